"""The mean over every replica of every group that a round gives each weight.

A round's exchange between the sync groups (`rounds.Averaging`): each
weight piece by piece (`variables.round_pieces`: a split weight's parts, a
sharded one's shards), each on its own devices through the round ops among
them (`topology.GroupedCommunicator.round_ops_on`), each replica weighted
by the rows it trained on since the last round (`replica_weights`); and
each weight's pieces set to theirs (`assign_pieces`).
"""

import tensorflow as tf

from replicator_strategy import variables as variables_lib
from replicator_strategy.collectives import per_replica


def weighted(strategy, variables, rows):
  """Each variable's mean over every replica of every group, piece by
  piece (`variables.round_pieces`, a `Mirrored` each), each replica
  weighted by its part of `rows` (None, or none counted: equally)."""
  if not variables:
    return []
  scale = lambda value, replicas: value
  scales = replica_weights(strategy, rows)
  if scales is not None:

    def scale(value, replicas):
      # A replica of no rows counts for nothing, whatever its weights hold.
      weight = tf.add_n([scales[r] for r in replicas]) / len(replicas)
      return tf.math.multiply_no_nan(value, tf.cast(weight, value.dtype))

  return reduce_pieces(strategy, tf.distribute.ReduceOp.MEAN, variables, scale)


def reduce_pieces(strategy, reduce_op, variables, value_of):
  """Each variable's pieces (`variables.round_pieces`), each component's
  value `value_of(its value, the local replicas it stands for)`, reduced
  over every replica of every group on the pieces' devices: per variable,
  a `Mirrored` per piece."""
  communicator = strategy.extended.communicator
  pieces = [variables_lib.round_pieces(v) for v in variables]
  batches = {}  # The pieces' all-reduce -> [(variable, piece, value)].
  for i, variable_pieces in enumerate(pieces):
    for j, piece in enumerate(variable_pieces):
      devices = [component.device for component, _ in piece]
      value = per_replica.make(devices, lambda k, piece=piece: value_of(
          piece[k][0].read_value(), piece[k][1]))
      batches.setdefault(communicator.round_ops_on(devices), []).append(
          (i, j, value))
  reduced = [[None] * len(p) for p in pieces]
  for ops, batch in batches.items():
    results = ops.batch_reduce(reduce_op, [(v, v) for _, _, v in batch])
    for (i, j, _), result in zip(batch, results):
      reduced[i][j] = result
  return reduced


def replica_weights(strategy, rows):
  """Each local replica's rows times the replicas, over every replica's
  rows: exactly 1 for each when all counted as many, or none counted;
  None without `rows`."""
  if rows is None:
    return None
  ops = strategy.extended.communicator.round_ops
  counts = per_replica.wrap(variables_lib.local_reads(rows))
  totals = per_replica.parts(
      ops.reduce(tf.distribute.ReduceOp.SUM, counts, counts))
  replicas = float(strategy.extended.num_replicas_in_all_groups)
  return [tf.where(total > 0, count * replicas / total, 1.0)
          for count, total in zip(per_replica.parts(counts), totals)]


def assign_pieces(variable, means):
  """Each of `variable`'s pieces (`variables.round_pieces`) set to its mean,
  among `means`: a `Mirrored` (each component its device's) or a tensor
  (every component)."""
  for piece, mean in zip(variables_lib.round_pieces(variable), means):
    values = per_replica.parts(mean)
    for k, (component, _) in enumerate(piece):
      component.assign(values[k] if len(values) == len(piece) else values[0])


def tf_variable(variable):
  """The distributed TF variable behind `variable` (a Keras one: its value)."""
  return variable if isinstance(variable, tf.Variable) else variable.value


def floats(variables):
  """The float variables among `variables`: the ones a round averages."""
  return [v for v in variables if tf_variable(v).dtype.is_floating]
