"""A non-chief worker's Keras files go to scratch, then removed; others stay.

In one process: a ReplicatorStrategy is made to answer as a non-chief worker
of a cluster does (`extended.is_chief` False), which is all the wrappers ask.
A spy keeps a copy of each scratch directory as it is removed, so the tests
see that the non-chief did write, and what. test_multi_worker checks the same
with real workers.
"""

import contextlib
import json
import os
import shutil
import tempfile
import unittest
from unittest import mock

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import models
import replicator_strategy as rs
from replicator_strategy.cluster import scratch
import topology

BATCH = 8


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(4 * BATCH, 8)).astype(np.float32),
          rng.normal(size=(4 * BATCH, 3)).astype(np.float32))


X, Y = _data()


def non_chief():
  """Every ReplicatorStrategy answers as a non-chief worker's, in the block."""
  return mock.patch.object(rs.ReplicatorExtended, "is_chief",
                           new_callable=mock.PropertyMock, return_value=False)


def compiled_model(strategy):
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(keras.optimizers.SGD(0.05), "mse")
  return model


def fit(model, epochs, callbacks, **kwargs):
  return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False,
                   verbose=0, callbacks=callbacks, **kwargs)


def files_under(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, names in os.walk(root) for f in names)


class ScratchSpy:
  """Records the scratch directories made and keeps a copy of each removed."""

  def __init__(self, keep_dir):
    self.made, self.kept = [], {}
    self._keep_dir = keep_dir
    self._new_dir, self._rmtree = scratch.new_dir, shutil.rmtree

  def new_dir(self):
    self.made.append(self._new_dir())
    return self.made[-1]

  def rmtree(self, path, *args, **kwargs):
    path = os.fspath(path)
    if path in self.made and os.path.isdir(path):
      self.kept[path] = os.path.join(self._keep_dir, str(len(self.kept)))
      shutil.copytree(path, self.kept[path])
    return self._rmtree(path, *args, **kwargs)

  def kept_files(self):
    """What each scratch directory held when removed, in order made."""
    return [files_under(self.kept[p]) for p in self.made if p in self.kept]

  @contextlib.contextmanager
  def watching(self):
    with mock.patch.object(scratch, "new_dir", self.new_dir), \
         mock.patch.object(shutil, "rmtree", self.rmtree):
      yield self


class ChiefWritesTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = self.enterContext(tempfile.TemporaryDirectory())
    self.out = os.path.join(self.tmp, "out")
    os.makedirs(self.out)
    self.spy = ScratchSpy(os.path.join(self.tmp, "kept"))
    self.enterContext(self.spy.watching())

  def assert_scratch_all_removed(self):
    self.assertTrue(self.spy.made, "no scratch directory was made")
    for path in self.spy.made:
      self.assertFalse(os.path.exists(path), path)

  def path(self, name):
    return os.path.join(self.out, name)


_SAVES = [
    ("save", "m.keras", ["m.keras"]),
    ("save_weights", "w.weights.h5", ["w.weights.h5"]),
    ("export", "exported", ["exported/fingerprint.pb",
                            "exported/saved_model.pb"]),
]


def _predictions_of(method, path):
  """What the model saved at `path` predicts for X."""
  if method == "save":
    return keras.models.load_model(path).predict(X, verbose=0)
  if method == "save_weights":
    model = models.small_mlp()
    model.load_weights(path)
    return model.predict(X, verbose=0)
  # Held in a name: the restored variables live as long as the root object.
  restored = tf.saved_model.load(path)
  return restored.serve(tf.constant(X)).numpy()


class SaveTest(ChiefWritesTest):

  @parameterized.expand(_SAVES)
  def test_a_non_chief_writes_to_scratch_then_removes_it(self, method, name,
                                                         files):
    model = compiled_model(topology.strategy_over(2))
    fit(model, epochs=1, callbacks=[])
    with non_chief():
      getattr(model, method)(self.path(name))
    self.assertEqual(files_under(self.out), [])
    self.assert_scratch_all_removed()
    self.assertEqual(len(self.spy.made), 1)
    kept = self.spy.kept_files()[0]
    for f in files:
      self.assertIn(f, kept)
    # It saved the trained model, as the chief would have.
    kept_copy = os.path.join(self.spy.kept[self.spy.made[0]], name)
    np.testing.assert_allclose(_predictions_of(method, kept_copy),
                               model.predict(X, verbose=0), rtol=1e-5,
                               atol=1e-6)

  @parameterized.expand([(f"{method}_{who}", method, name, files, who)
                         for method, name, files in _SAVES
                         for who in ("chief", "no_strategy")])
  def test_a_chief_or_another_strategy_writes_where_told(self, _, method,
                                                         name, files, who):
    if who == "chief":
      model = compiled_model(topology.strategy_over(2))
      context = contextlib.nullcontext()
    else:  # Inert for models of any other strategy, even on a non-chief.
      model, context = compiled_model(None), non_chief()
    with context:
      getattr(model, method)(self.path(name))
    for f in files:
      self.assertIn(f, files_under(self.out))
    self.assertEqual(self.spy.made, [])


class CallbacksTest(ChiefWritesTest):

  def checkpoint_and_logs(self):
    return [keras.callbacks.ModelCheckpoint(self.path("ckpt-{epoch}.keras")),
            keras.callbacks.TensorBoard(self.path("logs"))]

  def test_a_non_chief_checkpoints_and_logs_to_scratch(self):
    model = compiled_model(topology.strategy_over(2))
    callbacks = self.checkpoint_and_logs()
    with non_chief():
      fit(model, epochs=2, callbacks=callbacks)
    self.assertEqual(files_under(self.out), [])
    self.assert_scratch_all_removed()
    kept = self.spy.kept_files()
    self.assertEqual(sum(k == ["ckpt-1.keras"] for k in kept), 1, kept)
    self.assertEqual(sum(k == ["ckpt-2.keras"] for k in kept), 1, kept)
    logs = [k for k in kept if any(f.startswith("train/events.") for f in k)]
    self.assertEqual(len(logs), 1, kept)
    # The callback's log_dir is the script's again once training ends.
    self.assertEqual(callbacks[1].log_dir, self.path("logs"))

  def test_a_chief_checkpoints_and_logs_where_told(self):
    model = compiled_model(topology.strategy_over(2))
    fit(model, epochs=2, callbacks=self.checkpoint_and_logs())
    written = files_under(self.out)
    self.assertEqual([f for f in written if f.startswith("ckpt")],
                     ["ckpt-1.keras", "ckpt-2.keras"])
    self.assertTrue(any(f.startswith("logs/train/events.") for f in written),
                    written)
    self.assertEqual(self.spy.made, [])


class _Stop(Exception):
  pass


class _StopAtEpoch(keras.callbacks.Callback):

  def __init__(self, epoch):
    super().__init__()
    self._epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self._epoch:
      raise _Stop(f"epoch {epoch}")


class BackupAndRestoreTest(ChiefWritesTest):

  def test_only_the_chief_writes_and_deletes_the_backup(self):
    backup_dir = self.path("backup")
    strategy = topology.strategy_over(2)
    with self.assertRaises(_Stop):
      fit(compiled_model(strategy), epochs=3, callbacks=[
          keras.callbacks.BackupAndRestore(backup_dir), _StopAtEpoch(1)])
    chiefs_backup = {f: open(os.path.join(backup_dir, f), "rb").read()
                     for f in files_under(backup_dir)}
    self.assertEqual(sorted(chiefs_backup),
                     ["latest.weights.h5", "training_metadata.json"])
    self.assertEqual(
        json.loads(chiefs_backup["training_metadata.json"])["epoch"], 1)

    # A non-chief restores from the chief's backup and leaves it as it is.
    with non_chief():
      history = fit(compiled_model(strategy), epochs=3,
                    callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])
    self.assertEqual(history.epoch, [1, 2])
    self.assertEqual(
        {f: open(os.path.join(backup_dir, f), "rb").read()
         for f in files_under(backup_dir)}, chiefs_backup)
    self.assert_scratch_all_removed()
    kept = [f for files in self.spy.kept_files() for f in files]
    self.assertEqual(kept.count("training_metadata.json"), 2, kept)
    self.assertEqual(kept.count("latest.weights.h5"), 2, kept)

    # The chief resumes there too, and deletes the backup at the end.
    self.spy.made.clear()
    history = fit(compiled_model(strategy), epochs=3,
                  callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])
    self.assertEqual(history.epoch, [1, 2])
    self.assertFalse(os.path.exists(backup_dir))
    self.assertEqual(self.spy.made, [])


if __name__ == "__main__":
  unittest.main()
