"""A worker's private scratch directories, removed at exit, also on a preemption.

Across workers every worker saves (reading distributed variables may take
part in collectives), but only the chief's files may land where the script
says: the others write here (`keras.chief_writes` for Keras files,
`preemption_checkpoint` for checkpoints). A worker killed outright (SIGKILL)
cannot clean up: the next worker process that makes a scratch directory
removes those of processes that no longer run.

>>> path = new_dir()   # under this process's scratch root
>>> os.path.isdir(path)
True
"""

import atexit
import functools
import glob
import os
import shutil
import tempfile

from replicator_strategy.cluster import preemption

_scratch_root = []
_SCRATCH_PREFIX = "replicator-worker-"


def new_dir():
  """A new directory in this process's scratch root, removed at exit."""
  if not _scratch_root:
    _remove_scratch_of_dead_processes()
    _scratch_root.append(
        tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-"))
    remove = functools.partial(shutil.rmtree, _scratch_root[0],
                               ignore_errors=True)
    atexit.register(remove)
    preemption.call_before_exit(remove)
  return tempfile.mkdtemp(dir=_scratch_root[0])


def _remove_scratch_of_dead_processes():
  """Scratch roots (named by PID) of this user's processes that were killed."""
  pattern = os.path.join(tempfile.gettempdir(), f"{_SCRATCH_PREFIX}*-*")
  for root in glob.glob(pattern):
    pid = os.path.basename(root)[len(_SCRATCH_PREFIX):].split("-")[0]
    try:
      ours = os.stat(root).st_uid == os.getuid()
    except FileNotFoundError:
      continue  # Removed meanwhile.
    if pid.isdigit() and ours and not _running(int(pid)):
      shutil.rmtree(root, ignore_errors=True)


def _running(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Another user's process: running.
  return True
