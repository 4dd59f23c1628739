"""README's "Not yet" list is what the code refuses, no more and no less.

Each item of the list names a refusal checked here (it really is refused);
every combination of the constructor's options is accepted unless the list
names it; and each `NotImplementedError` the constructor raises is one of
the items.
"""

import ast
import inspect
import itertools
import pathlib
import re
import unittest
from unittest import mock

import tensorflow as tf

import replicator_strategy as rs
from replicator_strategy import devices
from replicator_strategy import extended as extended_lib
from replicator_strategy import mesh as mesh_lib
from replicator_strategy import strategy as strategy_lib
import topology

README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()


def not_yet_items():
  """The items of README's "Not yet" list, each on one line."""
  section = README[README.index("\nNot yet"):]
  section = section[:section.index("\n\n", section.index("\n- "))]
  return [" ".join(item.split())
          for item in re.findall(r"^- (.*?)(?=^- |\Z)", section, re.M | re.S)]


# Options of the constructor, each as a user turns it on (4 logical CPUs).
OPTIONS = {
    "model parallelism": {"devices": [f"/cpu:{i}" for i in range(4)],
                          "devices_per_replica": 2},
    "`variable_partitioner`": {
        "variable_partitioner":
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)},
    "`gradient_compression`": {"gradient_compression": "bfloat16"},
    "`shard_optimizer_state`": {"shard_optimizer_state": True},
    "sync groups": {"sync_groups": 2},
    # One stage: micro-batches alone, on any number of devices a replica.
    "`pipeline`": {"pipeline": rs.Pipeline(stages=1, microbatches=2)},
}
# The pairs of options the constructor refuses, as README's items name them.
REFUSED_PAIRS = set()
# Where the constructor raises NotImplementedError: TPUs.
NOT_IMPLEMENTED_SITES = 1


def refuses_tpus(test):
  with mock.patch.object(devices, "tpu_present", return_value=True):
    with test.assertRaisesRegex(NotImplementedError, "TPU"):
      rs.ReplicatorStrategy()


def refuses_per_replica_input(test):
  strategy = topology.strategy_over(2)
  options = tf.distribute.InputOptions(
      experimental_replication_mode=tf.distribute.InputReplicationMode
      .PER_REPLICA)
  with test.assertRaisesRegex(NotImplementedError, "PER_REPLICA"):
    strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(4), options)


def refuses_sparse_input_to_sync_groups_across_workers(test):
  with mock.patch.object(extended_lib.ReplicatorExtended, "num_workers",
                         new_callable=mock.PropertyMock, return_value=2):
    strategy = topology.strategy_over(4, sync_groups=2)
    sparse = tf.data.Dataset.from_tensors(
        tf.sparse.from_dense(tf.eye(8)))
    with test.assertRaisesRegex(NotImplementedError,
                                "sync groups across workers.*dense"):
      strategy.experimental_distribute_dataset(sparse)


def refuses_persistent_tapes_through_collectives_in_a_cond(test):
  strategy = topology.strategy_over(2)

  def fn():
    ctx = tf.distribute.get_replica_context()
    x = tf.ones([2])
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      y = tf.cond(ctx.replica_id_in_sync_group >= 0,
                  lambda: ctx.all_reduce("sum", x), lambda: x)
    return tape.gradient(y, x)

  with test.assertRaisesRegex(NotImplementedError,
                              "non-persistent GradientTape"):
    tf.function(lambda: strategy.run(fn))()


# Words that identify a README item -> the check that it is refused.
CHECKS = {
    "TPU execution": refuses_tpus,
    "`experimental_distribute_dataset` of anything but batches of dense":
        refuses_sparse_input_to_sync_groups_across_workers,
    "`InputReplicationMode.PER_REPLICA`": refuses_per_replica_input,
    "persistent (or nested) `GradientTape`":
        refuses_persistent_tapes_through_collectives_in_a_cond,
}


class ReadmeNotYetTest(unittest.TestCase):

  def test_every_item_is_checked_and_every_check_is_an_item(self):
    items = not_yet_items()
    self.assertEqual(len(items), len(CHECKS) + len(REFUSED_PAIRS), items)
    names = [*CHECKS, *(f"{a} with {b}" for a, b in REFUSED_PAIRS)]
    for item in items:
      with self.subTest(item):
        self.assertTrue(any(_named(name, item) for name in names),
                        f"README's item {item!r} has no check here")
    for name in names:
      with self.subTest(name):
        self.assertTrue(any(_named(name, item) for item in items),
                        f"{name!r} is checked but not in README's list")

  def test_the_constructor_refuses_the_pairs_listed_and_takes_the_rest(self):
    for count in range(2, len(OPTIONS) + 1):
      for names in itertools.combinations(OPTIONS, count):
        kwargs = {k: v for name in names for k, v in OPTIONS[name].items()}
        refused = any(set(pair) <= set(names) for pair in REFUSED_PAIRS)
        with self.subTest(names):
          if refused:
            with self.assertRaises(NotImplementedError):
              rs.ReplicatorStrategy(**kwargs)
          else:
            rs.ReplicatorStrategy(**kwargs)

  def test_each_item_is_refused(self):
    for name, check in CHECKS.items():
      with self.subTest(name):
        check(self)

  def test_the_constructor_raises_no_other_not_implemented_error(self):
    # Its modules' NotImplementedErrors: those checked above, no other.
    source = inspect.getsource(strategy_lib) + inspect.getsource(mesh_lib)
    raised = [node for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Raise) and
              "NotImplementedError" in ast.unparse(node.exc)]
    self.assertEqual(len(raised), NOT_IMPLEMENTED_SITES)


def _named(name, item):
  """Whether README's `item` names `name` ("a with b": both, a first)."""
  if " with " in name and name.split(" with ")[0] in OPTIONS:
    first, second = name.split(" with ")
    return first in item and second in item[item.index(first):]
  return name in item


if __name__ == "__main__":
  unittest.main()
