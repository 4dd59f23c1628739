"""Model parallelism: a replica that spans several devices.

Owns the logical devices of each replica (`logical_devices`): grouping this
worker's devices `devices_per_replica` at a time, placing variables on a
replica's i-th device (`strategy.logical_device_for_variables(i)`) and ops
(`ReplicaContext.logical_device(i)`).

May import: `replicator_strategy._tf_internal` and its own modules; nothing
from `collectives`, `sharding`, `cluster`, `cli` or `keras`.
"""
