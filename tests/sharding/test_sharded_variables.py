"""Sharded variables: weights cut along axis 0 over the replicas, same training.

`ReplicatorStrategy(variable_partitioner=...)` must train exactly as one
device does, with every kernel and bias sharded (the small MLP, whose last
bias of 3 rows leaves one of 4 replicas an empty shard) and with an Embedding
table whose lookups move only the rows a batch needs, on batches that split
unevenly over the replicas.
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

import assertions
from assertions import assert_per_replica
import topology
from test_custom_loop import make_step
import test_sharded_optimizer_state as zero
from replicator_strategy.sharding import creation
from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import variables as sharded_variables

RTOL, ATOL = zero.RTOL, zero.ATOL
FixedShards = tf.distribute.experimental.partitioners.FixedShardsPartitioner
MinSize = tf.distribute.experimental.partitioners.MinSizePartitioner


def every_kernel_sharded(n, **kwargs):
  return topology.strategy_over(n, variable_partitioner=FixedShards(n),
                                **kwargs)


def sharded(variables):
  return [v for v in variables
          if isinstance(v.value, sharded_variables.ShardedVariable)]


class CreationTest(unittest.TestCase):

  def test_what_is_sharded(self):
    strategy = every_kernel_sharded(4)
    with strategy.scope():
      table = tf.Variable(tf.reshape(tf.range(20.0), (10, 2)))
      scalar = tf.Variable(1.0)
      frozen = tf.Variable(tf.zeros((8,)), trainable=False)
      on_read = tf.Variable(
          tf.zeros((8,)), synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.SUM)
    self.assertIsInstance(table, sharded_variables.ShardedVariable)
    self.assertEqual([c.shape.as_list() for c in table.values],
                     [[3, 2], [3, 2], [2, 2], [2, 2]])
    self.assertEqual(list(table.shard_devices),
                     list(strategy.extended.worker_devices))
    for unsharded in (scalar, frozen, on_read):
      self.assertNotIsInstance(unsharded, sharded_variables.ShardedVariable)
    np.testing.assert_array_equal(table.numpy(),
                                  np.arange(20.0).reshape(10, 2))
    table.assign(tf.ones((10, 2)))
    np.testing.assert_array_equal(table.values[3].numpy(), np.ones((2, 2)))

  def test_optimizer_state_is_sharded_as_its_request_and_weight_say(self):
    strategy = every_kernel_sharded(4)
    with strategy.scope():
      weight = tf.Variable(tf.zeros((10, 2)))
      # Nested requests add up: the inner says flat, the outer reads whole.
      with creation.requesting(reads_whole=True), creation.requesting(
          flat=True):
        flat = tf.Variable(tf.zeros((3, 3)))
        with strategy.extended.colocate_vars_with(weight):
          average = tf.Variable(tf.zeros((10, 2)))
      with strategy.extended.colocate_vars_with(weight):
        moment = tf.Variable(tf.zeros((10, 2)))
    self.assertIsInstance(flat.layout, layout_lib.FlatLayout)
    self.assertEqual([c.shape.as_list() for c in flat.values], [[3]] * 4)
    self.assertIsNone(flat.replica_reads)  # Refused inside a replica.
    for state, reads in ((average, "whole"), (moment, "shard")):
      self.assertIs(state.layout, weight.layout)
      self.assertEqual(state.replica_reads, reads)

  def test_one_shard_or_one_replica_stays_mirrored(self):
    for strategy in (topology.strategy_over(
        4, variable_partitioner=MinSize(min_shard_bytes=1 << 20,
                                        max_shards=4)),
                     every_kernel_sharded(1)):
      with strategy.scope():
        v = tf.Variable(tf.zeros((10, 2)))
      self.assertNotIsInstance(v, sharded_variables.ShardedVariable)

  def test_bad_partitioners_are_refused(self):
    with self.assertRaisesRegex(ValueError, "variable_partitioner.*callable"):
      topology.strategy_over(2, variable_partitioner=4)
    strategy = topology.strategy_over(
        2, variable_partitioner=lambda shape, dtype: [1, 2])
    with self.assertRaisesRegex(ValueError, "along axis 0 only.*\\[1, 2\\]"):
      with strategy.scope():
        tf.Variable(tf.zeros((4, 4)))

  @parameterized.expand([
      ("negative", [-2, 1], ValueError),
      ("zero", [0, 1], ValueError),
      ("float", [2.0, 1], TypeError),
      ("none", None, TypeError),
      ("an_int_not_a_list", 2, TypeError),
  ])
  def test_what_a_partitioner_returns_is_checked_naming_the_variable(
      self, _, returned, error):
    # A negative or zero count used to make a mirrored variable silently; a
    # float or None failed with a bare TypeError from inside the strategy.
    strategy = topology.strategy_over(
        2, variable_partitioner=lambda shape, dtype: returned)
    with self.assertRaises(error) as raised:
      with strategy.scope():
        tf.Variable(tf.zeros((4, 4)), name="table")
    message = str(raised.exception)
    self.assertIn("Expected `variable_partitioner` to return the number of "
                  "shards along each axis: a list of 2 ints", message)
    self.assertIn(f"Received: variable_partitioner(shape=(4, 4), ...) = "
                  f"{returned!r} for the variable 'table'.", message)

  @parameterized.expand([(f"{n}_replicas{'_in_a_cond' if in_cond else ''}",
                          n, in_cond)
                         for n in (2, 4) for in_cond in (False, True)])
  def test_reads_whole_in_a_replica_and_gradients_are_summed_shards(
      self, _, n, in_cond):
    strategy = every_kernel_sharded(n)
    value = np.arange(10.0 * 3).reshape(10, 3).astype(np.float32)
    with strategy.scope():
      v = tf.Variable(value)

    @tf.function
    def step():
      ctx = tf.distribute.get_replica_context()
      scale = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
      read = lambda: tf.convert_to_tensor(v)
      with tf.GradientTape() as tape:
        # In a tf.cond the gather and its gradient are run-time collectives.
        whole = tf.cond(scale > 0, read, lambda: tf.zeros_like(value)) if (
            in_cond) else read()
        loss = tf.reduce_sum(whole * whole) * scale
      return whole, tape.gradient(loss, v)

    wholes, grads = strategy.run(step)
    assert_per_replica(self, strategy, wholes, [value] * n, rtol=0, atol=0,
                       what="whole read")
    # d/dv of sum over replicas of (r + 1) * v^2: the rows of each shard.
    summed = 2 * value * n * (n + 1) / 2
    want = [v.layout.shard(summed, g) for g in range(n)]
    assert_per_replica(self, strategy, grads, want, rtol=1e-6, atol=0,
                       what="gradient")


class FitTest(unittest.TestCase):

  # Each path on 4 replicas (nesterov, amsgrad and clipnorm are variants of
  # momentum, adam and global_clipnorm's paths); merge and tf.cond on 2.
  @parameterized.expand(
      [(f"4_replicas_{name}", 4, name) for name in zero._OPTIMIZERS
       if name not in ("nesterov", "amsgrad", "adam_clipnorm")] +
      [(f"2_replicas_{name}", 2, name)
       for name in ("momentum", "momentum_accumulation")] +
      [("4_replicas_adam_spe3", 4, "adam", 3)])
  def test_every_weight_sharded_fit_matches_no_strategy(
      self, _, n, optimizer_name, steps_per_execution=1):
    model = self.assert_fit_matches_no_strategy(
        every_kernel_sharded(n), optimizer_name, steps_per_execution)
    self.assertEqual(len(sharded(model.weights)), len(model.weights))

  def test_clipping_with_some_weights_sharded_matches_no_strategy(self):
    # Only the 8x16 kernel is big enough to cut. Clipping sums every
    # gradient first; the mirrored weights' update (its all-reduce skipped)
    # runs before the sharded kernel's, which still takes its gradient whole.
    strategy = topology.strategy_over(
        4, variable_partitioner=MinSize(min_shard_bytes=256, max_shards=4))
    model = self.assert_fit_matches_no_strategy(strategy, "adam_clipnorm")
    self.assertEqual(len(sharded(model.weights)), 1)

  def assert_fit_matches_no_strategy(self, strategy, optimizer_name,
                                     steps_per_execution=1):
    """Fits as `zero.fit` does, compares with no strategy; returns the model."""
    model, optimizer, losses = zero.fit(optimizer_name, strategy,
                                        steps_per_execution)
    want_losses, want_weights, want_optimizer = zero.reference_fit(
        optimizer_name)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for v, want in zip(model.weights, want_weights):
      np.testing.assert_allclose(v.numpy(), want, rtol=RTOL, atol=ATOL,
                                 err_msg=v.path)
    self.assertEqual(len(optimizer.variables), len(want_optimizer))
    for v, want in zip(optimizer.variables, want_optimizer):
      np.testing.assert_allclose(v.numpy(), want, rtol=RTOL, atol=ATOL,
                                 err_msg=v.path)
    return model


VOCABULARY, LENGTH, ROWS, BATCH = 40, 5, 58, 16


def embedding_data():
  rng = np.random.default_rng(1)
  ids = rng.integers(0, VOCABULARY, size=(ROWS, LENGTH)).astype(np.int32)
  y = rng.normal(size=(ROWS, 3)).astype(np.float32)
  return ids, y


def embedding_model():
  return keras.Sequential([
      keras.Input((LENGTH,), dtype="int32"),
      keras.layers.Embedding(VOCABULARY, 4),
      keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(3),
  ])


@functools.cache
def embedding_initial_weights():
  keras.utils.set_random_seed(0)
  return tuple(embedding_model().get_weights())


def fit_embedding(strategy):
  """Fit, evaluate and predict; 58 rows split unevenly in the last batch."""
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = embedding_model()
    model.set_weights(embedding_initial_weights())
    model.compile(keras.optimizers.Adam(0.05), "mse", jit_compile=False)
    ids, y = embedding_data()
    losses = model.fit(ids, y, batch_size=BATCH, epochs=2, shuffle=False,
                       verbose=0).history["loss"]
    return (model, losses, model.evaluate(ids, y, batch_size=BATCH, verbose=0),
            model.predict(ids, batch_size=BATCH, verbose=0))


@functools.cache
def one_device_embedding():
  """`fit_embedding` with no strategy; callers must not change it."""
  return fit_embedding(None)


class EmbeddingTest(unittest.TestCase):

  @parameterized.expand([
      ("2_replicas", lambda: every_kernel_sharded(2)),
      ("4_replicas", lambda: every_kernel_sharded(4)),
      # Only the table is big enough to cut; the Dense layer's slots are
      # then sharded flat by shard_optimizer_state.
      ("4_replicas_table_only_with_sharded_state", lambda: topology.strategy_over(
          4, variable_partitioner=MinSize(min_shard_bytes=128, max_shards=4),
          shard_optimizer_state=True)),
  ])
  def test_fit_evaluate_predict_match_no_strategy_with_row_lookups(
      self, _, make_strategy):
    strategy = make_strategy()
    gathered = []
    gather_whole = sharded_variables.gather_whole

    def recording(ctx, layout, *args):
      gathered.append(layout.shape)
      return gather_whole(ctx, layout, *args)

    with mock.patch.object(sharded_variables, "gather_whole", recording):
      model, losses, evaluated, predicted = fit_embedding(strategy)
    want_model, want_losses, want_evaluated, want_predicted = (
        one_device_embedding())
    table = model.layers[0].embeddings
    self.assertIsInstance(table.value, sharded_variables.ShardedVariable)
    self.assertNotIn((VOCABULARY, 4), gathered)  # Rows moved, not the table.
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(evaluated, want_evaluated, rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(predicted, want_predicted, rtol=RTOL,
                               atol=ATOL)
    for v, want in zip(model.weights + model.optimizer.variables,
                       want_model.weights + want_model.optimizer.variables):
      np.testing.assert_allclose(v.numpy(), want.numpy(), rtol=RTOL,
                                 atol=ATOL, err_msg=v.path)


  def test_ids_too_large_are_refused_as_on_one_device(self):
    self.check_ids_outside_the_table_are_refused(VOCABULARY)

  @pytest.mark.slow  # The same check as the test above, its other bound.
  def test_ids_too_negative_are_refused_as_on_one_device(self):
    self.check_ids_outside_the_table_are_refused(-VOCABULARY - 1)

  def check_ids_outside_the_table_are_refused(self, bad_id):
    ids, y = embedding_data()
    ids[3, 1] = bad_id
    with self.assertRaises(tf.errors.InvalidArgumentError):  # One CPU device.
      embedding_model()(ids)
    strategy = every_kernel_sharded(2)
    with strategy.scope():
      model = embedding_model()
      model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    with self.assertRaisesRegex(
        tf.errors.InvalidArgumentError,
        rf"Embedding ids must be rows of the table, in \[-{VOCABULARY}, "
        rf"{VOCABULARY}\)"):
      model.fit(ids, y, batch_size=BATCH, epochs=1, verbose=0)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "Embedding ids must be rows"):
      model.predict(ids, batch_size=BATCH, verbose=0)

  def test_negative_ids_count_from_the_end_as_on_one_device(self):
    ids, _ = embedding_data()
    ids[::7, 2] = -1
    ids[::5, 0] = -VOCABULARY
    want = embedding_model()
    want.set_weights(embedding_initial_weights())
    strategy = every_kernel_sharded(4)
    with strategy.scope():
      model = embedding_model()
      model.set_weights(embedding_initial_weights())
    np.testing.assert_allclose(
        model.predict(ids, batch_size=BATCH, verbose=0),
        want.predict(ids, batch_size=BATCH, verbose=0), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
class RecurrentTest(unittest.TestCase):

  def test_lstm_reads_its_sharded_kernels_inside_its_loop(self):
    # Keras's RNN steps in a tf.while_loop, where replicas can't meet: the
    # kernels are gathered before the loop.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, 3)).astype(np.float32)
    y = rng.normal(size=(64, 2)).astype(np.float32)

    def build():
      return keras.Sequential([keras.Input((6, 3)), keras.layers.LSTM(8),
                               keras.layers.Dense(2)])

    keras.utils.set_random_seed(0)
    start = build().get_weights()

    def fit(strategy):
      with strategy.scope() if strategy else contextlib.nullcontext():
        model = build()
        model.set_weights(start)
        model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=False)
        losses = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                           verbose=0).history["loss"]
      return model, losses

    model, losses = fit(every_kernel_sharded(4))
    want_model, want_losses = fit(None)
    self.assertEqual(len(sharded(model.weights)), len(model.weights))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for v, want in zip(model.weights, want_model.weights):
      np.testing.assert_allclose(v.numpy(), want.numpy(), rtol=RTOL,
                                 atol=ATOL, err_msg=v.path)


@pytest.mark.slow
class MixedPrecisionTest(unittest.TestCase):

  def test_mixed_float16_fit_matches_no_strategy(self):
    # float16 compute, float32 weights, Keras's LossScaleOptimizer around Adam.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      model, losses, _, predicted = fit_embedding(every_kernel_sharded(4))
      want_model, want_losses, _, want_predicted = fit_embedding(None)
    finally:
      keras.mixed_precision.set_global_policy("float32")
    self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    self.assertEqual(len(sharded(model.weights)), len(model.weights))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    np.testing.assert_allclose(predicted, want_predicted, rtol=1e-3,
                               atol=1e-3)
    for v, want in zip(model.weights, want_model.weights):
      np.testing.assert_allclose(v.numpy(), want.numpy(), rtol=1e-3,
                                 atol=1e-3, err_msg=v.path)


class CustomLoopTest(unittest.TestCase):

  @parameterized.expand([("2_replicas_momentum", 2, "momentum"),
                         ("4_replicas_adam", 4, "adam")])
  def test_apply_gradients_in_run_matches_one_device(self, _, n,
                                                     optimizer_name):
    strategy = every_kernel_sharded(n)
    with strategy.scope():
      model = zero.fresh_model()
      optimizer = zero._OPTIMIZERS[optimizer_name]()
    step = make_step(model, optimizer)

    @tf.function
    def train_step(batch):
      return strategy.reduce("sum", strategy.run(step, args=batch), axis=None)

    losses = [float(train_step(batch)) for batch in
              strategy.experimental_distribute_dataset(zero.dataset())]
    want_losses, want_weights = zero.reference_loop(optimizer_name)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    self.assertEqual(len(sharded(model.weights)), len(model.weights))
    for v, want in zip(model.weights, want_weights):
      np.testing.assert_allclose(v.numpy(), want, rtol=RTOL, atol=ATOL,
                                 err_msg=v.path)


class SavingTest(unittest.TestCase):
  """Sharded weights and state save whole: any replica count (or none) loads."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    _, cls.model, cls.optimizer, _ = zero.fit_under(every_kernel_sharded, 4,
                                                    "adam")
    cls.saved = [v.numpy() for v in cls.model.weights + cls.optimizer.variables]
    cls.directory = tempfile.mkdtemp()

  def built(self, strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = zero.fresh_model()
      optimizer = keras.optimizers.Adam(learning_rate=0.01)
      optimizer.build(model.trainable_variables)
    return model, optimizer

  def assert_restored(self, model, optimizer):
    got = model.weights + optimizer.variables
    self.assertEqual(len(got), len(self.saved))
    for v, want in zip(got, self.saved):
      np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)

  @parameterized.expand([("onto_2_shards", 2), ("onto_no_strategy", None)])
  def test_checkpoint_round_trip(self, _, n):
    path = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer).save(
        os.path.join(self.directory, f"ckpt_{n}"))
    model, optimizer = self.built(every_kernel_sharded(n) if n else None)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path).assert_consumed()
    self.assertEqual(bool(sharded(model.weights)), bool(n))
    self.assert_restored(model, optimizer)
    # And back: from the unsharded copy into 4 shards.
    back = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(self.directory, f"back_{n}"))
    model, optimizer = self.built(every_kernel_sharded(4))
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        back).assert_consumed()
    self.assert_restored(model, optimizer)

  @parameterized.expand([("onto_mirrored_strategy", "mirrored"),
                         ("onto_no_strategy", None)])
  def test_keras_save_and_load(self, _, target):
    path = os.path.join(self.directory, f"model_{target}.keras")
    self.model.save(path)
    strategy = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
                if target else None)
    with strategy.scope() if strategy else contextlib.nullcontext():
      loaded = keras.models.load_model(path)
    self.assert_restored(loaded, loaded.optimizer)
    weights = os.path.join(self.directory, "sharded.weights.h5")
    self.model.save_weights(weights)
    with every_kernel_sharded(2).scope():
      model = zero.fresh_model()
    model.load_weights(weights)
    for v, want in zip(model.weights, self.saved):
      np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)


  def test_an_exported_saved_model_serves_the_whole_weights(self):
    assertions.assert_exported_serves_as_the_model(self, self.model,
                                                   zero.data()[0])


@pytest.mark.slow  # Trains, saves or stops, then trains again.
class BackupAndRestoreTest(unittest.TestCase):

  def test_resumed_fit_ends_as_an_uninterrupted_one(self):
    backup_dir = tempfile.mkdtemp()

    def fit_with(callbacks):
      with every_kernel_sharded(4).scope():
        model = zero.fresh_model()
        model.compile(zero._OPTIMIZERS["adam"](), loss="mse",
                      jit_compile=False)
        model.fit(*zero.data(), batch_size=zero.GLOBAL_BATCH,
                  epochs=zero.EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)
      return model

    with self.assertRaisesRegex(RuntimeError, "interrupted"):
      fit_with([keras.callbacks.BackupAndRestore(backup_dir),
                zero._InterruptAtSecondEpoch()])
    resumed = fit_with([keras.callbacks.BackupAndRestore(backup_dir)])
    self.assertEqual(len(sharded(resumed.weights)), len(resumed.weights))
    _, want_weights, want_optimizer = zero.reference_fit("adam")
    got_all = resumed.weights + resumed.optimizer.variables
    want_all = list(want_weights) + list(want_optimizer)
    self.assertEqual(len(got_all), len(want_all))
    for got, want in zip(got_all, want_all):
      np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL,
                                 err_msg=got.path)


class RefusalTest(unittest.TestCase):

  def test_an_optimizer_that_is_not_elementwise_is_refused(self):
    with every_kernel_sharded(2).scope():
      model = zero.fresh_model()
      with self.assertRaisesRegex(
          NotImplementedError,
          r"ReplicatorStrategy\(variable_partitioner=...\) supports.*"
          r"Received: optimizer=Lamb"):
        keras.optimizers.Lamb().build(model.trainable_variables)

  def test_clipping_with_accumulation_is_refused(self):
    strategy = every_kernel_sharded(2)
    with strategy.scope():
      model = zero.fresh_model()
      model.compile(keras.optimizers.SGD(clipnorm=1.0,
                                         gradient_accumulation_steps=2),
                    "mse", jit_compile=False)
    with self.assertRaisesRegex(NotImplementedError,
                                "clipping.*gradient_accumulation_steps"):
      model.fit(*zero.data(), batch_size=zero.GLOBAL_BATCH, verbose=0)
