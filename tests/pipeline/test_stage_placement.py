"""Each stage's variables live on its stage's devices, values kept.

A model is built before the pipeline knows where it is cut; when the
pipeline first sees it, each stage's weights (and the slots of an optimizer
built already) move to that stage's device of every replica, so a device
holds its stage's share of the bytes, not the whole model's.
"""

import collections
import gc
import unittest
import weakref

import keras
import numpy as np

import replicator_strategy as rs



def mlp():
  return keras.Sequential([keras.Input((8,))] + [
      keras.layers.Dense(width, activation="tanh", name=f"dense_{i}")
      for i, width in enumerate((16, 16, 16, 3))])


def bytes_by_device(variables):
  held = collections.Counter()
  for v in variables:
    for component in v.value.values:
      held[component.device] += component.shape.num_elements() * (
          component.dtype.size)
  return held


def own_bytes(variables):
  return sum(np.prod(v.shape) * 4 for v in variables)


class StagePlacementTest(unittest.TestCase):

  def check_placed(self, stages_count, optimizer_built, make_optimizer=None):
    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=stages_count))
    with strategy.scope():
      model = mlp()
      optimizer = (make_optimizer or keras.optimizers.Adam)(0.1)
      model.compile(optimizer, "mse")
      if optimizer_built:
        optimizer.build(model.trainable_variables)
    before = model.get_weights()
    stages = strategy.pipeline_stages(model)
    self.assertEqual(len(stages), stages_count)
    self.assertIs(strategy.pipeline_stages(model), stages)  # Once.
    for a, b in zip(before, model.get_weights()):
      np.testing.assert_array_equal(a, b)
    held = bytes_by_device(model.weights)
    by_replica = strategy.extended.logical_devices
    for replica in range(strategy.num_replicas_in_sync):
      for stage, (device,) in zip(stages, by_replica.stage_devices(replica)):
        self.assertEqual(held[device], own_bytes(stage.variables))
        self.assertLess(held[device], own_bytes(model.weights))
    if optimizer_built and make_optimizer is None:
      # Adam's two slots a weight, on its weight's devices.
      slots = bytes_by_device(
          [v for v in optimizer.variables if len(v.shape) > 0])
      self.assertEqual(slots, collections.Counter(
          {d: 2 * n for d, n in held.items()}))
    return model, optimizer

  def test_stages_hold_their_share(self):
    for stages_count in (2, 4):
      for optimizer_built in (False, True):
        with self.subTest(stages=stages_count, built=optimizer_built):
          self.check_placed(stages_count, optimizer_built)

  def test_an_optimizer_built_before_still_finds_its_weights(self):
    # Adam (slots moved with their weights) and SGD (no slots).
    for make_optimizer in (keras.optimizers.Adam, keras.optimizers.SGD):
      with self.subTest(make_optimizer.__name__):
        model, optimizer = self.check_placed(2, True, make_optimizer)
        before = model.get_weights()
        grads = [np.ones(v.shape, np.float32)
                 for v in model.trainable_variables]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        self.assertEqual(optimizer.iterations.numpy(), 1)
        for a, b in zip(before, model.get_weights()):
          # Either's first step is -0.1 a weight.
          np.testing.assert_allclose(b, a - 0.1, atol=1e-5)

  def test_a_model_dropped_is_freed(self):
    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    with strategy.scope():
      model = mlp()
    strategy.pipeline_stages(model)
    dropped = weakref.ref(model)
    del model
    gc.collect()
    self.assertIsNone(dropped())

  def test_a_model_built_outside_the_scope(self):
    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    model = mlp()
    with self.assertRaisesRegex(ValueError, r"created outside "
                                r"`strategy.scope\(\)`.*Build the model"):
      strategy.pipeline_stages(model)


if __name__ == "__main__":
  unittest.main()
