"""Pipeline parallelism: a model cut into stages, run over micro-batches.

- `stages`: a model's layer calls cut into `Stage`s (balanced by parameter
  count, or at named layers), every tensor that crosses a cut carried.
- `balance`: where the cuts fall for stages of even cost.
- `schedules`: the order of each device's forwards and backwards over the
  micro-batches (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their bubble.
- `executor`: one replica's training step run through a schedule.

May import: `replicator_strategy._tf_internal` and its own modules. The Keras
model is read into calls by `replicator_strategy.keras.model_stages`
(`split_model`), its stages placed on a strategy's devices by
`keras.stage_placement` and `fit`'s step run by `keras.pipeline_steps`.
"""
