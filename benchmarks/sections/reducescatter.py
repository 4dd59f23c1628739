"""`ReplicaContext.reduce_scatter` against `all_reduce` of the same tensor.

16 MB on 2 and 4 replicas, through merge_call and inside a `tf.cond`
(run-time collectives). MirroredStrategy has no reduce_scatter in replica
context and refuses a collective inside `tf.cond`, so its merge_call
all_reduce of the same tensor stands beside ours as the reference.
"""

import tensorflow as tf

from benchmarks import contenders
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

PATHS = ("merge_call", "in tf.cond")


def reduce_scatter_rows(options, n):
  """One row per path: ours both ways, MirroredStrategy's all_reduce beside.

  Replica r holds (r + 1) + i / size at element i, so slice r of the sum
  starts with n (n + 1) / 2 + r: each contender returns that one number per
  replica (the reduce_scatter's first element, the all_reduce's element at
  slice r's start), which times the exchange, not a copy out, and checks
  that reduce_scatter's slices are the all_reduce's.
  """
  if n < 2:
    return []
  size = int(options.size["reduce_scatter_mb"] * 2 ** 20 / 4) // n * n
  runs = {}
  for path in PATHS:
    for name in ("reduce_scatter", "all_reduce"):
      runs[path, name] = _collective_fn(
          contenders.contender("replicator", n), size, name,
          in_cond=path == "in tf.cond")
  runs["merge_call", "mirrored all_reduce"] = _collective_fn(
      contenders.contender("mirrored", n), size, "all_reduce", in_cond=False)
  firsts = {key: fn() for key, fn in runs.items()}  # Traces them too.
  times = timing.interleaved(runs, options.size["allreduce_repeats"])
  rows = []
  for path in PATHS:
    of_path = [key for key in runs if key[0] == path]
    rows.append({"path": path, "replicas": n,
                 "mb": size * 4 / 2 ** 20,
                 "ms": {name: timing.median_ms(times[path, name])
                        for _, name in of_path},
                 "agree": timing.agree(
                     [firsts[key] for key in of_path] +
                     [[n * (n + 1) / 2 + r for r in range(n)]], rtol=1e-6)})
    tables.progress(SECTION.name, rows[-1])
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


def reduce_scatter_table(options, rows):
  del options
  if not rows:
    return []
  lines = ["", f"reduce_scatter vs all_reduce in replica context, "
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
  return lines


SECTION = section.Section(
    name="reducescatter",
    measures="reduce_scatter against all_reduce, merge_call and in tf.cond",
    per_replicas=reduce_scatter_rows, table=reduce_scatter_table)
