"""Stand-ins for the pipeline's stages and executor while they are missing.

`install()` puts a minimal `split_model` (a chain of layers cut into equal
runs) and a sequential executor (every micro-batch forward, then backward,
stage by stage) where `replicator_strategy.pipeline.stages` and `.executor`
are not importable; the real modules, once there, are used instead.
"""

import dataclasses
import importlib
import sys
import types



@dataclasses.dataclass
class Stage:
  index: int
  layers: tuple
  inputs: tuple
  outputs: tuple

  @property
  def variables(self):
    return [v for layer in self.layers for v in layer.variables]

  @property
  def trainable_variables(self):
    return [v for layer in self.layers for v in layer.trainable_variables]

  def __call__(self, tensors, training=None):
    x = tensors[self.inputs[0]]
    for layer in self.layers:
      x = layer(x, training=training)
    return {self.outputs[0]: x}


def split_model(model, stages, split=None):
  del split
  layers = [layer for layer in model.layers if layer.weights]
  per = -(-len(layers) // stages)
  runs = [tuple(layers[i:i + per]) for i in range(0, len(layers), per)]
  names = ["input:0"] + [f"{run[-1].name}:0:0" for run in runs[:-1]] + [
      "output:0"]
  return tuple(Stage(i, run, (names[i],), (names[i + 1],))
               for i, run in enumerate(runs))


def model_outputs(stages, x, training=None):
  tensors = {"input:0": x}
  for stage in stages:
    tensors.update(stage(tensors, training=training))
  return tensors["output:0"]


def install():
  """Puts each stand-in where its module is missing."""
  for name, attributes in (
      ("stages", dict(Stage=Stage, split_model=split_model,
                      model_outputs=model_outputs)),):
    full = f"replicator_strategy.pipeline.{name}"
    try:
      importlib.import_module(full)
    except ImportError:
      module = types.ModuleType(full)
      module.__dict__.update(attributes)
      sys.modules[full] = module
