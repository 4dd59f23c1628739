"""`MultiHeadAttention` on a `ReplicatorStrategy(layout_map=...)` replica
whose query, key and value projections split the heads over its devices.

The projections (column-parallel `EinsumDense`s, `keras.model_parallel`)
leave their outputs in parts by heads; each device attends over its own
heads, and the output projection (row-parallel) takes the devices' outputs
as they are.
"""

import functools

import tensorflow as tf

from replicator_strategy import replica_context
from replicator_strategy.model_parallel import megatron


def attention_per_head_group(compute_attention):
  """`MultiHeadAttention`'s attention, run per device on its heads when the
  query, key and value projections left their outputs in parts by heads."""

  @functools.wraps(compute_attention)
  def wrapper(self, query, key, value, attention_mask=None, training=None,
              return_attention_scores=False, **kwargs):
    ctx = tf.distribute.get_replica_context()
    if return_attention_scores or not isinstance(
        ctx, replica_context.ReplicaContext):
      return compute_attention(self, query, key, value, attention_mask,
                               training, return_attention_scores, **kwargs)
    devices = ctx.strategy.extended.logical_devices.model_devices(
        ctx.local_index, query.device)
    k = len(devices)
    parts = [megatron.parts_of(t, k, -2) for t in (query, key, value)]
    if k == 1 or any(p is None for p in parts):
      return compute_attention(self, query, key, value, attention_mask,
                               training, return_attention_scores, **kwargs)

    def heads(q, k_, v):
      return compute_attention(self, q, k_, v, attention_mask, training,
                               False, **kwargs)[0]

    outputs = [megatron.on_device(d, heads, q, k_, v)
               for d, q, k_, v in zip(devices, *parts)]
    return megatron.assembled(outputs, devices, -2), None

  return wrapper
