"""Compiled steps: `jit_compile=True` per replica (per device), `"auto"` as on one device.

`jit_compile=True` compiles the whole replicated step with XLA, which
fails on the replicas' devices, and `"auto"` turns XLA off under any
strategy. Here each replica's step is compiled on its own device (a
replica over several devices: each device's part), and `"auto"` means XLA
on accelerators, as without a strategy.
"""

import contextlib
import functools

import tensorflow as tf

from replicator_strategy.keras import _internal as ki
from replicator_strategy import strategy as strategy_lib


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
