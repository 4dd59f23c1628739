"""Gradients that a tape outside `strategy.run` takes of the replicas' collectives.

A tape outside the `tf.function` that calls `strategy.run` differentiates the
whole function, every replica at once, outside the replicas' home graph: TF
builds the replicas' gradients interleaved, in an order of its own, and each
replica launches its run-time collectives in the order they are built. Where
that order differs between replicas, or lies in a gradient's control flow
(not ordered at all), the collectives could only wait for each other or meet
the wrong partners: `check_order` refuses both, saying how to take the
gradient instead (`FIX`).
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

FIX = (
    "Take the gradient inside the function given to strategy.run (a "
    "tf.GradientTape there, then all-reduce the gradients or apply them with "
    "an optimizer, as Keras's train_step does).")


def built_for_outer_tape(ctx):
  """Whether replica context `ctx`'s ops are being built outside its thread:
  by a gradient that a tape outside strategy.run takes of the whole step."""
  return tf.distribute.get_replica_context() is not ctx


def check_order(ctx, position):
  """Refuses a gradient of exchanges that the replicas would launch in
  different orders: `position` is the exchange's number in `ctx`'s home
  graph (`exchange`), the same for the same exchange on every replica."""
  if not built_for_outer_tape(ctx):
    return  # A gradient inside strategy.run: built replica by replica.
  graph = tf.compat.v1.get_default_graph()
  if isinstance(graph, tfi.CONTROL_FLOW_GRAPH):
    raise NotImplementedError(
        "ReplicatorStrategy: a tf.GradientTape outside the tf.function "
        "that calls strategy.run differentiates a cross-replica collective "
        "called inside a tf.cond (or loop) of the replica function; its "
        "gradient's collectives could not keep one order on every "
        "replica. " + FIX)
  built = tfi.owned_by(graph, "exchanges_differentiated").setdefault(
      id(ctx.strategy), {})
  mine = built.setdefault(ctx.local_index, [])
  mine.append(position)
  for replica, theirs in built.items():
    if len(theirs) >= len(mine) and theirs[len(mine) - 1] != position:
      raise NotImplementedError(
          f"ReplicatorStrategy: a tf.GradientTape outside the tf.function "
          f"that calls strategy.run differentiates its cross-replica "
          f"collectives in an order that differs between replicas: "
          f"TensorFlow builds that gradient for every replica at once, "
          f"here reaching collective #{position + 1} of local replica "
          f"{ctx.local_index} where it reached collective "
          f"#{theirs[len(mine) - 1] + 1} of local replica {replica}. "
          f"Their gradients' collectives would wait for each other. " + FIX)
