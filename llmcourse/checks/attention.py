"""Checks for chapter 03, attention: softmax, the causal mask, scaled dot-product attention, heads,
GPT-2's multi-head self-attention, tiled attention with an online softmax, and the merge of two partial
attentions by their log-sum-exp.

Each check compares the learner's function with the engine's (`llmcourse.engine.parts`,
`llmcourse.engine.tiled_attention`), computed in float64 and returned in the input's dtype, on fixed edge
cases and seeded random ones: batch > 1, several heads, float64, odd sizes, masks of every shape,
values far from 0, float16 and bfloat16 with scores of about 1e4 (exact in their dtype: `large_exact_scores`).
When an answer is wrong, the message also names the mistake when the wrong answer is exactly what a known
mistake gives (no max shift, dividing by d instead of √d, the mask inverted or applied after the softmax, heads
split in the wrong order, the running sum not rescaled, a merge that overflows or weighs its parts 50/50, ...).
The tiled attention check also watches every tensor the learner's function makes (no score tensor wider than
the block in both dimensions) and the order of its products of queries and keys (FlashAttention-2's: the query
blocks outside, each finished before the next), and the merge's check ends in `LLMEngine`, whose decode steps
merge the partitions of a context with it.

    >>> def causal_mask(n_query, n_key):
    ...     query_pos = torch.arange(n_key - n_query, n_key)
    ...     return torch.arange(n_key)[None, :] <= query_pos[:, None]
    >>> check_causal_mask(causal_mask)
    ✓ causal_mask — 32 cases
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guarded
from llmcourse.engine import parts
from llmcourse.engine.generate import generate
from llmcourse.engine.slots import PartError
from llmcourse.engine.tiled_attention import merge_attention as engine_merge_attention
from llmcourse.engine.tokenizer import get_tokenizer
from llmcourse.serving.batching import Batching
from llmcourse.serving.llm_engine import LLMEngine

from .embeddings import HALF_DTYPES, NOT_CONTIGUOUS, check_in_engine
from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, call_learner, later, run_check
from .harness.forbid import DispatchWatch, Forbidden
from .harness.show import short
from .harness.tensors import Mistake, diagnose, in_float64, same_answer, tensor_judge, tensor_problem

OWN_SOFTMAX = "Write the softmax yourself: subtract the max, exponentiate, divide by the sum."
SOFTMAX_FAMILY = [
    Forbidden("torch.softmax", OWN_SOFTMAX),  # every route: torch.softmax, Tensor.softmax, F.softmax, aten
    Forbidden("torch._softmax", OWN_SOFTMAX),
    Forbidden("torch.special.special_softmax", OWN_SOFTMAX),
    Forbidden("torch.log_softmax", OWN_SOFTMAX),
    Forbidden("torch.special.special_log_softmax", OWN_SOFTMAX),
    Forbidden("torch.logsumexp", "The max shift is the point of this exercise: subtract the max yourself."),
    Forbidden("llmcourse.engine.parts.softmax", OWN_SOFTMAX),
]
OWN_ATTENTION = "Write it yourself from your softmax: scores = q @ kᵀ / √d, mask, softmax, @ v."
NO_ATTENTION = [
    *[Forbidden(f.target, "Use your own softmax.") for f in SOFTMAX_FAMILY],
    Forbidden("torch.nn.functional.scaled_dot_product_attention", OWN_ATTENTION),
    Forbidden("torch.nn.functional.multi_head_attention_forward", OWN_ATTENTION),
    Forbidden("llmcourse.engine.parts.attention", OWN_ATTENTION),
    Forbidden("llmcourse.engine.parts.attention_with_softmax", OWN_ATTENTION),
    Forbidden("llmcourse.engine.tiled_attention", OWN_ATTENTION),
    Forbidden("transformers", OWN_ATTENTION),
]
OWN_PARTS = "Use your own functions from this chapter (attention, split_heads, merge_heads, causal_mask)."


def _tolerance(dtype: torch.dtype, loose: bool = False) -> tuple[float, float]:
    """(atol, rtol): float64 answers must be float64-accurate, so a float32 detour is caught."""
    if dtype == torch.float64:
        return 1e-10, 1e-10
    if dtype in HALF_DTYPES:  # computed in float16 / bfloat16: a few roundings of each step (16 eps)
        eps = torch.finfo(dtype).eps
        return 16 * eps, 16 * eps
    return (1e-5, 1e-4) if loose else (1e-6, 1e-5)


def _in_engine_forbid(forbid: Sequence[Forbidden]) -> list[Forbidden]:
    """The black boxes that the engine itself does not call once the learner's part is in it."""
    return [f for f in forbid if not f.target.startswith(("llmcourse.", "torch.nn.functional.multi_head"))]


ENGINE_ERROR_HINTS = {"view size is not compatible": NOT_CONTIGUOUS}


def _judge(mistakes: Sequence[Mistake] = (), loose: bool = False) -> Callable[[Case, Any], Verdict]:
    return tensor_judge(lambda case: _tolerance(case.expected.dtype, loose), mistakes)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"<{dtype} {list(value.shape)}>"
    return repr(value)


def _show(name: str, *names: str) -> Callable[[tuple], str]:
    """Writes a call with tensors as <dtype [shape]> (their values are in expected/got)."""
    return lambda args: f"{name}({', '.join(f'{n}={_describe(a)}' for n, a in zip(names, args))})"


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """A random int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def _choice(g: torch.Generator, options: Sequence) -> Any:
    return options[_randint(g, 0, len(options) - 1)]


# ----------------------------------------------------------------------------------------------
# Softmax


def _shift_by(x: Tensor, dim: int, how: str) -> Tensor:
    shift = {
        "none": lambda: torch.zeros_like(x),
        "max": lambda: x.amax(dim, keepdim=True),
        "mean": lambda: x.mean(dim, keepdim=True),
        "min": lambda: x.amin(dim, keepdim=True),
        "global": lambda: x.max(),
    }[how]()
    e = torch.exp(x - shift)
    return e / e.sum(dim, keepdim=True)


SOFTMAX_MISTAKES: list[Mistake] = [  # the global max first: where it is right, the others are not named
    (
        lambda x, dim=-1: _shift_by(x, dim, "global"),
        "subtract the max of each row (x.amax(dim, keepdim=True)), not of the whole tensor: a row far below the "
        "global max underflows to 0 / 0",
    ),
    (
        lambda x, dim=-1: _shift_by(x, dim, "none"),
        "exp(x) overflows to inf for x above ~88 (float32) and inf / inf is nan: subtract each row's max first "
        "(softmax(x) = softmax(x - c) for any c)",
    ),
    (
        lambda x, dim=-1: _shift_by(x, dim, "mean"),
        "subtract the max, not the mean: x - mean can still be large and positive, and exp() overflows",
    ),
    (
        lambda x, dim=-1: _shift_by(x, dim, "min"),
        "subtract the max, not the min: x - min is >= 0 and exp() of it overflows",
    ),
    (
        lambda x, dim=-1: _shift_by(x, 0 if dim % x.dim() == x.dim() - 1 else -1, "max"),
        "normalise along `dim`, the argument, not always the last dimension: use keepdim=True so the max and the "
        "sum broadcast back along the same dimension",
    ),
]


def _softmax_case(description: str, x: Tensor, dim: int = -1, hint: str = "") -> Case:
    return Case(description, (x, dim), later(in_float64, torch.softmax, x, dim), hint)


def _random_logits(g: torch.Generator, i: int) -> tuple[str, Tensor, int]:
    ndim = _randint(g, 1, 4)
    shape = tuple(_randint(g, 1, 7) for _ in range(ndim))
    dim = _randint(g, -ndim, ndim - 1)
    dtype = _choice(g, [torch.float32, torch.float64, torch.float32, torch.float64, torch.float16, torch.bfloat16])
    scale = _choice(g, [0.1, 1.0, 10.0, 1000.0, 1e4])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    # each slice along `dim` gets its own offset: far from 0, and far from the other slices
    offset_shape = list(shape)
    offset_shape[dim] = 1
    x = x + (torch.rand(offset_shape, generator=g, dtype=torch.float64) - 0.5) * _choice(g, [0.0, 200.0, 2e4])
    if i % 3 == 2:  # some -inf, never a whole slice
        masked = torch.rand(shape, generator=g) < 0.4
        keep = torch.nn.functional.one_hot(x.argmax(dim), shape[dim]).bool().movedim(-1, dim)
        x = x.masked_fill(masked & ~keep, -math.inf)
    return f"shape {list(shape)}, dim={dim}, {str(dtype)[6:]}, scale {scale:g}", x.to(dtype), dim


def check_softmax(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """softmax(x, dim=-1) -> exp(x) / sum(exp(x)) along dim, for any shape and dim, in x's dtype."""
    inf = math.inf
    max_shift = "subtract the max along `dim` before exp(): every exponent is then <= 0"
    cases = [
        _softmax_case("a small row", torch.tensor([1.0, 2.0, 3.0])),
        _softmax_case("each row of a matrix sums to 1", torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]])),
        _softmax_case(
            "logits of +1e4 (exp overflows without the max shift)",
            torch.tensor([[1e4, 0.0, -1e4], [1e4, 1e4 - 1, 1e4 - 2]]),
            hint=max_shift,
        ),
        _softmax_case(
            "logits of -1e4 (exp underflows to 0 / 0 without the max shift)",
            torch.tensor([[-1e4, -1e4 - 1, -1e4 - 3]]),
            hint=max_shift,
        ),
        _softmax_case(
            "rows of -inf except one entry (masked scores)",
            torch.tensor([[-inf, 3.0, -inf], [-inf, -inf, -2.0], [0.0, -inf, -inf]]),
            hint="exp(-inf) = 0: a masked entry gets probability 0; the max of each row is finite here",
        ),
        _softmax_case(
            "causal scores: -inf above the diagonal",
            torch.tensor([[2.0, 0.0], [1.0, 3.0]]).masked_fill(torch.tensor([[False, True], [False, False]]), -inf),
        ),
        _softmax_case(
            "rows far apart (the max of the whole tensor is far above the second row)",
            torch.tensor([[0.0, 1.0, 2.0], [-1000.0, -1001.0, -999.0]]),
            hint="subtract each row's own max (keepdim=True), not the max of the whole tensor",
        ),
        _softmax_case(
            "float64 in, float64 out", torch.tensor([[0.1, 0.2, 0.3], [3.0, -3.0, 1e-3]], dtype=torch.float64)
        ),
        _softmax_case(
            "float64 logits of ±700", torch.tensor([[700.0, 699.0, -700.0]], dtype=torch.float64), hint=max_shift
        ),
        _softmax_case(
            "dim=0: each column sums to 1",
            torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 2.0, -3.0, 5.0], [2.0, 2.0, 0.0, -1.0]]),
            0,
        ),
        _softmax_case("dim=1 of a 3-D tensor", torch.arange(24.0).reshape(2, 3, 4).sin() * 5, 1),
        _softmax_case("dim=-2", torch.arange(12.0).reshape(3, 4).cos() * 3, -2),
        _softmax_case("one element", torch.tensor([[-5.0]])),
        _softmax_case("equal logits give a uniform distribution", torch.full((2, 5), 7.0)),
        _softmax_case(
            "attention scores [B, H, T, T]", (torch.arange(2 * 3 * 4 * 4.0).reshape(2, 3, 4, 4) * 1.7).sin() * 30
        ),
        _softmax_case(
            "float16 in, float16 out (scores far from 0)",
            torch.tensor([[300.0, 299.0, -5.0, 290.0]]).half(),
            hint="float16 in, float16 out: exp() of a float16 above ~11 overflows, so subtract the max",
        ),
        _softmax_case("bfloat16 in, bfloat16 out", (torch.arange(12.0).reshape(2, 6).cos() * 40).bfloat16()),
        _softmax_case(
            "float16 logits of ±1e4 (exp overflows, or underflows to 0 / 0, without the max shift)",
            torch.tensor([[9984.0, 9984.0, 9976.0, -9984.0], [-9984.0, -9992.0, -10000.0, -9984.0]]).half(),
            hint=max_shift,
        ),
        _softmax_case(
            "bfloat16 logits of ±1e4",
            torch.tensor([[9984.0, 9984.0, 9920.0, 0.0], [-9984.0, -9920.0, -9984.0, -10048.0]]).bfloat16(),
            hint=max_shift,
        ),
        _softmax_case(
            "a transposed (non-contiguous) view, dim=-1",
            (torch.arange(20.0).reshape(4, 5).sin() * 9).T,
            hint=NOT_CONTIGUOUS,
        ),
        _softmax_case(
            "1024 keys per row (GPT-2's context), with -inf on the future",
            (torch.arange(2 * 1024.0).reshape(2, 1024).sin() * 20).masked_fill(
                torch.arange(1024) > torch.tensor([[300], [1023]]), -inf
            ),
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        what, x, dim = _random_logits(g, i)
        cases.append(_softmax_case(f"random logits #{i} ({what})", x, dim))
    run_check(
        "softmax",
        fn,
        cases,
        judge=_judge(SOFTMAX_MISTAKES),
        forbid=SOFTMAX_FAMILY,
        seconds=5,
        total_seconds=30,
        error_hints=ENGINE_ERROR_HINTS,
        show_call=lambda args: f"softmax({_show_tensor(args[0])}, dim={args[1]})",
    )
    check_in_engine(
        "softmax",
        fn,
        _in_engine_forbid(SOFTMAX_FAMILY),
        hint="the engine calls softmax(scores, dim=-1) (dim by keyword) on [B, H, Tq, Tk] scores with -inf "
        "where the mask is False",
    )


def _show_tensor(x: Tensor) -> str:
    """Small tensors in full (they are the input a learner needs to see), large ones as <dtype [shape]>."""
    if x.numel() <= 12:
        values = ", ".join(f"{v:g}" for v in x.flatten().tolist())
        return f"tensor of shape {list(x.shape)} {str(x.dtype)[6:]} [{values}]"
    return _describe(x)


# ----------------------------------------------------------------------------------------------
# The causal mask


CAUSAL_MISTAKES: list[Mistake] = [
    (
        lambda nq, nk: torch.arange(nk)[None, :] < torch.arange(nk - nq, nk)[:, None],
        "off by one: a query may also see its own position (key j <= query position i, not <)",
    ),
    (
        lambda nq, nk: torch.arange(nk)[None, :] >= torch.arange(nk - nq, nk)[:, None],
        "that is the upper triangle: True must be where the key is at or BEFORE the query's position (the past)",
    ),
    (
        lambda nq, nk: torch.arange(nk)[None, :] <= torch.arange(nq)[:, None],
        "the queries are the LAST n_query positions: query i sits at position n_key - n_query + i",
    ),
    (
        lambda nq, nk: parts.causal_mask(nq, nk).float(),
        "return a bool tensor (True = may attend): a comparison such as `a <= b` gives one",
    ),
    (lambda nq, nk: ~parts.causal_mask(nq, nk), "the mask is inverted: True must mean 'may attend'"),
    (
        lambda nq, nk: torch.arange(nk)[None, :] % 256 <= torch.arange(nk - nq, nk)[:, None] % 256,
        "positions go past 255 (GPT-2 has 1024): compare int64 positions (torch.arange gives int64; uint8 wraps at "
        "256)",
    ),
]


def check_causal_mask(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """causal_mask(n_query, n_key) -> bool [n_query, n_key], True where query i may see key j."""

    def case(nq: int, nk: int, description: str, hint: str = "") -> Case:
        return Case(description, (nq, nk), later(parts.causal_mask, nq, nk), hint)

    cases = [
        case(1, 1, "one position sees itself"),
        case(3, 3, "prefill of 3 tokens: the lower triangle, diagonal included"),
        case(6, 6, "prefill of 6 tokens"),
        case(
            1,
            5,
            "decode: one new query after 4 cached positions sees all 5 keys",
            "query i sits at position n_key - n_query + i",
        ),
        case(3, 7, "a chunk of 3 queries at the end of 7 positions", "query i sits at position n_key - n_query + i"),
        case(2, 9, "2 queries at the end of 9 positions"),
        case(7, 8, "7 queries at the end of 8 positions"),
        case(
            5,
            9,
            "5 queries at the end of 9 positions (the same n_key as a case before)",
            "build the mask for the n_query and n_key you are given now: nothing may be kept from an earlier call",
        ),
        case(300, 300, "prefill of 300 tokens (past 255)", "positions go up to 299: compare int64 positions"),
        case(1, 300, "decode: one query after 299 cached positions"),
        case(
            3,
            1024,
            "3 queries at the end of GPT-2's whole context (1024 keys)",
            "build the mask for n_key keys, however many: nothing of a fixed size (256 or 1024 wide)",
        ),
        case(
            1100,
            1100,
            "1100 positions, past GPT-2's 1024",
            "nothing of a fixed size: compute the mask from n_query and n_key",
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        nk = _randint(g, 1, 40) if i % 4 else _randint(g, 41, 1200)
        nq = _choice(g, [nk, 1, _randint(g, 1, nk)])
        cases.append(case(nq, nk, f"random #{i}: n_query={nq}, n_key={nk}"))
    run_check(
        "causal_mask",
        fn,
        cases,
        judge=_judge(CAUSAL_MISTAKES),
        forbid=[
            Forbidden(
                "llmcourse.engine.parts.causal_mask", "Write it yourself: compare key positions with query positions."
            ),
        ],
        seconds=5,
        total_seconds=20,
        show_call=lambda args: f"causal_mask({args[0]}, {args[1]})",
    )


# ----------------------------------------------------------------------------------------------
# Scaled dot-product attention


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    fill: float = -math.inf,
    after: bool = False,
) -> Tensor:
    """Attention written out; the keyword arguments make the known mistakes."""
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)  # [B, H, Tq, Tk]
    if mask is not None and not after:
        scores = scores.masked_fill(~mask, fill)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and after:
        probs = probs * mask
    return probs @ v


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """The expected answer: the engine's fused attention (None = no mask), in float64."""
    return in_float64(
        lambda *a: torch.nn.functional.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), q, k, v, mask
    )


def _first_row_mask(q, k, v, mask=None):
    return _attention(q, k, v, None if mask is None else mask[:1] if mask.dim() == 4 else mask)


ATTENTION_MISTAKES: list[Mistake] = [
    (
        lambda q, k, v, mask=None: _attention(q, k, v, mask, scale=1 / q.shape[-1]),
        "scale the scores by 1/√d (d = q.shape[-1], the head dimension), not 1/d",
    ),
    (
        lambda q, k, v, mask=None: _attention(q, k, v, mask, scale=1.0),
        "divide the scores by √d (d = q.shape[-1]): without it softmax saturates as d grows",
    ),
    (
        lambda q, k, v, mask=None: _attention(q, k, v, mask, scale=1 / math.sqrt(k.shape[-2])),
        "scale by √d where d is the head dimension q.shape[-1], not the number of keys",
    ),
    (
        lambda q, k, v, mask=None: _attention(q, k, v, None if mask is None else ~mask),
        "the mask is inverted: True means 'may attend', so fill the scores where the mask is False (~mask)",
    ),
    (
        lambda q, k, v, mask=None: _attention(q, k, v, mask, after=True),
        "apply the mask before the softmax (scores where mask is False -> -inf); multiplying the probabilities by "
        "the mask afterwards leaves rows that no longer sum to 1",
    ),
    (
        lambda q, k, v, mask=None: _attention(q, k, v, mask, fill=0.0),
        "fill masked scores with -inf (or a very negative number), not 0: exp(0) = 1 still gives them weight",
    ),
    (
        lambda q, k, v, mask=None: _attention(
            q, k, v, parts.causal_mask(q.shape[-2], k.shape[-2]) if mask is None else mask
        ),
        "mask=None means no mask at all: every query attends to every key (the caller passes the causal mask)",
    ),
    (
        lambda q, k, v, mask=None: _attention(
            q, k[..., -q.shape[-2] :, :], v[..., -q.shape[-2] :, :], None if mask is None else mask[..., -q.shape[-2] :]
        ),
        "Tq and Tk differ: every query attends to all Tk keys (use k.shape[-2] for the keys, q.shape[-2] for the "
        "queries)",
    ),
    (
        _first_row_mask,
        "use the whole mask: each batch item has its own padding (do not index mask[0] or drop a "
        "dimension; masked_fill broadcasts a [B, 1, 1, Tk] mask by itself)",
    ),
]


def _random_mask(g: torch.Generator, kind: int, B: int, H: int, Tq: int, Tk: int) -> tuple[str, Optional[Tensor]]:
    """None, a causal [Tq, Tk], a padding [B, 1, 1, Tk] or a random [B, H, Tq, Tk] mask; no row all False."""
    if kind == 0:
        return "no mask", None
    if kind == 1:
        return "causal mask [Tq, Tk]", parts.causal_mask(Tq, Tk)
    if kind == 2:
        valid = torch.rand(B, 1, 1, Tk, generator=g) < 0.6
        valid[..., _randint(g, 0, Tk - 1)] = True
        return "padding mask [B, 1, 1, Tk]", valid
    mask = torch.rand(B, H, Tq, Tk, generator=g) < 0.5
    mask[..., -1] |= ~mask.any(-1)
    return "random mask [B, H, Tq, Tk]", mask


def _attention_case(
    description: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, hint: str = ""
) -> Case:
    return Case(description, (q, k, v, mask), later(reference_attention, q, k, v, mask), hint)


def _qkv(
    g: torch.Generator,
    B: int,
    H: int,
    Tq: int,
    Tk: int,
    D: int,
    Dv: Optional[int] = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(B, H, Tk, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(B, H, Tk, Dv or D, generator=g, dtype=torch.float64) * 3 + 1
    return q.to(dtype), k.to(dtype), v.to(dtype)


LARGE_SCORE = 9984  # about 1e4: exp overflows float16, bfloat16, float32 and float64 at this score


def large_exact_scores(
    g: torch.Generator, q_shape: Sequence[int], k_shape: Sequence[int], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Queries and keys (last dimension 16) in float16 or bfloat16 whose scaled scores q·k / √16 are ±LARGE_SCORE
    less a few steps, and exact in the dtype: each query is ±64 along one axis, each key 624 less 0-3 steps of
    the dtype's grid (0.5 in float16, 4 in bfloat16), so every product, sum and the division by 4 are exact, and
    a row's top scores tie or lie 8 (float16) or 64 (bfloat16) apart. Without the max shift exp() overflows (+)
    or underflows to 0 / 0 (-); with it, a float64 reference is the exact answer to within the output's rounding,
    so the dtype's own accuracy (a few eps) is the tolerance."""
    D = 16
    assert q_shape[-1] == k_shape[-1] == D
    step = 0.5 if dtype == torch.float16 else 4.0
    axis = torch.randint(0, D, tuple(q_shape[:-1]), generator=g)
    sign = torch.randint(0, 2, (*q_shape[:-1], 1), generator=g).double() * 2 - 1
    q = torch.nn.functional.one_hot(axis, D).double() * 64 * sign
    k = 624 - step * torch.randint(0, 4, tuple(k_shape), generator=g).double()
    return q.to(dtype), k.to(dtype)


def _large_qkv(g: torch.Generator, B: int, H: int, Tq: int, Tk: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """q, k, v [B, H, T, 16] with scores of about ±1e4, exact in `dtype` (`large_exact_scores`)."""
    q, k = large_exact_scores(g, (B, H, Tq, 16), (B, H, Tk, 16), dtype)
    return q, k, (torch.randn(B, H, Tk, 16, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)


def _engine_qkv(
    g: torch.Generator,
    B: int,
    H: int,
    Tq: int,
    Tk: int,
    D: int,
    dtype: torch.dtype = torch.float32,
    cached: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the engine passes them: q from split_heads (a transposed view of the projection's slice), k and
    v the first Tk positions of a preallocated cache (a slice), all non-contiguous."""
    qkv = torch.randn(B, Tq, 3 * H * D, generator=g, dtype=torch.float64).to(dtype)
    q = qkv[..., : H * D].view(B, Tq, H, D).transpose(1, 2)
    if not cached:
        k, v = (t.view(B, Tq, H, D).transpose(1, 2) for t in qkv[..., H * D :].split(H * D, dim=-1))
        return q, k, v
    cache = (torch.randn(2, B, H, Tk + 5, D, generator=g, dtype=torch.float64) * 2).to(dtype)
    return q, cache[0, :, :, :Tk], cache[1, :, :, :Tk]


def _engine_padding_mask(lengths: Sequence[int], Tq: int, Tk: int) -> Tensor:
    """The mask the engine builds for a left-padded batch: [B, 1, Tq, Tk], a padding query sees only itself."""
    real = torch.stack([torch.arange(Tk) >= Tk - n for n in lengths])  # [B, Tk]
    key_pos, query_pos = torch.arange(Tk), Tk - Tq + torch.arange(Tq)
    return ((key_pos <= query_pos[:, None]) & real[:, None, None, :]) | (key_pos == query_pos[:, None])


def check_attention(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """attention(q, k, v, mask=None) -> softmax(q kᵀ / √d, masked) v, [B, H, Tq, Dv].

    Also as the engine calls it: non-contiguous q (split_heads) and k, v (slices of a cache), the engine's
    masks ([Tq, Tk] causal, [B, 1, Tq, Tk] padding), 300 and 1024 keys, float16 / bfloat16; then inside
    the engine (`check_in_engine`)."""
    g = torch.Generator().manual_seed(seed)
    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were
    pad = torch.tensor(
        [[True, True, True, False, False], [True, True, True, True, True], [False, True, True, True, False]]
    )
    cases = [
        _attention_case(
            "one query, two keys, no mask",
            torch.tensor([[[[1.0, 0.0]]]]),
            torch.tensor([[[[2.0, 0.0], [0.0, 2.0]]]]),
            torch.tensor([[[[10.0], [20.0]]]]),
            hint="scores = [2, 0] / √2; weights = softmax(scores); out = weights @ v",
        ),
        _attention_case("mask=None attends everywhere", *_qkv(g, 1, 1, 4, 4, 8)),
        _attention_case("a causal mask [T, T]", *_qkv(g, 1, 2, 5, 5, 8), parts.causal_mask(5, 5)),
        _attention_case(
            "head dimension 64 (the scale 1/√d matters)", *_qkv(g, 1, 2, 4, 6, 64), parts.causal_mask(4, 6)
        ),
        _attention_case(
            "batch of 3, each with its own padding mask [B, 1, 1, Tk]",
            *_qkv(g, 3, 2, 5, 5, 4),
            pad[:, None, None, :],
            "masked_fill broadcasts the mask; keep its batch dimension",
        ),
        _attention_case("decode: one query, 7 keys, mask [1, 7]", *_qkv(g, 2, 2, 1, 7, 8), parts.causal_mask(1, 7)),
        _attention_case(
            "3 queries at the end of 7 keys, causal mask [3, 7]",
            *_qkv(g, 1, 3, 3, 7, 8),
            parts.causal_mask(3, 7),
            "Tq and Tk differ: use q.shape[-2] and k.shape[-2], not one T",
        ),
        _attention_case(
            "values with another last dimension (Dv=5, D=4)",
            *_qkv(g, 2, 1, 3, 4, 4, 5),
            hint="the output has v's last dimension: [B, H, Tq, Dv]",
        ),
        _attention_case(
            "float64 in, float64 out", *_qkv(g, 2, 2, 4, 4, 8, dtype=torch.float64), parts.causal_mask(4, 4)
        ),
        _attention_case(
            "a random mask per head [B, H, Tq, Tk]", *_qkv(g, 2, 3, 4, 6, 8), *_random_mask(g, 3, 2, 3, 4, 6)[1:]
        ),
        _attention_case(
            "scores far from 0 (q and k ×20)",
            *_qkv(g, 1, 2, 5, 5, 16, scale=20.0),
            parts.causal_mask(5, 5),
            "your softmax must be the stable one",
        ),
        _attention_case(
            "as the engine calls it: q from split_heads, k and v slices of a cache (non-contiguous), "
            "causal mask [4, 9]",
            *_engine_qkv(g, 2, 3, 4, 9, 8),
            parts.causal_mask(4, 9),
            NOT_CONTIGUOUS,
        ),
        _attention_case(
            "prefill of 300 tokens (past 256 keys), causal mask [300, 300], non-contiguous q, k, v",
            *_engine_qkv(g, 1, 2, 300, 300, 16, cached=False),
            parts.causal_mask(300, 300),
            "build nothing of a fixed size: Tk is k.shape[-2], however many keys",
        ),
        _attention_case(
            "decode: one query, 1024 keys (GPT-2's context) in a cache",
            *_engine_qkv(g, 2, 2, 1, 1024, 16),
            parts.causal_mask(1, 1024),
        ),
        _attention_case(
            "the engine's padding mask [B, 1, Tq, Tk] (rows of 6 and 3 real tokens; a padding query sees only itself)",
            *_engine_qkv(g, 2, 2, 6, 6, 8, cached=False),
            _engine_padding_mask([6, 3], 6, 6),
        ),
        _attention_case(
            "float16 in, float16 out (non-contiguous, causal)",
            *_engine_qkv(g, 1, 2, 5, 7, 16, torch.float16),
            parts.causal_mask(5, 7),
            "float16 in, float16 out",
        ),
        _attention_case(
            "bfloat16 in, bfloat16 out, a padding mask",
            *_engine_qkv(g, 2, 1, 4, 4, 8, torch.bfloat16, cached=False),
            _engine_padding_mask([4, 2], 4, 4),
        ),
        _attention_case(
            "float16, scores of about ±1e4 (exact in float16), causal mask [4, 6]",
            *_large_qkv(large, 2, 2, 4, 6, torch.float16),
            parts.causal_mask(4, 6),
            "exp() overflows float16 above ~11 (and float32 above ~88): your softmax must subtract each row's max",
        ),
        _attention_case("bfloat16, scores of about ±1e4, no mask", *_large_qkv(large, 1, 3, 3, 5, torch.bfloat16)),
    ]
    for i in range(n_random):
        B, H, D = _randint(g, 1, 3), _randint(g, 1, 4), _choice(g, [1, 3, 8, 16, 64])
        Tk = _randint(g, 1, 12)
        Tq = _choice(g, [Tk, 1, _randint(g, 1, Tk)])
        Dv = _choice(g, [D, D, _randint(g, 1, 9)])
        dtype = _choice(g, [torch.float32, torch.float64, torch.float32, torch.float64, torch.float16, torch.bfloat16])
        scale = _choice(g, [0.5, 1.0, 5.0] if dtype not in HALF_DTYPES else [0.5, 1.0])
        what, mask = _random_mask(g, i % 4, B, H, Tq, Tk)
        q, k, v = _qkv(g, B, H, Tq, Tk, D, Dv, scale=scale, dtype=dtype)
        if i % 3 == 1:  # the engine's layouts: transposed views
            q, k, v = (t.transpose(-2, -3).contiguous().transpose(-2, -3) for t in (q, k, v))
        cases.append(
            _attention_case(
                f"random #{i} (B={B}, H={H}, Tq={Tq}, Tk={Tk}, D={D}, Dv={Dv}, {str(dtype)[6:]}, {what})", q, k, v, mask
            )
        )
    run_check(
        "attention",
        fn,
        cases,
        judge=_judge(ATTENTION_MISTAKES, loose=True),
        forbid=NO_ATTENTION,
        error_hints={
            "is not written yet": "attention calls your softmax: if attention is written, write "
            "softmax (exercise 1) first",
            **ENGINE_ERROR_HINTS,
        },
        seconds=5,
        total_seconds=30,
        show_call=_show("attention", "q", "k", "v", "mask"),
    )
    check_in_engine(
        "attention",
        fn,
        _in_engine_forbid(NO_ATTENTION),
        hint="the engine calls attention(q, k, v, mask) with q from split_heads and k, v from its cache "
        "(non-contiguous views), mask [Tq, Tk] (causal) or [B, 1, Tq, Tk] (padding)",
    )


# ----------------------------------------------------------------------------------------------
# Heads


SPLIT_MISTAKES: list[Mistake] = [
    (
        lambda x, n: x.reshape(x.shape[0], n, x.shape[1], x.shape[2] // n),
        "view(B, n_head, T, D) mixes positions into heads: view as (B, T, n_head, D), then transpose(1, 2)",
    ),
    (
        lambda x, n: x.reshape(x.shape[0], x.shape[1], x.shape[2] // n, n).permute(0, 3, 1, 2),
        "head h holds channels h·D … (h+1)·D - 1 (consecutive), not every n_head-th channel: view as (B, T, n_head, D)",
    ),
    (
        lambda x, n: x.reshape(-1, n, x.shape[2] // n).transpose(0, 1).reshape(x.shape[0], n, x.shape[1], -1),
        "keep the batch dimension apart: view as (B, T, n_head, D) and transpose(1, 2); reshaping B·T rows mixes "
        "batch items",
    ),
]
MERGE_MISTAKES: list[Mistake] = [
    (
        lambda x: x.reshape(x.shape[0], x.shape[2], -1),
        "transpose back first: x.transpose(1, 2) is [B, T, H, D]; then reshape to [B, T, H·D]",
    ),
    (
        lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1),
        "head h's channels go to h·D … (h+1)·D - 1 (consecutive): transpose(1, 2), not a permute that puts heads last",
    ),
    (
        lambda x: x.transpose(0, 2).reshape(x.shape[2], x.shape[0], -1).transpose(0, 1),
        "keep the batch dimension first: x.transpose(1, 2).reshape(B, T, H * D)",
    ),
]


def _distinct(g: torch.Generator, shape: tuple, dtype: torch.dtype) -> Tensor:
    """Values that are all different (any permutation shows), far from 0."""
    n = math.prod(shape)
    return (
        (torch.randperm(n, generator=g).to(torch.float64) + torch.rand(n, generator=g, dtype=torch.float64))
        .reshape(shape)
        .to(dtype)
    )


def _head_shapes(g: torch.Generator, n_random: int) -> list[tuple[str, tuple[int, int, int], int, torch.dtype]]:
    shapes = [
        ("one position, one batch item", (1, 1, 6), 2, torch.float32),
        ("batch 1, 4 positions, 3 heads of 2", (1, 4, 6), 3, torch.float32),
        ("batch 2, 5 positions, 2 heads of 4", (2, 5, 8), 2, torch.float32),
        ("batch 3, one head (n_head=1)", (3, 4, 6), 1, torch.float32),
        ("heads of one channel (n_head=C)", (2, 3, 4), 4, torch.float32),
        ("float64", (2, 3, 12), 3, torch.float64),
        ("GPT-2's sizes: 12 heads of 64", (2, 7, 768), 12, torch.float32),
        ("300 positions, the bundled model's 6 heads of 32", (1, 300, 192), 6, torch.float32),
        ("float16", (2, 3, 8), 2, torch.float16),
        ("bfloat16", (1, 4, 12), 4, torch.bfloat16),
    ]
    for i in range(n_random):
        n_head, D = _randint(g, 1, 8), _randint(g, 1, 9)
        B, T = _randint(g, 1, 4), _randint(g, 1, 9)
        dtype = _choice(g, [torch.float32, torch.float64, torch.float32, torch.float16, torch.bfloat16])
        shapes.append((f"random #{i}", (B, T, n_head * D), n_head, dtype))
    return shapes


def check_split_heads(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """split_heads(x [B, T, C], n_head) -> [B, n_head, T, C // n_head]; head h holds channels h·D … (h+1)·D - 1."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i, (what, shape, n_head, dtype) in enumerate(_head_shapes(g, n_random)):
        if (
            i % 2 and i > 2
        ):  # as the engine passes it: one of the pieces of qkv.split(C, dim=-1), a non-contiguous slice
            x = _distinct(g, (shape[0], shape[1], 3 * shape[2]), dtype).split(shape[2], dim=-1)[i % 3]
            what += " (x a slice of qkv, as the engine passes it)"
        else:
            x = _distinct(g, shape, dtype)
        cases.append(
            Case(
                f"{what}: B={shape[0]}, T={shape[1]}, C={shape[2]}, n_head={n_head}",
                (x, n_head),
                parts.split_heads(x, n_head).contiguous(),
            )
        )
    forbid = [Forbidden("llmcourse.engine.parts.split_heads", "Write it yourself with view and transpose.")]
    run_check(
        "split_heads",
        fn,
        cases,
        judge=_judge(SPLIT_MISTAKES),
        forbid=forbid,
        error_hints=ENGINE_ERROR_HINTS,
        seconds=5,
        total_seconds=20,
        show_call=lambda args: f"split_heads(x={_describe(args[0])}, n_head={args[1]})",
    )
    check_in_engine(
        "split_heads",
        fn,
        _in_engine_forbid(forbid),
        hint="the engine calls split_heads three times (q, k, v) and keeps the three results: return a "
        "new view or tensor each time, not a buffer reused between calls",
    )


def check_merge_heads(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """merge_heads(x [B, H, T, D]) -> [B, T, H·D], the inverse of split_heads."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i, (what, (B, T, C), n_head, dtype) in enumerate(_head_shapes(g, n_random)):
        if i % 2:  # a transposed view, as split_heads gives
            x = _distinct(g, (B, T, n_head, C // n_head), dtype).transpose(1, 2)
            what += " (x a transposed view)"
        else:
            x = _distinct(g, (B, n_head, T, C // n_head), dtype)
        cases.append(Case(f"{what}: B={B}, H={n_head}, T={T}, D={C // n_head}", (x,), later(parts.merge_heads, x)))
    forbid = [Forbidden("llmcourse.engine.parts.merge_heads", "Write it yourself with transpose and reshape.")]
    run_check(
        "merge_heads",
        fn,
        cases,
        judge=_judge(MERGE_MISTAKES),
        forbid=forbid,
        error_hints={
            "view size is not compatible": "after transpose(1, 2) the memory is not laid out as [B, T, H·D]: use "
            ".reshape(B, T, H * D) (or .contiguous().view(...))"
        },
        seconds=5,
        total_seconds=20,
        show_call=lambda args: f"merge_heads(x={_describe(args[0])})",
    )
    check_in_engine(
        "merge_heads",
        fn,
        _in_engine_forbid(forbid),
        hint="the engine calls merge_heads on attention's [B, H, T, D] output",
    )


# ----------------------------------------------------------------------------------------------
# GPT-2's multi-head self-attention


def _self_attention(
    x,
    c_attn_weight,
    c_attn_bias,
    c_proj_weight,
    c_proj_bias,
    n_head,
    *,
    order=(0, 1, 2),
    causal=True,
    proj=True,
    heads_first=False,
    one_head=False,
    scale_by_width=False,
    attn_bias=True,
    proj_bias=True,
):
    """GPT-2's attention written out (softmax of the masked, scaled scores); the keyword arguments make the
    known mistakes."""
    C = x.shape[-1]
    n_head = 1 if one_head else n_head
    qkv = x @ c_attn_weight + (c_attn_bias if attn_bias else 0)  # [B, T, 3C]
    if heads_first:
        q, k, v = parts.split_heads(qkv, n_head).chunk(3, dim=-1)  # [B, H, T, 3D] cut in three: wrong
    else:
        q, k, v = (parts.split_heads(t, n_head) for t in qkv.split(C, dim=-1))  # [B, H, T, D]
        q, k, v = ((q, k, v)[i] for i in order)
    T = x.shape[1]
    mask = parts.causal_mask(T, T) if causal else None
    out = parts.merge_heads(_attention(q, k, v, mask, scale=C**-0.5 if scale_by_width else None))  # [B, T, C]
    return out @ c_proj_weight + (c_proj_bias if proj_bias else 0) if proj else out


def reference_self_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    """The expected answer, in float64, returned in x's dtype."""
    return in_float64(_self_attention, x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head)


SELF_ATTENTION_MISTAKES: list[Mistake] = [
    (
        functools.partial(_self_attention, order=(1, 0, 2)),
        "the fused projection's output is [q | k | v] along the last dim, in that order: q, k, v = qkv.split(C, "
        "dim=-1)",
    ),
    (
        functools.partial(_self_attention, order=(0, 2, 1)),
        "the fused projection's output is [q | k | v] along the last dim, in that order: q, k, v = qkv.split(C, "
        "dim=-1)",
    ),
    (
        functools.partial(_self_attention, causal=False),
        "GPT-2's attention is causal: pass causal_mask(T, T) to attention (None means no mask)",
    ),
    (
        functools.partial(_self_attention, proj=False),
        "finish with the output projection: merged @ c_proj_weight + c_proj_bias",
    ),
    (
        functools.partial(_self_attention, heads_first=True),
        "split qkv into q, k, v (along the last dim, C each) first, then split each into heads",
    ),
    (
        functools.partial(_self_attention, one_head=True),
        "use the n_head you are given: n_head heads of C // n_head channels each (split_heads(t, n_head)); one head "
        "over all C channels, or a fixed number of heads, is another attention",
    ),
    (
        functools.partial(_self_attention, scale_by_width=True),
        "each head scales its scores by 1/√D, D = C // n_head its own width (attention does it with q.shape[-1] of "
        "the split q), not by 1/√C",
    ),
    (
        functools.partial(_self_attention, attn_bias=False),
        "add the bias of the fused projection: qkv = x @ c_attn_weight + c_attn_bias (the check's biases are not 0)",
    ),
    (
        functools.partial(_self_attention, proj_bias=False),
        "add the bias of the output projection: merged @ c_proj_weight + c_proj_bias (the check's biases are not 0)",
    ),
]


def _self_attention_tolerance(case: Case) -> tuple[float, float]:
    """The accuracy contract of self_attention: the answer of any correct order of work in x's dtype (or wider),
    rounded to x's dtype. Each of its steps (two projections, the scores, the softmax, the weighted sum) rounds
    to the dtype, and the projections sum C products, so the error is relative to the size of the output, not
    to each entry (an entry near 0 is a difference of large terms): atol = k·eps·max|expected| with k = 1e-5 / eps
    for float32 (about 100 roundings: float64 accumulation, einsum or numpy pass; a float32 detour for float64
    does not), 2e-10 for float64, and 16 roundings for float16 / bfloat16 (rtol the same)."""
    dtype = case.expected.dtype
    size = max(1.0, float(case.expected.double().abs().max()))
    if dtype == torch.float64:
        return 2e-10 * size, 1e-10
    if dtype in HALF_DTYPES:
        eps = torch.finfo(dtype).eps
        return 16 * eps * size, 16 * eps
    return 1e-5 * size, 1e-4


@functools.lru_cache(maxsize=1)
def _bundled_layer() -> tuple[Tensor, ...]:
    """Layer 0's attention weights of the bundled model, and n_head."""
    model = bundled_model()
    attn = model.h[0].attn
    return (
        attn.c_attn.weight.detach().clone(),
        attn.c_attn.bias.detach().clone(),
        attn.c_proj.weight.detach().clone(),
        attn.c_proj.bias.detach().clone(),
        model.config.n_head,
    )


def _layer_as(layer: tuple, dtype: torch.dtype, n_head: Optional[int] = None, bias_shift: float = 0.0) -> tuple:
    """A layer's weights in another dtype, with another n_head, or with its biases moved away from 0."""
    w, b, pw, pb, h = layer
    return (
        w.to(dtype),
        (b.double() + bias_shift).to(dtype),
        pw.to(dtype),
        (pb.double() - bias_shift).to(dtype),
        h if n_head is None else n_head,
    )


def _random_layer(g: torch.Generator, C: int, n_head: int, dtype: torch.dtype) -> tuple:
    """Weights of a GPT-2 scale; biases far from 0 (1 ± 0.5), so that a dropped bias shows."""
    w = lambda *shape, s=1.0, at=0.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * s + at).to(dtype)  # noqa: E731
    return w(C, 3 * C, s=C**-0.5), w(3 * C, s=0.5, at=1.0), w(C, C, s=C**-0.5), w(C, s=0.5, at=-1.0), n_head


def _sequence_first(g: torch.Generator, B: int, T: int, C: int, dtype: torch.dtype) -> Tensor:
    """x [B, T, C] as a transposed view of a [T, B, C] tensor (non-contiguous: x.view(B * T, C) fails)."""
    return (torch.randn(T, B, C, generator=g, dtype=torch.float64) * 2).to(dtype).transpose(0, 1)


def _large_score_layer(g: torch.Generator, B: int, T: int, dtype: torch.dtype) -> tuple[Tensor, tuple]:
    """x [B, T, 32] and a layer of 2 heads of 16 whose scaled scores are about +1e4 (head 0) and -1e4 (head 1),
    exact in float16 / bfloat16 as `large_exact_scores` makes them: channel 0 of x is 64 and becomes every query's
    first coordinate (negated in head 1), channel 1 is a key value near 624 and becomes every key's first
    coordinate, the other channels carry the values; each projection has one weight of ±1 per output channel."""
    C, D = 32, 16
    keys = large_exact_scores(g, (1, D), (B, T, D), dtype)[1][..., :1].double()  # [B, T, 1]: 624 less a few steps
    x = torch.cat(
        [
            torch.full((B, T, 1), 64.0, dtype=torch.float64),
            keys,
            torch.randn(B, T, C - 2, generator=g, dtype=torch.float64) * 2,
        ],
        dim=-1,
    )
    w = torch.zeros(C, 3 * C, dtype=torch.float64)
    w[0, 0], w[0, D], w[1, C], w[1, C + D] = 1.0, -1.0, 1.0, 1.0  # q of head 0 = +64, of head 1 = -64; k = the key
    w[torch.arange(2, C), 2 * C + torch.arange(C - 2)] = 1.0  # v: the other channels
    b = torch.cat([torch.zeros(2 * C, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64) * 0.5])
    proj_w = torch.randn(C, C, generator=g, dtype=torch.float64) * C**-0.5
    proj_b = torch.randn(C, generator=g, dtype=torch.float64) * 0.5 + 1.0
    return x.to(dtype), (w.to(dtype), b.to(dtype), proj_w.to(dtype), proj_b.to(dtype), 2)


def _self_attention_case(description: str, x: Tensor, layer: tuple, hint: str = "") -> Case:
    return Case(description, (x, *layer), later(reference_self_attention, x, *layer), hint)


def check_self_attention(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """self_attention(x [B, T, C], c_attn_weight [C, 3C], c_attn_bias [3C], c_proj_weight [C, C],
    c_proj_bias [C], n_head) -> [B, T, C]: GPT-2's causal multi-head self-attention.

    Not an engine slot (the engine runs its blocks from the parts: split_heads, attention, merge_heads, whose
    checks end inside it), so this check ends with its own cases: the bundled model's layer in float32, float16
    and bfloat16 and with another n_head, 300 positions, x a non-contiguous view, biases far from 0."""
    g = torch.Generator().manual_seed(seed)
    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were
    bundled = _bundled_layer()
    C = bundled[0].shape[0]
    x = lambda *shape, dtype=torch.float32: (torch.randn(*shape, generator=g, dtype=torch.float64) * 2).to(dtype)  # noqa: E731
    no_fixed_size = "build the mask from this call's T (causal_mask(T, T)): nothing of a fixed size (256 or 1024 wide)"
    cases = [
        _self_attention_case("one position, 2 heads", x(1, 1, 4), _random_layer(g, 4, 2, torch.float32)),
        _self_attention_case("3 positions, 2 heads of 3", x(1, 3, 6), _random_layer(g, 6, 2, torch.float32)),
        _self_attention_case("batch 2, 5 positions, 3 heads", x(2, 5, 12), _random_layer(g, 12, 3, torch.float32)),
        _self_attention_case(
            "float64 in, float64 out", x(2, 4, 8, dtype=torch.float64), _random_layer(g, 8, 2, torch.float64)
        ),
        _self_attention_case(
            f"the bundled model's layer 0 (C={C}, {bundled[-1]} heads), 9 positions", x(1, 9, C), bundled
        ),
        _self_attention_case("the bundled model's layer 0, batch 3", x(3, 6, C), bundled),
        _self_attention_case(
            f"the bundled layer's weights split into 3 heads of {C // 3} (n_head is an argument)",
            x(2, 7, C),
            _layer_as(bundled, torch.float32, n_head=3),
            "split into the n_head heads you are given, not the bundled model's number",
        ),
        _self_attention_case("the same weights, 12 heads", x(1, 5, C), _layer_as(bundled, torch.float32, n_head=12)),
        _self_attention_case(
            "biases far from 0 (c_attn_bias + 2, c_proj_bias - 2)",
            x(2, 6, C),
            _layer_as(bundled, torch.float32, bias_shift=2.0),
        ),
        _self_attention_case(
            "x a non-contiguous view (a transposed [T, B, C] tensor)",
            _sequence_first(g, 2, 5, 12, torch.float32),
            _random_layer(g, 12, 4, torch.float32),
            NOT_CONTIGUOUS,
        ),
        _self_attention_case("300 positions (past 256), the bundled layer", x(1, 300, C), bundled, no_fixed_size),
        _self_attention_case(
            "float16 in, float16 out (the bundled layer in float16)",
            x(2, 8, C, dtype=torch.float16),
            _layer_as(bundled, torch.float16),
            "float16 in, float16 out",
        ),
        _self_attention_case(
            "float16, scores of about ±1e4 (exact in float16): exp overflows without the max shift",
            *_large_score_layer(large, 2, 6, torch.float16),
            "exp() overflows float16 above ~11: the softmax inside your attention must subtract each row's max",
        ),
        _self_attention_case(
            "bfloat16, scores of about ±1e4 (exact in bfloat16)", *_large_score_layer(large, 1, 7, torch.bfloat16)
        ),
        _self_attention_case(
            "bfloat16 in, bfloat16 out, 260 positions",
            x(1, 260, C, dtype=torch.bfloat16),
            _layer_as(bundled, torch.bfloat16, n_head=4),
            no_fixed_size,
        ),
    ]
    for i in range(n_random):
        n_head, D = _randint(g, 1, 4), _randint(g, 1, 8)
        B, T = _randint(g, 1, 3), _randint(g, 1, 10) if i % 5 else _randint(g, 11, 300)
        dtype = _choice(g, [torch.float32, torch.float64, torch.float32, torch.float64, torch.float16, torch.bfloat16])
        what = ""
        if i % 3 == 1:
            xi, what = _sequence_first(g, B, T, n_head * D, dtype), ", x non-contiguous"
        else:
            xi = x(B, T, n_head * D, dtype=dtype)
        cases.append(
            _self_attention_case(
                f"random #{i}: B={B}, T={T}, C={n_head * D}, n_head={n_head}, {str(dtype)[6:]}{what}",
                xi,
                _random_layer(g, n_head * D, n_head, dtype),
            )
        )
    run_check(
        "self_attention",
        fn,
        cases,
        judge=tensor_judge(_self_attention_tolerance, SELF_ATTENTION_MISTAKES),
        forbid=[
            *NO_ATTENTION,
            Forbidden("llmcourse.engine.parts", OWN_PARTS),
            Forbidden("llmcourse.engine.model", OWN_PARTS),
            Forbidden("torch.nn.MultiheadAttention", OWN_PARTS),
        ],
        error_hints={
            "is not written yet": "self_attention uses your causal_mask, attention, split_heads and "
            "merge_heads (and attention your softmax): write those first",
            "view size is not compatible": "x is a non-contiguous view here (a transposed [T, B, C] tensor): "
            ".view() cannot reshape it; x @ c_attn_weight works on any layout, "
            "or use .reshape() (or .contiguous().view())",
            "must match the size of tensor": "a size that does not fit this call: build the mask from this "
            "call's T (causal_mask(T, T), nothing of a fixed size) and split "
            "into this call's n_head heads of C // n_head",
        },
        seconds=5,
        total_seconds=30,
        show_call=_show(
            "self_attention", "x", "c_attn_weight", "c_attn_bias", "c_proj_weight", "c_proj_bias", "n_head"
        ),
    )


# ----------------------------------------------------------------------------------------------
# Tiled attention with an online softmax


def _scaled_scores(q: Tensor, k: Tensor, causal: bool) -> Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, Tq, Tk]
    if causal:
        scores = scores.masked_fill(~parts.causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return scores


def reference_tiled(
    q: Tensor, k: Tensor, v: Tensor, block_size: int = 64, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """The expected (out, lse): plain attention and torch.logsumexp of its scores, in float64."""

    def both(q, k, v):
        scores = _scaled_scores(q, k, causal)
        return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)

    out, lse = both(q.double(), k.double(), v.double())
    return out.to(q.dtype), lse.to(q.dtype)


def _tiled_mistake(q, k, v, block_size=64, causal=True, *, rescale=True, offset=True, running_max=True):
    """Tiled attention with a known mistake: the accumulator not rescaled, the causal offset forgotten, or no running
    max at all (exp of the raw scores)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    shift = Tk - Tq if offset else 0
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    l = torch.zeros(*q.shape[:-1], 1, dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for k0 in range(0, Tk, block_size):
        s = q @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            key_pos = k0 + torch.arange(s.shape[-1])
            s = s.masked_fill(key_pos[None, :] > shift + torch.arange(Tq)[:, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True)) if running_max else torch.zeros_like(m)
        r = torch.exp(m - m_new).nan_to_num(0.0, posinf=math.inf) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new).nan_to_num(0.0, posinf=math.inf)  # an overflow stays inf: no max shift gives nan
        l, acc, m = l * r + p.sum(-1, keepdim=True), acc * r + p @ v[:, :, k0 : k0 + block_size], m_new
    return acc / l


def _tiled_log_space(q, k, v, block_size=64, causal=True):
    """A running log-sum-exp instead of m and l, in the input's dtype: each block's terms weighed by exp(s - lse).
    Exact in float32 for moderate scores; in float16 an lse near 1e4 is a multiple of 8, and weights taken from it
    are off by up to e^4."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for k0 in range(0, Tk, block_size):
        s = q @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > Tk - Tq + torch.arange(Tq)[:, None], -math.inf)
        m = s.amax(-1)
        m = torch.where(m.isinf(), torch.zeros_like(m), m)
        new = torch.logaddexp(lse, m + torch.log(torch.exp(s - m[..., None]).sum(-1)))
        rescaled = out * torch.exp(lse - new)[..., None].nan_to_num(0.0)
        out = rescaled + torch.exp(s - new[..., None]) @ v[:, :, k0 : k0 + block_size]
        lse = new
    return out


def overflowing(mistake: Callable) -> Callable:
    """`mistake` (a softmax without the max shift) where its answer overflows, and nothing elsewhere: where exp()
    stays finite that mistake gives the right answer, and must not name a near miss of another kind."""

    @functools.wraps(mistake)
    def where_it_overflows(*args):
        out = mistake(*args)
        if bool(out.isfinite().all()):
            raise ValueError("no overflow on this input")  # known_mistake skips a mistake that cannot run
        return out

    return where_it_overflows


TILED_OUT_MISTAKES: list[Mistake] = [
    (
        overflowing(functools.partial(_tiled_mistake, running_max=False)),
        "keep the running max m and take exp(s - m_new): exp of a raw score overflows float16 above ~11 (float32 "
        "above ~88), and inf / inf is nan",
    ),
    (
        _tiled_log_space,
        "in float16 (bfloat16) a running log-sum-exp near 1e4 is rounded to a multiple of 8 (64), and weights "
        "exp(s - lse) taken from it are off by up to e^4: keep the running max m and the sum l apart and divide by "
        "l at the end (or keep the running state in float32, as FlashAttention's kernels do)",
    ),
    (
        functools.partial(_tiled_mistake, rescale=False),
        "when a block raises the running max from m to m_new, multiply both the running sum l and the accumulator "
        "by exp(m - m_new) before adding the block's terms",
    ),
    (
        functools.partial(_tiled_mistake, offset=False),
        "with Tq < Tk the queries are the LAST Tq positions: query i is at position Tk - Tq + i, and sees keys "
        "0 .. Tk - Tq + i",
    ),
    (
        lambda q, k, v, block_size=64, causal=True: reference_tiled(q, k, v, block_size, not causal)[0],
        "causal=True masks the future (key position > query position), causal=False masks nothing",
    ),
]


def _is_pair(got: Any) -> bool:
    return isinstance(got, tuple) and len(got) == 2


def _not_a_pair(got: Any) -> Verdict:
    """The verdict on a result that is not the (out, lse) pair tiled_attention and merge_attention return."""
    items = f" of {len(got)} items" if isinstance(got, (tuple, list)) else ""
    return f"expected a tuple (out, lse), got {type(got).__name__}{items}", "return out, lse"


def _judge_tiled(case: Case, got: Any) -> Verdict:
    out, lse = case.expected
    if not _is_pair(got):
        return _not_a_pair(got)
    atol, rtol = _tolerance(out.dtype, loose=True)
    problem = tensor_problem(got[0], out, atol=atol, rtol=rtol)
    if problem:
        return f"out: {problem}", diagnose(got[0], case.args, TILED_OUT_MISTAKES, out, atol=atol, rtol=rtol)
    problem = tensor_problem(got[1], lse, atol=atol, rtol=rtol)
    if problem:
        q, k, causal = case.args[0].double(), case.args[1].double(), case.args[4]
        scores = _scaled_scores(q, k, causal)
        if same_answer(got[1], (lse.double() - scores.amax(-1)).to(lse.dtype)):
            hint = "lse = m + log(l): add the running max m back to the log of the running sum l"
        elif same_answer(got[1], torch.logsumexp(scores * math.sqrt(q.shape[-1]), -1).to(lse.dtype)):
            hint = "lse is of the SCALED scores (q·k / √d), the ones the softmax uses"
        else:
            hint = "lse is the log-sum-exp of each query row's scaled, masked scores: m + log(l) at the end"
        return f"lse: {problem}", hint
    return None


def check_tiled_attention(fn, *, seed: int = 0, n_random: int = 10, long: bool = False) -> None:
    """tiled_attention(q, k, v, block_size=64, causal=True) -> (out [B, H, Tq, Dv], lse [B, H, Tq])."""
    g = torch.Generator().manual_seed(seed)
    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were

    def case(
        description: str, q: Tensor, k: Tensor, v: Tensor, block_size: int, causal: bool = True, hint: str = ""
    ) -> Case:
        return Case(
            description, (q, k, v, block_size, causal), later(reference_tiled, q, k, v, block_size, causal), hint
        )

    # keys whose scores grow along the sequence: the running max changes in every block
    q_up = torch.ones(1, 1, 6, 4)
    k_up = torch.arange(12.0).repeat_interleave(4).reshape(1, 1, 12, 4)
    v_up = torch.arange(12.0 * 3).reshape(1, 1, 12, 3).cos() * 5
    cases = [
        case("one block (block_size >= T)", *_qkv(g, 1, 1, 6, 6, 4), 64),
        case("blocks of 4 over 16 positions", *_qkv(g, 1, 2, 16, 16, 8), 4),
        case(
            "scores growing along the keys: the max changes in every block",
            q_up,
            k_up,
            v_up,
            3,
            False,
            "each new block raises the max: rescale l and the accumulator by exp(m_old - m_new)",
        ),
        case("the same, causal", q_up, k_up, v_up, 3),
        case(
            "a block size that does not divide T (13 positions, blocks of 5)",
            *_qkv(g, 1, 1, 13, 13, 8),
            5,
            hint="the last block is shorter: slice k[:, :, k0 : k0 + block_size], do not assume block_size rows",
        ),
        case("causal=False", *_qkv(g, 2, 2, 10, 10, 8), 4, False),
        case("decode: 1 query, 11 keys, causal", *_qkv(g, 1, 2, 1, 11, 8), 4),
        case("5 queries at the end of 12 keys, causal, blocks of 4", *_qkv(g, 1, 1, 5, 12, 8), 4),
        case("block_size=1", *_qkv(g, 1, 1, 5, 5, 4), 1),
        case("float64 in, float64 out", *_qkv(g, 2, 1, 9, 9, 8, dtype=torch.float64), 4),
        case("batch 2, 3 heads, scores far from 0", *_qkv(g, 2, 3, 20, 20, 16, scale=6.0), 8),
        case("values with another last dimension (Dv=3)", *_qkv(g, 1, 1, 7, 7, 4, 3), 3),
        case(
            "float16, scores of about ±1e4 (exact in float16), 6 queries at the end of 11 keys, blocks of 4",
            *_large_qkv(large, 1, 2, 6, 11, torch.float16),
            4,
            hint="the running max keeps every exponent <= 0: exp(s - m_new), never exp(s)",
        ),
        case("bfloat16, scores of about ±1e4, causal=False", *_large_qkv(large, 2, 1, 5, 9, torch.bfloat16), 3, False),
    ]
    for i in range(n_random):
        B, H, D = _randint(g, 1, 2), _randint(g, 1, 3), _choice(g, [4, 8, 16, 64])
        Tk = _randint(g, 1, 130)
        Tq = _choice(g, [Tk, Tk, 1, _randint(g, 1, Tk)])
        block = (
            _choice(g, [1, 3, 16, 32, 64, _randint(g, 2, 70)])
            if Tk < 40
            else _choice(g, [16, 32, 64, _randint(g, 8, 70)])
        )
        dtype = _choice(g, [torch.float32, torch.float64])
        causal = _choice(g, [True, True, False])
        cases.append(
            case(
                f"random #{i}: B={B}, H={H}, Tq={Tq}, Tk={Tk}, D={D}, block_size={block}, "
                f"causal={causal}, {str(dtype)[6:]}",
                *_qkv(g, B, H, Tq, Tk, D, scale=_choice(g, [1.0, 3.0]), dtype=dtype),
                block,
                causal,
            )
        )
    if long:
        cases.append(case("GPT-2's context: 1024 positions, 64 per block", *_qkv(g, 1, 1, 1024, 1024, 64), 64))
    cases.append(
        case(
            "as an engine passes them: non-contiguous q, k, v (split_heads' views)",
            *_engine_qkv(g, 2, 2, 9, 9, 8, cached=False),
            4,
        )
    )
    forbid = [*NO_ATTENTION, Forbidden("llmcourse.engine.tiled_attention", "Write the loop over blocks yourself.")]
    show = _show("tiled_attention", "q", "k", "v", "block_size", "causal")
    run_check(
        "tiled_attention",
        fn,
        cases,
        judge=_judge_tiled,
        forbid=forbid,
        error_hints=ENGINE_ERROR_HINTS,
        seconds=10,
        total_seconds=60,
        show_call=show,
    )
    _check_tiling(fn, forbid, show)


class _ProductWatch:
    """Which rows of q and which rows of k every operation of the learner's function combines, in order.

    An operation counts as a product of queries and keys when one of its inputs is made of rows of q and another
    of rows of k (matmul, einsum, a broadcast multiply: each reaches torch's kernels as one such operation). A
    tensor's vectors (along its last dimension, or the one before: kᵀ's columns) are recognised as rows of q or k
    by their directions, which survive slicing, copying, scaling by 1/√d and casting to float64; zero vectors
    (padding of a last block) are left out. The lookup runs in numpy, without matrix products: torch operations
    here would pass through the watch for black boxes, and BLAS threads would spin on every call."""

    def __init__(self, q: Tensor, k: Tensor):
        self.D = q.shape[-1]
        self.axis = np.random.default_rng(5).standard_normal(self.D)  # rows are looked up by their projection on it
        self.q_rows, self.k_rows = self._table(q.numpy()), self._table(k.numpy())
        self.products: list[tuple[np.ndarray, np.ndarray]] = []  # (ids of q's rows, ids of k's rows), in call order

    def _directions(self, vectors: np.ndarray) -> np.ndarray:
        vectors = vectors.reshape(-1, self.D).astype(np.float64)
        return vectors / np.sqrt((vectors * vectors).sum(-1, keepdims=True))

    def _table(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(directions, their projections sorted, the row ids in that order)."""
        directions = self._directions(rows)
        projections = (directions * self.axis).sum(-1)
        order = np.argsort(projections)
        return directions, projections[order], order

    def _rows(self, t: np.ndarray, table: tuple) -> Optional[np.ndarray]:
        """The ids of the rows of `table` that are t's vectors, or None if they are not all among them."""
        directions, projections, order = table
        for vectors in (
            t if t.shape[-1] == self.D else None,
            t.swapaxes(-1, -2) if t.shape[-2:-1] == (self.D,) else None,
        ):
            if vectors is None:
                continue
            vectors = vectors.reshape(-1, self.D)
            if not np.isfinite(vectors).all():
                continue
            vectors = self._directions(vectors[np.abs(vectors).max(-1) > 0])
            if not len(vectors):
                continue
            at = (vectors * self.axis).sum(-1)
            right = np.searchsorted(projections, at).clip(1, len(projections) - 1)
            nearest = np.where(at - projections[right - 1] < projections[right] - at, right - 1, right)
            ids = order[nearest]
            if bool(((vectors * directions[ids]).sum(-1) > 1 - 1e-9).all()):  # cosines: 1 for the same direction
                return ids
        return None

    def record(self, args: tuple, kwargs: dict) -> None:
        """Record an operation's inputs if they are rows of q and rows of k."""
        inputs = [
            t.detach().numpy()
            for a in (*args, *kwargs.values())
            for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, Tensor)
            and t.dtype in (torch.float32, torch.float64)
            and t.numel() > 0
            and self.D in t.shape[-2:]
        ]
        if len(inputs) < 2:
            return
        for i, t in enumerate(inputs):
            queries = self._rows(t, self.q_rows)
            if queries is None:
                continue
            for other in inputs[:i] + inputs[i + 1 :]:
                keys = self._rows(other, self.k_rows)
                if keys is not None:
                    self.products.append((queries, keys))
                    return


def _rows_text(rows: set) -> str:
    """'12–15' for consecutive rows, else the list."""
    low, high = min(rows), max(rows)
    if len(rows) == high - low + 1:
        return f"{low}" if low == high else f"{low}–{high}"
    return short(sorted(rows), 40)


def _loop_order_problem(
    products: list[tuple[np.ndarray, np.ndarray]], Tq: int, Tk: int, block: int
) -> Optional[tuple[str, str]]:
    """(what is wrong, what the products were) if the products do not follow FlashAttention-2's order, else None.

    Per head (b, h), products are taken in call order: a product of more than `block` queries has all the
    queries' running state in play at every key block; and a query that gets keys it has not met yet after the
    function had moved on to other queries means the key blocks are the outer loop. (Coming back to a query with
    keys it has already met — a second pass over the same blocks — is not a question of order.)"""
    per_head: dict[int, list[tuple[set, set]]] = {}
    for queries, keys in products:
        for head in sorted(set((queries // Tq).tolist())):
            rows = set((queries[queries // Tq == head] % Tq).tolist())
            per_head.setdefault(head, []).append((rows, set((keys[keys // Tk == head] % Tk).tolist())))
    for steps in per_head.values():
        steps = [(rows, keys) for rows, keys in steps if keys]  # this head's queries with this head's keys
        trace = [f"queries {_rows_text(rows)} with keys {_rows_text(keys)}" for rows, keys in steps]
        current: set = set()
        left_for: dict[int, set] = {}  # a query the loop has moved on from -> the queries it moved on to
        met: dict[int, set] = {}
        for n, (rows, keys) in enumerate(steps):
            if len(rows) > block:
                return (
                    f"your function multiplied {len(rows)} queries at once (rows {_rows_text(rows)}) with keys "
                    f"{_rows_text(keys)}: with every query in each product, the key blocks are the only loop, and "
                    "all the queries' running m, l and acc are rewritten at every key block (FlashAttention-1's "
                    "order, its loop over queries folded into one tensor)",
                    f"a product of {len(rows)} queries with keys {_rows_text(keys)}",
                )
            if not rows & current:
                left_for.update((i, rows) for i in current)
                current = set(rows)
            else:
                current |= rows
            back = {i for i in rows if i in left_for and keys - met.get(i, set())}
            if back:
                shown = trace[: min(n, 3)] + (["…"] if n > 3 else []) + [trace[n]]
                return (
                    f"your function multiplied queries {_rows_text(back)} with keys {_rows_text(keys)} after it had "
                    f"moved on to queries {_rows_text(left_for[min(back)])}: the key blocks are the outer loop and "
                    "the query blocks inside (FlashAttention-1's order), so every query's running m, l and acc are "
                    "rewritten once per key block",
                    ", then ".join(shown),
                )
            for i in rows:
                met.setdefault(i, set()).update(keys)
    return None


def _check_tiling(fn: Callable, forbid: Sequence[Forbidden], show: Callable[[tuple], str]) -> None:
    """Tiling is the exercise: at sizes past the small ones (B, H and the head dim no larger than the block), no
    floating-point tensor the function makes may be wider than the block in two dimensions — the whole
    [Tq, Tk] score table, or any piece of it more than block_size queries by more than block_size keys — nor
    hold more numbers than one block of keys against all queries ([B, H, Tq, block_size]) or a copy of k or v
    (which refuses one block of queries against all the keys, and the blocks of scores all made at once).
    Blocks of other shapes within that rule pass that part (fewer queries than a block against a block of
    keys). Then the loop order, FlashAttention-2's: the products of queries and keys (`_ProductWatch`) must take
    at most block_size queries at a time and finish each block of queries before the next (`_loop_order_problem`).
    Every tensor torch makes during the call is seen (a dispatch mode); broadcast (stride-0) dimensions take no
    memory and are not counted; work in numpy is not seen."""
    B, H, Tq, Tk, D, block = 1, 2, 256, 384, 16, 32
    g = torch.Generator().manual_seed(22)
    q, k, v = _qkv(g, B, H, Tq, Tk, D)
    allowed = max(B * H * Tq * max(block, D), B * H * Tk * D)
    largest: list = [0, None]  # numbers held, shape
    too_wide: list = [None]  # the first tensor wider than the block in two dimensions
    products = _ProductWatch(q, k)

    class Shapes(DispatchWatch):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            products.record(args, kwargs or {})
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if not (isinstance(t, Tensor) and t.is_floating_point()):
                    continue
                held = [n for n, stride in zip(t.shape, t.stride()) if n == 1 or stride != 0]  # [n, ...]
                if too_wide[0] is None and sum(n > block for n in held) >= 2:
                    too_wide[0] = tuple(t.shape)
                if math.prod(held) > largest[0]:
                    largest[0], largest[1] = math.prod(held), tuple(t.shape)
            return out

    def watched(q, k, v, block_size, causal):
        with Shapes():
            return fn(q, k, v, block_size, causal)

    args = (q, k, v, block, True)
    got = call_learner("tiled_attention", watched, args, forbid=forbid, seconds=20, show=show)
    expected = reference_tiled(*args)
    verdict = _judge_tiled(Case("", args, expected), got)
    if verdict:
        raise CheckFailed(
            f"✗ tiled_attention — {Tq} queries, {Tk} keys, blocks of {block}: {verdict[0]}\n"
            f"  input:    {show(args)}\n  hint: {verdict[1]}"
        )
    hint = (
        "  hint: loop over the queries in blocks of block_size (q[:, :, q0 : q0 + block_size]) and, inside, over "
        "the keys in blocks (k[:, :, k0 : k0 + block_size]), keeping only that query block's running max m, "
        "running sum l and accumulator: never the whole [Tq, Tk] score matrix, nor one block of queries against "
        "all the keys"
    )
    if too_wide[0] is not None:
        shape = list(too_wide[0])
        what = (
            "the whole [Tq, Tk] score table"
            if Tq in shape and Tk in shape
            else f"a piece of the score table more than {block} wide in two dimensions"
        )
        raise CheckFailed(
            f"✗ tiled_attention — tiling: {Tq} queries at the end of {Tk} keys, block_size={block}: your function "
            f"made a tensor of shape {shape}, {what}; tiled attention never holds scores wider than the block in "
            "both the query and the key dimension\n"
            f"  input:    {show(args)}\n"
            f"  expected: no tensor with more than one dimension over block_size={block}\n"
            f"  got:      a tensor of shape {shape}\n" + hint
        )
    if largest[0] > allowed:
        raise CheckFailed(
            f"✗ tiled_attention — tiling: {Tq} queries at the end of {Tk} keys, block_size={block}: your function "
            f"made a tensor of shape {list(largest[1])} ({largest[0]:,} numbers); tiled attention never holds more "
            f"than one block of keys' scores for all queries, [B, H, Tq, block_size] = {[B, H, Tq, block]} "
            f"({B * H * Tq * block:,} numbers)\n"
            f"  input:    {show(args)}\n"
            f"  expected: no tensor of more than {allowed:,} numbers (one block of scores, or a copy of k or v)\n"
            f"  got:      a tensor of shape {list(largest[1])}\n" + hint
        )
    order = _loop_order_problem(products.products, Tq, Tk, block)
    if order:
        raise CheckFailed(
            f"✗ tiled_attention — loop order: {Tq} queries at the end of {Tk} keys, block_size={block}: {order[0]}\n"
            f"  input:    {show(args)}\n"
            f"  expected: each block of at most {block} queries finished — all its key blocks, its m, l and acc "
            "kept in local variables, its output written once — before the next block of queries starts "
            "(FlashAttention-2's order)\n"
            f"  got:      {order[1]}\n"
            "  hint: for q0 in range(0, Tq, block_size): start m, l and acc for q[:, :, q0 : q0 + block_size]; for "
            "k0 in range(0, Tk, block_size): update them with that key block; then write out[:, :, q0 : q0 + "
            "block_size] and lse once"
        )


# ----------------------------------------------------------------------------------------------
# Merging two partial attentions by their log-sum-exp


def reference_merge(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """The expected (out, lse): the engine's merge, computed in float64 and returned in the inputs' dtype."""
    out, lse = engine_merge_attention(out1.double(), lse1.double(), out2.double(), lse2.double())
    return out.to(out1.dtype), lse.to(lse1.dtype)


def _weighted(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2  # [..., Tq, Dv]


def _exact_lse(lse1: Tensor, lse2: Tensor) -> Tensor:
    return torch.logaddexp(lse1, lse2)


MERGE_NAIVE_EXP = (
    "exp(lse) overflows to inf above ~88.7 in float32 (~11.1 in float16) and inf / inf is nan; far below 0 it "
    "underflows to 0 / 0: take the weights as exp(lse_i - lse), with lse = m + log(exp(lse1 - m) + exp(lse2 - m)) "
    "and m the larger lse"
)
MERGE_OUT_MISTAKES: list[Mistake] = [
    (
        lambda o1, l1, o2, l2: _weighted(
            o1, l1, o2, l2, (l1 - _exact_lse(l1, l2)).exp(), (l2 - _exact_lse(l1, l2)).exp()
        ),
        "a part with no keys has lse = -inf and an out that may be nan (0 / 0): its weight is 0, but 0 × nan is "
        "nan; leave that part out (torch.where(w > 0, w * out, 0))",
    ),
    (
        lambda o1, l1, o2, l2: _weighted(
            o1, l1, o2, l2, l1.exp() / (l1.exp() + l2.exp()), l2.exp() / (l1.exp() + l2.exp())
        ),
        MERGE_NAIVE_EXP,
    ),
    (
        lambda o1, l1, o2, l2: (o1 + o2) / 2,
        "averaging the two outputs 50/50 is right only when both parts hold the same softmax mass: part i weighs "
        "exp(lse_i) / (exp(lse1) + exp(lse2)) = exp(lse_i - lse)",
    ),
    (
        lambda o1, l1, o2, l2: _weighted(
            o1, l1, o2, l2, (l1 - torch.maximum(l1, l2)).exp(), (l2 - torch.maximum(l1, l2)).exp()
        ),
        "normalise: the weights exp(lse_i - m) with m = max(lse1, lse2) do not sum to 1; divide by their sum, i.e. "
        "use exp(lse_i - lse) with lse the merged log-sum-exp",
    ),
    (
        lambda o1, l1, o2, l2: _weighted(
            o1, l1, o2, l2, (l2 - _exact_lse(l1, l2)).exp(), (l1 - _exact_lse(l1, l2)).exp()
        ),
        "the weights are swapped: out1 gets exp(lse1 - lse), out2 gets exp(lse2 - lse)",
    ),
]
MERGE_LSE_MISTAKES: list[Mistake] = [
    (
        lambda o1, l1, o2, l2: torch.log(l1.exp() + l2.exp()),
        "log(exp(lse1) + exp(lse2)) overflows to inf (or gives log(0) = -inf) when exp does: compute it as "
        "m + log(exp(lse1 - m) + exp(lse2 - m)), m the larger lse",
    ),
    (
        lambda o1, l1, o2, l2: torch.maximum(l1, l2),
        "the merged lse is log(exp(lse1) + exp(lse2)) = m + log(1 + exp(-|lse1 - lse2|)), not just the max m: both "
        "parts' sums add",
    ),
    (
        lambda o1, l1, o2, l2: l1 + l2,
        "lse1 + lse2 is the log of the PRODUCT of the two sums; the sums add: lse = log(exp(lse1) + exp(lse2))",
    ),
    (
        lambda o1, l1, o2, l2: _exact_lse(l1, l2) - math.log(2),
        "the lse of the union is log(exp(lse1) + exp(lse2)), not the log of their average",
    ),
]


def _merge_tolerance(case: Case) -> tuple[float, float, float]:
    """(atol of out, atol of lse, rtol) from the stated accuracy: each number rounded to the dtype (eps), and the
    weights exp(lse_i - lse) carrying the rounding of the lse, |lse| · eps, which scales the outputs."""
    out1, lse1, out2, lse2 = case.args
    eps = torch.finfo(out1.dtype).eps
    finite = torch.cat([lse1.flatten(), lse2.flatten()]).double()
    finite = finite[finite.isfinite()]
    values = torch.cat([out1.flatten(), out2.flatten()]).double()
    values = values[values.isfinite()]
    L = float(finite.abs().max()) if finite.numel() else 0.0
    O = float(values.abs().max()) if values.numel() else 1.0
    return eps * (16 + 2 * L) * max(O, 1e-3), eps * (16 + 2 * L), 16 * eps


def _judge_merge(case: Case, got: Any) -> Verdict:
    out, lse = case.expected
    if not _is_pair(got):
        return _not_a_pair(got)
    atol_out, atol_lse, rtol = _merge_tolerance(case)
    problem = tensor_problem(got[0], out, atol=atol_out, rtol=rtol)
    if problem:
        return f"out: {problem}", diagnose(got[0], case.args, MERGE_OUT_MISTAKES, out, atol=atol_out, rtol=rtol)
    problem = tensor_problem(got[1], lse, atol=atol_lse, rtol=rtol)
    if problem:
        return f"lse: {problem}", diagnose(got[1], case.args, MERGE_LSE_MISTAKES, lse, atol=atol_lse, rtol=rtol)
    return None


def _partial_attentions(
    g: torch.Generator, batch: Sequence[int], Tq: int, n1: int, n2: int, D: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention of the same queries over n1 keys and over n2 other keys: (out1, lse1, out2, lse2), as attention
    gives them (computed in float64, rounded to `dtype`)."""
    q = torch.randn(*batch, Tq, D, generator=g, dtype=torch.float64)
    k = torch.randn(*batch, n1 + n2, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(*batch, n1 + n2, D, generator=g, dtype=torch.float64) * 3 + 1
    parts_ = []
    for keys in (slice(0, n1), slice(n1, n1 + n2)):
        scores = q @ k[..., keys, :].transpose(-2, -1) / math.sqrt(D)  # [..., Tq, n]
        parts_ += [torch.softmax(scores, dim=-1) @ v[..., keys, :], torch.logsumexp(scores, dim=-1)]
    return tuple(t.to(dtype) for t in parts_)


def _given_lse(
    g: torch.Generator, batch: Sequence[int], Tq: int, Dv: int, lse1: float, lse2: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Outputs of two parts (averages of values, here random) with log-sum-exps about lse1 and lse2."""
    out1, out2 = (torch.randn(*batch, Tq, Dv, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    jitter = [torch.rand(*batch, Tq, generator=g, dtype=torch.float64) for _ in range(2)]
    return out1.to(dtype), (lse1 + jitter[0]).to(dtype), out2.to(dtype), (lse2 + jitter[1]).to(dtype)


def _without_keys(out: Tensor, lse: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The part as attention over no keys gives it for the rows `rows` [..., Tq] (bool): lse -inf, out 0 / 0 = nan."""
    return out.masked_fill(rows.unsqueeze(-1), math.nan), lse.masked_fill(rows, -math.inf)


OWN_MERGE = "Write the merge yourself: the weights exp(lse_i - lse) from the two log-sum-exps."
NO_MERGE = [
    Forbidden("llmcourse.engine.tiled_attention.merge_attention", OWN_MERGE),
    Forbidden("llmcourse.engine.tiled_attention.tiled_attention", OWN_MERGE),
]


def check_merge_attention(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """merge_attention(out1, lse1, out2, lse2) -> (out, lse): two attentions of the same queries over disjoint
    keys (out [..., Tq, Dv], lse [..., Tq]) combined into the attention over both; then LLMEngine with it."""
    g = torch.Generator().manual_seed(seed)
    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were

    def case(description: str, args: tuple, hint: str = "") -> Case:
        return Case(description, args, later(reference_merge, *args), hint)

    stable = "compute the weights from the larger lse: exp(lse_i - lse), every exponent <= 0"
    out1, lse1, out2, lse2 = _given_lse(g, (2,), 4, 3, 250.0, 50.0, torch.float32)
    empty2 = _without_keys(out2, lse2, torch.ones_like(lse2, dtype=torch.bool))
    mixed = torch.rand(2, 3, 6, generator=g) < 0.5  # [B, H, Tq]: which rows of part 1 saw no keys
    m1, l1, m2, l2 = _partial_attentions(g, (2, 3), 6, 4, 5, 8, torch.float32)
    m1, l1 = _without_keys(m1, l1, mixed)
    wide = _partial_attentions(g, (2, 3), 5, 6, 7, 8, torch.float32)
    cases = [
        case(
            "one query row over 3 + 5 keys: out [1, 4], lse [1]", _partial_attentions(g, (), 1, 3, 5, 4, torch.float32)
        ),
        case(
            "batch 2, 3 heads, 5 queries over 7 + 9 keys: [B, H, Tq, Dv]",
            _partial_attentions(g, (2, 3), 5, 7, 9, 8, torch.float32),
        ),
        case("no batch dimensions: out [8, 16], lse [8]", _partial_attentions(g, (), 8, 2, 30, 16, torch.float32)),
        case("five dimensions: out [2, 2, 2, 3, 4]", _partial_attentions(g, (2, 2, 2), 3, 4, 4, 4, torch.float32)),
        case("float64 in, float64 out", _partial_attentions(g, (2, 2), 4, 5, 6, 8, torch.float64)),
        case("float16 in, float16 out", _partial_attentions(g, (2, 2), 4, 5, 6, 8, torch.float16)),
        case("bfloat16 in, bfloat16 out", _partial_attentions(g, (2, 2), 4, 5, 6, 8, torch.bfloat16)),
        case("lse1 - lse2 = 200 (exp(lse1) overflows float32)", (out1, lse1, out2, lse2), stable),
        case("lse2 - lse1 = 200, the other way round", (out2, lse2, out1, lse1), stable),
        case(
            "both lse about 1000 (exp overflows even in float64)",
            _given_lse(g, (3,), 5, 4, 1000.0, 999.0, torch.float64),
            stable,
        ),
        case(
            "both lse about -1000 (exp underflows to 0 / 0)",
            _given_lse(g, (3,), 5, 4, -1000.0, -1001.5, torch.float64),
            stable,
        ),
        case(
            "float16, both lse about 1e4 (exp(lse) overflows float16 above ~11)",
            _given_lse(large, (2,), 3, 4, 9984.0, 9976.0, torch.float16),
            stable,
        ),
        case(
            "bfloat16, both lse about -1e4 (exp underflows to 0 / 0)",
            _given_lse(large, (2,), 3, 4, -9984.0, -9920.0, torch.bfloat16),
            stable,
        ),
        case(
            "part 2 saw no keys: lse2 = -inf, out2 nan (0 / 0)",
            (out1, lse1, *empty2),
            "a part with no keys weighs exp(-inf) = 0: the result is the other part (lse = -inf is allowed)",
        ),
        case(
            "some rows of part 1 saw no keys",
            (m1, l1, m2, l2),
            "where lse1 = -inf, part 1 weighs nothing: out = out2, lse = lse2 for that row",
        ),
        case(
            "non-contiguous: out1 a transposed view, out2, lse1 and lse2 strided slices",
            (
                wide[0].mT.contiguous().mT,
                torch.stack([wide[1], wide[1]], -1)[..., 0],
                torch.stack([wide[2], wide[2]], -1)[..., 1],
                wide[3].unsqueeze(-1).expand(2, 3, 5, 2)[..., 1],
            ),
        ),
    ]
    G, H, D = 3, 4, 8  # as the engine calls it: the rows of a decode step, out [G, H, D], lse [G, H]
    parts_out = torch.randn(G, 2, H, D, generator=g) * 2  # [G, P, H, D]: two partitions
    parts_lse = torch.randn(G, 2, H, generator=g) * 3 + 5  # [G, P, H]
    rows = torch.tensor([0, 2])
    cases.append(
        case(
            "as LLMEngine calls it: partitions of decode rows, out [G, H, D], lse [G, H] (heads in the Tq place)",
            (parts_out[:, 0][rows], parts_lse[:, 0][rows], parts_out[rows, 1], parts_lse[rows, 1]),
        )
    )
    for i in range(n_random):
        batch = tuple(_randint(g, 1, 3) for _ in range(_randint(g, 0, 3)))
        Tq, Dv = _choice(g, [1, _randint(g, 1, 9)]), _choice(g, [1, 4, 16, _randint(g, 1, 40)])
        dtype = _choice(g, [torch.float32, torch.float64, torch.float32, torch.float64, torch.float16, torch.bfloat16])
        half = dtype in HALF_DTYPES
        gap = _choice(g, [0.0, 1.0, 5.0, 30.0] if half else [0.0, 1.0, 5.0, 30.0, 200.0])
        offset = _choice(g, [0.0, 3.0, -3.0] if half else [0.0, 50.0, -50.0, 500.0, -500.0])
        first, second = offset + gap, offset
        if _randint(g, 0, 1):
            first, second = second, first
        args = _given_lse(g, batch, Tq, Dv, first, second, dtype)
        what = f"lse about {first:g} and {second:g}"
        if i % 5 == 4 and not half:
            rows = torch.rand(*batch, Tq, generator=g) < 0.3
            args = (*_without_keys(args[0], args[1], rows), *args[2:])
            what += ", some rows of part 1 without keys"
        shape = [*batch, Tq, Dv]
        cases.append(case(f"random #{i}: out {shape}, {str(dtype)[6:]}, {what}", args))
    show = _show("merge_attention", "out1", "lse1", "out2", "lse2")
    run_check(
        "merge_attention",
        fn,
        cases,
        judge=_judge_merge,
        forbid=NO_MERGE,
        error_hints=ENGINE_ERROR_HINTS,
        seconds=5,
        total_seconds=30,
        show_call=show,
    )
    _merge_in_engine(fn)


MERGE_PROMPTS = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
)


def _merge_in_engine(fn: Callable) -> None:
    """LLMEngine on the bundled GPT-2 with the learner's merge_attention, contexts split into partitions of 8
    positions (each decode step merges several per layer); greedy, its tokens must be generate's."""
    model, tokenizer = bundled_model(), get_tokenizer()
    prompts = [tokenizer.encode(p) for p in MERGE_PROMPTS]
    settings = dict(block_size=4, partition_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    what = f"LLMEngine(bundled GPT-2, {', '.join(f'{k}={v}' for k, v in settings.items())}), 3 prompts, greedy"

    def run():
        engine = LLMEngine(model, **settings, batching=guarded(Batching, merge_attention=fn))
        try:
            return engine.generate(prompts, max_new_tokens=12)
        except PartError as err:
            return err

    got = call_learner(
        "merge_attention",
        run,
        (),
        forbid=NO_MERGE,
        seconds=60,
        show=lambda args: f"{what}, with your merge_attention",
    )
    if isinstance(got, Exception):
        text = str(got).split("\n  hint:")[0]
        raise CheckFailed(f"✗ merge_attention in the engine — {what}, with your merge_attention in it: {text}")
    with torch.inference_mode():
        expected = [generate(model, p, max_new_tokens=12) for p in prompts]
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        if mine != theirs:
            raise CheckFailed(
                f"✗ merge_attention in the engine — {what}: request {i} got different tokens than generate\n"
                f"  expected: {theirs}\n  got:      {mine}\n"
                "  hint: LLMEngine calls merge_attention(out1, lse1, out2, lse2) with out [G, H, D] and lse [G, H] "
                "(one decode row per sequence, heads in the Tq place), the partitions of a context left to right"
            )
