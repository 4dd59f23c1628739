"""Tensor parallel with ZeRO-3 in sync groups, on 8 logical CPUs: `python
tests/sync_groups_sharded_parts_main.py`, one JSON line of results.

Run by test_sync_groups_mesh.py in a fresh process: 2 groups x 2 replicas x
2 devices needs 8 devices, the suite's processes split the CPU into 4. The
MLP's kernels are split over the model axis and sharded over each group's
replicas (a layout naming the batch axis too).
"""

import json
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs

DEVICES = rs.split_cpu(8)  # Before any TensorFlow op.


def strategy(sharded=True, **grouping):
  """4 replicas over 2 devices each, in `grouping`'s sync groups; the
  kernels sharded over the replicas too, unless not `sharded`."""
  batch = "batch" if sharded else None
  layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
      (4, 2), ("batch", "model"), DEVICES))
  layout_map[".*up/kernel"] = (batch, "model")
  layout_map[".*up/bias"] = ("model",)
  layout_map[".*down/kernel"] = ("model", batch)
  return rs.ReplicatorStrategy(layout_map=layout_map, **grouping)


def mlp(momentum=0.0):
  keras.utils.set_random_seed(3)
  model = keras.Sequential([
      keras.Input((8,)), keras.layers.Dense(16, "tanh", name="up"),
      keras.layers.Dense(4, name="down")])
  model.compile(keras.optimizers.SGD(0.1, momentum=momentum), "mse")
  return model


def data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(64, 8)).astype(np.float32),
          rng.normal(size=(64, 4)).astype(np.float32))


def fit(the_strategy, rows=64, momentum=0.0):
  with the_strategy.scope():
    model = mlp(momentum)
  x, y = data()
  model.fit(x[:rows], y[:rows], batch_size=16, epochs=1, shuffle=False,
            verbose=0)
  return model


def group_step(model):
  """A step that moves each group's weights its own way."""
  group = tf.distribute.get_replica_context().sync_group
  x = tf.ones([2, 8]) * tf.cast(group + 1, tf.float32)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model(x))
  model.optimizer.apply_gradients(zip(
      tape.gradient(loss, model.trainable_variables),
      model.trainable_variables))


def checkpoint_between_rounds():
  """(each group's kernel shards differ, a checkpoint restores them all)."""
  grouped = strategy(sync_groups=2, average_every=1000)
  model = fit(grouped, rows=32)
  tf.function(lambda: grouped.run(group_step, (model,)))()
  components = model.get_layer("up").kernel.value.values
  saved = [c.numpy() for c in components]
  checkpoint = tf.train.Checkpoint(model=model)
  with tempfile.TemporaryDirectory() as directory:
    path = checkpoint.write(os.path.join(directory, "ckpt"))
    for component in components:
      component.assign(tf.zeros_like(component))
    checkpoint.read(path).assert_consumed()
  # Shard 0 of part 0 is component 0 in group 0, component 4 in group 1.
  return (not np.allclose(saved[0], saved[4]),
          all(np.array_equal(want, c.numpy())
              for want, c in zip(saved, components)))


def diloco(sharded):
  """The weights after `fit` with momentum, DiLoCo's outer Nesterov step
  and overlapped rounds."""
  return fit(strategy(
      sharded, sync_groups=2, average_every=2, overlap_averaging=True,
      outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)),
             momentum=0.9).get_weights()


def main():
  grouped = fit(strategy(sync_groups=2, average_every=1))
  synchronous = fit(strategy())
  kernel = grouped.get_layer("up").kernel.value
  differ, restored = checkpoint_between_rounds()
  print(json.dumps({
      "kinds": [type(w.value).__name__ for w in grouped.weights],
      "kernel_shards": [c.shape.as_list() for c in kernel.values],
      "grouped": [w.tolist() for w in grouped.get_weights()],
      "synchronous": [w.tolist() for w in synchronous.get_weights()],
      "diloco": [w.tolist() for w in diloco(sharded=True)],
      "diloco_unsharded": [w.tolist() for w in diloco(sharded=False)],
      "groups_differ_between_rounds": differ,
      "checkpoint_restores_every_group": restored,
  }))


if __name__ == "__main__":
  main()
