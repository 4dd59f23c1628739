"""Optimizer state held once across the replicas, a slice on each (ZeRO 1/2).

With `ReplicatorStrategy(shard_optimizer_state=True)`, every optimizer slot
(SGD momentum, Adam's m and v, ...) is one `ShardedSlot`: the slot flattened,
padded to a multiple of N and cut into N equal contiguous shards, shard r on
replica device r. A 784x512 kernel's momentum is spread over all replicas
rather than landing whole on one, so optimizer memory and optimizer math per
device both drop to about 1/N. A step then runs, per model weight:

1. reduce-scatter: shard r of the summed gradient is added up on device r
   from shard r of each replica's gradient (each replica cuts its own);
2. the update: device r runs the optimizer's own math on shard r of the
   weight and of the gradient, against shard r of the slots;
3. all-gather: every replica's copy of the weight (a `MirroredVariable`
   component) is overwritten with the concatenated new shards.

This module holds the strategy side: the layout, the slot variable and the
step's three parts (`ShardExchange.reduce_scatter`, `update_shards`,
`ShardExchange.all_gather`).
`replicator_strategy.keras.sharded_optimizer` connects Keras optimizers to it.

Design after ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054), stages 1 and
2, within one process for now.

>>> strategy = ReplicatorStrategy(shard_optimizer_state=True)
>>> with strategy.scope():
...   model = build_model()
...   model.compile(keras.optimizers.Adam(), "mse")
>>> [slot.value.shard_devices for slot in model.optimizer.variables[2:4]]
[('.../device:CPU:0', ..., '.../device:CPU:3'), ...]
"""

import contextlib
import dataclasses
import math
import threading

import numpy as np
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a tensor of `shape` is cut into `num_shards` equal flat shards."""
  shape: tuple
  num_shards: int

  @property
  def size(self):
    return math.prod(self.shape)

  @property
  def shard_size(self):
    return -(-self.size // self.num_shards)  # Rounded up; the last is padded.

  def shard(self, tensor, index):
    """Shard `index` of a full-shaped `tensor`, flat, zero-padded at the end."""
    start = min(index * self.shard_size, self.size)
    stop = min(start + self.shard_size, self.size)
    piece = tf.reshape(tensor, [-1])[start:stop]
    if stop - start < self.shard_size:
      piece = tf.pad(piece, [[0, self.shard_size - (stop - start)]])
    return piece

  def assemble(self, shards):
    """The full-shaped tensor from all `shards` (padding dropped)."""
    flat = tf.concat(list(shards), axis=0) if len(shards) > 1 else shards[0]
    return tf.reshape(flat[:self.size], self.shape)


class ShardedSlot(tfi.values.DistributedVariable):
  """An optimizer slot held once: component r is shard r, on device r.

  Inside the optimizer's update for replica r (an `UpdateContext(r)`), reads
  and assignments reach shard r, so the optimizer's own math runs unchanged
  on shards. In cross-replica context it reads as the full slot and accepts
  full-shaped assignments, so `numpy()`, Keras saving and checkpoints see the
  slot as one device would. Inside a replica outside an update (e.g. an
  EMA step) it would read as the replica's shard: not supported.
  """

  def __init__(self, strategy, values, aggregation, layout):
    self.layout = layout
    super().__init__(strategy, values, aggregation)

  @property
  def shape(self):
    return tf.TensorShape(self.layout.shape)

  def get_shape(self):
    return self.shape

  @property
  def shard_devices(self):
    return tuple(component.device for component in self.values)

  def _get_cross_replica(self):
    return self.layout.assemble([c.read_value() for c in self.values])

  def _get(self):
    """Shard r in the optimizer's update for replica r, else the whole slot."""
    shard = tfi.distribute_lib.get_update_replica_id()
    if shard is not None:
      return self.values[shard]
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.strategy is self.distribute_strategy:
      raise ValueError(
          f"The optimizer slot {self.name} is sharded over the replicas "
          f"(shard_optimizer_state=True): each replica holds 1/N of it, so "
          f"it cannot be read inside `strategy.run`. Read it outside "
          f"`strategy.run` (the whole slot), or create the strategy with "
          f"shard_optimizer_state=False.")
    return self._get_cross_replica()

  def _get_on_device_or_primary(self):
    return self._get()

  def value(self):
    return tf.convert_to_tensor(self._get())

  def __array__(self, dtype=None, copy=None):
    del copy  # A read is a copy already.
    return np.asarray(self.numpy(), dtype=dtype)

  def _as_graph_element(self):
    return None  # No single graph element holds the full value.

  def _update_cross_replica(self, update_fn, value, **kwargs):
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    updates = []
    for index, component in enumerate(self.values):
      with tf.device(component.device):
        updates.append(update_fn(component, self.layout.shard(value, index),
                                 **kwargs))
    return tf.group(updates)

  def _update_replica(self, update_fn, value, **kwargs):
    del update_fn, value, kwargs
    raise NotImplementedError(
        f"The sharded optimizer slot {self.name} can be updated only by its "
        f"optimizer's step, or in cross-replica context (outside "
        f"`strategy.run`). Received an update from inside a replica. Create "
        f"the strategy with shard_optimizer_state=False to update optimizer "
        f"slots from replicas (EMA, gradient accumulation).")

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._get_cross_replica()}

  def _restore_from_tensors(self, restored_tensors):
    return self.assign(restored_tensors["VARIABLE_VALUE"])


# Set while a Keras optimizer creates a slot under a sharding strategy.
_creating = threading.local()


@contextlib.contextmanager
def creating_slots():
  """Variables created inside are optimizer slots, to shard."""
  previous = getattr(_creating, "active", False)
  _creating.active = True
  try:
    yield
  finally:
    _creating.active = previous


def creating_slot():
  """Whether the variable being created is an optimizer slot to shard."""
  return getattr(_creating, "active", False)


def create_slot(strategy, devices, next_creator, **kwargs):
  """A `ShardedSlot` with one shard per device in `devices`."""
  kwargs.pop("colocate_with", None)  # Its shards go to every device.
  initial_value = kwargs["initial_value"]
  with tf.init_scope(), tf.device(devices[0]):
    full = tf.convert_to_tensor(
        initial_value() if callable(initial_value) else initial_value,
        dtype=kwargs.get("dtype"))
  layout = Layout(tuple(full.shape.as_list()), len(devices))
  kwargs.pop("shape", None)

  def create_shards(**kwargs):
    shards = []
    for index, device in enumerate(devices):
      with tf.device(device):
        kwargs["initial_value"] = layout.shard(full, index)
        if index:
          kwargs["name"] = "%s/shard_%d/" % (
              shards[0].name.split(":")[0], index)
        with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
          with tfi.record.stop_recording():
            shards.append(next_creator(**kwargs))
    return shards

  def sharded_slot(strategy, values, aggregation):
    return ShardedSlot(strategy, values, aggregation, layout)

  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_shards,
      {tf.VariableSynchronization.ON_WRITE: sharded_slot},
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)


# One step for one weight, in cross-replica context: reduce-scatter the
# gradient, update the shards, all-gather the weight.


class ShardExchange:
  """Moving shards between devices; `exchange_for` chooses one per topology.

  Between separate memories (GPUs) each device cuts its own gradient so
  that only shards move: shard r of the sum is added up on device r, and
  every device concatenates all the new shards.
  """

  def __init__(self, devices):
    self.devices = tuple(devices)

  def reduce_scatter(self, layout, gradients, summed):
    """Shard r of the summed gradient, on `devices[r]`, for every r.

    `gradients` holds each replica's gradient (on its device), or, if
    `summed`, each replica's copy of the already summed one.
    """
    gradients = [tf.convert_to_tensor(g) for g in gradients]  # IndexedSlices.
    if summed:
      return [_on(device, layout.shard, gradients[r], r)
              for r, device in enumerate(self.devices)]
    pieces = [[_on(source, layout.shard, g, r)
               for r in range(len(self.devices))]
              for source, g in zip(self.devices, gradients)]
    return [_on(device, tf.add_n, [p[r] for p in pieces])
            for r, device in enumerate(self.devices)]

  def all_gather(self, layout, weight, shards):
    """Every component of `weight` (one per device) set from all new shards."""
    return tf.group([
        _on(c.device, lambda c=c: c.assign(layout.assemble(shards),
                                           read_value=False))
        for c in weight.values])


class HostMemoryExchange(ShardExchange):
  """For devices that share host memory (logical CPUs of one process).

  A copy between them is a copy within one memory, so the fewest copies win:
  the gradients are added once, on the first device, and cut there; the new
  weight is assembled once and every component reads it.
  """

  def reduce_scatter(self, layout, gradients, summed):
    gradients = [tf.convert_to_tensor(g) for g in gradients]  # IndexedSlices.
    total = gradients[0] if summed else _on(self.devices[0], tf.add_n,
                                            gradients)
    return [_on(self.devices[0], layout.shard, total, r)
            for r in range(len(self.devices))]

  def all_gather(self, layout, weight, shards):
    full = _on(self.devices[0], layout.assemble, shards)
    return tf.group([
        _on(c.device, lambda c=c: c.assign(full, read_value=False))
        for c in weight.values])


def exchange_for(devices):
  """The `ShardExchange` for `devices`, this worker's, one per replica."""
  if all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices):
    return HostMemoryExchange(devices)
  return ShardExchange(devices)


def update_shards(layout, weight, devices, update_fn):
  """New shards of `weight`: `update_fn(r, shard_r)` in `UpdateContext(r)`.

  `update_fn` returns the new value of weight shard r; slots read inside it
  are shard r too.
  """
  new_shards = []
  for r, (device, component) in enumerate(zip(devices, weight.values)):
    with tf.device(device), tfi.UpdateContext(r), tf.name_scope(
        f"update_shard_{r}"):
      new_shards.append(update_fn(r, layout.shard(component.read_value(), r)))
  return new_shards


def _on(device, fn, *args):
  with tf.device(device):
    return fn(*args)
