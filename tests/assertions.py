"""Shared assertions: per-replica values, and an exported model's answers.

`assert_per_replica` checks each replica's part of a value, named.

For example, `assert_per_replica(self, strategy, strategy.run(fn), [3.0] * n)`
(every replica holds 3), or `assert_per_replica(self, strategy, values,
lambda replica: 2.0 * replica)` (replica r holds 2r).
"""

import os
import tempfile

import numpy as np
import tensorflow as tf


def assert_per_replica(test, strategy, value, expected, rtol=0.0, atol=0.0,
                       what="value"):
  """Asserts what each of `strategy`'s replicas holds of `value`.

  `value` is a per-replica value, a distributed variable, or a nest of them
  (as `strategy.run` returns); a plain tensor is every replica's. `expected`
  is a list with one entry per replica, or a function of the replica id
  (its index among the replicas of this one process) returning the entry.
  Each entry has the structure of `value` (so an array leaf is a NumPy
  array, not a list); its leaves are compared by shape and by value,
  exactly unless `rtol` or `atol` say otherwise.
  """
  local = strategy.experimental_local_results(value)
  # With sync groups, every replica of every group (num_replicas_in_sync
  # counts one group's).
  replicas = getattr(strategy.extended, "num_replicas_in_all_groups",
                     strategy.num_replicas_in_sync)
  test.assertEqual(len(local), replicas, f"{what}: one part per replica")
  if callable(expected):
    expected = [expected(replica) for replica in range(len(local))]
  test.assertEqual(len(expected), len(local),
                   f"{what}: `expected` needs one entry per replica")
  for replica, (got, want) in enumerate(zip(local, expected)):
    tf.nest.assert_same_structure(got, want, check_types=False)
    for path, g, w in zip(_paths(want), tf.nest.flatten(got),
                          tf.nest.flatten(want)):
      where = f"{what}{path} on replica {replica}"
      g = np.asarray(g)
      test.assertEqual(g.shape, np.shape(w), f"{where}: shape")
      np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)


def _paths(nest, prefix=""):
  """The index path of each leaf of `nest`, in `tf.nest.flatten` order."""
  if isinstance(nest, dict):
    return [p for key in sorted(nest)
            for p in _paths(nest[key], f"{prefix}[{key!r}]")]
  if isinstance(nest, (list, tuple)):
    return [p for i, item in enumerate(nest)
            for p in _paths(item, f"{prefix}[{i}]")]
  return [prefix]


def assert_exported_serves_as_the_model(test, model, x):
  """`model.export`'s SavedModel, loaded alone, answers `x` as `model` does."""
  with tempfile.TemporaryDirectory() as directory:
    model.export(os.path.join(directory, "exported"), verbose=False)
    loaded = tf.saved_model.load(os.path.join(directory, "exported"))
    np.testing.assert_allclose(loaded.serve(x), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
