"""Gradient all-reduce latency in replica context.

1, 16 and 64 MB, and 200 tensors of 4 KB, on 2 and 4 replicas, against the
floor: `add_n` of the same tensors on one device.
"""

import numpy as np
import tensorflow as tf

from benchmarks import contenders
from benchmarks import section
from benchmarks import tables
from benchmarks import timing


def _cases(size):
  """(label, tensors, bytes each)."""
  cases = [(f"{mb:g} MB", 1, int(mb * 2 ** 20)) for mb in size["allreduce_mb"]]
  count, each = size["allreduce_many"]
  unit = f"{each // 1024} KB" if each >= 1024 else f"{each} B"
  return cases + [(f"{count} x {unit}", count, each)]


def allreduce_rows(options, n):
  if n < 2:
    return []
  rows = []
  for label, count, size in _cases(options.size):
    per_device = [[tf.fill([size // 4], float(d + 1) + i / 1000.0)
                   for i in range(count)] for d in range(n)]
    with tf.device(contenders.devices()[0]):
      on_one = [[tf.identity(t) for t in ts] for ts in per_device]
    runs = {"add_n floor": _add_n_fn(on_one)}
    for name, strategy in contenders.contenders(n)[1:]:
      inputs = strategy.experimental_distribute_values_from_function(
          lambda ctx, p=per_device: [
              tf.identity(t) for t in p[ctx.replica_id_in_sync_group]])
      runs[name] = _all_reduce_fn(strategy, inputs)
    firsts = [np.asarray(fn()) for fn in runs.values()]  # Traces them too.
    times = timing.interleaved(runs, options.size["allreduce_repeats"])
    rows.append({"tensors": label, "replicas": n,
                 "ms": {k: timing.median_ms(v) for k, v in times.items()},
                 "agree": timing.agree(firsts, rtol=1e-6)})
    tables.progress(SECTION.name, rows[-1])
  return rows


def _add_n_fn(on_one):
  add = tf.function(lambda: [tf.add_n(list(ts)) for ts in zip(*on_one)])
  return lambda: add()[0]


def _all_reduce_fn(strategy, inputs):
  run = tf.function(lambda: strategy.run(
      lambda ts: tf.distribute.get_replica_context().all_reduce("sum", ts),
      (inputs,)))
  return lambda: strategy.experimental_local_results(run()[0])[-1]


def allreduce_table(options, rows):
  del options
  if not rows:
    return []
  lines = ["", "All-reduce in replica context, ms (median)",
           f"{'tensors':14} {'replicas':>8} {'add_n floor':>11} "
           f"{'mirrored':>9} {'replicator':>11} {'R/floor':>8} "
           f"{'M/floor':>8}  agree"]
  for r in rows:
    ms = r["ms"]
    floor = ms["add_n floor"]
    lines.append(
        f"{r['tensors']:14} {r['replicas']:>8} {floor:>11.2f} "
        f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
        f"{ms['replicator'] / floor:>8.2f} {ms['mirrored'] / floor:>8.2f}  "
        f"{r['agree']}")
  return lines


SECTION = section.Section(
    name="allreduce", measures="all-reduce latency against add_n on one device",
    per_replicas=allreduce_rows, table=allreduce_table)
