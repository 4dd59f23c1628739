"""A model cut into pipeline stages computes what the model does.

An 8-block MLP (Sequential) and a small transformer-like Functional model
(2 inputs, 2 outputs, residual connections, dropout) cut into 1, 2, 4 (and 8)
stages: the stages run in order give the model's outputs exactly, with
`training` on and off, also when every tensor between stages is copied (as
between devices: a Keras mask must travel by name); the stages' variables
partition the model's; the balanced cuts are those the rule of
`pipeline.balance` picks (checked against every possible cut); a named split
cuts where it says; bad arguments and models are refused with the fix.
"""

import ast
import itertools
import re
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.keras import _internal as keras_internal
from replicator_strategy.keras.model_stages import split_model
from replicator_strategy.pipeline import balance
from replicator_strategy.pipeline import stages as stages_lib

layers = keras.layers
MLP_WIDTHS = (8, 16, 8, 32, 8, 8, 16, 4)


def mlp():
  keras.utils.set_random_seed(1)
  return keras.Sequential(
      [keras.Input((6,))] +
      [layers.Dense(w, activation="relu", name=f"block_{i}")
       for i, w in enumerate(MLP_WIDTHS)], name="mlp")


def transformer(width=8, length=5):
  """Two inputs (the context used again at the end), two outputs."""
  keras.utils.set_random_seed(2)
  tokens = keras.Input((length, width), name="tokens")
  context = keras.Input((width,), name="context")
  x = layers.Dense(width, name="embed")(tokens)
  row = layers.Reshape((1, width), name="context_row")(
      layers.Dense(width, name="context_proj")(context))
  x = layers.Add(name="with_context")([x, row])
  for b in range(2):
    h = layers.LayerNormalization(name=f"block{b}_norm1")(x)
    h = layers.MultiHeadAttention(2, 4, name=f"block{b}_attention")(h, h)
    h = layers.Dropout(0.25, name=f"block{b}_drop")(h)
    x = layers.Add(name=f"block{b}_residual1")([x, h])
    h = layers.LayerNormalization(name=f"block{b}_norm2")(x)
    h = layers.Dense(2 * width, activation="gelu", name=f"block{b}_up")(h)
    h = layers.Dense(width, name=f"block{b}_down")(h)
    x = layers.Add(name=f"block{b}_residual2")([x, h])
  pooled = layers.GlobalAveragePooling1D(name="pool")(x)
  logits = layers.Dense(3, name="head")(pooled)
  aux = layers.Dense(1, name="aux")(
      layers.Concatenate(name="aux_in")([pooled, context]))
  return keras.Model([tokens, context], [logits, aux], name="transformer")


def mlp_batch():
  return np.random.default_rng(0).normal(size=(4, 6)).astype("float32")


def transformer_batch():
  rng = np.random.default_rng(0)
  return [rng.normal(size=(4, 5, 8)).astype("float32"),
          rng.normal(size=(4, 8)).astype("float32")]


def run_copied(stages, x, training):
  """The stages in order, each tensor between them copied (as a device
  transfer does: a Python attribute such as a Keras mask is lost)."""
  tensors = stages_lib.model_inputs(stages, x)
  for stage in stages:
    tensors = {k: tf.identity(v) for k, v in stage(tensors, training).items()}
  return [tensors[f"output:{i}"] for i in range(len(stages[-1].graph.outputs))]


def assert_exactly_equal(test, got, want):
  got, want = keras.tree.flatten(got), keras.tree.flatten(want)
  test.assertEqual(len(got), len(want))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def ids(variables):
  return [id(v) for v in variables]


CASES = [("mlp", mlp, mlp_batch, s) for s in (1, 2, 4, 8)] + [
    ("transformer", transformer, transformer_batch, s) for s in (1, 2, 4)]


class StagesComputeTheModelTest(unittest.TestCase):

  @parameterized.expand(CASES)
  def test_stages_in_order_equal_the_model(self, _, make, batch, num_stages):
    model, x = make(), batch()
    stages = split_model(model, num_stages)
    self.assertEqual(len(stages), num_stages)
    saved = [v.numpy() for v in model.variables]
    for training in (None, False, True):
      with self.subTest(training=training):
        want = model(x, training=training)
        for v, value in zip(model.variables, saved):  # Dropout's seed back.
          v.assign(value)
        assert_exactly_equal(
            self, stages_lib.model_outputs(stages, x, training=training), want)
        for v, value in zip(model.variables, saved):
          v.assign(value)
        assert_exactly_equal(self, run_copied(stages, x, training),
                             keras.tree.flatten(want))
    if num_stages > 1 and make is transformer:
      # Dropout acts: the comparison above sees the `training` flag.
      self.assertFalse(np.array_equal(model(x, training=True)[0],
                                      model(x, training=False)[0]))

  def test_traced_stages_equal_the_traced_model(self):
    model, x = transformer(), transformer_batch()
    stages = split_model(model, 4)
    assert_exactly_equal(
        self, tf.function(stages_lib.model_outputs)(stages, x),
        tf.function(model)(x))

  @parameterized.expand(CASES)
  def test_each_tensor_crossing_a_cut_is_carried(self, _, make, unused_batch,
                                                 num_stages):
    model = make()
    stages = split_model(model, num_stages)
    self.assertTrue(all(stage.calls for stage in stages))  # Each does work.
    self.assertEqual(stages[0].inputs[0], "input:0")
    for before, after in zip(stages, stages[1:]):
      self.assertEqual(after.inputs, before.outputs)
    self.assertEqual(stages[-1].outputs,
                     tuple(f"output:{i}" for i in range(len(model.outputs))))
    if make is transformer:
      # The context is read by the first and the last layers: every stage
      # carries it.
      for stage in stages:
        self.assertIn("input:1", stage.inputs)

  @parameterized.expand(CASES)
  def test_the_stages_variables_are_their_layers_and_all_the_models(
      self, _, make, unused_batch, num_stages):
    model = make()
    stages = split_model(model, num_stages)
    for attr in ("variables", "trainable_variables"):
      per_stage = [ids(getattr(stage, attr)) for stage in stages]
      for stage, found in zip(stages, per_stage):
        self.assertCountEqual(found, [i for layer in stage.layers
                                      for i in ids(getattr(layer, attr))])
      every = [i for found in per_stage for i in found]
      self.assertCountEqual(every, ids(getattr(model, attr)))
    self.assertEqual(sum(s.params for s in stages), model.count_params())
    called = [layer.name for stage in stages for layer in stage.layers]
    self.assertCountEqual(called, [layer.name for layer in model.layers
                                   if not isinstance(layer, layers.InputLayer)])


def loss_of(outputs):
  return tf.reduce_sum(outputs[0]) + tf.reduce_sum(outputs[1] ** 2)


def gradients_stage_by_stage(stages, x):
  """The loss's gradients, each stage differentiated on its own tape and
  fed the gradients of its outputs (as a pipeline's backward pass is)."""
  tensors, taped = stages_lib.model_inputs(stages, x), []
  for stage in stages:
    with tf.GradientTape() as tape:
      tape.watch(list(tensors.values()))
      outputs = stage(tensors, training=True)
      if stage is stages[-1]:
        outputs = loss_of([outputs["output:0"], outputs["output:1"]])
    taped.append((tape, tensors, outputs))
    tensors = outputs
  grads, upstream = {}, None
  for stage, (tape, inputs, outputs) in reversed(list(zip(stages, taped))):
    sources = [inputs[name] for name in stage.inputs]
    if upstream is None:
      found = tape.gradient(outputs, sources + stage.trainable_variables)
    else:
      found = tape.gradient([outputs[name] for name in stage.outputs],
                            sources + stage.trainable_variables,
                            output_gradients=[upstream[name]
                                              for name in stage.outputs])
    upstream = dict(zip(stage.inputs, found))
    grads.update(zip(ids(stage.trainable_variables), found[len(sources):]))
  return grads


class StageGradientsTest(unittest.TestCase):

  @parameterized.expand([(2,), (4,)])
  def test_stage_by_stage_backward_equals_the_models(self, num_stages):
    model, x = transformer(), transformer_batch()
    saved = [v.numpy() for v in model.variables]
    with tf.GradientTape() as tape:
      loss = loss_of(model(x, training=True))
    want = tape.gradient(loss, model.trainable_variables)
    for v, value in zip(model.variables, saved):
      v.assign(value)
    got = gradients_stage_by_stage(split_model(model, num_stages), x)
    assert_exactly_equal(
        self, [got[id(v)] for v in model.trainable_variables], want)


def best_cuts_by_search(costs, num_stages, allowed):
  """The rule of `pipeline.balance`, by trying every choice of cuts."""
  def key(cuts):
    spans = balance.stage_costs(costs, cuts)
    return (max(spans), sum(c * c for c in spans), [-p for p in cuts[::-1]])
  return min(itertools.combinations(sorted(allowed), num_stages - 1), key=key)


class BalancedCutsTest(unittest.TestCase):

  def test_the_rule_on_plain_costs(self):
    # Least largest stage (4), then least spread (4, 3, 3 over 4, 4, 2).
    self.assertEqual(balance.balanced_cuts([1] * 10, 3, range(1, 10)), (4, 7))
    # A call without cost stays with the one before it.
    self.assertEqual(
        balance.balanced_cuts([8, 0, 8, 0, 8, 0, 8, 0], 2, range(1, 8)), (4,))
    # Only the allowed cuts (2 would give 6, 6); of equal ones the later.
    self.assertEqual(balance.balanced_cuts([5, 1, 1, 5], 2, range(1, 4)), (2,))
    self.assertEqual(balance.balanced_cuts([5, 1, 1, 5], 2, [1]), (1,))
    self.assertEqual(balance.balanced_cuts([5, 1, 1, 5], 2, [1, 3]), (3,))
    for costs in ([3, 1, 4, 1, 5, 9, 2, 6], [0, 7, 0, 0, 7, 1, 0, 2, 2]):
      for num_stages in range(1, len(costs) + 1):
        allowed = range(1, len(costs))
        self.assertEqual(balance.balanced_cuts(costs, num_stages, allowed),
                         best_cuts_by_search(costs, num_stages, allowed))

  @parameterized.expand(CASES)
  def test_the_model_is_cut_by_the_rule(self, _, make, unused_batch,
                                        num_stages):
    model = make()
    graph = split_model(model, 1)[0].graph
    costs = [layer.count_params() for layer in
             (call.layer for call in graph.calls)]
    stages = split_model(model, num_stages)
    cuts = tuple(itertools.accumulate(len(s.calls) for s in stages))[:-1]
    self.assertEqual(cuts, best_cuts_by_search(
        costs, num_stages, range(1, len(graph.calls))))
    if make is mlp and num_stages == 2:
      self.assertEqual([s.params for s in stages], [624, 548])


class Slow(layers.Layer):
  """No weights, much work: parameter counts miss its cost, time does not."""

  def call(self, x):
    for _ in range(100):
      x = keras.ops.tanh(x)
    return x


class TimeBalanceTest(unittest.TestCase):

  def test_a_slow_layer_without_weights_gets_a_stage_of_its_own(self):
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [keras.Input((8,)), Slow(name="slow")] +
        [layers.Dense(8, name=f"dense_{i}") for i in range(3)])
    x = np.ones((4, 8), "float32")
    by_params = split_model(model, 2)
    self.assertEqual([layer.name for layer in by_params[0].layers],
                     ["slow", "dense_0", "dense_1"])
    by_time = split_model(model, 2, balance="time", sample=x)
    self.assertEqual([layer.name for layer in by_time[0].layers], ["slow"])
    assert_exactly_equal(self, stages_lib.model_outputs(by_time, x), model(x))

  def test_bad_balance(self):
    with self.assertRaisesRegex(ValueError, r"`balance` to be one of "
                                r"\('params', 'time'\).*balance='flops'"):
      split_model(mlp(), 2, balance="flops")
    with self.assertRaisesRegex(ValueError, r"sample=None. Pass sample="):
      split_model(mlp(), 2, balance="time")


class DescribeTest(unittest.TestCase):

  def test_each_stage_its_layers_params_and_tensors(self):
    text = stages_lib.describe(split_model(mlp(), 2))
    self.assertEqual(text.splitlines(), [
        "stage 0: 4 layers (block_0, block_1, block_2, block_3), 624 params",
        "  in:  input:0",
        "  out: block_3:0:0",
        "stage 1: 4 layers (block_4, block_5, block_6, block_7), 548 params",
        "  in:  block_3:0:0",
        "  out: output:0"])


class NamedSplitTest(unittest.TestCase):

  def test_cuts_before_the_named_layers(self):
    model, x = transformer(), transformer_batch()
    stages = split_model(model, 3, split=["block0_residual1", "block1_up"])
    names = [[layer.name for layer in s.layers] for s in stages]
    self.assertEqual(names[1][0], "block0_residual1")
    self.assertEqual(names[2][0], "block1_up")
    self.assertEqual(names[0][-1], "block0_drop")
    for stage in stages:
      self.assertCountEqual(
          ids(stage.variables),
          [i for name in ([layer.name for layer in stage.layers])
           for i in ids(model.get_layer(name).variables)])
    # The residual stream skips the attention of stage 0 into stage 1.
    self.assertIn("with_context:0:0", stages[1].inputs)
    assert_exactly_equal(self, stages_lib.model_outputs(stages, x),
                         model(x))

  def test_a_keras_mask_crosses_a_cut(self):
    keras.utils.set_random_seed(3)
    ids_in = keras.Input((6,), dtype="int32")
    h = layers.Embedding(10, 4, mask_zero=True, name="embed")(ids_in)
    h = layers.Dense(4, name="dense")(h)
    out = layers.Dense(2, name="out")(layers.GlobalAveragePooling1D(
        name="pool")(h))
    model = keras.Model(ids_in, out)
    x = np.array([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0]], "int32")
    stages = split_model(model, 2, split=["pool"])
    # The mask travels as the tensor Keras computed it from (`not_equal`,
    # the pooling's `mask` argument) and as the mask of the Dense's output.
    self.assertEqual(stages[0].outputs,
                     ("dense:0:0", "dense:0:0/mask", "not_equal:0:0"))
    assert_exactly_equal(self, run_copied(stages, x, None), [model(x)])


  def test_an_output_keeps_its_keras_mask_across_copies(self):
    # Keras's loss reads the mask of the model's output (a sequence here):
    # it must survive the copies between stages.
    keras.utils.set_random_seed(3)
    ids_in = keras.Input((6,), dtype="int32")
    h = layers.Embedding(10, 4, mask_zero=True, name="embed")(ids_in)
    model = keras.Model(ids_in, layers.Dense(2, name="out")(
        layers.Dense(4, name="dense")(h)))
    x = np.array([[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0]], "int32")
    stages = split_model(model, 3)
    tensors = stages_lib.model_inputs(stages, x)
    for stage in stages[:-1]:
      tensors = {k: tf.identity(v) for k, v in stage(tensors).items()}
    got = stages[-1](tensors)["output:0"]
    want = model(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(keras_internal.get_keras_mask(got),
                                  keras_internal.get_keras_mask(want))


class RefusedTest(unittest.TestCase):

  def assert_refused(self, pattern, *args, **kwargs):
    with self.assertRaisesRegex(ValueError, pattern) as caught:
      split_model(*args, **kwargs)
    return str(caught.exception)

  def test_bad_stage_counts(self):
    for bad in (0, -1, 2.0, "2", True):
      self.assert_refused(r"`stages` to be an int >= 1.*stages=", mlp(), bad)
    self.assert_refused(
        r"`stages` to be at most 8.*8 layer calls.*stages=9.*fewer stages",
        mlp(), 9)

  def test_bad_split_names(self):
    model = transformer()
    self.assert_refused(r"`split` names 'block1_upp'.*Did you mean "
                        r"\['block1_up'", model, 2, split=["block1_upp"])
    self.assert_refused(r"list 2 layer names for stages=3.*split=\['block0_up'\]",
                        model, 3, split=["block0_up"])
    self.assert_refused(r"list 1 layer names", model, 2, split="block0_up")
    self.assert_refused(
        r"in the order.*in call order: \['block0_up', 'block1_up'\]",
        model, 3, split=["block1_up", "block0_up"])
    self.assert_refused(r"in the order", model, 3,
                        split=["block0_up", "block0_up"])
    self.assert_refused(r"'context_proj', the first layer.*first stage would "
                        r"be empty", model, 2, split=["context_proj"])

  def test_a_layer_called_twice_stays_in_one_stage(self):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    shared = layers.Dense(4, name="shared")
    h = shared(layers.Dense(4, name="first")(inputs))
    h = layers.Dense(4, name="middle")(h)
    out = layers.Dense(2, name="last")(shared(h))
    model = keras.Model(inputs, out)
    message = self.assert_refused(
        r"layers sharing weights \(shared: calls 1\.\.3.*'shared' and "
        r"'shared'\) in stages 0 and 1.*split=\['middle'\]", model, 2,
        split=["middle"])
    suggested = ast.literal_eval(re.search(r"e\.g\. split=(\[.*\])", message)[1])
    x = np.ones((2, 4), "float32")
    for stages in (split_model(model, 2, split=suggested),
                   split_model(model, 2), split_model(model, 3)):
      holding = [s.index for s in stages
                 if any(layer.name == "shared" for layer in s.layers)]
      self.assertEqual(len(holding), 1)
      assert_exactly_equal(self, stages_lib.model_outputs(stages, x), model(x))
    self.assert_refused(r"at most 3", model, 4)

  def test_layers_tying_weights_stay_in_one_stage(self):

    class Tied(layers.Layer):
      """The transpose of a Dense layer's kernel: its weight too."""

      def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

      def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.dense.kernel))

    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    encode = layers.Dense(6, name="encode")
    h = layers.Dense(6, name="middle")(encode(inputs))
    model = keras.Model(inputs, Tied(encode, name="decode")(h))
    self.assert_refused(r"sharing weights \(encode, decode: calls 0\.\.2.*"
                        r"stages 0 and 1.*can be cut into at most 1 stages",
                        model, 2, split=["middle"])
    self.assert_refused(r"at most 1", model, 2)

  def test_a_subclassed_model_needs_a_layer_graph(self):

    class Subclassed(keras.Model):

      def __init__(self):
        super().__init__()
        self.dense = layers.Dense(2)

      def call(self, x):
        return self.dense(x)

    model = Subclassed()
    model(np.ones((1, 3), "float32"))
    self.assert_refused(r"layer graph.*Rewrite it as a Functional model",
                        model, 2)
    self.assert_refused(r"Expected `model` to be a Keras Functional or "
                        r"Sequential model", layers.Dense(2), 2)
    self.assert_refused(r"no layer graph.*not built.*keras.Input",
                        keras.Sequential([layers.Dense(2)]), 1)
    self.assert_refused(r"no layer graph.*holds no layer",
                        keras.Sequential([keras.Input((2,))]), 1)
    inputs = keras.Input((2,))
    self.assert_refused(r"calls no layer.*Add layers",
                        keras.Model(inputs, inputs), 1)

  def test_a_nested_model_is_one_layer(self):
    keras.utils.set_random_seed(5)
    inner = keras.Sequential([keras.Input((4,))] + [
        layers.Dense(4, name=f"inner_{i}") for i in range(3)], name="inner")
    inputs = keras.Input((4,))
    out = layers.Dense(2, name="after")(
        inner(layers.Dense(4, name="before")(inputs)))
    model = keras.Model(inputs, out)
    stages = split_model(model, 3)
    self.assertEqual([[layer.name for layer in s.layers] for s in stages],
                     [["before"], ["inner"], ["after"]])
    self.assertCountEqual(ids(stages[1].variables), ids(inner.variables))
    x = np.ones((2, 4), "float32")
    assert_exactly_equal(self, stages_lib.model_outputs(stages, x), model(x))
    self.assert_refused(r"at most 3.*a nested model is one call", model, 4)
    self.assert_refused(r"'inner_1', a layer inside 'inner'.*Name 'inner'",
                        model, 2, split=["inner_1"])

  def test_a_stage_names_the_tensors_it_misses(self):
    stages = split_model(mlp(), 2)
    with self.assertRaisesRegex(ValueError, r"Stage 1 of 'mlp' reads "
                                r"\['block_3:0:0'\]; missing"):
      stages[1]({"input:0": mlp_batch()})


if __name__ == "__main__":
  unittest.main()
