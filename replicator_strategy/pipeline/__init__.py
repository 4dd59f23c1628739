"""Pipeline parallelism: a model cut into stages, run over micro-batches.

Owns the cut of a Keras model into stages (`stages`), the schedules that
order each device's forwards and backwards (`schedules`) and the executor
that runs one replica's step through a schedule (`executor`).

May import: `replicator_strategy._tf_internal` and its own modules.
"""
