"""Table and progress formatting shared by the sections."""

import json
import sys


def progress(section, row):
  """One finished row, on stderr, as it comes."""
  print(f"  {section}: {json.dumps(row)}", file=sys.stderr, flush=True)


def cells(values, names, width, fmt=".2f"):
  """`values[name]` for each of `names`, right-aligned in `width`."""
  return " ".join(f"{format(values[n], fmt):>{width}}" for n in names)


def contender_table(title, rows):
  """Rows of none / mirrored / replicator by model and replica count."""
  if not rows:
    return []
  lines = ["", title, f"{'model':8} {'replicas':>8} {'none':>8} "
           f"{'mirrored':>9} {'replicator':>11} {'R/none':>7} "
           f"{'R/mirrored':>10}  agree"]
  for r in rows:
    ms = r["ms"]
    lines.append(
        f"{r['model']:8} {r['replicas']:>8} {ms['none']:>8.2f} "
        f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
        f"{ms['replicator'] / ms['none']:>7.2f} "
        f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  return lines
