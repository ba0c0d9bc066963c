"""Checks for chapter 04, the transformer block and GPT-2: layer norm, GELU, the Conv1D linear layer,
the MLP, the pre-LN block, the full forward pass, and loading a Hugging Face checkpoint.

Each check compares the learner's function with the engine's (`llmcourse.parts`, `llmcourse.GPT2`,
`llmcourse.loading`) on fixed edge cases and seeded random inputs: batch > 1, float64, values far from
0 and from their mean, square weights, 12 layers. Expected tensors are computed in float64 and cast
to the input's dtype. When an answer is wrong, the message also says what was probably done wrong,
found by comparing the answer with known mistakes computed on the same input (unbiased variance, eps
outside the root, GELU's erf form, a transposed weight, post-LN, an untied head, ...).

    >>> import torch
    >>> def gelu(x):
    ...     return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    >>> check_gelu(gelu)
    ✓ gelu — 14 cases

The engine's own functions are the black boxes: passing `llmcourse.parts.gelu` itself fails.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import parts as P
from ..config import GPT2Config
from ..model import GPT2
from .core import Case, Verdict, run_check, unwritten_helper
from .forbid import Forbidden
from .show import short
from .tensors import in_float64, same_answer, tensor_judge, tensor_problem

# ----------------------------------------------------------------------------------------------
# Black boxes

_OWN = "Write it yourself with tensor operations (+, *, @, mean, sqrt, tanh, ...)."
ENGINE_PARTS = [Forbidden(f"llmcourse.parts.{name}", "The engine's version is the black box here: use your own "
                          f"`{name}` from this chapter.") for name in ("layer_norm", "gelu", "linear")]
NO_LAYER_NORM = [
    Forbidden("torch.nn.functional.layer_norm", f"F.layer_norm is the black box this exercise opens. {_OWN}"),
    Forbidden("torch.native_layer_norm", f"torch's layer norm kernel is the black box here. {_OWN}"),
    Forbidden("torch.nn.functional.group_norm", f"A group norm with one group is a layer norm in disguise. {_OWN}"),
    Forbidden("torch.nn.functional.instance_norm", f"Another normalization layer is a black box here. {_OWN}"),
    Forbidden("torch.nn.functional.batch_norm", f"Another normalization layer is a black box here. {_OWN}"),
]
NO_GELU = [Forbidden("torch.nn.functional.gelu", f"F.gelu (and nn.GELU) is the black box this exercise opens. {_OWN}")]
NO_LIBRARIES = [
    Forbidden("transformers", "transformers' GPT-2 is what your code is compared with: build it from your own parts."),
    Forbidden("llmcourse.model", "The engine's GPT2 is what your code is compared with: build it from your own parts."),
    Forbidden("llmcourse.loading", "The engine's loader is what your code is compared with: read the files yourself "
                                   "(json and safetensors.torch.load_file)."),
]
COMPOSED = [*ENGINE_PARTS, *NO_LAYER_NORM, *NO_GELU, *NO_LIBRARIES]


# ----------------------------------------------------------------------------------------------
# Comparing tensors, and guessing the mistake


def _desc(t: Tensor) -> str:
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32) -> Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------------
# Layer norm


def _layer_norm_unbiased(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + eps) * weight + bias


def _layer_norm_eps_outside(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False).sqrt() + eps) * weight + bias


def _layer_norm_no_eps(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) / x.var(-1, keepdim=True, unbiased=False).sqrt() * weight + bias


def _layer_norm_no_bias(x, weight, bias, eps):
    return P.layer_norm(x, weight, torch.zeros_like(bias), eps)


def _layer_norm_no_weight(x, weight, bias, eps):
    return P.layer_norm(x, torch.ones_like(weight), bias, eps)


def _layer_norm_one_pass(x, weight, bias, eps):
    var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + eps) * weight + bias


def _layer_norm_dim1(x, weight, bias, eps):
    if x.dim() < 3:
        raise ValueError
    mean, var = x.mean(1, keepdim=True), x.var(1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


LAYER_NORM_MISTAKES = [
    (_layer_norm_unbiased, "use the biased variance, mean((x - mean)²) over the C features, as GPT-2 does: x.var(-1, unbiased=False); "
     "torch's var() divides by C - 1 by default"),
    (_layer_norm_eps_outside, "eps goes inside the square root: (x - mean) / sqrt(var + eps), not / (sqrt(var) + eps)"),
    (_layer_norm_no_eps, "add eps to the variance before the square root: it matters when the variance is small"),
    (_layer_norm_no_bias, "after normalizing, scale by weight and shift by bias: x̂ * weight + bias"),
    (_layer_norm_no_weight, "after normalizing, scale by weight and shift by bias: x̂ * weight + bias"),
    (_layer_norm_one_pass, "mean(x²) - mean(x)² loses all precision when the values are far from their mean (here around 1000): "
     "subtract the mean first, then average the squares"),
    (_layer_norm_dim1, "normalize over the last dimension (the C features of each position), dim=-1, whatever the number of "
     "leading dimensions"),
]
LAYER_NORM_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def _show_layer_norm(args: tuple) -> str:
    x, weight, bias, eps = args
    return f"layer_norm(x={_desc(x)}, weight={_desc(weight)}, bias={_desc(bias)}, eps={eps:g})"


def _layer_norm_case(description: str, x: Tensor, weight: Tensor, bias: Tensor, eps: float, hint: str = "") -> Case:
    return Case(description, (x, weight, bias, eps), in_float64(P.layer_norm, x, weight, bias, eps), hint)


def check_layer_norm(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """layer_norm(x, weight, bias, eps): normalize the last dim (biased variance, eps inside the root), scale, shift."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    ones, zeros = torch.ones, torch.zeros
    row = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cases = [
        _layer_norm_case("one row [1, 2, 3, 4], weight 1, bias 0", row, ones(4), zeros(4), 1e-5,
                         "mean 2.5, biased variance 1.25: the answer is (x - 2.5) / sqrt(1.25 + eps)"),
        _layer_norm_case("weight and bias", _randn(g, 3, 5), 1 + _randn(g, 5), _randn(g, 5), 1e-5),
        _layer_norm_case("a batch of 2 sequences of 3 positions", _randn(g, 2, 3, 8) * 3 + 1, 1 + _randn(g, 8),
                         _randn(g, 8), 1e-5, "each position (each row of C features) is normalized on its own"),
        _layer_norm_case("a large eps (1.0)", _randn(g, 4, 16), 1 + _randn(g, 16), _randn(g, 16), 1.0,
                         "eps is added to the variance, under the square root"),
        _layer_norm_case("float64, values around 1000, spread 0.01 (far from 0, close to their mean)",
                         1000 + _randn(g, 2, 3, 32, dtype=f64) * 1e-2, 1 + _randn(g, 32, dtype=f64),
                         _randn(g, 32, dtype=f64), 1e-5, "float64 in, float64 out"),
        _layer_norm_case("float64, a tiny spread (variance 1e-6, below eps)", 5 + _randn(g, 3, 24, dtype=f64) * 1e-3,
                         1 + _randn(g, 24, dtype=f64), _randn(g, 24, dtype=f64), 1e-5),
        _layer_norm_case("large values (spread 1000)", _randn(g, 2, 4, 12) * 1e3, 1 + _randn(g, 12), _randn(g, 12), 1e-5),
        _layer_norm_case("a 4-D input [2, 2, 3, 8]", _randn(g, 2, 2, 3, 8), 1 + _randn(g, 8), _randn(g, 8), 1e-5),
        _layer_norm_case("a constant row (variance 0)", torch.full((2, 6), 7.0), 1 + _randn(g, 6), _randn(g, 6), 1e-5,
                         "x - mean is 0 everywhere, so the answer is the bias (no NaN: eps keeps the root above 0)"),
        _layer_norm_case("C = 1: a single feature", _randn(g, 2, 3, 1), 1 + _randn(g, 1), _randn(g, 1), 1e-5,
                         "with one feature, x - mean = 0 and the biased variance is 0: the answer is the bias"),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64)[i % 2]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))] + [rng.choice([2, 3, 8, 17, 64, 768])]
        # float32 has about 7 significant digits: values 1000 ± 1e-3 are only noise there
        center, spread = rng.choice([(0, 1), (1000, 10), (-30, 0.1), (0, 100)] + [(1000, 1e-3)] * (dtype == f64))
        eps = rng.choice([1e-5, 1e-6, 0.1])
        x = center + _randn(g, *shape, dtype=dtype) * spread
        C = shape[-1]
        cases.append(_layer_norm_case(f"random #{i}: {str(dtype)[6:]}, values {center:g} ± {spread:g}, eps {eps:g}",
                                      x, 1 + _randn(g, C, dtype=dtype), _randn(g, C, dtype=dtype), eps))
    run_check("layer_norm", fn, cases, judge=tensor_judge(LAYER_NORM_TOLERANCES, LAYER_NORM_MISTAKES),
              forbid=[*NO_LAYER_NORM, *ENGINE_PARTS[:1]], show_call=_show_layer_norm, seconds=5, total_seconds=30)


# ----------------------------------------------------------------------------------------------
# GELU


def _gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_sigmoid(x):
    return x * torch.sigmoid(1.702 * x)


def _gelu_no_half(x):
    return 2 * P.gelu(x)


def _gelu_coefficient(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.44715 * x**3)))


def _gelu_no_root(x):
    return 0.5 * x * (1 + torch.tanh(2 / math.pi * (x + 0.044715 * x**3)))


GELU_MISTAKES = [
    (_gelu_erf, "this is GELU's exact (erf) form, 0.5·x·(1 + erf(x/√2)); GPT-2 uses the tanh approximation "
     "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) — they differ by up to about 5e-4"),
    (_gelu_sigmoid, "this is the sigmoid approximation x·σ(1.702x); GPT-2 uses the tanh one: "
     "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))"),
    (_gelu_no_half, "the formula starts with 0.5·x"),
    (_gelu_coefficient, "the cubic coefficient is 0.044715 (not 0.44715)"),
    (_gelu_no_root, "the factor in front is √(2/π) ≈ 0.7979, the square root of 2/π"),
]
GELU_TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.float64: (1e-10, 1e-9)}


def check_gelu(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """gelu(x): GPT-2's GELU, the tanh approximation, elementwise; same shape and dtype as x."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def case(description, x, hint=""):
        return Case(description, (x,), in_float64(P.gelu, x), hint)

    cases = [
        case("a few values", torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0])),
        case("float64, -6 to 6 in steps of 0.125", torch.linspace(-6, 6, 97, dtype=f64), "float64 in, float64 out"),
        case("a batch [2, 3, 5]", _randn(g, 2, 3, 5) * 2),
        case("large values ±20", torch.tensor([-20.0, -10.0, 10.0, 20.0]),
             "for x = 20 the argument of tanh is about 300: e^600 overflows, so write tanh with torch.tanh "
             "(or a formula that cannot overflow)"),
        case("very large values ±1e4 (float32)", torch.tensor([-1e4, -1e3, 1e3, 1e4]),
             "gelu(x) is x for large x and 0 for very negative x; x³ may overflow to inf, tanh(inf) is 1"),
        case("tiny values", torch.tensor([-1e-8, 1e-8, -1e-30, 1e-30], dtype=f64)),
        case("zeros", torch.zeros(2, 3)),
        case("float64 [2, 4, 8]", _randn(g, 2, 4, 8, dtype=f64) * 3),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64)[i % 2]
        shape = [rng.randint(1, 4) for _ in range(1 + i % 3)]
        cases.append(case(f"random #{i}: {str(dtype)[6:]} {shape}, spread {10 ** (i % 3 - 1):g}",
                          _randn(g, *shape, dtype=dtype) * 10 ** (i % 3 - 1)))
    run_check("gelu", fn, cases, judge=tensor_judge(GELU_TOLERANCES, GELU_MISTAKES),
              forbid=[*NO_GELU, *ENGINE_PARTS[1:2]], seconds=5, total_seconds=20,
              show_call=lambda args: f"gelu({short(args[0], 90)})")


# ----------------------------------------------------------------------------------------------
# Linear (Conv1D layout)


def _linear_transposed(x, weight, bias):
    return x @ weight.T + bias


def _linear_bias_first(x, weight, bias):
    return (x + bias) @ weight


def _linear_no_bias(x, weight, bias):
    return x @ weight


LINEAR_MISTAKES = [
    (_linear_transposed, "GPT-2 stores the weight as [C_in, C_out] (HF's Conv1D): the answer is x @ weight + bias, with no transpose "
     "(nn.Linear's layout [C_out, C_in] is the other one)"),
    (_linear_bias_first, "multiply first, then add the bias: x @ weight + bias"),
    (_linear_no_bias, "add the bias: x @ weight + bias"),
]
LINEAR_TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-10)}


def _show_linear(args: tuple) -> str:
    x, weight, bias = args
    return f"linear(x={_desc(x)}, weight={_desc(weight)}, bias={_desc(bias)})"


def check_linear(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """linear(x, weight, bias) = x @ weight + bias, weight [C_in, C_out]; x [..., C_in] -> [..., C_out]."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def case(description, x, c_out, hint="", dtype=None):
        dtype = dtype or x.dtype
        c_in = x.shape[-1]
        weight, bias = _randn(g, c_in, c_out, dtype=dtype), _randn(g, c_out, dtype=dtype)
        return Case(description, (x, weight, bias), in_float64(P.linear, x, weight, bias), hint)

    cases = [
        case("2-D x [3, 4], weight [4, 5]", _randn(g, 3, 4), 5, "weight is [C_in, C_out]: x @ weight has shape [3, 5]"),
        case("a square weight [4, 4]", _randn(g, 2, 4), 4,
             "with a square weight a transposed one has the right shape but the wrong values"),
        case("a batch: x [2, 3, 6], weight [6, 18] (like c_attn)", _randn(g, 2, 3, 6), 18,
             "keep every leading dimension: [B, T, C_in] -> [B, T, C_out]"),
        case("a 4-D input [2, 2, 3, 4]", _randn(g, 2, 2, 3, 4), 6,
             "x may have any number of leading dimensions: [..., C_in] -> [..., C_out]"),
        case("one vector x [4] (no leading dimensions)", _randn(g, 4), 3),
        case("float64 [2, 3, 8] x [8, 8]", _randn(g, 2, 3, 8, dtype=f64), 8, "float64 in, float64 out"),
        case("C_out = 1", _randn(g, 2, 5), 1),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64)[i % 2]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 3))] + [rng.choice([1, 3, 8, 64, 192])]
        cases.append(case(f"random #{i}: {str(dtype)[6:]}", _randn(g, *shape, dtype=dtype) * rng.choice([0.1, 1, 10]),
                          rng.choice([1, 4, shape[-1], 3 * shape[-1]])))
    run_check("linear", fn, cases, judge=tensor_judge(LINEAR_TOLERANCES, LINEAR_MISTAKES), error_hints={
        "cannot be multiplied": "weight is [C_in, C_out] (GPT-2's Conv1D layout): x [..., C_in] @ weight gives "
                                "[..., C_out], no transpose; add the bias after the product",
        "values to unpack": "x may have any number of leading dimensions ([C_in], [T, C_in], [B, T, C_in], ...): "
                            "x @ weight works for all of them"},
              forbid=[*ENGINE_PARTS[2:], NO_LIBRARIES[0]], show_call=_show_linear, seconds=5, total_seconds=20)


# ----------------------------------------------------------------------------------------------
# MLP


def reference_mlp(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias):
    """GPT-2's MLP with the engine's parts: [..., C] -> [..., 4C] -> GELU -> [..., C]."""
    return P.linear(P.gelu(P.linear(x, c_fc_weight, c_fc_bias)), c_proj_weight, c_proj_bias)


def _mlp_gelu_last(x, w1, b1, w2, b2):
    return P.gelu(P.linear(P.linear(x, w1, b1), w2, b2))


def _mlp_relu(x, w1, b1, w2, b2):
    return P.linear(torch.relu(P.linear(x, w1, b1)), w2, b2)


def _mlp_erf(x, w1, b1, w2, b2):
    return P.linear(_gelu_erf(P.linear(x, w1, b1)), w2, b2)


def _mlp_no_bias(x, w1, b1, w2, b2):
    return P.gelu(x @ w1) @ w2


def _mlp_no_gelu(x, w1, b1, w2, b2):
    return P.linear(P.linear(x, w1, b1), w2, b2)


MLP_MISTAKES = [
    (_mlp_gelu_last, "the GELU goes between the two layers: c_proj(gelu(c_fc(x))), not after c_proj"),
    (_mlp_relu, "GPT-2's activation is GELU (your `gelu`), not ReLU"),
    (_mlp_erf, "GPT-2's GELU is the tanh approximation (your `gelu`), not the erf form"),
    (_mlp_no_bias, "both layers have a bias: use your `linear(x, weight, bias)`"),
    (_mlp_no_gelu, "apply your `gelu` to the output of c_fc"),
]
COMPOSED_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}


def _show_mlp(args: tuple) -> str:
    x, w1, b1, w2, b2 = args
    return (f"mlp(x={_desc(x)}, c_fc_weight={_desc(w1)}, c_fc_bias={_desc(b1)}, c_proj_weight={_desc(w2)}, "
            f"c_proj_bias={_desc(b2)})")


def _layer_weights(g: torch.Generator, n_in: int, n_out: int, dtype) -> tuple[Tensor, Tensor]:
    """A linear layer's weight [n_in, n_out] and bias that keep activations around 1 (so mistakes show)."""
    return _randn(g, n_in, n_out, dtype=dtype) / math.sqrt(n_in), _randn(g, n_out, dtype=dtype) * 0.5


def check_mlp(fn, *, seed: int = 0, n_random: int = 4) -> None:
    """mlp(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias) = linear(gelu(linear(x, c_fc)), c_proj)."""
    g = torch.Generator().manual_seed(seed)

    def case(description, shape, dtype=torch.float32, hint=""):
        C = shape[-1]
        x = _randn(g, *shape, dtype=dtype) * 2
        args = (x, *_layer_weights(g, C, 4 * C, dtype), *_layer_weights(g, 4 * C, C, dtype))
        return Case(description, args, in_float64(reference_mlp, *args), hint)

    cases = [
        case("x [1, 3, 4]: C = 4, hidden 16", [1, 3, 4]),
        case("a batch [2, 5, 8]", [2, 5, 8]),
        case("float64 [2, 3, 6]", [2, 3, 6], torch.float64, "float64 in, float64 out"),
    ]
    for i in range(n_random):
        cases.append(case(f"random #{i}", [1 + i % 2, 2 + i, (8, 12, 64)[i % 3]], (torch.float32, torch.float64)[i % 2]))
    run_check("mlp", unwritten_helper(fn), cases, judge=tensor_judge(COMPOSED_TOLERANCES, MLP_MISTAKES), forbid=COMPOSED,
              show_call=_show_mlp, seconds=5, total_seconds=20)


# ----------------------------------------------------------------------------------------------
# The block


BLOCK_KEYS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias")


def _attend(x, w, n_head, causal=True):
    """Causal self-attention of GPT-2 with the engine's parts: x [B, T, C] -> [B, T, C]."""
    B, T, C = x.shape
    qkv = P.linear(x, w["attn.c_attn.weight"], w["attn.c_attn.bias"])  # [B, T, 3C]
    q, k, v = (P.split_heads(t, n_head) for t in qkv.split(C, dim=-1))  # [B, H, T, D]
    mask = P.causal_mask(T, T, x.device) if causal else torch.ones(T, T, dtype=torch.bool)
    a = P.merge_heads(P.attention(q, k, v, mask))  # [B, T, C]
    return P.linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"])


def _mlp_of(x, w):
    return reference_mlp(x, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"], w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])


def reference_block(x, weights, n_head, eps=1e-5):
    """GPT-2's pre-LN block with the engine's parts: x + attn(ln_1(x)), then + mlp(ln_2(x))."""
    w = weights
    x = x + _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return x + _mlp_of(P.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_post_ln(x, w, n_head, eps=1e-5):
    x = P.layer_norm(x + _attend(x, w, n_head), w["ln_1.weight"], w["ln_1.bias"], eps)
    return P.layer_norm(x + _mlp_of(x, w), w["ln_2.weight"], w["ln_2.bias"], eps)


def _block_one_residual(x, w, n_head, eps=1e-5):
    h = _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return x + _mlp_of(P.layer_norm(h, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_no_attention_residual(x, w, n_head, eps=1e-5):
    h = _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return h + _mlp_of(P.layer_norm(h, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_ln2_on_input(x, w, n_head, eps=1e-5):
    a = x + _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return a + _mlp_of(P.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_parallel(x, w, n_head, eps=1e-5):
    a = _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return x + a + _mlp_of(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w)


def _block_not_causal(x, w, n_head, eps=1e-5):
    x = x + _attend(P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head, causal=False)
    return x + _mlp_of(P.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_no_c_proj(x, w, n_head, eps=1e-5):
    h = P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
    B, T, C = h.shape
    q, k, v = (P.split_heads(t, n_head) for t in P.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(C, -1))
    x = x + P.merge_heads(P.attention(q, k, v, P.causal_mask(T, T)))
    return x + _mlp_of(P.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def _block_heads_reshaped(x, w, n_head, eps=1e-5):
    h = P.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
    B, T, C = h.shape
    qkv = P.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"])
    q, k, v = (t.reshape(B, n_head, T, C // n_head) for t in qkv.split(C, dim=-1))
    a = P.attention(q, k, v, P.causal_mask(T, T)).reshape(B, T, C)
    x = x + P.linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
    return x + _mlp_of(P.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


BLOCK_MISTAKES = [
    (_block_post_ln, "GPT-2 is pre-LN: normalize the input of each sub-layer and add its output to the unnormalized x — "
     "x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)) — not layer_norm(x + attn(x))"),
    (_block_one_residual, "each sub-layer adds to the residual stream: x = x + attn(ln_1(x)), then x = x + mlp(ln_2(x))"),
    (_block_no_attention_residual, "add the attention's output to x (the residual connection): x = x + attn(ln_1(x))"),
    (_block_ln2_on_input, "ln_2 normalizes the stream *after* the attention was added: x = x + attn(ln_1(x)); then mlp(ln_2(x)) with "
     "that new x"),
    (_block_parallel, "the MLP reads ln_2 of the stream after attention (GPT-2 runs the two sub-layers one after the other, "
     "not in parallel)"),
    (_block_not_causal, "attention must be causal: pass causal_mask(T, T) to attention, so that position t sees only positions "
     "0..t"),
    (_block_no_c_proj, "after merging the heads, project with attn.c_proj (a linear layer) before adding to x"),
    (_block_heads_reshaped, "a reshape of [B, T, C] to [B, H, T, D] mixes positions and heads: use split_heads (a view to [B, T, H, D], "
     "then a transpose) and merge_heads"),
]


def block_weights(n_embd: int, *, seed: int = 0, dtype=torch.float32) -> dict[str, Tensor]:
    """Random weights of one block, keyed as in GPT-2's checkpoint (relative to `h.N.`), large enough that
    every mistake changes the output.

        >>> sorted(block_weights(8))[:3]
        ['attn.c_attn.bias', 'attn.c_attn.weight', 'attn.c_proj.bias']
    """
    g = torch.Generator().manual_seed(seed)
    C = n_embd
    w = {}
    for ln in ("ln_1", "ln_2"):
        w[f"{ln}.weight"], w[f"{ln}.bias"] = 1 + 0.3 * _randn(g, C, dtype=dtype), 0.3 * _randn(g, C, dtype=dtype)
    for name, n_in, n_out in (("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C), ("mlp.c_fc", C, 4 * C),
                              ("mlp.c_proj", 4 * C, C)):
        w[f"{name}.weight"], w[f"{name}.bias"] = _layer_weights(g, n_in, n_out, dtype)
    w["attn.c_attn.weight"] *= 3  # sharper attention: a non-causal mask changes more
    return {k: w[k] for k in BLOCK_KEYS}


class _Weights(dict):
    """A block's weights that print as a short label in messages."""

    def __init__(self, data: dict, label: str):
        super().__init__(data)
        self.label = label

    def __repr__(self) -> str:
        return self.label


def _show_block(args: tuple) -> str:
    x, weights, n_head, eps = args
    return f"block(x={_desc(x)}, weights={weights!r}, n_head={n_head}, eps={eps:g})"


def check_block(fn, *, seed: int = 0, n_random: int = 3) -> None:
    """block(x, weights, n_head, eps=1e-5): GPT-2's pre-LN block, x [B, T, C] -> [B, T, C]."""
    g = torch.Generator().manual_seed(seed)

    def case(description, B, T, C, n_head, dtype=torch.float32, hint=""):
        x = _randn(g, B, T, C, dtype=dtype)
        w = _Weights(block_weights(C, seed=int(torch.randint(1 << 30, (1,), generator=g)), dtype=dtype),
                     f"<weights of one block, C={C}>")
        return Case(description, (x, w, n_head, 1e-5), in_float64(reference_block, x, w, n_head, 1e-5), hint)

    cases = [
        case("one position (T = 1), C = 8, 2 heads", 1, 1, 8, 2),
        case("x [1, 4, 8], 2 heads", 1, 4, 8, 2),
        case("a batch of 2, T = 5, C = 12, 3 heads", 2, 5, 12, 3),
        case("float64 [2, 3, 16], 4 heads", 2, 3, 16, 4, torch.float64, "float64 in, float64 out"),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n_head = rng.choice([1, 2, 4, 12])
        C = n_head * rng.choice([4, 8, 16])
        cases.append(case(f"random #{i}: C = {C}, {n_head} heads", rng.randint(1, 3), rng.randint(2, 9), C, n_head,
                          (torch.float32, torch.float64)[i % 2]))
    run_check("block", unwritten_helper(fn), cases, judge=tensor_judge(COMPOSED_TOLERANCES, BLOCK_MISTAKES), forbid=COMPOSED,
              show_call=_show_block, seconds=10, total_seconds=30)


# ----------------------------------------------------------------------------------------------
# The full forward pass


def lively_state_dict(config: GPT2Config, *, seed: int = 0, dtype=torch.float32, boost: float = 10.0) -> dict[str, Tensor]:
    """A random GPT-2 state dict with the engine's key names whose logits vary a lot from position to
    position (GPT-2's own init makes a random model nearly ignore the positions and the blocks): the
    linear weights are `boost` times GPT-2's init."""
    model = GPT2(config).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.wpe.weight.copy_(torch.randn(model.wpe.weight.shape, generator=g))
        model.wte.weight.mul_(boost)
        for block in model.h:
            for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                layer.weight.mul_(boost)
            block.ln_1.weight.copy_(1 + 0.3 * torch.randn(config.n_embd, generator=g))
            block.ln_2.bias.copy_(0.3 * torch.randn(config.n_embd, generator=g))
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}


def config_of(state_dict: dict, n_head: int) -> GPT2Config:
    """The GPT-2 configuration a state dict (engine key names) was made for."""
    vocab_size, n_embd = state_dict["wte.weight"].shape
    n_layer = len({k.split(".")[1] for k in state_dict if k.startswith("h.")})
    return GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                      n_positions=state_dict["wpe.weight"].shape[0])


def reference_forward(state_dict: dict, input_ids: Tensor, n_head: int, eps: float = 1e-5, *,
                      order: Optional[list[int]] = None, final_norm: bool = True, positions: bool = True) -> Tensor:
    """The engine's logits [B, T, vocab] for a state dict; the keyword arguments make known mistakes."""
    config = config_of(state_dict, n_head)
    if order is None and final_norm and positions:
        model = GPT2(dataclasses.replace(config, layer_norm_epsilon=eps))
        model.load_state_dict(state_dict)
        with torch.no_grad():
            return model.to(state_dict["wte.weight"].dtype).eval()(input_ids)
    B, T = input_ids.shape
    sd = state_dict
    with torch.no_grad():
        x = P.embedding(sd["wte.weight"], input_ids)
        if positions:
            x = x + P.embedding(sd["wpe.weight"], torch.arange(T).expand(B, T))
        for i in order if order is not None else range(config.n_layer):
            x = reference_block(x, {k: sd[f"h.{i}.{k}"] for k in BLOCK_KEYS}, n_head, eps)
        if final_norm:
            x = P.layer_norm(x, sd["ln_f.weight"], sd["ln_f.bias"], eps)
        return x @ sd["wte.weight"].T


def _forward_string_order(sd, ids, n_head, eps=1e-5):
    n_layer = config_of(sd, n_head).n_layer
    return reference_forward(sd, ids, n_head, eps, order=sorted(range(n_layer), key=str))


def _forward_reversed(sd, ids, n_head, eps=1e-5):
    return reference_forward(sd, ids, n_head, eps, order=list(reversed(range(config_of(sd, n_head).n_layer))))


FORWARD_MISTAKES = [
    (lambda sd, ids, h, eps=1e-5:
        reference_forward(sd, ids, h, eps, final_norm=False), "apply the final layer norm ln_f before the head"),
    (lambda sd, ids, h, eps=1e-5:
        reference_forward(sd, ids, h, eps, positions=False), "add the position embeddings: x = wte[ids] + wpe[0, 1, ..., T-1]"),
    (_forward_string_order, "run the blocks in order h.0, h.1, ..., h.11: sorting the keys as strings puts h.10 before h.2"),
    (_forward_reversed, "run the blocks in order h.0, h.1, ... (not reversed)"),
]


def _show_forward(args: tuple) -> str:
    sd, ids, n_head, eps = args
    return f"gpt2_forward(state_dict={sd!r}, input_ids={_desc(ids)} {short(ids.tolist(), 60)}, n_head={n_head}, eps={eps:g})"


def _judge_forward(tolerances: dict) -> Callable[[Case, Any], Verdict]:
    base = tensor_judge(tolerances, FORWARD_MISTAKES)

    def judge(case: Case, got: Any) -> Verdict:
        verdict = base(case, got)
        if verdict is None or verdict[1]:
            return verdict
        sd, ids, n_head, eps = case.args
        B, T = ids.shape
        if isinstance(got, Tensor) and got.shape == case.expected.shape and B > 1 and T > 1:
            rows = [reference_forward(sd, ids[b : b + 1], n_head, eps) for b in range(B)]
            if same_answer(got[:1], rows[0]) and not same_answer(got, torch.cat(rows)):
                return verdict[0], ("the first sequence is right but not the others: each row of input_ids is its "
                                    "own sequence, with positions 0..T-1 (torch.arange(T), not numel())")
        return verdict[0], ("check the tied head — logits = ln_f(x) @ wte.weight.T, GPT-2 has no separate lm_head — "
                            "and the embeddings: x = wte[input_ids] + wpe[positions]")

    return judge


def _forward_case(description: str, config: GPT2Config, B: int, T: int, seed: int, dtype=torch.float32,
                  hint: str = "", boost: float = 10.0) -> Case:
    sd = _Weights(lively_state_dict(config, seed=seed, dtype=dtype, boost=boost),
                  f"<GPT-2 weights: {config.n_layer} layers, n_embd {config.n_embd}, vocab {config.vocab_size}, "
                  f"{config.n_positions} positions, {str(dtype)[6:]}>")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab_size, (B, T), generator=g)
    return Case(description, (sd, ids, config.n_head, 1e-5), reference_forward(sd, ids, config.n_head), hint)


FORWARD_TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-8, 1e-9)}


def check_gpt2_forward(fn, *, seed: int = 0, n_random: int = 2, gpt2_124m: bool = False,
                       transformers: bool = False) -> None:
    """gpt2_forward(state_dict, input_ids, n_head, eps=1e-5) -> logits [B, T, vocab_size], equal to the engine's.

    `gpt2_124m`: one more case with the real GPT-2 small shapes (12 layers, 12 heads, 768, vocab 50257);
    `transformers`: the learner's logits also compared with transformers' GPT2LMHeadModel.
    """
    tiny = dict(n_positions=32, vocab_size=101)
    cases = [
        _forward_case("one sequence of 4 tokens, 2 layers, n_embd 16, 2 heads",
                      GPT2Config(n_layer=2, n_head=2, n_embd=16, **tiny), 1, 4, seed),
        _forward_case("a batch of 3 sequences of 5 tokens",
                      GPT2Config(n_layer=2, n_head=4, n_embd=16, **tiny), 3, 5, seed + 1,
                      hint="each row of input_ids is one sequence; positions are 0..T-1 in every row"),
        _forward_case("12 layers (like GPT-2 small), n_embd 8", GPT2Config(n_layer=12, n_head=2, n_embd=8, **tiny),
                      2, 3, seed + 2),
        _forward_case("float64 weights", GPT2Config(n_layer=1, n_head=2, n_embd=8, **tiny), 2, 4, seed + 3,
                      torch.float64, "float64 in, float64 out"),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n_head = rng.choice([1, 2, 3])
        config = GPT2Config(n_layer=rng.randint(1, 3), n_head=n_head, n_embd=n_head * rng.choice([4, 8]),
                            n_positions=rng.choice([16, 64]), vocab_size=rng.choice([7, 300, 1000]))
        cases.append(_forward_case(f"random #{i}", config, rng.randint(1, 3), rng.randint(1, 16), seed + 10 + i))
    if gpt2_124m:
        cases.append(_forward_case("GPT-2 small's shapes: 12 layers, 12 heads, n_embd 768, vocab 50257",
                                   GPT2Config(), 2, 8, seed + 20, boost=3.0))
    judge = _judge_forward(FORWARD_TOLERANCES)
    if transformers:
        judge = _also_transformers(judge)
    run_check("gpt2_forward", unwritten_helper(fn), cases, judge=judge, forbid=COMPOSED, show_call=_show_forward, seconds=20,
              total_seconds=60)


def hf_logits(state_dict: dict, input_ids: Tensor, n_head: int) -> Tensor:
    """Logits of transformers' GPT2LMHeadModel with these weights (the engine's key names)."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = config_of(state_dict, n_head)
    hf_config = transformers.GPT2Config(n_layer=config.n_layer, n_head=n_head, n_embd=config.n_embd,
                                        n_positions=config.n_positions, vocab_size=config.vocab_size,
                                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(hf_config)
    weights = {f"transformer.{k}": v for k, v in state_dict.items()}
    model.load_state_dict({**weights, "lm_head.weight": state_dict["wte.weight"]}, strict=False, assign=True)
    model.tie_weights()
    model = model.to(state_dict["wte.weight"].dtype).eval()
    with torch.no_grad():
        return model(input_ids).logits


def _also_transformers(judge: Callable[[Case, Any], Verdict]) -> Callable[[Case, Any], Verdict]:
    def both(case: Case, got: Any) -> Verdict:
        verdict = judge(case, got)
        if verdict is not None:
            return verdict
        sd, ids, n_head, eps = case.args
        theirs = hf_logits(sd, ids, n_head)
        problem = tensor_problem(got, theirs, atol=1e-4, rtol=1e-5)
        return (f"compared with transformers' GPT2LMHeadModel: {problem}", "") if problem else None

    return both


# ----------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint


def _save(folder: Path, config: GPT2Config, tensors: dict[str, Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config.to_json(folder / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def _hf_save_pretrained(folder: Path, state_dict: dict, config: GPT2Config) -> Path:
    """What transformers' save_pretrained writes for these weights."""
    import warnings

    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hf_config = transformers.GPT2Config(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                                        n_positions=config.n_positions, vocab_size=config.vocab_size)
    model = transformers.GPT2LMHeadModel(hf_config)
    weights = {f"transformer.{k}": v for k, v in state_dict.items()}
    model.load_state_dict({**weights, "lm_head.weight": state_dict["wte.weight"]}, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return folder


def checkpoint_folders(root: Path, *, seed: int = 0, transformers: bool = False) -> list[tuple[str, Path]]:
    """Model folders in each layout a GPT-2 checkpoint comes in, with random weights: (description, folder)."""
    out = []
    configs = [GPT2Config(n_layer=2, n_head=2, n_embd=8, n_positions=16, vocab_size=50),
               GPT2Config(n_layer=3, n_head=3, n_embd=12, n_positions=8, vocab_size=20)]
    for n, config in enumerate(configs):
        sd = lively_state_dict(config, seed=seed + n)
        prefixed = {f"transformer.{k}": v for k, v in sd.items()}
        out.append((f"as llmcourse.save_model writes it ({config.n_layer} layers): keys 'transformer.…', no "
                    "lm_head.weight", _save(root / f"save_model-{n}", config, prefixed)))
        out.append(("with lm_head.weight stored too (equal to wte.weight)",
                    _save(root / f"with-lm_head-{n}", config, {**prefixed, "lm_head.weight": sd["wte.weight"].clone()})))
        old = dict(sd)
        mask = torch.tril(torch.ones(config.n_positions, config.n_positions)).view(1, 1, config.n_positions, -1)
        for i in range(config.n_layer):
            old[f"h.{i}.attn.bias"], old[f"h.{i}.attn.masked_bias"] = mask.clone(), torch.tensor(-1e4)
        out.append(("in the old OpenAI style of the Hub's 'gpt2': keys without 'transformer.', with the buffers "
                    "h.N.attn.bias and h.N.attn.masked_bias", _save(root / f"openai-style-{n}", config, old)))
        if n == 0:
            half = {k: v.half() for k, v in prefixed.items()}
            out.append(("stored in float16 (like the bundled model: half the file size)",
                        _save(root / "float16", config, half)))
        if transformers:
            out.append(("as transformers' save_pretrained writes it",
                        _hf_save_pretrained(root / f"save_pretrained-{n}", sd, config)))
    return out


def reference_checkpoint(folder) -> tuple[dict[str, Tensor], dict]:
    """(state dict with the engine's key names, config.json as a dict): what the engine's loader reads."""
    from ..loading import check_weights, read_weights

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = GPT2Config.from_json(folder / "config.json")
    state = check_weights(read_weights(folder / "model.safetensors"), GPT2(config), folder / "model.safetensors")
    return state, raw


def _judge_checkpoint(case: Case, got: Any) -> Verdict:
    expected_sd, expected_config = case.expected
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (state_dict, config), got {short(got, 80)}", "return state_dict, config"
    sd, config = got
    if not isinstance(sd, dict):
        return f"the state dict should be a dict {{name: tensor}}, got a {type(sd).__name__}", ""
    for key in sd:
        if key not in expected_sd:
            if key.startswith("transformer."):
                hint = "drop the prefix 'transformer.': the engine's keys are 'wte.weight', 'h.0.ln_1.weight', ..."
            elif key.endswith(("attn.bias", "attn.masked_bias")):
                hint = ("h.N.attn.bias and h.N.attn.masked_bias are not weights but old causal-mask buffers: "
                        "drop them")
            elif key == "lm_head.weight":
                hint = "the head is tied to wte.weight: drop lm_head.weight (the forward pass uses wte.weight)"
            else:
                hint = "keep only the engine's keys"
            return f"unexpected key {key!r}", hint
    missing = [k for k in expected_sd if k not in sd]
    if missing:
        return (f"the key {missing[0]!r} is missing ({len(missing)} missing in all)",
                "every tensor of the file, renamed without 'transformer.' (see the list of keys in the exercise)")
    for key, want in expected_sd.items():
        tensor = sd[key]
        if not isinstance(tensor, Tensor):
            return f"{key!r} should be a tensor, got {short(tensor, 60)}", ""
        if tensor.shape != want.shape:
            hint = ("Conv1D weights are stored as [C_in, C_out] already, the layout linear() uses: no transpose"
                    if tensor.shape == want.shape[::-1] else "")
            return f"{key!r} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}", hint
        if tensor.dtype != want.dtype:
            return (f"{key!r} has dtype {tensor.dtype}, expected {want.dtype}",
                    "convert every tensor to float32 (tensor.float()): a checkpoint may store float16 to halve the "
                    "file, and the forward pass computes in float32")
        if not torch.equal(tensor, want):
            hint = ("Conv1D weights are stored as [C_in, C_out] already, the layout linear() uses: no transpose"
                    if want.dim() == 2 and want.shape[0] == want.shape[1] and torch.equal(tensor, want.T) else
                    "copy the tensors as they are in the file")
            return f"the values of {key!r} differ from the file's", hint
    if not isinstance(config, dict):
        return (f"the config should be the dict read from config.json, got a {type(config).__name__}",
                "json.loads(Path(folder, 'config.json').read_text())")
    if config != expected_config:
        return "the config differs from config.json", "return the whole of config.json, as json.load reads it"
    return None


def check_load_gpt2_checkpoint(fn, *, seed: int = 0, transformers: bool = False) -> None:
    """load_gpt2_checkpoint(folder) -> (state dict with the engine's key names, float32, and the config dict)
    for every layout."""
    root = Path(tempfile.mkdtemp(prefix="gpt2-checkpoints-"))
    try:
        cases = []
        for n, (description, folder) in enumerate(checkpoint_folders(root, seed=seed, transformers=transformers)):
            argument = str(folder) if n % 2 else folder  # a str or a pathlib.Path
            cases.append(Case(f"a checkpoint {description}", (argument,), reference_checkpoint(folder)))
        run_check("load_gpt2_checkpoint", fn, cases, judge=_judge_checkpoint, forbid=NO_LIBRARIES,
                  show_call=lambda args: f"load_gpt2_checkpoint({type(args[0]).__name__} '…/{Path(args[0]).name}')",
                  seconds=10, total_seconds=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
