"""`ReplicatorExtended`: the strategy's machinery behind `tf.distribute.Strategy`.

Everything TF and Keras reach through `strategy.extended` lives here:
variable creation, reductions, updates, input distribution and replica
execution. Subclasses TF's `StrategyExtendedV1`, the base every TF strategy
uses, because `Strategy.run` calls its `call_for_each_replica`.

>>> strategy = ReplicatorStrategy()
>>> strategy.extended.worker_devices
('/job:localhost/replica:0/task:0/device:CPU:0', ...)
"""

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import all_reduce as all_reduce_lib
from replicator_strategy import collective_watchdog
from replicator_strategy import collectives as collectives_lib
from replicator_strategy import packing
from replicator_strategy import reduce_op as reduce_op_lib
from replicator_strategy import replica_context
from replicator_strategy import sharded_optimizer_state
from replicator_strategy import variables

_utils = tfi.distribute_utils


class ReplicatorExtended(tfi.StrategyExtendedV1):
  """Replicates over `devices` of this worker, one replica per device.

  With a `cluster` (see `replicator_strategy.cluster`), every worker runs
  the same number of replicas; worker w holds global replicas
  w*M .. w*M+M-1 of N*M.
  """

  def __init__(self, container_strategy, devices, all_reduce, cluster=None,
               timeout_seconds=collectives_lib.TIMEOUT_SECONDS):
    super().__init__(container_strategy)
    self._devices = tuple(devices)
    self.cluster = cluster
    self.num_workers = cluster.num_workers if cluster else 1
    self.first_replica_id = (
        cluster.worker_index * len(self._devices) if cluster else 0)
    self.host_device = tfi.device_util.get_host_for_device(self._devices[0])
    self._cross_device_ops, self.all_reduce_choice = all_reduce_lib.choose(
        self._devices, all_reduce, num_workers=self.num_workers,
        timeout_seconds=timeout_seconds)
    self._host_reduce_ops = tf.distribute.ReductionToOneDevice()
    self.collectives = collectives_lib.ReplicaCollectives(
        self._devices, self._num_replicas_in_sync, timeout_seconds)
    if cluster:
      collective_watchdog.share_stalls_across_workers(cluster.worker_index,
                                                      cluster.num_workers)
      # A plain tensor in cross-replica context is this worker's value.
      self._worker_reduce_ops = all_reduce_lib.across_workers(
          self.host_device, self.num_workers, timeout_seconds)
      self.worker_broadcast = collectives_lib.WorkerBroadcast(
          self.host_device, cluster, timeout_seconds)
      # Ops without a device stay on this worker.
      self._default_device = cluster.task_name
      self._check_same_replicas_per_worker()
    # Partial final batches: a replica may get fewer (or no) examples.
    self.experimental_enable_get_next_as_optional = True
    self._use_var_policy = False
    logging.info("ReplicatorStrategy: %d replica(s) on %s%s; all-reduce %s",
                 len(self._devices), ", ".join(self._devices),
                 f" (worker {cluster.worker_index} of {cluster.num_workers})"
                 if cluster else "", self.all_reduce_choice)

  def _check_same_replicas_per_worker(self):
    """Fails every worker, clearly, unless all have as many devices."""
    with tf.device(self.host_device):
      counts = tfi.gather(self._worker_reduce_ops,
                          tf.constant([len(self._devices)]), self.host_device,
                          axis=0)
    counts = [int(c) for c in self._local_results(counts)[0]]
    if len(set(counts)) > 1:
      raise ValueError(
          f"Every worker must replicate over as many devices; they have "
          f"{', '.join(f'worker {i}: {n}' for i, n in enumerate(counts))}. "
          f"Give each worker the same `devices` count (or the same number "
          f"of GPUs / split_cpu devices).")

  # Replica execution.

  def _call_for_each_replica(self, fn, args, kwargs):
    return replica_context.call_for_each_replica(
        self._container_strategy(), fn, args, kwargs)

  def _use_merge_call(self):
    # TF and Keras ask this before every merge_call they could avoid; inside
    # control flow they then call `_replica_ctx_all_reduce` and
    # `_replica_ctx_update` directly, served below by per-replica collectives.
    return replica_context.merge_call_possible()

  def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
    if self._use_merge_call():
      return tfi.base_replica_ctx_all_reduce(self, reduce_op, value, options)
    ctx = tf.distribute.get_replica_context()
    flat = tf.nest.flatten(value)
    reduced = self.collectives.all_reduce(
        ctx.local_index, reduce_op_lib.parse(reduce_op), flat,
        ctx.collective_keys(len(flat)))
    return tf.nest.pack_sequence_as(value, reduced)

  def _replica_ctx_update(self, var, fn, args, kwargs, group):
    if self._use_merge_call():
      return tfi.base_replica_ctx_update(self, var, fn, args, kwargs, group)
    # Every replica holds the same (all-reduced) arguments, so each updates
    # its own component and the components stay identical.
    local_index = tf.distribute.get_replica_context().local_index
    if isinstance(var, tfi.values.DistributedVariable):
      var = tfi.component(var, local_index)
    with tf.device(var.device), tf.name_scope(f"update_{local_index}"):
      return fn(var, *args, **kwargs)

  def _get_local_replica_id(self, replica_id_in_sync_group):
    return replica_id_in_sync_group - self.first_replica_id

  def _get_replica_id_in_sync_group(self, replica_id):
    return self.first_replica_id + replica_id

  # Variables.

  def _create_variable(self, next_creator, **kwargs):
    if sharded_optimizer_state.creating_slot():
      return sharded_optimizer_state.create_slot(
          self._container_strategy(), self._devices, next_creator, **kwargs)
    return variables.create(self._container_strategy(), self._devices,
                            next_creator, **kwargs)

  def initial_value_from_chief(self, initial_value, dtype=None):
    """`initial_value` (a tensor or callable) as the chief computes it."""
    if not self.cluster:
      return initial_value
    return self.worker_broadcast.from_chief(initial_value, dtype)

  def _validate_colocate_with_variable(self, colocate_with_variable):
    _utils.validate_colocate_distributed_variable(colocate_with_variable, self)

  def read_var(self, replica_local_var):
    if _utils.is_sync_on_read(replica_local_var):
      return tfi.cross_replica_value(replica_local_var)
    return tf.identity(tfi.current_component(replica_local_var))

  def value_container(self, val):
    return _utils.value_container(val)

  def _update(self, var, fn, args, kwargs, group):
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

  def _ops_for(self, value, destinations):
    """The all-reduce algorithm, or the host path where it can't serve."""
    if self.cluster:
      return self._cross_device_ops  # Collectives reach every worker.
    parts = value.values if isinstance(value, tfi.values.DistributedValues) else (value,)
    if any(tf.as_dtype(p.dtype) == tf.int32 for p in parts):
      return self._host_reduce_ops  # NCCL cannot reduce int32.
    if destinations is not None and not tfi.devices_match(value, destinations):
      return self._host_reduce_ops
    return self._cross_device_ops

  def _reduce_to(self, reduce_op, value, destinations, options):
    def reduce_one(v):
      if _utils.is_mirrored(v) and reduce_op == tf.distribute.ReduceOp.MEAN:
        return v
      if not isinstance(v, tfi.values.DistributedValues) and self.cluster:
        return self._worker_reduce_ops.reduce(
            reduce_op, v, destinations=destinations, options=options)
      if not isinstance(v, tfi.values.DistributedValues):
        return tfi.cross_device_ops.reduce_non_distributed_value(
            reduce_op, v, destinations, self._num_replicas_in_sync)
      return self._ops_for(v, destinations).reduce(
          reduce_op, v, destinations=destinations, options=options)

    return tf.nest.map_structure(reduce_one, value)

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    if len(self._devices) == 1:
      value_destination_pairs = [_as_one_replica(v, d)
                                 for v, d in value_destination_pairs]
    values = [v for v, _ in value_destination_pairs]
    if all(
        isinstance(v, tfi.values.PerReplica) and
        self._ops_for(v, d) is self._cross_device_ops and
        tfi.devices_match(v, d)
        for v, d in value_destination_pairs):
      to_reduce, unpack = packing.pack(values)
      return unpack(self._cross_device_ops.batch_reduce(
          reduce_op, [(v, v) for v in to_reduce], options=options))
    if all(self._ops_for(v, d) is self._cross_device_ops
           for v, d in value_destination_pairs):
      return self._cross_device_ops.batch_reduce(
          reduce_op, value_destination_pairs, options=options)
    return [self._reduce_to(reduce_op, v, d, options)
            for v, d in value_destination_pairs]

  def _gather_to_implementation(self, value, destinations, axis, options):
    if not isinstance(value, tfi.values.DistributedValues):
      if self.cluster:  # This worker's value: gather every worker's.
        return tfi.gather(self._worker_reduce_ops, value, destinations, axis,
                          options)
      return value
    ops = self._cross_device_ops if self.cluster else self._host_reduce_ops
    return tfi.gather(ops, value, destinations, axis, options)

  @tfi.autograph.do_not_convert
  def reduce_extremum_to(self, op, value, destinations):
    """MIN or MAX of a per-replica `value` over every replica, on `destinations`.

    Gathers each replica's value (one collective across workers) and reduces
    the stack, so it works wherever `gather` does.
    """
    if isinstance(value, tfi.values.DistributedValues):
      parts = _utils.regroup([tf.expand_dims(v, 0) for v in value.values],
                             always_wrap=True)
    elif self.cluster:
      parts = tf.expand_dims(value, 0)  # This worker's value.
    else:
      return value
    stacked = self._gather_to(parts, destinations, axis=0)
    return _utils.regroup([
        reduce_op_lib.reduce_along(op, part, 0)
        for part in self._local_results(stacked)])

  def _broadcast_to(self, tensor, destinations):
    if isinstance(tensor, (float, int)):
      return tensor  # Converted later, to the destination variable's dtype.
    if destinations is None:
      destinations = self._devices
    return self._ops_for(tensor, None).broadcast(tensor, destinations)

  # Input.

  def _input_workers_with_options(self, options=None):
    compute = self._devices
    if options is not None and not options.experimental_fetch_to_device:
      compute = (self.host_device,) * len(self._devices)
    return tfi.input_lib.InputWorkers([(self.host_device, compute)])

  def _input_context(self):
    """This worker's input pipeline among every worker's."""
    return tf.distribute.InputContext(
        num_input_pipelines=self.num_workers,
        input_pipeline_id=self.cluster.worker_index if self.cluster else 0,
        num_replicas_in_sync=self._num_replicas_in_sync)

  @property
  def _input_workers(self):
    return self._input_workers_with_options()

  def _experimental_distribute_dataset(self, dataset, options):
    _reject_per_replica_mode(options, "experimental_distribute_dataset")
    if self._num_replicas_in_sync > 1:
      _reject_unbatched(dataset, self._num_replicas_in_sync)
    if self.cluster:
      _warn_if_not_sharded(dataset, self.num_workers)
    return tfi.input_util.get_distributed_dataset(
        dataset, self._input_workers_with_options(options),
        self._container_strategy(),
        num_replicas_in_sync=self._num_replicas_in_sync,
        input_context=self._input_context() if self.cluster else None,
        options=options)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    _reject_per_replica_mode(options, "distribute_datasets_from_function")
    return tfi.input_util.get_distributed_datasets_from_function(
        dataset_fn, self._input_workers_with_options(options),
        [self._input_context()], self._container_strategy(), options)

  def _experimental_distribute_values_from_function(self, value_fn):
    per_replica = []
    for i, device in enumerate(self._devices):
      with tf.device(device):
        per_replica.append(value_fn(tf.distribute.experimental.ValueContext(
            self.first_replica_id + i, self._num_replicas_in_sync)))
    return _utils.regroup(per_replica, always_wrap=True)

  def _experimental_make_numpy_dataset(self, numpy_input, session):
    return tfi.numpy_dataset.one_host_numpy_dataset(
        numpy_input, tfi.numpy_dataset.SingleDevice(self.host_device),
        session)

  # Topology.

  @property
  def _num_replicas_in_sync(self):
    return len(self._devices) * self.num_workers

  @property
  def worker_devices(self):
    return self._devices

  @property
  def worker_devices_by_replica(self):
    return [[d] for d in self._devices]

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
    return not self.cluster or self.cluster.is_chief

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


def _warn_if_not_sharded(dataset, num_workers):
  policy = dataset.options().experimental_distribute.auto_shard_policy
  if policy == tf.data.experimental.AutoShardPolicy.OFF:
    logging.warning(
        "The dataset given to ReplicatorStrategy.experimental_distribute_"
        "dataset has AutoShardPolicy.OFF: each of the %d workers reads all of "
        "it, so every example is seen %d times per epoch. Shard it yourself "
        "(dataset.shard) or use AutoShardPolicy.DATA or FILE.", num_workers,
        num_workers)


def _reject_unbatched(dataset, num_replicas):
  """Refuses scalar elements, which TF's rebatching fails on with an IndexError."""
  scalars = [
      "element" + "".join(f"[{key!r}]" for key in path)
      for path, spec in tfi.nest.flatten_with_tuple_paths(dataset.element_spec)
      if getattr(spec, "shape", None) is not None and spec.shape.rank == 0]
  if scalars:
    raise ValueError(
        f"experimental_distribute_dataset splits each element of the dataset "
        f"along its first dimension, the batch, among {num_replicas} "
        f"replicas, but this dataset has scalars with no such dimension "
        f"({', '.join(scalars)}): it looks unbatched. Received: element_spec="
        f"{dataset.element_spec}. Batch it with the global batch size "
        f"first: dataset.batch(global_batch_size).")


def _reject_per_replica_mode(options, api):
  if (options is not None and options.experimental_replication_mode ==
      tf.distribute.InputReplicationMode.PER_REPLICA):
    raise NotImplementedError(
        f"ReplicatorStrategy.{api} does not support "
        f"InputReplicationMode.PER_REPLICA yet. Use the default PER_WORKER "
        f"mode (leave experimental_replication_mode unset).")
