"""Keras layers on a `ReplicatorStrategy(layout_map=...)`.

- `variable_paths`: a Keras variable created in the strategy's scope tells
  the strategy its path and shape, which the layout map is looked up by;
- `megatron_dense`, `megatron_einsum_dense`: a `Dense` or `EinsumDense`
  whose kernel the layout splits runs column- or row-parallel
  (`model_parallel.megatron`), decided by where its einsum puts the split
  letter: in the output (column) or contracted (row);
- `megatron_embedding`: an `Embedding` whose table the layout splits looks
  up on each device: by columns, its output stays in parts; by rows (the
  vocabulary, Megatron's vocab-parallel embedding), each device looks up
  the ids in its rows and the parts are summed;
- `output_layouts`: a layer whose `<path>/output` key the layout map has
  returns its output in parts along the dimension the layout splits, one
  part per logical device (of its pipeline stage, with one), for a
  row-parallel layer after it; a layout it cannot apply (the model axis on
  the rows, dimension 0) is left out, with the warning
  `distribution_backend.distribute_tensor` gives.
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy import options as options_lib
from replicator_strategy import replica_context
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import sequence_parallel
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import megatron
from replicator_strategy.model_parallel import split_variables


def _model_layouts():
  options = options_lib.of()
  return options and options.layouts


def variable_paths(initialize):

  @functools.wraps(initialize)
  def wrapper(self, value):
    if _model_layouts() is None:
      return initialize(self, value)
    shape = self.shape if callable(value) else tf.TensorShape(value.shape)
    with layouts.creating(self.path, shape):
      return initialize(self, value)

  return wrapper


def split_variable(variable):
  """The `SplitVariable` behind `variable` (a Keras variable, its value, or
  None), or None.

  Under a mixed-precision policy a layer's weight reads as a cast tensor,
  which would assemble the whole: the layers cast the parts instead.
  """
  value = ki.backend_variable(variable) if isinstance(
      variable, keras.Variable) else variable
  return value if isinstance(value, split_variables.SplitVariable) else None


def _cast_parts(parts, dtype, devices):
  cast = []
  for part, device in zip(parts, devices):
    with tf.device(device):
      cast.append(tf.cast(part, dtype))
  return cast


def _matmul(x, kernel):
  if x.shape.rank == 2:
    return tf.matmul(x, kernel)
  return tf.tensordot(x, kernel, axes=1)


# Keras's activations that act on each value alone, so on each part.
_ELEMENTWISE = frozenset(keras.activations.get(name) for name in (
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu",
    "silu", "mish", "tanh", "sigmoid", "hard_sigmoid", "hard_silu",
    "softplus", "softsign", "exponential", "squareplus"))


def _split_kind(equation, kernel_axis):
  """("column", output axis) or ("row", input axis) for an einsum whose
  kernel is split along `kernel_axis`; axes count from the end."""
  operands, output = equation.replace("...", "").split("->")
  x_spec, kernel_spec = operands.split(",")
  letter = kernel_spec[kernel_axis]
  if letter in output:
    return "column", output.index(letter) - len(output)
  return "row", x_spec.index(letter) - len(x_spec)


def _parallel(layer, inputs, equation, product, bias_letters):
  """`layer` (a Dense or EinsumDense) run in parts, or None where it can't."""
  ctx = tf.distribute.get_replica_context()
  if (layer.lora_enabled or layer.quantization_mode or
      not isinstance(ctx, replica_context.ReplicaContext)):
    return None
  kernel = split_variable(layer.kernel)
  if kernel is None:
    return None
  local = ctx.local_index
  devices = [p.device for p in kernel.parts(local)]
  k = len(devices)
  dtype = layer.compute_dtype
  kind, axis = _split_kind(equation, kernel.axis)
  kernel_parts = _cast_parts(kernel.read_parts(local), dtype, devices)
  if kind == "column":
    # An activation over the features (softmax) needs them all: applied to
    # the assembled output, not to each device's part.
    activation = layer.activation or keras.activations.linear
    per_part = activation in _ELEMENTWISE
    bias_parts = None
    if layer.bias is not None:
      bias = split_variable(layer.bias)
      if bias is not None:
        bias_parts = _cast_parts(bias.read_parts(local), dtype, devices)
      elif equation.split("->")[1][axis] in bias_letters:
        with tf.device(devices[0]):
          bias_parts = tf.split(tf.cast(layer.bias, dtype), k, axis=axis)
      else:
        bias_parts = [tf.cast(layer.bias, dtype)] * k

    def finish(y, *bias):
      if bias:
        y = y + bias[0]
      return activation(y) if per_part else y

    extra_parts = None if bias_parts is None else [(b,) for b in bias_parts]
    outputs = sequence_parallel.column_output(
        inputs, product, finish, kernel_parts, extra_parts)
    if outputs is None:
      outputs = megatron.column_parallel(
          lambda x, w, *bias: finish(product(x, w), *bias), inputs,
          kernel_parts, devices, extra_parts)
    whole = megatron.assembled(outputs, devices, axis)
    return whole if per_part else activation(whole)
  products = megatron.row_products(
      product, megatron.split(inputs, k, axis, devices), kernel_parts, devices)
  scattered = sequence_parallel.row_output(layer, products, devices, dtype)
  if scattered is not None:
    return scattered
  with tf.device(devices[0]):
    x = tf.add_n(products)
  if layer.bias is not None:
    x = x + tf.cast(layer.bias, dtype)
  return x if layer.activation is None else layer.activation(x)


def megatron_dense(call):
  """A `Dense` whose kernel the layout splits computes in parts (Megatron)."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    out = _parallel(self, inputs, "...a,ab->...b", _matmul, "b")
    return call(self, inputs, *args, **kwargs) if out is None else out

  return wrapper


def megatron_einsum_dense(call):
  """An `EinsumDense` (attention's projections) whose kernel the layout
  splits computes in parts: split by heads, query/key/value are
  column-parallel and the output projection row-parallel."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    out = _parallel(self, inputs, self.equation,
                    lambda x, w: tf.einsum(self.equation, x, w),
                    self.bias_axes or "")
    return call(self, inputs, *args, **kwargs) if out is None else out

  return wrapper


def output_layouts(layer_call):
  """`Layer.__call__`, its output in parts where `<path>/output` says so."""

  @functools.wraps(layer_call)
  def wrapper(self, *args, **kwargs):
    outputs = layer_call(self, *args, **kwargs)
    ctx = tf.distribute.get_replica_context()
    if not isinstance(ctx, replica_context.ReplicaContext):
      return outputs
    axis = sequence_parallel.output_axis(f"{self.path}/output", outputs)
    if axis is None:  # No key, or not one tensor (an RNN cell's states).
      return outputs
    devices = sequence_parallel.model_devices(outputs)
    # Computed in parts (a column layer's, a sequence-parallel one's):
    # left so.
    if any(megatron.parts_of(outputs, len(devices), a)
           for a in range(outputs.shape.rank)):
      return outputs
    parts = [megatron.on_device(device, tf.identity, part)
             for device, part in zip(devices, megatron.split(
                 outputs, len(devices), axis, devices))]
    return megatron.assembled(parts, devices, axis)

  return wrapper


def megatron_embedding(call):
  """An `Embedding` whose table the layout splits looks up in parts."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    ctx = tf.distribute.get_replica_context()
    table = split_variable(self.embeddings) if not (
        self.lora_enabled or self.quantization_mode) else None
    if table is None or not isinstance(ctx, replica_context.ReplicaContext):
      return call(self, inputs, *args, **kwargs)
    local = ctx.local_index
    devices = [p.device for p in table.parts(local)]
    ids = tf.cast(inputs, tf.int32) if inputs.dtype not in (
        tf.int32, tf.int64) else inputs
    parts = table.read_parts(local)
    dtype = self.compute_dtype  # Each device casts what it looked up.
    if table.axis == 1:  # Columns: each device its slice of every row.
      outputs = [megatron.on_device(
          d, lambda t: tf.cast(tf.gather(t, ids), dtype), part)
                 for d, part in zip(devices, parts)]
      return megatron.assembled(outputs, devices, -1)
    rows = int(parts[0].shape[0])
    outputs = [megatron.on_device(d, functools.partial(
        _rows_here, ids=ids, first=i * rows, rows=rows, dtype=dtype), part)
               for i, (d, part) in enumerate(zip(devices, parts))]
    with tf.device(devices[0]):
      return tf.add_n(outputs)

  return wrapper


def _rows_here(table, ids, first, rows, dtype):
  """The rows of `ids` that `table` (rows first ... first+rows-1) holds, in
  `dtype`, zeros for the others; only those ids are looked up, so the
  gradient touches only them (as one device's sparse gradient does)."""
  local = tf.cast(ids, tf.int64) - first
  here = tf.where((local >= 0) & (local < rows))
  found = tf.cast(tf.gather(table, tf.gather_nd(local, here)), dtype)
  shape = tf.concat([tf.shape(ids, out_type=tf.int64),
                     tf.shape(table, out_type=tf.int64)[1:]], 0)
  return tf.scatter_nd(here, found, shape)

