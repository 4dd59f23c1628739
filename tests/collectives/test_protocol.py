"""The collectives, declared once (collectives/protocol.py), in every topology.

Each topology implements every collective of the protocol, and the sync
groups' topology runs each within each group from the protocol itself: a
collective added to the protocol needs a case in `CALLS` here, which runs it
in sync groups where the replicas merge and inside a `tf.cond`.
"""

import inspect
import unittest

import numpy as np
from parameterized import parameterized
import tensorflow as tf

from assertions import assert_per_replica
import topology
from replicator_strategy.collectives import communicator
from replicator_strategy.collectives import protocol
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.sync_groups import topology as groups_topology

# One call per collective of the protocol, as a replica makes it, and what
# replica i of a group gets, from the group's inputs `xs` (one per replica).
CALLS = {
    "all_reduce": (lambda ctx, x: ctx.all_reduce("sum", x),
                   lambda xs, i: sum(xs)),
    "all_gather": (lambda ctx, x: ctx.all_gather(x, axis=0),
                   lambda xs, i: np.concatenate(xs)),
    "reduce_scatter": (lambda ctx, x: ctx.reduce_scatter("sum", x),
                       lambda xs, i: np.split(sum(xs), len(xs))[i]),
    "all_to_all": (lambda ctx, x: ctx.all_to_all(x),
                   lambda xs, i: np.concatenate(
                       [np.split(x, len(xs))[i] for x in xs])),
}
# The protocol's name of each merged collective that has another name.
MERGED_AS = {"ops_for": "all_reduce"}
GROUPS, GROUP_SIZE = 2, 2


def replica_input(replica_id):
  return np.arange(4.0, dtype="float32") + 10.0 * replica_id


class ProtocolTest(unittest.TestCase):

  def test_every_collective_of_the_protocol_has_a_case_here(self):
    merged = {MERGED_AS.get(n, n) for n in protocol.names(
        protocol.Collectives)}
    launched = set(protocol.names(protocol.LaunchedCollectives)) - {
        "draw_keys"}
    self.assertEqual(merged, set(CALLS))
    self.assertEqual(launched, set(CALLS))

  def test_every_topology_implements_every_collective(self):
    for cls, declaration in (
        (communicator.Communicator, protocol.Collectives),
        (communicator.ClusterCommunicator, protocol.Collectives),
        (groups_topology.GroupedCommunicator, protocol.Collectives),
        (replica_collectives.ReplicaCollectives,
         protocol.LaunchedCollectives),
        (groups_topology.GroupedReplicaCollectives,
         protocol.LaunchedCollectives)):
      with self.subTest(cls.__name__):
        self.assertTrue(issubclass(cls, declaration))
        self.assertFalse(inspect.isabstract(cls), cls.__abstractmethods__)
    grouped = topology.strategy_over(4, sync_groups=2).extended.communicator
    self.assertIsInstance(grouped, groups_topology.GroupedCommunicator)
    self.assertIsInstance(grouped.replica_collectives,
                          protocol.LaunchedCollectives)

  def test_a_topology_lacking_a_collective_is_refused_naming_it(self):
    class Lacking(protocol.LaunchedCollectives):
      draw_keys = all_reduce = all_gather = reduce_scatter = (
          lambda self, *args: None)

    with self.assertRaisesRegex(TypeError, "all_to_all"):
      Lacking()


class GroupedCollectivesTest(unittest.TestCase):
  """Every collective within each sync group, forwarded from the protocol."""

  @parameterized.expand([(name, path) for name in CALLS
                         for path in ("merged", "launched")])
  def test_each_group_exchanges_alone(self, name, path):
    strategy = topology.strategy_over(GROUPS * GROUP_SIZE,
                                      sync_groups=GROUPS)
    call, expected = CALLS[name]

    def step():
      ctx = tf.distribute.get_replica_context()
      x = tf.constant(replica_input(0)) + 10.0 * tf.cast(
          ctx.replica_id_in_sync_group, tf.float32)
      if path == "merged":
        return call(ctx, x)
      # Inside a tf.cond each replica launches its own collectives.
      return tf.cond(tf.reduce_sum(x) >= 0.0, lambda: call(ctx, x),
                     lambda: call(ctx, -x))

    def want(replica):
      first = replica - replica % GROUP_SIZE
      group = [replica_input(first + i) for i in range(GROUP_SIZE)]
      return expected(group, replica % GROUP_SIZE)

    got = tf.function(lambda: strategy.run(step))()
    assert_per_replica(self, strategy, got, want, what=f"{name} ({path})")


if __name__ == "__main__":
  unittest.main()
