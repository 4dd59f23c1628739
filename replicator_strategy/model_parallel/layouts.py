"""Keras's `LayoutMap` read on TensorFlow: which weights split, along what.

`ReplicatorStrategy(layout_map=...)` takes a `keras.distribution.LayoutMap`
over a 2-D `DeviceMesh`: its batch axis (`batch_dim_name`, default the
mesh's first) is the replicas, its other axis (the model axis) each
replica's logical devices. A mesh with a stage axis (a pipeline's) or a
group axis (sync groups) too, named by role or through the strategy's
`axis_roles`, is read as a row per stage of each replica.

A variable whose Keras path a key matches (as Keras matches them: the
exact key, else one `re.fullmatch`) and whose layout names the model axis
in one dimension is a `split_variables.SplitVariable` split along that
dimension; every other variable is replicated over the model axis. A
layout that names the batch axis in a dimension shards the weight over the
replicas along it (ZeRO-3 for that weight: a
`sharding.variables.ShardedVariable`, or, split too, a
`sharded_parts.ShardedSplitVariable`).

>>> import keras
>>> import replicator_strategy as rs
>>> mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"),
...                                      rs.split_cpu(4))
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["dense.*kernel"] = (None, "model")
>>> layouts = ModelLayouts(layout_map)
>>> layouts.split_axis("dense_1/kernel", (4, 6))
1
>>> layouts.split_axis("dense_1/bias", (6,)) is None
True
>>> layout_map["up.*kernel"] = ("batch", "model")
>>> layouts.placement("up/kernel", (4, 6))  # (split, sharded) dimensions
(1, 0)
"""

import contextlib
import threading

from absl import logging
import numpy as np
import tensorflow as tf

from replicator_strategy import mesh as mesh_lib
from replicator_strategy import warn_once

_creating = threading.local()  # .variable: (path, shape) being created.


@contextlib.contextmanager
def creating(path, shape, placement=None):
  """Marks the variable created inside as a Keras variable's (`path`);
  `placement` (split, sharded dimensions) in place of the layout map's (the
  sharded one may be the `RowLayout` of each part, kept as it is)."""
  previous = getattr(_creating, "variable", None)
  _creating.variable = (path, tuple(shape), placement)
  try:
    yield
  finally:
    _creating.variable = previous


def variable_being_created():
  """(path, shape) of the Keras variable being created, or None."""
  variable = getattr(_creating, "variable", None)
  return variable and variable[:2]


def placement_given():
  """The placement `creating` was given for the variable, or None."""
  variable = getattr(_creating, "variable", None)
  return variable and variable[2]


class ModelLayouts:
  """A `keras.distribution.LayoutMap`, as the replicas' device groups."""

  def __init__(self, layout_map, batch_dim_name=None, axis_roles=None):
    mesh = getattr(layout_map, "device_mesh", None)
    if mesh is None or not hasattr(mesh, "axis_names"):
      raise ValueError(
          f"Expected `layout_map` to be a keras.distribution.LayoutMap over a "
          f"keras.distribution.DeviceMesh. Received: {layout_map!r}.")
    names, devices = list(mesh.axis_names), np.asarray(mesh.devices)
    roles = dict(axis_roles or {})
    if batch_dim_name is not None:
      roles.setdefault("batch", batch_dim_name)
    if len(names) > 2:  # A row per (group, batch, stage): a stage's devices.
      names, devices = _as_rows(names, devices, roles)
    if len(names) != 2:
      raise ValueError(
          f"ReplicatorStrategy(layout_map=...) takes a 2-D DeviceMesh: a batch "
          f"axis (the replicas) and a model axis (each replica's devices), or "
          f"one with a stage axis (a pipeline's) or a group axis (sync "
          f"groups) too, named by role or through `axis_roles`. Received a "
          f"mesh of shape {tuple(mesh.shape)} with axes {names}. Build it as "
          f"DeviceMesh((replicas, k), ('batch', 'model'), devices).")
    batch = roles.get("batch", names[0])
    if batch not in names:
      raise ValueError(
          f"`batch_dim_name={batch_dim_name!r}` names no axis of the layout "
          f"map's mesh, whose axes are {names}. Pass one of them, or None for "
          f"the first.")
    self.layout_map = layout_map
    self.batch_axis = batch
    self.model_axis = names[1 - names.index(batch)]
    if names.index(batch) == 1:
      devices = devices.T
    self.device_groups = tuple(
        tuple(_device_name(d) for d in row) for row in devices)
    self.devices_per_replica = len(self.device_groups[0])
    self.matched_keys = set()
    self._warned_keys = warn_once.Once()

  def split_axis(self, path, shape):
    """The dimension the model axis splits the variable at `path`, or None."""
    return self.placement(path, shape)[0]

  def placement(self, path, shape):
    """(the dimension the model axis splits, the one the batch axis shards)
    of the variable (or output) at `path`, each None where none."""
    if path is None:
      return None, None
    layout = self.layout_map[path]
    if layout is None:
      return None, None
    self.matched_keys.update(
        key for key in self.layout_map if self.layout_map[key] is layout)
    return self.axes_placement(path, layout.axes, shape)

  def axes_placement(self, path, axes, shape):
    """`placement` for a layout's `axes` (the layout of `path`)."""
    axes = tuple(axes)
    shape = tuple(shape)
    if len(axes) != len(shape):
      raise ValueError(
          f"The layout {axes} for the variable {path!r} has {len(axes)} "
          f"dimension(s), but the variable has {len(shape)} (shape "
          f"{list(shape)}). Give the layout one entry per dimension, None "
          f"where it is not split.")
    unknown = [a for a in axes
               if a not in (None, self.model_axis, self.batch_axis)]
    if unknown:
      raise ValueError(
          f"The layout {axes} for {path!r} names {unknown}, which is not an "
          f"axis of the mesh (batch {self.batch_axis!r}, model "
          f"{self.model_axis!r}).")
    return (self._split_dimension(path, axes, shape),
            _one_dimension(path, axes, self.batch_axis, "shards", "the replicas"))

  def _split_dimension(self, path, axes, shape):
    axis = _one_dimension(path, axes, self.model_axis, "splits",
                          "each replica's devices")
    if axis is None:
      return None
    k = self.devices_per_replica
    if shape[axis] is None or shape[axis] % k:  # A batch axis is None.
      raise ValueError(
          f"The layout {axes} for {path!r} splits dimension {axis} (size "
          f"{shape[axis]}, shape {list(shape)}) over the model axis "
          f"{self.model_axis!r} of size {k}, which does not divide it. Pick "
          f"sizes divisible by {k} (for attention: heads, and key/value heads), "
          f"or leave that dimension None.")
    return axis

  def warn_unmatched_keys(self):
    """Warns, once per key, of layout keys no variable has matched so far.

    A renamed layer otherwise leaves its weights silently replicated.
    """
    unmatched = [key for key in self.layout_map
                 if key not in self.matched_keys and
                 not key.endswith("/output")]  # Those match tensors.
    for key in filter(self._warned_keys, unmatched):
      logging.warning(
          "ReplicatorStrategy: the layout map key %r matches no variable "
          "created in the strategy's scope, so nothing is split by it. Keys "
          "match a variable's full path (`variable.path`, e.g. "
          "'sequential/dense/kernel') with re.fullmatch: start the key with "
          "'.*' to match any model name.", key)


def _as_rows(names, devices, roles):
  """A mesh's axis names and devices as a 2-D mesh's: a row per stage of
  each replica of each group, in that order (`mesh.ROLES`'), the model axis
  across. `roles` (role -> axis name) names the axes whose names are not
  their roles; where none is a role, their position does
  (`mesh.POSITIONAL_ROLES`)."""
  if not roles and not set(names) & set(mesh_lib.ROLES):
    roles = dict(zip(mesh_lib.POSITIONAL_ROLES.get(len(names), ()), names))
  name_of = {role: roles.get(role, role) for role in mesh_lib.ROLES}
  others = [n for n in names if n not in (name_of["group"], name_of["stage"])]
  if len(others) != 2:
    return names, devices  # The 2-D check names the mistake.
  batch = roles.get("batch", others[0])
  model = [n for n in others if n != batch]
  if batch not in others or len(model) != 1:
    return names, devices
  name_of.update(batch=batch, model=model[0])
  order = [names.index(name_of[role]) for role in mesh_lib.ROLES
           if name_of[role] in names]
  devices = devices.transpose(order)
  return [batch, model[0]], devices.reshape(-1, devices.shape[-1])


def _one_dimension(path, axes, name, verb, over):
  """The dimension of the layout `axes` that names the mesh axis `name`, or
  None; several are refused."""
  named = [d for d, a in enumerate(axes) if a == name]
  if len(named) > 1:
    raise ValueError(
        f"The layout {axes} for {path!r} {verb} {len(named)} dimensions over "
        f"{over} (the mesh axis {name!r}); name it in one dimension.")
  return named[0] if named else None


def _device_name(device):
  return tf.DeviceSpec.from_string(str(device)).to_string()
