"""A split weight's gradient stays in parts, from the tape to the update.

On a (2, 2) mesh (also as 2 sync groups of 1 replica) the traced training
step (Keras's train step, as `fit` runs it in each replica, and a custom
loop's `apply_gradients`) computes no tensor of a split weight's whole shape
that its outputs or updates depend on: each part's gradient is summed over
the replicas on its own device, and each part updated from it; so too when
the optimizer clips, scales the loss or accumulates, or the strategy
compresses the sum. The layers: an Embedding, MultiHeadAttention (its
EinsumDense projections), and a Megatron MLP of Dense layers. Clipped or
compressed in parts, it trains as one device does.
"""

import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import _tf_internal as tfi
from replicator_strategy.model_parallel import split_variables

# No activation, part or unsplit weight has a split weight's whole shape.
VOCAB, SEQ, WIDTH, HEADS, KEY_DIM, HIDDEN = 10, 5, 16, 4, 6, 28


def layout(table):
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  if table is not None:
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


def split_block(table, optimizer=lambda: keras.optimizers.Adam(0.01),
                **options):
  """(strategy, `block`) on a (2, 2) mesh, the `optimizer()` built;
  `options`: the strategy's."""
  strategy = rs.ReplicatorStrategy(layout_map=layout(table), **options)
  with strategy.scope():
    model = block(optimizer())
    model.optimizer.build(model.trainable_variables)
  return strategy, model


def whole_shapes(model):
  """The shapes of `model`'s split weights: the table's (if split), query,
  key and value's kernels' and biases', the attention output's, up's
  kernel's and bias's, down's."""
  return {tuple(v.shape) for v in model.weights
          if isinstance(v.value, split_variables.SplitVariable)}


def reached_whole(graph, shapes):
  """Ops of `graph` (and of the functions it calls) that the function's
  outputs or updates depend on, whose outputs have one of `shapes`."""
  return _reached(graph, shapes)[0]


def _reached(graph, shapes):
  """(`reached_whole`'s ops, the indices of `graph.inputs` they depend on)."""
  found, seen = [], set()
  pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    found.extend(op.name for t in op.outputs
                 if t.shape.rank is not None and
                 tuple(t.shape.as_list()) in shapes)
    pending.extend(op.control_inputs)
    called = tfi.called_function_graphs(op)
    if op.type not in ("If", "StatelessIf", "PartitionedCall",
                       "StatefulPartitionedCall"):
      pending.extend(t.op for t in op.inputs)
      for function_graph in called:
        found.extend(reached_whole(function_graph, shapes))
      continue
    # A call (a tf.cond's branches): only the inputs its functions read.
    first = 1 if op.type.endswith("If") else 0
    pending.extend(t.op for t in op.inputs[:first])
    for function_graph in called:
      names, used = _reached(function_graph, shapes)
      found.extend(names)
      pending.extend(op.inputs[first + i].op for i in used)
  inputs = [t.op for t in graph.inputs]
  return found, {i for i, op in enumerate(inputs) if op in seen}


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
# Optimizers that change the gradient between the tape and the update.
CHANGING = [
    ("clipnorm", lambda: keras.optimizers.Adam(0.01, clipnorm=0.1)),
    ("global_clipnorm",
     lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1)),
    ("clipvalue", lambda: keras.optimizers.Adam(0.01, clipvalue=0.01)),
    ("loss_scale", lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01))),
]


class NoWholeGradientTest(unittest.TestCase):

  def check(self, strategy, model, step_graph=fit_step_graph, split=7):
    """No tensor of the traced step's has the whole shape of any of the
    `split` distinct shapes of `model`'s split weights."""
    shapes = whole_shapes(model)
    self.assertEqual(len(shapes), split, shapes)
    self.assertEqual(reached_whole(step_graph(strategy, model), shapes), [])

  @parameterized.expand(TABLES)
  def test_the_fit_step_holds_no_whole_split_weight_with_a_table_by(
      self, _, table):
    self.check(*split_block(table))

  @parameterized.expand(CHANGING)
  def test_the_fit_step_holds_no_whole_split_weight_with(self, _, optimizer):
    self.check(*split_block((None, "model"), optimizer))

  def test_the_fit_step_holds_no_whole_split_weight_compressed(self):
    self.check(*split_block((None, "model"), gradient_compression="bfloat16"))

  def test_accumulating_holds_no_whole_split_weight_but_a_sparse_one(self):
    # Keras adds a sparse gradient to its accumulator dense, whole: the
    # table here is not split.
    self.check(*split_block(None, lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2)), split=6)

  def test_a_custom_loop_step_holds_no_whole_split_weight(self):
    self.check(*split_block((None, "model"),
                            lambda: keras.optimizers.SGD(0.1)),
               step_graph=custom_step_graph)

  @parameterized.expand([("fit", fit_step_graph),
                         ("custom_loop", custom_step_graph)])
  def test_in_sync_groups_the_step_holds_no_whole_split_weight_in(
      self, _, step_graph):
    # 2 groups of 1 replica over 2 devices: each part is summed within its
    # group, on its device.
    self.check(*split_block((None, "model"), sync_groups=2),
               step_graph=step_graph)


def trained(model):
  ids = np.random.default_rng(2).integers(0, VOCAB, size=(16, SEQ + 1))
  history = model.fit(ids[:, :-1], ids[:, 1:], batch_size=8, epochs=2,
                      shuffle=False, verbose=0)
  return history.history["loss"], model.get_weights()


class InPartsTrainsAsOneDeviceTest(unittest.TestCase):
  """Clipped, or summed as 16-bit floats, in parts: as one device trains."""

  def check(self, optimizer, rtol, **options):
    want_loss, want = trained(block(optimizer()))
    _, model = split_block((None, "model"), optimizer, **options)
    have_loss, have = trained(model)
    np.testing.assert_allclose(have_loss, want_loss, rtol=rtol)
    for w, h in zip(want, have, strict=True):
      np.testing.assert_allclose(h, w, rtol=rtol, atol=rtol / 10)

  # SGD: its updates follow the gradients' rounding, which Adam's
  # normalization would amplify.
  @parameterized.expand([("clipnorm", {"clipnorm": 0.1}),
                         ("global_clipnorm", {"global_clipnorm": 0.1})])
  def test_clipping_in_parts_by(self, _, clipping):
    self.check(lambda: keras.optimizers.SGD(0.1, **clipping), 1e-5)

  def test_gradient_compression_in_parts(self):
    self.check(lambda: keras.optimizers.SGD(0.1), 1e-2,
               gradient_compression="bfloat16")
