"""ReplicaContext.reduce_scatter and all_to_all against NumPy, on 1, 2, 4 replicas.

Each replica's value is a row of one NumPy array (random, so MIN/MAX have no
ties); the expected results and gradients are computed from that array.
"""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
import topology

_MODES = [("eager", False), ("function", True)]
_CASES = [(f"{n}_replicas_{mode}", n, traced)
          for n in topology.REPLICA_COUNTS for mode, traced in _MODES]
_OPS = ("sum", "mean", "min", "max")
_NP_OPS = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max}
# (split_axis, concat_axis) pairs for all_to_all; negative axes count too.
_AXES = ((0, 0), (0, 1), (1, 0), (-1, -1))


def replica_values(n, shape, seed=0):
  """[n, *shape]: replica r's value is row r."""
  return np.random.default_rng(seed).normal(size=(n, *shape)).astype(
      np.float32)


def own_row(array):
  """This replica's row of `array` (a NumPy array, one row per replica)."""
  ctx = tf.distribute.get_replica_context()
  return tf.gather(tf.constant(array), ctx.replica_id_in_sync_group)


def run_per_replica(strategy, fn, traced):
  run = lambda: strategy.run(fn)
  if traced:
    run = tf.function(run)
  return [tf.nest.map_structure(np.asarray, r)
          for r in strategy.experimental_local_results(run())]


def expected_reduce_scatter(op, values, axis):
  """Per replica: slice r of the values reduced over replicas."""
  reduced = _NP_OPS[op](values, axis=0)
  return np.split(reduced, len(values), axis=axis)


def expected_all_to_all(values, split_axis, concat_axis):
  """Per replica j: slice j of every replica's value, concatenated."""
  n = len(values)
  return [np.concatenate([np.split(v, n, axis=split_axis)[j] for v in values],
                         axis=concat_axis) for j in range(n)]


class ReduceScatterTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_every_op_on_nested_structures(self, _, n, traced):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 3))
    ys = replica_values(n, (4, 8), seed=1)

    def fn():
      ctx = tf.distribute.get_replica_context()
      value = {"x": own_row(xs), "more": [own_row(ys)]}
      return {op: (ctx.reduce_scatter(op, value),
                   ctx.reduce_scatter(op, own_row(ys), axis=-1))
              for op in _OPS}

    results = run_per_replica(strategy, fn, traced)
    for op in _OPS:
      for r, result in enumerate(results):
        on_axis_0, on_last_axis = result[op]
        np.testing.assert_allclose(
            on_axis_0["x"], expected_reduce_scatter(op, xs, 0)[r], rtol=1e-6)
        np.testing.assert_allclose(
            on_axis_0["more"][0], expected_reduce_scatter(op, ys, 0)[r],
            rtol=1e-6)
        np.testing.assert_allclose(
            on_last_axis, expected_reduce_scatter(op, ys, 1)[r], rtol=1e-6)

  @parameterized.expand([(str(op), op) for op in (
      tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN,
      rs.ReduceOp.MIN, rs.ReduceOp.MAX, "Max")])
  def test_accepts_tf_and_own_reduce_ops(self, _, op):
    strategy = topology.strategy_over(2)
    xs = replica_values(2, (4,))
    fn = lambda: tf.distribute.get_replica_context().reduce_scatter(
        op, own_row(xs))
    name = getattr(op, "name", None) or op.upper()
    for r, result in enumerate(run_per_replica(strategy, fn, traced=True)):
      np.testing.assert_allclose(
          result, expected_reduce_scatter(name.lower(), xs, 0)[r], rtol=1e-6)

  @parameterized.expand(_CASES)
  def test_gradients(self, _, n, traced):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 2))
    weights = replica_values(n, (4 // n, 2), seed=2)  # One per output slice.

    def fn():
      x = own_row(xs)
      ctx = tf.distribute.get_replica_context()
      grads = {}
      for op in _OPS:
        with tf.GradientTape() as tape:
          tape.watch(x)
          loss = tf.reduce_sum(ctx.reduce_scatter(op, x) * own_row(weights))
        grads[op] = tape.gradient(loss, x)
      return grads

    # Each replica's gradient is that of the sum of every replica's loss.
    upstream = np.concatenate(list(weights), axis=0)
    extremes = {"min": xs.min(axis=0), "max": xs.max(axis=0)}
    for r, grads in enumerate(run_per_replica(strategy, fn, traced)):
      np.testing.assert_allclose(grads["sum"], upstream, rtol=1e-6)
      np.testing.assert_allclose(grads["mean"], upstream / n, rtol=1e-6)
      for op, extreme in extremes.items():
        np.testing.assert_allclose(
            grads[op], np.where(xs[r] == extreme, upstream, 0.0), rtol=1e-6)

  @parameterized.expand(_MODES)
  def test_gradient_of_a_slice_read_with_gather_is_dense(self, _, traced):
    # The upstream gradient arrives as IndexedSlices; traced, it failed
    # inside custom_gradient ("Expected a type in (Tensor), got
    # IndexedSlices"), eagerly all_gather densified it.
    n = 2
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4,))

    def fn():
      x = own_row(xs)
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.gather(
            tf.distribute.get_replica_context().reduce_scatter("sum", x), [1]))
      return tape.gradient(loss, x)

    # Replica r's loss reads row 1 of its slice r: row 2r + 1 of the sum.
    for grad in run_per_replica(strategy, fn, traced):
      np.testing.assert_allclose(grad, [0.0, 1.0, 0.0, 1.0])

  def test_ties_split_the_gradient(self):
    strategy = topology.strategy_over(4)

    def fn():
      x = tf.fill([4], 5.0)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.distribute.get_replica_context().reduce_scatter("max", x)
      return tape.gradient(y, x)

    # Every replica ties everywhere: each slice's gradient 1 is split 4 ways.
    for result in run_per_replica(strategy, fn, traced=True):
      np.testing.assert_allclose(result, [0.25] * 4)


class AllToAllTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_slices_reach_their_replica_on_nested_structures(self, _, n,
                                                           traced):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 8))

    def fn():
      ctx = tf.distribute.get_replica_context()
      return [ctx.all_to_all({"x": [own_row(xs)]}, split, concat)
              for split, concat in _AXES]

    results = run_per_replica(strategy, fn, traced)
    for (split, concat), got in zip(_AXES, zip(*results)):
      expected = expected_all_to_all(xs, split, concat)
      for j in range(n):
        np.testing.assert_allclose(got[j]["x"][0], expected[j])

  @parameterized.expand(_CASES)
  def test_gradient_is_the_all_to_all_with_axes_swapped(self, _, n, traced):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 4))
    weights = replica_values(n, (4 // n, 4 * n), seed=3)

    def fn():
      x = own_row(xs)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.distribute.get_replica_context().all_to_all(
            x, split_axis=0, concat_axis=1)
        loss = tf.reduce_sum(y * own_row(weights))
      return tape.gradient(loss, x)

    # d(sum_j <w_j, y_j>)/dx_r: slice r (along axis 1) of every w_j,
    # stacked along axis 0 in order of j.
    expected = [np.concatenate([np.split(w, n, axis=1)[r] for w in weights],
                               axis=0) for r in range(n)]
    for r, grad in enumerate(run_per_replica(strategy, fn, traced)):
      np.testing.assert_allclose(grad, expected[r], rtol=1e-6)


class InsideControlFlowTest(unittest.TestCase):
  """In a tf.cond branch the replicas launch run-time collectives."""

  @parameterized.expand([(f"{n}_replicas", n) for n in topology.REPLICA_COUNTS])
  def test_reduce_scatter_and_all_to_all_inside_a_cond(self, _, n):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 8))

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = own_row(xs)
      always = ctx.replica_id_in_sync_group >= 0
      scattered = {
          op: tf.cond(always, lambda op=op: ctx.reduce_scatter(op, [x], 1),
                      lambda: [x[:, :8 // n]])
          for op in _OPS}
      exchanged = tf.cond(always, lambda: ctx.all_to_all(x, 1, 0),
                          lambda: tf.zeros([4 * n, 8 // n]))
      return scattered, exchanged

    results = run_per_replica(strategy, fn, traced=True)
    expected_exchange = expected_all_to_all(xs, 1, 0)
    for r, (scattered, exchanged) in enumerate(results):
      for op in _OPS:
        np.testing.assert_allclose(
            scattered[op][0], expected_reduce_scatter(op, xs, 1)[r],
            rtol=1e-6)
      np.testing.assert_allclose(exchanged, expected_exchange[r])

  @parameterized.expand([(f"{n}_replicas", n) for n in topology.REPLICA_COUNTS])
  def test_gradients_inside_a_cond(self, _, n):
    strategy = topology.strategy_over(n)
    xs = replica_values(n, (4, 4))
    weights = replica_values(n, (4 // n, 4), seed=2)
    a2a_weights = replica_values(n, (4 // n, 4 * n), seed=3)

    def fn():
      x = own_row(xs)
      ctx = tf.distribute.get_replica_context()
      always = ctx.replica_id_in_sync_group >= 0
      calls = {op: (lambda op=op: ctx.reduce_scatter(op, x), weights)
               for op in _OPS}
      calls["all_to_all"] = (
          lambda: ctx.all_to_all(x, split_axis=0, concat_axis=1), a2a_weights)
      grads = {}
      for name, (f, w) in calls.items():
        with tf.GradientTape() as tape:
          tape.watch(x)
          loss = tf.reduce_sum(tf.cond(always, f, f) * own_row(w))
        grads[name] = tape.gradient(loss, x)
      return grads

    upstream = np.concatenate(list(weights), axis=0)
    extremes = {"min": xs.min(axis=0), "max": xs.max(axis=0)}
    for r, grads in enumerate(run_per_replica(strategy, fn, traced=True)):
      np.testing.assert_allclose(grads["sum"], upstream, rtol=1e-6)
      np.testing.assert_allclose(grads["mean"], upstream / n, rtol=1e-6)
      for op, extreme in extremes.items():
        np.testing.assert_allclose(
            grads[op], np.where(xs[r] == extreme, upstream, 0.0), rtol=1e-6)
      np.testing.assert_allclose(
          grads["all_to_all"],
          np.concatenate([np.split(w, n, axis=1)[r] for w in a2a_weights],
                         axis=0), rtol=1e-6)


  def test_a_persistent_tape_through_a_collective_in_a_cond_is_refused(self):
    strategy = topology.strategy_over(2)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = tf.ones([2])
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = tf.cond(ctx.replica_id_in_sync_group >= 0,
                    lambda: ctx.reduce_scatter("sum", x), lambda: x[:1])
      return tape.gradient(y, x)

    with self.assertRaisesRegex(NotImplementedError,
                                "non-persistent GradientTape"):
      run_per_replica(strategy, fn, traced=True)


class UnevenSizeTest(unittest.TestCase):

  @parameterized.expand([
      (f"{api}_{mode}", api, traced)
      for api in ("reduce_scatter", "all_to_all") for mode, traced in _MODES])
  def test_a_size_not_divisible_by_the_replicas_is_refused(self, _, api,
                                                           traced):
    strategy = topology.strategy_over(4)
    collective = {
        "reduce_scatter": lambda ctx, v: ctx.reduce_scatter("sum", v, 1),
        "all_to_all": lambda ctx, v: ctx.all_to_all(v, 1, 0),
    }[api]
    fn = lambda: collective(tf.distribute.get_replica_context(),
                            {"ok": tf.ones([2, 8]), "odd": [tf.ones([2, 6])]})
    with self.assertRaisesRegex(
        ValueError, rf"ReplicaContext.{api} cuts each tensor of `value` into "
        r"4 equal slices.*multiple of 4. Received: value\['odd'\]\[0\] of "
        r"shape \(2, 6\), size 6 along axis 1. Pad it"):
      run_per_replica(strategy, fn, traced)

  def test_a_bad_axis_is_named(self):
    strategy = topology.strategy_over(2)
    fn = lambda: tf.distribute.get_replica_context().all_to_all(
        tf.ones([2, 2]), split_axis=0, concat_axis=2)
    with self.assertRaisesRegex(
        ValueError, r"`concat_axis` .* int in \[-2, 2\).*concat_axis=2"):
      run_per_replica(strategy, fn, traced=True)


if __name__ == "__main__":
  unittest.main()
