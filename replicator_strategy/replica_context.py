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

Design after TF-Replicator (Buchlovsky et al., 2019, arXiv:1902.00465).
"""

import collections

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import checks
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.collectives import reduce_op as reduce_op_lib


BatchRows = collections.namedtuple("BatchRows", ["first", "count", "total"])
BatchRows.__doc__ = """A replica's rows in the global batch: the `count` rows from
row `first` on, of `total` rows (every replica's, in replica order)."""


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

  def __init__(self, strategy, replica_id_in_sync_group, inputs=()):
    super().__init__(strategy, replica_id_in_sync_group)
    self._home_graph = tf.compat.v1.get_default_graph()
    self._inputs = inputs
    self._batch_rows = {}

  def outside_loops(self, fn):
    """`fn()`, built in this replica's own graph if called inside a while loop.

    Collectives can't run in a replica's while loop (each replica runs its
    own copy); a value the loop only reads, such as a sharded weight
    gathered whole, can be built before it, where the replicas merge, and
    the loop captures it (gradients flow back through the capture).
    """
    graph = tf.compat.v1.get_default_graph()
    in_loop = False
    while graph is not None and graph is not self._home_graph:
      in_loop = in_loop or isinstance(graph, tfi.WHILE_LOOP_GRAPHS)
      graph = getattr(graph, "outer_graph", None)
    if not (in_loop and graph is self._home_graph):
      return fn()
    with self._home_graph.as_default():
      return fn()

  @property
  def can_merge(self):
    """Whether `merge_call` can gather the replicas here.

    False inside control flow or a nested `tf.function`: each replica traces
    its own graph there. Eager code (even under `tf.init_scope`) always merges:
    replica threads take turns, so a blocking collective would never return.
    """
    return (tf.executing_eagerly() or
            tf.compat.v1.get_default_graph() is self._home_graph)

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
    if self.can_merge and not op.is_extremum and _has_indexed_slices(value):
      # TF's path keeps IndexedSlices sparse (it has no gradient).
      return super().all_reduce(op.to_tf(), value, options)
    flat = [tf.convert_to_tensor(v) for v in tf.nest.flatten(value)]
    if op.is_extremum:
      ys = self._exchange(
          lambda strategy, *values: _reduce_extremum(strategy, op, *values),
          lambda keys, values: self._collectives.all_reduce(
              self.local_index, op, values, keys),
          flat,
          grad=lambda xs, ys, dys: reduce_op_lib.extremum_gradient(
              xs, ys, dys, lambda ts: self.all_reduce("sum", ts)))
    else:
      ys = self._exchange(
          lambda strategy, *values: strategy.extended.batch_reduce_to(
              op.to_tf(), [(v, _destination(v)) for v in values], options),
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
    value = _own_tensors(value, "broadcast")
    flat = tf.nest.flatten(value)

    def grad(xs, ys, dys):
      summed = self.all_reduce("sum", dys)
      return [g if is_source else tf.zeros_like(g) for g in summed]

    ys = self._exchange(
        lambda strategy, *values: _broadcast_from(
            strategy, source_replica_id, *values),
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
    value = _own_tensors(value, "all_gather")
    flat = tf.nest.flatten(value)
    paths = [path for path, _ in tfi.nest.flatten_with_tuple_paths(value)]

    def gather(strategy, *values):
      checks.check_gatherable(strategy, values, paths, axis)
      return [strategy.extended.communicator.all_gather(v, axis, options)
              for v in values]

    ys = self._exchange(
        gather,
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
    value = _own_tensors(value, "reduce_scatter")
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

    ys = self._exchange(
        lambda strategy, *values: [
            strategy.extended.communicator.reduce_scatter(op, v, a)
            for v, a in zip(values, axes)],
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
    value = _own_tensors(value, "all_to_all")
    flat, splits = checks.split_evenly(
        value, split_axis, self.num_replicas_in_sync, "all_to_all",
        "split_axis")
    concats = [checks.normalized_axis(x, concat_axis, "all_to_all",
                                      "concat_axis") for x in flat]

    def grad(xs, ys, dys):
      del xs, ys
      return [self.all_to_all(dy, split_axis=c, concat_axis=s)
              for dy, s, c in zip(dys, splits, concats)]

    ys = self._exchange(
        lambda strategy, *values: [
            strategy.extended.communicator.all_to_all(v, s, c)
            for v, s, c in zip(values, splits, concats)],
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
    calls = _thunk_calls(thunks, fn)
    n = self.num_replicas_in_sync
    replica = self.replica_id_in_group
    results = []
    for i, call in enumerate(calls):
      what = f"thunks[{i}]()" if fn is None else f"fn(thunks[{i}])"
      if i % n == replica:
        result = _checked_result(call(), what)
      else:
        specs = _checked_result(tf.function(call).get_concrete_function()
                                .structured_outputs, what)
        result = tf.nest.map_structure(
            lambda t: tf.zeros(t.shape, t.dtype), specs)
      results.append(result)
    return tuple(self.all_reduce("sum", results))

  def batch_rows(self):
    """Where this replica's rows lie in the global batch, or None if unknown.

    A `BatchRows` (`first`, `count`, `total`: int64 scalars), the global
    batch being every replica's rows in replica order, as one device sees
    them (with sync groups: its group's rows, which the group trains on).
    Rows are the leading dimension of the first tensor given to
    `strategy.run`; one all-reduce per traced step (a vector of every
    replica's count) counts them.
    """
    graph = tf.compat.v1.get_default_graph()
    if graph not in self._batch_rows:
      leaves = [t for t in tf.nest.flatten(self._inputs)
                if tf.is_tensor(t) and t.shape.rank != 0]
      rows = None
      if leaves:
        count = tf.shape(leaves[0], out_type=tf.int64)[0]
        replica = self.replica_id_in_group
        # Counts travel as float32, exact below 2**24 rows: the all-reduce
        # every path (merge, control flow, workers, GPUs) already carries.
        own = tf.one_hot(replica, self.num_replicas_in_sync,
                         on_value=tf.cast(count, tf.float32))
        counts = tf.cast(self.all_reduce("sum", own), tf.int64)
        rows = BatchRows(first=tf.reduce_sum(counts[:replica]), count=count,
                         total=tf.reduce_sum(counts))
      self._batch_rows[graph] = rows
    return self._batch_rows[graph]

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

  def all_reduce_all_groups(self, reduce_op, value):
    """`all_reduce` ("sum" or "mean") over every replica of every sync group.

    The one exchange between groups a step may ask for (Keras's per-step
    logs of global metrics); with one group, `all_reduce` itself.
    """
    communicator = self.strategy.extended.communicator
    if communicator.num_sync_groups == 1:
      return self.all_reduce(reduce_op, value)
    checks.refuse_cross_replica_context("all_reduce_all_groups")
    op = reduce_op_lib.parse(reduce_op)
    if op.is_extremum:
      raise ValueError(
          f"Expected `reduce_op` of all_reduce_all_groups to be 'sum' or "
          f"'mean'. Received: reduce_op={reduce_op!r}.")
    flat = [tf.convert_to_tensor(v) for v in tf.nest.flatten(value)]
    everyone = communicator.everyone.replica_collectives
    ys = self._exchange(
        lambda strategy, *values: strategy.extended.communicator.
        reduce_all_groups(op.to_tf(), values),
        lambda keys, values: everyone.all_reduce(self.local_index, op, values,
                                                 keys),
        flat, grad=lambda xs, ys, dys: self.all_reduce_all_groups(op, dys),
        collectives=everyone)
    return tf.nest.pack_sequence_as(value, ys)

  @property
  def local_index(self):
    """This replica's index among this worker's replicas."""
    return tfi.replica_id(self) - self.strategy.extended.first_replica_id

  @property
  def _collectives(self):
    return self.strategy.extended.communicator.replica_collectives

  def collective_keys(self, count, collectives=None):
    """Instance keys for this replica's next `count` run-time collectives
    (of its own group's, or of `collectives`)."""
    graph = self._home_graph
    if self._built_for_outer_tape():
      # The home graph's function was traced before: it takes no new
      # captures. `_check_outer_tape_order` refused control flow here.
      graph = tf.compat.v1.get_default_graph()
    else:
      replica_collectives.check_not_in_replica_loop(graph)
      replica_collectives.check_in_function(graph)
    return (collectives or self._collectives).draw_keys(
        self.local_index, count, graph)

  def _exchange(self, merge_fn, collective_fn, xs, grad, keys_per_tensor=1,
                collectives=None):
    """Differentiable exchange of the tensors `xs` between replicas.

    Through `merge_call` (`merge_fn(strategy, *per_replica_xs)`) where the
    replicas can meet, else through run-time collectives
    (`collective_fn(keys, xs)`, keys drawn from `collectives`, by default
    the group's). `grad(xs, ys, dys)` gives the gradients,
    through collectives of the same path (inside a `tf.cond`, its gradient
    branch launches run-time collectives too).
    """
    merging = self.can_merge
    position = self._next_exchange()
    if not merging:
      # Drawn outside the custom gradient, which would otherwise take the
      # key counters for variables to differentiate.
      keys = self.collective_keys(keys_per_tensor * len(xs), collectives)

    @tfi.custom_gradient
    def exchange(*xs):
      if merging:
        # Cut from the other replicas' inputs, which a TF1 graph holds too:
        # custom_gradient would take the variables behind them for this
        # replica's (their gradients flow through their own replica's).
        ys = [tf.stop_gradient(y) for y in self.merge_call(merge_fn, args=xs)]
      else:
        ys = collective_fn(keys, list(xs))

      def gradient(*dys):
        if not merging and tfi.differentiating_for_higher_order():
          # TF then rebuilds the forward control flow inside functions of its
          # own, where the replicas' collectives lose their common order.
          raise NotImplementedError(
              "Gradients through a cross-replica collective inside control "
              "flow (a tf.cond branch in the function passed to "
              "strategy.run) are taken with a non-persistent GradientTape "
              "that no other tape watches; this one is persistent, or nested "
              "in another tape. Use one non-persistent tape per gradient, or "
              "call the collective outside the tf.cond.")
        self._check_outer_tape_order(position)
        return grad(list(xs), ys, list(dys))

      return list(ys), gradient

    return exchange(*xs)

  def _next_exchange(self):
    """This replica's count of the exchanges traced before this one in its
    home graph: the same for the same exchange on every replica."""
    counts = tfi.owned_by(self._home_graph, "exchanges_traced")
    key = (id(self.strategy), self.local_index)
    position = counts.get(key, 0)
    counts[key] = position + 1
    return position

  def _built_for_outer_tape(self):
    """Whether this replica's ops are being built outside its thread: by a
    gradient that a tape outside strategy.run takes of the whole step."""
    return tf.distribute.get_replica_context() is not self

  def _check_outer_tape_order(self, position):
    """Refuses a gradient of exchanges that the replicas would launch in
    different orders.

    A tape outside the `tf.function` that calls strategy.run differentiates
    the whole function, every replica at once, outside the replicas' home
    graph: TF builds the replicas' gradients interleaved, in an order of its
    own, and each replica launches its run-time collectives in the order
    they are built. Where that order differs between replicas, or lies in a
    gradient's control flow (not ordered at all), the collectives could only
    wait for each other or meet the wrong partners.
    """
    if not self._built_for_outer_tape():
      return  # A gradient inside strategy.run: built replica by replica.
    graph = tf.compat.v1.get_default_graph()
    if isinstance(graph, tfi.CONTROL_FLOW_GRAPH):
      raise NotImplementedError(
          "ReplicatorStrategy: a tf.GradientTape outside the tf.function "
          "that calls strategy.run differentiates a cross-replica collective "
          "called inside a tf.cond (or loop) of the replica function; its "
          "gradient's collectives could not keep one order on every "
          "replica. " + _OUTER_TAPE_FIX)
    built = tfi.owned_by(graph, "exchanges_differentiated").setdefault(
        id(self.strategy), {})
    mine = built.setdefault(self.local_index, [])
    mine.append(position)
    for replica, theirs in built.items():
      if len(theirs) >= len(mine) and theirs[len(mine) - 1] != position:
        raise NotImplementedError(
            f"ReplicatorStrategy: a tf.GradientTape outside the tf.function "
            f"that calls strategy.run differentiates its cross-replica "
            f"collectives in an order that differs between replicas: "
            f"TensorFlow builds that gradient for every replica at once, "
            f"here reaching collective #{position + 1} of local replica "
            f"{self.local_index} where it reached collective "
            f"#{theirs[len(mine) - 1] + 1} of local replica {replica}. "
            f"Their gradients' collectives would wait for each other. " +
            _OUTER_TAPE_FIX)


_OUTER_TAPE_FIX = (
    "Take the gradient inside the function given to strategy.run (a "
    "tf.GradientTape there, then all-reduce the gradients or apply them with "
    "an optimizer, as Keras's train_step does).")


def _has_indexed_slices(value):
  return any(isinstance(v, tf.IndexedSlices) for v in tf.nest.flatten(value))


def _destination(value):
  """Where a merge_call's reduction of `value` goes, as TF's all_reduce says:
  its replicas' devices, or a one-replica value's own device."""
  return value.device if isinstance(value, tf.Tensor) else value


def _own_tensors(value, api):
  """`value` as tensors of this replica's own (a None in it refused).

  A tensor made outside `strategy.run` reaches every replica as one object,
  which merge_call would take for a single value instead of one per replica
  (a broadcast from another replica would come back as zeros, a gather with
  one part). A copy per replica keeps each replica's part its own.
  """
  checks.reject_none(value, "value", f"ReplicaContext.{api}")
  return tf.nest.map_structure(tf.identity, value)


def _thunk_calls(thunks, fn):
  """Argument-free calls of `map_gather`'s thunks (or of `fn` on its inputs)."""
  if not isinstance(thunks, (list, tuple)) or not thunks:
    raise ValueError(
        "Expected `thunks` given to ReplicaContext.map_gather to be a "
        f"non-empty list or tuple. Received: thunks={thunks!r}")
  if fn is not None:
    if not callable(fn):
      raise TypeError(
          "Expected `fn` given to ReplicaContext.map_gather to be callable "
          f"or None. Received: fn={fn!r}")
    return [lambda x=x: fn(x) for x in thunks]
  for i, thunk in enumerate(thunks):
    if not callable(thunk):
      raise TypeError(
          "Expected every element of `thunks` given to "
          "ReplicaContext.map_gather to be callable (or give `fn` to apply "
          f"to them). Received: thunks[{i}]={thunk!r}")
  return list(thunks)


def _checked_result(result, what):
  """`result`, what the call `what` ("thunks[3]()") returned, as tensors,
  each of a static shape and a dtype that sums over replicas; a ValueError
  naming the part that is not."""
  checks.reject_none(result, what, "ReplicaContext.map_gather")
  result = tf.nest.map_structure(tf.convert_to_tensor, result)
  for path, t in tfi.nest.flatten_with_tuple_paths(result):
    where = what + "".join(f"[{key!r}]" for key in path)
    if not t.shape.is_fully_defined():
      raise ValueError(
          f"Expected every tensor that ReplicaContext.map_gather's {where} "
          f"returns to have a static shape: the replicas that don't run it "
          f"need one. Received: shape {t.shape}. Set it in the thunk, e.g. "
          f"with tf.ensure_shape.")
    if not (t.dtype.is_floating or t.dtype.is_integer):
      raise ValueError(
          f"Expected every tensor that ReplicaContext.map_gather's {where} "
          f"returns to be of a float or integer dtype: results travel in a "
          f"sum over replicas. Received: dtype {t.dtype.name}. Cast it in "
          f"the thunk (tf.cast) and back after.")
  return result


def merge_call_possible():
  """False inside a replica's control flow, where replicas can't merge, and
  in cross-replica context, where there are no replicas to merge: there
  `maybe_merge_call` (a Keras optimizer's update) runs its merge function
  itself, as merge_call would."""
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    return False
  return not isinstance(ctx, ReplicaContext) or ctx.can_merge


def _reduce_extremum(strategy, op, *per_replica):
  return [strategy.extended.reduce_extremum_to(op, v, destinations=v)
          for v in per_replica]


def _broadcast_from(strategy, source_replica_id, *per_replica):
  """The source's value everywhere: a sum in which only the source counts.

  The source may be on another worker, so this is an all-reduce, not a copy.
  """
  extended = strategy.extended
  n = strategy.num_replicas_in_sync
  out = []
  for value in per_replica:
    masked = [
        part if (extended.first_replica_id + i) % n == source_replica_id else
        tf.zeros_like(part)
        for i, part in enumerate(strategy.experimental_local_results(value))
    ]
    out.append(extended.reduce_to(tf.distribute.ReduceOp.SUM,
                                  tfi.distribute_utils.regroup(masked, always_wrap=True),
                                  destinations=value))
  return out
