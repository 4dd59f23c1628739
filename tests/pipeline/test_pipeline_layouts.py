"""A pipeline whose stages split weights over a model axis (Megatron's
rules inside each stage) trains as one device does.

2 stages x 2 model devices: each stage's column- and row-parallel Dense
kernels are in halves on its two devices; after a few Adam steps of `fit`
the weights, the loss and the metrics equal one device's (rtol 1e-5), with
GPipe, 1F1B, interleaved 1F1B and ZB-H1. An output layout and attention split
by heads split over their own stage's devices. Two such pipelines side by
side (batch 2 x stage 2 x model 2) run in a fresh process on 8 logical CPUs.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from unittest import mock

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import replicator_strategy as rs
from replicator_strategy.keras import stage_placement
from replicator_strategy.model_parallel import megatron

from pipeline_fits import BATCH  # noqa: I001
from pipeline_fits import assert_equal_weights
from pipeline_fits import assert_trains_as_one_device
from pipeline_fits import data
from pipeline_fits import fit
from pipeline_fits import held_bytes
from pipeline_fits import layout_map
from pipeline_fits import megatron_mlp
from pipeline_fits import one_device

DEVICES = [f"/cpu:{i}" for i in range(4)]
HERE = pathlib.Path(__file__).resolve().parent


def stage_by_model(microbatches, schedule="1f1b", split=("up_1",),
                   rules=None, **pipeline):
  """2 stages (`split` names where the later ones start) x 2 model devices,
  one replica."""
  mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), DEVICES)
  return rs.ReplicatorStrategy(
      layout_map=layout_map(mesh, rules),
      pipeline=rs.Pipeline(stages=2, microbatches=microbatches,
                           schedule=schedule, split=list(split), **pipeline))


def regularized_megatron_mlp():
  return megatron_mlp(regularizer=keras.regularizers.L2(0.05))


def dense_sandwich():
  return keras.Sequential([
      keras.Input((8,)), keras.layers.Dense(8, name="a"),
      keras.layers.Dense(16, name="mid"), keras.layers.Dense(8, name="down")])


def attention():
  x = keras.Input((4, 8))
  h = keras.layers.Dense(8, name="proj")(x)
  return keras.Model(x, keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h))


def autoencoding():
  """(x, x): the batches of a model whose outputs are its inputs' shape."""
  x, _ = data()
  return x, x


def sequences():
  x = np.random.default_rng(0).normal(size=(32, 4, 8)).astype(np.float32)
  return x, x


def fit_both(rules, split, **case):
  """Fits `case` on one device and on stage_by_model with `rules`, split
  at `split`, and compares them; returns the devices of each
  `megatron.assembled` call as the pipelined step is traced."""
  one_device(**case)
  with mock.patch.object(megatron, "assembled",
                         wraps=megatron.assembled) as assembled:
    assert_trains_as_one_device(
        stage_by_model(2, split=[split], rules=rules), **case)
  return [[d[-5:] for d in call.args[1]] for call in assembled.call_args_list]


class PipelineLayoutsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("4_micro_zb_h1", 4, "zb_h1"),  # The backward split in two.
  )
  def test_one_step_is_one_devices(self, microbatches, schedule):
    assert_trains_as_one_device(stage_by_model(microbatches, schedule),
                                build=megatron_mlp)

  @parameterized.named_parameters(
      ("1_micro_1f1b", 1, "1f1b"),
      ("2_micro_1f1b", 2, "1f1b"),
      ("4_micro_1f1b", 4, "1f1b"),
      ("4_micro_gpipe", 4, "gpipe"),
  )
  @pytest.mark.slow
  def test_more_steps_are_one_devices(self, microbatches, schedule):
    assert_trains_as_one_device(stage_by_model(microbatches, schedule),
                                build=megatron_mlp)

  @pytest.mark.slow
  def test_regularizers_on_split_weights(self):
    model = assert_trains_as_one_device(stage_by_model(2),
                                        build=regularized_megatron_mlp)
    self.assertLen(model.losses, 6)  # Each regularizer counted once.

  def test_each_stage_splits_its_kernels_over_its_devices(self):
    # With 2 GPipe micro-batches (1F1B's run with the slow tests).
    model = assert_trains_as_one_device(stage_by_model(2, "gpipe"),
                                        build=megatron_mlp)
    half = (8 * 16 + 16 + 16 * 8) // 2 * 4  # up's kernel and bias, down's.
    # The rest on its stage's first device: down's bias (8), the head's.
    self.assertEqual(held_bytes(model), {
        "CPU:0": half + 8 * 4, "CPU:1": half,
        "CPU:2": half + (8 + 8 * 3 + 3) * 4, "CPU:3": half})
    # Adam's slots, which fit makes once the stages are placed, where their
    # weights are, in the same parts.
    slots = stage_placement.slots_by_weight(model.optimizer)
    for weight in model.weights:
      for slot in slots[weight.path]:
        self.assertEqual(
            [(c.shape, c.device) for c in slot.value.values],
            [(c.shape, c.device) for c in weight.value.values], slot.path)

  def test_interleaved_stages_split_their_kernels(self):
    # 4 virtual stages, 2 a stage: each Megatron pair cut between the
    # stages, each kernel in halves on its stage's devices.
    model = assert_trains_as_one_device(
        stage_by_model(2, "interleaved_1f1b", virtual=2,
                       split=("down_0", "up_1", "down_1")),
        build=megatron_mlp)
    first, second = ["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]
    self.assertEqual(
        {w.path.partition("/")[2]: [c.device[-5:] for c in w.value.values]
         for w in model.weights},
        {"up_0/kernel": first, "up_0/bias": first,  # Virtual stage 0.
         "down_0/kernel": second, "down_0/bias": second[:1],  # 1.
         "up_1/kernel": first, "up_1/bias": first,  # 2.
         "down_1/kernel": second, "down_1/bias": second[:1],  # 3, the head:
         "head/kernel": second[:1], "head/bias": second[:1]})
    self.assertEqual(held_bytes(model)["CPU:1"], (8 * 8 + 8) * 2 * 4)

  def test_a_batch_stage_model_mesh(self):
    mesh = keras.distribution.DeviceMesh(
        (1, 2, 2), ("batch", "stage", "model"), DEVICES)
    assert_trains_as_one_device(rs.ReplicatorStrategy(
        mesh=mesh, layout_map=layout_map(mesh),
        pipeline=rs.Pipeline(stages=2, microbatches=2, split=["up_1"])),
        build=megatron_mlp)

  def test_a_keras_file_loads_and_trains_on(self):
    plain, _ = fit(megatron_mlp)
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    plain.save(path)
    # Loaded with its optimizer built, its slots move (split) with their
    # weights; it trains on as it does on one device, and saves the whole.
    with stage_by_model(2).scope():
      piped = keras.models.load_model(path)
    piped.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    plain.fit(*data(), batch_size=BATCH, shuffle=False, verbose=0)
    assert_equal_weights(piped.get_weights(), plain.get_weights())
    kernel = piped.get_layer("up_0").kernel.value
    self.assertEqual([(c.shape.as_list(), c.device[-5:]) for c in kernel.values],
                     [([8, 8], "CPU:0"), ([8, 8], "CPU:1")])
    piped.save(path)
    for a, b in zip(keras.models.load_model(path).get_weights(),
                    piped.get_weights()):
      np.testing.assert_array_equal(a, b)

  def test_an_output_layout_splits_over_its_stages_devices(self):
    devices = fit_both(
        # mid's output in column parts, for the row-parallel down.
        {".*mid/output": (None, "model"), ".*down/kernel": ("model", None)},
        "mid", build=dense_sandwich, batches=autoencoding, metrics=())
    # mid's output, once a micro-batch as the step is traced: in parts on
    # the second stage's devices, not the replica's four.
    self.assertEqual(devices, [["CPU:2", "CPU:3"]] * 2)

  def test_attention_splits_by_heads_over_its_stages_devices(self):
    devices = fit_both(
        {".*mha/(query|key|value)/kernel": (None, "model", None),
         ".*mha/(query|key|value)/bias": ("model", None),
         ".*mha/attention_output/kernel": ("model", None, None)},
        # SGD: the key's bias has no gradient but rounding, which Adam
        # magnifies.
        "mha", build=attention, batches=sequences, metrics=(),
        optimizer=keras.optimizers.SGD, learning_rate=0.1)
    # Each micro-batch (the step traced once): query, key and value in parts
    # by heads, then attention on each device over its heads, all on the
    # second stage's devices.
    self.assertEqual(devices, [["CPU:2", "CPU:3"]] * 8)


def three_axes_results(*args):
  """What `three_axes_main.py *args` prints, run in a fresh process."""
  env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
  env.pop("TF_CONFIG", None)
  done = subprocess.run(
      [sys.executable, str(HERE / "three_axes_main.py"), *args],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  if done.returncode:
    raise AssertionError(done.stderr[-3000:])
  return json.loads(done.stdout.splitlines()[-1])


def on(*devices, shape):
  """[shape, device] of a part or copy on each of `devices` ("CPU:d")."""
  return [[shape, f"CPU:{d}"] for d in devices]


@pytest.mark.slow  # A fresh process on 8 logical CPUs.
class BatchStageModelTest(parameterized.TestCase):
  """2 pipelines x 2 stages x 2 model devices (`three_axes_main.py`): with
  Adam, and with Adam accumulating 3 steps' gradients."""

  ARGS = ()

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = three_axes_results(*cls.ARGS)

  @parameterized.named_parameters(("adam", "adam"),
                                  ("accumulating", "accumulating"))
  def test_fit_is_one_devices(self, case):
    self.assert_fit_is_one_devices(case)

  def assert_fit_is_one_devices(self, case):
    """The weights, loss and metrics of `case` are one device's."""
    results = self.results[case]
    assert_equal_weights([np.array(w) for w in results["weights"]],
                         results["one_device_weights"])
    for name, values in results["one_device_history"].items():
      np.testing.assert_allclose(results["history"][name], values,
                                 rtol=1e-5, err_msg=name)

  @parameterized.named_parameters(("adam", "adam"),
                                  ("accumulating", "accumulating"))
  def test_each_device_holds_its_part_of_its_stages_weights(self, case):
    self.maxDiff = None
    parts = self.expected_parts()
    results = self.results[case]
    self.assertEqual(results["parts"], parts)
    # Adam's 2 moments, and an accumulator, each on its weight's stage.
    expected = {f"{path}/{slot}": where
                for path, where in self.expected_moments(parts).items()
                for slot in ("momentum", "velocity")}
    if case == "accumulating":
      expected.update({f"{path}/gradient_accumulator": where
                       for path, where in parts.items()})
    self.assertEqual(results["slot_parts"], expected)

  def expected_parts(self):
    """Weight -> [shape, device] of each of its parts or copies: each
    pipeline's copy, the first on devices 0-3, the second on 4-7, each split
    kernel in halves on its stage's two devices."""
    return {
        "up_0/kernel": on(0, 1, 4, 5, shape=[8, 8]),
        "up_0/bias": on(0, 1, 4, 5, shape=[8]),
        "down_0/kernel": on(0, 1, 4, 5, shape=[8, 8]),
        "down_0/bias": on(0, 4, shape=[8]),
        "up_1/kernel": on(2, 3, 6, 7, shape=[8, 8]),
        "up_1/bias": on(2, 3, 6, 7, shape=[8]),
        "down_1/kernel": on(2, 3, 6, 7, shape=[8, 8]),
        "down_1/bias": on(2, 6, shape=[8]),
        "head/kernel": on(2, 6, shape=[8, 3]),
        "head/bias": on(2, 6, shape=[3])}

  def expected_moments(self, parts):
    """Adam's moments of each weight: as the weight is, beside it."""
    return parts


class ShardedStateBatchStageModelTest(BatchStageModelTest):
  """The same, with `Sharding(optimizer_state=True)`."""

  ARGS = ("--sharded-state",)

  def expected_moments(self, parts):
    """Split weights' moments in parts as they are; the others' a flat half
    on their stage's first device of each pipeline (head/bias: 3 padded to
    4). A gradient accumulator is whole, as without sharding."""
    return {
        **{path: where for path, where in parts.items()
           if "kernel" in path and path != "head/kernel" or
           path.startswith("up_")},
        "down_0/bias": on(0, 4, shape=[4]),
        "down_1/bias": on(2, 6, shape=[4]),
        "head/kernel": on(2, 6, shape=[12]),
        "head/bias": on(2, 6, shape=[2])}


class ZeRO3BatchStageModelTest(BatchStageModelTest):
  """The same, with `Sharding(weights="batch")`: each part of a split
  weight, and each other weight, in halves by rows over the pipelines; and
  with Adam built before `fit` ("built_first")."""

  ARGS = ("--zero3",)

  def expected_parts(self):
    """Shard r of part j of a split weight on pipeline r's device j of its
    stage (device 4r + 2s + j); the others' rows on their stage's first
    device of each pipeline (head/bias: 3 rows, 2 and 1). Moments and an
    accumulator are sharded as their weights."""
    return {
        "up_0/kernel": on(0, 1, 4, 5, shape=[4, 8]),
        "up_0/bias": on(0, 1, 4, 5, shape=[4]),
        "down_0/kernel": on(0, 1, 4, 5, shape=[4, 8]),
        "down_0/bias": on(0, 4, shape=[4]),
        "up_1/kernel": on(2, 3, 6, 7, shape=[4, 8]),
        "up_1/bias": on(2, 3, 6, 7, shape=[4]),
        "down_1/kernel": on(2, 3, 6, 7, shape=[4, 8]),
        "down_1/bias": on(2, 6, shape=[4]),
        "head/kernel": on(2, 6, shape=[4, 3]),
        "head/bias": on(2, shape=[2]) + on(6, shape=[1])}

  @parameterized.named_parameters(("adam", "adam"),
                                  ("accumulating", "accumulating"))
  def test_each_shard_is_gathered_among_its_own_devices(self, case):
    # Shard r of a later stage's part j is gathered on pipeline r's device j
    # of that stage, where it lives, not on logical device j.
    self.assertEqual(self.results[case]["gathers"],
                     [[f"CPU:{d}"] * 2 for d in range(8)])

  def test_slots_built_first_move_sharded_with_their_weights(self):
    results = self.results["built_first"]
    self.assert_fit_is_one_devices("built_first")
    parts = self.expected_parts()
    self.assertEqual(results["parts"], parts)
    self.assertEqual(results["slot_parts"], {
        f"{path}/{slot}": where for path, where in parts.items()
        for slot in ("momentum", "velocity")})
