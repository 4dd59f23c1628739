"""`strategy.extended` on 1, 2 and 4 replicas, checked against NumPy.

Its public members only: topology, reductions and broadcasts to
destinations, gathers (through `strategy.gather`), variable updates, reads
and containers.
"""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import replicator_strategy as rs
import topology

CPU = "/job:localhost/replica:0/task:0/device:CPU:%d"
Agg = tf.VariableAggregation
ON_READ = tf.VariableSynchronization.ON_READ
_BASE = np.array([1.0, 2.0, 3.0], np.float32)
_MODES = [("eager", False), ("function", True)]
_REPLICAS_AND_MODES = [(f"{name}_{mode}", n, traced)
                       for name, n in topology.NAMED_REPLICA_COUNTS
                       for mode, traced in _MODES]
_SUM_AND_MEAN = [("sum", "sum", np.sum),
                 ("tf_sum", tf.distribute.ReduceOp.SUM, np.sum),
                 ("mean", "mean", np.mean),
                 ("tf_mean", tf.distribute.ReduceOp.MEAN, np.mean)]
_REPLICAS_AND_OPS = [(f"{name}_{op_name}", n, op, numpy_op)
                     for name, n in topology.NAMED_REPLICA_COUNTS
                     for op_name, op, numpy_op in _SUM_AND_MEAN]


def per_replica(strategy, fn):
  """The per-replica value `fn(replica id)`, made on each replica's device."""
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: fn(ctx.replica_id_in_sync_group))


def rows(r):
  """Replica r's float row: sums, means, mins all differ between replicas."""
  return tf.constant([r + 1.0, -(r + 1.0)**2, 10.0])


def numpy_rows(n):
  return np.stack([rows(r).numpy() for r in range(n)])


def ints(r):
  return tf.constant([r + 1, 2 * r], tf.int32)


def numpy_ints(n):
  return np.stack([ints(r).numpy() for r in range(n)])


class TopologyTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_one_replica_per_device_and_one_worker_the_chief(self, _, n):
    strategy = topology.strategy_over(n)
    extended = strategy.extended
    devices = tuple(CPU % i for i in range(n))
    self.assertIsInstance(extended, rs.ReplicatorExtended)
    self.assertEqual(strategy.num_replicas_in_sync, n)
    self.assertEqual(extended.worker_devices, devices)
    self.assertEqual(extended.parameter_devices, devices)
    self.assertEqual(extended.worker_devices_by_replica,
                     [[d] for d in devices])
    with strategy.scope():
      v = tf.Variable(1.0)
    self.assertEqual(tuple(extended.non_slot_devices([v])), devices)
    self.assertEqual((extended.should_checkpoint, extended.should_save_summary,
                      extended.experimental_should_init),
                     (True, True, True))
    self.assertFalse(extended.experimental_between_graph)


class ReduceToTest(unittest.TestCase):

  @parameterized.expand(_REPLICAS_AND_OPS)
  def test_to_a_mirrored_variable_every_replica_gets_the_result(
      self, _, n, op, numpy_op):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(tf.zeros([3]))
    reduced = strategy.extended.reduce_to(op, per_replica(strategy, rows),
                                          destinations=var)
    assert_per_replica(self, strategy, reduced,
                       [numpy_op(numpy_rows(n), axis=0)] * n, rtol=1e-6)

  @parameterized.expand(_REPLICAS_AND_OPS)
  def test_to_one_device_the_result_is_there(self, _, n, op, numpy_op):
    strategy = topology.strategy_over(n)
    values = per_replica(strategy, rows)
    for device in {0, n - 1}:  # The first device, and another.
      reduced = strategy.experimental_local_results(strategy.extended.reduce_to(
          op, values, destinations=f"/cpu:{device}"))
      self.assertEqual(len(reduced), 1)
      self.assertEqual(reduced[0].device, CPU % device)
      np.testing.assert_allclose(reduced[0],
                                 numpy_op(numpy_rows(n), axis=0), rtol=1e-6)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_int32_and_nests(self, _, n):
    strategy = topology.strategy_over(n)
    values = {"rows": per_replica(strategy, rows),
              "ints": (per_replica(strategy, ints),)}
    reduced = strategy.extended.reduce_to(
        "sum", values, destinations=values["rows"])
    assert_per_replica(self, strategy, reduced, [{
        "rows": numpy_rows(n).sum(axis=0),
        "ints": (numpy_ints(n).sum(axis=0),)}] * n, rtol=1e-6)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_mirrored_value_is_its_own_mean(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(_BASE)
    assert_per_replica(self, strategy,
                       strategy.extended.reduce_to("mean", var, var),
                       [_BASE] * n)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_plain_tensor_is_every_replicas_value(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(tf.zeros([3]))
    plain = tf.constant(_BASE)
    np.testing.assert_array_equal(
        strategy.extended.reduce_to("mean", plain, var), _BASE)
    if n == 1:
      assert_per_replica(self, strategy,
                         strategy.extended.reduce_to("sum", plain, var),
                         [_BASE])
    else:  # n copies of one value: TF refuses to guess a SUM.
      with self.assertRaisesRegex(ValueError, "cannot be reduced"):
        strategy.extended.reduce_to("sum", plain, var)


class BatchReduceToTest(unittest.TestCase):

  @parameterized.expand(_REPLICAS_AND_OPS)
  def test_values_to_their_own_devices(self, _, n, op, numpy_op):
    # The path Keras's gradients take: every value packed into one reduce.
    strategy = topology.strategy_over(n)
    values = [per_replica(strategy, lambda r, k=k: k * rows(r))
              for k in (1.0, 2.0, 3.0)]
    reduced = strategy.extended.batch_reduce_to(op, [(v, v) for v in values])
    self.assertEqual(len(reduced), 3)
    for k, result in zip((1.0, 2.0, 3.0), reduced):
      assert_per_replica(self, strategy, result,
                         [k * numpy_op(numpy_rows(n), axis=0)] * n,
                         rtol=1e-6, what=f"value {k}")

  @parameterized.expand(_REPLICAS_AND_OPS)
  def test_mixed_dtypes_and_destinations(self, _, n, op, numpy_op):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(tf.zeros([3]))
    floats, integers = per_replica(strategy, rows), per_replica(strategy, ints)
    reduced = strategy.extended.batch_reduce_to(
        op, [(floats, var), (integers, integers), (floats, "/cpu:0")])
    want = numpy_op(numpy_rows(n), axis=0)
    assert_per_replica(self, strategy, reduced[0], [want] * n, rtol=1e-6,
                       what="to a variable")
    # An int32 MEAN is the true mean (in float64), as in TF's strategies.
    assert_per_replica(self, strategy, reduced[1],
                       [numpy_op(numpy_ints(n), axis=0)] * n, what="int32")
    on_host = strategy.experimental_local_results(reduced[2])
    self.assertEqual([t.device for t in on_host], [CPU % 0])
    np.testing.assert_allclose(on_host[0], want, rtol=1e-6)

  def test_one_replica_takes_plain_tensors_without_destinations(self):
    # What merge_call hands over from a single replica's all_reduce.
    strategy = topology.strategy_over(1)
    reduced = strategy.extended.batch_reduce_to(
        "sum", [(tf.constant(_BASE), ""), (tf.constant(2.0), None)])
    assert_per_replica(self, strategy, reduced[0], [_BASE])
    assert_per_replica(self, strategy, reduced[1], [2.0])


class BroadcastToTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_tensor_reaches_every_destination(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      var = tf.Variable(tf.zeros([3]))
    with tf.device("/cpu:0"):
      tensor = tf.constant(_BASE)
    mirrored = strategy.extended.broadcast_to(tensor, destinations=var)
    assert_per_replica(self, strategy, mirrored, [_BASE] * n)
    self.assertEqual(
        [t.device for t in strategy.experimental_local_results(mirrored)],
        list(strategy.extended.worker_devices))
    last = strategy.experimental_local_results(strategy.extended.broadcast_to(
        tensor, destinations=f"/cpu:{n - 1}"))
    self.assertEqual([t.device for t in last], [CPU % (n - 1)])
    np.testing.assert_array_equal(last[0], _BASE)

  def test_python_numbers_wait_for_the_destination_dtype(self):
    strategy = topology.strategy_over(2)
    with strategy.scope():
      var = tf.Variable(0, dtype=tf.int64)
    self.assertEqual(strategy.extended.broadcast_to(3, var), 3)
    self.assertEqual(strategy.extended.broadcast_to(0.5, var), 0.5)


class GatherTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_along_any_axis_in_replica_order(self, _, n):
    strategy = topology.strategy_over(n)
    # Replica r holds a [2, r+1] block of r's: sizes differ along axis 1.
    blocks = per_replica(strategy, lambda r: tf.fill([2, r + 1], float(r)))
    gathered = strategy.gather(blocks, axis=1)
    want = np.concatenate([np.full([2, r + 1], float(r)) for r in range(n)],
                          axis=1)
    np.testing.assert_array_equal(gathered, want)
    self.assertEqual(gathered.device, CPU % 0)
    gathered_rows = strategy.gather(per_replica(strategy, ints), axis=0)
    np.testing.assert_array_equal(gathered_rows,
                                  numpy_ints(n).reshape(-1))

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_local_results_stay_on_their_devices(self, _, n):
    strategy = topology.strategy_over(n)
    local = strategy.experimental_local_results(per_replica(strategy, rows))
    self.assertEqual([t.device for t in local],
                     [CPU % i for i in range(n)])


class UpdateTest(unittest.TestCase):

  @parameterized.expand(_REPLICAS_AND_MODES)
  def test_fn_runs_once_per_component_on_its_device(self, _, n, traced):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(_BASE)
    devices = []

    def add(component, delta):
      devices.append(component.device)
      return component.assign_add(delta)

    def update():
      return strategy.extended.update(v, add, args=(10.0 * _BASE,),
                                      group=False)

    # group=False: one result per component, in replica order.
    result = tf.function(update)() if traced else update()
    self.assertEqual(devices, list(strategy.extended.worker_devices))
    self.assertEqual(len(result), n)
    for r in result:
      np.testing.assert_allclose(r, 11.0 * _BASE)
    assert_per_replica(self, strategy, v, [11.0 * _BASE] * n)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_each_component_gets_its_replicas_value(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(0.0, synchronization=ON_READ, aggregation=Agg.SUM)
    values = per_replica(strategy, lambda r: tf.constant(r + 1.0))
    strategy.extended.update(v, lambda c, x: c.assign(x), args=(values,))
    assert_per_replica(self, strategy, v, lambda r: r + 1.0)
    self.assertEqual(float(v.read_value()), n * (n + 1) / 2)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_update_non_slot_runs_on_every_non_slot_device(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(_BASE)
    colocate_with = strategy.extended.non_slot_devices([v])
    seen = []

    def fn(delta):
      seen.append(tf.constant(0.0).device)
      return tf.constant(_BASE) + delta

    results = strategy.extended.update_non_slot(colocate_with, fn,
                                                args=(1.0,), group=False)
    self.assertEqual(seen, list(strategy.extended.worker_devices))
    self.assertEqual(len(results), n)
    for r in results:
      np.testing.assert_array_equal(r, _BASE + 1.0)


class ReadVarTest(unittest.TestCase):

  @parameterized.expand([(f"{name}_{agg_name}", n, agg, numpy_op)
                         for name, n in topology.NAMED_REPLICA_COUNTS
                         for agg_name, agg, numpy_op in (
                             ("sum", Agg.SUM, np.sum),
                             ("mean", Agg.MEAN, np.mean))])
  def test_on_read_variables_read_aggregated(self, _, n, agg, numpy_op):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(tf.zeros([3]), synchronization=ON_READ, aggregation=agg)
    strategy.extended.update(v, lambda c, x: c.assign(x),
                             args=(per_replica(strategy, rows),))
    read = strategy.extended.read_var(v)
    np.testing.assert_allclose(read, numpy_op(numpy_rows(n), axis=0),
                               rtol=1e-6)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_mirrored_variables_read_their_value(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(_BASE)
    read = strategy.extended.read_var(v)
    np.testing.assert_array_equal(read, _BASE)
    v.assign(2.0 * _BASE)
    np.testing.assert_array_equal(read, _BASE)  # A copy, not a view.
    np.testing.assert_array_equal(strategy.extended.read_var(v), 2.0 * _BASE)


class ValueContainerTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_each_component_belongs_to_its_variable(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      mirrored = tf.Variable(_BASE)
      on_read = tf.Variable(0.0, synchronization=ON_READ,
                            aggregation=Agg.SUM)
    for v in (mirrored, on_read):
      self.assertIs(strategy.extended.value_container(v), v)
      for component in strategy.experimental_local_results(v):
        self.assertIsNot(component, v)
        self.assertIs(strategy.extended.value_container(component), v)

  def test_anything_else_is_its_own_container(self):
    strategy = topology.strategy_over(2)
    plain = tf.Variable(1.0)  # Made outside the scope.
    tensor = tf.constant(1.0)
    self.assertIs(strategy.extended.value_container(plain), plain)
    self.assertIs(strategy.extended.value_container(tensor), tensor)


if __name__ == "__main__":
  unittest.main()
