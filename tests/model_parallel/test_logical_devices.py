"""`devices_per_replica`: a replica over several devices, placed by hand.

A two-layer model with its second layer's variable and ops on each replica's
logical device 1 trains as on one device, and each variable and op sits where
it was placed.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

import topology

ROWS = 8


def data():
  return np.random.default_rng(0).normal(size=(ROWS, 3)).astype(np.float32)


def initial():
  rng = np.random.default_rng(1)
  return (rng.normal(size=(3, 4)).astype(np.float32),
          rng.normal(size=(4, 2)).astype(np.float32))


def one_device_step():
  w0, w1 = (tf.Variable(w) for w in initial())
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(data(), w0)), w1) ** 2)
    scaled = loss / ROWS
  grads = tape.gradient(scaled, [w0, w1])
  keras.optimizers.SGD(0.1).apply_gradients(zip(grads, [w0, w1]))
  return float(loss), w0.numpy(), w1.numpy()


class LogicalDevicesTest(unittest.TestCase):

  def test_a_custom_loop_over_two_devices_per_replica_trains_as_one_device(self):
    strategy = topology.strategy_over(4, devices_per_replica=2)
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    start0, start1 = initial()
    with strategy.scope():
      w0 = tf.Variable(start0)
      with strategy.logical_device_for_variables(1):
        w1 = tf.Variable(start1)
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build([w0, w1])
    self.assertEqual([c.device[-5:] for c in w0.values], ["CPU:0", "CPU:2"])
    self.assertEqual([c.device[-5:] for c in w1.values], ["CPU:1", "CPU:3"])

    def replica_step(x):
      ctx = tf.distribute.get_replica_context()
      with tf.GradientTape() as tape:
        hidden = tf.tanh(tf.matmul(x, w0))
        with ctx.logical_device(1):
          out = tf.matmul(hidden, w1, name="second_layer")
        loss = tf.reduce_sum(out ** 2)
        scaled = loss / ROWS
      grads = tape.gradient(scaled, [w0, w1])
      optimizer.apply_gradients(zip(grads, [w0, w1]))
      return loss

    @tf.function
    def step(batch):
      return strategy.reduce("sum", strategy.run(replica_step, (batch,)), None)

    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data()).batch(ROWS))))
    loss = float(step(batch))
    want_loss, want0, want1 = one_device_step()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for variable, want in ((w0, want0), (w1, want1)):
      for component in variable.values:
        np.testing.assert_allclose(component.numpy(), want, rtol=1e-5)
    placed = sorted(op.device[-5:] for op in
                    step.get_concrete_function(batch).graph.get_operations()
                    if op.name.endswith("second_layer"))
    self.assertEqual(placed, ["CPU:1", "CPU:3"])

  def test_a_device_count_it_does_not_divide_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"devices_per_replica=3.*4"):
      topology.strategy_over(4, devices_per_replica=3)
    with self.assertRaisesRegex(ValueError, "positive int"):
      topology.strategy_over(4, devices_per_replica=0)

  def test_a_logical_device_out_of_range_is_refused(self):
    strategy = topology.strategy_over(4, devices_per_replica=2)
    with self.assertRaisesRegex(ValueError, r"in \[0, 2\)"):
      with strategy.scope(), strategy.logical_device_for_variables(2):
        pass

    def replica_fn():
      with tf.distribute.get_replica_context().logical_device(5):
        return tf.constant(1.0)

    with self.assertRaisesRegex(ValueError, r"in \[0, 2\)"):
      strategy.run(replica_fn)


if __name__ == "__main__":
  unittest.main()
