"""Tensor parallelism with ZeRO-3: split weights sharded over the replicas too.

On a (2, 2) mesh of 4 logical CPUs, with `variable_partitioner` or a layout
that names the batch axis, every device holds 1/4 of each split weight and of
its Adam slots: a Megatron MLP (also clipped, or accumulating gradients) and
a transformer block (its token table split by columns, looked up row by row)
train with `fit` as on one device, part j of a weight is gathered (and its
gradient reduce-scattered) on device j of every replica, and weights files
move to and from a model with no strategy.
"""

import os
import tempfile
import unittest
from unittest import mock

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.model_parallel import sharded_parts
from replicator_strategy.sharding import exchange
import test_layout_map as megatron

PARTITIONER = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)


def partitioned_layout():
  """The Megatron layout, with the first Dense column-parallel too."""
  layout_map = megatron.megatron_layout(2)
  layout_map[".*embed/kernel"] = (None, "model")
  return layout_map


def batch_named_layout():
  """The same splits, each weight sharded over the replicas by its layout."""
  layout_map = keras.distribution.LayoutMap(megatron.mesh(2))
  layout_map[".*embed/kernel"] = ("batch", "model")
  layout_map[".*embed/bias"] = ("batch",)
  layout_map[".*up/kernel"] = ("batch", "model")
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", "batch")
  return layout_map


def assert_a_quarter_per_device(test, variables):
  """Each of the 4 devices holds at most 1.1 x a quarter of `variables`'
  bytes, counted from each part's or shard's device."""
  total, by_device = 0, {}
  for variable in variables:
    value = variable.value
    total += np.prod(variable.shape) * value.dtype.size
    for component in value.values:
      by_device[component.device] = by_device.get(component.device, 0) + (
          np.prod(component.shape) * component.dtype.size)
  test.assertEqual(len(by_device), 4, by_device)
  test.assertLessEqual(max(by_device.values()), 1.1 * total / 4, by_device)


def recording_gathers():
  """A patch of `exchange.all_gather` and the {logical device: devices its
  results landed on} it records."""
  landed = {}
  all_gather = exchange.all_gather

  def recording(ctx, value, axis, logical_device=0):
    gathered = all_gather(ctx, value, axis, logical_device)
    landed.setdefault(logical_device, set()).add(gathered.device[-5:])
    return gathered

  return mock.patch.object(exchange, "all_gather", recording), landed


class MegatronMlpTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.one_device = megatron.train(megatron.mlp())

  @parameterized.expand([
      ("variable_partitioner", partitioned_layout, PARTITIONER),
      # up/bias is split only (a 1-D layout names one axis), down/bias
      # mirrored: the quarter holds weight by weight.
      ("layouts_naming_the_batch_axis", batch_named_layout, None),
  ])
  def test_fit_on_a_2_by_2_mesh_equals_one_device_a_quarter_per_device(
      self, name, layout_map, partitioner):
    strategy = rs.ReplicatorStrategy(layout_map=layout_map(),
                                     variable_partitioner=partitioner)
    with strategy.scope():
      model = megatron.mlp()
    kinds = {v.path.split("/", 1)[1]: type(v.value).__name__
             for v in model.weights}
    self.assertEqual(kinds["up/kernel"], "ShardedSplitVariable")
    self.assertEqual(kinds["down/kernel"], "ShardedSplitVariable")
    patch, landed = recording_gathers()
    with patch:
      got = megatron.train(model)
    # Part j of a split weight is gathered on device j of each replica.
    self.assertEqual(landed[1], {"CPU:1", "CPU:3"})
    self.assertEqual(landed[0], {"CPU:0", "CPU:2"})
    np.testing.assert_allclose(got["loss"], self.one_device["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["predict"], self.one_device["predict"],
                               rtol=1e-5, atol=1e-6)
    for want, have in zip(self.one_device["weights"], got["weights"]):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    slots = [v for v in model.optimizer.variables
             if "up_kernel" in v.path or "down_kernel" in v.path]
    self.assertEqual({type(v.value).__name__ for v in slots},
                     {"ShardedSplitVariable"})
    if partitioner:
      assert_a_quarter_per_device(
          self, model.weights + model.optimizer.variables)
    else:
      for variable in [model.get_layer(n).kernel for n in ("embed", "up", "down")
                       ] + slots:
        assert_a_quarter_per_device(self, [variable])

  @parameterized.expand([
      # Keras sums the gradients before clipping: the shards' are gathered.
      ("clipping", {"global_clipnorm": 0.5}),
      # The accumulators are sharded as the weights, updated in a tf.cond.
      ("gradient_accumulation", {"gradient_accumulation_steps": 2}),
  ])
  @pytest.mark.slow
  def test_adam_options_train_as_one_device(self, _, adam_options):

    def mlp():
      model = megatron.mlp()
      model.compile(keras.optimizers.Adam(0.01, **adam_options), "mse",
                    steps_per_execution=3)
      return model

    want = megatron.train(mlp())
    strategy = rs.ReplicatorStrategy(layout_map=partitioned_layout(),
                                     variable_partitioner=PARTITIONER)
    with strategy.scope():
      model = mlp()
    got = megatron.train(model)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for w, h in zip(want["weights"], got["weights"]):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)
    up = {type(v.value).__name__ for v in model.optimizer.variables
          if "up_kernel" in v.path}
    self.assertEqual(up, {"ShardedSplitVariable"})

  def test_weights_files_move_to_and_from_a_model_with_no_strategy(self):
    strategy = rs.ReplicatorStrategy(layout_map=partitioned_layout(),
                                     variable_partitioner=PARTITIONER)
    with strategy.scope():
      model = megatron.mlp()
    x, y = megatron.data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    directory = self.enterContext(tempfile.TemporaryDirectory())
    model.save_weights(os.path.join(directory, "sharded.weights.h5"))
    plain = megatron.mlp()
    plain.load_weights(os.path.join(directory, "sharded.weights.h5"))
    megatron.assert_same_weights(plain, model)
    for weight in plain.weights:
      weight.assign(weight + 1.0)
    plain.save_weights(os.path.join(directory, "plain.weights.h5"))
    model.load_weights(os.path.join(directory, "plain.weights.h5"))
    megatron.assert_same_weights(model, plain)
    kernel = model.get_layer("up").kernel.value
    self.assertIsInstance(kernel, sharded_parts.ShardedSplitVariable)
    # Shard r of part j: rows 4r ... 4r+3 of columns 8j ... 8j+7.
    np.testing.assert_array_equal(
        kernel.values[3].numpy(), plain.get_layer("up").kernel.numpy()[4:, 8:])


class RefusalTest(unittest.TestCase):

  def test_across_workers_a_split_weight_sharded_is_refused_when_made(self):
    strategy = rs.ReplicatorStrategy(layout_map=partitioned_layout(),
                                     variable_partitioner=PARTITIONER)
    with mock.patch.object(type(strategy.extended), "num_workers",
                           new_callable=mock.PropertyMock, return_value=2):
      with self.assertRaisesRegex(
          NotImplementedError, r"(?s)sharded over the replicas.*within one "
          r"worker.*Received 2 workers"):
        with strategy.scope():
          keras.layers.Dense(megatron.HIDDEN, name="up").build(
              (None, megatron.FEATURES))


class ExchangeOnALogicalDeviceTest(unittest.TestCase):
  """A part's shards move among every replica's logical device j within
  each sync group: 2 groups of 1 replica over 2 devices."""

  def test_each_sync_group_gathers_and_reduce_scatters_alone(self):
    strategy = rs.ReplicatorStrategy(
        devices=[f"/cpu:{i}" for i in range(4)], devices_per_replica=2,
        sync_groups=2)

    def exchanged():
      ctx = tf.distribute.get_replica_context()
      with ctx.logical_device(1):
        x = tf.fill([2], tf.cast(ctx.sync_group + 1, tf.float32))
      return (exchange.all_gather(ctx, x, axis=0, logical_device=1),
              exchange.reduce_scatter(ctx, x, axis=0, logical_device=1))

    def in_cond():  # Each replica launches its collectives at run time.
      return tf.cond(tf.constant(True), exchanged, exchanged)

    for name, step in [("merged", lambda: strategy.run(exchanged)),
                       ("launched", tf.function(
                           lambda: strategy.run(in_cond)))]:
      with self.subTest(name):
        for result in step():
          self.assertEqual(
              [t.numpy().tolist()
               for t in strategy.experimental_local_results(result)],
              [[1.0, 1.0], [2.0, 2.0]])
    # Where the replicas meet, the results land on their logical device 1.
    self.assertEqual([t.device[-5:] for t in strategy.experimental_local_results(
        strategy.run(exchanged)[0])], ["CPU:1", "CPU:3"])


def block_layout():
  """The block's token table split by columns, its heads and MLP split
  Megatron style, its logits by columns."""
  layout_map = megatron.transformer_layout(2)
  layout_map[".*logits/kernel"] = (None, "model")
  layout_map[".*logits/bias"] = ("model",)
  return layout_map


class TransformerBlockTest(unittest.TestCase):

  def test_a_block_on_a_2_by_2_mesh_trains_as_one_device(self):
    # The table's parts look up their rows in their shards, so its gradient
    # stays sparse and Adam updates the rows a batch looked up, as on one
    # device (a table gathered whole would train otherwise).
    want_loss, want = megatron.train_transformer(megatron.transformer())
    strategy = rs.ReplicatorStrategy(layout_map=block_layout(),
                                     variable_partitioner=PARTITIONER)
    with strategy.scope():
      model = megatron.transformer()
    kinds = [type(v.value).__name__ for v in model.weights]
    self.assertEqual(kinds.count("ShardedSplitVariable"), 13, kinds)
    self.assertNotIn("MirroredVariable", kinds)
    have_loss, have = megatron.train_transformer(model)
    np.testing.assert_allclose(have_loss, want_loss, rtol=1e-5)
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-5)
    assert_a_quarter_per_device(self, model.weights + model.optimizer.variables)


if __name__ == "__main__":
  unittest.main()
