"""Comparing a learner's tensor with the expected one, with a message that says where they differ.

`core.equal` says only "the values differ"; for tensor exercises a learner needs to know how far
off, where, and whether NaN or inf appeared (the classic sign of an unstable softmax).

    >>> expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> print(tensor_problem(expected + torch.tensor([[0.0, 0.0], [0.5, 0.0]]), expected))
    the values differ at 1 of 4 positions, most at index [1, 0]: expected 3, got 3.5 (max |difference| 0.5)
    >>> tensor_problem(expected.double(), expected)
    'expected dtype torch.float32, got torch.float64 (keep the dtype of the input: float32 in, float32 out)'
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from .show import distinct, short


def plain_tensor_problem(got: Any, expected: torch.Tensor) -> Optional[str]:
    """What is wrong with `got` before its values can be compared: not a plain tensor (a subclass could
    answer any comparison), or on another device."""
    if not isinstance(got, torch.Tensor):
        return f"expected a torch.Tensor of shape {tuple(expected.shape)}, got {short(got, 80)}"
    if type(got) not in (torch.Tensor, torch.nn.Parameter):
        return (
            f"expected a plain torch.Tensor, got a {type(got).__name__} (a subclass of it): return an ordinary tensor"
        )
    if got.device != expected.device:
        return f"expected a tensor on {expected.device}, got one on {got.device}"
    return None


def _where(index: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def tensor_problem(got: Any, expected: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> Optional[str]:
    """None when `got` is a tensor of `expected`'s shape and dtype, close to it; otherwise what is wrong.

    Floats are close when |got - expected| <= atol + rtol·|expected| (torch.isclose), with NaN
    equal only to NaN and ±inf only to itself. Integer and bool tensors must be equal.
    """
    problem = plain_tensor_problem(got, expected)
    if problem:
        return problem
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if got.dtype != expected.dtype:
        kind = str(expected.dtype).replace("torch.", "")
        hint = (
            f" (keep the dtype of the input: {kind} in, {kind} out)"
            if expected.is_floating_point() and got.is_floating_point()
            else ""
        )
        return f"expected dtype {expected.dtype}, got {got.dtype}{hint}"
    got, expected = got.detach().as_subclass(torch.Tensor), expected.detach()
    if not expected.is_floating_point():
        wrong = got != expected
    else:
        wrong = ~torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(wrong.any()):
        return None
    count, total = int(wrong.sum()), wrong.numel()
    if expected.is_floating_point():
        broken = wrong & (got.isnan() | got.isinf()) & expected.isfinite()
        if bool(broken.any()):
            index = torch.nonzero(broken)[0]
            at = tuple(index)
            return (
                f"got nan or inf at {int(broken.sum())} of {total} positions (first at index {_where(index)}: "
                f"expected {expected[at].item():.6g}, got {got[at].item()}): an overflow, a 0/0 or inf - inf"
            )
        diff = (got.double() - expected.double()).abs().masked_fill(~wrong, 0).nan_to_num(nan=float("inf"))
        index = torch.nonzero(diff == diff.max())[0]
        at = tuple(index)
        want, have = distinct(expected[at].item(), got[at].item())
        allowed = atol + rtol * abs(expected[at].item())
        near = diff.max().item() <= 100 * allowed
        accuracy = (
            (
                f"; close, but the check asks for |got - expected| <= {atol:.3g} + {rtol:.3g}·|expected| "
                f"({allowed:.3g} here)"
            )
            if near
            else ""
        )
        return (
            f"the values differ at {count} of {total} positions, most at index {_where(index)}: "
            f"expected {want}, got {have} (max |difference| {diff.max().item():.3g}){accuracy}"
        )
    index = torch.nonzero(wrong)[0]
    at = tuple(index)
    return (
        f"the values differ at {count} of {total} positions, first at index {_where(index)}: "
        f"expected {expected[at].item()}, got {got[at].item()}"
    )


def tensors_close(atol: float = 1e-5, rtol: float = 1e-5) -> Callable[[Any, torch.Tensor], Optional[str]]:
    """A `compare` for `run_check`: `tensor_problem` with these tolerances.

    >>> tensors_close(atol=1e-3)(torch.tensor([1.0005]), torch.tensor([1.0])) is None
    True
    """
    return lambda got, expected: tensor_problem(got, expected, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------
# Naming the mistake: a wrong answer compared with what known wrong implementations give

Mistake = tuple[Callable[..., Any], str]  # (a known wrong implementation, the hint that names the mistake)
Tolerance = Union[dict, Callable[[Any], tuple[float, float]]]  # {dtype: (atol, rtol)}, or case -> (atol, rtol)

FLOAT32_ACCURACY = "your answer has float32 accuracy: compute in the input's dtype (no .float(), no float32 constants)"


def same_answer(got: Any, candidate: Any) -> bool:
    """Whether `got` is what `candidate` is: tensors of one shape whose values agree to about 1e-4,
    relative to the candidate's largest value (NaN = NaN). The dtype does not matter here."""
    if not isinstance(got, torch.Tensor) or not isinstance(candidate, torch.Tensor) or got.shape != candidate.shape:
        return False
    if got.dtype == torch.bool or candidate.dtype == torch.bool:
        return got.dtype == candidate.dtype and torch.equal(got, candidate)
    got, candidate = got.detach().double(), candidate.detach().double()
    scale = candidate.abs().nan_to_num(0, 0, 0).max().item() if candidate.numel() else 0.0
    return bool(torch.isclose(got, candidate, rtol=1e-4, atol=1e-6 * max(scale, 1.0), equal_nan=True).all())


def known_mistake(got: Any, args: tuple, mistakes: Sequence[Mistake], wrong: Callable[[torch.Tensor], bool]) -> str:
    """The hint of the first known mistake whose answer on `args` is `got` and is `wrong` there; else ''."""
    for mistake, hint in mistakes:
        try:
            with torch.no_grad():
                candidate = mistake(*args)
        except Exception:  # a mistake that cannot run on this input names nothing
            continue
        if same_answer(got, candidate) and wrong(candidate):
            return hint
    return ""


def diagnose(
    got: Any, args: tuple, mistakes: Sequence[Mistake], expected: torch.Tensor, *, atol: float, rtol: float
) -> str:
    """The hint of the first known mistake whose answer on `args` is `got` and is wrong there (not within
    atol/rtol of `expected`); for float64 work done in float32, FLOAT32_ACCURACY; else ''."""
    hint = known_mistake(
        got, args, mistakes, lambda candidate: tensor_problem(candidate, expected, atol=atol, rtol=rtol) is not None
    )
    if hint:
        return hint
    if (
        expected.dtype == torch.float64
        and isinstance(got, torch.Tensor)
        and got.dtype == torch.float64
        and same_answer(got, expected)
    ):
        return FLOAT32_ACCURACY
    return ""


def tensor_judge(tolerance: Tolerance, mistakes: Sequence[Mistake] = ()) -> Callable:
    """A `judge` for `run_check`: `tensor_problem` with the tolerance of the expected dtype (or of the
    case), and the hint of the known mistake the wrong answer is, if any.

        >>> judge = tensor_judge({torch.float32: (1e-6, 1e-5)}, [(lambda x: 2 * x, "double, not square")])
        >>> from llmcourse.checks.harness.core import Case
        >>> judge(Case("x = 2", (torch.tensor([2.0]),), torch.tensor([4.0])), torch.tensor([4.0])) is None
        True
        >>> judge(Case("x = 3", (torch.tensor([3.0]),), torch.tensor([9.0])), torch.tensor([6.0]))[1]
        'double, not square'
    """

    def judge(case, got: Any):
        if callable(tolerance):
            atol, rtol = tolerance(case)
        else:
            atol, rtol = tolerance[torch.float64 if case.expected.dtype == torch.float64 else torch.float32]
        problem = tensor_problem(got, case.expected, atol=atol, rtol=rtol)
        return (
            None
            if problem is None
            else (problem, diagnose(got, case.args, mistakes, case.expected, atol=atol, rtol=rtol))
        )

    return judge


def in_float64(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn on float64 copies of the floating-point tensors in `args` (also inside dicts), returned in the
    first one's dtype: the expected answer without float32 rounding.

        >>> in_float64(lambda x: x / 3, torch.tensor([1.0])).dtype
        torch.float32
    """

    def wide(a):
        if isinstance(a, dict):
            return {k: wide(v) for k, v in a.items()}
        return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    def first_dtype(a):
        if isinstance(a, dict):
            return next(filter(None, map(first_dtype, a.values())), None)
        return a.dtype if isinstance(a, torch.Tensor) and a.is_floating_point() else None

    dtype = next(filter(None, map(first_dtype, args)))
    with torch.no_grad():
        return fn(*map(wide, args)).to(dtype)
