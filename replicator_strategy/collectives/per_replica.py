"""Values with one part per local replica: their parts, and making them.

The communicator and the sharded step take distributed values apart (`parts`)
and build them from one part per device (`on_devices`, `wrap`, `make`), as TF
regroups them: a `PerReplica` even where this worker has one replica.

>>> value = make(("/cpu:0", "/cpu:1"), lambda r: tf.constant(r))
>>> [int(part) for part in parts(value)]
[0, 1]
>>> [part.device[-5:] for part in parts(value)]
['CPU:0', 'CPU:1']
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi


def parts(value):
  """This worker's parts of a distributed `value` (a plain tensor: one)."""
  if isinstance(value, tf.distribute.DistributedValues):
    return value.values
  return (value,)


def wrap(local_parts):
  """`local_parts`, one per local replica, as one distributed value."""
  return tfi.distribute_utils.regroup(list(local_parts), always_wrap=True)


def on_devices(devices, part_for):
  """`[part_for(i) for each i]`, each made on `devices[i]`."""
  made = []
  for i, device in enumerate(devices):
    with tf.device(device):
      made.append(part_for(i))
  return made


def make(devices, part_for):
  """A `PerReplica` of `part_for(i)`, each made on `devices[i]`."""
  return wrap(on_devices(devices, part_for))
