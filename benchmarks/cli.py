"""The command line: parses flags, splits the CPU, runs sections, reports.

The parent runs one child process per replica count for the sections that
run per count (every contender in the same process, interleaved round by
round), then one launch of 2 workers and one process for the sections that
compare them, then the sections that start processes of their own; it
prints the tables and writes the JSON. `--child section:spec` makes a
process a child: it runs that one piece and prints its result as JSON.

A full run runs one child at a time, so that nothing disturbs a timing.
--quick checks that everything runs and agrees, not timings: its children
for the replica counts (two for the most replicas) and its workers run side
by side, and the parent runs the other children itself
(`processes.child`).
"""

import concurrent.futures
import dataclasses
import json
import os
import platform
import sys
import time

import keras
import tensorflow as tf

import replicator_strategy as rs
from benchmarks import contenders
from benchmarks import options as options_lib
from benchmarks import processes
from benchmarks.sections import REGISTRY

# The child kind that runs every per-count section for one replica count.
REPLICAS = "replicas"
# The child kind that runs every section compared on workers, in turn.
WORKERS = "workers"
DESCRIPTION = ("ReplicatorStrategy vs MirroredStrategy vs no strategy, side "
               "by side in one run.")


def main(argv=None):
  options = options_lib.parse(
      argv, DESCRIPTION, {name: s.measures for name, s in REGISTRY.items()})
  if options.threads:  # Before TensorFlow's runtime starts.
    tf.config.threading.set_intra_op_parallelism_threads(options.threads)
    tf.config.threading.set_inter_op_parallelism_threads(options.threads)
  if not tf.config.list_physical_devices("GPU"):
    rs.split_cpu(options.devices)
  if options.child:
    print(json.dumps(run_child(options)))
    return
  start = time.perf_counter()
  results = run(options)
  results["machine"] = machine(options)
  results["seconds"] = time.perf_counter() - start
  print(table(options, results))
  print(f"\n{json.dumps(results['machine'])}\ntotal {results['seconds']:.0f} s")
  if options.json:
    with open(options.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


def chosen(options):
  return [REGISTRY[name] for name in options.sections]


def run_child(options):
  """What `--child section:spec` asks for; "replicas:n" runs one count,
  "workers" every section compared on workers."""
  name, _, spec = options.child.partition(":")
  if name == REPLICAS:
    return {s.name: s.per_replicas(options, int(spec))
            for s in chosen(options) if s.per_replicas}
  if name == WORKERS:
    return workers_child(options, spec)
  return REGISTRY[name].child(options, spec)


def workers_child(options, spec):
  """Every chosen section's `on_workers` result, by name, one after another."""
  del spec
  return {s.name: s.on_workers(options)
          for s in chosen(options) if s.on_workers}


def run(options):
  """Every chosen section's rows, by name."""
  sections = chosen(options)
  on_workers = [s for s in sections if s.on_workers]
  with concurrent.futures.ThreadPoolExecutor() as pool:
    start = pool.submit if options.quick else _done
    per_count = [start(processes.fresh, child_options, REPLICAS, n)
                 for n, child_options in _per_count_children(options)]
    workers = (start(processes.on_two_workers, options, WORKERS)
               if on_workers else None)
    single = (processes.child(options, WORKERS, workers_child)
              if on_workers else None)
    fresh = {s.name: s.fresh(options) for s in sections if s.fresh}
    results = {name: [] for name in options.sections}
    for count in per_count:
      for name, rows in count.result().items():
        results[name] += rows
    for name, rows in fresh.items():
      results[name] += rows
    for s in on_workers:
      results[s.name] += s.workers_rows(
          options, single[s.name], [w[s.name] for w in workers.result()])
  return results


def _per_count_children(options):
  """(replica count, options) of each child that runs per-count sections.

  One child per count; --quick splits the most replicas' sections, most of
  the work, over two children (every other section each), so that the run
  does not wait on one long child.
  """
  per_count = tuple(s.name for s in chosen(options) if s.per_replicas)
  if not per_count:
    return []
  if not options.quick:
    return [(n, options) for n in contenders.replica_counts()]
  *fewer, most = contenders.replica_counts()
  return [(n, options) for n in fewer] + [
      (most, dataclasses.replace(options, sections=part))
      for part in (per_count[::2], per_count[1::2]) if part]


def _done(fn, *args):
  """`fn(*args)`, run now, as a finished future: a full run waits for it."""
  future = concurrent.futures.Future()
  future.set_result(fn(*args))
  return future


def table(options, results):
  lines = []
  for name, s in REGISTRY.items():
    lines += s.table(options, results.get(name, []))
  return "\n".join(lines)


def machine(options):
  return {"python": platform.python_version(), "tensorflow": tf.__version__,
          "keras": keras.__version__, "cpus": os.cpu_count(),
          "devices": list(contenders.devices()), "quick": options.quick,
          "worker threads": (options_lib.worker_threads()
                             if options.share_cores else "default"),
          "platform": platform.platform()}


if __name__ == "__main__":
  sys.exit(main())
