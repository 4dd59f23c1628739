"""Pipeline parallelism: each schedule's measured bubble, memory and step.

For S = 2 and 4 pipeline devices and M micro-batches, each schedule (GPipe,
1F1B, ZB-H1, and interleaved 1F1B with 2 stages a device where S divides
M) runs an MLP of Dense stages (the same layers on each device:
interleaved's stages have half as many), one step traced by TF's profiler
(`benchmarks.pipeline_trace`): each device's busy fraction and the measured
bubble, beside (S - 1) / (M + S - 1) and the simulated timeline's
(`schedules.bubble_fraction`, F, B and W one unit each, and again with the
measured mean costs); ZB-H1's bubble over 1F1B's; each device's peak bytes
of activations held for the backward, measured against the schedule's bound
(`schedules.peak_in_flight` times one micro-batch's held bytes).

Then a transformer-like MLP (pre-norm residual blocks of Dense(4d, gelu),
Dense(d)) steps with SGD on one device, through 1F1B at S = 4 (its blocks'
weights on their stage's device) and data parallel over 4 replicas
(ReplicatorStrategy), interleaved round by round in one process: median
step times, ratios, and whether the first two steps' losses agree.

On a CPU the S logical devices share the machine's cores: with fewer cores
than devices the stages run one after another, not side by side, and the
measured bubble tells how little overlapped, not the schedule's. The table
says so; on S GPUs (or with a core per op's threads) it is the schedule's.
"""

import contextlib
import os
import statistics

import keras
import numpy as np
import tensorflow as tf

from benchmarks import contenders
from benchmarks import pipeline_trace
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import custom
from replicator_strategy.keras import model_stages
from replicator_strategy.pipeline import executor
from replicator_strategy.pipeline import schedules

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")
VIRTUAL = 2  # Interleaved 1F1B's stages a device.
STEP_STAGES = 4
STEP_SCHEDULE = "1f1b"
ONE, PIPE, DATA = "one device", "pipeline", "data parallel"


class DenseStage:
  """A stage of the benchmark MLP: `layers` Dense layers (the last stage
  ends with one unit), from "h{j-1}" (or the input) to "h{j}" (or the
  output), its weights on `device`."""

  def __init__(self, j, count, width, layers, device):
    self.index = j
    self.inputs = ("input:0",) if j == 0 else (f"h{j - 1}",)
    self.outputs = ("output:0",) if j == count - 1 else (f"h{j}",)
    last = j == count - 1
    with tf.device(device):
      self.layers = [keras.layers.Dense(width, activation="relu")
                     for _ in range(layers)] + (
                         [keras.layers.Dense(1)] if last else [])
      for layer in self.layers:
        layer.build((None, width))

  def __call__(self, tensors, training=None):
    h = tensors[self.inputs[0]]
    for layer in self.layers:
      h = layer(h, training=training)
    return {self.outputs[0]: h}

  @property
  def trainable_variables(self):
    return [v for layer in self.layers for v in layer.trainable_variables]


def mse(y, y_pred, sample_weight):
  del sample_weight
  return tf.reduce_mean((y - y_pred) ** 2)


def configurations(size):
  """(schedule, S, M, virtual) of the grid."""
  return [(name, s, m, VIRTUAL if name == "interleaved_1f1b" else 1)
          for s in size["pipeline_stages"]
          for m in size["pipeline_microbatches"] for name in SCHEDULES
          if name != "interleaved_1f1b" or m % s == 0]


def mlp_stages(size, s_count, virtual):
  """The benchmark MLP cut into `s_count * virtual` stages over the first
  `s_count` devices (each device the same layers whatever `virtual`); the
  devices."""
  _, width, layers = size["pipeline_mlp"]
  devices = list(contenders.devices()[:s_count])
  keras.utils.set_random_seed(0)
  count = s_count * virtual
  return [DenseStage(j, count, width, layers // virtual, devices[j % s_count])
          for j in range(count)], devices


def measured_run(size, name, s_count, m_count, virtual):
  """One configuration's measured step: `pipeline_trace.Measured`."""
  rows, width, _ = size["pipeline_mlp"]
  stages, devices = mlp_stages(size, s_count, virtual)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(rows, width)).astype("float32"))
  y = tf.constant(rng.normal(size=(rows, 1)).astype("float32"))
  plan = schedules.schedule(name, s_count, m_count, virtual)
  return pipeline_trace.measure(plan, stages, devices, x, y, mse,
                                rounds=size["pipeline_rounds"])


def bubble_child(options, spec):
  """In a child: every configuration's bubble, busy fractions and held
  bytes."""
  del spec
  rows = []
  for name, s_count, m_count, virtual in configurations(options.size):
    run = measured_run(options.size, name, s_count, m_count, virtual)
    plan = run.plan
    costs = run.mean_costs()
    if not plan.split_backward:  # Its B holds the weight gradient too.
      costs["W"] = 0.0
    per_stage = [max((b for (j, _), b in run.held.items() if j == stage),
                     default=0) for stage in range(plan.stages)]
    rows.append({
        "measure": "bubble", "schedule": name, "stages": s_count,
        "microbatches": m_count, "virtual": virtual,
        "theory": (s_count - 1) / (m_count + s_count - 1),
        "simulated": schedules.bubble_fraction(plan),
        "simulated_measured_costs": schedules.bubble_fraction(plan, costs),
        "measured": run.bubble(), "busy": run.busy_fractions(),
        "parallelism": run.parallelism(),
        "step_ms": run.makespan / 1e3, "costs_us": costs,
        "peak_held_kb": [b / 2 ** 10 for b in run.peak_held()],
        "bound_kb": [b / 2 ** 10 for b in
                     schedules.peak_in_flight(plan, per_stage)]})
    tables.progress(SECTION.name, rows[-1])
  return rows


def transformer_mlp(size, stage_devices=None):
  """Pre-norm residual blocks of Dense(4d, gelu), Dense(d); logits over 10.

  With `stage_devices` (S of them), block i's weights are made on device
  `i * S // blocks`, the stem on the first, the head on the last; the
  first layer of each later stage is named in `split`. Returns (model,
  split).
  """
  width, blocks, _ = size["pipeline_model"]
  count = len(stage_devices) if stage_devices else 1
  on = lambda k: (tf.device(stage_devices[k]) if stage_devices
                  else contextlib.nullcontext())
  inputs = keras.Input((width,))
  with on(0):
    x = keras.layers.Dense(width, name="stem")(inputs)
  split = []
  for i in range(blocks):
    k = i * count // blocks
    if i and k != (i - 1) * count // blocks:
      split.append(f"block{i}_norm")
    with on(k):
      h = keras.layers.LayerNormalization(name=f"block{i}_norm")(x)
      h = keras.layers.Dense(4 * width, activation="gelu",
                             name=f"block{i}_up")(h)
      x = keras.layers.Add(name=f"block{i}_add")(
          [x, keras.layers.Dense(width, name=f"block{i}_down")(h)])
  with on(count - 1):
    logits = keras.layers.Dense(10, name="head")(x)
  return keras.Model(inputs, logits), split


def step_child(options, spec):
  """In a child: one device, 1F1B at S = 4 and data parallel over 4
  replicas, round by round; medians and the first two steps' losses."""
  del spec
  size = options.size
  width, _, batch = size["pipeline_model"]
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
  y = tf.constant(rng.integers(0, 10, size=batch).astype("int32"))
  devices = list(contenders.devices()[:STEP_STAGES])
  steps = {ONE: _one_device_step(size, batch),
           PIPE: _pipeline_step(size, devices),
           DATA: _data_parallel_step(size, batch, x, y)}
  # Two untimed steps (the first traces): the second's loss is after an
  # update, so agreeing losses say the gradients agree too.
  losses = {name: [float(fn(x, y)) for _ in range(2)]
            for name, fn in steps.items()}
  times = timing.interleaved({name: lambda fn=fn: float(fn(x, y))
                              for name, fn in steps.items()},
                             rounds=size["pipeline_steps"])
  return {"ms": {n: timing.median_ms(t) for n, t in times.items()},
          "losses": losses,
          "agree": timing.agree(losses.values(), rtol=1e-4)}


def _optimizer(variables):
  optimizer = keras.optimizers.SGD(0.01)
  optimizer.build(variables)
  return optimizer


def _one_device_step(size, batch):
  with tf.device(contenders.devices()[0]):
    keras.utils.set_random_seed(0)
    model, _ = transformer_mlp(size)
    optimizer = _optimizer(model.trainable_variables)
  return custom.custom_step({"global_batch": batch}, model, optimizer, None)


def _pipeline_step(size, devices):
  keras.utils.set_random_seed(0)
  model, split = transformer_mlp(size, devices)
  stages = model_stages.split_model(model, len(devices), split)
  variables = executor.variables(stages)
  optimizer = _optimizer(variables)
  plan = schedules.schedule(STEP_SCHEDULE, len(devices),
                            size["pipeline_step_microbatches"])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(x, y):
    run = executor.run(plan, stages, devices, {"input:0": x}, y,
                       lambda y, p, w: loss(y, p))
    optimizer.apply(run.gradients, variables)
    return run.loss

  return step


def _data_parallel_step(size, batch, x, y):
  strategy = contenders.contender("replicator", STEP_STAGES)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model, _ = transformer_mlp(size)
    optimizer = _optimizer(model.trainable_variables)
  step = custom.custom_step({"global_batch": batch}, model, optimizer,
                            strategy)
  dataset = tf.data.Dataset.from_tensors((x, y))
  # Each replica's rows, cut once: the timed step gets the same batch.
  distributed = next(iter(strategy.experimental_distribute_dataset(dataset)))
  return lambda x, y: step(*distributed)


def pipeline_rows(options):
  """Fresh-process part: the bubble grid, then the step comparison."""
  if len(contenders.devices()) < max(options.size["pipeline_stages"]):
    return []
  rows = processes.child(options, SECTION.name, SECTION.child, "bubble")
  steps = processes.child(options, SECTION.name, SECTION.child, "step")
  rows.append({"measure": "step", "stages": STEP_STAGES,
               "schedule": STEP_SCHEDULE,
               "microbatches": options.size["pipeline_step_microbatches"],
               **steps})
  tables.progress(SECTION.name, rows[-1])
  return rows


def pipeline_child(options, spec):
  return bubble_child(options, spec) if spec == "bubble" else step_child(
      options, spec)


def pipeline_table(options, rows):
  if not rows:
    return []
  size = options.size
  rows_mlp, width, layers = size["pipeline_mlp"]
  bubbles = [r for r in rows if r["measure"] == "bubble"]
  one_f_one_b = {(r["stages"], r["microbatches"]): r["measured"]
                 for r in bubbles if r["schedule"] == "1f1b"}
  lines = ["", f"Pipeline bubble: MLP of Dense({width}) x {layers} a device "
           f"(a stage; interleaved: {layers // VIRTUAL} a stage), "
           f"batch {rows_mlp}, one step traced by TF's profiler (median of "
           f"{size['pipeline_rounds']}); theory (S-1)/(M+S-1), simulated "
           f"(F=B=W=1; B+W unsplit), simulated with the measured costs, "
           f"measured, and over 1F1B's; devices busy at once (par); each "
           f"device's busy fraction and peak activations held for the "
           f"backward, KB (bound: the schedule's in-flight count x one "
           f"micro-batch's)",
           f"{'schedule':20} {'S':>2} {'M':>2} {'theory':>6} {'sim':>5} "
           f"{'sim/c':>5} {'meas':>5} {'/1f1b':>5} {'par':>4}  "
           f"{'busy a device':23} peak held KB (bound)"]
  for r in bubbles:
    name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
    ratio = r["measured"] / one_f_one_b[r["stages"], r["microbatches"]]
    held = " ".join(f"{p:.0f}({b:.0f})"
                    for p, b in zip(r["peak_held_kb"], r["bound_kb"]))
    lines.append(
        f"{name:20} {r['stages']:>2} {r['microbatches']:>2} "
        f"{r['theory']:>6.3f} {r['simulated']:>5.3f} "
        f"{r['simulated_measured_costs']:>5.3f} {r['measured']:>5.3f} "
        f"{ratio:>5.2f} {r['parallelism']:>4.2f}  "
        f"{' '.join(f'{b:.2f}' for b in r['busy']):23} {held}")
  if bubbles:
    lines.append(_note(bubbles))
  for r in rows:
    if r["measure"] == "step":
      ms = r["ms"]
      lines += [
          "", f"Transformer-like MLP {size['pipeline_model'][:2]} "
          f"(width, blocks), batch {size['pipeline_model'][2]}, SGD step, "
          f"ms (median): one device, {r['schedule']} S={r['stages']} "
          f"M={r['microbatches']}, data parallel over {r['stages']} replicas",
          f"{ONE:>12} {PIPE:>12} {DATA:>14} {'pipe/one':>9} "
          f"{'pipe/data':>10}  losses agree",
          f"{ms[ONE]:>12.2f} {ms[PIPE]:>12.2f} {ms[DATA]:>14.2f} "
          f"{ms[PIPE] / ms[ONE]:>9.2f} {ms[PIPE] / ms[DATA]:>10.2f}  "
          f"{r['agree']}"]
  return lines


def _note(bubbles):
  """Why the measured bubble differs from the simulated one here."""
  cores = os.cpu_count()
  gaps = []
  for s_count in sorted({r["stages"] for r in bubbles}):
    of_s = [r for r in bubbles if r["stages"] == s_count]
    gap = statistics.median(r["measured"] - r["simulated"] for r in of_s)
    par = statistics.median(r["parallelism"] for r in of_s)
    gaps.append(f"S = {s_count}: measured - simulated {gap:+.3f}, {par:.2f} "
                f"devices busy at once")
  return (
      f"Medians by S ({'; '.join(gaps)}). The S logical devices share this "
      f"machine's {cores} CPU cores: where S > {cores}, at most {cores} "
      f"devices' ops progress at once and ops that overlap slow each other, "
      f"so the measured bubble tells how the cores were shared more than "
      f"the schedule; each action's fixed cost (its ops' launches, the "
      f"transfers) adds to it as M grows. With a device for each stage (S "
      f"GPUs, or cores enough for every device's ops) the measured bubble "
      f"is the one to compare with the simulated.")


SECTION = section.Section(
    name="pipeline", measures="pipeline schedules: measured bubble, held "
    "activations; step against one device and data parallel",
    fresh=pipeline_rows, child=pipeline_child, table=pipeline_table)
