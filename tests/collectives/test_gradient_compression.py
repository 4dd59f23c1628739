"""ReplicatorStrategy(gradient_compression=...): the gradient sum in 16 bits.

Training with compressed gradients stays within the documented precision of
one device (a dozen steps of the same data, weights and global batch), and
is not bit-equal to it: the 16-bit sum really happened.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import multi_worker_runs
import topology
from replicator_strategy.collectives import compression as gradient_compression

# (rtol, atol) after 12 steps: a sum rounded to 8 (bfloat16) or 11 (float16)
# mantissa bits each step; docs/performance.md states the same bounds.
TOLERANCE = {"bfloat16": (2e-2, 5e-3), "float16": (2e-3, 5e-4)}
RUNS = {"custom_loop": multi_worker_runs.custom_loop,
        "keras_fit": multi_worker_runs.keras_fit,
        # The sharded step then runs inside each replica's tf.cond.
        "keras_fit_accumulation": functools.partial(
            multi_worker_runs.keras_fit, accumulation_steps=2),
        "embedding_fit": multi_worker_runs.embedding_fit}


@functools.cache
def on_one_replica(run):
  """Run `run`'s results on one replica, uncompressed (once; read only)."""
  return RUNS[run](topology.strategy_over(1))


def every_weight_in(n):
  """A partitioner cutting every weight into `n` shards."""
  return tf.distribute.experimental.partitioners.FixedShardsPartitioner(n)


def trained(results):
  """A run's results less where its shards live (not a trained number)."""
  return {k: v for k, v in results.items() if k != "shard_rows"}


def flatten(results):
  """Every number in a run's nested results, in a fixed order."""
  if isinstance(results, dict):
    return np.concatenate([flatten(results[k]) for k in sorted(results)])
  if isinstance(results, (list, tuple)):
    return (np.concatenate([flatten(r) for r in results]) if results
            else np.zeros([0]))
  return np.asarray([results], dtype=float)


def assert_compressed_close(test, got, want, wire):
  got, want = flatten(got), flatten(want)
  rtol, atol = TOLERANCE[wire]
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
  test.assertGreater(np.abs(got - want).max(), 1e-6,
                     "bit-equal to uncompressed: nothing was compressed")


class GradientCompressionTest(unittest.TestCase):

  @parameterized.expand([
      (f"{run}_{n}_replicas_{wire}{'_sharded' if shard else ''}", run, n,
       wire, shard)
      for run, n, wire, shard in (("custom_loop", 2, "bfloat16", False),
                                  ("custom_loop", 4, "float16", False),
                                  ("keras_fit", 2, "float16", False),
                                  ("keras_fit", 4, "bfloat16", False),
                                  ("custom_loop", 4, "bfloat16", True),
                                  ("keras_fit", 2, "bfloat16", True),
                                  ("keras_fit", 4, "float16", True),
                                  ("keras_fit_accumulation", 2, "bfloat16",
                                   True))])
  def test_training_stays_within_the_precision_of_one_device(
      self, _, run, n, wire, shard_optimizer_state):
    want = on_one_replica(run)
    got = RUNS[run](topology.strategy_over(
        n, gradient_compression=wire,
        shard_optimizer_state=shard_optimizer_state))
    assert_compressed_close(self, got, want, wire)

  @parameterized.expand([("keras_fit", 4, "bfloat16"),
                         ("keras_fit", 2, "float16"),
                         ("embedding_fit", 4, "bfloat16"),
                         ("embedding_fit", 2, "float16")])
  @pytest.mark.slow
  def test_sharded_variables_train_within_the_precision_of_one_device(
      self, run, n, wire):
    # Every weight sharded: the Dense kernels' gradient reduce-scatter and
    # the Embedding rows' gradient all-gather travel as `wire`.
    want = trained(on_one_replica(run))
    got = trained(RUNS[run](topology.strategy_over(
        n, gradient_compression=wire, variable_partitioner=every_weight_in(n))))
    assert_compressed_close(self, got, want, wire)

  def test_a_sharded_weights_gradient_is_summed_in_16_bits(self):
    strategy = topology.strategy_over(2, gradient_compression="bfloat16",
                                      variable_partitioner=every_weight_in(2))
    with strategy.scope():
      weight = tf.Variable(tf.ones([4]))
      table = keras.layers.Embedding(4, 1)
      table.build()

    @tf.function
    def step():
      def replica_fn():
        with tf.GradientTape() as tape:
          loss = (tf.reduce_sum(weight * (1 / 3)) +
                  tf.reduce_sum(table(tf.constant([0, 3])) * (1 / 3)))
        return tape.gradient(loss, [weight, table.embeddings.value])
      return strategy.run(replica_fn)

    weight_grads, table_grads = step()
    # Each replica's 1/3 rounded to bfloat16 (0.333984375), summed over 2.
    for shard in strategy.experimental_local_results(weight_grads):
      np.testing.assert_array_equal(shard, [0.66796875] * 2)
    # Rows 0 and 3 (shard 0's first row, shard 1's second), each looked up
    # by both replicas.
    want = ([[0.66796875], [0.0]], [[0.0], [0.66796875]])
    for shard, rows in zip(
        strategy.experimental_local_results(table_grads), want):
      np.testing.assert_array_equal(
          tf.math.unsorted_segment_sum(shard.values, shard.indices, 2), rows)

  def test_with_sharded_state_the_gradient_exchange_is_16_bit(self):
    # The gradients of the sharded step travel as bfloat16: the traced
    # apply_gradients casts them so before the sum.
    strategy = topology.strategy_over(
        2, gradient_compression="bfloat16", shard_optimizer_state=True)
    with strategy.scope():
      weight = tf.Variable(tf.ones([6]))
      optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
      optimizer.build([weight])

    @tf.function
    def step():
      return strategy.run(lambda: optimizer.apply_gradients(
          [(tf.fill([6], 1 / 3), weight)]))

    casts = [op for op in step.get_concrete_function().graph.get_operations()
             if op.type == "Cast" and op.get_attr("DstT") == tf.bfloat16]
    self.assertEqual(len(casts), 2)  # One on each replica.
    step()
    # 2 x (1/3 as bfloat16: 0.333984375), times the learning rate.
    np.testing.assert_allclose(weight.values[0], 1 - 0.1 * 0.66796875,
                               rtol=1e-7)

  @parameterized.expand([("bfloat16",), ("float16",)])
  def test_the_sum_is_rounded_to_the_wire_dtype_and_returned_as_float32(
      self, wire):
    strategy = topology.strategy_over(4)
    third = np.float32(1 / 3)

    def step():
      ctx = tf.distribute.get_replica_context()
      total, count = gradient_compression.all_reduce_sum(
          ctx, [tf.constant(third), tf.constant(1, tf.int32)],
          gradient_compression.WIRE_DTYPES[wire])
      return total, count

    total, count = (strategy.experimental_local_results(r)[0]
                    for r in strategy.run(step))
    self.assertEqual(total.dtype, tf.float32)
    self.assertEqual(int(count), 4)
    rounded = tf.cast(tf.constant(third), gradient_compression.WIRE_DTYPES[
        wire])
    expected = float(tf.cast(rounded * 2 + rounded * 2, tf.float32))
    self.assertEqual(float(total), expected)
    self.assertNotEqual(float(total), float(np.float32(third) * 4))

  def test_names_are_taken_in_any_case(self):
    # "BFLOAT16" used to be refused while reduce ops took any case.
    for name in ("BFLOAT16", "BFloat16", "Float16"):
      with self.subTest(name):
        self.assertEqual(gradient_compression.wire_dtype(name),
                         gradient_compression.WIRE_DTYPES[name.lower()])
        topology.strategy_over(2, gradient_compression=name)

  def test_a_wrong_name_is_refused_with_the_choices(self):
    with self.assertRaisesRegex(ValueError, 'None, "float16" or "bfloat16".*'
                                "Received: gradient_compression='fp8'"):
      topology.strategy_over(2, gradient_compression="fp8")


if __name__ == "__main__":
  unittest.main()
