"""Test set-up: the CPU is split into 4 logical devices before TF starts.

Tests build strategies over 1, 2 or 4 of them with `strategy_over(n)`, so
every multi-replica path runs on any machine.

The quick loop (`pytest -m "not slow"`) runs each replica-count grid at
2 replicas: a case whose name says 1 or 4 replicas is marked `slow` here, and
runs with the rest of the suite.

TensorFlow's oneDNN kernels are on unless TF_ENABLE_ONEDNN_OPTS says otherwise:
the path of most servers, where a replica given no rows once crashed.
"""

import os
import re

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's oneDNN CPU kernels, on by default on AVX-512 servers, are the
# path tested unless TF_ENABLE_ONEDNN_OPTS=0 asks for Eigen's kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import replicator_strategy as rs  # pylint: disable=g-import-not-at-top
from replicator_strategy import warn_once  # pylint: disable=g-import-not-at-top

rs.split_cpu(4)


@pytest.fixture(autouse=True)
def _once_only_warnings_said_afresh():
  """Each test sees the once-only warnings as a fresh process would, whichever
  tests ran before it."""
  warn_once.forget_all()

_ONE_OR_FOUR_REPLICAS = re.compile(r"(?<![0-9])[14]_replicas")


def pytest_collection_modifyitems(items):
  for item in items:
    if _ONE_OR_FOUR_REPLICAS.search(item.name):
      item.add_marker(pytest.mark.slow)
