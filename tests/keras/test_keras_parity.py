"""Keras `fit`/`evaluate`/`predict` under the strategy equal one device.

Four model families (MLP, conv net with synchronized batch norm, embedding,
RNN), the MLP also through `tf.keras`, and the input kinds Keras accepts.
No data set is a multiple of the global batch: the last batch splits
unevenly, yet must train as on one device, every example must be counted
once and every row returned once, in order. Each one-device reference is
trained once and shared by the replica counts compared with it.
"""

import functools
import gc
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import topology

GLOBAL_BATCH = 16
# Neither is a multiple of the batch; 58 ends on 10 rows, split 3-3-2-2.
TRAIN_ROWS, EVAL_ROWS = 58, 27
RTOL, ATOL = 1e-5, 1e-6


def mlp():
  return keras.Sequential([keras.Input((6,)),
                           keras.layers.Dense(8, activation="relu"),
                           keras.layers.Dense(3)])


def tf_keras_mlp():
  # `tf.keras` names the same Keras 3 that `import keras` gives.
  return tf.keras.Sequential([tf.keras.Input((6,)),
                              tf.keras.layers.Dense(8, activation="relu"),
                              tf.keras.layers.Dense(3)])


def conv_sync_bn():
  return keras.Sequential([
      keras.Input((6, 6, 2)),
      # No bias before batch norm: its true gradient is zero, and Adam would
      # blow float noise in it up to full-size steps that differ per run.
      keras.layers.Conv2D(4, 3, use_bias=False),
      keras.layers.BatchNormalization(synchronized=True),
      keras.layers.ReLU(),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(3),
  ])


def embedding():
  return keras.Sequential([keras.Input((5,), dtype="int32"),
                           keras.layers.Embedding(20, 4),
                           keras.layers.GlobalAveragePooling1D(),
                           keras.layers.Dense(3)])


def rnn():
  return keras.Sequential([keras.Input((4, 3)), keras.layers.SimpleRNN(5),
                           keras.layers.Dense(3)])


MODELS = {
    "mlp": (mlp, lambda rng, n: rng.normal(size=(n, 6))),
    "tf_keras_mlp": (tf_keras_mlp, lambda rng, n: rng.normal(size=(n, 6))),
    "conv_sync_bn": (conv_sync_bn, lambda rng, n: rng.normal(size=(n, 6, 6, 2))),
    "embedding": (embedding, lambda rng, n: rng.integers(0, 20, size=(n, 5))),
    "rnn": (rnn, lambda rng, n: rng.normal(size=(n, 4, 3))),
}


# `tf.keras` is the Keras that `import keras` gives (its MLP builds, seeds and
# trains as the keras one): one device's keras MLP is its reference, and
# 4 replicas show it (on 1 and 2 it would run mlp's cases again).
SAME_MODEL = {"tf_keras_mlp": "mlp"}


def make_data(model_name, rows, seed):
  rng = np.random.default_rng(seed)
  x = MODELS[model_name][1](rng, rows)
  x = x.astype(np.int32 if x.dtype.kind == "i" else np.float32)
  return x, rng.integers(0, 3, size=rows).astype(np.int32)


def build(model_name, strategy):
  keras.utils.set_random_seed(7)
  with strategy.scope():
    model = MODELS[model_name][0]()
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  return model


def train_and_measure(model_name, strategy, fit_name="numpy",
                      encoding="dense"):
  """Trains with `FITS[fit_name]`, evaluates and predicts.

  `ENCODINGS[encoding]` turns every x into the model's input.
  """
  encode = ENCODINGS[encoding]
  model = build(model_name, strategy)
  x, y = make_data(model_name, TRAIN_ROWS, seed=0)
  history = FITS[fit_name](model, encode(x), y).history
  xe, ye = make_data(model_name, EVAL_ROWS, seed=1)
  xe = encode(xe)
  return {
      "history": history,
      "evaluate": model.evaluate(xe, ye, batch_size=GLOBAL_BATCH, verbose=0),
      "predict": model.predict(xe, batch_size=GLOBAL_BATCH, verbose=0),
      "weights": model.get_weights(),
  }


@functools.cache
def one_device(model_name, fit_name="numpy", encoding="dense"):
  """`train_and_measure` with no strategy; callers must not change it."""
  return train_and_measure(model_name, tf.distribute.get_strategy(), fit_name,
                           encoding)


def fit_numpy(model, x, y):
  return model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                   verbose=0)


def assert_same_results(test, got, want):
  test.assertEqual(sorted(got["history"]), sorted(want["history"]))
  for key, values in want["history"].items():
    np.testing.assert_allclose(got["history"][key], values, rtol=RTOL,
                               atol=ATOL, err_msg=key)
  np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=RTOL,
                             atol=ATOL)
  test.assertEqual(got["predict"].shape, (EVAL_ROWS, 3))
  np.testing.assert_allclose(got["predict"], want["predict"], rtol=RTOL,
                             atol=ATOL)
  test.assertEqual(len(got["weights"]), len(want["weights"]))
  for g, w in zip(got["weights"], want["weights"]):
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


class ModelParityTest(unittest.TestCase):

  @parameterized.expand([(f"{m}_{n}_replicas", m, n) for m in MODELS
                         for n in topology.REPLICA_COUNTS
                         if m not in SAME_MODEL or n == 4])
  def test_fit_evaluate_predict_and_weights(self, _, model_name, n):
    got = train_and_measure(model_name, topology.strategy_over(n))
    assert_same_results(self, got,
                        one_device(SAME_MODEL.get(model_name, model_name)))


def fit_dataset(model, x, y):
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
  return model.fit(dataset, epochs=2, verbose=0)


def fit_infinite_dataset(model, x, y):
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
      GLOBAL_BATCH).repeat()
  return model.fit(dataset, epochs=2, steps_per_epoch=TRAIN_ROWS // GLOBAL_BATCH,
                   verbose=0)


def fit_generator(model, x, y):
  def batches():
    while True:
      for i in range(0, TRAIN_ROWS, GLOBAL_BATCH):
        yield x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]
  return model.fit(batches(), epochs=2, steps_per_epoch=TRAIN_ROWS // GLOBAL_BATCH,
                   verbose=0)


class Batches(keras.utils.PyDataset):

  def __init__(self, x, y):
    super().__init__()
    self.x, self.y = x, y

  def __len__(self):
    return -(-len(self.x) // GLOBAL_BATCH)  # The partial batch too.

  def __getitem__(self, i):
    rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
    return self.x[rows], self.y[rows]


def fit_py_dataset(model, x, y):
  # Shuffled: the same seed gives one device and the replicas the same orders
  # (Keras's own pre-build under a strategy would draw one more shuffle).
  return model.fit(Batches(x, y), epochs=2, shuffle=True, verbose=0)


def fit_distributed_dataset(model, x, y):
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
  return model.fit(model.distribute_strategy.experimental_distribute_dataset(
      dataset), epochs=2, verbose=0)


def fit_with_validation(model, x, y):
  xv, yv = make_data("mlp", EVAL_ROWS, seed=2)
  return model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                   validation_data=(xv, yv), verbose=0)


def fit_validation_split(model, x, y):
  return model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                   validation_split=0.25, verbose=0)


def fit_steps_per_execution(model, x, y):
  with model.distribute_strategy.scope():
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=3)
  return fit_numpy(model, x, y)


INPUTS = {
    "dataset": fit_dataset,
    "infinite_dataset": fit_infinite_dataset,
    "generator": fit_generator,
    "py_dataset": fit_py_dataset,
    "validation_data": fit_with_validation,
    "validation_split": fit_validation_split,
    "steps_per_execution": fit_steps_per_execution,
}
FITS = {"numpy": fit_numpy, "distributed_dataset": fit_distributed_dataset,
        **INPUTS}


def sparse(x):
  """`x` as a tf.SparseTensor holding its larger half of the values."""
  return tf.sparse.from_dense(np.where(np.abs(x) > 0.7, x, 0.0))


ENCODINGS = {"dense": lambda x: x, "sparse": sparse}


def _outcome(call):
  try:
    result = call()
  except Exception as e:  # pylint: disable=broad-except
    return "raises", type(e)
  return "returns", tf.nest.map_structure(np.shape, result)


def zero_row_outcomes(strategy):
  """What fit, evaluate and predict on no rows return, or raise."""
  model = build("mlp", strategy)
  x, y = make_data("mlp", 0, seed=0)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
  return [
      _outcome(lambda: model.fit(x, y, batch_size=GLOBAL_BATCH,
                                 verbose=0).history),
      _outcome(lambda: model.evaluate(x, y, batch_size=GLOBAL_BATCH,
                                      verbose=0)),
      _outcome(lambda: model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)),
      _outcome(lambda: model.fit(dataset, verbose=0).history),
      _outcome(lambda: model.evaluate(dataset, verbose=0)),
  ]


@functools.cache
def one_device_zero_rows():
  return zero_row_outcomes(tf.distribute.get_strategy())


class InputParityTest(unittest.TestCase):

  @classmethod
  def tearDownClass(cls):
    # Frees the distributed generator runs' iterators, left in reference
    # cycles, while Python still runs. Freeing one has taken minutes; at
    # interpreter exit it never ended (its from_generator thread waits for
    # the GIL), so the test process hung after its last test.
    gc.collect()
    super().tearDownClass()

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  @pytest.mark.slow
  def test_sparse_x(self, _, n):
    got = train_and_measure("mlp", topology.strategy_over(n),
                            encoding="sparse")
    assert_same_results(self, got, one_device("mlp", encoding="sparse"))

  @parameterized.expand([(f"{name}_{n}_replicas", name, n)
                         for name in INPUTS for n in topology.REPLICA_COUNTS])
  def test_every_input_kind(self, _, input_name, n):
    got = train_and_measure("mlp", topology.strategy_over(n), input_name)
    assert_same_results(self, got, one_device("mlp", input_name))

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  @pytest.mark.slow
  def test_zero_rows_do_what_they_do_without_a_strategy(self, _, n):
    want = one_device_zero_rows()
    # Without a strategy, fit and evaluate do nothing and return empty logs.
    self.assertEqual(want[0], ("returns", {}))
    self.assertEqual(want[1], ("returns", []))
    self.assertEqual(zero_row_outcomes(topology.strategy_over(n)), want)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_distributed_dataset_from_the_strategy(self, _, n):
    got = train_and_measure("mlp", topology.strategy_over(n),
                            "distributed_dataset")
    assert_same_results(self, got, one_device("mlp", "dataset"))


if __name__ == "__main__":
  unittest.main()
