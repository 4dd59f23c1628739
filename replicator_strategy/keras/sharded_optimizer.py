"""Keras optimizers over sharded optimizer state (`sharded_optimizer_state`).

Wrappers, entries of `replicator_strategy.keras.PATCHES`, act when the strategy is a
`ReplicatorStrategy(shard_optimizer_state=True)`:

- `add_variable_from_reference` (how every Keras optimizer makes a slot
  shaped like a weight) creates a sharded slot (a `ShardedVariable`) instead
  of a mirrored one;
- `_backend_update_step` (Keras's TF step: all-reduce, then `update_step`
  per weight and per device) reduce-scatters the gradients instead (on
  logical CPUs, which share memory: all-reduces them packed, each replica
  reading its slice of the one sum; with `gradient_compression`, as 16-bit
  floats), runs the
  optimizer's own `update_step` once per shard, and all-gathers the weights:
  in one `merge_call` where the replicas can meet, else (inside a replica's
  control flow, as gradient accumulation's `tf.cond`) each replica steps its
  own shard with the replica context's `reduce_scatter` and `all_gather`.

`update_step(gradient, variable, learning_rate)` is handed a `WeightShard`,
which stands in for the weight: Keras finds the weight's slots from it, and
its assignments collect the shard's new value. The slots read inside are
shards too (a `ShardedVariable` in an update context), so the optimizer's math is
Keras's own, on 1/N of the elements per device. That holds for optimizers
whose math is elementwise and whose slots all come from
`add_variable_from_reference`: those in `SUPPORTED_OPTIMIZERS`, and their
subclasses that keep `update_step`. Others are refused when they build. EMA
copies and gradient accumulators stay whole (`_KEPT_WHOLE`). A third
wrapper, of `_apply_weight_decay`, leaves AdamW's decay to the step, which
decays each shard before its update, as Keras decays each weight.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(shard_optimizer_state=True)
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
...   model.compile(keras.optimizers.Adam(), "mse")
>>> history = model.fit(np.ones((16, 8)), np.ones((16, 4)), verbose=0)
>>> type(model.optimizer).__name__  # Adam's m and v: a quarter on each of 4 CPUs
'Adam'
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy import options as options_lib
from replicator_strategy import replica_context
from replicator_strategy.model_parallel import split_variables
from replicator_strategy.sharding import creation
from replicator_strategy.sharding import optimizer_state as sharded
from replicator_strategy.sharding import variables as sharded_variables
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import model_parallel
from replicator_strategy.keras import step_context

# Keras's optimizers whose `update_step` is elementwise on the weight, its
# gradient and slots shaped like it (Lamb's layer norms, Adafactor's factored
# moments and Muon's orthogonalisation are not).
SUPPORTED_OPTIMIZERS = (keras.optimizers.SGD, keras.optimizers.Adam,
                        keras.optimizers.AdamW, keras.optimizers.RMSprop,
                        keras.optimizers.Adagrad, keras.optimizers.Adadelta,
                        keras.optimizers.Adamax, keras.optimizers.Nadam,
                        keras.optimizers.Lion, keras.optimizers.Ftrl)


# Optimizer variables kept whole: EMA copies of the weights, mirrored, which
# Keras updates from each replica, and gradient accumulators, which hold each
# replica's own sum (accumulation steps move no data, as DDP's `no_sync`;
# `accumulators`).
_KEPT_WHOLE = ("average", "gradient_accumulator")


def _sharding_strategy():
  options = options_lib.of()
  if options and options.sharding.optimizer_state:
    return tf.distribute.get_strategy()
  return None


def shard_slots(add_variable_from_reference):

  @functools.wraps(add_variable_from_reference)
  def wrapper(self, reference_variable, name=None, initializer="zeros"):
    if _sharding_strategy() is None:
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)
    check_supported(self, "shard_optimizer_state=True")
    if name in _KEPT_WHOLE or model_parallel.split_variable(reference_variable):
      # A split weight's slots are split as it is (a 1/k part per device).
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)
    with creation.requesting(flat=True):
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)

  return wrapper


def decay_in_shards(apply_weight_decay):
  """Keras's weight decay (AdamW's) of every replica's copy, left to the
  sharded step for the weights it updates, which decays each shard once."""

  @functools.wraps(apply_weight_decay)
  def wrapper(self, variables):
    if _sharding_strategy() is None:
      return apply_weight_decay(self, variables)
    # Sharded weights (variable_partitioner) decay shard by shard in Keras's
    # own update already, split ones (a layout map) part by part.
    return apply_weight_decay(self, [
        v for v in variables if isinstance(
            v.value if isinstance(v, keras.Variable) else v,
            (sharded_variables.ShardedVariable,
             split_variables.SplitVariable))])

  return wrapper


def _decay(optimizer, stand_in):
  """Keras's decoupled weight decay (as its TF backend writes it), on a shard."""
  if optimizer.weight_decay is None or not ki.uses_weight_decay(
      optimizer, stand_in.weight):
    return
  lr = tf.cast(optimizer.learning_rate, stand_in.dtype)
  wd = tf.cast(optimizer.weight_decay, stand_in.dtype)
  stand_in.assign_sub(stand_in.value * wd * lr)


def sharded_update_step(backend_update_step):

  @functools.wraps(backend_update_step)
  def wrapper(self, grads, trainable_variables, learning_rate):
    strategy = _sharding_strategy()
    if strategy is None:
      return backend_update_step(self, grads, trainable_variables,
                                 learning_rate)
    weights = [v.value if isinstance(v, keras.Variable) else v
               for v in trainable_variables]
    split = [i for i, w in enumerate(weights) if model_parallel.split_variable(w)]
    if split:  # Keras's own step, part by part; the others' state sharded.
      backend_update_step(self, [grads[i] for i in split],
                          [trainable_variables[i] for i in split],
                          learning_rate)
      grads = [g for i, g in enumerate(grads) if i not in split]
      weights = [w for i, w in enumerate(weights) if i not in split]
      if not weights:
        return None
    update = functools.partial(_update_shard, self)

    def step(exchange, summed, grads, learning_rate):
      # Each logical device's weights (a pipeline stage's) among its devices.
      return sharded.step_on_their_devices(
          strategy, lambda grads, device: exchange(strategy, grads, summed,
                                                   device),
          grads, weights, learning_rate, update)

    ctx = tf.distribute.get_replica_context()
    if ctx is None:  # Called in cross-replica context: the gradients are global.
      return step(sharded.AllReplicas, True, grads, learning_rate)
    # keras.gradient_exchange sums the gradients first where the optimizer clips.
    summed = step_context.gradients_summed(self)
    if not replica_context.merge_call_possible():
      # Inside control flow (gradient accumulation's tf.cond): each replica
      # steps its own shard through run-time collectives.
      return step(sharded.OneReplica, summed, grads, learning_rate)

    def merge_fn(_, grads, learning_rate):
      return step(sharded.AllReplicas, summed, grads, learning_rate)

    return ctx.merge_call(merge_fn, args=(list(grads), learning_rate))

  return wrapper


def _update_shard(optimizer, weight, gradient, shard, learning_rate):
  """`optimizer`'s own step (weight decay, `update_step`) on a `shard` of
  `weight`; returns its new value."""
  stand_in = WeightShard(weight, shard)
  _decay(optimizer, stand_in)
  optimizer.update_step(gradient, stand_in, learning_rate)
  return stand_in.value


class WeightShard:
  """One shard of a model weight, standing in for it in `update_step`.

  The optimizer finds the weight's slots from it (Keras keys them by the
  distributed weight it belongs to) and its assignments collect the shard's
  new value, which the all-gather then writes to every copy of the weight.
  """

  def __init__(self, weight, value):
    self.weight = weight
    self.value = value

  @property
  def dtype(self):
    return self.value.dtype

  @property
  def shape(self):
    return self.value.shape

  def _distributed_container(self):
    # Keras's TF optimizer keys slots by this container (its `_var_key`).
    return self.weight

  def __tf_tensor__(self, dtype=None, name=None):
    return tf.convert_to_tensor(self.value, dtype=dtype, name=name)

  def assign(self, value, use_locking=False, name=None, read_value=True):
    del use_locking, name, read_value
    self.value = tf.convert_to_tensor(value, dtype=self.dtype)
    return self.value

  def assign_add(self, delta, use_locking=False, name=None, read_value=True):
    return self.assign(self.value + delta, use_locking, name, read_value)

  def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
    return self.assign(self.value - delta, use_locking, name, read_value)


def check_supported(optimizer, option):
  """Refuses an optimizer whose `update_step` is not one known to be elementwise.

  `option` names the strategy's option that shards, for the message.

  Subclasses that keep a supported class's `update_step` (changing a schedule
  or a config, say) are accepted.
  """
  owner = next(cls for cls in type(optimizer).__mro__
               if "update_step" in vars(cls))
  if owner not in SUPPORTED_OPTIMIZERS:
    raise NotImplementedError(
        f"ReplicatorStrategy({option}) supports the Keras "
        f"optimizers {', '.join(o.__name__ for o in SUPPORTED_OPTIMIZERS)} "
        f"and subclasses that keep their update_step (elementwise math, "
        f"slots shaped like the weights). Received: "
        f"optimizer={type(optimizer).__name__}, whose update_step is "
        f"{owner.__name__}'s. Use one of those, or a strategy without "
        f"{option}.")
