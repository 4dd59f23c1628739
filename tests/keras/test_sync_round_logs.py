"""Each epoch's logs of `fit` under sync groups count its averaging rounds.

`sync_rounds` and `sync_bytes` reach every callback's `on_epoch_end`,
`History` and Keras's epoch line (not at verbose=0), on 2 groups of 2
logical CPUs, with fragments too; without groups the logs are Keras's own.
"""

import contextlib
import io
import unittest

import keras
import numpy as np

import models
import topology
import replicator_strategy as rs

ROWS, GLOBAL_BATCH = 96, 16  # 6 steps an epoch.
# small_mlp's weights in bytes: 8 x 16 + 16, 16 x 3 + 3 floats.
FIRST_KERNEL, REST = 128 * 4, (16 + 48 + 3) * 4


def fit(strategy, verbose=0, callbacks=(), epochs=2):
  """`callbacks`: a list, or a function of the model giving them."""
  with strategy.scope():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(keras.optimizers.SGD(0.1), "mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8)).astype(np.float32)
  y = rng.normal(size=(ROWS, 3)).astype(np.float32)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs,
                        shuffle=False, verbose=verbose,
                        callbacks=(callbacks(model) if callable(callbacks)
                                   else callbacks))
  return history.history, out.getvalue()


class Seen(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.epochs = []

  def on_epoch_end(self, epoch, logs=None):
    self.epochs.append((logs["sync_rounds"], logs["sync_bytes"]))


class EpochLogsTest(unittest.TestCase):

  def test_every_callback_reads_the_epochs_rounds_and_bytes(self):
    seen = Seen()
    history, printed = fit(
        topology.strategy_over(4, sync_groups=2, average_every=4),
        callbacks=[seen])
    # Epoch 1: a round after step 4; epoch 2 after steps 8 and 12.
    whole = FIRST_KERNEL + REST
    self.assertEqual(seen.epochs, [(1, whole), (2, 2 * whole)])
    self.assertEqual(history["sync_rounds"], [1, 2])
    self.assertEqual(history["sync_bytes"], [whole, 2 * whole])
    self.assertEqual(printed, "")  # verbose=0

  def test_fragments_pay_for_their_own_weights(self):
    seen = Seen()
    strategy = topology.strategy_over(4, sync=rs.SyncGroups(
        groups=2, average_every=4, fragments=2))
    fit(strategy, epochs=1, callbacks=lambda model: keras.callbacks.CallbackList(
        [seen], add_history=True, model=model))
    # The rest at steps 2 and 6, the first kernel at step 4.
    self.assertEqual(seen.epochs, [(3, 2 * REST + FIRST_KERNEL)])

  def test_the_epoch_line_shows_them(self):
    for verbose in ("auto", 1, 2):
      with self.subTest(verbose=verbose):
        _, printed = fit(
            topology.strategy_over(4, sync_groups=2, average_every=2),
            verbose=verbose)
        self.assertEqual(printed.count("sync_rounds: 3.0000"), 2, printed)
        self.assertEqual(
            printed.count(f"sync_bytes: {3 * (FIRST_KERNEL + REST)}.0000"), 2)

  def test_no_counts_without_groups(self):
    history, _ = fit(topology.strategy_over(4), epochs=1)
    self.assertEqual(sorted(history), ["loss"])


if __name__ == "__main__":
  unittest.main()
