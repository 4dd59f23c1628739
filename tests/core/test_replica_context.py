"""Replica-context collectives, eagerly and in tf.function, on 1, 2, 4 replicas."""

import re
import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import replicator_strategy as rs
import topology

_MODES = [("eager", False), ("function", True)]
_CASES = [(f"{n}_replicas_{mode}", n, traced)
          for n in topology.REPLICA_COUNTS for mode, traced in _MODES]


def run(strategy, fn, traced):
  """strategy.run(fn), eagerly or inside a tf.function."""
  call = lambda: strategy.run(fn)
  return tf.function(call)() if traced else call()


def replica_value(offset=0.0):
  ctx = tf.distribute.get_replica_context()
  return tf.cast(ctx.replica_id_in_sync_group, tf.float32) + offset


class AllReduceTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_every_op_on_nested_structures(self, _, n, traced):
    strategy = topology.strategy_over(n)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = replica_value(1.0)  # 1..n
      vec = tf.stack([x, -x])
      return {op: ctx.all_reduce(op, {"s": x, "v": [vec]})
              for op in ("sum", "mean", "min", "max")}

    ids = np.arange(1, n + 1, dtype=np.float32)
    scalar = {"sum": ids.sum(), "mean": ids.mean(), "min": ids.min(),
              "max": ids.max()}
    vector = {"sum": [ids.sum(), -ids.sum()],
              "mean": [ids.mean(), -ids.mean()],
              "min": [ids.min(), -ids.max()],
              "max": [ids.max(), -ids.min()]}
    expected = {op: {"s": scalar[op], "v": [np.array(vector[op])]}
                for op in scalar}
    assert_per_replica(self, strategy, run(strategy, fn, traced),
                       [expected] * n, rtol=1e-7)

  # Every spelling of an op is parsed alike (test_reduce_op); these are the
  # op objects, which take other paths than names into the reduction.
  @parameterized.expand([(str(op), op, want) for op, want in (
      (tf.distribute.ReduceOp.SUM, 6.0), (tf.distribute.ReduceOp.MEAN, 1.5),
      (rs.ReduceOp.SUM, 6.0), (rs.ReduceOp.MEAN, 1.5), (rs.ReduceOp.MIN, 0.0),
      (rs.ReduceOp.MAX, 3.0))])
  def test_accepts_tf_and_own_reduce_ops(self, _, op, want):
    strategy = topology.strategy_over(4)
    fn = lambda: tf.distribute.get_replica_context().all_reduce(
        op, replica_value())
    assert_per_replica(self, strategy, run(strategy, fn, traced=True),
                       [want] * 4)

  def test_unknown_op_names_the_choices(self):
    strategy = topology.strategy_over(2)
    fn = lambda: tf.distribute.get_replica_context().all_reduce("prod", 1.0)
    with self.assertRaisesRegex(ValueError, "'sum', 'mean', 'min', 'max'.*'prod'"):
      strategy.run(fn)

  @parameterized.expand([
      (f"{api}_{mode}", api, traced)
      for api in ("all_reduce", "broadcast", "all_gather")
      for mode, traced in _MODES])
  def test_a_none_element_is_named_by_its_path(self, _, api, traced):
    strategy = topology.strategy_over(2)
    collective = {
        "all_reduce": lambda ctx, v: ctx.all_reduce("max", v),
        "broadcast": lambda ctx, v: ctx.broadcast(v),
        "all_gather": lambda ctx, v: ctx.all_gather(v, axis=0),
    }[api]

    def fn():
      x = tf.reshape(replica_value(), [1])
      return collective(tf.distribute.get_replica_context(),
                        {"loss": x, "aux": [x, None]})

    with self.assertRaisesRegex(
        ValueError, f"`value` given to ReplicaContext.{api} .*Received: "
        r"value\['aux'\]\[1\]=None"):
      run(strategy, fn, traced)

  @parameterized.expand(_CASES)
  def test_gradients(self, _, n, traced):
    strategy = topology.strategy_over(n)

    def fn():
      ctx = tf.distribute.get_replica_context()
      rid = ctx.replica_id_in_sync_group
      x = tf.cast(rid, tf.float32) + 1.0
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        sums = ctx.all_reduce("sum", x * 2.0)
        maxes = ctx.all_reduce("max", x)
        mins = ctx.all_reduce("min", x * x)
      return (tape.gradient(sums, x), tape.gradient(maxes, x),
              tape.gradient(mins, x))

    # d(sum_k 2 x_k)/dx_r summed over the n replicas' outputs = 2n. Every
    # replica's max is x_{n-1}: gradient n on that replica only. min(x^2) is
    # x_0^2 = 1: gradient n * 2 * x_0 on replica 0 only.
    assert_per_replica(
        self, strategy, run(strategy, fn, traced),
        lambda rid: (2.0 * n, n if rid == n - 1 else 0.0,
                     2.0 * n if rid == 0 else 0.0), rtol=1e-6)

  def test_ties_split_the_gradient(self):
    strategy = topology.strategy_over(4)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = tf.constant(5.0)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = ctx.all_reduce("max", x)
      return tape.gradient(y, x)

    # All four tie: the summed upstream gradient 4 is split four ways.
    assert_per_replica(self, strategy, run(strategy, fn, traced=True),
                       [1.0] * 4)


class SharedValueTest(unittest.TestCase):
  """A tensor made outside strategy.run: one value, already on every replica.

  SUM and MEAN return it as it is (as MirroredStrategy does, and Keras's
  optimizer tests expect); broadcast and gather see it in every replica.
  """

  @parameterized.expand(_CASES)
  def test_collectives_take_it_as_every_replicas_value(self, _, n, traced):
    strategy = topology.strategy_over(n)
    shared = tf.constant([2.0])

    def fn():
      ctx = tf.distribute.get_replica_context()
      return {"sum": ctx.all_reduce("sum", shared),
              "mean": ctx.all_reduce("mean", shared),
              "max": ctx.all_reduce("max", shared),
              "python_sum": ctx.all_reduce("sum", 3.0),
              "broadcast": ctx.broadcast(shared, source_replica_id=n - 1),
              "all_gather": ctx.all_gather(shared, axis=0)}

    two = np.array([2.0])
    assert_per_replica(self, strategy, run(strategy, fn, traced), [{
        "sum": two, "mean": two, "max": two, "python_sum": 3.0 * n,
        "broadcast": two, "all_gather": np.full(n, 2.0)}] * n)


class BroadcastTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_every_replica_gets_the_source_value(self, _, n, traced):
    strategy = topology.strategy_over(n)
    source = n - 1

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = replica_value()
      return ctx.broadcast({"a": x, "b": [tf.fill([2], x * 10)]},
                           source_replica_id=source)

    assert_per_replica(self, strategy, run(strategy, fn, traced),
                       [{"a": source, "b": [np.full(2, source * 10.0)]}] * n)

  @parameterized.expand(_CASES)
  def test_gradient_flows_to_source_only(self, _, n, traced):
    strategy = topology.strategy_over(n)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = replica_value(1.0)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = ctx.broadcast(x * 3.0) * replica_value(1.0)
      return tape.gradient(y, x)

    # d/dx_0 of sum_r 3 x_0 (r+1) = 3 * n(n+1)/2; zero elsewhere.
    assert_per_replica(
        self, strategy, run(strategy, fn, traced),
        lambda rid: 3.0 * n * (n + 1) / 2 if rid == 0 else 0.0, rtol=1e-6)

  def test_bad_source_replica(self):
    strategy = topology.strategy_over(2)
    fn = lambda: tf.distribute.get_replica_context().broadcast(1.0, 2)
    with self.assertRaisesRegex(ValueError, r"source_replica_id.*\[0, 2\).*2"):
      strategy.run(fn)


class ContextTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_ids_gather_and_merge_call(self, _, n, traced):
    strategy = topology.strategy_over(n)

    def fn():
      ctx = tf.distribute.get_replica_context()
      assert isinstance(ctx, rs.ReplicaContext), type(ctx)
      x = replica_value()
      gathered = ctx.all_gather({"row": tf.fill([1, 2], x)}, axis=0)
      merged = ctx.merge_call(
          lambda strategy, v: strategy.reduce("sum", v, axis=None), args=(x,))
      return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync,
              gathered["row"], merged)

    rows = np.repeat(np.arange(n, dtype=np.float32)[:, None], 2, axis=1)
    assert_per_replica(self, strategy, run(strategy, fn, traced),
                       lambda rid: (rid, n, rows, n * (n - 1) / 2))

  @parameterized.expand([
      (f"{api}_{mode}", api, traced)
      for api in ("merge_call", "all_reduce", "broadcast", "all_gather")
      for mode, traced in _MODES])
  def test_replica_calls_inside_a_merge_function_are_refused(self, _, api,
                                                             traced):
    strategy = topology.strategy_over(2)
    nested = {
        "merge_call": lambda ctx, v: ctx.merge_call(lambda s, x: x, args=(v,)),
        "all_reduce": lambda ctx, v: ctx.all_reduce("sum", v),
        "broadcast": lambda ctx, v: ctx.broadcast(v),
        "all_gather": lambda ctx, v: ctx.all_gather(v, axis=0),
    }[api]

    def fn():
      ctx = tf.distribute.get_replica_context()
      # merge_fn runs in cross-replica context: it gets every replica's x.
      return ctx.merge_call(lambda strategy, x: nested(ctx, x),
                            args=(tf.reshape(replica_value(), [1]),))

    with self.assertRaisesRegex(
        RuntimeError, f"ReplicaContext.{api} was called in cross-replica "
        "context, most likely inside a merge function"):
      run(strategy, fn, traced)

  def test_all_gather_gradient(self):
    strategy = topology.strategy_over(2)

    def fn():
      ctx = tf.distribute.get_replica_context()
      x = tf.reshape(replica_value(1.0), [1])
      with tf.GradientTape() as tape:
        tape.watch(x)
        g = ctx.all_gather(x, axis=0)  # [1, 2] everywhere
        y = tf.reduce_sum(g * tf.constant([10.0, 100.0]))
      return tape.gradient(y, x)

    assert_per_replica(self, strategy, run(strategy, fn, traced=True),
                       [np.array([20.0]), np.array([200.0])], rtol=1e-7)

  @parameterized.expand([("eager", False), ("traced", True)])
  def test_all_gather_of_other_dimensions_differing_names_them(self, _,
                                                               traced):
    # It used to fail in TF's concat: "Dimension 0 in both shapes must be
    # equal, but are 3 and 4" (dimensions counted without the gathered one).
    strategy = topology.strategy_over(2)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([2, 3 + ctx.replica_id_in_sync_group]))
    gather = lambda x: tf.distribute.get_replica_context().all_gather(
        {"a": x}, axis=0)
    call = (tf.function(lambda v: strategy.run(gather, args=(v,))) if traced
            else lambda v: strategy.run(gather, args=(v,)))
    with self.assertRaisesRegex(
        ValueError, re.escape(
            "ReplicaContext.all_gather concatenates every replica's "
            "value['a'] along axis=0, so its other dimensions must be the "
            "same on every replica, but dimension 1 differs. Received "
            "shapes: replica 0: (2, 3), replica 1: (2, 4).")):
      call(values)


if __name__ == "__main__":
  unittest.main()
