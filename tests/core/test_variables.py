"""Distributed variables on 1, 2, 4 replicas: creation, updates, checkpoints.

Everything goes through the public API: `tf.Variable` under `scope()`,
updates inside and outside `strategy.run`, `colocate_vars_with` and
`tf.train.Checkpoint`. (`strategy.extended.update`: test_extended.)
"""

import contextlib
import os
import tempfile
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import topology

Agg = tf.VariableAggregation
ON_READ = tf.VariableSynchronization.ON_READ

_MODES = [("eager", False), ("function", True)]
_BASE = np.array([1.0, 2.0, 3.0], np.float32)
_ON_WRITE_AGGREGATIONS = [("none", Agg.NONE), ("sum", Agg.SUM),
                          ("mean", Agg.MEAN),
                          ("only_first_replica", Agg.ONLY_FIRST_REPLICA)]
_ON_READ_AGGREGATIONS = [("sum", Agg.SUM), ("mean", Agg.MEAN)]


def _cases(*axes):
  """The cross product of named axes as parameterized.expand rows."""
  rows = [("", ())]
  for axis in axes:
    rows = [(f"{name}_{n}" if name else n, values + (v,))
            for name, values in rows for n, v in axis]
  return [(name,) + values for name, values in rows]


_REPLICAS = [(f"{n}_replicas", n) for n in topology.REPLICA_COUNTS]


def components(strategy, v):
  """Every replica's component of `v` as numpy (one for a plain variable)."""
  strategy = strategy or tf.distribute.get_strategy()
  return [np.asarray(c) for c in strategy.experimental_local_results(v)]


def run(strategy, fn, traced):
  """strategy.run(fn), eagerly or inside a tf.function."""
  call = lambda: strategy.run(fn)
  return tf.function(call)() if traced else call()


def replica_scale():
  """1 + replica id: 1 on replica 0, ..., n on replica n-1."""
  ctx = tf.distribute.get_replica_context()
  return 1.0 + tf.cast(ctx.replica_id_in_sync_group, tf.float32)


def aggregated_scale(aggregation, n):
  """What `aggregation` makes of the values 1..n (NONE: every replica's 1)."""
  scales = np.arange(1, n + 1, dtype=np.float32)
  return {Agg.NONE: 1.0, Agg.SUM: scales.sum(), Agg.MEAN: scales.mean(),
          Agg.ONLY_FIRST_REPLICA: scales[0]}[aggregation]


class CreationTest(unittest.TestCase):

  @parameterized.expand(_cases(_REPLICAS, _ON_WRITE_AGGREGATIONS))
  def test_on_write_variable_is_mirrored_on_every_device(self, _, n, agg):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(_BASE, aggregation=agg)
    self.assertEqual(type(v).__name__, "MirroredVariable")
    self.assertIsInstance(v, tf.distribute.DistributedValues)
    self.assertEqual(v.aggregation, agg)
    self.assertEqual(v.synchronization, tf.VariableSynchronization.ON_WRITE)
    self.assertIs(v.distribute_strategy, strategy)
    self.assertEqual([c.device for c in strategy.experimental_local_results(v)],
                     list(strategy.extended.worker_devices))
    assert_per_replica(self, strategy, v, [_BASE] * n)

  @parameterized.expand(_cases(_REPLICAS, _ON_READ_AGGREGATIONS))
  def test_on_read_variable_is_sync_on_read(self, _, n, agg):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(_BASE, synchronization=ON_READ, aggregation=agg)
    self.assertEqual(type(v).__name__, "SyncOnReadVariable")
    self.assertEqual(v.aggregation, agg)
    self.assertEqual([c.device for c in strategy.experimental_local_results(v)],
                     list(strategy.extended.worker_devices))

  @parameterized.expand(_REPLICAS)
  def test_random_initializer_gives_identical_components(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(lambda: tf.random.normal([8, 8]))
      dense = keras.layers.Dense(16)
      dense.build((None, 8))
    for var in (v, dense.kernel.value):
      first = components(strategy, var)[0]
      self.assertGreater(np.std(first), 0.1)  # really random, not constant
      assert_per_replica(self, strategy, var, [first] * n)


class OnWriteUpdateTest(unittest.TestCase):

  @parameterized.expand(_cases(_REPLICAS, _ON_WRITE_AGGREGATIONS, _MODES))
  def test_replica_context_updates_aggregate(self, _, n, agg, traced):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(np.zeros(3, np.float32), aggregation=agg)
    # NONE needs the same value on every replica; the others get 1 + id.
    scale = (lambda: tf.constant(1.0)) if agg == Agg.NONE else replica_scale
    a = aggregated_scale(agg, n) * _BASE

    def update(method, factor):
      def fn():
        getattr(v, method)(factor * scale() * _BASE)
        return v.read_value()
      return fn

    for method, factor, expected in [("assign", 1.0, a),
                                     ("assign_add", 2.0, 3 * a),
                                     ("assign_sub", 1.0, 2 * a)]:
      assert_per_replica(self, strategy, run(strategy, update(method, factor),
                                             traced),
                         [expected] * n, rtol=1e-6, what=f"{method}, read")
      assert_per_replica(self, strategy, v, [expected] * n, rtol=1e-6,
                         what=method)

  @parameterized.expand(_cases(_REPLICAS, _ON_WRITE_AGGREGATIONS, _MODES))
  def test_cross_replica_updates_reach_every_component(self, _, n, agg,
                                                       traced):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(np.zeros(3, np.float32), aggregation=agg)

    def update(method, delta):
      fn = lambda: getattr(v, method)(delta)
      return tf.function(fn)() if traced else fn()

    for method, delta, expected in [("assign", 4 * _BASE, 4 * _BASE),
                                    ("assign_add", 2 * _BASE, 6 * _BASE),
                                    ("assign_sub", _BASE, 5 * _BASE)]:
      update(method, delta)
      assert_per_replica(self, strategy, v, [expected] * n, what=method)
      np.testing.assert_array_equal(v.numpy(), expected, err_msg=method)

  @parameterized.expand(_cases(_REPLICAS, _MODES))
  def test_integer_only_first_replica_counter(self, _, n, traced):
    # The Keras optimizer's `iterations`: int64, ONLY_FIRST_REPLICA.
    strategy = topology.strategy_over(n)
    with strategy.scope():
      step = tf.Variable(0, dtype=tf.int64, aggregation=Agg.ONLY_FIRST_REPLICA)
    for _ in range(3):
      run(strategy, lambda: step.assign_add(1), traced)
    assert_per_replica(self, strategy, step, [3] * n)


class OnReadUpdateTest(unittest.TestCase):

  @parameterized.expand(_cases(_REPLICAS, _ON_READ_AGGREGATIONS, _MODES))
  def test_replica_updates_stay_local_and_reads_aggregate(self, _, n, agg,
                                                          traced):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(np.zeros(3, np.float32), synchronization=ON_READ,
                      aggregation=agg)

    def fn():
      x = replica_scale() * _BASE
      v.assign(x)
      v.assign_add(2.0 * x)
      v.assign_sub(x)
      return v.read_value()

    local = [2.0 * (1 + i) * _BASE for i in range(n)]
    assert_per_replica(self, strategy, run(strategy, fn, traced), local,
                       rtol=1e-7, what="read in replica context")
    assert_per_replica(self, strategy, v, local, rtol=1e-7)

    total = np.sum(local, axis=0)
    expected = total if agg == Agg.SUM else total / n
    np.testing.assert_allclose(v.read_value(), expected, rtol=1e-6)
    np.testing.assert_allclose(tf.convert_to_tensor(v), expected, rtol=1e-6)
    np.testing.assert_allclose(tf.function(v.read_value)(), expected,
                               rtol=1e-6)

  @parameterized.expand(_cases(_REPLICAS, _ON_READ_AGGREGATIONS))
  def test_cross_replica_assign_is_read_back(self, _, n, agg):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      v = tf.Variable(np.zeros(3, np.float32), synchronization=ON_READ,
                      aggregation=agg)
    v.assign(6.0 * _BASE)
    np.testing.assert_allclose(v.read_value(), 6.0 * _BASE, rtol=1e-6)
    # SUM puts the value in the first replica and zeros in the others, so
    # the sum reads it back exactly.
    want = ([6.0 * _BASE] + [0.0 * _BASE] * (n - 1) if agg == Agg.SUM
            else [6.0 * _BASE] * n)
    assert_per_replica(self, strategy, v, want, rtol=1e-6)
    if agg == Agg.MEAN:
      v.assign_add(_BASE)
      np.testing.assert_allclose(v.read_value(), 7.0 * _BASE, rtol=1e-6)
    else:
      with self.assertRaisesRegex(ValueError, "assign_add"):
        v.assign_add(_BASE)


class ColocateTest(unittest.TestCase):

  @parameterized.expand(_REPLICAS)
  def test_colocated_variable_lives_with_its_anchor(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      anchor = tf.Variable(_BASE)
      with strategy.extended.colocate_vars_with(anchor):
        slot = tf.Variable(lambda: 2.0 * anchor.read_value(),
                           aggregation=Agg.SUM)
    self.assertEqual(type(slot).__name__, "MirroredVariable")
    self.assertEqual(
        [c.device for c in strategy.experimental_local_results(slot)],
        [c.device for c in strategy.experimental_local_results(anchor)])
    assert_per_replica(self, strategy, slot, [2.0 * _BASE] * n)
    run(strategy, lambda: slot.assign(replica_scale() * _BASE), traced=True)
    assert_per_replica(self, strategy, slot, [n * (n + 1) / 2 * _BASE] * n,
                       rtol=1e-7)

  @parameterized.expand(_REPLICAS)
  def test_optimizer_slots_share_their_variables_devices(self, _, n):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      dense = keras.layers.Dense(3)
      dense.build((None, 2))
      optimizer = keras.optimizers.Adam()
      optimizer.build(dense.trainable_variables)
    want = [c.device for c in
            strategy.experimental_local_results(dense.kernel.value)]
    slots = [s for s in optimizer.variables if tuple(s.shape) == (2, 3)]
    self.assertEqual(len(slots), 2)  # momentum and velocity of the kernel
    for slot in slots:
      self.assertEqual(
          [c.device for c in strategy.experimental_local_results(slot.value)],
          want)


def _strategy(n):
  return topology.strategy_over(n) if n else None


def _scope(strategy):
  return strategy.scope() if strategy else contextlib.nullcontext()


def _build_model_and_optimizer(seed):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                            keras.layers.Dense(2)])
  optimizer = keras.optimizers.Adam(learning_rate=0.1)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def _keras_state(test, strategy, model, optimizer):
  """Every weight and optimizer variable; asserts replicas agree on each."""
  strategy = strategy or tf.distribute.get_strategy()
  state = []
  for v in model.weights + optimizer.variables:
    first = components(strategy, v.value)[0]
    assert_per_replica(test, strategy, v.value,
                       [first] * strategy.num_replicas_in_sync, what=v.path)
    state.append(first)
  return state


class CheckpointTest(unittest.TestCase):
  """Saved under N replicas (0: no strategy), restored under M."""

  @parameterized.expand([
      (f"save_{s or 'none'}_restore_{r or 'none'}", s, r)
      for s in (0,) + topology.REPLICA_COUNTS
      for r in (0,) + topology.REPLICA_COUNTS if (s, r) != (0, 0)])
  def test_restore_across_replica_counts(self, _, save_n, restore_n):
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    mirrored_value = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    # What the per-replica values 1..save_n sum to (one 1 without strategy).
    local_sum = float(save_n * (save_n + 1) / 2) if save_n else 1.0
    local_mean = local_sum / max(save_n, 1)

    saving = _strategy(save_n)
    with _scope(saving):
      mirrored = tf.Variable(np.zeros((2, 3), np.float32),
                             aggregation=Agg.MEAN)
      summed = tf.Variable(0.0, synchronization=ON_READ, aggregation=Agg.SUM)
      averaged = tf.Variable(0.0, synchronization=ON_READ,
                             aggregation=Agg.MEAN)
      model, optimizer = _build_model_and_optimizer(seed=1)
    mirrored.assign(mirrored_value)

    def local_step():
      scale = replica_scale() if saving else tf.constant(1.0)
      summed.assign_add(scale)
      averaged.assign_add(scale)
      x = tf.reshape(tf.range(8, dtype=tf.float32), (2, 4)) * scale
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - 1.0))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if saving:
      saving.run(local_step)
    else:
      local_step()
    saved_state = _keras_state(self, saving, model, optimizer)
    self.assertEqual(int(optimizer.iterations.numpy()), 1)
    tf.train.Checkpoint(mirrored=mirrored, summed=summed, averaged=averaged,
                        model=model, optimizer=optimizer).write(path)

    restoring = _strategy(restore_n)
    with _scope(restoring):
      mirrored2 = tf.Variable(np.ones((2, 3), np.float32),
                              aggregation=Agg.MEAN)
      summed2 = tf.Variable(0.0, synchronization=ON_READ, aggregation=Agg.SUM)
      averaged2 = tf.Variable(0.0, synchronization=ON_READ,
                              aggregation=Agg.MEAN)
      model2, optimizer2 = _build_model_and_optimizer(seed=2)
    fresh_state = _keras_state(self, restoring, model2, optimizer2)
    self.assertFalse(all(np.array_equal(a, b)
                         for a, b in zip(saved_state, fresh_state)))

    tf.train.Checkpoint(
        mirrored=mirrored2, summed=summed2, averaged=averaged2, model=model2,
        optimizer=optimizer2).read(path).assert_consumed()

    assert_per_replica(self, restoring or tf.distribute.get_strategy(),
                       mirrored2, [mirrored_value] * max(restore_n, 1),
                       what="mirrored")
    self.assertAlmostEqual(float(summed2.read_value()), local_sum, places=5)
    self.assertAlmostEqual(float(averaged2.read_value()), local_mean,
                           places=5)
    restored_state = _keras_state(self, restoring, model2, optimizer2)
    self.assertEqual(len(restored_state), len(saved_state))
    for got, want, v in zip(restored_state, saved_state,
                            model2.weights + optimizer2.variables):
      np.testing.assert_array_equal(got, want, err_msg=v.path)
    self.assertEqual(int(optimizer2.iterations.numpy()), 1)


if __name__ == "__main__":
  unittest.main()
