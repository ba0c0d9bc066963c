"""LLMEngine is exact: every request gets the tokens `llmcourse.generate` gives it alone.

The reference is `generate` run on each request by itself, never the engine's own logic. Property
tests draw hundreds of seeded random workloads (prompt lengths from one token to many blocks, shared
system prompts of 0-3 blocks, a prompt equal to the whole prefix, random arrivals, per-request
greedy or sampling settings with their own seed, EOS that really fires mid-way, block sizes 1/4/16,
pools just big enough for the largest request, token budgets that chunk prefills, 1-8 running
requests, prefix caching on and off, stop strings) and compare every token. A failure names the
workload's seed.

Measured (one process, one torch thread, 2 shared cores): this file compares 264 random workloads on
tiny models (200 fp32, 40 float64, 24 with a learner's batching functions; 1,014 requests, 5,913
tokens) and 3 on the bundled model (15 requests, stop strings), in 27 s (up to 50 s while other
processes share the cores). No token ever differed, fp32 included: a batched matmul may round
differently, but no greedy or sampled choice flipped. Run outside the suite with the same generator,
2,000 more fp32 workloads (seeds 200-2199: 7,903 requests, 44,894 tokens; 466 with preemptions, 920
with prefix-cache hits, 556 requests cut by a stop string) and 500 more float64 ones (1,966 requests,
10,949 tokens) gave no difference either. The paged forward of a mixed batch is within 8.3e-7 of
`model(ids)` in fp32, 7.8e-16 in float64.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import pytest
import torch

from llmcourse import GPT2, GPT2Config, generate, get_tokenizer, load_model
from llmcourse.course.guards import guard, guarded
from llmcourse.course.learner import Engine
from llmcourse.engine.generate import as_model
from llmcourse.engine.slots import PartError
from llmcourse.serving.batching import Batching
from llmcourse.serving.block_manager import block_hashes
from llmcourse.serving.llm_engine import LLMEngine
from llmcourse.serving.paged_cache import (
    Chunk,
    PagedKVCache,
    forward,
    gather_kv,
    paged_attention,
    paged_decode,
    partitions,
    slot_mapping,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int, dtype: torch.dtype = torch.float32) -> GPT2:
    """A small random GPT-2 whose continuations depend on the prompt's content and positions, and vary.

    GPT-2's own initialization repeats the last token (the head is tied to the token embedding); with
    unit-scale weights (std 1/sqrt(fan_in)), position embeddings of std 2 and a final layer norm of
    scale 0.3, six random prompts of one length get five or six different continuations, 3-8 different
    tokens each in 10, and next-token entropies of 2-4 nats (so that sampling depends on the seed).
    """
    rng = random.Random(seed)
    n_head = rng.choice([1, 2, 4])
    config = GPT2Config(
        n_layer=rng.choice([1, 2]),
        n_head=n_head,
        n_embd=n_head * rng.choice([8, 16]),
        n_positions=128,
        vocab_size=rng.choice([61, 97]),
    )
    model = GPT2(config).init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:  # the embeddings and the blocks' [C_in, C_out] matrices
                fan_in = p.shape[0] if name.startswith("h.") else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        model.wpe.weight.mul_(2)
        model.ln_f.weight.fill_(0.3)
    return model.to(dtype).eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------------
# Random workloads and the reference


@dataclasses.dataclass
class Workload:
    seed: int
    prompts: list[list[int]]
    settings: list[dict]  # per request, over COMMON
    arrivals: Optional[list[int]]
    engine: dict  # LLMEngine's keyword arguments
    prefix_len: int

    def describe(self) -> str:
        lengths = [len(p) for p in self.prompts]
        return (
            f"workload seed={self.seed}: engine {self.engine}, prefix {self.prefix_len} tokens, "
            f"prompt lengths {lengths}, arrivals {self.arrivals}, settings {self.settings}"
        )


COMMON = dict(eos_token_id=None)  # tiny vocabularies have no <|endoftext|>
TOKENIZER = get_tokenizer()


def sampling_settings(rng: random.Random) -> dict:
    kind = rng.choice(["greedy", "greedy", "temperature", "top_k", "top_p", "min_p", "repetition", "all"])
    s = {}
    if kind != "greedy" and kind != "repetition":
        s.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(10_000))
    if kind in ("top_k", "all"):
        s["top_k"] = rng.choice([1, 3, 10])
    if kind in ("top_p", "all"):
        s["top_p"] = rng.choice([0.5, 0.9])
    if kind in ("min_p", "all"):
        s["min_p"] = rng.choice([0.05, 0.2])
    if kind in ("repetition", "all"):
        s["repetition_penalty"] = rng.choice([1.3, 2.0])
    return s


def random_workload(seed: int, model: GPT2) -> Workload:
    rng = random.Random(seed)
    V, P = model.config.vocab_size, model.config.n_positions
    bs = rng.choice([1, 4, 4, 16, 16])
    tokens = lambda n: [rng.randrange(V) for _ in range(n)]  # noqa: E731
    max_prompt = {1: 20, 4: 36, 16: 60}[bs]
    prefix_len = min(rng.randint(0, 3) * bs + (0 if rng.random() < 0.5 else rng.randrange(bs)), max_prompt - 8)
    prefix = tokens(prefix_len)
    prompts, settings = [], []
    for _ in range(rng.randint(1, 7)):
        if prefix and rng.random() < 0.15:
            prompt = list(prefix)  # the whole system prompt and nothing else
        elif prefix and rng.random() < 0.75:
            prompt = prefix + tokens(rng.randint(0, max_prompt - prefix_len))
        else:
            prompt = tokens(rng.randint(1, max_prompt))
        prompts.append(prompt)
        settings.append({"max_new_tokens": rng.randint(1, min(14, P - len(prompt))), **sampling_settings(rng)})
    largest = max(-(-(len(p) + s["max_new_tokens"]) // bs) for p, s in zip(prompts, settings))
    total = sum(len(p) + s["max_new_tokens"] for p, s in zip(prompts, settings))
    budgets = [3, 7, 16, 64, 512] + ([1] if total < 80 else [])  # one token a step: short workloads only
    engine = dict(
        block_size=bs,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice(budgets),
        prefix_caching=rng.random() < 0.75,
    )
    tight = rng.random()
    if tight < 0.5:
        engine["num_blocks"] = largest + rng.randint(0, 1)  # just enough for the largest: preemption
    elif tight < 0.8:
        engine["num_blocks"] = largest + rng.randint(2, 2 * largest)
    arrivals = None if rng.random() < 0.3 else [rng.randint(0, 12) for _ in prompts]
    engine["partition_size"] = rng.choice([1, 2 * bs, 3 * bs, 256])  # decode attention split, partitions merged
    return Workload(seed, prompts, settings, arrivals, engine, prefix_len)


def alone(model: GPT2, prompt: list[int], settings: dict) -> list[int]:
    """The reference: `generate` on this request by itself."""
    return generate(model, prompt, **{**COMMON, **settings})


def cut_at_stop(tokenizer, tokens: list[int], stop: list[str], eos: Optional[int]) -> list[int]:
    """The alone run cut at the token that completes a stop string (or EOS, or the end)."""
    for k in range(1, len(tokens) + 1):
        if tokens[k - 1] == eos or any(s in tokenizer.decode(tokens[:k]) for s in stop):
            return tokens[:k]
    return tokens


def with_eos_mid_way(rng: random.Random, model: GPT2, w: Workload) -> list[list[int]]:
    """References for the workload; about a third of the requests get an EOS token that really occurs
    in their own continuation, so that they stop mid-way, and one in ten a stop string from their own text
    (GPT-2's tokenizer reads the tiny models' ids 0-96 as characters)."""
    expected = []
    for prompt, s in zip(w.prompts, w.settings):
        tokens = alone(model, prompt, s)
        chance = rng.random()
        if len(tokens) > 1 and chance < 0.35:
            s["eos_token_id"] = tokens[rng.randrange(len(tokens) - 1)]
            tokens = alone(model, prompt, s)
            assert tokens[-1] == s["eos_token_id"] and len(tokens) < s["max_new_tokens"]
        elif len(tokens) > 1 and chance > 0.9:
            start = rng.randrange(1, len(tokens))
            text = TOKENIZER.decode(tokens[start : start + rng.randint(1, 2)])
            if "\ufffd" not in text:  # ids 94-96 are single bytes of multi-byte characters
                s["stop"] = [text]
                tokens = cut_at_stop(TOKENIZER, tokens, s["stop"], None)
        expected.append(tokens)
    return expected


def first_difference(model: GPT2, w: Workload, expected: list[list[int]], got: list[list[int]]) -> str:
    """Which request differs where, and the logit gap between the two tokens at that point (alone run)."""
    for r, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            i = next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), min(len(e), len(g)))
            gap = ""
            if i < min(len(e), len(g)):
                with torch.inference_mode():
                    logits = model(torch.tensor([w.prompts[r] + e[:i]]))[0, -1]
                gap = f"; logits there: expected token {logits[e[i]].item():.6g}, got token {logits[g[i]].item():.6g}"
            return (
                f"{w.describe()}\n  request {r} ({w.settings[r]}) differs at new token {i}:\n"
                f"  alone:  {e}\n  engine: {g}{gap}"
            )
    return ""


def assert_idle(engine: LLMEngine, w: Workload) -> None:
    """After a workload: no request left, every block back on the free list, no block referenced."""
    assert not engine.has_unfinished(), w.describe()
    assert engine.blocks.num_free == engine.blocks.num_blocks, w.describe()
    assert all(c == 0 for c in engine.blocks.allocator.ref_count), w.describe()
    assert engine.step() == [], w.describe()


def run_streaming(engine: LLMEngine, w: Workload) -> list[list[int]]:
    """Drive the engine with add_request/step as a server would, checking the stream: each request's tokens
    arrive in order, and exactly one of them, the last, says finished."""
    arrivals = w.arrivals or [0] * len(w.prompts)
    ids, streams, done = {}, {}, set()
    step = 0
    while len(ids) < len(w.prompts) or engine.has_unfinished():
        for i, a in enumerate(arrivals):
            if a == step:
                rid = engine.add_request(w.prompts[i], **{**COMMON, **w.settings[i]})
                ids[i], streams[rid] = rid, []
        busy = engine.has_unfinished()
        for rid, token, finished in engine.step():
            assert rid not in done, f"{w.describe()}\n  request {rid} got token {token} after it finished"
            streams[rid].append(token)
            if finished:
                done.add(rid)
        if busy:  # the step's limits: requests and tokens
            ran = engine.last_step
            assert 1 <= len(ran) <= w.engine.get("max_num_seqs", 32), f"{w.describe()}\n  step {step} ran {ran}"
            assert sum(n for _, n in ran) <= w.engine.get("max_num_batched_tokens", 512), f"{w.describe()}\n  {ran}"
        step += 1
        assert step < 10_000, f"{w.describe()}\n  no end after {step} steps"
    assert done == set(streams), f"{w.describe()}\n  finished: {sorted(done)} of {sorted(streams)}"
    return [streams[ids[i]] for i in range(len(w.prompts))]


@dataclasses.dataclass
class Tally:
    workloads: int = 0
    requests: int = 0
    tokens: int = 0
    preempted: int = 0  # workloads with at least one preemption
    cached: int = 0  # workloads where the prefix cache served tokens
    preempted_and_cached: int = 0
    chunked: int = 0  # workloads with a prompt longer than the token budget
    eos: int = 0  # requests stopped by EOS before max_new_tokens
    stop: int = 0  # requests stopped by a stop string before max_new_tokens


def run_workloads(seeds, make_model, tally: Tally, **engine_settings) -> None:
    """make_model(seed): a model, or an `Engine` with a learner's functions (both drivers, generate for the
    references and LLMEngine, run them). `engine_settings`: LLMEngine's keywords besides the workload's."""
    model = None
    for seed in seeds:
        if seed % 10 == 0 or model is None:  # a new random model every 10 workloads
            model = make_model(seed)
        plain, _ = as_model(model)
        w = random_workload(seed, plain)
        expected = with_eos_mid_way(random.Random(seed + 1), model, w)
        engine = LLMEngine(model, **w.engine, **engine_settings)
        try:
            if seed % 2:
                got = run_streaming(engine, w)
            else:
                got = engine.generate(w.prompts, arrivals=w.arrivals, settings=w.settings, **COMMON)
        except (PartError, ValueError, RuntimeError) as err:
            raise AssertionError(f"{w.describe()}\n  the engine raised {type(err).__name__}: {err}") from err
        assert got == expected, first_difference(plain, w, expected, got)
        assert_idle(engine, w)
        stats = engine.stats
        tally.workloads += 1
        tally.requests += len(w.prompts)
        tally.tokens += sum(map(len, expected))
        tally.preempted += stats["preemptions"] > 0
        tally.cached += stats["cached_tokens"] > 0
        tally.preempted_and_cached += stats["preemptions"] > 0 and stats["cached_tokens"] > 0
        tally.chunked += max(map(len, w.prompts)) > w.engine["max_num_batched_tokens"]
        early = [len(e) < s["max_new_tokens"] for e, s in zip(expected, w.settings)]
        tally.eos += sum(x and "eos_token_id" in s for x, s in zip(early, w.settings))
        tally.stop += sum(x and "stop" in s for x, s in zip(early, w.settings))


# --------------------------------------------------------------------------------------------------
# Property tests


def test_engine_gives_every_request_its_alone_tokens_fp32():
    tally = Tally()
    run_workloads(range(200), tiny_model, tally)
    print(f"\nfp32: {tally}")
    assert tally.workloads == 200
    # The workloads reach what they are meant to reach.
    assert tally.preempted >= 20 and tally.cached >= 20 and tally.preempted_and_cached >= 5, tally
    assert tally.chunked >= 50 and tally.eos >= 50 and tally.stop >= 20, tally


def test_engine_gives_every_request_its_alone_tokens_float64():
    tally = Tally()
    run_workloads(range(1000, 1040), lambda seed: tiny_model(seed, torch.float64), tally)
    print(f"\nfloat64: {tally}")
    assert tally.preempted >= 3 and tally.cached >= 3, tally


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_engine_gives_every_request_its_alone_tokens_on_cuda(dtype):
    """The same property on a GPU: the pools, tables and generators live on the device (float16 too)."""
    tally = Tally()
    run_workloads(range(2000, 2030), lambda seed: tiny_model(seed).to("cuda", dtype), tally)
    print(f"\ncuda {dtype}: {tally}")
    assert tally.workloads == 30 and tally.preempted >= 2 and tally.cached >= 2, tally


def test_aborted_requests_free_their_blocks_and_the_others_stay_exact():
    """A server aborts the requests of clients that went away: waiting, mid-prompt (chunked prefill) or decoding.
    Their blocks return at once, their tokens so far are the start of their alone run, and every other request
    still gets exactly its alone tokens."""
    aborted_where = {"waiting": 0, "prefill": 0, "decoding": 0}
    for seed in range(40):
        model = tiny_model(seed // 10)
        w = random_workload(seed, model)
        rng = random.Random(seed)
        engine = LLMEngine(model, **w.engine)
        ids = [engine.add_request(p, **{**COMMON, **s}) for p, s in zip(w.prompts, w.settings)]
        doomed = {rid: rng.randint(0, 6) for rid in ids if rng.random() < 0.4}  # abort before this step
        step = 0
        while engine.has_unfinished():
            for rid, when in doomed.items():
                request = engine.requests[rid]
                if when == step and not request.finished:
                    where = (
                        "waiting"
                        if request in engine.scheduler.waiting
                        else "prefill"
                        if request.num_computed < len(request.prompt)
                        else "decoding"
                    )
                    aborted_where[where] += 1
                    engine.abort(rid)
                    assert request.finished and request.block_table == [], w.describe()
                    assert request not in engine.scheduler.running and request not in engine.scheduler.waiting
            engine.step()
            step += 1
        for rid, prompt, settings in zip(ids, w.prompts, w.settings):
            got, expected = engine.requests[rid].generated, alone(model, prompt, settings)
            if rid in doomed:
                assert got == expected[: len(got)], w.describe()
            else:
                assert got == expected, w.describe()
        assert_idle(engine, w)
        assert engine.release(ids[0]) is not None and ids[0] not in engine.requests
        assert engine.add_request(w.prompts[0], **{**COMMON, **w.settings[0]}) == len(ids)  # ids are never reused
    assert min(aborted_where.values()) >= 3, aborted_where


def test_logprobs_are_the_models_log_softmax_and_its_likeliest_tokens():
    model = tiny_model(3)
    engine = LLMEngine(model, max_num_batched_tokens=8)  # chunked prompts: logprobs only of new tokens
    prompts = [[5, 9, 2, 7, 1, 3, 3, 8, 4, 6, 10, 2], [1, 2]]
    rids = [engine.add_request(p, max_new_tokens=6, temperature=1.0, seed=4, logprobs=3, **COMMON) for p in prompts]
    plain = engine.add_request([4, 4], max_new_tokens=3, **COMMON)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[plain].logprobs == []
    for rid, prompt in zip(rids, prompts):
        request = engine.requests[rid]
        tokens = request.generated
        assert tokens == alone(model, prompt, dict(max_new_tokens=6, temperature=1.0, seed=4))
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].double(), -1)
        assert len(request.logprobs) == len(tokens)
        for step, (token, lp) in enumerate(zip(tokens, request.logprobs)):
            assert abs(lp.logprob - logp[step, token].item()) < 1e-5
            values, index = logp[step].topk(3)
            assert [i for i, _ in lp.top] == index.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top], dtype=torch.double), values, atol=1e-5)
    with pytest.raises(ValueError, match="logprobs must be None or an integer >= 0"):
        engine.add_request([1], logprobs=-1)


@pytest.mark.parametrize("mine", [False, True], ids=["engine's", "my batching functions"])
def test_preempting_a_request_that_shares_prefix_blocks_frees_only_its_own(mine):
    """Requests 1 and 2 share the block of [1, 2, 3, 4]; when request 0 needs a block, preempting request 2
    frees only its own block, not the shared one (found by the property test, workload seed 115)."""
    model = learner_model(3, **MINE) if mine else tiny_model(3)
    engine = LLMEngine(model, block_size=4, num_blocks=4)
    w = Workload(
        0,
        [[17], [1, 2, 3, 4, 20, 35], [1, 2, 3, 4, 44, 24]],
        [{"max_new_tokens": n} for n in (5, 4, 5)],
        [0, 1, 2],
        dict(block_size=4, num_blocks=4),
        4,
    )
    expected = [alone(tiny_model(3), p, s) for p, s in zip(w.prompts, w.settings)]
    assert run_streaming(engine, w) == expected
    assert engine.stats["preemptions"] > 0 and engine.stats["cached_tokens"] > 0
    assert_idle(engine, w)


def test_requests_that_fill_the_whole_context_and_an_engine_used_twice():
    """prompt + max_new_tokens == n_positions, pools too small for two at once: the last positions of the model,
    recomputed after preemption; then a second generate on the same engine, prompts given as tensors."""
    model = tiny_model(6)
    P = model.config.n_positions
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (P - 9, P - 3, 5)]
    settings = [{"max_new_tokens": 9}, {"max_new_tokens": 3, "temperature": 1.2, "seed": 1}, {"max_new_tokens": 8}]
    expected = [alone(model, p.tolist(), s) for p, s in zip(prompts, settings)]
    engine = LLMEngine(model, block_size=16, num_blocks=P // 16 + 2, max_num_batched_tokens=20)
    for _ in range(2):
        assert engine.generate(prompts, arrivals=[0, 0, 1], settings=settings, **COMMON) == expected
        assert engine.stats["preemptions"] > 0
        assert_idle(engine, Workload(6, [], settings, None, {}, 0))


def test_step_on_an_idle_engine_returns_nothing():
    engine = LLMEngine(tiny_model(0), block_size=4)
    assert engine.step() == [] and not engine.has_unfinished() and engine.stats["steps"] == 0
    assert engine.generate([]) == []


# --------------------------------------------------------------------------------------------------
# The bundled model: text prompts with a shared system prompt, sampling, stop strings

SHAKESPEARE = [
    "ROMEO:\nBut soft, what light",
    "JULIET:\nO Romeo, Romeo",
    "HAMLET:\nTo be, or not",
    "KING RICHARD III:\nNow is the winter",
    "MACBETH:\nIs this a dagger",
    "First Citizen:\nBefore we",
]


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("gpt2-shakespeare")


@pytest.mark.parametrize("seed", range(3))
def test_bundled_model_workloads_with_stop_strings(shakespeare, tokenizer, seed):
    rng = random.Random(seed)
    system = tokenizer.encode("A scene from a play, in the style of Shakespeare.\n\n")  # 13 tokens
    bs = [16, 4, 1][seed]
    prompts, settings, expected = [], [], []
    for line in rng.sample(SHAKESPEARE, 5):
        prompt = (system if rng.random() < 0.8 else []) + tokenizer.encode(line)
        s = {"max_new_tokens": rng.randint(4, 16), **sampling_settings(rng)}
        tokens = generate(shakespeare, prompt, **s)
        text = tokenizer.decode(tokens)
        if len(text) > 4 and rng.random() < 0.6:  # a stop string that occurs in the continuation
            start = rng.randrange(1, len(text) - 2)
            s["stop"] = ["never in any play", text[start : start + rng.randint(1, 3)]]
            tokens = cut_at_stop(tokenizer, tokens, s["stop"], s.get("eos_token_id", 50256))
        prompts.append(prompt)
        settings.append(s)
        expected.append(tokens)
    largest = max(-(-(len(p) + s["max_new_tokens"]) // bs) for p, s in zip(prompts, settings))
    limits = dict(block_size=bs, num_blocks=largest + 1, max_num_seqs=4, max_num_batched_tokens=24)
    engine = LLMEngine(shakespeare, **limits)
    w = Workload(seed, prompts, settings, [rng.randint(0, 6) for _ in prompts], limits, len(system))
    got = run_streaming(engine, w) if seed % 2 else engine.generate(prompts, w.arrivals, settings)
    assert got == expected, first_difference(shakespeare, w, expected, got)
    assert engine.stats["preemptions"] > 0 and engine.stats["cached_tokens"] > 0, engine.stats
    assert any(s.get("stop") and len(e) < s["max_new_tokens"] for s, e in zip(settings, expected))
    assert_idle(engine, w)


# --------------------------------------------------------------------------------------------------
# Requests that can never run are refused; the engine goes on with the others


def test_refused_requests_leave_the_engine_serving_the_others():
    model = tiny_model(5)
    V = model.config.vocab_size
    engine = LLMEngine(model, block_size=4, num_blocks=10)  # 40 positions
    good = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    expected = [alone(model, p, {"max_new_tokens": 8}) for p in good]
    ids = [engine.add_request(good[0], max_new_tokens=8, eos_token_id=None)]
    engine.step()
    refusals = [
        (
            dict(prompt_ids=list(range(30)), max_new_tokens=20),
            r"needs 13 blocks of 4 positions, but the pool has "
            r"num_blocks=10; lower max_new_tokens or make the pool",
        ),
        (dict(prompt_ids=[1] * 120, max_new_tokens=9), r"n_positions=128; lower max_new_tokens to at most 8"),
        (dict(prompt_ids=[1] * 128, max_new_tokens=1), r"n_positions=128; shorten the prompt"),
        (dict(prompt_ids=[]), r"empty: give at least one token"),
        (dict(prompt_ids=[1, V]), rf"holds {V}, not a token id in \[0, {V}\)"),
        (dict(prompt_ids=[1, -1]), r"holds -1, not a token id"),
        (dict(prompt_ids=[1, 2.0]), r"holds 2.0, not a token id"),
        (dict(prompt_ids=[1, True]), r"holds True, not a token id"),
        (dict(prompt_ids=[1], temperature=-0.5), r"temperature must be a number >= 0"),
        (dict(prompt_ids=[1], top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(prompt_ids=[1], max_new_tokens=0), r"max_new_tokens must be an integer >= 1"),
        (dict(prompt_ids=[1], eos_token_id=V), rf"eos_token_id must be a token id in \[0, {V}\) or None"),
        (dict(prompt_ids=[1], stop="abc"), r"stop must be a list of non-empty strings"),
        (dict(prompt_ids=[1], stop=[""]), r"stop must be a list of non-empty strings"),
        (dict(prompt_ids=[1], temprature=0.7), r"unknown setting\(s\) temprature; the settings are max_new_tokens"),
        (dict(prompt_ids=[1], num_beams=2), r"unknown setting\(s\) num_beams"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            engine.add_request(**{"eos_token_id": None, **kwargs})
        engine.step()  # the others go on meanwhile
    ids += [engine.add_request(p, max_new_tokens=8, eos_token_id=None) for p in good[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[i].generated for i in ids] == expected
    assert sorted(engine.requests) == ids == [0, 1, 2]  # refused requests took no id
    assert engine.blocks.num_free == 10


@pytest.mark.parametrize(
    "name, value",
    [
        ("block_size", 0),
        ("num_blocks", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("block_size", 2.5),
        ("max_num_seqs", True),
        ("num_blocks", "8"),
        ("max_num_batched_tokens", -3),
        ("kv_cache_memory", 0),
        ("kv_cache_memory", 1.5e6),
    ],
)
def test_bad_engine_arguments_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value!r}"):
        LLMEngine(tiny_model(0), **{name: value})


def test_kv_cache_memory_sizes_the_pool_by_chapter_06s_count():
    model = tiny_model(0)
    cfg = model.config
    block = 2 * cfg.n_layer * cfg.n_embd * 4 * 4  # keys and values of 4 positions in float32, bytes
    engine = LLMEngine(model, block_size=4, kv_cache_memory=37 * block + block - 1)
    pool = sum(t.numel() * t.element_size() for t in engine.cache.k + engine.cache.v)
    assert engine.blocks.num_blocks == 37 and pool == 37 * block
    assert engine.generate([[5, 6, 7]], max_new_tokens=6, **COMMON) == [alone(model, [5, 6, 7], dict(max_new_tokens=6))]
    with pytest.raises(ValueError, match=rf"hold no block of 4 positions \(a block's keys and values take {block}"):
        LLMEngine(model, block_size=4, kv_cache_memory=block - 1)
    with pytest.raises(ValueError, match="give num_blocks or kv_cache_memory, not both"):
        LLMEngine(model, num_blocks=8, kv_cache_memory=10**6)


def test_generate_refuses_bad_arrivals_and_settings_before_running_anything():
    model = tiny_model(1)
    engine = LLMEngine(model, block_size=4)
    prompts = [[1, 2], [3]]
    for kwargs, message in [
        (dict(arrivals=[0]), r"arrivals must hold one step number >= 0 per prompt \(2\)"),
        (dict(arrivals=[0, 1, 2]), r"arrivals must hold one step number"),
        (dict(arrivals=[0, -1]), r"arrivals must hold one step number"),
        (dict(arrivals=[0, 1.5]), r"arrivals must hold one step number"),
        (dict(settings=[{}]), r"settings must hold one dict per prompt \(2\)"),
        (dict(settings=[{}, 0.7]), r"settings must hold one dict per prompt"),
        (dict(settings=[{}, {"temperature": -1}]), r"prompt 1: temperature must be"),
        (dict(settings=[{"top_q": 0.9}, {}]), r"prompt 0: unknown setting\(s\) top_q"),
        (dict(max_new_tokens=200), r"prompt 0: .*n_positions=128"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, eos_token_id=None, **kwargs)
    with pytest.raises(ValueError, match=r"prompt 1: the prompt is empty"):
        engine.generate([[1], []], eos_token_id=None)
    assert engine.requests == {} and engine.stats["steps"] == 0  # nothing ran
    # settings override the common ones, per prompt
    got = engine.generate(
        prompts, settings=[{"max_new_tokens": 3}, {"temperature": 0.9, "seed": 4}], eos_token_id=None, max_new_tokens=5
    )
    assert got == [
        alone(model, [1, 2], {"max_new_tokens": 3}),
        alone(model, [3], {"max_new_tokens": 5, "temperature": 0.9, "seed": 4}),
    ]


# --------------------------------------------------------------------------------------------------
# A learner's batching functions: independent correct versions give the same tokens; broken ones are
# stopped with a PartError naming the part


def my_left_pad(prompts, pad_id=0):
    width = max(len(p) for p in prompts)
    rows = [
        (
            [pad_id] * (width - len(p)) + list(p),
            [0] * (width - len(p)) + [1] * len(p),
            [0] * (width - len(p)) + list(range(len(p))),
        )
        for p in prompts
    ]
    return tuple(torch.tensor([row[i] for row in rows]) for i in range(3))


class MyBlockAllocator:
    """A stack of free blocks (the most recently freed is reused first) and a dict of users."""

    def __init__(self, num_blocks):
        self.stack = list(reversed(range(num_blocks)))
        self.users = {}

    @property
    def num_free(self):
        return len(self.stack)

    @property
    def ref_count(self):
        return [self.users.get(b, 0) for b in range(len(self.stack) + len(self.users))]

    def allocate(self):
        block = self.stack.pop()
        self.users[block] = 1
        return block

    def share(self, block):
        if block not in self.users:
            self.stack.remove(block)
        self.users[block] = self.users.get(block, 0) + 1

    def release(self, block):
        self.users[block] -= 1
        if not self.users[block]:
            del self.users[block]
            self.stack.append(block)


def my_block_hashes(token_ids, block_size):
    """Another chained hash: each full block keyed by all the tokens up to its end."""
    return [hash(tuple(token_ids[:end])) for end in range(block_size, len(token_ids) + 1, block_size)]


def my_paged_attention(q, k_pool, v_pool, block_table, lengths):
    """One sequence at a time, the scores of all its blocks first, then one softmax (vLLM V1's kernel's order)."""
    bs, outs, lses = k_pool.shape[1], [], []
    for g in range(q.shape[0]):
        n = int(lengths[g])
        blocks = block_table[g, : -(-n // bs)].tolist()
        scores = torch.cat([torch.einsum("hd,thd->ht", q[g], k_pool[b]) for b in blocks], dim=1)[:, :n]  # [H, n]
        scores = scores / q.shape[-1] ** 0.5
        top = scores.max(dim=1, keepdim=True).values
        weights = torch.exp(scores - top)  # [H, n]
        out = sum(
            torch.einsum("ht,thd->hd", weights[:, i * bs : (i + 1) * bs], v_pool[b][: n - i * bs])
            for i, b in enumerate(blocks)
        )
        total = weights.sum(dim=1)
        outs.append(out / total[:, None])
        lses.append(top[:, 0] + torch.log(total))
    return torch.stack(outs), torch.stack(lses)


def my_schedule(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
    """Plan the running requests; if they do not fit, preempt the newest and plan again. Then admit every
    waiting request that fits (not only a prefix of the queue)."""
    kept, preempted = list(running), []
    while True:
        plan, budget = {}, max_num_batched_tokens
        free = num_free_blocks + sum(s.num_unshared_blocks for s in running if s.id in preempted)
        for s in kept:
            n = min(s.num_tokens - s.num_computed, budget)
            need = -(-(s.num_computed + n) // block_size) - s.num_blocks
            if n == 0 or need > free:
                break
            plan[s.id], free, budget = n, free - need, budget - n
        else:
            break
        if n == 0:
            break
        preempted.append(kept.pop().id)
    for s in [] if preempted else waiting:
        n = min(s.num_tokens - s.num_computed, budget)
        need = -(-(s.num_computed + n) // block_size) - s.num_blocks
        if len(plan) < max_num_seqs and n > 0 and need <= free:
            plan[s.id], free, budget = n, free - need, budget - n
    return plan, preempted


MINE = dict(
    left_pad=my_left_pad,
    BlockAllocator=MyBlockAllocator,
    block_hashes=my_block_hashes,
    paged_attention=my_paged_attention,
    schedule=my_schedule,
)


def learner_model(seed: int = 7, **overrides) -> Engine:
    """tiny_model(seed) with a learner's functions, as `my_engine()` gives them: LLMEngine takes the batching
    functions (`batching=guarded(Batching, ...)`), generate the left_pad (`left_pad=guard("left_pad", ...)`)."""
    functions = {}
    if "left_pad" in overrides:
        functions["left_pad"] = guard("left_pad", overrides.pop("left_pad"))
    if overrides:
        functions["batching"] = guarded(Batching, **overrides)
    return Engine(tiny_model(seed), None, functions)


def my_schedule_only_preempts(running, waiting, num_free_blocks, **limits):
    """Slow but correct: starts a request when nothing runs, else preempts what runs and schedules nothing."""
    if running:
        return {}, [s.id for s in reversed(running)]
    return {s.id: s.num_tokens - s.num_computed for s in waiting[:1]}, []


def test_a_step_that_only_preempts_computes_nothing_and_the_tokens_stay_exact():
    model, reference = learner_model(9, schedule=my_schedule_only_preempts), tiny_model(9)
    prompts = [[9, 9], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]]
    settings = [{"max_new_tokens": 5}, {"max_new_tokens": 4, "temperature": 1.0, "seed": 2}, {"max_new_tokens": 3}]
    engine = LLMEngine(model, block_size=4, num_blocks=5)
    assert engine.generate(prompts, settings=settings, **COMMON) == [
        alone(reference, p, s) for p, s in zip(prompts, settings)
    ]
    assert engine.stats["preemptions"] >= 8


def test_my_batching_functions_give_the_same_tokens():
    reference, model = tiny_model(7), learner_model(7, **MINE)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    assert generate(model, prompts, max_new_tokens=6, eos_token_id=None) == [
        alone(reference, p, {"max_new_tokens": 6}) for p in prompts
    ]  # left_pad: a static batch
    tally = Tally()
    run_workloads(range(2000, 2024), lambda seed: model, tally)  # the references come from the same model
    print(f"\nmy batching functions: {tally}")
    assert tally.preempted >= 3 and tally.cached >= 3, tally


def my_paged_attention_forgets_lse(q, k_pool, v_pool, block_table, lengths):
    return paged_attention(q, k_pool, v_pool, block_table, lengths)[0]


class MyAllocatorHandsOutABlockTwice(MyBlockAllocator):
    def allocate(self):
        block = self.stack[-1]  # forgets to take it off the free list
        self.users[block] = self.users.get(block, 0) + 1
        return block


def my_schedule_does_nothing(running, waiting, num_free_blocks, **limits):
    return {}, []


def my_schedule_ignores_the_free_blocks(running, waiting, num_free_blocks, *, max_num_batched_tokens, **limits):
    return {s.id: s.num_tokens - s.num_computed for s in running + waiting}, []


def my_schedule_gives_too_many_tokens(running, waiting, num_free_blocks, **limits):
    return {s.id: s.num_tokens for s in running + waiting}, []  # forgets what is computed


def my_schedule_preempts_a_waiting_request(running, waiting, num_free_blocks, **limits):
    return {}, [s.id for s in waiting]


def my_block_hashes_as_text(token_ids, block_size):
    return [f"{h:x}" for h in block_hashes(token_ids, block_size)]


def my_block_hashes_salted_by_length(token_ids, block_size):
    return [hash((h, len(token_ids))) for h in block_hashes(token_ids, block_size)]


def my_paged_attention_raises(q, k_pool, v_pool, block_table, lengths):
    return k_pool[block_table[:, lengths]]  # IndexError


def my_left_pad_forgets_positions(prompts, pad_id=0):
    ids, mask, _ = my_left_pad(prompts, pad_id)
    return ids, mask


def my_schedule_thrashes(running, waiting, num_free_blocks, *, block_size, **limits):
    """Preempts whatever runs and starts another waiting request a block at a time: no prompt ever completes."""
    start = [s for s in waiting if s.num_computed == 0][:1]
    return {s.id: min(block_size, s.num_tokens - s.num_computed) for s in start}, [s.id for s in reversed(running)]


BROKEN = [
    (
        "paged_attention",
        my_paged_attention_forgets_lse,
        r"part 'paged_attention' \(my_paged_attention_forgets_lse\) returned "
        r"\('shape \(\d+, \d+, \d+\) torch.float32',\); expected \(out, lse\) of shapes",
    ),
    (
        "paged_attention",
        my_paged_attention_raises,
        r"part 'paged_attention' \(my_paged_attention_raises\) raised IndexError",
    ),
    (
        "BlockAllocator",
        MyAllocatorHandsOutABlockTwice,
        r"part 'BlockAllocator' \(MyAllocatorHandsOutABlockTwice\) num_free is \d+, but \d+ blocks are not in use",
    ),
    ("schedule", my_schedule_does_nothing, r"part 'schedule' scheduled nothing and preempted nothing"),
    ("schedule", my_schedule_ignores_the_free_blocks, r"the scheduler gave out more blocks than were free"),
    ("schedule", my_schedule_gives_too_many_tokens, r"part 'schedule' gave request 0 \d+ tokens; it has \d+ to"),
    ("schedule", my_schedule_preempts_a_waiting_request, r"part 'schedule' preempted request 0, which is not running"),
    ("schedule", my_schedule_thrashes, r"part 'schedule' makes no progress: \d+ steps without a new token"),
    (
        "block_hashes",
        my_block_hashes_as_text,
        r"part 'block_hashes' \(my_block_hashes_as_text\) returned .*; expected a list of \d+ integers",
    ),
    (
        "block_hashes",
        my_block_hashes_salted_by_length,
        r"part 'block_hashes' gave the first \d+ blocks of a request other hashes once its tokens grew",
    ),
]


@pytest.mark.parametrize("part, fn, message", BROKEN, ids=[fn.__name__ for _, fn, _ in BROKEN])
def test_broken_batching_functions_are_stopped_naming_the_part(part, fn, message):
    """Never a silently wrong token, never a hang: a PartError that names the part."""
    model = learner_model(8, **{part: fn})
    engine = LLMEngine(model, block_size=4, num_blocks=5, max_num_batched_tokens=16, prefix_caching=part != "schedule")
    prompts = [[9, 9], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]]  # a shared block; tables not in block order
    with pytest.raises(PartError, match=message):
        for step in range(300):
            if step < len(prompts):
                engine.add_request(prompts[step], max_new_tokens=8, eos_token_id=None)
            engine.step()
        assert not engine.has_unfinished(), "a hang: no end after 300 steps"
        got = [r.generated for r in engine.requests.values()]
        assert got == [alone(tiny_model(8), p, {"max_new_tokens": 8}) for p in prompts], "silently wrong tokens"
        pytest.fail("ran to the end without a PartError")


def test_a_broken_left_pad_is_stopped_naming_the_part():
    model = learner_model(8, left_pad=my_left_pad_forgets_positions)
    with pytest.raises(
        PartError,
        match=r"(?s)part 'left_pad' \(my_left_pad_forgets_positions\) returned .*; expected "
        r"\(input_ids, attention_mask, position_ids\)",
    ):
        generate(model, [[1, 2], [3]], max_new_tokens=2, eos_token_id=None)


# --------------------------------------------------------------------------------------------------
# The paged pieces against plain references


def test_slot_mapping_and_gather_kv_match_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    for num_blocks, bs, H, D in [(7, 4, 2, 3), (12, 1, 1, 5), (5, 16, 4, 2)]:
        pool = torch.randn(num_blocks, bs, H, D, generator=g, dtype=torch.float64)
        for _ in range(5):
            n = int(torch.randint(1, num_blocks + 1, (1,), generator=g))
            table = torch.randperm(num_blocks, generator=g)[:n]
            length = int(torch.randint((n - 1) * bs + 1, n * bs + 1, (1,), generator=g))  # ends in its last block
            positions = torch.randperm(length, generator=g)
            want = [int(table[p // bs]) * bs + p % bs for p in positions.tolist()]
            assert slot_mapping(table, positions, bs).tolist() == want
            expected = torch.empty(H, length, D, dtype=torch.float64)
            for p in range(length):
                expected[:, p] = pool[table[p // bs], p % bs]
            assert torch.equal(gather_kv(pool, table, length), expected)
            # the keys written through the slots are the ones read through the table
            written = torch.zeros_like(pool)
            written.view(-1, H, D)[slot_mapping(table, torch.arange(length), bs)] = expected.transpose(0, 1)
            assert torch.equal(gather_kv(written, table, length), expected)


@pytest.mark.parametrize("partition_blocks", [1, 2, 3, 100])
def test_paged_attention_and_its_partitions_match_attention_over_the_gathered_keys(partition_blocks):
    """paged_attention (and paged_decode, its partitions merged) give softmax(q k / sqrt(D)) v and the log-sum-exp
    over each sequence's first `length` positions, whatever the rest of its last block holds."""
    g = torch.Generator().manual_seed(partition_blocks)
    num_blocks, bs, H, D = 30, 4, 3, 8
    k_pool, v_pool = torch.randn(2, num_blocks, bs, H, D, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([1, 4, 5, 17, 23, 9])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:6] for _ in lengths])  # [G, 6], past length too
    q = torch.randn(len(lengths), H, D, generator=g, dtype=torch.float64)
    out, lse = paged_attention(q, k_pool, v_pool, tables, lengths)
    decoded = paged_decode(q, k_pool, v_pool, partitions(tables, lengths, partition_blocks, bs))
    for row, n in enumerate(lengths.tolist()):
        keys, values = gather_kv(k_pool, tables[row], n), gather_kv(v_pool, tables[row], n)  # [H, n, D]
        scores = (keys @ q[row, :, :, None])[..., 0] / D**0.5  # [H, n]
        expected = (torch.softmax(scores, dim=-1)[:, None] @ values)[:, 0]  # [H, D]
        assert torch.allclose(out[row], expected, atol=1e-12) and torch.allclose(decoded[row], expected, atol=1e-12)
        assert torch.allclose(lse[row], torch.logsumexp(scores, dim=-1), atol=1e-12)


def test_block_hashes_are_chained_over_full_blocks():
    tokens = [5, 1, 4, 1, 5, 9, 2]
    hashes = block_hashes(tokens, 2)
    assert len(hashes) == 3 and block_hashes(tokens[:6], 2) == hashes and block_hashes(tokens[:4], 2) == hashes[:2]
    other = block_hashes([6, 1, 4, 1, 5, 9], 2)  # the same blocks 1 and 2 after another block 0
    assert len(set(hashes + other)) == 6
    assert my_block_hashes(tokens, 2) != hashes and len(my_block_hashes(tokens, 2)) == 3


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_paged_forward_of_a_mixed_batch_matches_each_request_alone(dtype, atol):
    """Decode rows and prefill chunks in one step give the logits `model(ids)` gives each request alone."""
    model = tiny_model(4, dtype)
    V, bs = model.config.vocab_size, 4
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(model.config, 40, bs, dtype=dtype)
    free = torch.randperm(40, generator=g).tolist()  # tables out of block order
    lengths = [9, 13, 1, 22, 6, 17]
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lengths]
    # {request: (computed before the step, after it)}: decodes (n-1 -> n), prefill chunks, whole prompts
    steps = [
        {0: (0, 8), 1: (0, 7), 3: (0, 12), 4: (0, 2)},  # prefills of several requests
        {0: (8, 9), 1: (7, 13), 2: (0, 1), 3: (12, 20), 4: (2, 3), 5: (0, 16)},  # 3 one-token rows, 3 chunks
        {3: (20, 21), 4: (3, 4), 5: (16, 17)},  # decodes only
        {3: (21, 22), 4: (4, 6)},
    ]  # one decode, one chunk
    worst = 0.0
    for step in steps:
        chunks = [Chunk(seqs[r][a:b], a, tables[r]) for r, (a, b) in step.items()]
        got = forward(model, cache, chunks)  # [len(chunks), V]
        for row, (r, (a, b)) in enumerate(step.items()):
            with torch.inference_mode():
                expected = model(torch.tensor([seqs[r][:b]]))[0, -1]
            diff = (got[row] - expected).abs().max().item()
            worst = max(worst, diff)
            assert diff <= atol, f"request {r}, positions {a}..{b - 1}: logits differ by {diff:.3g}"
    print(f"\nworst logit difference, {dtype}: {worst:.3g}")
