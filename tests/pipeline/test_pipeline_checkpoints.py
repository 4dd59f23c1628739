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

from test_pipeline_fit import data, initial_weights, mlp  # noqa: I001


def pipelined():
  strategy = rs.ReplicatorStrategy(
      pipeline=rs.Pipeline(stages=2, microbatches=2))
  with strategy.scope():
    model = mlp()
    model.set_weights(initial_weights())
    model.compile(keras.optimizers.Adam(0.01), "mse")
  return model


class PipelineCheckpointTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()

  def test_weights_file_to_no_strategy_and_back(self):
    model = pipelined()
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(self.dir, "m.weights.h5")
    model.save_weights(path)
    plain = mlp()
    plain.load_weights(path)
    for a, b in zip(plain.get_weights(), model.get_weights()):
      np.testing.assert_array_equal(a, b)
    # And back: into a pipeline whose stages are placed already.
    again = pipelined()
    again.predict(x[:16], verbose=0)
    again.load_weights(path)
    for a, b in zip(again.get_weights(), model.get_weights()):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(again.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=1e-5)

  def test_keras_file_loads_without_a_strategy(self):
    model = pipelined()
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(self.dir, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
      np.testing.assert_array_equal(a, b)
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
    piped.fit(x, y, batch_size=16, verbose=0)
    loaded.fit(x, y, batch_size=16, verbose=0)
    for a, b in zip(piped.get_weights(), loaded.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  unittest.main()
