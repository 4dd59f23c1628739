"""Timing and agreement helpers shared by the sections."""

import statistics
import time

import keras
import numpy as np


class StepTimer(keras.callbacks.Callback):
  """Wall time of each training step (the step function returns when done)."""

  def __init__(self):
    super().__init__()
    self.times = []
    self._start = None

  def on_train_batch_begin(self, batch, logs=None):
    del batch, logs
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    del batch, logs
    self.times.append(time.perf_counter() - self._start)


def median_ms(times):
  return 1000 * statistics.median(times)


def interleaved(fns, rounds, calls=1):
  """Times each of `fns` (a dict), round by round, `calls` calls a round.

  Interleaving the contenders makes machine noise hit all of them alike.

  Returns:
    {key: [seconds per call]}.
  """
  times = {key: [] for key in fns}
  for _ in range(rounds):
    for key, fn in fns.items():
      for _ in range(calls):
        start = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - start)
  return times


def agree(values, rtol):
  """Whether every value is within `rtol` of the first."""
  values = list(values)
  ref = np.asarray(values[0], dtype="float64")
  return all(np.allclose(np.asarray(v, dtype="float64"), ref, rtol=rtol,
                         atol=rtol) for v in values[1:])
