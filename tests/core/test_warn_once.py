"""Once-only warnings: said the first time, and afresh in each test.

The memos of what was warned live in one helper (`warn_once`), which
tests/conftest.py empties before each test: a test that expects a warning
gets it whichever tests warned of the same thing before it.
"""

import threading
import unittest

import keras
from keras.src.distribution import distribution_lib

import replicator_strategy as rs
from replicator_strategy import warn_once


class Unserved(distribution_lib.Distribution):
  """A kind of Distribution nothing serves (its base class is not public)."""


class WarnOnceTest(unittest.TestCase):

  def test_each_key_once_until_forgotten(self):
    said = warn_once.Once()
    self.assertEqual([said("a"), said("a"), said(("b", 1)), said("a")],
                     [True, False, True, False])
    warn_once.forget_all()
    self.assertEqual([said("a"), said(("b", 1))], [True, True])

  def test_replicas_racing_warn_once(self):
    said, answers = warn_once.Once(), []
    threads = [threading.Thread(target=lambda: answers.append(said("key")))
               for _ in range(8)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    self.assertEqual(sorted(answers), [False] * 7 + [True])

  def test_a_warning_given_before_is_given_again_in_the_next_test(self):
    # The same class twice, as two tests in either order would see it: the
    # memo forgotten between them (as tests/conftest.py does), each warns.
    strategy = rs.ReplicatorStrategy()  # The patches, while it lives.
    mesh = keras.distribution.DeviceMesh((4,), ("batch",),
                                         keras.distribution.list_devices())
    for _ in range(2):
      with self.assertWarnsRegex(UserWarning, "nothing is distributed"):
        with Unserved(mesh).scope():
          pass
      warn_once.forget_all()
    del strategy


if __name__ == "__main__":
  unittest.main()
