"""What both digits examples share: command line, devices, data and model.

The data is scikit-learn's `load_digits()`: 1797 8x8 grey images of the
digits 0-9 that ship inside the package, so nothing is downloaded.

Importing this module loads nothing heavy, so a script can read its command
line (and answer `--help`) before TensorFlow starts; TensorFlow, Keras and
scikit-learn come with the functions that use them.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import replicator_strategy  # (TF's log level: quiet unless set)

# Without a GPU, the CPU is split into this many logical devices, one replica
# each, unless --replicas says otherwise: the multi-replica path runs anywhere.
CPU_REPLICAS = 4


def parse_args(description, epochs, add_arguments=None):
  """The shared command line; `add_arguments(parser)` adds a script's own."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument(
      "--replicas", type=int, default=CPU_REPLICAS,
      help="logical CPU devices to split the CPU into when there is no GPU "
      f"(default: {CPU_REPLICAS}); on GPU machines every GPU is used instead")
  parser.add_argument(
      "--epochs", type=int, default=epochs,
      help=f"passes over the training set (default: {epochs})")
  parser.add_argument(
      "--global-batch-size", type=int, default=64,
      help="examples per step, summed over all replicas (default: 64)")
  if add_arguments is not None:
    add_arguments(parser)
  return parser.parse_args()


def set_up_devices(num_replicas):
  """Splits the CPU when there is no GPU; must run before TF makes devices.

  The package imports TensorFlow here, first, which keeps its start-up log
  lines out (TF_CPP_MIN_LOG_LEVEL is 2 unless set).
  """
  tf = replicator_strategy.check_tensorflow()
  if not tf.config.list_physical_devices("GPU"):
    replicator_strategy.split_cpu(num_replicas)


def load_data():
  """Returns `(x_train, x_test, y_train, y_test)`: 80% train, 20% test."""
  # pylint: disable=g-import-not-at-top
  from sklearn import datasets
  from sklearn import model_selection
  # pylint: enable=g-import-not-at-top
  digits = datasets.load_digits()
  x = (digits.images / 16.0).astype("float32")[..., None]  # NHWC in [0, 1]
  return model_selection.train_test_split(
      x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)


def build_model():
  """A small convnet that outputs logits for the 10 digits."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input(shape=(8, 8, 1)),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(10),
  ])
