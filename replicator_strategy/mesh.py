"""The strategy's device mesh: this worker's devices as axes, each with a role.

Every kind of parallelism is an axis of one mesh, as in GSPMD, torchtitan's
DeviceMesh and Keras's own `keras.distribution.DeviceMesh`:

- `"group"`, outermost: sync groups (`docs/sync-groups.md`), each training
  apart between averaging rounds;
- `"batch"`: the replicas of a group, data parallel; sharded optimizer state
  and ZeRO-3 weights are cut over it (`docs/sharding.md`);
- `"stage"`: one replica's pipeline stages, a device (or a model axis of
  devices) each, running its part of the model (`Pipeline`);
- `"model"`, innermost: a stage's devices (a replica's, without a
  pipeline), over which a layout map splits weights (tensor parallel,
  `docs/model-parallel.md`).

An axis left out has size 1. `ReplicatorStrategy(mesh=DeviceMesh(...))`
names the axes; the older keywords build the same mesh (`devices` and
`devices_per_replica=k`: batch x model; `sync_groups=G`: a group axis;
`pipeline=Pipeline(stages=S)`: a stage axis). A replica's devices are its
stage x model devices, row-major.
With several workers each worker's mesh lists its own devices; the batch
axis spans the workers, and so does the group axis: a mesh with a group axis
of size g on each of W workers forms g x W sync groups (one per worker when
g = 1), a mesh without one a single group.

>>> import keras
>>> import replicator_strategy as rs
>>> devices = rs.split_cpu(4)
>>> mesh = Mesh.from_device_mesh(keras.distribution.DeviceMesh(
...     (2, 1, 2), ("group", "batch", "model"), devices))
>>> print(mesh)
group 2 x batch 1 x model 2
>>> [len(replica) for replica in mesh.device_groups]
[2, 2]
"""

import dataclasses
import warnings

import numpy as np

from replicator_strategy import devices as devices_lib
from replicator_strategy.model_parallel import logical_devices

ROLES = ("group", "batch", "stage", "model")
# The roles of a mesh's axes by position, where their names are not roles
# (keras.distribution names them freely): in `ROLES` order, the batch axis
# first where there is no group axis.
POSITIONAL_ROLES = {1: ("batch",), 2: ("batch", "model"),
                    3: ("group", "batch", "model"), 4: ROLES}


@dataclasses.dataclass(frozen=True)
class Mesh:
  """This worker's devices, by role.

  Attributes:
    axis_names: the mesh's axis name for each role present, in `ROLES` order.
    roles: the roles present, in `ROLES` order.
    shape: each present axis's size on this worker.
    devices: this worker's device names, row-major over the axes.
    num_workers: the workers that each hold such a mesh.
  """

  axis_names: tuple
  roles: tuple
  shape: tuple
  devices: tuple
  num_workers: int = 1

  @classmethod
  def from_device_mesh(cls, device_mesh, axis_roles=None, num_workers=1):
    """The mesh of a `keras.distribution.DeviceMesh` (this worker's devices).

    `axis_roles` maps a role to the mesh's name for it, for axes not named
    by their role (`{"batch": "data", "model": "tensor"}`).
    """
    names = tuple(getattr(device_mesh, "axis_names", ()))
    if not names or not hasattr(device_mesh, "devices"):
      raise ValueError(
          f"Expected `mesh` to be a keras.distribution.DeviceMesh, such as "
          f"DeviceMesh((2, 2), ('batch', 'model'), devices). Received: "
          f"{device_mesh!r}.")
    role_of = _role_names(axis_roles, names)
    devices = np.asarray(device_mesh.devices, dtype=object)
    order = [names.index(role_of[role]) for role in ROLES
             if role_of[role] in names]
    devices = devices.transpose(order)
    roles = tuple(role for role in ROLES if role_of[role] in names)
    return cls(axis_names=tuple(role_of[role] for role in roles),
               roles=roles, shape=devices.shape,
               devices=tuple(_device_name(d) for d in devices.flat),
               num_workers=num_workers)

  @classmethod
  def from_keywords(cls, devices, devices_per_replica=1, sync_groups=1,
                    num_workers=1, stages=1):
    """The mesh the shorthand keywords describe: this worker's `devices`,
    `stages` x `devices_per_replica` to a replica, `sync_groups` over every
    worker."""
    replicas = len(devices) // (devices_per_replica * stages)
    roles, shape = ["batch"], [replicas]
    if sync_groups > 1:
      local_groups = max(sync_groups // num_workers, 1)
      roles, shape = ["group", "batch"], [local_groups,
                                         max(replicas // local_groups, 1)]
    if stages > 1:
      roles.append("stage")
      shape.append(stages)
    if devices_per_replica > 1:
      roles.append("model")
      shape.append(devices_per_replica)
    return cls(axis_names=tuple(roles), roles=tuple(roles), shape=tuple(shape),
               devices=tuple(str(d) for d in devices), num_workers=num_workers)

  def size(self, role):
    """The axis of `role`'s size on this worker (1 when the mesh has none)."""
    return self.shape[self.roles.index(role)] if role in self.roles else 1

  def axis_name(self, role):
    """The mesh's name for the axis of `role`, or None when it has none."""
    return self.axis_names[self.roles.index(role)] if role in self.roles else None

  @property
  def device_groups(self):
    """Each replica's devices (its stage x model axes), replicas in order."""
    k = self.size("stage") * self.size("model")
    return tuple(self.devices[i:i + k] for i in range(0, len(self.devices), k))

  @property
  def num_sync_groups(self):
    """Sync groups over every worker: the group axis on each worker."""
    if "group" not in self.roles:
      return 1
    return self.size("group") * self.num_workers

  def __str__(self):
    return " x ".join(f"{name} {size}" if name == role else
                      f"{name} ({role}) {size}"
                      for name, role, size in zip(self.axis_names, self.roles,
                                                  self.shape))


def build(device_mesh, axis_roles, batch_dim_name, devices,
          devices_per_replica, model_layouts, sync, num_workers,
          pipeline=None):
  """The strategy's `Mesh` from `mesh=` or the keywords it replaces, `sync`
  (an `options.SyncGroups`) with the mesh's groups, and `pipeline` (an
  `options.Pipeline` or None) with the mesh's stages."""
  if batch_dim_name is not None and model_layouts is None and (
      device_mesh is None):
    raise ValueError(
        f"`batch_dim_name={batch_dim_name!r}` names an axis of a mesh, but "
        f"neither `layout_map` nor `mesh` was given. Pass one, or leave "
        f"batch_dim_name out.")
  if device_mesh is not None:
    if batch_dim_name is not None:
      axis_roles = {"batch": batch_dim_name, **(axis_roles or {})}
    the_mesh, sync = _from_mesh(device_mesh, axis_roles, num_workers, sync,
                                devices, devices_per_replica, model_layouts)
    return the_mesh, sync, _mesh_pipeline(the_mesh, pipeline)
  if axis_roles is not None:
    raise ValueError(
        "`axis_roles` names the axes of a `mesh`, but no mesh was given. "
        "Pass mesh=keras.distribution.DeviceMesh(...), or leave axis_roles "
        "out.")
  if model_layouts is not None:
    devices, devices_per_replica = _mesh_devices(
        model_layouts, devices, devices_per_replica)
  devices = _devices_or_default(devices)
  stages = pipeline.stages if pipeline is not None else 1
  if stages > 1:
    _check_stages_divide(devices, devices_per_replica, stages)
  logical_devices.group_by_replica(devices, devices_per_replica * stages)
  return Mesh.from_keywords(devices, devices_per_replica, sync.groups,
                            num_workers, stages), sync, pipeline


def _check_stages_divide(devices, devices_per_replica, stages):
  """Refuses pipeline stages that do not divide this worker's devices."""
  k = devices_per_replica
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    return  # group_by_replica names the mistake.
  if len(devices) % (stages * k):
    each = f"{stages} x {k} = {stages * k}" if k > 1 else f"{stages}"
    raise ValueError(
        f"`Pipeline(stages={stages})` gives each replica {each} of this "
        f"worker's devices (a device per stage"
        f"{', times devices_per_replica' if k > 1 else ''}), but it has "
        f"{len(devices)}, not a multiple of {stages * k}. Pass a number of "
        f"stages that divides {len(devices) // k}, or `devices=[...]` "
        f"listing a multiple of {stages * k}.")


def _mesh_pipeline(the_mesh, pipeline):
  """`pipeline`, agreeing with the mesh's stage axis (a mesh with one and no
  `pipeline=` gets `Pipeline(stages=<its size>)`)."""
  stages = the_mesh.size("stage")
  if pipeline is None:
    if "stage" not in the_mesh.roles:
      return None
    # Here, not above: the options import this module.
    from replicator_strategy import options  # pylint: disable=g-import-not-at-top
    return options.Pipeline(stages=stages)
  if pipeline.stages != stages:
    raise ValueError(
        f"The mesh has {stages} stage(s) (its stage axis, {the_mesh}), but "
        f"pipeline stages={pipeline.stages}. Make them agree: name a "
        f"\"stage\" axis of size {pipeline.stages} in the mesh, or pass "
        f"Pipeline(stages={stages}).")
  return pipeline


def _devices_or_default(devices):
  """`devices` resolved, or every GPU, else every logical CPU device."""
  if devices is not None:
    return devices_lib.resolve_devices(devices)
  if devices_lib.tpu_present():
    raise NotImplementedError(devices_lib.tpu_not_supported_message())
  devices = devices_lib.local_devices()
  if devices_lib.is_lone_cpu(devices):
    warnings.warn(
        "ReplicatorStrategy: no GPU, so 1 replica on the CPU. For "
        "testing, replicator_strategy.split_cpu(n) before any TensorFlow "
        "op gives n replicas on n logical CPU devices.", stacklevel=4)
  return devices


def _from_mesh(device_mesh, axis_roles, num_workers, sync, devices,
               devices_per_replica, model_layouts):
  """The strategy's mesh from `mesh=`, and `sync` with its groups."""
  if devices is not None or devices_per_replica != 1:
    raise ValueError(
        "Pass either `mesh` or `devices`/`devices_per_replica`: the mesh "
        "lists the devices and its model axis gives each replica's. Received "
        f"both (devices={devices!r}, devices_per_replica="
        f"{devices_per_replica!r}).")
  the_mesh = Mesh.from_device_mesh(device_mesh, axis_roles,
                                            num_workers)
  try:
    resolved = devices_lib.resolve_devices(the_mesh.devices)
  except ValueError as e:
    raise ValueError(
        f"The mesh must list this worker's devices, as "
        f"keras.distribution.list_devices() names them. {e}") from None
  the_mesh = dataclasses.replace(the_mesh, devices=tuple(resolved))
  if model_layouts is not None:
    # A layout map's mesh has a row per stage of each replica.
    layout_groups = [list(devices_lib.resolve_devices(group))
                     for group in model_layouts.device_groups]
    k = the_mesh.size("model")
    stage_groups = [list(the_mesh.devices[i:i + k])
                    for i in range(0, len(the_mesh.devices), k)]
    if stage_groups != layout_groups:
      raise ValueError(
          f"The layout map's mesh and `mesh` must give each replica's stages "
          f"the same devices. Received: mesh {the_mesh} with stages "
          f"{stage_groups}, layout map rows {layout_groups}. Build the layout "
          f"map over the same DeviceMesh.")
  groups = the_mesh.num_sync_groups
  if sync.groups not in (1, groups):
    raise ValueError(
        f"The mesh forms {groups} sync group(s) (its group axis, {the_mesh}), "
        f"but sync groups={sync.groups}. Leave the number of groups out, or "
        f"make the mesh's group axis agree.")
  if groups > 1 and sync.groups == 1:
    sync = dataclasses.replace(sync, groups=groups)
  return the_mesh, sync


def _mesh_devices(model_layouts, devices, devices_per_replica):
  """The devices and devices per replica that a layout map's mesh gives."""
  if devices is not None:
    raise ValueError(
        "Pass either `devices` or `layout_map`: the layout map's mesh lists "
        "the devices. Received both.")
  k = model_layouts.devices_per_replica
  if devices_per_replica not in (1, k):
    raise ValueError(
        f"The layout map's mesh gives each replica {k} devices (its model "
        f"axis {model_layouts.model_axis!r}), but devices_per_replica="
        f"{devices_per_replica!r}. Leave devices_per_replica out.")
  flat = [d for group in model_layouts.device_groups for d in group]
  try:
    return devices_lib.resolve_devices(flat), k
  except ValueError as e:
    raise ValueError(
        f"The layout map's mesh must list this worker's devices, as "
        f"keras.distribution.list_devices() names them. {e}") from None


def _role_names(axis_roles, names):
  """Each role's axis name: `axis_roles`', else the role's own name."""
  axis_roles = dict(axis_roles or {})
  unknown_roles = sorted(set(axis_roles) - set(ROLES))
  if unknown_roles:
    raise ValueError(
        f"Expected the keys of `axis_roles` to be roles among {list(ROLES)}. "
        f"Received: {unknown_roles}.")
  role_of = {role: axis_roles.get(role, role) for role in ROLES}
  unnamed = [name for name in names if name not in role_of.values()]
  if unnamed or len(set(names)) != len(names):
    raise ValueError(
        f"Every axis of the mesh must have a role among {list(ROLES)}: the "
        f"axes {unnamed or list(names)} have none. Name the axes by role "
        f"(DeviceMesh(shape, ('batch', 'model'), devices)), or say which axis "
        f"is which: axis_roles={{'batch': {names[0]!r}, ...}}. Received: mesh "
        f"axes {list(names)}.")
  return role_of


def _device_name(device):
  """A device string from a mesh entry (a string or a `jax.Device`-like)."""
  return device if isinstance(device, str) else str(device)
