"""Checks for chapter 04, the transformer block and GPT-2: layer norm, GELU, the Conv1D linear layer,
the MLP, the pre-LN block, the full forward pass, and loading a Hugging Face checkpoint.

Each check compares the learner's function with the engine's (`llmcourse.engine.parts`, `llmcourse.GPT2`,
`llmcourse.engine.loading`) on fixed edge cases and seeded random inputs: batch > 1, float64, values far from
0 and from their mean, square weights, 12 layers. Expected tensors are computed in float64 and cast
to the input's dtype. When an answer is wrong, the message also says what was probably done wrong,
found by comparing the answer with known mistakes computed on the same input (unbiased variance, eps
outside the root, GELU's erf form, a transposed weight, post-LN, an untied head, ...).

    >>> import torch
    >>> def gelu(x):
    ...     return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    >>> check_gelu(gelu)
    ✓ gelu — 21 cases

The engine's own functions are the black boxes: passing `llmcourse.engine.parts.gelu` itself fails.
"""

from __future__ import annotations

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
from safetensors.torch import load_file, save_file
from torch import Tensor

from llmcourse.course.guards import guarded
from llmcourse.engine import parts as P
from llmcourse.engine.checkpoints import weight_files
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.loading import check_weights, read_checkpoint
from llmcourse.engine.model import GPT2
from llmcourse.engine.parts import Parts

from .harness.core import Case, Verdict, also_reference, later, run_check, unwritten_helper
from .harness.forbid import Forbidden
from .harness.show import distinct, short
from .harness.tensors import FLOAT32_ACCURACY, in_float64, known_mistake, same_answer, tensor_problem

# ----------------------------------------------------------------------------------------------
# Black boxes

_OWN = "Write it yourself with tensor operations (+, *, @, mean, sqrt, tanh, ...)."
ENGINE_PARTS = [
    Forbidden(
        f"llmcourse.engine.parts.{name}",
        f"The engine's version is the black box here: use your own `{name}` from this chapter.",
    )
    for name in ("layer_norm", "gelu", "linear")
]
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
    Forbidden(
        "llmcourse.engine.model", "The engine's GPT2 is what your code is compared with: build it from your own parts."
    ),
    Forbidden(
        "llmcourse.engine.loading",
        "The engine's loader is what your code is compared with: read the files yourself "
        "(json and safetensors.torch.load_file).",
    ),
]
# cpu_kernels.linear computes linear (by the engine's C kernel): refused where the learner's code calls it
NO_KERNELS = [
    Forbidden(
        "llmcourse.engine.cpu_kernels",
        "The engine's C kernels are the black box here: write it with @ and + yourself.",
        direct=True,  # the engine a check runs around the learner's linear uses them (the LM head)
    )
]
COMPOSED = [*ENGINE_PARTS, *NO_LAYER_NORM, *NO_GELU, *NO_LIBRARIES]


# ----------------------------------------------------------------------------------------------
# Comparing tensors, and guessing the mistake


def _desc(t: Tensor) -> str:
    layout = "" if t.is_contiguous() else ", a non-contiguous view"
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}{layout}"


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32) -> Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _transposed(g: torch.Generator, *shape: int, dtype=torch.float32) -> Tensor:
    """Random values of `shape` as a non-contiguous view: the last two dimensions of a bigger tensor, transposed."""
    return _randn(g, *shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


# ----------------------------------------------------------------------------------------------
# Accuracy contracts: how far from the exact answer a correct function may be
#
# Every answer is compared with the exact one (computed in float64 from the same inputs) and may be off
# by what rounding in the input's dtype can cause: a few units of rounding u (float64 2^-53, float32
# 2^-24, float16 2^-11, bfloat16 2^-8) times the size of the values the computation goes through, and
# √n for a sum of n terms (the typical growth of rounding errors in a sum, whatever its order: torch's,
# a Python loop, Welford's running mean, float64 accumulation). Each check states its bound; a
# correct function written another way stays well inside it, a wrong one is far outside.

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
HALF = (torch.float16, torch.bfloat16)
Accuracy = Callable[[tuple], tuple[Tensor, Tensor]]  # args -> (exact answer in float64, allowed |error|)


def _u(t: Tensor) -> float:
    return UNIT_ROUNDOFF.get(t.dtype, 2.0**-24)


def _wide(a: Any) -> Any:
    if isinstance(a, dict):
        return {k: _wide(v) for k, v in a.items()}
    return a.detach().double() if isinstance(a, Tensor) and a.is_floating_point() else a


def _floor(t: Tensor) -> float:
    """The smallest error worth reporting in t's dtype (below it, subnormal numbers round as they like)."""
    return 4 * torch.finfo(t.dtype).tiny if t.is_floating_point() else 0.0


HALF_DTYPE = (
    "keep the input's dtype: float16 in, float16 out (bfloat16 the same). The engine runs float16 and "
    "bfloat16 models and refuses a part that returns float32 (no .float() without converting back)"
)


def _dtype_hint(got: Any, expected: Tensor) -> str:
    if isinstance(got, Tensor) and got.dtype != expected.dtype and expected.dtype in HALF:
        return HALF_DTYPE
    return ""


def accuracy_judge(accuracy: Accuracy, contract: str, mistakes: Sequence[tuple[Callable, str]] = ()) -> Callable:
    """A judge: a tensor of the expected shape, dtype and device whose every element is within the allowed
    error of the exact answer (`accuracy(args)` -> (exact, allowed)); else where and how far off, the known
    mistake the answer is, or, when it is close, the `contract` it missed."""

    def judge(case: Case, got: Any) -> Verdict:
        expected = case.expected
        problem = tensor_problem(got, expected, atol=math.inf, rtol=0.0)  # type, shape, dtype, device, nan/inf
        if problem and not (isinstance(got, Tensor) and got.shape == expected.shape and got.dtype == expected.dtype):
            return problem, _dtype_hint(got, expected)
        exact, allowed = accuracy(case.args)

        def far(candidate: Tensor) -> bool:
            return not bool(((candidate.double() - exact).abs() <= allowed).all())

        if problem:  # nan or inf where the answer is finite: an overflow, which a known mistake may name
            return problem, known_mistake(got, case.args, mistakes, far)
        error = (got.detach().double() - exact).abs()
        wrong = ~(error <= allowed)
        if not bool(wrong.any()):
            return None
        ratio = (error / allowed).masked_fill(~wrong, 0)
        index = torch.nonzero(ratio == ratio.max())[0]
        at = tuple(index)
        want, have = distinct(exact[at].item(), got[at].item())
        problem = (
            f"the values differ at {int(wrong.sum())} of {wrong.numel()} positions, most at index "
            f"[{', '.join(str(int(i)) for i in index)}]: expected {want}, got {have} "
            f"(|difference| {error[at].item():.3g}, allowed {allowed[at].item():.3g} there)"
        )
        hint = known_mistake(got, case.args, mistakes, far)
        if not hint and got.dtype == torch.float64 and bool((error <= allowed * 2.0**29).all()):
            hint = FLOAT32_ACCURACY
        if not hint and ratio.max().item() < 30:
            hint = f"close, but not as accurate as expected: {contract}"
        return problem, hint

    return judge


# ----------------------------------------------------------------------------------------------
# The learner's part inside the engine (the way `llmcourse.course.learner.my_engine` installs it)

ENGINE_K = 16  # a whole model's logits: within 16·√C units of rounding of the largest |logit|
ENGINE_CONTRACT = (
    "the logits of a model may be off by 16·√C units of rounding of the input's dtype (C = n_embd) "
    "times the largest |logit|"
)


class EngineRun:
    """A tiny GPT-2 (non-default weights everywhere) that runs with the learner's part in its slot:
    `model.parts = guarded(Parts, part=fn)`, then `model(input_ids)` or `model(input_ids, last_only=True)`
    (which gives `ln_f` the non-contiguous view x[:, -1:]). Prints as a short description, never the model."""

    def __init__(self, part: str, dtype: torch.dtype, seed: int, *, last_only: bool = False, eps: float = 1e-5):
        self.part, self.dtype, self.last_only = part, dtype, last_only
        config = GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=101, layer_norm_epsilon=eps)
        self.config = config
        self.model = GPT2(config)
        self.model.load_state_dict(lively_state_dict(config, seed=seed))
        self.model.to(dtype).eval()
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(config.vocab_size, (3, 7), generator=g)
        ids[0, 0], ids[1, -1] = 0, config.vocab_size - 1  # the first and the last token of the vocabulary
        self.ids = ids

    def __deepcopy__(self, memo):  # the check's snapshot of its arguments: nothing of it is the learner's to change
        return self

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<tiny GPT-2: {c.n_layer} layers, n_embd {c.n_embd}, {str(self.dtype)[6:]}, "
            f"layer_norm_epsilon {c.layer_norm_epsilon:g}>"
        )

    def show(self) -> str:
        call = "model(input_ids, last_only=True)" if self.last_only else "model(input_ids)"
        return (
            f"model = {self!r}; model.parts = guarded(Parts, {self.part}={self.part}); {call} "
            f"with input_ids {_desc(self.ids)}"
        )


def _engine_exact(run: EngineRun) -> Tensor:
    """The engine's own logits in float64, from the same (rounded) weights: the exact answer."""
    model = GPT2(run.config)
    model.load_state_dict({k: v.double() for k, v in run.model.state_dict().items()})
    with torch.no_grad():
        return model.double().eval()(run.ids, last_only=run.last_only)


def _engine_accuracy(run: EngineRun) -> tuple[Tensor, Tensor]:
    exact = _engine_exact(run)
    allowed = ENGINE_K * UNIT_ROUNDOFF[run.dtype] * math.sqrt(run.config.n_embd) * exact.abs().max()
    return exact, torch.full_like(exact, allowed.item())


def engine_case(part: str, dtype: torch.dtype, seed: int, *, last_only: bool = False, eps: float = 1e-5) -> Case:
    run = EngineRun(part, dtype, seed, last_only=last_only, eps=eps)
    what = "the last position only (ln_f gets x[:, -1:], a view)" if last_only else "every position"
    return Case(
        f"your {part} in the engine: a tiny GPT-2 in {str(dtype)[6:]}, {what}",
        (run,),
        later(lambda r: _engine_exact(r).to(r.dtype), run),
        "the engine calls your part with its own tensors: any shape [..., C], float32, float16 or bfloat16, "
        "and needs the input's shape and dtype back",
    )


def with_engine_runs(
    fn: Callable, accuracy: Accuracy, contract: str, mistakes: Sequence[tuple[Callable, str]] = ()
) -> tuple[Callable, Callable]:
    """(the function a check runs, its judge) for a part whose cases include `engine_case`s: those
    install `fn` in the tiny model and run it; the others call `fn` as they are."""

    @functools.wraps(fn)
    def run(*args):
        if args and isinstance(args[0], EngineRun):
            engine = args[0]
            model, before = engine.model, engine.model.parts
            model.parts = guarded(Parts, **{engine.part: fn})
            try:
                with torch.no_grad():
                    return model(engine.ids, last_only=engine.last_only)
            finally:
                model.parts = before
        return fn(*args)

    part_judge = accuracy_judge(accuracy, contract, mistakes)
    in_engine = accuracy_judge(lambda args: _engine_accuracy(args[0]), ENGINE_CONTRACT)

    def judge(case: Case, got: Any) -> Verdict:
        return (in_engine if isinstance(case.args[0], EngineRun) else part_judge)(case, got)

    return run, judge


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


def _layer_norm_sum_over_c(x, weight, bias, eps):
    centered = x - x.mean(-1, keepdim=True)
    return centered / torch.sqrt((centered**2).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight + bias


def _layer_norm_dim1(x, weight, bias, eps):
    if x.dim() < 3:
        raise ValueError
    mean, var = x.mean(1, keepdim=True), x.var(1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


LAYER_NORM_MISTAKES = [
    (
        _layer_norm_unbiased,
        "use the biased variance, mean((x - mean)²) over the C features, as GPT-2 does: x.var(-1, unbiased=False); "
        "torch's var() divides by C - 1 by default",
    ),
    (_layer_norm_eps_outside, "eps goes inside the square root: (x - mean) / sqrt(var + eps), not / (sqrt(var) + eps)"),
    (_layer_norm_no_eps, "add eps to the variance before the square root: it matters when the variance is small"),
    (_layer_norm_no_bias, "after normalizing, scale by weight and shift by bias: x̂ * weight + bias"),
    (_layer_norm_no_weight, "after normalizing, scale by weight and shift by bias: x̂ * weight + bias"),
    (
        _layer_norm_sum_over_c,
        "in float16 the sum of the C squares overflows before you divide by C (65504 is float16's largest number): "
        "average them with .mean(-1, keepdim=True), which torch accumulates in float32 and rounds once",
    ),
    (
        _layer_norm_one_pass,
        "mean(x²) - mean(x)² loses all precision when the values are far from their mean (here around 1000): "
        "subtract the mean first, then average the squares",
    ),
    (
        _layer_norm_dim1,
        "normalize over the last dimension (the C features of each position), dim=-1, whatever the number of "
        "leading dimensions",
    ),
]

# Contract: each output within u·(8·√C·κ·(1 + |x̂|)·|weight| + 4·(|answer| + |bias|)), where κ = max|x| / √(var + eps)
# of its row: rounding x by one unit moves x - mean by up to u·max|x|, that is x̂ by u·κ, and the mean and the
# variance are sums of C terms. A Welford (running) mean and variance, float64 accumulation, var_mean or
# rsqrt all stay inside it; mean(x²) - mean² on values far from their mean does not.
LAYER_NORM_CONTRACT = (
    "layer_norm may be off by 8·√C units of rounding of x's dtype times κ = max|x| / √(var + eps) "
    "(how much rounding x moves the normalized values), times (1 + |x̂|)·|weight|, plus 4 units of "
    "rounding of the answer"
)


def layer_norm_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x, weight, bias, eps = args
    X, W, B = _wide(x), _wide(weight), _wide(bias)
    mean = X.mean(-1, keepdim=True)
    sigma = (((X - mean) ** 2).mean(-1, keepdim=True) + eps).sqrt()
    xhat = (X - mean) / sigma
    exact = xhat * W + B
    kappa = X.abs().amax(-1, keepdim=True) / sigma
    u = _u(x)
    allowed = u * (8 * math.sqrt(x.shape[-1]) * kappa * (1 + xhat.abs()) * W.abs() + 4 * (exact.abs() + B.abs()))
    return exact, allowed + _floor(x)


def _show_layer_norm(args: tuple) -> str:
    if isinstance(args[0], EngineRun):
        return args[0].show()
    x, weight, bias, eps = args
    return f"layer_norm(x={_desc(x)}, weight={_desc(weight)}, bias={_desc(bias)}, eps={eps:g})"


def _layer_norm_case(description: str, x: Tensor, weight: Tensor, bias: Tensor, eps: float, hint: str = "") -> Case:
    return Case(description, (x, weight, bias, eps), later(in_float64, P.layer_norm, x, weight, bias, eps), hint)


def check_layer_norm(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """layer_norm(x, weight, bias, eps): normalize the last dim (biased variance, eps inside the root), scale, shift.

    Any shape [..., C], float32, float64, float16 or bfloat16 (the answer in x's dtype), contiguous or not;
    the last cases run it inside the engine (a tiny GPT-2, as `my_engine` installs it)."""
    g = torch.Generator().manual_seed(seed)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16
    ones, zeros = torch.ones, torch.zeros
    row = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cases = [
        _layer_norm_case(
            "one row [1, 2, 3, 4], weight 1, bias 0",
            row,
            ones(4),
            zeros(4),
            1e-5,
            "mean 2.5, biased variance 1.25: the answer is (x - 2.5) / sqrt(1.25 + eps)",
        ),
        _layer_norm_case("weight and bias", _randn(g, 3, 5), 1 + _randn(g, 5), _randn(g, 5), 1e-5),
        _layer_norm_case(
            "a batch of 2 sequences of 3 positions",
            _randn(g, 2, 3, 8) * 3 + 1,
            1 + _randn(g, 8),
            _randn(g, 8),
            1e-5,
            "each position (each row of C features) is normalized on its own",
        ),
        _layer_norm_case(
            "a large eps (1.0)",
            _randn(g, 4, 16),
            1 + _randn(g, 16),
            _randn(g, 16),
            1.0,
            "eps is added to the variance, under the square root",
        ),
        _layer_norm_case(
            "float64, values around 1000, spread 0.01 (far from 0, close to their mean)",
            1000 + _randn(g, 2, 3, 32, dtype=f64) * 1e-2,
            1 + _randn(g, 32, dtype=f64),
            _randn(g, 32, dtype=f64),
            1e-5,
            "float64 in, float64 out",
        ),
        _layer_norm_case(
            "float64, a tiny spread (variance 1e-6, below eps)",
            5 + _randn(g, 3, 24, dtype=f64) * 1e-3,
            1 + _randn(g, 24, dtype=f64),
            _randn(g, 24, dtype=f64),
            1e-5,
        ),
        _layer_norm_case(
            "large values (spread 1000)", _randn(g, 2, 4, 12) * 1e3, 1 + _randn(g, 12), _randn(g, 12), 1e-5
        ),
        _layer_norm_case("a 4-D input [2, 2, 3, 8]", _randn(g, 2, 2, 3, 8), 1 + _randn(g, 8), _randn(g, 8), 1e-5),
        _layer_norm_case(
            "a constant row (variance 0)",
            torch.full((2, 6), 7.0),
            1 + _randn(g, 6),
            _randn(g, 6),
            1e-5,
            "x - mean is 0 everywhere, so the answer is the bias (no NaN: eps keeps the root above 0)",
        ),
        _layer_norm_case(
            "C = 1: a single feature",
            _randn(g, 2, 3, 1),
            1 + _randn(g, 1),
            _randn(g, 1),
            1e-5,
            "with one feature, x - mean = 0 and the biased variance is 0: the answer is the bias",
        ),
        _layer_norm_case("a 1-D x [6] (one position)", _randn(g, 6) * 2, 1 + _randn(g, 6), _randn(g, 6), 1e-5),
        _layer_norm_case(
            "x a non-contiguous view [2, 5, 16] (a transposed tensor)",
            _transposed(g, 2, 5, 16) * 2 + 1,
            1 + _randn(g, 16),
            _randn(g, 16),
            1e-5,
            "x may be a view whose rows are not contiguous: .view() fails on it, reshape or plain "
            "reductions over dim=-1 work",
        ),
        _layer_norm_case(
            "x[:, -1:], the view the engine's last_only gives ln_f",
            _randn(g, 3, 7, 24)[:, -1:] * 3,
            1 + _randn(g, 24),
            _randn(g, 24),
            1e-5,
        ),
        _layer_norm_case(
            "C = 768 (GPT-2 small), values 1000 ± 10",
            1000 + _randn(g, 2, 3, 768) * 10,
            1 + _randn(g, 768),
            _randn(g, 768),
            1e-5,
        ),
        _layer_norm_case(
            "float16 [2, 5, 64], as a float16 model runs it",
            (_randn(g, 2, 5, 64) * 3 + 1).half(),
            (1 + 0.3 * _randn(g, 64)).half(),
            _randn(g, 64).half(),
            1e-5,
            "float16 in, float16 out",
        ),
        _layer_norm_case(
            "float16, values 300 ± 40 (x² = 90000 is past float16's largest number, 65504; x - mean is not)",
            (300 + _randn(g, 2, 3, 64) * 40).half(),
            (1 + 0.3 * _randn(g, 64)).half(),
            _randn(g, 64).half(),
            1e-5,
        ),
        _layer_norm_case(
            "bfloat16 [3, 4, 48], eps 1e-3",
            (_randn(g, 3, 4, 48) * 2).bfloat16(),
            (1 + 0.3 * _randn(g, 48)).bfloat16(),
            _randn(g, 48).bfloat16(),
            1e-3,
            "bfloat16 in, bfloat16 out",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64, torch.float32, f64, f16, bf16)[i % 6]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))] + [rng.choice([2, 3, 8, 17, 64, 768])]
        # float32 has about 7 significant digits: values 1000 ± 1e-3 are only noise there (and half has 3)
        centers = [(0, 1), (1000, 10), (-30, 0.1), (0, 100)] + [(1000, 1e-3)] * (dtype == f64)
        center, spread = rng.choice(centers if dtype not in HALF else [(0, 1), (2, 10)])
        eps = rng.choice([1e-5, 1e-6, 0.1])
        x = center + _randn(g, *shape, dtype=f64) * spread
        if rng.random() < 0.3 and len(shape) > 1:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        C = shape[-1]
        cases.append(
            _layer_norm_case(
                f"random #{i}: {str(dtype)[6:]}, values {center:g} ± {spread:g}, eps {eps:g}",
                x.to(dtype),
                (1 + _randn(g, C, dtype=f64)).to(dtype),
                _randn(g, C, dtype=dtype),
                eps,
            )
        )
    cases += [
        engine_case("layer_norm", torch.float32, seed, eps=1e-3),
        engine_case("layer_norm", torch.bfloat16, seed + 1, last_only=True),
    ]
    run, judge = with_engine_runs(fn, layer_norm_accuracy, LAYER_NORM_CONTRACT, LAYER_NORM_MISTAKES)
    run_check(
        "layer_norm",
        run,
        cases,
        judge=judge,
        error_hints=VIEW_HINTS,
        forbid=[*NO_LAYER_NORM, *ENGINE_PARTS[:1], NO_LIBRARIES[0]],
        show_call=_show_layer_norm,
        seconds=5,
        total_seconds=30,
    )


VIEW_HINTS = {
    "view size is not compatible": "x may be a non-contiguous view (a transposed or sliced tensor, as the engine "
    "passes): use .reshape() (or .contiguous().view()) instead of .view()"
}


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


def _gelu_tanh_by_exp_in_half(x):
    if x.dtype not in HALF:
        raise ValueError("float32's overflow has a case hint of its own (large values ±20)")
    e = torch.exp(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))
    return 0.5 * x * (1 + (e - 1) / (e + 1))


GELU_MISTAKES = [
    (
        _gelu_erf,
        "this is GELU's exact (erf) form, 0.5·x·(1 + erf(x/√2)); GPT-2 uses the tanh approximation "
        "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) — they differ by up to about 5e-4",
    ),
    (
        _gelu_sigmoid,
        "this is the sigmoid approximation x·σ(1.702x); GPT-2 uses the tanh one: "
        "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))",
    ),
    (_gelu_no_half, "the formula starts with 0.5·x"),
    (_gelu_coefficient, "the cubic coefficient is 0.044715 (not 0.44715)"),
    (_gelu_no_root, "the factor in front is √(2/π) ≈ 0.7979, the square root of 2/π"),
    (
        _gelu_tanh_by_exp_in_half,
        "tanh written with exp overflows in float16: e^(2z) is inf past z ≈ 5.5 (65504 is its largest number), "
        "however z is clamped for float32, and inf / inf is nan. Use torch.tanh (or x·sigmoid(2z), which cannot "
        "overflow)",
    ),
]

# Contract: each output within 8 units of rounding of x's dtype times (|x| + |answer|): every step of the
# formula (x³, the sum, tanh, 1 + tanh, the products) rounds by at most one unit of a value of that size.
GELU_CONTRACT = "gelu may be off by 8 units of rounding of x's dtype times |x| + |gelu(x)|"


def gelu_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    (x,) = args
    X = _wide(x)
    exact = P.gelu(X)
    return exact, 8 * _u(x) * (X.abs() + exact.abs()) + _floor(x)


def check_gelu(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """gelu(x): GPT-2's GELU, the tanh approximation, elementwise; same shape and dtype as x (float32, float64,
    float16 or bfloat16; any shape, contiguous or not). The last cases run it inside the engine."""
    g = torch.Generator().manual_seed(seed)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16

    def case(description, x, hint=""):
        return Case(description, (x,), later(in_float64, P.gelu, x), hint)

    cases = [
        case("a few values", torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0])),
        case("float64, -6 to 6 in steps of 0.125", torch.linspace(-6, 6, 97, dtype=f64), "float64 in, float64 out"),
        case("a batch [2, 3, 5]", _randn(g, 2, 3, 5) * 2),
        case(
            "large values ±20",
            torch.tensor([-20.0, -10.0, 10.0, 20.0]),
            "for x = 20 the argument of tanh is about 300: e^600 overflows, so write tanh with torch.tanh "
            "(or a formula that cannot overflow)",
        ),
        case(
            "very large values ±1e4 (float32)",
            torch.tensor([-1e4, -1e3, 1e3, 1e4]),
            "gelu(x) is x for large x and 0 for very negative x; x³ may overflow to inf, tanh(inf) is 1",
        ),
        case("tiny values", torch.tensor([-1e-8, 1e-8, -1e-30, 1e-30], dtype=f64)),
        case("zeros", torch.zeros(2, 3)),
        case("float64 [2, 4, 8]", _randn(g, 2, 4, 8, dtype=f64) * 3),
        case(
            "x a non-contiguous view [3, 4, 6] (a transposed tensor)",
            _transposed(g, 3, 4, 6) * 2,
            "x may be a view whose elements are not contiguous: .view() fails on it, elementwise operations work",
        ),
        case(
            "float16 [2, 5, 64], as a float16 model runs it",
            (_randn(g, 2, 5, 64) * 2).half(),
            "float16 in, float16 out",
        ),
        case(
            "bfloat16 [2, 3, 768] (4C of the bundled model)",
            (_randn(g, 2, 3, 768) * 2).bfloat16(),
            "bfloat16 in, bfloat16 out",
        ),
        case(
            "float16, large values ±30 (x³ = 27000 is near float16's largest number, 65504)",
            torch.tensor([-30.0, -12.0, 12.0, 30.0], dtype=f16),
        ),
        case(
            "float16, x³ past float16's largest number (±50, ±300: x³ is ±inf, and tanh(±inf) = ±1)",
            torch.tensor([-300.0, -50.0, 50.0, 300.0], dtype=f16),
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64, torch.float32, f64, f16, bf16)[i % 6]
        shape = [rng.randint(1, 4) for _ in range(1 + i % 3)]
        x = _randn(g, *shape, dtype=dtype) * 10 ** (i % 3 - 1)
        if len(shape) > 1 and rng.random() < 0.3:
            x = x.transpose(0, -1)
        cases.append(case(f"random #{i}: {str(dtype)[6:]} {list(x.shape)}, spread {10 ** (i % 3 - 1):g}", x))
    cases += [engine_case("gelu", torch.float32, seed), engine_case("gelu", torch.float16, seed + 1, last_only=True)]
    run, judge = with_engine_runs(fn, gelu_accuracy, GELU_CONTRACT, GELU_MISTAKES)

    def show(args):
        return args[0].show() if isinstance(args[0], EngineRun) else f"gelu({short(args[0], 90)})"

    run_check(
        "gelu",
        run,
        cases,
        judge=judge,
        forbid=[*NO_GELU, *ENGINE_PARTS[1:2], NO_LIBRARIES[0]],  # transformers: ACT2FN["gelu_new"]
        seconds=5,
        total_seconds=20,
        error_hints=VIEW_HINTS,
        show_call=show,
    )


# ----------------------------------------------------------------------------------------------
# Linear (Conv1D layout)


def _linear_transposed(x, weight, bias):
    return x @ weight.T + bias


def _linear_bias_first(x, weight, bias):
    return (x + bias) @ weight


def _linear_no_bias(x, weight, bias):
    return x @ weight


LINEAR_MISTAKES = [
    (
        _linear_transposed,
        "GPT-2 stores the weight as [C_in, C_out] (HF's Conv1D): the answer is x @ weight + bias, with no transpose "
        "(nn.Linear's layout [C_out, C_in] is the other one)",
    ),
    (_linear_bias_first, "multiply first, then add the bias: x @ weight + bias"),
    (_linear_no_bias, "add the bias: x @ weight + bias"),
]

# Contract: each output within 8·√C_in units of rounding of x's dtype times |x| @ |weight| + |bias|, the size
# of the terms summed (a dot product of C_in terms, summed in any order, float32 or wider accumulation).
LINEAR_CONTRACT = (
    "linear may be off by 8·√C_in units of rounding of x's dtype times |x| @ |weight| + |bias| (the size "
    "of the terms it sums)"
)


def linear_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x, weight, bias = args
    X, W, B = _wide(x), _wide(weight), _wide(bias)
    exact = X @ W + B
    size = X.abs() @ W.abs() + B.abs()
    return exact, 8 * _u(x) * math.sqrt(x.shape[-1]) * size + _floor(x)


def _show_linear(args: tuple) -> str:
    if isinstance(args[0], EngineRun):
        return args[0].show()
    x, weight, bias = args
    return f"linear(x={_desc(x)}, weight={_desc(weight)}, bias={_desc(bias)})"


def check_linear(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """linear(x, weight, bias) = x @ weight + bias, weight [C_in, C_out]; x [..., C_in] -> [..., C_out], from
    1-D x [C_in] up, contiguous or not, in x's dtype (float32, float64, float16, bfloat16). The last cases run
    it inside the engine."""
    g = torch.Generator().manual_seed(seed)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16

    def case(description, x, c_out, hint="", dtype=None):
        dtype = dtype or x.dtype
        c_in = x.shape[-1]
        weight, bias = _randn(g, c_in, c_out, dtype=dtype), _randn(g, c_out, dtype=dtype)
        return Case(description, (x, weight, bias), later(in_float64, P.linear, x, weight, bias), hint)

    cases = [
        case("2-D x [3, 4], weight [4, 5]", _randn(g, 3, 4), 5, "weight is [C_in, C_out]: x @ weight has shape [3, 5]"),
        case(
            "a square weight [4, 4]",
            _randn(g, 2, 4),
            4,
            "with a square weight a transposed one has the right shape but the wrong values",
        ),
        case(
            "a 4-D input [2, 2, 3, 4]",
            _randn(g, 2, 2, 3, 4),
            6,
            "x may have any number of leading dimensions: [..., C_in] -> [..., C_out]",
        ),
        case("one vector x [4] (no leading dimensions)", _randn(g, 4), 3),
        case("float64 [2, 3, 8] x [8, 8]", _randn(g, 2, 3, 8, dtype=f64), 8, "float64 in, float64 out"),
        case("C_out = 1", _randn(g, 2, 5), 1),
        case("one row x [1, 8]", _randn(g, 1, 8), 24),
        case(
            "x a non-contiguous view [2, 5, 6] (a transposed tensor)",
            _transposed(g, 2, 5, 6),
            18,
            "x may be a view whose rows are not contiguous: .view() fails on it, reshape and @ work",
        ),
        case(
            "float16 x [2, 5, 64] and weight [64, 192], as a float16 model runs it",
            _randn(g, 2, 5, 64, dtype=f16),
            192,
            "float16 in, float16 out",
        ),
        case(
            "bfloat16 x [3, 192] and weight [192, 576] (c_attn of the bundled model)",
            _randn(g, 3, 192, dtype=bf16),
            576,
            "bfloat16 in, bfloat16 out",
        ),
        case("a 1-D float16 x [48]", _randn(g, 48, dtype=f16), 16),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        dtype = (torch.float32, f64, torch.float32, f64, f16, bf16)[i % 6]
        shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 3))] + [rng.choice([1, 3, 8, 64, 192])]
        x = _randn(g, *shape, dtype=dtype) * rng.choice([0.1, 1, 10])
        if len(shape) > 1 and rng.random() < 0.3:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        cases.append(
            case(
                f"random #{i}: {str(dtype)[6:]}{', not contiguous' * (not x.is_contiguous())}",
                x,
                rng.choice([1, 4, shape[-1], 3 * shape[-1]]),
            )
        )
    cases += [
        engine_case("linear", torch.float32, seed),
        engine_case("linear", torch.bfloat16, seed + 1, last_only=True),
    ]
    run, judge = with_engine_runs(fn, linear_accuracy, LINEAR_CONTRACT, LINEAR_MISTAKES)
    run_check(
        "linear",
        run,
        cases,
        judge=judge,
        error_hints={
            "cannot be multiplied": "weight is [C_in, C_out] (GPT-2's Conv1D layout): x [..., C_in] @ weight gives "
            "[..., C_out], no transpose; add the bias after the product",
            "values to unpack": "x may have any number of leading dimensions ([C_in], [T, C_in], [B, T, C_in], ...): "
            "x @ weight works for all of them",
            "must be a matrix": "x may have any number of leading dimensions, none too ([C_in]): "
            "x @ weight works for all "
            "of them (addmm and mm take matrices only)",
            **VIEW_HINTS,
        },
        forbid=[*ENGINE_PARTS[2:], *NO_KERNELS, NO_LIBRARIES[0]],
        show_call=_show_linear,
        seconds=5,
        total_seconds=20,
    )


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

# Contract: each output within 8·(√C + √4C) units of rounding of x's dtype times the size of what it sums:
# (1.13·(|x| @ |c_fc_weight| + |c_fc_bias|)) @ |c_proj_weight| + |c_proj_bias| (1.13 bounds GELU's slope, so an
# error in c_fc's output grows by at most that much; each linear layer is a dot product, see linear's contract).
MLP_CONTRACT = (
    "mlp may be off by 8·(√C + √4C) units of rounding of x's dtype times (1.13·(|x| @ |c_fc_weight| + "
    "|c_fc_bias|)) @ |c_proj_weight| + |c_proj_bias|, the size of the terms its two layers sum"
)


def mlp_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x, w1, b1, w2, b2 = args
    X, W1, B1, W2, B2 = map(_wide, args)
    exact = P.linear(P.gelu(P.linear(X, W1, B1)), W2, B2)
    size = (1.13 * (X.abs() @ W1.abs() + B1.abs())) @ W2.abs() + B2.abs()
    C = x.shape[-1]
    return exact, 8 * _u(x) * (math.sqrt(C) + math.sqrt(4 * C)) * size + _floor(x)


def _show_mlp(args: tuple) -> str:
    x, w1, b1, w2, b2 = args
    return (
        f"mlp(x={_desc(x)}, c_fc_weight={_desc(w1)}, c_fc_bias={_desc(b1)}, c_proj_weight={_desc(w2)}, "
        f"c_proj_bias={_desc(b2)})"
    )


def _layer_weights(g: torch.Generator, n_in: int, n_out: int, dtype) -> tuple[Tensor, Tensor]:
    """A linear layer's weight [n_in, n_out] and bias that keep activations around 1 (so mistakes show)."""
    return (_randn(g, n_in, n_out, dtype=torch.float64) / math.sqrt(n_in)).to(dtype), (
        _randn(g, n_out, dtype=torch.float64) * 0.5
    ).to(dtype)


def check_mlp(fn, *, seed: int = 0, n_random: int = 4) -> None:
    """mlp(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias) = linear(gelu(linear(x, c_fc)), c_proj), for
    any x [..., C] (1-D to 4-D, contiguous or not) in its dtype (float32, float64, float16, bfloat16)."""
    g = torch.Generator().manual_seed(seed)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16

    def case(description, shape, dtype=torch.float32, hint="", transposed=False):
        C = shape[-1]
        x = ((_transposed if transposed else _randn)(g, *shape, dtype=f64) * 2).to(dtype)
        args = (x, *_layer_weights(g, C, 4 * C, dtype), *_layer_weights(g, 4 * C, C, dtype))
        return Case(description, args, later(in_float64, reference_mlp, *args), hint)

    cases = [
        case("x [1, 3, 4]: C = 4, hidden 16", [1, 3, 4]),
        case("a batch [2, 5, 8]", [2, 5, 8]),
        case("float64 [2, 3, 6]", [2, 3, 6], f64, "float64 in, float64 out"),
        case(
            "a 1-D x [8] (one position)", [8], hint="x may have any number of leading dimensions: [..., C] -> [..., C]"
        ),
        case("a 2-D x [5, 12]", [5, 12]),
        case("a 4-D x [2, 2, 3, 8]", [2, 2, 3, 8]),
        case(
            "x a non-contiguous view [2, 4, 8] (a transposed tensor)",
            [2, 4, 8],
            transposed=True,
            hint="x may be a view whose rows are not contiguous: .view() fails on it, reshape and @ work",
        ),
        case("float16 [2, 5, 64], as a float16 model runs it", [2, 5, 64], f16, "float16 in, float16 out"),
        case("bfloat16 [1, 3, 192] (the bundled model's width)", [1, 3, 192], bf16, "bfloat16 in, bfloat16 out"),
    ]
    for i in range(n_random):
        shape = [1 + i % 2, 2 + i, (8, 12, 64)[i % 3]][(i % 4 == 3) :]  # 3-D, and 2-D every fourth
        cases.append(
            case(
                f"random #{i}", shape, (torch.float32, f64, torch.float32, f16, f64, bf16)[i % 6], transposed=i % 5 == 4
            )
        )
    run_check(
        "mlp",
        unwritten_helper(fn),
        cases,
        judge=accuracy_judge(mlp_accuracy, MLP_CONTRACT, MLP_MISTAKES),
        forbid=[*COMPOSED, *NO_KERNELS],
        show_call=_show_mlp,
        seconds=5,
        total_seconds=20,
        error_hints={
            **VIEW_HINTS,
            "values to unpack": "x may have any number of leading dimensions ([C], [T, C], "
            "[B, T, C], ...): your linear and gelu work on all of them",
        },
    )


# ----------------------------------------------------------------------------------------------
# The block


BLOCK_KEYS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)


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
    q, k, v = (
        P.split_heads(t, n_head) for t in P.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(C, -1)
    )
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
    (
        _block_post_ln,
        "GPT-2 is pre-LN: normalize the input of each sub-layer and add its output to the unnormalized x — "
        "x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)) — not layer_norm(x + attn(x))",
    ),
    (
        _block_one_residual,
        "each sub-layer adds to the residual stream: x = x + attn(ln_1(x)), then x = x + mlp(ln_2(x))",
    ),
    (_block_no_attention_residual, "add the attention's output to x (the residual connection): x = x + attn(ln_1(x))"),
    (
        _block_ln2_on_input,
        "ln_2 normalizes the stream *after* the attention was added: x = x + attn(ln_1(x)); then mlp(ln_2(x)) with "
        "that new x",
    ),
    (
        _block_parallel,
        "the MLP reads ln_2 of the stream after attention (GPT-2 runs the two sub-layers one after the other, "
        "not in parallel)",
    ),
    (
        _block_not_causal,
        "attention must be causal: pass causal_mask(T, T) to attention, so that position t sees only positions 0..t",
    ),
    (_block_no_c_proj, "after merging the heads, project with attn.c_proj (a linear layer) before adding to x"),
    (
        _block_heads_reshaped,
        "a reshape of [B, T, C] to [B, H, T, D] mixes positions and heads: use split_heads (a view to [B, T, H, D], "
        "then a transpose) and merge_heads",
    ),
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
    for name, n_in, n_out in (
        ("attn.c_attn", C, 3 * C),
        ("attn.c_proj", C, C),
        ("mlp.c_fc", C, 4 * C),
        ("mlp.c_proj", 4 * C, C),
    ):
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


# Contract for whole blocks and models: each output within K·√C units of rounding of the input's dtype times
# the largest value that goes in or comes out (layer norms, attention and MLPs in any correct order of
# operations stay well inside it, measured on the engine's own float32 / float16 / bfloat16 runs).
BLOCK_K = 16
BLOCK_CONTRACT = (
    "block may be off by 16·√C units of rounding of x's dtype times the largest |value| of x and of the answer"
)


def block_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    x, weights, n_head, *rest = args
    eps = rest[0] if rest else 1e-5
    exact = reference_block(_wide(x), _wide(weights), n_head, eps)
    size = max(x.detach().double().abs().max().item(), exact.abs().max().item())
    allowed = BLOCK_K * _u(x) * math.sqrt(x.shape[-1]) * size
    return exact, torch.full_like(exact, allowed)


def _block_eps_fixed(x, w, n_head, eps=1e-5):
    return reference_block(x, w, n_head, 1e-5)


BLOCK_MISTAKES.append(
    (_block_eps_fixed, "pass eps to both layer norms (ln_1 and ln_2): a model's layer_norm_epsilon is not always 1e-5")
)


def _show_block(args: tuple) -> str:
    x, weights, n_head, *rest = args
    eps = f", eps={rest[0]:g}" if rest else ""
    return f"block(x={_desc(x)}, weights={weights!r}, n_head={n_head}{eps})"


def check_block(fn, *, seed: int = 0, n_random: int = 3) -> None:
    """block(x, weights, n_head, eps=1e-5): GPT-2's pre-LN block, x [B, T, C] -> [B, T, C] in x's dtype
    (float32, float64, float16, bfloat16), also called without eps (the default must be GPT-2's 1e-5)."""
    g = torch.Generator().manual_seed(seed)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16

    def case(description, B, T, C, n_head, dtype=torch.float32, hint="", eps=1e-5, scale=1.0, transposed=False):
        x = ((_transposed if transposed else _randn)(g, B, T, C, dtype=f64) * scale).to(dtype)
        w = _Weights(
            block_weights(C, seed=int(torch.randint(1 << 30, (1,), generator=g)), dtype=dtype),
            f"<weights of one block, C={C}, {str(dtype)[6:]}>",
        )
        args = (x, w, n_head) if eps is None else (x, w, n_head, eps)
        return Case(description, args, later(in_float64, reference_block, x, w, n_head, eps or 1e-5), hint)

    cases = [
        case("one position (T = 1), C = 8, 2 heads", 1, 1, 8, 2),
        case("x [1, 4, 8], 2 heads", 1, 4, 8, 2),
        case("a batch of 2, T = 5, C = 12, 3 heads", 2, 5, 12, 3),
        case("float64 [2, 3, 16], 4 heads", 2, 3, 16, 4, f64, "float64 in, float64 out"),
        case(
            "eps = 0.1 (a model whose layer_norm_epsilon is not 1e-5)",
            2,
            4,
            8,
            2,
            eps=0.1,
            hint="both layer norms use the eps given to block",
        ),
        case(
            "called as block(x, weights, n_head), without eps; x small (variance 1e-4)",
            1,
            5,
            8,
            2,
            f64,
            eps=None,
            scale=1e-2,
            hint="eps's default is GPT-2's layer_norm_epsilon, 1e-5",
        ),
        case("x a non-contiguous view [2, 3, 8] (a transposed tensor)", 2, 3, 8, 2, transposed=True),
        case(
            "T = 300 positions, C = 8, 4 heads (head size 2)",
            1,
            300,
            8,
            4,
            hint="position t attends to positions 0..t, however many there are",
        ),
        case("float16 [2, 5, 32], 4 heads, as a float16 model runs it", 2, 5, 32, 4, f16, "float16 in, float16 out"),
        case("bfloat16 [1, 6, 24], 3 heads, eps 1e-3", 1, 6, 24, 3, bf16, "bfloat16 in, bfloat16 out", eps=1e-3),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n_head = rng.choice([1, 2, 4, 12])
        C = n_head * rng.choice([4, 8, 16])
        dtype = (torch.float32, f64, torch.float32, bf16, f64, f16)[i % 6]
        cases.append(
            case(
                f"random #{i}: {str(dtype)[6:]}, C = {C}, {n_head} heads",
                rng.randint(1, 3),
                rng.randint(2, 9),
                C,
                n_head,
                dtype,
                eps=rng.choice([1e-5, 1e-5, 1e-3, None]),
            )
        )
    run_check(
        "block",
        unwritten_helper(fn),
        cases,
        judge=accuracy_judge(block_accuracy, BLOCK_CONTRACT, BLOCK_MISTAKES),
        forbid=COMPOSED,
        show_call=_show_block,
        seconds=10,
        total_seconds=30,
        error_hints=VIEW_HINTS,
    )


# ----------------------------------------------------------------------------------------------
# The full forward pass


def lively_state_dict(
    config: GPT2Config, *, seed: int = 0, dtype=torch.float32, boost: float = 10.0
) -> dict[str, Tensor]:
    """A random GPT-2 state dict with the engine's key names whose logits vary a lot from position to
    position (GPT-2's own init makes a random model nearly ignore the positions and the blocks): the
    linear weights are `boost` times GPT-2's init, and no layer norm weight is 1, no bias 0."""
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
        # no parameter left at its initial value (1 or 0): a part that skips one (ln_f's affine, a bias) shows
        for name, p in model.named_parameters():
            if name.endswith("bias") and not p.abs().max() > 0:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()}


def config_of(state_dict: dict, n_head: int) -> GPT2Config:
    """The GPT-2 configuration a state dict (engine key names) was made for."""
    vocab_size, n_embd = state_dict["wte.weight"].shape
    n_layer = len({k.split(".")[1] for k in state_dict if k.startswith("h.")})
    return GPT2Config(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        n_positions=state_dict["wpe.weight"].shape[0],
    )


def reference_forward(
    state_dict: dict,
    input_ids: Tensor,
    n_head: int,
    eps: float = 1e-5,
    *,
    order: Optional[list[int]] = None,
    final_norm: bool = True,
    positions: bool = True,
    final_affine: bool = True,
) -> Tensor:
    """The engine's logits [B, T, vocab] for a state dict; the keyword arguments make known mistakes."""
    config = config_of(state_dict, n_head)
    if order is None and final_norm and positions and final_affine:
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
            w, b = (sd["ln_f.weight"], sd["ln_f.bias"]) if final_affine else (None, None)
            x = P.layer_norm(x, w, b, eps)
        return x @ sd["wte.weight"].T


def _forward_string_order(sd, ids, n_head, eps=1e-5):
    n_layer = config_of(sd, n_head).n_layer
    return reference_forward(sd, ids, n_head, eps, order=sorted(range(n_layer), key=str))


def _forward_reversed(sd, ids, n_head, eps=1e-5):
    return reference_forward(sd, ids, n_head, eps, order=list(reversed(range(config_of(sd, n_head).n_layer))))


def _forward_first_ten(sd, ids, n_head, eps=1e-5):
    return reference_forward(sd, ids, n_head, eps, order=list(range(min(10, config_of(sd, n_head).n_layer))))


FORWARD_MISTAKES = [
    (
        lambda sd, ids, h, eps=1e-5: reference_forward(sd, ids, h, eps, final_norm=False),
        "apply the final layer norm ln_f before the head",
    ),
    (
        lambda sd, ids, h, eps=1e-5: reference_forward(sd, ids, h, eps, final_affine=False),
        "ln_f has a weight and a bias too: layer_norm(x, ln_f.weight, ln_f.bias, eps) before the head",
    ),
    (
        lambda sd, ids, h, eps=1e-5: reference_forward(sd, ids, h, eps, positions=False),
        "add the position embeddings: x = wte[ids] + wpe[0, 1, ..., T-1]",
    ),
    (
        _forward_string_order,
        "run the blocks in order h.0, h.1, ..., h.11: sorting the keys as strings puts h.10 before h.2",
    ),
    (
        _forward_first_ten,
        "run every block: h.10 and h.11 too (count the layers from the keys; their numbers may have two digits)",
    ),
    (_forward_reversed, "run the blocks in order h.0, h.1, ... (not reversed)"),
    (
        lambda sd, ids, h, eps=1e-5: reference_forward(sd, ids, h, 1e-5),
        "pass eps to every layer norm (ln_1, ln_2 of each block and ln_f): a model's layer_norm_epsilon is not "
        "always 1e-5",
    ),
]

# Contract: the logits within 16·√C units of rounding of the weights' dtype times the largest |logit|.
FORWARD_K = 16
FORWARD_CONTRACT = (
    "gpt2_forward may be off by 16·√C units of rounding of the weights' dtype (C = n_embd) times the largest |logit|"
)


_EXACT: dict = {}  # the last exact forward pass, by its arguments' identities (a 124M-parameter one takes seconds)


def _exact_forward(sd: dict, ids: Tensor, n_head: int, eps: float) -> Tensor:
    key = (id(sd), id(ids), n_head, eps)
    if key not in _EXACT:
        _EXACT.clear()
        _EXACT[key] = reference_forward(_wide(dict(sd)), ids, n_head, eps)
    return _EXACT[key]


def forward_accuracy(args: tuple) -> tuple[Tensor, Tensor]:
    sd, ids, n_head, *rest = args
    exact = _exact_forward(sd, ids, n_head, rest[0] if rest else 1e-5)
    wte = sd["wte.weight"]
    allowed = FORWARD_K * _u(wte) * math.sqrt(wte.shape[1]) * exact.abs().max().item()
    return exact, torch.full_like(exact, allowed)


def _show_forward(args: tuple) -> str:
    sd, ids, n_head, *rest = args
    eps = f", eps={rest[0]:g}" if rest else ""
    return f"gpt2_forward(state_dict={sd!r}, input_ids={_desc(ids)} {short(ids.tolist(), 60)}, n_head={n_head}{eps})"


def _judge_forward() -> Callable[[Case, Any], Verdict]:
    base = accuracy_judge(forward_accuracy, FORWARD_CONTRACT, FORWARD_MISTAKES)

    def judge(case: Case, got: Any) -> Verdict:
        verdict = base(case, got)
        if verdict is None or verdict[1]:
            return verdict
        sd, ids, n_head, *rest = case.args
        eps = rest[0] if rest else 1e-5
        B, T = ids.shape
        if isinstance(got, Tensor) and got.shape == case.expected.shape and B > 1 and T > 1:
            rows = [reference_forward(sd, ids[b : b + 1], n_head, eps) for b in range(B)]
            if same_answer(got[:1], rows[0]) and not same_answer(got, torch.cat(rows)):
                return verdict[0], (
                    "the first sequence is right but not the others: each row of input_ids is its "
                    "own sequence, with positions 0..T-1 (torch.arange(T), not numel())"
                )
        return verdict[0], case.hint or (
            "check the tied head — logits = ln_f(x) @ wte.weight.T, GPT-2 has no separate lm_head — "
            "and the embeddings: x = wte[input_ids] + wpe[positions]"
        )

    return judge


def _forward_case(
    description: str,
    config: GPT2Config,
    B: int,
    T: int,
    seed: int,
    dtype=torch.float32,
    hint: str = "",
    boost: float = 10.0,
    eps: Optional[float] = 1e-5,
    special: bool = False,
) -> Case:
    sd = _Weights(
        lively_state_dict(config, seed=seed, dtype=dtype, boost=boost),
        f"<GPT-2 weights: {config.n_layer} layers, n_embd {config.n_embd}, vocab {config.vocab_size}, "
        f"{config.n_positions} positions, {str(dtype)[6:]}>",
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab_size, (B, T), generator=g)
    if special:  # token 0 (an EOS id elsewhere) and the last one (<|endoftext|> in GPT-2's vocabulary) are tokens too
        ids[0, 0], ids[-1, -1], ids[0, -1] = config.vocab_size - 1, 0, config.vocab_size - 1
    args = (sd, ids, config.n_head) if eps is None else (sd, ids, config.n_head, eps)
    return Case(description, args, later(lambda: _exact_forward(sd, ids, config.n_head, eps or 1e-5).to(dtype)), hint)


def check_gpt2_forward(
    fn, *, seed: int = 0, n_random: int = 2, gpt2_124m: bool = False, transformers: bool = False
) -> None:
    """gpt2_forward(state_dict, input_ids, n_head, eps=1e-5) -> logits [B, T, vocab_size], equal to the engine's,
    in the weights' dtype (float32, float64, float16, bfloat16); also called without eps (default 1e-5).

    `gpt2_124m`: one more case with the real GPT-2 small shapes (12 layers, 12 heads, 768, vocab 50257);
    `transformers`: the learner's float32 logits also compared with transformers' GPT2LMHeadModel.
    """
    tiny = dict(n_positions=32, vocab_size=101)
    f64, f16, bf16 = torch.float64, torch.float16, torch.bfloat16
    cases = [
        _forward_case(
            "one sequence of 4 tokens, 2 layers, n_embd 16, 2 heads",
            GPT2Config(n_layer=2, n_head=2, n_embd=16, **tiny),
            1,
            4,
            seed,
        ),
        _forward_case(
            "a batch of 3 sequences of 5 tokens",
            GPT2Config(n_layer=2, n_head=4, n_embd=16, **tiny),
            3,
            5,
            seed + 1,
            hint="each row of input_ids is one sequence; positions are 0..T-1 in every row",
        ),
        _forward_case(
            "12 layers (like GPT-2 small), n_embd 8", GPT2Config(n_layer=12, n_head=2, n_embd=8, **tiny), 2, 3, seed + 2
        ),
        _forward_case(
            "float64 weights",
            GPT2Config(n_layer=1, n_head=2, n_embd=8, **tiny),
            2,
            4,
            seed + 3,
            f64,
            "float64 in, float64 out",
        ),
        _forward_case(
            "eps = 1e-3 (a model whose layer_norm_epsilon is not 1e-5)",
            GPT2Config(n_layer=2, n_head=2, n_embd=8, **tiny),
            2,
            4,
            seed + 4,
            eps=1e-3,
            hint="every layer norm (ln_1, ln_2 and ln_f) uses the eps given",
        ),
        _forward_case(
            "called as gpt2_forward(state_dict, input_ids, n_head), without eps (float64 weights)",
            GPT2Config(n_layer=2, n_head=2, n_embd=8, **tiny),
            1,
            5,
            seed + 5,
            f64,
            eps=None,
            hint="eps's default is GPT-2's layer_norm_epsilon, 1e-5",
        ),
        _forward_case(
            "GPT-2's vocabulary (50257): tokens 0 and 50256 (<|endoftext|>) in the prompt",
            GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=50257),
            2,
            3,
            seed + 6,
            special=True,
            hint="every id is a row of wte, the special ones too",
        ),
        _forward_case(
            "300 tokens (positions past 255), 1 layer, n_embd 8",
            GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=512, vocab_size=101),
            1,
            300,
            seed + 7,
        ),
        _forward_case(
            "float16 weights (as load_model(dtype=torch.float16) holds them)",
            GPT2Config(n_layer=2, n_head=2, n_embd=16, **tiny),
            2,
            4,
            seed + 8,
            f16,
            "float16 in, float16 out",
        ),
        _forward_case(
            "bfloat16 weights",
            GPT2Config(n_layer=2, n_head=2, n_embd=8, **tiny),
            1,
            5,
            seed + 9,
            bf16,
            "bfloat16 in, bfloat16 out",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n_head = rng.choice([1, 2, 3])
        config = GPT2Config(
            n_layer=rng.choice([1, 2, 3]),
            n_head=n_head,
            n_embd=n_head * rng.choice([4, 8]),
            n_positions=rng.choice([16, 64]),
            vocab_size=rng.choice([7, 300, 1000]),
        )
        cases.append(
            _forward_case(
                f"random #{i}: {config.n_layer} layers",
                config,
                rng.randint(1, 3),
                rng.randint(1, 16),
                seed + 10 + i,
                eps=rng.choice([1e-5, 1e-5, 1e-4, None]),
            )
        )
    if gpt2_124m:
        cases.append(
            _forward_case(
                "GPT-2 small's shapes: 12 layers, 12 heads, n_embd 768, vocab 50257",
                GPT2Config(),
                2,
                8,
                seed + 20,
                boost=3.0,
            )
        )
    judge = _judge_forward()
    if transformers:
        judge = also_reference(judge, _transformers_logits, forward_accuracy)
    run_check(
        "gpt2_forward",
        unwritten_helper(fn),
        cases,
        judge=judge,
        forbid=COMPOSED,
        show_call=_show_forward,
        seconds=20,
        total_seconds=60,
    )


def hf_logits(state_dict: dict, input_ids: Tensor, n_head: int, eps: float = 1e-5) -> Tensor:
    """Logits of transformers' GPT2LMHeadModel with these weights (the engine's key names)."""
    import transformers  # heavy (seconds to import): only for the hidden comparison with transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = config_of(state_dict, n_head)
    hf_config = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_head=n_head,
        n_embd=config.n_embd,
        n_positions=config.n_positions,
        vocab_size=config.vocab_size,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        layer_norm_epsilon=eps,
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(hf_config)
    weights = {f"transformer.{k}": v for k, v in state_dict.items()}
    model.load_state_dict({**weights, "lm_head.weight": state_dict["wte.weight"]}, strict=False, assign=True)
    model.tie_weights()
    model = model.to(state_dict["wte.weight"].dtype).eval()
    with torch.no_grad():
        return model(input_ids).logits


def _transformers_logits(case: Case) -> tuple[str, Tensor]:
    """transformers' logits (in float64, from the same weights) for a forward case."""
    sd, ids, n_head, *rest = case.args
    return "transformers' GPT2LMHeadModel", hf_logits(_wide(dict(sd)), ids, n_head, rest[0] if rest else 1e-5)


# ----------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint


def _save(folder: Path, config: GPT2Config, tensors: dict[str, Tensor]) -> Path:

    folder.mkdir(parents=True)
    config.to_json(folder / "config.json")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    return folder


def _hf_save_pretrained(folder: Path, state_dict: dict, config: GPT2Config) -> Path:
    """What transformers' save_pretrained writes for these weights."""
    import transformers  # heavy (seconds to import): only for the hidden comparison with transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hf_config = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        n_positions=config.n_positions,
        vocab_size=config.vocab_size,
    )
    model = transformers.GPT2LMHeadModel(hf_config)
    weights = {f"transformer.{k}": v for k, v in state_dict.items()}
    model.load_state_dict({**weights, "lm_head.weight": state_dict["wte.weight"]}, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return folder


def checkpoint_folders(root: Path, *, seed: int = 0, transformers: bool = False) -> list[tuple[str, Path]]:
    """Model folders in each layout a GPT-2 checkpoint comes in, with random weights: (description, folder).
    Among them 12 layers (keys h.10.*, h.11.*: two digits), files stored in float16, bfloat16 and float64, and other
    *.safetensors files beside model.safetensors that are not the model's (a LoRA adapter, an optimizer's state)."""
    out = []
    configs = [
        GPT2Config(n_layer=2, n_head=2, n_embd=8, n_positions=16, vocab_size=50),
        GPT2Config(n_layer=3, n_head=3, n_embd=12, n_positions=8, vocab_size=20),
        GPT2Config(n_layer=12, n_head=1, n_embd=4, n_positions=8, vocab_size=20),
    ]
    for n, config in enumerate(configs):
        sd = lively_state_dict(config, seed=seed + n)
        prefixed = {f"transformer.{k}": v for k, v in sd.items()}
        out.append(
            (
                f"as llmcourse.save_model writes it ({config.n_layer} layers): keys 'transformer.…', no lm_head.weight",
                _save(root / f"save_model-{n}", config, prefixed),
            )
        )
        if n < 2:
            out.append(
                (
                    "with lm_head.weight stored too (equal to wte.weight)",
                    _save(root / f"with-lm_head-{n}", config, {**prefixed, "lm_head.weight": sd["wte.weight"].clone()}),
                )
            )
        old = dict(sd)
        mask = torch.tril(torch.ones(config.n_positions, config.n_positions)).view(1, 1, config.n_positions, -1)
        for i in range(config.n_layer):
            old[f"h.{i}.attn.bias"], old[f"h.{i}.attn.masked_bias"] = mask.clone(), torch.tensor(-1e4)
        out.append(
            (
                f"in the old OpenAI style of the Hub's 'gpt2' ({config.n_layer} layers): keys without "
                "'transformer.', with the buffers h.N.attn.bias and h.N.attn.masked_bias",
                _save(root / f"openai-style-{n}", config, old),
            )
        )
        if n == 0:
            half = {k: v.half() for k, v in prefixed.items()}
            out.append(
                (
                    "stored in float16 (like the bundled model: half the file size)",
                    _save(root / "float16", config, half),
                )
            )
        if n == 1:
            out.append(
                ("stored in bfloat16", _save(root / "bfloat16", config, {k: v.bfloat16() for k, v in prefixed.items()}))
            )
            out.append(("stored in float64", _save(root / "float64", config, {k: v.double() for k, v in old.items()})))
        if transformers and n < 2:
            out.append(
                (
                    "as transformers' save_pretrained writes it",
                    _hf_save_pretrained(root / f"save_pretrained-{n}", sd, config),
                )
            )
        if n == 0:
            out += _folders_with_strays(root, config, prefixed, seed=seed)
    return out


def _folders_with_strays(root: Path, config: GPT2Config, prefixed: dict[str, Tensor], *, seed: int):
    """Two folders whose model.safetensors has other *.safetensors files beside it, as fine-tuning and training
    leave them: a LoRA adapter (other names, sorted before model.safetensors) and an optimizer's moments (the
    weights' own names, other values, sorted after it). Only model.safetensors is the model (the engine's rule)."""
    g = torch.Generator().manual_seed(seed + 50)
    rank = 2
    adapter = {}
    for i in range(config.n_layer):
        stem = f"base_model.model.transformer.h.{i}.attn.c_attn"
        adapter[f"{stem}.lora_A.weight"] = _randn(g, rank, config.n_embd)
        adapter[f"{stem}.lora_B.weight"] = _randn(g, 3 * config.n_embd, rank)
    moments = {k: _randn(g, *v.shape) for k, v in prefixed.items()}
    return [
        (
            "beside a LoRA adapter, adapter_model.safetensors (keys base_model.model.…lora_A.weight): only "
            "model.safetensors is the model",
            add_stray_file(_save(root / "with-adapter", config, prefixed), "adapter_model.safetensors", adapter),
        ),
        (
            "beside optimizer.safetensors, the optimizer's moments stored under the weights' own names: only "
            "model.safetensors is the model",
            add_stray_file(_save(root / "with-optimizer", config, prefixed), "optimizer.safetensors", moments),
        ),
    ]


def add_stray_file(folder: Path, name: str, tensors: dict[str, Tensor]) -> Path:
    """`folder` with one more safetensors file, `name`, that is not among its weights."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


STRAY_FILES_HINT = (
    "read the files the index lists (its weight_map), or model.safetensors alone: a folder may hold other "
    "*.safetensors files ({names}) that are not this model's weights, so never load every *.safetensors (a glob), "
    "nor the first one in sorted order"
)


def stray_files_hint(folder: Path, sd: dict, expected_sd: dict[str, Tensor], prefixes: Sequence[str]) -> str:
    """STRAY_FILES_HINT naming the folder's stray *.safetensors files (those the engine does not read:
    `weight_files`), if the learner's state dict holds a tensor of one of them: under a name that is not the
    model's, or in place of the model's own tensor of that name; else ''."""
    folder = Path(folder)
    listed = set(weight_files(folder))
    strays = sorted(p for p in folder.glob("*.safetensors") if p not in listed)
    for path in strays:
        for name, tensor in load_file(str(path)).items():
            for key in {name, *(name.removeprefix(prefix) for prefix in prefixes)}:
                got = sd.get(key)
                if got is None or not isinstance(got, Tensor):
                    continue
                if key not in expected_sd:
                    return STRAY_FILES_HINT.format(names=", ".join(p.name for p in strays))
                want = expected_sd[key]
                if got.shape == tensor.shape and not torch.equal(got.to(want.dtype), want):
                    if torch.equal(got.to(tensor.dtype), tensor):
                        return STRAY_FILES_HINT.format(names=", ".join(p.name for p in strays))
    return ""


def reference_checkpoint(folder) -> tuple[dict[str, Tensor], dict]:
    """(state dict with the engine's key names, config.json as a dict): what the engine's loader reads."""

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    model, state = read_checkpoint(folder, Parts())
    return check_weights(state, model, folder / "model.safetensors"), raw


def _judge_checkpoint(case: Case, got: Any) -> Verdict:
    verdict = _checkpoint_problem(case, got)
    if verdict is None:
        return None
    stray = stray_files_hint(case.args[0], got[0], case.expected[0], ("transformer.",)) if _a_state(got) else ""
    return (verdict[0], stray) if stray else verdict


def _a_state(got: Any) -> bool:
    """Whether `got` is a pair whose first item is a dict (a loader's state dict, right or wrong)."""
    return isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], dict)


def _checkpoint_problem(case: Case, got: Any) -> Verdict:
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
                hint = "h.N.attn.bias and h.N.attn.masked_bias are not weights but old causal-mask buffers: drop them"
            elif key == "lm_head.weight":
                hint = "the head is tied to wte.weight: drop lm_head.weight (the forward pass uses wte.weight)"
            else:
                hint = "keep only the engine's keys"
            return f"unexpected key {key!r}", hint
    missing = [k for k in expected_sd if k not in sd]
    if missing:
        hint = (
            "every block's tensors, h.0 to h.11 here: layer numbers may have two digits (\\d+ in a regular "
            "expression, not \\d)"
            if re.match(r"h\.\d\d", missing[0])
            else "every tensor of the file, renamed without 'transformer.' (see the list of keys in the exercise)"
        )
        return f"the key {missing[0]!r} is missing ({len(missing)} missing in all)", hint
    return tensors_and_config_problem(
        sd,
        config,
        expected_sd,
        expected_config,
        layout="Conv1D weights are stored as [C_in, C_out] already, the layout linear() uses: no transpose",
        dtype=(
            "",
            "convert every tensor to float32 (tensor.float()), whatever the file stores: float16 or bfloat16 "
            "to halve the file, float64 sometimes; the forward pass computes in float32",
        ),
        copy="copy the tensors as they are in the file",
    )


def tensors_and_config_problem(sd, config, expected_sd, expected_config, *, layout, dtype, copy) -> Verdict:
    """A loader's state dict (with the expected keys) and config compared with the expected ones, tensor by tensor:
    type, shape (`layout`: the hint for a transposed one), dtype (`dtype`: what the message adds, the hint),
    values (`copy`: the hint), then the config. Chapters 04 and 11's loaders."""
    for key, want in expected_sd.items():
        tensor = sd[key]
        if not isinstance(tensor, Tensor):
            return f"{key!r} should be a tensor, got {short(tensor, 60)}", ""
        if tensor.shape != want.shape:
            hint = layout if tensor.shape == want.shape[::-1] else ""
            return f"{key!r} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}", hint
        if tensor.dtype != want.dtype:
            return f"{key!r} has dtype {tensor.dtype}, expected {want.dtype}{dtype[0]}", dtype[1]
        if not torch.equal(tensor, want):
            transposed = want.dim() == 2 and want.shape[0] == want.shape[1] and torch.equal(tensor, want.T)
            return f"the values of {key!r} differ from the file's", layout if transposed else copy
    if not isinstance(config, dict):
        return (
            f"the config should be the dict read from config.json, got a {type(config).__name__}",
            "json.loads(Path(folder, 'config.json').read_text())",
        )
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
        run_check(
            "load_gpt2_checkpoint",
            fn,
            cases,
            judge=_judge_checkpoint,
            forbid=NO_LIBRARIES,
            show_call=lambda args: f"load_gpt2_checkpoint({type(args[0]).__name__} '…/{Path(args[0]).name}')",
            seconds=10,
            total_seconds=60,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
