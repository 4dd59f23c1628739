"""Optimizer state held once across the replicas, a slice on each (ZeRO 1/2).

With `ReplicatorStrategy(shard_optimizer_state=True)`, every optimizer slot
(SGD momentum, Adam's m and v, ...) is one `ShardedSlot`: the slot flattened,
padded to a multiple of N and cut into N equal contiguous shards, shard g on
the device of global replica g (across workers, each worker holds its
replicas' shards). A 784x512 kernel's momentum is spread over all replicas
rather than landing whole on one, so optimizer memory and optimizer math per
device both drop to about 1/N. A step then runs, per model weight:

1. reduce-scatter: replica r gets shard r of the summed gradient (the
   communicator's `reduce_scatter`, chosen for the topology);
2. the update: device r runs the optimizer's own math on shard r of the
   weight and of the gradient, against shard r of the slots;
3. all-gather: every replica's copy of the weight (a `MirroredVariable`
   component) is overwritten with the concatenated new shards.

This module holds the strategy side: the layout, the slot variable and the
step's three parts (`reduce_scatter`, `update_shards`, `all_gather`).
`replicator_strategy.keras.sharded_optimizer` connects Keras optimizers to it.

Design after ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054), stages 1 and
2.

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
from replicator_strategy import reduce_op as reduce_op_lib


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

  def padded_flat(self, tensor):
    """`tensor` flat, zero-padded to `num_shards` shards: what reduce-scatter cuts."""
    flat = tf.reshape(tensor, [-1])
    return tf.pad(flat, [[0, self.shard_size * self.num_shards - self.size]])

  def assemble(self, shards):
    """The full-shaped tensor from all `shards` (padding dropped)."""
    flat = tf.concat(list(shards), axis=0) if len(shards) > 1 else shards[0]
    return tf.reshape(flat[:self.size], self.shape)


class ShardedSlot(tfi.values.DistributedVariable):
  """An optimizer slot held once: component r is shard `first_shard + r`, on device r.

  Across workers, each worker holds the shards of its own replicas; the
  global replica g holds shard g.

  Inside the optimizer's update for replica r (an `UpdateContext(r)`), reads
  and assignments reach shard r, so the optimizer's own math runs unchanged
  on shards. In cross-replica context it reads as the full slot and accepts
  full-shaped assignments, so `numpy()`, Keras saving and checkpoints see the
  slot as one device would. Inside a replica outside an update (e.g. an
  EMA step) it would read as the replica's shard: not supported.
  """

  def __init__(self, strategy, values, aggregation, layout, first_shard):
    self.layout = layout
    self.first_shard = first_shard
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
    shards = [c.read_value() for c in self.values]
    if len(shards) < self.layout.num_shards:  # Others are on other workers.
      gathered = self.distribute_strategy.extended.communicator.all_gather(
          _per_replica(shards), axis=0)
      shards = [_parts(gathered)[0]]
    return self.layout.assemble(shards)

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
        updates.append(update_fn(
            component, self.layout.shard(value, self.first_shard + index),
            **kwargs))
    return tf.group(updates)

  def _update_replica(self, update_fn, value, **kwargs):
    shard = tfi.distribute_lib.get_update_replica_id()
    if shard is not None:  # The optimizer's step, run by each replica.
      return update_fn(self.values[shard], value, **kwargs)
    raise NotImplementedError(
        f"The sharded optimizer slot {self.name} can be updated only by its "
        f"optimizer's step, or in cross-replica context (outside "
        f"`strategy.run`). Received an update from inside a replica. Create "
        f"the strategy with shard_optimizer_state=False to update optimizer "
        f"slots from replicas.")

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
  """A `ShardedSlot` with one shard per device in `devices`, this worker's."""
  kwargs.pop("colocate_with", None)  # Its shards go to every device.
  communicator = strategy.extended.communicator
  initial_value = kwargs["initial_value"]
  with tf.init_scope(), tf.device(devices[0]):
    full = tf.convert_to_tensor(
        initial_value() if callable(initial_value) else initial_value,
        dtype=kwargs.get("dtype"))
  layout = Layout(tuple(full.shape.as_list()), communicator.num_replicas)
  first_shard = communicator.first_replica_id
  kwargs.pop("shape", None)

  def create_shards(**kwargs):
    shards = []
    for index, device in enumerate(devices):
      with tf.device(device):
        kwargs["initial_value"] = layout.shard(full, first_shard + index)
        if index:
          kwargs["name"] = "%s/shard_%d/" % (
              shards[0].name.split(":")[0], index)
        with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
          with tfi.record.stop_recording():
            shards.append(next_creator(**kwargs))
    return shards

  def sharded_slot(strategy, values, aggregation):
    return ShardedSlot(strategy, values, aggregation, layout, first_shard)

  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_shards,
      {tf.VariableSynchronization.ON_WRITE: sharded_slot},
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)


# One step for one weight, in cross-replica context: reduce-scatter the
# gradient, update the shards, all-gather the weight.


def reduce_scatter(communicator, layout, gradients, summed):
  """This worker's shards of the summed gradient, shard `first + r` on device r.

  `gradients` holds each local replica's gradient (on its device), or, if
  `summed`, each one's copy of the already summed gradient.
  """
  gradients = [tf.convert_to_tensor(g) for g in gradients]  # IndexedSlices.
  first = communicator.first_replica_id
  if summed:
    return [_on(device, layout.shard, g, first + r)
            for r, (device, g) in enumerate(zip(communicator.devices,
                                                gradients))]
  padded = [_on(device, layout.padded_flat, g)
            for device, g in zip(communicator.devices, gradients)]
  return list(_parts(communicator.reduce_scatter(
      reduce_op_lib.ReduceOp.SUM, _per_replica(padded), axis=0)))


def update_shards(layout, weight, first_shard, update_fn):
  """New shards of `weight`: `update_fn(r, shard)` in `UpdateContext(r)`.

  `update_fn` returns the new value of weight shard `first_shard + r`; slots
  read inside it are that shard too.
  """
  new_shards = []
  for r, component in enumerate(weight.values):
    with tf.device(component.device), tfi.UpdateContext(r), tf.name_scope(
        f"update_shard_{r}"):
      new_shards.append(update_fn(
          r, layout.shard(component.read_value(), first_shard + r)))
  return new_shards


def all_gather(communicator, layout, weight, new_shards):
  """Every component of `weight` set from every replica's new shard."""
  gathered = communicator.all_gather(_per_replica(new_shards), axis=0)
  return tf.group([
      _on(c.device, lambda c=c, g=g: c.assign(layout.assemble([g]),
                                               read_value=False))
      for c, g in zip(weight.values, _parts(gathered))])


def _per_replica(parts):
  return tfi.distribute_utils.regroup(list(parts), always_wrap=True)


def _parts(value):
  """This worker's parts of a distributed value (one alone, unwrapped)."""
  if isinstance(value, tf.distribute.DistributedValues):
    return value.values
  return (value,)


def _on(device, fn, *args):
  with tf.device(device):
    return fn(*args)
