"""Pipelines with sharded state train as one device does.

Two pipelines of 2 stages on the 4 logical CPUs (batch 2 x stage 2):

- `Sharding(optimizer_state=True)` (ZeRO-1/2): each slot of a stage's
  weight is held once over the two pipelines, a flat half on that stage's
  device of each, and updated there;
- `Sharding(weights="batch")` (ZeRO-3): each stage's weights, and their
  slots, are cut by rows over the two pipelines, on the stage's devices.

The weights, the loss, the metrics and Adam's slots after `fit` (also with
gradient accumulation), and `evaluate` and `predict` after it, equal one
device's (rtol 1e-5); the weights and slots save and load as one device's.
"""

import functools
import os
import tempfile
import unittest

import keras
import numpy as np
from absl.testing import parameterized
import pytest

import replicator_strategy as rs
from replicator_strategy.keras import stage_placement
from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import variables as sharded_variables

from pipeline_fits import ATOL  # noqa: I001
from pipeline_fits import BATCH
from pipeline_fits import RTOL
from pipeline_fits import assert_equal_weights
from pipeline_fits import assert_trains_as_one_device
from pipeline_fits import data
from pipeline_fits import fit
from pipeline_fits import initial_weights
from pipeline_fits import mlp
from pipeline_fits import one_device

SLICED_STATE = rs.Sharding(optimizer_state=True)
SHARDED_WEIGHTS = rs.Sharding(weights="batch")

# Adam stepping every 2 batches (one_device caches its run by this object).
ACCUMULATING = functools.partial(keras.optimizers.Adam,
                                 gradient_accumulation_steps=2)


@functools.cache
def accumulated_on_one_device():
  """The model `fit` trains with ACCUMULATING on one device, fitted once."""
  return fit(optimizer=ACCUMULATING)[0]


def two_pipelines(sharding, schedule="1f1b"):
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ("batch", "stage"), [f"/cpu:{i}" for i in range(4)])
  return rs.ReplicatorStrategy(
      mesh=mesh, sharding=sharding,
      pipeline=rs.Pipeline(stages=2, microbatches=2, schedule=schedule))


def compiled(strategy, placed_first=False):
  """`mlp` with its optimizer built, after its stages are placed or, not
  `placed_first`, before (its slots then move with their weights)."""
  with strategy.scope():
    model = mlp()
    model.set_weights(initial_weights())
    model.compile(keras.optimizers.Adam(0.01), "mse")
    if placed_first:
      strategy.pipeline_stages(model)
    model.optimizer.build(model.trainable_variables)
  return model


def assert_sliced_on_their_stages(test, strategy, model):
  """Each of Adam's m and v of a stage's weight (with sharded weights, the
  weight too) in halves, one on that stage's device of each pipeline: flat
  slices of sharded optimizer state, rows of sharded weights."""
  devices = strategy.extended.logical_devices
  slots = stage_placement.slots_by_weight(model.optimizer)
  sharded_weights = strategy.extended.options.sharding.weights is not None
  for stage in strategy.pipeline_stages(model):
    own = tuple(devices.stage_devices(r)[stage.index][0] for r in range(2))
    for weight in stage.trainable_variables:
      test.assertEqual(len(slots[weight.path]), 2, weight.path)
      if sharded_weights:
        rows = layout_lib.RowLayout.split(list(weight.shape), 2, 2)
        halves = [list(rows.shard_shape(i)) for i in range(2)]
      else:
        halves = [[-(-int(np.prod(weight.shape)) // 2)]] * 2
      held = [v.value for v in slots[weight.path]]
      if sharded_weights:
        held.append(weight.value)
      for variable in held:
        test.assertIsInstance(variable, sharded_variables.ShardedVariable)
        test.assertEqual(variable.shard_devices, own, variable.name)
        test.assertEqual([c.shape.as_list() for c in variable.values], halves,
                         variable.name)


class PipelineShardingPlacedTest(parameterized.TestCase):

  def test_slots_made_for_placed_stages_are_sliced_there(self):
    strategy = two_pipelines(SLICED_STATE)
    model = compiled(strategy, placed_first=True)
    assert_sliced_on_their_stages(self, strategy, model)

  @parameterized.named_parameters(
      ("state_slots_made_first_move", SLICED_STATE, False),
      ("weights_and_slots_made_for_placed_stages", SHARDED_WEIGHTS, True),
      ("weights_and_slots_made_first_move", SHARDED_WEIGHTS, False),
  )
  @pytest.mark.slow
  def test_sliced_on_their_stages(self, sharding, placed_first):
    strategy = two_pipelines(sharding)
    model = compiled(strategy, placed_first)
    assert_sliced_on_their_stages(self, strategy, model)


@pytest.mark.slow
class PipelineShardedStateTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.strategy = two_pipelines(SLICED_STATE)
    cls.model = assert_trains_as_one_device(cls.strategy)

  def test_fit_slices_each_slot_on_its_stage(self):
    assert_sliced_on_their_stages(self, self.strategy, self.model)

  def test_slots_are_one_devices(self):
    plain, _ = fit()
    # Adam's iterations, learning rate, then each weight's m and v in order.
    for got, want in zip(self.model.optimizer.variables,
                         plain.optimizer.variables, strict=True):
      np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL,
                                 atol=ATOL, err_msg=got.path)

  def test_weights_file_loads_without_a_strategy(self):
    path = os.path.join(tempfile.mkdtemp(), "m.weights.h5")
    self.model.save_weights(path)
    plain = mlp()
    plain.load_weights(path)
    assert_equal_weights(plain.get_weights(), self.model.get_weights())

  def test_keras_file_holds_the_slots_whole(self):
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    self.model.save(path)
    loaded = keras.models.load_model(path)
    for got, want in zip(loaded.optimizer.variables,
                         self.model.optimizer.variables, strict=True):
      np.testing.assert_array_equal(got.numpy(), want.numpy())
    # Loaded into sharded pipelines (its slots sliced as they load, then
    # moved to their stages), it trains on as the model loaded without.
    strategy = two_pipelines(SLICED_STATE)
    with strategy.scope():
      piped = keras.models.load_model(path)
    piped.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    loaded.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    assert_equal_weights(piped.get_weights(), loaded.get_weights())
    assert_sliced_on_their_stages(self, strategy, piped)


class PipelineShardingFitTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("state_zb_h1", SLICED_STATE, "zb_h1"),
      ("weights_1f1b", SHARDED_WEIGHTS, "1f1b"),
      ("weights_gpipe", SHARDED_WEIGHTS, "gpipe"),
      ("weights_and_state_zb_h1",
       rs.Sharding(optimizer_state=True, weights="batch"), "zb_h1"),
  )
  @pytest.mark.slow
  def test_fit_with_slots_moved_to_their_stages(self, sharding, schedule):
    strategy = two_pipelines(sharding, schedule)
    model = compiled(strategy)
    model.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    assert_equal_weights(model.get_weights(), one_device()[0])
    assert_sliced_on_their_stages(self, strategy, model)
    path = os.path.join(tempfile.mkdtemp(), "m.weights.h5")
    model.save_weights(path)
    plain = mlp()
    plain.load_weights(path)
    assert_equal_weights(plain.get_weights(), model.get_weights())

  @parameterized.named_parameters(
      ("state", SLICED_STATE),  # Each replica steps its slice in a tf.cond.
      ("weights", SHARDED_WEIGHTS),
  )
  @pytest.mark.slow
  def test_accumulated_steps_then_evaluate_and_predict(self, sharding):
    model = assert_trains_as_one_device(two_pipelines(sharding),
                                        optimizer=ACCUMULATING)
    plain = accumulated_on_one_device()
    x, y = data()
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               plain.evaluate(x, y, verbose=0), rtol=RTOL)


if __name__ == "__main__":
  unittest.main()
