"""The replica context's collectives where the replicas meet, in `merge_call`.

Each function here is a merge function's body: it runs once, in
cross-replica context, on per-replica values (one per tensor the replicas
exchange) and returns each one's result for every replica, through the
strategy's `extended` (its reductions) or its `communicator` (gathers,
reduce-scatters, all-to-alls). Inside control flow the same collectives are
launched by each replica instead (`replica_collectives`).
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import checks


def has_indexed_slices(value):
  """Whether the structure `value` holds a `tf.IndexedSlices`."""
  return any(isinstance(v, tf.IndexedSlices) for v in tf.nest.flatten(value))


def all_reduce(strategy, values, op, options):
  """SUM or MEAN of each of `values` onto its replicas' devices."""
  return strategy.extended.batch_reduce_to(
      op.to_tf(), [(v, _destination(v)) for v in values], options)


def reduce_extremum(strategy, values, op):
  """MIN or MAX of each of `values` over every replica."""
  return [strategy.extended.reduce_extremum_to(op, v, destinations=v)
          for v in values]


def broadcast_from(strategy, values, source_replica_id):
  """The source's value everywhere: a sum in which only the source counts.

  The source may be on another worker, so this is an all-reduce, not a copy.
  """
  extended = strategy.extended
  n = strategy.num_replicas_in_sync
  out = []
  for value in values:
    masked = [
        part if (extended.first_replica_id + i) % n == source_replica_id else
        tf.zeros_like(part)
        for i, part in enumerate(strategy.experimental_local_results(value))
    ]
    out.append(extended.reduce_to(
        tf.distribute.ReduceOp.SUM,
        tfi.distribute_utils.regroup(masked, always_wrap=True),
        destinations=value))
  return out


def all_gather(strategy, values, paths, axis, options):
  """Each of `values` (at `paths` of the value given) concatenated over
  every replica along `axis`, their shapes checked first."""
  checks.check_gatherable(strategy, values, paths, axis)
  return [strategy.extended.communicator.all_gather(v, axis, options)
          for v in values]


def reduce_scatter(strategy, values, op, axes):
  """Slice r of each of `values` reduced with `op`, on replica r."""
  return [strategy.extended.communicator.reduce_scatter(v, op, a)
          for v, a in zip(values, axes)]


def all_to_all(strategy, values, split_axes, concat_axes):
  """Slice j of each replica's value of each of `values` to replica j."""
  return [strategy.extended.communicator.all_to_all(v, s, c)
          for v, s, c in zip(values, split_axes, concat_axes)]


def _destination(value):
  """Where a merge_call's reduction of `value` goes, as TF's all_reduce says:
  its replicas' devices, or a one-replica value's own device."""
  return value.device if isinstance(value, tf.Tensor) else value
