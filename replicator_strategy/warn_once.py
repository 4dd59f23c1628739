"""Warnings said once: a memo, per module or object, of what was said.

Some warnings would repeat at every step or call (a layout left unapplied,
a Distribution nothing serves, a sparse gradient made dense, a layout key
matching no variable); the module (or object) that gives one keeps a `Once`
and asks it, with what the warning is about, before saying it:

>>> said = Once()
>>> [said("a layout"), said("a layout"), said("another layout")]
[True, False, True]
>>> forget_all()
>>> said("a layout")
True

`forget_all()` forgets what every memo holds: the tests call it before each
test, so that what a test sees warned does not depend on the tests that ran
before it in the same process.
"""

import threading
import weakref

_memos = weakref.WeakSet()  # Every Once alive.
_lock = threading.Lock()  # Replicas run in threads of their own.


class Once:
  """The keys warned of: `once(key)` is True the first time only."""

  def __init__(self):
    self._said = set()
    with _lock:
      _memos.add(self)

  def __call__(self, key=None):
    """Whether to warn of `key` (hashable) now: not said before."""
    with _lock:
      if key in self._said:
        return False
      self._said.add(key)
      return True

  def forget(self):
    """Every key is to be warned of again."""
    with _lock:
      self._said.clear()


def forget_all():
  """Every `Once`'s keys are to be warned of again."""
  with _lock:
    memos = list(_memos)
  for memo in memos:
    memo.forget()
