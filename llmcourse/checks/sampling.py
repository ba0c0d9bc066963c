"""Checks for chapter 05, from logits to the next token: the logits processors (temperature, top-k,
top-p, min-p, repetition penalty), greedy and sampled choice, the whole sampler, beam search and the
generation loop.

Processors are compared with the engine's (`llmcourse.sampling`, itself tested equal to transformers'
logits processors) on random logits with ties, in float32 and float64, batch > 1 and odd vocabulary
sizes; a wrong answer first says which tokens should have been kept. Samplers are tested as samplers:
many seeded draws in one call, and a chi-square test of their frequencies against the expected
distribution (fixed seeds, so a check gives the same verdict every time it runs).

    >>> import torch
    >>> def temperature(logits, t):
    ...     return logits / t
    >>> check_temperature(temperature)
    ✓ temperature — 9 cases

The engine's own functions (and transformers') are the black boxes: passing them fails.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .. import sampling as S
from ..config import GPT2Config
from ..generate import beam_search as engine_beam_search
from ..generate import decoded, generate_text, stop_at
from ..model import GPT2
from ..tokenizer import EOT_ID, get_tokenizer
from .core import Case, CheckFailed, Verdict, run_check, unwritten_helper
from .forbid import Forbidden
from .show import short
from .tensors import diagnose, tensor_judge, tensor_problem

# ----------------------------------------------------------------------------------------------
# Black boxes

ENGINE = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "process_logits", "next_token",
          "greedy", "sample")
NO_ENGINE = [Forbidden(f"llmcourse.sampling.{name}", "The engine's version is the black box here: write your own "
                       "(and use your own functions from this chapter).")
             for name in ENGINE if hasattr(S, name)]
NO_LIBRARIES = [
    Forbidden("transformers", "transformers' logits processors are what your code is compared with: write your own."),
    Forbidden("llmcourse.generate", "The engine's generation loop is what your code is compared with: write your own."),
]
FORBID = [*NO_ENGINE, *NO_LIBRARIES]

FLOAT_TOL = {torch.float32: (1e-6, 1e-5), torch.float64: (1e-12, 1e-12)}
INF = float("inf")


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


# ----------------------------------------------------------------------------------------------
# Processors: logits [B, V] -> logits [B, V] with removed tokens at -inf


def _kept(x: Tensor) -> list[int]:
    return torch.nonzero(x > -INF).flatten().tolist()


def _ids(ids: list[int]) -> str:
    return short(ids, 90)


def _kept_judge(mistakes: Sequence[tuple[Callable, str]]) -> Callable[[Case, Any], Verdict]:
    """A judge that first compares which tokens are kept (not -inf), row by row, then the values."""
    values = tensor_judge(FLOAT_TOL, mistakes)

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
                problem = (f"row {row}: expected {int(kept_expected[row].sum())} tokens kept: "
                           f"{_ids(_kept(expected[row]))}, got {what}")
                atol, rtol = FLOAT_TOL[torch.float64 if expected.dtype == torch.float64 else torch.float32]
                return problem, diagnose(got, case.args, mistakes, expected, atol=atol, rtol=rtol)
        return values(case, got)

    return judge


def _processor_check(name: str, fn, cases: list[Case], mistakes, timeout_hint: str = "", **kwargs) -> None:
    run_check(name, fn, cases, judge=_kept_judge(mistakes), forbid=FORBID, timeout_hint=timeout_hint,
              seconds=5.0, total_seconds=20.0, **kwargs)


def _wrong_dim_softmax(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=0)


def check_temperature(fn, *, seed: int = 0, n_random: int = 4) -> None:
    """temperature(logits [B, V], t) -> logits / t, in the input's dtype."""
    mistakes = [(lambda x, t: x * t, "divide by t (t < 1 sharpens the distribution), do not multiply"),
                (lambda x, t: torch.softmax(x / t, dim=-1), "return logits (divided by t), not probabilities: "
                                                             "the filters and the sampler come after")]
    cases = [Case("t = 0.5 doubles the logits", (torch.tensor([[2.0, 1.0, -1.0]]), 0.5), torch.tensor([[4.0, 2.0, -2.0]])),
             Case("t = 2", (torch.tensor([[2.0, 1.0, -1.0]]), 2.0), torch.tensor([[1.0, 0.5, -0.5]])),
             Case("t = 1 changes nothing", (torch.tensor([[3.0, -7.0]]), 1.0), torch.tensor([[3.0, -7.0]])),
             Case("-inf (a removed token) stays -inf", (torch.tensor([[1.0, -INF, 0.5]]), 0.7),
                  torch.tensor([[1.0, -INF, 0.5]]) / 0.7)]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random + 1):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 1, 4), _randint(g, 3, 41) | 1, _choice(g, ["spread", "masked"]), dtype)
        t = _choice(g, [0.3, 0.7, 1.3, 2.5])
        cases.append(Case(f"random {_row_description(logits)}, t={t}", (logits, t), S.temperature(logits, t)))
    run_check("temperature", fn, cases, judge=tensor_judge(FLOAT_TOL, mistakes), forbid=FORBID, seconds=5.0,
              total_seconds=20.0)


def check_greedy(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """greedy(logits [B, V]) -> token ids [B] (torch.long): each row's argmax, the lowest id on ties."""
    def case(description, logits, hint=""):
        return Case(description, (logits,), logits.argmax(dim=-1), hint)

    cases = [case("one row", torch.tensor([[0.1, 3.0, -2.0]])),
             case("two rows: one token per row", torch.tensor([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]]),
                  "take the argmax along the vocabulary (dim=-1), one per row"),
             case("a tie: the lowest id wins", torch.tensor([[1.0, 4.0, 2.0, 4.0]]),
                  "torch.argmax returns the first of equal maxima"),
             case("-inf everywhere but one token", torch.tensor([[-INF, -INF, -3.0]])),
             case("three rows, far from 0", torch.tensor([[1000.0, 1001.0], [-500.0, -501.0], [7.0, 7.5]]))]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 2, 5), _randint(g, 3, 61) | 1, _choice(g, ["ties", "spread", "masked"]),
                                dtype)
        cases.append(case(f"random {_row_description(logits)}", logits))

    def judge(c: Case, got: Any) -> Verdict:
        problem = tensor_problem(got, c.expected)
        if problem is None:
            return None
        hint = ""
        if isinstance(got, Tensor) and got.shape == (c.expected.shape[0], 1):
            hint = "return a 1-d tensor [B] (squeeze the last dimension or use argmax without keepdim)"
        elif isinstance(got, Tensor) and got.dtype != torch.long:
            hint = "return token ids (torch.long), such as argmax's indices, not the maximum values"
        return problem, hint

    run_check("greedy", fn, cases, judge=judge, forbid=FORBID, seconds=5.0, total_seconds=20.0)


def check_top_k(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """top_k(logits [B, V], k) -> [B, V]: the k highest and any tied with the k-th kept, the rest -inf."""
    def strict(x, k):  # exactly k, ties dropped
        idx = torch.topk(x, min(k, x.shape[-1])).indices
        return torch.full_like(x, -INF).scatter(-1, idx, x.gather(-1, idx))

    mistakes = [
        (strict, "keep every token tied with the k-th highest logit: compare with the k-th value (>=) instead of "
                 "keeping exactly k positions"),
        (lambda x, k: S.top_k(x, k + 1), "off by one: keep k tokens, not k + 1"),
        (lambda x, k: x.masked_fill(x < torch.topk(x, min(k, x.shape[-1])).values[..., -1:], 0.0),
         "removed tokens must be -inf (probability 0 after softmax), not 0"),
        (lambda x, k: x.masked_fill(x < torch.sort(x.flatten(), descending=True).values[k - 1], -INF),
         "find the k-th highest value of each row (along dim=-1), not of the whole batch"),
    ]
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    cases = [Case("keep 2", (x, 2), torch.tensor([[2.0, 1.0, -INF, -INF]])),
             Case("ties with the k-th are kept", (torch.tensor([[1.0, 3.0, 1.0, 0.0, 1.0]]), 2),
                  torch.tensor([[1.0, 3.0, 1.0, -INF, 1.0]]),
                  "keep every token whose logit is >= the k-th highest: here 3 tokens tie for 2nd place"),
             Case("k larger than the vocabulary keeps all", (x, 10), x.clone(),
                  "k larger than V keeps every token: use min(k, V)"),
             Case("k = 1", (torch.tensor([[0.0, 5.0, 5.0, 1.0]]), 1), torch.tensor([[-INF, 5.0, 5.0, -INF]])),
             Case("two rows, each with its own k-th value", (torch.tensor([[5.0, 4.0, 3.0], [-1.0, -2.0, -3.0]]), 2),
                  torch.tensor([[5.0, 4.0, -INF], [-1.0, -2.0, -INF]]))]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        V = _randint(g, 3, 61) | 1
        logits = _random_logits(g, _randint(g, 2, 5), V, _choice(g, ["ties", "ties", "spread", "masked"]), dtype)
        k = _randint(g, 1, V + 2)
        cases.append(Case(f"random {_row_description(logits)}, k={k}", (logits, k), S.top_k(logits, k)))
    _processor_check("top_k", fn, cases, mistakes, error_hints={
        "selected index k out of range": "k may be larger than the vocabulary: use min(k, V)"})


def _unambiguous(fn: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether fn's kept set is the same whatever order ties are sorted in (no removed token has the logit
    of a kept one, in any row), and the same when computed in float64."""
    kept = fn(x) > -INF
    if not torch.equal(kept, fn(x.double()) > -INF):
        return False
    lowest_kept = x.masked_fill(~kept, INF).amin(-1)                      # [B]
    highest_removed = x.masked_fill(kept, -INF).amax(-1)                  # [B]
    return bool((highest_removed < lowest_kept).all())


def _near_cut(probs_sorted_cumulative: Tensor, cut: float) -> bool:
    return bool(((probs_sorted_cumulative - cut).abs() < 1e-5).any())


def check_top_p(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """top_p(logits [B, V], p) -> [B, V] (transformers' TopPLogitsWarper)."""
    def too_few(x, p):  # keeps tokens while the cumulative probability, including them, is <= p
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        keep = probs.cumsum(-1) <= p
        keep[..., 0] = True
        return x.masked_fill(~keep.scatter(-1, order, keep), -INF)

    def too_many(x, p):  # keeps the first token whose cumulative probability exceeds p, and one more
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        keep = probs.cumsum(-1) - probs <= p
        keep[..., 1:] &= (probs.cumsum(-1) - probs)[..., :-1] < p
        return x.masked_fill(~keep.scatter(-1, order, keep), -INF)

    def keep_below_p(x, p):  # removes tokens while the cumulative, from the least likely, is <= p
        return S.top_p(x, 1 - p) if p < 1 else x

    def on_logits(x, p):  # a cumulative sum of logits, not probabilities
        sorted_x, order = torch.sort(x)
        remove = sorted_x.cumsum(-1) <= 1 - p
        remove[..., -1] = False
        return x.masked_fill(remove.scatter(-1, order, remove), -INF)

    mistakes = [(too_few, "one token too few: keep the token whose probability makes the sum pass p (the smallest "
                          "set whose probabilities add up to MORE than p)"),
                (keep_below_p, "remove the least likely tokens while their cumulative probability is <= 1 - p "
                               "(not <= p)"),
                (on_logits, "add up probabilities (softmax first), not logits"),
                (lambda x, p: S.top_p(x.T, p).T if x.shape[0] > 1 else None,
                 "softmax and sort each row along the vocabulary (dim=-1)")]
    def case(description, logits, p, hint=""):
        return Case(description, (logits, p), S.top_p(logits, p), hint)

    two_rows = torch.tensor([[3.0, 0.0, 0.5, -1.0], [0.0, 0.3, -0.2, 0.1]])
    cases = [case("probabilities .5 .3 .2, p = 0.6 keeps 2", torch.tensor([[0.5, 0.3, 0.2]]).log(), 0.6,
                  "keep the most likely tokens until their probabilities add up to MORE than p: 0.5 is not "
                  "more than 0.6, 0.5 + 0.3 is"),
             case("probabilities .25 .5 .25, p = 0.4: the most likely alone is more than p",
                  torch.tensor([[0.25, 0.5, 0.25]]).log(), 0.4),
             case("a tiny p keeps the most likely token", torch.tensor([[1.0, 2.0, 0.0]]), 0.01,
                  "the most likely token is always kept"),
             case("two rows, each with its own distribution", two_rows, 0.7),
             case("some tokens already removed (-inf)", torch.tensor([[1.0, -INF, 0.5, -INF, 0.0]]), 0.8)]
    g = torch.Generator().manual_seed(seed)
    attempts = 0
    while len(cases) < 5 + n_random and attempts < 50 * (n_random + 1):
        attempts += 1
        dtype = torch.float64 if attempts % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "ties", "spread", "masked"]),
                                dtype)
        p = _choice(g, [0.1, 0.3, 0.5, 0.75, 0.9, 0.95])
        cumulative = torch.sort(torch.softmax(logits.double(), -1)).values.cumsum(-1)
        if _unambiguous(lambda x: S.top_p(x, p), logits) and not _near_cut(cumulative, 1 - p):
            cases.append(Case(f"random {_row_description(logits)}, p={p}", (logits, p), S.top_p(logits, p)))
    _processor_check("top_p", fn, cases, mistakes)


def check_min_p(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """min_p(logits [B, V], p) -> [B, V] (transformers' MinPLogitsWarper)."""
    def of_sum(x, p):
        return x.masked_fill(torch.softmax(x, -1) < p, -INF)

    def on_logits(x, p):
        return x.masked_fill(x < p * x.amax(-1, keepdim=True), -INF)

    def batch_max(x, p):
        probs = torch.softmax(x, -1)
        return x.masked_fill(probs < p * probs.max(), -INF)

    mistakes = [(batch_max, "each row has its own largest probability: amax(dim=-1, keepdim=True)"),
                (of_sum, "compare each probability with p times the LARGEST probability of its row, not with p "
                         "(p times the sum, which is 1)"),
                (on_logits, "compare probabilities (softmax first), not logits")]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    cases = [Case("p = 0.2: keep probabilities >= 0.2 × 0.5", (probs.log(), 0.2),
                  probs.log().masked_fill(torch.tensor([[False, False, False, True]]), -INF),
                  "a token is kept if its probability is >= p × the largest probability (0.1 here)"),
             Case("p = 0.5: keep probabilities >= 0.25", (probs.log(), 0.5),
                  probs.log().masked_fill(torch.tensor([[False, False, True, True]]), -INF)),
             Case("a flat distribution keeps everything", (torch.zeros(1, 5), 0.9), torch.zeros(1, 5)),
             Case("large logits (softmax must subtract the max)", (torch.tensor([[1000.0, 999.0, 990.0]]), 0.3),
                  torch.tensor([[1000.0, 999.0, -INF]])),
             Case("two rows with different maxima", (torch.tensor([[4.0, 3.0, 0.0], [0.0, 0.2, 0.1]]), 0.3),
                  S.min_p(torch.tensor([[4.0, 3.0, 0.0], [0.0, 0.2, 0.1]]), 0.3))]
    g = torch.Generator().manual_seed(seed)
    attempts = 0
    while len(cases) < 5 + n_random and attempts < 50 * (n_random + 1):
        attempts += 1
        dtype = torch.float64 if attempts % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "spread", "masked"]),
                                dtype)
        p = _choice(g, [0.05, 0.1, 0.3, 0.5, 0.8])
        probs = torch.softmax(logits.double(), -1)
        if not _near_cut(probs / probs.amax(-1, keepdim=True), p):
            cases.append(Case(f"random {_row_description(logits)}, p={p}", (logits, p), S.min_p(logits, p)))
    _processor_check("min_p", fn, cases, mistakes)


def check_repetition_penalty(fn, *, seed: int = 0, n_random: int = 6) -> None:
    """repetition_penalty(logits [B, V], seen [B, V] bool, penalty) -> [B, V] (transformers' semantics)."""
    mistakes = [
        (lambda x, seen, r: torch.where(seen, x * r, x), "for a positive logit, divide by the penalty: multiplying "
                                                         "would make a seen token MORE likely"),
        (lambda x, seen, r: torch.where(seen, x / r, x), "a negative logit is multiplied by the penalty (dividing "
                                                         "it would bring it closer to 0, more likely)"),
        (lambda x, seen, r: torch.where(~seen, torch.where(x < 0, x * r, x / r), x),
         "penalize the tokens that ARE in the text (seen is True), leave the others"),
        (lambda x, seen, r: torch.where(seen, x - math.log(r), x), "transformers' penalty divides (positive logits) "
                                                                   "or multiplies (negative ones), it does not subtract"),
    ]

    def case(description, logits, seen, penalty, hint=""):
        return Case(description, (logits, seen, penalty), S.repetition_penalty(logits, seen, penalty), hint)

    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    cases = [case("positive seen logits are divided, negative multiplied", x, seen, 2.0),
             case("penalty < 1 encourages repeats", x, seen, 0.5),
             case("nothing seen: nothing changes", x, torch.zeros_like(seen), 1.5),
             case("two rows with different texts", torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]]),
                  torch.tensor([[True, False, False], [False, True, True]]), 1.3)]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        dtype = torch.float64 if i % 2 else torch.float32
        logits = _random_logits(g, _randint(g, 2, 4), _randint(g, 3, 41) | 1, _choice(g, ["ties", "spread", "masked"]),
                                dtype)
        logits -= logits.masked_fill(logits.isinf(), 0).mean() if i % 3 == 0 else 0  # values on both sides of 0
        seen = torch.rand(logits.shape, generator=g) < 0.4
        penalty = _choice(g, [1.2, 1.5, 3.0, 0.8])
        cases.append(case(f"random {_row_description(logits)}, penalty={penalty}", logits, seen, penalty))
    _processor_check("repetition_penalty", fn, cases, mistakes)


# ----------------------------------------------------------------------------------------------
# Samplers: many seeded draws, frequencies against the expected distribution


def _chi2_limit(df: int, z: float = 4.75) -> float:
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
            return (f"row {row}: token {token} was drawn {int(counts[token])} times in {N} draws, but its "
                    f"probability is 0 (its logit is -inf)")
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
        if chi2 > _chi2_limit(df):
            worst = int(((counts / N - p).abs()).argmax())
            tv = 0.5 * float((counts / N - p).abs().sum())
            return (f"row {row}: the frequencies of {N} draws do not follow the probabilities (chi-square {chi2:.0f}, "
                    f"a correct sampler stays below {_chi2_limit(df):.0f}; total variation distance {tv:.3f}); "
                    f"e.g. token {worst}: probability {float(p[worst]):.3f}, drawn {float(counts[worst]) / N:.3f} "
                    f"of the time")
    return None


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


def _same_generator_same_tokens(name: str, fn, make_args: Callable[[torch.Generator], tuple], forbid) -> None:
    """The learner's sampler must draw from the generator it is given: equal seeds, equal tokens;
    different seeds, different tokens."""
    from .core import call_learner

    def draw(seed):
        return call_learner(name, fn, make_args(torch.Generator().manual_seed(seed)), forbid=forbid, seconds=5.0,
                            may_modify=True)

    first, again, other = draw(7), draw(7), draw(8)
    if isinstance(first, Tensor) and isinstance(again, Tensor) and not torch.equal(first, again):
        raise CheckFailed(f"✗ {name}: two calls with generators seeded alike (7) drew different tokens.\n"
                          f"  hint: draw with the generator you are given: torch.multinomial(probs, 1, "
                          f"generator=generator) — not the global random state")
    if isinstance(first, Tensor) and isinstance(other, Tensor) and torch.equal(first, other):
        raise CheckFailed(f"✗ {name}: generators seeded 7 and 8 drew exactly the same tokens.\n"
                          f"  hint: draw with the generator you are given, and do not seed anything yourself")


def _many(logits: Tensor, n: int) -> Tensor:
    return logits.repeat(n, 1)  # [n·B, V]: row i is logits[i % B]


def _seen_for(logits: Tensor, g: torch.Generator) -> Tensor:
    return torch.rand(logits.shape, generator=g) < 0.3


def check_sample(fn, *, seed: int = 0, n_random: int = 3, n_draws: int = 3000) -> None:
    """sample(logits [B, V], generator) -> token ids [B] long, drawn from softmax(logits)."""
    base = [("probabilities .5 .3 .2", torch.tensor([[0.5, 0.3, 0.2]]).log(), ""),
            ("a removed token (-inf) is never drawn", torch.tensor([[1.0, -INF, 0.0, 2.0, -INF]]),
             "exp(-inf) = 0: softmax gives removed tokens probability 0"),
            ("three rows, each its own distribution", torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-5.0, 1.0, 1.5]]),
             "draw one token per row, from that row's probabilities"),
            ("large logits", torch.tensor([[1000.0, 999.0, 998.5]]), "softmax must subtract the max"),
            ("float64 logits", torch.tensor([[0.3, -0.4, 1.1, 0.0]], dtype=torch.float64), "")]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        logits = _random_logits(g, _randint(g, 1, 3), _randint(g, 3, 15) | 1, _choice(g, ["ties", "masked"]),
                                torch.float64 if i % 2 else torch.float32)
        base.append((f"random {_row_description(logits)}", logits, ""))
    cases = [Case(f"{what}, {n_draws} draws per row", (_many(logits, n_draws), torch.Generator().manual_seed(seed + i)),
                  torch.softmax(logits.double(), -1), hint)
             for i, (what, logits, hint) in enumerate(base)]

    def show(args):
        logits = args[0]
        B = logits.shape[0] // n_draws
        return f"sample(logits [{n_draws} × each of these {B} rows: {short(logits[:B], 160)}], generator)"

    def hint(got, args):
        return "draw from the probabilities softmax(logits), with torch.multinomial(probs, 1, generator=generator)"

    run_check("sample", fn, cases, judge=_draws_judge(n_draws, hint), forbid=FORBID, show_call=show,
              may_modify=[1], seconds=5.0, total_seconds=20.0)
    _same_generator_same_tokens("sample", fn, lambda gen: (_many(torch.zeros(1, 50), 50), gen), FORBID)


def check_next_token(fn, *, seed: int = 0, n_random: int = 3, n_draws: int = 3000) -> None:
    """next_token(logits [B, V], settings, seen=None, generator=None) -> [B] long, as the engine's."""
    fn = unwritten_helper(fn)
    Settings = S.SamplingSettings
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    seen = torch.tensor([[True, False, False, False, False]])
    greedy = [
        ("greedy (temperature 0) is the argmax", torch.tensor([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]]), Settings(), None,
         "temperature 0 means greedy: the argmax of each row"),
        ("greedy with top-k, top-p and min-p set: they do not change the argmax", x,
         Settings(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3), None, ""),
        ("greedy applies the repetition penalty first", torch.tensor([[3.0, 2.9, -1.0]]),
         Settings(repetition_penalty=1.5), torch.tensor([[True, False, False]]),
         "the repetition penalty applies to greedy decoding too: token 0 (seen) drops from 3 to 2"),
        ("greedy, ties: the lowest id", torch.tensor([[1.0, 4.0, 4.0]], dtype=torch.float64), Settings(), None, ""),
    ]
    sampled = [
        ("temperature 0.5 before top-p 0.8", x, Settings(temperature=0.5, top_p=0.8), None,
         "the order is repetition penalty, temperature, top-k, top-p, min-p: at temperature 0.5 the most likely "
         "token alone has more than 0.8"),
        ("temperature 2 before min-p 0.3", x, Settings(temperature=2.0, min_p=0.3), None,
         "temperature first: at temperature 2 the distribution is flatter, and min-p keeps more tokens"),
        ("top-k 3 before top-p 0.75", probs.log(), Settings(temperature=1.0, top_k=3, top_p=0.75), None,
         "top-k first, then top-p on what top-k kept (softmax again: the 3 kept probabilities add up to 1)"),
        ("the repetition penalty before top-k 2", torch.tensor([[2.0, 1.5, 1.0, -1.0, -3.0]]),
         Settings(temperature=1.0, top_k=2, repetition_penalty=3.0), seen,
         "the repetition penalty comes first: token 0 (seen) drops from 2 to 0.67 and leaves the top 2"),
        ("temperature 1.5, all processors, two rows", torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -4.0],
                                                                    [0.0, 0.0, 1.0, -1.0, -INF, 3.0, 2.0]]),
         Settings(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
         torch.tensor([[False, True, False, False, True, False, False], [True, False, True, False, False, False, False]]),
         ""),
        ("temperature 1, nothing else: softmax(logits)", torch.tensor([[0.5, -0.5, 1.5]], dtype=torch.float64),
         Settings(temperature=1.0), None, "draw from softmax(logits), with the generator you are given"),
    ]
    g = torch.Generator().manual_seed(seed)
    attempts = 0
    while len(sampled) < 6 + n_random and attempts < 50:
        attempts += 1
        logits = _random_logits(g, _randint(g, 1, 3), _randint(g, 5, 15) | 1, _choice(g, ["ties", "spread"]),
                                torch.float64 if attempts % 2 else torch.float32)
        settings = Settings(temperature=_choice(g, [0.6, 1.0, 1.7]), top_k=_choice(g, [0, 2, 4]),
                            top_p=_choice(g, [1.0, 0.6, 0.9]), min_p=_choice(g, [0.0, 0.1]),
                            repetition_penalty=_choice(g, [1.0, 1.4]))
        seen_rows = _seen_for(logits, g)

        penalized = S.repetition_penalty(logits, seen_rows, settings.repetition_penalty)
        filters = dataclasses.replace(settings, repetition_penalty=1.0)
        if _unambiguous(lambda z: S.process_logits(z, filters), penalized):
            sampled.append((f"random {_row_description(logits)}, {settings}", logits, settings, seen_rows, ""))

    def expected_probs(logits, settings, seen_rows):
        return torch.softmax(S.process_logits(logits.double(), settings, seen_rows), -1)

    cases = []
    for what, logits, settings, seen_rows, hint in greedy:
        cases.append(Case(what, (logits, settings, seen_rows, torch.Generator().manual_seed(seed)),
                          S.next_token(logits, settings, seen_rows), hint))
    for i, (what, logits, settings, seen_rows, hint) in enumerate(sampled):
        many_seen = None if seen_rows is None else _many(seen_rows, n_draws)
        cases.append(Case(f"{what}, {n_draws} draws per row",
                          (_many(logits, n_draws), settings, many_seen, torch.Generator().manual_seed(seed + i)),
                          expected_probs(logits, settings, seen_rows), hint))

    def show(args):
        logits, settings, seen_rows, _ = args
        if logits.shape[0] < n_draws:
            return f"next_token({short(logits, 160)}, {settings}, seen={short(seen_rows, 80)}, generator)"
        B = logits.shape[0] // n_draws
        seen_rows = None if seen_rows is None else seen_rows[:B]
        return (f"next_token(logits [{n_draws} × each of these {B} rows: {short(logits[:B], 160)}], {settings}, "
                f"seen={short(seen_rows, 80)}, generator)")

    draws = _draws_judge(n_draws)

    def judge(case: Case, got: Any) -> Verdict:
        if case.expected.dtype == torch.long:  # greedy: the exact tokens
            problem = tensor_problem(got, case.expected)
            return None if problem is None else (problem, "")
        return draws(case, got)

    run_check("next_token", fn, cases, judge=judge, forbid=FORBID, show_call=show, may_modify=[3], seconds=5.0, total_seconds=20.0)
    _same_generator_same_tokens("next_token", fn, lambda gen: (_many(torch.zeros(1, 50), 50),
                                                               Settings(temperature=1.0), None, gen), FORBID)


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
    return ids[0, len(prompt):].tolist()


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


@one_thread
def check_beam_search(fn, *, seed: int = 0, n_random: int = 1) -> None:
    """beam_search(model, prompt_ids, num_beams, max_new_tokens, length_penalty=1.0, eos_token_id=None)
    -> the new token ids of the best beam, as the engine's (and transformers') beam search."""
    fn = unwritten_helper(fn)
    models = {s: tiny_model(s) for s in (seed, seed + 1)}
    g = torch.Generator().manual_seed(seed)

    def case(description, model_seed, prompt, num_beams, new, length_penalty, eos, hint=""):
        model = models[model_seed]
        expected = engine_beam_search(model, prompt, num_beams=num_beams, max_new_tokens=new,
                                      length_penalty=length_penalty, eos_token_id=eos)
        return Case(description, (model, prompt, num_beams, new, length_penalty, eos), expected, hint)

    prompt = [5, 17, 42]
    eos = _greedy_tokens(models[seed], prompt, 3)[2]  # a token that greedy decoding meets on its 3rd step
    cases = [
        case("one beam is greedy decoding", seed, prompt, 1, 6, 1.0, None,
             "with num_beams=1 beam search must give greedy decoding's tokens"),
        case("3 beams, no EOS", seed, [1, 2, 3], 3, 8, 1.0, None,
             "at the first step all beams are the same prompt: expand only the first (the others start at -inf), "
             "or they pick the same tokens"),
        case(f"3 beams, EOS = {eos} (met on the way)", seed, prompt, 3, 10, 1.0, eos,
             "a beam that ends in EOS is finished; keep searching until num_beams beams are finished and no live "
             "beam can beat the worst of them"),
        case(f"4 beams, EOS = {eos}, length_penalty 2.0", seed, prompt, 4, 10, 2.0, eos,
             "a finished beam's score is its sum of log-probabilities / (number of new tokens) ** length_penalty"),
        case(f"2 beams, EOS = {eos}, length_penalty 0.5", seed, prompt, 2, 10, 0.5, eos,
             "a finished beam's score is its sum of log-probabilities / (number of new tokens) ** length_penalty"),
    ]
    doubles = {s: tiny_model(s).double() for s in models}
    attempts = 0
    while len(cases) < 5 + n_random and attempts < 4 * (n_random + 1):
        attempts += 1
        model_seed = seed + attempts % 2
        prompt = torch.randint(0, 97, (_randint(g, 1, 6),), generator=g).tolist()
        greedy = _greedy_tokens(models[model_seed], prompt, 4)
        eos = _choice(g, [None, greedy[1], greedy[3]])
        settings = (_randint(g, 2, 5), _randint(g, 4, 12), _choice(g, [0.5, 1.0, 1.5, -0.5]), eos)
        new = case(f"random: model {model_seed}, prompt {prompt}, EOS {eos}", model_seed, prompt, *settings)
        if new.expected == engine_beam_search(doubles[model_seed], prompt, num_beams=settings[0],
                                              max_new_tokens=settings[1], length_penalty=settings[2],
                                              eos_token_id=eos):
            cases.append(new)  # no near-tie that float32 rounding (cached or not) could flip

    def show(args):
        model, prompt, num_beams, new, lp, eos = args
        return (f"beam_search(model, {prompt}, num_beams={num_beams}, max_new_tokens={new}, length_penalty={lp}, "
                f"eos_token_id={eos})")

    def compare(got, expected):
        if not isinstance(got, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
            return f"expected a list of token ids (Python ints), got {short(got, 80)}"
        if got == expected:
            return None
        same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        return (f"a different sequence ({len(got)} token{'s' * (len(got) != 1)} instead of {len(expected)}; "
                f"the first difference at position {same})")

    run_check("beam_search", fn, cases, compare=compare, forbid=FORBID, show_call=show, may_modify=[0], seconds=10.0,
              total_seconds=30.0)


# ----------------------------------------------------------------------------------------------
# The generation loop


class ScriptedModel:
    """Stands in for GPT-2: whatever the text, its next token is the script's next one (a logit 30 above
    the rest), so a check knows exactly which tokens a correct loop produces."""

    def __init__(self, prompt_length: int, script: list[int]):
        self.prompt_length, self.script = prompt_length, script
        self.config = GPT2Config(n_layer=1, n_head=1, n_embd=8)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def __call__(self, input_ids, *args, **kwargs) -> Tensor:
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        B, T = ids.shape
        step = min(max(T - self.prompt_length, 0), len(self.script) - 1)
        logits = torch.zeros(B, T, self.config.vocab_size)
        logits[:, -1, self.script[step]] = 30.0
        return logits

    def __repr__(self) -> str:
        return "model"


@one_thread
def check_stream_text(fn, *, seed: int = 0, n_random: int = 0) -> None:
    """stream_text(model, tokenizer, prompt, settings, max_new_tokens, eos_token_id=EOT_ID, stop=(), seed=0)
    yields text pieces; together they are the engine's `generate_text` with the same settings."""
    tok = get_tokenizer()
    Settings = S.SamplingSettings
    greedy = Settings()

    def run(*args):  # the learner's generator, run to the end: the list of pieces
        try:
            return list(fn(*args))
        except NotImplementedError as err:
            stub = traceback.extract_tb(err.__traceback__)[-1].name
            if stub != getattr(fn, "__name__", stub):
                raise RuntimeError(f"it calls {stub}, which is not written yet: write that exercise first (its check "
                                   "must pass)").with_traceback(err.__traceback__) from None
            raise

    def scripted(description, prompt, text_tokens, max_new, eos=EOT_ID, stop=(), hint=""):
        prompt_ids = tok.encode(prompt)
        model = ScriptedModel(len(prompt_ids), text_tokens)
        tokens = (text_tokens + text_tokens[-1:] * max_new)[:max_new]  # the model repeats its last token
        expected = "".join(stop_at(decoded(iter(tokens), tok, eos), stop))
        return Case(description, (model, tok, prompt, greedy, max_new, eos, tuple(stop), seed), expected, hint)

    hello = tok.encode(" Hello world, and good night.")
    llama = tok.encode(" I ❤ 🦙 llamas")
    cases = [
        scripted("stop after max_new_tokens = 3", "Say:", hello, 3, hint="exactly max_new_tokens new tokens"),
        scripted("EOS ends the text (not shown)", "Say:", hello[:4] + [EOT_ID] + hello[4:], 20,
                 hint="stop as soon as the new token is EOS, before decoding it"),
        scripted("EOS as the very first token: no text", "Say:", [EOT_ID] + hello, 20),
        scripted("eos_token_id=None never stops early", "Say:", hello[:3] + [EOT_ID] + hello[3:], 6, eos=None),
        scripted("an emoji split over several tokens is yielded whole", "Love:", llama, 20,
                 hint="push every token through a StreamDecoder: it holds back an unfinished UTF-8 character"),
        scripted("a stop string inside one token", "Say:", hello, 20, stop=("world",),
                 hint="yield the text before the stop string, then stop"),
        scripted("a stop string spread over two tokens", "Say:", hello, 20, stop=("lo wor",),
                 hint="the stop string can span tokens: look for it in all the text so far (holding back text "
                      "that could be the start of a stop string)"),
        scripted("two stop strings: the first one in the text wins", "Say:", hello, 20, stop=("night", ", and")),
        scripted("a stop string that never comes", "Say:", hello, 8, stop=("xyz",)),
    ]
    model = tiny_model(seed + 10, vocab_size=1000)  # GPT-2's first 1000 tokens: short, common pieces of text
    for i in range(n_random + 1):
        settings = [Settings(), Settings(temperature=0.8, top_k=20), Settings(temperature=1.0, top_p=0.9,
                                                                              repetition_penalty=1.3)][i % 3]
        prompt, eos, new = "The", [None, 13, 11][i % 3], 10 + 2 * i
        expected = generate_text(model, tok, prompt, max_new_tokens=new, eos_token_id=eos, seed=seed + i,
                                 **{f: getattr(settings, f) for f in ("temperature", "top_k", "top_p", "min_p",
                                                                       "repetition_penalty")})
        cases.append(Case(f"a tiny random GPT-2, {settings}, seed {seed + i}",
                          (model, tok, prompt, settings, new, eos, (), seed + i), expected,
                          "use torch.Generator().manual_seed(seed) once, and your next_token on the last position's "
                          "logits, with seen (the prompt's and the new tokens) for the repetition penalty"))

    def show(args):
        model, _, prompt, settings, new, eos, stop, s = args
        return (f"stream_text({model!r}, tokenizer, {prompt!r}, {settings}, max_new_tokens={new}, "
                f"eos_token_id={eos}, stop={stop}, seed={s})")

    def compare(got, expected):
        if not all(isinstance(piece, str) for piece in got):
            return f"every piece must be a str, got {short(got, 100)}"
        text = "".join(got)
        if text != expected:
            if "\ufffd" in text and "\ufffd" not in expected:
                return f"the text differs: got a '\\ufffd' (a piece of an unfinished UTF-8 character) in {text!r}"
            return f"the text differs: expected {expected!r}, got {text!r}"
        if len(expected) > 12 and len([p for p in got if p]) < 2:
            return "the text is right, but it came in one piece: yield each piece as soon as it is decoded (stream it)"
        return None

    run_check("stream_text", run, cases, compare=compare, forbid=FORBID, show_call=show, may_modify=[0, 1],
              seconds=10.0,
              total_seconds=30.0, timeout_hint="the loop must end after max_new_tokens tokens, at EOS or at a stop "
                                               "string")
