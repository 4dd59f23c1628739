"""The all-reduce choice for a topology, its refusals, and the chosen ops' sums.

`choose` reads only device names, the physical GPU count and whether
TensorFlow registers NCCL kernels; GPU topologies are simulated by replacing
the last two. The numeric tests run the chosen ops on 2, 3 and 4 of the
logical CPUs conftest made.
"""

import contextlib
import unittest
from unittest import mock

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
from replicator_strategy.collectives import all_reduce
import topology

CPUS = tuple(f"/cpu:{i}" for i in range(4))
GPUS = tuple(f"/gpu:{i}" for i in range(4))


@contextlib.contextmanager
def gpu_machine(physical_gpus, nccl):
  """A machine with `physical_gpus` GPUs and a TensorFlow with NCCL or not."""
  gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
          for i in range(physical_gpus)]
  registered = mock.Mock(kernel=["NcclAllReduce kernel"] if nccl else [])
  with mock.patch.object(tf.config, "list_physical_devices",
                         lambda device_type=None: list(gpus)
                         if device_type in (None, "GPU") else []), \
       mock.patch("tensorflow.python.framework.kernels."
                  "get_registered_kernels_for_op",
                  lambda op: registered if op == "NcclAllReduce" else
                  mock.Mock(kernel=[])):
    yield


class ChooseTest(unittest.TestCase):
  """The decision table, one row per test."""

  def assert_chosen(self, devices, algorithm, want_type, want_reason,
                    **kwargs):
    ops, reason = all_reduce.choose(devices, algorithm, **kwargs)
    self.assertEqual(type(ops).__name__, want_type)
    self.assertIsInstance(ops, tf.distribute.CrossDeviceOps)
    self.assertEqual(reason, want_reason)
    return ops

  def test_auto_on_one_device_adds_on_it(self):
    for device in ("/cpu:0", "/gpu:0"):
      with gpu_machine(1, nccl=True):
        ops = self.assert_chosen(
            (device,), "auto", "ReductionToOneDevice",
            "add_on_one_device: a single device has nothing to exchange")
      self.assertEqual(ops.reduce_to_device, device)

  @parameterized.expand([("2_cpus", 2), ("3_cpus", 3), ("4_cpus", 4)])
  def test_auto_on_cpus_adds_on_the_first(self, _, n):
    ops = self.assert_chosen(CPUS[:n], "auto", "ReductionToOneDevice",
                             "add_on_one_device: devices share host memory")
    self.assertEqual(ops.reduce_to_device, CPUS[0])

  @parameterized.expand([
      ("logical_gpus_on_one", 2, 1, True, "ReductionToOneDevice",
       "add_on_one_device: logical GPUs share a physical GPU's memory"),
      ("gpus_with_nccl", 2, 2, True, "NcclAllReduce",
       "nccl: separate GPUs and TensorFlow built with NCCL"),
      ("odd_gpus_with_nccl", 3, 3, True, "NcclAllReduce",
       "nccl: separate GPUs and TensorFlow built with NCCL"),
      ("gpus_without_nccl", 2, 2, False, "HierarchicalCopyAllReduce",
       "hierarchical_copy: separate GPUs without NCCL"),
      ("four_gpus_without_nccl", 4, 4, False, "HierarchicalCopyAllReduce",
       "hierarchical_copy: separate GPUs without NCCL"),
      ("odd_gpus_without_nccl", 3, 3, False, "ReductionToOneDevice",
       "add_on_one_device: an odd number of GPUs without NCCL"),
  ])
  def test_auto_on_gpus(self, _, n, physical, nccl, want_type, want_reason):
    with gpu_machine(physical, nccl):
      self.assert_chosen(GPUS[:n], "auto", want_type, want_reason)

  @parameterized.expand([
      ("add_on_one_device", CPUS[:3], "ReductionToOneDevice"),
      ("ring", CPUS[:3], "CollectiveAllReduce"),
      ("hierarchical_copy", CPUS[:2], "HierarchicalCopyAllReduce"),
      ("hierarchical_copy", CPUS, "HierarchicalCopyAllReduce"),
  ])
  def test_a_named_algorithm_that_can_serve_is_used(self, algorithm, devices,
                                                    want_type):
    self.assert_chosen(devices, algorithm, want_type, f"{algorithm}: requested")

  def test_nccl_on_separate_gpus_with_nccl_is_used(self):
    with gpu_machine(2, nccl=True):
      self.assert_chosen(GPUS[:2], "nccl", "NcclAllReduce", "nccl: requested")

  @parameterized.expand([("one_device", 1), ("several", 3)])
  def test_given_cross_device_ops_pass_through(self, _, num_workers):
    given = tf.distribute.HierarchicalCopyAllReduce()
    ops, reason = all_reduce.choose(CPUS[:3], given, num_workers=num_workers)
    self.assertIs(ops, given)
    self.assertEqual(reason, "given by the user: HierarchicalCopyAllReduce")

  @parameterized.expand([("unknown", "fast"), ("none", None),
                         ("class_not_instance", tf.distribute.NcclAllReduce)])
  def test_anything_else_is_refused_naming_the_choices(self, _, bad):
    with self.assertRaises(ValueError) as raised:
      all_reduce.choose(CPUS[:2], bad)
    self.assertEqual(
        str(raised.exception),
        f"Expected `all_reduce` to be one of {all_reduce.ALGORITHMS} (any "
        f"case) or a tf.distribute.CrossDeviceOps instance. Received: "
        f"all_reduce={bad!r}")

  @parameterized.expand([("upper", "RING"), ("title", "Ring"),
                         ("mixed", "Add_On_One_Device"), ("auto", "AUTO")])
  def test_names_are_taken_in_any_case_as_reduce_ops_are(self, _, name):
    # "RING" used to be refused while reduce ops ("SUM", "sum") took any case.
    _, reason = all_reduce.choose(CPUS[:2], name)
    _, lower_reason = all_reduce.choose(CPUS[:2], name.lower())
    self.assertEqual(reason, lower_reason)
    strategy = topology.strategy_over(2, all_reduce=name)
    self.assertEqual(strategy.extended.all_reduce_choice, lower_reason)

  def test_nccl_on_cpus_is_refused(self):
    # It used to fail at the first all-reduce: no NCCL kernel for CPUs.
    for nccl in (False, True):
      with gpu_machine(2, nccl), self.assertRaisesRegex(
          ValueError, r"all_reduce='nccl' all-reduces between GPUs, but "
          r"`devices` include /cpu:0. Received: all_reduce='nccl' with devices "
          r"\['/cpu:0', '/cpu:1'\]. Use all_reduce='auto'"):
        all_reduce.choose(CPUS[:2], "nccl")

  def test_nccl_without_nccl_kernels_is_refused(self):
    with gpu_machine(2, nccl=False), self.assertRaisesRegex(
        ValueError, "needs TensorFlow built with NCCL.*this TensorFlow has no "
        "NCCL kernels. Use all_reduce='auto'"):
      all_reduce.choose(GPUS[:2], "nccl")

  def test_nccl_on_logical_gpus_sharing_one_is_refused(self):
    with gpu_machine(1, nccl=True), self.assertRaisesRegex(
        ValueError, "needs one physical GPU per device, and the 2 logical "
        "GPUs in `devices` share fewer physical GPUs"):
      all_reduce.choose(GPUS[:2], "nccl")

  @parameterized.expand([("cpus", CPUS[:3]), ("gpus", GPUS[:3])])
  def test_hierarchical_copy_on_an_odd_count_is_refused(self, _, devices):
    # TF's implementation sums two halves of n // 2 devices: with 3 it
    # silently left the third replica out of every sum.
    with gpu_machine(3, nccl=False), self.assertRaisesRegex(
        ValueError, "odd number of devices TensorFlow's implementation leaves "
        "the last one out of the sum. Received: "
        "all_reduce='hierarchical_copy' with 3 devices"):
      all_reduce.choose(devices, "hierarchical_copy")

  @parameterized.expand([("auto",), ("ring",)])
  def test_several_workers_reach_each_other_with_collective_ops(self,
                                                                algorithm):
    self.assert_chosen(
        CPUS[:2], algorithm, "KeyedCollectiveOps",
        "ring: 2 device(s) add on one, then collective ops among 3 workers",
        num_workers=3, timeout_seconds=5)

  @parameterized.expand([("add_on_one_device",), ("nccl",),
                         ("hierarchical_copy",)])
  def test_several_workers_refuse_what_stays_on_one_machine(self, algorithm):
    with gpu_machine(2, nccl=True), self.assertRaisesRegex(
        ValueError, f"^all_reduce='{algorithm}' works within one machine "
        "only; across 2 workers only TensorFlow's collective ops reach every "
        "replica. Use all_reduce='auto' or 'ring'.$"):
      all_reduce.choose(GPUS[:2], algorithm, num_workers=2)


# Every algorithm that runs on CPUs, on every replica count it accepts.
_SUMMING = [(f"{algorithm}_{n}_replicas", algorithm, n)
            for algorithm in ("auto", "add_on_one_device", "ring",
                              "hierarchical_copy")
            for n in (2, 3, 4) if (algorithm, n) != ("hierarchical_copy", 3)]


def replica_rows(strategy):
  """Replica r holds [r+1, -(r+1)^2, 10]: sums and means tell them apart."""

  def row(ctx):
    r = float(ctx.replica_id_in_sync_group + 1)
    return tf.constant([r, -r * r, 10.0])

  return strategy.experimental_distribute_values_from_function(row)


def numpy_rows(n):
  ids = np.arange(1, n + 1, dtype=np.float32)
  return np.stack([ids, -ids**2, np.full(n, 10.0, np.float32)], axis=1)


class ChosenOpsReduceTest(unittest.TestCase):

  @parameterized.expand(_SUMMING)
  def test_reduce_and_batch_reduce_equal_numpy(self, _, algorithm, n):
    strategy = topology.strategy_over(n)
    ops, _ = all_reduce.choose(strategy.extended.worker_devices, algorithm)
    rows, want = replica_rows(strategy), numpy_rows(n)
    for op, numpy_op in ((tf.distribute.ReduceOp.SUM, np.sum),
                         (tf.distribute.ReduceOp.MEAN, np.mean)):
      expected = [numpy_op(want, axis=0)] * n
      assert_per_replica(self, strategy, ops.reduce(op, rows, rows),
                         expected, rtol=1e-6, what=f"reduce {op}")
      doubled = strategy.run(lambda x: 2.0 * x, args=(rows,))
      batched = ops.batch_reduce(op, [(rows, rows), (doubled, doubled)])
      assert_per_replica(self, strategy, batched[0], expected, rtol=1e-6,
                         what=f"batch_reduce {op}, first")
      assert_per_replica(self, strategy, batched[1],
                         [2.0 * e for e in expected], rtol=1e-6,
                         what=f"batch_reduce {op}, second")

  @parameterized.expand(_SUMMING)
  def test_a_strategy_with_it_sums_in_replica_context(self, _, algorithm, n):
    strategy = topology.strategy_over(n, all_reduce=algorithm)

    def fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce("sum", tf.fill([3], tf.cast(
          ctx.replica_id_in_sync_group, tf.float32)))

    assert_per_replica(self, strategy, tf.function(
        lambda: strategy.run(fn))(), [np.full(3, n * (n - 1) / 2)] * n)

  @parameterized.expand(["auto", "ring"])
  def test_strategies_side_by_side_keep_to_their_own_collectives(
      self, algorithm):
    # Stock MirroredStrategy's second instance collides with the first's
    # collectives; each ReplicatorStrategy keeps to its own.
    first = topology.strategy_over(2, all_reduce=algorithm)
    second = topology.strategy_over(2, all_reduce=algorithm)
    third = topology.strategy_over(4, all_reduce=algorithm)

    def summed(strategy, width):
      def fn():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", tf.ones([width]) * tf.cast(
            ctx.replica_id_in_sync_group + 1, tf.float32))
      return tf.function(lambda: strategy.run(fn))

    steps = [(first, summed(first, 3), np.full(3, 3.0)),
             (second, summed(second, 5), np.full(5, 3.0)),
             (third, summed(third, 7), np.full(7, 10.0))]
    for _ in range(2):
      for strategy, step, total in steps:
        assert_per_replica(self, strategy, step(),
                           [total] * strategy.num_replicas_in_sync)


if __name__ == "__main__":
  unittest.main()
