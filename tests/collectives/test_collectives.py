"""Collectives inside control flow, where replicas cannot meet in merge_call.

Keras calls all-reduces and variable updates inside `tf.cond` (EMA overwrite,
gradient accumulation, loss scaling) and inside the `tf.while_loop` of
`steps_per_execution`; these tests do the same through the public API.
"""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import topology



def _all_reduce_one():
  return tf.distribute.get_replica_context().all_reduce("sum", 1.0)


def _while_loop_inside():
  return tf.while_loop(lambda i, t: i < 3,
                       lambda i, t: (i + 1, t + _all_reduce_one()),
                       (0, 0.0))[1]


def _autograph_for_inside():
  total = tf.constant(0.0)
  for _ in tf.range(3):
    total += _all_reduce_one()
  return total


def _autograph_while_inside():
  total, i = tf.constant(0.0), tf.constant(0)
  while i < 3:
    total += _all_reduce_one()
    i += 1
  return total


def _cond_in_a_while_loop_inside():
  return tf.while_loop(
      lambda i, t: i < 3,
      lambda i, t: (i + 1, tf.cond(i >= 0, lambda: t + _all_reduce_one(),
                                   lambda: t)), (0, 0.0))[1]


def _python_for_inside():
  total = tf.constant(0.0)
  for _ in range(3):
    total += _all_reduce_one()
  return total


_LOOPS_INSIDE = [("while_loop", _while_loop_inside),
                 ("autograph_for", _autograph_for_inside),
                 ("autograph_while", _autograph_while_inside),
                 ("cond_in_a_while_loop", _cond_in_a_while_loop_inside)]


class LoopsTest(unittest.TestCase):
  """What docs/api.md says of collectives in loops (ReplicaContext)."""

  @parameterized.expand(_LOOPS_INSIDE)
  def test_a_loop_inside_the_replica_function_is_refused_when_traced(
      self, name, fn):
    strategy = topology.strategy_over(2)
    with self.assertRaisesRegex(NotImplementedError,
                                "inside a tf.while_loop written inside the "
                                "function passed to strategy.run"):
      tf.function(lambda: strategy.run(fn))()
    if name.startswith("autograph"):
      return  # No autograph in a TF1 graph: a Python loop over a tensor fails.
    with tf.Graph().as_default():
      graph_strategy = topology.strategy_over(2)
      with self.assertRaises(NotImplementedError):
        graph_strategy.run(fn)

  @parameterized.expand(_LOOPS_INSIDE + [("python_for", _python_for_inside)])
  def test_any_loop_works_eagerly_and_a_python_loop_traced(self, name, fn):
    strategy = topology.strategy_over(2)
    assert_per_replica(self, strategy, strategy.run(fn), [6.0, 6.0])
    if name == "python_for":
      assert_per_replica(self, strategy, tf.function(
          lambda: strategy.run(fn))(), [6.0, 6.0])

  def test_a_loop_around_strategy_run_works(self):
    strategy = topology.strategy_over(2)

    @tf.function
    def three_steps():
      total = tf.constant(0.0)
      for _ in tf.range(3):
        total += strategy.experimental_local_results(
            strategy.run(_all_reduce_one))[0]
      return total

    self.assertEqual(float(three_steps()), 6.0)


class ControlFlowTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_every_collective_inside_cond(self, _, n):
    strategy = topology.strategy_over(n)

    def fn(flag):
      ctx = tf.distribute.get_replica_context()
      x = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0

      def collectives():
        return {
            "sum": ctx.all_reduce("sum", x),
            "mean": ctx.all_reduce(tf.distribute.ReduceOp.MEAN, x),
            "min": ctx.all_reduce("min", x),
            "max": ctx.all_reduce("max", x),
            "broadcast": ctx.broadcast(x, source_replica_id=n - 1),
            "gather": ctx.all_gather(tf.reshape(x, [1]), axis=0),
        }

      def nothing():
        return {"sum": x, "mean": x, "min": x, "max": x, "broadcast": x,
                "gather": tf.zeros([n])}

      return tf.cond(flag, collectives, nothing)

    step = tf.function(lambda flag: strategy.run(fn, args=(flag,)))
    ids = np.arange(1, n + 1, dtype=np.float32)
    collected = {"sum": ids.sum(), "mean": ids.mean(), "min": 1.0, "max": n,
                 "broadcast": n, "gather": ids}
    assert_per_replica(self, strategy, step(tf.constant(True)),
                       [collected] * n)
    # The branch not taken launches nothing; the next call still agrees.
    assert_per_replica(self, strategy, step(tf.constant(False))["sum"],
                       list(ids))
    assert_per_replica(self, strategy, step(tf.constant(True)),
                       [collected] * n)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_gradients_inside_cond_equal_those_outside(self, _, n):
    # Outside a cond the gradients go through merge_call (checked against
    # NumPy in test_replica_context); inside, the gradient branch launches
    # run-time collectives of its own.
    strategy = topology.strategy_over(n)
    exchanges = {
        "sum": lambda ctx, x: ctx.all_reduce("sum", x),
        "mean": lambda ctx, x: ctx.all_reduce("mean", x),
        "min": lambda ctx, x: ctx.all_reduce("min", x),
        "max": lambda ctx, x: ctx.all_reduce("max", x),
        "broadcast": lambda ctx, x: ctx.broadcast(x, source_replica_id=n - 1),
        "gather": lambda ctx, x: ctx.all_gather(x, 0)}

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
      x = tf.constant([1.0, -2.0, 3.0]) * (r + 1.0) + r * r
      grads = {}
      for name, exchange in exchanges.items():
        for where in ("outside", "inside"):
          with tf.GradientTape() as tape:
            tape.watch(x)
            f = lambda exchange=exchange: exchange(ctx, x)
            y = f() if where == "outside" else tf.cond(r >= 0.0, f, f)
            # A weight per element and replica, so every path shows.
            w = tf.range(1.0, tf.cast(tf.size(y), tf.float32) + 1.0) + r
            loss = tf.reduce_sum(y * w)
          grads[name, where] = tape.gradient(loss, x)
      return {f"{name} {where}": g for (name, where), g in grads.items()}

    results = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(fn))())
    for name in exchanges:
      # Some replica gets a gradient (MIN, MAX and broadcast: not all).
      self.assertTrue(any(np.any(r[f"{name} outside"].numpy() != 0.0)
                          for r in results), name)
      for result in results:
        np.testing.assert_allclose(result[f"{name} inside"],
                                   result[f"{name} outside"], rtol=1e-6,
                                   err_msg=name)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_gather_of_uneven_parts_inside_cond_differentiates_as_outside(
      self, _, n):
    strategy = topology.strategy_over(n)

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = ctx.replica_id_in_sync_group
      x = tf.range(tf.cast(r + 1, tf.float32)) + 1.0  # Replica r: r + 1 rows.
      grads = []
      for in_cond in (False, True):
        with tf.GradientTape() as tape:
          tape.watch(x)
          gather = lambda: ctx.all_gather(x, axis=0)
          y = tf.cond(r >= 0, gather, gather) if in_cond else gather()
          w = tf.range(tf.cast(tf.size(y), tf.float32)) * tf.cast(r + 1,
                                                                 tf.float32)
          loss = tf.reduce_sum(y * w)
        grads.append(tape.gradient(loss, x))
      return grads

    results = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(fn))())
    total = n * (n + 1) / 2  # Sum of every replica's weight scale.
    start = 0
    for r, (outside, inside) in enumerate(results):
      want = np.arange(start, start + r + 1) * total
      np.testing.assert_allclose(outside, want)
      np.testing.assert_allclose(inside, want)
      start += r + 1

  @parameterized.expand([("bfloat16", tf.bfloat16), ("float16", tf.float16),
                         ("int32", tf.int32)])
  def test_gather_inside_cond_keeps_every_dtypes_values(self, _, dtype):
    # TF's gather kernel lacks bfloat16, whose bits travel as float16's.
    strategy = topology.strategy_over(2)

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = ctx.replica_id_in_sync_group
      # Values that float16 cannot hold, as bfloat16 can (1e20, 1e-20).
      x = tf.cast(tf.constant([1e20, -1e-20, 3.0]) if dtype == tf.bfloat16
                  else tf.constant([7.0, -1.0, 3.0]), dtype) * tf.cast(
                      r + 1, dtype)
      gather = lambda: ctx.all_gather(x, axis=0)
      return tf.cond(r >= 0, gather, gather), x

    results = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(fn))())
    want = np.concatenate([x.numpy() for _, x in results])
    for gathered, _ in results:
      self.assertEqual(gathered.dtype, dtype)
      np.testing.assert_array_equal(gathered.numpy(), want)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_cond_collectives_in_a_loop_around_run(self, _, n):
    # The shape of Keras's steps_per_execution: a tf.while_loop whose body
    # calls strategy.run, whose replicas all-reduce inside a tf.cond.
    strategy = topology.strategy_over(n)

    def fn(i):
      ctx = tf.distribute.get_replica_context()
      x = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
      return tf.cond(i % 2 == 0, lambda: ctx.all_reduce("sum", x * 2.0),
                     lambda: ctx.all_reduce("max", x))

    @tf.function
    def loop(steps):
      def body(i, acc):
        step = strategy.run(fn, args=(i,))
        return i + 1, acc + strategy.reduce("mean", step, axis=None)
      return tf.while_loop(lambda i, _: i < steps, body,
                           (tf.constant(0), tf.constant(0.0)))[1]

    ids_sum = n * (n + 1) / 2
    for steps in (3, 4, 3):
      even = (steps + 1) // 2
      self.assertEqual(float(loop(tf.constant(steps))),
                       even * 2 * ids_sum + (steps - even) * n)

  def test_collective_in_a_loop_inside_the_replica_function_is_refused(self):
    strategy = topology.strategy_over(2)

    def fn():
      ctx = tf.distribute.get_replica_context()
      return tf.while_loop(
          lambda i, _: i < 3,
          lambda i, acc: (i + 1, acc + ctx.all_reduce("sum", 1.0)),
          (tf.constant(0), tf.constant(0.0)))[1]

    with self.assertRaisesRegex(NotImplementedError,
                                "tf.while_loop.*Put the loop around"):
      tf.function(lambda: strategy.run(fn))()

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_variable_updates_inside_cond_stay_mirrored(self, _, n):
    strategy = topology.strategy_over(n)
    aggregations = {
        "sum": tf.VariableAggregation.SUM,
        "mean": tf.VariableAggregation.MEAN,
        "first": tf.VariableAggregation.ONLY_FIRST_REPLICA,
    }
    with strategy.scope():
      variables = {k: tf.Variable(0.0, aggregation=a)
                   for k, a in aggregations.items()}
      counter = tf.Variable(0, dtype=tf.int64,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0

      def update():
        ops = [v.assign_add(x) for v in variables.values()]
        ops.append(counter.assign_add(1))
        with tf.control_dependencies(ops):
          return tf.constant(True)

      return tf.cond(tf.constant(True), update, lambda: tf.constant(False))

    step = tf.function(lambda: strategy.run(fn))
    step()
    step()
    ids = np.arange(1, n + 1, dtype=np.float32)
    want = {"sum": 2 * ids.sum(), "mean": 2 * ids.mean(), "first": 2.0}
    for name, v in variables.items():
      assert_per_replica(self, strategy, v, [want[name]] * n, what=name)
    assert_per_replica(self, strategy, counter, [2] * n, what="counter")


if __name__ == "__main__":
  unittest.main()
