"""Per-batch logs and `*_on_batch` under the strategy equal one device's; batch shares.

Each one-device reference is computed once and shared by the replica counts.
"""

import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.keras import replica_loss
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


TOKENS, CLASSES, CALLS = 12, 3, 3


class RowsSeen(keras.layers.Layer):
  """Passes its input on; run eagerly, records each replica's rows."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.seen = []

  def call(self, x):
    if tf.executing_eagerly():  # Not the model's symbolic build.
      self.seen.append(int(tf.shape(x)[0]))
    return x


def on_batch_model(kind, strategy=None, run_eagerly=False):
  """A classifier of features ("dense", or "sparse" ones) or of tokens
  ("embedding", or "ragged" rows of them)."""
  keras.utils.set_random_seed(3)
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    if kind in ("dense", "sparse"):
      layers = [keras.Input((6,), sparse=kind == "sparse"), RowsSeen(),
                keras.layers.Dense(CLASSES)]
    elif kind == "embedding":
      # Its gradient is sparse: Keras's Adam squares it slice by slice.
      layers = [keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(TOKENS, 5), keras.layers.Flatten()]
    else:
      layers = [keras.Input((None,), dtype="int32", ragged=True),
                keras.layers.Embedding(TOKENS, 5),
                keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1))]
    model = keras.Sequential(layers + [keras.layers.Dense(CLASSES)]
                             if kind in ("embedding", "ragged") else layers)
    # Keras's kernel gradient for a sparse input has a slice per column of
    # the rows, so each replica's part adds its own: Adam, which squares
    # each, differs from one device as it does under fit.
    optimizer = (keras.optimizers.SGD(0.1, momentum=0.5) if kind == "sparse"
                 else keras.optimizers.Adam(0.05))
    model.compile(optimizer,
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], run_eagerly=run_eagerly,
                  jit_compile=False)
  return model


def on_batch_data(kind, rows):
  """`x` (as NumPy, dense: 0 pads a ragged row, is left out of a sparse
  one), `y` and sample weights for `CALLS` batches of `rows`."""
  rng = np.random.default_rng(5)
  total = CALLS * rows
  if kind in ("dense", "sparse"):
    x = rng.normal(size=(total, 6)).astype(np.float32)
    if kind == "sparse":
      x *= rng.random(x.shape) < 0.5
  else:
    x = rng.integers(1, TOKENS, size=(total, 4)).astype(np.int32)
    if kind == "ragged":
      x *= np.arange(4) < rng.integers(1, 5, size=(total, 1))
  y = rng.integers(0, CLASSES, size=total)
  sample_weight = rng.uniform(0.1, 2.0, size=total).astype(np.float32)
  return x, y, sample_weight


def as_input(kind, x):
  if kind == "sparse":
    return tf.sparse.from_dense(x)
  if kind == "ragged":
    return tf.RaggedTensor.from_tensor(x, padding=0)
  return x


def on_batch_calls(model, kind, rows, weighting):
  """`CALLS` train_on_batch calls, then a test_on_batch: the logs each
  returns, and the weights."""
  x, y, sample_weight = on_batch_data(kind, rows)
  logs = []
  for k in range(CALLS):
    part = slice(k * rows, (k + 1) * rows)
    weights = {"sample_weight": {"sample_weight": sample_weight[part]},
               "class_weight": {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}},
               None: {}}[weighting]
    logs.append(model.train_on_batch(as_input(kind, x[part]), y[part],
                                     return_dict=True, **weights))
  weights = ({"sample_weight": sample_weight[:rows]}
             if weighting == "sample_weight" else {})
  logs.append(model.test_on_batch(as_input(kind, x[:rows]), y[:rows],
                                  return_dict=True, **weights))
  return logs, model.get_weights()


@functools.cache
def one_device_on_batch_calls(kind, rows, weighting):
  return on_batch_calls(on_batch_model(kind), kind, rows, weighting)


ON_BATCH_CASES = (("dense", 16, None), ("dense", 16, "sample_weight"),
                  ("dense", 16, "class_weight"), ("dense", 7, None),
                  ("embedding", 16, None), ("sparse", 7, None),
                  ("ragged", 7, None))


class OnBatchTest(unittest.TestCase):
  """train_on_batch and test_on_batch split the batch as fit and evaluate do."""

  @parameterized.expand([
      (f"{kind}_{rows}_rows_{weighting}_{n}_replicas", kind, rows, weighting, n)
      for kind, rows, weighting in ON_BATCH_CASES for n in (2, 4)])
  def test_as_on_one_device(self, _, kind, rows, weighting, n):
    want_logs, want_weights = one_device_on_batch_calls(kind, rows, weighting)
    logs, weights = on_batch_calls(
        on_batch_model(kind, topology.strategy_over(n)), kind, rows, weighting)
    for call, (got, want) in enumerate(zip(logs, want_logs)):
      self.assertEqual(sorted(got), sorted(want))
      for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"call {call}: {key}")
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  @parameterized.expand([(f"{n}_replicas", n, parts)
                         for n, parts in ((2, [4, 3]), (4, [2, 2, 2, 1]))])
  def test_each_replica_sees_its_part(self, _, n, parts):
    model = on_batch_model("dense", topology.strategy_over(n),
                           run_eagerly=True)
    seen = model.layers[0].seen
    x, y, _ = on_batch_data("dense", 7)
    model.train_on_batch(x[:7], y[:7])
    self.assertEqual(sorted(seen), sorted(parts))
    seen.clear()
    model.test_on_batch(x[:7], y[:7])
    self.assertEqual(sorted(seen), sorted(parts))

  def test_class_weight_with_sample_weight_is_refused_as_by_keras(self):
    model = on_batch_model("dense", topology.strategy_over(2))
    x, y, sample_weight = on_batch_data("dense", 4)
    with self.assertRaisesRegex(
        ValueError, r"`sample_weight` and `class_weight` cannot be specified "
        r"at the same time. Received: sample_weight=\[.*\], "
        r"class_weight=\{0: 2.0\}"):
      model.train_on_batch(x[:4], y[:4], sample_weight=sample_weight[:4],
                           class_weight={0: 2.0})


class BatchShareTest(unittest.TestCase):
  """Each replica's share of the rows, by which its loss gradient is scaled."""

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_a_replica_with_r_plus_1_rows_has_its_share(self, _, n):
    strategy = topology.strategy_over(n)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([ctx.replica_id_in_sync_group + 1, 2]))
    share = lambda x: replica_loss.batch_share(tf.distribute.get_replica_context())
    got = strategy.experimental_local_results(
        tf.function(lambda v: strategy.run(share, (v,)))(values))
    total = n * (n + 1) / 2
    np.testing.assert_allclose(got, [(r + 1) / total for r in range(n)],
                               rtol=1e-6)

  def test_without_rows_it_is_unknown(self):
    strategy = topology.strategy_over(2)
    shares = strategy.run(
        lambda: replica_loss.batch_share(tf.distribute.get_replica_context()))
    self.assertIsNone(shares)


if __name__ == "__main__":
  unittest.main()
