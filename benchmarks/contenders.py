"""The devices and the strategies that compete on them.

Every strategy is made once per process (and lazily: listing the devices
starts TF, after `main` has split the CPU): several MirroredStrategy
instances over the same devices reuse collective keys and break each other.
"""

import functools

import tensorflow as tf

import replicator_strategy as rs


@functools.cache
def devices():
  """The local devices.

  Listing them starts TF: a worker joins its cluster first.
  """
  return rs.local_devices()


def replica_counts():
  return [n for n in (1, 2, 4) if n <= len(devices())]


def at_most_replicas(n):
  """Whether `n` is the most replicas (where one-count sections run)."""
  return n == replica_counts()[-1]


@functools.cache
def contenders(num_replicas):
  """(name, strategy or None) for one replica count; no strategy is 1 device."""
  chosen = list(devices()[:num_replicas])
  return [("none", None),
          ("mirrored", tf.distribute.MirroredStrategy(chosen)),
          ("replicator", rs.ReplicatorStrategy(devices=chosen))]


@functools.cache
def sharded(num_replicas):
  """ReplicatorStrategy with shard_optimizer_state=True (one per process)."""
  return rs.ReplicatorStrategy(devices=list(devices()[:num_replicas]),
                               shard_optimizer_state=True)


@functools.cache
def zero3(num_replicas):
  """ReplicatorStrategy with every weight and its state cut over the replicas."""
  return rs.ReplicatorStrategy(
      devices=list(devices()[:num_replicas]), shard_optimizer_state=True,
      variable_partitioner=(
          tf.distribute.experimental.partitioners.FixedShardsPartitioner(
              num_replicas)))


def contender(name, num_replicas):
  """The strategy named `name`: one of `contenders`, "sharded" or "zero3"."""
  if name == "sharded":
    return sharded(num_replicas)
  if name == "zero3":
    return zero3(num_replicas)
  return dict(contenders(num_replicas))[name]


def scope(strategy):
  return strategy.scope() if strategy else tf.device(devices()[0])
