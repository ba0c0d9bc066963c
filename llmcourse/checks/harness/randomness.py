"""Randomness as a contract: what every check of a function that draws random numbers asks of it.

A sampler is reproducible only if it draws from the `torch.Generator` it is given, and only from it:

1. the same generator state gives the same result (no hidden state of its own);
2. the generator is advanced (a function that copies its state, or ignores it, repeats itself);
3. the global random number generators (torch's, Python's `random`, numpy's) are neither used nor changed;
4. calls without a generator (None) differ from one another (no fresh `torch.Generator()` each time,
   no `manual_seed` inside).

`generator_contract` runs these four tests on a `draw(generator)` that calls the learner's function.

    >>> def sample(probs, generator=None):
    ...     return torch.multinomial(probs, 1, generator=generator)
    >>> probs = torch.full((1, 8), 1 / 8)
    >>> generator_contract("sample", lambda g: sample(probs, g))
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import torch

from llmcourse.course.failed import CheckFailed

from .core import equal
from .show import short

try:
    import numpy
except ImportError:  # pragma: no cover
    numpy = None


def _global_state() -> tuple:
    return (
        torch.random.get_rng_state(),
        random.getstate(),
        numpy.random.get_state(legacy=True) if numpy is not None else None,
    )


def _set_global_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    random.setstate(state[1])
    if numpy is not None:
        numpy.random.set_state(state[2])


def _same_global(a: tuple, b: tuple) -> Optional[str]:
    if not torch.equal(a[0], b[0]):
        return "torch's global generator (torch.manual_seed / torch.rand without generator=)"
    if a[1] != b[1]:
        return "Python's `random` module"
    if numpy is not None and not (a[2][0] == b[2][0] and (a[2][1] == b[2][1]).all() and a[2][2:] == b[2][2:]):
        return "numpy's global generator (numpy.random.*)"
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return equal(a, b, rel_tol=0.0, abs_tol=0.0) is None
    except Exception:
        return False


def generator_contract(
    name: str,
    draw: Callable[[Optional[torch.Generator]], Any],
    *,
    seed: int = 1234,
    varies: bool = True,
    tries: int = 8,
    what: str = "",
) -> None:
    """Raise CheckFailed unless `draw(generator)` (the learner's function, called through `call_learner`)
    keeps the contract above. `varies=False` for a draw whose result cannot change (then tests 2 and 4
    only ask that the generator be advanced); `what` describes the call in messages.
    """
    __tracebackhide__ = True
    call = what or f"{name}(..., generator=g)"

    def fail(problem: str, hint: str, expected: Any = None, got: Any = None) -> CheckFailed:
        lines = f"\n  expected: {short(expected)}\n  got:      {short(got)}" if expected is not None else ""
        return CheckFailed(f"✗ {name} — randomness: {problem}\n  input:    {call}{lines}\n  hint: {hint}")

    outer = _global_state()
    try:
        # 1 and 3: same generator state, two different global states -> same result, global state untouched
        torch.manual_seed(11), random.seed(11)
        if numpy is not None:
            numpy.random.seed(11)
        before = _global_state()
        g = torch.Generator().manual_seed(seed)
        start = g.get_state()
        first = draw(g)
        after_first = g.get_state()
        used = _same_global(before, _global_state())
        if used:
            raise fail(
                f"the call used or changed {used}",
                "draw only from the generator you are given (generator=generator in torch.rand, "
                "torch.multinomial, ...); never seed or draw from a global generator",
            )
        torch.manual_seed(22), random.seed(22)
        if numpy is not None:
            numpy.random.seed(22)
        again = draw(torch.Generator().manual_seed(seed))
        if not _same(again, first):
            raise fail(
                "two calls with generators in the same state gave different results",
                "draw every random number from the generator argument: then the same seed gives the same "
                "result (a function that keeps state of its own, or draws from a global generator, does not)",
                first,
                again,
            )
        # 2: the generator advances, and successive calls differ
        if torch.equal(after_first, start):
            raise fail(
                "the generator's state did not change: your function drew nothing from it",
                "pass generator=generator to the torch function that draws (torch.rand, torch.multinomial, "
                "torch.exponential_, ...); copying its state into a new generator does not advance it",
            )
        if varies:
            results = [first] + [draw(g) for _ in range(tries - 1)]
            if all(_same(r, first) for r in results[1:]):
                raise fail(
                    f"{tries} successive calls with the same generator gave the same result",
                    "each call must continue from the generator's current state (do not reseed it, and do "
                    "not make a new generator from a fixed seed)",
                    "different results",
                    first,
                )
            # 4: without a generator the calls differ (torch's global generator is used then)
            torch.manual_seed(33)
            unseeded = [draw(None) for _ in range(tries)]
            if all(_same(r, unseeded[0]) for r in unseeded[1:]):
                raise fail(
                    f"{tries} calls with generator=None gave the same result",
                    "with no generator, draw from torch's global generator (leave generator=None to "
                    "torch): a fresh torch.Generator() or a manual_seed inside repeats the same draws",
                    "different results",
                    unseeded[0],
                )
    finally:
        _set_global_state(outer)
