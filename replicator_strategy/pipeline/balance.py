"""Where to cut a sequence of layer calls into pipeline stages of even cost.

The rule (`balanced_cuts`): the cuts minimise the largest stage's cost (the
pipeline's slowest stage); among the cuts that do, they minimise the sum of
the squares of the stages' costs (the spread); among those, each cut falls
as late as it can, the last one first (so a call without cost, an
activation or a residual add, stays with the call before it).

>>> balanced_cuts([1] * 10, 3, range(1, 10))
(4, 7)
>>> balanced_cuts([8, 0, 8, 0, 8, 0, 8, 0], 2, range(1, 8))
(4,)

A call's cost is its parameter count (`stages.parameter_costs`), or its
forward time on a sample batch (`timed_costs`).
"""

import time

import tensorflow as tf

TIMED_REPEATS = 5  # The median of 5 runs (after one to warm up) resists noise.


def _stage_costs(prefix, bounds):
  return [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]


def _smallest_bottleneck(prefix, bounds, stages):
  """The least largest-stage cost over every choice of `stages` - 1 cuts."""
  m = len(bounds)
  inf = float("inf")
  worst = [inf] * m  # Over cuts of bounds[0]..bounds[i] into k stages.
  worst[0] = 0
  for k in range(1, stages + 1):
    nxt = [inf] * m
    for i in range(k, m):
      for j in range(i - 1, k - 2, -1):
        # The last stage grows as j falls: past the best, no j is better.
        last = prefix[bounds[i]] - prefix[bounds[j]]
        if last >= nxt[i]:
          break
        nxt[i] = min(nxt[i], max(worst[j], last))
    worst = nxt
  return worst[m - 1]


def balanced_cuts(costs, stages, allowed):
  """The positions of the `stages` - 1 cuts (a cut at p runs call p first in
  its stage) among `allowed` (positions in 1..len(costs) - 1), chosen by the
  module's rule. `allowed` must hold at least `stages` - 1 positions."""
  prefix = [0]
  for cost in costs:
    prefix.append(prefix[-1] + cost)
  bounds = [0] + sorted(set(allowed)) + [len(costs)]
  bottleneck = _smallest_bottleneck(prefix, bounds, stages)
  m = len(bounds)
  inf = float("inf")
  # spread[k][i]: least sum of squares cutting bounds[0]..bounds[i] into k
  # stages of at most `bottleneck` each; came[k][i] the bound before i.
  spread = [[inf] * m for _ in range(stages + 1)]
  came = [[None] * m for _ in range(stages + 1)]
  spread[0][0] = 0
  for k in range(1, stages + 1):
    for i in range(k, m):
      for j in range(i - 1, k - 2, -1):  # Latest first: ties keep it.
        cost = prefix[bounds[i]] - prefix[bounds[j]]
        if cost > bottleneck:
          break
        total = spread[k - 1][j] + cost * cost
        if total < spread[k][i]:
          spread[k][i], came[k][i] = total, j
  cuts, i = [], m - 1
  for k in range(stages, 1, -1):
    i = came[k][i]
    cuts.append(bounds[i])
  cuts.reverse()
  return tuple(cuts)


def stage_costs(costs, cuts):
  """Each stage's total cost for `cuts` (as `balanced_cuts` returns)."""
  prefix = [0]
  for cost in costs:
    prefix.append(prefix[-1] + cost)
  return _stage_costs(prefix, [0, *cuts, len(costs)])


def timed_costs(calls, tensors, repeats=TIMED_REPEATS):
  """Each of `calls`' forward time in seconds (the median of `repeats`),
  run in order on `tensors` (the model's inputs by name) with
  `training=False`, so that no state (a dropout's seed, a batch
  normalization's statistics) moves."""
  values, costs = dict(tensors), []
  for call in calls:
    call.run(values, False)  # The first call may build or trace.
    times = []
    for _ in range(repeats):
      tf.test.experimental.sync_devices()
      start = time.perf_counter()
      written = call.run(values, False)
      tf.test.experimental.sync_devices()
      times.append(time.perf_counter() - start)
    values.update(written)
    costs.append(sorted(times)[len(times) // 2])
  return costs
