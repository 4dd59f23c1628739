"""The replica context: TF-Replicator's collectives inside `strategy.run`.

Each replica runs the user's function in its own thread (TensorFlow's
`mirrored_run` threads, reused unchanged); `merge_call` is the rendezvous
where all replicas meet. On top of `tf.distribute.ReplicaContext` this adds
MIN/MAX all-reduce and `broadcast`, both differentiable.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy()
>>> def step():
...   ctx = tf.distribute.get_replica_context()
...   x = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
...   return ctx.all_reduce("max", x), ctx.broadcast(x + 10.0)
>>> strategy.experimental_local_results(strategy.run(step))[0]
(<tf.Tensor: ... numpy=3.0>, <tf.Tensor: ... numpy=10.0>)

Design after TF-Replicator (Buchlovsky et al., 2019, arXiv:1902.00465).
"""

import weakref

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import reduce_op as reduce_op_lib


class ReplicaContext(tfi.ThreadReplicaContext):
  """`tf.distribute.ReplicaContext` with MIN/MAX all-reduce and broadcast."""

  def all_reduce(self, reduce_op, value, options=None):
    """All-reduces a nested structure with "sum", "mean", "min" or "max".

    Accepts strings, `tf.distribute.ReduceOp` and `replicator_strategy.ReduceOp`.
    Gradients: SUM/MEAN as in TF; MIN/MAX send the summed upstream gradient to
    the replicas holding the extremum, split evenly among ties.
    """
    op = reduce_op_lib.parse(reduce_op)
    if not op.is_extremum:
      return super().all_reduce(op.to_tf(), value, options)
    flat = tf.nest.flatten(value)

    @tf.custom_gradient
    def extremum(*xs):
      ys = self.merge_call(_reduce_extremum, args=(op,) + tuple(xs))

      def grad(*dys):
        summed = self.all_reduce("sum", list(dys))
        masks = [tf.cast(tf.equal(x, y), dy.dtype) for x, y, dy in
                 zip(xs, ys, dys)]
        ties = self.all_reduce("sum", masks)
        return [g * m / t for g, m, t in zip(summed, masks, ties)]

      return list(ys), grad

    return tf.nest.pack_sequence_as(value, extremum(*flat))

  def broadcast(self, value, source_replica_id=0):
    """Every replica gets `source_replica_id`'s value of a nested structure.

    The gradient of the result flows back, summed over replicas, to the
    source replica's input; the other replicas' inputs get zero.
    """
    num_replicas = self.num_replicas_in_sync
    if not (isinstance(source_replica_id, int) and
            0 <= source_replica_id < num_replicas):
      raise ValueError(
          f"Expected `source_replica_id` to be an int in [0, "
          f"{num_replicas}). Received: source_replica_id="
          f"{source_replica_id!r}")
    flat = tf.nest.flatten(value)
    is_source = self._replica_id_in_sync_group == source_replica_id

    @tf.custom_gradient
    def broadcast(*xs):
      ys = self.merge_call(_broadcast_from, args=(source_replica_id,) + xs)

      def grad(*dys):
        summed = self.all_reduce("sum", list(dys))
        return [g if is_source else tf.zeros_like(g) for g in summed]

      return list(ys), grad

    return tf.nest.pack_sequence_as(value, broadcast(*flat))


def _reduce_extremum(strategy, op, *per_replica):
  extended = strategy.extended
  out = []
  for value in per_replica:
    parts = strategy.experimental_local_results(value)
    with tf.device(extended.worker_devices[0]):
      reduced = reduce_op_lib.reduce_along(op, tf.stack(parts), 0)
    out.append(extended.broadcast_to(reduced, value))
  return out


def _broadcast_from(strategy, source_replica_id, *per_replica):
  return [
      strategy.extended.broadcast_to(
          strategy.experimental_local_results(v)[source_replica_id], v)
      for v in per_replica
  ]


_lifted_functions = weakref.WeakKeyDictionary()


def call_for_each_replica(strategy, fn, args, kwargs):
  """Runs `fn` once per replica, each inside a `ReplicaContext`.

  A `tf.function` is lifted above the replica threads (one trace holding every
  replica), as MirroredStrategy does, so that `merge_call` works inside it.
  """
  if isinstance(fn, tfi.def_function.Function):
    per_strategy = _lifted_functions.setdefault(strategy,
                                                weakref.WeakKeyDictionary())
    lifted = per_strategy.get(fn)
    if lifted is None:
      python_fn = fn.python_function
      lifted = fn._clone(  # pylint: disable=protected-access
          python_function=lambda *a, **k: call_for_each_replica(
              strategy, python_fn, a, k))
      per_strategy[fn] = lifted
    return lifted(*args, **kwargs)
  if not tf.executing_eagerly():
    fn = tfi.autograph.tf_convert(fn, tfi.ag_ctx.control_status_ctx())

  @tfi.autograph.do_not_convert
  def in_replica_context(*a, **k):
    thread_context = tf.distribute.get_replica_context()
    with ReplicaContext(strategy, thread_context._replica_id_in_sync_group):  # pylint: disable=protected-access
      return fn(*a, **k)

  return tfi.mirrored_run.call_for_each_replica(strategy, in_replica_context,
                                                args, kwargs)
