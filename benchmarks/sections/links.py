"""Training over slow links: 2 workers x 2 on digits at several link rates.

An MLP trains on scikit-learn's digits (1797 8x8 images that ship with it,
split as keras_examples/digits.py splits them) on 2 workers x 2 devices under
the launcher, once per link rate (`replicator-launch --link-rate`: the
workers' loopback shaped into one simulated link), in each of the `VARIANTS`:
synchronous, local SGD (2 sync groups, a group per worker, averaging every 8
steps; also with the round's exchange overlapped with the next steps, and
with each group's change sent as int8), DiLoCo (every 32 steps, an outer
Nesterov step) and Streaming DiLoCo (the same in 4 fragments, each sent as
int8). Each variant reports its step time, the bytes that cross between the workers, its final
accuracy and the training time it takes to come within 0.5 points of the
synchronous run's final accuracy at the same rate.

--quick runs one tiny epoch of each variant in this process (4 devices, 2
groups; no launcher, no link): it checks that the pieces run, not timings.
"""

import json
import os
import statistics
import time

import keras
import numpy as np

import replicator_strategy as rs
from benchmarks import processes
from benchmarks import section
from benchmarks import tables

SIZES = {  # name: (full run, --quick)
    "hidden": (512, 16),
    "epochs": (20, 1),
    "global_batch": (64, 32),
    "train_rows": (1408, 64),  # 22 (2) steps an epoch, every batch full
}
RATES = (("unlimited", "1gbit", "100mbit"), ("unlimited",))
# "Reaches synchronous accuracy": within this of the synchronous run's final
# test accuracy at the same rate (0.5 points; 360 test digits).
WITHIN = 0.005


def _diloco_outer():
  return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


# Name: the strategy's `rs.SyncGroups`, made afresh for each run; one more
# row is one more entry.
VARIANTS = {
    "synchronous": rs.SyncGroups,
    "local SGD, H=8": lambda: rs.SyncGroups(groups=2, average_every=8),
    "local SGD, H=8, overlap": lambda: rs.SyncGroups(
        groups=2, average_every=8, overlap=True),
    "local SGD, H=8, int8": lambda: rs.SyncGroups(
        groups=2, average_every=8, outer_dtype="int8"),
    "DiLoCo, H=32": lambda: rs.SyncGroups(groups=2, average_every=32,
                                          outer_optimizer=_diloco_outer()),
    "streaming, H=32, F=4, int8": lambda: rs.SyncGroups(
        groups=2, average_every=32, outer_optimizer=_diloco_outer(),
        fragments=4, outer_dtype="int8"),
}


def _sizes(options):
  return {k: v[int(options.quick)] for k, v in SIZES.items()}


def _digits(size):
  """(x_train, y_train, x_test, y_test): float32 rows of 64 pixels in [0, 1]."""
  # pylint: disable=g-import-not-at-top
  from sklearn import datasets
  from sklearn import model_selection
  # pylint: enable=g-import-not-at-top
  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype("float32")
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
  rows = size["train_rows"]
  return x_train[:rows], y_train[:rows], x_test, y_test


def _mlp(size):
  h = size["hidden"]
  return keras.Sequential([
      keras.Input((64,)), keras.layers.Dense(h, activation="relu"),
      keras.layers.Dense(h, activation="relu"), keras.layers.Dense(10)])


class _EpochEnds(keras.callbacks.Callback):
  """Each epoch's end: seconds since `fit` began and the weights this worker
  holds (its group's, between rounds); each step's seconds."""

  def __init__(self):
    super().__init__()
    self.start, self.ends, self.weights, self.steps = None, [], [], []
    self._step_start = None

  def on_train_begin(self, logs=None):
    self.start = time.perf_counter()

  def on_train_batch_begin(self, batch, logs=None):
    self._step_start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.steps.append(time.perf_counter() - self._step_start)

  def on_epoch_end(self, epoch, logs=None):
    self.ends.append(time.perf_counter() - self.start)
    self.weights.append(self.model.get_weights())


def _accuracy(weights, x, y):
  """Test accuracy of the MLP's `weights`, in NumPy: nothing to trace and
  nothing exchanged."""
  *hidden, (kernel, bias) = zip(weights[::2], weights[1::2])
  for w, b in hidden:
    x = np.maximum(x @ w + b, 0)
  return float(np.mean(np.argmax(x @ kernel + bias, -1) == y))


def train(options, variant):
  """One variant's run: the step's ms (median of the epochs' mean steps,
  the first, which traces, left out), seconds and test accuracy at each
  epoch's end, the final accuracy and the bytes between the groups."""
  size = _sizes(options)
  x, y, x_test, y_test = _digits(size)
  keras.utils.set_random_seed(0)
  strategy = rs.ReplicatorStrategy(sync=VARIANTS[variant]())
  with strategy.scope():
    model = _mlp(size)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  ends = _EpochEnds()
  model.fit(x, y, batch_size=size["global_batch"], epochs=size["epochs"],
            shuffle=False, verbose=0, callbacks=[ends])
  steps = len(x) // size["global_batch"]
  per_epoch = [statistics.mean(ends.steps[e * steps:(e + 1) * steps])
               for e in range(size["epochs"])]
  # The first step traces: count it as a median one.
  traced = ends.steps[0] - statistics.median(ends.steps)
  if strategy.num_sync_groups == 1:
    between = sum(w.size * 4 for w in model.get_weights()) * len(ends.steps)
  else:
    between = strategy.averaging.bytes_averaged
  return {"ms": 1000 * statistics.median(per_epoch[1:] or per_epoch),
          "seconds": [end - traced for end in ends.ends],
          "accuracy": [_accuracy(w, x_test, y_test) for w in ends.weights],
          "final_accuracy": _accuracy(model.get_weights(), x_test, y_test),
          "bytes": between, "steps": len(ends.steps)}


def links_child(options, spec):
  """In a worker (or, --quick, this process): its task index and every
  variant's run, by name."""
  del spec  # The rate: the launcher shaped the link already.
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  return {"worker": task.get("index", 0),
          "runs": {variant: train(options, variant) for variant in VARIANTS}}


def to_accuracy(run, target):
  """Seconds and steps until an epoch's end first scores `target` (None,
  None if none does)."""
  epoch = next((e for e, a in enumerate(run["accuracy"]) if a >= target),
               None)
  if epoch is None:
    return {"seconds_to_sync_accuracy": None, "steps_to_sync_accuracy": None}
  return {"seconds_to_sync_accuracy": run["seconds"][epoch],
          "steps_to_sync_accuracy":
              (epoch + 1) * run["steps"] // len(run["accuracy"])}


def links_rows(options):
  """One row per rate and variant, from the chief's results."""
  rows = []
  for rate in RATES[int(options.quick)]:
    if options.quick:
      runs = processes.child(options, SECTION.name, links_child, rate)["runs"]
    else:
      flags = () if rate == "unlimited" else ("--link-rate", rate)
      runs, = [w["runs"] for w in processes.on_two_workers(
          options, SECTION.name, rate, launcher_flags=flags)
               if w["worker"] == 0]
    target = runs["synchronous"]["final_accuracy"] - WITHIN
    for variant, run in runs.items():
      row = {"rate": rate, "variant": variant, "ms": run["ms"],
             **to_accuracy(run, target),
             "final_accuracy": run["final_accuracy"],
             "mb_between_workers": run["bytes"] / 1e6, "steps": run["steps"],
             "seconds": run["seconds"], "accuracy": run["accuracy"]}
      tables.progress(SECTION.name, {k: v for k, v in row.items()
                                     if k not in ("seconds", "accuracy")})
      rows.append(row)
  return rows


def _ratio(value, reference):
  if value is None or not reference:
    return f"{'-':>6}"
  return f"{value / reference:>6.2f}"


def links_table(options, rows):
  """One line per rate and variant; each ratio against synchronous at the
  same rate and against the same variant unlimited."""
  del options
  if not rows:
    return []
  by = {(r["rate"], r["variant"]): r for r in rows}
  lines = ["", "Slow links (simulated: one shaped loopback), digits MLP on 2 "
           "workers x 2: step ms (median of epochs), seconds and steps to "
           "synchronous accuracy - 0.5 points, final accuracy, MB between "
           "workers",
           f"{'rate':>9} {'variant':30} {'ms':>7} {'/sync':>6} {'/unl':>6} "
           f"{'to acc s':>8} {'/sync':>6} {'/unl':>6} {'steps':>6} {'acc':>6} "
           f"{'MB':>8}"]
  for r in rows:
    sync = by[(r["rate"], "synchronous")]
    unlimited = by.get(("unlimited", r["variant"]), r)
    to_acc = r["seconds_to_sync_accuracy"]
    lines.append(
        f"{r['rate']:>9} {r['variant']:30} {r['ms']:>7.1f} "
        f"{_ratio(r['ms'], sync['ms'])} {_ratio(r['ms'], unlimited['ms'])} "
        f"{'never' if to_acc is None else f'{to_acc:.1f}':>8} "
        f"{_ratio(to_acc, sync['seconds_to_sync_accuracy'])} "
        f"{_ratio(to_acc, unlimited['seconds_to_sync_accuracy'])} "
        f"{r['steps_to_sync_accuracy'] or '-':>6} "
        f"{r['final_accuracy']:>6.4f} {r['mb_between_workers']:>8.1f}")
  return lines


SECTION = section.Section(
    name="links",
    measures="digits to synchronous accuracy on 2 workers x 2 over "
    "simulated links (unlimited, 1gbit, 100mbit): sync, local SGD, DiLoCo, streaming",
    fresh=links_rows, child=links_child, table=links_table)
