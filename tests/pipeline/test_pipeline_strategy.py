"""`ReplicatorStrategy(pipeline=rs.Pipeline(...))`: the record, the stage axis.

A pipeline's stages are an axis of the mesh, between "batch" and "model": 4
devices and 4 stages are one pipeline (one replica), 2 stages two pipelines
side by side (two replicas, data parallel), each replica's devices its stages
in order.
"""

import math
import unittest

import keras

import replicator_strategy as rs
from replicator_strategy import options as options_lib


def device_mesh(shape, names):
  devices = [f"/cpu:{i}" for i in range(math.prod(shape))]
  return keras.distribution.DeviceMesh(shape, names, devices)


def short(devices):
  return [d[-5:] for d in devices]


class PipelineOptionsTest(unittest.TestCase):

  def test_the_record_keeps_its_options(self):
    pipeline = rs.Pipeline(stages=2, microbatches=4, schedule="GPipe",
                           split=["dense_1"])
    self.assertEqual(pipeline, rs.Pipeline(2, 4, "gpipe", ("dense_1",)))
    strategy = rs.ReplicatorStrategy(pipeline=pipeline)
    self.assertEqual(options_lib.of(strategy).pipeline, pipeline)
    self.assertIsNone(options_lib.of(rs.ReplicatorStrategy()).pipeline)

  def test_bad_options_say_what_to_pass(self):
    cases = [
        (dict(stages=0), r"`stages` to be an int of at least 1. Received: "
                         r"stages=0. Pass how many stages"),
        (dict(stages=True), r"Received: stages=True"),
        (dict(microbatches=0), r"`microbatches`.*Received: microbatches=0"),
        (dict(schedule="pipedream"),
         r"`schedule` to be one of \['gpipe', '1f1b', 'interleaved_1f1b', "
         r"'zb_h1'\].*Received: schedule='pipedream'"),
        (dict(virtual=2), r"only the \"interleaved_1f1b\" schedule has"),
        (dict(stages=3, split=["a"]),
         r"`split` to be None or a list of 2 layer name\(s\).*split=\['a'\]"),
    ]
    for kwargs, pattern in cases:
      with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, pattern):
        rs.Pipeline(**kwargs)

  def test_stages_that_do_not_divide_the_devices(self):
    with self.assertRaisesRegex(
        ValueError, r"`Pipeline\(stages=3\)` gives each replica 3.*it has 4, "
        r"not a multiple of 3. Pass a number of stages that divides 4"):
      rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=3))
    with self.assertRaisesRegex(ValueError, r"2 x 2 = 4.*it has 2"):
      rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"], devices_per_replica=2,
                            pipeline=rs.Pipeline(stages=2))

  def test_a_pipeline_of_the_wrong_kind(self):
    with self.assertRaisesRegex(ValueError, r"`pipeline` to be None or a "
                                r"replicator_strategy.Pipeline.*pipeline=2"):
      rs.ReplicatorStrategy(pipeline=2)

  def test_zero3_with_a_layout_map_inside_the_stages(self):
    # Trained as one device on 8 CPUs: test_pipeline_layouts.py's
    # ZeRO3BatchStageModelTest.
    mesh = device_mesh((1, 2, 2), ("batch", "stage", "model"))
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*kernel"] = (None, "model")
    for kwargs in (dict(variable_partitioner=lambda shape, dtype: [2, 1]),
                   dict(sharding=rs.Sharding(weights="batch"))):
      with self.subTest(list(kwargs)):
        strategy = rs.ReplicatorStrategy(
            mesh=mesh, layout_map=layouts, pipeline=rs.Pipeline(stages=2),
            **kwargs)
        self.assertEqual(str(strategy.mesh), "batch 1 x stage 2 x model 2")
        self.assertIsNotNone(strategy.extended.variable_partitioner)

  def test_a_mesh_whose_stages_disagree(self):
    with self.assertRaisesRegex(ValueError, r"The mesh has 2 stage\(s\).*but "
                                r"pipeline stages=4"):
      rs.ReplicatorStrategy(mesh=device_mesh((2, 2), ("batch", "stage")),
                            pipeline=rs.Pipeline(stages=4))
    with self.assertRaisesRegex(ValueError, r"The mesh has 1 stage\(s\)"):
      rs.ReplicatorStrategy(mesh=device_mesh((4,), ("batch",)),
                            pipeline=rs.Pipeline(stages=2))


class StageAxisTest(unittest.TestCase):

  def test_stages_by_keyword(self):
    cases = [
        (4, "batch 1 x stage 4", [["CPU:0", "CPU:1", "CPU:2", "CPU:3"]]),
        (2, "batch 2 x stage 2", [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]),
        (1, "batch 4", [["CPU:0"], ["CPU:1"], ["CPU:2"], ["CPU:3"]]),
    ]
    for stages, shown, replicas in cases:
      with self.subTest(stages=stages):
        strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=stages))
        self.assertEqual(str(strategy.mesh), shown)
        self.assertIn(f"mesh {shown};", repr(strategy))
        self.assertEqual(strategy.num_replicas_in_sync, len(replicas))
        self.assertEqual([short(r) for r in
                          strategy.extended.worker_devices_by_replica],
                         replicas)

  def test_a_mesh_gives_what_its_keywords_give(self):
    by_mesh = rs.ReplicatorStrategy(
        mesh=device_mesh((2, 2), ("batch", "stage")))
    by_keywords = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    self.assertEqual(str(by_mesh.mesh), "batch 2 x stage 2")
    self.assertEqual(by_mesh.extended.worker_devices_by_replica,
                     by_keywords.extended.worker_devices_by_replica)
    self.assertEqual(options_lib.of(by_mesh).pipeline, rs.Pipeline(stages=2))

  def test_each_stage_s_devices(self):
    strategy = rs.ReplicatorStrategy(pipeline=rs.Pipeline(stages=2))
    devices = strategy.extended.logical_devices
    self.assertEqual([[short(s) for s in devices.stage_devices(r)]
                      for r in range(2)],
                     [[["CPU:0"], ["CPU:1"]], [["CPU:2"], ["CPU:3"]]])

  def test_a_replica_is_stage_by_model(self):
    cases = [
        # The mesh's first axis is the model axis: stage s is column s.
        (rs.ReplicatorStrategy(mesh=device_mesh(
            (2, 1, 2), ("model", "batch", "stage"))),
         [["CPU:0", "CPU:2"], ["CPU:1", "CPU:3"]]),
        (rs.ReplicatorStrategy(devices_per_replica=2,
                               pipeline=rs.Pipeline(stages=2)),
         [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]),
    ]
    for strategy, stages in cases:
      with self.subTest(stages=stages):
        self.assertEqual(str(strategy.mesh).replace(" (model)", ""),
                         "batch 1 x stage 2 x model 2")
        self.assertEqual(strategy.num_replicas_in_sync, 1)
        self.assertEqual(
            [short(s) for s in
             strategy.extended.logical_devices.stage_devices(0)], stages)

if __name__ == "__main__":
  unittest.main()
