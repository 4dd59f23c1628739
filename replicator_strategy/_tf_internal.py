"""The one place that imports TensorFlow's private `tensorflow.python.*` modules.

ReplicatorStrategy reuses TF's distributed-variable classes, input pipeline,
cross-device ops and replica threads. Those live in private modules whose
layout may change between TF releases, so every such import is made here and
checked against the TF versions this file was written for. Upgrading TF means
re-checking this one file.
"""

import os

import tensorflow as tf

TESTED_TF_VERSIONS = ("2.21",)
_ALLOW_UNTESTED_ENV = "REPLICATOR_STRATEGY_ALLOW_UNTESTED_TF"


def _check_tf_version():
  major_minor = ".".join(tf.__version__.split(".")[:2])
  if major_minor in TESTED_TF_VERSIONS or os.environ.get(_ALLOW_UNTESTED_ENV):
    return
  raise ImportError(
      f"replicator_strategy relies on private TensorFlow modules and was "
      f"tested with TensorFlow {', '.join(TESTED_TF_VERSIONS)}.x. Received: "
      f"tensorflow=={tf.__version__}. Install a tested version "
      f"(pip install 'tensorflow-cpu==2.21.*') or set {_ALLOW_UNTESTED_ENV}=1 "
      f"to try this one anyway.")


_check_tf_version()

# pylint: disable=g-import-not-at-top,unused-import
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import values
from tensorflow.python.eager import context
from tensorflow.python.eager import def_function
from tensorflow.python.eager import record
from tensorflow.python.framework import kernels
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import control_flow_v2_func_graphs
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import nest
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
# pylint: enable=g-import-not-at-top,unused-import

StrategyExtendedV1 = distribute_lib.StrategyExtendedV1
UpdateContext = distribute_lib.UpdateContext
ThreadReplicaContext = mirrored_run._MirroredReplicaContext  # pylint: disable=protected-access
WHILE_LOOP_GRAPHS = (control_flow_v2_func_graphs.WhileBodyFuncGraph,
                     control_flow_v2_func_graphs.WhileCondFuncGraph)


def one_replica_spec(spec):
  """One replica's part of a distributed iterator's element spec."""
  if isinstance(spec, values.PerReplicaSpec):
    return spec._value_specs[0]  # pylint: disable=protected-access
  return spec
