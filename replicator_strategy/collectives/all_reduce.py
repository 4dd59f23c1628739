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
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.collectives import worker_collectives

ALGORITHMS = ("auto", "add_on_one_device", "nccl", "hierarchical_copy",
              "ring")


def choose(devices, algorithm, num_workers=1,
           timeout_seconds=collective_watchdog.DEFAULT_TIMEOUT_SECONDS):
  """Returns `(cross_device_ops, reason)` for `devices` and a requested algorithm.

  With several workers, `devices` are this worker's and only TF's collective
  ops ("ring", the "auto" choice) reach the others.

  `algorithm` is one of `ALGORITHMS` (any case, as reduce op names) or a
  `tf.distribute.CrossDeviceOps`.
  "ring" (TF's collective ops, MirroredStrategy's CPU default) shares
  MirroredStrategy's limit: an optimizer first built inside a `tf.function`
  step fails with a placeholder error, so build it first when choosing it.
  """
  if isinstance(algorithm, tf.distribute.CrossDeviceOps):
    return algorithm, f"given by the user: {type(algorithm).__name__}"
  if isinstance(algorithm, str) and algorithm.lower() in ALGORITHMS:
    algorithm = algorithm.lower()
  if algorithm not in ALGORITHMS:
    raise ValueError(
        f"Expected `all_reduce` to be one of {ALGORITHMS} (any case) or a "
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
    if algorithm == "nccl":
      _check_nccl_can_serve(devices)
    if algorithm == "hierarchical_copy":
      _check_hierarchical_copy_can_serve(devices)
  return _build(algorithm, devices), f"{algorithm}: {reason}"


def across_workers(devices, num_workers, timeout_seconds):
  """All-reduce of this worker's values on `devices` with `num_workers`
  workers' (one per worker: `devices` is its host), in collective groups
  of its own."""
  return _keyed(devices, len(devices) * num_workers, timeout_seconds)


def _auto(devices):
  if len(devices) == 1:
    return "add_on_one_device", "a single device has nothing to exchange"
  if all(_device_type(d) == "CPU" for d in devices):
    return "add_on_one_device", "devices share host memory"
  if _logical_gpus_share_one(devices):
    return "add_on_one_device", "logical GPUs share a physical GPU's memory"
  if _nccl_built():
    return "nccl", "separate GPUs and TensorFlow built with NCCL"
  if _halves_leave_one_out(devices):
    return "add_on_one_device", "an odd number of GPUs without NCCL"
  return "hierarchical_copy", "separate GPUs without NCCL"


def _check_nccl_can_serve(devices):
  """Refuses now what NCCL would refuse at the first all-reduce."""
  not_gpu = [d for d in devices if _device_type(d) != "GPU"]
  if not_gpu:
    raise ValueError(
        f"all_reduce='nccl' all-reduces between GPUs, but `devices` include "
        f"{not_gpu[0]}. Received: all_reduce='nccl' with devices "
        f"{list(devices)}. Use all_reduce='auto' (it adds the replicas' "
        f"values on one device, the fastest way within host memory) or "
        f"'ring'.")
  if not _nccl_built():
    raise ValueError(
        "all_reduce='nccl' needs TensorFlow built with NCCL (a CUDA or ROCm "
        "build); this TensorFlow has no NCCL kernels. Use all_reduce='auto', "
        "which picks the best algorithm without NCCL, or install a GPU build "
        "of TensorFlow.")
  if _logical_gpus_share_one(devices):
    raise ValueError(
        f"all_reduce='nccl' needs one physical GPU per device, and the "
        f"{len(devices)} logical GPUs in `devices` share fewer physical GPUs "
        f"(NCCL refuses a GPU listed twice). Use all_reduce='auto' or "
        f"'add_on_one_device'.")


def _check_hierarchical_copy_can_serve(devices):
  if _halves_leave_one_out(devices):
    raise ValueError(
        f"all_reduce='hierarchical_copy' sums two equal halves of the "
        f"devices (it was made for 8-GPU machines); with an odd number of "
        f"devices TensorFlow's implementation leaves the last one out of the "
        f"sum. Received: all_reduce='hierarchical_copy' with "
        f"{len(devices)} devices. Use all_reduce='auto', "
        f"'add_on_one_device' or 'ring', or an even number of devices.")


def _halves_leave_one_out(devices):
  return len(devices) > 1 and len(devices) % 2 == 1


def _logical_gpus_share_one(devices):
  return len(devices) > len(tf.config.list_physical_devices("GPU"))


def _nccl_built():
  # TensorFlow registers NCCL kernels only in builds that include NCCL.
  return bool(tfi.kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)


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
  return worker_collectives.KeyedCollectiveOps(
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
          group_key_start=replica_collectives.new_group_key()))


def _device_type(device):
  return tf.DeviceSpec.from_string(device).device_type
