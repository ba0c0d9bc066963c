"""`time_limit`: nestable time limits whose time-out (`TimeUp`) learner code cannot easily swallow; `quick`:
whether the notebooks' measurement cells run under the test suite, with less time to spend.

One SIGALRM interval timer serves every active limit; the handler raises `TimeUp` in the code that
runs, again every `REPEAT` seconds until the limit's block ends.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

from .failed import CheckFailed


def quick() -> bool:
    """True when the test suite runs the notebooks (the root conftest.py sets LLMCOURSE_QUICK=1, and the kernels
    that nbgrader starts inherit it): measurement cells then measure fewer repeats and sizes, so that each takes a
    second or two. The published book, built without it, and a learner's kernel measure fully.

        >>> quick()  # doctests run under the test suite
        True
    """
    return os.environ.get("LLMCOURSE_QUICK", "0") not in ("", "0")


class TimeUp(BaseException):
    """A `time_limit`'s time is up (raised inside its block; the block's end turns it into TimeoutError).

    Not an `Exception`, so that a learner's `try: ... except Exception:` around an endless loop does
    not swallow it.
    """

    def __init__(self, limit: "time_limit"):
        super().__init__(f"still running after {limit.seconds:g} s")
        self.limit = limit


REPEAT = 0.05  # once a limit is up, the time-out is raised again this often until the block ends
_limits: list["time_limit"] = []  # the active limits, outermost first
_saved: dict = {}  # the SIGALRM handler and interval timer found when the outermost limit started
_critical = 0  # > 0 while this module (or forbid.py) restores state: a due time-out waits for the next tick
_NAG_AFTER = 5.0  # seconds past the limit before telling the learner that their code ignores it


def _timers_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _arm(now: float) -> None:
    earliest = min(limit.deadline for limit in _limits)
    signal.setitimer(signal.ITIMER_REAL, max(earliest - now, 1e-4), REPEAT)


def _on_alarm(signum, frame) -> None:
    if _critical or not _limits:
        return
    now = time.monotonic()
    due = [limit for limit in _limits if limit.deadline <= now]
    if not due:
        _arm(now)
        return
    for limit in due:
        limit.expired = True
    if frame is not None and frame.f_code in _DEFER:
        return  # this module is restoring state: the repeating timer comes back in REPEAT seconds
    first = due[0]
    if not first.nagged and now - first.deadline > _NAG_AFTER:
        first.nagged = True
        print(
            f"\nYour code has been stopped {int(now - first.deadline)} s ago (a time limit of {first.seconds:g} s) "
            "and keeps running: it catches the time-out (a bare `except:` or `except BaseException:`). "
            "Catch `Exception` instead; to get out now, interrupt or restart the kernel.",
            file=sys.stderr,
        )
    raise TimeUp(first)


class time_limit:
    """`with time_limit(seconds):` raises TimeoutError if the block runs longer than `seconds`.

    Inside the block the time-out is a `TimeUp` (a BaseException), raised again every 50 ms until
    the block ends, so that learner code catching exceptions cannot keep it running; when the block
    ends after its time is up — even if the code swallowed the time-out and returned — the `with`
    raises TimeoutError. Limits nest: the inner one never extends or switches off the outer one,
    and a `TimeUp` of an outer limit passes through inner blocks untouched. Main thread on Unix
    only (elsewhere there is no limit).

        >>> with time_limit(1):
        ...     sum(range(10))
        45
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self.nagged = False
        self.active = False
        self.deadline = math.inf

    def __enter__(self) -> "time_limit":
        if not _timers_usable() or not (self.seconds > 0 and math.isfinite(self.seconds)):
            return self
        global _critical
        _critical += 1
        try:
            now = time.monotonic()
            self.deadline = now + self.seconds
            if not _limits:
                handler = signal.signal(signal.SIGALRM, _on_alarm)
                delay, interval = signal.setitimer(signal.ITIMER_REAL, 0)
                _saved.update(handler=handler, until=now + delay if delay else None, interval=interval)
            _limits.append(self)
            self.active = True
            _arm(now)
        finally:
            _critical -= 1
        return self

    def __exit__(self, kind, err, tb) -> bool:
        global _critical
        _critical += 1
        try:
            if self.active:
                self.active = False
                _limits.remove(self)
                now = time.monotonic()
                if _limits:
                    _arm(now)
                else:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, _saved.get("handler") or signal.SIG_DFL)
                    if _saved.get("until") is not None:  # someone else's timer was running: give it back
                        signal.setitimer(signal.ITIMER_REAL, max(_saved["until"] - now, 1e-3), _saved["interval"])
        finally:
            _critical -= 1
        if isinstance(err, TimeUp) and err.limit is not self:
            return False  # an outer limit's time is up: it handles that
        if isinstance(err, (KeyboardInterrupt, CheckFailed)):
            return False
        if self.expired:
            raise TimeoutError(f"still running after {self.seconds:g} s") from None
        return False


# Code that restores state: a time-out that falls due while it runs waits for the next tick
# (forbid.py adds forbidding.__enter__ and __exit__).
_DEFER = {f.__code__ for f in (time_limit.__enter__, time_limit.__exit__, _arm, _on_alarm)}
