"""Fewer, larger all-reduces: small tensors packed into one per dtype.

Every all-reduce has a fixed cost (ops to launch, copies to schedule) that a
small tensor never amortizes: a model's biases, norms and Keras's per-step
metric totals cost more in overhead than in bytes. So the small values of a
batch all-reduce (as optimizers and Keras issue them) are flattened and
concatenated on each replica, reduced once, and split back; large values are
reduced as they are (copying them into a buffer would cost more than it saves).
Between workers, large values are packed too (`packed_all_reduce`): there each
collective costs round trips over the network whatever its size.

A buffer holds at most `BUCKET_BYTES` (per replica; a
`tf.distribute.experimental.CommunicationOptions(bytes_per_pack=...)` sets
another), filled in the values' order, so a model of many small weights gets
several buffers, each of neighbouring layers. In a traced step each buffer's
all-reduce then waits only for its own gradients and runs while the backward
pass computes the earlier layers' (DDP's gradient buckets; large values,
reduced alone, overlap so already).

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> bias = strategy.run(lambda: tf.ones([3]))
>>> scale = strategy.run(lambda: tf.ones([2]))
>>> to_reduce, unpack = pack([bias, scale])  # one float32 buffer of 5
>>> [r.values[0].shape.as_list() for r in to_reduce]
[[5]]
>>> sum_op = tf.distribute.ReduceOp.SUM
>>> reduced = unpack([strategy.extended.reduce_to(sum_op, r, r)
...                   for r in to_reduce])
>>> [m.values[0].numpy().tolist() for m in reduced]
[[2.0, 2.0, 2.0], [2.0, 2.0]]
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

# Values at most this large (bytes, per replica) are packed.
SMALL_BYTES = 256 * 1024

# A packed buffer holds at most this many bytes per replica (DDP's default
# bucket).
BUCKET_BYTES = 25 * 1024 * 1024


def bucket_bytes(options):
  """A buffer's bytes: `options.bytes_per_pack` (a
  `tf.distribute.experimental.CommunicationOptions`) if set, else
  `BUCKET_BYTES`."""
  return getattr(options, "bytes_per_pack", 0) or BUCKET_BYTES


def _dense(tensor):
  return (tf.is_tensor(tensor) and
          not isinstance(tensor, (tf.IndexedSlices, tf.SparseTensor)))


def packable(value):
  """Whether `value` (a PerReplica) is a dense tensor small enough to pack."""
  if not isinstance(value, tfi.values.PerReplica):
    return False
  first = value.values[0]
  return (_dense(first) and first.shape.is_fully_defined() and
          first.shape.num_elements() * first.dtype.size <= SMALL_BYTES and
          all(v.shape == first.shape for v in value.values))


def buckets(tensors, bucket_bytes):
  """Indices of `tensors` to pack together: lists of neighbours of one dtype,
  each of at most `bucket_bytes`, of two or more; and the indices left alone.

  What is not a dense tensor of a fully defined shape (None, say) stays
  alone.
  """
  groups = []
  filling = {}  # dtype: (the bucket being filled, its bytes)
  for index, tensor in enumerate(tensors):
    if (len(tensors) == 1 or not _dense(tensor) or
        not tensor.shape.is_fully_defined()):
      continue
    size = tensor.shape.num_elements() * tensor.dtype.size
    bucket, filled = filling.get(tensor.dtype, (None, 0))
    if bucket is None or filled + size > bucket_bytes:
      bucket, filled = [], 0
      groups.append(bucket)
    bucket.append(index)
    filling[tensor.dtype] = (bucket, filled + size)
  groups = [bucket for bucket in groups if len(bucket) > 1]
  packed = {i for bucket in groups for i in bucket}
  return groups, [i for i in range(len(tensors)) if i not in packed]


def flat_concat(tensors):
  """`tensors` flattened and concatenated: one buffer."""
  return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def flat_split(buffer, shapes):
  """`flat_concat`'s inverse: tensors of `shapes` from one buffer."""
  pieces = tf.split(buffer, [s.num_elements() for s in shapes])
  return [tf.reshape(p, s) for p, s in zip(pieces, shapes)]


def packed_all_reduce(tensors, all_reduce, bucket_bytes=BUCKET_BYTES):
  """`all_reduce(list of tensors)` of `tensors` (on one device) through as
  few buffers as `buckets` allows; the results in the order given.

  Between workers each collective costs a round trip or two whatever its
  size, so every dense tensor is packed, large or small.
  """
  groups, alone = buckets(tensors, bucket_bytes)
  reduced = all_reduce([tensors[i] for i in alone] +
                       [flat_concat([tensors[i] for i in g]) for g in groups])
  out = [None] * len(tensors)
  for i, result in zip(alone, reduced):
    out[i] = result
  for indices, buffer in zip(groups, reduced[len(alone):]):
    for i, piece in zip(indices, flat_split(
        buffer, [tensors[i].shape for i in indices])):
      out[i] = piece
  return out


def pack(values, bucket_bytes=BUCKET_BYTES):
  """Groups packable `values` by dtype into flat PerReplica buffers.

  Each buffer holds neighbouring values (in the order given) of at most
  `bucket_bytes` per replica. Returns `(to_reduce, unpack)`: reduce each of
  `to_reduce` to its own devices and pass the results, in order, to
  `unpack`, which returns one Mirrored per input value, in the input order.
  """
  groups, alone = buckets(
      [value.values[0] if packable(value) else None for value in values],
      bucket_bytes)
  to_reduce = [values[i] for i in alone]
  for indices in groups:
    parts = []
    devices = [part.device for part in values[indices[0]].values]
    for replica, device in enumerate(devices):
      with tf.device(device):
        parts.append(flat_concat([values[i].values[replica] for i in indices]))
    to_reduce.append(tfi.distribute_utils.regroup(parts, always_wrap=True))

  def unpack(reduced):
    out = [None] * len(values)
    for i, result in zip(alone, reduced):
      out[i] = result
    for indices, buffer in zip(groups, reduced[len(alone):]):
      shapes = [values[i].values[0].shape for i in indices]
      per_replica = []
      parts = (buffer.values if isinstance(buffer, tfi.values.DistributedValues)
               else (buffer,))
      for part in parts:
        with tf.device(part.device):
          per_replica.append(flat_split(part, shapes))
      for k, i in enumerate(indices):
        out[i] = tfi.distribute_utils.regroup(
            [pieces[k] for pieces in per_replica],
            wrap_class=tfi.values.Mirrored)
    return out

  return to_reduce, unpack


def batch_reduce(cross_device_ops, reduce_op, values,
                 bucket_bytes=BUCKET_BYTES, options=None):
  """`cross_device_ops.batch_reduce` of the PerReplica `values`, each to its
  own devices, through the buffers `pack` makes; one Mirrored per value."""
  to_reduce, unpack = pack(values, bucket_bytes)
  return unpack(cross_device_ops.batch_reduce(
      reduce_op, [(v, v) for v in to_reduce], options=options))
