"""Weights split over each replica's logical devices (a layout's model axis).

A `SplitVariable` is one distributed variable of the whole shape. Replica r
holds it in k parts, part i (slice i of the whole along `axis`) on the
replica's logical device i (with a pipeline, its stage's device i:
`stage_groups`); every replica holds the same parts (data parallel). Each
device holds 1/k of the weight, and of its optimizer slots, which are split
the same way. How it reads depends on where:

- in cross-replica context (outside `strategy.run`, saving, `numpy()`): the
  whole, from the first replica's parts; a whole-shaped assignment sets every
  part of every replica;
- inside the update of replica r's part i (the optimizer's step, which
  `ReplicatorExtended` runs once per part, on the part's device): part i, so
  an optimizer's elementwise math runs on parts unchanged;
- inside replica r (`strategy.run`): the whole, concatenated on the replica's
  logical device 0, so every layer reads it correctly. The layers of
  `replicator_strategy.keras.model_parallel_layers` compute on `parts()`
  instead, each part on its own device.

A gradient taken inside a replica flows to the replica's parts; the tape
hands the optimizer their concatenation, the gradient of the whole, which
carries the parts (`gradient_parts`): the optimizer sums and applies each
part on its device, and a traced step leaves the whole unread.

>>> import keras
>>> import replicator_strategy as rs
>>> mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"),
...                                      rs.split_cpu(4))
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["dense/kernel"] = (None, "model")
>>> strategy = rs.ReplicatorStrategy(layout_map=layout_map)
>>> with strategy.scope():
...   dense = keras.layers.Dense(6, name="dense")
...   dense.build((None, 3))
>>> [(p.shape.as_list(), p.device[-5:]) for p in dense.kernel.value.values]
[([3, 3], 'CPU:0'), ([3, 3], 'CPU:1'), ([3, 3], 'CPU:2'), ([3, 3], 'CPU:3')]
"""

import contextlib
import functools
import threading

from absl import logging
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.model_parallel import gradient_parts
from replicator_strategy.model_parallel import layouts
from replicator_strategy.sharding import variables as sharded_variables

_updating = threading.local()  # .part: the part an update step runs for.


class SplitVariable(sharded_variables.PiecewiseVariable):
  """A variable split in `num_parts` along `axis` on each replica's devices.

  `values` lists replica 0's parts, then replica 1's, ...: component
  `r * num_parts + i` is replica r's part i. `path` names it in messages:
  its Keras path (`block/layer_normalization/gamma`), unique where its TF
  name (`block/gamma:0`) can be two layers' of a block; else its TF name.
  """

  def __init__(self, strategy, values, aggregation, axis, shape, path=None):
    self.axis = axis
    self.path = path or values[0].name
    self.whole_shape = tf.TensorShape(shape)
    self.num_parts = strategy.extended.logical_devices.per_stage
    self._logged_whole_read = False
    super().__init__(strategy, values, aggregation)

  def parts(self, local_replica):
    """Replica `local_replica`'s parts, in order (part i on device i)."""
    k = self.num_parts
    return self.values[local_replica * k:(local_replica + 1) * k]

  def read_parts(self, local_replica):
    """Replica `local_replica`'s parts, each read on its device."""
    reads = []
    for part in self.parts(local_replica):
      with tf.device(part.device):
        reads.append(part.read_value())
    return reads

  def _whole(self, local_replica):
    """Replica `local_replica`'s whole, recorded with its parts' reads."""
    return gradient_parts.Parts(
        self.read_parts(local_replica), self.axis,
        [p.device for p in self.parts(local_replica)]).assembled()

  def _get_cross_replica(self):
    return self._whole(0)

  def _get(self):
    replica = tfi.distribute_lib.get_update_replica_id()
    if replica is not None:
      part = _part_being_updated()
      if part is None:
        return self._whole(replica)
      return self.parts(replica)[part]
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not self.distribute_strategy:
      return self._get_cross_replica()
    self._note_whole_read()
    return self._whole(ctx.local_index)

  def _note_whole_read(self):
    """Warns, once, that a layer reads the weight whole inside a replica."""
    if self._logged_whole_read:
      return
    self._logged_whole_read = True
    logging.warning(
        "ReplicatorStrategy: %s is split over each replica's %d devices, and "
        "its layer reads it whole (assembled on logical device 0 each "
        "step). Dense, EinsumDense, MultiHeadAttention and Embedding "
        "compute on the parts; see "
        "docs/model-parallel.md.", self.path, self.num_parts)

  def _get_replica(self, replica_id):
    part = _part_being_updated()
    if part is None:
      raise NotImplementedError(
          f"{self.path} is split over each replica's devices; an update step "
          f"of another variable cannot assign it whole. Assign it outside "
          f"`strategy.run`, or in its own optimizer step.")
    return self.parts(replica_id)[part]

  @property
  def handle(self):
    """Inside a replica, its parts' handles: what a gradient tape differentiates."""
    replica = tfi.distribute_lib.get_update_replica_id()
    part = _part_being_updated()
    if replica is not None and part is not None:
      return self.parts(replica)[part].handle
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not self.distribute_strategy:
      raise ValueError(
          f"{self.path} is split over each replica's devices: it has a handle "
          f"per part, inside `strategy.run` only.")
    local = ctx.local_index if replica is None else replica
    return tfi.GradientOfParts(
        [p.handle for p in self.parts(local)],
        lambda grads: _concat_gradients(grads, self.parts(local), self.axis))

  def known_pieces(self, value, replica):
    """`value`'s pieces for replica `replica`'s parts where they are known
    without reading it whole (`gradient_parts`), else None."""
    parts = gradient_parts.parts_of(value)
    if parts is not None:
      return parts.pieces
    return gradient_parts.uniform_pieces(
        value, [p.shape for p in self.parts(replica)],
        [p.device for p in self.parts(replica)])

  def _split(self, value):
    return tf.split(value, self.num_parts, axis=self.axis)

  def _update_cross_replica(self, update_fn, value, **kwargs):
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    pieces = self._split(value)
    updates = []
    for index, component in enumerate(self.values):
      with tf.device(component.device):
        updates.append(
            update_fn(component, pieces[index % self.num_parts], **kwargs))
    return tf.group(updates)

  def _update_replica(self, update_fn, value, **kwargs):
    replica = tfi.distribute_lib.get_update_replica_id()
    part = _part_being_updated()
    if replica is not None and part is not None:
      return update_fn(self.parts(replica)[part], value, **kwargs)
    if replica is None:
      replica = tf.distribute.get_replica_context().local_index
    pieces = self.known_pieces(value, replica)
    pieces = pieces if pieces is not None else self._split(
        tf.convert_to_tensor(value, dtype=self.dtype))
    return tf.group([update_fn(p, piece, **kwargs)
                     for p, piece in zip(self.parts(replica), pieces)])

  def _serialize_to_tensors(self):
    return {tfi.VARIABLE_VALUE_KEY: self._get_cross_replica()}

  def _restore_from_tensors(self, restored_tensors):
    return self.assign(restored_tensors[tfi.VARIABLE_VALUE_KEY])


def _concat_gradients(grads, parts, axis):
  """The whole's gradient from its parts', recorded with them (None if they
  are all None). Sparse ones (an Embedding's) stay sparse, as one device's
  optimizer gets them."""
  if all(g is None for g in grads):
    return None
  pieces = []
  for g, part in zip(grads, parts):
    with tf.device(part.device):  # Known shapes: a dynamic batch loses them.
      if all(isinstance(g, tf.IndexedSlices) for g in grads):
        pieces.append(tf.IndexedSlices(g.values, g.indices,
                                       tf.constant(part.shape.as_list())))
      else:
        pieces.append(tf.zeros_like(part) if g is None else
                      tf.ensure_shape(tf.convert_to_tensor(g), part.shape))
  return gradient_parts.Parts(pieces, axis,
                              [p.device for p in parts]).assembled()


def _split_sparse(value, k, axis, whole):
  """A sparse gradient of the whole, as k sparse gradients of the parts."""
  part_shape = list(whole)
  part_shape[axis] //= k
  if axis:
    return [tf.IndexedSlices(v, value.indices, tf.constant(part_shape))
            for v in tf.split(value.values, k, axis=axis)]
  rows = part_shape[0]
  indices = tf.cast(value.indices, tf.int64)
  pieces = []
  for i in range(k):
    mine = tf.where((indices >= i * rows) & (indices < (i + 1) * rows))[:, 0]
    pieces.append(tf.IndexedSlices(tf.gather(value.values, mine),
                                   tf.gather(indices, mine) - i * rows,
                                   tf.constant(part_shape)))
  return pieces


def update(var, fn, args, kwargs):
  """Runs `fn` once per replica and part, on the part's device.

  Arguments of the variable's whole shape are split to the part's slice;
  others (a learning rate) go whole. Returns, per replica, its parts'
  updates grouped (None where `fn` returns nothing).
  """
  select = tfi.distribute_utils.select_replica
  return [update_replica(var, r, fn, select(r, args), select(r, kwargs))
          for r in range(len(var.values) // var.num_parts)]


def update_replica(var, replica, fn, args, kwargs):
  """`update` for one replica, given its own `args` and `kwargs`."""
  split_args, split_kwargs = tf.nest.map_structure(
      lambda a: _split_if_whole(a, var, replica), (args, kwargs))
  results = []
  for part, component in enumerate(var.parts(replica)):
    part_args, part_kwargs = tf.nest.map_structure(
        functools.partial(_piece, part=part), (split_args, split_kwargs))
    with tf.device(component.device), tfi.UpdateContext(replica), \
        _updating_part(part), tf.name_scope(f"update_{replica}_{part}"):
      result = fn(component, *part_args, **part_kwargs)
    if result is not None:
      results.append(result)
  return tf.group(results) if results else None


class _Pieces:
  """A whole-shaped argument, split per part (a leaf to `tf.nest`)."""

  def __init__(self, pieces):
    self.pieces = pieces


def _piece(value, part):
  return value.pieces[part] if isinstance(value, _Pieces) else value


def _split_if_whole(value, var, replica):
  whole, k, axis = var.shape.as_list(), var.num_parts, var.axis
  if (isinstance(value, (tf.Tensor, tf.IndexedSlices)) and
      value.shape.is_compatible_with(whole)):
    pieces = var.known_pieces(value, replica)
    if pieces is not None:  # Its parts' own: the whole is left unread.
      return _Pieces(pieces)
  if isinstance(value, tf.IndexedSlices):  # A gradient of the whole.
    with tf.device(value.values.device):
      return _Pieces(_split_sparse(value, k, axis, whole))
  if (isinstance(value, (tf.Tensor, tf.Variable)) and
      value.shape.rank == len(whole) and value.shape.is_compatible_with(whole)):
    with tf.device(value.device):
      return _Pieces(tf.split(value, k, axis=axis))
  return value


def _part_being_updated():
  return getattr(_updating, "part", None)


@contextlib.contextmanager
def _updating_part(part):
  """Reads and assignments of split variables inside go to their `part`."""
  previous, _updating.part = _part_being_updated(), part
  try:
    yield
  finally:
    _updating.part = previous


def stage_groups(logical):
  """Each replica's devices that a new split variable's parts go to: those
  of the pipeline stage holding the logical device new variables go to (a
  replica's all, without a pipeline)."""
  first = logical.variables_on // logical.per_stage * logical.per_stage
  return tuple(group[first:first + logical.per_stage]
               for group in logical.groups)


def part_groups(variable):
  """Each replica's devices that the split `variable`'s parts are on."""
  devices = [c.device for c in variable.values]
  k = variable.num_parts
  return tuple(tuple(devices[i:i + k]) for i in range(0, len(devices), k))


def create(strategy, next_creator, axis, on_read=None,
           on_write=SplitVariable, **kwargs):
  """A `SplitVariable`: parts of the whole initial value, on every replica,
  on the devices of the split variable it is colocated with, if any.

  An on-read variable (replicas hold their own values) is an `on_read`, a
  `SplitVariable` subclass of the same arguments; any other an `on_write`.
  """
  if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ and
      on_read is None):
    raise NotImplementedError(
        f"The variable {kwargs.get('name')!r} is on-read (each replica holds "
        f"its own value) and colocated with a weight split over each "
        f"replica's devices; ReplicatorStrategy splits an on-read variable "
        f"only as a Keras optimizer's gradient accumulator. Create it outside "
        f"`colocate_vars_with` of the split weight.")
  weight = kwargs.pop("colocate_with", None)
  kwargs.pop("shape", None)
  communicator = strategy.extended.communicator
  # A slot goes beside its split weight's parts (a later pipeline stage's).
  groups = (part_groups(weight) if isinstance(weight, SplitVariable) else
            stage_groups(strategy.extended.logical_devices))
  k = len(groups[0])
  with tf.init_scope(), tf.device(groups[0][0]):
    initial_value = communicator.initial_value(kwargs["initial_value"],
                                               kwargs.get("dtype"))
    whole = tf.convert_to_tensor(
        initial_value() if callable(initial_value) else initial_value,
        dtype=kwargs.get("dtype"))
    pieces = tf.split(whole, k, axis=axis)

  def create_parts(**kwargs):
    parts = []
    for replica, group in enumerate(groups):
      for part, device in enumerate(group):
        with tf.device(device):
          kwargs["initial_value"] = tf.identity(pieces[part])
          if parts:
            kwargs["name"] = "{}/replica_{:d}/part_{:d}/".format(
                parts[0].name.split(":")[0], replica, part)
          with tfi.context.device_policy(tfi.context.DEVICE_PLACEMENT_SILENT):
            with tfi.record.stop_recording():
              parts.append(next_creator(**kwargs))
    return parts

  keras_variable = layouts.variable_being_created()
  path = keras_variable[0] if keras_variable else None

  def of_class(cls):
    return lambda strategy, values, aggregation: cls(
        strategy, values, aggregation, axis, whole.shape, path)

  return tfi.distribute_utils.create_mirrored_variable(
      strategy, create_parts,
      {tf.VariableSynchronization.ON_WRITE: of_class(on_write),
       tf.VariableSynchronization.ON_READ: on_read and of_class(on_read)},
      tfi.distribute_utils.VARIABLE_POLICY_MAPPING, **kwargs)
