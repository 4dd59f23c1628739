"""One mesh: `ReplicatorStrategy(mesh=DeviceMesh)` and the option records.

A mesh names each kind of parallelism as an axis ("group", "batch",
"model"); the older keywords are shorthands that build the same mesh and the
same records, so a strategy built either way trains the same.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

import models
import replicator_strategy as rs
from replicator_strategy import options as options_lib


def device_mesh(shape, names):
  devices = [f"/cpu:{i}" for i in range(int(np.prod(shape)))]
  return keras.distribution.DeviceMesh(shape, names, devices)


def fit_weights(strategy, steps=3):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16 * steps, 8)).astype(np.float32)
  y = rng.normal(size=(16 * steps, 3)).astype(np.float32)
  with strategy.scope():
    model = models.small_mlp()
    model.set_weights(models.initial_weights())
    model.compile(keras.optimizers.SGD(0.1), "mse")
  model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  return model.get_weights()


class MeshTest(unittest.TestCase):

  def test_keywords_build_the_mesh_they_describe(self):
    cases = [
        ({}, "batch 4", 1),
        ({"devices_per_replica": 2}, "batch 2 x model 2", 1),
        ({"sync_groups": 2}, "group 2 x batch 2", 2),
        ({"sync_groups": 4}, "group 4 x batch 1", 4),
    ]
    for keywords, shown, groups in cases:
      with self.subTest(**keywords):
        strategy = rs.ReplicatorStrategy(**keywords)
        self.assertEqual(str(strategy.mesh), shown)
        self.assertIn(f"; mesh {shown}; all-reduce", repr(strategy))
        self.assertEqual(strategy.num_sync_groups, groups)

  def test_a_mesh_gives_what_its_keywords_give(self):
    by_mesh = rs.ReplicatorStrategy(
        mesh=device_mesh((2, 2), ("batch", "model")))
    by_keywords = rs.ReplicatorStrategy(devices_per_replica=2)
    self.assertEqual(by_mesh.extended.worker_devices_by_replica,
                     by_keywords.extended.worker_devices_by_replica)
    self.assertEqual(by_mesh.num_replicas_in_sync, 2)
    grouped = rs.ReplicatorStrategy(
        mesh=device_mesh((2, 2), ("group", "batch")))
    self.assertEqual((grouped.num_sync_groups, grouped.num_replicas_in_sync),
                     (2, 2))
    self.assertEqual(options_lib.of(grouped).sync, rs.SyncGroups(groups=2))

  def test_axes_in_any_order_and_by_any_name(self):
    strategy = rs.ReplicatorStrategy(
        mesh=device_mesh((2, 2), ("tensor", "data")),
        axis_roles={"batch": "data", "model": "tensor"})
    self.assertEqual(str(strategy.mesh), "data (batch) 2 x tensor (model) 2")
    # The model axis is the mesh's first: replica r is column r.
    self.assertEqual(
        [[d[-5:] for d in replica]
         for replica in strategy.extended.worker_devices_by_replica],
        [["CPU:0", "CPU:2"], ["CPU:1", "CPU:3"]])

  def test_sync_groups_by_mesh_train_as_by_keyword(self):
    by_mesh = fit_weights(rs.ReplicatorStrategy(
        mesh=device_mesh((2, 2), ("group", "batch")),
        sync=rs.SyncGroups(groups=2, average_every=2)))
    by_keywords = fit_weights(rs.ReplicatorStrategy(
        sync_groups=2, average_every=2))
    for a, b in zip(by_mesh, by_keywords):
      np.testing.assert_array_equal(a, b)

  def test_records_equal_their_keywords(self):
    partitioner = rs.Sharding  # Any callable.
    cases = [
        (dict(sharding=rs.Sharding(optimizer_state=True,
                                   weights=partitioner)),
         dict(shard_optimizer_state=True, variable_partitioner=partitioner)),
        (dict(sync=rs.SyncGroups(groups=2, average_every=3, overlap=True)),
         dict(sync_groups=2, average_every=3, overlap_averaging=True)),
    ]
    for records, keywords in cases:
      with self.subTest(keywords=sorted(keywords)):
        a = options_lib.of(rs.ReplicatorStrategy(**records))
        b = options_lib.of(rs.ReplicatorStrategy(**keywords))
        self.assertEqual((a.sharding, a.sync), (b.sharding, b.sync))

  def test_weights_batch_shards_every_weight_over_the_replicas(self):
    strategy = rs.ReplicatorStrategy(sharding=rs.Sharding(weights="batch"))
    with strategy.scope():
      dense = keras.layers.Dense(3)
      dense.build((None, 8))
    shards = dense.kernel.value.values
    self.assertEqual([s.shape.as_list() for s in shards], [[2, 3]] * 4)
    self.assertEqual(len({s.device for s in shards}), 4)

  def test_options_of_another_strategy_is_none(self):
    self.assertIsNone(options_lib.of(tf.distribute.get_strategy()))
    self.assertIsNone(options_lib.of(tf.distribute.MirroredStrategy(["/cpu:0"])))
    self.assertIsNotNone(options_lib.of(rs.ReplicatorStrategy()))


class BadMeshTest(unittest.TestCase):

  def assert_refused(self, pattern, **kwargs):
    with self.assertRaisesRegex(ValueError, pattern):
      rs.ReplicatorStrategy(**kwargs)

  def test_an_axis_without_a_role(self):
    self.assert_refused(
        r"the axes \['x'\] have none.*axis_roles=",
        mesh=device_mesh((4,), ("x",)))

  def test_a_role_that_is_not_one(self):
    self.assert_refused(
        r"roles among \['group', 'batch', 'stage', 'model'\]. Received: \['tensor'\]",
        mesh=device_mesh((4,), ("batch",)), axis_roles={"tensor": "batch"})

  def test_a_mesh_beside_the_keywords_it_replaces(self):
    self.assert_refused(r"either `mesh` or `devices`",
                        mesh=device_mesh((4,), ("batch",)),
                        devices_per_replica=2)

  def test_a_mesh_whose_groups_disagree_with_sync(self):
    self.assert_refused(
        r"forms 2 sync group\(s\).*but sync groups=4",
        mesh=device_mesh((2, 2), ("group", "batch")),
        sync=rs.SyncGroups(groups=4))

  def test_a_record_beside_its_keywords(self):
    self.assert_refused(
        r"either `sync=` or the keywords it replaces.*average_every=2",
        sync=rs.SyncGroups(groups=2), average_every=2)

  def test_a_record_of_the_wrong_kind(self):
    self.assert_refused(r"Expected `sharding` to be a replicator_strategy"
                        r".Sharding. Received: sharding=True",
                        sharding=True)

  def test_a_layout_map_over_other_devices(self):
    layout_map = keras.distribution.LayoutMap(
        device_mesh((2, 2), ("batch", "model")))
    self.assert_refused(
        r"layout map's mesh and `mesh` must give each replica.s stages the same",
        mesh=device_mesh((4, 1), ("batch", "model")), layout_map=layout_map)

  def test_axis_roles_without_a_mesh(self):
    self.assert_refused(r"`axis_roles` names the axes of a `mesh`",
                        axis_roles={"batch": "data"})


if __name__ == "__main__":
  unittest.main()
