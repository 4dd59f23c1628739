"""The functions Keras's TensorFlow `distribution_lib` lacks, on ReplicatorStrategy.

Keras's `keras.distribution` calls its backend's `distribution_lib`; on
TensorFlow that module has only `list_devices`. `patches.PATCHES` adds these
(rows with `adds=True`) while the patches are in place:

- `num_processes()`, `process_id()`: the workers of the cluster a
  ReplicatorStrategy uses (the current strategy's, else `TF_CONFIG`) and
  this worker's index (0 is the chief); 1 and 0 alone.
- `get_device_count(device_type=None)`: how many devices
  `list_devices(device_type)` names (TF's logical devices: a split CPU
  counts as several).
- `initialize(job_addresses, num_processes, process_id)` (what
  `keras.distribution.initialize()` calls, from its arguments or the
  `KERAS_DISTRIBUTION_*` variables): writes the cluster TensorFlow reads,
  `TF_CONFIG`, with every worker's address and this process's index, so that
  a ReplicatorStrategy made afterwards joins it. Unlike JAX, TensorFlow needs
  every worker's address, not just the coordinator's. All None keeps a
  `TF_CONFIG` already set (or stays a single process).
- `distribute_tensor(tensor, layout)` (what `Layer.__call__` calls for a
  `<path>/output` key): returns `tensor`. Inside a ReplicatorStrategy
  replica, the layouts the strategy applies are applied already: the batch
  axis in dimension 0 is the replicas' rows, and the model axis in another
  dimension is split by the strategy's `output_layouts` row. A layout it
  cannot apply (the model axis on the batch dimension, an axis of neither
  role, one axis in several dimensions, ...) is left unapplied with a
  warning, once per layout; so is any layout naming an axis where no
  ReplicatorStrategy is in use.
- `distribute_variable(value, layout)`: a variable of `value` made in the
  current strategy's scope: in a ReplicatorStrategy(layout_map=...), split
  over the model axis and sharded over the batch axis as `layout` says
  (as a layout map key would); elsewhere as the strategy makes variables.
- `distribute_data_input(per_process_batch, layout, batch_dim_name)`: the
  per-process batch as the strategy distributes it: this worker's replicas
  each take their contiguous part of the rows (a PerReplica value).
- `_to_backend_mesh` (what `DeviceMesh.backend_mesh` calls; Keras's calls
  DTensor, which needs `dtensor.initialize_accelerator_system()`): the
  `replicator_strategy.mesh.Mesh` of the DeviceMesh, axes named by role
  (where the names are not roles, by position, `mesh.POSITIONAL_ROLES`: the
  batch axis first, as ModelParallel defaults to; group, batch, stage and
  model for 4 axes). `TensorLayout.backend_layout` is that mesh and the axes.

>>> import keras
>>> import replicator_strategy as rs
>>> rs.keras.install()
>>> keras.distribution.get_device_count("cpu")
4
>>> mesh = keras.distribution.DeviceMesh((2, 2), ("data", "model"),
...                                      keras.distribution.list_devices())
>>> print(mesh.backend_mesh)
data (batch) 2 x model 2
"""

import dataclasses
import json
import os
import warnings

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import global_batch_input
from replicator_strategy import mesh as mesh_lib
from replicator_strategy import options as options_lib
from replicator_strategy import replica_context
from replicator_strategy import warn_once
from replicator_strategy.cluster import config as cluster_lib
from replicator_strategy.keras import _internal as ki
from replicator_strategy.model_parallel import layouts as layouts_lib

_warned = warn_once.Once()  # The layouts distribute_tensor warned of.


def _cluster():
  """The cluster a ReplicatorStrategy uses now, or None alone."""
  options = options_lib.of()
  if options is not None:
    return tf.distribute.get_strategy().extended.cluster
  return cluster_lib.from_environment()


def num_processes():
  """The workers (processes) of the cluster; 1 alone."""
  cluster = _cluster()
  return cluster.num_workers if cluster else 1


def process_id():
  """This worker's index in the cluster (0: the chief); 0 alone."""
  cluster = _cluster()
  return cluster.worker_index if cluster else 0


def get_device_count(device_type=None):
  """How many devices `list_devices(device_type)` names."""
  return len(ki.tf_distribution_lib.list_devices(device_type))


def initialize(job_addresses, num_processes, process_id):  # pylint: disable=redefined-outer-name
  """Writes `TF_CONFIG` for the cluster of `job_addresses` (every worker's
  "host:port", comma-separated), this process being `process_id`."""
  if job_addresses is None and num_processes is None and process_id is None:
    cluster_lib.from_environment()  # Checks a TF_CONFIG that is set.
    return
  addresses = [a.strip() for a in (job_addresses or "").split(",")
               if a.strip()]
  count = len(addresses) if num_processes is None else num_processes
  asked = (f"job_addresses={job_addresses!r}, num_processes="
           f"{num_processes!r}, process_id={process_id!r}")
  if count > 1 and len(addresses) != count:
    raise ValueError(
        f"On TensorFlow every worker needs the address of every other: pass "
        f"all {count} workers' \"host:port\" in job_addresses (or "
        f"KERAS_DISTRIBUTION_JOB_ADDRESSES), comma-separated, in the same "
        f"order on every worker (JAX takes the coordinator's alone). "
        f"Received: {asked}.")
  if process_id is None and count > 1:
    raise ValueError(
        f"Pass this worker's index, 0 to {count - 1}, as process_id (or "
        f"KERAS_DISTRIBUTION_PROCESS_ID). Received: {asked}.")
  index = process_id or 0
  if not 0 <= index < max(count, 1):
    raise ValueError(
        f"process_id must be in 0 to {max(count, 1) - 1}. Received: {asked}.")
  wanted = {"cluster": {"worker": addresses}, "task": {"type": "worker",
                                                       "index": index}}
  have = os.environ.get("TF_CONFIG")
  if have:
    cluster = cluster_lib.from_environment()
    agrees = (tuple(addresses), index) == (
        (cluster.addresses, cluster.worker_index) if cluster else
        (tuple(addresses[:1]), 0))
    if not agrees and not (cluster is None and count <= 1):
      raise ValueError(
          f"TF_CONFIG is set and describes another cluster than "
          f"keras.distribution.initialize() was given. TF_CONFIG: {have}; "
          f"initialize: {asked}. Unset TF_CONFIG or pass what it says (or "
          f"call initialize() with no arguments to keep it).")
    return
  if count <= 1:
    return  # One process: nothing to join.
  if tfi.runtime_started():
    raise RuntimeError(
        f"keras.distribution.initialize() must come before TensorFlow starts "
        f"its runtime (before any op, dataset, variable or model), so that "
        f"the cluster can still be joined. Call it at the start of the "
        f"program. Received: {asked}.")
  os.environ["TF_CONFIG"] = json.dumps(wanted)
  try:
    cluster_lib.from_environment()  # The addresses, checked.
  except ValueError:
    del os.environ["TF_CONFIG"]
    raise


def _roles():
  """{mesh axis name: role} of the current ReplicatorStrategy, or None."""
  options = options_lib.of()
  if options is None:
    return None
  if options.layouts is not None:
    return {options.layouts.batch_axis: "batch",
            options.layouts.model_axis: "model"}
  return {name: role for name, role in zip(options.mesh.axis_names,
                                           options.mesh.roles)}


def unapplied(tensor, axes):
  """Why a replica cannot apply `axes` to `tensor` (a `<path>/output`), or
  None where the strategy applies it (the output_layouts row splits)."""
  roles = _roles() or {}
  shape = tf.TensorShape(getattr(tensor, "shape", None))
  if shape.rank is not None and shape.rank != len(axes):
    return f"it has {len(axes)} dimension(s), the tensor {shape.rank}"
  for dim, axis in enumerate(axes):
    if axis is None:
      continue
    role = roles.get(axis)
    if role not in ("batch", "model"):
      return (f"{axis!r} is neither the strategy's batch axis nor its model "
              f"axis ({roles or 'none'})")
    if axes.count(axis) > 1:
      return f"it names {axis!r} in several dimensions"
    if (role == "batch") != (dim == 0):
      return (f"{axis!r} ({role}) is in dimension {dim}: the replicas split "
              f"dimension 0, the rows, and the model axis another")
  return None


def distribute_tensor(tensor, layout):
  """`tensor` unchanged; a warning (once per layout) where the layout is
  not the one a ReplicatorStrategy replica gives it."""
  axes = tuple(_axes(layout))
  if not any(axes):
    return tensor
  # In the strategy's scope outside its replicas (the model's build), the
  # replicas' calls apply the layout.
  inside = options_lib.of() is not None or isinstance(
      tf.distribute.get_replica_context(), replica_context.ReplicaContext)
  for leaf in tf.nest.flatten(tensor):  # A layer's outputs, each.
    why = (unapplied(leaf, axes) if inside else
           "no ReplicatorStrategy is in use (its replicas apply layouts)")
    if why is not None:
      warn_unapplied(axes, why)
  return tensor


def warn_unapplied(axes, why):
  """Warns, once per layout, that the tensor layout `axes` is not applied."""
  if not _warned((axes, why)):
    return
  warnings.warn(
      f"keras.distribution asked for the layout {axes} of a tensor, which "
      f"ReplicatorStrategy leaves as it is on TensorFlow: {why}. The values "
      f"are the same; only where they live differs.", stacklevel=4)


def distribute_variable(value, layout):
  """A variable of `value`, made in the current strategy's scope and placed
  as `layout` says where the strategy has a layout map."""
  value = tf.convert_to_tensor(value)
  options = options_lib.of()
  model_layouts = options and options.layouts
  if model_layouts is None:
    if any(_axes(layout)):
      warnings.warn(
          f"keras.distribution asked for the layout {tuple(_axes(layout))} "
          f"of a variable; only a ReplicatorStrategy(layout_map=...) splits "
          f"variables on TensorFlow, so it is made as the current strategy "
          f"makes variables.", stacklevel=2)
    with tf.distribute.get_strategy().scope():
      return tf.Variable(value)
  path = "distribute_variable"
  placement = model_layouts.axes_placement(path, _axes(layout), value.shape)
  with tf.distribute.get_strategy().scope(), layouts_lib.creating(
      path, value.shape, placement):
    return tf.Variable(value)


def distribute_data_input(per_process_batch, layout, batch_dim_name):
  """The per-process batch as the current strategy distributes it: each of
  this worker's replicas takes its contiguous part of the rows."""
  del layout, batch_dim_name  # The strategy's replicas are the batch axis.
  if not tf.distribute.has_strategy():  # One device: the batch as it is.
    return tf.nest.map_structure(tf.convert_to_tensor, per_process_batch)
  strategy = tf.distribute.get_strategy()
  extended = strategy.extended
  local = len(extended.worker_devices)
  first = getattr(extended, "first_replica_id", 0)
  leaves = tf.nest.flatten(per_process_batch)
  parts = [global_batch_input.split_rows(tf.convert_to_tensor(leaf), local)
           for leaf in leaves]
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.pack_sequence_as(per_process_batch, [
          tf.identity(p[ctx.replica_id_in_sync_group - first])
          for p in parts]))


def _axes(layout):
  axes = getattr(layout, "axes", None)
  if axes is None:
    raise TypeError(
        f"Expected a keras.distribution.TensorLayout. Received: {layout!r}.")
  return tuple(axes)


def to_backend_mesh(to_backend_mesh_of_keras):
  """`DeviceMesh.backend_mesh`: a `replicator_strategy.mesh.Mesh`."""
  del to_backend_mesh_of_keras  # It needs DTensor's accelerator system.

  def wrapper(device_mesh):
    names = tuple(device_mesh.axis_names)
    roles = None
    if not set(names) <= set(mesh_lib.ROLES):  # By position: batch first.
      roles = dict(zip(mesh_lib.POSITIONAL_ROLES.get(len(names), ()), names))
    return mesh_lib.Mesh.from_device_mesh(device_mesh, roles)

  return wrapper


@dataclasses.dataclass(frozen=True)
class BackendLayout:
  """`TensorLayout.backend_layout` on TensorFlow: the mesh and the axes."""
  mesh: mesh_lib.Mesh
  axes: tuple


def to_backend_layout(to_backend_layout_of_keras):
  """`TensorLayout.backend_layout`: a `BackendLayout`."""
  del to_backend_layout_of_keras  # It builds a DTensor layout.

  def wrapper(tensor_layout):
    if tensor_layout.device_mesh is None:
      raise ValueError(
          f"Cannot create sharding when device mesh is not set for "
          f"TensorLayout. Received: {tensor_layout}. Give it one "
          f"(TensorLayout(axes, device_mesh)) or put it in a LayoutMap.")
    return BackendLayout(tensor_layout.device_mesh.backend_mesh,
                         tuple(tensor_layout.axes))

  return wrapper


ADDED = ("num_processes", "process_id", "get_device_count", "initialize",
         "distribute_tensor", "distribute_variable", "distribute_data_input")
