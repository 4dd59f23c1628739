"""A replica's loss: its own mean, its gradient scaled by its share of the rows.

A replica's mean loss is scaled by 1/N, which is right only when every
replica has as many rows; a final partial batch then trains differently
from one device. And the scaled value is what a custom `train_step` sees
and logs (the loss / N). Here the loss keeps its value, the replica's mean,
and its gradient is scaled by the replica's share of the rows. And Keras
scales only the pieces it computes, so what a `compute_loss` override adds
to `super().compute_loss(...)` trains N times as strongly; here the value
`compute_loss` returns to Keras's steps is scaled as a whole.
"""

import functools
import threading
import warnings

import keras
import tensorflow as tf

from replicator_strategy import warn_once
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import replicas


def batch_share(replica_context):
  """This replica's rows over all replicas' rows, or None if unknown.

  Exact loss scaling under uneven splits needs it: a replica's mean loss
  counts in proportion to its rows (Keras weights each replica's mean loss
  1/N otherwise). Rows as `ReplicaContext.batch_rows` counts them.

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
  >>> rows = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: tf.ones([2 * ctx.replica_id_in_sync_group + 1, 2]))
  >>> shares = strategy.run(
  ...     lambda x: batch_share(tf.distribute.get_replica_context()), (rows,))
  >>> [float(s) for s in strategy.experimental_local_results(shares)]
  [0.25, 0.75]
  """
  rows = replica_context.batch_rows()
  if rows is None:
    return None
  return tf.math.divide_no_nan(tf.cast(rows.count, tf.float32),
                               tf.cast(rows.total, tf.float32))


def scale_by_batch_share(keras_fn, scale):
  """A replica's mean loss, its gradient scaled by the replica's share of the rows.

  Keras scales each replica's loss by 1/N so that summing the replicas'
  gradients gives the global one; its own `train_step` then unscales the
  value for its logs, but a custom step logs the scaled value (the loss / N).
  Here the value stays the replica's own mean loss, what one device computes
  for those rows, and only its gradient carries the share: training is
  unchanged and every step logs real losses. Unscaling is then nothing to do.
  """

  @functools.wraps(keras_fn)
  def wrapper(value):
    if _scaling_whole_loss():  # `loss_scaled_whole` scales the total.
      return value
    share = None
    if replicas.in_our_replicas():
      share = batch_share(tf.distribute.get_replica_context())
    if share is None:
      return keras_fn(value)
    if not scale:
      return value
    share = tf.cast(share, value.dtype)
    return share * value + tf.stop_gradient((1 - share) * value)

  return wrapper


_loss_scope = threading.local()  # Each replica runs in its own thread.


def _scaling_whole_loss():
  return getattr(_loss_scope, "whole", False)


def loss_scaled_whole(compute_loss):
  """`Model._compute_loss` (Keras's train_step and test_step call
  `compute_loss` through it), its value scaled as one loss.

  Keras scales the pieces it computes inside `compute_loss` (a compiled loss,
  `add_loss` terms); what an override adds to `super().compute_loss(...)`, or
  computes itself, stays unscaled, and its gradient, summed over N replicas,
  trains N times as strongly as on one device. Here nothing inside is scaled
  and the value returned is, as a whole, as `scale_by_batch_share` scales a
  replica's mean loss.
  """

  @functools.wraps(compute_loss)
  def wrapper(self, *args, **kwargs):
    if not replicas.in_our_replicas() or _scaling_whole_loss():
      return compute_loss(self, *args, **kwargs)
    _loss_scope.whole = True
    try:
      loss = compute_loss(self, *args, **kwargs)
    finally:
      _loss_scope.whole = False
    if loss is None:
      return None
    return ki.loss.scale_loss_for_distribution(loss)

  return wrapper


def warn_override_unscaled(compute_loss):
  """`Model.compute_loss`, warning once per class where an override calls it
  from outside `loss_scaled_whole`: a custom train_step's own call, whose
  result nothing can scale as a whole."""

  @functools.wraps(compute_loss)
  def wrapper(self, *args, **kwargs):
    cls = type(self)
    if (cls.compute_loss is not keras.Model.compute_loss and
        not _scaling_whole_loss() and replicas.in_our_replicas() and
        _warned_overrides(cls)):
      warnings.warn(
          f"ReplicatorStrategy: {cls.__qualname__}.compute_loss calls "
          f"super().compute_loss() from a step of its own (a custom "
          f"train_step or test_step). Keras's own train_step scales the "
          f"value compute_loss returns as one device's; called from "
          f"another step, only the losses Keras computes inside are scaled, "
          f"and any term the override adds trains "
          f"{tf.distribute.get_strategy().num_replicas_in_sync} times as "
          f"strongly as on one device. Leave the step to Keras "
          f"(super().train_step(data)), or divide the added terms by "
          f"self.distribute_strategy.num_replicas_in_sync.", stacklevel=2)
    return compute_loss(self, *args, **kwargs)

  return wrapper


_warned_overrides = warn_once.Once()
