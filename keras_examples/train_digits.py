"""Train a Keras model on scikit-learn's digits with ReplicatorStrategy.

The drop-in use: build and compile the model inside `strategy.scope()`, then
call `model.fit` as usual. Each global batch is split across the replicas and
their gradients are all-reduced every step. Without a GPU the CPU is split
into `--replicas` logical devices, so the multi-replica path runs anywhere.

  python keras_examples/train_digits.py --replicas 4 --epochs 10
"""

import time

import digits  # pylint: disable=g-bad-import-order  (TF env vars; nothing heavy)


def main():
  args = digits.parse_args(__doc__.splitlines()[0], epochs=10)
  start = time.monotonic()
  digits.set_up_devices(args.replicas)
  # Here, not at the top: `--help` answers before TensorFlow loads.
  # pylint: disable=g-import-not-at-top
  import keras
  import replicator_strategy
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x_train, x_test, y_train, y_test = digits.load_data()

  strategy = replicator_strategy.ReplicatorStrategy()
  print(strategy)  # the replicas, their devices and the all-reduce, first
  with strategy.scope():
    model = digits.build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

  model.fit(x_train, y_train, batch_size=args.global_batch_size,
            epochs=args.epochs, validation_split=0.1)
  _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)

  print(f"test accuracy: {test_accuracy:.4f}")
  print(f"wall time: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
  main()
