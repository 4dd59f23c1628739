"""What ReplicatorStrategy changes in Keras 3, in one table, and its undoing.

- `patches`: the table `PATCHES` (what is wrapped, why, when it acts), in
  place while a ReplicatorStrategy lives (`hold`), or as `install()` and
  `uninstall()` decide.
- `replica_loss`: loss scaled by each replica's share of the rows.
- `batches`: each replica its part of the batch in `train_on_batch`,
  `test_on_batch` and `predict_on_batch`; the model built from the batches'
  spec.
- `gradient_exchange`: clipping after the all-reduce, compressed gradients,
  sparse rows summed as on one device.
- `compiled_steps`: `jit_compile` per replica.
- `global_results`: global per-batch logs, `predict` across workers.
- `replicas`: whether a wrapper acts (what the five above share).
- `chief_writes`: across workers, files written once, by the chief.
- `preemption_saves`: `BackupAndRestore` saves at the step every worker
  agreed to stop at after a SIGTERM.
- `sync_group_rounds`: with sync groups, `fit`'s averaging rounds and every
  group's state in `BackupAndRestore` backups.
- `step_context`: what the wrappers of one optimizer step tell each other
  (whether its gradients are summed over the replicas already).
- `distribution_strategy`: `keras.distribution.set_distribution` served by
  a ReplicatorStrategy (TF's default), `use_for_keras_distribution()`.
- `model_stages`, `stage_placement`, `pipeline_steps`: under a pipeline,
  the model cut into stages, each stage's variables on its devices, and
  `fit`'s step run through the schedule.
- `_internal`: Keras's private names, behind a Keras version check.

Nothing outside `keras/` imports it but the package's lazy loader, which
hands `patches.hold` to the strategy's constructor
(`strategy.CREATION_HOOKS`) and `distribution_strategy.scope_hook` to its
`scope()` (`strategy.SCOPE_HOOKS`), and `stage_placement.stages_of` to
`strategy.pipeline_stages` (`strategy.PIPELINE_STAGES`): the core and the
other subpackages never
depend on it.

>>> import replicator_strategy as rs
>>> len(rs.keras.PATCHES) > 0
True
"""

from replicator_strategy.keras.patches import install
from replicator_strategy.keras.patches import installed
from replicator_strategy.keras.patches import PATCHES
from replicator_strategy.keras.patches import uninstall

__all__ = ["PATCHES", "install", "installed", "uninstall"]
