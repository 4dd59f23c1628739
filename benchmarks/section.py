"""What a section declares: its name, what it measures, how it runs, its table.

A section runs in one or more of three places:
  * `per_replicas(options, n)`: in the child process for replica count `n`,
    with the other sections that do (every contender in one process per
    count: MirroredStrategy's collective keys clash between instances over
    different device counts). Returns rows, or [] where `n` is not its count.
  * `fresh(options)`: in the parent, starting processes of its own (first
    epochs, peak memory); each runs `child(options, spec)`, which returns a
    JSON-able result.
  * `on_workers(options)`: in one process over every device and in each of
    2 workers x 2 devices, with the other sections that do (one process and
    one launch for all of them); returns a JSON-able result.
    `workers_rows(options, single, workers)` makes the rows in the parent
    from the one process's result and the list of the workers'.
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
  on_workers: Callable[..., dict] | None = None
  workers_rows: Callable[..., list] | None = None
