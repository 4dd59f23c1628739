"""A Keras model's stages under a pipeline strategy: cut and placed once.

The first time a pipeline sees a model (its first `fit`, `evaluate` or
`predict`, or `strategy.pipeline_stages(model)`), the model is cut into the
strategy's stages (`keras.model_stages.split_model`) and each stage's variables
move to its devices (`pipeline.placement`); later calls get the same stages.

>>> import keras
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
>>> with strategy.scope():
...   model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
...                             keras.layers.Dense(2)])
>>> stages = stages_of(strategy, model)
>>> [s.index for s in stages]
[0, 1]
"""

import weakref

from replicator_strategy import options as options_lib
from replicator_strategy.pipeline import placement

# Model -> (a weak reference to the strategy, its stages).
_CUT = weakref.WeakKeyDictionary()


def pipeline_of(strategy):
  """`strategy`'s `Pipeline` when it has one, else None."""
  options = options_lib.of(strategy)
  return options.pipeline if options is not None else None


def stages_of(strategy, model):
  """`model`'s stages under `strategy`'s pipeline, each stage's variables
  (and the slots of an optimizer already built) on its devices."""
  cut = _CUT.get(model)
  if cut is not None and cut[0]() is strategy:
    return cut[1]
  pipeline = pipeline_of(strategy)
  if pipeline is None:
    raise ValueError(
        f"Expected a ReplicatorStrategy with a pipeline, such as "
        f"ReplicatorStrategy(pipeline=rs.Pipeline(stages=2)). Received: "
        f"{strategy!r}.")
  # Here, not above: the split reads Keras's graph, loaded with the model.
  from replicator_strategy.keras import model_stages  # pylint: disable=g-import-not-at-top
  stages = model_stages.split_model(model, pipeline.cuts, pipeline.split)
  placement.place(strategy, stages, getattr(model, "optimizer", None))
  _CUT[model] = (weakref.ref(strategy), stages)
  return stages
