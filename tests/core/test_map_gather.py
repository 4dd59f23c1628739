"""ReplicaContext.map_gather: each thunk on one replica, every result everywhere.

Checked against every replica computing every thunk itself, eagerly, in a
tf.function and inside a tf.cond, on 1, 2 and 4 replicas.
"""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import topology

NUM_THUNKS = 5  # Uneven over 2 and 4 replicas.
_MODES = [("eager", "eager"), ("function", "function"), ("in_cond", "in_cond")]
_CASES = [(f"{n}_replicas_{name}", n, mode)
          for n in topology.REPLICA_COUNTS for name, mode in _MODES]


def _matrices():
  """NUM_THUNKS symmetric positive definite 3x3 matrices."""
  a = np.random.default_rng(7).normal(size=(NUM_THUNKS, 3, 3))
  return (a @ a.transpose(0, 2, 1) + 3 * np.eye(3)).astype("float32")


MATRICES = _matrices()


def _factors(k, scale=1.0):
  """Thunk k's work: a nested structure, as K-FAC's per-layer factors."""
  a = tf.constant(MATRICES[k]) * scale
  return {"inverse": tf.linalg.inv(a), "logdet": [tf.linalg.logdet(a)],
          "index": tf.constant(k, tf.int64)}


def _step(strategy, replica_fn, mode):
  """A step that runs `replica_fn(call)` on every replica: `call(f)` is f(),
  or f() inside a tf.cond; traced unless `mode` is "eager"."""
  def call(f):
    if mode != "in_cond":
      return f()
    rid = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.cond(rid >= 0, f, f)
  step = lambda: strategy.run(lambda: replica_fn(call))
  return step if mode == "eager" else tf.function(step)


def _recording_thunks(ran, first):
  """A replica function whose map_gather's thunk k returns `first + k` and
  appends (k, the replica that ran it) to `ran`."""

  def replica_fn(call):
    ctx = tf.distribute.get_replica_context()
    rid = ctx.replica_id_in_sync_group

    def thunk(k):
      def record(replica):
        ran.append((k, int(replica)))
        return np.float32(first + k)
      return tf.reshape(tf.py_function(record, [rid], tf.float32), [])

    return call(lambda: ctx.map_gather([lambda k=k: thunk(k)
                                        for k in range(NUM_THUNKS)]))

  return replica_fn


class MapGatherTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_equals_every_replica_computing_everything(self, _, n, mode):
    strategy = topology.strategy_over(n)
    thunks = [lambda k=k: _factors(k) for k in range(NUM_THUNKS)]

    def replica_fn(call):
      ctx = tf.distribute.get_replica_context()
      return {"thunks": call(lambda: ctx.map_gather(thunks)),
              "fn": call(lambda: ctx.map_gather(list(range(NUM_THUNKS)),
                                                fn=_factors)),
              "everything": tuple(thunk() for thunk in thunks)}

    out = _step(strategy, replica_fn, mode)()
    everything = strategy.experimental_local_results(out["everything"])[0]
    self.assertEqual(
        [int(r["index"]) for r in everything], list(range(NUM_THUNKS)))
    expected = tf.nest.map_structure(np.asarray, everything)
    # A sum with zeros only: the results are bit for bit the thunks' own.
    assert_per_replica(self, strategy, out["thunks"], [expected] * n)
    assert_per_replica(self, strategy, out["fn"], [expected] * n)

  @parameterized.expand(_CASES)
  def test_each_thunk_runs_once_per_step_on_its_owner(self, _, n, mode):
    strategy = topology.strategy_over(n)
    ran = []  # (thunk, replica) of each run of a thunk.

    replica_fn = _recording_thunks(ran, first=0.0)
    step = _step(strategy, replica_fn, mode)
    steps = 2  # Traced, the second step runs the first one's graph.
    outs = [step() for _ in range(steps)]
    self.assertEqual(sorted(ran),
                     sorted([(k, k % n) for k in range(NUM_THUNKS)] * steps))
    for out in outs:
      assert_per_replica(self, strategy, out,
                         [tuple(float(k) for k in range(NUM_THUNKS))] * n)

  @parameterized.expand(_CASES)
  def test_gradients_reach_the_owner_summed_over_replicas(self, _, n, mode):
    strategy = topology.strategy_over(n)

    def replica_fn(call):
      ctx = tf.distribute.get_replica_context()
      weight = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
      scales = [tf.constant(1.0 + k / 10) for k in range(NUM_THUNKS)]
      thunks = [lambda k=k: _factors(k, scales[k])["inverse"]
                for k in range(NUM_THUNKS)]
      grads = {}
      for name, results in (
          ("map_gather", lambda: ctx.map_gather(thunks)),
          ("everything", lambda: tuple(t() for t in thunks))):
        with tf.GradientTape() as tape:
          tape.watch(scales)
          loss = weight * tf.add_n([tf.reduce_sum(r) for r in call(results)])
        grads[name] = tape.gradient(
            loss, scales, unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return grads

    out = _step(strategy, replica_fn, mode)()
    # Every replica computing everything: the sum over replicas of their
    # gradients is what an optimizer applies.
    total = [float(strategy.reduce("sum", g, axis=None))
             for g in out["everything"]]
    self.assertTrue(all(t != 0.0 for t in total))
    assert_per_replica(
        self, strategy, out["map_gather"],
        lambda rid: [total[k] if k % n == rid else 0.0
                     for k in range(NUM_THUNKS)], rtol=1e-5)


class MapGatherSyncGroupsTest(unittest.TestCase):
  """With sync groups each group shares out the thunks among its replicas."""

  @parameterized.expand(_MODES)
  def test_every_group_gets_every_result(self, _, mode):
    strategy = topology.strategy_over(4, sync_groups=2)
    ran = []  # (thunk, replica) of each run of a thunk.

    replica_fn = _recording_thunks(ran, first=1.0)
    out = _step(strategy, replica_fn, mode)()
    assert_per_replica(self, strategy, out,
                       [tuple(k + 1.0 for k in range(NUM_THUNKS))] * 4)
    # Thunk k on replica k mod 2 of each group: 0, 1 in group 0; 2, 3 in 1.
    self.assertEqual(sorted(ran), sorted(
        (k, group + k % 2) for k in range(NUM_THUNKS) for group in (0, 2)))


class MapGatherInputTest(unittest.TestCase):

  def _refused(self, error, pattern, thunks, fn=None, traced=False):
    strategy = topology.strategy_over(2)
    run = lambda: strategy.run(
        lambda: tf.distribute.get_replica_context().map_gather(thunks, fn))
    with self.assertRaisesRegex(error, pattern):
      tf.function(run)() if traced else run()

  def test_empty_or_not_a_list(self):
    self._refused(ValueError, r"non-empty list.*thunks=\[\]", [])
    self._refused(ValueError, r"non-empty list.*thunks=<function",
                  lambda: 1.0)

  def test_not_callable(self):
    self._refused(TypeError, r"callable.*give `fn`.*thunks\[1\]=2.0",
                  [lambda: 1.0, 2.0])
    self._refused(TypeError, r"`fn`.*callable or None.*fn='inv'",
                  [1.0], fn="inv")

  @parameterized.expand([("eager", False), ("function", True)])
  def test_a_result_without_a_static_shape(self, _, traced):
    thunk = lambda: {"ids": tf.unique(tf.constant([3, 3, 1])).y}
    self._refused(ValueError,
                  r"thunks\[0\]\(\)\['ids'\].*static shape.*\(None,\)"
                  r".*tf.ensure_shape", [thunk], traced=traced)

  def test_a_result_that_does_not_sum(self):
    self._refused(ValueError, r"thunks\[1\]\(\)\[0\].*float or integer.*bool"
                  r".*tf.cast", [lambda: 1.0, lambda: [tf.constant(True)]])

  def test_a_none_result(self):
    self._refused(ValueError, r"thunks\[0\]\(\)\[1\]=None",
                  [lambda: (1.0, None)])

  def test_errors_name_fn_on_its_input(self):
    self._refused(ValueError, r"fn\(thunks\[0\]\)\['ids'\].*static shape",
                  [1, 2], fn=lambda _: {"ids": tf.unique([3, 3, 1]).y},
                  traced=True)


if __name__ == "__main__":
  unittest.main()
