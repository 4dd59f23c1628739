"""Collectives between workers: TF's collective ops over gRPC, keyed to work in loops.

Two kinds, both among every worker of a cluster:
- `KeyedCollectiveOps`: the `tf.distribute.CrossDeviceOps` that reduces and
  gathers per-replica values across workers, hierarchically (this worker's
  replicas first, then one value per worker).
- `WorkerBroadcast`: the chief's value of a tensor to every worker (the
  initial value of each variable).

A ReplicatorStrategy over several workers all-reduces with
`KeyedCollectiveOps` (its `extended.communicator.cross_device_ops`); with a
single worker there is nothing for them to do, so they have no example here:
tests/end_to_end/test_multi_worker.py runs them on 2 workers x 2 replicas.
"""

import itertools

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy.collectives import packing
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.collectives import replica_collectives

ReduceOp = reduce_op_lib.ReduceOp

# A value whose gather between workers holds at most this many bytes is
# reduced from the gather: one ring step instead of two between 2 workers.
# Measured on 2 workers over loopback: 8 bytes 1.5 ms gathered, 2.7 ms
# all-reduced; 64 KiB 1.4 and 1.8 ms; 256 KiB even; 2.7 MB 7.8 and 6.9 ms.
GATHER_BYTES = 128 * 1024


class KeyedCollectiveOps(tf.distribute.CrossDeviceOps):
  """TF's collective ops across workers, keyed by `ReplicaCollectives` in graphs.

  TF's own `CollectiveAllReduce` draws instance keys at call time, which
  fails inside a while loop's `tf.cond` (Keras's `steps_per_execution` loop
  runs `strategy.run` exactly there). In a graph, this launches collectives
  with counter-drawn keys instead; eagerly it hands over to `eager_ops`, TF's
  `CollectiveAllReduce` over the same replicas, untimed (a timed launch holds
  a thread for the whole timeout), its wait bounded by the watchdog.

  Reductions in a graph are hierarchical: this worker's replicas are reduced
  on its first device, that one value per worker is all-reduced among the
  workers, and the result is copied to the destinations. A ring over all
  replicas would take 2 x (replicas - 1) steps, most of them crossing
  between workers; this takes 2 x (workers - 1). A batch of values crosses
  in as few collectives as `packing.packed_all_reduce` allows (one per dtype
  up to `bytes_per_pack`): each collective between workers costs round
  trips whatever its size. A small one is gathered and reduced on each
  worker (`GATHER_BYTES`): workers - 1 ring steps. Gathers launch one
  collective per local replica.
  """

  def __init__(self, devices, group_size, timeout_seconds, eager_ops):
    super().__init__()
    self._devices = tuple(devices)
    self._group_size = group_size
    self._collectives = replica_collectives.ReplicaCollectives(
        devices, group_size, timeout_seconds)
    self._across_workers = replica_collectives.ReplicaCollectives(
        self._devices[:1], self._num_between_graph_workers, timeout_seconds,
        what=f"collectives among {self._num_between_graph_workers} workers")
    self._eager_ops = eager_ops
    self._timeout = timeout_seconds

  def _handed_over(self, what, call):
    """`call()` on `eager_ops`, its eager wait bounded by the watchdog."""
    if not tf.executing_eagerly():
      return call()
    with collective_watchdog.waiting(
        f"an eager {what} across {self._num_between_graph_workers} workers",
        self._timeout):
      return call()

  @property
  def _num_between_graph_workers(self):
    return self._group_size // len(self._devices)

  def _keyed(self, values):
    return not tf.executing_eagerly() and all(
        len(v.values) == len(self._devices) for v in values)

  def _per_device(self, values, destinations, launch, keys_per_value):
    """`launch(local_index, tensors, keys)` on every local replica's parts."""
    graph = tf.compat.v1.get_default_graph()
    results = []
    for i in range(len(self._devices)):
      keys = self._collectives.draw_keys(i, keys_per_value * len(values),
                                         graph)
      results.append(launch(i, [v.values[i] for v in values], keys))
    return [_placed(parts, d) for parts, d in zip(zip(*results), destinations)]

  def reduce_implementation(self, reduce_op, per_replica_value, destinations,
                            options):
    if not self._keyed([per_replica_value]):
      return self._handed_over(
          "reduce", lambda: self._eager_ops.reduce_implementation(
              reduce_op, per_replica_value, destinations, options))
    return self.batch_reduce_implementation(
        reduce_op, [(per_replica_value, destinations)], options)[0]

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs,
                                  options):
    values = [v for v, _ in value_destination_pairs]
    if not self._keyed(values):
      return self._handed_over(
          "reduce", lambda: self._eager_ops.batch_reduce_implementation(
              reduce_op, value_destination_pairs, options))
    op = reduce_op_lib.parse(reduce_op)
    across = ReduceOp.SUM if op == ReduceOp.MEAN else op

    def among_workers(tensors):
      keys = self._across_workers.draw_keys(
          0, len(tensors), tf.compat.v1.get_default_graph())
      return [self._reduce_one(across, t, key) for t, key in zip(tensors, keys)]

    with tf.device(self._devices[0]):
      local = [reduce_op_lib.reduce_parts(across, v.values) for v in values]
      reduced = packing.packed_all_reduce(local, among_workers,
                                          packing.bucket_bytes(options))
    if op == ReduceOp.MEAN:
      with tf.device(self._devices[0]):
        # As TF's CollectiveAllReduce: integers divide into float64.
        reduced = [r / self._group_size for r in reduced]
    return [_placed([r], d)
            for r, (_, d) in zip(reduced, value_destination_pairs)]

  def _reduce_one(self, op, tensor, key):
    """`tensor` reduced among the workers: small ones through a gather."""
    across = self._across_workers
    tensor = tf.convert_to_tensor(tensor)
    small = (tensor.shape.is_fully_defined() and
             tensor.dtype in replica_collectives.GATHERED_DTYPES and
             tensor.shape.num_elements() * tensor.dtype.size *
             self._num_between_graph_workers <= GATHER_BYTES)
    launch = across.reduce_gathered if small else across.all_reduce
    return launch(0, op, [tensor], [key])[0]

  def reduce_scatter(self, reduce_op, per_replica_value, axis):
    """Slice g (of N along `axis`) of the reduction, on global replica g.

    Hierarchical, as the reductions: this worker's replicas are reduced on
    its first device, the workers reduce-scatter those values among them (an
    all-to-all then a local reduction: each worker sends (W-1)/W of the
    tensor, half of an all-reduce), and each local replica takes its slice
    of this worker's part. Returns this worker's slices, one per local
    replica, or None eagerly (no keyed collective there).
    """
    if not self._keyed([per_replica_value]):
      return None
    op = reduce_op_lib.parse(reduce_op)
    across = ReduceOp.SUM if op == ReduceOp.MEAN else op
    keys = self._across_workers.draw_keys(0, 1,
                                          tf.compat.v1.get_default_graph())
    with tf.device(self._devices[0]):
      local = reduce_op_lib.reduce_parts(across, per_replica_value.values)
    part, = self._across_workers.reduce_scatter(0, across, [local], [axis],
                                                keys)
    with tf.device(self._devices[0]):
      if op == ReduceOp.MEAN:
        part = part / self._group_size
      return tf.split(part, len(self._devices), axis=axis)

  def _gather_implementation(self, per_replica_value, destinations, axis,
                             options):
    if not self._keyed([per_replica_value]):
      return self._handed_over(
          "gather", lambda: tfi.gather_implementation(
              self._eager_ops, per_replica_value, destinations, axis,
              options))
    return self._per_device(
        [per_replica_value], [destinations],
        lambda i, tensors, keys: self._collectives.all_gather(
            i, tensors, axis, keys), replica_collectives.GATHER_KEYS)[0]


def _placed(parts, destinations):
  """Identical `parts` (one per local replica) as a Mirrored on `destinations`."""
  devices = tfi.cross_device_ops.get_devices_from(destinations)
  by_device = {tfi.device_util.canonicalize(p.device): p for p in parts}
  placed = []
  for device in devices:
    with tf.device(device):
      placed.append(tf.identity(by_device.get(device, parts[0])))
  return tfi.distribute_utils.regroup(placed, always_wrap=True,
                                      wrap_class=tfi.values.Mirrored)


class WorkerBroadcast:
  """Sends the chief's value of a tensor to every worker, once per call.

  Calls must come in the same order on every worker (as variable creation
  does: the same program creates the same variables in the same order).
  """

  def __init__(self, device, cluster, timeout_seconds):
    self._device = device
    self._cluster = cluster
    self._timeout = timeout_seconds
    self._group_key = replica_collectives.new_group_key()
    self._instance_keys = itertools.count(start=1)

  def from_chief(self, initial_value, dtype=None):
    """A callable giving the chief's `initial_value` (a tensor or callable)."""
    instance_key = next(self._instance_keys)

    def value_from_chief():
      with tf.device(self._device):
        value = initial_value() if callable(initial_value) else initial_value
        value = getattr(value, "wrapped_value", value)  # Restore-on-create.
        value = tf.convert_to_tensor(value, dtype=dtype)
        common = dict(group_size=self._cluster.num_workers,
                      group_key=self._group_key, instance_key=instance_key,
                      timeout=self._timeout)
        if self._cluster.is_chief:
          sent = tfi.collective_ops.broadcast_send_v2(value, **common)
          with tf.control_dependencies([sent]):
            return tf.identity(value)
        return tfi.collective_ops.broadcast_recv_v2(
            tf.shape(value), value.dtype, **common)

    return value_from_chief
