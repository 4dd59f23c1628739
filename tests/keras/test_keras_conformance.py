"""Keras's own tf.distribute tests, run against ReplicatorStrategy.

The keras wheel ships the tests Keras runs under MirroredStrategy. Importing
their classes here lets pytest collect them; a fixture makes every
`tf.distribute.MirroredStrategy(devices)` they build a ReplicatorStrategy over
the same devices. Their set-up resets TF's context to split the CPU in two;
that is skipped, so the 4-way split made by conftest stays in place.
"""

from unittest import mock

from keras import optimizers
from keras.src import backend
import pytest
import tensorflow as tf

import replicator_strategy as rs

# pylint: disable=g-import-not-at-top,unused-import
from keras.src.backend.tensorflow import distribute_test
from keras.src.backend.tensorflow.distribute_test import DistributeTest
from keras.src.backend.tensorflow import optimizer_distribute_test
from keras.src.callbacks import swap_ema_weights_test
# pylint: enable=g-import-not-at-top,unused-import

# Only one of the EMA-callback tests uses a strategy; the rest are hidden.
def _only_strategy_tests(test_class, keep):
  return type(test_class.__name__, (test_class,), {
      name: None for name in dir(test_class)
      if name.startswith("test_") and name != keep})


class OptimizerDistributeTest(
    optimizer_distribute_test.OptimizerDistributeTest):
  """Keras's optimizer tests; one reads a gradient accumulator differently.

  Under MirroredStrategy an accumulator read outside the replicas is the
  first replica's own sum; under ReplicatorStrategy it is the sum over every
  replica (what one device accumulates for the summed gradients, and what a
  save keeps, docs/keras.md). The weights are Keras's expected ones.
  """

  def test_gradient_accumulation(self):
    with self.strategy.scope():
      v = backend.Variable([[1.0, 2.0], [3.0, 4.0]])
      grads = backend.convert_to_tensor([[1.0, 1.0], [2.0, 2.0]])
      optimizer = optimizers.SGD(learning_rate=1.0,
                                 gradient_accumulation_steps=3)
      replicas = self.strategy.num_replicas_in_sync
      self.assertEqual(replicas, 2)
      for step, weights in ((1, [[1.0, 2.0], [3.0, 4.0]]),
                            (2, [[1.0, 2.0], [3.0, 4.0]]),
                            (3, [[-1.0, 0.0], [-1.0, 0.0]])):
        self.strategy.run(lambda: optimizer.apply_gradients([(grads, v)]))
        self.assertAllClose(v, weights)
        self.assertAllClose(optimizer._accumulated_gradients[0],  # pylint: disable=protected-access
                            (step % 3) * replicas * grads)
        self.assertAllClose(optimizer._iterations, step)  # pylint: disable=protected-access
        self.assertAllClose(optimizer.iterations, step // 3)


SwapEMAWeightsTest = _only_strategy_tests(
    swap_ema_weights_test.SwapEMAWeightsTest,
    keep="test_swap_ema_weights_with_tf_distribute")


@pytest.fixture(autouse=True)
def replicator_in_place_of_mirrored():
  created = []

  def make(devices=None, cross_device_ops=None):
    del cross_device_ops
    created.append(rs.ReplicatorStrategy(devices=devices))
    return created[-1]

  with mock.patch.object(tf.distribute, "MirroredStrategy", make), \
       mock.patch.object(distribute_test.context, "_reset_context"), \
       mock.patch.object(tf.config, "set_logical_device_configuration"):
    yield created
  assert created, "the test never built a strategy, so it checked nothing"
