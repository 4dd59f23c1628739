"""A custom training loop on 1, 2, 4 replicas matches the same loop on one device.

The loop is the one the tf.distribute guide teaches: a distributed dataset, a
`tf.function` step that calls `strategy.run`, a `GradientTape`, the loss
scaled with `tf.nn.compute_average_loss` and `optimizer.apply_gradients`.
The reference runs it without a strategy on the whole global batch; both
start from the same weights, so the final weights must agree.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import models
import topology

GLOBAL_BATCH = 16
STEPS = 4
RTOL, ATOL = 1e-5, 1e-6

_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "momentum": lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    # Accumulating steps add to each replica's accumulator and move no data;
    # every second step all-reduces the sum and updates.
    "adam_accumulate_2": lambda: keras.optimizers.Adam(
        learning_rate=0.01, gradient_accumulation_steps=2),
}
# Built: `optimizer.build` under scope first. Lazy: the first
# `apply_gradients`, inside the tf.function and `strategy.run`, builds it.
_BUILDS = [("lazy", False), ("built", True)]
_CASES = [(f"{n}_replicas_{opt}_{build}", n, opt, prebuilt)
          for n in topology.REPLICA_COUNTS for opt in _OPTIMIZERS
          for build, prebuilt in _BUILDS]


def dataset():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype(np.float32)
  y = rng.normal(size=(GLOBAL_BATCH * STEPS, 3)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def make_step(model, optimizer):
  """The per-replica step: returns the replica's share of the global loss."""

  def step(x, y):
    with tf.GradientTape() as tape:
      per_example = tf.reduce_mean(tf.square(model(x, training=True) - y),
                                   axis=-1)
      loss = tf.nn.compute_average_loss(per_example,
                                        global_batch_size=GLOBAL_BATCH)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


@functools.cache
def reference_run(optimizer_name):
  """Losses and final weights of the loop on one device, no strategy."""
  model = models.small_mlp()
  model.set_weights(models.initial_weights())
  optimizer = _OPTIMIZERS[optimizer_name]()
  train_step = tf.function(make_step(model, optimizer))
  losses = [float(train_step(x, y)) for x, y in dataset()]
  assert int(optimizer.iterations.numpy()) == updates(optimizer)
  return losses, model.get_weights()


def updates(optimizer):
  """The updates an optimizer makes in STEPS steps (Keras counts those)."""
  return STEPS // (optimizer.gradient_accumulation_steps or 1)


class CustomLoopTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_matches_single_device_training(self, _, n, optimizer_name,
                                          prebuilt):
    strategy = topology.strategy_over(n)
    with strategy.scope():
      model = models.small_mlp()
      model.set_weights(models.initial_weights())
      optimizer = _OPTIMIZERS[optimizer_name]()
      if prebuilt:
        optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer)

    @tf.function
    def train_step(batch):
      per_replica_loss = strategy.run(step, args=batch)
      return strategy.reduce("sum", per_replica_loss, axis=None)

    distributed = strategy.experimental_distribute_dataset(dataset())
    losses = [float(train_step(batch)) for batch in distributed]

    want_losses, want_weights = reference_run(optimizer_name)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    self.assertEqual(int(optimizer.iterations.numpy()), updates(optimizer))
    for v, want, start in zip(model.weights, want_weights, models.initial_weights()):
      self.assertGreater(np.abs(want - start).max(), 1e-3)  # it trained
      assert_per_replica(self, strategy, v.value, [want] * n, rtol=RTOL,
                         atol=ATOL, what=v.path)


if __name__ == "__main__":
  unittest.main()
