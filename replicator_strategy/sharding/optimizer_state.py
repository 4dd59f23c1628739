"""Optimizer state held once across the replicas, a slice on each (ZeRO 1/2).

With `ReplicatorStrategy(shard_optimizer_state=True)`, every optimizer slot
(SGD momentum, Adam's m and v, ...) is one `ShardedVariable` (see
`variables`; it refuses reads inside a replica) with a `layout.FlatLayout`:
the slot flattened, padded to a multiple of N and cut into N equal contiguous
shards, shard g on the device of global replica g (across workers, each worker holds its
replicas' shards). A 784x512 kernel's momentum is spread over all replicas
rather than landing whole on one, so optimizer memory and optimizer math per
device both drop to about 1/N. A step then runs, per model weight:

1. reduce-scatter: replica r gets shard r of the summed gradient (the
   communicator's `reduce_scatter`, chosen for the topology; where the
   replicas share memory, the step's packed all-reduce, each replica
   slicing the one sum in place);
2. the update: device r runs the optimizer's own math on shard r of the
   weight and of the gradient, against shard r of the slots;
3. all-gather: every replica's copy of the weight (a `MirroredVariable`
   component) is overwritten with the concatenated new shards.

This module holds the strategy side of the step, its three parts
(`reduce_scatter`, `update_shards`, `all_gather`); `creation` makes the
slots.
`replicator_strategy.keras.sharded_optimizer` connects Keras optimizers to it.

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

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.sharding import variables as sharded_variables


# One step for one weight, in cross-replica context: reduce-scatter the
# gradient, update the shards, all-gather the weight.


def reduce_scatter(communicator, layout, gradients, summed, wire=None):
  """This worker's shards of the summed gradient, shard `first + r` on device r.

  `gradients` holds each local replica's gradient (on its device), or, if
  `summed`, each one's copy of the already summed gradient, or that sum
  once (from cross-replica context). With a 16-bit
  `wire` dtype (`gradient_compression`), the gradients travel and are summed
  as that.
  """
  gradients = [dense(g) for g in gradients]
  first = communicator.first_replica_id
  if summed:
    if communicator.shares_memory or len(gradients) == 1:
      # Every copy holds the same sum: cut one.
      with tf.device(communicator.devices[0]):
        flat = tf.reshape(gradients[0], [-1])
      gradients = [flat] * len(communicator.devices)
    return [_on(device, layout.shard, g, first + r)
            for r, (device, g) in enumerate(zip(communicator.devices,
                                                gradients))]
  padded = [_on(device, lambda g: compression_lib.to_wire(
      layout.padded_flat(g), wire), g)
            for device, g in zip(communicator.devices, gradients)]
  shards = sharded_variables.parts(communicator.reduce_scatter(
      reduce_op_lib.ReduceOp.SUM, sharded_variables.per_replica(padded), axis=0))
  return [_on(device, compression_lib.from_wire, shard, gradients[0].dtype)
          for device, shard in zip(communicator.devices, shards)]


def dense(gradient):
  """`gradient` as a dense tensor, warning once if it was sparse.

  Keras on one device squares each row occurrence of an `IndexedSlices`
  gradient separately (Adam's second moment, Adagrad's accumulator; Adamax
  takes each one's absolute value); a dense gradient sums a row's
  occurrences first, so those slots differ from one device for rows used
  more than once in a batch. SGD's and Lion's math is linear in the gradient
  and does not differ.
  """
  if isinstance(gradient, tf.IndexedSlices) and not _warned_dense:
    _warned_dense.append(True)
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


_warned_dense = []


def update_shards(communicator, layout, weight, update_fn):
  """New shards of `weight`: `update_fn(r, shard)` in `UpdateContext(r)`.

  `update_fn` returns the new value of this worker's r-th shard (global
  shard `first_replica_id + r`); slots read inside it are that shard too.
  Replicas that share memory cut their shards from one read of the first
  copy (every copy holds the same value); others read their own copy.
  """
  first = communicator.first_replica_id
  if communicator.shares_memory:
    with tf.device(weight.values[0].device):
      whole = tf.reshape(weight.values[0].read_value(), [-1])
  new_shards = []
  for r, component in enumerate(weight.values):
    with tf.device(component.device), tfi.UpdateContext(r), tf.name_scope(
        f"update_shard_{r}"):
      value = whole if communicator.shares_memory else component.read_value()
      new_shards.append(update_fn(r, layout.shard(value, first + r)))
  return new_shards


def all_gather(communicator, layout, weight, new_shards):
  """Every component of `weight` set from every replica's new shard.

  Replicas that share memory assemble the weight once, on the first device,
  and every copy is assigned from it; others all-gather the shards.
  """
  if communicator.shares_memory:
    with tf.device(weight.values[0].device):
      whole = layout.assemble(new_shards)
    assembled = [whole] * len(weight.values)
  else:
    gathered = communicator.all_gather(
        sharded_variables.per_replica(new_shards), axis=0)
    assembled = [_on(c.device, layout.assemble, [g]) for c, g in zip(
        weight.values, sharded_variables.parts(gathered))]
  return tf.group([
      _on(c.device, lambda c=c, a=a: c.assign(a, read_value=False))
      for c, a in zip(weight.values, assembled)])


def _on(device, fn, *args):
  with tf.device(device):
    return fn(*args)
