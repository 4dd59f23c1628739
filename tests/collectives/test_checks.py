"""The replica context's checks: what each refuses, and what it names."""

import functools
import re
import unittest

from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.collectives import checks
from replicator_strategy.collectives import reduce_op
import topology


class MergePathMismatchTest(unittest.TestCase):
  """Where replicas meet in merge_call, a mismatch fails while tracing."""

  def test_sum_on_one_replica_max_on_another(self):
    strategy = topology.strategy_over(2)

    def fn():
      ctx = tf.distribute.get_replica_context()
      op = "sum" if tf.get_static_value(ctx.replica_id_in_sync_group) == 0 else "max"
      return ctx.all_reduce(op, 1.0)

    with self.assertRaisesRegex(
        ValueError, r"Replicas called different cross-replica operations at "
        r"the same point: replica 0: .*ReduceOp.SUM.*; replica 1: "
        r".*ReduceOp.MAX"):
      strategy.run(fn)


def _reduce(op):
  return lambda strategy, value: (op, value)


class MergeSignatureTest(unittest.TestCase):

  def test_merges_compare_by_name_and_by_the_modes_they_close_over(self):
    signature = lambda fn: checks.same_merge(fn)[0]
    sums = signature(_reduce(reduce_op.ReduceOp.SUM))
    self.assertEqual(sums, signature(_reduce(reduce_op.ReduceOp.SUM)))
    self.assertNotEqual(sums, signature(_reduce(reduce_op.ReduceOp.MAX)))
    # A partial, or a bound method, is the function it wraps.
    self.assertEqual(signature(functools.partial(_reduce, 1)),
                     signature(_reduce))
    self.assertEqual(signature(self.setUp), "TestCase.setUp")

  def test_the_checked_merge_runs_fn_on_the_arguments_after_the_signatures(
      self):
    signature, checked = checks.same_merge(lambda strategy, x, y=0: x + y)
    self.assertIsInstance(signature, str)
    self.assertEqual(checked(None, signature, 2, y=3), 5)


class ArgumentsTest(unittest.TestCase):

  def test_a_size_that_does_not_split_names_the_leaf_and_the_fix(self):
    value = {"a": tf.zeros([4, 2]), "b": [tf.zeros([3])]}
    with self.assertRaisesRegex(
        ValueError, re.escape(
            "ReplicaContext.reduce_scatter cuts each tensor of `value` into "
            "2 equal slices along axis=-1, one per replica, so its size "
            "there must be a multiple of 2. Received: value['b'][0] of "
            "shape (3,), size 3 along axis 0.")):
      checks.split_evenly(value, -1, 2, "reduce_scatter", "axis")
    flat, axes = checks.split_evenly({"a": tf.zeros([4, 2])}, -1, 2,
                                     "reduce_scatter", "axis")
    self.assertEqual((len(flat), axes), (1, [1]))

  def test_an_axis_out_of_range_is_named(self):
    self.assertEqual(checks.normalized_axis(tf.zeros([2, 3]), -1, "all_to_all",
                                            "concat_axis"), 1)
    with self.assertRaisesRegex(
        ValueError, re.escape(
            "Expected `concat_axis` given to ReplicaContext.all_to_all to be "
            "an int in [-2, 2) for a value of shape (2, 3). Received: "
            "concat_axis=2")):
      checks.normalized_axis(tf.zeros([2, 3]), 2, "all_to_all", "concat_axis")

  def test_a_replica_call_in_cross_replica_context_is_refused(self):
    checks.refuse_cross_replica_context("all_gather")  # No strategy: fine.
    with topology.strategy_over(1).scope(), self.assertRaisesRegex(
        RuntimeError, "ReplicaContext.all_gather was called in cross-replica "
        "context"):
      checks.refuse_cross_replica_context("all_gather")


class IndexedSlicesTest(unittest.TestCase):
  """all_gather refuses IndexedSlices, as TF's strategies, in every mode.

  Eagerly it used to densify them silently (every replica's whole dense
  tensor, mostly zeros); traced it failed inside custom_gradient ("Expected
  a type in (Tensor), got IndexedSlices").
  """

  @parameterized.expand([
      ("eager", lambda fn: fn),
      ("function", tf.function),
      ("function_inside_a_cond", lambda fn: tf.function(
          lambda x: tf.cond(tf.constant(True), lambda: fn(x),
                            lambda: fn(x)))),
  ])
  def test_all_gather_of_indexed_slices_is_refused(self, _, wrap):
    strategy = topology.strategy_over(2)
    slices = tf.IndexedSlices(values=tf.constant([[1.0, 2.0]]),
                              indices=tf.constant([2]),
                              dense_shape=tf.constant([5, 2]))

    def gather(x):
      ctx = tf.distribute.get_replica_context()
      return ctx.all_gather({"dense": tf.zeros([1]), "sparse": x}, axis=0)

    with self.assertRaisesRegex(
        NotImplementedError, re.escape(
            "ReplicaContext.all_gather: all_gather does not support "
            "IndexedSlices, as in TensorFlow's own strategies. Received: "
            "value['sparse'], an IndexedSlices. Gather "
            "tf.convert_to_tensor(value['sparse']) for the dense tensor")):
      strategy.run(wrap(gather), args=(slices,))


if __name__ == "__main__":
  unittest.main()
