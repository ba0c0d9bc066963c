"""Generation against transformers.generate, and its equivalences: cached, batched, streamed."""

import pytest
import torch

from llmcourse import GPT2Config, generate, generate_text, stream
from llmcourse.engine.generate import stop_at

from .conftest import DEVICES, hf_twin, lively_model

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "ROMEO: But soft, what light through yonder window breaks?",
    "🦙",
]
NEW = 48


def hf_generate(hf, ids, **kwargs):
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        pad_token_id=0,
        max_new_tokens=NEW,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers(small_pair, tokenizer, prompt):
    ours, theirs = small_pair
    ids = tokenizer.encode(prompt)
    got = generate(ours, ids, max_new_tokens=NEW, eos_token_id=None)
    assert got == hf_generate(theirs, ids, eos_token_id=None)
    assert len(got) == NEW and len(set(got)) > 10  # a real continuation, not one token repeated


def test_greedy_equals_transformers_on_the_124M_config(tmp_path, tokenizer):
    ours = lively_model(GPT2Config(), seed=11)
    theirs = hf_twin(ours, tmp_path)
    ids = tokenizer.encode(PROMPTS[3])
    assert generate(ours, ids, max_new_tokens=40, eos_token_id=None) == hf_generate(theirs, ids, eos_token_id=None)[:40]


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_with_repetition_penalty_equals_transformers(small_pair, tokenizer, prompt):
    ours, theirs = small_pair
    ids = tokenizer.encode(prompt)
    got = generate(ours, ids, max_new_tokens=NEW, eos_token_id=None, repetition_penalty=1.3)
    assert got == hf_generate(theirs, ids, eos_token_id=None, repetition_penalty=1.3)


def beam_cases():
    for prompt in PROMPTS[:4]:
        for num_beams, length_penalty in [(2, 1.0), (4, 0.5), (3, 2.0), (5, -1.0)]:
            for eos_at in [None, 8, 30]:
                yield prompt, num_beams, length_penalty, eos_at


@pytest.mark.parametrize("prompt, num_beams, length_penalty, eos_at", list(beam_cases()))
def test_beam_search_equals_transformers(small_pair, tokenizer, prompt, num_beams, length_penalty, eos_at):
    ours, theirs = small_pair
    ids = tokenizer.encode(prompt)
    # EOS: a token that greedy decoding emits at step `eos_at`, so beams meet it mid-way
    eos = None if eos_at is None else generate(ours, ids, max_new_tokens=eos_at + 1, eos_token_id=None)[eos_at]
    got = generate(ours, ids, max_new_tokens=NEW, num_beams=num_beams, length_penalty=length_penalty, eos_token_id=eos)
    expected = hf_generate(theirs, ids, num_beams=num_beams, length_penalty=length_penalty, eos_token_id=eos)
    assert got == expected
    if eos is None:
        assert len(got) == NEW


def test_eos_stops_and_is_included(small_pair, tokenizer):
    model = small_pair[0]
    ids = tokenizer.encode(PROMPTS[1])
    free = generate(model, ids, max_new_tokens=NEW, eos_token_id=None)
    eos = free[10]
    stop = free.index(eos)
    assert generate(model, ids, max_new_tokens=NEW, eos_token_id=eos) == free[: stop + 1]


def test_batch_of_different_lengths_equals_one_by_one(small_pair, tokenizer):
    model = small_pair[0]
    batch = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(ids) for ids in batch}) == len(batch)  # all lengths differ: real padding
    for settings in [dict(), dict(repetition_penalty=1.3)]:
        alone = [generate(model, ids, max_new_tokens=NEW, eos_token_id=None, **settings) for ids in batch]
        assert generate(model, batch, max_new_tokens=NEW, eos_token_id=None, **settings) == alone


def test_batch_rows_stop_at_their_own_eos(small_pair, tokenizer):
    model = small_pair[0]
    batch = [tokenizer.encode(p) for p in PROMPTS[:3]]
    free = generate(model, batch[0], max_new_tokens=NEW, eos_token_id=None)
    eos = free[5]
    alone = [generate(model, ids, max_new_tokens=NEW, eos_token_id=eos) for ids in batch]
    assert generate(model, batch, max_new_tokens=NEW, eos_token_id=eos) == alone
    assert alone[0][-1] == eos and len(alone[0]) <= 6


def test_sampling_is_reproducible_and_seed_dependent(small_pair, tokenizer):
    model = small_pair[0]
    ids = tokenizer.encode(PROMPTS[0])
    settings = dict(max_new_tokens=30, temperature=1.2, top_k=100, top_p=0.95, min_p=0.01, eos_token_id=None)
    first = generate(model, ids, seed=1, **settings)
    assert generate(model, ids, seed=1, **settings) == first
    assert generate(model, ids, seed=1, generator=torch.Generator().manual_seed(1), **settings) == first
    assert generate(model, ids, seed=2, **settings) != first


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_equals_decoded_tokens(small_pair, tokenizer, prompt, device):
    model = small_pair[0].to(device)
    tokens = generate(model, tokenizer.encode(prompt), max_new_tokens=NEW, eos_token_id=None)
    pieces = list(stream(model, tokenizer, prompt, max_new_tokens=NEW, eos_token_id=None))
    assert "".join(pieces) == tokenizer.decode(tokens)
    assert generate_text(model, tokenizer, prompt, max_new_tokens=NEW, eos_token_id=None) == "".join(pieces)
    assert len(pieces) > 1 and all("\ufffd" not in p for p in pieces[:-1])
    model.to("cpu")


def test_beam_search_streams_its_best_sequence(small_pair, tokenizer):
    model = small_pair[0]
    tokens = generate(model, tokenizer.encode(PROMPTS[0]), max_new_tokens=20, num_beams=3, eos_token_id=None)
    text = generate_text(model, tokenizer, PROMPTS[0], max_new_tokens=20, num_beams=3, eos_token_id=None)
    assert text == tokenizer.decode(tokens)


def test_stop_strings_end_the_text(small_pair, tokenizer):
    model = small_pair[0]
    full = generate_text(model, tokenizer, PROMPTS[1], max_new_tokens=NEW, eos_token_id=None)
    word = full.split()[4]
    cut = generate_text(model, tokenizer, PROMPTS[1], max_new_tokens=NEW, eos_token_id=None, stop=[word, "never"])
    assert cut == full[: full.index(word)]


def test_stop_at_holds_back_partial_matches():
    pieces = ["Hel", "lo wo", "r", "ld and more"]
    assert list(stop_at(iter(pieces), ["world"])) == ["Hel", "lo "]  # "wo", "wor" held back, then cut
    assert "".join(stop_at(iter(pieces), ["xyz"])) == "Hello world and more"
    assert "".join(stop_at(iter(["a", "b"]), ["bc"])) == "ab"  # a partial match at the end is released


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=[]), r"the prompt is empty: give at least one token.*50256"),
        (dict(prompt_ids=[[1, 2], []]), r"prompt 1 is empty"),
        (
            dict(prompt_ids=list(range(250)), max_new_tokens=10),
            r"250 token\(s\) and max_new_tokens is 10: 260 positions.*n_positions=256; lower max_new_tokens to at "
            r"most 6",
        ),
        (dict(prompt_ids=list(range(300))), r"300 token\(s\).*shorten the prompt"),
        (dict(prompt_ids=[1, 50257]), r"holds 50257, not a token id in \[0, 50257\)"),
        (dict(prompt_ids=[1, -3]), r"holds -3, not a token id"),
        (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
        (dict(temperature=-1), r"temperature must be a number >= 0"),
        (dict(top_k=-1), r"top_k must be an integer >= 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(min_p=2), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=-1), r"repetition_penalty must be a number > 0"),
        (dict(num_beams=0), r"num_beams must be an integer >= 1"),
        (dict(num_beams=3, temperature=0.8), r"with num_beams > 1 use temperature=0"),
        (dict(length_penalty=float("nan")), r"length_penalty must be a finite number"),
        (dict(eos_token_id=60000), r"eos_token_id must be a token id in \[0, 50257\) or None"),
    ],
)
def test_bad_input_is_a_clear_value_error(small_pair, kwargs, message):
    kwargs = {"prompt_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(small_pair[0], kwargs.pop("prompt_ids"), **kwargs)


def test_stream_checks_its_input_at_the_call(small_pair, tokenizer):
    with pytest.raises(ValueError, match="the prompt is empty"):
        stream(small_pair[0], tokenizer, "")  # raised now, not when iterated
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        stream(small_pair[0], tokenizer, "Hi", stop=[""])
