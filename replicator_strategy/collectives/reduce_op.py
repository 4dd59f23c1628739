"""Reduction operations: `tf.distribute.ReduceOp`'s SUM and MEAN, plus MIN and MAX.

`tf.distribute.ReduceOp` has only SUM and MEAN. ReplicatorStrategy accepts
those members unchanged, their string names, and this module's `ReduceOp`,
which adds MIN and MAX (TF-Replicator's vocabulary). Each op's ways of
combining (along an axis, of a list of parts, in TF's collective ops) and the
gradient of MIN/MAX live here.

>>> parse("max")
<ReduceOp.MAX: 'MAX'>
>>> parse(tf.distribute.ReduceOp.SUM)
<ReduceOp.SUM: 'SUM'>
"""

import enum

import tensorflow as tf


class ReduceOp(enum.Enum):
  """How values from all replicas are combined.

  Wherever a reduce op is taken, its string name ("max") does as well.

  >>> ReduceOp.MAX.is_extremum, ReduceOp.SUM.to_tf()
  (True, <ReduceOp.SUM: 'SUM'>)
  """
  SUM = "SUM"
  MEAN = "MEAN"
  MIN = "MIN"
  MAX = "MAX"

  def to_tf(self):
    """The `tf.distribute.ReduceOp` for SUM and MEAN; ValueError otherwise."""
    if self not in (ReduceOp.SUM, ReduceOp.MEAN):
      raise ValueError(f"{self} has no tf.distribute.ReduceOp equivalent.")
    return tf.distribute.ReduceOp(self.value)

  @property
  def is_extremum(self):
    return self in (ReduceOp.MIN, ReduceOp.MAX)

  @property
  def collective_merge_and_final_ops(self):
    """TF's collective all-reduce `merge_op` and `final_op` for this op."""
    return {
        ReduceOp.SUM: ("Add", "Id"),
        ReduceOp.MEAN: ("Add", "Div"),
        ReduceOp.MIN: ("Min", "Id"),
        ReduceOp.MAX: ("Max", "Id"),
    }[self]


def parse(op):
  """Returns the `ReduceOp` for a string, `tf.distribute.ReduceOp` or `ReduceOp`."""
  if isinstance(op, ReduceOp):
    return op
  if isinstance(op, tf.distribute.ReduceOp):
    return ReduceOp(op.value)
  if isinstance(op, str) and op.upper() in ReduceOp.__members__:
    return ReduceOp[op.upper()]
  raise ValueError(
      f"Expected a reduce op: one of 'sum', 'mean', 'min', 'max' (any case), "
      f"a tf.distribute.ReduceOp or a replicator_strategy.ReduceOp. "
      f"Received: {op!r}")


def reduce_parts(op, parts):
  """One tensor from several of the same shape: `op` over `parts`."""
  parts = [tf.convert_to_tensor(p) for p in parts]
  if op == ReduceOp.SUM:
    return tf.add_n(parts)
  return reduce_along(op, tf.stack(parts), 0)


def extremum_gradient(xs, ys, dys, sum_over_replicas):
  """Gradients of MIN/MAX `ys` = reduce(`xs`) over replicas, given `dys`.

  The upstream gradients, summed over replicas, go to the replicas holding
  the extremum, split evenly among ties. `sum_over_replicas(tensors)` is the
  SUM all-reduce of a list of tensors.
  """
  return route_to_extremum(xs, ys, sum_over_replicas(dys), sum_over_replicas)


def route_to_extremum(xs, ys, gradients, sum_over_replicas):
  """Sends `gradients` of MIN/MAX `ys` to the replicas whose `xs` equal them.

  `gradients` are every replica's upstream gradients of `ys`, already summed;
  ties split them evenly.
  """
  masks = [tf.cast(tf.equal(x, y), g.dtype)
           for x, y, g in zip(xs, ys, gradients)]
  ties = sum_over_replicas(masks)
  return [g * m / t for g, m, t in zip(gradients, masks, ties)]


def reduce_along(op, tensor, axis):
  """Reduces `tensor` along `axis` with `op` (axis 0 of a per-replica stack)."""
  return {
      ReduceOp.SUM: tf.reduce_sum,
      ReduceOp.MEAN: tf.reduce_mean,
      ReduceOp.MIN: tf.reduce_min,
      ReduceOp.MAX: tf.reduce_max,
  }[op](tensor, axis=axis)
