"""Reading the cluster from TF_CONFIG or a resolver; every mistake caught early.

Nothing here starts a server: a bad cluster must fail before any network
activity, which the strategy tests check by making the runtime start fail.
"""

import json
import os
import unittest
from unittest import mock

from parameterized import parameterized
import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy.cluster import config as cluster_lib
from replicator_strategy.cluster import runtime as worker_runtime

TWO = ["127.0.0.1:2222", "127.0.0.1:2223"]


def tf_config(cluster, task=None, **extra):
  config = {"cluster": cluster, **extra}
  if task is not None:
    config["task"] = task
  return json.dumps(config)


def with_tf_config(raw):
  return mock.patch.dict(os.environ, {"TF_CONFIG": raw})


class FromEnvironmentTest(unittest.TestCase):

  def test_unset_empty_or_one_task_means_this_machine_alone(self):
    with mock.patch.dict(os.environ, {}, clear=True):
      self.assertIsNone(cluster_lib.from_environment())
    for raw in ("", "  ", tf_config({"worker": TWO[:1]}),
                tf_config({"worker": TWO[:1]}, {"type": "worker", "index": 0})):
      with with_tf_config(raw):
        self.assertIsNone(cluster_lib.from_environment(), raw)

  def test_workers_in_order_with_worker_zero_as_chief(self):
    with with_tf_config(tf_config({"worker": TWO},
                                  {"type": "worker", "index": 1})):
      cluster = cluster_lib.from_environment()
    self.assertEqual((cluster.num_workers, cluster.worker_index,
                      cluster.is_chief), (2, 1, False))
    self.assertEqual(cluster.task_name, "/job:worker/replica:0/task:1")
    self.assertEqual(cluster.addresses, tuple(TWO))

  def test_a_chief_task_comes_first(self):
    jobs = {"chief": ["127.0.0.1:2000"], "worker": TWO}
    with with_tf_config(tf_config(jobs, {"type": "worker", "index": 0})):
      worker = cluster_lib.from_environment()
    with with_tf_config(tf_config(jobs, {"type": "chief", "index": 0})):
      chief = cluster_lib.from_environment()
    self.assertEqual((worker.num_workers, worker.worker_index), (3, 1))
    self.assertTrue(chief.is_chief)
    self.assertEqual(worker.task_name_of(0), "/job:chief/replica:0/task:0")
    self.assertEqual(worker.task_name_of(2), "/job:worker/replica:0/task:1")

  @parameterized.expand([
      ("bad_json", '{"cluster": ', "not valid JSON"),
      ("not_an_object", "[1, 2]", "must be a JSON object"),
      ("cluster_not_an_object", '{"cluster": [1], "task": {}}',
       '"cluster" and "task" must be JSON objects'),
      ("missing_task", tf_config({"worker": TWO}), 'has no "task"'),
      ("task_type_not_in_cluster",
       tf_config({"worker": TWO}, {"type": "chief", "index": 0}),
       "type 'chief' is not a job of the cluster"),
      ("index_out_of_range",
       tf_config({"worker": TWO}, {"type": "worker", "index": 2}),
       "index 2 is out of range.*2 task.*0 to 1"),
      ("negative_index",
       tf_config({"worker": TWO}, {"type": "worker", "index": -1}),
       "index -1 is out of range"),
      ("index_not_an_int",
       tf_config({"worker": TWO}, {"type": "worker", "index": "1"}),
       "index must be an int \\(indices 0 to 1 for the 'worker' job\\). "
       "Received: index='1', a str. Write it without quotes: \"index\": 1."),
      ("one_task_index_out_of_range",
       tf_config({"worker": TWO[:1]}, {"type": "worker", "index": 3}),
       "index 3 is out of range: the 'worker' job has 1 task\\(s\\), index 0 "
       "only"),
      ("one_task_of_another_type",
       tf_config({"worker": TWO[:1]}, {"type": "chief", "index": 0}),
       "type 'chief' is not a job of the cluster"),
      ("duplicate_addresses",
       tf_config({"worker": [TWO[0], TWO[0]]}, {"type": "worker", "index": 0}),
       "127.0.0.1:2222' is given to more than one task"),
      ("duplicate_across_jobs",
       tf_config({"chief": [TWO[0]], "worker": TWO},
                 {"type": "chief", "index": 0}),
       "given to more than one task"),
      ("parameter_server",
       tf_config({"worker": TWO, "ps": ["127.0.0.1:3000"]},
                 {"type": "worker", "index": 0}),
       "'ps' task, which ReplicatorStrategy does not use"),
      ("evaluator",
       tf_config({"worker": TWO, "evaluator": ["127.0.0.1:3000"]},
                 {"type": "evaluator", "index": 0}),
       "'evaluator' task"),
      ("address_without_port",
       tf_config({"worker": ["127.0.0.1", TWO[1]]},
                 {"type": "worker", "index": 0}),
       "'127.0.0.1' of the 'worker' job is not \"host:port\""),
      ("port_out_of_range",
       tf_config({"worker": ["127.0.0.1:70000", TWO[1]]},
                 {"type": "worker", "index": 0}),
       "port in 1-65535"),
      ("addresses_not_a_list",
       tf_config({"worker": "127.0.0.1:1,127.0.0.1:2"},
                 {"type": "worker", "index": 0}),
       "must be a list of"),
      ("two_chiefs",
       tf_config({"chief": TWO, "worker": ["127.0.0.1:9"]},
                 {"type": "chief", "index": 0}),
       "2 chiefs"),
      ("lone_parameter_server", tf_config({"ps": [TWO[0]]}),
       "'ps' task"),
  ])
  def test_invalid_tf_config_says_what_to_fix(self, _, raw, message):
    with with_tf_config(raw):
      with self.assertRaisesRegex(ValueError, message):
        cluster_lib.from_environment()

  def test_invalid_tf_config_fails_the_strategy_before_any_network(self):
    raw = tf_config({"worker": [TWO[0], TWO[0]]}, {"type": "worker", "index": 0})
    with with_tf_config(raw), mock.patch.object(
        worker_runtime, "start", side_effect=AssertionError("network")):
      with self.assertRaisesRegex(ValueError, "more than one task"):
        rs.ReplicatorStrategy()

  def test_joining_a_cluster_after_tensorflow_started_says_so(self):
    tf.constant(1.0)  # The runtime is up in this process.
    with with_tf_config(tf_config({"worker": TWO},
                                  {"type": "worker", "index": 0})):
      with self.assertRaisesRegex(RuntimeError,
                                  "before TensorFlow starts its runtime"):
        rs.ReplicatorStrategy()


class FromResolverTest(unittest.TestCase):

  def test_a_cluster_resolver_describes_the_cluster(self):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO}), task_type="worker", task_id=1,
        rpc_layer="grpc")
    cluster = cluster_lib.from_resolver(resolver)
    self.assertEqual((cluster.worker_index, cluster.num_workers), (1, 2))

  def test_a_resolver_is_validated_like_tf_config(self):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO}), task_type="worker", task_id=5)
    with self.assertRaisesRegex(ValueError, "index 5 is out of range"):
      cluster_lib.from_resolver(resolver)

  def test_a_single_task_resolver_means_this_machine_alone(self):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO[:1]}), task_type="worker",
        task_id=0)
    self.assertIsNone(cluster_lib.from_resolver(resolver))

  def test_a_single_task_resolver_with_an_index_out_of_range_is_refused(self):
    # It used to train alone, as if its index were 0.
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO[:1]}), task_type="worker",
        task_id=3)
    with self.assertRaisesRegex(ValueError, "index 3 is out of range.*1 "
                                "task\\(s\\), index 0 only"):
      cluster_lib.from_resolver(resolver)

  def test_something_else_is_refused(self):
    with self.assertRaisesRegex(TypeError, "ClusterResolver"):
      rs.ReplicatorStrategy(cluster_resolver={"worker": TWO})


if __name__ == "__main__":
  unittest.main()
