"""Collectives each replica launches by itself: the path inside control flow.

`merge_call` gathers the replica threads at one point of one graph. Inside a
`tf.cond` branch (or a nested `tf.function`) every replica traces its own
graph, so there is no point where all of them meet; Keras's EMA overwrite,
gradient accumulation and loss scaling call for all-reduces and updates
exactly there. In such places each replica launches TF collective ops that
meet at run time instead.

Launches meet by instance key. Each replica numbers its launches in program
order (`collective_watchdog.Progress`), so the n-th launch of every replica
agrees (TF's own call-time keys can't be captured inside control flow, and
keys fixed at trace time clash between loop iterations). TF keeps a record
per instance key for the life of the process and fixes its shape at first
use, so a collective of a static shape takes its key from a cycle of
`KEYS_PER_SIGNATURE` reserved for its signature (op, dtype, shape): memory
stays bounded however long the run. Only a collective whose shape is unknown
when traced (a gather of a partial batch) takes a fresh key each launch,
about half a KiB of TF's memory each. Each kind of collective (sum, mean,
min, max, gather) has its own group, so replicas that call different kinds
at the same point wait instead of mixing; the watchdog then says so.

>>> # inside a tf.cond branch, in one replica's trace of strategy.run:
>>> keys = strategy.extended.collectives.draw_keys(local_index, 1, home_graph)
>>> strategy.extended.collectives.all_reduce(local_index, ReduceOp.SUM, [g], keys)
"""

import itertools

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import collective_watchdog
from replicator_strategy import reduce_op as reduce_op_lib

ReduceOp = reduce_op_lib.ReduceOp

# A replica that never arrives (a branch taken on some replicas only, a
# worker that died) fails the step after this long instead of hanging it.
TIMEOUT_SECONDS = 120

# Instance keys each static signature cycles through: more than the launches
# of one signature that can be in flight on a device at once.
KEYS_PER_SIGNATURE = 1024
# Keys from here up are fresh keys for shapes unknown at trace time.
_FRESH_KEYS = 2**30

# Collective group keys are process-global: every group takes its own key
# range so that several strategies never collide.
_group_keys = itertools.count(start=1_000_000, step=1_000_000)

_MERGE_OPS = {
    ReduceOp.SUM: ("Add", "Id"),
    ReduceOp.MEAN: ("Add", "Div"),
    ReduceOp.MIN: ("Min", "Id"),
    ReduceOp.MAX: ("Max", "Id"),
}
_GATHER = "gather"
# Each kind of collective meets in its own group (an offset from the base).
_GROUP_OFFSETS = {kind: i for i, kind in enumerate((*_MERGE_OPS, _GATHER))}


# Keys one all_gather takes per tensor: one for the sizes, one for the data.
GATHER_KEYS = 2


def new_group_key():
  return next(_group_keys)


class ReplicaCollectives:
  """Run-time collectives among `group_size` replicas, this worker's on `devices`.

  Methods take the replica's index among this worker's `devices`. Waits are
  bounded by `timeout_seconds` through `collective_watchdog`.
  """

  def __init__(self, devices, group_size, timeout_seconds=TIMEOUT_SECONDS,
               what=None):
    self._devices = tuple(devices)
    self._group_size = group_size
    self._group_key = new_group_key()
    self._progress = collective_watchdog.Progress(
        self._devices, timeout_seconds,
        what or f"collectives among {group_size} replicas")

  def draw_keys(self, local_index, count, home_graph):
    """`count` launches for this replica's next collectives, in program order."""
    return self._progress.draw(local_index, count, home_graph)

  def _launch(self, local_index, kind, collective, tensor, launch):
    tensor = tf.convert_to_tensor(tensor)
    signature = _signature(kind, tensor)
    with tf.device(self._devices[local_index]):
      if tensor.shape.is_fully_defined():
        # Codes follow first use in this process: the same program on every
        # worker draws them in the same order (else keys differ, the launches
        # wait, and the watchdog says where).
        code = collective_watchdog.signature_code(signature)
        key = (code * KEYS_PER_SIGNATURE + 1 +
               tf.math.floormod(launch.number, KEYS_PER_SIGNATURE))
      else:
        key = _FRESH_KEYS + tf.math.floormod(launch.number, _FRESH_KEYS)
      # TF's collective kernels need a resource input on their device. It is
      # made in place: a gradient graph must not capture eager handles.
      token = tf.raw_ops.VarHandleOp(
          dtype=tf.float32, shape=[],
          shared_name=f"replicator_token_{self._group_key}_{local_index}")
      result = collective_watchdog.Progress.run(
          launch, signature,
          lambda: collective(tensor, self._group_size,
                             self._group_key + _GROUP_OFFSETS[kind], key,
                             ordering_token=token))
    # Collective ops have no registered gradient; differentiable callers
    # wrap them in a custom gradient (ReplicaContext).
    return tf.stop_gradient(result)

  def all_reduce(self, local_index, op, tensors, keys):
    """Each of `tensors` reduced with `op` over all replicas; a key each."""
    merge_op, final_op = _MERGE_OPS[op]
    return [
        self._launch(
            local_index, op,
            lambda *a, **k: tfi.collective_ops.all_reduce_v2(
                *a, merge_op=merge_op, final_op=final_op, **k),
            t, key)
        for t, key in zip(tensors, keys)
    ]

  def all_gather(self, local_index, tensors, axis, keys):
    """Each of `tensors` concatenated over all replicas along `axis`.

    Sizes along `axis` may differ between replicas (a partial batch): the
    sizes are gathered first and the parts padded to the largest. Takes
    `GATHER_KEYS` keys per tensor.
    """
    out = []
    for i, tensor in enumerate(tensors):
      size_key, key = keys[GATHER_KEYS * i:GATHER_KEYS * (i + 1)]
      moved = tf.experimental.numpy.moveaxis(tf.convert_to_tensor(tensor),
                                             axis, 0)
      gather = tfi.collective_ops.all_gather_v2
      size = tf.shape(moved)[:1]
      sizes = self._launch(local_index, _GATHER, gather, size, size_key)
      largest = tf.reduce_max(sizes)
      padding = tf.concat([[[0, largest - size[0]]],
                           tf.zeros([tf.rank(moved) - 1, 2], tf.int32)], 0)
      gathered = self._launch(local_index, _GATHER, gather,
                              tf.pad(moved, padding), key)
      rows = tf.reshape(tf.sequence_mask(sizes, largest), [-1])
      out.append(tf.experimental.numpy.moveaxis(
          tf.boolean_mask(gathered, rows), 0, axis))
    return out


def _signature(kind, tensor):
  """What a launch is, as the watchdog reports it: "all_reduce SUM float32[10]"."""
  name = "all_gather" if kind == _GATHER else f"all_reduce {kind.value}"
  shape = tensor.shape.as_list() if tensor.shape.rank is not None else "[?]"
  return f"{name} {tensor.dtype.name}{shape}"


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
  between workers; this takes 2 x (workers - 1). Gathers launch one
  collective per local replica.
  """

  def __init__(self, devices, group_size, timeout_seconds, eager_ops):
    super().__init__()
    self._devices = tuple(devices)
    self._group_size = group_size
    self._collectives = ReplicaCollectives(devices, group_size,
                                           timeout_seconds)
    self._across_workers = ReplicaCollectives(
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
    keys = self._across_workers.draw_keys(
        0, len(values), tf.compat.v1.get_default_graph())
    with tf.device(self._devices[0]):
      local = [_reduce_parts(across, v.values) for v in values]
    reduced = self._across_workers.all_reduce(0, across, local, keys)
    if op == ReduceOp.MEAN:
      with tf.device(self._devices[0]):
        # As TF's CollectiveAllReduce: integers divide into float64.
        reduced = [r / self._group_size for r in reduced]
    return [_placed([r], d)
            for r, (_, d) in zip(reduced, value_destination_pairs)]

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
            i, tensors, axis, keys), GATHER_KEYS)[0]


def _reduce_parts(op, parts):
  """The local replicas' `parts` reduced with SUM, MIN or MAX."""
  parts = [tf.convert_to_tensor(p) for p in parts]
  if op == ReduceOp.SUM:
    return tf.add_n(parts)
  return reduce_op_lib.reduce_along(op, tf.stack(parts), 0)


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

  def __init__(self, device, cluster, timeout_seconds=TIMEOUT_SECONDS):
    self._device = device
    self._cluster = cluster
    self._timeout = timeout_seconds
    self._group_key = new_group_key()
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


def check_not_in_replica_loop(home_graph):
  """Refuses collectives in a while loop that each replica runs on its own."""
  graph = tf.compat.v1.get_default_graph()
  while graph is not home_graph and graph is not None:
    if isinstance(graph, tfi.WHILE_LOOP_GRAPHS):
      raise NotImplementedError(
          "A cross-replica collective (all_reduce, all_gather, broadcast, or "
          "a variable update that aggregates) was called inside a "
          "tf.while_loop written inside the function passed to strategy.run. "
          "Each replica runs its own copy of such a loop, and TensorFlow's "
          "collective ops only meet within one loop. Put the loop around "
          "strategy.run instead (call strategy.run in each iteration), or "
          "all-reduce once after the loop.")
    graph = getattr(graph, "outer_graph", None)
