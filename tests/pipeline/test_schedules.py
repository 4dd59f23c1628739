"""Every schedule is a valid order with the bubble and memory its paper gives.

Valid: each action once, on its stage's device, and the dependencies met
by some timing (no device waits forever), for S = 1, 2, 4 devices and
M = 1, 2, 4, 8 micro-batches (M = 3 too, not dividing S). The bubble, with a
forward as long as a whole backward: (S-1)/(M+S-1) for GPipe and 1F1B,
(S-1)/(vM+S-1) for interleaved 1F1B (the bubble time divided by v), and with
F, B and W equally long, ZB-H1's at most half of 1F1B's (M >= S). Memory:
1F1B's device s holds min(S - s, M) micro-batches, GPipe's M; ZB-H1's at
most 1F1B's peak, min(S, M); in bytes, given each stage's per micro-batch.
"""

import itertools
import unittest

from parameterized import parameterized

from replicator_strategy.pipeline import schedules
from replicator_strategy.pipeline.schedules import B
from replicator_strategy.pipeline.schedules import F
from replicator_strategy.pipeline.schedules import W

GRID = list(itertools.product((1, 2, 4), (1, 2, 3, 4, 8)))
FOLDED = {"F": 1, "B": 1, "W": 0}  # A forward as long as the whole backward.


def plans():
  for s, m in GRID:
    for name in schedules.NAMES:
      for v in (1, 2, 3) if name == "interleaved_1f1b" else (1,):
        yield name, s, m, v


class ValidOrderTest(unittest.TestCase):

  def test_every_schedule_is_a_valid_order(self):
    for name, s, m, v in plans():
      with self.subTest(name=name, stages=s, microbatches=m, virtual=v):
        plan = schedules.schedule(name, s, m, v)
        schedules.check(plan)  # Raises if not.
        placed = schedules.timeline(plan)
        for a in placed.start:
          for need in schedules.dependencies(plan, a):
            self.assertLessEqual(placed.end[need], placed.start[a])
        order = placed.order()
        self.assertEqual(len(order), len(set(order)))
        self.assertEqual(len(order), (3 if plan.split_backward else 2) *
                         s * v * m)

  def test_check_finds_a_missing_action(self):
    plan = schedules.schedule("1f1b", 2, 2)
    broken = schedules.Schedule("1f1b", (plan[0][:-1], plan[1]), 2, 2, False)
    with self.assertRaisesRegex(ValueError, r"missing \[B\(0, 1\)\]"):
      schedules.check(broken)

  def test_timeline_names_a_deadlock(self):
    # Device 0 waits for B(1, 0) before F(0, 0); device 1 needs F(0, 0).
    plan = schedules.Schedule(
        "bad", ((B(0, 0), F(0, 0)), (F(1, 0), B(1, 0))), 2, 1, False)
    with self.assertRaisesRegex(ValueError, r"deadlocks.*B\(0, 0\)"):
      schedules.timeline(plan)

  def test_bad_arguments_say_what_is_expected(self):
    with self.assertRaisesRegex(ValueError, "one of"):
      schedules.schedule("pipedream", 2, 2)
    with self.assertRaisesRegex(ValueError, "microbatches=0"):
      schedules.schedule("gpipe", 2, 0)
    with self.assertRaisesRegex(ValueError, "interleaved_1f1b"):
      schedules.schedule("1f1b", 2, 2, virtual=2)


class BubbleTest(unittest.TestCase):

  @parameterized.expand(["gpipe", "1f1b"])
  def test_bubble_is_s_minus_1_over_m_plus_s_minus_1(self, name):
    for s, m in GRID:
      with self.subTest(stages=s, microbatches=m):
        self.assertAlmostEqual(
            schedules.bubble_fraction(schedules.schedule(name, s, m), FOLDED),
            (s - 1) / (m + s - 1))

  def test_interleaving_divides_the_bubble_by_v(self):
    for (s, m), v in itertools.product(GRID, (1, 2, 3)):
      if m % s:
        continue  # Megatron's bound holds for M a multiple of S.
      with self.subTest(stages=s, microbatches=m, virtual=v):
        plan = schedules.schedule("interleaved_1f1b", s, m, v)
        self.assertAlmostEqual(schedules.bubble_fraction(plan, FOLDED),
                               (s - 1) / (v * m + s - 1))
        # Each stage a v-th of the model: idle time a v-th of 1F1B's.
        placed = schedules.timeline(plan, {"F": 1 / v, "B": 1 / v, "W": 0})
        one = schedules.timeline(schedules.schedule("1f1b", s, m), FOLDED)
        self.assertAlmostEqual(placed.makespan - placed.busy(0),
                               (one.makespan - one.busy(0)) / v)

  def test_zb_h1_bubble_is_at_most_half_of_1f1b(self):
    for s, m in GRID:
      if m < s or s == 1:
        continue  # With M < S no W is left to fill the bubble.
      with self.subTest(stages=s, microbatches=m):
        zb = schedules.bubble_fraction(schedules.schedule("zb_h1", s, m))
        one = schedules.bubble_fraction(schedules.schedule("1f1b", s, m))
        self.assertLessEqual(zb, one / 2)
        # The paper's bubble: (S - 1) (F + B - W) per device.
        self.assertEqual(
            schedules.timeline(schedules.schedule("zb_h1", s, m)).makespan,
            3 * m + s - 1)

  def test_fewer_microbatches_than_stages_leave_a_bigger_bubble(self):
    self.assertGreater(
        schedules.bubble_fraction(schedules.schedule("1f1b", 4, 1), FOLDED),
        schedules.bubble_fraction(schedules.schedule("1f1b", 4, 8), FOLDED))


class MemoryTest(unittest.TestCase):

  def test_in_flight_microbatches(self):
    for s, m in GRID:
      with self.subTest(stages=s, microbatches=m):
        self.assertEqual(
            schedules.peak_in_flight(schedules.schedule("1f1b", s, m)),
            tuple(min(s - d, m) for d in range(s)))
        self.assertEqual(
            schedules.peak_in_flight(schedules.schedule("gpipe", s, m)),
            (m,) * s)
        self.assertLessEqual(
            max(schedules.peak_in_flight(schedules.schedule("zb_h1", s, m))),
            min(s, m))

  def test_interleaved_in_flight_pairs(self):
    for (s, m), v in itertools.product(GRID, (1, 2, 3)):
      padded = -(-m // s) * s
      bound = tuple(min(2 * (s - d - 1) + (v - 1) * s + 1, v * padded)
                    for d in range(s))
      with self.subTest(stages=s, microbatches=m, virtual=v):
        peaks = schedules.peak_in_flight(
            schedules.schedule("interleaved_1f1b", s, m, v))
        if m == padded:
          self.assertEqual(peaks, bound)
        else:  # Micro-batches left out hold nothing.
          self.assertTrue(all(p <= b for p, b in zip(peaks, bound)), peaks)

  def test_peak_activation_bytes(self):
    # Stage j's activations take 10 ** j bytes a micro-batch.
    for s, m in GRID:
      sizes = [10 ** j for j in range(s)]
      with self.subTest(stages=s, microbatches=m):
        self.assertEqual(
            schedules.peak_in_flight(schedules.schedule("1f1b", s, m), sizes),
            tuple(min(s - d, m) * 10 ** d for d in range(s)))
        self.assertEqual(
            schedules.peak_in_flight(schedules.schedule("gpipe", s, m), sizes),
            tuple(m * 10 ** d for d in range(s)))
    # Interleaved: device 0 of 2 holds stages 0 and 2.
    plan = schedules.schedule("interleaved_1f1b", 2, 1, 2)
    self.assertEqual(schedules.peak_in_flight(plan, [1, 10, 100, 1000]),
                     (101, 1010))

  def test_zb_h1_defers_w(self):
    plan = schedules.schedule("zb_h1", 4, 8)
    self.assertTrue(plan.split_backward)
    device = plan[1]
    self.assertLess(device.index(B(1, 1)), device.index(W(1, 0)))
    self.assertEqual(device[-1], W(1, 7))


if __name__ == "__main__":
  unittest.main()
