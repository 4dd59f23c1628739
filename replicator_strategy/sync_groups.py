"""Averaging rounds between sync groups: local SGD, and DiLoCo's outer step.

With `ReplicatorStrategy(sync_groups=G, average_every=H)` each group trains
on its own (`replicator_strategy.collectives.sync_groups`); every H steps an
averaging round makes the weights of every replica of every group their
mean (local SGD; Lin et al., 2018). With `outer_optimizer` the round instead
applies the averaged change since the last round, `old - mean`, through that
Keras optimizer as a gradient (DiLoCo; Douillard et al., 2023, arXiv:2311.08105):
`keras.optimizers.SGD(1.0)` gives the mean again, DiLoCo's choice is
`SGD(0.7, momentum=0.9, nesterov=True)`. Non-trainable float weights (batch
norm's moving statistics) are averaged in every round; optimizer slots stay
each group's own.

`Averaging` is what the strategy holds; Keras's `fit` calls it after each
step (`replicator_strategy.keras.sync_group_rounds`), a custom loop through
`ReplicatorStrategy.average_sync_groups` and `sync_groups_step`.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(sync_groups=2, average_every=4)
>>> with strategy.scope():
...   v = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
>>> def own_value():  # each group's mean, its own until a round
...   ctx = tf.distribute.get_replica_context()
...   v.assign(tf.cast(ctx.replica_id_in_sync_group, tf.float32))
>>> strategy.run(own_value)
>>> [float(x) for x in strategy.experimental_local_results(v)]
[0.5, 0.5, 2.5, 2.5]
>>> strategy.sync_groups_step(4, [v])  # step 4 of average_every=4: a round
True
>>> [float(x) for x in strategy.experimental_local_results(v)]
[1.5, 1.5, 1.5, 1.5]
"""

import numbers

import tensorflow as tf

from replicator_strategy.collectives import per_replica


def check_arguments(sync_groups, average_every, outer_optimizer):
  """Refuses a bad `sync_groups`, `average_every` or `outer_optimizer`."""
  for name, value in (("sync_groups", sync_groups),
                      ("average_every", average_every)):
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or
        value < 1):
      raise ValueError(
          f"Expected `{name}` to be an int of at least 1. Received: "
          f"{name}={value!r}. " + (
              "Pass the number of groups the replicas form (1: all "
              "synchronous)." if name == "sync_groups" else
              "Pass how many steps each group takes between averaging "
              "rounds (1: every step)."))
  if outer_optimizer is None:
    return
  import keras  # pylint: disable=g-import-not-at-top  # Only to check the type.
  if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
    raise ValueError(
        f"Expected `outer_optimizer` to be None (plain averaging) or a Keras "
        f"optimizer, such as keras.optimizers.SGD(0.7, momentum=0.9, "
        f"nesterov=True) (DiLoCo's). Received: outer_optimizer="
        f"{outer_optimizer!r} of type {type(outer_optimizer).__name__}.")
  if sync_groups == 1:
    raise ValueError(
        f"`outer_optimizer` applies the change between sync groups' "
        f"averaging rounds, but sync_groups=1 has no rounds. Received: "
        f"outer_optimizer={outer_optimizer!r}. Pass sync_groups > 1, or "
        f"leave outer_optimizer out.")


def _tf_variable(variable):
  """The distributed TF variable behind `variable` (a Keras one: its value)."""
  return variable if isinstance(variable, tf.Variable) else variable.value


class Averaging:
  """Averaging rounds of `strategy`'s sync groups, every `average_every` steps.

  `outer_optimizer`: None, or a Keras optimizer applying `old - mean` to the
  trainable weights (`old`: their value at the last round, kept here). It
  was made before the strategy, outside its scope, so the rounds step a
  copy made in the scope from its config: `outer_optimizer` here.
  """

  def __init__(self, strategy, average_every, outer_optimizer=None):
    self._strategy = strategy
    self.average_every = average_every
    self.outer_optimizer = None
    if outer_optimizer is not None:
      with strategy.scope():
        self.outer_optimizer = type(outer_optimizer).from_config(
            outer_optimizer.get_config())
    self._anchors = {}  # id of a trainable variable -> its value at the last round.
    self._rounds = {}  # ids of the variables -> the round's tf.function.
    # What passed between the groups: rounds, and the bytes of one
    # replica's weights they averaged (each round's all-reduce input).
    self.rounds = 0
    self.bytes_averaged = 0

  @property
  def anchors(self):
    """The trainable weights' values at the last round (with an outer
    optimizer), to checkpoint with them: a list of variables."""
    return list(self._anchors.values())

  def start(self, trainable):
    """Keeps the `trainable` weights' values now as the last round's (with an
    outer optimizer; the groups must agree: before training, or after a round)
    and builds the outer optimizer. Once per variable."""
    if self.outer_optimizer is None:
      return
    new = [v for v in trainable if id(v) not in self._anchors]
    if not new:
      return
    with self._strategy.scope():
      for v in new:
        self._anchors[id(v)] = tf.Variable(
            _tf_variable(v).read_value(), trainable=False,
            name="sync_groups_anchor")
      if not self.outer_optimizer.built:
        self.outer_optimizer.build(list(trainable))

  def rounds_due(self, last_step, step):
    """Whether a multiple of `average_every` lies in (last_step, step]."""
    return step // self.average_every > last_step // self.average_every

  def average(self, trainable, non_trainable=()):
    """One round now: every replica of every group gets the mean (or the
    outer optimizer's step from the mean) of `trainable`, and the mean of
    the float variables among `non_trainable`. Call it eagerly."""
    if self._strategy.num_sync_groups == 1:
      return
    trainable = list(trainable)
    non_trainable = [v for v in non_trainable
                     if _tf_variable(v).dtype.is_floating]
    if self.outer_optimizer is not None:
      missing = [v.name for v in trainable if id(v) not in self._anchors]
      if missing:
        raise ValueError(
            f"With an `outer_optimizer`, the weights' values before the first "
            f"round are kept, but these weights were not given before "
            f"training: {missing}. Call strategy.sync_groups_step(0, "
            f"trainable_variables) before the first step (Keras's fit does).")
    key = tuple(id(v) for v in trainable + non_trainable)
    if key not in self._rounds:
      self._rounds[key] = tf.function(
          lambda: self._round(trainable, non_trainable), autograph=False)
    with self._strategy.scope():
      self._rounds[key]()
    self.rounds += 1
    self.bytes_averaged += sum(
        _tf_variable(v).shape.num_elements() * _tf_variable(v).dtype.size
        for v in trainable + non_trainable)

  def _round(self, trainable, non_trainable):
    variables = [_tf_variable(v) for v in trainable + non_trainable]
    means = self._means(variables)
    for v, mean in zip(variables[len(trainable):], means[len(trainable):]):
      v.assign(mean)
    if self.outer_optimizer is None:
      for v, mean in zip(variables, means[:len(trainable)]):
        v.assign(mean)
      return
    deltas = []
    for v, weight, mean in zip(trainable, variables, means):
      anchor = self._anchors[id(v)]
      # Every replica agrees on both: the first one's is everyone's.
      deltas.append(anchor.read_value() - per_replica.parts(mean)[0])
      weight.assign(anchor.read_value())
    self.outer_optimizer.apply_gradients(zip(deltas, trainable))
    for v, weight in zip(trainable, variables):
      self._anchors[id(v)].assign(weight.read_value())

  def _means(self, variables):
    """Each variable's mean over every replica of every group, a `Mirrored`."""
    everyone = self._strategy.extended.communicator.everyone
    values = []
    for v in variables:
      parts = []
      for component in v.values:
        with tf.device(component.device):
          parts.append(component.read_value())
      values.append(per_replica.wrap(parts))
    if not values:
      return []
    return everyone.cross_device_ops.batch_reduce(
        tf.distribute.ReduceOp.MEAN, [(p, p) for p in values])
