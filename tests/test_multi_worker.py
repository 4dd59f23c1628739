"""2 workers x 2 logical CPUs on 127.0.0.1 equal one process with 4 replicas.

Each test starts real worker processes through the launcher (TF_CONFIG, TF's
gRPC runtime and collective ops), bounded in time; the launcher stops every
process it started. The 4-replica reference runs in this process, on the
same code (`multi_worker_runs`).
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import pytest

import multi_worker_runs
import topology

TESTS = pathlib.Path(__file__).parent
LAUNCH_TIMEOUT = 240


def launch_workers(runs, num_workers=2):
  """Runs `runs` on `num_workers` workers; returns each worker's results."""
  with tempfile.TemporaryDirectory() as out:
    done = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.launch", "--workers",
         str(num_workers), "--timeout", str(LAUNCH_TIMEOUT), "--",
         sys.executable, str(TESTS / "multi_worker_main.py"), ",".join(runs),
         out],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT + 30,
        check=False)
    if done.returncode != 0:
      raise AssertionError(f"workers failed ({done.returncode}):\n"
                           f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    return [json.loads((pathlib.Path(out) / f"worker_{i}.json").read_text())
            for i in range(num_workers)]


def assert_close_nested(test, actual, expected, rtol=1e-5, atol=1e-6):
  if isinstance(expected, dict):
    test.assertEqual(sorted(actual), sorted(expected))
    for key in expected:
      assert_close_nested(test, actual[key], expected[key], rtol, atol)
  elif isinstance(expected, list) and len({np.shape(e) for e in expected}) > 1:
    test.assertEqual(len(actual), len(expected))  # Weights of several shapes.
    for a, e in zip(actual, expected):
      assert_close_nested(test, a, e, rtol, atol)
  else:
    np.testing.assert_allclose(np.asarray(actual, dtype=float),
                               np.asarray(expected, dtype=float),
                               rtol=rtol, atol=atol)


@pytest.mark.slow
class TwoWorkersTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.workers = launch_workers(["primitives", "custom_loop", "keras_fit"])

  def test_workers_agree_on_everything_but_their_replica_ids(self):
    first, second = self.workers
    for mode in ("eager", "function"):
      self.assertEqual(first["primitives"][mode].pop("id"), [0.0, 1.0])
      self.assertEqual(second["primitives"][mode].pop("id"), [2.0, 3.0])
    self.assertEqual(first, second)

  def test_collectives_span_every_replica_of_every_worker(self):
    for mode in ("eager", "function"):
      got = self.workers[0]["primitives"][mode]
      self.assertEqual(got["sum"], [6.0, 6.0])  # 0 + 1 + 2 + 3
      self.assertEqual(got["mean"], [1.5, 1.5])
      self.assertEqual(got["min"], [1.0, 1.0])
      self.assertEqual(got["max"], [3.0, 3.0])
      self.assertEqual(got["broadcast"], [30.0, 30.0])  # From worker 1.
      self.assertEqual(got["all_gather"], [[0.0, 1.0, 2.0, 3.0]] * 2)
      self.assertEqual(got["merge_call"], [6.0])
      self.assertEqual(got["reduce"],
                       {"sum": 6.0, "mean": 1.5, "min": 0.0, "max": 3.0})
      self.assertEqual(got["gather"], [0.0, 1.0, 2.0, 3.0])
    self.assertEqual(self.workers[0]["primitives"]["function"]["in_cond"],
                     [3.0, 3.0])

  def test_unseeded_variables_start_from_the_chiefs_value(self):
    values = [w["primitives"]["unseeded_variable"] for w in self.workers]
    self.assertEqual(values[0], values[1])

  def test_custom_loop_equals_one_process_with_four_replicas(self):
    expected = multi_worker_runs.custom_loop(topology.strategy_over(4))
    for worker in self.workers:
      assert_close_nested(self, worker["custom_loop"], expected)

  def test_keras_fit_evaluate_predict_equal_one_process_with_four_replicas(
      self):
    expected = multi_worker_runs.keras_fit(topology.strategy_over(4))
    self.assertEqual(len(expected["predict"]), 27)
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit"], expected)


if __name__ == "__main__":
  unittest.main()
