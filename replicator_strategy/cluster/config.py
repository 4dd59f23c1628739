"""Which cluster this process belongs to: `TF_CONFIG` or a cluster resolver, checked.

Every mistake a hand-written `TF_CONFIG` can hold is caught here, before any
server starts or any port is touched, with a message that says what to fix.

>>> os.environ["TF_CONFIG"] = json.dumps({
...     "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
...     "task": {"type": "worker", "index": 1}})
>>> cluster = from_environment()
>>> cluster.worker_index, cluster.num_workers, cluster.is_chief
(1, 2, False)

Tasks of type "chief" and "worker" train (the chief is worker 0; without a
chief, worker 0 is the chief). Other task types (parameter servers,
evaluators) are refused: ReplicatorStrategy has no use for them.
"""

import dataclasses
import json
import os

import tensorflow as tf

TRAINING_TASK_TYPES = ("chief", "worker")
_FIX = ('Expected TF_CONFIG like {"cluster": {"worker": ["host1:port", '
        '"host2:port"]}, "task": {"type": "worker", "index": 0}}')


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The training tasks and this process's place among them."""
  addresses: tuple  # Every training task's "host:port", chief first.
  task_type: str
  task_index: int
  spec: tf.train.ClusterSpec
  rpc_layer: str = "grpc"

  @property
  def num_workers(self):
    return len(self.addresses)

  @property
  def worker_index(self):
    """This task's position among the workers; 0 is the chief."""
    if self.task_type == "worker" and "chief" in self.spec.jobs:
      return self.task_index + 1
    return self.task_index

  @property
  def is_chief(self):
    return self.worker_index == 0

  @property
  def task_name(self):
    return f"/job:{self.task_type}/replica:0/task:{self.task_index}"

  def task_name_of(self, worker_index):
    """The TF task name of the worker at `worker_index`."""
    if "chief" in self.spec.jobs:
      if worker_index == 0:
        return "/job:chief/replica:0/task:0"
      return f"/job:worker/replica:0/task:{worker_index - 1}"
    return f"/job:worker/replica:0/task:{worker_index}"


def from_environment():
  """The cluster `TF_CONFIG` describes; None when it names one task or is unset."""
  raw = os.environ.get("TF_CONFIG", "")
  if not raw.strip():
    return None
  try:
    config = json.loads(raw)
  except ValueError as e:
    raise ValueError(f"TF_CONFIG is not valid JSON ({e}). {_FIX}. "
                     f"Received: TF_CONFIG={raw!r}") from e
  if not isinstance(config, dict):
    raise ValueError(f"TF_CONFIG must be a JSON object. {_FIX}. "
                     f"Received: TF_CONFIG={raw!r}")
  jobs = config.get("cluster") or {}
  task = config.get("task") or {}
  where = f"Received: TF_CONFIG={raw!r}"
  if not isinstance(jobs, dict) or not isinstance(task, dict):
    raise ValueError(f'TF_CONFIG\'s "cluster" and "task" must be JSON '
                     f"objects. {_FIX}. {where}")
  if sum(len(a) for a in jobs.values() if isinstance(a, list)) <= 1:
    _check_jobs(jobs, where)
    if jobs and task:
      _check_task(jobs, task.get("type"), task.get("index", 0), where)
    return None  # One task: a single machine, nothing to connect.
  if not task:
    raise ValueError(f'TF_CONFIG describes a cluster but has no "task" '
                     f"saying which task this process is. {_FIX}. {where}")
  return _validated(jobs, task.get("type"), task.get("index", 0),
                    config.get("rpc_layer", "grpc"), where)


def from_resolver(resolver):
  """The cluster a `tf.distribute.cluster_resolver.ClusterResolver` describes."""
  if not isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver):
    raise TypeError(
        f"Expected `cluster_resolver` to be a "
        f"tf.distribute.cluster_resolver.ClusterResolver. Received: "
        f"{resolver!r}")
  jobs = resolver.cluster_spec().as_dict()
  where = f"Received from {type(resolver).__name__}: cluster={jobs}"
  jobs = {job: (list(a.values()) if isinstance(a, dict) else list(a))
          for job, a in jobs.items()}
  if sum(len(a) for a in jobs.values()) <= 1:
    _check_jobs(jobs, where)
    if jobs and resolver.task_type is not None:
      _check_task(jobs, resolver.task_type, resolver.task_id, where)
    return None
  return _validated(jobs, resolver.task_type, resolver.task_id,
                    resolver.rpc_layer or "grpc", where)


def _check_jobs(jobs, where):
  for job, addresses in jobs.items():
    if job not in TRAINING_TASK_TYPES:
      raise ValueError(
          f"The cluster has a {job!r} task, which ReplicatorStrategy does not "
          f"use: every task trains, as a {' or '.join(TRAINING_TASK_TYPES)}. "
          f"Remove the {job!r} job (run evaluation on the chief or as a "
          f"separate program). {where}")
    if not isinstance(addresses, list) or not all(
        isinstance(a, str) for a in addresses):
      raise ValueError(f"The cluster's {job!r} job must be a list of "
                       f'"host:port" strings. {where}')
    for address in addresses:
      host, _, port = address.rpartition(":")
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Address {address!r} of the {job!r} job is not "
                         f'"host:port" with a port in 1-65535. {where}')
  if len(jobs.get("chief", [])) > 1:
    raise ValueError(f"The cluster has {len(jobs['chief'])} chiefs; it can "
                     f'have at most one ("chief" holds one address). {where}')


def _check_task(jobs, task_type, task_index, where):
  """This task's type is a job of `jobs`, its index an int within the job."""
  if task_type not in jobs:
    raise ValueError(
        f"This task's type {task_type!r} is not a job of the cluster "
        f"{sorted(jobs)}. Set TF_CONFIG's task type to one of them. {where}")
  size = len(jobs[task_type])
  indices = "index 0 only" if size == 1 else f"indices 0 to {size - 1}"
  if isinstance(task_index, bool) or not isinstance(task_index, int):
    unquoted = (f' Write it without quotes: "index": {int(task_index)}.'
                if isinstance(task_index, str) and task_index.isdigit() else
                "")
    raise ValueError(
        f"This task's index must be an int ({indices} for the "
        f"{task_type!r} job). Received: index={task_index!r}, a "
        f"{type(task_index).__name__}.{unquoted} {where}")
  if not 0 <= task_index < size:
    raise ValueError(
        f"This task's index {task_index} is out of range: the {task_type!r} "
        f"job has {size} task(s), {indices}. {where}")


def _validated(jobs, task_type, task_index, rpc_layer, where):
  _check_jobs(jobs, where)
  _check_task(jobs, task_type, task_index, where)
  addresses = tuple(jobs.get("chief", [])) + tuple(jobs.get("worker", []))
  seen = set()
  for address in addresses:
    if address in seen:
      raise ValueError(f"Address {address!r} is given to more than one task; "
                       f"every task needs its own host:port. {where}")
    seen.add(address)
  return Cluster(addresses=addresses, task_type=task_type,
                 task_index=task_index, spec=tf.train.ClusterSpec(jobs),
                 rpc_layer=rpc_layer)
