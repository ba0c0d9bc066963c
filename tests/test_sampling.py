"""Logits processors against transformers' own, on random logits with ties, and settings checks."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmcourse.engine.sampling import (
    SamplingParams,
    min_p,
    next_token,
    process_logits,
    repetition_penalty,
    temperature,
    top_k,
    top_p,
)

V = 500


def random_logits(seed: int, rows: int = 8) -> torch.Tensor:
    """Random logits where many values tie: rounded to 0.5, and a block of rows fully equal."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.round(torch.randn(rows, V, generator=g) * 3 * 2) / 2
    logits[0] = 1.0  # all tied
    logits[1, :10] = logits[1].max() + 1  # ten tied maxima
    return logits


def seen_from(ids: torch.Tensor) -> torch.Tensor:
    seen = torch.zeros(ids.shape[0], V, dtype=torch.bool)
    return seen.scatter_(1, ids, True)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor):
    kept_ours, kept_theirs = torch.isfinite(ours), torch.isfinite(theirs)
    assert torch.equal(kept_ours, kept_theirs), f"kept sets differ in {(kept_ours != kept_theirs).sum()} places"
    assert torch.allclose(ours[kept_ours], theirs[kept_theirs], rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 2, 5, 50, V, V + 10])
def test_top_k(seed, k):
    logits = random_logits(seed)
    assert_same(top_k(logits, k), TopKLogitsWarper(k)(None, logits.clone()))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_top_p(seed, p):
    logits = random_logits(seed)
    assert_same(top_p(logits, p), TopPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p(seed, p):
    logits = random_logits(seed)
    assert_same(min_p(logits, p), MinPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("t", [0.3, 1.0, 2.5])
def test_temperature(t):
    logits = random_logits(0)
    assert_same(temperature(logits, t), TemperatureLogitsWarper(t)(None, logits.clone()))


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 3.0])
def test_repetition_penalty(penalty):
    logits = random_logits(1)
    ids = torch.randint(0, V, (8, 30), generator=torch.Generator().manual_seed(2))  # with repeats
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert_same(repetition_penalty(logits, seen_from(ids), penalty), theirs)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        dict(temperature=1.5, top_k=3, top_p=0.5),
        dict(temperature=0.5, top_p=0.8, min_p=0.2),
        dict(temperature=1.0, min_p=0.1, repetition_penalty=0.8),
    ],
)
def test_all_processors_in_transformers_order(settings):
    logits = random_logits(3)
    ids = torch.randint(0, V, (8, 20), generator=torch.Generator().manual_seed(4))
    s = SamplingParams(**settings)
    chain = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    chain.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        chain.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1:
        chain.append(TopPLogitsWarper(s.top_p))
    if s.min_p:
        chain.append(MinPLogitsWarper(s.min_p))
    assert_same(process_logits(logits, s, seen_from(ids)), chain(ids, logits.clone()))


def test_greedy_picks_the_argmax_after_the_repetition_penalty():
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert next_token(logits, SamplingParams()).tolist() == [0]
    assert next_token(logits, greedy, seen=torch.tensor([[True, False, False]])).tolist() == [1]


def test_sampling_is_seeded_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    s = SamplingParams(temperature=1.0)
    draw = lambda seed: [next_token(logits, s, generator=torch.Generator().manual_seed(seed)).item() for _ in range(1)]
    assert draw(1) == draw(1)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(
        torch.cat([next_token(logits.expand(1000, 4), s, generator=g) for _ in range(10)]), minlength=4
    )
    freq = counts / counts.sum()
    assert counts[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.02)
    only_top = SamplingParams(temperature=1.0, top_k=1)
    assert set(next_token(logits.expand(200, 4), only_top, generator=g).tolist()) == {0}


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(temperature=-0.1), r"temperature must be a number >= 0 \(0 = greedy\), got -0.1"),
        (dict(temperature=float("nan")), r"temperature must be a number >= 0"),
        (dict(top_k=-1), r"top_k must be an integer >= 0 \(0 = off\), got -1"),
        (dict(top_k=2.5), r"top_k must be an integer"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
        (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be a number > 0"),
        (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a number > 0"),
    ],
)
def test_impossible_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)
