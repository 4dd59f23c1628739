"""Construction, placement and the cross-replica API, on 1, 2 and 4 replicas."""

import re
import unittest
from unittest import mock

from absl.testing import absltest  # pylint: disable=unused-import
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
import topology

CPU = "/job:localhost/replica:0/task:0/device:CPU:%d"


class ConstructionTest(unittest.TestCase):

  def test_default_takes_every_logical_cpu(self):
    strategy = rs.ReplicatorStrategy()
    self.assertEqual(strategy.extended.worker_devices,
                     tuple(CPU % i for i in range(4)))
    self.assertEqual(strategy.num_replicas_in_sync, 4)

  def test_explicit_devices_in_any_spelling(self):
    strategy = rs.ReplicatorStrategy(devices=["/cpu:2", "CPU:0"])
    self.assertEqual(strategy.extended.worker_devices, (CPU % 2, CPU % 0))

  @parameterized.expand([
      ("missing", ["/cpu:0", "/cpu:9"], "'/cpu:9'.*does not exist"),
      ("gpu_absent", ["/gpu:0"], "'/gpu:0'.*does not exist"),
      ("duplicate", ["/cpu:1", "/device:CPU:1"], "'/device:CPU:1'.*more than once"),
      ("empty", [], "at least one device"),
      ("garbage", ["not a device"], "'not a device'"),
      ("plain_string", "/cpu:0",
       r"list of device strings.*devices='/cpu:0'. A single device goes in a "
       r"list too"),
      ("ints", [0, 1], r"Device 0 in `devices` is a number.*'/gpu:0' or "
       r"'/cpu:0'"),
      ("none_entry", ["/cpu:0", None],
       r"device string such as '/gpu:0' or a tf.DeviceSpec. Received: "
       r"devices\[1\]=None of type NoneType"),
      ("bytes_entry", [b"/cpu:0"], r"Received: devices\[0\]=b'/cpu:0' of type "
       r"bytes"),
      ("empty_string", [""], "Device '' in `devices` names no single device: "
       "it has no device type"),
      ("wildcard", ["/cpu:*"], r"'/cpu:\*' in `devices` names no single "
       "device: it has no device index"),
      ("no_index", ["/cpu:0", "/cpu"], "'/cpu' in `devices` names no single "
       "device"),
  ])
  def test_bad_device_lists_name_the_entry_and_what_exists(self, _, devices,
                                                         pattern):
    with self.assertRaisesRegex(ValueError, pattern) as raised:
      rs.ReplicatorStrategy(devices=devices)
    self.assertIn("Devices that exist: " + CPU % 0, str(raised.exception))

  def test_device_specs_name_devices_as_strings_do(self):
    specs = [tf.DeviceSpec(device_type="CPU", device_index=2),
             tf.DeviceSpec.from_string("/job:localhost/device:CPU:0")]
    strategy = rs.ReplicatorStrategy(devices=specs)
    self.assertEqual(strategy.extended.worker_devices, (CPU % 2, CPU % 0))
    with self.assertRaisesRegex(ValueError, "names no single device"):
      rs.ReplicatorStrategy(devices=[tf.DeviceSpec(device_type="CPU")])

  def test_mixed_device_types_are_rejected(self):
    fake = [tf.config.LogicalDevice(CPU % 0, "CPU"),
            tf.config.LogicalDevice(CPU.replace("CPU", "GPU") % 0, "GPU")]
    with mock.patch.object(tf.config, "list_logical_devices",
                           lambda *a: fake):
      with self.assertRaisesRegex(ValueError, r"mixes device types \['CPU', 'GPU'\]"):
        rs.ReplicatorStrategy(devices=["/cpu:0", "/gpu:0"])

  def test_tpu_host_gets_not_implemented(self):
    tpu = tf.config.LogicalDevice(CPU.replace("CPU", "TPU") % 0, "TPU")
    listing = lambda device_type=None: (
        [tpu] if device_type in (None, "TPU") else [])
    with mock.patch.object(tf.config, "list_logical_devices", listing):
      with self.assertRaisesRegex(NotImplementedError, "TPUStrategy"):
        rs.ReplicatorStrategy()
      with self.assertRaisesRegex(NotImplementedError, "TPU"):
        rs.ReplicatorStrategy(devices=["/tpu:0"])

  def test_split_cpu_after_initialisation_says_so(self):
    tf.constant(1.0)  # TF devices exist now.
    rs.split_cpu(4)  # Same split as conftest's: nothing to do.
    with self.assertRaisesRegex(RuntimeError,
                                "split_cpu.3. was called after.*into 4"):
      rs.split_cpu(3)
    with self.assertRaisesRegex(ValueError, "positive int.*0"):
      rs.split_cpu(0)

  @parameterized.expand([
      ("infinite", float("inf")), ("nan", float("nan")), ("bool", True),
      ("beyond_the_bound", rs.strategy.MAX_TIMEOUT_SECONDS * 10),
      ("zero", 0), ("string", "60"), ("none", None),
  ])
  def test_timeout_must_be_finite_positive_and_bounded(self, _, bad):
    with self.assertRaisesRegex(
        ValueError, r"finite number of seconds in \(0, 1000000000\]. "
        r"Received: timeout_seconds=" + re.escape(repr(bad))):
      rs.ReplicatorStrategy(timeout_seconds=bad)

  def test_largest_timeout_works_in_a_collective_under_control_flow(self):
    # Inside tf.cond the replicas meet in a collective op that carries the
    # timeout: the bound must fit it.
    strategy = topology.strategy_over(
        2, timeout_seconds=rs.strategy.MAX_TIMEOUT_SECONDS)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
      return tf.cond(x > 0.0, lambda: ctx.all_reduce("sum", x), lambda: x)

    results = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(fn))())
    self.assertEqual([float(r) for r in results], [3.0, 3.0])

  def test_bad_all_reduce_names_the_choices(self):
    with self.assertRaisesRegex(ValueError, "'auto'.*Received: all_reduce='fast'"):
      rs.ReplicatorStrategy(all_reduce="fast")

  def test_all_reduce_choice_is_automatic_and_reported(self):
    strategy = topology.strategy_over(4)
    self.assertEqual(strategy.extended.all_reduce_choice,
                     "add_on_one_device: devices share host memory")
    self.assertIn("all-reduce add_on_one_device", repr(strategy))
    given = topology.strategy_over(2, all_reduce=tf.distribute.ReductionToOneDevice())
    self.assertIn("given by the user", given.extended.all_reduce_choice)

  def test_topology_and_algorithm_are_logged_at_start(self):
    with self.assertLogs("absl", level="INFO") as logs:
      topology.strategy_over(2)
    self.assertEqual(len(logs.output), 1)
    self.assertRegex(logs.output[0], "2 replica.*CPU:0.*CPU:1.*add_on_one_device")

  @parameterized.expand([
      (f"{algorithm}_{n}_replicas", algorithm, n)
      for algorithm in ("add_on_one_device", "ring", "hierarchical_copy")
      for n in (2, 3, 4) if (algorithm, n) != ("hierarchical_copy", 3)])
  def test_every_cpu_capable_algorithm_sums(self, _, algorithm, n):
    strategy = topology.strategy_over(n, all_reduce=algorithm)
    fn = lambda: tf.distribute.get_replica_context().all_reduce(
        "sum", tf.fill([3], tf.cast(
            tf.distribute.get_replica_context().replica_id_in_sync_group,
            tf.float32)))
    for r in strategy.experimental_local_results(tf.function(
        lambda: strategy.run(fn))()):
      np.testing.assert_array_equal(r, [n * (n - 1) / 2] * 3)

  def test_nccl_on_cpu_devices_is_refused_at_construction(self):
    # It used to fail at the first all-reduce: no NCCL kernel for CPUs.
    with self.assertRaisesRegex(
        ValueError, "'nccl' all-reduces between GPUs, but `devices` include "
        ".*CPU:0.*Use all_reduce='auto'"):
      topology.strategy_over(2, all_reduce="nccl")

  def test_nccl_without_nccl_kernels_is_refused_at_construction(self):
    gpus = [tf.config.LogicalDevice(CPU.replace("CPU", "GPU") % i, "GPU")
            for i in range(2)]
    listing = lambda device_type=None: (
        gpus if device_type in (None, "GPU") else [])
    with mock.patch.object(tf.config, "list_logical_devices", listing), \
         mock.patch.object(tf.config, "list_physical_devices", listing):
      if tf.sysconfig.get_build_info().get("is_cuda_build"):
        self.skipTest("this TensorFlow has NCCL kernels")
      with self.assertRaisesRegex(ValueError, "has no NCCL kernels"):
        rs.ReplicatorStrategy(devices=["/gpu:0", "/gpu:1"], all_reduce="nccl")
      # "auto" picks what works without NCCL.
      self.assertEqual(
          rs.ReplicatorStrategy(devices=["/gpu:0", "/gpu:1"]).extended
          .all_reduce_choice, "hierarchical_copy: separate GPUs without NCCL")

  def test_hierarchical_copy_on_an_odd_device_count_is_refused(self):
    # TF's implementation sums two halves of n // 2 devices: with 3 it
    # silently left the third replica out of every sum.
    with self.assertRaisesRegex(
        ValueError, "odd number of devices.*Received: "
        "all_reduce='hierarchical_copy' with 3 devices"):
      topology.strategy_over(3, all_reduce="hierarchical_copy")

  @parameterized.expand(["auto", "ring"])
  def test_instances_work_side_by_side(self, algorithm):
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

    steps = [(first, summed(first, 3), 3.0), (second, summed(second, 5), 3.0),
             (third, summed(third, 7), 10.0)]
    for _ in range(2):
      for strategy, step, total in steps:
        for r in strategy.experimental_local_results(step()):
          np.testing.assert_array_equal(r, np.full(r.shape, total))


def _per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(fn)


class CrossReplicaTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_reduce_with_and_without_axis_on_nests(self, _, n):
    strategy = topology.strategy_over(n)
    values = _per_replica(strategy, lambda ctx: {
        "a": tf.constant([1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1),
        "b": (tf.constant(float(ctx.replica_id_in_sync_group)),)})
    ids = np.arange(1, n + 1)
    no_axis = strategy.reduce("sum", values, axis=None)
    np.testing.assert_allclose(no_axis["a"], [ids.sum(), 2 * ids.sum()])
    np.testing.assert_allclose(no_axis["b"][0], (ids - 1).sum())
    mean_axis = strategy.reduce(tf.distribute.ReduceOp.MEAN, values["a"], axis=0)
    np.testing.assert_allclose(mean_axis, np.mean(np.concatenate(
        [[i, 2 * i] for i in ids])))
    np.testing.assert_allclose(strategy.reduce("max", values["a"], axis=0), 2 * n)
    np.testing.assert_allclose(strategy.reduce("min", values, axis=None)["a"],
                               [1.0, 2.0])

  @parameterized.expand(["sum", "mean", "max"])
  def test_reduce_names_a_none_element_by_its_path(self, op):
    strategy = topology.strategy_over(2)
    results = strategy.run(lambda: {"loss": tf.constant(1.0), "extra": (None,)})
    with self.assertRaisesRegex(
        ValueError, r"`value` given to strategy.reduce .*Received: "
        r"value\['extra'\]\[0\]=None"):
      strategy.reduce(op, results, axis=None)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_gather_and_local_results(self, _, n):
    strategy = topology.strategy_over(n)
    values = _per_replica(strategy, lambda ctx: tf.fill(
        [2, ctx.replica_id_in_sync_group + 1],
        float(ctx.replica_id_in_sync_group)))
    local = strategy.experimental_local_results(values)
    self.assertEqual(len(local), n)
    for i, v in enumerate(local):
      self.assertEqual(v.device, CPU % i)
    gathered = strategy.gather(values, axis=1)
    np.testing.assert_array_equal(
        gathered[0], np.concatenate([[i] * (i + 1) for i in range(n)]))

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_distribute_dataset_splits_the_global_batch_and_keeps_the_tail(self, _, n):
    strategy = topology.strategy_over(n)
    # 23 examples in global batches of 8: the last batch has 7.
    dataset = tf.data.Dataset.range(23).batch(8)
    seen = []
    for batch in strategy.experimental_distribute_dataset(dataset):
      parts = strategy.experimental_local_results(batch)
      self.assertEqual(len(parts), n)
      if len(seen) < 16:
        self.assertEqual([len(p) for p in parts], [8 // n] * n)
      seen.extend(np.concatenate([p.numpy() for p in parts]).tolist())
    self.assertEqual(seen, list(range(23)))

  def test_an_unbatched_dataset_is_refused_with_the_fix(self):
    strategy = topology.strategy_over(2)
    features = tf.data.Dataset.from_tensor_slices(
        {"x": tf.ones([8, 3]), "label": tf.range(8)})
    with self.assertRaisesRegex(
        ValueError, r"among 2 replicas, but this dataset has scalars with no "
        r"such dimension \(element\['label'\]\): it looks unbatched.*"
        r"dataset.batch\(global_batch_size\)"):
      strategy.experimental_distribute_dataset(features)
    batched = strategy.experimental_distribute_dataset(features.batch(4))
    first = strategy.experimental_local_results(next(iter(batched))["label"])
    self.assertEqual([p.numpy().tolist() for p in first], [[0, 1], [2, 3]])

  def test_one_replica_takes_an_unbatched_dataset_as_no_strategy_does(self):
    # Nothing is split, so elements pass as they are, batched or not.
    strategy = topology.strategy_over(1)
    dataset = tf.data.Dataset.range(3)
    got = [int(strategy.experimental_local_results(e)[0])
           for e in strategy.experimental_distribute_dataset(dataset)]
    self.assertEqual(got, [int(e) for e in dataset])

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_distributed_dataset_in_a_traced_loop(self, _, n):
    strategy = topology.strategy_over(n)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(20).map(lambda x: tf.cast(x, tf.float32)).batch(8))

    @tf.function
    def total():
      acc = tf.constant(0.0)
      for batch in dataset:
        acc += strategy.reduce("sum", strategy.run(tf.reduce_sum, (batch,)),
                               axis=None)
      return acc

    self.assertEqual(total().numpy(), sum(range(20)))

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_datasets_from_function_gets_the_per_replica_batch(self, _, n):
    strategy = topology.strategy_over(n)
    contexts = []

    def dataset_fn(ctx):
      contexts.append(ctx)
      return tf.data.Dataset.range(16).batch(ctx.get_per_replica_batch_size(8))

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    self.assertEqual(len(contexts), 1)
    self.assertEqual((contexts[0].num_replicas_in_sync,
                      contexts[0].num_input_pipelines), (n, 1))
    first = strategy.experimental_local_results(batches[0])
    self.assertEqual([len(p) for p in first], [8 // n] * n)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_reduce_to_and_batch_reduce_to(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(0.0)
    values = _per_replica(
        strategy, lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))
    ids = np.arange(1, n + 1)
    summed = strategy.extended.reduce_to("sum", values, destinations=var)
    self.assertEqual(
        [float(v) for v in strategy.experimental_local_results(summed)],
        [ids.sum()] * n)
    on_host = strategy.extended.reduce_to("mean", values, destinations="/cpu:0")
    self.assertEqual(float(strategy.experimental_local_results(on_host)[0]),
                     ids.mean())
    batched = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.MEAN, [(values, var), (values, var)])
    for result in batched:
      self.assertEqual(
          [float(v) for v in strategy.experimental_local_results(result)],
          [ids.mean()] * n)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_run_returns_per_replica_results_for_per_replica_args(self, _, n):
    strategy = topology.strategy_over(n)
    values = _per_replica(strategy, lambda ctx: tf.constant(
        float(ctx.replica_id_in_sync_group)))
    doubled = strategy.run(lambda x: x * 2.0, args=(values,))
    self.assertEqual([float(v) for v in strategy.experimental_local_results(
        doubled)], [2.0 * i for i in range(n)])

  def test_per_replica_input_mode_is_rejected_clearly(self):
    strategy = topology.strategy_over(2)
    options = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    with self.assertRaisesRegex(NotImplementedError, "PER_REPLICA"):
      strategy.distribute_datasets_from_function(
          lambda ctx: tf.data.Dataset.range(4), options)


if __name__ == "__main__":
  unittest.main()
