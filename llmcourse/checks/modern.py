"""Checks for chapter 11, a modern model: RMSNorm, SwiGLU, `repeat_kv` (the warm-up: grouped-query attention by
copying), `grouped_attention` (each KV head read once), Qwen3's QK-norm, `rope_frequencies` (RoPE's speeds with
rope_theta and "linear" / "llama3" scaling), the Llama decoder block, and loading a Llama-family checkpoint.

Each check compares the learner's function with the engine's (`llmcourse.engine.parts`, `llmcourse.engine.llama`)
and, where it can, with transformers' (LlamaRMSNorm, repeat_kv, ROPE_INIT_FUNCTIONS, LlamaDecoderLayer /
Qwen3DecoderLayer, save_pretrained folders of LlamaForCausalLM, Qwen2 and Qwen3 models, built at check time in a
temporary folder: nothing is downloaded), on fixed edge cases and seeded random inputs drawn from what the engine
passes: float32, float16, bfloat16 and float64; non-contiguous views (split_heads' transposed heads, a cache's filled
part); one position; values near float16's limits; non-default eps; one KV head and as many KV heads as query heads;
masks None, padding and per head. When an answer is wrong the message says what was probably done wrong, found by
comparing it with known mistakes computed on the same input (LayerNorm's mean, eps outside the root, a tiled repeat,
query heads grouped h % H_kv, an untiled causal mask, llama3's bands swapped, post-norm, a kept `model.` prefix,
...); grouped_attention's `attention` argument records what it receives, so that k and v copied (repeat_kv's way)
are named too. Each check ends in the engine: a tiny Llama (or Qwen3) whose slot holds the learner's function must
give the engine's logits or tokens.

    >>> import torch
    >>> def swiglu(gate, up):
    ...     return gate * torch.sigmoid(gate) * up
    >>> check_swiglu(swiglu)                                           # doctest: +ELLIPSIS
    ✓ swiglu — ... cases

The engine's own functions are the black boxes: passing `llmcourse.engine.parts.swiglu` itself fails.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guarded
from llmcourse.engine import parts as P
from llmcourse.engine.checkpoints import load_llama_checkpoint
from llmcourse.engine.generate import generate
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.parts import Parts
from llmcourse.engine.slots import raised

from .gpt2 import (
    HALF,
    VIEW_HINTS,
    _desc,
    _floor,
    _randn,
    _transposed,
    _u,
    _wide,
    accuracy_judge,
    add_stray_file,
    stray_files_hint,
    tensors_and_config_problem,
)
from .harness.core import Case, Verdict, also_reference, later, run_check, unwritten_helper
from .harness.forbid import _ATTENTION as FUSED_ATTENTION
from .harness.forbid import DispatchWatch, Forbidden
from .harness.show import short
from .harness.tensors import known_mistake, plain_tensor_problem, same_answer, tensor_problem

f64, f16, bf16, f32 = torch.float64, torch.float16, torch.bfloat16, torch.float32
U32 = 2.0**-24  # float32's unit of rounding: RMSNorm is computed in float32 at least

# ----------------------------------------------------------------------------------------------
# Black boxes

_OWN = "Write it yourself with tensor operations (*, +, mean, rsqrt, sigmoid, ...)."


def _engine(name: str) -> Forbidden:
    return Forbidden(
        f"llmcourse.engine.parts.{name}",
        f"The engine's {name} is what yours is compared with: write your own (or call your own `{name}`).",
    )


NO_RMS_NORM = [
    Forbidden(
        "torch.nn.functional.rms_norm", f"F.rms_norm (and nn.RMSNorm) is the black box this exercise opens. {_OWN}"
    ),
    Forbidden("torch.nn.functional.layer_norm", f"A normalization layer of torch's is a black box here. {_OWN}"),
    Forbidden("torch.nn.functional.normalize", f"F.normalize divides by the L2 norm for you: a black box here. {_OWN}"),
    Forbidden("torch.linalg.vector_norm", f"torch's norms are a black box here: square, average, root. {_OWN}"),
    Forbidden("torch.norm", f"torch's norms are a black box here: square, average, root. {_OWN}"),
]
NO_SILU = [
    Forbidden(
        "torch.nn.functional.silu",
        "F.silu (and nn.SiLU) is the black box this exercise opens: silu(g) = g · sigmoid(g), with torch.sigmoid.",
    ),
]
NO_TRANSFORMERS = [
    Forbidden("transformers", "transformers' Llama is what your code is compared with: build it from your own parts.")
]


# ----------------------------------------------------------------------------------------------
# RMSNorm


def _rms(x: Tensor, eps: float) -> Tensor:
    """x / √(mean(x²) + eps) over the last dim (in x's dtype)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rms_layer_norm(x, weight, eps):
    x32 = x.float()
    return weight * (
        (x32 - x32.mean(-1, keepdim=True)) * torch.rsqrt(x32.var(-1, keepdim=True, unbiased=False) + eps)
    ).to(x.dtype)


def _rms_eps_outside(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def _rms_no_eps(x, weight, eps):
    return P.rms_norm(x, weight, 0.0)


def _rms_in_dtype(x, weight, eps):
    return weight * _rms(x, eps)


def _rms_weight_before_cast(x, weight, eps):
    return (_rms(x.float(), eps) * weight.float()).to(x.dtype)


def _rms_no_weight(x, weight, eps):
    return P.rms_norm(x, torch.ones_like(weight), eps)


def _rms_one_plus_weight(x, weight, eps):
    return P.rms_norm(x, 1 + weight, eps)


def _rms_l2(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_std(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.var(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_dim1(x, weight, eps):
    if x.dim() < 3:
        raise ValueError
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + eps)).to(x.dtype)


RMS_NORM_MISTAKES = [
    (
        _rms_layer_norm,
        "that is LayerNorm: RMSNorm subtracts no mean (and has no bias): x / √(mean(x²) + eps) · weight",
    ),
    (_rms_eps_outside, "eps goes inside the square root: x / √(mean(x²) + eps), not x / (√mean(x²) + eps)"),
    (
        _rms_no_eps,
        "add the eps you are given to mean(x²) before the root: it matters when the values are tiny or eps is large",
    ),
    (
        _rms_one_plus_weight,
        "Llama multiplies by weight itself (Gemma's RMSNorm is the one that multiplies by 1 + weight)",
    ),
    (_rms_no_weight, "after normalizing, multiply by weight (one learned scale per feature)"),
    (
        _rms_l2,
        "the root *mean* square: average the squares over the C features (mean, or sum / C), not their sum",
    ),
    (
        _rms_std,
        "mean(x²), not the variance: RMSNorm's denominator is the root mean square of x itself, no mean subtracted",
    ),
    (
        _rms_dim1,
        "normalize over the last dimension (the C features of each position), dim=-1, whatever the number of "
        "leading dimensions",
    ),
    (
        _rms_in_dtype,
        "this is rms_norm computed in x's dtype, without the float32 cast: in float16, x² overflows past 256 (65504 "
        "is its largest number) and underflows below 1e-4, and in either half format mean(x²) loses digits; "
        "square in float32: x.float() first, then cast the normalized x back to x's dtype and multiply by weight",
    ),
    (
        _rms_weight_before_cast,
        "cast the normalized x back to x's dtype first, then multiply by weight: weight * normed.to(x.dtype), the "
        "order transformers' LlamaRMSNorm (and the engine) use. Multiplying in float32 and casting once rounds "
        "differently, at about a quarter of the positions in float16 and bfloat16",
    ),
]

# Contract: the exact value (float64) within u·(8 + 2√C)·|normed|·|weight| of the float32 work, plus 2 units of
# rounding of x's dtype times |answer| (the cast of the normalized x, then the product with weight). In float16 and
# bfloat16 the answer must also round as the engine's does: equal to it at all but 1 % of the positions.
RMS_NORM_CONTRACT = (
    "rms_norm may be off by (8 + 2·√C) units of float32 rounding times |answer| (it is computed in float32), plus 2 "
    "units of rounding of x's dtype; in float16 and bfloat16 it must equal the engine's at 99 % of the positions"
)
HALF_ORDER_SHARE = 0.01  # the share of positions where a half-precision answer may round otherwise than the engine's


def rms_norm_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x, weight, eps = args
    X, W = _wide(x), _wide(weight)
    normed = _rms(X, eps)
    exact = normed * W
    u = max(_u(x), U32) if x.dtype == f64 else U32
    allowed = u * (8 + 2 * math.sqrt(x.shape[-1])) * exact.abs() + 2 * _u(x) * exact.abs() * (x.dtype != f64)
    return exact, allowed + _floor(x)


def half_rounding(reference: Callable, mistakes: Sequence[tuple[Callable, str]], contract: str) -> Callable:
    """A judge for half-precision answers that are within the accuracy contract: they must also equal the engine's
    (`reference(*args)`) at all but HALF_ORDER_SHARE of the positions (same operations, same order of rounding)."""

    def judge(case: Case, got: Tensor) -> Verdict:
        engine = reference(*case.args)
        wrong = got.detach() != engine
        share = wrong.float().mean().item() if wrong.numel() else 0.0
        if share <= HALF_ORDER_SHARE:
            return None
        index = [int(i) for i in torch.nonzero(wrong)[0]]
        at = tuple(index)
        problem = (
            f"rounded otherwise than the engine at {int(wrong.sum())} of {wrong.numel()} positions "
            f"({share:.0%}; at most {HALF_ORDER_SHARE:.0%} may), first at index {index}: expected "
            f"{engine[at].item():.6g}, got {got[at].item():.6g}"
        )
        hint = known_mistake(got, case.args, mistakes, lambda candidate: not torch.equal(candidate, engine))
        return problem, hint or f"in float16 and bfloat16 the order of operations matters: {contract}"

    return judge


def _with_half_order(judge: Callable, reference: Callable, mistakes, contract: str) -> Callable:
    order = half_rounding(reference, mistakes, contract)

    def both(case: Case, got: Any) -> Verdict:
        verdict = judge(case, got)
        if verdict is not None or case.expected.dtype not in HALF:
            return verdict
        return order(case, got)

    return both


def _show_rms_norm(args: tuple) -> str:
    x, weight, eps = args
    return f"rms_norm(x={_desc(x)}, weight={_desc(weight)}, eps={eps:g})"


def _rms_case(description: str, x: Tensor, weight: Tensor, eps: float, hint: str = "") -> Case:
    return Case(description, (x, weight, eps), later(P.rms_norm, x, weight, eps), hint)


def _hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm with this weight."""
    # transformers is heavy (seconds to import): only for the hidden comparison
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(weight.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def rms_norm_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    shared, weight16 = _randn(g, 4, 16) * 0.1, 1 + 0.3 * _randn(g, 16)
    cases = [
        _rms_case(
            "one row [3, -4], weight 1, eps 0",
            torch.tensor([[3.0, -4.0]]),
            torch.ones(2),
            0.0,
            "mean(x²) = (9 + 16) / 2 = 12.5: the answer is x / √12.5",
        ),
        _rms_case(
            "a row whose mean is not 0 ([1, 2, 3, 4])",
            torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
            torch.ones(4),
            1e-6,
            "RMSNorm divides by √(mean(x²) + eps) = √7.5: no mean is subtracted",
        ),
        _rms_case("weight", _randn(g, 3, 8) + 1, 0.5 + _randn(g, 8).abs(), 1e-6),
        _rms_case(
            "a batch of 2 sequences of 3 positions",
            _randn(g, 2, 3, 16) * 3 + 1,
            1 + 0.3 * _randn(g, 16),
            1e-5,
            "each position (each row of C features) is normalized on its own",
        ),
        _rms_case("a large eps (1.0)", shared, weight16, 1.0, "eps is added to mean(x²)"),
        _rms_case("the same x and weight, eps 1e-2 (one argument changed)", shared, weight16, 1e-2),
        _rms_case(
            "tiny values (1e-4): mean(x²) ≈ 1e-8, below eps = 1e-6",
            _randn(g, 2, 24) * 1e-4,
            1 + 0.3 * _randn(g, 24),
            1e-6,
        ),
        _rms_case("float64 [2, 3, 32]", _randn(g, 2, 3, 32, dtype=f64) * 2, 1 + _randn(g, 32, dtype=f64), 1e-6),
        _rms_case("a 1-D x [6] (one position)", _randn(g, 6) * 2, 1 + 0.3 * _randn(g, 6), 1e-5),
        _rms_case("a 4-D x [2, 2, 3, 8] (heads)", _randn(g, 2, 2, 3, 8), 1 + 0.3 * _randn(g, 8), 1e-6),
        _rms_case(
            "x a non-contiguous view [2, 5, 16] (a transposed tensor)",
            _transposed(g, 2, 5, 16) * 2,
            1 + 0.3 * _randn(g, 16),
            1e-6,
            "x may be a view whose rows are not contiguous: .view() fails on it, reshape or reductions over dim=-1 "
            "work",
        ),
        _rms_case(
            "x[:, -1:], the view the engine's last_only gives the final norm",
            _randn(g, 3, 7, 24)[:, -1:] * 3,
            1 + 0.3 * _randn(g, 24),
            1e-5,
        ),
        _rms_case("a constant row of zeros", torch.zeros(2, 6), 1 + 0.3 * _randn(g, 6), 1e-6, "0 / √eps = 0: no NaN"),
        _rms_case("C = 2048 (Llama-3.2-1B's width)", _randn(g, 1, 2, 2048) * 0.5, 1 + 0.3 * _randn(g, 2048), 1e-5),
        _rms_case(
            "float16, large values (±1000: x² = 1e6 is past float16's largest number, 65504)",
            (_randn(g, 2, 32) * 1000).half(),
            (1 + 0.3 * _randn(g, 32)).half(),
            1e-6,
        ),
        _rms_case(
            "float16, tiny values (±3e-3: x² ≈ 1e-5 keeps few digits in float16), eps 1e-8",
            (_randn(g, 2, 32) * 3e-3).half(),
            (1 + 0.3 * _randn(g, 32)).half(),
            1e-8,
        ),
        _rms_case(
            "float16 [2, 5, 64], as a float16 model runs it",
            (_randn(g, 2, 5, 64) * 3).half(),
            (1 + 0.3 * _randn(g, 64)).half(),
            1e-6,
            "float16 in, float16 out",
        ),
        _rms_case(
            "bfloat16 [3, 4, 48], eps 1e-5",
            (_randn(g, 3, 4, 48) * 2).bfloat16(),
            (1 + 0.3 * _randn(g, 48)).bfloat16(),
            1e-5,
            "bfloat16 in, bfloat16 out",
        ),
        _rms_case(
            "bfloat16, values around 1e4 (the residual stream of a deep model)",
            (1e4 + _randn(g, 2, 3, 40) * 3e3).bfloat16(),
            (1 + 0.3 * _randn(g, 40)).bfloat16(),
            1e-5,
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (f32, f64, f16, bf16, f32, f16)[i % 6]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))] + [rng.choice([2, 3, 8, 17, 64, 576])]
        scale = rng.choice([1e-2, 1, 30] if dtype == f16 else [1e-3, 1, 100])
        eps = rng.choice([1e-5, 1e-6, 1e-8, 0.1])
        x = _randn(g, *shape, dtype=f64) * scale
        if rng.random() < 0.3 and len(shape) > 1:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        C = shape[-1]
        cases.append(
            _rms_case(
                f"random #{i}: {str(dtype)[6:]} {shape}, values ± {scale:g}, eps {eps:g}",
                x.to(dtype),
                (1 + 0.3 * _randn(g, C, dtype=f64)).to(dtype),
                eps,
            )
        )
    return cases


def _hf_rms_norm_of(case: Case) -> tuple[str, Tensor]:
    return "transformers' LlamaRMSNorm", _hf_rms_norm(*case.args)


def check_rms_norm(fn, *, seed: int = 0, n_random: int = 10, transformers: bool = False) -> None:
    """rms_norm(x, weight, eps) = x / √(mean(x²) + eps) · weight over the last dim, computed in float32, cast back
    to x's dtype, then times weight (transformers' LlamaRMSNorm). Any shape [..., C], float32, float64, float16 or
    bfloat16, contiguous or not; the last cases run it inside a tiny Llama."""
    cases = rms_norm_cases(seed, n_random) + engine_cases("rms_norm", seed)
    base = accuracy_judge(rms_norm_accuracy, RMS_NORM_CONTRACT, RMS_NORM_MISTAKES)
    judge = _with_half_order(base, P.rms_norm, RMS_NORM_MISTAKES, RMS_NORM_CONTRACT)
    if transformers:
        judge = also_reference(
            judge,
            _hf_rms_norm_of,
            rms_norm_accuracy,
            slack=2,  # transformers rounds in its own order: within twice the contract (equal in half precision)
            hint="normalize in float32, cast back to x's dtype, then multiply by weight",
        )
    run, judge = with_llama_runs(fn, judge)
    run_check(
        "rms_norm",
        run,
        cases,
        judge=judge,
        error_hints=VIEW_HINTS,
        forbid=[*NO_RMS_NORM, _engine("rms_norm"), *NO_TRANSFORMERS],
        show_call=lambda args: args[0].show() if isinstance(args[0], LlamaRun) else _show_rms_norm(args),
        seconds=10,
        total_seconds=60,
    )


# ----------------------------------------------------------------------------------------------
# SwiGLU


def _swiglu_swapped(gate, up):
    return P.swiglu(up, gate)


def _swiglu_sigmoid(gate, up):
    return torch.sigmoid(gate) * up


def _swiglu_gelu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _swiglu_gelu_erf(gate, up):
    return F.gelu(gate) * up


def _swiglu_relu(gate, up):
    return torch.relu(gate) * up


def _swiglu_silu_of_product(gate, up):
    return F.silu(gate * up)


def _swiglu_sum(gate, up):
    return F.silu(gate) + up


def _swiglu_no_gate(gate, up):
    return F.silu(up)


SWIGLU_MISTAKES = [
    (
        _swiglu_swapped,
        "silu goes on the gate: silu(gate) · up (gate_proj's output is the one that passes through silu, up_proj's "
        "multiplies it)",
    ),
    (
        _swiglu_sigmoid,
        "silu(g) is g · sigmoid(g), not sigmoid(g) alone (that would be the original GLU): gate * sigmoid(gate) * up",
    ),
    (_swiglu_gelu, "that is GeGLU (GELU on the gate): SwiGLU's activation is silu(g) = g · sigmoid(g)"),
    (_swiglu_gelu_erf, "that is GeGLU (GELU on the gate): SwiGLU's activation is silu(g) = g · sigmoid(g)"),
    (_swiglu_relu, "that is ReGLU (ReLU on the gate): SwiGLU's activation is silu(g) = g · sigmoid(g)"),
    (_swiglu_silu_of_product, "multiply after the activation: silu(gate) · up, not silu(gate · up)"),
    (_swiglu_sum, "the gate *multiplies* up: silu(gate) · up, not a sum"),
    (_swiglu_no_gate, "both inputs are used: silu(gate) · up"),
]

# Contract: 8 units of rounding of the dtype times (|gate · sigmoid(gate)| · |up| + |answer|): silu and the product
# each round a few times, at most by one unit of a value of that size each.
SWIGLU_CONTRACT = "swiglu may be off by 8 units of rounding of the dtype times |silu(gate)|·|up| + |answer|"


def swiglu_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    gate, up = args
    G, Up = _wide(gate), _wide(up)
    silu = G * torch.sigmoid(G)
    exact = silu * Up
    return exact, 8 * _u(gate) * (silu.abs() * Up.abs() + exact.abs()) + _floor(gate)


def swiglu_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)

    def case(description, gate, up, hint=""):
        return Case(description, (gate, up), later(P.swiglu, gate, up), hint)

    cases = [
        case(
            "a few values, up = 1",
            torch.tensor([-4.0, -1.0, 0.0, 1.0, 4.0]),
            torch.ones(5),
            "silu(g) = g · sigmoid(g): silu(-1) ≈ -0.269, silu(1) ≈ 0.731",
        ),
        case("gate and up of different sizes", torch.tensor([[2.0, -2.0, 0.5]]), torch.tensor([[3.0, 0.5, -4.0]])),
        case("[2, 5, 24]", _randn(g, 2, 5, 24) * 2, _randn(g, 2, 5, 24)),
        case(
            "float64 [3, 16]", _randn(g, 3, 16, dtype=f64) * 3, _randn(g, 3, 16, dtype=f64), "float64 in, float64 out"
        ),
        case(
            "large values ±1000 (float32)",
            torch.tensor([-1000.0, -100.0, 100.0, 1000.0]),
            torch.tensor([1.0, -2.0, 0.5, 3.0]),
            "silu(1000) = 1000 and silu(-1000) = -0: a sigmoid written as exp(g) / (1 + exp(g)) gives inf / inf there; "
            "torch.sigmoid (or 1 / (1 + exp(-g))) does not",
        ),
        case("one position [1, 1, 8]", _randn(g, 1, 1, 8), _randn(g, 1, 1, 8)),
        case(
            "gate and up non-contiguous views [2, 4, 12] (transposed tensors)",
            _transposed(g, 2, 4, 12) * 2,
            _transposed(g, 2, 4, 12),
            "elementwise operations work on views of any layout",
        ),
        case(
            "float16 [2, 3, 64], as a float16 model runs it",
            (_randn(g, 2, 3, 64) * 3).half(),
            _randn(g, 2, 3, 64).half(),
            "float16 in, float16 out",
        ),
        case(
            "bfloat16 [2, 3, 1536] (an MLP's hidden width)",
            (_randn(g, 2, 3, 1536) * 3).bfloat16(),
            _randn(g, 2, 3, 1536).bfloat16(),
            "bfloat16 in, bfloat16 out",
        ),
        case(
            "float16, gate ±20 (exp(20) overflows float16)",
            torch.tensor([-20.0, -12.0, 12.0, 20.0], dtype=f16),
            torch.tensor([2.0, 1.0, -1.0, 0.5], dtype=f16),
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (f32, f64, f16, bf16, f32, f64)[i % 6]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))] + [rng.choice([1, 4, 32, 100])]
        scale = rng.choice([0.1, 1, 8])
        gate, up = _randn(g, *shape, dtype=dtype) * scale, _randn(g, *shape, dtype=dtype)
        if rng.random() < 0.3 and len(shape) > 1:
            gate = gate.transpose(0, -1).contiguous().transpose(0, -1)
        cases.append(case(f"random #{i}: {str(dtype)[6:]} {shape}, gate ± {scale:g}", gate, up))
    return cases


def check_swiglu(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """swiglu(gate, up) = silu(gate) · up, silu(g) = g · sigmoid(g), elementwise; same shape and dtype as gate
    (float32, float64, float16, bfloat16; any layout). F.silu is the black box. The last cases run it inside a tiny
    Llama."""
    cases = swiglu_cases(seed, n_random) + engine_cases("swiglu", seed)
    run, judge = with_llama_runs(fn, accuracy_judge(swiglu_accuracy, SWIGLU_CONTRACT, SWIGLU_MISTAKES))

    def show(args):
        if isinstance(args[0], LlamaRun):
            return args[0].show()
        return f"swiglu(gate={short(args[0], 80)}, up={short(args[1], 80)})"

    run_check(
        "swiglu",
        run,
        cases,
        judge=judge,
        forbid=[*NO_SILU, _engine("swiglu"), *NO_TRANSFORMERS],
        error_hints=VIEW_HINTS,
        show_call=show,
        seconds=10,
        total_seconds=60,
    )


# ----------------------------------------------------------------------------------------------
# repeat_kv: grouped-query attention's sharing


def _repeat_tiled(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)


def _repeat_along_t(x, n_rep):
    return x.repeat_interleave(n_rep, dim=2)


def _repeat_along_d(x, n_rep):
    return x.repeat_interleave(n_rep, dim=-1)


def _repeat_batch(x, n_rep):
    return x.repeat_interleave(n_rep, dim=0)


REPEAT_KV_MISTAKES = [
    (
        _repeat_tiled,  # torch.cat([x] * n_rep, dim=1) and x[:, None].expand(B, n_rep, H_kv, T, D) give the same
        "these are the KV heads tiled, 0, 1, 0, 1 for n_rep 2 — the order x.repeat(1, n_rep, 1, 1), "
        "torch.cat([x] * n_rep, dim=1) and a new axis before the heads, x[:, None].expand(B, n_rep, H_kv, T, D), "
        "give. Repeat each KV head in place, 0, 0, 1, 1 (query head h reads KV head h // n_rep): "
        "x.repeat_interleave(n_rep, dim=1), or a new axis after the heads, x[:, :, None].expand(B, H_kv, n_rep, T, D), "
        "then reshape",
    ),
    (_repeat_along_t, "repeat the heads (dim 1), not the positions (dim 2): [B, H_kv, T, D] -> [B, H_kv·n_rep, T, D]"),
    (_repeat_along_d, "repeat the heads (dim 1), not the head's features: [B, H_kv, T, D] -> [B, H_kv·n_rep, T, D]"),
    (_repeat_batch, "repeat the heads (dim 1), not the batch: [B, H_kv, T, D] -> [B, H_kv·n_rep, T, D]"),
]


def _repeat_judge(case: Case, got: Any) -> Verdict:
    problem = tensor_problem(got, case.expected, atol=0.0, rtol=0.0)
    if problem is None:
        return None
    hint = known_mistake(got, case.args, REPEAT_KV_MISTAKES, lambda c: not torch.equal(c, case.expected))
    if not hint and isinstance(got, Tensor) and got.shape == case.expected.shape and got.dtype == case.expected.dtype:
        hint = "copy the values: query head h's keys are KV head h // n_rep's, exactly"
    if not hint and isinstance(got, Tensor) and got.dtype != case.expected.dtype:
        hint = "keep the dtype: repeating heads copies values, it computes nothing"
    return problem, hint


def repeat_kv_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)

    def case(description, x, n_rep, hint=""):
        return Case(description, (x, n_rep), later(P.repeat_kv, x, n_rep), hint)

    def heads(B, H, T, D, dtype=f32):
        """x whose every value says which head it is in (100·head + position), plus noise."""
        base = 100 * torch.arange(H, dtype=f64).view(1, H, 1, 1) + torch.arange(T, dtype=f64).view(1, 1, T, 1)
        return (base + 0.01 * _randn(g, B, H, T, D, dtype=f64)).to(dtype)

    shared = heads(2, 2, 3, 4)
    cases = [
        case(
            "2 KV heads, n_rep 2 (values 100·head + position; the answer's heads are 0, 0, 1, 1)", heads(1, 2, 3, 4), 2
        ),
        case("4 KV heads, n_rep 3, a batch of 2", heads(2, 4, 5, 8), 3),
        case("n_rep 1 (multi-head attention: as many KV heads as query heads)", heads(2, 3, 4, 8), 1),
        case("one KV head (multi-query attention), n_rep 8", heads(1, 1, 6, 16), 8),
        case("the same x as the case before, n_rep 2 (one argument changed)", shared, 2),
        case("the same x again, n_rep 4", shared, 4, "n_rep comes from the call, not from an earlier one"),
        case("one position (T = 1, a decode step)", heads(3, 2, 1, 8), 4),
        case("float64", heads(1, 2, 3, 4, f64), 2, "float64 in, float64 out"),
        case("float16", heads(2, 2, 3, 8, f16), 2, "float16 in, float16 out"),
        case("bfloat16, Llama-3-8B's grouping: 8 KV heads for 32 query heads", heads(1, 8, 2, 4, bf16), 4),
        case(
            "x a non-contiguous view (split_heads' [B, T, H, D] transposed)",
            heads(2, 2, 3, 8).transpose(1, 2).contiguous().transpose(1, 2),
            2,
            "x may be a view: reshape works where view does not",
        ),
        case(
            "x a cache's filled part: cache[:, :, :length], a view of a longer tensor",
            heads(1, 2, 16, 8)[:, :, :5],
            3,
            "x may be a view: reshape works where view does not",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        H_kv, n_rep = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 7])
        B, T, D = rng.randint(1, 3), rng.randint(1, 9), rng.choice([2, 8, 64])
        dtype = (f32, f16, bf16, f64)[i % 4]
        x = heads(B, H_kv, T + 3, D, dtype)[:, :, :T] if rng.random() < 0.3 else heads(B, H_kv, T, D, dtype)
        cases.append(case(f"random #{i}: {str(dtype)[6:]} {list(x.shape)}, n_rep {n_rep}", x, n_rep))
    return cases


class RepeatedAttention:
    """Attention over the KV heads your repeat_kv copies — attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
    mask), chapter 03's attention — which must equal the engine's grouped_attention(q, k, v, mask, attention), which
    reads each KV head once. q, k, v and mask as the engine's Llama passes them (split_heads' q, a cache's filled
    part)."""

    def __init__(self, label: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]):
        self.label, self.args = label, (q, k, v, mask)

    def run(self, fn: Callable) -> Any:
        q, k, v, mask = self.args
        n_rep = q.shape[1] // k.shape[1]
        keys, values = fn(k, n_rep), fn(v, n_rep)
        if not (isinstance(keys, Tensor) and isinstance(values, Tensor) and keys.shape == values.shape):
            return keys  # the judge says what is wrong with it
        return P.attention(q, keys, values, mask)

    def grouped(self) -> Tensor:
        return P.grouped_attention(*self.args, P.attention)

    def show(self) -> str:
        q, k, v, mask = self.args
        n_rep = q.shape[1] // k.shape[1]
        shown = "None" if mask is None else _desc(mask)
        return (
            f"attention(q, repeat_kv(k, {n_rep}), repeat_kv(v, {n_rep}), mask) with q={_desc(q)}, k={_desc(k)}, "
            f"v={_desc(v)}, mask={shown}: the engine's grouped_attention(q, k, v, mask, attention) is expected"
        )

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return self.label


def repeated_attention_cases(seed: int) -> list[Case]:
    """Your repeat_kv where the engine used to call it: before attention, as a tiny Llama's layer does."""
    g = torch.Generator().manual_seed(seed + 1000)
    runs = [
        RepeatedAttention(
            "a decode step: 8 query heads over 2 KV heads, 1 query against 9 cached keys",
            *_gqa_qkv(g, 2, 2, 4, 1, 9, 16),
            None,
        ),
        RepeatedAttention(
            "a prefill of a left-padded batch in bfloat16: 4 query heads over 1 KV head, 6 positions",
            *_gqa_qkv(g, 2, 1, 4, 6, 6, 16, bf16, cached=False),
            _left_padding_mask([6, 4], 6, 6),
        ),
        RepeatedAttention(
            "a chunk of 3 queries of Tk 7, 6 query heads over 3 KV heads",
            *_gqa_qkv(g, 1, 3, 2, 3, 7, 8),
            None,
        ),
    ]
    return [
        Case(
            f"your repeat_kv before attention equals grouped attention: {run.label}",
            (run,),
            later(RepeatedAttention.grouped, run),
            "attention over your copies must equal the engine's grouped_attention, which reads each KV head "
            "once for its n_rep query heads: query head h reads KV head h // n_rep",
        )
        for run in runs
    ]


def _judge_repeated(case: Case, got: Any) -> Verdict:
    run = case.args[0]
    return accuracy_judge(lambda args: grouped_accuracy(run.args), GROUPED_CONTRACT)(case, got)


def check_repeat_kv(fn, *, seed: int = 0, n_random: int = 10, transformers: bool = False) -> None:
    """repeat_kv(x, n_rep): x [B, H_kv, T, D] -> [B, H_kv · n_rep, T, D], query head h reading KV head h // n_rep
    (each KV head repeated n_rep times in place, as transformers' repeat_kv); exact, in x's dtype. The last cases
    put it where the engine used to: attention over its copies must equal the engine's grouped_attention (which
    reads each KV head once, without them)."""
    cases = repeat_kv_cases(seed, n_random) + repeated_attention_cases(seed)
    base = _repeat_judge
    if transformers:
        base = _also_hf_repeat_kv(base)

    def run(*args):
        return args[0].run(fn) if isinstance(args[0], RepeatedAttention) else fn(*args)

    try:
        run = functools.wraps(fn)(run)
    except (AttributeError, TypeError):
        pass

    def judge(case: Case, got: Any) -> Verdict:
        return (_judge_repeated if isinstance(case.args[0], RepeatedAttention) else base)(case, got)

    def show(args):
        if isinstance(args[0], RepeatedAttention):
            return args[0].show()
        return f"repeat_kv(x={_desc(args[0])}, n_rep={args[1]})"

    run_check(
        "repeat_kv",
        run,
        cases,
        judge=judge,
        forbid=[_engine("repeat_kv"), *NO_TRANSFORMERS],
        error_hints={
            **VIEW_HINTS,
            "shape '[": "the answer is [B, H_kv · n_rep, T, D]: insert a dimension after the heads "
            "(x[:, :, None]), expand it to n_rep, then reshape",
        },
        show_call=show,
        seconds=10,
        total_seconds=60,
    )


def _also_hf_repeat_kv(judge: Callable) -> Callable:
    def both(case: Case, got: Any) -> Verdict:
        verdict = judge(case, got)
        if verdict is not None:
            return verdict
        # transformers is heavy (seconds to import): only for the hidden comparison
        from transformers.models.llama.modeling_llama import repeat_kv

        theirs = repeat_kv(*case.args)
        if torch.equal(got, theirs):
            return None
        return "differs from transformers' repeat_kv", "query head h reads KV head h // n_rep"

    return both


# ----------------------------------------------------------------------------------------------
# grouped_attention: grouped-query attention that reads each KV head once


def reference_grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    """What grouped_attention must equal: chapter 03's attention over the KV heads repeated for the query heads."""
    n_rep = q.shape[1] // k.shape[1]
    return P.attention(q, P.repeat_kv(k, n_rep), P.repeat_kv(v, n_rep), mask)


def _grouped(q, k, v, mask, *, tiled_heads=False, q_rows="r", mask_rows="r", none="causal", swap_out=False):
    """grouped_attention written out with the engine's attention; the keyword arguments make the known mistakes:
    query heads grouped h % H_kv (`tiled_heads`), the group's rows t-major (`q_rows`, `mask_rows` "t": row t·n_rep
    + r) rather than r-major (row r·T + t), mask None passed through (`none` "pass") or built with an unshifted
    tril ("tril"), the output's heads put back r-major (`swap_out`)."""
    B, H, T, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    n = H // H_kv
    heads = q.reshape(B, n, H_kv, T, D).transpose(1, 2) if tiled_heads else q.reshape(B, H_kv, n, T, D)
    rows = heads.reshape(B, H_kv, n * T, D) if q_rows == "r" else heads.transpose(2, 3).reshape(B, H_kv, T * n, D)
    if mask is None:
        if none == "pass":
            m = None
        else:
            base = P.causal_mask(T, Tk) if none == "causal" else torch.ones(T, Tk, dtype=torch.bool).tril()
            m = base.repeat(n, 1) if mask_rows == "r" else base.repeat_interleave(n, dim=0)
    else:
        full = mask.expand(B, H, T, Tk)
        full = full.reshape(B, n, H_kv, T, Tk).transpose(1, 2) if tiled_heads else full.reshape(B, H_kv, n, T, Tk)
        m = full.reshape(B, H_kv, n * T, Tk) if mask_rows == "r" else full.transpose(2, 3).reshape(B, H_kv, T * n, Tk)
    out = P.attention(rows, k, v, m)
    Dv = out.shape[-1]
    out = out.view(B, H_kv, n, T, Dv) if q_rows == "r" else out.view(B, H_kv, T, n, Dv).transpose(2, 3)
    if tiled_heads or swap_out:
        out = out.transpose(1, 2)  # [B, n, H_kv, T, Dv]: head r·H_kv + g
    return out.reshape(B, H, T, Dv)


_GROUP_ORDER = (
    "the mask's rows must follow the queries' rows: with q grouped as q.reshape(B, H_kv, n_rep * T, D), row r·T + t "
    "of a group is its r-th head at position t, so tile the mask whole, n_rep times along the rows — "
    "causal_mask(T, Tk).repeat(n_rep, 1), or a given mask expanded to [B, H, T, Tk] and reshaped to [B, H_kv, "
    "n_rep * T, Tk] — not each row n_rep times in a row (repeat_interleave: row t·n_rep + r)"
)
GROUPED_MISTAKES = [
    (
        lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, tiled_heads=True),
        "query head h reads KV head h // n_rep (heads 0 .. n_rep-1 share KV head 0, as repeat_kv's copies did): "
        "group them as q.reshape(B, H_kv, n_rep * T, D); q.reshape(B, n_rep, H_kv, T, D) pairs head h with KV head "
        "h % H_kv",
    ),
    (
        lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, none="pass"),
        "mask None means causal for the T queries, which are the last T of the Tk positions — but attention's own "
        "None would take the n_rep · T grouped rows for the last n_rep · T positions, and they are n_rep heads at "
        "the same T positions. Tile the causal mask yourself: causal_mask(T, Tk).repeat(n_rep, 1) ([n_rep · T, Tk], "
        "row r·T + t is position t)",
    ),
    (
        lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, none="tril"),
        "the T queries are the last T of the Tk positions: query t sits at position Tk - T + t and sees keys 0 .. "
        "Tk - T + t; torch.ones(T, Tk).tril() lets it see only 0 .. t. Use causal_mask(T, Tk) or "
        ".tril(diagonal=Tk - T), then tile it for the n_rep heads",
    ),
    (lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, mask_rows="t"), _GROUP_ORDER),
    (lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, q_rows="t"), _GROUP_ORDER),
    (
        lambda q, k, v, mask, attention=None: _grouped(q, k, v, mask, swap_out=True),
        "put the heads back in their order: attention's output [B, H_kv, n_rep · T, D] is reshaped to [B, H, T, D] "
        "as it is (row r·T + t of group g is head g·n_rep + r at position t), without swapping H_kv and n_rep",
    ),
]

# Contract: attention's answer (chapter 03's, given) from the same rounded q, k, v: within 8 units of rounding of
# the dtype times (1 + S) times V, where S bounds the row's scores (max over keys of Σ|q_i||k_i| / √D: a score's
# rounding grows with it) and V is the largest |v| of its KV head (the output is an average of the values).
GROUPED_K = 8
GROUPED_CONTRACT = (
    "grouped_attention may be off by 8 units of rounding of the dtype times (1 + the row's largest Σ|q_i·k_i| / √D) "
    "times the largest |v| of its KV head: what attention itself rounds"
)


def grouped_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    q, k, v, mask = args[:4]
    n_rep = q.shape[1] // k.shape[1]
    Q, K, V = _wide(q), P.repeat_kv(_wide(k), n_rep), P.repeat_kv(_wide(v), n_rep)
    exact = P.attention(Q, K, V, mask)
    scores = (Q.abs() @ K.abs().transpose(-1, -2)).amax(-1, keepdim=True) / math.sqrt(q.shape[-1])  # [B, H, T, 1]
    values = V.abs().amax((-2, -1), keepdim=True)  # [B, H, 1, 1]
    allowed = GROUPED_K * _u(q) * (1 + scores) * values + _floor(q)
    return exact, allowed.expand_as(exact)


class _Seen:
    """What `attention` was given in one call: shapes, and the memory k and v live in."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Any):
        self.q, self.k, self.v = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        self.k_memory, self.v_memory = k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()
        self.mask = None if mask is None else tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__

    def show(self) -> str:
        mask = "None" if self.mask is None else f"[{', '.join(map(str, self.mask))}]"
        return f"attention(q {list(self.q)}, k {list(self.k)}, v {list(self.v)}, mask {mask})"


class GivenAttention:
    """`attention` as the check gives it to grouped_attention: chapter 03's (the engine's `parts.attention`),
    multi-head — q, k and v with the same number of heads — which records what each call receives, so that the
    check can tell that k and v reached it as given (not copied: the same memory, [B, H_kv, Tk, D] in all) and that
    the work went through it (torch's fused attention run elsewhere is seen too: `outside`)."""

    def __init__(self):
        self.calls: list[_Seen] = []
        self.depth = 0
        self.outside: Optional[str] = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise TypeError(
                    f"attention(q, k, v, mask) takes q, k and v as tensors [B, heads, T, D]; got {name} = "
                    f"{short(t, 80)}"
                )
        if q.shape[1] != k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
            raise ValueError(
                f"attention(q, k, v, mask) is chapter 03's multi-head attention: q, k and v need the same batch "
                f"and number of heads; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
            )
        self.calls.append(_Seen(q, k, v, mask))
        self.depth += 1
        try:
            return P.attention(q, k, v, mask)
        finally:
            self.depth -= 1

    def run(self, fn: Callable, args: tuple) -> Any:
        """fn(*args) with this attention as its last argument, watching for torch's attention run outside it."""
        self.calls, self.depth, self.outside = [], 0, None
        with _AttentionOutside(self):
            return fn(*args)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "<chapter 03's attention(q, k, v, mask): multi-head, None = causal>"


class _AttentionOutside(DispatchWatch):
    """Notes torch's fused attention (F.scaled_dot_product_attention and its kernels, enable_gqa included) run while
    the given attention is not on the stack: the learner's function calling it itself."""

    def __init__(self, given: GivenAttention):
        super().__init__()
        self.given = given

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.given.depth == 0 and self.given.outside is None and name in FUSED_ATTENTION:
            self.given.outside = f"torch.ops.{func.namespace}.{name}"
        return func(*args, **(kwargs or {}))


OWN_ATTENTION_HINT = (
    "call `attention(q, k, v, mask)`, the function you are given (chapter 03's: multi-head, the engine passes the "
    "model's attention part), with the queries grouped per KV head: once on [B, H_kv, n_rep · T, D] rows, or once "
    "per KV group. F.scaled_dot_product_attention (enable_gqa=True included), an attention of your own or the "
    "engine's parts.attention called directly are not the part you were given"
)


def _grouped_calls_problem(case: Case, got: Any) -> Optional[tuple[str, str, str]]:
    """(what is wrong, what attention should have received, the hint) when the calls to the given attention read k
    and v otherwise than once each, as given; None if they did."""
    q, k, v, mask, given = case.args
    H, H_kv = q.shape[1], k.shape[1]
    n_rep = H // H_kv
    B, T, D = q.shape[0], q.shape[2], q.shape[3]
    wanted = f"attention(q {[B, H_kv, n_rep * T, D]}, k {list(k.shape)}, v {list(v.shape)}, mask) — k and v as given"
    if n_rep == 1:
        wanted = f"attention(q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, mask) — n_rep 1: as given"
    if not given.calls:
        return "your function did not call `attention`, the function it was given", wanted, OWN_ATTENTION_HINT
    memory = (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
    for seen in given.calls:
        if (seen.k_memory, seen.v_memory) != memory:
            if seen.k[1] > H_kv or len(given.calls) * seen.k[1] > H_kv:
                return (
                    f"attention received k and v with {seen.k[1]} heads, copies of the {H_kv} KV heads (not the "
                    f"tensors you were given): your function reads each KV head n_rep = {n_rep} times",
                    wanted,
                    "that is repeat_kv's copies, which grouped attention exists to avoid: a decode step's cost is "
                    "reading the KV cache, and the copies read (and write) every KV head n_rep times. Group the "
                    "queries instead — q.reshape(B, H_kv, n_rep * T, D), the mask tiled to match — and pass k and v "
                    "to attention as they are",
                )
            return (
                "attention received a copy of k or v (other memory than the tensors you were given)",
                wanted,
                "pass k and v to attention as they are (views of them are fine: k[:, g:g+1] for one group): no "
                ".contiguous(), .clone(), .to() or reshape that copies — the engine gives them as the filled part "
                "of its KV cache, and copying them reads and writes every byte of it",
            )
    read = sum(seen.k[1] for seen in given.calls)
    if read > H_kv:
        return (
            f"your function's {len(given.calls)} calls to attention read {read} key heads where there are {H_kv}: "
            f"each KV head is read {read // H_kv} times",
            wanted,
            "one call per query head (or k expanded to the H query heads) reads each KV head n_rep times: put the "
            "n_rep query heads of a KV head together as rows of one call, q.reshape(B, H_kv, n_rep * T, D)",
        )
    return None


def _judge_grouped(accuracy: Callable) -> Callable:
    def judge(case: Case, got: Any) -> Verdict:
        given = case.args[4]
        if given.outside:
            raise CheckFailed(
                f"✗ grouped_attention — {case.description}: your function ran torch's fused attention "
                f"({given.outside}) itself, not through the `attention` it was given\n"
                f"  input:    {_show_grouped(case.args)}\n"
                f"  expected: torch's attention run only inside the `attention` you were given\n"
                f"  got:      {given.outside} run by your function itself ({len(given.calls)} calls to `attention`)\n"
                f"  hint: {OWN_ATTENTION_HINT}"
            )
        verdict = accuracy(case, got)
        if verdict is not None:
            return verdict
        problem = _grouped_calls_problem(case, got)
        if problem is None:
            return None
        what, wanted, hint = problem
        calls = "; ".join(seen.show() for seen in given.calls[:4]) + " ..." * (len(given.calls) > 4)
        raise CheckFailed(
            f"✗ grouped_attention — {case.description}: {what}\n"
            f"  input:    {_show_grouped(case.args)}\n"
            f"  expected: {wanted}\n"
            f"  got:      {calls or 'no call to attention'}\n"
            f"  hint: {hint}"
        )

    return judge


def _show_grouped(args: tuple) -> str:
    q, k, v, mask, attention = args
    shown = "None" if mask is None else _desc(mask)
    return f"grouped_attention(q={_desc(q)}, k={_desc(k)}, v={_desc(v)}, mask={shown}, attention={attention!r})"


def _gqa_case(description: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], hint: str = "") -> Case:
    return Case(description, (q, k, v, mask, GivenAttention()), later(reference_grouped_attention, q, k, v, mask), hint)


def _gqa_qkv(g, B, H_kv, n_rep, T, Tk, D, dtype=f32, *, split=True, cached=True, scale=1.0, marked=False):
    """q [B, H, T, D] (split_heads' transposed view of a projection, or contiguous), k and v [B, H_kv, Tk, D] (the
    filled part of a longer cache, or contiguous). `marked`: v is 10·(KV head + 1) plus noise, so that an output
    head says which KV head it read."""
    H = H_kv * n_rep
    q = (_randn(g, B, T, H * D, dtype=f64) * scale).to(dtype).view(B, T, H, D).transpose(1, 2)
    if not split:
        q = q.contiguous()
    extra = 3 if cached else 0
    k = (_randn(g, B, H_kv, Tk + extra, D, dtype=f64) * scale).to(dtype)[:, :, :Tk]
    v = _randn(g, B, H_kv, Tk + extra, D, dtype=f64)
    if marked:
        v = 0.5 * v + 10 * (1 + torch.arange(H_kv, dtype=f64)).view(1, H_kv, 1, 1)
    else:
        v = 2 * v + 1
    v = v.to(dtype)[:, :, :Tk]
    if not cached:
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _left_padding_mask(lengths: Sequence[int], T: int, Tk: int) -> Tensor:
    """The engine's mask for a left-padded batch: [B, 1, T, Tk], causal over the real tokens; a padding query sees
    only itself."""
    real = torch.stack([torch.arange(Tk) >= Tk - n for n in lengths])  # [B, Tk]
    key_pos, query_pos = torch.arange(Tk), Tk - T + torch.arange(T)
    return ((key_pos <= query_pos[:, None]) & real[:, None, None, :]) | (key_pos == query_pos[:, None])


def _random_mask(g: torch.Generator, shape: Sequence[int]) -> Tensor:
    """A random bool mask with no row all False."""
    mask = torch.rand(tuple(shape), generator=g) < 0.6
    mask[..., -1] |= ~mask.any(-1)
    return mask


def grouped_attention_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    shared = _gqa_qkv(g, 2, 2, 2, 3, 5, 8)
    per_head = _random_mask(g, (2, 4, 3, 5))
    cases = [
        _gqa_case(
            "4 query heads over 2 KV heads (n_rep 2), 3 positions, mask None (causal); v is 10·(KV head + 1) plus "
            "noise, so each output head shows which KV head it read",
            *_gqa_qkv(g, 1, 2, 2, 3, 3, 8, split=False, cached=False, marked=True),
            None,
            "query head h reads KV head h // n_rep: heads 0 and 1 read KV head 0 (values near 10), heads 2 and 3 "
            "KV head 1 (near 20)",
        ),
        _gqa_case(
            "a decode step: one query (T 1) against 7 cached keys, n_rep 4, mask None",
            *_gqa_qkv(g, 2, 2, 4, 1, 7, 8),
            None,
            "mask None: the T queries are the last T of the Tk positions, so one query sees every key",
        ),
        _gqa_case(
            "a chunk of a prefill: 3 queries, the last 3 of Tk 8 positions, n_rep 2, mask None",
            *_gqa_qkv(g, 1, 2, 2, 3, 8, 8),
            None,
            "query t is at position Tk - T + t: causal_mask(T, Tk) says which keys it sees",
        ),
        _gqa_case(
            "n_rep 1 (multi-head attention: as many KV heads as query heads)",
            *_gqa_qkv(g, 2, 3, 1, 4, 4, 8),
            None,
            "n_rep 1: attention(q, k, v, mask) as it is",
        ),
        _gqa_case(
            "one KV head for 8 query heads (multi-query attention), 5 positions",
            *_gqa_qkv(g, 1, 1, 8, 5, 5, 8, marked=True),
            None,
        ),
        _gqa_case(
            "n_rep 8: 16 query heads over 2 KV heads (Llama-3-70B's grouping: 64 over 8), a decode step over 12 keys",
            *_gqa_qkv(g, 1, 2, 8, 1, 12, 16),
            None,
        ),
        _gqa_case(
            "as the engine calls it: q from split_heads (a non-contiguous view), k and v the filled part of a cache, "
            "4 queries of Tk 9, n_rep 3",
            *_gqa_qkv(g, 2, 2, 3, 4, 9, 8),
            None,
            "q may be a non-contiguous view: reshape it (a copy of q is fine; only k and v must not be copied)",
        ),
        _gqa_case(
            "the engine's padding mask [B, 1, T, Tk] for a left-padded batch (6 and 3 real tokens), n_rep 2",
            *_gqa_qkv(g, 2, 2, 2, 6, 6, 8, cached=False),
            _left_padding_mask([6, 3], 6, 6),
            "a given mask is expanded to [B, H, T, Tk] and laid out like the grouped queries: [B, H_kv, n_rep·T, Tk]",
        ),
        _gqa_case(
            "a decode step of a padded batch: mask [B, 1, 1, Tk], n_rep 4",
            *_gqa_qkv(g, 3, 1, 4, 1, 6, 8),
            _left_padding_mask([6, 2, 4], 1, 6),
        ),
        _gqa_case("a mask per query head [B, H, T, Tk] (random), n_rep 2", *shared, per_head),
        _gqa_case(
            "the same q, k, v, mask None (one argument changed)",
            *shared,
            None,
            "mask None: build the causal mask for this call's T and Tk",
        ),
        _gqa_case(
            "the causal mask given as [T, Tk] (broadcast over batch and heads), 3 queries of Tk 5, n_rep 3",
            *_gqa_qkv(g, 1, 2, 3, 3, 5, 8),
            P.causal_mask(3, 5),
        ),
        _gqa_case("float64, n_rep 2", *_gqa_qkv(g, 2, 2, 2, 4, 4, 8, f64), None, "float64 in, float64 out"),
        _gqa_case(
            "float16: split_heads' q, a cache's k and v, 5 queries of Tk 7, n_rep 2",
            *_gqa_qkv(g, 1, 2, 2, 5, 7, 16, f16),
            None,
            "float16 in, float16 out",
        ),
        _gqa_case(
            "bfloat16 decode, n_rep 4, padding mask [B, 1, 1, Tk]",
            *_gqa_qkv(g, 2, 2, 4, 1, 9, 16, bf16),
            _left_padding_mask([9, 5], 1, 9),
            "bfloat16 in, bfloat16 out",
        ),
        _gqa_case(
            "a prefill of 40 positions, head_dim 64, scores far from 0 (q and k ×3), n_rep 4",
            *_gqa_qkv(g, 1, 2, 4, 40, 40, 64, scale=3.0),
            None,
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        B, H_kv, n_rep = rng.randint(1, 2), rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
        D, Tk = rng.choice([4, 8, 16, 64]), rng.randint(1, 12)
        T = rng.choice([Tk, 1, rng.randint(1, Tk)])
        dtype = (f32, f64, f16, bf16, f32)[i % 5]
        q, k, v = _gqa_qkv(
            g, B, H_kv, n_rep, T, Tk, D, dtype, split=rng.random() < 0.6, cached=rng.random() < 0.5, scale=1.0
        )
        kind = i % 4
        if kind == 0:
            what, mask = "mask None", None
        elif kind == 1:
            lengths = [rng.randint(1, Tk) for _ in range(B)]
            what, mask = f"padding mask [B, 1, T, Tk] ({lengths} real tokens)", _left_padding_mask(lengths, T, Tk)
        elif kind == 2:
            what, mask = "key mask [B, 1, 1, Tk]", _random_mask(g, (B, 1, 1, Tk))
        else:
            what, mask = "a mask per head [B, H, T, Tk]", _random_mask(g, (B, H_kv * n_rep, T, Tk))
        cases.append(
            _gqa_case(
                f"random #{i}: {str(dtype)[6:]}, B {B}, {H_kv * n_rep} query heads over {H_kv} KV heads, T {T} of "
                f"Tk {Tk}, D {D}, {what}",
                q,
                k,
                v,
                mask,
            )
        )
    return cases


GROUPED_ERROR_HINTS = {
    "view size is not compatible": "q may be a non-contiguous view (split_heads' transpose, as the engine passes "
    "it): q.reshape(B, H_kv, n_rep * T, D) (a copy of q is fine; k and v go to attention as they are)",
    "chapter 03's multi-head attention": "attention is multi-head: group the n_rep query heads of each KV head as "
    "rows of one head, q.reshape(B, H_kv, n_rep * T, D), tile the mask to match, call attention(rows, k, v, mask) "
    "and reshape its output back to [B, H, T, D]",
    "must match the size": "the mask needs one row per grouped query row: [n_rep · T, Tk] "
    "(causal_mask(T, Tk).repeat(n_rep, 1)), or a given mask expanded to [B, H, T, Tk] and reshaped to "
    "[B, H_kv, n_rep · T, Tk]",
}


def check_grouped_attention(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """grouped_attention(q, k, v, mask, attention) -> [B, H, T, D]: q [B, H, T, D], k and v [B, H_kv, Tk, D], query
    head h reading KV head h // n_rep, each KV head read once — the check's `attention` (chapter 03's, multi-head)
    records what it receives, so k and v must reach it as given (no copies, no repeat_kv) — equal to
    attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask) within the accuracy of attention itself. mask None
    (causal: the T queries are the last T of the Tk positions) or a bool mask broadcastable to [B, H, T, Tk]; float32,
    float64, float16, bfloat16; q a non-contiguous view. The last cases run it in a tiny Llama's every layer."""
    cases = grouped_attention_cases(seed, n_random) + engine_cases("grouped_attention", seed)
    judge = _judge_grouped(accuracy_judge(grouped_accuracy, GROUPED_CONTRACT, GROUPED_MISTAKES))

    def run(*args):
        if isinstance(args[0], LlamaRun):
            return args[0].run(fn)
        return args[4].run(fn, args)

    try:
        run = functools.wraps(fn)(run)
    except (AttributeError, TypeError):
        pass

    def both(case: Case, got: Any) -> Verdict:
        return (_judge_engine if isinstance(case.args[0], LlamaRun) else judge)(case, got)

    run_check(
        "grouped_attention",
        run,
        cases,
        judge=both,
        forbid=[
            _engine("grouped_attention"),
            Forbidden(
                "llmcourse.engine.cpu_kernels",
                "The engine's C decode kernel groups the query heads itself: call the `attention` you are given.",
                direct=True,
            ),
            *NO_TRANSFORMERS,
        ],
        error_hints=GROUPED_ERROR_HINTS,
        show_call=lambda args: args[0].show() if isinstance(args[0], LlamaRun) else _show_grouped(args),
        seconds=10,
        total_seconds=60,
    )


# ----------------------------------------------------------------------------------------------
# QK-norm (Qwen3)


def _qk_norm_over_heads(q, k, qw, kw, eps):
    def norm(t, w):
        t32 = t.float()
        return w * (t32 * torch.rsqrt(t32.pow(2).mean((1, 3), keepdim=True) + eps)).to(t.dtype)

    return norm(q, qw), norm(k, kw)


def _qk_norm_over_positions(q, k, qw, kw, eps):
    def norm(t, w):
        t32 = t.float()
        return w * (t32 * torch.rsqrt(t32.pow(2).mean(2, keepdim=True) + eps)).to(t.dtype)

    return norm(q, qw), norm(k, kw)


def _qk_norm_one_weight(q, k, qw, kw, eps):
    return P.rms_norm(q, qw, eps), P.rms_norm(k, qw, eps)


def _qk_norm_swapped_weights(q, k, qw, kw, eps):
    return P.rms_norm(q, kw, eps), P.rms_norm(k, qw, eps)


def _qk_norm_q_only(q, k, qw, kw, eps):
    return P.rms_norm(q, qw, eps), k


def _qk_norm_swapped_result(q, k, qw, kw, eps):
    return P.rms_norm(k, kw, eps), P.rms_norm(q, qw, eps)


def _qk_norm_layer_norm(q, k, qw, kw, eps):
    return _rms_layer_norm(q, qw, eps), _rms_layer_norm(k, kw, eps)


def _qk_norm_in_dtype(q, k, qw, kw, eps):
    return _rms_in_dtype(q, qw, eps), _rms_in_dtype(k, kw, eps)


QK_NORM_MISTAKES = [
    (
        _qk_norm_over_heads,
        "normalize each head's vector on its own: over head_dim (the last dim, D features), not over all the heads "
        "of a position together (C = H·D; that is OLMo 2's QK-norm, Qwen3's is per head)",
    ),
    (_qk_norm_over_positions, "normalize over head_dim (the last dim), not over the positions"),
    (_qk_norm_one_weight, "queries and keys have a weight each: q_norm's for q, k_norm's for k"),
    (_qk_norm_swapped_weights, "q_weight scales the queries and k_weight the keys"),
    (_qk_norm_q_only, "normalize the keys too: (rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps))"),
    (_qk_norm_swapped_result, "return (q, k) in that order"),
    (_qk_norm_layer_norm, "RMSNorm, not LayerNorm: no mean subtracted"),
    (_qk_norm_in_dtype, RMS_NORM_MISTAKES[-2][1]),
]


def _qk_judge() -> Callable:
    part = _with_half_order(
        accuracy_judge(rms_norm_accuracy, RMS_NORM_CONTRACT), P.rms_norm, RMS_NORM_MISTAKES, RMS_NORM_CONTRACT
    )

    def judge(case: Case, got: Any) -> Verdict:
        q, k, qw, kw, eps = case.args
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"expected a pair (q, k) of tensors, got {short(got, 80)}", "return q, k"
        for name, tensor, weight, out, expected in (
            ("q", q, qw, got[0], case.expected[0]),
            ("k", k, kw, got[1], case.expected[1]),
        ):
            verdict = part(Case(case.description, (tensor, weight, eps), expected), out)
            if verdict is not None:
                problem, hint = verdict
                mistake = _qk_mistake(got, case)
                return f"the {name} returned: {problem}", mistake or hint
        return None

    return judge


def _qk_mistake(got: Any, case: Case) -> str:
    """The hint of the known mistake whose pair (q, k) is `got`, if any."""

    for mistake, hint in QK_NORM_MISTAKES:
        try:
            with torch.no_grad():
                cq, ck = mistake(*case.args)
        except Exception:
            continue
        eq, ek = case.expected
        if (
            isinstance(got[0], Tensor)
            and isinstance(got[1], Tensor)
            and same_answer(got[0], cq)
            and same_answer(got[1], ck)
            and not (torch.equal(cq, eq) and torch.equal(ck, ek))
        ):
            return hint
    return ""


def qk_norm_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)

    def case(description, B, H, H_kv, T, D, dtype=f32, eps=1e-6, scale=2.0, split=True, hint=""):
        def heads(n):
            t = _randn(g, B, T, n, D, dtype=f64) * scale * (1 + torch.arange(n, dtype=f64).view(1, 1, n, 1))
            t = t.to(dtype)
            return t.transpose(1, 2) if split else t.transpose(1, 2).contiguous()  # split_heads' view, or not

        q, k = heads(H), heads(H_kv)
        qw, kw = (1 + 0.4 * _randn(g, D)).to(dtype), (1 + 0.4 * _randn(g, D)).to(dtype)
        args = (q, k, qw, kw, eps)
        return Case(description, args, later(P.qk_norm, *args), hint)

    cases = [
        case(
            "q [1, 2, 3, 4] and k [1, 2, 3, 4] (heads of different sizes)",
            1,
            2,
            2,
            3,
            4,
            split=False,
            hint="each head of each position is normalized on its own, over its D features",
        ),
        case("grouped-query: 4 query heads, 2 KV heads", 2, 4, 2, 5, 8),
        case("one position, 8 query heads, 1 KV head", 1, 8, 1, 1, 16),
        case("eps 1e-3", 1, 2, 1, 4, 8, eps=1e-3, scale=0.01),
        case("float64", 1, 4, 2, 3, 8, f64, hint="float64 in, float64 out"),
        case(
            "float16, heads of split_heads (non-contiguous views)", 2, 4, 2, 3, 64, f16, hint="float16 in, float16 out"
        ),
        case("bfloat16, Qwen3's head_dim 128", 1, 4, 2, 3, 128, bf16, hint="bfloat16 in, bfloat16 out"),
        case("float16, large queries and keys (±500)", 1, 2, 2, 2, 32, f16, scale=500.0),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        H_kv = rng.choice([1, 2, 4])
        H = H_kv * rng.choice([1, 2, 4])
        dtype = (f32, bf16, f64, f16)[i % 4]
        D = rng.choice([2, 8, 64])
        cases.append(
            case(
                f"random #{i}: {str(dtype)[6:]}, {H} query heads, {H_kv} KV heads, D {D}",
                rng.randint(1, 3),
                H,
                H_kv,
                rng.randint(1, 6),
                D,
                dtype,
                eps=rng.choice([1e-6, 1e-5]),
                split=rng.random() < 0.7,
            )
        )
    return cases


def check_qk_norm(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """qk_norm(q, k, q_weight, k_weight, eps) -> (q, k): RMSNorm of every head's query and key vector over head_dim
    (q [B, H, T, D], k [B, H_kv, T, D], weights [D]), as rms_norm computes it; the heads come as split_heads gives
    them (non-contiguous views). The last cases run it inside a tiny Qwen3."""
    cases = qk_norm_cases(seed, n_random) + engine_cases("qk_norm", seed)
    run, judge = with_llama_runs(unwritten_helper(fn), _qk_judge())

    def show(args):
        if isinstance(args[0], LlamaRun):
            return args[0].show()
        q, k, qw, kw, eps = args
        return f"qk_norm(q={_desc(q)}, k={_desc(k)}, q_weight={_desc(qw)}, k_weight={_desc(kw)}, eps={eps:g})"

    run_check(
        "qk_norm",
        run,
        cases,
        judge=judge,
        forbid=[*NO_RMS_NORM, _engine("qk_norm"), *NO_TRANSFORMERS],
        error_hints=VIEW_HINTS,
        show_call=show,
        seconds=10,
        total_seconds=60,
    )


# ----------------------------------------------------------------------------------------------
# rope_frequencies: RoPE's speeds as checkpoints ship them (rope_theta, "linear" and "llama3" scaling)


def _speeds(head_dim: int, theta: float, dtype=f64) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))


def _llama3(inv_freq, scaling, *, swap=False, ratio="original/wavelength", blend_all=False, no_two_pi=False, **fixed):
    """The llama3 rule with the keyword arguments making the known mistakes."""
    s = {**scaling, **fixed}
    factor, old, low, high = (
        s["factor"],
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
    )
    wavelen = (1 if no_two_pi else 2 * math.pi) / inv_freq
    if ratio == "original/wavelength":
        smooth = (old / wavelen - low) / (high - low)
    elif ratio == "wavelength/original":
        smooth = (wavelen / old - low) / (high - low)
    else:  # the blend's weights swapped
        smooth = 1 - (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    if blend_all:
        return blended
    slow, fast = wavelen > old / low, wavelen < old / high
    if swap:
        slow, fast = fast, slow
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def _rope_mistake(head_dim, theta, scaling, *, dtype=f64, exponent=2, theta_fixed=None, linear_times=False, **llama3):
    inv_freq = 1.0 / ((theta_fixed or theta) ** (torch.arange(0, head_dim // 2, dtype=dtype) * exponent / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear" or (kind == "llama3" and llama3.get("as_linear")):
        out = inv_freq * scaling["factor"] if linear_times else inv_freq / scaling["factor"]
    elif kind == "llama3":
        out = _llama3(inv_freq, scaling, **{k: v for k, v in llama3.items() if k != "as_linear"})
    else:
        out = inv_freq
    return out.double()


def _mistake(**how) -> Callable:
    return lambda head_dim, rope_theta, rope_scaling: _rope_mistake(head_dim, rope_theta, rope_scaling, **how)


LLAMA31 = dict(original_max_position_embeddings=8192, low_freq_factor=1.0, high_freq_factor=4.0)
ROPE_MISTAKES = [
    (
        _mistake(linear_times=True),
        '"linear" scaling (Position Interpolation) divides every speed by factor: positions turn factor times more '
        "slowly, so factor times more of them fit in the angles the model was trained on — not faster",
    ),
    (
        _mistake(as_linear=True),
        '"llama3" divides only the slow pairs by factor (wavelength 2π / speed longer than original / '
        "low_freq_factor), keeps the fast ones (shorter than original / high_freq_factor) and blends those in "
        'between: not every speed, as "linear" does',
    ),
    (
        _mistake(swap=True),
        "the bands are swapped: the *slow* pairs, whose wavelength 2π / speed is longer than original / "
        "low_freq_factor, are divided by factor; the fast ones (wavelength shorter than original / "
        "high_freq_factor) are kept as they are",
    ),
    (
        _mistake(ratio="wavelength/original"),
        "smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor): original "
        "divided by the wavelength (how many turns the pair makes over the original context), not the wavelength "
        "divided by original",
    ),
    (
        _mistake(ratio="inverted"),
        "the blend's weights: (1 - smooth) · speed / factor + smooth · speed — smooth is 0 at the slow edge (all "
        "divided) and 1 at the fast edge (all kept)",
    ),
    (
        _mistake(blend_all=True),
        "the blend is for the pairs in between only: wavelengths longer than original / low_freq_factor are divided "
        "by factor, shorter than original / high_freq_factor kept; blending them too extrapolates the line past "
        "its ends",
    ),
    (
        _mistake(no_two_pi=True),
        "a pair's wavelength is 2π / speed (the positions it takes to turn once), not 1 / speed",
    ),
    (
        _mistake(**LLAMA31),
        "read original_max_position_embeddings, low_freq_factor and high_freq_factor from rope_scaling: Llama 3.1's "
        "8192, 1 and 4 are one checkpoint's values",
    ),
    (
        _mistake(theta_fixed=10000.0),
        "use the rope_theta you are given (Llama 3's is 500 000, Qwen3's 1 000 000), not 10 000",
    ),
    (
        _mistake(exponent=1),
        "the exponent is 2i / head_dim for pair i = 0 .. head_dim/2 - 1 (torch.arange(0, head_dim, 2) / head_dim), "
        "not i / head_dim",
    ),
    (
        _mistake(dtype=f32),  # last: a float32 answer is named by its dtype (`_judge_rope_frequencies`)
        "computed in float32 (torch.arange(...).float(), or a float32 tensor on the way), then converted: compute in "
        "float64 — the engine multiplies the speeds by positions up to 131 072 (Llama 3.1's context), where "
        "float32's 7 digits turn into angles off by hundredths of a radian",
    ),
]
ROPE_RTOL = 1e-10  # float64 routes (1 / θ^x, θ^-x, exp(-x·ln θ), blends written otherwise) agree to ~1e-15
ROPE_CONTRACT = "a float64 tensor [head_dim / 2] within 1e-10 relative of the exact speeds"


def _rope_problem(got: Any, expected: Tensor) -> Optional[tuple[str, bool]]:
    """(what is wrong, whether the values can be compared with a known mistake's), or None."""
    if isinstance(got, (list, tuple)):
        return f"expected a torch.Tensor (float64, [{expected.shape[0]}]), got a {type(got).__name__}", False
    problem = plain_tensor_problem(got, expected)
    if problem:
        return problem, False
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}", True
    if got.dtype != expected.dtype:
        return f"expected dtype {expected.dtype}, got {got.dtype}", got.is_floating_point()
    problem = tensor_problem(got, expected, atol=0.0, rtol=ROPE_RTOL)
    return (problem, True) if problem else None


def _judge_rope_frequencies(case: Case, got: Any) -> Verdict:
    expected = case.expected
    found = _rope_problem(got, expected)
    if found is None:
        return None
    problem, comparable = found
    hint = ""
    if comparable:
        float64 = isinstance(got, Tensor) and got.dtype == f64  # a float32 answer: its dtype is the mistake to name
        hint = known_mistake(
            got,
            case.args,
            ROPE_MISTAKES if float64 else ROPE_MISTAKES[:-1],
            lambda candidate: tensor_problem(candidate, expected, atol=0.0, rtol=ROPE_RTOL),
        )
    if hint:
        return problem, hint
    if isinstance(got, (list, tuple)):
        return problem, "return a tensor: torch.tensor(speeds, dtype=torch.float64), or compute with tensors"
    if isinstance(got, Tensor) and got.dim() == 1 and got.shape[0] == 2 * expected.shape[0]:
        return problem, "one speed per rotated pair: head_dim / 2 of them, pair i = 0 .. head_dim/2 - 1"
    if isinstance(got, Tensor) and got.shape == expected.shape and got.dtype != f64:
        return problem, (
            "compute and return the speeds in float64 (torch.arange(0, head_dim, 2, dtype=torch.float64)): the "
            "engine multiplies them by positions up to 131 072 (Llama 3.1's context), where float32's 7 digits "
            "turn into angles off by hundredths of a radian"
        )
    return problem, ""


def _show_rope_frequencies(args: tuple) -> str:
    head_dim, theta, scaling = args
    return f"rope_frequencies(head_dim={head_dim!r}, rope_theta={theta!r}, rope_scaling={scaling!r})"


def _scaling(kind: str, **values) -> dict:
    return {"rope_type": kind, **values}


def _llama3_scaling(factor, low, high, original) -> dict:
    return _scaling(
        "llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _rope_case(description: str, head_dim: int, theta: float, scaling: Optional[dict], hint: str = "") -> Case:
    return Case(
        description,
        (head_dim, theta, scaling),
        later(lambda d, t, s: P.rope_frequencies(d, t, copy.deepcopy(s)), head_dim, theta, scaling),
        hint,
    )


def _random_llama3(rng: random.Random, head_dim: int, theta: float) -> dict:
    """llama3 parameters whose three bands each hold at least one pair of this head_dim and theta: the thresholds
    original / low and original / high placed between the pairs' wavelengths."""
    wavelengths = sorted((2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)))
    n = len(wavelengths)
    a = rng.randint(0, n - 3)  # fast: wavelengths[: a + 1]
    b = rng.randint(a + 1, n - 2)  # in between: wavelengths[a + 1 : b + 1]; slow: the rest
    high_edge = math.sqrt(wavelengths[a] * wavelengths[a + 1])
    low_edge = math.sqrt(wavelengths[b] * wavelengths[b + 1])
    original = rng.choice([2048, 4096, 8192, 16384, 32768])
    factor = rng.choice([2.0, 4, 8.0, 16.0, 32])
    return _llama3_scaling(factor, original / low_edge, original / high_edge, original)


def rope_frequencies_cases(seed: int, n_random: int) -> list[Case]:
    shared = _llama3_scaling(8.0, 1.0, 4.0, 8192)
    cases = [
        _rope_case(
            "head_dim 8, rope_theta 10 000, no scaling",
            8,
            10000.0,
            None,
            "pair i turns at 1 / rope_theta ** (2i / head_dim): [1, 0.1, 0.01, 0.001] here",
        ),
        _rope_case("head_dim 64, rope_theta 10 000, rope_scaling None", 64, 10000.0, None),
        _rope_case(
            'head_dim 128, rope_theta 500 000 (Llama 3), {"rope_type": "default"}',
            128,
            500000.0,
            _scaling("default"),
            '"default" is unscaled RoPE, like None',
        ),
        _rope_case("head_dim 128, rope_theta 1 000 000 (Qwen3), no scaling", 128, 1000000.0, None),
        _rope_case("head_dim 2 (one pair): its speed is 1", 2, 10000.0, None),
        _rope_case(
            '"linear" scaling, factor 2 (Position Interpolation)',
            64,
            10000.0,
            _scaling("linear", factor=2.0),
            "linear: every speed divided by factor",
        ),
        _rope_case('"linear", factor 4, rope_theta 500 000, head_dim 128', 128, 500000.0, _scaling("linear", factor=4)),
        _rope_case('"linear", factor 8.0, head_dim 2', 2, 10000.0, _scaling("linear", factor=8.0)),
        _rope_case(
            "Llama-3.1-8B's: head_dim 128, rope_theta 500 000, llama3 factor 8, low_freq_factor 1, high_freq_factor "
            "4, original_max_position_embeddings 8192",
            128,
            500000.0,
            shared,
            "llama3: wavelength = 2π / speed; longer than original / low_freq_factor: divided by factor; shorter "
            "than original / high_freq_factor: kept; in between: (1 - smooth) · speed / factor + smooth · speed",
        ),
        _rope_case(
            "Llama-3.2-1B's: head_dim 64, rope_theta 500 000, llama3 factor 32 (low 1, high 4, original 8192)",
            64,
            500000.0,
            _llama3_scaling(32.0, 1.0, 4.0, 8192),
        ),
        _rope_case(
            "the same rope_scaling as two cases before, head_dim 64 (one argument changed)",
            64,
            500000.0,
            shared,
            "head_dim comes from the call",
        ),
        _rope_case(
            "llama3 with other bands: original 4096, low_freq_factor 2, high_freq_factor 16, factor 16",
            64,
            10000.0,
            _llama3_scaling(16.0, 2.0, 16.0, 4096),
            "read every value from rope_scaling",
        ),
        _rope_case(
            "two pairs exactly on the bands' edges: pair 0's wavelength 2π is original / high_freq_factor, pair 2's "
            "is original / low_freq_factor (< or <= there: the blend meets the bands at both edges)",
            16,
            10000.0,
            _llama3_scaling(8.0, 8192 / (2 * math.pi / 10000.0 ** (-4 / 16)), 8192 / (2 * math.pi), 8192),
        ),
        _rope_case(
            "integers where floats are usual: rope_theta 500000, factor 8, low 1, high 4 (config.json may say so)",
            32,
            500000,
            _llama3_scaling(8, 1, 4, 8192),
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        head_dim = rng.choice([8, 16, 64, 128, 2 * rng.randint(3, 80)])
        theta = rng.choice([10000.0, 500000.0, 1000000.0, float(round(10 ** rng.uniform(3, 7)))])
        kind = ("llama3", "linear", None, "llama3", "default")[i % 5]
        if kind == "llama3":
            scaling = _random_llama3(rng, head_dim, theta)
        elif kind == "linear":
            scaling = _scaling("linear", factor=rng.choice([2.0, 4, 8.0, 1.5, 32.0]))
        else:
            scaling = None if kind is None else _scaling("default")
        cases.append(
            _rope_case(
                f"random #{i}: head_dim {head_dim}, rope_theta {theta:g}, {kind or 'None'}", head_dim, theta, scaling
            )
        )
    return cases


def _hf_rope_frequencies(head_dim: int, theta: float, scaling: Optional[dict]) -> Tensor:
    """transformers' speeds for this configuration (`ROPE_INIT_FUNCTIONS`, or its default RoPE), computed in
    float32, as a LlamaConfig of one head of head_dim gives them."""
    # transformers is heavy (seconds to import): only for the hidden comparison
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.utils import logging

    logging.set_verbosity_error()
    kind = (scaling or {}).get("rope_type", "default")
    original = (scaling or {}).get("original_max_position_embeddings", 2048)
    config = HFLlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=4 * original,
        rope_parameters={"rope_theta": float(theta), **(scaling or {}), "rope_type": kind},
    )
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0]


def hf_rope_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    """The exact speeds and how far transformers' float32 ones may be from them: 16 units of float32 rounding times
    (1 + ln θ) (θ ** x with x rounded to float32), times 1 + the blend's amplification in llama3's middle band
    (an error δ in smooth changes the speed by δ · (1 - 1/factor) · speed)."""
    head_dim, theta, scaling = args
    exact = P.rope_frequencies(head_dim, theta, copy.deepcopy(scaling))
    base = _speeds(head_dim, theta)
    amplification = torch.zeros_like(base)
    if (scaling or {}).get("rope_type") == "llama3":
        s = scaling
        old, low, high, factor = (
            s["original_max_position_embeddings"],
            s["low_freq_factor"],
            s["high_freq_factor"],
            s["factor"],
        )
        turns = old * base / (2 * math.pi)  # original / wavelength
        smooth = ((turns - low) / (high - low)).clamp(0, 1)
        amplification = turns / (high - low) * (1 - 1 / factor) / ((1 - smooth) / factor + smooth)
    return exact, 16 * 2.0**-24 * (1 + math.log(theta)) * (1 + amplification) * exact.abs()


def _hf_rope_of(case: Case) -> Optional[tuple[str, Tensor]]:
    if isinstance(case.args[0], LlamaRun):
        return None
    return "transformers' ROPE_INIT_FUNCTIONS (float32)", _hf_rope_frequencies(*copy.deepcopy(case.args))


ROPE_ERROR_HINTS = {
    "'NoneType' object": "rope_scaling is None for plain RoPE (most checkpoints): treat None like "
    '{"rope_type": "default"} (scaling = rope_scaling or {})',
    "KeyError: 'factor'": 'rope_type "default" (or None) has no factor: those speeds are unscaled',
    "KeyError: 'type'": 'the kind of scaling is under "rope_type"',
    "KeyError: 'original_max_position_embeddings'": 'read the llama3 keys only when rope_type is "llama3"',
}


def check_rope_frequencies(fn, *, seed: int = 0, n_random: int = 10, transformers: bool = False) -> None:
    """rope_frequencies(head_dim, rope_theta, rope_scaling) -> float64 [head_dim / 2]: pair i's speed
    1 / rope_theta ** (2i / head_dim), scaled as rope_scaling says — None or "default": as it is; "linear": divided
    by "factor"; "llama3": the slow pairs divided by factor, the fast ones kept, those in between blended — equal to
    the engine's (and to transformers' ROPE_INIT_FUNCTIONS, which compute in float32) within 1e-10 relative.
    The last cases run it in tiny Llamas whose configs carry rope_scaling (or not)."""
    cases = rope_frequencies_cases(seed, n_random) + engine_cases("rope_frequencies", seed)
    judge = _judge_rope_frequencies
    if transformers:
        judge = also_reference(
            judge,
            _hf_rope_of,
            hf_rope_accuracy,
            hint="rope_frequencies must equal transformers' for these configurations (llama3's bands: wavelength "
            "2π / speed against original / low_freq_factor and original / high_freq_factor)",
        )
    run, judge = with_llama_runs(fn, judge)

    run_check(
        "rope_frequencies",
        run,
        cases,
        judge=judge,
        forbid=[
            _engine("rope_frequencies"),
            Forbidden(
                "llmcourse.engine.positions.rope_inv_freq",
                "The engine's RoPE speeds are what yours are compared with: 1 / rope_theta ** (2i / head_dim), in "
                "float64.",
            ),
            *NO_TRANSFORMERS,
        ],
        error_hints=ROPE_ERROR_HINTS,
        show_call=lambda args: args[0].show() if isinstance(args[0], LlamaRun) else _show_rope_frequencies(args),
        seconds=10,
        total_seconds=60,
    )


# ----------------------------------------------------------------------------------------------
# The learner's part inside the engine: a tiny Llama (or Qwen2, Qwen3) with it in its slot

ENGINE_K = 16  # a whole model's logits: within 16·√C units of rounding of the largest |logit|
ENGINE_CONTRACT = (
    "the logits of a model may be off by 16·√C units of rounding of the weights' dtype (C = n_embd) times the "
    "largest |logit|"
)


def tiny_config(**changes):
    """A tiny Llama-family configuration: 2 layers, C 32, 4 query heads over 2 KV heads, head_dim 8."""

    settings = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48, n_positions=64, vocab_size=97)
    settings.update(changes)
    return LlamaConfig(**settings)


def lively_llama_state(config, *, seed: int = 0) -> dict[str, Tensor]:
    """Random weights (the engine's key names) under which every mistake shows: projections of spread 1/√C_in
    (twice transformers' initialization would be 0.02), no norm weight 1, biases not 0, token rows of spread 1."""

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in Llama(config).state_dict().items():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            value = 1 + 0.4 * torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            value = 0.3 * torch.randn(shape, generator=g)
        elif name == "embed_tokens.weight":
            value = torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) * 1.5 / math.sqrt(shape[-1])
        state[name] = value
    return state


def tiny_llama(config, *, seed: int = 0, dtype=f32, parts=None):

    model = Llama(config, parts)
    model.load_state_dict(lively_llama_state(config, seed=seed))
    return model.to(dtype).eval().requires_grad_(False)


class LlamaRun:
    """A tiny Llama-family model that runs with the learner's part in its slot (`guarded(Parts, part=fn)`, as
    `my_engine` installs it): a prompt prefilled into a KV cache, then decode steps one token at a time (its
    logits at every position); or greedy generation (its tokens). Prints as a short description."""

    def __init__(self, part: str, dtype: torch.dtype, seed: int, *, generate: bool = False, last_only=False, **config):
        self.part, self.dtype, self.seed, self.generate, self.last_only = part, dtype, seed, generate, last_only
        self.config = tiny_config(**config)
        self.model = tiny_llama(self.config, seed=seed, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(self.config.vocab_size, (2, 9), generator=g)
        ids[0, 0], ids[1, 3] = 0, self.config.vocab_size - 1  # the first and the last token of the vocabulary
        self.ids, self.prompt = ids, 5

    def __deepcopy__(self, memo):  # the check's snapshot of its arguments: nothing of it is the learner's to change
        return self

    def __repr__(self) -> str:
        c = self.config
        family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[c.model_type]
        tied = "tied" if c.tie_word_embeddings else "untied"
        rope = f", head_dim {c.head_dim}, rope_theta {c.rope_theta:g}" if c.rope_theta != 10000.0 else ""
        rope += f", rope_scaling {c.rope_scaling}" if c.rope_scaling else ""
        return (
            f"<tiny {family}: {c.n_layer} layers, C {c.n_embd}, {c.n_head} query heads over {c.n_kv_head} KV heads, "
            f"{tied} head, rms_norm_eps {c.rms_norm_eps:g}{rope}, {str(self.dtype)[6:]}>"
        )

    def show(self) -> str:
        what = (
            f"llmcourse.generate(model, prompt of {self.prompt} tokens, max_new_tokens=8) (greedy, KV cache)"
            if self.generate
            else f"model(ids[:, :{self.prompt}], cache=cache{', last_only=True' * self.last_only}), then "
            f"model(ids[:, t:t+1], cache=cache) for t = {self.prompt}..{self.ids.shape[1] - 1}"
        )
        return f"model = {self!r}; model.parts = guarded(Parts, {self.part}={self.part}); {what}"

    def run(self, fn: Callable) -> Any:

        model, before = self.model, self.model.parts
        model.parts = guarded(Parts, **{self.part: fn})
        try:
            with torch.no_grad():
                if self.generate:
                    return generate(model, self.ids[0, : self.prompt].tolist(), max_new_tokens=8)
                cache = model.new_cache(self.ids.shape[0], 16)
                out = [model(self.ids[:, : self.prompt], cache=cache, last_only=self.last_only)]
                for t in range(self.prompt, self.ids.shape[1]):
                    out.append(model(self.ids[:, t : t + 1], cache=cache))
                return torch.cat(out, dim=1)
        finally:
            model.parts = before

    def exact(self) -> Any:
        """The engine's own answer: logits in float64 from the same (rounded) weights, in one pass without a
        cache; or its greedy tokens in the run's dtype."""

        if self.generate:
            with torch.no_grad():
                return generate(self.model, self.ids[0, : self.prompt].tolist(), max_new_tokens=8)
        model = Llama(self.config)
        model.load_state_dict({k: v.double() for k, v in self.model.state_dict().items()})
        with torch.no_grad():
            logits = model.double().eval()(self.ids)
        if self.last_only:
            logits = logits[:, self.prompt - 1 :]
        return logits


def _engine_accuracy(run: LlamaRun) -> tuple[Tensor, Tensor]:
    exact = run.exact()
    allowed = ENGINE_K * _u(run.model.norm.weight) * math.sqrt(run.config.n_embd) * exact.abs().max()
    return exact, torch.full_like(exact, allowed.item())


def _near_tie(run: LlamaRun, got: Any, expected: list[int]) -> bool:
    """Whether greedy tokens `got` part from `expected` only where two tokens' logits are closer than rounding can
    tell apart (the first differing step's two candidates within the engine contract of each other, in float64)."""

    if not isinstance(got, list) or len(got) != len(expected) or not all(isinstance(t, int) for t in got):
        return False
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    if not 0 <= got[i] < run.config.vocab_size:
        return False
    model = Llama(run.config)
    model.load_state_dict({k: v.double() for k, v in run.model.state_dict().items()})
    ids = torch.tensor([run.ids[0, : run.prompt].tolist() + expected[:i]])
    with torch.no_grad():
        logits = model.double().eval()(ids)[0, -1]
    allowed = ENGINE_K * _u(run.model.norm.weight) * math.sqrt(run.config.n_embd) * logits.abs().max().item()
    return abs(logits[got[i]].item() - logits[expected[i]].item()) <= 2 * allowed


def _judge_engine(case: Case, got: Any) -> Verdict:
    run = case.args[0]
    if run.generate:
        if got == case.expected or _near_tie(run, got, case.expected):
            return None
        return (
            "the tokens differ from the engine's own",
            f"your {run.part} runs in every layer at every step: check it on the cases above (the cache holds "
            f"{run.config.n_kv_head} KV heads for {run.config.n_head} query heads)",
        )
    verdict = accuracy_judge(lambda args: _engine_accuracy(args[0]), ENGINE_CONTRACT)(case, got)
    if verdict is None or verdict[1] or not isinstance(got, Tensor) or got.shape != case.expected.shape:
        return verdict
    exact, allowed = _engine_accuracy(run)
    right = ((got.double() - exact).abs() <= allowed).flatten(2).all(-1).all(0)  # [positions]
    first = 1 if run.last_only else run.prompt
    if bool(right[:first].all()) and not bool(right[first:].all()):
        return verdict[0], (
            "the prompt's positions are right, the decode steps after it are not: a decode step sees the earlier "
            "positions only through the KV cache"
            + (
                ", which attend(q, k, v) fills: call attend rather than an attention of your own"
                if run.part == "llama_block"
                else " (your function gets the cache's filled part: a view)"
            )
        )
    return verdict


def llama_case(part: str, dtype: torch.dtype, seed: int, *, generate=False, last_only=False, **config) -> Case:
    run = LlamaRun(part, dtype, seed, generate=generate, last_only=last_only, **config)
    what = (
        "greedy generation with the KV cache: the engine's tokens"
        if generate
        else "a prompt into the KV cache, then decode steps: the engine's logits"
    )
    return Case(
        f"your {part} in the engine: {run!r}, {what}",
        (run,),
        later(lambda r: r.exact() if r.generate else r.exact().to(r.dtype), run),
        "the engine calls your part with its own tensors (float32, float16 or bfloat16, views among them) and needs "
        "the shape and dtype it gives back",
    )


def engine_cases(part: str, seed: int) -> list[Case]:
    """The cases that run `part` inside a tiny model, each chosen to reach what the part does there."""
    if part == "rms_norm":
        return [
            llama_case(part, f32, seed, rms_norm_eps=1e-3),
            llama_case(part, bf16, seed + 1, tie_word_embeddings=False, last_only=True),
            llama_case(part, f32, seed + 2, generate=True),
        ]
    if part == "swiglu":
        return [
            llama_case(part, f32, seed),
            llama_case(part, f16, seed + 1),
            llama_case(part, f32, seed + 2, generate=True),
        ]
    if part == "grouped_attention":
        return [
            llama_case(part, f32, seed, n_head=8, n_kv_head=2),
            llama_case(part, bf16, seed + 1, n_head=4, n_kv_head=1, tie_word_embeddings=False),
            llama_case(part, f32, seed + 2, n_head=4, n_kv_head=4),
            llama_case(part, f16, seed + 3, model_type="qwen3", qk_norm=True, head_dim=16, n_kv_head=2),
            llama_case(part, f32, seed + 4, generate=True, n_embd=48, n_head=6, n_kv_head=2),
        ]
    if part == "rope_frequencies":
        # head_dim 16, rope_theta 500 000: wavelengths 6.3, 32, 167, 860, 4440, ...: fast 2 pairs (< 1024 / 16),
        # 2 in between, 4 slow (> 1024): every band turns at the 9 positions the run reaches
        llama3 = dict(head_dim=16, rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0, 1.0, 16.0, 1024))
        return [
            llama_case(part, f32, seed, **llama3),
            llama_case(part, f32, seed + 1, rope_scaling=_scaling("linear", factor=4.0)),
            llama_case(part, f32, seed + 2, head_dim=16, rope_theta=1000000.0),
            llama_case(part, bf16, seed + 3, n_kv_head=1, **llama3),
            llama_case(part, f32, seed + 4, generate=True, **llama3),
        ]
    if part == "qk_norm":
        qwen3 = dict(model_type="qwen3", qk_norm=True, head_dim=16, rms_norm_eps=1e-6)
        return [
            llama_case(part, f32, seed, **qwen3),
            llama_case(part, bf16, seed + 1, **qwen3, n_kv_head=1),
            llama_case(part, f32, seed + 2, generate=True, **qwen3),
        ]
    if part == "llama_block":
        return [
            llama_case(part, f32, seed, rms_norm_eps=1e-3, rope_theta=500000.0),
            llama_case(part, f32, seed + 1, model_type="qwen3", qk_norm=True, head_dim=16, n_kv_head=1),
            llama_case(
                part, bf16, seed + 2, model_type="qwen2", attention_bias=True, tie_word_embeddings=False, n_kv_head=4
            ),
            llama_case(part, f32, seed + 3, generate=True, n_head=8, n_kv_head=2),
        ]
    raise ValueError(part)


def with_llama_runs(fn: Callable, judge: Callable) -> tuple[Callable, Callable]:
    """(the function a check runs, its judge) for a part whose cases include `llama_case`s: those install `fn` in
    the tiny model and run it; the others call `fn` as they are."""

    def run(*args):
        if args and isinstance(args[0], LlamaRun):
            return args[0].run(fn)
        return fn(*args)

    try:
        run = functools.wraps(fn)(run)
    except (AttributeError, TypeError):
        pass

    def both(case: Case, got: Any) -> Verdict:
        return (_judge_engine if isinstance(case.args[0], LlamaRun) else judge)(case, got)

    return run, both


# ----------------------------------------------------------------------------------------------
# The Llama block


class Rotation:
    """`rope` as the engine passes it to a block: queries or keys [B, heads, T, D] rotated for this forward's
    positions (chapter 02's RoPE, half-split). Works in the dtype of what it rotates."""

    def __init__(self, position_ids: Tensor, theta: float):
        self.position_ids, self.theta = position_ids, theta

    def __call__(self, t: Tensor) -> Tensor:
        return P.rope(t, self.position_ids, self.theta)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        first, last = int(self.position_ids.min()), int(self.position_ids.max())
        return f"<rope: positions {first}..{last}, theta {self.theta:g}>"


class Attend:
    """`attend` as the engine passes it to a block: q [B, H, T, D], k and v [B, H_kv, T, D] -> [B, H, T, D], causal,
    each KV head read once for its query heads (`grouped_attention`; the engine also stores k and v in its cache
    here)."""

    def __init__(self, n_rep: int):
        self.n_rep = n_rep

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if k.shape[1] * self.n_rep != q.shape[1] or v.shape != k.shape:
            raise ValueError(
                f"attend(q, k, v) got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q has n_head heads, "
                f"k and v n_kv_head heads each (n_head = {self.n_rep} · n_kv_head here), all [B, heads, T, head_dim]"
            )
        return P.grouped_attention(q, k, v, None, P.attention)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"<attend: causal attention, each KV head serving {self.n_rep} query heads>"


class BlockLayer:
    """One decoder layer's weights (a `llmcourse.engine.llama.Layer`), printed as a short label."""

    def __init__(self, layer, label: str):
        self.layer, self.label = layer, label

    def __getattr__(self, name):
        return getattr(self.__dict__["layer"], name)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return self.label


def reference_block(x, layer, config, rope, attend, parts=None):
    """The engine's block with the engine's parts."""

    return P.llama_block(x, layer, config, rope, attend, Parts())


def _exact_block(args: tuple) -> Tensor:
    """The engine's block in float64 (weights, x, rotation and attention) from the same rounded values."""

    x, layer, config, rope, attend, parts = args
    wide = copy.deepcopy(getattr(layer, "layer", layer)).double()
    return reference_block(x.double(), wide, config, rope, attend)


def _rmsn(x, w, config):
    return P.rms_norm(x, w, config.rms_norm_eps)


def _attn_out(h, layer, config, rope, attend, *, norm_qk=True, rope_first=False, rope_v=False, o_proj=True, bias=True):
    p, a = P, layer.self_attn

    def project(module):  # without bias: h @ weight.T alone
        return module(h, p.linear) if bias else h @ module.weight.T

    q = p.split_heads(project(a.q_proj), config.n_head)
    k = p.split_heads(project(a.k_proj), config.n_kv_head)
    v = p.split_heads(project(a.v_proj), config.n_kv_head)
    if rope_first:
        q, k = rope(q), rope(k)
    if config.qk_norm and norm_qk:
        q, k = p.qk_norm(q, k, a.q_norm.weight, a.k_norm.weight, config.rms_norm_eps)
    if not rope_first:
        q, k = rope(q), rope(k)
    if rope_v:
        v = rope(v)
    out = p.merge_heads(attend(q, k, v))
    return a.o_proj(out, p.linear) if o_proj else out


def _mlp_out(h, layer, *, act=None, swap=False):
    m = layer.mlp
    gate, up = m.gate_proj(h, P.linear), m.up_proj(h, P.linear)
    if swap:
        gate, up = up, gate
    hidden = act(gate, up) if act is not None else P.swiglu(gate, up)
    return m.down_proj(hidden, P.linear)


def _block(
    x,
    layer,
    config,
    rope,
    attend,
    parts=None,
    *,
    post_norm=False,
    attn_residual=True,
    mlp_residual=True,
    second_norm_on_input=False,
    one_norm=False,
    parallel=False,
    eps=None,
    act=None,
    swap=False,
    **attn,
):
    if eps is not None:
        config = dataclasses.replace(config, rms_norm_eps=eps)
    w1, w2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
    if one_norm:
        w2 = w1
    if post_norm:
        x = _rmsn(x + _attn_out(x, layer, config, rope, attend, **attn), w1, config)
        return _rmsn(x + _mlp_out(x, layer, act=act, swap=swap), w2, config)
    a = _attn_out(_rmsn(x, w1, config), layer, config, rope, attend, **attn)
    h = _rmsn(x if (second_norm_on_input or parallel) else (x + a if attn_residual else a), w2, config)
    y = (x + a) if attn_residual else a
    if parallel:
        y = x + a
    m = _mlp_out(h, layer, act=act, swap=swap)
    return y + m if mlp_residual else m


def _gelu_mlp(gate, up):
    return F.gelu(up, approximate="tanh")


BLOCK_MISTAKES = [
    (
        lambda *a: _block(*a, post_norm=True),
        "Llama is pre-norm: normalize the input of each sub-layer and add its output to the unnormalized x — "
        "x = x + attn(rms_norm(x)); x = x + mlp(rms_norm(x)) — not rms_norm(x + attn(x))",
    ),
    (
        lambda *a: _block(*a, rope_first=True),
        "QK-norm comes before RoPE: normalize q and k (qk_norm), then rotate them (rope); rotating first normalizes "
        "rotated vectors with q_norm's weight, which is not what the model was trained with",
    ),
    (
        lambda *a: _block(*a, attn_residual=False),
        "add the attention's output to x (the residual connection): x = x + o_proj(merge_heads(attend(...)))",
    ),
    (lambda *a: _block(*a, mlp_residual=False), "add the MLP's output to x too: return x + down_proj(...)"),
    (
        lambda *a: _block(*a, act=_gelu_mlp),
        "Llama's MLP is SwiGLU, not GPT-2's GELU MLP: down_proj(swiglu(gate_proj(h), up_proj(h)))",
    ),
    (
        lambda *a: _block(*a, swap=True),
        "silu goes on gate_proj's output: swiglu(gate_proj(h), up_proj(h)), in that order",
    ),
    (
        lambda *a: _block(*a, second_norm_on_input=True),
        "post_attention_layernorm normalizes the stream *after* the attention was added: x = x + attn(...); "
        "then h = rms_norm(x, post_attention_layernorm.weight) with that new x",
    ),
    (
        lambda *a: _block(*a, one_norm=True),
        "two norms, each with its weight: input_layernorm before attention, post_attention_layernorm before the MLP",
    ),
    (lambda *a: _block(*a, rope_v=True), "RoPE rotates queries and keys only, not the values"),
    (
        lambda *a: _block(*a, norm_qk=False),
        "when config.qk_norm is true (Qwen3), normalize q and k with parts.qk_norm(q, k, q_norm.weight, "
        "k_norm.weight, eps) before RoPE",
    ),
    (lambda *a: _block(*a, o_proj=False), "project the merged heads with self_attn.o_proj before adding them to x"),
    (
        lambda *a: _block(*a, bias=False),
        "call each projection as a module, layer.self_attn.q_proj(h, parts.linear): Qwen2's q, k and v have biases, "
        "which it adds (h @ weight.T alone leaves them out)",
    ),
    (
        lambda *a: _block(*a, eps=1e-6),
        "pass config.rms_norm_eps to every norm: a model's eps is not always the same (1e-5 Llama, 1e-6 Qwen)",
    ),
    (
        lambda *a: _block(*a, eps=1e-5),
        "pass config.rms_norm_eps to every norm: a model's eps is not always the same (1e-5 Llama, 1e-6 Qwen)",
    ),
]

# Contract: each output within 16·√C units of rounding of x's dtype times the largest value that goes in or comes
# out (the norms in float32, attention and the MLP in x's dtype, in any correct order of operations).
BLOCK_K = 16
BLOCK_CONTRACT = (
    "llama_block may be off by 16·√C units of rounding of x's dtype (of float32 for float64: the norms are computed "
    "in float32) times the largest |value| of x and of the answer"
)


def block_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x = args[0]
    exact = _exact_block(args)
    size = max(x.detach().double().abs().max().item(), exact.abs().max().item())
    u = max(_u(x), U32)  # the norms are computed in float32 (the engine's and transformers'), float64 x too
    return exact, torch.full_like(exact, BLOCK_K * u * math.sqrt(x.shape[-1]) * size)


def block_case(description: str, seed: int, B: int, T: int, dtype=f32, *, start: int = 0, hint: str = "", **config):
    """x [B, T, C] and one layer of a tiny model of this configuration, positions start..start+T-1 (a decode step
    at an offset, or a prefill)."""

    cfg = tiny_config(n_layer=1, **config)
    model = tiny_llama(cfg, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 7)
    x = (torch.randn(B, T, cfg.n_embd, generator=g, dtype=f64) * 2).to(dtype)
    positions = (start + torch.arange(T)).expand(B, T)
    label = (
        f"<layer of a tiny {cfg.model_type}: C {cfg.n_embd}, {cfg.n_head} query heads over {cfg.n_kv_head} KV heads, "
        f"head_dim {cfg.head_dim}{', q_norm and k_norm' * cfg.qk_norm}{', q/k/v biases' * cfg.attention_bias}, "
        f"{str(dtype)[6:]}>"
    )
    args = (x, BlockLayer(model.layers[0], label), cfg, Rotation(positions, cfg.rope_theta), Attend(cfg.n_rep), Parts())
    return Case(description, args, later(reference_block, *args), hint)


def _show_block(args: tuple) -> str:
    x, layer, config, rope, attend, parts = args
    c = config
    shown = (
        f"LlamaConfig(n_head={c.n_head}, n_kv_head={c.n_kv_head}, head_dim={c.head_dim}, "
        f"rms_norm_eps={c.rms_norm_eps:g}, qk_norm={c.qk_norm}, ...)"
    )
    return (
        f"llama_block(x={_desc(x)}, layer={layer!r}, config={shown}, rope={rope!r}, attend={attend!r}, parts=Parts())"
    )


def block_cases(seed: int, n_random: int) -> list[Case]:
    cases = [
        block_case("one position (T = 1) at position 0", seed, 1, 1),
        block_case("x [1, 4, 32]: 4 query heads over 2 KV heads", seed + 1, 1, 4),
        block_case(
            "a batch of 2, 5 positions, rms_norm_eps 1e-3",
            seed + 2,
            2,
            5,
            rms_norm_eps=1e-3,
            hint="both norms use config.rms_norm_eps",
        ),
        block_case(
            "Qwen3: q_norm and k_norm, head_dim 16 (not n_embd / n_head)",
            seed + 3,
            2,
            4,
            model_type="qwen3",
            qk_norm=True,
            head_dim=16,
            rms_norm_eps=1e-6,
            hint="with config.qk_norm, parts.qk_norm(q, k, ...) runs on the split heads, before rope",
        ),
        block_case(
            "Qwen2: biases on q, k and v; as many KV heads as query heads",
            seed + 4,
            1,
            3,
            model_type="qwen2",
            attention_bias=True,
            n_kv_head=4,
        ),
        block_case("one KV head for 4 query heads (multi-query attention)", seed + 5, 2, 3, n_kv_head=1),
        block_case("a decode step: one position at position 37", seed + 6, 2, 1, start=37, rope_theta=500000.0),
        block_case(
            "C 256, 8 query heads over 2 KV heads (head_dim 32), 20 positions",
            seed + 10,
            1,
            20,
            n_embd=256,
            n_head=8,
            n_kv_head=2,
            intermediate_size=512,
        ),
        block_case("float64", seed + 7, 1, 4, f64, hint="float64 in, float64 out"),
        block_case("float16", seed + 8, 2, 3, f16, hint="float16 in, float16 out"),
        block_case("bfloat16, Qwen3", seed + 9, 1, 5, bf16, model_type="qwen3", qk_norm=True, head_dim=16),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        family = rng.choice(["llama", "qwen2", "qwen3"])
        n_kv = rng.choice([1, 2, 4])
        extra = dict(model_type=family, n_kv_head=n_kv, rms_norm_eps=rng.choice([1e-5, 1e-6, 1e-3]))
        if family == "qwen3":
            extra.update(qk_norm=True, head_dim=rng.choice([8, 16]))
        if family == "qwen2":
            extra.update(attention_bias=True)
        dtype = (f32, f64, bf16, f32, f16)[i % 5]
        cases.append(
            block_case(
                f"random #{i}: {family}, {n_kv} KV heads, {str(dtype)[6:]}",
                seed + 20 + i,
                rng.randint(1, 2),
                rng.randint(1, 6),
                dtype,
                start=rng.choice([0, 0, 9]),
                **extra,
            )
        )
    return cases


def _hf_layer(config, layer):
    """transformers' decoder layer of this family with the same weights (float64)."""
    # transformers is heavy (seconds to import): only for the hidden comparison
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    kind = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[config.model_type]
    hf_config = getattr(transformers, f"{kind}Config")(
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        num_hidden_layers=1,
        vocab_size=config.vocab_size,
    )
    hf_config._attn_implementation = "sdpa"
    module = __import__(f"transformers.models.{config.model_type}.modeling_{config.model_type}", fromlist=["x"])
    hf = getattr(module, f"{kind}DecoderLayer")(hf_config, 0)
    hf.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    rotary = getattr(module, f"{kind}RotaryEmbedding")(hf_config)
    return hf.double().eval(), rotary


def _hf_block_of(case: Case) -> Optional[tuple[str, Tensor]]:
    """transformers' decoder layer of the family (float64, the same weights) on a prefill case; None elsewhere."""
    if isinstance(case.args[0], LlamaRun):
        return None
    x, layer, config, rope, attend, parts = case.args
    if int(rope.position_ids.min()) > 0:  # a decode step: transformers needs the past keys for causality;
        return None  # one query attends to itself only here, so the engine's comparison suffices
    hf, rotary = _hf_layer(config, getattr(layer, "layer", layer))
    X = x.double()
    with torch.no_grad():
        theirs = hf(X, position_embeddings=rotary(X, rope.position_ids), position_ids=rope.position_ids)
    return f"transformers' {type(hf).__name__}", theirs


BLOCK_ERROR_HINTS = {
    **VIEW_HINTS,
    "attend(q, k, v) got": "attend takes the keys and values as split_heads gives them, config.n_kv_head heads each "
    "(split_heads(k_proj(h), config.n_kv_head)), and the queries with config.n_head: it stores k and v in the cache "
    "and groups the query heads per KV head itself (no repeat_kv in the block)",
}


def check_llama_block(fn, *, seed: int = 0, n_random: int = 4, transformers: bool = False) -> None:
    """llama_block(x, layer, config, rope, attend, parts): one pre-norm Llama decoder layer, x [B, T, C] -> [B, T, C]
    in x's dtype, made of `parts`' functions (as the engine calls it: its own parts, or the learner's), for Llama,
    Qwen2 (q/k/v biases) and Qwen3 (QK-norm) layers. The last cases run it as every layer of a tiny model."""
    cases = block_cases(seed, n_random) + engine_cases("llama_block", seed)
    judge = accuracy_judge(block_accuracy, BLOCK_CONTRACT, BLOCK_MISTAKES)
    if transformers:
        judge = also_reference(judge, _hf_block_of, block_accuracy)
    run, judge = with_llama_runs(unwritten_helper(fn), judge)
    run_check(
        "llama_block",
        run,
        cases,
        judge=judge,
        forbid=[_engine("llama_block"), *NO_TRANSFORMERS],
        show_call=lambda args: args[0].show() if isinstance(args[0], LlamaRun) else _show_block(args),
        error_hints=BLOCK_ERROR_HINTS,
        may_modify=(1, 2, 3, 4, 5),  # the engine's objects (its cache fills in attend); x must stay as it was
        seconds=10,
        total_seconds=90,
    )


# ----------------------------------------------------------------------------------------------
# Loading a Llama-family checkpoint


def _write(folder: Path, config: dict, tensors: dict[str, Tensor], shards: int = 1) -> Path:
    """A checkpoint folder as save_pretrained writes it: config.json and model.safetensors, or `shards` files
    model-0000i-of-0000n.safetensors listed in model.safetensors.index.json."""

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return folder


def _hf_save_pretrained(folder: Path, config, state: dict, *, max_shard_size=None) -> Path:
    """What transformers' save_pretrained writes for a model of this configuration with these weights."""
    # transformers is heavy (seconds to import): only for the hidden comparison
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    raw = config.to_dict()
    kind = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[config.model_type]
    hf_config = getattr(transformers, f"{kind}Config")(**{k: v for k, v in raw.items() if k != "architectures"})
    model = getattr(transformers, f"{kind}ForCausalLM")(hf_config)
    weights = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in state.items()}
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if max_shard_size is None:
            model.save_pretrained(folder)
        else:
            model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def checkpoint_folders(root: Path, *, seed: int = 0, transformers: bool = False) -> list[tuple[str, Path]]:
    """Llama-family checkpoint folders in every layout they come in, with random weights: (description, folder).
    Tied and untied heads, Qwen2's biases, Qwen3's QK-norms, shards with an index, the rotary inv_freq buffers of
    old checkpoints, 11 layers (two-digit keys), files in float16, bfloat16 and float32, and other *.safetensors files
    beside the weights that are not the model's (see `_folders_with_strays`)."""
    out = []

    def prefixed(state):
        return {("" if k == "lm_head.weight" else "model.") + k: v for k, v in state.items()}

    llama_tied = tiny_config(tie_word_embeddings=True)
    state = lively_llama_state(llama_tied, seed=seed)
    out.append(
        (
            "Llama, tied head (tie_word_embeddings true): no lm_head.weight in the file",
            _write(root / "llama-tied", llama_tied.to_dict(), prefixed(state)),
        )
    )
    untied = tiny_config(tie_word_embeddings=False, n_kv_head=1)
    state = lively_llama_state(untied, seed=seed + 1)
    raw = {k: v for k, v in untied.to_dict().items() if k != "tie_word_embeddings"}  # absent: untied
    out.append(
        (
            "Llama stored in float16, untied head (config.json without tie_word_embeddings: transformers' default, "
            "false): lm_head.weight is a weight of its own",
            _write(root / "llama-untied", raw, {k: v.half() for k, v in prefixed(state).items()}),
        )
    )
    qwen2 = tiny_config(model_type="qwen2", attention_bias=True, tie_word_embeddings=False, n_kv_head=4)
    state = lively_llama_state(qwen2, seed=seed + 2)
    out.append(
        (
            "Qwen2 (q, k and v have biases), stored in bfloat16, in 3 shards listed by model.safetensors.index.json",
            _write(root / "qwen2-sharded", qwen2.to_dict(), {k: v.bfloat16() for k, v in prefixed(state).items()}, 3),
        )
    )
    qwen3 = tiny_config(model_type="qwen3", qk_norm=True, head_dim=16, rms_norm_eps=1e-6)
    state = lively_llama_state(qwen3, seed=seed + 3)
    both = {**prefixed(state), "lm_head.weight": state["embed_tokens.weight"].clone()}
    out.append(
        (
            "Qwen3 (q_norm, k_norm), tied, but the file stores lm_head.weight too",
            _write(root / "qwen3-tied-with-head", qwen3.to_dict(), both),
        )
    )
    old = tiny_config(n_layer=11, n_embd=16, n_head=2, n_kv_head=1, intermediate_size=16, tie_word_embeddings=False)
    state = lively_llama_state(old, seed=seed + 4)
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(4) for i in range(old.n_layer)}
    out.append(
        (
            "an older Llama: 11 layers (keys layers.10.*), the rotary buffers model.layers.N.self_attn.rotary_emb."
            "inv_freq stored, 2 shards",
            _write(root / "llama-old-style", old.to_dict(), {**prefixed(state), **buffers}, 2),
        )
    )
    out += _folders_with_strays(root, prefixed, seed=seed)
    if transformers:
        llama = tiny_config(tie_word_embeddings=False, n_kv_head=1)
        out.append(
            (
                "as transformers' save_pretrained writes a LlamaForCausalLM (untied head)",
                _hf_save_pretrained(root / "hf-llama", llama, lively_llama_state(llama, seed=seed + 5)),
            )
        )
        qwen3 = tiny_config(model_type="qwen3", qk_norm=True, head_dim=16, tie_word_embeddings=True)
        out.append(
            (
                "as transformers' save_pretrained writes a Qwen3ForCausalLM (tied head), in shards of 20 kB",
                _hf_save_pretrained(
                    root / "hf-qwen3", qwen3, lively_llama_state(qwen3, seed=seed + 6), max_shard_size="20KB"
                ),
            )
        )
        qwen2 = tiny_config(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
        out.append(
            (
                "as transformers' save_pretrained writes a Qwen2ForCausalLM (biases, tied head)",
                _hf_save_pretrained(root / "hf-qwen2", qwen2, lively_llama_state(qwen2, seed=seed + 7)),
            )
        )
    return out


# Meta's (and Mistral's) own names for a Llama's tensors, as their consolidated files store them
META_NAMES = [
    (r"^embed_tokens\.", "tok_embeddings."),
    (r"\.self_attn\.([qkvo])_proj\.", r".attention.w\1."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"^lm_head\.", "output."),
]


def _meta_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    renamed = {}
    for key, tensor in state.items():
        for pattern, replacement in META_NAMES:
            key = re.sub(pattern, replacement, key)
        renamed[key] = tensor
    return renamed


def _folders_with_strays(root: Path, prefixed: Callable, *, seed: int) -> list[tuple[str, Path]]:
    """Folders with *.safetensors files beside the weights that are not the model's: the original consolidated file
    Mistral's Hub repositories ship beside transformers' shards; a shard left over from an earlier save into 3 files
    (the weights' own names, stale values), not in the index; a LoRA adapter beside model.safetensors. The model is
    model.safetensors, else the shards the index lists (the engine's rule)."""
    config = tiny_config(model_type="mistral", tie_word_embeddings=False, n_kv_head=1)
    state = lively_llama_state(config, seed=seed + 8)
    consolidated = add_stray_file(
        _write(root / "mistral-with-consolidated", config.to_dict(), prefixed(state), 2),
        "consolidated.safetensors",
        _meta_names(state),
    )
    config = tiny_config(tie_word_embeddings=True)
    state = lively_llama_state(config, seed=seed + 9)
    stale = {k: v + 1 for k, v in prefixed(state).items() if ".layers.1." in k}
    leftover = add_stray_file(
        _write(root / "llama-with-old-shard", config.to_dict(), prefixed(state), 2),
        "model-00003-of-00003.safetensors",
        stale,
    )
    config = tiny_config(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    state = lively_llama_state(config, seed=seed + 10)
    rank = 2
    lora = {}
    for i in range(config.n_layer):
        stem = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        lora[f"{stem}.lora_A.weight"] = torch.randn(rank, config.n_embd)
        lora[f"{stem}.lora_B.weight"] = torch.randn(config.n_head * config.head_dim, rank)
    adapter = add_stray_file(
        _write(root / "qwen2-with-adapter", config.to_dict(), prefixed(state)), "adapter_model.safetensors", lora
    )
    return [
        (
            "Mistral in 2 shards listed by the index, beside consolidated.safetensors (the same weights under "
            "Mistral's own names: layers.0.attention.wq.weight, ...), as Mistral's Hub repositories ship it: the "
            "model is what the index lists",
            consolidated,
        ),
        (
            "Llama in 2 shards listed by the index, beside model-00003-of-00003.safetensors, left over from an "
            "earlier save into 3 shards (the index does not list it)",
            leftover,
        ),
        (
            "Qwen2, model.safetensors beside a LoRA adapter, adapter_model.safetensors: the model is "
            "model.safetensors alone",
            adapter,
        ),
    ]


def reference_checkpoint(folder) -> tuple[dict[str, Tensor], dict]:
    """What the engine's loader reads: (state dict with the engine's key names, config.json as a dict)."""

    return load_llama_checkpoint(folder)


class LoaderRun:
    """A checkpoint folder that the engine loads with the learner's loader and generates from (greedy, 8 tokens)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"'…/{self.folder.name}'"

    @staticmethod
    def generate(state: dict, raw: dict) -> list[int]:

        config = LlamaConfig.from_dict(raw)
        model = Llama(config)
        model.load_state_dict({k: v.float() for k, v in state.items()})
        with torch.no_grad():
            return generate(model.eval(), [1, 2, 3], max_new_tokens=8)

    def run(self, fn: Callable) -> Any:
        out = fn(str(self.folder))
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], dict)):
            return out  # the judge says what is wrong with it
        try:
            return self.generate(*out)
        except Exception as err:
            return _LoadFailed(raised(err).removeprefix("raised "))


class _LoadFailed(str):
    pass


def _judge_checkpoint(case: Case, got: Any) -> Verdict:
    verdict = _checkpoint_problem(case, got)
    if verdict is None or isinstance(case.args[0], LoaderRun):
        return verdict
    if isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], dict):
        stray = stray_files_hint(case.args[0], got[0], case.expected[0], ("model.",))
        if stray:
            return verdict[0], stray
    return verdict


def _checkpoint_problem(case: Case, got: Any) -> Verdict:
    if isinstance(case.args[0], LoaderRun):
        if isinstance(got, _LoadFailed):
            return f"the engine could not load your state dict: {got}", "run the cases above first"
        if got == case.expected:
            return None
        return "the engine's greedy tokens from your weights differ from its own", ""
    expected_sd, expected_config = case.expected
    folder = Path(case.args[0])
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (state_dict, config), got {short(got, 80)}", "return state_dict, config"
    sd, config = got
    if not isinstance(sd, dict):
        return f"the state dict should be a dict {{name: tensor}}, got a {type(sd).__name__}", ""
    tied = expected_config.get("tie_word_embeddings", False)
    for key in sd:
        if key not in expected_sd:
            if key.startswith("model."):
                hint = (
                    "drop the prefix 'model.': the engine's keys are 'embed_tokens.weight', "
                    "'layers.0.self_attn.q_proj.weight', ..., 'norm.weight' (and 'lm_head.weight', which has none)"
                )
            elif key.endswith("rotary_emb.inv_freq"):
                hint = (
                    "drop the rotary_emb.inv_freq buffers: they are RoPE's speeds, computed from the config, not "
                    "weights (older checkpoints stored them)"
                )
            elif key == "lm_head.weight" and tied:
                hint = (
                    "tie_word_embeddings is true in config.json: the head is embed_tokens.weight itself, so drop "
                    "lm_head.weight when the file stores it"
                )
            else:
                hint = "keep only the model's weights, renamed without 'model.'"
            return f"unexpected key {key!r}", hint
    missing = [k for k in expected_sd if k not in sd]
    if missing:
        if missing[0] == "lm_head.weight":
            hint = (
                "this model's head is untied (tie_word_embeddings false or absent in config.json): keep "
                "lm_head.weight, a matrix of its own"
            )
        elif (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").is_file():
            hint = (
                "this checkpoint is sharded: model.safetensors.index.json's weight_map names the file of every "
                "tensor; read each of those files (once) and take the tensors of all of them"
            )
        elif any(re.match(r"layers\.\d\d", k) for k in missing):
            hint = "every layer's tensors: layer numbers may have two digits (\\d+ in a regular expression, not \\d)"
        else:
            hint = "every tensor of the files, renamed without 'model.'"
        return f"the key {missing[0]!r} is missing ({len(missing)} missing in all)", hint
    return tensors_and_config_problem(
        sd,
        config,
        expected_sd,
        expected_config,
        layout="the weights keep nn.Linear's layout [C_out, C_in], as stored: no transpose",
        dtype=(
            " (as stored)",
            "keep every tensor in the dtype the file stores (float16, bfloat16, ...): the model converts them "
            "to the dtype it runs in, and a 16-bit checkpoint converted to float32 takes twice the memory",
        ),
        copy="copy the tensors as they are in the files",
    )


def _show_loader(args: tuple) -> str:
    if isinstance(args[0], LoaderRun):
        return (
            f"state, config = load_llama_checkpoint({args[0]!r}); model = Llama(LlamaConfig.from_dict(config)); "
            "model.load_state_dict(state); llmcourse.generate(model, [1, 2, 3], max_new_tokens=8)"
        )
    return f"load_llama_checkpoint({type(args[0]).__name__} '…/{Path(args[0]).name}')"


def check_load_llama_checkpoint(fn, *, seed: int = 0, transformers: bool = False) -> None:
    """load_llama_checkpoint(folder) -> (state dict with the engine's key names — transformers' without 'model.',
    lm_head.weight only for an untied head, no rotary inv_freq buffers — each tensor in its stored dtype, and
    config.json as a dict), for one file or shards with an index. The last cases load models with it and generate."""
    root = Path(tempfile.mkdtemp(prefix="llama-checkpoints-"))
    try:
        cases = []
        folders = checkpoint_folders(root, seed=seed, transformers=transformers)
        for n, (description, folder) in enumerate(folders):
            argument = str(folder) if n % 2 else folder  # a str or a pathlib.Path
            cases.append(Case(f"a checkpoint: {description}", (argument,), later(reference_checkpoint, folder)))
        for description, folder in (folders[2], folders[3]):
            state, raw = reference_checkpoint(folder)
            cases.append(
                Case(
                    f"your loader in the engine: {description.split(',')[0]}, greedy tokens",
                    (LoaderRun(folder),),
                    later(LoaderRun.generate, state, raw),
                    "the engine builds the model from your config and loads your state dict into it",
                )
            )

        def run(*args):
            return args[0].run(fn) if isinstance(args[0], LoaderRun) else fn(*args)

        run_check(
            "load_llama_checkpoint",
            run,
            cases,
            judge=_judge_checkpoint,
            forbid=[
                *NO_TRANSFORMERS,
                Forbidden(
                    "llmcourse.engine.checkpoints",
                    "The engine's loader is what yours is compared with: read the files yourself (json and "
                    "safetensors.torch.load_file).",
                ),
                Forbidden(
                    "llmcourse.engine.loading",
                    "The engine's loader is what yours is compared with: read the files yourself (json and "
                    "safetensors.torch.load_file).",
                ),
            ],
            show_call=_show_loader,
            error_hints={
                "KeyError: 'tie_word_embeddings'": "config.json may leave tie_word_embeddings out: then the head is "
                "untied (transformers' default for these families): config.get('tie_word_embeddings', False)",
                "model.safetensors": "a sharded checkpoint has no model.safetensors: read model.safetensors.index.json "
                "(its weight_map names the file of every tensor) and load every file it names",
            },
            seconds=20,
            total_seconds=90,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
