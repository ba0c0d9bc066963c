"""Checks for chapter 08, speculative decoding: the acceptance rule, the verify step, the prompt-lookup
draft, the expected tokens per round and speed-up (`expected_tokens`, `expected_speedup`), the best number of
proposals (`best_k`, on the learner's own speed-up), and one greedy draft-verify round with cache rollback.

The two samplers (`accept_token`, `verify`) are checked as samplers: on toy vocabularies with known
p and q, many seeded calls, and a chi-square test of what comes back — the accepted / rejected
outcomes and the tokens — against the distribution the rule must produce (about 1 in a million for a
correct rule to fail a case); a wrong rule whose own distribution fits the counts is named. The
deterministic corners (p(x) >= q(x): always accepted; p(x) = 0: never; one-hot p and q: greedy) come
first. `speculative_round` runs in the check's own loop (as the engine's `speculative_steps` does) on
tiny random models and on the bundled pair: every round must return a prefix of plain greedy decoding's
continuation, leave both caches at the right length, run the target once, and keep exactly the proposals
that the draft's own greedy continuation gets right; then the engine runs with it installed.

The three formulas are compared with exact values (Fractions of the very numbers given: a float is a fraction
too), floats to a relative 1e-9; a value that matches a plausible wrong formula's (one term short, the accepted
count without the target's token, the untruncated series, a cost without the target's pass or with k + 1 draft
steps...) is named. `best_k` rests on the learner's own `expected_speedup` (the engine's formulas are refused):
its first case is a sweep over the corners, exact ties and the points where the wrong formulas part, and the
mistake that gives every answer of the sweep is named.

    >>> def expected_tokens(alpha, k):
    ...     return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    >>> def best_k(alpha, c, max_k):
    ...     return max(range(1, max_k + 1), key=lambda k: expected_tokens(alpha, k) / (k * c + 1))
    >>> check_expected_tokens(expected_tokens)
    ✓ expected_tokens — 24 cases
    >>> check_best_k(best_k)
    ✓ best_k — 39 cases
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import random
import sys
from fractions import Fraction
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guarded
from llmcourse.engine.generate import generate
from llmcourse.engine.model import GPT2
from llmcourse.engine.slots import PartError
from llmcourse.engine.speculative import AUTO_MAX_K, PROMPT_LOOKUP, Speculation, SpeculationStats
from llmcourse.engine.speculative import accept_token as engine_accept_token
from llmcourse.engine.speculative import prompt_lookup_draft as engine_prompt_lookup_draft
from llmcourse.engine.speculative import verify as engine_verify
from llmcourse.engine.tokenizer import get_tokenizer

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, _where, call_learner, failure, later, one_hint, run_check, unwritten_helper
from .harness.forbid import Forbidden, ForbiddenCall
from .harness.inputs import change_verdict, changed_input, named_like, watched
from .harness.randomness import generator_contract
from .harness.show import short
from .kv_cache import decisive_model, one_thread
from .sampling import _chi2_limit

NO_ENGINE = Forbidden(
    "llmcourse.engine.speculative",
    "llmcourse.engine.speculative is the engine's speculative decoding, what yours is compared with: write your own",
)


def _is_id(x: Any) -> bool:
    """An integer of any type (Python's, numpy's), not a bool: what the engine's guards take as a token id."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _dist(values, dtype=torch.float32) -> Tensor:
    t = torch.as_tensor(values, dtype=torch.float64)
    return (t / t.sum()).to(dtype)


def _fmt(p: Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.3g}" for v in p) + "]"


def chi2(counts: Tensor, probs: Tensor) -> tuple[float, float]:
    """(chi-square of `counts` against `probs`, the value a correct sampler exceeds with probability ~1e-6);
    outcomes expected fewer than 5 times are pooled. An outcome of probability 0 that occurs gives inf."""
    counts, probs = counts.double(), probs.double()
    n = float(counts.sum())
    if bool(((probs <= 0) & (counts > 0)).any()):
        return math.inf, 0.0
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    if float(wanted[-1]) < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    df = len(wanted) - 1
    if df < 1:
        return 0.0, math.inf
    return float(((observed - wanted) ** 2 / wanted).sum()), _chi2_limit(df)


def fits(counts: Tensor, probs: Tensor) -> bool:
    value, limit = chi2(counts, probs)
    return value <= limit


# ----------------------------------------------------------------------------------------------
# Exercise 1: accept_token


def rule_outcomes(p: Tensor, q: Tensor, accept: Tensor, correction: Tensor) -> Tensor:
    """The distribution [2V] of (accepted, token) for x ~ q, accepted with probability accept[x], else the
    token drawn from `correction`: entries 0..V-1 accepted x, V..2V-1 rejected then token t."""
    p, q, accept, correction = (t.double() for t in (p, q, accept, correction))
    kept = q * accept  # [V]
    return torch.cat([kept, (1 - kept.sum()).clamp(min=0) * correction])


def residual(p: Tensor, q: Tensor) -> Tensor:
    r = (p.double() - q.double()).clamp(min=0)
    return r / r.sum() if float(r.sum()) > 0 else p.double()


def correct_outcomes(p: Tensor, q: Tensor) -> Tensor:
    ratio = torch.where(q > 0, p.double() / q.double().clamp(min=1e-300), torch.ones((), dtype=torch.float64))
    return rule_outcomes(p, q, ratio.clamp(max=1), residual(p, q))


def _accept_mistakes(p: Tensor, q: Tensor) -> list[tuple[Tensor, str]]:
    """(outcome distribution, hint) of plausible wrong rules, for naming the one a learner wrote."""
    p64, q64 = p.double(), q.double()
    ratio = torch.where(q64 > 0, p64 / q64.clamp(min=1e-300), torch.ones((), dtype=torch.float64)).clamp(max=1)
    return [
        (
            rule_outcomes(p, q, (p64 >= q64).double(), residual(p, q)),
            "you accept exactly when p(x) >= q(x), without drawing: a proposal with p(x) < q(x) must still be "
            "accepted with probability p(x)/q(x) (draw u ~ U[0, 1) and accept iff u < p(x)/q(x))",
        ),
        (
            rule_outcomes(p, q, p64, residual(p, q)),
            "you accept with probability p(x): the rule is min(1, p(x)/q(x)) — divide by q(x), the chance the "
            "draft proposed x",
        ),
        (
            rule_outcomes(p, q, 1 - ratio, residual(p, q)),
            "the comparison is inverted: accept iff u < p(x)/q(x) (or u·q(x) < p(x)), not u > p(x)/q(x)",
        ),
        (
            rule_outcomes(p, q, ratio, p64),
            "after a rejection the token must come from the residual max(0, p - q), normalised — not from p: "
            "p's tokens were already given their share by the accepted proposals",
        ),
        (
            rule_outcomes(p, q, ratio, q64),
            "after a rejection the token must come from the residual max(0, p - q), normalised — not from q",
        ),
        (
            rule_outcomes(p, q, torch.zeros_like(p64), p64),
            "you never accept: the output has the right distribution, but every proposal is wasted; accept with "
            "probability min(1, p(x)/q(x))",
        ),
        (
            rule_outcomes(p, q, inverted_ratio(p, q), residual(p, q)),
            "the ratio is upside down: accept with probability min(1, p(x)/q(x)) — the target's probability over "
            "the draft's — not min(1, q(x)/p(x)), which keeps every proposal the target finds less likely than the "
            "draft does",
        ),
    ]


def inverted_ratio(p: Tensor, q: Tensor) -> Tensor:
    """min(1, q(x)/p(x)) for each x: the acceptance probability of a rule with its ratio upside down (1 where
    p(x) = 0: q/0 is infinite)."""
    p64, q64 = p.double(), q.double()
    return torch.where(p64 > 0, q64 / p64.clamp(min=1e-300), torch.ones((), dtype=torch.float64)).clamp(max=1)


@dataclasses.dataclass
class Draws:
    """What n calls of a sampler gave: the calls' results and their tally, or the first unusable result."""

    n: int
    counts: Any = None  # accept_token: [2V] (accepted x, rejected then t); verify: see _draw_verifies
    bad: Any = None  # (the arguments, what came back) of the first result that is not (bool, token id)
    problem: str = ""
    summary: str = ""
    hint: str = ""

    def __repr__(self) -> str:
        if self.bad is not None:
            return short(self.bad[1], 120)
        return self.summary


class Wanted:
    """What a frequency case expects, in words (shown as 'expected:')."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _accept_result_problem(out: Any, V: int, x: int) -> str:
    if not (isinstance(out, tuple) and len(out) == 2):
        return f"expected a tuple (accepted, token), got {short(out, 80)}"
    accepted, token = out
    if not isinstance(accepted, bool):
        return f"`accepted` should be a Python bool, got {short(accepted, 60)}" + (
            ": bool(...) it" if isinstance(accepted, Tensor) else ""
        )
    if not _is_id(token):
        return f"the token should be an integer (a Python int), got {short(token, 60)}" + (
            ": int(...) it" if isinstance(token, Tensor) else ""
        )
    if not 0 <= token < V:
        return f"the token {token} is not an id of the vocabulary [0, {V})"
    if accepted and token != x:
        return f"accepted the proposal {x} but returned the token {token}: an accepted proposal is the token"
    return ""


def _draw_accepts(fn: Callable, p: Tensor, q: Tensor, n: int, seed: int) -> Draws:
    """n calls fn(p, q, x, generator) with x ~ q; the tally of (accepted, token)."""
    V = p.shape[-1]
    g = torch.Generator().manual_seed(seed)
    proposals = torch.multinomial(q.double(), n, replacement=True, generator=g).tolist()
    counts = torch.zeros(2 * V, dtype=torch.long)
    with torch.random.fork_rng(devices=[]):  # a rule that draws from the global generator is seeded too
        torch.manual_seed(seed)
        for x in proposals:
            out = fn(p, q, x, g)
            problem = _accept_result_problem(out, V, x)
            if problem:
                return Draws(n, bad=((p, q, x), out), problem=problem)
            counts[out[1] + (0 if out[0] else V)] += 1
    freq = (counts[:V] + counts[V:]).double() / n
    return Draws(
        n,
        counts,
        summary=f"tokens {_fmt(freq)} of the time, {float(counts[:V].sum()) / n:.0%} of the proposals accepted",
    )


def _outside_residual(p: Tensor, q: Tensor, rejected_tokens: list[int]) -> str:
    """A hint if a token returned after a rejection has no mass in the residual max(0, p - q)."""
    r = residual(p, q)
    bad = [t for t in rejected_tokens if float(r[t]) == 0]
    if not bad:
        return ""
    t = bad[0]
    if float(p[t]) > 0 and t != len(p) - 1:
        return (
            f"token {t} has max(0, p - q) = 0, so a rejection can never give it: after a rejection draw from the "
            "residual max(0, p - q), normalised — not from p (p's tokens already got their share from the "
            "accepted proposals)"
        )
    return (
        f"token {t} has max(0, p - q) = 0, so a rejection can never give it: draw from the residual "
        "normalised (torch.multinomial normalises for you; an inverse-CDF draw with u in [0, 1) must compare "
        "u · sum with the cumulative sum, or the last token takes the mass the sum lacks)"
    )


def _accept_verdict(case: Case, got: Any) -> Verdict:
    kind = case.args[0]
    if kind == "engine":
        return engine_verdict("accept_token", case, got)
    if kind == "once":
        _, p, q, x, _seed = case.args
        problem = _accept_result_problem(got, p.shape[-1], x)
        if problem:
            return problem, "return (True, x) or (False, the token drawn from the residual)"
        if got != case.expected:
            return f"expected {case.expected}, got {got}", _outside_residual(p, q, [got[1]] if not got[0] else [])
        return None
    _, p, q, n, _seed = case.args
    if got.bad is not None:
        (_, _, x), out = got.bad
        return (
            f"with the proposal x = {x}: {got.problem}",
            "return (True, x) or (False, the token drawn from the residual)",
        )
    V = p.shape[-1]
    counts = got.counts
    outside = _outside_residual(p, q, torch.nonzero(counts[V:]).flatten().tolist())
    tokens = counts[:V] + counts[V:]
    want = correct_outcomes(p, q)
    alpha = float(want[:V].sum())
    accepted = int(counts[:V].sum())
    if outside:
        problem = "after a rejection your rule returned a token that the residual max(0, p - q) gives probability 0"
    elif not fits(tokens, p.double()):
        value, limit = chi2(tokens, p.double())
        freq = tokens.double() / n
        worst = int((freq - p.double()).abs().argmax())
        problem = (
            f"the tokens returned over {n} calls are not distributed as p: token {worst} came back "
            f"{float(freq[worst]):.1%} of the time, p({worst}) = {float(p[worst]):.1%}"
            + (f" (chi-square {value:.0f}; a correct rule stays below {limit:.0f})" if math.isfinite(value) else "")
        )
        if not fits(torch.tensor([accepted, n - accepted]), torch.tensor([alpha, 1 - alpha])):
            problem += (
                f"; and {accepted / n:.1%} of the proposals were accepted, where min(1, p(x)/q(x)) accepts "
                f"Σ min(p, q) = {alpha:.1%} of them"
            )
    elif not fits(counts, want):
        problem = (
            f"the tokens follow p, but the rule accepted {accepted / n:.1%} of the proposals; accepting with "
            f"probability min(1, p(x)/q(x)) keeps Σ min(p, q) = {alpha:.1%} of them"
        )
    else:
        return None
    hint = next((h for dist, h in _accept_mistakes(p, q) if fits(counts, dist)), outside)
    return problem, hint or (
        "accept x with probability min(1, p(x)/q(x)); after a rejection draw the token from "
        "max(0, p - q) divided by its sum (torch.multinomial normalises for you; an inverse-CDF "
        "draw with u must scale u by the sum)"
    )


def _spike(V: int, mass: dict) -> Tensor:
    """A distribution over V tokens with the given mass on a few of them."""
    p = torch.zeros(V, dtype=torch.float64)
    for token, m in mass.items():
        p[token] = m
    return (p / p.sum()).float()


def accept_cases(seed: int, n_random: int, n_draws: int) -> list[Case]:
    """check_accept_token's cases: the frequency tests (args ("many", p, q, n_draws, seed)), then the
    deterministic corners (args ("once", p, q, x, seed))."""
    g = torch.Generator().manual_seed(seed)

    def once(description, p, q, x, hint=""):
        p, q = _dist(p), _dist(q)
        return Case(
            description,
            ("once", p, q, x, seed),
            later(engine_accept_token, p, q, x, torch.Generator().manual_seed(0)),
            hint,
        )

    def many(description, p, q, hint="", dtype=torch.float32):
        p, q = _dist(p, dtype), _dist(q, dtype)
        alpha = float(torch.minimum(p, q).sum())
        return Case(
            description,
            ("many", p, q, n_draws, seed + len(cases)),
            Wanted(f"tokens distributed as p = {_fmt(p)}, Σ min(p, q) = {alpha:.0%} of the proposals accepted"),
            hint,
        )

    cases: list[Case] = []
    fixed = [
        once(
            "p(x) > q(x): always accepted",
            [0.2, 0.5, 0.3],
            [0.4, 0.2, 0.4],
            1,
            "p(x) >= q(x) means min(1, p/q) = 1: accept, whatever u is",
        ),
        once("p(x) = q(x): always accepted", [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], 3),
        once(
            "p(x) = 0: never accepted; the residual max(0, p - q) = [.5, 0, 0] gives token 0",
            [0.5, 0.5, 0],
            [0, 0.5, 0.5],
            2,
            "p(x) = 0: accept with probability 0; the residual is max(0, p - q)",
        ),
        once(
            "p one-hot on token 2, x = 1: rejected, the residual is all on token 2",
            [0, 0, 1, 0],
            [0.25, 0.25, 0.25, 0.25],
            1,
        ),
        once(
            "GPT-2's vocabulary (50257 tokens): p(x) = 0 for x = 300, the residual is all on token 50256",
            _spike(50257, {50256: 1.0}),
            _spike(50257, {300: 0.7, 50256: 0.3}),
            300,
            "token ids go up to 50256: keep them as Python ints (no uint8, no fixed-size table)",
        ),
        once(
            "the proposal is token 0 (GPT-2's '!'; EOS in some vocabularies), p(0) >= q(0): accepted",
            [0.6, 0.2, 0.2],
            [0.5, 0.25, 0.25],
            0,
            "token 0 is a token like any other: return (True, 0)",
        ),
    ]
    cases += [
        many("p and q overlap", [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]),
        many("q puts mass where p has none, p where q has none", [0.5, 0.5, 0], [0, 0.5, 0.5]),
        many("p == q: every proposal is accepted", [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),
        many("p one-hot", [0, 0, 1, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2]),
        many("q one-hot: the draft always proposes token 1", [0.25, 0.25, 0.25, 0.25], [0, 1, 0, 0]),
        many("p on tokens q never proposes", [0.1, 0.1, 0.1, 0.1, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25, 0, 0]),
        many("V = 8, float64", [1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1], dtype=torch.float64),
        many(
            "V = 300: the mass on tokens 0 and 256 to 299",
            _spike(300, {0: 0.2, 256: 0.3, 280: 0.2, 299: 0.3}).tolist(),
            _spike(300, {0: 0.4, 256: 0.1, 270: 0.2, 299: 0.3}).tolist(),
        ),
    ]
    for i in range(n_random):
        V = int(torch.randint(3, 9, (), generator=g))
        p, q = torch.rand(V, generator=g) ** 3, torch.rand(V, generator=g) ** 3  # peaked
        p[torch.rand(V, generator=g) < 0.25] = 0
        q[torch.rand(V, generator=g) < 0.25] = 0
        p[0], q[-1] = p[0] + 0.1, q[-1] + 0.1  # never all zero
        cases.append(many(f"random #{i}, V = {V}", p.tolist(), q.tolist()))
    return cases + fixed


def check_accept_token(fn, *, seed: int = 0, n_random: int = 2, n_draws: int = 1000) -> None:
    """accept_token(p, q, draft_token, generator=None) -> (accepted: bool, token: int): accept a proposal x ~ q
    with probability min(1, p(x)/q(x)), else a token drawn from max(0, p - q) normalised; checked by its
    outcomes' frequencies over many calls."""

    # Randomness as a contract, on two proposals whose outcomes are random for the rule and for the rule with its
    # ratio upside down alike (so that the frequency cases, not this contract, name that mistake): x = 0 kept with
    # probability p/q = 1/4 (upside down: always), else one of 3 tokens; x = 1 always kept (upside down: kept with
    # probability q/p = 1/4, else one of those 3 tokens). 4 outcomes of 1/4 each: 8 calls agree by chance with
    # probability 4 · 4^-8 = 6e-5.
    p, q = _dist([0.1, 0.2, 0.2, 0.2, 0.3]), _dist([0.4, 0.05, 0.05, 0.05, 0.45])
    generator_contract(
        "accept_token",
        lambda g: tuple(
            call_learner("accept_token", fn, (p, q, x, g), forbid=[NO_ENGINE], may_modify=(3,)) for x in (0, 1)
        ),
        what=f"accept_token(p={_fmt(p)}, q={_fmt(q)}, draft_token, generator) for draft_token 0, then 1",
    )

    def run(kind, *args):
        if kind == "engine":
            return _in_engine("accept_token", fn, *args)
        if kind == "once":
            p, q, x, s = args
            return fn(p, q, x, torch.Generator().manual_seed(s))
        p, q, n, s = args
        return _draw_accepts(fn, p, q, n, s)

    def show(args):
        if args[0] == "engine":
            return show_engine("accept_token", args[1])
        if args[0] == "once":
            _, p, q, x, s = args
            if p.shape[-1] > 12:
                nz = lambda t: "{" + ", ".join(f"{i}: {float(t[i]):.3g}" for i in torch.nonzero(t).flatten()) + "}"  # noqa
                return f"accept_token(p={nz(p)} (else 0, V = {p.shape[-1]}), q={nz(q)}, draft_token={x}, generator)"
            return f"accept_token(p={_fmt(p)}, q={_fmt(q)}, draft_token={x}, generator)"
        _, p, q, n, _ = args
        if p.shape[-1] > 12:
            nz = lambda t: "{" + ", ".join(f"{i}: {float(t[i]):.3g}" for i in torch.nonzero(t).flatten()) + "}"  # noqa
            return (
                f"{n} calls accept_token(p, q, x, generator), x drawn from q each time; V = {p.shape[-1]}, "
                f"p = {nz(p)}, q = {nz(q)} (else 0)"
            )
        return f"{n} calls accept_token(p, q, x, generator), x drawn from q each time; p = {_fmt(p)}, q = {_fmt(q)}" + (
            " (float64)" if p.dtype == torch.float64 else ""
        )

    cases = accept_cases(seed, n_random, n_draws) + engine_cases("accept_token", ("draft", "lookup-sampled"))
    run_check(
        "accept_token",
        named_like(run, fn),
        cases,
        judge=_accept_verdict,
        forbid=[NO_ENGINE],
        show_call=show,
        seconds=10,
        total_seconds=30,
        error_hints={
            "invalid multinomial distribution": "the residual max(0, p - q) was all zero: that happens "
            "only when p == q, where min(1, p/q) = 1 accepts every "
            "proposal — check your acceptance test"
        },
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: verify


def one_hot(ids: list[int], V: int) -> Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), V).float().reshape(len(ids), V)


def _verify_result_problem(out: Any, k: int, V: int) -> str:
    if not (isinstance(out, tuple) and len(out) == 2):
        return f"expected a tuple (num_accepted, next_token), got {short(out, 80)}"
    n, token = out
    if not _is_id(n):
        return f"num_accepted should be an integer (a Python int), got {short(n, 60)}"
    if not 0 <= n <= k:
        return f"num_accepted = {n}, outside [0, k = {k}]"
    if not _is_id(token):
        return f"next_token should be an integer (a Python int), got {short(token, 60)}" + (
            ": int(...) it" if isinstance(token, Tensor) else ""
        )
    if not 0 <= token < V:
        return f"next_token {token} is not an id of the vocabulary [0, {V})"
    return ""


def _greedy_hint(target: list[int], drafted: list[int], got: tuple) -> str:
    """What a wrong answer on one-hot p (target's argmax `target` [k+1]) and q (`drafted` [k]) points to."""
    k = len(drafted)
    n = next((i for i, (d, t) in enumerate(zip(drafted, target)) if d != t), k)
    got_n, token = got
    matches = sum(d == t for d, t in zip(drafted, target))
    if got_n == matches > n + 1:
        return "stop at the first rejection: the proposals after it were drafted after a wrong token and mean nothing"
    if got_n == n + 1 and n < k:
        return (
            f"proposal {n} ({drafted[n]}) is not the target's token ({target[n]}): it is rejected, so {n} are "
            "accepted — do not count the rejected one"
        )
    if got_n == k > n and token == target[k]:
        return (
            f"every proposal was kept, but the target gives proposal {n} ({drafted[n]}) probability p = 0, so "
            "min(1, p(x)/q(x)) = 0 rejects it: the ratio is upside down — min(1, q(x)/p(x)) is 1 there"
        )
    if got_n > n:
        return "stop at the first rejection: the proposals after it were drafted after a wrong token and mean nothing"
    if n == k and got_n == k and token != target[k]:
        return (
            f"all {k} proposals are accepted: the next token is a bonus drawn from p[k] (row {k}, the target's "
            f"distribution after all the proposals), here {target[k]}"
            + (" — not a draft token" if token in drafted else "")
        )
    if got_n == n and token != target[n]:
        return (
            f"at the rejection the token comes from the residual max(0, p[{n}] - q[{n}]), which is the target's "
            f"token {target[n]} here"
        )
    return ""


def _verify_verdict(case: Case, got: Any) -> Verdict:
    kind = case.args[0]
    if kind == "engine":
        return engine_verdict("verify", case, got)
    if kind == "once":
        _, p, q, drafted, _ = case.args
        problem = _verify_result_problem(got, len(drafted), p.shape[-1])
        if problem:
            return problem, "return (how many proposals were accepted, the token that comes next)"
        if got == case.expected:
            return None
        return f"expected {case.expected}, got {got}", _greedy_hint(p.argmax(-1).tolist(), drafted, got)
    _, p, q, n, _ = case.args
    if got.bad is not None:
        return got.problem, got.hint or "return (how many proposals were accepted, the token that comes next)"
    first, second, bonus, counts = got.counts
    alphas = [float(torch.minimum(p[i].double(), q[i].double()).sum()) for i in range(2)]
    want_counts = torch.tensor([1 - alphas[0], alphas[0] * (1 - alphas[1]), alphas[0] * alphas[1]])
    hint = case.hint or (  # the case's own hint names what it was built to catch
        "verify calls your accept_token at each position until the first rejection; if all k are accepted, the "
        "bonus token is drawn from p[k]"
    )
    checks = [
        (first, p[0], "the first new token (the first proposal if accepted, else the residual's token)"),
        (second, p[1], "the second new token, after an accepted first proposal"),
        (bonus, p[2], "the bonus token, when both proposals are accepted"),
    ]

    def counts_problem() -> Verdict:
        if fits(counts, want_counts):
            return None
        freq = counts.double() / n
        return (f"num_accepted was 0, 1, 2 in {_fmt(freq)} of the calls; the rule gives {_fmt(want_counts)}", hint)

    for index, (tally, probs, what) in enumerate(checks):
        if index == 1 and counts_problem():  # after the first token: how many were kept says more than the tokens
            return counts_problem()
        if int(tally.sum()) and not fits(tally, probs.double()):
            freq = tally.double() / tally.sum()
            worst = int((freq - probs.double()).abs().argmax())
            return (
                f"{what} is not distributed as the target's p: token {worst} came {float(freq[worst]):.1%} of "
                f"the time over {int(tally.sum())} calls, p = {float(probs[worst]):.1%}",
                hint,
            )
    return counts_problem()


def _draw_verifies(fn: Callable, p: Tensor, q: Tensor, n: int, seed: int) -> Draws:
    """n calls fn(p, q, [x1, x2], generator), x_i ~ q[i]; tallies of the first and second new token, the bonus
    token, and num_accepted."""
    V = p.shape[-1]
    g = torch.Generator().manual_seed(seed)
    proposals = torch.stack([torch.multinomial(q[i].double(), n, replacement=True, generator=g) for i in range(2)], 1)
    first, second, bonus = (torch.zeros(V, dtype=torch.long) for _ in range(3))
    accepted = torch.zeros(3, dtype=torch.long)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for x1, x2 in proposals.tolist():  # p and q are the case's arguments, which run_check watches
            drafted = [x1, x2]
            out = fn(p, q, drafted, g)
            if drafted != [x1, x2]:
                problem, hint = change_verdict(watched(fn, ()).name(2), [x1, x2], drafted)
                return Draws(n, bad=((p, q, [x1, x2]), out), problem=problem, hint=hint)
            problem = _verify_result_problem(out, 2, V)
            if problem:
                return Draws(n, bad=((p, q, [x1, x2]), out), problem=f"with the proposals [{x1}, {x2}]: {problem}")
            k, token = out
            accepted[k] += 1
            first[x1 if k >= 1 else token] += 1
            if k >= 1:
                second[x2 if k == 2 else token] += 1
            if k == 2:
                bonus[token] += 1
    return Draws(
        n,
        (first, second, bonus, accepted),
        summary=f"first new token {_fmt(first.double() / n)} of the time; 0, 1, 2 accepted in "
        f"{_fmt(accepted.double() / n)} of the calls",
    )


def check_verify(fn, *, seed: int = 0, n_random: int = 3, n_draws: int = 1000) -> None:
    """verify(p, q, draft_tokens, generator=None) -> (num_accepted, next_token): p [k+1, V], q [k, V]; accept_token
    at each position up to the first rejection (the residual's token comes next), or all k accepted and a bonus
    token drawn from p[k]."""
    rng = random.Random(seed)

    def greedy(description, target, drafted, V=6, hint=""):
        p, q = one_hot(target, V), one_hot(drafted, V)
        return Case(
            description,
            ("once", p, q, list(drafted), seed),
            later(engine_verify, p, q, list(drafted), torch.Generator().manual_seed(0)),
            hint,
        )

    cases = [
        greedy("greedy: the 2nd proposal differs from the target's token", [3, 1, 4, 0], [3, 5, 2]),
        greedy(
            "greedy: a later proposal matches again after a rejection",
            [3, 1, 4, 1, 5],
            [3, 2, 4, 1],
            hint="stop at the first rejection",
        ),
        greedy(
            "greedy: all 3 accepted, then the bonus token from p[3]",
            [3, 1, 4, 5],
            [3, 1, 4],
            hint="all k accepted: one more token, drawn from p[k]",
        ),
        greedy("greedy: the first proposal is rejected", [2, 2, 2], [0, 2]),
        greedy(
            "k = 0: no proposals, the token comes from p[0]",
            [4],
            [],
            hint="with no proposal, all 0 are accepted: the token is drawn from p[0]",
        ),
        greedy("k = 1, accepted: the bonus comes from p[1]", [1, 0], [1]),
        greedy(
            "GPT-2's vocabulary (50257 tokens), k = 4: ids 0, 300 and 50256, the 3rd proposal rejected",
            [0, 300, 50256, 7, 9],
            [0, 300, 50255, 7],
            V=50257,
            hint="token ids go up to 50256, and 0 is a token like any other",
        ),
    ]
    for i in range(n_random):
        V, k = rng.randint(3, 40), rng.randint(1, 6)
        target = [rng.randrange(V) for _ in range(k + 1)]
        agree = rng.randint(0, k)
        drafted = target[:agree] + [(t + rng.randint(1, V - 1)) % V for t in target[agree:k]]
        cases.append(greedy(f"greedy random #{i}: V = {V}, k = {k}", target, drafted, V))
    toy = [
        ([0.5, 0.3, 0.2, 0], [0.2, 0.2, 0.3, 0.3]),
        ([0, 0.4, 0.6, 0], [0.1, 0.6, 0.2, 0.1]),
        ([0.25, 0.25, 0.25, 0.25], [0.7, 0, 0, 0.3]),
    ]
    p = torch.stack([_dist(row) for row, _ in toy])
    q = torch.stack([_dist(row) for _, row in toy[:2]])
    alphas = [float(torch.minimum(p[i], q[i]).sum()) for i in range(2)]
    cases.append(
        Case(
            "2 proposals drawn from q (many calls): the tokens that come out follow p",
            ("many", p, q, n_draws, seed),
            Wanted(
                f"first new token distributed as p[0] = {_fmt(p[0])}; 0, 1, 2 accepted in "
                f"{_fmt(torch.tensor([1 - alphas[0], alphas[0] * (1 - alphas[1]), alphas[0] * alphas[1]]))}"
                " of the calls"
            ),
        )
    )
    # Each position draws its own u. The same proposal twice, kept with probability 1/2 each time: both kept in
    # 1/4 of the calls, the first alone in 1/4. One u for the whole round keeps both in 1/2 and the first alone
    # never: over n_draws = 1000 calls a bias of 0.25 is 18 standard deviations (sqrt(.1875 / 1000) = 0.014),
    # far past the chi-square limit (~5 sd at a false-alarm rate of 1e-6).
    p2 = torch.stack([_dist([0.5, 0.25, 0.25])] * 3)
    q2 = torch.stack([_dist([1, 0, 0])] * 2)
    cases.append(
        Case(
            "the same proposal at both positions, kept with probability 1/2 each: the two draws are independent",
            ("many", p2, q2, n_draws, seed + 1),
            Wanted("0, 1, 2 accepted in [0.5, 0.25, 0.25] of the calls"),
            "draw a new u at each position (accept_token draws its own): one u for the whole round "
            "accepts both or neither together",
        )
    )

    pc, qc = torch.stack([_dist([0.25, 0.25, 0.25, 0.25])] * 3), torch.stack([_dist([0.5, 0.5, 0, 0])] * 2)
    generator_contract(
        "verify",
        lambda g: call_learner(
            "verify", unwritten_helper(fn), (pc, qc, [0, 1], g), forbid=[NO_ENGINE], may_modify=(3,)
        ),
        what=f"verify(p = [{_fmt(pc[0])}] * 3, q = [{_fmt(qc[0])}] * 2, draft_tokens=[0, 1], generator)",
    )

    def run(kind, *args):
        if kind == "engine":
            return _in_engine("verify", fn, *args)
        if kind == "once":
            p, q, drafted, s = args
            return fn(p, q, drafted, torch.Generator().manual_seed(s))
        return _draw_verifies(fn, *args)

    def show(args):
        if args[0] == "engine":
            return show_engine("verify", args[1])
        if args[0] == "once":
            _, p, q, drafted, _ = args
            return (
                f"verify(p one-hot on {p.argmax(-1).tolist()}, q one-hot on {q.argmax(-1).tolist()}, "
                f"draft_tokens={drafted}, generator)" + (f" (V = {p.shape[-1]})" if p.shape[-1] > 12 else "")
            )
        _, p, q, n, _ = args
        return (
            f"{n} calls verify(p, q, [x1, x2], generator), x1 ~ q[0], x2 ~ q[1]; p = "
            f"[{', '.join(map(_fmt, p))}], q = [{', '.join(map(_fmt, q))}]"
        )

    cases += engine_cases("verify", ("draft", "lookup-sampled"))
    run_check(
        "verify",
        named_like(run, fn),
        cases,
        judge=_verify_verdict,
        forbid=[NO_ENGINE],
        show_call=show,
        seconds=10,
        total_seconds=30,
        error_hints={"is not written yet": "verify calls accept_token: write that exercise first"},
    )


# ----------------------------------------------------------------------------------------------
# Exercise 3: prompt_lookup_draft


def _lookup(tokens, k, max_ngram, *, latest=True, fallback=True, skip_tail=True, continuation=True):
    """prompt_lookup_draft and its plausible mistakes (flags off)."""
    sizes = range(min(max_ngram, len(tokens) - 1), 0, -1)
    for n in sizes if fallback else [n for n in sizes if n == max_ngram]:
        tail = tokens[-n:]
        last = len(tokens) - n - (1 if skip_tail else 0)
        starts = range(last, -1, -1) if latest else range(0, last + 1)
        for start in starts:
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k] if continuation else tokens[start : start + min(n, k)]
    return []


LOOKUP_MISTAKES = [  # the first whose answer is the learner's names the mistake
    (dict(latest=False), "take the LATEST earlier occurrence (search from the end): recent text predicts best"),
    (dict(fallback=False), "when the last max_ngram tokens never occurred, try shorter n-grams, down to n = 1"),
    (
        dict(skip_tail=False),
        "the tail itself is the latest occurrence of the tail, with nothing after it: look for "
        "occurrences that end before it (start <= len(tokens) - n - 1)",
    ),
    (dict(continuation=False), "propose what FOLLOWED the match (tokens[start + n : start + n + k]), not the match"),
]


def _stale_answer(case: Case, got: list) -> bool:
    """Whether `got` looks like an answer kept from another call: the engine's growing text, or the right answer for
    other arguments."""
    tokens, k, max_ngram = case.args if len(case.args) == 3 else (*case.args, 3)
    return case.description.startswith("the engine's calls") or any(
        _lookup(tokens, k2, n2) == got for k2 in range(1, 9) for n2 in range(1, 6) if (k2, n2) != (k, max_ngram)
    )


def _lookup_verdict(case: Case, got: Any) -> Verdict:
    if case.args[0] == "engine":
        return engine_verdict("prompt_lookup_draft", case, got) or _lookup_engine_calls(got)
    tokens, k, max_ngram = case.args if len(case.args) == 3 else (*case.args, 3)
    if not isinstance(got, list) or not all(_is_id(t) for t in got):
        return f"expected a list of ints, got {short(got, 80)}", "return a list of token ids ([] if no match)"
    if got == case.expected:
        return None
    hint = next((h for flags, h in LOOKUP_MISTAKES if _lookup(tokens, k, max_ngram, **flags) == got), "")
    if len(got) > k:
        hint = f"at most num_draft_tokens = {k} tokens"
    elif len(case.args) == 2 and not hint and any(_lookup(tokens, k, n) == got for n in (1, 2, 4, 5, 6, 8)):
        hint = (
            "the engine calls prompt_lookup_draft(tokens, num_draft_tokens) without max_ngram: its default "
            "must be 3 (def prompt_lookup_draft(tokens, num_draft_tokens, max_ngram=3))"
        )
    elif not hint and not case.hint and _stale_answer(case, got):  # a guess: a case's own hint says more
        hint = (
            "each call must depend on its own arguments only: a cache of earlier answers (or of an index of the "
            "text) keyed on part of them gives a stale answer when the text grows or num_draft_tokens changes"
        )
    return f"expected {short(case.expected, 120)}, got {short(got, 120)}", hint


def _lookup_engine_calls(got: EngineRun) -> Verdict:
    """Each of the engine's calls of the learner's prompt_lookup_draft against the engine's own answer (greedy
    tokens are the same whatever is proposed: only the proposals show a wrong lookup)."""
    for i, ((tokens, k), out) in enumerate(got.calls):
        expected = engine_prompt_lookup_draft(list(tokens), k)
        if out != expected:
            verdict = _lookup_verdict(Case("the engine's call", (tokens, k), expected), out)
            problem, hint = verdict if verdict else ("", "")
            raise failure(
                "prompt_lookup_draft",
                f"in the engine, {ENGINE_RUNS['lookup'][0]}, its call {i + 1} of "
                f"{len(got.calls)} (with your prompt_lookup_draft in the engine)",
                problem,
                f"prompt_lookup_draft(the text so far: {len(tokens)} tokens ending {short(tokens[-6:], 60)}, "
                f"{k}) — the engine's call, without max_ngram",
                expected,
                out,
                [LOOKUP_ENGINE_HINT, hint],  # it passed every case: what the engine's calls add is the news
            )
    return None


# token ids as a paragraph of numbers, not one per line
# fmt: off
_LONG_TEXT = [  # GPT-2's tokens of a passage of Romeo and Juliet (ids past 255; repeats a lookup can find)
    49, 2662, 46, 25, 198, 1537, 2705, 11, 644, 1657, 832, 331, 4324, 9457, 30, 198, 1026, 318, 262, 7627, 11,
    290, 21826, 318, 262, 4252, 13, 198, 3041, 786, 11, 3148, 4252, 11, 290, 1494, 262, 44069, 8824, 11, 198,
    8241, 318, 1541, 6639, 290, 14005, 351, 22353, 11, 198, 2504, 14210, 607, 25920, 1242, 881, 517, 3148, 621,
    673, 25, 198, 1532, 262, 4252, 318, 262, 7627, 11, 290, 21826, 318, 262, 4252, 11, 198, 50256, 198, 49, 2662,
    46, 25, 198, 40, 716, 1309, 262, 7627, 13, 0, 198, 7575, 318, 262, 4252, 13,
]
# fmt: on


# ----------------------------------------------------------------------------------------------
# In the engine: accept_token, verify and prompt_lookup_draft end by generating with the learner's function,
# given to generate as `llmcourse.course.learner.my_engine` gives it (`speculation=guarded(Speculation, ...)`), on the
# bundled pair (gpt2-shakespeare and gpt2-shakespeare-draft), so that a function that passes the cases cannot then
# fail in the engine (GPT-2's vocabulary, the engine's p and q rows, a round with fewer proposals, the whole text).

ENGINE_PROMPT = _LONG_TEXT * 2 + _LONG_TEXT[:40]  # 234 tokens of real text (the bundled models hold 256 positions)
ENGINE_NEW_TOKENS = 12
ENGINE_RUNS = {  # generate's settings; without `draft`: the bundled draft model
    "draft": (
        "greedy, the bundled draft model (gpt2-shakespeare-draft) proposing 3 tokens a round",
        dict(num_draft_tokens=3),
    ),
    "lookup": ("greedy, prompt lookup proposing 3 tokens a round", dict(draft=PROMPT_LOOKUP, num_draft_tokens=3)),
    "lookup-sampled": (
        "sampling (temperature 0.8, top_k 40, seed 3), prompt lookup proposing 3 tokens a round",
        dict(draft=PROMPT_LOOKUP, num_draft_tokens=3, temperature=0.8, top_k=40, seed=3),
    ),
}


def _engine_generate(run: str, speculation: Speculation) -> list[int]:
    """The bundled model's new tokens for ENGINE_PROMPT, generated with `speculation`'s functions."""
    model = bundled_model()
    settings = dict(ENGINE_RUNS[run][1])
    settings.setdefault("draft", bundled_model("gpt2-shakespeare-draft"))
    with one_thread():
        return generate(
            model,
            list(ENGINE_PROMPT),
            max_new_tokens=ENGINE_NEW_TOKENS,
            eos_token_id=None,
            speculation=speculation,
            **settings,
        )


def _engine_own(run: str) -> list[int]:
    return _engine_generate(run, Speculation())


@dataclasses.dataclass
class EngineRun:
    """What the engine did with the learner's function installed: the new tokens (or the PartError that stopped
    it), and each call of the learner's function (its arguments, its result)."""

    tokens: Any
    calls: list
    changed: Verdict = None  # the first call that changed an input: what changed, and the hint

    def __repr__(self) -> str:
        if isinstance(self.tokens, PartError):
            return "no tokens: the engine stopped (see above)"
        return short(self.tokens, 120)


def _in_engine(name: str, fn: Callable, run: str) -> EngineRun:
    """generate on the bundled pair with the learner's `name`, given as my_engine gives it. The engine's own
    code runs unwatched (and faster); the learner's calls run under the check's watch."""
    watch = sys.getprofile()
    calls: list = []
    changed: list = []

    def theirs(*args):
        inputs = watched(fn, args)
        sys.setprofile(watch)
        try:
            out = fn(*args)
        finally:
            sys.setprofile(None)
        calls.append((args, out))
        changed.append(changed_input(inputs, args))
        return out

    theirs.__name__ = theirs.__qualname__ = getattr(fn, "__qualname__", name)
    sys.setprofile(None)
    try:
        tokens = _engine_generate(run, guarded(Speculation, **{name: theirs}))
    except PartError as err:
        tokens = err
    finally:
        sys.setprofile(watch)
    return EngineRun(tokens, calls, next(filter(None, changed), None))


def engine_cases(name: str, runs: tuple[str, ...]) -> list[Case]:
    """Cases ("engine", run): greedy runs must give the engine's own tokens (computed after the learner's run);
    sampled ones must give ENGINE_NEW_TOKENS tokens without the engine stopping the learner's function."""
    return [
        Case(
            f"in the engine, {ENGINE_RUNS[run][0]}",
            ("engine", run),
            Wanted(f"{ENGINE_NEW_TOKENS} new tokens, each valid for the target's p (sampled: any the rule may give)")
            if "sampled" in run
            else later(_engine_own, run),
        )
        for run in runs
    ]


def show_engine(name: str, run: str) -> str:
    return (
        f"generate(gpt2-shakespeare, a {len(ENGINE_PROMPT)}-token prompt, max_new_tokens={ENGINE_NEW_TOKENS}, "
        f"eos_token_id=None, {', '.join(f'{k}={v!r}' for k, v in ENGINE_RUNS[run][1].items())}"
        f"{'' if 'draft' in ENGINE_RUNS[run][1] else ', draft=gpt2-shakespeare-draft'}, "
        f"speculation=guarded(Speculation, {name}={name})) (as my_engine runs it)"
    )


ENGINE_HINT = (
    "your {name} passes the cases above but not the engine's own calls: the engine gives it float32 rows of "
    "GPT-2's vocabulary (50257 tokens; one-hot when greedy, and q one-hot for prompt lookup), fewer "
    "proposals than num_draft_tokens at the end of a generation, and a generator"
)
LOOKUP_ENGINE_HINT = (
    "your prompt_lookup_draft passes the cases above but not the engine's own calls: before every "
    "round the engine calls prompt_lookup_draft(tokens, num_draft_tokens) — the whole text so far "
    "(prompt and new tokens, ids up to 50256), without max_ngram"
)


def engine_verdict(name: str, case: Case, got: EngineRun) -> Verdict:
    """The verdict on an ("engine", run) case: the engine did not stop the learner's function, and a greedy run
    gave the engine's own tokens."""
    hint = LOOKUP_ENGINE_HINT if name == "prompt_lookup_draft" else ENGINE_HINT.format(name=name)
    if got.changed:
        return f"with your {name} in the engine, a call {got.changed[0]}", got.changed[1]
    if isinstance(got.tokens, PartError):
        lines = str(got.tokens).split("\n")
        return (
            f"with your {name} in the engine, the engine stopped it: {lines[0]}"
            + "".join(f"\n  {line.strip()}" for line in lines[1:3] if not line.strip().startswith("hint")),
            hint,
        )
    if not (isinstance(got.tokens, list) and len(got.tokens) == ENGINE_NEW_TOKENS):
        return f"with your {name} in the engine, the engine gave {short(got.tokens, 80)}", hint
    if isinstance(case.expected, list) and got.tokens != case.expected:
        wrong = next(i for i, (a, b) in enumerate(zip(got.tokens, case.expected)) if a != b)
        return (
            f"with your {name} in the engine, greedy decoding gave other tokens than the engine's own (token "
            f"{wrong} differs): speculative decoding must give plain greedy decoding's tokens",
            hint,
        )
    return None


def check_prompt_lookup_draft(fn, *, seed: int = 0, n_random: int = 30) -> None:
    """prompt_lookup_draft(tokens, num_draft_tokens, max_ngram=3) -> up to k tokens that followed the latest
    earlier occurrence of the last n tokens, n = max_ngram down to 1; [] if none."""
    rng = random.Random(seed)

    def case(description, tokens, k, max_ngram=3, hint=""):
        return Case(
            description, (tokens, k, max_ngram), later(engine_prompt_lookup_draft, list(tokens), k, max_ngram), hint
        )

    def as_engine(description, tokens, k, hint=""):
        """prompt_lookup_draft(tokens, k), without max_ngram: as the engine's PromptLookup calls it."""
        return Case(description, (tokens, k), later(engine_prompt_lookup_draft, list(tokens), k), hint)

    cases = [
        case("no earlier occurrence", [1, 2, 3, 4], 3),
        case("one token only", [7], 2),
        case("the last 3 tokens occurred at the start", [5, 6, 7, 8, 9, 5, 6, 7], 2),
        case(
            "several occurrences: the latest wins",
            [1, 2, 10, 11, 1, 2, 20, 21, 1, 2],
            2,
            hint="the latest earlier occurrence of the tail",
        ),
        case(
            "a longer match is preferred to a later shorter one",
            [4, 5, 6, 30, 31, 9, 6, 40, 4, 5, 6],
            2,
            hint="try n = max_ngram first, then shorter",
        ),
        case("only a 1-token match exists", [3, 9, 8, 7, 3], 3, hint="fall back down to n = 1"),
        case("the continuation is shorter than k: it runs into the tail", [1, 2, 3, 1, 2], 5),
        case("overlapping repeats", [1, 1, 1, 1], 3),
        case("k = 1", [5, 6, 7, 5, 6], 1),
        case("max_ngram = 1", [4, 5, 6, 1, 5, 6], 2, max_ngram=1),
        case("max_ngram = 5, a 5-token repeat", [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5], 3, max_ngram=5),
        case("large token ids", [50256, 198, 464, 50256, 198], 2),
        as_engine(
            "called as the engine calls it (no max_ngram): a 3-token repeat and a later 2-token one",
            [7, 8, 9, 1, 2, 5, 8, 9, 3, 4, 7, 8, 9],
            2,
            hint="the default max_ngram is 3: the 3-token match [7, 8, 9] wins over the later [8, 9]",
        ),
        as_engine(
            "called as the engine calls it: a 4-token repeat must not be preferred (max_ngram = 3)",
            [1, 2, 3, 4, 10, 11, 9, 2, 3, 4, 20, 21, 1, 2, 3, 4],
            2,
        ),
        as_engine(
            "token 0 (a real token, EOS in some vocabularies) inside the text",
            [0, 5, 0, 0, 6, 0, 0],
            3,
            hint="0 is a token like any other (test `is None`, not truthiness)",
        ),
    ]
    # Longer texts (real text from GPT-2's tokenizer, token ids up to 50256) and the engine's own calls: one after
    # each round on a growing text, num_draft_tokens changing at the end (a cache keyed on part of the arguments
    # gives a stale answer).
    text = _LONG_TEXT * 3
    cases.append(as_engine(f"a long text: {len(text)} tokens of real text", text, 4))
    cases.append(case("a long text, max_ngram = 5", text[:300], 5, max_ngram=5))
    grown = text[:250]
    for step, (extra, k) in enumerate([(0, 4), (3, 4), (1, 4), (5, 4), (0, 2), (0, 1), (2, 6)]):
        grown = grown + text[len(grown) : len(grown) + extra] if extra else grown
        cases.append(
            as_engine(
                f"the engine's calls during one generation, call {step + 1}: {len(grown)} tokens, "
                f"num_draft_tokens = {k}",
                list(grown),
                k,
            )
        )

    for i in range(n_random):
        vocab, offset = rng.choice([2, 3, 5, 8]), rng.choice([0, 0, 250, 50250])  # ids past 255 too
        tokens = [offset + rng.randrange(vocab) for _ in range(rng.randint(1, rng.choice([30, 30, 300])))]
        cases.append(
            case(
                f"random #{i}: {len(tokens)} tokens from {vocab} ids",
                tokens,
                rng.randint(1, 6),
                rng.choice([1, 2, 3, 3, 3, 4]),
            )
        )

    def show(args):
        if args[0] == "engine":
            return show_engine("prompt_lookup_draft", args[1])
        if len(args) == 2:
            return f"prompt_lookup_draft({short(args[0], 120)}, num_draft_tokens={args[1]})"
        tokens, k, max_ngram = args
        return f"prompt_lookup_draft({short(tokens, 120)}, num_draft_tokens={k}, max_ngram={max_ngram})"

    cases += engine_cases("prompt_lookup_draft", ("lookup",))

    def run(*args):
        return _in_engine("prompt_lookup_draft", fn, args[1]) if args[0] == "engine" else fn(*args)

    run_check(
        "prompt_lookup_draft",
        named_like(run, fn, leading=()),
        cases,
        judge=_lookup_verdict,
        forbid=[NO_ENGINE],
        show_call=show,
        seconds=5,
        total_seconds=20,
    )


# ----------------------------------------------------------------------------------------------
# Exercises 4 to 6: expected_tokens, expected_speedup, best_k
#
# Every answer is compared with the exact value on the very numbers given (a float is a fraction too), so that no
# rounding of the check's own can make or break a tie. Floats are allowed a relative error of FORMULA_RTOL: a loop
# and the closed form differ by a few units in the last place, and the closed form loses digits as α → 1 (at
# α = 1 − 10⁻⁶, k = 64, about 10⁻¹¹), far inside it.

FORMULA_RTOL = 1e-9
NEAR = 1e-6  # how close a value must be to a known mistake's to name it

NO_FORMULA = [
    Forbidden(
        "llmcourse.engine.speculative.expected_tokens_per_round",
        "the engine's expected_tokens_per_round is what your expected_tokens is compared with: sum the chances "
        "yourself",
    ),
    Forbidden(
        "llmcourse.engine.speculative.expected_speedup",
        "the engine's expected_speedup is what yours is compared with: use your own (from your expected_tokens)",
    ),
    Forbidden(
        "llmcourse.engine.speculative.best_k",
        "the engine's best_k is what yours is compared with: write your own (from your expected_speedup)",
    ),
    Forbidden("llmcourse.bench.speculative", "the benchmark's formulas are the engine's: write your own"),
    NO_ENGINE,
]


def exact_tokens(alpha, k: int) -> Fraction:
    """1 + α + … + α^k in exact arithmetic on the very number given."""
    alpha = Fraction(alpha)
    return Fraction(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def exact_speedup(alpha, k: int, c) -> Fraction:
    """`expected_speedup` in exact arithmetic on the very numbers given (a float is a fraction too): no rounding
    can make or break a tie."""
    return exact_tokens(alpha, k) / (k * Fraction(c) + 1)


def exact_best_k(alpha, c, max_k: int) -> int:
    """The smallest k in 1..max_k with the largest exact speed-up."""
    return max(range(1, max_k + 1), key=lambda k: exact_speedup(alpha, k, c))


def clear_best(alpha, c, max_k: int) -> bool:
    """Whether the best k beats every other by more than rounding could change (a random case's requirement)."""
    values = sorted((exact_speedup(alpha, k, c) for k in range(1, max_k + 1)), reverse=True)
    return len(values) == 1 or values[0] - values[1] > Fraction(1, 10**9) * values[0]


def _as_fraction(x: Any) -> Optional[Fraction]:
    """A real number as an exact fraction; None for nan and infinities."""
    try:
        return Fraction(x) if isinstance(x, (numbers.Rational, float)) else Fraction(float(x))
    except (OverflowError, ValueError, TypeError):
        return None


def _close(got: Fraction, want: Fraction, rtol: float = FORMULA_RTOL) -> bool:
    return abs(got - want) <= Fraction(rtol) * abs(want)


def _number_problem(got: Any, what: str) -> Verdict:
    """Why `got` is not a usable number (a Python number of any type: int, float, Fraction, numpy's), or None."""
    if isinstance(got, Tensor):
        return f"expected a number, got a tensor {short(got, 60)}", f"return a Python number: float(...) of the {what}"
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        return f"expected a number, got {short(got, 80)}", f"return the {what}, a float (or any real number)"
    if math.isnan(float(got)):
        return (
            f"got {got!r}",
            "nan at α = 1: the closed form is 0/0 there (numpy's floats give nan where Python's raise "
            "ZeroDivisionError); at α = 1 every proposal is kept: k + 1 tokens — handle α == 1 separately, or sum "
            "the series in a loop",
        )
    if math.isinf(float(got)):
        return f"got {got!r}", f"the {what} is finite: look for a division by zero"
    return None


def _shown(x: Fraction) -> str:
    return f"{float(x):.10g}" + (f" (= {x})" if x.denominator != 1 and x.denominator < 10**4 else "")


class Value:
    """An exact expected value, shown as a float (and the fraction, if short)."""

    def __init__(self, value: Fraction):
        self.value = value

    def __repr__(self) -> str:
        return _shown(self.value)


def _token_mistakes(alpha: Fraction, k: int) -> list[tuple[Optional[Fraction], str]]:
    """(value, hint) of plausible wrong tokens per round at (α, k), for naming the one a learner wrote (None where
    the mistake is undefined, as 1/(1 − α) at α = 1)."""
    one = alpha == 1
    return [
        (
            Fraction(k) if one else (1 - alpha**k) / (1 - alpha),
            "one term short: (1 − α^k)/(1 − α) = 1 + α + … + α^(k−1) leaves out the k-th proposal (kept with "
            "probability α^k, when all k are kept): the numerator is 1 − α^(k+1)",
        ),
        (
            Fraction(k) if one else alpha * (1 - alpha**k) / (1 - alpha),
            "that is the expected number of accepted proposals, α + α² + … + α^k: every round also yields one token "
            "of the target's own — the correction at the first rejection, or the bonus token after k acceptances: "
            "add 1",
        ),
        (
            None if one else 1 / (1 - alpha),
            "1/(1 − α) = 1 + α + α² + … is the sum for unlimited proposals: a round has k, so the series stops at "
            "α^k: (1 − α^(k+1))/(1 − α)",
        ),
        (
            Fraction(k + 2) if one else (1 - alpha ** (k + 2)) / (1 - alpha),
            "one term too many: 1 + α + … + α^(k+1) counts a (k+1)-th proposal; a round has k proposals plus the "
            "target's one token: 1 + α + … + α^k",
        ),
        (
            1 + k * alpha,
            "proposal i counts only if it and every one before it are kept — probability α^i, not α: the target "
            "stops at the first rejection",
        ),
    ]


def _tokens_hint(alpha: Fraction, k: int, got: Fraction) -> str:
    want = exact_tokens(alpha, k)
    if alpha == 1 and got == k:
        return "at α = 1 every proposal is kept: k proposals plus the bonus token, k + 1"
    for value, hint in _token_mistakes(alpha, k):
        if value is not None and value != want and _close(got, value, NEAR):
            return hint
    if want.denominator != 1 and got in (math.floor(want), round(want)):
        return "the expectation is a fraction: return it whole (a float), not truncated or rounded to an int"
    return ""


def _tokens_verdict(case: Case, got: Any) -> Verdict:
    alpha, k = case.args
    problem = _number_problem(got, "expected number of tokens")
    if problem:
        return problem
    want, value = exact_tokens(alpha, k), _as_fraction(got)
    if _close(value, want):
        return None
    return f"expected {_shown(want)}, got {got!r}", _tokens_hint(Fraction(alpha), k, value)


def _random_alpha(rng: random.Random):
    return rng.choice(
        [rng.random(), rng.random(), 0.5 + rng.random() / 2, 0.9 + rng.random() / 10, rng.randint(1, 19) / 20]
    )


def check_expected_tokens(fn, *, seed: int = 0, n_random: int = 12) -> None:
    """expected_tokens(alpha, k) -> the tokens a round yields on average when each of its k proposals is kept with
    probability alpha, independently, until the first rejection: 1 + α + … + α^k = (1 − α^(k+1))/(1 − α), k + 1 at
    α = 1. Compared with the exact value on the numbers given, to FORMULA_RTOL."""
    rng = random.Random(seed)

    def case(description, alpha, k, hint=""):
        return Case(description, (alpha, k), later(lambda: Value(exact_tokens(alpha, k))), hint)

    cases = [
        case("α = 0.6, k = 4", 0.6, 4),
        case("k = 1: the first proposal, then the target's token", 0.5, 1, "1 + α: the proposal kept, or not"),
        case("a long round: α = 0.9, k = 16", 0.9, 16),
        case(
            "α = 0 (an int): every proposal is rejected",
            0,
            4,
            "at α = 0 a round yields exactly one token: the target's correction of the first proposal",
        ),
        case(
            "α = 1 (an int): every proposal is kept",
            1,
            4,
            "at α = 1 the closed form is 0/0: all k proposals are kept, then the bonus token: k + 1",
        ),
        case("α = 1.0 (a float), k = 8", 1.0, 8, "at α = 1 the tokens per round are k + 1"),
        case(
            "α = numpy.float64(1.0), k = 3",
            np.float64(1.0),
            3,
            "at α = 1 the tokens per round are k + 1 (numpy's 0/0 is nan)",
        ),
        case(
            "k = 0: a round with no proposal (prompt lookup found nothing) still yields the target's token",
            0.7,
            0,
            "the target's own token is always there: 1 + (nothing proposed)",
        ),
        case("the bundled pair: α ≈ 0.57, k = 8", 0.57, 8),
        case("α close to 1: α = 0.999999, k = 64", 0.999999, 64),
        case("fractions: α = 3/5, k = 5", Fraction(3, 5), 5),
        case("α = numpy.float64(0.7), k = 3", np.float64(0.7), 3),
    ]
    for i in range(n_random):
        cases.append(case(f"random #{i}", _random_alpha(rng), rng.choice([rng.randint(1, 8), rng.randint(1, 64)])))

    run_check(
        "expected_tokens",
        fn,
        cases,
        judge=_tokens_verdict,
        forbid=NO_FORMULA,
        show_call=lambda args: f"expected_tokens(alpha={args[0]!r}, k={args[1]})",
        seconds=5,
        total_seconds=20,
        shrink=False,
        error_hints={
            "ZeroDivisionError": "the α = 1 division by zero: the closed form is 0/0 there; all k proposals are kept, "
            "then the bonus token: k + 1 (handle α == 1 separately, or sum 1 + α + … + α^k in a loop)",
        },
    )


def _speedup_mistakes(alpha: Fraction, k: int, c: Fraction) -> list[tuple[Optional[Fraction], str]]:
    """(value, hint) of plausible wrong speed-ups at (α, k, c) (None where undefined)."""
    tokens = exact_tokens(alpha, k)
    found = [
        (
            tokens / (k * c) if c else None,
            "the cost k·c leaves out the target's pass: a round runs the draft k times (c each) and the target once, "
            "over k + 1 positions, which costs about one decode step: k·c + 1",
        ),
        (
            tokens / ((k + 1) * c + 1),
            "(k + 1)·c + 1 counts k + 1 draft steps: the draft makes k proposals, k steps of c each: k·c + 1",
        ),
        (
            tokens / (k * c + k + 1),
            "the verify pass is counted as k + 1 target steps: it reads the same weights once for all k + 1 positions, "
            "and while decode is memory-bound that costs about one step: k·c + 1",
        ),
        (
            tokens,
            "that is the tokens per round, not yet the speed-up: divide by the round's cost in target steps, k·c + 1",
        ),
        (tokens * (k * c + 1), "multiplied by the cost: the speed-up divides the tokens by the cost, k·c + 1"),
        (
            tokens / (k / c + 1) if c else None,
            "c is the draft's step time over the target's (small for a small draft): k draft steps cost k·c target "
            "steps, not k/c",
        ),
    ]
    for value, hint in _token_mistakes(alpha, k):
        if value is not None:
            found.append((value / (k * c + 1), f"the tokens per round are wrong (fix expected_tokens first): {hint}"))
    return found


def _speedup_verdict(case: Case, got: Any) -> Verdict:
    alpha, k, c = case.args
    problem = _number_problem(got, "speed-up")
    if problem:
        return problem
    want, value = exact_speedup(alpha, k, c), _as_fraction(got)
    if _close(value, want):
        return None
    hint = ""
    if Fraction(alpha) == 1 and _close(value, k / (k * Fraction(c) + 1)):
        hint = "at α = 1 every proposal is kept: k + 1 tokens per round (your expected_tokens gives k?)"
    for mistake, text in _speedup_mistakes(Fraction(alpha), k, Fraction(c)):
        if not hint and mistake is not None and mistake != want and _close(value, mistake, NEAR):
            hint = text
    return f"expected {_shown(want)}, got {got!r}", hint


def _random_cost(rng: random.Random):
    return rng.choice([0.0, rng.random() / 10, rng.random() / 3, rng.random(), 1 + rng.random()])


def check_expected_speedup(fn, *, seed: int = 0, n_random: int = 12) -> None:
    """expected_speedup(alpha, k, c) -> expected_tokens(alpha, k) / (k·c + 1): a round's tokens over its cost in
    target decode steps (k draft steps of c each, one target pass over k + 1 positions counted as one step).
    Compared with the exact value on the numbers given, to FORMULA_RTOL."""
    rng = random.Random(seed)

    def case(description, alpha, k, c, hint=""):
        return Case(description, (alpha, k, c), later(lambda: Value(exact_speedup(alpha, k, c))), hint)

    cases = [
        case("α = 0.6, k = 4, c = 0.1", 0.6, 4, 0.1),
        case("the bundled pair: α ≈ 0.57, k = 3, c ≈ 0.27", 0.57, 3, 0.27),
        case("a costly draft: α = 0.9, k = 2, c = 0.5", 0.9, 2, 0.5),
        case(
            "k = 1: (1 + α)/(1 + c), more than 1 exactly when α > c (Leviathan et al.'s Corollary 3.9)",
            0.7,
            1,
            0.2,
        ),
        case(
            "prompt lookup: c = 0 (an int), α = 0.5, k = 4",
            0.5,
            4,
            0,
            "with a free draft (c = 0) a round costs the target's one pass: the speed-up is the tokens per round",
        ),
        case(
            "α = 1 (an int), k = 4, c = 0.5",
            1,
            4,
            0.5,
            "at α = 1 the tokens per round are k + 1 (the closed form's 0/0)",
        ),
        case("α = 1, c = 1: exactly 1, whatever k", 1.0, 8, 1.0),
        case("α = 0: one token per round, k draft steps wasted", 0, 3, 0.1),
        case("a draft dearer than the target: α = 0.8, k = 3, c = 2", 0.8, 3, 2.0),
        case("a long round: α = 0.95, k = 40, c = 0.01", 0.95, 40, 0.01),
        case("fractions: α = 3/5, k = 3, c = 1/10", Fraction(3, 5), 3, Fraction(1, 10)),
        case("numpy floats: α = 0.7, k = 3, c = 0.05", np.float64(0.7), 3, np.float64(0.05)),
    ]
    for i in range(n_random):
        cases.append(case(f"random #{i}", _random_alpha(rng), rng.randint(1, 16), _random_cost(rng)))

    def show(args):
        return f"expected_speedup(alpha={args[0]!r}, k={args[1]}, c={args[2]!r})"

    run_check(
        "expected_speedup",
        unwritten_helper(fn),
        cases,
        judge=_speedup_verdict,
        forbid=NO_FORMULA,
        show_call=show,
        seconds=5,
        total_seconds=20,
        shrink=False,
        error_hints={
            ", c=0) raised ZeroDivisionError": "the cost of a round is k·c + 1 — k draft steps and the target's one "
            "pass — never 0, even with a free draft (c = 0): do you leave out the target's pass, or divide by c?",
            "ZeroDivisionError": "the α = 1 division by zero: the tokens per round are then k + 1 (call your "
            "expected_tokens, which handles α = 1)",
        },
    )


@dataclasses.dataclass
class AutoRun:
    """What generate(..., num_draft_tokens="auto") did with the learner's best_k installed."""

    tokens: Any  # the token ids, or the PartError the guard raised
    choices: list  # the stats' Choice records
    calls: int  # calls of the learner's best_k


def _auto_case(seed: int, how: str) -> tuple[GPT2, Any, list[int]]:
    """A tiny target, its draft (a noisy copy: c = 1, α ≈ 0.6; or prompt lookup: c = 0), a prompt."""
    target = decisive_model(seed).requires_grad_(False)
    draft = PROMPT_LOOKUP if how == PROMPT_LOOKUP else noisy_copy(target, seed, 0.1).requires_grad_(False)
    return target, draft, [(7 * i + seed) % 97 for i in range(5)]


AUTO_NEW_TOKENS = 40


def _run_auto(fn: Callable, seed: int, how: str, watch) -> AutoRun:
    """llmcourse.generate(target, prompt, draft=draft, num_draft_tokens="auto") with the learner's best_k."""
    calls = 0

    def theirs(*args):
        nonlocal calls
        calls += 1
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    theirs.__qualname__ = getattr(fn, "__qualname__", "best_k")
    target, draft, prompt = _auto_case(seed, how)
    stats = SpeculationStats()
    try:
        out = generate(
            target,
            prompt,
            max_new_tokens=AUTO_NEW_TOKENS,
            eos_token_id=None,
            draft=draft,
            num_draft_tokens="auto",
            stats=stats,
            speculation=guarded(Speculation, best_k=theirs),
        )
    except PartError as err:
        out = err
    return AutoRun(out, stats.choices, calls)


def _auto_plain(seed: int, how: str) -> list[int]:
    target, _, prompt = _auto_case(seed, how)
    return _greedy(target, prompt, AUTO_NEW_TOKENS)


def _auto_verdict(case: Case, got: AutoRun) -> Verdict:
    if isinstance(got.tokens, PartError):
        return f"the engine stopped your best_k: {str(got.tokens).splitlines()[0]}", ""
    if not got.calls:
        return "the engine never called your best_k", "num_draft_tokens='auto' calls speculation.best_k(α, c, max_k)"
    for choice in got.choices:
        want = exact_best_k(choice.alpha, choice.c, AUTO_MAX_K)
        if choice.k != want and clear_best(choice.alpha, choice.c, AUTO_MAX_K):
            return (
                f"after {choice.round} rounds (α = {choice.alpha:.4g}, c = {choice.c:.4g}) your best_k chose "
                f"k = {choice.k}; expected k = {want}",
                "",
            )
    if got.tokens != case.expected:
        return "the tokens differ from plain greedy decoding's", "greedy speculative decoding gives the same tokens"
    return None


# -- best_k ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Hypothesis:
    """A plausible wrong best_k, as what it answers: `explains(α, c, max_k, k)` says whether k is its answer there."""

    hint: str
    explains: Callable[[Fraction, Fraction, int, int], bool]


def _near_best(values: list, k: int) -> bool:
    """Whether k (1-based) is an argmax of `values` to within rounding."""
    if any(v is None for v in values) or not 1 <= k <= len(values):
        return False
    best = max(values)
    return values[k - 1] >= best - abs(best) * Fraction(NEAR)


def _formula(speedup: Callable[[Fraction, int, Fraction], Optional[Fraction]]):
    return lambda a, c, m, k: _near_best([speedup(a, j, c) for j in range(1, m + 1)], k)


def _tokens_only(a: Fraction, k: int, c: Fraction) -> Fraction:
    return exact_tokens(a, k)


def _largest_on_tie(a, c, m, k):
    values = [exact_speedup(a, j, c) for j in range(1, m + 1)]
    return k == max(j for j in range(1, m + 1) if values[j - 1] == max(values))


def _zero_based(a, c, m, k):
    return k == max(range(m), key=lambda j: exact_speedup(a, j, c))  # k = 0 tried, max_k not


BEST_K_HYPOTHESES = [  # the first that explains every answer of the sweep names the mistake
    Hypothesis(
        "ties broken to the largest k: on a tie take the smallest k (fewer draft steps, same speed-up)", _largest_on_tie
    ),
    Hypothesis(
        "argmax off by one: the position of the best speed-up in a list that starts at k = 1 is k - 1",
        lambda a, c, m, k: k == exact_best_k(a, c, m) - 1,
    ),
    Hypothesis(
        "searching 0..max_k-1 (range(max_k)): k counts proposals, 1..max_k; search range(1, max_k + 1)", _zero_based
    ),
    Hypothesis(
        "searching 1..max_k-1 (range(1, max_k) stops before max_k): k = max_k is never tried; search "
        "range(1, max_k + 1)",
        lambda a, c, m, k: k == exact_best_k(a, c, max(m - 1, 1)),
    ),
    Hypothesis(
        "ignoring the cost c: more proposals always yield more tokens per round, but each costs c; the speed-up "
        "divides by k·c + 1",
        _formula(_tokens_only),
    ),
    Hypothesis(
        "your k is the best for (1 − α^k)/(1 − α) (or the accepted count α(1 − α^k)/(1 − α)) over k·c + 1: your "
        "expected_tokens is one short — a round yields 1 + α + … + α^k (the accepted proposals and the target's "
        "own token)",
        _formula(lambda a, k, c: (k if a == 1 else (1 - a**k) / (1 - a)) / (k * c + 1)),
    ),
    Hypothesis(
        "your k is the best for (1 − α^(k+2))/(1 − α) over k·c + 1: your expected_tokens counts one proposal too "
        "many — 1 + α + … + α^k",
        _formula(lambda a, k, c: (k + 2 if a == 1 else (1 - a ** (k + 2)) / (1 - a)) / (k * c + 1)),
    ),
    Hypothesis(
        "your k is the best for a cost of (k + 1)·c + 1: the draft makes k proposals in k steps — the cost is k·c + 1",
        _formula(lambda a, k, c: exact_tokens(a, k) / ((k + 1) * c + 1)),
    ),
    Hypothesis(
        "your k is the best for 1/(1 − α) tokens per round, the series for unlimited proposals: a round has k, "
        "so the tokens are 1 + α + … + α^k = (1 − α^(k+1))/(1 − α) — fix expected_tokens",
        _formula(lambda a, k, c: (k + 1 if a == 1 else 1 / (1 - a)) / (k * c + 1)),
    ),
    Hypothesis(
        "your k is the best for a cost of k·c: the target's pass is left out — a round runs the draft k times (c "
        "each) and the target once (about one decode step): k·c + 1",
        _formula(lambda a, k, c: exact_tokens(a, k) / (k * c) if c else exact_tokens(a, k)),
    ),
    Hypothesis(
        "your k is the best for 1 + k·α tokens per round: proposal i counts only if all before it are kept, "
        "probability α^i — the tokens are 1 + α + … + α^k",
        _formula(lambda a, k, c: (1 + k * a) / (k * c + 1)),
    ),
    Hypothesis(
        "k = 1 everywhere: your speed-up falls as k grows — check your expected_speedup: the tokens grow with k, "
        "(1 − α^(k+1))/(1 − α) (not 1/(1 − α)), and the cost is k·c + 1 (the target's pass once, not k + 1 times; "
        "c per draft step, not 1/c)",
        lambda a, c, m, k: k == 1,
    ),
    Hypothesis(
        "argmax off by one: the best k is the best speed-up's position + 1 only if positions start at 0",
        lambda a, c, m, k: k == exact_best_k(a, c, m) + 1,
    ),
]


def _diagnosis(points: list, answers: list) -> str:
    """The hint of the first hypothesis that gives every answer of the sweep (answers that are not ints: none)."""
    if not all(_is_id(k) for k in answers):
        return ""
    pairs = [((Fraction(a), Fraction(c), m), int(k)) for (_, a, c, m, _), k in zip(points, answers)]
    for hypothesis in BEST_K_HYPOTHESES:
        if all(hypothesis.explains(*point, k) for point, k in pairs):
            return hypothesis.hint
    return ""


def _best_k_point(alpha, c, max_k: int, got: Any) -> Verdict:
    """What is wrong with `got` as best_k(alpha, c, max_k), with the hint this answer alone suggests."""
    want = exact_best_k(alpha, c, max_k)
    speedup = exact_speedup(alpha, want, c)

    def at(k):
        return f"k = {k} ({float(exact_speedup(alpha, k, c)):.4f}×)"

    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        return f"expected an integer k, got {short(got, 60)}", "return k, an int in 1..max_k"
    if not isinstance(got, numbers.Integral):
        if math.isclose(float(got), float(speedup), rel_tol=1e-6):
            return (
                f"got {got!r}, the best speed-up itself; expected {at(want)}",
                "returns the speed-up, not k: return the k that gives it",
            )
        if float(got).is_integer():
            return f"got {got!r}, a float; expected the int {want}", "return an int k (int(...) of a whole float)"
        return (
            f"got k = {got!r}, not an integer; expected {at(want)}",
            "a floating-point k (from calculus, setting a derivative to zero) is not a number of proposals: "
            "try every whole k in 1..max_k and keep the best",
        )
    got = int(got)
    if got == want:
        return None
    if got == 0:
        return (
            f"got k = 0; expected {at(want)}",
            "searching 0..max_k-1 (range(max_k)): k counts proposals, 1..max_k; search range(1, max_k + 1)",
        )
    if not 1 <= got <= max_k:
        return f"got k = {got}, outside 1..{max_k}; expected {at(want)}", "k is a number of proposals in 1..max_k"
    hints = []
    if got == want - 1:
        hints.append(
            "argmax off by one: the position of the best speed-up in a list that starts at k = 1 is k - 1"
            if got != max_k - 1 or want != max_k
            else "searching 0..max_k-1 or 1..max_k-1 (range(max_k) stops before max_k): k = max_k is never tried; "
            "search range(1, max_k + 1)"
        )
    if got > want and exact_speedup(alpha, got, c) == speedup:
        hints.append("ties broken to the largest k: on a tie take the smallest k (fewer draft steps, same speed-up)")
    elif got == max_k and c != 0:
        hints.append(
            "ignoring the cost c: more proposals always yield more tokens per round, but each costs c; the "
            "speed-up divides by k·c + 1"
        )
    if got == want + 1 and not hints:
        hints.append("argmax off by one: the best k is the best speed-up's position + 1 only if positions start at 0")
    return f"expected {at(want)}, got {at(got)}", "; ".join(hints)


def _best_k_verdict(case: Case, got: Any) -> Verdict:
    if case.args[0] == "engine":
        return _auto_verdict(case, got)
    if case.args[0] == "sweep":
        return _sweep_verdict(case, got)
    return _best_k_point(*case.args, got)


def _call(alpha, c, max_k) -> str:
    return f"best_k(alpha={alpha!r}, c={c!r}, max_k={max_k})"


@dataclasses.dataclass
class Sweep:
    """best_k's answers over the sweep's points, in order, up to the first that raised (`raised`: the error)."""

    answers: list
    raised: Optional[BaseException] = None
    where: str = ""

    def __repr__(self) -> str:
        return short(self.answers, 200)


def _raised_hint(err: BaseException, alpha, c, max_k: int) -> str:
    if isinstance(err, ZeroDivisionError) and Fraction(alpha) == 1:
        return (
            "the α = 1 division by zero: the closed form is 0/0 there; the tokens per round are k + 1 "
            "(1 + α + … + α^k with α = 1): handle α == 1 separately in your expected_tokens"
        )
    if isinstance(err, ZeroDivisionError) and Fraction(c) == 0:
        return (
            "a division by zero at c = 0 (prompt lookup's free draft): the cost of a round is k·c + 1, the target's "
            "pass included — your expected_speedup leaves it out (k·c), or divides by c"
        )
    if isinstance(err, ValueError) and max_k == 1:
        return "range(1, max_k) is empty at max_k = 1: k = max_k must be tried too: range(1, max_k + 1)"
    return ""


def _sweep_verdict(case: Case, got: Sweep) -> Verdict:
    points = case.args[1]
    for (description, alpha, c, max_k, hint), answer in zip(points, got.answers):
        verdict = _best_k_point(alpha, c, max_k, answer)
        if verdict:
            problem, own = verdict
            diagnosed = _diagnosis(points, got.answers) if _is_id(answer) else ""
            if isinstance(got.raised, ZeroDivisionError):  # a later point's division by c = 0 says more
                _, alpha_raised, c_raised, max_k_raised, _ = points[len(got.answers)]
                if Fraction(alpha_raised) != 1 and Fraction(c_raised) == 0:
                    diagnosed = _raised_hint(got.raised, alpha_raised, c_raised, max_k_raised)
            raise failure(
                "best_k",
                description,
                problem,
                _call(alpha, c, max_k),
                exact_best_k(alpha, c, max_k),
                answer,
                [diagnosed, own, hint],
            )
    if got.raised is not None:
        description, alpha, c, max_k, hint = points[len(got.answers)]
        err = got.raised
        try:
            message = str(err)
        except Exception:  # an exception whose str() fails
            message = "(its message cannot be shown)"
        message = short(message, 300) if len(message) > 300 else message
        hint = one_hint(_raised_hint(err, alpha, c, max_k), hint)
        raise CheckFailed(
            f"✗ best_k — {description}: {_call(alpha, c, max_k)} raised {type(err).__name__}: {message}{got.where}"
            + (f"\n  hint: {hint}" if hint else "")
        )
    return None


def _sweep_points() -> list[tuple]:
    """(description, α, c, max_k, hint) of the sweep: the corners first, then where the plausible mistakes part."""

    def point(description, alpha, c, max_k, hint=""):
        return (description, alpha, c, max_k, hint)

    return [
        point("α = 0.6, c = 0.1, max_k = 8: an optimum inside the range", 0.6, 0.1, 8),
        point("the bundled pair: α ≈ 0.57, c ≈ 0.27", 0.57, 0.27, 8),
        point("a good draft: α = 0.8, c = 0.05, max_k = 4 (the best is max_k)", 0.8, 0.05, 4),
        point("a free draft: c = 0, α = 0.5 (the best is max_k)", 0.5, 0.0, 6),
        point(
            "α = 0: every proposal is rejected",
            0.0,
            0.1,
            8,
            "at α = 0 a round yields one token whatever k, and each proposal costs c: k = 1",
        ),
        point(
            "α = 1 (an int): every proposal is kept",
            1,
            0.5,
            8,
            "at α = 1 the closed form is 0/0: the tokens per round are k + 1",
        ),
        point("α = 1, c = 1: every k gives a speed-up of exactly 1", 1.0, 1.0, 8, "on a tie take the smallest k"),
        point("α = 0, c = 0: every k gives exactly 1", 0, 0, 5, "on a tie take the smallest k (1 + 0 + … = 1 token)"),
        point("α = 1, c = 2: a draft dearer than the target", 1.0, 2.0, 8),
        point("max_k = 1", 0.9, 0.01, 1),
        point("a costly draft: α = 0.9, c = 0.5", 0.9, 0.5, 8),
        point("α close to 1, max_k = 64", 0.999999, 0.02, 64),
        point("α = 0.95, c = 0.01, max_k = 64: an optimum far inside", 0.95, 0.01, 64),
        point("fractions: α = 3/5, c = 1/10", Fraction(3, 5), Fraction(1, 10), 8),
        point("numpy floats: α = 0.7, c = 0.05", np.float64(0.7), np.float64(0.05), 8),
        # Exact ties inside the range (Fractions: no float is a tie there; the floats these become — in the closed
        # form, a loop or numpy — round to one too)
        point(
            "an exact tie between k = 2 and k = 3 (both 3/2×): α = 1/2, c = 1/12 as Fractions",
            Fraction(1, 2),
            Fraction(1, 12),
            8,
            "on a tie take the smallest k",
        ),
        point(
            "an exact tie between k = 3 and k = 4 (both 27/16×): α = 0.5, c = 1/27 (a Fraction)",
            0.5,
            Fraction(1, 27),
            6,
            "on a tie take the smallest k",
        ),
        point(
            "an exact tie between k = 1 and k = 2 (both 19/16×): α = 0.75, c = 9/19 (a Fraction)",
            0.75,
            Fraction(9, 19),
            5,
            "on a tie take the smallest k",
        ),
        point("the best k is max_k - 1... or max_k", 0.75, 0.02, 7),
        point("a draft that keeps less than it costs: α = 0.2, c = 0.3", 0.2, 0.3, 8),
        point("α = 0.8, c = 0.15", 0.8, 0.15, 12),
        point("α = 0.99, c = 0.2", 0.99, 0.2, 16),
        point("α = 0.9, c = 0.05, max_k = 16", 0.9, 0.05, 16),
        point("α = 0.7, c = 0.6", 0.7, 0.6, 8),
        point("α = 0.4, c = 0.02", 0.4, 0.02, 16),
    ]


def check_best_k(fn, *, seed: int = 0, n_random: int = 12) -> None:
    """best_k(alpha, c, max_k) -> the k in 1..max_k with the largest expected speed-up
    (1 − α^(k+1)) / ((1 − α)(k·c + 1)) ((k + 1)/(k·c + 1) at α = 1), the smallest on a tie; then the engine
    runs it: generate(..., num_draft_tokens="auto") must give plain greedy decoding's tokens.

    The first case is a sweep: best_k on every corner and on the points where plausible mistakes part (each wrong
    formula of expected_tokens or expected_speedup gives another k at some of them), one call each; the mistake that
    gives all of its answers is named. The engine's formulas are refused: best_k must rest on your own."""
    rng = random.Random(seed)
    fn = unwritten_helper(fn)
    points = _sweep_points()
    cases = [
        Case(
            f"best_k on {len(points)} points in turn",
            ("sweep", points),
            [exact_best_k(alpha, c, max_k) for _, alpha, c, max_k, _ in points],
        )
    ]
    count = 0
    while count < n_random:
        alpha = rng.choice([rng.random(), rng.random(), 0.5 + rng.random() / 2, 0.9 + rng.random() / 10])
        c = rng.choice([0.0, rng.random() / 10, rng.random() / 3, rng.random(), 1 + rng.random()])
        max_k = rng.randint(1, 16)
        if clear_best(alpha, c, max_k):
            cases.append(Case(f"random #{count}", (alpha, c, max_k), exact_best_k(alpha, c, max_k)))
            count += 1
    for how, which in [("draft", "a draft model (a noisy copy of the target: c = 1)"), (PROMPT_LOOKUP, PROMPT_LOOKUP)]:
        cases.append(
            Case(
                f"llmcourse.generate(target, prompt, draft={which}, num_draft_tokens='auto', max_new_tokens="
                f"{AUTO_NEW_TOKENS}) with your best_k installed: each k it chooses is the best for the α and c "
                "measured, and the tokens are plain greedy decoding's",
                ("engine", seed, how),
                later(_auto_plain, seed, how),
            )
        )

    def sweep(points):
        answers = []
        for _, alpha, c, max_k, _ in points:
            try:
                answers.append(fn(alpha, c, max_k))
            except (NotImplementedError, ForbiddenCall):
                raise
            except Exception as err:  # said with the point it failed at (the judge's message)
                return Sweep(answers, err, _where(err))
        return Sweep(answers)

    def run(*args):
        if args[0] == "sweep":
            return sweep(args[1])
        if args[0] != "engine":
            return fn(*args)
        watch = sys.getprofile()
        sys.setprofile(None)  # only the learner's calls are watched
        try:
            with one_thread(), torch.inference_mode():
                return _run_auto(fn, args[1], args[2], watch)
        finally:
            sys.setprofile(watch)

    run.__qualname__ = getattr(fn, "__qualname__", "best_k")

    def show(args):
        if args[0] == "engine":
            draft = "'prompt-lookup'" if args[2] == PROMPT_LOOKUP else "draft"
            return (
                f"generate(target, prompt, draft={draft}, num_draft_tokens='auto', eos_token_id=None, "
                "speculation=guarded(Speculation, best_k=best_k)) (a tiny target, vocabulary 97)"
            )
        if args[0] == "sweep":
            return f"best_k on {len(args[1])} (α, c, max_k) in turn: α from 0 to 1, c from 0 to 2, max_k from 1 to 64"
        return _call(*args)

    run_check(
        "best_k",
        run,
        cases,
        judge=_best_k_verdict,
        forbid=NO_FORMULA,
        show_call=show,
        seconds=10,
        total_seconds=30,
        shrink=False,
        success=f"✓ best_k — {len(points) + len(cases) - 1} cases",
        error_hints={
            "ZeroDivisionError": "the α = 1 division by zero: the closed form is 0/0 there; the tokens per round "
            "are k + 1 (1 + α + … + α^k with α = 1): handle α == 1 separately",
            "division by zero": "the α = 1 division by zero: the tokens per round are then k + 1; handle α == 1 "
            "separately",
        },
    )


# ----------------------------------------------------------------------------------------------
# Exercise 5: speculative_round


def noisy_copy(model: GPT2, seed: int, scale: float) -> GPT2:
    """The model with noise on its attention and MLP output weights: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in draft.h:
            for w in (block.attn.c_proj.weight, block.mlp.c_proj.weight):
                w.add_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale * w.std())
    return draft


@dataclasses.dataclass
class Pair:
    """A target, a draft, a prompt. Plain greedy decoding's continuation is not kept here: it is computed only after
    the learner's round returned (each round's, and the whole run's with `later`), out of the learner's reach."""

    description: str
    target: GPT2
    draft: GPT2
    prompt: list[int]
    max_new_tokens: int
    k: int
    exact_proposals: bool  # the draft's own greedy continuation is decisive: the kept count can be demanded
    eos_token_id: Optional[int] = None  # for the engine's run only

    def greedy(self) -> list[int]:
        """Plain greedy decoding's tokens from the prompt (what the rounds must make)."""
        return _greedy(self.target, self.prompt, self.max_new_tokens, self.eos_token_id)


PAIRS: dict[tuple, Pair] = {}  # kept out of the cases' arguments (models must not be snapshotted)


def _greedy(model: GPT2, ids: list[int], n: int, eos_token_id: Optional[int] = None) -> list[int]:
    with one_thread(), torch.inference_mode():
        return generate(model, ids, max_new_tokens=n, eos_token_id=eos_token_id) if n else []


def _pair(key: tuple, description: str, make: Callable[[], tuple], k: int, exact: bool = True) -> Pair:
    if key not in PAIRS:
        target, draft, prompt, n = make()
        PAIRS[key] = Pair(description, target, draft, prompt, n, k, exact)
    return PAIRS[key]


def bundled_pair() -> tuple[GPT2, GPT2]:
    """The bundled GPT-2 and its draft, as loaded once for every check (`bundled_model`)."""
    return bundled_model("gpt2-shakespeare"), bundled_model("gpt2-shakespeare-draft")


def token_zero_in_continuation(target: GPT2, prompt: list[int], n: int) -> list[int]:
    """Relabel the target's vocabulary (in place) so that one of its greedy tokens from `prompt` (the 3rd to the 8th,
    one that the prompt holds too if there is one) is token 0: the token table's rows 0 and t exchanged (the head is
    tied to it), so the continuation is the same with t and 0 exchanged; -> the prompt relabeled."""
    made = _greedy(target, prompt, min(n, 8))
    t = next((x for x in made[2:] if x in prompt and x != 0), made[min(4, len(made) - 1)])
    swap = {0: t, t: 0}
    with torch.no_grad():
        target.wte.weight[[0, t]] = target.wte.weight[[t, 0]].clone()
    return [swap.get(x, x) for x in prompt]


@dataclasses.dataclass
class RoundLog:
    """One round of the learner's `speculative_round` in the check's loop, and what was wrong with it."""

    index: int
    tokens: list  # the text before the round
    k: int
    out: Any = None
    target_length: int = 0
    draft_length: int = 0
    target_calls: int = 0
    draft_before: int = 0  # draft_cache.length before the round
    draft_written: int = 0  # the most positions the draft's cache held after one of its passes (or before the round)
    problem: str = ""
    hint: str = ""


@dataclasses.dataclass
class RoundRun:
    rounds: list
    tokens: list  # the new tokens made
    failed: Optional[RoundLog] = None
    engine: Any = None  # the engine's output with the learner's round installed, or its error

    def __repr__(self) -> str:
        if self.failed is not None:
            return f"round {self.failed.index}: {short(self.failed.out, 100)}"
        return short(self.tokens if self.engine is None else self.engine, 120)


def _round_problem(log: RoundLog, pair: Pair) -> None:
    """Fill log.problem / log.hint for a round whose result or caches are wrong (left empty when right). Called after
    the round returned: plain greedy decoding's continuation of the text and the draft's proposals are computed
    only now."""
    out, k, n = log.out, log.k, len(log.tokens)
    continuation = _greedy(pair.target, log.tokens, k + 1)
    proposals = _greedy(pair.draft, log.tokens, k) if pair.exact_proposals else []
    if not isinstance(out, list) or not all(_is_id(t) for t in out):
        log.problem = f"returned {short(out, 80)}, expected a list of token ids"
        log.hint = "return the kept proposals plus the target's next token, as a list of ints"
        return
    if log.target_calls != 1:
        log.problem = f"called the target {log.target_calls} times in one round"
        log.hint = (
            "the point of speculative decoding: ONE forward pass of the target over [tokens[-1], d1, …, dk] "
            "scores all k proposals at once (logits [1, k+1, V]); one pass per proposal is plain decoding"
            if log.target_calls > 1
            else "run the target once over [tokens[-1], d1, …, dk] with target_cache"
        )
        return
    if not 1 <= len(out) <= k + 1:
        log.problem = f"returned {len(out)} tokens; a round with k = {k} proposals returns 1 to {k + 1}"
        log.hint = "the kept proposals, then the target's next token"
        return
    kept = n + len(out) - 1
    if out != continuation[: len(out)]:
        wrong = next(i for i, (a, b) in enumerate(zip(out, continuation)) if a != b)
        log.problem = (
            f"returned {out}, but plain greedy decoding continues with {continuation[: len(out)]} "
            f"(token {wrong} differs)"
        )
        if log.target_length == n + len(out) and len(out) >= 1 and out == continuation[1 : len(out) + 1]:
            log.hint = "feed the target [tokens[-1], d1, …, dk]: its cache holds all of tokens but the last"
        else:
            log.hint = (
                "feed the target [tokens[-1], d1, …, dk] in one pass (its cache holds all of tokens but the "
                "last); keep proposal i while it equals the argmax at position i of that pass; the next token "
                "is the argmax after the last kept proposal"
            )
        return
    if log.target_length != kept:
        if log.target_length == n + len(out) and len(out) == proposals_kept(proposals, continuation):
            log.problem = (
                f"returned {len(out)} tokens and left target_cache.length = {log.target_length}; "
                f"{len(out)} kept proposals and the next token make {len(out) + 1} new tokens"
            )
            log.hint = "return the kept proposals AND the target's next token (the correction or the bonus)"
            return
        off = log.target_length - kept
        log.problem = (
            f"left target_cache.length = {log.target_length}; with {n} tokens before the round and "
            f"{len(out)} new, it must be {kept} (all but the last token, which the next round feeds) — "
            f"{abs(off)} position{'s' if abs(off) != 1 else ''} too {'many' if off > 0 else 'few'}"
        )
        log.hint = (
            "roll back: target_cache.length = len(tokens) + accepted (the verify pass wrote k + 1 positions; "
            "keep tokens[-1] and the accepted proposals, drop the rest)"
        )
        return
    if log.draft_length > log.draft_written:
        log.problem = (
            f"left draft_cache.length = {log.draft_length}, but the draft's cache never held more than "
            f"{log.draft_written} positions this round: its last {log.draft_length - log.draft_written} "
            f"position{'s are' if log.draft_length - log.draft_written != 1 else ' is'} stale (the last "
            f"proposal is never fed to the draft)"
        )
        log.hint = (
            "only ever shorten the draft's cache: draft_cache.length = min(draft_cache.length, len(tokens) + "
            "accepted) — setting it to len(tokens) + accepted unconditionally claims positions it never "
            "computed when every proposal is kept"
        )
        return
    if log.draft_length > kept:
        log.problem = (
            f"left draft_cache.length = {log.draft_length}, beyond the {kept} positions of the text "
            f"(before the new token): it still holds rejected proposals"
        )
        log.hint = (
            "roll the draft's cache back too: draft_cache.length = min(draft_cache.length, len(tokens) + "
            "accepted) — otherwise its stale keys poison every later proposal"
        )
        return
    if pair.exact_proposals:
        expected_kept = proposals_kept(proposals, continuation)
        if len(out) - 1 != expected_kept:
            log.problem = (
                f"kept {len(out) - 1} proposals; the draft's greedy continuation of the text is "
                f"{proposals}, of which the first {expected_kept} match the target's"
            )
            log.hint = (
                "the draft proposes from the whole text: feed it tokens[draft_cache.length:] (what its cache "
                "lacks — more than one token after a round that kept every proposal), then one proposal at "
                "a time; its cache must hold only tokens of the text"
            )


def proposals_kept(proposals: list[int], continuation: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(proposals, continuation)) if a != b), len(proposals))


class CountCalls:
    """Counts the calls of model.forward (by `model(...)` or `model.forward(...)`) while installed, and the most
    positions a cache held after one of them (`written`)."""

    def __init__(self, model: GPT2):
        self.model, self.calls, self.written = model, 0, 0

    def __enter__(self):
        self.model.forward = _Counted(self, type(self.model).forward.__get__(self.model))
        return self

    def __exit__(self, *exc):
        del self.model.forward


class _Counted:
    """model.forward, counted (a class: the watch refuses the checks' own functions, not their methods)."""

    def __init__(self, counter: CountCalls, forward: Callable):
        self.counter, self.forward = counter, forward

    def __call__(self, *args, **kwargs):
        self.counter.calls += 1
        out = self.forward(*args, **kwargs)
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if cache is not None:
            self.counter.written = max(self.counter.written, int(cache.length))
        return out


def _run_rounds(fn: Callable, pair: Pair, watch) -> RoundRun:
    """The learner's round in the check's loop (as the engine's speculative_steps), stopping at the first wrong
    round."""
    target, draft, prompt = pair.target, pair.draft, pair.prompt
    max_len = len(prompt) + pair.max_new_tokens
    tokens = list(prompt)
    target_cache, draft_cache = target.new_cache(1, max_len), draft.new_cache(1, max_len)
    if len(prompt) > 1:
        target(torch.tensor([prompt[:-1]]), cache=target_cache, last_only=True)
    run = RoundRun([], [])
    while len(run.tokens) < pair.max_new_tokens:
        k = min(pair.k, pair.max_new_tokens - len(run.tokens) - 1)
        log = RoundLog(len(run.rounds), list(tokens), k)
        run.rounds.append(log)
        log.draft_before = draft_cache.length
        given = list(tokens)  # the learner's copy: the round must leave it as it is
        with CountCalls(target) as counter, CountCalls(draft) as drafted:
            drafted.written = draft_cache.length
            sys.setprofile(watch)
            try:
                log.out = fn(target, draft, target_cache, draft_cache, given, k)
            finally:
                sys.setprofile(None)
        log.target_calls, log.draft_written = counter.calls, drafted.written
        log.target_length, log.draft_length = target_cache.length, draft_cache.length
        if given != tokens:
            log.problem = (
                f"changed its input `tokens` (the text so far): {len(tokens)} tokens ending "
                f"{short(tokens[-4:], 60)} before the round, {len(given)} ending {short(given[-4:], 60)} after it"
            )
            log.hint = (
                "leave `tokens` as it is (no tokens += …, .append, .extend): the caller adds the tokens your round "
                "returns, so appending them too would add them twice; build what you feed in a new list, "
                "[tokens[-1], *proposals]"
            )
        else:
            _round_problem(log, pair)
        if log.problem:
            run.failed = log
            return run
        ids = [int(t) for t in log.out]  # any integer type is a token id (the engine's guard converts them too)
        tokens += ids
        run.tokens += ids
    run.tokens = run.tokens[: pair.max_new_tokens]
    return run


def _run_engine(fn: Callable, pair: Pair, watch) -> RoundRun:
    """llmcourse.generate with the learner's round (`speculation=guarded(Speculation, speculative_round=...)`)."""
    target = pair.target

    def theirs(*args):
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    theirs.__qualname__ = getattr(fn, "__qualname__", "speculative_round")
    try:
        with one_thread():
            out = generate(
                target,
                pair.prompt,
                max_new_tokens=pair.max_new_tokens,
                eos_token_id=pair.eos_token_id,
                draft=pair.draft,
                num_draft_tokens=pair.k,
                speculation=guarded(Speculation, speculative_round=theirs),
            )
    except PartError as err:
        out = err
    return RoundRun([], [], engine=out)


def _round_verdict(case: Case, got: Any) -> Verdict:
    if case.args[0] == "engine":
        if isinstance(got.engine, PartError):
            return f"the engine stopped your round: {str(got.engine).split(chr(10))[0]}", ""
        if got.engine != case.expected:
            return (
                "the engine with your round installed gave other tokens than plain greedy decoding",
                "every round must return the kept proposals and the target's next token, and leave the caches "
                "as described",
            )
        return None
    if got.failed is None:
        return None if got.tokens == case.expected else ("the tokens differ from plain greedy decoding's", "")
    log = got.failed
    return (
        f"round {log.index} (tokens: {len(log.tokens)}, num_draft_tokens = {log.k}, draft_cache.length = "
        f"{log.draft_before} before the round): {log.problem}",
        log.hint,
    )


def check_speculative_round(fn, *, seed: int = 0, n_random: int = 1, bundled: bool = True) -> None:
    """speculative_round(target, draft, target_cache, draft_cache, tokens, num_draft_tokens) -> the kept proposals
    and the target's next token; one greedy draft-verify round with one target pass and both caches rolled back.
    Run in a loop, it must give plain greedy decoding's tokens."""
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(97) for _ in range(n)]

    def tiny(key, description, draft_of, n_prompt, n_new, k, n_positions=64, zero=False):
        def make():
            target = decisive_model(seed + key, n_positions=n_positions).requires_grad_(False)
            ids = prompt(n_prompt)
            if zero:
                ids = token_zero_in_continuation(target, ids, n_new)
            return target, draft_of(target).requires_grad_(False), ids, n_new

        return _pair((seed, key), description, make, k)

    pairs = [
        tiny(1, "the draft is a copy of the target: every proposal is kept", copy.deepcopy, 5, 20, 3),
        tiny(
            2, "a draft that agrees often (the target with noise), k = 4", lambda t: noisy_copy(t, seed, 0.15), 7, 24, 4
        ),
        tiny(
            3, "a one-token prompt, a draft that agrees often, k = 2", lambda t: noisy_copy(t, seed + 1, 0.1), 1, 16, 2
        ),
        tiny(
            4,
            "a draft that disagrees a lot (another random model), k = 6",
            lambda t: decisive_model(seed + 99).requires_grad_(False),
            9,
            20,
            6,
        ),
        tiny(5, "k = 1", lambda t: noisy_copy(t, seed + 2, 0.2), 4, 12, 1),
        tiny(
            6,
            "a prompt of 260 tokens (positions past 255), k = 3",
            lambda t: noisy_copy(t, seed + 3, 0.15),
            260,
            24,
            3,
            n_positions=320,
        ),
        tiny(
            7,
            "token 0 among the new tokens (a real token, as EOS may be), k = 3",
            lambda t: noisy_copy(t, seed + 4, 0.1),
            6,
            16,
            3,
            zero=True,
        ),
    ]
    for i in range(n_random):
        k = rng.randint(1, 6)
        pairs.append(
            tiny(
                10 + i,
                f"random #{i}: k = {k}",
                lambda t, i=i: noisy_copy(t, seed + 10 + i, rng.random() / 4),
                rng.randint(1, 20),
                rng.randint(10, 30),
                k,
            )
        )
    if bundled:

        def make():
            target, draft = bundled_pair()
            return target, draft, get_tokenizer().encode("ROMEO:\nBut soft, what light"), 16

        pairs.append(
            _pair(("bundled",), "the bundled pair (gpt2-shakespeare and its draft), k = 4", make, 4, exact=False)
        )
    zero = next(i for i, p in enumerate(pairs) if p.description.startswith("token 0"))
    pairs.append(dataclasses.replace(pairs[zero], eos_token_id=0))

    def greedy(i):  # the tokens the rounds must make: computed after the learner's calls
        return pairs[i].greedy()

    cases = [Case(p.description, ("loop", i), later(greedy, i)) for i, p in enumerate(pairs[:-1])]
    cases.append(
        Case(
            "llmcourse.generate(target, ids, draft=draft, num_draft_tokens=4) with your round installed",
            ("engine", 1),
            later(greedy, 1),
        )
    )
    cases.append(
        Case(
            "llmcourse.generate(target, ids, draft=draft, num_draft_tokens=3, eos_token_id=0) with your "
            "round installed: generation stops at the first token 0",
            ("engine", len(pairs) - 1),
            later(greedy, len(pairs) - 1),
        )
    )

    def run(kind, i):
        watch = sys.getprofile()
        sys.setprofile(None)  # only the learner's calls are watched (and the check's own model runs go faster)
        try:
            with one_thread(), torch.inference_mode():
                return _run_rounds(fn, pairs[i], watch) if kind == "loop" else _run_engine(fn, pairs[i], watch)
        finally:
            sys.setprofile(watch)

    def show(args):
        pair = pairs[args[1]]
        c, d = pair.target.config, pair.draft.config
        models = (
            f"target {c.n_layer} layers × {c.n_embd}, draft {d.n_layer} layers × {d.n_embd}, vocabulary {c.vocab_size}"
        )
        if args[0] == "engine":
            return (
                f"generate(target, {short(pair.prompt, 60)}, max_new_tokens={pair.max_new_tokens}, draft=draft, "
                f"num_draft_tokens={pair.k}, eos_token_id={pair.eos_token_id}, "
                f"speculation=guarded(Speculation, speculative_round=speculative_round)) ({models})"
            )
        return (
            f"rounds of speculative_round(target, draft, target_cache, draft_cache, tokens, {pair.k}) from the "
            f"prompt {short(pair.prompt, 60)} until {pair.max_new_tokens} new tokens ({models})"
        )

    run_check(
        "speculative_round",
        run,
        cases,
        judge=_round_verdict,
        forbid=[
            NO_ENGINE,
            Forbidden("llmcourse.engine.generate", "generate and stream run the whole loop: write one round yourself"),
        ],
        show_call=show,
        seconds=10,
        total_seconds=40,
    )
