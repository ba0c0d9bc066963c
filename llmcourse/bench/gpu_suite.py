"""`python -m llmcourse bench --gpu-suite`: the prepared check for a lent GPU, in under 5 minutes with compilation.

One command, for a session that gets a GPU for a few minutes: it measures what the course says of GPUs, runs the
CUDA tests (after the first measurement, the one the check is for: at most TESTS_S seconds), and prints tables
ready for the benchmarks page and chapters 07 and 10 (also written to out/gpu_suite.md and the "gpu_suite" section
of out/bench.json):

- **decode at batch 1**: random-weight models of Llama-3-8B's and Llama-3.2-1B's shapes (`SHAPES`; about 16 GB and
  2.5 GB in bfloat16) in bfloat16, int8 and int4, each decode step one CUDA graph (`generate(compile=True)`):
  tokens/s, and MBU, the bytes a step reads (weights and KV cache) times steps/s over the card's datasheet
  bandwidth (`roofline.GPUS`);
- **batches** of 16 and 64 rows: tokens/s of all rows;
- **LLMEngine** with 64 requests at once, its decode steps as CUDA graphs (`compile=True`) and without;
- **paged attention**: one layer's decode attention over a paged cache by chapter 07's routes (the engine's copy of
  each request's blocks, torch's fused kernel and a second pass for the log-sum-exp the partitions need; the same
  without that pass; on CUDA the memory-efficient kernel that returns it; the exercise's block loop) and by
  FlexAttention reading the blocks where they lie;
- **the capstone's table** (chapter 12) on the GPU.

Each section is timed; a section that fails is reported as such and the suite goes on; sections that would start
after `budget` seconds are listed as not run. `tiny=True` runs the same logic on a tiny model in seconds (what the
test suite does on a CPU; its figures mean nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from llmcourse.engine.generate import compile_step, decode_steps
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.loading import load_model, resolve_device
from llmcourse.engine.quantize import quantize_model, resident_bytes
from llmcourse.engine.roofline import GPUS, card_of
from llmcourse.engine.sampling import SamplingParams
from llmcourse.serving import paged_cache
from llmcourse.serving.llm_engine import LLMEngine

from . import capstone
from .common import measure_bandwidth, median_seconds, sync

SHAPES = {  # config.json of meta-llama/Meta-Llama-3-8B and meta-llama/Llama-3.2-1B (context cut to 2048)
    "Llama-3-8B": LlamaConfig(
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        intermediate_size=14336,
        vocab_size=128256,
        n_positions=2048,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "Llama-3.2-1B": LlamaConfig(
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        intermediate_size=8192,
        vocab_size=128256,
        n_positions=2048,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),  # fmt: skip
}
TINY = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=512, n_positions=256)
TESTS = {False: ["tests"], True: ["tests/test_decode_graphs.py"]}  # tiny: the graphs' own tests only
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}  # the models' dtype on each device
BUDGET_S = 290.0  # the suite's sections start only within this many seconds (a lent GPU's check: 5 minutes)
TESTS_S = 90.0  # the CUDA tests' share of it at most


@dataclasses.dataclass(frozen=True)
class Sizes:
    prompt: int = 128  # prompt tokens of every decode
    steps: int = 64  # decode steps timed (after a warm-up run that compiles)
    batches: tuple[int, ...] = (16, 64)
    requests: int = 64  # LLMEngine: requests at once
    request_tokens: int = 64  # LLMEngine: new tokens per request
    contexts: int = 1024  # paged attention: positions per request
    block_size: int = 16
    repeats: int = 3


FULL, SMALL = Sizes(), Sizes(prompt=8, steps=4, batches=(2, 4), requests=4, request_tokens=4, contexts=64, repeats=1)


def random_model(config: LlamaConfig, device: torch.device, fmt: Optional[str]) -> Llama:
    """A model of this shape with random weights (std 0.02, made on the device in its dtype, `DTYPE`: seconds for
    8B), quantized to `fmt` (None: the float weights)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE[device.type])
    try:
        with torch.device(device):
            model = Llama(config)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.eval()
    return quantize_model(model, fmt) if fmt else model


def step_bytes(model: Llama, batch: int, context: int) -> int:
    """Bytes one decode step reads: every weight once (an untied token table only for its rows: left out) and the
    KV cache of `batch` rows of `context` positions."""
    cfg = model.config
    weights = resident_bytes(model)
    if not cfg.tie_word_embeddings:
        table = model.embed_tokens
        weights -= sum(t.numel() * t.element_size() for t in [*table.parameters(), *table.buffers()])
    element = torch.empty((), dtype=model.dtype).element_size()
    return weights + 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * element * batch * context


def decode_rate(model, batch: int, sizes: Sizes) -> float:
    """Decode steps per second of `batch` rows after a prompt of sizes.prompt tokens, each step a compiled graph
    (a CUDA graph on a GPU): one run compiles, then the best of `repeats` runs, each timed from its first token to
    its last (the prefill left out)."""
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(sizes.prompt)] for i in range(batch)]
    settings = SamplingParams()

    def steps():
        return decode_steps(
            model, prompts, settings, max_new_tokens=sizes.steps + 1, eos_token_id=None, generator=None, compile=True
        )

    for _ in steps():  # compiles (or captures) the graph of this batch and cache length
        pass
    best = 0.0
    for _ in range(sizes.repeats):
        loop = steps()
        next(loop)  # the prefill and the first token
        sync(model.device)
        start = time.perf_counter()
        for _ in loop:
            pass
        sync(model.device)
        best = max(best, sizes.steps / (time.perf_counter() - start))
    return best


def decode_section(device, shapes, sizes: Sizes, bandwidth: float, budget: "Budget") -> list[dict]:
    rows = []
    for fmt in (None, "int8", "int4"):
        for name, config in shapes.items():
            if not budget.left():
                rows.append(dict(model=name, format=fmt or "bfloat16", skipped="time budget"))
                continue
            model = random_model(config, device, fmt)
            started = time.perf_counter()
            rate = decode_rate(model, 1, sizes)
            context = sizes.prompt + sizes.steps // 2
            read = step_bytes(model, 1, context)
            rows.append(
                dict(
                    model=name,
                    format=fmt or str(model.dtype).removeprefix("torch."),
                    batch=1,
                    tokens_per_s=rate,
                    GB_per_step=read / 1e9,
                    MBU=read * rate / bandwidth,
                    seconds=time.perf_counter() - started,
                )
            )
            del model
            free(device)
    return rows


def batch_section(device, shapes, sizes: Sizes, bandwidth: float, budget: "Budget") -> list[dict]:
    rows = []
    for name, config in shapes.items():
        model = None
        for batch in sizes.batches:
            if not budget.left():
                rows.append(dict(model=name, batch=batch, skipped="time budget"))
                continue
            model = model or random_model(config, device, None)
            rate = decode_rate(model, batch, sizes)
            read = step_bytes(model, batch, sizes.prompt + sizes.steps // 2)
            rows.append(dict(model=name, batch=batch, tokens_per_s=rate * batch, MBU=read * rate / bandwidth))
        del model
        free(device)
    return rows


def engine_section(device, config: LlamaConfig, sizes: Sizes) -> list[dict]:
    """LLMEngine with sizes.requests requests at once, decode steps compiled and not: tokens/s of the whole run
    (prefill included), after a warm-up run of the same workload."""
    model = random_model(config, device, None)
    prompts = [[(11 * i + j) % config.vocab_size for j in range(sizes.prompt)] for i in range(sizes.requests)]
    rows, tokens = [], {}
    for compiled in (False, True):
        engine = LLMEngine(model, max_num_seqs=sizes.requests, max_num_batched_tokens=4096, compile=compiled)

        def run():
            return engine.generate(prompts, max_new_tokens=sizes.request_tokens, eos_token_id=None)

        tokens[compiled] = run()  # compiles the buckets the workload meets
        seconds = median_seconds(run, sizes.repeats, device)
        rows.append(
            dict(
                route="CUDA graphs per batch bucket" if compiled else "eager",
                requests=sizes.requests,
                tokens_per_s=sizes.requests * sizes.request_tokens / seconds,
                buckets=sorted(engine.graphs.sizes_run) if compiled else [],
            )
        )
    rows[1]["same_tokens"] = tokens[True] == tokens[False]
    del model
    free(device)
    return rows


def paged_section(device, config: LlamaConfig, sizes: Sizes) -> list[dict]:
    """One layer's decode attention for 32 requests (8 on the tiny model) of sizes.contexts positions over a paged
    pool whose blocks are shuffled, by each route; ms per call, and each route's output against the block loop's."""
    dtype = DTYPE[device.type]
    G = 32 if config is not TINY else 8
    H, H_kv, D, bs = config.n_head, config.n_kv_head, config.head_dim, sizes.block_size
    per_request = -(-sizes.contexts // bs)
    num_blocks = G * per_request
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(num_blocks, bs, H_kv, D, generator=g).to(device, dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g).view(G, per_request).to(device)  # [G, blocks]
    lengths = torch.full((G,), sizes.contexts, device=device)
    q = torch.randn(G, H, D, generator=g).to(device, dtype)
    flex = compile_step(
        lambda q, k, v, t, n: paged_cache.paged_attention_flex(q, k, v, paged_cache.flex_mask(t, n, bs, num_blocks)),
        device,
    )

    def gathered():  # each request's blocks copied side by side: [G, H_kv, L, D] each
        blocks = tables.flatten()
        k = k_pool.index_select(0, blocks).view(G, -1, H_kv, D).transpose(1, 2)
        return q.view(G, H_kv, H // H_kv, D), k, v_pool.index_select(0, blocks).view(G, -1, H_kv, D).transpose(1, 2)

    def fused_only():
        return torch.nn.functional.scaled_dot_product_attention(*gathered()).reshape(G, H, D)

    def efficient_with_lse():  # CUDA: the memory-efficient kernel returns the log-sum-exp in the same pass
        return torch.ops.aten._scaled_dot_product_efficient_attention(*gathered(), None, True)[0].reshape(G, H, D)

    def engine_route():
        return paged_cache.paged_attention_fused(q, k_pool, v_pool, tables, lengths)[0]

    def block_loop():
        return paged_cache.paged_attention(q, k_pool, v_pool, tables, lengths)[0]

    routes: dict[str, Callable[[], torch.Tensor]] = {
        "gather, fused attention + log-sum-exp pass (the engine's eager route)": engine_route,
        "gather, fused attention only": fused_only,
        "FlexAttention over the pool (LLMEngine's graphs)": lambda: flex(q, k_pool, v_pool, tables, lengths),
        "block loop (chapter 07's exercise)": block_loop,
    }
    if device.type == "cuda":
        routes["gather, efficient attention returning the log-sum-exp"] = efficient_with_lse
    reference = paged_cache.paged_attention(q.float(), k_pool.float(), v_pool.float(), tables, lengths)[0]
    rows = []
    for route, fn in routes.items():
        error = (fn().float() - reference).abs().max().item()  # also the warm-up (compiles the flex kernel)
        seconds = median_seconds(fn, max(5, sizes.repeats), device)
        rows.append(dict(route=route, requests=G, positions=sizes.contexts, ms=seconds * 1e3, max_error=error))
    return rows


def tests_section(paths: list[str], seconds: float) -> list[dict]:
    """The CUDA tests (`-k cuda`: every test parametrized for the device, and the CUDA-only ones)."""
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-k", "cuda", *paths]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        return [dict(command=" ".join(command[1:]), returncode=done.returncode, summary=last)]
    except subprocess.TimeoutExpired:
        return [dict(command=" ".join(command[1:]), returncode=None, summary=f"stopped after {seconds:.0f} s")]


def capstone_section(device, quick: bool) -> list[dict]:
    results = capstone.measure(load_model("gpt2-shakespeare", device=device), quick=quick, with_transformers=not quick)
    return [dict(table=capstone.table(results))]


class Budget:
    """Seconds since the suite started; `left()` while a section may still start."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def used(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> bool:
        return self.used() < self.seconds


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(
    device: str = "auto", *, tiny: bool = False, budget: float = BUDGET_S, tests: Optional[list[str]] = None
) -> dict:
    """Every section, in order, each timed; -> {"machine": ..., "sections": {name: {"rows": [...], "seconds": ...}
    or {"error": ...} or {"skipped": ...}}}."""
    dev = resolve_device(device)
    sizes, shapes = (SMALL, {"tiny": TINY}) if tiny else (FULL, SHAPES)
    clock = Budget(budget)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        card = card_of(name)
        bandwidth = GPUS[card].bandwidth if card else measure_bandwidth(dev)
        source = f"{card} datasheet" if card else "measured (card not in roofline.GPUS)"
    else:
        name, bandwidth, source = "CPU", measure_bandwidth(dev, megabytes=64 if tiny else 1024), "measured"
    small = shapes.get("Llama-3.2-1B", TINY)
    sections: dict[str, Callable[[], list[dict]]] = {  # the figure the check is for first: 8B, bf16, batch 1
        "decode": lambda: decode_section(dev, shapes, sizes, bandwidth, clock),
        "tests": lambda: tests_section(tests or TESTS[tiny], max(10.0, min(TESTS_S, budget - clock.used()))),
        "batches": lambda: batch_section(dev, dict(reversed(shapes.items())), sizes, bandwidth, clock),
        "engine": lambda: engine_section(dev, small, sizes),
        "paged attention": lambda: paged_section(dev, small, sizes),
        "capstone": lambda: capstone_section(dev, quick=tiny),
    }
    results = {
        "machine": dict(device=name, bandwidth_GB_s=bandwidth / 1e9, bandwidth_source=source, torch=torch.__version__),
        "sections": {},
    }
    for section, measure in sections.items():
        if not clock.left():
            results["sections"][section] = dict(skipped=f"not started: {clock.used():.0f} s of the {budget:.0f} s used")
            continue
        started = time.perf_counter()
        try:
            rows = measure()
            results["sections"][section] = dict(rows=rows, seconds=time.perf_counter() - started)
        except Exception as err:  # one section's failure is a finding, not the end of the check
            traceback.print_exc()
            results["sections"][section] = dict(error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        free(dev)
    results["seconds"] = clock.used()
    return results


def number(x, column: str) -> str:
    """A cell: MBU as a percentage, other floats to 3 significant digits (thousands separated)."""
    if isinstance(x, float):
        return f"{x:.0%}" if column == "MBU" else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def markdown(results: dict) -> str:
    """The results as markdown: the machine, then a table per section (its rows' keys as columns)."""
    m = results["machine"]
    lines = [
        f"GPU check on {m['device']} (bandwidth {m['bandwidth_GB_s']:,.0f} GB/s, {m['bandwidth_source']}), "
        f"torch {m['torch']}, {results['seconds']:.0f} s in all.",
        "",
    ]
    for section, outcome in results["sections"].items():
        lines.append(f"**{section}**" + (f" ({outcome['seconds']:.0f} s)" if "seconds" in outcome else ""))
        lines.append("")
        if "rows" not in outcome:
            lines += [
                f"{'failed' if 'error' in outcome else 'not run'}: {outcome.get('error') or outcome['skipped']}",
                "",
            ]
            continue
        for row in outcome["rows"]:
            if "table" in row:  # the capstone's own table
                lines += [row["table"], ""]
        rows = [r for r in outcome["rows"] if "table" not in r]
        if rows:
            columns = list(dict.fromkeys(k for r in rows for k in r))
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            lines += ["| " + " | ".join(number(r.get(c, ""), c) for c in columns) + " |" for r in rows]
            lines.append("")
    return "\n".join(lines)


def main(out: Path, *, device: str = "auto", tiny: bool = False, tests: Optional[list[str]] = None) -> int:
    """`bench --gpu-suite`: run, print the tables, write out/gpu_suite.md and the "gpu_suite" section of
    out/bench.json. Refused on a CPU unless `tiny` (the CPU's figures of these models would take an hour)."""
    try:
        dev = resolve_device(device)
        if dev.type != "cuda" and not tiny:
            raise ValueError("the GPU check needs a CUDA device; --tiny runs its logic on a tiny model on the CPU")
    except ValueError as err:
        print(f"python -m llmcourse bench: error: {err}", file=sys.stderr)
        return 2
    if dev.type == "cpu":  # the logic only: dynamo traces every compiled step and runs it without generating code
        os.environ.setdefault("LLMCOURSE_COMPILE_BACKEND", "eager")
    results = run(device, tiny=tiny, tests=tests)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    print(text)
    (out / "gpu_suite.md").write_text(text + "\n")
    path = out / "bench.json"
    whole = json.loads(path.read_text()) if path.exists() else {}
    whole["gpu_suite"] = results
    path.write_text(json.dumps(whole, indent=2) + "\n")
    print(f"wrote {out / 'gpu_suite.md'} and the gpu_suite section of {path}")
    failed = [s for s, o in results["sections"].items() if "error" in o]
    return 1 if failed else 0
