"""Sync groups: replicas synchronous inside a group, the groups apart.

Owns how `ReplicatorStrategy(sync_groups=G)` cuts the replicas into groups
and what each group exchanges alone (`topology`: `GroupedCommunicator`,
which `collectives.communicator.for_topology` picks), and the averaging
rounds between the groups every `average_every` steps (`rounds`: the mean
weighted by each group's rows (`means`), DiLoCo's outer optimizer;
`quantized`: the low-bit exchange of each group's change with error
feedback; `overlap`: an overlapped round's exchange in its thread;
`fragments`: Streaming DiLoCo's fragments, each averaged at its own steps;
`first_group`: one model between rounds, the first group's; `state`:
`SyncGroupsState`, what checkpoints keep of the rounds). Keras's `fit` runs
the rounds through `keras/sync_group_rounds.py`, and each group's saved
value is `variables.SyncGroupVariable` (a `SavedCopies`, like
`ReplicaSum`): they stay with the Keras integration and the variables.

May import: `replicator_strategy._tf_internal`, `replica_context`,
`variables`, `collectives.per_replica`, `collectives.protocol` and its own
modules; nothing from `sharding`, `cluster`, `cli` or `keras`.
"""
