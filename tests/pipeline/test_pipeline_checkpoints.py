"""A pipelined model's weights save and load as one device's do.

Its stages' variables live on their stages' devices, but a `.weights.h5` or
`.keras` file holds each weight once, as without a strategy: saved from a
pipeline it loads into a model with no strategy, and back.
"""

import os
import tempfile
import unittest

import keras
import numpy as np

import replicator_strategy as rs

from pipeline_fits import BATCH  # noqa: I001
from pipeline_fits import assert_equal_weights
from pipeline_fits import data
from pipeline_fits import initial_weights
from pipeline_fits import mlp


def pipelined():
  strategy = rs.ReplicatorStrategy(
      pipeline=rs.Pipeline(stages=2, microbatches=2))
  with strategy.scope():
    model = mlp()
    model.set_weights(initial_weights())
    model.compile(keras.optimizers.Adam(0.01), "mse")
  return model


def weights_loaded(model, path):
  model.load_weights(path)
  return model


def assert_same_weights(got, want):
  for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
    np.testing.assert_array_equal(a, b)


class PipelineCheckpointTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.fitted = pipelined()  # Each test saves it, none changes it.
    cls.fitted.fit(*data(), batch_size=BATCH, verbose=0)

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()

  def save_and_load(self, file_name, save, load):
    """(model, loaded, path): the fitted pipelined model, saved to `path`
    with `save(model, path)`, and `load(path)`, which holds its weights."""
    path = os.path.join(self.dir, file_name)
    save(self.fitted, path)
    loaded = load(path)
    assert_same_weights(loaded, self.fitted)
    return self.fitted, loaded, path

  def test_weights_file_to_no_strategy_and_back(self):
    model, plain, path = self.save_and_load(
        "m.weights.h5", keras.Model.save_weights,
        lambda path: weights_loaded(mlp(), path))
    # And back: into a pipeline whose stages are placed already.
    again = pipelined()
    x, _ = data()
    again.predict(x[:16], verbose=0)
    assert_same_weights(weights_loaded(again, path), model)
    np.testing.assert_allclose(again.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=1e-5)

  def test_keras_file_loads_without_a_strategy(self):
    model, loaded, path = self.save_and_load(
        "m.keras", keras.Model.save, keras.models.load_model)
    # The optimizer's slots (on the stages' devices) are saved too.
    self.assertEqual(len(loaded.optimizer.variables),
                     len(model.optimizer.variables))
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
      np.testing.assert_array_equal(a.numpy(), b.numpy())

    # Loaded into a pipeline (its optimizer built: the slots move with their
    # weights), it trains on as the model loaded without one.
    strategy = rs.ReplicatorStrategy(
        pipeline=rs.Pipeline(stages=2, microbatches=2))
    with strategy.scope():
      piped = keras.models.load_model(path)
    piped.fit(*data(), batch_size=BATCH, verbose=0)
    loaded.fit(*data(), batch_size=BATCH, verbose=0)
    assert_equal_weights(piped.get_weights(), loaded.get_weights())


if __name__ == "__main__":
  unittest.main()
