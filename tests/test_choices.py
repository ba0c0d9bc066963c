"""n choices of one prompt (OpenAI's `n`), and the server's new sampling fields through the official openai client.

`LLMEngine.new_choices`: choice i equals a request of its own seeded seed + i (vLLM's rule), token for token, while
the choices share the prompt's full blocks through the prefix cache (counted). The server: n = 4 seeded equals four
separate seeded requests, streamed and not, on both routes; unseeded choices differ; the bound on n; presence and
frequency penalties, logit_bias and stop_token_ids equal the engine alone; the returned logprobs are the model's raw
ones; bad values get a 400 naming the field.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict

import httpx
import openai
import pytest
import torch

from llmcourse import load_model
from llmcourse.engine.generate import generate, generate_text
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import MAX_CHOICES, LLMEngine

from .test_llm_engine import tiny_model
from .test_server import wait_until

pytestmark = pytest.mark.usefixtures("one_thread", "server_log")
MODEL = "llama-shakespeare"


def run_choices(engine: LLMEngine, prompt: list[int], n: int, others=(), **settings) -> list[list[int]]:
    """The n choices' tokens, added as the server adds them (the first, then the others after it), with `others`
    (prompts) running alongside."""
    choices = engine.new_choices(prompt, n, **settings)
    engine.add(choices[0])
    for choice in choices[1:]:
        engine.add(choice, after=choices[0])
    for other in others:
        engine.add_request(other, max_new_tokens=5, eos_token_id=None)
    while engine.has_unfinished():
        engine.step()
    return [c.generated for c in choices]


@pytest.mark.parametrize("seed", range(12))
def test_choice_i_equals_a_request_of_its_own_seeded_seed_plus_i_and_the_prompt_blocks_are_shared(seed):
    rng = random.Random(seed)
    model = tiny_model(seed // 4)
    V = model.config.vocab_size
    bs = rng.choice([4, 16])
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 50))]
    n = rng.randint(2, 6)
    extra = rng.choice([{}, {"presence_penalty": 1.0, "logit_bias": {3: 2.0}}])
    settings = dict(max_new_tokens=rng.randint(3, 12), temperature=rng.choice([0.0, 0.8, 1.5]), seed=seed * 100,
                    eos_token_id=None, **extra)  # fmt: skip
    engine = LLMEngine(model, block_size=bs, max_num_batched_tokens=rng.choice([7, 64]))
    others = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(0, 2))]
    got = run_choices(engine, prompt, n, others, **settings)
    want = [generate(model, prompt, **{**settings, "seed": settings["seed"] + i}) for i in range(n)]
    assert got == want
    shared = (len(prompt) - 1) // bs * bs  # the full blocks but the one holding the last token
    assert engine.stats["cached_tokens"] >= (n - 1) * shared
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block back


def test_choices_wait_for_the_first_and_an_aborted_first_lets_them_run():
    model = tiny_model(1)
    prompt = list(range(40))
    engine = LLMEngine(model, block_size=4)
    choices = engine.new_choices(prompt, 3, max_new_tokens=4, temperature=1.0, seed=5, eos_token_id=None)
    ids = [engine.add(choices[0])] + [engine.add(c, after=choices[0]) for c in choices[1:]]
    engine.step()  # the first computes its prompt; the others are held, holding no block
    assert [c.num_computed for c in choices] == [40, 0, 0] and not choices[1].block_table
    engine.step()  # now they share its 9 full blocks and compute the last block (4 tokens) themselves
    assert engine.stats["cached_tokens"] == 2 * 36 and all(len(c.generated) == 1 for c in choices[1:])
    engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    assert [len(c.generated) for c in choices[1:]] == [4, 4]
    engine = LLMEngine(model, block_size=4)  # aborted while the others wait: they run by themselves
    choices = engine.new_choices(prompt, 2, max_new_tokens=4, temperature=1.0, seed=5, eos_token_id=None)
    first = engine.add(choices[0])
    engine.add(choices[1], after=choices[0])
    engine.abort(first)
    while engine.has_unfinished():
        engine.step()
    assert choices[1].generated == generate(model, prompt, max_new_tokens=4, temperature=1.0, seed=6, eos_token_id=None)


def test_n_is_bounded_by_max_num_seqs_and_the_pool():
    model = tiny_model(2)
    engine = LLMEngine(model, block_size=4, num_blocks=30, max_num_seqs=8)
    assert engine.max_choices(20, 10) == min(MAX_CHOICES, 8, (30 - 4) // 4)  # shared 4 blocks, 4 own each
    with pytest.raises(ValueError, match=r"^n must be at most 6 here \(got 7\)"):
        engine.new_choices(list(range(20)), 7, max_new_tokens=10, eos_token_id=None)
    assert len(engine.new_choices(list(range(20)), 6, max_new_tokens=10, eos_token_id=None)) == 6
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        engine.new_choices([1], 0)


# -- the server, through the official openai client -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    engine = LLMEngine(model, tokenizer=tokenizer, max_num_seqs=8)
    with ServerThread(build_app(engine, tokenizer, MODEL)) as server:
        server.engine = engine
        yield server, model, tokenizer


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def by_index(chunks, chat: bool) -> dict[int, str]:
    texts = defaultdict(str)
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
    return dict(texts)


def test_n_4_seeded_equals_four_requests_seeded_seed_to_seed_plus_3_streamed_or_not_both_routes(llama):
    server, model, tok = llama
    c = client(server)
    settings = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=11)
    prompt = "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is"
    alone = [c.completions.create(prompt=prompt, **{**settings, "seed": 11 + i}) for i in range(4)]
    separate, tokens = [a.choices[0].text for a in alone], sum(a.usage.completion_tokens for a in alone)
    ids = tok.encode(prompt)
    assert separate == [generate_text(model, tok, ids, max_new_tokens=24, temperature=1.0, seed=11 + i)
                        for i in range(4)]  # fmt: skip
    assert len(set(separate)) == 4
    cached = server.engine.stats["cached_tokens"]
    got = c.completions.create(prompt=prompt, n=4, **settings)
    assert [ch.index for ch in got.choices] == [0, 1, 2, 3] and [ch.text for ch in got.choices] == separate
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == tokens  # the prompt once
    assert server.engine.stats["cached_tokens"] - cached >= 3 * ((len(ids) - 1) // 16 * 16)  # choices 1-3 share
    chunks = list(c.completions.create(prompt=prompt, n=4, stream=True, stream_options={"include_usage": True},
                                       **settings))  # fmt: skip
    assert by_index(chunks, chat=False) == dict(enumerate(separate))
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == tokens and chunks[-1].usage.prompt_tokens == len(ids)

    messages = [{"role": "user", "content": "Good morrow, fair lady."}]
    separate = [c.chat.completions.create(messages=messages, **{**settings, "seed": 11 + i}).choices[0].message.content
                for i in range(4)]  # fmt: skip
    got = c.chat.completions.create(messages=messages, n=4, **settings)
    assert [ch.message.content for ch in got.choices] == separate and [ch.index for ch in got.choices] == [0, 1, 2, 3]
    chunks = list(c.chat.completions.create(messages=messages, n=4, stream=True, **settings))
    roles = [ch.choices[0].index for ch in chunks if ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2, 3] and by_index(chunks, chat=True) == dict(enumerate(separate))


def test_unseeded_choices_differ_and_n_beyond_what_the_server_runs_is_refused(llama):
    server, model, tok = llama
    c = client(server)
    got = c.completions.create(model=MODEL, prompt="JULIET:", max_tokens=20, temperature=1.0, n=4)
    assert len({ch.text for ch in got.choices}) == 4
    for n, most in [(9, "at most 8 here"), (MAX_CHOICES + 1, f"between 1 and {MAX_CHOICES}"), (0, "between 1")]:
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt="JULIET:", max_tokens=20, n=n)
        assert err.value.body["param"] == "n" and most in err.value.body["message"]


def test_penalties_and_bias_equal_the_engine_alone_and_logprobs_stay_the_models_own(llama):
    server, model, tok = llama
    c = client(server)
    ids = tok.encode("ROMEO:")
    fields = dict(max_tokens=30, temperature=0.9, seed=4, presence_penalty=0.8, frequency_penalty=1.2)
    bias = {tok.encode(" the")[0]: 4.0, tok.encode(",")[0]: -100}
    want = generate_text(model, tok, ids, max_new_tokens=30, temperature=0.9, seed=4, presence_penalty=0.8,
                         frequency_penalty=1.2, logit_bias=bias)  # fmt: skip
    plain = generate_text(model, tok, ids, max_new_tokens=30, temperature=0.9, seed=4)
    assert want != plain and "," not in want
    logit_bias = {str(k): v for k, v in bias.items()}
    got = c.completions.create(model=MODEL, prompt="ROMEO:", logit_bias=logit_bias, logprobs=2, **fields)
    assert got.choices[0].text == want
    streamed = c.completions.create(model=MODEL, prompt="ROMEO:", logit_bias=logit_bias, stream=True, **fields)
    assert "".join(ch.choices[0].text for ch in streamed) == want
    with torch.inference_mode():  # the first token's logprobs: the model's raw log-softmax, not the processed one
        raw = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
    first = generate(model, ids, max_new_tokens=1, temperature=0.9, seed=4, logit_bias=bias)[0]
    assert got.choices[0].logprobs.token_logprobs[0] == pytest.approx(raw[first].item(), abs=1e-4)
    messages = [{"role": "user", "content": "Speak, and spare not."}]
    want = generate_text(model, tok, tok.encode_chat(messages), max_new_tokens=30, temperature=0, presence_penalty=2,
                         logit_bias=bias)  # fmt: skip
    got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0, presence_penalty=2,
                                    logit_bias=logit_bias)  # fmt: skip
    assert got.choices[0].message.content == want


def test_stop_token_ids_end_a_choice_with_finish_reason_stop_the_token_not_in_the_text(llama):
    server, model, tok = llama
    c = client(server)
    ids = tok.encode("JULIET:")
    tokens = generate(model, ids, max_new_tokens=40, temperature=0)
    stop = tokens[8]
    k = tokens.index(stop)
    body = dict(model=MODEL, prompt="JULIET:", max_tokens=40, temperature=0, extra_body={"stop_token_ids": [stop]})
    got = c.completions.create(**body)
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == tok.decode(tokens[:k])
    assert got.usage.completion_tokens == k + 1  # the stop token is counted, as vLLM counts it
    chunks = list(c.completions.create(stream=True, **body))
    assert "".join(ch.choices[0].text for ch in chunks) == tok.decode(tokens[:k])
    assert chunks[-1].choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "Good morrow."}]
    tokens = generate(model, tok.encode_chat(messages), max_new_tokens=40, temperature=0)
    got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                    extra_body={"stop_token_ids": [tokens[5]]})  # fmt: skip
    assert got.choices[0].message.content == tok.decode(tokens[: tokens.index(tokens[5])])


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"stop_token_ids": "46"}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [4096]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"n": 2.5}, "n"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_values_get_a_400_naming_the_field(llama, fields, param):
    server, model, tok = llama
    for route, body in [("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [{"role": "user",
                        "content": "Hi"}]})]:  # fmt: skip
        response = httpx.post(f"{server.url}/v1/{route}", content=json.dumps({**body, **fields}),
                              headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and len(error["message"]) > 20


def test_a_client_that_disconnects_frees_the_blocks_of_every_choice(llama, monkeypatch):
    server, model, tok = llama
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: time.sleep(0.002) or step())  # 200 steps: over 0.4 s
    health = lambda: httpx.get(server.url + "/health").json()  # noqa: E731
    long = {"prompt": "ROMEO:\n" * 12, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "n": 4}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}) as response:
            lines = response.iter_lines()  # (held here: closing this iterator would close the connection)
            assert next(line for line in lines if '"text": "' in line and '"index": 3' in line)  # all four decode
            held = health()
            assert held["running"] == 4 and held["free_blocks"] < held["num_blocks"], held
    assert wait_until(lambda: health()["running"] == 0), "the aborted choices still run"
    assert health()["free_blocks"] == health()["num_blocks"]
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request whose client gives up
        httpx.post(server.url + "/v1/completions", json=long, timeout=0.5)
    assert wait_until(lambda: health()["running"] == health()["waiting"] == 0)
    assert health()["free_blocks"] == health()["num_blocks"]
