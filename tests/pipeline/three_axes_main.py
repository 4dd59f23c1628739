"""A batch 2 x stage 2 x model 2 mesh on 8 logical CPUs: `python
tests/pipeline/three_axes_main.py [--sharded-state]`, one JSON line of
results.

Run by test_pipeline_layouts.py in a fresh process: the mesh needs 8
devices, the suite's processes split the CPU into 4. Two pipelines of two
stages, Megatron's rules splitting each stage's kernels over its 2 model
devices, fitted as `pipeline_fits.fit` fits one device; with
`--sharded-state`, the optimizer state sharded over the pipelines.
"""

import json
import sys

import keras

import replicator_strategy as rs

from pipeline_fits import fit  # noqa: I001
from pipeline_fits import layout_map
from pipeline_fits import megatron_mlp
from pipeline_fits import one_device

rs.split_cpu(8)  # Before any TensorFlow op.


def main():
  mesh = keras.distribution.DeviceMesh(
      (2, 2, 2), ("batch", "stage", "model"), [f"/cpu:{i}" for i in range(8)])
  sharding = rs.Sharding(optimizer_state="--sharded-state" in sys.argv[1:])
  model, history = fit(megatron_mlp, rs.ReplicatorStrategy(
      mesh=mesh, layout_map=layout_map(mesh), sharding=sharding,
      pipeline=rs.Pipeline(stages=2, microbatches=2, split=["up_1"])))
  weights, one_history = one_device(build=megatron_mlp)
  print(json.dumps({
      "weights": [w.tolist() for w in model.get_weights()],
      "history": history,
      "one_device_weights": [w.tolist() for w in weights],
      "one_device_history": one_history,
      # Weight -> the (shape, device) of each of its parts or copies.
      "parts": {w.path.partition("/")[2]: [(c.shape.as_list(), c.device[-5:])
                                           for c in w.value.values]
                for w in model.weights},
      # Adam's m of each weight (made in the weights' order), alike.
      "momentum": {w.path.partition("/")[2]: [(c.shape.as_list(),
                                               c.device[-5:])
                                              for c in m.value.values]
                   for w, m in zip(model.trainable_weights, [
                       v for v in model.optimizer.variables
                       if v.path.endswith("_momentum")], strict=True)},
  }))


if __name__ == "__main__":
  main()
