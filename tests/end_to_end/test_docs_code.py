"""The Python code in README.md and docs/*.md runs as written.

Each file's ```python blocks run in order, as one script, in a fresh process
in an empty directory (they split the CPU themselves, as a reader's script
would). docs/multi-worker.md's run as 2 workers under the launcher; the
README's as if pasted into an interactive `python` (where a blank line must
end each indented block before the next statement). Every
file with a python block is checked: a new page is covered without a change
here.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import unittest

from parameterized import parameterized
import pytest

import default_output

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
MULTI_WORKER = {"docs/multi-worker.md": 2}  # Page: workers.
PASTED = ("README.md",)
# Pages run as a user's shell has it (no TF_CPP_MIN_LOG_LEVEL), whose output
# must hold no TensorFlow C++ log line.
QUIET_BY_DEFAULT = ("README.md",)
# Page: the last logged loss must be below this (ten classes: 2.3 by chance).
FINAL_LOSS_BELOW = {"README.md": 1.0}
TIMEOUT_SECONDS = 300
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(relative_path):
  return _BLOCK.findall((ROOT / relative_path).read_text())


def command(relative_path, script):
  """The command that runs `script`, and what it reads on stdin."""
  if relative_path in PASTED:
    return [sys.executable, "-i"], script
  python = [sys.executable, "-c", script]
  workers = MULTI_WORKER.get(relative_path)
  if workers is None:
    return python, None
  return [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers",
          str(workers), "--timeout", str(TIMEOUT_SECONDS), "--", *python], None


class DocsCodeTest(unittest.TestCase):

  def test_every_page_is_checked_and_multi_worker_pages_exist(self):
    self.assertIn("docs/getting-started.md", PAGES)
    for page in [*MULTI_WORKER, *FINAL_LOSS_BELOW]:
      self.assertTrue(python_blocks(page), page)

  @parameterized.expand([(p.replace("/", "_").replace(".", "_"), p)
                         for p in PAGES
                         if python_blocks(p) and p not in MULTI_WORKER])
  @pytest.mark.slow
  def test_runs_as_written(self, _, relative_path):
    self.run_page(relative_path)

  @pytest.mark.slow
  def test_multi_worker_page_runs_as_written_on_workers(self):
    for relative_path in MULTI_WORKER:
      with self.subTest(relative_path):
        self.run_page(relative_path)

  def run_page(self, relative_path):
    script = "\n".join(python_blocks(relative_path))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONPATH=str(ROOT))
    if relative_path in QUIET_BY_DEFAULT:
      env = default_output.user_environ(KERAS_BACKEND="tensorflow",
                                        PYTHONPATH=str(ROOT))
    env.pop("TF_CONFIG", None)
    args, stdin = command(relative_path, script)
    with tempfile.TemporaryDirectory() as cwd:
      done = subprocess.run(args, input=stdin, cwd=cwd, env=env,
                            capture_output=True, text=True,
                            timeout=TIMEOUT_SECONDS + 30)
    failed = (f"{relative_path} failed:\n{done.stdout[-2000:]}\n"
              f"{done.stderr[-3000:]}")
    self.assertEqual(done.returncode, 0, failed)
    # The interactive interpreter goes on after an error, and exits 0.
    self.assertNotRegex(done.stderr, r"Traceback|\w+Error: ", failed)
    if relative_path in QUIET_BY_DEFAULT:
      self.assertNotRegex(done.stdout + done.stderr,
                          default_output.TENSORFLOW_LOG_LINE, failed)
    if relative_path in FINAL_LOSS_BELOW:
      losses = re.findall(r"loss: (\d+\.\d+)", done.stdout)
      self.assertTrue(losses, done.stdout[-2000:])
      self.assertLess(float(losses[-1]), FINAL_LOSS_BELOW[relative_path])


if __name__ == "__main__":
  unittest.main()
