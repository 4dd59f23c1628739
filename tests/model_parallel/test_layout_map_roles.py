"""A layout map's mesh read by role: a stage axis renamed through
`axis_roles`, a 4-axis (group, batch, stage, model) mesh.

The layout map's mesh gives each replica's stages their devices, a row per
stage (of each replica, of each group); its stage axis is found by name, or
by the name `axis_roles` gives it. Keras's `DeviceMesh.backend_mesh` reads 4
axes not named by role as group, batch, stage and model.
"""

import contextlib
import unittest

import keras
import numpy as np

import replicator_strategy as rs
from replicator_strategy import options
from replicator_strategy.model_parallel import layouts

DEVICES = [f"/cpu:{i}" for i in range(4)]
CPU = [f"/device:CPU:{i}" for i in range(4)]


def mlp():
  return keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(8, activation="tanh", name="up_0"),
      keras.layers.Dense(8, activation="tanh", name="up_1"),
      keras.layers.Dense(3, name="head")])


def layout_map(mesh, model_axis):
  layouts = keras.distribution.LayoutMap(mesh)
  layouts[".*up_.*/kernel"] = (None, model_axis)
  return layouts


def fit(strategy=None):
  keras.utils.set_random_seed(0)
  weights = mlp().get_weights()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 8)).astype(np.float32)
  y = rng.normal(size=(16, 3)).astype(np.float32)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = mlp()
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(0.1), "mse")
  model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  return model


class LayoutMapRolesTest(unittest.TestCase):

  def test_a_stage_axis_renamed_through_axis_roles(self):
    mesh = keras.distribution.DeviceMesh((1, 2, 2), ("data", "pp", "tp"),
                                         DEVICES)
    strategy = rs.ReplicatorStrategy(
        mesh=mesh, layout_map=layout_map(mesh, "tp"),
        axis_roles={"batch": "data", "stage": "pp", "model": "tp"})
    self.assertEqual(options.of(strategy).pipeline.stages, 2)
    read = strategy.extended.model_layouts
    self.assertEqual((read.batch_axis, read.model_axis), ("data", "tp"))
    self.assertEqual(read.device_groups, ((CPU[0], CPU[1]), (CPU[2], CPU[3])))
    # Each stage's kernel split over its two devices, trained as one device.
    model = fit(strategy)
    for a, b in zip(model.get_weights(), fit().get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def test_a_group_batch_stage_model_mesh(self):
    mesh = keras.distribution.DeviceMesh(
        (1, 1, 2, 2), ("group", "batch", "stage", "model"), DEVICES)
    strategy = rs.ReplicatorStrategy(mesh=mesh,
                                     layout_map=layout_map(mesh, "model"))
    read = strategy.extended.model_layouts
    self.assertEqual((read.batch_axis, read.model_axis), ("batch", "model"))
    self.assertEqual(read.device_groups, ((CPU[0], CPU[1]), (CPU[2], CPU[3])))

  def test_four_axes_not_named_by_role_are_read_by_position(self):
    strategy = rs.ReplicatorStrategy()  # Keras's backend functions, ours.
    mesh = keras.distribution.DeviceMesh((1, 1, 2, 2), ("g", "d", "p", "t"),
                                         DEVICES)
    self.assertEqual(str(mesh.backend_mesh),
                     "g (group) 1 x d (batch) 1 x p (stage) 2 x t (model) 2")
    # So is a layout map over them: a row per stage.
    read = layouts.ModelLayouts(layout_map(mesh, "t"))
    self.assertEqual((read.batch_axis, read.model_axis), ("d", "t"))
    self.assertEqual(read.device_groups, ((CPU[0], CPU[1]), (CPU[2], CPU[3])))
    del strategy


if __name__ == "__main__":
  unittest.main()
