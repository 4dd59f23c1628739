"""The rounds' low-bit exchange: each group's change sent in 16, 8 or 4 bits.

With `SyncGroups(outer_dtype=...)` a round exchanges, for each trainable
weight, each group's change since the last round, `anchor - weights` (its
`anchor`: the value every group agreed on then), instead of the weights in
float32. The mean of the changes is what a round needs: local SGD sets
`anchor - mean change` (the mean of the weights), DiLoCo's outer step takes
the mean change as its gradient (`old - mean`). Each group quantizes its
change plus the residual its last quantization dropped (error feedback:
what is not sent this round is sent later, so the sum of what a group sent
stays within half a quantum of the sum of its changes) and keeps the new
residual. `Wire` says how: "bfloat16" (rounded to the nearest), "int8" or
"int4" (a symmetric scale per chunk, `max |x| / 127` or `/ 7`, rounded to
the nearest integer; two int4 values a byte).

TF's collective gather takes no 8- or 16-bit dtype, so the values travel
packed into int32 words (4 int8, 8 int4 or 2 bfloat16 a word), each chunk
with its float32 scale bitcast beside it: the gather carries the low-bit
payload itself. A piece of a weight is cut into as many chunks as each
group has replicas holding it, and each replica sends its own chunk of its
group's change (the replicas of a group agree), so a round sends each
group's change once; every replica dequantizes every group's chunks and
sums them, each weighted by its group's rows.

>>> int8 = wire("int8")
>>> words, scales, sent = quantize(tf.constant([0.5, -1.0, 0.26]), int8, 1)
>>> words.dtype.name, words.shape.as_list()  # 3 values, padded to a word
('int32', [1, 1])
>>> round(float(scales[0]) * 127, 6)  # max |x| = 127 steps
1.0
>>> [round(float(v), 4) for v in sent]  # 64, -127 and 33 steps
[0.5039, -1.0, 0.2598]
>>> [round(float(v), 4) for v in dequantize(words, scales, int8)[:3]]
[0.5039, -1.0, 0.2598]
"""

import dataclasses

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import variables as variables_lib
from replicator_strategy.collectives import per_replica

OUTER_DTYPES = ("bfloat16", "int8", "int4")


@dataclasses.dataclass(frozen=True)
class Wire:
  """How a round's changes travel: `bits` a value; `levels`, the largest
  integer sent (a chunk's largest |value| maps to it), or 0 for bfloat16,
  which needs no scale."""

  name: str
  bits: int
  levels: int

  @property
  def per_word(self):
    """Values in one int32 word."""
    return 32 // self.bits

  def chunk_length(self, size, chunks):
    """Values in each of `chunks` chunks of `size` values, padded to whole
    words."""
    per_chunk = -(-size // chunks)
    return -(-per_chunk // self.per_word) * self.per_word

  def bytes_sent(self, size, chunks):
    """Bytes of `size` values sent in `chunks` chunks: their words and a
    float32 scale each."""
    return chunks * (self.chunk_length(size, chunks) // self.per_word + 1) * 4


_WIRES = {"bfloat16": Wire("bfloat16", 16, 0), "int8": Wire("int8", 8, 127),
          "int4": Wire("int4", 4, 7)}


def wire(outer_dtype):
  """The `Wire` named `outer_dtype`, None for None."""
  if outer_dtype is None:
    return None
  if not isinstance(outer_dtype, str) or outer_dtype not in _WIRES:
    raise ValueError(
        f"Expected `outer_dtype` to be None (rounds exchange float32) or one "
        f"of {OUTER_DTYPES} (each group's change since the last round sent "
        f"in 16, 8 or 4 bits, with error feedback). Received: outer_dtype="
        f"{outer_dtype!r}.")
  return _WIRES[outer_dtype]


def quantize(value, wire_, chunks):
  """`(words, scales, sent)`: `value` flattened, padded with zeros and cut
  into `chunks` rows, as int32 words `[chunks, words]` and a float32 scale
  per row; `sent`, what they stand for, in `value`'s shape."""
  flat = tf.reshape(tf.cast(value, tf.float32), [-1])
  size = flat.shape.num_elements()
  length = wire_.chunk_length(size, chunks)
  rows = tf.reshape(tf.pad(flat, [[0, chunks * length - size]]),
                    [chunks, length])
  if wire_.levels:
    scales = tf.reduce_max(tf.abs(rows), axis=1) / wire_.levels
    steps = tf.clip_by_value(
        tf.round(rows / tf.where(scales > 0, scales, 1.0)[:, None]),
        -wire_.levels, wire_.levels)
    sent = steps * scales[:, None]
  else:
    scales = tf.ones([chunks])
    steps = tf.cast(rows, tf.bfloat16)
    sent = tf.cast(steps, tf.float32)
  return (_pack(steps, wire_), scales,
          tf.reshape(tf.reshape(sent, [-1])[:size], value.shape))


def dequantize(words, scales, wire_):
  """The values of `words` (`[chunks, words]`), each row times its scale
  (0 where the scale is: a group that trained on no rows), flattened."""
  return tf.reshape(
      tf.math.multiply_no_nan(_unpack(words, wire_), scales[:, None]), [-1])


def _pack(steps, wire_):
  chunks = steps.shape[0]
  if wire_.bits == 16:
    return tf.bitcast(tf.reshape(steps, [chunks, -1, 2]), tf.int32)
  if wire_.bits == 8:
    return tf.bitcast(tf.reshape(tf.cast(steps, tf.int8), [chunks, -1, 4]),
                      tf.int32)
  nibbles = tf.reshape(
      tf.bitwise.bitwise_and(tf.cast(steps, tf.int32), 15), [chunks, -1, 2])
  pairs = tf.bitwise.bitwise_or(nibbles[..., 0],
                                tf.bitwise.left_shift(nibbles[..., 1], 4))
  return tf.bitcast(tf.reshape(tf.cast(pairs, tf.uint8), [chunks, -1, 4]),
                    tf.int32)


def _unpack(words, wire_):
  length = int(words.shape[1]) * wire_.per_word
  if wire_.bits == 16:
    return tf.cast(tf.reshape(tf.bitcast(words, tf.bfloat16), [-1, length]),
                   tf.float32)
  if wire_.bits == 8:
    return tf.cast(tf.reshape(tf.bitcast(words, tf.int8), [-1, length]),
                   tf.float32)
  pairs = tf.cast(tf.reshape(tf.bitcast(words, tf.uint8), [-1, length // 2]),
                  tf.int32)
  nibbles = tf.reshape(tf.stack([tf.bitwise.bitwise_and(pairs, 15),
                                 tf.bitwise.right_shift(pairs, 4)], -1),
                       [-1, length])
  return tf.cast(tf.where(nibbles >= 8, nibbles - 16, nibbles), tf.float32)


class LowBitExchange:
  """A round's exchange of the trainable weights' changes at `wire`, with
  each group's residuals (error feedback), kept in `state.residuals`.

  `replicas_per_group`: a group's replicas (`num_replicas_in_sync`);
  `replicas`: every group's, over every worker.
  """

  def __init__(self, wire_, replicas_per_group, replicas, state):
    self.wire = wire_
    self._per_group = replicas_per_group
    self._replicas = replicas
    self._state = state
    self._residuals = {}  # id of a weight's anchor -> its residual.

  @classmethod
  def of(cls, strategy, outer_dtype, state):
    """The exchange `outer_dtype` names for `strategy`'s rounds, or None."""
    wire_ = wire(outer_dtype)
    return wire_ and cls(wire_, strategy.num_replicas_in_sync,
                         strategy.extended.num_replicas_in_all_groups, state)

  def keep(self, anchor, residual):
    """Keeps `residual` (made zero, beside the weight) for the weight whose
    anchor is `anchor`, in the checkpointed state."""
    self._residuals[id(anchor)] = residual
    self._state.residuals.append(residual)

  def means(self, communicator, weights, anchors, replica_weights):
    """Each of `weights`' new value, `anchor - the weighted mean change`, as
    its pieces' (`variables.round_pieces`), each a `PerReplica` of its
    components'; updates the residuals. `replica_weights`: each local
    replica's weight in the mean (its rows, times the replicas, over all
    rows), or None: equally."""
    residuals = [self._residuals[id(anchor)] for anchor in anchors]
    batches = {}  # The pieces' round ops -> [(variable, piece, sends)].
    layout = []  # Per variable, per piece: (devices, chunks, its anchor's).
    for i, (weight, anchor, residual) in enumerate(
        zip(weights, anchors, residuals)):
      layout.append([])
      for j, pieces in enumerate(zip(*(variables_lib.round_pieces(v) for v in
                                       (weight, anchor, residual)))):
        devices = [component.device for component, _ in pieces[0]]
        chunks = self._chunks(pieces[0])
        sends = per_replica.on_devices(
            devices, lambda k, p=pieces, c=chunks: self._send(
                p, k, c, replica_weights))
        layout[i].append((devices, chunks, pieces[1]))
        batches.setdefault(communicator.round_ops_on(devices), []).append(
            (i, j, sends))
    means = [[None] * len(pieces) for pieces in layout]
    for ops, batch in batches.items():
      # One gather per set of devices: every piece's words, side by side.
      widths = [int(sends[0].shape[1]) for _, _, sends in batch]
      value = per_replica.wrap([
          tf.concat([sends[k] for _, _, sends in batch], axis=1)
          for k in range(len(batch[0][2]))])
      # Across workers the gather's shape is unknown: its width is not.
      gathered = [tf.reshape(part, [-1, sum(widths)]) for part in
                  per_replica.parts(tfi.gather(ops, value, value, axis=0))]
      for (i, j, _), columns in zip(batch, _columns(widths)):
        devices, chunks, anchor_piece = layout[i][j]
        means[i][j] = per_replica.make(
            devices, lambda k, a=anchor_piece, g=gathered, c=columns,
            n=chunks: self._mean(a[k][0], g[k][:, c[0]:c[1]], n))
    return means

  def _chunks(self, piece):
    """How many of `piece`'s components hold each group's value (a group's
    replicas, or 1 where each component holds a group's shard)."""
    group = [replicas[0] // self._per_group for _, replicas in piece]
    return group.count(group[0])

  def _send(self, pieces, k, chunks, replica_weights):
    """Component k's row of the gather, `[1, 1 + words]`: the chunk of its
    group's change that is its own (its place among the group's
    components), its scale times the group's weight (bitcast) first.
    Keeps the group's residual."""
    weight, anchor, residual = (piece[k][0] for piece in pieces)
    change = tf.cast(anchor.read_value() - weight.read_value() +
                     residual.read_value(), tf.float32)
    words, scales, sent = quantize(change, self.wire, chunks)
    residual.assign(tf.cast(change - sent, residual.dtype))
    groups = [replicas[0] // self._per_group for _, replicas in pieces[0]]
    group = groups[k]
    members = range(group * self._per_group, (group + 1) * self._per_group)
    share = (float(len(members)) if replica_weights is None else
             tf.add_n([replica_weights[r] for r in members]))
    scale = scales * tf.cast(share, tf.float32) / self._replicas
    own = slice(k - groups.index(group), k - groups.index(group) + 1)
    return tf.concat([tf.bitcast(scale[own], tf.int32)[:, None], words[own]],
                     axis=1)

  def _mean(self, anchor, columns, chunks):
    """`anchor` less the weighted sum of every group's change, from the
    gathered `columns` (`[components, 1 + words]`, a group's `chunks`
    components after each other)."""
    changes = dequantize(columns[:, 1:], tf.bitcast(columns[:, 0], tf.float32),
                         self.wire)
    length = (int(columns.shape[1]) - 1) * self.wire.per_word
    total = tf.reduce_sum(tf.reshape(changes, [-1, chunks * length]), axis=0)
    size = anchor.shape.num_elements()
    return anchor.read_value() - tf.cast(
        tf.reshape(total[:size], anchor.shape), anchor.dtype)

  def bytes_sent(self, variables):
    """The bytes a round sends of `variables`' changes, each group's once."""
    return sum(self.wire.bytes_sent(piece[0][0].shape.num_elements(),
                                    self._chunks(piece))
               for v in variables for piece in variables_lib.round_pieces(v))


def bytes_sent(low_bit, trainable, non_trainable):
  """The bytes of a round of the distributed TF variables `trainable` and
  `non_trainable`: the float ones whole (a replica's all-reduce input), the
  trainable ones' changes at `low_bit`'s width where it is not None."""
  whole = list(non_trainable) + ([] if low_bit else list(trainable))
  return (sum(v.shape.num_elements() * v.dtype.size for v in whole) +
          (low_bit.bytes_sent(trainable) if low_bit else 0))


def _columns(widths):
  """(start, end) of each of `widths` side by side."""
  ends = [sum(widths[:i + 1]) for i in range(len(widths))]
  return [(end - w, end) for end, w in zip(ends, widths)]
