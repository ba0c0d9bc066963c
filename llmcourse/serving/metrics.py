"""The server's Prometheus metrics (`GET /metrics`), named as vLLM names its own, `llmcourse:` for `vllm:`.

Each server has a registry of its own (prometheus_client's default registry is one per process, and tests start
several servers in one). What a request does is counted where the server streams it (`RequestMetrics`, fed by
`Server.pieces`); the time of a token is the clock read `AsyncEngine.deliver` makes once per step, so the
engine's step does no other work for the metrics. The queues and the KV cache are read from the engine when
Prometheus scrapes (`EngineState`), not kept up to date by the engine.

    >>> metrics = Metrics("llama-shakespeare", engine)                         # doctest: +SKIP
    >>> one = metrics.request(submitted=0.0, prompt_tokens=5)                  # doctest: +SKIP
    >>> one.token(0.05); one.token(0.07); one.finish("length")                 # doctest: +SKIP
    >>> print(metrics.exposition().decode())                                   # doctest: +SKIP
    llmcourse:request_success_total{finished_reason="length",model_name="llama-shakespeare"} 1.0
    llmcourse:prompt_tokens_total{model_name="llama-shakespeare"} 5.0
    llmcourse:generation_tokens_total{model_name="llama-shakespeare"} 2.0
    llmcourse:time_to_first_token_seconds_count{model_name="llama-shakespeare"} 1.0
    llmcourse:inter_token_latency_seconds_count{model_name="llama-shakespeare"} 1.0 ...
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# How a request ended: vLLM's finished_reason values (stop: EOS or a stop string; length: max_tokens; abort: the
# client went away or the server shut down) and error (a step failed, a learner's part under `serve --parts`).
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (seconds); inter-token latency gets four below its 10 ms, where a small model's steps are.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
MEDIA_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text format


class Metrics:
    """A server's metrics: counters and histograms that requests feed, and the engine's state read at scrape time.
    engine: the `LLMEngine`; pending: -> requests submitted but not yet in the engine (they wait too)."""

    def __init__(self, model_name: str, engine, pending: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()

        def metric(kind, name: str, doc: str, **options):  # one series, labelled with the model's name
            return kind(f"llmcourse:{name}", doc, ["model_name"], registry=self.registry, **options).labels(model_name)

        success = Counter("llmcourse:request_success", "Requests finished, by finished_reason.",
                          ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of the requests that got a first token.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated (EOS too, as usage counts).")
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Seconds from a request's submission to the "
                           "engine (after tokenizing, as vLLM) to its first token.", buckets=TTFT_BUCKETS)  # fmt: skip
        self.itl = metric(Histogram, "inter_token_latency_seconds", "Seconds between two consecutive tokens of a "
                          "request.", buckets=ITL_BUCKETS)  # fmt: skip
        self.registry.register(EngineState(engine, model_name, pending))

    def request(self, submitted: float, prompt_tokens: int) -> "RequestMetrics":
        """The counting of one request submitted at `submitted` (time.monotonic())."""
        return RequestMetrics(self, submitted, prompt_tokens)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format, as `GET /metrics` answers."""
        return generate_latest(self.registry)


class RequestMetrics:
    """One request's share of the metrics: `token(at)` for each of its tokens (at: when the engine gave it, in
    time.monotonic()), then `finish(reason)`; only a request's first finish counts."""

    __slots__ = ("metrics", "submitted", "prompt_tokens", "last", "reason")

    def __init__(self, metrics: Metrics, submitted: float, prompt_tokens: int):
        self.metrics, self.submitted, self.prompt_tokens = metrics, submitted, prompt_tokens
        self.last: Optional[float] = None
        self.reason: Optional[str] = None

    def token(self, at: float) -> None:
        m = self.metrics
        if self.last is None:  # the first: the prompt is in
            m.ttft.observe(at - self.submitted)
            m.prompt_tokens.inc(self.prompt_tokens)
        else:
            m.itl.observe(at - self.last)
        self.last = at
        m.generation_tokens.inc()

    def finish(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.metrics.finished[reason].inc()


class EngineState:
    """A custom collector: the engine's queues, KV blocks and preemptions, read when Prometheus scrapes.

    Read on the event loop while a step may run in the engine's thread: lengths of lists and counters, each read
    whole (the GIL), possibly one step apart from each other."""

    def __init__(self, engine, model_name: str, pending: Callable[[], int]):
        self.engine, self.model, self.pending = engine, [model_name], pending

    def collect(self):
        scheduler, blocks = self.engine.scheduler, self.engine.blocks
        used, total = blocks.num_blocks - blocks.num_free, blocks.num_blocks
        for kind, name, doc, value in (
            (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", len(scheduler.running)),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to join the batch.",
             len(scheduler.waiting) + self.pending()),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Share of the KV cache's blocks in use (1: all).", used / total),
            (GaugeMetricFamily, "kv_cache_blocks_used", "KV cache blocks in use.", used),
            (GaugeMetricFamily, "kv_cache_blocks", "KV cache blocks in the pool.", total),
            (CounterMetricFamily, "num_preemptions", "Requests preempted (their blocks taken, recomputed later).",
             scheduler.num_preempted),
        ):  # fmt: skip
            family = kind(f"llmcourse:{name}", doc, labels=["model_name"])
            family.add_metric(self.model, value)
            yield family
