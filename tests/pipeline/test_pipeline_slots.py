"""`fit` under a pipeline makes each optimizer slot on its weight's stage device.

The stages are placed before `fit` builds the optimizer, so Adam's slots,
made beside their weights, are made on their stage's device of each
replica from the start: no slot of a later stage's weight is ever made on
a replica's first device (and moved).
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs


def mlp():
  return keras.Sequential([keras.Input((8,))] + [
      keras.layers.Dense(width, name=f"dense_{i}")
      for i, width in enumerate((8, 8, 3))])


class SlotsMadeInPlaceTest(unittest.TestCase):

  def test_fit_makes_each_slot_on_its_stage_device(self):
    made = []  # (name, device) of every variable made, component by component.

    def recorder(next_creator, **kwargs):
      variable = next_creator(**kwargs)
      made.append((variable.name, variable.device))
      return variable

    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    # Outside the strategy's scope: the creator sees each replica's component.
    with tf.variable_creator_scope(recorder):
      with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse")
      rng = np.random.default_rng(0)
      model.fit(rng.normal(size=(16, 8)), rng.normal(size=(16, 3)),
                batch_size=16, verbose=0)
    devices = strategy.extended.logical_devices
    replicas = range(strategy.num_replicas_in_sync)
    for stage in strategy.pipeline_stages(model):
      own = {devices.stage_devices(r)[stage.index][0] for r in replicas}
      for weight in stage.trainable_variables:
        slot = weight.path.replace("/", "_") + "_"
        slots = [d for name, d in made if slot in name]
        # Adam's two slots, a component on each replica.
        self.assertEqual(len(slots), 2 * len(replicas), weight.path)
        self.assertEqual(set(slots), own, weight.path)


if __name__ == "__main__":
  unittest.main()
