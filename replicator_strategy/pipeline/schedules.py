"""Pipeline schedules: which forward and backward each device runs, in what order.

A pipeline of `S` devices runs a model cut into stages (`S * virtual` of
them; stage `j` on device `j % S`) over `M` micro-batches. A schedule lists,
for each device, its actions in order: `F(stage, micro)` the forward,
`B(stage, micro)` the backward to the stage's inputs (and to its weights,
unless the schedule splits the backward), `W(stage, micro)` the backward to
its weights. `timeline` places the actions in time (each as soon as its
inputs exist and its device is free) and `bubble_fraction` is the share of
device time left idle:

>>> plan = schedule("1f1b", stages=2, microbatches=4)
>>> plan[1]
(F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2), F(1, 3), B(1, 3))
>>> bubble_fraction(plan, cost={"F": 1, "B": 1, "W": 0})
0.2

The schedules: "gpipe" (GPipe, arXiv 1811.06965: every forward, then every
backward), "1f1b" (PipeDream-Flush, arXiv 2006.09503: one forward, one
backward), "interleaved_1f1b" (Megatron-LM, arXiv 2104.04473: `virtual`
stages per device) and "zb_h1" (Zero Bubble's ZB-H1, arXiv 2401.10241: the
weight gradients deferred into the bubble, as much memory as 1F1B).
"""

import collections
import dataclasses

NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
UNIT_COST = {"F": 1, "B": 1, "W": 1}


@dataclasses.dataclass(frozen=True)
class Action:
  """One action of a schedule: `kind` "F", "B" or "W" of `stage` on `micro`."""
  kind: str
  stage: int
  micro: int

  def __repr__(self):
    return f"{self.kind}({self.stage}, {self.micro})"


def F(stage, micro):  # noqa: N802 (the papers' names)
  """The forward of `stage` on micro-batch `micro`."""
  return Action("F", stage, micro)


def B(stage, micro):  # noqa: N802
  """The backward of `stage` to its inputs (and weights, if not split)."""
  return Action("B", stage, micro)


def W(stage, micro):  # noqa: N802
  """The backward of `stage` to its weights (split schedules only)."""
  return Action("W", stage, micro)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per device, its actions in order (`plan[d]`); `stages` counts them all.

  `split_backward`: whether B and W are separate actions; if not, each B
  also computes the weight gradients.
  """
  name: str
  devices: tuple
  stages: int
  microbatches: int
  split_backward: bool

  def __getitem__(self, device):
    return self.devices[device]

  def __len__(self):
    return len(self.devices)

  def __iter__(self):
    return iter(self.devices)

  def device_of(self, stage):
    """The device that runs `stage`."""
    return stage % len(self.devices)


def schedule(name, stages, microbatches, virtual=1):
  """The schedule `name` for `stages` devices and `microbatches` micro-batches.

  Args:
    name: one of `NAMES`.
    stages: the pipeline's devices, `S`. The model has `S * virtual` stages.
    microbatches: `M`, any number from 1 (fewer than `S` leaves a larger
      bubble). For "interleaved_1f1b", M not a multiple of S (which
      Megatron-LM refuses) runs the order of the next multiple with the
      missing micro-batches left out.
    virtual: stages per device, for "interleaved_1f1b" only.

  Returns:
    A `Schedule`: `plan[d]` is device `d`'s tuple of actions. Device `d`
    holds the activations of at most (`peak_in_flight`): M micro-batches
    in GPipe, `min(S - d, M)` in 1F1B, `min(S, M)` in ZB-H1, and in
    interleaved 1F1B `min(2 (S - d - 1) + (v - 1) S + 1, v M')` (stage,
    micro-batch) pairs, each a v-th of the device's layers (M' is M
    rounded up to a multiple of S).
  """
  for arg, value in (("stages", stages), ("microbatches", microbatches),
                     ("virtual", virtual)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"Expected `{arg}` to be a positive int. Received: "
                       f"{arg}={value!r}.")
  if name not in NAMES:
    raise ValueError(f"Unknown pipeline schedule. Received: name={name!r}; "
                     f"expected one of {NAMES}.")
  if virtual != 1 and name != "interleaved_1f1b":
    raise ValueError(
        f"Only the 'interleaved_1f1b' schedule runs several stages per "
        f"device. Received: name={name!r}, virtual={virtual}; pass "
        f"virtual=1 or name='interleaved_1f1b'.")
  build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb_h1": _zb_h1,
           "interleaved_1f1b": lambda s, m: _interleaved(s, m, virtual)}[name]
  return Schedule(name, tuple(tuple(d) for d in build(stages, microbatches)),
                  stages * virtual, microbatches, name == "zb_h1")


def _gpipe(s_count, m_count):
  return [[F(s, m) for m in range(m_count)] + [B(s, m) for m in range(m_count)]
          for s in range(s_count)]


def _one_f_one_b(s_count, m_count):
  """Device `s` runs `S - s - 1` forwards ahead, so it holds the activations
  of at most `min(S - s, M)` micro-batches."""
  devices = []
  for s in range(s_count):
    warm = min(s_count - s - 1, m_count)
    order = [F(s, m) for m in range(warm)]
    for m in range(m_count - warm):
      order += [F(s, warm + m), B(s, m)]
    devices.append(order + [B(s, m) for m in range(m_count - warm, m_count)])
  return devices


def _interleaved(s_count, m_count, virtual):
  """Megatron-LM's order: micro-batches in groups of `S`, each group through
  the device's stages in turn; a device runs `2 (S - d - 1) + (v - 1) S`
  forwards ahead. For `M` not a multiple of `S`, the order of the next
  multiple with the missing micro-batches left out (still a valid order: it
  drops nodes from an acyclic one)."""
  padded = -(-m_count // s_count) * s_count
  total = padded * virtual

  def action(kind, d, k):
    group, rest = divmod(k, s_count * virtual)
    chunk, i = divmod(rest, s_count)
    if kind == "B":
      chunk = virtual - 1 - chunk
    return Action(kind, chunk * s_count + d, group * s_count + i)

  devices = []
  for d in range(s_count):
    warm = min(2 * (s_count - d - 1) + (virtual - 1) * s_count, total)
    order = [action("F", d, k) for k in range(warm)]
    for k in range(total - warm):
      order += [action("F", d, warm + k), action("B", d, k)]
    order += [action("B", d, k) for k in range(total - warm, total)]
    devices.append([a for a in order if a.micro < m_count])
  return devices


def _zb_h1(s_count, m_count):
  """1F1B's order with device `s`'s W lagging `s` micro-batches behind its B,
  the lagging W's run last: each device holds at most `min(S, M)`
  micro-batches (F done, W not), 1F1B's peak (device 0's), and with F, B and
  W equally long and `M >= S` the bubble is a third of 1F1B's."""
  devices = []
  for s in range(s_count):
    warm = min(s_count - s - 1, m_count)
    order = [F(s, m) for m in range(warm)]
    for m in range(m_count):
      order += [F(s, warm + m)] if warm + m < m_count else []
      order += [B(s, m)] + ([W(s, m - s)] if m >= s else [])
    devices.append(order + [W(s, m) for m in range(max(m_count - s, 0), m_count)])
  return devices


def dependencies(plan, action):
  """The actions `action` needs finished first (on any device)."""
  j, m = action.stage, action.micro
  if action.kind == "F":
    return [F(j - 1, m)] if j else []
  if action.kind == "W":
    return [B(j, m)]
  return [F(j, m)] + ([B(j + 1, m)] if j + 1 < plan.stages else [])


def check(plan):
  """Raises ValueError unless every action of `plan` is there once, on its
  stage's device, and the order can run (no device waits forever)."""
  kinds = "FBW" if plan.split_backward else "FB"
  expected = collections.Counter(
      Action(k, j, m) for k in kinds for j in range(plan.stages)
      for m in range(plan.microbatches))
  found = collections.Counter(a for d in plan for a in d)
  if found != expected:
    raise ValueError(
        f"Schedule {plan.name!r} is not one of each action: missing "
        f"{sorted(expected - found, key=repr)}, extra "
        f"{sorted(found - expected, key=repr)}.")
  for d, actions in enumerate(plan):
    for a in actions:
      if plan.device_of(a.stage) != d:
        raise ValueError(f"Schedule {plan.name!r} runs {a} on device {d}; "
                         f"stage {a.stage} is on device {plan.device_of(a.stage)}.")
  timeline(plan)


@dataclasses.dataclass(frozen=True)
class Timeline:
  """When each action of `plan` starts and ends (`start[a]`, `end[a]`)."""
  plan: Schedule
  start: dict
  end: dict

  @property
  def makespan(self):
    return max(self.end.values(), default=0)

  def busy(self, device):
    """The time `device` spends running actions."""
    return sum(self.end[a] - self.start[a] for a in self.plan[device])

  def chart(self):
    """One line per device, one column per unit of time (whole-number
    costs): the action running then (kind and micro-batch), or ".." idle.

    >>> print(timeline(schedule("zb_h1", 2, 3)).chart())
    F0 F1 .. B0 W0 F2 B1 W1 B2 W2
    .. F0 B0 F1 B1 W0 F2 B2 W1 W2
    """
    rows = []
    for actions in self.plan:
      row = [".."] * int(self.makespan)
      for a in actions:
        for t in range(int(self.start[a]), int(self.end[a])):
          row[t] = f"{a.kind}{a.micro}"
      rows.append(" ".join(row))
    return "\n".join(rows)

  def order(self):
    """Every action, by start time: an order that respects the dependencies."""
    return sorted(self.start, key=lambda a: (self.start[a], self.end[a],
                                             self.plan.device_of(a.stage)))


def timeline(plan, cost=None):
  """Places `plan`'s actions in time, each as early as it can run.

  Args:
    plan: a `Schedule`.
    cost: the time of an "F", "B" and "W" (default 1 each); where the
      backward is not split, a B takes `cost["B"] + cost["W"]`.

  Returns:
    A `Timeline`. Raises ValueError naming the actions that wait forever if
    the order deadlocks.
  """
  cost = dict(UNIT_COST, **(cost or {}))
  if not plan.split_backward:
    cost["B"] += cost["W"]
  start, end = {}, {}
  position = [0] * len(plan)
  free = [0] * len(plan)
  remaining = sum(len(d) for d in plan)
  while remaining:
    progressed = False
    for d, actions in enumerate(plan):
      while position[d] < len(actions):
        a = actions[position[d]]
        needs = dependencies(plan, a)
        if any(n not in end for n in needs):
          break
        start[a] = max([free[d]] + [end[n] for n in needs])
        end[a] = free[d] = start[a] + cost[a.kind]
        position[d] += 1
        remaining -= 1
        progressed = True
    if not progressed:
      stuck = {d: (actions[position[d]], [
          n for n in dependencies(plan, actions[position[d]]) if n not in end])
               for d, actions in enumerate(plan) if position[d] < len(actions)}
      raise ValueError(f"Schedule {plan.name!r} deadlocks: device -> (its next "
                       f"action, the actions it waits for): {stuck}.")
  return Timeline(plan, start, end)


def bubble_fraction(plan, cost=None):
  """The share of the devices' time idle from the first action to the last."""
  placed = timeline(plan, cost)
  total = len(plan) * placed.makespan
  return (total - sum(placed.busy(d) for d in range(len(plan)))) / total


def peak_in_flight(plan, sizes=None):
  """Per device, the most activations it holds at once: a (stage,
  micro-batch)'s from its F until the backward that frees them (W if split,
  else B).

  Args:
    plan: a `Schedule`.
    sizes: per stage, what one micro-batch's activations of it take (bytes,
      say); by default 1 each, so the peak counts (stage, micro-batch) pairs.
  """
  sizes = sizes or [1] * plan.stages
  last = "W" if plan.split_backward else "B"
  peaks = []
  for actions in plan:
    held = peak = 0
    for a in actions:
      held += sizes[a.stage] * ((a.kind == "F") - (a.kind == last))
      peak = max(peak, held)
    peaks.append(peak)
  return tuple(peaks)
