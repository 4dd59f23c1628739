"""The local multi-worker launcher: TF_CONFIG, prefixes, failing fast, clean-up.

Workers here are small Python scripts, not TensorFlow programs, so the tests
check the launcher alone and run in seconds.
"""

import json
import os
import pathlib
import pty
import signal
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCH = [sys.executable, "-m", "replicator_strategy.cli.launch"]


def launch(*args, timeout=120, env=None):
  return subprocess.run(LAUNCH + list(args), capture_output=True, text=True,
                        timeout=timeout, check=False,
                        env={**os.environ, **(env or {})})


def read_terminal(fd):
  """What a program wrote to a pseudo-terminal; b"" once it is closed."""
  try:
    return os.read(fd, 4096)
  except OSError:  # EIO: every writer closed it.
    return b""


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie not yet reaped by init counts as gone.
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return not (stat.exists() and stat.read_text().split()[2] == "Z")


def wait_for(condition, seconds=20):
  deadline = time.monotonic() + seconds
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"still false after {seconds} s: {condition}")
    time.sleep(0.05)


# Each worker writes "PID CHILD_PID" to pids<i> once both run, then sleeps;
# on SIGTERM it writes term<i> and exits 143 (unless told to ignore SIGTERM).
SLEEPER = """
import json, os, pathlib, signal, subprocess, sys, time
out, ignore = pathlib.Path(sys.argv[1]), sys.argv[2] == "ignore"
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
def on_term(sig, frame):
  (out / f"term{i}").touch()
  sys.exit(143)
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_term)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(out / f"pids{i}.tmp").write_text(f"{os.getpid()} {child.pid}")
(out / f"pids{i}.tmp").rename(out / f"pids{i}")
time.sleep(120)
"""


def start_sleepers(out, num_workers=2, ignore_sigterm=False, grace="5"):
  """The launcher running SLEEPER workers; returns it and every worker's pids."""
  # Restarts are allowed, to show that a signalled launcher does not restart.
  launcher = subprocess.Popen(
      LAUNCH + ["--workers", str(num_workers), "--grace-period", grace,
                "--max-restarts", "2", "--",
                sys.executable, "-c", SLEEPER, out,
                "ignore" if ignore_sigterm else "handle"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  files = [pathlib.Path(out, f"pids{i}") for i in range(num_workers)]
  wait_for(lambda: all(f.exists() for f in files))
  return launcher, [int(p) for f in files for p in f.read_text().split()]


# Two epochs of a progress bar written as Keras's `Progbar` writes it (its
# dynamic display, on in any POSIX process): backspaces over the previous
# state, a carriage return, the new state; a newline ends the epoch. Then a
# line on stdout and a warning on stderr. First, on stderr, one of the INFO
# lines TensorFlow logs when imported, whatever TF_CPP_MIN_LOG_LEVEL says.
PROGRESS_BARS = r"""
import json, os, sys, time
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print("I0000 00:00:1795517664.615734  9522 port.cc:153] oneDNN custom "
      "operations are on.", file=sys.stderr)
for epoch in (1, 2):
  width = 0
  for step in (1, 2, 3):
    state = f"{step}/3 ━━━━ 0s 5ms/step - loss: {epoch + step / 10:.1f}"
    sys.stdout.write("\b" * width + "\r" + state)
    sys.stdout.flush()
    width = len(state)
    time.sleep(0.2)  # Time for the launcher to read each redraw.
  sys.stdout.write("\n")
print(f"trained on worker {i}", flush=True)
print(f"UserWarning: worker {i} warns", file=sys.stderr)
"""
SUMMARY = (r"^\[launch\] {workers} workers, \d+\.\d s; exit status {status} "
           r"\({statuses}\)\.$")


class LaunchTest(unittest.TestCase):

  def test_progress_bars_show_the_chief_in_full_and_the_others_warnings(self):
    done = launch("--workers", "2", "--", sys.executable, "-c", PROGRESS_BARS,
                  env={"TF_CPP_MIN_LOG_LEVEL": "1"})
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertEqual(done.stdout.splitlines(), [
        "[worker 0] 3/3 ━━━━ 0s 5ms/step - loss: 1.3",
        "[worker 0] 3/3 ━━━━ 0s 5ms/step - loss: 2.3",
        "[worker 0] trained on worker 0"])
    stderr = done.stderr.splitlines()
    self.assertEqual(sorted(stderr[:-1]),
                     ["[worker 0] UserWarning: worker 0 warns",
                      "[worker 1] UserWarning: worker 1 warns"])
    self.assertRegex(stderr[-1], SUMMARY.format(
        workers=2, status=0, statuses="worker 0: 0, worker 1: 0"))

  def test_on_a_terminal_a_progress_bar_redraws_on_one_status_line(self):
    terminal, launcher_end = pty.openpty()
    with subprocess.Popen(
        LAUNCH + ["--workers", "2", "--", sys.executable, "-c",
                  PROGRESS_BARS], stdout=launcher_end,
        stderr=subprocess.DEVNULL) as launcher:
      os.close(launcher_end)
      shown = b""
      while chunk := read_terminal(terminal):
        shown += chunk
      self.assertEqual(launcher.wait(timeout=60), 0)
    os.close(terminal)
    shown = shown.decode()
    clear = "\r\x1b[K"  # Back to the line's start, and erase it.
    for step in (1, 2, 3):
      self.assertIn(
          f"{clear}[worker 0] {step}/3 ━━━━ 0s 5ms/step - loss: 2.{step}", shown)
    self.assertTrue(shown.endswith(
        f"{clear}[worker 0] 3/3 ━━━━ 0s 5ms/step - loss: 2.3\r\n"
        f"[worker 0] trained on worker 0\r\n"), repr(shown[-300:]))
    self.assertNotIn("[worker 1]", shown)

  def test_output_all_shows_every_workers_lines_each_with_its_prefix(self):
    done = launch("--workers", "2", "--output", "all", "--", sys.executable,
                  "-c", PROGRESS_BARS, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertEqual(done.stderr.count("port.cc:153] oneDNN"), 2, done.stderr)
    for i in range(2):
      mine = [line for line in done.stdout.splitlines()
              if line.startswith(f"[worker {i}] ")]
      self.assertEqual(mine, [
          f"[worker {i}] 3/3 ━━━━ 0s 5ms/step - loss: 1.3",
          f"[worker {i}] 3/3 ━━━━ 0s 5ms/step - loss: 2.3",
          f"[worker {i}] trained on worker {i}"])
    self.assertEqual(len(done.stdout.splitlines()), 6, done.stdout)

  def test_each_worker_gets_its_tf_config_and_a_prefix(self):
    script = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
              "print(json.dumps(c))")
    done = launch("--workers", "3", "--output", "all", "--", sys.executable,
                  "-c", script)
    self.assertEqual(done.returncode, 0, done.stderr)
    configs = {}
    for line in done.stdout.splitlines():
      prefix, _, payload = line.partition("] ")
      configs[prefix + "]"] = json.loads(payload)
    self.assertEqual(sorted(configs), [f"[worker {i}]" for i in range(3)])
    cluster = configs["[worker 0]"]["cluster"]["worker"]
    self.assertEqual(len(set(cluster)), 3)
    for i in range(3):
      config = configs[f"[worker {i}]"]
      self.assertEqual(config["cluster"]["worker"], cluster)
      self.assertEqual(config["task"], {"type": "worker", "index": i})
    for address in cluster:
      host, port = address.split(":")
      self.assertEqual(host, "127.0.0.1")
      self.assertGreater(int(port), 0)

  def test_a_failing_worker_stops_the_others_and_their_children(self):
    with tempfile.TemporaryDirectory() as tmp:
      script = (
          "import json, os, subprocess, sys, time\n"
          "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
          "child = subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(120)'])\n"
          f"open(os.path.join({tmp!r}, f'pids{{i}}'), 'w').write("
          "f'{os.getpid()} {child.pid}')\n"
          "if i == 1:\n"
          "  time.sleep(1)\n"
          "  sys.exit(3)\n"
          "time.sleep(120)\n")
      start = time.monotonic()
      done = launch("--workers", "2", "--", sys.executable, "-c", script)
      self.assertLess(time.monotonic() - start, 60)
      self.assertEqual(done.returncode, 3, done.stderr)
      self.assertIn("worker 1 exited with status 3", done.stderr)
      self.assertRegex(done.stderr.splitlines()[-1], SUMMARY.format(
          workers=2, status=3, statuses="worker 0: 143, worker 1: 3"))
      pids = [int(p) for i in range(2)
              for p in pathlib.Path(tmp, f"pids{i}").read_text().split()]
    time.sleep(0.5)
    self.assertEqual([p for p in pids if alive(p)], [])

  def test_timeout_stops_every_worker(self):
    done = launch("--workers", "2", "--timeout", "2", "--", sys.executable,
                  "-c", "import time; time.sleep(120)")
    self.assertEqual(done.returncode, 124, done.stderr)
    self.assertIn("timed out after 2.0 s", done.stderr)

  def test_sigterm_to_the_launcher_reaches_every_worker_and_ends_them_all(
      self):
    with tempfile.TemporaryDirectory() as out:
      launcher, pids = start_sleepers(out)
      start = time.monotonic()
      launcher.send_signal(signal.SIGTERM)
      _, stderr = launcher.communicate(timeout=30)
      seconds = time.monotonic() - start
      self.assertEqual(launcher.returncode, 128 + signal.SIGTERM, stderr)
      self.assertIn("received SIGTERM; passing it on to every worker", stderr)
      self.assertNotIn("restarting", stderr)
      self.assertEqual(sorted(os.listdir(out)),
                       ["pids0", "pids1", "term0", "term1"])
    self.assertLess(seconds, 10)
    wait_for(lambda: not any(alive(p) for p in pids), seconds=5)

  def test_sighup_and_sigint_are_passed_on_too(self):
    for sig in (signal.SIGHUP, signal.SIGINT):
      with tempfile.TemporaryDirectory() as out:
        launcher, pids = start_sleepers(out, num_workers=1)
        launcher.send_signal(sig)
        launcher.communicate(timeout=30)
        self.assertEqual(launcher.returncode, 128 + sig)
      # Called before the loop moves on, so `pids` is this iteration's.
      wait_for(lambda: not any(alive(p) for p in pids), seconds=5)  # noqa: B023

  def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(self):
    with tempfile.TemporaryDirectory() as out:
      launcher, pids = start_sleepers(out, ignore_sigterm=True, grace="1")
      start = time.monotonic()
      launcher.send_signal(signal.SIGTERM)
      launcher.communicate(timeout=30)
    self.assertEqual(launcher.returncode, 128 + signal.SIGTERM)
    self.assertLess(time.monotonic() - start, 1 + 3)
    wait_for(lambda: not any(alive(p) for p in pids), seconds=5)

  def test_a_killed_launcher_leaves_no_worker_and_no_child_behind(self):
    with tempfile.TemporaryDirectory() as out:
      launcher, pids = start_sleepers(out, ignore_sigterm=True, grace="1")
      self.assertTrue(all(alive(p) for p in pids))
      launcher.kill()
      launcher.communicate(timeout=30)
      start = time.monotonic()
      wait_for(lambda: not any(alive(p) for p in pids), seconds=10)
    # SIGTERM at once, SIGKILL after the 1 s grace for those that ignore it.
    self.assertLess(time.monotonic() - start, 4)

  def test_a_worker_killed_by_a_signal_exits_128_plus_its_number(self):
    script = ("import json, os, signal, time\n"
              "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
              "  os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(120)\n")
    done = launch("--workers", "2", "--", sys.executable, "-c", script)
    self.assertEqual(done.returncode, 137, done.stderr)
    self.assertIn("worker 1 was killed by SIGKILL; stopping the others",
                  done.stderr)

  def test_a_killed_worker_is_named_first_when_its_peer_failed_too(self):
    # Worker 0 fails when worker 1 dies under it; if one poll finds both
    # ended, the signal that killed worker 1 is the cause to name first.
    with tempfile.TemporaryDirectory() as out:
      launcher, pids = start_sleepers(out)
      launcher.send_signal(signal.SIGSTOP)  # Both end before it looks.
      try:
        os.kill(pids[2], signal.SIGKILL)
        os.kill(pids[0], signal.SIGTERM)  # It exits with status 143.
        wait_for(lambda: not alive(pids[0]) and not alive(pids[2]))
      finally:
        launcher.send_signal(signal.SIGCONT)
      restarted = pathlib.Path(out, "pids0")
      wait_for(lambda: int(restarted.read_text().split()[0]) != pids[0])
      launcher.send_signal(signal.SIGTERM)
      _, stderr = launcher.communicate(timeout=30)
    self.assertIn("worker 1 was killed by SIGKILL; worker 0 exited with "
                  "status 143; stopping the others", stderr)

  def test_max_restarts_restarts_every_worker_on_fresh_ports(self):
    # Worker 1 fails on the first two starts; each start logs its TF_CONFIG.
    script = (
        "import json, os, pathlib, sys, time\n"
        "restart = int(os.environ['REPLICATOR_RESTART_COUNT'])\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "i = config['task']['index']\n"
        "pathlib.Path(sys.argv[1], f'{restart}-{i}').write_text("
        "json.dumps(config['cluster']))\n"
        "if i == 1 and restart < 2:\n"
        "  while not pathlib.Path(sys.argv[1], f'{restart}-0').exists():\n"
        "    time.sleep(0.01)  # Worker 0 has logged this start too.\n"
        "  sys.exit(3)\n"
        "time.sleep(1 if i == 1 else 0.5)\n")
    for max_restarts, status, starts in (("2", 0, 3), ("1", 3, 2)):
      with tempfile.TemporaryDirectory() as out:
        done = launch("--workers", "2", "--max-restarts", max_restarts, "--",
                      sys.executable, "-c", script, out)
        self.assertEqual(done.returncode, status, done.stderr)
        self.assertEqual(done.stderr.count("restarting every worker"),
                         starts - 1, done.stderr)
        clusters = {name: json.loads(pathlib.Path(out, name).read_text())
                    for name in os.listdir(out)}
      self.assertEqual(sorted(clusters), [f"{r}-{i}" for r in range(starts)
                                          for i in range(2)])
      ports = [tuple(clusters[f"{r}-0"]["worker"]) for r in range(starts)]
      self.assertEqual(len(set(ports)), starts)  # Fresh ports every start.

  def test_bad_arguments_say_what_to_fix(self):
    for args, message in [(["--workers", "0", "--", "true"], "at least 1"),
                          (["--workers", "2"], "no command given"),
                          (["--workers", "2", "--timeout", "-1", "--", "true"],
                           "--timeout must be positive"),
                          (["--workers", "2", "--max-restarts", "-1", "--",
                            "true"], "--max-restarts must be 0 or more")]:
      done = launch(*args)
      self.assertEqual(done.returncode, 2, args)
      self.assertIn(message, done.stderr)

  def test_usage_names_the_command_as_invoked(self):
    self.assertRegex(launch("--help").stdout,
                     r"^usage: python -m replicator_strategy\.cli\.launch ")
    with tempfile.TemporaryDirectory() as directory:
      # What pip writes for the console script `replicator-launch`.
      script = os.path.join(directory, "replicator-launch")
      with open(script, "w") as f:
        f.write("import sys\n"
                "from replicator_strategy.cli.launch import main\n"
                "sys.exit(main())\n")
      done = subprocess.run([sys.executable, script, "--help"],
                            capture_output=True, text=True, timeout=60,
                            check=True)
    self.assertRegex(done.stdout, r"^usage: replicator-launch ")

  def test_the_old_module_runs_the_launcher_and_names_its_new_home(self):
    done = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.launch", "--workers", "2",
         "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertEqual(done.stdout.count("] ran"), 1, done.stdout)  # The chief's.
    self.assertRegex(done.stderr, r"DeprecationWarning: replicator_strategy\.launch "
                     r"is deprecated.*run `replicator-launch`")
    usage = subprocess.run(
        [sys.executable, "-m", "replicator_strategy.launch", "--help"],
        capture_output=True, text=True, timeout=60, check=True)
    self.assertRegex(usage.stdout,
                     r"^usage: python -m replicator_strategy\.cli\.launch ")


if __name__ == "__main__":
  unittest.main()
