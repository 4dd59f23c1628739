"""`ReplicatorExtended`: the strategy's machinery behind `tf.distribute.Strategy`.

Everything TF and Keras reach through `strategy.extended` lives here:
variable creation, reductions, updates, input distribution (through
`input_distribution`) and replica execution. Subclasses TF's
`StrategyExtendedV1`, the base every TF strategy uses, because `Strategy.run`
calls its `call_for_each_replica`.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy()
>>> strategy.extended.worker_devices
('/job:localhost/replica:0/task:0/device:CPU:0', ...)
"""

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import logical_devices
from replicator_strategy.model_parallel import sharded_parts
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.collectives import communicator as communicator_lib
from replicator_strategy.collectives import packing
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy import input_distribution
from replicator_strategy import replica_context
from replicator_strategy import replica_runner
from replicator_strategy.sharding import creation as sharding
from replicator_strategy.sharding import variables as sharded_variables
from replicator_strategy import variables

_utils = tfi.distribute_utils


class ReplicatorExtended(tfi.StrategyExtendedV1):
  """Replicates over `devices` of this worker, one replica per device.

  How replicas exchange values, alone or with other workers (a `cluster`,
  see `replicator_strategy.cluster.config`), is the `communicator`'s business,
  chosen here once.

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
  >>> isinstance(strategy.extended, rs.ReplicatorExtended)
  True
  >>> strategy.extended.all_reduce_choice
  'add_on_one_device: devices share host memory'
  """

  def __init__(self, container_strategy, options, all_reduce, cluster=None,
               timeout_seconds=collective_watchdog.DEFAULT_TIMEOUT_SECONDS):
    """`options`: the strategy's `options.StrategyOptions`, its mesh giving
    each replica's devices and the sync groups."""
    super().__init__(container_strategy)
    self.options = options
    self.logical_devices = logical_devices.LogicalDevices(
        options.mesh.device_groups, options.mesh.size("stage"))
    self.communicator = communicator_lib.for_topology(
        [group[0] for group in self.logical_devices.groups], all_reduce,
        cluster, timeout_seconds, options.sync.groups)
    self.variable_partitioner = options.sharding.partitioner(
        self.communicator.num_replicas)
    self._devices = self.communicator.devices
    tfi.set_default_device(self, self.communicator.default_device)
    # Partial final batches: a replica may get fewer (or no) examples.
    self.experimental_enable_get_next_as_optional = True
    logging.info("ReplicatorStrategy: %s", self.communicator.describe())

  @property
  def model_layouts(self):
    """The layout map as read (`layouts.ModelLayouts`), or None."""
    return self.options.layouts

  @property
  def cluster(self):
    """The workers (a `replicator_strategy.cluster.config.Cluster`), or None alone."""
    return self.communicator.cluster

  @property
  def num_workers(self):
    return self.communicator.num_workers

  @property
  def num_sync_groups(self):
    """How many sync groups the replicas form (1: all in sync)."""
    return self.communicator.num_sync_groups

  @property
  def num_replicas_in_all_groups(self):
    """Every replica of every sync group: the replicas a global batch is
    split among."""
    return self.communicator.num_replicas * self.communicator.num_sync_groups

  @property
  def deals_worker_slices(self):
    """Whether each worker reads every global batch and keeps its replicas'
    parts, contiguous in global replica order (`global_batch_input`): with
    sync groups across workers, so that a group trains on the rows it would
    in one process. TF's input deals the parts round-robin over workers."""
    return self.num_workers > 1 and self.num_sync_groups > 1

  @property
  def first_replica_id(self):
    """The global replica id of this worker's first replica."""
    return self.communicator.first_replica_id

  @property
  def host_device(self):
    return self.communicator.host_device

  @property
  def all_reduce_choice(self):
    """Which all-reduce the strategy uses, and why."""
    return self.communicator.all_reduce_choice

  # Replica execution.

  def _call_for_each_replica(self, fn, args, kwargs):
    if self.model_layouts is not None:
      self.model_layouts.warn_unmatched_keys()
    return replica_runner.call_for_each_replica(
        tfi.container_strategy(self), fn, args, kwargs)

  def _use_merge_call(self):
    # TF and Keras ask this before every merge_call they could avoid; inside
    # control flow they then call `_replica_ctx_all_reduce` and
    # `_replica_ctx_update` directly, served below by per-replica collectives.
    return replica_context.merge_call_possible()

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    if self._use_merge_call():
      return tfi.base_replica_ctx_all_reduce(self, reduce_op, value, options)
    # Inside a replica's control flow: its run-time collectives.
    return tf.distribute.get_replica_context().all_reduce(reduce_op, value)

  def _replica_ctx_update(self, var, fn, args, kwargs, group):
    if self._use_merge_call():
      return tfi.base_replica_ctx_update(self, var, fn, args, kwargs, group)
    # Every replica holds the same (all-reduced) arguments, so each updates
    # its own component and the components stay identical. Distributed
    # variables read inside read as that component (a sharded one: its shard).
    local_index = tf.distribute.get_replica_context().local_index
    if isinstance(var, sharded_parts.ShardedSplitVariable):
      return var.update_own_shards(local_index, fn, *args, **kwargs)
    if isinstance(var, split_variables.SplitVariable):
      return split_variables.update_replica(var, local_index, fn, args, kwargs)
    if isinstance(var, tfi.values.DistributedVariable):
      var = tfi.component(var, local_index)
    with tf.device(var.device), tfi.UpdateContext(local_index), tf.name_scope(
        f"update_{local_index}"):
      return fn(var, *args, **kwargs)

  def _get_local_replica_id(self, replica_id_in_sync_group):
    return replica_id_in_sync_group - self.first_replica_id

  def _get_replica_id_in_sync_group(self, replica_id):
    return self.first_replica_id + replica_id

  # Variables.

  def _create_variable(self, next_creator, **kwargs):
    strategy = tfi.container_strategy(self)
    replica_sum = kwargs.pop(variables.REPLICA_SUM, False)
    request = kwargs.pop(sharding.SLOT_REQUEST, None)
    axis, batch_axis = self._layout_axes(kwargs)
    placed = sharded_parts.create(
        strategy, next_creator, request, axis, batch_axis,
        variables.piecewise_class(strategy, sharded_parts.ShardedSplitVariable),
        **kwargs)
    if placed is None:
      placed = sharding.create(
          strategy, next_creator, request, batch_axis,
          variables.piecewise_class(strategy,
                                    sharded_variables.ShardedVariable),
          **kwargs)
    if placed is not None:
      return placed
    if axis is not None:
      return split_variables.create(
          strategy, next_creator, axis,
          on_read=variables.SplitReplicaSum if replica_sum else None,
          on_write=variables.piecewise_class(
              strategy, split_variables.SplitVariable), **kwargs)
    return variables.create(strategy, self.logical_devices.variable_devices(),
                            next_creator, replica_sum=replica_sum, **kwargs)

  def _layout_axes(self, kwargs):
    """(where the model axis splits the new variable, where the batch axis
    shards it), as the layout map says (a slot: split as its weight)."""
    colocate_with = kwargs.get("colocate_with")
    if isinstance(colocate_with, split_variables.SplitVariable):
      return colocate_with.axis, None
    if (self.model_layouts is None or colocate_with is not None or
        kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ):
      return None, None
    keras_variable = layouts.variable_being_created()
    if keras_variable is None:
      return None, None
    return (layouts.placement_given() or
            self.model_layouts.placement(*keras_variable))

  def _validate_colocate_with_variable(self, colocate_with_variable):
    _utils.validate_colocate_distributed_variable(colocate_with_variable, self)

  def read_var(self, replica_local_var):
    if _utils.is_sync_on_read(replica_local_var):
      return tfi.cross_replica_value(replica_local_var)
    return tf.identity(tfi.current_component(replica_local_var))

  def value_container(self, val):
    container = _utils.value_container(val)
    if isinstance(container, split_variables.SplitVariable):
      return val  # A part: a gradient tape watches each part by its handle.
    return container

  def _update(self, var, fn, args, kwargs, group):
    if not isinstance(var, tfi.values.DistributedVariable):
      raise ValueError(
          f"ReplicatorStrategy was asked to update {var.name!r}, a variable "
          f"created outside `strategy.scope()`: it lives on one device, not "
          f"on each replica's, so the replicas cannot train it. Create the "
          f"model and its optimizer inside the scope: `with strategy.scope(): "
          f"model = ...; model.compile(...)`, then `model.fit(...)` (a model "
          f"loaded or built outside can be rebuilt inside and given its "
          f"weights with `set_weights`).")
    if isinstance(var, split_variables.SplitVariable):
      return _utils.update_regroup(
          self, split_variables.update(var, fn, args, kwargs), group)
    return self._update_per_device(
        [(v.device, v) for v in var.values], fn, args, kwargs, group)

  def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
    return self._update_per_device([(d, None) for d in colocate_with], fn,
                                   args, kwargs, group)

  def _update_per_device(self, targets, fn, args, kwargs, group):
    updates = []
    for i, (device, component) in enumerate(targets):
      leading = () if component is None else (component,)
      with tf.device(device), tfi.UpdateContext(i), tf.name_scope(
          f"update_{i}"):
        updates.append(
            fn(*leading, *_utils.select_replica(i, args),
               **_utils.select_replica(i, kwargs)))
    return _utils.update_regroup(self, updates, group)

  def non_slot_devices(self, var_list):
    del var_list
    return self._devices

  # Reductions and broadcasts.

  def _reduce_to(self, reduce_op, value, destinations, options):
    def reduce_one(v):
      if _utils.is_mirrored(v) and reduce_op == tf.distribute.ReduceOp.MEAN:
        return v
      if not isinstance(v, tfi.values.DistributedValues):
        return self.communicator.reduce_plain(reduce_op, v, destinations,
                                              options)
      return self.communicator.ops_for(v, destinations).reduce(
          reduce_op, v, destinations=destinations, options=options)

    return tf.nest.map_structure(reduce_one, value)

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    if len(self._devices) == 1:
      value_destination_pairs = [_as_one_replica(v, d)
                                 for v, d in value_destination_pairs]
    values = [v for v, _ in value_destination_pairs]
    ops = self.communicator.cross_device_ops
    if all(
        isinstance(v, tfi.values.PerReplica) and
        self.communicator.ops_for(v, d) is ops and tfi.devices_match(v, d)
        for v, d in value_destination_pairs):
      return packing.batch_reduce(ops, reduce_op, values,
                                  packing.bucket_bytes(options), options)
    if all(self.communicator.ops_for(v, d) is ops
           for v, d in value_destination_pairs):
      return ops.batch_reduce(reduce_op, value_destination_pairs,
                              options=options)
    return [self._reduce_to(reduce_op, v, d, options)
            for v, d in value_destination_pairs]

  def _gather_to_implementation(self, value, destinations, axis, options):
    if not isinstance(value, tfi.values.DistributedValues):
      return self.communicator.gather_plain(value, destinations, axis, options)
    return tfi.gather(self.communicator.gather_ops, value, destinations, axis,
                      options)

  @tfi.autograph.do_not_convert
  def reduce_extremum_to(self, op, value, destinations):
    """MIN or MAX of a per-replica `value` over every replica, on `destinations`.

    Gathers each replica's value (one collective across workers) and reduces
    the stack, so it works wherever `gather` does. A plain tensor is every
    replica's value in one process, this worker's across workers.
    """
    if isinstance(value, tfi.values.DistributedValues):
      value = _utils.regroup([tf.expand_dims(v, 0) for v in value.values],
                             always_wrap=True)
    else:
      value = tf.expand_dims(value, 0)
    stacked = self._gather_to_implementation(value, destinations, 0, None)
    return _utils.regroup([
        reduce_op_lib.reduce_along(op, part, 0)
        for part in tfi.container_strategy(self).experimental_local_results(
            stacked)])

  def _broadcast_to(self, tensor, destinations):
    if isinstance(tensor, (float, int)):
      return tensor  # Converted later, to the destination variable's dtype.
    if destinations is None:
      destinations = self._devices
    return self.communicator.ops_for(tensor, None).broadcast(tensor, destinations)

  # Input: see `input_distribution`.

  def _input_workers_with_options(self, options=None):
    return input_distribution.input_workers(self, options)

  @property
  def _input_workers(self):
    return self._input_workers_with_options()

  def _experimental_distribute_dataset(self, dataset, options):
    return input_distribution.distribute_dataset(self, dataset, options)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    return input_distribution.distribute_datasets_from_function(
        self, dataset_fn, options)

  def _experimental_distribute_values_from_function(self, value_fn):
    return input_distribution.distribute_values_from_function(self, value_fn)

  def _experimental_make_numpy_dataset(self, numpy_input, session):
    return input_distribution.numpy_dataset(self, numpy_input, session)

  # Topology.

  @property
  def _num_replicas_in_sync(self):
    return self.communicator.num_replicas

  @property
  def worker_devices(self):
    return self._devices

  @property
  def worker_devices_by_replica(self):
    return [list(g) for g in self.logical_devices.groups]

  @property
  def parameter_devices(self):
    return self._devices

  def _in_multi_worker_mode(self):
    return self.num_workers > 1

  @property
  def experimental_between_graph(self):
    return self.num_workers > 1

  @property
  def experimental_should_init(self):
    return True

  @property
  def is_chief(self):
    return self.communicator.is_chief

  @property
  def should_checkpoint(self):
    return self.is_chief

  @property
  def should_save_summary(self):
    return self.is_chief

  @property
  def _global_batch_size(self):
    return True


def _as_one_replica(value, destinations):
  """A value of this worker's one replica as a PerReplica, with a destination.

  With one local replica, merge_call hands its values over unwrapped, and a
  replica-context all-reduce names as destination the device the value had
  when it was made: none ("") where no device scope was set.
  """
  if tf.is_tensor(value) and not isinstance(value,
                                            tfi.values.DistributedValues):
    value = tfi.distribute_utils.regroup([value], always_wrap=True)
  if not tfi.cross_device_ops.check_destinations(destinations):
    destinations = value
  return value, destinations

