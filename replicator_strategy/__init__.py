"""replicator-strategy: TF-Replicator as a `tf.distribute.Strategy`.

>>> import keras
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy()   # every GPU, else every CPU device
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.count_params()
4

Importing the package sets TF_CPP_MIN_LOG_LEVEL to 2 unless it is set (no
TensorFlow INFO or WARNING lines; 0 shows them, see `cli.tensorflow_logs`),
and loads nothing heavy: TensorFlow and Keras come with
the first public name used (the Keras patches, `replicator_strategy.keras`,
with the first `ReplicatorStrategy` made: they stay while one lives), so the
launcher and `python -m replicator_strategy --help` start at once, and
without TensorFlow installed. The TensorFlow check runs there too: a missing
or too old TensorFlow is an `ImportError` that says which extra to install.
"""

import importlib
import re

from replicator_strategy.cli import tensorflow_logs

__version__ = "0.1.0"

tensorflow_logs.quiet_unless_asked()

# Public name -> the module that defines it.
_PUBLIC = {
    "Pipeline": "replicator_strategy.options",
    "PreemptionCheckpoint": "replicator_strategy.cluster.preemption_checkpoint",
    "ReduceOp": "replicator_strategy.collectives.reduce_op",
    "ReplicaContext": "replicator_strategy.replica_context",
    "ReplicatorExtended": "replicator_strategy.extended",
    "ReplicatorStrategy": "replicator_strategy.strategy",
    "Sharding": "replicator_strategy.options",
    "SyncGroups": "replicator_strategy.options",
    "local_devices": "replicator_strategy.devices",
    "split_cpu": "replicator_strategy.devices",
    "use_for_keras_distribution":
        "replicator_strategy.keras.distribution_strategy",
}
__all__ = sorted(_PUBLIC)

MIN_TENSORFLOW = (2, 21)
_INSTALL_HINT = (
    "Install the package with the extra that brings TensorFlow: "
    "pip install 'replicator-strategy[cpu]' (tensorflow-cpu) or "
    "pip install 'replicator-strategy[gpu]' (TensorFlow with CUDA); from a "
    "clone of the repository: pip install '.[cpu]' or '.[gpu]'.")


def check_tensorflow():
  """Imports TensorFlow; an ImportError naming the extra if it is missing or old.

  >>> check_tensorflow().__version__.startswith("2.")
  True
  """
  try:
    tf = tensorflow_logs.quiet_import()
  except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "tensorflow":
      raise
    raise ImportError(
        f"replicator_strategy needs TensorFlow "
        f"{'.'.join(map(str, MIN_TENSORFLOW))} or newer, which is not "
        f"installed. {_INSTALL_HINT}") from None
  found = getattr(tf, "__version__", "unknown")
  numbers = re.match(r"(\d+)\.(\d+)", found)
  if not numbers or tuple(map(int, numbers.groups())) < MIN_TENSORFLOW:
    raise ImportError(
        f"replicator_strategy needs TensorFlow "
        f"{'.'.join(map(str, MIN_TENSORFLOW))} or newer. Found: TensorFlow "
        f"{found} (at {getattr(tf, '__file__', 'unknown')}). {_INSTALL_HINT}")
  return tf


_loading = False


def _load():
  global _loading
  _loading = True
  try:
    check_tensorflow()
    keras_integration = importlib.import_module("replicator_strategy.keras")
    for name, module in _PUBLIC.items():
      globals()[name] = getattr(importlib.import_module(module), name)
    strategy = importlib.import_module("replicator_strategy.strategy")
    strategy.CREATION_HOOKS.append(keras_integration.patches.hold)
    strategy.SCOPE_HOOKS.append(
        keras_integration.distribution_strategy.scope_hook)
    strategy.PIPELINE_STAGES.append(
        keras_integration.stage_placement.stages_of)
  finally:
    _loading = False


def __getattr__(name):
  # While loading, the submodules' own `from replicator_strategy import x`
  # must fall through to importing x.
  if (name in _PUBLIC or name == "keras") and not _loading:
    _load()
    return globals()[name]
  raise AttributeError(f"module 'replicator_strategy' has no attribute "
                       f"{name!r}")


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC) | {"keras"})
