"""Sync groups: replicas synchronous inside a group, the groups apart.

TF-Replicator's RFC (tensorflow/community, rfcs/20181016-replicator.md)
names them: `num_replicas_in_sync` replicas form a sync group, and
`num_sync_groups` groups train side by side, exchanging nothing between
their rounds of averaging (`replicator_strategy.sync_groups.rounds`).

Groups are contiguous in global replica order and lie within one worker, so
a group's exchange is local: a `Communicator` over a slice of this worker's
devices. `GroupedCommunicator` stands where the strategy's communicator
stands and answers every exchange a replica asks for (an all-reduce, a
gather, a reduce-scatter, an all-to-all, inside control flow too) within its
group; a reduction that leaves the replicas (`strategy.reduce` onto the
host) and everything about the worker, its input and its cluster come from
the all-replica communicator, `everyone`. The averaging rounds exchange
between groups through `round_ops`, over every replica too: across workers,
collectives with keys of their own, so that a round's exchange running in a
thread beside the steps (`overlap_averaging`) never draws launch numbers
from the counters of a step's own exchanges between groups (`fit`'s
validation metrics, a custom loop's `all_reduce_all_groups`). `local_groups`
reduces over this worker's groups only (`fit`'s per-step logs).

>>> from replicator_strategy.collectives import communicator
>>> grouped = communicator.for_topology(
...     ("/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"), "auto", None, 120,
...     sync_groups=2)
>>> grouped.num_replicas, grouped.num_sync_groups
(2, 2)
>>> [group.devices for group in grouped.groups]
[('/cpu:0', '/cpu:1'), ('/cpu:2', '/cpu:3')]
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import per_replica
from replicator_strategy.collectives import protocol


def check_divides(num_groups, num_replicas, local_replicas):
  """Refuses `num_groups` that does not cut the replicas into equal groups,
  each within one worker."""
  if num_replicas % num_groups:
    divisors = [d for d in range(1, num_replicas + 1) if num_replicas % d == 0]
    raise ValueError(
        f"Expected `sync_groups` to divide the {num_replicas} replicas into "
        f"groups of equal size. Received: sync_groups={num_groups}. Pass one "
        f"of {divisors}.")
  size = num_replicas // num_groups
  if local_replicas % size:
    raise ValueError(
        f"Each sync group must lie within one worker: sync_groups="
        f"{num_groups} makes groups of {size} replicas, but each worker has "
        f"{local_replicas}. Pass sync_groups={num_replicas // local_replicas}"
        f" (one group per worker) or a multiple of it.")


def _each_group(name, declared):
  """The collective `name` of `protocol.Collectives` (`declared`), each sync
  group's own: every group's part of the value, through its communicator."""
  wrap_class = (tfi.values.Mirrored
                if getattr(declared, "same_on_every_replica", False)
                else tfi.values.PerReplica)

  def call(self, value, *args, **kwargs):
    return _joined([getattr(group, name)(part, *args, **kwargs)
                    for group, part in zip(self.groups, self.split(value))],
                   wrap_class)

  call.__name__ = name
  call.__doc__ = f"`protocol.Collectives.{name}` within each sync group."
  return call


@protocol.forwarded(protocol.Collectives, _each_group)
class GroupedCommunicator(protocol.Collectives):
  """`everyone`'s replicas in `num_groups` sync groups, each exchanging alone.

  Its collectives (`protocol.Collectives`) run within each group: all but
  `ops_for`, group by group from the protocol itself.

  Attributes:
    everyone: the communicator among every replica of every group.
    round_ops: the all-reduce among every replica that the averaging rounds
      use (`everyone`'s own in one process); `round_ops_on` gives theirs
      among the devices of a split weight's parts or a sharded one's shards.
    groups: one `Communicator` per sync group of this worker, over its slice
      of the devices, in replica order.
    local_groups: the communicator among this worker's replicas, every
      group on it and no other worker (`everyone` in one process).
    num_replicas: replicas in one group (`num_replicas_in_sync`).
    num_sync_groups: how many groups, over every worker.

  Anything else (the devices, the host, the cluster, input contexts, the
  first value of a variable) is `everyone`'s.
  """

  def __init__(self, everyone, num_groups, make_group, make_round_ops=None):
    """`make_group(devices)`: the `Communicator` of one group's devices;
    `make_round_ops(devices)`: the rounds' all-reduce among values on this
    worker's `devices` and every other worker's (None: `everyone`'s own)."""
    check_divides(num_groups, everyone.num_replicas, len(everyone.devices))
    self.everyone = everyone
    self._make_group = make_group
    self._on_devices = {}
    self._make_round_ops = make_round_ops
    self._round_ops = {}
    self.round_ops = self.round_ops_on(everyone.devices)
    self.num_sync_groups = num_groups
    self.num_replicas = everyone.num_replicas // num_groups
    n = self.num_replicas
    self.groups = tuple(
        make_group(everyone.devices[i:i + n])
        for i in range(0, len(everyone.devices), n))
    # Made here, not when first used: collectives between workers number
    # their groups from one counter per process, in the order made.
    if everyone.num_workers == 1:
      self.local_groups = everyone
    elif len(self.groups) == 1:
      self.local_groups = self.groups[0]
    else:
      self.local_groups = make_group(everyone.devices)
    self._replica_devices = {tfi.device_util.resolve(d)
                             for d in everyone.devices}
    self.cross_device_ops = GroupedOps(self)
    self.replica_collectives = GroupedReplicaCollectives(self)

  def __getattr__(self, name):
    # Only reached for what this class does not define: the worker's.
    return getattr(self.everyone, name)

  def round_ops_on(self, devices):
    """The rounds' all-reduce among values on this worker's `devices`, one
    per local replica (or group), and every other worker's: made once."""
    devices = tuple(tfi.device_util.resolve(d) for d in devices)
    if devices not in self._round_ops:
      self._round_ops[devices] = (
          self._make_round_ops(devices) if self._make_round_ops else
          self.everyone.cross_device_ops)
    return self._round_ops[devices]

  def on_devices(self, devices):
    """The same groups, exchanging values on other devices (each replica's
    logical device j): a `GroupedCommunicator` over `everyone.on_devices`,
    each group alone, its rounds' all-reduces this one's. Made once per
    `devices`; itself for its own."""
    key = tuple(devices)
    if key == self.everyone.devices:
      return self
    if key not in self._on_devices:
      self._on_devices[key] = GroupedCommunicator(
          self.everyone.on_devices(devices), self.num_sync_groups,
          self._make_group, self.round_ops_on)
    return self._on_devices[key]

  def describe(self):
    return (f"{self.everyone.describe()}, in {self.num_sync_groups} sync "
            f"groups of {self.num_replicas}")

  def group_of(self, local_index):
    """(the group's `Communicator`, the index within it) of a local replica."""
    return (self.groups[local_index // self.num_replicas],
            local_index % self.num_replicas)

  def split(self, value):
    """A distributed `value` of every local replica, as one per group."""
    parts = per_replica.parts(value)
    n = self.num_replicas
    return [per_replica.wrap(parts[i:i + n]) for i in range(0, len(parts), n)]

  def spans_replicas(self, value, destinations):
    """Whether `value` is every local replica's, going back to them.

    Decided by `destinations` (the values' own devices, or a variable's): a
    part made eagerly (a broadcast's zeros) may sit on another device.
    """
    return (isinstance(value, tf.distribute.DistributedValues) and
            len(value.values) == len(self.devices) and
            set(tfi.cross_device_ops.get_devices_from(destinations)) ==
            self._replica_devices)

  def ops_for(self, value, destinations):
    del value, destinations
    return self.cross_device_ops

  @property
  def gather_ops(self):
    return self.cross_device_ops

  def reduce_across_groups(self, reduce_op, values, local=False):
    """Each of the per-replica `values` reduced over every replica of every
    group (the exchange between groups), or with `local` of every group on
    this worker, back on the replicas."""
    among = self.local_groups if local else self.everyone
    return [among.ops_for(v, v).reduce(reduce_op, v, v) for v in values]


class GroupedOps(tf.distribute.CrossDeviceOps):
  """Reductions and gathers of every local replica's values, group by group.

  A value going back to the replicas is reduced within each group: the
  result, a `Mirrored`, holds each group's own on its replicas. Other
  destinations (one device) get the reduction over every replica.
  """

  def __init__(self, grouped):
    super().__init__()
    self._grouped = grouped

  def reduce_implementation(self, reduce_op, per_replica_value, destinations,
                            options):
    grouped = self._grouped
    if not grouped.spans_replicas(per_replica_value, destinations):
      return grouped.everyone.ops_for(per_replica_value, destinations).reduce(
          reduce_op, per_replica_value, destinations, options)
    return _joined([
        group.ops_for(part, part).reduce(reduce_op, part, part, options)
        for group, part in zip(grouped.groups, grouped.split(per_replica_value))
    ], tfi.values.Mirrored)

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs,
                                  options):
    grouped = self._grouped
    if not all(grouped.spans_replicas(v, d)
               for v, d in value_destination_pairs):
      return [self.reduce_implementation(reduce_op, v, d, options)
              for v, d in value_destination_pairs]
    per_group = [grouped.split(v) for v, _ in value_destination_pairs]
    reduced = [
        _group_batch_reduce(group, reduce_op, [parts[g] for parts in per_group],
                            options)
        for g, group in enumerate(grouped.groups)]
    return [_joined([results[i] for results in reduced], tfi.values.Mirrored)
            for i in range(len(value_destination_pairs))]

  def broadcast_implementation(self, tensor, destinations):
    return self._grouped.everyone.ops_for(tensor, None).broadcast(
        tensor, destinations)

  def _gather_implementation(self, per_replica_value, destinations, axis,
                             options):
    grouped = self._grouped
    if not grouped.spans_replicas(per_replica_value, destinations):
      return tfi.gather(grouped.everyone.gather_ops, per_replica_value,
                        destinations, axis, options)
    return _joined([
        tfi.gather(group.gather_ops, part, part, axis, options)
        for group, part in zip(grouped.groups, grouped.split(per_replica_value))
    ], tfi.values.Mirrored)


def _group_batch_reduce(group, reduce_op, parts, options):
  """One group's reduction of several values, batched where one op serves."""
  ops = group.cross_device_ops
  if all(group.ops_for(p, p) is ops for p in parts):
    return ops.batch_reduce(reduce_op, [(p, p) for p in parts], options)
  return [group.ops_for(p, p).reduce(reduce_op, p, p, options) for p in parts]


def _joined(per_group, wrap_class=tfi.values.PerReplica):
  """One distributed value from each group's, in replica order."""
  return tfi.distribute_utils.regroup(
      [part for value in per_group for part in per_replica.parts(value)],
      wrap_class=wrap_class, always_wrap=True)


def _in_own_group(name, declared):
  """The run-time collective `name` (`declared`) among the replicas of
  `local_index`'s group."""
  del declared  # Every launched collective takes the local index first.

  def call(self, local_index, *args):
    group, index = self._grouped.group_of(local_index)
    return getattr(group.replica_collectives, name)(index, *args)

  call.__name__ = name
  call.__doc__ = (f"`protocol.LaunchedCollectives.{name}` among the "
                  f"replicas of `local_index`'s group.")
  return call


@protocol.forwarded(protocol.LaunchedCollectives, _in_own_group)
class GroupedReplicaCollectives(protocol.LaunchedCollectives):
  """Run-time collectives (inside control flow) within each sync group:
  `protocol.LaunchedCollectives`, by a local replica index, each from the
  protocol itself."""

  def __init__(self, grouped):
    self._grouped = grouped
