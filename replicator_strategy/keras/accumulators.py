"""Gradient accumulators saved replica by replica, so a resumed run is exact.

With `gradient_accumulation_steps`, each replica adds its own gradients to
its own accumulator (accumulating steps move no data), so the replicas'
copies differ. Keras keeps one copy per variable. Here an accumulator is a
`replicator_strategy.variables.ReplicaSum`: it reads and saves, where Keras
and TF look, as the sum of every replica's copy (what one device's
accumulator holds, so stock Keras loads the files), and a save also keeps
every replica's copy beside it:

- `tf.train.Checkpoint` (`PreemptionCheckpoint`): a `REPLICA_VALUES`
  attribute next to the variable's `VARIABLE_VALUE`;
- `.weights.h5`, `.keras` (`BackupAndRestore`): an entry `replica_values`
  inside the optimizer's group of the H5 file, beside the `vars` entry that
  Keras reads (and counts: its load refuses a different number of values).

A load on as many replicas gives each replica its own copy back; on another
number, the sum goes to the first replica and zeros to the others.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope():  # 4 replicas here
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
...   model.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse")
>>> _ = model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=8, verbose=0)
>>> type(model.optimizer._accumulated_gradients[0].value).__name__
'ReplicaSum'
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import sharded_weights
from replicator_strategy import strategy as strategy_lib
from replicator_strategy import variables

# The H5 entry, inside the optimizer's group, holding every replica's copy of
# its accumulators, keyed by their index in `optimizer.variables`.
REPLICA_VALUES_ENTRY = "replica_values"


def per_replica_accumulators(add_variable_from_reference):
  """Gradient accumulators made `variables.ReplicaSum`s."""

  @functools.wraps(add_variable_from_reference)
  def wrapper(self, reference_variable, name=None, initializer="zeros"):
    if (name != "gradient_accumulator" or not isinstance(
        tf.distribute.get_strategy(), strategy_lib.ReplicatorStrategy) or
        # A sharded weight's accumulator is sharded as the weight is.
        sharded_weights.any_sharded([reference_variable])):
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)

    def replica_sum(next_creator, **kwargs):
      kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
      kwargs["aggregation"] = tf.VariableAggregation.SUM
      kwargs[variables.REPLICA_SUM] = True
      return next_creator(**kwargs)

    with tf.variable_creator_scope(replica_sum):
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)

  return wrapper


def _replica_sums(optimizer):
  """(index in `optimizer.variables`, ReplicaSum) of its accumulators."""
  found = []
  for i, variable in enumerate(optimizer.variables):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, (variables.ReplicaSum, variables.SplitReplicaSum)):
      found.append((str(i), value))
  return found


def _entry(path):
  return f"{path}/{REPLICA_VALUES_ENTRY}" if path else REPLICA_VALUES_ENTRY


def save_replica_values(save_own_variables):
  """Keras's save of the optimizer, then every replica's accumulators beside it."""

  @functools.wraps(save_own_variables)
  def wrapper(self, store):
    save_own_variables(self, store)
    sums = _replica_sums(self)
    path = ki.h5_entry_path(store) if sums else None
    if path is None:
      return
    store.make(_entry(path))
    # Every worker gathers (a collective), in the same order.
    for key, variable in sums:
      store[key] = variable.saved_copies()

  return wrapper


def load_replica_values(load_own_variables):
  """Keras's load of the optimizer, then each replica's own accumulators, if
  the file holds them for as many replicas."""

  @functools.wraps(load_own_variables)
  def wrapper(self, store):
    loaded = len(store.keys()) == len(self.variables)  # Else Keras skips.
    load_own_variables(self, store)
    sums = _replica_sums(self)
    path = ki.h5_entry_path(store) if sums and loaded else None
    if path is None or not store.has_path(_entry(path)):
      return
    store.get(_entry(path))
    for key, variable in sums:
      # On another number of replicas, Keras's load of the sum stands.
      if key in store and variable.restores_copies(store[key]):
        variable.assign_copies(store[key])

  return wrapper
