"""Train a Keras model on scikit-learn's digits with ReplicatorStrategy.

The drop-in use: build and compile the model inside `strategy.scope()`, then
call `model.fit` as usual. Each global batch is split across the replicas and
their gradients are all-reduced every step. Without a GPU the CPU is split
into `--replicas` logical devices so the multi-replica path runs anywhere.

  python keras_examples/train_digits.py --replicas 4 --epochs 10
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

import replicator_strategy  # pylint: disable=g-import-not-at-top


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--replicas", type=int, default=4,
                      help="logical CPU devices to split into when there is "
                      "no GPU (default: 4); ignored on GPU machines, which "
                      "use every GPU")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--global-batch-size", type=int, default=64,
                      help="examples per step, summed over all replicas")
  return parser.parse_args()


def load_data():
  from sklearn import datasets, model_selection  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()  # 1797 8x8 images, shipped with sklearn
  x = (digits.images / 16.0).astype("float32")[..., None]
  return model_selection.train_test_split(
      x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)


def build_model():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input(shape=(8, 8, 1)),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(10),
  ])


def main():
  args = parse_args()
  # Must happen before TensorFlow creates its devices.
  if not tf.config.list_physical_devices("GPU"):
    replicator_strategy.split_cpu(args.replicas)

  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x_train, x_test, y_train, y_test = load_data()

  strategy = replicator_strategy.ReplicatorStrategy()
  with strategy.scope():
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

  model.fit(x_train, y_train, batch_size=args.global_batch_size,
            epochs=args.epochs, validation_split=0.1)
  _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)

  print(strategy)
  print(f"test accuracy: {test_accuracy:.4f}")


if __name__ == "__main__":
  main()
