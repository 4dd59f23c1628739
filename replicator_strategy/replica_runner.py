"""Running a function once per replica: what `strategy.run` does.

`call_for_each_replica` starts one thread per replica (TensorFlow's
`mirrored_run` threads, reused unchanged), each inside its
`ReplicaContext`. Around them: a `tf.function` is lifted above the threads,
one trace holding every replica, so that `merge_call` works inside it; one
with `jit_compile=True` is compiled per replica device; a plain function is
converted by autograph when traced; a replica left without rows gets tensors
of unknown rows.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> @tf.function
... def step():
...   return tf.distribute.get_replica_context().all_reduce("sum", 1.0)
>>> [float(t) for t in strategy.experimental_local_results(strategy.run(step))]
[2.0, 2.0]
"""

import contextlib
import warnings

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import batch_rows
from replicator_strategy import replica_context


_OUTER_TAPE_EAGERLY = (
    "ReplicatorStrategy: strategy.run was called eagerly inside a "
    "tf.GradientTape. The replicas run in threads of their own, which that "
    "tape does not watch: its gradients of anything they compute are None. "
    "Take the gradient inside the function given to strategy.run (a "
    "GradientTape there, as Keras's train_step does), or call strategy.run "
    "inside a tf.function: an outer tape then gives replica 0's share of the "
    "gradient, as with MirroredStrategy.")


def call_for_each_replica(strategy, fn, args, kwargs):
  """Runs `fn` once per replica, each inside a `ReplicaContext`.

  A `tf.function` is lifted above the replica threads (one trace holding every
  replica), as MirroredStrategy does, so that `merge_call` works inside it.
  One with `jit_compile=True` is compiled per replica: XLA compiles each
  replica's ops for that replica's device (`tf.xla.experimental.jit_scope`),
  the collectives between them run as TensorFlow ops.
  """
  if isinstance(fn, tfi.def_function.Function):
    # Held by `fn` (its code may hold `fn`: a Keras model's step), not by
    # a global map, which would keep both for good.
    per_strategy = tfi.owned_by(fn, "lifted_for_strategies")
    lifted = per_strategy.get(strategy)
    if lifted is None:
      python_fn = fn.python_function
      scope = (tf.xla.experimental.jit_scope if tfi.asks_for_xla(fn)
               else contextlib.nullcontext)

      def replicated(*a, **k):
        with scope():
          return call_for_each_replica(strategy, python_fn, a, k)

      lifted = tfi.clone_function_without_xla(fn, replicated)
      per_strategy[strategy] = lifted
    return lifted(*args, **kwargs)
  if not tf.executing_eagerly():
    fn = tfi.autograph.tf_convert(fn, tfi.ag_ctx.control_status_ctx())
  elif tfi.tape_recording():
    # Tapes are per thread and the replicas run in threads of their own.
    warnings.warn(_OUTER_TAPE_EAGERLY, stacklevel=1)  # This line: once.

  worker_counts = batch_rows.WorkerCounts.for_step(strategy.extended, args,
                                                   kwargs)

  @tfi.autograph.do_not_convert
  def in_replica_context(*a, **k):
    thread_context = tf.distribute.get_replica_context()
    a, k = _relax_empty_batches((a, k))
    context = replica_context.ReplicaContext(
        strategy, tfi.replica_id(thread_context), inputs=(a, k),
        worker_counts=worker_counts)
    with context:
      if worker_counts is None:
        # Counting the rows all-reduces, which merges the replica threads,
        # and they take turns at each merge: counted later (Keras scales a
        # loss by the rows' share), it would let another replica run a layer
        # in between, and Keras layers keep their add_loss values on the
        # layer, shared by the threads. In one process unused counts are
        # pruned from the graph. Across workers (`worker_counts`) nothing
        # merges, and the count is exchanged where first asked for.
        context.batch_rows()
      return fn(*a, **k)

  return tfi.mirrored_run.call_for_each_replica(strategy, in_replica_context,
                                                args, kwargs)


def _relax_empty_batches(structure):
  """`structure` with each traced tensor of 0 rows made one of unknown rows.

  A replica left without rows (fewer rows than replicas) gets tensors whose
  static batch is 0 when the step is traced for the concrete batch (as
  Keras's predict and evaluate do); TF's shape inference then fails some
  layers (an LSTM's bias add) that run well on 0 rows of unknown count.
  """
  def relax(t):
    if (tf.is_tensor(t) and not tf.executing_eagerly() and
        isinstance(t, tf.Tensor) and t.shape.rank and t.shape[0] == 0):
      return tf.raw_ops.PlaceholderWithDefault(
          input=t, shape=tf.TensorShape([None]).concatenate(t.shape[1:]))
    return t
  return tf.nest.map_structure(relax, structure)
