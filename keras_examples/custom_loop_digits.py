"""A custom training loop on scikit-learn's digits with ReplicatorStrategy.

The pieces of a hand-written loop under a strategy:
  * `strategy.experimental_distribute_dataset` splits each global batch;
  * a `tf.function` step calls `strategy.run`, so every replica runs the
    same `tf.GradientTape` code on its slice;
  * the loss is averaged over the *global* batch, so the gradients the
    optimizer all-reduces (sums) across replicas are those of the mean loss;
  * `strategy.reduce` combines per-replica results for logging, and the
    replica context's `all_reduce("max", ...)` finds the worst replica.

  python keras_examples/custom_loop_digits.py --replicas 4 --epochs 10
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
  import tensorflow as tf
  import replicator_strategy
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x_train, x_test, y_train, y_test = digits.load_data()
  global_batch = args.global_batch_size

  strategy = replicator_strategy.ReplicatorStrategy()
  print(strategy)  # the replicas, their devices and the all-reduce, first
  with strategy.scope():
    model = digits.build_model()
    optimizer = keras.optimizers.Adam(3e-3)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)  # one loss per example

  train_data = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x_train, y_train))
      .shuffle(len(x_train), seed=0)
      .batch(global_batch, drop_remainder=True))
  # The last test batch is partial: some replicas get fewer examples.
  test_data = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch))

  @tf.function
  def train_step(batch):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        per_example_loss = loss_fn(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(
            per_example_loss, global_batch_size=global_batch)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      # Every replica learns the largest of the replicas' mean losses.
      replica_loss = tf.reduce_mean(per_example_loss)
      worst = tf.distribute.get_replica_context().all_reduce(
          "max", replica_loss)
      return loss, worst

    loss, worst = strategy.run(replica_step, args=batch)
    # Each replica's `loss` is its share of the global mean: sum the shares.
    return (strategy.reduce("sum", loss, axis=None),
            strategy.experimental_local_results(worst)[0])  # same on all

  @tf.function
  def count_correct(batch):
    def replica_count(x, y):
      predicted = tf.argmax(model(x, training=False), axis=-1)
      return tf.reduce_sum(tf.cast(predicted == y, tf.int64))
    return strategy.reduce("sum", strategy.run(replica_count, args=batch),
                           axis=None)

  for epoch in range(1, args.epochs + 1):
    losses, worst_losses = [], []
    for batch in train_data:
      loss, worst = train_step(batch)
      losses.append(float(loss))
      worst_losses.append(float(worst))
    correct = sum(int(count_correct(batch)) for batch in test_data)
    print(f"epoch {epoch:2d}: loss {sum(losses) / len(losses):.4f}, "
          f"worst replica's loss {sum(worst_losses) / len(worst_losses):.4f}, "
          f"test accuracy {correct / len(x_test):.4f}")

  print(f"test accuracy: {correct / len(x_test):.4f}")
  print(f"wall time: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
  main()
