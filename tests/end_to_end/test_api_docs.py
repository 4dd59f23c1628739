"""docs/api.md cannot go stale: every public name, argument, option and variable is on it.

(Its code runs in test_docs_code.py; the docstring examples in test_docstrings.py.)
"""

import inspect
import pathlib
import re
import subprocess
import sys
import unittest

import replicator_strategy as rs

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = (ROOT / "docs" / "api.md").read_text()


def options_of(module):
  done = subprocess.run([sys.executable, "-m", module, "--help"],
                        capture_output=True, text=True, timeout=60, check=True)
  return sorted(set(re.findall(r"(--[a-z][a-z-]+)", done.stdout)) - {"--help"})


class ApiDocsTest(unittest.TestCase):

  def test_every_public_name_has_a_section(self):
    for name in rs.__all__:
      self.assertIn(f"### `{name}`", API)

  def test_every_strategy_argument_is_described(self):
    for name in inspect.signature(rs.ReplicatorStrategy).parameters:
      self.assertIn(f"| `{name}` |", API)

  def test_collectives_in_loops_are_described_as_tested(self):
    # It said collectives work inside `tf.while_loop`; inside strategy.run's
    # function they are refused (tests/collectives/test_collectives.py LoopsTest).
    section = API[API.index("### `ReplicaContext`"):API.index("### `ReduceOp`")]
    works = section[:section.index("In loops:")]
    self.assertNotIn("while_loop", works)
    for claim in ("A loop around `strategy.run` works",
                  "raises\n  `NotImplementedError` when traced: a "
                  "`tf.while_loop` in a `tf.function` or a TF1\n  graph, or "
                  "an autograph `for`/`while` over tensors in a `tf.function`",
                  "A Python loop (`for _ in range(3)`) unrolls and works; "
                  "eagerly every loop is a\n  Python loop and works"):
      self.assertIn(claim, section)

  def test_every_replica_context_method_is_named(self):
    public = [n for n in vars(rs.ReplicaContext) if not n.startswith("_")]
    self.assertIn("all_to_all", public)
    for name in public:
      self.assertIn(f"`{name}", API)

  def test_every_command_option_is_described(self):
    launcher = options_of("replicator_strategy.cli.launch")
    self.assertIn("--output", launcher)
    for option in launcher:
      self.assertIn(f"| `{option}", API)
    self.assertEqual(options_of("replicator_strategy"), [])

  def test_every_environment_variable_the_package_reads_is_described(self):
    source = "\n".join(p.read_text() for p in
                       (ROOT / "replicator_strategy").rglob("*.py"))
    names = set(re.findall(r'"((?:TF|REPLICATOR|KERAS)_[A-Z_]+)"', source))
    self.assertIn("REPLICATOR_RESTART_COUNT", names)
    for name in names:
      self.assertIn(f"| `{name}` |", API)


if __name__ == "__main__":
  unittest.main()
