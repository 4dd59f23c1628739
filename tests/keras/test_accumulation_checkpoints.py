"""Gradient accumulation resumes exactly from a checkpoint saved between updates.

`gradient_accumulation_steps=3`, 6 steps (updates at steps 3 and 6), saved
after step 4 (the next step accumulates) or 5 (the next step updates),
loaded into a fresh model, trained to step 6: on as many replicas, the
weights equal those of 6 uninterrupted steps to the last bit, because each
replica gets its own accumulator back (`variables.ReplicaSum`,
`keras.accumulators`). On another number of replicas the saved sum goes to
the first replica: equal within float rounding.
"""

import collections
import contextlib
import functools
import os
import tempfile
import unittest
import warnings

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import models
import replicator_strategy as rs
import saves
import topology

BATCH = 16
STEPS = 6
ACCUMULATE = 3
RTOL = 1e-5


def data(steps=STEPS):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * steps, 8)).astype(np.float32)
  y = rng.normal(size=(BATCH * steps, 3)).astype(np.float32)
  return x, y


def compiled(strategy):
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=ACCUMULATE), "mse")
    model.optimizer.build(model.trainable_variables)
  return model


def over(n):
  return None if n is None else topology.strategy_over(n)


def fit(model, first, last):
  x, y = data()
  model.fit(x[first * BATCH:last * BATCH], y[first * BATCH:last * BATCH],
            batch_size=BATCH, shuffle=False, verbose=0)


@functools.cache
def trained(n, steps):
  """A model fitted on the first `steps` steps on n replicas (None: none).

  Tests share it: they save it, never change it.
  """
  model = compiled(over(n))
  fit(model, 0, steps)
  return model


def uninterrupted(n):
  """Weights after STEPS steps on n replicas (None: no strategy)."""
  return trained(n, STEPS).get_weights()


def resumed(n, saved_after, save, directory):
  load = save(trained(n, saved_after), directory)
  fresh = compiled(over(n))
  load(fresh)
  fit(fresh, saved_after, STEPS)
  return fresh


def assert_equal_weights(got, want):
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


def replica_copies(optimizer):
  """Each accumulator's per-replica copies, as arrays."""
  return [[c.numpy() for c in a.value.values]
          for a in optimizer._accumulated_gradients]  # pylint: disable=protected-access


@pytest.mark.slow  # Trains, saves or stops, then trains again.
class ResumeTest(unittest.TestCase):

  @parameterized.expand([
      (f"{n}_replicas_{f}_before_{step}", n, f, after)
      for n in topology.REPLICA_COUNTS for f in saves.FORMATS
      for step, after in (("accumulating", 4), ("update", 5))])
  def test_resumed_equals_uninterrupted_exactly(self, _, n, fmt, saved_after):
    with tempfile.TemporaryDirectory() as directory:
      model = resumed(n, saved_after, saves.FORMATS[fmt], directory)
    assert_equal_weights(model.get_weights(), uninterrupted(n))

  def test_every_replica_gets_its_own_accumulator_back(self):
    with tempfile.TemporaryDirectory() as directory:
      model = trained(4, 2)
      saved = replica_copies(model.optimizer)
      self.assertTrue(any(np.any(c[0] != c[1]) for c in saved))
      for save in saves.FORMATS.values():
        fresh = compiled(topology.strategy_over(4))
        save(model, directory)(fresh)
        for got, want in zip(replica_copies(fresh.optimizer), saved):
          for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

  def test_four_replicas_then_two_then_no_strategy(self):
    with tempfile.TemporaryDirectory() as directory:
      on_four = trained(4, 2)
      on_two = compiled(topology.strategy_over(2))
      saves.save_weights(on_four, directory)(on_two)
      fit(on_two, 2, 4)
      alone = compiled(None)
      saves.save_checkpoint(on_two, directory)(alone)
      fit(alone, 4, STEPS)
    for g, w in zip(alone.get_weights(), uninterrupted(None), strict=True):
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-7)

  @parameterized.expand(saves.FORMATS.items())
  def test_no_strategy_then_two_replicas(self, _, save):
    # The file has no replica values: the sum goes to the first replica.
    with tempfile.TemporaryDirectory() as directory:
      alone = trained(None, 4)
      on_two = compiled(topology.strategy_over(2))
      save(alone, directory)(on_two)
      fit(on_two, 4, STEPS)
    for g, w in zip(on_two.get_weights(), uninterrupted(None), strict=True):
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-7)

  def test_a_preemption_checkpoint_resumes_exactly(self):
    strategy = topology.strategy_over(2)
    with tempfile.TemporaryDirectory() as directory:
      model = trained(2, 4)
      tf.train.CheckpointManager(
          tf.train.Checkpoint(model=model, optimizer=model.optimizer),
          directory, max_to_keep=1).save()
      fresh = compiled(strategy)
      with rs.PreemptionCheckpoint(strategy, tf.train.Checkpoint(
          model=fresh, optimizer=fresh.optimizer), directory):
        fit(fresh, 4, STEPS)
    assert_equal_weights(fresh.get_weights(), uninterrupted(2))


class _Interrupted(Exception):
  pass


class _InterruptAfter(keras.callbacks.Callback):
  """Stops `fit` after `steps` steps, counted over its epochs."""

  def __init__(self, steps):
    super().__init__()
    self._steps, self._done = steps, 0

  def on_train_batch_end(self, batch, logs=None):
    self._done += 1
    if self._done == self._steps:
      raise _Interrupted()


@pytest.mark.slow  # Trains, saves or stops, then trains again.
class BackupAndRestoreTest(unittest.TestCase):
  """4 steps an epoch, an update every 3: backups hold pending steps."""

  def setUp(self):
    super().setUp()
    x, y = data()
    self.x, self.y = x[:4 * BATCH], y[:4 * BATCH]
    self.strategy = topology.strategy_over(2)
    directory = tempfile.TemporaryDirectory()  # pylint: disable=consider-using-with
    self.addCleanup(directory.cleanup)
    self.backup = os.path.join(directory.name, "backup")

  def fit(self, model, callbacks=(), epochs=2):
    model.fit(self.x, self.y, batch_size=BATCH, epochs=epochs, shuffle=False,
              verbose=0, callbacks=list(callbacks))

  def test_an_epoch_backup_resumes_exactly(self):
    reference = compiled(self.strategy)
    self.fit(reference)
    first = compiled(self.strategy)
    # Backed up after epoch 1 (step 4, pending), stopped after step 6.
    with self.assertRaises(_Interrupted):
      self.fit(first, [keras.callbacks.BackupAndRestore(self.backup),
                       _InterruptAfter(6)])
    second = compiled(self.strategy)
    self.fit(second, [keras.callbacks.BackupAndRestore(self.backup)])
    assert_equal_weights(second.get_weights(), reference.get_weights())

  def test_a_backup_every_two_steps_resumes_exactly(self):
    # Saved after step 2 (two steps pending), interrupted after step 3;
    # Keras resumes at the start of the saved epoch.
    reference = compiled(self.strategy)
    reference.fit(self.x[:2 * BATCH], self.y[:2 * BATCH], batch_size=BATCH,
                  shuffle=False, verbose=0)
    self.fit(reference)  # The two epochs again, without a save.
    first = compiled(self.strategy)
    with self.assertRaises(_Interrupted):
      self.fit(first, [keras.callbacks.BackupAndRestore(self.backup,
                                                        save_freq=2),
                       _InterruptAfter(3)])
    second = compiled(self.strategy)
    self.fit(second, [keras.callbacks.BackupAndRestore(self.backup,
                                                       save_freq=2)])
    assert_equal_weights(second.get_weights(), reference.get_weights())


class StockKerasTest(unittest.TestCase):
  """Files saved on 2 replicas load with no strategy, Keras as shipped."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.saved = trained(2, 4)
    cls.sums = [a.numpy() for a in
                cls.saved.optimizer._accumulated_gradients]  # pylint: disable=protected-access

  def setUp(self):
    super().setUp()
    rs.keras.uninstall()
    self.addCleanup(rs.keras.install)
    directory = tempfile.TemporaryDirectory()  # pylint: disable=consider-using-with
    self.addCleanup(directory.cleanup)
    self.directory = directory.name

  def assert_loaded_sums(self, model):
    assert_equal_weights(model.get_weights(), self.saved.get_weights())
    for got, want in zip(model.optimizer._accumulated_gradients, self.sums,  # pylint: disable=protected-access
                         strict=True):
      np.testing.assert_array_equal(got.numpy(), want)
    self.assertTrue(any(np.any(s != 0) for s in self.sums))

  @parameterized.expand(saves.FORMATS.items())
  def test_loads_the_sum_of_the_replicas_accumulators(self, _, save):
    load = save(self.saved, self.directory)
    fresh = compiled(None)
    with warnings.catch_warnings():
      # Keras warns when it skips variables it cannot match.
      warnings.simplefilter("error", UserWarning)
      load(fresh)
    self.assert_loaded_sums(fresh)

  def test_load_model_of_a_keras_file(self):
    path = os.path.join(self.directory, "m.keras")
    self.saved.save(path)
    with warnings.catch_warnings():
      warnings.simplefilter("error", UserWarning)
      self.assert_loaded_sums(keras.models.load_model(path))


class NoDataMovesTest(unittest.TestCase):

  def test_an_accumulating_step_runs_no_collective(self):
    strategy = topology.strategy_over(2)
    with strategy.scope():
      model = models.small_mlp()
      optimizer = keras.optimizers.SGD(
          0.1, gradient_accumulation_steps=ACCUMULATE, clipnorm=1.0)
      optimizer.build(model.trainable_variables)

    def step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
      optimizer.apply_gradients(zip(tape.gradient(
          loss, model.trainable_variables), model.trainable_variables))

    graph = tf.function(lambda x: strategy.run(step, args=(x,))
                        ).get_concrete_function(
                            tf.TensorSpec((4, 8))).graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}

    def collectives(name):
      found = collections.Counter()
      for node in library[name].node_def:
        if "Collective" in node.op:
          found[node.op] += 1
        for attr in node.attr.values():
          if attr.HasField("func") and attr.func.name in library:
            found.update(collectives(attr.func.name))
      return found

    branches = [(collectives(node.attr["then_branch"].func.name),
                 collectives(node.attr["else_branch"].func.name))
                for node in graph.node if node.op in ("If", "StatelessIf")]
    self.assertTrue(branches)
    # Per replica: the update branch sums the clipped gradients...
    self.assertEqual(sum(1 for update, _ in branches if update), 2)
    # ...and no accumulating branch moves data.
    self.assertEqual([accumulate for _, accumulate in branches
                      if accumulate], [])


if __name__ == "__main__":
  unittest.main()
