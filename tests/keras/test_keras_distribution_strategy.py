"""`keras.distribution.set_distribution` makes a ReplicatorStrategy TF's default.

After `rs.use_for_keras_distribution()`: a `DataParallel` or `ModelParallel`
set is served by a ReplicatorStrategy (reused when set again, undone by
None, replaced by another, restored by `Distribution.scope()`); one that
cannot run here is refused at `set_distribution`, naming it. The rule
between a distribution and an open strategy scope: the open
ReplicatorStrategy wins when it matches, a mismatch names both, another
strategy in use is refused. With no distribution set, strategies behave as
before, and uninstalling puts `set_distribution` back as shipped.
"""

import unittest

import keras
from keras.src.distribution import distribution_lib
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.keras import _internal as ki


def devices(n=4):
  return keras.distribution.list_devices()[:n]


def full_names(names):
  return [f"/job:localhost/replica:0/task:0/device:CPU:{name.split(':')[-1]}"
          for name in names]


def megatron_layout_map(mesh):
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)
  return layout_map


def mesh_2_by_2(names=("batch", "model")):
  return keras.distribution.DeviceMesh((2, 2), names, devices())


def current():
  return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


class DistributionTestCase(unittest.TestCase):
  """Patches in place; Keras's distribution and TF's default left as found."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rs.use_for_keras_distribution()

  def setUp(self):
    super().setUp()
    self.assertIsNone(keras.distribution.distribution())
    self.assertFalse(tf.distribute.has_strategy())

  def tearDown(self):
    keras.distribution.set_distribution(None)
    self.assertFalse(tf.distribute.has_strategy())
    super().tearDown()


class SetDistributionTest(DistributionTestCase):

  def test_data_parallel_makes_a_replicator_strategy_the_default(self):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    strategy = current()
    self.assertIsInstance(strategy, rs.ReplicatorStrategy)
    self.assertEqual(strategy.num_replicas_in_sync, 4)
    self.assertEqual(list(strategy.extended.worker_devices),
                     full_names(devices()))
    keras.distribution.set_distribution(None)
    self.assertIsNone(current())

  def test_the_same_distribution_reuses_its_strategy_another_replaces_it(self):
    first = keras.distribution.DataParallel()
    keras.distribution.set_distribution(first)
    strategy = current()
    keras.distribution.set_distribution(first)
    self.assertIs(current(), strategy)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices(2)))
    self.assertIsNot(current(), strategy)
    self.assertEqual(current().num_replicas_in_sync, 2)
    keras.distribution.set_distribution(first)
    self.assertIs(current(), strategy)

  def test_a_distribution_scope_restores_what_was_before(self):
    outer = keras.distribution.DataParallel(devices=devices(2))
    inner = keras.distribution.DataParallel()
    with inner.scope():
      self.assertEqual(current().num_replicas_in_sync, 4)
    self.assertIsNone(current())
    keras.distribution.set_distribution(outer)
    before = current()
    with inner.scope():
      self.assertEqual(current().num_replicas_in_sync, 4)
    self.assertIs(current(), before)
    self.assertIs(keras.distribution.distribution(), outer)

  def test_model_parallel_makes_a_strategy_over_its_layout_map(self):
    layout_map = megatron_layout_map(mesh_2_by_2(("data", "model")))
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"))
    strategy = current()
    self.assertIs(strategy.extended.options.layouts.layout_map, layout_map)
    self.assertEqual(strategy.extended.options.layouts.batch_axis, "data")
    self.assertEqual(str(strategy.mesh), "batch 2 x model 2")
    self.assertEqual([list(g) for g in strategy.mesh.device_groups],
                     [full_names(devices()[:2]), full_names(devices()[2:])])

  def test_a_data_parallel_mesh_of_two_axes_makes_every_device_a_replica(self):
    # Keras 3.15's DataParallel fails on such a mesh in its own warning
    # (warnings.warn(message, ndim): a TypeError), so the mesh is swapped in
    # after.
    distribution = keras.distribution.DataParallel(
        device_mesh=keras.distribution.DeviceMesh((4,), ("data",), devices()))
    distribution._device_mesh = mesh_2_by_2(("data", "model"))  # pylint: disable=protected-access
    keras.distribution.set_distribution(distribution)
    self.assertEqual(current().num_replicas_in_sync, 4)
    self.assertEqual(str(current().mesh), "data (batch) 4")

  def test_a_distribution_set_before_the_entry_point_is_picked_up(self):
    distribution = keras.distribution.DataParallel()
    rs.keras.uninstall()
    try:
      keras.distribution.set_distribution(distribution)  # Keras as shipped.
      self.assertIsNone(current())
    finally:
      rs.use_for_keras_distribution()
    self.assertEqual(current().num_replicas_in_sync, 4)


  def test_another_kind_of_distribution_is_recorded_and_warned_of(self):
    # A subclass of Keras's base class (not public), as a user might write;
    # new here, so its warning (once per class) is not given yet.
    class Custom(distribution_lib.Distribution):
      pass
    base = Custom(mesh_2_by_2())
    with self.assertWarnsRegex(UserWarning, "only a DataParallel or a "
                               "ModelParallel .* nothing is distributed"):
      with base.scope():
        self.assertIs(keras.distribution.distribution(), base)
        self.assertIsNone(current())
    self.assertIsNone(keras.distribution.distribution())


class RefusedDistributionTest(DistributionTestCase):

  def check_refused(self, distribution, *parts):
    with self.assertRaises(ValueError) as caught:
      keras.distribution.set_distribution(distribution)
    for part in (type(distribution).__name__ + "(mesh of shape",) + parts:
      self.assertIn(part, str(caught.exception))
    self.assertIsNone(keras.distribution.distribution())
    self.assertIsNone(current())

  def test_a_model_parallel_mesh_of_three_axes(self):
    mesh = keras.distribution.DeviceMesh((1, 2, 2), ("batch", "model", "x"),
                                         devices())
    self.check_refused(
        keras.distribution.ModelParallel(layout_map=megatron_layout_map(mesh)),
        "2-D DeviceMesh", "DeviceMesh((replicas, k), ('batch', 'model')")

  def test_a_batch_dim_name_that_names_no_axis(self):
    self.check_refused(
        keras.distribution.ModelParallel(
            layout_map=megatron_layout_map(mesh_2_by_2()),
            batch_dim_name="rows"),
        "batch_dim_name='rows'", "names no axis")

  def test_devices_this_process_lacks(self):
    mesh = keras.distribution.DeviceMesh((2,), ("batch",), ["gpu:0", "gpu:1"])
    self.check_refused(keras.distribution.DataParallel(device_mesh=mesh),
                       "'gpu:0'", "does not exist")


class ScopeRuleTest(DistributionTestCase):
  """The open ReplicatorStrategy wins; a mismatch names both."""

  def test_set_inside_a_matching_scope_is_served_by_it_from_then_on(self):
    strategy = rs.ReplicatorStrategy(mesh=keras.distribution.DeviceMesh(
        (4,), ("batch",), devices()), shard_optimizer_state=True)
    distribution = keras.distribution.DataParallel()
    with strategy.scope():
      keras.distribution.set_distribution(distribution)
      self.assertIs(current(), strategy)
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    self.assertIs(current(), strategy)  # The default now.
    self.assertIs(model.distribute_strategy, strategy)
    model.compile("adam", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=8, verbose=0)
    keras.distribution.set_distribution(None)
    self.assertIsNone(current())
    keras.distribution.set_distribution(distribution)
    self.assertIs(current(), strategy)

  def test_a_distribution_scope_inside_a_matching_scope_leaves_none(self):
    strategy = rs.ReplicatorStrategy(mesh=keras.distribution.DeviceMesh(
        (4,), ("batch",), devices()))
    with strategy.scope():
      with keras.distribution.DataParallel().scope():
        self.assertIs(current(), strategy)
    self.assertIsNone(current())

  def test_set_inside_a_mismatching_scope_names_both(self):
    strategy = rs.ReplicatorStrategy(devices=devices(2))
    with strategy.scope():
      with self.assertRaises(ValueError) as caught:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
      self.assertIs(current(), strategy)
    message = str(caught.exception)
    self.assertIn("ReplicatorStrategy(2 replicas", message)
    self.assertIn("DataParallel(mesh of shape (4,)", message)
    self.assertIsNone(keras.distribution.distribution())
    self.assertIsNone(current())

  def test_a_matching_scope_opened_while_set_serves_it_from_then_on(self):
    distribution = keras.distribution.DataParallel()
    keras.distribution.set_distribution(distribution)
    made = current()
    strategy = rs.ReplicatorStrategy(mesh=keras.distribution.DeviceMesh(
        (4,), ("batch",), devices()))
    with strategy.scope():
      self.assertIs(current(), strategy)
    self.assertIs(current(), strategy)
    keras.distribution.set_distribution(distribution)
    self.assertIs(current(), strategy)
    self.assertIsNot(made, strategy)

  def test_a_mismatching_scope_opened_while_set_names_both(self):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    made = current()
    strategy = rs.ReplicatorStrategy(devices=devices(2))
    with self.assertRaises(ValueError) as caught:
      with strategy.scope():
        pass
    message = str(caught.exception)
    self.assertIn("ReplicatorStrategy(2 replicas", message)
    self.assertIn("DataParallel(mesh of shape (4,)", message)
    self.assertIs(current(), made)

  def test_a_matching_strategy_traced_while_another_serves_says_what_to_do(self):
    strategy = rs.ReplicatorStrategy(mesh=keras.distribution.DeviceMesh(
        (4,), ("batch",), devices()))
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    made = current()

    @tf.function
    def step():
      return strategy.run(lambda: tf.constant(1.0))

    with self.assertRaisesRegex(ValueError, "open its scope before training"):
      step()
    self.assertIs(current(), made)
    with strategy.scope():
      pass
    self.assertIs(current(), strategy)
    self.assertEqual(len(strategy.experimental_local_results(step())), 4)

  def test_a_model_parallel_matches_a_strategy_of_its_layout_map_only(self):
    layout_map = megatron_layout_map(mesh_2_by_2())
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      keras.distribution.set_distribution(
          keras.distribution.ModelParallel(layout_map=layout_map))
      self.assertIs(current(), strategy)
      keras.distribution.set_distribution(None)
      with self.assertRaisesRegex(ValueError, "ModelParallel.*differ"):
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=megatron_layout_map(mesh_2_by_2())))
      with self.assertRaisesRegex(ValueError, "DataParallel.*differ"):
        keras.distribution.set_distribution(keras.distribution.DataParallel())

  def test_a_mirrored_strategy_in_use_is_refused(self):
    mirrored = tf.distribute.MirroredStrategy(devices(2))
    with mirrored.scope():
      with self.assertRaises(ValueError) as caught:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    message = str(caught.exception)
    self.assertIn("MirroredStrategy is in use", message)
    self.assertIn("DataParallel(mesh of shape (4,)", message)
    self.assertIsNone(keras.distribution.distribution())


class NoDistributionTest(DistributionTestCase):
  """With the patches in place and no distribution set, nothing changes."""

  def test_strategies_train_as_before_and_leave_no_default(self):
    x, y = np.ones((8, 3)), np.ones((8, 1))
    for strategy in (rs.ReplicatorStrategy(devices=devices(2)),
                     tf.distribute.MirroredStrategy(devices(2))):
      with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
      model.fit(x, y, batch_size=4, verbose=0)
      self.assertIs(model.distribute_strategy, strategy)
      kernel = model.layers[0].kernel.value
      self.assertIsInstance(kernel, tf.distribute.DistributedValues)
      if isinstance(strategy, tf.distribute.MirroredStrategy):
        self.assertEqual(type(kernel).__module__,
                         "tensorflow.python.distribute.values")
      self.assertIsNone(current())
      self.assertIs(tf.distribute.get_strategy(),
                    tf.distribute.get_strategy())  # TF's default, unchanged.
      self.assertIsNone(keras.distribution.distribution())

  def test_uninstall_restores_set_distribution_exactly(self):
    rs.keras.uninstall()
    try:
      for function in (keras.distribution.set_distribution,
                       ki.distribution_lib.set_distribution):
        self.assertIs(function, ki.distribution_lib.__dict__["set_distribution"])
        self.assertFalse(hasattr(function, "__wrapped__"))
        self.assertIn("keras", function.__code__.co_filename)
    finally:
      rs.use_for_keras_distribution()
    self.assertTrue(hasattr(keras.distribution.set_distribution,
                            "__wrapped__"))


if __name__ == "__main__":
  unittest.main()
