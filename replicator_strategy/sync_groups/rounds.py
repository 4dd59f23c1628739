"""Averaging rounds between sync groups: local SGD, and DiLoCo's outer step.

With `ReplicatorStrategy(sync_groups=G, average_every=H)` each group trains
on its own (`replicator_strategy.sync_groups.topology`); every H steps an
averaging round makes the weights of every replica of every group their
mean (local SGD; Lin et al., 2018), each group weighted by the rows it
trained on since the last round where its steps counted them
(`Averaging.count_rows`; Keras's `fit` does): with plain SGD averaging every
step that is synchronous training, an uneven last batch included. With
`outer_optimizer` the round instead
applies the averaged change since the last round, `old - mean`, through that
Keras optimizer as a gradient (DiLoCo; Douillard et al., 2023, arXiv:2311.08105):
`keras.optimizers.SGD(1.0)` gives the mean again, DiLoCo's choice is
`SGD(0.7, momentum=0.9, nesterov=True)`. Non-trainable float weights (batch
norm's moving statistics) are averaged in every round; optimizer slots stay
each group's own. With `SyncGroups(fragments=F)` each round takes the
fragments due (`fragments`), with `outer_dtype` it exchanges each group's
change at that width (`quantized`); together, each fragment's round sends
that fragment's change (Streaming DiLoCo with a low-bit exchange). Between
rounds `first_group_everywhere` reads one model (`first_group`).

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

import functools

import tensorflow as tf

from replicator_strategy import replica_context as replica_context_lib
from replicator_strategy import variables as variables_lib
from replicator_strategy.collectives import per_replica
from replicator_strategy.sync_groups import first_group
from replicator_strategy.sync_groups import fragments as fragments_lib
from replicator_strategy.sync_groups import means as means_lib
from replicator_strategy.sync_groups import quantized
from replicator_strategy.sync_groups import state as state_lib


class Averaging:
  """Averaging rounds of `strategy`'s sync groups, every `average_every` steps.

  `outer_optimizer`: None, or a Keras optimizer applying `old - mean` to the
  trainable weights (`old`: their value at the last round, its anchor). It
  was made before the strategy, outside its scope, so the rounds step a
  copy made in the scope from its config: `outer_optimizer` here.

  `overlap`: a scheduled round (`scheduled_round`) only snapshots the
  trainable weights and starts their exchange in a thread, which runs while
  the groups take the next steps; the next round applies it, one round late,
  as Streaming DiLoCo does: each replica's weights become the round's target
  (the snapshots' mean, or the outer step from it) plus the replica's own
  progress since its snapshot. Non-trainable weights average at once.

  Rows: a round weighs each replica by the rows its steps counted since the
  last round (`count_rows`), so a group that trained on more rows counts
  more; with none counted (a custom loop that does not count), equally.

  `outer_dtype`: None, or the width a round sends each group's change of
  the trainable weights at (`low_bit`, a `quantized.LowBitExchange`).

  `fragments`: how many of Streaming DiLoCo's (`fragments.Fragments`); a
  fragment's round sends its weights only (at `outer_dtype`, each weight
  with its own residual).

  `state`: what a checkpoint keeps of it (`state.SyncGroupsState`).
  """

  def __init__(self, strategy, average_every, outer_optimizer=None,
               overlap=False, outer_dtype=None, fragments=1):
    self._strategy = strategy
    self.average_every = average_every
    self.overlap = overlap
    # ids of the trainable variables -> their snapshots and the functions of
    # an overlapped round.
    self._overlapped = {}
    self.fragments = fragments_lib.Fragments(fragments, average_every, overlap)
    self._outer = fragments_lib.outer_copies(strategy, outer_optimizer, fragments)
    self.outer_optimizer = self._outer[0] if self._outer else None
    self.state = state_lib.SyncGroupsState(
        self.outer_optimizer, self._outer[1:], self.fragments.in_flight)
    self.low_bit = quantized.LowBitExchange.of(strategy, outer_dtype,
                                               self.state)
    self._anchors = {}  # id of a trainable variable -> its value at the last round.
    self._rounds = {}  # ids of the variables -> the round's tf.function.
    self._first_group = first_group.FirstGroup(strategy)
    # What passed between the groups: rounds, and the bytes each sent
    # (`quantized.bytes_sent`: float32 weights whole, low-bit changes).
    self.rounds = 0
    self.bytes_averaged = 0

  def start(self, trainable):
    """Makes the rounds' state for the `trainable` weights, once per
    variable: the rows' counters; with an outer optimizer, their anchors
    (their values now: the groups must agree, before training or after a
    round) and its slots; with overlap, their snapshots. Made after a
    checkpoint was read, TF restores them as they are made."""
    if self._strategy.num_sync_groups > 1 and self.state.rows is None:
      self.state.rows = self._row_counter("sync_groups_rows")
      if self.overlap:
        self.state.snapshot_rows = self._row_counter(
            "sync_groups_snapshot_rows")
    if self._strategy.num_sync_groups > 1:
      self.fragments.split(trainable)  # Checks the count once.
    if self.outer_optimizer is not None or self.low_bit:
      self._start_anchors(trainable)
    if self.overlap and self._strategy.num_sync_groups > 1:
      for part in self.fragments.split(trainable):
        self._overlapped_functions(part)

  def _row_counter(self, name):
    """A count per replica, saved with every replica's (`ReplicaSum`)."""
    def replica_sum(next_creator, **kwargs):
      kwargs[variables_lib.REPLICA_SUM] = True
      return next_creator(**kwargs)

    with self._strategy.scope(), tf.variable_creator_scope(replica_sum):
      return tf.Variable(0.0, trainable=False, name=name,
                         synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM)

  def count_rows(self):
    """In a replica's training step: adds its rows (the leading dimension of
    the first tensor given to `strategy.run`, `ReplicaContext.batch_rows`)
    to what the next round weighs it by. Keras's `fit` calls it; a custom
    loop whose groups may see unequal rows calls it in its step, after
    `strategy.sync_groups_step(0, ...)`."""
    if self._strategy.num_sync_groups == 1:
      return
    if self.state.rows is None:
      raise ValueError(
          "Rows are counted into variables made before the first step: call "
          "strategy.sync_groups_step(0, trainable_variables) before it.")
    ctx = tf.distribute.get_replica_context()
    rows = (ctx.batch_rows()
            if isinstance(ctx, replica_context_lib.ReplicaContext) else None)
    if rows is None:
      raise ValueError(
          "count_rows() counts the rows of the first tensor given to "
          "strategy.run; call it inside strategy.run(step, args=(batch,)) "
          "with a batch of rank 1 or more.")
    self.state.rows.assign_add(tf.cast(rows.count, tf.float32))

  def _start_anchors(self, trainable):
    new = [v for v in trainable if id(v) not in self._anchors]
    if not new:
      return
    with self._strategy.scope():
      for v in new:
        self._anchors[id(v)] = _copy_beside(means_lib.tf_variable(v),
                                            "sync_groups_anchor")
        self.state.anchors.append(self._anchors[id(v)])
        if self.low_bit:
          self.low_bit.keep(self._anchors[id(v)], _copy_beside(
              means_lib.tf_variable(v), "sync_groups_residual", tf.zeros_like))
      self.fragments.build(self._outer, trainable)

  def first_group_everywhere(self, variables):
    """`first_group.FirstGroup.everywhere`: one model between rounds."""
    return self._first_group.everywhere(variables)

  def rounds_due(self, last_step, step):
    """Whether a round of a fragment (of every weight: at a multiple of
    `average_every`) falls at a step in (last_step, step]."""
    return bool(self.fragments.due(last_step, step))

  def scheduled_round(self, trainable, non_trainable=(), steps=None):
    """The round due after the steps (last_step, step] (None: all
    fragments'): `average` of the fragments due, or an overlapped one each;
    returns the trainable weights it left equal on every replica."""
    parts = self.fragments.due_parts(trainable, steps)
    if self.overlap and self._strategy.num_sync_groups > 1:
      for part in parts:
        self._overlapped_round(part, means_lib.floats(non_trainable))
      return []
    trainable = [v for part in parts for v in part]
    self.average(trainable, non_trainable)
    return trainable

  def average(self, trainable, non_trainable=()):
    """One round now: every replica of every group gets the mean (or the
    outer optimizer's step from the mean) of `trainable`, and the mean of
    the float variables among `non_trainable`. Call it eagerly. An
    overlapped exchange still in flight is applied first."""
    if self._strategy.num_sync_groups == 1:
      return
    trainable = list(trainable)
    non_trainable = means_lib.floats(non_trainable)
    self._check_anchors(trainable)
    self._apply_pending(trainable)
    self._run_round(trainable, non_trainable, restart_rows=True)
    self._count(trainable, non_trainable)

  def _run_round(self, trainable, non_trainable, restart_rows):
    """The round of `trainable` and `non_trainable`, weighted by the rows
    counted; `restart_rows`: then counts from zero."""
    key = (tuple(id(v) for v in trainable + non_trainable), restart_rows)
    if key not in self._rounds:
      self._rounds[key] = tf.function(
          lambda: self._round(trainable, non_trainable, restart_rows),
          autograph=False)
    with self._strategy.scope():
      self._rounds[key]()

  def _count(self, trainable, non_trainable):
    self.rounds += 1
    self.bytes_averaged += quantized.bytes_sent(
        self.low_bit, *([means_lib.tf_variable(v) for v in variables]
                        for variables in (trainable, non_trainable)))

  def _check_anchors(self, trainable):
    if self.outer_optimizer is not None or self.low_bit:
      missing = [v.name for v in trainable if id(v) not in self._anchors]
      if missing:
        raise ValueError(
            f"With an `outer_optimizer` or `outer_dtype`, the weights' values "
            f"before the first round are kept, but these weights were not "
            f"given before training: {missing}. Call "
            f"strategy.sync_groups_step(0, trainable_variables) before the "
            f"first step (Keras's fit does).")

  def _round(self, trainable, non_trainable, restart_rows):
    variables = [means_lib.tf_variable(v) for v in trainable + non_trainable]
    low_bit = len(trainable) if self.low_bit else 0
    means = means_lib.weighted(self._strategy, variables[low_bit:],
                               self.state.rows)
    if self.low_bit:  # The trainable weights' changes, at its width.
      means = self.low_bit.means(
          self._strategy.extended.communicator, variables[:low_bit],
          [self._anchors[id(v)] for v in trainable],
          means_lib.replica_weights(self._strategy, self.state.rows)
      ) + means
    for v, mean in zip(variables[len(trainable):], means[len(trainable):]):
      means_lib.assign_pieces(v, mean)
    self._step_to(trainable, means[:len(trainable)])
    if restart_rows:
      _restart(self.state.rows)

  def _step_to(self, trainable, means):
    """Sets `trainable` to `means` (each a list of its pieces', each a tensor
    or a `Mirrored`), or, with an outer optimizer, to its step from them;
    keeps them as `old`."""
    variables = [means_lib.tf_variable(v) for v in trainable]
    if self.outer_optimizer is None:
      for v, mean in zip(variables, means):
        means_lib.assign_pieces(v, mean)
      for v, weight in zip(trainable, variables):
        if id(v) in self._anchors:  # Each group's change counts from here.
          _copy_components(weight, self._anchors[id(v)])
      return
    deltas = []
    for v, weight, mean in zip(trainable, variables, means):
      anchor = self._anchors[id(v)]
      deltas.append(_delta(anchor, mean))
      _copy_components(anchor, weight)
    self.fragments.apply(self._outer, deltas, trainable)
    for v, weight in zip(trainable, variables):
      _copy_components(weight, self._anchors[id(v)])

  def _overlapped_round(self, trainable, non_trainable):
    self._check_anchors(trainable)
    self._apply_pending(trainable)
    if non_trainable:
      # The snapshots take the rows and count from zero.
      self._run_round([], non_trainable, restart_rows=False)
    snapshots, take_snapshots, exchange, _ = self._overlapped_functions(
        trainable)
    with self._strategy.scope():
      take_snapshots()
      # Traced here, not in the thread: a trace numbers its collectives
      # (`collective_watchdog.signature_code`), which every worker must do
      # in the same order, the program's.
      exchange = exchange.get_concrete_function()
    self.state.exchange.start(tuple(id(v) for v in trainable),
                              functools.partial(self._in_scope, exchange))
    self.fragments.started(trainable)
    self._count(snapshots, non_trainable)

  def _apply_pending(self, trainable):
    """Waits for the exchange in flight, if any, and applies it."""
    if not self.state.exchange.in_flight:
      return
    trainable = self.fragments.pending(trainable)
    _, _, exchange, apply = self._overlapped_functions(trainable)
    means = self.state.exchange.take(
        tuple(id(v) for v in trainable),
        functools.partial(self._in_scope, exchange))
    self._in_scope(apply, means)

  def _in_scope(self, function, *args):
    with self._strategy.scope():
      return function(*args)

  def _overlapped_functions(self, trainable):
    """(snapshots, take them, exchange them, apply the exchanged means) for
    `trainable`, made once."""
    key = tuple(id(v) for v in trainable)
    if key not in self._overlapped:
      variables = [means_lib.tf_variable(v) for v in trainable]
      with self._strategy.scope():
        snapshots = [_copy_beside(v, "sync_groups_snapshot")
                     for v in variables]
      self.state.snapshots.extend(snapshots)

      def take_snapshots():
        pairs = list(zip(variables, snapshots))
        if self.state.rows is not None:
          pairs.append((self.state.rows, self.state.snapshot_rows))
        for v, snapshot in pairs:
          for component, kept in zip(v.values, snapshot.values):
            kept.assign(component.read_value())
        _restart(self.state.rows)

      def exchange():
        # Every replica agrees on each mean: the first part is everyone's.
        return [[per_replica.parts(piece)[0] for piece in mean]
                for mean in means_lib.weighted(self._strategy, snapshots,
                                               self.state.snapshot_rows)]

      def apply(means):
        progress = [[c.read_value() - s.read_value()
                     for c, s in zip(v.values, snapshot.values)]
                    for v, snapshot in zip(variables, snapshots)]
        self._step_to(trainable, means)
        for v, own in zip(variables, progress):
          for component, delta in zip(v.values, own):
            component.assign_add(delta)

      self._overlapped[key] = (
          snapshots, *(tf.function(f, autograph=False)
                       for f in (take_snapshots, exchange, apply)))
    return self._overlapped[key]


def _copy_beside(variable, name, value_of=lambda value: value):
  """A new variable of `value_of(variable's value)`, on its devices and
  split or sharded as it is (in the strategy's scope)."""
  with tf.distribute.get_strategy().extended.colocate_vars_with(variable):
    return tf.Variable(lambda: value_of(variable.read_value()),
                       trainable=False, name=name)


def _copy_components(source, target):
  """Each component of `target` set to `source`'s on its device (made by
  `_copy_beside`)."""
  for kept, component in zip(source.values, target.values):
    component.assign(kept.read_value())


def _delta(anchor, means):
  """`old - mean` of the whole weight, from its anchor and its pieces'
  means (every replica agrees on both: the first one's is everyone's)."""
  return variables_lib.whole_from_pieces(anchor, [
      piece[0][0].read_value() - per_replica.parts(mean)[0]
      for piece, mean in zip(variables_lib.round_pieces(anchor), means)])


def _restart(rows):
  """Every local replica's count of `rows` (if any) back to zero."""
  if rows is not None:
    for component in rows.values:
      component.assign(tf.zeros_like(component))
