"""Every `>>>` example in the package's docstrings runs, and every public name has one.

The examples run under doctest in one fresh process (docstring_examples_main.py),
module after module, as each module's own names see them.
"""

import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import tempfile
import unittest

import pytest

import replicator_strategy as rs

TESTS = pathlib.Path(__file__).resolve().parent.parent


class DocstringsTest(unittest.TestCase):

  @pytest.mark.slow
  def test_every_example_runs(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONPATH=str(TESTS.parent))
    env.pop("TF_CONFIG", None)
    with tempfile.TemporaryDirectory() as cwd:
      done = subprocess.run(
          [sys.executable, str(TESTS / "docstring_examples_main.py"), cwd],
          capture_output=True, text=True, env=env, timeout=300, check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    results = [json.loads(line) for line in done.stdout.splitlines()
               if line.startswith('{"module"')]
    modules = ["replicator_strategy"] + [
        m.name for m in pkgutil.walk_packages(rs.__path__,
                                              "replicator_strategy.")
        if not m.name.endswith("__main__")]
    self.assertEqual(sorted(r["module"] for r in results), sorted(modules))
    self.assertEqual([r for r in results if r["failed"]], [],
                     done.stdout[-6000:])
    self.assertGreater(sum(r["attempted"] for r in results), 100)

  def test_every_public_name_has_an_example_first_in_help(self):
    for name in rs.__all__:
      with self.subTest(name):
        doc = getattr(rs, name).__doc__
        self.assertIn(">>> ", doc)
    # help(ReplicatorStrategy) shows the example before the arguments.
    doc = rs.ReplicatorStrategy.__doc__
    self.assertLess(doc.index(">>> "), doc.index("Args:"))


if __name__ == "__main__":
  unittest.main()
