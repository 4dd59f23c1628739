"""The strategy's options: small frozen records, read through one accessor.

`ReplicatorStrategy(sharding=Sharding(...), sync=SyncGroups(...))` says
how state is sharded and how sync groups train; the older keywords
(`shard_optimizer_state`, `variable_partitioner`, `sync_groups`,
`average_every`, `outer_optimizer`, `overlap_averaging`) build the same
records. The strategy keeps every option in one `StrategyOptions`, its
`extended.options`; the core and the Keras patches read it through
`of(strategy)`.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(   # 4 replicas here
...     sync=rs.SyncGroups(groups=2, average_every=4))
>>> of(strategy).sync
SyncGroups(groups=2, average_every=4, outer_optimizer=None, overlap=False,
           outer_dtype=None, fragments=1)
>>> print(of(strategy).mesh)
group 2 x batch 2
>>> of(rs.ReplicatorStrategy(shard_optimizer_state=True)).sharding
Sharding(optimizer_state=True, weights=None)
"""

import dataclasses
import numbers
import typing

import tensorflow as tf

from replicator_strategy import mesh as mesh_lib
from replicator_strategy.pipeline import schedules

# What `Sharding(weights=BATCH)` names: every trainable weight cut over the
# batch axis, along its first dimension, a shard per replica.
BATCH = "batch"


@dataclasses.dataclass(frozen=True)
class Sharding:
  """What is held once, cut over the replicas (`docs/sharding.md`).

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(   # 4 replicas here
  ...     sharding=rs.Sharding(optimizer_state=True, weights="batch"))
  >>> strategy.extended.options.sharding.weights
  'batch'

  Attributes:
    optimizer_state: each Keras optimizer slot as 1/N slices, one per
      replica, each updated on its replica (ZeRO stages 1 and 2).
    weights: None (every replica holds every weight), `"batch"` (every
      trainable weight cut along its first dimension over the replicas, a
      shard each: ZeRO stage 3), or a callable `(shape, dtype) -> shards
      per axis` such as TF's `FixedShardsPartitioner`, which picks the
      weights and their shard counts.
  """

  optimizer_state: bool = False
  weights: typing.Any = None

  def __post_init__(self):
    if not isinstance(self.optimizer_state, bool):
      raise ValueError(
          f"Expected `shard_optimizer_state` to be True or False. Received: "
          f"shard_optimizer_state={self.optimizer_state!r} (Sharding's "
          f"optimizer_state).")
    if not (self.weights is None or self.weights == BATCH or
            callable(self.weights)):
      raise ValueError(
          f"Expected `variable_partitioner` (Sharding's weights) to be None, "
          f"{BATCH!r} (every weight cut over the replicas) or a callable "
          f"(shape, dtype) -> list of ints, such as "
          f"tf.distribute.experimental.partitioners.FixedShardsPartitioner"
          f"(num_shards). Received: variable_partitioner={self.weights!r} "
          f"(Sharding's weights).")

  def partitioner(self, num_replicas):
    """The `(shape, dtype) -> shards per axis` callable `weights` means, or None."""
    if self.weights != BATCH:
      return self.weights
    return tf.distribute.experimental.partitioners.FixedShardsPartitioner(
        num_replicas)


@dataclasses.dataclass(frozen=True)
class SyncGroups:
  """Sync groups: replicas in sync inside a group, the groups averaging
  their weights every `average_every` steps (`docs/sync-groups.md`).

  >>> import keras
  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(sync=rs.SyncGroups(
  ...     groups=2, average_every=8,
  ...     outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)))
  >>> strategy.num_sync_groups, strategy.num_replicas_in_sync
  (2, 2)

  Attributes:
    groups: how many groups the replicas form (1: every replica in sync).
    average_every: steps between averaging rounds.
    outer_optimizer: None (a round sets the mean), or a Keras optimizer a
      round applies the change since the last round through (DiLoCo).
    overlap: a round's exchange runs beside the next steps and lands one
      round late (Streaming DiLoCo's overlap).
    outer_dtype: None (a round exchanges float32), or "bfloat16", "int8" or
      "int4": a round sends each group's change since the last round at
      that width, with error feedback (`sync_groups.quantized`); with
      `fragments`, each fragment's round sends that fragment's change.
    fragments: Streaming DiLoCo's fragments: the trainable weights cut into
      this many, each averaged every `average_every` steps at its own
      offset, so a round every average_every / fragments steps averages
      one (`replicator_strategy.sync_groups.fragments`); with `overlap`,
      the next round applies each fragment's exchange. At most
      `average_every`; 1: every weight in every round.
  """

  groups: int = 1
  average_every: int = 1
  outer_optimizer: typing.Any = None
  overlap: bool = False
  outer_dtype: str | None = None
  fragments: int = 1

  def __post_init__(self):
    _check_sync_groups(self.groups, self.average_every, self.outer_optimizer,
                       self.overlap)
    _check_outer_dtype(self)
    _check_fragments(self)


def _check_outer_dtype(sync):
  """Refuses an `outer_dtype` the rounds cannot send."""
  if sync.outer_dtype is None:
    return
  # Here, not above: it imports the variables, which import these options.
  from replicator_strategy.sync_groups import quantized  # pylint: disable=g-import-not-at-top
  quantized.wire(sync.outer_dtype)  # Checks the name.
  if sync.groups == 1:
    raise ValueError(
        f"`outer_dtype` sets what sync groups' averaging rounds send, but "
        f"sync_groups=1 has no rounds. Received: outer_dtype="
        f"{sync.outer_dtype!r}. Pass groups > 1, or leave outer_dtype out.")
  if sync.overlap:
    raise NotImplementedError(
        f"A low-bit outer exchange with an overlapped round is not supported "
        f"yet. Received: outer_dtype={sync.outer_dtype!r}, overlap=True. Pass "
        f"overlap=False, or leave outer_dtype out (float32 rounds).")


def _check_fragments(sync):
  """Refuses a `fragments` count the rounds cannot keep."""
  fragments = sync.fragments
  if (isinstance(fragments, bool) or
      not isinstance(fragments, numbers.Integral) or fragments < 1):
    raise ValueError(
        f"Expected `fragments` to be an int of at least 1. Received: "
        f"fragments={fragments!r}. Pass how many parts the trainable weights "
        f"are cut into, each averaged on its own schedule (1: all at once).")
  if fragments == 1:
    return
  if sync.groups == 1:
    raise ValueError(
        f"`fragments` staggers sync groups' averaging rounds, but "
        f"sync_groups=1 has no rounds. Received: fragments={fragments}. Pass "
        f"groups > 1, or leave fragments out.")
  if fragments > sync.average_every:
    raise ValueError(
        f"Expected `fragments` to be at most `average_every`: each fragment "
        f"has its round at its own step of every average_every. Received: "
        f"fragments={fragments}, average_every={sync.average_every}. Pass "
        f"fragments <= {sync.average_every}, or a larger average_every.")


def _check_sync_groups(sync_groups, average_every, outer_optimizer,
                       overlap_averaging):
  """Refuses a bad `sync_groups`, `average_every`, `outer_optimizer` or
  `overlap_averaging`."""
  if not isinstance(overlap_averaging, bool):
    raise ValueError(
        f"Expected `overlap_averaging` to be True or False. Received: "
        f"overlap_averaging={overlap_averaging!r}.")
  for name, value in (("sync_groups", sync_groups),
                      ("average_every", average_every)):
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or
        value < 1):
      raise ValueError(
          f"Expected `{name}` to be an int of at least 1. Received: "
          f"{name}={value!r}. " + (
              "Pass the number of groups the replicas form (1: all "
              "synchronous)." if name == "sync_groups" else
              "Pass how many steps each group takes between averaging "
              "rounds (1: every step)."))
  if outer_optimizer is not None:
    import keras  # pylint: disable=g-import-not-at-top  # Only to check the type.
    if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
      raise ValueError(
          f"Expected `outer_optimizer` to be None (plain averaging) or a Keras "
          f"optimizer, such as keras.optimizers.SGD(0.7, momentum=0.9, "
          f"nesterov=True) (DiLoCo's). Received: outer_optimizer="
          f"{outer_optimizer!r} of type {type(outer_optimizer).__name__}.")
  if sync_groups > 1:
    return
  for name, value, default, what in (
      ("average_every", average_every, 1, "sets the steps between"),
      ("outer_optimizer", outer_optimizer, None, "applies the change between"),
      ("overlap_averaging", overlap_averaging, False, "overlaps")):
    if value != default:
      raise ValueError(
          f"`{name}` {what} sync groups' averaging rounds, but sync_groups=1 "
          f"has no rounds. Received: {name}={value!r}. Pass sync_groups > 1, "
          f"or leave {name} out.")


SCHEDULES = schedules.NAMES  # What `Pipeline(schedule=...)` names.


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """Pipeline parallelism: each replica's model cut into stages, one per
  device of the mesh's "stage" axis, each batch in micro-batches
  (`docs/parallelism.md`).

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(   # 4 devices here: 2 pipelines
  ...     pipeline=rs.Pipeline(stages=2, microbatches=4))
  >>> print(strategy.mesh)
  batch 2 x stage 2
  >>> strategy.num_replicas_in_sync
  2

  Attributes:
    stages: how many stages each replica's model is cut into, one per
      device of the stage axis (1: one device runs the whole model).
    microbatches: how many micro-batches each replica's batch is cut into;
      their gradients are summed and applied once a step.
    schedule: the order each device runs its micro-batches' forward and
      backward passes in: "gpipe", "1f1b", "interleaved_1f1b" (`virtual`
      stages a device) or "zb_h1" (the weights' gradients deferred into the
      bubble); any case.
    split: None (stages balanced by parameter count), or the names of the
      first layer of each stage after the first (`stages - 1` names).
    virtual: stages each device runs, with "interleaved_1f1b" (the model is
      cut into stages x virtual pieces).
  """

  stages: int = 1
  microbatches: int = 1
  schedule: str = "1f1b"
  split: typing.Any = None
  virtual: int = 1

  def __post_init__(self):
    for name in ("stages", "microbatches", "virtual"):
      _check_count(name, getattr(self, name), _PIPELINE_HINTS[name])
    schedule = self.schedule
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
      raise ValueError(
          f"Expected `schedule` to be one of {list(SCHEDULES)} (any case). "
          f"Received: schedule={schedule!r}. Pass one of them, such as "
          f"schedule=\"1f1b\".")
    object.__setattr__(self, "schedule", schedule.lower())
    if self.virtual > 1 and self.schedule != "interleaved_1f1b":
      raise ValueError(
          f"`virtual` sets the stages each device runs, which only the "
          f"\"interleaved_1f1b\" schedule has. Received: virtual="
          f"{self.virtual}, schedule={self.schedule!r}. Pass "
          f"schedule=\"interleaved_1f1b\", or leave virtual out.")
    if self.split is not None:
      object.__setattr__(self, "split", _checked_split(self.split,
                                                       self.cuts))

  @property
  def cuts(self):
    """How many pieces the model is cut into: stages x virtual."""
    return self.stages * self.virtual


_PIPELINE_HINTS = {
    "stages": "Pass how many stages (devices) each replica's model is cut "
              "into (1: no pipeline).",
    "microbatches": "Pass how many micro-batches each replica's batch is cut "
                    "into (1: the batch whole).",
    "virtual": "Pass how many stages each device runs (1 unless the schedule "
               "is \"interleaved_1f1b\").",
}


def _check_count(name, value, hint):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
      value < 1):
    raise ValueError(
        f"Expected `{name}` to be an int of at least 1. Received: "
        f"{name}={value!r}. {hint}")


def _checked_split(split, cuts):
  """`split` as a tuple: the first layer's name of each piece but the first."""
  names = (tuple(split) if isinstance(split, (list, tuple)) else None)
  if names is None or not all(isinstance(n, str) for n in names) or (
      len(names) != cuts - 1):
    raise ValueError(
        f"Expected `split` to be None or a list of {cuts - 1} layer name(s): "
        f"the first layer of each stage after the first. Received: "
        f"split={split!r}. Pass split=None to balance the stages by "
        f"parameter count.")
  return names


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
  """Every option of one strategy (`extended.options`).

  Attributes:
    mesh: the device mesh (`replicator_strategy.mesh.Mesh`).
    sharding: a `Sharding`.
    sync: a `SyncGroups`.
    gradient_compression: None, "bfloat16" or "float16".
    layouts: the layout map as read (`model_parallel.layouts.ModelLayouts`),
      or None.
    pipeline: a `Pipeline`, or None (no stage axis).
  """

  mesh: mesh_lib.Mesh
  sharding: Sharding = Sharding()
  sync: SyncGroups = SyncGroups()
  gradient_compression: str | None = None
  layouts: typing.Any = None
  pipeline: typing.Any = None


def record(record, cls, name, **keywords):
  """`record`, or the `cls` record the older keywords describe.

  `keywords` maps each field to (keyword name, value given); giving both a
  record and a keyword other than its default is an error.
  """
  defaults = cls()
  given = {field: value for field, (_, value) in keywords.items()
           if not _is_default(value, getattr(defaults, field))}
  if record is None:
    return cls(**given)
  if not isinstance(record, cls):
    raise ValueError(
        f"Expected `{name}` to be a replicator_strategy.{cls.__name__}. "
        f"Received: {name}={record!r}.")
  if given:
    raise ValueError(
        f"Pass either `{name}=` or the keywords it replaces, not both. "
        f"Received: {name}={record!r} and "
        + ", ".join(f"{keywords[f][0]}={v!r}" for f, v in given.items()) + ".")
  return record


def _is_default(value, default):
  # By type too: True == 1, but sync_groups=True is a mistake to report.
  return type(value) is type(default) and value == default


def of(strategy=None):
  """`strategy`'s `StrategyOptions` (default: the current strategy's), or
  None for a strategy that is not a `ReplicatorStrategy`."""
  if strategy is None:
    strategy = tf.distribute.get_strategy()
  options = getattr(strategy.extended, "options", None)
  return options if isinstance(options, StrategyOptions) else None
