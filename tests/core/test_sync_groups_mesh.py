"""Sync groups composed with the other axes: sharded state, tensor parallel, ZeRO-3.

Each group shards (or splits) over its own replicas, and the rounds average
between groups, so with plain SGD averaging every step (H = 1) `fit` and a
custom loop equal synchronous training of the same combination without
groups (the mean of θ - η·gᵢ is θ - η·mean(gᵢ)); at H > 1 the groups differ
between rounds and agree after `fit`; a checkpoint between rounds restores
every group's weights and optimizer state; DiLoCo's outer step with
overlapped rounds trains as the same groups without the combination's axis.
On 4 logical CPUs: 2 groups of 2 replicas (sharded state, ZeRO-3), 2 groups
of 1 replica over 2 devices (tensor parallel). Whole fits that only add
cases are marked slow.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

from assertions import assert_per_replica
import models
import replicator_strategy as rs
import topology
from test_sharded_variables import embedding_data
from test_sharded_variables import embedding_initial_weights
from test_sharded_variables import embedding_model
from test_sync_groups import ATOL, GLOBAL_BATCH, RTOL, data
from replicator_strategy.sharding import variables as sharded_variables

EPOCHS = 2  # 12 steps of 16 rows.
TESTS = pathlib.Path(__file__).resolve().parent.parent


def momentum():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def nesterov():
  """DiLoCo's outer optimizer."""
  return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def mlp():
  """`models.small_mlp` from its initial weights, its layers named for a
  layout map."""
  model = keras.Sequential([
      keras.Input((8,)), keras.layers.Dense(16, "tanh", name="up"),
      keras.layers.Dense(3, name="down")])
  model.set_weights(models.initial_weights())
  return model


def compiled_model(strategy, optimizer=None):
  with strategy.scope():
    model = mlp()
    model.compile((optimizer or (lambda: keras.optimizers.SGD(0.1)))(), "mse")
  return model


def fit(strategy, optimizer=None, callbacks=(), rows=None):
  """`rows` of the data (default all): 55 ends each epoch with 7 rows."""
  model = compiled_model(strategy, optimizer)
  x, y = (a[:rows] for a in data())
  history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS,
                      shuffle=False, verbose=0, callbacks=list(callbacks))
  return model, history.history["loss"]


def custom_loop(strategy, steps=4):
  """`steps` steps of SGD in a custom loop, `sync_groups_step` after each;
  each group's loss is the mean over its share of the global batch."""
  with strategy.scope():
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1)
  x, y = data()
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).take(
          steps))
  group_batch = GLOBAL_BATCH // strategy.num_sync_groups

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(
          tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1),
          global_batch_size=group_batch)
    optimizer.apply_gradients(zip(tape.gradient(
        loss, model.trainable_variables), model.trainable_variables))

  step = tf.function(lambda x, y: strategy.run(replica_step, (x, y)))
  strategy.sync_groups_step(0, model.trainable_variables)
  for x, y in dataset:
    step(x, y)
    strategy.sync_groups_step(optimizer.iterations,
                              model.trainable_variables)
  return model


def group_step(model):
  """A step that moves each group's weights and momentum its own way, as
  steps between rounds do."""
  group = tf.distribute.get_replica_context().sync_group
  x = tf.ones([2, 8]) * tf.cast(group + 1, tf.float32)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model(x))
  model.optimizer.apply_gradients(zip(
      tape.gradient(loss, model.trainable_variables),
      model.trainable_variables))


def local_values(strategy, variable):
  """Each of this worker's components (or parts) of `variable`, as arrays."""
  value = variable.value if isinstance(variable, keras.Variable) else variable
  return [c.numpy() for c in value.values]


class ComposedTest:
  """The checks every combination passes; a subclass says how to build it."""

  def strategy(self, **grouping):
    """The combination's strategy, with `grouping` (sync_groups, ...) or
    without groups."""
    raise NotImplementedError

  def plain_strategy(self, **grouping):
    """The same replicas and `grouping`, without the combination's axis."""
    raise NotImplementedError

  def group_parts(self, strategy, variable):
    """Each group's components (or parts) of `variable`, as arrays."""
    parts = local_values(strategy, variable)
    n = len(parts) // strategy.num_sync_groups
    return [parts[i:i + n] for i in range(0, len(parts), n)]

  def assert_groups_agree(self, strategy, variable, agree=True):
    groups = self.group_parts(strategy, variable)
    for one, other in zip(groups[0], groups[1]):
      if agree:
        np.testing.assert_array_equal(one, other)
      else:
        self.assertFalse(np.allclose(one, other))

  def test_fit_averaging_every_sgd_step_is_synchronous(self):
    model, losses = fit(self.strategy(sync_groups=2, average_every=1))
    want, want_losses = fit(self.strategy())
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for got, expected in zip(model.get_weights(), want.get_weights()):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)

  def test_custom_loop_averaging_every_sgd_step_is_synchronous(self):
    model = custom_loop(self.strategy(sync_groups=2, average_every=1))
    want = custom_loop(self.strategy())
    for got, expected in zip(model.get_weights(), want.get_weights()):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)

  @pytest.mark.slow  # Whole fits that add cases.
  def test_diloco_overlapped_trains_as_without_the_axis(self):
    # Momentum inside each group, DiLoCo's outer step, overlapped rounds.
    grouping = lambda: dict(sync_groups=2, average_every=2,
                            outer_optimizer=nesterov(),
                            overlap_averaging=True)
    strategy = self.strategy(**grouping())
    model, losses = fit(strategy, momentum)
    want, want_losses = fit(self.plain_strategy(**grouping()), momentum)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for got, expected in zip(model.get_weights(), want.get_weights()):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    state = strategy.sync_groups_state
    # The rounds' copies of each weight lie as it does.
    for weight, anchor, snapshot in zip(model.trainable_weights, state.anchors,
                                        state.snapshots):
      for copy in (anchor, snapshot):
        self.assertIs(type(copy), type(weight.value))
        self.assertEqual([c.device for c in copy.values],
                         [c.device for c in weight.value.values])

  @pytest.mark.slow  # Whole fits that add cases.
  def test_groups_differ_between_rounds_and_agree_after_fit(self):
    strategy = self.strategy(sync_groups=2, average_every=4)
    seen = {}

    parts_of = self.group_parts

    class Look(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        seen[int(self.model.optimizer.iterations.numpy())] = parts_of(
            strategy, self.model.layers[0].kernel)

    model, losses = fit(strategy, momentum, callbacks=[Look()])
    self.assertLess(losses[-1], losses[0])
    for step in (3, 4, 5):
      for one, other in zip(*seen[step]):
        if step == 4:  # A round.
          np.testing.assert_array_equal(one, other)
        else:
          self.assertFalse(np.allclose(one, other))
    for variable in model.weights:
      self.assert_groups_agree(strategy, variable)
    # Each group's optimizer state stays its own.
    self.assert_groups_agree(strategy, model.optimizer.momentums[0],
                             agree=False)

  def test_predict_between_rounds_answers_with_the_first_group(self):
    strategy = self.strategy(sync_groups=2, average_every=1000)
    model = compiled_model(strategy, momentum)
    with strategy.scope():
      model.optimizer.build(model.trainable_variables)
    tf.function(lambda: strategy.run(group_step, (model,)))()
    kernel = local_values(strategy, model.layers[0].kernel)
    self.assert_groups_agree(strategy, model.layers[0].kernel, agree=False)
    one = mlp()
    one.set_weights(model.get_weights())
    x = data()[0][:GLOBAL_BATCH]
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               one.predict(x, verbose=0), rtol=RTOL,
                               atol=ATOL)
    for got, want in zip(local_values(strategy, model.layers[0].kernel),
                         kernel):  # Each group keeps its own.
      np.testing.assert_array_equal(got, want)

  def test_a_checkpoint_between_rounds_restores_every_group(self):
    strategy = self.strategy(sync_groups=2, average_every=1000,
                             outer_optimizer=nesterov(),
                             overlap_averaging=True)
    model = compiled_model(strategy, momentum)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                     sync_groups=strategy.sync_groups_state)
    x, y = data()
    model.fit(x[:3 * GLOBAL_BATCH], y[:3 * GLOBAL_BATCH],
              batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    # fit ended with a round; between rounds each group has its own.
    step = tf.function(lambda: strategy.run(group_step, (model,)))
    step()
    state = strategy.sync_groups_state
    variables = [model.layers[0].kernel, model.optimizer.momentums[0],
                 *state.anchors, *state.snapshots]
    saved = [local_values(strategy, v) for v in variables]
    self.assert_groups_agree(strategy, variables[0], agree=False)
    self.assert_groups_agree(strategy, variables[1], agree=False)
    with tempfile.TemporaryDirectory() as directory:
      path = checkpoint.write(os.path.join(directory, "ckpt"))
      step()
      for v in variables[2:]:
        for component in v.values:
          component.assign(tf.zeros_like(component))
      checkpoint.read(path).assert_consumed()
    for v, values in zip(variables, saved):
      for got, want in zip(local_values(strategy, v), values):
        np.testing.assert_array_equal(got, want)


class StateShardingTest(ComposedTest, unittest.TestCase):
  """shard_optimizer_state=True: each group's slots over its 2 replicas."""

  def strategy(self, **grouping):
    return topology.strategy_over(4, shard_optimizer_state=True, **grouping)

  def plain_strategy(self, **grouping):
    return topology.strategy_over(4, **grouping)

  def test_each_group_shards_its_slots_over_its_replicas(self):
    strategy = self.strategy(sync_groups=2, average_every=4)
    model = compiled_model(strategy, momentum)
    with strategy.scope():
      model.optimizer.build(model.trainable_variables)
    velocity = model.optimizer.momentums[0]  # The 8x16 kernel's.
    self.assertEqual([c.shape.as_list() for c in velocity.value.values],
                     [[64]] * 4)
    velocity.assign(tf.reshape(tf.range(128.0), [8, 16]))
    assert_per_replica(self, strategy, velocity.value,
                       [np.arange(64.0), np.arange(64.0, 128.0)] * 2)
    np.testing.assert_array_equal(velocity.numpy(),
                                  np.arange(128.0).reshape(8, 16))


class TensorParallelTest(ComposedTest, unittest.TestCase):
  """A (batch, model) mesh: 2 groups of 1 replica over 2 devices, the MLP's
  first layer column-parallel and its second row-parallel."""

  def strategy(self, **grouping):
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    return rs.ReplicatorStrategy(layout_map=layout_map, **grouping)

  def plain_strategy(self, **grouping):
    return topology.strategy_over(2, **grouping)

  def test_by_hand_a_variable_on_a_second_device_averages_there(self):
    strategy = rs.ReplicatorStrategy(
        devices=[f"/cpu:{i}" for i in range(4)], devices_per_replica=2,
        sync_groups=2)
    with strategy.scope(), strategy.logical_device_for_variables(1):
      v = tf.Variable(0.0)

    def set_to_group():
      v.assign(tf.cast(tf.distribute.get_replica_context().sync_group,
                       tf.float32))

    strategy.run(set_to_group)
    assert_per_replica(self, strategy, v, [0.0, 1.0])
    strategy.average_sync_groups([v])
    assert_per_replica(self, strategy, v, [0.5, 0.5])
    self.assertEqual([c.device[-5:] for c in v.values], ["CPU:1", "CPU:3"])


@pytest.mark.slow  # A fresh process on 8 logical CPUs.
class TensorParallelZeroThreeTest(unittest.TestCase):
  """2 groups x 2 replicas x 2 devices, each kernel split over a replica's
  devices and sharded over its group's replicas
  (`sync_groups_sharded_parts_main.py`)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, str(TESTS / "sync_groups_sharded_parts_main.py")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode:
      raise AssertionError(done.stderr[-3000:])
    cls.results = json.loads(done.stdout.splitlines()[-1])

  def test_each_device_holds_a_shard_of_a_part(self):
    self.assertEqual(self.results["kinds"].count(
        "SyncGroupShardedSplitVariable"), 2, self.results["kinds"])
    # The 8 x 16 kernel: 2 parts of 8 x 8, each in 2 shards of 4 x 8.
    self.assertEqual(self.results["kernel_shards"], [[4, 8]] * 8)

  def test_fit_averaging_every_sgd_step_is_synchronous(self):
    for got, want in zip(self.results["grouped"], self.results["synchronous"],
                         strict=True):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  def test_diloco_overlapped_trains_as_without_the_sharding(self):
    for got, want in zip(self.results["diloco"],
                         self.results["diloco_unsharded"], strict=True):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  def test_a_checkpoint_between_rounds_restores_every_group(self):
    self.assertTrue(self.results["groups_differ_between_rounds"])
    self.assertTrue(self.results["checkpoint_restores_every_group"])


class ZeroThreeTest(ComposedTest, unittest.TestCase):
  """variable_partitioner: each group's weights cut in 2 shards over its 2
  replicas."""

  def strategy(self, **grouping):
    return topology.strategy_over(
        4, variable_partitioner=tf.distribute.experimental.partitioners
        .FixedShardsPartitioner(2), **grouping)

  def plain_strategy(self, **grouping):
    return topology.strategy_over(4, **grouping)

  def test_each_group_shards_its_weights_over_its_replicas(self):
    strategy = self.strategy(sync_groups=2, average_every=4)
    model = compiled_model(strategy)
    kernel = model.layers[0].kernel
    self.assertEqual([c.shape.as_list() for c in kernel.value.values],
                     [[4, 16]] * 4)
    whole = models.initial_weights()[0]
    assert_per_replica(self, strategy, kernel.value, [whole[:4], whole[4:]] * 2)

  def test_an_embedding_table_looks_up_rows_within_each_group(self):
    def fit_table(strategy):
      with strategy.scope():
        model = embedding_model()
        model.set_weights(embedding_initial_weights())
        model.compile(keras.optimizers.SGD(0.1), "mse")
      ids, y = embedding_data()
      history = model.fit(ids, y, batch_size=GLOBAL_BATCH, shuffle=False,
                          verbose=0)
      return model, history.history["loss"]

    model, losses = fit_table(self.strategy(sync_groups=2, average_every=1))
    self.assertIsInstance(model.layers[0].embeddings.value,
                          sharded_variables.ShardedVariable)
    # Synchronous, the table cut in 4: cut in 2 over 4 replicas, the two
    # holding no rows would get no gradient.
    want, want_losses = fit_table(topology.strategy_over(
        4, variable_partitioner=tf.distribute.experimental.partitioners
        .FixedShardsPartitioner(4)))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for got, expected in zip(model.get_weights(), want.get_weights()):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)

  def test_an_uneven_last_batch_averages_each_shard_by_the_groups_rows(self):
    # 7 rows: 2 + 2 for group 0, 2 + 1 for group 1; each group's shard
    # counts its group's rows.
    model, losses = fit(self.strategy(sync_groups=2, average_every=1),
                        rows=55)
    want, want_losses = fit(self.strategy(), rows=55)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for got, expected in zip(model.get_weights(), want.get_weights()):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


if __name__ == "__main__":
  unittest.main()
