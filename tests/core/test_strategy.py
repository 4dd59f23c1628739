"""Construction, placement and the cross-replica API, on 1, 2 and 4 replicas.

The pieces the strategy is built from have their own tests: test_devices,
test_all_reduce, test_extended; here, that it puts them together.
"""

import re
import warnings
import unittest
from unittest import mock

from absl.testing import absltest  # noqa: F401  # pylint: disable=unused-import
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import replicator_strategy as rs
from replicator_strategy import devices
import topology

CPU = "/job:localhost/replica:0/task:0/device:CPU:%d"


class ConstructionTest(unittest.TestCase):

  def test_default_takes_every_local_device(self):
    strategy = rs.ReplicatorStrategy()
    self.assertEqual(strategy.extended.worker_devices, rs.local_devices())
    self.assertEqual(strategy.num_replicas_in_sync, len(rs.local_devices()))

  def test_explicit_devices_are_resolved_and_bad_ones_refused(self):
    strategy = rs.ReplicatorStrategy(devices=["/cpu:2", "CPU:0"])
    self.assertEqual(strategy.extended.worker_devices, (CPU % 2, CPU % 0))
    with self.assertRaises(ValueError) as raised:
      rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:9"])
    with self.assertRaises(ValueError) as resolved:
      devices.resolve_devices(["/cpu:0", "/cpu:9"])
    self.assertEqual(str(raised.exception), str(resolved.exception))

  def test_tpu_host_gets_not_implemented(self):
    tpu = tf.config.LogicalDevice(CPU.replace("CPU", "TPU") % 0, "TPU")
    listing = lambda device_type=None: (
        [tpu] if device_type in (None, "TPU") else [])
    with mock.patch.object(tf.config, "list_logical_devices", listing):
      with self.assertRaisesRegex(NotImplementedError, "TPUStrategy"):
        rs.ReplicatorStrategy()

  @parameterized.expand([
      ("infinite", float("inf")), ("nan", float("nan")), ("bool", True),
      ("beyond_the_bound", rs.strategy.MAX_TIMEOUT_SECONDS * 10),
      ("zero", 0), ("negative", -1), ("string", "60"), ("none", None),
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

    assert_per_replica(self, strategy, tf.function(lambda: strategy.run(fn))(),
                       [3.0, 3.0])

  def test_all_reduce_choice_is_reported_and_a_bad_one_refused(self):
    strategy = topology.strategy_over(4)
    self.assertEqual(strategy.extended.all_reduce_choice,
                     "add_on_one_device: devices share host memory")
    self.assertIn("all-reduce add_on_one_device", repr(strategy))
    given = topology.strategy_over(
        2, all_reduce=tf.distribute.ReductionToOneDevice())
    self.assertIn("given by the user", given.extended.all_reduce_choice)
    with self.assertRaisesRegex(ValueError, "Received: all_reduce='fast'"):
      rs.ReplicatorStrategy(all_reduce="fast")

  def test_topology_and_algorithm_are_logged_at_start(self):
    with self.assertLogs("absl", level="INFO") as logs:
      topology.strategy_over(2)
    self.assertEqual(len(logs.output), 1)
    self.assertRegex(logs.output[0], "2 replica.*CPU:0.*CPU:1.*add_on_one_device")

  def test_a_lone_cpu_gets_a_hint_that_split_cpu_gives_more_replicas(self):
    lone_cpu = ("/job:localhost/replica:0/task:0/device:CPU:0",)
    with mock.patch.object(devices, "local_devices", return_value=lone_cpu), \
        self.assertWarns(UserWarning) as warned:
      self.assertEqual(rs.ReplicatorStrategy().num_replicas_in_sync, 1)
    self.assertIn("no GPU, so 1 replica on the CPU. For testing, "
                  "replicator_strategy.split_cpu(n) before any TensorFlow op "
                  "gives n replicas", str(warned.warning))
    self.assertEqual(warned.filename, __file__)  # Points at the caller.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      rs.ReplicatorStrategy()  # 4 logical CPUs: no hint.
    self.assertNotIn("split_cpu", "\n".join(str(w.message) for w in caught))


def _per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(fn)


class GraphModeTest(unittest.TestCase):
  """TF1-style code: the strategy made and run inside `tf.Graph().as_default()`."""

  def test_devices_variables_and_run_in_a_graph(self):
    with tf.Graph().as_default():
      strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
      self.assertEqual(strategy.extended.worker_devices,
                       ("/job:localhost/replica:0/task:0/device:CPU:0",
                        "/job:localhost/replica:0/task:0/device:CPU:1"))
      with strategy.scope():
        v = tf.Variable(3.0)
      self.assertIsInstance(v, tf.distribute.DistributedValues)

      def fn():
        ctx = tf.distribute.get_replica_context()
        rank = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        return ctx.all_reduce("sum", rank + 1.0)

      summed = strategy.experimental_local_results(strategy.run(fn))
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        self.assertEqual(session.run(summed), (3.0, 3.0))
        self.assertEqual(session.run(strategy.experimental_local_results(v)),
                         (3.0, 3.0))

  def test_default_devices_in_a_graph_are_those_outside(self):
    eager = rs.ReplicatorStrategy().extended.worker_devices
    self.assertGreater(len(eager), 1)
    with tf.Graph().as_default():
      self.assertEqual(rs.ReplicatorStrategy().extended.worker_devices, eager)


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

  @parameterized.expand([("string", "0"), ("float", 0.0), ("bool", True),
                         ("list", [0]), ("tensor", tf.constant(0))])
  def test_reduce_refuses_an_axis_that_is_not_an_int_naming_axis(self, _, axis):
    # A string used to fail naming `reduction_indices`, a list or a tensor
    # with "unhashable type" (as in MirroredStrategy).
    strategy = topology.strategy_over(2)
    values = strategy.run(lambda: tf.ones([2, 3]))
    for op in ("sum", "mean", "max"):
      with self.assertRaises(TypeError) as raised:
        strategy.reduce(op, values, axis=axis)
      self.assertIn("Expected `axis` given to strategy.reduce to be None "
                    "(reduce across replicas only) or an int", str(raised.exception))
      self.assertIn(f"Received: axis={axis!r} of type {type(axis).__name__}.",
                    str(raised.exception))

  def test_reduce_refuses_an_axis_out_of_range_and_takes_numpy_ints(self):
    strategy = topology.strategy_over(2)
    values = strategy.run(lambda: {"x": tf.ones([2, 3])})
    with self.assertRaisesRegex(
        ValueError, r"Expected `axis` given to strategy.reduce to be in "
        r"\[-2, 2\) for value\['x'\] of shape \(2, 3\) \(each replica's\), "
        r"or None. Received: axis=5."):
      strategy.reduce("sum", values, axis=5)
    # MirroredStrategy's MEAN refuses NumPy ints; they are ints.
    for op in ("sum", "mean", "max"):
      np.testing.assert_allclose(
          strategy.reduce(op, values["x"], axis=np.int64(1)),
          strategy.reduce(op, values["x"], axis=1))

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
    assert_per_replica(self, strategy, next(iter(batched))["label"],
                       [np.array([0, 1]), np.array([2, 3])])

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
  def test_run_returns_per_replica_results_for_per_replica_args(self, _, n):
    strategy = topology.strategy_over(n)
    values = _per_replica(strategy, lambda ctx: tf.constant(
        float(ctx.replica_id_in_sync_group)))
    doubled = strategy.run(lambda x: x * 2.0, args=(values,))
    assert_per_replica(self, strategy, doubled, lambda replica: 2.0 * replica)

  def test_per_replica_input_mode_is_rejected_clearly(self):
    strategy = topology.strategy_over(2)
    options = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    with self.assertRaisesRegex(NotImplementedError, "PER_REPLICA"):
      strategy.distribute_datasets_from_function(
          lambda ctx: tf.data.Dataset.range(4), options)


if __name__ == "__main__":
  unittest.main()
