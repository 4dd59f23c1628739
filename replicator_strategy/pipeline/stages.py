"""Pipeline stages: a model's layer calls cut into consecutive groups.

A model is read (by `replicator_strategy.keras.model_stages`) into a
`LayerGraph`: its calls in the order the model runs them, each reading and
writing named tensors. `cut` groups the calls into `Stage`s. Tensor names:
`"input:<i>"` the model's i-th (flattened) input, `"<layer>:<k>:<j>"` the
j-th output of the layer's k-th call in the model (the `keras_history` the
model's config shows), `"<tensor>/mask"` a tensor's Keras mask, and
`"output:<i>"` the model's i-th output. Stage s + 1 reads exactly what
stage s writes (`stages[s + 1].inputs == stages[s].outputs`): a tensor that
a later stage needs (a skip connection, an input) passes through the stages
between; the last stage writes the `"output:<i>"`.

Keras-neutral: this module needs only the calls' `layer` (its `weights`,
`variables`, `trainable_variables`) and their `run`.
"""

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from replicator_strategy.pipeline import balance as balance_lib


@dataclasses.dataclass(frozen=True)
class LayerCall:
  """One call of a layer: `run(values, training)` returns the tensors it
  writes (by name) from `values`, a dict holding every name in `reads`."""
  layer: Any
  reads: tuple
  writes: tuple
  run: Callable


@dataclasses.dataclass(frozen=True)
class LayerGraph:
  """A model as calls: `inputs` ("input:<i>"), `outputs` (the names of the
  tensors the model returns), `feed(x)` (the model's input `x` by name, as
  the model converts it), `pack(flat)` (outputs in the model's structure)
  and `added_losses(layer)` (the scalar losses a layer's latest call added,
  such as activity regularization; None: layers add none)."""
  name: str
  inputs: tuple
  outputs: tuple
  calls: tuple
  feed: Callable
  pack: Callable
  added_losses: Callable = None


# What a stage returns, besides its outputs, when its layers added losses:
# their sum.
ADDED_LOSS = "added_loss:"


def output_name(i):
  return f"output:{i}"


class Stage:
  """Consecutive calls of a model; `stage(tensors, training)` runs them.

  `inputs`: the tensor names it reads (all must be in `tensors`; others
  are ignored); `outputs`: those it returns; `layers`: the layers it calls
  (each once, in call order); `variables` / `trainable_variables`: theirs.
  """

  def __init__(self, index, calls, inputs, outputs, graph):
    self.index = index
    self.calls = tuple(calls)
    self.inputs = tuple(inputs)
    self.outputs = tuple(outputs)
    self.graph = graph
    self.layers = tuple({id(c.layer): c.layer for c in calls}.values())
    self.variables = _unique(v for layer in self.layers
                             for v in getattr(layer, "variables", ()))
    self.trainable_variables = _unique(
        v for layer in self.layers
        for v in getattr(layer, "trainable_variables", ()))

  @property
  def params(self):
    """How many numbers its layers' weights hold."""
    return sum(_size(v) for v in _unique(
        w for layer in self.layers for w in getattr(layer, "weights", ())))

  def __call__(self, tensors, training=None):
    missing = [name for name in self.inputs if name not in tensors]
    if missing:
      raise ValueError(
          f"Stage {self.index} of {self.graph.name!r} reads {list(self.inputs)}; "
          f"missing {missing}. Received tensors named {sorted(tensors)}. "
          f"Pass the previous stage's outputs (or `model_inputs(stages, x)` "
          f"to the first stage).")
    values = {name: tensors[name] for name in self.inputs}
    added = []
    for call in self.calls:
      values.update(call.run(values, training))
      if self.graph.added_losses is not None:
        added += self.graph.added_losses(call.layer)
    aliases = {output_name(i): name for i, name in enumerate(self.graph.outputs)}
    out = {name: values[aliases.get(name, name)] for name in self.outputs}
    if added:
      out[ADDED_LOSS] = sum(added[1:], added[0])
    return out

  def __repr__(self):
    return (f"<Stage {self.index}: {len(self.calls)} calls, "
            f"{self.layers[0].name}..{self.layers[-1].name}, "
            f"{self.params} params>")


def _unique(items):
  return list({id(item): item for item in items}.values())


def _size(variable):
  size = 1
  for dim in variable.shape:
    size *= int(dim)
  return size


def parameter_costs(calls):
  """Each call's parameter count; a weight counts at its first call only."""
  seen, costs = set(), []
  for call in calls:
    weights = [w for w in getattr(call.layer, "weights", ())
               if id(w) not in seen]
    seen.update(id(w) for w in weights)
    costs.append(sum(_size(w) for w in _unique(weights)))
  return costs


def _weight_spans(calls):
  """(first, last, layer names) of each group of calls that share a
  variable, for groups of more than one call."""
  owner = {}  # id(variable) -> index of its group's first call.
  parent = list(range(len(calls)))

  def root(i):
    while parent[i] != i:
      i = parent[i]
    return i

  for i, call in enumerate(calls):
    for v in getattr(call.layer, "variables", ()):
      if id(v) in owner:
        parent[root(i)] = root(owner[id(v)])
      else:
        owner[id(v)] = i
  groups = {}
  for i in range(len(calls)):
    groups.setdefault(root(i), []).append(i)
  spans = []
  for members in groups.values():
    if len(members) > 1:
      names = list(dict.fromkeys(calls[i].layer.name for i in members))
      spans.append((members[0], members[-1], names))
  return spans


def live_tensors(graph, position):
  """The names written before call `position` (model inputs included) that
  a call from `position` on reads or the model returns, in written order."""
  needed = set(graph.outputs)
  for call in graph.calls[position:]:
    needed.update(call.reads)
  written = list(graph.inputs)
  for call in graph.calls[:position]:
    written.extend(call.writes)
  return [name for name in written if name in needed]


def cut(graph, stages, split=None, costs=None):
  """`graph`'s calls as `stages` Stages: cut before the first call of each
  layer named in `split`, else where `balance.balanced_cuts` puts them for
  `costs` (one per call; default: parameter counts)."""
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    raise ValueError(
        f"Expected `stages` to be an int >= 1 (how many groups of layers to "
        f"cut {graph.name!r} into). Received: stages={stages!r}.")
  calls = graph.calls
  if not calls:
    raise ValueError(
        f"{graph.name!r} calls no layer: there is nothing to cut into stages. "
        f"Received: a model of inputs only. Add layers to it.")
  costs = parameter_costs(calls) if costs is None else costs
  spans = _weight_spans(calls)
  forbidden = {p for first, last, _ in spans for p in range(first + 1, last + 1)}
  allowed = [p for p in range(1, len(calls)) if p not in forbidden]
  if split is not None:
    cuts = _named_cuts(graph, stages, split, spans, costs, allowed)
  elif stages > len(allowed) + 1:
    raise ValueError(
        f"Expected `stages` to be at most {len(allowed) + 1}: {graph.name!r} "
        f"runs {len(calls)} layer calls, which can be cut at "
        f"{len(allowed)} places (the calls of a layer, or of layers sharing "
        f"weights, stay in one stage; a nested model is one call). Received: "
        f"stages={stages}. Pass fewer stages, or a model of more layers.")
  else:
    cuts = balance_lib.balanced_cuts(costs, stages, allowed)
  bounds = [0, *cuts, len(calls)]
  result = []
  for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
    outputs = ([output_name(i) for i in range(len(graph.outputs))]
               if s == stages - 1 else live_tensors(graph, b))
    result.append(Stage(s, calls[a:b], live_tensors(graph, a), outputs, graph))
  return tuple(result)


def _named_cuts(graph, stages, split, spans, costs, allowed):
  """The cut positions `split` (layer names) asks for, checked."""
  calls = graph.calls
  first_call = {}
  for i, call in enumerate(calls):
    first_call.setdefault(call.layer.name, i)
  if isinstance(split, str) or len(split) != stages - 1:
    raise ValueError(
        f"Expected `split` to list {stages - 1} layer names for stages="
        f"{stages} (the first layer of each stage after the first). "
        f"Received: split={split!r}.")
  order = list(first_call)
  for name in split:
    holder = next((c.layer.name for c in calls if name in
                   [inner.name for inner in getattr(c.layer, "layers", ())]),
                  None)
    if name not in first_call and holder:
      raise ValueError(
          f"`split` names {name!r}, a layer inside {holder!r}, a model "
          f"{graph.name!r} calls as one layer: a stage holds it whole. "
          f"Received: split={list(split)}. Name {holder!r} or a layer after "
          f"it (or build {graph.name!r} from the inner model's layers).")
    if name not in first_call:
      near = difflib.get_close_matches(str(name), order, n=5, cutoff=0.5)
      raise ValueError(
          f"`split` names {name!r}, which is not a layer {graph.name!r} "
          f"calls. Did you mean {near or order[:10]}? (the layers, in the "
          f"order the model calls them: {order})")
  cuts = [first_call[name] for name in split]
  if cuts[0] == 0:
    raise ValueError(
        f"`split` names {split[0]!r}, the first layer {graph.name!r} calls: "
        f"the first stage would be empty. Name the first layer of each "
        f"stage after the first. Received: split={list(split)}.")
  if any(b <= a for a, b in zip(cuts, cuts[1:])):
    in_order = sorted(set(split), key=first_call.get)
    raise ValueError(
        f"Expected `split` in the order {graph.name!r} calls its layers, "
        f"each once. Received: split={list(split)}; in call order: "
        f"{in_order}.")
  for s, position in enumerate(cuts):
    for first, last, names in spans:
      if first < position <= last:
        raise ValueError(_shared_weights_message(
            graph, split, s, first, last, names, cuts, costs, allowed))
  return tuple(cuts)


def _shared_weights_message(graph, split, s, first, last, names, cuts,
                            costs, allowed):
  """The error for cut `s` falling between calls sharing weights."""
  calls = graph.calls
  bounds = [0, *cuts, len(calls)]
  keep = [p for p in (first, last + 1) if p in allowed and
          bounds[s] < p < bounds[s + 2]]
  if keep:
    suggestion = list(split)
    suggestion[s] = calls[keep[-1]].layer.name
    fix = f"Keep them in one stage, e.g. split={suggestion}."
  elif len(allowed) >= len(cuts):
    suggestion = [calls[p].layer.name for p in balance_lib.balanced_cuts(
        costs, len(cuts) + 1, allowed)]
    fix = f"Keep them in one stage, e.g. split={suggestion}."
  else:
    fix = (f"Keep them in one stage: {graph.name!r} can be cut into at most "
           f"{len(allowed) + 1} stages.")
  return (
      f"`split` puts calls of layers sharing weights ({', '.join(names)}: "
      f"calls {first}..{last} of {graph.name!r}, by "
      f"{calls[first].layer.name!r} and {calls[last].layer.name!r}) in "
      f"stages {_stage_of(bounds, first)} and {_stage_of(bounds, last)}; a weight lives in one "
      f"stage. Received: split={list(split)}. {fix}")


def _stage_of(bounds, position):
  return max(k for k, b in enumerate(bounds[:-1]) if b <= position)


def model_inputs(stages, x):
  """The model's input `x` as the first stage reads it (by name)."""
  return stages[0].graph.feed(x)


def model_outputs(stages, x, training=None):
  """The model's outputs for `x`, the stages run in order: what
  `model(x, training=training)` returns."""
  tensors = model_inputs(stages, x)
  for stage in stages:
    tensors = stage(tensors, training=training)
  return stages[-1].graph.pack(
      [tensors[output_name(i)] for i in range(len(stages[-1].graph.outputs))])


def describe(stages):
  """A table: per stage its layers, parameter count, tensors in and out."""
  lines = []
  for stage in stages:
    names = [layer.name for layer in stage.layers]
    lines.append(
        f"stage {stage.index}: {len(names)} layers ({', '.join(names)}), "
        f"{stage.params} params\n  in:  {', '.join(stage.inputs)}\n"
        f"  out: {', '.join(stage.outputs)}")
  return "\n".join(lines)
