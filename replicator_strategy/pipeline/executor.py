"""One replica's training step through a pipeline schedule, in TensorFlow.

`run` cuts the batch into micro-batches and runs a `Schedule`'s actions on
the stages: F records the stage's forward on a `tf.GradientTape` of its own
(the last stage's also the micro-batch's loss), B takes the gradient of the
stage's outputs to its inputs, given the gradients its consumers sent back
(and to its weights, unless the schedule splits the backward), W the
gradient to its weights. Each action's ops are placed on its stage's device
and, in a graph, wait for the device's previous action (control
dependencies), so each device runs its actions in the schedule's order.

Each micro-batch's loss is weighted by its share of the rows, so the loss
and the gradients, summed over the micro-batches, are the whole batch's:

>>> import keras
>>> from replicator_strategy.pipeline import schedules
>>> class Dense:  # A stage: one layer, from "input:0" to "output:0".
...   inputs, outputs = ("input:0",), ("output:0",)
...   def __init__(self, units):
...     self.layer = keras.layers.Dense(units)
...   def __call__(self, tensors, training=None):
...     return {"output:0": self.layer(tensors["input:0"])}
...   @property
...   def trainable_variables(self):
...     return self.layer.trainable_variables
>>> stage = Dense(1)
>>> x, y = tf.random.normal((5, 3)), tf.zeros((5, 1))
>>> mse = lambda y, y_pred, sample_weight: tf.reduce_mean((y - y_pred) ** 2)
>>> step = run(schedules.schedule("1f1b", 1, microbatches=2), [stage],
...            ["/cpu:0"], x, y, mse)
>>> bool(abs(step.loss - mse(y, stage.layer(x), None)) < 1e-6)
True

The loss function must average over the micro-batch's rows (as Keras's
losses do by default). Losses beyond it come through `extra_loss`: a
stage's weights' own (regularization), once a step on the stage's device,
and what its layers add on each micro-batch (activity regularization,
`add_loss`), weighted by the micro-batch's share as its loss is.
"""

import contextlib
import typing

import tensorflow as tf

from replicator_strategy.pipeline import schedules
from replicator_strategy.pipeline import stages as stages_lib


class Step(typing.NamedTuple):
  """What `run` returns (a nest, so a `tf.function` may return it): the
  batch's `loss`, the `gradients` of `variables(stages)` (None where the loss
  does not depend on one; multiplied by `scale_loss` if given), the model's
  `outputs` (one tensor, or a list for several outputs), rows in the batch's
  order, and `extra`, the part of `loss` that `extra_loss` gave (0 without)."""
  loss: tf.Tensor
  gradients: list
  outputs: object
  extra: tf.Tensor


def variables(stages):
  """Every stage's trainable variables, stage by stage: `Step.gradients`'s."""
  return [v for stage in stages for v in stage.trainable_variables]


def run(plan, stages, stage_devices, x, y, loss_fn, sample_weight=None,
        training=True, extra_loss=None, scale_loss=None, forward_context=None):
  """Runs one replica's step through `plan` (a `schedules.Schedule`).

  Args:
    plan: the schedule, for `len(stages)` stages.
    stages: the `Stage`s, in the model's order.
    stage_devices: a device per pipeline device (`len(plan)`), or per stage.
    x, y, sample_weight: the batch (nests of tensors; `x`'s flat i-th tensor
      is the stages' "input:i", or `x` maps those names to tensors, as
      `stages.model_inputs` gives them). Cut into `plan.microbatches` micro-batches
      of `N // M` or `N // M + 1` rows, the larger first.
    loss_fn: `(y, y_pred, sample_weight) -> scalar`, the micro-batch's mean
      loss; `y_pred` is the tensor "output:0", or the list of "output:i".
    training: passed to each stage.
    extra_loss: None, or `(stage, added) -> scalar or None`, a stage's loss
      beyond `loss_fn`'s: called once a step with `added=None` (a loss of
      the stage's weights alone, its regularization), and on each micro-batch
      whose forward added losses (`Stage` returns their sum as
      `stages.ADDED_LOSS`), with that sum weighted by the micro-batch's
      share of the rows. Each value is added to the loss, and its gradient
      to the stage's.
    scale_loss: None, or `loss -> loss`, applied to every loss before its
      gradient is taken (a loss scale); `Step.loss` stays unscaled.
    forward_context: None, or `(stage, first, rows) -> context manager`,
      entered around stage `stage`'s forward on the micro-batch of `rows`
      rows from row `first` of the batch (int32 scalars): what its random
      layers draw, for one.

  Returns:
    A `Step`: loss and gradients equal to one device's on the whole batch.
  """
  schedules.check(plan)
  devices = _stage_devices(plan, stages, stage_devices)
  sources = _sources(stages)
  step = _Run(plan, stages, devices, sources, training, extra_loss,
              scale_loss or (lambda loss: loss),
              forward_context or (lambda *_: contextlib.nullcontext()))
  step.split_batch(x, y, sample_weight)
  for action in schedules.timeline(plan).order():
    device = plan.device_of(action.stage)
    with tf.device(devices[action.stage]), tf.name_scope(
        f"{action.kind}{action.stage}_{action.micro}"
    ), tf.control_dependencies(step.previous[device]):
      produced = getattr(step, action.kind)(action.stage, action.micro,
                                            loss_fn)
      if not tf.executing_eagerly():
        step.previous[device] = [
            tf.group(*tf.nest.flatten(produced, expand_composites=True),
                     name="done")]
  for j in range(len(stages)):
    with tf.device(devices[j]), tf.name_scope(f"R{j}"), (
        tf.control_dependencies(step.previous[plan.device_of(j)])):
      step.R(j)
  return step.result()


class _Run:
  """The state of one step: the micro-batches, each (stage, micro-batch)'s
  tape, inputs and outputs, the gradients sent back, the sums."""

  def __init__(self, plan, stages, devices, sources, training, extra_loss,
               scale_loss, forward_context):
    self.plan, self.stages, self.devices = plan, stages, devices
    self.sources, self.training = sources, training
    self.extra_loss, self.scale_loss = extra_loss, scale_loss
    self.forward_context = forward_context
    self.extras = []  # What `extra_loss` added to the loss.
    self.previous = [[] for _ in plan]
    self.tapes, self.feeds, self.targets, self.values = {}, {}, {}, {}
    self.sent = {}  # (producer, name, micro) -> gradients from consumers.
    self.losses, self.outputs = [], []
    self.sums = {}  # Stage -> its weights' gradients (built by F).

  def split_batch(self, x, y, sample_weight):
    """Cuts x (on its first consumer's device), y and the weights (on the
    last stage's) into micro-batches."""
    named = x if isinstance(x, dict) and all(
        str(k).startswith("input:") for k in x) else {
            f"input:{i}": t for i, t in enumerate(tf.nest.flatten(x))}
    m_count = self.plan.microbatches
    rows = tf.shape(next(iter(named.values())))[0]
    sizes = rows // m_count + tf.cast(tf.range(m_count) < rows % m_count,
                                      rows.dtype)
    cut = lambda t: tf.split(t, sizes, num=m_count)
    self.inputs = {}
    for name, tensor in named.items():
      users = [j for j, s in enumerate(self.stages) if name in s.inputs]
      with tf.device(self.devices[users[0] if users else 0]):
        self.inputs[name] = cut(tensor)
    cut_nest = lambda nest: [None] * m_count if nest is None else [
        tf.nest.pack_sequence_as(nest, parts)
        for parts in zip(*[cut(t) for t in tf.nest.flatten(nest)])]
    with tf.device(self.devices[-1]):
      self.y, self.weights = cut_nest(y), cut_nest(sample_weight)
      self.shares = [tf.cast(sizes[m], tf.float64) / tf.cast(rows, tf.float64)
                     for m in range(m_count)]
    self.sizes = sizes
    self.firsts = tf.cumsum(sizes, exclusive=True)

  def F(self, j, m, loss_fn):  # noqa: N802 (the action's name)
    """The forward of stage j on micro-batch m, on a tape kept for B (and W)."""
    stage = self.stages[j]
    feeds = {}
    for name in stage.inputs:
      producer = self.sources[j][name]
      value = (self.inputs[name][m] if producer is None
               else self.values[producer, name, m])
      feeds[name] = tf.identity(value)  # Moved to this stage's device.
    tape = tf.GradientTape(persistent=self.plan.split_backward)
    with tape, self.forward_context(j, self.firsts[m], self.sizes[m]):
      tape.watch([feeds[n] for n in self._differentiable(j, feeds)])
      out = dict(stage(feeds, training=self.training))
      added = self._added(j, m, out.pop(stages_lib.ADDED_LOSS, None))
      if j == len(self.stages) - 1:
        y_pred = _model_outputs(out)
        loss = _scalar(loss_fn(self.y[m], y_pred, self.weights[m]))
        loss = tf.math.multiply_no_nan(loss, tf.cast(self.shares[m], loss.dtype))
        if added is not None:
          loss += tf.cast(added, loss.dtype)
        self.losses.append(loss)
        self.outputs.append(tf.nest.flatten(y_pred))
        out["loss:"] = self.scale_loss(loss)
      elif added is not None:
        self.losses.append(added)
        out["loss:"] = self.scale_loss(added)
    self.tapes[j, m], self.feeds[j, m] = tape, feeds
    for name, value in out.items():
      self.values[j, name, m] = value
    return list(out.values())

  def B(self, j, m, loss_fn):  # noqa: N802
    """The gradient of stage j's outputs on micro-batch m to its inputs, sent
    to their producers; to its weights too unless the backward is split."""
    del loss_fn
    targets, grads = self.targets[j, m] = self._targets(j, m)
    feeds = self.feeds[j, m]
    names = [n for n in self._differentiable(j, feeds)
             if self.sources[j][n] is not None]
    weights = [] if self.plan.split_backward else list(
        self.stages[j].trainable_variables)
    if not targets or not names + weights:
      return []
    found = self.tapes[j, m].gradient(
        targets, [feeds[n] for n in names] + weights, output_gradients=grads)
    for name, grad in zip(names, found):
      if grad is not None:
        self.sent.setdefault((self.sources[j][name], name, m), []).append(grad)
    if not self.plan.split_backward:
      self._finish(j, m, found[len(names):])
    return [g for g in found if g is not None]

  def W(self, j, m, loss_fn):  # noqa: N802
    """The gradient of stage j's outputs on micro-batch m to its weights."""
    del loss_fn
    targets, grads = self.targets[j, m]
    if not targets:
      return []
    found = self.tapes[j, m].gradient(
        targets, list(self.stages[j].trainable_variables),
        output_gradients=grads)
    self._finish(j, m, found)
    return [g for g in found if g is not None]

  def R(self, j):  # noqa: N802
    """Stage j's `extra_loss` of its weights alone, once a step; its
    gradient added to the stage's sums."""
    if self.extra_loss is None:
      return
    weights = list(self.stages[j].trainable_variables)
    with tf.GradientTape() as tape:
      loss = self.extra_loss(self.stages[j], None)
      if loss is None:
        return
      self.extras.append(loss)
      self.losses.append(loss)
      scaled = self.scale_loss(loss)
    self._accumulate(j, tape.gradient(scaled, weights))

  def result(self):
    with tf.device(self.devices[-1]):
      loss = tf.add_n(self.losses)
      extra = (tf.add_n([tf.cast(e, loss.dtype) for e in self.extras])
               if self.extras else tf.zeros((), loss.dtype))
      outputs = [tf.concat(parts, 0) for parts in zip(*self.outputs)]
    gradients = []
    for j, stage in enumerate(self.stages):
      gradients += self.sums.get(j, [None] * len(stage.trainable_variables))
    return Step(loss, gradients,
                outputs[0] if len(outputs) == 1 else outputs, extra)

  def _added(self, j, m, added):
    """The `extra_loss` of what stage j's layers added on micro-batch m,
    weighted by its share of the rows, or None."""
    if added is None or self.extra_loss is None:
      return None
    added = tf.math.multiply_no_nan(
        added, tf.cast(self.shares[m], added.dtype))
    added = self.extra_loss(self.stages[j], added)
    if added is not None:
      self.extras.append(added)
    return added

  def _differentiable(self, j, feeds):
    return [n for n in self.stages[j].inputs if feeds[n].dtype.is_floating]

  def _targets(self, j, m):
    """Stage j's outputs on micro-batch m that gradients came back to, and
    those gradients (summed over the consumers, on stage j's device)."""
    if j == len(self.stages) - 1:
      return [self.values[j, "loss:", m]], None
    targets, grads = [], []
    if (j, "loss:", m) in self.values:  # What its layers added.
      targets.append(self.values[j, "loss:", m])
      grads.append(tf.ones_like(targets[0]))
    for name in self.stages[j].outputs:
      sent = self.sent.pop((j, name, m), None)
      if sent:
        targets.append(self.values[j, name, m])
        grads.append(tf.add_n(sent) if len(sent) > 1 else sent[0])
    return targets, grads

  def _finish(self, j, m, found):
    """Adds micro-batch m's weight gradients of stage j to the sums; drops
    its tape and outputs (every consumer ran its forward before this)."""
    del self.tapes[j, m], self.feeds[j, m], self.targets[j, m]
    for name in (*self.stages[j].outputs, "loss:"):
      self.values.pop((j, name, m), None)
    self._accumulate(j, found)

  def _accumulate(self, j, found):
    """Adds weight gradients `found` of stage j to its sums."""
    sums = self.sums.setdefault(
        j, [None] * len(self.stages[j].trainable_variables))
    for i, grad in enumerate(found):
      if grad is not None:
        sums[i] = grad if sums[i] is None else _add(sums[i], grad)


def _add(total, grad):
  if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                            tf.concat([total.indices, grad.indices], 0),
                            total.dense_shape)
  return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def _scalar(loss):
  """The micro-batch's loss; Keras's losses return an empty one unreduced."""
  loss = tf.convert_to_tensor(loss)
  if loss.shape.rank == 0:
    return loss
  if loss.shape.as_list() == [0]:
    return tf.zeros((), loss.dtype)
  raise ValueError(
      f"Expected `loss_fn` to return a scalar, the mean loss over the "
      f"micro-batch's rows. Received a tensor of shape {loss.shape}.")


def _model_outputs(out):
  """The last stage's "output:i" tensors: one tensor, or the list of them."""
  count = sum(1 for name in out if name.startswith("output:"))
  missing = [f"output:{i}" for i in range(count) if f"output:{i}" not in out]
  if not count or missing:
    raise ValueError(
        f"The last stage must return the model's outputs 'output:0', ... ; "
        f"it returned {sorted(out)}.")
  outputs = [out[f"output:{i}"] for i in range(count)]
  return outputs[0] if count == 1 else outputs


def _stage_devices(plan, stages, stage_devices):
  stage_devices = list(stage_devices)
  if len(stages) != plan.stages:
    raise ValueError(
        f"Schedule {plan.name!r} is for {plan.stages} stages; received "
        f"{len(stages)} stages. Pass schedule(name, devices, microbatches, "
        f"virtual) with devices * virtual == len(stages).")
  if len(stage_devices) == len(stages):
    return stage_devices
  if len(stage_devices) == len(plan):
    return [stage_devices[plan.device_of(j)] for j in range(len(stages))]
  raise ValueError(
      f"Expected a device per pipeline device ({len(plan)}) or per stage "
      f"({len(stages)}). Received {len(stage_devices)}: {stage_devices}.")


def _sources(stages):
  """Per stage, each input's producer: the latest earlier stage that outputs
  it, or None for the model's inputs "input:i"."""
  sources = []
  for j, stage in enumerate(stages):
    found = {}
    for name in stage.inputs:
      producers = [k for k in range(j) if name in stages[k].outputs]
      if not producers and not name.startswith("input:"):
        raise ValueError(
            f"Stage {j} reads {name!r}, which no earlier stage outputs and "
            f"is not a model input ('input:i').")
      found[name] = producers[-1] if producers else None
    sources.append(found)
  return sources
