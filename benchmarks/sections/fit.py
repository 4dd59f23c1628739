"""Keras `fit` steady-state step time.

An MLP 784-512-512-10 and a small conv net with batch norm, global batch
256, on 1, 2 and 4 replicas; no strategy, MirroredStrategy and
ReplicatorStrategy interleaved round by round. Other sections time their
own models and contenders with `fit_rows`.
"""

import contextlib

import tensorflow as tf

from benchmarks import contenders
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from replicator_strategy.keras import random_layers

NAMES = ("none", "mirrored", "replicator")
# A contender "X, own draws" is X with Keras's random layers drawing each
# replica's own values (as MirroredStrategy does).
OWN_DRAWS = ", own draws"


def fit_rows(options, n, model_names=tuple(models.MODELS), names=NAMES,
             optimizer="sgd", section_name=None):
  """Keras fit step of each contender; a name "X+xla" is X with jit_compile.

  Each row is reported as it comes under `section_name` (default "fit").
  """
  rows = []
  for model_name in model_names:
    runs = _compiled_runs(options.size, n, model_name, names, optimizer)
    failed = _fit_rounds(options.size, model_name, runs)
    rows.append({
        "model": model_name, "replicas": n,
        "ms": {name: timing.median_ms(r["times"]) for name, r in runs.items()
               if name not in failed},
        "failed": failed,
        "agree": models.losses_agree(
            model_name, {k: r["losses"] for k, r in runs.items()
                         if k not in failed})})
    tables.progress(section_name or SECTION.name, rows[-1])
  return rows


def _compiled_runs(size, n, model_name, names, optimizer):
  weights = models.initial_weights(size, model_name)
  runs = {}
  for name in names:
    strategy_name, _, xla = name.removesuffix(OWN_DRAWS).partition("+")
    runs[name] = {
        "model": models.compiled(size, model_name,
                                 contenders.contender(strategy_name, n),
                                 weights, optimizer, jit_compile=bool(xla)),
        "times": [], "losses": [],
        "draws": (random_layers.drawn_per_replica if name.endswith(OWN_DRAWS)
                  else contextlib.nullcontext)}
  return runs


def _fit_rounds(size, model_name, runs):
  """Fits every run a warm-up round then `rounds` rounds; {name: error}."""
  x, y = models.data(size, model_name, size["fit_steps"])
  failed = {}
  for round_index in range(size["rounds"] + 1):
    for name, run in runs.items():
      if name in failed:
        continue
      timer = timing.StepTimer()
      try:
        with run["draws"]():
          history = run["model"].fit(
              x, y, batch_size=size["global_batch"], epochs=1,
              shuffle=False, verbose=0, callbacks=[timer])
      except (tf.errors.OpError, ValueError) as e:  # MirroredStrategy + XLA.
        failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        continue
      if round_index == 0:  # Warm-up: tracing; losses from equal weights.
        run["losses"] = history.history["loss"]
      else:  # A call's first step also makes the iterator: left out.
        run["times"] += timer.times[1:]
  return failed


SECTION = section.Section(
    name="fit", measures="Keras fit step, MLP and conv net, 1/2/4 replicas",
    per_replicas=fit_rows,
    table=lambda options, rows: tables.contender_table(
        "Keras fit step, ms (median)", rows))
