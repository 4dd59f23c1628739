"""A pipeline trains with `model.losses` and loss scaling as one device does.

Each stage's weights' regularization counts once a step, on its device; an
activity regularizer counts on each micro-batch, weighted by its share of
the rows; the optimizer's `scale_loss` (a `LossScaleOptimizer`'s dynamic
scale, a `loss_scale_factor`) scales every loss before its gradient, and
the optimizer unscales the sum and skips a step that overflowed. Two steps
of two pipelines of 2 stages, 2 micro-batches each, against one device.
"""

import contextlib
import unittest

import keras
import numpy as np
import pytest

import replicator_strategy as rs

ROWS, BATCH = 32, 16


def regularized():
  """A regularizer on each stage's kernel; activity ones in either stage."""
  return keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(8, activation="tanh", name="d0",
                         kernel_regularizer=keras.regularizers.L2(0.1),
                         activity_regularizer=keras.regularizers.L1(0.05)),
      keras.layers.Dense(8, activation="tanh", name="d1"),
      keras.layers.Dense(8, activation="tanh", name="d2",
                         kernel_regularizer=keras.regularizers.L1L2(0.01, 0.2)),
      keras.layers.Dense(3, name="d3", bias_regularizer="l2",
                         activity_regularizer=keras.regularizers.L2(0.1)),
  ])


def plain():
  return keras.Sequential([keras.Input((8,))] + [
      keras.layers.Dense(width, name=f"d{i}")
      for i, width in enumerate((8, 8, 3))])


def data(huge_first_batch=False):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8)).astype(np.float32)
  if huge_first_batch:  # float16 activations overflow: the step is skipped.
    x[:BATCH] *= 1e5
  return x, rng.normal(size=(ROWS, 3)).astype(np.float32)


def fit(make_model, optimizer, strategy=None, x_y=None):
  keras.utils.set_random_seed(0)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = make_model()
    model.compile(optimizer(), "mse")
  history = model.fit(*(x_y or data()), batch_size=BATCH, shuffle=False,
                      verbose=0)
  return model, history.history["loss"]


def pipelines(schedule="1f1b"):
  """Two pipelines of 2 stages side by side, 2 micro-batches each."""
  return rs.ReplicatorStrategy(pipeline=rs.Pipeline(
      stages=2, microbatches=2, schedule=schedule))


def assert_as_one_device(make_model, optimizer, rtol=1e-5, x_y=None,
                         schedule="1f1b"):
  """Two steps of `pipelines(schedule)` and of one device end equal;
  returns both models."""
  one, one_loss = fit(make_model, optimizer, x_y=x_y)
  piped, loss = fit(make_model, optimizer, pipelines(schedule), x_y=x_y)
  for a, b in zip(piped.get_weights(), one.get_weights()):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10)
  np.testing.assert_allclose(loss, one_loss, rtol=rtol)
  return piped, one


class PipelineLossesTest(unittest.TestCase):

  def test_regularization_losses(self):
    piped, one = assert_as_one_device(
        regularized, lambda: keras.optimizers.Adam(0.01))
    # evaluate, stage by stage, counts them too.
    np.testing.assert_allclose(
        piped.evaluate(*data(), batch_size=BATCH, verbose=0),
        one.evaluate(*data(), batch_size=BATCH, verbose=0), rtol=1e-5)

  @pytest.mark.slow  # The quick loop has the 1F1B case.
  def test_regularization_losses_through_a_split_backward(self):
    # ZB-H1: an activity loss's gradient to the weights in the deferred W.
    assert_as_one_device(regularized, lambda: keras.optimizers.SGD(0.1),
                         schedule="zb_h1")

  def test_a_loss_scale_factor(self):
    # Keras scales the loss by it and divides the gradients by it.
    assert_as_one_device(
        plain, lambda: keras.optimizers.SGD(0.05, loss_scale_factor=64.0))


class PipelineLossScaleTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    keras.mixed_precision.set_global_policy("mixed_float16")
    self.addCleanup(keras.mixed_precision.set_global_policy, "float32")

  def test_mixed_float16_with_a_skipped_step(self):
    # The first batch overflows: both skip it and halve the scale; the
    # second trains, equal within float16's precision.
    piped, one = assert_as_one_device(
        plain, lambda: keras.optimizers.SGD(0.05), rtol=1e-3,
        x_y=data(huge_first_batch=True))
    self.assertIsInstance(piped.optimizer, keras.optimizers.LossScaleOptimizer)
    for model in (piped, one):  # The scale halved once, one step applied.
      self.assertEqual(model.optimizer.dynamic_scale.numpy(), 2.0 ** 14)
      self.assertEqual(model.optimizer.iterations.numpy(), 1)


if __name__ == "__main__":
  unittest.main()
