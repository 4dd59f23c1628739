"""`ReplicatorStrategy`: single-device code, replicated over every local device.

The class's docstring opens with an example. On several machines the same
script runs on each, with `TF_CONFIG` (or a cluster resolver) saying which
worker it is; see docs/multi-worker.md.

TF-Replicator (Buchlovsky et al., 2019, arXiv:1902.00465) rebuilt as a
`tf.distribute.Strategy`.
"""

import math
import numbers

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.cluster import config as cluster_lib
from replicator_strategy.collectives import checks
from replicator_strategy.collectives import watchdog as collective_watchdog
from replicator_strategy import extended as extended_lib
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy import mesh as mesh_lib
from replicator_strategy import options as options_lib
from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.cluster import runtime as worker_runtime
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import tpu_names
from replicator_strategy.sync_groups import rounds

# TF turns the timeout into int64 microseconds (collective ops, through a
# float32) and int64 nanoseconds of a clock (heartbeats), which overflow past
# about 1e10 seconds. A billion seconds, about 31 years, stays clear of that
# and already means "never time out".
MAX_TIMEOUT_SECONDS = 10**9

# Each is called with every ReplicatorStrategy made. The package's loader
# adds the Keras patches' `hold` (they stay in place while a strategy lives),
# so this module does not import replicator_strategy.keras.
CREATION_HOOKS = []
# Holds the function that cuts a Keras model into a strategy's pipeline
# stages and places them (the loader adds `keras.stage_placement.stages_of`).
PIPELINE_STAGES = []
# Each is called as hook(strategy, scope) by `ReplicatorStrategy.scope()` and
# returns the scope to hand out (the loader adds the Keras distribution's
# check of a scope opened while `keras.distribution` has one set).
SCOPE_HOOKS = []


class ReplicatorStrategy(tf.distribute.Strategy):
  """Synchronous data-parallel replication over local devices and workers.

  >>> import keras
  >>> import numpy as np
  >>> import replicator_strategy as rs
  >>> rs.split_cpu(4)                     # no GPU here: 4 logical CPUs
  >>> strategy = rs.ReplicatorStrategy()  # every GPU, else every logical CPU
  >>> strategy.num_replicas_in_sync
  4
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  ...   model.compile("sgd", "mse")
  >>> x, y = np.ones((64, 3)), np.ones((64, 1))
  >>> history = model.fit(x, y, batch_size=16, verbose=0)  # 4 rows a replica

  Without a GPU and without `split_cpu`, the CPU is one device: one replica
  (a warning says so). `print(strategy)` shows the replicas, devices
  and all-reduce; `python -m replicator_strategy` what the default would use
  on this machine.

  Args:
    devices: this worker's devices to replicate over, one replica each: a
      list of device strings such as "/gpu:0", or of `tf.DeviceSpec`s.
      Default: every local GPU, or every logical CPU device when there is no
      GPU. Every worker must have as many.
    all_reduce: "auto" (default: picked for the topology, see
      `replicator_strategy.collectives.all_reduce`), "add_on_one_device", "nccl",
      "hierarchical_copy", "ring" (names in any case), or a
      `tf.distribute.CrossDeviceOps`.
      "nccl" needs GPUs and a TensorFlow built with NCCL, "hierarchical_copy"
      an even number of devices. Across workers: "auto" or "ring".
    cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
      describing the workers. Default: `TF_CONFIG` when set, else this
      machine alone.
    timeout_seconds: across workers, how long to wait for a worker (to
      start, to answer a heartbeat, to join a collective) before failing;
      within one worker, for a replica to join a collective inside control
      flow. A finite number of seconds, at most 1e9 (about 31 years).
    shard_optimizer_state: hold each Keras optimizer slot once, a 1/N slice
      on each replica (across workers too), and update each slice on its
      replica (ZeRO stages 1 and 2, see docs/sharding.md); with sync
      groups, each group's slots, 1/n on each of its n replicas. Default
      False: every replica holds every slot.
    variable_partitioner: shard trainable variables along axis 0 over the
      replicas (ZeRO stage 3, big embedding tables; see docs/sharding.md):
      a callable `(shape, dtype) -> list of shards per axis`, such as TF's
      `tf.distribute.experimental.partitioners.FixedShardsPartitioner`,
      `MinSizePartitioner` or `MaxSizePartitioner`. A variable it cuts into
      k > 1 shards gets one shard on each of the first min(k, N) replicas
      (the rest hold none; with sync groups, N is a group's replicas and
      each group holds its own); its optimizer state is sharded alike.
      Default None: no variable is sharded.
    gradient_compression: None (default), "bfloat16" or "float16" (any
      case): the Keras optimizer's gradient all-reduce sends float32
      gradients as 16-bit floats and sums them so, half the bytes; the
      update itself is float32 (see `replicator_strategy.collectives.compression`
      for the precision). With `shard_optimizer_state=True`, the gradients'
      reduce-scatter is 16-bit so too; with `variable_partitioner`, the
      sharded weights' gradient exchange (a reduce-scatter, or for an
      `Embedding` table an all-gather of the looked-up rows' gradients).
    devices_per_replica: how many of this worker's devices each replica
      spans (model parallelism, see
      `replicator_strategy.model_parallel.logical_devices`): replica r owns
      devices r*k ... r*k+k-1, in order. Default 1.
    layout_map: a `keras.distribution.LayoutMap` over a 2-D
      `keras.distribution.DeviceMesh` of this worker's devices: its batch
      axis the replicas, its other axis each replica's devices; the weights
      it matches are split over them (see docs/model-parallel.md and
      `replicator_strategy.model_parallel.layouts`). Replaces `devices`.
    batch_dim_name: the mesh axis of `layout_map` that is the replicas.
      Default: the mesh's first axis.
    sync_groups: how many sync groups the replicas form (TF-Replicator's
      hybrid regime, see docs/sync-groups.md): groups of equal size,
      contiguous in global replica order and each within one worker, every
      exchange a step asks for (all-reduce, gather, broadcast, merge, the
      Keras gradient sum) spanning its group only. `num_replicas_in_sync`
      is then one group's replicas, `num_sync_groups` the groups. Composes
      with `shard_optimizer_state` and `variable_partitioner` (each group
      shards over its own replicas) and with `devices_per_replica` or
      `layout_map` (a replica spans its devices in any group). Default 1:
      every replica in sync.
    average_every: with sync_groups > 1, every how many steps the groups
      average their weights (an averaging round, `average_sync_groups`);
      Keras's `fit` counts its steps, and ends with a round. Default 1 (any
      other value needs sync_groups > 1).
    outer_optimizer: with sync_groups > 1, None (default: a round sets the
      mean) or a Keras optimizer that a round applies the change since the
      last round through (`old - mean` as the gradient; DiLoCo), such as
      `keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)`.
    overlap_averaging: with sync_groups > 1, True: a round snapshots the
      weights and exchanges them in a thread while the groups take the next
      average_every steps, and the next round applies the result, one round
      late (Streaming DiLoCo's overlap). Default False: a round exchanges
      and applies at once (True needs sync_groups > 1).
  """

  def __init__(self, devices=None, all_reduce="auto", cluster_resolver=None,
               timeout_seconds=collective_watchdog.DEFAULT_TIMEOUT_SECONDS,
               shard_optimizer_state=False, variable_partitioner=None,
               gradient_compression=None, devices_per_replica=1,
               layout_map=None, batch_dim_name=None, sync_groups=1,
               average_every=1, outer_optimizer=None,
               overlap_averaging=False, *, mesh=None, sharding=None, sync=None,
               axis_roles=None, pipeline=None):
    _check_timeout(timeout_seconds)
    compression_lib.wire_dtype(gradient_compression)  # Checks the name.
    sharding = options_lib.record(sharding, options_lib.Sharding, "sharding",
                       optimizer_state=("shard_optimizer_state",
                                        shard_optimizer_state),
                       weights=("variable_partitioner", variable_partitioner))
    sync = options_lib.record(sync, options_lib.SyncGroups, "sync",
                   groups=("sync_groups", sync_groups),
                   average_every=("average_every", average_every),
                   outer_optimizer=("outer_optimizer", outer_optimizer),
                   overlap=("overlap_averaging", overlap_averaging))
    cluster = (cluster_lib.from_resolver(cluster_resolver)
               if cluster_resolver is not None else
               cluster_lib.from_environment())
    if cluster:
      worker_runtime.start(cluster, timeout_seconds)
    model_layouts = (layouts.ModelLayouts(layout_map, batch_dim_name,
                                          axis_roles)
                     if layout_map is not None else None)
    if pipeline is not None and not isinstance(pipeline, options_lib.Pipeline):
      raise ValueError(
          f"Expected `pipeline` to be None or a replicator_strategy.Pipeline, "
          f"such as rs.Pipeline(stages=2, microbatches=4). Received: "
          f"pipeline={pipeline!r}.")
    the_mesh, sync, pipeline = mesh_lib.build(
        mesh, axis_roles, batch_dim_name, devices, devices_per_replica,
        model_layouts, sync, cluster.num_workers if cluster else 1, pipeline)
    options = options_lib.StrategyOptions(
        mesh=the_mesh, sharding=sharding, sync=sync,
        gradient_compression=gradient_compression, layouts=model_layouts,
        pipeline=pipeline)
    super().__init__(extended_lib.ReplicatorExtended(
        self, options, all_reduce, cluster, timeout_seconds))
    self.averaging = rounds.Averaging(
        self, sync.average_every, sync.outer_optimizer, overlap=sync.overlap,
        outer_dtype=sync.outer_dtype, fragments=sync.fragments)
    for hook in CREATION_HOOKS:
      hook(self)

  def scope(self):
    """The strategy's scope: `with strategy.scope():` builds models for it."""
    scope = super().scope()
    for hook in SCOPE_HOOKS:
      scope = hook(self, scope)
    return scope

  @property
  def shard_optimizer_state(self):
    """Whether optimizer slots are sharded over the replicas
    (`options.Sharding.optimizer_state`)."""
    return self.extended.options.sharding.optimizer_state

  @property
  def gradient_compression(self):
    """The 16-bit dtype gradients travel as, or None."""
    return self.extended.options.gradient_compression

  @property
  def mesh(self):
    """The device mesh (`replicator_strategy.mesh.Mesh`): axes by role.

    >>> print(ReplicatorStrategy(devices_per_replica=2).mesh)
    batch 2 x model 2
    """
    return self.extended.options.mesh

  @property
  def num_sync_groups(self):
    """How many sync groups the replicas form; 1 when all are in sync.

    >>> ReplicatorStrategy(sync_groups=2).num_sync_groups  # 4 replicas here
    2
    """
    return self.extended.num_sync_groups

  @property
  def average_every(self):
    """Steps between averaging rounds of the sync groups."""
    return self.averaging.average_every

  @property
  def sync_groups_state(self):
    """What a checkpoint keeps of the rounds between sync groups: the outer
    optimizer's state, the weights at the last round and an overlapped
    round's exchange in flight (`replicator_strategy.sync_groups.state.
    SyncGroupsState`). Save it beside the model:
    `tf.train.Checkpoint(model=model, optimizer=optimizer,
    sync_groups=strategy.sync_groups_state)`; `BackupAndRestore` does."""
    return self.averaging.state

  def average_sync_groups(self, trainable_variables,
                          non_trainable_variables=()):
    """An averaging round now, between every sync group (call it eagerly).

    Every replica then holds the mean of each of `trainable_variables` over
    every replica (or, with `outer_optimizer`, the outer step from it), and
    the mean of each float variable of `non_trainable_variables` (batch
    norm's moving statistics). Keras variables or distributed TF ones.
    Nothing to do with one group. With `overlap_averaging`, the exchange
    in flight is applied first.
    """
    self.averaging.average(trainable_variables, non_trainable_variables)

  def sync_groups_step(self, step, trainable_variables,
                       non_trainable_variables=()):
    """A custom loop's step counter: a round when `step` (the steps done,
    such as `optimizer.iterations`) is a positive multiple of
    `average_every`; returns whether it averaged. Call it once before the
    first step (step 0: with an outer optimizer, the weights' values then
    are the first round's `old`), then after each step. With
    `overlap_averaging`, a round applies the previous round's exchange and
    starts its own; `average_sync_groups` then ends with one model. With
    `SyncGroups(fragments=F)`, a round at each step a fragment is due
    averages that fragment only (`sync_groups.fragments`)."""
    step = int(tf.convert_to_tensor(step))  # Also a (Keras) variable.
    self.averaging.start(trainable_variables)
    if not (self.num_sync_groups > 1 and
            self.averaging.rounds_due(step - 1, step) and step > 0):
      return False
    self.averaging.scheduled_round(trainable_variables,
                                   non_trainable_variables, (step - 1, step))
    return True

  def pipeline_stages(self, model):
    """The Keras `model` cut into the stages of `ReplicatorStrategy(
    pipeline=...)`, each stage's variables moved to its devices (once:
    Keras's `fit`, `evaluate` and `predict` do it first otherwise); a tuple
    of `pipeline.stages.Stage`s."""
    return PIPELINE_STAGES[0](self, model)

  def logical_device_for_variables(self, logical_device_id):
    """Variables created inside live on each replica's `logical_device_id`.

    See `replicator_strategy.model_parallel.logical_devices`; with one device
    per replica only 0 is valid.
    """
    return self.extended.logical_devices.for_variables(logical_device_id)

  def experimental_assign_to_logical_device(self, tensor, logical_device_id):
    """TPUStrategy's name: `tensor`, copied to this replica's device
    `logical_device_id` (inside `strategy.run`)."""
    return tpu_names.assign_to_logical_device(self, tensor, logical_device_id)

  def experimental_replicate_to_logical_devices(self, tensor):
    """TPUStrategy's name: `tensor`, read whole on every logical device (each
    reading op gets its copy, as TensorFlow copies across devices)."""
    return tpu_names.replicate_to_logical_devices(self, tensor)

  def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
    """TPUStrategy's name: `tensor` held in parts, one per logical device,
    along the one dimension `partition_dimensions` splits (inside
    `strategy.run`). A row-parallel layer then takes the parts as they are;
    any other op reads the whole."""
    return tpu_names.split_to_logical_devices(self, tensor,
                                              partition_dimensions)

  def reduce(self, reduce_op, value, axis):
    """`tf.distribute.Strategy.reduce`, also with "min" and "max".

    >>> strategy = ReplicatorStrategy()  # 4 replicas here
    >>> def replica_id():
    ...   ctx = tf.distribute.get_replica_context()
    ...   return tf.cast(ctx.replica_id_in_sync_group, tf.float32)
    >>> float(strategy.reduce("max", strategy.run(replica_id), axis=None))
    3.0
    """
    op = reduce_op_lib.parse(reduce_op)
    checks.reject_none(value, "value", "strategy.reduce")
    axis = self._checked_axis(axis, value)
    if not op.is_extremum:
      return super().reduce(op.to_tf(), value, axis)

    def reduce_one(v):
      if axis is not None:
        parts = [reduce_op_lib.reduce_along(op, p, axis)
                 for p in self.experimental_local_results(v)]
        v = (tfi.distribute_utils.regroup(parts, always_wrap=True)
             if isinstance(v, tf.distribute.DistributedValues) else parts[0])
      # A plain tensor is every replica's value in one process; across
      # workers, this worker's value.
      reduced = self.extended.reduce_extremum_to(
          op, v, destinations=self.extended.host_device)
      return self.experimental_local_results(reduced)[0]

    return tf.nest.map_structure(reduce_one, value)

  def _checked_axis(self, axis, value):
    """`axis` for `reduce`: None or a Python int in range for every tensor.

    TF's own errors name `reduction_indices` (a string) or nothing (a tensor,
    a list), and its MEAN refuses NumPy ints.
    """
    if axis is None:
      return None
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
      raise TypeError(
          f"Expected `axis` given to strategy.reduce to be None (reduce "
          f"across replicas only) or an int: the axis of each replica's "
          f"tensor to reduce as well, usually 0, the batch. Received: "
          f"axis={axis!r} of type {type(axis).__name__}.")
    axis = int(axis)
    for path, leaf in tfi.nest.flatten_with_tuple_paths(value):
      shape = getattr(self.experimental_local_results(leaf)[0], "shape", None)
      rank = tf.TensorShape(shape).rank
      if rank is not None and not -rank <= axis < rank:
        where = "value" + "".join(f"[{key!r}]" for key in path)
        raise ValueError(
            f"Expected `axis` given to strategy.reduce to be in [-{rank}, "
            f"{rank}) for {where} of shape {shape} (each replica's), or "
            f"None. Received: axis={axis}.")
    return axis

  def __repr__(self):
    n = self.num_replicas_in_sync
    comm = self.extended.communicator
    workers = (f" over {comm.num_workers} workers, this is worker "
               f"{comm.worker_index}" if comm.num_workers > 1 else "")
    groups = (f" in each of {self.num_sync_groups} sync groups averaging "
              f"every {self.average_every} steps"
              if self.num_sync_groups > 1 else "")
    return (f"ReplicatorStrategy({n} replica{'s' if n > 1 else ''}{groups}"
            f"{workers}: {', '.join(self.extended.worker_devices)}; mesh "
            f"{self.mesh}; all-reduce "
            f"{self.extended.all_reduce_choice})")


def _check_timeout(timeout_seconds):
  # bool is an int to Python, but True seconds is surely a mistake.
  is_number = (isinstance(timeout_seconds, numbers.Real) and
               not isinstance(timeout_seconds, bool))
  if not (is_number and math.isfinite(timeout_seconds) and
          0 < timeout_seconds <= MAX_TIMEOUT_SECONDS):
    raise ValueError(
        f"Expected `timeout_seconds` to be a finite number of seconds in "
        f"(0, {MAX_TIMEOUT_SECONDS}]. Received: timeout_seconds="
        f"{timeout_seconds!r}. For a timeout that never fires in practice, "
        f"pass timeout_seconds={MAX_TIMEOUT_SECONDS} (about 31 years).")


