"""Pipeline parallelism: a model cut into stages, run over micro-batches.

- `stages`: a model's layer calls cut into `Stage`s (balanced, or before
  named layers), every tensor that crosses a cut carried; `model_outputs`
  runs them in order, `describe` lists them.
- `balance`: where the cuts fall for stages of even cost (parameters or
  measured time).
- `schedules`: the order of each device's forwards and backwards over the
  micro-batches (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their bubble.
- `executor`: one replica's training step run through a schedule.

May import: `replicator_strategy._tf_internal` and its own modules; nothing
from `keras` (the package's rule): `replicator_strategy.keras.model_stages.
split_model` reads a Keras model's layer graph into the calls `stages.cut`
groups, `keras.stage_placement` places a strategy's stages on its devices
and `keras.pipeline_steps` runs `fit`'s step through the executor.
"""
