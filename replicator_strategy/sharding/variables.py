"""Variables held once across the replicas, a shard on each (ZeRO 3, big tables).

A `ShardedVariable` is one distributed variable whose component on the
device of global replica g is shard g of the whole, as its `layout` (a
`layout.Layout`) cuts it (across workers, each worker holds its own
replicas' shards). Its memory per device is about 1/N of the whole. How it reads depends on where:

- in cross-replica context (outside `strategy.run`, saving, `numpy()`): the
  whole variable, assembled from every shard, and a whole-shaped assignment
  sets every shard;
- inside an update for replica r (`strategy.extended.update`, the
  optimizer's step): shard r, so an optimizer's elementwise math runs on
  shards unchanged;
- inside a replica (`strategy.run`), as `replica_reads` says: "whole" (model
  weights: an all-gather, whose gradient is a reduce-scatter, so replica r's
  gradient is shard r of the summed gradient; inside a while loop, as an
  RNN's, gathered before the loop), "shard" (optimizer state of a
  sharded weight) or None (refused: optimizer state of a mirrored weight,
  see `optimizer_state`).

`ReplicatorStrategy(variable_partitioner=...)` shards the trainable
variables that TF's partitioners cut along axis 0 (`layout.RowLayout`);
their optimizer slots follow (`creation` decides which variables are
sharded). `lookup` reads only the rows a batch needs from a sharded table.

>>> from replicator_strategy import ReplicatorStrategy
>>> partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(4)
>>> strategy = ReplicatorStrategy(variable_partitioner=partitioner)
>>> with strategy.scope():
...   table = tf.Variable(tf.zeros([10, 2]))
>>> [c.shape.as_list() for c in table.values]
[[3, 2], [3, 2], [2, 2], [2, 2]]
"""

from absl import logging
import numpy as np
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy.collectives import per_replica
from replicator_strategy import options as options_lib
from replicator_strategy import warn_once
from replicator_strategy.sharding import exchange


class PiecewiseVariable(tfi.values.DistributedVariable):
  """A distributed variable whose components are pieces of one whole.

  It has the whole's shape (`whole_shape`), and reads, converts and prints as
  what its subclass's `_get` gives where it is read. `ShardedVariable` and
  `model_parallel.split_variables.SplitVariable` are the two kinds.
  """

  whole_shape = ()
  _stand_in = None

  @property
  def shape(self):
    return tf.TensorShape(self.whole_shape)

  def get_shape(self):
    return self.shape

  def _get(self):
    raise NotImplementedError("Each kind reads the pieces its own way.")

  def _get_on_device_or_primary(self):
    return self._read()

  def value(self):
    return tf.convert_to_tensor(self._read())

  def _read(self):
    if tfi.values_util.is_saving_non_distributed():
      return self._saved_model_stand_in()
    return self._get()

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    if tfi.values_util.is_saving_non_distributed():
      return tf.convert_to_tensor(self._saved_model_stand_in(), dtype=dtype,
                                  name=name)
    return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)

  def _saved_model_stand_in(self):
    """The one whole variable that a SavedModel's functions read instead.

    TF would export the first piece alone. The stand-in holds no value: a
    SavedModel takes its values from this variable's checkpoint (whole).
    """
    if self._stand_in is None:
      with tf.init_scope(), tf.device(self.values[0].device):
        self._stand_in = tfi.uninitialized_variable(
            self.shape, self.dtype, self.name.split(":")[0], self.trainable)
    return self._stand_in

  def _export_to_saved_model_graph(self, object_map=None, tensor_map=None,
                                   options=None, **kwargs):
    stand_in = self._saved_model_stand_in()
    resources = tfi.export_to_saved_model_graph(
        stand_in, object_map=object_map, tensor_map=tensor_map,
        options=options, **kwargs)
    object_map[self] = object_map[stand_in]
    return resources

  def __array__(self, dtype=None, copy=None):
    del copy  # A read is a copy already.
    return np.asarray(self.numpy(), dtype=dtype)

  def _as_graph_element(self):
    return None  # No single graph element holds the whole value.


def shard_index(first_shard, local_index, num_shards):
  """The shard local replica `local_index` holds: its global replica id,
  counted within its sync group (each group holds every shard, over its own
  replicas), where `first_shard` is this worker's first replica's id."""
  return (first_shard + local_index) % num_shards


class ShardedVariable(PiecewiseVariable):
  """A variable whose component r is shard `shard_index(r)`, on device r.

  `layout` is a `layout.Layout`; `replica_reads` is "whole", "shard" or None
  (see the module docstring for how it reads in each context);
  `logical_device`: the replicas' logical device the shards are on. Under
  sync groups each group holds its own shards, read and assigned whole in
  cross-replica context as the first group's.
  """

  def __init__(self, strategy, values, aggregation, layout, first_shard,
               replica_reads, logical_device=0):
    self.layout = layout
    self.logical_device = logical_device
    self.whole_shape = layout.shape
    self.first_shard = first_shard
    self.replica_reads = replica_reads
    super().__init__(strategy, values, aggregation)

  @property
  def shard_devices(self):
    return tuple(component.device for component in self.values)

  def shard_index(self, local_index):
    """The shard that component `local_index` holds."""
    return shard_index(self.first_shard, local_index, self.layout.num_shards)

  def _get_cross_replica(self):
    shards = [c.read_value() for c in self.values]
    if len(shards) >= self.layout.num_shards:  # A group's (the first's) here.
      return self.layout.assemble(shards[:self.layout.num_shards])
    # The other shards are on other workers.
    padded = [self.layout.pad(s, self.shard_index(r))
              for r, s in enumerate(shards)]
    gathered = self.distribute_strategy.extended.communicator.all_gather(
        per_replica.wrap(padded), axis=self.layout.axis)
    return self.layout.assemble_padded(per_replica.parts(gathered)[0])

  def _get(self):
    shard = tfi.distribute_lib.get_update_replica_id()
    if shard is not None:
      return self.values[shard]
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not self.distribute_strategy:
      return self._get_cross_replica()
    if self.replica_reads is None:
      raise ValueError(
          f"The optimizer slot {self.name} is sharded over the replicas "
          f"(shard_optimizer_state=True): each replica holds 1/N of it, so "
          f"it cannot be read inside `strategy.run`. Read it outside "
          f"`strategy.run` (the whole slot), or create the strategy with "
          f"shard_optimizer_state=False.")
    local = ctx.local_index
    if self.replica_reads == "shard":
      return self.values[local]
    return ctx.outside_loops(lambda: gather_whole(
        ctx, self.layout, self.values[local].read_value(),
        self.shard_index(local), self.logical_device))

  def own_shards(self, whole, local_replica):
    """Replica `local_replica`'s shard of a whole-shaped tensor (the shape of
    its gradient)."""
    return self.layout.shard(whole, self.shard_index(local_replica))

  def gather_own_shards(self, ctx, value):
    """The whole, in replica context, from every replica's `own_shards`."""
    shard = self.shard_index(ctx.local_index)
    return self.layout.assemble_padded(exchange.all_gather(
        ctx, self.layout.pad(value, shard), self.layout.axis,
        self.logical_device))

  def update_own_shards(self, local_replica, fn, *args, **kwargs):
    """`fn(shard, *args, **kwargs)` for replica `local_replica`'s shard, on
    its device, in its update context."""
    component = self.values[local_replica]
    with tf.device(component.device), tfi.UpdateContext(local_replica):
      return fn(component, *args, **kwargs)

  def _update_cross_replica(self, update_fn, value, **kwargs):
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    updates = []
    for index, component in enumerate(self.values):
      with tf.device(component.device):
        updates.append(update_fn(
            component, self.layout.shard(value, self.shard_index(index)),
            **kwargs))
    return tf.group(updates)

  def _update_replica(self, update_fn, value, **kwargs):
    shard = tfi.distribute_lib.get_update_replica_id()
    if shard is not None:  # An update step, run for each replica.
      return update_fn(self.values[shard], value, **kwargs)
    if self.replica_reads is None:
      raise NotImplementedError(
          f"The sharded optimizer slot {self.name} can be updated only by "
          f"its optimizer's step, or in cross-replica context (outside "
          f"`strategy.run`). Received an update from inside a replica. "
          f"Create the strategy with shard_optimizer_state=False to update "
          f"optimizer slots from replicas.")
    # Inside a replica: this replica's shard, given whole (as every replica
    # computes it) or as the shard itself (a gradient of this shard).
    local = tf.distribute.get_replica_context().local_index
    shard = self.shard_index(local)
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    if value.shape.as_list() == list(self.layout.shape):
      value = self.layout.shard(value, shard)
    elif value.shape.as_list() != list(self.layout.shard_shape(shard)):
      raise ValueError(
          f"Variable {self.name} is sharded over the replicas; inside a "
          f"replica it takes either its whole shape {list(self.layout.shape)} "
          f"or this replica's shard, of shape "
          f"{list(self.layout.shard_shape(shard))}. Received a value of shape "
          f"{value.shape}.")
    return update_fn(self.values[local], value, **kwargs)

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._get_cross_replica()}

  def _restore_from_tensors(self, restored_tensors):
    return self.assign(restored_tensors["VARIABLE_VALUE"])


def gather_whole(ctx, layout, shard_value, shard, logical_device=0):
  """The whole variable, in replica context, from this replica's shard (on
  its `logical_device`, where the whole lands too).

  Gradient: reduce-scatter, so this replica's shard gets its rows of the
  gradient summed over every replica (half the traffic of an all-reduce),
  sent and summed as 16-bit floats with the strategy's
  `gradient_compression`.
  """
  wire = _wire(ctx)
  axis = layout.axis

  @tfi.custom_gradient
  def gather(padded):
    def grad(dy):
      if isinstance(dy, tf.IndexedSlices):
        _warn_dense(layout.shape)
      return compression_lib.from_wire(exchange.reduce_scatter(
          ctx, compression_lib.to_wire(tf.convert_to_tensor(dy), wire), axis,
          logical_device), dy.dtype)
    return exchange.all_gather(ctx, padded, axis, logical_device), grad

  return layout.assemble_padded(gather(layout.pad(shard_value, shard)))


def _warn_dense(shape):
  """Warns, once per shape, that a sparse gradient of a gathered weight is
  made dense before its reduce-scatter."""
  if not _warned_dense(tuple(shape)):
    return
  logging.warning(
      "ReplicatorStrategy: a weight of shape %s, sharded over the replicas "
      "and read whole, gets a sparse gradient (an Embedding's table split "
      "by rows over a replica's devices, or sharded by columns, or read by a "
      "LoRA or quantized Embedding): it is made dense before its "
      "reduce-scatter. Optimizers that square the gradient or take its "
      "absolute value (Adam, Adagrad, ...) then treat rows looked up several "
      "times in a batch, and rows not looked up, otherwise than Keras on one "
      "device. Split the table by columns (None, 'model') and shard it by "
      "rows, or leave it unsplit: it then looks up only its rows and stays "
      "sparse.",
      list(shape))


_warned_dense = warn_once.Once()


def lookup(variable, ids):
  """Rows `ids` of a sharded table inside a replica: only those rows move.

  Every replica's ids are gathered; each replica picks the rows its shard
  holds (zeros for the others); a reduce-scatter sums the picks and hands
  each replica its own rows. Moves N x batch rows per replica, whatever the
  table's size; the gradient reaches each shard as the rows it gave.
  """
  ctx = tf.distribute.get_replica_context()
  local = ctx.local_index
  every_id, count = gather_ids(ctx, ids, variable.layout.shape[0])
  return lookup_in_shard(ctx, variable.layout, variable.values[local],
                         variable.shard_index(local), ids, every_id, count,
                         variable.logical_device)


def gather_ids(ctx, ids, num_rows):
  """Every replica's `ids`, checked and counted from 0 as rows of a table of
  `num_rows`, and how many of them are this replica's."""
  flat = tf.reshape(ids, [-1])
  count = tf.shape(flat)[0]
  most = ctx.all_reduce("max", count)
  return _checked_ids(ctx.all_gather(tf.pad(flat, [[0, most - count]]),
                                     axis=0), num_rows), count


def lookup_in_shard(ctx, layout, component, shard, ids, every_id, count,
                    logical_device=0):
  """This replica's rows `ids` of a table cut by rows (`layout`), of which
  `component` holds shard `shard`: each replica picks the rows of `every_id`
  its shard holds, on its `logical_device`, and the picks are
  reduce-scattered among those devices."""
  width = layout.shape[1:]
  with tf.device(component.device):
    if layout.rows[shard]:
      rows = every_id - tf.cast(layout.offsets[shard], every_id.dtype)
      held = (rows >= 0) & (rows < layout.rows[shard])
      picked = tf.gather(component, tf.where(held, rows, 0))
      picked = tf.where(tf.reshape(held, [-1] + [1] * len(width)), picked,
                        tf.zeros_like(picked))
    else:
      picked = tf.zeros(tf.concat([tf.shape(every_id), width], 0),
                        component.dtype)
  mine = _rows_to_their_replicas(ctx, picked, logical_device)[:count]
  return tf.reshape(mine, tf.concat([tf.shape(ids), width], 0))


def _rows_to_their_replicas(ctx, picked, logical_device):
  """The reduce-scatter of every replica's picks: each replica's own rows.

  Its gradient (each replica's rows' gradients, all-gathered to the shards
  that gave them) travels as 16-bit floats with the strategy's
  `gradient_compression`.
  """
  wire = _wire(ctx)
  if wire is None:
    return exchange.reduce_scatter(ctx, picked, 0, logical_device)

  @tfi.custom_gradient
  def scatter(picked):
    def grad(dy):
      return compression_lib.from_wire(exchange.all_gather(
          ctx, compression_lib.to_wire(dy, wire), 0, logical_device), dy.dtype)
    return exchange.reduce_scatter(ctx, picked, 0, logical_device), grad

  return scatter(picked)


def _wire(ctx):
  """The 16-bit dtype `ctx`'s strategy sends gradients as, or None."""
  options = options_lib.of(ctx.strategy)
  return compression_lib.wire_dtype(options and options.gradient_compression)


def _checked_ids(every_id, num_rows):
  """`every_id` as rows of the table, as Keras's lookup reads them.

  A negative id counts from the end (Keras's `ops.take`); one outside
  [-num_rows, num_rows) is an error, as on one CPU device, where a sharded
  table would otherwise return zeros. Every replica checks every replica's
  ids, so all of them stop together (none waits in a collective for one
  that stopped).
  """
  lowest, highest = tf.reduce_min(every_id), tf.reduce_max(every_id)
  check = tf.debugging.Assert(
      (lowest >= -num_rows) & (highest < num_rows),
      [f"Embedding ids must be rows of the table, in [-{num_rows}, "
       f"{num_rows}); received ids from", lowest, "to", highest])
  with tf.control_dependencies([check]):
    return tf.where(every_id < 0, every_id + num_rows, every_id)


def create(strategy, next_creator, layout_for, replica_reads, logical_device=0,
           variable_class=ShardedVariable, **kwargs):
  """A `ShardedVariable`, this worker's shards on its replicas' devices (each
  replica's `logical_device`).

  `layout_for(whole_initial_value)` gives the layout; every worker starts
  from the chief's initial value. Returns None where the layout is None.
  `variable_class`: `ShardedVariable` or a subclass (sync groups' saves).
  """
  kwargs.pop("colocate_with", None)  # Its shards go to every device.
  kwargs.pop("shape", None)
  communicator = strategy.extended.communicator
  devices = [group[logical_device]
             for group in strategy.extended.logical_devices.groups]
  with tf.init_scope(), tf.device(devices[0]):
    initial_value = communicator.initial_value(kwargs["initial_value"],
                                               kwargs.get("dtype"))
    whole = tf.convert_to_tensor(
        initial_value() if callable(initial_value) else initial_value,
        dtype=kwargs.get("dtype"))
  layout = layout_for(whole)
  if layout is None:
    return None
  first_shard = communicator.first_replica_id

  def create_shards(**kwargs):
    shards = []
    for index, device in enumerate(devices):
      with tf.device(device):
        kwargs["initial_value"] = layout.shard(
            whole, shard_index(first_shard, index, layout.num_shards))
        if index:
          kwargs["name"] = "{}/shard_{:d}/".format(
              shards[0].name.split(":")[0], index)
        with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
          with tfi.record.stop_recording():
            shards.append(next_creator(**kwargs))
    return shards

  def sharded_variable(strategy, values, aggregation):
    return variable_class(strategy, values, aggregation, layout, first_shard,
                          replica_reads, logical_device)

  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_shards,
      {tf.VariableSynchronization.ON_WRITE: sharded_variable},
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)
