"""`keras.distribution.set_distribution` on TensorFlow: a ReplicatorStrategy serves it.

Keras 3's own multi-device API (`set_distribution(DataParallel(...))` or
`ModelParallel(layout_map=..., batch_dim_name=...)`, then plain `fit`) does
nothing on TensorFlow as shipped. With the package's Keras patches in place
(`replicator_strategy.use_for_keras_distribution()`, or while a
ReplicatorStrategy lives), setting a distribution makes a ReplicatorStrategy
from it TensorFlow's default strategy (`tf.distribute.experimental_set_strategy`),
so a script written the JAX way trains on every device with no `scope()`:

- `DataParallel`: `ReplicatorStrategy(mesh=..., axis_roles={"batch": ...})`,
  every device of its mesh a replica. A mesh of several axes (which Keras
  on JAX shards over its first axis only, repeating the work over the
  others) is flattened: every device a replica, the global batch cut over
  all of them; the results are those of one device either way.
- `ModelParallel`: `ReplicatorStrategy(layout_map=..., batch_dim_name=...)`:
  the layout map's kernels split over the model axis.
- another `Distribution` (the base class, a subclass of neither): recorded
  by Keras, served by nothing, with a warning once per class.

Setting the same distribution again reuses its strategy; setting None
undoes it, another replaces it; `with distribution.scope():` restores what
was before. A distribution that cannot run here (a mesh of devices this
process lacks, a `ModelParallel` mesh not of 2 axes) is a `ValueError` at
`set_distribution` that names it and says what to change.

The rule between a distribution and a strategy's scope: the ReplicatorStrategy
whose scope is open wins, and the distribution must match it (the same
replicas' devices; for a `ModelParallel` the same layout map and batch axis,
for a `DataParallel` no layout map). A distribution set inside a matching
ReplicatorStrategy's scope, or one whose scope is opened while the
distribution is set, is served by that strategy from then on (TensorFlow's
default once no scope is open); its own options (sharding, sync groups)
stay. A mismatch is a `ValueError` naming both; so is any other
`tf.distribute.Strategy` in use (a `MirroredStrategy`'s scope) when a
distribution is set.

>>> import keras
>>> import tensorflow as tf
>>> import replicator_strategy as rs
>>> rs.use_for_keras_distribution()
>>> distribution = keras.distribution.DataParallel()
>>> keras.distribution.set_distribution(distribution)
>>> strategy = tf.distribute.get_strategy()
>>> type(strategy).__name__, strategy.num_replicas_in_sync
('ReplicatorStrategy', 4)
>>> keras.distribution.set_distribution(None)
>>> tf.distribute.has_strategy()
False
"""

import functools
import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from replicator_strategy import devices as devices_lib
from replicator_strategy import strategy as strategy_lib
from replicator_strategy import warn_once
from replicator_strategy.keras import _internal as ki
from replicator_strategy.model_parallel import layouts as layouts_lib

_strategies = weakref.WeakKeyDictionary()  # Distribution -> its strategy.
_default = None  # The strategy this module made TF's default, if any.
_warned = warn_once.Once()  # Distribution classes warned of as not served.
_local = threading.local()  # .open: scopes open; .pending; .setting.


def use_for_keras_distribution():
  """Makes `keras.distribution.set_distribution` train with a ReplicatorStrategy.

  Puts the package's Keras patches in place for good
  (`replicator_strategy.keras.install()`): the one line a script written
  for Keras on JAX adds, since it sets a distribution before any strategy
  exists. A distribution set already is served from now on.

  >>> import keras
  >>> import numpy as np
  >>> import replicator_strategy as rs
  >>> rs.use_for_keras_distribution()
  >>> keras.distribution.set_distribution(keras.distribution.DataParallel())
  >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  >>> model.compile("sgd", "mse")
  >>> history = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=8,
  ...                     verbose=0)
  >>> model.distribute_strategy.num_replicas_in_sync
  4
  >>> keras.distribution.set_distribution(None)
  """
  from replicator_strategy.keras import patches  # pylint: disable=g-import-not-at-top
  patches.install()
  distribution = keras.distribution.distribution()
  if distribution is not None:
    _served(distribution, _strategy_to_serve(distribution))


def served_by_a_strategy(set_distribution):
  """`set_distribution` that also makes a ReplicatorStrategy serve the
  distribution (see the module's docstring)."""

  @functools.wraps(set_distribution)
  def wrapper(value):
    strategy = _strategy_to_serve(value)  # Refused before anything changes.
    set_distribution(value)
    _served(value, strategy)

  return wrapper


def input_left_to_the_strategy(get_data_adapter):
  """Keras's `get_data_adapter` with a distribution a ReplicatorStrategy
  serves: the input left to the strategy, which splits each global batch
  over every worker's replicas itself. Keras would cut it per process first
  (`Distribution.distribute_dataset`), so each step would train on a part
  of a part, and it refuses NumPy input across processes, which the
  strategy takes."""

  @functools.wraps(get_data_adapter)
  def wrapper(*args, **kwargs):
    distribution = keras.distribution.distribution()
    if distribution is None or distribution not in _strategies:
      return get_data_adapter(*args, **kwargs)
    ki.global_state.set_global_attribute(
        ki.distribution_lib.GLOBAL_ATTRIBUTE_NAME, None)
    try:
      return get_data_adapter(*args, **kwargs)
    finally:
      ki.global_state.set_global_attribute(
          ki.distribution_lib.GLOBAL_ATTRIBUTE_NAME, distribution)

  return wrapper


def scope_hook(strategy, scope):
  """`strategy.scope()` (a ReplicatorStrategy's) that checks it against the
  distribution set, and keeps TF's default in line once no scope is open."""
  if getattr(_local, "setting", False):
    return scope  # The scope experimental_set_strategy holds for us.
  return _TrackedScope(strategy, scope)


class _TrackedScope:
  """A ReplicatorStrategy's scope, counted open while entered."""

  def __init__(self, strategy, scope):
    self._strategy = strategy
    self._scope = scope

  def __enter__(self):
    _check_opened(self._strategy)
    entered = self._scope.__enter__()
    _open_scopes().append(self._strategy)
    return entered

  def __exit__(self, *exc_info):
    try:
      return self._scope.__exit__(*exc_info)
    finally:
      _open_scopes().pop()
      if not _open_scopes() and getattr(_local, "pending", False):
        _local.pending = False
        _sync()


def _open_scopes():
  if not hasattr(_local, "open"):
    _local.open = []
  return _local.open


def _current():
  """The strategy in use (a scope open, or a default set), or None."""
  return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def _strategy_in_use():
  """The ReplicatorStrategy whose scope the user opened (innermost), else
  one in use that this module did not make the default, else None."""
  if _open_scopes():
    return _open_scopes()[-1]
  current = _current()
  if isinstance(current, strategy_lib.ReplicatorStrategy) and (
      current is not _default):
    return current
  return None


def _strategy_to_serve(distribution):
  """The ReplicatorStrategy that is to serve `distribution` (None for None):
  the open scope's if it matches, else the distribution's own, made once."""
  current = _current()
  if distribution is None:
    return None
  if current is not None and not isinstance(current,
                                            strategy_lib.ReplicatorStrategy):
    raise ValueError(
        f"keras.distribution.set_distribution({describe(distribution)}) was "
        f"called while a {type(current).__name__} is in use (its scope is "
        f"open, or it was set with tf.distribute.experimental_set_strategy). "
        f"A Keras distribution on TensorFlow trains with a ReplicatorStrategy "
        f"of its own: set the distribution outside that strategy's scope, or "
        f"use the strategy alone.")
  in_use = _strategy_in_use()
  if in_use is not None and in_use is not _strategies.get(distribution):
    _check_match(in_use, distribution, "is open")
    return in_use
  strategy = _strategies.get(distribution)
  return strategy if strategy is not None else _made_for(distribution)


def _served(distribution, strategy):
  """After Keras recorded `distribution`: `strategy` serves it, TF's default
  now, or once the scopes open are closed."""
  if strategy is not None:
    _strategies[distribution] = strategy
  if _open_scopes():
    _local.pending = True
  else:
    _sync()


def _sync():
  """Makes TF's default the strategy of Keras's distribution (or none),
  unless a strategy this module did not set is in use."""
  distribution = keras.distribution.distribution()
  wanted = _strategies.get(distribution) if distribution is not None else None
  current = _current()
  if current is wanted or (current is not None and current is not _default):
    return
  _set_default(wanted)


def _set_default(strategy):
  global _default
  _local.setting = True
  try:
    tf.distribute.experimental_set_strategy(strategy)
  finally:
    _local.setting = False
  _default = strategy


def _check_opened(strategy):
  """A ReplicatorStrategy's scope is being entered: with a distribution set,
  it must match it, and then serves it from now on."""
  distribution = keras.distribution.distribution()
  if (distribution is None or _strategies.get(distribution) is None or
      _strategies[distribution] is strategy or
      not tf.distribute.in_cross_replica_context()):
    return
  served_by = _strategies[distribution]
  _check_match(strategy, distribution, "is being opened")
  current = _current()
  if current is served_by and current is _default:
    if not tf.executing_eagerly():
      raise ValueError(
          f"A function traced for {strategy!r} runs while keras.distribution "
          f"has {describe(distribution)} set, which {served_by!r} serves. "
          f"The strategy matches the distribution: open its scope before "
          f"training (`with strategy.scope(): model.fit(...)`), and it "
          f"serves the distribution from then on.")
    _set_default(strategy)
  _strategies[distribution] = strategy


def _check_match(strategy, distribution, what):
  """Raises unless `strategy` can serve `distribution`."""
  try:
    wanted = _replica_devices(distribution)
  except ValueError as e:
    raise ValueError(
        f"{describe(distribution)} cannot run on TensorFlow: {e}") from None
  layouts = strategy.extended.options.layouts
  layout_map = (ki.layout_map(distribution)
                if isinstance(distribution, keras.distribution.ModelParallel)
                else None)
  same = (wanted == [list(g) for g in strategy.mesh.device_groups] and
          (layouts.layout_map if layouts else None) is layout_map and
          (layouts is None or
           layouts.batch_axis == distribution.batch_dim_name))
  if not same:
    raise ValueError(
        f"The scope of {strategy!r} {what} while keras.distribution has "
        f"{describe(distribution)} set, and they differ (replicas "
        f"{[list(g) for g in strategy.mesh.device_groups]} with "
        f"{'a' if layouts else 'no'} layout map, against {wanted} with "
        f"{'its' if layout_map is not None else 'no'} layout map). The "
        f"strategy whose scope is open serves the distribution: make them "
        f"match (the same devices; the distribution's layout map passed as "
        f"ReplicatorStrategy(layout_map=...)), or set the distribution "
        f"outside the scope.")


def _replica_devices(distribution):
  """Each replica's devices (full names) that `distribution` describes."""
  if isinstance(distribution, keras.distribution.ModelParallel):
    groups = layouts_lib.ModelLayouts(
        ki.layout_map(distribution), distribution.batch_dim_name).device_groups
  else:
    groups = [[d] for d in _flat_devices(distribution.device_mesh)]
  return [list(devices_lib.resolve_devices(list(g))) for g in groups]


def _flat_devices(device_mesh):
  return [str(d) for d in np.asarray(device_mesh.devices).flat]


def _made_for(distribution):
  """A new ReplicatorStrategy for `distribution`, or a ValueError naming it."""
  if isinstance(distribution, keras.distribution.ModelParallel):
    make = functools.partial(
        strategy_lib.ReplicatorStrategy,
        layout_map=ki.layout_map(distribution),
        batch_dim_name=distribution.batch_dim_name)
  elif isinstance(distribution, keras.distribution.DataParallel):
    devices = _flat_devices(distribution.device_mesh)
    make = functools.partial(
        strategy_lib.ReplicatorStrategy,
        mesh=keras.distribution.DeviceMesh(
            (len(devices),), [distribution.batch_dim_name], devices),
        axis_roles={"batch": distribution.batch_dim_name})
  else:
    _warn_unserved(distribution)
    return None
  try:
    return make()
  except (ValueError, NotImplementedError) as e:
    raise ValueError(
        f"{describe(distribution)} cannot run on TensorFlow: {e}") from None


def _warn_unserved(distribution):
  """Another kind of Distribution: Keras records it, nothing serves it."""
  if not _warned(type(distribution)):
    return
  warnings.warn(
      f"keras.distribution.set_distribution({describe(distribution)}): only "
      f"a DataParallel or a ModelParallel (or a subclass) is served by a "
      f"ReplicatorStrategy on TensorFlow, so nothing is distributed while it "
      f"is set. Use one of those, or ReplicatorStrategy(...) directly.",
      stacklevel=4)


def describe(distribution):
  """A distribution as errors name it: its class, mesh and batch axis."""
  mesh = getattr(distribution, "device_mesh", None)
  if mesh is None:
    return repr(distribution)
  return (f"{type(distribution).__name__}(mesh of shape {tuple(mesh.shape)}, "
          f"axes {list(mesh.axis_names)}, devices {_flat_devices(mesh)}, "
          f"batch_dim_name={distribution.batch_dim_name!r})")
