"""Keras's `fit` under a pipeline trains as one device does.

Each replica's step cuts its batch into micro-batches, runs the schedule's
forwards and backwards on the stages' devices and applies the summed
gradients once: after a few Adam steps the weights, the loss and the metrics
equal one device's on the same batches (rtol 1e-5), for 2 and 4 stages, 1, 2
and 4 micro-batches, GPipe, 1F1B, interleaved 1F1B and ZB-H1, one pipeline
or two side by side (2 batch x 2 stage); sync groups of pipelines average as
synchronous training does.
"""

import collections
import contextlib
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import replicator_strategy as rs

from pipeline_fits import BATCH  # noqa: I001
from pipeline_fits import assert_equal_weights
from pipeline_fits import assert_trains_as_one_device
from pipeline_fits import data
from pipeline_fits import fit
from pipeline_fits import initial_weights
from pipeline_fits import mlp
from pipeline_fits import one_device


class TracedDense(keras.layers.Dense):
  """A Dense that notes, each time a step is traced, the device it ran on."""

  calls = collections.Counter()  # (layer name, device) -> calls traced.

  def call(self, inputs):
    outputs = super().call(inputs)
    TracedDense.calls[self.name, outputs.device[-5:]] += 1
    return outputs


def traced_mlp():
  return mlp(TracedDense)


def dropouts():
  """Dropout in each of the stages that `split=["dense_2"]` cuts (in the
  first and third of `["dense_1", "dense_2", "dense_3"]`'s)."""
  dense = lambda name: keras.layers.Dense(16, activation="tanh", name=name)
  return keras.Sequential([
      keras.Input((8,)), dense("dense_0"), keras.layers.Dropout(0.3),
      dense("dense_1"), dense("dense_2"), keras.layers.Dropout(0.3),
      keras.layers.Dense(3, name="dense_3")])


def pipelined(stages, microbatches, schedule, **options):
  """Pipelines of `stages` stages over the 4 devices."""
  return rs.ReplicatorStrategy(pipeline=rs.Pipeline(
      stages=stages, microbatches=microbatches, schedule=schedule, **options))


class PipelineFitTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("4_stages_2_micro_gpipe", 4, 2, "gpipe"),  # Fewer than the stages.
      ("2_stages_4_micro_zb_h1", 2, 4, "zb_h1"),
  )
  def test_one_step_is_one_devices(self, stages, microbatches, schedule):
    assert_trains_as_one_device(pipelined(stages, microbatches, schedule))

  @parameterized.named_parameters(
      ("2_stages_1_micro_1f1b", 2, 1, "1f1b"),
      ("2_stages_2_micro_gpipe", 2, 2, "gpipe"),
      ("2_stages_4_micro_1f1b", 2, 4, "1f1b"),
      ("4_stages_4_micro_1f1b", 4, 4, "1f1b"),
      ("1_stage_4_micro_1f1b", 1, 4, "1f1b"),  # Micro-batches alone.
  )
  @pytest.mark.slow
  def test_more_steps_are_one_devices(self, stages, microbatches, schedule):
    assert_trains_as_one_device(pipelined(stages, microbatches, schedule))

  @parameterized.named_parameters(
      # 8 rows a pipeline: micro-batches of 3, 3 and 2 rows.
      ("2_pipelines_3_micro_gpipe", 4, 3, "gpipe"),
      ("1_pipeline_2_micro_zb_h1", 2, 2, "zb_h1"),
      # 4 virtual stages, the first and third with a dropout on device 0.
      ("1_pipeline_2_micro_interleaved", 2, 2, "interleaved_1f1b", 2,
       ["dense_1", "dense_2", "dense_3"]),
  )
  @pytest.mark.slow
  def test_dropout_draws_one_devices_values(self, devices, microbatches,
                                            schedule, virtual=1,
                                            split=("dense_2",)):
    # Each micro-batch draws its rows' values, from the seed one device draws
    # once a step.
    assert_trains_as_one_device(rs.ReplicatorStrategy(
        devices=[f"/cpu:{i}" for i in range(devices)], pipeline=rs.Pipeline(
            stages=2, microbatches=microbatches, schedule=schedule,
            virtual=virtual, split=list(split))), build=dropouts)

  def test_interleaved_stages(self):
    assert_trains_as_one_device(rs.ReplicatorStrategy(
        devices=["/cpu:0", "/cpu:1"], pipeline=rs.Pipeline(
            stages=2, microbatches=2, schedule="interleaved_1f1b",
            virtual=2)))

  def test_two_pipelines_on_a_batch_by_stage_mesh(self):
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "stage"), [f"/cpu:{i}" for i in range(4)])
    # 1F1B in 4 micro-batches (as `pipelined(2, 4, "1f1b")` is, by keywords).
    assert_trains_as_one_device(rs.ReplicatorStrategy(
        mesh=mesh, pipeline=rs.Pipeline(stages=2, microbatches=4)))

  def test_sync_groups_of_pipelines(self):
    # Averaging every step with SGD: synchronous training, one device's.
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("group", "stage"), [f"/cpu:{i}" for i in range(4)])
    assert_trains_as_one_device(rs.ReplicatorStrategy(
        mesh=mesh, sync=rs.SyncGroups(groups=2, average_every=1),
        pipeline=rs.Pipeline(stages=2, microbatches=2)),
        optimizer=keras.optimizers.SGD)

  def test_each_stage_runs_each_micro_batch_on_its_device(self):
    TracedDense.calls.clear()
    strategy = rs.ReplicatorStrategy(
        pipeline=rs.Pipeline(stages=2, microbatches=4))
    fit(traced_mlp, strategy)
    # Traced once a replica: 4 micro-batches a layer, on its stage's device
    # (the model's symbolic calls have no device).
    traced = {k: n for k, n in TracedDense.calls.items() if k[1]}
    self.assertEqual(traced, {
        ("dense_0", "CPU:0"): 4, ("dense_1", "CPU:0"): 4,
        ("dense_2", "CPU:1"): 4, ("dense_3", "CPU:1"): 4,
        ("dense_0", "CPU:2"): 4, ("dense_1", "CPU:2"): 4,
        ("dense_2", "CPU:3"): 4, ("dense_3", "CPU:3"): 4})

  def test_evaluate_and_predict_run_stage_by_stage(self):
    x, y = data()
    one = mlp()
    one.set_weights(initial_weights())
    one.compile(loss="mse", metrics=["mae"])
    TracedDense.calls.clear()
    strategy = rs.ReplicatorStrategy(
        pipeline=rs.Pipeline(stages=2, microbatches=2))
    with strategy.scope():
      model = traced_mlp()
      model.set_weights(initial_weights())
      model.compile(loss="mse", metrics=["mae"])
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH,
                                              verbose=0),
                               one.evaluate(x, y, batch_size=BATCH, verbose=0),
                               rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                               one.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-5, atol=1e-6)
    traced = {k: n for k, n in TracedDense.calls.items() if k[1]}
    # evaluate's step and predict's, once a replica, each layer on its stage.
    self.assertEqual(traced, {
        ("dense_0", "CPU:0"): 2, ("dense_1", "CPU:0"): 2,
        ("dense_2", "CPU:1"): 2, ("dense_3", "CPU:1"): 2,
        ("dense_0", "CPU:2"): 2, ("dense_1", "CPU:2"): 2,
        ("dense_2", "CPU:3"): 2, ("dense_3", "CPU:3"): 2})

  def test_a_custom_loop_runs_the_pipelined_train_step(self):
    strategy = rs.ReplicatorStrategy(
        pipeline=rs.Pipeline(stages=2, microbatches=2))
    with strategy.scope():
      model = mlp()
      model.set_weights(initial_weights())
      model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    strategy.pipeline_stages(model)  # Eagerly, before the step is traced.
    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data()).batch(BATCH))

    @tf.function
    def step(batch):
      return strategy.run(model.train_step, args=(batch,))

    for batch in batches:
      step(batch)
    assert_equal_weights(model.get_weights(), one_device()[0])

  def test_a_step_traced_before_the_stages_are_placed(self):
    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    with strategy.scope():
      model = mlp()
      model.compile("sgd", "mse")
    with self.assertRaisesRegex(ValueError, r"has not placed model .* Call "
                                r"strategy.pipeline_stages\(model\) once"):
      strategy.run(tf.function(model.train_step), args=(data(),))


def two_in_two_out():
  """Two inputs, a skip connection across the cut, two outputs."""
  a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
  h = keras.layers.Dense(16, activation="tanh", name="d0")(a)
  h = keras.layers.Add()([h, keras.layers.Dense(16, activation="tanh",
                                                name="d1")(h)])
  h = keras.layers.Concatenate()([h, keras.layers.Dense(16, name="d2")(b)])
  return keras.Model({"a": a, "b": b}, [keras.layers.Dense(3, name="d3")(h),
                                        keras.layers.Dense(1, name="d4")(h)])


class FunctionalPipelineTest(unittest.TestCase):

  @pytest.mark.slow
  def test_inputs_outputs_sample_weights_and_partial_batches(self):
    keras.utils.set_random_seed(0)
    start = two_in_two_out().get_weights()
    rng = np.random.default_rng(0)
    rows = 50  # Batches of 20, 20 and 10: micro-batches of 3, 3, 2, 2 ...
    x = {"a": rng.normal(size=(rows, 8)).astype(np.float32),
         "b": rng.normal(size=(rows, 4)).astype(np.float32)}
    y = [rng.normal(size=(rows, 3)).astype(np.float32),
         rng.normal(size=(rows, 1)).astype(np.float32)]
    weights = rng.uniform(size=(rows,)).astype(np.float32)

    def run(strategy):
      with strategy.scope() if strategy else contextlib.nullcontext():
        model = two_in_two_out()
        model.set_weights(start)
        model.compile(keras.optimizers.Adam(0.01), ["mse", "mae"],
                      loss_weights=[1.0, 0.5], metrics=[["mae"], ["mse"]])
      history = model.fit(x, y, sample_weight=weights, batch_size=20,
                          shuffle=False, verbose=0)
      return (model.get_weights(), history.history,
              model.evaluate(x, y, batch_size=20, verbose=0),
              model.predict(x, batch_size=20, verbose=0))

    piped = run(rs.ReplicatorStrategy(
        pipeline=rs.Pipeline(stages=2, microbatches=4)))
    one = run(None)
    for a, b in zip(piped[0], one[0]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name in ("loss", "d3_loss", "d4_loss", "d3_mae", "d4_mse"):
      np.testing.assert_allclose(piped[1][name], one[1][name], rtol=1e-5)
    np.testing.assert_allclose(piped[2], one[2], rtol=1e-5)
    for a, b in zip(piped[3], one[3]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  unittest.main()
