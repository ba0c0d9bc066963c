"""Checks for chapter 05, from logits to the next token: the logits processors (temperature, top-k,
top-p, min-p, repetition penalty), greedy and sampled choice, the whole sampler, beam search and the
generation loop.

Processors are compared with the engine's (`llmcourse.engine.sampling`, itself tested equal to transformers'
logits processors) on random logits with ties, in float32 and float64, batch > 1 and odd vocabulary
sizes; a wrong answer first says which tokens should have been kept. Samplers are tested as samplers:
many seeded draws in one call, and a chi-square test of their frequencies against the expected
distribution (fixed seeds, so a check gives the same verdict every time it runs).

    >>> import torch
    >>> def temperature(logits, t):
    ...     return logits / t
    >>> check_temperature(temperature)
    ✓ temperature — 18 cases

The engine's own functions (and transformers') are the black boxes: passing them fails.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from collections.abc import Iterator
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from llmcourse.course.guards import guarded
from llmcourse.course.limits import TimeUp, time_limit, time_out_message
from llmcourse.engine import sampling as S
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.generate import beam_search as engine_beam_search
from llmcourse.engine.generate import decoded, generate, generate_text, stop_at
from llmcourse.engine.model import GPT2
from llmcourse.engine.sampling import Sampler
from llmcourse.engine.slots import PartError, raised
from llmcourse.engine.tokenizer import EOT_ID, get_tokenizer

from .harness.bundled import bundled_model
from .harness.core import Case, CheckFailed, Verdict, call_learner, failure, later, run_check, unwritten_helper
from .harness.forbid import Forbidden
from .harness.randomness import generator_contract
from .harness.show import short
from .harness.tensors import diagnose, tensor_judge, tensor_problem

# ----------------------------------------------------------------------------------------------
# Black boxes

ENGINE = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "process_logits",
    "next_token",
    "greedy",
    "sample",
)
NO_ENGINE = [
    Forbidden(
        f"llmcourse.engine.sampling.{name}",
        "The engine's version is the black box here: write your own (and use your own functions from this chapter).",
    )
    for name in ENGINE
    if hasattr(S, name)
]
NO_LIBRARIES = [
    Forbidden("transformers", "transformers' logits processors are what your code is compared with: write your own."),
    Forbidden(
        "llmcourse.engine.generate", "The engine's generation loop is what your code is compared with: write your own."
    ),
]
FORBID = [*NO_ENGINE, *NO_LIBRARIES]

FLOAT_TOL = {torch.float32: (1e-6, 1e-5), torch.float64: (1e-12, 1e-12)}
INF = float("inf")
HALF = (torch.float16, torch.bfloat16)


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for a result of this dtype. The accuracy asked for: float32 and float64 as the engine's
    own (1e-5 and 1e-12 relative); float16 / bfloat16 within 2 units in the last place of the exactly rounded
    answer (2·eps relative), so that computing in float32 and rounding once, or in the half dtype, both pass."""
    if dtype in HALF:
        return 1e-6, 2 * torch.finfo(dtype).eps
    return FLOAT_TOL[torch.float64 if dtype == torch.float64 else torch.float32]


def _accuracy(dtype: torch.dtype) -> str:
    atol, rtol = _tol(dtype)
    what = "2 units in the last place" if dtype in HALF else "the engine's accuracy"
    return (
        f"{str(dtype).removeprefix('torch.')} results must be within {rtol:.2g} relative of the exact answer ({what})"
    )


def _with_accuracy(judge: Callable[[Case, Any], Verdict]) -> Callable[[Case, Any], Verdict]:
    """`judge`, whose message for an answer close to the expected one (within 100 times the tolerance) says
    what accuracy was expected."""

    def judged(case: Case, got: Any) -> Verdict:
        verdict = judge(case, got)
        expected = case.expected
        if (
            verdict is None
            or not isinstance(got, Tensor)
            or not isinstance(expected, Tensor)
            or got.shape != expected.shape
            or got.dtype != expected.dtype
            or not expected.is_floating_point()
        ):
            return verdict
        atol, rtol = _tol(expected.dtype)
        finite = expected.isfinite()
        if (
            torch.equal(finite, got.isfinite())
            and torch.equal(expected[~finite], got.detach()[~finite])
            and bool(
                torch.isclose(
                    got.detach()[finite].double(), expected[finite].double(), rtol=100 * rtol, atol=100 * atol
                ).all()
            )
        ):
            problem, hint = verdict
            return problem, "; ".join(
                h for h in (hint, f"close, but not close enough: {_accuracy(expected.dtype)}") if h
            )
        return verdict

    return judged


LAYOUTS = ("contiguous", "logits[:, -1] of [B, T, V]", "column-major (a transposed copy, transposed back)")


def _layout(x: Tensor, how: str) -> Tensor:
    """x [B, V], the same values in another memory layout: learners and the engine pass logits[:, -1] of the
    model's [B, T, V] output (rows V·T apart), and transposed views exist too. `view` fails on both."""
    if how.startswith("logits[:, -1]"):
        big = torch.zeros(x.shape[0], 3, x.shape[-1], dtype=x.dtype)
        big[:, -1] = x
        return big[:, -1]
    if how.startswith("column-major"):
        return x.T.contiguous().T
    return x


NOT_CONTIGUOUS_HINT = (
    "your input may not be contiguous in memory (here logits[:, -1] of the model's [B, T, V] "
    "output, or a transposed view): use reshape instead of view, or work along dim=-1"
)
ERROR_HINTS = {
    "view size is not compatible": NOT_CONTIGUOUS_HINT,
    "selected index k out of range": "k may be larger than the vocabulary: use min(k, V)",
    "contains either `inf`, `nan`": (
        "the probabilities hold inf or nan: subtract each row's max before exp (exp overflows above 11 in float16 "
        "and above 88 in float32, and inf / inf is nan)"
    ),
}


def _randint(g: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=g))


def _choice(g: torch.Generator, options: Sequence) -> Any:
    return options[_randint(g, 0, len(options) - 1)]


def _random_logits(g: torch.Generator, B: int, V: int, kind: str, dtype=torch.float32) -> Tensor:
    """[B, V] logits: 'ties' (a few distinct values), 'spread' (far from 0 and from their mean) or
    'masked' (some -inf, never a whole row)."""
    if kind == "ties":
        logits = torch.randint(-4, 5, (B, V), generator=g).double() * 0.75
    else:
        logits = torch.randn(B, V, generator=g, dtype=torch.float64) * _choice(g, [0.5, 2.0, 5.0])
        logits += _choice(g, [0.0, -300.0, 1000.0])
    if kind == "masked":
        masked = torch.rand(B, V, generator=g) < 0.4
        masked[torch.arange(B), logits.argmax(-1)] = False
        logits = logits.masked_fill(masked, -INF)
    return logits.to(dtype)


def _row_description(logits: Tensor) -> str:
    return f"{str(logits.dtype).removeprefix('torch.')} logits {list(logits.shape)}"


def _random_half(g: torch.Generator, dtype: torch.dtype) -> Tensor:
    """[B, V] float16 / bfloat16 logits of the size GPT-2's are (|x| < 30), with ties and some -inf."""
    B, V = _randint(g, 1, 4), _randint(g, 5, 300)
    logits = (torch.randn(B, V, generator=g, dtype=torch.float64) * _choice(g, [1.0, 4.0])).to(dtype)
    if _randint(g, 0, 1):
        masked = torch.rand(B, V, generator=g) < 0.3
        masked[torch.arange(B), logits.argmax(-1)] = False
        logits = logits.masked_fill(masked, -INF)
    return logits


PROMPT = "ROMEO:\nWhat say you, my lord? I will not stay to hear the"


def _bundled_model() -> GPT2:
    return bundled_model()


@functools.lru_cache(maxsize=4)
def _real_logits_cached(seed: int) -> Tensor:
    model = _bundled_model()
    ids = torch.tensor([get_tokenizer().encode(PROMPT)])
    with torch.no_grad():
        logits = model(ids)[0].float()  # [T, V]
    probs = torch.softmax(logits.double(), -1)
    tail = (probs * (probs < 1e-4)).sum(-1)  # GPT-2's mass on tokens below 1e-4 at each position
    order = torch.argsort(tail, descending=True)
    return logits[order[seed % 3]][None].clone(), logits[order[3 + seed % 5 : 6 + seed % 5]].clone()


def real_logits(seed: int = 0) -> tuple[Tensor, Tensor]:
    """The bundled GPT-2's next-token logits on a Shakespeare prompt (float32, V = 50257): one row [1, V]
    with much of its mass on unlikely tokens (10–13 % on tokens of probability below 1e-4), and three
    other positions [3, V]."""
    one, three = _real_logits_cached(seed)
    return one.clone(), three.clone()


# ----------------------------------------------------------------------------------------------
# In the engine: a slot's check ends by generating with the learner's function installed as `my_engine`
# installs it (`guarded(Sampler, name=fn)`, passed to `generate`), on the bundled GPT-2


def in_engine(
    name: str,
    fn: Callable,
    runs: Sequence[dict],
    judge: Optional[Callable[[Case, Any], Verdict]] = None,
    reference: Optional[Callable] = None,
    *,
    seconds: float = 20.0,
) -> None:
    """Generate 4 tokens with the bundled GPT-2 and `fn` in the sampler's slot `name`, installed as `my_engine`
    installs it, for each of `runs` (`generate`'s settings; 'batch': False for one prompt instead of two): it must
    not fail in the engine, and each of its answers there, on the logits the engine gives it, must pass
    `judge` against `reference` on the same arguments (computed after the generation)."""

    calls: list[tuple[tuple, Any]] = []

    @functools.wraps(fn)
    def recorded(*args):
        kept = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        out = fn(*args)
        calls.append((kept, out))
        return out

    model = _bundled_model()
    tokenizer = get_tokenizer()
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("JULIET:\nO")]
    limit = time_limit(seconds)
    sampler = guarded(Sampler, **{name: recorded})
    try:
        with limit:
            for run in map(dict, runs):
                generate(
                    model,
                    prompts if run.pop("batch", True) else prompts[0],
                    max_new_tokens=4,
                    eos_token_id=None,
                    sampler=sampler,
                    **run,
                )
    except (TimeUp, KeyboardInterrupt):
        raise
    except BaseException as err:
        if limit.expired:
            raise CheckFailed(
                time_out_message(f"{name} in the engine: generating 4 tokens with your {name}", limit)
            ) from None
        text = str(err) if isinstance(err, PartError) else raised(err).removeprefix("raised ")
        lines = text.split("\n")
        raise CheckFailed(
            f"✗ {name} in the engine (the bundled GPT-2 generating with your {name}, as my_engine() "
            f"will): {lines[0]}" + "".join(f"\n  {line.strip()}" for line in lines[1:3])
        ) from None
    if judge is None:
        return
    for i, (args, got) in enumerate(calls):
        case = Case(
            f"in the engine (the bundled GPT-2 generating with your {name}), call {i + 1}", args, reference(*args)
        )
        verdict = judge(case, got)
        if verdict:
            problem, hint = verdict
            raise failure(
                name,
                case.description,
                problem,
                f"{name}({', '.join(short(a, 100) for a in args)})",
                case.expected,
                got,
                [
                    hint,
                    "the engine gives your function float32 logits [B, V] of "
                    "GPT-2's vocabulary (50257 tokens), one row per prompt",
                ],
            )


# ----------------------------------------------------------------------------------------------
# Processors: logits [B, V] -> logits [B, V] with removed tokens at -inf


def _kept(x: Tensor) -> list[int]:
    return torch.nonzero(x > -INF).flatten().tolist()


def _ids(ids: list[int]) -> str:
    return short(ids, 90)


def _kept_judge(mistakes: Sequence[tuple[Callable, str]]) -> Callable[[Case, Any], Verdict]:
    """A judge that first compares which tokens are kept (not -inf), row by row, then the values."""
    values = tensor_judge(lambda c: _tol(c.expected.dtype), mistakes)

    def judge(case: Case, got: Any) -> Verdict:
        expected = case.expected
        if isinstance(got, Tensor) and got.shape == expected.shape and got.dtype == expected.dtype:
            kept_got, kept_expected = got.detach() > -INF, expected > -INF
            if not torch.equal(kept_got, kept_expected):
                row = int(torch.nonzero((kept_got != kept_expected).any(-1))[0])
                if bool(got[row].isnan().any()):
                    what = "nan where a number or -inf belongs"
                else:
                    what = f"{int(kept_got[row].sum())} kept: {_ids(_kept(got[row]))}"
                problem = (
                    f"row {row}: expected {int(kept_expected[row].sum())} tokens kept: "
                    f"{_ids(_kept(expected[row]))}, got {what}"
                )
                atol, rtol = _tol(expected.dtype)
                return problem, diagnose(got, case.args, mistakes, expected, atol=atol, rtol=rtol)
        return values(case, got)

    return judge


def _processor_check(
    name: str, fn, cases: list[Case], mistakes, engine_runs: Sequence[dict], timeout_hint: str = "", **kwargs
) -> None:
    """The cases, then generation with `fn` in the engine (see `in_engine`), compared with the engine's own."""
    judge = _with_accuracy(_kept_judge(mistakes))
    run_check(
        name,
        fn,
        cases,
        judge=judge,
        forbid=FORBID,
        timeout_hint=timeout_hint,
        seconds=5.0,
        total_seconds=20.0,
        error_hints=kwargs.pop("error_hints", ERROR_HINTS),
        **kwargs,
    )
    in_engine(name, fn, engine_runs, judge, getattr(S, name))


def _shapes_and_layouts(g: torch.Generator, make: Callable[[Tensor, str], Case]) -> list[Case]:
    """The cases every processor meets in the engine and in learners' code, made by make(logits, what):
    float16 and bfloat16 logits (half in, half out), logits that are not contiguous in memory, one row of
    GPT-2's real logits (V = 50257) and three rows of them."""
    one, three = real_logits(_randint(g, 0, 100))
    inputs = [
        (lambda: _random_half(g, torch.float16), "float16 logits (float16 in, float16 out)"),
        (lambda: _random_half(g, torch.bfloat16), "bfloat16 logits (bfloat16 in, bfloat16 out)"),
        (lambda: _layout(_random_logits(g, 3, 17, "spread"), LAYOUTS[1]), f"{LAYOUTS[1]}: not contiguous"),
        (lambda: _layout(_random_logits(g, 2, 9, "ties", torch.float64), LAYOUTS[2]), f"{LAYOUTS[2]}"),
        (lambda: one, "one row of GPT-2's logits [1, 50257]"),
        (lambda: _layout(three, LAYOUTS[1]), f"GPT-2's logits [3, 50257], {LAYOUTS[1]}"),
    ]
    cases = []
    for draw, what in inputs:  # make() gives None where it finds the answer ambiguous: draw again
        case = next((c for _ in range(10) if (c := make(draw(), what)) is not None), None)
        cases += [case] if case is not None else []
    return cases


def _wrong_dim_softmax(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=0)


def _exact(fn: Callable, x: Tensor, *args) -> Tensor:
    """fn computed in float64 and rounded once to x's dtype: the answer a result is compared with."""
    return fn(x.double(), *args).to(x.dtype)


def check_temperature(fn, *, seed: int = 0, n_random: int = 4) -> None:
    """temperature(logits [B, V], t) -> logits / t, in the input's dtype."""
    mistakes = [
        (lambda x, t: x * t, "divide by t (t < 1 sharpens the distribution), do not multiply"),
        (
            lambda x, t: torch.softmax(x / t, dim=-1),
            "return logits (divided by t), not probabilities: the filters and the sampler come after",
        ),
        (lambda x, t: x / max(t, 0.3), "a low temperature is allowed: divide by t whatever it is (t > 0)"),
    ]

    def case(description, logits, t, hint=""):
        return Case(description, (logits, t), later(_exact, S.temperature, logits, t), hint)

    same = torch.tensor([[2.0, 1.0, -1.0, 0.25]])
    cases = [
        case("t = 0.5 doubles the logits", torch.tensor([[2.0, 1.0, -1.0]]), 0.5),
        case("t = 2", torch.tensor([[2.0, 1.0, -1.0]]), 2.0),
        case("t = 1 changes nothing", torch.tensor([[3.0, -7.0]]), 1.0),
        case("-inf (a removed token) stays -inf", torch.tensor([[1.0, -INF, 0.5]]), 0.7),
        case("t = 0.05: a very low temperature (nearly greedy)", same, 0.05),
        case("the same logits again, t = 3 (one call must not remember another)", same, 3.0),
        case("t = 0.01, float64", torch.tensor([[0.3, -0.2, 0.0]], dtype=torch.float64), 0.01),
    ]
    g = torch.Generator().manual_seed(seed)
    cases += _shapes_and_layouts(g, lambda x, what: case(f"{what}, t={(t := _choice(g, [0.1, 0.7, 1.5]))}", x, t))
    for i in range(n_random + 1):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 1, 4), _randint(g, 3, 41) | 1, _choice(g, ["spread", "masked"]), dtype)
        t = _choice(g, [0.05, 0.3, 0.7, 1.3, 2.5])
        cases.append(case(f"random {_row_description(logits)}, t={t}", logits, t))
    judge = _with_accuracy(tensor_judge(lambda c: _tol(c.expected.dtype), mistakes))
    run_check(
        "temperature", fn, cases, judge=judge, forbid=FORBID, seconds=5.0, total_seconds=20.0, error_hints=ERROR_HINTS
    )
    in_engine("temperature", fn, [dict(temperature=0.2, seed=seed)], judge, S.temperature)


def check_greedy(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """greedy(logits [B, V]) -> token ids [B] (torch.long): each row's argmax, the lowest id on ties."""

    def case(description, logits, hint=""):
        return Case(description, (logits,), later(torch.argmax, logits, dim=-1), hint)

    cases = [
        case("one row", torch.tensor([[0.1, 3.0, -2.0]]), "one row in, one token id out: shape [1]"),
        case(
            "two rows: one token per row",
            torch.tensor([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]]),
            "take the argmax along the vocabulary (dim=-1), one per row",
        ),
        case(
            "a tie: the lowest id wins",
            torch.tensor([[1.0, 4.0, 2.0, 4.0]]),
            "torch.argmax returns the first of equal maxima",
        ),
        case("-inf everywhere but one token", torch.tensor([[-INF, -INF, -3.0]])),
        case("three rows, far from 0", torch.tensor([[1000.0, 1001.0], [-500.0, -501.0], [7.0, 7.5]])),
        case("float16 ties (float16 rounds 3.0001 to 3.0)", torch.tensor([[3.0, 3.0001, 2.0]]).half()),
    ]
    g = torch.Generator().manual_seed(seed)
    cases += _shapes_and_layouts(g, lambda x, what: case(what, x))
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(
            g, _randint(g, 2, 5), _randint(g, 3, 61) | 1, _choice(g, ["ties", "spread", "masked"]), dtype
        )
        cases.append(case(f"random {_row_description(logits)}", logits))

    def judge(c: Case, got: Any) -> Verdict:
        problem = tensor_problem(got, c.expected)
        if problem is None:
            return None
        hint = ""
        if isinstance(got, Tensor) and got.shape == (c.expected.shape[0], 1):
            hint = "return a 1-d tensor [B] (squeeze the last dimension or use argmax without keepdim)"
        elif isinstance(got, Tensor) and got.dim() == 0:
            hint = "return one id per row, a tensor [B] even when B = 1 (argmax along dim=-1, not of the whole tensor)"
        elif isinstance(got, Tensor) and got.is_floating_point():
            hint = "return token ids (torch.long), such as argmax's indices, not the maximum values"
        elif isinstance(got, Tensor) and got.dtype != torch.long:
            hint = "token ids are torch.long (int64), as argmax returns them"
        return problem, hint

    run_check("greedy", fn, cases, judge=judge, forbid=FORBID, seconds=5.0, total_seconds=20.0, error_hints=ERROR_HINTS)
    in_engine("greedy", fn, [dict()], judge, lambda logits: logits.argmax(-1))


def _kth_distinct(x: Tensor, k: int) -> Tensor:
    """A known mistake: top-k that takes the k-th highest *distinct* value of each row as the k-th."""
    rows = [row.unique(sorted=True).flip(0) for row in x]
    kth = torch.stack([row[min(k, len(row)) - 1] for row in rows])[:, None]
    return x.masked_fill(x < kth, -INF)


def check_top_k(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """top_k(logits [B, V], k) -> [B, V]: the k highest and any tied with the k-th kept, the rest -inf."""

    def strict(x, k):  # exactly k, ties dropped
        idx = torch.topk(x, min(k, x.shape[-1])).indices
        return torch.full_like(x, -INF).scatter(-1, idx, x.gather(-1, idx))

    mistakes = [
        (
            strict,
            "keep every token tied with the k-th highest logit: compare with the k-th value (>=) instead of "
            "keeping exactly k positions",
        ),
        (
            _kth_distinct,
            "count tied logits one by one: the k-th highest is the k-th entry of the sorted row (torch.topk or "
            "torch.sort), not the k-th distinct value",
        ),
        (lambda x, k: S.top_k(x, k + 1), "off by one: keep k tokens, not k + 1"),
        (
            lambda x, k: x.masked_fill(x < torch.topk(x, min(k, x.shape[-1])).values[..., -1:], 0.0),
            "removed tokens must be -inf (probability 0 after softmax), not 0",
        ),
        (
            lambda x, k: x.masked_fill(x < torch.sort(x.flatten(), descending=True).values[k - 1], -INF),
            "find the k-th highest value of each row (along dim=-1), not of the whole batch",
        ),
        (
            lambda x, k: x.masked_fill(x <= torch.topk(x, min(k, x.shape[-1])).values[..., -1:], -INF),
            "the k-th highest logit itself stays: remove only the logits < the k-th (not <=)",
        ),
    ]
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    cases = [
        Case("keep 2", (x, 2), torch.tensor([[2.0, 1.0, -INF, -INF]])),
        Case(
            "ties with the k-th are kept",
            (torch.tensor([[1.0, 3.0, 1.0, 0.0, 1.0]]), 2),
            torch.tensor([[1.0, 3.0, 1.0, -INF, 1.0]]),
            "keep every token whose logit is >= the k-th highest: here 3 tokens tie for 2nd place",
        ),
        Case(
            "k larger than the vocabulary keeps all",
            (x, 10),
            x.clone(),
            "k larger than V keeps every token: use min(k, V)",
        ),
        Case("k = 1", (torch.tensor([[0.0, 5.0, 5.0, 1.0]]), 1), torch.tensor([[-INF, 5.0, 5.0, -INF]])),
        Case(
            "the two highest tie, k = 2: the k-th is the second 3, not the next distinct value",
            (torch.tensor([[3.0, 1.0, 3.0, 0.0]]), 2),
            torch.tensor([[3.0, -INF, 3.0, -INF]]),
        ),
        Case(
            "every logit ties, k = 1: all tie with the k-th and stay",
            (torch.full((1, 4), 2.5), 1),
            torch.full((1, 4), 2.5),
        ),
        Case(
            "float16 ties at the k-th (float16 rounds 1.0001 to 1.0), k = 2",
            (torch.tensor([[2.0, 1.0001, 0.5, 1.0]]).half(), 2),
            torch.tensor([[2.0, 1.0, -INF, 1.0]]).half(),
        ),
        Case(
            "two rows, each with its own k-th value",
            (torch.tensor([[5.0, 4.0, 3.0], [-1.0, -2.0, -3.0]]), 2),
            torch.tensor([[5.0, 4.0, -INF], [-1.0, -2.0, -INF]]),
        ),
    ]
    same = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0, 1.0]])
    cases += [
        Case("k = 3 on these logits", (same, 3), S.top_k(same, 3)),
        Case("the same logits again, k = 5 (one call must not remember another)", (same, 5), S.top_k(same, 5)),
        Case("k = V keeps all", (same, 6), same.clone()),
        Case(
            "k = 1, one row of GPT-2's logits [1, 50257]", (real_logits(seed)[0], 1), S.top_k(real_logits(seed)[0], 1)
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    cases += _shapes_and_layouts(
        g, lambda x, what: Case(f"{what}, k={(k := _choice(g, [1, 3, 40]))}", (x, k), _exact(S.top_k, x, k))
    )
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        V = _randint(g, 3, 61) | 1
        logits = _random_logits(g, _randint(g, 2, 5), V, _choice(g, ["ties", "ties", "spread", "masked"]), dtype)
        k = _randint(g, 1, V + 2)
        cases.append(Case(f"random {_row_description(logits)}, k={k}", (logits, k), later(S.top_k, logits, k)))
    _processor_check("top_k", fn, cases, mistakes, [dict(temperature=1.0, top_k=40, seed=seed)])


def _unambiguous(fn: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether fn's kept set is the same whatever order ties are sorted in (no removed token has the logit
    of a kept one, in any row), and the same when computed in float64."""
    kept = fn(x) > -INF
    if not torch.equal(kept, fn(x.double()) > -INF) or not torch.equal(kept, fn(x.float()) > -INF):
        return False
    lowest_kept = x.masked_fill(~kept, INF).amin(-1)  # [B]
    highest_removed = x.masked_fill(kept, -INF).amax(-1)  # [B]
    return bool((highest_removed < lowest_kept).all())


def _exact_logits(probs: Sequence[float]) -> Tensor:
    """[1, V] float64 logits whose softmax is exactly `probs` (powers of two that add up to 1), in float64 and
    in float32: log(p / max p), whose exp rounds back to p / max p for the ratios 1, 1/2, 1/4, 1/16 and 1/32
    (not 1/8: exp(log(1/8)) is 1 ulp off in float64). A case built on them sits exactly on a threshold."""
    top = max(probs)
    return torch.tensor([[math.log(p / top) for p in probs]], dtype=torch.float64)


def _large_half_logits(
    maybe: Callable[[str, Tensor, float], Optional[Case]], p16: float, p_bf16: float
) -> list[Optional[Case]]:
    """Cases `maybe(description, logits, p)` on float16 and bfloat16 logits whose exp overflows the dtype (e^11.1
    is float16's largest number): a softmax that does not subtract the max gives inf / inf = nan."""
    return [
        maybe(
            "large float16 logits (up to 12.5: exp overflows float16 unless the max is subtracted)",
            torch.tensor([[11.0, 12.5, 9.0, 12.0, 7.0]]).half(),
            p16,
        ),
        maybe(
            "large bfloat16 logits (near 1000: exp overflows unless the max is subtracted)",
            torch.tensor([[1000.0, 996.0, 1000.0, 992.0]]).bfloat16(),
            p_bf16,
        ),
    ]


WITHOUT_MAX = (
    "subtract each row's max before exp (softmax(x) = softmax(x - max)): exp overflows above 11 in float16 and "
    "above 88 in float32, and inf / inf is nan"
)


def _softmax_without_max(x: Tensor) -> Tensor:
    """A known mistake: exp(x) / sum, which overflows on large logits."""
    e = x.exp()
    return e / e.sum(-1, keepdim=True)


def _margin(dtype: torch.dtype) -> float:
    """How far from a cut a probability must be for every correct way of computing it to agree: 1e-5 for float32
    and float64; for float16 / bfloat16, whose softmax and cumulative sums may be computed in the half dtype
    itself (3 and 2 significant digits), 0.02 and 0.05."""
    return {torch.float16: 0.02, torch.bfloat16: 0.05}.get(dtype, 1e-5)


def _near_cut(probs_sorted_cumulative: Tensor, cut: float, margin: float = 1e-5) -> bool:
    return bool(((probs_sorted_cumulative - cut).abs() < margin).any())


def check_top_p(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """top_p(logits [B, V], p) -> [B, V] (transformers' TopPLogitsWarper)."""

    def too_few(x, p):  # keeps tokens while the cumulative probability, including them, is <= p
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        keep = probs.cumsum(-1) <= p
        keep[..., 0] = True
        return x.masked_fill(~keep.scatter(-1, order, keep), -INF)

    def mass_before_exceeds(x, p):  # the tutorials' rule: remove a token when the mass before it exceeds p
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        keep = probs.cumsum(-1) - probs <= p
        return x.masked_fill(~keep.scatter(-1, order, keep), -INF)

    def without_max(x, p):  # softmax as exp(x) / sum: exp overflows on large logits, and inf / inf is nan
        sorted_x, order = torch.sort(x)
        remove = _softmax_without_max(sorted_x).cumsum(-1) <= 1 - p
        remove[..., -1] = False
        return x.masked_fill(remove.scatter(-1, order, remove), -INF)

    def keep_below_p(x, p):  # removes tokens while the cumulative, from the least likely, is <= p
        return S.top_p(x, 1 - p) if p < 1 else x

    def on_logits(x, p):  # a cumulative sum of logits, not probabilities
        sorted_x, order = torch.sort(x)
        remove = sorted_x.cumsum(-1) <= 1 - p
        remove[..., -1] = False
        return x.masked_fill(remove.scatter(-1, order, remove), -INF)

    mistakes = [  # the overflow first: where it is wrong, it may also look like another mistake
        (without_max, WITHOUT_MAX),
        (
            too_few,
            "one token too few: keep the token whose probability makes the sum pass p (the smallest "
            "set whose probabilities add up to MORE than p)",
        ),
        (keep_below_p, "remove the least likely tokens while their cumulative probability is <= 1 - p (not <= p)"),
        (on_logits, "add up probabilities (softmax first), not logits"),
        (
            lambda x, p: S.top_p(x.T, p).T if x.shape[0] > 1 else None,
            "softmax and sort each row along the vocabulary (dim=-1)",
        ),
        (
            mass_before_exceeds,
            "one token too many exactly on the boundary: remove every token whose cumulative probability, from "
            "the least likely, is <= 1 - p (<=, not <); seen from the most likely, remove a token once the mass "
            "before it reaches p (>=), not only once it exceeds p",
        ),
    ]

    def case(description, logits, p, hint=""):
        return Case(description, (logits, p), later(S.top_p, logits, p), hint)

    two_rows = torch.tensor([[3.0, 0.0, 0.5, -1.0], [0.0, 0.3, -0.2, 0.1]])
    cases = [
        case(
            "probabilities .5 .3 .2, p = 0.6 keeps 2",
            torch.tensor([[0.5, 0.3, 0.2]]).log(),
            0.6,
            "keep the most likely tokens until their probabilities add up to MORE than p: 0.5 is not "
            "more than 0.6, 0.5 + 0.3 is",
        ),
        case(
            "probabilities .25 .5 .25, p = 0.4: the most likely alone is more than p",
            torch.tensor([[0.25, 0.5, 0.25]]).log(),
            0.4,
        ),
        case(
            "a tiny p keeps the most likely token",
            torch.tensor([[1.0, 2.0, 0.0]]),
            0.01,
            "the most likely token is always kept",
        ),
        case("two rows, each with its own distribution", two_rows, 0.7),
        case("some tokens already removed (-inf)", torch.tensor([[1.0, -INF, 0.5, -INF, 0.0]]), 0.8),
        case("large logits (softmax must subtract the max)", torch.tensor([[1000.0, 999.0, 990.0, 998.0]]), 0.7),
    ]
    # exactly on the boundary: the cumulative probability equals 1 - p, exactly in float64 and float32 (answers
    # computed now, not later: a smaller version of these logits, as shrinking would try, is off the boundary)
    halves = _exact_logits([0.5, 0.25, 0.125, 0.03125, 0.03125, 0.03125, 0.03125])
    cases += [
        Case(
            "probabilities .5 .25 .125 4×.03125 (exact in float64), p = 0.75: .5 + .25 is exactly p and is kept alone",
            (halves, 0.75),
            S.top_p(halves, 0.75),
            "here 4 × .03125 + .125 = 0.25 = 1 - p: those tokens go, and .5 + .25 (exactly p) stay",
        ),
        Case(
            "the same probabilities in float32, p = 0.5: the most likely alone is exactly p and is kept alone",
            (halves.float(), 0.5),
            S.top_p(halves.float(), 0.5),
            "here all but the most likely add up to 0.5 = 1 - p: they go, and .5 (exactly p) stays alone",
        ),
    ]

    def fair(logits, p):  # every correct way of computing it keeps the same tokens
        cumulative = torch.sort(torch.softmax(logits.double(), -1)).values.cumsum(-1)
        return _unambiguous(lambda x: S.top_p(x, p), logits) and not _near_cut(cumulative, 1 - p, _margin(logits.dtype))

    def maybe(description, logits, p):
        return case(f"{description}, p={p}", logits, p) if fair(logits, p) else None

    same = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    one = real_logits(seed)[0]
    cases += [
        case("p = 0.9 on these logits", same, 0.9),
        case("the same logits again, p = 0.3 (one call must not remember another)", same, 0.3),
        case("p = 0.001 keeps only the most likely token", same, 0.001),
        maybe("one row of GPT-2's logits [1, 50257]", one, 0.95),
        *_large_half_logits(maybe, 0.9, 0.9),
    ]
    g = torch.Generator().manual_seed(seed)
    cases += _shapes_and_layouts(g, lambda x, what: maybe(what, x, _choice(g, [0.3, 0.6, 0.9])))
    cases = [c for c in cases if c is not None]
    wanted = len(cases) + n_random
    attempts = 0
    while len(cases) < wanted and attempts < 50 * (n_random + 1):
        attempts += 1
        dtype = [torch.float64, torch.float32, torch.float16, torch.bfloat16][attempts % 4]
        if dtype in HALF:
            logits = _random_half(g, dtype)
        else:
            logits = _random_logits(
                g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "ties", "spread", "masked"]), dtype
            )
        p = _choice(g, [0.1, 0.3, 0.5, 0.75, 0.9, 0.95])
        if fair(logits, p):
            cases.append(
                Case(f"random {_row_description(logits)}, p={p}", (logits, p), later(_exact, S.top_p, logits, p))
            )
    _processor_check("top_p", fn, cases, mistakes, [dict(temperature=1.0, top_p=0.9, seed=seed)])


def check_min_p(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """min_p(logits [B, V], p) -> [B, V] (transformers' MinPLogitsWarper)."""

    def of_sum(x, p):
        return x.masked_fill(torch.softmax(x, -1) < p, -INF)

    def on_logits(x, p):
        return x.masked_fill(x < p * x.amax(-1, keepdim=True), -INF)

    def batch_max(x, p):
        probs = torch.softmax(x, -1)
        return x.masked_fill(probs < p * probs.max(), -INF)

    def at_most(x, p, keep_the_largest=False):  # removes probabilities <= p × the largest
        probs = torch.softmax(x, -1)
        top = probs.amax(-1, keepdim=True)
        return x.masked_fill((probs <= p * top) & ((probs < top) if keep_the_largest else True), -INF)

    def without_max(x, p):
        probs = _softmax_without_max(x)
        return x.masked_fill(probs < p * probs.amax(-1, keepdim=True), -INF)

    at_most_hint = (
        "a probability of exactly p × the largest is kept: remove only the probabilities < p × the largest (not <=)"
    )
    mistakes = [  # the overflow first: where it is wrong, it may also look like another mistake
        (without_max, WITHOUT_MAX),
        (batch_max, "each row has its own largest probability: amax(dim=-1, keepdim=True)"),
        (at_most, at_most_hint),
        (functools.partial(at_most, keep_the_largest=True), at_most_hint),
        (
            of_sum,
            "compare each probability with p times the LARGEST probability of its row, not with p "
            "(p times the sum, which is 1)",
        ),
        (on_logits, "compare probabilities (softmax first), not logits"),
    ]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    cases = [
        Case(
            "p = 0.2: keep probabilities >= 0.2 × 0.5",
            (probs.log(), 0.2),
            probs.log().masked_fill(torch.tensor([[False, False, False, True]]), -INF),
            "a token is kept if its probability is >= p × the largest probability (0.1 here)",
        ),
        Case(
            "p = 0.5: keep probabilities >= 0.25",
            (probs.log(), 0.5),
            probs.log().masked_fill(torch.tensor([[False, False, True, True]]), -INF),
        ),
        Case("a flat distribution keeps everything", (torch.zeros(1, 5), 0.9), torch.zeros(1, 5)),
        Case(
            "large logits (softmax must subtract the max)",
            (torch.tensor([[1000.0, 999.0, 990.0]]), 0.3),
            torch.tensor([[1000.0, 999.0, -INF]]),
        ),
        Case(
            "two rows with different maxima",
            (torch.tensor([[4.0, 3.0, 0.0], [0.0, 0.2, 0.1]]), 0.3),
            S.min_p(torch.tensor([[4.0, 3.0, 0.0], [0.0, 0.2, 0.1]]), 0.3),
        ),
    ]

    def fair(logits, p):  # every correct way of computing it keeps the same tokens
        probs = torch.softmax(logits.double(), -1)
        ratio = probs / probs.amax(-1, keepdim=True)
        return _unambiguous(lambda x: S.min_p(x, p), logits) and not _near_cut(
            ratio[ratio < 1], p, _margin(logits.dtype) * p
        )

    def maybe(description, logits, p):
        return (
            Case(f"{description}, p={p}", (logits, p), later(_exact, S.min_p, logits, p)) if fair(logits, p) else None
        )

    ties = torch.tensor([[3.0, 1.0, 3.0, 2.9, -INF]])
    cases += [
        Case(
            "p = 1 keeps only the most likely token (and any tied with it)",
            (ties, 1.0),
            torch.tensor([[3.0, -INF, 3.0, -INF, -INF]]),
            "p = 1: a token is kept if its probability is >= the largest one, so the largest (and its ties) "
            "stay: compare with <, not <=",
        ),
        Case("the same logits again, p = 0.5 (one call must not remember another)", (ties, 0.5), S.min_p(ties, 0.5)),
        Case("p = 1, float16", (ties.half(), 1.0), torch.tensor([[3.0, -INF, 3.0, -INF, -INF]]).half()),
        maybe("one row of GPT-2's logits [1, 50257]", real_logits(seed)[0], 0.02),
        *_large_half_logits(maybe, 0.3, 0.01),
    ]
    # exactly on the boundary, in float64 (where these probabilities are exact; see _exact_logits; answers computed
    # now: a smaller version of these logits is off the boundary)
    halves = _exact_logits([0.5, 0.25, 0.125, 0.03125, 0.03125, 0.03125, 0.03125])
    cases += [
        Case(
            f"probabilities .5 .25 .125 4×.03125 (exact in float64), p = {p}: a probability of exactly "
            f"{p} × .5 = {p / 2:g} is kept",
            (halves, p),
            S.min_p(halves, p),
            f"the bar is p × .5 = {p / 2:g}: a probability equal to it stays",
        )
        for p in (0.25, 0.5)
    ]
    g = torch.Generator().manual_seed(seed)
    cases = [
        c
        for c in cases + _shapes_and_layouts(g, lambda x, what: maybe(what, x, _choice(g, [0.01, 0.1, 0.3])))
        if c is not None
    ]
    wanted = len(cases) + n_random
    attempts = 0
    while len(cases) < wanted and attempts < 50 * (n_random + 1):
        attempts += 1
        dtype = [torch.float64, torch.float32, torch.float16, torch.bfloat16][attempts % 4]
        if dtype in HALF:
            logits = _random_half(g, dtype)
        else:
            logits = _random_logits(
                g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "spread", "masked"]), dtype
            )
        p = _choice(g, [0.05, 0.1, 0.3, 0.5, 0.8, 1.0])
        if fair(logits, p):
            cases.append(
                Case(f"random {_row_description(logits)}, p={p}", (logits, p), later(_exact, S.min_p, logits, p))
            )
    _processor_check("min_p", fn, cases, mistakes, [dict(temperature=1.0, min_p=0.05, seed=seed)])


def check_repetition_penalty(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """repetition_penalty(logits [B, V], seen [B, V] bool, penalty) -> [B, V] (transformers' semantics)."""
    mistakes = [
        (
            lambda x, seen, r: torch.where(seen, x * r, x),
            "for a positive logit, divide by the penalty: multiplying would make a seen token MORE likely",
        ),
        (
            lambda x, seen, r: torch.where(seen, x / r, x),
            "a negative logit is multiplied by the penalty (dividing it would bring it closer to 0, more likely)",
        ),
        (
            lambda x, seen, r: torch.where(~seen, torch.where(x < 0, x * r, x / r), x),
            "penalize the tokens that ARE in the text (seen is True), leave the others",
        ),
        (
            lambda x, seen, r: torch.where(seen, x - math.log(r), x),
            "transformers' penalty divides (positive logits) or multiplies (negative ones), it does not subtract",
        ),
    ]

    def case(description, logits, seen, penalty, hint=""):
        return Case(description, (logits, seen, penalty), later(S.repetition_penalty, logits, seen, penalty), hint)

    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    cases = [
        case("positive seen logits are divided, negative multiplied", x, seen, 2.0),
        case("penalty < 1 encourages repeats", x, seen, 0.5),
        case("nothing seen: nothing changes", x, torch.zeros_like(seen), 1.5),
        case(
            "two rows with different texts",
            torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]]),
            torch.tensor([[True, False, False], [False, True, True]]),
            1.3,
        ),
    ]

    def exact(description, logits, seen, penalty, hint=""):
        return Case(
            description, (logits, seen, penalty), later(_exact, S.repetition_penalty, logits, seen, penalty), hint
        )

    zeros = torch.tensor([[0.0, -0.0, 1.0, -1.0]])
    one = real_logits(seed)[0]
    log_probs = torch.log_softmax(real_logits(seed)[1], -1)
    cases += [
        case("the same logits again, penalty 3 (one call must not remember another)", x, seen, 3.0),
        case("logits 0 stay 0", zeros, torch.ones(1, 4, dtype=torch.bool), 1.7),
        case("penalty 10", x, seen, 10.0),
        case("one row of GPT-2's logits [1, 50257], the prompt's tokens seen", one, _seen_for(one, None, 0.02), 1.3),
        case(
            "log-probabilities (all negative: beam search's input), 3 beams [3, 50257]",
            log_probs,
            _seen_for(log_probs, None, 0.001),
            1.2,
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    cases += _shapes_and_layouts(
        g,
        lambda logits, what: exact(
            f"{what}, penalty 1.5",
            logits - logits.masked_fill(logits.isinf(), 0).mean().to(logits.dtype),
            _seen_for(logits, g),
            1.5,
        ),
    )
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(
            g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "spread", "masked"]), dtype
        )
        logits -= logits.masked_fill(logits.isinf(), 0).mean() if i % 3 == 0 else 0  # values on both sides of 0
        seen = torch.rand(logits.shape, generator=g) < 0.4
        penalty = _choice(g, [1.2, 1.5, 3.0, 0.8])
        cases.append(case(f"random {_row_description(logits)}, penalty={penalty}", logits, seen, penalty))
    _processor_check(
        "repetition_penalty",
        fn,
        cases,
        mistakes,
        [dict(repetition_penalty=1.3), dict(num_beams=2, repetition_penalty=1.3, batch=False)],
    )


# ----------------------------------------------------------------------------------------------
# Samplers: many seeded draws, frequencies against the expected distribution


Z = 4.75  # standard deviations: a correct sampler fails one test with a probability of about 1e-6


def _chi2_limit(df: int, z: float = Z) -> float:
    """The chi-square value that a correct sampler exceeds with probability about 1e-6 (z = 4.75 standard
    deviations, Wilson–Hilferty approximation)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def frequency_problem(tokens: Tensor, probs: Tensor) -> Optional[str]:
    """None if `tokens` [N·B] (row i drawn from probs[i % B]) look like draws from `probs` [B, V];
    otherwise what is off. Tokens of probability 0 must never appear; the rest pass a chi-square test
    at a level of about 1e-6 (tokens expected fewer than 5 times are pooled)."""
    B, V = probs.shape
    draws = tokens.view(-1, B)  # [N, B]
    N = draws.shape[0]
    for row in range(B):
        counts = torch.bincount(draws[:, row], minlength=V).double()
        p = probs[row].double()
        impossible = (p == 0) & (counts > 0)
        if bool(impossible.any()):
            token = int(torch.nonzero(impossible)[0])
            return (
                f"row {row}: token {token} was drawn {int(counts[token])} times in {N} draws, but its "
                f"probability is 0 (its logit is -inf)"
            )
        expected = p * N
        big = expected >= 5
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        wanted = torch.cat([expected[big], expected[~big].sum()[None]])
        if wanted[-1] < 1e-9:
            observed, wanted = observed[:-1], wanted[:-1]
        df = len(wanted) - 1
        if df < 1:
            continue
        chi2 = float(((observed - wanted) ** 2 / wanted).sum())
        for below in (1e-4, 1e-3):  # the unlikely tokens together: a sampler that drops them
            unlikely = (p > 0) & (p < below)
            mass = float(p[unlikely].sum())
            if N * mass >= 10 and mass < 0.9:
                drawn = float(counts[unlikely].sum())
                z = (drawn - N * mass) / math.sqrt(N * mass * (1 - mass))
                if abs(z) > Z:
                    return (
                        f"row {row}: the tokens of probability below {below:g} (together {mass:.1%} of the "
                        f"probability) were drawn {drawn / N:.1%} of the time in {N} draws ({abs(z):.1f} standard "
                        f"deviations {'below' if z < 0 else 'above'}): every token must keep its own probability, "
                        f"however small (no cut-off, no rounding of probabilities)"
                    )
        if chi2 > _chi2_limit(df):
            worst = int(((counts / N - p).abs()).argmax())
            tv = 0.5 * float((counts / N - p).abs().sum())
            return (
                f"row {row}: the frequencies of {N} draws do not follow the probabilities (chi-square {chi2:.0f}, "
                f"a correct sampler stays below {_chi2_limit(df):.0f}; total variation distance {tv:.3f}); "
                f"e.g. token {worst}: probability {float(p[worst]):.3f}, drawn {float(counts[worst]) / N:.3f} "
                f"of the time"
            )
    return _joint_problem(draws, probs)


def _pair_problem(a: Tensor, b: Tensor, p: Tensor, q: Tensor, what: str) -> Optional[str]:
    """None if the pairs (a[i], b[i]) look independent, as draws of p ⊗ q; else what is off (chi-square)."""
    V = p.shape[0]
    counts = torch.bincount(a * V + b, minlength=V * V).double()
    expected = torch.outer(p.double(), q.double()).flatten() * a.shape[0]
    big = expected >= 5
    if int(big.sum()) < 2:
        return None
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    if wanted[-1] < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    df = len(wanted) - 1
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    if chi2 > _chi2_limit(df):
        same = float((a == b).double().mean())
        return (
            f"{what} are not independent (chi-square {chi2:.0f} of the pairs, a correct sampler stays below "
            f"{_chi2_limit(df):.0f}; the two are the same token {same:.0%} of the time, "
            f"{float((p * q).sum()):.0%} expected): draw a new random number for every row"
        )
    return None


def _joint_problem(draws: Tensor, probs: Tensor) -> Optional[str]:
    """Draws [N, B] of probs [B, V]: rows 0 and 1 of one call, and row 0 of one copy and of the next, must be
    independent (one random number shared by several rows passes every test of one row alone)."""
    N, B = draws.shape
    if probs.shape[-1] > 64:
        return None
    if B >= 2:
        problem = _pair_problem(draws[:, 0], draws[:, 1], probs[0], probs[1], "the draws of rows 0 and 1")
        if problem:
            return problem
    half = N // 2 * 2
    return _pair_problem(
        draws[0:half:2, 0], draws[1:half:2, 0], probs[0], probs[0], f"the draws of rows 0 and {B} (the same logits)"
    )


def _draws_judge(n_draws: int, extra_hint: Callable[[Any, tuple], str] = lambda got, args: "") -> Callable:
    def judge(case: Case, got: Any) -> Verdict:
        probs = case.expected
        shape = (n_draws * probs.shape[0],)
        if not isinstance(got, Tensor) or got.shape != shape or got.dtype != torch.long:
            problem = tensor_problem(got, torch.zeros(shape, dtype=torch.long))
            hint = ""
            if isinstance(got, Tensor) and got.shape == (shape[0], 1):
                hint = "return a 1-d tensor [B]: torch.multinomial(probs, 1) is [B, 1], squeeze(-1) it"
            return problem, hint
        problem = frequency_problem(got, probs)
        return None if problem is None else (problem, extra_hint(got, case.args))

    return judge


def _many(logits: Tensor, n: int) -> Tensor:
    return logits.repeat(n, 1)  # [n·B, V]: row i is logits[i % B]


def _seen_for(logits: Tensor, g: Optional[torch.Generator], fraction: float = 0.3) -> Tensor:
    """seen [B, V] bool with about `fraction` of the tokens seen (g None: a generator seeded 0)."""
    g = g if g is not None else torch.Generator().manual_seed(0)
    return torch.rand(logits.shape, generator=g) < fraction


ZERO_HINT = "exp(-inf) = 0: softmax gives removed tokens probability 0, and they must never be drawn"


def _one_row_draws(
    name: str,
    fn,
    make_args: Callable[[Tensor, torch.Generator], tuple],
    logits: Tensor,
    n: int,
    show: Callable[[tuple], str],
    seed: int,
) -> None:
    """n calls with ONE row (generation's real case), one generator for all: each answer a tensor [1], and
    together they follow the probabilities."""
    g = torch.Generator().manual_seed(seed)
    tokens = []
    budget = time_limit(20.0)
    try:
        with budget:
            for _ in range(n):
                args = make_args(logits, g)
                got = call_learner(name, fn, args, forbid=FORBID, seconds=5.0, show=show)
                if not isinstance(got, Tensor) or got.shape != (1,) or got.dtype != torch.long:
                    problem = tensor_problem(got, torch.zeros(1, dtype=torch.long))
                    hint = (
                        "one row in, one token id out: a tensor [1] (squeeze(-1) multinomial's [1, 1], not "
                        "squeeze() or item())"
                        if isinstance(got, Tensor) and got.numel() == 1
                        else ""
                    )
                    raise failure(
                        name, "one row (as in generation)", problem, show(args), "a tensor [1] of torch.long", got, hint
                    )
                tokens.append(got)
    except TimeoutError:
        if not budget.expired:
            raise
        raise CheckFailed(time_out_message(f"{name}: {n} calls with one row", budget)) from None
    problem = frequency_problem(torch.cat(tokens), torch.softmax(logits.double(), -1))
    if problem:
        raise CheckFailed(
            f"✗ {name} — {n} calls with one row each (as in generation), one generator: {problem}\n"
            f"  input:    {show(make_args(logits, g))}\n"
            f"  hint: a sampler must draw from the probabilities whatever the number of rows: one row "
            f"is the usual case in generation"
        )


def check_sample(fn, *, seed: int = 0, n_random: int = 3, n_draws: int = 3000) -> None:
    """sample(logits [B, V], generator) -> token ids [B] long, drawn from softmax(logits)."""

    base = [
        ("probabilities .5 .3 .2", torch.tensor([[0.5, 0.3, 0.2]]).log(), ""),
        ("removed tokens (-inf)", torch.tensor([[1.0, -INF, 0.0, 2.0, -INF]]), ""),
        (
            "three rows, each its own distribution",
            torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-5.0, 1.0, 1.5]]),
            "draw one token per row, from that row's probabilities",
        ),
        ("large logits", torch.tensor([[1000.0, 999.0, 998.5]]), "softmax must subtract the max"),
        (
            "large float16 logits (up to 12.5: exp overflows float16 unless the max is subtracted)",
            torch.tensor([[11.0, 12.5, 9.0, 12.0]]).half(),
            "softmax must subtract the max",
        ),
        (
            "bfloat16 logits near 1000",
            torch.tensor([[1000.0, 996.0, 1000.0, 992.0]]).bfloat16(),
            "softmax must subtract the max",
        ),
        ("float64 logits", torch.tensor([[0.3, -0.4, 1.1, 0.0]], dtype=torch.float64), ""),
        (f"{LAYOUTS[1]}: not contiguous", _layout(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), LAYOUTS[1]), ""),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        logits = _random_logits(
            g,
            _randint(g, 1, 3),
            _randint(g, 3, 15) | 1,
            _choice(g, ["ties", "masked"]),
            torch.float64 if i % 2 else torch.float32,
        )
        base.append((f"random {_row_description(logits)}", logits, ""))
    cases = [
        Case(
            f"{what}, {n_draws} draws per row",
            (_many(logits, n_draws), torch.Generator().manual_seed(seed + i)),
            torch.softmax(logits.double(), -1),
            hint,
        )
        for i, (what, logits, hint) in enumerate(base)
    ]
    # GPT-2's real logits: 10-13 % of the probability on tokens below 1e-4 (a cut-off there is 5+ sigmas off)
    real = real_logits(seed)[0]
    cases.append(
        Case(
            "one row of GPT-2's logits [1, 50257], 300 draws",
            (_many(real, 300), torch.Generator().manual_seed(seed)),
            torch.softmax(real.double(), -1),
        )
    )

    def show(args):
        logits = args[0]
        n = n_draws if logits.shape[0] >= n_draws else 300 if logits.shape[0] % 300 == 0 else 1
        B = logits.shape[0] // n
        what = f"{n} × each of these {B} rows: " if n > 1 else ""
        return f"sample(logits [{what}{short(logits[:B], 160)}], generator)"

    def hint(got, args):
        return "draw from the probabilities softmax(logits), with torch.multinomial(probs, 1, generator=generator)"

    draws = _draws_judge(n_draws, hint)

    def judge(case, got):
        n = n_draws if case.args[0].shape[0] >= n_draws else 300
        verdict = (_draws_judge(n, hint) if n != n_draws else draws)(case, got)
        if verdict and "probability is 0" in verdict[0]:
            return verdict[0], ZERO_HINT
        return verdict

    run_check(
        "sample",
        fn,
        cases,
        judge=judge,
        forbid=FORBID,
        show_call=show,
        may_modify=[1],
        seconds=5.0,
        total_seconds=20.0,
        error_hints=ERROR_HINTS,
    )
    flat = torch.zeros(4, 50)
    generator_contract(
        "sample",
        lambda gen: call_learner("sample", fn, (flat, gen), forbid=FORBID, seconds=5.0),
        what="sample(torch.zeros(4, 50), generator)",
    )
    _one_row_draws(
        "sample", fn, lambda logits, gen: (logits, gen), torch.tensor([[0.5, 0.3, 0.2]]).log(), 300, show, seed
    )
    in_engine("sample", fn, [dict(temperature=1.0, seed=seed)])


def check_next_token(fn, *, seed: int = 0, n_random: int = 3, n_draws: int = 3000) -> None:
    """next_token(logits [B, V], settings, seen=None, generator=None) -> [B] long, as the engine's."""
    fn = unwritten_helper(fn)
    Settings = S.SamplingParams
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    seen = torch.tensor([[True, False, False, False, False]])
    greedy = [
        (
            "greedy (temperature 0) is the argmax",
            torch.tensor([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]]),
            Settings(),
            None,
            "temperature 0 means greedy: the argmax of each row",
        ),
        (
            "greedy with top-k, top-p and min-p set: they do not change the argmax",
            x,
            Settings(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3),
            None,
            "",
        ),
        (
            "greedy applies the repetition penalty first",
            torch.tensor([[3.0, 2.9, -1.0]]),
            Settings(repetition_penalty=1.5),
            torch.tensor([[True, False, False]]),
            "the repetition penalty applies to greedy decoding too: token 0 (seen) drops from 3 to 2",
        ),
        ("greedy, ties: the lowest id", torch.tensor([[1.0, 4.0, 4.0]], dtype=torch.float64), Settings(), None, ""),
        (
            "greedy, repetition penalty 1.5 but seen=None: nothing is penalized",
            torch.tensor([[3.0, 2.9, -1.0]]),
            Settings(repetition_penalty=1.5),
            None,
            "seen=None means no text to penalize: skip the repetition penalty",
        ),
        (
            "top-k 1 keeps only the most likely token: always drawn",
            torch.tensor([[0.5, 2.0, 1.9, -1.0], [3.0, 0.0, 2.0, 2.5]]),
            Settings(temperature=1.0, top_k=1),
            None,
            "top_k=1 keeps one token (the argmax), so sampling always draws it",
        ),
        (
            "min-p 1 keeps only the most likely token: always drawn",
            torch.tensor([[0.5, 2.0, 1.9, -1.0]]),
            Settings(temperature=0.7, min_p=1.0),
            None,
            "min_p=1 keeps only the tokens as likely as the most likely one",
        ),
        (
            "temperature 0.01 is nearly greedy",
            torch.tensor([[1.0, 1.2, 0.9]]),
            Settings(temperature=0.01),
            None,
            "divide by any temperature > 0, however small",
        ),
    ]
    sampled = [
        (
            "temperature 0.5 before top-p 0.8",
            x,
            Settings(temperature=0.5, top_p=0.8),
            None,
            "the order is repetition penalty, temperature, top-k, top-p, min-p: at temperature 0.5 the most likely "
            "token alone has more than 0.8",
        ),
        (
            "temperature 2 before min-p 0.3",
            x,
            Settings(temperature=2.0, min_p=0.3),
            None,
            "temperature first: at temperature 2 the distribution is flatter, and min-p keeps more tokens",
        ),
        (
            "top-k 3 before top-p 0.75",
            probs.log(),
            Settings(temperature=1.0, top_k=3, top_p=0.75),
            None,
            "top-k first, then top-p on what top-k kept (softmax again: the 3 kept probabilities add up to 1)",
        ),
        (
            "top-p 0.8 before min-p 0.15",
            torch.tensor([[0.6, 0.12] + [0.0175] * 16]).log(),
            Settings(temperature=1.0, top_p=0.8, min_p=0.15),
            None,
            "top-p comes before min-p: here it keeps tokens 0 and 1 (and 5 of the small ones, that min-p removes); "
            "min-p first would leave 0.6 and 0.12, and top-p on those would drop token 1",
        ),
        (
            "the repetition penalty before top-k 2",
            torch.tensor([[2.0, 1.5, 1.0, -1.0, -3.0]]),
            Settings(temperature=1.0, top_k=2, repetition_penalty=3.0),
            seen,
            "the repetition penalty comes first: token 0 (seen) drops from 2 to 0.67 and leaves the top 2",
        ),
        (
            "temperature 1.5, all processors, two rows",
            torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -4.0], [0.0, 0.0, 1.0, -1.0, -INF, 3.0, 2.0]]),
            Settings(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
            torch.tensor(
                [[False, True, False, False, True, False, False], [True, False, True, False, False, False, False]]
            ),
            "",
        ),
        (
            "temperature 1, nothing else: softmax(logits)",
            torch.tensor([[0.5, -0.5, 1.5]], dtype=torch.float64),
            Settings(temperature=1.0),
            None,
            "draw from softmax(logits), with the generator you are given",
        ),
        # settings that look greedy but are not: every processor that is on must run, then a draw
        (
            "top-k 1 after the repetition penalty, temperature 0.7: the penalty changes the most likely token",
            torch.tensor([[3.0, 2.9, -1.0, 0.5]]),
            Settings(temperature=0.7, top_k=1, repetition_penalty=1.5),
            torch.tensor([[True, False, False, False]]),
            "top_k=1 is not greedy decoding: the repetition penalty comes first (token 0, seen, drops from 3 to 2), "
            "then top-k keeps the new most likely token",
        ),
        (
            "top-k 1 with two tokens tied for the top: both stay, and each is drawn half of the time",
            torch.tensor([[1.0, 2.0, 2.0, 0.5]]),
            Settings(temperature=0.8, top_k=1),
            None,
            "top_k=1 keeps every token tied with the highest (top-k keeps ties), and sampling draws among them: "
            "do not replace it by greedy decoding (argmax takes the lowest id)",
        ),
        (
            "temperature 0.001, logits 0.001 apart: still a draw (27 % / 73 %)",
            torch.tensor([[1.0, 1.001, -1.0]], dtype=torch.float64),
            Settings(temperature=0.001),
            None,
            "only temperature 0 is greedy: divide by any temperature > 0, however small, and draw",
        ),
        (
            "large float16 logits (up to 12.5) at temperature 0.5: exp overflows float16 unless the max is subtracted",
            torch.tensor([[11.0, 12.5, 9.0, 12.0]]).half(),
            Settings(temperature=0.5, top_p=0.95),
            None,
            "softmax must subtract each row's max (e^11.1 is float16's largest number)",
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    attempts = 0
    while len(sampled) < 11 + n_random and attempts < 50:
        attempts += 1
        logits = _random_logits(
            g,
            _randint(g, 1, 3),
            _randint(g, 5, 15) | 1,
            _choice(g, ["ties", "spread"]),
            torch.float64 if attempts % 2 else torch.float32,
        )
        settings = Settings(
            temperature=_choice(g, [0.6, 1.0, 1.7]),
            top_k=_choice(g, [0, 2, 4]),
            top_p=_choice(g, [1.0, 0.6, 0.9]),
            min_p=_choice(g, [0.0, 0.1]),
            repetition_penalty=_choice(g, [1.0, 1.4]),
        )
        seen_rows = _seen_for(logits, g)

        penalized = S.repetition_penalty(logits, seen_rows, settings.repetition_penalty)
        filters = dataclasses.replace(settings, repetition_penalty=1.0)
        if _unambiguous(lambda z: S.process_logits(z, filters), penalized):
            sampled.append((f"random {_row_description(logits)}, {settings}", logits, settings, seen_rows, ""))

    def expected_probs(logits, settings, seen_rows):
        return torch.softmax(S.process_logits(logits.double(), settings, seen_rows), -1)

    cases = []
    for what, logits, settings, seen_rows, hint in greedy:
        cases.append(
            Case(
                what,
                (logits, settings, seen_rows, torch.Generator().manual_seed(seed)),
                S.next_token(logits, settings, seen_rows),
                hint,
            )
        )
    for i, (what, logits, settings, seen_rows, hint) in enumerate(sampled):
        many_seen = None if seen_rows is None else _many(seen_rows, n_draws)
        cases.append(
            Case(
                f"{what}, {n_draws} draws per row",
                (_many(logits, n_draws), settings, many_seen, torch.Generator().manual_seed(seed + i)),
                expected_probs(logits, settings, seen_rows),
                hint,
            )
        )

    def show(args):
        logits, settings, seen_rows, _ = args
        if logits.shape[0] < n_draws:
            return f"next_token({short(logits, 160)}, {settings}, seen={short(seen_rows, 80)}, generator)"
        B = logits.shape[0] // n_draws
        seen_rows = None if seen_rows is None else seen_rows[:B]
        return (
            f"next_token(logits [{n_draws} × each of these {B} rows: {short(logits[:B], 160)}], {settings}, "
            f"seen={short(seen_rows, 80)}, generator)"
        )

    draws = _draws_judge(n_draws)

    def judge(case: Case, got: Any) -> Verdict:
        if case.expected.dtype == torch.long:  # greedy: the exact tokens
            problem = tensor_problem(got, case.expected)
            return None if problem is None else (problem, "")
        return draws(case, got)

    last: dict = {}

    @functools.wraps(fn)
    def tracked(*args):  # the last arguments, for _blame_part
        last["args"] = args
        return fn(*args)

    try:
        run_check(
            "next_token",
            tracked,
            cases,
            judge=judge,
            forbid=FORBID,
            show_call=show,
            may_modify=[3],
            seconds=5.0,
            total_seconds=20.0,
            error_hints=ERROR_HINTS,
        )
    except CheckFailed as err:
        blamed = _blame_part(fn, last.get("args"), err)
        if blamed:
            raise blamed from None
        raise
    one_row = Settings(temperature=1.0)
    flat = torch.zeros(4, 50)
    generator_contract(
        "next_token",
        lambda gen: call_learner("next_token", fn, (flat, one_row, None, gen), forbid=FORBID, seconds=5.0),
        what="next_token(torch.zeros(4, 50), SamplingParams(temperature=1.0), None, generator)",
    )
    _one_row_draws(
        "next_token",
        fn,
        lambda logits, gen: (logits, one_row, None, gen),
        torch.tensor([[0.5, 0.3, 0.2]]).log(),
        200,
        show,
        seed,
    )


PIPELINE = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


def _blame_part(fn, args: Optional[tuple], err: CheckFailed) -> Optional[CheckFailed]:
    """When next_token fails, the first of the learner's own parts (from the namespace next_token was written in)
    whose output broke what the next step needs, on the failing case's input: that part's name, in a few lines."""
    fn = getattr(fn, "__wrapped__", fn)
    namespace = getattr(fn, "__globals__", {})
    text = str(err)
    if args is None or len(args) != 4:
        return None
    logits, settings, seen, _ = args
    x = logits.float()
    for name in PIPELINE:
        on = {
            "repetition_penalty": settings.repetition_penalty != 1 and seen is not None,
            "temperature": not settings.greedy and settings.temperature != 1,
            "top_k": not settings.greedy and settings.top_k > 0,
            "top_p": not settings.greedy and settings.top_p < 1,
            "min_p": not settings.greedy and settings.min_p > 0,
        }[name]
        if not on:
            continue
        args = (
            (x, seen, settings.repetition_penalty)
            if name == "repetition_penalty"
            else (
                x,
                {
                    "temperature": settings.temperature,
                    "top_k": settings.top_k,
                    "top_p": settings.top_p,
                    "min_p": settings.min_p,
                }[name],
            )
        )
        expected = getattr(S, name)(*args)
        part = namespace.get(name)
        if callable(part) and getattr(part, "__module__", None) != S.__name__:
            try:
                got = call_learner(name, part, args, forbid=FORBID, seconds=5.0)
            except CheckFailed:
                got = None
            broken = None
            if not isinstance(got, Tensor) or got.shape != x.shape:
                broken = f"returned {short(got, 80)}"
            elif bool((got == -INF).all(-1).any()):
                broken = "removed every token of a row (all -inf): nothing is left to draw"
            elif bool(got.isnan().any()):
                broken = "returned nan"
            elif not torch.equal(got > -INF, expected > -INF):
                broken = "kept other tokens than it should"
            if broken:
                first = text.split("\n")[0]
                return CheckFailed(
                    f"{first}\n  the cause: your {name} {broken}, on "
                    f"{name}({', '.join(short(a, 100) for a in args)})\n"
                    f"  hint: next_token uses your {name}, which does not pass its own check: run "
                    f"check_{name}({name}) and fix it first"
                )
        x = expected
    return None


# ----------------------------------------------------------------------------------------------
# Beam search on tiny random models


def tiny_model(seed: int, vocab_size: int = 97, sharpness: float = 4.0) -> GPT2:
    """A 2-layer GPT-2 with random weights whose next token depends on the whole context and whose
    distributions are far from uniform: GPT-2's initialization is scaled up (the layers', so that the
    context matters more than the last token; the final norm's, so that logits spread by `sharpness`)."""
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=vocab_size)
    model = GPT2(config).init_weights(seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith("weight") and not name.startswith(("wte", "wpe")):
                p.mul_(30.0)
        model.wte.weight.mul_(5.0)
        model.wpe.weight.mul_(20.0)
        model.ln_f.weight.mul_(sharpness)
    return model


def _greedy_tokens(model: GPT2, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def one_thread(check: Callable) -> Callable:
    """`check` run with one torch thread: tiny models gain nothing from more, and on a busy machine the
    threads of every small operation wait for each other (10x slower measured)."""

    @functools.wraps(check)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return check(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


@dataclasses.dataclass(frozen=True)
class BeamRules:
    """The chapter's rules of beam search (the defaults), or one known way of getting them wrong: see
    `beam_search_by`, and `BEAM_MISTAKES` for the mistakes and the hints that name them."""

    candidates: int = 2  # candidates taken each step, per beam (1: only num_beams)
    finish_below: int = 1  # a candidate may finish only if its rank < finish_below × num_beams
    eos_at_any_rank: bool = True  # False: only the best candidate's EOS finishes it, the others live on
    length_finishes: bool = True  # False: at max_new_tokens only EOS ends a candidate (else the best live one wins)
    stop: str = "normalized"  # stop early when the best live beam at its length cannot win ("normalized"); "raw":
    # compared unnormalized; "first": as soon as one hypothesis is finished; "never"


def beam_search_by(
    rules: BeamRules,
    model: Callable,
    prompt: Sequence[int],
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    eos_token_id: Optional[int] = None,
) -> list[int]:
    """Beam search by `rules`, written as the chapter asks (whole beams recomputed each step, float32 log-softmax):
    with the default rules, the engine's answer (a test says so); with a mistake's, that mistake's."""
    K = num_beams
    beams, scores = [list(prompt)] * K, torch.full((K,), -INF)
    scores[0] = 0.0
    finished: list[tuple[float, list[int]]] = []
    live: list[tuple[float, list[int]]] = []
    with torch.no_grad():
        for step in range(max_new_tokens):
            log_probs = torch.log_softmax(model(torch.tensor(beams))[:, -1].float(), dim=-1)  # [K, V]
            V = log_probs.shape[-1]
            top, index = torch.topk((scores[:, None] + log_probs).flatten(), rules.candidates * K)
            new_tokens, last = step + 1, step == max_new_tokens - 1
            live = []
            for rank, (score, i) in enumerate(zip(top.tolist(), index.tolist())):
                beam, token = divmod(i, V)
                eos = token == eos_token_id and (rules.eos_at_any_rank or rank == 0)
                if eos or (last and rules.length_finishes):
                    if rank < rules.finish_below * K:
                        finished.append((score / new_tokens**length_penalty, beams[beam] + [token]))
                elif len(live) < K:
                    live.append((score, beams[beam] + [token]))
            finished = sorted(finished, key=lambda f: -f[0])[:K]
            if last or not live or (rules.stop == "first" and finished):
                break
            best = live[0][0] / (1 if rules.stop == "raw" else new_tokens**length_penalty)
            if rules.stop != "never" and len(finished) == K and best <= finished[-1][0]:
                break
            beams, scores = [tokens for _, tokens in live], torch.tensor([score for score, _ in live])
    return (finished[0][1] if finished else live[0][1])[len(prompt) :]  # none finished: only if length_finishes=False


BEAM_MISTAKES = [
    (
        BeamRules(candidates=1),
        "take the 2·num_beams best candidates each step: one that ends with EOS finishes and takes no live beam's "
        "place, so the candidates after it still fill num_beams live beams",
    ),
    (
        BeamRules(eos_at_any_rank=False),
        "a candidate that ends with EOS is finished at any rank among the first num_beams, not only the best one, "
        "and never becomes a live beam",
    ),
    (
        BeamRules(finish_below=2),
        "only candidates ranked among the first num_beams (of the 2·num_beams) may finish: an EOS candidate ranked "
        "lower is dropped",
    ),
    (
        BeamRules(length_finishes=False),
        "at the last step (max_new_tokens) every candidate among the first num_beams finishes, not only those "
        "ending with EOS: then the best finished hypothesis is the answer",
    ),
    (
        BeamRules(stop="first"),
        "do not stop when the first hypothesis is finished: keep searching until num_beams beams are finished and "
        "no live beam can beat the worst of them",
    ),
    (
        BeamRules(stop="raw"),
        "in the stopping test, score the best live beam at its current length (score / new_tokens ** "
        "length_penalty), as the finished ones are scored",
    ),
    (
        BeamRules(stop="never"),
        "stop once num_beams hypotheses are finished and the best live beam, scored at its length, is not better "
        "than the worst of them: searching on finds other texts than transformers' beam search",
    ),
]


class TreeModel:
    """Stands in for a model in beam search: its next-token probabilities after each continuation of the prompt
    come from a table (the new tokens so far -> {token: probability}; the rest of the probability spread over the
    other tokens in decreasing shares, so that no two tie), so that a case can put EOS exactly where a rule
    matters and say every beam's score."""

    def __init__(self, prompt_length: int, table: dict[tuple[int, ...], dict[int, float]], vocab_size: int = 8):
        self.prompt_length, self.table = prompt_length, table
        self.config = GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=vocab_size)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def probs(self, new: tuple[int, ...]) -> Tensor:
        """[V] float64: the next token's probabilities after the new tokens `new`."""
        given, V = self.table.get(new, {}), self.config.vocab_size
        others = [t for t in range(V) if t not in given]
        shares = torch.tensor([0.8**i for i in range(len(others))], dtype=torch.float64)
        probs = torch.zeros(V, dtype=torch.float64)
        probs[others] = shares / shares.sum() * (1 - sum(given.values()))
        probs[list(given)] = torch.tensor(list(given.values()), dtype=torch.float64)
        return probs

    def __call__(self, input_ids, *args, **kwargs) -> Tensor:
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        logits = torch.empty(*ids.shape, self.config.vocab_size)  # [B, T, V], the same at every position
        for row in range(ids.shape[0]):
            logits[row] = self.probs(tuple(ids[row, self.prompt_length :].tolist())).log().float()
        return logits

    def __repr__(self) -> str:
        return "model"


TREE_PROMPT, TREE_EOS = [6, 6], 7


def _beam_trees() -> list[tuple[str, dict, int, int, float]]:
    """The stopping rules of beam search, each where it decides the answer: (what the case shows, a TreeModel's
    table, num_beams, max_new_tokens, length_penalty), for the prompt TREE_PROMPT and EOS = TREE_EOS."""
    A, B, X, Y, EOS = 1, 2, 4, 5, TREE_EOS
    return [
        (
            "2 beams: after the prompt A .5, EOS .4 (ranked 2nd: [EOS] is finished, never extended), B .05; after A, "
            "X .3: [EOS] wins (-0.92 against [A, X]'s -1.90 / 2)",
            {(): {A: 0.5, EOS: 0.4, B: 0.05}, (A,): {X: 0.3}, (EOS,): {Y: 0.99}},
            2,
            2,
            1.0,
        ),
        (
            "2 beams: after the prompt A .5, EOS .3 (ranked 2nd: it finishes), B .15; after B, EOS .95: [B, EOS] "
            "wins (-1.95 / 2), found only by keeping 2·num_beams candidates",
            {(): {A: 0.5, EOS: 0.3, B: 0.15}, (B,): {EOS: 0.95}, (A,): {X: 0.2}},
            2,
            2,
            1.0,
        ),
        (
            "2 beams: after the prompt A .34, B .33, EOS .32 (ranked 3rd, below num_beams: it does not finish)",
            {(): {A: 0.34, B: 0.33, EOS: 0.32}, (A,): {X: 0.25}, (B,): {Y: 0.2}},
            2,
            2,
            1.0,
        ),
        (
            "2 beams, max_new_tokens 2: EOS .45 first, then A .35 and A X .9: reaching max_new_tokens finishes [A, X], "
            "which wins (-1.15 / 2)",
            {(): {EOS: 0.45, A: 0.35, B: 0.15}, (A,): {X: 0.9}},
            2,
            2,
            1.0,
        ),
        (
            "1 beam, length_penalty 2: EOS .6 first, so one beam stops there, as greedy decoding does",
            {(): {EOS: 0.6, A: 0.3}, (A,): {EOS: 0.99}},
            1,
            3,
            2.0,
        ),
        (
            "2 beams: EOS .3 finishes first, then [A, EOS] (-1.40 / 2); the live [A, X] (-1.51) scored at its length "
            "(-0.76) can still beat the worst finished (-1.20), and [A, X, EOS] wins",
            {(): {A: 0.55, EOS: 0.3, B: 0.1}, (A,): {EOS: 0.45, X: 0.4}, (A, X): {EOS: 0.99}},
            2,
            3,
            1.0,
        ),
    ]


def _beam_mistake(case: Case, got: Any) -> str:
    """The hint of the first of BEAM_MISTAKES whose answer on the case is `got`, else ''."""
    for rules, hint in BEAM_MISTAKES:
        try:
            if beam_search_by(rules, *case.args) == got:
                return hint
        except Exception:  # a mistake that cannot run on this case names nothing
            continue
    return ""


@one_thread
def check_beam_search(fn, *, seed: int = 0, n_random: int = 1) -> None:
    """beam_search(model, prompt_ids, num_beams, max_new_tokens, length_penalty=1.0, eos_token_id=None)
    -> the new token ids of the best beam, as the engine's (and transformers') beam search."""
    fn = unwritten_helper(fn)
    models = {s: tiny_model(s) for s in (seed, seed + 1)}
    g = torch.Generator().manual_seed(seed)

    def case(description, model_seed, prompt, num_beams, new, length_penalty, eos, hint=""):
        model = models[model_seed]
        expected = engine_beam_search(
            model, prompt, num_beams=num_beams, max_new_tokens=new, length_penalty=length_penalty, eos_token_id=eos
        )
        return Case(description, (model, prompt, num_beams, new, length_penalty, eos), expected, hint)

    prompt = [5, 17, 42]
    eos = _greedy_tokens(models[seed], prompt, 3)[2]  # a token that greedy decoding meets on its 3rd step
    cases = [
        case(
            "one beam is greedy decoding",
            seed,
            prompt,
            1,
            6,
            1.0,
            None,
            "with num_beams=1 beam search must give greedy decoding's tokens",
        ),
        case(
            "3 beams, no EOS",
            seed,
            [1, 2, 3],
            3,
            8,
            1.0,
            None,
            "at the first step all beams are the same prompt: expand only the first (the others start at -inf), "
            "or they pick the same tokens",
        ),
        case(
            f"3 beams, EOS = {eos} (met on the way)",
            seed,
            prompt,
            3,
            10,
            1.0,
            eos,
            "a beam that ends in EOS is finished; keep searching until num_beams beams are finished and no live "
            "beam can beat the worst of them",
        ),
        case(
            f"4 beams, EOS = {eos}, length_penalty 2.0",
            seed,
            prompt,
            4,
            10,
            2.0,
            eos,
            "a finished beam's score is its sum of log-probabilities / (number of new tokens) ** length_penalty",
        ),
        case(
            f"2 beams, EOS = {eos}, length_penalty 0.5",
            seed,
            prompt,
            2,
            10,
            0.5,
            eos,
            "a finished beam's score is its sum of log-probabilities / (number of new tokens) ** length_penalty",
        ),
    ]
    # EOS id 0: the model with tokens 0 and `eos` swapped (rows of the tied embedding) meets token 0 on the way
    eos = _greedy_tokens(models[seed], prompt, 3)[2]
    swapped = tiny_model(seed)
    with torch.no_grad():
        swapped.wte.weight[[0, eos]] = swapped.wte.weight[[eos, 0]].clone()
    models["swapped"] = swapped
    swap = {0: eos, eos: 0}
    cases.append(
        case(
            "3 beams, EOS id 0 (a real token, met on the way)",
            "swapped",
            [swap.get(t, t) for t in prompt],
            3,
            10,
            1.0,
            0,
            "token id 0 is a real token: compare with `token == eos_token_id`, not `if eos_token_id`",
        )
    )
    defaults = case(
        "called without length_penalty and eos_token_id (defaults 1.0 and None)",
        seed,
        [7, 8, 9],
        3,
        8,
        1.0,
        None,
        "the defaults: length_penalty=1.0, eos_token_id=None",
    )
    cases.append(dataclasses.replace(defaults, args=defaults.args[:4]))
    # the stopping rules, each where it decides the answer, on scripted models: early, so that a mistake in them is
    # named by the first case it fails (after the two that show the start)
    trees = []
    for what, table, num_beams, new_tokens, length_penalty in _beam_trees():
        args = (TreeModel(len(TREE_PROMPT), table), TREE_PROMPT, num_beams, new_tokens, length_penalty, TREE_EOS)
        trees.append(Case(f"{what} (A = 1, B = 2, X = 4, Y = 5, EOS = 7)", args, beam_search_by(BeamRules(), *args)))
    cases[2:2] = trees
    doubles = {s: tiny_model(s).double() for s in (seed, seed + 1)}
    attempts = 0
    while len(cases) < 11 + n_random and attempts < 4 * (n_random + 1):
        attempts += 1
        model_seed = seed + attempts % 2
        prompt = torch.randint(0, 97, (_randint(g, 1, 6),), generator=g).tolist()
        greedy = _greedy_tokens(models[model_seed], prompt, 4)
        eos = _choice(g, [None, greedy[1], greedy[3]])
        settings = (_randint(g, 2, 5), _randint(g, 4, 12), _choice(g, [0.5, 1.0, 1.5, -0.5]), eos)
        new = case(f"random: model {model_seed}, prompt {prompt}, EOS {eos}", model_seed, prompt, *settings)
        if new.expected == engine_beam_search(
            doubles[model_seed],
            prompt,
            num_beams=settings[0],
            max_new_tokens=settings[1],
            length_penalty=settings[2],
            eos_token_id=eos,
        ):
            cases.append(new)  # no near-tie that float32 rounding (cached or not) could flip

    def show(args):
        model, prompt, num_beams, new, *rest = args
        more = ", length_penalty={}, eos_token_id={}".format(*rest) if rest else ""
        return f"beam_search(model, {prompt}, num_beams={num_beams}, max_new_tokens={new}{more})"

    def judge(case: Case, got: Any) -> Verdict:
        expected = case.expected
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            return f"expected a list of token ids (Python ints), got {short(got, 80)}", ""
        if got == expected:
            return None
        same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        return (
            f"a different sequence ({len(got)} token{'s' * (len(got) != 1)} instead of {len(expected)}; "
            f"the first difference at position {same})",
            _beam_mistake(case, got),
        )

    run_check(
        "beam_search",
        fn,
        cases,
        judge=judge,
        forbid=FORBID,
        show_call=show,
        may_modify=[0],
        seconds=10.0,
        total_seconds=30.0,
    )


# ----------------------------------------------------------------------------------------------
# The generation loop


class _Pieces(list):
    """The pieces a stream yielded; `first_at`: the model's calls when the first non-empty one came; `returned`: the
    type of what the function returned when it was not an iterator (a list: not streamed); `global_rng_used`:
    whether torch's global generator changed meanwhile."""

    first_at: Optional[int] = None
    calls: Optional[int] = None
    returned: Optional[str] = None
    global_rng_used: bool = False


class ScriptedModel:
    """Stands in for GPT-2: whatever the text, its next token is the script's next one (a logit 30 above
    the rest), so a check knows exactly which tokens a correct loop produces. A step of the script may also
    be {token: logit} (the others 0): then the settings decide (a repetition penalty, a draw)."""

    def __init__(self, prompt_length: int, script: list[Union[int, dict[int, float]]]):
        self.prompt_length, self.script = prompt_length, script
        self.config = GPT2Config(n_layer=1, n_head=1, n_embd=8)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    calls = 0  # how many times it was called (a stream's first piece must come before the last call)

    def __call__(self, input_ids, *args, **kwargs) -> Tensor:
        self.calls += 1
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        B, T = ids.shape
        step = min(max(T - self.prompt_length, 0), len(self.script) - 1)
        logits = torch.zeros(B, T, self.config.vocab_size)
        entry = self.script[step]
        for token, logit in ({entry: 30.0} if isinstance(entry, int) else entry).items():
            logits[:, -1, token] = logit
        return logits

    def __repr__(self) -> str:
        return "model"


def stream_tokens(
    model: Callable,
    prompt_ids: list[int],
    settings: S.SamplingParams,
    max_new_tokens: int,
    seed: int,
    *,
    seen_prompt: bool = True,
    seen_new: bool = True,
    one_generator: bool = True,
) -> list[int]:
    """The new tokens the engine's loop chooses (EOS not minded): the engine's next_token on the last position's
    logits, `seen` the prompt's and the new tokens, one generator seeded `seed` (`generate`'s own, a test says).
    With `seen_prompt`, `seen_new` or `one_generator` False, the tokens of a loop that gets that wrong."""
    ids, generator = list(prompt_ids), torch.Generator().manual_seed(seed)
    seen = torch.zeros(1, model.config.vocab_size, dtype=torch.bool)
    seen[0, ids] = seen_prompt
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if not one_generator:
                generator = torch.Generator().manual_seed(seed)
            token = int(S.next_token(model(torch.tensor([ids]))[:, -1], settings, seen, generator))
            ids.append(token)
            if seen_new:
                seen[0, token] = True
    return ids[len(prompt_ids) :]


STREAM_MISTAKES = [  # (how the loop goes wrong: stream_tokens' arguments, the hint that names it)
    (dict(settings=S.SamplingParams()), "pass the settings given to your next_token: they are not always greedy"),
    (
        dict(seen_new=False),
        "add each new token to seen as soon as it is chosen (seen[0, token] = True): the repetition penalty applies "
        "to the tokens the stream wrote too",
    ),
    (dict(seen_prompt=False), "seen starts with the prompt's tokens (seen[0, ids] = True before the loop)"),
    (
        dict(one_generator=False),
        "make the generator once, before the loop, and pass that one to next_token at every step: a new generator "
        "each step draws the same number again",
    ),
    (dict(seed=0), "seed the generator with the seed given: torch.Generator().manual_seed(seed)"),
]


def _stream_mistake(case: Case, text: str) -> str:
    """The hint of the first of STREAM_MISTAKES whose text on a scripted case is `text`, else ''."""
    model, tok, prompt, settings, max_new_tokens, *rest = case.args
    eos, stop, seed = rest or (EOT_ID, (), 0)
    prompt_ids = tok.encode(prompt, allowed_special="all")
    for change, hint in STREAM_MISTAKES:
        arguments = {"settings": settings, "seed": seed, **change}
        tokens = stream_tokens(model, prompt_ids, max_new_tokens=max_new_tokens, **arguments)
        if "".join(stop_at(decoded(iter(tokens), tok, eos), stop)) == text:
            return hint
    return ""


@one_thread
def check_stream_text(fn, *, seed: int = 0, n_random: int = 0) -> None:
    """stream_text(model, tokenizer, prompt, settings, max_new_tokens, eos_token_id=EOT_ID, stop=(), seed=0)
    yields text pieces; together they are the engine's `generate_text` with the same settings."""
    tok = get_tokenizer()
    Settings = S.SamplingParams
    greedy = Settings()

    def run(*args):  # the learner's generator, run to the end: the list of pieces, and when the first came
        model = args[0]
        if isinstance(model, ScriptedModel):
            model.calls = 0
        try:
            pieces, global_rng = _Pieces(), torch.random.get_rng_state()
            stream = fn(*args)
            pieces.returned = None if isinstance(stream, Iterator) else type(stream).__name__
            for piece in stream:
                if pieces.first_at is None and isinstance(piece, str) and piece:
                    pieces.first_at = getattr(model, "calls", None)
                pieces.append(piece)
            pieces.calls = getattr(model, "calls", None)
            pieces.global_rng_used = not torch.equal(global_rng, torch.random.get_rng_state())
            return pieces
        except NotImplementedError as err:
            stub = traceback.extract_tb(err.__traceback__)[-1].name
            if stub != getattr(fn, "__name__", stub):
                raise RuntimeError(
                    f"it calls {stub}, which is not written yet: write that exercise first (its check must pass)"
                ).with_traceback(err.__traceback__) from None
            raise

    def scripted(
        description, prompt, script, max_new, eos=EOT_ID, stop=(), hint="", defaults=False, settings=greedy, at=seed
    ):
        prompt_ids = tok.encode(prompt, allowed_special="all")
        model = ScriptedModel(len(prompt_ids), script)
        if all(isinstance(step, int) for step in script):  # the model repeats its last token
            tokens = (script + script[-1:] * max_new)[:max_new]
        else:
            tokens = stream_tokens(model, prompt_ids, settings, max_new, at)
        expected = "".join(stop_at(decoded(iter(tokens), tok, eos), stop))
        args = (model, tok, prompt, settings, max_new) + (() if defaults else (eos, tuple(stop), at))
        return Case(description, args, expected, hint)

    hello = tok.encode(" Hello world, and good night.")
    llama = tok.encode(" I ❤ 🦙 llamas")
    yes, no = tok.encode(" yes") + tok.encode(" no")
    cases = [
        scripted("stop after max_new_tokens = 3", "Say:", hello, 3, hint="exactly max_new_tokens new tokens"),
        scripted(
            "EOS ends the text (not shown)",
            "Say:",
            hello[:4] + [EOT_ID] + hello[4:],
            20,
            hint="stop as soon as the new token is EOS, before decoding it",
        ),
        scripted("EOS as the very first token: no text", "Say:", [EOT_ID] + hello, 20),
        scripted("eos_token_id=None never stops early", "Say:", hello[:3] + [EOT_ID] + hello[3:], 6, eos=None),
        scripted(
            "an emoji split over several tokens is yielded whole",
            "Love:",
            llama,
            20,
            hint="push every token through a StreamDecoder: it holds back an unfinished UTF-8 character",
        ),
        scripted(
            "a stop string inside one token",
            "Say:",
            hello,
            20,
            stop=("world",),
            hint="yield the text before the stop string, then stop",
        ),
        scripted(
            "a stop string spread over two tokens",
            "Say:",
            hello,
            20,
            stop=("lo wor",),
            hint="the stop string can span tokens: look for it in all the text so far (holding back text "
            "that could be the start of a stop string)",
        ),
        scripted("two stop strings: the first one in the text wins", "Say:", hello, 20, stop=("night", ", and")),
        scripted("a stop string that never comes", "Say:", hello, 8, stop=("xyz",)),
        scripted(
            "called as the engine would, without eos_token_id, stop and seed (EOS = <|endoftext|>)",
            "Say:",
            hello[:3] + [EOT_ID] + hello[3:],
            20,
            defaults=True,
            hint="the defaults: eos_token_id=EOT_ID, stop=(), seed=0",
        ),
        scripted(
            "EOS id 0 (the token '!')",
            "Say:",
            tok.encode(" Wow! Yes!"),
            20,
            eos=0,
            hint="token id 0 is a real token: compare with `token == eos_token_id`, not `if eos_token_id`",
        ),
        scripted(
            "a prompt with <|endoftext|> in it",
            "One.<|endoftext|>Two:",
            hello,
            6,
            hint='encode the prompt with allowed_special="all" (<|endoftext|> is one token, id 50256)',
        ),
        scripted(
            "a prompt with the stop string in it: only the new text is searched",
            "Say world:",
            hello,
            20,
            stop=("world", "night"),
        ),
        scripted(
            "max_new_tokens ends inside an emoji: flush the decoder at the end",
            "Love:",
            llama,
            5,
            hint="after the loop, yield what decoder.flush() returns (an unfinished character becomes '\\ufffd')",
        ),
        scripted("a long text: the first piece comes as soon as it is decoded", "Say:", hello, 8),
        # the settings and the bookkeeping: seen (the prompt's tokens and each new one) and one generator
        scripted(
            "repetition penalty 1.5, greedy: ' Hello' (in the prompt) and ' world' (once chosen) lose to the next best",
            "Say: Hello",
            [
                {hello[0]: 3.0, hello[1]: 2.5},
                {hello[0]: 3.0, hello[2]: 2.5},
                {hello[1]: 3.0, hello[3]: 2.5},
                *hello[4:],
            ],
            6,
            settings=Settings(repetition_penalty=1.5),
            hint="pass the settings to your next_token, with seen: the prompt's tokens and each new token as soon "
            "as it is chosen",
        ),
        scripted(
            f"temperature 1, top-k 2, seed {seed + 5}: two tokens as likely at each step, a draw from one generator",
            "Yes or no?",
            [{yes: 30.0, no: 30.0}] * 8,
            8,
            settings=Settings(temperature=1.0, top_k=2),
            at=seed + 5,
            hint=f"one generator, torch.Generator().manual_seed(seed) with the seed given ({seed + 5}), made once "
            "before the loop and passed to your next_token at every step, with the settings given",
        ),
    ]
    model = tiny_model(seed + 10, vocab_size=1000)  # GPT-2's first 1000 tokens: short, common pieces of text
    for i in range(n_random + 1):
        settings = [
            Settings(),
            Settings(temperature=0.8, top_k=20),
            Settings(temperature=1.0, top_p=0.9, repetition_penalty=1.3),
        ][i % 3]
        prompt, eos, new = "The", [None, 13, 11][i % 3], 10 + 2 * i
        expected = generate_text(
            model,
            tok,
            prompt,
            max_new_tokens=new,
            eos_token_id=eos,
            seed=seed + i,
            **{f: getattr(settings, f) for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
        )
        cases.append(
            Case(
                f"a tiny random GPT-2, {settings}, seed {seed + i}",
                (model, tok, prompt, settings, new, eos, (), seed + i),
                expected,
            )
        )

    def show(args):
        model, _, prompt, settings, new, *rest = args
        more = ", eos_token_id={}, stop={}, seed={}".format(*rest) if rest else ""
        return f"stream_text({model!r}, tokenizer, {prompt!r}, {settings}, max_new_tokens={new}{more})"

    def judge(case, got) -> Verdict:
        if not all(isinstance(piece, str) for piece in got):
            return f"every piece must be a str, got {short(list(got), 100)}", ""
        text, expected = "".join(got), case.expected
        if text != expected:
            problem = f"the text differs: expected {expected!r}, got {text!r}"
            if "\ufffd" in text and "\ufffd" not in expected:
                return (
                    f"the text differs: got a '\\ufffd' (a piece of an unfinished UTF-8 character) in {text!r}",
                    "push every token through a StreamDecoder: it holds back an unfinished UTF-8 character",
                )
            if expected.startswith(text) and expected.endswith("\ufffd"):
                return problem, (
                    "the text ends too early: after the loop, yield what decoder.flush() returns (the "
                    "bytes of an unfinished character)"
                )
            model = case.args[0]
            if isinstance(model, ScriptedModel) and not all(isinstance(step, int) for step in model.script):
                return problem, _stream_mistake(case, text)
            if not isinstance(model, ScriptedModel) and case.args[3].temperature > 0 and expected[:3] == text[:3]:
                return problem, (
                    "use torch.Generator().manual_seed(seed) once, and your next_token on the last "
                    "position's logits, with seen (the prompt's and the new tokens) for the repetition "
                    "penalty"
                )
            return problem, ""
        if got.global_rng_used:
            return (
                "the text is right, but torch's global generator changed (torch.manual_seed, or a draw without "
                "generator=)",
                "make one generator, torch.Generator().manual_seed(seed), and pass it to next_token: a stream must "
                "not reseed or draw from the global generator that the rest of the program uses",
            )
        if got.returned is not None:
            return (
                f"the text is right, but stream_text returned a {got.returned}: it must be a generator function that "
                "yields each piece as soon as it is ready",
                "write `yield piece` where a piece is ready, not `pieces.append(piece)` and `return pieces`",
            )
        if len(expected) > 12 and len([p for p in got if p]) < 2:
            return (
                "the text is right, but it came in one piece: yield each piece as soon as it is decoded (stream it)",
                "",
            )
        if got.first_at is not None and got.calls is not None and got.calls > 2 and got.first_at >= got.calls:
            return (
                f"the text is right, but its first piece came only after the model's last call ({got.calls} "
                f"calls): yield each piece as soon as it is decoded, before computing the next token"
            ), ""
        return None

    run_check(
        "stream_text",
        run,
        cases,
        judge=judge,
        forbid=FORBID,
        show_call=show,
        may_modify=[0, 1],
        seconds=10.0,
        total_seconds=30.0,
        timeout_hint="the loop must end after max_new_tokens tokens, at EOS or at a stop string",
    )
