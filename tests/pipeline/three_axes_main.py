"""A batch 2 x stage 2 x model 2 mesh on 8 logical CPUs: `python
tests/pipeline/three_axes_main.py [--sharded-state] [--zero3]`, one JSON
line of results.

Run by test_pipeline_layouts.py in a fresh process: the mesh needs 8
devices, the suite's processes split the CPU into 4. Two pipelines of two
stages, Megatron's rules splitting each stage's kernels over its 2 model
devices, fitted as `pipeline_fits.fit` fits one device: with Adam, and with
Adam accumulating the gradients of the 3 batches (one update); with
`--sharded-state`, the optimizer state sharded over the pipelines; with
`--zero3`, the weights too (`Sharding(weights="batch")`), each part of a
split weight in shards over the pipelines, also with Adam built before
`fit` (its slots then move to their stages).
"""

import functools
import json
import sys
from unittest import mock

import keras

import replicator_strategy as rs
from replicator_strategy.keras import stage_placement
from replicator_strategy.sharding import exchange

from pipeline_fits import fit  # noqa: I001
from pipeline_fits import layout_map
from pipeline_fits import megatron_mlp
from pipeline_fits import one_device

rs.split_cpu(8)  # Before any TensorFlow op.

ACCUMULATING = functools.partial(keras.optimizers.Adam,
                                 gradient_accumulation_steps=3)


def strategy():
  mesh = keras.distribution.DeviceMesh(
      (2, 2, 2), ("batch", "stage", "model"), [f"/cpu:{i}" for i in range(8)])
  return rs.ReplicatorStrategy(
      mesh=mesh, layout_map=layout_map(mesh),
      sharding=rs.Sharding(
          optimizer_state="--sharded-state" in sys.argv[1:],
          weights="batch" if "--zero3" in sys.argv[1:] else None),
      pipeline=rs.Pipeline(stages=2, microbatches=2, split=["up_1"]))


def places(variable):
  """The (shape, device) of each of `variable`'s parts or copies."""
  return [(c.shape.as_list(), c.device[-5:]) for c in variable.value.values]


def gathered_where(run):
  """`run()`, and the distinct (device of a shard, device it is gathered on)
  pairs of the all-gathers of sharded weights' shards it traces."""
  original, pairs = exchange.all_gather, set()

  def all_gather(ctx, value, axis, logical_device=0):
    group = ctx.strategy.extended.logical_devices.groups[ctx.local_index]
    pairs.add((value.device[-5:], group[logical_device][-5:]))
    return original(ctx, value, axis, logical_device)

  with mock.patch.object(exchange, "all_gather", all_gather):
    return run(), sorted(pairs)


def fitted(**case):
  """`fit(**case)` on `strategy()` and on one device."""
  (model, history), gathers = gathered_where(
      lambda: fit(megatron_mlp, strategy(), **case))
  weights, one_history = one_device(build=megatron_mlp, **case)
  slots = stage_placement.slots_by_weight(model.optimizer)
  return {
      "weights": [w.tolist() for w in model.get_weights()],
      "history": history,
      "one_device_weights": [w.tolist() for w in weights],
      "one_device_history": one_history,
      "gathers": gathers,
      # Weight -> the (shape, device) of each of its parts or copies.
      "parts": {w.path.partition("/")[2]: places(w) for w in model.weights},
      # "<weight>/<slot>" (Adam's moments, an accumulator) -> the same.
      "slot_parts": {
          f"{w.path.partition('/')[2]}/"
          f"{s.name[len(w.path.replace('/', '_')) + 1:]}": places(s)
          for w in model.weights for s in slots[w.path]},
  }


def main():
  results = {"adam": fitted(), "accumulating": fitted(optimizer=ACCUMULATING)}
  if "--zero3" in sys.argv[1:]:  # Sharded slots moved with their weights.
    results["built_first"] = fitted(built_first=True)
  print(json.dumps(results))


if __name__ == "__main__":
  main()
