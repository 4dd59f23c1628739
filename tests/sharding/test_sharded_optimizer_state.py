"""Sharded optimizer state: slots held once, a shard per replica, same training.

`ReplicatorStrategy(shard_optimizer_state=True)` must train exactly as one
device does: Keras `fit` and a custom loop on 1, 2 and 4 replicas, from the
same weights on the same data and global batch, against the same run with no
strategy. The small MLP's weights (8x16, 16, 16x3, 3) split evenly on 2 and
4 replicas except the last bias, which is padded, so both cases run.
"""

import contextlib
import functools
import os
import tempfile
import unittest
from unittest import mock

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

from assertions import assert_per_replica
import models
import topology
from test_custom_loop import make_step
from replicator_strategy.collectives import communicator as communicator_lib
from replicator_strategy.collectives import per_replica
from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import optimizer_state as sharded
from replicator_strategy.sharding import variables as sharded_variables

GLOBAL_BATCH = 16
STEPS = 4
EPOCHS = 2
RTOL, ATOL = 1e-5, 1e-6

def _adamw_accumulating_without_bias_decay():
  optimizer = keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1,
                                     gradient_accumulation_steps=2)
  optimizer.exclude_from_weight_decay(var_names=["bias"])
  return optimizer


_OPTIMIZERS = {
    "momentum": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9,
                                             nesterov=True),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    "amsgrad": lambda: keras.optimizers.Adam(learning_rate=0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(learning_rate=0.01,
                                            weight_decay=0.1),
    # Clipping sums the gradients before the step (keras.gradient_exchange), so
    # the step cuts the summed gradient instead of reduce-scattering.
    "adam_clipnorm": lambda: keras.optimizers.Adam(learning_rate=0.01,
                                                   clipnorm=0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=0.01,
                                                momentum=0.5),
    # Steps the inner optimizer from a cross-replica tf.cond.
    "loss_scale_adam": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate=0.01)),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        learning_rate=0.01, global_clipnorm=0.5),
    # Weight decay merges the replicas between clipping's sum and the step.
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(
        learning_rate=0.01, weight_decay=0.1, clipnorm=0.5),
    # The EMA copy stays mirrored; Keras overwrites the weights from it in a
    # tf.cond inside each replica.
    "adam_ema": lambda: keras.optimizers.Adam(
        learning_rate=0.01, use_ema=True, ema_momentum=0.5,
        ema_overwrite_frequency=3),
    # The step runs inside a tf.cond in each replica: the replica path.
    "momentum_accumulation": lambda: keras.optimizers.SGD(
        learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=2),
    # Each shard decays in the step (merge and replica paths), biases not.
    "adamw_accumulation_no_bias_decay": _adamw_accumulating_without_bias_decay,
    # The other elementwise Keras optimizers, each with its own slots.
    "adagrad": lambda: keras.optimizers.Adagrad(learning_rate=0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(learning_rate=1.0),
    "adamax": lambda: keras.optimizers.Adamax(learning_rate=0.01),
    # Also a mirrored scalar (its momentum schedule's product) it assigns
    # inside each replica before the step.
    "nadam": lambda: keras.optimizers.Nadam(learning_rate=0.01),
    "lion": lambda: keras.optimizers.Lion(learning_rate=0.01),
    # Reads the weight itself in its math, and assigns it whole.
    "ftrl": lambda: keras.optimizers.Ftrl(
        learning_rate=0.1, l1_regularization_strength=0.01,
        l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.01),
}
# Every optimizer on 4 replicas (uneven shards, padding); on 1 and 2, one of
# each path: merge, clipping (summed first), EMA, loss scaling, tf.cond.
_FIT_CASES = [(f"4_replicas_{name}", 4, name) for name in _OPTIMIZERS] + [
    (f"{n}_replicas_{name}", n, name) for n in (1, 2)
    for name in ("momentum", "adam_global_clipnorm", "adam_ema",
                 "loss_scale_adam", "momentum_accumulation")]
# Built: `optimizer.build` under scope first. Lazy: the first
# `apply_gradients`, inside the tf.function and `strategy.run`, builds it.
# Momentum built on 2 runs with the slow tests: its step on 2 is checked by
# FitTest and by apply_gradients outside run, the built path by adam.
_LOOP_CASES = [(f"{n}_replicas_{name}_built", n, name, True)
               for n in topology.REPLICA_COUNTS for name in ("momentum", "adam")
               if (n, name) != (2, "momentum")
               ] + [(f"{n}_replicas_adam_lazy", n, "adam", False) for n in (2, 4)]


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype(np.float32)
  y = rng.normal(size=(GLOBAL_BATCH * STEPS, 3)).astype(np.float32)
  return x, y


def fresh_model():
  model = models.small_mlp()
  model.set_weights(models.initial_weights())
  return model


def fit(optimizer_name, strategy=None, steps_per_execution=1):
  """A fresh model fitted; returns it, its optimizer and the losses."""
  with strategy.scope() if strategy else contextlib.nullcontext():
    keras.utils.set_random_seed(0)
    model = fresh_model()
    optimizer = _OPTIMIZERS[optimizer_name]()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False,
                  steps_per_execution=steps_per_execution)
    history = model.fit(*data(), batch_size=GLOBAL_BATCH, epochs=EPOCHS,
                        shuffle=False, verbose=0)
  return model, optimizer, history.history["loss"]


@functools.cache
def reference_fit(optimizer_name):
  model, optimizer, losses = fit(optimizer_name)
  return (losses, [w.numpy() for w in model.weights],
          [v.numpy() for v in optimizer.variables])


def sharding(n):
  return topology.strategy_over(n, shard_optimizer_state=True)


@functools.cache
def fit_under(make_strategy, n, optimizer_name, steps_per_execution=1):
  """`fit` under `make_strategy(n)`, run once: the tests that share it read it.

  Returns the strategy, the model, its optimizer and the losses.
  """
  strategy = make_strategy(n)
  return (strategy, *fit(optimizer_name, strategy, steps_per_execution))


def slots(optimizer):
  return [v for v in optimizer.variables
          if isinstance(v.value, sharded_variables.ShardedVariable)]


class ExchangeTest(unittest.TestCase):

  @parameterized.expand([
      (f"{name}{'' if shared else '_separate_memories'}", n, shared)
      for name, n in topology.NAMED_REPLICA_COUNTS for shared in (True, False)])
  def test_reduce_scatter_then_all_gather(self, _, n, shares_memory):
    # Separate memories (GPUs, workers) exchange shards; logical CPUs, which
    # share one memory, sum once and cut.
    strategy = sharding(n)
    devices = strategy.extended.worker_devices
    layout = layout_lib.FlatLayout((3, 3), n)
    each = per_replica.make(devices, lambda r: tf.fill((3, 3), float(r + 1)))
    # Each replica's copy of the sum.
    total = per_replica.make(devices,
                             lambda r: tf.fill((3, 3), n * (n + 1) / 2))
    with mock.patch.object(communicator_lib.Communicator, "shares_memory",
                           shares_memory):
      for grads, summed in ((each, False), (total, True)):
        exchange = sharded.AllReplicas(strategy, [grads], summed)
        shards = exchange.reduce_scatter(layout, exchange.gradients[0])
        self.assertEqual([s.shape for s in shards],
                         [(layout.shard_size,)] * n)
        np.testing.assert_array_equal(
            tf.concat(shards, 0),
            [n * (n + 1) / 2] * 9 + [0] * (layout.shard_size * n - 9))
      with strategy.scope():
        weight = tf.Variable(tf.zeros((3, 3)))
      new_shards = [layout.shard(tf.reshape(tf.range(9.0), (3, 3)), r)
                    for r in range(n)]
      exchange.all_gather(layout, weight, new_shards)
    for component in weight.values:
      np.testing.assert_array_equal(component, np.arange(9.0).reshape(3, 3))


class SlotPlacementTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_every_slot_is_one_shard_per_device(self, _, n):
    strategy = sharding(n)
    with strategy.scope():
      model = fresh_model()
      optimizer = keras.optimizers.Adam()
      optimizer.build(model.trainable_variables)
    self.assertEqual(len(slots(optimizer)), 2 * len(model.trainable_variables))
    for slot, weight in zip(slots(optimizer),
                            [w for w in model.trainable_variables
                             for _ in range(2)]):
      components = slot.value.values
      self.assertEqual(
          [c.device for c in components], list(strategy.extended.worker_devices))
      size = int(np.prod(weight.shape))
      self.assertEqual([int(c.shape.num_elements()) for c in components],
                       [-(-size // n)] * n, slot.path)
      self.assertEqual(slot.shape, weight.shape)
      self.assertEqual(slot.value.shape, weight.shape)
      np.testing.assert_array_equal(slot.numpy(), np.zeros(weight.shape))

  def momentum_of_a_3x3_weight(self, strategy):
    """The one slot of SGD with momentum for a 3x3 weight, assigned 0..8."""
    with strategy.scope():
      optimizer = keras.optimizers.SGD(momentum=0.9)
      weight = keras.Variable(np.zeros((3, 3), np.float32))
      optimizer.build([weight])
    (slot,) = slots(optimizer)
    value = np.arange(9, dtype=np.float32).reshape(3, 3)
    slot.assign(value)
    return slot, value

  def test_full_value_assigns_and_reads_back_across_shards(self):
    slot, value = self.momentum_of_a_3x3_weight(sharding(4))
    np.testing.assert_array_equal(slot.numpy(), value)
    np.testing.assert_array_equal(slot.value.values[3].numpy(), [0, 0, 0])
    np.testing.assert_array_equal(slot.value.values[2].numpy(), [6, 7, 8])

  def test_every_read_outside_run_is_the_whole_slot(self):
    strategy = sharding(4)
    slot, value = self.momentum_of_a_3x3_weight(strategy)
    reads = {
        "value()": lambda: slot.value.value(),
        "read_value()": lambda: slot.value.read_value(),
        "convert_to_tensor": lambda: tf.convert_to_tensor(slot.value),
        "np.asarray": lambda: np.asarray(slot.value),
        "in a tf.function": tf.function(lambda: slot.value + 0.0),
    }
    for name, read in reads.items():
      with self.subTest(name):
        np.testing.assert_array_equal(np.asarray(read()), value)
      with self.subTest(name + " in the scope"), strategy.scope():
        np.testing.assert_array_equal(np.asarray(read()), value)

  def test_a_read_inside_run_is_refused_not_a_shard(self):
    strategy = sharding(2)
    with strategy.scope():
      optimizer = keras.optimizers.SGD(momentum=0.9)
      weight = keras.Variable(np.zeros((4,), np.float32))
      optimizer.build([weight])
    (slot,) = slots(optimizer)
    with self.assertRaisesRegex(ValueError,
                                "sharded over the replicas.*strategy.run"):
      strategy.run(tf.function(lambda: slot.value * 2.0))

  def test_without_the_option_slots_are_mirrored(self):
    strategy = topology.strategy_over(2)
    with strategy.scope():
      model = fresh_model()
      optimizer = keras.optimizers.Adam()
      optimizer.build(model.trainable_variables)
    self.assertEqual(slots(optimizer), [])


class FitTest(unittest.TestCase):

  @parameterized.expand(_FIT_CASES + [
      # 3 steps per execution put the step in a tf.while_loop.
      ("4_replicas_adam_spe3", 4, "adam", 3)])
  def test_fit_matches_no_strategy(self, _, n, optimizer_name,
                                   steps_per_execution=1):
    strategy, model, optimizer, losses = fit_under(sharding, n, optimizer_name,
                                                   steps_per_execution)
    want_losses, want_weights, want_optimizer = reference_fit(optimizer_name)

    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    self.assertTrue(slots(optimizer))
    for v, want, start in zip(model.weights, want_weights,
                              models.initial_weights()):
      self.assertGreater(np.abs(want - start).max(), 1e-3)  # it trained
      for replica, got in enumerate(
          strategy.experimental_local_results(v.value)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{v.path} on replica {replica}")
    # The slots read back whole (assembled from their shards).
    self.assertEqual(len(optimizer.variables), len(want_optimizer))
    for v, want in zip(optimizer.variables, want_optimizer):
      np.testing.assert_allclose(v.numpy(), want, rtol=RTOL, atol=ATOL,
                                 err_msg=v.path)


def dataset():
  return tf.data.Dataset.from_tensor_slices(data()).batch(GLOBAL_BATCH)


@functools.cache
def reference_loop(optimizer_name):
  model = fresh_model()
  optimizer = _OPTIMIZERS[optimizer_name]()
  train_step = tf.function(make_step(model, optimizer))
  losses = [float(train_step(x, y)) for x, y in dataset()]
  return losses, model.get_weights()


# In a tf.cond: adam_clipnorm (adam's step, clipped) on every count, nadam
# and ftrl on 4; momentum and adam alone (the same in-cond path as
# adam_clipnorm, whose steps the merge cases check) only with the slow tests.
_IN_COND_CASES = [(f"{n}_replicas_adam_clipnorm_in_cond", n, "adam_clipnorm",
                   True, True) for n in topology.REPLICA_COUNTS] + [
                       (f"4_replicas_{name}_in_cond", 4, name, True, True)
                       for name in ("nadam", "ftrl")]
_SLOW_CASES = [("2_replicas_momentum_built", 2, "momentum", True, False)] + [
    (f"{n}_replicas_{name}_in_cond", n, name, True, True)
    for n in topology.REPLICA_COUNTS for name in ("momentum", "adam")]


class CustomLoopTest(unittest.TestCase):

  @parameterized.expand([(*case, False) for case in _LOOP_CASES] +
                        _IN_COND_CASES)
  def test_apply_gradients_in_run_matches_one_device(
      self, _, n, optimizer_name, prebuilt, in_cond):
    self.check_apply_gradients_in_run(n, optimizer_name, prebuilt, in_cond)

  @parameterized.expand(_SLOW_CASES)
  @pytest.mark.slow
  def test_more_apply_gradients_in_run_match_one_device(
      self, _, n, optimizer_name, prebuilt, in_cond):
    self.check_apply_gradients_in_run(n, optimizer_name, prebuilt, in_cond)

  def check_apply_gradients_in_run(self, n, optimizer_name, prebuilt, in_cond):
    """In a tf.cond no merge is possible: each replica steps its own shard."""
    strategy = sharding(n)
    with strategy.scope():
      model = fresh_model()
      optimizer = _OPTIMIZERS[optimizer_name]()
      if prebuilt:
        optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer)
    if in_cond:
      step = lambda x, y, step=step: tf.cond(
          tf.size(x) >= 0, lambda: step(x, y), lambda: 0.0)

    @tf.function
    def train_step(batch):
      return strategy.reduce("sum", strategy.run(step, args=batch), axis=None)

    losses = [float(train_step(batch)) for batch in
              strategy.experimental_distribute_dataset(dataset())]
    want_losses, want_weights = reference_loop(optimizer_name)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    self.assertEqual(int(optimizer.iterations.numpy()), STEPS)
    self.assertTrue(slots(optimizer))
    for v, want in zip(model.weights, want_weights):
      assert_per_replica(self, strategy, v.value, [want] * n, rtol=RTOL,
                         atol=ATOL, what=v.path)


  @parameterized.expand([(f"{n}_replicas_{name}", n, name)
                         for n in topology.REPLICA_COUNTS
                         for name in ("momentum", "adam")])
  def test_apply_gradients_outside_run_takes_them_as_the_global_ones(
      self, _, n, optimizer_name):
    # Outside strategy.run (cross-replica context) Keras takes the gradients
    # as already summed, mirrored state or sharded; it used to fail sharded.
    gradients = [np.full(w.shape, 0.1 * (i + 1), "float32")
                 for i, w in enumerate(models.initial_weights())]
    want = fresh_model()
    want_optimizer = _OPTIMIZERS[optimizer_name]()
    strategy = sharding(n)
    with strategy.scope():
      model = fresh_model()
      optimizer = _OPTIMIZERS[optimizer_name]()
    for _ in range(2):
      want_optimizer.apply_gradients(zip(gradients, want.trainable_variables))
      with strategy.scope():
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    self.assertTrue(slots(optimizer))
    for v, w in zip(model.weights, want.weights):
      assert_per_replica(self, strategy, v.value, [w.numpy()] * n, rtol=RTOL,
                         atol=ATOL, what=v.path)


class SavingTest(unittest.TestCase):
  """Slots save whole, so any replica count (or none) restores them."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    _, cls.model, cls.optimizer, _ = fit_under(sharding, 4, "adam")
    cls.saved = [v.numpy() for v in cls.optimizer.variables]
    cls.directory = tempfile.mkdtemp()

  def assert_restored(self, optimizer):
    self.assertEqual(len(optimizer.variables), len(self.saved))
    for v, want in zip(optimizer.variables, self.saved):
      np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)

  @parameterized.expand([("onto_2_replicas", 2), ("onto_no_strategy", None)])
  def test_checkpoint_round_trip(self, _, n):
    path = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer).save(
        os.path.join(self.directory, f"ckpt_{n}"))
    strategy = sharding(n) if n else None
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = fresh_model()
      optimizer = keras.optimizers.Adam(learning_rate=0.01)
      optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path).assert_consumed()
    self.assertEqual(bool(slots(optimizer)), bool(n))
    self.assert_restored(optimizer)

  @parameterized.expand([("no_strategy", None), ("mirrored_strategy", "mirrored")])
  def test_checkpoint_from_unsharded_into_4_shards(self, _, source):
    source_strategy = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
                       if source else None)
    with (source_strategy.scope() if source_strategy else
          contextlib.nullcontext()):
      model = fresh_model()
      optimizer = keras.optimizers.Adam(learning_rate=0.01)
      optimizer.build(model.trainable_variables)
    for v, value in zip(optimizer.variables, self.saved):
      v.assign(value)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(self.directory, f"from_{source}"))
    with sharding(4).scope():
      model = fresh_model()
      optimizer = keras.optimizers.Adam(learning_rate=0.01)
      optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path).assert_consumed()
    self.assertTrue(slots(optimizer))
    self.assert_restored(optimizer)

  @parameterized.expand([("onto_2_shards", "sharded"),
                         ("onto_mirrored_strategy", "mirrored"),
                         ("onto_no_strategy", None)])
  def test_keras_save_and_load(self, _, target):
    path = os.path.join(self.directory, f"model_{target}.keras")
    self.model.save(path)
    strategy = {"sharded": lambda: sharding(2),
                "mirrored": lambda: tf.distribute.MirroredStrategy(
                    ["/cpu:0", "/cpu:1"]),
                None: lambda: None}[target]()
    with strategy.scope() if strategy else contextlib.nullcontext():
      loaded = keras.models.load_model(path)
    self.assertEqual(bool(slots(loaded.optimizer)), target == "sharded")
    self.assert_restored(loaded.optimizer)


class _InterruptAtSecondEpoch(keras.callbacks.Callback):

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == 1:
      raise RuntimeError("interrupted")


@pytest.mark.slow  # Trains, saves or stops, then trains again.
class BackupAndRestoreTest(unittest.TestCase):

  def test_resumed_fit_ends_as_an_uninterrupted_one(self):
    backup_dir = tempfile.mkdtemp()

    def fit_with(callbacks):
      with sharding(4).scope():
        keras.utils.set_random_seed(0)
        model = fresh_model()
        model.compile(_OPTIMIZERS["adam"](), loss="mse", jit_compile=False)
        model.fit(*data(), batch_size=GLOBAL_BATCH, epochs=EPOCHS,
                  shuffle=False, verbose=0, callbacks=callbacks)
      return model

    with self.assertRaisesRegex(RuntimeError, "interrupted"):
      fit_with([keras.callbacks.BackupAndRestore(backup_dir),
                _InterruptAtSecondEpoch()])
    resumed = fit_with([keras.callbacks.BackupAndRestore(backup_dir)])
    _, want, want_optimizer, _ = fit_under(sharding, 4, "adam")
    for got, expected in zip(resumed.weights + resumed.optimizer.variables,
                             want.weights + want_optimizer.variables):
      np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=RTOL,
                                 atol=ATOL, err_msg=got.path)


class SparseGradientTest(unittest.TestCase):

  def test_an_embeddings_dense_step_is_said_once(self):
    # Adam on one device squares each occurrence of a row's gradient; the
    # dense sharded step squares their sum, so the user is told.
    with sharding(2).scope():
      model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                keras.layers.Embedding(10, 2),
                                keras.layers.Flatten(), keras.layers.Dense(1)])
      model.compile(keras.optimizers.Adam(), "mse", jit_compile=False)
    with self.assertLogs("absl", "WARNING") as logs:
      model.fit(np.zeros((8, 3), np.int32), np.zeros((8, 1)), batch_size=8,
                verbose=0)
    said = [line for line in logs.output if "sparse gradient" in line]
    self.assertEqual(len(said), 1, logs.output)
    self.assertIn("variable_partitioner", said[0])

  @parameterized.expand([("sgd", lambda: keras.optimizers.SGD(0.1, 0.9)),
                         ("lion", lambda: keras.optimizers.Lion(0.01))])
  def test_a_dense_step_is_exact_for_math_linear_in_the_gradient(
      self, _, optimizer):
    # Ids repeat within the batch: a row's occurrences are summed first.
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(16, 3)).astype(np.int32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    tables = []
    for strategy in (None, sharding(2)):
      with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(10, 2),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(optimizer(), "mse", jit_compile=False)
      start = model.get_weights()[0]
      model.fit(x, y, batch_size=16, epochs=3, verbose=0)
      tables.append(model.get_weights()[0])
    self.assertGreater(np.abs(tables[0] - start).max(), 1e-3)  # it trained
    np.testing.assert_allclose(tables[1], tables[0], rtol=RTOL, atol=ATOL)


class RefusalTest(unittest.TestCase):

  def test_unsupported_optimizer_is_refused_when_it_builds(self):
    strategy = sharding(2)
    with strategy.scope():
      model = fresh_model()
      optimizer = keras.optimizers.Adafactor()
      with self.assertRaisesRegex(
          NotImplementedError, r"supports the Keras optimizers SGD, Adam.*"
          r"Received: optimizer=Adafactor, whose update_step is Adafactor's"):
        optimizer.build(model.trainable_variables)

  def test_a_subclass_keeping_the_update_step_is_sharded(self):

    class LoggedAdam(keras.optimizers.Adam):

      def get_config(self):
        return {**super().get_config(), "logged": True}

    class OwnStepAdam(keras.optimizers.Adam):

      def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)

    strategy = sharding(2)
    with strategy.scope():
      model = fresh_model()
      optimizer = LoggedAdam()
      optimizer.build(model.trainable_variables)
      self.assertTrue(slots(optimizer))
      with self.assertRaisesRegex(NotImplementedError,
                                  "whose update_step is OwnStepAdam's"):
        OwnStepAdam().build(model.trainable_variables)

  def test_option_must_be_a_bool(self):
    with self.assertRaisesRegex(
        ValueError, r"Expected `shard_optimizer_state` to be True or False\. "
        r"Received: shard_optimizer_state='yes'"):
      topology.strategy_over(2, shard_optimizer_state="yes")


if __name__ == "__main__":
  unittest.main()
