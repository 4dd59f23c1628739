"""Pipeline parallelism: a model cut into stages, run over micro-batches.

- `stages`: a model's layer calls cut into `Stage`s (balanced by parameter
  count, or at named layers), every tensor that crosses a cut carried.
- `balance`: where the cuts fall for stages of even cost.
- `schedules` and `executor`: the order each device runs its forwards and
  backwards in, and one replica's step run through it.
- `placement` and `placed_stages`: a strategy's stages, each stage's
  variables on its devices (`ReplicatorStrategy(pipeline=...)`).

The Keras model is read into calls by `replicator_strategy.keras.model_stages`
(`split_model`).

May import: `replicator_strategy._tf_internal`, `options`, `keras._internal`
(to give a Keras variable its moved value) and its own modules.
"""
