"""Sharded optimizer state, and weights too, at the most replicas.

Optimizer-state and weight bytes per device and peak resident memory for an
MLP of 50 M parameters with Adam, under MirroredStrategy,
ReplicatorStrategy, ReplicatorStrategy with shard_optimizer_state=True
("sharded") and with every weight cut over the replicas too ("zero3"),
each in a fresh process; and the MLP fit step (SGD with momentum, and Adam)
of those four, side by side.
"""

import keras
import numpy as np

from benchmarks import contenders
from benchmarks import models
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import fit

NAMES = ("mirrored", "replicator", "sharded", "zero3")
# (key in a child's result, label in the memory table)
MEMORY_ROWS = (("optimizer_mb_per_device_max", "optimizer/device max"),
               ("optimizer_mb_total", "optimizer, all devices"),
               ("weight_mb_per_device_max", "weights/device max"),
               ("weight_mb_total", "weights, all devices"),
               ("peak_rss_mb", "peak RSS"))


def fit_step_rows(options, n):
  """In-process part: the MLP fit step, state sharded or not."""
  if not contenders.at_most_replicas(n):
    return []
  rows = []
  for optimizer in models.OPTIMIZERS:
    row = fit.fit_rows(options, n, model_names=("mlp",), names=NAMES,
                       optimizer=optimizer, section_name=SECTION.name)[0]
    rows.append(dict(row, measure="fit step", optimizer=optimizer))
  return rows


def big_mlp(size):
  inputs, width, layers = size["big_mlp"]
  return keras.Sequential(
      [keras.Input((inputs,))] +
      [keras.layers.Dense(width, activation="relu") for _ in range(layers)] +
      [keras.layers.Dense(10)])


def memory_child(options, spec):
  """In a child: the big MLP with Adam under one strategy; its bytes.

  Builds the model and the optimizer, then fits a few steps of a small
  batch; the peak resident memory is the whole process's.
  """
  name, n = spec.split(":")
  size = options.size
  strategy = contenders.contender(name, int(n))
  with strategy.scope():
    keras.utils.set_random_seed(0)  # The same weights under every strategy.
    model = big_mlp(size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
  optimizer_bytes = models.bytes_by_device(model.optimizer.variables)
  weight_bytes = models.bytes_by_device(model.weights)
  rng = np.random.default_rng(0)
  rows = size["big_mlp_batch"] * size["big_mlp_steps"]
  x = rng.normal(size=(rows, size["big_mlp"][0])).astype("float32")
  y = rng.integers(0, 10, size=rows).astype("int32")
  history = model.fit(x, y, batch_size=size["big_mlp_batch"], epochs=1,
                      shuffle=False, verbose=0)
  return {"params": model.count_params(),
          "optimizer_bytes": optimizer_bytes, "weight_bytes": weight_bytes,
          "peak_rss_mb": processes.peak_rss_mb(),
          "loss": history.history["loss"]}


def memory_rows(options):
  """Fresh-process part: one child per contender, so peaks don't mix."""
  n = contenders.replica_counts()[-1]
  runs = {name: processes.child(options, SECTION.name, memory_child,
                                f"{name}:{n}")
          for name in NAMES}
  params = runs["mirrored"]["params"]
  row = {"measure": "memory", "replicas": n, "params": params,
         "adam_slot_mb": params * 4 / 2 ** 20,
         "agree": timing.agree([r["loss"] for r in runs.values()], rtol=1e-4)}
  for key in ("optimizer_bytes", "weight_bytes"):
    row[key.replace("bytes", "mb_per_device_max")] = {
        name: max(r[key].values()) / 2 ** 20 for name, r in runs.items()}
    row[key.replace("bytes", "mb_total")] = {
        name: sum(r[key].values()) / 2 ** 20 for name, r in runs.items()}
    row[key.replace("bytes", "devices")] = {
        name: len(r[key]) for name, r in runs.items()}
  row["peak_rss_mb"] = {name: r["peak_rss_mb"] for name, r in runs.items()}
  tables.progress(SECTION.name, row)
  return [row]


def sharding_table(options, rows):
  """The section's two tables: memory, then fit step."""
  size = options.size
  lines = []
  header = (f"{'':22} " + " ".join(f"{n:>11}" for n in NAMES) +
            f" {'S/mirrored':>10} {'Z3/mirrored':>11}")
  for r in (r for r in rows if r["measure"] == "memory"):
    inputs, width, layers = size["big_mlp"]
    lines += ["", f"Sharded state (sharded) and weights too (zero3): MLP "
              f"{inputs}-{width}x{layers}-10 ({r['params'] / 1e6:.1f} M "
              f"parameters), Adam, {r['replicas']} replicas, global batch "
              f"{size['big_mlp_batch']}, MB (each contender in a fresh "
              f"process; one Adam slot = {r['adam_slot_mb']:.1f} MB)", header]
    for key, label in MEMORY_ROWS:
      v = r[key]
      lines.append(f"{label:22} {tables.cells(v, NAMES, 11, '.1f')} "
                   f"{v['sharded'] / v['mirrored']:>10.2f} "
                   f"{v['zero3'] / v['mirrored']:>11.2f}")
    rss = r["peak_rss_mb"]
    lines.append(f"{'peak RSS - mirrored':22} " + tables.cells(
        {n: rss[n] - rss["mirrored"] for n in NAMES}, NAMES, 11, ".1f") +
                 f"   losses agree {r['agree']}")
  fit_rows = [r for r in rows if r["measure"] == "fit step"]
  if fit_rows:
    lines += ["", f"Keras fit step, sharded state / weights, MLP, "
              f"{fit_rows[0]['replicas']} replicas, ms (median)",
              f"{'optimizer':22} " + " ".join(f"{n:>11}" for n in NAMES) +
              f" {'S/mirrored':>10} {'Z3/mirrored':>11}  agree"]
    for r in fit_rows:
      ms = r["ms"]
      lines.append(
          f"{r['optimizer']:22} {tables.cells(ms, NAMES, 11)} "
          f"{ms['sharded'] / ms['mirrored']:>10.2f} "
          f"{ms['zero3'] / ms['mirrored']:>11.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="sharding", measures="sharded optimizer state and weights: memory, "
    "fit step",
    per_replicas=fit_step_rows, fresh=memory_rows, child=memory_child,
    table=sharding_table)
