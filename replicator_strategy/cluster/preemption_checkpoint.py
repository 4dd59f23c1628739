"""Custom training loops: save at the step every worker agrees on, resume there.

What `keras.callbacks.BackupAndRestore` does for `fit` (see `preemption`),
for a loop of your own over a `tf.train.Checkpoint`. Put the step count in
the checkpoint and start the loop from it: a restarted run then resumes at
the very step where the preempted one stopped.

(Example: the class's docstring.)

(TF's `tf.distribute.experimental.PreemptionCheckpointHandler` is not used:
it asks a cloud metadata server over the network whether it runs on GCP when
it is created, and handles SIGTERM for MultiWorkerMirroredStrategy alone.)
"""

import tensorflow as tf

from replicator_strategy.cluster import preemption
from replicator_strategy.cluster import scratch


class PreemptionCheckpoint:
  """Restores `checkpoint` from `directory`; saves there when preempted.

  Across workers, every worker saves (reading some variables takes part in
  collectives) but only the chief's checkpoint lands in `directory`; the
  others write to scratch. `directory` must be readable by every worker.

  >>> import keras
  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy()
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  ...   optimizer = keras.optimizers.SGD(0.1)
  >>> @tf.function
  ... def train_step(x):
  ...   def replica_step(x):
  ...     with tf.GradientTape() as tape:
  ...       loss = tf.reduce_sum(model(x) ** 2) / 8  # 8: the global batch
  ...     grads = tape.gradient(loss, model.trainable_variables)
  ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
  ...   strategy.run(replica_step, args=(x,))
  >>> dataset = tf.data.Dataset.from_tensor_slices(tf.ones((32, 2))).batch(8)
  >>> step = tf.Variable(0, dtype=tf.int64)
  >>> checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
  >>> with rs.PreemptionCheckpoint(strategy, checkpoint, "ckpt") as preemption:
  ...   for batch in strategy.experimental_distribute_dataset(
  ...       dataset.skip(int(step.numpy()))):  # the step restored from "ckpt"
  ...     train_step(batch)
  ...     step.assign_add(1, read_value=False)
  ...     preemption.step_done()  # on preemption: saves, exits 143
  >>> int(step.numpy())
  4
  """

  def __init__(self, strategy, checkpoint, directory):
    if not isinstance(checkpoint, tf.train.Checkpoint):
      raise TypeError(f"Expected `checkpoint` to be a tf.train.Checkpoint. "
                      f"Received: {checkpoint!r}")
    write_to = (directory if strategy.extended.should_checkpoint else
                scratch.new_dir())
    self._manager = tf.train.CheckpointManager(checkpoint, write_to,
                                               max_to_keep=1)
    latest = tf.train.latest_checkpoint(directory)
    if latest:
      checkpoint.restore(latest)

  def __enter__(self):
    preemption.start_watching()
    return self

  def __exit__(self, exc_type, exc_value, traceback):
    # Exits 143 if told to stop meanwhile, unless an error is on its way out.
    preemption.stop_watching(exit_if_told=exc_type is None)

  def step_done(self):
    """Call after every step: at the agreed step, saves and exits 143."""
    if preemption.step_done():
      self._manager.save()
      preemption.stop()
