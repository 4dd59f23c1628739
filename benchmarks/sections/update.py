"""The optimizer update alone, at the most replicas.

`optimizer.apply_gradients` inside `strategy.run`, timed on its own, for
MirroredStrategy, ReplicatorStrategy and ReplicatorStrategy with
shard_optimizer_state=True ("sharded"), with SGD and Adam, for the MLP at
each width of `update_hidden` (the benchmark's first).

Every replica starts each step from the same fixed gradients (made once,
outside the trace; replica r's are r + 1 times the first's), so the step is
the gradient exchange and the update and nothing else. Beside it, the same
gradients' exchange alone, as the update starts with it: an all-reduce for
mirrored state, and for sharded state too where the replicas share memory
(logical CPUs: each slices the one sum in place), else a reduce-scatter
(each `ReplicaContext` collective of every gradient, padded flat for
reduce_scatter as the sharded update does). "apply - exchange" is then the
update: for mirrored state every replica's whole update, for sharded state
the update of one shard per replica and the all-gather of the new weights.
"""

import itertools

import keras
import numpy as np
import tensorflow as tf

from benchmarks import contenders
from benchmarks import models
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

NAMES = ("mirrored", "replicator", "sharded")
MEASURES = ("apply", "exchange")


def update_rows(options, n):
  if not contenders.at_most_replicas(n):
    return []
  size = options.size
  rows = []
  for hidden, optimizer in itertools.product(size["update_hidden"],
                                             models.OPTIMIZERS):
    keras.utils.set_random_seed(0)
    weights = models.mlp(size, hidden).get_weights()
    rng = np.random.default_rng(1)
    grads = [1e-3 * rng.normal(size=w.shape).astype("float32")
             for w in weights]
    runs, finals = {}, {}
    for name in NAMES:
      finals[name] = _add_runs(runs, size, name, n, hidden, optimizer,
                               weights, grads)
    for fn in runs.values():  # Traces them.
      fn()
    times = timing.interleaved(runs, size["rounds"], calls=size["fit_steps"])
    rows.append({"optimizer": optimizer, "hidden": hidden,
                 "parameters": sum(w.size for w in weights),
                 "replicas": n,
                 "ms": {f"{name} {measure}": timing.median_ms(t)
                        for (name, measure), t in times.items()},
                 "agree": timing.agree(
                     [np.concatenate([w.ravel() for w in m.get_weights()])
                      for m in finals.values()], rtol=1e-4)})
    tables.progress(SECTION.name, rows[-1])
  return rows


def _add_runs(runs, size, name, n, hidden, optimizer, weights, grads):
  """Adds contender `name`'s apply and exchange to `runs`; its model."""
  strategy = contenders.contender(name, n)
  with strategy.scope():
    model = models.mlp(size, hidden)
    model.set_weights(weights)
    opt = models.OPTIMIZERS[optimizer]()
    opt.build(model.trainable_variables)
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda ctx: [tf.constant(g) * float(ctx.replica_id_in_sync_group + 1)
                   for g in grads])
  runs[name, "apply"] = _apply_fn(strategy, model, opt, per_replica)
  runs[name, "exchange"] = _exchange_fn(
      strategy, per_replica, scatter=name == "sharded" and
      not strategy.extended.communicator.shares_memory)
  return model


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


def update_table(options, rows):
  del options
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
                " ".join(f"{n:>10}" for n in NAMES) +
                f" {'S/mirrored':>10} {'S/replicator':>12}  agree"]
    by_measure = {m: {n: ms[f"{n} {m}"] for n in NAMES} for m in MEASURES}
    by_measure["update"] = {n: ms[f"{n} apply"] - ms[f"{n} exchange"]
                            for n in NAMES}
    model = f"{r['hidden']} ({r['parameters'] / 1e6:.3g})"
    for label, v in by_measure.items():
      lines.append(
          f"{model:12} {r['optimizer']:9} {label:9} " +
          tables.cells(v, NAMES, 10) +
          f" {v['sharded'] / v['mirrored']:>10.2f}"
          f" {v['sharded'] / v['replicator']:>12.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="update", measures="the optimizer update alone, mirrored and sharded",
    per_replicas=update_rows, table=update_table)
