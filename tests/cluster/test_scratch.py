"""Scratch directories: the first one removes those of killed processes."""

import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from replicator_strategy.cluster import scratch


class ScratchRootTest(unittest.TestCase):

  def test_the_first_scratch_removes_only_dead_processes_scratch(self):
    with tempfile.TemporaryDirectory() as tmp:
      dead = subprocess.run(
          [sys.executable, "-c", "import os; print(os.getpid())"],
          capture_output=True, text=True, check=True)
      roots = {name: os.path.join(tmp, name) for name in (
          f"replicator-worker-{int(dead.stdout)}-abc",  # Its process ended.
          f"replicator-worker-{os.getppid()}-def",  # A running process's.
          "replicator-worker-notapid-ghi",
          "another-program-1-jkl")}
      for path in roots.values():
        os.makedirs(os.path.join(path, "inside"))
      # This process has no scratch root yet, and makes it under `tmp`.
      with mock.patch.object(tempfile, "tempdir", tmp), \
           mock.patch.object(scratch, "_scratch_root", []):
        made = scratch.new_dir()
        self.assertTrue(os.path.isdir(made))
        self.assertTrue(os.path.basename(os.path.dirname(made)).startswith(
            f"replicator-worker-{os.getpid()}-"))
      left = sorted(os.listdir(tmp))
    self.assertEqual(sorted(set(roots) - set(left)),
                     [f"replicator-worker-{int(dead.stdout)}-abc"])


if __name__ == "__main__":
  unittest.main()
