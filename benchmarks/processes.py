"""Child processes: one per replica count, fresh ones, and two workers.

A child is `python -m benchmarks --child section:spec` with the parent's
flags; it prints its result as JSON on its last line. The package's parent
folder goes on the child's PYTHONPATH, so that children find the package
from any working directory (the launcher starts workers in a temporary one).
--quick runs the children on the parent's own devices in the parent
(`child`): a quick run checks that every piece runs and agrees, not what a
fresh process measures, and each process it does not start saves the start
of TensorFlow and Keras (about 10 s of CPU).
"""

import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
  paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
      os.pathsep) if p]
  return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _command(options, kind, spec, devices=None, worker=False):
  # -X faulthandler: a child that crashes in native code (a SIGSEGV) prints
  # every thread's Python stack to its stderr, which `fresh` passes on.
  return ([sys.executable, "-X", "faulthandler", "-m", "benchmarks", "--child",
           f"{kind}:{spec}"] + options.child_flags(devices, worker))


def child(options, kind, run, spec=""):
  """The child `kind:spec`, which runs `run(options, spec)`; its result.

  In a fresh process; with --quick in this one, its result as a child
  would print it.
  """
  if options.quick:
    return json.loads(json.dumps(run(options, spec)))
  return fresh(options, kind, spec)


def fresh(options, kind, spec="", timeout=600):
  """Runs the child `kind:spec` in a fresh process; its JSON result.

  A child killed by a signal (a native crash inside TensorFlow, seen
  rarely under a loaded machine) is run once more, after its stacks and a
  line saying so go to stderr; a second failure raises with the child's
  last stderr lines, its stacks among them.
  """
  for attempt in (1, 2):
    done = subprocess.run(_command(options, kind, spec), capture_output=True,
                          text=True, timeout=timeout, env=_env())
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
      return json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode > 0 or attempt == 2:
      raise ChildFailed(kind, spec, done.returncode, done.stderr)
    print(f"benchmark child {kind}:{spec} died by signal {-done.returncode} "
          "(its stacks above); running it once more", file=sys.stderr)


class ChildFailed(RuntimeError):
  """A benchmark child that exited with an error; its stderr's end."""

  def __init__(self, kind, spec, returncode, stderr):
    super().__init__(
        f"benchmark child {kind}:{spec} failed with exit status {returncode}; "
        f"the end of its stderr:\n{stderr[-4000:]}")


def on_two_workers(options, kind, spec="", launcher_flags=()):
  """Runs the child `kind:spec` on 2 workers x 2 devices (under the
  launcher, with `launcher_flags` such as a `--link-rate`); each worker's
  JSON result."""
  with tempfile.TemporaryDirectory() as out:
    done = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.cli.launch", "--workers",
         "2", "--timeout", "500", "--output", "all", *launcher_flags, "--"] +
        _command(options, kind, spec, devices=2, worker=True),
        stdout=subprocess.PIPE, text=True, timeout=560, check=True, cwd=out,
        env=_env())
  lines = [line.split("] ", 1)[1] for line in done.stdout.splitlines()
           if line.startswith("[worker ") and
           line.split("] ", 1)[1].startswith("{")]
  return [json.loads(line) for line in lines]


def peak_rss_mb():
  """This process's peak resident memory so far."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
