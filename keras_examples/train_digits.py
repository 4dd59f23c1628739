"""Train a Keras model on scikit-learn's digits with ReplicatorStrategy.

The drop-in use: build and compile the model inside `strategy.scope()`, then
call `model.fit` as usual. Each global batch is split across the replicas and
their gradients are all-reduced every step. Without a GPU the CPU is split
into `--replicas` logical devices, so the multi-replica path runs anywhere.

  python keras_examples/train_digits.py --replicas 4 --epochs 10

With `--sync-groups 2 --average-every 8` the replicas train in two sync
groups that average their weights every 8 steps (docs/sync-groups.md);
`--outer-dtype int8` sends each group's change at a round as int8.
"""

import time

import digits  # pylint: disable=g-bad-import-order  (TF env vars; nothing heavy)


def add_sync_group_arguments(parser):
  parser.add_argument(
      "--sync-groups", type=int, default=1,
      help="sync groups the replicas form, each synchronous, averaging "
      "between them every --average-every steps (default: 1, all in sync)")
  parser.add_argument(
      "--average-every", type=int, default=8,
      help="with --sync-groups > 1, steps between averaging rounds "
      "(default: 8)")
  parser.add_argument(
      "--outer-dtype", choices=("bfloat16", "int8", "int4"), default=None,
      help="with --sync-groups > 1, send each group's change at a round in "
      "this width, with error feedback (default: the weights in float32)")


def main():
  args = digits.parse_args(__doc__.splitlines()[0], epochs=10,
                           add_arguments=add_sync_group_arguments)
  start = time.monotonic()
  digits.set_up_devices(args.replicas)
  # Here, not at the top: `--help` answers before TensorFlow loads.
  # pylint: disable=g-import-not-at-top
  import keras
  import replicator_strategy
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x_train, x_test, y_train, y_test = digits.load_data()

  strategy = replicator_strategy.ReplicatorStrategy(
      sync=replicator_strategy.SyncGroups(
          groups=args.sync_groups,
          average_every=args.average_every if args.sync_groups > 1 else 1,
          outer_dtype=args.outer_dtype))
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
  if args.sync_groups > 1:
    averaging = strategy.averaging
    print(f"averaging rounds: {averaging.rounds}, "
          f"{averaging.bytes_averaged / averaging.rounds:.0f} bytes each")
  print(f"wall time: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
  main()
