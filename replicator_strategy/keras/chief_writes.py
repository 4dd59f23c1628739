"""Across workers, Keras writes files once: on the chief.

Every worker runs the same script, so every worker calls `model.save`,
`ModelCheckpoint`, `BackupAndRestore` and `TensorBoard`. Each worker must
still do the saving (reading distributed variables may take part in
collectives), but only the chief's files may land where the script says:
the others write to a private scratch directory that is deleted right after
(TensorBoard logs: at the end of training; everything: at exit, also on a
preemption; see `replicator_strategy.cluster.scratch`).

- `Model.save`, `Model.save_weights`, `Model.export` (so also ModelCheckpoint).
- `BackupAndRestore` saves, and deletes its backup at the end, on the chief
  only. Every worker restores from the chief's `backup_dir`, so it must be
  on storage every worker reads (one machine, or a shared file system).
- `TensorBoard` logs.

Entries of `replicator_strategy.keras.PATCHES`, applied on the first use of
`replicator_strategy`; inert unless the model's
strategy is a ReplicatorStrategy over several workers, on a non-chief one.

>>> import keras
>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope():
...   model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> model.save("model.keras")  # on worker 1: written to scratch, then deleted
>>> os.path.exists("model.keras")  # alone, or on the chief
True
"""

import functools
import os
import shutil

from replicator_strategy import strategy as strategy_lib
from replicator_strategy.cluster import scratch as scratch_lib
from replicator_strategy.keras import _internal as ki


def _non_chief(model):
  strategy = getattr(model, "distribute_strategy", None)
  return (isinstance(strategy, strategy_lib.ReplicatorStrategy) and
          not strategy.extended.is_chief)


def to_scratch_unless_chief(write):

  @functools.wraps(write)
  def wrapper(self, filepath, *args, **kwargs):
    if not _non_chief(self):
      return write(self, filepath, *args, **kwargs)
    scratch = scratch_lib.new_dir()
    try:
      name = os.path.basename(os.fspath(filepath).rstrip("/")) or "export"
      return write(self, os.path.join(scratch, name), *args, **kwargs)
    finally:
      shutil.rmtree(scratch, ignore_errors=True)

  return wrapper


def backup_to_scratch_unless_chief(save_model):

  @functools.wraps(save_model)
  def wrapper(self, *args, **kwargs):
    if not _non_chief(self.model):
      return save_model(self, *args, **kwargs)
    scratch = scratch_lib.new_dir()
    try:
      with ki.backup_written_to(self, scratch):
        return save_model(self, *args, **kwargs)
    finally:
      shutil.rmtree(scratch, ignore_errors=True)

  return wrapper


def keep_backup_unless_chief(on_train_end):

  @functools.wraps(on_train_end)
  def wrapper(self, logs=None):
    if not _non_chief(self.model):
      return on_train_end(self, logs)
    return None  # The chief deletes the one backup.

  return wrapper


def log_to_scratch_unless_chief(set_model):

  @functools.wraps(set_model)
  def wrapper(self, model):
    if _non_chief(model) and not getattr(self, "_replicator_scratch", None):
      self._replicator_scratch = self.log_dir  # pylint: disable=protected-access
      self.log_dir = scratch_lib.new_dir()
    return set_model(self, model)

  return wrapper


def drop_scratch_logs(on_train_end):

  @functools.wraps(on_train_end)
  def wrapper(self, logs=None):
    result = on_train_end(self, logs)
    real = getattr(self, "_replicator_scratch", None)
    if real is not None:
      shutil.rmtree(self.log_dir, ignore_errors=True)
      self.log_dir, self._replicator_scratch = real, None  # pylint: disable=protected-access
    return result

  return wrapper
