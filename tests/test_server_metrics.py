"""`GET /metrics` (`llmcourse.serving.metrics`): Prometheus' text format as prometheus_client's own parser reads it,
counters that move exactly with the requests run (requests by finish reason, prompt and generated tokens, one
time-to-first-token per request and one inter-token gap per token after the first), gauges read from the engine
while a request runs and waits, one registry per server, and the API key."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmcourse import load_model
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread", "server_log")  # tiny models; no traceback in the log
MODEL = "llama-shakespeare"
COUNTERS = ("request_success", "prompt_tokens", "generation_tokens", "num_preemptions")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_blocks_used",
          "kv_cache_blocks")  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = load_model(MODEL, device="cpu"), load_tokenizer(MODEL)
    return model, tokenizer


class SlowEngine(LLMEngine):
    """A step of at least 10 ms: a request of 250 tokens runs long enough to be seen running."""

    def step(self):
        time.sleep(0.01)
        return super().step()


class FailingEngine(LLMEngine):
    """Its third step fails, as a learner's part under `serve --parts` may."""

    def step(self):
        if self.num_steps == 2:
            raise RuntimeError("a part failed")
        return super().step()


def server_of(model, tokenizer, name: str = MODEL, engine=LLMEngine, max_num_seqs: int = 1, **app) -> ServerThread:
    """One request runs at a time by default: a second one waits, for the gauges. `.engine`: its engine."""
    llm_engine = engine(model, tokenizer=tokenizer, max_num_seqs=max_num_seqs)
    server = ServerThread(build_app(llm_engine, tokenizer, name, **app))
    server.engine = llm_engine
    return server


def scrape(server, **headers) -> dict:
    """/metrics parsed by prometheus_client: {(sample name, ((label, value), ...) without model_name): value}."""
    reply = httpx.get(server.url + "/metrics", headers=headers, timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain"), reply.text
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[s.name, labels] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[f"llmcourse:{name}", tuple(sorted(labels.items()))]


def moved(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_parse_with_prometheus_clients_parser_and_are_vllms(llama):
    """Every metric is there with its type and help, labelled with the model's name, vLLM's names with
    `llmcourse:` for `vllm:`; a fresh server's counters are 0 (each finish reason shown), its pool idle."""
    with server_of(*llama) as server:
        text = httpx.get(server.url + "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for names, kind in ((COUNTERS, "counter"), (HISTOGRAMS, "histogram"), (GAUGES, "gauge")):
            for name in names:
                family = families[f"llmcourse:{name}"]
                assert family.type == kind and family.documentation, name
                assert {s.labels["model_name"] for s in family.samples} == {MODEL}
        samples = scrape(server)
        for reason in ("stop", "length", "abort", "error"):
            assert value(samples, "request_success_total", finished_reason=reason) == 0
        assert value(samples, "kv_cache_blocks_used") == 0 == value(samples, "num_requests_running")
        assert value(samples, "kv_cache_blocks") == server.engine.blocks.num_blocks


def test_counters_move_exactly_with_the_requests(llama):
    """Requests of known sizes through the official client: request counts by finish reason, prompt and generated
    token totals exact; one time to first token per request, one inter-token gap per token after the first, their
    sums within the time the requests took."""
    model, tokenizer = llama
    with server_of(model, tokenizer) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        before, started = scrape(server), time.monotonic()
        prompts = [[2002, 58], [1124, 2830, 44, 760, 963, 46, 10], [2002, 58, 10]]
        lengths = [5, 3, 8]
        for prompt, n in zip(prompts, lengths):  # ignore_eos: exactly n tokens, finish "length"
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                             extra_body={"ignore_eos": True})  # fmt: skip
            assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == n
        streamed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed)
        text = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
        stop = text.strip()[:2]  # a stop string met within the answer: finish "stop"
        cut = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=12, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 12
        usages = [*lengths, 4, 12, cut.usage.completion_tokens]
        sent = [*prompts, prompts[0], prompts[2], prompts[2]]
        elapsed = time.monotonic() - started
        after = scrape(server)
    assert moved(after, before, "request_success_total", finished_reason="length") == 5
    assert moved(after, before, "request_success_total", finished_reason="stop") == 1
    assert moved(after, before, "request_success_total", finished_reason="abort") == 0
    assert moved(after, before, "prompt_tokens_total") == sum(map(len, sent)) == 20
    assert moved(after, before, "generation_tokens_total") == sum(usages)
    assert moved(after, before, "time_to_first_token_seconds_count") == len(sent)
    assert moved(after, before, "inter_token_latency_seconds_count") == sum(u - 1 for u in usages)
    ttft, itl = (moved(after, before, f"{name}_sum") for name in HISTOGRAMS)
    assert 0 < ttft + itl < elapsed
    inf = moved(after, before, "inter_token_latency_seconds_bucket", le="+Inf")
    assert inf == sum(u - 1 for u in usages)  # every gap in a bucket


def test_gauges_show_a_running_and_a_waiting_request_and_an_abort_counts(llama):
    """While a long stream runs and a second one waits for its place (max_num_seqs=1), the gauges say so and the
    KV blocks in use are the running request's; clients that go away count as abort, and the pool is idle again."""
    model, tokenizer = llama
    with (
        server_of(model, tokenizer, engine=SlowEngine) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        body = {"prompt": [2002, 58], "max_tokens": 250, "temperature": 0, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # (kept: an iterator dropped closes the connection)
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 2}):  # it waits
                deadline = time.monotonic() + 10
                while value(samples := scrape(server), "num_requests_waiting") != 1:
                    assert time.monotonic() < deadline, samples
                    time.sleep(0.02)
                assert value(samples, "num_requests_running") == 1
                used, total = value(samples, "kv_cache_blocks_used"), value(samples, "kv_cache_blocks")
                assert 1 <= used <= 16 and total == server.engine.blocks.num_blocks  # 252 positions: 16 blocks of 16
                assert value(samples, "kv_cache_usage_perc") == pytest.approx(used / total)
        deadline = time.monotonic() + 10  # both clients went away: counted, then out of the scheduler's queues
        while (
            value(samples := scrape(server), "request_success_total", finished_reason="abort") < 2
            or value(samples, "num_requests_running") + value(samples, "num_requests_waiting") > 0
        ):
            assert time.monotonic() < deadline, samples
            time.sleep(0.02)
        assert value(samples, "num_requests_running") == 0 == value(samples, "num_requests_waiting")
        assert value(samples, "kv_cache_blocks_used") == 0 == value(samples, "kv_cache_usage_perc")
        assert value(samples, "request_success_total", finished_reason="length") == 0


def test_each_of_n_choices_counts_as_a_request(llama):
    """n = 3 choices (streamed or not) count as three requests, as vLLM's n child requests do: three finishes, the
    prompt's tokens three times, a first token each."""
    model, tokenizer = llama
    with server_of(model, tokenizer, max_num_seqs=4) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        before = scrape(server)
        done = client.completions.create(model=MODEL, prompt=[2002, 58, 10], max_tokens=4, n=3, seed=1,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        assert [c.finish_reason for c in done.choices] == ["length"] * 3 and done.usage.completion_tokens == 12
        chunks = list(client.completions.create(model=MODEL, prompt=[2002, 58, 10], max_tokens=4, n=3, seed=1,
                                                stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
        assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]
        after = scrape(server)
    assert moved(after, before, "request_success_total", finished_reason="length") == 6
    assert moved(after, before, "prompt_tokens_total") == 6 * 3
    assert moved(after, before, "generation_tokens_total") == 6 * 4
    assert moved(after, before, "time_to_first_token_seconds_count") == 6
    assert moved(after, before, "inter_token_latency_seconds_count") == 6 * 3


def test_a_failed_step_counts_as_error(llama):
    """A step that fails ends the request with an error event; it counts as error, with the tokens it got."""
    model, tokenizer = llama
    with server_of(model, tokenizer, engine=FailingEngine) as server:
        body = {"prompt": [2002, 58], "max_tokens": 10, "temperature": 0, "stream": True, "ignore_eos": True}
        events = httpx.post(server.url + "/v1/completions", json=body, timeout=30).text.split("\n\n")
        assert '"error"' in events[-3] and events[-2] == "data: [DONE]"
        samples = scrape(server)
        assert value(samples, "request_success_total", finished_reason="error") == 1
        assert value(samples, "generation_tokens_total") == 2 == value(samples, "prompt_tokens_total")
        assert (
            value(samples, "time_to_first_token_seconds_count")
            == 1
            == value(samples, "inter_token_latency_seconds_count")
        )


def test_two_servers_in_one_process_keep_their_own_metrics(llama):
    """Two servers in one process (prometheus_client's default registry would refuse the second's metrics): a
    request to one moves its counters only."""
    model, tokenizer = llama
    with server_of(model, tokenizer, "first") as one, server_of(model, tokenizer, "second") as two:
        client = openai.OpenAI(base_url=two.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model="second", prompt=[2002, 58], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
        first, second = scrape(one), scrape(two)
        assert value(second, "generation_tokens_total") == 3 and value(first, "generation_tokens_total") == 0
        assert value(second, "request_success_total", finished_reason="length") == 1
        assert value(first, "request_success_total", finished_reason="length") == 0
        text = httpx.get(two.url + "/metrics").text
        assert 'model_name="second"' in text and 'model_name="first"' not in text


def test_tokenize_detokenize_and_metrics_want_the_api_key(llama):
    with server_of(*llama, api_key="sesame") as server:
        for method, route, body in (("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "ROMEO:"}),
                                    ("POST", "/detokenize", {"tokens": [2002, 58]})):  # fmt: skip
            for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                    ({"Authorization": "Bearer sesame"}, 200)):  # fmt: skip
                reply = httpx.request(method, server.url + route, json=body, headers=headers)
                assert reply.status_code == status, (route, headers, reply.text)
                if status == 401:
                    assert reply.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200  # open: a load balancer's probe
