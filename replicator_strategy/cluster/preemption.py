"""SIGTERM to one worker stops every worker at a step they all agree on.

Kubernetes and Slurm send SIGTERM before they take a machine away. Across
workers, training is synchronous: a worker that stops alone leaves the others
blocked in the next step's collective, and a worker blocked there cannot
answer a barrier. So the agreement runs beside the training loop, on TF's
coordination service (the key-value store every worker already shares):

1. SIGTERM on worker w sets a local flag (TF's own handler, which only
   records the signal, is replaced).
2. At its next step boundary, after `c` steps, worker w publishes "stop after
   step c + 1" under one key, then waits until every worker acknowledges it.
   The others are at most one step ahead (inside step c + 1, which cannot
   finish without w), so c + 1 is a step every worker still has to reach.
3. On every worker a background thread waits on that key from the start;
   it records the step, then acknowledges. Only then does w run step c + 1,
   so every worker knows the step before it can finish it.
4. After step c + 1 each worker saves (see `keras.callbacks.BackupAndRestore`
   below), waits for the others at a barrier and exits with status 143
   (128 + SIGTERM), which the launcher's `--max-restarts` restarts.

Per step this costs one check of a local flag: no collective, no RPC. A
training loop takes part by calling `step_done()` after each step between
`start_watching()` and `stop_watching()`; `keras.callbacks.BackupAndRestore`
does so in `fit` (see `replicator_strategy.keras.preemption_saves`). SIGTERM while
no such loop runs (another loop, evaluation, start-up) exits at once with 143;
the other workers then fail naming this one.

A loop's part, here alone (no cluster: nothing to agree on, never a stop):

>>> start_watching()
>>> [step_done() for _ in range(3)]  # after each step; True: save, `stop()`
[False, False, False]
>>> stop_watching()
"""

import atexit
import os
import signal
import sys
import threading

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

PREEMPTED_STATUS = 128 + signal.SIGTERM
_STOP_KEY = "replicator_strategy/preemption/stop_after_step"
_ACK_KEY = "replicator_strategy/preemption/acknowledged/{}"
_BARRIER = "replicator_strategy/preemption/saved"
_NOT_PREEMPTED = "-1 none"  # Releases the listeners at exit.

_watch = []  # The one _Watch of this process, once its cluster started.
_before_exit = []  # Clean-ups that an exit through os._exit must still run.


def call_before_exit(fn):
  """Runs `fn` before a preempted worker exits (atexit handlers do not run)."""
  _before_exit.append(fn)


def install(cluster, timeout_seconds):
  """Watches for SIGTERM on this worker and for a stop step set by any worker.

  Called once the cluster's runtime started, from the main thread.
  """
  if not _watch:
    _watch.append(_Watch(cluster, timeout_seconds))


def start_watching():
  """A training loop that calls `step_done()` after every step begins."""
  if _watch:
    _watch[0].loops += 1


def stop_watching(exit_if_told=True):
  """The loop ended; exits if this worker was told to stop meanwhile."""
  if not _watch:
    return
  watch = _watch[0]
  watch.loops -= 1
  if exit_if_told and (watch.signalled.is_set() or watch.stop_known.is_set()):
    # The loop ended before the stop step (a preemption in its last step).
    exit_preempted(f"{watch.cluster.task_name} stops at the end of its "
                   f"training loop: {watch.reason()}.")


def step_done():
  """True when every worker must stop after this step: save, then `stop()`."""
  return bool(_watch) and _watch[0].step_done()


def stop():
  """At the stop step, once saved: waits for every worker, exits 143."""
  watch = _watch[0]
  try:
    tfi.context.context().wait_at_barrier(_BARRIER, watch.timeout_ms)
  except tf.errors.OpError as e:
    _say(f"{watch.cluster.task_name}: not every worker saved before the "
         f"stop ({e.message}).")
  exit_preempted(f"{watch.cluster.task_name} stops after step "
                 f"{watch.stop_step}: {watch.reason()}. Restart every worker "
                 f"(the launcher's --max-restarts does) to resume from the "
                 f"last backup.")


def exit_preempted(message):
  """Exits at once with 143, past TF's shutdown barrier that peers would hold."""
  _say(message)
  for fn in _before_exit:
    fn()
  os._exit(PREEMPTED_STATUS)  # pylint: disable=protected-access


def _say(message):
  try:
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
  except OSError:
    pass  # Output is gone (its reader, the launcher, was killed): go on.


class _Watch:
  """This worker's SIGTERM flag, step count and the listener of the stop key."""

  def __init__(self, cluster, timeout_seconds):
    self.cluster = cluster
    self.timeout_ms = int(timeout_seconds * 1000)
    self.loops = 0
    self.steps = 0
    self.signalled = threading.Event()
    self.stop_known = threading.Event()
    self.stop_step = None
    self.origin = None
    self._context = tfi.context.context()
    # Python handlers can only be set from the main thread; elsewhere TF's
    # own handler stays, which records SIGTERM and lets training go on.
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self._on_sigterm)
    threading.Thread(target=self._listen, daemon=True,
                     name="replicator-preemption-listener").start()
    # A listener still blocked in TF when the interpreter exits can crash it.
    atexit.register(self._release_listener)

  def reason(self):
    origin = self.origin or self.cluster.task_name
    return f"{origin} received SIGTERM"

  def _on_sigterm(self, signum, frame):
    del signum, frame
    if self.signalled.is_set():
      return
    self.signalled.set()
    if not self.loops:
      message = (
          f"{self.cluster.task_name} received SIGTERM outside a training loop "
          f"that saves on preemption; it exits with status {PREEMPTED_STATUS} "
          f"without saving. Use keras.callbacks.BackupAndRestore in fit, or "
          f"PreemptionCheckpoint in a custom loop, to save and resume.")
      # The others learn why at once, not when its heartbeats stop.
      try:
        self._context.report_error_to_cluster(tf.errors.UNAVAILABLE, message)
      except (tf.errors.OpError, ValueError):
        pass  # The runtime is gone already.
      exit_preempted(message)

  def step_done(self):
    self.steps += 1
    if self.stop_known.is_set():
      return self.steps >= self.stop_step
    if self.signalled.is_set():
      self._announce(self.steps + 1)
    return False

  def _announce(self, stop_step):
    try:
      self._context.set_config_key_value(
          _STOP_KEY, f"{stop_step} {self.cluster.task_name}")
    except tf.errors.AlreadyExistsError:
      return  # Another worker announced first; the listener reads its step.
    _say(f"{self.cluster.task_name} received SIGTERM: every worker stops "
         f"after step {stop_step}.")
    try:
      for index in range(self.cluster.num_workers):
        self._context.get_config_key_value(_ACK_KEY.format(index),
                                           self.timeout_ms)
    except tf.errors.OpError as e:
      exit_preempted(f"{self.cluster.task_name} received SIGTERM, but not "
                     f"every worker acknowledged the stop step ({e.message}); "
                     f"exiting without saving.")

  def _listen(self):
    try:
      value = self._context.get_config_key_value(_STOP_KEY)
    except tf.errors.OpError:
      return  # The runtime shut down.
    step, origin = value.split(" ", 1)
    if int(step) < 0:
      return
    self.stop_step, self.origin = int(step), origin
    self.stop_known.set()  # Before the acknowledgement: see the docstring.
    try:
      self._context.set_config_key_value(
          _ACK_KEY.format(self.cluster.worker_index), "1")
    except tf.errors.OpError:
      pass  # The announcer is gone; its peers fail naming it.

  def _release_listener(self):
    try:
      self._context.set_config_key_value(_STOP_KEY, _NOT_PREEMPTED)
    except tf.errors.OpError:
      pass  # Set already (a stop step), or the runtime is gone.
