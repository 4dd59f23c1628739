"""A simulated slow link between the launcher's workers: `tc` on loopback.

    replicator-launch --workers 2 --link-rate 100mbit --link-delay 10 -- ...

The launcher's workers talk over the loopback of its private network
namespace; shaping that loopback (never the host's) makes every byte between
them cross one link of the given rate and delay. A token bucket (`tbf`) sets
the rate; `netem`, where the kernel has it, the delay, with the token bucket
as its child when both are asked. Every packet leaves through loopback once,
whichever way it goes, so the link is shared by both directions and by every
worker: a round trip pays the delay twice.
"""

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys

# tc's units (its man page, "RATES"), in bits per second: bit/bps and the SI
# (k, m, g, t) and IEC (ki, mi, gi, ti) prefixes; "bps" counts bytes.
_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(|k|m|g|t|ki|mi|gi|ti)"
                   r"(bit|bps)\s*$", re.IGNORECASE)
# Slower than this, a loopback packet (up to 64 KiB) takes seconds to cross:
# more likely a typo ("1bit" for "1gbit") than a link anyone trains over.
MIN_RATE_BITS = 100_000
# The bucket holds at least two of loopback's largest packets (MTU 65536: a
# packet larger than the bucket would never leave) and 4 ms at the rate, so
# that the kernel's timers keep up. The queue behind it holds a second at the
# rate, and at least 16 MiB, more than TCP keeps in flight on loopback: the
# link drops nothing (a drop there left TCP waiting out retransmission
# timeouts of seconds, a loss model nobody asked for).
_MIN_BURST_BYTES = 2 * 65536
_BURST_SECONDS = 0.004
_QUEUE_SECONDS = 1
_MIN_QUEUE_BYTES = 16 * 2**20
# netem's queue, in packets (its default, 1000, drops at high rates).
_NETEM_LIMIT = 100_000
# The launcher's exit status when it cannot shape the link: a usage error's,
# as argparse exits.
REFUSED = 2
_TC_PATH = os.pathsep.join(["/usr/sbin", "/sbin"])


def rate(text):
  """`--link-rate`: a tc-style rate ("100mbit", "1gbit") in bits per second.

  >>> rate("100mbit"), rate("1Gbit"), rate("2.5mbps")
  (100000000, 1000000000, 20000000)
  """
  match = _RATE.match(text)
  if not match:
    raise argparse.ArgumentTypeError(
        f"expected a rate with tc's units: a number, then bit, kbit, mbit, "
        f"gbit or tbit (bits per second; kibit etc. for powers of 2), or bps, "
        f"kbps, mbps, gbps (bytes per second), e.g. 100mbit or 1gbit. "
        f"Received: {text!r}")
  number, prefix, unit = match.groups()
  bits = float(number) * _PREFIXES[prefix.lower()] * (
      8 if unit.lower() == "bps" else 1)
  if bits < MIN_RATE_BITS:
    raise argparse.ArgumentTypeError(
        f"expected a rate of at least {MIN_RATE_BITS // 1000}kbit (a loopback "
        f"packet of 64 KiB would take seconds to cross a slower link). "
        f"Received: {text!r} ({bits:g} bits per second)")
  return round(bits)


def delay(text):
  """`--link-delay`: milliseconds each packet waits, more than 0.

  >>> delay("10"), delay("0.5")
  (10.0, 0.5)
  """
  try:
    ms = float(text)
  except ValueError:
    ms = float("nan")
  if not 0 < ms < float("inf"):
    raise argparse.ArgumentTypeError(
        f"expected milliseconds, a number more than 0, e.g. 10. Received: "
        f"{text!r}")
  return ms


def add_arguments(parser):
  parser.add_argument(
      "--link-rate", type=rate, metavar="RATE",
      help="simulate a link of this rate between the workers, e.g. 100mbit "
      "or 1gbit (tc's units): shapes the loopback of their private network, "
      "shared by every worker and both directions. Default: unlimited")
  parser.add_argument(
      "--link-delay", type=delay, metavar="MS",
      help="with it, each packet between the workers waits this many "
      "milliseconds (a round trip twice); needs the kernel's netem")


@dataclasses.dataclass(frozen=True)
class Link:
  """The shaping asked for: a rate in bits per second, a delay in ms."""
  rate_bits: int | None = None
  delay_ms: float | None = None

  def describe(self):
    """E.g. "100 Mbit/s, 10 ms delay"."""
    parts = []
    if self.rate_bits:
      value, unit = next((self.rate_bits / scale, unit) for scale, unit in (
          (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s"))
                         if self.rate_bits >= scale)
      parts.append(f"{value:g} {unit}")
    if self.delay_ms:
      parts.append(f"{self.delay_ms:g} ms delay")
    return ", ".join(parts)

  def qdiscs(self):
    """tc's arguments, one list per qdisc, root first."""
    root = ["qdisc", "add", "dev", "lo", "root", "handle", "1:"]
    qdiscs = []
    if self.delay_ms:
      qdiscs.append(root + ["netem", "delay", f"{self.delay_ms:g}ms", "limit",
                            str(_NETEM_LIMIT)])
    if self.rate_bits:
      burst = max(_MIN_BURST_BYTES,
                  round(self.rate_bits / 8 * _BURST_SECONDS))
      # Under netem, as its one child: delayed packets then queue for the
      # rate.
      where = (["qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:"]
               if qdiscs else root)
      queue = max(_MIN_QUEUE_BYTES,
                  round(self.rate_bits / 8 * _QUEUE_SECONDS))
      qdiscs.append(where + ["tbf", "rate", f"{self.rate_bits}bit", "burst",
                             str(burst), "limit", str(queue)])
    return qdiscs

  def shape(self):
    """Shapes this network namespace's loopback and says so; False, having
    said why, where it cannot."""
    problem = self._shape()
    if problem:
      refuse(problem)
      return False
    print(f"[launch] the workers' link: {self.describe()} (simulated on the "
          f"loopback of their network).", file=sys.stderr, flush=True)
    return True

  def _shape(self):
    """None, or what went wrong."""
    tc = shutil.which("tc", path=os.pathsep.join(
        [os.environ.get("PATH", ""), _TC_PATH]))
    if tc is None:
      return ("--link-rate and --link-delay need the `tc` command (package "
              "iproute2), which is not installed. Install it, or leave "
              "both out.")
    for qdisc in self.qdiscs():
      done = subprocess.run([tc] + qdisc, capture_output=True, text=True,
                            timeout=30, check=False)
      if done.returncode == 0:
        continue
      if "netem" in qdisc and "unknown" in done.stderr.lower():
        return ("--link-delay needs the kernel's netem queueing discipline "
                "(module sch_netem), which this kernel lacks. Load it on the "
                "host (`modprobe sch_netem`, as root), or leave out "
                "--link-delay: --link-rate alone works without it.")
      return (f"could not shape the workers' link: `tc {' '.join(qdisc)}` "
              f"failed: {done.stderr.strip()}")
    return None


def from_args(parser, args):
  """The `Link` that `args` ask for, or None; refuses it on the host's
  network, whose loopback the rest of the machine shares."""
  if args.link_rate is None and args.link_delay is None:
    return None
  if args.network == "host":
    parser.error("--link-rate and --link-delay shape the loopback of the "
                 "workers' private network and cannot be used with --network "
                 "host (they would slow the whole machine's loopback). Leave "
                 "out --network host.")
  return Link(args.link_rate, args.link_delay)


def no_namespace(refused):
  """What the launcher says when asked to shape without a namespace."""
  return (f"--link-rate and --link-delay need the workers' private network, "
          f"which the kernel refused ({refused}); nothing was run: the host's "
          f"loopback is never shaped. Run where user and network namespaces "
          f"are allowed, or leave both out.")


def refuse(message):
  """Says why the launcher stops before starting a worker; its exit status."""
  print(f"[launch] {message}", file=sys.stderr, flush=True)
  return REFUSED
