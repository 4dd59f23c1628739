"""The launcher's simulated link: `--link-rate` and `--link-delay` shape the
loopback of the workers' private network, and nothing else.

Workers here are small Python scripts on 127.0.0.1 (a sender and a receiver
process, or an echo), not TensorFlow programs.
"""

import contextlib
import io
import os
import shutil
import subprocess
import sys
import unittest
from unittest import mock

import pytest
from test_launch import launch

from replicator_strategy.cli import launch as launch_lib
from replicator_strategy.cli import link

# Sends MEGABYTES to a receiver process over 127.0.0.1 and prints the seconds
# from the first byte sent to the receiver's acknowledgement of the last, then
# the packets loopback's queue dropped.
TRANSFER = """
import os, re, shutil, socket, subprocess, sys, time
size = int(float(sys.argv[1]) * 1e6)
server = socket.create_server(("127.0.0.1", 0))
receiver = subprocess.Popen([sys.executable, "-c", '''
import socket, sys
size, got = int(sys.argv[2]), 0
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60) as s:
  while got < size:
    got += len(s.recv(1 << 20))
  s.sendall(b"k")
''', str(server.getsockname()[1]), str(size)])
connection, _ = server.accept()
connection.settimeout(60)
start = time.monotonic()
connection.sendall(b"x" * size)
assert connection.recv(1) == b"k"
print(f"seconds {time.monotonic() - start}", flush=True)
receiver.wait(timeout=60)
tc = shutil.which("tc", path=os.environ["PATH"] + ":/usr/sbin:/sbin")
stats = subprocess.run([tc, "-s", "qdisc", "show", "dev", "lo"], timeout=30,
                       capture_output=True, text=True, check=True).stdout
print(f"dropped {re.search('dropped ([0-9]+)', stats).group(1)}", flush=True)
"""

# Times round trips of one byte to an echo process over 127.0.0.1; prints the
# median in ms.
ROUND_TRIPS = """
import socket, statistics, subprocess, sys, time
server = socket.create_server(("127.0.0.1", 0))
echo = subprocess.Popen([sys.executable, "-c", '''
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60) as s:
  s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  while byte := s.recv(1):
    s.sendall(byte)
''', str(server.getsockname()[1])])
connection, _ = server.accept()
connection.settimeout(60)
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(10):
  start = time.monotonic()
  connection.sendall(b"p")
  assert connection.recv(1) == b"p"
  times.append(time.monotonic() - start)
connection.close()
echo.wait(timeout=60)
print(f"ms {statistics.median(times) * 1000}", flush=True)
"""


def _measured(done, name):
  """The number a worker printed after `name`."""
  lines = [line for line in done.stdout.splitlines() if f"] {name} " in line]
  assert lines, done.stdout + done.stderr
  return float(lines[-1].rsplit(" ", 1)[1])


def netem_available():
  """Whether this kernel lets a private network namespace use netem."""
  probe = ("import shutil, subprocess, sys\n"
           "from replicator_strategy.cli import launch\n"
           "if launch.isolate_network(): sys.exit(3)\n"
           "tc = shutil.which('tc', path='/usr/sbin:/sbin:/usr/bin:/bin')\n"
           "sys.exit(subprocess.run([tc, 'qdisc', 'add', 'dev', 'lo', 'root', "
           "'netem', 'delay', '1ms'], capture_output=True).returncode)")
  return subprocess.run([sys.executable, "-c", probe], timeout=60,
                        check=False).returncode == 0


def _shaping_possible():
  """A private namespace and `tc` (the launcher needs both to shape)."""
  probe = ("import sys\nfrom replicator_strategy.cli import launch\n"
           "sys.exit(1 if launch.isolate_network() else 0)")
  return (shutil.which("tc", path="/usr/sbin:/sbin:" + os.environ["PATH"])
          and subprocess.run([sys.executable, "-c", probe], timeout=60,
                             check=False).returncode == 0)


class RateTest(unittest.TestCase):

  def test_rates_take_tcs_units(self):
    for text, bits in [("100mbit", 100e6), ("1gbit", 1e9), ("10Mbit", 10e6),
                       ("1.5gbit", 1.5e9), ("512kibit", 512 * 1024),
                       ("1mbps", 8e6), ("250kbit", 250e3)]:
      self.assertEqual(link.rate(text), bits, text)

  def test_a_bad_rate_says_what_is_expected(self):
    for text, message in [("100", "expected a rate with tc's units"),
                          ("fast", "Received: 'fast'"),
                          ("100mb", "e.g. 100mbit or 1gbit"),
                          ("-1gbit", "Received: '-1gbit'"),
                          ("1bit", "at least 100kbit")]:
      done = launch("--workers", "1", f"--link-rate={text}", "--", "true")
      self.assertEqual(done.returncode, 2, text)
      self.assertIn("argument --link-rate: ", done.stderr)
      self.assertIn(message, done.stderr)

  def test_a_bad_delay_says_what_is_expected(self):
    for text in ("0", "-5", "soon", "inf"):
      done = launch("--workers", "1", f"--link-delay={text}", "--", "true")
      self.assertEqual(done.returncode, 2, text)
      self.assertIn(f"expected milliseconds, a number more than 0, e.g. 10. "
                    f"Received: '{text}'", done.stderr)

  def test_the_hosts_network_is_never_shaped(self):
    done = launch("--workers", "1", "--network", "host", "--link-rate",
                  "1gbit", "--", "true")
    self.assertEqual(done.returncode, 2)
    self.assertIn("cannot be used with --network host", done.stderr)

  def test_without_a_private_network_nothing_is_shaped_or_run(self):
    stderr = io.StringIO()
    with mock.patch.object(launch_lib, "isolate_network",
                           return_value="Operation not permitted"), \
        mock.patch.object(link.Link, "shape") as shape, \
        mock.patch.object(launch_lib, "run") as run, \
        contextlib.redirect_stderr(stderr):
      status = launch_lib.main(["--workers", "2", "--link-rate", "100mbit",
                                "--", "true"])
    self.assertEqual(status, 2)
    shape.assert_not_called()
    run.assert_not_called()
    self.assertIn("need the workers' private network, which the kernel "
                  "refused (Operation not permitted); nothing was run",
                  stderr.getvalue())

  def test_the_qdiscs_put_the_rate_under_the_delay(self):
    qdiscs = link.Link(rate_bits=100_000_000, delay_ms=10).qdiscs()
    self.assertEqual([q[:6] for q in qdiscs],
                     [["qdisc", "add", "dev", "lo", "root", "handle"],
                      ["qdisc", "add", "dev", "lo", "parent", "1:1"]])
    self.assertEqual(qdiscs[0][7:10], ["netem", "delay", "10ms"])
    self.assertEqual(qdiscs[1][8:11], ["tbf", "rate", "100000000bit"])
    tbf, = link.Link(rate_bits=1_000_000_000).qdiscs()
    # The bucket holds 4 ms at 1 Gbit/s, more than two 64 KiB packets.
    self.assertEqual(tbf[4:12], ["root", "handle", "1:", "tbf", "rate",
                                 "1000000000bit", "burst", "500000"])


@pytest.mark.slow
class ShapedLinkTest(unittest.TestCase):

  def setUp(self):
    if not _shaping_possible():
      self.fail("the launcher needs a private network namespace and tc here")

  def test_a_transfer_takes_as_long_as_the_rate_says(self):
    megabytes = 2.5  # 1 s at 20 Mbit/s.
    shaped = launch("--workers", "1", "--timeout", "60", "--link-rate",
                    "20mbit", "--", sys.executable, "-c", TRANSFER,
                    str(megabytes))
    self.assertEqual(shaped.returncode, 0, shaped.stderr)
    self.assertIn("[launch] the workers' link: 20 Mbit/s", shaped.stderr)
    unshaped = launch("--workers", "1", "--timeout", "60", "--", sys.executable,
                      "-c", TRANSFER, str(megabytes))
    self.assertEqual(unshaped.returncode, 0, unshaped.stderr)
    expected = megabytes * 8e6 / 20e6
    self.assertGreater(_measured(shaped, "seconds"), 0.8 * expected)
    self.assertLess(_measured(shaped, "seconds"), 2 * expected)
    self.assertLess(_measured(unshaped, "seconds"), 0.3 * expected)
    # A rate, not a lossy link: TCP never waits out a retransmission timeout.
    self.assertEqual(_measured(shaped, "dropped"), 0)

  def test_a_delay_adds_twice_itself_to_a_round_trip_or_says_why_not(self):
    done = launch("--workers", "1", "--timeout", "60", "--link-delay", "20",
                  "--", sys.executable, "-c", ROUND_TRIPS)
    if netem_available():
      self.assertEqual(done.returncode, 0, done.stderr)
      self.assertGreaterEqual(_measured(done, "ms"), 2 * 20)
    else:
      self.assertEqual(done.returncode, 2)
      self.assertIn("--link-delay needs the kernel's netem queueing "
                    "discipline (module sch_netem), which this kernel lacks",
                    done.stderr)
      self.assertNotIn("[worker 0]", done.stdout)


if __name__ == "__main__":
  unittest.main()
