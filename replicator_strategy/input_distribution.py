"""How `ReplicatorExtended` distributes input among the replicas.

The methods TF calls on `strategy.extended` for input
(`experimental_distribute_dataset`, `distribute_datasets_from_function`,
`experimental_distribute_values_from_function`) hand over to the functions
here, which take the `ReplicatorExtended`. A dataset goes to TF's input
pipeline, split among every replica of every sync group (per worker across
workers), or to a `global_batch_input.GlobalBatchDataset` where that serves
better: CPU replicas of one worker, and sync groups across workers (each
worker's contiguous parts of every global batch). What TF would fail on late
or not at all is refused first, saying how to fix it.

>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> dataset = tf.data.Dataset.range(4)
>>> strategy.experimental_distribute_dataset(dataset)
Traceback (most recent call last):
...
ValueError: experimental_distribute_dataset splits each element of the
dataset along its first dimension, the batch, among 2 replicas, ...
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy import global_batch_input


def input_workers(extended, options=None):
  """TF's `InputWorkers`: this worker's host feeding its replicas' devices
  (or the host itself, when `options` say not to fetch to the devices)."""
  compute = extended.worker_devices
  if options is not None and not options.experimental_fetch_to_device:
    compute = (extended.host_device,) * len(extended.worker_devices)
  return tfi.input_lib.InputWorkers([(extended.host_device, compute)])


def distribute_dataset(extended, dataset, options):
  """`strategy.experimental_distribute_dataset(dataset, options)`."""
  _reject_per_replica_mode(options, "experimental_distribute_dataset")
  devices = extended.worker_devices
  if extended.num_replicas_in_all_groups > 1:
    _reject_unbatched(dataset, extended.num_replicas_in_all_groups)
  if extended.deals_worker_slices:
    _reject_unsliceable(dataset, options)
    return global_batch_input.GlobalBatchDataset(
        dataset, devices, extended.host_device,
        worker_slice=(extended.first_replica_id,
                      extended.num_replicas_in_all_groups))
  extended.communicator.check_dataset(dataset)
  if extended.num_workers == 1 and global_batch_input.splits_on_host(
      dataset, devices, options):
    return global_batch_input.GlobalBatchDataset(dataset, devices,
                                                 extended.host_device)
  return tfi.input_util.get_distributed_dataset(
      dataset, input_workers(extended, options),
      tfi.container_strategy(extended),
      num_replicas_in_sync=extended.num_replicas_in_all_groups,
      input_context=extended.communicator.dataset_input_context(),
      options=options)


def distribute_datasets_from_function(extended, dataset_fn, options):
  """`strategy.distribute_datasets_from_function(dataset_fn, options)`."""
  _reject_per_replica_mode(options, "distribute_datasets_from_function")
  return tfi.input_util.get_distributed_datasets_from_function(
      dataset_fn, input_workers(extended, options),
      [extended.communicator.input_context()],
      tfi.container_strategy(extended), options)


def distribute_values_from_function(extended, value_fn):
  """`strategy.experimental_distribute_values_from_function(value_fn)`:
  `value_fn` called on each local replica's device with its global id."""
  per_replica = []
  for i, device in enumerate(extended.worker_devices):
    with tf.device(device):
      per_replica.append(value_fn(tf.distribute.experimental.ValueContext(
          extended.first_replica_id + i, extended.num_replicas_in_all_groups)))
  return tfi.distribute_utils.regroup(per_replica, always_wrap=True)


def numpy_dataset(extended, numpy_input, session):
  """A NumPy input as a dataset on this worker's host."""
  return tfi.numpy_dataset.one_host_numpy_dataset(
      numpy_input, tfi.numpy_dataset.SingleDevice(extended.host_device),
      session)


def _reject_unbatched(dataset, num_replicas):
  """Refuses scalar elements, which TF's rebatching fails on with an IndexError."""
  scalars = [
      "element" + "".join(f"[{key!r}]" for key in path)
      for path, spec in tfi.nest.flatten_with_tuple_paths(dataset.element_spec)
      if getattr(spec, "shape", None) is not None and spec.shape.rank == 0]
  if scalars:
    raise ValueError(
        f"experimental_distribute_dataset splits each element of the dataset "
        f"along its first dimension, the batch, among {num_replicas} "
        f"replicas, but this dataset has scalars with no such dimension "
        f"({', '.join(scalars)}): it looks unbatched. Received: element_spec="
        f"{dataset.element_spec}. Batch it with the global batch size "
        f"first: dataset.batch(global_batch_size).")


def _reject_unsliceable(dataset, options):
  """Refuses, with sync groups across workers, what a worker cannot cut its
  replicas' parts from."""
  if not global_batch_input.can_serve(dataset, options):
    raise NotImplementedError(
        f"With sync groups across workers, experimental_distribute_dataset "
        f"gives each worker its replicas' contiguous parts of every global "
        f"batch (so a group trains on the rows it would in one process), "
        f"which it does for batches of dense tensors with the default input "
        f"options only yet. Received: element_spec={dataset.element_spec}, "
        f"options={options}. Batch dense tensors and pass no options, or "
        f"give each worker its rows with distribute_datasets_from_function.")


def _reject_per_replica_mode(options, api):
  if (options is not None and options.experimental_replication_mode ==
      tf.distribute.InputReplicationMode.PER_REPLICA):
    raise NotImplementedError(
        f"ReplicatorStrategy.{api} does not support "
        f"InputReplicationMode.PER_REPLICA yet. Use the default PER_WORKER "
        f"mode (leave experimental_replication_mode unset).")
