"""The collectives, declared once: what every topology implements.

The replicas exchange values through four collectives: `all_reduce`,
`all_gather`, `reduce_scatter` and `all_to_all` (`broadcast` and
`map_gather` are all-reduces). Each topology implements each of them in two
forms, the two abstract classes here:

- `Collectives`, on per-replica values in cross-replica context, where the
  replicas meet (a merge function, `merged`, or the strategy's reductions):
  `communicator.Communicator` (one process), `communicator.ClusterCommunicator`
  (across workers) and `sync_groups.topology.GroupedCommunicator` (each sync
  group alone).
- `LaunchedCollectives`, each replica launching its part at run time, where
  the replicas can't meet (inside control flow):
  `replica_collectives.ReplicaCollectives`, and
  `sync_groups.topology.GroupedReplicaCollectives` (each group alone).

`ReplicaContext` offers each collective to the replicas, with its gradient,
through `exchange`. Adding a collective: an abstract method in each class
here, its implementation in `Communicator` and `ReplicaCollectives` (Python
refuses to make a topology that lacks one: a TypeError naming it), a method
of `ReplicaContext`, and its test; the sync-groups topology runs it group by
group by itself (`forwarded`).

>>> from replicator_strategy.collectives import communicator
>>> comm = communicator.for_topology(("/cpu:0", "/cpu:1"), "auto", None, 120)
>>> isinstance(comm, Collectives)
True
>>> sorted(names(LaunchedCollectives))
['all_gather', 'all_reduce', 'all_to_all', 'draw_keys', 'reduce_scatter']
"""

import abc


def same_on_every_replica(method):
  """Marks a collective of `Collectives` whose result is the same on every
  replica (a `Mirrored`), not each replica's own (a `PerReplica`)."""
  method.same_on_every_replica = True
  return method


class Collectives(abc.ABC):
  """The collectives on per-replica values, called in cross-replica context.

  `value` is a distributed value with one part per local replica; results
  hold one part per local replica too.
  """

  @abc.abstractmethod
  def ops_for(self, value, destinations):
    """all_reduce: the `tf.distribute.CrossDeviceOps` that reduces `value`
    (distributed or plain) onto `destinations`."""

  @same_on_every_replica
  @abc.abstractmethod
  def all_gather(self, value, axis, options=None):
    """Every replica's part of `value`, concatenated in global replica order
    along `axis`, on every local replica; a `Mirrored`. `options`: a
    `tf.distribute.experimental.CommunicationOptions`."""

  @abc.abstractmethod
  def reduce_scatter(self, value, op, axis):
    """Slice r (of N along `axis`) of `value` reduced over the replicas with
    `op` (a `ReduceOp`), on replica r; a `PerReplica`."""

  @abc.abstractmethod
  def all_to_all(self, value, split_axis, concat_axis):
    """Slice j (of N along `split_axis`) of replica r's `value` to replica j,
    which concatenates what it receives in replica order along
    `concat_axis`; a `PerReplica`."""


class LaunchedCollectives(abc.ABC):
  """The collectives each replica launches by itself, at run time.

  Methods take the replica's index among this worker's replicas
  (`local_index`), a list of its `tensors`, and instance `keys` drawn with
  `draw_keys`, one per tensor (`all_gather`: two); they return the list of
  results.
  """

  @abc.abstractmethod
  def draw_keys(self, local_index, count, home_graph):
    """`count` keys for this replica's next collectives, in program order."""

  @abc.abstractmethod
  def all_reduce(self, local_index, op, tensors, keys):
    """Each of `tensors` reduced with `op` over the replicas."""

  @abc.abstractmethod
  def all_gather(self, local_index, tensors, axis, keys):
    """Each of `tensors` concatenated over the replicas along `axis`."""

  @abc.abstractmethod
  def reduce_scatter(self, local_index, op, tensors, axes, keys):
    """Slice r (of N along its axis) of each tensor reduced, on replica r."""

  @abc.abstractmethod
  def all_to_all(self, local_index, tensors, split_axes, concat_axes, keys):
    """Slice j (of N along its split axis) of each tensor to replica j,
    concatenated there along the concat axis."""


def names(protocol):
  """The collectives `protocol` declares (its abstract methods' names)."""
  return protocol.__abstractmethods__


def forwarded(protocol, forward):
  """A class decorator: each collective of `protocol` that the class does
  not define itself becomes `forward(name, declared)`, `declared` being the
  protocol's method (its docstring, its marks)."""

  def decorate(cls):
    for name in names(protocol):
      if name not in vars(cls):
        setattr(cls, name, forward(name, getattr(protocol, name)))
    abc.update_abstractmethods(cls)
    return cls

  return decorate
