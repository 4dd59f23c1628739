"""Choosing the all-reduce algorithm that fits the devices.

Devices that share host memory (logical CPU devices) gain nothing from ring
or tree algorithms made for separate devices: each step of a ring is a copy
within one memory, so the cheapest all-reduce is to add the replicas' values
on one device and hand every replica that one sum. Separate GPUs use NCCL
when TensorFlow was built with it.

>>> ops, reason = choose(("/cpu:0", "/cpu:1"), "auto")
>>> reason
'add_on_one_device: devices share host memory'
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import collectives

ALGORITHMS = ("auto", "add_on_one_device", "nccl", "hierarchical_copy",
              "ring")


def choose(devices, algorithm, num_workers=1,
           timeout_seconds=collectives.TIMEOUT_SECONDS):
  """Returns `(cross_device_ops, reason)` for `devices` and a requested algorithm.

  With several workers, `devices` are this worker's and only TF's collective
  ops ("ring", the "auto" choice) reach the others.

  `algorithm` is one of `ALGORITHMS` or a `tf.distribute.CrossDeviceOps`.
  "ring" (TF's collective ops, MirroredStrategy's CPU default) shares
  MirroredStrategy's limit: an optimizer first built inside a `tf.function`
  step fails with a placeholder error, so build it first when choosing it.
  """
  if isinstance(algorithm, tf.distribute.CrossDeviceOps):
    return algorithm, f"given by the user: {type(algorithm).__name__}"
  if algorithm not in ALGORITHMS:
    raise ValueError(
        f"Expected `all_reduce` to be one of {ALGORITHMS} or a "
        f"tf.distribute.CrossDeviceOps instance. Received: "
        f"all_reduce={algorithm!r}")
  if num_workers > 1:
    if algorithm not in ("auto", "ring"):
      raise ValueError(
          f"all_reduce={algorithm!r} works within one machine only; across "
          f"{num_workers} workers only TensorFlow's collective ops reach "
          f"every replica. Use all_reduce='auto' or 'ring'.")
    reason = (f"{len(devices)} device(s) add on one, then collective ops "
              f"among {num_workers} workers")
    return _keyed(devices, len(devices) * num_workers,
                  timeout_seconds), f"ring: {reason}"
  if algorithm == "auto":
    algorithm, reason = _auto(devices)
  else:
    reason = "requested"
  return _build(algorithm, devices), f"{algorithm}: {reason}"


def across_workers(host_device, num_workers, timeout_seconds):
  """All-reduce of one value per worker, on each worker's `host_device`."""
  return _keyed([host_device], num_workers, timeout_seconds)


def _auto(devices):
  if len(devices) == 1:
    return "add_on_one_device", "a single device has nothing to exchange"
  if all(_device_type(d) == "CPU" for d in devices):
    return "add_on_one_device", "devices share host memory"
  physical_gpus = len(tf.config.list_physical_devices("GPU"))
  if len(devices) > physical_gpus:
    return "add_on_one_device", "logical GPUs share a physical GPU's memory"
  if tf.sysconfig.get_build_info().get("is_cuda_build", False):
    return "nccl", "separate GPUs and TensorFlow built with NCCL"
  return "hierarchical_copy", "separate GPUs without NCCL"


def _build(algorithm, devices):
  if algorithm == "add_on_one_device":
    return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
  if algorithm == "nccl":
    return tf.distribute.NcclAllReduce()
  if algorithm == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce()
  return _collective(devices, len(devices))


def _keyed(devices, group_size, timeout_seconds):
  """Collective ops among `group_size` replicas that also work in loops."""
  return collectives.KeyedCollectiveOps(
      devices, group_size, timeout_seconds,
      eager_ops=_collective(devices, group_size))


def _collective(devices, group_size):
  """TF's collective all-reduce among `group_size` replicas, ours on `devices`.

  Untimed: a timed launch holds a thread for the whole timeout, however soon
  it finishes (see `collective_watchdog`).
  """
  return tfi.cross_device_ops.CollectiveAllReduce(
      devices=devices,
      group_size=group_size,
      options=tfi.collective_util.Options(
          implementation=tfi.collective_util.CommunicationImplementation.RING),
      collective_keys=tfi.cross_device_utils.CollectiveKeys(
          group_key_start=collectives.new_group_key()))


def _device_type(device):
  return tf.DeviceSpec.from_string(device).device_type
