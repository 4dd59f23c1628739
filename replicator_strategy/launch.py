"""Runs one training command as N local workers, each with its own TF_CONFIG.

    python -m replicator_strategy.launch --workers 2 -- python train.py --epochs 3

Every worker gets `TF_CONFIG` naming a cluster of N workers on 127.0.0.1 and
free ports, and its own task index (worker 0 is the chief). Each line a
worker prints comes out prefixed with `[worker i]`. When one worker fails,
the others are stopped and the launcher exits with the failed worker's
status; after `--timeout` seconds every worker is stopped and it exits 124.
Every process a worker started is stopped with it.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

_GRACE_SECONDS = 5
TIMEOUT_STATUS = 124


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


def _forward(stream, prefix, lock):
  for line in iter(stream.readline, b""):
    with lock:
      sys.stdout.buffer.write(prefix + line)
      sys.stdout.buffer.flush()
  stream.close()


def _stop(workers):
  """SIGTERM every worker's process group, then SIGKILL what remains."""
  for process in workers:
    if process.poll() is None:
      _signal_group(process, signal.SIGTERM)
  deadline = time.monotonic() + _GRACE_SECONDS
  for process in workers:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for process in workers:
    # Also reaches children a finished worker left behind.
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process, sig):
  try:
    os.killpg(process.pid, sig)
  except ProcessLookupError:
    pass


def run(command, num_workers, timeout=None):
  """Runs `command` as `num_workers` workers; returns the exit status."""
  addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
  lock = threading.Lock()
  workers, forwarders = [], []
  try:
    for index in range(num_workers):
      env = {**os.environ, "TF_CONFIG": tf_config(addresses, index)}
      process = subprocess.Popen(
          command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          start_new_session=True)
      workers.append(process)
      forwarder = threading.Thread(
          target=_forward, daemon=True,
          args=(process.stdout, f"[worker {index}] ".encode(), lock))
      forwarder.start()
      forwarders.append(forwarder)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      statuses = [p.poll() for p in workers]
      failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
      if failed:
        index, status = failed[0]
        print(f"[launch] worker {index} exited with status {status}; "
              f"stopping the others.", file=sys.stderr)
        return status
      if all(s == 0 for s in statuses):
        return 0
      if deadline is not None and time.monotonic() > deadline:
        print(f"[launch] timed out after {timeout} s; stopping every worker.",
              file=sys.stderr)
        return TIMEOUT_STATUS
      time.sleep(0.1)
  finally:
    _stop(workers)
    for forwarder in forwarders:
      forwarder.join(timeout=_GRACE_SECONDS)


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m replicator_strategy.launch",
      description="Run a training command as N local workers on 127.0.0.1, "
      "each with its own TF_CONFIG.",
      epilog="Example: python -m replicator_strategy.launch --workers 2 -- "
      "python train.py")
  parser.add_argument("--workers", type=int, required=True,
                      help="number of worker processes (at least 1)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="seconds before every worker is stopped "
                      f"(exit status {TIMEOUT_STATUS}); default: none")
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
  return run(command, args.workers, args.timeout)


if __name__ == "__main__":
  sys.exit(main())
