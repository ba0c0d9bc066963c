"""Shrinking a failing case: the smallest input found on which the learner's answer is still wrong.

A random case that fails shows, say, logits [4, 61] whose one wrong value hides among 244; the same mistake on
logits [1, 6] is read at a glance. `shrink` tries smaller versions of a case whose expected answer is
`later(reference, *args)`: fewer positions along each dimension of its tensors, fewer items in its lists, smaller
ints, then simpler values (zeros, rounded). It keeps a candidate only if the reference still runs on it and the
check's judge still finds the learner's answer wrong in the same way (the same kind of problem, the same hint).
Arguments whose sizes are tied (q, k and v; logits and a k) shrink together or not at all: a candidate on which
the reference raises is dropped.

Only the arguments the case and its reference share (the same objects, in the same order) are shrunk, and of
those only plain tensors, lists and ints above 1: anything else (a string naming a mode, a dtype) stays as it is.
A case whose reference also gets something else than atoms and functions (a tensor derived from an argument, a
generator, a model) is not shrunk at all (`safe`).

    >>> import torch
    >>> def wrong_at_5(x): return x.masked_fill(torch.arange(x.shape[-1]) == 5, 0.0)
    >>> def attempt(args):
    ...     got = wrong_at_5(*args)
    ...     return None if torch.equal(got, args[0]) else (args, got, ("the values differ", ""))
    >>> x = torch.arange(1.0, 41.0).view(2, 20)
    >>> found = shrink((x,), [0], attempt, ("the values differ", ""))
    >>> found.case[0].shape
    torch.Size([1, 6])
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from llmcourse.course.limits import time_limit

TRIES = 300  # candidates tried at most
SECONDS = 2.0  # CPU-s spent shrinking at most (also at most half of what is left of the check's budget)

Attempt = Callable[[tuple], Optional[tuple]]  # args -> (the case, got, verdict) if the answer is still wrong there


@dataclasses.dataclass
class Shrunk:
    """The smallest failing case found: the case as `attempt` gave it, the learner's answer, the judge's verdict."""

    case: Any
    got: Any
    verdict: tuple[str, str]


def same_failure(verdict: tuple[str, str], original: tuple[str, str]) -> bool:
    """Whether a candidate's verdict is the original one's kind of failure: the same first words (letters only:
    'the values differ', 'expected shape ...', 'row ...: expected ... kept') and the same hint.

    >>> same_failure(("the values differ at 1 of 6 positions", "h"), ("the values differ at 9 of 244", "h"))
    True
    >>> same_failure(("expected shape (1,), got (2,)", "h"), ("the values differ at 9 of 244", "h"))
    False
    """
    return verdict[1] == original[1] and _kind(verdict[0]) == _kind(original[0])


def _kind(problem: str) -> list[str]:
    return re.findall(r"[a-z]+", problem.lower())[:3]


def worth_it(got: Any, expected: Any) -> bool:
    """Whether an answer is wrong in its values (worth shrinking: a smaller case shows them), not in its kind: a
    tensor of the expected shape and dtype, a list or tuple of the expected length, any other value of the expected
    type. A wrong type, shape or dtype is said as well on the case as it is.

    >>> worth_it(torch.zeros(2, 3), torch.ones(2, 3)), worth_it(torch.zeros(3), torch.ones(2, 3))
    (True, False)
    """
    if isinstance(expected, torch.Tensor):
        like = (expected.shape, expected.dtype, expected.device)
        return type(got) is torch.Tensor and (got.shape, got.dtype, got.device) == like
    if isinstance(expected, (list, tuple)):
        return type(got) is type(expected) and len(got) == len(expected)
    return type(got) is type(expected)


_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def _data(value: Any) -> bool:
    """An atom, a plain tensor, or a list or tuple of such: what a case can be cut from without hidden state (a
    torch.Generator would be advanced by every try, a model or a dict of weights is not cut)."""
    if isinstance(value, _ATOMS) or type(value) is torch.Tensor:
        return True
    return type(value) in (list, tuple) and all(map(_data, value))


def safe(args: tuple, theirs: tuple, kwargs: dict, pairs: Sequence[tuple[int, int]]) -> bool:
    """Whether a case (`args`) and its reference's arguments (`theirs`, `kwargs`), paired as `pairs` says (args[i]
    is theirs[j]), can shrink together: the paired ones are data (`_data`), every other one an atom (or, for the
    reference, a function: `in_float64`'s). A reference argument that is not the case's own (a tensor derived from
    one, a generator) would not shrink with it.

    >>> x = torch.zeros(3)
    >>> safe((x, 2), (torch.softmax, x, 2), {}, [(0, 1), (1, 2)]), safe((x,), (x, x.double()), {}, [(0, 0)])
    (True, False)
    """
    mine, paired = {i for i, _ in pairs}, {j for _, j in pairs}
    case_ok = all(_data(a) if i in mine else isinstance(a, _ATOMS) for i, a in enumerate(args))
    others = [b for j, b in enumerate(theirs) if j not in paired] + list(kwargs.values())
    return bool(pairs) and case_ok and all(isinstance(b, _ATOMS) or inspect.isroutine(b) for b in others)


def shrink(
    args: tuple,
    places: Sequence[int],
    attempt: Attempt,
    verdict: tuple[str, str],
    *,
    tries: int = TRIES,
    seconds: float = SECONDS,
) -> Optional[Shrunk]:
    """The smallest version of `args` found on which `attempt` still fails as `verdict` says, or None if none is
    smaller. `places` are the positions of the arguments that may change (the others stay as they are);
    `attempt(args)` runs the learner's function and the reference on `args` and gives (the case, got, verdict)
    when the learner's answer is wrong there, else None. Stops after `tries` candidates or `seconds` of CPU time,
    with the smallest found."""
    best: Optional[Shrunk] = None
    current, left = args, tries
    try:
        with time_limit(seconds) as limit, _quietly():
            improved = True
            while improved and left > 0:
                improved = False
                for candidate in _candidates(current, places):
                    if left <= 0:
                        break
                    left -= 1
                    outcome = attempt(candidate)
                    if outcome is not None and same_failure(outcome[2], verdict):
                        best, current, improved = Shrunk(*outcome), candidate, True
                        break
    except TimeoutError:
        if not limit.expired:
            raise
    return best


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """The tries print and warn nothing: a learner's debugging print would come 300 times, and a warning about the
    variance of one value is the try's, not the learner's."""
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")
        yield


def _shrinkable(value: Any) -> bool:
    if type(value) is torch.Tensor:
        return value.numel() > 0 and not value.requires_grad and value.device.type != "meta"
    if type(value) is list:
        return len(value) > 1
    return type(value) is int and value > 1


def _candidates(args: tuple, places: Sequence[int]) -> Iterator[tuple]:
    """Smaller versions of args, the biggest steps first: every dimension of one size shrunk in all the tensors at
    once (tied sizes), then each tensor's dimensions, each list and int alone, then simpler values."""
    places = [i for i in places if _shrinkable(args[i])]
    tensors = [i for i in places if isinstance(args[i], torch.Tensor)]
    sizes = sorted({n for i in tensors for n in args[i].shape if n > 1}, reverse=True)
    for n in sizes:
        for m in _smaller(n):
            yield _replaced(args, {i: _narrow_size(args[i], n, m) for i in tensors if n in args[i].shape})
    for i in places:
        value = args[i]
        if isinstance(value, torch.Tensor):
            for dim, n in enumerate(value.shape):
                for m in _smaller(n):
                    yield _replaced(args, {i: _narrow(value, dim, 0, m)})
                    if m <= n // 2:
                        yield _replaced(args, {i: _narrow(value, dim, n - m, m)})
        elif isinstance(value, list):
            for m in _smaller(len(value)):
                yield _replaced(args, {i: value[:m]})
                if m <= len(value) // 2:
                    yield _replaced(args, {i: value[len(value) - m :]})
        else:
            for m in _smaller(value):
                yield _replaced(args, {i: m})
    for i in tensors:
        for simpler in _simpler_values(args[i]):
            yield _replaced(args, {i: simpler})


def _smaller(n: int) -> list[int]:
    """1, n // 2 and n - 1 (those below n, at least 1), smallest first."""
    return sorted({m for m in (1, n // 2, n - 1) if 1 <= m < n})


def _replaced(args: tuple, changes: dict) -> tuple:
    return tuple(changes.get(i, value) for i, value in enumerate(args))


def _private(value: torch.Tensor) -> torch.Tensor:
    """A copy of `value` with its own storage and the same layout (a view stays a view of the same strides), so that
    a learner's function that changes it cannot change the case's own tensor."""
    storage = value.untyped_storage()
    copy = torch.empty(0, dtype=value.dtype, device=value.device)
    return copy.set_(storage.clone(), value.storage_offset(), value.shape, value.stride())


def _narrow(value: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """value.narrow(dim, start, length), contiguous if value was (a slice along a later dim is not), else a
    private view of the same strides."""
    part = _private(value).narrow(dim, start, length)
    return part.contiguous() if value.is_contiguous() else part


def _narrow_size(value: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Every dimension of `value` of size n narrowed to its first m positions."""
    for dim, size in enumerate(value.shape):
        if size == n:
            value = _narrow(value, dim, 0, m)
    return value


def _simpler_values(value: torch.Tensor) -> Iterator[torch.Tensor]:
    """Zeros (where finite), then the values rounded to 0, 1 and 2 decimals: each only where it changes them."""
    if not value.is_floating_point():
        return
    finite = value.isfinite()
    for simpler in (
        lambda: value.masked_fill(finite, 0.0),
        *(lambda d=d: value.round(decimals=d) + 0.0 for d in (0, 1, 2)),  # + 0.0: no -0 in messages
    ):
        candidate = simpler()
        if not torch.equal(candidate, value):
            yield _layout_of(value, candidate)


def _layout_of(value: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new`'s values in a private copy of `value`'s layout."""
    copy = _private(value)
    copy.copy_(new)
    return copy


def summary(args: tuple, names: Callable[[int], str], shrunk: tuple) -> str:
    """What shrinking changed, for the case's description: the arguments' sizes as they were, and whose values
    were simplified (same size, other values).

    >>> x, y = torch.zeros(4, 61), torch.ones(3)
    >>> summary((x, 5, y), lambda i: "xky"[i], (x[:1, :6], 2, torch.zeros(3)))
    'shrunk from x [4, 61], k=5; y simplified'
    """
    sizes, simplified = [], []
    for i, (before, after) in enumerate(zip(args, shrunk)):
        if before is after:
            continue
        name = names(i)
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.shape == before.shape:
            simplified.append(name)
        elif isinstance(before, torch.Tensor):
            sizes.append(f"{name} {list(before.shape)}")
        elif isinstance(before, list):
            sizes.append(f"{name} of {len(before)} items")
        else:
            sizes.append(f"{name}={before}")
    parts = [f"shrunk from {', '.join(sizes)}"] if sizes else []
    parts += [f"{', '.join(simplified)} simplified"] if simplified else []
    return "; ".join(parts)


def allowed(left: float) -> float:
    """The CPU-s shrinking may use when the check has `left` CPU-s: SECONDS, or half of `left` if that is less (the
    rest stays for the message: a check's budget that runs out says "too slow", not what was wrong).

    >>> allowed(60.0), allowed(1.0), allowed(float("inf"))
    (2.0, 0.5, 2.0)
    """
    return max(0.0, min(SECONDS, left / 2))
