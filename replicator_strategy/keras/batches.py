"""Batches as `fit` cuts them: the `*_on_batch` methods, the build, the input.

- `train_on_batch`, `test_on_batch` and `predict_on_batch` hand the whole
  batch to every replica: N times the work, N copies of every slice of a
  sparse gradient, and N times the rows from `predict_on_batch`. Here the
  batch is cut into per-replica parts as `fit` cuts one, so they train,
  evaluate and predict as one device does.
- Before the first step Keras builds the model from the first batch, averaged
  over the replicas, which fails when the batch splits unevenly, or on a
  sparse batch, or on zero rows, or for a model with no `call()` (a GAN
  trained by its own `train_step`); and it draws that batch from an iterator
  it then drops, so a generator loses the batches it read ahead. Here it
  builds from the batches' spec, reading nothing, and a model with no
  `call()` is left to build in its first step, as without a strategy.

And one thing Keras could not know: `fit` takes a dataset the strategy
distributed itself (`experimental_distribute_dataset`) only if TF's own
classes made it, by name, so it is told that a
`replicator_strategy.global_batch_input.GlobalBatchDataset` is one too.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope():  # 4 replicas here
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model.predict_on_batch(np.ones((10, 3))).shape  # 10 rows, not 4 x 10
(10, 2)
"""

import functools
import inspect

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy import _tf_internal as tfi
from replicator_strategy import global_batch_input
from replicator_strategy import strategy as strategy_lib


def build_from_batch_spec(maybe_symbolic_build):

  @functools.wraps(maybe_symbolic_build)
  def wrapper(self, iterator=None, data_batch=None):
    strategy = self.distribute_strategy
    if not isinstance(strategy, strategy_lib.ReplicatorStrategy):
      return maybe_symbolic_build(self, iterator=iterator,
                                  data_batch=data_batch)
    if iterator is None:
      # `split_on_batch`'s parts: built from the first replica's, as `fit`
      # builds from one replica's spec.
      return maybe_symbolic_build(self, data_batch=tf.nest.map_structure(
          lambda v: strategy.experimental_local_results(v)[0], data_batch))
    if type(self).call is keras.Model.call:
      # No call() to build from (a GAN's custom train_step, say): defer to
      # the step's first trace, as Keras does without a strategy.
      return None
    # Keras's pre-build draws a batch from an iterator it then drops, with
    # whatever that iterator read ahead: a generator loses batches (how many
    # depends on timing), a shuffled PyDataset one shuffle. The batches'
    # spec builds the same, reading nothing.
    spec = ki.distributed_dataset(iterator).element_spec
    return maybe_symbolic_build(self, data_batch=tf.nest.map_structure(
        tfi.one_replica_spec, spec))

  return wrapper


def split_on_batch(on_batch):
  """`Model.train_on_batch`, `test_on_batch` or `predict_on_batch`, its
  batch (`x`, `y`, `sample_weight`) cut into the replicas' parts as `fit`
  cuts a batch.

  Keras gives every replica the whole batch: N times the work, N times the
  rows from `predict_on_batch`, and N copies of each slice of a sparse
  gradient (which Keras's Adam squares one by one). A `class_weight` is
  turned into sample weights from the whole batch's labels first, as Keras
  does; Keras builds the model from the first replica's part
  (`build_from_batch_spec`).
  """
  signature = inspect.signature(on_batch)

  @functools.wraps(on_batch)
  def wrapper(self, *args, **kwargs):
    strategy = self.distribute_strategy
    if not (isinstance(strategy, strategy_lib.ReplicatorStrategy) and
            strategy.extended.num_replicas_in_all_groups > 1):
      return on_batch(self, *args, **kwargs)
    call = signature.bind(self, *args, **kwargs)
    data = call.arguments
    if data.get("class_weight") is not None:
      if data.get("sample_weight") is not None:
        # Keras refuses both, naming the values received.
        return on_batch(self, *args, **kwargs)
      data["sample_weight"] = (
          ki.data_adapter_utils.class_weight_to_sample_weights(
              data["y"], data["class_weight"]))
      data["class_weight"] = None
    for name in ("x", "y", "sample_weight"):
      if data.get(name) is not None:
        data[name] = split_batch(strategy, data[name])
    return on_batch(*call.args, **call.kwargs)

  return wrapper


def takes_global_batch_dataset(is_tf_dataset):

  @functools.wraps(is_tf_dataset)
  def wrapper(x):
    return (isinstance(x, global_batch_input.GlobalBatchDataset) or
            is_tf_dataset(x))

  return wrapper


def split_batch(strategy, batch):
  """A batch (any nest) as per-replica contiguous parts, cut as every global
  batch is (`global_batch_input.split_rows`): cut on the host, each part
  copied to its replica's device."""
  leaves = tf.nest.flatten(batch)
  with tf.device(strategy.extended.host_device):
    # Every replica of every sync group takes its part.
    parts = [global_batch_input.split_rows(
        leaf if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)) else
        tf.convert_to_tensor(leaf),
        strategy.extended.num_replicas_in_all_groups) for leaf in leaves]
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.pack_sequence_as(batch, [
          tf.identity(p[ctx.replica_id_in_sync_group]) for p in parts]))
