"""Sync groups across workers: 2 workers x 2 devices against one process x 4.

The MLP fit step, synchronous and in 2 sync groups averaging every H = 1, 8
and 32 steps (on 2 workers x 2, a group per worker), each with and without
`overlap_averaging` (the round's exchange in a thread beside the next H
steps), and the bytes that go between the workers per step: a synchronous
step all-reduces the gradients over every replica, a sync group's step only
within its group, and a round all-reduces one copy of the weights every H
steps. A `fit` of one epoch traces the step and the round (`fit` ends with
one); a `fit` of `rounds` epochs is timed. `--share-cores` gives each worker
TensorFlow threads for half the cores.
"""

import statistics

import keras

import replicator_strategy as rs
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

# Variants: name -> sync_groups, average_every, overlap_averaging.
VARIANTS = {"sync": (1, 1, False)}
VARIANTS.update({
    f"2 groups, H={h}{', overlap' if overlap else ''}": (2, h, overlap)
    for h in (1, 8, 32) for overlap in (False, True)})
WHERE = ("1 process x 4", "2 workers x 2")


def groups_on_workers(options):
  """In one process or a worker: every variant's result, by variant."""
  return {variant: _fit_step(options.size, *VARIANTS[variant])
          for variant in VARIANTS}


def _fit_step(size, sync_groups, average_every, overlap):
  """The MLP fit step in ms (median of the timed epochs' mean steps), the
  bytes between groups per step, and the last epoch's loss."""
  strategy = rs.ReplicatorStrategy(sync_groups=sync_groups,
                                   average_every=average_every,
                                   overlap_averaging=overlap)
  x, y = models.data(size, "mlp", size["fit_steps"])
  with strategy.scope():
    model = models.mlp(size)
    model.set_weights(models.initial_weights(size, "mlp"))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=size["global_batch"], epochs=1, shuffle=False,
            verbose=0)
  traced_bytes = strategy.averaging.bytes_averaged
  timer = timing.StepTimer()
  epochs, steps = size["rounds"], size["fit_steps"]
  history = model.fit(x, y, batch_size=size["global_batch"], epochs=epochs,
                      shuffle=False, verbose=0, callbacks=[timer])
  per_epoch = [statistics.mean(timer.times[e * steps:(e + 1) * steps])
               for e in range(epochs)]
  if sync_groups == 1:
    # Every step's gradients, over every replica.
    between = sum(w.size * 4 for w in model.get_weights())
  else:
    between = ((strategy.averaging.bytes_averaged - traced_bytes) /
               (epochs * steps))
  return {"ms": timing.median_ms(per_epoch), "bytes per step": between,
          "last_loss": history.history["loss"][-1]}


def groups_rows(options, single_run, worker_runs):
  """One row per variant: the one process's run against the workers'."""
  del options
  rows = []
  for variant in VARIANTS:
    single = single_run[variant]
    workers = [w[variant] for w in worker_runs]
    row = {"variant": variant,
           "ms": {WHERE[0]: single["ms"],
                  WHERE[1]: statistics.median(w["ms"] for w in workers)},
           "bytes per step": single["bytes per step"],
           # The workers agree with each other (one model after fit).
           "agree": timing.agree([w["last_loss"] for w in workers],
                                 rtol=1e-5)}
    tables.progress(SECTION.name, row)
    rows.append(row)
  return rows


def groups_table(options, rows):
  del options
  if not rows:
    return []
  one, two = WHERE
  sync = rows[0]["ms"][one]
  lines = ["", "Sync groups, MLP fit step: ms per step (median of epochs), "
           "bytes all-reduced between the workers per step",
           f"{'variant':25} {'1 x 4':>7} {'2 x 2':>7} {'2x2/1x4':>8} "
           f"{'2x2/1x4 sync':>13} {'bytes/step':>11} agree"]
  for r in rows:
    ms = r["ms"]
    lines.append(
        f"{r['variant']:25} {ms[one]:>7.2f} {ms[two]:>7.2f} "
        f"{ms[two] / ms[one]:>8.2f} {ms[two] / sync:>13.2f} "
        f"{r['bytes per step']:>11.0f} {r['agree']}")
  return lines


SECTION = section.Section(
    name="sync_groups",
    measures="sync groups (H = 1, 8, 32): 2 workers x 2 against 1 process x 4",
    on_workers=groups_on_workers, workers_rows=groups_rows,
    table=groups_table)
