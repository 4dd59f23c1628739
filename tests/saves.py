"""The three ways a Keras run is saved and resumed, for resume tests.

Each `save_*(model, directory)` saves `model` and returns `load(fresh)`,
which loads what was saved into a fresh model of the same shape.
"""

import os

import tensorflow as tf


def save_weights(model, directory):
  path = os.path.join(directory, "w.weights.h5")
  model.save_weights(path)
  return lambda fresh: fresh.load_weights(path)


def save_keras(model, directory):
  path = os.path.join(directory, "m.keras")
  model.save(path)
  return lambda fresh: fresh.load_weights(path)  # A .keras file's weights.


def save_checkpoint(model, directory):
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
      os.path.join(directory, "ckpt"))
  return lambda fresh: tf.train.Checkpoint(
      model=fresh, optimizer=fresh.optimizer).restore(path).assert_consumed()


FORMATS = {"weights_h5": save_weights, "keras": save_keras,
           "checkpoint": save_checkpoint}
