"""A replica without rows skips the layers that fail or go wrong on none.

A batch of fewer rows than replicas leaves some replicas with none
(`replicator_strategy.global_batch_input` cuts every batch as evenly as it
can; TF's distributed dataset, which serves other inputs, leaves replicas
empty more often). On 0 rows:

- TF's oneDNN CPU kernels (on by default on x86 CPUs with AVX-512) give a
  convolution an output of the wrong shape (the next layer then fails:
  "Matrix size-incompatible: In[0]: [0,32]") and abort the process in max
  pooling's gradient;
- a `BatchNormalization` that is not synchronized takes the mean and
  variance of no rows, NaN: its moving statistics on that replica become
  NaN, and so, through its gradient, do its `gamma` on every replica.

So inside a replica of several, each call of a layer in `GUARDED_LAYERS` on
a batch not known to have rows runs under a `tf.cond`: without rows, the
layer returns 0 rows of its output shape, its weights get no gradient from
this replica and its state stays as it was, which is what 0 rows give on one
device. The step's loss and metrics count the true rows
(`ReplicaContext.batch_rows`), so every result is one device's. (A
synchronized `BatchNormalization` all-reduces its statistics, which every
replica must join: it runs, and counts no rows where there are none.)

>>> import keras
>>> import numpy as np
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((4, 4, 1)),
...                             keras.layers.Conv2D(2, 3), keras.layers.Flatten()])
>>> model.predict(np.ones((1, 4, 4, 1)), verbose=0).shape  # replica 1: no rows
(1, 8)
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import replicas

# Each class that defines the `call` the layers run (Conv1D's own does not
# call its base's).
GUARDED_LAYERS = (ki.BaseConv, keras.layers.Conv1D, ki.BaseDepthwiseConv,
                  ki.BaseSeparableConv, ki.BaseConvTranspose, ki.BasePooling,
                  keras.layers.BatchNormalization)


def skipped_without_rows(call):
  """Wraps a `GUARDED_LAYERS` class's `call(inputs, ...)`."""

  @functools.wraps(call)
  def wrapper(layer, inputs, *args, **kwargs):
    if (inputs.shape[0] or getattr(layer, "synchronized", False) or
        not replicas.in_our_replicas()):
      return call(layer, inputs, *args, **kwargs)

    def no_rows():
      shape = layer.compute_output_shape(tuple(inputs.shape))
      return tf.zeros([0] + [d or 0 for d in shape[1:]], inputs.dtype)

    return tf.cond(tf.shape(inputs)[0] > 0,
                   lambda: call(layer, inputs, *args, **kwargs), no_rows)

  return wrapper
