"""Each replica's logical devices, as TF-Replicator numbered them.

With `ReplicatorStrategy(devices_per_replica=k)` replica r owns this
worker's devices r*k ... r*k+k-1, its logical devices 0 ... k-1. Inputs, and
every op or variable not placed otherwise, go to logical device 0 (the
replica's device in `strategy.extended.worker_devices`); gradients flow back
across devices, and the optimizer updates each variable on its own device.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices_per_replica=2)  # 4 CPUs here
>>> strategy.num_replicas_in_sync
2
>>> with strategy.scope(), strategy.logical_device_for_variables(1):
...   v = tf.Variable(1.0)
>>> [c.device[-5:] for c in v.values]
['CPU:1', 'CPU:3']
"""

import contextlib
import numbers

import tensorflow as tf


def group_by_replica(devices, devices_per_replica):
  """This worker's `devices`, `devices_per_replica` at a time, in order."""
  k = devices_per_replica
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(
        f"Expected `devices_per_replica` to be a positive int: how many of "
        f"this worker's devices each replica spans. Received: "
        f"devices_per_replica={k!r}.")
  k = int(k)
  if len(devices) % k:
    raise ValueError(
        f"`devices_per_replica={k}` gives each replica {k} of this worker's "
        f"devices, but it has {len(devices)} ({', '.join(devices)}), not a "
        f"multiple of {k}. Pass a `devices_per_replica` that divides "
        f"{len(devices)}, or `devices=[...]` listing a multiple of {k}.")
  return tuple(tuple(devices[i:i + k]) for i in range(0, len(devices), k))


class LogicalDevices:
  """The replicas' device groups, and where new variables go.

  With `stages` pipeline stages, a replica's devices are its stages'
  in order, each stage's the same number (its model axis): stage s owns
  logical devices s*k ... s*k+k-1.
  """

  def __init__(self, groups, stages=1):
    self.groups = tuple(tuple(g) for g in groups)
    self.stages = stages
    self._variables_on = 0  # The logical device new variables go to.

  @property
  def per_replica(self):
    """How many devices each replica spans."""
    return len(self.groups[0])

  def check(self, logical_device_id, api):
    if (isinstance(logical_device_id, bool) or
        not isinstance(logical_device_id, numbers.Integral) or
        not 0 <= logical_device_id < self.per_replica):
      raise ValueError(
          f"{api} takes a logical device id in [0, {self.per_replica}): each "
          f"replica spans {self.per_replica} device(s) "
          f"(`devices_per_replica`). Received: {logical_device_id!r}.")
    return int(logical_device_id)

  @contextlib.contextmanager
  def for_variables(self, logical_device_id):
    """New variables inside get a component on each replica's device."""
    i = self.check(logical_device_id, "logical_device_for_variables")
    previous, self._variables_on = self._variables_on, i
    try:
      yield
    finally:
      self._variables_on = previous

  @property
  def variables_on(self):
    """The logical device new variables go to (`for_variables`)."""
    return self._variables_on

  def variable_devices(self):
    """The devices, one per replica, that a new variable's components go to."""
    return tuple(group[self._variables_on] for group in self.groups)

  @property
  def per_stage(self):
    """How many devices each pipeline stage of a replica spans."""
    return self.per_replica // self.stages

  def stage_devices(self, local_replica):
    """The local replica's devices by pipeline stage: a tuple of each
    stage's devices."""
    k, group = self.per_stage, self.groups[local_replica]
    return tuple(group[i:i + k] for i in range(0, len(group), k))

  def model_devices(self, local_replica, device):
    """The local replica's devices that hold `device` (a tensor's) on their
    model axis: its pipeline stage's, or, without one, the replica's."""
    stages = self.stage_devices(local_replica)
    if len(stages) > 1:
      wanted = tf.DeviceSpec.from_string(device or "")
      for stage in stages:
        if any(_same_device(wanted, d) for d in stage):
          return stage
    return stages[0] if len(stages) == 1 else self.groups[local_replica]

  def device_id(self, local_replica, device):
    """The logical device id of `device` (a part's) in the local replica:
    with pipeline stages, a stage's part j is not on logical device j."""
    wanted = tf.DeviceSpec.from_string(device)
    for i, candidate in enumerate(self.groups[local_replica]):
      if _same_device(wanted, candidate):
        return i
    raise ValueError(
        f"Device {device!r} is not one of replica {local_replica}'s devices "
        f"{self.groups[local_replica]}: a split weight's parts must be on its "
        f"replica's devices.")

  def of_variable(self, variable):
    """The logical device id that the distributed `variable`'s components
    are on (a pipeline stage's, or the one it was made for)."""
    return self.device_id(0, variable.values[0].device)

  def on_device(self, local_replica, logical_device_id):
    """A `tf.device` scope on the local replica's logical device."""
    i = self.check(logical_device_id, "ReplicaContext.logical_device")
    return tf.device(self.groups[local_replica][i])


def _same_device(spec, device):
  """Whether the `tf.DeviceSpec` `spec` (a partial one matches what it names)
  names `device`."""
  other = tf.DeviceSpec.from_string(device)
  return spec.device_type is not None and all(
      mine is None or mine == theirs for mine, theirs in (
          (spec.job, other.job), (spec.task, other.task),
          (spec.device_type, other.device_type),
          (spec.device_index, other.device_index)))


def communicator_on(extended, logical_device_id):
  """The exchange among every replica's logical device `logical_device_id`
  (the strategy's `extended`), where part j of a split weight moves: the
  communicator's own on those devices, with every worker, within each sync
  group (`Communicator.on_devices`); the communicator itself for device 0."""
  return extended.communicator.on_devices(
      [group[logical_device_id] for group in extended.logical_devices.groups])
