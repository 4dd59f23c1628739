"""What the wrappers of one optimizer step tell each other, in one replica.

Keras runs an optimizer's step as a chain of its methods
(`_backend_apply_gradients`, then `_clip_gradients`, `_apply_weight_decay`
and `_backend_update_step` with its `_all_reduce_sum_gradients`) and has no
argument for the one thing ReplicatorStrategy's wrappers of them must agree
on: whether the gradients are summed over the replicas already (`gradient_exchange`
sums them before an optimizer clips). A `StepContext` holds it, for one
optimizer in one replica, opened by `stepping` around the step. Each
replica traces the step in its own thread and the threads take turns at
every merge_call inside it (weight decay's, say), so what one replica's
step knows is not seen by another's.

>>> import keras
>>> import replicator_strategy as rs
>>> optimizer = keras.optimizers.SGD()
>>> def step():
...   with stepping(optimizer) as context:
...     context.gradients_summed = True
...     return gradients_summed(optimizer)
>>> rs.ReplicatorStrategy().run(step)  # Each replica in its own step.
True
>>> gradients_summed(optimizer)  # No step open here.
False
"""

import contextlib
import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class StepContext:
  """One optimizer's step in one replica.

  Attributes:
    gradients_summed: the gradients reaching the update are summed over the
      replicas already: Keras's all-reduce of them is skipped, a sharded
      step cuts them rather than reduce-scatters them, and a sharded
      weight's gradient is whole.
  """
  gradients_summed: bool = False


# Open steps: (optimizer, replica context) ids -> StepContext.
_open = {}


@contextlib.contextmanager
def stepping(optimizer):
  """A fresh `StepContext` for `optimizer`'s step in this replica, while inside."""
  key = _key(optimizer)
  _open[key] = StepContext()
  try:
    yield _open[key]
  finally:
    del _open[key]


def current(optimizer):
  """`optimizer`'s open `StepContext` in this replica, or None."""
  return _open.get(_key(optimizer))


def gradients_summed(optimizer):
  """Whether `optimizer`'s step in this replica has summed gradients."""
  context = current(optimizer)
  return context is not None and context.gradients_summed


def _key(optimizer):
  return id(optimizer), id(tf.distribute.get_replica_context())
