"""Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) on the model axis.

A pre-norm transformer block (MultiHeadAttention with its heads split, a
Megatron MLP, LayerNormalizations, dropout, residuals), its row-parallel
layers' outputs split along the sequence by the layout map, trains with
`fit` and a custom loop as one device does, on (1, 2) and (2, 2) meshes; a
traced step exchanges, per block forward, 2 all-gathers and 2
reduce-scatters and sums no whole-sequence product; backward, it gathers
the column layers' inputs again (2 all-gathers more per block), so no
whole sequence is held from the forward; the LayerNorms and dropouts
between the Megatron pairs compute 1/k of the sequence on each device.

Marked `slow`: the (1, 2) mesh's `fit` (with and without XLA), the custom
loops.
"""

import collections
import functools
import re
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

import replicator_strategy as rs

VOCAB, SEQ, WIDTH, HEADS, ROWS = 12, 8, 16, 4, 16
BATCH = 3  # The traced step's rows: no weight has a dimension of 3.


def layout_map(replicas, model):
  """Heads and the MLP split Megatron's way; the row layers' outputs (and
  the embedding's) split along the sequence."""
  mesh = keras.distribution.DeviceMesh(
      (replicas, model), ("batch", "model"),
      keras.distribution.list_devices()[:replicas * model])
  layouts = keras.distribution.LayoutMap(mesh)
  layouts[".*attention/(query|key|value)/kernel"] = (None, "model", None)
  layouts[".*attention/(query|key|value)/bias"] = ("model", None)
  layouts[".*attention/attention_output/kernel"] = ("model", None, None)
  layouts[".*up/kernel"] = (None, "model")
  layouts[".*up/bias"] = ("model",)
  layouts[".*down/kernel"] = ("model", None)
  layouts[".*(tokens|attention_output|down)/output"] = (None, "model", None)
  return layouts


def transformer(blocks=1):
  """Pre-norm blocks: x + drop(attend(norm(x))), x + drop(mlp(norm(x)))."""
  keras.utils.set_random_seed(3)
  ids = keras.Input((SEQ,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")(ids)
  for b in range(blocks):
    h = keras.layers.LayerNormalization(name=f"block{b}_norm1")(x)
    h = keras.layers.MultiHeadAttention(
        HEADS, WIDTH // HEADS, name=f"block{b}_attention")(
            h, h, use_causal_mask=True)
    x = x + keras.layers.Dropout(0.2, name=f"block{b}_drop1")(h)
    h = keras.layers.LayerNormalization(name=f"block{b}_norm2")(x)
    h = keras.layers.Dense(4 * WIDTH, activation="gelu",
                           name=f"block{b}_up")(h)
    h = keras.layers.Dense(WIDTH, name=f"block{b}_down")(h)
    x = x + keras.layers.Dropout(0.2, name=f"block{b}_drop2")(h)
  x = keras.layers.LayerNormalization(name="final_norm")(x)
  return compiled(keras.Model(ids, keras.layers.Dense(VOCAB, name="logits")(x)))


def compiled(model, jit_compile=False):
  # SGD: the key bias's gradient is zero but for rounding, which Adam's
  # normalization would make a step of the learning rate's size.
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile)
  return model


def data():
  ids = np.random.default_rng(4).integers(0, VOCAB, size=(ROWS, SEQ + 1))
  return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)


def fit(model, dataset=False):
  """The losses and weights after 2 steps of `fit`; from a `tf.data`
  dataset, whose batch size is unknown when the step is traced."""
  x, y = data()
  if dataset:
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
                        epochs=1, verbose=0)
  else:
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0)
  return history.history["loss"], model.get_weights()


def custom_loop(strategy, steps=2):
  """The losses and weights after `steps` of a custom loop (with no
  strategy: one device)."""
  x, y = data()
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    model = transformer()
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True)) / ROWS
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  losses = []
  if strategy is None:
    step = tf.function(replica_step)
    for _ in range(steps):
      losses.append(float(step(x, y)))
    return losses, model.get_weights()
  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(ROWS))))

  @tf.function
  def step(batch):
    return strategy.reduce("sum", strategy.run(replica_step, batch), None)

  for _ in range(steps):
    losses.append(float(step(batch)))
  return losses, model.get_weights()


@functools.cache
def one_device(how):
  if how == "xla":
    return fit(compiled(transformer(), jit_compile=True))
  return fit(transformer()) if how == "fit" else custom_loop(None)


def assert_equal_to_one_device(have, want):
  np.testing.assert_allclose(have[0], want[0], rtol=1e-5)
  for h, w in zip(have[1], want[1], strict=True):
    np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)


def sequence_parallel(replicas, model):
  strategy = rs.ReplicatorStrategy(layout_map=layout_map(replicas, model))
  with strategy.scope():
    return strategy, transformer()


class TrainingTest(unittest.TestCase):

  @pytest.mark.slow
  def test_fit_on_a_2_by_2_mesh_equals_one_device(self):
    _, model = sequence_parallel(2, 2)
    assert_equal_to_one_device(fit(model), one_device("fit"))

  @pytest.mark.slow
  def test_fit_on_a_1_by_2_mesh_equals_one_device(self):
    _, model = sequence_parallel(1, 2)
    assert_equal_to_one_device(fit(model), one_device("fit"))

  @pytest.mark.slow
  def test_fit_under_xla_on_a_1_by_2_mesh_equals_one_device_under_xla(self):
    # XLA draws other dropout values than TF's kernels: one device's under
    # XLA, each device's slice of them drawn inside its XLA cluster.
    _, model = sequence_parallel(1, 2)
    assert_equal_to_one_device(fit(compiled(model, jit_compile=True)),
                               one_device("xla"))

  @pytest.mark.slow
  def test_fit_under_xla_with_rows_unknown_when_tracing_equals_one_device(self):
    # The dropouts draw the rows' whole runs at once, which XLA compiles
    # too (a loop over the rows it would leave out, drawing TF's values).
    _, model = sequence_parallel(1, 2)
    assert_equal_to_one_device(
        fit(compiled(model, jit_compile=True), dataset=True), one_device("xla"))

  @pytest.mark.slow
  def test_a_custom_loop_on_a_1_by_2_mesh_equals_one_device(self):
    strategy = rs.ReplicatorStrategy(layout_map=layout_map(1, 2))
    assert_equal_to_one_device(custom_loop(strategy),
                               one_device("custom_loop"))

  @pytest.mark.slow
  def test_a_custom_loop_on_a_2_by_2_mesh_equals_one_device(self):
    strategy = rs.ReplicatorStrategy(layout_map=layout_map(2, 2))
    assert_equal_to_one_device(custom_loop(strategy),
                               one_device("custom_loop"))


def _device_index(op):
  return tf.DeviceSpec.from_string(op.device).device_index


@functools.cache
def traced_step(blocks=2):
  """The graph of a training step (a tape, then the optimizer) of `blocks`
  blocks on a (1, 2) mesh: its ops that feed something."""
  strategy = rs.ReplicatorStrategy(layout_map=layout_map(1, 2))
  with strategy.scope():
    model = transformer(blocks)
    model.optimizer.build(model.trainable_variables)
  x, y = (tf.constant(a[:BATCH]) for a in data())

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            model.compute_loss(x, y, model(x, training=True)))
      grads = tape.gradient(loss, model.trainable_variables)
      model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(replica_step, (x, y))

  graph = step.get_concrete_function(x, y).graph
  return [op for op in graph.get_operations()
          if any(t.consumers() for t in op.outputs)]


def _exchanges(ops):
  """{name scope: (block, exchange)} of the exchanges `ops` make: forward
  in a layer's scope, their gradients under "gradient_tape/"."""
  scopes = {}
  for op in ops:
    for name in ("sequence_all_gather", "sequence_reduce_scatter"):
      if f"/{name}/" in op.name:
        scope = op.name.split(f"/{name}/")[0]
        scopes[scope] = (re.search(r"block\d", scope).group(), name)
  return scopes


def _backward(ops):
  """`ops` from the first gradient op on: the backward pass and the update."""
  return ops[next(i for i, op in enumerate(ops)
                  if op.name.startswith("gradient_tape/")):]


def _readers(tensor):
  """The ops that read `tensor`, through identities and reshapes."""
  readers = []
  for op in tensor.consumers():
    if op.type in ("Identity", "IdentityN", "Reshape"):
      readers += [r for t in op.outputs for r in _readers(t)]
    else:
      readers.append(op)
  return readers


class ExchangesTest(unittest.TestCase):
  """What a replica's devices exchange, in a traced step of 2 blocks."""

  def test_each_block_all_gathers_twice_and_reduce_scatters_twice(self):
    scopes = _exchanges(traced_step())
    forward = {s: e for s, e in scopes.items()
               if not s.startswith("gradient_tape/")}
    self.assertEqual(collections.Counter(forward.values()), {
        (block, name): 2 for block in ("block0", "block1")
        for name in ("sequence_all_gather", "sequence_reduce_scatter")})
    # Backward, each is differentiated (an all-gather's gradient is a
    # reduce-scatter, and the other way round), on the same devices.
    self.assertEqual({s.removeprefix("gradient_tape/") for s in scopes
                      if s.startswith("gradient_tape/")}, set(forward))
    # Each device takes part in each exchange, forward and backward.
    for scope in scopes:
      self.assertEqual({_device_index(op) for op in traced_step()
                        if op.name.startswith(scope + "/sequence_")}, {0, 1})

  def test_no_activation_is_summed_away_from_its_device(self):
    sums = [op for op in traced_step()
            if op.type in ("AddN", "AddV2") and op.outputs[0].shape.rank == 3]

    def devices(op):  # Of the activations summed (not a bias).
      return {_device_index(t.op) for t in op.inputs if t.shape.rank == 3}

    # Across devices: only parts, each on its device, by the reduce-scatters
    # (2 a block forward, and the all-gathers' gradients backward); no
    # whole-sequence product is summed on one device.
    combines = [op for op in sums if len(devices(op)) > 1]
    self.assertEqual({(op.outputs[0].shape[1], _device_index(op))
                      for op in combines}, {(SEQ // 2, 0), (SEQ // 2, 1)})
    self.assertEqual(len(combines), 2 * 2 * 2 * 2)  # Blocks, ways, devices.
    # The tape's sums of a part's, or a copy's, gradients (a residual and a
    # layer read it) are made where it lives.
    self.assertEqual([op.name for op in sums if len(devices(op)) == 1 and
                      devices(op) != {_device_index(op)}], [])

  def test_norms_and_dropouts_compute_half_the_sequence_on_each_device(self):
    # Forward and backward: each op of the LayerNormalizations and dropouts
    # between the Megatron pairs that makes a tensor of the step's rows
    # (not a weight's gradient).
    ops = [op for op in traced_step()
           if re.search(r"block\d_(norm|drop)\d", op.name) and
           op.outputs and op.outputs[0].dtype == tf.float32 and
           op.outputs[0].shape.rank == 3 and op.outputs[0].shape[0] == BATCH]
    self.assertGreater(len(ops), 40)
    self.assertEqual({(op.outputs[0].shape[1], _device_index(op))
                      for op in ops}, {(SEQ // 2, 0), (SEQ // 2, 1)})

  def test_the_backward_reads_no_whole_sequence_the_forward_gathered(self):
    # Each device keeps its part of a column layer's input for the backward
    # (Megatron-SP), not the whole its forward all-gathered.
    ops = traced_step()
    backward = _backward(ops)
    wholes = {t.name for op in ops[:len(ops) - len(backward)]
              if "/sequence_all_gather/" in op.name for t in op.outputs
              if t.shape.rank == 3 and t.shape[1] == SEQ}
    self.assertGreater(len(wholes), 2 * 2 * 2)
    self.assertEqual([op.name for op in backward
                      if any(t.name in wholes for t in op.inputs)], [])

  def test_each_block_gathers_its_column_layers_inputs_again_backward(self):
    # Attention's input (shared by query, key and value) and up's: on each
    # device, read there by the kernels' gradients (and by the product made
    # again for the tape to differentiate, its value unread).
    concats = [op for op in _backward(traced_step())
               if "/sequence_all_gather_again/" in op.name and
               op.type == "ConcatV2"]
    self.assertEqual(collections.Counter(
        (re.search(r"block\d", op.name).group(), _device_index(op))
        for op in concats), {(block, device): 2 for block in (
            "block0", "block1") for device in (0, 1)})
    for op in concats:
      readers = [r for r in _readers(op.outputs[0])
                 if r.name.startswith("gradient_tape/")]
      self.assertEqual([r.type for r in readers],
                       ["Einsum"] * 3 if "attention" in op.name else ["MatMul"])
      self.assertEqual({_device_index(r) for r in readers},
                       {_device_index(op)})
