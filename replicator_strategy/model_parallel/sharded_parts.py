"""Weights split over each replica's devices and sharded over the replicas.

Tensor parallelism with ZeRO-3: a weight that a layout splits in k parts
over the model axis (a `split_variables.SplitVariable`) and shards over the
N replicas (`variable_partitioner`, or a layout that names the batch axis
too, as `("batch", "model")`) is a `ShardedSplitVariable`. Device j of
replica r holds shard r of part j (a `sharding.layout.RowLayout` of the
part), 1/(N k) of the weight, and so do its optimizer slots; with sync
groups, N is a group's replicas and r counts within the group. How it reads:

- in cross-replica context (saving, `numpy()`): the whole, from every shard
  (the first group's);
- inside the update of replica r's part j: its shard, so an optimizer's
  elementwise math runs on shards unchanged;
- inside replica r: each part gathered over the replicas on its own device j
  (`read_parts`, what the Megatron layers compute on), its gradient
  reduce-scattered there, so each shard gets its rows of the gradient
  summed over every replica. The gradient a tape gives is this replica's
  shards of the parts, side by side along the split axis (`own_shards`);
  `replicator_strategy.keras.sharded_weights` steps each shard with it.

An `Embedding` table split by columns and sharded by rows is not gathered:
each part looks up the batch's rows in its shards on its own device
(`lookup`), and its gradient stays sparse, as one device's does.

>>> import keras
>>> import replicator_strategy as rs
>>> mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"),
...                                      rs.split_cpu(4))
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["dense/kernel"] = ("batch", "model")
>>> with rs.ReplicatorStrategy(layout_map=layout_map).scope():
...   dense = keras.layers.Dense(6, name="dense")
...   dense.build((None, 4))
>>> [(c.shape.as_list(), c.device[-5:]) for c in dense.kernel.value.values]
[([2, 3], 'CPU:0'), ([2, 3], 'CPU:1'), ([2, 3], 'CPU:2'), ([2, 3], 'CPU:3')]
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.model_parallel import layouts
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.sharding import creation
from replicator_strategy.sharding import exchange
from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import variables as sharded_variables


class ShardedSplitVariable(split_variables.SplitVariable):
  """A `SplitVariable` whose component `r * k + j` is shard r of part j.

  `layout`: how a part is cut over the replicas (a `RowLayout` of the part's
  shape); `replica_reads`: "whole" (a weight: parts gathered inside a
  replica) or "shard" (optimizer state: this replica's shards).
  """

  def __init__(self, strategy, values, aggregation, axis, shape, path, layout,
               first_shard, replica_reads):
    self.layout = layout
    self.first_shard = first_shard
    self.replica_reads = replica_reads
    super().__init__(strategy, values, aggregation, axis, shape, path)

  def shard_index(self, local_replica):
    """The shard of each part that local replica `local_replica` holds
    (counted within its sync group)."""
    return sharded_variables.shard_index(self.first_shard, local_replica,
                                         self.layout.num_shards)

  def logical_device(self, local_replica, part):
    """The logical device that part `part` is on: with pipeline stages, a
    later stage's part j is not on logical device j. Its shards move among
    every replica's that device."""
    return self.distribute_strategy.extended.logical_devices.device_id(
        local_replica, self.parts(local_replica)[part].device)

  def read_parts(self, local_replica):
    """Replica `local_replica`'s parts, each gathered whole on its device."""
    ctx = tf.distribute.get_replica_context()
    shard = self.shard_index(local_replica)
    reads = []
    for j, component in enumerate(self.parts(local_replica)):
      with tf.device(component.device):
        reads.append(ctx.outside_loops(
            lambda c=component, j=j: sharded_variables.gather_whole(
                ctx, self.layout, c.read_value(), shard,
                logical_device=self.logical_device(local_replica, j))))
    return reads

  def _whole(self, local_replica):
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not self.distribute_strategy:
      return self._get_cross_replica()
    if self.replica_reads == "shard":
      return self._concat([c.read_value() for c in self.parts(local_replica)])
    return super()._whole(local_replica)

  def _get_cross_replica(self):
    k, n = self.num_parts, self.layout.num_shards
    parts = []
    for j in range(k):
      with tf.device(self.values[j].device):
        # Under sync groups, the first group's.
        parts.append(self.layout.assemble(
            [c.read_value() for c in self.values[j::k][:n]]))
    with tf.device(self.values[0].device):
      return tf.concat(parts, self.axis)

  def _concat(self, pieces):
    with tf.device(pieces[0].device):
      return tf.concat(pieces, self.axis)

  @property
  def handle(self):
    """Inside a replica, its shards' handles: their gradients (already
    summed over the replicas) side by side, as `own_shards` lays them."""
    ctx = tf.distribute.get_replica_context()
    if (tfi.distribute_lib.get_update_replica_id() is not None or
        ctx is None or ctx.strategy is not self.distribute_strategy):
      return super().handle
    shards = self.parts(ctx.local_index)
    return tfi.GradientOfParts([s.handle for s in shards],
                               lambda grads: self._side_by_side(grads, shards))

  def _side_by_side(self, grads, shards):
    """The shards' gradients laid out as `own_shards`; those of a `lookup`
    by columns (the same rows of every part) stay sparse."""
    if all(g is None for g in grads):
      return None
    if self.axis and all(isinstance(g, tf.IndexedSlices) for g in grads):
      shape = tf.concat([grads[0].dense_shape[:self.axis],
                         [sum(int(s.shape[self.axis]) for s in shards)],
                         grads[0].dense_shape[self.axis + 1:]], 0)
      return tf.IndexedSlices(self._concat([g.values for g in grads]),
                              grads[0].indices, shape)
    return self._concat([tf.zeros_like(s) if g is None else
                         tf.convert_to_tensor(g)
                         for g, s in zip(grads, shards)])

  def lookup(self, ids):
    """Rows `ids` of a table split by columns and sharded by rows, inside a
    replica: each part's rows picked from its shards and reduce-scattered
    on its own device, as `sharding.variables.lookup` does for a table;
    returns the parts (only the rows move, and the gradients stay sparse)."""
    ctx = tf.distribute.get_replica_context()
    local = ctx.local_index
    every_id, count = sharded_variables.gather_ids(ctx, ids, self.shape[0])
    return [
        sharded_variables.lookup_in_shard(
            ctx, self.layout, component, self.shard_index(local), ids,
            every_id, count, self.logical_device(local, j))
        for j, component in enumerate(self.parts(local))]

  @property
  def looks_up_rows(self):
    """Whether `lookup` serves this table: split by columns, sharded by rows."""
    return self.axis == 1 and self.layout.axis == 0 and len(self.shape) == 2

  def own_shards(self, whole, local_replica):
    """Replica `local_replica`'s shard of each part of a whole-shaped tensor,
    side by side along the split axis (the shape of its gradient)."""
    shard = self.shard_index(local_replica)
    return self._concat([self.layout.shard(part, shard)
                         for part in self._split(whole)])

  def gather_own_shards(self, ctx, value):
    """The whole, in replica context, from every replica's `own_shards`."""
    shard = self.shard_index(ctx.local_index)
    parts = []
    for j, (component, piece) in enumerate(zip(
        self.parts(ctx.local_index), self._split(value))):
      with tf.device(component.device):
        parts.append(self.layout.assemble_padded(exchange.all_gather(
            ctx, self.layout.pad(piece, shard), self.layout.axis,
            self.logical_device(ctx.local_index, j))))
    return self._concat(parts)

  def update_own_shards(self, local_replica, fn, *args, **kwargs):
    """`fn(shard, *args, **kwargs)` for each of replica `local_replica`'s
    shards, on its device, in its update context. A tensor argument laid out
    as `own_shards` gives (or of the whole's shape, is cut to give) each shard
    its piece; other arguments go to each shard as they are."""
    whole = self.shape.as_list()
    own = list(self.layout.shard_shape(self.shard_index(local_replica)))
    own[self.axis] *= self.num_parts

    def pieces(value):
      if isinstance(value, tf.IndexedSlices) and self.axis:  # A `lookup`'s.
        shape = tf.unstack(value.dense_shape)
        shape[self.axis] //= self.num_parts
        return [tf.IndexedSlices(v, value.indices, tf.stack(shape))
                for v in self._split(value.values)]
      if not isinstance(value, (tf.Tensor, tf.Variable)):
        return None
      if value.shape.as_list() == whole:
        value = self.own_shards(value, local_replica)
      return self._split(value) if value.shape.as_list() == own else None

    flat = tf.nest.flatten((args, kwargs))
    split = [pieces(value) for value in flat]
    updates = []
    for j, component in enumerate(self.parts(local_replica)):
      part_args, part_kwargs = tf.nest.pack_sequence_as(
          (args, kwargs), [value if cut is None else cut[j]
                           for value, cut in zip(flat, split)])
      with tf.device(component.device), tfi.UpdateContext(local_replica), \
          split_variables._updating_part(j):  # pylint: disable=protected-access
        updates.append(fn(component, *part_args, **part_kwargs))
    updates = [u for u in updates if u is not None]
    return tf.group(updates) if updates else None

  def _update_cross_replica(self, update_fn, value, **kwargs):
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    k = self.num_parts
    updates = []
    for j, part in enumerate(self._split(value)):
      for r, component in enumerate(self.values[j::k]):
        with tf.device(component.device):
          updates.append(update_fn(
              component, self.layout.shard(part, self.shard_index(r)),
              **kwargs))
    return tf.group(updates)

  def _update_replica(self, update_fn, value, **kwargs):
    replica = tfi.distribute_lib.get_update_replica_id()
    if replica is not None and split_variables._part_being_updated() is not None:  # pylint: disable=protected-access
      return super()._update_replica(update_fn, value, **kwargs)
    if replica is None:
      replica = tf.distribute.get_replica_context().local_index
    return self.update_own_shards(
        replica, update_fn, tf.convert_to_tensor(value, dtype=self.dtype),
        **kwargs)


def create(strategy, next_creator, request, split_axis, batch_axis,
           variable_class, **kwargs):
  """A `variable_class` (`ShardedSplitVariable` or a subclass) where the new
  variable is one, else None.

  It is one where it is optimizer state of one (created `colocate_with` it),
  or a trainable weight split along `split_axis` that `batch_axis` (the
  dimension a layout names the batch axis for, or the `RowLayout` of a part
  that a weight moved to its pipeline stage keeps) or `variable_partitioner`
  (asked about a part) shards over the replicas.
  """
  request = request or creation.SlotRequest()
  weight = kwargs.get("colocate_with")
  extended = strategy.extended
  num_replicas = extended.communicator.num_replicas
  if isinstance(weight, ShardedSplitVariable):
    if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
      raise NotImplementedError(
          f"The variable {kwargs.get('name')!r} is on-read (each replica "
          f"holds its own value) and colocated with {weight.path}, a weight "
          f"split over each replica's devices and sharded over the replicas, "
          f"which keeps no on-read state. Create it outside "
          f"`colocate_vars_with` of that weight.")
    return _create(strategy, next_creator, weight.axis, weight.layout,
                   "whole" if request.reads_whole else "shard",
                   variable_class, split_variables.part_groups(weight),
                   **kwargs)
  if (split_axis is None or weight is not None or
      (batch_axis is None and extended.variable_partitioner is None) or
      not creation.shardable(kwargs)):
    return None
  groups = split_variables.stage_groups(extended.logical_devices)
  if isinstance(batch_axis, layout_lib.RowLayout):
    layout = batch_axis
  else:
    shape = list(layouts.variable_being_created()[1])
    shape[split_axis] //= len(groups[0])
    layout = creation.row_layout(extended.variable_partitioner, shape,
                                 kwargs.get("dtype"), num_replicas,
                                 kwargs.get("name"), batch_axis)
  if layout is None:
    return None
  return _create(strategy, next_creator, split_axis, layout, "whole",
                 variable_class, groups, **kwargs)


def _check_one_worker(extended):
  """Refuses, when made, what the shards' exchange does not serve yet."""
  if extended.logical_devices.per_replica > 1 and extended.num_workers > 1:
    raise NotImplementedError(
        f"A weight split over each replica's devices and sharded over the "
        f"replicas (variable_partitioner, or a layout naming the batch axis) "
        f"moves its parts' shards among the replicas' logical device j, "
        f"which works within one worker only yet. Received "
        f"{extended.num_workers} workers. Shard only the weights no layout "
        f"splits (leave the batch axis out of the layouts, and "
        f"variable_partitioner out).")


def _create(strategy, next_creator, axis, layout, replica_reads,
            variable_class, groups, **kwargs):
  """The variable: shard r of part j of the whole initial value on each
  replica r's device j of `groups[r]` (its parts' devices)."""
  kwargs.pop("colocate_with", None)
  kwargs.pop("shape", None)
  extended = strategy.extended
  _check_one_worker(extended)
  communicator = extended.communicator
  first_shard = communicator.first_replica_id
  with tf.init_scope(), tf.device(groups[0][0]):
    initial_value = communicator.initial_value(kwargs["initial_value"],
                                               kwargs.get("dtype"))
    whole = tf.convert_to_tensor(
        initial_value() if callable(initial_value) else initial_value,
        dtype=kwargs.get("dtype"))
    parts = tf.split(whole, len(groups[0]), axis=axis)

  def create_shards(**kwargs):
    shards = []
    for replica, group in enumerate(groups):
      for part, device in enumerate(group):
        with tf.device(device):
          kwargs["initial_value"] = layout.shard(
              parts[part], sharded_variables.shard_index(
                  first_shard, replica, layout.num_shards))
          if shards:
            kwargs["name"] = "{}/replica_{:d}/part_{:d}/".format(
                shards[0].name.split(":")[0], replica, part)
          with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
            with tfi.record.stop_recording():
              shards.append(next_creator(**kwargs))
    return shards

  keras_variable = layouts.variable_being_created()
  path = keras_variable[0] if keras_variable else None

  def sharded_split_variable(strategy, values, aggregation):
    return variable_class(strategy, values, aggregation, axis, whole.shape,
                          path, layout, first_shard, replica_reads)

  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_shards,
      {tf.VariableSynchronization.ON_WRITE: sharded_split_variable},
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)
