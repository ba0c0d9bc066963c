"""The speed benchmark (`python -m llmcourse bench`, the default): the engine against transformers on the same
weights, and against this machine's limits.

`python -m llmcourse bench` measures, in one run, with interleaved repeats and medians:

- decode tokens/s at batch 1 (128-token prompt, 128 new tokens, greedy), engine vs transformers,
  the engine both eager and with `compile=True` (torch.compile; on a GPU also CUDA graphs);
- prefill tokens/s at several prompt lengths, engine vs transformers;
- the roofline: memory bandwidth and matmul throughput measured now, the bytes and FLOPs of one
  decode step, the bound they put on decode tokens/s (the engine's `predict`, chapter 10: each kernel of the
  step on its own roofline, the step's least time the sum of theirs), and the engine's fraction of it;
- the KV cache: time per token at several context lengths, with the cache and with full recompute;
- batching: decode tokens/s at several batch sizes (prefill excluded), eager and compiled, against
  each one's roofline;
- MBU and MFU (the engine's `predict` given the measured time, which runs `utilization`) of every decode and
  prefill row: the bytes a step moves per second over the measured bandwidth, its FLOP/s over the measured matmul
  throughput; on a card of the engine's `GPUS`, also over its datasheet figures.

Every predicted figure is the engine's `predict` for the model's `ModelShape`, weights and activations in the run's
dtype (`predict_step`): one count of a step's kernels, the one chapter 10's learners write.

On a GPU (`--device cuda`, the default when there is one) every row runs there.

The machine is recorded with the figures (CPU model, cores, last-level cache, and whether the
model's weights fit in that cache): how close decode comes to the roofline, and how it compares with
transformers, depend on it. A cache that holds most of the weights serves part of each step's reads
faster than memory.

By default the model is GPT-2 124M's configuration with random weights in float32: the timings of
a forward pass do not depend on the values of the weights, so no download is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from llmcourse.engine import roofline as engine_roofline
from llmcourse.engine import threads
from llmcourse.engine.generate import CompileError, generate
from llmcourse.engine.loading import resolve_device, resolve_dtype
from llmcourse.engine.roofline import ModelShape, Prediction, card_of, gpu_roof

from .common import (
    COMPILED,
    ENGINE,
    FIGSIZE,
    ROOF,
    STYLE,
    TRANSFORMERS,
    bound_of,
    describe_machine,
    load,
    machine,
    measure_bandwidth,
    measure_matmul,
    median_seconds,
    save,
    transformers_twin,
)


def torch_threads(fn: Callable) -> Callable:
    """`fn` run with torch's own threads at the engine's count: transformers computes with torch's threads, and the
    engine set torch's own count to one (`llmcourse.engine.threads`)."""

    def run(*args, **kwargs):
        with threads.torch_computes():
            return fn(*args, **kwargs)

    return run


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function, alternating between them so that machine noise hits all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(median_seconds(fn, 1, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(
    *,
    model_name: str = "gpt2",
    device: str = "auto",
    dtype: str = "float32",
    prompt_len: int = 128,
    new_tokens: int = 128,
    prefill_lens: tuple[int, ...] = (128, 512, 1024),
    contexts: tuple[int, ...] = (128, 512, 1024),
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32),
    repeats: int = 3,
    with_transformers: bool = True,
    compile: bool = True,
    progress: Callable[[str], None] = print,
) -> dict:
    """Run every benchmark; return the figures as a dict (what `bench` writes as JSON)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    model = load(model_name, dev, dt)  # a configuration of `CONFIGS` (random weights) or a model's name
    cfg = model.config
    limit = cfg.n_positions
    prefill_lens = tuple(n for n in prefill_lens if n <= limit)
    contexts = tuple(sorted({min(n, limit - 1) for n in contexts}))  # the decoded token needs one more position
    prompt_len, new_tokens = min(prompt_len, limit // 2), min(new_tokens, limit // 2)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, max(prefill_lens + (prompt_len,))), generator=g)
    hf = transformers_twin(model) if with_transformers else None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
    results: dict = {
        "model": model_name,
        "config": cfg.__dict__,
        "shape": dataclasses.asdict(ModelShape.of(cfg)),  # what `predict_step` predicts from
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "threads": threads.count(),
        "repeats": repeats,
        "machine": machine(dev, weight_bytes),
    }
    if dev.type != "cuda":
        results["cuda_skipped"] = (
            "no CUDA GPU on this machine" if not torch.cuda.is_available() else f"--device {device} was asked for"
        )

    def decode(rows, n: int, compiled: bool) -> Callable[[], object]:
        return lambda: generate(model, rows, max_new_tokens=n, eos_token_id=None, compile=compiled)

    # decode at batch 1
    progress("decode, batch 1" + (" (compiling)" if compile else ""))
    ids = prompt[0, :prompt_len].tolist()
    modes = {"engine": False}
    if compile:
        try:
            decode(ids, new_tokens, True)()  # compiles (on CUDA also records the graph)
            modes["engine_compiled"] = True
        except CompileError as err:
            results["compile_skipped"] = str(err)
    fns = {name: decode(ids, new_tokens, compiled) for name, compiled in modes.items()}
    if hf is not None:
        hf_ids = prompt[:, :prompt_len].to(dev)
        fns["transformers"] = lambda: torch_threads(hf.generate)(
            hf_ids,
            attention_mask=torch.ones_like(hf_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    seconds = interleaved(fns, repeats, dev)
    results["decode"] = {name: new_tokens / s for name, s in seconds.items()}

    # prefill
    results["prefill"] = {}
    for n in prefill_lens:
        progress(f"prefill, {n} tokens")
        x = prompt[:, :n].to(dev)
        with torch.inference_mode():
            fns = {"engine": lambda: model(x, cache=model.new_cache(1, n), last_only=True)}
            if hf is not None:
                fns["transformers"] = lambda: torch_threads(hf)(x, use_cache=True, logits_to_keep=1)
            seconds = interleaved(fns, repeats, dev)
        results["prefill"][n] = {name: n / s for name, s in seconds.items()}

    # roofline
    progress("roofline: bandwidth and matmul throughput")
    cache_MB = results["machine"]["llc_MB"] or 0
    with threads.torch_computes():  # the machine's bandwidth and matmul rate on the engine's threads
        bandwidth, flops = measure_bandwidth(dev, max(1024, int(4 * cache_MB))), measure_matmul(dev, dt)
    context = prompt_len + new_tokens // 2  # the middle of the decode
    p = predict_step(results, (flops, bandwidth), context=context)
    results["roofline"] = {
        "bandwidth_GBps": bandwidth / 1e9,
        "matmul_GFLOPs": flops / 1e9,
        "context": context,
        "decode_step_MB": p.bytes / 1e6,
        "decode_step_GFLOP": p.flops / 1e9,
        "bound_tokens_per_s": p.tokens_per_s,
        "bound_is": bound_of(p),
        "compute_bound": p.compute_bound(),
        **{f"{name}_fraction": results["decode"][name] / p.tokens_per_s for name in modes},
    }

    # KV cache vs recompute
    results["kv_cache"] = {}
    with torch.inference_mode():
        for n in contexts:
            progress(f"KV cache vs recompute, context {n}")
            x = prompt[:, :n].to(dev)
            nxt = prompt[:, n : n + 1].to(dev)
            cache = model.new_cache(1, n + 1)
            model(x, cache=cache)

            def cached():
                model(nxt, cache=cache)
                cache.length -= 1  # undo, so every repeat decodes at the same context

            full = torch.cat([x, nxt], dim=1)
            seconds = interleaved({"cached": cached, "recompute": lambda: model(full, last_only=True)}, repeats, dev)
            results["kv_cache"][n] = {
                "cached_ms": seconds["cached"] * 1e3,
                "recompute_ms": seconds["recompute"] * 1e3,
                "speedup": seconds["recompute"] / seconds["cached"],
            }

    # batching: decode only. Generating 2n and n tokens and taking the difference removes the prefill,
    # which for a batch of 32 prompts would otherwise dominate the time.
    results["batching"] = {}
    steps = max(8, new_tokens // 4)
    for b in batch_sizes:
        progress(f"batched decode, batch {b}")
        rows = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).tolist()
        context = prompt_len + 3 * steps // 2  # the middle of the second half, the steps measured
        p = predict_step(results, (flops, bandwidth), batch=b, context=context)
        bound = p.tokens_per_s
        results["batching"][b] = {
            "context": context,
            "bound_tokens_per_s": bound,
            "bound_is": bound_of(p),
            "compute_bound": p.compute_bound(),
            "step_MB": p.bytes / 1e6,
            "step_GFLOP": p.flops / 1e9,
        }
        for name, compiled in modes.items():  # one after the other: their weights compete for the cache
            seconds = interleaved({n: decode(rows, n, compiled) for n in (steps, 2 * steps)}, repeats, dev)
            if seconds[2 * steps] > seconds[steps]:
                speed = b * steps / (seconds[2 * steps] - seconds[steps])
            else:  # noise larger than the difference (a tiny model): count the prefill in, an underestimate
                speed = b * 2 * steps / seconds[2 * steps]
            results["batching"][b][name] = speed
            results["batching"][b][f"{name}_fraction"] = speed / bound

    # MBU and MFU: against what this run measured, and on a known card against its datasheet
    results["prefill_GFLOP"] = {
        n: predict_step(results, (flops, bandwidth), new_tokens=n).flops / 1e9 for n in prefill_lens
    }
    results["utilization"] = {"measured": {"peak_GFLOPs": flops / 1e9, "bandwidth_GBps": bandwidth / 1e9}}
    card = card_of(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    if card is not None:
        peak, bw = gpu_roof(card)
        results["utilization"]["datasheet"] = {"card": card, "peak_GFLOPs": peak / 1e9, "bandwidth_GBps": bw / 1e9}
    for against in results["utilization"].values():
        against.update(utilizations(results, against["peak_GFLOPs"] * 1e9, against["bandwidth_GBps"] * 1e9))
    return results


def predict_step(
    r: dict,
    machine_figures: tuple[float, float],
    *,
    batch: int = 1,
    new_tokens: int = 1,
    context: int = 0,
    measured_seconds: Optional[float] = None,
) -> Prediction:
    """The engine's `predict` for a step of the results' model (`r["shape"]`, weights and activations in
    `r["dtype"]`) on a machine (peak FLOP/s, bandwidth): a decode step of `batch` sequences after `context` cached
    positions, or a prefill of `new_tokens`, the head on the last position only (as the engine's generation and
    transformers' `logits_to_keep=1` run it). Given `measured_seconds`, also MBU and MFU.

        >>> from llmcourse.engine.roofline import SHAPES
        >>> r = {"shape": dataclasses.asdict(SHAPES["GPT-2 124M"]), "dtype": "float32"}
        >>> p = predict_step(r, (188e9, 20.5e9), context=192)   # GPT-2 124M, float32, images/bench.json's machine
        >>> round(p.tokens_per_s, 1), bound_of(p), round(p.bytes / 1e6)
        (40.2, 'memory', 510)
    """
    return engine_roofline.predict(
        ModelShape(**r["shape"]),
        machine_figures,
        batch=batch,
        new_tokens=new_tokens,
        context=context,
        weights=r["dtype"],
        dtype=r["dtype"],
        last_only=True,
        measured_seconds=measured_seconds,
    )


def utilizations(r: dict, peak_flops: float, bandwidth: float) -> dict:
    """MBU and MFU of every decode row (batch 1, and each batch size) and MFU of every prefill row of the results
    `r`, against a machine's peak FLOP/s and bandwidth: `predict_step` (the engine's `predict`) given the time a step
    took, from the measured tokens/s. Prefill is judged by its FLOPs alone (MFU).

        >>> from llmcourse.engine.roofline import SHAPES
        >>> r = {"shape": dataclasses.asdict(SHAPES["GPT-2 124M"]), "dtype": "float32",
        ...      "decode": {"engine": 40.0}, "roofline": {"context": 192}, "prefill": {}, "batching": {}}
        >>> u = utilizations(r, peak_flops=200e9, bandwidth=25e9)["decode"]["engine"]   # 40 steps/s x 510 MB
        >>> round(u["MBU"], 3), round(u["MFU"], 3)
        (0.816, 0.051)
    """
    machine_figures = (peak_flops, bandwidth)

    def of(seconds: float, **settings) -> dict:
        p = predict_step(r, machine_figures, measured_seconds=seconds, **settings)
        return {"MBU": p.mbu, "MFU": p.mfu}

    context = r["roofline"]["context"]
    out: dict = {"decode": {name: of(1 / speed, context=context) for name, speed in r["decode"].items()}}
    out["prefill"] = {
        n: {name: {"MFU": of(n / speed, new_tokens=n)["MFU"]} for name, speed in v.items()}
        for n, v in by_size(r["prefill"])
    }
    out["batching"] = {
        b: {name: of(b / v[name], batch=b, context=v["context"]) for name in ("engine", "engine_compiled") if name in v}
        for b, v in by_size(r["batching"])
    }
    return out


def bound_text(v: dict) -> str:
    """Which limit bounds a predicted step (`common.bound_of`), in words; where some kernels are compute-bound and
    others memory-bound, which are.

    >>> bound_text({"bound_is": "mixed", "compute_bound": ["q", "k", "v"]}), bound_text({"bound_is": "memory"})
    ('mixed: q, k, v compute-bound', 'memory-bound')
    """
    if v["bound_is"] == "mixed":
        return f"mixed: {', '.join(v['compute_bound'])} compute-bound"
    return f"{v['bound_is']}-bound"


def by_size(d: dict) -> list[tuple[int, dict]]:
    """The rows of a section keyed by a length or a batch size, in order; the keys are ints as `run`
    returns them and strings once read back from JSON."""
    return sorted((int(k), v) for k, v in d.items())


def ratios(r: dict) -> dict:
    """The headline ratios the targets are stated in."""
    out = {}
    d = r["decode"]
    if "transformers" in d:
        out["decode_vs_transformers"] = d["engine"] / d["transformers"]
        out.update({f"prefill_{n}_vs_transformers": v["engine"] / v["transformers"] for n, v in by_size(r["prefill"])})
    compiled = "engine_compiled" in d
    if compiled and "transformers" in d:
        out["decode_compiled_vs_transformers"] = d["engine_compiled"] / d["transformers"]
    out["decode_roofline_fraction"] = r["roofline"]["engine_fraction"]
    if compiled:
        out["decode_compiled_roofline_fraction"] = r["roofline"]["engine_compiled_fraction"]
    out.update({f"kv_cache_speedup_{n}": v["speedup"] for n, v in by_size(r["kv_cache"])})
    batching = dict(by_size(r["batching"]))
    if 1 in batching:
        for name, label in [("engine", ""), ("engine_compiled", "_compiled")]:
            if name in batching[1]:
                one = batching[1][name]
                out.update({f"batch_{b}{label}_vs_batch_1": v[name] / one for b, v in batching.items() if b != 1})
    return out


def table(r: dict) -> str:
    lines = [
        f"model {r['model']} ({r['config']['n_layer']} layers, {r['config']['n_embd']} wide), "
        f"{r['device']}, {r['dtype']}, {r['threads']} threads, median of {r['repeats']}",
        "machine: " + (describe_machine(r["machine"]) if "machine" in r else "not recorded"),
    ]

    def row(label, engine, ref=None, unit="tok/s"):
        extra = f"   transformers {ref:9.1f} {unit}   ratio {engine / ref:5.2f}x" if ref else ""
        lines.append(f"  {label:<28} engine {engine:9.1f} {unit}{extra}")

    d = r["decode"]
    row("decode, batch 1", d["engine"], d.get("transformers"))
    if "engine_compiled" in d:
        graphs = " + CUDA graphs" if r["device"].startswith("cuda") else ""
        row(f"  with torch.compile{graphs}", d["engine_compiled"], d.get("transformers"))
    elif "compile_skipped" in r:
        lines.append(f"  with torch.compile: skipped, {r['compile_skipped']}")
    for n, v in by_size(r["prefill"]):
        row(f"prefill, {n} tokens", v["engine"], v.get("transformers"))
    rf = r["roofline"]
    lines.append(
        f"  roofline: bandwidth {rf['bandwidth_GBps']:.1f} GB/s, matmul {rf['matmul_GFLOPs']:.0f} GFLOP/s; "
        f"a decode step reads {rf['decode_step_MB']:.0f} MB and does {rf['decode_step_GFLOP']:.2f} GFLOP"
    )
    compiled = f", compiled {rf['engine_compiled_fraction']:.0%}" if "engine_compiled_fraction" in rf else ""
    lines.append(
        f"            bound {rf['bound_tokens_per_s']:.1f} tok/s ({bound_text(rf)}); "
        f"the engine reaches {rf['engine_fraction']:.0%} of it{compiled}"
    )
    for n, v in by_size(r["kv_cache"]):
        lines.append(
            f"  context {n:>5}: cached {v['cached_ms']:7.2f} ms/token, recompute {v['recompute_ms']:8.2f} "
            f"ms/token, {v['speedup']:5.1f}x"
        )
    batching = by_size(r["batching"])
    for b, v in batching:
        first, v1 = batching[0]
        speeds = [
            (label, v[name], v1[name])
            for name, label in [("engine", "eager"), ("engine_compiled", "compiled")]
            if name in v
        ]
        lines.append(
            f"  batch {b:>3}: "
            + ", ".join(f"{label} {s:7.1f} tok/s ({s / s1:4.1f}x batch {first})" for label, s, s1 in speeds)
            + f"; {bound_text(v)} at {v['bound_tokens_per_s']:.0f} tok/s"
        )
    if "utilization" in r:
        lines += utilization_table(r["utilization"])
    if "cuda_skipped" in r:
        lines.append(
            f"  CUDA rows (all of the above on a GPU, and decode with torch.compile + CUDA graphs): "
            f"skipped, {r['cuda_skipped']}"
        )
    return "\n".join(lines)


def percent(x: float) -> str:
    """A fraction as a percentage, two significant digits below 10 % (MFU of a decode step is often well under
    1 %), and "<0.01%" below that.

    >>> percent(0.7712), percent(0.07), percent(0.0123), percent(0.00045), percent(1.05), percent(4e-6)
    ('77%', '7.0%', '1.2%', '0.045%', '105%', '<0.01%')
    """
    if x < 1e-4:
        return "<0.01%"
    return f"{x:.0%}" if x >= 0.1 else f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def utilization_table(u: dict) -> list[str]:
    """The table's MBU and MFU lines: one row per decode and prefill row, a pair of columns per machine figure
    they are measured against (this run's measurements; a known card's datasheet)."""
    against = {"measured": "of measured"} | ({"datasheet": f"of {u['datasheet']['card']}"} if "datasheet" in u else {})
    m = u["measured"]
    names = {"engine": "engine", "engine_compiled": "compiled", "transformers": "transformers"}
    rows = [(f"decode, batch 1, {names[n]}", ("decode", n)) for n in m["decode"]]
    rows += [(f"prefill, {n} tokens, {names[k]}", ("prefill", n, k)) for n, v in by_size(m["prefill"]) for k in v]
    batch_names = {"engine": "eager", "engine_compiled": "compiled"}
    rows += [(f"batch {b}, {batch_names[k]}", ("batching", b, k)) for b, v in by_size(m["batching"]) for k in v]
    width = max(len(label) for label, _ in rows)

    def cell(figures: dict, path: tuple) -> dict:
        for key in path:  # keys are ints as `run` returns them, strings once read back from JSON
            figures = figures[key] if key in figures else figures[str(key)]
        return figures

    lines = ["  MBU = bytes moved per second / bandwidth, MFU = FLOP/s / peak, of the figures:"]
    for k, label in against.items():
        peak = u[k]["peak_GFLOPs"]
        peak_text = f"{peak:.0f} GFLOP/s" if peak < 1e4 else f"{peak / 1e3:.0f} TFLOP/s"
        source = " (datasheet)" if k == "datasheet" else " (this run)"
        lines.append(f"    {label}{source}: {u[k]['bandwidth_GBps']:.4g} GB/s, {peak_text}")
    lines += [
        f"    {'':<{width}}" + "".join(f"{label:>18}" for label in against.values()),
        f"    {'':<{width}}" + f"{'MBU':>9}{'MFU':>9}" * len(against),
    ]
    for label, path in rows:
        cells = [cell(u[k], path) for k in against]
        lines.append(
            f"    {label:<{width}}"
            + "".join(f"{percent(c['MBU']) if 'MBU' in c else '-':>9}{percent(c['MFU']):>9}" for c in cells)
        )
    return lines


# One figure per measurement, each readable on a phone (about 400 px wide): `common.STYLE`.
FIGURES = {
    "decode": "bench_decode.png",
    "prefill": "bench_prefill.png",
    "kv_cache": "bench_kv_cache.png",
    "batching": "bench_batching.png",
}


def short_machine(r: dict) -> str:
    m = r.get("machine")
    if not m:
        return r["device"]
    if "gpu" in m:
        return m["gpu"]
    cache = f", {m['llc_MB']:.0f} MB L{m['llc_level']}" if m.get("llc_MB") else ""
    return f"{m['cores']} cores{cache}"


def plot(r: dict, out: Path) -> list[Path]:
    """Write one PNG per measurement (`FIGURES`) into the folder `out`; return their paths."""
    import matplotlib  # heavy and optional (the course extra): only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above
    from matplotlib.ticker import MaxNLocator, NullLocator

    def log_axis(ax, values):
        """A log y axis with two to four plain-number ticks, evenly spaced: 1-2-5, 1-3 or powers of 10."""
        lo, hi = min(values) / 1.4, max(values) * 1.4
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        for subs in [(1, 2, 5), (1, 3), (1,)]:
            ticks = [
                m * 10.0**k
                for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                for m in subs
                if lo <= m * 10.0**k <= hi
            ]
            if len(ticks) <= 4:
                break
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_locator(NullLocator())

    d, rf = r["decode"], r["roofline"]
    paths = []
    with plt.rc_context(STYLE):
        # decode at batch 1: the bound, the engine, compiled, transformers; horizontal bars, values written on them
        fig, ax = plt.subplots(figsize=FIGSIZE)
        bars = [("roofline", rf["bound_tokens_per_s"], ROOF), ("engine", d["engine"], ENGINE)]
        if "engine_compiled" in d:
            bars.append(("compiled", d["engine_compiled"], COMPILED))
        if "transformers" in d:
            bars.append(("transformers", d["transformers"], TRANSFORMERS))
        names, values, colors = zip(*bars[::-1])
        ax.barh(names, values, color=colors)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}" if v >= 10 else f" {v:.1f}", va="center")
        ax.set_xlim(0, max(values) * 1.25)
        ax.xaxis.set_major_locator(MaxNLocator(3))
        ax.set_xlabel("tokens/s")
        ax.set_title(f"decode, batch 1\n{short_machine(r)}")
        paths.append(save(fig, out / FIGURES["decode"]))

        # prefill: engine vs transformers at each prompt length
        fig, ax = plt.subplots(figsize=FIGSIZE)
        prefill = by_size(r["prefill"])
        xs = range(len(prefill))
        two = "transformers" in d
        width = 0.4 if two else 0.6
        ax.bar(
            [x - width / 2 * two for x in xs], [v["engine"] for _, v in prefill], width, color=ENGINE, label="engine"
        )
        if two:
            ax.bar(
                [x + width / 2 for x in xs],
                [v["transformers"] for _, v in prefill],
                width,
                color=TRANSFORMERS,
                label="transformers",
            )
        ax.set_xticks(list(xs), [str(n) for n, _ in prefill])
        ax.yaxis.set_major_locator(MaxNLocator(4))
        ax.set_ylim(0, 1.3 * max(x for _, v in prefill for x in v.values()))  # room for the legend
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_title("prefill")
        ax.legend(loc="upper center", ncol=2)
        paths.append(save(fig, out / FIGURES["prefill"]))

        # the KV cache: time per new token against the context, with the cache and recomputing everything
        fig, ax = plt.subplots(figsize=FIGSIZE)
        kv = by_size(r["kv_cache"])
        ctx = [n for n, _ in kv]
        ax.plot(ctx, [v["recompute_ms"] for _, v in kv], "o-", color=TRANSFORMERS, lw=2.5, label="recompute")
        ax.plot(ctx, [v["cached_ms"] for _, v in kv], "o-", color=ENGINE, lw=2.5, label="KV cache")
        log_axis(ax, [v[k] for _, v in kv for k in ("cached_ms", "recompute_ms")])
        ax.set_xticks(ctx if len(ctx) <= 4 else ctx[:: math.ceil(len(ctx) / 4)])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per new token")
        ax.set_title("time per token")
        ax.legend()
        paths.append(save(fig, out / FIGURES["kv_cache"]))

        # batching: decode tokens/s against the batch size, with each batch size's roofline
        fig, ax = plt.subplots(figsize=FIGSIZE)
        batching = by_size(r["batching"])
        bs = [b for b, _ in batching]
        ax.plot(bs, [v["bound_tokens_per_s"] for _, v in batching], "--", color=ROOF, lw=2.5, label="roofline")
        shown = [v["bound_tokens_per_s"] for _, v in batching]
        for name, label, color in [("engine_compiled", "compiled", COMPILED), ("engine", "eager", ENGINE)]:
            if all(name in v for _, v in batching):
                ax.plot(bs, [v[name] for _, v in batching], "o-", color=color, lw=2.5, label=label)
                shown += [v[name] for _, v in batching]
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.xaxis.set_minor_locator(NullLocator())
        log_axis(ax, shown)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("batching")
        ax.legend()
        paths.append(save(fig, out / FIGURES["batching"]))
    return paths


def main(args: argparse.Namespace) -> int:
    """`bench` without `--serving`, `--speculative` or `--quantize`: measure, then write out/bench.json, print the
    table and the ratios, and draw the figures."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        bar = tqdm(desc="bench", unit="part")
        results = run(
            model_name=args.model,
            device=args.device,
            dtype=args.dtype,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            prefill_lens=tuple(args.prefill_lens),
            contexts=tuple(args.contexts),
            batch_sizes=tuple(args.batch_sizes),
            repeats=args.repeats,
            with_transformers=not args.no_transformers,
            compile=not args.no_compile,
            progress=lambda s: (bar.set_postfix_str(s), bar.update()),
        )
        bar.close()
    except ValueError as err:
        print(f"python -m llmcourse bench: error: {err}")
        return 2
    # The measurements are written first; nothing after them (the ratios, the table, the figures) may lose them.
    path = out / "bench.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    status = 0
    for step in ("ratios", "table", "figures"):
        try:
            if step == "ratios":
                results["ratios"] = ratios(results)
                path.write_text(json.dumps(results, indent=2) + "\n")
            elif step == "table":
                print(table(results))
                print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in results.get("ratios", {}).items()))
            else:
                figures = plot(results, out)
                print(f"wrote {path} and {', '.join(str(f) for f in figures)}")
        except Exception:  # a bug in reporting: show it, keep going, and fail at the end
            sys.stdout.flush()
            traceback.print_exc()
            print(
                f"python -m llmcourse bench: error: could not produce the {step}; the measurements are in {path}",
                file=sys.stderr,
            )
            status = 1
    return status
