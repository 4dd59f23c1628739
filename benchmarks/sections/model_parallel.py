"""Model parallelism: a transformer's weights split over each replica's devices.

Weight and Adam-slot bytes per device, peak resident memory and the `fit`
step of a transformer (blocks of MultiHeadAttention, then Dense(4d, gelu)
"up" and Dense(d) "down") on 4 devices, each contender in a fresh process:
plain data parallel over 4 replicas (k=1); `ReplicatorStrategy(layout_map=...)`
with 2 replicas of 2 devices (k=2) and 1 replica of 4 (k=4), the heads, up's
columns and down's rows split Megatron style over a replica's k devices; and
every weight cut over the 4 replicas by `variable_partitioner` ("zero3",
with `shard_optimizer_state=True`); and both at once ("k=2+zero3": 2
replicas of 2 devices, the token table and the logits split by columns too,
every weight sharded over the 2 replicas, so each device holds a quarter of
each split weight). Weights, gradients and Adam slots per device are set
against a quarter of their total. The global batch is the same everywhere.
"""

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.model_parallel import split_variables
from benchmarks import contenders
from benchmarks import models
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

DEVICES = 4
NAMES = ("k=1", "k=2", "k=4", "zero3", "k=2+zero3")
TP_ZERO3 = "k=2+zero3"
# (key in a child's result, label in the table)
MEMORY_ROWS = (("weight_mb_per_device_max", "weights/device max"),
               ("weight_mb_total", "weights, all devices"),
               ("optimizer_mb_per_device_max", "Adam/device max"),
               ("optimizer_mb_total", "Adam, all devices"),
               ("state_mb_per_device_max", "w+grad+Adam/dev max"),
               ("state_over_quarter", "  / (total / 4)"),
               ("peak_rss_mb", "peak RSS"))
# Megatron's split of a block: attention by heads, then a column-parallel
# Dense and a row-parallel one (one combine per pair, forward and backward).
LAYOUT = {
    ".*attention/(query|key|value)/kernel": (None, "model", None),
    ".*attention/(query|key|value)/bias": ("model", None),
    ".*attention/attention_output/kernel": ("model", None, None),
    ".*up/kernel": (None, "model"),
    ".*up/bias": ("model",),
    ".*down/kernel": ("model", None),
}
# With ZeRO-3 as well, the token table and the logits split by columns: the
# big weights left whole would sit on each replica's first device. (The table,
# sharded by rows, still looks up only the batch's rows.)
TP_ZERO3_LAYOUT = {**LAYOUT, ".*tokens/embeddings": (None, "model"),
                   ".*logits/kernel": (None, "model"),
                   ".*logits/bias": ("model",)}


def transformer(size, key="transformer", dropout=0.0):
  """Token embedding, `blocks` pre-norm blocks, logits over the vocabulary;
  `size[key]` is (vocabulary, sequence, width, heads, blocks). With a
  `dropout` rate, Megatron's dropouts after attention and after "down"."""
  vocab, seq, width, heads, blocks = size[key]

  def dropped(h, i, j):
    if not dropout:
      return h
    return keras.layers.Dropout(dropout, seed=j * blocks + i,
                                name=f"block{i}_dropout{j + 1}")(h)

  ids = keras.Input((seq,), dtype="int32")
  x = keras.layers.Embedding(vocab, width, name="tokens")(ids)
  for i in range(blocks):
    h = keras.layers.LayerNormalization(name=f"block{i}_norm1")(x)
    x = x + dropped(keras.layers.MultiHeadAttention(
        heads, width // heads, name=f"block{i}_attention")(
            h, h, use_causal_mask=True), i, 0)
    h = keras.layers.LayerNormalization(name=f"block{i}_norm2")(x)
    h = keras.layers.Dense(4 * width, activation="gelu", name=f"block{i}_up")(h)
    x = x + dropped(keras.layers.Dense(width, name=f"block{i}_down")(h), i, 1)
  x = keras.layers.LayerNormalization(name="final_norm")(x)
  return keras.Model(ids, keras.layers.Dense(vocab, name="logits")(x),
                     name="transformer")


def strategy(name):
  """The contender `name` over the first 4 devices."""
  if name == "zero3":
    return contenders.zero3(DEVICES)
  zero3 = name == TP_ZERO3
  k = int(name.removeprefix("k=").removesuffix("+zero3"))
  if k == 1:
    return contenders.contender("replicator", DEVICES)
  mesh = keras.distribution.DeviceMesh(
      (DEVICES // k, k), ("batch", "model"),
      keras.distribution.list_devices()[:DEVICES])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, layout in (TP_ZERO3_LAYOUT if zero3 else LAYOUT).items():
    layout_map[key] = layout
  return rs.ReplicatorStrategy(
      layout_map=layout_map, variable_partitioner=(
          tf.distribute.experimental.partitioners.FixedShardsPartitioner(
              DEVICES // k) if zero3 else None))


def gradient_bytes_by_device(weights):
  """Bytes of each weight's gradient, per device, as the strategy holds it in
  a traced step: as its components, a sharded weight's as its shards, a split
  one's as its parts (its gradient stays in parts), a mirrored one's on each
  replica."""
  by_device = {}
  for weight in weights:
    for component in weight.value.values:
      by_device[component.device] = by_device.get(component.device, 0) + (
          component.shape.num_elements() * component.dtype.size)
  return by_device


def model_parallel_child(options, spec):
  """In a child: the transformer with Adam under one contender; its bytes,
  peak memory, losses and fit step times."""
  size = options.size
  with strategy(spec).scope():
    keras.utils.set_random_seed(0)  # The same weights under every contender.
    model = transformer(size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
  vocab, seq = size["transformer"][:2]
  batch, steps = size["transformer_batch"], size["transformer_steps"]
  ids = np.random.default_rng(0).integers(
      0, vocab, size=(batch * steps, seq + 1)).astype("int32")
  timer = timing.StepTimer()
  history = model.fit(ids[:, :-1], ids[:, 1:], batch_size=batch, epochs=1,
                      shuffle=False, verbose=0, callbacks=[timer])
  split = [v for v in model.weights
           if isinstance(v.value, split_variables.SplitVariable)]
  return {"params": model.count_params(), "split_weights": len(split),
          "weight_bytes": models.bytes_by_device(model.weights),
          "optimizer_bytes": models.bytes_by_device(model.optimizer.variables),
          "gradient_bytes": gradient_bytes_by_device(model.trainable_weights),
          "peak_rss_mb": processes.peak_rss_mb(),
          "ms": timing.median_ms(timer.times[1:]),  # The first step traces.
          "step_ms": [1000 * t for t in timer.times[1:]],
          "loss": history.history["loss"]}


def model_parallel_rows(options, names=NAMES):
  """Fresh-process part: one child per contender, so peaks don't mix.

  `names`: the contenders (the tests run one); ratios are to k=1's.
  """
  if len(contenders.devices()) < DEVICES:
    return []
  runs = {name: processes.child(options, SECTION.name, model_parallel_child,
                                name)
          for name in names}
  params = next(iter(runs.values()))["params"]
  row = {"devices": DEVICES, "params": params,
         "adam_slot_mb": params * 4 / 2 ** 20,
         "split_weights": {n: r["split_weights"] for n, r in runs.items()},
         "agree": timing.agree([r["loss"] for r in runs.values()], rtol=1e-4),
         "ms": {n: r["ms"] for n, r in runs.items()},
         "step_ms": {n: r["step_ms"] for n, r in runs.items()},
         "peak_rss_mb": {n: r["peak_rss_mb"] for n, r in runs.items()}}
  for key in ("optimizer_bytes", "weight_bytes"):
    row[key.replace("bytes", "mb_per_device_max")] = {
        n: max(r[key].values()) / 2 ** 20 for n, r in runs.items()}
    row[key.replace("bytes", "mb_total")] = {
        n: sum(r[key].values()) / 2 ** 20 for n, r in runs.items()}
    row[key.replace("bytes", "devices")] = {
        n: len(r[key]) for n, r in runs.items()}
  state = {n: _summed(r["weight_bytes"], r["gradient_bytes"],
                      r["optimizer_bytes"]) for n, r in runs.items()}
  row["state_mb_per_device_max"] = {n: max(b.values()) / 2 ** 20
                                    for n, b in state.items()}
  # A quarter of one copy of the weights, their gradients and two Adam slots.
  quarter = 4 * params * 4 / DEVICES
  row["state_over_quarter"] = {n: max(b.values()) / quarter
                               for n, b in state.items()}
  tables.progress(SECTION.name, row)
  return [row]


def _summed(*by_devices):
  """Bytes per device, summed over several {device: bytes}."""
  total = {}
  for by_device in by_devices:
    for device, size in by_device.items():
      total[device] = total.get(device, 0) + size
  return total


def model_parallel_table(options, rows):
  size = options.size
  vocab, seq, width, heads, blocks = size["transformer"]
  lines = []
  for r in rows:
    names = list(r["ms"])
    ratios = [n for n in names if n != "k=1"] if "k=1" in names else []
    lines += ["", f"Model parallel (layout_map, k devices a replica) against "
              f"zero3: transformer, {blocks} block{'s' * (blocks > 1)}, "
              f"width {width}, {heads} heads, vocabulary {vocab}, sequence {seq} "
              f"({r['params'] / 1e6:.1f} M parameters), Adam, "
              f"{r['devices']} devices, global batch "
              f"{size['transformer_batch']}, MB (each in a fresh process; "
              f"one Adam slot = {r['adam_slot_mb']:.1f} MB)",
              f"{'':22} " + " ".join(f"{n:>9}" for n in names) + " " +
              " ".join(f"{n + '/k=1':>10}" for n in ratios)]
    for key, label in MEMORY_ROWS:
      if key in r:  # Rows written before the w+grad+Adam rows lack them.
        lines.append(_line(label, r[key], names, ratios,
                           ".2f" if key == "state_over_quarter" else ".1f"))
    lines.append(_line("fit step (ms, median)", r["ms"], names, ratios, ".2f") +
                 f"  losses agree {r['agree']}")
  return lines


def _line(label, values, names, ratios, fmt):
  """One measure: each contender's value, then `ratios`' to k=1's."""
  return (f"{label:22} {tables.cells(values, names, 9, fmt)} " +
          " ".join(f"{values[n] / values['k=1']:>10.2f}" for n in ratios))


SECTION = section.Section(
    name="model_parallel", measures="a transformer's weights split over k "
    "devices a replica (layout_map) against zero3, and both: memory, fit "
    "step",
    fresh=model_parallel_rows, child=model_parallel_child,
    table=model_parallel_table)
