"""Sequence parallelism for Keras layers on a `ReplicatorStrategy(layout_map=...)`.

A row-parallel layer whose `<path>/output` key splits a dimension between
the batch and the features (the sequence: `(None, "model", None)`)
reduce-scatters its products along it (`row_output`): device i holds part i
of the sum. What follows takes the parts as they are, each on its device:

- `norm_in_parts`: a `LayerNormalization` over the features;
- `dropout_in_parts`: a `Dropout`, each part drawing the values one device
  draws for it (`model_parallel.sequence_parallel.dropout`);
- `add_in_parts`: `keras.ops.add`, a functional model's `x + y` and `Add`
  (a residual), the other operand cut where it lives if it is whole;

until a column-parallel layer all-gathers its input (`column_output`), once
per tensor however many layers read it (attention's query, key and value),
and again in the backward for its kernel's gradient.
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import options as options_lib
from replicator_strategy import replica_context
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import distribution_backend
from replicator_strategy.keras import random_layers
from replicator_strategy.model_parallel import megatron
from replicator_strategy.model_parallel import sequence_parallel


def output_axis(path, tensor):
  """The dimension the layout map's key for `path` (`<layer path>/output`)
  splits `tensor` along, or None; a layout a replica cannot apply is left
  out, with the warning `distribution_backend.distribute_tensor` gives."""
  options = options_lib.of()
  model_layouts = options and options.layouts
  if model_layouts is None or not isinstance(tensor, tf.Tensor):
    return None
  layout = model_layouts.layout_map[path]
  if layout is None:
    return None
  why = distribution_backend.unapplied(tensor, tuple(layout.axes))
  if why is not None:  # Left as it is, as keras.distribution is told.
    distribution_backend.warn_unapplied(tuple(layout.axes), why)
    return None
  return model_layouts.split_axis(path, tensor.shape.as_list())


def model_devices(tensor):
  """This replica's devices on the model axis where `tensor` lives, or None
  outside a ReplicatorStrategy replica."""
  ctx = tf.distribute.get_replica_context()
  if not isinstance(ctx, replica_context.ReplicaContext):
    return None
  return ctx.strategy.extended.logical_devices.model_devices(
      ctx.local_index, tensor.device)


def sequence_parts(tensor):
  """(parts, axis, devices) of `tensor` held in parts along a dimension
  between the batch and the features, one per device; else None."""
  if (tf.executing_eagerly() or not isinstance(tensor, tf.Tensor) or
      (tensor.shape.rank or 0) < 3):
    return None
  devices = model_devices(tensor)
  if devices is None or len(devices) < 2:
    return None
  for axis in range(1, tensor.shape.rank - 1):
    parts = megatron.parts_of(tensor, len(devices), axis)
    if parts is not None:
      return parts, axis, devices
  return None


def row_output(layer, products, devices, dtype):
  """A row-parallel `layer`'s output from its `products` (one per device),
  reduce-scattered where its output key splits the sequence; else None.
  The bias and activation act on each part on its device."""
  rank = products[0].shape.rank
  axis = output_axis(f"{layer.path}/output", products[0])
  if axis is None or not 0 < axis < rank - 1:
    return None
  parts = sequence_parallel.reduce_scatter(products, devices, axis)
  activation = layer.activation
  bias = [] if layer.bias is None else [tf.cast(layer.bias, dtype)]
  if bias or activation is not None:

    def finish(y, *bias):
      y = y + bias[0] if bias else y
      return y if activation is None else activation(y)

    parts = [megatron.on_device(d, finish, part, *bias)
             for d, part in zip(devices, parts)]
  return megatron.assembled(parts, devices, axis)


def column_output(inputs, product, finish, kernel_parts, extra_parts):
  """A column-parallel layer's output parts where `inputs` is in parts along
  the sequence, else None: on each device `product` of a whole all-gathered
  (once per tensor and graph, shared by the layers that read it), gathered
  again in the backward (`sequence_parallel.column_parallel`), then
  `finish(y, *extra_parts[i])` (the bias, the activation)."""
  found = sequence_parts(inputs)
  if found is None:
    return None
  parts, axis, devices = found
  gathers = tfi.owned_by(tf.compat.v1.get_default_graph(), "sequence_gathers")
  if inputs.ref() not in gathers:
    gathers[inputs.ref()] = sequence_parallel.gathered(parts, devices, axis)
  products = sequence_parallel.column_parallel(
      product, gathers[inputs.ref()], kernel_parts)
  return [megatron.on_device(d, finish, y, *(extra_parts[i] if extra_parts else ()))
          for i, (d, y) in enumerate(zip(devices, products))]


def norm_in_parts(call):
  """A `LayerNormalization` over the features normalizes each part of its
  input on the part's device."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    found = sequence_parts(inputs)
    axes = [self.axis] if isinstance(self.axis, int) else list(self.axis)
    if found is None or found[1] in [a % inputs.shape.rank for a in axes]:
      return call(self, inputs, *args, **kwargs)
    parts, axis, devices = found
    weights = [keras.ops.convert_to_tensor(w) if w is not None else None
               for w in (self.gamma, self.beta)]
    given = [w for w in weights if w is not None]

    def norm(x, *given):
      given = iter(given)
      gamma, beta = [None if w is None else next(given) for w in weights]
      out = keras.ops.layer_normalization(
          x, gamma, beta, self.axis, self.epsilon,
          rms_scaling=self.rms_scaling)
      return keras.ops.cast(out, self.compute_dtype)

    outputs = [megatron.on_device(d, norm, part, *given)
               for d, part in zip(devices, parts)]
    return megatron.assembled(outputs, devices, axis)

  return wrapper


def dropout_in_parts(call):
  """A `Dropout` drops from each part of its input on the part's device,
  the units one device drops there."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    training = kwargs.get("training", args[0] if args else False)
    found = sequence_parts(inputs)
    if (found is None or not training or not 0 < self.rate < 1 or
        self.noise_shape is not None):
      return call(self, inputs, *args, **kwargs)
    parts, axis, devices = found
    seed = ki.draw_seed(self.seed_generator)  # Once, as one device draws.
    first = random_layers.rows_of(parts[0])
    outputs = [megatron.on_device(d, functools.partial(
        sequence_parallel.dropout, rate=self.rate, seed=seed,
        first_row=0 if first is None else first, index=i, k=len(devices),
        axis=axis), part) for i, (d, part) in enumerate(zip(devices, parts))]
    return megatron.assembled(outputs, devices, axis)

  return wrapper


def add_in_parts(add):
  """Keras's backend `add`: of a tensor in parts along the sequence and one
  of its shape, part by part on each part's device."""

  @functools.wraps(add)
  def wrapper(x1, x2):
    found = sequence_parts(x1) or sequence_parts(x2)
    if (found is None or not isinstance(x1, tf.Tensor) or
        not isinstance(x2, tf.Tensor) or
        not x1.shape.is_compatible_with(x2.shape)):
      return add(x1, x2)
    _, axis, devices = found
    k = len(devices)
    outputs = [megatron.on_device(d, add, a, b) for d, a, b in zip(
        devices, megatron.split(x1, k, axis, [x1.device or devices[0]]),
        megatron.split(x2, k, axis, [x2.device or devices[0]]))]
    return megatron.assembled(outputs, devices, axis)

  return wrapper
