"""The one place that reaches TensorFlow's private modules and members.

ReplicatorStrategy reuses TF's distributed-variable classes, input pipeline,
cross-device ops and replica threads. Those live in private modules whose
layout may change between TF releases, so this file, checked against the
TF versions it was written for, lists:

- every import of a private `tensorflow.python.*` module, and the private
  classes the package subclasses or uses (`ThreadReplicaContext`, ...);
- `DISTRIBUTED_VARIABLE_HOOKS`: the private methods of TF's
  `DistributedVariable` that `ShardedVariable` and `SplitVariable` override,
  each checked on
  import to exist still;
- a named function for every private member of a TF object the package
  reads, calls or sets (at the end of this file).

tests/core/test_tf_internal.py checks that no other module reaches a TF
private. Upgrading TF means re-checking this one file.
"""

import collections
import functools
import os
import sys
import weakref

import tensorflow as tf

TESTED_TF_VERSIONS = ("2.21",)
_ALLOW_UNTESTED_ENV = "REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF"


def _check_tf_version():
  major_minor = ".".join(tf.__version__.split(".")[:2])
  if major_minor in TESTED_TF_VERSIONS or os.environ.get(_ALLOW_UNTESTED_ENV):
    return
  raise ImportError(
      f"replicator_strategy relies on private TensorFlow modules and was "
      f"tested with TensorFlow {', '.join(TESTED_TF_VERSIONS)}.x. Received: "
      f"tensorflow=={tf.__version__}. Install a tested version "
      f"(pip install 'tensorflow-cpu==2.21.*') or set {_ALLOW_UNTESTED_ENV}=1 "
      f"to try this one anyway.")


_check_tf_version()

# pylint: disable=g-import-not-at-top,unused-import
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python import pywrap_tfe
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import values
from tensorflow.python.distribute import values_util
from tensorflow.python.eager import context
from tensorflow.python.eager import def_function
from tensorflow.python.eager import record
from tensorflow.python.framework import composite_tensor
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import kernels
from tensorflow.python.framework import ops
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import control_flow_v2_func_graphs
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import constants as trackable_constants
from tensorflow.python.util import nest
from tensorflow.python.checkpoint import restore as checkpoint_restore
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.tsl.profiler.protobuf import xplane_pb2
# pylint: enable=g-import-not-at-top,unused-import

StrategyExtendedV1 = distribute_lib.StrategyExtendedV1
UpdateContext = distribute_lib.UpdateContext
ThreadReplicaContext = mirrored_run._MirroredReplicaContext  # pylint: disable=protected-access
FuncGraph = func_graph.FuncGraph
XSpace = xplane_pb2.XSpace  # What tf.profiler.experimental writes (*.xplane.pb).
# The checkpoint attribute holding a variable's value.
VARIABLE_VALUE_KEY = trackable_constants.VARIABLE_VALUE_KEY
WHILE_LOOP_GRAPHS = (control_flow_v2_func_graphs.WhileBodyFuncGraph,
                     control_flow_v2_func_graphs.WhileCondFuncGraph)
CONTROL_FLOW_GRAPH = control_flow_v2_func_graphs.ControlFlowFuncGraph

# The private methods of TF's `DistributedVariable` that
# `sharding.variables.ShardedVariable` and
# `model_parallel.split_variables.SplitVariable` override: TF reads, updates
# and saves a distributed variable through them.
DISTRIBUTED_VARIABLE_HOOKS = (
    "_as_graph_element", "_dense_var_to_tensor",
    "_export_to_saved_model_graph", "_get", "_get_cross_replica",
    "_get_on_device_or_primary", "_get_replica", "_restore_from_tensors",
    "_serialize_to_tensors", "_update_cross_replica", "_update_replica")


def _check_hooks(base, hooks):
  """Refuses a TF whose `base` lacks a private method a subclass of ours
  overrides (TF would no longer call the override)."""
  missing = [name for name in hooks if not callable(getattr(base, name, None))]
  if missing:
    raise ImportError(
        f"replicator_strategy overrides private methods of TensorFlow's "
        f"{base.__name__}: expected it to define {', '.join(missing)}. "
        f"Received: tensorflow=={tf.__version__}, whose {base.__name__} does "
        f"not. Install a tested version (pip install "
        f"'tensorflow-cpu=={TESTED_TF_VERSIONS[-1]}.*').")


_check_hooks(values.DistributedVariable, DISTRIBUTED_VARIABLE_HOOKS)


class _GradientOfPartsProtocol(
    composite_tensor_gradient.CompositeTensorGradient):

  def get_gradient_components(self, value):
    return list(value.handles)

  def replace_gradient_components(self, value, component_grads):
    return value.combine(component_grads)


class GradientOfParts(composite_tensor.CompositeTensor):
  """A handle a gradient tape differentiates as several variables' handles.

  `tf.GradientTape.gradient` expands a composite source into
  `handles` and gives back `combine(their gradients)`, so a variable held in
  parts gets one gradient of its whole shape.
  """

  __composite_gradient__ = _GradientOfPartsProtocol()

  def __init__(self, handles, combine):
    self.handles = tuple(handles)
    self.combine = combine

  @property
  def _type_spec(self):
    raise NotImplementedError("A GradientOfParts is a gradient source only.")


def one_replica_spec(spec):
  """One replica's part of a distributed iterator's element spec."""
  if isinstance(spec, values.PerReplicaSpec):
    return spec._value_specs[0]  # pylint: disable=protected-access
  return spec


class CheckpointedThrough(tf.__internal__.tracking.Trackable):
  """A base for objects a `tf.train.Checkpoint` saves through `children()`.

  The subclass's `children()` names the trackable objects (a `tf.data`
  iterator, say) that hold its state; TF's protocol method is this class's.
  """

  def children(self):
    raise NotImplementedError

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    del save_type, kwargs
    return self.children()


# Private members of TF objects, each reached through one function here.


def component(distributed_variable, local_index):
  """The component of a distributed variable on this worker's `local_index` device."""
  return distributed_variable._get_replica(local_index)  # pylint: disable=protected-access


def cross_replica_value(sync_on_read_variable):
  """A sync-on-read variable's value aggregated over every replica."""
  return sync_on_read_variable._get_cross_replica()  # pylint: disable=protected-access


def current_component(distributed_variable):
  """The component of a distributed variable for the current device or replica."""
  return distributed_variable._get()  # pylint: disable=protected-access


def devices_match(value, destinations):
  return cross_device_ops._devices_match(value, destinations)  # pylint: disable=protected-access


def gather(ops, value, destinations, axis, options=None):
  """`ops` (a `tf.distribute.CrossDeviceOps`) gathering `value` along `axis`."""
  return ops._gather(value, destinations=destinations, axis=axis,  # pylint: disable=protected-access
                     options=options)


def gather_implementation(ops, value, destinations, axis, options):
  """`ops`'s own gather, below the checks `gather` makes first."""
  return ops._gather_implementation(value, destinations, axis, options)  # pylint: disable=protected-access


def base_replica_ctx_all_reduce(extended, reduce_op, value, options):
  """`StrategyExtendedV1`'s replica-context all-reduce, for a subclass that overrides it."""
  return StrategyExtendedV1._replica_ctx_all_reduce(extended, reduce_op, value,  # pylint: disable=protected-access
                                                    options)


def base_replica_ctx_update(extended, var, fn, args, kwargs, group):
  """`StrategyExtendedV1`'s replica-context update, for a subclass that overrides it."""
  return StrategyExtendedV1._replica_ctx_update(extended, var, fn, args,  # pylint: disable=protected-access
                                                kwargs, group)


def base_merge_call(replica_context, fn, args, kwargs):
  """The replica threads' `merge_call`, for a subclass that overrides it."""
  return ThreadReplicaContext._merge_call(replica_context, fn, args, kwargs)  # pylint: disable=protected-access


def update_in_replica_context(replica_context, var, fn, args, kwargs, group):
  """`ReplicaContext._update`: `fn` on every component of `var`, from a replica."""
  return replica_context._update(var, fn, args=args, kwargs=kwargs,  # pylint: disable=protected-access
                                 group=group)


def base_update_replica(variable_class, variable, update_fn, value, **kwargs):
  """`variable_class`'s (a TF distributed variable class) update from a replica."""
  return variable_class._update_replica(variable, update_fn, value, **kwargs)  # pylint: disable=protected-access


def replica_id(replica_context):
  """A replica context's replica id in the sync group, as a Python int."""
  return replica_context._replica_id_in_sync_group  # pylint: disable=protected-access


def asks_for_xla(function):
  """Whether a `tf.function` was made with `jit_compile=True`."""
  return bool(function._jit_compile)  # pylint: disable=protected-access


def clone_function_without_xla(function, python_function):
  """A `tf.function` like `function` around `python_function`, not compiled
  with XLA as a whole."""
  clone = function._clone(python_function=python_function)  # pylint: disable=protected-access
  clone._jit_compile = None  # pylint: disable=protected-access
  return clone


def called_function_graphs(op):
  """The traced graphs of the functions a graph `op` calls (a `tf.function`
  call, a `tf.cond`'s branches, a `tf.while_loop`'s condition and body)."""
  names = []
  for value in op.node_def.attr.values():
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  graphs = []
  for name in names:
    graph = op.graph
    while graph is not None:
      function = graph._get_function(name)  # pylint: disable=protected-access
      if function is not None:
        graphs.append(function.graph)
        break
      graph = getattr(graph, "outer_graph", None)
  return graphs


def xla_launches_by_device(fn):
  """`fn()`'s result and a Counter: device -> XLA clusters launched on it.

  Read from the run's optimized graphs (TF's run metadata), so it counts
  what really ran compiled, not what was asked for.
  """
  eager = context.context()
  eager.enable_run_metadata()
  try:
    result = fn()
    metadata = eager.export_run_metadata()
  finally:
    eager.disable_run_metadata()
  launches = collections.Counter(
      tf.DeviceSpec.from_string(node.device).to_string()
      for graph in metadata.function_graphs
      for node in graph.post_optimization_graph.node
      if node.op == "_XlaRun")
  return result, launches


def require_registration_barrier(eager_context):
  """Every task must register with the coordination service, or all fail."""
  eager_context._coordination_service_config.cluster_register_with_barrier = True  # pylint: disable=protected-access


def container_strategy(extended):
  """The `tf.distribute.Strategy` that owns `extended` (held by a weak reference)."""
  return extended._container_strategy()  # pylint: disable=protected-access


def set_default_device(extended, device):
  """Ops without a device scope in the strategy's scope go to `device`."""
  extended._default_device = device  # pylint: disable=protected-access


def differentiating_for_higher_order():
  """Whether the graph being built now belongs to a gradient that TF wraps
  for a persistent or nested `GradientTape` (its "cflow_gradient_wrapper")."""
  return control_flow_util_v2.graph_wrapped_for_higher_order_tape_gradients(
      tf.compat.v1.get_default_graph())


def tape_recording():
  """Whether a `GradientTape` (or forward accumulator) of this thread records."""
  return (record.could_possibly_record() and
          not pywrap_tfe.TFE_Py_TapeSetIsStopped())


def uninitialized_variable(shape, dtype, name, trainable):
  """A variable with no value, made past any strategy's variable creator."""
  return resource_variable_ops.UninitializedVariable(
      shape=shape, dtype=dtype, name=name, trainable=trainable)


def export_to_saved_model_graph(variable, **kwargs):
  """TF's SavedModel copy of `variable` (in `kwargs["object_map"]`), and
  the resources it made."""
  return variable._export_to_saved_model_graph(**kwargs)  # pylint: disable=protected-access


def attributes_being_restored():
  """The attributes a checkpoint holds for the variable TF is restoring, while
  it asks that variable (`_serialize_to_tensors`) which ones to read; None
  when nothing is being restored (a save).

  TF reads every attribute the variable names and fails on one the
  checkpoint lacks: a variable that saves an extra attribute names it only
  if it is there. TF passes the checkpoint's attributes no further than its
  `CheckpointPosition`, so they are read from the caller's frame.
  """
  code = checkpoint_restore.CheckpointPosition._create_serialize_to_tensor_saveable.__code__  # pylint: disable=protected-access
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_code is code:
      position = frame.f_locals["self"]
      return {attribute.name for attribute in position.object_proto.attributes}
    frame = frame.f_back
  return None


def custom_gradient(f):
  """`tf.custom_gradient(f)`, its gradient function living as long as the
  graph that can differentiate its op, not as long as the process.

  In a graph, TF registers each custom gradient in its global gradient
  registry for good, and with it all the gradient function holds (for a
  collective: the replica context, hence the strategy). Here the registry
  holds it weakly and the op's graph strongly: it goes, its registry entry
  too, with the graph (a `tf.function` or Keras model dropped).

  >>> @custom_gradient
  ... def double_grad(x):
  ...   return tf.identity(x), lambda dy: 2.0 * dy
  >>> @tf.function
  ... def slope(x):
  ...   with tf.GradientTape() as tape:
  ...     tape.watch(x)
  ...     y = double_grad(x)
  ...   return tape.gradient(y, x)
  >>> float(slope(tf.constant(3.0)))
  2.0
  """
  differentiable = tf.custom_gradient(f)

  @functools.wraps(f)
  def call(*args):
    result = differentiable(*args)
    if not tf.executing_eagerly():
      _held_by_graph(tf.nest.flatten(result, expand_composites=True)[0].op)
    return result

  return call


# keras/rematerialization.py's: tapes paused; variables read, and watched; ops recorded.
tapes_paused, VariableWatcher = record.stop_recording, record.VariableWatcher
record_operation, variable_read = record.record_operation, resource_variable_ops.variable_accessed


def note(tf_object, name, value):
  """Keeps `value` on `tf_object` (a tensor) as our note `name`; it goes with
  the object. `noted` reads it back.

  >>> x = tf.constant(1.0)
  >>> note(x, "origin", "a constant")
  >>> noted(x, "origin"), noted(tf.constant(2.0), "origin")
  ('a constant', None)
  """
  setattr(tf_object, f"_replicator_strategy_{name}", value)


def noted(tf_object, name):
  """Our note `name` on `tf_object` (see `note`), or None."""
  return getattr(tf_object, f"_replicator_strategy_{name}", None)


def owned_by(tf_object, name):
  """The dict `name` of ours that `tf_object` (a graph, a `tf.function`)
  holds, made empty on first ask: it goes with `tf_object`.

  What it holds may refer back to `tf_object` (a graph's tensors, a
  function's Python code): a global `weakref.WeakKeyDictionary` would keep
  such values, and their keys, for good.

  >>> graph = tf.Graph()
  >>> owned_by(graph, "notes")["a"] = 1
  >>> owned_by(graph, "notes")
  {'a': 1}
  """
  attribute = f"_replicator_strategy_{name}"
  owned = getattr(tf_object, attribute, None)
  if owned is None:
    owned = {}
    setattr(tf_object, attribute, owned)
  return owned


def runtime_started():
  """Whether TF's runtime has started (its devices made): a cluster can no
  longer be joined."""
  return context.context()._initialized  # pylint: disable=protected-access


def _held_by_graph(op):
  """Moves the registry's hold on `op`'s custom gradient (named by the
  `_gradient_op_type` attribute custom_gradient gave `op`) to `op.graph`."""
  name = op.get_attr("_gradient_op_type").decode()
  entry = ops._gradient_registry._registry[name]  # pylint: disable=protected-access
  names = owned_by(op.graph, "custom_gradient_names")  # Strings only.
  if not names:
    weakref.finalize(op.graph, _unregister_gradients, names).atexit = False
  names[name] = None
  owned_by(op.graph, "custom_gradients")[name] = entry["type"]
  function = weakref.ref(entry["type"])
  entry["type"] = lambda op, *grads: function()(op, *grads)


def _unregister_gradients(names):
  for name in names:
    ops._gradient_registry._registry.pop(name, None)  # pylint: disable=protected-access
