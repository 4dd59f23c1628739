"""Per-step cost with negligible compute.

A tiny model's (one Dense layer) fit step on 1, 2 and 4 replicas, and the
part of it that is input: a traced function that takes the iterator as its
argument (as Keras's step does), gets the next batch and sums each
replica's part; nothing else.
"""

import tensorflow as tf

from benchmarks import contenders
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import fit


def overhead_rows(options, n):
  return (fit.fit_rows(options, n, model_names=("tiny",),
                       section_name=SECTION.name) +
          [input_fetch(options.size, n)])


def input_fetch(size, n):
  """The input part of a fit step, alone (model "input fetch")."""
  x, _ = models.data(size, "tiny", size["fit_steps"])
  fetches, firsts = {}, {}
  for name, strategy in contenders.contenders(n):
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(
        size["global_batch"]).repeat()
    if strategy is None:
      fetch = tf.function(lambda it: [tf.reduce_sum(next(it))])
      iterator = iter(dataset)
    else:
      fetch = tf.function(
          lambda it, s=strategy: s.experimental_local_results(
              s.run(tf.reduce_sum, args=(next(it),))))
      iterator = iter(strategy.experimental_distribute_dataset(dataset))
    # Traces; the first batch.
    firsts[name] = sum(float(t) for t in fetch(iterator))
    fetches[name] = lambda f=fetch, it=iterator: f(it)
  times = timing.interleaved(fetches, size["rounds"], calls=size["fit_steps"])
  row = {"model": "input fetch", "replicas": n,
         "ms": {name: timing.median_ms(t) for name, t in times.items()},
         "failed": {},
         "agree": timing.agree(firsts.values(), rtol=1e-4)}
  tables.progress(SECTION.name, row)
  return row


def overhead_table(options, rows):
  if not rows:
    return []
  lines = ["", "Per-step overhead: fit step of one Dense layer "
           f"({options.size['image'] ** 2}x10), and its input fetch alone (the "
           "next batch from the iterator Keras passes to its step), ms "
           "(median)",
           f"{'part':12} {'replicas':>8} {'none':>8} {'mirrored':>9} "
           f"{'replicator':>11} {'R/none':>7} {'M/none':>7} "
           f"{'R/mirrored':>10}  agree"]
  for r in sorted(rows, key=lambda r: r["model"] != "tiny"):
    ms = r["ms"]
    part = "fit step" if r["model"] == "tiny" else r["model"]
    lines.append(
        f"{part:12} "
        f"{r['replicas']:>8} {ms['none']:>8.2f} {ms['mirrored']:>9.2f} "
        f"{ms['replicator']:>11.2f} {ms['replicator'] / ms['none']:>7.2f} "
        f"{ms['mirrored'] / ms['none']:>7.2f} "
        f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="overhead", measures="per-step overhead: a tiny model, input fetch",
    per_replicas=overhead_rows, table=overhead_table)
