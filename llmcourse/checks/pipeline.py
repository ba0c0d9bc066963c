"""Checks for chapter 00, the pipeline."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from llmcourse.engine.sampling import top_k_next_tokens

from .harness.core import Case, run_check
from .harness.forbid import Forbidden

SORT_YOURSELF = "Turn the logits into probabilities, then sort the token ids by probability."
NO_TOPK = [
    Forbidden("torch.topk", SORT_YOURSELF),  # every route: torch.topk, Tensor.topk, torch.ops.aten.topk, ...
    Forbidden("llmcourse.engine.sampling.top_k_next_tokens", "Write your own."),
    Forbidden("llmcourse.engine.sampling.top_k", SORT_YOURSELF),
    Forbidden("transformers", SORT_YOURSELF),
]


def _rel_tol(dtype: torch.dtype) -> float:
    """The accuracy asked of a probability: float32's (1e-4 relative) for float32 and float64 logits; for float16
    and bfloat16 ones, 2 units in the last place of that dtype, so that a softmax computed in the logits' own dtype
    passes as well as one computed in float32."""
    return 2 * torch.finfo(dtype).eps if dtype in (torch.float16, torch.bfloat16) else 1e-4


def _pairs_match(got: Any, expected: list[tuple[int, float]], rel_tol: float = 1e-4) -> Optional[str]:
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
            return (
                f"item {rank}: the probability should be a Python float (use float(...)), got {type(got_prob).__name__}"
            )
        if got_token != token:
            return f"item {rank}: expected token {token}, got {got_token}"
        if not math.isclose(got_prob, prob, rel_tol=rel_tol, abs_tol=1e-6):
            return f"item {rank} (token {token}): expected probability {prob:.6f}, got {got_prob:.6f}"
    return None


def _judge(case: Case, got: Any) -> Optional[tuple[str, str]]:
    """`_pairs_match` at the accuracy of the case's logits."""
    problem = _pairs_match(got, case.expected, _rel_tol(case.args[0].dtype))
    if problem is None:
        return None
    too_many = isinstance(got, list) and len(got) > len(case.expected)
    return problem, "return exactly k pairs, even when more tokens tie at the k-th place" if too_many else ""


def _case(description: str, logits: torch.Tensor, k: int, hint: str = "") -> Case:
    return Case(description, (logits, k), top_k_next_tokens(logits, k), hint)


def _unambiguous(logits: torch.Tensor, k: int, expected: list[tuple[int, float]]) -> bool:
    """True if every correct implementation must give `expected`'s tokens: they are the exact order
    (by logit, then by id), and no two of the first k + 1 logits are so close (without being equal),
    or so improbable, that rounding in float32 could reorder them."""
    values, order = torch.sort(logits.double(), descending=True, stable=True)  # stable: ties by id
    x = dict(zip(order[: k + 1].tolist(), values[: k + 1].tolist()))
    order = list(x)
    if [token for token, _ in expected] != order[:k]:
        return False
    top = x[order[0]]
    if any(x[i] != -math.inf and top - x[i] > 60 for i in order[:k]):  # exp() of that underflows in float32
        return False
    return all(not 0 < x[a] - x[b] < 1e-3 for a, b in zip(order[: k + 1], order[1 : k + 1]))


def _random_logits(g: torch.Generator, i: int) -> tuple[str, torch.Tensor, int]:
    """Logits of several shapes: GPT-2's vocabulary, far from their mean, with many ties, far from 0,
    in float64 and with masked (-inf) tokens; k from 1 to the whole vocabulary."""

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    kind = i % 5
    # GPT-2's whole vocabulary once (a correct sorted() with a tensor per comparison takes half a minute of CPU
    # under the check's watch there), vocabularies of thousands in the other cases of this kind
    vocab = (50257 if i == 0 else randint(1000, 8000)) if kind == 0 else randint(2, 300)
    k = randint(1, min(vocab, 12)) if randint(0, 3) or vocab > 300 else randint(1, vocab)
    if kind == 0:
        what = "GPT-2's vocabulary" if vocab == 50257 else f"a vocabulary of {vocab}"
        logits = torch.randn(vocab, generator=g) * 3
    elif kind == 1:  # most tokens far below a few: the mean is far below the max
        cluster = randint(1, min(vocab, 12))
        logits = torch.randn(vocab, generator=g) * 5 - float(randint(100, 3000))
        logits[torch.randperm(vocab, generator=g)[:cluster]] = torch.randn(cluster, generator=g) * 3
        k = randint(1, cluster)
        what = "far from their mean"
    elif kind == 2:  # few distinct values: many ties
        what, logits = "many ties", torch.randint(-4, 5, (vocab,), generator=g).float() * 0.5
    elif kind == 3:  # a large offset and spread
        offset = float(randint(-5000, 5000))
        what, logits = f"offset {offset:g}", torch.randn(vocab, generator=g) * [0.1, 3.0, 20.0][randint(0, 2)] + offset
    else:  # float64, some tokens masked
        logits = (torch.randn(vocab, generator=g) * 4).float().double()
        masked = torch.rand(vocab, generator=g) < 0.3
        masked[int(torch.argmax(logits))] = False
        what, logits = "float64, some -inf", logits.masked_fill(masked, -math.inf)
    return f"{what}, vocabulary {vocab}, k={k}", logits, k


def check_top_k_next_tokens(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """top_k_next_tokens(logits [V], k) -> [(token id, probability), ...], most likely first."""
    max_not_mean = (
        "softmax(x) = softmax(x - c) for any c: subtract the max (not the mean, not the min), so that "
        "every exponent is <= 0 and exp() cannot overflow"
    )
    cases = [
        _case("a small example", torch.tensor([2.0, 1.0, 0.5, -1.0]), 2),
        _case("k = 1 is the greedy choice", torch.tensor([0.1, 3.0, -2.0]), 1),
        _case(
            "k = vocabulary size lists every token",
            torch.tensor([0.3, -0.2, 1.5, 0.0]),
            4,
            "probabilities come from a softmax over all the logits; they add up to 1",
        ),
        _case(
            "ties list the smaller token id first",
            torch.tensor([1.0, 2.0, 1.0, 2.0, 0.0]),
            3,
            "sort by probability, highest first, breaking ties by token id (a stable sort does it)",
        ),
        _case(
            "large logits (exp overflows if you don't subtract the max)",
            torch.tensor([1000.0, 999.0, 990.0]),
            2,
            "softmax(x) = softmax(x - max(x)): subtracting the max keeps exp() finite",
        ),
        _case(
            "very negative logits",
            torch.tensor([-1000.0, -1001.0, -1003.0]),
            3,
            "softmax(x) = softmax(x - max(x)): subtracting the max keeps exp() from underflowing to 0/0",
        ),
        _case("a vocabulary of one token", torch.tensor([0.5]), 1, "one token has probability 1"),
        _case(
            "two likely tokens far above the rest (far from the mean)",
            torch.cat([torch.full((98,), -300.0), torch.tensor([5.0, 4.0])]),
            2,
            max_not_mean,
        ),
        _case(
            "masked tokens: logits of -inf have probability 0",
            torch.tensor([1.0, -math.inf, 2.0, -math.inf, 0.5]),
            4,
            "exp(-inf) is 0: those tokens come last, smaller id first",
        ),
        _case("k larger than 10", torch.linspace(3.0, -3.0, 30).flip(0), 25, ""),
        _case(
            "a tie across the k-th place: exactly k pairs, the smaller ids first",
            torch.tensor([2.0, 1.0, 0.0, 1.0, 1.0]),
            2,
            "return exactly k pairs: of the tokens tied at the k-th place, the smaller ids first until there are k",
        ),
        _case(
            "four tokens tied for 2nd place in a vocabulary of 40",
            torch.zeros(40).index_fill(0, torch.tensor([5, 12, 25, 39]), 1.0).index_fill(0, torch.tensor([30]), 2.0),
            3,
            "torch's sort of more than 16 values lists equal values in any order: use torch.argsort(probs, "
            "descending=True, stable=True), or sort by (-probability, id)",
        ),
        # float16 and bfloat16 logits (probabilities to their own accuracy, see _rel_tol)
        _case(
            "large float16 logits (up to 12.5: exp overflows float16 unless the max is subtracted)",
            torch.tensor([11.0, 12.5, 9.0, 12.0, 7.0]).half(),
            3,
            "softmax(x) = softmax(x - max(x)): e^11.1 is float16's largest number",
        ),
        _case(
            "bfloat16 logits near 1000, two tied for the top",
            torch.tensor([1000.0, 996.0, 1000.0, 992.0]).bfloat16(),
            3,
            "softmax(x) = softmax(x - max(x)): subtracting the max keeps exp() finite",
        ),
        _case(
            "float16 rounds 1.0001 to 1.0: a tie, the smaller id first",
            torch.tensor([2.0, 1.0001, 1.0, 0.5]).half(),
            2,
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    attempts = 0
    fixed = len(cases)
    while len(cases) < fixed + n_random and attempts < 20 * (n_random + 1):
        attempts += 1
        what, logits, k = _random_logits(g, len(cases) - fixed)
        case = _case(f"random logits #{len(cases) - fixed} ({what})", logits, k)
        if _unambiguous(logits, k, case.expected):
            cases.append(case)
    run_check(
        "top_k_next_tokens",
        fn,
        cases,
        judge=_judge,
        forbid=NO_TOPK,
        # sorted() over 50,257 ids with a key that indexes the tensor (p[i]: a 0-d tensor per comparison) is
        # correct and slow: 2.3 CPU-s a call, 36 under the watch for torch.topk, which sees every tensor
        # operation (measured on an AMD EPYC Zen 4)
        seconds=60,
        total_seconds=240,
        timeout_hint="a sort written by hand that compares every pair (O(V²)) is far too slow for 50,257 tokens: "
        "use torch.argsort or sorted()",
    )
