"""Runs one collective-watchdog case in a fresh process (an abort ends its collectives).

    python tests/watchdog_main.py CASE
    python tests/watchdog_main.py after_a_timeout CASE
    python -m replicator_strategy.cli.launch --workers 2 -- \
        python tests/watchdog_main.py uneven_steps rows

Prints one JSON line: {"error": ..., "message": ..., "seconds": ...} for a
case that fails as it should, {"samples": [...]} for the long runs.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import replicator_strategy as rs  # pylint: disable=g-import-not-at-top

rs.split_cpu(2)

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top


def replica_id():
  return tf.distribute.get_replica_context().replica_id_in_sync_group


def on_replica_0(then, otherwise):
  return lambda: tf.cond(tf.equal(replica_id(), 0), then, otherwise)


def all_reduce(op, shape=()):
  return lambda: tf.distribute.get_replica_context().all_reduce(
      op, tf.ones(shape))


CASES = {
    # Replica 0 all-reduces, replica 1 skips: replica 0 waits for ever.
    "stall": (2, on_replica_0(all_reduce("sum"), lambda: tf.ones(()))),
    "op_mismatch": (60, on_replica_0(all_reduce("sum"), all_reduce("max"))),
    "shape_mismatch": (60, on_replica_0(all_reduce("sum", [2]),
                                        lambda: all_reduce("sum", [3])()[:2])),
}


def run_case(name):
  timeout, fn = CASES[name]
  strategy = rs.ReplicatorStrategy(timeout_seconds=timeout)
  return outcome(tf.function(lambda: strategy.run(fn)))


def after_a_timeout(name):
  """The "stall" case, then case `name` in a new strategy, twice."""
  return {"stall": run_case("stall"), "first": run_case(name),
          "again": run_case(name)}


def uneven_steps(what):
  """Keras fit where worker 1 has more batches than worker 0.

  `what` differs: "rows" (worker 1 has 32 more) or "batch_size" (worker 1
  batches 8 rows, worker 0 16).
  """
  strategy = rs.ReplicatorStrategy(timeout_seconds=5)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
  worker = strategy.extended.cluster.worker_index
  rows = 64 + 32 * worker if what == "rows" else 64
  batch_size = 16 // (1 + worker) if what == "batch_size" else 16
  x = np.ones((rows, 4), "float32")
  data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(batch_size)
  return outcome(lambda: model.fit(data, epochs=2, verbose=0))


def outcome(fn):
  start = time.monotonic()
  try:
    fn()
  except tf.errors.OpError as e:
    return {"error": type(e).__name__, "message": e.message,
            "seconds": time.monotonic() - start}
  return {"error": None, "seconds": time.monotonic() - start}


def _sample():
  statm = open("/proc/self/statm").read().split()
  return {"threads": len(os.listdir("/proc/self/task")),
          "rss_mib": int(statm[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20}


def long_custom_loop(steps, every):
  """A collective inside tf.cond on every step."""
  strategy = rs.ReplicatorStrategy()

  def fn(x):
    ctx = tf.distribute.get_replica_context()
    return tf.cond(x > 0, lambda: ctx.all_reduce("sum", x), lambda: x)

  step = tf.function(lambda x: strategy.run(fn, args=(x,)))
  samples = []
  for i in range(steps):
    step(tf.constant(1.0))
    if (i + 1) % every == 0:
      samples.append(_sample())
  return samples


def long_fit(steps, every):
  """Keras fit with gradient_accumulation_steps=2: collectives inside tf.cond."""
  strategy = rs.ReplicatorStrategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01, gradient_accumulation_steps=2),
                  "mse")
  x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
  data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(8)
  samples = []

  class Sample(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      samples.append(_sample())

  model.fit(data, steps_per_epoch=every, epochs=steps // every, verbose=0,
            callbacks=[Sample()])
  return samples


if __name__ == "__main__":
  case = sys.argv[1]
  if case == "uneven_steps":
    result = uneven_steps(sys.argv[2])
  elif case == "after_a_timeout":
    result = after_a_timeout(sys.argv[2])
  elif case.startswith("long_"):
    result = {"samples": globals()[case](int(sys.argv[2]), int(sys.argv[3]))}
  else:
    result = run_case(case)
  print(json.dumps(result), flush=True)
