"""Pipeline parallelism: a model cut into stages that run one after another.

- `stages`: a model's layer calls cut into `Stage`s (balanced by parameter
  count, or at named layers), every tensor that crosses a cut carried.
- `balance`: where the cuts fall for stages of even cost.

May import: its own modules. The Keras model is read into calls by
`replicator_strategy.keras.model_stages` (`split_model`).
"""
