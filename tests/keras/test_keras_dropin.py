"""Existing Keras programs, unchanged, under ReplicatorStrategy: as on one device.

Each case is a program a user already has (a Keras guide's, or a common
pattern) run with no strategy and under the strategy on 1, 2 and 4 replicas,
from the same weights on the same data. Each run with no strategy is made once
and shared by the replica counts compared with it.
"""

import contextlib
import functools
import unittest
import warnings

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import topology
from replicator_strategy import _tf_internal as tfi

RTOL, ATOL = 1e-5, 1e-6
LATENT = 4


class GAN(keras.Model):
  """The Keras guide's GAN ("Customizing what happens in fit"): no call().

  Its latent vectors come from the batch instead of a random generator, so
  that one device and N replicas see the same ones.
  """

  def __init__(self, discriminator, generator):
    super().__init__()
    self.discriminator = discriminator
    self.generator = generator

  def compile(self, d_optimizer, g_optimizer, loss_fn):
    super().compile()
    self.d_optimizer = d_optimizer
    self.g_optimizer = g_optimizer
    self.loss_fn = loss_fn

  def train_step(self, real):
    batch = tf.shape(real)[0]
    latent = tf.reduce_mean(real, axis=1, keepdims=True) * tf.ones([1, LATENT])
    images = tf.concat([self.generator(latent), real], 0)
    labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
    with tf.GradientTape() as tape:
      d_loss = self.loss_fn(labels, self.discriminator(images))
    grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
    self.d_optimizer.apply_gradients(
        zip(grads, self.discriminator.trainable_weights))
    with tf.GradientTape() as tape:
      g_loss = self.loss_fn(tf.zeros((batch, 1)),
                            self.discriminator(self.generator(latent)))
    grads = tape.gradient(g_loss, self.generator.trainable_weights)
    self.g_optimizer.apply_gradients(
        zip(grads, self.generator.trainable_weights))
    return {"d_loss": d_loss, "g_loss": g_loss}


def gan_parts():
  discriminator = keras.Sequential([
      keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
      keras.layers.Dense(1)])
  generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(6)])
  return discriminator, generator


class NoCallModelTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    keras.utils.set_random_seed(0)
    cls.start = [part.get_weights() for part in gan_parts()]
    cls.data = np.random.default_rng(0).normal(size=(64, 6)).astype(
        np.float32)
    cls.want = cls.fit(None)

  @classmethod
  def fit(cls, strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
      parts = gan_parts()
      for part, weights in zip(parts, cls.start):
        part.set_weights(weights)
      gan = GAN(*parts)
      gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3),
                  keras.losses.BinaryCrossentropy(from_logits=True))
      history = gan.fit(cls.data, batch_size=16, epochs=2, shuffle=False,
                        verbose=0).history
    return [w.numpy() for w in gan.weights], history

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_the_guides_gan_trains_and_logs_as_on_one_device(self, _, n):
    got, history = self.fit(topology.strategy_over(n))
    want, want_history = self.want
    self.assertEqual(len(got), len(want))
    for g, w, start in zip(got, want,
                           [w for part in self.start for w in part]):
      self.assertGreater(np.abs(w - start).max(), 1e-4)  # it trained
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    # The losses its train_step returns, not divided by the replicas.
    for key in ("d_loss", "g_loss"):
      np.testing.assert_allclose(history[key], want_history[key], rtol=RTOL)


class CustomStepModel(keras.Model):
  """The Keras guide's custom train_step and test_step, with a loss tracker."""

  def __init__(self):
    super().__init__()
    self.hidden = keras.layers.Dense(16, activation="tanh")
    self.out = keras.layers.Dense(3)
    self.loss_tracker = keras.metrics.Mean(name="loss")

  def call(self, x):
    return self.out(self.hidden(x))

  @property
  def metrics(self):
    return [self.loss_tracker]

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred)
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
    self.loss_tracker.update_state(loss)
    return {"loss": self.loss_tracker.result()}

  def test_step(self, data):
    x, y = data
    self.loss_tracker.update_state(self.compute_loss(y=y, y_pred=self(x)))
    return {"loss": self.loss_tracker.result()}


def regression_data(rows):
  """`rows` examples of 8 features and 3 targets, always the same."""
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 8)).astype(np.float32),
          rng.normal(size=(rows, 3)).astype(np.float32))


class CustomStepTest(unittest.TestCase):
  """64 rows, batch 16: every replica gets as many rows."""

  @staticmethod
  def run_model(strategy):
    keras.utils.set_random_seed(0)
    x, y = regression_data(64)
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = CustomStepModel()
      model.build((None, 8))
      model.compile(keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
      history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                          verbose=0).history["loss"]
      evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
    return history, evaluated, model.get_weights()

  @classmethod
  @functools.cache
  def one_device(cls):
    return cls.run_model(None)

  @parameterized.expand(topology.NAMED_REPLICA_COUNTS)
  def test_the_guides_custom_steps_log_as_on_one_device(self, _, n):
    history, evaluated, weights = self.run_model(topology.strategy_over(n))
    want_history, want_evaluated, want_weights = self.one_device()
    np.testing.assert_allclose(history, want_history, rtol=RTOL)
    np.testing.assert_allclose(evaluated, want_evaluated, rtol=RTOL)
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


_LAYERS = {"dense": keras.layers.Flatten, "lstm": lambda: keras.layers.LSTM(8),
           "gru": lambda: keras.layers.GRU(8),
           "conv": lambda: keras.layers.Conv1D(4, 2)}


class FewerRowsThanReplicasTest(unittest.TestCase):
  """1 or 3 rows on 4 replicas: some replicas get none."""

  @classmethod
  @functools.cache
  def one_device(cls, kind, rows, train):
    return cls.run_model(kind, None, rows, train)

  @staticmethod
  def run_model(kind, strategy, rows, train):
    """Predictions, evaluation and weights; if `train`, again after `fit`."""
    keras.utils.set_random_seed(0)

    def build():
      return keras.Sequential([keras.Input((5, 3)), _LAYERS[kind](),
                               keras.layers.Flatten(), keras.layers.Dense(2)])

    def scope():
      return strategy.scope() if strategy else contextlib.nullcontext()

    def measured():
      return (model.predict(x, verbose=0), model.evaluate(x, y, verbose=0),
              model.get_weights())

    start = build().get_weights()
    x = np.random.default_rng(0).normal(size=(rows, 5, 3)).astype(np.float32)
    y = np.ones((rows, 2), np.float32)
    with scope():
      model = build()
      model.set_weights(start)
      model.compile("sgd", "mse", jit_compile=False)
    results = [measured()]
    if train:
      with scope():
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
      results.append(measured())
    return results

  # GRU steps as LSTM does: predicted only.
  @parameterized.expand([
      (f"{kind}_{rows}_rows_{n}_replicas", kind, rows, n, kind != "gru")
      for kind in _LAYERS for rows, n in ((1, 2), (3, 4))])
  def test_as_on_one_device(self, _, kind, rows, n, train):
    got = self.run_model(kind, topology.strategy_over(n), rows, train)
    want = self.one_device(kind, rows, train)
    self.assertEqual(len(got), len(want))
    for (predicted, evaluated, weights), (
        want_predicted, want_evaluated, want_weights) in zip(got, want):
      self.assertEqual(predicted.shape, (rows, 2))
      np.testing.assert_allclose(predicted, want_predicted, rtol=RTOL,
                                 atol=ATOL)
      np.testing.assert_allclose(evaluated, want_evaluated, rtol=RTOL,
                                 atol=ATOL)
      for g, w in zip(weights, want_weights):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


class ActivityLoss(keras.layers.Layer):
  """Adds a loss on its input's activations, as the Keras guide's layers do."""

  def call(self, h):
    self.add_loss(0.01 * tf.reduce_mean(tf.square(h)))
    return h


class WithModelLoss(keras.Model):
  """A subclassed model that adds a loss in its own call()."""

  def __init__(self):
    super().__init__()
    self.hidden = keras.layers.Dense(16, activation="tanh")
    self.out = keras.layers.Dense(3)

  def call(self, x):
    h = self.hidden(x)
    self.add_loss(0.01 * tf.reduce_mean(tf.square(h)))
    return self.out(h)


def layer_loss_model():
  return keras.Sequential([keras.Input((8,)),
                           keras.layers.Dense(16, activation="tanh"),
                           ActivityLoss(), keras.layers.Dense(3)])


def model_loss_model():
  model = WithModelLoss()
  model.build((None, 8))
  return model


class AddLossTest(unittest.TestCase):
  """58 rows, batch 16: the last batch splits unevenly on 4 replicas."""

  @classmethod
  @functools.cache
  def one_device(cls, build):
    return cls.fit(build, None)

  @staticmethod
  def fit(build, strategy, run_eagerly=False):
    keras.utils.set_random_seed(0)
    start = build().get_weights()
    x, y = regression_data(58)
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = build()
      model.set_weights(start)
      model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False,
                    run_eagerly=run_eagerly)
      losses = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                         verbose=0).history["loss"]
    return losses, model.get_weights()

  @parameterized.expand(
      [(f"{where}_{n}_replicas", build, n, False)
       for where, build in (("in_a_layer", layer_loss_model),
                            ("in_a_subclassed_model", model_loss_model))
       for n in topology.REPLICA_COUNTS] +
      [("in_a_layer_4_replicas_run_eagerly", layer_loss_model, 4, True)])
  def test_add_loss_trains_as_on_one_device(self, _, build, n, run_eagerly):
    losses, weights = self.fit(build, topology.strategy_over(n), run_eagerly)
    want_losses, want_weights = self.one_device(build)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class ExtraTermLoss(CustomStepModel):
  """A `compute_loss` override adding terms to Keras's loss (keras.io style):
  one on the replica's predictions, one on a weight, shared by every replica.
  """

  train_step = keras.Model.train_step
  test_step = keras.Model.test_step

  @property
  def metrics(self):
    return keras.Model.metrics.fget(self)

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                   training=True):
    loss = super().compute_loss(x, y, y_pred, sample_weight, training)
    return (loss + 0.5 * keras.ops.mean(keras.ops.square(y_pred)) +
            0.1 * keras.ops.sum(keras.ops.square(self.out.kernel)))


class OwnLoss(ExtraTermLoss):
  """A `compute_loss` that computes the whole loss itself (Keras's docstring's
  example): a mean over the replica's rows and the `add_loss` terms."""

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                   training=True):
    return (keras.ops.mean(keras.ops.square(y_pred - y)) +
            keras.ops.sum(self.losses))

  def call(self, x):
    h = self.hidden(x)
    self.add_loss(0.01 * keras.ops.mean(keras.ops.square(h)))
    return self.out(h)


class StepCallingOverride(ExtraTermLoss):
  """The Keras guide's custom train_step, calling an override of compute_loss."""

  train_step = CustomStepModel.train_step
  test_step = CustomStepModel.test_step
  metrics = CustomStepModel.metrics


class ComputeLossOverrideTest(unittest.TestCase):
  """The loss an override of compute_loss returns trains as one device's."""

  @staticmethod
  def run_model(model_class, strategy, train):
    keras.utils.set_random_seed(0)
    x, y = regression_data(58)
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = model_class()
      model.build((None, 8))
      model.compile(keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
      logged = train(model, x, y)
    return logged, model.get_weights()

  @staticmethod
  def train_on_batch(model, x, y):
    return model.train_on_batch(x[:16], y[:16])

  @staticmethod
  def fit(model, x, y):  # The last batch splits unevenly on 4 replicas.
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history["loss"]

  @classmethod
  @functools.cache
  def one_device(cls, model_class, train):
    return cls.run_model(model_class, None, getattr(cls, train))

  @parameterized.expand([
      (f"{model_class.__name__}_{train}_{n}_replicas", model_class, train, n)
      for model_class in (ExtraTermLoss, OwnLoss)
      for train in ("train_on_batch", "fit") for n in (2, 4)])
  def test_as_on_one_device(self, _, model_class, train, n):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      logged, weights = self.run_model(
          model_class, topology.strategy_over(n), getattr(self, train))
    # Keras's own steps: scaled as a whole, nothing to warn of.
    self.assertFalse([w for w in caught if "compute_loss" in str(w.message)])
    want_logged, want_weights = self.one_device(model_class, train)
    np.testing.assert_allclose(logged, want_logged, rtol=RTOL, atol=ATOL)
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  def test_a_custom_step_calling_an_override_warns_once(self):
    strategy = topology.strategy_over(2)
    with self.assertWarnsRegex(
        UserWarning, r"StepCallingOverride\.compute_loss calls "
        r"super\(\)\.compute_loss\(\) from a step of its own.* 2 times as "
        r"strongly") as caught:
      self.run_model(StepCallingOverride, strategy, self.fit)
    self.assertEqual(
        sum("compute_loss" in str(w.message) for w in caught.warnings), 1)


def synchronized_conv_net():
  # No bias before batch norm: its gradient is zero up to rounding, which
  # Adam would scale up to whole steps.
  return keras.Sequential([
      keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, use_bias=False),
      keras.layers.BatchNormalization(synchronized=True),
      keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(3)])


def image_data(rows):
  """`rows` 6x6 images of 2 channels and 3 targets, always the same."""
  rng = np.random.default_rng(1)
  return (rng.normal(size=(rows, 6, 6, 2)).astype(np.float32),
          rng.normal(size=(rows, 3)).astype(np.float32))


# name: (model, its data).
_JIT_MODELS = {
    "mlp": (layer_loss_model, lambda: regression_data(58)),
    "conv_net_synchronized_batch_norm": (synchronized_conv_net,
                                         lambda: image_data(48)),
}


@pytest.mark.slow
class JitCompileTest(unittest.TestCase):
  """`jit_compile=True`: every replica's steps compiled with XLA on its own
  device, results as one device's XLA-compiled run."""

  @classmethod
  @functools.cache
  def one_device(cls, model_name):
    results, _ = cls.fit(model_name, None)
    return results

  @staticmethod
  def fit(model_name, strategy):
    """Fit, evaluate and predict: their results, and the XLA launches of all
    three (TF's run metadata can keep launches made outside a count for the
    next one: none is left out)."""
    build, data = _JIT_MODELS[model_name]
    keras.utils.set_random_seed(0)
    x, y = data()
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = build()
      model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)

      def program():
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                            verbose=0).history["loss"]
        return (history, model.evaluate(x, y, verbose=0),
                model.predict(x, verbose=0), model.get_weights())

      return tfi.xla_launches_by_device(program)

  @parameterized.expand(
      [(f"mlp_{n}_replicas", "mlp", n) for n in topology.REPLICA_COUNTS] +
      [(f"conv_net_synchronized_batch_norm_{n}_replicas",
        "conv_net_synchronized_batch_norm", n) for n in (2, 4)])
  def test_each_replica_runs_compiled_as_one_device(self, _, model_name, n):
    strategy = topology.strategy_over(n)
    got, launches = self.fit(model_name, strategy)
    want = self.one_device(model_name)
    for g, w in zip(got[:3], want[:3]):
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    for g, w in zip(got[3], want[3]):
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    replica_devices = {tf.DeviceSpec.from_string(d).to_string()
                       for d in strategy.extended.worker_devices}
    self.assertEqual(set(launches), replica_devices)

  def test_auto_means_xla_on_accelerators_only(self):
    with topology.strategy_over(2).scope():
      model = layer_loss_model()
      model.compile("sgd", "mse", jit_compile="auto")
    accelerated = any(device.device_type != "CPU"
                      for device in tf.config.list_physical_devices())
    self.assertEqual(model.jit_compile, accelerated)


class BuiltOutsideScopeTest(unittest.TestCase):

  @parameterized.expand([("compiled_outside", False), ("compiled_inside", True)])
  def test_fit_says_to_build_under_the_scope_and_trains_nothing(
      self, _, compile_inside):
    strategy = topology.strategy_over(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    before = model.get_weights()
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    if not compile_inside:
      model.compile("sgd", "mse")
    with strategy.scope():
      if compile_inside:
        model.compile("sgd", "mse")
      with self.assertRaisesRegex(
          ValueError, r"created outside `strategy.scope\(\)`.*Create the "
          r"model and its optimizer inside the scope"):
        model.fit(x, y, verbose=0)
    for got, want in zip(model.get_weights(), before):
      np.testing.assert_array_equal(got, want)

  def test_a_custom_loop_says_so_too(self):
    strategy = topology.strategy_over(2)
    weight = tf.Variable(1.0)
    with strategy.scope():
      optimizer = keras.optimizers.SGD()

    @tf.function
    def step():
      return strategy.run(lambda: optimizer.apply_gradients([(1.0, weight)]))

    with self.assertRaisesRegex(ValueError, "outside `strategy.scope"):
      step()
    self.assertEqual(float(weight.numpy()), 1.0)


if __name__ == "__main__":
  unittest.main()
