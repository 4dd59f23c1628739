"""Deeper models under a pipeline's `fit` train as one device does.

An 8-block MLP in 8 micro-batches over 2 and 4 stages (1F1B, ZB-H1); a
transformer block written as a Functional model (attention, LayerNormalization
and residual adds that cross the stages' cuts) over 2 stages in 1, 2, 4 and 8
micro-batches; and two such blocks in one pipeline over 4 stages in 1, 2, 4
and 8 micro-batches; the transformers with every schedule (interleaved 1F1B
with 2 virtual stages a device): after a few Adam steps the weights, the loss
and the metrics equal one device's (rtol 1e-5).
"""

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import replicator_strategy as rs

from pipeline_fits import ROWS  # noqa: I001
from pipeline_fits import assert_trains_as_one_device
from pipeline_fits import mlp

layers = keras.layers

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")


def eight_blocks():
  # As wide as each other: with narrower blocks between wider ones, a first
  # layer's gradient is so small that Adam magnifies the rounding in which
  # order rows are summed beyond rtol 1e-5, data parallel alone included.
  return mlp(widths=(16,) * 7 + (3,))


def transformer(width=8, length=4, blocks=1):
  """`blocks` pre-norm transformer blocks and a head: 7 layers a block and 3
  more (10 for one block, enough for 2 stages of 2 virtual stages each; 17 for
  two, enough for 4 stages of 2)."""
  tokens = keras.Input((length, width))
  x = layers.Dense(width, name="embed")(tokens)
  for block in range(blocks):
    # One block keeps its layers' plain names.
    prefix = f"block{block}_" if blocks > 1 else ""
    h = layers.LayerNormalization(name=f"{prefix}norm1")(x)
    # No biases in the projections: the key's bias has no gradient but
    # rounding, which Adam magnifies.
    h = layers.MultiHeadAttention(2, 4, use_bias=False,
                                  name=f"{prefix}attention")(h, h)
    x = layers.Add(name=f"{prefix}residual1")([x, h])
    h = layers.LayerNormalization(name=f"{prefix}norm2")(x)
    h = layers.Dense(2 * width, activation="gelu", name=f"{prefix}up")(h)
    x = layers.Add(name=f"{prefix}residual2")(
        [x, layers.Dense(width, name=f"{prefix}down")(h)])
  pooled = layers.GlobalAveragePooling1D(name="pool")(x)
  return keras.Model(tokens, layers.Dense(3, name="head")(pooled))


def two_blocks():
  # A function, not a partial: one device's run is cached by `build`.
  return transformer(blocks=2)


def sequences():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, 4, 8)).astype(np.float32),
          rng.normal(size=(ROWS, 3)).astype(np.float32))


def pipelined(stages, microbatches, schedule, devices=4):
  """Pipelines of `stages` stages over the first `devices` devices;
  interleaved ones with 2 virtual stages a device."""
  virtual = 2 if schedule == "interleaved_1f1b" else 1
  return rs.ReplicatorStrategy(
      devices=[f"/cpu:{i}" for i in range(devices)], pipeline=rs.Pipeline(
          stages=stages, microbatches=microbatches, schedule=schedule,
          virtual=virtual))


class DeepModelsTest(parameterized.TestCase):

  @parameterized.named_parameters(("4_stages_8_micro_zb_h1", 4, "zb_h1"))
  @pytest.mark.slow
  def test_eight_blocks_in_eight_micro_batches(self, stages, schedule):
    # 2 stages: 2 pipelines, each cutting its 8 rows into 8 micro-batches.
    assert_trains_as_one_device(pipelined(stages, 8, schedule),
                                build=eight_blocks)

  @parameterized.named_parameters(
      ("2_stages_1f1b", 2, "1f1b"),
      ("2_stages_zb_h1", 2, "zb_h1"),
      ("4_stages_1f1b", 4, "1f1b"),
  )
  @pytest.mark.slow
  def test_more_eight_blocks_in_eight_micro_batches(self, stages, schedule):
    assert_trains_as_one_device(pipelined(stages, 8, schedule),
                                build=eight_blocks)

  @pytest.mark.slow
  def test_a_transformer_in_one_pipeline(self):
    # One pipeline, not two: its step is traced in half the time.
    assert_trains_as_one_device(pipelined(2, 2, "1f1b", devices=2),
                                build=transformer, batches=sequences)

  @parameterized.named_parameters(
      ("2_micro_gpipe", 2, "gpipe"),
      ("2_micro_1f1b", 2, "1f1b"),
      ("2_micro_zb_h1", 2, "zb_h1"),
      ("2_micro_interleaved", 2, "interleaved_1f1b"),
      ("4_micro_gpipe", 4, "gpipe"),
      ("4_micro_1f1b", 4, "1f1b"),
      ("4_micro_zb_h1", 4, "zb_h1"),
      ("4_micro_interleaved", 4, "interleaved_1f1b"),
  )
  @pytest.mark.slow
  def test_a_transformer_over_two_stages(self, microbatches, schedule):
    assert_trains_as_one_device(pipelined(2, microbatches, schedule),
                                build=transformer, batches=sequences)

  @parameterized.named_parameters(
      (f"{m}_micro_{schedule}", m, schedule) for m in (1, 8)
      for schedule in SCHEDULES)
  @pytest.mark.slow
  def test_a_transformer_over_two_stages_in_one_and_eight(
      self, microbatches, schedule):
    # 2 pipelines of 8 rows: 8 micro-batches are a row each.
    assert_trains_as_one_device(pipelined(2, microbatches, schedule),
                                build=transformer, batches=sequences)

  @parameterized.named_parameters(
      (f"{m}_micro_{schedule}", m, schedule) for m in (1, 2, 4, 8)
      for schedule in SCHEDULES)
  @pytest.mark.slow
  def test_two_transformer_blocks_over_four_stages(self, microbatches,
                                                   schedule):
    # One pipeline over the 4 devices; interleaved: 8 virtual stages.
    assert_trains_as_one_device(pipelined(4, microbatches, schedule),
                                build=two_blocks, batches=sequences)
