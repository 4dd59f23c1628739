"""Keras fit step with `jit_compile=True` against without, per contender.

At the most replicas, the MLP and conv net (--quick: the MLP).
MirroredStrategy cannot compile its replicated step with XLA: its failure is
recorded, not raised.
"""

from benchmarks import contenders
from benchmarks import section
from benchmarks.sections import fit

NAMES = tuple(f"{name}{xla}" for name in fit.NAMES for xla in ("", "+xla"))


def xla_rows(options, n):
  if not contenders.at_most_replicas(n):
    return []
  return fit.fit_rows(options, n, model_names=options.size["xla_models"],
                      names=NAMES, section_name=SECTION.name)


def xla_table(options, rows):
  """jit_compile=True beside not, per contender; a failed contender says so."""
  del options
  lines = []
  for r in rows:
    ms = r["ms"]
    if not lines:
      lines += ["", f"Keras fit step with jit_compile=True (+xla) and without, "
                f"{r['replicas']} replicas, ms (median)",
                f"{'model':8} " + " ".join(f"{name:>15}" for name in NAMES) +
                f" {'R+xla/R':>8} {'R+xla/none+xla':>14}  agree"]
    cell = lambda name, ms=ms: (f"{ms[name]:>15.2f}" if name in ms
                                else f"{'fails':>15}")
    lines.append(
        f"{r['model']:8} " + " ".join(cell(name) for name in NAMES) +
        f" {ms['replicator+xla'] / ms['replicator']:>8.2f}"
        f" {ms['replicator+xla'] / ms['none+xla']:>14.2f}  {r['agree']}")
  for r in rows:
    for name, error in r["failed"].items():
      lines.append(f"{r['model']} {name} fails: {error}")
  return lines


SECTION = section.Section(
    name="xla", measures="fit step with jit_compile=True and without",
    per_replicas=xla_rows, table=xla_table)
