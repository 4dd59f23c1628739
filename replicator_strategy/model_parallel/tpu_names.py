"""TPUStrategy's logical-device calls, with a meaning on CPUs and GPUs.

On TPUs these three only annotate a tensor for XLA's partitioner. Here each
places the tensor itself, on the calling replica's logical devices
(`devices_per_replica` or a layout map's model axis), with TPUStrategy's
checks:

- `assign_to_logical_device(tensor, i)`: a copy on logical device i;
- `replicate_to_logical_devices(tensor)`: the tensor, which every logical
  device reads whole (TensorFlow copies it to each device that reads it);
- `split_to_logical_devices(tensor, partition_dimensions)`: the tensor in
  parts, part i on logical device i, along the one dimension
  `partition_dimensions` splits; a row-parallel layer (`megatron`) takes the
  parts as they are, and any other op reads the whole.

>>> import replicator_strategy as rs
>>> rs.split_cpu(4)
>>> strategy = rs.ReplicatorStrategy(devices_per_replica=2)
>>> placed = []
>>> @tf.function
... def replica_step():
...   x = tf.ones([2, 4])
...   on_1 = strategy.experimental_assign_to_logical_device(x, 1)
...   halves = strategy.experimental_split_to_logical_devices(x, [1, 2])
...   placed.append(on_1.device[-5:])
...   return halves
>>> halves = strategy.run(replica_step)
>>> placed, halves.values[1].shape.as_list()
(['CPU:1', 'CPU:3'], [2, 4])
"""

import math
import numbers

import tensorflow as tf

from replicator_strategy.model_parallel import megatron


def _replica(strategy, api):
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.strategy is not strategy or not hasattr(
      ctx, "local_index"):
    raise ValueError(
        f"strategy.{api} places a tensor on the calling replica's logical "
        f"devices: call it inside `strategy.run`.")
  return ctx


def assign_to_logical_device(strategy, tensor, logical_device_id):
  ctx = _replica(strategy, "experimental_assign_to_logical_device")
  with ctx.logical_device(logical_device_id):
    return tf.identity(tensor)


def replicate_to_logical_devices(strategy, tensor):
  _replica(strategy, "experimental_replicate_to_logical_devices")
  return tf.identity(tensor)


def split_to_logical_devices(strategy, tensor, partition_dimensions):
  ctx = _replica(strategy, "experimental_split_to_logical_devices")
  logical = strategy.extended.logical_devices
  k = logical.per_replica
  tensor = tf.convert_to_tensor(tensor)
  dims = list(partition_dimensions)
  if len(dims) != tensor.shape.rank:
    raise ValueError(
        f"Length of `partition_dimensions` must equal the rank of `tensor` "
        f"({tensor.shape.rank}). Received partition_dimensions={dims}.")
  if (not all(isinstance(d, numbers.Integral) and d >= 1 for d in dims) or
      math.prod(dims) != k):
    raise ValueError(
        f"`partition_dimensions` must be positive ints whose product is the "
        f"number of logical devices per replica ({k}). Received "
        f"partition_dimensions={dims}.")
  split = [axis for axis, d in enumerate(dims) if d > 1]
  if len(split) > 1:
    raise NotImplementedError(
        f"On CPUs and GPUs a tensor is split along one dimension; "
        f"partition_dimensions={dims} splits {len(split)}. Split one "
        f"dimension into {k}.")
  if not split:
    return tf.identity(tensor)
  axis = split[0]
  size = tensor.shape[axis]
  if size is None or size % k:
    raise ValueError(
        f"`tensor` dimension {axis} (size {size}, shape {tensor.shape}) must "
        f"divide into {k} parts, as partition_dimensions={dims} asks.")
  devices = logical.groups[ctx.local_index]
  parts = []
  for device, part in zip(devices, tf.split(tensor, k, axis=axis)):
    with tf.device(device):
      parts.append(tf.identity(part))
  return megatron.assembled(parts, devices, axis)
