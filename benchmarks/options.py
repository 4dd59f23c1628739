"""The run's options: the command-line flags and the sizes `--quick` picks."""

import argparse
import dataclasses
import os

SIZES = {  # name: (full run, --quick)
    "mlp_hidden": (512, 16),
    # The update section's MLP widths: the benchmark MLP's, then wider, to
    # show how the update's fixed costs per weight weigh as weights grow.
    "update_hidden": ((512, 1024, 2048), (16, 32)),
    "conv_filters": (16, 4),
    "image": (28, 8),
    "global_batch": (256, 32),
    # --quick times one round (after the warm-up that traces) of 4 steps: its
    # last step is the update of `multi`'s accumulation over 4 steps.
    "fit_steps": (20, 4),
    "rounds": (5, 1),
    "allreduce_mb": ((1, 16, 64), (0.0625,)),
    "allreduce_many": ((200, 4096), (10, 256)),  # tensors, bytes each
    "allreduce_repeats": (15, 1),
    "reduce_scatter_mb": (16, 0.0625),
    "map_gather_inverses": ((8, 512), (4, 16)),  # matrices, rows of each
    # The xla section's models. --quick compiles the MLP alone: the conv
    # net's row (its replicated step compiled by XLA) took about 50 s of CPU,
    # the quick run's longest piece; its other contenders run in fit.
    "xla_models": (("mlp", "convnet"), ("mlp",)),
    "first_epoch_runs": (3, 1),  # fresh processes per contender
    # The memory-bound MLP: input, hidden width, hidden layers; 50.4 M
    # parameters in full (192 MiB a copy in float32).
    "big_mlp": ((4096, 4096, 3), (64, 64, 2)),
    "big_mlp_batch": (16, 8),  # global; small, so that the state dominates
    "big_mlp_steps": (3, 2),
    # The embedding table: rows x width (512 MB in full), ids per example,
    # global batch, timed steps.
    "embedding": ((2_000_000, 64), (2_000, 8)),
    "embedding_ids": (8, 4),
    "embedding_batch": (256, 32),
    "embedding_steps": (20, 3),
    # The model_parallel transformer: vocabulary, sequence, width, heads,
    # blocks (51.4 M parameters in full); global batch; steps, the first of
    # which traces and is not timed.
    "transformer": ((512, 16, 1024, 8, 4), (32, 4, 16, 4, 1)),
    "transformer_batch": (8, 8),
    "transformer_steps": (8, 2),
    # The pipeline section: stage counts S and micro-batch counts M of its
    # grid; its MLP's batch rows, width and Dense layers a device (halved
    # a stage in interleaved 1F1B's 2 stages a device); profiled
    # steps a configuration (the median's kept). Then its transformer-like
    # MLP (width, blocks, global batch), 1F1B's micro-batches and the timed
    # rounds of the step comparison.
    "pipeline_stages": ((2, 4), (2, 4)),
    "pipeline_microbatches": ((1, 2, 4, 8), (4,)),
    "pipeline_mlp": ((256, 512, 2), (16, 16, 2)),
    "pipeline_rounds": (5, 1),
    "pipeline_model": ((512, 8, 256), (16, 4, 16)),
    "pipeline_step_microbatches": (8, 4),
    "pipeline_steps": (10, 2),
    # The memory section's transformer (vocabulary, sequence, width, heads,
    # blocks: 50.9 M parameters in full, a sequence long enough that
    # activations dominate), its global batch and steps (the first untimed).
    "memory_transformer": ((512, 512, 1024, 8, 4), (32, 16, 16, 4, 1)),
    "memory_batch": (4, 2),
    "memory_steps": (6, 2),
}


@dataclasses.dataclass(frozen=True)
class Options:
  """What to run and how big.

  Attributes:
    quick: tiny sizes, to check that everything runs and agrees.
    devices: logical CPU devices when there is no GPU.
    sections: the names of the sections to run, in order.
    json: where to write the results too, or None.
    child: in a child process, what it runs ("section:spec"), else None.
    share_cores: each of the 2 workers gets TensorFlow threads (intra- and
      inter-op) for its share of the cores, half, as on a machine of its
      own with half the cores; one process keeps TensorFlow's default, a
      thread per core. Default False: every process sizes its thread pools
      to every core.
    threads: in a child process, the TensorFlow threads it sets (intra- and
      inter-op), or None: TensorFlow's default.
    size: each of `SIZES` at the chosen scale.
  """
  quick: bool = False
  devices: int = 4
  sections: tuple[str, ...] = ()
  json: str | None = None
  child: str | None = None
  share_cores: bool = False
  threads: int | None = None
  size: dict = dataclasses.field(init=False)

  def __post_init__(self):
    object.__setattr__(self, "size",
                       {k: v[int(self.quick)] for k, v in SIZES.items()})

  def child_flags(self, devices=None, worker=False):
    """The flags a child process (a `worker` of 2, or not) needs to see the
    same run."""
    threads = ["--threads", str(worker_threads())] if (
        worker and self.share_cores) else []
    return (["--devices", str(devices or self.devices),
             "--sections", ",".join(self.sections)] +
            (["--quick"] if self.quick else []) + threads)


def worker_threads():
  """With `share_cores`, each of 2 workers' TensorFlow threads: half the
  cores."""
  return max(1, os.cpu_count() // 2)


def parse(argv, description, sections):
  """Options from `argv`; `sections`: each valid name, what it measures."""
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks", description=description,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="sections:\n" + "\n".join(
          f"  {name:14} {measures}" for name, measures in sections.items()))
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes: checks that everything runs and agrees")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--devices", type=int, default=4,
                      help="logical CPU devices when there is no GPU "
                      "(default 4)")
  every = ",".join(sections)
  parser.add_argument("--sections", default=every,
                      help="comma-separated subset of the sections below "
                      "(default: all)")
  parser.add_argument("--share-cores", action="store_true",
                      help="sections on 2 workers: each worker gets "
                      "TensorFlow threads for half the cores (as on a "
                      "machine of its own), the one process all of them "
                      "(default: every process sizes its thread pools to "
                      "every core)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  chosen = tuple(args.sections.split(","))
  unknown = [name for name in chosen if name not in sections]
  if unknown:
    parser.error(f"Expected --sections from {every}. Received: "
                 f"--sections={args.sections} (unknown: {','.join(unknown)})")
  return Options(quick=args.quick, devices=args.devices, sections=chosen,
                 json=args.json, child=args.child,
                 share_cores=args.share_cores, threads=args.threads)
