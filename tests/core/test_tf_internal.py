"""The adapters: they alone reach TF's and Keras's privates, behind version checks.

`_tf_internal` refuses untested TensorFlow versions and TF classes without
the hooks `ShardedVariable` overrides; no other module (patch wrappers
included: `self._x`, `getattr(self, "_x")`) reaches a private member of TF
or Keras; nothing outside `keras/` imports it. (`keras/_internal`'s version
check is tested in test_keras_patches.)
"""

import ast
import functools
import importlib
import inspect
import os
import pathlib
import re
import unittest
from unittest import mock

import tensorflow as tf

from replicator_strategy import _tf_internal
from replicator_strategy.keras import patches as keras_patches
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.sharding import variables as sharded_variables


class VersionCheckTest(unittest.TestCase):

  def test_untested_version_is_refused_with_the_way_out(self):
    with mock.patch.object(tf, "__version__", "2.99.0"), \
         mock.patch.dict(os.environ, {}, clear=False):
      os.environ.pop("REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF", None)
      with self.assertRaisesRegex(
          ImportError, r"tested with TensorFlow 2\.21\.x.*tensorflow==2\.99\.0"
          r".*REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF=1"):
        _tf_internal._check_tf_version()

  def test_override_and_tested_versions_pass(self):
    with mock.patch.object(tf, "__version__", "2.99.0"), mock.patch.dict(
        os.environ, {"REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF": "1"}):
      _tf_internal._check_tf_version()
    with mock.patch.object(tf, "__version__", "2.21.3"):
      _tf_internal._check_tf_version()


PACKAGE = pathlib.Path(_tf_internal.__file__).parent
ADAPTERS = ("_tf_internal.py", "keras/_internal.py")
_REFLECTION = ("getattr", "setattr", "hasattr", "delattr")


def _private(name):
  return re.fullmatch(r"_[A-Za-z]\w*", name) is not None


def _our_private_names(trees):
  """`_names` this package defines: functions, methods, attributes it sets."""
  names = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif (isinstance(node, ast.Attribute) and
            isinstance(node.ctx, ast.Store) and
            isinstance(node.value, ast.Name) and node.value.id == "self"):
        names.add(node.attr)
  return {n for n in names if n.startswith("_")}


def _private_accesses(tree):
  """(node, object, name) for each `object._name` in `tree`, each
  `getattr(object, "_name", ...)` (or setattr, hasattr, delattr), and, with
  object None, each other string "_name" (a name a loop may pass to setattr).
  """
  named = set()
  for node in ast.walk(tree):  # Breadth first: a call before its arguments.
    if isinstance(node, ast.Attribute) and _private(node.attr):
      yield node, node.value, node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in _REFLECTION and len(node.args) > 1 and
          isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str) and _private(node.args[1].value)):
      named.add(id(node.args[1]))
      yield node, node.args[0], node.args[1].value
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and
          _private(node.value) and id(node) not in named):
      yield node, None, node.value


def _on_self(node):
  return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _inside_methods(tree):
  """The ids of the nodes inside the methods of the classes `tree` defines."""
  return {id(node)
          for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
          for method in cls.body if isinstance(method, ast.FunctionDef)
          for node in ast.walk(method)}


def _patch_table_names(tree):
  """The ids of the names that `Patch(...)` entries (the table) wrap."""
  return {id(node.args[1]) for node in ast.walk(tree)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id == "Patch" and len(node.args) > 1}


def _leaks(modules, ours, patched_privates):
  """Where `modules` (name -> tree) reach private members of TF or Keras.

  A name is ours if the package defines or sets it (`ours`). `self._x` in a
  method of our own class is left to the subclass test below; anywhere else
  (a patch wrapper), `self` is a Keras object, so `_x` must also not be a
  private member of a class the patches wrap (`patched_privates`).
  """
  found = []
  for name, tree in modules.items():
    methods, table = _inside_methods(tree), _patch_table_names(tree)
    for node, owner, attr in _private_accesses(tree):
      if (_on_self(owner) and id(node) in methods) or id(node) in table:
        continue
      keras_own = _on_self(owner) and attr in patched_privates
      # os._exit is public API despite its name.
      if (attr in ours and not keras_own) or ast.unparse(node) == "os._exit":
        continue
      found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
  return found


@functools.cache
def _patched_privates():
  """`_names` the Keras classes that `PATCHES` wraps (and their bases) define or set."""
  return set().union(*(
      _private_names_of_foreign(patch.owner.__mro__)
      for patch in keras_patches.PATCHES if isinstance(patch.owner, type)))


# What the wrappers once reached through `self`, as the guard must see it.
_LEAKING_WRAPPERS = """
def reduce_before_clipping(backend_apply_gradients):
  def wrapper(self, grads, variables):
    pairs = self._all_reduce_sum_gradients(zip(grads, variables))
    self._gradients_reduced = True
    return backend_apply_gradients(self, [g for g, _ in pairs], variables)
  return wrapper

_BACKUP_FILES = ("_weights_path",)

def lookup_rows(call):
  def wrapper(self, inputs):
    table = getattr(self, "_embeddings", None)
    for name in _BACKUP_FILES:
      setattr(self, name, "/tmp")
    return call(self, inputs) if self._variables else table
  return wrapper
"""


class PrivateMembersTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.modules = {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text())
                   for p in sorted(PACKAGE.rglob("*.py"))}
    cls.ours = _our_private_names(cls.modules.values())

  def test_only_the_adapters_reach_private_members_of_tf_and_keras(self):
    outside = {name: tree for name, tree in self.modules.items()
               if name not in ADAPTERS}
    self.assertEqual(_leaks(outside, self.ours, _patched_privates()), [],
                     "reach these through _tf_internal or keras/_internal")

  def test_the_guard_sees_self_and_getattr_in_patch_wrappers(self):
    # `_variables` is also a name of ours, but on `self` in a wrapper it is
    # the Keras optimizer's; `_gradients_reduced` (now a `StepContext` field)
    # was an attribute of ours set on Keras's optimizer.
    self.assertCountEqual(
        _leaks({"old": ast.parse(_LEAKING_WRAPPERS)}, self.ours,
               _patched_privates()),
        ["old:4: self._all_reduce_sum_gradients",
         "old:5: self._gradients_reduced",
         "old:9: '_weights_path'",
         "old:13: getattr(self, '_embeddings', None)",
         "old:16: self._variables"])

  def test_our_subclasses_use_no_private_member_of_their_tf_bases(self):
    # `self._x` where a TF base class defines or sets `_x` is TF's private
    # member too, unless our class overrides it (a hook TF asks subclasses
    # to implement, such as `_call_for_each_replica`).
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
      relative = path.relative_to(PACKAGE).with_suffix("")
      if path.relative_to(PACKAGE).as_posix() in ADAPTERS:
        continue
      module = importlib.import_module(".".join(
          ("replicator_strategy",) + relative.parts).removesuffix(".__init__"))
      for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
          continue
        foreign = _private_names_of_foreign(
            getattr(module, cls.name).__mro__[1:])
        overridden = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        for node, owner, attr in _private_accesses(cls):
          if _on_self(owner) and attr in foreign and attr not in overridden:
            found.append(f"{relative}:{node.lineno}: {cls.name} "
                         f"{ast.unparse(node)}")
    self.assertEqual(found, [], "reach these through _tf_internal")


def _private_names_of_foreign(classes):
  """`_names` that the classes outside this package among `classes` define or set."""
  return set().union(*map(_private_names_of_class, classes))


@functools.cache
def _private_names_of_class(cls):
  """`_names` that `cls` defines or sets, unless it is ours (read once)."""
  if cls.__module__.startswith("replicator_strategy") or cls is object:
    return frozenset()
  names = set(vars(cls))
  try:
    names |= set(re.findall(r"self\.(_\w+)", inspect.getsource(cls)))
  except (OSError, TypeError):
    pass  # Built in: no source to read.
  return frozenset(n for n in names if _private(n))


class OverriddenHooksTest(unittest.TestCase):

  def test_the_listed_hooks_are_what_our_distributed_variables_override(self):
    overridden = set()
    for cls in (sharded_variables.PiecewiseVariable,
                sharded_variables.ShardedVariable,
                split_variables.SplitVariable):
      tf_names = _private_names_of_foreign(cls.__mro__[1:])
      overridden |= {name for name, value in vars(cls).items()
                     if inspect.isfunction(value) and name in tf_names}
    self.assertEqual(overridden, set(_tf_internal.DISTRIBUTED_VARIABLE_HOOKS))

  def test_a_tf_without_a_listed_hook_is_refused(self):
    _tf_internal._check_hooks(_tf_internal.values.DistributedVariable,
                              _tf_internal.DISTRIBUTED_VARIABLE_HOOKS)

    class Renamed:

      def _get(self):
        pass

    with self.assertRaisesRegex(
        ImportError, r"TensorFlow's Renamed: expected it to define "
        r"_update_replica\. Received: tensorflow==2\.21\..*does not\. "
        r"Install a tested version"):
      _tf_internal._check_hooks(Renamed, ("_get", "_update_replica"))


_KERAS_INTEGRATION = "replicator_strategy.keras"


def _imported(node, module_name):
  """The modules an import in `module_name` (dotted) names, resolved."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom):
    package = module_name.split(".")[:-1]
    base = package[:len(package) + 1 - node.level] if node.level else []
    base = ".".join(base + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]
  if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
      "import_module") and node.args and isinstance(node.args[0], ast.Constant)):
    return [node.args[0].value]
  return []


def _keras_imports(modules):
  """(module, line, code) of each import of `replicator_strategy.keras` in
  `modules` (dotted name -> tree)."""
  return [(name, node.lineno, ast.unparse(node))
          for name, tree in modules.items()
          if not name.startswith(_KERAS_INTEGRATION)
          for node in ast.walk(tree)
          if any(m == _KERAS_INTEGRATION or
                 m.startswith(_KERAS_INTEGRATION + ".")
                 for m in _imported(node, name))]


class LayeringTest(unittest.TestCase):

  def test_nothing_outside_keras_imports_keras(self):
    modules = {
        ".".join(("replicator_strategy",) +
                 p.relative_to(PACKAGE).with_suffix("").parts): ast.parse(
                     p.read_text())
        for p in sorted(PACKAGE.rglob("*.py"))}
    # The package's lazy loader hands the Keras patches to the strategy.
    self.assertEqual(
        [(name, code) for name, _, code in _keras_imports(modules)],
        [("replicator_strategy.__init__",
          "importlib.import_module('replicator_strategy.keras')")])

  def test_the_check_sees_each_form_of_import(self):
    found = _keras_imports({
        "replicator_strategy.cluster.preemption_checkpoint": ast.parse(
            "from replicator_strategy.keras import chief_writes\n"
            "import replicator_strategy.keras.batches\n"
            "from replicator_strategy import keras\n"
            "from ..keras import patches\n"
            "from replicator_strategy import strategy\n")})
    self.assertEqual([line for _, line, _ in found], [1, 2, 3, 4])


if __name__ == "__main__":
  unittest.main()
