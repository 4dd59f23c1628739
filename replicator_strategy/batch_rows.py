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

BatchRows = collections.namedtuple("BatchRows", ["first", "count", "total"])
BatchRows.__doc__ = """A replica's rows in the global batch: the `count` rows from
row `first` on, of `total` rows (every replica's, in replica order)."""


class Counter:
  """Counts one replica's rows of `inputs` (what `strategy.run` was given),
  once per graph the replica traces in."""

  def __init__(self, inputs):
    self._inputs = inputs
    self._by_graph = {}

  def rows(self, ctx):
    """The `BatchRows` of replica context `ctx`, or None if its inputs hold
    no tensor of rank 1 or more. One all-reduce per traced step (a vector of
    every replica's count) counts them."""
    graph = tf.compat.v1.get_default_graph()
    if graph not in self._by_graph:
      leaves = [t for t in tf.nest.flatten(self._inputs)
                if tf.is_tensor(t) and t.shape.rank != 0]
      rows = None
      if leaves:
        count = tf.shape(leaves[0], out_type=tf.int64)[0]
        replica = ctx.replica_id_in_group
        # Counts travel as float32, exact below 2**24 rows: the all-reduce
        # every path (merge, control flow, workers, GPUs) already carries.
        own = tf.one_hot(replica, ctx.num_replicas_in_sync,
                         on_value=tf.cast(count, tf.float32))
        counts = tf.cast(ctx.all_reduce("sum", own), tf.int64)
        rows = BatchRows(first=tf.reduce_sum(counts[:replica]), count=count,
                         total=tf.reduce_sum(counts))
      self._by_graph[graph] = rows
    return self._by_graph[graph]
