r"""Workers' output through the launcher: each line prefixed, progress bars redrawn.

`replicator-launch` copies every worker's stdout and stderr here, one reading
thread per stream (`forward`), into one `Console`.

>>> last_redraw(b"1/3 [==>...]\r3/3 [======]")
b'3/3 [======]'
"""

import threading


class Console:
  """Where the workers' lines go: each prefixed, progress-bar redraws handled.

  A progress bar (Keras's) redraws its line with carriage returns (and
  backspaces); under several prefixes these would overwrite each other, so a
  finished line comes out once, in its last state. On a terminal the latest
  unfinished state of each shown stream is drawn on a status line meanwhile.
  """

  def __init__(self, stdout, stderr, live):
    self._out = {"stdout": stdout, "stderr": stderr}
    self._live = live
    # Re-entrant: a signal handler may speak while its thread holds it.
    self._lock = threading.RLock()
    self._status_shown = False

  def say(self, message):
    """The launcher's own message, on stderr, prefixed `[launch]`."""
    self.line("stderr", f"[launch] {message}".encode())

  def line(self, stream, text):
    with self._lock:
      self._clear_status()
      self._out[stream].write(text + b"\n")
      self._out[stream].flush()

  def redraw(self, text):
    if not self._live:
      return
    with self._lock:
      self._out["stdout"].write(b"\r\x1b[K" + text)
      self._out["stdout"].flush()
      self._status_shown = True

  def _clear_status(self):
    if self._status_shown:
      self._out["stdout"].write(b"\r\x1b[K")
      self._out["stdout"].flush()
      self._status_shown = False


def last_redraw(segment):
  """What a terminal would show of `segment`: the text after its last `\\r`."""
  return segment.rstrip(b"\r").rsplit(b"\r", 1)[-1].replace(b"\b", b"")


def forward(stream, prefix, console, name, shown, keep=lambda line: True):
  """Copies `stream` to `console` line by line until it closes.

  Only lines `keep` accepts come through. A stream not `shown` is still read
  to its end, so the worker never blocks on a full pipe.
  """
  pending = b""
  for chunk in iter(lambda: stream.read1(1 << 16), b""):
    if not shown:
      continue
    *lines, pending = (pending + chunk).split(b"\n")
    for line in lines:
      if keep(line):
        console.line(name, prefix + last_redraw(line))
    if b"\r" in pending:
      console.redraw(prefix + last_redraw(pending))
  if pending:
    console.line(name, prefix + last_redraw(pending))
  stream.close()
