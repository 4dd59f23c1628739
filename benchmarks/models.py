"""The benchmark's models, data and optimizers, sized by the run's options.

Every contender starts from the same weights and data, so that their losses
can be compared ("agree").
"""

import keras
import numpy as np

from benchmarks import contenders
from benchmarks import timing


def mlp(size, h=None):
  h = h or size["mlp_hidden"]
  return keras.Sequential([
      keras.Input((size["image"] ** 2,)),
      keras.layers.Dense(h, activation="relu"),
      keras.layers.Dense(h, activation="relu"),
      keras.layers.Dense(10)])


def convnet(size):
  f = size["conv_filters"]
  s = size["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.Conv2D(f, 3, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.Conv2D(2 * f, 3, strides=2, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10)])


def tiny(size):
  """One small Dense layer: its step time is the per-step overhead."""
  return keras.Sequential([keras.Input((size["image"] ** 2,)),
                           keras.layers.Dense(10)])


def dropout_convnet(size):
  """The keras-io MNIST conv net (filters scaled like `convnet`'s, "same"
  padding so that the quick run's 8x8 images fit)."""
  f = size["conv_filters"]
  s = size["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.Conv2D(2 * f, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(2),
      keras.layers.Conv2D(4 * f, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(2),
      keras.layers.Flatten(),
      keras.layers.Dropout(0.5),
      keras.layers.Dense(10)])


def augmented(size):
  """RandomFlip + RandomRotation in front of a small conv net."""
  f = size["conv_filters"]
  s = size["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.RandomFlip(),
      keras.layers.RandomRotation(0.1),
      keras.layers.Conv2D(f, 3, strides=2, activation="relu"),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10)])


MODELS = {"mlp": mlp, "convnet": convnet}
RANDOM_MODELS = {"dropout": dropout_convnet, "augmented": augmented}
ALL_MODELS = {**MODELS, "tiny": tiny, **RANDOM_MODELS}
# Batch norm normalises each replica's share of the batch (under either
# strategy), so only the strategies agree with each other there.
PER_REPLICA_STATISTICS = ("convnet",)

OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-3)}


def losses_agree(model_name, losses):
  """Contenders' losses agree (with no strategy only where it can)."""
  names = [name for name in losses if not name.startswith("none") or
           model_name not in PER_REPLICA_STATISTICS]
  if model_name in RANDOM_MODELS:  # Only these draw one device's values.
    names = [name for name in names if name in ("none", "replicator")]
  return timing.agree((losses[name] for name in names), rtol=1e-4)


def data(size, model_name, batches):
  rng = np.random.default_rng(0)
  s = size["image"]
  shape = ((s, s, 1) if model_name in ("convnet", *RANDOM_MODELS)
           else (s * s,))
  rows = size["global_batch"] * batches
  x = rng.normal(size=(rows,) + shape).astype("float32")
  y = rng.integers(0, 10, size=rows).astype("int32")
  return x, y


def initial_weights(size, model_name):
  keras.utils.set_random_seed(0)
  return ALL_MODELS[model_name](size).get_weights()


def compiled(size, model_name, strategy, weights, optimizer="sgd",
             jit_compile=False):
  if model_name in RANDOM_MODELS:  # Every contender's layers: the same seeds.
    keras.utils.set_random_seed(0)
  with contenders.scope(strategy):
    model = ALL_MODELS[model_name](size)
    model.set_weights(weights)
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile)
  return model


def bytes_by_device(variables):
  """Bytes of every variable's components (copies, or shards), per device."""
  by_device = {}
  for variable in variables:
    value = getattr(variable, "value", variable)  # A Keras variable's tf one.
    for component in getattr(value, "values", (value,)):
      by_device[component.device] = by_device.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return by_device
