"""What the ResNet, SN-GAN and D4PG examples share around their training.

The command line (`--replicas`, `--quick`, `--output-dir`), the devices, the
topology printed first and the wall time printed last, curves drawn to a PNG
and TensorBoard logs. Files are written by the chief only, so every example
also runs as several workers:

  replicator-launch --workers 2 -- \\
      python keras_examples/resnet_digits.py --replicas 2 --quick

Importing this module loads nothing heavy. Each example defines its flags,
then, run as a script, calls `read_command_line` before it imports
TensorFlow: `--help` (and a bad flag) answers at once, and TensorFlow is then
imported without its start-up log lines. Its `main` calls `start` (it parses
the flags, makes the strategy and prints it), trains under `run.strategy`,
writes through `run` and ends with `run.finish()`; resnet_digits.py is the
shortest to read.
"""

import argparse
import os
import time

import digits  # (TF's log level and Keras's backend, before TF loads)
import replicator_strategy


def parse_args(description, add_arguments=None, argv=None):
  """The shared flags, plus those `add_arguments(parser)` adds."""
  lines = description.strip().splitlines()
  parser = argparse.ArgumentParser(
      description=lines[0], epilog="\n".join(lines[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
      "--replicas", type=int, default=None,
      help="replicas on this machine: without a GPU, the CPU is split into "
      f"this many logical devices (default: {digits.CPU_REPLICAS}, as "
      "train_digits.py); with GPUs, the first this many GPUs (default: "
      "every GPU)")
  parser.add_argument(
      "--quick", action="store_true",
      help="a run of under a minute that checks everything works, "
      "not a result")
  parser.add_argument(
      "--output-dir", default=None,
      help="where the plots and TensorBoard logs go (default: "
      "example_runs/<example name>)")
  if add_arguments is not None:
    add_arguments(parser)
  args = parser.parse_args(argv)
  if args.replicas is not None and args.replicas < 1:
    parser.error(f"--replicas must be at least 1, got {args.replicas}")
  return args


def read_command_line(description, add_arguments=None):
  """Parses the command line, then imports TensorFlow without its start-up lines.

  An example run as a script calls it before its own imports of TensorFlow
  and Keras, so that `--help` and a bad flag answer in a moment.
  """
  parse_args(description, add_arguments)
  replicator_strategy.check_tensorflow()


def make_strategy(num_replicas):
  """A ReplicatorStrategy over `num_replicas` devices (None: the default).

  The default: every GPU, or without one the CPU split into
  `digits.CPU_REPLICAS` logical devices. Must run before TensorFlow creates
  its devices: it splits the CPU when there is no GPU.
  """
  tf = replicator_strategy.check_tensorflow()
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    replicator_strategy.split_cpu(num_replicas or digits.CPU_REPLICAS)
    return replicator_strategy.ReplicatorStrategy()
  if num_replicas is None:
    return replicator_strategy.ReplicatorStrategy()
  if num_replicas > len(gpus):
    raise ValueError(
        f"--replicas {num_replicas} asks for more GPUs than this machine "
        f"has ({len(gpus)}). Pass --replicas {len(gpus)} or fewer.")
  return replicator_strategy.ReplicatorStrategy(
      devices=[f"/gpu:{i}" for i in range(num_replicas)])


class ExampleRun:
  """One run of an example: its arguments, strategy, output files and clock."""

  def __init__(self, name, args, strategy, start_time):
    self.name = name
    self.args = args
    self.strategy = strategy
    self.output_dir = args.output_dir or os.path.join("example_runs", name)
    self._start_time = start_time
    self._writer = None
    if self.is_chief:
      os.makedirs(self.output_dir, exist_ok=True)

  @property
  def is_chief(self):
    """Whether this worker writes the files (true in a single process)."""
    return self.strategy.extended.should_checkpoint

  @property
  def replicas(self):
    """"1 replica", "4 replicas": for titles."""
    n = self.strategy.num_replicas_in_sync
    return f"{n} replica{'s' if n > 1 else ''}"

  @property
  def tensorboard_dir(self):
    return os.path.join(self.output_dir, "tensorboard")

  def path(self, file_name):
    return os.path.join(self.output_dir, file_name)

  def log(self, label, step, curves):
    """Writes each curve's latest value to TensorBoard, and prints them.

    For loops of one's own (Keras `fit` has its TensorBoard callback):
    `curves` maps names to lists of numbers; one line `label step: ...`.
    Only the chief writes the logs.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if self._writer is None:
      self._writer = (tf.summary.create_file_writer(self.tensorboard_dir)
                      if self.is_chief else tf.summary.create_noop_writer())
    with self._writer.as_default(step=step):
      for name, values in curves.items():
        tf.summary.scalar(name.replace(" ", "_"), values[-1])
    print(f"{label} {step}: " + ", ".join(
        f"{name} {values[-1]:.5g}" for name, values in curves.items()),
          flush=True)

  def plot_curves(self, file_name, curves, x_label, title=None):
    """Draws `{panel: {label: values}}` as side-by-side panels into a PNG.

    Each panel is one subplot; its lines share the x axis (`x_label`,
    counted from 1). Only the chief draws. Returns the file's path.
    """
    path = self.path(file_name)
    if not self.is_chief:
      return path
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    figure, axes = pyplot.subplots(
        1, len(curves), figsize=(4 * len(curves), 3), squeeze=False)
    for axis, (panel, lines) in zip(axes[0], curves.items()):
      for label, values in lines.items():
        axis.plot(range(1, len(values) + 1), values, label=label)
      axis.set_xlabel(x_label)
      axis.set_title(panel)
      axis.grid(alpha=0.3)
      if len(lines) > 1:
        axis.legend()
    if title:
      figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
    print(f"wrote {path}")
    return path

  def finish(self):
    print(f"wall time: {time.perf_counter() - self._start_time:.1f} s")


def start(name, description, add_arguments=None, quick=None, argv=None):
  """Parses the command line, makes the strategy and prints its topology.

  `quick` maps argument names to the values `--quick` sets. Seeds Python,
  NumPy and TensorFlow with 0. Call it first, before any other TensorFlow
  op: it may split the CPU, and across workers the strategy must exist
  before TensorFlow starts.
  """
  start_time = time.perf_counter()
  args = parse_args(description, add_arguments, argv)
  if args.quick:
    for argument, value in (quick or {}).items():
      setattr(args, argument, value)
  strategy = make_strategy(args.replicas)
  print(strategy, flush=True)
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  return ExampleRun(name, args, strategy, start_time)
