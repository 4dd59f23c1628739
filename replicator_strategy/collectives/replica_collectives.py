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
min, max, gather, all-to-all) has its own group, so replicas that call
different kinds at the same point wait instead of mixing; the watchdog then
says so.

>>> collectives = ReplicaCollectives(("/cpu:0",), group_size=1)
>>> @tf.function
... def one_replica(x):
...   keys = collectives.draw_keys(0, 1, tf.compat.v1.get_default_graph())
...   return collectives.all_reduce(0, ReduceOp.SUM, [x], keys)[0]
>>> float(one_replica(tf.constant(2.0)))
2.0
"""

import itertools

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy.collectives import protocol
from replicator_strategy.collectives import reduce_op as reduce_op_lib

ReduceOp = reduce_op_lib.ReduceOp

# Instance keys each static signature cycles through: more than the launches
# of one signature that can be in flight on a device at once.
KEYS_PER_SIGNATURE = 1024
# Keys from here up are fresh keys for shapes unknown at trace time.
_FRESH_KEYS = 2**30

# Collective group keys are process-global: every group takes its own key
# range so that several strategies never collide.
_group_keys = itertools.count(start=1_000_000, step=1_000_000)

_GATHER = "gather"
_ALL_TO_ALL = "all_to_all"
# Each kind of collective meets in its own group (an offset from the base).
_GROUP_OFFSETS = {kind: i for i, kind in
                  enumerate((*ReduceOp, _GATHER, _ALL_TO_ALL))}


# Keys one all_gather takes per tensor: one for the sizes, one for the data.
GATHER_KEYS = 2

# The dtypes TF's gather kernel takes (no bfloat16, no bool).
GATHERED_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def new_group_key():
  return next(_group_keys)


class ReplicaCollectives(protocol.LaunchedCollectives):
  """Run-time collectives among `group_size` replicas, this worker's on `devices`.

  `protocol.LaunchedCollectives`: methods take the replica's index among
  this worker's `devices`. Waits are bounded by `timeout_seconds` through
  `collective_watchdog`.
  """

  def __init__(self, devices, group_size,
               timeout_seconds=collective_watchdog.DEFAULT_TIMEOUT_SECONDS,
               what=None):
    self._devices = tuple(devices)
    self._group_size = group_size
    self._group_key = new_group_key()
    self._progress = collective_watchdog.Progress(
        self._devices, timeout_seconds,
        what or f"collectives among {group_size} replicas", group_size)

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
    merge_op, final_op = op.collective_merge_and_final_ops
    return [
        self._launch(
            local_index, op,
            lambda *a, **k: tfi.collective_ops.all_reduce_v2(
                *a, merge_op=merge_op, final_op=final_op, **k),
            t, key)
        for t, key in zip(tensors, keys)
    ]

  def reduce_gathered(self, local_index, op, tensors, keys):
    """As `all_reduce`, from a gather of every replica's tensor: N - 1 ring
    steps instead of 2 (N - 1), N / 2 times the bytes each way, and every
    replica adds in the same order. Faster for small tensors, whose steps
    cost their latency, not their bytes. Static shapes of the dtypes TF
    gathers (`GATHERED_DTYPES`) only; a key each."""
    return [
        reduce_op_lib.reduce_along(op, self._launch(
            local_index, _GATHER, tfi.collective_ops.all_gather_v2,
            tf.expand_dims(t, 0), key), 0)
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
      # TF's gather kernel has no bfloat16; a gather only moves bits, so
      # they travel as float16's.
      carried = moved.dtype
      if carried == tf.bfloat16:
        moved = tf.bitcast(moved, tf.float16)
      gather = tfi.collective_ops.all_gather_v2
      size = tf.shape(moved)[:1]
      sizes = self._launch(local_index, _GATHER, gather, size, size_key)
      largest = tf.reduce_max(sizes)
      padding = tf.concat([[[0, largest - size[0]]],
                           tf.zeros([tf.rank(moved) - 1, 2], tf.int32)], 0)
      gathered = self._launch(local_index, _GATHER, gather,
                              tf.pad(moved, padding), key)
      rows = tf.reshape(tf.sequence_mask(sizes, largest), [-1])
      gathered = tf.boolean_mask(gathered, rows)
      if gathered.dtype != carried:
        gathered = tf.bitcast(gathered, carried)
      out.append(tf.experimental.numpy.moveaxis(gathered, 0, axis))
    return out

  def all_to_all(self, local_index, tensors, split_axes, concat_axes, keys):
    """Slice j (of N along its split axis) of each tensor to replica j.

    Each replica concatenates the slices it receives, in replica order, along
    the concat axis. One key per tensor.
    """
    return [
        tf.concat(tf.unstack(self._exchange_slices(local_index, t, split,
                                                   key)), axis=concat)
        for t, split, concat, key in zip(tensors, split_axes, concat_axes,
                                         keys)
    ]

  def reduce_scatter(self, local_index, op, tensors, axes, keys):
    """Slice r (of N along its axis) of each tensor reduced over replicas, on r.

    Built as an all-to-all, then a local reduction of the N slices received:
    TF has no reduce-scatter kernel on CPU, and this moves (N-1)/N of a
    tensor per replica, half of what an all-reduce (then a slice) moves.
    One key per tensor.
    """
    return [
        reduce_op_lib.reduce_along(
            op, self._exchange_slices(local_index, t, axis, key), 0)
        for t, axis, key in zip(tensors, axes, keys)
    ]

  def _exchange_slices(self, local_index, tensor, axis, key):
    """[N, ...]: slice r (of N along `axis`) of every replica's `tensor`, here
    on replica r, stacked in replica order."""
    n = self._group_size
    moved = tf.experimental.numpy.moveaxis(tf.convert_to_tensor(tensor),
                                           axis, 0)
    if moved.shape.is_fully_defined():
      shape = [n, moved.shape[0] // n, *moved.shape[1:]]
    else:
      shape = tf.concat([[n, -1], tf.shape(moved)[1:]], 0)
    # CollectiveAllToAllV2 sends row i of its input to replica i.
    received = self._launch(local_index, _ALL_TO_ALL,
                            tfi.collective_ops.all_to_all_v2,
                            tf.reshape(moved, shape), key)
    return tf.experimental.numpy.moveaxis(received, 1, axis + 1)


def _signature(kind, tensor):
  """What a launch is, as the watchdog reports it: "all_reduce SUM float32[10]"."""
  name = ({_GATHER: "all_gather", _ALL_TO_ALL: "all_to_all"}.get(kind) or
          f"all_reduce {kind.value}")
  shape = tensor.shape.as_list() if tensor.shape.rank is not None else "[?]"
  return f"{name} {tensor.dtype.name}{shape}"


def check_in_function(home_graph):
  """Refuses run-time collectives where strategy.run is traced in a TF1 graph.

  Their launch counters live in the function graph strategy.run is traced in
  (`collective_watchdog.Progress.draw`); a TF1 graph, run by a Session, has
  none of the captures they need.
  """
  if not isinstance(home_graph, tfi.FuncGraph):
    raise NotImplementedError(
        "A cross-replica collective (all_reduce, all_gather, broadcast, "
        "reduce_scatter, all_to_all, or a variable update that aggregates) "
        "was called inside a tf.cond (or a nested tf.function) of the "
        "function passed to strategy.run, in a TF1 graph (tf.Graph run by a "
        "tf.compat.v1.Session). There each replica launches its own "
        "collectives, which needs a tf.function: run the step in a "
        "tf.function, or call the collective outside the tf.cond (there "
        "collectives work in TF1 graphs too).")


def check_not_in_replica_loop(home_graph):
  """Refuses collectives in a while loop that each replica runs on its own."""
  graph = tf.compat.v1.get_default_graph()
  while graph is not home_graph and graph is not None:
    if isinstance(graph, tfi.WHILE_LOOP_GRAPHS):
      raise NotImplementedError(
          "A cross-replica collective (all_reduce, all_gather, broadcast, "
          "reduce_scatter, all_to_all, or a variable update that "
          "aggregates) was called inside a tf.while_loop written inside the "
          "function passed to strategy.run. Each replica runs its own copy "
          "of such a loop, and TensorFlow's collective ops only meet within "
          "one loop. Put the loop around strategy.run instead (call "
          "strategy.run in each iteration), or "
          "all-reduce once after the loop.")
    graph = getattr(graph, "outer_graph", None)
