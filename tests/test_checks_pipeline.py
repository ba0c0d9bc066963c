"""Chapter 00's check: the reference passes, plausible mistakes fail with a specific message."""

import pytest
import torch

from llmcourse.checks import CheckFailed, check_top_k_next_tokens
from llmcourse.sampling import top_k_next_tokens


def test_reference_passes(capsys):
    check_top_k_next_tokens(top_k_next_tokens)
    assert capsys.readouterr().out == "✓ top_k_next_tokens — 26 cases\n"


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
        (uses_topk, r"called torch.Tensor.topk, the black box"),
    ],
)
def test_plausible_mistakes_are_rejected(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_top_k_next_tokens(wrong)


def test_a_differently_written_solution_passes():
    def pure_python(logits, k):
        values = logits.tolist()
        top = max(values)
        weights = [2.718281828459045 ** (v - top) for v in values]
        total = sum(weights)
        ranked = sorted(range(len(values)), key=lambda i: (-weights[i], i))
        return [(i, weights[i] / total) for i in ranked[:k]]

    check_top_k_next_tokens(pure_python, seed=7, n_random=10)


def test_a_hanging_solution_is_stopped():
    def hangs(logits, k):
        while True:
            pass

    from llmcourse.checks.core import Case, run_check

    with pytest.raises(CheckFailed, match="did not finish within 0.5 s"):
        run_check("top_k_next_tokens", hangs, [Case("any", (torch.zeros(3), 1), [])], seconds=0.5)
