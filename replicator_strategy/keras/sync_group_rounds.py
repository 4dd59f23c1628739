"""Averaging rounds of sync groups in Keras's `fit`, unchanged for users.

With `ReplicatorStrategy(sync_groups=G, average_every=H)` Keras's train
function is followed, after each call, by a look at the optimizer's
`iterations` (the steps done, which checkpoints keep): when it passed a
multiple of H, an averaging round runs (`replicator_strategy.sync_groups.rounds`).
Before the first step the weights are kept as the first round's `old` (with
an outer optimizer). Each train step counts its replicas' rows, which a
round weighs the groups by (`Averaging.count_rows`), and logs its metrics
over this worker's groups only (`global_results`). When `fit` returns, a
last round runs if the last step did not average (or left an overlapped
exchange in flight), so `evaluate`, `predict` and saving see one model.
Called between rounds (a custom loop's, or a callback's), `predict`,
`evaluate` and their `_on_batch` forms answer with the first group's
weights, which `get_weights()` and `save()` return; `fit`'s own validation
runs on each group's.

With fragments (`SyncGroups(fragments=F)`) a round averages the fragments
due at the steps a call passed, and `fit`'s last round the weights its last
step left apart (the fragments not averaged then).

A `BackupAndRestore` backup, taken between rounds, holds one value per
weight (its `.weights.h5` file); beside it a `tf.train.Checkpoint` of the
model, its optimizer and the rounds' state (`strategy.sync_groups_state`:
the outer optimizer's, the weights at the last round, an overlapped
exchange in flight), `GROUP_STATE`, holds every group's
(`replicator_strategy.variables.SyncGroupVariable`), and a resume reads it
after Keras's load, so every group goes on from its own weights and the
rounds as they would have.

>>> import keras
>>> import numpy as np
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(sync_groups=2, average_every=3)
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
...   model.compile("sgd", "mse")
>>> _ = model.fit(np.ones((40, 3)), np.ones((40, 1)), batch_size=8, verbose=0)
>>> kernels = strategy.experimental_local_results(model.layers[0].kernel.value)
>>> all(np.array_equal(k, kernels[0]) for k in kernels)  # 5 steps, then a round
True
"""

import dataclasses
import functools
import os
import weakref

import tensorflow as tf

from replicator_strategy import strategy as strategy_lib
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import global_results


@dataclasses.dataclass
class _Rounds:
  """One model's training under sync groups: the ids of the weights its
  last step left apart (None: none, before any step)."""
  apart: set | None = None


_rounds = weakref.WeakKeyDictionary()  # model -> _Rounds

# The checkpoint, in a BackupAndRestore's directory, of every group's state.
GROUP_STATE = "sync_groups"


def _grouped(model):
  strategy = model.distribute_strategy
  return (isinstance(strategy, strategy_lib.ReplicatorStrategy) and
          strategy.num_sync_groups > 1)


def _apart_after(model, steps):
  """The round due after the steps (last_step, step] of `steps`, if any;
  then notes the weights left apart."""
  averaging = model.distribute_strategy.averaging
  equal = []
  if averaging.rounds_due(*steps):
    # Every round averages the non-trainable weights at once.
    equal = model.non_trainable_weights + averaging.scheduled_round(
        model.trainable_weights, model.non_trainable_weights, steps)
  equal = {id(v) for v in equal}
  _rounds[model].apart = {id(v) for v in model.weights if id(v) not in equal}


def rows_counted(make_function):
  """Keras's step maker, with the train step counting its rows for the
  rounds, and its logs summed over this worker's groups only
  (`global_results`)."""

  @functools.wraps(make_function)
  def wrapper(self, step_function):
    if _grouped(self) and step_function == self.train_step:
      averaging = self.distribute_strategy.averaging
      train_step = step_function

      @functools.wraps(train_step)
      def step_function(data):
        averaging.count_rows()
        with global_results.train_step_logs_local():
          return train_step(data)

    return make_function(self, step_function)

  return wrapper


def rounds_after_steps(make_train_function):
  """Keras's train function, followed by the rounds due after each call."""

  @functools.wraps(make_train_function)
  def wrapper(self, force=False):
    built = make_train_function(self, force)
    train_function = self.train_function
    if (not _grouped(self) or train_function is None or
        getattr(train_function, "counts_sync_group_rounds", False)):
      return built
    _rounds.setdefault(self, _Rounds())
    averaging = self.distribute_strategy.averaging

    def with_rounds(*args, **kwargs):
      averaging.start(self.trainable_weights)
      before = int(self.optimizer.iterations.numpy())
      logs = train_function(*args, **kwargs)
      after = int(self.optimizer.iterations.numpy())
      if after != before:
        _apart_after(self, (before, after))
      return logs

    with_rounds.counts_sync_group_rounds = True
    self.train_function = with_rounds
    return built if built is None else with_rounds

  return wrapper


def last_round(fit):
  """Keras's `fit`, then a round of the weights its last step left apart."""

  @functools.wraps(fit)
  def wrapper(self, *args, **kwargs):
    history = fit(self, *args, **kwargs)
    rounds = _rounds.get(self)
    if _grouped(self) and rounds is not None and rounds.apart:
      self.distribute_strategy.averaging.average(
          [v for v in self.trainable_weights if id(v) in rounds.apart],
          self.non_trainable_weights)
      rounds.apart = None
    return history

  return wrapper


def with_one_model(method):
  """Keras's `predict`, `evaluate` or their `_on_batch`, answered by the
  first group's weights on every replica (not fit's validation)."""

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    if not _grouped(self) or ki.is_fit_validation(kwargs):
      return method(self, *args, **kwargs)
    with self.distribute_strategy.averaging.first_group_everywhere(
        self.weights):
      return method(self, *args, **kwargs)

  return wrapper


def _group_state(model):
  """A checkpoint of `model`, its optimizer and the rounds' state: every
  group's values."""
  parts = {"model": model,
           "sync_groups": model.distribute_strategy.sync_groups_state}
  if model.optimizer is not None:
    parts["optimizer"] = model.optimizer
  return tf.train.Checkpoint(**parts)


def group_state_beside_backup(save_model):
  """`BackupAndRestore`'s save, then every group's state beside it."""

  @functools.wraps(save_model)
  def wrapper(self):
    save_model(self)
    if _grouped(self.model):
      # Every worker writes (a gather across workers); a non-chief's
      # backup_dir is its scratch directory here (`chief_writes`).
      _group_state(self.model).write(os.path.join(self.backup_dir,
                                                  GROUP_STATE))

  return wrapper


def group_state_from_backup(on_train_begin):
  """`BackupAndRestore`'s load, then every group's state, if saved."""

  @functools.wraps(on_train_begin)
  def wrapper(self, logs=None):
    on_train_begin(self, logs)
    path = os.path.join(self.backup_dir, GROUP_STATE)
    if _grouped(self.model) and tf.io.gfile.exists(path + ".index"):
      # Read before the rounds' state is made, which TF fills as it is made
      # (here at once, before the backup goes): a backup written before a
      # part of it existed (the rows' counters) matches, and counts none.
      _group_state(self.model).read(path).assert_existing_objects_matched()
      self.model.distribute_strategy.averaging.start(
          self.model.trainable_weights)

  return wrapper
