"""What a section declares: its name, what it measures, how it runs, its table.

A section runs in one or both of two places:
  * `per_replicas(options, n)`: in the child process for replica count `n`,
    with the other sections that do (every contender in one process per
    count: MirroredStrategy's collective keys clash between instances over
    different device counts). Returns rows, or [] where `n` is not its count.
  * `fresh(options)`: in the parent, starting processes of its own (first
    epochs, peak memory, workers); each runs `child(options, spec)`, which
    returns a JSON-able result.
Its rows are the list under its name in the results JSON; `table(options,
rows)` formats them, as lines.
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  measures: str
  table: Callable[..., list]
  per_replicas: Callable[..., list] | None = None
  fresh: Callable[..., list] | None = None
  child: Callable[..., dict] | None = None
