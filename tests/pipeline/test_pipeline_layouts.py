"""A pipeline whose stages split weights over a model axis (Megatron's
rules inside each stage) trains as one device does.

2 stages x 2 model devices: each stage's column- and row-parallel Dense
kernels are in halves on its two devices; after a few Adam steps of `fit`
the weights, the loss and the metrics equal one device's (rtol 1e-5). An
output layout and attention split by heads split over their own stage's
devices.
"""

import contextlib
import os
import tempfile
from unittest import mock

import keras
import numpy as np
from absl.testing import parameterized

import replicator_strategy as rs
from replicator_strategy.model_parallel import megatron

ROWS, BATCH, DEVICES = 48, 16, [f"/cpu:{i}" for i in range(4)]


def megatron_mlp():
  """Two Megatron pairs (up column-parallel, down row-parallel), a head."""
  layers = [keras.Input((8,))]
  for i in range(2):
    layers += [keras.layers.Dense(16, activation="tanh", name=f"up_{i}"),
               keras.layers.Dense(8, activation="tanh", name=f"down_{i}")]
  return keras.Sequential(layers + [keras.layers.Dense(3, name="head")])


def layout_map(mesh):
  layouts = keras.distribution.LayoutMap(mesh)
  layouts[".*up_.*/kernel"] = (None, "model")
  layouts[".*up_.*/bias"] = ("model",)
  layouts[".*down_.*/kernel"] = ("model", None)
  return layouts


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, 8)).astype(np.float32),
          rng.normal(size=(ROWS, 3)).astype(np.float32))


def fit(strategy=None):
  keras.utils.set_random_seed(0)
  weights = megatron_mlp().get_weights()
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = megatron_mlp()
    model.set_weights(weights)
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
  history = model.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
  return model, history.history


def stage_by_model(microbatches, schedule):
  """2 stages ("up_1" starts the second) x 2 model devices, one replica."""
  mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
  return rs.ReplicatorStrategy(
      layout_map=layout_map(mesh),
      pipeline=rs.Pipeline(stages=2, microbatches=microbatches,
                           schedule=schedule, split=["up_1"]))


class PipelineLayoutsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    model, cls.history = fit()
    cls.weights = model.get_weights()

  def assert_trains_as_one_device(self, strategy):
    model, history = fit(strategy)
    for a, b in zip(model.get_weights(), self.weights):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name in ("loss", "mae"):
      np.testing.assert_allclose(history[name], self.history[name], rtol=1e-5)
    return model

  @parameterized.named_parameters(
      ("1_micro_1f1b", 1, "1f1b"),
      ("2_micro_gpipe", 2, "gpipe"),
      ("4_micro_1f1b", 4, "1f1b"),
      ("4_micro_gpipe", 4, "gpipe"),
      ("4_micro_zb_h1", 4, "zb_h1"),  # The backward split in two.
  )
  def test_one_step_is_one_devices(self, microbatches, schedule):
    self.assert_trains_as_one_device(stage_by_model(microbatches, schedule))

  def test_each_stage_splits_its_kernels_over_its_devices(self):
    model = self.assert_trains_as_one_device(stage_by_model(2, "1f1b"))
    held = {}  # device -> bytes of the model's weights it holds.
    for weight in model.weights:
      for component in weight.value.values:
        device = component.device[-5:]
        held[device] = held.get(device, 0) + (
            np.prod(component.shape) * component.dtype.size)
    half = (8 * 16 + 16 + 16 * 8) // 2 * 4  # up's kernel and bias, down's.
    # The rest on its stage's first device: down's bias (8), the head's.
    self.assertEqual(held, {"CPU:0": half + 8 * 4, "CPU:1": half,
                            "CPU:2": half + (8 + 8 * 3 + 3) * 4,
                            "CPU:3": half})

  def test_a_batch_stage_model_mesh(self):
    mesh = keras.distribution.DeviceMesh(
        (1, 2, 2), ("batch", "stage", "model"), DEVICES)
    self.assert_trains_as_one_device(rs.ReplicatorStrategy(
        mesh=mesh, layout_map=layout_map(mesh),
        pipeline=rs.Pipeline(stages=2, microbatches=2, split=["up_1"])))

  def test_a_keras_file_loads_and_trains_on(self):
    plain, _ = fit()
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    plain.save(path)
    # Loaded with its optimizer built, its slots move (split) with their
    # weights; it trains on as it does on one device, and saves the whole.
    with stage_by_model(2, "1f1b").scope():
      piped = keras.models.load_model(path)
    piped.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    plain.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(piped.get_weights(), plain.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    kernel = piped.get_layer("up_0").kernel.value
    self.assertEqual([(c.shape.as_list(), c.device[-5:]) for c in kernel.values],
                     [([8, 8], "CPU:0"), ([8, 8], "CPU:1")])
    piped.save(path)
    for a, b in zip(keras.models.load_model(path).get_weights(),
                    piped.get_weights()):
      np.testing.assert_array_equal(a, b)

  def test_an_output_layout_splits_over_its_stages_devices(self):
    def model():
      return keras.Sequential([
          keras.Input((8,)), keras.layers.Dense(8, name="a"),
          keras.layers.Dense(16, name="mid"),
          keras.layers.Dense(8, name="down")])

    keras.utils.set_random_seed(0)
    weights = model().get_weights()
    x, _ = data()
    one = model()
    one.set_weights(weights)
    one.compile(keras.optimizers.Adam(0.01), "mse")
    one.fit(x, x, batch_size=BATCH, shuffle=False, verbose=0)
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*mid/output"] = (None, "model")  # For the row-parallel down.
    layouts[".*down/kernel"] = ("model", None)
    strategy = rs.ReplicatorStrategy(layout_map=layouts, pipeline=rs.Pipeline(
        stages=2, microbatches=2, split=["mid"]))
    with strategy.scope():
      piped = model()
      piped.set_weights(weights)
      piped.compile(keras.optimizers.Adam(0.01), "mse")
    with mock.patch.object(megatron, "assembled",
                           wraps=megatron.assembled) as assembled:
      piped.fit(x, x, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(piped.get_weights(), one.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # mid's output, once a micro-batch as the step is traced: in parts on
    # the second stage's devices, not the replica's four.
    self.assertEqual([[d[-5:] for d in call.args[1]]
                      for call in assembled.call_args_list],
                     [["CPU:2", "CPU:3"]] * 2)

  def test_attention_splits_by_heads_over_its_stages_devices(self):
    def model():
      x = keras.Input((4, 8))
      h = keras.layers.Dense(8, name="proj")(x)
      return keras.Model(x, keras.layers.MultiHeadAttention(
          2, 4, name="mha")(h, h))

    keras.utils.set_random_seed(0)
    weights = model().get_weights()
    x = np.random.default_rng(0).normal(size=(32, 4, 8)).astype(np.float32)
    # SGD: the key's bias has no gradient but rounding, which Adam magnifies.
    one = model()
    one.set_weights(weights)
    one.compile(keras.optimizers.SGD(0.1), "mse")
    one.fit(x, x, batch_size=BATCH, shuffle=False, verbose=0)
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*mha/(query|key|value)/kernel"] = (None, "model", None)
    layouts[".*mha/(query|key|value)/bias"] = ("model", None)
    layouts[".*mha/attention_output/kernel"] = ("model", None, None)
    strategy = rs.ReplicatorStrategy(layout_map=layouts, pipeline=rs.Pipeline(
        stages=2, microbatches=2, split=["mha"]))
    with strategy.scope():
      piped = model()
      piped.set_weights(weights)
      piped.compile(keras.optimizers.SGD(0.1), "mse")
    with mock.patch.object(megatron, "assembled",
                           wraps=megatron.assembled) as assembled:
      piped.fit(x, x, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(piped.get_weights(), one.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Each micro-batch (the step traced once): query, key and value in parts
    # by heads, then attention on each device over its heads, all on the
    # second stage's devices.
    self.assertEqual([[d[-5:] for d in call.args[1]]
                      for call in assembled.call_args_list],
                     [["CPU:2", "CPU:3"]] * 8)
