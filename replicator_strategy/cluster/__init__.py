"""The multi-worker runtime: which cluster, its bring-up, and preemption.

Owns reading and checking `TF_CONFIG` or a cluster resolver (`config`),
starting TensorFlow's gRPC server and collectives (`runtime`), the agreed stop
on SIGTERM (`preemption`), the custom-loop checkpoint built on it
(`preemption_checkpoint`) and the scratch directories non-chief workers save
to (`scratch`).

May import: `replicator_strategy._tf_internal` and its own modules; nothing
from `collectives`, `sharding`, `cli` or `keras`.
"""
