"""Keras `model.fit` on 1, 2, 4 replicas matches `fit` without a strategy.

Every Keras 3 optimizer feature that talks to the strategy is covered: the
plain update (`extended.update` after a SUM all-reduce), weight decay,
gradient clipping, EMA with periodic overwrite and gradient accumulation (both
update inside a `tf.cond`, where replicas can't `merge_call`: each updates its
own copy, and accumulation all-reduces with run-time collectives), and the
loss-scale optimizer under mixed precision. Each runs traced, with
`steps_per_execution` 1 and 3 (3 puts the step in a `tf.while_loop`, and 4
steps an epoch leave a partial execution). The reference is the same `fit`
without a strategy and one step per execution, from the same weights on the
same data and global batch.
"""

import contextlib
import functools
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest

from assertions import assert_per_replica
import models
import topology

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 4
EPOCHS = 2
RTOL, ATOL = 1e-5, 1e-6
# Mixed precision: each replica sums its gradients over 16/n examples in
# float16 (relative precision ~1e-3) before the float32 all-reduce adds the
# partial sums, so they round differently from the one-device sums over all 16
# examples. Adam moves a weight by about its learning rate (0.01) whatever the
# gradient's size, so the weights differ by ~1e-5 absolute (up to 4e-5), which
# is large relative to weights near zero: hence the atol too.
FLOAT16_RTOL, FLOAT16_ATOL = 1e-3, 1e-4

# name: (optimizer factory, dtype policy).
_OPTIMIZERS = {
    "sgd": (lambda: keras.optimizers.SGD(learning_rate=0.1), "float32"),
    "momentum": (lambda: keras.optimizers.SGD(learning_rate=0.1,
                                              momentum=0.9), "float32"),
    "adam": (lambda: keras.optimizers.Adam(learning_rate=0.01), "float32"),
    "adamw": (lambda: keras.optimizers.AdamW(learning_rate=0.01,
                                             weight_decay=0.1), "float32"),
    # The thresholds are below the gradient norms (1 to 2 per weight, 2.8 in
    # all), so clipping changes every step.
    "adam_clipnorm": (lambda: keras.optimizers.Adam(learning_rate=0.01,
                                                    clipnorm=0.5), "float32"),
    "adam_global_clipnorm": (lambda: keras.optimizers.Adam(
        learning_rate=0.01, global_clipnorm=1.0), "float32"),
    # Weight decay merges the replicas between clipping's all-reduce and the
    # update, whose all-reduce each replica must still skip.
    "adamw_clipnorm": (lambda: keras.optimizers.AdamW(
        learning_rate=0.01, weight_decay=0.1, clipnorm=0.5), "float32"),
    "adam_ema": (lambda: keras.optimizers.Adam(
        learning_rate=0.01, use_ema=True, ema_overwrite_frequency=2),
                 "float32"),
    "sgd_accumulate": (lambda: keras.optimizers.SGD(
        learning_rate=0.1, gradient_accumulation_steps=2), "float32"),
    "adam_accumulate": (lambda: keras.optimizers.Adam(
        learning_rate=0.01, gradient_accumulation_steps=2), "float32"),
    "loss_scale_adam": (lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate=0.01)), "mixed_float16"),
}
# Every optimizer on 1, 2 and 4 replicas, with 1 and 3 steps per execution.
# These run with the slow tests, a quick case taking the same path: SGD,
# momentum and Adam at 3 steps (a tf.while_loop: adamw's and every other
# 3-step case), adam_clipnorm at 3 (adamw_clipnorm's), sgd_accumulate at 1
# (adam_accumulate's).
_SLOW = {("sgd", 3), ("momentum", 3), ("adam", 3), ("adam_clipnorm", 3),
         ("sgd_accumulate", 1)}
_CASES = [(f"{n}_replicas_{name}_spe{spe}", n, name, spe)
          for n in (1, 2, 4) for name in _OPTIMIZERS for spe in (1, 3)
          if (name, spe) not in _SLOW]
_SLOW_CASES = [(f"{n}_replicas_{name}_spe{spe}", n, name, spe)
               for n in (1, 2, 4) for name, spe in sorted(_SLOW)]


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(GLOBAL_BATCH * STEPS_PER_EPOCH, 8)).astype(np.float32)
  y = rng.normal(size=(GLOBAL_BATCH * STEPS_PER_EPOCH, 3)).astype(np.float32)
  return x, y


@contextlib.contextmanager
def dtype_policy(name):
  """Sets Keras's global dtype policy, restoring the previous one after."""
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(name)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def train(optimizer_name, steps_per_execution, strategy=None):
  """Fits a fresh model from the shared initial weights.

  Returns the model, its optimizer and the per-epoch losses. The model is
  built under `strategy.scope()` if a strategy is given.
  """
  make_optimizer, policy = _OPTIMIZERS[optimizer_name]
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with dtype_policy(policy), scope:
    keras.utils.set_random_seed(0)
    model = models.small_mlp("relu")
    model.set_weights(models.initial_weights("relu"))
    optimizer = make_optimizer()
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=False,
                  jit_compile=False, steps_per_execution=steps_per_execution)
    history = model.fit(*data(), batch_size=GLOBAL_BATCH, epochs=EPOCHS,
                        shuffle=False, verbose=0)
  return model, optimizer, history.history["loss"]


@functools.cache
def reference_run(optimizer_name):
  """Losses, final weights and optimizer state of `fit` with no strategy."""
  model, optimizer, losses = train(optimizer_name, steps_per_execution=1)
  return (losses, [w.numpy() for w in model.weights],
          int(optimizer.iterations.numpy()),
          [v.numpy() for v in optimizer.variables])


class KerasOptimizersTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_fit_matches_no_strategy(self, _, n, optimizer_name,
                                   steps_per_execution):
    self.check_fit_matches_no_strategy(n, optimizer_name, steps_per_execution)

  @parameterized.expand(_SLOW_CASES)
  @pytest.mark.slow
  def test_variants_fit_as_no_strategy(
      self, _, n, optimizer_name, steps_per_execution):
    self.check_fit_matches_no_strategy(n, optimizer_name, steps_per_execution)

  def check_fit_matches_no_strategy(self, n, optimizer_name,
                                    steps_per_execution):
    strategy = topology.strategy_over(n)
    model, optimizer, losses = train(optimizer_name, steps_per_execution,
                                     strategy)

    want_losses, want_weights, want_iterations, want_optimizer = (
        reference_run(optimizer_name))
    rtol, atol = ((FLOAT16_RTOL, FLOAT16_ATOL)
                  if _OPTIMIZERS[optimizer_name][1] == "mixed_float16"
                  else (RTOL, ATOL))
    np.testing.assert_allclose(losses, want_losses, rtol=rtol, atol=atol,
                               err_msg="per-epoch loss history")
    self.assertEqual(int(optimizer.iterations.numpy()), want_iterations)
    start_weights = models.initial_weights("relu")
    for v, want, start in zip(model.weights, want_weights, start_weights):
      self.assertGreater(np.abs(want - start).max(), 1e-3)  # it trained
      assert_per_replica(self, strategy, v.value, [want] * n, rtol=rtol,
                         atol=atol, what=v.path)
    # Moments, EMA averages, loss scale; the gradient accumulators are back
    # at zero after an even number of steps. (Paths differ in the optimizer's
    # uniquified name; the order is the same.)
    self.assertEqual(len(optimizer.variables), len(want_optimizer))
    for v, want in zip(optimizer.variables, want_optimizer):
      np.testing.assert_allclose(v.numpy(), want, rtol=rtol, atol=atol,
                                 err_msg=v.path)


SEQ, VOCAB, WIDTH = 6, 11, 8


class TokenAndPosition(keras.layers.Layer):
  """keras.io's GPT input: token and position embeddings, the positions an
  `arange` with no batch axis (one device's gradient: a slice per row)."""

  def __init__(self, positions=True):
    super().__init__()
    self.tokens = keras.layers.Embedding(VOCAB, WIDTH)
    self.positions = keras.layers.Embedding(SEQ, WIDTH) if positions else None

  def call(self, x):
    tokens = self.tokens(x)
    if self.positions is None:
      return tokens
    return tokens + self.positions(keras.ops.arange(keras.ops.shape(x)[-1]))


class Block(keras.layers.Layer):
  """keras.io's GPT block, without dropout or attention biases."""

  def __init__(self):
    super().__init__()
    # No biases: the key's has a gradient of zero up to rounding (softmax
    # ignores a shift), which Adam would scale up to whole steps.
    self.attention = keras.layers.MultiHeadAttention(2, WIDTH // 2,
                                                     use_bias=False)
    self.feed_forward = keras.Sequential([
        keras.layers.Dense(2 * WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH)])
    self.norms = [keras.layers.LayerNormalization(epsilon=1e-6)
                  for _ in range(2)]

  def call(self, x):
    x = self.norms[0](x + self.attention(x, x, use_causal_mask=True))
    return self.norms[1](x + self.feed_forward(x))


def gpt(positions=True):
  return keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                           TokenAndPosition(positions), Block(), Block(),
                           keras.layers.Dense(VOCAB)])


def fit_gpt(make_optimizer, strategy, positions=True):
  """Per-epoch losses and weights of keras.io's GPT after 2 epochs of 2 steps
  of batch 16 (each token many times in a batch: the token table's rows
  repeat)."""
  keras.utils.set_random_seed(0)
  start = gpt(positions).get_weights()
  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, size=(32, SEQ)).astype(np.int32)
  y = np.roll(x, -1, axis=1)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = gpt(positions)
    model.set_weights(start)
    model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    losses = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                       verbose=0).history["loss"]
  return losses, model.get_weights()


_GPT_OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(1e-3),
                   "adamw": lambda: keras.optimizers.AdamW(1e-3)}


class SparseGradientTest(unittest.TestCase):
  """Embeddings' sparse gradients reach the optimizer as one device's."""

  @staticmethod
  @functools.cache
  def one_device(name, positions=True):
    return fit_gpt(_GPT_OPTIMIZERS[name], None, positions)

  @parameterized.expand([(f"{name}_{n}_replicas", name, n)
                         for name, n in (("adam", 2), ("adam", 4),
                                         ("adamw", 4))])
  @pytest.mark.slow
  def test_keras_io_gpt_trains_as_on_one_device(self, _, name, n):
    losses, weights = fit_gpt(_GPT_OPTIMIZERS[name],
                              topology.strategy_over(n))
    want_losses, want_weights = self.one_device(name)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  def test_token_rows_stay_a_slice_per_occurrence(self):
    # Without positions: every replica looks up its own rows, whose slices
    # the all-reduce concatenates, each occurrence squared apart by Adam.
    losses, weights = fit_gpt(_GPT_OPTIMIZERS["adam"],
                              topology.strategy_over(2), positions=False)
    want_losses, want_weights = self.one_device("adam", positions=False)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(weights, want_weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


if __name__ == "__main__":
  unittest.main()
