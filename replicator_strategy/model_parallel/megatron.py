"""Megatron-LM's column- and row-parallel matmuls, over a replica's devices.

A column-parallel matmul multiplies the whole input by each part of a kernel
split by output features (`SplitVariable` axis -1), part i on logical device
i: its output stays in parts, one per device. A row-parallel matmul
multiplies input part i by kernel part i (split by input features, axis 0)
on device i and sums the products on logical device 0: one combine forward.
Fed a column layer's parts, it takes them as they are, so a column/row pair
never assembles the hidden activation. Backward, each part's gradient is
computed on its own device; the column layer's input gradient is the one
combine backward.

Outputs in parts are recorded per graph (`parts_of`), so the next layer finds
them; a layer that is not row-parallel reads the assembled output.

>>> import replicator_strategy as rs
>>> rs.split_cpu(4)
>>> x, w = tf.ones([2, 3]), tf.ones([3, 4])
>>> parts = column_parallel(x, tf.split(w, 2, axis=1), None, None,
...                         ["/cpu:0", "/cpu:1"])
>>> [p.device[-5:] for p in parts]
['CPU:0', 'CPU:1']
>>> row_parallel(tf.split(x, 3, axis=1), tf.split(w, 3), ["/cpu:0"] * 3).numpy()
array([[3., 3., 3., 3.],
       [3., 3., 3., 3.]], dtype=float32)
"""

import weakref

import tensorflow as tf

_outputs_in_parts = weakref.WeakKeyDictionary()  # graph -> {ref: parts}


def on_device(device, fn, *args):
  """`fn(*args)` on `device`, its gradient computed on `device` too."""

  @tf.custom_gradient
  def placed(*args):
    with tf.device(device):
      out = fn(*args)

    def grad(dy):
      with tf.device(device):
        with tf.GradientTape() as tape:
          tape.watch(args)
          again = fn(*args)
        return tape.gradient(again, args, output_gradients=dy)

    return out, grad

  with tf.device(device):  # Where custom_gradient's pass-through op goes.
    return placed(*args)


def assembled(parts, devices):
  """The parts concatenated on the first device; recorded as in parts."""
  with tf.device(devices[0]):
    whole = tf.concat(parts, axis=-1)
  if not tf.executing_eagerly():
    graph = tf.compat.v1.get_default_graph()
    _outputs_in_parts.setdefault(graph, {})[whole.ref()] = tuple(parts)
  return whole


def parts_of(tensor, k):
  """The parts `tensor` was assembled from (k of them), or None."""
  if tf.executing_eagerly() or not isinstance(tensor, tf.Tensor):
    return None
  recorded = _outputs_in_parts.get(tf.compat.v1.get_default_graph(), {})
  parts = recorded.get(tensor.ref())
  return parts if parts is not None and len(parts) == k else None


def column_parallel(x, kernel_parts, bias_parts, activation, devices):
  """`activation(x @ kernel + bias)` in parts, part i on `devices[i]`."""

  def part(x, kernel, *bias):
    y = tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(
        x, kernel, axes=1)
    if bias:
      y = y + bias[0]
    return y if activation is None else activation(y)

  outputs = []
  for i, device in enumerate(devices):
    bias = () if bias_parts is None else (bias_parts[i],)
    outputs.append(on_device(device, part, x, kernel_parts[i], *bias))
  return outputs


def row_parallel(x_parts, kernel_parts, devices):
  """`concat(x_parts) @ concat(kernel_parts)`, summed on `devices[0]`."""

  def part(x, kernel):
    return tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(
        x, kernel, axes=1)

  products = [on_device(d, part, x, w)
              for d, x, w in zip(devices, x_parts, kernel_parts)]
  with tf.device(devices[0]):
    return tf.add_n(products)
