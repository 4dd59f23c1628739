"""TensorFlow's C++ log lines: quiet unless asked, start-up lines included.

Importing the package sets TF_CPP_MIN_LOG_LEVEL to `QUIET_LEVEL` (2: no INFO
and no WARNING lines) unless it is set (`quiet_unless_asked`); its workers,
examples and snippets inherit it. TF_CPP_MIN_LOG_LEVEL=0 shows every line.
TensorFlow's own INFO lines there (oneDNN, CPU instructions, input pipelines
it will not optimize) say nothing a user of the strategy can act on.

TensorFlow 2.21 logs a few INFO lines when it is imported (oneDNN, CPU
instructions) before it reads TF_CPP_MIN_LOG_LEVEL, through abseil's not yet
initialised logging, which adds a warning line of its own. At log level 1 or
more (no INFO), these lines are dropped here: when the package is the first
to import TensorFlow (`quiet_import`), and from the workers' stderr in the
launcher (`is_start_up_info`). Level 0 shows them, as TF would.

>>> is_start_up_info(b"I0000 00:00:1795517664.615734  9522 port.cc:153] oneDNN")
True
>>> is_start_up_info(b"W0000 00:00:1795517671.830944  9522 dataset.cc:997] ...")
False
"""

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

  >>> environ = {}
  >>> quiet_unless_asked(environ); environ
  {'TF_CPP_MIN_LOG_LEVEL': '2'}
  >>> environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}  # asked for every line
  >>> quiet_unless_asked(environ); environ
  {'TF_CPP_MIN_LOG_LEVEL': '0'}
  """
  environ.setdefault(LEVEL_ENV, QUIET_LEVEL)


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
  if "tensorflow" in sys.modules or not info_hidden():
    import tensorflow  # pylint: disable=g-import-not-at-top
    return tensorflow
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().splitlines(True):
        if not is_start_up_info(line):
          sys.stderr.buffer.write(line)
      sys.stderr.flush()
  return tensorflow
