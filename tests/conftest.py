"""Test set-up: the CPU is split into 4 logical devices before TF starts.

Tests build strategies over 1, 2 or 4 of them with `strategy_over(n)`, so
every multi-replica path runs on any machine.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import replicator_strategy as rs  # pylint: disable=g-import-not-at-top

rs.split_cpu(4)
