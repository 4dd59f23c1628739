"""`python -m benchmarks [--quick] [--json PATH] [--sections a,b,...]`."""

import os

# Before TensorFlow and Keras load: quiet TF's C++ logs, Keras on TF.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import cli

if __name__ == "__main__":
  cli.main()
