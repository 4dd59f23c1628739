"""Where the MLP custom-loop step's time goes, at the most replicas.

Forward, then adding backward, the gradient all-reduce, and the optimizer
update; with one more contender, "sharded" (ReplicatorStrategy with
shard_optimizer_state=True), whose update reduce-scatters the gradients,
updates 1/N of every slot per replica and all-gathers the weights; and
"none, sliced": no strategy, the batch in as many slices in turn.
"""

from benchmarks import contenders
from benchmarks import section
from benchmarks.sections import custom

NAMES = ("none", "mirrored", "replicator", "sharded")


def parts_rows(options, n):
  if not contenders.at_most_replicas(n):
    return []
  return custom.custom_rows(options, n, model_names=("mlp",),
                            parts=custom.STEP_PARTS, sliced=True, names=NAMES,
                            section_name=SECTION.name)


def parts_table(options, rows):
  del options
  if not rows:
    return []
  lines = ["", f"MLP custom-loop step by part, {rows[0]['replicas']}"
           f" replicas, ms (median; each part adds a stage to the one above;"
           f" sliced = no strategy, the batch in as many slices in turn;"
           f" sharded = replicator with shard_optimizer_state=True)",
           f"{'part':14} {'none':>8} {'sliced':>8} {'mirrored':>9} "
           f"{'replicator':>11} {'sharded':>8} {'R/none':>7} "
           f"{'R/sliced':>8} {'R/mirrored':>10}  agree"]
  for r in rows:
    ms = r["ms"]
    lines.append(
        f"{r['part']:14} {ms['none']:>8.2f} {ms['none, sliced']:>8.2f} "
        f"{ms['mirrored']:>9.2f} {ms['replicator']:>11.2f} "
        f"{ms['sharded']:>8.2f} "
        f"{ms['replicator'] / ms['none']:>7.2f} "
        f"{ms['replicator'] / ms['none, sliced']:>8.2f} "
        f"{ms['replicator'] / ms['mirrored']:>10.2f}  {r['agree']}")
  return lines


SECTION = section.Section(
    name="parts", measures="MLP custom-loop step by part, sharded beside",
    per_replicas=parts_rows, table=parts_table)
