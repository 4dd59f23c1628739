"""Each stage's variables on its stage's devices, moved there once.

A Keras model makes its weights when it is built, on each replica's first
device, before anyone knows where the model is cut. When a pipeline first
sees the model (`pipeline.placed_stages.stages_of`), every variable of stage s
is made again on each replica's stage-s device with the value it holds, and
the Keras variable is given it: layers, the optimizer's lists and saves hold
the Keras variable, so they read the new one. An optimizer built before
gets its slots moved with their weights.

>>> import keras
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
>>> with strategy.scope():
...   dense = keras.layers.Dense(2)
...   dense.build((None, 3))
>>> move(strategy, dense.kernel, logical_device=1)
>>> [c.device[-5:] for c in dense.kernel.value.values]
['CPU:1', 'CPU:3']
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.keras import _internal as ki


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
      for v in (variable, *slots.get(variable.path, ())):
        move(strategy, v, logical_device)
  if slots:
    ki.reindex_weights(optimizer)


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


def move(strategy, variable, logical_device):
  """Makes the Keras `variable` (of `strategy`) anew on each replica's
  `logical_device`, with its value; nothing to do where it is already."""
  held = ki.backend_variable(variable)
  if not isinstance(held, tfi.values.DistributedVariable):
    raise ValueError(
        f"A pipeline places each stage's weights on its devices, but "
        f"{variable.path!r} was created outside `strategy.scope()`. Build "
        f"the model inside it: `with strategy.scope(): model = ...`.")
  devices = strategy.extended.logical_devices
  wanted = tuple(group[logical_device] for group in devices.groups)
  if tuple(c.device for c in held.values) == wanted:
    return
  with strategy.scope(), devices.for_variables(logical_device):
    moved = tf.Variable(
        initial_value=tf.identity(held.read_value()), trainable=held.trainable,
        name=held.name.split(":")[0], dtype=held.dtype,
        aggregation=held.aggregation, synchronization=held.synchronization)
  ki.set_backend_variable(variable, moved)
