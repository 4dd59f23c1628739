"""The local multi-worker launcher: TF_CONFIG, prefixes, failing fast, clean-up.

Workers here are small Python scripts, not TensorFlow programs, so the tests
check the launcher alone and run in seconds.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCH = [sys.executable, "-m", "replicator_strategy.launch"]


def launch(*args, timeout=120):
  return subprocess.run(LAUNCH + list(args), capture_output=True, text=True,
                        timeout=timeout, check=False)


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie not yet reaped by init counts as gone.
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return not (stat.exists() and stat.read_text().split()[2] == "Z")


class LaunchTest(unittest.TestCase):

  def test_each_worker_gets_its_tf_config_and_a_prefix(self):
    script = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
              "print(json.dumps(c))")
    done = launch("--workers", "3", "--", sys.executable, "-c", script)
    self.assertEqual(done.returncode, 0, done.stderr)
    configs = {}
    for line in done.stdout.splitlines():
      prefix, _, payload = line.partition("] ")
      configs[prefix + "]"] = json.loads(payload)
    self.assertEqual(sorted(configs), [f"[worker {i}]" for i in range(3)])
    cluster = configs["[worker 0]"]["cluster"]["worker"]
    self.assertEqual(len(set(cluster)), 3)
    for i in range(3):
      config = configs[f"[worker {i}]"]
      self.assertEqual(config["cluster"]["worker"], cluster)
      self.assertEqual(config["task"], {"type": "worker", "index": i})
    for address in cluster:
      host, port = address.split(":")
      self.assertEqual(host, "127.0.0.1")
      self.assertGreater(int(port), 0)

  def test_a_failing_worker_stops_the_others_and_their_children(self):
    with tempfile.TemporaryDirectory() as tmp:
      script = (
          "import json, os, subprocess, sys, time\n"
          "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
          "child = subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(120)'])\n"
          f"open(os.path.join({tmp!r}, f'pids{{i}}'), 'w').write("
          "f'{os.getpid()} {child.pid}')\n"
          "if i == 1:\n"
          "  time.sleep(1)\n"
          "  sys.exit(3)\n"
          "time.sleep(120)\n")
      start = time.monotonic()
      done = launch("--workers", "2", "--", sys.executable, "-c", script)
      self.assertLess(time.monotonic() - start, 60)
      self.assertEqual(done.returncode, 3, done.stderr)
      self.assertIn("worker 1 exited with status 3", done.stderr)
      pids = [int(p) for i in range(2)
              for p in pathlib.Path(tmp, f"pids{i}").read_text().split()]
    time.sleep(0.5)
    self.assertEqual([p for p in pids if alive(p)], [])

  def test_timeout_stops_every_worker(self):
    done = launch("--workers", "2", "--timeout", "2", "--", sys.executable,
                  "-c", "import time; time.sleep(120)")
    self.assertEqual(done.returncode, 124, done.stderr)
    self.assertIn("timed out after 2.0 s", done.stderr)

  def test_bad_arguments_say_what_to_fix(self):
    for args, message in [(["--workers", "0", "--", "true"], "at least 1"),
                          (["--workers", "2"], "no command given"),
                          (["--workers", "2", "--timeout", "-1", "--", "true"],
                           "--timeout must be positive")]:
      done = launch(*args)
      self.assertEqual(done.returncode, 2, args)
      self.assertIn(message, done.stderr)


if __name__ == "__main__":
  unittest.main()
