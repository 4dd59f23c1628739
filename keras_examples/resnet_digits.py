"""A small ResNet trained with Keras `fit` and the large-batch recipe.

The paper's first workload (ResNet-50 on ImageNet) scaled down to
scikit-learn's 8x8 digits: residual blocks with cross-replica (synchronized)
batch norm, so the statistics are those of the whole global batch whatever
the replica count, and the large-batch recipe of Goyal et al. (2017): SGD
with momentum, the learning rate scaled with the global batch (--base-lr
per 256 examples), a linear warm-up, then a cosine decay.

  python keras_examples/resnet_digits.py --replicas 4
  replicator-launch --workers 2 -- \\
      python keras_examples/resnet_digits.py --replicas 2 --quick
"""

import harness  # pylint: disable=g-bad-import-order  (nothing heavy)



def add_arguments(parser):
  parser.add_argument("--epochs", type=int, default=30,
                      help="passes over the training set (default: 30)")
  parser.add_argument("--global-batch-size", type=int, default=256,
                      help="examples per step over all replicas (default: 256)")
  parser.add_argument("--base-lr", type=float, default=0.2,
                      help="peak learning rate per 256 examples of global "
                      "batch (default: 0.2)")
  parser.add_argument("--warmup-epochs", type=int, default=3,
                      help="epochs of linear warm-up (default: 3)")


if __name__ == "__main__":
  # --help and a bad flag answer here, before TensorFlow loads.
  harness.read_command_line(__doc__, add_arguments)

import digits
import keras


def residual_block(x, filters, stride):
  """Two 3x3 convolutions and a shortcut, each followed by synchronized BN."""
  y = keras.layers.Conv2D(filters, 3, stride, padding="same",
                          use_bias=False)(x)
  y = keras.layers.BatchNormalization(synchronized=True, momentum=0.9)(y)
  y = keras.layers.ReLU()(y)
  y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
  # Zero-initialised scale: each block starts as the identity (Goyal et al.).
  y = keras.layers.BatchNormalization(
      synchronized=True, momentum=0.9, gamma_initializer="zeros")(y)
  if stride != 1 or x.shape[-1] != filters:
    x = keras.layers.Conv2D(filters, 1, stride, use_bias=False)(x)
    x = keras.layers.BatchNormalization(synchronized=True, momentum=0.9)(x)
  return keras.layers.ReLU()(keras.layers.Add()([x, y]))


def build_resnet(stage_filters=(32, 64, 128), blocks_per_stage=2):
  """A ResNet for 8x8x1 images: 3 stages (8x8, 4x4, 2x2), logits for 10."""
  inputs = keras.Input(shape=(8, 8, 1))
  x = keras.layers.Conv2D(stage_filters[0], 3, padding="same",
                          use_bias=False)(inputs)
  x = keras.layers.BatchNormalization(synchronized=True, momentum=0.9)(x)
  x = keras.layers.ReLU()(x)
  for stage, filters in enumerate(stage_filters):
    for block in range(blocks_per_stage):
      x = residual_block(x, filters, 2 if stage > 0 and block == 0 else 1)
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(10)(x), name="resnet")


def large_batch_schedule(base_lr, global_batch, steps_per_epoch, epochs,
                         warmup_epochs):
  """Linear warm-up to `base_lr * global_batch / 256`, then cosine to 0."""
  warmup_steps = warmup_epochs * steps_per_epoch
  return keras.optimizers.schedules.CosineDecay(
      initial_learning_rate=0.0, warmup_target=base_lr * global_batch / 256,
      warmup_steps=warmup_steps,
      decay_steps=epochs * steps_per_epoch - warmup_steps)


def main():
  run = harness.start("resnet_digits", __doc__, add_arguments,
                      quick={"epochs": 3, "warmup_epochs": 1})
  args = run.args
  x_train, x_test, y_train, y_test = digits.load_data()
  steps_per_epoch = len(x_train) // args.global_batch_size
  schedule = large_batch_schedule(args.base_lr, args.global_batch_size,
                                  steps_per_epoch, args.epochs,
                                  args.warmup_epochs)

  with run.strategy.scope():
    model = build_resnet()
    model.compile(
        optimizer=keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True,
                                       weight_decay=5e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

  # Full batches only: the same steps, hence the same schedule, on any
  # replica count. The test set is evaluated after every epoch for the plot.
  keep = steps_per_epoch * args.global_batch_size
  history = model.fit(
      x_train[:keep], y_train[:keep], batch_size=args.global_batch_size,
      epochs=args.epochs, validation_data=(x_test, y_test), verbose=2,
      callbacks=[keras.callbacks.TensorBoard(run.tensorboard_dir)])
  _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)

  curves = history.history
  run.plot_curves("curves.png", {
      "loss": {"train": curves["loss"], "test": curves["val_loss"]},
      "accuracy": {"train": curves["accuracy"],
                   "test": curves["val_accuracy"]},
      "learning rate": {"end of epoch": [
          float(schedule(steps_per_epoch * e))
          for e in range(1, args.epochs + 1)]},
  }, x_label="epoch", title=f"ResNet on digits, {run.replicas}, global batch "
     f"{args.global_batch_size}")
  print(f"test accuracy: {test_accuracy:.4f}")
  run.finish()


if __name__ == "__main__":
  main()
