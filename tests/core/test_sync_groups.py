"""Sync groups: synchronous inside a group, averaging rounds between groups.

`ReplicatorStrategy(sync_groups=G, average_every=H, outer_optimizer=None)` on
4 logical CPUs. One group is the synchronous strategy exactly; two groups
averaging every step with plain SGD are synchronous training (the mean of
θ - η·gᵢ is θ - η·mean(gᵢ)); between rounds each group's replicas agree and
the groups differ; rounds come exactly every H steps; an outer SGD(1.0) is
plain averaging; checkpoints taken between rounds restore every group.
The quick loop keeps the equalities and the exact checks; whole `fit` runs
that only add cases are marked slow.
"""

import functools
import os
import tempfile
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

from assertions import assert_per_replica
import models
import multi_worker_runs
import topology
from replicator_strategy.collectives import communicator as communicator_lib
from replicator_strategy.keras import sync_group_rounds

GLOBAL_BATCH = 16
ROWS = 96  # 6 steps an epoch.
RTOL, ATOL = 1e-5, 1e-6


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8)).astype(np.float32)
  y = rng.normal(size=(ROWS, 3)).astype(np.float32)
  return x, y


def compiled_model(strategy, optimizer=None, steps_per_execution=1):
  with strategy.scope():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(optimizer or keras.optimizers.SGD(0.1), "mse",
                  steps_per_execution=steps_per_execution)
  return model


def fit(strategy, epochs=2, callbacks=(), optimizer=None,
        steps_per_execution=1, rows=ROWS):
  """`rows` of the data: 54 ends each epoch with a batch of 6."""
  model = compiled_model(strategy, optimizer, steps_per_execution)
  x, y = data()
  history = model.fit(x[:rows], y[:rows], batch_size=GLOBAL_BATCH,
                      epochs=epochs,
                      shuffle=False, verbose=0, callbacks=list(callbacks))
  return model, history.history["loss"]


def nesterov():
  """DiLoCo's outer optimizer."""
  return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


@functools.cache
def synchronous_fit(rows=ROWS):
  model, losses = fit(topology.strategy_over(4), rows=rows)
  return tuple(model.get_weights()), tuple(losses)


def kernels(strategy, model):
  """Each replica's first kernel."""
  return [np.array(k) for k in
          strategy.experimental_local_results(model.layers[0].kernel.value)]


class GroupsTest(unittest.TestCase):

  def test_the_groups_count_and_size(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=3)
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    self.assertEqual(strategy.num_sync_groups, 2)
    self.assertEqual(strategy.average_every, 3)
    self.assertIn("in each of 2 sync groups", repr(strategy))

  def test_one_group_is_the_synchronous_strategy_exactly(self):
    strategy = topology.strategy_over(4, sync_groups=1)
    # The same code path: the plain communicator, no grouping around it.
    self.assertIs(type(strategy.extended.communicator),
                  communicator_lib.Communicator)
    self.assertEqual(strategy.num_sync_groups, 1)
    model, losses = fit(strategy)
    weights, sync_losses = synchronous_fit()
    self.assertEqual(tuple(losses), sync_losses)
    for got, want in zip(model.get_weights(), weights):
      np.testing.assert_array_equal(got, want)

  @pytest.mark.slow
  def test_replica_collectives_span_the_group(self):
    strategy = topology.strategy_over(4, sync_groups=2)

    def step():
      ctx = tf.distribute.get_replica_context()
      r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
      return (ctx.all_reduce("sum", r), ctx.broadcast(r + 10.0),
              ctx.all_gather(tf.reshape(r, [1]), axis=0),
              ctx.all_reduce_all_groups("sum", r),
              # One process is one worker: every group is local.
              ctx.all_reduce_local_groups("mean", r),
              tf.constant([ctx.replica_id_in_group, ctx.sync_group]))

    group_sums = [1.0, 1.0, 5.0, 5.0]
    expected = lambda r: (group_sums[r], 10.0 + 2 * (r // 2),
                          np.array([2 * (r // 2), 2 * (r // 2) + 1], "f"),
                          6.0, 1.5, np.array([r % 2, r // 2], "i"))
    assert_per_replica(self, strategy, strategy.run(step), expected)
    assert_per_replica(self, strategy, tf.function(
        lambda: strategy.run(step))(), expected)

  def test_collectives_inside_control_flow_span_the_group(self):
    strategy = topology.strategy_over(4, sync_groups=2)

    @tf.function
    def run():
      def step():
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        # Inside a tf.cond each replica launches its own collectives.
        return tf.cond(r >= 0.0,
                       lambda: (ctx.all_reduce("sum", r),
                                ctx.all_reduce_all_groups("sum", r),
                                ctx.all_reduce_local_groups("sum", r)),
                       lambda: (r, r, r))
      return strategy.run(step)

    assert_per_replica(self, strategy, run(),
                       lambda r: ([1.0, 1.0, 5.0, 5.0][r], 6.0, 6.0))


class StepLogsTest(unittest.TestCase):
  """`fit`'s logs in one process: each step's sum this worker's groups,
  which here are all of them, as each epoch's do (2 workers:
  tests/end_to_end/test_multi_worker.py)."""

  def test_each_step_and_epoch_logs_every_group(self):
    run = multi_worker_runs.sync_groups_step_logs(
        topology.strategy_over(4, sync_groups=2, average_every=4))
    for step, (logs, local, pairs) in enumerate(
        zip(run["logs"], run["local"], run["pairs"]), 1):
      with self.subTest(step=step):
        # Summed from every replica's metric variables after the step.
        for name in logs:
          self.assertAlmostEqual(logs[name], local[name], places=5)
        # The groups (replicas 0, 1 and 2, 3) differ: not one group's.
        self.assertNotAlmostEqual(pairs[0]["loss"], pairs[1]["loss"], places=3)
    self.assertEqual(run["history"]["loss"],
                     [run["logs"][step]["loss"] for step in (3, 7, 11)])
    self.assertEqual(run["launches"], [0] * 12)  # No other worker.


class AveragingTest(unittest.TestCase):

  def test_two_groups_averaging_every_step_with_sgd_are_synchronous(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=1)
    model, losses = fit(strategy)
    weights, sync_losses = synchronous_fit()
    np.testing.assert_allclose(losses, sync_losses, rtol=RTOL)
    for got, want in zip(model.get_weights(), weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert_per_replica(self, strategy, model.layers[0].kernel.value,
                       [weights[0]] * 4, rtol=RTOL, atol=ATOL)

  def test_an_uneven_last_batch_averages_the_groups_by_their_rows(self):
    # Each epoch's last batch, 6 rows, splits unevenly between the groups:
    # their mean gradients count by rows, as in one batch of 6.
    strategy = topology.strategy_over(4, sync_groups=2, average_every=1)
    model, losses = fit(strategy, rows=54)
    weights, sync_losses = synchronous_fit(rows=54)
    np.testing.assert_allclose(losses, sync_losses, rtol=RTOL)
    for got, want in zip(model.get_weights(), weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  @pytest.mark.slow
  def test_groups_of_one_replica_averaging_every_step_are_synchronous(self):
    strategy = topology.strategy_over(4, sync_groups=4, average_every=1)
    self.assertEqual(strategy.num_replicas_in_sync, 1)
    model, losses = fit(strategy)
    weights, sync_losses = synchronous_fit()
    np.testing.assert_allclose(losses, sync_losses, rtol=RTOL)
    for got, want in zip(model.get_weights(), weights):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  @pytest.mark.slow
  def test_steps_per_execution_dividing_average_every_keeps_the_rounds(self):
    one_step, _ = fit(topology.strategy_over(4, sync_groups=2,
                                             average_every=4))
    strategy = topology.strategy_over(4, sync_groups=2, average_every=4)
    two_steps, _ = fit(strategy, steps_per_execution=2)
    for got, want in zip(two_steps.get_weights(), one_step.get_weights()):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # 12 steps: rounds after steps 4, 8 and 12; none left for the end.
    self.assertEqual(strategy.averaging.rounds, 3)

  @pytest.mark.slow
  def test_between_rounds_groups_differ_and_after_fit_all_agree(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=4)
    seen = {}

    class Look(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        seen[int(self.model.optimizer.iterations.numpy())] = kernels(
            strategy, self.model)

    model, _ = fit(strategy, epochs=1, callbacks=[Look()])
    self.assertEqual(sorted(seen), [1, 2, 3, 4, 5, 6])
    for step, parts in seen.items():
      with self.subTest(step=step):
        np.testing.assert_array_equal(parts[0], parts[1])
        np.testing.assert_array_equal(parts[2], parts[3])
        if step == 4:  # A round: every replica the same.
          np.testing.assert_array_equal(parts[0], parts[2])
        else:
          self.assertFalse(np.allclose(parts[0], parts[2]))
    # Step 6 did not average; fit ends with a round.
    after = kernels(strategy, model)
    for part in after[1:]:
      np.testing.assert_array_equal(part, after[0])
    np.testing.assert_allclose(after[0], np.mean(seen[6], axis=0), rtol=1e-6)

  def test_rounds_come_exactly_every_average_every_steps(self):
    h = 3
    strategy = topology.strategy_over(4, sync_groups=2, average_every=h)
    with strategy.scope():
      v = tf.Variable(0.0)

    def set_to_replica_id(step):
      ctx = tf.distribute.get_replica_context()
      v.assign(100.0 * step + tf.cast(ctx.replica_id_in_sync_group,
                                      tf.float32))

    self.assertFalse(strategy.sync_groups_step(0, [v]))
    for step in range(1, 3 * h + 1):
      strategy.run(set_to_replica_id, (float(step),))
      averaged = strategy.sync_groups_step(step, [v])
      with self.subTest(step=step):
        self.assertEqual(averaged, step % h == 0)
        if averaged:  # The exact mean of 0, 1, 2, 3.
          assert_per_replica(self, strategy, v, [100.0 * step + 1.5] * 4)
        else:
          assert_per_replica(self, strategy, v,
                             [100.0 * step + r for r in range(4)])

  @pytest.mark.slow
  def test_outer_sgd_of_one_is_plain_averaging(self):
    plain_strategy = topology.strategy_over(4, sync_groups=2, average_every=2)
    plain, plain_losses = fit(plain_strategy)
    outer_strategy = topology.strategy_over(
        4, sync_groups=2, average_every=2,
        outer_optimizer=keras.optimizers.SGD(1.0))
    outer, outer_losses = fit(outer_strategy)
    np.testing.assert_allclose(outer_losses, plain_losses, rtol=RTOL)
    for got, want in zip(outer.get_weights(), plain.get_weights()):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  @pytest.mark.slow
  def test_outer_nesterov_trains(self):
    strategy = topology.strategy_over(
        4, sync_groups=2, average_every=2,
        outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9,
                                             nesterov=True))
    model, losses = fit(strategy, epochs=4)
    self.assertLess(losses[-1], 0.9 * losses[0])
    after = kernels(strategy, model)
    for part in after[1:]:
      np.testing.assert_array_equal(part, after[0])
    self.assertEqual(len(strategy.sync_groups_state.anchors), 4)

  @pytest.mark.slow
  def test_batch_norm_statistics_are_averaged(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=100)
    with strategy.scope():
      model = keras.Sequential([keras.Input((8,)),
                                keras.layers.BatchNormalization(),
                                keras.layers.Dense(3)])
      model.compile(keras.optimizers.SGD(0.1), "mse")
    before_round = {}

    class Look(keras.callbacks.Callback):

      def on_train_end(self, logs=None):  # Before fit's last round.
        before_round["mean"] = [np.array(m) for m in
                                strategy.experimental_local_results(
                                    model.layers[0].moving_mean.value)]

    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[Look()])
    groups = before_round["mean"]
    self.assertFalse(np.allclose(groups[0], groups[2]))
    assert_per_replica(self, strategy, model.layers[0].moving_mean.value,
                       [np.mean(groups, axis=0)] * 4, rtol=1e-6)


class OverlapTest(unittest.TestCase):
  """overlap_averaging=True: a round's exchange applies one round later."""

  def test_the_exchange_applies_exactly_one_round_later(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=2,
                                      overlap_averaging=True)
    with strategy.scope():
      v = tf.Variable(0.0)

    def set_to(step):
      ctx = tf.distribute.get_replica_context()
      v.assign(step * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))

    strategy.sync_groups_step(0, [v])
    seen = {}
    for step in range(1, 7):
      strategy.run(set_to, (float(step),))
      strategy.sync_groups_step(step, [v])
      seen[step] = [float(x) for x in strategy.experimental_local_results(v)]
    # Step 2: snapshots 2, 4, 6, 8 (mean 5) leave; nothing applied yet.
    self.assertEqual(seen[2], [2.0, 4.0, 6.0, 8.0])
    self.assertEqual(seen[3], [3.0, 6.0, 9.0, 12.0])
    # Step 4: 5 plus each replica's progress since its snapshot; then
    # snapshots 7, 9, 11, 13 (mean 10) leave.
    self.assertEqual(seen[4], [7.0, 9.0, 11.0, 13.0])
    # Step 6: 10 plus the progress from 7, 9, 11, 13 to 6, 12, 18, 24.
    self.assertEqual(seen[6], [9.0, 13.0, 17.0, 21.0])
    strategy.average_sync_groups([v])  # Applies mean 15, then all agree.
    assert_per_replica(self, strategy, v, [15.0] * 4)
    self.assertEqual(strategy.averaging.rounds, 4)

  @pytest.mark.slow
  def test_fit_trains_and_ends_with_one_model(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=2,
                                      overlap_averaging=True)
    model, losses = fit(strategy, epochs=3)
    self.assertLess(losses[-1], 0.9 * losses[0])
    after = kernels(strategy, model)
    for part in after[1:]:
      np.testing.assert_array_equal(part, after[0])
    # 18 steps: 9 overlapped rounds, and fit's last.
    self.assertEqual(strategy.averaging.rounds, 10)

  def test_overlap_is_true_or_false(self):
    with self.assertRaisesRegex(ValueError, r"overlap_averaging='yes'"):
      topology.strategy_over(4, sync_groups=2, overlap_averaging="yes")


class OneModelTest(unittest.TestCase):
  """Between rounds, predict and evaluate answer with one model: the first
  group's, which get_weights() and save() return."""

  def test_predict_and_evaluate_between_rounds(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=1000)
    model = compiled_model(strategy)
    kernel = model.layers[0].kernel

    def group_steps():  # As a step would, each group its own way.
      group = tf.distribute.get_replica_context().sync_group
      kernel.assign(kernel + 0.1 * tf.cast(group + 1, tf.float32))

    strategy.run(group_steps)
    apart = kernels(strategy, model)
    self.assertFalse(np.allclose(apart[0], apart[2]))
    one = models.small_mlp()
    one.set_weights(model.get_weights())
    one.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = (a[:GLOBAL_BATCH] for a in data())
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               one.predict(x, verbose=0), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(model.predict_on_batch(x),
                               one.predict_on_batch(x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               one.evaluate(x, y, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(model.test_on_batch(x, y),
                               one.test_on_batch(x, y), rtol=RTOL)
    # Each group keeps its own weights.
    assert_per_replica(self, strategy, model.layers[0].kernel.value, apart)


class CheckpointTest(unittest.TestCase):

  def test_a_checkpoint_between_rounds_restores_every_group(self):
    strategy = topology.strategy_over(4, sync_groups=2, average_every=1000)
    model = compiled_model(strategy)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = {}

    class SaveAtStep3(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        if batch == 2:  # Between rounds: the groups differ.
          saved["kernels"] = kernels(strategy, model)
          saved["path"] = checkpoint.save(os.path.join(directory, "ckpt"))

    x, y = data()
    with tempfile.TemporaryDirectory() as directory:
      model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                verbose=0, callbacks=[SaveAtStep3()])
      # fit ended with a round: every replica differs from the saved ones.
      self.assertFalse(np.allclose(kernels(strategy, model)[0],
                                   saved["kernels"][0]))
      checkpoint.restore(saved["path"]).assert_consumed()
    self.assertFalse(np.allclose(saved["kernels"][0], saved["kernels"][2]))
    assert_per_replica(self, strategy, model.layers[0].kernel.value,
                       saved["kernels"])
    self.assertEqual(int(model.optimizer.iterations.numpy()), 3)

  @pytest.mark.slow  # Trains three times.
  def test_a_custom_loop_restored_between_rounds_goes_on_exactly(self):
    # DiLoCo's outer step, overlapped: saved after step 4, round 3's
    # exchange in flight. Read before the anchors, snapshots and outer slots
    # exist (sync_groups_step(0, ...) makes them), which TF restores as
    # they are made.
    def make():
      strategy = topology.strategy_over(
          4, sync_groups=2, average_every=3, outer_optimizer=nesterov(),
          overlap_averaging=True)
      with strategy.scope():
        model = models.small_mlp()
        model.set_weights(models.initial_weights())
        optimizer = keras.optimizers.SGD(0.1)
      checkpoint = tf.train.Checkpoint(
          model=model, optimizer=optimizer,
          sync_groups=strategy.sync_groups_state)
      return strategy, model, optimizer, checkpoint

    def train(strategy, model, optimizer, until):
      x, y = (tf.constant(a) for a in data())
      rows = GLOBAL_BATCH // 4

      def replica_step():
        ctx = tf.distribute.get_replica_context()
        start = (tf.cast(optimizer.iterations % (ROWS // GLOBAL_BATCH),
                         tf.int32) * GLOBAL_BATCH +
                 ctx.replica_id_in_sync_group * rows)
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(
              model(x[start:start + rows]) - y[start:start + rows]))
        optimizer.apply_gradients(zip(
            tape.gradient(loss, model.trainable_variables),
            model.trainable_variables))

      step = tf.function(lambda: strategy.run(replica_step))
      strategy.sync_groups_step(0, model.trainable_variables)
      while int(optimizer.iterations.numpy()) < until:
        step()
        strategy.sync_groups_step(optimizer.iterations,
                                  model.trainable_variables)

    strategy, uninterrupted, optimizer, _ = make()
    train(strategy, uninterrupted, optimizer, until=8)
    strategy.average_sync_groups(uninterrupted.trainable_variables)

    strategy, model, optimizer, checkpoint = make()
    train(strategy, model, optimizer, until=4)
    self.assertTrue(strategy.sync_groups_state.exchange.in_flight)
    with tempfile.TemporaryDirectory() as directory:
      path = checkpoint.write(os.path.join(directory, "ckpt"))
      strategy, resumed, optimizer, checkpoint = make()
      checkpoint.read(path).assert_existing_objects_matched()
      self.assertEqual(list(strategy.sync_groups_state.anchors), [])
      train(strategy, resumed, optimizer, until=8)
    strategy.average_sync_groups(resumed.trainable_variables)
    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights()):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

  @pytest.mark.slow
  def test_a_checkpoint_of_one_group_loads_into_every_group(self):
    one = compiled_model(topology.strategy_over(4))
    strategy = topology.strategy_over(4, sync_groups=2, average_every=5)
    grouped = compiled_model(strategy)
    with tempfile.TemporaryDirectory() as directory:
      path = tf.train.Checkpoint(model=one).save(
          os.path.join(directory, "ckpt"))
      grouped.layers[0].kernel.assign(tf.zeros([8, 16]))
      tf.train.Checkpoint(model=grouped).restore(path).assert_consumed()
    assert_per_replica(self, strategy, grouped.layers[0].kernel.value,
                       [models.initial_weights()[0]] * 4)


def state_before_row_counts(strategy):
  """`strategy.sync_groups_state` as checkpoints held it before the rounds
  counted rows: no row counters."""
  state = strategy.sync_groups_state
  earlier = tf.Module()
  earlier.outer_optimizer = state.outer_optimizer
  earlier.anchors = list(state.anchors)
  earlier.snapshots = list(state.snapshots)
  earlier.exchange = state.exchange
  return earlier


class EarlierCheckpointTest(unittest.TestCase):
  """Checkpoints written before the rounds counted rows restore every
  group, and count no rows: the next round is the plain mean."""

  def test_a_checkpoint_without_row_counts(self):
    def make():
      strategy = topology.strategy_over(4, sync_groups=2, average_every=1)
      with strategy.scope():
        m = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
      return strategy, m

    def set_to_group():
      m.assign(tf.cast(tf.distribute.get_replica_context().sync_group,
                       tf.float32))

    strategy, m = make()
    strategy.sync_groups_step(0, [m])
    strategy.run(set_to_group)
    with tempfile.TemporaryDirectory() as directory:
      path = tf.train.Checkpoint(
          m=m, sync_groups=state_before_row_counts(strategy)).write(
              os.path.join(directory, "ckpt"))
      strategy, m = make()
      tf.train.Checkpoint(m=m, sync_groups=strategy.sync_groups_state).read(
          path).assert_existing_objects_matched()
      strategy.sync_groups_step(0, [m])
    assert_per_replica(self, strategy, m, [0.0, 0.0, 1.0, 1.0])
    assert_per_replica(self, strategy, strategy.sync_groups_state.rows,
                       [0.0] * 4)
    strategy.sync_groups_step(1, [m])
    assert_per_replica(self, strategy, m, [0.5] * 4)
    # Counted from then on: 4 rows in group 0, 2 in group 1.
    rows = [2, 2, 1, 1]
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([rows[ctx.replica_id_in_sync_group], 3]))

    def counted_step(x):
      del x  # Counted by count_rows.
      strategy.averaging.count_rows()
      set_to_group()

    strategy.run(counted_step, (batch,))
    strategy.sync_groups_step(2, [m])
    assert_per_replica(self, strategy, m, [1 / 3] * 4, rtol=1e-6)

  def test_a_backup_without_row_counts_resumes(self):
    # Written after epoch 0: step 6, between rounds (H = 5).
    x, y = data()
    saved = {}

    class EarlierGroupState(keras.callbacks.Callback):
      """After BackupAndRestore's save: its group state, as written before
      rows were counted."""

      def on_epoch_end(self, epoch, logs=None):
        strategy = self.model.distribute_strategy
        saved["kernels"] = kernels(strategy, self.model)
        tf.train.Checkpoint(
            model=self.model, optimizer=self.model.optimizer,
            sync_groups=state_before_row_counts(strategy)).write(
                os.path.join(backup, sync_group_rounds.GROUP_STATE))

    with tempfile.TemporaryDirectory() as directory:
      backup = os.path.join(directory, "backup")
      fit(topology.strategy_over(4, sync_groups=2, average_every=5),
          epochs=1, callbacks=[
              keras.callbacks.BackupAndRestore(backup,
                                               delete_checkpoint=False),
              EarlierGroupState()])
      strategy = topology.strategy_over(4, sync_groups=2, average_every=5)
      resumed = compiled_model(strategy)
      # Epoch 0 is done: the resume restores and trains no more.
      resumed.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    self.assertFalse(np.allclose(saved["kernels"][0], saved["kernels"][2]))
    assert_per_replica(self, strategy, resumed.layers[0].kernel.value,
                       saved["kernels"])
    self.assertEqual(int(resumed.optimizer.iterations.numpy()), 6)
    assert_per_replica(self, strategy, strategy.sync_groups_state.rows,
                       [0.0] * 4)


@pytest.mark.slow  # Each test fits three times.
class BackupAndRestoreTest(unittest.TestCase):
  """A `fit` interrupted between rounds and resumed from its backup ends
  where uninterrupted training does."""

  def assert_resume_ends_uninterrupted(self, **grouping):
    # 12 steps; rounds after steps 5 and 10, and fit's last after 12.
    make = lambda: topology.strategy_over(4, sync_groups=2, average_every=5,
                                          **{k: f() for k, f in
                                             grouping.items()})
    uninterrupted, _ = fit(make())

    class InterruptAfterStep8(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 8:
          raise InterruptedError("step 8, between rounds")

    x, y = data()
    with tempfile.TemporaryDirectory() as directory:
      backup = os.path.join(directory, "backup")
      interrupted = compiled_model(make())
      with self.assertRaises(InterruptedError):
        interrupted.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0, callbacks=[
                            # Saved after epoch 0: step 6, between rounds.
                            keras.callbacks.BackupAndRestore(backup),
                            InterruptAfterStep8()])
      strategy = make()
      resumed = compiled_model(strategy)
      resumed.layers[0].kernel.assign(tf.zeros([8, 16]))
      resumed.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                  verbose=0, callbacks=[
                      keras.callbacks.BackupAndRestore(backup)])
    self.assertEqual(int(resumed.optimizer.iterations.numpy()), 12)
    for got, want in zip(resumed.get_weights(), uninterrupted.get_weights()):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    kernel = kernels(strategy, resumed)
    for part in kernel[1:]:
      np.testing.assert_array_equal(part, kernel[0])

  def test_plain_averaging(self):
    self.assert_resume_ends_uninterrupted()

  def test_an_outer_nesterov_step(self):
    # The backup keeps the outer momentum and the weights of round 5.
    self.assert_resume_ends_uninterrupted(outer_optimizer=nesterov)

  def test_an_overlapped_exchange_in_flight(self):
    # At the backup, round 5's exchange is in flight; round 10 applies it.
    self.assert_resume_ends_uninterrupted(outer_optimizer=nesterov,
                                          overlap_averaging=lambda: True)


class BadInputTest(unittest.TestCase):

  def assert_refused(self, pattern, error=ValueError, **kwargs):
    with self.assertRaisesRegex(error, pattern):
      topology.strategy_over(4, **kwargs)

  def test_groups_that_do_not_divide_the_replicas(self):
    self.assert_refused(r"`sync_groups` to divide the 4 replicas.*"
                        r"sync_groups=3\. Pass one of \[1, 2, 4\]",
                        sync_groups=3)

  def test_not_a_count(self):
    self.assert_refused(r"sync_groups=0", sync_groups=0)
    self.assert_refused(r"sync_groups=True", sync_groups=True)
    self.assert_refused(r"`average_every` to be an int of at least 1.*"
                        r"average_every=0", sync_groups=2, average_every=0)
    self.assert_refused(r"average_every=2\.5", sync_groups=2,
                        average_every=2.5)

  def test_an_outer_optimizer_that_is_not_keras(self):
    self.assert_refused(r"`outer_optimizer` to be None .* a Keras optimizer"
                        r".*outer_optimizer='sgd'",
                        sync_groups=2, outer_optimizer="sgd")
    self.assert_refused(
        r"outer_optimizer=<.*of type GradientDescentOptimizer",
        sync_groups=2, outer_optimizer=tf.compat.v1.train.GradientDescentOptimizer(
            1.0))

  def test_an_outer_step_without_the_weights_before_training(self):
    strategy = topology.strategy_over(
        4, sync_groups=2, outer_optimizer=keras.optimizers.SGD(1.0))
    with strategy.scope():
      v = tf.Variable(1.0, name="w")
    with self.assertRaisesRegex(ValueError,
                                r"not given before training: \['w:0'\]"
                                r".*sync_groups_step\(0, "):
      strategy.average_sync_groups([v])

  def test_an_outer_optimizer_with_one_group(self):
    self.assert_refused(r"sync_groups=1 has no rounds",
                        outer_optimizer=keras.optimizers.SGD(1.0))

  def test_rounds_options_with_one_group(self):
    self.assert_refused(r"`average_every` sets the steps between sync groups' "
                        r"averaging rounds, but sync_groups=1 has no rounds\. "
                        r"Received: average_every=8\. Pass sync_groups > 1",
                        average_every=8)
    self.assert_refused(r"`overlap_averaging` overlaps .*sync_groups=1 has no "
                        r"rounds\. Received: overlap_averaging=True",
                        overlap_averaging=True)


if __name__ == "__main__":
  unittest.main()
