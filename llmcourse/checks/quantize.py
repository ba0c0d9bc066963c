"""Checks for chapter 09, quantization: absmax int8 per row, 4-bit values packed two per byte, 4-bit
groups of 32 (Q4_0), a linear layer with int8 weights, and the memory a model's weights take.

Quantized values are integers, so they are compared exactly — except where w / scale lies within
1e-4 of a half-integer (a tie, or a float's last bit away from one): there either neighbour is right,
whatever rule breaks ties (torch.round rounds half to even, Python's round too, numpy the same; C's
round away from zero). Scales are compared in their stored dtype. A wrong answer is compared with what
the known mistakes give (a scale from the mean, truncation, nibbles in the wrong order, ...) and the
matching one is named.

    >>> def weight_memory(n_params, fmt):
    ...     per_weight = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5 + 2 / 32}
    ...     if fmt not in per_weight:
    ...         raise ValueError(f"unknown format {fmt!r}")
    ...     return n_params * per_weight[fmt]
    >>> check_weight_memory(weight_memory)
    ✓ weight_memory — 20 cases
"""

from __future__ import annotations

import copy
import functools
import math
import random
import sys
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
from llmcourse.engine.quantize import unpack_int4 as engine_unpack_int4
from llmcourse.engine.quantize import weight_memory as engine_weight_memory
from llmcourse.engine.slots import PartError

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, call_learner, failure, later, run_check
from .harness.forbid import Forbidden
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


def _engine_run(fmt: str, fns: dict[str, Callable]) -> tuple[Any, list]:
    """A copy of the bundled GPT-2 quantized to `fmt` with `fns` installed, then ENGINE_NEW_TOKENS greedy tokens.
    -> (the tokens, or the PartError that stopped the engine; each call of a learner's function: (name, args,
    result)). Run inside call_learner: the engine's own code runs unwatched, the learner's under the watch."""
    watch = sys.getprofile()
    calls: list = []

    def recorded(name: str, fn: Callable) -> Callable:
        def call(*args):
            sys.setprofile(watch)
            try:
                out = fn(*args)
            finally:
                sys.setprofile(None)
            calls.append((name, args, out))
            return out

        call.__name__ = call.__qualname__ = getattr(fn, "__qualname__", name)
        return call

    sys.setprofile(None)
    try:
        model = copy.deepcopy(bundled_model())
        quantization = guarded(Quantization, **{n: recorded(n, f) for n, f in fns.items()})
        with one_thread():
            quantize_model(model, fmt, quantization)
            tokens = generate(model, ENGINE_PROMPT, max_new_tokens=ENGINE_NEW_TOKENS, eos_token_id=None)
    except PartError as err:
        tokens = err
    finally:
        sys.setprofile(watch)
    return tokens, calls


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
    fmt: str, fns: dict[str, Callable], judges: dict[str, tuple[Callable, Callable]], *, seconds: float = 20.0
) -> None:
    """Quantize the bundled GPT-2 to `fmt` with the learner's `fns` (slot name -> function) installed as my_engine
    installs them, and generate; raise CheckFailed if the engine stops one of them, or if one of the calls the engine
    made fails `judges[name] = (judge, reference)` against reference(*args)."""
    names = ", ".join(fns)
    installed = ", ".join(f"{n}={n}" for n in fns)
    what = (
        f"quantize_model(the bundled GPT-2 (float32), {fmt!r}, guarded(Quantization, {installed})) "
        f"(your {names} installed as my_engine installs them), then generate(model, a {len(ENGINE_PROMPT)}-token "
        f"prompt, max_new_tokens={ENGINE_NEW_TOKENS})"
    )
    tokens, calls = call_learner(names, _engine_run, (fmt, fns), forbid=FORBID, seconds=seconds, show=lambda args: what)
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
        return f"scale: {problem}", mistake()
    ratio = w.double() / torch.where(escale == 0, 1.0, escale.double())[:, None]
    problem = values_problem(q, eq, ratio, "q's values")
    if problem:
        hint = mistake()
        if not hint and bool((q.long() == -128).any()):
            hint = "values outside [-127, 127] wrapped around in int8: clamp before converting"
        return problem, hint
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


def _pack_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(case.expected, Refusal):
        return refusal_verdict(case.expected, got)
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


def _quantize_int4_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(case.expected, Refusal):
        return refusal_verdict(case.expected, got)
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
        return f"scales: {problem}", named
    ratio = _int4_values(w, escales)
    problem = values_problem(engine_unpack_int4(packed), engine_unpack_int4(epacked), ratio, "the 4-bit values")
    if problem:
        return problem, mistake()
    return None


def _try(fn, *args):
    try:
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
# Exercise 4: int8_linear


INT8_LINEAR_MISTAKES = [
    (
        lambda x, q, s, b: x @ (q.to(x.dtype) * s.to(x.dtype)[None, :]).T + (0 if b is None else b),
        "a scale belongs to an output ROW of q: q * scale[:, None] (or scale the product's last dimension)",
    ),
    (
        lambda x, q, s, b: ((x @ q.to(x.dtype).T) + (0 if b is None else b)) * s.to(x.dtype),
        "add the bias AFTER scaling: y = (x @ q.T) * scale + bias (the bias is in the output's units)",
    ),
    (
        lambda x, q, s, b: x @ q.to(x.dtype).T + (0 if b is None else b),
        "multiply by the scales: the weight is q * scale[:, None], not q",
    ),
    (
        lambda x, q, s, b: (x @ q.to(x.dtype).T) / s.to(x.dtype) + (0 if b is None else b),
        "the weight is q * scale: multiply by the scales, do not divide",
    ),
]


UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _linear_tolerance(case: Case) -> tuple[float, float]:
    """The accuracy asked of int8_linear, in x's dtype (unit roundoff u, at least float32's: the dequantized weight
    may be float32, as dequantize_int8's is): each weight q·scale may be rounded to the dtype or not (u per term),
    the K products summed in any order and precision (a few u of the sum of |terms|,
    far more than the √K·u a sum really loses), the result rounded to the dtype (u·|y|); so
    |y - expected| <= 8·u·Σ|x·w| + 4·u·|expected|, any correct way of writing it passes, and a wrong scale, bias or
    layout (errors of the size of y itself) does not."""
    x, q, scale, bias = case.args
    u = max(UNIT_ROUNDOFF.get(x.dtype, 2.0**-24), 2.0**-24)
    size = x.abs().double().reshape(-1, x.shape[-1]) @ (q.double().abs() * scale.double().abs()[:, None]).T
    bias_size = 0.0 if bias is None else float(bias.double().abs().max()) if bias.numel() else 0.0
    return 8 * u * (float(size.max()) + bias_size) + 1e-30, 4 * u


def _linear_verdict(case: Case, got: Any) -> Verdict:
    atol, rtol = _linear_tolerance(case)
    problem = tensor_problem(got, case.expected, atol=atol, rtol=rtol)
    if problem is None:
        return None
    expected = case.expected
    hint = ""
    if (
        isinstance(got, Tensor)
        and got.dim() == expected.dim()
        and got.shape == (*expected.shape[:-2], expected.shape[-1], expected.shape[-2])
        and got.shape != expected.shape
    ):
        hint = "the output is [..., N]: x @ W.T with W = q * scale[:, None] of shape [N, K]"
    elif isinstance(got, Tensor) and got.shape == expected.shape and got.dtype != expected.dtype:
        hint = f"return x's dtype ({expected.dtype}): convert the dequantized weight (or the product) to x.dtype"
    elif (
        isinstance(got, Tensor)
        and got.shape == expected.shape
        and got.is_floating_point()
        and tensor_problem(got, expected, atol=atol * 64, rtol=rtol * 64) is None
    ):
        hint = (
            f"close, but outside the accuracy asked: |y - expected| <= {atol:.3g} + {rtol:.3g}·|expected| "
            f"(a few units of {expected.dtype}'s rounding times the size of the sums): compute the products "
            f"in {expected.dtype} or wider"
        )
    else:
        for fn, h in INT8_LINEAR_MISTAKES:
            candidate = _try(fn, *case.args)
            if (
                isinstance(candidate, Tensor)
                and isinstance(got, Tensor)
                and candidate.shape == got.shape
                and torch.allclose(got.double(), candidate.double(), rtol=rtol, atol=atol)
                and tensor_problem(candidate.to(expected.dtype), expected, atol=atol, rtol=rtol) is not None
            ):
                hint = h
                break
    return problem, hint


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
    cases = [
        case(
            "x [1, 3], 2 outputs, no bias",
            torch.tensor([[1.0, 2.0, 3.0]]),
            q1,
            s1,
            None,
            hint="y = x @ (q * scale[:, None]).T: [63.5 - 64, 2 * (1 + 4 + 9)] = [-0.5, 28]",
        ),
        case(
            "the same with a bias",
            torch.tensor([[1.0, 2.0, 3.0]]),
            q1,
            s1,
            torch.tensor([10.0, -1.0]),
            hint="the bias is added after scaling: [9.5, 27]",
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
            "float64 x: float64 out",
            torch.randn(3, 16, generator=rng, dtype=torch.float64) * 5,
            *layer(7, 16, dtype=torch.float64),
            hint="the output has x's dtype",
        ),
        case(
            "float64 x [2, 2, 12] with float32 scales, no bias",
            torch.randn(2, 2, 12, generator=rng, dtype=torch.float64),
            *layer(5, 12, bias=False),
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
            hint="the output has x's dtype: float16 in, float16 out",
        ),
        case(
            "a bfloat16 model: x [2, 2, 64], scales and bias bfloat16: bfloat16 out",
            (torch.randn(2, 2, 64, generator=rng) * 3).bfloat16(),
            *model_layer(16, 64, torch.bfloat16),
            hint="the output has x's dtype: bfloat16 in, bfloat16 out",
        ),
        case(
            "float16 x and bias with float32 scales (quantize_int8's): float16 out",
            (torch.randn(3, 16, generator=rng) * 2).half(),
            *(lambda q, s, b: (q, s, b.half()))(*layer(8, 16)),
            hint="the output has x's dtype: convert the weight (or the product) to x.dtype",
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
            hint="x may be any view: use reshape (not view), or a matmul that takes any layout",
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
    """int8_linear(x [..., K], q [N, K] int8, scale [N], bias [N] or None) -> [..., N] in x's dtype."""

    def show(args):
        x, q, scale, bias = args
        return f"int8_linear(x={short(x, 90)}, q={short(q, 90)}, scale={short(scale, 70)}, bias={short(bias, 50)})"

    run_check(
        "int8_linear",
        int8_linear,
        linear_cases(seed, n_random),
        judge=_linear_verdict,
        forbid=FORBID,
        show_call=show,
        seconds=5,
        total_seconds=20,
        error_hints={
            "same dtype": "matmul does not mix int8 and float: convert q first (q.to(x.dtype))",
            "signed char": "matmul does not mix int8 and float: convert q first (q.to(x.dtype))",
            "expected m1 and m2 to have the same dtype": "matmul does not mix dtypes: convert the "
            "dequantized weight to x.dtype",
            "expected scalar type": "matmul does not mix dtypes: convert the dequantized weight to x.dtype",
            "view size is not compatible": "x may be a transposed view: use reshape, not view",
            "cannot be multiplied": "the weight q is [N, K] (rows are outputs): x @ W.T",
            "The size of tensor": "scale has one entry per output, a ROW of q: q * scale[:, None] "
            "(or the product's last dimension times scale)",
        },
    )
    check_in_engine("int8", {"int8_linear": int8_linear}, {"int8_linear": (_linear_verdict, engine_int8_linear)})


# ----------------------------------------------------------------------------------------------
# Exercise 5: weight_memory


MEMORY_MISTAKES = [
    (
        lambda n, f: n * {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}[f],
        "int4 stores a float16 scale (2 bytes) per 32 weights too: 0.5 + 2 / 32 bytes per weight",
    ),
    (
        lambda n, f: n * {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4.5}[f],
        "these are bits; return bytes (divide by 8)",
    ),
    (
        lambda n, f: n * {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5625}[f] / 2**30,
        "return bytes, not GiB",
    ),
    (
        lambda n, f: n * {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5625}[f] / 1e9,
        "return bytes, not GB",
    ),
    (
        lambda n, f: n * {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5 + 2 / 16}[f],
        "a float16 scale is 2 bytes per GROUP of 32 weights: 2 / 32 bytes per weight",
    ),
]


def _memory_verdict(case: Case, got: Any) -> Verdict:
    if isinstance(case.expected, Refusal):
        if not isinstance(got, Raised):
            return (
                f"expected a ValueError, got {short(got, 80)}",
                "raise ValueError for a format you do not know, naming it",
            )
        if case.args[1] not in got.message:
            return (
                f"the ValueError's message does not name the format {case.args[1]!r}: {got.message!r}",
                "name the unknown format in the message",
            )
        return None
    wrong = unexpected_error(got)
    if wrong:
        return wrong
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        hint = "return a Python number (float(...))" if isinstance(got, Tensor) else "return a number of bytes"
        return f"expected a number, got {short(got, 60)}", hint
    if math.isclose(got, case.expected, rel_tol=1e-9, abs_tol=1e-9):
        return None
    n, fmt = case.args
    hint = next((h for fn, h in MEMORY_MISTAKES if math.isclose(_try(fn, n, fmt) or math.nan, got, rel_tol=1e-9)), "")
    return f"expected {case.expected:,.6g} bytes, got {got:,.6g}", hint


class _FormatRefusal(Refusal):
    def __repr__(self) -> str:
        return "a ValueError that names the format"


def check_weight_memory(weight_memory: Callable, *, seed: int = 0, n_random: int = 6) -> None:
    """weight_memory(n_params, fmt) -> bytes: 4, 2, 2, 1 and 0.5 + 2/32 per weight for float32, float16,
    bfloat16, int8, int4."""
    rng = random.Random(seed)
    formats = ["float32", "float16", "bfloat16", "int8", "int4"]
    cases = [
        Case(
            f"a {n / 1e9:g}B model in {fmt}",
            (n, fmt),
            engine_weight_memory(n, fmt),
            "int4: half a byte per weight plus a 2-byte float16 scale per 32 weights" if fmt == "int4" else "",
        )
        for n in (7e9, 70e9)
        for fmt in formats
    ]
    cases += [
        Case(
            "GPT-2 small, 124,439,808 weights (an int) in int4",
            (124_439_808, "int4"),
            engine_weight_memory(124_439_808, "int4"),
        ),
        Case("no weights", (0, "int8"), 0.0),
        Case("an unknown format 'int3'", (1000, "int3"), _FormatRefusal(0, "")),
        Case("an unknown format 'fp8'", (1000, "fp8"), _FormatRefusal(0, "")),
    ]
    for i in range(n_random):
        n = rng.choice([rng.randint(1, 10**6), rng.random() * 1e12])
        fmt = rng.choice(formats)
        cases.append(Case(f"random #{i}", (n, fmt), engine_weight_memory(n, fmt)))

    def show(args):
        return f"weight_memory({args[0]!r}, {args[1]!r})"

    run_check(
        "weight_memory",
        catching_value_errors(weight_memory),
        cases,
        judge=_memory_verdict,
        forbid=FORBID,
        show_call=show,
        seconds=5,
        total_seconds=10,
    )
