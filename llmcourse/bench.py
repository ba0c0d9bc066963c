"""Benchmarks: the engine against transformers on the same weights, and against this machine's limits.

`python -m llmcourse bench` measures, in one run, with interleaved repeats and medians:

- decode tokens/s at batch 1 (128-token prompt, 128 new tokens, greedy), engine vs transformers,
  the engine both eager and with `compile=True` (torch.compile; on a GPU also CUDA graphs);
- prefill tokens/s at several prompt lengths, engine vs transformers;
- the roofline: memory bandwidth and matmul throughput measured now, the bytes and FLOPs of one
  decode step, the bound they put on decode tokens/s, and the engine's fraction of it;
- the KV cache: time per token at several context lengths, with the cache and with full recompute;
- batching: decode tokens/s at several batch sizes (prefill excluded), eager and compiled, against
  each one's roofline.

On a GPU (`--device cuda`, the default when there is one) every row runs there.

By default the model is GPT-2 124M's configuration with random weights in float32: the timings of
a forward pass do not depend on the values of the weights, so no download is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .config import GPT2Config
from .generate import CompileError, generate
from .loading import load_model, resolve_device, resolve_dtype, save_model
from .model import GPT2

CONFIGS = {
    "gpt2": GPT2Config(),
    "tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256),
}


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function, alternating between them so that machine noise hits all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(median_seconds(fn, 1, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second read from memory by summing a large array, as decode streams its weights.

    The array must be far bigger than the last-level cache (480 MB on the course's machines)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    seconds = median_seconds(lambda: x.sum(), repeats, device)
    return x.numel() * 4 / seconds


def measure_matmul(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matrix product."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    seconds = median_seconds(lambda: a @ b, repeats, device)
    return 2 * size**3 / seconds


def decode_step_cost(config: GPT2Config, context: int, bytes_per_value: int, batch: int = 1) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step for `batch` rows: every weight once, plus each row's
    KV cache. The weights are shared by the rows; the cache and the arithmetic are not.

        >>> decode_step_cost(GPT2Config(n_layer=1, n_head=1, n_embd=4, vocab_size=10), context=2, bytes_per_value=4)
        (1248, 600)
    """
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    block_weights = L * (12 * C * C + 13 * C)  # c_attn, c_proj, c_fc, c_proj + biases + 2 layer norms
    head = V * C  # the tied embedding, read whole for the logits
    kv = 2 * L * context * C  # every cached key and value of one row
    values = block_weights + 2 * C + head + batch * (kv + C)  # + ln_f + each row's position row
    flops = batch * (2 * (block_weights + head) + 4 * L * context * C)  # matrix-vector products + attention
    return values * bytes_per_value, flops


def roofline(bandwidth: float, matmul: float, step_bytes: float, step_flops: float, batch: int = 1) -> tuple[float, str]:
    """(the most tokens/s a decode step allows, "memory" or "compute": which limit binds)."""
    memory, compute = bandwidth / step_bytes, matmul / step_flops
    return batch * min(memory, compute), "memory" if memory < compute else "compute"


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
    if model_name in CONFIGS:
        model = GPT2(CONFIGS[model_name]).init_weights(0).to(dev, dt).eval().requires_grad_(False)
    else:
        model = load_model(model_name, device=dev, dtype=dt)
    cfg = model.config
    limit = cfg.n_positions
    prefill_lens = tuple(n for n in prefill_lens if n <= limit)
    contexts = tuple(sorted({min(n, limit - 1) for n in contexts}))  # the decoded token needs one more position
    prompt_len, new_tokens = min(prompt_len, limit // 2), min(new_tokens, limit // 2)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, max(prefill_lens + (prompt_len,))), generator=g)
    hf = transformers_twin(model) if with_transformers else None
    results: dict = {"model": model_name, "config": cfg.__dict__, "device": str(dev), "dtype": str(dt).removeprefix("torch."),
                     "threads": torch.get_num_threads(), "repeats": repeats}
    if dev.type != "cuda":
        results["cuda_skipped"] = ("no CUDA GPU on this machine" if not torch.cuda.is_available()
                                   else f"--device {device} was asked for")

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
        fns["transformers"] = lambda: hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), do_sample=False,
                                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
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
                fns["transformers"] = lambda: hf(x, use_cache=True, logits_to_keep=1)
            seconds = interleaved(fns, repeats, dev)
        results["prefill"][n] = {name: n / s for name, s in seconds.items()}

    # roofline
    progress("roofline: bandwidth and matmul throughput")
    bandwidth, flops = measure_bandwidth(dev), measure_matmul(dev, dt)
    step_bytes, step_flops = decode_step_cost(cfg, prompt_len + new_tokens // 2, dt.itemsize)
    bound, bound_is = roofline(bandwidth, flops, step_bytes, step_flops)
    results["roofline"] = {
        "bandwidth_GBps": bandwidth / 1e9, "matmul_GFLOPs": flops / 1e9,
        "decode_step_MB": step_bytes / 1e6, "decode_step_GFLOP": step_flops / 1e9,
        "bound_tokens_per_s": bound, "bound_is": bound_is,
        **{f"{name}_fraction": results["decode"][name] / bound for name in modes},
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
            results["kv_cache"][n] = {"cached_ms": seconds["cached"] * 1e3, "recompute_ms": seconds["recompute"] * 1e3,
                                      "speedup": seconds["recompute"] / seconds["cached"]}

    # batching: decode only. Generating 2n and n tokens and taking the difference removes the prefill,
    # which for a batch of 32 prompts would otherwise dominate the time.
    results["batching"] = {}
    steps = max(8, new_tokens // 4)
    for b in batch_sizes:
        progress(f"batched decode, batch {b}")
        rows = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).tolist()
        step_cost = decode_step_cost(cfg, prompt_len + 3 * steps // 2, dt.itemsize, b)
        bound, bound_is = roofline(bandwidth, flops, *step_cost, b)
        results["batching"][b] = {"bound_tokens_per_s": bound, "bound_is": bound_is}
        for name, compiled in modes.items():  # one after the other: their weights compete for the cache
            seconds = interleaved({n: decode(rows, n, compiled) for n in (steps, 2 * steps)}, repeats, dev)
            speed = b * steps / max(seconds[2 * steps] - seconds[steps], 1e-9)
            results["batching"][b][name] = speed
            results["batching"][b][f"{name}_fraction"] = speed / bound
    return results


def transformers_twin(model: GPT2):
    """transformers' GPT2LMHeadModel with the same weights (through a saved folder, as a user would)."""
    import tempfile

    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        return GPT2LMHeadModel.from_pretrained(folder, dtype=model.dtype).to(model.device).eval()


def ratios(r: dict) -> dict:
    """The headline ratios the targets are stated in."""
    out = {}
    if "transformers" in r["decode"]:
        out["decode_vs_transformers"] = r["decode"]["engine"] / r["decode"]["transformers"]
        out.update({f"prefill_{n}_vs_transformers": v["engine"] / v["transformers"] for n, v in r["prefill"].items()})
    compiled = "engine_compiled" in r["decode"]
    if compiled and "transformers" in r["decode"]:
        out["decode_compiled_vs_transformers"] = r["decode"]["engine_compiled"] / r["decode"]["transformers"]
    out["decode_roofline_fraction"] = r["roofline"]["engine_fraction"]
    if compiled:
        out["decode_compiled_roofline_fraction"] = r["roofline"]["engine_compiled_fraction"]
    out.update({f"kv_cache_speedup_{n}": v["speedup"] for n, v in r["kv_cache"].items()})
    if 1 in r["batching"]:
        for name, label in [("engine", ""), ("engine_compiled", "_compiled")][: 1 + compiled]:
            one = r["batching"][1][name]
            out.update({f"batch_{b}{label}_vs_batch_1": v[name] / one for b, v in r["batching"].items() if b != 1})
    return out


def table(r: dict) -> str:
    lines = [f"model {r['model']} ({r['config']['n_layer']} layers, {r['config']['n_embd']} wide), "
             f"{r['device']}, {r['dtype']}, {r['threads']} threads, median of {r['repeats']}"]
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
    for n, v in r["prefill"].items():
        row(f"prefill, {n} tokens", v["engine"], v.get("transformers"))
    rf = r["roofline"]
    lines.append(f"  roofline: bandwidth {rf['bandwidth_GBps']:.1f} GB/s, matmul {rf['matmul_GFLOPs']:.0f} GFLOP/s; "
                 f"a decode step reads {rf['decode_step_MB']:.0f} MB and does {rf['decode_step_GFLOP']:.2f} GFLOP")
    compiled = f", compiled {rf['engine_compiled_fraction']:.0%}" if "engine_compiled_fraction" in rf else ""
    lines.append(f"            bound {rf['bound_tokens_per_s']:.1f} tok/s ({rf['bound_is']}-bound); "
                 f"the engine reaches {rf['engine_fraction']:.0%} of it{compiled}")
    for n, v in r["kv_cache"].items():
        lines.append(f"  context {n:>5}: cached {v['cached_ms']:7.2f} ms/token, recompute {v['recompute_ms']:8.2f} "
                     f"ms/token, {v['speedup']:5.1f}x")
    first = min(r["batching"], default=None)
    for b, v in r["batching"].items():
        speeds = [(label, v[name], r["batching"][first][name])
                  for name, label in [("engine", "eager"), ("engine_compiled", "compiled")] if name in v]
        lines.append(f"  batch {b:>3}: " + ", ".join(f"{label} {s:7.1f} tok/s ({s / s1:4.1f}x batch {first})"
                                                    for label, s, s1 in speeds)
                     + f"; {v['bound_is']}-bound at {v['bound_tokens_per_s']:.0f} tok/s")
    if "cuda_skipped" in r:
        lines.append(f"  CUDA rows (all of the above on a GPU, and decode with torch.compile + CUDA graphs): "
                     f"skipped, {r['cuda_skipped']}")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    ax = axes[0]
    d = r["decode"]
    compiled = "engine_compiled" in d
    labels = ["decode b=1"] + ["decode compiled"] * compiled + [f"prefill {n}" for n in r["prefill"]]
    engine = [d["engine"]] + [d["engine_compiled"]] * compiled + [v["engine"] for v in r["prefill"].values()]
    ax.bar([i - 0.2 for i in range(len(labels))], engine, 0.4, label="engine")
    if "transformers" in d:
        ref = [d["transformers"]] * (1 + compiled) + [v["transformers"] for v in r["prefill"].values()]
        ax.bar([i + 0.2 for i in range(len(labels))], ref, 0.4, label="transformers")
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.set_title("engine (blue) vs transformers (orange)")
    ax = axes[1]
    rf = r["roofline"]
    bars = {"roofline bound": rf["bound_tokens_per_s"], "engine": d["engine"]}
    if compiled:
        bars["compiled"] = d["engine_compiled"]
    ax.bar(list(bars), list(bars.values()), color=["#999", "C0", "C2"][: len(bars)])
    ax.set_title(f"decode, batch 1, vs the {rf['bound_is']} roofline")
    ax.set_ylabel("tokens/s")
    ax = axes[2]
    ctx = list(r["kv_cache"])
    ax.plot(ctx, [v["cached_ms"] for v in r["kv_cache"].values()], "o-", label="KV cache")
    ax.plot(ctx, [v["recompute_ms"] for v in r["kv_cache"].values()], "o-", label="recompute")
    ax.set_xlabel("context length")
    ax.set_ylabel("ms per new token")
    ax.set_yscale("log")
    ax.set_title("time per token")
    ax.legend()
    ax = axes[3]
    bs = list(r["batching"])
    ax.plot(bs, [v["engine"] for v in r["batching"].values()], "o-", label="engine")
    if compiled:
        ax.plot(bs, [v["engine_compiled"] for v in r["batching"].values()], "o-", color="C2", label="compiled")
    ax.plot(bs, [v["bound_tokens_per_s"] for v in r["batching"].values()], "--", color="#999", label="roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("batching")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm import tqdm

        bar = tqdm(desc="bench", unit="part")
        results = run(model_name=args.model, device=args.device, dtype=args.dtype, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, prefill_lens=tuple(args.prefill_lens),
                      contexts=tuple(args.contexts), batch_sizes=tuple(args.batch_sizes), repeats=args.repeats,
                      with_transformers=not args.no_transformers, compile=not args.no_compile,
                      progress=lambda s: (bar.set_postfix_str(s), bar.update()))
        bar.close()
    except ValueError as err:
        print(f"python -m llmcourse bench: error: {err}")
        return 2
    results["ratios"] = ratios(results)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "bench.png")
    print(table(results))
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in results["ratios"].items()))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0
