"""Gradients summed as 16-bit floats: half the bytes through every all-reduce.

`ReplicatorStrategy(gradient_compression="bfloat16")` (or `"float16"`) casts
each floating gradient wider than 16 bits down before the optimizer's
all-reduce and the sum back up after, as Horovod's `Compression.fp16` does.
Only the transfer and the sum are 16-bit: the optimizer updates its float32
weights and slots from a float32 gradient, as without compression. With
`shard_optimizer_state=True` the gradients' reduce-scatter travels so too;
with `variable_partitioner`, the sharded weights' gradient exchange (see
`sharding/variables.py`).

What it costs in precision: the sum of N replicas' gradients rounded to 16
bits, a relative error of at most about N * 2**-8 for "bfloat16" (8-bit
mantissa) and N * 2**-11 for "float16", whose range ends at 65504 and whose
smallest normal number is 6e-5 (smaller gradients lose digits, below 6e-8
they flush to zero). Keras divides each replica's loss by the number of
replicas, so the sum is the mean gradient and does not grow with N. With a
`LossScaleOptimizer` use "bfloat16": scaled float16 gradients overflow.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"],
...                                  gradient_compression="bfloat16")
>>> def step():
...   ctx = tf.distribute.get_replica_context()
...   return all_reduce_sum(ctx, [tf.constant(1 / 3)], tf.bfloat16)[0]
>>> total = strategy.experimental_local_results(strategy.run(step))[0]
>>> total.dtype.name, float(total)  # 2 x (1/3 in bfloat16: 0.333984375)
('float32', 0.66796875)
"""

import tensorflow as tf

WIRE_DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16}


def wire_dtype(gradient_compression):
  """The 16-bit dtype named by `gradient_compression`, or None for none."""
  if gradient_compression is None:
    return None
  name = (gradient_compression.lower()
          if isinstance(gradient_compression, str) else None)
  if name not in WIRE_DTYPES:
    raise ValueError(
        f"Expected `gradient_compression` to be None, \"float16\" or "
        f"\"bfloat16\" (any case). Received: gradient_compression="
        f"{gradient_compression!r}.")
  return WIRE_DTYPES[name]


def _compressed(gradient, wire):
  """Whether `gradient` travels as `wire`: a dense float wider than it."""
  return (wire is not None and isinstance(gradient, tf.Tensor) and
          gradient.dtype.is_floating and gradient.dtype.size > wire.size)


def to_wire(gradient, wire):
  """`gradient` as it is sent: cast to `wire` (None: no compression) if it is
  a dense float wider than that, else unchanged."""
  return tf.cast(gradient, wire) if _compressed(gradient, wire) else gradient


def from_wire(received, dtype):
  """A sum received as 16-bit floats, back in its gradient's `dtype`."""
  return received if received.dtype == dtype else tf.cast(received, dtype)


def all_reduce_sum(replica_context, gradients, wire):
  """`replica_context.all_reduce("sum", gradients)`, floats sent as `wire`.

  Each wider float tensor is cast to `wire` on its replica, summed, and the
  sum cast back to the tensor's dtype. Other values (sparse gradients, 16-bit
  ones) are summed as they are, in the same all-reduce.
  """
  gradients = list(gradients)
  summed = replica_context.all_reduce(
      tf.distribute.ReduceOp.SUM, [to_wire(g, wire) for g in gradients])
  return [from_wire(s, g.dtype) if _compressed(g, wire) else s
          for s, g in zip(summed, gradients)]
