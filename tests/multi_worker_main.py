"""One worker of a multi-worker test: `python tests/multi_worker_main.py RUNS OUT_DIR [TIMEOUT]`.

Started by `replicator_strategy.cli.launch` (which sets TF_CONFIG); runs the
comma-separated run specs RUNS in turn, each on a strategy with the options
it names (`multi_worker_runs.parse`), and writes their results to
OUT_DIR/worker_<index>.json as {spec: results}. A run that takes a working
directory gets OUT_DIR/<spec>.
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

# MULTI_WORKER_DEVICES="2,3": worker i gets the i-th count (default 2 each).
_COUNTS = os.environ.get("MULTI_WORKER_DEVICES", "2,2").split(",")
rs.split_cpu(int(_COUNTS[json.loads(os.environ["TF_CONFIG"])["task"]["index"]]))
# A shared launch runs several runs back to back: on a loaded 2-core machine
# one worker can trace a run's graphs for over a minute while the other waits
# in a collective. The fault tests pass their own short timeout.
_TIMEOUT = float(sys.argv[3]) if len(sys.argv) > 3 else 300


_strategies = {}  # A run spec's option names ("bfloat16+4_shards") -> strategy.


def strategy(option_names="", options=None):
  """The strategy a run spec's options (`options`, named `option_names`) ask
  for, made once."""
  if option_names not in _strategies:
    _strategies[option_names] = rs.ReplicatorStrategy(
        timeout_seconds=_TIMEOUT, **(options or {}))
  return _strategies[option_names]


strategy()  # Joins the cluster before any TensorFlow op; the others follow.

import multi_worker_runs  # pylint: disable=g-import-not-at-top


def main(runs, out_dir, timeout=None):
  del timeout  # Read above, before the strategy starts.
  results = {}
  for spec in runs.split(","):
    name, options = multi_worker_runs.parse(spec)
    extra = ()
    if name in multi_worker_runs.TAKES_WORKDIR:
      extra = (pathlib.Path(out_dir, spec),)
      extra[0].mkdir(exist_ok=True)
    results[spec] = multi_worker_runs.RUNS[name](
        strategy(spec.partition("@")[2], options), *extra)
  index = strategy().extended.cluster.worker_index
  path = pathlib.Path(out_dir) / f"worker_{index}.json"
  path.write_text(json.dumps(results))


if __name__ == "__main__":
  main(*sys.argv[1:])
