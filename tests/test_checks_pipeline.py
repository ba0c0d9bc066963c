"""Chapter 00's check: a correct answer passes, plausible mistakes fail with a specific message."""

import heapq
import math
from pathlib import Path

import pytest
import torch
from torch import topk as topk_imported_early  # an alias made before the check: still the black box

from llmcourse.checks import CheckFailed, check_top_k_next_tokens
from llmcourse.checks.harness.core import Case, run_check
from llmcourse.engine.sampling import top_k_next_tokens
from tests.notebook_checks import notebook_cells

ENGINE = top_k_next_tokens


NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions/00_pipeline/00_pipeline.ipynb"


@pytest.fixture(scope="module")
def nb():
    """The notebook's solution, defined as a learner's notebook defines it."""
    setup, solutions, _ = notebook_cells(NOTEBOOK)
    namespace = {"__name__": "__learner__"}
    for source in [*setup, *solutions]:
        exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    return namespace


def test_the_solution_passes(nb, capsys):
    check_top_k_next_tokens(nb["top_k_next_tokens"])
    check_top_k_next_tokens(nb["top_k_next_tokens"], seed=2026, n_random=60)  # the notebook's hidden test
    assert capsys.readouterr().out == "✓ top_k_next_tokens — 35 cases\n✓ top_k_next_tokens — 75 cases\n"


def stub(logits, k):
    raise NotImplementedError()


def forgot_to_sort(logits, k):
    probs = torch.softmax(logits, -1)
    return [(i, float(probs[i])) for i in range(k)]


def naive_softmax(logits, k):  # exp of large logits overflows to inf, then nan
    probs = logits.exp() / logits.exp().sum()
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def off_by_one(logits, k):
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[: k - 1]]


def ties_by_larger_id(logits, k):
    probs = torch.softmax(logits, -1)
    order = sorted(range(len(probs)), key=lambda i: (probs[i].item(), i), reverse=True)
    return [(i, float(probs[i])) for i in order[:k]]


def returns_logits(logits, k):
    order = torch.argsort(logits, descending=True, stable=True)
    return [(int(i), float(logits[i])) for i in order[:k]]


def tensor_items(logits, k):
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    return [(i, probs[i]) for i in order[:k]]


def uses_topk(logits, k):
    values, indices = torch.softmax(logits, -1).topk(k)
    return [(int(i), float(v)) for v, i in zip(values, indices)]


# -- almost right: only wide inputs tell them apart ---------------------------------------------


def shifted_by_the_mean(logits, k):  # right for logits near their mean; exp overflows when the max is far above it
    shifted = logits - logits.mean()
    probs = shifted.exp() / shifted.exp().sum()
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def shifted_by_the_min(logits, k):
    shifted = logits - logits.min()
    probs = shifted.exp() / shifted.exp().sum()
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def in_half_precision(logits, k):  # fine to 3 digits, not to 4
    probs = torch.softmax(logits.to(torch.bfloat16), -1)
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


# -- changes its input --------------------------------------------------------------------------


def subtracts_in_place(logits, k):
    logits -= logits.max()  # the caller's logits change
    probs = logits.exp() / logits.exp().sum()
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def sorts_in_place(logits, k):
    probs = torch.softmax(logits, -1)
    logits.copy_(probs)  # reuses the input as scratch space
    order = torch.argsort(logits, descending=True, stable=True)
    return [(int(i), float(logits[i])) for i in order[:k]]


# -- the black box, reached another way ---------------------------------------------------------


def topk_alias(logits, k):
    values, indices = topk_imported_early(torch.softmax(logits, -1), k)
    return [(int(i), float(v)) for v, i in zip(values, indices)]


def topk_through_aten(logits, k):
    values, indices = torch.ops.aten.topk(torch.softmax(logits, -1), k)
    return [(int(i), float(v)) for v, i in zip(values, indices)]


def engine_alias(logits, k):
    return ENGINE(logits, k)


def swallows_the_black_box_error(logits, k):
    try:
        return uses_topk(logits, k)
    except Exception:  # the refusal is caught: the check still knows
        return top_k_next_tokens_pure(logits, k)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (stub, "not written yet"),
        (forgot_to_sort, r"k = 1 is the greedy choice: item 0: expected token 1, got 0"),
        (naive_softmax, r"large logits \(exp overflows.*got nan"),
        (off_by_one, r"expected 2 pairs, got 1"),
        (ties_by_larger_id, r"ties list the smaller token id first"),
        (returns_logits, r"expected probability"),
        (tensor_items, r"token id should be a Python int"),
        (uses_topk, r"called torch\.Tensor\.topk \(that is torch\.topk\), the black box"),
        (shifted_by_the_mean, r"far from the mean\)[\s\S]*got nan[\s\S]*subtract the max \(not the mean"),
        (shifted_by_the_min, r"got nan"),
        (in_half_precision, r"expected probability"),
        (subtracts_in_place, r"changed its input `logits`[\s\S]*before the call[\s\S]*in-place operation"),
        (sorts_in_place, r"changed its input `logits`"),
        (topk_alias, r"called torch\.topk, the black box"),
        (topk_through_aten, r"called torch\.ops\.aten\.topk \(that is torch\.topk\)"),
        (engine_alias, r"called llmcourse\.engine\.sampling\.top_k_next_tokens, the black box"),
        (swallows_the_black_box_error, r"called torch\.Tensor\.topk"),
    ],
)
def test_plausible_mistakes_are_rejected(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_top_k_next_tokens(wrong)


@pytest.mark.parametrize("wrong", [shifted_by_the_mean, shifted_by_the_min])
def test_random_logits_alone_reach_far_enough(wrong):
    """A hidden test is mostly random cases: they alone must tell an almost-right softmax apart."""
    import llmcourse.checks.pipeline as pipeline

    g = torch.Generator().manual_seed(2026)
    cases = []
    for i in range(20):
        what, logits, k = pipeline._random_logits(g, i)
        cases.append(Case(f"random logits #{i} ({what})", (logits, k), top_k_next_tokens(logits, k)))
    with pytest.raises(CheckFailed, match="random logits"):
        run_check("top_k_next_tokens", wrong, cases, compare=pipeline._pairs_match)


def top_k_next_tokens_pure(logits, k):
    values = logits.tolist()
    top = max(values)
    weights = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(weights)
    ranked = sorted(range(len(values)), key=lambda i: (-weights[i], i))
    return [(i, weights[i] / total) for i in ranked[:k]]


def with_heapq(logits, k):
    """Sort by logit (the same order as by probability), only the k largest, with heapq."""
    values = logits.double()
    probs = torch.softmax(values, -1)
    best = heapq.nsmallest(k, range(len(values)), key=lambda i: (-values[i].item(), i))
    return [(i, probs[i].item()) for i in best]


def softmax_by_hand_on_a_copy(logits, k):
    x = logits.clone()
    x -= x.max()  # in place, but on a copy: fine
    x = x.exp()
    x /= x.sum()
    order = (
        sorted(range(x.numel()), key=lambda i: -x[i].item())
        if x.numel() < 1000
        else torch.argsort(x, descending=True, stable=True).tolist()
    )
    return [(int(i), float(x[i])) for i in order[:k]]


@pytest.mark.parametrize("solution", [top_k_next_tokens_pure, with_heapq, softmax_by_hand_on_a_copy])
def test_differently_written_solutions_pass(solution):
    check_top_k_next_tokens(solution, seed=7, n_random=30)


def test_a_hanging_solution_is_stopped():
    def hangs(logits, k):
        while True:
            pass

    with pytest.raises(CheckFailed, match="did not finish within its 0.5 CPU-s"):
        run_check("top_k_next_tokens", hangs, [Case("any", (torch.zeros(3), 1), [])], seconds=0.5)


def test_the_time_out_hint_is_about_this_exercise(monkeypatch):
    import llmcourse.checks.pipeline as pipeline

    def hangs(logits, k):
        while True:
            try:
                sum(range(10**6))
            except Exception:  # swallows everything an Exception can be: not the time-out
                pass

    real = pipeline.run_check
    monkeypatch.setattr(pipeline, "run_check", lambda *a, **kw: real(*a, **{**kw, "seconds": 0.3}))
    with pytest.raises(CheckFailed, match=r"did not finish within its 0.3 CPU-s") as caught:
        check_top_k_next_tokens(hangs)
    assert "merge" not in str(caught.value) and "50,257" in str(caught.value)


def test_transformers_helpers_are_black_boxes_too():
    warper = pytest.importorskip("transformers").TopKLogitsWarper  # imported before, as in a notebook

    def with_a_warper(logits, k):
        kept = warper(top_k=k)(None, logits[None])[0]
        probs = torch.softmax(kept, -1)
        order = torch.argsort(probs, descending=True, stable=True)
        return [(int(i), float(probs[i])) for i in order[:k]]

    with pytest.raises(CheckFailed, match=r"called transformers\.generation\.logits_process\.TopKLogitsWarper"):
        check_top_k_next_tokens(with_a_warper)


# -- issue 41: ties at the k-th place, float16 and bfloat16 logits ------------------------------


def unstable_sort(logits, k):  # torch's default sort: equal values in any order past 16 of them
    probs = torch.softmax(logits.float(), -1)
    order = torch.argsort(probs, descending=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def every_tie_at_the_kth(logits, k):  # a threshold, as top-k filtering keeps ties: more than k pairs
    probs = torch.softmax(logits.float(), -1)
    kth = torch.sort(probs, descending=True).values[min(k, len(probs)) - 1]
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order if probs[i] >= kth]


def guards_float32_only(logits, k):  # subtracts the max only where float32's exp would overflow
    x = logits - logits.max() if logits.abs().max() > 80 else logits
    probs = x.exp() / x.exp().sum()
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


@pytest.mark.parametrize(
    "wrong, message",
    [
        (unstable_sort, r"four tokens tied for 2nd place in a vocabulary of 40[\s\S]*stable=True"),
        (every_tie_at_the_kth, r"expected 3 pairs, got 4[\s\S]*hint: return exactly k pairs"),
        (guards_float32_only, r"large float16 logits[\s\S]*got nan[\s\S]*float16's largest number"),
    ],
)
def test_ties_and_half_precision_mistakes_are_named(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_top_k_next_tokens(wrong)


def softmax_in_the_logits_dtype(logits, k):  # float16 in: probabilities to float16's accuracy
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    return [(int(i), float(probs[i])) for i in order[:k]]


def test_a_softmax_in_the_logits_own_dtype_is_accepted():
    check_top_k_next_tokens(softmax_in_the_logits_dtype, seed=2026, n_random=60)
