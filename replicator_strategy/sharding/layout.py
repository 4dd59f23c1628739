"""How a whole tensor is cut into one shard per replica, and put back together.

`Layout` is the protocol every sharded variable and the sharded step speak:
shard g of a whole tensor goes to global replica g (`shard`, `shard_shape`);
collectives move shards padded to one shape (`pad`), and the whole comes back
from every shard (`assemble`) or from their padded concatenation
(`assemble_padded`). Two layouts declare it:

- `FlatLayout` (`shard_optimizer_state`): the tensor flattened and cut into
  equal contiguous shards, the last zero-padded;
- `RowLayout` (`variable_partitioner`, a layout map's batch axis): the
  tensor cut along one axis (0 for a partitioner) as TF's partitioners cut,
  shards past the partitioner's count empty.

>>> x = tf.reshape(tf.range(10.0), (5, 2))
>>> flat = FlatLayout.of(x.shape, 4)
>>> [flat.shard(x, g).numpy().tolist() for g in range(4)]
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0, 0.0, 0.0]]
>>> rows = RowLayout.split((5, 2), 3, 4)
>>> [rows.shard(x, g).shape.as_list() for g in range(4)]
[[2, 2], [2, 2], [1, 2], [0, 2]]
"""

import abc
import dataclasses
import itertools
import math

import tensorflow as tf


class Layout(abc.ABC):
  """How a tensor of `shape` is cut into `num_shards` shards, shard g on replica g.

  Attributes:
    shape: the whole tensor's shape, a tuple.
    num_shards: how many shards, one per replica over every worker.
    axis: the axis of the tensor that `pad`ded shards concatenate along.
  """
  shape: tuple
  num_shards: int
  axis: int

  @abc.abstractmethod
  def shard(self, tensor, index):
    """Shard `index` of a whole-shaped `tensor`."""

  @abc.abstractmethod
  def shard_shape(self, index):
    """The shape of shard `index`, a tuple."""

  @abc.abstractmethod
  def pad(self, shard, index):
    """Shard `index` padded to the one shape every shard takes in collectives."""

  @abc.abstractmethod
  def assemble(self, shards):
    """The whole tensor from every shard, in order."""

  @abc.abstractmethod
  def assemble_padded(self, gathered):
    """The whole tensor from every padded shard, concatenated in order."""


@dataclasses.dataclass(frozen=True)
class FlatLayout(Layout):
  """A tensor of `shape` flattened and cut into `num_shards` equal shards."""
  shape: tuple
  num_shards: int
  axis = 0  # Of the flattened tensor.

  @classmethod
  def of(cls, shape, num_shards):
    """The layout of a tensor of `shape` (a `tf.TensorShape` too)."""
    return cls(tuple(tf.TensorShape(shape).as_list()), num_shards)

  @property
  def size(self):
    return math.prod(self.shape)

  @property
  def shard_size(self):
    return -(-self.size // self.num_shards)  # Rounded up; the last is padded.

  def shard(self, tensor, index):
    """Shard `index` of a full-shaped `tensor`, flat, zero-padded at the end."""
    start = min(index * self.shard_size, self.size)
    stop = min(start + self.shard_size, self.size)
    flat = tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])
    piece = flat[start:stop]
    if stop - start < self.shard_size:
      piece = tf.pad(piece, [[0, self.shard_size - (stop - start)]])
    return piece

  def padded_flat(self, tensor):
    """`tensor` flat, zero-padded to `num_shards` shards: what reduce-scatter cuts."""
    flat = tf.reshape(tensor, [-1])
    return tf.pad(flat, [[0, self.shard_size * self.num_shards - self.size]])

  def shard_shape(self, index):
    del index  # Every shard is as long.
    return (self.shard_size,)

  def pad(self, shard, index):
    del index  # Shards are padded already.
    return shard

  def assemble(self, shards):
    """The full-shaped tensor from all `shards` (padding dropped)."""
    flat = tf.concat(list(shards), axis=0) if len(shards) > 1 else shards[0]
    if self.shard_size * self.num_shards > self.size:
      flat = flat[:self.size]
    return tf.reshape(flat, self.shape)

  def assemble_padded(self, gathered):
    return self.assemble([gathered])


@dataclasses.dataclass(frozen=True)
class RowLayout(Layout):
  """A tensor of `shape` cut along `axis` (0: its rows): shard g holds
  `rows[g]` of its slices there.

  As TF's partitioners cut (`tf.nn.embedding_lookup`'s "div" strategy): the
  first shards hold one slice more when they do not divide evenly; shards
  past the partitioner's count are empty. `axis` other than 0: a layout
  map's batch axis naming that dimension.
  """
  shape: tuple
  rows: tuple
  axis: int = 0

  @classmethod
  def split(cls, shape, num_shards, num_replicas, axis=0):
    """`num_shards` (at most `num_replicas`) shards of `shape` along `axis`,
    one per replica."""
    num_shards = min(num_shards, num_replicas, shape[axis])
    base, extra = divmod(shape[axis], num_shards)
    rows = [base + (g < extra) for g in range(num_shards)]
    return cls(tuple(shape), tuple(rows + [0] * (num_replicas - num_shards)),
               axis)

  @property
  def num_shards(self):
    return len(self.rows)

  @property
  def offsets(self):
    return tuple(itertools.accumulate((0,) + self.rows[:-1]))

  @property
  def max_rows(self):
    return max(self.rows)

  def _slice(self, tensor, start, size):
    if self.axis == 0:
      return tensor[start:start + size]
    return tf.gather(tensor, tf.range(start, start + size), axis=self.axis)

  def shard(self, tensor, index):
    """Shard `index` of a whole-shaped `tensor`."""
    return self._slice(tensor, self.offsets[index], self.rows[index])

  def shard_shape(self, index):
    shape = list(self.shape)
    shape[self.axis] = self.rows[index]
    return tuple(shape)

  def pad(self, shard, index):
    """Shard `index` padded with zeros to `max_rows`: what collectives move."""
    missing = self.max_rows - self.rows[index]
    if not missing:
      return shard
    padding = [[0, 0]] * len(self.shape)
    padding[self.axis] = [0, missing]
    return tf.pad(shard, padding)

  def assemble(self, shards):
    """The whole tensor from every shard, in order."""
    shards = list(shards)
    return tf.concat(shards, axis=self.axis) if len(shards) > 1 else shards[0]

  def assemble_padded(self, gathered):
    """The whole tensor from every padded shard, concatenated in order."""
    return self.assemble([
        self._slice(gathered, g * self.max_rows, rows)
        for g, rows in enumerate(self.rows)])
