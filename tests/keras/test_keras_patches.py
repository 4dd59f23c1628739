"""The table of Keras patches: applied once, undone by uninstall, version-checked.

They are in place while a ReplicatorStrategy lives, so other strategies'
tracebacks never pass through them.
"""

import collections
import functools
import json
import os
import subprocess
import sys
import types
import unittest
from unittest import mock

import keras
import numpy as np
import pytest

import replicator_strategy as rs
from replicator_strategy.keras import _internal as keras_internal
from replicator_strategy.keras import patches as keras_patches


class PatchTableTest(unittest.TestCase):

  def test_uninstall_puts_back_every_keras_function_and_install_reapplies(self):
    patched = {(p.owner, p.name): getattr(p.owner, p.name)
               for p in keras_patches.PATCHES}
    added = {(p.owner, p.name) for p in keras_patches.PATCHES if p.adds}
    try:
      keras_patches.uninstall()
      for owner, name in added:  # What Keras lacks is gone again.
        self.assertFalse(hasattr(owner, name), name)
      shipped = {key: getattr(*key) for key in patched if key not in added}
      for (owner, name), function in shipped.items():
        with self.subTest(name):
          self.assertIsNot(function, patched[(owner, name)])
          # Keras's own code, not a wrapper of ours (functools.wraps copies
          # names, not code).
          self.assertIn(f"{os.sep}keras{os.sep}", _code(function).co_filename)
          self.assertIn("replicator_strategy",
                        _code(patched[(owner, name)]).co_filename)
    finally:
      keras_patches.install()
    reapplied = {key: getattr(*key) for key in patched}
    for key, function in reapplied.items():
      self.assertIsNot(function, shipped.get(key))
    keras_patches.install()  # Once only: a second call wraps nothing again.
    for key, function in reapplied.items():
      self.assertIs(getattr(*key), function)

  def test_a_strategy_trains_with_keras_untouched_after_uninstall(self):
    try:
      keras_patches.uninstall()
      strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
      with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
      history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4,
                          verbose=0)
      self.assertEqual(len(history.history["loss"]), 1)
      # Keras's own predict_on_batch: every replica gets the whole batch.
      self.assertEqual(len(model.predict_on_batch(np.ones((4, 2)))), 8)
    finally:
      keras_patches.install()
    self.assertEqual(len(model.predict_on_batch(np.ones((4, 2)))), 4)


class AddedAttributeTest(unittest.TestCase):
  """A row with `adds=True` gives an owner a name it lacks, for as long as
  the patches are in place."""

  def setUp(self):
    super().setUp()
    self.owner = types.ModuleType("shipped")
    self.owner.kept = "Keras's own"
    self.shipped = dict(vars(self.owner))

  def _installed_with(self, table):
    keras_patches.uninstall()
    self.addCleanup(keras_patches.install)
    patcher = mock.patch.object(keras_patches, "PATCHES", table)
    patcher.start()
    self.addCleanup(patcher.stop)
    self.addCleanup(keras_patches.uninstall)  # Runs first: the table's own.
    keras_patches.install()

  def test_uninstall_deletes_what_install_added(self):
    def added():
      return "ours"

    self._installed_with((keras_patches.Patch(
        self.owner, "added", added, "always", adds=True),))
    self.assertIs(self.owner.added, added)
    keras_patches.uninstall()
    self.assertEqual(vars(self.owner), self.shipped)
    keras_patches.install()
    self.assertIs(self.owner.added, added)

  def test_a_name_the_owner_has_is_left_as_shipped(self):
    self._installed_with((keras_patches.Patch(
        self.owner, "kept", lambda: "ours", "always", adds=True),))
    self.assertEqual(self.owner.kept, "Keras's own")
    keras_patches.uninstall()
    self.assertEqual(vars(self.owner), self.shipped)


# Each method the table wraps more than once: its wrappers, outer to inner,
# in the order patches.py's comments explain.
LAYERING = {
    (keras.Model, "test_on_batch"): ["with_one_model", "split_on_batch"],
    (keras.Model, "predict_on_batch"): ["with_one_model", "split_on_batch"],
    (keras.Model, "_make_function"): ["rows_counted", "compiled_per_replica"],
    (keras.Model, "fit"): ["rounds_in_epoch_logs", "last_round"],
    (keras.Model, "make_train_function"): ["stages_placed_first",
                                           "rounds_after_steps"],
    (keras.Model, "make_predict_function"): ["stages_placed_first",
                                             "predict_compiled_per_device"],
    (keras.Model, "predict_step"): ["forward_through_stages",
                                    "predict_step_per_device"],
    (keras.Layer, "__call__"): ["stage_by_stage_call", "output_layouts"],
    (keras.optimizers.Optimizer, "_all_reduce_sum_gradients"): [
        "gather_for_clipping", "split_in_parts", "slices_as_on_one_device",
        "skip_if_reduced", "compressed_on_the_wire"],
    (keras.optimizers.Optimizer, "_clip_gradients"): [
        "reduce_accumulated_before_clipping", "clip_in_parts"],
    (keras.optimizers.Optimizer, "add_variable_from_reference"): [
        "average_reads_whole", "shard_slots", "per_replica_accumulators"],
    (keras.optimizers.Optimizer, "_backend_update_step"): [
        "update_shards", "sharded_update_step"],
    (keras.layers.Embedding, "call"): ["lookup_rows", "megatron_embedding"],
    (keras.layers.Dropout, "call"): ["dropout_in_parts", "dropout_rows"],
    (keras.callbacks.BackupAndRestore, "_save_model"): [
        "backup_to_scratch_unless_chief", "group_state_beside_backup"],
    (keras.callbacks.BackupAndRestore, "on_train_begin"): [
        "watching", "group_state_from_backup"],
    (keras.callbacks.BackupAndRestore, "on_train_end"): [
        "watched", "keep_backup_unless_chief"],
}


def layering(table):
  """Each (owner, name) wrapped more than once in `table`: its wrappers'
  names, outer (a later row) to inner."""
  wrappers = collections.defaultdict(list)
  for patch in table:
    wrap = patch.wrap
    if isinstance(wrap, functools.partial):
      wrap = wrap.func
    wrappers[(patch.owner, patch.name)].insert(0, wrap.__name__)
  return {key: names for key, names in wrappers.items() if len(names) > 1}


class LayeringTest(unittest.TestCase):
  maxDiff = None

  def test_methods_wrapped_more_than_once_keep_their_order(self):
    self.assertEqual(layering(keras_patches.PATCHES), LAYERING)

  def test_two_rows_swapped_are_caught(self):
    table = list(keras_patches.PATCHES)
    names = [getattr(p.wrap, "__name__", None) for p in table]
    i = names.index("compressed_on_the_wire")
    j = names.index("skip_if_reduced")
    table[i], table[j] = table[j], table[i]
    self.assertNotEqual(layering(table), LAYERING)


# Run in a fresh process: the suite's own process has `install()`ed the
# patches for good (see above). Prints one JSON line of what it saw.
LIFETIME = r"""
import gc, json, traceback
import replicator_strategy as rs
rs.split_cpu(2)
import keras, numpy as np, tensorflow as tf

class Raises(keras.Model):
  def call(self, x):
    raise ValueError("raised by the model's call")

def our_frames_in_a_mirrored_strategy_error():
  with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    model = Raises()
    model.compile("sgd", "mse")
  try:
    model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
  except ValueError as e:
    assert "raised by the model's call" in str(e), e
    return [f"{frame.filename}:{frame.name}"
            for frame in traceback.extract_tb(e.__traceback__)
            if "replicator_strategy" in frame.filename]
  raise AssertionError("fit did not raise")

seen = {"loaded": rs.keras.installed()}  # rs.keras: the public names load.
strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
with strategy.scope():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0)

@tf.function
def custom_step(x):
  def replica_step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    return tf.distribute.get_replica_context().all_reduce("sum", grads)
  return strategy.run(replica_step, (x,))

custom_step(tf.ones((4, 2)))
seen["alive"] = rs.keras.installed()
seen["alive_frames"] = our_frames_in_a_mirrored_strategy_error()
del strategy
gc.collect()
seen["model_alive"] = rs.keras.installed()  # The model holds its strategy.
del model
gc.collect()
# The traced step's collectives (their gradients) hold it.
seen["function_alive"] = rs.keras.installed()
del custom_step
gc.collect()
seen["none_alive"] = rs.keras.installed()
seen["none_alive_frames"] = our_frames_in_a_mirrored_strategy_error()
print(json.dumps(seen))
"""


@pytest.mark.slow  # A fresh process, with TensorFlow started in it.
class PatchLifetimeTest(unittest.TestCase):

  def test_patches_live_with_strategies_and_stay_out_of_other_tracebacks(self):
    done = subprocess.run([sys.executable, "-c", LIFETIME],
                          capture_output=True, text=True, timeout=120,
                          check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    seen = json.loads(done.stdout.splitlines()[-1])
    self.assertFalse(seen["loaded"])
    self.assertTrue(seen["alive"])
    self.assertTrue(seen["model_alive"])
    self.assertTrue(seen["function_alive"])
    # Trained with fit and a custom loop, the strategy is gone once the
    # user drops it, its model and its function: TF's global registry of
    # the collectives' gradients does not keep it.
    self.assertFalse(seen["none_alive"])
    # While a ReplicatorStrategy lives, the error passes through our
    # wrappers (inert for MirroredStrategy): the check sees them. Once none
    # lives, a MirroredStrategy error's traceback holds no frame of ours.
    self.assertTrue(seen["alive_frames"])
    self.assertEqual(seen["none_alive_frames"], [])


class VersionCheckTest(unittest.TestCase):

  def test_untested_keras_is_refused_with_the_way_out(self):
    with mock.patch.dict(os.environ, {}, clear=False):
      os.environ.pop("REPLICATOR_STRATEGY_ALLOW_UNTESTED_KERAS", None)
      with self.assertRaisesRegex(
          ImportError, r"tested with Keras 3\.15\.x\. Received: keras==3\.99"
          r"\.0.*REPLICATOR_STRATEGY_ALLOW_UNTESTED_KERAS=1"):
        keras_internal.check_keras_version("3.99.0")

  def test_override_and_tested_versions_pass(self):
    with mock.patch.dict(os.environ,
                         {"REPLICATOR_STRATEGY_ALLOW_UNTESTED_KERAS": "1"}):
      keras_internal.check_keras_version("3.99.0")
    keras_internal.check_keras_version("3.15.1")
    keras_internal.check_keras_version()  # The installed Keras.


def _code(function):
  """The code of a function, or of a property's getter."""
  return (function.fget if isinstance(function, property) else function).__code__


if __name__ == "__main__":
  unittest.main()
