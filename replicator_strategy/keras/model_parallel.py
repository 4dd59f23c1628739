"""Keras layers on a `ReplicatorStrategy(layout_map=...)`.

- `variable_paths`: a Keras variable created in the strategy's scope tells
  the strategy its path and shape, which the layout map is looked up by.
"""

import functools

import tensorflow as tf

from replicator_strategy import replica_context
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import megatron
from replicator_strategy.model_parallel import split_variables


def _model_layouts():
  strategy = tf.distribute.get_strategy()
  return getattr(strategy.extended, "model_layouts", None)


def variable_paths(initialize):

  @functools.wraps(initialize)
  def wrapper(self, value):
    if _model_layouts() is None:
      return initialize(self, value)
    shape = self.shape if callable(value) else tf.TensorShape(value.shape)
    with layouts.creating(self.path, shape):
      return initialize(self, value)

  return wrapper


def _split(weight):
  value = getattr(weight, "value", None) if weight is not None else None
  return value if isinstance(value, split_variables.SplitVariable) else None


def _cast_parts(parts, dtype, devices):
  cast = []
  for part, device in zip(parts, devices):
    with tf.device(device):
      cast.append(tf.cast(part, dtype))
  return cast


def megatron_dense(call):
  """A `Dense` whose kernel the layout splits computes in parts (Megatron)."""

  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    ctx = tf.distribute.get_replica_context()
    plain = not (self.lora_enabled or self.quantization_mode)
    kernel = _split(self.kernel) if plain else None
    if kernel is None or not isinstance(ctx, replica_context.ReplicaContext):
      return call(self, inputs, *args, **kwargs)
    local = ctx.local_index
    devices = [p.device for p in kernel.parts(local)]
    dtype = self.compute_dtype
    kernel_parts = _cast_parts(kernel.read_parts(local), dtype, devices)
    k = len(devices)
    if kernel.axis == 1:  # Column-parallel: the output in parts.
      bias_parts = None
      if self.bias is not None:
        bias = _split(self.bias)
        if bias is not None:
          bias_parts = _cast_parts(bias.read_parts(local), dtype, devices)
        else:
          with tf.device(devices[0]):
            bias_parts = tf.split(tf.cast(self.bias, dtype), k)
      outputs = megatron.column_parallel(inputs, kernel_parts, bias_parts,
                                         self.activation, devices)
      return megatron.assembled(outputs, devices)
    x_parts = megatron.parts_of(inputs, k)
    if x_parts is None:
      with tf.device(devices[0]):
        x_parts = tf.split(inputs, k, axis=-1)
    x = megatron.row_parallel(x_parts, kernel_parts, devices)
    if self.bias is not None:
      x = x + tf.cast(self.bias, dtype)
    return x if self.activation is None else self.activation(x)

  return wrapper
