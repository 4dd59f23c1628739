"""The one table of changes replicator_strategy makes to Keras, and their undoing.

Keras 3 has no hook for what ReplicatorStrategy must change (global logs,
exact loss scaling, files written once across workers, saving on
preemption), so the package wraps Keras functions while a ReplicatorStrategy
lives: from the first one made until the last one is gone (a model compiled
under one keeps it alive, and so does a `tf.function` that traced a step
with it, until they are dropped). A script that makes none, with
MirroredStrategy say, runs Keras as shipped: no frame of ours in its
tracebacks. Every wrapper is listed in `PATCHES`: what it wraps, why, and
when it acts; each calls Keras's own code unchanged where it does not act.
The wrapped names, private ones included, were checked against the Keras
versions that `replicator_strategy.keras._internal` names; another version
is refused on import (set `REPLICATOR_STRATEGY_ALLOW_UNTESTED_KERAS=1` to
try it anyway).

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy()
>>> installed()            # while a ReplicatorStrategy lives
True
>>> rs.keras.uninstall()   # Keras exactly as installed, strategies or not
>>> installed()
False
>>> rs.keras.install()     # the patches back, until uninstall()
>>> installed()
True
"""

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import accumulators
from replicator_strategy.keras import attention_heads
from replicator_strategy.keras import batches
from replicator_strategy.keras import chief_writes
from replicator_strategy.keras import compiled_steps
from replicator_strategy.keras import distribution_backend
from replicator_strategy.keras import distribution_strategy
from replicator_strategy.keras import empty_replicas
from replicator_strategy.keras import global_results
from replicator_strategy.keras import gradient_exchange
from replicator_strategy.keras import loss_scale
from replicator_strategy.keras import model_parallel
from replicator_strategy.keras import pipeline_steps
from replicator_strategy.keras import preemption_saves
from replicator_strategy.keras import random_layers
from replicator_strategy.keras import rematerialization
from replicator_strategy.keras import replica_loss
from replicator_strategy.keras import sequence_parallel
from replicator_strategy.keras import sharded_optimizer
from replicator_strategy.keras import sharded_weights
from replicator_strategy.keras import stage_placement
from replicator_strategy.keras import sync_group_rounds
from replicator_strategy.keras import sync_round_logs

@dataclasses.dataclass(frozen=True)
class Patch:
  """`owner.name` replaced by `wrap(original)`, acting only `when`.

  With `adds=True` the owner lacks `name` as shipped: `wrap` itself is set
  there, and uninstall deletes it again (a Keras that defines it keeps its
  own).
  """
  owner: Any
  name: str
  wrap: Callable
  when: str
  adds: bool = False


_MODEL = keras.Model
_OPTIMIZER = keras.optimizers.Optimizer
_BACKUP = keras.callbacks.BackupAndRestore
_BOARD = keras.callbacks.TensorBoard
_UNDER_US = "the strategy is a ReplicatorStrategy with several replicas"
_NON_CHIEF = "on a non-chief worker of a ReplicatorStrategy cluster"
_PREEMPTIBLE = "a ReplicatorStrategy cluster is running (SIGTERM agreed)"
_SHARDING = "the strategy is a ReplicatorStrategy(shard_optimizer_state=True)"
_SHARDED = "a weight is sharded by ReplicatorStrategy(variable_partitioner=...)"
_SPLIT_KERNEL = ("a ReplicatorStrategy(layout_map=...) replica runs the layer, "
                 "its kernel split by the layout")
_GROUPS = "the strategy is a ReplicatorStrategy(sync_groups=G > 1)"
_ROWS = "a ReplicatorStrategy replica (of several) runs the layer on a batch"
_NO_ROWS = ("a ReplicatorStrategy replica (of several) runs the layer (a "
            "batch normalization: not synchronized) on a batch not known to "
            "have rows")
_DISTRIBUTION = ("a keras.distribution DataParallel or ModelParallel is set: "
                 "a ReplicatorStrategy serves it, TensorFlow's default")
_PIPELINE = "the strategy is a ReplicatorStrategy(pipeline=...)"
_IN_PARTS = ("a ReplicatorStrategy(layout_map=...) replica runs it on a tensor "
             "in parts along the sequence (a row-parallel layer's output "
             "reduce-scattered there)")
_IN_ROW_LAYER = ("in a random layer's call that _ROWS marked, for draws of "
                 "rank 1 or more")

# In order: a later entry on the same name wraps an earlier one. Where rows
# wrap the same method, a comment says why in that order; test_keras_patches
# (LayeringTest) fails if such rows are reordered.
PATCHES = (
    Patch(_MODEL, "get_metrics_result",
          global_results.global_metrics_result, _UNDER_US),
    # test_on_batch, predict_on_batch, outer to inner: with_one_model (sync
    # groups, below), split_on_batch. The one cuts the data, the other swaps
    # the first group's weights in around the call: outermost, they are in
    # place for all that runs inside, the split included.
    *(Patch(_MODEL, name, batches.split_on_batch,
            _UNDER_US + ": the batch cut into the replicas' parts")
      for name in ("train_on_batch", "test_on_batch", "predict_on_batch")),
    Patch(_MODEL, "_maybe_symbolic_build",
          batches.build_from_batch_spec,
          "the strategy is a ReplicatorStrategy"),
    Patch(ki.loss, "scale_loss_for_distribution",
          functools.partial(replica_loss.scale_by_batch_share,
                            scale=True), _UNDER_US),
    Patch(ki.loss, "unscale_loss_for_distribution",
          functools.partial(replica_loss.scale_by_batch_share,
                            scale=False), _UNDER_US),
    Patch(_MODEL, "_compute_loss", replica_loss.loss_scaled_whole,
          _UNDER_US + ": the loss compute_loss returns, scaled as a whole"),
    Patch(_MODEL, "compute_loss", replica_loss.warn_override_unscaled,
          _UNDER_US + ", called by an override of compute_loss from a step "
          "of its own (a warning, once per class)"),
    Patch(_OPTIMIZER, "_backend_apply_gradients",
          gradient_exchange.reduce_before_clipping,
          _UNDER_US + " and the optimizer clips"),
    # _clip_gradients, outer to inner: reduce_accumulated_before_clipping,
    # clip_in_parts (what is clipped is summed first).
    Patch(_OPTIMIZER, "_clip_gradients", gradient_exchange.clip_in_parts,
          "the optimizer clips by norm a weight split by a layout map"),
    Patch(_OPTIMIZER, "_clip_gradients",
          gradient_exchange.reduce_accumulated_before_clipping,
          _UNDER_US + ", the optimizer accumulates gradients and clips"),
    Patch(_OPTIMIZER, "add_variable_from_reference",
          accumulators.per_replica_accumulators,
          "the strategy is a ReplicatorStrategy: gradient accumulators"),
    Patch(_OPTIMIZER, "save_own_variables", accumulators.save_replica_values,
          "an optimizer with ReplicatorStrategy gradient accumulators is "
          "saved to an H5 file"),
    Patch(_OPTIMIZER, "load_own_variables", accumulators.load_replica_values,
          "the H5 file holds every replica's accumulators, for as many "
          "replicas"),
    Patch(keras.optimizers.LossScaleOptimizer, "check_finite",
          loss_scale.finite_on_every_replica,
          _UNDER_US + ": whether any replica's gradients overflowed"),
    # _all_reduce_sum_gradients, outer to inner: gather_for_clipping
    # (sharded_weights, below), split_in_parts, slices_as_on_one_device,
    # skip_if_reduced, compressed_on_the_wire. compressed_on_the_wire is the
    # sum itself (it calls Keras's only without compression), so every other
    # wrapper sits above it: skip_if_reduced, to sum nothing twice when the
    # gradients were summed before clipping; slices_as_on_one_device, which
    # changes what is summed (a slice's values); split_in_parts above it, to
    # see a split weight's gradient as the tape gave it; gather_for_clipping
    # outermost, which takes sharded weights' gradients (gathered, not
    # summed) out of what any sum below sees.
    Patch(_OPTIMIZER, "_all_reduce_sum_gradients",
          gradient_exchange.compressed_on_the_wire,
          "the strategy is a ReplicatorStrategy(gradient_compression=...)"),
    Patch(_OPTIMIZER, "_all_reduce_sum_gradients",
          gradient_exchange.skip_if_reduced,
          "the gradients were all-reduced before clipping"),
    Patch(_OPTIMIZER, "_all_reduce_sum_gradients",
          gradient_exchange.slices_as_on_one_device,
          _UNDER_US + " and a sparse gradient's rows are constants (an "
          "Embedding of positions)"),
    Patch(_OPTIMIZER, "_all_reduce_sum_gradients",
          gradient_exchange.split_in_parts,
          _UNDER_US + " and a weight is split by a layout map"),
    Patch(_OPTIMIZER, "add_variable_from_reference",
          sharded_optimizer.shard_slots, _SHARDING),
    Patch(_OPTIMIZER, "_backend_update_step",
          sharded_optimizer.sharded_update_step, _SHARDING),
    Patch(_OPTIMIZER, "_apply_weight_decay",
          sharded_optimizer.decay_in_shards, _SHARDING),
    Patch(_OPTIMIZER, "_backend_update_step",
          sharded_weights.update_shards, _SHARDED),
    Patch(_OPTIMIZER, "_all_reduce_sum_gradients",
          sharded_weights.gather_for_clipping,
          _SHARDED + " and the optimizer clips"),
    Patch(_OPTIMIZER, "add_variable_from_reference",
          sharded_weights.average_reads_whole, _SHARDED),
    Patch(keras.Variable, "_initialize", model_parallel.variable_paths,
          "in the scope of a ReplicatorStrategy(layout_map=...)"),
    Patch(keras.layers.Dense, "call", model_parallel.megatron_dense,
          _SPLIT_KERNEL),
    Patch(keras.layers.EinsumDense, "call",
          model_parallel.megatron_einsum_dense, _SPLIT_KERNEL),
    Patch(keras.layers.MultiHeadAttention, "_compute_attention",
          attention_heads.attention_per_head_group,
          "a ReplicatorStrategy(layout_map=...) replica attends with query, "
          "key and value split by heads"),
    Patch(keras.layers.Embedding, "call", model_parallel.megatron_embedding,
          "a ReplicatorStrategy(layout_map=...) replica looks up an "
          "Embedding whose table the layout splits"),
    Patch(keras.Layer, "__call__", model_parallel.output_layouts,
          "a ReplicatorStrategy(layout_map=...) replica runs a layer whose "
          "<path>/output key the layout map has"),
    # Embedding.call, outer to inner: lookup_rows, megatron_embedding (above).
    # lookup_rows takes a table split by columns and sharded by rows first,
    # which megatron_embedding would gather whole.
    Patch(keras.layers.Embedding, "call", sharded_weights.lookup_rows,
          _SHARDED + ": the Embedding's table"),
    # _make_function, outer to inner: rows_counted (sync groups, below),
    # compiled_per_replica. rows_counted knows the train step by identity
    # (step_function == self.train_step), which compiled_per_replica's
    # tf.function would hide; inside it, the step compiled counts its rows.
    Patch(_MODEL, "_make_function", compiled_steps.compiled_per_replica,
          "the strategy is a ReplicatorStrategy and jit_compile=True"),
    Patch(_MODEL, "make_predict_function",
          compiled_steps.predict_compiled_per_device,
          "the strategy is a ReplicatorStrategy over several devices per "
          "replica and jit_compile=True"),
    Patch(_MODEL, "predict_step", compiled_steps.predict_step_per_device,
          "traced for a ReplicatorStrategy over several devices per replica "
          "with jit_compile=True"),
    Patch(_MODEL, "_resolve_auto_jit_compile",
          compiled_steps.xla_on_accelerators,
          "the strategy is a ReplicatorStrategy and jit_compile=\"auto\""),
    Patch(ki.data_adapters, "is_tf_dataset",
          batches.takes_global_batch_dataset,
          "the data is a ReplicatorStrategy's distributed dataset"),
    Patch(ki.tf_trainer, "reduce_per_replica",
          global_results.concat_across_workers,
          "predict across several ReplicatorStrategy workers"),
    Patch(_MODEL, "_make_function", sync_group_rounds.rows_counted,
          _GROUPS + ": the train step counts its rows for the rounds"),
    Patch(_MODEL, "make_train_function",
          sync_group_rounds.rounds_after_steps,
          _GROUPS + ": averaging rounds every average_every steps"),
    # fit, outer to inner: rounds_in_epoch_logs, last_round. Either order
    # counts the same: fit's last round comes after the last epoch's logs.
    Patch(_MODEL, "fit", sync_group_rounds.last_round,
          _GROUPS + " and the last step did not average"),
    Patch(_MODEL, "fit", sync_round_logs.rounds_in_epoch_logs,
          _GROUPS + ": each epoch's logs count its averaging rounds"),
    *(Patch(_MODEL, name, sync_group_rounds.with_one_model,
            _GROUPS + ": answered by the first group's weights")
      for name in ("predict", "evaluate", "predict_on_batch",
                   "test_on_batch")),
    Patch(_MODEL, "_symbolic_build",
          stage_placement.stages_placed_before_slots,
          _PIPELINE + ": the model whose optimizer is built there"),
    Patch(_OPTIMIZER, "build", stage_placement.placed_before_slots,
          _PIPELINE + ", building the optimizer of the model that "
          "_symbolic_build builds: its stages placed first"),
    Patch(_MODEL, "train_step", pipeline_steps.pipelined_train_step,
          _PIPELINE + ": a replica's step through the schedule"),
    # predict_step, outer to inner: forward_through_stages,
    # predict_step_per_device; Layer.__call__: stage_by_stage_call,
    # output_layouts. Either order works: a pipeline has no layout map.
    *(Patch(_MODEL, name, pipeline_steps.forward_through_stages,
            _PIPELINE + ": the model's call run stage by stage")
      for name in ("test_step", "predict_step")),
    Patch(keras.Layer, "__call__", pipeline_steps.stage_by_stage_call,
          _PIPELINE + ": the model a replica's test or predict step calls"),
    # make_train_function, outer to inner: stages_placed_first,
    # rounds_after_steps (sync groups, above); make_predict_function:
    # stages_placed_first, predict_compiled_per_device. Outermost, the
    # variables are in place before any step is made.
    *(Patch(_MODEL, name, pipeline_steps.stages_placed_first,
            _PIPELINE + ": the model cut, its stages placed, once")
      for name in ("make_train_function", "make_test_function",
                   "make_predict_function")),
    # Before chief_writes' entries: those wrap these.
    Patch(_BACKUP, "_save_model",
          sync_group_rounds.group_state_beside_backup,
          _GROUPS + ": every group's state beside the backup"),
    Patch(_BACKUP, "on_train_begin",
          sync_group_rounds.group_state_from_backup,
          _GROUPS + " and the backup holds every group's state"),
    Patch(_MODEL, "save", chief_writes.to_scratch_unless_chief,
          _NON_CHIEF),
    Patch(_MODEL, "save_weights", chief_writes.to_scratch_unless_chief,
          _NON_CHIEF),
    Patch(_MODEL, "export", chief_writes.to_scratch_unless_chief,
          _NON_CHIEF),
    Patch(_BACKUP, "_save_model",
          chief_writes.backup_to_scratch_unless_chief, _NON_CHIEF),
    Patch(_BACKUP, "on_train_end", chief_writes.keep_backup_unless_chief,
          _NON_CHIEF),
    Patch(_BOARD, "set_model", chief_writes.log_to_scratch_unless_chief,
          _NON_CHIEF),
    Patch(_BOARD, "on_train_end", chief_writes.drop_scratch_logs,
          _NON_CHIEF),
    Patch(_BACKUP, "on_train_begin", preemption_saves.watching, _PREEMPTIBLE),
    Patch(_BACKUP, "on_train_batch_end", preemption_saves.stopping_when_told,
          _PREEMPTIBLE),
    Patch(_BACKUP, "on_train_end", preemption_saves.watched, _PREEMPTIBLE),
    # Distribution.scope() calls the first; users the second (the same
    # function, bound in keras.distribution's namespace).
    Patch(ki.distribution_lib, "set_distribution",
          distribution_strategy.served_by_a_strategy, _DISTRIBUTION),
    Patch(keras.distribution, "set_distribution",
          distribution_strategy.served_by_a_strategy, _DISTRIBUTION),
    Patch(ki.data_adapters, "get_data_adapter",
          distribution_strategy.input_left_to_the_strategy,
          _DISTRIBUTION + ": the input left to it (its split over workers)"),
    *(Patch(ki.tf_distribution_lib, name,
            getattr(distribution_backend, name),
            "keras.distribution calls it (Keras's TF backend lacks it)",
            adds=True) for name in distribution_backend.ADDED),
    Patch(ki.tf_distribution_lib, "_to_backend_mesh",
          distribution_backend.to_backend_mesh,
          "DeviceMesh.backend_mesh: the strategy's mesh, not DTensor's"),
    Patch(ki.tf_distribution_lib, "_to_backend_layout",
          distribution_backend.to_backend_layout,
          "TensorLayout.backend_layout: that mesh and the axes"),
    Patch(ki.tf_core, "remat", rematerialization.recomputed_in_place,
          "keras.remat or a keras.RematScope rematerializes a call"),
    Patch(keras.random.SeedGenerator, "next", rematerialization.drawn_again,
          "in a rematerialized call: its forward's seeds recorded, replayed "
          "by its recompute; in a pipeline stage: its first micro-batch's, "
          "by the others"),
    Patch(ki.tf_random, "uniform", random_layers.uniform_rows, _IN_ROW_LAYER),
    Patch(ki.tf_random, "normal", random_layers.normal_rows, _IN_ROW_LAYER),
    Patch(ki.tf_random, "dropout", random_layers.dropout_mask_rows,
          _IN_ROW_LAYER),
) + tuple(
    Patch(layer, "call", random_layers.dropout_rows, _ROWS)
    for layer in random_layers.DROPOUT_LAYERS) + tuple(
        Patch(layer, "get_random_transformation", random_layers.image_rows,
              _ROWS) for layer in random_layers.IMAGE_LAYERS) + tuple(
                  Patch(layer, "call", empty_replicas.skipped_without_rows,
                        _NO_ROWS) for layer in empty_replicas.GUARDED_LAYERS) + (
    # Dropout.call, outer to inner: dropout_in_parts, dropout_rows (above).
    # A part draws its slice of one device's values itself.
    Patch(keras.layers.Dropout, "call", sequence_parallel.dropout_in_parts,
          _IN_PARTS + ", training"),
    Patch(keras.layers.LayerNormalization, "call",
          sequence_parallel.norm_in_parts, _IN_PARTS + ", over the features"),
    Patch(ki.tf_numpy, "add", sequence_parallel.add_in_parts,
          _IN_PARTS + " (a residual add) and the other of its shape"),
)

_originals = []  # (owner, name, what it was), in the order applied.
_ABSENT = object()  # What an added attribute was: nothing.
_lock = threading.RLock()  # Finalizers run in whichever thread collects.
_changing = False  # A finalizer run amid a change leaves it to finish.
_alive = 0  # ReplicatorStrategy objects alive that `hold` was given.
_pinned = None  # True after install(), False after uninstall(), else None.


def hold(strategy):
  """Keeps the patches in place while `strategy` (a ReplicatorStrategy) lives.

  The strategy's constructor calls it; the last one gone takes the patches
  away, unless `install()` or `uninstall()` decided for good.
  """
  global _alive
  weakref.finalize(strategy, _release).atexit = False
  with _lock:
    _alive += 1
    _apply_or_remove()


def _release():
  global _alive
  with _lock:
    _alive -= 1
    _apply_or_remove()


def installed():
  """Whether the patches are in place now."""
  return bool(_originals)


def install():
  """Applies every patch in `PATCHES`, once, and keeps them until `uninstall`.

  Without it, they are in place while a ReplicatorStrategy lives.
  """
  global _pinned
  with _lock:
    _pinned = True
    _apply_or_remove()


def uninstall():
  """Puts back every Keras function the patches wrap; Keras is as shipped.

  ReplicatorStrategy then trains as MirroredStrategy does under Keras: local
  per-batch logs, 1/N loss scaling, every worker writing its files; until
  `install()`.
  """
  global _pinned
  with _lock:
    _pinned = False
    _apply_or_remove()


def _apply_or_remove():
  """Applies or removes the patches as `_pinned`, else `_alive`, asks.

  Called with `_lock` held. The garbage collector may run a strategy's
  finalizer amid a change, in this thread: its call returns at once, and
  cannot change what is wanted (the change under way is for a strategy that
  is referenced, or was decided by install() or uninstall()).
  """
  global _changing
  if _changing:
    return
  _changing = True
  try:
    wanted = _alive > 0 if _pinned is None else _pinned
    if wanted and not _originals:
      for patch in PATCHES:
        if patch.adds:
          if hasattr(patch.owner, patch.name):
            continue
          _originals.append((patch.owner, patch.name, _ABSENT))
          setattr(patch.owner, patch.name, patch.wrap)
          continue
        original = getattr(patch.owner, patch.name)
        _originals.append((patch.owner, patch.name, original))
        setattr(patch.owner, patch.name, patch.wrap(original))
    elif not wanted:
      while _originals:
        owner, name, original = _originals.pop()
        if original is _ABSENT:
          delattr(owner, name)
        else:
          setattr(owner, name, original)
  finally:
    _changing = False
