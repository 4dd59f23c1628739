"""The runnable examples still run, each in a fresh process.

The digits examples train two short epochs. The paper's workloads (ResNet,
SN-GAN, D4PG) run with `--quick`: the checks are that they finish, print
the topology first and the wall time last, report a finite result and write
their files, not the quality of a full run (docs/examples.md has those), and
that, run as a user's shell runs them, they print no TensorFlow C++ log line
and no warning a user cannot act on.
"""

import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from parameterized import parameterized
import pytest

import default_output
import topology

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "keras_examples"
TOPOLOGY_2_REPLICAS = r"ReplicatorStrategy\(2 replicas: .*CPU:0.*CPU:1"
ENV = default_output.user_environ()
# Keras's, when fit is given shuffle=True (its default) with a dataset.
SHUFFLE_IGNORED = "`shuffle=True` was passed, but will be ignored"

# script, extra flags, the line with its result, the files it writes.
WORKLOADS = [
    ("resnet_digits.py", [], "test accuracy", ["curves.png"]),
    ("sngan_digits.py", ["--loop", "fit"],
     "generated digits classified as intended", ["curves.png", "samples.png"]),
    ("sngan_digits.py", ["--loop", "custom"],
     "generated digits classified as intended", ["curves.png", "samples.png"]),
    ("d4pg.py", [], r"average return over \d+ episodes", ["curves.png"]),
    # A Control Suite task (1000 steps an episode): 2 actors keep it short.
    ("d4pg.py", ["--env", "cartpole-swingup", "--actors", "2"],
     r"average return over \d+ episodes", ["curves.png"]),
]


def reported(stdout, label):
  """The number printed after `label:` (the last such line)."""
  return float(re.findall(label + r": (\S+)", stdout)[-1])


def d4pg_module():
  """keras_examples/d4pg.py, imported (its `main` is not run)."""
  if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
  import d4pg  # pylint: disable=g-import-not-at-top
  return d4pg


class ControlSuiteTaskTest(unittest.TestCase):
  """d4pg.py's Control Suite environment: flat observations, scaled actions."""

  def test_observations_are_flat_and_resets_seeded(self):
    env = d4pg_module().ControlSuiteTask("cartpole-swingup")
    # position (cart, cos and sin of the pole) and velocity (2).
    self.assertEqual((env.observation_size, env.action_size), (5, 1))
    first = env.reset(seed=3)
    self.assertEqual(first.shape, (5,))
    np.testing.assert_array_equal(env.reset(seed=3), first)
    self.assertFalse(np.array_equal(env.reset(seed=4), first))
    observation, reward, done = env.step(np.array([1.0]))
    self.assertEqual(observation.shape, (5,))
    self.assertTrue(0.0 <= reward <= 1.0)
    self.assertFalse(done)
    low, high = env.support(0.99)
    self.assertEqual(low, 0.0)
    self.assertAlmostEqual(high, 100.0)

  def test_an_unknown_task_is_named_with_the_choices(self):
    with self.assertRaisesRegex(
        ValueError, r"Received: --env cartpole-upside.*cartpole-swingup"):
      d4pg_module().ControlSuiteTask("cartpole-upside")


class D4pgLearnerTest(unittest.TestCase):
  """d4pg.py's actors and learner: the NumPy policy, the replicas' batches."""

  def learner(self, num_replicas):
    d4pg = d4pg_module()
    import harness  # pylint: disable=g-import-not-at-top
    args = harness.parse_args(d4pg.__doc__, d4pg.add_arguments,
                              ["--updates-per-call", "3",
                               "--global-batch-size", "8"])
    return d4pg.Learner(topology.strategy_over(num_replicas), 5, 1,
                        (0.0, 100.0), args)

  def test_the_numpy_policy_is_the_actor(self):
    actor = self.learner(1).actor
    observations = np.random.default_rng(0).normal(
        0, 5, (16, 5)).astype("float32")
    np.testing.assert_allclose(
        d4pg_module().numpy_policy(actor)(observations),
        actor(observations), rtol=1e-5, atol=1e-7)

  def test_every_replica_count_trains_on_the_same_global_batch(self):
    def global_batch(num_replicas):
      buffer = d4pg_module().ReplayBuffer(100, seed=0)
      buffer.add(tuple(np.arange(50 * width, dtype="float32").reshape(
          50, width) for width in (5, 1, 1, 1, 5)))
      learner = self.learner(num_replicas)
      replicas = learner.strategy.experimental_local_results(
          learner.sample_batches(buffer))
      return [np.concatenate([r[field] for r in replicas], axis=1)
              for field in range(5)]

    one, four = global_batch(1), global_batch(4)
    self.assertEqual(one[0].shape, (3, 8, 5))
    for field_one, field_four in zip(one, four):
      np.testing.assert_array_equal(field_one, field_four)


class ExamplesTest(unittest.TestCase):

  @parameterized.expand(["train_digits.py", "custom_loop_digits.py"])
  @pytest.mark.slow
  def test_example_trains_and_reports(self, script):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--epochs", "2",
         "--replicas", "2"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    # The topology first, the wall time last; no TensorFlow start-up lines.
    self.assertRegex(lines[0], r"^ReplicatorStrategy\(2 replicas: .*CPU:0.*CPU:1")
    self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
    self.assertNotIn("oneDNN custom operations", done.stderr)
    accuracy = float(done.stdout.rsplit("test accuracy:", 1)[1].split()[0])
    self.assertGreater(accuracy, 0.5)  # 2 epochs; chance is 0.1.

  @pytest.mark.slow
  def test_the_transformer_trains_with_its_heads_split(self):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "transformer_digits.py"), "--epochs",
         "3"], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    self.assertRegex(lines[0], r"^ReplicatorStrategy\(2 replicas: .*CPU:0.*CPU:2")
    self.assertEqual(lines[1], "up/kernel [32, 128] in 2 parts of [32, 64], on "
                     "device:CPU:0, device:CPU:1, device:CPU:2, device:CPU:3")
    self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
    accuracy = float(done.stdout.rsplit("test accuracy:", 1)[1].split()[0])
    self.assertGreater(accuracy, 0.5)  # 3 epochs; chance is 0.1.

  @pytest.mark.slow
  def test_keras_distribution_trains_the_same_data_or_model_parallel(self):
    reports = {}
    for flags in (["--replicas", "4"],
                  ["--replicas", "2", "--model-parallel", "2"]):
      done = subprocess.run(
          [sys.executable, str(EXAMPLES / "keras_distribution_digits.py"),
           "--epochs", "3", *flags], capture_output=True, text=True,
          timeout=300, check=False,
          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      lines = done.stdout.splitlines()
      self.assertRegex(lines[0], r"^ReplicatorStrategy\(\d replicas: ")
      self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
      reports[flags[1]] = (lines[1], float(
          done.stdout.rsplit("test accuracy:", 1)[1].split()[0]))
    copies = ", ".join(f"(32, 128) on CPU:{i}" for i in range(4))
    parts = ", ".join(f"(32, 64) on CPU:{i}" for i in range(4))
    self.assertEqual(reports["4"][0], f"up/kernel (32, 128), held as {copies}")
    self.assertEqual(reports["2"][0], f"up/kernel (32, 128), held as {parts}")
    self.assertGreater(reports["4"][1], 0.5)  # 3 epochs; chance is 0.1.
    # The same global batches and seed: the same model, up to float sums.
    self.assertAlmostEqual(reports["4"][1], reports["2"][1], delta=0.01)

  @pytest.mark.slow
  def test_the_pipeline_trains_the_same_whatever_its_schedule(self):
    accuracies = []
    for schedule in ("gpipe", "zb_h1"):
      done = subprocess.run(
          [sys.executable, str(EXAMPLES / "pipeline_digits.py"), "--epochs",
           "3", "--schedule", schedule], capture_output=True, text=True,
          timeout=300, check=False,
          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      lines = done.stdout.splitlines()
      self.assertRegex(lines[0], r"^ReplicatorStrategy\(2 replicas: .*CPU:0.*"
                       r"CPU:2; mesh batch 2 x stage 2")
      self.assertRegex(lines[1], r"^stage 0: \d+ layers, \d+ weights$")
      self.assertRegex(lines[2], r"^stage 1: \d+ layers, \d+ weights$")
      self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
      accuracies.append(float(
          done.stdout.rsplit("test accuracy:", 1)[1].split()[0]))
    self.assertGreater(accuracies[0], 0.5)  # 3 epochs; chance is 0.1.
    # Every schedule sums the same gradients: the same model, up to float sums.
    self.assertAlmostEqual(accuracies[0], accuracies[1], delta=0.01)

  @parameterized.expand(["train_digits.py", "custom_loop_digits.py",
                         "transformer_digits.py", "keras_distribution_digits.py",
                         "pipeline_digits.py",
                         "resnet_digits.py",
                         "sngan_digits.py", "d4pg.py"])
  def test_help_answers_without_importing_tensorflow(self, script):
    # -X importtime lists every module imported, on stderr.
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(EXAMPLES / script), "--help"],
        capture_output=True, text=True, timeout=60, check=True)
    self.assertIn("--global-batch-size", done.stdout)
    # Without a GPU, 4 replicas by default, as train_digits.py; these two
    # make 2 replicas of 2 devices each.
    if script not in ("transformer_digits.py", "pipeline_digits.py"):
      replicas = " ".join(done.stdout.split()).split("--replicas REPLICAS")[2]
      self.assertIn("(default: 4", replicas.split(" --")[0])
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines()}
    self.assertIn("argparse", imported)
    self.assertFalse(imported & {"tensorflow", "keras", "sklearn", "gymnasium"})

  @parameterized.expand([(f"{w[0][:-3]}_{'_'.join(w[1]) or 'default'}",) + w
                         for w in WORKLOADS])
  @pytest.mark.slow
  def test_quick_run_reports_and_writes_files(self, _, script, flags, label,
                                              files):
    with tempfile.TemporaryDirectory() as output_dir:
      done = subprocess.run(
          [sys.executable, str(EXAMPLES / script), "--quick", "--replicas",
           "2", "--output-dir", output_dir] + flags,
          capture_output=True, text=True, timeout=300, check=False, env=ENV)
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      self.assert_quiet(done)
      lines = done.stdout.strip().splitlines()
      self.assertRegex(lines[0], TOPOLOGY_2_REPLICAS)
      self.assertRegex(lines[-1], r"^wall time: \d+\.\d s$")
      self.assertTrue(math.isfinite(reported(done.stdout, label)),
                      done.stdout[-2000:])
      for name in files:
        self.assertGreater(os.path.getsize(os.path.join(output_dir, name)),
                           1000, name)
      event_files = list(pathlib.Path(output_dir, "tensorboard").glob(
          "**/events.out.tfevents.*"))
      self.assertTrue(event_files, "no TensorBoard logs")

  @pytest.mark.slow
  def test_quick_run_as_two_workers_writes_once(self):
    with tempfile.TemporaryDirectory() as output_dir:
      done = subprocess.run(
          [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers",
           "2", "--output", "all", "--timeout", "240", "--", sys.executable,
           str(EXAMPLES / "d4pg.py"), "--quick", "--replicas", "2",
           "--output-dir", output_dir],
          capture_output=True, text=True, timeout=300, check=False, env=ENV)
      self.assertEqual(done.returncode, 0, done.stdout[-3000:])
      self.assert_quiet(done)
      for worker in (0, 1):
        self.assertRegex(
            done.stdout, rf"\[worker {worker}\] ReplicatorStrategy\(4 "
            rf"replicas over 2 workers, this is worker {worker}")
        self.assertTrue(math.isfinite(reported(
            done.stdout, rf"\[worker {worker}\] average return over \d+ "
            r"episodes")))
      self.assertEqual(done.stdout.count("wrote "), 1, done.stdout[-3000:])
      self.assertTrue(os.path.exists(os.path.join(output_dir, "curves.png")))

  def assert_quiet(self, done):
    output = done.stdout + done.stderr
    self.assertNotRegex(output, default_output.TENSORFLOW_LOG_LINE,
                        output[-3000:])
    self.assertNotIn(SHUFFLE_IGNORED, output)


if __name__ == "__main__":
  unittest.main()
