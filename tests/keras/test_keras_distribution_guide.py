"""The keras.io guide "Distributed training with Keras", walked on TensorFlow.

Its steps in our own code, on the 4 logical CPUs (a (2, 2) mesh where the
guide has (2, 4)): `initialize()` (single process: nothing to join),
`list_devices()`, a `DeviceMesh` with axes data and model, a `TensorLayout`,
`DataParallel()` set and an MLP on 28 x 28 x 1 images fitted and evaluated
with no scope; then a `LayoutMap` (`d1` split over model, `d2`'s output laid
out over data), `ModelParallel(batch_dim_name="data")` set, and a model of
`d1` and `d2` summarized and fitted.
"""

import io
import contextlib
import unittest

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.model_parallel import split_variables

ROWS, BATCH = 64, 16


def images_dataset(shape):
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(ROWS,) + shape).astype(np.float32)
  y = keras.utils.to_categorical(rng.integers(0, 10, size=ROWS), 10)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


class KerasGuideTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rs.use_for_keras_distribution()

  def tearDown(self):
    keras.distribution.set_distribution(None)
    self.assertFalse(tf.distribute.has_strategy())
    super().tearDown()

  def test_data_parallel_then_model_parallel_as_the_guide_does(self):
    try:
      keras.distribution.initialize()
    except (AttributeError, ValueError):  # One process: nothing to join.
      pass
    devices = keras.distribution.list_devices()
    self.assertEqual(len(devices), 4)
    mesh = keras.distribution.DeviceMesh((2, 2), ["data", "model"], devices)
    layout = keras.distribution.TensorLayout(("model", "data"), mesh)
    self.assertEqual(layout.axes, ("model", "data"))
    self.assertIs(layout.device_mesh, mesh)

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((28, 28, 1))
    hidden = keras.layers.Flatten()(inputs)
    hidden = keras.layers.Dense(200, activation="relu")(hidden)
    hidden = keras.layers.Dropout(0.4)(hidden)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    self.assertEqual(model.distribute_strategy.num_replicas_in_sync, 4)
    model.compile(loss="mse", optimizer="adam")
    before = model.get_weights()
    dataset = images_dataset((28, 28, 1))
    history = model.fit(dataset, epochs=1, verbose=0)
    self.assertTrue(np.isfinite(history.history["loss"]).all())
    self.assertTrue(np.isfinite(model.evaluate(dataset, verbose=0)))
    self.assertTrue(any(not np.array_equal(a, b)
                        for a, b in zip(before, model.get_weights())))

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("data", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"))
    # A functional model: its weights' paths are the keys ("d1/kernel");
    # a Sequential's are "sequential/d1/kernel", which the keys don't match.
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(200, activation="relu", name="d1")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax", name="d2")(hidden)
    model = keras.Model(inputs, outputs)
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):
      model.summary()
    self.assertIn("d1", summary.getvalue())
    d1 = model.get_layer("d1")
    for weight in (d1.kernel, d1.bias):
      self.assertIsInstance(weight.value, split_variables.SplitVariable)
    strategy = model.distribute_strategy
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    self.assertEqual(strategy.extended.options.layouts.batch_axis, "data")
    model.compile(loss="mse", optimizer="adam")
    history = model.fit(images_dataset((784,)), epochs=1, verbose=0)
    self.assertTrue(np.isfinite(history.history["loss"]).all())


if __name__ == "__main__":
  unittest.main()
