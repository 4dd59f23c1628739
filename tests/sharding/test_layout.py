"""The layout protocol: how its two layouts cut a tensor and put it back together."""

import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy.sharding import layout as layout_lib


class FlatLayoutTest(unittest.TestCase):

  def test_shards_are_equal_contiguous_and_padded_at_the_end(self):
    layout = layout_lib.FlatLayout((2, 5), 4)
    self.assertEqual(layout.shard_size, 3)
    x = tf.reshape(tf.range(1.0, 11.0), (2, 5))
    shards = [layout.shard(x, r).numpy().tolist() for r in range(4)]
    self.assertEqual(shards, [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 0]])
    np.testing.assert_array_equal(
        layout.assemble([layout.shard(x, r) for r in range(4)]), x)

  def test_fewer_elements_than_shards_and_scalars(self):
    layout = layout_lib.FlatLayout((), 4)
    shards = [layout.shard(tf.constant(7.0), r).numpy().tolist()
              for r in range(4)]
    self.assertEqual(shards, [[7], [0], [0], [0]])
    self.assertEqual(float(layout.assemble(
        [tf.constant([7.0]), *[tf.zeros([1])] * 3])), 7.0)


class RowLayoutTest(unittest.TestCase):

  def test_rows_split_as_tf_partitioners_do_and_empty_shards_pad(self):
    layout = layout_lib.RowLayout.split((5, 2), 3, 4)
    self.assertEqual(layout.rows, (2, 2, 1, 0))
    self.assertEqual(layout.offsets, (0, 2, 4, 5))
    x = tf.reshape(tf.range(10.0), (5, 2))
    shards = [layout.shard(x, g) for g in range(4)]
    self.assertEqual([s.shape.as_list() for s in shards],
                     [[2, 2], [2, 2], [1, 2], [0, 2]])
    np.testing.assert_array_equal(layout.assemble(shards), x)
    padded = tf.concat([layout.pad(s, g) for g, s in enumerate(shards)], 0)
    self.assertEqual(padded.shape.as_list(), [8, 2])
    np.testing.assert_array_equal(layout.assemble_padded(padded), x)

  def test_more_shards_than_replicas_or_rows_caps(self):
    self.assertEqual(layout_lib.RowLayout.split((9,), 8, 4).rows,
                     (3, 2, 2, 2))
    self.assertEqual(layout_lib.RowLayout.split((2,), 4, 4).rows,
                     (1, 1, 0, 0))


class ProtocolTest(unittest.TestCase):

  @parameterized.expand([
      ("flat", layout_lib.FlatLayout((5, 2), 4)),
      ("flat_fewer_elements_than_shards", layout_lib.FlatLayout((1, 2), 4)),
      ("rows", layout_lib.RowLayout.split((5, 2), 3, 4)),
  ])
  def test_every_layout_keeps_the_contract(self, _, layout):
    self.assertIsInstance(layout, layout_lib.Layout)
    x = tf.reshape(tf.range(float(np.prod(layout.shape))), layout.shape)
    shards = [layout.shard(x, g) for g in range(layout.num_shards)]
    self.assertEqual([tuple(s.shape.as_list()) for s in shards],
                     [layout.shard_shape(g) for g in range(layout.num_shards)])
    padded = [layout.pad(s, g) for g, s in enumerate(shards)]
    self.assertEqual(len({tuple(p.shape.as_list()) for p in padded}), 1)
    np.testing.assert_array_equal(layout.assemble(shards), x)
    np.testing.assert_array_equal(layout.assemble_padded(tf.concat(padded, 0)),
                                  x)

  def test_the_protocol_is_abstract(self):
    with self.assertRaises(TypeError):
      layout_lib.Layout()  # pylint: disable=abstract-class-instantiated


if __name__ == "__main__":
  unittest.main()
