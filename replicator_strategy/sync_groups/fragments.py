"""Streaming DiLoCo's fragments: the rounds of sync groups staggered by part.

With `SyncGroups(groups=G, average_every=H, fragments=F)` the trainable
weights are cut into F fragments (Douillard et al., 2025, "Streaming DiLoCo
with overlapping communication", arXiv:2501.18512), each averaged on its own
schedule: fragment f at the steps s > 0 with (s - offset_f) % H == 0,
offset_f = f·H // F (rounded down; evenly every H/F steps when F divides H).
So every H steps each fragment has one round, a round every H/F steps
averages about 1/F of the weights, and none pays for the whole model.

The fragments are contiguous runs of the trainable weights in the order
given (a Keras model's: layer by layer, as the paper's blocks of layers),
balanced by element count: fragment f ends at the weight whose running
count of elements comes nearest f/F of the total, each fragment holding at
least one weight. Each fragment has its own anchors (the weights' own) and
its own copy of the outer optimizer; `rounds.Averaging` holds a
`Fragments` and asks it which weights a step's round takes. With an
overlapped exchange, a fragment's round starts its exchange and the next
round (the next fragment's) applies it, H/F steps later; which fragment's
is in flight is state a checkpoint keeps (`InFlight`).

>>> fragments = Fragments(count=2, average_every=4)
>>> fragments.offsets
[0, 2]
>>> [step for step in range(1, 9) if fragments.due(step - 1, step)]
[2, 4, 6, 8]
>>> fragments.due(3, 4), fragments.due(5, 6)  # Fragment 0 at 4, 8; 1 at 2, 6.
([0], [1])
>>> import tensorflow as tf
>>> weights = [tf.Variable(tf.zeros(n)) for n in (6, 2, 3, 1)]
>>> [[int(w.shape[0]) for w in part] for part in fragments.split(weights)]
[[6], [2, 3, 1]]
"""

import math

import tensorflow as tf


class InFlight(tf.train.experimental.PythonState):
  """The fragments whose overlapped exchange is in flight, by index."""

  def __init__(self):
    self.fragments = []

  def serialize(self):
    return ",".join(str(f) for f in self.fragments)

  def deserialize(self, string_value):
    self.fragments = [int(f) for f in tf.compat.as_str(string_value).split(",")
                      if f]


class Fragments:
  """The trainable weights cut into `count` fragments, each averaged every
  `average_every` steps, at its own offset; with `overlap`, which one's
  exchange is in flight (`in_flight`, an `InFlight`; None with one)."""

  def __init__(self, count, average_every, overlap=False):
    self.count = count
    self.average_every = average_every
    self.offsets = [f * average_every // count for f in range(count)]
    self.in_flight = InFlight() if overlap and count > 1 else None
    self._parts = {}  # Ids of the trainable weights -> their fragments.
    self._index = {}  # Id of a trainable weight -> its fragment.
    self._last = []  # The fragments of the trainable weights last cut.
    self._stepped = set()  # Ids of the weights the outer optimizers step.

  def due(self, last_step, step):
    """The fragments with a round at a step in (last_step, step]."""
    h = self.average_every
    return [f for f, offset in enumerate(self.offsets)
            if (step - offset) // h > (last_step - offset) // h]

  def split(self, trainable):
    """`trainable` cut into the fragments: contiguous, balanced by element
    count, each at least one weight."""
    trainable = list(trainable)
    key = tuple(id(v) for v in trainable)
    if self.count == 1:
      return [trainable]
    if key in self._parts:
      self._last = self._parts[key]
      return self._last
    if self.count > len(trainable):
      raise ValueError(
          f"Expected `fragments` to be at most the number of trainable "
          f"weights, each fragment holding at least one. Received: "
          f"fragments={self.count} for {len(trainable)} trainable weights "
          f"({[v.name for v in trainable]}). Pass fragments <= "
          f"{len(trainable)}.")
    sizes = [math.prod(tuple(v.shape)) for v in trainable]
    running = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    ends = []
    for f in range(1, self.count):
      # The cut after weight i, leaving room for the fragments after it.
      first = (ends[-1] if ends else 0) + 1
      last = len(trainable) - (self.count - f)
      target = f * running[-1] / self.count
      ends.append(min(range(first, last + 1),
                      key=lambda i: abs(running[i - 1] - target)))
    bounds = [0, *ends, len(trainable)]
    parts = [trainable[a:b] for a, b in zip(bounds, bounds[1:])]
    self._parts[key] = self._last = parts
    for f, part in enumerate(parts):
      for v in part:
        self._index[id(v)] = f
    return parts

  def of(self, variable):
    """The fragment `variable` is in (0 with one fragment)."""
    if self.count == 1:
      return 0
    if id(variable) not in self._index:
      raise ValueError(
          f"The weight {variable.name} is in no fragment: the fragments are "
          f"cut from the trainable weights given before the first step. "
          f"Give every round the same trainable weights.")
    return self._index[id(variable)]

  def due_parts(self, trainable, steps):
    """The fragments of `trainable` with a round at a step in (last_step,
    step] of `steps` (None: all)."""
    parts = self.split(trainable)
    if steps is None:
      return parts
    return [parts[f] for f in self.due(*steps)]

  def started(self, trainable):
    """Notes the fragments of `trainable` as the ones in flight."""
    if self.in_flight is not None:
      self.in_flight.fragments = sorted({self.of(v) for v in trainable})

  def pending(self, trainable):
    """The weights whose exchange is in flight: `trainable` with one
    fragment, else those of the fragments noted in flight."""
    if self.in_flight is None:
      return trainable
    if not self.in_flight.fragments:
      raise ValueError(
          "An overlapped exchange is in flight, but the rounds' state does "
          "not say which fragment's: restore a checkpoint written with the "
          "same `fragments` (its `sync_groups_state`), or one between rounds.")
    return [v for f in self.in_flight.fragments for v in self._last[f]]

  def build(self, optimizers, trainable):
    """Builds each fragment's outer optimizer among `optimizers` for its
    weights of `trainable`."""
    for optimizer, part in zip(optimizers, self.split(trainable)):
      new = [v.name for v in part if id(v) not in self._stepped]
      if optimizer.built and new:
        raise ValueError(
            f"A strategy's outer optimizer steps one model's trainable "
            f"weights, those given before its first step; these are new: "
            f"{new}. Make a new strategy (and outer optimizer) for each "
            f"model.")
      if not optimizer.built:
        optimizer.build(part)
        self._stepped.update(id(v) for v in part)

  def apply(self, optimizers, gradients, trainable):
    """Each fragment's outer optimizer among `optimizers` steps its weights
    of `trainable` by their `gradients`."""
    pairs = {}
    for gradient, v in zip(gradients, trainable):
      pairs.setdefault(self.of(v), []).append((gradient, v))
    for f, fragment_pairs in sorted(pairs.items()):
      optimizers[f].apply_gradients(fragment_pairs)


def outer_copies(strategy, outer_optimizer, count):
  """`count` copies of `outer_optimizer` (made before the strategy) in its
  scope, from its config: one per fragment; none without one."""
  if outer_optimizer is None:
    return []
  with strategy.scope():
    return [type(outer_optimizer).from_config(outer_optimizer.get_config())
            for _ in range(count)]
