"""Optimizer-state bytes per device and fit step time, sharded or not.

Builds an MLP (784 -> 512 -> 512 -> 10) with Adam under
`ReplicatorStrategy(shard_optimizer_state=...)` over N logical CPUs, prints
the bytes of optimizer variables on each device, then fits and prints the
median step time (the first steps, which trace, left out).

  python benchmarks/sharded_optimizer_state.py --replicas 4 --steps 30
"""

import argparse
import collections
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# pylint: disable=g-import-not-at-top
import keras
import numpy as np

import replicator_strategy as rs
# pylint: enable=g-import-not-at-top


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replicas", type=int, default=4,
                      help="logical CPU devices, one replica each")
  parser.add_argument("--steps", type=int, default=30,
                      help="fit steps timed per configuration")
  parser.add_argument("--warmup", type=int, default=5,
                      help="first steps left out of the median")
  parser.add_argument("--global-batch", type=int, default=256)
  return parser.parse_args()


def optimizer_bytes_by_device(optimizer):
  """Bytes of every optimizer variable's components, per device."""
  by_device = collections.Counter()
  for variable in optimizer.variables:
    value = variable.value
    for component in getattr(value, "values", (value,)):
      by_device[component.device] += (component.shape.num_elements() *
                                       component.dtype.size)
  return by_device


class StepTimer(keras.callbacks.Callback):
  """Wall time of each training batch."""

  def __init__(self):
    super().__init__()
    self.times = []
    self.start = None

  def on_train_batch_begin(self, batch, logs=None):
    self.start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter() - self.start)


def run(args, shard):
  strategy = rs.ReplicatorStrategy(
      devices=[f"/cpu:{i}" for i in range(args.replicas)],
      shard_optimizer_state=shard)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
  by_device = optimizer_bytes_by_device(model.optimizer)

  rng = np.random.default_rng(0)
  n = args.global_batch * (args.steps + args.warmup)
  x = rng.normal(size=(n, 784)).astype(np.float32)
  y = rng.normal(size=(n, 10)).astype(np.float32)
  timer = StepTimer()
  model.fit(x, y, batch_size=args.global_batch, epochs=1, shuffle=False,
            verbose=0, callbacks=[timer])
  return by_device, statistics.median(timer.times[args.warmup:])


def main():
  args = parse_args()
  rs.split_cpu(args.replicas)
  results = {shard: run(args, shard) for shard in (False, True)}
  for shard, (by_device, median) in results.items():
    print(f"shard_optimizer_state={shard}:")
    for device, size in sorted(by_device.items()):
      print(f"  {device}: {size / 2**20:.2f} MiB of optimizer state")
    print(f"  total {sum(by_device.values()) / 2**20:.2f} MiB; median fit "
          f"step {median * 1e3:.1f} ms (global batch {args.global_batch}, "
          f"{args.steps} steps)")


if __name__ == "__main__":
  main()
