"""Deprecated home of the launcher: `replicator-launch` now.

`python -m replicator_strategy.launch` keeps working for this release, with a
`DeprecationWarning` naming the new entry points: the `replicator-launch`
command, or `python -m replicator_strategy.cli.launch`. Importing `main` from
here works the same way.
"""

import sys
import warnings

from replicator_strategy.cli import launch
from replicator_strategy.cli.launch import main

MOVED = ("replicator_strategy.launch is deprecated and will be removed in the "
         "next release: run `replicator-launch` (or `python -m "
         "replicator_strategy.cli.launch`), or import main from "
         "replicator_strategy.cli.launch.")

__all__ = ["main"]

# Run as a script, the warning is this module's own (`__main__`), which
# Python's default filters show; imported, it is the importer's.
warnings.warn(MOVED, DeprecationWarning,
              stacklevel=1 if __name__ == "__main__" else 2)

if __name__ == "__main__":
  sys.argv[0] = launch.__file__  # The usage line names the new command.
  sys.exit(main())
