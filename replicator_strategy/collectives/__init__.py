"""Collectives: how replicas and workers exchange values.

Owns the collectives' one declaration, which every topology implements
(`protocol`); the traced exchange under the replica context's collectives
(`exchange`), their merge functions (`merged`) and the checks of a tape
outside `strategy.run` (`outer_tape`); the reduction operations
(`reduce_op`), the per-step exchange a strategy is built with
(`communicator`), the all-reduce algorithm for the devices (`all_reduce`),
packing small values into one exchange (`packing`), 16-bit gradient
exchange (`compression`), the collectives a replica launches by itself
(`replica_collectives`) or with other workers (`worker_collectives`), the
thread that bounds every wait in them (`watchdog`), and taking apart and
making values with one part per replica (`per_replica`).

What the replica context's collectives are given, and that every replica
asks for the same merge, is checked here too (`checks`).

With sync groups, `communicator.for_topology` hands back a
`sync_groups.topology.GroupedCommunicator` instead.

May import: `replicator_strategy._tf_internal`, `sync_groups.topology` (from
`communicator` only) and its own modules; nothing from `sharding`,
`cluster`, `cli` or `keras`.
"""
