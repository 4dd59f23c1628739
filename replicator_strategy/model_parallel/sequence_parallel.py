"""Megatron-LM's sequence parallelism (Korthikanti et al., 2022): the exchanges.

Between a row-parallel layer and the next column-parallel one, a replica's
k devices hold the activations in k parts along the sequence, part i on
device i. A row-parallel layer's k products are reduce-scattered: device i
sums slice i of every product. A column-parallel layer's input is
all-gathered: each device concatenates the k parts. Each is the other's
gradient, computed on the devices that hold the values. A column layer's
product reads the whole (`column_parallel`), but its backward reads a whole
gathered again from the parts, as Megatron-SP does: each device keeps its
part for the backward, not the whole. A dropout over a part draws the values
one device draws for that slice of the whole.

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

A column layer's kernel gradient reads the whole gathered again:

>>> @tf.function
... def kernel_gradient(x):
...   kernels = [tf.ones([2, 3]), tf.ones([2, 3])]
...   with tf.GradientTape() as tape:
...     tape.watch(kernels)
...     gather = gathered(tf.split(x, 2, axis=1), devices, axis=1)
...     ys = column_parallel(lambda x, w: tf.einsum("bsd,de->bse", x, w),
...                          gather, kernels)
...   return tape.gradient(ys[1], kernels[1])  # x summed over the sequence.
>>> kernel_gradient(products[0])[:, 0].numpy()
array([12., 16.], dtype=float32)
"""

import collections

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import random_rows
from replicator_strategy.model_parallel import megatron

REDUCE_SCATTER = "sequence_reduce_scatter"
ALL_GATHER = "sequence_all_gather"
ALL_GATHER_AGAIN = "sequence_all_gather_again"

# An all-gather's wholes (one per device) and what it gathered: `parts`
# along `axis`, part j on devices[j], in name scope `scope`.
Gathered = collections.namedtuple("Gathered", "wholes parts devices axis scope")


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
  with tf.name_scope(ALL_GATHER):
    return _gather(parts, devices, axis)


def _gather(parts, devices, axis):
  k = len(devices)
  # A copy of part j for each device, made on device j: its k gradients
  # are summed there.
  copies = [megatron.on_device(d, lambda p: [tf.identity(p) for _ in range(k)], p)
            for d, p in zip(devices, parts)]
  return [megatron.on_device(d, lambda *c: tf.concat(c, axis=axis),
                             *[c[i] for c in copies])
          for i, d in enumerate(devices)]


def gathered(parts, devices, axis):
  """An `all_gather` of `parts`, as a `Gathered` for `column_parallel`."""
  return Gathered(all_gather(parts, devices, axis), tuple(parts),
                  tuple(devices), axis, _scope())


def _scope():
  """The current name scope, to enter again (a trailing "/")."""
  scope = tf.compat.v1.get_default_graph().get_name_scope()
  return f"{scope}/" if scope else ""


def column_parallel(fn, gather, kernel_parts):
  """`[fn(gather.wholes[i], kernel_parts[i]) on device i]`: a column
  layer's products of an all-gather's wholes (a `Gathered`), `fn` a product
  whose gradient reads its inputs, not its output (a matmul, an einsum).

  Backward, device i's gradient reads a whole gathered again from the parts
  once the gradient reached it (`_gathered_again`), so the forward's whole
  is freed after its product: what each device keeps for the backward is
  its part, 1/k of the sequence. The input's gradient, which needs no
  whole, does not wait for that all-gather.
  """
  return [_product(fn, gather, i, w) for i, w in enumerate(kernel_parts)]


def _product(fn, gather, i, kernel):
  device = gather.devices[i]
  scope = _scope()  # Its gradient's ops named as the tape names them.

  @tfi.custom_gradient
  def product(x, w):
    with tf.device(device):
      y = fn(x, w)

    def grad(dy):
      dy = megatron.summed_on(dy, device)
      x = _gathered_again(gather, dy)[i]
      with tf.name_scope(scope), tf.device(device):
        with tf.GradientTape() as tape:
          tape.watch([x, w])
          again = fn(x, w)  # Unread by its gradient: pruned.
        return tape.gradient(again, [x, w], output_gradients=dy)

    return y, grad

  with tf.device(device):
    return product(gather.wholes[i], kernel)


def _gathered_again(gather, dy):
  """`gather`'s wholes gathered again from its parts once `dy` (a product's
  gradient) is there, each part sent then: once per graph, for every layer
  that read the wholes (attention's query, key and value)."""
  again = tfi.owned_by(tf.compat.v1.get_default_graph(), "sequence_gathered_again")
  key = gather.wholes[0].ref()
  if key not in again:
    with tf.name_scope(f"gradient_tape/{gather.scope}{ALL_GATHER_AGAIN}/"):
      zero = megatron.zero_after(dy)
      parts = []
      for d, part in zip(gather.devices, gather.parts):
        with tf.device(d):
          parts.append(part + tf.cast(zero, part.dtype))
      again[key] = _gather(parts, gather.devices, gather.axis)
  return again[key]


def dropout(x, rate, seed, first_row, index, k, axis):
  """`tf.nn.experimental.stateless_dropout` of part `index` of k along `axis`
  of rows `first_row`... of a larger batch: what one device draws there
  (`random_rows.dropout_part`), with XLA too where `x`'s shape is known
  when tracing."""
  return random_rows.dropout_part(x, rate, seed, axis, index, k, first_row)
