"""Activation memory: sequence parallelism and rematerialization, per device.

A transformer (pre-norm blocks: MultiHeadAttention, Dropout, Dense(4d,
gelu) "up", Dense(d) "down", Dropout; the heads, up's columns and down's
rows split Megatron style) runs on one replica of 4 devices (k = 4), each
contender in a fresh process:

- "tensor parallel": the Megatron split alone; the LayerNorm, dropout and
  residual activations between the pairs are whole on every device;
- "+ sequence parallel": the token embedding's, the attention output's and
  down's `output` keys split the sequence (`(None, "model", None)`), so the
  LayerNorms, dropouts and residual adds between the pairs hold 1/k of the
  sequence per device;
- "+ SP, selective remat": and `keras.RematScope(mode="larger_than")`
  recomputes the layers whose outputs are larger than a block's (the MLP's
  up projection and gelu) and attention's core (scores, softmax, heads'
  outputs) in the backward;
- "+ SP, remat attn+up": and `keras.RematScope(mode="list_of_layers")`
  naming each block's MultiHeadAttention and "up": their calls (the
  query, key and value projections, the scores, softmax and heads'
  outputs; up's output and gelu) recomputed in the backward;
- "+ SP, full remat": and `keras.RematScope(mode="full")`.

Each step is traced (`strategy.run(model.train_step, ...)` in a
`tf.function`) and its graph counted by `benchmarks.memory_trace`: the
peak bytes of live tensors per device, the bytes the forward holds for the
backward per device, and those of the LayerNorm and dropout layers (what
sequence parallelism cuts by k). Then the same step runs: the median step
time, and whether every contender's losses agree (they all equal one device's).
"""

import time

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from benchmarks import contenders
from benchmarks import memory_trace
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import model_parallel

DEVICES = 4
TP, SP, SELECTIVE, LAYERS, FULL = (
    "tensor parallel", "+ sequence parallel", "+ SP, selective remat",
    "+ SP, remat attn+up", "+ SP, full remat")
NAMES = (TP, SP, SELECTIVE, LAYERS, FULL)
# The row-parallel layers whose sums become reduce-scatters along the
# sequence: what follows them, up to the next column layer, runs in parts.
# The token embedding's too, so that the first block starts in parts.
SEQUENCE_LAYOUT = {".*(tokens|attention_output|down)/output":
                   (None, "model", None)}
# The blocks' LayerNorms and dropouts (in their ops' names): what sequence
# parallelism cuts. The final LayerNorm feeds the whole logits on device 0.
NORMS_AND_DROPOUTS = r"block\d+_(norm|dropout)"
MB = 2 ** 20


def transformer(size):
  """`model_parallel.transformer` with Megatron's dropouts (rate 0.1)."""
  return model_parallel.transformer(size, "memory_transformer", dropout=0.1)


def strategy(name):
  """One replica of the first 4 devices, the Megatron split on them."""
  mesh = keras.distribution.DeviceMesh(
      (1, DEVICES), ("batch", "model"),
      keras.distribution.list_devices()[:DEVICES])
  layout_map = keras.distribution.LayoutMap(mesh)
  layouts = dict(model_parallel.LAYOUT)
  if name != TP:
    layouts.update(SEQUENCE_LAYOUT)
  for key, layout in layouts.items():
    layout_map[key] = layout
  return rs.ReplicatorStrategy(layout_map=layout_map)


def remat_scope(name, size):
  """The contender's `keras.RematScope`: for the selective one, the layers
  whose outputs are larger than a block's (Keras counts the rows a call
  gets): the MLP's "up" with its gelu, and attention's core (its scores,
  softmax and heads' outputs, each device's from its query, key and value
  parts, `keras/attention_heads.py`), as Megatron-LM's selective recompute;
  for "attn+up", each block's attention and "up" by name."""
  _, seq, width, _, blocks = size["memory_transformer"]
  if name == LAYERS:
    return keras.RematScope(mode="list_of_layers", layer_names=[
        f"block{i}_{layer}" for i in range(blocks)
        for layer in ("attention", "up")])
  if name == SELECTIVE:
    return keras.RematScope(
        mode="larger_than",
        output_size_threshold=size["memory_batch"] * seq * width)
  return keras.RematScope(mode="full" if name == FULL else None)


def _built(name, size):
  with strategy(name).scope() as scope_strategy:
    keras.utils.set_random_seed(0)  # The same weights in every contender.
    with remat_scope(name, size):
      model = transformer(size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
  return scope_strategy, model


def memory_child(options, name):
  """In a child: the contender's traced step counted, then run."""
  size = options.size
  strategy_, model = _built(name, size)
  vocab, seq = size["memory_transformer"][:2]
  ids = np.random.default_rng(0).integers(
      0, vocab, size=(size["memory_batch"], seq + 1)).astype("int32")
  x, y = tf.constant(ids[:, :-1]), tf.constant(ids[:, 1:])
  step = tf.function(
      lambda x, y: strategy_.run(model.train_step, ((x, y),)))
  live = memory_trace.live_bytes(step.get_concrete_function(x, y).graph)
  devices = [d for d in live.peak if d]
  timer, losses = [], []
  for _ in range(size["memory_steps"]):
    start = time.perf_counter()
    logs = step(x, y)
    losses.append(float(strategy_.experimental_local_results(
        logs["loss"])[0]))
    timer.append(time.perf_counter() - start)
  return {
      "peak_mb": max(live.peak[d] for d in devices) / MB,
      "held_mb": max(live.held_by(d) for d in devices) / MB,
      "norm_dropout_mb": max(live.held_by(d, NORMS_AND_DROPOUTS)
                             for d in devices) / MB,
      "ms": timing.median_ms(timer[1:] or timer),
      "loss": losses,
      "peak_rss_mb": processes.peak_rss_mb()}


def memory_rows(options, names=NAMES):
  """Fresh-process part: one child per contender, so nothing is shared."""
  if len(contenders.devices()) < DEVICES:
    return []
  runs = {name: processes.child(options, SECTION.name, memory_child, name)
          for name in names}
  row = {key: {n: r[key] for n, r in runs.items()}
         for key in ("peak_mb", "held_mb", "norm_dropout_mb", "ms",
                     "peak_rss_mb")}
  row["devices"] = DEVICES
  row["agree"] = timing.agree([r["loss"] for r in runs.values()], rtol=1e-4)
  tables.progress(SECTION.name, row)
  return [row]


ROWS = (("peak_mb", "peak live MB/device", ".1f"),
        ("held_mb", "held for backward", ".1f"),
        ("norm_dropout_mb", "  of it LN + dropout", ".2f"),
        ("ms", "step ms (median)", ".0f"),
        ("peak_rss_mb", "process peak RSS MB", ".0f"))


def memory_table(options, rows):
  vocab, seq, width, heads, blocks = options.size["memory_transformer"]
  lines = []
  for r in rows:
    names = list(r["ms"])
    lines += ["", f"Activation memory: transformer, {blocks} blocks, width "
              f"{width}, {heads} heads, sequence {seq}, batch "
              f"{options.size['memory_batch']}, Adam, one replica of "
              f"{r['devices']} devices (k = {r['devices']}); bytes of live "
              f"tensors per device counted in the traced step (max over "
              f"devices), and each column's ratio to the first; losses agree "
              f"{r['agree']}",
              f"{'':22} " + " ".join(f"{n:>22}" for n in names)]
    for key, label, fmt in ROWS:
      first = r[key][names[0]]
      lines.append(f"{label:22} " + " ".join(
          f"{format(r[key][n], fmt):>13} ({r[key][n] / first:5.2f}x)"
          for n in names))
  return lines


SECTION = section.Section(
    name="memory", measures="activation bytes per device and step time: "
    "tensor parallel, + sequence parallel, + selective (by size or by name) "
    "or full remat",
    fresh=memory_rows, child=memory_child, table=memory_table)
