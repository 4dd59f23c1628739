"""A step through any schedule gives one device's loss, gradients and outputs.

Every schedule (interleaved with 2 stages per device), on S = 2 and 4 of the
4 logical CPUs, over M = 1, 2, 3, 4, 8 micro-batches of a 10-row batch (3, 4
and 8 do not divide it), for an MLP of Dense layers and for a model whose
skip connection crosses stages (read directly from an earlier stage, and
carried through a middle one), with sample weights: the loss, gradients
and outputs equal one device's on the whole batch (rtol 1e-5), eagerly and
inside `tf.function`; the traced graph places each stage's ops on its
device and orders each device's actions as the schedule says; run eagerly,
a stage's activations live as long as the schedule says. The stages
are stand-ins, and `keras.model_stages.split_model`'s cut of a Functional
model with two inputs and residuals. `training=True` is passed
(the layers have no dropout: equal random draws on one device and in a
pipeline are the integration's to test).
"""

import itertools
import unittest
import weakref

import keras
import numpy as np
import pytest
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.keras import model_stages
from replicator_strategy.pipeline import executor
from replicator_strategy.pipeline import schedules
from replicator_strategy.pipeline import stages as stages_lib

ROWS, FEATURES, WIDTH = 10, 5, 6
DEVICES = [f"/device:CPU:{i}" for i in range(4)]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
             ("zb_h1", 1)]


class Stage:
  """A stand-in stage: `fn(layers, tensors, training)` -> its outputs."""

  def __init__(self, index, inputs, outputs, layers, fn):
    self.index, self.inputs, self.outputs = index, inputs, outputs
    self.layers, self.fn = layers, fn

  def __call__(self, tensors, training=None):
    assert training is True, training
    out = self.fn(self.layers, tensors)
    assert set(out) == set(self.outputs), (out, self.outputs)
    return out

  @property
  def trainable_variables(self):
    return [v for layer in self.layers for v in layer.trainable_variables]


def dense(j, units=WIDTH, activation="tanh"):
  return keras.layers.Dense(units, activation=activation, name=f"stage{j}")


def mlp(count):
  """Stage j: Dense from "h{j-1}" (or the input) to "h{j}" (or the output)."""
  keras.utils.set_random_seed(1)
  stages = []
  for j in range(count):
    read = "input:0" if j == 0 else f"h{j - 1}"
    write = "output:0" if j == count - 1 else f"h{j}"
    layer = dense(j, 2 if j == count - 1 else WIDTH,
                  None if j == count - 1 else "tanh")
    stages.append(Stage(j, (read,), (write,), [layer],
                        lambda ls, t, r=read, w=write: {w: ls[0](t[r])}))
  return stages


def skip(count):
  """The MLP with stage 0's output also added to the last stage's input;
  stage 1 carries it on (its output "skip"), a later middle stage does not,
  so the last stage reads it from stage 1 (or from stage 0 when S = 2)."""
  keras.utils.set_random_seed(2)
  stages = []
  for j in range(count):
    layer = dense(j, 2 if j == count - 1 else WIDTH,
                  None if j == count - 1 else "tanh")
    if j == 0:
      fn = lambda ls, t: (lambda h: {"h0": h, "skip": h[:, :1]})(
          ls[0](t["input:0"]))
      stages.append(Stage(j, ("input:0",), ("h0", "skip"), [layer], fn))
    elif j == count - 1:
      read = f"h{j - 1}"
      fn = lambda ls, t, r=read: {"output:0": ls[0](t[r] * t["skip"])}
      stages.append(Stage(j, (read, "skip"), ("output:0",), [layer], fn))
    elif j == 1:
      fn = lambda ls, t: {"h1": ls[0](t["h0"] + t["skip"]), "skip": t["skip"]}
      stages.append(Stage(j, ("h0", "skip"), ("h1", "skip"), [layer], fn))
    else:
      fn = lambda ls, t, r=f"h{j - 1}", w=f"h{j}": {w: ls[0](t[r])}
      stages.append(Stage(j, (f"h{j - 1}",), (f"h{j}",), [layer], fn))
  return stages


def batch(rows=ROWS):
  rng = np.random.default_rng(0)
  return (tf.constant(rng.normal(size=(rows, FEATURES)), tf.float32),
          tf.constant(rng.normal(size=(rows, 2)), tf.float32),
          tf.constant(rng.uniform(0.5, 2, size=(rows,)), tf.float32))


def loss_fn(y, y_pred, sample_weight):
  return keras.losses.MeanSquaredError()(y, y_pred, sample_weight=sample_weight)


def one_device(stages, x, y, w):
  """Loss, gradients and outputs of the stages run in order on one device."""
  with tf.GradientTape() as tape:
    tensors = {"input:0": x}
    for stage in stages:
      tensors.update(stage(tensors, training=True))
    loss = loss_fn(y, tensors["output:0"], w)
  variables = [v for s in stages for v in s.trainable_variables]
  return loss, tape.gradient(loss, variables), tensors["output:0"]


def build(stages, x):
  """Creates the stages' weights (a forward on one device)."""
  tensors = {"input:0": x}
  for stage in stages:
    tensors.update(stage(tensors, training=True))


def residual_model():
  """8 Dense layers, a residual around every pair, two inputs."""
  keras.utils.set_random_seed(3)
  x = keras.Input((FEATURES,))
  extra = keras.Input((1,))
  h = keras.layers.Dense(WIDTH, activation="tanh")(x)
  for _ in range(3):
    inner = keras.layers.Dense(WIDTH, activation="tanh")(h)
    h = h + keras.layers.Dense(WIDTH, activation="tanh")(inner)
  h = keras.layers.Dense(2)(h) * extra
  return keras.Model([x, extra], h)


class ExecutorTest(unittest.TestCase):

  def assert_step_equals_one_device(self, model, name, s, v, m, compiled=False,
                                    rows=ROWS):
    stages = model(s * v)
    x, y, w = batch(rows)
    build(stages, x)
    plan = schedules.schedule(name, s, m, v)
    run = lambda x, y, w: executor.run(plan, stages, DEVICES[:s], x, y,
                                       loss_fn, sample_weight=w)
    step = tf.function(run)(x, y, w) if compiled else run(x, y, w)
    loss, grads, outputs = one_device(stages, x, y, w)
    np.testing.assert_allclose(step.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(step.outputs, outputs, rtol=1e-5, atol=1e-7)
    self.assertEqual(len(step.gradients), len(grads))
    for got, want, var in zip(step.gradients, grads,
                              executor.variables(stages)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                 err_msg=var.path)

  @parameterized.expand([
      (f"{name}_{s}stages_{m}micro", name, s, v, m)
      for (name, v), s, m in itertools.product(SCHEDULES, (2, 4),
                                               (1, 2, 3, 4, 8))])
  def test_mlp_equals_one_device(self, _, name, s, v, m):
    self.assert_step_equals_one_device(mlp, name, s, v, m)

  @parameterized.expand([
      (f"{name}_{s}stages_{m}micro", name, s, v, m)
      for (name, v), s, m in itertools.product(SCHEDULES, (2, 4), (1, 3, 4))])
  def test_skip_connection_equals_one_device(self, _, name, s, v, m):
    self.assert_step_equals_one_device(skip, name, s, v, m)

  @parameterized.expand([(name, name, v) for name, v in SCHEDULES])
  def test_in_tf_function(self, _, name, v):
    self.assert_step_equals_one_device(skip, name, 4, v, 3, compiled=True)

  @parameterized.expand([
      (f"{name}_{s}stages", name, s, v)
      for (name, v), s in itertools.product(SCHEDULES, (2, 4))])
  def test_split_model_equals_the_model(self, _, name, s, v):
    model = residual_model()
    stages = model_stages.split_model(model, s * v)
    self.assertEqual(len(stages), s * v)
    x, y, w = batch()
    inputs = [x, x[:, :1] + 1.0]
    plan = schedules.schedule(name, s, 3, v)
    step = executor.run(plan, stages, DEVICES[:s],
                        stages_lib.model_inputs(stages, inputs), y, loss_fn,
                        sample_weight=w)
    with tf.GradientTape() as tape:
      outputs = model(inputs, training=True)
      loss = loss_fn(y, outputs, w)
    grads = tape.gradient(loss, executor.variables(stages))
    self.assertCountEqual([v.path for v in executor.variables(stages)],
                          [v.path for v in model.trainable_variables])
    np.testing.assert_allclose(step.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(step.outputs, outputs, rtol=1e-5, atol=1e-7)
    for got, want in zip(step.gradients, grads):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

  @parameterized.expand([("1f1b",), ("zb_h1",)])
  def test_token_ids_and_an_embedding(self, name):
    # Integer inputs take no gradient; the table's gradient is sparse
    # (IndexedSlices), summed over the micro-batches as such.
    keras.utils.set_random_seed(4)
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(7, WIDTH)(ids)
    h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    model = keras.Model(ids, keras.layers.Dense(2)(h[:, 0]))
    stages = model_stages.split_model(model, 2)
    x = tf.constant(np.random.default_rng(0).integers(0, 7, (ROWS, 3)))
    _, y, w = batch()
    step = tf.function(lambda x, y, w: executor.run(
        schedules.schedule(name, 2, 3), stages, DEVICES[:2], x, y, loss_fn,
        sample_weight=w))(x, y, w)
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True), w)
    grads = tape.gradient(loss, executor.variables(stages))
    self.assertIsInstance(step.gradients[0], tf.IndexedSlices)
    np.testing.assert_allclose(step.loss, loss, rtol=1e-5)
    for got, want in zip(step.gradients, grads):
      np.testing.assert_allclose(tf.convert_to_tensor(got),
                                 tf.convert_to_tensor(want), rtol=1e-5,
                                 atol=1e-7)

  @parameterized.expand([("gpipe",), ("1f1b",), ("zb_h1",)])
  def test_eager_frees_activations_as_the_schedule_says(self, name):
    # Stage 0's outputs stay alive from its F to its last backward: at most
    # the schedule's peak on device 0 (GPipe M, 1F1B and ZB-H1 S).
    stages = mlp(2)
    x, y, w = batch(16)
    build(stages, x)
    alive, peak = [], []
    forward = stages[0].fn

    def recorded(layers, tensors):
      out = forward(layers, tensors)
      alive.append(weakref.ref(out["h0"]))
      peak.append(sum(ref() is not None for ref in alive))
      return out

    stages[0].fn = recorded
    plan = schedules.schedule(name, 2, 8)
    executor.run(plan, stages, DEVICES[:2], x, y, loss_fn, sample_weight=w)
    self.assertEqual(max(peak), schedules.peak_in_flight(plan)[0])

  def test_no_targets(self):
    stages = mlp(2)
    x, _, _ = batch()
    build(stages, x)
    norm = lambda y, y_pred, w: tf.reduce_mean(y_pred ** 2)
    step = executor.run(schedules.schedule("1f1b", 2, 3), stages, DEVICES[:2],
                        x, None, norm)
    with tf.GradientTape() as tape:
      loss = norm(None, stages[1](stages[0]({"input:0": x}, True), True)[
          "output:0"], None)
    grads = tape.gradient(loss, executor.variables(stages))
    np.testing.assert_allclose(step.loss, loss, rtol=1e-5)
    for got, want in zip(step.gradients, grads):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

  @pytest.mark.slow
  def test_fewer_rows_than_microbatches(self):
    self.assert_step_equals_one_device(mlp, "1f1b", 2, 1, 4, rows=3)
    self.assert_step_equals_one_device(mlp, "zb_h1", 2, 1, 4, rows=3,
                                       compiled=True)

  @parameterized.expand([(name, name, v) for name, v in SCHEDULES])
  def test_graph_places_and_orders_each_device(self, _, name, v):
    s, m = 4, 3
    stages = skip(s * v)
    x, y, w = batch()
    build(stages, x)
    plan = schedules.schedule(name, s, m, v)
    graph = tf.function(
        lambda x, y, w: executor.run(plan, stages, DEVICES[:s], x, y, loss_fn,
                                     sample_weight=w).loss
    ).get_concrete_function(x, y, w).graph
    by_action, pending = {}, []
    for op in graph.get_operations():  # In the order they were made.
      scope = op.name.split("/")[0]
      if op.type in ("Placeholder", "ReadVariableOp"):
        continue  # A variable's handle or read: where the variable lives.
      if scope == "gradient_tape" or _action(scope):
        pending.append(op)
      if _action(scope) and op.name == f"{scope}/done":
        by_action[_action(scope)], pending = pending, []
      elif op.type == "MatMul" and not pending:
        self.fail(f"{op.name} is in no action")
    for d, actions in enumerate(plan):
      for action in actions:
        self.assertTrue(by_action[action], action)
        for op in by_action[action]:  # Its forward or backward MatMul too.
          self.assertIn(f"CPU:{d}", op.device, op.name)
      for before, after in zip(actions, actions[1:]):
        self.assertTrue(_reaches(by_action[after], set(by_action[before])),
                        f"{after} does not wait for {before} on device {d}")

  def test_bad_devices_say_what_is_expected(self):
    stages = mlp(2)
    x, y, w = batch()
    build(stages, x)
    with self.assertRaisesRegex(ValueError, r"device per pipeline device \(2\)"):
      executor.run(schedules.schedule("1f1b", 2, 2), stages, DEVICES[:3], x, y,
                   loss_fn)
    with self.assertRaisesRegex(ValueError, "for 4 stages; received 2"):
      executor.run(schedules.schedule("interleaved_1f1b", 2, 2, 2), stages,
                   DEVICES[:2], x, y, loss_fn)

  def test_bad_stages_and_losses_say_what_is_expected(self):
    stages = mlp(2)
    x, y, _ = batch()
    build(stages, x)
    plan = schedules.schedule("1f1b", 2, 2)
    per_row = lambda y, y_pred, w: tf.reduce_mean((y - y_pred) ** 2, axis=1)
    with self.assertRaisesRegex(ValueError, r"scalar.*shape \(5,\)"):
      executor.run(plan, stages, DEVICES[:2], x, y, per_row)
    stages[1].inputs = ("h7",)
    with self.assertRaisesRegex(ValueError, "Stage 1 reads 'h7'"):
      executor.run(plan, stages, DEVICES[:2], x, y, loss_fn)
    stages[1].inputs, stages[1].outputs = ("h0",), ("h1",)
    stages[1].fn = lambda ls, t: {"h1": ls[0](t["h0"])}
    with self.assertRaisesRegex(ValueError, r"'output:0'.*returned \['h1'\]"):
      executor.run(plan, stages, DEVICES[:2], x, y, loss_fn)


def _action(scope):
  """The action whose ops the executor makes in name scope `scope`, or None."""
  kind, _, micro = scope.partition("_")
  if kind[:1] in ("F", "B", "W") and kind[1:].isdigit() and micro.isdigit():
    return schedules.Action(kind[0], int(kind[1:]), int(micro))
  return None


def _reaches(ops, targets):
  """Whether some op of `targets` is an input (data or control, at any
  depth) of one of `ops`."""
  seen, pending = set(), list(ops)
  while pending:
    op = pending.pop()
    for dep in [t.op for t in op.inputs] + list(op.control_inputs):
      if dep in targets:
        return True
      if dep not in seen:
        seen.add(dep)
        pending.append(dep)
  return False


if __name__ == "__main__":
  unittest.main()
