"""A split weight's gradient kept in its parts, from the tape to the update.

A gradient tape hands an optimizer one gradient per variable, of the
variable's whole shape. For a `SplitVariable` that whole is the
concatenation of its parts' gradients, each computed on its part's device.
The concatenation carries its `Parts` (`record`), and so does a whole read
of a split variable inside a replica (a gradient accumulator's). What is
computed from them elementwise, by scalars or by other such values (a loss
scale's division, an accumulator's sum, clipping by a norm), has parts too:
`parts_of` computes each part's on its device, from the parts. The
optimizer's all-reduce sums each part over the replicas on its own device
(`keras.gradient_exchange`: part j among every replica's logical device j),
and the update takes each part's sum (`split_variables.update`). So in a traced step
the whole feeds nothing, and TensorFlow prunes it: no device holds a split
weight's whole gradient.

>>> @tf.function
... def halves():
...   parts = [tf.ones([2, 3]), 2 * tf.ones([2, 3])]
...   whole = record(tf.concat(parts, 0), Parts(parts, 0, ["", ""]))
...   return [p[0, 0] for p in parts_of(tf.cast(whole, tf.float16) / 4).pieces]
>>> [float(x) for x in halves()]
[0.25, 0.5]
"""

import numpy as np
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

_NOTE = "parts"

# Ops computed part by part: elementwise, with every other input a scalar or
# of the same whole shape.
_ELEMENTWISE = frozenset((
    "Identity", "Cast", "Neg", "Abs", "Sign", "Square", "Sqrt", "Rsqrt",
    "Reciprocal", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "AddV2",
    "Add", "Sub", "Maximum", "Minimum", "ClipByValue", "SelectV2"))


class Parts:
  """A value of a split weight's shape in parts: `pieces[j]` (a tensor or,
  for a sparse gradient, `tf.IndexedSlices`) on `devices[j]`, slice j of the
  whole along `axis`."""

  def __init__(self, pieces, axis, devices):
    self.pieces = tuple(pieces)
    self.axis = axis
    self.devices = tuple(devices)

  def with_pieces(self, pieces):
    return Parts(pieces, self.axis, self.devices)

  def assembled(self):
    """The whole, on logical device 0, recorded with these parts: what
    Keras's optimizer is handed, and, in a traced step, prunes unread."""
    with tf.device(self.devices[0]):
      if isinstance(self.pieces[0], tf.IndexedSlices):
        whole = _concat_sparse(self.pieces, self.axis)
      else:
        whole = tf.concat(self.pieces, self.axis)
    return record(whole, self)


def record(whole, parts):
  """Returns `whole`, noted to be `parts` (a `Parts`)."""
  tfi.note(whole, _NOTE, parts)
  return whole


def parts_of(value):
  """The `Parts` of `value`, or None where it is not known to have any.

  A value recorded with parts, a tensor captured from one into a
  `tf.cond` branch, or computed from one elementwise (by scalars or other
  such values) in a graph; the parts of a computed one are computed, each on
  its part's device, in the value's own graph (once: it records them).
  """
  parts = tfi.noted(value, _NOTE)
  if parts is not None or not isinstance(value, tf.Tensor) or (
      tf.executing_eagerly() or not hasattr(value, "graph")):
    return parts
  outer = _captured_from(value)
  if outer is not None:
    return parts_of(outer)
  if not value.shape.is_fully_defined():
    return None
  op = value.op
  if op.type not in _ELEMENTWISE or len(op.outputs) != 1:
    return None
  found, inputs = None, []
  for x in op.inputs:
    if x.shape.is_fully_defined() and x.shape.num_elements() == 1 and (
        x.shape.rank == 0 or value.shape.rank >= x.shape.rank):
      inputs.append(None)  # A scalar: the same for every part.
      continue
    parts = parts_of(x) if x.shape == value.shape else None
    if parts is None or (found is not None and
                         (parts.axis, parts.devices) !=
                         (found.axis, found.devices)):
      return None
    if any(isinstance(p, tf.IndexedSlices) for p in parts.pieces):
      return None
    found = parts
    inputs.append(parts.pieces)
  if found is None:
    return None
  pieces = []
  with value.graph.as_default():
    for j, device in enumerate(found.devices):
      with tf.device(device):
        pieces.append(value.graph.create_op(
            op.type, [x if p is None else p[j] for x, p in zip(op.inputs,
                                                             inputs)],
            [value.dtype], attrs=dict(op.node_def.attr)).outputs[0])
  parts = found.with_pieces(pieces)
  record(value, parts)
  return parts


def may_have_parts():
  """Whether the strategy in scope splits weights over a replica's devices."""
  logical = getattr(tf.distribute.get_strategy().extended, "logical_devices",
                    None)
  return logical is not None and logical.per_replica > 1


def pieces_or_whole(values):
  """`values` (gradients, or None), each with `Parts` replaced by its
  pieces; and a function that puts such a list (the pieces changed, say
  scaled) back as `values` are, each split one assembled from its pieces."""
  parts = [None if v is None or not may_have_parts() else parts_of(v)
           for v in values]
  flat = []
  for v, p in zip(values, parts):
    flat.extend([v] if p is None else p.pieces)

  def regrouped(new_flat):
    out, new_flat = [], iter(new_flat)
    for p in parts:
      out.append(next(new_flat) if p is None else p.with_pieces(
          [next(new_flat) for _ in p.pieces]).assembled())
    return out

  return flat, regrouped


def uniform_pieces(value, shapes, devices):
  """`value` in pieces of `shapes` on `devices` where it is a constant of
  one value throughout (an accumulator's zeros), else None."""
  if not isinstance(value, tf.Tensor) or tf.executing_eagerly():
    return None
  constant = tf.get_static_value(value)
  if constant is None or constant.size == 0 or np.any(
      constant != constant.flat[0]):
    return None
  pieces = []
  for shape, device in zip(shapes, devices):
    with tf.device(device):
      pieces.append(tf.fill(shape, tf.constant(constant.flat[0], value.dtype)))
  return pieces


def _captured_from(tensor):
  """The outer tensor that `tensor`, a function's capture, stands for."""
  for outer, inner in getattr(tensor.graph, "captures", ()):
    if inner is tensor:
      return outer
  return None


def _concat_sparse(pieces, axis):
  shapes = [tf.get_static_value(g.dense_shape) for g in pieces]
  shape = list(shapes[0])
  shape[axis] = sum(int(s[axis]) for s in shapes)
  if axis:  # The same rows in every part: their columns side by side.
    return tf.IndexedSlices(tf.concat([g.values for g in pieces], axis),
                            pieces[0].indices, tf.constant(shape))
  offsets = np.cumsum([0] + [int(s[0]) for s in shapes[:-1]])
  return tf.IndexedSlices(
      tf.concat([g.values for g in pieces], 0),
      tf.concat([tf.cast(g.indices, tf.int64) + o
                 for g, o in zip(pieces, offsets)], 0), tf.constant(shape))
