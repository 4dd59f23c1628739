"""The optimizer's gradient all-reduce: before clipping, compressed, sparse rows as one.

- Gradient clipping (`clipnorm`, `global_clipnorm`, `clipvalue`) clips each
  replica's share of the gradient before the all-reduce, which is not the
  clipped global gradient. Here clipping optimizers all-reduce first.
- The all-reduce of a sparse gradient keeps every replica's slice at a row
  apart, where one device has one slice for a lookup that does not depend
  on the batch (an `Embedding` of positions), and Keras's Adam squares each
  slice. Here such slices are summed, as one device has them.

- The gradient of a weight split over each replica's devices (a
  `layout_map`'s) is summed part by part, each part among the replicas on
  its own device; the update takes the parts, so no device holds it whole
  (`model_parallel.gradient_parts`).

And one thing Keras has no word for: with
`ReplicatorStrategy(gradient_compression=...)` the optimizer's gradient
all-reduce sends 16-bit floats (`replicator_strategy.collectives.compression`).
"""

import functools
import itertools

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import replicas
from replicator_strategy.keras import sharded_weights
from replicator_strategy.keras import step_context
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy.collectives import exchange
from replicator_strategy import options as options_lib
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.model_parallel import gradient_parts
from replicator_strategy.model_parallel import logical_devices


def _clips(optimizer):
  """Whether `optimizer` clips its gradients (by norm, global norm or value)."""
  return optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue


def reduce_before_clipping(backend_apply_gradients):

  @functools.wraps(backend_apply_gradients)
  def wrapper(self, grads, trainable_variables):
    if not (_clips(self) and replicas.in_our_replicas()):
      return backend_apply_gradients(self, grads, trainable_variables)
    with step_context.stepping(self) as step:
      # With accumulation, `reduce_accumulated_before_clipping` reduces
      # before clipping, at update steps only.
      if not self.gradient_accumulation_steps:
        pairs = ki.all_reduce_sum_gradients(self, zip(
            grads, [v.value if isinstance(v, keras.Variable) else v
                    for v in trainable_variables]))
        grads = [g for g, _ in pairs]
        step.gradients_summed = True
      return backend_apply_gradients(self, grads, trainable_variables)

  return wrapper


def reduce_accumulated_before_clipping(clip_gradients):
  """With gradient accumulation, clipping of the global (g + acc) / steps.

  Keras clips each replica's (g + acc) / steps at an update step, before its
  all-reduce; here they are all-reduced first, at update steps only (Keras
  clips nowhere else), and the update's own all-reduce is skipped.
  """

  @functools.wraps(clip_gradients)
  def wrapper(self, grads):
    # The step `reduce_before_clipping` opened where the optimizer clips.
    step = step_context.current(self)
    if step is None or not self.gradient_accumulation_steps:
      return clip_gradients(self, grads)
    if sharded_weights.any_sharded(ki.optimizer_weights(self)):
      sharded_weights.refuse_clipping_accumulated()
    # Without sharded weights, the weights do not change the sum.
    pairs = ki.all_reduce_sum_gradients(self, [(g, None) for g in grads])
    step.gradients_summed = True
    return clip_gradients(self, [g for g, _ in pairs])

  return wrapper


def clip_in_parts(clip_gradients):
  """Clipping by norm or global norm, a split weight's norm summed from its
  parts' (each part's sum of squares on its device): the clipped gradient
  stays in parts, and no device reads it whole."""

  @functools.wraps(clip_gradients)
  def wrapper(self, grads):
    if not (self.clipnorm or self.global_clipnorm):
      return clip_gradients(self, grads)
    flat, regrouped = gradient_parts.pieces_or_whole(grads)
    if len(flat) == len(grads):
      return clip_gradients(self, grads)
    if self.global_clipnorm:
      # Keras's own: its global norm sums each entry's sum of squares.
      return regrouped(ki.clip_by_global_norm(flat, self.global_clipnorm))
    clipped = []
    for g in grads:
      parts = None if g is None else gradient_parts.parts_of(g)
      if parts is None or isinstance(g, tf.IndexedSlices):
        clipped.extend(clip_gradients(self, [g]))  # Sparse stays sparse.
      else:
        clipped.append(_clip_parts_by_norm(parts, self.clipnorm))
    return clipped

  return wrapper


def _clip_parts_by_norm(parts, clip_norm):
  """`tf.clip_by_norm` of a gradient in `parts`, part by part."""
  squares = []
  for piece, device in zip(parts.pieces, parts.devices):
    with tf.device(device):
      squares.append(tf.reduce_sum(piece * piece))
  with tf.device(parts.devices[0]):
    l2sum = tf.add_n(squares)
    # As tf.clip_by_norm: a zero gradient stays zero.
    l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, 1.0)),
                      l2sum)
    clip_norm = tf.cast(clip_norm, l2sum.dtype)
    divisor = tf.maximum(l2norm, clip_norm)
  pieces = []
  for piece, device in zip(parts.pieces, parts.devices):
    with tf.device(device):
      pieces.append(piece * clip_norm / divisor)
  return parts.with_pieces(pieces).assembled()


def compressed_on_the_wire(all_reduce_sum_gradients):
  """The optimizer's gradient sum, sent as the strategy's 16-bit floats.

  `ReplicatorStrategy(gradient_compression=...)`; see
  `replicator_strategy.collectives.compression`.
  """
  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    wire = (compression_lib.wire_dtype(options_lib.of().gradient_compression)
            if replicas.in_our_replicas() else None)
    if wire is None:
      return all_reduce_sum_gradients(self, grads_and_vars)
    pairs = list(grads_and_vars)
    summed = iter(compression_lib.all_reduce_sum(
        tf.distribute.get_replica_context(),
        [g for g, _ in pairs if g is not None], wire))
    return [(None if g is None else next(summed), v) for g, v in pairs]

  return wrapper


def split_in_parts(all_reduce_sum_gradients):
  """The optimizer's gradient sum, a split weight's part by part.

  A split weight's gradient (its `gradient_parts.Parts`) is summed over the
  replicas in parts, each on its own device, compressed as the others are;
  its whole, of the summed parts, is what the update splits and, in a
  traced step, leaves unread. A sparse part whose rows are constants (an
  Embedding of positions) sums its values, as `slices_as_on_one_device`
  does for a whole. The other gradients go on to Keras's sum.
  """

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    pairs = list(grads_and_vars)
    if (step_context.gradients_summed(self) or not replicas.in_our_replicas()
        or not gradient_parts.may_have_parts()):
      return all_reduce_sum_gradients(self, pairs)
    parts = [None if g is None else gradient_parts.parts_of(g)
             for g, _ in pairs]
    if not any(parts):
      return all_reduce_sum_gradients(self, pairs)
    rest = [pair for pair, p in zip(pairs, parts) if p is None]
    rest = iter(all_reduce_sum_gradients(self, rest) if rest else ())
    split = [p for p in parts if p is not None]
    alike = [[isinstance(g, tf.IndexedSlices) and
              computed_from_constants(g.indices) for g in p.pieces]
             for p in split]
    summed = _sum_parts(
        tf.distribute.get_replica_context(),
        [p.with_pieces([g.values if a else g for g, a in zip(p.pieces, al)])
         for p, al in zip(split, alike)],
        compression_lib.wire_dtype(options_lib.of().gradient_compression))
    # A part summed by its values: sparse again, at its rows.
    summed = iter([s.with_pieces([
        tf.IndexedSlices(t, g.indices, g.dense_shape) if a else t
        for g, t, a in zip(p.pieces, s.pieces, al)])
                   for p, s, al in zip(split, summed, alike)])
    return [next(rest) if p is None else (next(summed).assembled(), v)
            for (_, v), p in zip(pairs, parts)]

  return wrapper


def _sum_parts(replica_context, parts_list, wire=None):
  """Each of `parts_list` (`Parts`, one per gradient) summed over the
  replicas in sync, part by part: part j among every replica's part j, on
  its own device (the same logical device in each replica), within each sync
  group. Returns their `Parts`.

  `wire`: the 16-bit dtype dense float parts travel as
  (`collectives.compression`), or None. In a replica's control flow (a
  `tf.cond` branch) sparse parts are summed dense, as `all_reduce` does.
  """
  ctx = replica_context
  extended = ctx.strategy.extended
  if extended.num_replicas_in_all_groups == 1:
    return list(parts_list)
  # Each piece's logical device: part j of a later pipeline stage's weight
  # is on that stage's device j, not the replica's.
  ids = [[extended.logical_devices.device_id(ctx.local_index, d)
          for d in parts.devices] for parts in parts_list]
  used = sorted({i for row in ids for i in row})
  exchanges = {i: logical_devices.communicator_on(extended, i) for i in used}
  columns = {i: [] for i in used}
  for parts, row in zip(parts_list, ids):
    for piece, device, i in zip(parts.pieces, parts.devices, row):
      with tf.device(device):
        if not ctx.can_merge and isinstance(piece, tf.IndexedSlices):
          piece = tf.convert_to_tensor(piece)
        columns[i].append(compression_lib.to_wire(piece, wire))
  if ctx.can_merge:

    def merge_fn(strategy, *values):
      del strategy
      values, totals = iter(values), []
      for i in used:
        totals += exchanges[i].cross_device_ops.batch_reduce(
            tf.distribute.ReduceOp.SUM,
            [(v, v) for v in itertools.islice(values, len(columns[i]))])
      return totals

    flat = iter(ctx.merge_call(merge_fn, args=tuple(
        v for i in used for v in columns[i])))
    summed = {i: [next(flat) for _ in columns[i]] for i in used}
  else:
    summed = {}
    for i in used:
      collectives = exchanges[i].replica_collectives
      keys = exchange.collective_keys(ctx, len(columns[i]), collectives)
      summed[i] = collectives.all_reduce(
          ctx.local_index, reduce_op_lib.ReduceOp.SUM, columns[i], keys)
  summed = {i: iter(totals) for i, totals in summed.items()}
  out = []
  for parts, row in zip(parts_list, ids):
    pieces = []
    for piece, device, i in zip(parts.pieces, parts.devices, row):
      total = next(summed[i])
      if not isinstance(total, tf.IndexedSlices):
        with tf.device(device):
          total = compression_lib.from_wire(total, piece.dtype)
      pieces.append(total)
    out.append(parts.with_pieces(pieces))
  return out


def skip_if_reduced(all_reduce_sum_gradients):

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    if step_context.gradients_summed(self):
      return list(grads_and_vars)
    return all_reduce_sum_gradients(self, grads_and_vars)

  return wrapper


def slices_as_on_one_device(all_reduce_sum_gradients):
  """The optimizer's gradient sum, with rows every replica looks up alike
  summed row by row, as one device's gradient has them.

  The all-reduce of an `IndexedSlices` gradient concatenates the replicas'
  slices: one device's own for a lookup of the batch's rows (a slice per
  token), but a lookup at rows that do not depend on the batch (an
  `Embedding` of positions, `arange` with no batch axis) gives one slice per
  row on one device, the batch's sum, and N after the all-reduce. Keras's
  Adam squares each slice, so its second moment differs (slices 1 and 2 at
  one row give 5, one device's 3 gives 9). Here such a gradient's values are
  summed across the replicas and its indices kept.
  """

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    pairs = list(grads_and_vars)
    alike = [replicas.in_our_replicas() and isinstance(g, tf.IndexedSlices) and
             computed_from_constants(g.indices) for g, _ in pairs]
    if not any(alike):
      return all_reduce_sum_gradients(self, pairs)
    summed = all_reduce_sum_gradients(
        self, [(g.values, v) if a else (g, v)
               for (g, v), a in zip(pairs, alike)])
    return [(tf.IndexedSlices(s, g.indices, g.dense_shape), v) if a else (s, v)
            for (g, _), (s, v), a in zip(pairs, summed, alike)]

  return wrapper


def computed_from_constants(tensor):
  """Whether the traced `tensor` is computed from constants alone, by ops
  that are not stateful: then it is the same on every replica.

  False where that is not known: an eager tensor, or one that depends on a
  function's inputs (the batch), a variable or a random op.

  >>> found = []
  >>> @tf.function(input_signature=[tf.TensorSpec([None])])
  ... def traced(x):
  ...   found.append(computed_from_constants(tf.range(5) * 2))
  ...   found.append(computed_from_constants(tf.range(tf.shape(x)[0])))
  ...   return x
  >>> _ = traced(tf.ones([3]))
  >>> found
  [True, False]
  """
  if tf.executing_eagerly() or not hasattr(tensor, "op"):
    return False
  seen, pending = set(), [tensor.op]
  while pending:
    op = pending.pop()
    if op in seen or op.type == "Const":
      continue
    if not op.inputs or op.op_def.is_stateful:
      return False
    seen.add(op)
    pending.extend(t.op for t in op.inputs)
  return True
