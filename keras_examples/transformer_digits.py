"""Train a small transformer on scikit-learn's digits, each replica over 2 devices.

Model parallelism with Keras's own `LayoutMap`, on TensorFlow: each replica
spans `--model-parallel` devices; the attention's heads and the MLP's hidden
units are split over them (Megatron's column- and row-parallel layers), and
the replicas train data-parallel. Each 8x8 image is read as 8 tokens, one
per row of pixels. Without a GPU the CPU is split into
`--replicas x --model-parallel` logical devices.

  python keras_examples/transformer_digits.py --replicas 2 --model-parallel 2
"""

import argparse
import time

import digits  # pylint: disable=g-bad-import-order  (TF env vars; nothing heavy)

WIDTH, HEADS = 32, 4


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replicas", type=int, default=2,
                      help="data-parallel replicas (default: 2)")
  parser.add_argument("--model-parallel", type=int, default=2,
                      help="devices each replica spans; it must divide the "
                      f"{HEADS} heads (default: 2)")
  add_training_arguments(parser)
  return parser.parse_args()


def add_training_arguments(parser):
  """--epochs and --global-batch-size, which every transformer script takes."""
  parser.add_argument("--epochs", type=int, default=10,
                      help="passes over the training set (default: 10)")
  parser.add_argument("--global-batch-size", type=int, default=64,
                      help="examples per step, over all replicas (default: 64)")


def layout_map(keras, devices, replicas, k):
  """Heads and hidden units split over each replica's k devices."""
  mesh = keras.distribution.DeviceMesh((replicas, k), ("batch", "model"),
                                       devices)
  layouts = keras.distribution.LayoutMap(mesh)
  layouts[".*attention/(query|key|value)/kernel"] = (None, "model", None)
  layouts[".*attention/(query|key|value)/bias"] = ("model", None)
  layouts[".*attention/attention_output/kernel"] = ("model", None, None)
  layouts[".*up/kernel"] = (None, "model")  # Column-parallel.
  layouts[".*up/bias"] = ("model",)
  layouts[".*down/kernel"] = ("model", None)  # Row-parallel.
  return layouts


def build_model(keras):
  """Rows of pixels as tokens -> one transformer block -> digit logits."""
  pixels = keras.Input((8, 8))
  x = keras.layers.Dense(WIDTH, name="tokens")(pixels)
  x = x + keras.layers.Embedding(8, WIDTH, name="positions")(
      keras.ops.arange(8))
  attended = keras.layers.MultiHeadAttention(
      HEADS, WIDTH // HEADS, name="attention")(x, x)
  x = keras.layers.LayerNormalization()(x + attended)
  hidden = keras.layers.Dense(4 * WIDTH, activation="gelu", name="up")(x)
  x = keras.layers.LayerNormalization()(
      x + keras.layers.Dense(WIDTH, name="down")(hidden))
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(pixels, keras.layers.Dense(10, name="logits")(x))


def load_data():
  """The digits as `(x_train, x_test, y_train, y_test)`, each image 8 rows."""
  x_train, x_test, y_train, y_test = digits.load_data()
  return x_train[..., 0], x_test[..., 0], y_train, y_test


def compile_model(keras, model):
  model.compile(
      optimizer=keras.optimizers.Adam(3e-3),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])


def fit_and_report(model, args, data, start):
  """Trains `model` on `data` (`load_data()`'s) and prints its test accuracy
  and the wall time since `start`."""
  x_train, x_test, y_train, y_test = data
  model.fit(x_train, y_train, batch_size=args.global_batch_size,
            epochs=args.epochs, validation_split=0.1)
  _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
  print(f"test accuracy: {test_accuracy:.4f}")
  print(f"wall time: {time.monotonic() - start:.1f} s")


def main():
  args = parse_args()
  start = time.monotonic()
  devices_needed = args.replicas * args.model_parallel
  digits.set_up_devices(devices_needed)
  # Here, not at the top: `--help` answers before TensorFlow loads.
  # pylint: disable=g-import-not-at-top
  import keras
  import replicator_strategy
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  data = load_data()

  devices = keras.distribution.list_devices()[:devices_needed]
  strategy = replicator_strategy.ReplicatorStrategy(layout_map=layout_map(
      keras, devices, args.replicas, args.model_parallel))
  print(strategy)  # the replicas, their first devices and the all-reduce
  with strategy.scope():
    model = build_model(keras)
    compile_model(keras, model)
  kernel = model.get_layer("up").kernel.value  # held in parts
  print(f"up/kernel {kernel.shape.as_list()} in {args.model_parallel} parts "
        f"of {kernel.values[0].shape.as_list()}, on "
        f"{', '.join(p.device.rsplit('/', 1)[-1] for p in kernel.values)}")
  fit_and_report(model, args, data, start)


if __name__ == "__main__":
  main()
