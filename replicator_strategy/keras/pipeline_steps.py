"""Keras's `fit` under a pipeline: each replica's step through the schedule.

Under `ReplicatorStrategy(pipeline=rs.Pipeline(...))` the model is cut into
stages and each stage's variables moved to its devices before the first
step is traced (`stages_placed_first`, around `make_train_function` and its
siblings: eagerly, once). Each replica's train step (`pipelined_train_step`)
then cuts its batch into the pipeline's micro-batches and runs the
schedule's forwards and backwards on the stages' devices
(`pipeline.executor.run`); the gradients, summed over the micro-batches,
are applied once, as Keras's step applies the whole batch's, and the
metrics see the model's outputs for the whole batch. One step is one
device's step on the same batch.

The loss must be a mean over the rows (Keras's default reduction); a model
with regularization losses (`model.losses`) is refused for now.
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import stage_placement
from replicator_strategy.pipeline import schedules


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
    strategy = tf.distribute.get_strategy()
    pipeline = stage_placement.pipeline_of(strategy)
    if pipeline is None or tf.distribute.in_cross_replica_context():
      return train_step(self, data)
    return _train_step(self, strategy, pipeline, data)

  return wrapper


def _train_step(model, strategy, pipeline, data):
  # Local import: the executor imports nothing of Keras, but loads with it.
  from replicator_strategy.pipeline import executor  # pylint: disable=g-import-not-at-top
  stages = stage_placement.placed(strategy, model)
  if model.losses:
    raise NotImplementedError(
        f"A pipeline does not carry regularization losses (model.losses) "
        f"across its stages yet. Received: model {model.name!r} with "
        f"{len(model.losses)} of them. Remove the regularizers, or train "
        f"without `pipeline=`.")
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  local = tf.distribute.get_replica_context().local_index
  devices = [d[0] for d in
             strategy.extended.logical_devices.stage_devices(local)]
  plan = schedules.schedule(pipeline.schedule, pipeline.stages,
                            pipeline.microbatches, pipeline.virtual)

  def micro_loss(y, y_pred, sample_weight):
    return ki.compute_loss(model, x=None, y=y, y_pred=y_pred,
                           sample_weight=sample_weight, training=True)

  step = executor.run(plan, stages, devices, x, y, micro_loss,
                      sample_weight=sample_weight, training=True)
  rows = tf.shape(tf.nest.flatten(x)[0])[0]
  ki.loss_tracker(model).update_state(
      ki.loss.unscale_loss_for_distribution(step.loss), sample_weight=rows)
  model.optimizer.apply_gradients(
      zip(step.gradients, executor.variables(stages)))
  y_pred = stages[-1].graph.pack(tf.nest.flatten(step.outputs))
  return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
