"""`devices_per_replica`: a replica over several devices, placed by hand.

A two-layer model with its second layer's variable and ops on each replica's
logical device 1 trains as on one device, and each variable and op sits where
it was placed.
"""

import contextlib
import unittest

import keras
import numpy as np
import tensorflow as tf

import replicator_strategy as rs
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


def adam_steps(strategy, placed=None):
  """w0 and w1 after three Adam steps of the two-layer model (w1 on logical
  device 1); `placed` gets the two variables."""
  start0, start1 = initial()
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    w0 = tf.Variable(start0)
    place = (strategy.logical_device_for_variables(1) if strategy
             else contextlib.nullcontext())
    with place:
      w1 = tf.Variable(start1)
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([w0, w1])

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, w0)), w1) ** 2)
      scaled = loss / ROWS
    grads = tape.gradient(scaled, [w0, w1])
    optimizer.apply_gradients(zip(grads, [w0, w1]))

  if strategy is None:
    run, batch = tf.function(step), data()
  else:
    run = tf.function(lambda b: strategy.run(step, (b,)))
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data()).batch(ROWS))))
  for _ in range(3):
    run(batch)
  if placed is not None:
    placed.extend([w0, w1])
  return w0.numpy(), w1.numpy()


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

  def test_adam_with_sharded_optimizer_state_trains_as_one_device(self):
    want = adam_steps(None)
    have = adam_steps(topology.strategy_over(
        4, devices_per_replica=2, shard_optimizer_state=True))
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)

  def test_sharded_variables_train_as_one_device_on_their_logical_device(self):
    # Each weight's shards go to its logical device of every replica, where
    # it is gathered inside a replica and its gradient reduce-scattered.
    strategy = topology.strategy_over(
        4, devices_per_replica=2, variable_partitioner=(
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)))
    placed = []
    have = adam_steps(strategy, placed)
    want = adam_steps(None)
    for w, h in zip(want, have):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)
    w0, w1 = placed
    self.assertEqual(type(w0).__name__, "ShardedVariable")
    self.assertEqual([c.shape.as_list() for c in w1.values], [[2, 2], [2, 2]])
    self.assertEqual([c.device[-5:] for c in w0.values], ["CPU:0", "CPU:2"])
    self.assertEqual([c.device[-5:] for c in w1.values], ["CPU:1", "CPU:3"])

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


class TpuNamesTest(unittest.TestCase):
  """TPUStrategy's three logical-device calls, placing tensors themselves."""

  @classmethod
  def setUpClass(cls):
    cls.strategy = topology.strategy_over(4, devices_per_replica=2)

  def graph_of(self, replica_fn):
    step = tf.function(lambda: self.strategy.run(replica_fn))
    return step, step.get_concrete_function().graph

  def test_assign_copies_to_the_replicas_logical_device(self):
    strategy = self.strategy

    def replica_fn():
      x = tf.constant([1.0, 2.0])
      return strategy.experimental_assign_to_logical_device(x * 2, 1)

    step, graph = self.graph_of(replica_fn)
    for part in strategy.experimental_local_results(step()):
      np.testing.assert_array_equal(part.numpy(), [2.0, 4.0])
    copies = sorted(op.device[-5:] for op in graph.get_operations()
                    if op.type == "Identity" and op.inputs and
                    op.inputs[0].op.type == "Mul")
    self.assertEqual(copies, ["CPU:1", "CPU:3"])

  def test_replicate_gives_the_tensor(self):
    strategy = self.strategy
    got = strategy.run(lambda: strategy.experimental_replicate_to_logical_devices(
        tf.constant([3.0])))
    for part in strategy.experimental_local_results(got):
      np.testing.assert_array_equal(part.numpy(), [3.0])

  def test_split_parts_go_to_each_device_and_a_row_parallel_layer_takes_them(
      self):
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*row/kernel"] = ("model", None)
    strategy = rs.ReplicatorStrategy(layout_map=layout_map)
    with strategy.scope():
      layer = keras.layers.Dense(3, name="row", use_bias=False)
      layer.build((None, 4))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    def replica_fn():
      halves = strategy.experimental_split_to_logical_devices(
          tf.constant(x), [1, 2])
      return layer(halves)

    step = tf.function(lambda: strategy.run(replica_fn))
    for part in strategy.experimental_local_results(step()):
      np.testing.assert_allclose(part.numpy(), x @ layer.kernel.numpy(),
                                 rtol=1e-5, atol=1e-5)
    graph = step.get_concrete_function().graph
    halves = [op for op in graph.get_operations() if op.type == "Identity" and
              op.inputs and op.inputs[0].op.type == "Split"]
    self.assertEqual(sorted(op.device[-5:] for op in halves),
                     ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    assembled = [op for op in graph.get_operations() if op.type == "ConcatV2"]
    self.assertEqual(len(assembled), 2)  # One per replica, feeding nothing.
    self.assertTrue(all(not op.outputs[0].consumers() for op in assembled))

  def test_bad_calls_are_refused_as_tpu_strategy_refuses_them(self):
    strategy = self.strategy
    x = tf.ones([2, 4])
    cases = [
        (lambda: strategy.experimental_split_to_logical_devices(x, [2]),
         ValueError, r"rank of `tensor` \(2\)"),
        (lambda: strategy.experimental_split_to_logical_devices(x, [1, 4]),
         ValueError, r"product is the number of logical devices per replica "
         r"\(2\)"),
        (lambda: strategy.experimental_split_to_logical_devices(
            tf.ones([3, 3]), [2, 1]), ValueError, r"size 3.*into 2 parts"),
        (lambda: strategy.experimental_assign_to_logical_device(x, 2),
         ValueError, r"in \[0, 2\)"),
    ]
    for call, error, message in cases:
      with self.subTest(message), self.assertRaisesRegex(error, message):
        strategy.run(call)
    with self.assertRaisesRegex(ValueError, "inside `strategy.run`"):
      strategy.experimental_assign_to_logical_device(x, 1)
    four = topology.strategy_over(4, devices_per_replica=4)
    with self.assertRaisesRegex(NotImplementedError, "along one dimension"):
      four.run(lambda: four.experimental_split_to_logical_devices(x, [2, 2]))


if __name__ == "__main__":
  unittest.main()
