"""Whether a Keras wrapper acts: in a replica of a ReplicatorStrategy of several.

What the wrappers that put Keras right under this strategy share
(`replica_loss`, `batches`, `gradient_exchange`, `compiled_steps`,
`global_results`). Each wrapper is an entry of
`replicator_strategy.keras.PATCHES`, applied on the first use of
`replicator_strategy`, on `keras.Model`, `keras.optimizers.Optimizer` and
Keras's loss-scaling functions; every wrapper calls Keras's own code
unchanged for any other strategy.
"""

import tensorflow as tf

from replicator_strategy import replica_context


def in_our_replicas():
  """Whether this runs in a replica of a ReplicatorStrategy of several."""
  ctx = tf.distribute.get_replica_context()
  return (isinstance(ctx, replica_context.ReplicaContext) and
          ctx.strategy.extended.num_replicas_in_all_groups > 1)
