"""PreemptionCheckpoint in one process: restores the latest checkpoint, never stops.

Stopping at an agreed step needs several workers: see `PreemptionTest` in
test_multi_worker.py.
"""

import tempfile
import unittest

import tensorflow as tf

import replicator_strategy as rs
import topology


class PreemptionCheckpointTest(unittest.TestCase):

  def make(self, strategy):
    with strategy.scope():
      weights = tf.Variable([1.0, 2.0])
      step = tf.Variable(0, dtype=tf.int64)
    return tf.train.Checkpoint(weights=weights, step=step), weights, step

  def test_restores_the_latest_checkpoint_of_the_directory(self):
    strategy = topology.strategy_over(2)
    with tempfile.TemporaryDirectory() as directory:
      checkpoint, weights, step = self.make(strategy)
      weights.assign([5.0, 6.0])
      step.assign(7)
      tf.train.CheckpointManager(checkpoint, directory, max_to_keep=1).save()
      restored, weights, step = self.make(strategy)
      rs.PreemptionCheckpoint(strategy, restored, directory)
    self.assertEqual(int(step.numpy()), 7)
    self.assertEqual(weights.numpy().tolist(), [5.0, 6.0])

  def test_an_empty_directory_leaves_the_initial_values(self):
    strategy = topology.strategy_over(2)
    with tempfile.TemporaryDirectory() as directory:
      checkpoint, weights, step = self.make(strategy)
      with rs.PreemptionCheckpoint(strategy, checkpoint, directory) as saver:
        for _ in range(3):
          step.assign_add(1)
          saver.step_done()  # Never stops outside a cluster.
    self.assertEqual(int(step.numpy()), 3)
    self.assertEqual(weights.numpy().tolist(), [1.0, 2.0])

  def test_anything_but_a_tf_train_checkpoint_is_refused(self):
    strategy = topology.strategy_over(1)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(), "unused",
                                         max_to_keep=1)
    with self.assertRaisesRegex(
        TypeError, r"Expected `checkpoint` to be a tf.train.Checkpoint. "
        r"Received: <tensorflow.*CheckpointManager"):
      rs.PreemptionCheckpoint(strategy, manager, "unused")


if __name__ == "__main__":
  unittest.main()
