"""The HTTP benchmark (`python -m llmcourse bench --http`): what the OpenAI-compatible server costs on top of the
engine, measured, not guessed.

One workload, two systems, the same model and engine settings:

- **HTTP**: the real server, `python -m llmcourse serve` in a subprocess on a free port; clients (asyncio + httpx
  in this process) stream `POST /v1/completions` with `"stream": true` and the prompt as token ids, and take the
  time of each server-sent event as it arrives;
- **in-process**: `AsyncEngine` over an `LLMEngine` in this process (the server's default settings), the time
  taken when each token's `Output` reaches the consumer.

The workload: seeded random prompts of `prompt_tokens` token ids, each generating exactly `max_tokens` tokens
(greedy, `ignore_eos`), sent by C clients at once, each client sending its next request as soon as its last one has
finished, `requests` per run. Each concurrency level runs `repeats` times per system, in the order HTTP, in-process,
in-process, HTTP, ... (drifts in the machine's speed, e.g. other work on it, fall on both), each repeat on new
prompts (the engines' prefix caches never serve one run's prompts to another), the same prompts for both systems.
Per system and level, over its runs: output tokens/s (all output tokens over the runs' wall time, each run from its
first request sent to its last token), time to first token (TTFT: request sent -> first token, or first text chunk
over HTTP) and inter-token latency (ITL: the gaps between a request's consecutive tokens, or text chunks over HTTP,
pooled over the requests), p50 and p99.

Over HTTP the output tokens are counted by the server's usage chunk (`stream_options: {"include_usage": true}`);
ITL is measured between text chunks: a chunk carries one token's text unless a token ends inside a UTF-8
character (its bytes wait for the next token), so the table says how many chunks carried how many tokens.
The text a client receives must equal the in-process tokens decoded: the same greedy tokens. Beside the times,
the CPU time of all threads per output token (Linux): the server process's plus the clients' (this process's)
over HTTP, this process's in-process; on a machine with few cores the two compete for them.

    >>> s = summary([[Stream(0.0, [0.1, 0.2, 0.4], 3), Stream(0.1, [0.3, 0.4], 2)], [Stream(1.0, [1.6], 1)]])
    >>> s["tokens_per_s"], round(s["ttft_p50_ms"]), s["chunks"], round(s["itl_p50_ms"])
    (6.0, 200, 6, 100)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple, Optional, Sequence

from llmcourse.engine import threads
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model, resolve_device, resolve_dtype
from llmcourse.serving.async_engine import AsyncEngine
from llmcourse.serving.llm_engine import MAX_NUM_SEQS, LLMEngine

from .common import ENGINE, STYLE, TRANSFORMERS, describe_machine, machine, measure_and_save, save
from .serving import percentile

FIGURE = "bench_http.png"
MODEL = "llama-shakespeare"  # the bundled modern model, the server's default
CONCURRENCY = (1, 4, 16, 32)
HTTP, INPROCESS = TRANSFORMERS, ENGINE  # the figure's colours: the engine's blue for the engine alone


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workload: `requests` per run, each `prompt_tokens` random token ids generating exactly `max_tokens`
    tokens; `repeats` runs per system and concurrency level; `warmup` requests per system before the first level."""

    requests: int = 64
    repeats: int = 2
    prompt_tokens: int = 64
    max_tokens: int = 64
    warmup: int = 8
    seed: int = 0


QUICK = Sizes(requests=8, repeats=1, prompt_tokens=16, max_tokens=8, warmup=2)


DONE = {}  # what `take_event` returns for the stream's last event, data: [DONE]


def take_event(line: str, now: float, times: list[float], pieces: list[str]) -> Optional[dict]:
    """One line of a completion's server-sent events: its chunk (None for a line that is no event, DONE at the end),
    each text piece in it appended to `pieces` with its arrival time `now`. An error event raises."""
    if not line.startswith("data: "):
        return None
    if line == "data: [DONE]":
        return DONE
    chunk = json.loads(line[6:])
    if "error" in chunk:
        raise RuntimeError(f"the server sent an error mid-stream: {chunk['error']}")
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            times.append(now)
            pieces.append(choice["text"])
    return chunk


class Stream(NamedTuple):
    """One request as a client saw it: when it was sent, when each token (in-process) or text chunk (HTTP)
    arrived, how many tokens it got, and what (token ids in-process, the text pieces over HTTP)."""

    sent: float
    times: list[float]
    tokens: int
    output: Sequence = ()


# ----------------------------------------------------------------------------------------------- workload


def prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def summary(runs: Sequence[Sequence[Stream]]) -> dict:
    """Throughput and latencies of one system at one level, over its runs (times in s, latencies reported in
    ms): the tokens of all runs over the sum of their wall times; percentiles of all requests' latencies."""
    streams = [s for run in runs for s in run]
    if not streams or any(not run for run in runs) or any(not s.times for s in streams):
        raise ValueError("every run needs a request, and every request at least one token")
    ttft = [s.times[0] - s.sent for s in streams]
    itl = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    wall = sum(max(s.times[-1] for s in run) - min(s.sent for s in run) for run in runs)
    tokens = sum(s.tokens for s in streams)
    return {
        "runs": len(runs),
        "requests": len(streams),
        "output_tokens": tokens,
        "chunks": sum(len(s.times) for s in streams),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
    }


async def drive(items: Sequence, concurrency: int, one: Callable[[object], Awaitable[Stream]]) -> list[Stream]:
    """`concurrency` clients, each sending its next item as soon as its last one is done. -> a Stream per item,
    in order."""
    results: list[Optional[Stream]] = [None] * len(items)
    queue = iter(range(len(items)))

    async def client() -> None:
        for i in queue:  # the clients share the iterator: each takes the next item left
            results[i] = await one(items[i])

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(items)))))
    return results


# ------------------------------------------------------------------------------------------------ HTTP


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far: from /proc (Linux); 0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m llmcourse serve` in a subprocess on a free port, from start until its /health answers 200 to
    SIGINT (its clean shutdown). Its output goes to a file, shown if it fails."""

    def __init__(self, model: str, device: str, dtype: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, "-m", "llmcourse", "serve", "--model", model, "--port", str(self.port),
            "--device", device, "--dtype", dtype,
        ]  # fmt: skip
        self.timeout = timeout

    def __enter__(self) -> "Server":
        import httpx  # the benchmark's HTTP client (`run` checks that it is installed)

        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}) before answering:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                output = self.output()
                self.__exit__()
                raise RuntimeError(f"the server did not answer /health in {self.timeout:.0f} s:\n{output}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def http_level(url: str, model: str, items: Sequence[list[int]], concurrency: int, max_tokens: int):
    """The requests over HTTP, `concurrency` streaming clients. -> a Stream per request (text pieces as output)."""
    import httpx  # the benchmark's HTTP client (`run` checks that it is installed)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def one(prompt: list[int]) -> Stream:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            times, pieces, usage = [], [], None
            sent = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread())!r}")
                async for line in response.aiter_lines():
                    chunk = take_event(line, time.perf_counter(), times, pieces)
                    if chunk is DONE:
                        break
                    usage = (chunk or {}).get("usage") or usage
            if usage is None:
                raise RuntimeError("the server sent no usage chunk (stream_options include_usage)")
            return Stream(sent, times, usage["completion_tokens"], pieces)

        # a connection per client before the clock starts, as a client that stays connected has
        await asyncio.gather(*(client.get("/health") for _ in range(concurrency)))
        return await drive(items, concurrency, one)


# ------------------------------------------------------------------------------------------------ in-process


async def inprocess_level(llm_engine, items: Sequence[list[int]], concurrency: int, max_tokens: int):
    """The requests through `AsyncEngine(llm_engine)` in this process. -> a Stream per request (token ids)."""

    async with AsyncEngine(llm_engine) as engine:

        async def one(prompt: list[int]) -> Stream:
            times, ids = [], []
            sent = time.perf_counter()
            request = llm_engine.new_request(prompt, max_new_tokens=max_tokens, eos_token_id=None)
            async for out in engine.submit(request):
                times.append(time.perf_counter())
                ids.append(out.token)
            return Stream(sent, times, len(ids), ids)

        return await drive(items, concurrency, one)


def server_engine(model, tokenizer):
    """The `LLMEngine` that `python -m llmcourse serve` builds by default (its --max-num-seqs' default)."""
    return LLMEngine(model, max_num_seqs=MAX_NUM_SEQS, tokenizer=tokenizer)


# ------------------------------------------------------------------------------------------------- runner


def run(
    model: str = MODEL,
    concurrency: Sequence[int] = CONCURRENCY,
    *,
    device: str = "auto",
    dtype: str = "float32",
    sizes: Sizes = Sizes(),
    progress: Callable[[str], None] = print,
) -> dict:
    """Both systems at each concurrency; -> the figures (bench.json's "http" section). The server runs
    throughout; the in-process engine is made as the server makes its own."""
    if not concurrency or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in concurrency):
        raise ValueError(f"concurrency levels must be integers >= 1, got {list(concurrency)!r}")
    try:
        import httpx  # noqa: F401  (the clients' library: installed with the openai client, which the tests use)
    except ImportError:
        raise ValueError("bench --http needs the httpx package for its clients: pip install httpx") from None
    if min(sizes.requests, sizes.repeats, sizes.prompt_tokens, sizes.max_tokens) < 1 or sizes.warmup < 0:
        raise ValueError(f"every size must be >= 1 (warmup >= 0), got {sizes}")
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    loaded = load_model(model, device=dev, dtype=dt)  # a bad name fails before the server starts
    tokenizer = load_tokenizer(model)
    llm_engine = server_engine(loaded, tokenizer)
    cfg, s = loaded.config, sizes
    if s.prompt_tokens + s.max_tokens > cfg.n_positions:
        raise ValueError(
            f"{s.prompt_tokens} prompt tokens and {s.max_tokens} output tokens do not fit in {model}'s "
            f"{cfg.n_positions} positions"
        )
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.parameters())
    results: dict = {
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "threads": threads.count(),  # the engine's (torch's own is one while it computes)
        "machine": machine(dev, weight_bytes),
        "model": model,
        "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_positions": cfg.n_positions},
        "sizes": dataclasses.asdict(s),
        "engine": {
            "max_num_seqs": llm_engine.scheduler.max_num_seqs,
            "max_num_batched_tokens": llm_engine.scheduler.max_num_batched_tokens,
            "num_blocks": llm_engine.blocks.num_blocks,
            "block_size": llm_engine.blocks.block_size,
        },
        "levels": [],
    }
    vocab = cfg.vocab_size
    progress(f"http, {model}: starting the server")
    with Server(model, device, dtype) as server:
        results["server"] = {"command": " ".join(server.command[1:])}
        warm = prompts(s.warmup, s.prompt_tokens, vocab, s.seed + 10_000)
        progress(f"http, {model}: {s.warmup} warm-up requests per system")
        asyncio.run(http_level(server.url, model, warm, max(concurrency), s.max_tokens))
        asyncio.run(inprocess_level(llm_engine, warm, max(concurrency), s.max_tokens))
        for level, c in enumerate(concurrency):
            progress(f"http, {model}: {c} clients, {s.repeats} x {s.requests} requests, over HTTP and in-process")
            runs: dict[str, list[list[Stream]]] = {"http": [], "inprocess": []}
            cpu = {"server": 0.0, "client": 0.0, "inprocess": 0.0}  # CPU seconds, all threads
            for repeat in range(s.repeats):
                items = prompts(s.requests, s.prompt_tokens, vocab, s.seed + 100 * level + repeat)
                for system in ("http", "inprocess")[:: 1 if repeat % 2 == 0 else -1]:
                    before = time.process_time(), cpu_seconds(server.process.pid)
                    if system == "http":
                        runs[system].append(asyncio.run(http_level(server.url, model, items, c, s.max_tokens)))
                        cpu["client"] += time.process_time() - before[0]
                        cpu["server"] += cpu_seconds(server.process.pid) - before[1]
                    else:
                        runs[system].append(asyncio.run(inprocess_level(llm_engine, items, c, s.max_tokens)))
                        cpu["inprocess"] += time.process_time() - before[0]
            same = sum(
                tokenizer.decode(a.output) == "".join(b.output)
                for inproc, http in zip(runs["inprocess"], runs["http"])
                for a, b in zip(inproc, http)
            )
            results["levels"].append(
                {
                    "concurrency": c,
                    "http": {
                        **summary(runs["http"]),
                        "cpu_s": cpu["server"] + cpu["client"],
                        "server_cpu_s": cpu["server"],
                        "client_cpu_s": cpu["client"],
                    },
                    "inprocess": {**summary(runs["inprocess"]), "cpu_s": cpu["inprocess"]},
                    "same_text": same,
                }
            )
    return results


def ratios(r: dict) -> list[dict]:
    """HTTP / in-process, per level: throughput (below 1: HTTP serves fewer tokens/s), TTFT and ITL p50 and p99,
    CPU time per output token (None where it was not measured: outside Linux)."""
    out = []
    for level in r["levels"]:
        h, i = level["http"], level["inprocess"]
        q = {"concurrency": level["concurrency"], "tokens_per_s": h["tokens_per_s"] / i["tokens_per_s"]}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            q[key] = h[key] / i[key]
        cpu = [v["cpu_s"] / v["output_tokens"] for v in (h, i)]
        q["cpu_per_token"] = cpu[0] / cpu[1] if h["server_cpu_s"] > 0 and cpu[1] > 0 else None
        out.append(q)
    return out


def table(r: dict) -> str:
    s, c = r["sizes"], r["config"]
    lines = [
        f"http: {r['device']}, {r['dtype']}, {r['threads']} threads",
        "machine: " + describe_machine(r["machine"]),
        f"  {r['model']} ({c['n_layer']} layers, {c['n_embd']} wide), LLMEngine max_num_seqs="
        f"{r['engine']['max_num_seqs']}: {s['repeats']} x {s['requests']} requests per level and system, "
        f"{s['prompt_tokens']} random prompt tokens -> {s['max_tokens']} output tokens each (greedy, ignore_eos)",
        f"    {'clients':>7}  {'':<11}{'tok/s':>8}{'TTFT p50':>10}{'p99':>10}{'ITL p50':>10}{'p99':>10}{'CPU/tok':>10}",
    ]
    all_ratios = r.get("ratios") or ratios(r)
    for level, q in zip(r["levels"], all_ratios):
        for label, v in (("HTTP", level["http"]), ("in-process", level["inprocess"])):
            per_token = 1e3 * v["cpu_s"] / v["output_tokens"]
            split = (
                f"  (server {1e3 * v['server_cpu_s'] / v['output_tokens']:.2f} + client "
                f"{1e3 * v['client_cpu_s'] / v['output_tokens']:.2f})"
                if label == "HTTP"
                else ""
            )
            lines.append(
                f"    {level['concurrency'] if label == 'HTTP' else '':>7}  {label:<11}{v['tokens_per_s']:8.0f}"
                f"{v['ttft_p50_ms']:8.1f}ms{v['ttft_p99_ms']:8.1f}ms{v['itl_p50_ms']:8.2f}ms{v['itl_p99_ms']:8.2f}ms"
                f"{per_token:8.2f}ms{split}"
            )
        cpu = "" if q["cpu_per_token"] is None else f"{q['cpu_per_token']:9.2f}x"
        lines.append(
            f"    {'':>7}  {'HTTP / in':<11}{q['tokens_per_s']:7.2f}x{q['ttft_p50_ms']:9.2f}x{q['ttft_p99_ms']:9.2f}x"
            f"{q['itl_p50_ms']:9.2f}x{q['itl_p99_ms']:9.2f}x{cpu}"
        )
    h = [level["http"] for level in r["levels"]]
    same = sum(level["same_text"] for level in r["levels"])
    total = sum(level["inprocess"]["requests"] for level in r["levels"])
    lines.append("    (CPU/tok: CPU time of all threads per output token; over HTTP the server's plus the clients')")
    lines.append(
        f"    (over HTTP {sum(v['output_tokens'] for v in h)} tokens came in {sum(v['chunks'] for v in h)} text "
        f"chunks; the same text as in-process for {same} of {total} requests)"
    )
    return "\n".join(lines)


def plot(r: dict, out: Path) -> Path:
    """Output tokens/s, TTFT p50 and ITL p50 against the number of clients, over HTTP and in-process."""
    import matplotlib  # heavy and optional (the course extra): only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above

    clients = [level["concurrency"] for level in r["levels"]]
    rows = [("output tok/s", "tokens_per_s"), ("TTFT p50 (ms)", "ttft_p50_ms"), ("ITL p50 (ms)", "itl_p50_ms")]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(rows), 1, figsize=(5.6, 2.4 * len(rows)), sharex=True)
        for ax, (label, key) in zip(axes, rows):
            for system, name, color in (("http", "HTTP", HTTP), ("inprocess", "in-process", INPROCESS)):
                ax.plot(clients, [level[system][key] for level in r["levels"]], "o-", color=color, label=name)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
        axes[0].set_title(f"{r['model']}: HTTP vs in-process")
        axes[0].legend(loc="best")
        axes[-1].set_xscale("log", base=2)
        axes[-1].set_xticks(clients, [str(c) for c in clients])
        axes[-1].minorticks_off()
        axes[-1].set_xlabel("concurrent clients")
        return save(fig, out / FIGURE)


def main(
    out: Path,
    *,
    model: str = MODEL,
    concurrency: Sequence[int] = CONCURRENCY,
    device: str = "auto",
    dtype: str = "float32",
    sizes: Sizes = Sizes(),
) -> int:
    """`bench --http`: measure, then write the "http" section of out/bench.json (keeping its other sections),
    print the table and draw the figure."""

    def report(results: dict) -> Path:
        results["ratios"] = ratios(results)
        print(table(results))
        return plot(results, out)

    def measure() -> dict:
        return run(model, concurrency, device=device, dtype=dtype, sizes=sizes)

    return measure_and_save(out, "http", measure, report)
