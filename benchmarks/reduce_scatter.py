"""reduce_scatter vs all_reduce of the same tensor, in replica context, one process.

Each replica holds one float32 tensor of --mb MB; a traced `strategy.run`
calls `ReplicaContext.reduce_scatter("sum", x)` or `all_reduce("sum", x)`,
both through merge_call and inside a `tf.cond` (run-time collectives: an
all-to-all then a local sum, against TF's collective all-reduce). The
contenders run interleaved, round by round; the table shows median ms.

  python benchmarks/reduce_scatter.py --replicas 4 --mb 16 --rounds 20
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
# pylint: enable=g-import-not-at-top


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replicas", type=int, default=4,
                      help="logical CPU devices, one replica each")
  parser.add_argument("--mb", type=float, default=16.0,
                      help="megabytes of float32 per replica")
  parser.add_argument("--rounds", type=int, default=20,
                      help="timed calls of each contender")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed calls of each contender first")
  return parser.parse_args()


def contenders(strategy, size):
  """name -> traced step returning every replica's result's first element."""
  # Inputs made once, outside the trace, so that nothing is constant-folded.
  inputs = strategy.experimental_distribute_values_from_function(
      lambda context: tf.fill([size], float(context.replica_id_in_sync_group)))

  def make(collective, in_cond):
    def replica_fn(x):
      ctx = tf.distribute.get_replica_context()
      call = lambda: collective(ctx, x)
      if in_cond:
        y = tf.cond(ctx.replica_id_in_sync_group >= 0, call, call)
      else:
        y = call()
      return y[0]  # Fetch one number: time the exchange, not the copy out.

    return tf.function(lambda: strategy.run(replica_fn, (inputs,)))

  reduce_scatter = lambda ctx, x: ctx.reduce_scatter("sum", x)
  all_reduce = lambda ctx, x: ctx.all_reduce("sum", x)
  return {
      "reduce_scatter (merge_call)": make(reduce_scatter, False),
      "all_reduce (merge_call)": make(all_reduce, False),
      "reduce_scatter (in tf.cond)": make(reduce_scatter, True),
      "all_reduce (in tf.cond)": make(all_reduce, True),
  }


def main():
  args = parse_args()
  rs.split_cpu(args.replicas)
  strategy = rs.ReplicatorStrategy(
      devices=[f"/cpu:{i}" for i in range(args.replicas)])
  n = args.replicas
  size = int(args.mb * 2**20 / 4) // n * n
  steps = contenders(strategy, size)
  times = {name: [] for name in steps}
  firsts = {}
  for name, step in steps.items():
    for _ in range(args.warmup):
      firsts[name] = [float(v) for v in
                      strategy.experimental_local_results(step())]
  for _ in range(args.rounds):
    for name, step in steps.items():
      start = time.perf_counter()
      tf.nest.map_structure(np.asarray,
                            strategy.experimental_local_results(step()))
      times[name].append(time.perf_counter() - start)
  expected = float(sum(range(n)))
  for name, got in firsts.items():
    assert got == [expected] * n, (name, got)
  print(f"{n} replicas, {size * 4 / 2**20:.1f} MB float32 each, "
        f"median of {args.rounds} (tf.function, CPU)")
  for name, measured in times.items():
    print(f"  {name:30s} {1000 * statistics.median(measured):9.2f} ms")


if __name__ == "__main__":
  main()
