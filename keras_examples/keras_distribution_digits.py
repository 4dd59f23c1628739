"""Train on scikit-learn's digits with Keras's own `keras.distribution` API.

The script is written as for JAX: it never builds a strategy or opens a
scope. It sets a `keras.distribution.DataParallel` (every device a replica)
or, with `--model-parallel 2`, a `ModelParallel` whose `LayoutMap` splits the
transformer's heads and MLP over each replica's devices (Megatron's column-
and row-parallel layers), and calls `model.fit`. On TensorFlow,
`replicator_strategy.use_for_keras_distribution()` is the one line added:
the distribution set runs under a ReplicatorStrategy made from its mesh
(docs/keras-distribution.md). Without a GPU the CPU is split into
`--replicas x --model-parallel` logical devices.

  python keras_examples/keras_distribution_digits.py --replicas 4
  python keras_examples/keras_distribution_digits.py --replicas 2 \\
      --model-parallel 2
"""

import argparse
import time

import digits  # pylint: disable=g-bad-import-order  (TF env vars; nothing heavy)
import transformer_digits


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replicas", type=int, default=4,
                      help="data-parallel replicas (default: 4)")
  parser.add_argument("--model-parallel", type=int, default=1,
                      help="devices each replica spans (ModelParallel when "
                      f"above 1); it must divide the {transformer_digits.HEADS} "
                      "heads (default: 1, DataParallel)")
  transformer_digits.add_training_arguments(parser)
  return parser.parse_args()


def main():
  args = parse_args()
  start = time.monotonic()
  devices_needed = args.replicas * args.model_parallel
  digits.set_up_devices(devices_needed)
  # Here, not at the top: `--help` answers before TensorFlow loads.
  # pylint: disable=g-import-not-at-top
  import keras
  import replicator_strategy
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  replicator_strategy.use_for_keras_distribution()  # The line TF adds.

  keras.utils.set_random_seed(0)
  data = transformer_digits.load_data()

  devices = keras.distribution.list_devices()[:devices_needed]
  if args.model_parallel > 1:
    distribution = keras.distribution.ModelParallel(
        layout_map=transformer_digits.layout_map(
            keras, devices, args.replicas, args.model_parallel),
        batch_dim_name="batch")
  else:
    distribution = keras.distribution.DataParallel(devices=devices)
  keras.distribution.set_distribution(distribution)
  print(tf.distribute.get_strategy())  # the strategy serving it, its replicas

  model = transformer_digits.build_model(keras)
  transformer_digits.compile_model(keras, model)
  kernel = model.get_layer("up").kernel
  print(f"up/kernel {kernel.shape}, held as {held_as(kernel)}")

  transformer_digits.fit_and_report(model, args, data, start)


def held_as(variable):
  """What each device holds of `variable`: a copy, or a part of it."""
  return ", ".join(f"{tuple(v.shape)} on {v.device.rsplit(':', 2)[-2]}:"
                   f"{v.device.rsplit(':', 1)[-1]}"
                   for v in variable.value.values)


if __name__ == "__main__":
  main()
