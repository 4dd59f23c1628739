"""Keras's random layers under the strategy draw what one device draws.

Each replica's output of a random layer equals its rows of one device's
output for the global batch, and models with Dropout, GaussianNoise or
random image augmentation train as on one device, with an uneven final
batch that leaves replicas without rows. Each one-device reference is
computed once and shared by the replica counts compared with it.
"""

import functools
import tempfile
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import topology

RTOL, ATOL = 1e-5, 1e-5
GLOBAL_BATCH = 16
# 50 rows end on a batch of 2: on 4 replicas, 1, 1, 0 and 0 rows.
TRAIN_ROWS = 50
LAYER_ROWS = 10  # Split 5-5 on 2 replicas, 3-3-2-2 on 4.

_l = keras.layers
# name: (layer, input shape of one row). Images are 8x8 RGB in [0, 255].
LAYERS = {
    "Dropout": (lambda: _l.Dropout(0.5), (6,)),
    "Dropout_noise_shape": (lambda: _l.Dropout(0.5, noise_shape=(None, 1)),
                            (6,)),
    "SpatialDropout1D": (lambda: _l.SpatialDropout1D(0.5), (4, 3)),
    "SpatialDropout2D": (lambda: _l.SpatialDropout2D(0.5), (4, 4, 3)),
    "SpatialDropout3D": (lambda: _l.SpatialDropout3D(0.5), (2, 2, 2, 3)),
    "GaussianNoise": (lambda: _l.GaussianNoise(0.5), (6,)),
    "GaussianDropout": (lambda: _l.GaussianDropout(0.5), (6,)),
    "AlphaDropout": (lambda: _l.AlphaDropout(0.5), (6,)),
    "RandomFlip": (_l.RandomFlip, (8, 8, 3)),
    "RandomRotation": (lambda: _l.RandomRotation(0.3), (8, 8, 3)),
    "RandomTranslation": (lambda: _l.RandomTranslation(0.3, 0.3), (8, 8, 3)),
    "RandomZoom": (lambda: _l.RandomZoom(0.3), (8, 8, 3)),
    "RandomContrast": (lambda: _l.RandomContrast(0.5), (8, 8, 3)),
    "RandomBrightness": (lambda: _l.RandomBrightness(0.5), (8, 8, 3)),
    "RandomSaturation": (lambda: _l.RandomSaturation(0.5), (8, 8, 3)),
    "RandomHue": (lambda: _l.RandomHue(0.5), (8, 8, 3)),
    "RandomSharpness": (lambda: _l.RandomSharpness(0.5), (8, 8, 3)),
    "RandomColorDegeneration": (lambda: _l.RandomColorDegeneration(0.5),
                                (8, 8, 3)),
    "RandomColorJitter": (lambda: _l.RandomColorJitter(
        brightness_factor=0.5, contrast_factor=0.5, saturation_factor=0.5,
        hue_factor=0.5), (8, 8, 3)),
    "RandomGrayscale": (lambda: _l.RandomGrayscale(0.5), (8, 8, 3)),
    "RandomInvert": (lambda: _l.RandomInvert(0.5), (8, 8, 3)),
    "RandomShear": (lambda: _l.RandomShear(0.3, 0.3), (8, 8, 3)),
    "RandomPerspective": (lambda: _l.RandomPerspective(0.5), (8, 8, 3)),
    "RandomErasing": (lambda: _l.RandomErasing(0.5), (8, 8, 3)),
    "Solarization": (lambda: _l.Solarization(0.5, 0.5), (8, 8, 3)),
}


def _scale(row_shape):
  return 255.0 if len(row_shape) == 3 else 1.0


def _layer_input(row_shape):
  rng = np.random.default_rng(0)
  scale = _scale(row_shape)
  return (rng.uniform(size=(LAYER_ROWS,) + row_shape) * scale).astype(
      np.float32)


def _layer_output(name, strategy):
  make, row_shape = LAYERS[name]
  x = _layer_input(row_shape)
  keras.utils.set_random_seed(3)
  with strategy.scope():
    layer = make()
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices(x).batch(LAYER_ROWS))
  step = tf.function(lambda x: strategy.run(
      lambda x: layer(x, training=True), (x,)))
  parts = strategy.experimental_local_results(step(next(iter(dataset))))
  return np.concatenate([np.asarray(p) for p in parts])


@functools.cache
def one_device_output(name):
  return _layer_output(name, tf.distribute.get_strategy())


class LayerOutputTest(unittest.TestCase):

  @parameterized.expand([(f"{name}_{n}_replicas", name, n) for name in LAYERS
                         for n in (2, 4)])
  def test_each_replica_gets_its_rows_of_one_devices_output(self, _, name, n):
    # Geometric transforms interpolate in float32: rounding differs slightly
    # with the batch size, in proportion to the pixel values.
    np.testing.assert_allclose(
        _layer_output(name, topology.strategy_over(n)),
        one_device_output(name), rtol=RTOL,
        atol=ATOL * _scale(LAYERS[name][1]))


def conv_dropout():
  """The keras-io MNIST conv net, shrunk to 8x8 images."""
  return keras.Sequential([
      keras.Input((8, 8, 1)), _l.Conv2D(4, 3, activation="relu"),
      _l.MaxPooling2D(2), _l.Flatten(), _l.Dropout(0.5), _l.Dense(3)])


def gaussian_noise():
  return keras.Sequential([keras.Input((6,)), _l.GaussianNoise(0.3),
                           _l.Dense(8, activation="relu"), _l.Dense(3)])


def augmented_images():
  return keras.Sequential([
      keras.Input((8, 8, 1)), _l.RandomFlip(), _l.RandomRotation(0.2),
      _l.Conv2D(4, 3, activation="relu"), _l.GlobalAveragePooling2D(),
      _l.Dense(3)])


MODELS = {"conv_dropout": (conv_dropout, (8, 8, 1)),
          "gaussian_noise": (gaussian_noise, (6,)),
          "augmented_images": (augmented_images, (8, 8, 1))}


def train(model_name, strategy, per_replica=None):
  """History and weights after 2 epochs of `fit` (uneven final batch).

  With `per_replica(dataset, input_context)`, the global batches are cut into
  replica batches by it, through `distribute_datasets_from_function`.
  """
  make, row_shape = MODELS[model_name]
  rng = np.random.default_rng(0)
  x = rng.normal(size=(TRAIN_ROWS,) + row_shape).astype(np.float32)
  y = rng.integers(0, 3, size=TRAIN_ROWS).astype(np.int32)
  keras.utils.set_random_seed(7)
  with strategy.scope():
    model = make()
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  if per_replica is None:
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0)
  else:
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(strategy.distribute_datasets_from_function(
        lambda context: per_replica(batches.repeat(), context)), epochs=2,
                        steps_per_epoch=len(batches), verbose=0)
  return {"loss": history.history["loss"],
          "weights": [w.tolist() for w in model.get_weights()]}


@functools.cache
def one_device(model_name):
  return train(model_name, tf.distribute.get_strategy())


def assert_same_training(got, want):
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=RTOL)
  for g, w in zip(got["weights"], want["weights"]):
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-6)


class TrainingTest(unittest.TestCase):

  @parameterized.expand([(f"{m}_{n}_replicas", m, n) for m in MODELS
                         for n in (2, 4)])
  def test_fit_equals_one_device(self, _, model_name, n):
    assert_same_training(train(model_name, topology.strategy_over(n)),
                         one_device(model_name))


@pytest.mark.slow
class TwoWorkersTest(unittest.TestCase):

  def test_fit_on_two_workers_of_two_equals_one_device(self):
    import test_multi_worker  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as out:
      workers = test_multi_worker.results_of(["random_layers_fit"], out)
    for worker in workers:
      for name, got in worker["random_layers_fit"].items():
        assert_same_training(got, one_device(name))


if __name__ == "__main__":
  unittest.main()
