"""Model parallelism: a replica that spans several devices.

Owns the logical devices of each replica (`logical_devices`): grouping this
worker's devices `devices_per_replica` at a time, placing variables on a
replica's i-th device (`strategy.logical_device_for_variables(i)`) and ops
(`ReplicaContext.logical_device(i)`). Owns Keras's layout map read on
TensorFlow (`layouts`), the weights it splits over a replica's devices
(`split_variables`), those also sharded over the replicas (`sharded_parts`,
tensor parallelism with ZeRO-3) and Megatron-LM's column/row-parallel
matmuls over them (`megatron`).

May import: `replicator_strategy._tf_internal`, `sharding` (the
`PiecewiseVariable` base a split variable shares with a sharded one, and
the layouts, creation and exchanges of shards) and its own modules; nothing
from `collectives`, `cluster`, `cli` or `keras`.
"""
