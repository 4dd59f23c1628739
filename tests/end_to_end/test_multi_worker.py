"""2 workers x 2 logical CPUs on 127.0.0.1 equal one process with 4 replicas.

Each test starts real worker processes through the launcher (TF_CONFIG, TF's
gRPC runtime and collective ops), bounded in time; the launcher stops every
process it started. Tests that only read runs' results share launches
(`RunsOnWorkers`). The references run in this process, on the same code
(`multi_worker_runs`), once each (`in_one_process`).
"""

import atexit
import collections
import functools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import keras
import numpy as np
import pytest

import models
import multi_worker_runs
import test_empty_replicas
import test_gradient_compression
import topology
from replicator_strategy.cli import launch
from test_launch import alive

TESTS = pathlib.Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 480  # A shared launch runs for minutes on a loaded machine.


def launch_workers(runs, out, num_workers=2, env=None, launch_args=(),
                   command=None):
  """Runs `runs` on `num_workers` workers writing to `out` (or each worker
  runs `command`); (status, output), the output whole: the launcher's line
  on a failure can come before a dying worker's long traceback."""
  command = command or (sys.executable, str(TESTS / "multi_worker_main.py"),
                        ",".join(runs), str(out))
  done = subprocess.run(
      [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers",
       str(num_workers), "--timeout", str(LAUNCH_TIMEOUT), *launch_args, "--",
       *command],
      capture_output=True, text=True, timeout=LAUNCH_TIMEOUT + 30,
      check=False, env={**os.environ, **(env or {})})
  return done.returncode, done.stdout + done.stderr


def worker_results(out, status, output, num_workers=2):
  """Each worker's results in `out`, after a launch that must have succeeded."""
  if status != 0:
    raise AssertionError(f"workers failed ({status}):\n{output}")
  return [json.loads((pathlib.Path(out) / f"worker_{i}.json").read_text())
          for i in range(num_workers)]


def results_of(runs, out, num_workers=2, env=None, launcher_args=()):
  """Each worker's results of `runs`, which must succeed."""
  return worker_results(
      out, *launch_workers(runs, out, num_workers, env, launcher_args),
      num_workers)


@functools.cache
def in_one_process(spec, num_replicas=4):
  """Run spec `spec`'s results in this process on `num_replicas` replicas.

  Computed once; the tests only read them.
  """
  name, options = multi_worker_runs.parse(spec)
  return multi_worker_runs.RUNS[name](
      topology.strategy_over(num_replicas, **options))


def assert_close_nested(test, actual, expected, rtol=1e-5, atol=1e-6):
  if isinstance(expected, dict):
    test.assertEqual(sorted(actual), sorted(expected))
    for key in expected:
      assert_close_nested(test, actual[key], expected[key], rtol, atol)
  elif isinstance(expected, list) and len({np.shape(e) for e in expected}) > 1:
    test.assertEqual(len(actual), len(expected))  # Weights of several shapes.
    for a, e in zip(actual, expected):
      assert_close_nested(test, a, e, rtol, atol)
  else:
    np.testing.assert_allclose(np.asarray(actual, dtype=float),
                               np.asarray(expected, dtype=float),
                               rtol=rtol, atol=atol)


class RunsOnWorkers:
  """Mixin: `RUNS` on 2 workers x 2, each on a strategy with `OPTIONS`.

  The classes of one `LAUNCH` share it: it runs all their runs, each once,
  before the first of their tests (`shared_launch`). `cls.workers` holds each
  worker's results by run name, `cls.workdir(run)` the files a run wrote.
  """
  RUNS = ()
  OPTIONS = ""  # "@OPTION+OPTION" (multi_worker_runs.STRATEGY_OPTIONS).
  LAUNCH = "plain"
  specs = collections.defaultdict(list)  # Of each launch, in order, once.

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    specs = RunsOnWorkers.specs[cls.LAUNCH]
    specs += [run + cls.OPTIONS for run in cls.RUNS
              if run + cls.OPTIONS not in specs]

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out, status, output = shared_launch(cls.LAUNCH)
    cls.workers = [{run: worker[run + cls.OPTIONS] for run in cls.RUNS}
                   for worker in worker_results(cls.out, status, output)]

  @classmethod
  def workdir(cls, run):
    return pathlib.Path(cls.out, run + cls.OPTIONS)


@functools.cache
def shared_launch(name):
  """(output directory, status, output) of launch `name` of RunsOnWorkers.

  A failed launch fails each class that shares it, without a relaunch. The
  directory lasts until the tests end.
  """
  out = tempfile.TemporaryDirectory()
  atexit.register(out.cleanup)
  return out.name, *launch_workers(RunsOnWorkers.specs[name], out.name)


@pytest.mark.slow
class TwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  RUNS = ("primitives", "custom_loop", "keras_fit",
          "keras_fit_steps_per_execution", "input_pipelines", "batch_share",
          "collectives_per_step")

  def test_workers_agree_on_everything_but_ids_and_input_shards(self):
    first, second = (dict(w) for w in self.workers)
    for run in ("input_pipelines", "batch_share", "collectives_per_step"):
      first.pop(run)
      second.pop(run)
    first["primitives"] = {k: dict(v) if isinstance(v, dict) else v
                           for k, v in first["primitives"].items()}
    second["primitives"] = {k: dict(v) if isinstance(v, dict) else v
                            for k, v in second["primitives"].items()}
    for mode in ("eager", "function"):
      self.assertEqual(first["primitives"][mode].pop("id"), [0.0, 1.0])
      self.assertEqual(second["primitives"][mode].pop("id"), [2.0, 3.0])
    self.assertEqual(first, second)

  def test_collectives_span_every_replica_of_every_worker(self):
    for mode in ("eager", "function"):
      got = self.workers[0]["primitives"][mode]
      self.assertEqual(got["sum"], [6.0, 6.0])  # 0 + 1 + 2 + 3
      self.assertEqual(got["mean"], [1.5, 1.5])
      self.assertEqual(got["min"], [1.0, 1.0])
      self.assertEqual(got["max"], [3.0, 3.0])
      self.assertEqual(got["int_sum"], [22, 22])  # 1 + 4 + 7 + 10
      self.assertEqual(got["int_mean"], [5.5, 5.5])  # As in one process.
      self.assertEqual(got["broadcast"], [30.0, 30.0])  # From worker 1.
      self.assertEqual(got["all_gather"], [[0.0, 1.0, 2.0, 3.0]] * 2)
      self.assertEqual(got["merge_call"], [6.0])
      self.assertEqual(got["reduce"],
                       {"sum": 6.0, "mean": 1.5, "min": 0.0, "max": 3.0})
      self.assertEqual(got["gather"], [0.0, 1.0, 2.0, 3.0])
    self.assertEqual(self.workers[0]["primitives"]["function"]["in_cond"],
                     [3.0, 3.0])

  def test_the_batch_share_counts_every_workers_rows(self):
    np.testing.assert_allclose([w["batch_share"] for w in self.workers],
                               [[0.1, 0.2], [0.3, 0.4]], rtol=1e-6)

  def test_a_step_exchanges_between_workers_only_what_it_reads(self):
    # An empty step launches no collective; the batch share, read once or
    # inside a tf.cond, one; a batch all-reduce of 4 float32 tensors, one.
    for worker, shares in zip(self.workers, ([0.1, 0.2], [0.3, 0.4])):
      got = dict(worker["collectives_per_step"])
      np.testing.assert_allclose(got.pop("shares_in_cond"), shares, rtol=1e-6)
      self.assertEqual(got, {"empty": 0, "batch_share": 1,
                             "batch_share_in_cond": 1,
                             "all_reduce_4_tensors": 1})

  def test_unseeded_variables_start_from_the_chiefs_value(self):
    values = [w["primitives"]["unseeded_variable"] for w in self.workers]
    self.assertEqual(values[0], values[1])

  def test_custom_loop_equals_one_process_with_four_replicas(self):
    expected = in_one_process("custom_loop")
    for worker in self.workers:
      assert_close_nested(self, worker["custom_loop"], expected)

  def test_keras_fit_evaluate_predict_equal_one_process_with_four_replicas(
      self):
    expected = in_one_process("keras_fit")
    self.assertEqual(len(expected["predict"]), 27)
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit"], expected)
      assert_close_nested(self, worker["keras_fit_steps_per_execution"],
                          expected)

  def test_each_worker_reads_its_own_shard(self):
    first, second = (w["input_pipelines"] for w in self.workers)
    # input_pipeline_id, num_input_pipelines, per-replica batch of 8.
    self.assertEqual(first["contexts"], [[0, 2, 2]])
    self.assertEqual(second["contexts"], [[1, 2, 2]])
    self.assertEqual(first["rows"], [[0, 2, 4, 6]])
    self.assertEqual(second["rows"], [[1, 3, 5, 7]])

  def test_a_dataset_read_whole_by_every_worker_is_warned_about(self):
    for worker in self.workers:
      warnings = worker["input_pipelines"]["warnings"]
      self.assertEqual(len(warnings), 1, warnings)
      self.assertIn("AutoShardPolicy.OFF: each of the 2 workers reads all",
                    warnings[0])


@pytest.mark.slow
class OneDevicePerWorkerTest(unittest.TestCase):
  """The usual cluster of one-GPU machines: nothing to add within a worker."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory() as out:
      cls.workers = results_of(["primitives", "custom_loop", "keras_fit"],
                               out, env={"MULTI_WORKER_DEVICES": "1,1"})

  def test_training_equals_one_process_with_two_replicas(self):
    for run in ("custom_loop", "keras_fit"):
      expected = in_one_process(run, 2)
      for worker in self.workers:
        assert_close_nested(self, worker[run], expected)

  def test_collectives_span_both_workers(self):
    for index, worker in enumerate(self.workers):
      for mode in ("eager", "function"):
        got = worker["primitives"][mode]
        self.assertEqual(got["id"], [float(index)])
        expected = {"sum": 1.0, "mean": 0.5, "min": 1.0, "max": 1.0,
                    "int_sum": 5, "int_mean": 2.5, "broadcast": 10.0,
                    "merge_call": 1.0}
        self.assertEqual({k: got[k] for k in expected},
                         {k: [v] for k, v in expected.items()})
        self.assertEqual(got["all_gather"], [[0.0, 1.0]])
        self.assertEqual(got["reduce"],
                         {"sum": 1.0, "mean": 0.5, "min": 0.0, "max": 1.0})
        self.assertEqual(got["gather"], [0.0, 1.0])
      self.assertEqual(worker["primitives"]["function"]["in_cond"], [1.0])


@pytest.mark.slow
class SlicingCollectivesTest(RunsOnWorkers, unittest.TestCase):
  """reduce_scatter and all_to_all over 2 workers x 2 replicas equal 4 in one process."""
  RUNS = ("slicing_collectives",)

  def test_every_replica_gets_what_it_gets_in_one_process(self):
    expected = in_one_process("slicing_collectives")
    # Gradients inside a tf.cond (run-time collectives) are those of
    # merge_call's path.
    for replica, results in expected["in_cond"].items():
      assert_close_nested(self, results["gradients"],
                          expected["function"][replica]["gradients"])
    for mode, by_replica in expected.items():
      got = {}
      for worker in self.workers:
        got.update(worker["slicing_collectives"][mode])
      assert_close_nested(self, got, by_replica)


@pytest.mark.slow
class MapGatherTest(RunsOnWorkers, unittest.TestCase):
  """map_gather over 2 workers x 2 replicas: each thunk once, on its owner."""
  RUNS = ("map_gather",)

  def test_every_replica_gets_what_it_gets_in_one_process(self):
    expected = in_one_process("map_gather")
    for mode, results in expected.items():
      got = {}
      for worker in self.workers:
        got.update(worker["map_gather"][mode]["replicas"])
      assert_close_nested(self, got, results["replicas"])
      for replica, result in got.items():
        assert_close_nested(self, result["map_gather"]["values"],
                            result["everything"]["values"])
        # The owner's gradient is every replica's, summed.
        total = np.sum([r["everything"]["gradients"] for r in got.values()],
                       axis=0)
        owned = [k % 4 == int(replica) for k in range(len(total))]
        assert_close_nested(self, result["map_gather"]["gradients"],
                            np.where(owned, total, 0.0).tolist())

  def test_each_thunk_ran_once_on_its_owner(self):
    for mode in ("eager", "function", "in_cond"):
      first, second = (w["map_gather"][mode]["ran"] for w in self.workers)
      self.assertEqual(first, [[0, 0], [1, 1], [4, 0], [5, 1]], mode)
      self.assertEqual(second, [[2, 2], [3, 3]], mode)


def by_metric(logs):
  """Each step's logs ({metric: value}) as {metric: each step's value}."""
  return {name: [step[name] for step in logs] for name in logs[0]}


def saved_slots(path):
  """The optimizer slots of the Keras model saved at `path`."""
  loaded = keras.models.load_model(path)
  return [v.numpy().tolist() for v in loaded.optimizer.variables
          if v.path.split("/")[-1] not in ("iteration", "learning_rate")]


@pytest.mark.slow
class SyncGroupsTwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  """sync_groups=2 (average_every=4) on 2 workers x 2: a group per worker."""
  RUNS = ("sync_groups_loop", "sync_groups_fit")
  OPTIONS = "@2_sync_groups"
  LAUNCH = "keras"
  # 58 rows in batches of 16: 4 steps an epoch, 12 in 3 epochs: rounds
  # after steps 4, 8 and 12, and none at the end (step 12 averaged).
  ROUNDS_IN_FIT = 3

  def test_a_custom_loop_equals_one_process_with_four_replicas(self):
    # Each replica's rows are chosen by its replica id: the same anywhere.
    expected = in_one_process("sync_groups_loop" + self.OPTIONS)
    self.assertFalse(np.allclose(expected["kernels"][0][0],
                                 expected["kernels"][0][2]))
    for worker in self.workers:
      loop = worker["sync_groups_loop"]
      assert_close_nested(self, loop["losses"], expected["losses"])
      assert_close_nested(self, loop["weights"], expected["weights"])
    # Each worker holds its own group: replicas 0, 1 on worker 0.
    for step in range(8):
      assert_close_nested(self, self.workers[0]["sync_groups_loop"]["kernels"][
          step], expected["kernels"][step][:2])
      assert_close_nested(self, self.workers[1]["sync_groups_loop"]["kernels"][
          step], expected["kernels"][step][2:])

  def test_fit_equals_one_process_with_four_replicas(self):
    # Each worker's group trains on the rows group 0 or 1 gets in one
    # process, the last batch's 10 rows split 3, 3 | 2, 2 as there.
    expected = in_one_process("sync_groups_fit" + self.OPTIONS)
    for worker in self.workers:
      assert_close_nested(self, worker["sync_groups_fit"], expected)

  def test_fit_ends_with_one_model_on_every_worker(self):
    first, second = (w["sync_groups_fit"] for w in self.workers)
    assert_close_nested(self, second["weights"], first["weights"], rtol=0,
                        atol=0)
    assert_close_nested(self, second["predict"], first["predict"])
    losses = first["history"]["loss"]
    self.assertLess(losses[-1], losses[0])

  def test_weights_cross_between_workers_once_every_four_steps(self):
    weights = sum(np.size(w) for w in models.initial_weights())
    for worker in self.workers:
      result = worker["sync_groups_fit"]
      self.assertEqual(result["rounds"], self.ROUNDS_IN_FIT)
      self.assertEqual(result["bytes_averaged"],
                       self.ROUNDS_IN_FIT * 4 * weights)


@pytest.mark.slow
class SyncGroupsStepLogsTwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  """`fit`'s logs in a sync group per worker (2 workers x 2, H = 4, 12
  steps): each step's from the worker's own group, each epoch's over every
  group, and nothing crossing between the workers until a round."""
  RUNS = ("sync_groups_step_logs",)
  OPTIONS = "@2_sync_groups"
  LAUNCH = "keras"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.runs = [w["sync_groups_step_logs"] for w in cls.workers]
    # One process x 4, the same groups: the metrics of replicas 0, 1 and of
    # 2, 3 after each step, from their metric variables.
    cls.expected = in_one_process("sync_groups_step_logs" + cls.OPTIONS)

  def test_each_step_logs_the_workers_own_groups(self):
    for index, run in enumerate(self.runs):
      own = by_metric([step[index] for step in self.expected["pairs"]])
      assert_close_nested(self, by_metric(run["logs"]), own)
      assert_close_nested(self, by_metric(run["local"]), own)
    # The workers' logs differ: each shows its own rows.
    first, second = (by_metric(run["logs"])["loss"] for run in self.runs)
    self.assertFalse(np.allclose(first, second))

  def test_each_epoch_logs_every_group(self):
    for run in self.runs:
      assert_close_nested(self, run["history"], self.expected["history"])
      # Not the worker's own groups' last step (epoch 1 ends at step 4).
      self.assertNotAlmostEqual(run["history"]["loss"][0],
                                run["logs"][3]["loss"], places=4)

  def test_no_collective_crosses_between_workers_between_rounds(self):
    for run in self.runs:
      launches = run["launches"]
      self.assertEqual(len(launches), 12)
      # Rounds follow steps 4, 8 and 12: their exchange is counted there.
      self.assertTrue(all(n > 0 for n in launches[3::4]), launches)
      self.assertEqual([n for step, n in enumerate(launches, 1) if step % 4],
                       [0] * 9)


@pytest.mark.slow
class SyncGroupsStepLogsTwoGroupsPerWorkerTest(
    SyncGroupsStepLogsTwoWorkersTest):
  """The same with 2 sync groups on each worker: each step's logs sum the
  worker's two groups."""
  OPTIONS = "@4_sync_groups"


@pytest.mark.slow
class MeshTwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  """Each worker's mesh (1 x 2): a group axis spans the workers, a group on
  each; a model axis stays inside each, a replica over both devices."""
  RUNS = ("sync_groups_fit",)
  OPTIONS = "@mesh_group_per_worker"
  LAUNCH = "keras"

  def test_a_group_axis_of_one_is_a_group_per_worker(self):
    expected = in_one_process("sync_groups_fit@2_sync_groups")
    for worker in self.workers:
      assert_close_nested(self, worker["sync_groups_fit"], expected)


@pytest.mark.slow
class MeshModelAxisTwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  RUNS = ("keras_fit",)
  OPTIONS = "@mesh_row_parallel"
  LAUNCH = "keras"

  def test_a_model_axis_in_each_worker_trains_as_one_device(self):
    want = in_one_process("keras_fit", 1)
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit"], want)


@pytest.mark.slow
class PipelineTwoWorkersTest(RunsOnWorkers, unittest.TestCase):
  """A pipeline of 2 stages on each worker's 2 devices (2 micro-batches):
  the batch axis spans the workers, a pipeline on each."""
  RUNS = ("pipeline_fit",)
  OPTIONS = "@pipeline"
  LAUNCH = "pipeline"
  SHARDS = 1  # A weight's shards over the pipelines: 1 on each worker.

  def test_pipelines_on_two_workers_train_as_one_device(self):
    # Adam, a dropout in each block, short final batches: the losses, each
    # worker's weights, evaluation and predictions.
    want = dict(in_one_process("pipeline_fit", 1))
    del want["replicas"], want["parts"]
    # The first 2 blocks' kernels and biases on a worker's first device,
    # the third block's and the head's on its second.
    stages = (0, 0, 0, 0, 1, 1, 1, 1)
    for index, worker in enumerate(self.workers):
      with self.subTest(worker=index):
        got = dict(worker["pipeline_fit"])
        self.assertEqual(got.pop("replicas"), 2)
        self.assertEqual(got.pop("parts"), [
            [[f"/job:worker/replica:0/task:{index}/device:CPU:{stage}",
              self.worker_shape(np.shape(weight), index)]]
            for stage, weight in zip(stages, want["weights"], strict=True)])
        assert_close_nested(self, got, want)

  def worker_shape(self, shape, index):
    """The shape of worker `index`'s part of a weight of `shape`."""
    rows, extra = divmod(shape[0], self.SHARDS)
    return [rows + (index < extra)] + list(shape[1:])


@pytest.mark.slow
class PipelineShardedStateTwoWorkersTest(PipelineTwoWorkersTest):
  """The same, each stage's optimizer slots cut over the 2 pipelines."""
  OPTIONS = "@pipeline+shard_optimizer_state"


@pytest.mark.slow
class PipelineZero3TwoWorkersTest(PipelineTwoWorkersTest):
  """The same, each stage's weights cut over the 2 pipelines (ZeRO-3): half
  of each on each worker's device of its stage."""
  OPTIONS = "@pipeline+zero3"
  SHARDS = 2


@pytest.mark.slow
class OverlappedSyncGroupsTwoWorkersTest(SyncGroupsTwoWorkersTest):
  """The same with overlap_averaging=True: each round's exchange between the
  workers runs in a thread while the groups take the next steps."""
  OPTIONS = "@2_sync_groups+overlap"
  LAUNCH = "sharded_variables"  # Beside the keras launch's, each stays short.
  # Steps 4, 8 and 12 start exchanges; the end of fit applies the last one
  # and averages at once.
  ROUNDS_IN_FIT = 4


@pytest.mark.slow
class LowBitSyncGroupsTwoWorkersTest(SyncGroupsTwoWorkersTest):
  """The same with `outer_dtype="int8"`: each round all-gathers each group's
  change as int8 packed into int32 words, between the workers."""
  OPTIONS = "@int8_rounds"
  LAUNCH = "low_bit"

  def test_weights_cross_between_workers_once_every_four_steps(self):
    # Each weight of the 8-16-3 model in 2 chunks (one per replica of a
    # group) of int8 words and a float32 scale: the kernels 2 x (16 + 1) and
    # 2 x (6 + 1) words, the biases 2 x (2 + 1) and 2 x (1 + 1).
    for worker in self.workers:
      result = worker["sync_groups_fit"]
      self.assertEqual(result["rounds"], self.ROUNDS_IN_FIT)
      self.assertEqual(result["bytes_averaged"],
                       self.ROUNDS_IN_FIT * 4 * (34 + 14 + 6 + 4))


@pytest.mark.slow
class FragmentedSyncGroupsTwoWorkersTest(SyncGroupsTwoWorkersTest):
  """The same in Streaming DiLoCo's 2 fragments (the first kernel, the
  rest), overlapped: each fragment's exchange between the workers runs in a
  thread until the next fragment's round."""
  OPTIONS = "@2_sync_groups_fragments"
  LAUNCH = "fragments"
  # The rest at steps 2, 6 and 10, the first kernel at 4, 8 and 12; the end
  # of fit applies the last exchange and averages every weight at once.
  ROUNDS_IN_FIT = 7

  def test_weights_cross_between_workers_once_every_four_steps(self):
    first_kernel, rest = 8 * 16, 16 + 16 * 3 + 3
    for worker in self.workers:
      result = worker["sync_groups_fit"]
      self.assertEqual(result["rounds"], self.ROUNDS_IN_FIT)
      self.assertEqual(result["bytes_averaged"],
                       4 * (3 * rest + 3 * first_kernel + first_kernel + rest))


@pytest.mark.slow
class FragmentedLowBitSyncGroupsTwoWorkersTest(SyncGroupsTwoWorkersTest):
  """The same in 2 fragments with int8 rounds (Streaming DiLoCo with int8):
  each fragment's round all-gathers that fragment's int8 changes only."""
  OPTIONS = "@int8_fragments"
  LAUNCH = "low_bit"
  # The rest at steps 2, 6 and 10, the first kernel at 4, 8 and 12; the end
  # of fit averages the rest, which step 12 left apart.
  ROUNDS_IN_FIT = 7

  def test_weights_cross_between_workers_once_every_four_steps(self):
    # In 2 chunks of int8 words and a scale each: the first kernel
    # 2 x (16 + 1) words; the rest 2 x (2 + 1), 2 x (6 + 1) and 2 x (1 + 1).
    first_kernel, rest = 4 * 34, 4 * (6 + 14 + 4)
    for worker in self.workers:
      result = worker["sync_groups_fit"]
      self.assertEqual(result["rounds"], self.ROUNDS_IN_FIT)
      self.assertEqual(result["bytes_averaged"],
                       3 * first_kernel + 4 * rest)


@pytest.mark.slow
class ShardedOptimizerStateTest(RunsOnWorkers, unittest.TestCase):
  """shard_optimizer_state=True on 2 workers x 2 equals one process with 4."""
  RUNS = ("custom_loop", "keras_fit", "keras_fit_steps_per_execution",
          "keras_fit_accumulation", "keras_fit_nadam", "sharded_state")
  OPTIONS = "@shard_optimizer_state"
  LAUNCH = "sharded_state"

  def test_training_equals_one_process_with_four_replicas(self):
    custom_loop = in_one_process("custom_loop")
    keras_fit = in_one_process("keras_fit")
    for worker in self.workers:
      assert_close_nested(self, worker["custom_loop"], custom_loop)
      assert_close_nested(self, worker["keras_fit"], keras_fit)
      assert_close_nested(self, worker["keras_fit_steps_per_execution"],
                          keras_fit)

  def test_nadam_equals_one_process_with_four_replicas(self):
    # Also a mirrored scalar Nadam assigns inside each replica.
    expected = in_one_process("keras_fit_nadam")
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit_nadam"], expected)

  def test_gradient_accumulation_equals_one_process_with_four_replicas(self):
    # The step runs inside each replica's tf.cond: run-time collectives.
    expected = in_one_process("keras_fit_accumulation")
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit_accumulation"], expected)

  def test_each_worker_holds_its_replicas_shards_and_reads_whole_slots(self):
    expected = in_one_process("sharded_state" + self.OPTIONS)
    self.assertEqual(len(expected["shard_sizes"]), 8)  # Adam: m, v x 4.
    for worker in self.workers:
      got = worker["sharded_state"]
      # 4 shards of each slot in all, 2 on each worker.
      self.assertEqual(got["shard_sizes"],
                       [sizes[:2] for sizes in expected["shard_sizes"]])
      assert_close_nested(self, got["slots"], expected["slots"])

  def test_the_chiefs_saved_model_holds_the_whole_slots(self):
    slots = saved_slots(self.workdir("sharded_state") / "sharded.keras")
    assert_close_nested(self, slots, self.workers[0]["sharded_state"]["slots"])


@pytest.mark.slow
class LayoutMapTest(RunsOnWorkers, unittest.TestCase):
  """A layout map's model axis inside each worker: 2 workers x (1 replica
  over 2 devices) train as one device."""
  RUNS = ("custom_loop", "keras_fit", "keras_files")
  OPTIONS = "@row_parallel"

  def test_training_equals_one_device(self):
    for run in ("custom_loop", "keras_fit"):
      want = in_one_process(run, 1)
      for index, worker in enumerate(self.workers):
        with self.subTest(run=run, worker=index):
          assert_close_nested(self, worker[run], want)

  def test_only_the_chief_writes_the_split_weights_whole(self):
    assert_only_the_chief_wrote(self, self.workdir("keras_files"),
                                [w["keras_files"] for w in self.workers])


@pytest.mark.slow
class GradientCompressionTest(RunsOnWorkers, unittest.TestCase):
  """gradient_compression="bfloat16" across workers: 16-bit collective sums."""
  RUNS = ("custom_loop", "keras_fit")
  OPTIONS = "@bfloat16"
  LAUNCH = "compressed"

  def test_training_stays_within_the_precision_of_one_device(self):
    for run in self.RUNS:
      want = in_one_process(run, 1)
      for index, worker in enumerate(self.workers):
        with self.subTest(run=run, worker=index):
          test_gradient_compression.assert_compressed_close(
              self, worker[run], want, "bfloat16")


@pytest.mark.slow
class ShardedStateGradientCompressionTest(GradientCompressionTest):
  """The same with shard_optimizer_state=True: a 16-bit reduce-scatter."""
  OPTIONS = "@bfloat16+shard_optimizer_state"


@pytest.mark.slow
class ShardedVariablesGradientCompressionTest(RunsOnWorkers,
                                              unittest.TestCase):
  """Every weight in 4 shards: their gradient exchanges across workers in 16
  bits (the kernels' reduce-scatter, the Embedding rows' all-gather)."""
  RUNS = ("keras_fit", "embedding_fit")
  OPTIONS = "@bfloat16+4_shards"
  LAUNCH = "compressed"

  def test_training_stays_within_the_precision_of_one_device(self):
    for run in self.RUNS:
      want = test_gradient_compression.trained(in_one_process(run, 1))
      for index, worker in enumerate(self.workers):
        with self.subTest(run=run, worker=index):
          test_gradient_compression.assert_compressed_close(
              self, test_gradient_compression.trained(worker[run]), want,
              "bfloat16")


@pytest.mark.slow
class KerasCustomStepsTest(RunsOnWorkers, unittest.TestCase):
  RUNS = ("keras_custom_steps", "fewer_rows_than_replicas",
          "conv_last_batches")
  LAUNCH = "keras"

  def assert_workers_equal_one_process_with_four(self, run):
    expected = in_one_process(run)
    for worker in self.workers:
      assert_close_nested(self, worker[run], expected)

  def test_custom_steps_and_add_loss_equal_one_process_with_four(self):
    self.assert_workers_equal_one_process_with_four("keras_custom_steps")

  def test_fewer_rows_than_replicas_equal_one_process_with_four(self):
    self.assert_workers_equal_one_process_with_four("fewer_rows_than_replicas")

  def test_conv_last_batches_equal_one_device(self):
    want = test_empty_replicas.one_device(test_empty_replicas.last_batches)
    for index, worker in enumerate(self.workers):
      for rows, got in worker["conv_last_batches"].items():
        with self.subTest(worker=index, last_batch=rows):
          test_empty_replicas.assert_same(self, got, want[rows])


@pytest.mark.slow
class ShardedVariablesTest(RunsOnWorkers, unittest.TestCase):
  """Every weight cut in 4 shards, on 2 workers x 2, equals one process with 4."""
  # Custom loops and accumulation with sharded variables are checked in one
  # process; across workers, fit, the Embedding lookups and saving.
  RUNS = ("keras_fit", "embedding_fit", "sharded_state")
  OPTIONS = "@4_shards"
  LAUNCH = "sharded_variables"

  def test_training_equals_one_process_with_four_replicas(self):
    expected = in_one_process("keras_fit")
    for worker in self.workers:
      assert_close_nested(self, worker["keras_fit"], expected)

  def test_embedding_lookups_and_shards_across_workers(self):
    want = in_one_process("embedding_fit" + self.OPTIONS)
    # Table (40 rows), kernel (4 rows), bias (3 rows): shards of 4 replicas.
    self.assertEqual(want["shard_rows"], [[10] * 4, [1] * 4, [1, 1, 1, 0]])
    mirrored = in_one_process("embedding_fit")
    for index, worker in enumerate(self.workers):
      got = worker["embedding_fit"]
      self.assertEqual(got["shard_rows"],
                       [rows[2 * index:2 * index + 2]
                        for rows in want["shard_rows"]])
      for key in ("history", "weights", "predict", "slots"):
        assert_close_nested(self, got[key], mirrored[key])

  def test_the_chiefs_saved_model_holds_the_whole_weights_and_slots(self):
    state = self.workers[0]["sharded_state"]
    # Every slot of the sharded weights: 2 shards here, of 4 in all.
    self.assertEqual([len(sizes) for sizes in state["shard_sizes"]],
                     [2] * len(state["shard_sizes"]))
    slots = saved_slots(self.workdir("sharded_state") / "sharded.keras")
    assert_close_nested(self, slots, state["slots"])
    assert_close_nested(self, slots, in_one_process("sharded_state")["slots"])


def assert_only_the_chief_wrote(test, workdir, results):
  """`keras_files`' `workdir` holds the chief's files, once; worker 1's
  scratch directory (`results`: each worker's) is gone; the saved model
  holds the weights the workers trained."""
  written = sorted(str(p.relative_to(workdir))
                   for p in workdir.rglob("*") if p.is_file())
  first, second = results
  test.assertEqual(first["scratch"], [])
  # Worker 1's one scratch root (a process's runs share it), now gone.
  test.assertEqual(len(second["scratch"]), 1)
  test.assertFalse(os.path.exists(second["scratch"][0]))
  events = [f for f in written if "tfevents" in f]
  test.assertEqual(len(events), 1, written)  # One writer, not two.
  test.assertTrue(events[0].startswith("logs/train/"))
  for expected in ("ckpt-1.keras", "ckpt-2.keras", "final.keras",
                   "final.weights.h5", "exported/saved_model.pb"):
    test.assertIn(expected, written)
  test.assertFalse(any(f.startswith("backup") for f in written), written)
  saved = keras.models.load_model(workdir / "final.keras").get_weights()
  for result in results:
    assert_close_nested(test, [w.tolist() for w in saved], result["weights"])


@pytest.mark.slow
class FilesTest(RunsOnWorkers, unittest.TestCase):
  """Checkpoints, SavedModels, logs: written once; a restart resumes."""
  RUNS = ("keras_files",)

  def test_only_the_chief_writes_and_the_others_clean_up(self):
    assert_only_the_chief_wrote(self, self.workdir("keras_files"),
                                [w["keras_files"] for w in self.workers])

  def test_a_restarted_cluster_resumes_and_ends_as_if_uninterrupted(self):
    run = ["keras_backup_and_restore"]
    with tempfile.TemporaryDirectory() as out:
      status, output = launch_workers(run, out)
      self.assertNotEqual(status, 0, "the first run was not interrupted")
      self.assertTrue(pathlib.Path(out, run[0], "backup").is_dir(), output)
      resumed = results_of(run, out)
    expected = in_one_process("keras_backup_and_restore")
    for worker in resumed:
      got = worker["keras_backup_and_restore"]
      self.assertEqual(len(got["loss"]), 2)  # Epochs 3 and 4 only.
      assert_close_nested(self, got["loss"], expected["loss"][2:])
      assert_close_nested(self, got["weights"], expected["weights"])


@pytest.mark.slow
class PreemptionTest(RunsOnWorkers, unittest.TestCase):
  """SIGTERM or SIGKILL to worker 1 in epoch 3 of 4; --max-restarts resumes."""
  RUNS = ("keras_accumulation_uninterrupted",)

  def run_interrupted(self, run):
    """The launcher's output, the resumed results, what TMPDIR holds after."""
    with tempfile.TemporaryDirectory() as out, \
        tempfile.TemporaryDirectory() as tmp:
      status, output = launch_workers([run], out, env={"TMPDIR": tmp},
                                      launch_args=["--max-restarts", "1"])
      self.assertEqual(status, 0, output)
      workers = [json.loads((pathlib.Path(out) / f"worker_{i}.json")
                            .read_text())[run] for i in range(2)]
      scratch = [p for p in os.listdir(tmp) if p.startswith("replicator-")]
      self.assertFalse(pathlib.Path(out, run, "backup").exists())
    expected = in_one_process("keras_backup_and_restore")
    for got in workers:
      self.assertEqual(len(got["loss"]), 2)  # Epochs 3 and 4 only.
      assert_close_nested(self, got["loss"], expected["loss"][2:])
      assert_close_nested(self, got["weights"], expected["weights"])
    return output, scratch

  def test_gradient_accumulation_restarts_exactly(self):
    # Every worker exits after epoch 2 of 4 with a step pending in each
    # replica's accumulators; the launcher restarts them from the backup.
    run = "keras_accumulation_restarted"
    with tempfile.TemporaryDirectory() as out:
      status, output = launch_workers([run], out,
                                      launch_args=["--max-restarts", "1"])
      self.assertEqual(status, 0, output)
      self.assertIn("2 workers, 2 starts", output)  # Restarted once.
      restarted = [json.loads((pathlib.Path(out) / f"worker_{i}.json")
                              .read_text())[run] for i in range(2)]
    for got, want in zip(restarted, self.workers):
      want = want["keras_accumulation_uninterrupted"]
      self.assertEqual(got["loss"], want["loss"][2:])  # Epochs 3 and 4.
      self.assertEqual(got["weights"], want["weights"])  # To the bit.

  def test_sigterm_stops_every_worker_at_one_step_and_a_restart_resumes(self):
    output, scratch = self.run_interrupted("keras_preempted")
    # Signalled after step 10, seen after step 11: every worker stops after 12.
    stop = ("stops after step 12: /job:worker/replica:0/task:1 received "
            "SIGTERM")
    self.assertIn(f"[worker 0] /job:worker/replica:0/task:0 {stop}", output)
    self.assertIn(f"[worker 1] /job:worker/replica:0/task:1 {stop}", output)
    self.assertRegex(output, r"worker \d exited with status 143")
    self.assertIn("restarting every worker on fresh ports (restart 1", output)
    self.assertEqual(scratch, [])  # Removed before the preempted exit.

  def test_a_custom_loop_saves_at_the_agreed_step_and_resumes_there(self):
    run = "custom_loop_preempted"
    with tempfile.TemporaryDirectory() as out:
      status, output = launch_workers([run], out,
                                      launch_args=["--max-restarts", "1"])
      self.assertEqual(status, 0, output)
      workers = [json.loads((pathlib.Path(out) / f"worker_{i}.json")
                            .read_text())[run] for i in range(2)]
    # Signalled after step 5, seen there: every worker stops after step 6.
    self.assertIn("[worker 0] /job:worker/replica:0/task:0 stops after step 6: "
                  "/job:worker/replica:0/task:1 received SIGTERM", output)
    expected = in_one_process("custom_loop_preempted")
    for got in workers:
      self.assertEqual(got["start"], 6)
      assert_close_nested(self, got["weights"], expected["weights"])

  def signal_the_launcher(self, sig):
    """(status, output, seconds until no worker runs) after `sig` mid-fit."""
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryFile(
        "w+") as log:
      launcher = subprocess.Popen(
          [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers",
           "2", "--timeout", str(LAUNCH_TIMEOUT), "--", sys.executable,
           str(TESTS / "multi_worker_main.py"), "keras_until_stopped", out],
          stdout=log, stderr=subprocess.STDOUT, text=True)
      self.addCleanup(launcher.kill)
      workdir = pathlib.Path(out, "keras_until_stopped")
      pid_files = [workdir / f"pid{i}" for i in range(2)]
      deadline = time.monotonic() + 60
      while not all(p.exists() for p in pid_files):
        self.assertIsNone(launcher.poll())
        self.assertLess(time.monotonic(), deadline)
        time.sleep(0.1)
      pids = [int(p.read_text()) for p in pid_files]
      start = time.monotonic()
      launcher.send_signal(sig)
      launcher.wait(timeout=60)
      while any(alive(pid) for pid in pids):
        self.assertLess(time.monotonic() - start, 60)
        time.sleep(0.05)
      seconds = time.monotonic() - start
      log.seek(0)
      self.assertTrue((workdir / "backup" / "latest.weights.h5").exists())
      return launcher.returncode, log.read(), seconds

  def test_sigterm_to_the_launcher_stops_every_worker_at_one_step(self):
    status, output, seconds = self.signal_the_launcher(signal.SIGTERM)
    self.assertEqual(status, 143, output[-3000:])
    self.assertRegex(output, r"\[worker 0\] /job:worker/replica:0/task:0 "
                     r"stops after step \d+: /job:worker/replica:0/task:\d "
                     r"received SIGTERM")
    self.assertRegex(output, r"\[worker 1\] /job:worker/replica:0/task:1 "
                     r"stops after step \d+")
    self.assertLess(seconds, 15)

  def test_a_killed_launcher_leaves_no_worker(self):
    status, _, seconds = self.signal_the_launcher(signal.SIGKILL)
    self.assertEqual(status, -signal.SIGKILL)
    # Its watchdog's SIGTERM stopped them, well before its SIGKILL at 25 s.
    self.assertLess(seconds, 15)

  def test_a_killed_worker_exits_137_and_its_scratch_goes_at_the_restart(
      self):
    output, scratch = self.run_interrupted("keras_killed")
    self.assertIn("worker 1 was killed by SIGKILL", output)
    self.assertEqual(scratch, [])


@pytest.mark.slow
class NetworkTest(RunsOnWorkers, unittest.TestCase):
  """TF's server listens on every interface (hard-coded in TF 2.21), so the
  launcher gives its workers a network namespace with loopback only."""
  RUNS = ("listening_addresses",)

  def test_the_launchers_workers_can_be_reached_from_nowhere_else(self):
    ours = os.readlink("/proc/self/ns/net")
    for worker in self.workers:
      got = worker["listening_addresses"]
      self.assertTrue(got["listening"], got)  # It serves, on its port...
      self.assertEqual(got["interfaces"], ["lo"], got)  # ...on loopback only,
      self.assertNotEqual(got["network_namespace"], ours, got)  # not ours.
    self.assertEqual(
        self.workers[0]["listening_addresses"]["network_namespace"],
        self.workers[1]["listening_addresses"]["network_namespace"])

  def test_network_host_keeps_the_machines_network(self):
    with tempfile.TemporaryDirectory() as out:
      workers = results_of(["listening_addresses"], out,
                           launcher_args=["--network", "host"])
    for worker in workers:
      self.assertEqual(worker["listening_addresses"]["network_namespace"],
                       os.readlink("/proc/self/ns/net"))


FAULT_TIMEOUT = 10  # timeout_seconds the fault tests give the strategy.


def start_workers(indices, runs, out, num_workers=2):
  """Starts the workers at `indices` of a cluster, writing to `out`; the
  others never start."""
  addresses = [f"127.0.0.1:{p}" for p in launch.free_ports(num_workers)]
  return {
      i: subprocess.Popen(
          [sys.executable, str(TESTS / "multi_worker_main.py"), runs, out,
           str(FAULT_TIMEOUT)],
          env={**os.environ, "TF_CONFIG": launch.tf_config(addresses, i)},
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          start_new_session=True)
      for i in indices
  }


def outcome(process, limit=120):
  """(exit status, seconds, output) of a worker, killed after `limit` s."""
  start = time.monotonic()
  try:
    output, _ = process.communicate(timeout=limit)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate()
  return process.returncode, time.monotonic() - start, output


def kill_all(workers):
  for process in workers.values():
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


@pytest.mark.slow
class FaultTest(unittest.TestCase):
  """A worker that never starts, dies or freezes fails the others, named."""

  def setUp(self):
    super().setUp()
    self.out = self.enterContext(tempfile.TemporaryDirectory())

  def check_fails_naming(self, workers, survivor, missing_task):
    self.addCleanup(kill_all, workers)
    status, seconds, output = outcome(workers[survivor])
    self.assertNotEqual(status, 0, output[-3000:])
    self.assertNotEqual(status, -signal.SIGKILL, "hung: " + output[-3000:])
    self.assertLess(seconds, 6 * FAULT_TIMEOUT)
    self.assertIn(missing_task, output)

  def test_a_worker_that_never_starts_fails_the_chief_naming_it(self):
    workers = start_workers([0], "custom_loop", self.out)
    self.check_fails_naming(workers, 0, "Missing: /job:worker/replica:0/task:1")

  def test_a_chief_that_never_starts_fails_the_worker_naming_it(self):
    workers = start_workers([1], "custom_loop", self.out)
    self.check_fails_naming(
        workers, 1, "Missing: the chief, /job:worker/replica:0/task:0")

  def test_workers_with_different_device_counts_are_refused(self):
    with tempfile.TemporaryDirectory() as out:
      status, output = launch_workers(["primitives"], out,
                                      env={"MULTI_WORKER_DEVICES": "2,3"})
    self.assertNotEqual(status, 0)
    self.assertIn("Every worker must replicate over as many devices; they "
                  "have worker 0: 2, worker 1: 3", output)

  def test_a_worker_that_dies_mid_training_fails_the_chief_naming_it(self):
    workers = start_workers([0, 1], "peer_dies", self.out)
    self.check_fails_naming(workers, 0, "/job:worker/replica:0/task:1")

  def test_sigterm_outside_a_saving_loop_exits_143_and_fails_the_chief(self):
    workers = start_workers([0, 1], "peer_gets_sigterm", self.out)
    message = ("/job:worker/replica:0/task:1 received SIGTERM outside a "
               "training loop that saves on preemption")
    self.check_fails_naming(workers, 0, message)  # Told why, at once.
    status, _, output = outcome(workers[1])
    self.assertEqual(status, 143, output[-3000:])
    self.assertIn(message, output)

  def test_a_port_taken_by_another_process_is_named(self):
    with socket.socket() as taken:
      taken.bind(("127.0.0.1", 0))
      taken.listen()
      port = taken.getsockname()[1]
      address = f"127.0.0.1:{port}"
      worker = subprocess.Popen(
          [sys.executable, str(TESTS / "multi_worker_main.py"), "primitives",
           self.out, str(FAULT_TIMEOUT)],
          env={**os.environ, "TF_CONFIG": launch.tf_config(
              [address, f"127.0.0.1:{launch.free_ports(1)[0]}"], 0)},
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          start_new_session=True)
      self.addCleanup(kill_all, {0: worker})
      status, seconds, output = outcome(worker)
    self.assertNotEqual(status, 0)
    self.assertLess(seconds, 30)
    self.assertIn(f"/job:worker/replica:0/task:0 cannot listen on port {port}, "
                  f"the port of its address {address} in the cluster "
                  f"(Address already in use): another process holds it.",
                  output)

  def test_a_worker_that_freezes_mid_training_fails_the_chief_naming_it(self):
    workers = start_workers([0, 1], "peer_freezes", self.out)
    self.check_fails_naming(
        workers, 0, "stopped sending heartbeats):\n/job:worker/replica:0/task:1")


if __name__ == "__main__":
  unittest.main()
