"""Small all-reduces are packed into one per dtype and come back unchanged."""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
from replicator_strategy import packing
import topology


class PackingTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_batch_all_reduce_of_mixed_values_equals_one_by_one(self, _, n):
    strategy = topology.strategy_over(n)
    big = packing.SMALL_BYTES // 4 + 1  # float32 elements: not packed.

    def values(ctx):
      r = float(ctx.replica_id_in_sync_group + 1)
      return [tf.fill([3, 2], r), tf.constant(r), tf.fill([big], r),
              tf.fill([5], int(r)), tf.fill([4], r * 2), tf.fill([2], int(r))]

    per_replica = strategy.experimental_distribute_values_from_function(values)

    @tf.function
    def batched():
      return strategy.run(lambda vs: tf.distribute.get_replica_context()
                          .all_reduce("sum", vs), (per_replica,))

    total = n * (n + 1) / 2
    want = [np.full([3, 2], total), total, np.full([big], total),
            np.full([5], int(total)), np.full([4], 2 * total),
            np.full([2], int(total))]
    assert_per_replica(self, strategy, batched(), [want] * n)

  def test_only_several_small_dense_values_of_a_dtype_are_packed(self):
    strategy = topology.strategy_over(2)
    small = strategy.experimental_distribute_values_from_function(
        lambda _: tf.ones([4]))
    large = strategy.experimental_distribute_values_from_function(
        lambda _: tf.ones([packing.SMALL_BYTES // 4 + 1]))
    ints = strategy.experimental_distribute_values_from_function(
        lambda _: tf.ones([4], tf.int32))
    to_reduce, _ = packing.pack([small, large, small, ints])
    # large and the lone int32 alone; the two float32 smalls in one buffer.
    self.assertEqual(len(to_reduce), 3)
    self.assertEqual(to_reduce[-1].values[0].shape, [8])


if __name__ == "__main__":
  unittest.main()
