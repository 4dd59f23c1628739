"""First-epoch time (tracing included) and peak memory.

The MLP's first fit epoch at the most replicas, each contender in fresh
processes (the median of `first_epoch_runs`).
"""

import statistics
import time

from benchmarks import contenders
from benchmarks import models
from benchmarks import processes
from benchmarks import section
from benchmarks import tables

NAMES = ("none", "mirrored", "replicator")
KEYS = ("first_epoch_s", "peak_rss_mb")


def first_child(options, spec):
  """In a child: one fit epoch of the MLP; seconds and peak RSS."""
  name, n = spec.split(":")
  size = options.size
  strategy = contenders.contender(name, int(n))
  weights = models.initial_weights(size, "mlp")
  x, y = models.data(size, "mlp", size["fit_steps"])
  start = time.perf_counter()
  model = models.compiled(size, "mlp", strategy, weights)
  model.fit(x, y, batch_size=size["global_batch"], epochs=1, verbose=0)
  return {"first_epoch_s": time.perf_counter() - start,
          "peak_rss_mb": processes.peak_rss_mb()}


def first_rows(options):
  n = contenders.replica_counts()[-1]
  runs = {name: [] for name in NAMES}
  for _ in range(options.size["first_epoch_runs"]):
    for name, results in runs.items():  # A fresh process each.
      results.append(processes.child(options, SECTION.name, first_child,
                                     f"{name}:{n}"))
  row = {"replicas": n, "runs": options.size["first_epoch_runs"]}
  for key in KEYS:
    row[key] = {name: statistics.median(r[key] for r in results)
                for name, results in runs.items()}
  tables.progress(SECTION.name, row)
  return [row]


def first_table(options, rows):
  del options
  lines = []
  for r in rows:
    lines += ["", f"First epoch (tracing included) and peak memory, MLP, "
              f"{r['replicas']} replicas, median of {r['runs']} fresh "
              f"processes each",
              f"{'':12} {'none':>8} {'mirrored':>9} {'replicator':>11}"]
    for key, unit in zip(KEYS, ("s", "M")):
      v = r[key]
      lines.append(f"{key:12} {v['none']:>7.1f}{unit} "
                   f"{v['mirrored']:>8.1f}{unit} {v['replicator']:>10.1f}"
                   f"{unit}")
  return lines


SECTION = section.Section(
    name="first", measures="first epoch and peak memory, fresh processes",
    fresh=first_rows, child=first_child, table=first_table)
