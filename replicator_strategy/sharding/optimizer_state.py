"""Optimizer state held once across the replicas, a slice on each (ZeRO 1/2).

With `ReplicatorStrategy(shard_optimizer_state=True)`, every optimizer slot
(SGD momentum, Adam's m and v, ...) is one `ShardedVariable` (see
`variables`; it refuses reads inside a replica) with a `layout.FlatLayout`:
the slot flattened, padded to a multiple of N and cut into N equal contiguous
shards, shard g on the device of global replica g (across workers, each
worker holds its replicas' shards; with sync groups, N is a group's replicas
and each group holds every shard of its own state, shard g on its replica
g). A 784x512 kernel's momentum is spread
over all replicas rather than landing whole on one, so optimizer memory and
optimizer math per device both drop to about 1/N. A step then runs, per model weight:

1. reduce-scatter: replica r gets shard r of the summed gradient (the
   communicator's `reduce_scatter`, chosen for the topology; where the
   replicas share memory, the step's packed all-reduce, each replica
   slicing the one sum in place);
2. the update: device r runs the optimizer's own math on shard r of the
   weight and of the gradient, against shard r of the slots;
3. all-gather: every replica's copy of the weight (a `MirroredVariable`
   component) is overwritten with the concatenated new shards.

This module holds the strategy side of the step, written once (`step`) for
two `Exchange`s: `AllReplicas`, every local replica's shards at once from
cross-replica context (a `merge_call`), and `OneReplica`, a replica's own
shard from inside its control flow (a `tf.cond`), where the replicas cannot
merge and exchange through run-time collectives. `creation` makes the slots;
`replicator_strategy.keras.sharded_optimizer` connects Keras optimizers.

Design after ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054), stages 1 and
2.

>>> import keras
>>> from replicator_strategy import ReplicatorStrategy
>>> strategy = ReplicatorStrategy(shard_optimizer_state=True)
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
...   model.compile(keras.optimizers.Adam(), "mse")
...   model.optimizer.build(model.trainable_variables)
>>> [slot.value.shard_devices for slot in model.optimizer.variables[2:4]]
[('.../device:CPU:0', ..., '.../device:CPU:3'), ...]
"""

import abc

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import warn_once
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy.collectives import packing
from replicator_strategy.collectives import per_replica
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.model_parallel import logical_devices
from replicator_strategy.sharding import exchange as shard_exchange
from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import variables as sharded_variables


def step(exchange, weights, learning_rate, update):
  """One sharded step of every weight in `weights`, over `exchange`.

  Per weight, with `exchange.gradients` in the same order: each replica's
  shard of the summed gradient, then `update(weight, gradient_shard,
  weight_shard, learning_rate)` for each replica in an `UpdateContext` (the
  weight's slots read inside are that replica's shard), which returns the
  new weight shard, then every copy of the weight set from the new shards.
  """
  updates = []
  for weight, gradient in zip(weights, exchange.gradients):
    layout = layout_lib.FlatLayout.of(weight.shape, exchange.num_replicas)

    def update_shard(r, gradient_shard, weight_shard, weight=weight):
      return update(weight, gradient_shard, weight_shard,
                    tfi.distribute_utils.select_replica(r, learning_rate))

    new_shards = exchange.update_shards(
        layout, weight, exchange.reduce_scatter(layout, gradient),
        update_shard)
    updates.append(exchange.all_gather(layout, weight, new_shards))
  return tf.group(updates)


def step_on_their_devices(strategy, make_exchange, gradients, weights,
                          learning_rate, update):
  """`step` of the `weights` on each logical device of the replicas (a
  pipeline stage's weights on its device), over `make_exchange(gradients,
  logical_device)`, which exchanges among every replica's that device."""
  devices = strategy.extended.logical_devices
  on_device = {}
  for gradient, weight in zip(gradients, weights):
    pair = on_device.setdefault(devices.of_variable(weight), ([], []))
    pair[0].append(gradient)
    pair[1].append(weight)
  return tf.group([
      step(make_exchange(device_gradients, i), device_weights, learning_rate,
           update)
      for i, (device_gradients, device_weights) in on_device.items()])


class Exchange(abc.ABC):
  """Between which replicas `step` runs, and how they exchange shards.

  Attributes:
    gradients: the step's gradients, one per weight, as `reduce_scatter`
      takes them.
    num_replicas: replicas in sync, over every worker: the number of shards.
  """
  gradients: list
  num_replicas: int

  @abc.abstractmethod
  def reduce_scatter(self, layout, gradient):
    """The shards of the summed `gradient` this exchange's replicas update."""

  @abc.abstractmethod
  def update_shards(self, layout, weight, gradient_shards, update_fn):
    """`update_fn(r, gradient_shard, weight_shard)` for each of its local
    replicas r in `UpdateContext(r)`: the new weight shards, in order."""

  @abc.abstractmethod
  def all_gather(self, layout, weight, new_shards):
    """Its replicas' copies of `weight` set from every replica's new shard."""


class AllReplicas(Exchange):
  """The step's exchange for every local replica at once, in cross-replica context.

  `gradients` (each a distributed value, or a plain tensor: the global
  gradient) are taken as each local replica's part, or, if `summed`, as each
  one's copy of the sum over every replica. Where the replicas share memory
  they are summed here, in one packed all-reduce, as 16-bit floats with the
  strategy's `gradient_compression` (every replica then reads its slice of
  the one sum in place: no more bytes than a reduce-scatter, far fewer ops).
  The weights, their slots and the exchange are on every replica's
  `logical_device`.
  """

  def __init__(self, strategy, gradients, summed, logical_device=0):
    self._communicator = logical_devices.communicator_on(strategy.extended,
                                                         logical_device)
    self._wire = compression_lib.wire_dtype(strategy.gradient_compression)
    self.num_replicas = self._communicator.num_replicas
    self.gradients = [strategy.experimental_local_results(g)
                      for g in gradients]
    if self._communicator.shares_memory and not summed:
      self.gradients = self._summed_in_place()
      summed = True
    self._summed = summed

  def _summed_in_place(self):
    """Every local replica's copy of the summed gradients, on its device."""
    devices = self._communicator.devices
    sent = [per_replica.make(devices, lambda r, parts=parts:
                             compression_lib.to_wire(parts[r], self._wire))
            for parts in self.gradients]
    sums = packing.batch_reduce(self._communicator.cross_device_ops,
                                tf.distribute.ReduceOp.SUM, sent)
    return [_from_wire(devices, per_replica.parts(total), parts[0].dtype)
            for parts, total in zip(self.gradients, sums)]

  def reduce_scatter(self, layout, gradient):
    """This worker's shards of the summed `gradient`, shard `_shard(r)` on device r.

    `gradient` is its local parts, as in `gradients`; summed, they are cut,
    from one copy where the replicas share memory (every copy holds the same
    sum). With a 16-bit wire dtype the parts travel and are summed as that.
    """
    communicator = self._communicator
    parts = [_dense(g) for g in gradient]
    if self._summed:
      if len(parts) == 1:  # The global gradient: every group's.
        parts *= len(communicator.devices)
      if communicator.shares_memory:  # One copy of each group's sum.
        parts = _per_group(communicator, lambda r: tf.reshape(parts[r], [-1]))
      return per_replica.on_devices(
          communicator.devices,
          lambda r: layout.shard(parts[r], _shard(communicator, r)))
    padded = per_replica.on_devices(
        communicator.devices, lambda r: compression_lib.to_wire(
            layout.padded_flat(parts[r]), self._wire))
    shards = per_replica.parts(communicator.reduce_scatter(
        per_replica.wrap(padded), reduce_op_lib.ReduceOp.SUM, axis=0))
    return _from_wire(communicator.devices, shards, parts[0].dtype)

  def update_shards(self, layout, weight, gradient_shards, update_fn):
    """New shards of `weight`: `update_fn(r, gradient_shards[r], shard)` in
    `UpdateContext(r)`, for this worker's r-th shard (shard `_shard(r)`).

    Replicas that share memory cut their shards from one read of their
    group's first copy (the group's copies hold the same value); others read
    their own copy.
    """
    communicator = self._communicator
    if communicator.shares_memory:
      wholes = _per_group(communicator, lambda r: tf.reshape(
          weight.values[r].read_value(), [-1]))
    new_shards = []
    for r, component in enumerate(weight.values):
      with tf.device(component.device), tfi.UpdateContext(r), tf.name_scope(
          f"update_shard_{r}"):
        value = (wholes[r] if communicator.shares_memory else
                 component.read_value())
        new_shards.append(update_fn(r, gradient_shards[r],
                                    layout.shard(value, _shard(communicator, r))))
    return new_shards

  def all_gather(self, layout, weight, new_shards):
    """Every component of `weight` set from every replica's new shard.

    Replicas that share memory assemble the weight once per sync group, on
    its first device, and its copies are assigned from it; others all-gather
    the shards.
    """
    communicator = self._communicator
    devices = [c.device for c in weight.values]
    if communicator.shares_memory:
      n = communicator.num_replicas
      assembled = _per_group(
          communicator, lambda r: layout.assemble(new_shards[r:r + n]))
    else:
      gathered = per_replica.parts(communicator.all_gather(
          per_replica.wrap(new_shards), axis=0))
      assembled = per_replica.on_devices(
          devices, lambda r: layout.assemble([gathered[r]]))
    return tf.group(per_replica.on_devices(
        devices, lambda r: weight.values[r].assign(assembled[r],
                                                   read_value=False)))


class OneReplica(Exchange):
  """The step's exchange for this replica's own shard, inside its control flow.

  Where the replicas cannot merge (a `tf.cond` of the replica function, as
  gradient accumulation's), each steps its shard through the replica
  context's run-time collectives, among every replica's `logical_device`.
  `gradients` are this replica's, or, if `summed`, its copy of the sum over
  every replica.
  """

  def __init__(self, strategy, gradients, summed, logical_device=0):
    communicator = logical_devices.communicator_on(strategy.extended,
                                                   logical_device)
    self._logical_device = logical_device
    self._context = tf.distribute.get_replica_context()
    self._local = self._context.local_index
    self._shard = _shard(communicator, self._local)
    self._wire = compression_lib.wire_dtype(strategy.gradient_compression)
    self._summed = summed
    self.num_replicas = communicator.num_replicas
    self.gradients = list(gradients)

  def reduce_scatter(self, layout, gradient):
    """This replica's shard of the summed `gradient`, as a list of one."""
    gradient = _dense(gradient)
    if self._summed:
      return [layout.shard(gradient, self._shard)]
    return [compression_lib.from_wire(shard_exchange.reduce_scatter(
        self._context, compression_lib.to_wire(layout.padded_flat(gradient),
                                               self._wire), 0,
        self._logical_device), gradient.dtype)]

  def update_shards(self, layout, weight, gradient_shards, update_fn):
    """This replica's new shard of `weight`, as a list of one."""
    component = tfi.component(weight, self._local)
    shard = layout.shard(component.read_value(), self._shard)
    with tfi.UpdateContext(self._local):
      return [update_fn(self._local, gradient_shards[0], shard)]

  def all_gather(self, layout, weight, new_shards):
    """This replica's copy of `weight` set from every replica's new shard."""
    whole = layout.assemble([shard_exchange.all_gather(
        self._context, new_shards[0], 0, self._logical_device)])
    return tfi.component(weight, self._local).assign(whole, read_value=False)


def _shard(communicator, r):
  """The shard of the state local replica `r` updates: its place in its sync
  group (every group holds all of the state), or without groups its global
  replica id."""
  return sharded_variables.shard_index(communicator.first_replica_id, r,
                                       communicator.num_replicas)


def _per_group(communicator, make):
  """For each local replica, `make(first)` of its sync group's first local
  replica, made once per group on that replica's device (replicas in a
  group hold the same values; without groups, one for all)."""
  n = communicator.num_replicas
  made = {}
  for first in range(0, len(communicator.devices), n):
    with tf.device(communicator.devices[first]):
      made[first] = make(first)
  return [made[r - r % n] for r in range(len(communicator.devices))]


def _dense(gradient):
  """`gradient` as a dense tensor, warning once if it was sparse.

  Keras on one device squares each row occurrence of an `IndexedSlices`
  gradient separately (Adam's second moment, Adagrad's accumulator; Adamax
  takes each one's absolute value); a dense gradient sums a row's
  occurrences first, so those slots differ from one device for rows used
  more than once in a batch. SGD's and Lion's math is linear in the gradient
  and does not differ.
  """
  if isinstance(gradient, tf.IndexedSlices) and _warned_dense():
    logging.warning(
        "shard_optimizer_state=True makes a sparse gradient (an Embedding's, "
        "say) dense before cutting it into shards. Optimizers that square "
        "the gradient or take its absolute value (every supported one but "
        "SGD and Lion: Adam's second moment, Adagrad's accumulator, ...) then "
        "treat each row's summed gradient, where Keras on one device treats "
        "each occurrence separately: for rows looked up several times in a "
        "batch, training differs from one device. To keep sparse updates, "
        "shard the table itself with "
        "ReplicatorStrategy(variable_partitioner=...).")
  return tf.convert_to_tensor(gradient)


_warned_dense = warn_once.Once()


def _from_wire(devices, received, dtype):
  """Each of `received` back in `dtype`, on its device among `devices`."""
  return per_replica.on_devices(
      devices, lambda r: compression_lib.from_wire(received[r], dtype))
