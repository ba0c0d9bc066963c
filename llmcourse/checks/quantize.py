"""Checks for chapter 09, quantization: absmax int8 per row, 4-bit values packed two per byte, 4-bit
groups of 32 (Q4_0), a linear layer with int8 weights by the integer route, SmoothQuant's factors, and the
output error they trade with the α that makes it smallest (`smoothing_error`, `best_alpha`).

Quantized values are integers, so they are compared exactly — except where w / scale lies within
1e-4 of a half-integer (a tie, or a float's last bit away from one): there either neighbour is right,
whatever rule breaks ties (torch.round rounds half to even, Python's round too, numpy the same; C's
round away from zero). Scales are compared in their stored dtype. A wrong answer is compared with what
the known mistakes give (a scale from the mean, truncation, nibbles in the wrong order, ...) and the
matching one is named.

    >>> def smooth_scales(act_absmax, weight, alpha=0.5):
    ...     a, w = act_absmax.float(), weight.float().abs().amax(dim=0)
    ...     s = a ** alpha / w ** (1 - alpha)
    ...     return torch.where((a > 0) & (w > 0), s, 1.0)
    >>> check_smooth_scales(smooth_scales)
    ✓ smooth_scales — 18 cases
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guarded
from llmcourse.engine.generate import generate
from llmcourse.engine.quantize import Quantization, quantize_model
from llmcourse.engine.quantize import dequantize_int4 as engine_dequantize_int4
from llmcourse.engine.quantize import dequantize_int8 as engine_dequantize_int8
from llmcourse.engine.quantize import int8_linear as engine_int8_linear
from llmcourse.engine.quantize import pack_int4 as engine_pack_int4
from llmcourse.engine.quantize import quantize_int4 as engine_quantize_int4
from llmcourse.engine.quantize import quantize_int8 as engine_quantize_int8
from llmcourse.engine.quantize import smooth_scales as engine_smooth_scales
from llmcourse.engine.quantize import unpack_int4 as engine_unpack_int4
from llmcourse.engine.slots import PartError

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, call_learner, failure, later, run_check, unwritten_helper
from .harness.forbid import DispatchWatch, Forbidden
from .harness.inputs import changed_input, watched
from .harness.show import short
from .harness.tensors import tensor_problem
from .kv_cache import one_thread

NO_ENGINE = Forbidden(
    "llmcourse.engine.quantize",
    "llmcourse.engine.quantize is the engine's quantization, what yours is compared with: write your own",
)
NO_TORCH_QUANTIZATION = [
    Forbidden(
        f"torch.{name}", "torch's quantized tensors do the whole exercise: write the scale and the rounding yourself"
    )
    for name in (
        "quantize_per_channel",
        "quantize_per_tensor",
        "quantize_per_tensor_dynamic",
        "fake_quantize_per_channel_affine",
        "fake_quantize_per_tensor_affine",
        "_make_per_channel_quantized_tensor",
        "_make_per_tensor_quantized_tensor",
        "int_repr",
        "dequantize",
        "fbgemm_linear_quantize_weight",
        "fbgemm_pack_quantized_matrix",
        "fbgemm_linear_int8_weight",
        "fbgemm_linear_int8_weight_fp32_activation",
        "_convert_weight_to_int4pack",
        "_weight_int4pack_mm",
        "_weight_int8pack_mm",
        "_dyn_quant_pack_4bit_weight",
        "_dyn_quant_matmul_4bit",
    )
]
NO_KERNELS = Forbidden(
    "llmcourse.engine.cpu_kernels", "llmcourse.engine.cpu_kernels holds the engine's quantized kernels: write your own"
)
FORBID = [NO_ENGINE, NO_KERNELS, *NO_TORCH_QUANTIZATION]
VIEW_HINTS = {
    "view size is not compatible": "quantize_model passes a layer's weight.T, a transposed view: view() "
    "cannot merge its dimensions; use reshape (or index rows and groups as "
    "they are)"
}


class Raised:
    """What a call that raised ValueError gave (so that a case can expect the error)."""

    def __init__(self, err: BaseException):
        self.type, self.message = type(err).__name__, str(err)

    def __repr__(self) -> str:
        return f"{self.type}({self.message!r})"


class Refusal:
    """The expected answer of a case whose input must be refused: a ValueError that mentions `size`."""

    def __init__(self, size: int, why: str):
        self.size, self.why = size, why

    def __repr__(self) -> str:
        return f"a ValueError whose message names the size {self.size} ({self.why})"


class catching_value_errors:  # noqa: N801 (used as a function)
    """fn, with a ValueError it raises returned as a `Raised` (other errors propagate as usual). A class: the
    watch refuses the checks' own functions, not their methods."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except ValueError as err:
            return Raised(err)


def refusal_verdict(expected: Refusal, got: Any) -> Verdict:
    if not isinstance(got, Raised):
        return (
            f"expected a ValueError, got {short(got, 80)}",
            f'check the size first and `raise ValueError(f"... {{size}} ...")` ({expected.why})',
        )
    if str(expected.size) not in got.message:
        return (
            f"the ValueError's message does not name the size {expected.size}: {got.message!r}",
            'say what is wrong in the message, with the size, e.g. f"... got {K} values"',
        )
    return None


def unexpected_error(got: Any) -> Verdict:
    if isinstance(got, Raised):
        return f"raised ValueError: {got.message}", "this input is valid: refuse only the sizes the exercise names"
    return None


def _near_ties(ratio: Tensor) -> Tensor:
    """Where w / scale is within 1e-4 of a half-integer: either neighbour is a right rounding."""
    return ((ratio.abs() - ratio.abs().floor()) - 0.5).abs() < 1e-4


def values_problem(got: Tensor, expected: Tensor, ratio: Tensor, what: str) -> Optional[str]:
    """None when the integer values `got` equal `expected`, but for ±1 at near-ties of `ratio`."""
    off = got.long() - expected.long()
    wrong = (off != 0) & ~((off.abs() == 1) & _near_ties(ratio))
    if not bool(wrong.any()):
        return None
    index = torch.nonzero(wrong)[0]
    at = tuple(index)
    where = "[" + ", ".join(str(int(i)) for i in index) + "]"
    return (
        f"{what} differ at {int(wrong.sum())} of {wrong.numel()} positions, first at index {where}: expected "
        f"{int(expected[at])}, got {int(got[at])} (w / scale there = {float(ratio[at]):.6g})"
    )


def _pair(got: Any, name: str) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, Tensor) for t in got)):
        return f"expected a tuple of two tensors ({name}), got {short(got, 100)}"
    return None


# ----------------------------------------------------------------------------------------------
# In the engine: every slot's check ends by quantizing the bundled GPT-2 with the learner's functions installed as
# `llmcourse.course.learner.my_engine` installs them (`guarded(Quantization, ...)`) and generating a few tokens; each
# call the engine made of a learner's function is then judged against the engine's own function on the same arguments
# (computed after the run), with the exercise's own judge. So a function that passes the cases cannot then fail in
# the engine (GPT-2's token table [50257, 192], the layers' transposed weights, one-row decoding steps, ...).

# token ids as a paragraph of numbers, not one per line
# fmt: off
ENGINE_PROMPT = [49, 2662, 46, 25, 198, 1537, 2705, 11, 644, 1657, 832, 331, 4324, 9457, 30, 198, 50256, 0, 198, 41,
                 6239, 2767, 25]  # "ROMEO:\nBut soft, what light through yonder window breaks?\n", EOS, token 0, 5 more
# fmt: on
ENGINE_NEW_TOKENS = 2  # a prefill of 23 rows, then a one-row decoding step


def _engine_run(fmt: str, fns: dict[str, Callable], calibrate: bool = False) -> tuple[Any, list, Optional[tuple]]:
    """A copy of the bundled GPT-2 quantized to `fmt` with `fns` installed, then ENGINE_NEW_TOKENS greedy tokens.
    -> (the tokens, or the PartError that stopped the engine; each call of a learner's function: (name, args,
    result); the first call that changed an argument: (its index in the calls, its verdict), or None). Run inside
    call_learner: the engine's own code runs unwatched, the learner's under the watch."""
    watch = sys.getprofile()
    calls: list = []
    changed: list = []

    def recorded(name: str, fn: Callable) -> Callable:
        inputs = watched(fn, ())  # the engine passes the model's own weights: each snapshot once, for every call

        def call(*args):
            if not changed:
                inputs.remember(args)
            sys.setprofile(watch)
            try:
                out = fn(*args)
            finally:
                sys.setprofile(None)
            calls.append((name, args, out))
            verdict = None if changed else changed_input(inputs, args)
            if verdict:
                changed.append((len(calls) - 1, verdict))
            return out

        call.__name__ = call.__qualname__ = getattr(fn, "__qualname__", name)
        return call

    sys.setprofile(None)
    try:
        model = copy.deepcopy(bundled_model())
        quantization = guarded(Quantization, **{n: recorded(n, f) for n, f in fns.items()})
        with one_thread():
            quantize_model(model, fmt, quantization, calibration=ENGINE_PROMPT if calibrate else None)
            tokens = generate(model, ENGINE_PROMPT, max_new_tokens=ENGINE_NEW_TOKENS, eos_token_id=None)
    except PartError as err:
        tokens = err
    finally:
        sys.setprofile(watch)
    return tokens, calls, changed[0] if changed else None


def _identical(got: Any, expected: Any) -> bool:
    if isinstance(expected, tuple):
        return isinstance(got, tuple) and len(got) == len(expected) and all(map(_identical, got, expected))
    return (
        type(got) is Tensor
        and isinstance(expected, Tensor)
        and got.dtype == expected.dtype
        and got.shape == expected.shape
        and torch.equal(got, expected)
    )


def _describe(name: str, args: tuple) -> str:
    def one(a):
        if isinstance(a, Tensor):
            layout = "" if a.is_contiguous() else ", a transposed view"
            return f"<{str(a.dtype)[6:]} {list(a.shape)}{layout}>"
        return repr(a)

    return f"{name}({', '.join(map(one, args))})"


def check_in_engine(
    fmt: str,
    fns: dict[str, Callable],
    judges: dict[str, tuple[Callable, Callable]],
    *,
    seconds: float = 20.0,
    calibrate: bool = False,
) -> None:
    """Quantize the bundled GPT-2 to `fmt` with the learner's `fns` (slot name -> function) installed as my_engine
    installs them, and generate; raise CheckFailed if the engine stops one of them, or if one of the calls the engine
    made fails `judges[name] = (judge, reference)` against reference(*args). `calibrate`: smoothed with the prompt as
    the calibration (`quantize_model(..., calibration=)`)."""
    names = ", ".join(fns)
    installed = ", ".join(f"{n}={n}" for n in fns)
    what = (
        f"quantize_model(the bundled GPT-2 (float32), {fmt!r}, guarded(Quantization, {installed})"
        f"{', calibration=the prompt' if calibrate else ''}) "
        f"(your {names} installed as my_engine installs them), then generate(model, a {len(ENGINE_PROMPT)}-token "
        f"prompt, max_new_tokens={ENGINE_NEW_TOKENS})"
    )
    tokens, calls, changed = call_learner(
        names, _engine_run, (fmt, fns, calibrate), forbid=FORBID, seconds=seconds, show=lambda args: what
    )
    if changed:
        index, (problem, modify_hint) = changed
        name, args, _ = calls[index]
        raise CheckFailed(
            f"✗ {name} in the engine — {what}; the engine's call {index + 1} of {len(calls)}: {problem}\n"
            f"  input:    {_describe(name, args)}\n  hint: {modify_hint}"
        )
    hint = (
        f"your {names} pass{'es' if len(fns) == 1 else ''} the cases above but not the engine's own calls: "
        "quantize_model passes each layer's weight.T (a transposed view: [576, 192], [192, 192], [768, 192], "
        "[192, 768]) and GPT-2's token table [50257, 192], without optional arguments; the model then "
        "calls them on a prefill (many rows) and on one-row decoding steps"
    )
    if isinstance(tokens, PartError):
        lines = str(tokens).split("\n")
        raise CheckFailed(
            f"✗ {names} in the engine — {what}: the engine stopped it: {lines[0]}"
            + "".join(
                f"\n  {line.strip()}" for line in lines[1:3] if line.strip() and not line.strip().startswith("hint")
            )
            + f"\n  hint: {hint}"
        ) from None
    judged = set()
    for i, (name, args, got) in enumerate(calls):
        # One call per interface (shapes, layouts, dtypes): what the engine adds to the cases, which already judge
        # values of every kind; the calls are kept alive until here, so their tensors are all different.
        key = (name, *((a.shape, a.stride(), a.dtype) if isinstance(a, Tensor) else type(a) for a in args))
        if key in judged:
            continue
        judged.add(key)
        judge, reference = judges[name]
        case = Case(f"in the engine, call {i + 1} of {len(calls)}", args, reference(*args))
        if _identical(got, case.expected):  # the usual answer, at once (GPT-2's token table is 9.6M weights)
            continue
        verdict = judge(case, got)
        if verdict:
            problem, case_hint = verdict
            raise failure(
                f"{name} in the engine",
                f"{what}; the engine's call {i + 1} of {len(calls)}",
                problem,
                _describe(name, args),
                case.expected,
                got,
                [case_hint, hint],
            )


# ----------------------------------------------------------------------------------------------
# Exercise 1: quantize_int8, dequantize_int8


def _int8_with(scale_of: Callable[[Tensor], Tensor], *, rounding=torch.round, clamp: bool = True) -> Callable:
    def quantize(w):
        w = w.float()
        scale = scale_of(w)  # broadcastable to w
        ratio = rounding(w / torch.where(scale == 0, 1.0, scale))
        ratio = ratio.clamp(-127, 127) if clamp else ratio
        return ratio.to(torch.int8), scale.reshape(-1)

    return quantize


def _absmax_rows(w: Tensor) -> Tensor:
    return w.abs().amax(dim=-1, keepdim=True) / 127


INT8_MISTAKES = [
    (
        _int8_with(lambda w: w.abs().mean(dim=-1, keepdim=True) / 127),
        "the scale is max|row| / 127, not the mean |w|: the value of largest magnitude must map to ±127",
    ),
    (
        _int8_with(lambda w: w.abs().mean(dim=-1, keepdim=True) / 127, clamp=False),
        "the scale is max|row| / 127, not the mean |w|: the value of largest magnitude must map to ±127",
    ),
    (
        _int8_with(lambda w: w.std(dim=-1, keepdim=True) / 127),
        "the scale is max|row| / 127, not the standard deviation: the value of largest magnitude must map to ±127",
    ),
    (
        _int8_with(_absmax_rows, rounding=torch.trunc),
        "round to the nearest integer (torch.round): .to(torch.int8) and torch.trunc cut toward zero, so 2.9 becomes 2",
    ),
    (
        _int8_with(_absmax_rows, rounding=torch.floor),
        "round to the nearest integer (torch.round), not down (floor): -0.2 must become 0, not -1",
    ),
    (
        _int8_with(lambda w: w.abs().amax().expand(w.shape[0], 1) / 127),
        "one scale per ROW (per output), max over that row only: one scale for the whole tensor wastes the "
        "small rows' precision",
    ),
    (
        _int8_with(lambda w: w.abs().amax(dim=0, keepdim=True) / 127),
        "a scale per row: take the max over the last dimension (dim=-1), not over the rows (dim=0)",
    ),
    (
        _int8_with(lambda w: w.abs().amax(dim=-1, keepdim=True) / 128, clamp=False),
        "divide max|row| by 127, not 128: the extreme must map to ±127 (128 does not fit in int8 and wraps to -128)",
    ),
    (
        _int8_with(lambda w: w.abs().amax(dim=-1, keepdim=True) / 128),
        "divide max|row| by 127, not 128: the extreme must map to ±127",
    ),
    (
        _int8_with(lambda w: w.abs().amax(dim=-1, keepdim=True) / 255),
        "divide max|row| by 127, not 255: symmetric int8 uses [-127, 127], half of the 255 steps on each side",
    ),
    (
        _int8_with(lambda w: (w.amax(dim=-1, keepdim=True) - w.amin(dim=-1, keepdim=True)) / 255),
        "this is the asymmetric (min, max) scale; the exercise's is symmetric: max|row| / 127, no zero point",
    ),
]


def _same_int8(got: tuple, candidate: Optional[tuple]) -> bool:
    if candidate is None:
        return False
    q, scale = got
    cq, cscale = candidate
    if q.shape != cq.shape or scale.shape != cscale.shape:
        return False
    return bool(torch.equal(q.long(), cq.long())) and bool(
        torch.allclose(scale.double(), cscale.double(), rtol=1e-5, atol=1e-12, equal_nan=True)
    )


# Scales below this come only from rows (or groups) of tiny values: where a wrong answer differs only there, the
# scale was floored (max(scale, eps), scale + eps) or not guarded where it underflows to 0.
TINY_SCALE = 1e-6


def floor_hint(escale: Tensor, bad: Tensor, what: str) -> str:
    """The hint for answers wrong only where the expected scale `escale` is tiny (`bad`: where they are wrong, same
    shape), or ''. `what` names a row or a group."""
    if not bool(bad.any()) or not bool((escale[bad].abs() < TINY_SCALE).all()):
        return ""
    if bool((escale[bad] == 0).all()):
        return (
            f"this {what}'s scale is 0 although its values are not: they are so small that the scale underflows "
            "(rounds to 0) — divide by 1 where the scale you divide by is 0, as for an all-zero "
            f"{what} (w / 0 is ±inf, clamped to the extreme level)"
        )
    return (
        f"only {what}s of tiny values are wrong: the scale has no floor — a floor (max(scale, eps), scale + eps, "
        f"clamp(min=eps)) gives them another scale or other values; guard only the division where the scale is 0 "
        "(divide by 1 there)"
    )


def _exact_where_underflowed(w: Tensor, q: Tensor, eq: Tensor, escale: Tensor) -> Tensor:
    """The expected q, where a row's float32 scale underflowed to 0 (values of about 1e-44) taking the learner's q if
    it is the exact ratio w · 127 / max|w| (a computation in float64, rounded): either dequantizes to 0 with scale 0.
    Only q = ±127 everywhere, from w / 0 = ±inf, stays wrong there."""
    w64 = w.double()
    top = w64.abs().amax(-1, keepdim=True)
    underflowed = ((escale == 0)[:, None] & (top > 0)).expand_as(eq)
    if not bool(underflowed.any()):
        return eq
    exact = torch.round(w64 * 127 / torch.where(top > 0, top, 1.0)).clamp(-127, 127)
    near = (q.long() - exact.long()).abs() <= 1
    rows_exact = (near | ~underflowed).all(-1, keepdim=True) & underflowed
    return torch.where(rows_exact, q.to(eq.dtype), eq)


def _quantize_int8_verdict(case: Case, got: Any) -> Verdict:
    problem = _pair(got, "q, scale")
    if problem:
        return problem, "return q, scale"
    (w,) = case.args
    q, scale = got
    eq, escale = case.expected
    N, K = w.shape
    if q.shape != (N, K):
        return f"q: expected shape {(N, K)}, got {tuple(q.shape)}", "q has w's shape"
    if q.dtype != torch.int8:
        return f"q: expected dtype torch.int8, got {q.dtype}", "convert at the end: q.to(torch.int8)"
    if scale.shape != (N,):
        hint = (
            "a scale per row, one number each: amax(dim=-1) without keepdim"
            if scale.numel() == N
            else "a scale per row: shape [N]"
        )
        return f"scale: expected shape {(N,)}, got {tuple(scale.shape)}", hint
    if scale.dtype != torch.float32:
        return (
            f"scale: expected dtype torch.float32, got {scale.dtype}",
            "the scales are float32 whatever the input's dtype: compute on w.float()",
        )

    def mistake() -> str:  # computed only for a wrong answer (the cases include GPT-2-sized layers)
        return next((hint for fn, hint in INT8_MISTAKES if _same_int8(got, _try(fn, w))), "")

    if bool(scale.isnan().any()):
        return "scale has nan", "an all-zero row has max 0: its scale is 0 (no division by it)"
    # accuracy: the scale is max|row| / 127 in float32, computed in any order: within 1e-5 (relative)
    problem = tensor_problem(scale, escale, atol=1e-12, rtol=1e-5)
    if problem:
        zero = (escale == 0) & (scale != 0)
        if bool(zero.any()):
            return (
                f"scale: {problem}",
                mistake() or "an all-zero row gets scale 0 (and q 0): do not replace its max by 1 or eps",
            )
        bad = ~torch.isclose(scale.double(), escale.double(), rtol=1e-5, atol=1e-12)
        return f"scale: {problem}", mistake() or floor_hint(escale, bad, "row")
    ratio = w.double() / torch.where(escale == 0, 1.0, escale.double())[:, None]
    eq = _exact_where_underflowed(w, q, eq, escale)
    problem = values_problem(q, eq, ratio, "q's values")
    if problem:
        hint = mistake()
        if not hint and bool((q.long() == -128).any()):
            hint = "values outside [-127, 127] wrapped around in int8: clamp before converting"
        bad_rows = ((q.long() - eq.long()).abs() > 1).any(-1)
        return problem, hint or floor_hint(escale, bad_rows, "row")
    return None


def _random_weights(rng: torch.Generator, N: int, K: int, dtype=torch.float32) -> Tensor:
    """Rows of different sizes and offsets: a per-tensor or per-column scale cannot pass for a per-row one."""
    row_scale = torch.exp(torch.randn(N, 1, generator=rng, dtype=torch.float64) * 1.5)  # [N, 1]
    offset = torch.randn(N, 1, generator=rng, dtype=torch.float64) * 0.5
    return ((torch.randn(N, K, generator=rng, dtype=torch.float64) + offset) * row_scale).to(dtype)


def stored_transposed(w: Tensor) -> Tensor:
    """w [N, K] as the engine passes a linear layer's weight: `Affine.weight.T`, a transposed view of the stored
    [K, N] (not contiguous)."""
    return w.T.contiguous().T


def int8_cases(seed: int, n_random: int) -> list[Case]:
    def case(description, w, hint=""):
        return Case(description, (w,), later(engine_quantize_int8, w), hint)

    rng = torch.Generator().manual_seed(seed)
    planted = torch.randn(3, 40, generator=rng) * 0.05
    planted[1, 7] = 4.0
    planted[2, 30] = -6.0
    cases = [
        case(
            "one row, values of both signs",
            torch.tensor([[2.54, -1.27, 0.1, -0.3, 1.9]]),
            hint="scale = max|row| / 127 = 0.02; q = round(w / scale)",
        ),
        case("truncation shows: values just below an integer", torch.tensor([[127.0, 2.9, -2.9, 0.6, -0.6, 63.7]])),
        case(
            "two rows, the second all zero",
            torch.tensor([[0.5, -1.0, 0.3], [0.0, 0.0, 0.0]]),
            hint="an all-zero row gets scale 0 and q 0",
        ),
        case(
            "the negative extreme maps to -127",
            torch.tensor([[-2.0, 1.3, 0.5, -0.01]]),
            hint="the largest MAGNITUDE maps to ±127: here -2.0 -> -127",
        ),
        case(
            "rows of very different sizes",
            torch.tensor([[1000.0, -300.0, 2.0], [0.001, -0.002, 0.0007], [-5.0, 5.0, 2.6]]),
            hint="each row gets its own scale",
        ),
        case("a row with one huge value: the small ones round to 0", planted),
        case("a single column", torch.tensor([[3.0], [-0.5], [0.0]])),
        case(
            "float64 input (scale float32)",
            _random_weights(rng, 5, 17, torch.float64),
            hint="compute in float32 (w.float()): the scales are float32",
        ),
        case(
            "float16 input (scale float32)",
            _random_weights(rng, 4, 24, torch.float16),
            hint="compute in float32 (w.float()): the scales are float32",
        ),
        case("an all-zero matrix", torch.zeros(2, 5), hint="an all-zero row gets scale 0 and q 0"),
        case(
            "rows of tiny values (max 3e-7, 2e-30): each its own scale, however small",
            torch.tensor([[3e-7, -1e-7, 2.5e-8, 0.0], [2e-30, -1.3e-30, 4e-31, 1e-30], [0.5, -0.25, 0.1, 0.0]]),
            hint="the scale is max|row| / 127 however small: no floor (eps) on it",
        ),
        case(
            "a row of subnormal values (1e-44): max|w| / 127 underflows to 0, so scale 0 and q 0",
            torch.tensor([[1e-44, -5e-45, 3e-45], [0.3, -0.6, 0.2]]),
            hint="divide by 1 where the scale is 0 (torch.where(scale == 0, 1.0, scale)), as for an all-zero row",
        ),
        case(
            "the engine's input: a layer's weight.T [96, 32], a transposed view (not contiguous)",
            stored_transposed(_random_weights(rng, 96, 32)),
            hint="quantize_model passes Affine.weight.T, a transposed view: use reshape, not view, or index "
            "rows and columns as they are",
        ),
        case(
            "float16 weight.T [64, 40] (a float16 model), not contiguous",
            stored_transposed(_random_weights(rng, 64, 40, torch.float16)),
            hint="compute in float32 (w.float()): the scales are float32",
        ),
        case(
            "bfloat16 weight.T [48, 24] (a bfloat16 model), not contiguous",
            stored_transposed(_random_weights(rng, 48, 24, torch.bfloat16)),
            hint="compute in float32 (w.float()): the scales are float32",
        ),
        case("GPT-2's sizes: weight.T [384, 768]", stored_transposed(_random_weights(rng, 384, 768))),
        case(
            "float16 extremes: a row with 60000, a row of values near 1e-3",
            torch.tensor([[60000.0, -25000.0, 1.0, 0.0], [1e-3, -2e-3, 5e-4, 1.5e-3]], dtype=torch.float16),
            hint="compute in float32 (w.float()): 60000 / scale overflows nothing there",
        ),
    ]
    for i in range(n_random):
        N, K = int(torch.randint(1, 40, (), generator=rng)), int(torch.randint(1, 200, (), generator=rng))
        w = _random_weights(rng, N, K, [torch.float32, torch.float16, torch.bfloat16][i % 3])
        cases.append(
            case(
                f"random #{i}: [{N}, {K}] {str(w.dtype)[6:]}, {'not ' if i % 2 else ''}contiguous",
                stored_transposed(w) if i % 2 else w,
            )
        )
    return cases


def _dequantize_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed + 1)
    pairs = [
        (
            "q = [[64, -127, 38], [0, 0, 0]], scales 1/127 and 0",
            torch.tensor([[64, -127, 38], [0, 0, 0]], dtype=torch.int8),
            torch.tensor([1 / 127, 0.0]),
        ),
        (
            "three rows with different scales",
            torch.tensor([[127, -127], [1, -1], [-64, 5]], dtype=torch.int8),
            torch.tensor([0.5, 3.0, 0.01]),
        ),
    ]
    table_q, table_s = engine_quantize_int8(_random_weights(rng, 300, 64))
    ids = torch.tensor([0, 299, 256, 5, 5, 128])
    pairs += [  # the engine's calls: a quantized token table's rows (Quantization.rows), scales in the model's dtype
        ("rows of a quantized table, gathered (ids [0, 299, 256, 5, 5, 128])", table_q[ids], table_s[ids]),
        ("float16 scales (a float16 model's table): the result is float32", table_q[:7], table_s[:7].half()),
        ("bfloat16 scales (a bfloat16 model's table): the result is float32", table_q[-5:], table_s[-5:].bfloat16()),
        ("float64 scales: the result is float32", table_q[10:14], table_s[10:14].double()),
    ]
    for i in range(n_random + 2):
        N, K = int(torch.randint(1, 30, (), generator=rng)), int(torch.randint(1, 150, (), generator=rng))
        q, scale = engine_quantize_int8(_random_weights(rng, N, K))
        scale = scale.to([torch.float32, torch.float16, torch.bfloat16][i % 3])
        pairs.append((f"random #{i}: [{N}, {K}], {str(scale.dtype)[6:]} scales", q, scale))
    return [Case(d, (q, s), later(engine_dequantize_int8, q, s)) for d, q, s in pairs]


DEQUANTIZE_INT8_MISTAKES = [
    (
        lambda q, s: q.float() * s.float()[None, : q.shape[1]],
        "each ROW has its scale: q * scale[:, None] (scale[None, :] multiplies columns)",
    ),
    (lambda q, s: q.float() / s.float()[:, None], "dequantizing multiplies: w ≈ q * scale (quantizing divided)"),
    (lambda q, s: q.float() * s.float()[:, None] / 127, "the scale already holds the / 127: w ≈ q * scale"),
]


def _dequantize_judge(mistakes: list) -> Callable[[Case, Any], Verdict]:
    def judge(case: Case, got: Any) -> Verdict:
        problem = tensor_problem(got, case.expected, atol=1e-7, rtol=1e-5)
        if problem is None:
            return None
        hint = ""
        if isinstance(got, Tensor) and got.dtype != torch.float32 and got.is_floating_point():
            scales = case.args[1]
            hint = (
                f"the weights are float32 whatever the scales' dtype (here {scales.dtype}): q.float() * "
                "scale.float()[...]"
                if got.dtype == scales.dtype
                else "return float32 (q.float() * ...)"
            )
        for fn, h in mistakes:
            try:
                candidate = fn(*case.args)
            except Exception:
                continue
            if (
                isinstance(got, Tensor)
                and candidate.shape == got.shape
                and torch.allclose(got.double(), candidate.double(), rtol=1e-5, atol=1e-7, equal_nan=True)
            ):
                hint = h
                break
        return problem, hint

    return judge


def check_quantize_int8(
    quantize_int8: Callable, dequantize_int8: Callable, *, seed: int = 0, n_random: int = 4
) -> None:
    """quantize_int8(w) -> (q [N, K] int8, scale [N] float32), absmax per row; dequantize_int8(q, scale)."""

    def show_w(args):
        return f"quantize_int8({short(args[0], 160)}{'' if args[0].is_contiguous() else ' (a transposed view)'})"

    run_check(
        "quantize_int8",
        quantize_int8,
        int8_cases(seed, n_random),
        judge=_quantize_int8_verdict,
        forbid=FORBID,
        show_call=show_w,
        seconds=5,
        total_seconds=20,
        error_hints=VIEW_HINTS,
    )
    run_check(
        "dequantize_int8",
        dequantize_int8,
        _dequantize_cases(seed, n_random),
        judge=_dequantize_judge(DEQUANTIZE_INT8_MISTAKES),
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
        error_hints={"Byte": "convert q to float first (q.float()): int8 times a float scale is not a float32 tensor"},
    )
    check_in_engine(
        "int8",
        {"quantize_int8": quantize_int8, "dequantize_int8": dequantize_int8},
        {
            "quantize_int8": (_quantize_int8_verdict, engine_quantize_int8),
            "dequantize_int8": (_dequantize_judge(DEQUANTIZE_INT8_MISTAKES), engine_dequantize_int8),
        },
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: pack_int4, unpack_int4


def _pack_hi_first(q):
    n = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return (n[..., 0::2] << 4) | n[..., 1::2]


def _pack_offset(q):
    n = (q.to(torch.int16) + 8).to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def _pack_as_int8(q):
    n = q.to(torch.int16) & 0xF
    return (n[..., 0::2] | (n[..., 1::2] << 4)).to(torch.int8)


def _pack_halves(q):
    K = q.shape[-1]
    n = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return n[..., : K // 2] | (n[..., K // 2 :] << 4)


def _pack_unmasked(q):
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def _pack_memory_order(q):
    n = (torch.as_strided(q, (q.numel(),), (1,)).to(torch.int16) & 0xF).to(torch.uint8)
    return (n[0::2] | (n[1::2] << 4)).reshape(*q.shape[:-1], -1)


PACK_MISTAKES = [
    (
        _pack_hi_first,
        "the nibbles are in the wrong order: value 2i goes in the LOW nibble (bits 0-3) of byte i, "
        "value 2i + 1 in the high nibble (bits 4-7)",
    ),
    (
        _pack_offset,
        "this is the offset (+8) encoding; the format is two's complement: -1 is 0b1111 (q & 0xF), 0 is 0b0000",
    ),
    (
        _pack_halves,
        "pair NEIGHBOURS: byte i holds values 2i and 2i + 1 (q[..., 0::2] and q[..., 1::2]), not values i and i + K/2",
    ),
    (
        _pack_unmasked,
        "a negative value's sign bits spill into the other nibble: in int8, -1 is 0xFF, so "
        "`lo | (hi << 4)` turns the high nibble to 1111 — keep only 4 bits of each value (q & 0xF) "
        "before combining",
    ),
    (
        _pack_memory_order,
        "your pack_int4 reads q's memory as if its rows were contiguous (as_strided, "
        "untyped_storage, data_ptr, numpy's buffer): quantize_int4 passes a transposed view, whose "
        "neighbours in a row are far apart in memory; index the tensor (q[..., 0::2]) instead",
    ),
]
PACK_ERROR_HINTS = {
    "shift": "shift unsigned bytes: convert the nibbles to torch.uint8 before `<< 4`",
    "view size is not compatible": "quantize_int4 passes pack_int4 the values of a layer's weight.T, a transposed "
    "view: view() cannot merge its dimensions; use reshape, or index q[..., 0::2] "
    "and q[..., 1::2] as they are",
}


def _unpack_no_sign(p):
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.int8)


def _unpack_hi_first(p):
    v = torch.stack([p >> 4, p & 0xF], dim=-1).flatten(-2).to(torch.int8)
    return v - 16 * (v >= 8).to(torch.int8)


def _unpack_offset(p):
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.int8) - 8


def _unpack_halves(p):
    v = torch.cat([p & 0xF, p >> 4], dim=-1).to(torch.int8)
    return v - 16 * (v >= 8).to(torch.int8)


UNPACK_MISTAKES = [
    (
        _unpack_no_sign,
        "the sign is lost: nibbles 8..15 are the negative values -8..-1 (two's complement): subtract 16 from those",
    ),
    (
        _unpack_hi_first,
        "the nibbles are in the wrong order: the LOW nibble of byte i is value 2i, the high nibble value 2i + 1",
    ),
    (
        _unpack_offset,
        "this undoes the offset (+8) encoding; the format is two's complement: nibble 15 is -1, nibble 1 is 1",
    ),
    (
        _unpack_halves,
        "interleave: byte i gives values 2i and 2i + 1 (stack low and high on a new last "
        "dimension, then flatten), not the lows then the highs",
    ),
]


def _mistake_hint(mistakes: list, args: tuple, got: Any, expected: Tensor) -> str:
    """The hint of the first mistake whose answer is `got`'s values and is wrong here."""
    for fn, hint in mistakes:
        try:
            candidate = fn(*args)
        except Exception:
            continue
        if (
            isinstance(got, Tensor)
            and got.shape == candidate.shape
            and torch.equal(got.long(), candidate.long())
            and not (candidate.shape == expected.shape and torch.equal(candidate.long(), expected.long()))
        ):
            return hint
    return ""


def _odd_count_hint(q: Tensor, got: Any) -> str:
    """What a pack_int4 that returned bytes for an odd number of values did with the odd one, or ''."""
    if not isinstance(got, Tensor) or got.dim() != q.dim() or got.shape[:-1] != q.shape[:-1]:
        return ""
    K = q.shape[-1]
    if got.shape[-1] == K // 2:
        return (
            f"your bytes hold {K - 1} of the {K} values: K // 2 = {K // 2} bytes truncate the odd one away; the "
            f"format has no place for it — raise ValueError, naming the size {K}"
        )
    if got.shape[-1] == (K + 1) // 2:
        return (
            f"you padded the odd value with a zero nibble: {(K + 1) // 2} bytes unpack to {K + 1} values, not {K}; "
            f"the format refuses an odd count — raise ValueError, naming the size {K}"
        )
    return ""


def _pack_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(case.expected, Refusal):
        verdict = refusal_verdict(case.expected, got)
        hint = _odd_count_hint(case.args[0], got) if verdict else ""
        return (verdict[0], hint) if hint else verdict
    wrong = unexpected_error(got)
    if wrong:
        return wrong
    if isinstance(got, Tensor) and got.shape == case.expected.shape and got.dtype == torch.int8:
        return (
            f"expected dtype torch.uint8, got {got.dtype}",
            "bytes are unsigned (torch.uint8): in int8 a byte >= 128 becomes negative and `>> 4` keeps its sign",
        )
    problem = tensor_problem(got, case.expected)
    if problem:
        return problem, _mistake_hint(PACK_MISTAKES, case.args, got, case.expected)
    return None


def _unpack_verdict(case: Case, got: Any) -> Verdict:
    problem = tensor_problem(got, case.expected)
    if problem:
        hint = _mistake_hint(UNPACK_MISTAKES, case.args, got, case.expected)
        if not hint and isinstance(got, Tensor) and got.dtype != torch.int8:
            hint = "return int8 values (.to(torch.int8))"
        return problem, hint
    return None


def pack_cases(seed: int, n_random: int) -> list[Case]:
    def case(description, values, hint=""):
        q = torch.tensor(values, dtype=torch.int8) if not isinstance(values, Tensor) else values
        return Case(description, (q,), later(engine_pack_int4, q), hint)

    def values(*shape):
        return torch.randint(-8, 8, shape, generator=rng, dtype=torch.int8)

    rng = torch.Generator().manual_seed(seed)
    wide = (
        "rows of more than 255 values: an index, a count or a shift held in uint8 or int8 wraps at 256 (or "
        "overflows at 128)"
    )
    transposed = (
        "quantize_int4 passes the values of a layer's weight.T: a transposed view (strides (1, N)), "
        "not contiguous in memory; view() cannot merge its dimensions and its memory is not in row order"
    )
    cases = [
        case("[1, 2] -> 0x21", [1, 2], hint="value 2i in the low nibble: 1 | (2 << 4) = 0x21"),
        case("[-1, 0] -> 0x0F", [-1, 0], hint="-1 in 4-bit two's complement is 0b1111 = 15: (-1) & 0xF"),
        case("[-8, 7] -> 0x78", [-8, 7], hint="-8 is 0b1000, 7 is 0b0111: 8 | (7 << 4) = 0x78"),
        case("[0, -1] -> 0xF0", [0, -1]),
        case("[-8, -8, 7, 7, 0, -3]", [-8, -8, 7, 7, 0, -3]),
        case("a batch of rows [2, 4]", [[1, 2, 3, 4], [-1, -2, -3, -4]], hint="pack along the last dimension"),
        case("leading dimensions [2, 3, 8]", values(2, 3, 8)),
        case(
            "every pair of values: 256 pairs in one row [512]",
            torch.stack(torch.meshgrid(torch.arange(-8, 8), torch.arange(-8, 8), indexing="ij"), -1)
            .flatten()
            .to(torch.int8),
            hint=wide,
        ),
        case("a [260, 768] matrix (rows and columns past 255)", values(260, 768), hint=wide),
        case(
            "a transposed view [576, 192] (as quantize_int4 passes c_attn's weight.T)",
            values(192, 576).T,
            hint=transposed,
        ),
        case("a transposed view [300, 512]", values(512, 300).T, hint=transposed),
        case("one row of a transposed view [1, 64]", values(64, 5).T[2:3], hint=transposed),
        Case(
            "odd size: 3 values",
            (torch.tensor([1, 2, 3], dtype=torch.int8),),
            Refusal(3, "an odd number of values cannot fill whole bytes"),
        ),
        Case(
            "odd size: [2, 5]",
            (torch.zeros(2, 5, dtype=torch.int8),),
            Refusal(5, "an odd number of values in the last dimension"),
        ),
    ]
    for i in range(n_random):
        shape = [
            int(torch.randint(1, 6, (), generator=rng)) for _ in range(int(torch.randint(0, 3, (), generator=rng)))
        ]
        K = 2 * int(torch.randint(1, 300, (), generator=rng))
        q = values(*shape, K) if i % 2 or not shape else values(*shape[:-1], K, shape[-1]).transpose(-1, -2)
        cases.append(case(f"random #{i}: {[*q.shape]}{'' if q.is_contiguous() else ', a transposed view'}", q))
    return cases


def two_packs_cases(seed: int) -> list[Case]:
    """Two calls, both results kept: a buffer kept between calls and returned is overwritten by the next call."""
    rng = torch.Generator().manual_seed(seed + 3)
    q1, q2, q3 = (torch.randint(-8, 8, (4, 64), generator=rng, dtype=torch.int8) for _ in range(3))
    return [
        Case(
            "pack_int4(q1), then pack_int4(q2) of the same shape [4, 64]: both results",
            (q1, q2),
            later(lambda a, b: (engine_pack_int4(a), engine_pack_int4(b)), q1, q2),
        ),
        Case(
            "pack_int4(q1) [4, 64], then pack_int4(q2) [2, 64]: both results",
            (q3, q2[:2]),
            later(lambda a, b: (engine_pack_int4(a), engine_pack_int4(b)), q3, q2[:2]),
        ),
    ]


def _two_packs_verdict(case: Case, got: Any) -> Verdict:
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"expected the two results, got {short(got, 80)}", ""
    for which, g, e in zip(("first", "second"), got, case.expected):
        problem = tensor_problem(g, e)
        if problem:
            return (
                f"the {which} result: {problem}",
                "pack_int4 gave the right bytes for q1 alone, but they changed when it was called again: "
                "return a new tensor from each call (a buffer kept between calls, e.g. a module-level "
                "torch.empty sliced to size, is overwritten by the next call — quantize_model keeps every "
                "layer's packed bytes)",
            )
    return None


def unpack_cases(seed: int, n_random: int) -> list[Case]:
    def case(description, packed, hint=""):
        return Case(description, (packed,), later(engine_unpack_int4, packed), hint)

    rng = torch.Generator().manual_seed(seed + 1)
    cases = [
        case("0x21 -> [1, 2]", torch.tensor([0x21], dtype=torch.uint8), hint="the low nibble is the first value"),
        case("0x0F -> [-1, 0]", torch.tensor([0x0F], dtype=torch.uint8), hint="nibble 15 is -1"),
        case("0x78 -> [-8, 7]", torch.tensor([0x78], dtype=torch.uint8), hint="nibble 8 is -8"),
        case(
            "all 256 bytes",
            torch.arange(256, dtype=torch.int64).to(torch.uint8),
            hint="nibbles 0..7 are 0..7, nibbles 8..15 are -8..-1",
        ),
        case("all 256 bytes as a [16, 16] matrix", torch.arange(256).to(torch.uint8).view(16, 16)),
        case(
            "a [260, 384] matrix (rows and columns past 255, as a layer's [260, 768] values)",
            engine_pack_int4(torch.randint(-8, 8, (260, 768), generator=rng, dtype=torch.int8)),
            hint="rows of more than 255 bytes: an index or a count held in uint8 wraps at 256",
        ),
    ]
    for i in range(n_random):
        shape = [
            int(torch.randint(1, 6, (), generator=rng)) for _ in range(int(torch.randint(0, 3, (), generator=rng)))
        ]
        q = torch.randint(
            -8, 8, (*shape, 2 * int(torch.randint(1, 300, (), generator=rng))), generator=rng, dtype=torch.int8
        )
        cases.append(case(f"random #{i}: packed {[*shape, q.shape[-1] // 2]}", engine_pack_int4(q)))
    return cases


def check_pack_int4(pack_int4: Callable, unpack_int4: Callable, *, seed: int = 0, n_random: int = 6) -> None:
    """pack_int4(q [..., K] int8 in [-8, 7]) -> [..., K // 2] uint8 (value 2i low nibble); unpack_int4 inverts it."""

    def show_q(args):
        (q,) = args
        return f"pack_int4({short(q, 120)}{'' if q.is_contiguous() else f', a transposed view, strides {q.stride()}'})"

    run_check(
        "pack_int4",
        catching_value_errors(pack_int4),
        pack_cases(seed, n_random),
        judge=_pack_verdict,
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
        error_hints=PACK_ERROR_HINTS,
        show_call=show_q,
    )

    def two_packs(q1, q2):
        return pack_int4(q1), pack_int4(q2)

    run_check(
        "pack_int4, called twice",
        two_packs,
        two_packs_cases(seed),
        judge=_two_packs_verdict,
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
    )
    run_check(
        "unpack_int4",
        unpack_int4,
        unpack_cases(seed, n_random),
        judge=_unpack_verdict,
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
    )
    rng = torch.Generator().manual_seed(seed + 2)
    trips = []
    for i in range(n_random + 2):
        q = torch.randint(-8, 8, (3, 2 * int(torch.randint(1, 50, (), generator=rng))), generator=rng, dtype=torch.int8)
        trips.append(Case(f"random #{i}: unpack_int4(pack_int4(q)) == q, q {tuple(q.shape)}", (q,), q))

    def round_trip(q):
        return unpack_int4(pack_int4(q))

    run_check(
        "unpack_int4(pack_int4(q))",
        round_trip,
        trips,
        judge=lambda c, got: _roundtrip_verdict(c, got),
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
    )
    check_in_engine(
        "int4",
        {"pack_int4": pack_int4, "unpack_int4": unpack_int4},
        {"pack_int4": (_pack_verdict, engine_pack_int4), "unpack_int4": (_unpack_verdict, engine_unpack_int4)},
    )


def _roundtrip_verdict(case: Case, got: Any) -> Verdict:
    problem = tensor_problem(got, case.expected)
    return (problem, "unpack_int4 must give back exactly what pack_int4 was given") if problem else None


# ----------------------------------------------------------------------------------------------
# Exercise 3: quantize_int4, dequantize_int4


def _q4(w: Tensor, group_size: int, scale_of: Callable, *, half_first: bool = True, lo: int = -8, hi: int = 7):
    N, K = w.shape
    groups = w.float().view(N, K // group_size, group_size)
    scales = scale_of(groups)  # [N, G, 1]
    used = scales.half().float() if half_first else scales
    q = torch.round(groups / torch.where(used == 0, 1.0, used)).clamp(lo, hi).to(torch.int8)
    return engine_pack_int4(q.view(N, K)), scales.view(N, -1).half()


def _signed_extreme(groups):
    return groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)) / -8


INT4_MISTAKES = [
    (
        lambda w, g=32: _q4(w, g, lambda x: x.abs().amax(dim=-1, keepdim=True) / 7),
        "Q4_0's rule: the value of largest magnitude m (with its sign) maps to -8: scale = m / -8. absmax / 7 "
        "wastes the level -8",
    ),
    (
        lambda w, g=32: _q4(w, g, lambda x: x.abs().amax(dim=-1, keepdim=True) / 8),
        "the scale keeps the extreme's sign: scale = m / -8 where m is the value of largest magnitude (so m "
        "itself becomes -8; with max|w| / 8 a positive extreme would be 8, out of range)",
    ),
    (
        lambda w, g=32: _q4(w, g, _signed_extreme, half_first=False),
        "round the scale to float16 BEFORE dividing by it: the values must be those the stored (float16) scale "
        "reproduces",
    ),
    (
        lambda w, g=32: _q4(w, g, lambda x: x.abs().amax(dim=-1, keepdim=True) / 127),
        "4 bits: the extreme maps to -8, not ±127",
    ),
]


def _int4_values(w: Tensor, scales: Tensor) -> Tensor:
    """w / scale in float64, with each group's scale (0 -> 1)."""
    N, K = w.shape
    s = scales.double()
    s = torch.where(s == 0, 1.0, s).repeat_interleave(K // scales.shape[1], dim=1)
    return w.double() / s


def _partial_group_hint(w: Tensor, group_size: int, got: Any) -> str:
    """What a quantize_int4 that returned scales for a row of K not a multiple of group_size did, or ''."""
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], Tensor) and got[1].dim() == 2):
        return ""
    K, G = w.shape[1], got[1].shape[1]
    if G == K // group_size:
        return (
            f"your scales cover {G * group_size} of the {K} values of a row: K // group_size = {G} groups drop the "
            f"last {K % group_size}; a row must split into whole groups — raise ValueError, naming {K}"
        )
    if G == -(-K // group_size):
        return (
            f"your last group holds only {K % group_size} values: a row must split into whole groups of "
            f"{group_size} — raise ValueError, naming {K}"
        )
    return ""


def _quantize_int4_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(case.expected, Refusal):
        verdict = refusal_verdict(case.expected, got)
        hint = _partial_group_hint(case.args[0], case.args[1], got) if verdict else ""
        return (verdict[0], hint) if hint else verdict
    wrong = unexpected_error(got)
    if wrong:
        return wrong
    problem = _pair(got, "packed, scales")
    if problem:
        return problem, "return packed, scales"
    w, group_size = case.args if len(case.args) == 2 else (case.args[0], 32)
    packed, scales = got
    epacked, escales = case.expected
    N, K = w.shape
    G = K // group_size
    if scales.shape != (N, G):
        hint = f"a scale per group of {group_size} consecutive values of a row: [N, K // {group_size}] = [{N}, {G}]"
        if len(case.args) == 1 and len(scales.shape) == 2 and scales.shape[0] == N:
            hint = (
                "the engine calls quantize_int4(w) without group_size: the default must be 32 "
                "(def quantize_int4(w, group_size=32))"
            )
        elif scales.shape == (N,) or scales.shape == (N, 1):
            hint = f"one scale per GROUP of {group_size} values, not per row: shape [{N}, {G}]"
        elif scales.shape == (N // group_size, K) if N % group_size == 0 else False:
            hint = (
                f"groups run ALONG a row (the input dimension): view the rows as [N, K // {group_size}, "
                f"{group_size}], not columns"
            )
        return f"scales: expected shape {(N, G)}, got {tuple(scales.shape)}", hint
    if scales.dtype != torch.float16:
        return (
            f"scales: expected dtype torch.float16, got {scales.dtype}",
            "store the scales in float16 (.half()), and divide by that rounded scale",
        )
    if packed.shape != (N, K // 2) or packed.dtype != torch.uint8:
        return (
            f"packed: expected a torch.uint8 tensor of shape {(N, K // 2)}, got {packed.dtype} {tuple(packed.shape)}",
            "pack the values with your pack_int4",
        )

    def mistake() -> str:  # computed only for a wrong answer (the engine's calls include GPT-2's token table)
        return next((h for fn, h in INT4_MISTAKES if _same_packed(got, _try(fn, w, group_size))), "")

    # A group whose largest magnitude is reached by +m and -m alike (GPT-2's weights have some) may take either as
    # its extreme: the scale is then ±m / 8, and the values follow the scale chosen.
    groups = w.double().reshape(N, G, group_size)
    peak = groups.abs().amax(-1)
    tie = (groups == peak[..., None]).any(-1) & (groups == -peak[..., None]).any(-1) & (peak > 0)
    other = tie & (scales == -escales)
    if bool(other.any()):
        escales = torch.where(other, scales, escales)
        q = torch.round(groups / torch.where(escales == 0, 1.0, escales.double())[..., None]).clamp(-8, 7)
        epacked = engine_pack_int4(q.to(torch.int8).reshape(N, K))
    problem = tensor_problem(scales, escales, atol=0, rtol=0)
    if problem:
        named = mistake()
        if bool((escales < 0).any()) and bool((scales >= 0).all()) and not named:
            named = "the scale keeps the extreme's sign: m / -8, with m the value of largest magnitude in the group"
        return f"scales: {problem}", named or floor_hint(escales.float(), scales != escales, "group")
    ratio = _int4_values(w, escales)
    values, evalues = engine_unpack_int4(packed), engine_unpack_int4(epacked)
    problem = values_problem(values, evalues, ratio, "the 4-bit values")
    if problem:
        bad_groups = ((values.long() - evalues.long()).abs() > 1).reshape(N, G, group_size).any(-1)
        return problem, mistake() or floor_hint(escales.float(), bad_groups, "group")
    return None


def _try(fn, *args):
    """fn(*args) of a known mistake, or None if it cannot run here (its warnings, e.g. a std of one value, unshown)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except Exception:
        return None


def _same_packed(got: tuple, candidate: Optional[tuple]) -> bool:
    if candidate is None:
        return False
    return all(
        isinstance(a, Tensor) and a.shape == b.shape and torch.equal(a.double(), b.double())
        for a, b in zip(got, candidate)
    )


def fp16_boundary_weights() -> Tensor:
    """A row where dividing by the float32 scale and by the stored float16 scale round differently."""
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0001  # scale m / -8 = -0.1250125 in float32, -0.125 in float16
    w[0, 1] = 2.5 * 0.12500625  # / -0.125 -> -2.50005 (-3); / -0.1250125 -> -2.49998 (-2)
    w[0, 2] = -0.3
    return w


def int4_cases(seed: int, n_random: int) -> list[Case]:
    def case(description, w, group_size=32, hint=""):
        return Case(description, (w, group_size), later(engine_quantize_int4, w, group_size), hint)

    def as_engine(description, w, hint=""):
        """quantize_int4(w), without group_size: as quantize_model calls it (a wrong default must fail)."""
        return Case(
            f"{description}; called as the engine calls it, quantize_int4(w)",
            (w,),
            later(engine_quantize_int4, w),
            hint,
        )

    rng = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(-1.0, 0.6, 32)[None]
    two_groups = torch.cat([torch.linspace(-0.4, 0.8, 32), torch.linspace(-30.0, 10.0, 32)])[None]
    cases = [
        case(
            "one group, the extreme -1.0 maps to -8",
            ramp,
            hint="m = -1.0 (largest magnitude, with its sign): scale = m / -8 = 0.125, q = round(w / 0.125)",
        ),
        case(
            "one group, a positive extreme: the scale is negative",
            -ramp,
            hint="m = 1.0: scale = 1.0 / -8 = -0.125, so 1.0 -> -8 and -0.6 -> 5",
        ),
        case("two groups of very different sizes", two_groups, hint="each group of 32 has its own scale"),
        case(
            "the float16 rounding of the scale matters",
            fp16_boundary_weights(),
            hint="round the scale to float16 first (scale = (m / -8).half()), then divide by that rounded scale",
        ),
        case(
            "an all-zero group",
            torch.cat([torch.zeros(1, 32), torch.ones(1, 32)], dim=1),
            hint="an all-zero group gets scale 0 and values 0",
        ),
        case("groups of 16", _random_weights(rng, 3, 64), group_size=16),
        case("groups of 64, [5, 128]", _random_weights(rng, 5, 128), group_size=64),
        case("float64 input", _random_weights(rng, 2, 96, torch.float64)),
        case("float16 input", _random_weights(rng, 3, 64, torch.float16)),
        case("a single row [1, 32]", _random_weights(rng, 1, 32)),
        Case(
            "K = 48 is not a multiple of 32",
            (torch.zeros(2, 48), 32),
            Refusal(48, "a row must split into whole groups"),
        ),
        Case("K = 40 with groups of 16", (torch.zeros(1, 40), 16), Refusal(40, "a row must split into whole groups")),
        as_engine(
            "a layer's weight.T [96, 64] (a transposed view, not contiguous)",
            stored_transposed(_random_weights(rng, 96, 64)),
            hint="quantize_model passes Affine.weight.T, a transposed view: use reshape (view cannot merge its "
            "dimensions)",
        ),
        as_engine(
            "a float16 model's weight.T [64, 96]", stored_transposed(_random_weights(rng, 64, 96, torch.float16))
        ),
        as_engine(
            "a bfloat16 model's weight.T [32, 128]", stored_transposed(_random_weights(rng, 32, 128, torch.bfloat16))
        ),
        as_engine(
            "GPT-2's sizes: weight.T [300, 768] (24 groups a row)", stored_transposed(_random_weights(rng, 300, 768))
        ),
        as_engine("a token table [97, 32] (contiguous)", _random_weights(rng, 97, 32)),
        case(
            "tiny values: the float16 scale is subnormal",
            _random_weights(rng, 2, 64) * 1e-5,
            hint="round the scale to float16 first (scale = (m / -8).half()), then divide by that rounded scale",
        ),
        case(
            "groups of tiny values: scales far below float16's normal range (~1e-7), and one that rounds to 0 in "
            "float16 (values ~1e-8), beside a normal group",
            torch.cat(
                [torch.linspace(-0.5, 1.0, 32), torch.linspace(-1e-6, 8e-7, 32), torch.linspace(-1e-8, 2e-8, 32)]
            ).reshape(1, 96),
        ),
        case("groups of 128, [4, 768]", _random_weights(rng, 4, 768), group_size=128),
        case("one group a row: group_size = K = 96", _random_weights(rng, 3, 96), group_size=96),
        case("groups of 2", _random_weights(rng, 2, 8), group_size=2),
    ]
    for i in range(n_random):
        N = int(torch.randint(1, 40, (), generator=rng))
        K = 32 * int(torch.randint(1, 9, (), generator=rng))
        w = _random_weights(rng, N, K, [torch.float32, torch.float16, torch.bfloat16][i % 3])
        if i % 2:
            cases.append(as_engine(f"random #{i}: weight.T [{N}, {K}] {str(w.dtype)[6:]}", stored_transposed(w)))
        else:
            cases.append(case(f"random #{i}: [{N}, {K}] {str(w.dtype)[6:]}", w))
    return cases


DEQUANTIZE_INT4_MISTAKES = [
    (
        lambda p, s: (
            _unpack_no_sign(p).float().view(p.shape[0], s.shape[1], -1).mul(s.float()[..., None]).view(p.shape[0], -1)
        ),
        "the 4-bit values are signed: unpack nibbles 8..15 as -8..-1",
    ),
    (
        lambda p, s: engine_unpack_int4(p).float() * s.float()[:, :1],
        "each group of K // G values has its own scale: view the values as [N, G, K // G] and multiply by "
        "scales[..., None]",
    ),
    (
        lambda p, s: (engine_unpack_int4(p).float().view(p.shape[0], -1, s.shape[1]) * s.float()[:, None, :]).view(
            p.shape[0], -1
        ),
        "a group is K // G CONSECUTIVE values: view as [N, G, K // G] (not [N, K // G, G])",
    ),
]


def _dequantize_int4_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed + 1)
    ws = [
        (
            "two groups of very different sizes",
            torch.cat([torch.linspace(-0.4, 0.8, 32), torch.linspace(-30.0, 10.0, 32)])[None],
            32,
        ),
        ("groups of 16, [3, 64]", _random_weights(rng, 3, 64), 16),
    ]
    ws.append(("GPT-2's sizes: [300, 768]", _random_weights(rng, 300, 768), 32))
    for i in range(n_random + 1):
        N, K = int(torch.randint(1, 30, (), generator=rng)), 32 * int(torch.randint(1, 8, (), generator=rng))
        ws.append((f"random #{i}: [{N}, {K}]", _random_weights(rng, N, K), 32))
    cases = []
    for description, w, g in ws:
        packed, scales = engine_quantize_int4(w, g)
        cases.append(Case(description, (packed, scales), later(engine_dequantize_int4, packed, scales)))
    packed, scales = engine_quantize_int4(_random_weights(rng, 300, 64))
    ids = torch.tensor([0, 299, 256, 7, 7])  # the engine's call for a quantized token table's rows
    cases.append(
        Case(
            "rows of a quantized table, gathered (ids [0, 299, 256, 7, 7])",
            (packed[ids], scales[ids]),
            later(engine_dequantize_int4, packed[ids], scales[ids]),
        )
    )
    return cases


def check_quantize_int4(
    quantize_int4: Callable, dequantize_int4: Callable, *, seed: int = 0, n_random: int = 4
) -> None:
    """quantize_int4(w, group_size) -> (packed [N, K // 2] uint8, scales [N, K // group_size] float16), Q4_0;
    dequantize_int4(packed, scales) -> [N, K] float32."""

    def show_w(args):
        w = args[0]
        layout = "" if w.is_contiguous() else " (a transposed view)"
        return f"quantize_int4({short(w, 140)}{layout}" + (f", group_size={args[1]})" if len(args) > 1 else ")")

    run_check(
        "quantize_int4",
        catching_value_errors(quantize_int4),
        int4_cases(seed, n_random),
        judge=_quantize_int4_verdict,
        forbid=FORBID,
        show_call=show_w,
        seconds=5,
        total_seconds=20,
        error_hints=VIEW_HINTS,
    )
    run_check(
        "dequantize_int4",
        dequantize_int4,
        _dequantize_int4_cases(seed, n_random),
        judge=_dequantize_judge(DEQUANTIZE_INT4_MISTAKES),
        forbid=FORBID,
        seconds=5,
        total_seconds=20,
    )
    check_in_engine(
        "int4",
        {"quantize_int4": quantize_int4, "dequantize_int4": dequantize_int4},
        {
            "quantize_int4": (_quantize_int4_verdict, engine_quantize_int4),
            "dequantize_int4": (_dequantize_judge(DEQUANTIZE_INT4_MISTAKES), engine_dequantize_int4),
        },
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: int8_linear, the integer route


UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# aten's matrix products: the integer route may run them on integers only (int32 sums, or torch._int_mm)
MATRIX_PRODUCTS = {"mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear"}


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


class FloatProducts(DispatchWatch):
    """Records the matrix products on floating-point tensors that run while it is active (aten, however reached),
    and the float elementwise products with at least `outer` numbers: x [M, K] times q [N, K] broadcast to
    [M, N, K] before a sum is the same float route without a matmul."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the forbid watch's mode: no torch._dynamo import on first use

    def __init__(self, outer: float = math.inf):
        super().__init__()
        self.seen: list[str] = []
        self.outer = outer

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, Tensor)]
        out = func(*args, **(kwargs or {}))
        if name in MATRIX_PRODUCTS and any(t.is_floating_point() for t in tensors):
            self.seen.append(f"aten.{name} on {' x '.join(f'{str(t.dtype)[6:]} {list(t.shape)}' for t in tensors)}")
        elif name in ("mul", "mul_") and _is_float(out) and self.outer <= out.numel() > max(t.numel() for t in tensors):
            self.seen.append(f"aten.{name} broadcast to {str(out.dtype)[6:]} {list(out.shape)}, then summed")
        return out


class Traced:
    """A learner's result with the float matrix products its call ran."""

    def __init__(self, result: Any, float_products: list[str]):
        self.result, self.float_products = result, float_products

    def __repr__(self) -> str:
        return short(self.result)


class watching_products:  # noqa: N801 (used as a function)
    """fn, returning a `Traced`: its result and the float matrix products it ran. A class: the watch refuses the
    checks' own functions, not their methods."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        x, q = (args + (None, None))[:2]
        tensors = isinstance(x, Tensor) and isinstance(q, Tensor) and q.dim() == 2 and q.shape[1] > 1
        outer = x.numel() * q.shape[0] if tensors else math.inf  # M · N · K numbers: the products of x and q
        with FloatProducts(outer) as products:
            result = self.fn(*args)
        return Traced(result, products.seen)


def _rows_int8(rows: Tensor, scale_of: Callable, rounding=torch.round) -> tuple[Tensor, Tensor]:
    """rows [M, K] -> (xq [M, K] float64 integers, xs broadcastable to rows), with the given scale and rounding."""
    rows = rows.float()
    xs = scale_of(rows)
    return rounding(rows / torch.where(xs == 0, 1.0, xs)).clamp(-127, 127), xs


def _integer_route(
    scale_of: Callable = lambda r: r.abs().amax(-1, keepdim=True) / 127,
    *,
    rounding=torch.round,
    accumulate: Optional[torch.dtype] = None,
) -> Callable:
    """The integer route with one of its parts swapped for a known mistake (exact sums, in float64)."""

    def linear(x, q, scale, bias):
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = _rows_int8(rows, scale_of, rounding)
        if accumulate is None:
            sums = xq.double() @ q.double().T
        else:  # the products added in a narrow integer type: they wrap around
            sums = (xq.to(accumulate) @ q.to(accumulate).T).double()
        y = (sums * xs.double().reshape(-1, 1) * scale.double()).to(x.dtype).view(*x.shape[:-1], q.shape[0])
        return y if bias is None else y + bias

    return linear


INT8_LINEAR_MISTAKES = [
    (
        lambda x, q, s, b: (x.double() @ (q.double() * s.double()[:, None]).T).to(x.dtype) + (0 if b is None else b),
        "the activations were not quantized: the integer route rounds each row of x to int8 too (absmax per row, "
        "as quantize_int8 does for w), then multiplies integers by integers",
    ),
    (
        _integer_route(lambda r: r.abs().amax() / 127),
        "one activation scale for the whole batch (per tensor): a row's result then depends on the other rows "
        "(batch-dependent); give each row (token) of x its own scale, max|row| / 127",
    ),
    (
        _integer_route(lambda r: r.abs().amax(0, keepdim=True) / 127),
        "the activations' scale was taken per column (over the tokens): take it per row, max|x[m]| / 127 over "
        "the K inputs of token m",
    ),
    (
        _integer_route(rounding=torch.trunc),
        "rounding by truncation (.to(torch.int8) or trunc drops the fraction): round to the nearest integer "
        "first (torch.round)",
    ),
    (
        _integer_route(accumulate=torch.int8),
        "the sums overflowed: int8 @ int8 adds in int8, which wraps around above 127; convert both to int32 "
        "first (x_q.to(torch.int32) @ q.to(torch.int32).T) or use torch._int_mm",
    ),
    (
        _integer_route(accumulate=torch.int16),
        "the sums overflowed int16 (127 · 127 is already 16,129): accumulate in int32",
    ),
    (
        lambda x, q, s, b: _integer_route()(x, q, torch.ones_like(s), b),
        "multiply each sum by both scales: s_x[m] · scale[n] (the weights' scale is missing)",
    ),
    (
        lambda x, q, s, b: _integer_route(lambda r: torch.ones(r.shape[0], 1))(x, q, s, b),
        "the activations' scale must be applied: y = sums · s_x[m] · scale[n] (s_x is missing, or x was not "
        "divided by it)",
    ),
    (
        lambda x, q, s, b: _integer_route(lambda r: (x.reshape(r.shape).abs().amax(-1, keepdim=True) / 127).float())(
            x, q, s, b
        ),
        "compute the activations' scale in float32 (x.float()), as quantize_int8 does: in bfloat16 or float16 it is "
        "rounded, and many values round to the other neighbour",
    ),
]


def _activation_ties(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (where x / s_x is a near-tie [M, K], s_x [M]) for the reference's per-row quantization."""
    rows = x.reshape(-1, x.shape[-1]).float()
    xs = rows.abs().amax(-1) / 127  # [M]
    ratio = rows / torch.where(xs == 0, 1.0, xs)[:, None]
    return _near_ties(ratio), xs


def _linear_tolerance(case: Case) -> tuple[Tensor, float]:
    """The accuracy asked of int8_linear: the integer sums are exact, so y is determined but for (1) an activation
    within 1e-4 of a rounding tie, which may go either way: a change of 1 in xq[m, k] moves y[m, n] by
    |q[n, k]| · s_x[m] · scale[n]; (2) the scaling, in float32 or wider (a few units of float32's rounding of the
    scaled sum, before the bias); (3) the result rounded to x's dtype and the bias added in it (a unit of its rounding
    of the scaled sum and of |bias|). -> (atol [..., N], rtol)."""
    x, q, scale, bias = case.args
    ties, xs = _activation_ties(x)
    u = UNIT_ROUNDOFF.get(x.dtype, 2.0**-24)
    flips = (ties.double() @ q.double().abs().T) * xs.double()[:, None] * scale.double().abs()  # [M, N]
    bias = torch.zeros(()) if bias is None else bias.double()
    scaled = (case.expected.double().reshape(flips.shape) - bias).abs()  # |y| before the bias
    atol = 1.01 * flips + 8 * 2.0**-24 * scaled + 2 * u * (scaled + bias.abs()) + 1e-30
    return atol.reshape(case.expected.shape), 0.0


def _close(got: Tensor, expected: Tensor, atol: Tensor, rtol: float) -> Tensor:
    return (got.double() - expected.double()).abs() <= atol + rtol * expected.double().abs()


def _linear_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(got, Traced):
        got, float_products = got.result, got.float_products
    else:
        float_products = []
    expected = case.expected
    if isinstance(got, Tensor) and got.shape == expected.shape and got.dtype != expected.dtype:
        return (
            f"returned dtype {got.dtype}; expected x's dtype {expected.dtype}",
            f"return x's dtype ({expected.dtype}): convert the scaled result with .to(x.dtype)",
        )
    problem = tensor_problem(got, expected, atol=0, rtol=0) if not isinstance(got, Tensor) else None
    if problem is None and got.shape != expected.shape:
        problem = f"returned shape {tuple(got.shape)}; expected {tuple(expected.shape)}"
        if expected.dim() >= 2 and got.shape == (*expected.shape[:-2], expected.shape[-1], expected.shape[-2]):
            return problem, "the output is [..., N]: x_q @ q.T, one column per row of q"
        return problem, "x may have any number of leading dimensions: reshape it to rows [M, K] and back"
    if problem:
        return problem, ""
    atol, rtol = _linear_tolerance(case)
    wrong = ~_close(got, expected, atol, rtol)
    if bool(wrong.any()):
        at = tuple(torch.nonzero(wrong)[0].tolist())
        problem = (
            f"differs at {int(wrong.sum())} of {wrong.numel()} outputs, first at {list(at)}: expected "
            f"{float(expected[at]):.8g}, got {float(got[at]):.8g} "
            f"(allowed: ±{float(atol[at] + rtol * abs(expected[at])):.3g})"
        )
        for fn, hint in INT8_LINEAR_MISTAKES:
            candidate = _try(fn, *case.args)
            if (
                isinstance(candidate, Tensor)
                and candidate.shape == got.shape
                and bool(_close(got, candidate, atol * 4 + 1e-6 * candidate.double().abs(), rtol).all())
                and not bool(_close(candidate, expected, atol, rtol).all())
            ):
                return problem, hint
        _, xs = _activation_ties(case.args[0])
        return (
            problem,
            floor_hint(xs, wrong.reshape(len(xs), -1).any(-1), "row")
            or "each row: s_x = max|row| / 127, x_q = round(row / s_x); then (x_q @ q.T in int32) · s_x · scale",
        )
    if float_products:
        return (
            f"the products were summed in floating point ({float_products[0]}): the exercise is the integer route",
            "multiply integers by integers and add them in int32: x_q.to(torch.int32) @ q.to(torch.int32).T (or "
            "torch._int_mm(x_q, q.T)); scale the int32 sums afterwards — scaling before summing, or dequantizing "
            "q to float, is the float route",
        )
    return None


def linear_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed)

    def layer(N, K, bias=True, dtype=torch.float32):
        q, scale = engine_quantize_int8(_random_weights(rng, N, K))  # a float64 model keeps float64 scales
        return q, scale.to(dtype), ((torch.randn(N, generator=rng) * 2).to(dtype) if bias else None)

    def case(description, x, q, scale, bias, hint=""):
        return Case(description, (x, q, scale, bias), later(engine_int8_linear, x, q, scale, bias), hint)

    def model_layer(N, K, dtype):  # as the engine holds it: scales and bias in the model's dtype
        q, scale, bias = layer(N, K)
        return q, scale.to(dtype), bias.to(dtype)

    q1 = torch.tensor([[127, -64, 0], [1, 2, 3]], dtype=torch.int8)
    s1 = torch.tensor([0.5, 2.0])
    # rows of very different sizes: with one scale for the batch the small rows lose their digits
    batch = torch.randn(4, 64, generator=rng) * torch.tensor([100.0, 0.01, 1.0, 3.0])[:, None]
    # K = 2048, every product positive and large: sums up to 127 · 127 · 2048 ≈ 3.3e7 need int32
    wide_x = torch.rand(2, 2048, generator=rng) * 0.2 + 0.8
    wide_q = (120 + torch.randint(0, 8, (3, 2048), generator=rng)).to(torch.int8)
    cases = [
        case(
            "x [1, 3] = [[0.5, 1.27, -0.254]], 2 outputs, no bias",
            torch.tensor([[0.5, 1.27, -0.254]]),
            q1,
            s1,
            None,
            hint="s_x = 1.27 / 127 = 0.01, x_q = [50, 127, round(-25.4) = -25]; int32 sums "
            "[6350 - 8128 + 0, 50 + 254 - 75] = [-1778, 229]; y = sums · 0.01 · [0.5, 2] = [-8.89, 4.58]",
        ),
        case("the same with a bias", torch.tensor([[0.5, 1.27, -0.254]]), q1, s1, torch.tensor([10.0, -1.0])),
        case(
            "4 rows of very different sizes (100, 0.01, 1, 3): each row its own scale",
            batch,
            *layer(24, 64),
            hint="a row's result must not depend on the other rows: one scale per row of x",
        ),
        case(
            "K = 2048, large positive products: the sums reach 3.3e7",
            wide_x,
            wide_q,
            torch.tensor([0.01, 0.02, 0.005]),
            None,
            hint="int8 x int8 products add up beyond int16 (and int8): accumulate in int32",
        ),
        case(
            "x rows that land on rounding ties: x_q = round(x / s_x) (round half to even or away from zero)",
            torch.tensor([[127.0, 0.5, 1.5, -2.5, 3.7, -3.7, 0.49, 0.51]]),
            torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [-8, 7, -6, 5, -4, 3, -2, 1]], dtype=torch.int8),
            torch.tensor([1.0, 0.5]),
            None,
            hint="round to the nearest integer (a tie may go either way); truncation would give 3 for 3.7",
        ),
        case(
            "a square layer [4, 4]: rows and columns could be confused",
            torch.randn(2, 4, generator=rng) * 3,
            *layer(4, 4),
        ),
        case(
            "x [B, T, K] = [2, 3, 24], 10 outputs",
            torch.randn(2, 3, 24, generator=rng) * 3,
            *layer(10, 24),
            hint="x may have any number of leading dimensions: [..., K] -> [..., N]",
        ),
        case(
            "a row of zeros in x (s_x = 0): its outputs are the bias",
            torch.cat([torch.zeros(1, 16), torch.randn(2, 16, generator=rng)]),
            *layer(6, 16),
            hint="an all-zero row: scale 0 and values 0 (do not divide by 0)",
        ),
        case(
            "rows of x of tiny values (max 3e-7, 2e-30): each its own scale, however small",
            torch.randn(2, 24, generator=rng) * torch.tensor([[3e-7], [2e-30]]),
            *layer(5, 24, bias=False),
        ),
        case(
            "float64 x: float64 out",
            torch.randn(3, 16, generator=rng, dtype=torch.float64) * 5,
            *layer(7, 16, dtype=torch.float64),
            hint="the output has x's dtype",
        ),
        case("one input row, many outputs", torch.randn(1, 32, generator=rng) * 10, *layer(96, 32)),
        case(
            "a zero row in q (scale 0)",
            torch.randn(2, 8, generator=rng),
            torch.cat([layer(3, 8)[0], torch.zeros(1, 8, dtype=torch.int8)]),
            torch.cat([layer(3, 8)[1], torch.zeros(1)]),
            None,
        ),
        case(
            "a float16 model: x [1, 3, 32], scales and bias float16 (as the engine passes them): float16 out",
            (torch.randn(1, 3, 32, generator=rng) * 3).half(),
            *model_layer(24, 32, torch.float16),
            hint="the output has x's dtype: float16 in, float16 out (the scales computed in float32)",
        ),
        case(
            "a bfloat16 model: x [2, 2, 64], scales and bias bfloat16: bfloat16 out",
            (torch.randn(2, 2, 64, generator=rng) * 3).bfloat16(),
            *model_layer(16, 64, torch.bfloat16),
            hint="the output has x's dtype: bfloat16 in, bfloat16 out (the scales computed in float32)",
        ),
        case(
            "one vector x [K] = [40]: y [N]",
            torch.randn(40, generator=rng) * 3,
            *layer(12, 40),
            hint="x may be a single vector: [K] -> [N]",
        ),
        case(
            "x a transposed view [3, 2, 48] (not contiguous)",
            (torch.randn(2, 3, 48, generator=rng) * 3).transpose(0, 1),
            *layer(20, 48),
            hint="x may be any view: use reshape (not view)",
        ),
        case(
            "GPT-2's sizes, one token (decoding): x [1, 1, 768], q [2304, 768]",
            torch.randn(1, 1, 768, generator=rng),
            *layer(2304, 768),
        ),
        case(
            "GPT-2's sizes, a prompt of 40 tokens: x [1, 40, 768], q [768, 768]",
            torch.randn(1, 40, 768, generator=rng),
            *layer(768, 768),
        ),
    ]
    for i in range(n_random):
        N, K = int(torch.randint(1, 80, (), generator=rng)), int(torch.randint(1, 120, (), generator=rng))
        lead = [int(torch.randint(1, 5, (), generator=rng)) for _ in range(int(torch.randint(1, 3, (), generator=rng)))]
        dtype = [torch.float32, torch.float64, torch.float16, torch.bfloat16][i % 4]
        cases.append(
            case(
                f"random #{i}: x {[*lead, K]} {str(dtype)[6:]}, q [{N}, {K}]",
                (torch.randn(*lead, K, generator=rng, dtype=torch.float64) * 4).to(dtype),
                *layer(N, K, bias=bool(i % 3), dtype=dtype),
            )
        )
    return cases


def check_int8_linear(int8_linear: Callable, *, seed: int = 0, n_random: int = 4) -> None:
    """int8_linear(x [..., K], q [N, K] int8, scale [N], bias [N] or None) -> [..., N] in x's dtype, by the integer
    route: each row of x quantized to int8 (absmax per row, scale s_x), int8 x int8 products summed in int32, the
    sums times s_x · scale, plus the bias."""

    def show(args):
        x, q, scale, bias = args
        return f"int8_linear(x={short(x, 90)}, q={short(q, 90)}, scale={short(scale, 70)}, bias={short(bias, 50)})"

    run_check(
        "int8_linear",
        watching_products(int8_linear),
        linear_cases(seed, n_random),
        judge=_linear_verdict,
        forbid=FORBID,
        show_call=show,
        seconds=5,
        total_seconds=30,
        error_hints={
            "same dtype": "matmul does not mix dtypes: convert both x_q and q to torch.int32 first",
            "signed char": "matmul does not mix dtypes: convert both x_q and q to torch.int32 first",
            "expected scalar type": "matmul does not mix dtypes: convert both x_q and q to torch.int32 first",
            "view size is not compatible": "x may be a transposed view: use reshape, not view",
            "cannot be multiplied": "the weight q is [N, K] (rows are outputs): x_q @ q.T",
            "The size of tensor": "s_x has one entry per row of x, scale one per row of q (an output): "
            "sums [M, N] * s_x[:, None] * scale[None, :]",
        },
    )
    check_in_engine("int8", {"int8_linear": int8_linear}, {"int8_linear": (_linear_verdict, engine_int8_linear)})


# ----------------------------------------------------------------------------------------------
# Exercise 5: smooth_scales (SmoothQuant)


def _smooth_with(combine: Callable, axis: int = 0, absolute: bool = True) -> Callable:
    """smooth_scales with a known mistake: combine(a, w, alpha) -> s, the weight's max over `axis`."""

    def smooth(act_absmax, weight, alpha=0.5):
        a = act_absmax.double()
        w = (weight.double().abs() if absolute else weight.double()).amax(dim=axis)
        if w.shape != a.shape:
            return None
        s = combine(a, w, float(alpha))
        return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))

    return smooth


def _smooth_reduced(reduce: Callable) -> Callable:
    """smooth_scales with the weights' term reduce(|W|) [K] instead of each column's max (a known mistake)."""

    def smooth(act_absmax, weight, alpha=0.5):
        a, w = act_absmax.double(), reduce(weight.double().abs())
        s = a.pow(float(alpha)) / w.pow(1 - float(alpha))
        return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))

    return smooth


def _smooth_unguarded(act_absmax, weight, alpha=0.5):
    a, w = act_absmax.double(), weight.double().abs().amax(dim=0)
    return a.pow(alpha) / w.pow(1 - alpha)


SMOOTH_MISTAKES = [
    (
        _smooth_with(lambda a, w, al: a.pow(1 - al) / w.pow(al)),
        "alpha and 1 - alpha swapped: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (alpha is the share of the "
        "activations' range moved into the weights)",
    ),
    (
        _smooth_with(lambda a, w, al: w.pow(1 - al) / a.pow(al)),
        "the ratio is upside down: x is DIVIDED by s (and W's columns multiplied), so a channel with large "
        "activations needs a large s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)",
    ),
    (
        _smooth_with(lambda a, w, al: a.pow(al) * w.pow(1 - al)),
        "divide by the weights' term: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), not times",
    ),
    (
        _smooth_with(lambda a, w, al: a.pow(al) / w.pow(1 - al), axis=1),
        "the weights' maximum was taken per output (a row of W): take it per INPUT channel j, over the rows: "
        "weight.abs().amax(dim=0), one value per column",
    ),
    (
        _smooth_with(lambda a, w, al: a.pow(al) / w.pow(1 - al), absolute=False),
        "take the maximum of |W|, not of the signed weights (a column of negative weights has a small max)",
    ),
    (
        _smooth_with(lambda a, w, al: a / w),
        "alpha was ignored: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)",
    ),
    (
        _smooth_with(lambda a, w, al: a.sqrt() / w.sqrt()),
        "alpha was fixed at 0.5 (square roots): use the alpha given, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)",
    ),
    (
        _smooth_reduced(lambda w: w.mean(dim=0)),
        "the weights' term is each column's MAXIMUM |w|, weight.abs().amax(dim=0), not its mean",
    ),
    (
        _smooth_reduced(lambda w: w.max().expand(w.shape[1])),
        "one maximum for the whole matrix: take each input channel's own, over the rows (weight.abs().amax(dim=0))",
    ),
]


class Outcome:
    """The expected answer of a case graded by its outcome: the reference's factors `s` and the layer's inputs `x`
    whose int8 output error the learner's factors must bring below plain rounding's."""

    def __init__(self, s: Tensor, x: Tensor):
        self.s, self.x = s, x

    def __repr__(self) -> str:
        return short(self.s)


def _outcome_expected(act_absmax: Tensor, weight: Tensor, alpha: float, x: Tensor) -> Outcome:
    return Outcome(engine_smooth_scales(act_absmax, weight, alpha), x)


def _smooth_verdict(case: Case, got: Any) -> Verdict:
    act_absmax, weight = case.args[:2]
    outcome = case.expected if isinstance(case.expected, Outcome) else None
    expected = outcome.s if outcome is not None else case.expected
    K = act_absmax.shape[0]
    if not isinstance(got, Tensor):
        return f"expected a tensor s [{K}], got {short(got, 80)}", "return a tensor with one factor per input channel"
    if got.shape != (K,):
        hint = (
            "one factor per INPUT channel j: the weight's maximum over its rows (weight.abs().amax(dim=0))"
            if got.numel() == weight.shape[0]
            else f"return s of shape [{K}], one factor per input channel"
        )
        return f"returned shape {tuple(got.shape)}; expected ({K},)", hint
    if got.dtype not in (torch.float32, torch.float64):
        return (
            f"returned dtype {got.dtype}; expected float32",
            "compute in float32 (act_absmax.float(), weight.float()): the factors scale the weights before they are "
            "quantized, and half precision would round them",
        )
    dead = (act_absmax.double() == 0) | (weight.double().abs().amax(dim=0) == 0)  # [K]
    bad = ~torch.isfinite(got) | (got <= 0)
    if bool((bad & dead).any()):
        j = int(torch.nonzero(bad & dead)[0])
        return (
            f"s[{j}] = {float(got[j])} for a channel whose maximum is 0 (act_absmax[{j}] = {float(act_absmax[j]):g}, "
            f"max|W[:, {j}]| = {float(weight[:, j].abs().max()):g})",
            "guard the zero channels: 0 ** alpha / 0 ** (1 - alpha) is 0, inf or nan, and x / s then is inf or nan; "
            "give a channel whose maximum is 0 the factor 1 (nothing to move)",
        )
    live = ~dead
    rel = ((got.double() - expected.double()).abs() / expected.double().abs())[live]
    if rel.numel() and not bool((rel <= 1e-5).all()):
        j = int(torch.nonzero(live)[int(rel.argmax())])
        problem = f"s[{j}] = {float(got[j]):.7g}; expected {float(expected[j]):.7g}"
        for fn, hint in SMOOTH_MISTAKES:
            candidate = _try(fn, *case.args)
            if (
                isinstance(candidate, Tensor)
                and candidate.shape == got.shape
                and torch.allclose(got.double()[live], candidate[live], rtol=1e-4)
            ):
                return problem, hint
        return problem, "s_j = act_absmax_j ** alpha / max_n |weight[n, j]| ** (1 - alpha), in float32"
    if bool(bad.any()):
        j = int(torch.nonzero(bad)[0])
        return f"s[{j}] = {float(got[j])}", "every factor must be finite and positive"
    if outcome is not None:
        return _outcome_verdict(case, outcome, got)
    return None


def planted_outlier_layer(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's inputs with one outlier channel, as LLM.int8() found in large models: x [64, 256] with channel 7
    about 80x the others, weight [128, 256] -> (x, weight, act_absmax [256])."""
    rng = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=rng)
    x[:, 7] *= 80
    weight = torch.randn(128, 256, generator=rng) * 0.05
    return x, weight, x.abs().amax(dim=0)


def int8_output_error(x: Tensor, weight: Tensor, s: Optional[Tensor] = None) -> float:
    """The relative error of the integer route (int8 weights per row, int8 activations per row) on x @ weight.T,
    with the layer smoothed by s [K] first (x / s, weight's columns times s) when given."""
    exact = x.double() @ weight.double().T
    if s is not None:
        x, weight = x / s.float(), weight * s.float()
    q, scale = engine_quantize_int8(weight)
    y = engine_int8_linear(x, q, scale, None)
    return float((y.double() - exact).norm() / exact.norm())


def _outcome_verdict(case: Case, outcome: Outcome, got: Tensor) -> Verdict:
    x, weight = outcome.x, case.args[1]
    plain, smoothed = int8_output_error(x, weight), int8_output_error(x, weight, got)
    if not smoothed < plain:
        return (
            f"smoothing with your factors leaves an output error of {smoothed:.3%}, plain rounding {plain:.3%}",
            "the factors must move the outlier channel's range into the weights",
        )
    return None


def smooth_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed)

    def case(description, act_absmax, weight, *alpha, hint=""):
        return Case(
            description, (act_absmax, weight, *alpha), later(engine_smooth_scales, act_absmax, weight, *alpha), hint
        )

    def channels(K, outlier=None):
        a = torch.rand(K, generator=rng) * 3 + 0.1
        if outlier is not None:
            a[outlier] *= 60
        return a

    x, weight, absmax = planted_outlier_layer(seed)
    outcome = Case(
        "a planted outlier channel (80x): x [64, 256], weight [128, 256], alpha 0.5",
        (absmax, weight, 0.5),
        later(_outcome_expected, absmax, weight, 0.5, x),
        "with your factors the int8 route's output error must drop below plain rounding's",
    )
    cases = [
        case(
            "act_absmax [100, 1], weight [[1, 4], [-2, 1]], alpha 0.5",
            torch.tensor([100.0, 1.0]),
            torch.tensor([[1.0, 4.0], [-2.0, 1.0]]),
            0.5,
            hint="max|W_j| over the rows: [2, 4]; s = [100^0.5 / 2^0.5, 1 / 4^0.5] = [7.07, 0.5]",
        ),
        case(
            "alpha 0.8 (most of the range moved): act_absmax [3], weight [2, 3]",
            torch.tensor([50.0, 2.0, 0.5]),
            torch.tensor([[0.1, -0.4, 0.2], [0.3, 0.2, -0.05]]),
            0.8,
            hint="s_j = act_absmax_j ** 0.8 / max|W_j| ** 0.2",
        ),
        case("alpha 0.25", channels(6, 2), torch.randn(4, 6, generator=rng), 0.25),
        case("alpha left out (0.5)", channels(5, 1), torch.randn(3, 5, generator=rng)),
        case("alpha 1 (an int): s = act_absmax", channels(4), torch.randn(3, 4, generator=rng), 1),
        case("alpha 0 (an int): s = 1 / max|W_j|", channels(4), torch.randn(5, 4, generator=rng), 0),
        case(
            "a square weight [6, 6]: rows and columns could be confused",
            channels(6, 0),
            torch.randn(6, 6, generator=rng) * torch.logspace(-1, 1, 6)[:, None],
            0.6,
        ),
        case(
            "a channel the calibration never saw (act_absmax 0) and a weight column of zeros",
            torch.tensor([2.0, 0.0, 5.0, 1.0]),
            torch.tensor([[0.5, 0.2, 0.0, 0.1], [-0.3, 0.1, 0.0, 0.2]]),
            0.5,
            hint="a channel whose maximum is 0 gets s = 1: nothing to move, and no 0 / 0",
        ),
        case(
            "the weight as quantize_model passes it: weight.T of GPT-2's [C_in, C_out] layout (a transposed view)",
            channels(48, 5),
            torch.randn(48, 20, generator=rng).T,
            0.5,
        ),
        case(
            "a bfloat16 model's weight, float32 act_absmax: s in float32",
            channels(16, 3),
            (torch.randn(8, 16, generator=rng) * 0.1).bfloat16(),
            0.5,
            hint="compute in float32: weight.float()",
        ),
        case("float64 inputs", channels(12).double(), torch.randn(7, 12, generator=rng, dtype=torch.float64), 0.7),
        case("one input channel", torch.tensor([4.0]), torch.tensor([[0.5], [-2.0]]), 0.5),
        case(
            "GPT-2's c_fc: act_absmax [768], weight [3072, 768]",
            channels(768, 100),
            torch.randn(3072, 768, generator=rng) * 0.02,
            0.5,
        ),
        outcome,
    ]
    for i in range(n_random):
        N, K = int(torch.randint(1, 40, (), generator=rng)), int(torch.randint(1, 60, (), generator=rng))
        alpha = [0.5, 0.3, 0.75, 0.9][i % 4]
        cases.append(
            case(
                f"random #{i}: weight [{N}, {K}], alpha {alpha}",
                channels(K, 0),
                torch.randn(N, K, generator=rng),
                alpha,
            )
        )
    return cases


def check_smooth_scales(smooth_scales: Callable, *, seed: int = 0, n_random: int = 4) -> None:
    """smooth_scales(act_absmax [K], weight [N, K], alpha=0.5) -> s [K] float32: s_j = act_absmax_j^alpha /
    max_n |weight[n, j]|^(1 - alpha), 1 where either maximum is 0."""

    def show(args):
        act_absmax, weight, *alpha = args
        more = f", alpha={alpha[0]!r}" if alpha else ""
        return f"smooth_scales(act_absmax={short(act_absmax, 80)}, weight={short(weight, 80)}{more})"

    run_check(
        "smooth_scales",
        smooth_scales,
        smooth_cases(seed, n_random),
        judge=_smooth_verdict,
        forbid=FORBID,
        show_call=show,
        seconds=5,
        total_seconds=20,
        error_hints={
            "The size of tensor": "one factor per input channel j: act_absmax [K] and the weight's max over its rows "
            "(weight.abs().amax(dim=0)) [K]",
            "view size is not compatible": "the weight may be a transposed view: use reshape, not view",
        },
    )
    check_in_engine(
        "int8",
        {"smooth_scales": smooth_scales},
        {"smooth_scales": (_smooth_verdict, engine_smooth_scales)},
        calibrate=True,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 6: smoothing_error, best_alpha (choosing SmoothQuant's alpha)

# A correct error computed another way (in float64, with dequantized floats, token by token) rounds a near-tie of
# x / s or W s the other way now and then: up to 2.6e-4 of the error on these layers. Every named mistake is off by
# far more (a factor, mostly).
ERROR_RTOL = 2e-3
NAMED_RTOL = 5e-3  # a learner's mistake matches the check's version of it this closely (float32 against float64)


def _fake_int8(t: Tensor, dim: Optional[int]) -> Tensor:
    """dequant(quant(t)) in float64, absmax int8 with one scale per slice along `dim` (1: per row, 0: per column,
    None: one for the whole tensor)."""
    scale = (t.abs().amax(dim=dim, keepdim=True) if dim is not None else t.abs().max()) / 127
    return torch.round(t / torch.where(scale == 0, 1.0, scale)).clamp(-127, 127) * scale


ROUNDING_DIM = {"token": 1, "row": 1, "channel": 0, "column": 0, "tensor": None}


def smoothed_error(
    x: Tensor,
    weight: Tensor,
    alpha: float,
    *,
    dead: str = "one",
    divide: bool = True,
    columns: bool = True,
    scale_weight: bool = True,
    swap: bool = False,
    pass_alpha: bool = True,
    smooth: bool = True,
    act_dim: int = 0,
    act_abs: bool = True,
    x_rounding: Optional[str] = "token",
    w_rounding: Optional[str] = "row",
    measure: str = "output",
    norm: str = "frobenius",
) -> Optional[float]:
    """`smoothing_error` in float64, right with the defaults; each keyword set otherwise is a known mistake (None
    where that mistake cannot run on these shapes). x [M, K], weight [N, K]: s from x's own channels
    (s_j = max_m |x_mj|^alpha / max_n |w_nj|^(1 - alpha), 1 where either is 0), x / s rounded per token, W diag(s)
    per output row, and ||int8 route - x W^T|| / ||x W^T||."""
    x, w = x.double(), weight.double()
    alpha = float(alpha)
    if smooth:
        a = (x.abs() if act_abs else x).amax(dim=1 if act_dim else 0)
        m = w.abs().amax(dim=0)
        if a.shape != m.shape:
            return None
        power = (1 - alpha if swap else alpha) if pass_alpha else 0.5
        s = a.pow(power) / m.pow(1 - power)
        if dead == "one":
            s = torch.where((a > 0) & (m > 0), s, torch.ones_like(s))
        else:  # SmoothQuant's own code: both maxima and the factor clamped at 1e-5
            s = (a.clamp(min=1e-5).pow(power) / m.clamp(min=1e-5).pow(1 - power)).clamp(min=1e-5)
    else:
        s = torch.ones(x.shape[1], dtype=torch.float64)
    xs = x / s if divide else x * s
    if not scale_weight:
        ws = w
    elif columns:
        ws = w * s
    elif w.shape[0] == w.shape[1]:
        ws = w * s[:, None]
    else:
        return None
    exact = x @ w.T
    rx = _fake_int8(xs, ROUNDING_DIM[x_rounding]) if x_rounding else xs
    rw = _fake_int8(ws, ROUNDING_DIM[w_rounding]) if w_rounding else ws
    if measure == "activations":
        difference, size = rx - xs, xs
    elif measure == "weights":
        difference, size = rw - ws, ws
    else:
        difference, size = rx @ rw.T - exact, exact
    if norm == "mean":
        return float(difference.abs().mean() / size.abs().mean())
    if norm == "max":
        return float(difference.abs().max() / size.abs().max())
    if norm == "absolute":
        return float(difference.norm())
    if norm == "elementwise":
        return float((difference.abs() / size.abs()).mean())
    return float(difference.norm() / size.norm())


def reference_smoothing_error(x: Tensor, weight: Tensor, alpha: float) -> float:
    """The engine's route, in float32 as the engine computes: `smooth_scales` from x's channels, `quantize_int8` of
    W diag(s), `int8_linear` of x / s; the error against x W^T in float64."""
    x, w = x.float(), weight.float()
    s = engine_smooth_scales(x.abs().amax(dim=0), w, float(alpha))
    q, scale = engine_quantize_int8(w * s)
    y = engine_int8_linear(x / s, q, scale, None)
    exact = x.double() @ w.double().T
    return float((y.double() - exact).norm() / exact.norm())


class ErrorExpected:
    """The expected error of a case: the engine's route (float32) and the same in float64; either is right. Where a
    channel's maximum is 0, the factor smooth_scales gives it changes the error (x / s keeps a channel of zero weights
    in the tokens' scales when s_j = 1, and a column of W scaled by s_j sets its rows' scales): the error with
    SmoothQuant's own rule there (maxima clamped at 1e-5), which smooth_scales' check accepts too, is right as well."""

    def __init__(self, x: Tensor, weight: Tensor, alpha: float):
        self.f32 = reference_smoothing_error(x, weight, alpha)
        self.f64 = smoothed_error(x, weight, alpha)
        dead = bool((x.abs().amax(dim=0) == 0).any() or (weight.abs().amax(dim=0) == 0).any())
        self.clamped = smoothed_error(x, weight, alpha, dead="clamp") if dead else None

    def __repr__(self) -> str:
        return f"{self.f32:.6g}"

    def accepts(self, got: float) -> bool:
        return any(abs(got - e) <= ERROR_RTOL * abs(e) for e in (self.f32, self.f64, self.clamped) if e is not None)


SMOOTHING_ERROR_MISTAKES = [
    (
        dict(divide=False),
        "x was multiplied by s: DIVIDE it (x / s) and multiply W's columns (W * s), so that "
        "(x / s) (W diag(s))^T = x W^T",
    ),
    (
        dict(columns=False),
        "W's rows were multiplied by s: s has one factor per INPUT channel j, which is column j of W: weight * s "
        "(broadcast over the rows), not weight * s[:, None]",
    ),
    (
        dict(scale_weight=False),
        "x was divided by s but W not multiplied by it: the smoothed layer must compute the same product, "
        "(x / s) (W * s)^T",
    ),
    (dict(swap=True), "alpha and 1 - alpha swapped: pass alpha to smooth_scales as it is"),
    (
        dict(pass_alpha=False),
        "smooth_scales was called without alpha, so with its default 0.5: pass alpha on",
    ),
    (
        dict(smooth=False),
        "that is the error of plain int8, with no smoothing (s = 1): smooth first, s = smooth_scales(act_absmax, "
        "weight, alpha)",
    ),
    (
        dict(act_dim=1),
        "act_absmax was taken per token: it is each INPUT channel's largest |x| over the tokens, "
        "x.abs().amax(dim=0), [K]",
    ),
    (
        dict(act_abs=False),
        "act_absmax is the largest |x| of each channel: x.abs().amax(dim=0), not x.amax(dim=0) (a channel whose "
        "largest values are negative)",
    ),
    (
        dict(x_rounding="tensor"),
        "the activations were rounded with one scale for the whole of x: the integer route gives each token (row "
        "of x / s) its own scale, as int8_linear does",
    ),
    (
        dict(x_rounding="channel"),
        "the activations were rounded with one scale per channel: the integer route gives each token (row of "
        "x / s) its own scale, as int8_linear does",
    ),
    (
        dict(w_rounding="tensor"),
        "the weights were rounded with one scale for the whole matrix: quantize_int8(W * s) gives each output "
        "row its own",
    ),
    (
        dict(w_rounding="column"),
        "the weights were rounded with one scale per column: quantize_int8 takes W * s as it is, [N, K], one "
        "scale per output row",
    ),
    (
        dict(x_rounding=None),
        "only the weights were rounded: the integer route rounds the activations too, "
        "int8_linear(x / s, q, scale, None)",
    ),
    (
        dict(w_rounding=None),
        "only the activations were rounded: the weights W * s are rounded too, quantize_int8(weight * s)",
    ),
    (
        dict(measure="activations"),
        "that is the rounding error of the activations x / s alone: measure it on the layer's output, "
        "int8_linear(...) against x @ weight.T",
    ),
    (
        dict(measure="weights"),
        "that is the rounding error of the weights W * s alone: measure it on the layer's output, "
        "int8_linear(...) against x @ weight.T",
    ),
    (
        dict(norm="mean"),
        "mean |difference| / mean |y|: the error is a ratio of norms, ||y_int8 - y|| / ||y|| ((...).norm(), the "
        "square root of the sum of squares)",
    ),
    (
        dict(norm="max"),
        "max |difference| / max |y|: the error is a ratio of norms, ||y_int8 - y|| / ||y|| ((...).norm())",
    ),
    (dict(norm="absolute"), "||y_int8 - y|| alone: divide it by ||y|| = ||x @ weight.T||"),
    (
        dict(norm="elementwise"),
        "the mean of |difference| / |y| element by element: the error is ||y_int8 - y|| / ||y||, the norms of "
        "the whole outputs",
    ),
]


def _number(got: Any) -> Optional[float]:
    """A Python number, numpy number or 0-d tensor as a float; None otherwise."""
    if isinstance(got, bool):
        return None
    if isinstance(got, Tensor):
        return float(got) if got.numel() == 1 and got.dim() == 0 and not got.is_complex() else None
    try:
        return float(got) if isinstance(got, numbers.Real) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _smoothing_error_verdict(case: Case, got: Any) -> Verdict:
    expected: ErrorExpected = case.expected
    value = _number(got)
    if value is None:
        return (
            f"expected a number, got {short(got, 80)}",
            "return the error as a Python float: ((y - exact).norm() / exact.norm()).item()",
        )
    if expected.accepts(value):
        return None
    problem = f"expected {expected.f32:.6g}, got {value:.6g}"
    if not math.isfinite(value):
        return problem, (
            "a factor s_j of 0, inf or nan: use your smooth_scales (a channel whose maximum is 0 gets s_j = 1), "
            "and divide x by s"
        )
    named = []  # (how far, hint) of each known mistake that gives the learner's answer; the nearest is named
    for options, hint in SMOOTHING_ERROR_MISTAKES:
        candidate = _try(functools.partial(smoothed_error, **options), *case.args)
        if candidate is not None and math.isfinite(candidate) and candidate != 0:
            off = abs(value - candidate) / abs(candidate)
            if off <= NAMED_RTOL:
                named.append((off, hint))
    return problem, min(named)[1] if named else ""


def _layer(
    rng: torch.Generator,
    M: int,
    K: int,
    N: int,
    *,
    outliers: int = 0,
    grow: float = 1.0,
    token_spread: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """A layer's inputs x [M, K] and weight [N, K]: tokens of sizes spread over `token_spread` (a factor), `outliers`
    channels `grow` times the others (LLM.int8()'s outlier features), weights whose rows differ in size."""
    x = torch.randn(M, K, generator=rng)
    if token_spread != 1:
        sizes = torch.logspace(0, math.log10(token_spread), M)[torch.randperm(M, generator=rng)]
        x = x * sizes[:, None]
    if outliers:
        x[:, torch.randperm(K, generator=rng)[:outliers]] *= grow
    rows = torch.logspace(-0.3, 0.3, N)[torch.randperm(N, generator=rng)]
    weight = torch.randn(N, K, generator=rng) * 0.05 * rows[:, None]
    return x, weight


def smoothing_error_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed)

    def case(description, x, weight, alpha, hint=""):
        return Case(description, (x, weight, alpha), later(ErrorExpected, x, weight, alpha), hint)

    x, w = _layer(rng, 64, 96, 80, outliers=2, grow=50, token_spread=4)
    square_x, square_w = _layer(rng, 64, 64, 64, outliers=1, grow=30, token_spread=3)
    spread_x, spread_w = _layer(rng, 48, 64, 40, outliers=1, grow=20, token_spread=100)
    flat_x, flat_w = _layer(rng, 48, 64, 40)
    dead_x, dead_w = _layer(rng, 32, 48, 24, outliers=1, grow=40, token_spread=2)
    dead_x[:, 5] = 0  # a channel the calibration never saw
    dead_w[:, 9] = 0  # an input channel no output reads
    negative_x, negative_w = _layer(rng, 40, 48, 32, token_spread=2)
    negative_x[:, 3] = -negative_x[:, 3].abs() * 60  # an outlier channel of negative values
    negative_x[0, 3] = 1.0  # its signed max is small and positive
    view_x, view_w = _layer(rng, 48, 64, 56, outliers=2, grow=25, token_spread=3)
    half_x, half_w = _layer(rng, 32, 64, 48, outliers=1, grow=60, token_spread=3)
    double_x, double_w = _layer(rng, 40, 48, 36, outliers=3, grow=15, token_spread=5)
    one_x, one_w = _layer(rng, 1, 32, 24, outliers=1, grow=50)
    fc_x, fc_w = _layer(rng, 48, 192, 768, outliers=3, grow=40, token_spread=3)
    cases = [
        case(
            "two outlier channels (50x the others): x [64, 96], weight [80, 96], alpha 0.5",
            x,
            w,
            0.5,
            hint="s = smooth_scales(x.abs().amax(dim=0), weight, alpha); q, scale = quantize_int8(weight * s); "
            "y = int8_linear(x / s, q, scale, None); ||y - x W^T|| / ||x W^T||",
        ),
        case("the same layer, alpha 0.8 (most of the range moved into the weights)", x, w, 0.8),
        case("the same layer, alpha 0.2", x, w, 0.2),
        case("the same layer, alpha 0 (an int): s = 1 / max|W_j|", x, w, 0),
        case("the same layer, alpha 1 (an int): s = max|X_j|", x, w, 1),
        case(
            "a square layer (rows and columns of W could be confused; tokens and channels too): x [64, 64], "
            "weight [64, 64], alpha 0.6",
            square_x,
            square_w,
            0.6,
        ),
        case(
            "tokens of very different sizes (100x apart) and an outlier channel: x [48, 64], weight [40, 64], "
            "alpha 0.5",
            spread_x,
            spread_w,
            0.5,
        ),
        case("no outlier channel: x [48, 64], weight [40, 64], alpha 0.5", flat_x, flat_w, 0.5),
        case(
            "a channel the calibration never saw (x[:, 5] = 0) and a weight column of zeros (W[:, 9] = 0), alpha 0.7",
            dead_x,
            dead_w,
            0.7,
            hint="a channel whose maximum is 0 gets s_j = 1 (your smooth_scales does it): no 0 / 0",
        ),
        case(
            "an outlier channel of negative values (x[:, 3], down to -60x): x [40, 48], weight [32, 48], alpha 0.5",
            negative_x,
            negative_w,
            0.5,
        ),
        case(
            "x and weight as transposed views (quantize_model holds a layer's weight as weight.T), alpha 0.4",
            view_x.T.contiguous().T,
            view_w.T.contiguous().T,
            0.4,
        ),
        case(
            "float16 activations and a bfloat16 weight (a half-precision model): compute in float32, alpha 0.5",
            half_x.half(),
            half_w.bfloat16(),
            0.5,
        ),
        case("float64 inputs, three outlier channels, alpha 0.3", double_x.double(), double_w.double(), 0.3),
        case("one token: x [1, 32], weight [24, 32], alpha 0.5", one_x, one_w, 0.5),
        case(
            "GPT-2 small's c_fc with three outlier channels: x [48, 192], weight [768, 192], alpha 0.5",
            fc_x,
            fc_w,
            0.5,
        ),
    ]
    for i in range(n_random):
        M, K, N = (int(torch.randint(lo, hi, (), generator=rng)) for lo, hi in ((2, 48), (8, 96), (4, 64)))
        outliers = int(torch.randint(0, 4, (), generator=rng))
        grow = [5.0, 20.0, 100.0, 300.0][i % 4]
        alpha = round(float(torch.rand((), generator=rng)), 2)
        rx, rw = _layer(rng, M, K, N, outliers=outliers, grow=grow, token_spread=10)
        cases.append(
            case(
                f"random #{i}: x [{M}, {K}], weight [{N}, {K}], {outliers} outlier channels {grow:g}x, alpha {alpha}",
                rx,
                rw,
                alpha,
            )
        )
    return cases


# best_alpha


class AlphaExpected:
    """The expected choice of a case: each alpha's error by the engine's route (float32) and in float64. An alpha is
    right if its error is the smallest, within ERROR_RTOL of it by either route; among alphas whose errors are
    exactly equal (a tie), the smallest."""

    def __init__(self, x: Tensor, weight: Tensor, alphas):
        self.alphas = [float(a) for a in alphas]
        self.f32 = [reference_smoothing_error(x, weight, a) for a in self.alphas]
        self.f64 = [smoothed_error(x, weight, a) for a in self.alphas]

    def best(self) -> float:
        i = min(range(len(self.alphas)), key=lambda i: (self.f32[i], self.alphas[i]))
        return self.alphas[i]

    def __repr__(self) -> str:
        return f"{self.best():g}"

    def right(self, i: int) -> bool:
        near = any(errors[i] <= min(errors) * (1 + ERROR_RTOL) + 1e-12 for errors in (self.f32, self.f64))
        tied_below = any(
            self.f32[j] == self.f32[i] and self.alphas[j] < self.alphas[i] for j in range(len(self.alphas))
        )
        return near and not tied_below


def _index_of(alpha: float, alphas: list[float]) -> Optional[int]:
    found = [i for i, a in enumerate(alphas) if abs(a - alpha) <= 1e-6 * max(1.0, abs(a))]
    return found[0] if found else None


BEST_ALPHA_MISTAKES = [
    (
        lambda errors, alphas: alphas[max(range(len(errors)), key=lambda i: (errors[i], -i))],
        "that alpha gives the LARGEST error: the best alpha gives the smallest (min / argmin, not max)",
    ),
    (
        lambda errors, alphas: alphas[max(i for i, e in enumerate(errors) if e == min(errors))],
        "on a tie (equal errors) return the smallest alpha: keep the first minimum (compare with <, not <=)",
    ),
    (
        lambda errors, alphas: min(range(len(errors)), key=lambda i: errors[i]),
        "that is the index of the best alpha in alphas: return the alpha itself, alphas[i]",
    ),
    (lambda errors, alphas: min(errors), "that is the smallest error: return the alpha that gives it"),
    (
        lambda errors, alphas: (
            alphas[min(range(len(errors) - 1), key=lambda i: errors[i])] if len(errors) > 1 else None
        ),
        "the last alpha of the list was never tried: try every one (range(len(alphas)))",
    ),
    (
        lambda errors, alphas: (
            alphas[1 + min(range(len(errors) - 1), key=lambda i: errors[1 + i])] if len(errors) > 1 else None
        ),
        "the first alpha of the list was never tried: try every one",
    ),
    (lambda errors, alphas: 0.5, "alpha 0.5 is SmoothQuant's default, not the best here: try each of alphas"),
]


def _best_alpha_verdict(case: Case, got: Any) -> Verdict:
    expected: AlphaExpected = case.expected
    value = _number(got)
    if value is None:
        return (
            f"expected one of alphas (a number), got {short(got, 80)}",
            "return the alpha whose smoothing_error is the smallest: one item of alphas",
        )
    i = _index_of(value, expected.alphas)
    if i is not None and expected.right(i):
        return None
    best = expected.best()
    j = _index_of(best, expected.alphas)
    if i is None:
        problem = f"expected {best:g} (error {expected.f32[j]:.4%}), got {value:g}, which is not one of alphas"
    else:
        problem = f"expected {best:g} (error {expected.f32[j]:.4%}), got {value:g} (error {expected.f32[i]:.4%})"
    for fn, hint in BEST_ALPHA_MISTAKES:
        candidate = _try(fn, expected.f32, expected.alphas)
        if candidate is not None and abs(float(candidate) - value) <= 1e-9 * max(1.0, abs(value)):
            return problem, hint
    return (
        problem,
        "call smoothing_error(x, weight, alpha) for each alpha of alphas and return the one with the smallest",
    )


def _tied_layer(rng: torch.Generator, M: int, K: int, N: int) -> tuple[Tensor, Tensor]:
    """A layer whose every channel's largest |x| and column's largest |w| are 1: s = 1 for every alpha, so every
    alpha gives the same error exactly (a tie)."""
    x, weight = _layer(rng, M, K, N, token_spread=3)
    return x / x.abs().amax(dim=0), weight / weight.abs().amax(dim=0)


ALPHAS = [i / 10 for i in range(11)]


def best_alpha_cases(seed: int, n_random: int) -> list[Case]:
    rng = torch.Generator().manual_seed(seed + 1)

    def case(description, x, weight, alphas, hint=""):
        return Case(description, (x, weight, alphas), later(AlphaExpected, x, weight, alphas), hint)

    x, w = _layer(rng, 64, 96, 80, outliers=2, grow=50, token_spread=4)
    big_x, big_w = _layer(rng, 48, 64, 48, outliers=1, grow=300, token_spread=3)
    tie_x, tie_w = _tied_layer(rng, 32, 48, 40)
    cases = [
        case(
            "two outlier channels (50x): x [64, 96], weight [80, 96], alphas [0, 0.1, ..., 1] (a list)",
            x,
            w,
            list(ALPHAS),
            hint="errors = [smoothing_error(x, weight, a) for a in alphas]; the alpha of the smallest",
        ),
        case("the same layer, alphas (0.5, 0.6, 0.7, 0.8, 0.9, 1.0) (a tuple)", x, w, (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)),
        case("the same layer, alphas (0.0, 0.1, 0.2, 0.3)", x, w, (0.0, 0.1, 0.2, 0.3)),
        case(
            "one outlier channel 300x: x [48, 64], weight [48, 64], alphas torch.linspace(0, 1, 11) (a tensor)",
            big_x,
            big_w,
            torch.linspace(0, 1, 11, dtype=torch.float64),
        ),
        case(
            "every channel's max |x| and every column's max |w| are 1: s = 1 for every alpha, all errors equal; "
            "alphas [0.2, 0.4, 0.6, 0.8]",
            tie_x,
            tie_w,
            [0.2, 0.4, 0.6, 0.8],
            hint="on a tie, the smallest alpha",
        ),
        case("alphas in no order: [0.9, 0.3, 0.6, 0.0]", x, w, [0.9, 0.3, 0.6, 0.0]),
        case("one alpha: [0.7]", big_x, big_w, [0.7]),
    ]
    for i in range(n_random):
        M, K, N = (int(torch.randint(lo, hi, (), generator=rng)) for lo, hi in ((8, 48), (16, 96), (8, 64)))
        grow = [10.0, 40.0, 150.0][i % 3]
        rx, rw = _layer(rng, M, K, N, outliers=1 + i % 3, grow=grow, token_spread=5)
        cases.append(
            case(
                f"random #{i}: x [{M}, {K}], weight [{N}, {K}], {1 + i % 3} outlier channels {grow:g}x, "
                "alphas [0, 0.1, ..., 1]",
                rx,
                rw,
                list(ALPHAS),
            )
        )
    return cases


def check_smoothing_error(smoothing_error: Callable, best_alpha: Callable, *, seed: int = 0, n_random: int = 4) -> None:
    """smoothing_error(x [M, K], weight [N, K], alpha) -> the relative error ||y_int8 - x W^T|| / ||x W^T|| of the
    integer route on the layer smoothed with s = smooth_scales(x.abs().amax(dim=0), weight, alpha) (x / s rounded
    per token, W * s per output row); best_alpha(x, weight, alphas) -> the alpha of alphas with the smallest error
    (the smallest alpha on a tie)."""

    def show_error(args):
        x, weight, alpha = args
        return f"smoothing_error(x={short(x, 70)}, weight={short(weight, 70)}, alpha={alpha!r})"

    def show_best(args):
        x, weight, alphas = args
        return f"best_alpha(x={short(x, 70)}, weight={short(weight, 70)}, alphas={short(alphas, 90)})"

    run_check(
        "smoothing_error",
        unwritten_helper(smoothing_error),
        smoothing_error_cases(seed, n_random),
        judge=_smoothing_error_verdict,
        forbid=FORBID,
        show_call=show_error,
        seconds=5,
        total_seconds=40,
        shrink=False,
        error_hints={
            "The size of tensor": "act_absmax and s have one value per INPUT channel j (x.abs().amax(dim=0), [K]): "
            "x / s divides x's columns, weight * s multiplies W's columns (both broadcast over the rows)",
            "view size is not compatible": "x and weight may be transposed views: use reshape, not view",
        },
    )
    run_check(
        "best_alpha",
        unwritten_helper(best_alpha),
        best_alpha_cases(seed, max(1, n_random // 2)),
        judge=_best_alpha_verdict,
        forbid=FORBID,
        show_call=show_best,
        seconds=15,
        total_seconds=60,
        shrink=False,
    )
