"""The one place that reaches Keras's private modules and members.

Checked against the Keras versions this file was written for, as
`_tf_internal` is for TensorFlow, it lists:

- every private Keras module the package imports (some own functions that
  `patches.PATCHES` wraps);
- a named function for every private member of a Keras object that the
  patch wrappers and the rest of the package read, call or set (the
  wrapped names themselves are in the table `patches.PATCHES`).

tests/core/test_tf_internal.py checks that no other module reaches a Keras
private. Upgrading Keras means re-checking this file and the table in
`patches`, and one contract kept elsewhere: the TF optimizer finds a
weight's slots through `_distributed_container()` (its `_var_key`), which
`sharded_optimizer.WeightShard` provides to stand in for a weight.
"""

import contextlib
import os

import keras

TESTED_KERAS_VERSIONS = ("3.15",)
_ALLOW_UNTESTED_ENV = "REPLICATOR_STRATEGY_ALLOW_UNTESTED_KERAS"


def check_keras_version(version=keras.__version__):
  """Refuses a Keras version whose private names were not checked."""
  major_minor = ".".join(version.split(".")[:2])
  if major_minor in TESTED_KERAS_VERSIONS or os.environ.get(
      _ALLOW_UNTESTED_ENV):
    return
  raise ImportError(
      f"replicator_strategy wraps Keras functions (some private) and was "
      f"tested with Keras {', '.join(TESTED_KERAS_VERSIONS)}.x. Received: "
      f"keras=={version}. Install a tested version (pip install "
      f"'keras=={TESTED_KERAS_VERSIONS[-1]}.*') or set "
      f"{_ALLOW_UNTESTED_ENV}=1 to try this one anyway.")


check_keras_version()

# pylint: disable=g-import-not-at-top,unused-import
from keras.src.backend.tensorflow import core as tf_core  # Its remat.
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib
from keras.src.backend.tensorflow import numpy as tf_numpy  # Its `add`.
from keras.src.backend.tensorflow import random as tf_random  # Its draws.
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.distribution import distribution_lib  # Distribution.scope's set_distribution.
from keras.src.backend.common import masking  # A tensor's `_keras_mask`.
from keras.src.layers.convolutional.base_conv import BaseConv
from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose
from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
from keras.src.layers.convolutional.base_separable_conv import BaseSeparableConv
from keras.src.layers.pooling.base_pooling import BasePooling
from keras.src.layers.regularization.spatial_dropout import BaseSpatialDropout
from keras.src.backend.common import global_state  # Where the distribution set is kept.
from keras.src.losses import loss  # Where Keras scales losses.
from keras.src.models import functional  # The layer graph a pipeline cuts.
from keras.src.optimizers.base_optimizer import clip_by_global_norm  # Its global_clipnorm.
from keras.src.saving import saving_lib  # The H5 store of weights files.
from keras.src.trainers import data_adapters  # Which data fit takes.
from keras.src.trainers.data_adapters import data_adapter_utils  # class_weight as sample weights.
from keras.src.trainers import trainer
# pylint: enable=g-import-not-at-top,unused-import


def layout_map(model_parallel):
  """The `LayoutMap` a `keras.distribution.ModelParallel` was made with."""
  return model_parallel._layout_map  # pylint: disable=protected-access


def multi_worker_concat(value, strategy):
  """Keras's gather of every worker's rows, as it does for MultiWorkerMirroredStrategy."""
  return tf_trainer._multi_worker_concat(value, strategy)  # pylint: disable=protected-access


def distributed_dataset(epoch_iterator):
  """The distributed dataset a Keras `TFEpochIterator` iterates over."""
  return epoch_iterator._get_iterator()  # pylint: disable=protected-access


def save_backup(backup_and_restore):
  """A `BackupAndRestore` callback writes its backup now."""
  backup_and_restore._save_model()  # pylint: disable=protected-access


# Where a `BackupAndRestore` writes, besides its public `backup_dir`.
_BACKUP_FILES = ("_weights_path", "_training_metadata_path",
                 "_prev_weights_path", "_prev_training_metadata_path")


@contextlib.contextmanager
def backup_written_to(backup_and_restore, directory):
  """A `BackupAndRestore` callback writes its backup into `directory`, in the block."""
  real = {name: getattr(backup_and_restore, name)
          for name in _BACKUP_FILES + ("backup_dir",)}
  try:
    for name in _BACKUP_FILES:
      setattr(backup_and_restore, name,
              os.path.join(directory, os.path.basename(real[name])))
    backup_and_restore.backup_dir = directory
    yield
  finally:
    for name, path in real.items():
      setattr(backup_and_restore, name, path)


def all_reduce_sum_gradients(optimizer, grads_and_vars):
  """`optimizer`'s sum of (gradient, variable) pairs over the replicas, with
  every wrapper `PATCHES` put around it."""
  return optimizer._all_reduce_sum_gradients(grads_and_vars)  # pylint: disable=protected-access


def backend_variable(variable):
  """The backend variable a Keras `variable` holds, as stored: its `value`
  is cast inside a mixed-precision layer's call."""
  return variable._value  # pylint: disable=protected-access


def set_backend_variable(variable, value):
  """Makes the Keras `variable` hold the backend variable `value` instead:
  every layer and optimizer list that holds `variable` then reads `value`."""
  variable._value = value  # pylint: disable=protected-access


def reindex_weights(optimizer):
  """Has a built `optimizer` find its weights again after their backend
  variables changed (`set_backend_variable`): it keys them by those."""
  optimizer._trainable_variables_indices = {  # pylint: disable=protected-access
      optimizer._var_key(v): i  # pylint: disable=protected-access
      for i, v in enumerate(optimizer_weights(optimizer))}


def loss_tracker(model):
  """The metric Keras's own steps add each batch's loss to (the "loss" log)."""
  return model._loss_tracker  # pylint: disable=protected-access


_PIPELINE_STAGES = "_replicator_strategy_pipeline_stages"


def pipeline_stages_kept(model):
  """What `keep_pipeline_stages` left on the Keras `model`, or None."""
  return vars(model).get(_PIPELINE_STAGES)


def keep_pipeline_stages(model, value):
  """Keeps `value` on `model`, past Keras's and TF's attribute tracking (it
  holds no weight to save)."""
  object.__setattr__(model, _PIPELINE_STAGES, value)


def output_loss_trackers(model):
  """The metrics that log each output's own loss (`<output>_loss`), which
  the compiled loss updates each time it computes."""
  compiled = model._compile_loss  # pylint: disable=protected-access
  return compiled.metrics if compiled is not None else []


def added_losses(layer):
  """The losses `layer`'s latest call added (`add_loss`, activity
  regularizers), its inner layers' included: `layer.losses` without its
  weights' regularization."""
  return [value for inner in layer._flatten_layers()  # pylint: disable=protected-access
          for value in inner._get_own_losses()]  # pylint: disable=protected-access


@contextlib.contextmanager
def losses_as(model, losses):
  """`model.losses` is `losses` (a non-empty list) in the block, as Keras's
  JAX trainer sets it for `compute_loss`."""
  held = model._losses_override  # pylint: disable=protected-access
  held.extend(losses)
  try:
    yield
  finally:
    held.clear()


def compute_loss(model, **kwargs):
  """`model`'s loss as Keras's own steps compute it (`Model._compute_loss`,
  with every wrapper `PATCHES` put around it)."""
  return model._compute_loss(**kwargs)  # pylint: disable=protected-access


def embeddings_variable(embedding):
  """An `Embedding` layer's table variable as it holds it (before LoRA or
  int4 unpacking), or None before it is built."""
  return getattr(embedding, "_embeddings", None)


def uses_weight_decay(optimizer, variable):
  """Whether `optimizer` decays `variable` (not excluded by id or name)."""
  return optimizer._use_weight_decay(variable)  # pylint: disable=protected-access


def is_fit_validation(evaluate_kwargs):
  """Whether `Model.evaluate` was called by `fit` to validate."""
  return bool(evaluate_kwargs.get("_use_cached_eval_dataset"))


def supports_jit(model):
  """Whether Keras would compile `model` with XLA (no layer refuses it)."""
  return trainer.model_supports_jit(model)


def draw_seed(seed):
  """The seed tensor Keras's TF backend draws with for `seed` (an int, a
  `keras.random.SeedGenerator`, advanced once, or None: the global one)."""
  return tf_random._cast_seed(tf_random.draw_seed(seed))  # pylint: disable=protected-access


def concrete_noise_shape(inputs, noise_shape):
  """A dropout's `noise_shape`, its None entries taken from `inputs`."""
  return tf_random._get_concrete_noise_shape(inputs, noise_shape)  # pylint: disable=protected-access


def attention_dropout(attention):
  """A built `MultiHeadAttention`'s `Dropout` over its attention scores."""
  return attention._dropout_layer  # pylint: disable=protected-access


def attention_combine(attention, scores, value):
  """`MultiHeadAttention`'s output from its (dropped) scores and `value`, as
  its `_compute_attention` combines them."""
  return keras.ops.einsum(attention._combine_equation, scores, value)  # pylint: disable=protected-access


def remat_mode(layer):
  """The `keras.RematScope` mode `layer` was created in (`mode`,
  `output_size_threshold`, `layer_names`), or None."""
  return layer._remat_mode  # pylint: disable=protected-access


def optimizer_weights(optimizer):
  """The weights `optimizer` was built for (its accumulators follow them)."""
  return optimizer._trainable_variables  # pylint: disable=protected-access


def h5_entry_path(store):
  """The path of the entry an H5 weights store writes or reads now, or None
  for another store (a sharded H5 file, a directory, an .npz)."""
  if type(store) is not saving_lib.H5IOStore:  # pylint: disable=unidiomatic-typecheck
    return None
  return store._h5_entry_path  # pylint: disable=protected-access


Functional = functional.Functional


def graph_of(model):
  """The Functional graph `model` runs: itself, a Sequential's inner one
  (None before it is built with an input shape)."""
  if isinstance(model, keras.Sequential):
    return model._functional  # pylint: disable=protected-access
  return model


def graph_nodes(graph):
  """The layer calls of Functional `graph` in the order its `call` runs them."""
  by_depth = graph._nodes_by_depth  # pylint: disable=protected-access
  return [node for depth in sorted(by_depth, reverse=True)
          for node in by_depth[depth] if node.operation and not node.is_input]


def call_nodes(operation):
  """Every call of `operation` (a layer) in any graph, in call order."""
  return operation._inbound_nodes  # pylint: disable=protected-access


def standardize_inputs(graph, inputs):
  """`inputs` as Functional `graph`'s `call` takes them: flat, converted."""
  return graph._standardize_inputs(inputs)  # pylint: disable=protected-access


def pack_outputs(graph, flat_outputs):
  """The model's outputs in the structure Functional `graph` returns them."""
  return functional.unpack_singleton(keras.tree.pack_sequence_as(
      graph._outputs_struct, flat_outputs))  # pylint: disable=protected-access


def call_in_graph(operation, training):
  """`operation` called as a Functional graph calls it: `training` passed
  when the layer takes it and it is not None."""
  return functional.operation_fn(operation, training=training)


get_keras_mask = masking.get_keras_mask  # Its mask, or None.
set_keras_mask = masking.set_keras_mask
