"""`keras.RematScope` and `keras.remat` under ReplicatorStrategy train as without remat.

As shipped, Keras's TF backend refuses them in graph mode (keras#21207). Here
each mode Keras defines ("full", "activations", "larger_than",
"list_of_layers", and `keras.remat(layer)`) gives the weights that training
without remat gives after 2 steps of `fit` (rtol 1e-5), on 2 replicas, in
graph mode and with XLA, with Dropout and BatchNormalization among the
rematerialized layers (their draws and moving statistics as without remat);
with sharded state, with a layout map (a Megatron MLP on a 1 x 2 mesh), with
a pipeline (2 stages) and in a custom loop. The recompute happens (the
backward calls the layer again) on the devices of the forward: each
replica's, each stage's, each Megatron part's; it adds no transfer between
devices but the layer's own, repeated.

Marked slow (the quick loop leaves them out): the other modes, with and
without XLA, sharded state, the pipeline and Megatron's other modes.
"""

import collections
import contextlib
import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import replicator_strategy as rs

ROWS, BATCH, FEATURES, HIDDEN, OUT = 16, 8, 8, 16, 3


class Noted(keras.layers.Dense):
  """A Dense that notes the device of each of its calls traced in a step."""

  calls = collections.Counter()  # (layer name, device) -> calls traced.

  def call(self, inputs):
    outputs = super().call(inputs)
    if outputs.device:  # Not the model's symbolic calls.
      Noted.calls[self.name, outputs.device[-5:]] += 1
    return outputs


class Rematerialized(keras.layers.Layer):
  """Calls `block` through `keras.remat(block)`, or directly."""

  def __init__(self, block, remat, **kwargs):
    super().__init__(**kwargs)
    self.block, self.remat = block, remat

  def build(self, input_shape):
    self.block.build(input_shape)

  def call(self, inputs, training=None):
    block = keras.remat(self.block) if self.remat else self.block
    return block(inputs, training=training)

  def compute_output_shape(self, input_shape):
    return self.block.compute_output_shape(input_shape)


# Name -> the RematScope's arguments; None: `keras.remat(block)` instead.
MODES = {
    "full": {"mode": "full"},
    "activations": {"mode": "activations"},
    # A (rows, 16) output is larger, the (rows, 3) one is not.
    "larger_than": {"mode": "larger_than", "output_size_threshold": 10},
    "list_of_layers": {"mode": "list_of_layers",
                       "layer_names": ["hidden", "drop", "norm"]},
    "remat_layer": None,
}


def model(mode=None, jit_compile=False):
  """Dense, Dropout, BatchNormalization, Dense, built under `MODES[mode]`
  (no mode: no remat); compiled."""
  keras.utils.set_random_seed(5)
  scope = MODES.get(mode)
  with keras.RematScope(**scope) if scope else contextlib.nullcontext():
    block = keras.Sequential([
        Noted(HIDDEN, activation="tanh", name="hidden"),
        keras.layers.Dropout(0.3, seed=2, name="drop")], name="block")
    net = keras.Sequential([
        keras.Input((FEATURES,)),
        Rematerialized(block, remat=mode == "remat_layer", name="wrapper"),
        keras.layers.BatchNormalization(name="norm"),
        keras.layers.Dense(OUT, name="out")])
  net.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit_compile)
  return net


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
          rng.normal(size=(ROWS, OUT)).astype(np.float32))


def fitted_weights(strategy, build):
  """The weights after 2 steps of `fit` of `build()`, made in `strategy`'s
  scope."""
  with strategy.scope():
    net = build()
  net.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  return net.get_weights()


def two_replicas(**kwargs):
  return rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"], **kwargs)


@functools.cache
def without_remat(jit_compile):
  return fitted_weights(two_replicas(), functools.partial(
      model, jit_compile=jit_compile))


def assert_same_weights(test, got, want):
  test.assertEqual(len(got), len(want))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def modes(*names):
  return [(name, name) for name in names]


class RematModesTest(unittest.TestCase):

  def check(self, mode, jit_compile):
    got = fitted_weights(two_replicas(), functools.partial(
        model, mode, jit_compile=jit_compile))
    assert_same_weights(self, got, without_remat(jit_compile))

  def test_remat_layer_in_graph_mode_as_without_remat(self):
    self.check("remat_layer", jit_compile=False)

  @parameterized.expand(modes("full", "activations", "larger_than"))
  @pytest.mark.slow
  def test_the_other_modes_in_graph_mode_as_without_remat(self, _, mode):
    self.check(mode, jit_compile=False)

  def test_the_backward_calls_the_layer_again_on_its_replicas_device(self):
    # The Dropout recomputes its mask, BatchNormalization updates its
    # statistics once: the weights are those without remat.
    Noted.calls.clear()
    self.check("list_of_layers", jit_compile=False)
    # The step traced once: each replica's forward, then its recompute.
    self.assertEqual(dict(Noted.calls),
                     {("hidden", "CPU:0"): 2, ("hidden", "CPU:1"): 2})

  @parameterized.expand(modes(*MODES))
  @pytest.mark.slow
  def test_with_xla_as_without_remat(self, _, mode):
    self.check(mode, jit_compile=True)

  @parameterized.expand(modes("full", "list_of_layers"))
  @pytest.mark.slow
  def test_with_sharded_state_as_without_remat(self, _, mode):
    sharded = functools.partial(two_replicas, sharding=rs.Sharding(
        optimizer_state=True, weights="batch"))
    got = fitted_weights(sharded(), functools.partial(model, mode))
    assert_same_weights(self, got, fitted_weights(sharded(), model))


def custom_loop_weights(strategy, mode, steps=2):
  """The weights after `steps` of a custom loop through `strategy.run`."""
  x, y = data()
  with strategy.scope():
    net = model(mode)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(net.trainable_variables)

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((net(x, training=True) - y) ** 2) / ROWS
    grads = tape.gradient(loss, net.trainable_variables)
    optimizer.apply_gradients(zip(grads, net.trainable_variables))

  batches = iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)))

  @tf.function
  def step(batch):
    strategy.run(replica_step, batch)

  for _ in range(steps):
    step(next(batches))
  return net.get_weights()


class CustomLoopTest(unittest.TestCase):

  @pytest.mark.slow
  def test_a_custom_loop_trains_as_without_remat(self):
    assert_same_weights(self, custom_loop_weights(two_replicas(), "full"),
                        custom_loop_weights(two_replicas(), None))


def pipelined(scope=None):
  """Four Dense layers and a Dropout (2 stages' worth), built under
  `RematScope(**scope)`."""
  keras.utils.set_random_seed(5)
  with keras.RematScope(**scope) if scope else contextlib.nullcontext():
    dense = [Noted(width, activation="tanh", name=f"dense_{i}")
             for i, width in enumerate((16, 16, 16, OUT))]
    net = keras.Sequential([keras.Input((FEATURES,)), *dense[:3],
                            keras.layers.Dropout(0.3, seed=2, name="drop"),
                            dense[3]])
  net.compile(keras.optimizers.SGD(0.1), "mse")
  return net


class PipelineTest(unittest.TestCase):

  @pytest.mark.slow
  def test_each_stage_recomputes_on_its_device_as_without_remat(self):
    def pipeline():
      return two_replicas(pipeline=rs.Pipeline(stages=2, microbatches=2))

    # Without remat, as 2 replicas without a pipeline draw: one device's.
    want = fitted_weights(two_replicas(), pipelined)
    assert_same_weights(self, fitted_weights(pipeline(), pipelined), want)
    Noted.calls.clear()
    got = fitted_weights(pipeline(), functools.partial(pipelined, {
        "mode": "list_of_layers",
        "layer_names": ["dense_0", "drop", "dense_3"]}))
    assert_same_weights(self, got, want)
    # 2 micro-batches a step: forwards, and recomputes for the two Dense.
    self.assertEqual(dict(Noted.calls), {
        ("dense_0", "CPU:0"): 4, ("dense_1", "CPU:0"): 2,
        ("dense_2", "CPU:1"): 2, ("dense_3", "CPU:1"): 4})


def megatron_layout():
  mesh = keras.distribution.DeviceMesh(
      (1, 2), ("batch", "model"), keras.distribution.list_devices()[:2])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")  # Column-parallel.
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)  # Row-parallel.
  return layout_map


MEGATRON_BATCH = 6  # No weight has a dimension of 6.


def megatron_mlp(mode=None):
  keras.utils.set_random_seed(7)
  scope = {"list_of_layers": {"mode": "list_of_layers",
                              "layer_names": ["up", "down", "drop"]},
           "activations": {"mode": "activations"},
           "full": {"mode": "full"}}.get(mode)
  with keras.RematScope(**scope) if scope else contextlib.nullcontext():
    net = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="relu", name="up"),
        keras.layers.Dense(OUT, name="down"),
        keras.layers.Dropout(0.3, seed=2, name="drop")])
  net.compile(keras.optimizers.SGD(0.1), "mse")
  return net


def _device(op):
  return op.device[-5:]


def traced_step(strategy, net):
  """The graph of a training step of `net`, and the ops it runs."""
  with strategy.scope():
    net.optimizer.build(net.trainable_variables)
  x, y = (tf.constant(t[:MEGATRON_BATCH]) for t in data())

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((net(x, training=True) - y) ** 2)
      grads = tape.gradient(loss, net.trainable_variables)
      net.optimizer.apply_gradients(zip(grads, net.trainable_variables))
    strategy.run(replica_step, (x, y))

  graph = step.get_concrete_function(x, y).graph
  runs, pending = set(), [t.op for t in graph.outputs] + list(
      graph.control_outputs)
  while pending:  # What the outputs and the updates need: TF prunes the rest.
    op = pending.pop()
    if op not in runs:
      runs.add(op)
      pending += [t.op for t in op.inputs] + list(op.control_inputs)
  return graph, runs


def transfers(runs):
  """(from device, to device, shape) of each tensor sent between devices."""
  sent = {(t.ref(), _device(op)): (_device(t.op), _device(op),
                                   tuple(t.shape.as_list()))
          for op in runs for t in op.inputs
          if t.op.device and op.device and _device(t.op) != _device(op)}
  return collections.Counter(sent.values())


def matmuls(runs):
  return collections.Counter(_device(op) for op in runs if op.type == "MatMul")


class MegatronTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout())
    with strategy.scope():
      cls.plain = megatron_mlp()
    _, cls.plain_runs = traced_step(strategy, cls.plain)
    cls.want = fitted_weights(
        rs.ReplicatorStrategy(layout_map=megatron_layout()), megatron_mlp)

  def check(self, mode):
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout())
    got = fitted_weights(strategy, functools.partial(megatron_mlp, mode))
    assert_same_weights(self, got, self.want)
    with strategy.scope():
      net = megatron_mlp(mode)
    return traced_step(strategy, net)

  def test_each_part_recomputes_on_its_device_as_without_remat(self):
    graph, runs = self.check("list_of_layers")
    # Each device's part of up computed again, for relu's gradient (down's,
    # linear, is not read by its gradient: TF prunes it).
    self.assertEqual(matmuls(runs) - matmuls(self.plain_runs),
                     {"CPU:0": 1, "CPU:1": 1})
    # Between the pair, no activation is assembled: the recompute passes
    # the parts on.
    hidden = [op for op in runs if op.type == "ConcatV2" and
              op.outputs[0].shape.as_list() == [MEGATRON_BATCH, HIDDEN]]
    self.assertEqual(hidden, [])
    self.assertTrue(any(op.type == "ConcatV2" and
                        op.outputs[0].shape.as_list() == [MEGATRON_BATCH,
                                                          HIDDEN]
                        for op in graph.get_operations()))
    # The one transfer added: up's input to device 1 again, as its forward
    # sends it (a column layer's own).
    self.assertEqual(transfers(runs) - transfers(self.plain_runs),
                     {("CPU:0", "CPU:1", (MEGATRON_BATCH, FEATURES)): 1})
    self.assertEqual(transfers(self.plain_runs) - transfers(runs), {})

  @parameterized.expand(modes("activations", "full"))
  @pytest.mark.slow
  def test_other_modes_as_without_remat(self, _, mode):
    _, runs = self.check(mode)
    self.assertFalse([op for op in runs if op.type == "ConcatV2" and
                      op.outputs[0].shape.as_list() == [MEGATRON_BATCH,
                                                        HIDDEN]])


if __name__ == "__main__":
  unittest.main()
