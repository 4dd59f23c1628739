"""The traced exchange under every collective of the replica context.

Each collective of `ReplicaContext` exchanges a list of tensors between the
replicas, differentiably, one of two ways. Where the replicas meet (each
replica's ops are built in its home graph, `can_merge`), through
`merge_call`; inside control flow or a nested `tf.function`, where each
replica traces its own graph, every replica launches run-time collectives
(`replica_collectives`) whose instance keys it draws in program order
(`collective_keys`). Each exchange is numbered in its replica's home graph,
the same number on every replica, so that a gradient a tape outside
`strategy.run` takes can check that the replicas differentiate their
exchanges in one order (`outer_tape`).

The replica context `ctx` given to each function here is a
`replica_context.ReplicaContext`: its `home_graph` (where `strategy.run`
traced it), `local_index`, `strategy` and `merge_call`.
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import outer_tape
from replicator_strategy.collectives import replica_collectives


def can_merge(ctx):
  """Whether `merge_call` can gather the replicas here.

  False inside control flow or a nested `tf.function`: each replica traces
  its own graph there. Eager code (even under `tf.init_scope`) always merges:
  replica threads take turns, so a blocking collective would never return.
  """
  return (tf.executing_eagerly() or
          tf.compat.v1.get_default_graph() is ctx.home_graph)


def outside_loops(ctx, fn):
  """`fn()`, built in `ctx`'s home graph if called inside a while loop.

  Collectives can't run in a replica's while loop (each replica runs its
  own copy); a value the loop only reads, such as a sharded weight gathered
  whole, can be built before it, where the replicas merge, and the loop
  captures it (gradients flow back through the capture).
  """
  graph = tf.compat.v1.get_default_graph()
  in_loop = False
  while graph is not None and graph is not ctx.home_graph:
    in_loop = in_loop or isinstance(graph, tfi.WHILE_LOOP_GRAPHS)
    graph = getattr(graph, "outer_graph", None)
  if not (in_loop and graph is ctx.home_graph):
    return fn()
  with ctx.home_graph.as_default():
    return fn()


def group_collectives(ctx):
  """The run-time collectives among `ctx`'s replicas (its sync group's)."""
  return ctx.strategy.extended.communicator.replica_collectives


def collective_keys(ctx, count, collectives=None):
  """Instance keys for `ctx`'s next `count` run-time collectives (of its own
  group's, or of `collectives`)."""
  graph = ctx.home_graph
  if outer_tape.built_for_outer_tape(ctx):
    # The home graph's function was traced before: it takes no new
    # captures. `outer_tape.check_order` refused control flow here.
    graph = tf.compat.v1.get_default_graph()
  else:
    replica_collectives.check_not_in_replica_loop(graph)
    replica_collectives.check_in_function(graph)
  return (collectives or group_collectives(ctx)).draw_keys(
      ctx.local_index, count, graph)


def exchange(ctx, merge_fn, collective_fn, xs, grad, keys_per_tensor=1,
             collectives=None):
  """Differentiable exchange of the tensors `xs` between `ctx`'s replicas.

  Through `merge_call` (`merge_fn(strategy, *per_replica_xs)`) where the
  replicas can meet, else through run-time collectives
  (`collective_fn(keys, xs)`, `keys_per_tensor` keys per tensor drawn from
  `collectives`, by default the group's). `grad(xs, ys, dys)` gives the
  gradients, through collectives of the same path (inside a `tf.cond`, its
  gradient branch launches run-time collectives too).
  """
  merging = can_merge(ctx)
  position = _next_exchange(ctx)
  if not merging:
    # Drawn outside the custom gradient, which would otherwise take the
    # key counters for variables to differentiate.
    keys = collective_keys(ctx, keys_per_tensor * len(xs), collectives)

  @tfi.custom_gradient
  def exchanged(*xs):
    if merging:
      # Cut from the other replicas' inputs, which a TF1 graph holds too:
      # custom_gradient would take the variables behind them for this
      # replica's (their gradients flow through their own replica's).
      ys = [tf.stop_gradient(y) for y in ctx.merge_call(merge_fn, args=xs)]
    else:
      ys = collective_fn(keys, list(xs))

    def gradient(*dys):
      if not merging and tfi.differentiating_for_higher_order():
        # TF then rebuilds the forward control flow inside functions of its
        # own, where the replicas' collectives lose their common order.
        raise NotImplementedError(
            "Gradients through a cross-replica collective inside control "
            "flow (a tf.cond branch in the function passed to "
            "strategy.run) are taken with a non-persistent GradientTape "
            "that no other tape watches; this one is persistent, or nested "
            "in another tape. Use one non-persistent tape per gradient, or "
            "call the collective outside the tf.cond.")
      outer_tape.check_order(ctx, position)
      return grad(list(xs), ys, list(dys))

    return list(ys), gradient

  return exchanged(*xs)


def _next_exchange(ctx):
  """`ctx`'s count of the exchanges traced before this one in its home
  graph: the same for the same exchange on every replica."""
  counts = tfi.owned_by(ctx.home_graph, "exchanges_traced")
  key = (id(ctx.strategy), ctx.local_index)
  position = counts.get(key, 0)
  counts[key] = position + 1
  return position
