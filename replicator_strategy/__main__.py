"""`python -m replicator_strategy`: the environment report (see environment_report)."""

import sys

from replicator_strategy.cli import environment_report

if __name__ == "__main__":
  sys.exit(environment_report.main())
