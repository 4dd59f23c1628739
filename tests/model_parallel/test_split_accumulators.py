"""Gradient accumulation of split weights (`layout_map` and
`gradient_accumulation_steps`).

A split weight's accumulator is split as the weight is (1/k of it on each of
a replica's devices), each replica holding its own copy
(`variables.SplitReplicaSum`). The Megatron MLP of `test_layout_map`, an
update every 3 steps, 6 steps on a (2, 2) mesh: equal to one device; saved
after step 4 (the next step accumulates) or 5 (the next updates), loaded
into a fresh split model and trained to step 6: equal to 6 uninterrupted
steps to the last bit, as data parallelism's `test_accumulation_checkpoints`.
An Embedding's table split by rows or columns accumulates its sparse
gradients as one device does.
"""

import functools
import tempfile
import unittest

import keras
import numpy as np
from parameterized import parameterized
import pytest
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import variables
import saves
from test_layout_map import FEATURES
from test_layout_map import megatron_layout
from test_layout_map import mesh
from test_layout_map import mlp
from test_layout_map import OUT
from test_layout_map import SEQ
from test_layout_map import train_transformer
from test_layout_map import VOCAB
from test_layout_map import WIDTH

BATCH = 8
STEPS = 6
ACCUMULATE = 3


def data():
  rng = np.random.default_rng(1)
  return (rng.normal(size=(BATCH * STEPS, FEATURES)).astype(np.float32),
          rng.normal(size=(BATCH * STEPS, OUT)).astype(np.float32))


def compiled(replicas):
  """The MLP accumulating gradients; on a (replicas, 4 // replicas) mesh, or
  one device (None)."""
  strategy = rs.ReplicatorStrategy(
      layout_map=megatron_layout(replicas)) if replicas else None
  with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
    model = mlp()
    model.compile(keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=ACCUMULATE), "mse")
    model.optimizer.build(model.trainable_variables)
  return model


def fit(model, first, last):
  x, y = data()
  model.fit(x[first * BATCH:last * BATCH], y[first * BATCH:last * BATCH],
            batch_size=BATCH, shuffle=False, verbose=0)


@functools.cache
def trained(replicas, steps):
  """`compiled(replicas)` fitted on the first `steps` steps; tests save it,
  never change it."""
  model = compiled(replicas)
  fit(model, 0, steps)
  return model


def accumulators(model):
  return [a.value for a in model.optimizer._accumulated_gradients]  # pylint: disable=protected-access


class SplitAccumulatorTest(unittest.TestCase):

  def test_trains_as_one_device_with_the_accumulators_split(self):
    model = trained(2, STEPS)
    split = [a for a in accumulators(model)
             if isinstance(a, variables.SplitReplicaSum)]
    # up's kernel and bias, down's kernel; each part on its own device.
    self.assertEqual(len(split), 3)
    for accumulator in split:
      self.assertEqual(len({p.device for p in accumulator.values}), 4)
      self.assertEqual({tuple(p.shape) for p in accumulator.values},
                       {tuple(accumulator.parts(0)[0].shape)})
    for want, have in zip(trained(None, STEPS).get_weights(),
                          model.get_weights(), strict=True):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)

  def test_reads_as_the_sum_of_the_replicas_copies(self):
    model = trained(2, 4)  # One step accumulated since the update.
    for accumulator in accumulators(model):
      if isinstance(accumulator, variables.SplitReplicaSum):
        copies = accumulator.saved_copies().numpy()
        self.assertTrue(np.any(copies[0] != copies[1]))
        np.testing.assert_array_equal(accumulator.numpy(), copies.sum(0))

  @parameterized.expand([("rows", ("model", None)), ("columns", (None, "model"))])
  def test_a_split_table_accumulates_sparse_gradients_as_one_device_by(
      self, _, layout):
    def model():
      keras.utils.set_random_seed(3)
      ids = keras.Input((SEQ,), dtype="int32")
      x = keras.layers.Embedding(VOCAB, WIDTH, name="table")(ids)
      net = keras.Model(ids, keras.layers.Dense(VOCAB)(x))
      net.compile(keras.optimizers.Adam(
          0.01, gradient_accumulation_steps=ACCUMULATE),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      return net

    layout_map = keras.distribution.LayoutMap(mesh(2))
    layout_map[".*table/embeddings"] = layout
    with rs.ReplicatorStrategy(layout_map=layout_map).scope():
      split = model()
    want_loss, want = train_transformer(model())
    have_loss, have = train_transformer(split)
    self.assertIsInstance(accumulators(split)[0], variables.SplitReplicaSum)
    np.testing.assert_allclose(have_loss, want_loss, rtol=1e-5)
    for w, h in zip(want, have, strict=True):
      np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6)

  @parameterized.expand([
      (f"{name}_before_{step}", save, after)
      for name, save in saves.FORMATS.items()
      for step, after in (("accumulating", 4), ("update", 5))])
  def test_resumed_equals_uninterrupted_exactly(self, _, save, saved_after):
    with tempfile.TemporaryDirectory() as directory:
      load = save(trained(2, saved_after), directory)
      fresh = compiled(2)
      load(fresh)
    fit(fresh, saved_after, STEPS)
    for want, have in zip(trained(2, STEPS).get_weights(), fresh.get_weights(),
                          strict=True):
      np.testing.assert_array_equal(have, want)

  @pytest.mark.slow
  def test_moves_between_mesh_shapes_and_one_device(self):
    # Saved on 2 replicas, resumed on 1 (the sum to its one copy), saved
    # again, resumed on one device: equal to one device within rounding.
    with tempfile.TemporaryDirectory() as directory:
      on_one_replica = compiled(1)
      saves.save_weights(trained(2, 4), directory)(on_one_replica)
      fit(on_one_replica, 4, 5)
      alone = compiled(None)
      saves.save_checkpoint(on_one_replica, directory)(alone)
    fit(alone, 5, STEPS)
    for want, have in zip(trained(None, STEPS).get_weights(),
                          alone.get_weights(), strict=True):
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  unittest.main()
