"""Starting TensorFlow's own multi-worker runtime: gRPC server and collectives.

Nothing here is home-made transport: this is the bring-up TensorFlow's
`MultiWorkerMirroredStrategy` performs (collective-ops configuration, the
coordination service, `enable_collective_ops` with a `ServerDef`), with every
wait bounded by one timeout so that a missing or dead worker fails the others
instead of hanging them: every task must register within it, and a task
whose heartbeats stop for half of it is reported by name to the others.

`ReplicatorStrategy()` calls `start(cluster, timeout_seconds)` once per
process, before any op, when `TF_CONFIG` (or a cluster resolver) names
several workers; a process that started it is a worker for good, so it has
no example here (tests/end_to_end/test_multi_worker.py starts real workers).

TensorFlow's gRPC runtime has no authentication: run it on a trusted network.
"""

import errno
import re
import socket

import tensorflow as tf

from replicator_strategy import _tf_internal as tfi
from replicator_strategy.cluster import preemption

_started = {}  # The one ServerDef this process was started with.


def start(cluster, timeout_seconds):
  """Starts this task's server; a second call for the same cluster is a no-op."""
  server_def = tf.train.ServerDef(
      cluster=cluster.spec.as_cluster_def(), job_name=cluster.task_type,
      task_index=cluster.task_index, protocol=cluster.rpc_layer)
  key = server_def.SerializeToString()
  if _started:
    if key not in _started:
      raise RuntimeError(
          "This process already joined a different cluster; TensorFlow's "
          "runtime joins one cluster per process. Create every "
          "ReplicatorStrategy of a process from the same TF_CONFIG or cluster "
          "resolver.")
    return
  context = tfi.context.context()
  chief = cluster.task_name_of(0)
  timeout_ms = int(timeout_seconds * 1000)
  try:
    context.configure_collective_ops(
        collective_leader=chief,
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(cluster.task_name,))
  except RuntimeError as e:
    raise RuntimeError(
        f"ReplicatorStrategy must join the cluster of {cluster.num_workers} "
        f"workers before TensorFlow starts its runtime ({e}). Create the "
        f"strategy at the start of the program, before any TensorFlow op, "
        f"dataset, variable or model (split_cpu may come first).") from e
  context.configure_coordination_service(
      service_type="standalone",
      service_leader=chief,
      cluster_register_timeout_in_ms=timeout_ms,
      heartbeat_timeout_in_ms=timeout_ms // 2,
      shutdown_barrier_timeout_in_ms=timeout_ms,
      coordinated_jobs=[
          tfi.coordination_config_pb2.CoordinatedJob(
              name=job, num_tasks=cluster.spec.num_tasks(job))
          for job in cluster.spec.jobs
      ])
  # Every task must register within the timeout, or all of them fail.
  tfi.require_registration_barrier(context)
  server_def.default_session_config.CopyFrom(context.config)
  _check_port_free(cluster)
  try:
    context.enable_collective_ops(server_def)
    context.ensure_initialized()
  except tf.errors.OpError as e:
    raise RuntimeError(
        f"{cluster.task_name} could not start the cluster of "
        f"{cluster.num_workers} workers ({', '.join(cluster.addresses)}) "
        f"within timeout_seconds={timeout_seconds}. Missing: "
        f"{_missing_tasks(e.message, cluster)}. Start every worker "
        f"with the same cluster in TF_CONFIG, each with its own task, or "
        f"raise timeout_seconds. TensorFlow said: {e.message}") from e
  _started[key] = cluster
  preemption.install(cluster, timeout_seconds)


def _check_port_free(cluster):
  """Fails naming the port if another process holds it.

  TF's server listens on every interface at the port of this task's address
  (whatever its host), and when it cannot, the others only see a task that
  never registers.
  """
  address = cluster.addresses[cluster.worker_index]
  port = int(address.rpartition(":")[2])
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    # As gRPC does, so that connections closing in TIME_WAIT do not count.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("0.0.0.0", port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # Not a port someone holds: TF reports it as it starts.
      raise RuntimeError(
          f"{cluster.task_name} cannot listen on port {port}, the port of its "
          f"address {address} in the cluster ({e.strerror}): another process "
          f"holds it. Stop that process (`ss -ltnp 'sport = :{port}'` names "
          f"it), or give this task a free port in TF_CONFIG or the cluster "
          f"resolver; the launcher picks free ports itself.") from e


def _missing_tasks(message, cluster):
  """The tasks TF's coordination service reports absent, else the chief."""
  listed = re.search(r"task names:\s*((?:/job:\w+/replica:\d+/task:\d+\s*)+)",
                     message)
  if listed:
    return ", ".join(listed.group(1).split())
  return (f"the chief, {cluster.task_name_of(0)} at {cluster.addresses[0]}, "
          f"did not answer")
