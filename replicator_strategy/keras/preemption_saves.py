"""`keras.callbacks.BackupAndRestore` takes part in the agreed stop on SIGTERM.

Across workers, SIGTERM to one worker stops every worker after one agreed
step (see `replicator_strategy.cluster.preemption`). In `fit`, `BackupAndRestore`
watches for that step from `on_train_begin`, counts steps in
`on_train_batch_end`, saves and stops there. Entries of
`replicator_strategy.keras.PATCHES`; inert unless a ReplicatorStrategy
cluster is running.

>>> import keras
>>> import numpy as np
>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope():
...   model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
...   model.compile("sgd", "mse")
>>> backup = keras.callbacks.BackupAndRestore("backup")  # every worker reads it
>>> history = model.fit(np.ones((8, 2)), np.ones(8), epochs=2, verbose=0,
...                     callbacks=[backup])
>>> history.epoch
[0, 1]
"""

import functools

from replicator_strategy.cluster import preemption
from replicator_strategy.keras import _internal as ki


def watching(on_train_begin):

  @functools.wraps(on_train_begin)
  def wrapper(self, logs=None):
    result = on_train_begin(self, logs)
    preemption.start_watching()
    return result

  return wrapper


def stopping_when_told(on_train_batch_end):

  @functools.wraps(on_train_batch_end)
  def wrapper(self, batch, logs=None):
    result = on_train_batch_end(self, batch, logs)
    if preemption.step_done():
      # Keras 3 resumes a backup from the start of its epoch: a mid-epoch
      # backup would train that epoch's first batches twice. So with
      # save_freq="epoch" the last epoch's backup is the one to resume from;
      # with save_freq=N batches, save now as Keras does every N batches.
      if self.save_freq != "epoch":
        ki.save_backup(self)
      preemption.stop()
    return result

  return wrapper


def watched(on_train_end):

  @functools.wraps(on_train_end)
  def wrapper(self, logs=None):
    preemption.stop_watching()
    return on_train_end(self, logs)

  return wrapper
