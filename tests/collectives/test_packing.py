"""Small all-reduces are packed into one per dtype and come back unchanged."""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
from replicator_strategy.collectives import packing
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

  def test_buffers_hold_neighbouring_values_up_to_the_bucket_size(self):
    strategy = topology.strategy_over(2)
    four = strategy.experimental_distribute_values_from_function(
        lambda _: tf.ones([4]))  # 16 bytes
    ints = strategy.experimental_distribute_values_from_function(
        lambda _: tf.ones([4], tf.int32))
    to_reduce, unpack = packing.pack([four, ints, four, four, ints, four],
                                     bucket_bytes=32)
    # float32: [0, 2] and [3, 5]; int32: [1, 4]; nothing alone.
    self.assertEqual([t.values[0].shape.as_list() for t in to_reduce],
                     [[8], [8], [8]])
    reduced = unpack([strategy.extended.reduce_to("sum", t, t)
                      for t in to_reduce])
    for value in reduced:
      np.testing.assert_array_equal(value.values[1], [2, 2, 2, 2])

  def test_a_bucket_waits_only_for_its_own_values(self):
    # Communication overlaps the backward pass: with a bucket size that
    # splits them, the sum of the values computed first does not wait for
    # the values computed later. (Keras's custom gradient then joins every
    # sum before the update, as DDP waits for its last bucket.)
    strategy = topology.strategy_over(2)

    def step(bytes_per_pack):
      def replica_fn():
        early = [tf.identity(tf.ones([4]), name=f"early_{i}") for i in range(2)]
        late = [tf.identity(tf.ones([4]) * 2, name=f"late_{i}")
                for i in range(2)]
        return tf.distribute.get_replica_context().all_reduce(
            "sum", early + late,
            options=tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=bytes_per_pack))

      return tf.function(lambda: strategy.run(replica_fn))

    def what_each_sum_waits_for(fn):
      graph = fn.get_concrete_function().graph
      waits = []
      for add in (op for op in graph.get_operations() if op.type == "AddN"):
        seen, todo = set(), [add]
        while todo:
          op = todo.pop()
          if op.name not in seen:
            seen.add(op.name)
            todo += [t.op for t in op.inputs] + list(op.control_inputs)
        waits.append({kind for kind in ("early", "late")
                      if any(name.startswith(kind + "_") for name in seen)})
      return sorted(waits, key=sorted)

    self.assertEqual(what_each_sum_waits_for(step(0)), [{"early", "late"}])
    self.assertEqual(what_each_sum_waits_for(step(32)), [{"early"}, {"late"}])
    np.testing.assert_array_equal(
        strategy.experimental_local_results(step(32)())[1],
        [[2] * 4] * 2 + [[4] * 4] * 2)

  def test_between_workers_every_value_of_a_dtype_crosses_packed(self):
    # Large values too, in buckets of at most bucket_bytes; each value
    # comes back in its own shape and place.
    large = packing.SMALL_BYTES // 4 + 1  # float32 elements.
    tensors = [tf.ones([3, 2]), tf.fill([large], 2.0), tf.ones([4], tf.int32),
               tf.constant(5.0), tf.fill([2], 3)]
    crossed = []

    def doubled(buffers):
      crossed.extend(b.shape.as_list() for b in buffers)
      return [b * 2 for b in buffers]

    out = packing.packed_all_reduce(tensors, doubled)
    self.assertEqual(sorted(crossed), [[6], [6 + large + 1]])
    for got, sent in zip(out, tensors):
      np.testing.assert_array_equal(got, sent * 2)
    crossed.clear()
    # The first float32 value fills a bucket alone; the next two share one.
    packing.packed_all_reduce(tensors, doubled, bucket_bytes=4 * large + 4)
    self.assertEqual(sorted(crossed), [[3, 2], [6], [large + 1]])


if __name__ == "__main__":
  unittest.main()
