"""What a traced step pays to exchange between workers, beside one process.

Traced steps that all-reduce nothing, two scalars, or the MLP's gradients
(2.7 MB) in `strategy.run`, and beside them the same math on the replicas'
devices in a plain `tf.function`, on 1 process x 4 and 2 workers x 2.

A `strategy.run` step also all-reduces each replica's rows (the batch share
Keras's loss scaling reads): in one process that is pruned when unused;
across workers it is a collective, so it runs in every step.
"""

import statistics

import tensorflow as tf

import replicator_strategy as rs
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing
from benchmarks.sections import multi

EXCHANGES = ("tf.function", "run, nothing", "run, 2 scalars",
             "run, gradients")


def _step(strategy, values, exchange):
  """A traced step for one of `EXCHANGES`."""
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


def exchange_on_workers(options):
  """In one process or a worker: each exchange's ms (median), and the sums."""
  size = options.size
  strategy = rs.ReplicatorStrategy()
  shapes = [w.shape for w in models.initial_weights(size, "mlp")]
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.fill(s, float(ctx.replica_id_in_sync_group + 1))
                   for s in shapes] + [tf.constant(1.0), tf.constant(2.0)])
  steps = {exchange: _step(strategy, values, exchange)
           for exchange in EXCHANGES}
  for fn in steps.values():  # Traces them.
    fn()
  # The sums, the same on every replica of every worker.
  results = {exchange: float(strategy.experimental_local_results(
      steps[exchange]())[0]) for exchange in ("run, 2 scalars",
                                              "run, gradients")}
  times = timing.interleaved(steps, size["rounds"] * size["fit_steps"])
  return {"ms": {e: timing.median_ms(t) for e, t in times.items()},
          "results": results}


def exchange_rows(options, single, workers):
  del options
  row = {"ms": {f"{exchange}, {where}": statistics.median(
      r["ms"][exchange] for r in results)
                for where, results in zip(multi.WHERE, ([single], workers))
                for exchange in EXCHANGES},
         "agree": all(w["results"] == single["results"] for w in workers)}
  tables.progress(SECTION.name, row)
  return [row]


def exchange_table(options, rows):
  del options
  lines = []
  for r in rows:
    lines += ["", "Exchange alone: a traced strategy.run step that all-reduces "
              "nothing, two scalars or the MLP's gradients (2.7 MB), and the "
              "same math in a plain tf.function on the replicas' devices, ms "
              "(median; across workers every run also all-reduces the "
              "replicas' rows, the batch share)",
              f"{'exchange':14} {'1 x 4':>7} {'2 x 2':>7} {'2x2 - 1x4':>10} "
              f"agree"]
    for exchange in EXCHANGES:
      one, two = (r["ms"][f"{exchange}, {where}"] for where in multi.WHERE)
      lines.append(f"{exchange:14} {one:>7.2f} {two:>7.2f} {two - one:>10.2f} "
                   f"{r['agree']}")
  return lines


SECTION = section.Section(
    name="exchange", measures="what a traced step pays to exchange",
    on_workers=exchange_on_workers, workers_rows=exchange_rows,
    table=exchange_table)
