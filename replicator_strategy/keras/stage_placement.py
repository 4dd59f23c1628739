"""A Keras model's pipeline stages, each stage's variables on its devices.

A Keras model makes its weights when it is built, on each replica's first
device, before anyone knows where the model is cut. The first time a
pipeline sees the model (its first `fit`, `evaluate` or `predict`, or
`strategy.pipeline_stages(model)`), `stages_of` cuts it into the strategy's
stages (`model_stages.split_model`) and makes every variable of stage s
again on each replica's stage-s device, with the value it holds, and gives
the Keras variable the new one (a weight the layout map splits, in parts
over the stage's model-axis devices): layers, the optimizer's lists and saves hold
the Keras variable, so they read the new one. The optimizer that `fit`
builds makes each slot on its weight's devices (the stages are placed just
before); one built before gets its slots moved with their weights. Later
calls get the same stages.

>>> import keras
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
...                             keras.layers.Dense(2)])
>>> stages = stages_of(strategy, model)
>>> [c.device[-5:] for c in stages[1].variables[0].value.values]
['CPU:1', 'CPU:3']
"""

import contextlib
import functools
import threading
import weakref

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import options as options_lib
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import model_stages
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.sharding import creation
from replicator_strategy.sharding import layout as layout_lib

# A model keeps its cut, (a weak reference to the strategy, its stages),
# itself (`ki.keep_pipeline_stages`): the stages refer to the model, so a
# table keyed by the model would keep it alive.


def pipeline_of(strategy):
  """`strategy`'s `Pipeline` when it has one, else None."""
  options = options_lib.of(strategy)
  return options.pipeline if options is not None else None


def stages_of(strategy, model):
  """`model`'s stages under `strategy`'s pipeline, each stage's variables
  (and the slots of an optimizer already built) on its devices."""
  cut = ki.pipeline_stages_kept(model)
  if cut is not None and cut[0]() is strategy:
    return cut[1]
  pipeline = pipeline_of(strategy)
  if pipeline is None:
    raise ValueError(
        f"Expected a ReplicatorStrategy with a pipeline, such as "
        f"ReplicatorStrategy(pipeline=rs.Pipeline(stages=2)). Received: "
        f"{strategy!r}.")
  stages = model_stages.split_model(model, pipeline.cuts, pipeline.split)
  place(strategy, stages, getattr(model, "optimizer", None))
  ki.keep_pipeline_stages(model, (weakref.ref(strategy), stages))
  return stages


# The model whose `_symbolic_build` runs now (each replica's thread, or
# the caller's): its optimizer's build places its stages first.
_building = threading.local()


def stages_placed_before_slots(symbolic_build):
  """`Model._symbolic_build` (fit, evaluate and predict build the model and
  its optimizer there): under a pipeline, the model marked for
  `placed_before_slots`."""

  @functools.wraps(symbolic_build)
  def wrapper(self, *args, **kwargs):
    if pipeline_of(self.distribute_strategy) is None:
      return symbolic_build(self, *args, **kwargs)
    previous = getattr(_building, "model", None)
    _building.model = self
    try:
      return symbolic_build(self, *args, **kwargs)
    finally:
      _building.model = previous

  return wrapper


def placed_before_slots(build):
  """`Optimizer.build`, for the model `stages_placed_before_slots` marked:
  its stages placed first, so that each slot is made on its weight's stage
  devices (`colocate_vars_with` the weight), not moved there after."""

  @functools.wraps(build)
  def wrapper(self, *args, **kwargs):
    model = getattr(_building, "model", None)
    if model is not None and not self.built:
      stages_of(model.distribute_strategy, model)
    return build(self, *args, **kwargs)

  return wrapper


def placed(strategy, model):
  """`model`'s stages as `stages_of` cut and placed them: in a step traced
  in a replica, where no variable may be made."""
  cut = ki.pipeline_stages_kept(model)
  if cut is None or cut[0]() is not strategy:
    raise ValueError(
        f"The pipeline has not placed model {model.name!r}'s stages on their "
        f"devices yet, which a traced step cannot do. Call "
        f"strategy.pipeline_stages(model) once, eagerly, before the step "
        f"(Keras's fit, evaluate and predict do).")
  return cut[1]


def stage_logical_device(strategy, stage_index):
  """The logical device (of each replica) that piece `stage_index` of the
  model runs on: its stage's first (pieces beyond the stage count, an
  interleaved schedule's, wrap around the devices)."""
  devices = strategy.extended.logical_devices
  return (stage_index % devices.stages) * devices.per_stage


def place(strategy, stages, optimizer=None):
  """Moves each of `stages`' variables onto its stage's device of every
  replica, with the slots `optimizer` already holds for them."""
  slots = slots_by_weight(optimizer)
  for stage in stages:
    logical_device = stage_logical_device(strategy, stage.index)
    for variable in stage.variables:
      move(strategy, variable, logical_device)
      for slot in slots.get(variable.path, ()):
        move(strategy, slot, logical_device, weight=variable)
  # Built with slots or none (plain SGD); a LossScaleOptimizer's inner one too.
  for built in (optimizer, getattr(optimizer, "inner_optimizer", None)):
    if built is not None and built.built:
      ki.reindex_weights(built)


def slots_by_weight(optimizer):
  """Weight path -> the slots a built Keras `optimizer` holds for it.

  Keras names a weight's slot `<its path, "/" as "_">_<slot name>`, on its
  weight's devices, and makes none before it is built."""
  if optimizer is None or not optimizer.built:
    return {}
  weights = {w.path.replace("/", "_") + "_": w.path
             for w in ki.optimizer_weights(optimizer)}
  found = {}
  for slot in optimizer.variables:
    prefix = max((p for p in weights if slot.name.startswith(p)), key=len,
                 default=None)
    if prefix is not None:
      found.setdefault(weights[prefix], []).append(slot)
  return found


def move(strategy, variable, logical_device, weight=None):
  """Makes the Keras `variable` (of `strategy`) anew on each replica's
  `logical_device`, with its value; nothing to do where it is already.
  `weight`: the Keras weight (moved already) that `variable` is an
  optimizer slot of."""
  held = ki.backend_variable(variable)
  if not isinstance(held, tfi.values.DistributedVariable):
    raise ValueError(
        f"A pipeline places each stage's weights on its devices, but "
        f"{variable.path!r} was created outside `strategy.scope()`. Build "
        f"the model inside it: `with strategy.scope(): model = ...`.")
  devices = strategy.extended.logical_devices
  split = isinstance(held, split_variables.SplitVariable)
  with devices.for_variables(logical_device):
    groups = (split_variables.stage_groups(devices) if split else
              [(group[logical_device],) for group in devices.groups])
  if tuple(c.device for c in held.values) == tuple(
      d for group in groups for d in group):
    return
  # Sharded over the replicas too (ZeRO-3), it keeps its cut of each part.
  sharded = getattr(held, "layout", None) if split else None
  if weight is not None and (sharded is not None or not split):
    creating = _beside(strategy, weight, held)
  elif split:  # A split weight (or slot) is made split again, along its axis.
    creating = layouts.creating(variable.path, held.whole_shape,
                                (held.axis, sharded))
  else:
    creating = contextlib.nullcontext()
  with strategy.scope(), devices.for_variables(logical_device), creating:
    moved = tf.Variable(
        initial_value=tf.identity(held.read_value()), trainable=held.trainable,
        name=held.name.split(":")[0], dtype=held.dtype,
        aggregation=held.aggregation, synchronization=held.synchronization)
  ki.set_backend_variable(variable, moved)


@contextlib.contextmanager
def _beside(strategy, weight, held):
  """Variables made inside are made as the optimizer makes a slot of
  `weight` like `held`: beside it, sliced over the replicas where `held`
  was (sharded optimizer state), sharded as it is where it is sharded."""
  flat = isinstance(getattr(held, "layout", None), layout_lib.FlatLayout)
  reads_whole = getattr(held, "replica_reads", None) == "whole"
  with strategy.extended.colocate_vars_with(ki.backend_variable(weight)):
    with creation.requesting(flat=flat, reads_whole=reads_whole):
      yield
