"""Multi-worker: 2 workers x 2 devices against one process x 4.

The MLP fit step under ReplicatorStrategy, plain, with bfloat16 gradient
compression and with gradient accumulation over 4 steps; with
accumulation, also each kind of step on its own (those that only
accumulate, those that all-reduce and update).
"""

import statistics

import keras

import replicator_strategy as rs
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

# Variants of the step: strategy arguments, optimizer arguments.
VARIANTS = {
    "plain": ({}, {}),
    "bfloat16": ({"gradient_compression": "bfloat16"}, {}),
    "accumulate 4": ({}, {"gradient_accumulation_steps": 4}),
}
WHERE = ("1 process x 4", "2 workers x 2")


def multi_on_workers(options):
  """In one process or a worker: every variant's result, by variant.

  One process runs them all, one after another (a worker joins its cluster
  once; each variant's strategy uses it in turn).
  """
  return {variant: _fit_step(options.size, variant) for variant in VARIANTS}


def _fit_step(size, variant):
  """The MLP fit step under `variant`, in ms.

  The mean step of each round (accumulation steps and update steps alike),
  median over rounds; with gradient accumulation also the median of each
  kind of step: those that only accumulate and those that all-reduce and
  update.
  """
  strategy_kwargs, optimizer_kwargs = VARIANTS[variant]
  strategy = rs.ReplicatorStrategy(**strategy_kwargs)
  x, y = models.data(size, "mlp", size["fit_steps"])
  with strategy.scope():
    model = models.mlp(size)
    model.set_weights(models.initial_weights(size, "mlp"))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9, **optimizer_kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  every = optimizer_kwargs.get("gradient_accumulation_steps")
  rounds, by_kind, steps_done = [], {"accumulate": [], "update": []}, 0
  first_loss = None
  for round_index in range(size["rounds"] + 1):
    timer = timing.StepTimer()
    history = model.fit(x, y, batch_size=size["global_batch"], epochs=1,
                        shuffle=False, verbose=0, callbacks=[timer])
    if round_index:
      rounds.append(statistics.mean(timer.times[1:]))
      for i, step_time in enumerate(timer.times[1:], start=steps_done + 1):
        if every:  # Keras updates where (iterations + 1) % every == 0.
          by_kind["update" if (i + 1) % every == 0 else "accumulate"].append(
              step_time)
    else:
      first_loss = history.history["loss"][0]
    steps_done += len(timer.times)
  result = {"ms": timing.median_ms(rounds), "first_loss": first_loss}
  if every:
    result["ms by kind"] = {kind: timing.median_ms(times)
                            for kind, times in by_kind.items() if times}
  return result


def multi_rows(options, single_run, worker_runs):
  """One row per variant: the one process's run against the workers'."""
  del options
  rows = []
  for variant in VARIANTS:
    single = single_run[variant]
    workers = [w[variant] for w in worker_runs]
    by_where = dict(zip(WHERE, ([single], workers)))
    row = {"variant": variant,
           "ms": {where: statistics.median(r["ms"] for r in results)
                  for where, results in by_where.items()},
           "ms by kind": {
               f"{kind}, {where}": statistics.median(
                   r["ms by kind"][kind] for r in results)
               for where, results in by_where.items()
               for kind in single.get("ms by kind", {})},
           # 16-bit sums differ from float32 ones by ~1e-3 relative.
           "agree": timing.agree([single["first_loss"]] +
                                 [w["first_loss"] for w in workers],
                                 rtol=1e-3)}
    tables.progress(SECTION.name, row)
    rows.append(row)
  return rows


def multi_table(options, rows):
  del options
  if not rows:
    return []
  one, two = WHERE
  plain = rows[0]["ms"][one]
  lines = ["", "Multi-worker fit step (MLP), ms per step (mean of a round, "
           "median of rounds)",
           f"{'variant':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2/1x4':>8} "
           f"{'2x2/1x4 plain':>14} agree"]
  for r in rows:
    ms = r["ms"]
    lines.append(
        f"{r['variant']:14} {ms[one]:>7.2f} {ms[two]:>7.2f} "
        f"{ms[two] / ms[one]:>8.2f} {ms[two] / plain:>14.2f} {r['agree']}")
  for r in rows:
    kinds = sorted({k.split(", ")[0] for k in r["ms by kind"]})
    if not kinds:
      continue
    lines += ["", f"{r['variant']}: each kind of step, ms (median): "
              f"accumulate = add the gradient to each replica's "
              f"accumulator, no gradient exchange; update = all-reduce and "
              f"update",
              f"{'step':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2/1x4':>8}"]
    for kind in kinds:
      a, b = (r["ms by kind"][f"{kind}, {where}"] for where in WHERE)
      lines.append(f"{kind:14} {a:>7.2f} {b:>7.2f} {b / a:>8.2f}")
  return lines


SECTION = section.Section(
    name="multi", measures="2 workers x 2 devices against 1 process x 4",
    on_workers=multi_on_workers, workers_rows=multi_rows, table=multi_table)
