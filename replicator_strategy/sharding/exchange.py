"""A sharded weight's gather and its gradient's reduce-scatter, on a logical device.

A weight sharded over the replicas lives on one logical device of each
replica: device 0 for a weight no layout splits, device j for part j of a
weight split over a replica's devices (`model_parallel.sharded_parts`). Its
shards move among those devices only: on logical device 0 through the
replica context's own collectives, on device j through the communicator of
every replica's device j (`logical_devices.communicator_on`), with the
same two paths (a `merge_call` where the replicas meet, run-time
collectives inside control flow).

>>> import tensorflow as tf
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices_per_replica=2)  # 4 CPUs here
>>> def step():
...   ctx = tf.distribute.get_replica_context()
...   with ctx.logical_device(1):
...     x = tf.fill([1], tf.cast(ctx.replica_id_in_sync_group, tf.float32))
...   gathered = all_gather(ctx, x, axis=0, logical_device=1)
...   return gathered, gathered.device[-5:]
>>> [(t.numpy().tolist(), d) for t, d in strategy.experimental_local_results(
...     strategy.run(step))]
[([0.0, 1.0], 'CPU:1'), ([0.0, 1.0], 'CPU:3')]
"""

import tensorflow as tf

from replicator_strategy.collectives import reduce_op as reduce_op_lib
from replicator_strategy.collectives import replica_collectives
from replicator_strategy.collectives import exchange as exchange_lib
from replicator_strategy.model_parallel import logical_devices

_SUM = reduce_op_lib.ReduceOp.SUM


def all_gather(ctx, value, axis, logical_device=0):
  """Every replica's `value` (each of one shape) concatenated along `axis`,
  on this replica's `logical_device`; the gradient is `reduce_scatter`."""
  if logical_device == 0:
    return ctx.all_gather(value, axis)
  communicator = logical_devices.communicator_on(ctx.strategy.extended,
                                                 logical_device)
  collectives = communicator.replica_collectives
  return _exchange(
      ctx, communicator,
      lambda values: [communicator.all_gather(v, axis) for v in values],
      lambda keys, values: collectives.all_gather(ctx.local_index, values,
                                                  axis, keys),
      value, lambda dy: reduce_scatter(ctx, dy, axis, logical_device),
      keys_per_tensor=replica_collectives.GATHER_KEYS)


def reduce_scatter(ctx, value, axis, logical_device=0):
  """Slice r (of N along `axis`) of `value` summed over the replicas, on
  replica r's `logical_device`; the gradient is `all_gather`."""
  if logical_device == 0:
    return ctx.reduce_scatter("sum", value, axis=axis)
  communicator = logical_devices.communicator_on(ctx.strategy.extended,
                                                 logical_device)
  collectives = communicator.replica_collectives
  return _exchange(
      ctx, communicator,
      lambda values: [communicator.reduce_scatter(v, _SUM, axis)
                      for v in values],
      lambda keys, values: collectives.reduce_scatter(
          ctx.local_index, _SUM, values, [axis], keys),
      value, lambda dy: all_gather(ctx, dy, axis, logical_device))


def _exchange(ctx, communicator, merge, collective, value, grad,
              keys_per_tensor=1):
  """The replica context's one differentiable exchange, among the devices of
  `communicator` (the replicas' other logical device), its result there."""
  with tf.device(communicator.devices[ctx.local_index]):
    return exchange_lib.exchange(
        ctx, lambda strategy, *values: merge(values), collective, [value],
        grad=lambda xs, ys, dys: [grad(dys[0])],
        keys_per_tensor=keys_per_tensor,
        collectives=communicator.replica_collectives)[0]
