"""Runs one training command as N local workers, each with its own TF_CONFIG.

    replicator-launch --workers 2 -- python train.py --epochs 3

Every worker gets `TF_CONFIG` naming a cluster of N workers on 127.0.0.1 and
free ports, and its own task index (worker 0 is the chief).

Output: each line a worker prints comes out prefixed with `[worker i]`, a
progress bar's carriage-return redraws as its final line. By default the
chief's output comes in full and the other workers' stderr (their warnings,
errors and tracebacks; their stdout repeats the chief's); `--output all`
shows everything. The launcher's own lines start with `[launch]`, the last
one a summary: workers, wall time, each worker's exit status. Workers get
`TF_CPP_MIN_LOG_LEVEL=2` (TensorFlow's C++ INFO and WARNING lines off, its
start-up lines too: see `tensorflow_logs`) unless it is set.

When one worker fails,
the others are stopped and the launcher exits with the failed worker's
status (128 + N for a worker killed by signal N); after `--timeout` seconds
every worker is stopped and it exits 124. Every process a worker started is
stopped with it.

Signals: SIGTERM, SIGINT and SIGHUP sent to the launcher are passed on to
every worker, which gets `--grace-period` seconds to save and exit before
SIGKILL; the launcher then exits 128 + the signal's number. A launcher that
dies without that chance (SIGKILL, a crash) still leaves no worker behind: a
small watchdog process stops every worker when the launcher's end of a pipe
closes.

Network: TensorFlow's server listens on every interface of its machine,
whatever address the cluster names (TF 2.21 hard-codes it). So by default
the launcher gives its workers a private network namespace whose only
interface is loopback: nothing outside the launcher can reach them, and
they reach nothing outside it either. `--network host` keeps the machine's
network (for a script that downloads data); where the kernel refuses a
private namespace, the launcher says so and runs on the host's network.
`--link-rate` and `--link-delay` shape that namespace's loopback into a
simulated slow link between the workers (see `link`).

Restarts: with `--max-restarts N`, a cluster in which a worker failed is
stopped and started again, all workers on fresh ports, up to N times. Each
worker reads which start it is from `REPLICATOR_RESTART_COUNT` (0 first).
A script that uses `keras.callbacks.BackupAndRestore` resumes from its last
backup.
"""

import argparse
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from replicator_strategy.cli import link as link_lib
from replicator_strategy.cli import tensorflow_logs
from replicator_strategy.cli import worker_output

_STOP_SECONDS = 5  # How long a worker stopped because another failed gets.
TIMEOUT_STATUS = 124
OUTPUT_CHIEF, OUTPUT_ALL = "chief", "all"
RESTART_COUNT_ENV = "REPLICATOR_RESTART_COUNT"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# Runs apart from the launcher, in its own session. The launcher writes "+PID"
# for each worker it starts and "-PID" once that worker's process group is
# gone; when the launcher's end of the pipe closes (it exited or was killed),
# every group still listed gets SIGTERM, then SIGKILL after the grace period.
# Plain Python without imports of ours, so that it starts in milliseconds.
_WATCHDOG = """
import os, signal, sys, time
grace, groups = float(sys.argv[1]), set()
for line in sys.stdin:
  (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
def alive(group):
  try:
    os.killpg(group, 0)
    return True
  except (ProcessLookupError, PermissionError):
    return False
for group in groups:
  if alive(group):
    os.killpg(group, signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and any(alive(g) for g in groups):
  time.sleep(0.1)
for group in groups:
  if alive(group):
    os.killpg(group, signal.SIGKILL)
"""


_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network():
  """Moves this process into a network namespace of its own, loopback up.

  Children inherit it. Unprivileged users get a user namespace too, with
  their own uid and gid mapped to themselves. Returns None, or why the kernel
  refused (no user namespaces, a seccomp filter, not Linux).
  """
  flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
  uid, gid = os.geteuid(), os.getegid()
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
      return os.strerror(ctypes.get_errno())
    if flags & _CLONE_NEWUSER:
      for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                         ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
          f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      request = struct.pack("16sH14x", b"lo", 0)
      current = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS,
                                                     request))[1]
      fcntl.ioctl(s, _SIOCSIFFLAGS,
                  struct.pack("16sH14x", b"lo", current | _IFF_UP))
  except (OSError, AttributeError) as e:
    return str(e)
  return None


def free_ports(count):
  """`count` distinct free TCP ports on 127.0.0.1."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def tf_config(addresses, index):
  return json.dumps({"cluster": {"worker": addresses},
                     "task": {"type": "worker", "index": index}})


def exit_status(returncode):
  """A shell's exit status: 128 + N for a process killed by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def _how_it_ended(returncode):
  if returncode < 0:
    return f"was killed by {signal.Signals(-returncode).name}"
  return f"exited with status {returncode}"


def _signal_group(process, sig):
  try:
    os.killpg(process.pid, sig)
  except ProcessLookupError:
    pass


def _stop(workers, grace, sig=signal.SIGTERM):
  """`sig` to every worker's process group, then SIGKILL what remains.

  With `sig=None` the workers already got a signal: they only get the grace
  period to end.
  """
  for process in workers:
    if sig is not None and process.poll() is None:
      _signal_group(process, sig)
  _wait(workers, grace)
  for process in workers:
    # Also reaches children a finished worker left behind.
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _wait(workers, seconds):
  deadline = time.monotonic() + seconds
  for process in workers:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass


class _Signals:
  """Passes SIGTERM, SIGINT and SIGHUP on to the workers; remembers the first."""

  def __init__(self, console):
    self.received = None
    self.workers = []
    self._console = console
    self._previous = {}

  def __enter__(self):
    for sig in FORWARDED_SIGNALS:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, sig, frame):
    del frame
    if self.received is None:
      self.received = sig
      self._console.say(f"received {signal.Signals(sig).name}; passing it on "
                        f"to every worker.")
    for process in self.workers:
      _signal_group(process, sig)


class _Launch:
  """One cluster of local workers: its first start and any restarts."""

  def __init__(self, command, num_workers, timeout, grace_period, signals,
               console, output):
    self.command = command
    self.num_workers = num_workers
    self.console = console
    self.output = output
    self.statuses = []  # Each worker's exit status, after the last start.
    self.timeout = timeout
    self.deadline = None if timeout is None else time.monotonic() + timeout
    self.grace_period = grace_period
    self.signals = signals
    self.watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(grace_period)],
        stdin=subprocess.PIPE, text=True, start_new_session=True)

  def close(self):
    try:
      self.watchdog.stdin.close()  # Every group is gone: it exits at once.
    except BrokenPipeError:
      pass  # It was killed; nothing is left for it to do.
    self.watchdog.wait()

  def _tell_watchdog(self, line):
    try:
      self.watchdog.stdin.write(line + "\n")
      self.watchdog.stdin.flush()
    except BrokenPipeError:
      # Someone killed it: the launcher still stops its workers itself, it
      # only can no longer do so if it is killed outright too.
      self.console.say("the watchdog process is gone.")

  def run_once(self, restart):
    """One start of the cluster; (exit status, whether a restart may help)."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(self.num_workers)]
    workers, forwarders = [], []
    self.signals.workers = workers
    try:
      for index in range(self.num_workers):
        env = {tensorflow_logs.LEVEL_ENV: tensorflow_logs.QUIET_LEVEL,
               **os.environ, "TF_CONFIG": tf_config(addresses, index),
               RESTART_COUNT_ENV: str(restart)}
        process = subprocess.Popen(
            self.command, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        workers.append(process)
        self._tell_watchdog(f"+{process.pid}")
        prefix = f"[worker {index}] ".encode()
        for name in ("stdout", "stderr"):
          # The other workers' stdout repeats the chief's (same program,
          # same global logs); their stderr has what went wrong.
          shown = (index == 0 or name == "stderr" or
                   self.output == OUTPUT_ALL)
          forwarder = threading.Thread(
              target=worker_output.forward, daemon=True,
              args=(getattr(process, name), prefix, self.console, name,
                    shown, self._keep(env)))
          forwarder.start()
          forwarders.append(forwarder)
      return self._watch(workers)
    finally:
      if self.signals.received is None:
        _stop(workers, _STOP_SECONDS)
      else:
        _stop(workers, self.grace_period, sig=None)  # Forwarded already.
      for process in workers:
        self._tell_watchdog(f"-{process.pid}")
      for forwarder in forwarders:
        forwarder.join(timeout=_STOP_SECONDS)
      self.statuses = [exit_status(p.returncode) for p in workers]

  @staticmethod
  def _keep(env):
    if not tensorflow_logs.info_hidden(env):
      return lambda line: True
    return lambda line: not tensorflow_logs.is_start_up_info(line)

  def _watch(self, workers):
    while True:
      if self.signals.received is not None:
        return 128 + self.signals.received, False
      statuses = [p.poll() for p in workers]
      failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
      if failed:
        # A worker that lost a peer exits with an error soon after it: when
        # one poll finds both gone, the one a signal killed is the cause.
        failed.sort(key=lambda failure: (failure[1] > 0, failure[0]))
        self.console.say("; ".join(
            f"worker {index} {_how_it_ended(returncode)}"
            for index, returncode in failed) + "; stopping the others.")
        return exit_status(failed[0][1]), True
      if all(s == 0 for s in statuses):
        return 0, False
      if self.deadline is not None and time.monotonic() > self.deadline:
        self.console.say(f"timed out after {self.timeout} s; stopping every "
                         f"worker.")
        return TIMEOUT_STATUS, False
      time.sleep(0.1)


def run(command, num_workers, timeout=None, max_restarts=0, grace_period=25,
        output=OUTPUT_CHIEF):
  """Runs `command` as `num_workers` workers; returns the exit status.

  `timeout` bounds the whole run, restarts included. `output`: "chief"
  shows worker 0's output in full and the others' stderr, "all" everything.
  Ends with a summary line: workers, starts, wall time, exit statuses.
  """
  console = worker_output.Console(sys.stdout.buffer, sys.stderr.buffer,
                    live=sys.stdout.isatty())
  start = time.monotonic()
  with _Signals(console) as signals:
    launch = _Launch(command, num_workers, timeout, grace_period, signals,
                     console, output)
    restart = 0
    try:
      while True:
        status, may_restart = launch.run_once(restart)
        if (not may_restart or restart >= max_restarts or
            signals.received is not None):
          break
        restart += 1
        console.say(f"restarting every worker on fresh ports (restart "
                    f"{restart} of at most {max_restarts}).")
    finally:
      launch.close()
    statuses = ", ".join(f"worker {i}: {s}"
                         for i, s in enumerate(launch.statuses))
    starts = f", {restart + 1} starts" if restart else ""
    console.say(f"{num_workers} worker{'s' if num_workers > 1 else ''}"
                f"{starts}, {time.monotonic() - start:.1f} s; exit status "
                f"{status} ({statuses}).")
  return status


def invoked_as(script=None):
  """The command as the user typed it, for the usage line.

  `python -m replicator_strategy.cli.launch` runs this file as `script`
  (sys.argv[0]); the console script is `replicator-launch`.

  >>> invoked_as("/usr/local/bin/replicator-launch")
  'replicator-launch'
  >>> invoked_as(__file__)
  'python -m replicator_strategy.cli.launch'
  """
  script = sys.argv[0] if script is None else script
  if os.path.abspath(script) == os.path.abspath(__file__):
    return "python -m replicator_strategy.cli.launch"
  return os.path.basename(script) or "replicator-launch"


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog=invoked_as(),
      description="Run a training command as N local workers on 127.0.0.1, "
      "each with its own TF_CONFIG.",
      epilog="Example: replicator-launch --workers 2 -- "
      "python train.py")
  parser.add_argument("--workers", type=int, required=True,
                      help="number of worker processes (at least 1)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="seconds before every worker is stopped "
                      f"(exit status {TIMEOUT_STATUS}), restarts included; "
                      "default: none")
  parser.add_argument("--max-restarts", type=int, default=0,
                      help="when a worker fails, restart every worker up to "
                      f"this many times; each reads {RESTART_COUNT_ENV}. "
                      "Default: 0")
  parser.add_argument("--grace-period", type=float, default=25,
                      help="seconds the workers get to save and exit after a "
                      "signal to the launcher, before SIGKILL. Default: 25")
  parser.add_argument("--network", choices=("private", "host"),
                      default="private",
                      help="private (default): the workers get a network of "
                      "their own with loopback only, unreachable from outside "
                      "(TensorFlow's server listens on every interface); "
                      "host: the machine's network, for scripts that "
                      "download data")
  parser.add_argument("--output", choices=(OUTPUT_CHIEF, OUTPUT_ALL),
                      default=OUTPUT_CHIEF,
                      help="chief (default): worker 0's output in full and the "
                      "other workers' stderr (warnings, errors, tracebacks); "
                      "all: every worker's output in full. Either way each "
                      "line is prefixed [worker i] and a progress bar's "
                      "redraws come out as its final line")
  link_lib.add_arguments(parser)
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="the command each worker runs, after `--`")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if args.workers < 1:
    parser.error(f"--workers must be at least 1. Received: {args.workers}")
  if not command:
    parser.error("no command given. Put it after `--`, e.g. "
                 "`--workers 2 -- python train.py`.")
  if args.timeout is not None and args.timeout <= 0:
    parser.error(f"--timeout must be positive. Received: {args.timeout}")
  if args.max_restarts < 0:
    parser.error(f"--max-restarts must be 0 or more. Received: "
                 f"{args.max_restarts}")
  if args.grace_period < 0:
    parser.error(f"--grace-period must be 0 or more. Received: "
                 f"{args.grace_period}")
  link = link_lib.from_args(parser, args)
  if args.network == "private":
    refused = isolate_network()
    if refused and link:
      return link_lib.refuse(link_lib.no_namespace(refused))
    if refused:
      print(f"[launch] could not give the workers a private network "
            f"({refused}); they run on the host's network, where "
            f"TensorFlow's server listens on every interface. Use "
            f"--network host to silence this.", file=sys.stderr, flush=True)
  if link and not link.shape():
    return link_lib.REFUSED
  return run(command, args.workers, args.timeout, args.max_restarts,
             args.grace_period, args.output)


if __name__ == "__main__":
  sys.exit(main())
