"""The adapter refuses TensorFlow versions its private imports were not checked on."""

import os
import unittest
from unittest import mock

import tensorflow as tf

from replicator_strategy import _tf_internal


class VersionCheckTest(unittest.TestCase):

  def test_untested_version_is_refused_with_the_way_out(self):
    with mock.patch.object(tf, "__version__", "2.99.0"), \
         mock.patch.dict(os.environ, {}, clear=False):
      os.environ.pop("REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF", None)
      with self.assertRaisesRegex(
          ImportError, r"tested with TensorFlow 2\.21\.x.*tensorflow==2\.99\.0"
          r".*REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF=1"):
        _tf_internal._check_tf_version()

  def test_override_and_tested_versions_pass(self):
    with mock.patch.object(tf, "__version__", "2.99.0"), mock.patch.dict(
        os.environ, {"REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF": "1"}):
      _tf_internal._check_tf_version()
    with mock.patch.object(tf, "__version__", "2.21.3"):
      _tf_internal._check_tf_version()


if __name__ == "__main__":
  unittest.main()
