"""Fewer, larger all-reduces: small tensors packed into one per dtype.

Every all-reduce has a fixed cost (ops to launch, copies to schedule) that a
small tensor never amortizes: a model's biases, norms and Keras's per-step
metric totals cost more in overhead than in bytes. So the small values of a
batch all-reduce (as optimizers and Keras issue them) are flattened and
concatenated on each replica, reduced once, and split back; large values are
reduced as they are (copying them into a buffer would cost more than it saves).

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


def pack(values):
  """Groups packable `values` by dtype into flat PerReplica buffers.

  Returns `(to_reduce, unpack)`: reduce each of `to_reduce` to its own devices
  and pass the results, in order, to `unpack`, which returns one Mirrored per
  input value, in the input order.
  """
  groups = {}  # dtype: indices of the values packed together
  for index, value in enumerate(values):
    if packable(value) and len(values) > 1:
      groups.setdefault(value.values[0].dtype, []).append(index)
  groups = {d: ix for d, ix in groups.items() if len(ix) > 1}
  packed_indices = {i for ix in groups.values() for i in ix}
  alone = [i for i in range(len(values)) if i not in packed_indices]
  to_reduce = [values[i] for i in alone]
  for indices in groups.values():
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
    for indices, buffer in zip(groups.values(), reduced[len(alone):]):
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
