"""`python -m replicator_strategy`: versions, devices, the default strategy, TF_CONFIG checked."""

import json
import os
import socket
import subprocess
import sys
import unittest
from unittest import mock

import pytest

from replicator_strategy.cli import environment_report
from replicator_strategy.cli import launch


def tf_config(addresses, index=0):
  return {"TF_CONFIG": launch.tf_config(addresses, index)}


class EnvironmentReportTest(unittest.TestCase):

  @pytest.mark.slow
  def test_the_command_prints_versions_devices_and_the_default_strategy(self):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run([sys.executable, "-m", "replicator_strategy"],
                          capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
    for expected in ("replicator-strategy 0.1.0", "TensorFlow 2.21.",
                     "Keras 3.", "Devices: CPU:0",
                     "ReplicatorStrategy() here: 1 replica (1 on this worker: "
                     "CPU:0); all-reduce add_on_one_device",
                     "split_cpu(n)", "TF_CONFIG: not set"):
      self.assertIn(expected, done.stdout)

  def test_every_worker_address_is_checked(self):
    # This worker's port; a peer that listens; one not started (its port is
    # closed); one whose host does not answer: its listen queue is full, so
    # the kernel drops new connections, as a firewall would.
    own, listening, closed, silent = launch.free_ports(4)
    with socket.socket() as peer, socket.socket() as full, \
        socket.socket() as queued:
      peer.bind(("127.0.0.1", listening))
      peer.listen()
      full.bind(("127.0.0.1", silent))
      full.listen(0)
      queued.connect(("127.0.0.1", silent))
      addresses = [f"127.0.0.1:{p}" for p in (own, listening, closed, silent)]
      with mock.patch.dict(os.environ, tf_config(addresses)), \
          mock.patch.object(environment_report, "CONNECT_SECONDS", 0.5):
        lines, problems = environment_report.report()
    text = "\n".join(lines)
    self.assertEqual(problems, 1, text)
    self.assertIn("ReplicatorStrategy() here: 16 replicas (4 on this worker: "
                  "CPU:0, CPU:1, CPU:2, CPU:3 x 4 workers); all-reduce ring",
                  text)
    self.assertIn("TF_CONFIG: 4 workers; this is worker 0 (the chief)", text)
    self.assertEqual(lines[-4:], [
        f"  worker 0 127.0.0.1:{own}: this worker; port {own} is free",
        f"  worker 1 127.0.0.1:{listening}: reachable: a worker listens there",
        f"  worker 2 127.0.0.1:{closed}: the host answers; nothing listens on "
        f"port {closed} yet (fine before the job starts)",
        f"  worker 3 127.0.0.1:{silent}: no answer within 0.5 s: the host is "
        f"down, or a firewall drops port {silent}, which every worker must "
        f"reach"])

  def test_a_taken_port_and_an_invalid_tf_config_are_problems(self):
    with socket.socket() as taken:
      taken.bind(("", 0))
      port = taken.getsockname()[1]
      own_port_taken = tf_config([f"127.0.0.1:{port}", "127.0.0.1:1"])
      with mock.patch.dict(os.environ, own_port_taken):
        lines, problems = environment_report.report()
    self.assertEqual(problems, 1)
    self.assertIn(f"port {port} is taken", "\n".join(lines))
    no_port = {"TF_CONFIG": json.dumps({
        "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1"]},
        "task": {"type": "worker", "index": 0}})}
    with mock.patch.dict(os.environ, no_port):
      lines, problems = environment_report.report()
    self.assertEqual(problems, 1)
    self.assertIn("TF_CONFIG is invalid: Address '127.0.0.1'", lines[-1])

  def test_malformed_and_unresolvable_addresses(self):
    self.assertEqual(environment_report.check_address("127.0.0.1:99999",
                                                      own=False)[1], 1)
    said, problem = environment_report.check_address("no-such-host.invalid:22",
                                                     own=False)
    self.assertEqual((problem, said.startswith("the host name does not "
                                               "resolve")), (1, True))


if __name__ == "__main__":
  unittest.main()
