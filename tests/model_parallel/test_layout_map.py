"""`ReplicatorStrategy(layout_map=...)`: Keras's LayoutMap on TensorFlow.

A Megatron MLP (a column-parallel Dense, then a row-parallel one) trains with
`fit`, `evaluate`, `predict` and a custom loop as on one device, on a (2, 2)
and a (1, 4) mesh of 4 logical CPUs; each split weight and its optimizer
slots hold 1/k of their bytes on each of a replica's devices; the traced
step combines activations once forward and once backward; checkpoints move
between a split model and a plain one; bad layouts are refused.

Marked `slow` (the quick loop leaves them out): the (1, 4) mesh, the
transformer block, mixed precision, XLA, the `.keras` file and BackupAndRestore.
"""

import contextlib
import functools
import os
import tempfile
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import assertions
import replicator_strategy as rs
from replicator_strategy import _tf_internal as tfi
from replicator_strategy.model_parallel import split_variables

ROWS, FEATURES, HIDDEN, OUT = 48, 8, 16, 4
BATCH = 6  # The traced step's rows: no weight has a dimension of 6.


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
          rng.normal(size=(ROWS, OUT)).astype(np.float32))


def mesh(replicas):
  return keras.distribution.DeviceMesh(
      (replicas, 4 // replicas), ("batch", "model"),
      keras.distribution.list_devices()[:4])


def megatron_layout(replicas):
  layout_map = keras.distribution.LayoutMap(mesh(replicas))
  layout_map[".*up/kernel"] = (None, "model")  # Column-parallel.
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)  # Row-parallel.
  return layout_map


def mlp():
  keras.utils.set_random_seed(7)
  model = keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.Dense(FEATURES, activation="tanh", name="embed"),
      keras.layers.Dense(HIDDEN, activation="relu", name="up"),
      keras.layers.Dense(OUT, name="down"),
  ])
  model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=3)
  return model


def train(model):
  x, y = data()
  history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  return {"loss": history.history["loss"],
          "evaluate": model.evaluate(x, y, batch_size=8, verbose=0),
          "predict": model.predict(x, batch_size=8, verbose=0),
          "weights": model.get_weights()}


def split_mlp(replicas):
  strategy = rs.ReplicatorStrategy(layout_map=megatron_layout(replicas))
  with strategy.scope():
    model = mlp()
  return strategy, model


@functools.cache
def trained_split_mlp(replicas):
  """(model, `train`'s results) of the split MLP on a (replicas, 4 //
  replicas) mesh: trained once, read by several tests."""
  _, model = split_mlp(replicas)
  return model, train(model)


class MegatronMlpTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.one_device = train(mlp())

  def check_fit(self, replicas):
    model, got = trained_split_mlp(replicas)
    self.assertEqual(model.distribute_strategy.num_replicas_in_sync, replicas)
    np.testing.assert_allclose(got["loss"], self.one_device["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["evaluate"], self.one_device["evaluate"],
                               rtol=1e-5)
    np.testing.assert_allclose(got["predict"], self.one_device["predict"],
                               rtol=1e-5, atol=1e-6)
    for want, have in zip(self.one_device["weights"], got["weights"]):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    return model

  def check_bytes_per_device(self, model, replicas):
    k = 4 // replicas
    split = [v for v in model.weights + model.optimizer.variables
             if isinstance(v.value, split_variables.SplitVariable)]
    # up/kernel, up/bias, down/kernel and their two Adam slots each.
    self.assertEqual(len(split), 9)
    for variable in split:
      whole = np.prod(variable.shape) * variable.value.dtype.size
      by_device = {}
      for part in variable.value.values:
        by_device[part.device] = by_device.get(part.device, 0) + (
            np.prod(part.shape) * part.dtype.size)
      self.assertEqual(len(by_device), 4, variable.path)
      self.assertEqual(set(by_device.values()), {whole // k}, variable.path)

  def test_fit_evaluate_predict_on_a_2_by_2_mesh_equal_one_device(self):
    model = self.check_fit(2)
    self.check_bytes_per_device(model, 2)

  @pytest.mark.slow
  def test_fit_evaluate_predict_on_a_1_by_4_mesh_equal_one_device(self):
    model = self.check_fit(1)
    self.check_bytes_per_device(model, 1)

  def test_with_sharded_optimizer_state_equals_one_device(self):
    # Split weights keep their slots split over a replica's devices; the
    # others' slots are sharded over the replicas (the batch axis).
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout(2),
                                     shard_optimizer_state=True)
    with strategy.scope():
      model = mlp()
    got = train(model)
    np.testing.assert_allclose(got["loss"], self.one_device["loss"], rtol=1e-5)
    for want, have in zip(self.one_device["weights"], got["weights"]):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    kinds = {v.path: type(v.value).__name__ for v in model.optimizer.variables}
    up = [kind for path, kind in kinds.items() if "up_kernel" in path]
    embed = [kind for path, kind in kinds.items() if "embed_kernel" in path]
    self.assertEqual(up, ["SplitVariable"] * 2)  # Adam's momentum, velocity.
    self.assertEqual(embed, ["ShardedVariable"] * 2)

  def test_unsplit_weights_are_mirrored_over_the_replicas(self):
    strategy, model = split_mlp(2)
    embed = model.get_layer("embed").kernel.value
    self.assertNotIsInstance(embed, split_variables.SplitVariable)
    self.assertEqual([c.device[-5:] for c in embed.values], ["CPU:0", "CPU:2"])
    del strategy


VOCAB, SEQ, WIDTH, HEADS = 12, 5, 16, 4


def transformer_layout(replicas):
  layout_map = keras.distribution.LayoutMap(mesh(replicas))
  layout_map[".*tokens/embeddings"] = (None, "model")  # Read whole.
  layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
  layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
  layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)
  return layout_map


def transformer():
  """A transformer block: heads split by device, then a Megatron MLP."""
  keras.utils.set_random_seed(3)
  ids = keras.Input((SEQ,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")(ids)
  attended = keras.layers.MultiHeadAttention(
      HEADS, WIDTH // HEADS, name="attention")(x, x, use_causal_mask=True)
  x = keras.layers.LayerNormalization()(x + attended)
  hidden = keras.layers.Dense(4 * WIDTH, activation="gelu", name="up")(x)
  x = x + keras.layers.Dense(WIDTH, name="down")(hidden)
  model = keras.Model(ids, keras.layers.Dense(VOCAB, name="logits")(x))
  model.compile(keras.optimizers.Adam(0.01),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def train_transformer(model):
  ids = np.random.default_rng(4).integers(0, VOCAB, size=(32, SEQ + 1))
  history = model.fit(ids[:, :-1], ids[:, 1:], batch_size=8, epochs=2,
                      shuffle=False, verbose=0)
  return history.history["loss"], model.get_weights()


class TransformerBlockTest(unittest.TestCase):

  @pytest.mark.slow
  def test_a_block_with_heads_split_on_a_2_by_2_mesh_trains_as_one_device(self):
    want_loss, want = train_transformer(transformer())
    strategy = rs.ReplicatorStrategy(layout_map=transformer_layout(2))
    with strategy.scope():
      model = transformer()
    split = [v.path for v in model.weights
             if isinstance(v.value, split_variables.SplitVariable)]
    # The table; query, key and value kernels and biases; the attention
    # output kernel; up's kernel and bias; down's kernel.
    self.assertEqual(len(split), 11, split)
    ids = tf.constant(np.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    graph = traced_step(strategy, model, ids, ids)
    # Each device attends over its heads, forward and backward.
    self.assertEqual({_device_index(op) for op in graph.get_operations()
                      if op.type in ("Softmax", "SoftmaxGrad")}, {0, 1, 2, 3})
    # Query, key, value and the attention, assembled, feed nothing: TF
    # prunes them.
    assembled = [op for op in graph.get_operations()
                 if op.type == "ConcatV2" and "attention" in op.name and
                 op.outputs[0].shape.rank == 4]
    self.assertEqual(len(assembled), 8)  # 4 per replica.
    self.assertTrue(all(not op.outputs[0].consumers() for op in assembled))
    have_loss, have = train_transformer(model)
    np.testing.assert_allclose(have_loss, want_loss, rtol=1e-5)
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-5)


def custom_loop_weights(strategy, steps=3, xla=False):
  """The weights after `steps` of a custom loop; `xla`: the step compiled
  (with no strategy by `jit_compile=True`, else under `jit_scope`)."""
  x, y = data()
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)

  def replica_step(x, y):
    if xla and strategy is not None:
      with tf.xla.experimental.jit_scope(separate_compiled_gradients=False):
        return uncompiled_step(x, y)
    return uncompiled_step(x, y)

  def uncompiled_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((model(x) - y) ** 2) / ROWS
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  if strategy is None:
    step = tf.function(replica_step, jit_compile=xla)
    for _ in range(steps):
      step(x, y)
    return model.get_weights()
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(ROWS))
  batch = next(iter(dataset))

  @tf.function
  def step(batch):
    strategy.run(replica_step, batch)

  for _ in range(steps):
    step(batch)
  return model.get_weights()


def forward_graph(strategy, model, x):
  """The graph of `model`'s training-mode forward pass on x, one replica."""

  @tf.function
  def step(x):
    return strategy.run(functools.partial(model, training=True), (x,))

  return step.get_concrete_function(x).graph


def mixed_precision_transformer(policy):
  """`transformer()` under `policy`, trained by SGD: its updates follow the
  gradients' rounding, which Adam's normalization would amplify. (Under
  float16 Keras wraps it in a loss-scale optimizer, whose first step
  overflows and is skipped.)"""
  keras.mixed_precision.set_global_policy(policy)
  model = transformer()
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


# rtol and atol of the losses and weights: each compute dtype's precision.
MIXED_TOLERANCES = {"mixed_float16": (1e-3, 1e-3),
                    "mixed_bfloat16": (1e-2, 1e-2)}


class MixedPrecisionTest(unittest.TestCase):
  """Under a mixed policy Keras casts each weight a layer reads; a split
  weight's parts are cast each on its device, so the layers still compute on
  them."""

  def setUp(self):
    self.addCleanup(keras.mixed_precision.set_global_policy, "float32")

  @parameterized.expand([("float16",), ("bfloat16",)])
  def test_the_layers_compute_on_their_parts_under_mixed(self, dtype):
    strategy = rs.ReplicatorStrategy(layout_map=transformer_layout(2))
    with strategy.scope():
      model = mixed_precision_transformer(f"mixed_{dtype}")
    wholes = {tuple(v.shape) for v in model.weights
              if isinstance(v.value, split_variables.SplitVariable)}
    self.assertEqual(len(wholes), 7, wholes)  # Shapes of the 11 split weights.
    ids = tf.constant(np.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    graph = forward_graph(strategy, model, ids)
    whole = [op.name for op in graph.get_operations() for t in op.outputs
             if t.shape.rank is not None and tuple(t.shape.as_list()) in wholes]
    self.assertEqual(whole, [])
    # Each part is cast where it lives: no cast takes its input from another
    # device's op, and the casts to the compute dtype run on every device.
    casts = [op for op in graph.get_operations() if op.type == "Cast" and
             op.outputs[0].dtype == dtype]
    self.assertEqual(
        [op.name for op in casts
         if _device_index(op.inputs[0].op) not in (None, _device_index(op))],
        [])
    self.assertEqual({_device_index(op) for op in casts}, {0, 1, 2, 3})

  @parameterized.expand([("float16",), ("bfloat16",)])
  @pytest.mark.slow
  def test_a_block_with_heads_split_trains_as_one_device_under_mixed(
      self, dtype):
    # Dense, EinsumDense, MultiHeadAttention and Embedding, in parts.
    policy = f"mixed_{dtype}"
    one_device = mixed_precision_transformer(policy)
    want_loss, want = train_transformer(one_device)
    strategy = rs.ReplicatorStrategy(layout_map=transformer_layout(2))
    with strategy.scope():
      model = mixed_precision_transformer(policy)
    have_loss, have = train_transformer(model)
    if dtype == "float16":  # The same steps overflowed, and were skipped.
      want_scale = one_device.optimizer.dynamic_scale.numpy()
      self.assertLess(want_scale, 2.0**15)
      self.assertEqual(model.optimizer.dynamic_scale.numpy(), want_scale)
    rtol, atol = MIXED_TOLERANCES[policy]
    np.testing.assert_allclose(have_loss, want_loss, rtol=rtol)
    for w, h in zip(want, have, strict=True):
      np.testing.assert_allclose(h, w, rtol=rtol, atol=atol)

  @pytest.mark.slow
  def test_mixed_float16_on_a_2_by_2_mesh_trains_as_one_device(self):
    keras.mixed_precision.set_global_policy("mixed_float16")
    want = train(mlp())
    _, model = split_mlp(2)
    got = train(model)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-3)
    for w, h in zip(want["weights"], got["weights"]):
      np.testing.assert_allclose(h, w, rtol=1e-3, atol=1e-3)


class CustomLoopTest(unittest.TestCase):

  def test_a_custom_loop_on_a_2_by_2_mesh_trains_as_one_device(self):
    want = custom_loop_weights(None)
    have = custom_loop_weights(
        rs.ReplicatorStrategy(layout_map=megatron_layout(2)))
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)


def _device_index(op):
  return tf.DeviceSpec.from_string(op.device).device_index if op.device else None


def traced_step(strategy, model, x, y):
  """The graph of a training step of `model` on (x, y), one replica."""
  optimizer = model.optimizer
  with strategy.scope():
    optimizer.build(model.trainable_variables)

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model.compute_loss(x, y, model(x)))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(replica_step, (x, y))

  return step.get_concrete_function(x, y).graph


class CombinesTest(unittest.TestCase):
  """What the traced step exchanges between a replica's devices."""

  def test_a_column_row_pair_combines_once_forward_and_once_backward(self):
    strategy, model = split_mlp(1)
    graph = traced_step(strategy, model,
                        *(tf.constant(a[:BATCH]) for a in data()))
    combines = [
        op for op in graph.get_operations()
        if len({_device_index(t.op) for t in op.inputs
                if t.dtype != tf.resource} - {None}) > 1 and
        op.type in ("AddN", "AddV2", "ConcatV2", "Sum") and
        op.outputs[0].consumers()]
    activations = [op for op in combines
                   if op.outputs[0].shape.as_list()[:1] == [BATCH]]
    # Forward: the row layer's sum of its 4 products. Backward: the column
    # layer's input gradient, summed from its 4 devices.
    self.assertEqual([(op.type, len(op.inputs)) for op in activations],
                     [("AddN", 4), ("AddN", 4)],
                     [op.name for op in combines])
    # The other combines assemble the 3 split weights' gradients (whole on
    # logical device 0, for Keras's optimizer).
    self.assertEqual(
        sorted(op.outputs[0].shape.as_list() for op in combines
               if op not in activations),
        [[FEATURES, HIDDEN], [HIDDEN], [HIDDEN, OUT]])
    # The column layer's output, assembled, feeds nothing: TF prunes it.
    assembled = [op for op in graph.get_operations()
                 if op.type == "ConcatV2" and "/up" in op.name]
    self.assertEqual(len(assembled), 1)
    self.assertEqual(assembled[0].outputs[0].consumers(), [])
    # Each part's matmuls, forward and backward, run on its own device.
    matmul_devices = {_device_index(op) for op in graph.get_operations()
                      if op.type == "MatMul" and "embed" not in op.name}
    self.assertEqual(matmul_devices, {0, 1, 2, 3})


class OutputLayoutTest(unittest.TestCase):

  def test_an_output_key_hands_a_row_parallel_layer_its_parts(self):
    layout_map = keras.distribution.LayoutMap(mesh(2))
    layout_map[".*embed/output"] = (None, "model")
    layout_map[".*down/kernel"] = ("model", None)
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((FEATURES,)),
          keras.layers.Dense(HIDDEN, activation="tanh", name="embed"),
          keras.layers.Dense(OUT, name="down")])
    x = tf.constant(data()[0][:BATCH])
    step = tf.function(lambda x: strategy.run(model, (x,)))
    want = np.tanh(x.numpy() @ model.layers[0].kernel.numpy() +
                   model.layers[0].bias.numpy()) @ model.layers[1].kernel.numpy()
    for part in strategy.experimental_local_results(step(x)):
      np.testing.assert_allclose(part.numpy(), want + model.layers[1].bias.numpy(),
                                 rtol=1e-5, atol=1e-5)
    graph = step.get_concrete_function(x).graph
    # One split per replica, the relayout's: the row layer splits nothing.
    splits = [op for op in graph.get_operations() if op.type == "Split"]
    self.assertEqual(len(splits), 2)


class ActivationTest(unittest.TestCase):

  def test_a_softmax_over_split_features_sees_them_all(self):
    layout_map = keras.distribution.LayoutMap(mesh(2))
    layout_map[".*head/kernel"] = (None, "model")  # Column-parallel.
    layout_map[".*head/bias"] = ("model",)
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((FEATURES,)),
          keras.layers.Dense(OUT, activation="softmax", name="head")])
    x = tf.constant(data()[0][:BATCH])
    logits = (x.numpy() @ model.layers[0].kernel.numpy() +
              model.layers[0].bias.numpy())
    want = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    step = tf.function(lambda x: strategy.run(model, (x,)))
    for part in strategy.experimental_local_results(step(x)):
      np.testing.assert_allclose(part.numpy(), want, rtol=1e-5, atol=1e-6)


class WarningsTest(unittest.TestCase):

  def test_a_key_matching_no_variable_is_warned_at_the_first_run(self):
    layout_map = megatron_layout(2)
    layout_map["renamed/kernel"] = (None, "model")
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      model = mlp()
    x, _ = data()
    with self.assertLogs(level="WARNING") as logs:
      model.predict(x, batch_size=8, verbose=0)
    self.assertRegex("\n".join(logs.output),
                     r"key 'renamed/kernel' matches no variable")
    self.assertNotRegex("\n".join(logs.output), r"key '\.\*up")

  def test_a_layer_reading_a_split_weight_whole_is_logged_once_by_path(self):
    # Two LayerNorms of a block: TF names both gammas `block_0/gamma:0`.
    layout_map = keras.distribution.LayoutMap(mesh(2))
    layout_map[".*gamma"] = ("model",)
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      model = keras.Sequential([keras.Input((4,)), TwoNorms(name="block_0")])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    with self.assertLogs(level="WARNING") as logs:
      got = model.predict(x, batch_size=4, verbose=0)
      model.predict(x, batch_size=4, verbose=0)
    whole = [line for line in logs.output if "reads it whole" in line]
    self.assertEqual(len(whole), 2, logs.output)
    self.assertRegex(whole[0], r" sequential\S*/block_0/first/gamma ")
    self.assertRegex(whole[1], r" sequential\S*/block_0/second/gamma ")

    def norm(x):
      return (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) +
                                                      1e-3)

    np.testing.assert_allclose(got, norm(norm(x)), rtol=1e-4, atol=1e-4)


class TwoNorms(keras.layers.Layer):
  """A block of two LayerNormalizations, one after the other."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.first = keras.layers.LayerNormalization(name="first")
    self.second = keras.layers.LayerNormalization(name="second")

  def call(self, x):
    return self.second(self.first(x))


class EmbeddingTest(unittest.TestCase):
  """A table split by columns or rows (the vocabulary) looks up in parts."""

  def check(self, layout):
    def model():
      keras.utils.set_random_seed(3)
      ids = keras.Input((SEQ,), dtype="int32")
      x = keras.layers.Embedding(VOCAB, WIDTH, name="table")(ids)
      out = keras.layers.Dense(VOCAB, name="logits")(x)
      net = keras.Model(ids, out)
      net.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      return net

    layout_map = keras.distribution.LayoutMap(mesh(2))
    layout_map[".*table/embeddings"] = layout
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      split = model()
    ids = tf.constant(np.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    graph = traced_step(strategy, split, ids, ids)
    gathers = {_device_index(op) for op in graph.get_operations()
               if op.type in ("GatherV2", "ResourceGather")}
    self.assertEqual(gathers, {0, 1, 2, 3})  # Each device looks up its part.
    # Adam updates only the rows a batch looks up, as on one device.
    want_loss, want = train_transformer(model())
    have_loss, have = train_transformer(split)
    np.testing.assert_allclose(have_loss, want_loss, rtol=1e-5)
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)

  def test_a_table_split_by_columns_trains_as_one_device(self):
    self.check((None, "model"))

  def test_a_table_split_by_rows_trains_as_one_device(self):
    self.check(("model", None))


def assert_same_weights(model, want):
  for w, h in zip(want.get_weights(), model.get_weights(), strict=True):
    np.testing.assert_array_equal(h, w)


class CheckpointTest(unittest.TestCase):

  def check_round_trip(self, model, scope):
    """Weights files: the trained (2, 2) split MLP into `model`, then
    `model`, changed in `scope`, into a (1, 4) mesh."""
    directory = self.enterContext(tempfile.TemporaryDirectory())
    split, _ = trained_split_mlp(2)
    split.save_weights(os.path.join(directory, "split.weights.h5"))
    model.load_weights(os.path.join(directory, "split.weights.h5"))
    assert_same_weights(model, split)
    with scope:
      model.layers[1].kernel.assign(model.layers[1].kernel + 1.0)
    model.save_weights(os.path.join(directory, "model.weights.h5"))
    _, back = split_mlp(1)
    back.load_weights(os.path.join(directory, "model.weights.h5"))
    assert_same_weights(back, model)

  def test_an_exported_saved_model_serves_the_whole_weights(self):
    split, _ = trained_split_mlp(2)
    assertions.assert_exported_serves_as_the_model(self, split, data()[0])

  def test_weights_files_move_between_a_split_model_and_a_plain_one(self):
    self.check_round_trip(mlp(), contextlib.nullcontext())

  @pytest.mark.slow
  def test_a_keras_file_loads_without_a_strategy_and_into_a_split_one(self):
    directory = self.enterContext(tempfile.TemporaryDirectory())
    split, _ = trained_split_mlp(2)
    path = os.path.join(directory, "model.keras")
    split.save(path)
    plain = keras.models.load_model(path)
    assert_same_weights(plain, split)
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout(1))
    with strategy.scope():
      again = keras.models.load_model(path)
    self.assertIsInstance(again.get_layer("up").kernel.value,
                          split_variables.SplitVariable)
    assert_same_weights(again, split)
    x, _ = data()
    np.testing.assert_allclose(again.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)

  def test_weights_move_between_a_split_model_and_mirrored_strategy(self):
    mirrored = tf.distribute.MirroredStrategy(
        keras.distribution.list_devices()[:2])
    with mirrored.scope():
      model = mlp()
    self.check_round_trip(model, mirrored.scope())

  @pytest.mark.slow
  def test_backup_and_restore_resumes_on_another_mesh_shape(self):
    directory = self.enterContext(tempfile.TemporaryDirectory())
    x, y = data()
    _, split = split_mlp(2)
    split.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(directory, delete_checkpoint=False)])
    _, resumed = split_mlp(1)
    # The backup says epoch 1 is done: only the second epoch runs.
    history = resumed.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                          verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(directory)])
    self.assertEqual(len(history.history["loss"]), 1)
    straight = mlp()
    straight.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for want, have in zip(straight.get_weights(), resumed.get_weights()):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)

  def test_a_tf_checkpoint_restores_into_another_mesh_shape(self):
    directory = self.enterContext(tempfile.TemporaryDirectory())
    split, _ = trained_split_mlp(2)
    path = tf.train.Checkpoint(model=split).save(os.path.join(directory, "c"))
    _, other = split_mlp(1)
    tf.train.Checkpoint(model=other).restore(path).assert_existing_objects_matched()
    assert_same_weights(other, split)


@pytest.mark.slow
class XlaTest(unittest.TestCase):
  """`jit_compile=True` over a replica of several devices: XLA compiles each
  device's ops, and training equals one device's XLA-compiled run."""

  @staticmethod
  def train_compiled(strategy):
    """`train`'s results, and the devices that launched XLA clusters in a
    first `predict` and in `train` (TF records a function's launches when it
    first runs it)."""
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = mlp()
      model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=3,
                    jit_compile=True)
    x, _ = data()
    _, predict_launches = tfi.xla_launches_by_device(
        lambda: model.predict(x, batch_size=8, verbose=0))
    got, launches = tfi.xla_launches_by_device(lambda: train(model))
    return got, set(launches), set(predict_launches)

  def test_each_device_runs_compiled_and_training_equals_one_device(self):
    want, _, _ = self.train_compiled(None)
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout(2))
    got, launches, predict_launches = self.train_compiled(strategy)
    for key in ("loss", "evaluate"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5,
                               atol=1e-6)
    for have, wanted in zip(got["weights"], want["weights"]):
      np.testing.assert_allclose(have, wanted, rtol=1e-5, atol=1e-6)
    devices = {tf.DeviceSpec.from_string(d).to_string()
               for replica in strategy.extended.worker_devices_by_replica
               for d in replica}
    self.assertEqual(len(devices), 4)
    self.assertEqual(launches, devices)
    self.assertEqual(predict_launches, devices)

  def test_a_custom_loop_under_jit_scope_compiles_each_device(self):
    # What docs/model-parallel.md tells custom loops to do.
    want = custom_loop_weights(None, xla=True)
    strategy = rs.ReplicatorStrategy(layout_map=megatron_layout(2))
    have, launches = tfi.xla_launches_by_device(
        lambda: custom_loop_weights(strategy, xla=True))
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)
    self.assertEqual(len(launches), 4)

  def test_auto_means_xla_on_accelerators_as_without_a_strategy(self):
    strategy, model = split_mlp(2)
    with strategy.scope():
      model.compile("sgd", "mse", jit_compile="auto")
    accelerated = any(device.device_type != "CPU"
                      for device in tf.config.list_physical_devices())
    self.assertEqual(model.jit_compile, accelerated)


class BadLayoutTest(unittest.TestCase):

  def build(self, key, layout, units=HIDDEN, replicas=2):
    layout_map = keras.distribution.LayoutMap(mesh(replicas))
    layout_map[key] = layout
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      keras.Sequential([keras.Input((FEATURES,)),
                        keras.layers.Dense(units, name="up")])

  def test_an_axis_that_does_not_divide_the_dimension_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"(?s)'sequential.*/up/kernel'.*size 5.*does not divide.*"
        r"divisible by 2"):
      self.build(".*up/kernel", (None, "model"), units=5)

  def test_a_rank_mismatch_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"(?s)layout \('model',\).*up/kernel.*1 dimension.*has 2"):
      self.build(".*up/kernel", ("model",))

  def test_two_dimensions_over_one_axis_are_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"(?s)up/kernel.*shards 2 dimensions over the replicas"):
      self.build(".*up/kernel", ("batch", "batch"))

  def test_a_mesh_of_other_devices_is_refused(self):
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), ["cpu:0", "cpu:1", "cpu:2", "cpu:9"]))
    with self.assertRaisesRegex(ValueError,
                                r"(?s)mesh must list this worker's devices.*9"):
      rs.ReplicatorStrategy(layout_map=layout_map)

  def test_a_mesh_that_is_not_2_d_is_refused(self):
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (4,), ("model",), keras.distribution.list_devices()[:4]))
    with self.assertRaisesRegex(ValueError, r"takes a 2-D DeviceMesh"):
      rs.ReplicatorStrategy(layout_map=layout_map)

  def test_devices_beside_a_layout_map_are_refused(self):
    with self.assertRaisesRegex(ValueError, r"either `devices` or `layout_map`"):
      rs.ReplicatorStrategy(devices=["cpu:0"], layout_map=megatron_layout(2))

  def test_an_unknown_batch_dim_name_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"batch_dim_name='rows'.*names no"):
      rs.ReplicatorStrategy(layout_map=megatron_layout(2),
                            batch_dim_name="rows")


if __name__ == "__main__":
  unittest.main()
