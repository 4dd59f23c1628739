"""A big embedding table, sharded by rows (lookups move only the rows used).

An Embedding model's fit step (lookup + update) with SGD and its weight
bytes per device and peak memory, at the most replicas, each contender
(no strategy, MirroredStrategy, ReplicatorStrategy, and "zero3": every
weight cut over the replicas) in a fresh process.
"""

import keras
import numpy as np

from benchmarks import contenders
from benchmarks import models
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

NAMES = ("none", "mirrored", "replicator", "zero3")


def embedding_child(options, spec):
  """In a child: fit steps of an Embedding model; times and bytes."""
  name, n = spec.split(":")
  size = options.size
  strategy = contenders.contender(name, int(n))
  rows, width = size["embedding"]
  with contenders.scope(strategy):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((size["embedding_ids"],), dtype="int32"),
        keras.layers.Embedding(rows, width),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
  batch = size["embedding_batch"]
  examples = batch * size["embedding_steps"]
  rng = np.random.default_rng(0)
  x = rng.integers(0, rows, size=(examples, size["embedding_ids"]),
                   dtype=np.int32)
  y = rng.normal(size=(examples, 1)).astype("float32")
  times, losses = [], []
  for _ in range(2):  # The first epoch traces.
    timer = timing.StepTimer()
    losses += model.fit(x, y, batch_size=batch, epochs=1, shuffle=False,
                        verbose=0, callbacks=[timer]).history["loss"]
    times = timer.times
  return {"ms": timing.median_ms(times), "losses": losses,
          "weight_bytes": models.bytes_by_device(model.weights),
          "peak_rss_mb": processes.peak_rss_mb()}


def embedding_rows(options):
  n = contenders.replica_counts()[-1]
  runs = {name: processes.child(options, SECTION.name, embedding_child,
                                f"{name}:{n}")
          for name in NAMES}
  rows, width = options.size["embedding"]
  row = {"replicas": n, "table_mb": rows * width * 4 / 2 ** 20,
         "ms": {name: r["ms"] for name, r in runs.items()},
         "weight_mb_per_device_max": {
             name: max(r["weight_bytes"].values()) / 2 ** 20
             for name, r in runs.items()},
         "peak_rss_mb": {name: r["peak_rss_mb"] for name, r in runs.items()},
         "agree": timing.agree([r["losses"] for r in runs.values()],
                               rtol=1e-4)}
  tables.progress(SECTION.name, row)
  return [row]


def embedding_table(options, rows):
  size = options.size
  lines = []
  for r in rows:
    rows_, width = size["embedding"]
    names = list(r["ms"])
    lines += ["", f"Embedding {rows_:,} x {width} ({r['table_mb']:.0f} MB), "
              f"SGD, {r['replicas']} replicas, global batch "
              f"{size['embedding_batch']} x {size['embedding_ids']} ids: fit "
              f"step (lookup + update) and weight MB per device",
              f"{'':22} " + " ".join(f"{n:>11}" for n in names) +
              f" {'Z3/mirrored':>11}"]
    for key, label, fmt in (("ms", "step ms (median)", ".2f"),
                            ("weight_mb_per_device_max",
                             "weights/device max", ".1f"),
                            ("peak_rss_mb", "peak RSS", ".0f")):
      v = r[key]
      lines.append(f"{label:22} " + tables.cells(v, names, 11, fmt) +
                   f" {v['zero3'] / v['mirrored']:>11.2f}")
    lines.append(f"losses agree {r['agree']}")
  return lines


SECTION = section.Section(
    name="embedding", measures="a big embedding table sharded by rows",
    fresh=embedding_rows, child=embedding_child, table=embedding_table)
