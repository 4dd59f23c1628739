"""The adapter: it refuses untested TensorFlow versions, and it alone reaches TF's privates.

(With `keras/_internal`, its twin for Keras, tested in test_keras_patches.)
"""

import ast
import importlib
import inspect
import os
import pathlib
import re
import unittest
from unittest import mock

import tensorflow as tf

from replicator_strategy import _tf_internal


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


class PrivateMembersTest(unittest.TestCase):

  def test_only_the_adapters_reach_private_members_of_tf_and_keras(self):
    modules = {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text())
               for p in sorted(PACKAGE.rglob("*.py"))}
    ours = _our_private_names(modules.values())
    found = []
    for name, tree in modules.items():
      if name in ADAPTERS:
        continue
      for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and
                node.attr.startswith("_") and not node.attr.startswith("__")):
          continue
        on_self = (isinstance(node.value, ast.Name) and
                   node.value.id in ("self", "cls"))
        # os._exit is public API despite its name.
        if on_self or node.attr in ours or ast.unparse(node) == "os._exit":
          continue
        found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    self.assertEqual(found, [],
                     "reach these through _tf_internal or keras/_internal")


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
        foreign = _private_names_of_foreign_bases(getattr(module, cls.name))
        overridden = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(cls):
          if (isinstance(node, ast.Attribute) and
              isinstance(node.value, ast.Name) and
              node.value.id in ("self", "cls") and node.attr in foreign and
              node.attr not in overridden):
            found.append(f"{relative}:{node.lineno}: {cls.name} "
                         f"{ast.unparse(node)}")
    self.assertEqual(found, [], "reach these through _tf_internal")


def _private_names_of_foreign_bases(cls):
  """`_names` that classes outside this package among `cls`'s bases define or set."""
  names = set()
  for base in cls.__mro__[1:]:
    if base.__module__.startswith("replicator_strategy") or base is object:
      continue
    names |= set(vars(base))
    try:
      names |= set(re.findall(r"self\.(_\w+)", inspect.getsource(base)))
    except (OSError, TypeError):
      pass  # Built in: no source to read.
  return {n for n in names if n.startswith("_") and not n.startswith("__")}


if __name__ == "__main__":
  unittest.main()
