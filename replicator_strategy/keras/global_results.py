"""Metrics and `predict`'s rows as one device has them, across replicas and workers.

- Per-batch logs (the progress bar, `on_*_batch_end` callbacks, the return of
  `train_on_batch`) are averages of each replica's *local* metric results,
  which differ from the global values for anything but equal local batches
  and linear metrics. Here the metric variables are summed across replicas
  first (one batched all-reduce per step) and the results computed from the
  sums, exactly as one device would. With sync groups a train step's logs
  sum over this worker's groups only (`train_step_logs_local`), so that no
  group waits on another worker between rounds; an epoch's logs (History,
  `on_epoch_end`), read outside the step, and `evaluate`'s sum over every
  group.
- Across workers, `predict` concatenates this worker's replicas only (Keras
  gathers every worker's rows for MultiWorkerMirroredStrategy alone). Here
  every worker gets all rows, in order.
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import replicas
from replicator_strategy import strategy as strategy_lib


_step = threading.local()  # Each replica runs its step in its own thread.


@contextlib.contextmanager
def train_step_logs_local():
  """In here (a replica's train step), metric results sum over this
  worker's sync groups, not every worker's."""
  _step.local = True
  try:
    yield
  finally:
    _step.local = False


def global_metrics_result(get_metrics_result):

  @functools.wraps(get_metrics_result)
  def wrapper(self):
    if not replicas.in_our_replicas():
      return get_metrics_result(self)
    ctx = tf.distribute.get_replica_context()
    variables = [v for metric in self.metrics for v in metric.variables]
    if not variables:
      return get_metrics_result(self)
    # Keras metric state is additive (totals, counts, confusion entries);
    # with sync groups, summed over every group's replicas, as one device's,
    # or in a train step over this worker's.
    reduce = (ctx.all_reduce_local_groups if getattr(_step, "local", False)
              else ctx.all_reduce_all_groups)
    summed = reduce("sum", [tf.convert_to_tensor(v) for v in variables])
    with keras.StatelessScope(state_mapping=list(zip(variables, summed))):
      return get_metrics_result(self)

  return wrapper


def concat_across_workers(reduce_per_replica):

  @functools.wraps(reduce_per_replica)
  def wrapper(values, strategy, reduction):
    if not (reduction == "concat" and
            isinstance(strategy, strategy_lib.ReplicatorStrategy) and
            strategy.extended.num_workers > 1):
      return reduce_per_replica(values, strategy, reduction)
    if strategy.extended.deals_worker_slices:
      # Each worker held its replicas' contiguous parts: in replica order.
      return tf.nest.map_structure(lambda v: strategy.gather(v, axis=0),
                                   values)
    # Keras's own gather-and-reorder for MultiWorkerMirroredStrategy fits
    # the input layout, which is the same TF input pipeline.
    every_replica = _EveryGroup(strategy)
    return tf.nest.map_structure(
        lambda v: ki.multi_worker_concat(v, every_replica),
        values)

  return wrapper


class _EveryGroup:
  """`strategy` with every replica of every sync group counted in sync: the
  replicas a batch was split among, which Keras's gather cuts its rows by."""

  def __init__(self, strategy):
    self._strategy = strategy

  @property
  def num_replicas_in_sync(self):
    return self._strategy.extended.num_replicas_in_all_groups

  def __getattr__(self, name):
    return getattr(self._strategy, name)
