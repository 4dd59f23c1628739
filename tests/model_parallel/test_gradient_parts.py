"""A split weight's gradient stays in parts, from the tape to the update.

On a (2, 2) mesh the traced training step (Keras's train step, as `fit`
runs it in each replica, and a custom loop's `apply_gradients`) computes no
tensor of a split weight's whole shape that its outputs or updates depend
on: each part's gradient is summed over the replicas on its own device, and
each part updated from it. The layers: an Embedding, MultiHeadAttention
(its EinsumDense projections), and a Megatron MLP of Dense layers.
"""

import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import _tf_internal as tfi
from replicator_strategy.model_parallel import split_variables

# No activation of the traced step has a split weight's shape.
VOCAB, SEQ, WIDTH, HEADS, KEY_DIM, HIDDEN = 10, 5, 16, 4, 6, 24


def layout(table):
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*table/embeddings"] = table
  layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
  layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
  layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)
  return layout_map


def block(optimizer):
  keras.utils.set_random_seed(5)
  ids = keras.Input((SEQ,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, WIDTH, name="table")(ids)
  x = x + keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="attention")(
      x, x)
  hidden = keras.layers.Dense(HIDDEN, activation="relu", name="up")(x)
  x = x + keras.layers.Dense(WIDTH, name="down")(hidden)
  model = keras.Model(ids, keras.layers.Dense(VOCAB, name="logits")(x))
  model.compile(optimizer,
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def split_block(table, optimizer=lambda: keras.optimizers.Adam(0.01)):
  """(strategy, `block`) on a (2, 2) mesh, the `optimizer()` built."""
  strategy = rs.ReplicatorStrategy(layout_map=layout(table))
  with strategy.scope():
    model = block(optimizer())
    model.optimizer.build(model.trainable_variables)
  return strategy, model


def whole_shapes(model):
  shapes = {tuple(v.shape) for v in model.weights
            if isinstance(v.value, split_variables.SplitVariable)}
  assert len(shapes) == 7, shapes  # Table, q/k/v, their biases, output, up...
  return shapes


def reached_whole(graph, shapes):
  """Ops of `graph` (and of the functions it calls) that the function's
  outputs or updates depend on, whose outputs have one of `shapes`."""
  found = []
  pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
  seen = set()
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    found.extend(op.name for t in op.outputs
                 if t.shape.rank is not None and
                 tuple(t.shape.as_list()) in shapes)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
    for called in tfi.called_function_graphs(op):
      found.extend(reached_whole(called, shapes))
  return found


def inputs():
  ids = np.arange(4 * (SEQ + 1)).reshape(4, SEQ + 1) % VOCAB
  return tf.constant(ids[:, :-1]), tf.constant(ids[:, 1:])


def fit_step_graph(strategy, model):
  """Keras's train step, as `fit` runs it in each replica, traced."""

  @tf.function
  def step(x, y):
    return strategy.run(model.train_step, args=((x, y),))

  return step.get_concrete_function(*inputs()).graph


def custom_step_graph(strategy, model):
  """A custom loop's step: a tape, then `apply_gradients`, traced."""

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model.compute_loss(x, y, model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def step(x, y):
    strategy.run(replica_step, (x, y))

  return step.get_concrete_function(*inputs()).graph


TABLES = [("columns", (None, "model")), ("rows", ("model", None))]


class NoWholeGradientTest(unittest.TestCase):

  @parameterized.expand(TABLES)
  def test_the_fit_step_holds_no_whole_split_weight_with_a_table_by(
      self, _, table):
    strategy, model = split_block(table)
    self.assertEqual(
        reached_whole(fit_step_graph(strategy, model), whole_shapes(model)),
        [])

  def test_a_custom_loop_step_holds_no_whole_split_weight(self):
    strategy, model = split_block((None, "model"),
                                  lambda: keras.optimizers.SGD(0.1))
    self.assertEqual(
        reached_whole(custom_step_graph(strategy, model), whole_shapes(model)),
        [])
