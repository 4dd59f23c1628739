"""One thread per process that bounds every wait in a run-time collective.

TensorFlow's collective ops take a `timeout`, but each timed launch parks an
OS thread that sleeps out the whole timeout, however soon the collective
finishes (`Env::SchedClosureAfter`): at 4 collectives a step and 120 s, a fast
loop holds thousands of threads and the process dies of it. So
ReplicatorStrategy launches its per-step collectives untimed and this
watchdog does the timing:

- In graphs, each replica's launches advance counters on its device
  (`Progress`): how many it launched, how many completed, and the signature
  (op, dtype, shape) of the last one.
- The watchdog thread reads them four times a second. Collectives pending
  with no counter moving for `timeout_seconds` abort every collective of the
  process (TF's `abort_collective_ops`) with a message saying which replica
  waits in what. Local replicas waiting at the same launch in different
  collectives (a sum on one, a max on another) abort within about a second:
  their programs differ, and no amount of waiting mends that.
- Eager calls are timed with `waiting()`.

As after TF's own timeout, collectives fail in this process once aborted (TF
keeps its collective executor aborted for every strategy); it must restart.
A collective traced or called after the abort is refused at once, with the
abort's report (`check_not_aborted`), instead of TF's bare
"Function was cancelled before it was started".

>>> progress = Progress(("/cpu:0", "/cpu:1"), timeout_seconds=120,
...                     what="collectives among 2 replicas")
>>> progress.read()
[(0, 0, 'none'), (0, 0, 'none')]
"""

import atexit
import contextlib
import dataclasses
import itertools
import threading
import time
import weakref

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi

# A replica that never arrives (a branch taken on some replicas only, a
# worker that died) fails the step after this long instead of hanging it.
DEFAULT_TIMEOUT_SECONDS = 120

POLL_SECONDS = 0.25
# Consecutive polls that must show the same mismatch: a replica between
# drawing its launch number and naming its collective is not one.
_MISMATCH_POLLS = 4

# How long a stalled worker waits for the others' reports before aborting.
_EXCHANGE_SECONDS = 5

_signature_lock = threading.Lock()
_signatures = []
_signature_codes = {}


def signature_code(description):
  """A small int naming `description` (e.g. "all_reduce SUM float32[10]")."""
  with _signature_lock:
    code = _signature_codes.get(description)
    if code is None:
      code = _signature_codes[description] = len(_signatures)
      _signatures.append(description)
    return code


_workers = {}  # "index" and "count" once this process is a worker of a cluster.


def share_stalls_across_workers(worker_index, num_workers):
  """In a cluster: a stall report also says what the other workers wait in.

  Reports travel through TF's coordination service, which every worker runs.
  """
  _workers.update(index=worker_index, count=num_workers)


def _describe(code):
  return _signatures[code] if 0 <= code < len(_signatures) else "none"


class _Order:
  """One replica's collectives in one graph, each waiting for the one before:
  program order even where TF adds no control dependencies (a gradient's
  graphs), so every replica launches its collectives in the same order.

  `last_ops` ({replica: name of its last op}) is kept per graph by `Progress`;
  names, not ops, so that it holds no graph alive.
  """

  def __init__(self, graph, last_ops, local_index):
    self._graph = weakref.ref(graph)
    self._last_ops = last_ops
    self._local_index = local_index

  def after(self):
    """Control dependencies on this replica's last op, in its own graph."""
    graph = tf.compat.v1.get_default_graph()
    name = self._last_ops.get(self._local_index)
    if name is None or graph is not self._graph():
      return contextlib.nullcontext()
    return tf.control_dependencies([graph.get_operation_by_name(name)])

  def record(self, tensor):
    self._last_ops[self._local_index] = tensor.op.name


@dataclasses.dataclass(frozen=True)
class Launch:
  """One drawn launch of a replica: its number on the device, and handles to mark it."""
  number: tf.Tensor
  completed: tf.Tensor
  last: tf.Tensor
  order: _Order


class Progress:
  """Counters the graph collectives of one group of replicas advance, a set per device."""

  def __init__(self, devices, timeout_seconds, what, group_size=None):
    """`group_size`: the replicas the collectives span, over every worker
    (None: these `devices`')."""
    self.devices = tuple(devices)
    # More replicas than this worker's devices hold: other workers' too.
    self.spans_workers = (group_size or len(self.devices)) > len(self.devices)
    self.timeout_seconds = timeout_seconds
    self.what = what
    self.traced = False  # No counter moves until a collective is traced.
    with tf.init_scope():
      # Made directly, bypassing variable creator scopes: these belong to no
      # model and must never become distributed variables themselves.
      self._variables = [
          tuple(_counter(device, name, initial)
                for name, initial in (("launched", 0), ("completed", 0),
                                      ("last", -1)))
          for device in self.devices
      ]
    # Per graph: {replica: name of its last collective op there} (`_Order`).
    self._last_ops = weakref.WeakKeyDictionary()
    _WATCHDOG.watch(self)

  def draw(self, local_index, count, home_graph):
    """`count` `Launch`es for this replica, numbered in its program order.

    The counters are captured in `home_graph`, where strategy.run is traced:
    control-flow branches that capture an eager handle themselves can't be
    differentiated. Within a graph each increment and launch waits for the
    one before (`_Order`; across graphs TF's automatic control dependencies
    order them), and replicas run the same program, so the n-th launch of
    every replica draws the same number.
    """
    check_not_aborted()
    self.traced = True
    with home_graph.as_default():
      launched, completed, last = (home_graph.capture(v.handle)
                                   for v in self._variables[local_index])
    graph = tf.compat.v1.get_default_graph()
    order = _Order(graph, self._last_ops.setdefault(graph, {}), local_index)
    launches = []
    with tf.device(self.devices[local_index]):
      for _ in range(count):
        with order.after():
          increment = tf.raw_ops.AssignAddVariableOp(resource=launched,
                                                     value=1)
        with tf.control_dependencies([increment]):
          number = tf.raw_ops.ReadVariableOp(resource=launched,
                                             dtype=tf.int32)
        order.record(number)
        launches.append(Launch(number, completed, last, order))
    return launches

  @staticmethod
  def run(launch, description, collective):
    """`collective()`'s result, with the launch marked as `description` and completed."""
    with launch.order.after():
      mark = tf.raw_ops.AssignVariableOp(
          resource=launch.last, value=tf.constant(signature_code(description)))
    with tf.control_dependencies([mark]):
      result = collective()
    with tf.control_dependencies([result]):
      done = tf.raw_ops.AssignAddVariableOp(resource=launch.completed, value=1)
    with tf.control_dependencies([done]):
      result = tf.identity(result)
    launch.order.record(result)
    return result

  def read(self):
    """Per device: (launched, completed, description of the last launched)."""
    out = []
    for launched, completed, last in self._variables:
      out.append((int(launched.numpy()), int(completed.numpy()),
                  _describe(int(last.numpy()))))
    return out


def launches_between_workers():
  """How many graph collectives this process has launched among replicas of
  several workers so far: a launch per local device (a hierarchical
  reduction's one between workers counts once)."""
  return sum(launched for progress in _WATCHDOG.watched()
             if progress.spans_workers
             for launched, _, _ in progress.read())


def check_not_aborted():
  """Raises `tf.errors.CancelledError` with the report if collectives were aborted.

  TF aborts a process's collectives for good (a new strategy's too), so a
  later collective could only fail, without saying why.
  """
  reason = _WATCHDOG.aborted
  if reason is not None:
    raise tf.errors.CancelledError(
        None, None,
        "ReplicatorStrategy: this collective can't run: every collective of "
        "this process was aborted earlier, and TensorFlow keeps them aborted "
        "for the life of the process, whichever strategy launches them. "
        "Restart the process (fix the cause first) to run collectives again. "
        "The earlier abort:\n" + reason)


def _counter(device, name, initial):
  with tf.device(device):
    return tfi.resource_variable_ops.ResourceVariable(
        initial, dtype=tf.int32, trainable=False,
        name=f"replicator_collectives_{name}")


def waiting(description, timeout_seconds):
  """Context manager: aborts collectives if the block lasts over `timeout_seconds`.

  >>> with waiting("eager all_reduce across 2 workers", 120):
  ...   pass
  """
  return _WATCHDOG.waiting(description, timeout_seconds)


_ADVICE = (
    "A replica that waits while another waits in none, or in another "
    "collective, took a different path: a tf.cond or loop whose condition "
    "differs between replicas, or a worker that ran more steps than another "
    "(give every worker the same number of steps: the same dataset length and "
    "global batch size). A worker may also have stopped, or be slower than "
    "timeout_seconds allows: raise timeout_seconds if so.")


def stall_message(headline, report):
  """Why collectives were aborted: `report` says what this worker waits in.

  In a cluster, the other workers' reports are added as they come (each
  stalled worker sends its own), for `_EXCHANGE_SECONDS` at most.
  """
  lines = [headline, "On this worker:" if _workers else "Replicas:", report]
  for worker, peer_report in _reports_from_other_workers(report):
    lines += [f"On worker {worker}:",
              peer_report or "  no report: it stopped, or is not waiting in "
              "a collective"]
  return "\n".join(lines + [_ADVICE])


def _replica_lines(devices, states):
  lines = []
  for index, (device, (launched, completed, last)) in enumerate(
      zip(devices, states)):
    if launched > completed:
      lines.append(f"  replica {index} ({device}) waits in collective "
                   f"#{completed + 1}: {last}")
    else:
      lines.append(f"  replica {index} ({device}) completed its {completed} "
                   f"collectives and waits in none")
  return "\n".join(lines)


def _reports_from_other_workers(report):
  """[(worker, its report or None)]: what the other stalled workers wait in."""
  if not _workers:
    return []
  context = tfi.context.context()
  prefix = "replicator_stall/"
  try:
    context.set_config_key_value(prefix + str(_workers["index"]), report)
  except Exception:  # pylint: disable=broad-except
    return []  # The coordination service is gone: a peer died.
  deadline = time.monotonic() + _EXCHANGE_SECONDS
  reports = []
  for worker in range(_workers["count"]):
    if worker == _workers["index"]:
      continue
    try:
      reports.append((worker, context.get_config_key_value(
          prefix + str(worker),
          max(1, int((deadline - time.monotonic()) * 1000)))))
    except Exception:  # pylint: disable=broad-except
      reports.append((worker, None))
  return reports


def mismatch_message(what, states, devices):
  """Why collectives were aborted: local replicas called different ones."""
  lines = [f"  replica {index} ({device}): {last}"
           for index, (device, (_, _, last)) in enumerate(zip(devices, states))]
  return (
      f"ReplicatorStrategy: replicas called different collectives at the same "
      f"point ({what}, collective #{states[0][0]} of each):\n" +
      "\n".join(lines) + "\n"
      "Every replica must call the same collectives (op, dtype and shape) in "
      "the same order; a tf.cond whose branches call different collectives "
      "must take the same branch on every replica.")


def _mismatched(states):
  launched = {s[0] for s in states}
  pending = all(s[0] > s[1] for s in states)
  return (len(states) > 1 and pending and len(launched) == 1 and
          len({s[2] for s in states}) > 1)


class _Watchdog:
  """The thread; starts with the first `Progress` or `waiting`."""

  def __init__(self):
    self._lock = threading.Lock()
    self._sources = weakref.WeakKeyDictionary()  # Progress -> _Seen
    self._waits = {}
    self._wait_ids = itertools.count()
    self._thread = None
    self._stop = threading.Event()
    self.aborted = None

  def watch(self, progress):
    with self._lock:
      self._sources[progress] = _Seen()
      self._start()

  def watched(self):
    """Every `Progress` alive."""
    with self._lock:
      return list(self._sources)

  @contextlib.contextmanager
  def waiting(self, description, timeout_seconds):
    check_not_aborted()
    wait_id = next(self._wait_ids)
    with self._lock:
      self._waits[wait_id] = (time.monotonic() + timeout_seconds,
                              description, timeout_seconds)
      self._start()
    try:
      yield
    finally:
      with self._lock:
        del self._waits[wait_id]

  def _start(self):
    if self._thread is None:
      self._thread = threading.Thread(
          target=self._run, name="replicator-collective-watchdog",
          daemon=True)
      self._thread.start()
      atexit.register(self.stop)

  def stop(self):
    """Ends the thread (at exit, before TF's runtime goes)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()

  def _run(self):
    while not self._stop.wait(POLL_SECONDS) and self.aborted is None:
      reason = self._check(time.monotonic())
      if reason:
        self.aborted = reason
        tfi.context.context().abort_collective_ops(
            tf.errors.DEADLINE_EXCEEDED, reason)

  def _check(self, now):
    with self._lock:
      sources = list(self._sources.items())
      waits = list(self._waits.values())
    for deadline, description, timeout_seconds in waits:
      if now > deadline:
        return stall_message(
            f"ReplicatorStrategy: {description} did not finish within "
            f"{timeout_seconds} s (timeout_seconds), so every collective of "
            f"this process was aborted.", f"  waits in {description}")
    for progress, seen in sources:
      if not progress.traced:
        continue
      try:
        states = progress.read()
      except Exception:  # pylint: disable=broad-except
        continue  # Its variables are being deleted; nothing is pending there.
      reason = seen.update(progress, states, now)
      if reason:
        return reason
    return None


class _Seen:
  """What the watchdog last read from one `Progress`, and since when."""

  def __init__(self):
    self.states = None
    self.since = 0.0
    self.mismatch_polls = 0

  def update(self, progress, states, now):
    if states != self.states:
      self.states, self.since, self.mismatch_polls = states, now, 0
    if not any(launched > completed for launched, completed, _ in states):
      return None
    if _mismatched(states):
      self.mismatch_polls += 1
      if self.mismatch_polls >= _MISMATCH_POLLS:
        return mismatch_message(progress.what, states, progress.devices)
    if now - self.since > progress.timeout_seconds:
      return stall_message(
          f"ReplicatorStrategy: {progress.what} made no progress for "
          f"{progress.timeout_seconds} s (timeout_seconds), so every "
          f"collective of this process was aborted.",
          _replica_lines(progress.devices, states))
    return None


_WATCHDOG = _Watchdog()
