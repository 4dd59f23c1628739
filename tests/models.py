"""The small model the training tests share, and its seeded starting weights."""

import functools

import keras


def small_mlp(activation="tanh"):
  """8 features -> Dense(16, activation) -> 3 outputs."""
  return keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(16, activation=activation),
      keras.layers.Dense(3),
  ])


@functools.cache
def initial_weights(activation="tanh"):
  """Seeded weights for `small_mlp`, so every run starts from the same ones."""
  keras.utils.set_random_seed(0)
  return tuple(small_mlp(activation).get_weights())
