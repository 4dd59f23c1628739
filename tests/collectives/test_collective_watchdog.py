"""The collective watchdog: long runs stay flat, stalls and mismatches fail clearly.

Each case runs in its own process (tests/watchdog_main.py): an abort ends
every collective of the process that sees it.
"""

import functools
import json
import os
import subprocess
import sys
import unittest

from parameterized import parameterized
import pytest

MAIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "watchdog_main.py")


@functools.cache
def run_main(*args, timeout=300):
  """The JSON line of `watchdog_main.py ARGS`, run once; read it only."""
  done = subprocess.run([sys.executable, MAIN, *map(str, args)],
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
class LongRunTest(unittest.TestCase):
  """10,000 steps with a collective inside tf.cond on each: no growth.

  Past the ~3,000 steps after which such a fit used to abort; the ~0.9 MiB
  per 1,000 steps it used to grow by would be twice the bound between the
  first and last samples.
  """

  def assert_flat(self, samples):
    first, last = samples[0], samples[-1]
    self.assertEqual(len(samples), 10)
    # Before: +4 threads a step (8,016 after 2,000 steps), then an abort.
    self.assertLessEqual(last["threads"], first["threads"] + 2, samples)
    # Before: ~0.9 MiB more every 1,000 steps (TF's per-key records).
    self.assertLess(last["rss_mib"] - first["rss_mib"], 4.0, samples)

  def test_custom_loop_with_a_collective_in_cond(self):
    self.assert_flat(run_main("long_custom_loop", 10000, 1000)["samples"])

  def test_fit_with_gradient_accumulation(self):
    self.assert_flat(run_main("long_fit", 10000, 1000)["samples"])


@pytest.mark.slow
class StallAndMismatchTest(unittest.TestCase):

  def test_a_replica_left_waiting_fails_after_the_timeout_naming_it(self):
    got = run_main("after_a_timeout", "op_mismatch")["stall"]
    self.assertEqual(got["error"], "DeadlineExceededError")
    self.assertGreater(got["seconds"], 2.0)
    self.assertLess(got["seconds"], 15.0)
    self.assertIn("made no progress for 2 s (timeout_seconds)", got["message"])
    self.assertIn("device:CPU:0) waits in collective #1: all_reduce SUM "
                  "float32[]", got["message"])
    self.assertIn("device:CPU:1) completed its 0 collectives and waits in none",
                  got["message"])

  def test_replicas_calling_different_collectives_fail_at_once(self):
    for case, ops in [("op_mismatch", ("all_reduce SUM float32[]",
                                       "all_reduce MAX float32[]")),
                      ("shape_mismatch", ("all_reduce SUM float32[2]",
                                          "all_reduce SUM float32[3]"))]:
      with self.subTest(case):
        got = run_main(case)
        self.assertEqual(got["error"], "DeadlineExceededError")
        # The timeout is 60 s: the mismatch is seen without waiting it out.
        self.assertLess(got["seconds"], 15.0)
        self.assertIn("replicas called different collectives at the same "
                      "point", got["message"])
        self.assertIn(f"CPU:0): {ops[0]}", got["message"])
        self.assertIn(f"CPU:1): {ops[1]}", got["message"])

  def test_after_a_timeout_a_mismatch_gets_the_abort_report_at_once(self):
    # The second used to get TF's bare "Function was cancelled before it was
    # started": TF keeps the process's collectives aborted, for a new
    # strategy too.
    after = run_main("after_a_timeout", "op_mismatch")
    for attempt in ("first", "again"):
      got = after[attempt]
      with self.subTest(attempt):
        self.assertEqual(got["error"], "CancelledError")
        self.assertLess(got["seconds"], 1.0)
        self.assertIn("every collective of this process was aborted earlier",
                      got["message"])
        self.assertIn("Restart the process", got["message"])
        self.assertIn("made no progress for 2 s (timeout_seconds)",
                      got["message"])
        self.assertIn("waits in collective #1: all_reduce SUM float32[]",
                      got["message"])


@pytest.mark.slow
class AcrossWorkersTest(unittest.TestCase):

  @parameterized.expand([("dataset_lengths", "rows"),
                         ("batch_sizes", "batch_size")])
  def test_workers_with_different_step_counts_say_where_each_waits(
      self, _, what):
    done = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers", "2",
         "--timeout", "120", "--output", "all", "--", sys.executable, MAIN,
         "uneven_steps", what],
        capture_output=True, text=True, timeout=180, check=False)
    results = {}
    for line in done.stdout.splitlines():
      prefix, _, rest = line.partition("] ")
      if rest.startswith("{"):
        results[prefix] = json.loads(rest)
    self.assertEqual(sorted(results), ["[worker 0", "[worker 1"], done.stdout)
    for worker, got in results.items():
      with self.subTest(worker):
        self.assertEqual(got["error"], "DeadlineExceededError")
        self.assertLess(got["seconds"], 30.0)  # timeout_seconds=5.
    # Worker 0 ran out of data and waits in an eager reduce at the end of the
    # epoch; worker 1 waits for it in its next step's all-reduce. Each error
    # says both, in its own report or in the other worker's (whichever abort
    # comes first).
    for worker, got in results.items():
      with self.subTest(worker):
        self.assertIn("On worker ", got["message"])
        self.assertIn("waits in an eager reduce across 2 workers",
                      got["message"])
        self.assertIn("replica 0 (/job:worker/replica:0/task:1/device:CPU:0) "
                      "waits in collective #", got["message"])
        self.assertIn("the same dataset length and global batch size",
                      got["message"])


if __name__ == "__main__":
  unittest.main()
