"""Where a replica's rows lie in the global batch: `ReplicaContext.batch_rows()`.

Rows are the leading dimension of the first tensor given to `strategy.run`;
the global batch is every replica's rows in replica order, as one device
sees them (with sync groups: the group's rows, which the group trains on).
Keras's loss scaling weights a replica's loss gradient by `count / total`;
random layers draw those rows' values.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> def rows(batch):
...   return tf.distribute.get_replica_context().batch_rows()
>>> batch = strategy.experimental_distribute_values_from_function(
...     lambda ctx: tf.zeros([ctx.replica_id_in_sync_group + 2, 3]))
>>> [[int(t) for t in r] for r in strategy.experimental_local_results(
...     strategy.run(rows, args=(batch,)))]
[[0, 2, 5], [2, 3, 5]]
"""

import collections

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import per_replica

BatchRows = collections.namedtuple("BatchRows", ["first", "count", "total"])
BatchRows.__doc__ = """A replica's rows in the global batch: the `count` rows from
row `first` on, of `total` rows (every replica's, in replica order)."""


def _first_leaf(inputs):
  """The first tensor of rank 1 or more in `inputs`, or None."""
  return next((t for t in tf.nest.flatten(inputs)
               if tf.is_tensor(t) and t.shape.rank != 0), None)


def _own_counts(replica_ids, leaves, num_replicas):
  """A float32 vector of `num_replicas`: the rows of each of `leaves` at its
  replica's id, zeros elsewhere."""
  # Counts travel as float32, exact below 2**24 rows: the all-reduce every
  # path (merge, control flow, workers, GPUs) already carries.
  return tf.add_n([
      tf.one_hot(replica, num_replicas,
                 on_value=tf.cast(tf.shape(leaf)[0], tf.float32))
      for replica, leaf in zip(replica_ids, leaves)])


def _rows_from(counts, replica, count):
  counts = tf.cast(counts, tf.int64)
  return BatchRows(first=tf.reduce_sum(counts[:replica]), count=count,
                   total=tf.reduce_sum(counts))


class WorkerCounts:
  """Every replica's rows across workers, exchanged when a step first asks.

  A collective between workers is never pruned from a traced step, so the
  counts are exchanged only where a replica asks for its rows (Keras's loss
  scaling, random layers), once per traced step: this worker's replicas'
  counts, from the step's inputs, go in one all-reduce between the workers,
  built where `strategy.run` is traced (so a `tf.cond` branch that asks
  captures it). No replica merges for it: the replica threads never take
  turns there, and a step that asks for no rows exchanges nothing.
  """

  def __init__(self, extended, args, kwargs):
    self._extended = extended
    self._leaves = [
        _first_leaf(tfi.distribute_utils.select_replica(i, (args, kwargs)))
        for i in range(len(extended.worker_devices))]
    self._home_graph = tf.compat.v1.get_default_graph()
    self._counts = None

  @classmethod
  def for_step(cls, extended, args, kwargs):
    """The counts of a `strategy.run` traced across workers in one sync
    group; else None (the replicas count through `ReplicaContext.all_reduce`,
    pruned when unused in one process, and eager steps count at once)."""
    if (tf.executing_eagerly() or extended.num_workers == 1 or
        extended.num_sync_groups > 1):
      return None
    return cls(extended, args, kwargs)

  def counts(self, num_replicas):
    """Every replica's rows (of `num_replicas`, in replica order), or None
    without inputs of rank 1 or more."""
    if self._leaves[0] is None:
      return None
    if self._counts is None:
      communicator = self._extended.communicator
      first = self._extended.first_replica_id
      with self._home_graph.as_default(), tf.device(communicator.host_device):
        own = _own_counts(range(first, first + len(self._leaves)),
                          self._leaves, num_replicas)
        summed = communicator.reduce_plain(
            tf.distribute.ReduceOp.SUM, own, communicator.host_device, None)
        self._counts = per_replica.parts(summed)[0]
    return self._counts


class Counter:
  """Counts one replica's rows of `inputs` (what `strategy.run` was given),
  once per graph the replica traces in; across workers, from the step's
  `WorkerCounts` if it has one."""

  def __init__(self, inputs, worker_counts=None):
    self._inputs = inputs
    self._worker_counts = worker_counts
    self._by_graph = {}

  def rows(self, ctx):
    """The `BatchRows` of replica context `ctx`, or None if its inputs hold
    no tensor of rank 1 or more. One all-reduce per traced step (a vector of
    every replica's count) counts them."""
    graph = tf.compat.v1.get_default_graph()
    if graph not in self._by_graph:
      leaf = _first_leaf(self._inputs)
      rows = None
      if leaf is not None:
        count = tf.shape(leaf, out_type=tf.int64)[0]
        replica = ctx.replica_id_in_group
        if self._worker_counts is not None:
          counts = self._worker_counts.counts(ctx.num_replicas_in_sync)
        else:
          counts = ctx.all_reduce("sum", _own_counts(
              [replica], [leaf], ctx.num_replicas_in_sync))
        rows = _rows_from(counts, replica, count)
      self._by_graph[graph] = rows
    return self._by_graph[graph]
