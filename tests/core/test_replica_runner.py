"""`strategy.run`: one trace for every replica, XLA per replica, empty replicas."""

import unittest

from parameterized import parameterized
import tensorflow as tf

import topology


class ReplicaRunnerTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_tf_function_is_traced_once_for_every_replica(self, _, n):
    strategy = topology.strategy_over(n)
    replicas_traced = []

    @tf.function
    def step(x):
      ctx = tf.distribute.get_replica_context()
      replicas_traced.append(ctx)
      own = x + tf.cast(ctx.replica_id_in_sync_group, tf.float32)
      return ctx.merge_call(
          lambda strategy, v: strategy.extended.reduce_to("sum", v, v),
          args=(own,))

    for value in (1.0, 2.0):
      got = strategy.experimental_local_results(
          strategy.run(step, args=(tf.constant(value),)))
      self.assertEqual([float(t) for t in got],
                       [n * value + n * (n - 1) / 2] * n)
    self.assertEqual(len(replicas_traced), n)  # Traced once, not per call.

  def test_a_jit_compiled_replica_function_runs_too(self):
    strategy = topology.strategy_over(2)
    step = tf.function(
        lambda x: tf.distribute.get_replica_context().all_reduce("sum", x * 2),
        jit_compile=True)
    got = strategy.experimental_local_results(
        strategy.run(step, args=(tf.constant(3.0),)))
    self.assertEqual([float(t) for t in got], [12.0, 12.0])

  def test_a_replica_without_rows_traces_them_as_unknown(self):
    strategy = topology.strategy_over(2)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([2 - 2 * ctx.replica_id_in_sync_group, 3]))
    shapes = []

    def fn(x):
      shapes.append(x.shape.as_list())
      return tf.reduce_sum(x)

    got = strategy.experimental_local_results(
        tf.function(lambda v: strategy.run(fn, args=(v,)))(values))
    self.assertCountEqual(shapes, [[2, 3], [None, 3]])
    self.assertEqual([float(t) for t in got], [6.0, 0.0])


if __name__ == "__main__":
  unittest.main()
