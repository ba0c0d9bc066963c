"""Chapter 08's checks: the references pass, stubs and plausible mistakes fail with a message that says what
is wrong, other correct ways of writing each exercise pass, the engine's own functions are refused; and the
check-side machinery (the chi-square tally, the rule's outcome distribution, the round's loop) does what the
checks rely on."""

import functools
import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import llmcourse.checks.speculative as spec_checks
from llmcourse.checks import CheckFailed
from llmcourse.checks.speculative import (
    Draws,
    _accept_verdict,
    accept_cases,
    check_accept_token,
    check_best_k,
    check_expected_speedup,
    check_expected_tokens,
    check_prompt_lookup_draft,
    check_speculative_round,
    check_verify,
    chi2,
    correct_outcomes,
    decisive_model,
    noisy_copy,
)
from llmcourse.course.guards import guarded
from llmcourse.engine import speculative as engine
from llmcourse.engine.speculative import Speculation

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/08_speculative/08_speculative.ipynb"


# -- references, written as a learner would ---------------------------------------------------------


def accept_token(p, q, draft_token, generator=None):
    u = torch.rand((), generator=generator)
    if u * q[draft_token] < p[draft_token]:
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual, 1, generator=generator))


def verify(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def prompt_lookup_draft(tokens, num_draft_tokens, max_ngram=3):
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_draft_tokens]
    return []


def expected_tokens(alpha, k):
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha, k, c):
    return expected_tokens(alpha, k) / (k * c + 1)


def best_k(alpha, c, max_k):
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, c))


def speculative_round(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    n = len(tokens)
    ids = torch.tensor([tokens[draft_cache.length :]])
    proposals = []
    for _ in range(num_draft_tokens):
        logits = draft(ids, cache=draft_cache)
        proposals.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[proposals[-1]]])
    logits = target(torch.tensor([[tokens[-1], *proposals]]), cache=target_cache)[0]  # [k+1, V]
    best = logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == best[accepted]:
        accepted += 1
    target_cache.length = n + accepted
    draft_cache.length = min(draft_cache.length, n + accepted)
    return proposals[:accepted] + [best[accepted]]


REFERENCES = [
    (check_accept_token, accept_token, dict(n_random=4)),
    (check_verify, verify, dict(n_random=10)),
    (check_prompt_lookup_draft, prompt_lookup_draft, dict(n_random=200)),
    (check_expected_tokens, expected_tokens, dict(n_random=40)),
    (check_expected_speedup, expected_speedup, dict(n_random=40)),
    (check_best_k, best_k, dict(n_random=40)),
    (check_speculative_round, speculative_round, dict(n_random=2)),
]
IDS = [check.__name__ for check, _, _ in REFERENCES]


@pytest.mark.parametrize("check, reference, hidden", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, hidden, capsys):
    check(reference)
    check(reference, seed=101, **hidden)
    assert capsys.readouterr().out.count("✓") == 2


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("check", [c for c, _, _ in REFERENCES], ids=IDS)
def test_stub_is_not_written_yet(check):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


def fails(check, fn, pattern, **kwargs):
    with pytest.raises(CheckFailed) as err:
        check(fn, **kwargs)
    assert re.search(pattern, str(err.value), re.S), str(err.value)
    assert "Traceback" not in str(err.value)
    return str(err.value)


# -- accept_token ----------------------------------------------------------------------------------


def accept_inverse_cdf_unnormalised(p, q, draft_token, generator=None):
    """The residual sampled by inverse CDF with u in [0, 1) against an unnormalised cumulative sum."""
    u = torch.rand((), generator=generator)
    if u * q[draft_token] < p[draft_token]:
        return True, draft_token
    cdf = (p - q).clamp(min=0).cumsum(0)
    v = torch.rand((), generator=generator)
    return False, min(int((cdf <= v).sum()), len(p) - 1)


def accept_correction_from_p(p, q, draft_token, generator=None):
    u = torch.rand((), generator=generator)
    if u * q[draft_token] < p[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial(p, 1, generator=generator))


def accept_if_p_at_least_q(p, q, draft_token, generator=None):
    if p[draft_token] >= q[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial((p - q).clamp(min=0), 1, generator=generator))


def accept_with_probability_p(p, q, draft_token, generator=None):
    if torch.rand((), generator=generator) < p[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial((p - q).clamp(min=0), 1, generator=generator))


def accept_inverted(p, q, draft_token, generator=None):
    if torch.rand((), generator=generator) > p[draft_token] / q[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial((p - q).clamp(min=0), 1, generator=generator))


def accept_never(p, q, draft_token, generator=None):
    return False, int(torch.multinomial(p, 1, generator=generator))


def accept_tensor_token(p, q, draft_token, generator=None):
    accepted, token = accept_token(p, q, draft_token, generator)
    return accepted, torch.tensor(token)


def accept_engine(p, q, draft_token, generator=None):
    return engine.accept_token(p, q, draft_token, generator)


def accept_returns_other_token(p, q, draft_token, generator=None):
    accepted, token = accept_token(p, q, draft_token, generator)
    return accepted, (token + 1) % len(p) if accepted else token


ACCEPT_MISTAKES = [
    (
        accept_inverse_cdf_unnormalised,
        r"returned a token that the residual max\(0, p - q\) gives probability 0.*"
        r"token 2 has max\(0, p - q\) = 0.*u · sum",
    ),
    (
        accept_correction_from_p,
        r"returned a token that the residual.*gives probability 0.*residual max\(0, p - q\), "
        r"normalised — not from p",
    ),
    (accept_if_p_at_least_q, r"p\(x\) >= q\(x\), without drawing"),
    (accept_with_probability_p, r"accept with probability p\(x\): the rule is min\(1, p\(x\)/q\(x\)\)"),
    (accept_inverted, r"comparison is inverted"),
    (
        accept_never,
        r"gives probability 0.*expected: tokens distributed as p.*0% of the proposals accepted.*"
        r"you never accept",
    ),
    (accept_tensor_token, r"the token should be an integer \(a Python int\), got tensor.*int\(\.\.\.\) it"),
    (accept_engine, r"llmcourse\.engine\.speculative.*write your own"),
    (accept_returns_other_token, r"accepted the proposal \d+ but returned the token \d+"),
]


@pytest.mark.parametrize("fn, pattern", ACCEPT_MISTAKES, ids=[f.__name__ for f, _ in ACCEPT_MISTAKES])
def test_accept_token_mistakes_are_named(fn, pattern):
    fails(check_accept_token, fn, pattern)


def accept_by_division(p, q, draft_token, generator=None):
    """Correct, written differently: u < p/q (q(x) > 0 for a proposal drawn from q), the residual drawn by
    inverse CDF with u scaled by the sum."""
    if torch.rand(1, generator=generator).item() < float(p[draft_token] / q[draft_token]):
        return True, draft_token
    cdf = (p - q).clamp(min=0).cumsum(0)
    v = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
    return False, int(torch.searchsorted(cdf, v, right=True).clamp(max=len(p) - 1))


def accept_bernoulli_numpy(p, q, draft_token, generator=None):
    """Correct, written differently: a float64 u, numpy for the ratio, multinomial on the
    unnormalised residual in float64; the token a numpy.int64 (any integer type is a token id)."""
    ratio = min(1.0, float(np.float64(p[draft_token]) / np.float64(q[draft_token])))
    if torch.rand(1, generator=generator, dtype=torch.float64).item() < ratio:
        return True, draft_token
    residual = (p.double() - q.double()).clamp(min=0)
    return False, np.int64(torch.multinomial(residual, 1, generator=generator).item())


@pytest.mark.parametrize("fn", [accept_by_division, accept_bernoulli_numpy])
def test_accept_token_alternatives_pass(fn, capsys):
    check_accept_token(fn)
    assert capsys.readouterr().out.count("✓") == 1


def tallies(case, outcomes, seed):
    """What the frequency case would tally from a rule whose (accepted, token) outcomes have the distribution
    `outcomes` [2V]: a multinomial draw of n counts (what n calls of such a rule give, without making them)."""
    n = case.args[3]
    draws = torch.multinomial(outcomes.float(), n, replacement=True, generator=torch.Generator().manual_seed(seed))
    return Draws(n, torch.bincount(draws, minlength=len(outcomes)))


FREQUENCY_CASES = [c for c in accept_cases(0, 2, 1000) + accept_cases(101, 3, 1000) if c.args[0] == "many"]


@pytest.mark.parametrize("seed", [0, 101])
def test_accept_token_check_at_fixed_seeds_passes_a_correct_rule_on_every_draw(seed):
    """The check's decision at its own N = 1000, over 50 draws of the counts a correct rule gives: always a pass
    (the chi-square level is about 1e-6 per case)."""
    for case in FREQUENCY_CASES:
        for draw in range(50):
            p, q = case.args[1], case.args[2]
            assert _accept_verdict(case, tallies(case, correct_outcomes(p, q), 1000 * seed + draw)) is None


def test_accept_token_check_rejects_each_wrong_rule_on_every_draw():
    """...and the counts of each wrong rule (`_accept_mistakes`: accept iff p >= q, with probability p, inverted,
    the correction from p or from q, never accept, the ratio upside down) are rejected, with that rule's hint, in all
    50 draws."""
    for index, hint_start in enumerate(
        [
            "you accept exactly when p(x) >= q(x)",
            "you accept with probability p(x)",
            "the comparison is inverted",
            "after a rejection the token must come from the residual max(0, p - q), normalised — not from p",
            "after a rejection the token must come from the residual max(0, p - q), normalised — not from q",
            "you never accept",
            "the ratio is upside down",
        ]
    ):
        for draw in range(50):
            verdicts = []
            for case in FREQUENCY_CASES:
                wrong = spec_checks._accept_mistakes(case.args[1], case.args[2])[index][0]
                verdict = _accept_verdict(case, tallies(case, wrong, draw))
                if verdict is not None:
                    verdicts.append(verdict)
                    break
            assert verdicts and verdicts[0][1].startswith(hint_start), (index, draw, verdicts)


def test_accept_token_outcome_distribution_is_the_rule():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    outcomes = correct_outcomes(p, q)  # accepted 1 with probability .5; rejected (x = 2) then token 0
    assert outcomes.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]
    assert torch.allclose(outcomes[:3] + outcomes[3:], p.double())
    value, limit = chi2(torch.tensor([0, 500, 0, 500, 0, 0]), outcomes)
    assert value == 0 and limit > 0
    assert chi2(torch.tensor([1, 499, 0, 500, 0, 0]), outcomes)[0] == float("inf")  # an impossible outcome


def test_accept_token_that_raises_or_hangs_gets_a_clear_message(monkeypatch):
    def raises(p, q, draft_token, generator=None):
        return True, p[draft_token + 10]

    def hangs(p, q, draft_token, generator=None):
        while True:
            pass

    fails(check_accept_token, raises, r"raised IndexError.*\n  at line \d+ in raises")
    quick = functools.partial(spec_checks.run_check, seconds=0.5)
    monkeypatch.setattr(spec_checks, "run_check", lambda *a, **k: quick(*a, **{**k, "seconds": 0.5}))
    fails(check_accept_token, hangs, r"did not finish within its [\d.]+ CPU-s")


# -- verify ----------------------------------------------------------------------------------------


def verify_bonus_missing(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    return len(draft_tokens), draft_tokens[-1] if draft_tokens else int(torch.multinomial(p[0], 1))


def verify_bonus_from_last_row(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(p[max(k - 1, 0)], 1, generator=generator))


def verify_counts_rejected(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i + 1, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def verify_does_not_stop(p, q, draft_tokens, generator=None):
    kept, token = 0, None
    for i, x in enumerate(draft_tokens):
        accepted, t = accept_token(p[i], q[i], x, generator)
        if accepted:
            kept += 1
        elif token is None:
            token = t
    if token is None:
        token = int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))
    return kept, token


def verify_bonus_from_q(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(q[k - 1] if k else p[0], 1, generator=generator))


def verify_with_wrong_rule(p, q, draft_tokens, generator=None):
    """Right structure, but the correction comes from p (a wrong accept_token)."""
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_correction_from_p(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def verify_engine(p, q, draft_tokens, generator=None):
    return engine.verify(p, q, draft_tokens, generator)


VERIFY_MISTAKES = [
    (verify_bonus_missing, r"all 3 accepted.*bonus drawn from p\[k\].*not a draft token"),
    (verify_bonus_from_last_row, r"all 3 accepted.*bonus drawn from p\[k\] \(row 3"),
    (verify_counts_rejected, r"expected \(1, 1\), got \(2, 1\).*do not count the rejected one"),
    (verify_does_not_stop, r"expected \(1, 1\), got \(3, 1\).*stop at the first rejection"),
    (verify_bonus_from_q, r"all 3 accepted.*bonus drawn from p\[k\]"),
    (verify_with_wrong_rule, r"the first new token .* is not distributed as the target's p"),
    (verify_engine, r"llmcourse\.engine\.speculative.*write your own"),
]


@pytest.mark.parametrize("fn, pattern", VERIFY_MISTAKES, ids=[f.__name__ for f, _ in VERIFY_MISTAKES])
def test_verify_mistakes_are_named(fn, pattern):
    fails(check_verify, fn, pattern)


def verify_recursive(p, q, draft_tokens, generator=None):
    """Correct, written differently: recursion, and the learner's other correct rule; numpy.int64 results."""
    if not draft_tokens:
        return np.int64(0), np.int64(torch.multinomial(p[0], 1, generator=generator).item())
    accepted, token = accept_by_division(p[0], q[0], draft_tokens[0], generator)
    if not accepted:
        return np.int64(0), np.int64(token)
    n, token = verify_recursive(p[1:], q[1:], draft_tokens[1:], generator)
    return n + 1, token


def test_verify_alternative_passes(capsys):
    check_verify(verify_recursive)
    check_verify(verify_recursive, seed=101, n_random=10)
    assert capsys.readouterr().out.count("✓") == 2


def test_verify_that_calls_an_unwritten_accept_token_says_so():
    def verify_calling_stub(p, q, draft_tokens, generator=None):
        for i, x in enumerate(draft_tokens):
            stub(p[i], q[i], x, generator)
        return 0, 0

    fails(
        check_verify,
        verify_calling_stub,
        r"(accept_token|it calls stub, which is not written yet): write that "
        r"exercise first",
    )


# -- prompt_lookup_draft ---------------------------------------------------------------------------


def lookup_earliest(tokens, num_draft_tokens, max_ngram=3):
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_draft_tokens]
    return []


def lookup_matches_tail_itself(tokens, num_draft_tokens, max_ngram=3):
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_draft_tokens]
    return []


def lookup_no_fallback(tokens, num_draft_tokens, max_ngram=3):
    n = max_ngram
    if len(tokens) <= n:
        return []
    tail = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start : start + n] == tail:
            return tokens[start + n : start + n + num_draft_tokens]
    return []


def lookup_returns_match(tokens, num_draft_tokens, max_ngram=3):
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start : start + min(n, num_draft_tokens)]
    return []


def lookup_too_many(tokens, num_draft_tokens, max_ngram=3):
    return prompt_lookup_draft(tokens, num_draft_tokens + 1, max_ngram)


def lookup_tuple(tokens, num_draft_tokens, max_ngram=3):
    return tuple(prompt_lookup_draft(tokens, num_draft_tokens, max_ngram))


def lookup_engine(tokens, num_draft_tokens, max_ngram=3):
    return engine.prompt_lookup_draft(tokens, num_draft_tokens, max_ngram)


LOOKUP_MISTAKES = [
    (lookup_earliest, r"latest wins.*: expected \[20(, 21)?\], got \[10(, 11)?\].*LATEST earlier occurrence"),
    (lookup_matches_tail_itself, r"expected \[8, 9\], got \[\].*the tail itself is the latest occurrence"),
    (lookup_no_fallback, r"expected \[20, 21\], got \[\].*try shorter n-grams, down to n = 1"),
    (lookup_returns_match, r"occurred at the start.*expected \[8(, 9)?\], got \[.*propose what FOLLOWED the match"),
    (lookup_too_many, r"at most num_draft_tokens = \d"),
    (lookup_tuple, r"expected a list of ints, got \("),
    (lookup_engine, r"llmcourse\.engine\.speculative.*write your own"),
]


@pytest.mark.parametrize("fn, pattern", LOOKUP_MISTAKES, ids=[f.__name__ for f, _ in LOOKUP_MISTAKES])
def test_prompt_lookup_draft_mistakes_are_named(fn, pattern):
    fails(check_prompt_lookup_draft, fn, pattern)


def lookup_by_strings(tokens, num_draft_tokens, max_ngram=3):
    """Correct, written differently: tuples in a dict of the latest start of every n-gram before the tail."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        latest = {tuple(tokens[s : s + n]): s for s in range(len(tokens) - n)}  # later starts overwrite
        start = latest.get(tuple(tokens[-n:]))
        if start is not None:
            return tokens[start + n : start + n + num_draft_tokens]
    return []


def test_prompt_lookup_draft_alternative_passes(capsys):
    check_prompt_lookup_draft(lookup_by_strings)
    check_prompt_lookup_draft(lookup_by_strings, seed=101, n_random=200)
    assert capsys.readouterr().out.count("✓") == 2


# -- expected_tokens -------------------------------------------------------------------------------


def tokens_one_short(alpha, k):
    """α^k for α^(k+1): 1 + α + … + α^(k−1), the k-th proposal left out."""
    return k if alpha == 1 else (1 - alpha**k) / (1 - alpha)


def tokens_accepted_only(alpha, k):
    """The accepted count α + … + α^k, without the target's own token."""
    return k if alpha == 1 else alpha * (1 - alpha**k) / (1 - alpha)


def tokens_untruncated(alpha, k):
    """The infinite series 1/(1 − α)."""
    return k + 1 if alpha == 1 else 1 / (1 - alpha)


def tokens_divide_by_zero(alpha, k):
    """The closed form with no α = 1 case: ZeroDivisionError there."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def tokens_nan_numpy(alpha, k):
    """The closed form in numpy's floats with no α = 1 case: nan there (and a RuntimeWarning)."""
    a = np.float64(alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (1 - a ** (k + 1)) / (1 - a)


def tokens_one_too_many(alpha, k):
    return sum(alpha**i for i in range(k + 2))


def tokens_linear(alpha, k):
    """Each proposal kept with probability α on its own: 1 + k·α."""
    return 1 + k * alpha


def tokens_truncated(alpha, k):
    return int(expected_tokens(alpha, k))


def tokens_k_at_one(alpha, k):
    """The α = 1 case without the bonus token."""
    return k if alpha == 1 else expected_tokens(alpha, k)


def tokens_as_tensor(alpha, k):
    return torch.tensor(float(expected_tokens(alpha, k)), dtype=torch.float64)


def tokens_engine(alpha, k):
    return engine.expected_tokens_per_round(alpha, k)


TOKENS_MISTAKES = [
    (tokens_one_short, r"α = 0\.6, k = 4: expected 2\.3056.*got 2\.176.*one term short.*1 − α\^\(k\+1\)"),
    (tokens_accepted_only, r"expected 2\.3056.*got 1\.305.*the expected number of accepted proposals.*add 1"),
    (tokens_untruncated, r"expected 2\.3056.*got 2\.5.*1/\(1 − α\).*unlimited proposals"),
    (tokens_divide_by_zero, r"alpha=1, k=4\) raised ZeroDivisionError.*α = 1 division by zero.*k \+ 1"),
    (tokens_nan_numpy, r"α = 1 \(an int\).*got np\.float64\(nan\).*nan at α = 1.*k \+ 1"),
    (tokens_one_too_many, r"expected 2\.3056.*got 2\.38.*one term too many"),
    (tokens_linear, r"expected 2\.3056.*got 3\.4.*probability α\^i, not α"),
    (tokens_truncated, r"expected 2\.3056.*got 2\b.*not truncated or rounded"),
    (tokens_k_at_one, r"every proposal is kept.*expected 5, got 4.*k proposals plus the bonus token"),
    (tokens_as_tensor, r"got a tensor.*float\(\.\.\.\)"),
    (tokens_engine, r"llmcourse\.engine\.speculative\.expected_tokens_per_round.*sum the chances yourself"),
]


@pytest.mark.parametrize("fn, pattern", TOKENS_MISTAKES, ids=[f.__name__ for f, _ in TOKENS_MISTAKES])
def test_expected_tokens_mistakes_are_named(fn, pattern):
    fails(check_expected_tokens, fn, pattern)


def tokens_by_loop(alpha, k):
    """Correct, written differently: the sum itself, no α = 1 case (α^0 = 1 for any α)."""
    total = 0
    for i in range(k + 1):
        total += alpha**i
    return total


def tokens_by_horner(alpha, k):
    """Correct: 1 + α(1 + α(1 + …)), from the inside out."""
    t = 1
    for _ in range(k):
        t = 1 + alpha * t
    return t


def tokens_fsum(alpha, k):
    return math.fsum(float(alpha) ** i for i in range(k + 1))


def tokens_numpy(alpha, k):
    """Correct: numpy's float64 (a numpy float returned), the limit taken when α is within 1e-12 of 1."""
    a = np.float64(alpha)
    if np.isclose(a, 1.0, rtol=0, atol=1e-12):
        return np.float64(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def tokens_isclose(alpha, k):
    """Correct: the limit taken when α is close to 1 (math.isclose's default, 1e-9 relative)."""
    return float(k + 1) if math.isclose(alpha, 1) else (1 - alpha ** (k + 1)) / (1 - alpha)


def tokens_exact(alpha, k):
    """Correct: in exact Fractions, whatever the input."""
    a = Fraction(alpha)
    return sum(a**i for i in range(k + 1))


@pytest.mark.parametrize(
    "fn", [tokens_by_loop, tokens_by_horner, tokens_fsum, tokens_numpy, tokens_isclose, tokens_exact]
)
def test_expected_tokens_alternatives_pass(fn, capsys):
    check_expected_tokens(fn)
    check_expected_tokens(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_expected_tokens_equals_the_engine():
    from llmcourse.checks.speculative import exact_tokens

    for alpha in [0, 0.3, 0.57, 0.999999, 1, 1.0, Fraction(3, 5)]:
        for k in [0, 1, 4, 8, 64]:
            assert expected_tokens(alpha, k) == pytest.approx(float(exact_tokens(alpha, k)), rel=1e-9)
            assert engine.expected_tokens_per_round(alpha, k) == pytest.approx(float(exact_tokens(alpha, k)), rel=1e-9)


# -- expected_speedup ------------------------------------------------------------------------------


def speedup_without_the_target(alpha, k, c):
    """The cost k·c: the target's pass left out (ZeroDivisionError at c = 0)."""
    return expected_tokens(alpha, k) / (k * c)


def speedup_without_the_target_guarded(alpha, k, c):
    """The cost k·c, with c = 0 handled as a speed-up of the tokens alone."""
    return expected_tokens(alpha, k) / (k * c) if c else expected_tokens(alpha, k)


def speedup_k1_draft_steps(alpha, k, c):
    return expected_tokens(alpha, k) / ((k + 1) * c + 1)


def speedup_verify_k1_steps(alpha, k, c):
    """The verify pass counted as k + 1 target steps."""
    return expected_tokens(alpha, k) / (k * c + k + 1)


def speedup_not_divided(alpha, k, c):
    return expected_tokens(alpha, k)


def speedup_multiplied(alpha, k, c):
    return expected_tokens(alpha, k) * (k * c + 1)


def speedup_c_inverted(alpha, k, c):
    return expected_tokens(alpha, k) / (k / c + 1) if c else expected_tokens(alpha, k)


def speedup_on_wrong_tokens(alpha, k, c):
    """Right in itself, on an expected_tokens one term short."""
    return tokens_one_short(alpha, k) / (k * c + 1)


def speedup_divides_by_zero(alpha, k, c):
    """The closed form written out, no α = 1 case."""
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def speedup_engine(alpha, k, c):
    return engine.expected_speedup(alpha, k, c)


def speedup_on_the_engines_tokens(alpha, k, c):
    return engine.expected_tokens_per_round(alpha, k) / (k * c + 1)


SPEEDUP_MISTAKES = [
    (speedup_without_the_target, r"expected 1\.6468.*got 5\.76.*leaves out the target's pass"),
    (speedup_without_the_target_guarded, r"expected 1\.6468.*got 5\.76.*leaves out the target's pass"),
    (speedup_k1_draft_steps, r"expected 1\.6468.*got 1\.53706.*counts k \+ 1 draft steps"),
    (speedup_verify_k1_steps, r"expected 1\.6468.*got 0\.42696.*verify pass is counted as k \+ 1.*memory-bound"),
    (speedup_not_divided, r"expected 1\.6468.*got 2\.3056.*not yet the speed-up: divide"),
    (speedup_multiplied, r"expected 1\.6468.*got 3\.2278.*multiplied by the cost"),
    (speedup_c_inverted, r"expected 1\.6468.*got 0\.0562.*not k/c"),
    (speedup_on_wrong_tokens, r"expected 1\.6468.*got 1\.5542.*fix expected_tokens first.*one term short"),
    (speedup_divides_by_zero, r"alpha=1, k=4, c=0\.5\) raised ZeroDivisionError.*α = 1 division by zero"),
    (speedup_engine, r"llmcourse\.engine\.speculative\.expected_speedup.*use your own"),
    (speedup_on_the_engines_tokens, r"llmcourse\.engine\.speculative\.expected_tokens_per_round"),
]


@pytest.mark.parametrize("fn, pattern", SPEEDUP_MISTAKES, ids=[f.__name__ for f, _ in SPEEDUP_MISTAKES])
def test_expected_speedup_mistakes_are_named(fn, pattern):
    fails(check_expected_speedup, fn, pattern)


def speedup_inline_loop(alpha, k, c):
    """Correct, written differently: the sum in a loop, the cost written c·k + 1."""
    return sum(alpha**i for i in range(k + 1)) / (c * k + 1)


def speedup_numpy(alpha, k, c):
    return tokens_numpy(alpha, k) / (np.float64(k) * np.float64(c) + 1)


def speedup_exact(alpha, k, c):
    return tokens_exact(alpha, k) / (k * Fraction(c) + 1)


@pytest.mark.parametrize("fn", [speedup_inline_loop, speedup_numpy, speedup_exact])
def test_expected_speedup_alternatives_pass(fn, capsys):
    check_expected_speedup(fn)
    check_expected_speedup(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_expected_speedup_that_calls_an_unwritten_expected_tokens_says_so():
    def speedup_on_a_stub(alpha, k, c):
        return stub(alpha, k) / (k * c + 1)

    fails(check_expected_speedup, speedup_on_a_stub, r"it calls stub, which is not written yet: write that exercise")


# -- best_k ----------------------------------------------------------------------------------------


def best_k_returns_the_speedup(alpha, c, max_k):
    return max(expected_speedup(alpha, k, c) for k in range(1, max_k + 1))


def best_k_index(alpha, c, max_k):
    speedups = [expected_speedup(alpha, k, c) for k in range(1, max_k + 1)]
    return speedups.index(max(speedups))  # the position, not k


def best_k_largest_on_ties(alpha, c, max_k):
    best = 1
    for k in range(1, max_k + 1):
        if expected_speedup(alpha, k, c) >= expected_speedup(alpha, best, c):
            best = k
    return best


def best_k_ignores_cost(alpha, c, max_k):
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, 0))


def best_k_divides_by_zero(alpha, c, max_k):
    return max(range(1, max_k + 1), key=lambda k: (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)))


def best_k_range_max_k(alpha, c, max_k):
    return max(range(max_k), key=lambda k: expected_speedup(alpha, k, c))  # k = 0 included, max_k not


def best_k_stops_before_max_k(alpha, c, max_k):
    return max(range(1, max(max_k, 2)), key=lambda k: expected_speedup(alpha, k, c))


def best_k_range_empty_at_one(alpha, c, max_k):
    return max(range(1, max_k), key=lambda k: expected_speedup(alpha, k, c))


def best_k_calculus(alpha, c, max_k):
    """The continuous maximiser on a fine grid: a float k."""
    grid = [1 + i * (max_k - 1) / 1000 for i in range(1001)]
    return max(grid, key=lambda x: (1 - alpha ** (x + 1)) / (1 - alpha) / (x * c + 1) if alpha != 1 else 1)


def best_k_float(alpha, c, max_k):
    return float(best_k(alpha, c, max_k))


def best_k_engine(alpha, c, max_k):
    return engine.best_k(alpha, c, max_k)


def over(tokens):
    """expected_speedup written right, on the given expected_tokens."""

    def speedup(alpha, k, c):
        return tokens(alpha, k) / (k * c + 1)

    speedup.__name__ = f"speedup_over_{tokens.__name__}"
    return speedup


def on(speedup):
    """best_k written right, on the given (wrong) expected_speedup."""

    def best_k(alpha, c, max_k):
        return max(range(1, max_k + 1), key=lambda k: speedup(alpha, k, c))

    best_k.__name__ = f"best_k_on_{speedup.__name__}"
    return best_k


def best_k_engines_speedup(alpha, c, max_k):
    """The learner's own expected_speedup is wrong; best_k reaches for the engine's instead."""
    from llmcourse.engine.speculative import expected_speedup as the_engines

    return max(range(1, max_k + 1), key=lambda k: the_engines(alpha, k, c))


BEST_K_MISTAKES = [
    (best_k_returns_the_speedup, r"got 1\.67\d+, the best speed-up itself.*returns the speed-up, not k"),
    (best_k_index, r"expected k = 3 \(1\.6738×\), got k = 2.*argmax off by one: the position"),
    (best_k_largest_on_ties, r"every k gives a speed-up of exactly 1.*got k = 8.*ties broken to the largest k"),
    (best_k_ignores_cost, r"expected k = 3.*got k = 8.*ignoring the cost c"),
    (best_k_divides_by_zero, r"every proposal is kept: .*raised ZeroDivisionError.*α = 1 division by zero"),
    (best_k_range_max_k, r"searching 0\.\.max_k-1"),
    (best_k_stops_before_max_k, r"k = max_k is never tried"),
    (best_k_range_empty_at_one, r"expected k = 4.*got k = 3.*k = max_k is never tried"),
    (best_k_calculus, r"not an integer.*floating-point k \(from calculus"),
    (best_k_float, r"a float; expected the int"),
    (best_k_engine, r"llmcourse\.engine\.speculative\.best_k.*write your own"),
    (best_k_engines_speedup, r"llmcourse\.engine\.speculative\.expected_speedup.*use your own"),
    # best_k written right, on a wrong expected_speedup (its own check fails): the k's it gives are named
    (on(over(tokens_one_short)), r"expected k = 3.*got k = 4.*expected_tokens is one short"),
    (on(over(tokens_accepted_only)), r"got k = 4.*expected_tokens is one short"),
    (on(over(tokens_one_too_many)), r"got k = 2.*counts one proposal too many"),
    (on(over(tokens_linear)), r"got k = 8.*1 \+ k·α tokens per round"),
    (on(speedup_k1_draft_steps), r"bundled pair.*expected k = 1.*got k = 2.*cost of \(k \+ 1\)·c \+ 1"),
    (on(speedup_verify_k1_steps), r"got k = 1.*k = 1 everywhere: your speed-up falls"),
    (on(speedup_without_the_target_guarded), r"got k = 1.*best for a cost of k·c: the target's pass is left out"),
    (on(speedup_not_divided), r"got k = 8.*ignoring the cost c"),
    (on(speedup_without_the_target), r"got k = 1.*division by zero at c = 0.*leaves it out \(k·c\)"),
    (on(over(tokens_untruncated)), r"got k = 1.*best for 1/\(1 − α\) tokens per round"),
]


@pytest.mark.parametrize(
    "fn, pattern", BEST_K_MISTAKES, ids=[f"{i}-{f.__name__}" for i, (f, _) in enumerate(BEST_K_MISTAKES)]
)
def test_best_k_mistakes_are_named(fn, pattern):
    fails(check_best_k, fn, pattern)


def test_best_k_is_checked_inside_the_engine():
    """Right on every number the check tries, wrong when the engine calls it: the engine case catches it."""
    calls = []

    def engine_only_wrong(alpha, c, max_k):
        calls.append(alpha)
        if isinstance(alpha, float) and max_k == engine.AUTO_MAX_K and 0.5 < alpha < 0.8 and c == 1.0:
            return max_k
        return best_k(alpha, c, max_k)

    fails(check_best_k, engine_only_wrong, r"num_draft_tokens='auto'.*your best_k chose k = 8; expected k = 1")


def test_best_k_that_calls_an_unwritten_expected_speedup_says_so():
    def best_k_on_a_stub(alpha, c, max_k):
        return max(range(1, max_k + 1), key=lambda k: stub(alpha, k, c))

    fails(check_best_k, best_k_on_a_stub, r"it calls stub, which is not written yet: write that exercise")


def best_k_early_stop(alpha, c, max_k):
    """Correct, written differently: climb while the next k pays (the speed-up has a single peak in k)."""
    k = 1
    while k < max_k and expected_speedup(alpha, k + 1, c) > expected_speedup(alpha, k, c):
        k += 1
    return k


def best_k_by_sum(alpha, c, max_k):
    """Correct, written differently: the sum 1 + α + … + α^k (no α = 1 case), ties kept by a strict >."""
    best, best_speedup = None, None
    for k in range(1, max_k + 1):
        speedup = sum(alpha**i for i in range(k + 1)) / (1 + k * c)
        if best is None or speedup > best_speedup:
            best, best_speedup = k, speedup
    return np.int64(best)  # numpy's integers are integers too


@pytest.mark.parametrize(
    "fn",
    [
        best_k_early_stop,
        best_k_by_sum,
        on(speedup_inline_loop),
        on(speedup_numpy),
        on(speedup_exact),
        on(over(tokens_by_horner)),
        on(over(tokens_fsum)),
        on(over(tokens_isclose)),
    ],
    ids=lambda f: f.__name__,
)
def test_best_k_alternatives_pass(fn, capsys):
    check_best_k(fn)
    check_best_k(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_best_k_sweep_points_are_clear_or_exact_ties_every_float_way():
    """Every point of the sweep has one best k beyond rounding, or an exact tie that each way of computing the
    speed-up in floats (closed form, loop, Horner, math.fsum, numpy, the arguments made floats first) keeps a tie:
    a correct best_k in floats gives the smallest k of the tie on every point."""
    from llmcourse.checks.speculative import _sweep_points, clear_best, exact_best_k, exact_speedup

    ways = [
        expected_speedup,
        speedup_inline_loop,
        speedup_numpy,
        over(tokens_by_horner),
        over(tokens_fsum),
    ]
    ways += [lambda a, k, c, f=f: f(float(a), k, float(c)) for f in ways]
    for description, alpha, c, max_k, _ in _sweep_points():
        want = exact_best_k(alpha, c, max_k)
        if not clear_best(alpha, c, max_k):
            assert any(exact_speedup(alpha, k, c) == exact_speedup(alpha, want, c) for k in range(want + 1, max_k + 1))
        for way in ways:
            assert max(range(1, max_k + 1), key=lambda k: way(alpha, k, c)) == want, description


def test_best_k_matches_the_engine_and_the_limits():
    assert engine.best_k(0.0, 0.1, 8) == 1  # α = 0: each proposal only costs
    assert engine.best_k(0.0, 0.0, 8) == 1  # every k ties: the smallest
    assert engine.best_k(1.0, 0.5, 8) == 8 and engine.best_k(1.0, 1.0, 8) == 1 and engine.best_k(1, 2, 8) == 1
    assert engine.best_k(0.6, 0.1, 8) == 3 and engine.best_k(0.6, 0.1, 2) == 2
    assert engine.expected_speedup(1 - 1e-9, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("c", [0.0, 0.01, 0.1, 0.5, 2.0])
def test_the_expected_speedup_has_a_single_peak_in_k(alpha, c):
    """What lets best_k stop at the first k that does not pay: it rises, then falls."""
    values = [engine.expected_speedup(alpha, k, c) for k in range(1, 65)]
    peak = values.index(max(values))
    assert all(a <= b for a, b in zip(values[:peak], values[1 : peak + 1]))
    assert all(a >= b for a, b in zip(values[peak:], values[peak + 1 :]))


# -- speculative_round -----------------------------------------------------------------------------


def round_with(
    *,
    target_off=0,
    draft_rollback=True,
    feed_last=True,
    one_pass=True,
    next_token=True,
    feed_only_last_to_draft=False,
    draft_unconditional=False,
):
    """speculative_round with one plausible mistake switched on."""

    def round_(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
        n = len(tokens)
        ids = torch.tensor([[tokens[-1]]] if feed_only_last_to_draft else [tokens[draft_cache.length :]])
        proposals = []
        for _ in range(num_draft_tokens):
            logits = draft(ids, cache=draft_cache)
            proposals.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[proposals[-1]]])
        fed = [tokens[-1], *proposals] if feed_last else proposals or [tokens[-1]]
        if one_pass:
            best = target(torch.tensor([fed]), cache=target_cache)[0].argmax(-1).tolist()
        else:
            best = [int(target(torch.tensor([[t]]), cache=target_cache)[0, -1].argmax()) for t in fed]
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == best[accepted]:
            accepted += 1
        target_cache.length = n + accepted + target_off
        if draft_unconditional:
            draft_cache.length = n + accepted
        elif draft_rollback:
            draft_cache.length = min(draft_cache.length, n + accepted)
        return proposals[:accepted] + ([best[accepted]] if next_token else [])

    return round_


def round_engine(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    return engine.speculative_round(target, draft, target_cache, draft_cache, tokens, num_draft_tokens)


def round_via_generate(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    from llmcourse import generate

    out = generate(target, tokens, max_new_tokens=1, eos_token_id=None)
    target_cache.length = len(tokens)
    return out


ROUND_MISTAKES = [
    (round_with(target_off=-1), r"target_cache\.length = \d+.*1 position too few.*roll back"),
    (round_with(target_off=+1), r"target_cache\.length = \d+.*1 position too many"),
    (round_with(draft_rollback=False), r"draft_cache\.length = \d+, beyond.*stale keys poison"),
    (round_with(feed_last=False), r"plain greedy decoding continues with.*feed the target \[tokens\[-1\], d1"),
    (round_with(one_pass=False), r"called the target \d times in one round.*ONE forward pass"),
    (round_with(next_token=False), r"returned \d tokens.*(1 to|the next token)"),
    (
        round_with(feed_only_last_to_draft=True),
        r"kept \d proposals; the draft's greedy continuation.*"
        r"tokens\[draft_cache\.length:\]",
    ),
    (round_engine, r"llmcourse\.engine\.speculative.*write your own"),
    (round_via_generate, r"llmcourse\.engine\.generate.*write one round yourself"),
]


@pytest.mark.parametrize(
    "fn, pattern",
    ROUND_MISTAKES,
    ids=[
        "target_one_short",
        "target_one_long",
        "no_draft_rollback",
        "no_last_token",
        "one_pass_per_proposal",
        "no_next_token",
        "draft_fed_last_only",
        "engine",
        "generate",
    ],
)
def test_speculative_round_mistakes_are_named(fn, pattern):
    fails(check_speculative_round, fn, pattern)


def round_with_tensors(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    """Correct, written differently: the draft's proposals as a tensor, the kept count with cumprod, the draft's
    cache rolled back before it runs next instead of after (it is at most len(tokens) - 1 here); numpy.int64 ids."""
    n = len(tokens)
    drafted = torch.empty(0, dtype=torch.long)
    ids = torch.tensor(tokens[draft_cache.length :])[None]
    for _ in range(num_draft_tokens):
        nxt = draft(ids, cache=draft_cache, last_only=True)[0, -1].argmax()[None]
        drafted = torch.cat([drafted, nxt])
        ids = nxt[None]
    fed = torch.cat([torch.tensor(tokens[-1:]), drafted])[None]  # [1, k+1]
    best = target(fed, cache=target_cache)[0].argmax(-1)  # [k+1]
    accepted = int((drafted == best[:-1]).long().cumprod(0).sum())
    target_cache.length = n + accepted
    if draft_cache.length > n + accepted:
        draft_cache.length = n + accepted
    return list(drafted[:accepted].numpy()) + [np.int64(best[accepted])]


def test_speculative_round_alternative_passes(capsys):
    check_speculative_round(round_with_tensors)
    assert capsys.readouterr().out.count("✓") == 1


def test_speculative_round_expected_tokens_are_out_of_reach():
    """Plain greedy decoding's tokens are computed after each round returned: no pair holds them, and the check's own
    greedy helper is refused."""
    import dataclasses

    from llmcourse.checks import speculative as checks

    assert "expected" not in {f.name for f in dataclasses.fields(checks.Pair)}

    def round_from_the_check(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
        target_cache.length = len(tokens)
        return checks._greedy(target, tokens, 1)

    fails(check_speculative_round, round_from_the_check, r"llmcourse\.checks")


def test_speculative_round_that_raises_gets_a_clear_message():
    def raises(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
        return [int(draft(torch.tensor([tokens]))[0, -1].argmax())][num_draft_tokens]

    fails(check_speculative_round, raises, r"raised IndexError.*at line \d+ in raises")


def test_speculative_round_in_the_engine_equals_plain_greedy():
    """The check's tiny pairs: the engine with the reference round (`speculation=guarded(Speculation, ...)`) gives
    plain greedy's tokens, and so does the engine's own round; the noisy drafts keep some proposals and reject
    others."""
    from llmcourse import generate

    torch.set_num_threads(1)
    target = decisive_model(3).requires_grad_(False)
    for draft in (noisy_copy(target, 0, 0.15), decisive_model(99)):
        plain = generate(target, [5, 6, 7], max_new_tokens=20, eos_token_id=None)
        for k in (1, 6):
            stats = engine.SpeculationStats()
            assert (
                generate(
                    target,
                    [5, 6, 7],
                    max_new_tokens=20,
                    eos_token_id=None,
                    draft=draft,
                    num_draft_tokens=k,
                    stats=stats,
                )
                == plain
            )
            assert (
                generate(
                    target,
                    [5, 6, 7],
                    max_new_tokens=20,
                    eos_token_id=None,
                    draft=draft,
                    num_draft_tokens=k,
                    speculation=guarded(Speculation, speculative_round=speculative_round),
                )
                == plain
            )


def test_reference_accept_token_against_the_engine_on_one_hot_and_torch():
    """Independent references: one-hot p and q make the rule greedy; the engine's rule equals the reference's
    draw for draw with the same generator (both draw u first, then the residual)."""
    V = 7
    for target, proposal in [(3, 3), (3, 5)]:
        p, q = F.one_hot(torch.tensor(target), V).float(), F.one_hot(torch.tensor(proposal), V).float()
        assert accept_token(p, q, proposal) == (target == proposal, target)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    p, q = torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.5, 0.2, 0.3])
    for x in [0, 0, 1, 2, 0, 2, 0, 0]:
        assert accept_token(p, q, x, g1) == engine.accept_token(p, q, x, g2)


# -- issue 22: kinds of hole (randomness contract, joint draws, engine calls, sizes, special ids) -------------


def accept_global_rng(p, q, draft_token, generator=None):
    """Draws from torch's global generator although it is given one (generate(seed=...) would not repeat)."""
    if torch.rand(()) * q[draft_token] < p[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial((p - q).clamp(min=0), 1))


def accept_copied_generator(p, q, draft_token, generator=None):
    """Draws from a copy of the generator's state: the caller's generator never advances."""
    g = torch.Generator()
    if generator is not None:
        g.set_state(generator.get_state())
    return accept_token(p, q, draft_token, g)


def accept_uint8_token(p, q, draft_token, generator=None):
    """Keeps the token in a uint8 tensor: ids past 255 wrap."""
    accepted, token = accept_token(p, q, draft_token, generator)
    return accepted, int(torch.tensor(token).to(torch.uint8))


def verify_one_u(p, q, draft_tokens, generator=None):
    """One uniform for the whole round (0.5 vs 0.25 for both kept in the check's joint case)."""
    u = torch.rand((), generator=generator)
    for i, x in enumerate(draft_tokens):
        if not u * q[i, x] < p[i, x]:
            return i, int(torch.multinomial((p[i] - q[i]).clamp(min=0), 1, generator=generator))
    return len(draft_tokens), int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))


def verify_fresh_generator(p, q, draft_tokens, generator=None):
    """A fresh torch.Generator() when given none: every unseeded call repeats the same draws."""
    return verify(p, q, draft_tokens, generator if generator is not None else torch.Generator())


def verify_drops_generator(p, q, draft_tokens, generator=None):
    return verify(p, q, draft_tokens, None)


def lookup_default_2(tokens, num_draft_tokens, max_ngram=2):
    return prompt_lookup_draft(tokens, num_draft_tokens, max_ngram)


_CACHE = {}


def lookup_cached_on_text(tokens, num_draft_tokens, max_ngram=3):
    """Caches its answer by the text alone (not num_draft_tokens)."""
    key = tuple(tokens)
    if key not in _CACHE:
        _CACHE[key] = prompt_lookup_draft(tokens, num_draft_tokens, max_ngram)
    return _CACHE[key]


def lookup_window_32(tokens, num_draft_tokens, max_ngram=3):
    """Searches only the last 32 tokens (fine on short texts)."""
    return prompt_lookup_draft(tokens[-32:], num_draft_tokens, max_ngram)


def lookup_zero_is_none(tokens, num_draft_tokens, max_ngram=3):
    """Stops copying at a token 0, taken for 'nothing'."""
    out = prompt_lookup_draft(tokens, num_draft_tokens, max_ngram)
    return out[: out.index(0)] if 0 in out else out


def round_crop_256(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    """The text cropped to a fixed 256-token window (nanoGPT's `idx[:, -block_size:]`): the caches hold the whole
    text, so past 256 tokens the positions no longer match."""
    return speculative_round(target, draft, target_cache, draft_cache, tokens[-256:], num_draft_tokens)


def round_zero_is_no_proposal(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    """Takes a proposal 0 for 'no proposal' and stops keeping proposals there (the tokens stay right)."""
    n = len(tokens)
    ids = torch.tensor([tokens[draft_cache.length :]])
    proposals = []
    for _ in range(num_draft_tokens):
        proposals.append(int(draft(ids, cache=draft_cache)[0, -1].argmax()))
        ids = torch.tensor([[proposals[-1]]])
    best = target(torch.tensor([[tokens[-1], *proposals]]), cache=target_cache)[0].argmax(-1).tolist()
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] and proposals[accepted] == best[accepted]:
        accepted += 1
    target_cache.length = n + accepted
    draft_cache.length = min(draft_cache.length, n + accepted)
    return proposals[:accepted] + [best[accepted]]


ISSUE22_MISTAKES = [
    (check_speculative_round, round_crop_256, r"a prompt of 260 tokens \(positions past 255\).*target_cache\.length"),
    (
        check_speculative_round,
        round_zero_is_no_proposal,
        r"token 0 among the new tokens.*kept \d proposals; the draft's greedy continuation",
    ),
    (check_accept_token, accept_global_rng, r"randomness: the call used or changed torch's global generator"),
    (check_accept_token, accept_copied_generator, r"randomness: the generator's state did not change"),
    (check_accept_token, accept_uint8_token, r"V = 300.*accepted the proposal 299 but returned the token 43"),
    (check_verify, verify_one_u, r"kept with probability 1/2 each.*num_accepted was 0, 1, 2.*draw a new u at each"),
    (check_verify, verify_fresh_generator, r"randomness: 8 calls with generator=None gave the same result"),
    (check_verify, verify_drops_generator, r"randomness: the call used or changed torch's global generator"),
    (check_prompt_lookup_draft, lookup_default_2, r"without max_ngram: its default must be 3"),
    (check_prompt_lookup_draft, lookup_cached_on_text, r"a long text.*keyed on part of them"),
    (check_prompt_lookup_draft, lookup_window_32, r"a long text: \d+ tokens"),
    (check_prompt_lookup_draft, lookup_zero_is_none, r"token 0.*0 is a token like any other"),
    (
        check_speculative_round,
        round_with(draft_unconditional=True),
        r"draft's cache never held more than.*only ever shorten the draft's cache",
    ),
]


@pytest.mark.parametrize(
    "check, fn, pattern",
    ISSUE22_MISTAKES,
    ids=[f.__name__ if hasattr(f, "__name__") else str(i) for i, (_, f, _) in enumerate(ISSUE22_MISTAKES)],
)
def test_issue22_kinds_are_rejected_and_named(check, fn, pattern):
    _CACHE.clear()
    fails(check, fn, pattern)


def lookup_reversed_search(tokens, num_draft_tokens, max_ngram=3):
    """Correct, written differently: the text reversed, str.find-like search with numpy arrays; numpy.int64 ids."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0 .. len - n - 1
        hits = np.nonzero((windows == tail).all(axis=1))[0]
        if len(hits):
            start = int(hits[-1])
            return list(arr[start + n : start + n + num_draft_tokens])
    return []


def test_prompt_lookup_draft_numpy_alternative_passes(capsys):
    check_prompt_lookup_draft(lookup_reversed_search)
    check_prompt_lookup_draft(lookup_reversed_search, seed=101, n_random=200)
    assert capsys.readouterr().out.count("✓") == 2


def test_verify_alternative_with_float64_draws_passes(capsys):
    check_verify(verify_recursive, seed=7)
    check_accept_token(accept_bernoulli_numpy, seed=7)
    assert capsys.readouterr().out.count("✓") == 2


# -- in the engine: each slot's check ends by generating with it installed as my_engine installs it ----------


def accept_one_hot_shortcut(p, q, draft_token, generator=None):
    """Right on every case; in the engine's greedy rounds over GPT-2's vocabulary (q one-hot) it keeps every
    proposal."""
    if len(q) > 50000 and q[draft_token] == 1:
        return True, draft_token
    return accept_token(p, q, draft_token, generator)


def verify_engine_k3(p, q, draft_tokens, generator=None):
    """Right on every case; with the engine's 3 proposals over GPT-2's vocabulary it keeps them all."""
    if p.shape[-1] > 50000 and len(draft_tokens) == 3:
        return 3, int(p[3].argmax())
    return verify(p, q, draft_tokens, generator)


def lookup_engine_only(tokens, num_draft_tokens, max_ngram=3):
    """Right on every case; proposes nothing on the engine's calls (the bundled prompt, 3 proposals a round)."""
    if tokens[0] == 49 and num_draft_tokens == 3:
        return []
    return prompt_lookup_draft(tokens, num_draft_tokens, max_ngram)


IN_ENGINE_ONLY = [
    (
        check_accept_token,
        accept_one_hot_shortcut,
        r"in the engine, greedy, the bundled draft.*with your accept_token in the engine, the engine stopped it: part "
        r"'accept_token' \(accept_one_hot_shortcut\) returned token \d+, which the target's distribution p gives "
        r"probability 0.*speculation=guarded\(Speculation, accept_token=accept_token\).*passes the cases above but not "
        r"the "
        r"engine's own calls",
    ),
    (
        check_verify,
        verify_engine_k3,
        r"in the engine, greedy.*with your verify in the engine, the engine stopped it: part 'verify'.*probability 0",
    ),
    (
        check_prompt_lookup_draft,
        lookup_engine_only,
        r"in the engine, greedy, prompt lookup.*its call 1 of \d+ \(with your prompt_lookup_draft in the engine\): "
        r"expected \[\d+, \d+, \d+\], got \[\].*the engine's call, without max_ngram.*before every round the "
        r"engine calls",
    ),
]


@pytest.mark.parametrize("check, fn, pattern", IN_ENGINE_ONLY, ids=[f.__name__ for _, f, _ in IN_ENGINE_ONLY])
def test_a_slot_wrong_only_in_the_engine_is_rejected(check, fn, pattern):
    fails(check, fn, pattern)


def test_the_engine_runs_its_own_speculation_after_a_check(capsys):
    """The check gives the learner's function to generate (`speculation=`): nothing of it stays on the bundled model."""
    from llmcourse.checks.harness.bundled import bundled_model
    from llmcourse.checks.speculative import _engine_own

    check_accept_token(accept_token)
    assert not hasattr(bundled_model(), "speculation") and not bundled_model().parts.overridden()
    assert _engine_own("draft") == _engine_own("lookup")  # greedy with either draft is plain greedy decoding


# -- issue 41: inputs changed in place, exact Fraction ties, the inverted ratio named as such ---------------


def accept_ratio_upside_down(p, q, draft_token, generator=None):
    """min(1, q(x)/p(x)) instead of min(1, p(x)/q(x))."""
    ratio = q[draft_token] / p[draft_token] if p[draft_token] > 0 else torch.tensor(float("inf"))
    if torch.rand((), generator=generator) < ratio.clamp(max=1):
        return True, draft_token
    return False, int(torch.multinomial((p - q).clamp(min=0), 1, generator=generator))


def verify_ratio_upside_down(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_ratio_upside_down(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def accept_residual_in_place(p, q, draft_token, generator=None):
    """The residual computed in the caller's p (p.sub_(q)): the engine's next position reads a changed row."""
    if torch.rand((), generator=generator) * q[draft_token] < p[draft_token]:
        return True, draft_token
    return False, int(torch.multinomial(p.sub_(q).clamp_(min=0), 1, generator=generator))


def verify_appends_the_bonus(p, q, draft_tokens, generator=None):
    """Appends the token that comes next to the caller's list of proposals."""
    for i, x in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], x, generator)
        if not accepted:
            return i, token
    k = len(draft_tokens)
    draft_tokens.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return k, draft_tokens[-1]


def verify_normalises_in_the_engine(p, q, draft_tokens, generator=None):
    """Right on every case, but on the engine's GPT-2 rows it renormalises p in place (p /= p.sum(-1))."""
    if p.shape[-1] > 50000:
        p /= p.sum(-1, keepdim=True)
    return verify(p, q, draft_tokens, generator)


def lookup_reverses_the_text(tokens, num_draft_tokens, max_ngram=3):
    """Searches from the end by reversing the caller's list (list.reverse() works in place)."""
    tokens.reverse()
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        head = tokens[:n]
        for start in range(1, len(tokens) - n + 1):
            if tokens[start : start + n] == head:
                return tokens[max(start - num_draft_tokens, 0) : start][::-1]
    return []


def round_appends_the_kept_proposals(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    """Adds the kept proposals to the caller's `tokens` as it goes (tokens += ...)."""
    n = len(tokens)
    out = speculative_round(target, draft, target_cache, draft_cache, tokens, num_draft_tokens)
    tokens += out[:-1]
    assert len(tokens) >= n
    return out


def best_k_climbs_through_ties(alpha, c, max_k):
    """The speed-up's single peak climbed with >=: it walks through a tie to the larger k (α = 0 and 1, where every
    k ties or the peak is an end, are answered in closed form)."""
    if alpha == 0:
        return 1
    if alpha == 1:
        return max_k if c < 1 else 1
    k = 1
    while k < max_k and expected_speedup(alpha, k + 1, c) >= expected_speedup(alpha, k, c):
        k += 1
    return k


ISSUE41_MISTAKES = [
    (
        check_accept_token,
        accept_ratio_upside_down,
        r"not distributed as p.*and \d+\.\d% of the proposals were accepted, where min\(1, p\(x\)/q\(x\)\) accepts "
        r".*hint: the ratio is upside down",
    ),
    (check_verify, verify_ratio_upside_down, r"got \(3, 0\).*every proposal was kept.*the ratio is upside down"),
    (check_accept_token, accept_residual_in_place, r"changed its input `p`.*in-place operation"),
    (check_verify, verify_appends_the_bonus, r"changed its input `draft_tokens`.*after the call:  \[0, 1, \d\]"),
    (
        check_verify,
        verify_normalises_in_the_engine,
        r"in the engine, .*with your verify in the engine, a call changed its input `p`.*in-place operation",
    ),
    (check_prompt_lookup_draft, lookup_reverses_the_text, r"changed its input `tokens`.*build a new list"),
    (
        check_speculative_round,
        round_appends_the_kept_proposals,
        r"round \d+ .*changed its input `tokens` \(the text so far\).*the caller adds the tokens your round returns",
    ),
    (
        check_best_k,
        best_k_climbs_through_ties,
        r"an exact tie between k = 2 and k = 3.*expected k = 2 \(1\.5000×\), got k = 3.*ties broken to the largest k",
    ),
]


@pytest.mark.parametrize("check, fn, pattern", ISSUE41_MISTAKES, ids=[f.__name__ for _, f, _ in ISSUE41_MISTAKES])
def test_issue41_kinds_are_rejected_and_named(check, fn, pattern):
    message = fails(check, fn, pattern)
    assert "randomness" not in message


def accept_residual_in_a_copy(p, q, draft_token, generator=None):
    """Correct, written differently: the residual made in place, in a copy of p."""
    if torch.rand((), generator=generator) * q[draft_token] < p[draft_token]:
        return True, draft_token
    residual = p.clone()
    residual.sub_(q).clamp_(min=0)
    return False, int(torch.multinomial(residual, 1, generator=generator))


def round_on_a_copy_of_the_text(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
    """Correct, written differently: grows its own copy of the text with each proposal."""
    text, n = list(tokens), len(tokens)
    for _ in range(num_draft_tokens):
        logits = draft(torch.tensor([text[draft_cache.length :]]), cache=draft_cache)
        text.append(int(logits[0, -1].argmax()))
    proposals = text[n:]
    draft_cache.length = min(draft_cache.length, len(text) - 1)
    best = target(torch.tensor([text[n - 1 :]]), cache=target_cache)[0].argmax(-1).tolist()
    accepted = next((i for i, (a, b) in enumerate(zip(proposals, best)) if a != b), len(proposals))
    target_cache.length = n + accepted
    draft_cache.length = min(draft_cache.length, n + accepted)
    return proposals[:accepted] + [best[accepted]]


def best_k_in_floats(alpha, c, max_k):
    """Correct, written differently: the arguments converted to floats (an exact tie given in Fractions stays one)."""
    alpha, c = float(alpha), float(c)
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, c))


def best_k_numpy(alpha, c, max_k):
    """Correct, written differently: every k at once in numpy; argmax keeps the first of equal values."""
    a, cost, ks = np.float64(alpha), np.float64(c), np.arange(1, max_k + 1)
    tokens = ks + 1.0 if a == 1 else (1 - a ** (ks + 1)) / (1 - a)
    return int(ks[np.argmax(tokens / (ks * cost + 1))])


ISSUE41_ALTERNATIVES = [
    (check_accept_token, accept_residual_in_a_copy),
    (check_speculative_round, round_on_a_copy_of_the_text),
    (check_best_k, best_k_in_floats),
    (check_best_k, best_k_numpy),
    (check_best_k, best_k_by_sum),  # exact in Fractions
]


@pytest.mark.parametrize("check, fn", ISSUE41_ALTERNATIVES, ids=[f.__name__ for _, f in ISSUE41_ALTERNATIVES])
def test_issue41_alternatives_pass(check, fn, capsys):
    check(fn)
    assert capsys.readouterr().out.count("✓") == 1


def test_best_k_exact_ties_are_ties():
    """The tie cases are exact in Fractions, and the floats they become round to the same tie."""
    from llmcourse.checks.speculative import exact_speedup

    ties = [(Fraction(1, 2), Fraction(1, 12), (2, 3)), (0.5, Fraction(1, 27), (3, 4)), (0.75, Fraction(9, 19), (1, 2))]
    for alpha, c, (k1, k2) in ties:
        assert exact_speedup(alpha, k1, c) == exact_speedup(alpha, k2, c)
        in_floats = [engine.expected_speedup(float(alpha), k, float(c)) for k in (k1, k2)]
        assert in_floats[0] == in_floats[1]
        assert engine.best_k(alpha, c, 8) == k1


def test_verify_draws_watch_the_proposals_list():
    """The frequency case's own calls (outside run_check) see a verify that changes the list it is given."""
    p = torch.stack([torch.tensor([0.5, 0.3, 0.2])] * 3)
    q = torch.stack([torch.tensor([0.2, 0.3, 0.5])] * 2)
    draws = spec_checks._draw_verifies(verify_appends_the_bonus, p, q, 50, 0)
    assert draws.bad is not None and "changed its input `draft_tokens`" in draws.problem, draws.problem
    assert "build a new list" in draws.hint
    assert spec_checks._draw_verifies(verify, p, q, 50, 0).bad is None
