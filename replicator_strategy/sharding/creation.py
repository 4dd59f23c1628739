"""Which new variables are sharded, and how: asked once, by the variable creator.

The strategy's variable creator hands every new variable's arguments to
`create` before it makes a mirrored one. A variable is sharded (a
`ShardedVariable`, see `variables`) where:

- it is optimizer state of a sharded weight (created `colocate_with` it, as
  Keras's slots are): as the weight is, read inside a replica as its shard,
  or whole where its `SlotRequest` says `reads_whole` (EMA copies);
- its `SlotRequest` says `flat` (`shard_optimizer_state`'s slots): flattened
  over every replica (`FlatLayout`) on its weight's logical device (a
  pipeline stage's), refused inside a replica;
- `variable_partitioner` cuts it, a trainable weight: by rows (`RowLayout`),
  read whole inside a replica; or a layout map's batch axis names one of its
  dimensions: one shard per replica along it.

Keras's optimizers create their state with no word for sharding: the Keras
wrappers that know ask `requesting(...)`, which passes a `SlotRequest` with
the variable's own arguments (a `tf.variable_creator_scope`, as
`variables.REPLICA_SUM` is passed), so those arguments alone decide.

>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope(), requesting(flat=True):
...   slot = tf.Variable(tf.zeros([3, 3]))
>>> [c.shape.as_list() for c in slot.values]  # 9 elements over 4 replicas
[[3], [3], [3], [3]]
"""

import contextlib
import dataclasses
import numbers

import tensorflow as tf

from replicator_strategy.sharding import layout as layout_lib
from replicator_strategy.sharding import variables

# `tf.Variable` argument, read by the strategy's variable creator: a
# `SlotRequest` (Keras does not pass it on, so `requesting` adds it).
SLOT_REQUEST = "slot_request"


@dataclasses.dataclass(frozen=True)
class SlotRequest:
  """How the optimizer state created under `requesting` is to be sharded.

  Attributes:
    flat: state of a mirrored weight is sharded flat over every replica
      (`shard_optimizer_state`). State of a sharded weight is sharded as the
      weight is, whatever this says.
    reads_whole: state of a sharded weight reads whole inside a replica (an
      EMA copy, which Keras updates from the weight's whole value), not as
      this replica's shard.
  """
  flat: bool = False
  reads_whole: bool = False


@contextlib.contextmanager
def requesting(**request):
  """Variables created inside carry `SlotRequest(**request)` to the creator.

  Inside another `requesting`, its request is kept where this one says
  nothing.
  """
  def creator(next_creator, **kwargs):
    kwargs[SLOT_REQUEST] = dataclasses.replace(
        kwargs.get(SLOT_REQUEST, SlotRequest()), **request)
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield


def create(strategy, next_creator, request=None, batch_axis=None,
           variable_class=variables.ShardedVariable, **kwargs):
  """A `ShardedVariable` where the variable `kwargs` describe is sharded, else None.

  `request`: the variable's `SlotRequest`, if its creator passed one.
  `batch_axis`: the dimension a layout map's batch axis names for it, which
  it is sharded along in place of what `variable_partitioner` says.
  `variable_class`: `ShardedVariable` or the subclass to make.
  """
  request = request or SlotRequest()
  kwargs["variable_class"] = variable_class
  num_replicas = strategy.extended.communicator.num_replicas
  weight = kwargs.get("colocate_with")
  if isinstance(weight, variables.ShardedVariable):
    return variables.create(
        strategy, next_creator, lambda _: weight.layout,
        "whole" if request.reads_whole else "shard", weight.logical_device,
        **kwargs)
  if request.flat:
    # On its weight's logical device (a pipeline stage's), as its weight's
    # update runs there; made without one, where new variables go.
    devices = strategy.extended.logical_devices
    return variables.create(
        strategy, next_creator,
        lambda whole: layout_lib.FlatLayout.of(whole.shape, num_replicas),
        None, devices.of_variable(weight) if isinstance(
            weight, tf.distribute.DistributedValues) else devices.variables_on,
        **kwargs)
  partitioner = strategy.extended.variable_partitioner
  if (partitioner is None and batch_axis is None) or not shardable(kwargs):
    return None
  return variables.create(
      strategy, next_creator,
      lambda whole: row_layout(partitioner, whole.shape, whole.dtype,
                               num_replicas, kwargs.get("name"), batch_axis),
      "whole", strategy.extended.logical_devices.variables_on, **kwargs)


def shardable(kwargs):
  """Whether a new variable is a trainable weight a partitioner may cut."""
  synchronization = kwargs.get("synchronization",
                               tf.VariableSynchronization.AUTO)
  return (kwargs.get("trainable", True) is not False and
          kwargs.get("colocate_with") is None and
          synchronization in (tf.VariableSynchronization.AUTO,
                              tf.VariableSynchronization.ON_WRITE))


def row_layout(partitioner, shape, dtype, num_replicas, name=None,
               batch_axis=None):
  """The `RowLayout` `partitioner` asks for, or None where it cuts nothing.

  `batch_axis` (not None): one shard per replica along that dimension, as a
  layout map's batch axis asks, whatever `partitioner` says. `name` (the
  variable's) is for errors.
  """
  shape = tf.TensorShape(shape)
  if shape.rank is None or shape.rank == 0 or not shape.is_fully_defined():
    return None
  if batch_axis is not None:
    num_shards, axis = num_replicas, batch_axis
  else:
    num_shards = _shard_counts(partitioner(shape=shape, dtype=dtype), shape,
                               name)[0]
    axis = 0
  if num_shards < 2 or num_replicas < 2:
    return None
  return layout_lib.RowLayout.split(shape.as_list(), num_shards, num_replicas,
                                    axis)


def _shard_counts(received, shape, name):
  """What a partitioner returned for a variable, checked: a list of ints."""
  variable = f"the variable {name!r}" if name else "an unnamed variable"
  received_text = (f"Received: variable_partitioner(shape={shape}, ...) = "
                   f"{received!r} for {variable}.")
  accepted = (f"Expected `variable_partitioner` to return the number of "
              f"shards along each axis: a list of {shape.rank} ints, the "
              f"first at least 1 and the others 1, as TF's partitioners "
              f"return (FixedShardsPartitioner(2) gives "
              f"{[2] + [1] * (shape.rank - 1)}).")
  is_sequence = (not isinstance(received, (str, bytes, dict)) and
                 hasattr(received, "__iter__"))
  counts = list(received) if is_sequence else []
  if not is_sequence or not all(
      isinstance(n, numbers.Integral) and not isinstance(n, bool)
      for n in counts):
    raise TypeError(f"{accepted} {received_text}")
  if any(n < 1 for n in counts):
    raise ValueError(f"{accepted} A variable has at least 1 shard along "
                     f"each axis. {received_text}")
  if len(counts) != shape.rank or any(n != 1 for n in counts[1:]):
    raise ValueError(
        f"ReplicatorStrategy shards variables along axis 0 only. "
        f"{accepted} {received_text}")
  return [int(n) for n in counts]
