"""Bytes of live tensors per device in a traced training step.

`live_bytes(graph)` walks the ops of the step's graph that run (what its
outputs or a stateful op needs) in creation order (the order the forward and
then the backward built them, which is the order the tape keeps activations
for) and keeps each op's outputs alive from the op to their
last reader on the same device; a tensor read on another device is a copy
there, alive from when it was made (TF sends it then) to its last reader
there. A variable's read
value (wherever it is read: weights are not what this counts), a constant
and an `Identity` (an alias of its input, which it keeps alive as long as
itself) allocate nothing of their own. The peak per device
is the most bytes alive at once; `held` what the forward leaves for the
backward to read, by tensor (its name says its layer).

This counts what the graph asks to keep, not what the allocator did: the
runtime may free earlier (it runs ops as soon as their inputs are ready) or
keep buffers in pools. Every contender is counted the same way, so the
ratios are what the comparison reads.

>>> g = tf.Graph()
>>> with g.as_default():
...   a = tf.ones([256])          # A constant: counted as no allocation.
...   b = a * 2.0                 # 1 KiB, read by c and d.
...   c = b + 1.0                 # 1 KiB
...   d = tf.reduce_sum(b * c)    # b * c: 1 KiB, then a scalar.
>>> live_bytes(g).peak[""]
3072
"""

import dataclasses
import re

import tensorflow as tf

_FREE = frozenset({"ReadVariableOp", "VarHandleOp", "Const", "Placeholder",
                   "NoOp", "Shape", "ShapeN", "Size", "Rank"})
_ALIAS = frozenset({"Identity", "IdentityN", "StopGradient", "Reshape",
                    "Snapshot", "Squeeze", "ExpandDims"})
_BACKWARD = re.compile(r"(^|/)gradient_tape/|(^|/)gradients(_\d+)?/")


@dataclasses.dataclass(frozen=True)
class Live:
  """`peak[device]`: the most bytes alive at once on `device` (the op's
  canonical device name, "" where the graph left it unplaced);
  `held[device][tensor name]`: bytes the forward made that the backward
  reads."""
  peak: dict
  held: dict

  def held_by(self, device, pattern=".*"):
    """Bytes on `device` held for the backward whose tensor's name matches
    `pattern` (a regular expression searched in it: a layer's name)."""
    return sum(v for name, v in self.held.get(device, {}).items()
               if re.search(pattern, name))


def _bytes(tensor):
  if tensor.shape.rank is None or not tensor.shape.is_fully_defined():
    return 0  # Shape-like tensors of an unknown size: small, left out.
  return tensor.shape.num_elements() * tensor.dtype.size


def _device(op):
  return tf.DeviceSpec.from_string(op.device).to_string() if op.device else ""


def _run(graph):
  """A function graph's ops that run, in creation order: those its outputs
  or a stateful op needs (TF prunes the others, as a concatenation recorded
  for a layer that reads parts)."""
  ops = graph.get_operations()
  if not hasattr(graph, "outputs"):  # A plain graph: each op may be fetched.
    return ops
  roots = [t.op for t in graph.outputs] + list(graph.control_outputs) + [
      op for op in ops if op.op_def is None or op.op_def.is_stateful]
  needed, pending = set(), list(roots)
  while pending:
    op = pending.pop()
    if op.name in needed:
      continue
    needed.add(op.name)
    pending += [t.op for t in op.inputs] + list(op.control_inputs)
  return [op for op in ops if op.name in needed]


def live_bytes(graph):
  """The `Live` bytes of `graph`'s ops, in their creation order."""
  ops = _run(graph)
  order = {op: i for i, op in enumerate(ops)}
  # The forward ends where the first gradient op was made: the ops after it
  # (the tape's sums of gradients too, made outside its name scope) are the
  # backward's or the update's.
  backward = next((i for i, op in enumerate(ops) if _BACKWARD.search(op.name)),
                  len(ops))
  root = {}  # An alias's name -> the tensor whose buffer it is.
  # (device, buffer's name) -> [first use, last use, bytes]
  spans = {}
  held, counted = {}, set()
  for op in ops:
    i = order[op]
    device = _device(op)
    for tensor in op.inputs:
      buffer = root.get(tensor.name, tensor)
      key = (device, buffer.name)
      span = spans.get(key)
      if span is None:  # Read on another device: a copy, sent when made.
        span = spans[key] = [order[buffer.op], i, 0 if buffer.op.type in _FREE
                             else _bytes(buffer)]
      span[1] = max(span[1], i)
      if i >= backward > order[buffer.op] and span[2]:
        if key not in counted:
          counted.add(key)
          held.setdefault(device, {})[buffer.name] = span[2]
    for tensor in op.outputs:
      if op.type in _FREE:
        continue
      if op.type in _ALIAS and op.inputs:
        root[tensor.name] = root.get(op.inputs[0].name, op.inputs[0])
        continue
      spans[device, tensor.name] = [i, i, _bytes(tensor)]
  changes = {}
  for (device, _), (first, last, size) in spans.items():
    if size:
      events = changes.setdefault(device, [])
      events += [(first, size), (last + 1, -size)]
  peak = {}
  for device, events in changes.items():
    alive = top = 0
    for _, change in sorted(events):  # A free first at equal positions.
      alive += change
      top = max(top, alive)
    peak[device] = top
  return Live(peak, held)
