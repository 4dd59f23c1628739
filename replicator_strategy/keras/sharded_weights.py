"""Keras layers and optimizers over sharded weights (`sharding/variables.py`).

With `ReplicatorStrategy(variable_partitioner=...)`, the weights the
partitioner cuts are `ShardedVariable`s: inside a replica a layer reads the
whole weight (an all-gather), and the gradient Keras gets for it is this
replica's shard of the gradient, already summed over the replicas (a
reduce-scatter). Four wrappers, entries of `replicator_strategy.keras.PATCHES`,
fit Keras to that:

- `_backend_update_step`: each replica runs the optimizer's own
  `update_step` on its shard (the weight's shard, its gradient, the slots'
  shards), with no all-reduce; other weights go on as before;
- `_all_reduce_sum_gradients` (called where an optimizer clips, which needs
  whole gradients): a sharded weight's gradient is all-gathered, its sum is
  there already;
- `add_variable_from_reference`: an EMA copy of a sharded weight reads whole
  in a replica, as Keras updates it from the weight's value; the optimizer
  must be one whose math is elementwise;
- `Embedding.call`: a sharded table gives only the rows the batch asks for
  (`sharding/variables.py`'s `lookup`), never the whole table; so does a
  table split by columns over a replica's devices and sharded by rows
  (`model_parallel/sharded_parts.py`), part by part, its output in parts.

Weights split over a replica's devices and sharded over the replicas
(`ShardedSplitVariable`) are sharded weights here too: each replica steps its
shards of every part, on the part's device.

>>> from replicator_strategy import ReplicatorStrategy
>>> partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(4)
>>> with ReplicatorStrategy(variable_partitioner=partitioner).scope():
...   model = keras.Sequential([keras.Input((5,), dtype="int32"),
...                             keras.layers.Embedding(1000, 8)])
>>> [c.shape.as_list() for c in model.weights[0].value.values]
[[250, 8], [250, 8], [250, 8], [250, 8]]
"""

import functools

import keras
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import replica_context
from replicator_strategy.model_parallel import megatron
from replicator_strategy.model_parallel import sharded_parts
from replicator_strategy.sharding import creation
from replicator_strategy.sharding import variables as sharded_variables
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import sharded_optimizer
from replicator_strategy.keras import step_context


def refuse_clipping_accumulated():
  """Clipping accumulated gradients of sharded weights is not implemented."""
  raise NotImplementedError(
      "Gradient clipping (clipnorm, global_clipnorm, clipvalue) with "
      "gradient_accumulation_steps is not supported for weights sharded "
      "by ReplicatorStrategy(variable_partitioner=...) yet. Drop one of "
      "the three: clipping, accumulation, or the partitioner.")


def any_sharded(variables):
  """Whether a weight among `variables` is sharded (variable_partitioner)."""
  return any(_sharded_weight(v) is not None for v in variables)


def _sharded_weight(variable):
  """`variable`'s `ShardedVariable` (or `ShardedSplitVariable`) if it is a
  sharded weight, else None."""
  if isinstance(variable, keras.Variable):
    variable = variable.value
  if (isinstance(variable, (sharded_variables.ShardedVariable,
                            sharded_parts.ShardedSplitVariable)) and
      variable.replica_reads == "whole" and variable.trainable):
    return variable
  return None


def update_shards(backend_update_step):

  @functools.wraps(backend_update_step)
  def wrapper(self, grads, trainable_variables, learning_rate):
    sharded = [_sharded_weight(v) for v in trainable_variables]
    if not any(w is not None for w in sharded):
      return backend_update_step(self, grads, trainable_variables,
                                 learning_rate)
    # Whole gradients where Keras summed them first (an optimizer that clips),
    # or in cross-replica context; else this replica's summed shard.
    whole = (step_context.gradients_summed(self) or
             tf.distribute.get_replica_context() is None)
    rest = [(g, v) for g, v, w in zip(grads, trainable_variables, sharded)
            if w is None]
    updates = []
    if rest:
      updates.append(backend_update_step(
          self, [g for g, _ in rest], [v for _, v in rest], learning_rate))
    for grad, weight in zip(grads, sharded):
      if weight is not None and grad is not None:
        updates.append(_update_weight(self, grad, weight, learning_rate,
                                      whole))
    return tf.group([u for u in updates if u is not None])

  return wrapper


def _update_weight(optimizer, grad, weight, learning_rate, whole):
  """The optimizer's step on every shard of `weight` this process updates."""
  ctx = tf.distribute.get_replica_context()
  if ctx is None:

    def step(component, grad, learning_rate):
      shard = weight.shard_index(tfi.distribute_lib.get_update_replica_id())
      return optimizer.update_step(
          weight.layout.shard(tf.convert_to_tensor(grad), shard), component,
          learning_rate)

    return weight.distribute_strategy.extended.update(
        weight, step, args=(grad, learning_rate), group=True)
  # Each replica steps its own shards: no exchange needed.
  local = ctx.local_index
  if whole:
    grad = weight.own_shards(tf.convert_to_tensor(grad), local)
  return weight.update_own_shards(
      local, lambda shard, grad: optimizer.update_step(grad, shard,
                                                       learning_rate), grad)


def gather_for_clipping(all_reduce_sum_gradients):

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    pairs = list(grads_and_vars)
    sharded = [_sharded_weight(v) for _, v in pairs]
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not any(w is not None for w in sharded):
      return all_reduce_sum_gradients(self, pairs)
    if self.gradient_accumulation_steps:
      refuse_clipping_accumulated()
    rest = iter(all_reduce_sum_gradients(
        self, [p for p, w in zip(pairs, sharded) if w is None]))
    summed = []
    for (grad, var), weight in zip(pairs, sharded):
      if weight is None:
        summed.append(next(rest))
      elif grad is None:
        summed.append((None, var))
      else:  # Summed over the replicas already: gather the shards.
        summed.append((weight.gather_own_shards(
            ctx, tf.convert_to_tensor(grad)), var))
    return summed

  return wrapper


def average_reads_whole(add_variable_from_reference):

  @functools.wraps(add_variable_from_reference)
  def wrapper(self, reference_variable, name=None, initializer="zeros"):
    if _sharded_weight(reference_variable) is None:
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)
    sharded_optimizer.check_supported(self, "variable_partitioner=...")
    if name != "average":
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)
    with creation.requesting(reads_whole=True):
      return add_variable_from_reference(self, reference_variable, name=name,
                                         initializer=initializer)

  return wrapper


def lookup_rows(call):

  @functools.wraps(call)
  def wrapper(self, inputs):
    table = _sharded_weight(ki.embeddings_variable(self))
    ctx = tf.distribute.get_replica_context()
    if (table is None or self.lora_enabled or self.quantization_mode or
        not isinstance(ctx, replica_context.ReplicaContext)):
      return call(self, inputs)
    if inputs.dtype not in (tf.int32, tf.int64):
      inputs = tf.cast(inputs, tf.int32)
    if isinstance(table, sharded_parts.ShardedSplitVariable):
      if not table.looks_up_rows:  # Gathered whole, part by part.
        return call(self, inputs)
      parts = []
      for part in table.lookup(inputs):
        with tf.device(part.device):
          parts.append(tf.cast(part, self.compute_dtype))
      return megatron.assembled(parts, [p.device for p in parts], -1)
    if table.layout.axis != 0:  # Sharded by columns: read whole.
      return call(self, inputs)
    return tf.cast(sharded_variables.lookup(table, inputs), self.compute_dtype)

  return wrapper
