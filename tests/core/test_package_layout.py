"""A layout that shows the design: short modules, small classes at the top, no cycles.

Every module of the package is at most `MODULE_LINES` long; the replica
context and the extended class, the classes a reader opens first, at most
`CLASS_LINES` (their parts live in modules named for what they are). The
command-line tools and the package root import each other in one direction
only: no cycle of module-level imports passes through `cli/` or the root.
"""

import ast
import pathlib
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "replicator_strategy"

MODULE_LINES = 450
CLASS_LINES = 350
SMALL_CLASSES = {"replica_context.py": "ReplicaContext",
                 "extended.py": "ReplicatorExtended"}


def package_modules(package=PACKAGE):
  """Dotted module name -> (path, whether it is a package's __init__)."""
  modules = {}
  for path in sorted(package.rglob("*.py")):
    parts = (package.name,) + path.relative_to(package).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
  return modules


def _module_level_imports(tree):
  """The import statements run when the module is imported: not those in a
  function body, which run when it is called."""
  pending = list(tree.body)
  while pending:
    node = pending.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for field in ("body", "orelse", "finalbody", "handlers"):
        pending.extend(getattr(node, field, None) or ())


def import_graph(sources):
  """Module -> the modules of `sources` (dotted name -> (source, is a
  package)) it imports when it is imported."""
  graph = {}
  for name, (source, is_package) in sources.items():
    package = name if is_package else name.rpartition(".")[0]
    imported = set()
    for node in _module_level_imports(ast.parse(source)):
      if isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
        continue
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) + 1 - node.level] +
                        ([node.module] if node.module else []))
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        imported.add(submodule if submodule in sources else base)
    graph[name] = {m for m in imported if m in sources and m != name}
  return graph


def cycles_through(graph, modules):
  """For each of `modules` on an import cycle of `graph`, its shortest
  cycle: a list of modules from it back to itself."""
  found = []
  for start in sorted(modules):
    came_from = {}  # Module -> the module that reached it first.
    pending = [start]
    while pending and start not in came_from:
      module = pending.pop(0)
      for nxt in sorted(graph.get(module, ())):
        if nxt not in came_from:
          came_from[nxt] = module
          pending.append(nxt)
    if start in came_from:
      cycle = [start, came_from[start]]
      while cycle[-1] != start:
        cycle.append(came_from[cycle[-1]])
      found.append(cycle[::-1])
  return found


class LayoutTest(unittest.TestCase):

  def test_every_module_is_short(self):
    long_modules = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path, _ in package_modules().values()
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES}
    self.assertEqual(long_modules, {}, f"modules over {MODULE_LINES} lines: "
                     "split them by concern")

  def test_the_replica_context_and_the_extended_class_are_small(self):
    for module, class_name in SMALL_CLASSES.items():
      tree = ast.parse((PACKAGE / module).read_text())
      classes = {node.name: node.end_lineno - node.lineno + 1
                 for node in tree.body if isinstance(node, ast.ClassDef)}
      with self.subTest(class_name):
        self.assertIn(class_name, classes)
        self.assertLessEqual(classes[class_name], CLASS_LINES)

  def test_no_import_cycle_passes_through_the_cli_or_the_package_root(self):
    modules = package_modules()
    graph = import_graph({name: (path.read_text(), is_package)
                          for name, (path, is_package) in modules.items()})
    self.assertIn("replicator_strategy.cli.tensorflow_logs",
                  graph["replicator_strategy"])
    ends = [m for m in modules
            if m == "replicator_strategy" or m.startswith(
                "replicator_strategy.cli")]
    self.assertEqual(cycles_through(graph, ends), [])

  def test_the_cycle_check_sees_a_cycle_in_each_form_of_import(self):
    graph = import_graph({
        "pkg": ("from pkg.cli import launch\n", True),
        "pkg.cli": ("", True),
        "pkg.cli.launch": ("if True:\n  from .. import devices\n", False),
        "pkg.devices": ("import pkg.strategy\n"
                        "def later():\n  from pkg.cli import launch\n", False),
        "pkg.strategy": ("from pkg import cli\n", False),
    })
    self.assertEqual(graph["pkg.devices"], {"pkg.strategy"})
    self.assertEqual(cycles_through(graph, ["pkg.cli.launch"]), [])
    graph["pkg.cli"] = {"pkg.cli.launch"}
    self.assertEqual(
        cycles_through(graph, ["pkg.cli.launch"]),
        [["pkg.cli.launch", "pkg.devices", "pkg.strategy", "pkg.cli",
          "pkg.cli.launch"]])


if __name__ == "__main__":
  unittest.main()
