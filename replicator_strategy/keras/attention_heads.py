"""`MultiHeadAttention` on a `ReplicatorStrategy(layout_map=...)` replica
whose query, key and value projections split the heads over its devices.

The projections (column-parallel `EinsumDense`s, `keras.model_parallel`)
leave their outputs in parts by heads; each device attends over its own
heads, and the output projection (row-parallel) takes the devices' outputs
as they are. So the attention reads query, key and value in parts only:

- its dropout (`MultiHeadAttention(dropout=...)`, in training) keeps on
  each device the units of its heads that one device keeps: the seed is
  drawn once per call, as one device draws it, and each device draws that
  draw's values for its heads and its replica's rows
  (`random_rows.dropout_part`);
- `return_attention_scores=True` returns each device's scores (before the
  dropout, as Keras returns them) assembled along the heads axis, recorded
  in parts (`megatron.assembled`);
- created in a `keras.RematScope(mode="larger_than")` whose threshold the
  whole scores (batch x heads x query x key) exceed, each device's core
  (scores, softmax, dropout, heads' outputs) is recomputed in the backward
  from its query, key and value parts (`rematerialization.Recomputed`), as
  Megatron-LM's selective recompute does: Keras's mode would recompute the
  softmax alone, whose output the heads' outputs keep anyway.
"""

import functools
import math

from replicator_strategy import random_rows
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import random_layers
from replicator_strategy.keras import rematerialization
from replicator_strategy.keras import sequence_parallel
from replicator_strategy.model_parallel import megatron


def _parts_by_heads(query, key, value):
  """(query, key and value parts, their devices), or (None, None) where
  they are not in parts by heads on this replica's devices."""
  devices = sequence_parallel.model_devices(query)
  if devices is None:
    return None, None
  parts = [megatron.parts_of(t, len(devices), -2) for t in (query, key, value)]
  if len(devices) == 1 or any(p is None for p in parts):
    return None, None
  return parts, devices


def _heads_dropout(attention, heads_axis, first_row):
  """`dropout(scores, i)`: device i's scores (its heads, the rows from
  `first_row` on) dropped as one device's attention dropout drops them."""
  layer = ki.attention_dropout(attention)
  seed = ki.draw_seed(layer.seed_generator)  # Once per call, as on one device.

  def dropout(scores, i):
    return random_rows.dropout_part(
        scores, layer.rate, seed, heads_axis, i,
        attention.num_heads // scores.shape[heads_axis], first_row)

  return dropout


def _core_recomputed(attention, query, key):
  """Whether `attention`'s `RematScope` asks for its scores recomputed: the
  whole scores larger than its "larger_than" threshold (a dimension of
  unknown size counted as 1, as Keras counts it)."""
  mode = ki.remat_mode(attention)
  if mode is None or mode.mode != "larger_than":
    return False
  rank = query.shape.rank
  scores = math.prod(d or 1 for d in query.shape[:-1]) * math.prod(
      d or 1 for d in key.shape[rank - 2 - len(attention.attention_axes):-2])
  return scores > mode.output_size_threshold


def attention_per_head_group(compute_attention):
  """`MultiHeadAttention`'s attention, run per device on its heads when the
  query, key and value projections left their outputs in parts by heads."""

  @functools.wraps(compute_attention)
  def wrapper(self, query, key, value, attention_mask=None, training=None,
              return_attention_scores=False, **kwargs):
    parts, devices = _parts_by_heads(query, key, value)
    if parts is None:
      return compute_attention(self, query, key, value, attention_mask,
                               training, return_attention_scores, **kwargs)
    # The scores' axes: the batch's, the heads', then the attention axes of
    # the query and of the key.
    heads_axis = query.shape.rank - 2 - len(self.attention_axes)
    dropout = None
    if training and ki.attention_dropout(self).rate > 0:
      first_row = random_layers.rows_of(query)  # This replica's, else as is.
      dropout = _heads_dropout(self, heads_axis,
                               0 if first_row is None else first_row)

    def heads(i, q, k, v):
      if dropout is None:
        out, scores = compute_attention(self, q, k, v, attention_mask,
                                        training, return_attention_scores,
                                        **kwargs)
      else:  # Keras's scores, dropped here as one device drops them.
        _, scores = compute_attention(self, q, k, v, attention_mask, False,
                                      True, **kwargs)
        out = ki.attention_combine(self, dropout(scores, i), v)
      return (out, scores) if return_attention_scores else out

    def core(i):
      if _core_recomputed(self, query, key):
        return rematerialization.Recomputed(functools.partial(heads, i))
      return functools.partial(heads, i)

    results = [megatron.on_device(d, core(i), *qkv)
               for i, (d, *qkv) in enumerate(zip(devices, *parts))]
    if not return_attention_scores:
      return megatron.assembled(results, devices, -2), None
    outputs, scores = zip(*results)
    return (megatron.assembled(list(outputs), devices, -2),
            megatron.assembled(list(scores), devices, heads_axis))

  return wrapper
