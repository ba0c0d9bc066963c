"""The serving benchmark (`python -m llmcourse bench --serving`): many requests arriving over time, served by
static batching and by `LLMEngine`'s continuous batching over a paged KV cache, with the same memory.

Two workloads, seeded, with arrivals in wall-clock seconds (a Poisson process):

- **mixed**: prompt and output lengths drawn from log-normal distributions (most short, a few long, as
  in chat logs), served by static batching (`decode_steps` on fixed batches of B requests in arrival
  order: a batch starts when its last request has arrived and the previous batch is done, and runs to
  its longest request's output) and by `LLMEngine` (each request added when it arrives, `step()` until
  done). Same memory budget: static batching reserves B x (longest prompt + longest output) KV
  positions, the engine's pool has as many (num_blocks x block_size);
- **shared prefix**: every request starts with the same long system prompt, then a short user part;
  `LLMEngine` with prefix caching on and off.

Per system: output tokens/s (each request's own tokens only), time to first token (TTFT) and time per
output token after the first (TPOT), p50 and p99, and the wall time. Every timestamp is taken with
`time.perf_counter()` when a step's tokens reach Python.

    >>> w = mixed_workload(4, vocab_size=100, n_positions=64, rate=10.0, seed=0)
    >>> len(w.prompts), w.arrivals[0], all(len(p) + n <= 64 for p, n in zip(w.prompts, w.max_new_tokens))
    (4, 0.0, True)
    >>> summary([Record(0.0, [0.1, 0.2, 0.4], [1, 2, 3]), Record(0.5, [0.6], [4])])["tokens_per_s"]
    6.666666666666667
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from llmcourse.engine import threads
from llmcourse.engine.generate import check_request, decode_steps
from llmcourse.engine.loading import resolve_device, resolve_dtype
from llmcourse.engine.sampling import SamplingParams
from llmcourse.serving.llm_engine import LLMEngine

from .common import ENGINE, STYLE, TRANSFORMERS, describe_machine, load, machine, measure_and_save, save, sync

FIGURE = "bench_serving.png"
MODELS = ("gpt2-shakespeare", "gpt2")  # the bundled model and GPT-2 124M's configuration (random weights)
TARGETS = {"continuous_vs_static_throughput": 1.5, "prefix_cache_ttft_p50_speedup": 2.0}


class Workload(NamedTuple):
    """Requests in arrival order: prompt token ids, how many tokens each generates, arrival (s after the start)."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    arrivals: list[float]

    @property
    def longest(self) -> int:
        """Positions the longest possible request needs: the longest prompt plus the longest output."""
        return max(map(len, self.prompts)) + max(self.max_new_tokens)


class Record(NamedTuple):
    """One request as served: when it arrived, when each of its tokens reached Python, and the tokens."""

    arrival: float
    token_times: list[float]
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The benchmark's sizes for one model (`sizes_for`)."""

    requests: int = 64
    prompt_median: int = 24
    prompt_max: int = 128
    output_median: int = 32
    output_max: int = 128
    batch_size: int = 16  # static batching's B; the engine's pool gets the same KV positions
    block_size: int = 16
    max_num_seqs: int = 16  # as many rows per step as a static batch: on a CPU a step's time grows with its rows
    max_num_batched_tokens: int = 512
    load: float = 4.0  # arrival rate / static batching's estimated capacity: both systems have a queue
    prefix_requests: int = 32
    system_len: int = 192
    user_median: int = 12
    prefix_output: int = 16
    prefix_load: float = 0.8  # arrival rate / the measured capacity without prefix caching
    seed: int = 0


def sizes_for(n_positions: int, quick: bool = False) -> Sizes:
    """Sizes that fit the model's context and keep `bench --serving` to about a minute per model on 2 cores.

    The 124M configuration (1024 positions) gets a longer system prompt but shorter outputs than the bundled
    model: on 2 CPU cores a decode step of 16 rows takes it 0.1-0.3 s."""
    sizes = Sizes()
    if n_positions >= 1024:
        sizes = dataclasses.replace(
            sizes, output_median=12, output_max=32, system_len=256, prefix_requests=16, prefix_output=4
        )
    if n_positions < sizes.prompt_max + sizes.output_max or n_positions < sizes.system_len + 64:
        half = n_positions // 2
        sizes = dataclasses.replace(
            sizes,
            prompt_max=half,
            output_max=n_positions - half,
            prompt_median=min(sizes.prompt_median, half // 4),
            output_median=min(sizes.output_median, half // 4),
            system_len=min(sizes.system_len, half),
            prefix_output=min(sizes.prefix_output, half // 4),
            user_median=min(sizes.user_median, n_positions // 16),
        )
    if quick:
        sizes = dataclasses.replace(
            sizes,
            requests=16,
            batch_size=4,
            max_num_seqs=4,
            prefix_requests=8,
            prompt_max=min(32, sizes.prompt_max),
            output_max=min(16, sizes.output_max),
            prompt_median=min(8, sizes.prompt_median),
            output_median=min(8, sizes.output_median),
            system_len=min(64, sizes.system_len),
            prefix_output=min(4, sizes.prefix_output),
        )
    return sizes


# ----------------------------------------------------------------------------------------------- workloads


def lognormal_lengths(rng: random.Random, n: int, median: int, low: int, high: int, sigma: float = 0.8) -> list[int]:
    """n lengths, log-normal around `median` (sigma 0.8: a tenth are over 2.8x the median), clipped to [low, high]."""
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` requests/s; the first arrives at 0."""
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate!r}")
    times = [0.0]
    while len(times) < n:
        times.append(times[-1] + rng.expovariate(rate))
    return times[:n]


def mixed_workload(
    n: int, *, vocab_size: int, n_positions: int, rate: float, seed: int = 0, sizes: Optional[Sizes] = None
) -> Workload:
    """Prompts and outputs of log-normal lengths (random token ids), arriving at `rate` requests/s."""
    s = sizes or sizes_for(n_positions)
    rng = random.Random(seed)
    prompt_lens = lognormal_lengths(rng, n, s.prompt_median, 4, min(s.prompt_max, n_positions - 1))
    outputs = [
        min(o, n_positions - p)
        for o, p in zip(lognormal_lengths(rng, n, s.output_median, 4, s.output_max), prompt_lens)
    ]
    prompts = [[rng.randrange(vocab_size) for _ in range(p)] for p in prompt_lens]
    return Workload(prompts, outputs, poisson_arrivals(rng, n, rate))


def shared_prefix_workload(
    n: int, *, vocab_size: int, n_positions: int, rate: float, seed: int = 0, sizes: Optional[Sizes] = None
) -> Workload:
    """The same system prompt of `sizes.system_len` tokens, then a short user part of its own, per request."""
    s = sizes or sizes_for(n_positions)
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(s.system_len)]
    room = n_positions - s.system_len - s.prefix_output
    if room < 1:
        raise ValueError(
            f"a system prompt of {s.system_len} tokens and {s.prefix_output} new tokens do not fit in "
            f"n_positions={n_positions}"
        )
    users = lognormal_lengths(rng, n, min(s.user_median, room), 1, room, sigma=0.5)
    prompts = [system + [rng.randrange(vocab_size) for _ in range(u)] for u in users]
    return Workload(prompts, [s.prefix_output] * n, poisson_arrivals(rng, n, rate))


# ------------------------------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between the closest ranks (numpy's default).

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 90), percentile([5], 99)
    (2.5, 3.7, 5)
    """
    if not values:
        return float("nan")
    xs = sorted(values)
    at = q / 100 * (len(xs) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo) if hi != lo else xs[lo]


def summary(records: Sequence[Record]) -> dict:
    """Throughput and latencies of a served workload (times in s from the start, latencies reported in ms).

    tokens/s: all requests' tokens over the wall time, from the first arrival to the last token. TTFT: first
    token - arrival. TPOT: (last token - first token) / (tokens - 1), for requests of 2 tokens or more."""
    if any(not r.tokens or len(r.tokens) != len(r.token_times) for r in records):
        raise ValueError("every request needs at least one token, and one time per token")
    ttft = [r.token_times[0] - r.arrival for r in records]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1) for r in records if len(r.tokens) > 1]
    wall = max(r.token_times[-1] for r in records) - min(r.arrival for r in records)
    tokens = sum(len(r.tokens) for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50),
        "tpot_p99_ms": 1e3 * percentile(tpot, 99),
    }


# ------------------------------------------------------------------------------------------------- runners


def wait_until(deadline: float) -> None:
    if (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def run_static(model, workload: Workload, batch_size: int) -> list[Record]:
    """Static batching: fixed batches of `batch_size` requests in arrival order, each run to its longest output
    (a finished row keeps its place until the batch ends). A batch starts when its last request has arrived
    and the previous batch is done."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    n = len(workload.prompts)
    check_request(model, workload.prompts, max(workload.max_new_tokens), None)  # [prompt + output] fits
    records = [Record(a, [], []) for a in workload.arrivals]
    order = sorted(range(n), key=lambda i: workload.arrivals[i])
    greedy = SamplingParams()
    sync(model.device)
    start = time.perf_counter()
    for first in range(0, n, batch_size):
        batch = order[first : first + batch_size]
        wait_until(start + max(workload.arrivals[i] for i in batch))
        wants = [workload.max_new_tokens[i] for i in batch]
        steps = decode_steps(
            model,
            [workload.prompts[i] for i in batch],
            greedy,
            max_new_tokens=max(wants),
            eos_token_id=None,
            generator=None,
        )
        for step, token in enumerate(steps):
            tokens = token.tolist()  # [B], waits for the device
            now = time.perf_counter() - start
            for row, i in enumerate(batch):
                if step < wants[row]:
                    records[i].tokens.append(tokens[row])
                    records[i].token_times.append(now)
    return records


def run_engine(model, workload: Workload, **engine_args) -> tuple[list[Record], dict]:
    """`LLMEngine(model, **engine_args)` serving the workload: each request is added when it arrives, and the
    engine steps while it has work (else waits for the next arrival). -> records, the engine's stats."""
    engine = LLMEngine(model, **engine_args)
    records = [Record(a, [], []) for a in workload.arrivals]
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.arrivals[i])
    which: dict[int, int] = {}  # request id -> index in the workload
    sync(model.device)
    start = time.perf_counter()
    while order or engine.has_unfinished():
        now = time.perf_counter() - start
        while order and workload.arrivals[order[0]] <= now:
            i = order.pop(0)
            which[
                engine.add_request(workload.prompts[i], max_new_tokens=workload.max_new_tokens[i], eos_token_id=None)
            ] = i
        if not engine.has_unfinished():
            wait_until(start + workload.arrivals[order[0]])
            continue
        out = engine.step()  # the tokens are Python ints: the step is done
        now = time.perf_counter() - start
        for rid, token, _ in out:
            records[which[rid]].tokens.append(token)
            records[which[rid]].token_times.append(now)
    return records, engine.stats


def with_rate(workload: Workload, rate: float, seed: int) -> Workload:
    return workload._replace(arrivals=poisson_arrivals(random.Random(seed + 1), len(workload.prompts), rate))


def decode_step_seconds(model, batch_size: int, prompt_len: int) -> float:
    """Seconds of one static-batching decode step of `batch_size` rows (the difference of two short runs, which
    also warms the model up)."""
    rows = [[i % model.config.vocab_size] * prompt_len for i in range(batch_size)]
    greedy = SamplingParams()

    def seconds(n: int) -> float:
        sync(model.device)
        start = time.perf_counter()
        for _ in decode_steps(model, rows, greedy, max_new_tokens=n, eos_token_id=None, generator=None):
            pass
        sync(model.device)
        return time.perf_counter() - start

    seconds(2)
    return max(seconds(10) - seconds(2), 1e-6) / 8


def prefill_seconds(model, prompt_len: int) -> float:
    """Seconds of one forward pass over a prompt of `prompt_len` tokens."""
    ids = torch.zeros(1, prompt_len, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(ids, last_only=True)
        sync(model.device)
        start = time.perf_counter()
        model(ids, last_only=True)
        sync(model.device)
    return time.perf_counter() - start


def serve_model(model, name: str, sizes: Sizes, progress: Callable[[str], None] = print) -> dict:
    """Both comparisons on one model.

    The arrival rates come from the speed of this model on this machine, measured first: the mixed workload
    arrives `sizes.load` times faster than static batching's estimated capacity (decode steps x their time),
    so that both systems have a queue to work on; the shared-prefix one at `sizes.prefix_load` times the
    capacity without prefix caching (a prompt's prefill plus its decode steps' share of a batch)."""
    cfg, s = model.config, sizes
    out: dict = {
        "model": name,
        "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_positions": cfg.n_positions},
        "sizes": dataclasses.asdict(s),
    }
    progress(f"serving, {name}: timing a decode step and a prefill")
    step_s = decode_step_seconds(model, s.batch_size, s.prompt_median)
    # one engine run before the measurements: the first calls of some kernels are slower
    run_engine(model, Workload([[1] * s.prompt_median] * 2, [4, 4], [0.0, 0.0]), max_num_seqs=2)

    # mixed workload: static batching against continuous batching, the same KV positions
    w = mixed_workload(
        s.requests, vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, rate=1.0, seed=s.seed, sizes=s
    )
    static_steps = sum(max(w.max_new_tokens[i : i + s.batch_size]) for i in range(0, s.requests, s.batch_size))
    rate = s.load * s.requests / (static_steps * step_s)
    w = with_rate(w, rate, s.seed)
    budget = s.batch_size * w.longest
    engine_args = dict(
        block_size=s.block_size,
        num_blocks=budget // s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
    )
    progress(f"serving, {name}: {s.requests} requests, static batching (B={s.batch_size})")
    static = run_static(model, w, s.batch_size)
    progress(f"serving, {name}: {s.requests} requests, LLMEngine")
    engine, stats = run_engine(model, w, **engine_args)
    out["mixed"] = {
        "rate_per_s": rate,
        "decode_step_ms": 1e3 * step_s,
        "static_steps": static_steps,
        "prompt_tokens": sum(map(len, w.prompts)),
        "kv_positions": budget,
        "engine_kv_positions": engine_args["num_blocks"] * s.block_size,
        "same_tokens": [r.tokens for r in static] == [r.tokens for r in engine],
        "static": summary(static),
        "engine": {**summary(engine), **stats},
    }

    # shared system prompt: prefix caching on and off
    p = shared_prefix_workload(
        s.prefix_requests, vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, rate=1.0, seed=s.seed, sizes=s
    )
    prompt_s = prefill_seconds(model, s.system_len + s.user_median)
    rate = s.prefix_load / (prompt_s + s.prefix_output * step_s / s.batch_size)
    p = with_rate(p, rate, s.seed)
    runs = {}
    for caching in (True, False):
        progress(f"serving, {name}: shared system prompt, prefix caching {'on' if caching else 'off'}")
        records, stats = run_engine(model, p, **dict(engine_args, num_blocks=None), prefix_caching=caching)
        runs["cached" if caching else "uncached"] = {**summary(records), **stats}
    out["prefix"] = {
        "rate_per_s": rate,
        "prefill_ms": 1e3 * prompt_s,
        "system_len": s.system_len,
        "prompt_tokens": sum(map(len, p.prompts)),
        **runs,
    }
    return out


def run(
    models: Sequence[str] = MODELS,
    *,
    device: str = "auto",
    dtype: str = "float32",
    quick: bool = False,
    progress: Callable[[str], None] = print,
) -> dict:
    """The serving benchmark on each model; -> the figures (bench.json's "serving" section)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    loaded = {name: load(name, dev, dt) for name in models}  # bad names fail before anything runs
    weight_bytes = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in loaded.values())
    results = {
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "threads": threads.count(),  # the engine's (torch's own is one while it computes)
        "machine": machine(dev, weight_bytes),
        "models": {},
    }
    for name, model in loaded.items():
        results["models"][name] = serve_model(model, name, sizes_for(model.config.n_positions, quick), progress)
    return results


def ratios(r: dict) -> dict:
    """The headline ratios, per model: continuous / static throughput, static / continuous TTFT and TPOT p50,
    uncached / cached TTFT p50 and p99 on the shared-prefix workload."""
    out = {}
    for name, m in r["models"].items():
        st, en = m["mixed"]["static"], m["mixed"]["engine"]
        on, off = m["prefix"]["cached"], m["prefix"]["uncached"]
        out[name] = {
            "continuous_vs_static_throughput": en["tokens_per_s"] / st["tokens_per_s"],
            "static_vs_continuous_ttft_p50": st["ttft_p50_ms"] / en["ttft_p50_ms"],
            "static_vs_continuous_tpot_p50": st["tpot_p50_ms"] / en["tpot_p50_ms"],
            "prefix_cache_ttft_p50_speedup": off["ttft_p50_ms"] / on["ttft_p50_ms"],
            "prefix_cache_ttft_p99_speedup": off["ttft_p99_ms"] / on["ttft_p99_ms"],
        }
    return out


def table(r: dict) -> str:
    lines = [
        f"serving: {r['device']}, {r['dtype']}, {r['threads']} threads",
        "machine: " + describe_machine(r["machine"]),
    ]
    head = f"    {'':<26}{'tok/s':>8}{'TTFT p50':>10}{'p99':>10}{'TPOT p50':>10}{'p99':>10}{'wall':>8}"

    def row(label: str, v: dict) -> str:
        return (
            f"    {label:<26}{v['tokens_per_s']:8.1f}{v['ttft_p50_ms']:8.0f}ms{v['ttft_p99_ms']:8.0f}ms"
            f"{v['tpot_p50_ms']:8.1f}ms{v['tpot_p99_ms']:8.1f}ms{v['wall_s']:7.1f}s"
        )

    all_ratios = r.get("ratios") or ratios(r)
    for name, m in r["models"].items():
        c, mixed, prefix = m["config"], m["mixed"], m["prefix"]
        s = m["sizes"]
        lines.append(
            f"  {name} ({c['n_layer']} layers, {c['n_embd']} wide): {mixed['static']['requests']} requests, "
            f"{mixed['prompt_tokens']} prompt tokens, {mixed['static']['output_tokens']} output tokens, "
            f"{mixed['rate_per_s']:.2f} requests/s; {mixed['kv_positions']} KV positions each"
        )
        lines.append(head)
        lines.append(row(f"static batching, B={s['batch_size']}", mixed["static"]))
        lines.append(row("LLMEngine", mixed["engine"]))
        e = mixed["engine"]
        lines.append(
            f"      (engine: {e['steps']} steps, {e['preemptions']} preemptions; "
            f"same tokens as static batching: {'yes' if mixed['same_tokens'] else 'NO'})"
        )
        lines.append(
            f"    shared system prompt of {prefix['system_len']} tokens, {prefix['cached']['requests']} "
            f"requests at {prefix['rate_per_s']:.2f}/s:"
        )
        lines.append(row("prefix caching on", prefix["cached"]))
        lines.append(row("prefix caching off", prefix["uncached"]))
        lines.append(
            f"      (prompt tokens served from the cache: {prefix['cached']['cached_tokens']} of "
            f"{prefix['prompt_tokens']})"
        )
        q = all_ratios[name]
        lines.append(
            f"    continuous / static throughput {q['continuous_vs_static_throughput']:.2f}x "
            f"(target {TARGETS['continuous_vs_static_throughput']}x); prefix caching cuts TTFT p50 "
            f"{q['prefix_cache_ttft_p50_speedup']:.1f}x, p99 {q['prefix_cache_ttft_p99_speedup']:.1f}x "
            f"(target {TARGETS['prefix_cache_ttft_p50_speedup']}x)"
        )
    return "\n".join(lines)


def plot(r: dict, out: Path) -> Path:
    """One figure, a column per model, readable at phone width: output tokens/s (static vs continuous), TTFT and
    TPOT percentiles, and TTFT on the shared-prefix workload with prefix caching off and on."""
    import matplotlib  # heavy and optional (the course extra): only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above

    models = list(r["models"].items())
    rows = [
        ("output tok/s", None),
        ("TTFT (ms)", "ttft"),
        ("TPOT (ms)", "tpot"),
        ("TTFT (ms),\nshared prefix", "prefix"),
    ]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(
            len(rows), len(models), figsize=(max(5.6, 2.9 * len(models) + 0.6), 2.2 * len(rows)), squeeze=False
        )
        for col, (name, m) in enumerate(models):
            st, en = m["mixed"]["static"], m["mixed"]["engine"]
            for row, (label, key) in enumerate(rows):
                ax = axes[row, col]
                if key is None:
                    values, names, colors = (
                        [st["tokens_per_s"], en["tokens_per_s"]],
                        ["static", "contin."],
                        [TRANSFORMERS, ENGINE],
                    )
                    ax.bar_label(ax.bar(names, values, color=colors), fmt="%.0f")
                    ax.set_title(name)
                else:
                    base, new = (m["prefix"]["uncached"], m["prefix"]["cached"]) if key == "prefix" else (st, en)
                    k = "ttft" if key == "prefix" else key
                    labels = ("no cache", "prefix cache") if key == "prefix" else ("static", "contin.")
                    values = [base[f"{k}_p50_ms"], base[f"{k}_p99_ms"], new[f"{k}_p50_ms"], new[f"{k}_p99_ms"]]
                    ax.bar([-0.2, 0.8], values[:2], 0.4, color=TRANSFORMERS, label=labels[0])
                    ax.bar([0.2, 1.2], values[2:], 0.4, color=ENGINE, label=labels[1])
                    ax.set_xticks([0, 1], ["p50", "p99"])
                    if col == 0:
                        ax.legend(loc="upper left", fontsize=12, handlelength=1)
                ax.set_ylim(0, (1.7 if key and col == 0 else 1.3) * max(values))  # room for the legend
                ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(3))
                if col == 0:
                    ax.set_ylabel(label)
        return save(fig, out / FIGURE)


def main(models: Sequence[str], out: Path, *, device: str = "auto", dtype: str = "float32", quick: bool = False) -> int:
    """`bench --serving`: measure, then write the "serving" section of out/bench.json (keeping its other
    sections), print the table and the ratios, and draw the figure."""

    def report(results: dict) -> Path:
        results["ratios"] = ratios(results)
        print(table(results))
        return plot(results, out)

    return measure_and_save(out, "serving", lambda: run(models, device=device, dtype=dtype, quick=quick), report)
