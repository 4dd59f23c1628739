"""Creating distributed variables: one component per replica device.

TF's `MirroredVariable` (on-write, every aggregation) and `SyncOnReadVariable`
(on-read, e.g. Keras metrics) carry checkpointing, SavedModel export and
Keras integration, so they are reused; this module decides where the
components live and what each starts from, and what a variable whose
replicas hold different copies saves and loads (`SavedCopies`: a SUM on-read
variable's every copy besides their sum, `ReplicaSum`; each sync group's
value, `SyncGroupVariable`).

>>> from replicator_strategy import ReplicatorStrategy
>>> strategy = ReplicatorStrategy()
>>> with strategy.scope():
...   v = tf.Variable(1.0)
>>> type(v).__name__
'MirroredVariable'
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import replica_context
from replicator_strategy.model_parallel import sharded_parts
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.sharding import variables as sharded_variables


class MirroredVariable(tfi.values.MirroredVariable):
  """TF's MirroredVariable, with ONLY_FIRST_REPLICA updates in control flow.

  TF broadcasts replica 0's value for such an update through `merge_call`,
  which can't gather replicas inside a `tf.cond` (Keras's loss-scale
  optimizer steps its counters there); this broadcasts with a collective.
  """

  def _update_replica(self, update_fn, value, **kwargs):
    ctx = tf.distribute.get_replica_context()
    if (self.aggregation != tf.VariableAggregation.ONLY_FIRST_REPLICA or
        not isinstance(ctx, replica_context.ReplicaContext) or ctx.can_merge):
      return tfi.base_update_replica(tfi.values.MirroredVariable, self,
                                     update_fn, value, **kwargs)
    if tf.is_tensor(value):
      value = ctx.broadcast(value, source_replica_id=0)
    return tfi.update_in_replica_context(ctx, self, update_fn, (value,), kwargs,
                                         group=True)


class SyncOnReadVariable(tfi.values.SyncOnReadVariable):
  """TF's SyncOnReadVariable, whose summed value a save and a load keep exactly.

  A SUM variable (a Keras metric's total, a gradient accumulator) reads and
  saves as the sum of every replica's copy. TF loads such a sum back by
  giving each copy sum / N, which rounds (N = 3) and reads back a different
  sum; here the first replica of the cluster takes the whole sum and every
  other copy zero, so it reads back as the very value saved, on any number
  of replicas.
  """

  def assign(self, value, use_locking=False, name=None, read_value=True):
    with tfi.distribute_lib.enter_or_assert_strategy(self.distribute_strategy):
      if (self.aggregation != tf.VariableAggregation.SUM or
          not _assigns_the_sum()):
        return super().assign(value, use_locking, name, read_value)
      return self._assign_sum(tf.convert_to_tensor(value, dtype=self.dtype),
                              read_value)

  def _assign_sum(self, value, read_value):
    share = _sum_on_first(self.distribute_strategy, value)
    updates = []
    for i, component in enumerate(self.values):
      with tf.device(component.device):
        updates.append(component.assign(share(i), read_value=False))
    if not read_value:
      return tf.group(updates)
    with tf.control_dependencies(updates):
      return self.read_value()


def _assigns_the_sum():
  """Whether an assignment here sets a SUM variable's sum, not one replica's
  copy: in cross-replica context, outside updates and non-distributed saves."""
  return (tf.distribute.in_cross_replica_context() and
          not tfi.values_util.in_replica_update_context() and
          not tfi.values_util.is_saving_non_distributed())


def _sum_on_first(strategy, value):
  """Local replica i's share of a SUM assigned `value`: all of it on the
  cluster's first replica, zeros elsewhere."""
  first = strategy.extended.first_replica_id == 0
  return lambda i: value if first and i == 0 else tf.zeros_like(value)


def local_reads(variable):
  """Each of this worker's components of the distributed `variable`, read on
  its device."""
  reads = []
  for component in variable.values:
    with tf.device(component.device):
      reads.append(component.read_value())
  return reads


class SavedCopies:
  """A distributed variable whose saves keep a copy per replica or per group.

  TF saves one value of a distributed variable. A subclass saves, beside it
  (what TF and one device load), the copies its replicas hold (one per
  `replicas_per_copy` replicas, in global replica order) under
  `COPIES_KEY`; a load on as many replicas (and groups) gives every replica
  its own copy back, and otherwise assigns the one value.
  """

  COPIES_KEY = None  # The checkpoint attribute holding the copies.
  replicas_per_copy = 1

  def saved_copies(self):
    """The copies, of every worker, stacked in global replica order."""
    strategy = self.distribute_strategy
    with tfi.distribute_lib.enter_or_assert_strategy(strategy):
      own = []
      for copy in self._local_copies():
        with tf.device(copy.device):
          own.append(tf.expand_dims(copy, 0))
      every_replica = strategy.gather(tfi.values.PerReplica(own), axis=0)
      return every_replica[::self.replicas_per_copy]

  def _local_copies(self):
    """This worker's replicas' copies, each read on its device."""
    return local_reads(self)

  def _assign_local_copies(self, value_of):
    """Gives each of this worker's replicas i the value `value_of(i)`."""
    updates = []
    for i, component in enumerate(self.values):
      with tf.device(component.device):
        updates.append(component.assign(value_of(i), read_value=False))
    return tf.group(updates)

  def restores_copies(self, stacked):
    """Whether `stacked` (a `saved_copies()`) has a copy for each copy here:
    saved on as many replicas (and groups)."""
    extended = self.distribute_strategy.extended
    return (stacked.shape[0] * self.replicas_per_copy ==
            extended.num_replicas_in_all_groups)

  def assign_copies(self, stacked):
    """Gives each replica its copy from `saved_copies()` that
    `restores_copies`."""
    first = self.distribute_strategy.extended.first_replica_id
    return self._assign_local_copies(lambda i: tf.cast(
        stacked[(first + i) // self.replicas_per_copy], self.dtype))

  def _serialize_to_tensors(self):
    tensors = {tfi.VARIABLE_VALUE_KEY: self.read_value()}
    if tfi.values_util.is_saving_non_distributed():
      return tensors
    restoring = tfi.attributes_being_restored()
    # A checkpoint saved with no strategy (or before the copies were saved)
    # has only the value: then TF must not be asked for the others.
    if restoring is None or self.COPIES_KEY in restoring:
      tensors[self.COPIES_KEY] = self.saved_copies()
    return tensors

  def _restore_from_tensors(self, restored_tensors):
    stacked = restored_tensors.get(self.COPIES_KEY)
    if stacked is not None and self.restores_copies(stacked):
      return self.assign_copies(stacked)
    return self.assign(restored_tensors[tfi.VARIABLE_VALUE_KEY],
                       read_value=False)


# `tf.Variable` argument, read by the strategy's variable creator: the variable
# is a `ReplicaSum` (Keras does not pass it on, so a creator scope adds it).
REPLICA_SUM = "replica_sum"


class ReplicaSum(SavedCopies, SyncOnReadVariable):
  """A SUM on-read variable whose saves keep every replica's copy.

  Reads, and saves where TF and Keras look, as the sum of every replica's
  copy (what one device would hold; a gradient accumulator), and also keeps
  each copy: a load on as many replicas gives every replica its own copy
  back, so a resumed run adds in the same order as an uninterrupted one.
  Saved on another number of replicas, or with no strategy, the sum goes to
  the first replica and zeros to the others.
  """

  COPIES_KEY = "REPLICA_VALUES"


class _SplitCopies(SavedCopies, split_variables.SplitVariable):
  """A split weight's shape whose saves keep copies: each replica's copy is
  its parts, whole."""

  def _local_copies(self):
    return [self._whole(r) for r in range(len(self.values) // self.num_parts)]

  def _assign_local_copies(self, value_of):
    updates = []
    for r in range(len(self.values) // self.num_parts):
      for part, piece in zip(self.parts(r), self._split(value_of(r))):
        with tf.device(part.device):
          updates.append(part.assign(piece, read_value=False))
    return tf.group(updates)


class SplitReplicaSum(_SplitCopies):
  """A `ReplicaSum` of a split weight's shape (its gradient accumulator).

  Each replica's copy is split as the weight is, part i on the replica's
  logical device i, so a device holds 1/k of it; inside a replica it reads
  as the replica's copy, whole (beside the whole gradient the optimizer
  gets), elsewhere and in saves as the sum of every replica's copy.
  """

  COPIES_KEY = ReplicaSum.COPIES_KEY

  def _get_cross_replica(self):
    return self.distribute_strategy.reduce(
        tf.distribute.ReduceOp.SUM,
        tfi.values.PerReplica(self._local_copies()), axis=None)

  def _note_whole_read(self):
    pass  # The optimizer's, not a layer's: it adds the whole gradient.

  def assign(self, value, use_locking=False, name=None, read_value=True):
    with tfi.distribute_lib.enter_or_assert_strategy(self.distribute_strategy):
      if not _assigns_the_sum():
        return super().assign(value, use_locking, name, read_value)
      update = self._assign_local_copies(_sum_on_first(
          self.distribute_strategy,
          tf.convert_to_tensor(value, dtype=self.dtype)))
      if not read_value:
        return update
      with tf.control_dependencies([update]):
        return self.read_value()


class SyncGroupVariable(SavedCopies, MirroredVariable):
  """A MirroredVariable under sync groups, whose saves keep every group's value.

  Between averaging rounds each sync group holds its own value (its
  replicas agree), and TF saves one: the first replica's. Here a save keeps,
  beside that value (what TF and one device load), each group's, in group
  order; a load on as many groups gives every group its own back, so a run
  restored between rounds goes on as it would have. On another number of
  groups, every replica loads the first group's value.
  """

  COPIES_KEY = "SYNC_GROUP_VALUES"

  @property
  def replicas_per_copy(self):
    return self.distribute_strategy.num_replicas_in_sync


class SyncGroupShardedVariable(SavedCopies, sharded_variables.ShardedVariable):
  """A `ShardedVariable` under sync groups, whose saves keep every group's value.

  Each group holds its own shards (sharded over its replicas) and, between
  rounds, its own values (its optimizer's state): saved and restored as a
  `SyncGroupVariable`'s are, each group's whole.
  """

  COPIES_KEY = SyncGroupVariable.COPIES_KEY
  replicas_per_copy = SyncGroupVariable.replicas_per_copy

  def _local_copies(self):
    n = self.layout.num_shards
    shards = local_reads(self)
    wholes = {}
    for first in range(0, len(shards), n):
      with tf.device(self.values[first].device):
        wholes[first] = self.layout.assemble(shards[first:first + n])
    return [wholes[r - r % n] for r in range(len(shards))]

  def _assign_local_copies(self, value_of):
    return super()._assign_local_copies(
        lambda i: self.layout.shard(value_of(i), self.shard_index(i)))


class SyncGroupSplitVariable(_SplitCopies):
  """A `SplitVariable` under sync groups, whose saves keep every group's
  value (each group's first replica's parts, whole), as a
  `SyncGroupVariable`'s are."""

  COPIES_KEY = SyncGroupVariable.COPIES_KEY
  replicas_per_copy = SyncGroupVariable.replicas_per_copy


class SyncGroupShardedSplitVariable(SavedCopies,
                                    sharded_parts.ShardedSplitVariable):
  """A `ShardedSplitVariable` under sync groups, whose saves keep every
  group's value (each group's parts, assembled from its shards, whole), as
  a `SyncGroupVariable`'s are."""

  COPIES_KEY = SyncGroupVariable.COPIES_KEY
  replicas_per_copy = SyncGroupVariable.replicas_per_copy

  def _local_copies(self):
    k, n = self.num_parts, self.layout.num_shards
    wholes = {}
    for first in range(0, len(self.values) // k, n):
      parts = []
      for j in range(k):
        shards = self.values[first * k + j:(first + n) * k:k]
        with tf.device(shards[0].device):
          parts.append(self.layout.assemble(
              [c.read_value() for c in shards]))
      wholes[first] = self._concat(parts)
    return [wholes[r - r % n] for r in range(len(self.values) // k)]

  def _assign_local_copies(self, value_of):
    updates = []
    for r in range(len(self.values) // self.num_parts):
      for component, part in zip(self.parts(r), self._split(value_of(r))):
        with tf.device(component.device):
          updates.append(component.assign(
              self.layout.shard(part, self.shard_index(r)), read_value=False))
    return tf.group(updates)


_SYNC_GROUP_CLASSES = {
    sharded_variables.ShardedVariable: SyncGroupShardedVariable,
    split_variables.SplitVariable: SyncGroupSplitVariable,
    sharded_parts.ShardedSplitVariable: SyncGroupShardedSplitVariable,
}


def piecewise_class(strategy, cls):
  """The class `strategy` makes its `cls` variables (`ShardedVariable` or
  `SplitVariable`) of: under sync groups, its subclass that saves every
  group's value."""
  if strategy.extended.num_sync_groups > 1:
    return _SYNC_GROUP_CLASSES[cls]
  return cls


def round_pieces(variable):
  """How the averaging rounds between sync groups exchange the distributed
  `variable`: in pieces, each a list of (component, the local replicas it
  stands for), one value per replica (or per group) on its own device. A
  split weight's piece i is part i of every replica, a sharded one's piece
  s is shard s of every group, and a split one sharded too has a piece for
  shard s of part j of every group: each is averaged on its own devices,
  never whole. Any other variable is one piece, its components."""
  values = variable.values
  if isinstance(variable, sharded_parts.ShardedSplitVariable):
    k, n = variable.num_parts, variable.layout.num_shards
    return [[(values[(g + s) * k + j], list(range(g, g + n)))
             for g in range(0, len(values) // k, n)]
            for j in range(k) for s in range(n)]
  if isinstance(variable, split_variables.SplitVariable):
    k = variable.num_parts
    return [[(variable.parts(r)[i], [r]) for r in range(len(values) // k)]
            for i in range(k)]
  if isinstance(variable, sharded_variables.ShardedVariable):
    n = variable.layout.num_shards
    return [[(values[g + s], list(range(g, g + n)))
             for g in range(0, len(values), n)] for s in range(n)]
  return [[(component, [r]) for r, component in enumerate(values)]]


def whole_from_pieces(variable, values):
  """The whole of `variable` from one value of each of its `round_pieces`,
  on the first's device."""
  with tf.device(values[0].device):
    if isinstance(variable, sharded_parts.ShardedSplitVariable):
      n = variable.layout.num_shards
      return tf.concat([variable.layout.assemble(values[j:j + n])
                        for j in range(0, len(values), n)], variable.axis)
    if isinstance(variable, split_variables.SplitVariable):
      return tf.concat(values, variable.axis)
    if isinstance(variable, sharded_variables.ShardedVariable):
      return variable.layout.assemble(values)
    return values[0]


_CLASS_MAPPING = {
    **tfi.distribute_utils.VARIABLE_CLASS_MAPPING,
    tf.VariableSynchronization.ON_WRITE: MirroredVariable,
    tf.VariableSynchronization.ON_READ: SyncOnReadVariable,
}
_REPLICA_SUM_MAPPING = {**_CLASS_MAPPING,
                        tf.VariableSynchronization.ON_READ: ReplicaSum}
_SYNC_GROUP_MAPPING = {**_CLASS_MAPPING,
                       tf.VariableSynchronization.ON_WRITE: SyncGroupVariable}


def create(strategy, devices, next_creator, replica_sum=False, **kwargs):
  """Creates a variable with one component on each of `devices`.

  `replica_sum=True` (with ON_READ SUM) makes a `ReplicaSum`.
  """
  colocate_with = kwargs.pop("colocate_with", None)
  if isinstance(colocate_with, tfi.numpy_dataset.SingleDevice):
    with tf.device(colocate_with.device):
      return next_creator(**kwargs)
  if colocate_with is not None:
    devices = tuple(component.device for component in colocate_with.values)

  def create_components(**kwargs):
    components = []
    for i, device in enumerate(devices):
      with tf.device(device):
        if i == 0:
          # Every worker starts from the chief's value.
          kwargs["initial_value"] = strategy.extended.communicator.initial_value(
              kwargs["initial_value"], kwargs.get("dtype"))
        else:
          # Replicas start from the primary's value, so they are identical
          # even when the initializer is random.
          kwargs["initial_value"] = _copy_of(components[0])
          kwargs["name"] = "{}/replica_{:d}/".format(
              components[0].name.split(":")[0], i)
        with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
          with tfi.record.stop_recording():
            components.append(next_creator(**kwargs))
    return components

  if replica_sum:
    mapping = _REPLICA_SUM_MAPPING
  elif strategy.extended.num_sync_groups > 1:
    mapping = _SYNC_GROUP_MAPPING
  else:
    mapping = _CLASS_MAPPING
  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_components, mapping,
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)


def _copy_of(primary):
  def initial_value():
    if tf.executing_eagerly() or tf.inside_function():
      return tf.identity(primary.value())
    return tf.identity(primary.initial_value)
  return initial_value
