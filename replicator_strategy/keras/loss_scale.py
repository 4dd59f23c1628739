"""Keras's loss-scale optimizer skips a step that overflowed on any replica.

Under `mixed_float16` the `LossScaleOptimizer` checks its gradients for
inf or NaN and, finding any, skips the step and halves the scale. Its
gradients are each replica's own, before the all-reduce, and Keras takes
the first replica's answer for all, so an overflow on another replica went
into the summed gradient and the weights became inf or NaN. Here every
replica takes the answer of all of them: a step is skipped when any
replica's gradients overflowed, as one device's gradients of the whole
batch would have.
"""

import functools

import tensorflow as tf

from replicator_strategy.keras import replicas
from replicator_strategy.model_parallel import gradient_parts


def finite_on_every_replica(check_finite):
  """`LossScaleOptimizer.check_finite`, agreed by the replicas in sync."""

  @functools.wraps(check_finite)
  def wrapper(self, grads):
    # A split weight's gradient, checked part by part on its devices.
    finite = check_finite(self, gradient_parts.pieces_or_whole(grads)[0])
    if not replicas.in_our_replicas():
      return finite
    ctx = tf.distribute.get_replica_context()
    overflowed = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(overflowed, 0.0)

  return wrapper
