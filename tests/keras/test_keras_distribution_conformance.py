"""Keras's own keras.distribution tests, run on TensorFlow with the patches.

The keras wheel ships `keras/src/distribution/distribution_lib_test.py`.
Importing its classes here lets pytest collect them, with the package's
patches installed (`rs.keras.install()`), so that Keras's TF
`distribution_lib` has the functions they call or mock (`initialize`,
`num_processes`, `get_device_count`, ...). The classes Keras skips as "JAX
only" run too: pytest reads marks from every base class, so their skip mark
is taken off Keras's class itself (this module alone imports it). Their
8-device meshes only build layouts and need no real devices; the one that
needs devices asks `get_device_count()` (4 logical CPUs here).

The TF counterparts of `keras/src/backend/jax/distribution_lib_test.py`
are `TensorflowDistributionLibTest` below, in this package's own code: each
JAX test that has a meaning on TensorFlow, in the same order, with a
ReplicatorStrategy built from the distribution for the end-to-end fits.

Cases that cannot apply on TensorFlow, and why:

- jax `test_device_conversion`: `_to_backend_device` turns "cpu:0" into a
  `jax.Device`; TensorFlow places ops by device name, and the
  strategy's mesh resolves the names itself (`backend_mesh` below).
- jax `test_initialize_with_coordinator_address`: JAX joins a cluster from
  the coordinator's address alone; TensorFlow's runtime needs every
  worker's address, so `initialize` refuses one address for several
  processes with an error that says so (tested below instead).
- jax `test_initialize_with_all_job_addresses` mocks
  `jax.distributed.initialize`; on TensorFlow `initialize` writes
  `TF_CONFIG` (tested below instead).
- jax `test_distribute_tensor_with_jax_layout`: takes JAX's own layout types
  (`jax.experimental.layout.Format`); TensorFlow has none.
- jax `test_distribute_tensor` and `test_e2e_model_parallel_with_output_sharding`
  check a `jax.Array`'s sharding (`is_equivalent_to`,
  `jax.debug.inspect_array_sharding`); a TF tensor has no sharding: a
  replica holds its rows, and a model-axis output is in parts on the
  replica's devices. Their TF counterparts check the values each replica
  holds instead.
- jax `test_variable_assignment_reuse_layout` and the e2e tests read
  `variable._value.sharding.spec`; on TensorFlow the layout shows as the
  kind of variable (a `SplitVariable` split along the model axis, a
  replicated variable elsewhere), which the counterparts check.
"""

import os
import unittest

import keras
from keras.src.distribution import distribution_lib_test
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import distribution_backend
from replicator_strategy.model_parallel import split_variables

BACKEND = ki.tf_distribution_lib


def setUpModule():
  rs.keras.install()


def _on_tensorflow(test_class):
  """Keras's `test_class` with its "only JAX" skip mark taken off."""
  test_class.pytestmark = [mark for mark in test_class.pytestmark
                           if mark.name != "skipif"]
  return test_class


class MultiProcessInitializeTest(
    _on_tensorflow(distribution_lib_test.MultiProcessInitializeTest)):
  """Keras's; its tearDown empties os.environ, which is put back here."""

  def setUp(self):
    super().setUp()
    self._environ = dict(os.environ)
    for name in ("KERAS_DISTRIBUTION_JOB_ADDRESSES",
                 "KERAS_DISTRIBUTION_NUM_PROCESSES",
                 "KERAS_DISTRIBUTION_PROCESS_ID"):
      os.environ.pop(name, None)

  def tearDown(self):
    try:
      super().tearDown()
    finally:
      os.environ.clear()
      os.environ.update(self._environ)


DataParallelDistributionTest = _on_tensorflow(
    distribution_lib_test.DataParallelDistributionTest)
ModelParallelDistributionTest = _on_tensorflow(
    distribution_lib_test.ModelParallelDistributionTest)
DataShardingIntegrationTest = _on_tensorflow(
    distribution_lib_test.DataShardingIntegrationTest)
# Keras's tests that run on every backend, collected here too.
DeviceMeshTest = distribution_lib_test.DeviceMeshTest
DistributionTest = distribution_lib_test.DistributionTest
LayoutMapTest = distribution_lib_test.LayoutMapTest
TensorLayoutTest = distribution_lib_test.TensorLayoutTest
TfDatasetDistributionTest = distribution_lib_test.TfDatasetDistributionTest


ROWS, FEATURES, HIDDEN, CLASSES = 32, 8, 16, 4


def _devices():
  return keras.distribution.list_devices()


def _model_parallel_layouts(output=None):
  """Keras's e2e layout map: every Dense's kernel and bias split over the
  model axis of a (2, 2) mesh; `output`, the Denses' output layout."""
  layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
      (2, 2), ("batch", "model"), _devices()))
  layout_map[".*dense.*kernel"] = keras.distribution.TensorLayout(
      [None, "model"])
  layout_map[".*dense.*bias"] = keras.distribution.TensorLayout(["model"])
  if output is not None:
    layout_map[".*dense.*output"] = output
  return layout_map


class RowsSeen(keras.layers.Layer):
  """Records the shape of the rows each call gets (a replica's)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.rows_seen = []

  def call(self, inputs):
    self.rows_seen.append(inputs.shape[0])
    return inputs


def _mlp(*middle):
  keras.utils.set_random_seed(3)
  inputs = keras.layers.Input(shape=[FEATURES])
  y = keras.layers.Dense(HIDDEN, use_bias=False, activation="relu")(inputs)
  for layer in middle:
    y = layer(y)
  y = keras.layers.Dropout(0.4)(y)
  y = keras.layers.Dense(CLASSES, activation="softmax")(y)
  return keras.Model(inputs=inputs, outputs=y)


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
          rng.normal(size=(ROWS, CLASSES)).astype(np.float32))


def _fit(model):
  model.compile(keras.optimizers.SGD(0.1), loss="mse")
  x, y = _data()
  return model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history


class TensorflowDistributionLibTest(unittest.TestCase):
  """Keras's JAX backend tests, as they apply to TensorFlow (see above).

  `initialize` and the process count have theirs in
  test_keras_distribution_backend (InitializeTest, ProcessesTest).
  """

  def setUp(self):
    super().setUp()
    self.addCleanup(keras.distribution.set_distribution, None)

  def _under(self, distribution, strategy):
    """`distribution` set as Keras's, `strategy` made from it around it."""
    keras.distribution.set_distribution(distribution)
    return strategy.scope()

  def _as_on_one_device(self, make_model, distribution, strategy):
    """Fits `make_model()` on one device and under `distribution` and
    `strategy`; checks they agree; the distributed model."""
    one = make_model()
    one_history = _fit(one)
    with self._under(distribution, strategy):
      model = make_model()
    history = _fit(model)
    np.testing.assert_allclose(history["loss"], one_history["loss"],
                               rtol=1e-5)
    for got, want in zip(model.get_weights(), one.get_weights()):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return model

  def test_get_device_count(self):
    self.assertEqual(BACKEND.get_device_count(), 4)
    self.assertEqual(BACKEND.get_device_count("cpu"), 4)
    self.assertEqual(BACKEND.get_device_count("gpu"),
                     len(BACKEND.list_devices("gpu")))

  def test_list_devices(self):
    self.assertEqual(len(keras.distribution.list_devices()), 4)
    self.assertEqual(len(keras.distribution.list_devices("cpu")), 4)

  def test_distribute_tensor(self):
    strategy = rs.ReplicatorStrategy(
        mesh=keras.distribution.DeviceMesh((4,), ("batch",), _devices()))
    layout = keras.distribution.TensorLayout(
        ("batch", None), keras.distribution.DeviceMesh(
            (4,), ("batch",), _devices()))
    x = tf.constant(np.random.default_rng(0).normal(size=(16, 8)),
                    tf.float32)
    rows = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[4 * ctx.replica_id_in_sync_group:][:4])

    def replica(rows):
      return keras.distribution.distribute_tensor(rows, layout)

    for run in (strategy.run, tf.function(strategy.run)):  # Eager, traced.
      parts = strategy.experimental_local_results(run(replica, (rows,)))
      np.testing.assert_array_equal(np.concatenate(parts), x)

  def test_to_backend_mesh(self):
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"))
    backend_mesh = BACKEND._to_backend_mesh(mesh)  # pylint: disable=protected-access
    self.assertEqual(backend_mesh.shape, (2, 2))
    self.assertEqual(backend_mesh.axis_names, ("batch", "model"))
    renamed = keras.distribution.DeviceMesh((2, 2), ("data", "tensor"))
    self.assertEqual(BACKEND._to_backend_mesh(renamed).roles,  # pylint: disable=protected-access
                     ("batch", "model"))
    # A strategy takes it as its mesh.
    strategy = rs.ReplicatorStrategy(mesh=mesh)
    self.assertEqual(str(strategy.mesh), str(backend_mesh))

  def test_to_backend_layout(self):
    mesh = keras.distribution.DeviceMesh((2, 2), ("data", "model"))
    layout = keras.distribution.TensorLayout(("data", None), mesh)
    backend_layout = BACKEND._to_backend_layout(layout)  # pylint: disable=protected-access
    self.assertEqual(backend_layout, distribution_backend.BackendLayout(
        BACKEND._to_backend_mesh(mesh), ("data", None)))  # pylint: disable=protected-access

  def test_validation_for_device_mesh(self):
    layout = keras.distribution.TensorLayout(("data", None), device_mesh=None)
    with self.assertRaisesRegex(
        ValueError, "Cannot create sharding when device mesh is not set"):
      BACKEND._to_backend_layout(layout)  # pylint: disable=protected-access

  def test_variable_assignment_reuse_layout(self):
    layout_map = _model_parallel_layouts()
    strategy = rs.ReplicatorStrategy(layout_map=layout_map,
                                     batch_dim_name="batch")
    with self._under(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"), strategy):
      dense = keras.layers.Dense(8)
      dense.build((16, 16))
    kernel, bias = np.random.default_rng(0).normal(size=(2, 16, 8))
    bias = bias[0]
    dense.kernel.assign(kernel)
    dense.bias.assign(bias)
    for weight, value, axis in ((dense.kernel, kernel, 1),
                                (dense.bias, bias, 0)):
      split = ki.backend_variable(weight)
      self.assertIsInstance(split, split_variables.SplitVariable)
      self.assertEqual(split.axis, axis)
      for replica in range(2):  # Each device its half of what was assigned.
        parts = [p.numpy() for p in split.parts(replica)]
        np.testing.assert_allclose(np.concatenate(parts, axis), value,
                                   rtol=1e-6)
        self.assertEqual(parts[0].shape[axis], value.shape[axis] // 2)

  def test_e2e_data_parallel_model(self):
    distribution = keras.distribution.DataParallel()
    strategy = rs.ReplicatorStrategy(mesh=distribution.device_mesh)
    model = self._as_on_one_device(_mlp, distribution, strategy)
    self.assertEqual(strategy.num_replicas_in_sync, 4)
    for weight in model.weights:  # Replicated: every replica its copy.
      self.assertEqual(len(strategy.experimental_local_results(weight.value)),
                       4)

  def test_e2e_model_parallel_model(self):
    layout_map = _model_parallel_layouts()
    strategy = rs.ReplicatorStrategy(layout_map=layout_map,
                                     batch_dim_name="batch")
    model = self._as_on_one_device(_mlp, keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"), strategy)
    for weight in model.weights:
      split = ki.backend_variable(weight)
      if "kernel" in weight.path or "bias" in weight.path:
        self.assertIsInstance(split, split_variables.SplitVariable)
        self.assertEqual(split.axis, len(weight.shape) - 1)
      else:
        self.assertNotIsInstance(split, split_variables.SplitVariable)

  def test_e2e_model_parallel_with_output_sharding(self):
    layout_map = _model_parallel_layouts(output=("batch", None))
    strategy = rs.ReplicatorStrategy(layout_map=layout_map,
                                     batch_dim_name="batch")
    rows_seen = RowsSeen()
    self._as_on_one_device(
        lambda: _mlp(rows_seen), keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"), strategy)
    # The traced step's replicas each take 8 / 2 rows.
    self.assertIn(4, rows_seen.rows_seen)
    self.assertEqual(set(rows_seen.rows_seen) - {None, 8}, {4})

  def test_distribute_data_input(self):
    strategy = rs.ReplicatorStrategy()  # The 4 logical CPUs.
    per_process_batch = np.arange(3 * 4 * 5).reshape((3 * 4, 5))
    layout = keras.distribution.TensorLayout(
        ("batch", None), keras.distribution.DeviceMesh((4,), ("batch",)))
    with strategy.scope():
      result = BACKEND.distribute_data_input(per_process_batch, layout,
                                             "batch")
    shards = strategy.experimental_local_results(result)
    self.assertEqual(len(shards), 4)
    for i, shard in enumerate(shards):
      self.assertEqual(shard.shape, (3, 5))
      np.testing.assert_array_equal(shard, per_process_batch[3 * i:][:3])
      self.assertEqual(tf.DeviceSpec.from_string(shard.device).device_index,
                       i)
    # Without a strategy, one device's batch.
    np.testing.assert_array_equal(BACKEND.distribute_data_input(
        per_process_batch, layout, "batch"), per_process_batch)
