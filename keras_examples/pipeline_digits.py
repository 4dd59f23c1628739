"""Train a small transformer on scikit-learn's digits as a pipeline of stages.

Pipeline parallelism: each replica's model (the one `transformer_digits.py`
builds, unchanged) is cut into `--stages` consecutive stages, each on its own
device, and every batch into `--microbatches` micro-batches that flow through
them in the `--schedule`'s order; the gradients summed over the micro-batches
are applied once, so a step equals one device's on the whole batch
(docs/pipeline.md). The replicas train data-parallel. Without a GPU the CPU
is split into `--replicas x --stages` logical devices.

  python keras_examples/pipeline_digits.py --replicas 2 --stages 2 \\
      --microbatches 4 --schedule 1f1b
"""

import argparse
import time

import digits  # pylint: disable=g-bad-import-order  (TF env vars; nothing heavy)
import transformer_digits

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replicas", type=int, default=2,
                      help="data-parallel pipelines (default: 2)")
  parser.add_argument("--stages", type=int, default=2,
                      help="devices each pipeline spans, a stage each "
                      "(default: 2)")
  parser.add_argument("--microbatches", type=int, default=4,
                      help="micro-batches each replica's batch is cut into "
                      "(default: 4)")
  parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                      help="the order of forwards and backwards (default: "
                      "1f1b)")
  transformer_digits.add_training_arguments(parser)
  return parser.parse_args()


def main():
  args = parse_args()
  start = time.monotonic()
  digits.set_up_devices(args.replicas * args.stages)
  # Here, not at the top: `--help` answers before TensorFlow loads.
  # pylint: disable=g-import-not-at-top
  import keras
  import replicator_strategy
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  data = transformer_digits.load_data()

  strategy = replicator_strategy.ReplicatorStrategy(
      pipeline=replicator_strategy.Pipeline(
          stages=args.stages, microbatches=args.microbatches,
          schedule=args.schedule))
  print(strategy)  # the replicas, their devices, the mesh with its stage axis
  with strategy.scope():
    model = transformer_digits.build_model(keras)
    transformer_digits.compile_model(keras, model)
  for stage in strategy.pipeline_stages(model):
    print(f"stage {stage.index}: {len(stage.layers)} layers, "
          f"{stage.params} weights")

  transformer_digits.fit_and_report(model, args, data, start)


if __name__ == "__main__":
  main()
