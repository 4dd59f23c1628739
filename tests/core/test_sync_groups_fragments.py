"""Streaming DiLoCo's fragments: `SyncGroups(fragments=F)` on 4 logical CPUs.

Two groups of two replicas. A custom loop of gradient steps toward each
replica's own targets equals a NumPy reference of the same math, step by
step: fragment f averaged at the steps s with (s - f·H/F) % H == 0, by the
plain mean or DiLoCo's outer Nesterov step, each fragment from its own
anchors and momentum; F = 1 is the rounds as they were. `fit` averages the
fragments due and ends with one model; a run resumed between two
fragments' rounds (from a `tf.train.Checkpoint` of `sync_groups_state`, or
`BackupAndRestore`) equals the uninterrupted one.
"""

import os
import tempfile
import unittest

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import models
import topology
import replicator_strategy as rs

LR = 0.1
SIZES = (3, 5, 2)  # Weights a, b, c: F = 2 cuts [a] | [b, c]; F = 3 each.
STEPS = 9
RTOL, ATOL = 1e-6, 1e-7


def targets(sizes=SIZES):
  """Step s, replica r: the point replica r's step pulls each weight to."""
  rng = np.random.default_rng(0)
  return rng.normal(size=(STEPS + 1, 4, sum(sizes))).astype(np.float32)


def nesterov():
  return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def grouped(fragments, average_every, outer_optimizer=None, overlap=False,
            outer_dtype=None):
  return topology.strategy_over(4, sync=rs.SyncGroups(
      groups=2, average_every=average_every, outer_optimizer=outer_optimizer,
      overlap=overlap, fragments=fragments, outer_dtype=outer_dtype))


def reference(fragments, average_every, outer, overlap=False, steps=STEPS,
              sizes=SIZES, cuts=None, exchange=None):
  """Each step's weights of each replica, in NumPy: a list of [4, 10]
  (of `sizes`' sum). `cuts`: each fragment's (first, end) column, for
  `SIZES` by default. With `overlap`, a fragment's round snapshots it and
  the next round (of any fragment) applies the snapshots' mean (or the
  outer step from it) plus each replica's progress since. `exchange(lo, hi,
  anchor, w)`: a round's mean of columns lo:hi (None: the plain mean)."""
  if cuts is None:
    cuts = {1: [(0, 10)], 2: [(0, 3), (3, 10)],
            3: [(0, 3), (3, 8), (8, 10)]}[fragments]
  offsets = [f * average_every // fragments for f in range(fragments)]
  t = targets(sizes)
  w = np.zeros((4, sum(sizes)), np.float32)
  anchor = np.zeros(sum(sizes), np.float32)
  momentum = np.zeros(sum(sizes), np.float32)

  def round_of(lo, hi, mean=None):
    if mean is None:
      mean = (w[:, lo:hi].mean(axis=0) if exchange is None else
              exchange(lo, hi, anchor, w))
    if outer:  # Keras's SGD(0.7, momentum=0.9, nesterov=True).
      g = anchor[lo:hi] - mean
      momentum[lo:hi] = 0.9 * momentum[lo:hi] - 0.7 * g
      mean = anchor[lo:hi] + 0.9 * momentum[lo:hi] - 0.7 * g
    anchor[lo:hi] = mean
    w[:, lo:hi] = mean

  in_flight = []  # [(lo, hi, each replica's snapshot)]

  def apply_in_flight():
    for lo, hi, snapshot in in_flight:
      progress = w[:, lo:hi] - snapshot
      round_of(lo, hi, snapshot.mean(axis=0))
      w[:, lo:hi] += progress
    in_flight.clear()

  seen = []
  for step in range(1, steps + 1):
    for group in (slice(0, 2), slice(2, 4)):  # The group's mean gradient.
      w[group] -= LR * (w[group] - t[step, group].mean(axis=0))
    for (lo, hi), offset in zip(cuts, offsets):
      if (step - offset) % average_every == 0:
        if overlap:
          apply_in_flight()
          in_flight.append((lo, hi, w[:, lo:hi].copy()))
        else:
          round_of(lo, hi)
    seen.append(w.copy())
  apply_in_flight()
  for lo, hi in cuts:  # The round that ends with one model.
    round_of(lo, hi)
  seen.append(w.copy())
  return seen


class Loop:
  """The custom loop: weights a, b, c; replica r's step pulls them toward
  its targets, its group's replicas agreeing (the group's mean)."""

  def __init__(self, strategy, sizes=SIZES):
    self.strategy = strategy
    with strategy.scope():
      self.weights = [tf.Variable(tf.zeros([n]), name=name,
                                  aggregation=tf.VariableAggregation.MEAN)
                      for n, name in zip(sizes, "abcdefgh")]
      self.steps = tf.Variable(0, dtype=tf.int64)
    all_targets = tf.constant(targets(sizes))

    def replica_step():
      ctx = tf.distribute.get_replica_context()
      t = all_targets[tf.cast(self.steps, tf.int32) + 1,
                      ctx.replica_id_in_sync_group]
      for w, part in zip(self.weights, tf.split(t, sizes)):
        w.assign_sub(LR * (w - part))

    def step():
      strategy.run(replica_step)
      self.steps.assign_add(1)

    self.step = tf.function(step)

  def values(self):
    """Each replica's a, b, c, concatenated: [4, 10]."""
    return np.concatenate([np.stack(self.strategy.experimental_local_results(w))
                           for w in self.weights], axis=1)

  def train(self, until):
    """Steps up to `until`, each followed by the round due; each step's
    values."""
    self.strategy.sync_groups_step(0, self.weights)
    seen = []
    while int(self.steps.numpy()) < until:
      self.step()
      self.strategy.sync_groups_step(self.steps, self.weights)
      seen.append(self.values())
    return seen

  def checkpoint(self):
    return tf.train.Checkpoint(weights=self.weights, steps=self.steps,
                               sync_groups=self.strategy.sync_groups_state)


class ScheduleTest(parameterized.TestCase):

  @parameterized.parameters(
      (1, 4, False, False), (2, 4, False, False), (2, 4, True, False),
      (3, 6, True, False), (3, 5, True, False), (1, 4, True, True),
      (2, 4, False, True), (3, 6, True, True))
  def test_rounds_equal_the_reference(self, fragments, average_every, outer,
                                      overlap):
    strategy = grouped(fragments, average_every, nesterov() if outer else None,
                       overlap)
    loop = Loop(strategy)
    seen = loop.train(STEPS)
    strategy.average_sync_groups(loop.weights)
    seen.append(loop.values())
    want = reference(fragments, average_every, outer, overlap)
    for step, (got, expected) in enumerate(zip(seen, want), start=1):
      np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL,
                                 err_msg=f"after step {step}")
    due = [s for s in range(1, STEPS + 1)
           if any((s - f * average_every // fragments) % average_every == 0
                  for f in range(fragments))]
    self.assertEqual(strategy.averaging.rounds, len(due) + 1)

  def test_a_round_averages_its_fragment_only(self):
    strategy = grouped(2, 4)
    loop = Loop(strategy)
    loop.train(2)  # Fragment 1 ([b, c]) at step 2, fragment 0 ([a]) at 4.
    groups = loop.values()
    np.testing.assert_array_equal(groups[0, 3:], groups[2, 3:])
    self.assertFalse(np.allclose(groups[0, :3], groups[2, :3]))
    self.assertEqual(strategy.averaging.bytes_averaged, 7 * 4)

  def test_one_fragment_saves_the_state_as_before(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=4,
                                      outer_optimizer=nesterov())
    self.assertFalse(hasattr(strategy.sync_groups_state,
                             "fragment_outer_optimizers"))
    self.assertFalse(hasattr(strategy.sync_groups_state,
                             "fragments_in_flight"))
    state = grouped(3, 6, nesterov(), overlap=True).sync_groups_state
    self.assertLen(state.fragment_outer_optimizers, 2)
    self.assertEqual(state.fragments_in_flight.fragments, [])


class ResumeTest(parameterized.TestCase):
  """Resumed between two fragments' rounds: as if never stopped."""

  @parameterized.parameters(False, True)
  def test_a_custom_loop_from_a_checkpoint(self, overlap):
    make = lambda: Loop(grouped(2, 4, nesterov(), overlap))
    uninterrupted = make()
    uninterrupted.train(STEPS)
    uninterrupted.strategy.average_sync_groups(uninterrupted.weights)

    interrupted = make()
    # Fragment 0 at 4 (with overlap, its exchange in flight), fragment 1
    # due at 6.
    interrupted.train(5)
    self.assertEqual(interrupted.strategy.sync_groups_state.exchange.in_flight,
                     overlap)
    with tempfile.TemporaryDirectory() as directory:
      path = interrupted.checkpoint().write(os.path.join(directory, "ckpt"))
      resumed = make()
      resumed.checkpoint().read(path).assert_existing_objects_matched()
      resumed.train(STEPS)
    resumed.strategy.average_sync_groups(resumed.weights)
    np.testing.assert_allclose(resumed.values(), uninterrupted.values(),
                               rtol=RTOL, atol=ATOL)
    for got, want in zip(
        [resumed.strategy.averaging.outer_optimizer,
         *resumed.strategy.sync_groups_state.fragment_outer_optimizers],
        [uninterrupted.strategy.averaging.outer_optimizer,
         *uninterrupted.strategy.sync_groups_state.fragment_outer_optimizers]):
      self.assertEqual(int(got.iterations.numpy()), int(want.iterations.numpy()))


GLOBAL_BATCH = 16
ROWS = 96  # 6 steps an epoch.


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8)).astype(np.float32)
  y = rng.normal(size=(ROWS, 3)).astype(np.float32)
  return x, y


def compiled_model(strategy, steps_per_execution=1):
  with strategy.scope():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(keras.optimizers.SGD(0.1), "mse",
                  steps_per_execution=steps_per_execution)
  return model


def kernels(strategy, model, layer):
  return [np.array(k) for k in strategy.experimental_local_results(
      model.layers[layer].kernel.value)]


class FitTest(parameterized.TestCase):
  """small_mlp's weights, 128 + 16 + 48 + 3 elements, in 2 fragments: the
  first kernel, and the rest."""

  def test_fit_averages_the_fragments_due_and_ends_with_one_model(self):
    strategy = grouped(2, 4, nesterov())
    model = compiled_model(strategy)
    seen = {}

    class Look(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        seen[int(self.model.optimizer.iterations.numpy())] = (
            kernels(strategy, model, 0), kernels(strategy, model, 1))

    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0,
              callbacks=[Look()])
    for step, (first, second) in seen.items():
      with self.subTest(step=step):
        self.assertEqual(np.array_equal(first[0], first[2]), step == 4)
        self.assertEqual(np.array_equal(second[0], second[2]), step in (2, 6))
    for layer in (0, 1):
      kernel = kernels(strategy, model, layer)
      for part in kernel[1:]:
        np.testing.assert_array_equal(part, kernel[0])
    # Rounds of fragment 1 at 2 and 6, of fragment 0 at 4, and fit's last
    # of fragment 0 only: fragment 1 was averaged by step 6.
    self.assertEqual(strategy.averaging.rounds, 4)
    outer = [strategy.averaging.outer_optimizer,
             *strategy.sync_groups_state.fragment_outer_optimizers]
    self.assertEqual([int(o.iterations.numpy()) for o in outer], [2, 2])
    self.assertEqual(strategy.averaging.bytes_averaged,
                     4 * (128 + 67 + 128 + 67))

  def test_steps_per_execution_dividing_the_offsets_keeps_the_rounds(self):
    x, y = data()
    weights = []
    for steps_per_execution in (1, 2):  # Calls end at 2, 4, 6: each round's.
      model = compiled_model(grouped(2, 4, nesterov()), steps_per_execution)
      model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
      weights.append(model.get_weights())
    for got, want in zip(*weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  @parameterized.parameters(False, True)
  def test_fit_resumes_from_a_backup_between_fragments(self, overlap):
    # 12 steps; fragment 1 at 2, 6, 10, fragment 0 at 4, 8, 12. The backup
    # after epoch 0 (step 6) lies between them (with overlap, fragment 1's
    # exchange in flight); interrupted after step 7.
    make = lambda: grouped(2, 4, nesterov(), overlap)
    x, y = data()
    uninterrupted = compiled_model(make())
    uninterrupted.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                      verbose=0)

    class InterruptAfterStep7(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 7:
          raise InterruptedError("step 7, between fragments' rounds")

    with tempfile.TemporaryDirectory() as directory:
      backup = os.path.join(directory, "backup")
      interrupted = compiled_model(make())
      with self.assertRaises(InterruptedError):
        interrupted.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0, callbacks=[
                            keras.callbacks.BackupAndRestore(backup),
                            InterruptAfterStep7()])
      resumed = compiled_model(make())
      resumed.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                  verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    self.assertEqual(int(resumed.optimizer.iterations.numpy()), 12)
    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights()):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class BadInputTest(unittest.TestCase):

  def test_not_a_count(self):
    for bad in (0, True, 1.5, "2"):
      with self.subTest(bad=bad):
        with self.assertRaisesRegex(
            ValueError, r"`fragments` to be an int of at least 1.*"
            rf"fragments={bad!r}"):
          rs.SyncGroups(groups=2, average_every=4, fragments=bad)

  def test_more_fragments_than_steps_between_rounds(self):
    with self.assertRaisesRegex(
        ValueError, r"`fragments` to be at most `average_every`.*"
        r"fragments=5, average_every=4\. Pass fragments <= 4"):
      rs.SyncGroups(groups=2, average_every=4, fragments=5)

  def test_fragments_with_one_group(self):
    with self.assertRaisesRegex(ValueError, r"sync_groups=1 has no rounds\. "
                                r"Received: fragments=2"):
      rs.SyncGroups(fragments=2)

  def test_one_outer_optimizer_per_model(self):
    strategy = grouped(2, 4, nesterov())
    Loop(strategy).train(1)
    with self.assertRaisesRegex(
        ValueError, r"outer optimizer steps one model's trainable weights.*"
        r"these are new: \['a:0'\]\. Make a new strategy"):
      Loop(strategy).train(1)

  def test_more_fragments_than_trainable_weights(self):
    strategy = grouped(3, 6)
    with strategy.scope():
      weights = [tf.Variable(1.0, name="w"), tf.Variable(2.0, name="v")]
    with self.assertRaisesRegex(
        ValueError, r"at most the number of trainable weights.*"
        r"fragments=3 for 2 trainable weights \(\['w:0', 'v:0'\]\)"):
      strategy.sync_groups_step(0, weights)


if __name__ == "__main__":
  unittest.main()
