"""`MultiHeadAttention` with its heads split by a layout map.

Each device attends over its heads. Attention dropout draws, for each
device's heads, the values one device draws for them, and
`return_attention_scores=True` returns the devices' scores assembled along
the heads axis without reading query, key or value whole: training with
dropout, and with the scores, equals one device at rtol 1e-5 on a (1, 2)
and a (2, 2) mesh.

Under `keras.RematScope(mode="larger_than")`, each device's core is
recomputed in the backward (its softmax runs twice), training as one device.

Marked `slow` (the quick loop leaves them out): the (1, 2) meshes and the
recompute.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import random_rows

ROWS, BATCH, SEQ, WIDTH, HEADS = 16, 8, 5, 8, 4


def layout(replicas, heads_per_device=2):
  mesh = keras.distribution.DeviceMesh(
      (replicas, heads_per_device), ("batch", "model"),
      keras.distribution.list_devices()[:replicas * heads_per_device])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
  layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
  layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
  return layout_map


def data():
  rng = np.random.default_rng(5)
  x = rng.normal(size=(ROWS, SEQ, WIDTH)).astype(np.float32)
  y = rng.normal(size=(ROWS, SEQ, WIDTH)).astype(np.float32)
  scores = rng.uniform(size=(ROWS, HEADS, SEQ, SEQ)).astype(np.float32)
  return x, y, scores


def attention_model(scores=False):
  """Self-attention with dropout on the scores; `scores`: the model returns
  them too, and trains on them. SGD: the key's bias has a zero gradient (a
  softmax ignores a shift of all its inputs), whose rounding Adam would
  scale up to its step size."""
  keras.utils.set_random_seed(11)
  x = keras.Input((SEQ, WIDTH))
  attention = keras.layers.MultiHeadAttention(
      HEADS, WIDTH // HEADS, dropout=0.25, seed=3, name="attention")
  if scores:
    out, attention_scores = attention(x, x, return_attention_scores=True)
    model = keras.Model(x, [out, attention_scores])
    model.compile(keras.optimizers.SGD(0.1), ["mse", "mse"])
  else:
    model = keras.Model(x, attention(x, x, use_causal_mask=True))
    model.compile(keras.optimizers.SGD(0.1), "mse")
  return model


def compiled(model, scores=False):
  """`model` compiled with XLA."""
  model.compile(keras.optimizers.SGD(0.1), ["mse", "mse"] if scores else "mse",
                jit_compile=True)
  return model


def fit(model, scores=False, dataset=False):
  """The losses and weights after 2 steps of `fit`, then `predict`; `fit`
  from a `tf.data` dataset, whose batch size is unknown when the step is
  traced, if `dataset`."""
  x, y, want_scores = data()
  targets = (y, want_scores) if scores else y
  if dataset:
    history = model.fit(tf.data.Dataset.from_tensor_slices(
        (x, targets)).batch(BATCH), verbose=0)
  else:
    history = model.fit(x, targets, batch_size=BATCH, shuffle=False,
                        verbose=0)
  outputs = model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
  return history.history["loss"], model.get_weights(), outputs


@functools.cache
def one_device(scores=False):
  return fit(attention_model(scores), scores)


def assert_equal_to_one_device(test, got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for w, h in zip(want[1], got[1]):
    np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)
  for w, h in zip(tf.nest.flatten(want[2]), tf.nest.flatten(got[2])):
    np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)
  del test


def split_model(replicas, scores=False):
  strategy = rs.ReplicatorStrategy(layout_map=layout(replicas))
  with strategy.scope():
    return strategy, attention_model(scores)


class DropoutTest(unittest.TestCase):
  """`fit` runs the attention with `training=True`: its dropout acts."""

  def test_fit_with_dropout_on_a_2_by_2_mesh_equals_one_device(self):
    _, model = split_model(2)
    assert_equal_to_one_device(self, fit(model), one_device())

  @pytest.mark.slow
  def test_fit_with_dropout_on_a_1_by_2_mesh_equals_one_device(self):
    _, model = split_model(1)
    assert_equal_to_one_device(self, fit(model), one_device())

  @pytest.mark.slow
  def test_fit_under_xla_with_dropout_equals_one_device_under_xla(self):
    # XLA draws other values than TF's kernels: one device's under XLA.
    want = fit(compiled(attention_model()))
    _, model = split_model(2)
    assert_equal_to_one_device(self, fit(compiled(model)), want)
    # Rows unknown when tracing: each device draws its rows' whole runs at
    # once, which XLA compiles too (a loop over the rows it would leave out).
    _, model = split_model(2)
    assert_equal_to_one_device(self, fit(compiled(model), dataset=True), want)


def traced_gradients(strategy, model, x):
  """The graph of a replica's forward and backward pass of `model`, with
  dropout, on `x`, and the scores it returns."""

  @tf.function
  def step(x):
    def replica_step(x):
      with tf.GradientTape() as tape:
        out, scores = model(x, training=True)
        loss = tf.reduce_sum(out) + tf.reduce_sum(scores * scores)
      return tape.gradient(loss, model.trainable_variables), scores
    return strategy.run(replica_step, (x,))

  return step.get_concrete_function(x).graph


def _device_index(op):
  return tf.DeviceSpec.from_string(op.device).device_index


class ScoresTest(unittest.TestCase):
  """`return_attention_scores=True`: the scores (before dropout, as Keras
  returns them) and the output, and training on both, equal one device's."""

  @pytest.mark.slow
  def test_fit_on_the_scores_on_a_2_by_2_mesh_equals_one_device(self):
    _, model = split_model(2, scores=True)
    assert_equal_to_one_device(self, fit(model, scores=True),
                               one_device(scores=True))

  @pytest.mark.slow
  def test_fit_on_the_scores_on_a_1_by_2_mesh_equals_one_device(self):
    _, model = split_model(1, scores=True)
    assert_equal_to_one_device(self, fit(model, scores=True),
                               one_device(scores=True))

  def test_no_op_reads_query_key_or_value_whole(self):
    strategy, model = split_model(1, scores=True)
    graph = traced_gradients(strategy, model, tf.constant(data()[0][:BATCH]))
    concats = [op for op in graph.get_operations() if op.type == "ConcatV2"]
    # Query, key and value, assembled from their parts, feed nothing.
    whole = [op for op in concats
             if any(f"/{name}" in op.name for name in ("query", "key", "value"))]
    self.assertEqual(len(whole), 3, [op.name for op in concats])
    self.assertEqual([c for op in whole for c in op.outputs[0].consumers()], [])
    # The scores are each device's, forward and backward, then assembled.
    self.assertEqual({_device_index(op) for op in graph.get_operations()
                      if op.type in ("Softmax", "SoftmaxGrad")}, {0, 1})
    scores = [op for op in concats
              if op.outputs[0].shape.as_list() == [BATCH, HEADS, SEQ, SEQ]]
    self.assertEqual(len(scores), 1)
    self.assertEqual([_device_index(t.op) for t in scores[0].inputs[:-1]],
                     [0, 1])


class UniformSliceTest(unittest.TestCase):
  """The draw each device's heads take: its slice of one device's draw."""

  @parameterized.expand([("float32", tf.float32), ("bfloat16", tf.bfloat16)])
  def test_a_slice_holds_the_values_of_one_draw(self, _, dtype):
    seed = tf.constant([3, 9])
    whole = tf.random.stateless_uniform([7, 6, 3, 5], seed, dtype=dtype)

    @tf.function(input_signature=[tf.TensorSpec([None, 2, 3, 5], dtype)])
    def unknown_rows(x):  # Rows known only when running: whole runs drawn.
      return random_rows.uniform_slice(tf.shape(x), seed, 1, 4, 6, dtype, 3)

    known = random_rows.uniform_slice([4, 2, 3, 5], seed, 1, 4, 6, dtype, 3)
    for part in (known, unknown_rows(tf.zeros([4, 2, 3, 5], dtype))):
      np.testing.assert_array_equal(part, whole[3:, 4:])


def core_remat(rows):
  """A `RematScope` whose threshold is a device's scores (of 2 heads) for
  `rows` rows a replica: Keras recomputes no layer of the attention, ours
  its core (the whole scores are twice that)."""
  return keras.RematScope(mode="larger_than",
                          output_size_threshold=rows * HEADS // 2 * SEQ * SEQ)


class CoreRematTest(unittest.TestCase):
  """`RematScope(mode="larger_than")` with split heads: each device's core
  (scores, softmax, dropout, heads' outputs) is recomputed in the backward."""

  @pytest.mark.slow
  def test_fit_on_a_2_by_2_mesh_equals_one_device(self):
    strategy = rs.ReplicatorStrategy(layout_map=layout(2))
    with strategy.scope(), core_remat(BATCH // 2):
      model = attention_model()
    assert_equal_to_one_device(self, fit(model), one_device())

  @pytest.mark.slow
  def test_fit_under_xla_equals_one_device_under_xla(self):
    want = fit(compiled(attention_model()))
    strategy = rs.ReplicatorStrategy(layout_map=layout(2))
    with strategy.scope(), core_remat(BATCH // 2):
      model = attention_model()
    assert_equal_to_one_device(self, fit(compiled(model)), want)

  @pytest.mark.slow
  def test_each_device_computes_its_softmax_again_in_the_backward(self):
    strategy = rs.ReplicatorStrategy(layout_map=layout(1))
    with strategy.scope(), core_remat(BATCH):
      model = attention_model()

    @tf.function
    def step(x):
      def replica_step(x):
        with tf.GradientTape() as tape:
          loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)
      return strategy.run(replica_step, (x,))

    graph = step.get_concrete_function(tf.constant(data()[0][:BATCH])).graph
    softmaxes = [_device_index(op) for op in graph.get_operations()
                 if op.type == "Softmax"]
    self.assertEqual(sorted(softmaxes), [0, 0, 1, 1])  # Forward, recompute.
