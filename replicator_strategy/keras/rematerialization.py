"""`keras.remat` and `keras.RematScope` on TF: in graph mode, with XLA, on the forward's devices.

Keras's TF backend rematerializes with `tf.recompute_grad`, which inside a
`tf.function` refuses a layer's keyword arguments (`training=...`,
keras#21207): TF's graph-mode `custom_gradient` takes positional tensors
only. Called with those alone it runs, but its recompute would still draw
new random values (each draw advances a `SeedGenerator`), apply the call's
state updates twice (a BatchNormalization's moving statistics), and its one
`IdentityN` op would take every input, output and weight the call reads to
one device (a Megatron layer's parts, gathered). `Recomputed`, which Keras's
`remat` returns here, instead:

- takes the call's tensors, wherever they are in its arguments, as its
  inputs and keeps the rest as they are; an input or output that a Megatron
  layer left in parts (`megatron.assembled`) goes in or out as its parts;
- runs the call with the tapes paused and records one op of its own on
  them, from the inputs and the weights the call read to the outputs, each
  output an identity on its own device;
- in the backward, once a gradient reached the call (a data dependency:
  XLA ignores control dependencies), runs the call again on the device of
  its forward (a Megatron layer's parts each on theirs, as its code places
  them), drawing the seeds its forward drew (`drawn_again`) for the rows
  it drew them for (a pipeline's micro-batch), its state updates dropped
  (a `keras.StatelessScope`), and differentiates it.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
>>> with strategy.scope(), keras.RematScope(mode="full"):
...   dropout = keras.layers.Dropout(0.5, seed=1)
>>> @tf.function
... def dropped_and_gradient(x):
...   def step(x):
...     with tf.GradientTape() as tape:
...       tape.watch(x)
...       y = dropout(x, training=True)  # A keyword: refused as shipped.
...     return y, tape.gradient(y, x)
...   return strategy.run(step, (x,))
>>> y, dx = dropped_and_gradient(tf.ones([2, 4]))
>>> # 2 where the forward kept a unit, 0 where it dropped one: so is dx.
>>> [np.array_equal(a, b) for a, b in zip(strategy.experimental_local_results(y),
...                                       strategy.experimental_local_results(dx))]
[True, True]
"""

import contextlib
import contextvars
import functools

import keras
import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import random_layers
from replicator_strategy.model_parallel import megatron

# The seeds of the rematerialized call running in this thread: recorded by
# its forward, replayed by its recompute.
_draws = contextvars.ContextVar("rematerialized_draws", default=None)


def recomputed_in_place(remat):
  """Keras's TF backend `remat(f)`: `Recomputed(f)`, not `tf.recompute_grad`."""

  @functools.wraps(remat)
  def wrapper(f):
    return Recomputed(f)

  return wrapper


def drawn_again(next_seed):
  """`SeedGenerator.next`: in a rematerialized call, its forward's seeds
  recorded, and drawn again by its recompute (and so in `SharedDraws`)."""

  @functools.wraps(next_seed)
  def wrapper(self, ordered=True):
    draws = _draws.get()
    if draws is None:
      return next_seed(self, ordered)
    return draws.draw(lambda: next_seed(self, ordered))

  return wrapper


class _Recorded:
  """The seeds a rematerialized forward drew, in order, drawn through the
  enclosing call's draws (a call rematerialized inside another)."""

  def __init__(self, outer):
    self.outer, self.seeds = outer, []

  def draw(self, next_seed):
    seed = self.outer.draw(next_seed) if self.outer else next_seed()
    self.seeds.append(seed)
    return seed


class _Replayed:
  """A recompute's draws: its forward's seeds again, in order (the seed
  generators stay as the forward left them)."""

  def __init__(self, seeds):
    self.seeds = iter(seeds)

  def draw(self, next_seed):
    del next_seed
    seed = next(self.seeds, None)
    if seed is None:
      raise RuntimeError(
          "A rematerialized call drew more random values when recomputed "
          "than in its forward, so its gradient would not be the forward's. "
          "Draw with keras.random and a SeedGenerator inside the call, the "
          "same draws whatever the pass.")
    return seed


class SharedDraws:
  """Seeds drawn by the first of several runs of the same calls, drawn
  again by the others: a pipeline stage's forward on each micro-batch draws
  the seeds one device draws once for the whole batch."""

  def __init__(self):
    self._seeds = None

  @contextlib.contextmanager
  def drawing(self):
    first = self._seeds is None
    draws = _Recorded(_draws.get()) if first else _Replayed(self._seeds)
    with _drawing(draws):
      yield
    if first:
      self._seeds = draws.seeds


@contextlib.contextmanager
def _drawing(draws):
  token = _draws.set(draws)
  try:
    yield
  finally:
    _draws.reset(token)


def _is_input(value):
  return tf.is_tensor(value) and not isinstance(
      value, (tf.Variable, keras.Variable))


def _in_parts(flat):
  """The tensors of `flat` (a Megatron layer's output in parts as its parts),
  and for each, its `(index in flat, count of parts, axis, device)`."""
  tensors, places = [], []
  for i, value in enumerate(flat):
    if _is_input(value):
      parts, axis = megatron.recorded(value) or ([value], None)
      tensors += parts
      places.append((i, len(parts), axis, value.device))
  return tensors, places


def _wholes(tensors, places):
  """(index, whole) for each place: its parts in `tensors` assembled."""
  wholes, at = [], 0
  for i, count, axis, device in places:
    parts = tensors[at:at + count]
    at += count
    wholes.append((i, parts[0] if axis is None else megatron.assembled(
        parts, [device], axis)))
  return wholes


def _after(x, dys):
  """`x`, once a gradient reached the call: its recompute waits for the
  backward. A data dependency on a gradient on x's device (XLA ignores
  control dependencies), else a control dependency: no data crosses."""
  if tf.executing_eagerly():
    return tf.identity(x)
  here = [d for d in dys if _device(d) == _device(x)]
  with tf.device(x.device):
    if not here:
      with tf.control_dependencies(dys[:1]):
        return tf.identity(x)
    zero = megatron.zero_after(here[0])
    if x.dtype.is_floating:
      return x + tf.cast(zero, x.dtype)
    with tf.control_dependencies([zero]):
      return tf.identity(x)


def _device(tensor):
  return tf.DeviceSpec.from_string(tensor.device).to_string()


class Recomputed:
  """`f`, its intermediate values recomputed by its gradient, not kept.

  Compares equal to `f`: a layer's activation rematerialized
  (`RematScope(mode="activations")`) is still the elementwise function a
  Megatron column layer applies to each part of its output.
  """

  def __init__(self, f):
    functools.update_wrapper(self, f, updated=())

  def __eq__(self, other):
    return self.__wrapped__ == getattr(other, "__wrapped__", other)

  def __hash__(self):
    return hash(self.__wrapped__)

  def __call__(self, *args, **kwargs):
    if not tfi.tape_recording():  # No gradient asked: nothing to keep.
      return self.__wrapped__(*args, **kwargs)
    flat = tf.nest.flatten((args, kwargs))
    feeds, slots = _in_parts(flat)

    def run(tensors):
      values = list(flat)
      for i, whole in _wholes(tensors, slots):
        values[i] = whole
      a, kw = tf.nest.pack_sequence_as((args, kwargs), values)
      return self.__wrapped__(*a, **kw)

    draws = _Recorded(_draws.get())
    micro = random_layers.microbatch_running()
    with tfi.VariableWatcher() as watcher, tfi.tapes_paused(), _drawing(
        draws):
      outputs = run(feeds)
      flat_out = tf.nest.flatten(outputs)
      given, places = _in_parts(flat_out)
      results = []
      for part in given:
        with tf.device(part.device):
          results.append(tf.identity(part))
    variables = [v for v in watcher.watched_variables() if v.dtype.is_floating]
    if not results or not feeds + variables:
      return outputs
    forward_device = places[0][3]
    # Not the results themselves: eagerly, they would be kept for the backward.
    shapes = [(tf.shape(r), r.dtype) for r in results]

    def backward(*dys):
      dys = [tf.zeros(*shape) if d is None else d
             for d, shape in zip(dys, shapes)]
      with tf.device(forward_device):
        xs = [_after(x, dys) for x in feeds]
        with tf.GradientTape() as tape, _drawing(_Replayed(draws.seeds)), (
            random_layers.microbatch(*micro) if micro
            else contextlib.nullcontext()):
          tape.watch([x for x in xs if x.dtype.is_floating])
          tape.watch(variables)
          with keras.StatelessScope():
            again = _as_given(tf.nest.flatten(run(xs)), places)
        return tape.gradient(again, xs + variables, output_gradients=dys)

    # A variable's gradient goes to its handle, as a read's does (a sharded
    # weight's: its shard's, of the shard's shape).
    for v in variables:  # Read with the tapes paused: not watched yet.
      tfi.variable_read(v)
    tfi.record_operation("Recomputed", results,
                         feeds + [v.handle for v in variables], backward)
    for i, whole in _wholes(results, places):
      mask = ki.get_keras_mask(flat_out[i])
      if mask is not None:
        ki.set_keras_mask(whole, mask)
      flat_out[i] = whole
    return tf.nest.pack_sequence_as(outputs, flat_out)


def _as_given(flat, places):
  """The recompute's outputs as the forward gave them: in the same parts."""
  return [part for i, count, axis, device in places
          for part in ([flat[i]] if axis is None else megatron.split(
              flat[i], count, axis, [device]))]
