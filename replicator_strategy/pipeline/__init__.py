"""Pipeline parallelism: a model cut into stages that run one after another.

- `stages`: a model's layer calls cut into `Stage`s (balanced, or before
  named layers), every tensor that crosses a cut carried; `model_outputs`
  runs them in order, `describe` lists them.
- `balance`: where the cuts fall for stages of even cost (parameters or
  measured time).

May import: its own modules; nothing from `keras` (the package's rule):
`replicator_strategy.keras.model_stages.split_model` reads a Keras model's
layer graph into the calls `stages.cut` groups.
"""
