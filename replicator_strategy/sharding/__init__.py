"""Sharding: state held once across the replicas, a slice on each.

Owns how a tensor is cut into one shard per replica (`layout`: the `Layout`
protocol and its two layouts, `FlatLayout` and `RowLayout`), which new
variables are sharded and how (`creation`, asked by the strategy's variable
creator, with a `SlotRequest` from an optimizer), the variables held so
(`variables`: `ShardedVariable`, its reads and row lookups), their gathers
and gradients' reduce-scatters on a replica's logical device (`exchange`),
and the one optimizer step over sharded optimizer state (`optimizer_state`,
ZeRO 1/2).

May import: `replicator_strategy._tf_internal`, `replicator_strategy.collectives`
and its own modules; nothing from `cluster`, `cli` or `keras`.
"""
