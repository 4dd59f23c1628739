"""One input op per step: a global batch read once, split among the replicas.

TF's distributed iterator reads every replica's batch with its own op and
passes a structure of per-device iterators into every `tf.function` call;
with 4 replicas that costs about 0.7 ms a step, twice a tiny model's whole
step. When the replicas share the host's memory (CPU devices on one worker),
nothing is gained by prefetching each part to its device, so this dataset
reads each global batch with one op from one `tf.data` iterator of the
user's own dataset, and the step cuts it into the replicas' parts.

Step k of the replicas sees element k of the dataset, as one device does,
cut as evenly as it can be, in order: a batch of B rows on N replicas gives
the first `B % N` replicas one row more than the others (10 rows on 4: 3, 3,
2, 2; 5 on 4: 2, 1, 1, 1). TF's distributed dataset gives `ceil(B / N)` to
each in turn, so a short last batch leaves replicas without rows (5 on 4:
2, 2, 1, 0) where every one could have had some. Only a batch of fewer rows
than replicas leaves some empty; there, the Keras layers that cannot run on
no rows skip themselves (`replicator_strategy.keras.empty_replicas`).

With sync groups across workers (`worker_slice`) each worker reads every
global batch and keeps its own replicas' parts, contiguous in global replica
order: worker w of W, with M replicas, parts w*M ... w*M+M-1. So its groups
train on the rows the same groups get in one process (TF's multi-worker
input deals the parts round-robin: worker 0 would get parts 0 and 2 of 4).

>>> import tensorflow as tf
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> dataset = tf.data.Dataset.range(5).batch(4)
>>> batches = strategy.experimental_distribute_dataset(dataset)
>>> [[part.numpy().tolist() for part in strategy.experimental_local_results(b)]
...  for b in batches]
[[[0, 1], [2, 3]], [[4], []]]
"""

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi


def splits_on_host(dataset, devices, options):
  """Whether `GlobalBatchDataset` can serve `dataset` on `devices`.

  It can for batches of dense tensors, on CPU devices, with the default
  input options; anything else keeps TF's distributed dataset.
  """
  return (all(tf.DeviceSpec.from_string(d).device_type == "CPU"
              for d in devices) and
          can_serve(dataset, options))


def can_serve(dataset, options):
  """Whether `GlobalBatchDataset` can cut `dataset`'s elements, given input
  `options`: batches of dense tensors, with the default options."""
  return options is None and all(
      type(spec) is tf.TensorSpec and spec.shape.rank
      for spec in tf.nest.flatten(dataset.element_spec))


def _part_sizes(num_rows, num_replicas):
  """Rows per replica, as even as can be: the first `num_rows % num_replicas`
  get one more.

  A Python list for a static `num_rows`, else a tensor.

  >>> _part_sizes(5, 4)
  [2, 1, 1, 1]
  """
  base, extra = num_rows // num_replicas, num_rows % num_replicas
  if isinstance(num_rows, int):
    return [base + (i < extra) for i in range(num_replicas)]
  return base + tf.cast(
      tf.range(num_replicas, dtype=tf.int64) < extra, tf.int64)


def _local_spec(spec, num_local, parts):
  """The spec of this worker's `num_local` parts of a leaf of spec `spec`:
  parts `first, ... first + num_local - 1` of `total` (`parts`), as
  `_part_sizes` cuts it; a `PerReplicaSpec` of several."""
  first, total = parts
  if total == 1:
    return spec
  num_rows = spec.shape[0]
  sizes = (_part_sizes(num_rows, total)[first:first + num_local]
           if num_rows is not None else [None] * num_local)
  specs = [tf.TensorSpec([rows] + spec.shape[1:], spec.dtype)
           for rows in sizes]
  return tfi.values.PerReplicaSpec(*specs) if num_local > 1 else specs[0]


def split_rows(leaf, num_parts):
  """`leaf` (a tensor, `tf.RaggedTensor` or `tf.SparseTensor`) cut along its
  first axis into `num_parts` contiguous parts, in order, as every global
  batch is cut (`_part_sizes`).

  >>> [part.numpy().tolist() for part in split_rows(tf.range(7), 2)]
  [[0, 1, 2, 3], [4, 5, 6]]
  """
  num_rows = leaf.shape[0]
  if num_rows is None:
    num_rows = tf.shape(leaf, out_type=tf.int64)[0]
  sizes = _part_sizes(num_rows, num_parts)
  if not isinstance(leaf, tf.SparseTensor):
    return tf.split(leaf, sizes, num=num_parts)
  sizes = tf.cast(sizes, tf.int64)
  starts = tf.cumsum(sizes, exclusive=True)
  rest = leaf.dense_shape[1:]
  return [tf.sparse.slice(
      leaf, tf.concat([starts[i:i + 1], tf.zeros_like(rest)], 0),
      tf.concat([sizes[i:i + 1], rest], 0)) for i in range(num_parts)]


class GlobalBatchDataset(tf.distribute.DistributedDataset):
  """`dataset`'s global batches, each split among `devices` (see module doc).

  `worker_slice`: None, or (the global id of this worker's first replica,
  the replicas of every worker) with sync groups across workers: a batch is
  cut among them all and `devices` get their replicas' parts.

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
  >>> second_worker = GlobalBatchDataset(  # replicas 2 and 3 of 4
  ...     tf.data.Dataset.range(10).batch(10), strategy.extended.worker_devices,
  ...     strategy.extended.host_device, worker_slice=(2, 4))
  >>> [[part.numpy().tolist() for part in strategy.experimental_local_results(b)]
  ...  for b in second_worker]
  [[[6, 7], [8, 9]]]
  """

  def __init__(self, dataset, devices, host_device, worker_slice=None):
    self._dataset = dataset
    self._devices = tuple(devices)
    self._host_device = host_device
    self._parts = worker_slice or (0, len(self._devices))
    leaves = [_local_spec(spec, len(self._devices), self._parts)
              for spec in tf.nest.flatten(dataset.element_spec)]
    self._element_spec = tf.nest.pack_sequence_as(dataset.element_spec,
                                                  leaves)

  @property
  def element_spec(self):
    return self._element_spec

  @property
  def cardinality(self):
    """The number of batches (or `tf.data.INFINITE_CARDINALITY`, or
    `tf.data.UNKNOWN_CARDINALITY`), a number as on TF's distributed dataset."""
    return int(self._dataset.cardinality())

  def __iter__(self):
    with tf.device(self._host_device):
      batches = iter(self._dataset)
    return GlobalBatchIterator(batches, self._devices, self._parts,
                               self._element_spec)

  def reduce(self, initial_state, reduce_fn):
    """`reduce_fn(state, batch)` over every batch, as `for` in a tf.function does."""
    iterator = iter(self)
    def has_batch(optional, state):
      del state
      return optional.has_value()
    def step(optional, state):
      return (iterator.get_next_as_optional(),
              reduce_fn(state, optional.get_value()))
    _, state = tf.while_loop(
        has_batch, step, [iterator.get_next_as_optional(), initial_state],
        parallel_iterations=1)
    return state


class GlobalBatchIterator(tf.distribute.DistributedIterator,
                          tf.__internal__.CompositeTensor,
                          tfi.CheckpointedThrough):
  """Iterates a `GlobalBatchDataset`: one `tf.data` iterator read per step.

  A `tf.train.Checkpoint` saves its position (its `tf.data` iterator's), so
  a run restored mid-epoch goes on with the next batch, on any number of
  replicas (TF's distributed iterator cannot be saved):

  >>> import tempfile
  >>> import tensorflow as tf
  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
  >>> batches = strategy.experimental_distribute_dataset(
  ...     tf.data.Dataset.range(8).batch(2))
  >>> iterator = iter(batches)
  >>> _ = next(iterator)
  >>> path = tf.train.Checkpoint(input=iterator).save(tempfile.mkdtemp() + "/c")
  >>> _ = next(iterator)
  >>> _ = tf.train.Checkpoint(input=iterator).restore(path)
  >>> [x.numpy().tolist() for x in
  ...  strategy.experimental_local_results(next(iterator))]
  [[2], [3]]
  """

  def __init__(self, batches, devices, parts, element_spec):
    """`parts`: (the first of `devices`' parts, the parts of a batch)."""
    self._batches = batches
    self._devices = devices
    self._parts = parts
    self._element_spec = element_spec

  @property
  def element_spec(self):
    return self._element_spec

  def children(self):
    return {"iterator": self._batches}

  @property
  def _type_spec(self):
    return GlobalBatchIteratorSpec(tf.type_spec_from_value(self._batches),
                                   self._devices, self._parts,
                                   self._element_spec)

  def _on_devices(self, batch):
    """A global batch cut into the replicas' parts, this worker's each on
    its device."""
    first, total = self._parts
    if total == 1:
      return batch
    leaves = []
    for leaf in tf.nest.flatten(batch):
      on_devices = []
      for device, part in zip(self._devices, split_rows(leaf, total)[first:]):
        with tf.device(device):
          on_devices.append(tf.identity(part))
      leaves.append(tfi.values.PerReplica(tuple(on_devices))
                    if len(on_devices) > 1 else on_devices[0])
    return tf.nest.pack_sequence_as(batch, leaves)

  def get_next(self):
    return self._on_devices(self._batches.get_next())

  def get_next_as_optional(self):
    batch = self._batches.get_next_as_optional()
    return tf.cond(
        batch.has_value(),
        lambda: tf.experimental.Optional.from_value(
            self._on_devices(batch.get_value())),
        lambda: tf.experimental.Optional.empty(self._element_spec))

  def __iter__(self):
    return self

  def __next__(self):
    try:
      return self.get_next()
    except tf.errors.OutOfRangeError as end:
      raise StopIteration from end


class GlobalBatchIteratorSpec(tf.TypeSpec):
  """The `tf.TypeSpec` of a `GlobalBatchIterator`: what a tf.function traces.

  Its one component is the `tf.data` iterator, so passing the iterator into
  a `tf.function` flattens one resource, not one per replica.
  """

  __slots__ = ["_batches_spec", "_devices", "_parts", "_element_spec"]

  def __init__(self, batches_spec, devices, parts, element_spec):
    self._batches_spec = batches_spec
    self._devices = devices
    self._parts = parts
    self._element_spec = element_spec

  @property
  def value_type(self):
    return GlobalBatchIterator

  def _serialize(self):
    return (self._batches_spec, self._devices, self._parts,
            self._element_spec)

  @property
  def _component_specs(self):
    return self._batches_spec

  def _to_components(self, value):
    return value._batches  # pylint: disable=protected-access

  def _from_components(self, components):
    return GlobalBatchIterator(components, self._devices, self._parts,
                               self._element_spec)
