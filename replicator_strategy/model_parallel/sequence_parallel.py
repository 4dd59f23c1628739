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

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import random_rows
from replicator_strategy.model_parallel import megatron

REDUCE_SCATTER = "sequence_reduce_scatter"
ALL_GATHER = "sequence_all_gather"
BACKWARD = "backward"  # The scope of the exchanges a gradient makes.


def _scattered(values, devices, axis):
  """Part j of the sum of `values` (value i on devices[i]) on devices[j]:
  each value is cut where it lives, and only its slice j moves."""
  k = len(devices)
  with tf.name_scope(REDUCE_SCATTER):
    slices = []
    for value, device in zip(values, devices):
      with tf.device(device):
        slices.append(tf.split(value, k, axis=axis))
    parts = []
    for j, device in enumerate(devices):
      with tf.device(device):
        parts.append(tf.add_n([s[j] for s in slices]))
  return parts


def _gathered(parts, devices, axis):
  """The `parts` concatenated along `axis` on each of `devices`."""
  with tf.name_scope(ALL_GATHER):
    wholes = []
    for device in devices:
      with tf.device(device):
        wholes.append(tf.concat(parts, axis=axis))
  return wholes


def _present(grads, like, devices):
  """`grads` on their devices (`megatron.summed_on`), a None one (its
  output unused) as zeros."""
  filled = []
  for grad, value, device in zip(grads, like, devices):
    if grad is None:
      with tf.device(device):
        grad = tf.zeros_like(value)
    filled.append(megatron.summed_on(grad, device))
  return filled


def reduce_scatter(values, devices, axis):
  """The sum of `values` in parts along `axis`, part j on devices[j];
  backward, the parts' gradients all-gathered."""

  @tfi.custom_gradient
  def exchange(*values):
    parts = _scattered(values, devices, axis)

    def grad(*dys):
      with tf.name_scope(BACKWARD):
        return _gathered(_present(dys, parts, devices), devices, axis)

    return parts, grad

  return list(exchange(*values))


def all_gather(parts, devices, axis):
  """The `parts` concatenated along `axis`, a copy on each of `devices`;
  backward, the copies' gradients reduce-scattered."""

  @tfi.custom_gradient
  def exchange(*parts):
    wholes = _gathered(parts, devices, axis)

    def grad(*dys):
      with tf.name_scope(BACKWARD):
        return _scattered(_present(dys, wholes, devices), devices, axis)

    return wholes, grad

  return list(exchange(*parts))


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
