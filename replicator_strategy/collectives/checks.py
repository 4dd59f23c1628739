"""The replica context's checks: a mistake fails naming what was received.

A `None` in a value, an axis out of range, sizes that do not split over the
replicas, shapes a gather can't concatenate, a collective called inside a
merge function, replicas asking for different merges at the same point:
TF's own errors come later or never, and name neither the value nor the
replica.

>>> reject_none({"a": [1.0, None]}, "value", "ReplicaContext.all_reduce")
Traceback (most recent call last):
...
ValueError: Expected every element of `value` given to
ReplicaContext.all_reduce to be a tensor or a number. Received:
value['a'][1]=None. ...
"""

import enum
import inspect

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi


def refuse_cross_replica_context(api):
  """A RuntimeError if `ReplicaContext.{api}` is called in cross-replica context.

  A merge function (merge_call's merge_fn) runs once for all replicas, in
  cross-replica context; a replica context captured there would fail inside
  TF with "Need to be inside `call_for_each_replica()`" or a PerReplica error.
  """
  if tf.distribute.in_cross_replica_context():
    raise RuntimeError(
        f"ReplicaContext.{api} was called in cross-replica context, most "
        f"likely inside a merge function (the merge_fn given to "
        f"merge_call), which runs once for all replicas. Its arguments "
        f"already hold every replica's value: combine them with the "
        f"strategy that merge_fn receives (strategy.reduce, "
        f"strategy.extended.reduce_to, strategy.gather), or call {api} "
        f"in the replica function, before or after merge_call.")


def reject_none(value, argument, api):
  """Names the path of the first None in the structure `value`.

  TF's own error, "None values not supported.", does not say where it is.
  """
  for path, leaf in tfi.nest.flatten_with_tuple_paths(value):
    if leaf is None:
      where = argument + "".join(f"[{key!r}]" for key in path)
      raise ValueError(
          f"Expected every element of `{argument}` given to {api} to be a "
          f"tensor or a number. Received: {where}=None. Leave it out of "
          f"`{argument}`, or put a tensor in its place.")


def own_tensors(value, api):
  """`value` as tensors of this replica's own (a None in it refused).

  A tensor made outside `strategy.run` reaches every replica as one object,
  which merge_call would take for a single value instead of one per replica
  (a broadcast from another replica would come back as zeros, a gather with
  one part). A copy per replica keeps each replica's part its own.
  """
  reject_none(value, "value", f"ReplicaContext.{api}")
  return tf.nest.map_structure(tf.identity, value)

def refuse_indexed_slices(value, api):
  """A NotImplementedError naming the first `tf.IndexedSlices` in `value`,
  as TF's strategies raise for all_gather (densified silently, it would
  hand back every replica's dense shape, mostly zeros)."""
  for path, leaf in tfi.nest.flatten_with_tuple_paths(value):
    if isinstance(leaf, tf.IndexedSlices):
      where = "value" + "".join(f"[{key!r}]" for key in path)
      raise NotImplementedError(
          f"ReplicaContext.{api}: {api} does not support IndexedSlices, as "
          f"in TensorFlow's own strategies. Received: {where}, an "
          f"IndexedSlices. Gather "
          f"tf.convert_to_tensor({where}) for the dense tensor, or its "
          f".values and .indices (each replica's indices point into its "
          f"own dense tensor).")


def normalized_axis(tensor, axis, api, argument):
  """`axis` of `tensor` as a non-negative int; a ValueError if it has none."""
  rank = tensor.shape.rank
  if not isinstance(axis, int) or rank is None or not -rank <= axis < rank:
    raise ValueError(
        f"Expected `{argument}` given to ReplicaContext.{api} to be an int "
        f"in [-{rank}, {rank}) for a value of shape {tensor.shape}. "
        f"Received: {argument}={axis!r}")
  return axis % rank


def split_evenly(value, axis, num_replicas, api, argument):
  """(`value`'s leaves, each leaf's axis) for a collective that cuts every
  leaf into `num_replicas` equal slices along `axis`.

  A size known when traced is checked then; an unknown one when the leaf is
  computed.
  """
  n = num_replicas
  flat, axes = [], []
  for path, x in tfi.nest.flatten_with_tuple_paths(value):
    a = normalized_axis(x, axis, api, argument)
    size = x.shape[a]
    where = "value" + "".join(f"[{key!r}]" for key in path)
    message = (
        f"ReplicaContext.{api} cuts each tensor of `value` into {n} equal "
        f"slices along {argument}={axis}, one per replica, so its size "
        f"there must be a multiple of {n}. Received: {where} of shape "
        f"{x.shape}, size {{}} along axis {a}. Pad it along that axis to "
        f"a multiple of {n} (tf.pad) and drop the padding afterwards.")
    if size is not None and size % n:
      raise ValueError(message.format(size))
    if size is None:
      check = tf.debugging.assert_equal(
          tf.shape(x)[a] % n, 0, message=message.format("not a multiple"))
      with tf.control_dependencies([check]):
        x = tf.identity(x)
    flat.append(x)
    axes.append(a)
  return flat, axes


def check_gatherable(strategy, per_replica_values, paths, axis):
  """Refuses values whose dimensions other than `axis` differ between replicas.

  TF's concat would say "Dimension 0 in both shapes must be equal", counting
  dimensions without `axis` and naming neither the value nor the replicas.
  """
  if isinstance(axis, bool) or not isinstance(axis, int):
    return
  first = strategy.extended.first_replica_id
  for path, value in zip(paths, per_replica_values):
    shapes = [part.shape for part in strategy.experimental_local_results(value)]
    ranks = {shape.rank for shape in shapes} - {None}
    differs = None
    if len(ranks) > 1:
      differs = "their ranks differ"
    elif ranks:
      rank = ranks.pop()
      if -rank <= axis < rank:
        for d in range(rank):
          sizes = {shape[d] for shape in shapes} - {None}
          if d != axis % rank and len(sizes) > 1:
            differs = f"dimension {d} differs"
            break
    if differs:
      where = "value" + "".join(f"[{key!r}]" for key in path)
      received = ", ".join(f"replica {first + i}: {shape}"
                           for i, shape in enumerate(shapes))
      raise ValueError(
          f"ReplicaContext.all_gather concatenates every replica's {where} "
          f"along axis={axis}, so its other dimensions must be the same on "
          f"every replica, but {differs}. Received shapes: {received}. Pad "
          f"or slice each replica's {where} to the same size there, or "
          f"gather along the dimension that differs.")


def same_merge(fn):
  """(What a merge_call of `fn` asks for, `fn` checking every replica asked it).

  TF runs the first replica's merge function and drops the others': a
  replica that asked for a different one (a max where the others sum) would
  silently get their result. So each replica's call passes what it asks for
  first; the checked function takes every replica's and refuses a mismatch.
  """

  def checked(strategy, signatures, *args, **kwargs):
    _check_same_merge(signatures)
    return fn(strategy, *args, **kwargs)

  return _merge_signature(fn), checked


def _merge_signature(fn):
  """What a merge_call asks for, comparable between replicas."""
  fn = inspect.unwrap(getattr(fn, "func", fn))  # Partials, autograph.
  fn = getattr(fn, "__func__", fn)  # A bound method.
  modes = []
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      if isinstance(cell.cell_contents, enum.Enum):
        modes.append(str(cell.cell_contents))
    except ValueError:
      pass  # An empty cell.
  name = ".".join(part for part in getattr(fn, "__qualname__", "").split(".")
                  if part not in ("<locals>", "<lambda>")) or repr(fn)
  return f"{name} ({', '.join(modes)})" if modes else name


def _check_same_merge(signatures):
  if not isinstance(signatures, tf.distribute.DistributedValues):
    return  # The same object from every replica, or one replica.
  parts = signatures.values
  if len(set(parts)) > 1:
    raise ValueError(
        "Replicas called different cross-replica operations at the same "
        "point: " + "; ".join(f"replica {i}: {p}" for i, p in enumerate(parts))
        + ". Every replica must call the same all_reduce / merge_call (same "
        "op) in the same order.")


def thunk_calls(thunks, fn):
  """Argument-free calls of `map_gather`'s thunks (or of `fn` on its inputs)."""
  if not isinstance(thunks, (list, tuple)) or not thunks:
    raise ValueError(
        "Expected `thunks` given to ReplicaContext.map_gather to be a "
        f"non-empty list or tuple. Received: thunks={thunks!r}")
  if fn is not None:
    if not callable(fn):
      raise TypeError(
          "Expected `fn` given to ReplicaContext.map_gather to be callable "
          f"or None. Received: fn={fn!r}")
    return [lambda x=x: fn(x) for x in thunks]
  for i, thunk in enumerate(thunks):
    if not callable(thunk):
      raise TypeError(
          "Expected every element of `thunks` given to "
          "ReplicaContext.map_gather to be callable (or give `fn` to apply "
          f"to them). Received: thunks[{i}]={thunk!r}")
  return list(thunks)


def thunk_result(result, what):
  """`result`, what the call `what` ("thunks[3]()") of `map_gather` returned,
  as tensors, each of a static shape and a dtype that sums over replicas; a
  ValueError naming the part that is not."""
  reject_none(result, what, "ReplicaContext.map_gather")
  result = tf.nest.map_structure(tf.convert_to_tensor, result)
  for path, t in tfi.nest.flatten_with_tuple_paths(result):
    where = what + "".join(f"[{key!r}]" for key in path)
    if not t.shape.is_fully_defined():
      raise ValueError(
          f"Expected every tensor that ReplicaContext.map_gather's {where} "
          f"returns to have a static shape: the replicas that don't run it "
          f"need one. Received: shape {t.shape}. Set it in the thunk, e.g. "
          f"with tf.ensure_shape.")
    if not (t.dtype.is_floating or t.dtype.is_integer):
      raise ValueError(
          f"Expected every tensor that ReplicaContext.map_gather's {where} "
          f"returns to be of a float or integer dtype: results travel in a "
          f"sum over replicas. Received: dtype {t.dtype.name}. Cast it in "
          f"the thunk (tf.cast) and back after.")
  return result
