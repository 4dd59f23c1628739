"""Reduce ops: every accepted spelling parsed, reducing as NumPy does, to_tf."""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.collectives import reduce_op

ReduceOp = reduce_op.ReduceOp
_NUMPY = {ReduceOp.SUM: np.sum, ReduceOp.MEAN: np.mean, ReduceOp.MIN: np.min,
          ReduceOp.MAX: np.max}


class ParseTest(unittest.TestCase):

  def test_the_package_exports_this_enum(self):
    self.assertIs(rs.ReduceOp, ReduceOp)
    self.assertEqual([op.value for op in ReduceOp],
                     ["SUM", "MEAN", "MIN", "MAX"])

  @parameterized.expand([
      (spelling, spelling, op)
      for op in ReduceOp
      for spelling in (op.value, op.value.lower(), op.value.capitalize(),
                       op.value[0].lower() + op.value[1:])])
  def test_names_in_any_case(self, _, spelling, want):
    self.assertIs(reduce_op.parse(spelling), want)

  @parameterized.expand([("sum", tf.distribute.ReduceOp.SUM, ReduceOp.SUM),
                         ("mean", tf.distribute.ReduceOp.MEAN, ReduceOp.MEAN)])
  def test_tf_reduce_ops_map_to_ours(self, _, tf_op, want):
    self.assertIs(reduce_op.parse(tf_op), want)

  @parameterized.expand([(op.value, op) for op in ReduceOp])
  def test_ours_pass_through(self, _, op):
    self.assertIs(reduce_op.parse(op), op)

  @parameterized.expand([
      ("unknown_name", "prod"), ("empty", ""), ("padded", " sum"),
      ("none", None), ("number", 1), ("bytes", b"sum"),
      ("enum_name_of_another_kind", tf.VariableAggregation.SUM),
  ])
  def test_anything_else_names_the_choices_and_what_was_received(self, _, bad):
    with self.assertRaises(ValueError) as raised:
      reduce_op.parse(bad)
    self.assertEqual(
        str(raised.exception),
        "Expected a reduce op: one of 'sum', 'mean', 'min', 'max' (any "
        "case), a tf.distribute.ReduceOp or a replicator_strategy.ReduceOp. "
        f"Received: {bad!r}")


class ReduceAlongTest(unittest.TestCase):

  @parameterized.expand([(f"{op.value}_axis_{axis}", op, axis)
                         for op in ReduceOp for axis in (0, 1, -1)])
  def test_equals_numpy(self, _, op, axis):
    # Distinct values with mixed signs, so each op picks out something else.
    stack = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    got = reduce_op.reduce_along(op, tf.constant(stack), axis)
    want = _NUMPY[op](stack, axis=axis)
    self.assertEqual(got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6)

  @parameterized.expand([(op.value, op) for op in ReduceOp])
  def test_integers_stay_integers(self, _, op):
    stack = tf.constant([[3, -1], [5, 7], [-2, 4]])
    got = reduce_op.reduce_along(op, stack, 0)
    self.assertEqual(got.dtype, tf.int32)
    # Integer MEAN truncates, as tf.reduce_mean does.
    want = {ReduceOp.SUM: [6, 10], ReduceOp.MEAN: [2, 3],
            ReduceOp.MIN: [-2, -1], ReduceOp.MAX: [5, 7]}[op]
    self.assertEqual(got.numpy().tolist(), want)


class ToTfTest(unittest.TestCase):

  def test_sum_and_mean_have_tf_equivalents(self):
    self.assertIs(ReduceOp.SUM.to_tf(), tf.distribute.ReduceOp.SUM)
    self.assertIs(ReduceOp.MEAN.to_tf(), tf.distribute.ReduceOp.MEAN)
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
      self.assertIs(reduce_op.parse(op.to_tf()), op)

  @parameterized.expand([("min", ReduceOp.MIN), ("max", ReduceOp.MAX)])
  def test_extrema_have_none(self, _, op):
    with self.assertRaisesRegex(
        ValueError, f"^ReduceOp.{op.value} has no tf.distribute.ReduceOp "
        "equivalent.$"):
      op.to_tf()

  def test_only_min_and_max_are_extrema(self):
    self.assertEqual([op for op in ReduceOp if op.is_extremum],
                     [ReduceOp.MIN, ReduceOp.MAX])


if __name__ == "__main__":
  unittest.main()
