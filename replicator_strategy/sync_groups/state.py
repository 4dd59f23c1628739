"""What a checkpoint keeps of the averaging rounds between sync groups.

`SyncGroupsState` is `strategy.sync_groups_state`, saved beside the model
and its optimizer; `rounds.Averaging` makes and updates what it holds.
"""

import tensorflow as tf

from replicator_strategy.sync_groups import overlap


class SyncGroupsState(tf.Module):
  """What a checkpoint keeps of the rounds between sync groups.

  `strategy.sync_groups_state`: save it beside the model and its optimizer,
  `tf.train.Checkpoint(model=..., optimizer=..., sync_groups=...)`, and a
  run restored between rounds goes on exactly as it would have. It holds
  the outer optimizer's copy (`outer_optimizer`, with its momentum and
  iterations), the trainable weights' values at the last round (`anchors`,
  with an outer optimizer or `outer_dtype`), each replica's rows since then
  (`rows`) and, with overlap, the snapshots of the round in flight
  (`snapshots`, and their rows, `snapshot_rows`) and whether it is
  (`exchange`), and with
  `outer_dtype` each group's residuals of its last low-bit exchange
  (`residuals`, error feedback). With fragments each fragment's anchors and
  residuals are among `anchors` and `residuals`, and fragments 1 ... F-1
  have their own outer optimizers (`fragment_outer_optimizers`; the first's
  is `outer_optimizer`); with overlap, which fragment's exchange is in
  flight is `fragments_in_flight`. Anchors, residuals, snapshots
  and the outer optimizer's slots are made before the first step
  (`strategy.sync_groups_step(0, trainable_variables)`, or Keras's `fit`);
  a checkpoint read before that is restored into them as they are made,
  so its files must stay until then.

  >>> import keras
  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(
  ...     sync_groups=2, average_every=4,
  ...     outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9,
  ...                                          nesterov=True))
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  ...   model.compile("sgd", "mse")
  >>> checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
  ...                                  sync_groups=strategy.sync_groups_state)
  >>> _ = model.fit(tf.ones((48, 3)), tf.ones((48, 1)), batch_size=8,
  ...               verbose=0)  # 6 steps: a round after step 4, and fit's last
  >>> len(strategy.sync_groups_state.anchors)  # The kernel's and the bias's
  2
  >>> outer = strategy.sync_groups_state.outer_optimizer
  >>> int(outer.iterations.numpy())  # Two outer steps, with their momentum
  2
  >>> path = checkpoint.write("diloco_checkpoint")
  >>> _ = outer.iterations.assign(0)
  >>> checkpoint.read(path).assert_existing_objects_matched() and None
  >>> int(outer.iterations.numpy())
  2
  """

  def __init__(self, outer_optimizer, fragment_outer_optimizers=(),
               fragments_in_flight=None):
    super().__init__(name="sync_groups")
    self.outer_optimizer = outer_optimizer
    # One fragment saves as before.
    if fragment_outer_optimizers:
      self.fragment_outer_optimizers = list(fragment_outer_optimizers)
    if fragments_in_flight is not None:
      self.fragments_in_flight = fragments_in_flight
    self.anchors = []
    self.snapshots = []
    self.residuals = []
    self.rows = None
    self.snapshot_rows = None
    self.exchange = overlap.ExchangeInFlight()
