"""Keras's `fit` under a pipeline: each replica's step through the schedule.

Under `ReplicatorStrategy(pipeline=rs.Pipeline(...))` the model is cut into
stages and each stage's variables moved to its devices before the first
step is traced (`stages_placed_first`, around `make_train_function` and its
siblings: eagerly, once). Each replica's train step (`pipelined_train_step`)
then cuts its batch into the pipeline's micro-batches and runs the
schedule's forwards and backwards on the stages' devices
(`pipeline.executor.run`); the gradients, summed over the micro-batches,
are applied once, as Keras's step applies the whole batch's, and the
metrics see the model's outputs for the whole batch. Random layers draw, on
each micro-batch, one device's values for its rows. One step is one
device's step on the same batch. `evaluate` and `predict` run Keras's own
steps, the model's call stage by stage, each on its device
(`forward_through_stages`, `stage_by_stage_call`).

The loss must be a mean over the rows (Keras's default reduction). A
model's regularization losses count as on one device: each stage's weights'
regularization once a step on its device, what its layers add (activity
regularization, `add_loss`) on each micro-batch, weighted by its share of
the rows. The optimizer's `scale_loss` (a `LossScaleOptimizer`'s scale)
multiplies every loss before its gradient is taken, as in Keras's step; the
optimizer unscales the summed gradients and skips a step that overflowed.
"""

import collections
import contextlib
import functools
import threading

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import random_layers
from replicator_strategy.keras import rematerialization
from replicator_strategy.keras import stage_placement
from replicator_strategy.pipeline import schedules
from replicator_strategy.pipeline import stages as stages_lib

# The model whose call runs stage by stage now, its stages and their
# devices; each replica runs in its own thread.
_forward = threading.local()


def stages_placed_first(make_function):
  """`Model.make_train_function` (and the test and predict ones): first, under
  a pipeline, the model cut and each stage's variables on its devices."""

  @functools.wraps(make_function)
  def wrapper(self, *args, **kwargs):
    strategy = self.distribute_strategy
    if stage_placement.pipeline_of(strategy) is not None:
      stage_placement.stages_of(strategy, self)
    return make_function(self, *args, **kwargs)

  return wrapper


def pipelined_train_step(train_step):
  """`Model.train_step`, in a replica of a pipeline: through its schedule."""

  @functools.wraps(train_step)
  def wrapper(self, data):
    here = _pipeline_replica()
    if here is None:
      return train_step(self, data)
    return _train_step(self, *here, data)

  return wrapper


def forward_through_stages(step):
  """`Model.test_step` or `predict_step`, in a replica of a pipeline: Keras's
  own, the model's call run stage by stage (`stage_by_stage_call`)."""

  @functools.wraps(step)
  def wrapper(self, data):
    here = _pipeline_replica()
    if here is None:
      return step(self, data)
    strategy = here[0]
    stages = stage_placement.placed(strategy, self)
    previous = getattr(_forward, "call", None)
    _forward.call = (self, stages, _stage_devices(strategy, stages))
    try:
      return step(self, data)
    finally:
      _forward.call = previous

  return wrapper


def stage_by_stage_call(layer_call):
  """`Layer.__call__`: the model `forward_through_stages` marked, run stage by
  stage, each stage's ops on its device of this replica."""

  @functools.wraps(layer_call)
  def wrapper(self, *args, **kwargs):
    marked = getattr(_forward, "call", None)
    if marked is None or marked[0] is not self:
      return layer_call(self, *args, **kwargs)
    _, stages, devices = marked
    _forward.call = None  # The stages' own layer calls are Keras's.
    try:
      tensors = stages_lib.model_inputs(stages, args[0])
      for stage, device in zip(stages, devices):
        with tf.device(device):
          tensors = stage(tensors, training=kwargs.get("training"))
      outputs = stages[-1].graph.outputs
      return stages[-1].graph.pack(
          [tensors[stages_lib.output_name(i)] for i in range(len(outputs))])
    finally:
      _forward.call = marked

  return wrapper


def _pipeline_replica():
  """(the strategy, its `Pipeline`) in a replica of a pipeline strategy,
  else None."""
  strategy = tf.distribute.get_strategy()
  pipeline = stage_placement.pipeline_of(strategy)
  if pipeline is None or tf.distribute.in_cross_replica_context():
    return None
  return strategy, pipeline


def _stage_devices(strategy, stages):
  """Each of `stages`' device in this replica: stage j on the pipeline's
  device j % S (an interleaved schedule's stages wrap around)."""
  local = tf.distribute.get_replica_context().local_index
  devices = [d[0] for d in
             strategy.extended.logical_devices.stage_devices(local)]
  return [devices[j % len(devices)] for j in range(len(stages))]


def _train_step(model, strategy, pipeline, data):
  # Local import: the executor imports nothing of Keras, but loads with it.
  from replicator_strategy.pipeline import executor  # pylint: disable=g-import-not-at-top
  stages = stage_placement.placed(strategy, model)
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  plan = schedules.schedule(pipeline.schedule, pipeline.stages,
                            pipeline.microbatches, pipeline.virtual)

  def micro_loss(y, y_pred, sample_weight):
    # model.losses, counted by `extra_loss` instead, count 0 here.
    with ki.losses_as(model, [tf.zeros((), keras.config.floatx())]):
      return ki.compute_loss(model, x=None, y=y, y_pred=y_pred,
                             sample_weight=sample_weight, training=True)

  # Each micro-batch's loss counts in the per-output loss logs as a batch
  # would: they are put back, and the whole batch's loss counted once below.
  logged = [v for m in ki.output_loss_trackers(model) for v in m.variables]
  before = [tf.identity(v.value) for v in logged]
  step = executor.run(plan, stages, _stage_devices(strategy, stages),
                      stages_lib.model_inputs(stages, x), y, micro_loss,
                      sample_weight=sample_weight, training=True,
                      extra_loss=_extra_loss,
                      scale_loss=model.optimizer.scale_loss,
                      forward_context=_drawing_as_one_device())
  model.optimizer.apply_gradients(
      zip(step.gradients, executor.variables(stages)))
  y_pred = stages[-1].graph.pack(tf.nest.flatten(step.outputs))
  for variable, value in zip(logged, before):
    variable.assign(value)
  # model.losses: what the step's `extra_loss` counted, before the update.
  with ki.losses_as(model, [tf.cast(step.extra, keras.config.floatx())]):
    loss = ki.compute_loss(model, x=x, y=y, y_pred=y_pred,
                           sample_weight=sample_weight, training=True)
  rows = tf.shape(tf.nest.flatten(x)[0])[0]
  ki.loss_tracker(model).update_state(
      ki.loss.unscale_loss_for_distribution(loss), sample_weight=rows)
  return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _drawing_as_one_device():
  """`executor.run`'s `forward_context`: a stage's random layers draw, on
  each micro-batch, one device's values for its rows: with the seeds the
  stage's first micro-batch drew (one device draws once a step), at the
  micro-batch's rows of the batch."""
  draws = collections.defaultdict(rematerialization.SharedDraws)

  @contextlib.contextmanager
  def drawing(stage, first, rows):
    with draws[stage].drawing(), random_layers.microbatch(first, rows):
      yield

  return drawing


def _extra_loss(stage, added):
  """A stage's part of `model.losses` (`executor.run`'s `extra_loss`): its
  weights' regularization (`added` None), or what its layers added on a
  micro-batch; its gradient scaled as the replica's share of the batch, as
  Keras's step scales `model.losses`."""
  if added is None:
    terms = [keras.ops.sum(v.regularizer(v))
             for v in stage.trainable_variables
             if getattr(v, "regularizer", None) is not None]
    if not terms:
      return None
    added = sum(terms[1:], terms[0])
  return ki.loss.scale_loss_for_distribution(added)
