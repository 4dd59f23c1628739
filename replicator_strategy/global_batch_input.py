"""One input op per step: a global batch read once, split among the replicas.

TF's distributed iterator reads every replica's batch with its own op and
passes a structure of per-device iterators into every `tf.function` call;
with 4 replicas that costs about 0.7 ms a step, twice a tiny model's whole
step. When the replicas share the host's memory (CPU devices on one worker),
nothing is gained by prefetching each part to its device, so this dataset
instead splits each global batch in `tf.data`'s background threads and the
step reads all the parts with one op, from one iterator.

Step k of the replicas sees element k of the dataset, as one device does,
and splits it as TF's distributed dataset does: a batch of B rows gives
`ceil(B / N)` rows to each of N replicas in order, so the last ones may get
fewer or none (10 rows on 4 replicas: 3, 3, 3, 1).

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
  return (options is None and
          all(tf.DeviceSpec.from_string(d).device_type == "CPU"
              for d in devices) and
          all(type(spec) is tf.TensorSpec and spec.shape.rank
              for spec in tf.nest.flatten(dataset.element_spec)))


def _part_sizes(num_rows, num_replicas):
  """Rows per replica: `ceil(num_rows / num_replicas)` each, in order.

  A Python list where every part has the same static size, else a tensor.
  """
  if isinstance(num_rows, int) and num_rows % num_replicas == 0:
    return [num_rows // num_replicas] * num_replicas
  chunk = (num_rows + num_replicas - 1) // num_replicas
  starts = tf.range(num_replicas, dtype=tf.int64) * chunk
  return tf.clip_by_value(num_rows - starts, 0, chunk)


def _split_leaves(num_replicas):
  """A `tf.data` map function: an element -> per leaf, its replicas' parts."""
  def split(*element):
    parts = []
    for leaf in tf.nest.flatten(element):
      num_rows = leaf.shape[0]
      if num_rows is None:
        num_rows = tf.shape(leaf, out_type=tf.int64)[0]
      parts.append(tuple(tf.split(leaf, _part_sizes(num_rows, num_replicas),
                                  num=num_replicas)))
    return tuple(parts)
  return split


class GlobalBatchDataset(tf.distribute.DistributedDataset):
  """`dataset`'s global batches, each split among `devices` (see module doc)."""

  def __init__(self, dataset, devices, host_device):
    self._structure = dataset.element_spec
    self._devices = tuple(devices)
    self._host_device = host_device
    with tf.device(host_device):
      self._parts = dataset.map(
          _split_leaves(len(self._devices))).prefetch(tf.data.AUTOTUNE)
    self._element_spec = _per_replica(self._structure,
                                      self._parts.element_spec,
                                      len(self._devices))

  @property
  def element_spec(self):
    return self._element_spec

  @property
  def cardinality(self):
    """The number of batches (or `tf.data.INFINITE_CARDINALITY`, or
    `tf.data.UNKNOWN_CARDINALITY`), a number as on TF's distributed dataset."""
    return int(self._parts.cardinality())

  def __iter__(self):
    with tf.device(self._host_device):
      parts = iter(self._parts)
    return GlobalBatchIterator(parts, self._structure, self._devices,
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
                          tf.__internal__.CompositeTensor):
  """Iterates a `GlobalBatchDataset`: one `tf.data` iterator read per step."""

  def __init__(self, parts, structure, devices, element_spec):
    self._parts = parts
    self._structure = structure
    self._devices = devices
    self._element_spec = element_spec

  @property
  def element_spec(self):
    return self._element_spec

  @property
  def _type_spec(self):
    return GlobalBatchIteratorSpec(tf.type_spec_from_value(self._parts),
                                   self._structure, self._devices,
                                   self._element_spec)

  def _on_devices(self, parts):
    if len(self._devices) == 1:
      return tf.nest.pack_sequence_as(self._structure,
                                      [leaf[0] for leaf in parts])
    leaves = []
    for leaf in parts:
      on_devices = []
      for device, part in zip(self._devices, leaf):
        with tf.device(device):
          on_devices.append(tf.identity(part))
      leaves.append(tfi.values.PerReplica(tuple(on_devices)))
    return tf.nest.pack_sequence_as(self._structure, leaves)

  def get_next(self):
    return self._on_devices(self._parts.get_next())

  def get_next_as_optional(self):
    parts = self._parts.get_next_as_optional()
    return tf.cond(
        parts.has_value(),
        lambda: tf.experimental.Optional.from_value(
            self._on_devices(parts.get_value())),
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

  __slots__ = ["_parts_spec", "_structure", "_devices", "_element_spec"]

  def __init__(self, parts_spec, structure, devices, element_spec):
    self._parts_spec = parts_spec
    self._structure = structure
    self._devices = devices
    self._element_spec = element_spec

  @property
  def value_type(self):
    return GlobalBatchIterator

  def _serialize(self):
    return (self._parts_spec, self._structure, self._devices,
            self._element_spec)

  @property
  def _component_specs(self):
    return self._parts_spec

  def _to_components(self, value):
    return value._parts  # pylint: disable=protected-access

  def _from_components(self, components):
    return GlobalBatchIterator(components, self._structure, self._devices,
                               self._element_spec)


def _per_replica(structure, parts_spec, num_replicas):
  """The element spec a replica-split batch has: PerReplicaSpec leaves."""
  if num_replicas == 1:
    leaves = [parts[0] for parts in parts_spec]
  else:
    leaves = [tfi.values.PerReplicaSpec(*parts) for parts in parts_spec]
  return tf.nest.pack_sequence_as(structure, leaves)
