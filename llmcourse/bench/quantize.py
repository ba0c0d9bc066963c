"""The quantization benchmark (`python -m llmcourse bench --quantize`): the engine in float32, int8 and int4 against
transformers (float32), CTranslate2 (float32, int8) and llama.cpp (f32, q8_0; batch 1), the inference engines users
pick for CPUs, in one run.

Every engine runs the same random GPT-2 124M weights (CTranslate2 converts the engine's saved folder; llama.cpp reads
them written as GGUF, `bench.llama_cpp`), greedy, in interleaved repeats (the order reversed every other repeat, a
pause before each call so that the threads of the call before are asleep), medians. **Threads**: the engine and
transformers at the engine's choice (`llmcourse.engine.threads`: every core); CTranslate2 and llama.cpp at every
thread count from 1 to the engine's, and at their own defaults (CTranslate2: 4, at most the machine's cores;
llama-cpp-python: half the CPUs), so that the engine is set against each peer at its default and at its best.

- **batch 1**: a 128-token prompt and 128 new tokens; tokens/s = new tokens / the whole call (prompt included, as
  the issue states its targets), and the decode steps alone;
- **batch 16**: 16 prompts of 128 tokens, 32 new tokens each; tokens/s of the decode steps alone (a 2,048-token
  prefill would otherwise dominate). Each step's time is taken when its tokens reach Python (`decode_steps` for the
  engine, a logits processor for transformers, CTranslate2's per-token callback). llama-cpp-python decodes one
  sequence at a time: batch 1 only.

Each row is set against its own roofline (`decode_bound`: the engine's `predict`, chapter 10's count kernel by
kernel, with the weights in the row's format, scales included, as `matrix_bytes` counts them; the tied head counted
quantized, as the engine quantizes the token table; activations and each row's KV cache in float32; llama.cpp's
q8_0, 34 bytes per 32 weights, counted as the engine's int8) on the memory bandwidth measured in the same run
(`common.measure_bandwidth`) and, for float32 rows, the float32 matmul rate (integer products run at other rates:
the quantized rows are bounded by bandwidth alone). The greedy tokens of every row are compared with the engine's
float32 ones (tokens until the first divergence). To say where the time goes, the engine's linear layers alone are
timed per format (all 48 of the blocks, and the head), and its attention over a decode step's cache.

    >>> steps = [decode_bound(GPT2Config(), 192, fmt, 1, (188e9, 20.5e9)) for fmt in ENGINE_FORMATS]   # GPT-2 124M
    >>> [round(p.bytes / 1e6) for p in steps], [round(p.tokens_per_s) for p in steps]   # MB a step moves, tok/s
    ([510, 140, 85], [40, 146, 240])
    >>> first_divergence([1, 2, 3, 4], [1, 2, 5, 4]), first_divergence([1, 2], [1, 2])
    (2, 2)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from llmcourse.engine import cpu_kernels
from llmcourse.engine import roofline as engine_roofline
from llmcourse.engine import threads as engine_threads
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.generate import decode_steps
from llmcourse.engine.loading import resolve_device, save_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.quantize import BYTES_PER_WEIGHT, quantize_model, resident_bytes
from llmcourse.engine.roofline import ModelShape, Prediction
from llmcourse.engine.sampling import SamplingParams
from llmcourse.engine.tokenizer import vocab_files

from . import llama_cpp
from .common import (
    CONFIGS,
    ROOF,
    STYLE,
    bound_of,
    describe_machine,
    machine,
    measure_bandwidth,
    measure_matmul,
    save,
    save_section,
    transformers_twin,
)

FIGURE = "bench_quantize.png"
ENGINE_FORMATS = ("float32", "int8", "int4")
CT2_TYPES = ("float32", "int8")  # on a CPU, CTranslate2's int8 is int8_float32 (and it has no int4)
REFERENCE = "engine float32"  # every row's tokens are compared with this one's
# (faster row, slower row, the target for faster / slower), at each batch size; the engine is also measured
# against CTranslate2 at its own default threads where that differs (`targets`)
PEERS = {"ctranslate2": {"float32": "float32", "int8": "int8"}, "llama.cpp": dict(llama_cpp.GGUF_TYPES)}
OWN_TARGET = ("engine int4", "engine int8", 1.3)  # the engine against itself: int4 reads 0.56x int8's bytes


def ctranslate2_default_threads() -> int:
    """The threads CTranslate2 computes with when not told (`intra_threads` 0): 4, at most the machine's cores."""
    return min(4, os.cpu_count() or 1)


def peer_thread_counts(engine: int, default: int) -> list[int]:
    """The thread counts a peer runs at: 1, 2, 4, ... up to the engine's count, that count, and the peer's default.

    >>> peer_thread_counts(2, 2), peer_thread_counts(2, 1), peer_thread_counts(16, 4), peer_thread_counts(6, 8)
    ([1, 2], [1, 2], [1, 2, 4, 8, 16], [1, 2, 4, 6, 8])
    """
    return sorted({2**i for i in range(engine.bit_length()) if 2**i <= engine} | {engine, default})


def peer_name(peer: str, fmt: str, threads: int) -> str:
    """A peer's row: "ctranslate2 int8, 2 threads", "llama.cpp q8_0, 1 thread"."""
    return f"{peer} {PEERS[peer][fmt]}, {threads} thread{'s' * (threads != 1)}"


CT2_NOT_INSTALLED = "CTranslate2 is not installed (pip install ctranslate2): its rows are skipped"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The benchmark's sizes (`QUICK`: the tests')."""

    model: str = "gpt2"  # a configuration of `common.CONFIGS`: random weights
    prompt_len: int = 128
    new_tokens: int = 128
    batch: int = 16
    batch_new_tokens: int = 32
    repeats: int = 3
    layer_repeats: int = 7  # passes over the linear layers, per format and batch size (interleaved)


SETTLE_S = 0.2  # the pause before each timed call
QUICK = Sizes(model="tiny", prompt_len=16, new_tokens=8, batch=2, batch_new_tokens=4, repeats=1, layer_repeats=1)


# ------------------------------------------------------------------------------------------------ metrics


def decode_bound(
    config: GPT2Config, context: int, fmt: str, batch: int, machine_figures: tuple[float, float]
) -> Prediction:
    """The roofline of a decode step of `batch` rows after `context` cached positions with the blocks' linear
    layers and the tied token table in `fmt` (activations and the KV cache in float32), on a machine (float32
    matmul FLOP/s, bandwidth): the engine's `predict` with weights=`fmt`. A quantized format's products run at no
    FLOP/s limit here (bandwidth alone): integer products run at other rates than the float32 one measured."""
    peak, bandwidth = machine_figures
    return engine_roofline.predict(
        ModelShape.of(config),
        (peak if fmt == "float32" else math.inf, bandwidth),
        batch=batch,
        context=context,
        weights=fmt,
        dtype="float32",
        last_only=True,
    )


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many tokens agree with `reference` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def ratios(rows: dict, batch: int) -> dict:
    """At each batch size measured, the engine in float32 and int8 against each peer in the same format, at the
    peer's default threads and at its best thread count there (the fastest of its rows at that batch size), and
    OWN_TARGET: faster / slower, the target, whether it is met, and the peer's row. Batch 1: tokens/s of the whole
    call (prompt included); batch `batch`: of the decode steps."""
    out = {}
    for key, label in (("batch_1", "1"), (f"batch_{batch}", str(batch))):
        for fmt in ("float32", "int8"):
            engine = rows.get(f"engine {fmt}", {}).get(key)
            for peer, formats in PEERS.items():
                theirs = {n: v for n, v in rows.items() if n.startswith(f"{peer} {formats[fmt]}, ") and key in v}
                if engine is None or not theirs:
                    continue
                best = max(theirs, key=lambda n: theirs[n][key]["tokens_per_s"])
                default = next((n for n, v in theirs.items() if v.get("default")), None)
                for which, name in (("at its default", default), ("at its best", best)):
                    if name is not None:
                        value = engine["tokens_per_s"] / theirs[name][key]["tokens_per_s"]
                        out[f"engine {fmt} / {peer} {formats[fmt]} {which}, batch {label}"] = {
                            "ratio": value, "target": 1.0, "met": value >= 1.0, "against": name,
                        }  # fmt: skip
        fast, slow, target = OWN_TARGET
        if key in rows.get(fast, {}) and key in rows.get(slow, {}):
            value = rows[fast][key]["tokens_per_s"] / rows[slow][key]["tokens_per_s"]
            out[f"{fast} / {slow}, batch {label}"] = {"ratio": value, "target": target, "met": value >= target}
    return out


# -------------------------------------------------------------------------------------------- the engines


class Row:
    """One engine in one format: `decode(prompts, n)` -> (new tokens per prompt, seconds of the whole call,
    seconds from the first token to the last). `threads`: the peer's (None: the engine's choice); `default`: the
    peer's own default; `batch_1_only`: llama-cpp-python decodes one sequence at a time."""

    def __init__(
        self,
        name: str,
        engine: str,
        fmt: str,
        decode: Callable[[list[list[int]], int], tuple],
        threads: Optional[int] = None,
        default: bool = False,
        batch_1_only: bool = False,
    ):
        self.name, self.engine, self.format, self.decode = name, engine, fmt, decode
        self.threads, self.default, self.batch_1_only = threads, default, batch_1_only


def engine_row(model, fmt: str) -> Row:
    settings = SamplingParams()

    @torch.inference_mode()
    def decode(prompts, n):
        start = time.perf_counter()
        tokens, stamps = [], []
        for token in decode_steps(model, prompts, settings, max_new_tokens=n, eos_token_id=None, generator=None):
            tokens.append(token)
            stamps.append(time.perf_counter())
        return torch.stack(tokens, dim=1).tolist(), stamps[-1] - start, stamps[-1] - stamps[0]

    return Row(f"engine {fmt}", "engine", fmt, decode)


def transformers_row(hf) -> Row:
    # heavy and optional (the course extra): only when comparing with transformers
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        """Called once per step, after its forward pass: the time each step's logits are ready."""

        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    @torch.inference_mode()
    def decode(prompts, n):
        ids = torch.tensor(prompts, device=hf.device)
        stamp = Stamp()
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([stamp]),
        )
        end = time.perf_counter()
        return out[:, ids.shape[1] :].tolist(), end - start, stamp.stamps[-1] - stamp.stamps[0]

    return Row("transformers float32", "transformers", "float32", decode)


def ctranslate2_module():
    """The ctranslate2 package, or None where it is not installed.

    Its OpenMP threads (its own runtime, not torch's) are made to sleep between parallel regions rather than
    spin: spinning, they took the 2 cores from the next row (measured in one process: the engine's float32 decode
    went from 31 to 16 tok/s right after a CTranslate2 call, and CTranslate2's int8 from 57 to 30 tok/s after the
    engine's). The policy is read when the runtime loads (a value the user set is kept), and only there."""
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = before or "PASSIVE"
    try:
        import ctranslate2  # optional (not a dependency), and its threads' policy must be set before it loads
    except ImportError:
        return None
    finally:
        if before is None:
            del os.environ["OMP_WAIT_POLICY"]
    return ctranslate2


def ctranslate2_rows(ct2, folder: Path, out: Path, compute_types: Sequence[str], device: str, counts) -> list[Row]:
    """CTranslate2 generators converted from the saved model folder `folder` (converted once, in float32; each
    compute type quantizes the weights when the model is loaded, as converting with `quantization=` would), one
    per compute type and thread count of `counts`."""
    if not (out / "vocabulary.json").exists():
        ct2.converters.TransformersConverter(str(folder)).convert(str(out), force=True)
    vocabulary = json.loads((out / "vocabulary.json").read_text())  # token strings, in id order
    rows = []
    for compute_type in compute_types:
        for threads in counts:
            generator = ct2.Generator(
                str(out), device=device, compute_type=compute_type, intra_threads=threads, inter_threads=1
            )

            def decode(prompts, n, generator=generator):
                stamps = {}

                def on_token(step):  # called for each row's token; the last call of a step stamps it
                    stamps[step.step] = time.perf_counter()

                start = time.perf_counter()
                results = generator.generate_batch(
                    [[vocabulary[i] for i in p] for p in prompts],
                    max_length=n,
                    min_length=n,
                    end_token=[],
                    sampling_topk=1,
                    include_prompt_in_result=False,
                    callback=on_token,
                )
                end = time.perf_counter()
                return [r.sequences_ids[0] for r in results], end - start, stamps[max(stamps)] - stamps[min(stamps)]

            name, default = peer_name("ctranslate2", compute_type, threads), threads == ctranslate2_default_threads()
            rows.append(Row(name, "ctranslate2", compute_type, decode, threads, default))
    return rows


def llama_cpp_rows(modules, model, folder: Path, counts, context: int) -> list[Row]:
    """llama.cpp (llama-cpp-python) on the engine's weights written as GGUF files, f32 and q8_0, one row per thread
    count of `counts`, batch 1."""
    llama, gguf = modules
    rows = []
    for fmt, file_type in llama_cpp.GGUF_TYPES.items():
        path = llama_cpp.write_gguf(gguf, model, folder / f"model-{file_type}.gguf", file_type)
        for threads in counts:
            decode = llama_cpp.decoder(llama, path, threads, context)
            default = threads == llama_cpp.default_threads()
            rows.append(Row(peer_name("llama.cpp", fmt, threads), "llama.cpp", fmt, decode, threads, default, True))
    return rows


def saved_folder(model, folder: Path) -> Path:
    """`model` saved as transformers saves GPT-2, with the tokenizer files CTranslate2's converter reads."""
    save_model(model, folder)
    files = vocab_files()
    shutil.copy(files["encoder.json"], folder / "vocab.json")
    shutil.copy(files["vocab.bpe"], folder / "merges.txt")
    return folder


# -------------------------------------------------------------------------------------------------- timing


def measure(
    rows: list[Row],
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    progress: Callable[[str], None],
    label: str,
    threads: Callable[[Row], None],
) -> dict:
    """Each row on the same prompts, interleaved: -> per row the median seconds (whole call, decode steps) and
    the first repeat's tokens. `threads(row)` sets torch's threads before each call (making a CTranslate2
    generator sets the process's OpenMP thread count to its own). A row that decodes one sequence at a time is
    left out of batches. Before each call, a pause: the threads of the call before (CTranslate2's OpenMP, llama.cpp's
    pool) go to sleep instead of spinning beside it."""
    rows = [row for row in rows if len(prompts) == 1 or not row.batch_1_only]

    def decode(row: Row, prompts, n):
        threads(row)
        time.sleep(SETTLE_S)
        return row.decode(prompts, n)

    for row in rows:  # warm-up: the kernels, their libraries, and the shapes of this batch size
        decode(row, [p[: max(2, len(p) // 8)] for p in prompts], 2)
    calls, steps, tokens = ({row.name: [] for row in rows} for _ in range(3))
    for rep in range(repeats):
        progress(f"quantize, {label}: repeat {rep + 1} of {repeats}")
        for row in rows if rep % 2 == 0 else rows[::-1]:
            got, call, decode_s = decode(row, prompts, new_tokens)
            calls[row.name].append(call)
            steps[row.name].append(decode_s)
            tokens[row.name].append(got)
    return {
        row.name: {
            "call_s": statistics.median(calls[row.name]),
            "steps_s": statistics.median(steps[row.name]),
            "tokens": tokens[row.name][0],
        }
        for row in rows
    }


@torch.inference_mode()
def linear_times(models: dict, rows: Sequence[int], repeats: int) -> dict:
    """ms of the engine's linear layers alone for `rows` input rows, per format: all of the blocks' (each called
    as the model calls it, `layer(x, model.parts.linear)`) and the head (`model.head`: the final layer norm and the
    tied table), and the weight bytes they read per ms (GB/s). The formats and row counts are interleaved, repeat
    after repeat."""
    g = torch.Generator().manual_seed(0)
    cfg = next(iter(models.values())).config
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    inputs = {m: [torch.randn(m, n_in, generator=g) for n_in in [C, C, C, 4 * C] * L] for m in rows}
    runs = {}
    for fmt, model in models.items():
        layers = [
            layer
            for block in model.h
            for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        ]
        for m in rows:
            xs = [x.to(model.device, model.dtype) for x in inputs[m]]
            runs[fmt, m, "blocks"] = lambda model=model, layers=layers, xs=xs: [
                layer(x, model.parts.linear) for layer, x in zip(layers, xs)
            ]
            runs[fmt, m, "head"] = lambda model=model, x=xs[0]: model.head(x)
    times = {key: [] for key in runs}
    with cpu_kernels.computing():  # the engine's threads, as in a forward pass
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(repeats):
            for key, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[key].append(1e3 * (time.perf_counter() - start))
    out = {}
    for fmt in models:
        bpw = BYTES_PER_WEIGHT[fmt]
        out[fmt] = {}
        for m in rows:
            blocks_ms, head_ms = (statistics.median(times[fmt, m, part]) for part in ("blocks", "head"))
            out[fmt][m] = {
                "blocks_ms": blocks_ms,
                "head_ms": head_ms,
                "blocks_GBps": L * 12 * C * C * bpw / blocks_ms / 1e6,
                "head_GBps": V * C * bpw / head_ms / 1e6,
            }
    return out


@torch.inference_mode()
def attention_times(model, contexts: dict[int, int], repeats: int) -> dict:
    """ms of one decode step's attention, all layers, per batch size: `model.attention` (the engine's `attention`
    part) of one query per row over a cache of `contexts[batch]` positions, a cache per layer as in decoding (each
    read from memory, not from the last layer's cache), and the cache bytes read per ms (GB/s)."""
    cfg = model.config
    H, D, L = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_layer
    g = torch.Generator().manual_seed(1)
    out = {}
    for batch, context in contexts.items():
        caches = [
            torch.randn(2, batch, H, context + 16, D, generator=g).to(model.device, model.dtype) for _ in range(L)
        ]
        q = torch.randn(batch, H, 1, D, generator=g).to(model.device, model.dtype)

        def run(caches=caches, q=q, context=context):
            return [model.attention(q, kv[0, :, :, :context], kv[1, :, :, :context], None) for kv in caches]

        times = []
        with cpu_kernels.computing():  # the engine's threads, as in a forward pass
            run()
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(1e3 * (time.perf_counter() - start))
        ms = statistics.median(times)
        nbytes = 2 * L * batch * H * context * D * caches[0].element_size()
        out[batch] = {"ms": ms, "context": context, "GBps": nbytes / ms / 1e6}
    return out


# ----------------------------------------------------------------------------------------------------- run


def check_model(name: str) -> None:
    if name not in CONFIGS:
        raise ValueError(
            f"bench --quantize runs a configuration with random weights ({', '.join(CONFIGS)}), not {name!r}"
        )


def run(
    *,
    device: str = "auto",
    threads: Optional[int] = None,
    sizes: Sizes = Sizes(),
    progress: Callable[[str], None] = print,
) -> dict:
    """The whole benchmark; -> the figures (bench.json's "quantize" section). `threads`: the engine's and
    transformers' (default: the engine's choice, `llmcourse.engine.threads`); the peers run at every count of
    `peer_thread_counts`."""
    check_model(sizes.model)
    dev = resolve_device(device)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    count = engine_threads.choose()  # the engine's threads (`threads` where given)
    own = torch.get_num_threads()  # torch's own while the engine computes

    def set_threads(row: Row) -> None:  # transformers computes with torch's threads: the engine's count
        torch.set_num_threads(count if row.engine == "transformers" else own)

    try:
        started = time.perf_counter()
        progress("quantize: the models (engine float32, int8, int4; transformers; CTranslate2; llama.cpp)")
        base = GPT2(CONFIGS[sizes.model]).init_weights(0).to(dev).eval().requires_grad_(False)
        cfg = base.config
        models = {fmt: base if fmt == "float32" else quantize_model(copy.deepcopy(base), fmt) for fmt in ENGINE_FORMATS}
        rows = [engine_row(model, fmt) for fmt, model in models.items()]
        ct2, llama = ctranslate2_module(), llama_cpp.modules() if dev.type == "cpu" else None
        r: dict = {
            "model": sizes.model,
            "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd},
            "device": str(dev),
            "threads": count,
            "machine": machine(dev, resident_bytes(base)),
            "sizes": dataclasses.asdict(sizes),
            "resident_MB": {fmt: resident_bytes(m) / 1e6 for fmt, m in models.items()},
        }
        g = torch.Generator().manual_seed(0)
        prompt_len = min(sizes.prompt_len, cfg.n_positions // 2)
        one = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g).tolist()
        many = torch.randint(0, cfg.vocab_size, (sizes.batch, prompt_len), generator=g).tolist()
        with tempfile.TemporaryDirectory() as tmp:
            folder = saved_folder(base, Path(tmp) / "model")
            rows.append(transformers_row(transformers_twin(base)))
            if ct2 is None:
                r["ctranslate2_skipped"] = CT2_NOT_INSTALLED
                progress(CT2_NOT_INSTALLED)
            else:
                supported = sorted(ct2.get_supported_compute_types(dev.type))
                default = ctranslate2_default_threads()
                counts = peer_thread_counts(count, default) if dev.type == "cpu" else [default]
                r["ctranslate2"] = {
                    "version": ct2.__version__, "compute_types": supported, "default_threads": default,
                    "thread_counts": counts,
                }  # fmt: skip
                types = [t for t in CT2_TYPES if t in supported]
                rows += ctranslate2_rows(ct2, folder, Path(tmp) / "ct2", types, dev.type, counts)
            if llama is None:
                skipped = llama_cpp.NOT_INSTALLED if dev.type == "cpu" else "llama.cpp runs on the CPU here: skipped"
                r["llama_cpp_skipped"] = skipped
                progress(skipped)
            else:
                default = llama_cpp.default_threads()
                counts = peer_thread_counts(count, default)
                r["llama_cpp"] = {"version": llama[0].__version__, "default_threads": default, "thread_counts": counts}
                rows += llama_cpp_rows(llama, base, Path(tmp), counts, prompt_len + sizes.new_tokens + 8)
            measured = {
                1: measure(rows, one, sizes.new_tokens, sizes.repeats, progress, "batch 1", set_threads),
                sizes.batch: measure(
                    rows, many, sizes.batch_new_tokens, sizes.repeats, progress, f"batch {sizes.batch}", set_threads
                ),
            }

        progress("quantize: roofline (bandwidth, matmul throughput) and the linear layers alone")
        cache_MB = r["machine"]["llc_MB"] or 0
        with engine_threads.torch_computes():  # the machine's bandwidth and matmul rate on the engine's threads
            bandwidth, flops = measure_bandwidth(dev, max(1024, int(4 * cache_MB))), measure_matmul(dev, torch.float32)
        r["roofline"] = {"bandwidth_GBps": bandwidth / 1e9, "matmul_GFLOPs": flops / 1e9}
        r["linear_ms"] = linear_times(models, (1, sizes.batch), sizes.layer_repeats)
        middle = {b: prompt_len + n // 2 for b, n in ((1, sizes.new_tokens), (sizes.batch, sizes.batch_new_tokens))}
        r["attention_ms"] = attention_times(base, middle, sizes.layer_repeats)

        r["rows"] = {}
        for row in rows:
            entry = r["rows"][row.name] = {
                "engine": row.engine,
                "format": row.format,
                "bytes_per_weight": BYTES_PER_WEIGHT[row.format],
                "threads": row.threads or count,
                "default": row.default or row.threads is None,
            }
            for b, n in ((1, sizes.new_tokens), (sizes.batch, sizes.batch_new_tokens)):
                if row.name not in measured[b]:
                    continue
                m, ref = measured[b][row.name], measured[b][REFERENCE]
                context = prompt_len + n // 2  # the middle of the run
                p = decode_bound(cfg, context, row.format, b, (flops, bandwidth))
                bound = p.tokens_per_s
                decode = b * (n - 1) / m["steps_s"]
                entry[f"batch_{b}"] = {
                    "tokens_per_s": n / m["call_s"] if b == 1 else decode,  # batch 1: the whole call, as the issue's
                    "decode_tokens_per_s": decode,
                    "call_s": m["call_s"],
                    "step_MB": p.bytes / 1e6,
                    "bound_tokens_per_s": bound,
                    "bound_is": bound_of(p),
                    "fraction": decode / bound,
                    "agreement": statistics.mean(first_divergence(t, u) for t, u in zip(m["tokens"], ref["tokens"])),
                    "agreement_of": n,
                }
        r["ratios"] = ratios(r["rows"], sizes.batch)
        r["seconds"] = time.perf_counter() - started
        return r
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ reporting


def table(r: dict) -> str:
    b = r["sizes"]["batch"]
    rf = r["roofline"]
    lines = [
        f"quantization: {r['model']} configuration (random weights), {r['device']}, {r['threads']} threads, "
        f"median of {r['sizes']['repeats']} ({r['seconds']:.0f} s)",
        "machine: " + describe_machine(r["machine"]),
        f"  bandwidth {rf['bandwidth_GBps']:.1f} GB/s, matmul {rf['matmul_GFLOPs']:.0f} GFLOP/s; engine weights "
        "in memory: " + ", ".join(f"{fmt} {mb:.1f} MB" for fmt, mb in r["resident_MB"].items()),
    ]
    if "ctranslate2_skipped" in r:
        lines.append(f"  {r['ctranslate2_skipped']}")
    else:
        ct = r["ctranslate2"]
        lines.append(
            f"  CTranslate2 {ct['version']}, compute types here: {', '.join(ct['compute_types'])}; its own default: "
            f"{ct['default_threads']} threads"
        )
    if "llama_cpp_skipped" in r:
        lines.append(f"  {r['llama_cpp_skipped']}")
    else:
        lc = r["llama_cpp"]
        lines.append(
            f"  llama-cpp-python {lc['version']} (batch 1 only); its own default: {lc['default_threads']} "
            f"thread{'s' * (lc['default_threads'] != 1)}"
        )
    lines.append(
        f"  batch 1: {r['sizes']['prompt_len']}-token prompt + {r['sizes']['new_tokens']} new tokens "
        f"(tok/s of the whole call; decode: the steps alone); batch {b}: {r['sizes']['batch_new_tokens']} "
        f"new tokens per row (decode steps)"
    )
    lines.append(
        f"    {'':<40}{'B/weight':>9}{'tok/s':>8}{'decode':>8}{'roofline':>9}{'':>5}{'same':>9}"
        f"{'tok/s':>9}{'roofline':>9}{'':>5}{'same':>8}"
    )
    lines.append(f"    {'':<40}{'':>9}{'--- batch 1':>39}{'':>8}{f'--- batch {b}':>31}")
    for name, v in r["rows"].items():
        one, many = v["batch_1"], v.get(f"batch_{b}")
        lines.append(
            f"    {name + ' (default)' * (v['engine'] in PEERS and v['default']):<40}{v['bytes_per_weight']:>9.4g}"
            f"{one['tokens_per_s']:>8.1f}{one['decode_tokens_per_s']:>8.1f}{one['bound_tokens_per_s']:>9.1f}"
            f"{one['fraction']:>5.0%}{one['agreement']:>5.0f}/{one['agreement_of']:<3}"
            + (
                f"{many['tokens_per_s']:>9.1f}{many['bound_tokens_per_s']:>9.1f}{many['fraction']:>5.0%}"
                f"{many['agreement']:>5.1f}/{many['agreement_of']}"
                if many
                else f"{'-':>9}"
            )
        )
    lines.append(
        "    (same: greedy tokens equal to the engine float32's before the first difference; at batch "
        f"{b} the mean over the rows)"
    )
    lines.append("  ratios (target):")
    for name, v in r["ratios"].items():
        shown = name.replace(", batch", f" ({v['against'].split(', ')[-1]}), batch") if "against" in v else name
        lines.append(f"    {shown:<72} {v['ratio']:5.2f}x (≥ {v['target']:g}: {'met' if v['met'] else 'MISSED'})")
    lines.append("  the engine's linear layers alone (ms per decode step; GB/s of weights read):")
    for fmt, by_rows in r["linear_ms"].items():
        lines.append(
            f"    {fmt:<8}"
            + ";  ".join(
                f"{m} row{'s' if int(m) > 1 else ''}: blocks {v['blocks_ms']:5.1f} ms ({v['blocks_GBps']:4.1f} GB/s), "
                f"head {v['head_ms']:5.1f} ms ({v['head_GBps']:4.1f} GB/s)"
                for m, v in sorted(by_rows.items(), key=lambda kv: int(kv[0]))
            )
        )
    lines.append("  a decode step of the engine, in ms: the linear layers, the head, attention, and the rest")
    for fmt, by_rows in r["linear_ms"].items():
        parts = []
        for m, v in sorted(by_rows.items(), key=lambda kv: int(kv[0])):
            step = 1e3 * int(m) / r["rows"][f"engine {fmt}"][f"batch_{m}"]["decode_tokens_per_s"]
            attention = r["attention_ms"][m]["ms"]
            rest = step - v["blocks_ms"] - v["head_ms"] - attention
            parts.append(
                f"batch {m}: {step:5.1f} = {v['blocks_ms']:.1f} + {v['head_ms']:.1f} + {attention:.1f} + {rest:.1f}"
            )
        lines.append(f"    {fmt:<8}" + ";  ".join(parts))
    lines.append(
        "    (attention: "
        + ", ".join(
            f"batch {m} over {v['context']} positions {v['GBps']:.1f} GB/s of cache"
            for m, v in sorted(r["attention_ms"].items(), key=lambda kv: int(kv[0]))
        )
        + ")"
    )
    return "\n".join(lines)


COLORS = {"engine": "C0", "transformers": "C1", "ctranslate2": "C3", "llama.cpp": "C2"}


def plot(r: dict, out: Path) -> Path:
    """Tokens/s per engine and format, batch 1 above batch 16 (readable at phone width): a bar per row, its
    roofline drawn as the light bar behind it."""
    import matplotlib  # heavy and optional (the course extra): only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above
    from matplotlib.patches import Patch

    b = r["sizes"]["batch"]

    def short(name: str) -> str:
        for long, brief in (("ctranslate2", "CT2"), ("transformers", "HF"), ("float32", "fp32"), (" threads", "t")):
            name = name.replace(long, brief)
        return name.replace(" thread", "t")

    panels = [("batch_1", "batch 1 (prompt included)"), (f"batch_{b}", f"batch {b} (decode steps)")]
    shown = {key: [n for n in list(r["rows"])[::-1] if key in r["rows"][n]] for key, _ in panels}  # first on top
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(
            2, 1, figsize=(5.6, 2.2 + 0.55 * sum(map(len, shown.values()))),
            gridspec_kw={"height_ratios": [len(v) for v in shown.values()]},
        )  # fmt: skip
        for ax, (key, title) in zip(axes, panels):
            names = shown[key]
            labels = [short(n) for n in names]
            rows = [r["rows"][n][key] for n in names]
            colors = [COLORS[r["rows"][n]["engine"]] for n in names]
            bounds = [v["bound_tokens_per_s"] for v in rows]
            speeds = [v["tokens_per_s"] for v in rows]
            ax.barh(labels, bounds, color="none", edgecolor=ROOF, hatch="///", lw=1)
            ax.barh(labels, speeds, color=colors, height=0.6)
            for i, v in enumerate(speeds):
                ax.text(v, i, f" {v:.0f}", va="center", fontsize=13)
            ax.set_xlim(0, 1.12 * max(bounds + speeds))
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
            ax.set_title(title, fontsize=14)
        axes[1].set_xlabel("tokens/s")
        fig.legend(
            handles=[Patch(facecolor="none", edgecolor=ROOF, hatch="///", label="roofline")],
            loc="upper center",
            bbox_to_anchor=(0.5, 1.0),
            frameon=False,
            fontsize=13,
        )
        fig.suptitle(" ", fontsize=8)  # room for the legend
        return save(fig, out / FIGURE)


def main(
    out: Path,
    *,
    device: str = "auto",
    dtype: str = "float32",
    repeats: int = 3,
    model: str = "gpt2",
    sizes: Optional[Sizes] = None,
) -> int:
    """`bench --quantize`: measure, then write the "quantize" section of out/bench.json (keeping its other
    sections), print the table and draw the figure."""
    sizes = sizes or Sizes(model=model, repeats=repeats)
    try:
        if dtype != "float32":
            raise ValueError(
                f"bench --quantize runs float32 activations (as CTranslate2's int8 does on a CPU); "
                f"--dtype {dtype} is not supported"
            )
        check_model(sizes.model)
        out.mkdir(parents=True, exist_ok=True)
        results = run(device=device, sizes=sizes)
    except ValueError as err:
        print(f"python -m llmcourse bench: error: {err}", file=sys.stderr)
        return 2

    def report() -> Path:
        print(table(results))
        return plot(results, out)

    return save_section(out, "quantize", results, report)
