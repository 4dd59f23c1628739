"""What a user's run prints by default: no TensorFlow C++ log lines.

Subprocess tests that check a quiet start run with `user_environ()`, the
environment without the suite's TF_CPP_MIN_LOG_LEVEL (conftest.py sets it),
and look for `TENSORFLOW_LOG_LINE` in what the run wrote.
"""

import os
import re

# glog's prefix of an INFO or WARNING line ("I0000 00:00:1795686607.527616
# 9006 dataset.cc:997]", wherever a line starts: the interactive interpreter
# writes its prompts before it) and the start-up lines of TensorFlow 2.21.
# Its ERROR lines come through by design, and which ones a run prints depends
# on the CPU: with oneDNN's kernels, grappler's remapper reports that it could
# not fuse a convolution whose activation's gradient reads its pre-activation
# ("E0000 ... meta_optimizer.cc:967] remapper failed") and runs the graph
# unfused.
TENSORFLOW_LOG_LINE = re.compile(
    r"[IW]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\]|oneDNN|cpu_feature_guard|"
    r"absl::InitializeLog")


def user_environ(**overrides):
  """os.environ as a user's shell has it: TF_CPP_MIN_LOG_LEVEL unset."""
  environ = {k: v for k, v in os.environ.items()
             if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONWARNINGS")}
  return {**environ, **overrides}
