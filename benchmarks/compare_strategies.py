"""ReplicatorStrategy vs MirroredStrategy vs no strategy, side by side in one run.

    python benchmarks/compare_strategies.py                # the full run
    python benchmarks/compare_strategies.py --quick        # tiny sizes, seconds
    python benchmarks/compare_strategies.py --json out.json

For each replica count, every contender runs in the same process on the same
logical devices (the CPU split into 4 unless GPUs exist), interleaved round by
round so that machine noise hits all of them alike; the table shows medians and
ratios. (Each replica count gets its own process: MirroredStrategy's collective
keys clash between instances over different device counts.)

1. Keras `fit` steady-state step time: MLP 784-512-512-10 and a small conv net
   with batch norm, global batch 256, on 1, 2 and 4 replicas.
2. Custom-loop (GradientTape) step time, same models.
3. Gradient all-reduce latency in replica context (1, 16, 64 MB; 200 tensors of
   4 KB) on 2 and 4 replicas, against the floor: `add_n` of the same tensors on
   one device.
4. First-epoch time (tracing included) and peak memory, each contender in
   fresh processes (the median of three).
5. Multi-worker: 2 workers x 2 devices against one process x 4 (fit step).
6. Where the MLP custom-loop step's time goes, at the most replicas: forward,
   then adding backward, the gradient all-reduce, and the optimizer update;
   with one more contender, "sharded" (ReplicatorStrategy with
   shard_optimizer_state=True), whose update reduce-scatters the gradients,
   updates 1/N of every slot per replica and all-gathers the weights.
7. Sharded optimizer state, at the most replicas: optimizer-state and weight
   bytes per device and peak resident memory for an MLP of 50 M parameters
   with Adam, MirroredStrategy, ReplicatorStrategy and ReplicatorStrategy
   with shard_optimizer_state=True each in a fresh process; and the MLP fit
   step (SGD with momentum, and Adam) of those three, side by side.
9. Random layers, at the most replicas: the fit step of a conv net with
   Dropout(0.5) and of an image model with RandomFlip + RandomRotation, with
   each replica drawing its rows of one device's random values (the
   default, "replicator") and as Keras alone draws them ("own draws": each
   replica its batch's first rows, as MirroredStrategy does).
8. `ReplicaContext.reduce_scatter` against `all_reduce` of the same 16 MB
   tensor on 2 and 4 replicas, through merge_call and inside a `tf.cond`
   (run-time collectives). MirroredStrategy has no reduce_scatter in replica
   context and refuses a collective inside `tf.cond`, so its merge_call
   all_reduce of the same tensor stands beside ours as the reference.

Every contender starts from the same weights and data; the run also checks
that their losses and all-reduce results agree ("agree" column).
"""

import argparse
import contextlib
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

SIZES = {  # name: (full run, --quick)
    "mlp_hidden": (512, 16),
    # The update section's MLP widths: the benchmark MLP's, then wider, to
    # show how the update's fixed costs per weight weigh as weights grow.
    "update_hidden": ((512, 1024, 2048), (16, 32)),
    "conv_filters": (16, 4),
    "image": (28, 8),
    "global_batch": (256, 32),
    "fit_steps": (20, 3),
    "rounds": (5, 2),
    "allreduce_mb": ((1, 16, 64), (0.0625,)),
    "allreduce_many": ((200, 4096), (10, 256)),  # tensors, bytes each
    "allreduce_repeats": (15, 3),
    "reduce_scatter_mb": (16, 0.0625),
    "first_epoch_runs": (3, 1),  # fresh processes per contender
    # The memory-bound MLP: input, hidden width, hidden layers; 50.4 M
    # parameters in full (192 MiB a copy in float32).
    "big_mlp": ((4096, 4096, 3), (64, 64, 2)),
    "big_mlp_batch": (16, 8),  # global; small, so that the state dominates
    "big_mlp_steps": (3, 2),
    # The embedding table: rows x width (512 MB in full), ids per example,
    # global batch, timed steps.
    "embedding": ((2_000_000, 64), (2_000, 8)),
    "embedding_ids": (8, 4),
    "embedding_batch": (256, 32),
    "embedding_steps": (20, 3),
}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes: checks that everything runs and agrees")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--devices", type=int, default=4,
                      help="logical CPU devices when there is no GPU (default 4)")
  parser.add_argument("--sections",
                      default="fit,custom,allreduce,reducescatter,parts,"
                      "update,first,multi,exchange,sharding,embedding,xla,"
                      "overhead,random",
                      help="comma-separated subset of fit,custom,allreduce,"
                      "reducescatter,parts,update,first,multi,exchange,"
                      "sharding,embedding,xla,overhead,random")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


ARGS = parse_args()
Q = 1 if ARGS.quick else 0
SIZE = {k: v[Q] for k, v in SIZES.items()}

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf
import keras
import replicator_strategy as rs
from replicator_strategy.keras import random_layers
# pylint: enable=g-import-not-at-top,wrong-import-position

if not tf.config.list_physical_devices("GPU"):
  rs.split_cpu(ARGS.devices)


@functools.cache
def devices():
  """The local devices (listing them starts TF: a worker joins its cluster first)."""
  return rs.local_devices()


def replica_counts():
  return [n for n in (1, 2, 4) if n <= len(devices())]


# Contenders.

@functools.cache
def contenders(num_replicas):
  """(name, strategy or None) for one replica count; no strategy is 1 device.

  Made once per process: several MirroredStrategy instances over the same
  devices reuse collective keys and break each other.
  """
  chosen = list(devices()[:num_replicas])
  return [("none", None),
          ("mirrored", tf.distribute.MirroredStrategy(chosen)),
          ("replicator", rs.ReplicatorStrategy(devices=chosen))]


@functools.cache
def sharded(num_replicas):
  """ReplicatorStrategy with shard_optimizer_state=True (one per process)."""
  return rs.ReplicatorStrategy(devices=list(devices()[:num_replicas]),
                               shard_optimizer_state=True)


@functools.cache
def zero3(num_replicas):
  """ReplicatorStrategy with every weight and its state cut over the replicas."""
  return rs.ReplicatorStrategy(
      devices=list(devices()[:num_replicas]), shard_optimizer_state=True,
      variable_partitioner=(
          tf.distribute.experimental.partitioners.FixedShardsPartitioner(
              num_replicas)))


def contender(name, num_replicas):
  """The strategy named `name`: one of `contenders`, "sharded" or "zero3"."""
  if name == "sharded":
    return sharded(num_replicas)
  if name == "zero3":
    return zero3(num_replicas)
  return dict(contenders(num_replicas))[name]


def scope(strategy):
  return strategy.scope() if strategy else tf.device(devices()[0])


# Models and data.

def mlp(h=None):
  h = h or SIZE["mlp_hidden"]
  return keras.Sequential([
      keras.Input((SIZE["image"] ** 2,)),
      keras.layers.Dense(h, activation="relu"),
      keras.layers.Dense(h, activation="relu"),
      keras.layers.Dense(10)])


def convnet():
  f = SIZE["conv_filters"]
  s = SIZE["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.Conv2D(f, 3, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.Conv2D(2 * f, 3, strides=2, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10)])


def tiny():
  """One small Dense layer: its step time is the per-step overhead."""
  return keras.Sequential([keras.Input((SIZE["image"] ** 2,)),
                           keras.layers.Dense(10)])


def dropout_convnet():
  """The keras-io MNIST conv net (filters scaled like `convnet`'s, "same"
  padding so that the quick run's 8x8 images fit)."""
  f = SIZE["conv_filters"]
  s = SIZE["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.Conv2D(2 * f, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(2),
      keras.layers.Conv2D(4 * f, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(2),
      keras.layers.Flatten(),
      keras.layers.Dropout(0.5),
      keras.layers.Dense(10)])


def augmented():
  """RandomFlip + RandomRotation in front of a small conv net."""
  f = SIZE["conv_filters"]
  s = SIZE["image"]
  return keras.Sequential([
      keras.Input((s, s, 1)),
      keras.layers.RandomFlip(),
      keras.layers.RandomRotation(0.1),
      keras.layers.Conv2D(f, 3, strides=2, activation="relu"),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10)])


MODELS = {"mlp": mlp, "convnet": convnet}
RANDOM_MODELS = {"dropout": dropout_convnet, "augmented": augmented}
ALL_MODELS = {**MODELS, "tiny": tiny, **RANDOM_MODELS}
# Batch norm normalises each replica's share of the batch (under either
# strategy), so only the strategies agree with each other there.
PER_REPLICA_STATISTICS = ("convnet",)


def losses_agree(model_name, losses):
  """Contenders' losses agree (with no strategy only where it can)."""
  names = [name for name in losses if not name.startswith("none") or
           model_name not in PER_REPLICA_STATISTICS]
  if model_name in RANDOM_MODELS:  # Only these draw one device's values.
    names = [name for name in names if name in ("none", "replicator")]
  return agree((losses[name] for name in names), rtol=1e-4)


def data(model_name, batches):
  rng = np.random.default_rng(0)
  s = SIZE["image"]
  shape = ((s, s, 1) if model_name in ("convnet", *RANDOM_MODELS)
           else (s * s,))
  rows = SIZE["global_batch"] * batches
  x = rng.normal(size=(rows,) + shape).astype("float32")
  y = rng.integers(0, 10, size=rows).astype("int32")
  return x, y


def initial_weights(model_name):
  keras.utils.set_random_seed(0)
  return ALL_MODELS[model_name]().get_weights()


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-3)}


def compiled(model_name, strategy, weights, optimizer="sgd", jit_compile=False):
  if model_name in RANDOM_MODELS:  # Every contender's layers: the same seeds.
    keras.utils.set_random_seed(0)
  with scope(strategy):
    model = ALL_MODELS[model_name]()
    model.set_weights(weights)
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile)
  return model


# Timing helpers.

class StepTimer(keras.callbacks.Callback):
  """Wall time of each training step (the step function returns when done)."""

  def __init__(self):
    super().__init__()
    self.times = []
    self._start = None

  def on_train_batch_begin(self, batch, logs=None):
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter() - self._start)


def median_ms(times):
  return 1000 * statistics.median(times)


def agree(values, rtol):
  """Whether every value is within `rtol` of the first."""
  values = list(values)
  ref = np.asarray(values[0], dtype="float64")
  return all(np.allclose(np.asarray(v, dtype="float64"), ref, rtol=rtol,
                         atol=rtol) for v in values[1:])


# 1. Keras fit.

def bench_fit(n, model_names=tuple(MODELS), names=("none", "mirrored",
                                                    "replicator"),
              optimizer="sgd", section="fit"):
  """Keras fit step of each contender; a name "X+xla" is X with jit_compile."""
  rows = []
  for model_name in model_names:
    weights = initial_weights(model_name)
    x, y = data(model_name, SIZE["fit_steps"])
    runs = {}
    for name in names:
      strategy_name, _, xla = name.removesuffix(OWN_DRAWS).partition("+")
      runs[name] = {"model": compiled(model_name, contender(strategy_name, n),
                                      weights, optimizer, jit_compile=bool(xla)),
                    "times": [], "losses": [],
                    "draws": (random_layers.drawn_per_replica
                              if name.endswith(OWN_DRAWS) else
                              contextlib.nullcontext)}
    failed = {}
    for round_index in range(SIZE["rounds"] + 1):
      for name, run in runs.items():
        if name in failed:
          continue
        timer = StepTimer()
        try:
          with run["draws"]():
            history = run["model"].fit(
                x, y, batch_size=SIZE["global_batch"], epochs=1,
                shuffle=False, verbose=0, callbacks=[timer])
        except (tf.errors.OpError, ValueError) as e:  # MirroredStrategy + XLA.
          failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
          continue
        if round_index == 0:  # Warm-up: tracing; losses from equal weights.
          run["losses"] = history.history["loss"]
        else:  # A call's first step also makes the iterator: left out.
          run["times"] += timer.times[1:]
    rows.append({
        "model": model_name, "replicas": n,
        "ms": {name: median_ms(r["times"]) for name, r in runs.items()
               if name not in failed},
        "failed": failed,
        "agree": losses_agree(
            model_name, {k: r["losses"] for k, r in runs.items()
                         if k not in failed})})
    print_progress(section, rows[-1])
  return rows


def bench_xla(n):
  """jit_compile=True against not, for each contender, at the most replicas."""
  if n != replica_counts()[-1]:
    return []
  return bench_fit(n, names=[f"{name}{xla}" for name in ("none", "mirrored",
                                                         "replicator")
                             for xla in ("", "+xla")], section="xla")


OWN_DRAWS = ", own draws"


def bench_random(n):
  """Random layers drawing one device's rows against each replica's own."""
  if n != replica_counts()[-1]:
    return []
  return bench_fit(n, model_names=tuple(RANDOM_MODELS),
                   names=("none", "mirrored", "replicator",
                          "replicator" + OWN_DRAWS), section="random")


def bench_overhead(n):
  """Per-step cost with negligible compute: a tiny model's fit step, and the
  part of it that is input (`input_fetch`)."""
  return (bench_fit(n, model_names=("tiny",), section="overhead") +
          [input_fetch(n)])


def input_fetch(n):
  """The input part of a fit step, alone: a traced function that takes the
  iterator as its argument (as Keras's step does), gets the next batch and
  sums each replica's part; nothing else.
  """
  x, _ = data("tiny", SIZE["fit_steps"])
  runs = {}
  for name, strategy in contenders(n):
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(
        SIZE["global_batch"]).repeat()
    if strategy is None:
      fetch = tf.function(lambda it: [tf.reduce_sum(next(it))])
      iterator = iter(dataset)
    else:
      fetch = tf.function(
          lambda it, s=strategy: s.experimental_local_results(
              s.run(tf.reduce_sum, args=(next(it),))))
      iterator = iter(strategy.experimental_distribute_dataset(dataset))
    first = sum(float(t) for t in fetch(iterator))  # Traces; the first batch.
    runs[name] = {"fetch": fetch, "iterator": iterator, "first": first,
                  "times": []}
  for _ in range(SIZE["rounds"]):
    for run in runs.values():
      for _ in range(SIZE["fit_steps"]):
        start = time.perf_counter()
        run["fetch"](run["iterator"])
        run["times"].append(time.perf_counter() - start)
  row = {"model": "input fetch", "replicas": n,
         "ms": {name: median_ms(r["times"]) for name, r in runs.items()},
         "failed": {},
         "agree": agree([r["first"] for r in runs.values()], rtol=1e-4)}
  print_progress("overhead", row)
  return row


# 2. Custom loop.

# Each part adds one stage to the step before it; "update" is the whole step.
STEP_PARTS = ("forward", "+ backward", "+ all-reduce", "+ update")


def custom_step(model, optimizer, strategy, part="+ update", slices=1):
  """A traced step running one of `STEP_PARTS`; returns the summed loss.

  With `slices`, the model runs on that many slices of the batch in turn
  (no strategy): the replicas' compute without any replication.
  """
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")
  batch = SIZE["global_batch"]

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.add_n([loss_fn(y_slice, model(x_slice, training=True))
                       for x_slice, y_slice in zip(tf.split(x, slices),
                                                   tf.split(y, slices))])
      loss /= batch
    if part == "forward":
      return loss
    grads = tape.gradient(loss, model.trainable_variables)
    if part == "+ update":
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    if part == "+ all-reduce":
      grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
    # Depends on every gradient, so none is pruned from the trace.
    return loss + 0 * tf.add_n([tf.reduce_sum(g) for g in grads])

  if strategy is None:
    return tf.function(replica_step)

  @tf.function
  def step(x, y):
    losses = strategy.run(replica_step, (x, y))
    return strategy.reduce("sum", losses, axis=None)

  return step


def bench_custom(n, model_names=tuple(MODELS), parts=("+ update",),
                 sliced=False, names=("none", "mirrored", "replicator")):
  """Custom-loop step times; with several `parts`, one row per part.

  `sliced` adds the contender "none, sliced": no strategy, the batch in `n`
  slices one after another.
  """
  rows = []
  for model_name in model_names:
    weights = initial_weights(model_name)
    x, y = data(model_name, SIZE["fit_steps"])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        SIZE["global_batch"]).cache()
    runs = {}
    for name, strategy, slices in (
        [(name, contender(name, n), 1) for name in names] +
        ([("none, sliced", None, n)] if sliced else [])):
      with scope(strategy):
        model = MODELS[model_name]()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        optimizer.build(model.trainable_variables)
      batches = list(strategy.experimental_distribute_dataset(dataset)
                     if strategy else dataset)
      for part in parts:
        runs[name, part] = {
            "step": custom_step(model, optimizer, strategy, part, slices),
            "batches": batches, "times": [], "losses": []}
    for round_index in range(SIZE["rounds"] + 1):
      for run in runs.values():
        for x_batch, y_batch in run["batches"]:
          start = time.perf_counter()
          loss = float(run["step"](x_batch, y_batch))
          if round_index == 0:
            run["losses"].append(loss)
          else:
            run["times"].append(time.perf_counter() - start)
    for part in parts:
      of_part = {name: r for (name, p), r in runs.items() if p == part}
      rows.append({
          "model": model_name, "replicas": n,
          "ms": {name: median_ms(r["times"]) for name, r in of_part.items()},
          # The update changes the weights between the parts' runs.
          "agree": losses_agree(
              model_name, {k: r["losses"] for k, r in of_part.items()})})
      if len(parts) > 1:
        rows[-1]["part"] = part
      print_progress("custom", rows[-1])
  return rows


# 6. Where an MLP step's time goes.

def bench_parts(n):
  if n != replica_counts()[-1]:
    return []
  return bench_custom(n, model_names=("mlp",), parts=STEP_PARTS, sliced=True,
                      names=("none", "mirrored", "replicator", "sharded"))


# 3. All-reduce latency.

def bench_allreduce(n):
  if n < 2:
    return []
  cases = [(f"{mb:g} MB", 1, int(mb * 2 ** 20)) for mb in SIZE["allreduce_mb"]]
  count, each = SIZE["allreduce_many"]
  unit = f"{each // 1024} KB" if each >= 1024 else f"{each} B"
  cases.append((f"{count} x {unit}", count, each))
  rows = []
  for label, count, size in cases:
    per_device = [[tf.fill([size // 4], float(d + 1) + i / 1000.0)
                   for i in range(count)] for d in range(n)]
    with tf.device(devices()[0]):
      on_one = [[tf.identity(t) for t in ts] for ts in per_device]
    runs = {"add_n floor": _add_n_fn(on_one)}
    for name, strategy in contenders(n)[1:]:
      inputs = strategy.experimental_distribute_values_from_function(
          lambda ctx, s=strategy: [tf.identity(t) for t in per_device[
              ctx.replica_id_in_sync_group]])
      runs[name] = _all_reduce_fn(strategy, inputs)
    firsts = [np.asarray(fn()) for fn in runs.values()]  # Traces them too.
    times = {name: [] for name in runs}
    for _ in range(SIZE["allreduce_repeats"]):
      for name, fn in runs.items():
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
    rows.append({"tensors": label, "replicas": n,
                 "ms": {k: median_ms(v) for k, v in times.items()},
                 "agree": agree(firsts, rtol=1e-6)})
    print_progress("allreduce", rows[-1])
  return rows


def _add_n_fn(on_one):
  add = tf.function(lambda: [tf.add_n(list(ts)) for ts in zip(*on_one)])
  return lambda: add()[0]


def _all_reduce_fn(strategy, inputs):
  run = tf.function(lambda: strategy.run(
      lambda ts: tf.distribute.get_replica_context().all_reduce("sum", ts),
      (inputs,)))
  return lambda: strategy.experimental_local_results(run()[0])[-1]


# 8. reduce_scatter against all_reduce.

SCATTER_PATHS = ("merge_call", "in tf.cond")


def bench_reduce_scatter(n):
  """One row per path: ours both ways, MirroredStrategy's all_reduce beside.

  Replica r holds (r + 1) + i / size at element i, so slice r of the sum
  starts with n (n + 1) / 2 + r: each contender returns that one number per
  replica (the reduce_scatter's first element, the all_reduce's element at
  slice r's start), which times the exchange, not a copy out, and checks
  that reduce_scatter's slices are the all_reduce's.
  """
  if n < 2:
    return []
  size = int(SIZE["reduce_scatter_mb"] * 2 ** 20 / 4) // n * n
  runs = {}
  for path in SCATTER_PATHS:
    for name in ("reduce_scatter", "all_reduce"):
      runs[path, name] = _collective_fn(contender("replicator", n), size, name,
                                        in_cond=path == "in tf.cond")
  runs["merge_call", "mirrored all_reduce"] = _collective_fn(
      contender("mirrored", n), size, "all_reduce", in_cond=False)
  firsts = {key: fn() for key, fn in runs.items()}  # Traces them too.
  times = {key: [] for key in runs}
  for _ in range(SIZE["allreduce_repeats"]):
    for key, fn in runs.items():
      start = time.perf_counter()
      fn()
      times[key].append(time.perf_counter() - start)
  rows = []
  for path in SCATTER_PATHS:
    of_path = [key for key in runs if key[0] == path]
    rows.append({"path": path, "replicas": n,
                 "mb": size * 4 / 2 ** 20,
                 "ms": {name: median_ms(times[path, name])
                        for _, name in of_path},
                 "agree": agree([firsts[key] for key in of_path] +
                                [[n * (n + 1) / 2 + r for r in range(n)]],
                                rtol=1e-6)})
    print_progress("reducescatter", rows[-1])
  return rows


def _collective_fn(strategy, size, collective, in_cond):
  """A traced `strategy.run` of one collective; returns a number per replica."""
  # Made once, outside the trace, so that nothing is constant-folded.
  inputs = strategy.experimental_distribute_values_from_function(
      lambda ctx: float(ctx.replica_id_in_sync_group + 1) +
      tf.range(size, dtype=tf.float32) / size)

  def replica_fn(x):
    ctx = tf.distribute.get_replica_context()
    if collective == "reduce_scatter":
      call = lambda: ctx.reduce_scatter("sum", x)[0]
    else:
      start = ctx.replica_id_in_sync_group * (size // ctx.num_replicas_in_sync)
      call = lambda: tf.gather(ctx.all_reduce("sum", x), start)
    if in_cond:
      return tf.cond(ctx.replica_id_in_sync_group >= 0, call, call)
    return call()

  run = tf.function(lambda: strategy.run(replica_fn, (inputs,)))
  return lambda: [float(v) for v in strategy.experimental_local_results(run())]



# 9. The optimizer update alone.

UPDATE_CONTENDERS = ("mirrored", "replicator", "sharded")
UPDATE_MEASURES = ("apply", "exchange")


def bench_update(n):
  """`optimizer.apply_gradients` inside `strategy.run`, timed on its own.

  Every replica starts each step from the same fixed gradients (made once,
  outside the trace; replica r's are r + 1 times the first's), so the step
  is the gradient exchange and the update and nothing else. Beside it, the
  same gradients' exchange alone, as the update starts with it: an
  all-reduce for mirrored state, and for sharded state too where the
  replicas share memory (logical CPUs: each slices the one sum in place),
  else a reduce-scatter (each `ReplicaContext` collective of every gradient,
  padded flat for reduce_scatter as the sharded update does). "apply -
  exchange" is then the update: for mirrored state every replica's whole
  update, for sharded state the update of one shard per replica and the
  all-gather of the new weights. Run for the MLP at each width of
  `update_hidden`, the benchmark's first.
  """
  if n != replica_counts()[-1]:
    return []
  rows = []
  for hidden, optimizer in itertools.product(SIZE["update_hidden"],
                                             OPTIMIZERS):
    keras.utils.set_random_seed(0)
    weights = mlp(hidden).get_weights()
    rng = np.random.default_rng(1)
    grads = [1e-3 * rng.normal(size=w.shape).astype("float32")
             for w in weights]
    runs, finals = {}, {}
    for name in UPDATE_CONTENDERS:
      strategy = contender(name, n)
      with strategy.scope():
        model = mlp(hidden)
        model.set_weights(weights)
        opt = OPTIMIZERS[optimizer]()
        opt.build(model.trainable_variables)
      per_replica = strategy.experimental_distribute_values_from_function(
          lambda ctx: [tf.constant(g) * float(ctx.replica_id_in_sync_group + 1)
                       for g in grads])
      runs[name, "apply"] = _apply_fn(strategy, model, opt, per_replica)
      runs[name, "exchange"] = _exchange_fn(
          strategy, per_replica, scatter=name == "sharded" and
          not strategy.extended.communicator.shares_memory)
      finals[name] = model
    times = {key: [] for key in runs}
    for key, fn in runs.items():  # Traces them.
      fn()
    for _ in range(SIZE["rounds"]):
      for key, fn in runs.items():
        for _ in range(SIZE["fit_steps"]):
          start = time.perf_counter()
          fn()
          times[key].append(time.perf_counter() - start)
    ms = {f"{name} {measure}": median_ms(times[name, measure])
          for name, measure in runs}
    rows.append({"optimizer": optimizer, "hidden": hidden,
                 "parameters": sum(w.size for w in weights),
                 "replicas": n, "ms": ms,
                 "agree": agree([np.concatenate([w.ravel()
                                                 for w in m.get_weights()])
                                 for m in finals.values()], rtol=1e-4)})
    print_progress("update", rows[-1])
  return rows


def _apply_fn(strategy, model, optimizer, per_replica):
  def replica_fn(grads):
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  return tf.function(lambda: strategy.run(replica_fn, (per_replica,)))


def _exchange_fn(strategy, per_replica, scatter):
  def replica_fn(grads):
    ctx = tf.distribute.get_replica_context()
    if not scatter:
      return ctx.all_reduce("sum", grads)
    n = ctx.num_replicas_in_sync
    flat = [tf.pad(tf.reshape(g, [-1]), [[0, -g.shape.num_elements() % n]])
            for g in grads]
    return ctx.reduce_scatter("sum", flat)

  return tf.function(lambda: strategy.run(replica_fn, (per_replica,)))


def update_table(rows):
  lines = []
  for r in rows:
    ms = r["ms"]
    if not lines:
      lines += ["", f"Optimizer update alone, MLP 784-h-h-10 (h: hidden "
                f"width, M: parameters), "
                f"{r['replicas']} replicas, ms (median; apply = "
                f"apply_gradients of fixed gradients inside strategy.run; "
                f"exchange = their all-reduce, or the reduce-scatter a "
                f"sharded update starts with where the replicas do not share "
                f"memory; update = apply - exchange)",
                f"{'h (M)':12} {'optimizer':9} {'measure':9} " +
                " ".join(f"{n:>10}" for n in UPDATE_CONTENDERS) +
                f" {'S/mirrored':>10} {'S/replicator':>12}  agree"]
    update = {n: ms[f"{n} apply"] - ms[f"{n} exchange"]
              for n in UPDATE_CONTENDERS}
    for label, v in (("apply", {n: ms[f"{n} apply"]
                                for n in UPDATE_CONTENDERS}),
                     ("exchange", {n: ms[f"{n} exchange"]
                                   for n in UPDATE_CONTENDERS}),
                     ("update", update)):
      model = f"{r['hidden']} ({r['parameters'] / 1e6:.3g})"
      lines.append(
          f"{model:12} {r['optimizer']:9} {label:9} " +
          " ".join(f"{v[n]:>10.2f}" for n in UPDATE_CONTENDERS) +
          f" {v['sharded'] / v['mirrored']:>10.2f}"
          f" {v['sharded'] / v['replicator']:>12.2f}  {r['agree']}")
  return lines


def replicas_child(n):
  """In a child: every in-process section for one replica count, as JSON."""
  n = int(n)
  print(json.dumps({section: bench(n)
                    for section, bench in IN_PROCESS_SECTIONS.items()
                    if section in ARGS.sections.split(",")}))


# 4. First epoch and peak memory, in fresh processes.

def first_epoch_child(spec):
  """Runs in a child: one fit epoch of the MLP; prints seconds and peak RSS."""
  name, n = spec.split(":")
  strategy = contender(name, int(n))
  weights = initial_weights("mlp")
  x, y = data("mlp", SIZE["fit_steps"])
  start = time.perf_counter()
  model = compiled("mlp", strategy, weights)
  model.fit(x, y, batch_size=SIZE["global_batch"], epochs=1, verbose=0)
  seconds = time.perf_counter() - start
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(json.dumps({"first_epoch_s": seconds, "peak_rss_mb": peak_mb}))


def _child(spec, timeout=600):
  command = [sys.executable, __file__, "--child", spec, "--devices",
             str(ARGS.devices), "--sections", ARGS.sections] + (
                 ["--quick"] if ARGS.quick else [])
  done = subprocess.run(command, stdout=subprocess.PIPE, text=True,
                        timeout=timeout, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def bench_first_epoch():
  n = replica_counts()[-1]
  runs = {name: [] for name in ("none", "mirrored", "replicator")}
  for _ in range(SIZE["first_epoch_runs"]):
    for name, results in runs.items():
      results.append(_child(f"first:{name}:{n}"))  # A fresh process each.
  row = {"replicas": n, "runs": SIZE["first_epoch_runs"]}
  for key in ("first_epoch_s", "peak_rss_mb"):
    row[key] = {name: statistics.median(r[key] for r in results)
                for name, results in runs.items()}
  print_progress("first", row)
  return [row]


# 5. Multi-worker.

# Variants of the multi-worker step: strategy arguments, optimizer arguments.
MULTI_VARIANTS = {
    "plain": ({}, {}),
    "bfloat16": ({"gradient_compression": "bfloat16"}, {}),
    "accumulate 4": ({}, {"gradient_accumulation_steps": 4}),
}


def fit_step_child(variant):
  """In a child (maybe a worker): the MLP fit step under `variant`, in ms.

  The mean step of each round (accumulation steps and update steps alike),
  median over rounds; with gradient accumulation also the median of each
  kind of step: those that only accumulate and those that all-reduce and
  update.
  """
  strategy_kwargs, optimizer_kwargs = MULTI_VARIANTS[variant]
  strategy = rs.ReplicatorStrategy(**strategy_kwargs)
  x, y = data("mlp", SIZE["fit_steps"])
  with strategy.scope():
    model = mlp()
    model.set_weights(initial_weights("mlp"))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9, **optimizer_kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  every = optimizer_kwargs.get("gradient_accumulation_steps")
  rounds, by_kind, steps_done = [], {"accumulate": [], "update": []}, 0
  for round_index in range(SIZE["rounds"] + 1):
    timer = StepTimer()
    history = model.fit(x, y, batch_size=SIZE["global_batch"], epochs=1,
                        shuffle=False, verbose=0, callbacks=[timer])
    if round_index:
      rounds.append(statistics.mean(timer.times[1:]))
      for i, step_time in enumerate(timer.times[1:], start=steps_done + 1):
        if every:  # Keras updates on the steps where (iterations + 1) % every == 0.
          by_kind["update" if (i + 1) % every == 0 else "accumulate"].append(
              step_time)
    else:
      first_loss = history.history["loss"][0]
    steps_done += len(timer.times)
  result = {"ms": median_ms(rounds), "first_loss": first_loss}
  if every:
    result["ms by kind"] = {kind: median_ms(times)
                            for kind, times in by_kind.items() if times}
  print(json.dumps(result))


def _on_two_workers(spec):
  """`--child spec` on 2 workers x 2 devices (under the launcher): each
  worker's JSON."""
  with tempfile.TemporaryDirectory() as out:
    done = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.launch", "--workers",
         "2", "--timeout", "500", "--output", "all", "--", sys.executable,
         __file__, "--child", spec, "--devices", "2"] + (
             ["--quick"] if ARGS.quick else []),
        stdout=subprocess.PIPE, text=True, timeout=560, check=True, cwd=out)
  lines = [l.split("] ", 1)[1] for l in done.stdout.splitlines()
           if l.startswith("[worker ") and
           l.split("] ", 1)[1].startswith("{")]
  return [json.loads(l) for l in lines]


def bench_multi_worker():
  rows = []
  for variant in MULTI_VARIANTS:
    single = _child(f"fit_step:{variant}")
    workers = _on_two_workers(f"fit_step:{variant}")
    row = {"variant": variant,
           "ms": {"1 process x 4": single["ms"],
                  "2 workers x 2": statistics.median(
                      w["ms"] for w in workers)},
           "ms by kind": {
               f"{kind}, {where}": statistics.median(
                   r["ms by kind"][kind] for r in results)
               for where, results in (("1 process x 4", [single]),
                                      ("2 workers x 2", workers))
               for kind in single.get("ms by kind", {})},
           # 16-bit sums differ from float32 ones by ~1e-3 relative.
           "agree": agree([single["first_loss"]] +
                          [w["first_loss"] for w in workers], rtol=1e-3)}
    print_progress("multi", row)
    rows.append(row)
  return rows


EXCHANGES = ("tf.function", "run, nothing", "run, 2 scalars",
             "run, gradients")


def exchange_child(spec):
  """In a child (maybe a worker): traced steps that all-reduce nothing, two
  scalars, or the MLP's gradients (2.7 MB) in `strategy.run`, and beside
  them the same math on the replicas' devices in a plain `tf.function`; ms
  (median).

  A `strategy.run` step also all-reduces each replica's rows (the batch
  share Keras's loss scaling reads): in one process that is pruned when
  unused; across workers it is a collective, so it runs in every step.
  """
  del spec
  strategy = rs.ReplicatorStrategy()
  shapes = [w.shape for w in initial_weights("mlp")]
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.fill(s, float(ctx.replica_id_in_sync_group + 1))
                   for s in shapes] + [tf.constant(1.0), tf.constant(2.0)])

  def step(exchange):
    if exchange == "tf.function":
      last_grads = strategy.experimental_local_results(values[-3])

      def by_hand():
        results = []
        for part in last_grads:
          with tf.device(part.device):
            results.append(part[0] * 2)
        return results
      return tf.function(by_hand)

    def replica_fn(values):
      ctx = tf.distribute.get_replica_context()
      grads, scalars = values[:-2], values[-2:]
      if exchange == "run, 2 scalars":
        return ctx.all_reduce("sum", scalars)[0]
      if exchange == "run, gradients":
        return ctx.all_reduce("sum", grads)[-1][0]
      return grads[-1][0] * 2

    return tf.function(lambda: strategy.run(replica_fn, (values,)))

  steps = {exchange: step(exchange) for exchange in EXCHANGES}
  for fn in steps.values():  # Traces them.
    fn()
  # The sums, the same on every replica of every worker.
  results = {exchange: float(strategy.experimental_local_results(
      steps[exchange]())[0]) for exchange in ("run, 2 scalars",
                                              "run, gradients")}
  times = {exchange: [] for exchange in EXCHANGES}
  for _ in range(SIZE["rounds"] * SIZE["fit_steps"]):
    for exchange, fn in steps.items():
      start = time.perf_counter()
      fn()
      times[exchange].append(time.perf_counter() - start)
  print(json.dumps({"ms": {e: median_ms(t) for e, t in times.items()},
                    "results": results}))


def bench_exchange():
  """What a traced step pays to exchange between workers, beside one process."""
  single = _child("exchange:")
  workers = _on_two_workers("exchange:")
  row = {"ms": {f"{exchange}, {where}": statistics.median(
      r["ms"][exchange] for r in results)
                for where, results in (("1 process x 4", [single]),
                                       ("2 workers x 2", workers))
                for exchange in EXCHANGES},
         "agree": all(w["results"] == single["results"] for w in workers)}
  print_progress("exchange", row)
  return [row]


# 7. Sharded optimizer state.

SHARDING_CONTENDERS = ("mirrored", "replicator", "sharded", "zero3")


def bench_sharding_fit(n):
  """In-process part: the MLP fit step, state sharded or not, at most replicas."""
  if n != replica_counts()[-1]:
    return []
  rows = []
  for optimizer in OPTIMIZERS:
    row, = bench_fit(n, model_names=("mlp",), names=SHARDING_CONTENDERS,
                     optimizer=optimizer)
    rows.append(dict(row, measure="fit step", optimizer=optimizer))
  return rows


def big_mlp():
  inputs, width, layers = SIZE["big_mlp"]
  return keras.Sequential(
      [keras.Input((inputs,))] +
      [keras.layers.Dense(width, activation="relu") for _ in range(layers)] +
      [keras.layers.Dense(10)])


def bytes_by_device(variables):
  """Bytes of every variable's components (copies, or shards), per device."""
  by_device = {}
  for variable in variables:
    value = getattr(variable, "value", variable)  # A Keras variable's tf one.
    for component in getattr(value, "values", (value,)):
      by_device[component.device] = by_device.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return by_device


def sharding_memory_child(spec):
  """In a child: the big MLP with Adam under one strategy; prints its bytes.

  Builds the model and the optimizer, then fits a few steps of a small
  batch; the peak resident memory is the whole process's.
  """
  name, n = spec.split(":")
  strategy = contender(name, int(n))
  with strategy.scope():
    keras.utils.set_random_seed(0)  # The same weights under every strategy.
    model = big_mlp()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
  optimizer_bytes = bytes_by_device(model.optimizer.variables)
  weight_bytes = bytes_by_device(model.weights)
  rng = np.random.default_rng(0)
  rows = SIZE["big_mlp_batch"] * SIZE["big_mlp_steps"]
  x = rng.normal(size=(rows, SIZE["big_mlp"][0])).astype("float32")
  y = rng.integers(0, 10, size=rows).astype("int32")
  history = model.fit(x, y, batch_size=SIZE["big_mlp_batch"], epochs=1,
                      shuffle=False, verbose=0)
  print(json.dumps({
      "params": model.count_params(),
      "optimizer_bytes": optimizer_bytes, "weight_bytes": weight_bytes,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "loss": history.history["loss"]}))


def bench_sharding_memory():
  """Fresh-process part: one child per contender, so peaks don't mix."""
  n = replica_counts()[-1]
  runs = {name: _child(f"sharding:{name}:{n}") for name in SHARDING_CONTENDERS}
  params = runs["mirrored"]["params"]
  row = {"measure": "memory", "replicas": n, "params": params,
         "adam_slot_mb": params * 4 / 2 ** 20,
         "agree": agree([r["loss"] for r in runs.values()], rtol=1e-4)}
  for key in ("optimizer_bytes", "weight_bytes"):
    row[key.replace("bytes", "mb_per_device_max")] = {
        name: max(r[key].values()) / 2 ** 20 for name, r in runs.items()}
    row[key.replace("bytes", "mb_total")] = {
        name: sum(r[key].values()) / 2 ** 20 for name, r in runs.items()}
    row[key.replace("bytes", "devices")] = {
        name: len(r[key]) for name, r in runs.items()}
  row["peak_rss_mb"] = {name: r["peak_rss_mb"] for name, r in runs.items()}
  print_progress("sharding", row)
  return [row]


# 8. A big embedding table, sharded by rows (lookups move only the rows used).

EMBEDDING_CONTENDERS = ("none", "mirrored", "replicator", "zero3")


def embedding_child(spec):
  """In a child: fit steps of an Embedding model; prints times and bytes."""
  name, n = spec.split(":")
  strategy = (zero3(int(n)) if name == "zero3" else
              dict(contenders(int(n)))[name])
  rows, width = SIZE["embedding"]
  with scope(strategy):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((SIZE["embedding_ids"],), dtype="int32"),
        keras.layers.Embedding(rows, width),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
  batch = SIZE["embedding_batch"]
  examples = batch * SIZE["embedding_steps"]
  rng = np.random.default_rng(0)
  x = rng.integers(0, rows, size=(examples, SIZE["embedding_ids"]),
                   dtype=np.int32)
  y = rng.normal(size=(examples, 1)).astype("float32")
  times, losses = [], []
  for _ in range(2):  # The first epoch traces.
    timer = StepTimer()
    losses += model.fit(x, y, batch_size=batch, epochs=1, shuffle=False,
                        verbose=0, callbacks=[timer]).history["loss"]
    times = timer.times
  print(json.dumps({
      "ms": median_ms(times), "losses": losses,
      "weight_bytes": bytes_by_device(model.weights),
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def bench_embedding():
  n = replica_counts()[-1]
  runs = {name: _child(f"embedding:{name}:{n}")
          for name in EMBEDDING_CONTENDERS}
  rows, width = SIZE["embedding"]
  row = {"replicas": n, "table_mb": rows * width * 4 / 2 ** 20,
         "ms": {name: r["ms"] for name, r in runs.items()},
         "weight_mb_per_device_max": {
             name: max(r["weight_bytes"].values()) / 2 ** 20
             for name, r in runs.items()},
         "peak_rss_mb": {name: r["peak_rss_mb"] for name, r in runs.items()},
         "agree": agree([r["losses"] for r in runs.values()], rtol=1e-4)}
  print_progress("embedding", row)
  return [row]


# Output.

def print_progress(section, row):
  print(f"  {section}: {json.dumps(row)}", file=sys.stderr, flush=True)


def table(results):
  lines = []
  for section, title in (("fit", "Keras fit step, ms (median)"),
                         ("custom", "Custom-loop step, ms (median)")):
    if section not in results:
      continue
    lines += ["", title, f"{'model':8} {'replicas':>8} {'none':>8} "
              f"{'mirrored':>9} {'replicator':>11} {'R/none':>7} "
              f"{'R/mirrored':>10}  agree"]
    for r in results[section]:
      ms = r["ms"]
      lines.append(
          f"{r['model']:8} {r['replicas']:>8} {ms['none']:>8.2f} "
          f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
          f"{ms['replicator'] / ms['none']:>7.2f} "
          f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  lines += xla_table(results.get("xla", []))
  lines += random_table(results.get("random", []))
  if results.get("overhead"):
    lines += ["", "Per-step overhead: fit step of one Dense layer "
              f"({SIZE['image'] ** 2}x10), and its input fetch alone (the "
              "next batch from the iterator Keras passes to its step), ms "
              "(median)",
              f"{'part':12} {'replicas':>8} {'none':>8} {'mirrored':>9} "
              f"{'replicator':>11} {'R/none':>7} {'M/none':>7} "
              f"{'R/mirrored':>10}  agree"]
    for r in sorted(results["overhead"], key=lambda r: r["model"] != "tiny"):
      ms = r["ms"]
      part = "fit step" if r["model"] == "tiny" else r["model"]
      lines.append(
          f"{part:12} "
          f"{r['replicas']:>8} {ms['none']:>8.2f} {ms['mirrored']:>9.2f} "
          f"{ms['replicator']:>11.2f} {ms['replicator'] / ms['none']:>7.2f} "
          f"{ms['mirrored'] / ms['none']:>7.2f} "
          f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  if results.get("parts"):
    parts = results["parts"]
    lines += ["", f"MLP custom-loop step by part, {parts[0]['replicas']}"
              f" replicas, ms (median; each part adds a stage to the one above;"
              f" sliced = no strategy, the batch in as many slices in turn;"
              f" sharded = replicator with shard_optimizer_state=True)",
              f"{'part':14} {'none':>8} {'sliced':>8} {'mirrored':>9} "
              f"{'replicator':>11} {'sharded':>8} {'R/none':>7} "
              f"{'R/sliced':>8} {'R/mirrored':>10}  agree"]
    for r in parts:
      ms = r["ms"]
      lines.append(
          f"{r['part']:14} {ms['none']:>8.2f} {ms['none, sliced']:>8.2f} "
          f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
          f"{ms['sharded']:>8.2f} "
          f"{ms['replicator'] / ms['none']:>7.2f} "
          f"{ms['replicator'] / ms['none, sliced']:>8.2f} "
          f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  lines += update_table(results.get("update", []))
  lines += sharding_table(results.get("sharding", []))
  lines += embedding_table(results.get("embedding", []))
  if "allreduce" in results:
    lines += ["", "All-reduce in replica context, ms (median)",
              f"{'tensors':14} {'replicas':>8} {'add_n floor':>11} "
              f"{'mirrored':>9} {'replicator':>11} {'R/floor':>8} "
              f"{'M/floor':>8}  agree"]
    for r in results["allreduce"]:
      ms = r["ms"]
      floor = ms["add_n floor"]
      lines.append(
          f"{r['tensors']:14} {r['replicas']:>8} {floor:>11.2f} "
          f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
          f"{ms['replicator'] / floor:>8.2f} {ms['mirrored'] / floor:>8.2f}  "
          f"{r['agree']}")
  if results.get("reducescatter"):
    rows = results["reducescatter"]
    lines += ["", f"reduce_scatter vs all_reduce in replica context, "
              f"{rows[0]['mb']:g} MB float32 per replica, ms (median; "
              f"MirroredStrategy has no reduce_scatter in replica context and "
              f"refuses a collective inside tf.cond: its merge_call all_reduce "
              f"is the reference)",
              f"{'path':12} {'replicas':>8} {'R scatter':>10} "
              f"{'R all_reduce':>12} {'M all_reduce':>12} "
              f"{'scatter/R':>9} {'scatter/M':>9}  agree"]
    for r in rows:
      ms = r["ms"]
      reference = ms.get("mirrored all_reduce")
      lines.append(
          f"{r['path']:12} {r['replicas']:>8} {ms['reduce_scatter']:>10.2f} "
          f"{ms['all_reduce']:>12.2f} "
          + (f"{reference:>12.2f}" if reference else f"{'-':>12}") +
          f" {ms['reduce_scatter'] / ms['all_reduce']:>9.2f} "
          + (f"{ms['reduce_scatter'] / reference:>9.2f}" if reference
             else f"{'-':>9}") + f"  {r['agree']}")
  if "first" in results:
    r = results["first"][0]
    lines += ["", f"First epoch (tracing included) and peak memory, MLP, "
              f"{r['replicas']} replicas, median of {r['runs']} fresh "
              f"processes each",
              f"{'':12} {'none':>8} {'mirrored':>9} {'replicator':>11}"]
    for key, unit in (("first_epoch_s", "s"), ("peak_rss_mb", "MB")):
      v = r[key]
      lines.append(f"{key:12} {v['none']:>7.1f}{unit[0]} "
                   f"{v['mirrored']:>8.1f}{unit[0]} {v['replicator']:>10.1f}"
                   f"{unit[0]}")
  if "multi" in results:
    plain = results["multi"][0]["ms"]["1 process x 4"]
    lines += ["", "Multi-worker fit step (MLP), ms per step (mean of a round, "
              "median of rounds)",
              f"{'variant':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2/1x4':>8} "
              f"{'2x2/1x4 plain':>14} agree"]
    for r in results["multi"]:
      ms = r["ms"]
      lines.append(
          f"{r['variant']:14} {ms['1 process x 4']:>7.2f} "
          f"{ms['2 workers x 2']:>7.2f} "
          f"{ms['2 workers x 2'] / ms['1 process x 4']:>8.2f} "
          f"{ms['2 workers x 2'] / plain:>14.2f} {r['agree']}")
    for r in results["multi"]:
      kinds = sorted({k.split(", ")[0] for k in r["ms by kind"]})
      if not kinds:
        continue
      lines += ["", f"{r['variant']}: each kind of step, ms (median): "
                f"accumulate = add the gradient to each replica's "
                f"accumulator, no gradient exchange; update = all-reduce and update",
                f"{'step':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2/1x4':>8}"]
      for kind in kinds:
        one, two = (r["ms by kind"][f"{kind}, {where}"]
                    for where in ("1 process x 4", "2 workers x 2"))
        lines.append(f"{kind:14} {one:>7.2f} {two:>7.2f} {two / one:>8.2f}")
  if "exchange" in results:
    r, = results["exchange"]
    lines += ["", "Exchange alone: a traced strategy.run step that all-reduces "
              "nothing, two scalars or the MLP's gradients (2.7 MB), and the "
              "same math in a plain tf.function on the replicas' devices, ms "
              "(median; across workers every run also all-reduces the "
              "replicas' rows, the batch share)",
              f"{'exchange':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2 - 1x4':>10} "
              f"agree"]
    for exchange in EXCHANGES:
      one, two = (r["ms"][f"{exchange}, {where}"]
                  for where in ("1 process x 4", "2 workers x 2"))
      lines.append(f"{exchange:14} {one:>7.2f} {two:>7.2f} {two - one:>10.2f} "
                   f"{r['agree']}")
  return "\n".join(lines)


def xla_table(rows):
  """jit_compile=True beside not, per contender; a failed contender says so."""
  lines = []
  for r in rows:
    ms = r["ms"]
    if not lines:
      lines += ["", f"Keras fit step with jit_compile=True (+xla) and without, "
                f"{r['replicas']} replicas, ms (median)",
                f"{'model':8} " + " ".join(
                    f"{name:>15}" for name in ("none", "none+xla", "mirrored",
                                               "mirrored+xla", "replicator",
                                               "replicator+xla")) +
                f" {'R+xla/R':>8} {'R+xla/none+xla':>14}  agree"]
    cell = lambda name: (f"{ms[name]:>15.2f}" if name in ms
                         else f"{'fails':>15}")
    lines.append(
        f"{r['model']:8} " + " ".join(cell(name) for name in (
            "none", "none+xla", "mirrored", "mirrored+xla", "replicator",
            "replicator+xla")) +
        f" {ms['replicator+xla'] / ms['replicator']:>8.2f}"
        f" {ms['replicator+xla'] / ms['none+xla']:>14.2f}  {r['agree']}")
  for r in rows:
    for name, error in r["failed"].items():
      lines.append(f"{r['model']} {name} fails: {error}")
  return lines


def random_table(rows):
  """Drawing one device's rows ("replicator") against each replica's own."""
  lines = []
  own = "replicator" + OWN_DRAWS
  for r in rows:
    ms = r["ms"]
    if not lines:
      lines += ["", f"Random layers: Keras fit step, {r['replicas']} replicas,"
                f" ms (median; own draws = each replica its batch's first "
                f"rows, as Keras alone)",
                f"{'model':10} {'none':>8} {'mirrored':>9} {'replicator':>11} "
                f"{'own draws':>10} {'R/own':>7} {'R/mirrored':>10} "
                f"{'R/none':>7}  agree"]
    lines.append(
        f"{r['model']:10} {ms['none']:>8.2f} {ms['mirrored']:>9.2f} "
        f"{ms['replicator']:>11.2f} {ms[own]:>10.2f} "
        f"{ms['replicator'] / ms[own]:>7.2f} "
        f"{ms['replicator'] / ms['mirrored']:>10.2f} "
        f"{ms['replicator'] / ms['none']:>7.2f}  {r['agree']}")
  return lines


def sharding_table(rows):
  """The sharding section's two tables: memory, then fit step."""
  lines = []
  names = SHARDING_CONTENDERS
  columns = lambda v, f: " ".join(f"{format(v[n], f):>11}" for n in names)
  header = (f"{'':22} " + " ".join(f"{n:>11}" for n in names) +
            f" {'S/mirrored':>10} {'Z3/mirrored':>11}")
  for r in (r for r in rows if r["measure"] == "memory"):
    inputs, width, layers = SIZE["big_mlp"]
    lines += ["", f"Sharded state (sharded) and weights too (zero3): MLP "
              f"{inputs}-{width}x{layers}-10 ({r['params'] / 1e6:.1f} M "
              f"parameters), Adam, {r['replicas']} replicas, global batch "
              f"{SIZE['big_mlp_batch']}, MB (each contender in a fresh "
              f"process; one Adam slot = {r['adam_slot_mb']:.1f} MB)", header]
    for key, label in (("optimizer_mb_per_device_max", "optimizer/device max"),
                       ("optimizer_mb_total", "optimizer, all devices"),
                       ("weight_mb_per_device_max", "weights/device max"),
                       ("weight_mb_total", "weights, all devices"),
                       ("peak_rss_mb", "peak RSS")):
      v = r[key]
      lines.append(f"{label:22} {columns(v, '.1f')} "
                   f"{v['sharded'] / v['mirrored']:>10.2f} "
                   f"{v['zero3'] / v['mirrored']:>11.2f}")
    rss = r["peak_rss_mb"]
    lines.append(f"{'peak RSS - mirrored':22} " + columns(
        {n: rss[n] - rss["mirrored"] for n in names}, ".1f") +
                 f"   losses agree {r['agree']}")
  fit_rows = [r for r in rows if r["measure"] == "fit step"]
  if fit_rows:
    lines += ["", f"Keras fit step, sharded state / weights, MLP, "
              f"{fit_rows[0]['replicas']} replicas, ms (median)",
              f"{'optimizer':22} " + " ".join(f"{n:>11}" for n in names) +
              f" {'S/mirrored':>10} {'Z3/mirrored':>11}  agree"]
    for r in fit_rows:
      ms = r["ms"]
      lines.append(
          f"{r['optimizer']:22} {columns(ms, '.2f')} "
          f"{ms['sharded'] / ms['mirrored']:>10.2f} "
          f"{ms['zero3'] / ms['mirrored']:>11.2f}  {r['agree']}")
  return lines


def embedding_table(rows):
  lines = []
  for r in rows:
    rows_, width = SIZE["embedding"]
    names = list(r["ms"])
    lines += ["", f"Embedding {rows_:,} x {width} ({r['table_mb']:.0f} MB), "
              f"SGD, {r['replicas']} replicas, global batch "
              f"{SIZE['embedding_batch']} x {SIZE['embedding_ids']} ids: fit "
              f"step (lookup + update) and weight MB per device",
              f"{'':22} " + " ".join(f"{n:>11}" for n in names) +
              f" {'Z3/mirrored':>11}"]
    for key, label, fmt in (("ms", "step ms (median)", ".2f"),
                            ("weight_mb_per_device_max",
                             "weights/device max", ".1f"),
                            ("peak_rss_mb", "peak RSS", ".0f")):
      v = r[key]
      lines.append(f"{label:22} " + " ".join(
          f"{format(v[n], fmt):>11}" for n in names) +
                   f" {v['zero3'] / v['mirrored']:>11.2f}")
    lines.append(f"losses agree {r['agree']}")
  return lines


def machine():
  return {"python": platform.python_version(), "tensorflow": tf.__version__,
          "keras": keras.__version__, "cpus": os.cpu_count(),
          "devices": list(devices()), "quick": ARGS.quick,
          "platform": platform.platform()}


# Sections (or their parts) measured per replica count, in one child process
# for each count.
IN_PROCESS_SECTIONS = {"fit": bench_fit, "custom": bench_custom,
                       "allreduce": bench_allreduce,
                       "reducescatter": bench_reduce_scatter,
                       "parts": bench_parts,
                       "update": bench_update,
                       "sharding": bench_sharding_fit,
                       "xla": bench_xla,
                       "overhead": bench_overhead,
                       "random": bench_random}
# Sections (or their parts) that start fresh processes of their own.
FRESH_PROCESS_SECTIONS = {"first": bench_first_epoch,
                          "multi": bench_multi_worker,
                          "exchange": bench_exchange,
                          "sharding": bench_sharding_memory,
                          "embedding": bench_embedding}


def main():
  if ARGS.child:
    kind, _, spec = ARGS.child.partition(":")
    return {"first": first_epoch_child, "replicas": replicas_child,
            "fit_step": fit_step_child, "exchange": exchange_child,
            "sharding": sharding_memory_child,
            "embedding": embedding_child}[kind](spec)
  start = time.perf_counter()
  sections = ARGS.sections.split(",")
  results = {s: [] for s in sections}
  for n in replica_counts():
    if set(IN_PROCESS_SECTIONS) & set(sections):
      for section, rows in _child(f"replicas:{n}").items():
        results[section] += rows
  for section, bench in FRESH_PROCESS_SECTIONS.items():
    if section in sections:
      results[section] += bench()
  results["machine"] = machine()
  results["seconds"] = time.perf_counter() - start
  print(table(results))
  print(f"\n{json.dumps(results['machine'])}\ntotal {results['seconds']:.0f} s")
  if ARGS.json:
    with open(ARGS.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
