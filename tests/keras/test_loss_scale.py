"""Under `mixed_float16`, a step whose gradients overflow on any replica is
skipped, as one device skips it.

The last replica's rows have targets large enough that their scaled float16
gradients overflow; the other replicas' do not. One device, which sees every
row, skips the step and halves the loss scale; so must every replica
(`keras.loss_scale`), rather than apply the overflowed sum.
"""

import contextlib
import unittest

import keras
import numpy as np
from parameterized import parameterized

import topology

ROWS = 8


def fitted(strategy, steps_per_execution=1):
  """A Dense layer fitted 3 steps under mixed_float16; the loss history."""
  with strategy.scope() if strategy else contextlib.nullcontext():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.01), "mse",
                  steps_per_execution=steps_per_execution)
  x = np.ones((3 * ROWS, 4), np.float32)
  y = np.zeros((3 * ROWS, 3), np.float32)
  y[ROWS - 2:ROWS] = 300.0  # The first step's last 2 rows overflow.
  history = model.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0)
  return model, history.history["loss"]


class LossScaleTest(unittest.TestCase):

  def setUp(self):
    keras.mixed_precision.set_global_policy("mixed_float16")
    self.addCleanup(keras.mixed_precision.set_global_policy, "float32")

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS + [
      # The steps in a loop: the check runs where replicas cannot merge.
      ("2_replicas_3_steps_per_execution", 2, 3)])
  def test_an_overflow_on_one_replica_skips_the_step_as_one_device(
      self, _, n, steps_per_execution=1):
    want, want_loss = fitted(None)
    self.assertEqual(want.optimizer.dynamic_scale.numpy(), 2.0**14)  # Skipped.
    model, loss = fitted(topology.strategy_over(n), steps_per_execution)
    self.assertEqual(model.optimizer.dynamic_scale.numpy(), 2.0**14)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-3)
    for w, h in zip(want.get_weights(), model.get_weights(), strict=True):
      np.testing.assert_allclose(h, w, rtol=1e-3, atol=1e-3)


if __name__ == "__main__":
  unittest.main()
