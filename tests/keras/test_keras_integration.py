"""Per-batch logs and `*_on_batch` under the strategy equal one device's; batch shares.

Each one-device reference is computed once and shared by the replica counts.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.keras import training
import topology

ROWS, GLOBAL_BATCH = 44, 16  # The last batch has 12 rows: uneven on 4 replicas.


def data():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(ROWS, 6)).astype(np.float32)
  y = (rng.random(ROWS) < 0.4).astype(np.float32)
  return x, y


def build(strategy=None):
  keras.utils.set_random_seed(3)
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(1, activation="sigmoid")])
    # Precision is not an average of per-replica precisions, and a zero
    # learning rate keeps both models identical batch after batch.
    model.compile(keras.optimizers.SGD(0.0), "binary_crossentropy",
                  metrics=[keras.metrics.Precision(name="precision"), "accuracy"])
  return model


class BatchLogger(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.logs = []

  def on_train_batch_end(self, batch, logs=None):
    self.logs.append({k: float(v) for k, v in logs.items()})

  def on_test_batch_end(self, batch, logs=None):
    self.logs.append({k: float(v) for k, v in logs.items()})


def batch_logs(model, method):
  x, y = data()
  logger = BatchLogger()
  if method == "fit":
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
              callbacks=[logger], verbose=0)
  else:
    model.evaluate(x, y, batch_size=GLOBAL_BATCH, callbacks=[logger],
                   verbose=0)
  return logger.logs


@functools.cache
def one_device_batch_logs(method):
  return batch_logs(build(), method)


@functools.cache
def one_device_predict_on_batch(rows):
  return build().predict_on_batch(data()[0][:rows])


def train_and_test_on_batch(model):
  x, y = data()
  return {method: getattr(model, method)(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH],
                                         return_dict=True)
          for method in ("train_on_batch", "test_on_batch")}


@functools.cache
def one_device_train_and_test_on_batch():
  return train_and_test_on_batch(build())


class KerasIntegrationTest(unittest.TestCase):

  @parameterized.expand([(f"{n}_replicas_{m}", n, m)
                         for n in topology.REPLICA_COUNTS
                         for m in ("fit", "evaluate")])
  def test_per_batch_logs_are_global(self, _, n, method):
    want = one_device_batch_logs(method)
    got = batch_logs(build(topology.strategy_over(n)), method)
    self.assertEqual(len(got), len(want))
    for g, w in zip(got, want):
      self.assertEqual(sorted(g), sorted(w))
      for key in w:
        np.testing.assert_allclose(g[key], w[key], rtol=1e-5, err_msg=key)

  @parameterized.expand([(f"{n}_replicas_{rows}_rows", n, rows)
                         for n in topology.REPLICA_COUNTS for rows in (10, 3)])
  def test_predict_on_batch_returns_each_row_once_in_order(self, _, n, rows):
    want = one_device_predict_on_batch(rows)
    got = build(topology.strategy_over(n)).predict_on_batch(data()[0][:rows])
    self.assertEqual(got.shape, (rows, 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_train_and_test_on_batch_return_one_device_values(self, _, n):
    want = one_device_train_and_test_on_batch()
    got = train_and_test_on_batch(build(topology.strategy_over(n)))
    for method, logs in want.items():
      self.assertEqual(sorted(got[method]), sorted(logs), method)
      for key in logs:
        np.testing.assert_allclose(got[method][key], logs[key], rtol=1e-5,
                                   err_msg=f"{method} {key}")


class BatchShareTest(unittest.TestCase):
  """Each replica's share of the rows, by which its loss gradient is scaled."""

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_replica_with_r_plus_1_rows_has_its_share(self, _, n):
    strategy = topology.strategy_over(n)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([ctx.replica_id_in_sync_group + 1, 2]))
    share = lambda x: training.batch_share(tf.distribute.get_replica_context())
    got = strategy.experimental_local_results(
        tf.function(lambda v: strategy.run(share, (v,)))(values))
    total = n * (n + 1) / 2
    np.testing.assert_allclose(got, [(r + 1) / total for r in range(n)],
                               rtol=1e-6)

  def test_without_rows_it_is_unknown(self):
    strategy = topology.strategy_over(2)
    shares = strategy.run(
        lambda: training.batch_share(tf.distribute.get_replica_context()))
    self.assertIsNone(shares)


if __name__ == "__main__":
  unittest.main()
