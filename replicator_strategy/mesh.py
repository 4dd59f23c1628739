"""The strategy's device mesh: this worker's devices as axes, each with a role.

Every kind of parallelism is an axis of one mesh, as in GSPMD, torchtitan's
DeviceMesh and Keras's own `keras.distribution.DeviceMesh`:

- `"group"`, outermost: sync groups (`docs/sync-groups.md`), each training
  apart between averaging rounds;
- `"batch"`: the replicas of a group, data parallel; sharded optimizer state
  and ZeRO-3 weights are cut over it (`docs/sharding.md`);
- `"model"`, innermost: one replica's devices, over which a layout map
  splits weights (tensor parallel, `docs/model-parallel.md`).

An axis left out has size 1. `ReplicatorStrategy(mesh=DeviceMesh(...))`
names the axes; the older keywords build the same mesh (`devices` and
`devices_per_replica=k`: batch x model; `sync_groups=G`: a group axis).
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

import numpy as np

ROLES = ("group", "batch", "model")


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
                    num_workers=1):
    """The mesh the shorthand keywords describe: this worker's `devices`,
    `devices_per_replica` to a replica, `sync_groups` over every worker."""
    replicas = len(devices) // devices_per_replica
    roles, shape = ["batch"], [replicas]
    if sync_groups > 1:
      local_groups = max(sync_groups // num_workers, 1)
      roles, shape = ["group", "batch"], [local_groups,
                                         max(replicas // local_groups, 1)]
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
    """Each replica's devices (its model axis), replicas in order."""
    k = self.size("model")
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
