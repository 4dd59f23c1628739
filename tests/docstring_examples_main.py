"""Runs every `>>>` example in the package's docstrings; one JSON line per module.

Run by test_docstrings.py in a fresh process: the CPU is split into 4
logical devices first, as the examples assume, and no TF_CONFIG is set. Each
module's examples see that module's names, as doctest gives them; an example
that changes os.environ has it put back before the next module.
"""

import doctest
import importlib
import json
import os
import pkgutil
import sys

import replicator_strategy as rs

rs.split_cpu(4)
os.chdir(sys.argv[1])  # Examples that write files write there.
names = ["replicator_strategy"] + [
    info.name
    for info in pkgutil.walk_packages(rs.__path__, "replicator_strategy.")
    if not info.name.endswith("__main__")]  # Running it is the command.
for name in names:
  module = importlib.import_module(name)
  saved_environ = dict(os.environ)
  result = doctest.testmod(
      module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  os.environ.clear()
  os.environ.update(saved_environ)
  print(json.dumps({"module": name, "attempted": result.attempted,
                    "failed": result.failed}), flush=True)
