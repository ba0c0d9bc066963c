"""Checks for chapter 00, the pipeline."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..sampling import top_k_next_tokens
from .core import Case, Forbidden, run_check

NO_TOPK = [
    Forbidden("torch.topk", "Turn the logits into probabilities, then sort the token ids by probability."),
    Forbidden("torch.Tensor.topk", "Turn the logits into probabilities, then sort the token ids by probability."),
]


def _pairs_match(got: Any, expected: list[tuple[int, float]]) -> Optional[str]:
    if not isinstance(got, list):
        return f"expected a list of (token id, probability) pairs, got a {type(got).__name__}"
    if len(got) != len(expected):
        return f"expected {len(expected)} pairs, got {len(got)}"
    for rank, (pair, (token, prob)) in enumerate(zip(got, expected)):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            return f"item {rank} should be a (token id, probability) tuple, got {pair!r}"
        got_token, got_prob = pair
        if not isinstance(got_token, int) or isinstance(got_token, bool):
            return f"item {rank}: the token id should be a Python int (use int(...)), got {type(got_token).__name__}"
        if not isinstance(got_prob, float):
            return f"item {rank}: the probability should be a Python float (use float(...)), got {type(got_prob).__name__}"
        if got_token != token:
            return f"item {rank}: expected token {token}, got {got_token}"
        if not math.isclose(got_prob, prob, rel_tol=1e-4, abs_tol=1e-6):
            return f"item {rank} (token {token}): expected probability {prob:.6f}, got {got_prob:.6f}"
    return None


def _case(description: str, logits: torch.Tensor, k: int, hint: str = "") -> Case:
    return Case(description, (logits, k), top_k_next_tokens(logits, k), hint)


def check_top_k_next_tokens(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """top_k_next_tokens(logits [V], k) -> [(token id, probability), ...], most likely first."""
    cases = [
        _case("a small example", torch.tensor([2.0, 1.0, 0.5, -1.0]), 2),
        _case("k = 1 is the greedy choice", torch.tensor([0.1, 3.0, -2.0]), 1),
        _case("k = vocabulary size lists every token", torch.tensor([0.3, -0.2, 1.5, 0.0]), 4,
              "probabilities come from a softmax over all the logits; they add up to 1"),
        _case("ties list the smaller token id first", torch.tensor([1.0, 2.0, 1.0, 2.0, 0.0]), 3,
              "sort by probability, highest first, breaking ties by token id (a stable sort does it)"),
        _case("large logits (exp overflows if you don't subtract the max)", torch.tensor([1000.0, 999.0, 990.0]), 2,
              "softmax(x) = softmax(x - max(x)): subtracting the max keeps exp() finite"),
        _case("very negative logits", torch.tensor([-1000.0, -1001.0, -1003.0]), 3,
              "softmax(x) = softmax(x - max(x)): subtracting the max keeps exp() from underflowing to 0/0"),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        vocab = 50257 if i % 5 == 0 else int(torch.randint(2, 200, (1,), generator=g))
        k = int(torch.randint(1, min(vocab, 10) + 1, (1,), generator=g))
        logits = torch.randn(vocab, generator=g) * 3
        cases.append(_case(f"random logits #{i} (vocabulary {vocab}, k={k})", logits, k))
    run_check("top_k_next_tokens", fn, cases, compare=_pairs_match, forbid=NO_TOPK)
