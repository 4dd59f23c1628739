"""Streaming DiLoCo with a low-bit exchange: `SyncGroups(fragments=F,
outer_dtype=...)` on 4 logical CPUs, 2 groups of 2.

Each fragment's round sends that fragment's change only, quantized with each
weight's own residual (error feedback), and counts that fragment's bytes. A
custom loop equals a NumPy reference of the same math (the fragments'
schedule and outer step of test_sync_groups_fragments, the quantization of
test_sync_groups_low_bit); a run resumed from a checkpoint between two
fragments' rounds equals the uninterrupted one.
"""

import os
import tempfile

from absl.testing import parameterized
import numpy as np

from test_sync_groups_fragments import grouped
from test_sync_groups_fragments import Loop
from test_sync_groups_fragments import nesterov
from test_sync_groups_fragments import reference
from test_sync_groups_fragments import STEPS
from test_sync_groups_low_bit import np_quantize

SIZES = (3, 5, 2)  # F = 2 cuts [a] | [b, c]; F = 3 each weight.
CUTS = {2: [(0, 3), (3, 10)], 3: [(0, 3), (3, 8), (8, 10)]}


class LowBitRounds:
  """A round's mean of columns lo:hi in NumPy: each weight's change of each
  group plus its residual, quantized in 2 chunks (one per replica of a
  group), each group weighted 1/2; keeps each group's residuals."""

  def __init__(self, name, sizes):
    self.name = name
    ends = np.cumsum(sizes)
    self.weights = list(zip(ends - sizes, ends))
    self.residuals = np.zeros((2, sum(sizes)), np.float32)

  def __call__(self, lo, hi, anchor, w):
    change = np.zeros(hi - lo, np.float32)
    for a, b in self.weights:
      if not lo <= a < hi:
        continue
      for g in range(2):
        value = anchor[a:b] - w[2 * g, a:b] + self.residuals[g, a:b]
        sent, scales, _, steps = np_quantize(value, self.name, 2)
        self.residuals[g, a:b] = value - sent
        received = steps * (scales * np.float32(0.5))[:, None]
        change[a - lo:b - lo] += received.reshape(-1)[:b - a]
    return anchor[lo:hi] - change


def group_values(strategy, variables):
  """Each group's value (its first replica's) of `variables`, concatenated."""
  return np.stack([np.concatenate([
      strategy.experimental_local_results(v)[2 * g].numpy() for v in variables])
                   for g in range(2)])


class FragmentsLowBitTest(parameterized.TestCase):

  @parameterized.parameters(
      (2, 4, False, "int8"), (2, 4, True, "int8"), (3, 6, True, "int8"),
      (2, 4, True, "int4"))
  def test_rounds_equal_the_reference(self, fragments, average_every, outer,
                                      name):
    strategy = grouped(fragments, average_every, nesterov() if outer else None,
                       outer_dtype=name)
    loop = Loop(strategy)
    seen = loop.train(STEPS)
    strategy.average_sync_groups(loop.weights)
    seen.append(loop.values())
    rounds = LowBitRounds(name, SIZES)
    want = reference(fragments, average_every, outer, cuts=CUTS[fragments],
                     exchange=rounds)
    for step, (got, expected) in enumerate(zip(seen, want), start=1):
      np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6,
                                 err_msg=f"after step {step}")
    np.testing.assert_allclose(
        group_values(strategy, strategy.sync_groups_state.residuals),
        rounds.residuals, rtol=1e-6, atol=1e-6)
    self.assertTrue(rounds.residuals.any())

  def test_a_round_sends_its_fragment_only(self):
    # 4 weights of 256: a round of F = 4 sends one weight's int8 change.
    sizes = (256,) * 4
    per_round = {}
    for fragments, name in ((1, None), (1, "int8"), (4, "int8")):
      strategy = grouped(fragments, 4, outer_dtype=name)
      Loop(strategy, sizes).train(4)
      averaging = strategy.averaging
      self.assertEqual(averaging.rounds, fragments)  # F = 4: after 1, 2, 3, 4.
      per_round[fragments, name] = averaging.bytes_averaged / averaging.rounds
    # Each group's 256 int8 values in 2 chunks of 32 words and a scale.
    self.assertEqual(per_round[4, "int8"], 2 * (32 + 1) * 4)
    self.assertEqual(per_round[4, "int8"], per_round[1, "int8"] / 4)
    self.assertEqual(per_round[1, None], 4 * 256 * 4)
    # 1/16 of float32's, and a scale's word beside each chunk's 32.
    self.assertAlmostEqual(per_round[4, "int8"] / per_round[1, None],
                           1 / 16 * 33 / 32)

  def test_a_run_resumed_between_fragments_goes_on_exactly(self):
    make = lambda: Loop(grouped(2, 4, nesterov(), outer_dtype="int8"))
    uninterrupted = make()
    uninterrupted.train(STEPS)
    uninterrupted.strategy.average_sync_groups(uninterrupted.weights)

    interrupted = make()
    interrupted.train(5)  # Fragment 1 at 2, fragment 0 at 4; 1 due at 6.
    state = interrupted.strategy.sync_groups_state
    self.assertTrue(group_values(interrupted.strategy, state.residuals).any())
    with tempfile.TemporaryDirectory() as directory:
      path = interrupted.checkpoint().write(os.path.join(directory, "ckpt"))
      resumed = make()
      resumed.checkpoint().read(path).assert_existing_objects_matched()
      resumed.train(STEPS)
    resumed.strategy.average_sync_groups(resumed.weights)
    np.testing.assert_array_equal(resumed.values(), uninterrupted.values())
    np.testing.assert_array_equal(
        group_values(resumed.strategy,
                     resumed.strategy.sync_groups_state.residuals),
        group_values(uninterrupted.strategy,
                     uninterrupted.strategy.sync_groups_state.residuals))
