"""`ReplicatorStrategy`: single-device code, replicated over every local device.

>>> import replicator_strategy as rs
>>> rs.split_cpu(4)                      # demo/test only: 4 virtual CPUs
>>> strategy = rs.ReplicatorStrategy()   # every GPU, else every CPU device
>>> strategy.num_replicas_in_sync
4
>>> with strategy.scope():
...   model = keras.Sequential([keras.layers.Dense(1)])
...   model.compile("sgd", "mse")
>>> model.fit(x, y, batch_size=64)       # the global batch, split 4 ways

TF-Replicator (Buchlovsky et al., 2019, arXiv:1902.00465) rebuilt as a
`tf.distribute.Strategy`.
"""

import json
import os

import tensorflow as tf

from replicator_strategy import devices as devices_lib
from replicator_strategy import extended as extended_lib
from replicator_strategy import reduce_op as reduce_op_lib


class ReplicatorStrategy(tf.distribute.Strategy):
  """Synchronous data-parallel replication over the devices of one machine.

  Args:
    devices: device strings to replicate over, one replica each. Default:
      every local GPU, or every logical CPU device when there is no GPU.
    all_reduce: "auto" (default: picked for the topology, see
      `replicator_strategy.all_reduce`), "add_on_one_device", "nccl",
      "hierarchical_copy", "ring", or a `tf.distribute.CrossDeviceOps`.
  """

  def __init__(self, devices=None, all_reduce="auto"):
    _refuse_multi_worker_tf_config()
    if devices is None:
      if devices_lib.tpu_present():
        raise NotImplementedError(devices_lib.tpu_not_supported_message())
      devices = devices_lib.local_devices()
    else:
      devices = devices_lib.resolve_devices(devices)
    super().__init__(extended_lib.ReplicatorExtended(self, devices, all_reduce))

  def reduce(self, reduce_op, value, axis):
    """`tf.distribute.Strategy.reduce`, also with "min" and "max".

    >>> strategy.reduce("max", per_replica_values, axis=None)
    """
    op = reduce_op_lib.parse(reduce_op)
    if not op.is_extremum:
      return super().reduce(op.to_tf(), value, axis)

    def reduce_one(v):
      parts = self.experimental_local_results(v)
      if axis is not None:
        parts = [reduce_op_lib.reduce_along(op, p, axis) for p in parts]
      with tf.device(self.extended.host_device):
        return reduce_op_lib.reduce_along(op, tf.stack(parts), 0)

    return tf.nest.map_structure(reduce_one, value)

  def __repr__(self):
    n = self.num_replicas_in_sync
    return (f"ReplicatorStrategy({n} replica{'s' if n > 1 else ''}: "
            f"{', '.join(self.extended.worker_devices)}; all-reduce "
            f"{self.extended.all_reduce_choice})")


def _refuse_multi_worker_tf_config():
  """Multi-worker runs are not supported yet: fail rather than train alone."""
  raw = os.environ.get("TF_CONFIG")
  if not raw:
    return
  try:
    cluster = json.loads(raw).get("cluster", {})
    tasks = sum(len(addresses) for addresses in cluster.values())
  except (ValueError, AttributeError, TypeError) as e:
    raise ValueError(
        f"TF_CONFIG is not a valid cluster description ({e}). Received: "
        f"TF_CONFIG={raw!r}. Unset it to run on this machine alone.") from e
  if tasks > 1:
    raise NotImplementedError(
        f"TF_CONFIG describes a cluster of {tasks} tasks, but "
        f"ReplicatorStrategy runs on one machine only so far; every worker "
        f"would train alone. Unset TF_CONFIG, or use "
        f"tf.distribute.MultiWorkerMirroredStrategy for now.")
