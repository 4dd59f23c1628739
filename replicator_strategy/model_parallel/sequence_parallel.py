"""Megatron-LM's sequence parallelism (Korthikanti et al., 2022): the exchanges.

Between a row-parallel layer and the next column-parallel one, a replica's
k devices hold the activations in k parts along the sequence, part i on
device i. A row-parallel layer's k products are reduce-scattered: device i
sums slice i of every product. A column-parallel layer's input is
all-gathered: each device concatenates the k parts. Each is the other's
gradient, computed on the devices that hold the values. A dropout over a
part draws the values one device draws for that slice of the whole.

>>> import replicator_strategy as rs
>>> rs.split_cpu(4)
>>> devices = ["/cpu:0", "/cpu:1"]
>>> products = [tf.reshape(tf.range(8.0), [1, 4, 2])] * 2
>>> parts = reduce_scatter(products, devices, axis=1)
>>> [(p.shape.as_list(), p.device[-5:]) for p in parts]
[([1, 2, 2], 'CPU:0'), ([1, 2, 2], 'CPU:1')]
>>> whole = all_gather(parts, devices, axis=1)
>>> bool(tf.reduce_all(whole[1] == 2 * products[0]))
True
"""

import tensorflow as tf

from replicator_strategy import random_rows
from replicator_strategy.model_parallel import megatron

REDUCE_SCATTER = "sequence_reduce_scatter"
ALL_GATHER = "sequence_all_gather"


def reduce_scatter(values, devices, axis):
  """The sum of `values` (value i on devices[i]) in parts along `axis`,
  part j on devices[j]: each value is cut where it lives, and only its
  slice j moves. Backward, each device concatenates its value's gradient
  from the parts' (an all-gather).

  Every step runs, and is differentiated, on one device
  (`megatron.on_device`): one op over several devices would pass them all
  through its own.
  """
  k = len(devices)
  with tf.name_scope(REDUCE_SCATTER):
    slices = [megatron.on_device(d, lambda v: tf.split(v, k, axis=axis), v)
              for d, v in zip(devices, values)]
    return [megatron.on_device(d, lambda *s: tf.add_n(s), *[s[j] for s in slices])
            for j, d in enumerate(devices)]


def all_gather(parts, devices, axis):
  """The `parts` (part j on devices[j]) concatenated along `axis`, a copy
  on each of `devices`. Backward, device j sums the slices j of the
  copies' gradients (a reduce-scatter)."""
  k = len(devices)
  with tf.name_scope(ALL_GATHER):
    # A copy of part j for each device, made on device j: its k gradients
    # are summed there.
    copies = [megatron.on_device(d, lambda p: [tf.identity(p) for _ in range(k)], p)
              for d, p in zip(devices, parts)]
    return [megatron.on_device(d, lambda *c: tf.concat(c, axis=axis),
                               *[c[i] for c in copies])
            for i, d in enumerate(devices)]


def dropout(x, rate, seed, first_row, index, k, axis):
  """`tf.nn.experimental.stateless_dropout` of part `index` of k along `axis`
  of rows `first_row`... of a larger batch: what one device draws there.

  Viewed as rows of one part's length (a row per part of each slice of
  the dimensions before `axis`), one device's draw has this part's values
  in every k-th row from `index` on; each is drawn where it starts
  (`random_rows`), at the cost of the part's own values.
  """

  def uniform(shape, dtype):
    shape = tf.cast(shape, tf.int64)
    chunk = tf.reduce_prod(shape[axis:])
    start = tf.cast(first_row, tf.int64) * tf.reduce_prod(shape[1:axis])

    def row(r):
      return random_rows.uniform(
          tf.stack([tf.constant(1, tf.int64), chunk]), seed, dtype=dtype,
          first_row=(start + r) * k + index)[0]

    rows = tf.map_fn(row, tf.range(tf.reduce_prod(shape[:axis])),
                     fn_output_signature=tf.TensorSpec([None], dtype))
    return tf.reshape(rows, shape)

  return tf.nn.experimental.general_dropout(x, rate, uniform_sampler=uniform)
