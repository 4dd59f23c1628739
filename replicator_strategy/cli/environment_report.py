"""What this machine offers a ReplicatorStrategy, for a bug report or a pre-flight check.

    python -m replicator_strategy          # or: replicator-env

prints the versions (package, Python, TensorFlow, Keras), the devices
TensorFlow finds, what a default `ReplicatorStrategy()` would replicate over
and which all-reduce it would choose, and, when `TF_CONFIG` is set, whether
it is valid, this worker's port is free and every other worker's host
answers on its port (a closed port is fine: that worker has not started
yet). It exits 1 when something is wrong, so a job script can run it first.
TensorFlow is imported only after the arguments are read: `--help` answers at
once, without TensorFlow installed.

>>> check_address("127.0.0.1:1", own=False)  # Port 1: nothing listens.
('the host answers; nothing listens on port 1 yet (fine before the job starts)', 0)
"""

import argparse
import importlib.metadata
import os
import platform
import socket
import sys

CONNECT_SECONDS = 3.0


def check_address(address, own):
  """(a description of `address`, 1 if it is a problem else 0).

  A peer's host must answer a TCP connection at its port, accepting it or
  refusing it (its worker not started yet); this worker's own port (`own`)
  must be free to listen on, as TensorFlow's server listens there on every
  interface.
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")  # An IPv6 literal: "[::1]:2222".
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    return ("not host:port with a port in 1-65535; write it like "
            "'host1:2222'", 1)
  try:
    family, kind, proto, _, socket_address = socket.getaddrinfo(
        host, int(port), type=socket.SOCK_STREAM)[0]
  except socket.gaierror as e:
    return f"the host name does not resolve ({e.strerror})", 1
  if own:
    with socket.socket(family, kind, proto) as s:
      try:
        s.bind(("", int(port)) if family == socket.AF_INET else
               ("::", int(port)))
      except OSError as e:
        return (f"this worker; port {port} is taken ({e.strerror}): stop "
                f"what holds it or pick another port", 1)
    return f"this worker; port {port} is free", 0
  with socket.socket(family, kind, proto) as s:
    s.settimeout(CONNECT_SECONDS)
    try:
      s.connect(socket_address)
    except ConnectionRefusedError:
      return (f"the host answers; nothing listens on port {port} yet (fine "
              f"before the job starts)", 0)
    except TimeoutError:
      return (f"no answer within {CONNECT_SECONDS:g} s: the host is down, or "
              f"a firewall drops port {port}, which every worker must reach",
              1)
    except OSError as e:
      return f"unreachable ({e.strerror or e})", 1
  return "reachable: a worker listens there", 0


def _versions():
  keras_version = _installed("keras")
  lines = [f"replicator-strategy {_installed('replicator-strategy')}",
           f"Python {platform.python_version()} on {platform.platform()}",
           f"Keras {keras_version} (backend "
           f"{os.environ.get('KERAS_BACKEND', 'tensorflow')})"]
  return lines


def _installed(distribution):
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _tensorflow_and_devices():
  """Lines on TensorFlow, its devices and the default strategy; problems."""
  import replicator_strategy  # pylint: disable=g-import-not-at-top
  try:
    tf = replicator_strategy.check_tensorflow()
  except ImportError as e:
    return [f"TensorFlow: {e}"], 1
  # pylint: disable=g-import-not-at-top
  from replicator_strategy.collectives import all_reduce
  from replicator_strategy.cluster import config as cluster_lib
  from replicator_strategy import devices as devices_lib
  # pylint: enable=g-import-not-at-top
  build = tf.sysconfig.get_build_info()
  cuda = (f"CUDA {build.get('cuda_version')}, cuDNN "
          f"{build.get('cudnn_version')}" if build.get("is_cuda_build")
          else "no CUDA")
  lines = [f"TensorFlow {tf.__version__} ({cuda})"]
  physical = tf.config.list_physical_devices()
  lines.append("Devices: " + (", ".join(
      d.name.replace("/physical_device:", "") for d in physical) or "none"))
  try:
    cluster = cluster_lib.from_environment()
  except ValueError as e:
    return lines + [f"TF_CONFIG is invalid: {e}"], 1
  devices = devices_lib.local_devices()
  workers = cluster.num_workers if cluster else 1
  _, reason = all_reduce.choose(devices, "auto", num_workers=workers)
  replicas = len(devices) * workers
  lines.append(
      f"ReplicatorStrategy() here: {replicas} replica"
      f"{'s' if replicas > 1 else ''} ({len(devices)} on this worker: "
      f"{', '.join(d.split('device:')[-1] for d in devices)}"
      f"{f' x {workers} workers' if cluster else ''}); all-reduce {reason}")
  if devices_lib.is_lone_cpu(devices):
    lines.append("  (no GPU: replicator_strategy.split_cpu(n) before any "
                 "TensorFlow op gives n CPU replicas, for testing)")
  cluster_lines, problems = _cluster_lines(cluster)
  return lines + cluster_lines, problems


def _cluster_lines(cluster):
  if cluster is None:
    return ["TF_CONFIG: not set (or one task): this machine alone"], 0
  lines = [f"TF_CONFIG: {cluster.num_workers} workers; this is worker "
           f"{cluster.worker_index}{' (the chief)' if cluster.is_chief else ''}"]
  problems = 0
  for index, address in enumerate(cluster.addresses):
    said, problem = check_address(address,
                                  own=index == cluster.worker_index)
    problems += problem
    lines.append(f"  worker {index} {address}: {said}")
  return lines, problems


def report():
  """The report's lines and how many problems it found."""
  lines, problems = _tensorflow_and_devices()
  return _versions() + lines, problems


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m replicator_strategy",
      description="Print the environment for a bug report, and check it "
      "before a long job: versions, devices, what ReplicatorStrategy() would "
      "use here, and with TF_CONFIG set, whether every worker's address "
      "answers. Exits 1 if something is wrong.")
  parser.parse_args(argv)
  lines, problems = report()
  print("\n".join(lines))
  if problems:
    print(f"{problems} problem{'s' if problems > 1 else ''} found (above).")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
