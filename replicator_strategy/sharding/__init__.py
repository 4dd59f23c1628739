"""Sharding: state held once across the replicas, a slice on each.

Owns sharded optimizer state (`optimizer_state`, ZeRO 1/2) and sharded
variables (`variables`, ZeRO 3 and big embedding tables).

May import: `replicator_strategy._tf_internal`, `replicator_strategy.collectives`
and its own modules; nothing from `cluster`, `cli` or `keras`.
"""
