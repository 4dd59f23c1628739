"""Sync groups' low-bit outer exchange: `SyncGroups(outer_dtype=...)`.

The quantization equals a NumPy reference of the same math; with error
feedback the total a group sent stays within half a quantum of its true
total (without it, it drifts); a custom loop on 4 logical CPUs in 2 groups
of 2 equals a NumPy reference of the same rounds, for local SGD and DiLoCo's
outer Nesterov step, bytes counted included; a run resumed between rounds
from a checkpoint equals an uninterrupted one; `fit` trains with it.
"""

import os
import tempfile
import unittest

import keras
import ml_dtypes
import numpy as np
from parameterized import parameterized
import tensorflow as tf

import models
import topology
import replicator_strategy as rs
from replicator_strategy.sync_groups import quantized

WIRES = ("bfloat16", "int8", "int4")
LEVELS = {"int8": 127, "int4": 7}
PER_WORD = {"bfloat16": 2, "int8": 4, "int4": 8}
LR = 0.25
SHAPES = ((5, 3), (3,))  # A Dense(3) on 5 features: 15 + 3 weights.


def np_quantize(x, name, chunks):
  """(sent, scales, chunk length, steps): what `name` sends of `x` in
  `chunks` chunks, by hand: `steps` (`[chunks, length]`) times `scales`."""
  flat = np.asarray(x, np.float32).reshape(-1)
  per_chunk = -(-flat.size // chunks)
  length = -(-per_chunk // PER_WORD[name]) * PER_WORD[name]
  rows = np.zeros(chunks * length, np.float32)
  rows[:flat.size] = flat
  rows = rows.reshape(chunks, length)
  if name == "bfloat16":
    scales = np.ones(chunks, np.float32)
    steps = rows.astype(ml_dtypes.bfloat16).astype(np.float32)
  else:
    scales = np.abs(rows).max(axis=1) / np.float32(LEVELS[name])
    steps = np.clip(np.round(rows / np.where(scales > 0, scales, 1)[:, None]),
                    -LEVELS[name], LEVELS[name])
  sent = steps * scales[:, None]
  return (sent.reshape(-1)[:flat.size].reshape(np.shape(x)), scales, length,
          steps)


class QuantizeTest(unittest.TestCase):

  @parameterized.expand([(n, c) for n in WIRES for c in (1, 2, 3)])
  def test_equals_numpy_and_packs_into_int32_words(self, name, chunks):
    x = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    x[0, 0] = 0.0
    words, scales, sent = quantized.quantize(tf.constant(x), quantized.wire(
        name), chunks)
    want, want_scales, length, _ = np_quantize(x, name, chunks)
    np.testing.assert_array_equal(sent, want)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(
        quantized.dequantize(words, scales, quantized.wire(name))[:x.size],
        want.reshape(-1))
    self.assertEqual(words.dtype, tf.int32)
    self.assertEqual(words.shape.as_list(),
                     [chunks, length // PER_WORD[name]])
    self.assertEqual(quantized.wire(name).bytes_sent(x.size, chunks),
                     4 * (words.shape.num_elements() + chunks))

  def test_a_chunk_of_zeros_sends_zeros(self):
    words, scales, sent = quantized.quantize(tf.zeros([4]), quantized.wire(
        "int8"), 1)
    self.assertEqual(float(scales[0]), 0.0)
    np.testing.assert_array_equal(sent, np.zeros(4))
    np.testing.assert_array_equal(
        quantized.dequantize(words, scales, quantized.wire("int8")),
        np.zeros(4))

  def test_error_feedback_keeps_the_total_sent_within_half_a_quantum(self):
    # One large change and many small ones, each below half a quantum: sent
    # alone they round to zero every round; with the residual added back
    # they get through.
    rng = np.random.default_rng(1)
    changes = np.concatenate(
        [np.ones((50, 1)), rng.uniform(0, 0.003, size=(50, 15))],
        axis=1).astype(np.float32)
    int8 = quantized.wire("int8")
    residual = tf.zeros([16])
    sent_total, plain_total = np.zeros(16), np.zeros(16)
    for n, change in enumerate(changes, 1):
      value = tf.constant(change) + residual
      _, scales, sent = quantized.quantize(value, int8, 1)
      residual = value - sent
      sent_total += sent.numpy()
      plain_total += quantized.quantize(tf.constant(change), int8, 1)[2].numpy()
      # What is not sent yet is the residual: half a quantum at most.
      quantum = float(scales[0])
      np.testing.assert_array_less(
          np.abs(sent_total - changes[:n].sum(axis=0)), quantum / 2 + 1e-5)
    self.assertGreater(np.abs(plain_total - changes.sum(axis=0)).max(),
                       5 * quantum)


def group_targets(shapes=SHAPES):
  rng = np.random.default_rng(2)
  return [rng.normal(size=(2, *shape)).astype(np.float32) for shape in shapes]


def initial(shapes=SHAPES):
  rng = np.random.default_rng(3)
  return [rng.normal(size=shape).astype(np.float32) for shape in shapes]


def make(name, outer_optimizer=None, units=3, **kwargs):
  """A strategy of 2 groups over 4 logical CPUs (with `layout_map`, of its
  replicas), a Dense(units) on 5 features in it, its optimizer, a
  checkpoint of them."""
  sync = rs.SyncGroups(groups=2, average_every=2,
                       outer_optimizer=outer_optimizer, outer_dtype=name)
  strategy = (rs.ReplicatorStrategy(sync=sync, **kwargs)
              if "layout_map" in kwargs else
              topology.strategy_over(4, sync=sync, **kwargs))
  with strategy.scope():
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(units, name="up")])
    model.set_weights(initial(((5, units), (units,))))
    optimizer = keras.optimizers.SGD(LR)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                   sync_groups=strategy.sync_groups_state)
  return strategy, model, optimizer, checkpoint


def train(strategy, model, optimizer, steps):
  """Each group steps toward its own targets: the gradient of
  |w - target|² / 2 summed over a group's replicas is w - target."""
  weights = model.trainable_variables
  targets = [tf.constant(t) for t in
             group_targets([tuple(w.shape) for w in weights])]
  replicas = strategy.num_replicas_in_sync

  def replica_step():
    group = tf.distribute.get_replica_context().sync_group
    with tf.GradientTape() as tape:
      loss = tf.add_n([tf.reduce_sum(tf.square(w - tf.gather(t, group)))
                       for w, t in zip(weights, targets)]) / (2 * replicas)
    optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))

  step = tf.function(lambda: strategy.run(replica_step))
  strategy.sync_groups_step(0, weights)
  for n in steps:
    step()
    strategy.sync_groups_step(n, weights)


def in_two_chunks(unused_i, unused_shape):
  """A weight's pieces and their chunks: whole, one chunk per replica of a
  group of 2."""
  return [(np.s_[...], 2)]


def reference(name, steps, outer_optimizer=None, pieces=in_two_chunks,
              shapes=SHAPES):
  """The same training and rounds in NumPy: (each group's weights, each
  group's residuals). Weight i's change goes as `pieces(i, its shape)`:
  (index, chunks) each; each group weighted 1/2."""
  targets = group_targets(shapes)
  groups = [initial(shapes), initial(shapes)]
  anchors = initial(shapes)
  residuals = [[np.zeros(s, np.float32) for s in shapes] for _ in range(2)]
  outer = None
  if outer_optimizer is not None:
    outer = [keras.Variable(a) for a in anchors]
  for n in steps:
    groups = [[w - np.float32(LR) * (w - t[g]) for w, t in zip(ws, targets)]
              for g, ws in enumerate(groups)]
    if n % 2:
      continue
    mean_change = []
    for i, shape in enumerate(shapes):
      total = np.zeros(shape, np.float32)
      for g in range(2):
        change = anchors[i] - groups[g][i] + residuals[g][i]
        for piece, chunks in pieces(i, shape):
          part = change[piece]
          sent, scales, _, steps = np_quantize(part, name, chunks)
          residuals[g][i][piece] = part - sent
          # As every replica receives it: its steps times its scale times
          # its group's weight, 1/2.
          received = (steps * (scales * np.float32(0.5))[:, None]).reshape(-1)
          total[piece] += received[:part.size].reshape(part.shape)
      mean_change.append(total)
    means = [a - m for a, m in zip(anchors, mean_change)]
    if outer is not None:
      for v, a in zip(outer, anchors):
        v.assign(a)
      outer_optimizer.apply_gradients(
          zip([a - m for a, m in zip(anchors, means)], outer))
      means = [v.numpy() for v in outer]
    anchors = means
    groups = [list(means), list(means)]
  return groups, residuals


def per_group(strategy, variables):
  """Each group's value of each variable (its first replica's)."""
  return [[strategy.experimental_local_results(
      v.value if isinstance(v, keras.Variable) else v)[2 * g].numpy()
           for v in variables] for g in range(2)]


class CustomLoopTest(unittest.TestCase):

  @parameterized.expand(WIRES)
  def test_local_sgd_rounds_equal_numpy(self, name):
    strategy, model, optimizer, _ = make(name)
    train(strategy, model, optimizer, range(1, 8))  # rounds at 2, 4 and 6
    want, want_residuals = reference(name, range(1, 8))
    for got, expected in zip(per_group(strategy, model.trainable_variables),
                             want):
      for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    residuals = per_group(strategy, strategy.sync_groups_state.residuals)
    for got, expected in zip(residuals, want_residuals):
      for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    # By hand, a round's bytes: the kernel's 15 values in 2 chunks of 8
    # (int8: 2 words; int4: 1; bfloat16: 4), the bias's 3 in 2 chunks of 2
    # (1 word each), each chunk with its 4-byte scale.
    per_round = {"int8": 2 * (8 + 4) + 2 * (4 + 4),
                 "int4": 2 * (4 + 4) + 2 * (4 + 4),
                 "bfloat16": 2 * (16 + 4) + 2 * (4 + 4)}[name]
    self.assertEqual(strategy.averaging.rounds, 3)
    self.assertEqual(strategy.averaging.bytes_averaged, 3 * per_round)

  def test_zero3_shards_each_shard_equals_numpy(self):
    # Each group holds each weight in 2 shards, one per replica: each
    # shard's change goes in one chunk, from the replica that holds it.
    strategy, model, optimizer, _ = make(
        "int8", variable_partitioner=(
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)))
    self.assertEqual(
        [c.shape.as_list() for c in model.layers[0].kernel.value.values],
        [[3, 3], [2, 3]] * 2)
    train(strategy, model, optimizer, range(1, 5))
    want, want_residuals = reference(
        "int8", range(1, 5), pieces=lambda i, shape: [
            (rows, 1) for rows in np.array_split(np.arange(shape[0]), 2)])
    self.assertEqual(strategy.averaging.bytes_averaged, 2 * 4 * (
        (3 + 1) + (2 + 1) + (1 + 1) + (1 + 1)))  # 9 and 6, 2 and 1 values
    def group_values(variable, g):  # Group g's shards, whole.
      return np.concatenate([variable.values[2 * g + s].read_value()
                             for s in range(2)])

    for g in range(2):
      for got, expected in zip(
          [v.value for v in model.trainable_variables] +
          list(strategy.sync_groups_state.residuals),
          want[g] + want_residuals[g]):
        np.testing.assert_allclose(group_values(got, g), expected, rtol=1e-6,
                                   atol=1e-6)

  def test_split_parts_each_part_equals_numpy(self):
    # 2 groups of 1 replica over 2 devices, the kernel column-parallel:
    # each part's change goes in one chunk, the bias whole in one.
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    strategy, model, optimizer, _ = make("int4", units=4,
                                         layout_map=layout_map)
    kernel = model.layers[0].kernel.value
    self.assertEqual([p.shape.as_list() for p in kernel.parts(0)],
                     [[5, 2], [5, 2]])
    train(strategy, model, optimizer, range(1, 5))
    want, want_residuals = reference(
        "int4", range(1, 5), shapes=((5, 4), (4,)), pieces=lambda i, shape: (
            [(np.s_[:, :2], 1), (np.s_[:, 2:], 1)] if i == 0 else
            [(np.s_[...], 1)]))
    self.assertEqual(strategy.averaging.bytes_averaged, 2 * 4 * (
        (2 + 1) + (2 + 1) + (1 + 1)))  # 10 and 10 int4 values, and 4
    for g in range(2):
      kernels = (kernel, strategy.sync_groups_state.residuals[0])
      biases = (model.layers[0].bias.value,
                strategy.sync_groups_state.residuals[1])
      for got, expected in zip(kernels, (want[g][0], want_residuals[g][0])):
        np.testing.assert_allclose(
            np.concatenate([p.read_value() for p in got.parts(g)], axis=1),
            expected, rtol=1e-6, atol=1e-6)
      for got, expected in zip(biases, (want[g][1], want_residuals[g][1])):
        np.testing.assert_allclose(
            strategy.experimental_local_results(got)[g], expected, rtol=1e-6,
            atol=1e-6)

  def test_an_outer_nesterov_step_equals_numpy(self):
    strategy, model, optimizer, _ = make("int8", nesterov())
    train(strategy, model, optimizer, range(1, 7))
    want, _ = reference("int8", range(1, 7), nesterov())
    for got, expected in zip(per_group(strategy, model.trainable_variables),
                             want):
      for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)

  def test_a_run_resumed_between_rounds_goes_on_exactly(self):
    strategy, model, optimizer, _ = make("int4", nesterov())
    train(strategy, model, optimizer, range(1, 9))
    uninterrupted = per_group(strategy, model.trainable_variables)

    strategy, model, optimizer, checkpoint = make("int4", nesterov())
    train(strategy, model, optimizer, range(1, 4))  # After round 1, and a step.
    self.assertTrue(np.any(per_group(
        strategy, strategy.sync_groups_state.residuals)[0][0]))
    with tempfile.TemporaryDirectory() as directory:
      path = checkpoint.write(os.path.join(directory, "ckpt"))
      strategy, model, optimizer, checkpoint = make("int4", nesterov())
      checkpoint.read(path).assert_existing_objects_matched()
      train(strategy, model, optimizer, range(4, 9))
    for got, want in zip(per_group(strategy, model.trainable_variables),
                         uninterrupted):
      for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def nesterov():
  return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


class FitTest(unittest.TestCase):

  def test_fit_trains_ends_with_one_model_and_counts_int8_bytes(self):
    strategy = topology.strategy_over(4, sync=rs.SyncGroups(
        groups=2, average_every=4, outer_dtype="int8"))
    with strategy.scope():
      model = models.small_mlp()
      model.set_weights(models.initial_weights())
      model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    y = rng.normal(size=(96, 3)).astype(np.float32)
    losses = model.fit(x, y, batch_size=16, verbose=0).history["loss"]
    self.assertTrue(np.isfinite(losses).all())
    for v in model.trainable_variables:
      values = strategy.experimental_local_results(v.value)
      for value in values[1:]:
        np.testing.assert_array_equal(value, values[0])
    # 6 steps: rounds after step 4 and fit's last. Each weight in 2 chunks
    # of int8, 4 a word, and a scale each: the 8x16 kernel 2 x (16 + 1)
    # words, its bias 2 x (2 + 1), the 16x3 kernel 2 x (6 + 1), its bias
    # 2 x (1 + 1); float32 would be 195 x 4 = 780 bytes.
    self.assertEqual(strategy.averaging.rounds, 2)
    self.assertEqual(strategy.averaging.bytes_averaged,
                     2 * 4 * (2 * 17 + 2 * 3 + 2 * 7 + 2 * 2))


class BadInputTest(unittest.TestCase):

  def test_an_unknown_width(self):
    with self.assertRaisesRegex(ValueError, r"outer_dtype.*'int3'"):
      rs.SyncGroups(groups=2, outer_dtype="int3")

  def test_one_group(self):
    with self.assertRaisesRegex(ValueError, "sync_groups=1 has no rounds"):
      rs.SyncGroups(outer_dtype="int8")

  def test_with_overlap(self):
    with self.assertRaisesRegex(NotImplementedError, "overlap"):
      rs.SyncGroups(groups=2, overlap=True, outer_dtype="int8")


if __name__ == "__main__":
  unittest.main()
