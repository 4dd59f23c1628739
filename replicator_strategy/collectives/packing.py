"""Fewer, larger all-reduces: small tensors packed into one per dtype.

Every all-reduce has a fixed cost (ops to launch, copies to schedule) that a
small tensor never amortizes: a model's biases, norms and Keras's per-step
metric totals cost more in overhead than in bytes. So the small values of a
batch all-reduce (as optimizers and Keras issue them) are flattened and
concatenated on each replica, reduced once, and split back; large values are
reduced as they are (copying them into a buffer would cost more than it saves).

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


def packable(value):
  """Whether `value` (a PerReplica) is a dense tensor small enough to pack."""
  if not isinstance(value, tfi.values.PerReplica):
    return False
  first = value.values[0]
  return (tf.is_tensor(first) and
          not isinstance(first, (tf.IndexedSlices, tf.SparseTensor)) and
          first.shape.is_fully_defined() and
          first.shape.num_elements() * first.dtype.size <= SMALL_BYTES and
          all(v.shape == first.shape for v in value.values))


def pack(values, bucket_bytes=BUCKET_BYTES):
  """Groups packable `values` by dtype into flat PerReplica buffers.

  Each buffer holds neighbouring values (in the order given) of at most
  `bucket_bytes` per replica. Returns `(to_reduce, unpack)`: reduce each of
  `to_reduce` to its own devices and pass the results, in order, to
  `unpack`, which returns one Mirrored per input value, in the input order.
  """
  buckets = []  # Indices of the values packed together, one list per buffer.
  filling = {}  # dtype: (the bucket being filled, its bytes)
  for index, value in enumerate(values):
    if not packable(value) or len(values) == 1:
      continue
    first = value.values[0]
    size = first.shape.num_elements() * first.dtype.size
    bucket, filled = filling.get(first.dtype, (None, 0))
    if bucket is None or filled + size > bucket_bytes:
      bucket, filled = [], 0
      buckets.append(bucket)
    bucket.append(index)
    filling[first.dtype] = (bucket, filled + size)
  groups = [bucket for bucket in buckets if len(bucket) > 1]
  packed_indices = {i for ix in groups for i in ix}
  alone = [i for i in range(len(values)) if i not in packed_indices]
  to_reduce = [values[i] for i in alone]
  for indices in groups:
    parts = []
    devices = [part.device for part in values[indices[0]].values]
    for replica, device in enumerate(devices):
      with tf.device(device):
        parts.append(tf.concat(
            [tf.reshape(values[i].values[replica], [-1]) for i in indices], 0))
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
          pieces = tf.split(part, [s.num_elements() for s in shapes])
          per_replica.append([tf.reshape(p, s) for p, s in zip(pieces, shapes)])
      for k, i in enumerate(indices):
        out[i] = tfi.distribute_utils.regroup(
            [pieces[k] for pieces in per_replica],
            wrap_class=tfi.values.Mirrored)
    return out

  return to_reduce, unpack
