"""The functions Keras's TF `distribution_lib` lacks, added by the patches.

`keras.distribution` calls them on any backend; as shipped, Keras's TF
module has only `list_devices`, so a `<path>/output` layout key raised
AttributeError in `Layer.__call__`. With the patches in place they exist,
and a ModelParallel model with output keys trains on a ReplicatorStrategy as
on one device.
"""

import json
import os
import unittest
import warnings
from unittest import mock

import keras
from keras.src.distribution import distribution_lib as keras_dlib
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import _tf_internal as tfi
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import distribution_backend
from replicator_strategy.model_parallel import split_variables

BACKEND = ki.tf_distribution_lib
TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
               "task": {"type": "worker", "index": 1}}


def setUpModule():
  rs.keras.install()


def tearDownModule():
  rs.keras.install()  # As the suite's other modules leave them.


def _no_cluster_env():
  """os.environ as it was after the block, TF_CONFIG and Keras's variables
  unset in it."""
  patcher = mock.patch.dict(os.environ)
  patcher.start()
  for name in ("TF_CONFIG", "KERAS_DISTRIBUTION_JOB_ADDRESSES",
               "KERAS_DISTRIBUTION_NUM_PROCESSES",
               "KERAS_DISTRIBUTION_PROCESS_ID"):
    os.environ.pop(name, None)
  return patcher


class AddedFunctionsTest(unittest.TestCase):

  def test_keras_ships_none_of_them_and_uninstall_takes_them_away(self):
    names = set(vars(BACKEND))
    self.assertTrue(all(hasattr(BACKEND, n)
                        for n in distribution_backend.ADDED))
    try:
      rs.keras.uninstall()
      shipped = set(vars(BACKEND))
    finally:
      rs.keras.install()
    self.assertEqual(names - shipped, set(distribution_backend.ADDED))
    self.assertEqual(set(vars(BACKEND)), names)


class ProcessesTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    self.addCleanup(_no_cluster_env().stop)

  def test_one_process_alone(self):
    self.assertEqual((BACKEND.num_processes(), BACKEND.process_id()), (1, 0))
    distribution = keras.distribution.DataParallel()
    self.assertEqual(distribution.num_processes, 1)

  def test_the_cluster_of_tf_config(self):
    os.environ["TF_CONFIG"] = json.dumps(TWO_WORKERS)
    self.assertEqual((BACKEND.num_processes(), BACKEND.process_id()), (2, 1))
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"chief": ["127.0.0.1:2222"],
                    "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]},
        "task": {"type": "worker", "index": 0}})
    self.assertEqual((BACKEND.num_processes(), BACKEND.process_id()), (3, 1))


class InitializeTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    self.addCleanup(_no_cluster_env().stop)

  def _before_the_runtime(self):
    patcher = mock.patch.object(tfi, "runtime_started", return_value=False)
    patcher.start()
    self.addCleanup(patcher.stop)

  def test_keras_variables_write_the_cluster_tf_reads(self):
    self._before_the_runtime()
    os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = (
        "127.0.0.1:2222, 127.0.0.1:2223")
    os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"] = "2"
    os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] = "1"
    keras.distribution.initialize()
    self.assertEqual(json.loads(os.environ["TF_CONFIG"]), TWO_WORKERS)
    self.assertEqual((BACKEND.num_processes(), BACKEND.process_id()), (2, 1))
    keras.distribution.initialize()  # The same again: agrees, kept.
    self.assertEqual(json.loads(os.environ["TF_CONFIG"]), TWO_WORKERS)

  def test_no_arguments_keep_tf_config_or_stay_alone(self):
    keras.distribution.initialize()
    self.assertNotIn("TF_CONFIG", os.environ)
    os.environ["TF_CONFIG"] = json.dumps(TWO_WORKERS)
    keras.distribution.initialize()
    self.assertEqual(json.loads(os.environ["TF_CONFIG"]), TWO_WORKERS)
    os.environ.pop("TF_CONFIG")
    keras.distribution.initialize("127.0.0.1:2222", 1, 0)  # One process.
    self.assertNotIn("TF_CONFIG", os.environ)

  def test_the_coordinator_alone_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"every worker needs the address of every other: pass "
        r"all 2 workers'.*JAX takes the coordinator's alone.*"
        r"job_addresses='10.0.0.1:1234', num_processes=2"):
      BACKEND.initialize("10.0.0.1:1234", 2, 0)
    with self.assertRaisesRegex(ValueError, "pass all 3 workers'"):
      BACKEND.initialize("10.0.0.1:1234,10.0.0.2:2345", 3, 0)
    with self.assertRaisesRegex(ValueError, "process_id"):
      BACKEND.initialize("10.0.0.1:1234,10.0.0.2:2345", 2, None)
    with self.assertRaisesRegex(ValueError, "process_id must be in 0 to 1"):
      BACKEND.initialize("10.0.0.1:1234,10.0.0.2:2345", 2, 2)
    self.assertNotIn("TF_CONFIG", os.environ)

  def test_bad_addresses_leave_no_tf_config(self):
    self._before_the_runtime()
    with self.assertRaisesRegex(ValueError, "not \"host:port\""):
      BACKEND.initialize("10.0.0.1,10.0.0.2:2345", 2, 0)
    self.assertNotIn("TF_CONFIG", os.environ)

  def test_a_tf_config_that_disagrees_is_named(self):
    os.environ["TF_CONFIG"] = json.dumps(TWO_WORKERS)
    with self.assertRaisesRegex(
        ValueError, r"TF_CONFIG is set and describes another cluster.*"
        r"TF_CONFIG: \{.*127.0.0.1:2223.*initialize: job_addresses="
        r"'127.0.0.1:2222,127.0.0.1:2223', num_processes=2, process_id=0"):
      BACKEND.initialize("127.0.0.1:2222,127.0.0.1:2223", 2, 0)

  def test_after_the_runtime_started_is_refused(self):
    self.assertTrue(tfi.runtime_started())  # The suite ran ops already.
    with self.assertRaisesRegex(
        RuntimeError, "must come before TensorFlow starts its runtime"):
      BACKEND.initialize("127.0.0.1:2222,127.0.0.1:2223", 2, 0)
    self.assertNotIn("TF_CONFIG", os.environ)


def _mesh():
  return keras.distribution.DeviceMesh(
      (2, 2), ("data", "model"), keras.distribution.list_devices())


def _layout(axes, mesh=None):
  return keras.distribution.TensorLayout(axes, mesh or _mesh())


class DistributeTensorTest(unittest.TestCase):

  def test_eager_without_a_strategy_warns_once_per_layout(self):
    x = tf.ones((4, 2))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      self.assertIs(keras.distribution.distribute_tensor(
          x, _layout((None, None))), x)
      self.assertEqual(caught, [])
      for _ in range(2):
        self.assertIs(keras.distribution.distribute_tensor(
            x, _layout(("data", None))), x)
      outputs = {"a": x, "b": (x, x)}  # A layer's several outputs.
      self.assertIs(keras.distribution.distribute_tensor(
          outputs, _layout(("data", None))), outputs)
    self.assertEqual(len(caught), 1)
    self.assertRegex(str(caught[0].message),
                     r"layout \('data', None\).*no ReplicatorStrategy")

  def test_in_a_replica_what_the_strategy_cannot_apply_is_named(self):
    strategy = rs.ReplicatorStrategy(layout_map=keras.distribution.LayoutMap(
        _mesh()), batch_dim_name="data")
    mesh = _mesh()
    cases = {("data", None): None, (None, "model"): None,
             ("model", None): r"'model' \(model\) is in dimension 0",
             (None, "data"): r"'data' \(batch\) is in dimension 1",
             ("data", "data"): "names 'data' in several dimensions",
             (None, "other"): "'other' is neither the strategy's batch axis",
             ("data", None, None): "3 dimension"}
    for axes, why in cases.items():
      other_mesh = keras.distribution.DeviceMesh(
          (2, 2), ("data", "other"), keras.distribution.list_devices())
      layout = _layout(axes, other_mesh if "other" in axes else mesh)
      with self.subTest(axes=axes), warnings.catch_warnings(
          record=True) as caught:
        warnings.simplefilter("always")
        out = strategy.run(
            lambda layout=layout: keras.distribution.distribute_tensor(
                tf.ones((2, 4)), layout))
        for part in strategy.experimental_local_results(out):
          np.testing.assert_array_equal(part, np.ones((2, 4)))
        messages = [str(w.message) for w in caught]
        if why is None:
          self.assertEqual(messages, [])
        else:
          self.assertEqual(len(messages), 1, messages)
          self.assertRegex(messages[0], why)

  def _trains_as_one_device(self, d1_output):
    """A Megatron pair trained under ModelParallel, `.*d1/output` laid out
    as `d1_output` and `.*d2/output` by rows; the calls of distribute_tensor
    and the warnings of keras.distribution, after it trained as one device."""
    layout_map = keras.distribution.LayoutMap(_mesh())
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d1/output"] = d1_output
    layout_map[".*d2/kernel"] = ("model", None)
    layout_map[".*d2/output"] = ("data", None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.normal(size=(32, 4)).astype(np.float32)

    def train():
      keras.utils.set_random_seed(1)
      model = keras.Sequential([
          keras.Input((8,)),
          keras.layers.Dense(16, activation="tanh", name="d1"),
          keras.layers.Dense(4, name="d2")])
      model.compile(keras.optimizers.SGD(0.1), "mse")
      history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                          verbose=0)
      return model, history.history["loss"]

    one_model, one_loss = train()
    one_predicted = one_model(x[:6])
    strategy = rs.ReplicatorStrategy(layout_map=layout_map,
                                     batch_dim_name="data")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"))
    self.addCleanup(keras.distribution.set_distribution, None)
    with mock.patch.object(BACKEND, "distribute_tensor",
                           wraps=BACKEND.distribute_tensor) as called, \
         warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      with strategy.scope():
        model, loss = train()
      # Rows not known when traced: a split of them could not be cut.
      step = tf.function(lambda x: strategy.run(model, (x,)),
                         input_signature=[tf.TensorSpec([None, 8])])
      for part in strategy.experimental_local_results(step(x[:6])):
        np.testing.assert_allclose(part, one_predicted, rtol=1e-5, atol=1e-6)
    self.assertIsInstance(ki.backend_variable(model.layers[0].kernel),
                          split_variables.SplitVariable)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
    for got, want in zip(model.get_weights(), one_model.get_weights()):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return ({layout.axes for (_, layout), _ in called.call_args_list},
            [str(w.message) for w in caught
             if "keras.distribution" in str(w.message)])

  def test_a_model_parallel_model_with_output_keys_trains_as_one_device(self):
    layouts, warned = self._trains_as_one_device((None, "model"))
    self.assertEqual(layouts, {(None, "model"), ("data", None)})
    self.assertEqual(warned, [])

  def test_the_model_axis_on_the_rows_is_warned_of_and_left_out(self):
    layouts, warned = self._trains_as_one_device(("model", None))
    self.assertEqual(layouts, {("model", None), ("data", None)})
    self.assertEqual(len(warned), 1, warned)
    self.assertRegex(warned[0], r"layout \('model', None\).*dimension 0")


class DistributeVariableTest(unittest.TestCase):

  def test_split_as_the_layout_says_in_a_layout_map_strategy(self):
    strategy = rs.ReplicatorStrategy(layout_map=keras.distribution.LayoutMap(
        _mesh()), batch_dim_name="data")
    value = np.arange(32, dtype=np.float32).reshape(4, 8)
    with strategy.scope():
      variable = BACKEND.distribute_variable(value, _layout((None, "model")))
      replicated = BACKEND.distribute_variable(value, _layout((None, None)))
    self.assertIsInstance(variable, split_variables.SplitVariable)
    self.assertEqual(variable.axis, 1)
    self.assertEqual([p.shape.as_list() for p in variable.parts(0)],
                     [[4, 4], [4, 4]])
    np.testing.assert_array_equal(variable.numpy(), value)
    self.assertNotIsInstance(replicated, split_variables.SplitVariable)
    np.testing.assert_array_equal(replicated.numpy(), value)
    with strategy.scope(), self.assertRaisesRegex(
        ValueError, "dimension 1 .*does not divide"):
      BACKEND.distribute_variable(np.ones((4, 3)), _layout((None, "model")))

  def test_elsewhere_made_as_the_strategy_makes_variables(self):
    strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope(), warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      variable = BACKEND.distribute_variable(np.ones((2, 2)),
                                             _layout(("data", None)))
    self.assertRegex(str(caught[0].message),
                     r"only a ReplicatorStrategy\(layout_map=...\) splits")
    self.assertEqual(len(strategy.experimental_local_results(variable)), 2)


class BackendMeshTest(unittest.TestCase):

  def test_keras_own_needs_dtensor_set_up(self):
    mesh = _mesh()
    try:
      rs.keras.uninstall()
      with self.assertRaisesRegex(ValueError, "initialize_accelerator_system"):
        _ = keras_dlib.DeviceMesh((2, 2), ("data", "model"),
                                  mesh.devices.flatten()).backend_mesh
    finally:
      rs.keras.install()


if __name__ == "__main__":
  unittest.main()
