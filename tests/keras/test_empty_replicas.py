"""A conv net's short batches, fewer rows than replicas included, as on one device.

Batches of 1 to 7 rows (every short last batch on 4 replicas, 2 and 1 too)
leave replicas with few rows or none; `fit`, `evaluate` and `predict` of a
small conv net on them must equal one device's, with TF's oneDNN kernels on
or off. One dataset holds every batch size, so one run per replica count
covers the grid; the one-device run is made once and shared.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import topology

RTOL, ATOL = 1e-5, 1e-6
BATCH_SIZES = range(1, 8)  # 1 .. 2N - 1 for N = 4.
ROW_SHAPE = (6, 6, 1)


def conv_net():
  """Convolution, max pooling (its gradient aborts on 0 rows in oneDNN) and
  global pooling (it fails on the wrong shape a 0-row oneDNN convolution
  gives)."""
  return keras.Sequential([
      keras.Input(ROW_SHAPE), keras.layers.Conv2D(4, 3, activation="relu"),
      keras.layers.MaxPooling2D(2), keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(3)])


def data(rows, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows,) + ROW_SHAPE).astype(np.float32),
          rng.integers(0, 3, size=rows).astype(np.int32))


@functools.cache
def initial_weights():
  keras.utils.set_random_seed(0)
  return tuple(conv_net().get_weights())


def compiled(strategy):
  with strategy.scope():
    model = conv_net()
    model.set_weights(initial_weights())
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])
  return model


def results(model, x, y=None, batch_size=None):
  """History, evaluation, predictions and weights of `fit` (one epoch)."""
  history = model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
  return {"history": history.history,
          "evaluate": model.evaluate(x, y, batch_size=batch_size, verbose=0),
          "predict": model.predict(x, batch_size=batch_size,
                                   verbose=0).tolist(),
          "weights": [w.tolist() for w in model.get_weights()]}


def short_batches(strategy):
  """`results` on a dataset of batches of 1, 2, ... 7 rows, in turn."""
  x, y = data(sum(BATCH_SIZES))
  ends = np.cumsum(BATCH_SIZES)
  batches = functools.reduce(tf.data.Dataset.concatenate, [
      tf.data.Dataset.from_tensors((x[end - size:end], y[end - size:end]))
      for size, end in zip(BATCH_SIZES, ends)])
  return results(compiled(strategy), batches)


def last_batches(strategy, global_batch=8):
  """`results` of NumPy arrays of `global_batch` + r rows, for every r in
  `BATCH_SIZES`: a full batch, then a last batch of r rows; one model fits
  them in turn (its steps traced once). Keras's own input path, the one TF
  takes across workers."""
  model = compiled(strategy)
  return {str(r): results(model, *data(global_batch + r, seed=r),
                          batch_size=global_batch) for r in BATCH_SIZES}


@functools.cache
def one_device(run):
  """`run`'s results with no strategy."""
  return run(tf.distribute.get_strategy())


def assert_same(test, got, want):
  test.assertEqual(sorted(got), sorted(want))
  for key in want:
    if key == "weights":
      for g, w in zip(got[key], want[key]):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    elif key == "history":
      test.assertEqual(sorted(got[key]), sorted(want[key]))
      for name in want[key]:
        np.testing.assert_allclose(got[key][name], want[key][name],
                                   rtol=RTOL, atol=ATOL, err_msg=name)
    else:
      np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                 err_msg=key)


class BatchNormalizationTest(unittest.TestCase):

  @staticmethod
  def fit_one_row(strategy):
    """One row: replica 0 holds it, as one device does; the others none."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((3,)), keras.layers.Dense(4),
          keras.layers.BatchNormalization(), keras.layers.Dense(1)])
      model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.random.default_rng(0).normal(size=(1, 3)).astype(np.float32)
    model.fit(x, np.ones((1, 1), np.float32), epochs=2, verbose=0)
    return model

  def test_a_replica_without_rows_keeps_its_statistics(self):
    strategy = topology.strategy_over(2)
    model = self.fit_one_row(strategy)
    want = self.fit_one_row(tf.distribute.get_strategy()).get_weights()
    for got, w in zip(model.get_weights(), want):
      np.testing.assert_allclose(got, w, rtol=RTOL, atol=ATOL)
    norm = model.layers[1]
    initial = {"moving_mean": 0.0, "moving_variance": 1.0}
    for name, value in initial.items():
      # Replica 1 saw no rows: its statistics are as they started.
      empty = strategy.experimental_local_results(
          getattr(norm, name).value)[1]
      np.testing.assert_array_equal(empty, np.full([4], value, np.float32))


class ShortBatchesTest(unittest.TestCase):

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_fit_evaluate_predict_equal_one_device(self, _, n):
    assert_same(self, short_batches(topology.strategy_over(n)),
                one_device(short_batches))

  def test_last_batches_of_numpy_arrays_equal_one_device_4_replicas(self):
    got, want = last_batches(topology.strategy_over(4)), one_device(
        last_batches)
    for rows in want:
      with self.subTest(last_batch=rows):
        assert_same(self, got[rows], want[rows])


if __name__ == "__main__":
  unittest.main()
