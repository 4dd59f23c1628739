"""`ReplicaContext.map_gather` against every replica running every thunk.

8 thunks, each the inverse of a 512 x 512 matrix (K-FAC's per-layer
inverses), on 2 and 4 replicas: with `map_gather` each replica inverts its
share and one all-reduce hands out the results; without, each inverts all 8.
MirroredStrategy has no `map_gather`, so every replica running every thunk
is the reference.
"""

import tensorflow as tf

from benchmarks import contenders
from benchmarks import section
from benchmarks import tables
from benchmarks import timing

WAYS = ("map_gather", "every replica")


def map_gather_rows(options, n):
  """One row per replica count: both ways' times, and whether they agree.

  Each returns, per replica, the sum of every inverse's elements: the same
  number both ways when every replica got every result.
  """
  if n < 2:
    return []
  count, size = options.size["map_gather_inverses"]
  strategy = contenders.contender("replicator", n)
  runs = {way: _inverses_fn(strategy, count, size, way) for way in WAYS}
  firsts = {way: fn() for way, fn in runs.items()}  # Traces them too.
  times = timing.interleaved(runs, options.size["allreduce_repeats"])
  row = {"replicas": n, "inverses": count, "size": size,
         "ms": {way: timing.median_ms(times[way]) for way in WAYS},
         "agree": timing.agree(firsts.values(), rtol=1e-4)}
  tables.progress(SECTION.name, row)
  return [row]


def _inverses_fn(strategy, count, size, way):
  """A traced `strategy.run` of `count` inverses; a number per replica."""
  # Made once, outside the trace, so that nothing is constant-folded: the
  # same well-conditioned matrices on every replica.
  def matrices(ctx):
    del ctx
    a = tf.random.stateless_normal([count, size, size], seed=[1, 2])
    return tf.eye(size) * size + tf.matmul(a, a, transpose_b=True) / size

  inputs = strategy.experimental_distribute_values_from_function(matrices)

  def replica_fn(x):
    thunks = [lambda k=k: tf.linalg.inv(x[k]) for k in range(count)]
    if way == "map_gather":
      results = tf.distribute.get_replica_context().map_gather(thunks)
    else:
      results = [thunk() for thunk in thunks]
    return tf.add_n([tf.reduce_sum(r) for r in results])

  run = tf.function(lambda: strategy.run(replica_fn, (inputs,)))
  return lambda: [float(v) for v in strategy.experimental_local_results(run())]


def map_gather_table(options, rows):
  del options
  if not rows:
    return []
  lines = ["", f"map_gather vs every replica running every thunk: "
           f"{rows[0]['inverses']} inverses of {rows[0]['size']} x "
           f"{rows[0]['size']} float32, ms (median)",
           f"{'replicas':>8} {'map_gather':>10} {'every replica':>13} "
           f"{'ratio':>6}  agree"]
  for r in rows:
    ms = r["ms"]
    lines.append(
        f"{r['replicas']:>8} {ms['map_gather']:>10.2f} "
        f"{ms['every replica']:>13.2f} "
        f"{ms['map_gather'] / ms['every replica']:>6.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="mapgather",
    measures="map_gather of 8 matrix inverses against every replica "
             "inverting all 8",
    per_replicas=map_gather_rows, table=map_gather_table)
