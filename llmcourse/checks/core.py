"""The machinery every exercise check shares.

A check runs the learner's function on cases (fixed edge cases plus seeded random ones) and
compares each result with the engine's answer. It stops at the first wrong case with a message a
learner can act on — which input, what was expected, what came back, a hint — and on success
prints one line. Learner code may raise, loop forever, return the wrong type or call the black box
the exercise replaces: each of these becomes a `CheckFailed` with a clear message, never a crash
or a hang.

    >>> def double(x): return 2 * x
    >>> run_check("double", double, [Case("small", (3,), 6)])
    ✓ double — 1 case
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import signal
import threading
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence

import torch


class CheckFailed(AssertionError):
    """A learner's function gave a wrong answer (the message says which and why)."""


class ForbiddenCall(RuntimeError):
    """The learner's function called the black box its exercise replaces."""


@dataclasses.dataclass
class Case:
    """One input of a check: `fn(*args)` must give `expected` (as judged by the check's compare)."""

    description: str
    args: tuple
    expected: Any
    hint: str = ""


@dataclasses.dataclass(frozen=True)
class Forbidden:
    """`target` ('torch.topk', 'torch.Tensor.topk', ...) may not be called; `instead` says what to do."""

    target: str
    instead: str = ""


def short(value: Any, limit: int = 300) -> str:
    """A readable, bounded repr for messages (tensors show shape, dtype and values)."""
    if isinstance(value, torch.Tensor):
        text = f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, values={value.tolist()!r})"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def _resolve(target: str) -> tuple[Any, str]:
    """'torch.Tensor.topk' -> (torch.Tensor, 'topk'); the object that owns the attribute."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ValueError(f"cannot resolve {target!r}")


@contextlib.contextmanager
def forbidding(rules: Sequence[Forbidden]):
    """Temporarily replace each forbidden function with one that raises ForbiddenCall."""
    saved = []
    try:
        for rule in rules:
            owner, name = _resolve(rule.target)
            original = getattr(owner, name)

            def refuse(*args, _rule=rule, **kwargs):
                raise ForbiddenCall(f"your function called {_rule.target}, the black box this exercise asks you to "
                                    f"write yourself. {_rule.instead}".rstrip())

            setattr(owner, name, refuse)
            saved.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError if the block runs longer than `seconds` (main thread, Unix; else no limit)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_learner(name: str, fn: Callable, args: tuple, *, forbid: Sequence[Forbidden] = (), seconds: float = 10.0):
    """fn(*args), turning a raise, a hang or a forbidden call into a CheckFailed that says so."""
    __tracebackhide__ = True
    shown = ", ".join(short(a, 120) for a in args)
    try:
        with forbidding(forbid), time_limit(seconds):
            return fn(*args)
    except ForbiddenCall as err:
        raise CheckFailed(f"✗ {name}({shown})\n  {err}") from None
    except TimeoutError:
        raise CheckFailed(f"✗ {name}({shown}) did not finish within {seconds:g} s.\n"
                          "  hint: look for a loop that never ends (a merge that never shrinks the list?)") from None
    except NotImplementedError:
        raise CheckFailed(f"✗ {name} is not written yet: replace `raise NotImplementedError` with your code") from None
    except Exception as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise CheckFailed(f"✗ {name}({shown}) raised {type(err).__name__}: {err}\n"
                          f"  at line {frame.lineno} in {frame.name}: {frame.line}") from None


def equal(got: Any, expected: Any) -> Optional[str]:
    """None when equal; otherwise why not (types first, then values)."""
    if type(got) is not type(expected) and not (isinstance(got, (int, float)) and isinstance(expected, (int, float))):
        return f"expected a {type(expected).__name__}, got a {type(got).__name__}"
    if isinstance(expected, float):
        return None if math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-6) else "the numbers differ"
    return None if got == expected else "the values differ"


Verdict = Optional[tuple[str, str]]  # None if right, else (what is wrong, a hint; "" = the case's own hint)


def failure(name: str, description: str, problem: str, call: str, expected: Any, got: Any, hint: str) -> CheckFailed:
    """The message every check gives for a wrong answer."""
    hint = f"\n  hint: {hint}" if hint else ""
    return CheckFailed(f"✗ {name} — {description}: {problem}\n"
                       f"  input:    {call}\n"
                       f"  expected: {short(expected)}\n"
                       f"  got:      {short(got)}{hint}")


def run_check(
    name: str,
    fn: Callable,
    cases: Iterable[Case],
    *,
    compare: Callable[[Any, Any], Optional[str]] = equal,
    judge: Optional[Callable[[Case, Any], Verdict]] = None,
    forbid: Sequence[Forbidden] = (),
    error_hints: Optional[dict[str, str]] = None,
    seconds: float = 10.0,
) -> None:
    """Run every case; raise CheckFailed at the first wrong one; print '✓ name — N cases'.

    Answers are judged by `compare(got, expected)` -> None or what is wrong, or, when the verdict
    needs the input too, by `judge(case, got)` -> Verdict. `error_hints` adds a hint when the
    learner's function raises an error whose message contains one of its keys.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"✗ {name}: expected a function, got {short(fn)}")
    if judge is None:
        judge = lambda case, got: (problem, "") if (problem := compare(got, case.expected)) else None  # noqa: E731
    count = 0
    for case in cases:
        try:
            got = call_learner(name, fn, case.args, forbid=forbid, seconds=seconds)
        except CheckFailed as err:
            hint = next((h for key, h in (error_hints or {}).items() if key in str(err)), "")
            if hint:
                raise CheckFailed(f"{err}\n  hint: {hint}") from None
            raise
        verdict = judge(case, got)
        if verdict:
            problem, hint = verdict
            call = f"{name}({', '.join(short(a, 200) for a in case.args)})"
            raise failure(name, case.description, problem, call, case.expected, got, hint or case.hint)
        count += 1
    print(f"✓ {name} — {count} case{'s' if count != 1 else ''}")
