"""The averaging rounds between sync groups in each epoch's logs of `fit`.

With `ReplicatorStrategy(sync_groups=G > 1)`, `fit` adds to each epoch's
logs `sync_rounds`, the averaging rounds this process ran during the epoch,
and `sync_bytes`, the bytes those rounds sent (one replica's float32
weights a round, or with `outer_dtype` each group's low-bit change:
`strategy.averaging.rounds` and `bytes_averaged` over the epoch). Every
callback's `on_epoch_end` reads them, `History` keeps them, and Keras's
epoch line shows them (at `verbose=1`, `"auto"` or 2; nothing at 0). The
round `fit` runs after its last epoch, to end with one model, is in no
epoch's count (only in `strategy.averaging.rounds`).

>>> import keras
>>> import numpy as np
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(sync_groups=2, average_every=2)
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
...   model.compile("sgd", "mse")
>>> history = model.fit(np.ones((48, 3)), np.ones((48, 1)), batch_size=8,
...                     epochs=2, verbose=0)  # 6 steps an epoch
>>> history.history[ROUNDS], history.history[BYTES]  # 3 rounds of 4 floats
([3, 3], [48, 48])
"""

import functools
import inspect

import keras

ROUNDS = "sync_rounds"
BYTES = "sync_bytes"


class EpochRounds(keras.callbacks.Callback):
  """Puts the rounds and bytes of `averaging` during an epoch in its logs."""

  def __init__(self, averaging):
    super().__init__()
    self._averaging = averaging
    self._start = (0, 0)

  def on_epoch_begin(self, epoch, logs=None):
    self._start = (self._averaging.rounds, self._averaging.bytes_averaged)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      logs[ROUNDS] = self._averaging.rounds - self._start[0]
      logs[BYTES] = self._averaging.bytes_averaged - self._start[1]


def rounds_in_epoch_logs(fit):
  """Keras's `fit`, with `EpochRounds` first among its callbacks, so every
  other one (and the epoch line) sees its counts."""
  signature = inspect.signature(fit)

  @functools.wraps(fit)
  def wrapper(self, *args, **kwargs):
    strategy = self.distribute_strategy
    if getattr(strategy, "num_sync_groups", 1) == 1:
      return fit(self, *args, **kwargs)
    bound = signature.bind(self, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    counter = EpochRounds(strategy.averaging)
    if isinstance(callbacks, keras.callbacks.CallbackList):
      callbacks.callbacks.insert(0, counter)
      counter.set_model(self)
    else:
      bound.arguments["callbacks"] = [counter,
                                      *keras.tree.flatten(callbacks or [])]
    return fit(*bound.args, **bound.kwargs)

  return wrapper
