"""Eight things Keras 3 gets wrong under any strategy, put right for this one.

- Per-batch logs (the progress bar, `on_*_batch_end` callbacks, the return of
  `train_on_batch`) are averages of each replica's *local* metric results,
  which differ from the global values for anything but equal local batches
  and linear metrics. Here the metric variables are summed across replicas
  first (one batched all-reduce per step) and the results computed from the
  sums, exactly as one device would.
- `train_on_batch`, `test_on_batch` and `predict_on_batch` hand the whole
  batch to every replica: N times the work, N copies of every slice of a
  sparse gradient, and N times the rows from `predict_on_batch`. Here the
  batch is cut into per-replica parts as `fit` cuts one, so they train,
  evaluate and predict as one device does.
- A replica's mean loss is scaled by 1/N, which is right only when every
  replica has as many rows; a final partial batch then trains differently
  from one device. And the scaled value is what a custom `train_step` sees
  and logs (the loss / N). Here the loss keeps its value, the replica's mean,
  and its gradient is scaled by the replica's share of the rows. And Keras
  scales only the pieces it computes, so what a `compute_loss` override adds
  to `super().compute_loss(...)` trains N times as strongly; here the value
  `compute_loss` returns to Keras's steps is scaled as a whole.
- Before the first step Keras builds the model from the first batch, averaged
  over the replicas, which fails when the batch splits unevenly, or on a
  sparse batch, or on zero rows, or for a model with no `call()` (a GAN
  trained by its own `train_step`); and it draws that batch from an iterator
  it then drops, so a generator loses the batches it read ahead. Here it
  builds from the batches' spec, reading nothing, and a model with no
  `call()` is left to build in its first step, as without a strategy.
- Gradient clipping (`clipnorm`, `global_clipnorm`, `clipvalue`) clips each
  replica's share of the gradient before the all-reduce, which is not the
  clipped global gradient. Here clipping optimizers all-reduce first.
- The all-reduce of a sparse gradient keeps every replica's slice at a row
  apart, where one device has one slice for a lookup that does not depend
  on the batch (an `Embedding` of positions), and Keras's Adam squares each
  slice. Here such slices are summed, as one device has them.
- Across workers, `predict` concatenates this worker's replicas only (Keras
  gathers every worker's rows for MultiWorkerMirroredStrategy alone). Here
  every worker gets all rows, in order.
- `jit_compile=True` compiles the whole replicated step with XLA, which
  fails on the replicas' devices, and `"auto"` turns XLA off under any
  strategy. Here each replica's step is compiled on its own device (a
  replica over several devices: each device's part), and `"auto"` means XLA
  on accelerators, as without a strategy.

And one thing Keras could not know: `fit` takes a dataset the strategy
distributed itself (`experimental_distribute_dataset`) only if TF's own
classes made it, by name, so it is told that a
`replicator_strategy.global_batch_input.GlobalBatchDataset` is one too.

And one thing Keras has no word for: with
`ReplicatorStrategy(gradient_compression=...)` the optimizer's gradient
all-reduce sends 16-bit floats (`replicator_strategy.collectives.compression`).

Each wrapper is an entry of `replicator_strategy.keras.PATCHES`, applied on the first
use of `replicator_strategy`, on `keras.Model`, `keras.optimizers.Optimizer` and
Keras's loss-scaling functions; every wrapper calls Keras's own code
unchanged for any other strategy.

>>> import numpy as np
>>> import replicator_strategy as rs
>>> with rs.ReplicatorStrategy().scope():  # 4 replicas here
...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model.predict_on_batch(np.ones((10, 3))).shape  # 10 rows, not 4 x 10
(10, 2)
"""

import contextlib
import functools
import inspect
import threading
import warnings

import keras
import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy.keras import sharded_weights
from replicator_strategy.keras import step_context
from replicator_strategy import _tf_internal as tfi
from replicator_strategy import global_batch_input
from replicator_strategy.collectives import compression as compression_lib
from replicator_strategy import replica_context
from replicator_strategy import strategy as strategy_lib


def in_our_replicas():
  """Whether this runs in a replica of a ReplicatorStrategy of several."""
  ctx = tf.distribute.get_replica_context()
  return (isinstance(ctx, replica_context.ReplicaContext) and
          ctx.strategy.extended.num_replicas_in_all_groups > 1)


def global_metrics_result(get_metrics_result):

  @functools.wraps(get_metrics_result)
  def wrapper(self):
    if not in_our_replicas():
      return get_metrics_result(self)
    ctx = tf.distribute.get_replica_context()
    variables = [v for metric in self.metrics for v in metric.variables]
    if not variables:
      return get_metrics_result(self)
    # Keras metric state is additive (totals, counts, confusion entries);
    # with sync groups, summed over every group's replicas, as one device's.
    summed = ctx.all_reduce_all_groups(
        "sum", [tf.convert_to_tensor(v) for v in variables])
    with keras.StatelessScope(state_mapping=list(zip(variables, summed))):
      return get_metrics_result(self)

  return wrapper


def build_from_batch_spec(maybe_symbolic_build):

  @functools.wraps(maybe_symbolic_build)
  def wrapper(self, iterator=None, data_batch=None):
    strategy = self.distribute_strategy
    if not isinstance(strategy, strategy_lib.ReplicatorStrategy):
      return maybe_symbolic_build(self, iterator=iterator,
                                  data_batch=data_batch)
    if iterator is None:
      # `split_on_batch`'s parts: built from the first replica's, as `fit`
      # builds from one replica's spec.
      return maybe_symbolic_build(self, data_batch=tf.nest.map_structure(
          lambda v: strategy.experimental_local_results(v)[0], data_batch))
    if type(self).call is keras.Model.call:
      # No call() to build from (a GAN's custom train_step, say): defer to
      # the step's first trace, as Keras does without a strategy.
      return None
    # Keras's pre-build draws a batch from an iterator it then drops, with
    # whatever that iterator read ahead: a generator loses batches (how many
    # depends on timing), a shuffled PyDataset one shuffle. The batches'
    # spec builds the same, reading nothing.
    spec = ki.distributed_dataset(iterator).element_spec
    return maybe_symbolic_build(self, data_batch=tf.nest.map_structure(
        tfi.one_replica_spec, spec))

  return wrapper


def batch_share(replica_context):
  """This replica's rows over all replicas' rows, or None if unknown.

  Exact loss scaling under uneven splits needs it: a replica's mean loss
  counts in proportion to its rows (Keras weights each replica's mean loss
  1/N otherwise). Rows as `ReplicaContext.batch_rows` counts them.

  >>> import replicator_strategy as rs
  >>> strategy = rs.ReplicatorStrategy(devices=["/cpu:0", "/cpu:1"])
  >>> rows = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: tf.ones([2 * ctx.replica_id_in_sync_group + 1, 2]))
  >>> shares = strategy.run(
  ...     lambda x: batch_share(tf.distribute.get_replica_context()), (rows,))
  >>> [float(s) for s in strategy.experimental_local_results(shares)]
  [0.25, 0.75]
  """
  rows = replica_context.batch_rows()
  if rows is None:
    return None
  return tf.math.divide_no_nan(tf.cast(rows.count, tf.float32),
                               tf.cast(rows.total, tf.float32))


def scale_by_batch_share(keras_fn, scale):
  """A replica's mean loss, its gradient scaled by the replica's share of the rows.

  Keras scales each replica's loss by 1/N so that summing the replicas'
  gradients gives the global one; its own `train_step` then unscales the
  value for its logs, but a custom step logs the scaled value (the loss / N).
  Here the value stays the replica's own mean loss, what one device computes
  for those rows, and only its gradient carries the share: training is
  unchanged and every step logs real losses. Unscaling is then nothing to do.
  """

  @functools.wraps(keras_fn)
  def wrapper(value):
    if _scaling_whole_loss():  # `loss_scaled_whole` scales the total.
      return value
    share = None
    if in_our_replicas():
      share = batch_share(tf.distribute.get_replica_context())
    if share is None:
      return keras_fn(value)
    if not scale:
      return value
    share = tf.cast(share, value.dtype)
    return share * value + tf.stop_gradient((1 - share) * value)

  return wrapper


_loss_scope = threading.local()  # Each replica runs in its own thread.


def _scaling_whole_loss():
  return getattr(_loss_scope, "whole", False)


def loss_scaled_whole(compute_loss):
  """`Model._compute_loss` (Keras's train_step and test_step call
  `compute_loss` through it), its value scaled as one loss.

  Keras scales the pieces it computes inside `compute_loss` (a compiled loss,
  `add_loss` terms); what an override adds to `super().compute_loss(...)`, or
  computes itself, stays unscaled, and its gradient, summed over N replicas,
  trains N times as strongly as on one device. Here nothing inside is scaled
  and the value returned is, as a whole, as `scale_by_batch_share` scales a
  replica's mean loss.
  """

  @functools.wraps(compute_loss)
  def wrapper(self, *args, **kwargs):
    if not in_our_replicas() or _scaling_whole_loss():
      return compute_loss(self, *args, **kwargs)
    _loss_scope.whole = True
    try:
      loss = compute_loss(self, *args, **kwargs)
    finally:
      _loss_scope.whole = False
    if loss is None:
      return None
    return ki.loss.scale_loss_for_distribution(loss)

  return wrapper


def warn_override_unscaled(compute_loss):
  """`Model.compute_loss`, warning once per class where an override calls it
  from outside `loss_scaled_whole`: a custom train_step's own call, whose
  result nothing can scale as a whole."""

  @functools.wraps(compute_loss)
  def wrapper(self, *args, **kwargs):
    cls = type(self)
    if (cls.compute_loss is not keras.Model.compute_loss and
        not _scaling_whole_loss() and in_our_replicas() and
        cls not in _warned_overrides):
      _warned_overrides.add(cls)
      warnings.warn(
          f"ReplicatorStrategy: {cls.__qualname__}.compute_loss calls "
          f"super().compute_loss() from a step of its own (a custom "
          f"train_step or test_step). Keras's own train_step scales the "
          f"value compute_loss returns as one device's; called from "
          f"another step, only the losses Keras computes inside are scaled, "
          f"and any term the override adds trains "
          f"{tf.distribute.get_strategy().num_replicas_in_sync} times as "
          f"strongly as on one device. Leave the step to Keras "
          f"(super().train_step(data)), or divide the added terms by "
          f"self.distribute_strategy.num_replicas_in_sync.", stacklevel=2)
    return compute_loss(self, *args, **kwargs)

  return wrapper


_warned_overrides = set()


def split_on_batch(on_batch):
  """`Model.train_on_batch`, `test_on_batch` or `predict_on_batch`, its
  batch (`x`, `y`, `sample_weight`) cut into the replicas' parts as `fit`
  cuts a batch.

  Keras gives every replica the whole batch: N times the work, N times the
  rows from `predict_on_batch`, and N copies of each slice of a sparse
  gradient (which Keras's Adam squares one by one). A `class_weight` is
  turned into sample weights from the whole batch's labels first, as Keras
  does; Keras builds the model from the first replica's part
  (`build_from_batch_spec`).
  """
  signature = inspect.signature(on_batch)

  @functools.wraps(on_batch)
  def wrapper(self, *args, **kwargs):
    strategy = self.distribute_strategy
    if not (isinstance(strategy, strategy_lib.ReplicatorStrategy) and
            strategy.extended.num_replicas_in_all_groups > 1):
      return on_batch(self, *args, **kwargs)
    call = signature.bind(self, *args, **kwargs)
    data = call.arguments
    if data.get("class_weight") is not None:
      if data.get("sample_weight") is not None:
        # Keras refuses both, naming the values received.
        return on_batch(self, *args, **kwargs)
      data["sample_weight"] = (
          ki.data_adapter_utils.class_weight_to_sample_weights(
              data["y"], data["class_weight"]))
      data["class_weight"] = None
    for name in ("x", "y", "sample_weight"):
      if data.get(name) is not None:
        data[name] = split_batch(strategy, data[name])
    return on_batch(*call.args, **call.kwargs)

  return wrapper


def _clips(optimizer):
  """Whether `optimizer` clips its gradients (by norm, global norm or value)."""
  return optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue


def reduce_before_clipping(backend_apply_gradients):

  @functools.wraps(backend_apply_gradients)
  def wrapper(self, grads, trainable_variables):
    if not (_clips(self) and in_our_replicas()):
      return backend_apply_gradients(self, grads, trainable_variables)
    with step_context.stepping(self) as step:
      # With accumulation, `reduce_accumulated_before_clipping` reduces
      # before clipping, at update steps only.
      if not self.gradient_accumulation_steps:
        pairs = ki.all_reduce_sum_gradients(self, zip(
            grads, [v.value if isinstance(v, keras.Variable) else v
                    for v in trainable_variables]))
        grads = [g for g, _ in pairs]
        step.gradients_summed = True
      return backend_apply_gradients(self, grads, trainable_variables)

  return wrapper


def reduce_accumulated_before_clipping(clip_gradients):
  """With gradient accumulation, clipping of the global (g + acc) / steps.

  Keras clips each replica's (g + acc) / steps at an update step, before its
  all-reduce; here they are all-reduced first, at update steps only (Keras
  clips nowhere else), and the update's own all-reduce is skipped.
  """

  @functools.wraps(clip_gradients)
  def wrapper(self, grads):
    # The step `reduce_before_clipping` opened where the optimizer clips.
    step = step_context.current(self)
    if step is None or not self.gradient_accumulation_steps:
      return clip_gradients(self, grads)
    if sharded_weights.any_sharded(ki.optimizer_weights(self)):
      sharded_weights.refuse_clipping_accumulated()
    # Without sharded weights, the weights do not change the sum.
    pairs = ki.all_reduce_sum_gradients(self, [(g, None) for g in grads])
    step.gradients_summed = True
    return clip_gradients(self, [g for g, _ in pairs])

  return wrapper


def compressed_on_the_wire(all_reduce_sum_gradients):
  """The optimizer's gradient sum, sent as the strategy's 16-bit floats.

  `ReplicatorStrategy(gradient_compression=...)`; see
  `replicator_strategy.collectives.compression`.
  """
  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    strategy = tf.distribute.get_strategy()
    wire = (compression_lib.wire_dtype(strategy.gradient_compression)
            if in_our_replicas() else None)
    if wire is None:
      return all_reduce_sum_gradients(self, grads_and_vars)
    pairs = list(grads_and_vars)
    summed = iter(compression_lib.all_reduce_sum(
        tf.distribute.get_replica_context(),
        [g for g, _ in pairs if g is not None], wire))
    return [(None if g is None else next(summed), v) for g, v in pairs]

  return wrapper


def skip_if_reduced(all_reduce_sum_gradients):

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    if step_context.gradients_summed(self):
      return list(grads_and_vars)
    return all_reduce_sum_gradients(self, grads_and_vars)

  return wrapper


def slices_as_on_one_device(all_reduce_sum_gradients):
  """The optimizer's gradient sum, with rows every replica looks up alike
  summed row by row, as one device's gradient has them.

  The all-reduce of an `IndexedSlices` gradient concatenates the replicas'
  slices: one device's own for a lookup of the batch's rows (a slice per
  token), but a lookup at rows that do not depend on the batch (an
  `Embedding` of positions, `arange` with no batch axis) gives one slice per
  row on one device, the batch's sum, and N after the all-reduce. Keras's
  Adam squares each slice, so its second moment differs (slices 1 and 2 at
  one row give 5, one device's 3 gives 9). Here such a gradient's values are
  summed across the replicas and its indices kept.
  """

  @functools.wraps(all_reduce_sum_gradients)
  def wrapper(self, grads_and_vars):
    pairs = list(grads_and_vars)
    alike = [in_our_replicas() and isinstance(g, tf.IndexedSlices) and
             computed_from_constants(g.indices) for g, _ in pairs]
    if not any(alike):
      return all_reduce_sum_gradients(self, pairs)
    summed = all_reduce_sum_gradients(
        self, [(g.values, v) if a else (g, v)
               for (g, v), a in zip(pairs, alike)])
    return [(tf.IndexedSlices(s, g.indices, g.dense_shape), v) if a else (s, v)
            for (g, _), (s, v), a in zip(pairs, summed, alike)]

  return wrapper


def computed_from_constants(tensor):
  """Whether the traced `tensor` is computed from constants alone, by ops
  that are not stateful: then it is the same on every replica.

  False where that is not known: an eager tensor, or one that depends on a
  function's inputs (the batch), a variable or a random op.

  >>> found = []
  >>> @tf.function(input_signature=[tf.TensorSpec([None])])
  ... def traced(x):
  ...   found.append(computed_from_constants(tf.range(5) * 2))
  ...   found.append(computed_from_constants(tf.range(tf.shape(x)[0])))
  ...   return x
  >>> _ = traced(tf.ones([3]))
  >>> found
  [True, False]
  """
  if tf.executing_eagerly() or not hasattr(tensor, "op"):
    return False
  seen, pending = set(), [tensor.op]
  while pending:
    op = pending.pop()
    if op in seen or op.type == "Const":
      continue
    if not op.inputs or op.op_def.is_stateful:
      return False
    seen.add(op)
    pending.extend(t.op for t in op.inputs)
  return True


def takes_global_batch_dataset(is_tf_dataset):

  @functools.wraps(is_tf_dataset)
  def wrapper(x):
    return (isinstance(x, global_batch_input.GlobalBatchDataset) or
            is_tf_dataset(x))

  return wrapper


def concat_across_workers(reduce_per_replica):

  @functools.wraps(reduce_per_replica)
  def wrapper(values, strategy, reduction):
    if not (reduction == "concat" and
            isinstance(strategy, strategy_lib.ReplicatorStrategy) and
            strategy.extended.num_workers > 1):
      return reduce_per_replica(values, strategy, reduction)
    if strategy.extended.deals_worker_slices:
      # Each worker held its replicas' contiguous parts: in replica order.
      return tf.nest.map_structure(lambda v: strategy.gather(v, axis=0),
                                   values)
    # Keras's own gather-and-reorder for MultiWorkerMirroredStrategy fits
    # the input layout, which is the same TF input pipeline.
    every_replica = _EveryGroup(strategy)
    return tf.nest.map_structure(
        lambda v: ki.multi_worker_concat(v, every_replica),
        values)

  return wrapper


class _EveryGroup:
  """`strategy` with every replica of every sync group counted in sync: the
  replicas a batch was split among, which Keras's gather cuts its rows by."""

  def __init__(self, strategy):
    self._strategy = strategy

  @property
  def num_replicas_in_sync(self):
    return self._strategy.extended.num_replicas_in_all_groups

  def __getattr__(self, name):
    return getattr(self._strategy, name)


def compiled_per_replica(make_function):
  """Keras's step maker, with `jit_compile=True` compiling each replica's step.

  Keras compiles the function around `strategy.run` with XLA as a whole,
  which compiles for one device and fails on the other replicas' variables
  (MirroredStrategy too). Here that function stays a plain `tf.function` and
  the step it runs on every replica is the `jit_compile=True` one, which
  ReplicatorStrategy compiles per replica, on the replica's device; a
  replica over several devices is compiled per device (`_per_device`).
  """
  def wrapper(self, step_function):
    if not _compiles_for_replicator(self):
      return make_function(self, step_function)
    if _spans_devices(self):
      step = tf.function(_per_device(step_function), reduce_retracing=True)
    else:
      step = tf.function(step_function, jit_compile=True,
                         reduce_retracing=True)
    with _whole_step_uncompiled(self):
      return make_function(self, step)

  return wrapper


def predict_compiled_per_device(make_predict_function):
  """Keras's predict maker, for a replica over several devices with XLA.

  Keras compiles the replica's predict step as one XLA function, for one
  device; `predict_step_per_device` compiles it per device instead.
  """
  def wrapper(self, *args, **kwargs):
    if not (_compiles_for_replicator(self) and _spans_devices(self)):
      return make_predict_function(self, *args, **kwargs)
    with _whole_step_uncompiled(self):
      return make_predict_function(self, *args, **kwargs)

  return wrapper


def predict_step_per_device(predict_step):
  """`Model.predict_step`, traced under `jit_scope` where XLA is asked of a
  replica over several devices (see `predict_compiled_per_device`)."""
  def wrapper(self, *args, **kwargs):
    if not (tf.inside_function() and _compiles_for_replicator(self) and
            _spans_devices(self)):
      return predict_step(self, *args, **kwargs)
    return _per_device(functools.partial(predict_step, self))(*args, **kwargs)

  return wrapper


def _compiles_for_replicator(model):
  return model.jit_compile and isinstance(model.distribute_strategy,
                                          strategy_lib.ReplicatorStrategy)


def _spans_devices(model):
  return model.distribute_strategy.extended.logical_devices.per_replica > 1


@contextlib.contextmanager
def _whole_step_uncompiled(model):
  """Keras's own `jit_compile=True` off while it makes the function around
  the replicas' steps, which compile themselves."""
  model.jit_compile = False
  try:
    yield
  finally:
    model.jit_compile = True


def _per_device(step_function):
  """`step_function` with its ops compiled by XLA in one cluster per device.

  XLA compiles a function for one device, but a replica over several
  devices has variables on each: under `jit_scope` TF clusters each
  device's compilable ops apart and passes values between the clusters.
  """
  @functools.wraps(step_function)
  def step(*args, **kwargs):
    with tf.xla.experimental.jit_scope(separate_compiled_gradients=False):
      return step_function(*args, **kwargs)

  return step


def xla_on_accelerators(resolve_auto_jit_compile):
  """`jit_compile="auto"` resolved as without a strategy: XLA on GPUs/TPUs.

  Keras turns "auto" off under any `tf.distribute` strategy because a whole
  replicated step does not compile; ReplicatorStrategy compiles per replica.
  """
  def wrapper(self):
    if not isinstance(self.distribute_strategy,
                      strategy_lib.ReplicatorStrategy):
      return resolve_auto_jit_compile(self)
    accelerated = any(device.device_type != "CPU"
                      for device in tf.config.list_physical_devices())
    return accelerated and ki.supports_jit(self)

  return wrapper


def split_batch(strategy, batch):
  """A batch (any nest) as per-replica contiguous parts, cut as every global
  batch is (`global_batch_input.split_rows`): cut on the host, each part
  copied to its replica's device."""
  leaves = tf.nest.flatten(batch)
  with tf.device(strategy.extended.host_device):
    # Every replica of every sync group takes its part.
    parts = [global_batch_input.split_rows(
        leaf if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)) else
        tf.convert_to_tensor(leaf),
        strategy.extended.num_replicas_in_all_groups) for leaf in leaves]
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.pack_sequence_as(batch, [
          tf.identity(p[ctx.replica_id_in_sync_group]) for p in parts]))
