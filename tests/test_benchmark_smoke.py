"""The benchmark's quick mode: every contender runs and their results agree.

Timings are not checked (a unit test is no place for them); the full run and
its table live in docs/performance.md.
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

import pytest

BENCHMARK = (pathlib.Path(__file__).parent.parent / "benchmarks" /
             "compare_strategies.py")


@pytest.mark.slow
class BenchmarkSmokeTest(unittest.TestCase):

  def test_quick_run_covers_every_contender_and_they_agree(self):
    with tempfile.TemporaryDirectory() as out:
      path = pathlib.Path(out) / "results.json"
      done = subprocess.run(
          [sys.executable, str(BENCHMARK), "--quick", "--json", str(path)],
          capture_output=True, text=True, timeout=500, check=False)
      self.assertEqual(done.returncode, 0, done.stdout[-3000:] +
                       done.stderr[-5000:])
      results = json.loads(path.read_text())
    for section in ("fit", "custom"):
      rows = results[section]
      self.assertEqual({(r["model"], r["replicas"]) for r in rows},
                       {(m, n) for m in ("mlp", "convnet") for n in (1, 2, 4)})
      for row in rows:
        self.assertEqual(sorted(row["ms"]), ["mirrored", "none", "replicator"])
        self.assertTrue(all(ms > 0 for ms in row["ms"].values()), row)
        self.assertTrue(row["agree"], row)
    for row in results["allreduce"]:
      self.assertEqual(sorted(row["ms"]),
                       ["add_n floor", "mirrored", "replicator"])
      self.assertTrue(row["agree"], row)
    self.assertEqual({r["replicas"] for r in results["allreduce"]}, {2, 4})
    self.assertEqual(
        [(r["part"], r["replicas"]) for r in results["parts"]],
        [(part, 4) for part in
         ("forward", "+ backward", "+ all-reduce", "+ update")])
    for row in results["parts"]:
      self.assertEqual(sorted(row["ms"]),
                       ["mirrored", "none", "none, sliced", "replicator"])
      self.assertTrue(row["agree"], row)
    first = results["first"][0]
    for key in ("first_epoch_s", "peak_rss_mb"):
      self.assertEqual(sorted(first[key]), ["mirrored", "none", "replicator"])
      self.assertTrue(all(v > 0 for v in first[key].values()))
    self.assertTrue(results["multi"][0]["agree"], results["multi"])
    self.assertIn("Keras fit step, ms (median)", done.stdout)


if __name__ == "__main__":
  unittest.main()
