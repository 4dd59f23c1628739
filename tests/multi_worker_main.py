"""One worker of a multi-worker test: `python tests/multi_worker_main.py RUNS OUT_DIR [TIMEOUT]`.

Started by `replicator_strategy.cli.launch` (which sets TF_CONFIG); runs the
comma-separated `multi_worker_runs.RUNS` and writes their results to
OUT_DIR/worker_<index>.json as {run: results}.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# The runs import test modules by name; they live in tests/<subsystem>/.
sys.path[1:1] = sorted(str(d) for d in pathlib.Path(__file__).parent.iterdir()
                       if d.is_dir() and d.name[0] not in "._")

import replicator_strategy as rs  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

# MULTI_WORKER_DEVICES="2,3": worker i gets the i-th count (default 2 each).
_COUNTS = os.environ.get("MULTI_WORKER_DEVICES", "2,2").split(",")
rs.split_cpu(int(_COUNTS[json.loads(os.environ["TF_CONFIG"])["task"]["index"]]))
# MULTI_WORKER_SHARD_OPTIMIZER_STATE=1: the strategy shards optimizer state.
# MULTI_WORKER_VARIABLE_SHARDS=K: it cuts every weight into K shards.
# MULTI_WORKER_GRADIENT_COMPRESSION=bfloat16: its gradient all-reduce is 16-bit.
_SHARDS = os.environ.get("MULTI_WORKER_VARIABLE_SHARDS")
STRATEGY = rs.ReplicatorStrategy(
    timeout_seconds=float(sys.argv[3]) if len(sys.argv) > 3 else 60,
    shard_optimizer_state=bool(
        os.environ.get("MULTI_WORKER_SHARD_OPTIMIZER_STATE")),
    variable_partitioner=(
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            int(_SHARDS)) if _SHARDS else None),
    gradient_compression=os.environ.get("MULTI_WORKER_GRADIENT_COMPRESSION"))

import multi_worker_runs  # pylint: disable=g-import-not-at-top


def main(runs, out_dir, timeout=None):
  del timeout  # Read above, before the strategy starts.
  results = {}
  for run in runs.split(","):
    extra = (out_dir,) if run in multi_worker_runs.TAKES_WORKDIR else ()
    results[run] = multi_worker_runs.RUNS[run](STRATEGY, *extra)
  index = STRATEGY.extended.cluster.worker_index
  path = pathlib.Path(out_dir) / f"worker_{index}.json"
  path.write_text(json.dumps(results))


if __name__ == "__main__":
  main(*sys.argv[1:])
