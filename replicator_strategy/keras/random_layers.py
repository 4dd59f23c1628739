"""Keras's random layers draw, in each replica, that replica's rows of one device's values.

Keras draws random values with TF's stateless ops, seeded from a
`keras.random.SeedGenerator` whose state is the same on every replica, so
each replica would draw the values of the global batch's first rows: a
`Dropout(0.5)` would drop the same units of every replica's first row, and
training would differ from one device. Inside the calls of the layers in
`ROW_LAYERS`, whose draws are known to have one row per input row (rank 0
draws, the same for the whole batch, stay as they are), each replica draws
the values of its own rows of the global batch
(`replicator_strategy.random_rows`, at the cost of its own draw), placed by
the step's row counts (`ReplicaContext.batch_rows`). The seed generators
advance once per draw, as on one device, whatever the replica count.

`keras.random` called in user code (outside these layers) draws the same
values on every replica, as one device draws them once.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> x = np.ones((4, 3), "float32")
>>> one_device = keras.layers.GaussianNoise(0.5, seed=1)(x, training=True)
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> with strategy.scope():
...   noise = keras.layers.GaussianNoise(0.5, seed=1)
>>> halves = strategy.experimental_distribute_values_from_function(
...     lambda ctx: tf.constant(x[2 * ctx.replica_id_in_sync_group:][:2]))
>>> parts = strategy.experimental_local_results(strategy.run(
...     lambda x: noise(x, training=True), (halves,)))
>>> np.array_equal(np.concatenate(parts), one_device)
True
"""

import contextlib
import contextvars
import functools

import keras
import tensorflow as tf

from replicator_strategy import random_rows
from replicator_strategy import replica_context
from replicator_strategy.keras import _internal as ki

_layers = keras.layers
# Each draws one row of values per input row, or a value for the whole batch.
DROPOUT_LAYERS = (_layers.Dropout, ki.BaseSpatialDropout, _layers.AlphaDropout,
                  _layers.GaussianNoise, _layers.GaussianDropout)
# Images in, their transformations drawn in `get_random_transformation`.
IMAGE_LAYERS = (
    _layers.RandomFlip, _layers.RandomRotation, _layers.RandomTranslation,
    _layers.RandomZoom, _layers.RandomContrast, _layers.RandomBrightness,
    _layers.RandomSaturation, _layers.RandomHue, _layers.RandomSharpness,
    _layers.RandomColorDegeneration, _layers.RandomGrayscale,
    _layers.RandomInvert, _layers.RandomShear, _layers.RandomPerspective,
    _layers.RandomErasing,
    _layers.Solarization)
ROW_LAYERS = DROPOUT_LAYERS + IMAGE_LAYERS

# The rows of the layer input being drawn for, in this replica's thread.
_drawing_for = contextvars.ContextVar("drawing_for", default=None)
# False while `drawn_per_replica` holds (read by every replica's thread).
_aligned = [True]
# (first, count): the micro-batch of the replica's rows being run, if any.
_microbatch = contextvars.ContextVar("microbatch", default=None)


@contextlib.contextmanager
def drawn_per_replica():
  """Random layers traced within draw as Keras alone makes them: each replica
  its batch's first rows. For measuring what drawing one device's rows costs.
  """
  _aligned[0] = False
  try:
    yield
  finally:
    _aligned[0] = True


@contextlib.contextmanager
def microbatch(first, count):
  """Inside, the layers run on the micro-batch of `count` of the replica's
  rows from its row `first` on (a pipeline's): they draw those rows'."""
  token = _microbatch.set((first, count))
  try:
    yield
  finally:
    _microbatch.reset(token)


def microbatch_running():
  """The (first, count) of the `microbatch` running now, or None: what a
  recompute in the backward enters again to draw its forward's rows."""
  return _microbatch.get()


def rows_of(inputs):
  """Where `inputs`' rows lie in the global batch, or None to draw as is.

  A layer's input holds k rows per row of the step's input, or of its
  micro-batch (k = 1 but for reshaped batches): its rows from k * first on.
  """
  ctx = tf.distribute.get_replica_context()
  micro = _microbatch.get()
  if not (_aligned[0] and isinstance(ctx, replica_context.ReplicaContext) and
          (ctx.num_replicas_in_sync > 1 or micro is not None)):
    return None
  rows = ctx.batch_rows()
  if rows is None:
    return None
  first, step_rows = rows.first, rows.count
  if micro is not None:
    first += tf.cast(micro[0], tf.int64)
    step_rows = tf.cast(micro[1], tf.int64)
  count = tf.shape(inputs, out_type=tf.int64)[0]
  per_row = count // tf.maximum(step_rows, 1)
  # Not a multiple of the step's rows: not the batch; drawn as one device would.
  per_row = tf.where(per_row * step_rows == count, per_row, 0)
  return per_row * first


def _drawing_rows(call, inputs_of):
  """`call` with its draws placed at its input's rows of the global batch."""

  @functools.wraps(call)
  def wrapper(layer, *args, **kwargs):
    inputs = inputs_of(layer, *args, **kwargs)
    first = None if inputs is None else rows_of(inputs)
    if first is None:
      return call(layer, *args, **kwargs)
    token = _drawing_for.set(first)
    try:
      return call(layer, *args, **kwargs)
    finally:
      _drawing_for.reset(token)

  return wrapper


def _dropout_input(layer, inputs=None, *args, **kwargs):
  del args, kwargs
  noise_shape = getattr(layer, "noise_shape", None)
  if noise_shape is not None and noise_shape[0] is not None:
    return None  # One mask for the whole batch: drawn as is.
  return inputs


def _images(layer, data=None, *args, **kwargs):
  del args, kwargs
  images = data["images"] if isinstance(data, dict) else data
  # Unbatched images (rank 3) draw for one image.
  return images if len(images.shape) == 4 else None


def dropout_rows(call):
  """Wraps a dropout/noise layer's `call`."""
  return _drawing_rows(call, _dropout_input)


def image_rows(get_random_transformation):
  """Wraps an image layer's `get_random_transformation`."""
  return _drawing_rows(get_random_transformation, _images)


def _rank(shape):
  return shape.shape[0] if tf.is_tensor(shape) else len(shape)


def uniform_rows(uniform):
  """Keras's backend `uniform`, drawing the rows of a row layer's input."""

  @functools.wraps(uniform)
  def wrapper(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    first = _drawing_for.get()
    if first is None or _rank(shape) == 0:
      return uniform(shape, minval=minval, maxval=maxval, dtype=dtype,
                     seed=seed)
    return random_rows.uniform(shape, ki.draw_seed(seed), minval, maxval,
                               dtype or keras.config.floatx(), first)

  return wrapper


def normal_rows(normal):
  """Keras's backend `normal`, drawing the rows of a row layer's input."""

  @functools.wraps(normal)
  def wrapper(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    first = _drawing_for.get()
    if first is None or _rank(shape) == 0:
      return normal(shape, mean=mean, stddev=stddev, dtype=dtype, seed=seed)
    return random_rows.normal(shape, ki.draw_seed(seed), mean, stddev,
                              dtype or keras.config.floatx(), first)

  return wrapper


def dropout_mask_rows(dropout):
  """Keras's backend dropout, drawing the rows of the layer's input."""

  @functools.wraps(dropout)
  def wrapper(inputs, rate, noise_shape=None, seed=None):
    first = _drawing_for.get()
    if first is None or rate in (0.0, 1.0):
      return dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
    return random_rows.dropout(
        inputs, rate, ki.draw_seed(seed),
        noise_shape=ki.concrete_noise_shape(inputs, noise_shape),
        first_row=first)

  return wrapper
