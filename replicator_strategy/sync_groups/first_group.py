"""One model between rounds: the first group's weights on every replica.

Between the averaging rounds of sync groups (`rounds.Averaging`) each group
holds its own weights. While a prediction, an evaluation or a save reads
them (Keras's `predict`, `evaluate`, `get_weights`, `save`: through
`keras/sync_group_rounds.py`), `FirstGroup.everywhere` gives every replica
the first group's value, so they answer with one model, and gives each
replica its own back after.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(sync_groups=2, average_every=4)
>>> with strategy.scope():
...   v = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
>>> def own_value():  # each group's mean, its own until a round
...   ctx = tf.distribute.get_replica_context()
...   v.assign(tf.cast(ctx.replica_id_in_sync_group, tf.float32))
>>> strategy.run(own_value)
>>> with FirstGroup(strategy).everywhere([v]):
...   [float(x) for x in strategy.experimental_local_results(v)]
[0.5, 0.5, 0.5, 0.5]
>>> [float(x) for x in strategy.experimental_local_results(v)]
[0.5, 0.5, 2.5, 2.5]
"""

import contextlib

import tensorflow as tf

from replicator_strategy import variables as variables_lib
from replicator_strategy.sync_groups import means as means_lib


class FirstGroup:
  """The first group's weights on every replica of `strategy`'s groups."""

  def __init__(self, strategy):
    self._strategy = strategy
    self._functions = {}  # ids of the variables -> its tf.function.

  @contextlib.contextmanager
  def everywhere(self, variables):
    """While inside, every replica holds the first group's value of each
    float variable among `variables` (what `get_weights` reads and a save
    writes), so a prediction between rounds answers with one model; each
    replica's own value after. Call it eagerly."""
    variables = [means_lib.tf_variable(v) for v in means_lib.floats(variables)
                 if isinstance(means_lib.tf_variable(v),
                               tf.distribute.DistributedValues)]
    if self._strategy.num_sync_groups == 1 or not variables:
      yield
      return
    own = [variables_lib.local_reads(v) for v in variables]
    key = tuple(id(v) for v in variables)
    if key not in self._functions:
      self._functions[key] = tf.function(lambda: self._assign(variables),
                                         autograph=False)
    with self._strategy.scope():
      self._functions[key]()
    try:
      yield
    finally:
      for v, values in zip(variables, own):
        for component, value in zip(v.values, values):
          component.assign(value)

  def _assign(self, variables):
    # A sum in which only the first replica of all counts: it may lie on
    # another worker.
    first = self._strategy.extended.first_replica_id
    sums = means_lib.reduce_pieces(
        self._strategy, tf.distribute.ReduceOp.SUM, variables,
        lambda value, replicas: value if first + replicas[0] == 0 else
        tf.zeros_like(value))
    for v, value in zip(variables, sums):
      means_lib.assign_pieces(v, value)
