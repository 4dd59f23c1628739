"""The one-op input path cuts each global batch as evenly as it can, in order.

A batch of B rows on N replicas gives the first B % N replicas one row more
than the others (`np.array_split`), so only a batch of fewer rows than
replicas leaves any replica empty; TF's distributed dataset gives
ceil(B / N) rows to each in turn (5 rows on 4 replicas: 2, 2, 1, 0).
"""

import tempfile
import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from replicator_strategy import global_batch_input
import topology


def _rows(num_rows, batch_size, drop_remainder=False):
  features = np.arange(num_rows * 3, dtype=np.float32).reshape(num_rows, 3)
  return tf.data.Dataset.from_tensor_slices(
      {"x": features, "y": np.arange(num_rows)}).batch(
          batch_size, drop_remainder=drop_remainder)


def _per_replica_rows(strategy, dataset):
  """For each step, each replica's rows as lists."""
  return [[[part.numpy().tolist() for part in
            strategy.experimental_local_results(leaf)]
           for leaf in tf.nest.flatten(batch)]
          for batch in strategy.experimental_distribute_dataset(dataset)]


def _even_parts(dataset, replicas):
  """For each step, each replica's rows of an even cut, as lists."""
  return [[[part.tolist() for part in np.array_split(leaf.numpy(), replicas)]
           for leaf in tf.nest.flatten(batch)] for batch in dataset]


# (name, rows, global batch, replicas, drop_remainder): even splits, uneven
# ones (10 rows on 4 replicas: 3, 3, 2, 2), short last batches, fewer rows
# than replicas, and static shapes, even and not.
_CASES = [
    ("even", 16, 8, 4, False),
    ("uneven", 23, 10, 4, False),
    ("short_last", 10, 4, 2, False),
    ("three_replicas", 19, 7, 3, False),
    ("five_on_four", 5, 5, 4, False),
    ("fewer_rows_than_replicas", 5, 3, 4, False),
    ("one_replica", 5, 2, 1, False),
    ("static", 20, 8, 4, True),
    ("static_uneven", 20, 10, 4, True),
]


class SplitEvenlyTest(unittest.TestCase):

  @parameterized.expand(_CASES)
  def test_each_replica_gets_its_even_part_in_order(
      self, _, rows, batch, replicas, drop_remainder):
    ours = topology.strategy_over(replicas)
    dataset = _rows(rows, batch, drop_remainder)
    distributed = ours.experimental_distribute_dataset(dataset)
    self.assertIsInstance(distributed, global_batch_input.GlobalBatchDataset)
    self.assertEqual(_per_replica_rows(ours, dataset),
                     _even_parts(dataset, replicas))
    # Static batches give parts of static sizes; the others, unknown ones.
    for spec, leaf in zip(tf.nest.flatten(distributed.element_spec),
                          tf.nest.flatten(dataset.element_spec)):
      sizes = ([len(part) for part in np.array_split(range(batch), replicas)]
               if drop_remainder else [None] * replicas)
      self.assertEqual([part.shape.as_list() for part in
                        tf.nest.flatten(spec, expand_composites=True)],
                       [[size] + leaf.shape[1:].as_list() for size in sizes])

  def test_a_short_batch_mid_stream_stays_one_step(self):
    dataset = tf.data.Dataset.range(10).batch(4).repeat(2)
    rows = _per_replica_rows(topology.strategy_over(4), dataset)
    self.assertEqual(rows[2], [[[8], [9], [], []]])
    self.assertEqual(rows, _even_parts(dataset, 4))

  def test_parts_are_on_their_replicas_devices(self):
    strategy = topology.strategy_over(4)
    batch = next(iter(strategy.experimental_distribute_dataset(_rows(8, 8))))
    self.assertEqual(
        [tf.DeviceSpec.from_string(part.device).device_index
         for part in strategy.experimental_local_results(batch["x"])],
        [0, 1, 2, 3])


class WorkerSliceTest(unittest.TestCase):
  """With sync groups across workers, worker w of 2 (2 replicas each) gets
  parts 2w and 2w + 1 of every global batch: replicas 2w, 2w + 1 of 4."""

  @parameterized.expand([(name, rows, batch, static) for
                         name, rows, batch, replicas, static in _CASES
                         if replicas == 4])
  def test_a_workers_parts_are_its_replicas_of_four(self, _, rows, batch,
                                                    drop_remainder):
    dataset = _rows(rows, batch, drop_remainder)
    four = _per_replica_rows(topology.strategy_over(4), dataset)
    two = topology.strategy_over(2)
    for worker in (0, 1):
      sliced = global_batch_input.GlobalBatchDataset(
          dataset, two.extended.worker_devices, two.extended.host_device,
          worker_slice=(2 * worker, 4))
      got = [[[part.numpy().tolist() for part in
               two.experimental_local_results(leaf)]
              for leaf in tf.nest.flatten(batch)] for batch in sliced]
      self.assertEqual(got, [[leaf[2 * worker:2 * worker + 2]
                              for leaf in step] for step in four])


class InsideTFFunctionTest(unittest.TestCase):

  def setUp(self):
    super().setUp()
    self.strategy = topology.strategy_over(4)
    self.batches = self.strategy.experimental_distribute_dataset(_rows(10, 4))

  def _sum_on_replicas(self, batch):
    return self.strategy.reduce(
        "SUM", self.strategy.run(lambda b: tf.reduce_sum(b["y"]), (batch,)),
        axis=None)

  def test_for_loop_in_a_tf_function_sees_every_row(self):
    @tf.function
    def total(batches):
      result = tf.constant(0, tf.int64)
      for batch in batches:
        result += self._sum_on_replicas(batch)
      return result
    self.assertEqual(int(total(self.batches)), sum(range(10)))

  def test_new_iterators_reuse_one_trace(self):
    step = tf.function(lambda it: self._sum_on_replicas(next(it)))
    for _ in range(3):
      iterator = iter(self.batches)
      self.assertEqual(int(step(iterator)), 0 + 1 + 2 + 3)
      self.assertEqual(int(step(iterator)), 4 + 5 + 6 + 7)
    self.assertEqual(step.experimental_get_tracing_count(), 1)

  def test_optional_is_empty_after_the_last_batch(self):
    @tf.function
    def fetch(iterator):
      optional = iterator.get_next_as_optional()
      return optional.has_value(), tf.cond(
          optional.has_value(),
          lambda: self._sum_on_replicas(optional.get_value()),
          lambda: tf.constant(-1, tf.int64))
    iterator = iter(self.batches)
    self.assertEqual([(bool(h), int(s)) for h, s in
                      (fetch(iterator) for _ in range(4))],
                     [(True, 6), (True, 22), (True, 17), (False, -1)])

  def test_optional_of_statically_uneven_parts(self):
    # 10 rows on 4 replicas with drop_remainder: parts of static sizes
    # 3, 3, 2, 2, which the empty optional's spec must match.
    batches = self.strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(20).batch(10, drop_remainder=True))
    @tf.function
    def total(iterator):
      optional = iterator.get_next_as_optional()
      return tf.cond(optional.has_value(),
                     lambda: self._sum_on_replicas({"y": optional.get_value()}),
                     lambda: tf.constant(-1, tf.int64))
    iterator = iter(batches)
    self.assertEqual([int(total(iterator)) for _ in range(3)],
                     [sum(range(10)), sum(range(10, 20)), -1])

  def test_eager_iteration_stops(self):
    iterator = iter(self.batches)
    self.assertEqual(len(list(iterator)), 3)
    with self.assertRaises(StopIteration):
      next(iterator)


class CheckpointTest(unittest.TestCase):
  """A saved iterator goes on with the next batch, on any number of replicas."""

  @parameterized.expand([("same_replicas", 2, 2), ("2_to_4_replicas", 2, 4),
                         ("4_to_1_replica", 4, 1)])
  def test_restored_iterator_continues_with_the_next_batch(
      self, _, saved_on, restored_on):
    dataset = tf.data.Dataset.range(40).shuffle(40, seed=1).batch(8)
    saving = topology.strategy_over(saved_on)
    iterator = iter(saving.experimental_distribute_dataset(dataset))
    next(iterator)
    path = tf.train.Checkpoint(input=iterator).save(
        tempfile.mkdtemp() + "/ckpt")
    expected = [np.concatenate(saving.experimental_local_results(next(i)))
                for i in [iterator] * 2]
    restoring = topology.strategy_over(restored_on)
    restored = iter(restoring.experimental_distribute_dataset(dataset))
    tf.train.Checkpoint(input=restored).restore(path).assert_consumed()
    step = tf.function(restoring.experimental_local_results)
    got = [np.concatenate(restoring.experimental_local_results(next(restored))),
           np.concatenate(step(next(restored)))]
    np.testing.assert_array_equal(got, expected)


class FallsBackToTFTest(unittest.TestCase):
  """Inputs the one-op path does not take keep TF's distributed dataset."""

  def test_ragged_elements(self):
    ragged = tf.ragged.constant([[1], [2, 3], [], [4, 5, 6]])
    strategy = topology.strategy_over(2)
    distributed = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(ragged).batch(4))
    self.assertNotIsInstance(distributed,
                             global_batch_input.GlobalBatchDataset)
    batch = next(iter(distributed))
    self.assertEqual(
        [part.to_list() for part in
         strategy.experimental_local_results(batch)],
        [[[1], [2, 3]], [[], [4, 5, 6]]])

  def test_input_options(self):
    strategy = topology.strategy_over(2)
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    distributed = strategy.experimental_distribute_dataset(_rows(4, 4),
                                                           options)
    self.assertNotIsInstance(distributed,
                             global_batch_input.GlobalBatchDataset)
    batch = next(iter(distributed))
    self.assertEqual([part.numpy().tolist() for part in
                      strategy.experimental_local_results(batch["y"])],
                     [[0, 1], [2, 3]])

  def test_gpu_devices(self):
    self.assertFalse(global_batch_input.splits_on_host(
        _rows(4, 4), ["/gpu:0", "/gpu:1"], None))


class SplitRowsTest(unittest.TestCase):
  """A ragged or sparse batch is cut into the rows a dense one is cut into."""

  @parameterized.expand([("eagerly", False), ("in_a_tf_function", True)])
  def test_ragged_and_sparse_as_dense(self, _, traced):
    # 7 rows of 1 to 3 nonzero values, 0 after them: a ragged row's end.
    dense = tf.constant(np.arange(1, 22).reshape(7, 3) *
                        (np.arange(3) < np.arange(7)[:, None] % 3 + 1))
    inputs = {"dense": dense,
              "ragged": tf.RaggedTensor.from_tensor(dense, padding=0),
              "sparse": tf.sparse.from_dense(dense)}
    # In a function, the number of rows is known when it runs.
    specs = {"dense": tf.TensorSpec([None, 3], dense.dtype),
             "ragged": tf.RaggedTensorSpec([None, None], dense.dtype),
             "sparse": tf.SparseTensorSpec([None, 3], dense.dtype)}
    parts = {}
    for kind, value in inputs.items():
      split = lambda v: global_batch_input.split_rows(v, 3)
      if traced:
        split = tf.function(split, input_signature=[specs[kind]])
      parts[kind] = split(value)
    self.assertEqual(tf.concat(parts["dense"], 0).numpy().tolist(),
                     dense.numpy().tolist())
    for part, ragged, sparse in zip(parts["dense"], parts["ragged"],
                                    parts["sparse"]):
      want = part.numpy().tolist()
      self.assertEqual(ragged.to_tensor(shape=part.shape).numpy().tolist(),
                       want)
      self.assertEqual(tf.sparse.to_dense(sparse).numpy().tolist(), want)

if __name__ == "__main__":
  unittest.main()
