"""The runnable examples still run: one short epoch each, in a fresh process."""

import os
import pathlib
import subprocess
import sys
import unittest

from parameterized import parameterized

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "keras_examples"


class ExamplesTest(unittest.TestCase):

  @parameterized.expand(["train_digits.py", "custom_loop_digits.py"])
  def test_example_trains_and_reports(self, script):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--epochs", "2",
         "--replicas", "2"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    # The topology first, the wall time last; no TensorFlow start-up lines.
    self.assertRegex(lines[0], r"^ReplicatorStrategy\(2 replicas: .*CPU:0.*CPU:1")
    self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
    self.assertNotIn("oneDNN custom operations", done.stderr)
    accuracy = float(done.stdout.rsplit("test accuracy:", 1)[1].split()[0])
    self.assertGreater(accuracy, 0.5)  # 2 epochs; chance is 0.1.

  @parameterized.expand(["train_digits.py", "custom_loop_digits.py"])
  def test_help_answers_without_importing_tensorflow(self, script):
    # -X importtime lists every module imported, on stderr.
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(EXAMPLES / script), "--help"],
        capture_output=True, text=True, timeout=60, check=True)
    self.assertIn("--global-batch-size", done.stdout)
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines()}
    self.assertIn("argparse", imported)
    self.assertFalse(imported & {"tensorflow", "keras", "sklearn"})


if __name__ == "__main__":
  unittest.main()
