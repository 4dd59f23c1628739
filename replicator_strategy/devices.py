"""Which devices a ReplicatorStrategy replicates over, and splitting the CPU.

`split_cpu` and `local_devices` are public (each with an example);
`resolve_devices` checks the `devices` a user passes.
"""

import numbers

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

_SUPPORTED_TYPES = ("CPU", "GPU")


def split_cpu(num_devices):
  """Splits the physical CPU into `num_devices` logical CPU devices.

  Multi-replica code then runs on any machine, which is how tests and demos
  exercise 2 or 4 replicas without GPUs. Call it before TensorFlow creates
  its devices (before the first op, dataset or variable); calling it again
  with the same count is harmless.

  >>> split_cpu(4)
  >>> len(tf.config.list_logical_devices("CPU"))
  4
  """
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(
        f"Expected `num_devices` to be a positive int. Received: "
        f"num_devices={num_devices!r}")
  cpu = tf.config.list_physical_devices("CPU")[0]
  wanted = [tf.config.LogicalDeviceConfiguration()] * num_devices
  current = tf.config.get_logical_device_configuration(cpu)
  if current is not None and len(current) == num_devices:
    return
  try:
    tf.config.set_logical_device_configuration(cpu, wanted)
  except RuntimeError as e:
    have = len(tf.config.list_logical_devices("CPU"))
    raise RuntimeError(
        f"split_cpu({num_devices}) was called after TensorFlow initialised "
        f"its devices, so the CPU stays split into {have} logical device(s). "
        f"Call split_cpu at the start of the program, before any TensorFlow "
        f"op, dataset, variable or strategy is created.") from e


def local_devices():
  """The devices `ReplicatorStrategy()` uses by default, as full names.

  Every local GPU if there is one, else every logical CPU device. In a
  cluster, this worker's only.

  >>> import replicator_strategy as rs
  >>> rs.split_cpu(4)  # before TensorFlow touches a device
  >>> rs.local_devices()
  ('/job:localhost/replica:0/task:0/device:CPU:0', ...,
   '/job:localhost/replica:0/task:0/device:CPU:3')
  """
  for device_type in ("GPU", "CPU"):
    found = _this_tasks(tf.config.list_logical_devices(device_type))
    if found:
      return tuple(_canonical(d.name) for d in found)
  raise RuntimeError("TensorFlow reports no CPU or GPU device.")


def is_lone_cpu(devices):
  """Whether `devices` is this worker's one CPU, unsplit: a single replica."""
  return (len(devices) == 1 and
          tf.DeviceSpec.from_string(devices[0]).device_type == "CPU")


def _this_tasks(logical_devices):
  """Drops other workers' devices, which TF lists once in a cluster."""
  task = tfi.context.context().host_address_space()
  return [d for d in logical_devices
          if _canonical(d.name).startswith(task + "/")]


def _canonical(name):
  """`name` in full, job and task included, eagerly and in a `tf.Graph`.

  TF lists devices without their job inside a graph ("/device:CPU:0"),
  and canonicalizes without one there; this worker's task fills it in.
  """
  return tfi.device_util.canonicalize(
      name, default=tfi.context.context().host_address_space())


def tpu_present():
  return bool(tf.config.list_logical_devices("TPU"))


def resolve_devices(devices):
  """Validates user devices and returns their canonical full names.

  Each entry is a device string such as "/gpu:0" or a `tf.DeviceSpec`, naming
  one device of this worker. Raises ValueError naming the bad entry and
  listing the devices that exist, and NotImplementedError for TPU devices.
  """
  existing = {
      _canonical(d.name): d.device_type
      for d in _this_tasks(tf.config.list_logical_devices())
  }
  listing = ", ".join(sorted(existing)) or "none"
  if isinstance(devices, (str, tf.DeviceSpec)) or not hasattr(
      devices, "__iter__"):
    raise ValueError(
        f"Expected `devices` to be a list of device strings such as "
        f"['/gpu:0', '/gpu:1']. Received: devices={devices!r}. A single "
        f"device goes in a list too: devices=['/gpu:0']. Devices that "
        f"exist: {listing}")
  devices = list(devices)
  if not devices:
    raise ValueError(
        f"Expected `devices` to name at least one device. Received: "
        f"devices=[]. Devices that exist: {listing}")
  resolved = []
  for i, entry in enumerate(devices):
    name = _canonical(_one_device(i, entry, listing))
    if name not in existing:
      raise ValueError(
          f"Device {entry!r} in `devices` does not exist on this machine. "
          f"Devices that exist: {listing}")
    if existing[name] == "TPU":
      raise NotImplementedError(tpu_not_supported_message())
    if existing[name] not in _SUPPORTED_TYPES:
      raise ValueError(
          f"Device {entry!r} in `devices` has type {existing[name]}; "
          f"ReplicatorStrategy replicates over CPU or GPU devices. "
          f"Devices that exist: {listing}")
    if name in resolved:
      raise ValueError(
          f"Device {entry!r} appears more than once in `devices` (as "
          f"{name}). List each device once. Devices that exist: {listing}")
    resolved.append(name)
  types = {existing[name] for name in resolved}
  if len(types) > 1:
    raise ValueError(
        f"`devices` mixes device types {sorted(types)}: {devices!r}. A "
        f"replica on a CPU would hold back every GPU replica each step; list "
        f"only GPUs or only CPUs. Devices that exist: {listing}")
  return tuple(resolved)


def _one_device(i, entry, listing):
  """The device string of one `devices` entry, which must name one device.

  TF's own parsing fills in what a string leaves out ("", "/cpu:*" and
  "/cpu" all become CPU:0), which would quietly drop replicas the user meant
  to have, so an entry without a device type and index is refused here.
  """
  if isinstance(entry, numbers.Integral) and not isinstance(entry, bool):
    raise ValueError(
        f"Device {entry!r} in `devices` is a number, which could mean a GPU "
        f"or a CPU. Write it as a device string, such as '/gpu:{entry}' or "
        f"'/cpu:{entry}'. Devices that exist: {listing}")
  if isinstance(entry, tf.DeviceSpec):
    text = entry.to_string()
  elif isinstance(entry, str):
    text = entry
  else:
    raise ValueError(
        f"Expected each entry of `devices` to be a device string such as "
        f"'/gpu:0' or a tf.DeviceSpec. Received: devices[{i}]={entry!r} "
        f"of type {type(entry).__name__}. Devices that exist: {listing}")
  try:
    spec = tf.DeviceSpec.from_string(text)
  except ValueError as e:
    raise ValueError(
        f"Device {entry!r} in `devices` is not a valid device string "
        f"({e}). Devices that exist: {listing}") from e
  if spec.device_type is None or spec.device_index is None:
    missing = "type" if spec.device_type is None else "index"
    raise ValueError(
        f"Device {entry!r} in `devices` names no single device: it has no "
        f"device {missing}. Name each device with its type and index, such "
        f"as '/gpu:0' or '/cpu:1', and list several to replicate over "
        f"several. Devices that exist: {listing}")
  return text


def tpu_not_supported_message():
  return (
      "ReplicatorStrategy recognises TPU devices but does not run on them "
      "yet: TPU execution needs XLA replication, which is not implemented or "
      "tested. Use tf.distribute.TPUStrategy on TPU hosts, or pass "
      "devices=[...] naming CPU or GPU devices.")
