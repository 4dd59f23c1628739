"""Megatron-LM's column- and row-parallel layers, over a replica's devices.

A column-parallel layer computes part i of its output from the whole input
and kernel part i (split by output features), on logical device i: its
output stays in parts, one per device. A row-parallel layer computes
`input part i x kernel part i` (split by input features) on device i and
sums the products on logical device 0: one combine forward. Fed a column
layer's parts, it takes them as they are, so a column/row pair never
assembles the activation between them. Backward, each part's gradient is
computed on its own device, from the forward's own record; the column
layer's input gradient is the one combine backward.

Outputs in parts are recorded per graph with the axis they split (`parts_of`),
so the next layer finds them; a layer that takes no parts reads the
assembled output.

>>> import replicator_strategy as rs
>>> rs.split_cpu(4)
>>> x, w = tf.ones([2, 3]), tf.ones([3, 4])
>>> parts = column_parallel(tf.matmul, x, tf.split(w, 2, axis=1),
...                         ["/cpu:0", "/cpu:1"])
>>> [p.device[-5:] for p in parts]
['CPU:0', 'CPU:1']
>>> row_parallel(tf.matmul, tf.split(x, 3, axis=1), tf.split(w, 3),
...              ["/cpu:0"] * 3).numpy()
array([[3., 3., 3., 3.],
       [3., 3., 3., 3.]], dtype=float32)
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi


def on_device(device, fn, *args):
  """`fn(*args)` on `device`, its gradient computed on `device` too.

  The gradient comes from the forward's own record, so a random op inside
  (dropout) is differentiated with the values it drew; a persistent one, as
  a pipeline's split backward (ZB-H1) asks for it twice: to the inputs, then
  to the weights. `fn` may return a tuple of tensors.
  """

  @tfi.custom_gradient
  def placed(*args):
    with tf.device(device), tf.GradientTape(persistent=True) as tape:
      tape.watch(args)
      out = fn(*args)

    def grad(*dys):  # One per output: `fn` may return a list.
      dys = tf.nest.pack_sequence_as(out, [summed_on(g, device) for g in dys])
      with tf.device(device):
        return tape.gradient(out, args, output_gradients=dys)

    return out, grad

  with tf.device(device):  # Where custom_gradient's pass-through op goes.
    return placed(*args)


def summed_on(grad, device):
  """`grad`, summed on `device` where all it sums lives there.

  A tape sums a tensor's gradients from its several readers (a residual
  and a layer) where the backward pass was called: on the replica's first
  device. Such a sum is made again on `device`; the tape's, unused, is
  pruned.
  """
  if (tf.executing_eagerly() or not isinstance(grad, tf.Tensor) or
      grad.op.type != "AddN"):
    return grad
  here = tf.DeviceSpec.from_string(device)
  devices = {tf.DeviceSpec.from_string(t.device) for t in grad.op.inputs}
  if devices != {here} or tf.DeviceSpec.from_string(grad.device) == here:
    return grad
  with tf.device(device):
    return tf.add_n(list(grad.op.inputs))


def zero_after(tensor):
  """A scalar 0.0 computed from `tensor` on its device: added to a value,
  it makes the value wait for `tensor` by data (XLA ignores control
  dependencies), at the cost of a scalar moved."""
  with tf.device(tensor.device):
    first = tf.reduce_max(tf.reshape(tensor, [-1])[:1])  # -inf if empty.
    ready = tf.cast(first, tf.bool)
    return tf.where(ready == ready, 0.0, float("nan"))  # Not folded away.


def column_parallel(fn, x, kernel_parts, devices, extra_parts=None):
  """`[fn(x, kernel_parts[i], *extra_parts[i]) on devices[i]]`."""
  return [on_device(d, fn, x, w, *(extra_parts[i] if extra_parts else ()))
          for i, (d, w) in enumerate(zip(devices, kernel_parts))]


def row_products(fn, x_parts, kernel_parts, devices):
  """`[fn(x_parts[i], kernel_parts[i]) on devices[i]]`: what a row-parallel
  layer sums."""
  return [on_device(d, fn, x, w)
          for d, x, w in zip(devices, x_parts, kernel_parts)]


def row_parallel(fn, x_parts, kernel_parts, devices):
  """The sum over i of `fn(x_parts[i], kernel_parts[i])` (each on
  `devices[i]`), on `devices[0]`."""
  products = row_products(fn, x_parts, kernel_parts, devices)
  with tf.device(devices[0]):
    return tf.add_n(products)


def assembled(parts, devices, axis):
  """The parts concatenated along `axis` on the first device, recorded as
  in parts (nothing computes the concatenation unless a layer reads it)."""
  with tf.device(devices[0]):
    whole = tf.concat(parts, axis=axis)
  if not tf.executing_eagerly():
    _outputs_in_parts()[whole.ref()] = (tuple(parts), axis)
  return whole


def recorded(tensor):
  """(parts, axis) that `assembled` made `tensor` from, or None."""
  if tf.executing_eagerly() or not isinstance(tensor, tf.Tensor):
    return None
  return _outputs_in_parts().get(tensor.ref())


def parts_of(tensor, k, axis):
  """The k parts `tensor` was assembled from along `axis`, or None."""
  parts, parts_axis = recorded(tensor) or ((), None)
  if len(parts) != k:
    return None
  rank = tensor.shape.rank
  if rank is None or parts_axis % rank != axis % rank:
    return None
  return parts


def _outputs_in_parts():
  """The current graph's outputs in parts: {tensor ref: (parts, axis)}."""
  return tfi.owned_by(tf.compat.v1.get_default_graph(), "outputs_in_parts")


def split(tensor, k, axis, devices):
  """`tensor` in k parts along `axis`: a recorded split, else cut on
  `devices[0]`."""
  parts = parts_of(tensor, k, axis)
  if parts is None:
    with tf.device(devices[0]):
      parts = tf.split(tensor, k, axis=axis)
  return parts
