"""TensorFlow's C++ log lines: quiet unless asked, start-up lines included.

Importing the package sets TF_CPP_MIN_LOG_LEVEL to `QUIET_LEVEL` (2: no INFO
and no WARNING lines) unless it is set (`quiet_unless_asked`); its workers,
examples and snippets inherit it. TF_CPP_MIN_LOG_LEVEL=0 shows every line.
TensorFlow's own INFO lines there (oneDNN, CPU instructions, input pipelines
it will not optimize) say nothing a user of the strategy can act on.

TensorFlow 2.21 logs a few INFO lines while it is imported (oneDNN, twice
where its oneDNN kernels are on, and CPU instructions) before it reads
TF_CPP_MIN_LOG_LEVEL, through abseil's not yet initialised logging, which
adds a warning line of its own each time. At log level 1 or more (no INFO),
these lines are dropped: `quiet_unless_asked` also hooks the first
`import tensorflow` of the process, whoever makes it (Keras, the user's
script, the package), and from the workers' stderr the launcher drops them
too (`is_start_up_info`). Level 0 shows them, as TF would. What TensorFlow
writes later, errors included, comes through.

>>> is_start_up_info(b"I0000 00:00:1795517664.615734  9522 port.cc:153] oneDNN")
True
>>> is_start_up_info(b"W0000 00:00:1795517671.830944  9522 dataset.cc:997] ...")
False
"""

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LEVEL = "2"
_START_UP_INFO = re.compile(
    rb"(I\d{4} .*\]|WARNING: All log messages before absl::InitializeLog|"
    rb"To enable the following instructions:)")


def quiet_unless_asked(environ=os.environ):
  """Sets TF_CPP_MIN_LOG_LEVEL in `environ` to `QUIET_LEVEL` unless it is set.

  With `os.environ` and INFO hidden, the first `import tensorflow` of the
  process then drops TensorFlow's start-up lines (`_QuietFirstImport`).

  >>> environ = {}
  >>> quiet_unless_asked(environ); environ
  {'TF_CPP_MIN_LOG_LEVEL': '2'}
  >>> environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}  # asked for every line
  >>> quiet_unless_asked(environ); environ
  {'TF_CPP_MIN_LOG_LEVEL': '0'}
  """
  environ.setdefault(LEVEL_ENV, QUIET_LEVEL)
  if (environ is os.environ and info_hidden() and "tensorflow" not in
      sys.modules and not any(isinstance(f, _QuietFirstImport)
                              for f in sys.meta_path)):
    sys.meta_path.insert(0, _QuietFirstImport())


def is_start_up_info(line):
  """Whether `line` (bytes) is one of TensorFlow's start-up INFO lines."""
  return bool(_START_UP_INFO.match(line))


def info_hidden(environ=os.environ):
  """Whether TF_CPP_MIN_LOG_LEVEL in `environ` hides INFO lines."""
  return environ.get(LEVEL_ENV, "0") not in ("", "0")


def quiet_import():
  """`import tensorflow`; its start-up INFO lines dropped if the level says so.

  Everything else TensorFlow writes to stderr meanwhile comes through.
  """
  quiet_unless_asked()
  import tensorflow  # pylint: disable=g-import-not-at-top
  return tensorflow


@contextlib.contextmanager
def _start_up_lines_dropped():
  """Holds back what is written to file descriptor 2; lets all but start-up
  lines through at the end."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().splitlines(True):
        if not is_start_up_info(line):
          sys.stderr.buffer.write(line)
      sys.stderr.flush()


class _QuietFirstImport(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` as the path finder does, and loads it with its
  start-up lines dropped; gone from `sys.meta_path` once used.

  A finder rather than importing TensorFlow here: the package stays light
  (the launcher starts without TensorFlow), and the import that comes first,
  Keras's included, is the one that prints the lines.
  """

  def find_spec(self, name, path=None, target=None):
    if name != "tensorflow":
      return None
    sys.meta_path.remove(self)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


class _QuietLoader(importlib.abc.Loader):
  """Runs a loader's `exec_module` with TensorFlow's start-up lines dropped."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    module.__spec__.loader = module.__loader__ = self._loader
    if not info_hidden():
      self._loader.exec_module(module)
      return
    with _start_up_lines_dropped():
      self._loader.exec_module(module)
