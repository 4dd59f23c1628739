"""A script written the JAX way trains on TensorFlow as on one device.

`keras.distribution.set_distribution(...)`, then build, compile, `fit`,
`evaluate`, `predict` with no `strategy.scope()`: with `DataParallel` over the
4 logical CPUs, and with `ModelParallel` and a Megatron layout map
(column-parallel `up`, row-parallel `down`) on a 2 x 2 mesh, whose named
kernels are split (each device holds its share of their bytes); and a custom
loop through `tf.distribute.get_strategy().run`. Each equals one device:
same data, same global batch, same starting weights.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

import models
import replicator_strategy as rs
from replicator_strategy.model_parallel import split_variables

ROWS, BATCH, FEATURES, HIDDEN, OUT = 32, 8, 8, 16, 4


def data(out=OUT):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
          rng.normal(size=(ROWS, out)).astype(np.float32))


def megatron_mlp():
  return keras.Sequential([
      keras.Input((FEATURES,)),
      keras.layers.Dense(HIDDEN, activation="relu", name="up"),
      keras.layers.Dense(OUT, name="down"),
  ])


def megatron_distribution():
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")  # Column-parallel.
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", None)  # Row-parallel.
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name="batch")


def fit_evaluate_predict(model, weights, x, y):
  """`model` from `weights`, trained 2 epochs; what it reports."""
  model.set_weights(weights)
  model.compile(keras.optimizers.Adam(0.01), "mse")
  history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                      verbose=0)
  return {"loss": history.history["loss"],
          "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
          "predict": model.predict(x, batch_size=BATCH, verbose=0),
          "weights": model.get_weights()}


def custom_loop(model, weights, steps=3):
  """`model` from `weights` after `steps` of SGD in a loop of `strategy.run`
  under TF's default strategy: the distribution's, if one is set."""
  x, y = data()
  model.set_weights(weights)
  strategy = tf.distribute.get_strategy()
  optimizer = keras.optimizers.SGD(0.1)
  optimizer.build(model.trainable_variables)
  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(ROWS))))

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((model(x) - y) ** 2) / ROWS
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def step(batch):
    strategy.run(replica_step, batch)

  for _ in range(steps):
    step(batch)
  return model.get_weights(), strategy.num_replicas_in_sync


class JaxStyleScriptTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rs.use_for_keras_distribution()

  def tearDown(self):
    keras.distribution.set_distribution(None)
    self.assertFalse(tf.distribute.has_strategy())
    super().tearDown()

  def assert_same(self, got, want):
    for name in ("loss", "evaluate"):
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                 err_msg=name)
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5,
                               atol=1e-6)
    for have, expected in zip(got["weights"], want["weights"]):
      np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6)

  def test_data_parallel_fit_evaluate_predict_equal_one_device(self):
    x, y = data(out=3)  # models.small_mlp: 8 features in, 3 out.
    want = fit_evaluate_predict(models.small_mlp(), models.initial_weights(),
                                x, y)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = models.small_mlp()
    self.assertEqual(model.distribute_strategy.num_replicas_in_sync, 4)
    self.assert_same(
        fit_evaluate_predict(model, models.initial_weights(), x, y), want)

  def test_model_parallel_splits_the_named_kernels_and_equals_one_device(self):
    keras.utils.set_random_seed(3)
    weights = megatron_mlp().get_weights()
    want = fit_evaluate_predict(megatron_mlp(), weights, *data())
    keras.distribution.set_distribution(megatron_distribution())
    model = megatron_mlp()
    self.assert_same(fit_evaluate_predict(model, weights, *data()), want)
    strategy = model.distribute_strategy
    split = {w.path: w.value for w in model.weights
             if isinstance(w.value, split_variables.SplitVariable)}
    self.assertEqual(sorted(p.split("/", 1)[1] for p in split),
                     ["down/kernel", "up/bias", "up/kernel"])
    k = strategy.mesh.size("model")
    self.assertGreater(k, 1)
    for path, variable in split.items():
      whole = int(np.prod(variable.shape)) * variable.dtype.size
      held = {}
      for part in variable.values:
        held[part.device] = held.get(part.device, 0) + (
            int(np.prod(part.shape)) * part.dtype.size)
      self.assertEqual(sorted(held), sorted(strategy.mesh.devices), path)
      self.assertEqual(set(held.values()), {whole // k}, path)

  def test_a_custom_loop_under_a_set_distribution_equals_one_device(self):
    keras.utils.set_random_seed(5)
    weights = megatron_mlp().get_weights()
    want, _ = custom_loop(megatron_mlp(), weights)
    for distribution, replicas in ((keras.distribution.DataParallel(), 4),
                                   (megatron_distribution(), 2)):
      keras.distribution.set_distribution(distribution)
      with self.subTest(type(distribution).__name__):
        got, replicas_run = custom_loop(megatron_mlp(), weights)
        self.assertEqual(replicas_run, replicas)
        for have, expected in zip(got, want):
          np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  unittest.main()
