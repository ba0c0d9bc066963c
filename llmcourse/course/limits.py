"""`time_limit`: nestable limits on the CPU time a block of code uses, whose time-out (`TimeUp`) learner code
cannot easily swallow; `quick`: whether the notebooks' measurement cells run under the test suite.

A limit counts this process's CPU time (`cpu_seconds`), not the clock on the wall: on a machine whose cores
other work keeps busy, a function gets a share of a core and takes longer on the wall, but it uses the same
CPU time, so a verdict does not depend on the machine's load. Code that waits rather than computes (a
`time.sleep`, a lock, `input()`) uses no CPU time; a wall-clock ceiling (`wall_ceiling`: three times the CPU
limit and 20 s more) stops it, far above what any working code needs on a loaded machine.

One interval timer of each kind serves every active limit: ITIMER_PROF (SIGPROF, the process's CPU time) and
ITIMER_REAL (SIGALRM, the wall). The handler raises `TimeUp` in the code that runs, again every `REPEAT`
seconds until the limit's block ends.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from .failed import CheckFailed


def quick() -> bool:
    """True when the test suite runs the notebooks (the root conftest.py sets LLMCOURSE_QUICK=1, and the kernels
    that nbgrader starts inherit it): measurement cells then measure fewer repeats and sizes, so that each takes a
    second or two. The published book, built without it, and a learner's kernel measure fully.

        >>> quick()  # doctests run under the test suite
        True
    """
    return os.environ.get("LLMCOURSE_QUICK", "0") not in ("", "0")


def cpu_seconds() -> float:
    """The CPU time this process has used, in seconds, all its threads together (a check's child process
    computes on one thread: there it is that thread's time).

        >>> start = cpu_seconds(); _ = sum(range(10**6)); cpu_seconds() - start > 0
        True
    """
    return time.process_time()


def work_seconds() -> float:
    """The CPU time of this process and of the child processes it has waited for (the checks' children, see
    `llmcourse.checks.harness.isolate`): what running a chapter with its checks has used.

        >>> work_seconds() > 0
        True
    """
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def wall_ceiling(cpu_limit: float) -> float:
    """The wall-clock seconds after which a block limited to `cpu_limit` CPU-seconds is stopped even if it used
    less CPU: it waits (a sleep, a lock) rather than computes. Three times the CPU limit gives a computing block
    its time with two other processes on each core; the 20 s more cover starting up on a busy machine.

        >>> wall_ceiling(10)
        50.0
    """
    return 3.0 * cpu_limit + 20.0


class TimeUp(BaseException):
    """A `time_limit`'s time is up (raised inside its block; the block's end turns it into TimeoutError).

    Not an `Exception`, so that a learner's `try: ... except Exception:` around an endless loop does
    not swallow it.
    """

    def __init__(self, limit: "time_limit"):
        super().__init__(f"still running after {limit.describe()}")
        self.limit = limit


REPEAT = 0.05  # once a limit is up, the time-out is raised again this often until the block ends
_TIMERS = (
    ((signal.SIGPROF, signal.ITIMER_PROF), (signal.SIGALRM, signal.ITIMER_REAL)) if hasattr(signal, "SIGPROF") else ()
)
_limits: list["time_limit"] = []  # the active limits, outermost first
# Told the earliest active limit (see `earliest`) each time the active limits change; a check's child process sets
# it, so that its parent can end it when it ignores its time-out (llmcourse.checks.harness.isolate).
observer: Optional[Callable[[Optional[tuple]], None]] = None
_saved: dict = {}  # the handlers and interval timers found when the outermost limit started
_critical = 0  # > 0 while this module (or forbid.py) restores state: a due time-out waits for the next tick
_NAG_AFTER = 5.0  # wall seconds past the limit before telling the learner that their code ignores it


def earliest() -> Optional[tuple]:
    """(CPU deadline as `cpu_seconds` reads it, wall deadline as time.monotonic reads it, that limit's CPU-s and
    wall seconds) of the active limit that runs out first in CPU time, or None when none is active."""
    if not _limits:
        return None
    first = min(_limits, key=lambda limit: limit.cpu_deadline)
    wall = min(limit.wall_deadline for limit in _limits)
    return first.cpu_deadline, wall, first.seconds, first.wall


def _notify() -> None:
    if observer is not None:
        observer(earliest())


def _timers_usable() -> bool:
    return bool(_TIMERS) and threading.current_thread() is threading.main_thread()


def _arm() -> None:
    """Each timer set to the earliest deadline of its kind, then every REPEAT seconds."""
    cpu_left = min(limit.cpu_deadline for limit in _limits) - cpu_seconds()
    wall_left = min(limit.wall_deadline for limit in _limits) - time.monotonic()
    signal.setitimer(signal.ITIMER_PROF, max(cpu_left, 1e-4), REPEAT)
    signal.setitimer(signal.ITIMER_REAL, max(wall_left, 1e-4), REPEAT)


def _on_timer(signum, frame) -> None:
    if _critical or not _limits:
        return
    cpu, wall = cpu_seconds(), time.monotonic()
    due = []
    for limit in _limits:
        if not limit.expired and (limit.cpu_deadline <= cpu or limit.wall_deadline <= wall):
            limit.expired, limit.by_wall, limit.expired_at = True, limit.cpu_deadline > cpu, wall
        if limit.expired:
            due.append(limit)
    if not due:
        _arm()
        return
    if frame is not None and frame.f_code in _DEFER:
        return  # this module is restoring state: the repeating timers come back in REPEAT seconds
    first = due[0]
    if not first.nagged and wall - first.expired_at > _NAG_AFTER:
        first.nagged = True
        print(
            f"\nYour code has been stopped {int(wall - first.expired_at)} s ago (a limit of {first.describe()}) "
            "and keeps running: it catches the time-out (a bare `except:` or `except BaseException:`). "
            "Catch `Exception` instead; to get out now, interrupt or restart the kernel.",
            file=sys.stderr,
        )
    raise TimeUp(first)


class time_limit:
    """`with time_limit(seconds):` raises TimeoutError if the block uses more than `seconds` of CPU time, or runs
    longer than `wall` seconds on the wall (default `wall_ceiling(seconds)`).

    Inside the block the time-out is a `TimeUp` (a BaseException), raised again every 50 ms until
    the block ends, so that learner code catching exceptions cannot keep it running; when the block
    ends after its time is up — even if the code swallowed the time-out and returned — the `with`
    raises TimeoutError. Limits nest: the inner one never extends or switches off the outer one,
    and a `TimeUp` of an outer limit passes through inner blocks untouched. After the block,
    `cpu_used` and `wall_used` say what it took, `expired` whether its time ran out and `by_wall` whether
    the wall ceiling ended it (it waited) rather than the CPU limit (it computed). Main thread on Unix
    only (elsewhere there is no limit).

        >>> with time_limit(1) as limit:
        ...     sum(range(10))
        45
        >>> limit.expired, limit.cpu_used < 1
        (False, True)
    """

    def __init__(self, seconds: float, *, wall: Optional[float] = None):
        self.seconds = seconds
        self.wall = wall_ceiling(seconds) if wall is None else wall
        self.expired = self.by_wall = self.nagged = self.active = False
        self.cpu_deadline = self.wall_deadline = self.expired_at = math.inf
        self.cpu_used = self.wall_used = 0.0
        self._start = (0.0, 0.0)

    def describe(self) -> str:
        """'10 CPU-s', or '50 s on the wall' when the wall ceiling ended it."""
        return f"{self.wall:g} s on the wall" if self.by_wall else f"{self.seconds:g} CPU-s"

    def cpu_left(self) -> float:
        """The CPU-s left to the block while it runs (inf where there is no limit).

        >>> with time_limit(10) as limit:
        ...     round(limit.cpu_left())
        10
        """
        return self.cpu_deadline - cpu_seconds()

    def __enter__(self) -> "time_limit":
        self._start = (cpu_seconds(), time.monotonic())
        if not _timers_usable() or not (self.seconds > 0 and math.isfinite(self.seconds)):
            return self
        global _critical
        _critical += 1
        try:
            cpu, wall = self._start
            self.cpu_deadline, self.wall_deadline = cpu + self.seconds, wall + self.wall
            if not _limits:
                now = time.monotonic()
                for signum, which in _TIMERS:
                    handler = signal.signal(signum, _on_timer)
                    delay, interval = signal.setitimer(which, 0)
                    _saved[signum] = (handler, which, now + delay if delay else None, interval)
            _limits.append(self)
            self.active = True
            _arm()
            _notify()
        finally:
            _critical -= 1
        return self

    def __exit__(self, kind, err, tb) -> bool:
        global _critical
        _critical += 1
        try:
            self.cpu_used, self.wall_used = cpu_seconds() - self._start[0], time.monotonic() - self._start[1]
            if self.active:
                self.active = False
                _limits.remove(self)
                if _limits:
                    _arm()
                else:
                    _restore()
                _notify()
        finally:
            _critical -= 1
        if isinstance(err, TimeUp) and err.limit is not self:
            return False  # an outer limit's time is up: it handles that
        if isinstance(err, (KeyboardInterrupt, CheckFailed)):
            return False
        if self.expired:
            raise TimeoutError(f"still running after {self.describe()}") from None
        return False


def _restore() -> None:
    """The timers and handlers as the outermost limit found them (someone else's running timer given back)."""
    now = time.monotonic()
    for signum, (handler, which, until, interval) in _saved.items():
        signal.setitimer(which, 0)
        signal.signal(signum, handler or signal.SIG_DFL)
        if until is not None:
            signal.setitimer(which, max(until - now, 1e-3), interval)
    _saved.clear()


def forget_inherited() -> None:
    """In a forked child: the limits of the parent's blocks are the parent's to enforce (the child's CPU clock
    starts again at zero, and the parent waits on the wall), so the child starts with none and default handlers."""
    global _critical, observer
    _limits.clear()
    _critical, observer = 0, None
    for signum, which in _TIMERS:
        signal.setitimer(which, 0)
    for signum, (handler, which, until, interval) in _saved.items():
        signal.signal(signum, handler or signal.SIG_DFL)
    _saved.clear()


SCALE = 20  # a call may use this many times the CPU time the engine's own function used on the same input


def time_out_message(
    call: str, limit: "time_limit", *, hint: str = "", floor: Optional[float] = None, reference: Optional[tuple] = None
) -> str:
    """What a learner reads when `call` ran out of `limit`: CPU time used against the limit (and, when the limit
    was scaled to it, the engine's `reference` = (name, CPU-s) on the same input and the `floor`), or, when the
    wall ceiling ended it, that it waited.

        >>> limit = time_limit(10); limit.cpu_used, limit.expired = 10.02, True
        >>> message = time_out_message("f(x)", limit, floor=10, reference=("f", 0.21))
        >>> message.splitlines()[0][:78]
        '✗ f(x) did not finish within its 10 CPU-s: it was stopped after using 10 CPU-s'
        >>> "where the engine's f used 0.21 CPU-s" in message, "larger of 10 CPU-s and 20× the engine's" in message
        (True, True)
    """
    if limit.by_wall:
        return (
            f"✗ {call} did not finish within {limit.wall:g} s on the wall, and used only {limit.cpu_used:.2g} of its "
            f"{limit.seconds:g} CPU-s: it waits rather than computes.\n"
            "  hint: look for a wait that never ends — time.sleep, input(), a lock, a queue — or a loop that never "
            "ends around one"
        )
    text = f"✗ {call} did not finish within its {limit.seconds:g} CPU-s: it was stopped after using "
    text += f"{limit.cpu_used:.3g} CPU-s"
    if reference is not None:
        text += (
            f", where the engine's {reference[0]} used {reference[1]:.2g} CPU-s on the same input (the limit here is "
            f"the larger of {floor:g} CPU-s and {SCALE}× the engine's)"
        )
    hint = hint or (
        "it computes far longer than this input needs: look for work repeated for every element where one tensor "
        "operation would do, or a loop whose condition never changes"
    )
    return f"{text}.\n  hint: {hint}"


# Code that restores state: a time-out that falls due while it runs waits for the next tick
# (forbid.py adds forbidding.__enter__ and __exit__).
_DEFER = {f.__code__ for f in (time_limit.__enter__, time_limit.__exit__, _arm, _on_timer, _restore, _notify)}
