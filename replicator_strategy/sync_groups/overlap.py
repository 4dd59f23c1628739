"""An overlapped averaging round's exchange, in a thread beside the steps.

With `overlap_averaging=True` a round only snapshots the trainable weights
and starts their exchange between the sync groups in a thread
(`ExchangeInFlight`); the groups take their next steps meanwhile, and the
next round takes the means (`rounds.Averaging`, as Streaming DiLoCo does).

>>> in_flight = ExchangeInFlight()
>>> in_flight.start(("w",), lambda: [1.5])
>>> in_flight.in_flight, in_flight.take(("w",), lambda: [0.0])
(True, [1.5])
"""

import threading

import tensorflow as tf


class ExchangeInFlight(tf.train.experimental.PythonState):
  """An overlapped round's exchange, running in a thread until the next
  round takes its means.

  A checkpoint keeps whether one is in flight; its inputs, the snapshots,
  are variables beside it (`state.SyncGroupsState.snapshots`). Restored, the next
  round redoes the exchange from the restored snapshots: the same means, as
  if it had never stopped.
  """

  def __init__(self):
    self._thread = None
    self._result = {}
    self._key = None  # Ids of the variables it was started for.
    self._redo = False  # Restored in flight: redo it from the snapshots.

  @property
  def in_flight(self):
    return self._thread is not None or self._redo

  def start(self, key, exchange):
    """Runs `exchange` (returning the means) in a thread, for the variables
    with ids `key`."""
    result = {}

    def run():
      result["means"] = exchange()

    thread = threading.Thread(target=run, daemon=True,
                              name="sync_groups_exchange")
    thread.start()
    self._thread, self._result, self._key, self._redo = (
        thread, result, key, False)

  def take(self, key, exchange):
    """The exchange's means, once it is done (redone by `exchange` when it
    was restored in flight)."""
    thread, result, started_for = self._thread, self._result, self._key
    self._thread, self._key, self._redo = None, None, False
    if thread is None:
      return exchange()
    thread.join()
    if started_for != key:
      raise ValueError(
          "An overlapped averaging round was started for other variables "
          "than these; give every round the same variables.")
    return result["means"]

  def serialize(self):
    return "in flight" if self.in_flight else ""

  def deserialize(self, string_value):
    if self._thread is not None:
      self._thread.join()  # Its snapshots are being replaced: drop it.
    self._thread, self._key = None, None
    self._redo = bool(string_value)
