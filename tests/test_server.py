"""The OpenAI-compatible server (`python -m llmcourse serve`), through the official `openai` client and raw HTTP.

Every answer is compared with the engine run alone (`generate` / `generate_text` on the same prompt ids, settings
and seed), never with the server's own logic: 32 concurrent streaming clients with random settings on both routes,
stop strings that span tokens, UTF-8 characters split across tokens, log-probabilities against a full forward
pass. A client that disconnects gives its KV blocks back at once; a full server answers 429 with Retry-After;
bad requests get OpenAI-shaped errors and the next request is served; SIGINT/SIGTERM stop it cleanly.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from llmcourse import GPT2, get_tokenizer, load_model
from llmcourse.engine.generate import generate, generate_text, until_eos
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import LLMEngine
from llmcourse.serving.untrusted import MAX_BODY

from .conftest import SMALL

pytestmark = pytest.mark.usefixtures("one_thread", "server_log")  # no traceback in the log
MODEL = "llama-shakespeare"
JSON = "application/json"
LINES = ["ROMEO:", "Good morrow, cousin.", "What light through yonder window breaks?", "JULIET:\nO Romeo,",
         "Now is the winter of our discontent", "To be, or not to be", "My lord,"]  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    engine = LLMEngine(model, tokenizer=tokenizer, max_num_seqs=8)
    with ServerThread(build_app(engine, tokenizer, MODEL)) as server:
        server.engine = engine
        yield server, model, tokenizer


SPELLED = "Juliet: I ❤ thee 🌹 — naïve café, 日本"  # characters of 2, 3 and 4 bytes, split across tokens


def spelling_model(text: str) -> GPT2:
    """A GPT-2 whose greedy continuation of a one-token prompt spells `text` (GPT-2's tokens):
    the blocks add nothing (zero output projections) and each position's embedding points at that position's
    token in the tied head (random 64-dim rows: a row's dot with itself, ~64, beats its dot with any other)."""
    torch.manual_seed(0)
    model = GPT2(SMALL).init_weights(0).eval()  # (GPT2() leaves its parameters uninitialized)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_proj" in name:
                p.zero_()
        target = get_tokenizer().encode(text)
        model.wte.weight.normal_()
        model.wpe.weight.zero_()
        for position, token in enumerate(target):
            model.wpe.weight[position] = 20 * model.wte.weight[token]
    return model


@pytest.fixture(scope="module")
def random_gpt2():
    """A GPT-2 without a chat template that spells SPELLED (its tokens split characters)."""
    model, tokenizer = spelling_model(SPELLED), get_tokenizer()
    with ServerThread(build_app(LLMEngine(model), tokenizer, "random-gpt2")) as server:
        yield server, model, tokenizer


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def alone(model, tokenizer, ids, **settings) -> str:
    return generate_text(model, tokenizer, ids, **settings)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


# -- the openai client, each route, streaming and not -------------------------------------------------------------


def test_completions_and_chat_equal_the_engine_alone_streamed_or_not(llama):
    server, model, tok = llama
    c = client(server)
    settings = dict(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=7)
    want = alone(model, tok, tok.encode("ROMEO:"), **settings)
    got = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0.8, top_p=0.95, seed=7)
    assert got.choices[0].text == want and got.object == "text_completion"
    assert got.usage.prompt_tokens == len(tok.encode("ROMEO:")) and got.usage.completion_tokens == 30
    assert got.choices[0].finish_reason == "length"
    pieces = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0.8, top_p=0.95, seed=7,
                                  stream=True)  # fmt: skip
    texts = [p.choices[0].text for p in pieces]
    assert "".join(texts) == want and len([t for t in texts if t]) > 5  # streamed piece by piece

    messages = [{"role": "user", "content": "Good morrow, fair lady."}]
    want = alone(model, tok, tok.encode_chat(messages), max_new_tokens=40, temperature=0, seed=0)
    got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(tok.encode_chat(messages))
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == got.usage.total_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [got.choices[0].finish_reason]


def test_a_reply_ends_at_the_models_eos_with_finish_reason_stop(llama):
    server, model, tok = llama
    ids = chat_ids(tok, "Wilt thou be gone?")
    tokens = generate(model, ids, max_new_tokens=200, temperature=0)
    assert tokens[-1] in model.config.eos_token_ids, "the bundled model ends a greedy reply within 200 tokens"
    got = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Wilt thou be gone?"}], max_tokens=200, temperature=0
    )
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == len(tokens)
    assert got.choices[0].message.content == tok.decode(tokens[:-1])  # EOS itself is not shown


def test_stop_strings_that_span_tokens_end_the_text_before_them(llama):
    server, model, tok = llama
    ids = tok.encode("ROMEO:")
    tokens = generate(model, ids, max_new_tokens=30, temperature=0)
    pieces = [tok.decode([t]) for t in tokens]
    i = next(i for i in range(3, 30) if len(pieces[i]) >= 2 and pieces[i + 1].strip())
    stop = pieces[i][-2:] + pieces[i + 1][:1]  # from inside one token into the next
    want = alone(model, tok, ids, max_new_tokens=30, temperature=0, stop=(stop,))
    assert stop not in want and len(want) < len(tok.decode(tokens))
    c = client(server)
    streamed = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "stop"


def test_streamed_text_never_holds_half_a_character(random_gpt2):
    """The text's emoji, heart and kanji are split across GPT-2's byte-level tokens; each piece the server
    sends is whole characters, and together they are the text."""
    server, model, tok = random_gpt2
    n = len(tok.encode(SPELLED))
    tokens = generate(model, [464], max_new_tokens=n, temperature=0)
    assert tok.decode(tokens) == SPELLED and sum("\ufffd" in tok.decode([t]) for t in tokens) >= 4
    chunks = client(server).completions.create(model="random-gpt2", prompt=[464], max_tokens=n, temperature=0,
                                               stream=True)  # fmt: skip
    texts = [ch.choices[0].text for ch in chunks]
    assert "".join(texts) == SPELLED and all("\ufffd" not in t for t in texts)
    assert len([t for t in texts if t]) < n  # a split character waited for its last token


def test_logprobs_are_the_models_log_softmax_with_its_likeliest_alternatives(llama):
    server, model, tok = llama
    c = client(server)
    got = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, logprobs=3)
    ids = tok.encode("ROMEO:")
    tokens = generate(model, ids, max_new_tokens=12, temperature=0)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + tokens]))[0, len(ids) - 1 : -1].double(), -1)
    lp = got.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in tokens] and "".join(lp.tokens) == got.choices[0].text
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs, dtype=torch.double), chosen, atol=1e-4)
    for step, top in enumerate(lp.top_logprobs):
        values, index = logp[step].topk(3)
        assert list(top) == [tok.decode([i]) for i in index.tolist()]
        assert torch.allclose(torch.tensor(list(top.values()), dtype=torch.double), values, atol=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(12)]

    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2, stream=True)  # fmt: skip
    entries = [e for ch in chat if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    ids = chat_ids(tok, "Hi")
    tokens = generate(model, ids, max_new_tokens=5, temperature=0)
    assert [e.token for e in entries] == [tok.decode([t]) for t in tokens if t not in model.config.eos_token_ids]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    assert all(bytes(e.bytes) == tok.token_bytes(t) for e, t in zip(entries, tokens))


def test_models_and_health(llama):
    server, model, tok = llama
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL] and client(server).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4o")
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == model.config.n_positions and card["chat"] is True
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["free_blocks"] == health["num_blocks"] > 0


# -- many clients at once -----------------------------------------------------------------------------------------


def random_request(rng: random.Random, i: int) -> dict:
    chat = rng.random() < 0.5
    line = rng.choice(LINES)
    body = {
        "max_tokens": rng.randint(1, 40),
        "temperature": rng.choice([0, 0, 0.7, 1.0, 1.3]),
        "top_p": rng.choice([1.0, 0.9]),
        "seed": rng.randrange(1000),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rng.random() < 0.3:
        body["stop"] = [rng.choice([" the", ",", "\n", "o"])]
    extra = {}
    if rng.random() < 0.3:
        extra["top_k"] = rng.choice([5, 40])
    if rng.random() < 0.2:
        extra["repetition_penalty"] = 1.3
    body["messages" if chat else "prompt"] = [{"role": "user", "content": line}] if chat else line
    return {"chat": chat, "body": body, "extra": extra}


def test_32_concurrent_streaming_clients_each_get_the_engine_alone(llama):
    server, model, tok = llama
    rng = random.Random(27)
    requests = [random_request(rng, i) for i in range(32)]
    started = []

    async def one(c: openai.AsyncOpenAI, r: dict):
        await asyncio.sleep(rng.random() * 0.3)  # arrivals spread over the others' decoding
        started.append(time.perf_counter())
        if r["chat"]:
            stream = await c.chat.completions.create(model=MODEL, extra_body=r["extra"] or None, **r["body"])
            return [(ch.choices[0].delta.content or "") if ch.choices else ch.usage async for ch in stream]
        stream = await c.completions.create(model=MODEL, extra_body=r["extra"] or None, **r["body"])
        return [ch.choices[0].text if ch.choices else ch.usage async for ch in stream]

    async def all_clients():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(c, r) for r in requests))

    steps, computed = server.engine.num_steps, server.engine.num_computed_tokens
    answers = asyncio.run(all_clients())
    steps, computed = server.engine.num_steps - steps, server.engine.num_computed_tokens - computed
    assert steps < computed / 4, "the requests were served one by one, not as one continuous batch"
    for i, (r, answer) in enumerate(zip(requests, answers)):
        body = r["body"]
        ids = chat_ids(tok, body["messages"][0]["content"]) if r["chat"] else tok.encode(body["prompt"])
        settings = dict(max_new_tokens=body["max_tokens"], temperature=body["temperature"], top_p=body["top_p"],
                        seed=body["seed"], stop=tuple(body.get("stop", ())), **r["extra"])  # fmt: skip
        *texts, use = answer
        assert "".join(texts) == alone(model, tok, ids, **settings), f"client {i}: {r}"
        assert use.prompt_tokens == len(ids)
        if not body.get("stop"):
            assert use.completion_tokens == len(until_eos(generate(model, ids, **{**settings, "stop": ()}),
                                                          model.config.eos_token_ids)), f"client {i}"  # fmt: skip
    health = httpx.get(server.url + "/health").json()
    assert health["running"] == health["waiting"] == 0 and health["free_blocks"] == health["num_blocks"]


# -- disconnects and a full server ----------------------------------------------------------------------------------


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_client_that_disconnects_frees_its_blocks_at_once(llama):
    server, model, tok = llama
    health = lambda: httpx.get(server.url + "/health").json()  # noqa: E731
    long = {"prompt": "ROMEO:", "max_tokens": 250, "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=long) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is streaming
            held = health()
            assert held["running"] == 1 and held["free_blocks"] < held["num_blocks"]
        # the connection is closed here, 230-odd tokens early
    assert wait_until(lambda: health()["running"] == 0), "the aborted request still runs"
    after = health()
    assert after["free_blocks"] == after["num_blocks"], after

    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request whose client gives up
        httpx.post(server.url + "/v1/completions", json={**long, "stream": False}, timeout=0.5)
    assert wait_until(lambda: health()["running"] == health()["waiting"] == 0)
    assert health()["free_blocks"] == health()["num_blocks"]


def test_a_full_server_answers_429_with_retry_after_and_recovers():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    app = build_app(LLMEngine(model, tokenizer=tokenizer), tokenizer, MODEL, max_pending=2)
    long = {"prompt": "ROMEO:", "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "stream": True}
    with ServerThread(app) as server, httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=long) as a:
            with http.stream("POST", server.url + "/v1/completions", json=long) as b:
                assert a.status_code == b.status_code == 200
                full = http.post(server.url + "/v1/completions", json=long)
                assert full.status_code == 429 and full.headers["retry-after"] == "1"
                assert "max_pending=2" in full.json()["error"]["message"]
        assert wait_until(lambda: http.get(server.url + "/health").json()["running"] == 0)
        ok = http.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- bad requests ------------------------------------------------------------------------------------------------

BAD = [  # (route, body, status, the field named)
    ("completions", b"{not json", 400, None),
    ("completions", [1, 2], 400, None),
    ("completions", {"prompt": "Hi", "temprature": 0.5}, 400, "temprature"),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ("completions", {"prompt": "thee " * 300}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "Hi", "top_k": -1}, 400, "top_k"),
    ("completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "Hi", "frequency_penalty": -5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "Hi", "logprobs": 9}, 400, "logprobs"),
    ("completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": [1, 99_999]}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "echo": True}, 400, "echo"),
    ("completions", {"prompt": "Hi", "model": "gpt-4o"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": []}, 400, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "thee " * 300}]}, 400, "messages"),
]


@pytest.mark.parametrize("route, body, status, param", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, _, p) in enumerate(BAD)])
def test_a_bad_request_gets_an_openai_error_naming_the_field_and_the_server_goes_on(llama, route, body, status, param):
    server, model, tok = llama
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert len(error["message"]) > 20 and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_oversized_bodies_unknown_routes_and_the_openai_client_get_errors(llama):
    server, model, tok = llama
    huge = httpx.post(server.url + "/v1/completions", content=b"x" * (MAX_BODY + 1), headers={"content-type": JSON})
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"].startswith("no route /v1/nothing")
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="gpt-4o", prompt="Hi")


def test_a_model_without_a_chat_template_refuses_the_chat_route(random_gpt2):
    server, model, tok = random_gpt2
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(server).chat.completions.create(model="random-gpt2", messages=[{"role": "user", "content": "Hi"}])
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["chat"] is False


def test_an_api_key_is_required_when_set_and_compared_whole():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    app = build_app(LLMEngine(model, tokenizer=tokenizer), tokenizer, MODEL, api_key="s3cret")
    with ServerThread(app) as server:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer s3cre"}):
            response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/health").status_code == 200  # open: load balancers probe it
        assert httpx.get(server.url + "/").status_code == 200  # the page itself; it sends the key it is given
        got = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret").completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert got.usage.completion_tokens == 2


# -- the command ---------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_cleanly_on_a_signal_with_a_request_in_flight(sig):
    port = free_port()
    command = [sys.executable, "-m", "llmcourse", "serve", "--port", str(port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: ping(url), 60), process.stderr.read() if process.poll() is not None else "no start"
        long = {"prompt": "ROMEO:", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            process.send_signal(sig)
            rest = list(lines)  # finished or cut, but never hanging
        assert process.wait(timeout=30) == 0
        assert not rest or rest[-1] in ("data: [DONE]", "") or rest[-1].startswith("data:")
    finally:
        process.kill()
    assert "Traceback" not in process.stderr.read()


def ping(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_refuses_bad_flags_in_their_terms():
    for argv, message in ((["--port", "70000"], "--port"), (["--max-num-seqs", "0"], "--max-num-seqs"),
                          (["--model", "no/such/model"], "no/such/model")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "llmcourse", "serve", *argv], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode in (1, 2) and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_failing_step_fails_the_requests_in_it_with_an_error_event_and_the_server_goes_on(llama, monkeypatch):
    server, model, tok = llama
    step, calls = server.engine.step, []

    def fails_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a learner's part broke")
        return step()

    monkeypatch.setattr(server.engine, "step", fails_once)
    body = {"prompt": "ROMEO:", "max_tokens": 10, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][5:])["error"]["message"] == "a learner's part broke"
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "ignore_eos": True}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    health = httpx.get(server.url + "/health").json()
    assert health["running"] == health["waiting"] == 0 and health["free_blocks"] == health["num_blocks"]


def test_serve_parts_serves_your_engine_and_says_which_parts_are_yours(tmp_path):
    """`serve --parts chapters/`: the learner's functions where their checks pass (here chapter 01's tokenizer),
    the engine's own elsewhere, the notice on stderr; the same greedy text as the engine alone."""
    from .release import released
    from .test_course import solved_copy

    shutil.copytree(released("00_pipeline"), tmp_path / "00_pipeline")
    solved_copy("01_tokenization", tmp_path)
    missing = subprocess.run([sys.executable, "-m", "llmcourse", "serve", "--parts", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert missing.returncode == 2 and "--parts: no folder" in missing.stderr, missing.stderr
    port = free_port()
    command = [sys.executable, "-m", "llmcourse", "serve", "--parts", str(tmp_path), "--model", "gpt2-shakespeare"]
    process = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: ping(url), 120), process.stderr.read() if process.poll() is not None else "no start"
        got = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0})
        model = load_model("gpt2-shakespeare")
        assert got.json()["choices"][0]["text"] == alone(model, get_tokenizer(), "ROMEO:", max_new_tokens=12)
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    log = process.stderr.read()
    assert "your engine: your StreamDecoder, decode, encode (every generation)" in log and "Traceback" not in log
