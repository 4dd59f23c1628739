"""Random layers' fit step: one device's draws against each replica's own.

At the most replicas: the fit step of a conv net with Dropout(0.5) and of an
image model with RandomFlip + RandomRotation, with each replica drawing its
rows of one device's random values (the default, "replicator") and as Keras
alone draws them ("own draws": each replica its batch's first rows, as
MirroredStrategy does); no strategy and MirroredStrategy beside.
"""

from benchmarks import contenders
from benchmarks import models
from benchmarks import section
from benchmarks.sections import fit

OWN = "replicator" + fit.OWN_DRAWS


def random_rows(options, n):
  if not contenders.at_most_replicas(n):
    return []
  return fit.fit_rows(options, n, model_names=tuple(models.RANDOM_MODELS),
                      names=fit.NAMES + (OWN,), section_name=SECTION.name)


def random_table(options, rows):
  """Drawing one device's rows ("replicator") against each replica's own."""
  del options
  lines = []
  for r in rows:
    ms = r["ms"]
    if not lines:
      lines += ["", f"Random layers: Keras fit step, {r['replicas']} replicas,"
                f" ms (median; own draws = each replica its batch's first "
                f"rows, as Keras alone)",
                f"{'model':10} {'none':>8} {'mirrored':>9} {'replicator':>11} "
                f"{'own draws':>10} {'R/own':>7} {'R/mirrored':>10} "
                f"{'R/none':>7}  agree"]
    lines.append(
        f"{r['model']:10} {ms['none']:>8.2f} {ms['mirrored']:>9.2f} "
        f"{ms['replicator']:>11.2f} {ms[OWN]:>10.2f} "
        f"{ms['replicator'] / ms[OWN]:>7.2f} "
        f"{ms['replicator'] / ms['mirrored']:>10.2f} "
        f"{ms['replicator'] / ms['none']:>7.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="random", measures="random layers: one device's draws vs own draws",
    per_replicas=random_rows, table=random_table)
