"""The benchmark's quick mode: every contender runs and their results agree.

Timings are not checked (a unit test is no place for them); the full run and
its table live in docs/performance.md. The quick run leaves out the
`model_parallel` section (its five contenders trace a transformer each, about
45 s of CPU); two of them run here in this process instead, as do the
`pipeline` section (a profiled step of each schedule) and the `memory` one.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # Holds `benchmarks`.
# Sections the quick run leaves out (tested in this process below).
IN_PROCESS = ("model_parallel", "pipeline", "memory")


def _import_benchmarks():
  """The `benchmarks` package, importable from the repository root."""
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  from benchmarks import options  # pylint: disable=g-import-not-at-top
  from benchmarks.sections import REGISTRY  # pylint: disable=g-import-not-at-top
  return options, REGISTRY


@pytest.mark.slow
class BenchmarkSmokeTest(unittest.TestCase):

  def test_quick_run_covers_every_contender_and_they_agree(self):
    _, registry = _import_benchmarks()
    sections = ",".join(name for name in registry if name not in IN_PROCESS)
    with tempfile.TemporaryDirectory() as out:
      path = pathlib.Path(out) / "results.json"
      env = {**os.environ, "PYTHONPATH": os.pathsep.join(
          [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
      with subprocess.Popen(
          [sys.executable, "-m", "benchmarks", "--quick", "--json", str(path),
           "--sections", sections],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
          env=env, start_new_session=True) as run:
        try:
          stdout, stderr = run.communicate(timeout=500)
        except subprocess.TimeoutExpired:
          # Its children run side by side: stop them with it.
          os.killpg(run.pid, signal.SIGKILL)
          stdout, stderr = run.communicate()
      self.assertEqual(run.returncode, 0, stdout[-3000:] + stderr[-5000:])
      results = json.loads(path.read_text())
    for section in ("fit", "custom"):
      rows = results[section]
      self.assertEqual({(r["model"], r["replicas"]) for r in rows},
                       {(m, n) for m in ("mlp", "convnet") for n in (1, 2, 4)})
      for row in rows:
        self.assertEqual(sorted(row["ms"]), ["mirrored", "none", "replicator"])
        self.assertTrue(all(ms > 0 for ms in row["ms"].values()), row)
        self.assertTrue(row["agree"], row)
    for row in results["allreduce"]:
      self.assertEqual(sorted(row["ms"]),
                       ["add_n floor", "mirrored", "replicator"])
      self.assertTrue(row["agree"], row)
    self.assertEqual({r["replicas"] for r in results["allreduce"]}, {2, 4})
    self.assertEqual(
        [(r["path"], r["replicas"]) for r in results["reducescatter"]],
        [(path, n) for n in (2, 4) for path in ("merge_call", "in tf.cond")])
    for row in results["reducescatter"]:
      # MirroredStrategy's reference all_reduce has no tf.cond path.
      self.assertEqual(set(row["ms"]), {"all_reduce", "reduce_scatter"} | (
          {"mirrored all_reduce"} if row["path"] == "merge_call" else set()))
      self.assertTrue(row["agree"], row)
    self.assertEqual([r["replicas"] for r in results["mapgather"]], [2, 4])
    for row in results["mapgather"]:
      self.assertEqual(sorted(row["ms"]), ["every replica", "map_gather"])
      self.assertTrue(row["agree"], row)
    self.assertIn("map_gather vs every replica running every thunk", stdout)
    self.assertEqual(
        [(r["part"], r["replicas"]) for r in results["parts"]],
        [(part, 4) for part in
         ("forward", "+ backward", "+ all-reduce", "+ update")])
    for row in results["parts"]:
      self.assertEqual(sorted(row["ms"]), ["mirrored", "none", "none, sliced",
                                           "replicator", "sharded"])
      self.assertTrue(row["agree"], row)
    self.assertEqual(
        [(r["hidden"], r["optimizer"], r["replicas"])
         for r in results["update"]],
        [(h, o, 4) for h in (16, 32) for o in ("sgd", "adam")])
    for row in results["update"]:
      self.assertEqual(set(row["ms"]), {
          f"{name} {measure}" for name in ("mirrored", "replicator", "sharded")
          for measure in ("apply", "exchange")})
      self.assertTrue(row["agree"], row)
    first = results["first"][0]
    for key in ("first_epoch_s", "peak_rss_mb"):
      self.assertEqual(sorted(first[key]), ["mirrored", "none", "replicator"])
      self.assertTrue(all(v > 0 for v in first[key].values()))
    self.assertEqual([r["variant"] for r in results["multi"]],
                     ["plain", "bfloat16", "accumulate 4"])
    for row in results["multi"]:
      self.assertTrue(row["agree"], row)
    self.assertEqual([r["variant"] for r in results["sync_groups"]],
                     ["sync"] + [f"2 groups, H={h}{overlap}"
                                 for h in (1, 8, 32)
                                 for overlap in ("", ", overlap")])
    sync_bytes = results["sync_groups"][0]["bytes per step"]
    for row in results["sync_groups"]:
      self.assertTrue(row["agree"], row)  # The workers end with one model.
      self.assertEqual(sorted(row["ms"]), ["1 process x 4", "2 workers x 2"])
    # A round every step moves the weights' bytes; every 8, fewer.
    by_variant = {r["variant"]: r["bytes per step"]
                  for r in results["sync_groups"]}
    self.assertEqual(by_variant["2 groups, H=1"], sync_bytes)
    # Overlapped, fit's end applies the exchange in flight and averages once
    # more: a round beyond one a step.
    self.assertGreater(by_variant["2 groups, H=1, overlap"], sync_bytes)
    for overlap in ("", ", overlap"):
      self.assertLess(by_variant[f"2 groups, H=8{overlap}"], sync_bytes)
    links = {r["variant"]: r for r in results["links"]}
    self.assertEqual(list(links), ["synchronous", "local SGD, H=8",
                                   "local SGD, H=8, overlap",
                                   "local SGD, H=8, int8", "DiLoCo, H=32",
                                   "streaming, H=32, F=4, int8"])
    for row in links.values():
      self.assertEqual(row["rate"], "unlimited")  # --quick: no link shaped.
      self.assertTrue(0 <= row["final_accuracy"] <= 1, row)
    # Every step's gradients against one round at fit's end.
    self.assertLess(links["local SGD, H=8"]["mb_between_workers"],
                    links["synchronous"]["mb_between_workers"])
    self.assertIn("Slow links (simulated: one shaped loopback)", stdout)
    exchange, = results["exchange"]
    self.assertEqual(len(exchange["ms"]), 10)  # 5 exchanges, 1 x 4 and 2 x 2.
    # The anchor (MultiWorkerMirroredStrategy) ran, and its sums agree too.
    self.assertEqual(sorted(exchange["anchor ms"]),
                     ["run, gradients", "run, nothing"])
    self.assertTrue(exchange["agree"], exchange)
    self.assertEqual(sorted(results["multi"][-1]["ms by kind"]), [
        f"{kind}, {where}" for kind in ("accumulate", "update")
        for where in ("1 process x 4", "2 workers x 2")])
    xla, = [r for r in results["xla"] if r["model"] == "mlp"]
    # MirroredStrategy cannot compile its replicated step with XLA.
    self.assertEqual(set(xla["ms"]) | set(xla["failed"]), {
        f"{name}{xla_suffix}" for name in ("none", "mirrored", "replicator")
        for xla_suffix in ("", "+xla")})
    self.assertIn("replicator+xla", xla["ms"])
    self.assertTrue(xla["agree"], xla)
    self.assertEqual([(r["model"], r["replicas"]) for r in results["overhead"]],
                     [(part, n) for n in (1, 2, 4)
                      for part in ("tiny", "input fetch")])
    for row in results["overhead"]:
      self.assertEqual(sorted(row["ms"]), ["mirrored", "none", "replicator"])
      self.assertTrue(row["agree"], row)
    self.assertEqual([(r["model"], r["replicas"]) for r in results["random"]],
                     [("dropout", 4), ("augmented", 4)])
    for row in results["random"]:
      self.assertEqual(sorted(row["ms"]), ["mirrored", "none", "replicator",
                                           "replicator, own draws"])
      self.assertTrue(row["agree"], row)  # One device's draws, bit for bit.
    self.assertIn("Random layers: Keras fit step, 4 replicas", stdout)
    sharding, = [r for r in results["sharding"] if r["measure"] == "memory"]
    contenders = ["mirrored", "replicator", "sharded", "zero3"]
    for key in ("optimizer_mb_per_device_max", "weight_mb_per_device_max",
                "peak_rss_mb"):
      self.assertEqual(sorted(sharding[key]), contenders)
      self.assertTrue(all(v > 0 for v in sharding[key].values()), sharding)
    self.assertEqual(set(sharding["optimizer_devices"].values()), {4})
    # Bytes are counted, not timed: each device holds a quarter of the slots.
    optimizer = sharding["optimizer_mb_per_device_max"]
    self.assertLess(optimizer["sharded"], 0.3 * optimizer["mirrored"])
    self.assertLess(optimizer["zero3"], 0.3 * optimizer["mirrored"])
    weights = sharding["weight_mb_per_device_max"]
    self.assertLess(weights["zero3"], 0.3 * weights["mirrored"])
    self.assertTrue(sharding["agree"], sharding)
    fit_steps = [r for r in results["sharding"] if r["measure"] == "fit step"]
    self.assertEqual([(r["optimizer"], r["replicas"]) for r in fit_steps],
                     [("sgd", 4), ("adam", 4)])
    for row in fit_steps:
      self.assertEqual(sorted(row["ms"]), contenders)
      self.assertTrue(row["agree"], row)
    embedding, = results["embedding"]
    self.assertEqual(sorted(embedding["ms"]),
                     ["mirrored", "none", "replicator", "zero3"])
    table = embedding["weight_mb_per_device_max"]
    self.assertLess(table["zero3"], 0.3 * table["mirrored"])
    self.assertTrue(embedding["agree"], embedding)
    self.assertIn("Sharded state (sharded) and weights too", stdout)
    self.assertIn("Embedding 2,000 x 8", stdout)
    self.assertIn("Keras fit step, ms (median)", stdout)

  def test_model_parallel_splits_weights_over_a_replicas_devices(self):
    options_lib, registry = _import_benchmarks()
    options = options_lib.Options(quick=True, sections=IN_PROCESS)
    section = registry["model_parallel"]
    # k=2 alone (the section's quick run adds k=1, k=4 and zero3), in this
    # process: --quick runs a section's children in the caller.
    row, = section.fresh(options, names=("k=2",))
    self.assertEqual(row["split_weights"], {"k=2": 10})
    self.assertEqual(row["weight_devices"], {"k=2": 4})
    # Bytes are counted: each device holds half of each split weight and of
    # its two Adam slots (mirrored: one slot's bytes, and two), and the
    # tiny model's embedding, logits and norms whole.
    one_copy = row["adam_slot_mb"]
    self.assertLess(row["weight_mb_per_device_max"]["k=2"], 0.75 * one_copy)
    self.assertLess(row["optimizer_mb_per_device_max"]["k=2"], 1.5 * one_copy)
    self.assertAlmostEqual(row["weight_mb_total"]["k=2"], 2 * one_copy)
    table = "\n".join(section.table(options, [row]))
    self.assertIn("Model parallel (layout_map, k devices a replica)", table)

  def test_tensor_parallel_with_zero3_holds_a_quarter_per_device(self):
    options_lib, registry = _import_benchmarks()
    options = options_lib.Options(quick=True, sections=IN_PROCESS)
    section = registry["model_parallel"]
    row, = section.fresh(options, names=("k=2+zero3",))
    self.assertEqual(row["split_weights"], {"k=2+zero3": 13})
    # Weights, gradients and Adam slots: each device about a quarter (the
    # norms and biases, sharded on each replica's first device, a little
    # more there).
    self.assertLess(row["state_over_quarter"]["k=2+zero3"], 1.1)
    table = "\n".join(section.table(options, [row]))
    self.assertIn("w+grad+Adam/dev max", table)

  def test_pipeline_measures_each_schedule_and_the_step(self):
    options_lib, registry = _import_benchmarks()
    from replicator_strategy.pipeline import schedules  # pylint: disable=g-import-not-at-top
    options = options_lib.Options(quick=True, sections=("pipeline",))
    section = registry["pipeline"]
    rows = section.fresh(options)
    bubbles = [r for r in rows if r["measure"] == "bubble"]
    self.assertEqual(
        [(r["schedule"], r["stages"], r["microbatches"], r["virtual"])
         for r in bubbles],
        [(name, s, 4, 2 if name == "interleaved_1f1b" else 1)
         for s in (2, 4) for name in ("gpipe", "1f1b", "zb_h1",
                                      "interleaved_1f1b")])
    for r in bubbles:
      plan = schedules.schedule(r["schedule"], r["stages"], 4, r["virtual"])
      self.assertEqual(r["simulated"], schedules.bubble_fraction(plan))
      self.assertEqual(r["theory"], (r["stages"] - 1) / (r["stages"] + 3))
      self.assertTrue(0 < r["measured"] < 1, r)
      self.assertEqual(len(r["busy"]), r["stages"])
      self.assertTrue(all(0 < b <= 1 for b in r["busy"]), r)
      self.assertGreaterEqual(r["parallelism"], 1 - 1e-9)
      # Each device's activations, held from its F to its last backward in
      # the measured timeline, peak at the schedule's bound: the measured
      # order is the schedule's, and the graph frees what it says.
      self.assertEqual(r["peak_held_kb"], r["bound_kb"])
      self.assertTrue(all(kb > 0 for kb in r["bound_kb"]), r)
    by_name = {(r["schedule"], r["stages"]): r for r in bubbles}
    for s in (2, 4):
      self.assertLess(by_name["zb_h1", s]["simulated"],
                      by_name["1f1b", s]["simulated"])
      # GPipe holds every micro-batch's activations, 1F1B's last device one.
      self.assertEqual(by_name["gpipe", s]["bound_kb"][-1],
                       4 * by_name["1f1b", s]["bound_kb"][-1])
    step, = [r for r in rows if r["measure"] == "step"]
    self.assertEqual(sorted(step["ms"]),
                     ["data parallel", "one device", "pipeline"])
    self.assertTrue(all(ms > 0 for ms in step["ms"].values()), step)
    # The same losses 3 ways, before and after an update.
    self.assertTrue(step["agree"], step)
    self.assertEqual({len(v) for v in step["losses"].values()}, {2})
    table = "\n".join(section.table(options, rows))
    self.assertIn("is the one to compare with the simulated", table)
    self.assertIn("pipe/data", table)

  def test_memory_counts_what_sequence_parallelism_and_remat_save(self):
    options_lib, registry = _import_benchmarks()
    options = options_lib.Options(quick=True, sections=("memory",))
    section = registry["memory"]
    row, = section.fresh(options)
    tp, sp, selective, layers, full = row["ms"]
    self.assertEqual([tp, sp, selective, layers, full], [
        "tensor parallel", "+ sequence parallel", "+ SP, selective remat",
        "+ SP, remat attn+up", "+ SP, full remat"])
    self.assertTrue(row["agree"], row)  # Each equals one device.
    norms = row["norm_dropout_mb"]
    # The blocks' LayerNorms and dropouts: whole on device 0 without
    # sequence parallelism, a quarter of the sequence a device with it (and
    # their outputs, read by the exchange alone, no longer held).
    self.assertLessEqual(norms[sp], 1.1 * norms[tp] / 4)
    held = row["held_mb"]
    self.assertLess(held[sp], held[tp])
    self.assertLess(held[selective], held[sp])
    # Each block's attention and up recomputed (at these sizes "larger_than"
    # picks nearly every layer): less than 60% of what SP alone holds.
    self.assertLess(held[layers], 0.6 * held[sp])
    self.assertLess(held[full], 0.2 * held[sp])
    self.assertLessEqual(row["peak_mb"][full], row["peak_mb"][sp])
    table = "\n".join(section.table(options, [row]))
    self.assertIn("Activation memory: transformer", table)

  def test_memory_trace_counts_copies_and_leaves_out_what_is_pruned(self):
    _import_benchmarks()
    from benchmarks import memory_trace  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    @tf.function
    def step(x):
      with tf.device("/cpu:0"):
        a = x * 2.0               # 1 KiB on device 0, read on device 1.
        unused = tf.concat([a, a], 0)  # Pruned: nothing reads it.
        del unused
      with tf.device("/cpu:1"):
        b = a + 1.0               # The copy of a (1 KiB), then b (1 KiB).
      return tf.reduce_sum(b)

    graph = step.get_concrete_function(tf.ones([256])).graph
    peak = {d[-5:]: v for d, v in memory_trace.live_bytes(graph).peak.items()
            if d}
    self.assertEqual(peak, {"CPU:0": 1024, "CPU:1": 2048})

  def test_pipeline_timelines_draw_a_measured_step_small(self):
    options_lib, _ = _import_benchmarks()
    from benchmarks import pipeline_timelines  # pylint: disable=g-import-not-at-top
    from benchmarks.sections import pipeline  # pylint: disable=g-import-not-at-top
    size = options_lib.Options(quick=True).size
    measured = pipeline.measured_run(size, "zb_h1", 4, 8, 1)
    # Every action ran ops but ZB-H1's first-stage B (no input gradient).
    self.assertEqual(
        {a for d in measured.plan for a in d} - set(measured.spans),
        {a for a in measured.plan[0]
         if a.kind == "B"})
    with tempfile.TemporaryDirectory() as out:
      path = pathlib.Path(out) / "zb_h1.png"
      pipeline_timelines.draw(measured, path, "zb_h1")
      data = path.read_bytes()
    self.assertTrue(data.startswith(b"\x89PNG"))
    self.assertLess(len(data), 100_000)

if __name__ == "__main__":
  unittest.main()


class FreshChildTest(unittest.TestCase):
  """`processes.fresh`: a child killed by a signal runs once more; a child
  that fails for good raises with the end of its stderr."""

  def _fresh_running(self, script, marker):
    _import_benchmarks()
    from benchmarks import processes  # pylint: disable=g-import-not-at-top
    command = [sys.executable, "-c", script, marker]
    with mock.patch.object(processes, "_command",
                                    lambda *args, **kwargs: command):
      return processes.fresh(None, "replicas", "1", timeout=60)

  def test_a_child_killed_by_a_signal_runs_once_more(self):
    # The first run leaves a marker and kills itself; the second answers.
    script = ("import os, signal, sys\n"
              "if not os.path.exists(sys.argv[1]):\n"
              "  open(sys.argv[1], 'w').close()\n"
              "  print('stacks of the crash', file=sys.stderr, flush=True)\n"
              "  os.kill(os.getpid(), signal.SIGSEGV)\n"
              "print('{\"runs\": 2}')\n")
    with tempfile.TemporaryDirectory() as out:
      self.assertEqual(
          self._fresh_running(script, os.path.join(out, "ran")), {"runs": 2})

  def test_a_child_that_crashes_twice_raises_with_its_stderr(self):
    script = ("import os, signal, sys\n"
              "print('stacks of the crash', file=sys.stderr, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGSEGV)\n")
    _import_benchmarks()
    from benchmarks import processes  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(processes.ChildFailed,
                                r"exit status -11;(.|\n)*stacks of the crash"):
      self._fresh_running(script, "unused")

  def test_a_child_that_exits_with_an_error_is_not_run_again(self):
    script = ("import os, sys\n"
              "with open(sys.argv[1], 'a') as f: f.write('x')\n"
              "sys.exit('bad flag')\n")
    _import_benchmarks()
    from benchmarks import processes  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as out:
      marker = os.path.join(out, "runs")
      with self.assertRaisesRegex(processes.ChildFailed, "bad flag"):
        self._fresh_running(script, marker)
      with open(marker, encoding="utf-8") as f:
        self.assertEqual(f.read(), "x")
