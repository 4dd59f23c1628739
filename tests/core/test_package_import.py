"""Importing the package: TensorFlow only on first use, and a clear error without it.

Each test runs Python in a fresh process in which TensorFlow is missing (an
import hook refuses it, as an environment without it would) or too old (a
stand-in module reports an old version); or, with TensorFlow, as a user's
first script would: what it prints under default settings.
"""

import subprocess
import sys
import textwrap
import unittest

import pytest

import default_output

WITHOUT_TENSORFLOW = """
import sys
class NoTensorFlow:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "tensorflow":
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTensorFlow())
"""
OLD_TENSORFLOW = """
import sys, types
sys.modules["tensorflow"] = types.SimpleNamespace(__version__="2.15.1",
                                                  __file__="/old/tf.py")
"""


def python(prelude, code, *args):
  return subprocess.run(
      [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
      capture_output=True, text=True, timeout=120, check=False)


class PackageImportTest(unittest.TestCase):

  def test_missing_tensorflow_is_an_import_error_naming_the_extras(self):
    done = python(WITHOUT_TENSORFLOW, """
        import replicator_strategy as rs  # Loads nothing yet.
        for use in (lambda: rs.ReplicatorStrategy,
                    lambda: __import__("replicator_strategy").split_cpu):
          try:
            use()
          except ImportError as e:
            print(type(e).__name__, e)
        from replicator_strategy import ReplicatorStrategy
        """)
    self.assertNotEqual(done.returncode, 0)
    message = ("ImportError replicator_strategy needs TensorFlow 2.21 or "
               "newer, which is not installed. Install the package with the "
               "extra that brings TensorFlow: pip install "
               "'replicator-strategy[cpu]'")
    self.assertEqual(done.stdout.count(message), 2, done.stdout)
    self.assertIn("'.[cpu]' or '.[gpu]'", done.stdout)
    # The traceback of `from ... import` is short: no frames inside Keras.
    self.assertNotIn("keras", done.stderr)
    self.assertIn("ImportError: replicator_strategy needs TensorFlow",
                  done.stderr.splitlines()[-1])

  def test_too_old_tensorflow_is_an_import_error_saying_what_was_found(self):
    done = python(OLD_TENSORFLOW, """
        import replicator_strategy as rs
        rs.ReplicatorStrategy
        """)
    self.assertIn("ImportError: replicator_strategy needs TensorFlow 2.21 or "
                  "newer. Found: TensorFlow 2.15.1 (at /old/tf.py). Install",
                  done.stderr)

  def test_commands_answer_help_without_tensorflow(self):
    usages = {"replicator_strategy": "usage: python -m replicator_strategy",
              "replicator_strategy.cli.launch":
                  "usage: python -m replicator_strategy.cli.launch"}
    for module, usage in usages.items():
      with self.subTest(module):
        done = python(WITHOUT_TENSORFLOW, """
            import runpy, sys
            sys.argv = sys.argv[1:]  # As `python -m MODULE --help` has it.
            try:  # alter_sys: sys.argv[0] the module's file, as -m sets it.
              runpy.run_module(sys.argv[0], run_name="__main__",
                               alter_sys=True)
            except SystemExit as e:
              print("exit", e.code, "tensorflow" in sys.modules)
            """, module, "--help")
        self.assertIn(usage, done.stdout, done.stderr)
        self.assertTrue(done.stdout.endswith("exit 0 False\n"), done.stdout)

  def test_the_environment_report_says_tensorflow_is_missing(self):
    done = python(WITHOUT_TENSORFLOW, """
        import runpy, sys
        sys.argv = ["replicator_strategy"]
        try:
          runpy.run_module("replicator_strategy", run_name="__main__")
        except SystemExit as e:
          print("exit", e.code)
        """)
    self.assertIn("replicator-strategy 0.1.0\nPython ", done.stdout)
    self.assertIn("TensorFlow: replicator_strategy needs TensorFlow 2.21 or "
                  "newer, which is not installed.", done.stdout)
    self.assertTrue(done.stdout.endswith("1 problem found (above).\nexit 1\n"),
                    done.stdout + done.stderr)

  def test_the_launcher_imports_no_tensorflow(self):
    # TensorFlow installed, as usual: the launcher still leaves it alone, so
    # it starts at once.
    done = python("", """
        import sys
        import replicator_strategy.cli.launch
        print(sorted(m for m in sys.modules
                     if m.split(".")[0] in ("tensorflow", "keras")))
        """)
    self.assertEqual(done.stdout, "[]\n", done.stderr)


# A user's first script, on one CPU (no split_cpu): the default strategy,
# printed, then Keras fit (whose input pipeline TensorFlow logs about).
FIRST_SCRIPT = """
import replicator_strategy as rs
import keras
import numpy as np
strategy = rs.ReplicatorStrategy()
print(strategy)
with strategy.scope():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, verbose=0)
"""


class DefaultStartTest(unittest.TestCase):

  @pytest.mark.slow  # Two TensorFlow processes; in the quick loop,
  # test_strategy's lone-CPU test checks the warning in process.
  def test_one_cpu_replica_is_one_warning_and_tensorflow_stays_quiet(self):
    # Run side by side: by default, and asking for TensorFlow's lines.
    runs = [subprocess.Popen([sys.executable, "-c", FIRST_SCRIPT], env=e,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for e in (default_output.user_environ(),
                      default_output.user_environ(TF_CPP_MIN_LOG_LEVEL="0"))]
    (out, err), (_, asked_err) = [r.communicate(timeout=120) for r in runs]
    self.assertEqual([r.returncode for r in runs], [0, 0], err + asked_err)
    self.assertRegex(out, r"^ReplicatorStrategy\(1 replica: .*CPU:0;")
    # Under default logging, stderr is the one warning naming split_cpu.
    self.assertEqual(len(err.splitlines()), 1, err)
    self.assertRegex(err, r"UserWarning: ReplicatorStrategy: no GPU, so 1 "
                     r"replica on the CPU\. .*replicator_strategy\.split_cpu")
    self.assertNotRegex(err, default_output.TENSORFLOW_LOG_LINE)
    # TF_CPP_MIN_LOG_LEVEL=0 asks for TensorFlow's C++ lines: they come.
    self.assertRegex(asked_err, default_output.TENSORFLOW_LOG_LINE)


if __name__ == "__main__":
  unittest.main()
