"""The replica context: TF-Replicator's collectives inside `strategy.run`.

Each replica runs the user's function in its own thread (`replica_runner`);
`merge_call` is the rendezvous where all replicas meet. Inside control flow
(a `tf.cond` branch, a nested `tf.function`) the replicas trace separate
graphs and cannot meet, so there collectives are launched per replica
instead (`replica_collectives`); in a `tf.while_loop` of the replica
function they are refused (`replica_collectives.check_not_in_replica_loop`).
On top of `tf.distribute.ReplicaContext` this adds MIN/MAX all-reduce,
`broadcast`, `reduce_scatter`, `all_to_all` and `map_gather`, all
differentiable, on both paths (example: `ReplicaContext`).

`ReplicaContext` holds the collectives, each with its gradient; the traced
exchange under them is `collectives.exchange`, their merge functions
`collectives.merged`, and a replica's rows of the global batch `batch_rows`.

Design after TF-Replicator (Buchlovsky et al., 2019, arXiv:1902.00465).
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import batch_rows as batch_rows_lib
from replicator_strategy.collectives import checks
from replicator_strategy.collectives import exchange
from replicator_strategy.collectives import merged
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.collectives import reduce_op as reduce_op_lib


class ReplicaContext(tfi.ThreadReplicaContext):
  """`tf.distribute.ReplicaContext` with MIN/MAX all-reduce, broadcast,
  reduce-scatter, all-to-all and map_gather.

  What `tf.distribute.get_replica_context()` returns inside `strategy.run`:

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy()
  >>> def step():
  ...   ctx = tf.distribute.get_replica_context()
  ...   x = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
  ...   return ctx.all_reduce("max", x), ctx.broadcast(x + 10.0)
  >>> strategy.experimental_local_results(strategy.run(step))[0]
  (<tf.Tensor: ... numpy=3.0>, <tf.Tensor: ... numpy=10.0>)
  """

  def __init__(self, strategy, replica_id_in_sync_group, inputs=(), worker_counts=None):
    super().__init__(strategy, replica_id_in_sync_group)
    # Where strategy.run traces this replica: where the replicas can merge.
    self.home_graph = tf.compat.v1.get_default_graph()
    self._rows = batch_rows_lib.Counter(inputs, worker_counts)

  def _merge_call(self, fn, args, kwargs):
    signature, checked = checks.same_merge(fn)
    return tfi.base_merge_call(self, checked, (signature,) + tuple(args),
                               kwargs)

  def merge_call(self, merge_fn, args=(), kwargs=None):
    """`tf.distribute.ReplicaContext.merge_call`, from replica context only.

    `merge_fn` runs in cross-replica context: there, as in every TF strategy,
    `tf.distribute.get_replica_context()` is None, and a replica context
    captured before is refused with a RuntimeError.
    """
    checks.refuse_cross_replica_context("merge_call")
    return super().merge_call(merge_fn, args, kwargs)

  def all_reduce(self, reduce_op, value, options=None):
    """All-reduces a nested structure with "sum", "mean", "min" or "max".

    Accepts strings, `tf.distribute.ReduceOp` and `replicator_strategy.ReduceOp`.
    Gradients: SUM/MEAN as in TF; MIN/MAX send the summed upstream gradient to
    the replicas holding the extremum, split evenly among ties.
    """
    checks.refuse_cross_replica_context("all_reduce")
    op = reduce_op_lib.parse(reduce_op)
    checks.reject_none(value, "value", "ReplicaContext.all_reduce")
    # Python numbers become each replica's own tensor. A tensor made outside
    # strategy.run stays one object: SUM and MEAN take it, as MirroredStrategy
    # and Keras's tests do, for a value already all-reduced.
    value = tf.nest.map_structure(
        lambda v: v if tf.is_tensor(v) else tf.convert_to_tensor(v), value)
    if (self.can_merge and not op.is_extremum and
        merged.has_indexed_slices(value)):
      # TF's path keeps IndexedSlices sparse (it has no gradient).
      return super().all_reduce(op.to_tf(), value, options)
    flat = [tf.convert_to_tensor(v) for v in tf.nest.flatten(value)]
    if op.is_extremum:
      ys = exchange.exchange(
          self,
          lambda strategy, *values: merged.reduce_extremum(strategy, values, op),
          lambda keys, values: self._collectives.all_reduce(
              self.local_index, op, values, keys),
          flat,
          grad=lambda xs, ys, dys: reduce_op_lib.extremum_gradient(
              xs, ys, dys, lambda ts: self.all_reduce("sum", ts)))
    else:
      ys = exchange.exchange(
          self,
          lambda strategy, *values: merged.all_reduce(strategy, values, op,
                                                      options),
          lambda keys, values: self._collectives.all_reduce(
              self.local_index, op, values, keys),
          flat, grad=lambda xs, ys, dys: self.all_reduce(op, dys))
    return tf.nest.pack_sequence_as(value, ys)

  def broadcast(self, value, source_replica_id=0):
    """Every replica gets `source_replica_id`'s value of a nested structure.

    The gradient of the result flows back, summed over replicas, to the
    source replica's input; the other replicas' inputs get zero.
    """
    checks.refuse_cross_replica_context("broadcast")
    num_replicas = self.num_replicas_in_sync
    if not (isinstance(source_replica_id, int) and
            0 <= source_replica_id < num_replicas):
      raise ValueError(
          f"Expected `source_replica_id` to be an int in [0, "
          f"{num_replicas}). Received: source_replica_id="
          f"{source_replica_id!r}")
    is_source = self.replica_id_in_group == source_replica_id
    value = checks.own_tensors(value, "broadcast")
    flat = tf.nest.flatten(value)

    def grad(xs, ys, dys):
      summed = self.all_reduce("sum", dys)
      return [g if is_source else tf.zeros_like(g) for g in summed]

    ys = exchange.exchange(
        self, lambda strategy, *values: merged.broadcast_from(
            strategy, values, source_replica_id),
        lambda keys, values: self._collectives.all_reduce(
            self.local_index, reduce_op_lib.ReduceOp.SUM,
            [v if is_source else tf.zeros_like(v) for v in values], keys),
        flat, grad=grad)
    return tf.nest.pack_sequence_as(value, ys)

  def all_gather(self, value, axis, options=None):
    """`tf.distribute.ReplicaContext.all_gather`, also inside control flow.

    Inside control flow every replica's value must have the same shape.
    """
    checks.refuse_cross_replica_context("all_gather")
    checks.refuse_indexed_slices(value, "all_gather")
    value = checks.own_tensors(value, "all_gather")
    flat = tf.nest.flatten(value)
    paths = [path for path, _ in tfi.nest.flatten_with_tuple_paths(value)]

    ys = exchange.exchange(
        self, lambda strategy, *values: merged.all_gather(
            strategy, values, paths, axis, options),
        lambda keys, values: self._collectives.all_gather(
            self.local_index, values, axis, keys),
        flat, grad=lambda xs, ys, dys: [
            self._own_part(x, dy, axis) for x, dy in zip(xs, dys)],
        keys_per_tensor=replica_collectives.GATHER_KEYS)
    return tf.nest.pack_sequence_as(value, ys)

  def _own_part(self, x, gathered_dy, axis):
    """This replica's part, as `x` lies in a gather along `axis`, of the
    upstream gradients of that gather summed over replicas (parts may differ
    in size along `axis`: a partial batch)."""
    size = tf.shape(x)[axis]
    sizes = self.all_gather(tf.reshape(size, [1]), axis=0)
    start = tf.reduce_sum(sizes[:self.replica_id_in_group])
    return tf.gather(self.all_reduce("sum", gathered_dy),
                     tf.range(start, start + size), axis=axis)

  def reduce_scatter(self, reduce_op, value, axis=0):
    """Replica r gets slice r (of N along `axis`) of `value` reduced over replicas.

    `value` is a nested structure; every tensor's size along `axis` must be
    a multiple of N, the replicas in sync. Gradients: SUM gathers the
    upstream gradients (MEAN divides them by N); MIN/MAX route them as
    `all_reduce` does. Inside control flow: an all-to-all of the slices and
    a local reduction (TF has no reduce-scatter on CPU; this moves half of
    what an all-reduce does).

    >>> from replicator_strategy import ReplicatorStrategy
    >>> strategy = ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
    >>> def step():
    ...   ctx = tf.distribute.get_replica_context()
    ...   x = tf.range(4.0) * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
    ...   return ctx.reduce_scatter("sum", x)
    >>> [t.numpy() for t in strategy.experimental_local_results(strategy.run(step))]
    [array([0., 3.], dtype=float32), array([6., 9.], dtype=float32)]
    """
    checks.refuse_cross_replica_context("reduce_scatter")
    op = reduce_op_lib.parse(reduce_op)
    n = self.num_replicas_in_sync
    value = checks.own_tensors(value, "reduce_scatter")
    flat, axes = checks.split_evenly(value, axis, n, "reduce_scatter", "axis")

    def grad(xs, ys, dys):
      # Dense: a slice read with tf.gather sends back IndexedSlices.
      full_dys = [self.all_gather(tf.convert_to_tensor(dy), a)
                  for dy, a in zip(dys, axes)]
      if op == reduce_op_lib.ReduceOp.SUM:
        return full_dys
      if op == reduce_op_lib.ReduceOp.MEAN:
        return [g / n for g in full_dys]
      full_ys = [self.all_gather(y, a) for y, a in zip(ys, axes)]
      return reduce_op_lib.route_to_extremum(
          xs, full_ys, full_dys, lambda ts: self.all_reduce("sum", ts))

    ys = exchange.exchange(
        self, lambda strategy, *values: merged.reduce_scatter(
            strategy, values, op, axes),
        lambda keys, values: self._collectives.reduce_scatter(
            self.local_index, op, values, axes, keys),
        flat, grad=grad)
    return tf.nest.pack_sequence_as(value, ys)

  def all_to_all(self, value, split_axis=0, concat_axis=0):
    """Slice j (of N along `split_axis`) of this replica's value goes to replica j.

    Each replica concatenates the N slices it receives, in replica order,
    along `concat_axis`. `value` is a nested structure; sizes along
    `split_axis` must be multiples of N. The gradient is the all-to-all of
    the upstream gradients with the axes swapped.

    >>> from replicator_strategy import ReplicatorStrategy
    >>> strategy = ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
    >>> def step():
    ...   ctx = tf.distribute.get_replica_context()
    ...   r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
    ...   return ctx.all_to_all(tf.constant([0.0, 1.0]) + 10.0 * r)
    >>> [t.numpy() for t in strategy.experimental_local_results(strategy.run(step))]
    [array([ 0., 10.], dtype=float32), array([ 1., 11.], dtype=float32)]
    """
    checks.refuse_cross_replica_context("all_to_all")
    value = checks.own_tensors(value, "all_to_all")
    flat, splits = checks.split_evenly(
        value, split_axis, self.num_replicas_in_sync, "all_to_all",
        "split_axis")
    concats = [checks.normalized_axis(x, concat_axis, "all_to_all",
                                      "concat_axis") for x in flat]

    def grad(xs, ys, dys):
      del xs, ys
      return [self.all_to_all(dy, split_axis=c, concat_axis=s)
              for dy, s, c in zip(dys, splits, concats)]

    ys = exchange.exchange(
        self, lambda strategy, *values: merged.all_to_all(
            strategy, values, splits, concats),
        lambda keys, values: self._collectives.all_to_all(
            self.local_index, values, splits, concats, keys),
        flat, grad=grad)
    return tf.nest.pack_sequence_as(value, ys)

  def map_gather(self, thunks, fn=None):
    """Thunk i runs on replica i mod N only; every replica gets all results.

    N is `num_replicas_in_sync`; with sync groups, replica i mod N of each
    group (`replica_id_in_group`) runs it, and its group gets the result.

    Work that every replica would repeat is shared out instead, as K-FAC
    does with its per-layer inverses (TF-Replicator's `map_gather`). With
    `fn`, `thunks` holds inputs, and replica i mod N computes
    `fn(thunks[i])`. Returns the tuple of results, in order, on every
    replica. Each result is a nested structure of numeric tensors with
    static shapes: the other replicas trace the thunk (without running it)
    for its shapes and add zeros of them to one all-reduce. A thunk that
    reads this replica's own values computes with its owner's. Gradients
    flow, summed over replicas, to the owner's inputs.

    >>> from replicator_strategy import ReplicatorStrategy
    >>> strategy = ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
    >>> matrices = [tf.eye(2) * k for k in (1.0, 2.0, 4.0)]
    >>> def step():
    ...   ctx = tf.distribute.get_replica_context()
    ...   return ctx.map_gather(matrices, fn=tf.linalg.inv)  # 0, 2 on replica 0
    >>> [float(m[0, 0]) for m in strategy.experimental_local_results(
    ...     strategy.run(step))[1]]
    [1.0, 0.5, 0.25]
    """
    checks.refuse_cross_replica_context("map_gather")
    calls = checks.thunk_calls(thunks, fn)
    n = self.num_replicas_in_sync
    replica = self.replica_id_in_group
    results = []
    for i, call in enumerate(calls):
      what = f"thunks[{i}]()" if fn is None else f"fn(thunks[{i}])"
      if i % n == replica:
        result = checks.thunk_result(call(), what)
      else:
        specs = checks.thunk_result(
            tf.function(call).get_concrete_function().structured_outputs, what)
        result = tf.nest.map_structure(
            lambda t: tf.zeros(t.shape, t.dtype), specs)
      results.append(result)
    return tuple(self.all_reduce("sum", results))

  def all_reduce_all_groups(self, reduce_op, value):
    """`all_reduce` ("sum" or "mean") over every replica of every sync group.

    An exchange between groups (Keras's metrics of `evaluate` and of `fit`'s
    validation); with one group, `all_reduce` itself.
    """
    return self._reduce_across_groups("all_reduce_all_groups", reduce_op,
                                      value, local=False)

  def all_reduce_local_groups(self, reduce_op, value):
    """`all_reduce` ("sum" or "mean") over this worker's replicas: every sync
    group on it, no other worker (in one process, every group).

    Keras's per-step logs of a train step: no wait on other workers. With
    one group, `all_reduce` itself.
    """
    return self._reduce_across_groups("all_reduce_local_groups", reduce_op,
                                      value, local=True)

  def _reduce_across_groups(self, name, reduce_op, value, local):
    communicator = self.strategy.extended.communicator
    if communicator.num_sync_groups == 1:
      return self.all_reduce(reduce_op, value)
    checks.refuse_cross_replica_context(name)
    op = reduce_op_lib.parse(reduce_op)
    if op.is_extremum:
      raise ValueError(
          f"Expected `reduce_op` of {name} to be 'sum' or 'mean'. "
          f"Received: reduce_op={reduce_op!r}.")
    flat = [tf.convert_to_tensor(v) for v in tf.nest.flatten(value)]
    among = (communicator.local_groups if local else
             communicator.everyone).replica_collectives
    ys = exchange.exchange(
        self, lambda strategy, *values: strategy.extended.communicator.
        reduce_across_groups(op.to_tf(), values, local),
        lambda keys, values: among.all_reduce(self.local_index, op, values,
                                              keys),
        flat, grad=lambda xs, ys, dys: self._reduce_across_groups(
            name, op, dys, local),
        collectives=among)
    return tf.nest.pack_sequence_as(value, ys)

  # Where this replica is and what it sees: documented API, computed elsewhere.

  @property
  def can_merge(self):
    """Whether `merge_call` can gather the replicas here (see
    `collectives.exchange.can_merge`)."""
    return exchange.can_merge(self)

  def outside_loops(self, fn):
    """`fn()`, built where the replicas merge if called inside a while loop
    (see `collectives.exchange.outside_loops`)."""
    return exchange.outside_loops(self, fn)

  def batch_rows(self):
    """Where this replica's rows lie in the global batch, or None if unknown:
    a `batch_rows.BatchRows` (`first`, `count`, `total`: int64 scalars)."""
    return self._rows.rows(self)

  def logical_device(self, logical_device_id):
    """Ops inside run on this replica's device `logical_device_id` (see
    `replicator_strategy.model_parallel.logical_devices`)."""
    return self.strategy.extended.logical_devices.on_device(
        self.local_index, logical_device_id)

  @property
  def replica_id_in_group(self):
    """This replica's index within its sync group (see
    `replicator_strategy.sync_groups.topology`): the replica id, with one
    group."""
    return tfi.replica_id(self) % self.num_replicas_in_sync

  @property
  def sync_group(self):
    """The index of this replica's sync group, 0 with one group."""
    return tfi.replica_id(self) // self.num_replicas_in_sync

  @property
  def local_index(self):
    """This replica's index among this worker's replicas."""
    return tfi.replica_id(self) - self.strategy.extended.first_replica_id

  @property
  def _collectives(self):
    return exchange.group_collectives(self)


def merge_call_possible():
  """False inside a replica's control flow, where replicas can't merge, and
  in cross-replica context, where there are no replicas to merge: there
  `maybe_merge_call` (a Keras optimizer's update) runs its merge function
  itself, as merge_call would."""
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    return False
  return not isinstance(ctx, ReplicaContext) or ctx.can_merge
