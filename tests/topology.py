"""Shared test topologies: 1, 2 and 4 virtual CPU replicas."""

import replicator_strategy as rs

REPLICA_COUNTS = (1, 2, 4)
NAMED_REPLICA_COUNTS = [(f"{n}_replicas", n) for n in REPLICA_COUNTS]


def strategy_over(num_replicas, **kwargs):
  """A ReplicatorStrategy over the first `num_replicas` logical CPUs."""
  return rs.ReplicatorStrategy(
      devices=[f"/cpu:{i}" for i in range(num_replicas)], **kwargs)
