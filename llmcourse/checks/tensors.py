"""Comparing a learner's tensor with the expected one, with a message that says where they differ.

`core.equal` says only "the values differ"; for tensor exercises a learner needs to know how far
off, where, and whether NaN or inf appeared (the classic sign of an unstable softmax).

    >>> expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> print(tensor_problem(expected + torch.tensor([[0.0, 0.0], [0.5, 0.0]]), expected))
    the values differ at 1 of 4 positions, most at index [1, 0]: expected 3, got 3.5 (max |difference| 0.5)
    >>> tensor_problem(expected.double(), expected)
    'expected dtype torch.float32, got torch.float64 (keep the dtype of the input: float64 in, float64 out)'
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .show import short


def _where(index: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def tensor_problem(got: Any, expected: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> Optional[str]:
    """None when `got` is a tensor of `expected`'s shape and dtype, close to it; otherwise what is wrong.

    Floats are close when |got - expected| <= atol + rtol·|expected| (torch.isclose), with NaN
    equal only to NaN and ±inf only to itself. Integer and bool tensors must be equal.
    """
    if not isinstance(got, torch.Tensor):
        return f"expected a torch.Tensor of shape {tuple(expected.shape)}, got {short(got, 80)}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if got.dtype != expected.dtype:
        hint = " (keep the dtype of the input: float64 in, float64 out)" if expected.is_floating_point() \
            and got.is_floating_point() else ""
        return f"expected dtype {expected.dtype}, got {got.dtype}{hint}"
    if got.device != expected.device:
        return f"expected a tensor on {expected.device}, got one on {got.device}"
    got, expected = got.detach(), expected.detach()
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
            return (f"got nan or inf at {int(broken.sum())} of {total} positions (first at index {_where(index)}: "
                    f"expected {expected[at].item():.6g}, got {got[at].item()}): an overflow, a 0/0 or inf - inf")
        diff = (got.double() - expected.double()).abs().masked_fill(~wrong, 0).nan_to_num(nan=float("inf"))
        index = torch.nonzero(diff == diff.max())[0]
        at = tuple(index)
        return (f"the values differ at {count} of {total} positions, most at index {_where(index)}: "
                f"expected {expected[at].item():.6g}, got {got[at].item():.6g} "
                f"(max |difference| {diff.max().item():.3g})")
    index = torch.nonzero(wrong)[0]
    at = tuple(index)
    return (f"the values differ at {count} of {total} positions, first at index {_where(index)}: "
            f"expected {expected[at].item()}, got {got[at].item()}")


def tensors_close(atol: float = 1e-5, rtol: float = 1e-5) -> Callable[[Any, torch.Tensor], Optional[str]]:
    """A `compare` for `run_check`: `tensor_problem` with these tolerances.

        >>> tensors_close(atol=1e-3)(torch.tensor([1.0005]), torch.tensor([1.0])) is None
        True
    """
    return lambda got, expected: tensor_problem(got, expected, atol=atol, rtol=rtol)
