"""Keras callbacks and saving with models built under ReplicatorStrategy.

Everything goes through the public Keras 3 API: `ModelCheckpoint`,
`EarlyStopping`, `ReduceLROnPlateau`, `TensorBoard` and `BackupAndRestore`
around `fit`; `.keras` files, `.weights.h5` files and SavedModel export.
What is written must hold the model's values, and what is read back, with
no strategy or under a strategy of another replica count, must predict the
same.
"""

import contextlib
import functools
import glob
import os
import tempfile
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

from assertions import assert_per_replica
import models
import topology

BATCH = 16
STEPS_PER_EPOCH = 4
RTOL, ATOL = 1e-6, 1e-6
# Predictions come from different batch splits and kernels: last-bit noise.
PREDICT_RTOL, PREDICT_ATOL = 1e-5, 1e-6


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS_PER_EPOCH, 8)).astype(np.float32)
  y = rng.normal(size=(BATCH * STEPS_PER_EPOCH, 3)).astype(np.float32)
  return x, y


X, Y = _data()
# 20 rows in batches of 8: the last batch is partial on every topology.
X_PREDICT = np.random.default_rng(1).normal(size=(20, 8)).astype(np.float32)


def compile_with_adam(model):
  model.compile(keras.optimizers.Adam(learning_rate=0.01), "mse")
  return model


def compiled_model():
  """A model with fixed starting weights; call under a scope."""
  model = models.small_mlp()
  model.set_weights(models.initial_weights())
  return compile_with_adam(model)


def strategy_or_none(n):
  return None if n is None else topology.strategy_over(n)


def scope_of(strategy):
  return contextlib.nullcontext() if strategy is None else strategy.scope()


def compiled_model_under(strategy):
  with scope_of(strategy):
    return compiled_model()


def fit(model, epochs, callbacks=(), **kwargs):
  return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False,
                   callbacks=list(callbacks), verbose=0, **kwargs)


class SameValuesMixin:

  def assert_variables_hold(self, model, variables, want, what):
    """Every replica's copy of each of `model`'s `variables` equals `want`."""
    self.assertEqual(len(variables), len(want), what)
    # Without a strategy this is the default one: a single copy.
    strategy = model.distribute_strategy
    for variable, expected in zip(variables, want):
      assert_per_replica(self, strategy, variable.value,
                         [expected] * strategy.num_replicas_in_sync,
                         rtol=RTOL, atol=ATOL,
                         what=f"{what}: {variable.path}")

  def assert_arrays_equal(self, got, want, what):
    self.assertEqual(len(got), len(want), what)
    for i, (g, w) in enumerate(zip(got, want)):
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL,
                                 err_msg=f"{what}: array {i}")


class TempDirMixin:

  def setUp(self):
    super().setUp()
    self.tmp = self.enterContext(tempfile.TemporaryDirectory())

  def path(self, *parts):
    return os.path.join(self.tmp, *parts)


class CallbacksTest(TempDirMixin, SameValuesMixin, unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_model_checkpoint_files_hold_each_epochs_weights(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      model = compiled_model()
    at_epoch_end = {}
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: at_epoch_end.setdefault(
            epoch + 1, model.get_weights()))
    fit(model, epochs=2, callbacks=[
        keras.callbacks.ModelCheckpoint(
            self.path("w-{epoch:02d}.weights.h5"), save_weights_only=True),
        keras.callbacks.ModelCheckpoint(self.path("m-{epoch:02d}.keras")),
        record,
    ])

    self.assertEqual(
        sorted(os.listdir(self.tmp)),
        ["m-01.keras", "m-02.keras", "w-01.weights.h5", "w-02.weights.h5"])
    for epoch in (1, 2):
      plain = models.small_mlp()
      plain.load_weights(self.path(f"w-{epoch:02d}.weights.h5"))
      self.assert_arrays_equal(plain.get_weights(), at_epoch_end[epoch],
                               f"weights file of epoch {epoch}")
      loaded = keras.models.load_model(self.path(f"m-{epoch:02d}.keras"))
      self.assert_arrays_equal(loaded.get_weights(), at_epoch_end[epoch],
                               f".keras file of epoch {epoch}")
    self.assertGreater(
        np.abs(at_epoch_end[2][0] - at_epoch_end[1][0]).max(), 1e-4)
    # The full file holds the optimizer too, as it was after the last epoch.
    self.assertEqual(int(loaded.optimizer.iterations.numpy()),
                     2 * STEPS_PER_EPOCH)
    self.assert_arrays_equal(
        [np.asarray(v) for v in loaded.optimizer.variables],
        [np.asarray(v) for v in model.optimizer.variables],
        "optimizer state in the .keras file")

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_early_stopping_stops_once_the_loss_plateaus(self, _, n):
    # Learning rate 0 from epoch 1 on: epoch 1's loss, on the weights epoch 0
    # left, is lower and then repeats exactly, so patience 1 runs out at the
    # end of epoch 2.
    strategy = topology.strategy_over(n)
    with strategy.scope():
      model = compiled_model()
    early_stopping = keras.callbacks.EarlyStopping(
        monitor="loss", patience=1, restore_best_weights=True)
    history = fit(model, epochs=20, callbacks=[
        keras.callbacks.LearningRateScheduler(
            lambda epoch: 0.05 if epoch < 1 else 0.0),
        early_stopping,
    ])

    losses = history.history["loss"]
    self.assertEqual(len(losses), 3)
    self.assertEqual(early_stopping.stopped_epoch, 2)
    self.assertEqual(early_stopping.best_epoch, 1)
    self.assertLess(losses[1], losses[0])
    self.assertEqual(losses[2], losses[1])
    self.assertEqual(int(model.optimizer.iterations.numpy()),
                     3 * STEPS_PER_EPOCH)
    self.assert_variables_hold(model, [model.optimizer.learning_rate], [0.0],
                               "learning rate")

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_reduce_lr_on_plateau_lowers_the_learning_rate(self, _, n):
    # Validation inputs of zeros through bias-free layers predict zeros
    # whatever the weights: val_loss never improves while training goes on.
    strategy = topology.strategy_over(n)
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((8,)),
          keras.layers.Dense(16, activation="tanh", use_bias=False),
          keras.layers.Dense(3, use_bias=False),
      ])
      model.compile(keras.optimizers.SGD(learning_rate=0.4), "mse")
    start = model.get_weights()
    x_val = np.zeros((8, 8), np.float32)
    y_val = np.ones((8, 3), np.float32)
    history = fit(model, epochs=3, validation_data=(x_val, y_val),
                  callbacks=[keras.callbacks.ReduceLROnPlateau(
                      monitor="val_loss", factor=0.5, patience=1)])

    np.testing.assert_array_equal(history.history["val_loss"], [1.0] * 3)
    # Logged at each epoch's end, before that epoch's reduction.
    np.testing.assert_allclose(history.history["learning_rate"],
                               [0.4, 0.4, 0.2], rtol=RTOL)
    self.assert_variables_hold(model, [model.optimizer.learning_rate], [0.1],
                               "learning rate")
    self.assertGreater(np.abs(model.get_weights()[0] - start[0]).max(), 1e-4)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_tensorboard_writes_the_epoch_losses(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      model = compiled_model()
    log_dir = self.path("logs")
    history = fit(model, epochs=3, validation_data=(X[:BATCH], Y[:BATCH]),
                  callbacks=[keras.callbacks.TensorBoard(log_dir,
                                                         histogram_freq=1)])

    for split, key in (("train", "loss"), ("validation", "val_loss")):
      events = glob.glob(os.path.join(log_dir, split, "events.out.tfevents.*"))
      self.assertTrue(events, f"no event file under {log_dir}/{split}")
      written = _scalars(events, "epoch_loss")
      self.assertEqual(sorted(written), [0, 1, 2], split)
      np.testing.assert_allclose([written[s] for s in range(3)],
                                 history.history[key], rtol=RTOL,
                                 err_msg=split)
    # The last epoch's histogram of the first kernel spans its final values.
    kernel = model.layers[0].kernel
    buckets = _tensors(glob.glob(os.path.join(log_dir, "train", "events.*")),
                       f"{kernel.path}/histogram")[2]
    final = model.get_weights()[0]
    self.assertEqual(buckets[:, 2].sum(), final.size)
    np.testing.assert_allclose([buckets[0, 0], buckets[-1, 1]],
                               [final.min(), final.max()], rtol=RTOL)


def _events(files):
  for path in files:
    yield from tf.compat.v1.train.summary_iterator(path)


def _tensors(files, tag):
  """{step: array} of the summary `tag` in event files."""
  found = {}
  for event in _events(files):
    for value in event.summary.value:
      if value.tag == tag:
        found[event.step] = tf.make_ndarray(value.tensor)
  return found


def _scalars(files, tag):
  return {step: float(v) for step, v in _tensors(files, tag).items()}


EPOCHS = 4
INTERRUPTED_AT_EPOCH = 2


class _Interrupt(Exception):
  pass


class _InterruptAt(keras.callbacks.Callback):
  """Raises `_Interrupt` when training reaches an epoch (and batch)."""

  def __init__(self, epoch, batch=None):
    super().__init__()
    self._epoch, self._batch, self._current_epoch = epoch, batch, None

  def on_epoch_begin(self, epoch, logs=None):
    self._current_epoch = epoch
    if epoch == self._epoch and self._batch is None:
      raise _Interrupt(f"epoch {epoch}")

  def on_train_batch_begin(self, batch, logs=None):
    if self._current_epoch == self._epoch and batch == self._batch:
      raise _Interrupt(f"epoch {self._current_epoch} batch {batch}")


@functools.cache
def uninterrupted_run(n):
  """Weights and optimizer state after EPOCHS epochs without interruption."""
  model = compiled_model_under(topology.strategy_over(n))
  fit(model, epochs=EPOCHS)
  return (model.get_weights(),
          [np.asarray(v) for v in model.optimizer.variables])


# Interrupted as epoch 2 begins, or at its batch 2: then the resumed run
# must also drop the updates of the interrupted epoch's first two batches.
_BACKUP_CASES = [
    ("1_replicas_at_epoch_begin", 1, None),
    ("2_replicas_mid_epoch", 2, 2),
    ("4_replicas_mid_epoch", 4, 2),
]


@pytest.mark.slow  # Trains, saves or stops, then trains again.
class BackupAndRestoreTest(TempDirMixin, SameValuesMixin, unittest.TestCase):

  @parameterized.expand(_BACKUP_CASES)
  def test_resumed_training_ends_where_uninterrupted_training_does(
      self, _, n, interrupted_at_batch):
    backup_dir = self.path("backup")
    strategy = topology.strategy_over(n)
    interrupted = compiled_model_under(strategy)
    with self.assertRaises(_Interrupt):
      fit(interrupted, epochs=EPOCHS, callbacks=[
          keras.callbacks.BackupAndRestore(backup_dir),
          _InterruptAt(INTERRUPTED_AT_EPOCH, interrupted_at_batch),
      ])
    self.assertEqual(int(interrupted.optimizer.iterations.numpy()),
                     INTERRUPTED_AT_EPOCH * STEPS_PER_EPOCH +
                     (interrupted_at_batch or 0))
    self.assertTrue(os.path.exists(os.path.join(backup_dir,
                                                "latest.weights.h5")))

    # A fresh process would rebuild everything: a new strategy and model.
    # Its starting weights differ, so only the backup can make it match.
    keras.utils.set_random_seed(1)
    with topology.strategy_over(n).scope():
      resumed = compile_with_adam(models.small_mlp())
    history = fit(resumed, epochs=EPOCHS,
                  callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])

    self.assertEqual(history.epoch, list(range(INTERRUPTED_AT_EPOCH, EPOCHS)))
    self.assertEqual(int(resumed.optimizer.iterations.numpy()),
                     EPOCHS * STEPS_PER_EPOCH)
    want_weights, want_optimizer = uninterrupted_run(n)
    self.assert_variables_hold(resumed, resumed.weights, want_weights,
                               "model weights")
    self.assert_variables_hold(resumed, resumed.optimizer.variables,
                               want_optimizer, "optimizer state")
    self.assertFalse(os.path.exists(backup_dir))  # deleted once training ends


# A model trained for an epoch under each topology ("none": no strategy).
_SOURCES = [("none", None)] + topology.NAMED_REPLICA_COUNTS
_TARGETS = [None, *topology.REPLICA_COUNTS]
# load_model under a strategy of a different replica count than the saver's.
_OTHER_COUNT = {1: 4, 2: 1, 4: 2}


@functools.cache
def trained_under(n):
  """(model, strategy) after one epoch; cached, so callers must not train it."""
  strategy = strategy_or_none(n)
  model = compiled_model_under(strategy)
  fit(model, epochs=1)
  return model, strategy


class SavingTest(TempDirMixin, SameValuesMixin, unittest.TestCase):

  def assert_same_state(self, loaded, saved, strategy, what):
    """Weights and optimizer state, on every replica of `loaded`."""
    self.assert_variables_hold(loaded, loaded.weights, saved.get_weights(),
                               what)
    self.assert_variables_hold(
        loaded, loaded.optimizer.variables,
        [np.asarray(v) for v in saved.optimizer.variables],
        f"{what}, optimizer")
    if strategy is not None:
      self.assertIs(loaded.distribute_strategy, strategy, what)

  def assert_same_model(self, loaded, saved, strategy, what):
    self.assert_same_state(loaded, saved, strategy, what)
    np.testing.assert_allclose(
        loaded.predict(X_PREDICT, batch_size=8, verbose=0),
        saved.predict(X_PREDICT, batch_size=8, verbose=0),
        rtol=PREDICT_RTOL, atol=PREDICT_ATOL, err_msg=f"{what}: predict")

  @parameterized.expand([
      (f"{name}_{where}", n, inside)
      for name, n in topology.NAMED_REPLICA_COUNTS
      for where, inside in (("inside_scope", True), ("outside_scope", False))
  ])
  def test_keras_file_loads_without_and_with_another_strategy(
      self, _, n, save_inside_scope):
    model, strategy = trained_under(n)
    path = self.path("m.keras")
    if save_inside_scope:
      with strategy.scope():
        model.save(path)
    else:
      model.save(path)

    plain = keras.models.load_model(path)
    self.assert_same_model(plain, model, None, "loaded without a strategy")
    other = topology.strategy_over(_OTHER_COUNT[n])
    with other.scope():
      distributed = keras.models.load_model(path)
    self.assert_same_model(distributed, model, other,
                           f"loaded under {_OTHER_COUNT[n]} replicas")

  @parameterized.expand(_SOURCES)
  def test_weights_file_loads_into_every_topology(self, _, n):
    model, _ = trained_under(n)
    self.assertGreater(
        np.abs(model.get_weights()[0] - models.initial_weights()[0]).max(), 1e-4)
    path = self.path("w.weights.h5")
    model.save_weights(path)

    for target in _TARGETS:
      with self.subTest(saved_under=n, loaded_under=target):
        strategy = strategy_or_none(target)
        with scope_of(strategy):
          fresh = compiled_model()
          fresh.optimizer.build(fresh.trainable_variables)
        fresh.load_weights(path)
        self.assert_same_state(fresh, model, strategy,
                               f"{n} -> {target} replicas")

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_exported_saved_model_serves_the_same_predictions(self, _, n):
    model, _ = trained_under(n)
    export_dir = self.path("exported")
    model.export(export_dir, verbose=False)

    # Held in a name: the restored variables live as long as the root object.
    reloaded = tf.saved_model.load(export_dir)
    served = reloaded.serve(tf.constant(X_PREDICT))
    np.testing.assert_allclose(
        served.numpy(), model.predict(X_PREDICT, batch_size=8, verbose=0),
        rtol=PREDICT_RTOL, atol=PREDICT_ATOL)


if __name__ == "__main__":
  unittest.main()
