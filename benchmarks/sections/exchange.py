"""What a traced step pays to exchange between workers, beside one process.

Traced steps that all-reduce nothing, two scalars, or the MLP's gradients
(2.7 MB) in `strategy.run`, and beside them the same math on the replicas'
devices in a plain `tf.function`, on 1 process x 4 and 2 workers x 2; and a
traced copy of the gradients into one buffer on one device ("copy"), the
memcpy floor of the exchange.

The anchor: `tf.distribute.MultiWorkerMirroredStrategy`'s custom-loop
all-reduce of the same gradients, on the same runtime (TF's collective ops
over gRPC), in 2 workers of their own (it joins its own cluster). On CPUs it
runs one replica per worker, each holding its worker's two replicas' sum, so
its sums equal ours.

Across workers the batch share (the rows Keras's loss scaling reads) is
exchanged only where a step reads it: none of these steps does.
"""

import statistics

import tensorflow as tf

import replicator_strategy as rs
from benchmarks import models
from benchmarks import processes
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import multi

EXCHANGES = ("tf.function", "run, nothing", "run, 2 scalars",
             "run, gradients", "copy")
# The anchor's steps, under MultiWorkerMirroredStrategy.
ANCHOR = ("run, nothing", "run, gradients")
MWMS = "mwms"


def _replica_fn(exchange):
  """The function `strategy.run` runs for one of `EXCHANGES`."""

  def replica_fn(values):
    ctx = tf.distribute.get_replica_context()
    grads, scalars = values[:-2], values[-2:]
    if exchange == "run, 2 scalars":
      return ctx.all_reduce("sum", scalars)[0]
    if exchange == "run, gradients":
      return ctx.all_reduce("sum", grads)[-1][0]
    return grads[-1][0] * 2

  return replica_fn


def _local_fn(strategy, values, exchange):
  """A plain traced function: the last gradient doubled on each replica's
  device, or every gradient of the first replica copied into one buffer."""
  firsts = strategy.experimental_local_results(values)[0]
  if exchange == "copy":
    grads = firsts[:-2]

    def copy():
      with tf.device(grads[0].device):
        return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)[-1]
    return tf.function(copy)
  last_grads = [v[-3] for v in strategy.experimental_local_results(values)]

  def by_hand():
    results = []
    for part in last_grads:
      with tf.device(part.device):
        results.append(part[0] * 2)
    return results
  return tf.function(by_hand)


def _timed(strategy, values, exchanges, size):
  """Each exchange's ms (median) and the all-reduced gradients' sum."""
  steps = {e: (_local_fn(strategy, values, e) if e in ("tf.function", "copy")
               else tf.function(lambda e=e: strategy.run(
                   _replica_fn(e), (values,))))
           for e in exchanges}
  for fn in steps.values():  # Traces them.
    fn()
  results = {e: float(strategy.experimental_local_results(steps[e]())[0])
             for e in ("run, 2 scalars", "run, gradients") if e in steps}
  times = timing.interleaved(steps, size["rounds"] * size["fit_steps"])
  return {"ms": {e: timing.median_ms(t) for e, t in times.items()},
          "results": results}


def _shapes(size):
  return [w.shape for w in models.initial_weights(size, "mlp")]


def exchange_on_workers(options):
  """In one process or a worker: each exchange's ms (median), and the sums."""
  strategy = rs.ReplicatorStrategy()
  shapes = _shapes(options.size)
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.fill(s, float(ctx.replica_id_in_sync_group + 1))
                   for s in shapes] + [tf.constant(1.0), tf.constant(2.0)])
  return _timed(strategy, values, EXCHANGES, options.size)


def exchange_child(options, spec):
  """In each of 2 workers of their own (`spec` is `MWMS`): the anchor's
  steps."""
  del spec  # The anchor is this section's only child.
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  shapes = _shapes(options.size)
  m = options.devices  # Our replicas per worker: the anchor holds their sum.
  worker = strategy.cluster_resolver.task_id
  fill = float(worker * m * m + m * (m + 1) // 2)
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.fill(s, fill) for s in shapes] +
      [tf.constant(1.0), tf.constant(2.0)])
  return _timed(strategy, values, ANCHOR, options.size)


def exchange_rows(options, single, workers):
  anchor = processes.on_two_workers(options, SECTION.name, MWMS)
  row = {"ms": {f"{exchange}, {where}": statistics.median(
      r["ms"][exchange] for r in results)
                for where, results in zip(multi.WHERE, ([single], workers))
                for exchange in EXCHANGES},
         "anchor ms": {exchange: statistics.median(
             r["ms"][exchange] for r in anchor) for exchange in ANCHOR},
         "agree": all(w["results"] == single["results"] for w in workers) and
                  all(a["results"]["run, gradients"] ==
                      single["results"]["run, gradients"] for a in anchor)}
  tables.progress(SECTION.name, row)
  return [row]


def costs(row):
  """The figures the targets name, ms: the gradients' all-reduce between
  workers (ours and the anchor's: the step less the same step exchanging
  nothing), the memcpy floor, and an empty step's cost across workers."""
  one, two = multi.WHERE
  ms, anchor = row["ms"], row["anchor ms"]
  return {
      "gradients": ms[f"run, gradients, {two}"] - ms[f"run, nothing, {two}"],
      "anchor gradients": anchor["run, gradients"] - anchor["run, nothing"],
      "copy": ms[f"copy, {one}"],
      "empty step": ms[f"run, nothing, {two}"] - ms[f"run, nothing, {one}"],
  }


def exchange_table(options, rows):
  del options
  lines = []
  for r in rows:
    lines += ["", "Exchange alone: a traced strategy.run step that all-reduces "
              "nothing, two scalars or the MLP's gradients (2.7 MB), the "
              "same math in a plain tf.function on the replicas' devices, "
              "and the gradients copied into one buffer (copy), ms (median)",
              f"{'exchange':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2 - 1x4':>10} "
              f"agree"]
    for exchange in EXCHANGES:
      one, two = (r["ms"][f"{exchange}, {where}"] for where in multi.WHERE)
      lines.append(f"{exchange:14} {one:>7.2f} {two:>7.2f} {two - one:>10.2f} "
                   f"{r['agree']}")
    c = costs(r)
    anchor = r["anchor ms"]
    lines += [
        "",
        f"MultiWorkerMirroredStrategy, 2 workers x 1 (the anchor), ms: "
        f"run, nothing {anchor['run, nothing']:.2f}; run, gradients "
        f"{anchor['run, gradients']:.2f}",
        f"gradient all-reduce between workers (2 x 2 run, gradients - run, "
        f"nothing): ours {c['gradients']:.2f} ms, anchor "
        f"{c['anchor gradients']:.2f} ms, copy floor {c['copy']:.2f} ms; "
        f"ours / anchor {c['gradients'] / c['anchor gradients']:.2f}, "
        f"ours / copy {c['gradients'] / c['copy']:.1f}",
        f"empty step's cost across workers (run, nothing: 2 x 2 - 1 x 4): "
        f"{c['empty step']:.2f} ms"]
  return lines


SECTION = section.Section(
    name="exchange", measures="what a traced step pays to exchange",
    on_workers=exchange_on_workers, workers_rows=exchange_rows,
    child=exchange_child, table=exchange_table)
