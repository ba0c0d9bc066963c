"""presence_penalty, frequency_penalty, logit_bias and stop_token_ids in the engine: each processor against a direct
computation on logits, their order (vLLM's: bias, repetition, frequency and presence, then temperature), `generate`
against a step-by-step loop written here (the counts are of *generated* tokens only), speculative decoding and
`LLMEngine` (continuous batching, prefix caching, preemption) against `generate` alone, and the command line's flags.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmcourse.engine.generate import generate, new_generator
from llmcourse.engine.sampling import (
    Sampler,
    SamplingParams,
    add_logit_bias,
    presence_frequency_penalty,
    process_logits,
    token_counts,
)
from llmcourse.serving.llm_engine import LLMEngine

from .test_cli import run_here
from .test_llm_engine import (
    COMMON,
    assert_idle,
    first_difference,
    random_workload,
    run_streaming,
    tiny_model,
    with_eos_mid_way,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def direct(logits, settings: SamplingParams, seen, generated: list[list[int]]):
    """The processors written out element by element, in vLLM's order, in float32 as the engine computes."""
    x = logits.clone()
    for b in range(len(x)):
        for token, bias in settings.logit_bias:
            x[b, token] = x[b, token] + bias
        for token in range(x.shape[1]):
            if seen is not None and seen[b, token] and settings.repetition_penalty != 1:
                r = settings.repetition_penalty
                x[b, token] = x[b, token] * r if x[b, token] < 0 else x[b, token] / r
            count = generated[b].count(token)
            x[b, token] = (
                x[b, token]
                - count * torch.tensor(settings.frequency_penalty)
                - (count > 0) * torch.tensor(settings.presence_penalty)
            )
    return x if settings.greedy else x / settings.temperature


def test_each_processor_equals_a_direct_computation_on_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g) * 3
    bias = [(0, 2.5), (4, -100.0), (10, 0.125)]
    expected = logits.clone()
    for token, b in bias:
        expected[:, token] += b
    assert torch.equal(add_logit_bias(logits, bias), expected)

    generated = [[1, 1, 1, 5], [], [10, 2, 10]]
    counts = token_counts(generated, 11)
    expected = logits.clone()
    for b, row in enumerate(generated):
        for token in set(row):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            expected[b, token] = expected[b, token] - row.count(token) * torch.tensor(0.7) - torch.tensor(0.3)
    assert torch.equal(presence_frequency_penalty(logits, counts, 0.7, 0.3), expected)
    assert torch.equal(presence_frequency_penalty(logits, counts * 0, 0.7, 0.3), logits)  # nothing generated: no change


@pytest.mark.parametrize(
    "settings",
    [
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={3: 4.0, 7: -2.0}),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.9,
            logit_bias={0: -100, 3: 1.25},
        ),  # fmt: skip
        SamplingParams(temperature=1.3, repetition_penalty=0.8, frequency_penalty=2.0),
    ],
)
def test_the_processing_order_is_vllms_bias_repetition_frequency_presence_then_temperature(settings):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, generator=g) * 2
    generated = [[3, 3, 8], [0]]
    prompt = [[1, 2], [2, 5, 5]]
    seen = torch.zeros(2, 9, dtype=torch.bool)
    for b in range(2):
        seen[b, prompt[b] + generated[b]] = True  # the repetition penalty: prompt and generated
    got = process_logits(logits, settings, seen, token_counts(generated, 9))  # the others: generated only
    assert torch.equal(got, direct(logits, settings, seen, generated))


def test_greedy_choices_feel_the_bias_and_the_penalties_and_the_settings_are_checked():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    counts = torch.tensor([[1.0, 0.0, 0.0]])
    assert Sampler().next_token(logits, SamplingParams(), counts=counts).item() == 0
    assert Sampler().next_token(logits, SamplingParams(presence_penalty=0.2), counts=counts).item() == 1
    assert Sampler().next_token(logits, SamplingParams(logit_bias={2: 100})).item() == 2
    for bad, field in [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={i: 1 for i in range(301)}), "logit_bias"),
        (dict(stop_token_ids=[-2]), "stop_token_ids"),
        (dict(num_beams=2, presence_penalty=0.5), "beam search"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    model = tiny_model(0)  # vocabulary 61 or 97
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias holds {V}, not a token id"):
        SamplingParams(logit_bias={V: 1}).for_model(model)
    with pytest.raises(ValueError, match=rf"stop_token_ids holds {V + 3}"):
        SamplingParams(stop_token_ids=[V + 3]).for_model(model)
    params = SamplingParams(eos_token_id=5, stop_token_ids=[7, 5]).for_model(model)
    assert params.eos_token_id == (5, 7) and params.stop_token_ids == ()


def step_by_step(model, prompt, settings: SamplingParams) -> list[int]:
    """The reference: the whole text through the model at every step (no cache), the processors written here."""
    generator = new_generator(model, settings.seed)
    ids, generated = list(prompt), []
    for _ in range(settings.max_new_tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([ids]))[:, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[0, ids] = True
        x = direct(logits, settings, seen, [generated])
        token = int(x.argmax()) if settings.greedy else int(torch.multinomial(x.softmax(-1), 1, generator=generator))
        ids.append(token)
        generated.append(token)
    return generated


@pytest.mark.parametrize("seed", range(6))
def test_generate_applies_them_as_a_direct_computation_does_over_generated_tokens_only(seed):
    model = tiny_model(seed, torch.float64)
    rng = random.Random(seed)
    V = model.config.vocab_size
    prompt = [rng.randrange(V) for _ in range(rng.randint(3, 12))]
    settings = SamplingParams(
        max_new_tokens=12,
        temperature=[0.0, 0.8][seed % 2],
        seed=seed,
        presence_penalty=rng.choice([-0.5, 0.0, 1.0]),
        frequency_penalty=rng.choice([0.3, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        logit_bias={rng.randrange(V): 3.0, rng.randrange(V): -100},
        eos_token_id=None,
    )
    want = step_by_step(model, prompt, settings)
    assert generate(model, prompt, settings) == want
    if settings.greedy:  # batched with a shorter prompt (a sampled batch draws from one generator for both rows)
        assert generate(model, [prompt, prompt[:2]], settings)[0] == want
    plain = generate(model, prompt, max_new_tokens=12, temperature=settings.temperature, seed=seed, eos_token_id=None)
    assert plain != want, "the settings change this continuation"


def test_speculative_decoding_keeps_greedy_output_with_penalties_and_bias():
    model = tiny_model(3)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    settings = dict(max_new_tokens=20, presence_penalty=0.8, frequency_penalty=0.4, logit_bias={9: 2.0},
                    eos_token_id=None)  # fmt: skip
    assert generate(model, prompt, draft="prompt-lookup", **settings) == generate(model, prompt, **settings)


def test_stop_token_ids_end_generation_as_eos_does():
    model = tiny_model(4)
    prompt = [3, 1, 4, 1, 5]
    tokens = generate(model, prompt, max_new_tokens=15, eos_token_id=None)
    stop = tokens[6]
    cut = tokens[: tokens.index(stop) + 1]
    assert generate(model, prompt, max_new_tokens=15, eos_token_id=None, stop_token_ids=[stop]) == cut
    engine = LLMEngine(model)
    assert engine.generate([prompt], max_new_tokens=15, eos_token_id=None, stop_token_ids=[stop]) == [cut]


def penalty_settings(rng: random.Random, vocab_size: int) -> dict:
    kind = rng.choice(["presence", "frequency", "both", "bias", "all"])
    s = {}
    if kind in ("presence", "both", "all"):
        s["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if kind in ("frequency", "both", "all"):
        s["frequency_penalty"] = rng.choice([-0.5, 0.7, 2.0])
    if kind in ("bias", "all"):
        s["logit_bias"] = {rng.randrange(vocab_size): rng.choice([-100, -3.0, 2.5, 100]) for _ in range(3)}
    return s


def test_llm_engine_gives_every_request_its_alone_tokens_with_penalties_and_bias():
    """The engine's property (continuous batching equals `generate` alone) with the new settings on every request:
    random workloads of test_llm_engine (prefix caching, preemption, chunked prefills, EOS, stop strings)."""
    model, cached, preempted = None, 0, 0
    for seed in range(100):
        if seed % 10 == 0:
            model = tiny_model(seed)
        w = random_workload(seed, model)
        rng = random.Random(seed + 7)
        for s in w.settings:
            s.update(penalty_settings(rng, model.config.vocab_size))
        expected = with_eos_mid_way(random.Random(seed + 1), model, w)
        engine = LLMEngine(model, **w.engine)
        if seed % 2:
            got = run_streaming(engine, w)
        else:
            got = engine.generate(w.prompts, arrivals=w.arrivals, settings=w.settings, **COMMON)
        assert got == expected, first_difference(model, w, expected, got)
        assert_idle(engine, w)
        cached += engine.stats["cached_tokens"] > 0
        preempted += engine.stats["preemptions"] > 0
    assert cached >= 10 and preempted >= 10, (cached, preempted)


def test_the_command_line_takes_the_penalties_and_the_bias(capsys):
    code, out, err = run_here(capsys, "generate", "--help")
    assert code == 0 and all(f in out for f in ("--presence-penalty", "--frequency-penalty", "--logit-bias ID=BIAS"))
    flags = ["--max-new-tokens", "12", "--seed", "3", "--presence-penalty", "1.5", "--frequency-penalty", "0.5"]
    code, out, err = run_here(
        capsys, "generate", *flags, "--logit-bias", "11=-100", "--logit-bias", "13=-100", "ROMEO:"
    )
    assert code == 0, err
    from llmcourse import generate_text, get_tokenizer, load_model

    want = generate_text(load_model(), get_tokenizer(), "ROMEO:", max_new_tokens=12, temperature=0.8, seed=3,
                         presence_penalty=1.5, frequency_penalty=0.5, logit_bias={11: -100, 13: -100})  # fmt: skip
    assert out == want + "\n" and "," not in out and "." not in out  # 11: ",", 13: "." in GPT-2's vocabulary
    code, out, err = run_here(capsys, "generate", "--presence-penalty", "3", "ROMEO:")
    assert code == 2 and "--presence-penalty must be a number in [-2, 2]" in err
    code, out, err = run_here(capsys, "generate", "--logit-bias", "comma", "ROMEO:")
    assert code == 2 and "TOKEN_ID=BIAS" in err
