"""How this process's replicas exchange values: on their own, or with other workers.

Chosen once, when the strategy is made (`for_topology`): a `Communicator`
for one process, a `ClusterCommunicator` when `TF_CONFIG` or a cluster
resolver names several workers. The extended class, the replica context and
variable creation ask it, and nothing else asks whether there is a cluster.

What differs across workers: all-reduces reach every worker through TF's
collective ops (never the host path), a plain tensor in cross-replica context
is this worker's value (so it is reduced and gathered across workers, not
taken as every replica's), variables start from the chief's value, datasets
are sharded per worker, and ops without a device stay on this worker.

>>> comm = for_topology(("/cpu:0", "/cpu:1"), "auto", cluster=None,
...                     timeout_seconds=120)
>>> comm.num_replicas, comm.all_reduce_choice
(2, 'add_on_one_device: devices share host memory')
"""

import copy

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import all_reduce as all_reduce_lib
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy.collectives import per_replica
from replicator_strategy.collectives import protocol
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.collectives import worker_collectives
from replicator_strategy.sync_groups import topology


def for_topology(devices, all_reduce, cluster, timeout_seconds, sync_groups=1):
  """The communicator for this worker's `devices`, in `cluster` (or alone).

  With `sync_groups` > 1, a `sync_groups.topology.GroupedCommunicator`:
  exchanges within each group, the one chosen here between all of them.
  """
  if cluster:
    everyone = ClusterCommunicator(devices, all_reduce, cluster,
                                   timeout_seconds)
  else:
    everyone = Communicator(devices, all_reduce, timeout_seconds)
  if sync_groups == 1:
    return everyone

  def round_ops(round_devices):
    if cluster:
      return all_reduce_lib.across_workers(round_devices, cluster.num_workers,
                                           timeout_seconds)
    if round_devices == everyone_devices:
      return everyone.cross_device_ops
    return all_reduce_lib.choose(round_devices, all_reduce,
                                 timeout_seconds=timeout_seconds)[0]

  everyone_devices = tuple(tfi.device_util.resolve(d) for d in everyone.devices)
  return topology.GroupedCommunicator(
      everyone, sync_groups,
      lambda group_devices: Communicator(group_devices, all_reduce,
                                         timeout_seconds),
      make_round_ops=round_ops)


class Communicator(protocol.Collectives):
  """Replicas on this process's `devices`, no other worker.

  Its collectives (`ops_for`, `all_gather`, `reduce_scatter`, `all_to_all`)
  are `protocol.Collectives`'.

  Attributes:
    devices: this worker's replica devices, one replica each.
    host_device: the CPU of this worker, where input pipelines run.
    cross_device_ops: the all-reduce of per-replica values.
    all_reduce_choice: which all-reduce, and why.
    replica_collectives: collectives each replica launches itself (inside
      control flow), among every replica.
  """

  cluster = None
  num_sync_groups = 1
  num_workers = 1
  worker_index = 0
  is_chief = True
  # Ops with no device scope: TF's default placement.
  default_device = None

  def __init__(self, devices, all_reduce, timeout_seconds):
    self._all_reduce, self._timeout_seconds = all_reduce, timeout_seconds
    self.host_device = tfi.device_util.get_host_for_device(devices[0])
    self._exchange_on(devices)
    self._host_reduce_ops = tf.distribute.ReductionToOneDevice()
    self._on_devices = {}

  def _exchange_on(self, devices, what=None):
    """Sets the devices, one per local replica, and what exchanges among
    them and every worker's."""
    self.devices = tuple(devices)
    self.cross_device_ops, self.all_reduce_choice = all_reduce_lib.choose(
        self.devices, self._all_reduce, num_workers=self.num_workers,
        timeout_seconds=self._timeout_seconds)
    self.replica_collectives = replica_collectives.ReplicaCollectives(
        self.devices, self.num_replicas, self._timeout_seconds,
        what=what)

  @property
  def num_replicas(self):
    """Replicas in sync, over every worker."""
    return len(self.devices) * self.num_workers

  @property
  def shares_memory(self):
    """Whether every replica's device is in this process's host memory
    (logical CPUs, no other worker): a value on one of them is readable by
    all without a copy."""
    return self.num_workers == 1 and all(
        tf.DeviceSpec.from_string(d).device_type == "CPU" for d in self.devices)

  @property
  def first_replica_id(self):
    """The global id of this worker's first replica."""
    return self.worker_index * len(self.devices)

  def describe(self):
    return (f"{len(self.devices)} replica(s) on {', '.join(self.devices)}; "
            f"all-reduce {self.all_reduce_choice}")

  def ops_for(self, value, destinations):
    """The all-reduce for `value` (distributed or plain) onto `destinations`.

    The chosen algorithm, or the host path where it can't serve: NCCL cannot
    reduce int32, and destinations other than the values' own devices.
    """
    parts = (value.values if isinstance(value, tf.distribute.DistributedValues)
             else (value,))
    if any(tf.as_dtype(p.dtype) == tf.int32 for p in parts):
      return self._host_reduce_ops
    if destinations is not None and not tfi.devices_match(value,
                                                          destinations):
      return self._host_reduce_ops
    return self.cross_device_ops

  @property
  def timeout_seconds(self):
    """How long a replica waits in a collective before failing."""
    return self._timeout_seconds

  def on_devices(self, devices):
    """The same replicas, exchanging values on other devices: a communicator
    of this one's kind among `devices`, one per local replica (each
    replica's logical device j), with the same workers, in collective groups
    of its own. Made once per strategy and `devices`; itself for its own."""
    key = tuple(devices)
    if key == self.devices:
      return self
    if key not in self._on_devices:
      other = copy.copy(self)
      other._on_devices = {}  # pylint: disable=protected-access
      other._exchange_on(  # pylint: disable=protected-access
          devices,
          what=f"collectives among {self.num_replicas} replicas on {devices}")
      self._on_devices[key] = other
    return self._on_devices[key]

  @property
  def gather_ops(self):
    """The `CrossDeviceOps` that gathers per-replica values."""
    return self._host_reduce_ops

  def reduce_plain(self, reduce_op, value, destinations, options):
    """A plain tensor reduced in cross-replica context: every replica's value."""
    del options  # Nothing is exchanged.
    return tfi.cross_device_ops.reduce_non_distributed_value(
        reduce_op, value, destinations, self.num_replicas)

  def gather_plain(self, value, destinations, axis, options):
    """A plain tensor gathered in cross-replica context: this process's value."""
    del destinations, axis, options
    return value

  def reduce_scatter(self, value, op, axis):
    """Logical CPUs share one memory, so the fewest passes win: the parts are
    reduced once, on the first device, and cut there (measured faster than
    cutting on every device). Separate memories cut each part on its own
    device and reduce slice r on device r, so only slices move, each once.
    """
    if self.shares_memory:
      with tf.device(self.devices[0]):
        reduced = tf.split(
            reduce_op_lib.reduce_parts(op, per_replica.parts(value)),
            self.num_replicas, axis=axis)
      return per_replica.make(self.devices, lambda r: tf.identity(reduced[r]))
    pieces = self._cut(value, axis)
    return per_replica.make(
        self.devices, lambda r: reduce_op_lib.reduce_parts(
            op, [p[r] for p in pieces]))

  def all_gather(self, value, axis, options=None):
    """Through `gather_ops`, as TF gathers per-replica values."""
    return tfi.gather(self.gather_ops, _wrapped(value), _wrapped(value), axis,
                      options)

  def all_to_all(self, value, split_axis, concat_axis):
    """Each replica's part cut on its own device, slice j gathered on j."""
    pieces = self._cut(value, split_axis)
    return per_replica.make(
        self.devices,
        lambda j: tf.concat([p[j] for p in pieces], axis=concat_axis))

  def _cut(self, value, axis):
    """Each local replica's part of `value` in N slices, on its own device."""
    local = per_replica.parts(value)
    return per_replica.on_devices(
        self.devices, lambda r: tf.split(local[r], self.num_replicas, axis=axis))

  def initial_value(self, initial_value, dtype):
    """`initial_value` (a tensor or callable) of a new variable, unchanged."""
    del dtype
    return initial_value

  def dataset_input_context(self):
    """The `InputContext` that shards a dataset per worker; None alone."""
    return None

  def input_context(self):
    """This worker's input pipeline among every worker's."""
    return tf.distribute.InputContext(
        num_input_pipelines=self.num_workers,
        input_pipeline_id=self.worker_index,
        num_replicas_in_sync=self.num_replicas)

  def check_dataset(self, dataset):
    """Warns about a dataset that every worker would read whole."""
    del dataset


class ClusterCommunicator(Communicator):
  """Replicas on this worker's `devices`, with every worker of `cluster`.

  Every worker runs as many replicas; worker w holds global replicas
  w*M .. w*M+M-1 of N*M. Starting checks that every worker has as many.
  """

  def __init__(self, devices, all_reduce, cluster, timeout_seconds):
    self.cluster = cluster
    self.num_workers = cluster.num_workers
    self.worker_index = cluster.worker_index
    self.is_chief = cluster.is_chief
    # Ops without a device stay on this worker.
    self.default_device = cluster.task_name
    super().__init__(devices, all_reduce, timeout_seconds)
    collective_watchdog.share_stalls_across_workers(self.worker_index,
                                                    self.num_workers)
    # One value per worker, on each worker's host.
    self._worker_reduce_ops = all_reduce_lib.across_workers(
        [self.host_device], self.num_workers, timeout_seconds)
    self._broadcast = worker_collectives.WorkerBroadcast(
        self.host_device, cluster, timeout_seconds)
    self._check_same_replicas_per_worker()

  def describe(self):
    return (f"{super().describe()} (worker {self.worker_index} of "
            f"{self.num_workers})")

  def _check_same_replicas_per_worker(self):
    """Fails every worker, clearly, unless all have as many devices."""
    with tf.device(self.host_device):
      counts = self.gather_plain(tf.constant([len(self.devices)]),
                                 self.host_device, 0, None)
    if isinstance(counts, tf.distribute.DistributedValues):
      counts = counts.values[0]
    counts = [int(c) for c in counts]
    if len(set(counts)) > 1:
      raise ValueError(
          f"Every worker must replicate over as many devices; they have "
          f"{', '.join(f'worker {i}: {n}' for i, n in enumerate(counts))}. "
          f"Give each worker the same `devices` count (or the same number "
          f"of GPUs / split_cpu devices).")

  def ops_for(self, value, destinations):
    del value, destinations
    return self.cross_device_ops  # Only collectives reach every worker.

  @property
  def gather_ops(self):
    return self.cross_device_ops

  def reduce_plain(self, reduce_op, value, destinations, options):
    return self._worker_reduce_ops.reduce(
        reduce_op, value, destinations=destinations, options=options)

  def gather_plain(self, value, destinations, axis, options):
    return tfi.gather(self._worker_reduce_ops, value, destinations, axis,
                      options)

  def reduce_scatter(self, value, op, axis):
    """As one process's, reduced across every worker.

    In a graph, a hierarchical reduce-scatter (`KeyedCollectiveOps`): only
    slices cross between workers. Eagerly, SUM and MEAN all-reduce and MIN
    and MAX reduce a gather of every replica's value; each local replica
    then keeps its own slice.
    """
    value = _wrapped(value)
    keyed = getattr(self.cross_device_ops, "reduce_scatter", None)
    slices = keyed(op, value, axis) if keyed else None
    if slices is not None:
      return per_replica.make(self.devices, lambda i: tf.identity(slices[i]))
    if op.is_extremum:
      reduced = [reduce_op_lib.reduce_along(op, stack, 0)
                 for stack in self._every_replicas(value)]
    else:
      reduced = per_replica.parts(self.cross_device_ops.reduce(
          op.to_tf(), value, destinations=value))
    return per_replica.make(
        self.devices, lambda i: tf.split(
            reduced[i], self.num_replicas,
            axis=axis)[self.first_replica_id + i])

  def all_to_all(self, value, split_axis, concat_axis):
    """As one process's, from a gather of every replica's value.

    The gather reaches every worker but moves N times what an all-to-all
    needs; the run-time collectives (inside control flow) move only slices.
    """
    stacks = self._every_replicas(_wrapped(value))

    def received(i):
      j = self.first_replica_id + i
      return tf.concat(
          [tf.split(part, self.num_replicas, axis=split_axis)[j]
           for part in tf.unstack(stacks[i], num=self.num_replicas)],
          axis=concat_axis)

    return per_replica.make(self.devices, received)

  def _every_replicas(self, value):
    """[N, ...] on each local replica: every replica's part, in replica order."""
    stacked = per_replica.wrap([tf.expand_dims(p, 0) for p in value.values])
    return per_replica.parts(tfi.gather(self.cross_device_ops, stacked,
                                        destinations=value, axis=0))

  def initial_value(self, initial_value, dtype):
    """A callable giving the chief's `initial_value`: every worker starts equal."""
    return self._broadcast.from_chief(initial_value, dtype)

  def dataset_input_context(self):
    return self.input_context()

  def check_dataset(self, dataset):
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.OFF:
      logging.warning(
          "The dataset given to ReplicatorStrategy.experimental_distribute_"
          "dataset has AutoShardPolicy.OFF: each of the %d workers reads all "
          "of it, so every example is seen %d times per epoch. Shard it "
          "yourself (dataset.shard) or use AutoShardPolicy.DATA or FILE.",
          self.num_workers, self.num_workers)


def _wrapped(value):
  """`value` as a distributed value, even with one local replica."""
  return per_replica.wrap(per_replica.parts(value))
