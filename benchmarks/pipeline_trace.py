"""A pipeline step's measured timeline: when each action ran, from TF's trace.

`measure` traces the executor's step (`pipeline.executor.run`) in a
`tf.function`, runs it once to warm up, then under
`tf.profiler.experimental` (`rounds` times, each on its own) and reads each
trace: every op the step ran, with its start and duration. Each op maps
back to the action (F, B or W of a stage and a micro-batch) whose code
built it: the executor builds an action's ops under its name scope and
ends them with an "<action>/done" group, so in the traced graph's creation
order the ops up to an action's "done" are that action's. (Names alone do
not say it: a gradient op is named after its forward op,
"gradient_tape/F1_0/...", whichever backward built it.) Those scopes and
groups are the executor's; this module only reads them.
A device's busy time is the union of its actions' ops' intervals; the
bubble is the share of the devices' time idle from the first action's first
op to the last action's last op, as `schedules.bubble_fraction` defines it
for the simulated timeline.

Activations held for the backward: the tensors an F(s, m) makes that its
B(s, m) or W(s, m) reads (a variable's read value left out: it is the
variable's buffer), counted in the traced graph; each is held from its F's
end to its last reader's end in the measured timeline.
"""

import dataclasses
import glob
import re
import tempfile

import tensorflow as tf

from replicator_strategy import _tf_internal
from replicator_strategy.pipeline import executor
from replicator_strategy.pipeline import schedules

_DONE = re.compile(r"([FBW])(\d+)_(\d+)/done")
_SCOPE = re.compile(r"([FBW])(\d+)_(\d+)$")
_TRANSFER = re.compile(r"/_\d+$")  # A _Send's or _Recv's suffix.
# Ops that move or wait, not compute: a variable read has no input and runs
# at the step's start, a _Send of an activation may run well after it.
_IDLE = ("", "ReadVariableOp", "VarHandleOp", "Const", "NoOp", "_Send",
         "_Recv")


@dataclasses.dataclass(frozen=True)
class Measured:
  """One measured step of `plan`, times in microseconds from its first op.

  `spans[action]`: (start, end) of the action's ops; `intervals[action]`:
  each of its ops' (start, end); `held[(stage, micro)]`: bytes an F holds
  for its backward; `released[(stage, micro)]`: when its last reader ended;
  `unassigned_us`: time of the step's ops that are no action's (cutting the
  batch into micro-batches, summing the losses).
  """
  plan: schedules.Schedule
  spans: dict
  intervals: dict
  held: dict
  released: dict
  unassigned_us: float

  @property
  def makespan(self):
    return max(end for _, end in self.spans.values())

  def busy(self, device):
    """The time `device` ran any op of its actions (overlaps counted once)."""
    return _union([i for a in self.actions(device) for i in self.intervals[a]])

  def busy_fractions(self):
    return [self.busy(d) / self.makespan for d in range(len(self.plan))]

  def actions(self, device):
    """`device`'s actions that ran ops, in the schedule's order."""
    return [a for a in self.plan[device] if a in self.spans]

  def parallelism(self):
    """The mean number of devices busy while any is: 1 when the devices'
    ops never overlapped (they took turns), S when all ran at once."""
    every = [i for a in self.spans for i in self.intervals[a]]
    return sum(self.busy(d) for d in range(len(self.plan))) / _union(every)

  def bubble(self):
    return 1 - sum(self.busy_fractions()) / len(self.plan)

  def mean_costs(self):
    """Each kind's mean span (us): an F, a B (with W where not split), a W."""
    costs = {}
    for kind in "FBW":
      spans = [e - s for a, (s, e) in self.spans.items() if a.kind == kind]
      costs[kind] = sum(spans) / len(spans) if spans else 0.0
    return costs

  def peak_held(self):
    """Per device, the most bytes of activations held at once."""
    peaks = []
    for device in range(len(self.plan)):
      changes = []
      for (j, m), size in self.held.items():
        if self.plan.device_of(j) == device:
          changes += [(self.spans[schedules.F(j, m)][1], size),
                      (self.released[j, m], -size)]
      held = peak = 0
      for _, change in sorted(changes):  # A release first at equal times.
        held += change
        peak = max(peak, held)
      peaks.append(peak)
    return peaks


def measure(plan, stages, devices, x, y, loss_fn, rounds=1):
  """Runs `plan` on `stages` (traced, warmed up) under the profiler `rounds`
  times; the `Measured` step of median bubble."""
  step = tf.function(lambda x, y: executor.run(plan, stages, devices, x, y,
                                               loss_fn))
  graph = step.get_concrete_function(x, y).graph
  owner = actions_of(graph)
  tf.nest.map_structure(lambda t: t.numpy(), step(x, y))  # Warm up.
  rows = int(tf.nest.flatten(x)[0].shape[0])
  held, readers = held_bytes(graph, owner, plan.microbatches, rows)
  runs = [_timeline(plan, profile(lambda: step(x, y)), owner, held, readers)
          for _ in range(rounds)]
  return sorted(runs, key=Measured.bubble)[len(runs) // 2]


def _timeline(plan, events, owner, held, readers):
  intervals = {a: [] for d in plan for a in d}
  unassigned = 0.0
  for name, start, end in events:
    action = _owner(name, owner)
    if action is None:
      unassigned += end - start
    else:
      intervals[action].append((start, end))
  # An action with no op to run: ZB-H1's B of the first stage (no input
  # gradient to send back) is its "done" alone.
  intervals = {a: i for a, i in intervals.items() if i}
  origin = min(s for i in intervals.values() for s, _ in i)
  intervals = {a: [(s - origin, e - origin) for s, e in i]
               for a, i in intervals.items()}
  spans = {a: (min(s for s, _ in i), max(e for _, e in i))
           for a, i in intervals.items()}
  released = {key: max(spans[r][1] for r in readers[key]) for key in held}
  return Measured(plan, spans, intervals, held, released, unassigned)


def actions_of(graph):
  """{op name: the executor's action that built it} for `graph`'s ops."""
  owner, pending = {}, []
  for op in graph.get_operations():  # In creation order.
    pending.append(op.name)
    done = _DONE.fullmatch(op.name)
    if done:
      action = schedules.Action(done[1], int(done[2]), int(done[3]))
      if not owner:  # Before the first action: the batch cut, no action's.
        scope = op.name.removesuffix("done")
        pending = pending[next(i for i, n in enumerate(pending)
                               if n.startswith(scope)):]
      owner.update((name, action) for name in pending)
      pending = []
  return owner


def _owner(name, owner):
  """The action of a traced op: by its graph name, else the nearest scope
  (an op the graph optimizer made or renamed keeps its original's scope)."""
  name = _TRANSFER.sub("", name)
  parts = name.split("/")
  for k in range(len(parts), 0, -1):
    found = owner.get("/".join(parts[:k]))
    if found:
      return found
  scope = _SCOPE.fullmatch(parts[0])
  return scope and schedules.Action(scope[1], int(scope[2]), int(scope[3]))


def held_bytes(graph, owner, microbatches, rows):
  """{(stage, micro): bytes its F makes that its B or W reads} and each
  one's readers (actions); a micro-batch's unknown first dimension is its
  rows (`rows` cut as the executor cuts them)."""
  held, readers = {}, {}
  for op in graph.get_operations():
    reader = owner.get(op.name)
    if reader is None or reader.kind == "F":
      continue
    for tensor in op.inputs:
      maker = owner.get(tensor.op.name)
      if (maker is None or maker.kind != "F" or tensor.op.type ==
          "ReadVariableOp" or (maker.stage, maker.micro) !=
          (reader.stage, reader.micro)):
        continue
      key = (maker.stage, maker.micro)
      readers.setdefault(key, set()).add(reader)
      seen = held.setdefault(key, {})
      micro_rows = rows // microbatches + (maker.micro < rows % microbatches)
      seen[tensor.name] = _bytes(tensor, micro_rows)
  return {k: sum(v.values()) for k, v in held.items()}, readers


def _bytes(tensor, rows):
  dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
  count = 1
  for i, dim in enumerate(dims):
    count *= dim if dim is not None else (rows if i == 0 else 1)
  return count * tensor.dtype.size


def profile(fn):
  """Runs `fn` (results fetched) under the profiler: each op it ran, as
  (name, start us, end us)."""
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    try:
      tf.nest.map_structure(lambda t: t.numpy(), fn())
    finally:
      tf.profiler.experimental.stop()
    space = _tf_internal.XSpace()
    path, = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
  events = []
  for plane in space.planes:
    names = {k: m.name for k, m in plane.event_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        name = names.get(event.metadata_id, "")
        op, sep, kind = name.rpartition(":")
        # "name:Type" is an op.
        if sep and kind not in _IDLE and not op.endswith(":") and " " not in name:
          start = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
          events.append((op, start, start + event.duration_ps / 1e6))
  return events


def _union(intervals):
  total, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total
