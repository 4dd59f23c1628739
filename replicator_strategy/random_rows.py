"""A replica's rows of the random values one device draws for the global batch.

TF's stateless random ops (Philox, on CPU and GPU, under XLA too) make
element i of a draw from counter block i // 4 (i // 2 for 64-bit values),
for uniform and normal values alike. A replica whose rows start at row
`first` of the global batch therefore draws only its own elements: it moves
the counter on by the blocks before them and drops the few leading values of
its first block. This costs what its own draw costs, whatever the number of
replicas, and gives bit for bit the values one device draws for those rows:

>>> import tensorflow as tf
>>> from replicator_strategy import random_rows
>>> seed = tf.constant([7, 0])
>>> whole = tf.random.stateless_uniform([10, 3], seed)
>>> rows = random_rows.uniform([4, 3], seed, first_row=5)
>>> bool(tf.reduce_all(rows == whole[5:9]))
True
"""

import tensorflow as tf

# Philox makes 4 uint32 per counter block: 4 values of 16 or 32 bits, 2 of 64.
_BLOCK_BITS = 128


def _values_per_block(dtype):
  bits = 64 if dtype.size == 8 else 32
  return _BLOCK_BITS // bits


def _values(op, count, start, seed, dtype):
  """`count` values of `op`'s draw from element `start` on (int64 scalars;
  `count` known before running, as XLA needs it, where it is an int)."""
  per_block = _values_per_block(dtype)
  lead = start % per_block
  key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
  # The counter is 128 bits, low word first: add the blocks with the carry.
  low = counter[0] + tf.cast(start // per_block, tf.uint64)
  carry = tf.cast(low < counter[0], tf.uint64)
  counter = tf.stack([low, counter[1] + carry])
  # A block more than `count` needs: the draw's size does not hang on `lead`.
  values = op(shape=tf.reshape(count + per_block - 1, [1]), key=key,
              counter=counter, dtype=dtype, alg=_AUTO_SELECT)
  return tf.slice(values, tf.reshape(lead, [1]),
                  tf.cast(tf.reshape(count, [1]), tf.int64))


def _draw(op, shape, seed, dtype, first_row):
  """`op`'s values for rows `first_row`... of a draw of that many more rows.

  `shape` is this replica's ([rows, ...]); `first_row` an integer scalar.
  """
  static = _static_shape(shape)
  shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
  start = tf.cast(first_row, tf.int64) * tf.reduce_prod(shape[1:])
  values = tf.reshape(
      _values(op, tf.reduce_prod(shape), start, seed, dtype), shape)
  values.set_shape(static)
  return values


def _static_shape(shape):
  """What is known before running of a shape given as a tensor or a list."""
  if tf.is_tensor(shape):
    return tf.TensorShape(None)
  return tf.TensorShape([tf.get_static_value(d) for d in shape])


# What `tf.random.stateless_*` pass: Philox on CPU and GPU.
_AUTO_SELECT = 3


def uniform(shape, seed, minval=0.0, maxval=1.0, dtype=tf.float32,
            first_row=0):
  """`tf.random.stateless_uniform` (floats) for rows `first_row`... of a
  larger draw, `shape` being these rows' ([rows, ...])."""
  dtype = tf.as_dtype(dtype)
  minval = tf.convert_to_tensor(minval, dtype)
  maxval = tf.convert_to_tensor(maxval, dtype)
  values = _draw(tf.raw_ops.StatelessRandomUniformV2, shape, seed, dtype,
                 first_row)
  return tf.add(values * (maxval - minval), minval)


def normal(shape, seed, mean=0.0, stddev=1.0, dtype=tf.float32, first_row=0):
  """`tf.random.stateless_normal` for rows `first_row`... of a larger draw."""
  dtype = tf.as_dtype(dtype)
  mean = tf.convert_to_tensor(mean, dtype)
  stddev = tf.convert_to_tensor(stddev, dtype)
  values = _draw(tf.raw_ops.StatelessRandomNormalV2, shape, seed, dtype,
                 first_row)
  return tf.add(values * stddev, mean)


def dropout(x, rate, seed, noise_shape=None, first_row=0):
  """`tf.nn.experimental.stateless_dropout` for rows `first_row`... of a
  larger batch; `x` and `noise_shape` are these rows'."""
  return tf.nn.experimental.general_dropout(
      x, rate, noise_shape=noise_shape,
      uniform_sampler=lambda shape, dtype: uniform(
          shape, seed, dtype=dtype, first_row=first_row))


def uniform_slice(shape, seed, axis, first, whole, dtype=tf.float32,
                  first_row=0):
  """`tf.random.stateless_uniform`'s values in [0, 1) for a slice along
  `axis` (> 0) of a larger draw: its dimension `axis` is `whole` long, of
  which `shape` (the slice's) holds `first`...; its rows from `first_row` on.

  Each index before `axis` holds one run of the draw's values. Where their
  number is known when tracing, each run draws the slice's values alone, one
  op each. Otherwise the rows' whole runs are drawn at once (whole / slice
  times the values; a loop of runs would be one XLA's auto-clustering
  leaves out, drawing TF's values under XLA) and the slice taken from each.

  >>> seed = tf.constant([7, 0])
  >>> whole = tf.random.stateless_uniform([6, 4, 3], seed)
  >>> part = uniform_slice([2, 2, 3], seed, 1, first=2, whole=4, first_row=3)
  >>> bool(tf.reduce_all(part == whole[3:5, 2:]))
  True
  >>> rows = tf.function(lambda: uniform_slice(
  ...     tf.constant([2, 2, 3]), seed, 1, first=2, whole=4, first_row=3))()
  >>> bool(tf.reduce_all(rows == part))
  True
  """
  dtype = tf.as_dtype(dtype)
  static = _static_shape(shape)
  shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
  inner = tf.reduce_prod(shape[axis + 1:])
  before = tf.cast(first_row, tf.int64) * tf.reduce_prod(shape[1:axis])
  rows = tf.reduce_prod(shape[:axis])
  run = static[axis:].num_elements() if static.rank else None
  if run is None:
    run = shape[axis] * inner

  def draw(count, start):
    return _values(tf.raw_ops.StatelessRandomUniformV2, count, start, seed,
                   dtype)

  count = static[:axis].num_elements() if static.rank else None
  if count:  # One op each, which XLA's clusters take in (not a loop).
    runs = tf.stack([draw(run, ((before + j) * whole + first) * inner)
                     for j in range(count)])
  else:  # Unknown when tracing, or none: the whole runs, then the slice.
    runs = tf.reshape(draw(rows * whole * inner, before * whole * inner),
                      tf.stack([rows, whole * inner]))
    runs = tf.slice(runs, tf.stack([0, first * inner]),
                    tf.stack([rows, tf.cast(run, tf.int64)]))
  values = tf.reshape(runs, shape)
  values.set_shape(static)
  return values


def dropout_part(x, rate, seed, axis, index, count, first_row=0):
  """`tf.nn.experimental.stateless_dropout` for part `index` of `count`
  equal parts along `axis` (> 0) of a larger batch: `x` is that part of
  rows `first_row`... (`uniform_slice`'s values).

  The dimensions known when tracing are passed as such: where all are, the
  draw is one op per row, which XLA compiles with the ops around it (its
  values then XLA's, as one device compiled with XLA draws them).

  >>> seed = tf.constant([7, 0])
  >>> whole = tf.nn.experimental.stateless_dropout(tf.ones([5, 8, 2]), 0.5, seed)
  >>> part = dropout_part(tf.ones([3, 4, 2]), 0.5, seed, axis=1, index=1,
  ...                     count=2, first_row=2)
  >>> bool(tf.reduce_all(part == whole[2:, 4:]))
  True
  """

  def uniform(shape, dtype):
    shape = [shape[j] if d is None else d
             for j, d in enumerate(x.shape.as_list())]
    length = tf.cast(shape[axis], tf.int64)
    return uniform_slice(shape, seed, axis, index * length, count * length,
                         dtype, first_row)

  return tf.nn.experimental.general_dropout(x, rate, uniform_sampler=uniform)
