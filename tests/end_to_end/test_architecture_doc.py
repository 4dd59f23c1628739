"""docs/architecture.md is drawn from the code: every module, every subpackage.

Its module table names each module of the package once (a path relative to
`replicator_strategy/`) and no module that is gone; its layer diagram shows
every subpackage.
"""

import pathlib
import re
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "replicator_strategy"
PAGE = ROOT / "docs" / "architecture.md"


def package_modules():
  return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def modules_section():
  text = PAGE.read_text()
  start = text.index("\n## Modules\n")
  end = text.index("\n## ", start + 1)
  return text[start:end]


def table_modules(section):
  """Every `path.py` named in the first column of the section's tables."""
  named = []
  for row in re.findall(r"^\| (.*?) \|", section, re.M):
    named += re.findall(r"`([\w/]+\.py)`", row)
  return named


class ArchitectureDocTest(unittest.TestCase):

  def test_the_module_table_names_every_module_once(self):
    named = table_modules(modules_section())
    self.assertEqual(sorted(set(named)), sorted(named),
                     "a module named twice in docs/architecture.md")
    self.assertEqual(set(named), package_modules(),
                     "docs/architecture.md's module table and the package "
                     "differ: missing modules on the right, gone ones on the "
                     "left")

  def test_the_diagram_shows_every_subpackage(self):
    diagram = re.search(r"^```\n(.*?)^```", modules_section(), re.S | re.M)
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    self.assertTrue(subpackages)
    for name in sorted(subpackages):
      self.assertIn(f"{name}/", diagram.group(1))

  def test_a_missing_module_is_caught(self):
    section = "## Modules\n\n| Module | Holds |\n|---|---|\n| `strategy.py` | x |\n"
    self.assertEqual(table_modules(section), ["strategy.py"])
    self.assertNotEqual(set(table_modules(section)), package_modules())


if __name__ == "__main__":
  unittest.main()
