"""Speculative decoding, proven against references that do not use `llmcourse.engine.speculative`: plain
`generate` without a draft, transformers (plain and assisted generation), and distributions
computed by hand.

- greedy: speculative == plain, token for token (bundled pair, random small pairs that disagree a
  lot, a draft identical to the target, prompt lookup; k = 1..8, prompts of length 1, max_new_tokens
  from 1, EOS mid-round, stop strings, batches, repetition penalty, float64);
- the acceptance rule as a sampler: on toy p and q the returned token is distributed as p (a
  chi-square test with fixed seeds), P(accept) = sum(min(p, q)), and subtly wrong rules fail the
  same test (the test has power);
- end to end on the bundled pair: the first and second sampled tokens follow the target's
  processed distribution (temperature, top-k, top-p, min-p, repetition penalty) computed with
  transformers' model and logits processors;
- statistics, refusals, the command line, and a learner's slots
  (`generate(..., speculation=guarded(Speculation, ...))`).

Measured when written (CPU, torch 2.13, one thread). This file compares about 700 tokens of the
bundled pair (9 prompts: held-out passages, random ids, one token; k = 1..8; plain and assisted
transformers too) and about 4,000 of random small pairs (k = 1..8, four drafts, prompt lookup,
float64, repetition penalty). Offline, with the same code: 40 held-out prompts x k = 1..8 x 32
tokens = 10,240 bundled-pair tokens, and 1,024 small-model runs (32 prompts of 1 to 30 tokens x
k = 1..8 x three drafts and prompt lookup x 40 tokens = 40,960 tokens); no token ever differed, although the fp32
verify pass scores k + 1 positions in one matmul (the smallest top-2 logit gap on those greedy
paths was 7.0e-05).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch

from llmcourse import GPT2, GPT2Config, generate, generate_text, get_tokenizer, load_model, stream
from llmcourse.course.guards import guarded
from llmcourse.engine.loading import MODELS_DIR
from llmcourse.engine.slots import PartError
from llmcourse.engine.speculative import (
    AUTO_FIRST_K,
    AUTO_MAX_K,
    AUTO_ROUNDS,
    Speculation,
    SpeculationStats,
    accept_token,
    best_k,
    draft_cost,
    prompt_lookup_draft,
    verify,
)
from llmcourse.training.shakespeare import validation_tokens

from .conftest import lively_model

SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=97)
TINY = GPT2Config(n_layer=1, n_head=1, n_embd=16, n_positions=128, vocab_size=97)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def bundled():
    return load_model("gpt2-shakespeare", device="cpu"), load_model("gpt2-shakespeare-draft", device="cpu")


def shakespeare_prompts(n: int, length: int = 12) -> list[list[int]]:
    """n held-out passages of `length` tokens, spread over the validation text."""
    ids = validation_tokens().tolist()
    return [ids[i : i + length] for i in range(0, len(ids) - length, (len(ids) - length) // n)][:n]


@pytest.fixture(scope="module")
def small():
    """Random small models (vocab 97): a target and drafts that disagree with it a lot ('other',
    'tiny'), a little ('near': the target's weights plus noise), or never ('same')."""
    target = lively_model(SMALL, seed=1)
    near = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in near.parameters():
            w.add_(0.2 * w.std() * torch.randn(w.shape, generator=g))
    drafts = {
        "other": lively_model(SMALL, seed=2),
        "tiny": lively_model(TINY, seed=3),
        "near": near,
        "same": copy.deepcopy(target),
    }
    return target, drafts


def random_prompts(seed: int, n: int, vocab: int = 97, longest: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, *torch.randint(1, longest + 1, (n - 2,), generator=g).tolist()]
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


def plain(model, prompt, **kw):
    return generate(model, prompt, eos_token_id=kw.pop("eos_token_id", None), **kw)


# ---------------------------------------------------------------------------------------------
# Independent implementations of chapter 08's slots (a learner's, written differently from the
# engine's): inverse-CDF sampling, tuple search, a round that checks proposals one by one.


def draw(weights: torch.Tensor, generator) -> int:
    """A token drawn from unnormalised weights [V] by inverting the CDF."""
    cdf = weights.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(weights) - 1)


def my_accept_token(p, q, draft_token, generator=None):
    if torch.rand((), generator=generator) < p[draft_token] / q[draft_token]:
        return True, draft_token
    residual = torch.where(p > q, p - q, torch.zeros_like(p))
    return False, draw(residual if residual.sum() > 0 else p, generator)


def my_verify(p, q, draft_tokens, generator=None):
    for i, x in enumerate(draft_tokens):
        kept, token = my_accept_token(p[i], q[i], x, generator)
        if not kept:
            return i, token
    return len(draft_tokens), draw(p[len(draft_tokens)], generator)


def my_prompt_lookup(tokens, num_draft_tokens, max_ngram=3):
    for n in range(max_ngram, 0, -1):
        if n >= len(tokens):
            continue
        tail = tuple(tokens[-n:])
        starts = [i for i in range(len(tokens) - n) if tuple(tokens[i : i + n]) == tail]
        if starts:
            return list(tokens[starts[-1] + n :][:num_draft_tokens])
    return []


def my_round(target, draft, target_cache, draft_cache, tokens, num_draft_tokens, *, rollback=0):
    """One greedy round; `rollback` != 0 moves the target cache's rollback (a broken round)."""
    proposals, feed = [], tokens[draft_cache.length :]
    for _ in range(num_draft_tokens):
        proposals.append(int(draft(torch.tensor([feed]), cache=draft_cache)[0, -1].argmax()))
        feed = proposals[-1:]
    best = target(torch.tensor([[tokens[-1], *proposals]]), cache=target_cache)[0].argmax(-1).tolist()  # [k+1]
    n = 0
    while n < len(proposals) and proposals[n] == best[n]:
        n += 1
    target_cache.length = len(tokens) + n + rollback
    draft_cache.length = min(draft_cache.length, len(tokens) + n)
    return proposals[:n] + [best[n]]


# ---------------------------------------------------------------------------------------------
# Greedy: speculative == plain, token for token.


@pytest.fixture(scope="module")
def bundled_cases(bundled, tok):
    """(prompts, plain greedy continuations): held-out passages, one of random ids, one of 1 token."""
    target, _ = bundled
    random_ids = torch.randint(0, 50257, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = shakespeare_prompts(7) + [random_ids, tok.encode("O")]
    return prompts, [plain(target, p, max_new_tokens=16) for p in prompts]


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_with_the_bundled_draft_is_plain_greedy(bundled, bundled_cases, k):
    """A batch of prompts (decoded one by one) gives each prompt's plain greedy tokens, for every k."""
    target, draft = bundled
    prompts, expected = bundled_cases
    chosen = [(k + 3 * j) % len(prompts) for j in range(3)]  # 3 prompts per k, every prompt with several k's
    stats = SpeculationStats()
    got = generate(
        target,
        [prompts[i] for i in chosen],
        max_new_tokens=16,
        eos_token_id=None,
        draft=draft,
        num_draft_tokens=k,
        stats=stats,
    )
    assert got == [expected[i] for i in chosen]
    assert 0 < stats.acceptance_rate < 1 and stats.new_tokens == 48


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_greedy_with_the_bundled_draft_is_plain_greedy_on_cuda(bundled_cases):
    """On a GPU the k + 1 verified rows go through other kernels than one row: still plain greedy's tokens."""
    target, draft = load_model("gpt2-shakespeare", device="cuda"), load_model("gpt2-shakespeare-draft", device="cuda")
    prompts, _ = bundled_cases
    expected = [plain(target, p, max_new_tokens=16) for p in prompts]
    for k in range(1, 9):
        assert (
            generate(target, prompts, max_new_tokens=16, eos_token_id=None, draft=draft, num_draft_tokens=k) == expected
        ), k


@pytest.fixture(scope="module")
def small_cases(small):
    """(k, prompt, max_new_tokens, plain greedy's tokens) for k = 1..8."""
    return [
        (k, prompt, new, plain(small[0], prompt, max_new_tokens=new))
        for k in range(1, 9)
        for prompt, new in zip(random_prompts(seed=k, n=6), (1, 2, 3, 7, 19, 30))
    ]


@pytest.mark.parametrize("kind", ["other", "tiny", "near", "same"])
def test_greedy_with_random_small_models_is_plain_greedy(small, small_cases, kind):
    """Random target and drafts (disagreeing a lot, a little, never), k = 1..8, prompts of 1 to 16
    tokens, max_new_tokens from 1 to 30."""
    target, drafts = small
    stats = SpeculationStats()
    for k, prompt, new, expected in small_cases:
        assert (
            plain(target, prompt, max_new_tokens=new, draft=drafts[kind], num_draft_tokens=k, stats=stats) == expected
        ), (kind, k, prompt, new)
    rate = stats.acceptance_rate
    assert {"other": rate < 0.3, "tiny": rate < 0.3, "near": 0.3 < rate < 1, "same": rate == 1}[kind], rate


def test_a_draft_identical_to_the_target_accepts_everything(small):
    """A copy of the target, or the target itself (each keeps its own cache)."""
    target, drafts = small
    for k, draft in [(1, drafts["same"]), (4, target), (8, drafts["same"])]:
        stats = SpeculationStats()
        got = plain(target, [5, 6, 7], max_new_tokens=40, draft=draft, num_draft_tokens=k, stats=stats)
        assert got == plain(target, [5, 6, 7], max_new_tokens=40)
        assert stats.acceptance_rate == 1 and stats.new_tokens == 40
        assert all(r.accepted == len(r.drafted) == k for r in stats.rounds[:-1])  # every round but the last: k + 1
        assert len(stats.rounds) == -(-40 // (k + 1)) and stats.tokens_per_forward == 40 / len(stats.rounds)


# num_draft_tokens="auto": k chosen by Speculation.best_k from the measured α and the models' sizes.


def test_auto_greedy_is_plain_greedy_whatever_k_it_chooses(bundled, bundled_cases, small, small_cases):
    target, draft = bundled
    prompts, expected = bundled_cases
    stats = SpeculationStats()
    auto = dict(draft=draft, num_draft_tokens="auto", stats=stats)
    assert generate(target, prompts, max_new_tokens=16, eos_token_id=None, **auto) == expected
    assert stats.choices and all(c.k == best_k(c.alpha, c.c, AUTO_MAX_K) for c in stats.choices)
    assert {round(c.c, 3) for c in stats.choices} == {round(draft_cost(target, draft), 3)} == {0.269}
    assert "num_draft_tokens='auto' chose k = " in stats.summary()
    small_target, drafts = small
    for how in [*drafts.values(), "prompt-lookup"]:
        for k, prompt, new, want in small_cases:
            if k == 1:  # the k of small_cases is not used: "auto" chooses
                assert plain(small_target, prompt, max_new_tokens=new, draft=how, num_draft_tokens="auto") == want


def test_auto_proposes_4_then_what_best_k_chooses(small):
    """AUTO_FIRST_K proposals per round, then every AUTO_ROUNDS rounds the k best_k returns for the α measured
    (kept / judged) and c from the sizes (1 for a copy of the target)."""
    target, drafts = small
    calls = []

    def two(alpha, c, max_k):
        calls.append((alpha, c, max_k))
        return 2

    stats = SpeculationStats()
    speculation = guarded(Speculation, best_k=two)
    got = plain(
        target,
        [5, 6, 7],
        max_new_tokens=40,
        draft=drafts["same"],
        num_draft_tokens="auto",
        stats=stats,
        speculation=speculation,
    )
    assert got == plain(target, [5, 6, 7], max_new_tokens=40)
    sizes = [len(r.drafted) for r in stats.rounds]
    assert sizes[:AUTO_ROUNDS] == [AUTO_FIRST_K] * AUTO_ROUNDS and set(sizes[AUTO_ROUNDS:-1]) == {2}
    assert calls[0] == (1.0, 1.0, AUTO_MAX_K) and len(calls) == len(stats.rounds) // AUTO_ROUNDS
    assert [c.k for c in stats.choices] == [2] * len(calls)


def test_auto_estimates_alpha_from_the_proposals_judged(small):
    """α = kept / judged over the rounds so far: a round's proposals after its first rejection are never judged
    (kept / drafted would underestimate α)."""
    target, drafts = small
    stats = SpeculationStats()
    plain(target, [3, 1, 4, 1, 5], max_new_tokens=40, draft=drafts["near"], num_draft_tokens="auto", stats=stats)
    assert len(stats.choices) >= 3
    for choice in stats.choices:
        rounds = stats.rounds[: choice.round]
        kept = sum(r.accepted for r in rounds)
        judged = sum(r.accepted + (r.accepted < len(r.drafted)) for r in rounds)
        assert choice.alpha == kept / judged and choice.alpha > kept / sum(len(r.drafted) for r in rounds)


def test_auto_sampling_repeats_with_its_seed(bundled, tok):
    """c comes from the models' sizes, not a stopwatch: a seeded sampled run gives the same tokens every time."""
    target, draft = bundled
    ids = tok.encode("ROMEO:\nBut soft")
    runs = [
        generate(target, ids, max_new_tokens=24, temperature=0.8, seed=3, draft=draft, num_draft_tokens="auto")
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_greedy_filling_the_whole_context_is_plain_greedy(small):
    """prompt + max_new_tokens == n_positions, k up to 64: the last rounds shrink to fit."""
    target, drafts = small
    prompt = (random_prompts(seed=3, n=3, longest=100)[2] * 10)[:100]
    expected = plain(target, prompt, max_new_tokens=28)
    for draft in (drafts["same"], drafts["other"], "prompt-lookup"):
        for k in (4, 27, 64):
            assert plain(target, prompt, max_new_tokens=28, draft=draft, num_draft_tokens=k) == expected, (draft, k)


def test_sampling_with_top_k_1_is_plain_greedy(small):
    """top_k=1 samples from one-hot distributions: the sampling path (acceptance rule, residual,
    bonus draws) must then give greedy decoding's tokens, whatever the seed."""
    target, drafts = small
    for k, prompt in zip((1, 3, 5, 8), random_prompts(seed=70, n=4)):
        for draft in (drafts["other"], drafts["near"], "prompt-lookup"):
            assert plain(
                target, prompt, max_new_tokens=20, temperature=0.8, top_k=1, seed=k, draft=draft, num_draft_tokens=k
            ) == plain(target, prompt, max_new_tokens=20), (k, draft)


def test_greedy_in_float64_is_plain_greedy(small, bundled, tok):
    """float64 target and draft; and a float32 draft for a float64 target (allowed: the draft only
    proposes, the target decides every token)."""
    target, drafts = small
    target64 = copy.deepcopy(target).double()
    for kind in ("other", "near"):
        draft64 = copy.deepcopy(drafts[kind]).double()
        for k, prompt in zip((1, 3, 8), random_prompts(seed=20, n=3)):
            assert plain(target64, prompt, max_new_tokens=25, draft=draft64, num_draft_tokens=k) == plain(
                target64, prompt, max_new_tokens=25
            )
    big64 = copy.deepcopy(bundled[0]).double()
    ids = tok.encode("JULIET:\nO Romeo, Romeo")
    expected = plain(big64, ids, max_new_tokens=12)
    assert plain(big64, ids, max_new_tokens=12, draft=bundled[1], num_draft_tokens=3) == expected


def test_a_float64_target_takes_its_draft_by_name(bundled, tok):
    """A named draft takes the target's dtype, float64 too (it was refused once: bug tests-1)."""
    big64 = copy.deepcopy(bundled[0]).double()
    ids = tok.encode("ROMEO:")
    assert plain(big64, ids, max_new_tokens=5, draft="gpt2-shakespeare-draft") == plain(big64, ids, max_new_tokens=5)


def test_greedy_with_repetition_penalty_is_plain_greedy(small, bundled, tok):
    target, drafts = small
    for k, prompt in zip(range(1, 9), random_prompts(seed=30, n=8)):
        for draft in (drafts["other"] if k % 2 else drafts["near"], "prompt-lookup"):
            assert plain(
                target, prompt, max_new_tokens=20, repetition_penalty=1.3, draft=draft, num_draft_tokens=k
            ) == plain(target, prompt, max_new_tokens=20, repetition_penalty=1.3)
    big, big_draft = bundled
    ids = tok.encode("KING:\nAy, ay, ay, ay, my lord")
    for penalty in (1.3, 0.8):
        assert plain(
            big, ids, max_new_tokens=20, repetition_penalty=penalty, draft=big_draft, num_draft_tokens=3
        ) == plain(big, ids, max_new_tokens=20, repetition_penalty=penalty)


def test_prompt_lookup_is_plain_greedy_and_proposes_what_the_text_repeats(bundled, small, tok):
    """Prompt lookup: the same tokens as plain greedy; each round's proposals are exactly the
    continuation of the text's last n-gram's latest earlier occurrence (checked with our own lookup)."""
    big, _ = bundled
    start = tok.encode("JULIET:\nO Romeo, Romeo")
    quoted = start + plain(big, start, max_new_tokens=30) + tok.encode("\n\n") + start  # the text quotes its own future
    for k, ids in [(6, quoted), (2, tok.encode("KING:\nAy, ay, ay, ay, ay,")), (8, start)]:
        stats = SpeculationStats()
        got = plain(big, ids, max_new_tokens=24, draft="prompt-lookup", num_draft_tokens=k, stats=stats)
        assert got == plain(big, ids, max_new_tokens=24)
        tokens, made = list(ids), 0
        for r in stats.rounds:
            assert r.drafted == my_prompt_lookup(tokens, min(k, 24 - made - 1)), (ids, tokens)
            new = r.drafted[: r.accepted] + [r.token]
            assert new == got[made : made + len(new)] or made + len(new) > 24
            tokens, made = tokens + new, made + len(new)
        assert stats.accepted > 0
        assert ids is not quoted or stats.tokens_per_forward > 2
    # A model that repeats its last token (GPT-2's own random init): lookup accepts nearly all, but
    # proposes one token a round: the latest occurrence of a run's tail is the run shifted by one.
    repeater = GPT2(SMALL).init_weights(0).eval()
    stats = SpeculationStats()
    assert plain(repeater, [5, 5, 5], max_new_tokens=40, draft="prompt-lookup", stats=stats) == plain(
        repeater, [5, 5, 5], max_new_tokens=40
    )
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_forward > 1.8
    # Random small models, all k and prompt lengths (mostly no repeats: few or no proposals).
    target, _ = small
    for k in range(1, 9):
        for new, prompt in zip((1, 5, 33), random_prompts(seed=40 + k, n=3, longest=40)):
            assert plain(target, prompt, max_new_tokens=new, draft="prompt-lookup", num_draft_tokens=k) == plain(
                target, prompt, max_new_tokens=new
            )


def test_prompt_lookup_on_text_without_repeats_proposes_nothing(bundled, tok):
    big, _ = bundled
    ids = list(range(1000, 1012))  # 12 distinct tokens
    stats = SpeculationStats()
    got = plain(big, ids, max_new_tokens=2, draft="prompt-lookup", stats=stats)
    assert stats.rounds[0].drafted == [] and stats.drafted == 0 and stats.acceptance_rate == 0
    assert len(stats.rounds) == 2 and stats.tokens_per_forward == 1 and got == plain(big, ids, max_new_tokens=2)
    assert prompt_lookup_draft(ids, 4) == [] and prompt_lookup_draft([7], 4) == []


def test_eos_mid_round_ends_where_plain_greedy_ends(small):
    """EOS taken from the plain run's tokens, at positions inside a round (a draft that accepts
    everything makes rounds of k + 1 tokens) and at round ends; the EOS is the last token returned."""
    target, drafts = small
    prompt, k = [11, 12, 13], 4
    free = plain(target, prompt, max_new_tokens=30)
    firsts = [j for j, t in enumerate(free) if t not in free[:j]][1:8]
    assert any(j % (k + 1) != k for j in firsts)  # at least one EOS fires mid-round
    for j in firsts:
        expected = free[: j + 1]
        assert plain(target, prompt, max_new_tokens=30, eos_token_id=free[j]) == expected
        for kind in ("same", "other", "near"):
            stats = SpeculationStats()
            got = plain(
                target,
                prompt,
                max_new_tokens=30,
                eos_token_id=free[j],
                draft=drafts[kind],
                num_draft_tokens=k,
                stats=stats,
            )
            assert got == expected and stats.new_tokens == j + 1, (kind, j)


def test_stop_strings_and_eos_with_stream_and_generate_text(bundled, tok):
    big, big_draft = bundled
    prompt = "ROMEO:\nBut soft, what light"
    free = generate_text(big, tok, prompt, max_new_tokens=30)
    cases = [(free[5:9], big_draft, 2), (free[20:23], "prompt-lookup", 5), ("zzz", "gpt2-shakespeare-draft", 3)]
    for stop, draft, k in cases:
        expected = free[: free.index(stop)] if stop in free else free
        assert generate_text(big, tok, prompt, max_new_tokens=30, stop=[stop]) == expected
        got = generate_text(big, tok, prompt, max_new_tokens=30, stop=[stop], draft=draft, num_draft_tokens=k)
        assert got == expected, (stop, draft, k)
    pieces = list(stream(big, tok, prompt, max_new_tokens=30, draft=big_draft, num_draft_tokens=5))
    assert "".join(pieces) == free and len(pieces) > 10  # streamed piece by piece, not once at the end
    eos = generate(big, tok.encode(prompt), max_new_tokens=30, eos_token_id=None)[17]
    assert generate_text(big, tok, prompt, max_new_tokens=30, eos_token_id=eos, draft=big_draft) == generate_text(
        big, tok, prompt, max_new_tokens=30, eos_token_id=eos
    )


# ---------------------------------------------------------------------------------------------
# transformers: plain greedy and assisted generation give our tokens.


def hf_models(*folders):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [GPT2LMHeadModel.from_pretrained(f).eval() for f in folders]


@pytest.fixture(scope="module")
def hf_bundled():
    return hf_models(MODELS_DIR / "gpt2-shakespeare", MODELS_DIR / "gpt2-shakespeare-draft")


def hf_greedy(model, ids, new, **kwargs):
    x = torch.tensor([ids])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def test_transformers_plain_and_assisted_generation_give_our_tokens(
    bundled, hf_bundled, bundled_cases, small, tmp_path
):
    from llmcourse import save_model

    target, draft = bundled
    hf_target, hf_draft = hf_bundled
    prompts, expected = bundled_cases
    calls = []
    hook = hf_draft.register_forward_hook(lambda *args: calls.append(1))  # assisted generation did use the draft
    for i in (5, 7):  # a passage, random ids
        assert hf_greedy(hf_target, prompts[i], 16) == expected[i]
        assert hf_greedy(hf_target, prompts[i], 16, assistant_model=hf_draft) == expected[i]
        assert generate(target, prompts[i], max_new_tokens=16, eos_token_id=None, draft=draft) == expected[i]
    hook.remove()
    assert len(calls) > 5
    small_target, drafts = small
    save_model(small_target, tmp_path / "t")
    save_model(drafts["other"], tmp_path / "d")
    hf_small, hf_other = hf_models(tmp_path / "t", tmp_path / "d")
    for prompt in random_prompts(seed=50, n=3):  # lengths 1, 2 and more
        ours = plain(small_target, prompt, max_new_tokens=20, draft=drafts["other"], num_draft_tokens=3)
        assert hf_greedy(hf_small, prompt, 20, assistant_model=hf_other) == ours == hf_greedy(hf_small, prompt, 20)


# ---------------------------------------------------------------------------------------------
# The acceptance rule as a sampler (toy vocabularies, fixed seeds).


def chi_square_p_value(samples: list[int], probs: torch.Tensor) -> float:
    """P-value of a chi-square goodness-of-fit test of `samples` against `probs` [V]; 0 if a sample
    has probability 0. Categories expected fewer than 5 times are pooled (into the smallest other
    one if the pool itself is expected fewer than 5 times). No scipy here: the chi-square survival
    function is the regularised upper incomplete gamma, Q(df/2, stat/2). The tests pass a rule at
    p > 1e-4 (a false alarm once in 10,000 seeds) and require p < 1e-6 of a wrong one; the seeds
    are fixed, so a run is deterministic."""
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * len(samples)
    big = expected >= 5
    observed, wanted = counts[big].tolist(), expected[big].tolist()
    rest_o, rest_e = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_e >= 5 or not observed:
        observed, wanted = observed + [rest_o], wanted + [rest_e]
    elif rest_e > 0:
        j = min(range(len(wanted)), key=wanted.__getitem__)
        observed[j] += rest_o
        wanted[j] += rest_e
    df = len(observed) - 1
    if df == 0:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def dirichlet(seed: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(v, generator=g, dtype=torch.float64).log()  # Exp(1) draws, normalised: Dirichlet(1, ..., 1)
    return (x / x.sum()).float()


def one_hot(i: int, v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


TOY = {  # name: (p, q)
    "q has mass where p has none": (torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.1, 0.2, 0.3, 0.4])),
    "p has mass where q has none": (torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.6, 0.4, 0.0])),
    "V = 2": (torch.tensor([0.9, 0.1]), torch.tensor([0.3, 0.7])),
    "p == q": (dirichlet(1, 10), dirichlet(1, 10)),
    "random V = 7": (dirichlet(2, 7), dirichlet(3, 7)),
    "random V = 10": (dirichlet(4, 10), dirichlet(5, 10)),
    "one-hot p, spread q": (one_hot(2, 5), dirichlet(6, 5)),
    "spread p, one-hot q (prompt lookup)": (dirichlet(7, 5), one_hot(1, 5)),
    "one-hots that differ": (one_hot(3, 6), one_hot(0, 6)),
    "one-hots that agree": (one_hot(4, 6), one_hot(4, 6)),
}
DRAWS = 3000


def run_rule(rule, p, q, seed: int = 0, n: int = DRAWS) -> tuple[list[int], float]:
    """n draft tokens drawn from q, each passed through `rule`: (the returned tokens, the fraction accepted)."""
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()
    g = torch.Generator().manual_seed(seed + 1)
    results = [rule(p, q, x, g) for x in drafts]
    return [int(t) for _, t in results], sum(bool(a) for a, _ in results) / n


def residual_from_p(p, q, x, g=None):  # wrong: on rejection draws from p instead of max(0, p - q)
    if torch.rand((), generator=g) * q[x] < p[x]:
        return True, x
    return False, int(torch.multinomial(p, 1, generator=g))


def accept_iff_p_at_least_q(p, q, x, g=None):  # wrong: deterministic acceptance
    if p[x] >= q[x]:
        return True, x
    return False, int(torch.multinomial((p - q).clamp(min=0), 1, generator=g))


def accept_with_probability_p(p, q, x, g=None):  # wrong: min(1, p) instead of min(1, p / q)
    if torch.rand((), generator=g) < p[x]:
        return True, x
    r = (p - q).clamp(min=0)
    return False, int(torch.multinomial(r if r.sum() > 0 else p, 1, generator=g))


@pytest.mark.parametrize("case", list(TOY))
def test_accept_token_returns_tokens_distributed_as_p(case):
    p, q = TOY[case]
    for rule in (accept_token, my_accept_token):
        tokens, accepted = run_rule(rule, p, q)
        assert chi_square_p_value(tokens, p) > 1e-4, (case, rule.__name__)
        alpha = min(float(torch.minimum(p, q).sum()), 1.0)  # P(accept) = sum(min(p, q))
        if alpha in (0.0, 1.0) or case == "p == q":
            assert accepted == round(alpha)
        else:
            assert abs(accepted - alpha) < 4 * (alpha * (1 - alpha) / DRAWS) ** 0.5, (case, accepted, alpha)


@pytest.mark.parametrize("wrong", [residual_from_p, accept_iff_p_at_least_q, accept_with_probability_p])
def test_a_subtly_wrong_acceptance_rule_fails_the_same_test(wrong):
    """The frequency test has power: each wrong rule is rejected (p < 1e-6) where 0 < p(x) < q(x) for
    some proposals (elsewhere a wrong rule may happen to give p: then min(1, p/q) is 0 or 1)."""
    for case in ("p has mass where q has none", "random V = 7", "random V = 10"):
        p, q = TOY[case]
        tokens, _ = run_rule(wrong, p, q)
        assert chi_square_p_value(tokens, p) < 1e-6, (case, wrong.__name__)


def verify_draws(fn, p, q, seed: int, n: int = DRAWS) -> list[tuple[int, int, list[int]]]:
    """n rounds of `fn` with proposals drawn from q's rows: (accepted, next token, proposals) each."""
    g, gd = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 7)
    out = []
    for _ in range(n):
        drafts = [int(torch.multinomial(row, 1, generator=gd)) for row in q]
        accepted, token = fn(p, q, drafts, g)
        out.append((accepted, token, drafts))
    return out


def emitted(accepted: int, token: int, drafts: list[int]) -> list[int]:
    return drafts[:accepted] + [token]


def bonus_from_the_last_draft_row(p, q, drafts, g=None):  # wrong: bonus drawn from p[k - 1], not p[k]
    n, token = verify(p, q, drafts, g)
    return (n, int(torch.multinomial(p[n - 1], 1, generator=g))) if n == len(drafts) else (n, token)


def bonus_is_the_argmax(p, q, drafts, g=None):  # wrong: the bonus token is not sampled
    n, token = verify(p, q, drafts, g)
    return (n, int(p[n].argmax())) if n == len(drafts) else (n, token)


@pytest.mark.parametrize("k", [1, 3])
def test_verify_first_and_second_tokens_are_distributed_as_p(k):
    """p [k+1, V], q [k, V] random (V = 6, and q with mass where p has none): the first returned token
    ~ p[0]; after an accepted first proposal, the second ~ p[1] (a proposal or the bonus token)."""
    p = torch.stack([dirichlet(10 + i, 6) for i in range(k + 1)])
    q = torch.stack([dirichlet(20 + i, 6) for i in range(k)])
    p[0, 5], q[0, 4] = 0.0, 0.0  # p has no mass on 5 (q has), q none on 4 (p has)
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    wrong = (bonus_from_the_last_draft_row, bonus_is_the_argmax) if k == 1 else ()  # they change the (k+1)-th token
    for fn in (verify, my_verify, *wrong):
        rounds = verify_draws(fn, p, q, seed=k, n=2000)
        firsts = [emitted(*r)[0] for r in rounds]
        seconds = [emitted(*r)[1] for r in rounds if r[0] >= 1]
        assert all(0 <= r[0] <= k for r in rounds)
        assert chi_square_p_value(firsts, p[0]) > 1e-4, fn.__name__
        second_ok = chi_square_p_value(seconds, p[1]) > 1e-4
        assert second_ok == (fn in (verify, my_verify)), fn.__name__
        alpha = float(torch.minimum(p[0], q[0]).sum())
        share = len(seconds) / len(rounds)  # P(the first proposal is accepted)
        assert abs(share - alpha) < 4 * (alpha * (1 - alpha) / len(rounds)) ** 0.5


def test_verify_greedy_one_hots_keeps_proposals_while_they_are_the_argmax():
    V, target = 9, [4, 2, 7, 7, 1]
    p = torch.stack([one_hot(t, V) for t in target])  # [5, V]
    for drafts, expected in [([4, 2, 7, 7], (4, 1)), ([4, 2, 0, 7], (2, 7)), ([3, 2, 7, 7], (0, 4)), ([4], (1, 2))]:
        q = torch.stack([one_hot(t, V) for t in drafts])
        for seed in range(3):
            assert verify(p[: len(drafts) + 1], q, drafts, torch.Generator().manual_seed(seed)) == expected


# ---------------------------------------------------------------------------------------------
# End to end on the bundled pair: the sampled tokens' distributions are the target's.


def processed(hf_model, ids: list[int], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
    """The target's next-token distribution [V] after `ids`, processed by transformers' processors."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = torch.tensor([ids])
    with torch.no_grad():
        scores = hf_model(x).logits[:, -1].float()  # [1, V]
    warpers = [RepetitionPenaltyLogitsProcessor(repetition_penalty)] if repetition_penalty != 1.0 else []
    warpers += [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warp in warpers:
        scores = warp(x, scores)
    return torch.softmax(scores, -1)[0]


@pytest.mark.parametrize(
    "settings, n, k",
    [
        (dict(temperature=1.0), 128, 2),
        (dict(temperature=0.7, top_k=5, top_p=0.95, min_p=0.05, repetition_penalty=1.3), 100, 1),
    ],
)
def test_speculative_sampling_follows_the_targets_distribution(bundled, hf_bundled, tok, settings, n, k):
    """n samples of speculative sampling with the bundled draft (one batch call: each prompt is its own
    sample). The first token ~ the target's processed distribution after the prompt; the second,
    for the most frequent first tokens, ~ the target's distribution after prompt + that token."""
    target, draft = bundled
    ids = tok.encode("O")  # the draft agrees about half the time (alpha ~ 0.5 at temperature 1)
    stats = SpeculationStats()
    rows = generate(
        target,
        [ids] * n,
        max_new_tokens=k + 1,
        eos_token_id=None,
        draft=draft,
        num_draft_tokens=k,
        seed=3,
        stats=stats,
        **settings,
    )
    assert 0.2 < stats.acceptance_rate < 0.9  # both paths (accepted proposals, residual draws) are exercised
    p_first = processed(hf_bundled[0], ids, **settings)
    assert chi_square_p_value([r[0] for r in rows], p_first) > 1e-4
    firsts = Counter(r[0] for r in rows)
    for first, count in firsts.most_common(2):
        seconds = [r[1] for r in rows if r[0] == first]
        p_second = processed(hf_bundled[0], ids + [first], **settings)
        assert chi_square_p_value(seconds, p_second) > 1e-4, tok.decode([first])
    # The reference itself is sharp: the draft's own distribution fails the same test.
    q_first = processed(hf_bundled[1], ids, **settings)
    assert (
        chi_square_p_value(
            torch.multinomial(q_first, n, replacement=True, generator=torch.Generator().manual_seed(0)).tolist(),
            p_first,
        )
        < 1e-6
    )


# ---------------------------------------------------------------------------------------------
# Statistics.


def test_stats_add_up(bundled, bundled_cases):
    target, draft = bundled
    prompts, _ = bundled_cases
    for k, kw in [(3, {}), (5, dict(temperature=0.8, seed=4))]:
        stats = SpeculationStats()
        out = generate(
            target,
            prompts[:3],
            max_new_tokens=10,
            eos_token_id=None,
            draft=draft,
            num_draft_tokens=k,
            stats=stats,
            **kw,
        )
        assert stats.new_tokens == sum(map(len, out)) == 30
        assert 0 <= stats.acceptance_rate <= 1 and stats.drafted == sum(len(r.drafted) for r in stats.rounds)
        assert stats.tokens_per_forward == stats.new_tokens / len(stats.rounds)
        assert all(0 <= r.accepted <= len(r.drafted) <= k for r in stats.rounds)
        assert sum(r.accepted + 1 for r in stats.rounds) >= stats.new_tokens  # a last round may be cut
        by_position = stats.acceptance_by_position()
        assert len(by_position) == k and all(0 <= a <= 1 for a in by_position)
        assert stats.seconds > 0 and "target forward passes" in stats.summary()


# ---------------------------------------------------------------------------------------------
# Refusals.


@pytest.mark.parametrize("num_draft_tokens", [0, -1, 65, 1.5, True, "4", None])
def test_num_draft_tokens_must_be_a_positive_integer(bundled, num_draft_tokens):
    target, draft = bundled
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an integer in \[1, 64\].*got"):
        generate(target, [1, 2], max_new_tokens=3, draft=draft, num_draft_tokens=num_draft_tokens)


def test_drafts_that_cannot_work_are_refused_with_the_reason(bundled, small, tok):
    target, draft = bundled
    ids = tok.encode("ROMEO:")
    cases = [
        (dict(draft=small[0]), r"draft model's vocabulary has 97 tokens but the target's has 50257"),
        (dict(draft=draft, num_beams=2), r"does not combine with beam search: use num_beams=1"),
        (dict(draft=draft, compile=True), r"leave out compile=True or the draft"),
        (dict(draft="gpt2-shakespeare-draf"), r"could not be loaded.*did you mean 'gpt2-shakespeare-draft'"),
        (dict(draft="/no/such/folder"), r"the draft model '/no/such/folder' could not be loaded"),
        (dict(draft=object()), r"draft must be a model .* got object"),
        (dict(draft=torch.nn.Linear(2, 2)), r"draft must be a model .* got Linear"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(target, ids, max_new_tokens=4, **kw)
    short = GPT2(GPT2Config(n_layer=1, n_head=1, n_embd=16, n_positions=16)).init_weights(0)
    with pytest.raises(
        ValueError,
        match=r"draft model has only n_positions=16, but the longest prompt plus "
        r"max_new_tokens is 22 positions",
    ):
        generate(target, [ids, list(range(12))], max_new_tokens=10, draft=short)
    assert generate(target, ids, max_new_tokens=10, draft=short) == generate(target, ids, max_new_tokens=10)  # 12 fit


def test_the_command_line_speculates_and_reports(capsys):
    from llmcourse.__main__ import main

    def run_here(*args):
        try:
            code = main(["generate", "--max-new-tokens", "16", "--temperature", "0", *args, "ROMEO:"])
        except SystemExit as exit:
            code = exit.code
        out = capsys.readouterr()
        return code, out.out, out.err

    code, plain_text, _ = run_here()
    assert code == 0 and len(plain_text) > 20
    for args in (["--draft", "gpt2-shakespeare-draft"], ["--draft", "prompt-lookup", "--num-draft-tokens", "6"]):
        code, text, err = run_here(*args)
        assert code == 0 and text == plain_text, args
        assert err.count("\n") == 1 and err.startswith("speculative decoding: 16 tokens in "), err
    code, text, err = run_here("--draft", "gpt2-shakespeare-draft", "--num-draft-tokens", "0")
    assert code == 2 and text == "" and err.count("\n") == 1, err
    assert "--num-draft-tokens must be an integer in [1, 64]" in err and "Traceback" not in err
    code, text, err = run_here("--draft", "gpt2-shakespeare-draf")
    assert code == 2 and err.count("\n") == 1 and "did you mean 'gpt2-shakespeare-draft'" in err, err


# ---------------------------------------------------------------------------------------------
# A learner's slots, given to generate as `speculation=guarded(Speculation, **fns)`.


def test_a_learners_correct_slots_give_the_engines_tokens(small):
    target, drafts = small
    mine = dict(
        accept_token=my_accept_token, verify=my_verify, prompt_lookup_draft=my_prompt_lookup, speculative_round=my_round
    )
    cases = [(p, k, new) for k, (p, new) in zip((1, 2, 4, 8), zip(random_prompts(seed=60, n=4), (1, 2, 17, 30)))]
    expected = [plain(target, p, max_new_tokens=new) for p, k, new in cases]
    engine_samples = plain(target, cases[3][0], max_new_tokens=30, temperature=0.9, seed=7, draft=drafts["near"])
    for fns in (mine, dict(speculative_round=my_round), dict(accept_token=my_accept_token)):
        speculation = guarded(Speculation, **fns)
        for (prompt, k, new), want in zip(cases, expected):
            for draft in (drafts["other"], drafts["near"], "prompt-lookup"):
                got = plain(
                    target, prompt, max_new_tokens=new, draft=draft, num_draft_tokens=k, speculation=speculation
                )
                assert got == want, (fns, k, draft)
        sampled = plain(
            target,
            cases[3][0],
            max_new_tokens=30,
            temperature=0.9,
            seed=7,
            draft=drafts["near"],
            speculation=speculation,
        )
        assert len(sampled) == 30 and (sampled == engine_samples) == ("verify" not in fns and "accept_token" not in fns)


def round_without_target_rollback(target, draft, target_cache, draft_cache, tokens, k):
    out = my_round(target, draft, target_cache, draft_cache, tokens, k)
    target_cache.length = len(tokens) + k
    return out


def round_one_short(target, draft, target_cache, draft_cache, tokens, k):
    return my_round(target, draft, target_cache, draft_cache, tokens, k, rollback=-1)


def round_without_draft_rollback(target, draft, target_cache, draft_cache, tokens, k):
    before = draft_cache.length
    out = my_round(target, draft, target_cache, draft_cache, tokens, k)
    draft_cache.length = len(tokens) + k - 1 if k else before
    return out


def round_returning_nothing(target, draft, target_cache, draft_cache, tokens, k):
    my_round(target, draft, target_cache, draft_cache, tokens, k)
    return []


def round_that_raises(target, draft, target_cache, draft_cache, tokens, k):
    return draft(tokens, cache=draft_cache)  # a list, not a tensor


def round_returning_a_tensor(target, draft, target_cache, draft_cache, tokens, k):
    return torch.tensor(my_round(target, draft, target_cache, draft_cache, tokens, k))


def verify_accepting_one_too_many(p, q, drafts, g=None):
    return len(drafts) + 1, 0


def verify_returning_a_negative_count(p, q, drafts, g=None):
    return -1, 0


def verify_returning_a_bool(p, q, drafts, g=None):
    return True, int(p[0].argmax())


def verify_returning_a_token_out_of_range(p, q, drafts, g=None):
    return 0, p.shape[-1]


def accept_token_switching_the_proposal(p, q, x, g=None):
    return True, (x + 1) % len(p)


def lookup_proposing_too_many(tokens, k, max_ngram=3):
    return list(tokens[: k + 1])


def lookup_inventing_tokens(tokens, k, max_ngram=3):
    return [max(tokens) + 1] * k


def best_k_zero(alpha, c, max_k):
    return 0


def best_k_the_speedup(alpha, c, max_k):
    return 1.7


@pytest.mark.parametrize(
    "slot, fn, message",
    [
        ("speculative_round", round_without_target_rollback, r"left target_cache.length = \d+.*roll them back"),
        ("speculative_round", round_one_short, r"target's cache must hold exactly \d+ positions"),
        ("speculative_round", round_without_draft_rollback, r"and the draft's at most \d+"),
        ("speculative_round", round_returning_nothing, r"returned \[\]; expected a list of 1 to \d+ token ids"),
        ("speculative_round", round_that_raises, r"raised \w+"),
        ("speculative_round", round_returning_a_tensor, r"returned tensor.*expected a list"),
        ("verify", verify_accepting_one_too_many, r"returned \(\d+, 0\); expected \(number accepted in \[0, \d+\]"),
        ("verify", verify_returning_a_negative_count, r"returned \(-1, 0\)"),
        ("verify", verify_returning_a_bool, r"returned \(True, \d+\)"),
        ("verify", verify_returning_a_token_out_of_range, r"next token id in \[0, 97\)"),
        ("accept_token", accept_token_switching_the_proposal, r"accepted the proposal \d+ but returned token \d+"),
        ("prompt_lookup_draft", lookup_proposing_too_many, r"expected a list of at most \d+ token ids"),
        ("prompt_lookup_draft", lookup_inventing_tokens, r"returned \[4, 4, 4, 4\]; .*copied from the text"),
        ("best_k", best_k_zero, r"returned 0; expected an integer k in 1\.\.8"),
        ("best_k", best_k_the_speedup, r"returned 1\.7; expected an integer k in 1\.\.8"),
    ],
)
def test_a_learners_broken_slot_is_stopped_with_a_part_error(small, slot, fn, message):
    target, drafts = small
    speculation = guarded(Speculation, **{slot: fn})
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup proposes
    draft = "prompt-lookup" if slot == "prompt_lookup_draft" else drafts["other"]
    with pytest.raises(PartError, match=rf"part '{slot}' \({fn.__name__}\) .*{message}"):
        auto = "auto" if slot == "best_k" else 4
        plain(target, prompt, max_new_tokens=30, draft=draft, num_draft_tokens=auto, speculation=speculation)
