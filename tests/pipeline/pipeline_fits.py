"""A model fitted with and without a pipeline, compared: the pipeline tests' reference.

`fit` trains a model from fixed initial weights on fixed batches, under a
strategy or on one device; `assert_trains_as_one_device` fits it under a
strategy and compares the weights, the loss and the metrics with one
device's run of the same case (model, batches, optimizer), which is run once
for all the tests of a process.
"""

import contextlib

import keras
import numpy as np

ROWS, BATCH = 48, 16
RTOL, ATOL = 1e-5, 1e-6


def mlp(layer=keras.layers.Dense, widths=(16, 16, 16, 3)):
  """A Sequential stack of tanh Dense layers "dense_0", "dense_1", ..."""
  return keras.Sequential([keras.Input((8,))] + [
      layer(width, activation="tanh", name=f"dense_{i}")
      for i, width in enumerate(widths)])


# Megatron's rules for megatron_mlp: each "up" column-parallel, each "down"
# row-parallel.
MEGATRON_RULES = {".*up_.*/kernel": (None, "model"), ".*up_.*/bias": ("model",),
                  ".*down_.*/kernel": ("model", None)}


def megatron_mlp(regularizer=None):
  """Two Megatron pairs (up column-parallel, down row-parallel), a head;
  `regularizer` on each split weight (up's kernel and bias, down's kernel)."""
  layers = [keras.Input((8,))]
  for i in range(2):
    layers += [keras.layers.Dense(16, activation="tanh", name=f"up_{i}",
                                  kernel_regularizer=regularizer,
                                  bias_regularizer=regularizer),
               keras.layers.Dense(8, activation="tanh", name=f"down_{i}",
                                  kernel_regularizer=regularizer)]
  return keras.Sequential(layers + [keras.layers.Dense(3, name="head")])


def layout_map(mesh, rules=None):
  """A LayoutMap over `mesh` with `rules` (pattern -> axes), Megatron's
  rules for megatron_mlp unless given."""
  layouts = keras.distribution.LayoutMap(mesh)
  for pattern, axes in (rules or MEGATRON_RULES).items():
    layouts[pattern] = axes
  return layouts


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, 8)).astype(np.float32),
          rng.normal(size=(ROWS, 3)).astype(np.float32))


def initial_weights(build=mlp):
  keras.utils.set_random_seed(0)
  return build().get_weights()


def fit(build=mlp, strategy=None, *, batches=data,
        optimizer=keras.optimizers.Adam, learning_rate=0.01,
        metrics=("mae",), built_first=False):
  """(model, history) after an epoch of `batches()` from `build`'s seeded
  initial weights; `built_first`: with the optimizer built before `fit`
  (a pipeline's stages then move its slots)."""
  weights = initial_weights(build)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = build()
    model.set_weights(weights)
    model.compile(optimizer(learning_rate), "mse", metrics=list(metrics))
    if built_first:
      model.optimizer.build(model.trainable_variables)
  history = model.fit(*batches(), batch_size=BATCH, shuffle=False, verbose=0)
  return model, history.history


_ONE_DEVICE = {}  # fit's arguments -> one device's (weights, history).


def one_device(**case):
  """(weights, history) of `fit(**case)` with no strategy, run once a case."""
  key = tuple(sorted(case.items()))
  if key not in _ONE_DEVICE:
    model, history = fit(**case)
    _ONE_DEVICE[key] = model.get_weights(), history
  return _ONE_DEVICE[key]


def assert_equal_weights(got, want):
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def assert_trains_as_one_device(strategy, **case):
  """`fit(**case)` under `strategy` ends with one device's weights, loss and
  metrics (rtol 1e-5); returns the model."""
  weights, history = one_device(**case)
  model, got = fit(strategy=strategy, **case)
  assert_equal_weights(model.get_weights(), weights)
  for name, values in history.items():
    np.testing.assert_allclose(got[name], values, rtol=RTOL, err_msg=name)
  return model


def held_bytes(model):
  """Device ("CPU:0", ...) -> bytes of `model`'s weights (split or not) it
  holds."""
  held = {}
  for weight in model.weights:
    for component in getattr(weight.value, "values", [weight.value]):
      device = component.device[-5:]
      held[device] = held.get(device, 0) + (
          np.prod(component.shape) * component.dtype.size)
  return held
