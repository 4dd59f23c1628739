"""Collectives in TF1 graph mode: a `tf.Graph` run by a `tf.compat.v1.Session`.

One graph holds every replica there, so a replica's collective output also
depends on the other replicas' inputs (and the variables behind them). Values
and `tf.gradients` are checked against MirroredStrategy over the same logical
devices where it has the op, against NumPy otherwise.
"""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

import topology

BASE = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # Cut evenly by 1, 2, 4.


def _run_in_graph(make_strategy, replica_fn, cross_replica_fn=None,
                  with_variable=False):
  """{"replicas": each replica's result, "cross": cross_replica_fn's}, run in
  a Session. `replica_fn(v)` gets a mirrored variable holding BASE, or None."""
  with tf.Graph().as_default():
    strategy = make_strategy()
    v = None
    if with_variable:
      with strategy.scope():
        v = tf.Variable(BASE)
    out = strategy.run(replica_fn, args=(v,))
    fetches = {"replicas": strategy.experimental_local_results(out)}
    if cross_replica_fn is not None:
      fetches["cross"] = cross_replica_fn(strategy, out)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(fetches)


def _replica_id():
  return tf.distribute.get_replica_context().replica_id_in_sync_group


def _weight():
  """Each replica's loss weight, r + 1: the gradients tell replicas apart."""
  return tf.cast(_replica_id() + 1, tf.float32)


def _loss_gradient(y, x):
  return tf.gradients(_weight() * tf.reduce_sum(y), [x])[0]


class GraphModeCollectivesTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_what_mirrored_strategy_has_matches_it(self, _, n):

    def step(v):
      # MirroredStrategy's own all_reduce and all_gather fail on a value
      # computed from a variable in a TF1 graph of 2 or more replicas ("grad_fn
      # must accept keyword argument 'variables'"), so it gets a constant.
      ctx = tf.distribute.get_replica_context()
      base = tf.constant(BASE) if v is None else v
      x = base + 10.0 * tf.cast(_replica_id(), tf.float32)
      out = {"sum": ctx.all_reduce("sum", x),
             "mean": ctx.all_reduce(tf.distribute.ReduceOp.MEAN, x),
             "gather": ctx.all_gather(x, axis=0)}
      grads = {k: _loss_gradient(y, x) for k, y in out.items()}
      return x, out, grads

    def cross_replica(strategy, out):
      x = out[0]
      return {"sum": strategy.reduce("sum", x, axis=None),
              "mean": strategy.reduce("mean", x, axis=None),
              "sum_axis_0": strategy.reduce("sum", x, axis=0),
              "gather": strategy.gather(x, axis=0)}

    devices = [f"/cpu:{i}" for i in range(n)]
    ours = _run_in_graph(lambda: topology.strategy_over(n), step,
                         cross_replica, with_variable=True)
    theirs = _run_in_graph(lambda: tf.distribute.MirroredStrategy(devices),
                           step, cross_replica)
    tf.nest.map_structure(np.testing.assert_allclose, ours, theirs)
    # MirroredStrategy's gradient of an all-reduce is itself all-reduced.
    np.testing.assert_allclose(ours["replicas"][0][2]["sum"],
                               np.full(4, n * (n + 1) / 2))

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_every_collective_of_variables_matches_numpy(self, _, n):

    def step(v):
      ctx = tf.distribute.get_replica_context()
      x = v * _weight()
      out = {
          "sum": ctx.all_reduce("sum", x),
          "mean": ctx.all_reduce("mean", x),
          "min": ctx.all_reduce("min", x),
          "max": ctx.all_reduce("max", x),
          "gather": ctx.all_gather(x, axis=0),
          "broadcast": ctx.broadcast(x, source_replica_id=n - 1),
          "reduce_scatter": ctx.reduce_scatter("sum", x),
          "all_to_all": ctx.all_to_all(x),
          "merge_call": ctx.merge_call(
              lambda strategy, t: strategy.reduce("sum", t, axis=None),
              args=(x,)),
      }
      grads = {k: tf.gradients(_weight() * tf.reduce_sum(y), [x, v])
               for k, y in out.items()}
      return out, grads

    def cross_replica(strategy, out):
      return {"max": strategy.reduce("max", out[0]["reduce_scatter"],
                                     axis=None),
              "gather": strategy.gather(out[0]["reduce_scatter"], axis=0)}

    got = _run_in_graph(lambda: topology.strategy_over(n), step,
                        cross_replica, with_variable=True)

    xs = [BASE * (r + 1) for r in range(n)]
    weights = np.arange(1, n + 1, dtype=np.float32)
    total = weights.sum()
    # Replica r's loss is (r + 1) * sum(y_r); for reduce_scatter and
    # all_to_all slice j of every x reaches replica j's loss.
    per_slice = np.repeat(weights, 4 // n)
    to_one = lambda holder: [np.full(4, total if r == holder else 0.0)
                             for r in range(n)]
    expected = {
        "sum": (sum(xs), [np.full(4, total)] * n),
        "mean": (sum(xs) / n, [np.full(4, total / n)] * n),
        "min": (xs[0], to_one(0)),
        "max": (xs[-1], to_one(n - 1)),
        "gather": (np.concatenate(xs), [np.full(4, total)] * n),
        "broadcast": (xs[-1], to_one(n - 1)),
        "reduce_scatter": (None, [per_slice] * n),
        "all_to_all": (None, [per_slice] * n),
        # merge_call has no gradient of its own: each replica's loss reaches
        # its own input through TF's graph of the merge.
        "merge_call": (sum(xs), [np.full(4, w) for w in weights]),
    }
    slices = np.split(sum(xs), n)
    for r, (out, grads) in enumerate(got["replicas"]):
      for key, (value, x_grad) in expected.items():
        where = f"{key} on replica {r}"
        if key == "reduce_scatter":
          value = slices[r]
        if key == "all_to_all":
          value = np.concatenate([np.split(x, n)[r] for x in xs])
        np.testing.assert_allclose(out[key], value, err_msg=where)
        np.testing.assert_allclose(grads[key][0], x_grad[r], err_msg=where)
        np.testing.assert_allclose(grads[key][1], x_grad[r] * (r + 1),
                                   err_msg=where + ", the variable")
    np.testing.assert_allclose(got["cross"]["max"], slices[-1])
    np.testing.assert_allclose(got["cross"]["gather"], sum(xs))

  def test_a_collective_inside_a_cond_says_it_needs_a_tf_function(self):
    # It failed with "'Graph' object has no attribute 'capture'".
    with tf.Graph().as_default():
      strategy = topology.strategy_over(2)

      def step():
        ctx = tf.distribute.get_replica_context()
        x = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        return tf.cond(x >= 0, lambda: ctx.all_reduce("max", x), lambda: x)

      with self.assertRaisesRegex(
          NotImplementedError, r"inside a tf.cond .* in a TF1 graph .*run "
          r"the step in a tf.function, or call the collective outside the "
          r"tf.cond"):
        strategy.run(step)


if __name__ == "__main__":
  unittest.main()
