"""replicator-strategy: TF-Replicator as a `tf.distribute.Strategy`.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy()
>>> with strategy.scope():
...   model = build_model()  # any single-device Keras model
"""

from replicator_strategy import keras
from replicator_strategy.devices import local_devices
from replicator_strategy.devices import split_cpu
from replicator_strategy.extended import ReplicatorExtended
from replicator_strategy.preemption_checkpoint import PreemptionCheckpoint
from replicator_strategy.reduce_op import ReduceOp
from replicator_strategy.replica_context import ReplicaContext
from replicator_strategy.strategy import ReplicatorStrategy

__all__ = [
    "PreemptionCheckpoint",
    "ReduceOp",
    "ReplicaContext",
    "ReplicatorExtended",
    "ReplicatorStrategy",
    "local_devices",
    "split_cpu",
]
__version__ = "0.1.0"

keras.install()
