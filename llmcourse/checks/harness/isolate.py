"""`isolated`: a check runs in a child process, so that no learner code can hang or crash the caller.

The in-process time limit (`limits`) stops a learner's function between two Python instructions. It
cannot stop a loop inside one C call (`sum(range(10**13))`), nor code that catches the time-out
again and again (`except BaseException: continue`). So a check runs in a forked copy of the process:
the child runs the check as usual and tells the parent, over a pipe, what it prints, when a call of
the learner's function starts and ends, its time limits as they change (`limits.earliest`: every
`time_limit` of the check, a call's own and the check's budget alike), and how the check ended. While a
limit is active the parent reads the child's CPU time from /proc; when the child overruns a limit by
`GRACE` seconds, the parent ends it by force and reports the call that ran: the Jupyter kernel survives,
and its state is as before the check.

Costs, measured on a 2-core x86-64 machine with torch and transformers loaded (520 MB resident):
a fork and a child's exit take about 20 ms. The child runs torch with one thread: after a fork, the
OpenMP thread pool that the parent's torch started is unusable in the child (a parallel region
there waits for ever), and one thread is always safe. Where fork is not available (Windows, macOS
by policy), CUDA is initialised (a forked child cannot use it), or `LLMCOURSE_CHECKS_IN_PROCESS=1`
is set, a check runs in the process itself with the in-process limits only.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import struct
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch

from llmcourse.course import limits
from llmcourse.course.failed import CheckFailed

GRACE = 3.0  # seconds past a call's own limit before the child is ended by force
CAP = 600.0  # no check may run longer than this, whatever it does
_HEADER = struct.Struct("!I")

_channel: Optional["_Channel"] = None  # set in a child: its end of the pipe


class _Channel:
    """The child's end of the pipe: length-prefixed pickled messages."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, *message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        data = _HEADER.pack(len(data)) + data
        while data:
            written = os.write(self.fd, data)
            data = data[written:]


class _Stream:
    """sys.stdout / sys.stderr in the child: each write goes to the parent, which prints it."""

    def __init__(self, channel: _Channel, name: str):
        self.channel, self.name = channel, name

    def write(self, text: str) -> int:
        if text:
            self.channel.send("out", self.name, str(text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def call_started(call: str) -> None:
    """In a child: the learner's function starts (the parent names it if it must end the child)."""
    if _channel is not None:
        _channel.send("call", call)


def call_ended() -> None:
    if _channel is not None:
        _channel.send("end")


def usable() -> bool:
    """Whether checks can run in a child process here."""
    return (
        _channel is None
        and hasattr(os, "fork")
        and sys.platform.startswith("linux")
        and os.environ.get("LLMCOURSE_CHECKS_IN_PROCESS") != "1"
        and not (torch.cuda.is_available() and torch.cuda.is_initialized())
    )


def _payload(err: BaseException) -> tuple:
    """How the child's exception travels: itself when it pickles, else its type name and text."""
    try:
        data = pickle.dumps(err)
        pickle.loads(data)
        return ("exception", data)
    except Exception:
        return ("text", type(err).__name__, str(err))


def _child(check: Callable, args: tuple, kwargs: dict, fd: int) -> None:
    global _channel
    _channel = channel = _Channel(fd)
    try:  # a signal here (a time limit's) must not write into the parent's event-loop pipe, which the child shares
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread
        pass
    limits.forget_inherited()
    limits.observer = lambda earliest: channel.send("limits", earliest)
    torch.set_num_threads(1)
    sys.stdout, sys.stderr = _Stream(channel, "stdout"), _Stream(channel, "stderr")
    try:
        value = check(*args, **kwargs)
        try:
            channel.send("return", value)
        except Exception:
            channel.send("return", None)
    except CheckFailed as err:
        channel.send("failed", str(err))
    except BaseException as err:
        channel.send("raised", _payload(err))


def _read_messages(fd: int, buffer: bytearray) -> tuple[list, bool]:
    """The complete messages that have arrived, and whether the pipe is closed."""
    data = os.read(fd, 1 << 16)
    buffer.extend(data)
    messages = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + size:
            break
        messages.append(pickle.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return messages, not data


def _end(pid: int) -> Optional[int]:
    """Kill the child if it still runs; its wait status."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        os.kill(pid, signal.SIGKILL)
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
POLL = 0.25  # seconds between two readings of the child's CPU time while a limit is active


def child_cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process `pid` has used, from /proc/pid/stat (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime and stime: fields 14 and 15 of stat
    except (OSError, IndexError, ValueError):
        return 0.0


def overrun(pid: int, earliest: tuple, call: Optional[str]) -> Optional[str]:
    """Why the child `pid` must be ended now: it ran `GRACE` s past its earliest limit (see `limits.earliest`), so it
    ignores the time-out; None while it has not."""
    cpu_deadline, wall_deadline, seconds, wall = earliest
    used = child_cpu_seconds(pid)
    if used > cpu_deadline + GRACE:
        limit = f"its {seconds:g} CPU-s"
    elif time.monotonic() > wall_deadline + GRACE:
        limit = f"{wall:g} s on the wall"
    else:
        return None
    return (
        f"✗ {call or 'the check'} did not finish within {limit}, and could not be stopped from inside "
        f"(it ran on {GRACE:g} s past its limit): the check ended it.\n"
        "  hint: look for a loop that never ends — also one inside a single call (sum(range(10**13))) "
        "or one that catches every exception (`except BaseException:` / a bare `except:` also "
        "catches the time-out: catch `Exception`)"
    )


def _run_in_child(check: Callable, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about forking a process with threads: the child
        warnings.simplefilter("ignore", DeprecationWarning)  # takes none of their locks (it prints through the pipe)
        pid = os.fork()
    if pid == 0:  # the child: run the check, report, and leave without running any exit handler
        try:
            os.close(read)
            _child(check, args, kwargs, write)
        finally:
            os._exit(0)
    os.close(write)
    buffer = bytearray()
    outcome: Optional[tuple] = None
    call: Optional[str] = None  # the learner's call that runs now, if any
    earliest: Optional[tuple] = None  # the child's limit that runs out first (limits.earliest)
    cap = time.monotonic() + CAP
    try:
        while True:
            wait = cap - time.monotonic()
            if earliest is not None:
                why = overrun(pid, earliest, call)
                if why:
                    raise CheckFailed(why) from None
                wait = min(wait, POLL)
            if wait <= 0:
                raise CheckFailed(f"✗ the check did not finish within {CAP:g} s: it was ended.") from None
            if not select.select([read], [], [], wait)[0]:
                continue
            messages, closed = _read_messages(read, buffer)
            for message in messages:
                kind = message[0]
                if kind == "out":
                    print(message[2], end="", file=sys.stdout if message[1] == "stdout" else sys.stderr, flush=True)
                elif kind == "call":
                    call = message[1]
                elif kind == "end":
                    call = None
                elif kind == "limits":
                    earliest = message[1]
                else:
                    outcome = message
            if closed:
                break
    finally:
        os.close(read)
        status = _end(pid)
    if outcome is None:
        how = (
            f"signal {os.WTERMSIG(status)}"
            if status is not None and os.WIFSIGNALED(status)
            else f"exit status {os.WEXITSTATUS(status)}"
            if status is not None
            else "unknown"
        )
        where = f" while running {call}" if call else ""
        raise CheckFailed(
            f"✗ the check's process ended unexpectedly ({how}){where}: the learner's code crashed it "
            "(os._exit, a segmentation fault in C code, or memory ran out)."
        )
    kind = outcome[0]
    if kind == "return":
        return outcome[1]
    if kind == "failed":
        raise CheckFailed(outcome[1]) from None
    payload = outcome[1]
    if payload[0] == "exception":
        raise pickle.loads(payload[1])
    raise RuntimeError(f"{payload[1]}: {payload[2]}")


_preloads: list[Callable[[], Any]] = []  # what every child needs, computed once in the parent (`preload`)
_preloaded = False


def preload(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Register `fn` (a cached loader: a model, its logits) to run in this process before the first check's
    child is forked, so that no check pays for it again. Returns `fn`."""
    _preloads.append(fn)
    return fn


def _preload() -> None:
    global _preloaded
    if not _preloaded:
        _preloaded = True
        for fn in _preloads:
            fn()


def isolated(check: Callable) -> Callable:
    """`check` run in a child process when `usable()`, else in this one (see the module's docstring)."""

    @functools.wraps(check)
    def run(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not usable():
            return check(*args, **kwargs)
        _preload()
        return _run_in_child(check, args, kwargs)

    run.isolated = True
    return run
