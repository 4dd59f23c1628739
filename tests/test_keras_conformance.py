"""Keras's own tf.distribute tests, run against ReplicatorStrategy.

The keras wheel ships the tests Keras runs under MirroredStrategy. Importing
their classes here lets pytest collect them; a fixture makes every
`tf.distribute.MirroredStrategy(devices)` they build a ReplicatorStrategy over
the same devices. Their set-up resets TF's context to split the CPU in two;
that is skipped, so the 4-way split made by conftest stays in place.
"""

from unittest import mock

import pytest
import tensorflow as tf

import replicator_strategy as rs

# pylint: disable=g-import-not-at-top,unused-import
from keras.src.backend.tensorflow import distribute_test
from keras.src.backend.tensorflow.distribute_test import DistributeTest
from keras.src.backend.tensorflow.optimizer_distribute_test import OptimizerDistributeTest
from keras.src.callbacks import swap_ema_weights_test
# pylint: enable=g-import-not-at-top,unused-import

# Only one of the EMA-callback tests uses a strategy; the rest are hidden.
def _only_strategy_tests(test_class, keep):
  return type(test_class.__name__, (test_class,), {
      name: None for name in dir(test_class)
      if name.startswith("test_") and name != keep})


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
