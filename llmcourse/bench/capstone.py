"""Chapter 12's measurement: your engine beside the course engine and transformers, same weights, one run, and the
roofline's prediction (chapter 10) beside every figure.

    >>> results = measure(my_engine("chapters"))                          # doctest: +SKIP
    >>> print(table(results)); print("\\n".join(advice(results)))        # doctest: +SKIP

Three systems run the same weights (`model`, a bundled name), on the device and in the dtype of your engine's model:
**yours** (the engine given: `my_engine()`'s, or any model), **course** (`load_model(model)`: the engine's own
functions) and **transformers** (GPT2LMHeadModel / the Llama family's class loaded from the same weights, saved as
`save_pretrained` writes them; skipped, with a note, where transformers is not installed). What each row measures:

- **prefill tok/s**: one forward pass over a prompt of `PREFILL` tokens (Shakespeare's held-out text) into an empty
  cache, logits of the last position only, no sampling: prompt tokens / seconds.
- **decode tok/s**: greedy generation at batch 1 after a short prompt (`PROMPT` tokens): (N - 1) / (time of N new
  tokens - time of 1 new token), so the prompt's prefill and the call's fixed costs cancel; the three systems must
  produce the same N tokens (`same_tokens` says whether they did).
- **TTFT p50, ITL p50**: the engines behind the course's server (`build_app` over `LLMEngine`, uvicorn in a thread
  of this process), one streaming `POST /v1/completions` at a time with the short prompt's token ids: time to the
  first text chunk, and the gaps between chunks; this process's client and the server share the cores. transformers
  has no server here: "—".
- **memory**: bytes of the weights the model holds (`resident_bytes`: parameters and buffers, each tensor once) plus
  the KV cache for the decode's context (the tensors of a cache made for it; transformers': the past key values of
  a forward pass over that many positions).
- **roofline**: this machine's memory bandwidth (the median of sums of an array several times the last-level cache)
  and matrix-product throughput (FLOP/s of a square product in the model's dtype), measured in the same run, and the
  engine's `predict` (chapter 10: each kernel of a step on its own roofline, the larger of bytes / bandwidth and
  FLOPs / peak, the step the sum of its kernels') for the prefill (`last_only`: the head on the last position only,
  as all three compute it), a decode step (at the middle of the decode's context), the server's prompt and step;
  memory: the shape's count of weights
  (`ModelShape.resident_params`: biases, norms and GPT-2's position table left out) and of the cache.
- **fractions**: tokens/s measured / predicted; times predicted / measured; memory measured / predicted.

When no function of yours is in the engine given (`yours_functions` is empty: a learner who has not written or passed
any exercise yet, or `load_model(model)` itself), yours and the course engine run the same code: the table heads the
column "yours = course", says that the two columns' differences are run-to-run noise and how large they were, and
`advice` compares nothing.

Every figure is a median of `repeats` (3; quick: 1) repeats, the systems interleaved within each repeat (prefill of
each, then decode of each, then the server of each) so that drifts of the machine fall on all alike. A repeat's
TTFT and ITL are the medians over its requests (ITL pooled over their gaps). `spread` keeps each row's max / min
over the repeats: `advice` calls yours slower only beyond 1.1x and beyond that spread, and, for decode, names the
functions that hold the difference in a profile (interleaved repeats of one decode each, medians per function).

What the figures depend on: the machine (recorded: processor, cores, last-level cache), torch's threads (recorded;
on a CPU shared with other work every row slows, which the load average at the start shows), the dtype, and for
tiny models the Python overhead of each step far more than the arithmetic: a tiny model is far from its roofline,
and its decode tok/s measures the code around the matrix products. The per-function profile behind `advice` (the
time spent inside each of the forward pass's and sampler's functions during extra, untimed decodes) adds time of
its own to every call, to both engines alike; a learner's function runs inside the guard that checks each of its
calls (`course.guards`), and the guard's time counts as the function's: it is part of running your engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.client
import json
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Optional

import torch

from llmcourse.course.learner import CHAPTER_OF, Engine
from llmcourse.engine import roofline as engine_roofline
from llmcourse.engine.decoder import Decoder
from llmcourse.engine.generate import as_model, generate
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model, save_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.parts import Parts
from llmcourse.engine.quantize import resident_bytes
from llmcourse.engine.roofline import ModelShape
from llmcourse.engine.sampling import Sampler
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import LLMEngine

from .common import (
    bound_of,
    describe_machine,
    machine,
    measure_bandwidth,
    measure_matmul,
    run_seconds,
    sync,
    transformers_twin,
)
from .http import DONE, Stream, summary, take_event
from .speed import percent

SYSTEMS = ("yours", "course", "transformers")
ENGINES = ("yours", "course")  # the two behind the server
ROWS = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "itl_ms", "memory_MB")
SLOWER = 1.1  # a side counts as slower beyond this ratio: repeats of the same engine differ by a few percent


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workload: prefill prompt, short prompt, decode tokens, server requests per repeat and their tokens."""

    prefill: int = 128
    prompt: int = 16
    new_tokens: int = 64
    requests: int = 2
    server_tokens: int = 32
    repeats: int = 3
    bandwidth_MB: int = 1024


FULL = Sizes()
QUICK = Sizes(prefill=32, prompt=8, new_tokens=8, requests=1, server_tokens=6, repeats=1, bandwidth_MB=128)
TEXT = Path(__file__).resolve().parents[1] / "data" / "shakespeare_val.txt"


# ------------------------------------------------------------------------------------------------ the systems


def functions_of_yours(engine) -> list[str]:
    """The slots where `engine` runs a function that is not the engine's own: its model's parts, its drivers' tables
    (sampler, speculation, batching), a KVCache or left_pad of its own, its tokenizer's functions. Empty: `engine`
    runs the course engine's code, as `load_model(model)` does (a learner's function is always guarded, so even a
    copy of the engine's function counts as theirs)."""
    model, functions = as_model(engine)
    parts = getattr(model, "parts", None)
    names = list(parts.overridden()) if hasattr(parts, "overridden") else []
    for keyword, fn in functions.items():
        if hasattr(fn, "overridden"):
            names += fn.overridden()
        elif fn is not None:
            names.append(keyword)
    names += sorted(getattr(getattr(engine, "tokenizer", None), "mine", None) or ())
    return names


def transformers_of(model: Decoder):
    """transformers' model with the same weights (GPT2LMHeadModel, or the class the Llama family's config names)."""
    if isinstance(model, GPT2):
        return transformers_twin(model)
    # heavy and optional (the course extra): only when comparing with transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype).to(model.device).eval()


def prompts(tokenizer, sizes: Sizes, limit: int) -> tuple[list[int], list[int]]:
    """(the prefill's prompt, the short prompt): the held-out plays' text, from a line's start."""
    text = TEXT.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[text.index("\n") + 1 : 20_000])
    return ids[: min(sizes.prefill, limit // 2)], ids[: sizes.prompt]


def cache_bytes(obj, depth: int = 3) -> int:
    """Bytes of the tensors a KV cache holds (its attributes, lists and tuples, `depth` levels down)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth == 0:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(cache_bytes(x, depth - 1) for x in obj)
    if isinstance(obj, dict):
        return sum(cache_bytes(x, depth - 1) for x in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(cache_bytes(x, depth - 1) for x in vars(obj).values())
    return 0


class System:
    """One side: how it prefills, decodes and what it holds."""

    def __init__(self, name: str, target, model, tokenizer=None, hf=None):
        self.name, self.target, self.model, self.tokenizer, self.hf = name, target, model, tokenizer, hf
        self.kv_cache = (getattr(target, "functions", None) or {}).get("kv_cache")

    def prefill(self, ids: list[int]) -> Callable[[], object]:
        x = torch.tensor([ids], device=self.model.device)
        if self.hf is not None:
            return lambda: self.hf(x, use_cache=True, logits_to_keep=1)
        return lambda: self.model(x, cache=self.model.new_cache(1, len(ids), cache_class=self.kv_cache), last_only=True)

    def decode(self, ids: list[int], n: int) -> list[int]:
        if self.hf is not None:
            x = torch.tensor([ids], device=self.model.device)
            out = self.hf.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=0,
            )  # fmt: skip
            return out[0, len(ids) :].tolist()
        return generate(self.target, ids, max_new_tokens=n, eos_token_id=None)

    def memory(self, context: int) -> dict:
        """MB of weights held, and of a KV cache for `context` positions."""
        with torch.inference_mode():
            if self.hf is not None:
                x = torch.zeros(1, context, dtype=torch.long, device=self.model.device)
                kv = cache_bytes(self.hf(x, use_cache=True, logits_to_keep=1).past_key_values)
            else:
                kv = cache_bytes(self.model.new_cache(1, context, cache_class=self.kv_cache))
        weights = resident_bytes(self.hf if self.hf is not None else self.model)
        return {"weights_MB": weights / 1e6, "kv_MB": kv / 1e6, "memory_MB": (weights + kv) / 1e6}


# ------------------------------------------------------------------------------------------------ the server


def one_request(url: str, body: dict) -> Stream:
    """One streaming completion: when it was sent, when each text chunk arrived, the tokens (the usage chunk)."""
    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    connection.connect()  # connected before the clock starts, as a client that stays connected is
    try:
        sent = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
        times, pieces, tokens = [], [], 0
        while line := response.readline():
            chunk = take_event(line.decode().strip(), time.perf_counter(), times, pieces)
            if chunk is DONE:
                break
            tokens = ((chunk or {}).get("usage") or {}).get("completion_tokens", tokens)
        return Stream(sent, times, tokens, pieces)
    finally:
        connection.close()


def served(system: System, name: str) -> ServerThread:
    tokenizer = system.tokenizer
    return ServerThread(build_app(LLMEngine(system.target, tokenizer=tokenizer), tokenizer, name))


# ------------------------------------------------------------------------------------------------ the profile


class Profile:
    """Exclusive seconds inside each slot function (time in a slot called from another counts for the inner one)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.stack: list[float] = []  # the time spent in the callees of each open call

    def timed(self, name: str, fn: Callable) -> Callable:
        if isinstance(fn, functools.partial):  # a composite (guards.composed): time the learner's function inside
            keywords = {k: self.timed(k, v) if callable(v) and k in SLOT_NAMES else v for k, v in fn.keywords.items()}
            fn = functools.partial(fn.func, *fn.args, **keywords)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                inner = self.stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + spent - inner
                if self.stack:
                    self.stack[-1] += spent

        return call

    def table(self, table):
        return table.replace(**{n: self.timed(n, getattr(table, n)) for n in table.slot_names()})


SLOT_NAMES = set(Parts.slot_names()) | set(Sampler.slot_names())


def tied_table(model: Decoder):
    """The token table whose `logits` are the model's head when it is tied to the embedding (GPT-2's, a tied Llama's);
    None for an untied head (that goes through the `linear` part)."""
    table = getattr(model, "wte", None) or getattr(model, "embed_tokens", None)
    tied = isinstance(model, GPT2) or getattr(model.config, "tie_word_embeddings", False)
    return table if tied and hasattr(table, "logits") else None


def profile(system: System, ids: list[int], n: int) -> dict:
    """ms per decoded token inside each of the forward pass's and the sampler's functions, in a tied head's product
    ("head"), and in the rest, over one untimed greedy generation of `n` tokens after `ids` (the prefill included:
    one step among n)."""
    p = Profile()
    model, functions = as_model(system.target)
    parts, table = model.parts, tied_table(model)
    model.parts = p.table(parts)
    if table is not None:
        table.logits = p.timed("head", table.logits)  # an instance attribute over the method, deleted below
    sampler = p.table(functions.get("sampler") or Sampler())
    try:
        start = time.perf_counter()
        generate(Engine(model, None, {**functions, "sampler": sampler}), ids, max_new_tokens=n, eos_token_id=None)
        sync(model.device)
        total = time.perf_counter() - start
    finally:
        model.parts = parts
        if table is not None:
            del table.logits
    out = {name: 1e3 * s / n for name, s in p.seconds.items()}
    out["rest"] = 1e3 * (total - sum(p.seconds.values())) / n
    return out


# ------------------------------------------------------------------------------------------------ measuring


def measure(
    engine,
    *,
    model: str = "gpt2-shakespeare",
    quick: bool = False,
    with_transformers: bool = True,
    threads: Optional[int] = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """Your engine (`engine`: `my_engine()`'s, `Pieces.install(...)`'s, or a model) against the course engine and
    transformers on the weights of `model`, with this machine's roofline; -> the figures (see the module's
    docstring). quick: 1 repeat, short prompts, few tokens (the tests). threads: torch's threads for the run (None:
    as they are); recorded with the figures."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return measured(engine, model, QUICK if quick else FULL, with_transformers, progress)
    finally:
        torch.set_num_threads(before)


def measured(engine, model: str, sizes: Sizes, with_transformers: bool, progress: Callable[[str], None]) -> dict:
    quick = sizes.repeats == 1
    mine, _ = as_model(engine)
    dev, dt = mine.device, mine.dtype
    # your tokenizer (chapter 01's) is GPT-2's; a Llama-family model brings its own, as in `my_engine`
    tokenizer = getattr(engine, "tokenizer", None) if isinstance(mine, GPT2) else None
    tokenizer = tokenizer or load_tokenizer(model)
    course = load_model(model, device=dev, dtype=dt)
    yours_functions = functions_of_yours(engine)
    systems = {
        "yours": System("yours", engine, mine, tokenizer),
        "course": System("course", course, course, load_tokenizer(model)),
    }
    results: dict = {
        "model": model,
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "sizes": dataclasses.asdict(sizes),
        "machine": machine(dev, resident_bytes(course)),
        "yours_functions": yours_functions,  # empty: yours is the course engine's code
    }
    if with_transformers:
        try:
            systems["transformers"] = System("transformers", None, course, hf=transformers_of(course))
        except ImportError as err:
            results["transformers_skipped"] = f"transformers is not installed ({err})"
    else:
        results["transformers_skipped"] = "not asked for"
    long_ids, ids = prompts(systems["course"].tokenizer, sizes, course.config.n_positions)
    n, m = sizes.new_tokens, sizes.server_tokens
    results.update(prefill_tokens=len(long_ids), prompt_tokens=len(ids))
    body = {"model": model, "prompt": ids, "max_tokens": m, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    times: dict = {name: {k: [] for k in ("prefill", "decode_n", "decode_1", "ttft", "itl")} for name in systems}
    tokens: dict = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(served(systems[name], model)).url for name in ENGINES}
        progress("warm-up")
        with torch.inference_mode():
            for name, s in systems.items():
                s.prefill(long_ids)()
                tokens[name] = s.decode(ids, n)
            for name in ENGINES:
                one_request(urls[name], body)
        for r in range(sizes.repeats):
            progress(f"repeat {r + 1} of {sizes.repeats}")
            with torch.inference_mode():
                for name, s in systems.items():
                    times[name]["prefill"] += run_seconds(s.prefill(long_ids), 1, dev)
                for name, s in systems.items():
                    start = time.perf_counter()
                    got = s.decode(ids, n)
                    sync(dev)
                    times[name]["decode_n"].append(time.perf_counter() - start)
                    if got != tokens[name]:
                        raise RuntimeError(f"{name}: greedy decoding gave other tokens on a repeat")
                for name, s in systems.items():
                    times[name]["decode_1"] += run_seconds(lambda: s.decode(ids, 1), 1, dev)
            for name in ENGINES:
                streams = [one_request(urls[name], body) for _ in range(sizes.requests)]
                figures = summary([streams])
                times[name]["ttft"].append(figures["ttft_p50_ms"])
                times[name]["itl"].append(figures["itl_p50_ms"])
                times[name].setdefault("text", "".join(streams[0].output))

    results["systems"], results["spread"] = {}, {}
    for name, s in systems.items():
        t = times[name]
        per_repeat = {  # each repeat's figures; the row's figure is their median, `spread` their max / min
            "prefill_tok_s": [len(long_ids) / x for x in t["prefill"]],
            "decode_tok_s": [
                (n - 1) / (a - b) if a > b else n / a  # noise beyond the difference: count all of it
                for a, b in zip(t["decode_n"], t["decode_1"])
            ],
            "ttft_ms": t["ttft"],
            "itl_ms": t["itl"],
        }
        results["systems"][name] = {
            **{row: statistics.median(v) if v else None for row, v in per_repeat.items()},
            **s.memory(len(ids) + n),
            "tokens": tokens[name],
        }
        results["spread"][name] = {row: max(v) / min(v) for row, v in per_repeat.items() if v}
        if name in ENGINES:
            results["systems"][name]["server_text"] = t["text"]
    results["same_tokens"] = {name: tokens[name] == tokens["course"] for name in systems}

    progress("roofline: bandwidth and matmul throughput")
    cache_MB = results["machine"]["llc_MB"] or 0
    bandwidth = measure_bandwidth(dev, max(sizes.bandwidth_MB, int(4 * cache_MB)), 3 if quick else 5)
    peak = measure_matmul(dev, dt, repeats=3 if quick else 5)
    results["roofline"] = roofline(course, (peak, bandwidth), len(long_ids), len(ids), n, m)
    results["fractions"] = fractions(results)
    progress("profile")
    profiles: dict = {name: [] for name in ENGINES}
    with torch.inference_mode():
        for _ in range(sizes.repeats):  # interleaved, as the timed repeats
            for name in ENGINES:
                profiles[name].append(profile(systems[name], ids, n))
    results["profile_ms_per_token"] = {
        name: {slot: statistics.median(p.get(slot, 0.0) for p in runs) for slot in runs[0]}
        for name, runs in profiles.items()
    }
    return results


def roofline(model: Decoder, machine_figures: tuple[float, float], prefill: int, prompt: int, n: int, m: int) -> dict:
    """The roofline's prediction for each row, from this machine's (peak FLOP/s, bandwidth) and the model's shape:
    a prefill of `prefill` tokens, a decode step in the middle of `prompt` + `n` positions, the server's prefill of
    `prompt` tokens and its step in the middle of `prompt` + `m`, the weights and the decode's cache. Every time is
    the engine's `predict` (weights and activations in the model's dtype; the head on the last position only)."""
    shape, name = ModelShape.of(model.config), str(model.dtype).removeprefix("torch.")
    peak, bandwidth = machine_figures
    value = model.dtype.itemsize

    def step(new_tokens: int, context: int) -> engine_roofline.Prediction:
        return engine_roofline.predict(
            shape, machine_figures, new_tokens=new_tokens, context=context, weights=name, dtype=name, last_only=True
        )

    pre, dec = step(prefill, 0), step(1, prompt + n // 2)
    first, server_step = step(prompt, 0), step(1, prompt + m // 2)
    kv = 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * (prompt + n) * value
    weights = shape.resident_params() * value
    return {
        "decode_kernels_ms": {k.name: 1e3 * t.seconds for k, t in zip(dec.kernels, dec.times)},
        "bandwidth_GBps": bandwidth / 1e9,
        "peak_GFLOPs": peak / 1e9,
        "prefill_tok_s": pre.tokens_per_s,
        "prefill_bound": bound_of(pre),
        "decode_tok_s": dec.tokens_per_s,
        "decode_bound": bound_of(dec),
        "ttft_ms": 1e3 * first.seconds,
        "itl_ms": 1e3 * server_step.seconds,
        "weights_MB": weights / 1e6,
        "kv_MB": kv / 1e6,
        "memory_MB": (weights + kv) / 1e6,
    }


def fractions(r: dict) -> dict:
    """Each measured figure as a fraction of the roofline's: tokens/s measured / predicted, times predicted /
    measured (1 is the roofline; less is slower), memory measured / predicted."""
    roof, out = r["roofline"], {}
    for name, s in r["systems"].items():
        out[name] = {}
        for row in ROWS:
            if s.get(row) is None:
                continue
            out[name][row] = roof[row] / s[row] if row in ("ttft_ms", "itl_ms") else s[row] / roof[row]
    return out


# ------------------------------------------------------------------------------------------------ reporting

LABELS = {
    "prefill_tok_s": "prefill tok/s",
    "decode_tok_s": "decode tok/s",
    "ttft_ms": "TTFT p50 ms",
    "itl_ms": "ITL p50 ms",
    "memory_MB": "memory MB",
}
HEADS = {"yours": "yours", "course": "course engine", "transformers": "transformers", "roofline": "roofline"}
SPEEDS = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "itl_ms")


def yours_is_course(r: dict) -> bool:
    """Whether yours ran the course engine's own code (no function of yours in it); False where not recorded."""
    return r.get("yours_functions") == []


def heads(r: dict) -> dict:
    """The columns' names: yours is named the course engine's where it ran the same code."""
    return {**HEADS, "yours": "yours = course"} if yours_is_course(r) else HEADS


def same_code_note(r: dict) -> str:
    """Where yours is the course engine: the two columns time the same code, so what separates them is noise, as
    large as this run shows it (and the repeats' spread, with more than one repeat)."""
    yours, course = r["systems"]["yours"], r["systems"]["course"]
    apart = max(
        (
            max(yours[row], course[row]) / min(yours[row], course[row])
            for row in SPEEDS
            if yours.get(row) and course.get(row)
        ),
        default=1.0,
    )
    note = (
        "yours = the course engine here: no function of yours is in this engine yet, so the two columns time the "
        f"same code, and their differences (up to {apart - 1:.0%} in this run) are run-to-run noise"
    )
    spreads = [v for name in ENGINES for row, v in r.get("spread", {}).get(name, {}).items() if row in SPEEDS]
    if r["sizes"]["repeats"] > 1 and spreads:
        note += f"; the repeats of one engine spread by up to {max(spreads) - 1:.0%}"
    return note


def number(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def table(r: dict) -> str:
    """The side-by-side table: a row per figure, a column per system and the roofline's prediction; each measured
    figure with its fraction of the roofline's in brackets (tokens/s and times: 100% is the roofline; memory: what
    it holds over what the shape needs)."""
    sz, roof = r["sizes"], r["roofline"]
    rows = {
        "prefill_tok_s": f"prefill tok/s ({r['prefill_tokens']} tokens)",
        "decode_tok_s": f"decode tok/s (batch 1, {sz['new_tokens']} new)",
        "ttft_ms": f"TTFT p50 ms ({r['prompt_tokens']}-token prompt)",
        "itl_ms": "ITL p50 ms (server)",
        "memory_MB": "memory MB (weights + KV)",
    }
    bounds = {
        "prefill_tok_s": roof["prefill_bound"],
        "decode_tok_s": roof["decode_bound"],
        "memory_MB": f"{number(roof['weights_MB'])} + {number(roof['kv_MB'])}",
    }
    width = max(len(v) for v in rows.values()) + 2
    col = 20
    named = heads(r)
    lines = [
        f"capstone: {r['model']}, {r['device']}, {r['dtype']}, {r['threads']} threads, median of {sz['repeats']} "
        "interleaved repeats",
        "machine: " + describe_machine(r["machine"]),
        f"roofline: bandwidth {roof['bandwidth_GBps']:.1f} GB/s, matmul {roof['peak_GFLOPs']:.0f} GFLOP/s (measured "
        "now); (x%) = the figure's fraction of the roofline's",
        " " * width + "".join(f"{named[c]:>{col}}" for c in ("yours", "course", "transformers", "roofline")),
    ]
    for row, label in rows.items():
        cells = []
        for name in ("yours", "course", "transformers"):
            s = r["systems"].get(name)
            if s is None or s.get(row) is None:
                cells.append("—" if s is not None else "skipped")
                continue
            value = f"{number(s['weights_MB'])} + {number(s['kv_MB'])}" if row == "memory_MB" else number(s[row])
            cells.append(f"{value} ({percent(r['fractions'][name][row])})")
        extra = f" {bounds[row]}" if row in bounds and row != "memory_MB" else ""
        roof_cell = bounds["memory_MB"] if row == "memory_MB" else number(roof[row]) + extra
        lines.append(f"{label:<{width}}" + "".join(f"{c:>{col}}" for c in cells) + f"{roof_cell:>{col}}")
    same = ", ".join(f"{HEADS[n]} {'yes' if ok else 'NO'}" for n, ok in r["same_tokens"].items() if n != "course")
    lines.append(f"same greedy tokens as the course engine: {same}")
    if yours_is_course(r):
        lines.append(same_code_note(r))
    if "transformers_skipped" in r:
        lines.append(f"transformers: skipped, {r['transformers_skipped']}")
    return "\n".join(lines)


COLOURS = {"yours": "#7b3fb5", "course": "#1f77b4", "transformers": "#999999"}
PANELS = (  # (row, title): higher is better for tokens/s, lower for times
    ("prefill_tok_s", "prefill tok/s (↑ better)"),
    ("decode_tok_s", "decode tok/s (↑)"),
    ("ttft_ms", "TTFT p50 ms (↓ better)"),
    ("itl_ms", "ITL p50 ms (↓)"),
)


def figure(r: dict):
    """The table's speeds as bars, a panel per row, the roofline's prediction as a dashed line in each.

    >>> show(figure(measure(my_engine())), "capstone-measured")            # doctest: +SKIP
    """
    import plotly.graph_objects as go  # the course extra, not the engine's: only the chapter's figure needs it
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=[title for _, title in PANELS], vertical_spacing=0.16)
    for i, (row, _) in enumerate(PANELS):
        at = dict(row=i // 2 + 1, col=i % 2 + 1)
        names = [n for n in SYSTEMS if r["systems"].get(n, {}).get(row) is not None]
        fig.add_trace(
            go.Bar(
                x=[heads(r)[n] for n in names],
                y=[r["systems"][n][row] for n in names],
                marker_color=[COLOURS[n] for n in names],
                text=[f"{number(r['systems'][n][row])}<br>{percent(r['fractions'][n][row])}" for n in names],
                textposition="inside",
                textangle=0,
                hovertemplate="%{x}: %{y:.3g}<extra>" + LABELS[row] + "</extra>",
                showlegend=False,
            ),
            **at,
        )
        fig.add_hline(
            y=r["roofline"][row],
            line_dash="dash",
            line_color="#d62728",
            annotation_text=f"roofline {number(r['roofline'][row])}",
            annotation_position="top left",
            **at,
        )
        fig.update_yaxes(rangemode="tozero", range=[0, 1.15 * max(r["roofline"][row], *fig.data[-1].y)], **at)
    fig.update_layout(height=560, margin=dict(l=40, r=10, t=50, b=30), uniformtext_minsize=9)
    return fig


def advice(r: dict) -> list[str]:
    """What would make your engine as fast as the course engine, from this run's figures: each row where yours is
    slower, by how much, and — from the profile of one decode — which of your functions hold the difference and
    their chapter; where yours is as fast, how far both are from the roofline."""
    yours, course, roof = r["systems"]["yours"], r["systems"]["course"], r["roofline"]
    if yours_is_course(r):
        fraction = r["fractions"]["course"]["decode_tok_s"]
        return [
            "yours is the course engine here (no function of yours is in it yet): there is nothing of yours to compare "
            f"or to make faster; it decodes at {percent(fraction)} of the roofline's {number(roof['decode_tok_s'])} "
            "tok/s. Write your chapters' functions (each one's check must pass), save them, and measure again."
        ]
    out = []
    slower = {}
    noise = {}  # a ratio counts beyond SLOWER and beyond the spread of either engine's repeats of that row
    for row, higher_is_better in (("prefill_tok_s", True), ("decode_tok_s", True), ("ttft_ms", False),
                                  ("itl_ms", False)):  # fmt: skip
        ratio = course[row] / yours[row] if higher_is_better else yours[row] / course[row]
        noise[row] = max(SLOWER, *(r.get("spread", {}).get(n, {}).get(row, 1.0) for n in ENGINES))
        if ratio > noise[row]:
            slower[row] = ratio
    if "decode_tok_s" in slower:
        gap = 1e3 / yours["decode_tok_s"] - 1e3 / course["decode_tok_s"]
        out.append(
            f"decode: yours {number(yours['decode_tok_s'])} tok/s, the course engine {number(course['decode_tok_s'])}: "
            f"{slower['decode_tok_s']:.1f}x slower ({gap:.2f} ms more per token; the roofline allows "
            f"{number(roof['decode_tok_s'])} tok/s)"
        )
        out += culprits(r["profile_ms_per_token"])
    if "prefill_tok_s" in slower:
        out.append(
            f"prefill: yours {number(yours['prefill_tok_s'])} tok/s, the course engine "
            f"{number(course['prefill_tok_s'])}: {slower['prefill_tok_s']:.1f}x slower on {r['prefill_tokens']} "
            "tokens; the same functions run there on all the prompt's rows at once"
        )
    decode_ratio = course["decode_tok_s"] / yours["decode_tok_s"]
    for row, what in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        if row in slower:
            out.append(
                f"server: your {what} {number(yours[row])} ms, the course engine's {number(course[row])} ms "
                f"({slower[row]:.1f}x; generate's decode {decode_ratio:.1f}x): behind the server `LLMEngine` runs the "
                "steps, its decode tokens attending with chapter 07's paged_attention, not the forward pass's attention"
            )
    memory = yours["memory_MB"] / course["memory_MB"]
    if memory > SLOWER:
        out.append(
            f"memory: yours holds {number(yours['weights_MB'])} MB of weights + {number(yours['kv_MB'])} MB of KV "
            f"cache, the course engine {number(course['weights_MB'])} + {number(course['kv_MB'])} ({memory:.1f}x)"
        )
    if not slower:
        fraction = r["fractions"]["course"]["decode_tok_s"]
        line = (
            f"no row of yours is slower than the course engine's beyond 1.1x and the repeats' spread (up to "
            f"{max(noise.values()):.2f}x in this run): decode {yours['decode_tok_s'] / course['decode_tok_s']:.2f}x, "
            f"prefill {yours['prefill_tok_s'] / course['prefill_tok_s']:.2f}x of its speed; both decode at "
            f"{percent(fraction)} of the roofline's {number(roof['decode_tok_s'])} tok/s"
        )
        rest = r["profile_ms_per_token"]["course"]
        inside = sum(v for k, v in rest.items() if k != "rest")
        line += (
            f"; profiled (the profile's own timing adds to every call), the course engine's "
            f"{inside + rest['rest']:.2f} ms per token spend {inside:.2f} ms inside the forward pass's and the "
            f"sampler's functions and {rest['rest']:.2f} ms in the code around them"
        )
        out.append(line)
    if "transformers" in r["systems"]:
        t = r["systems"]["transformers"]
        out.append(
            f"against transformers: yours decodes at {yours['decode_tok_s'] / t['decode_tok_s']:.2f}x its speed, "
            f"prefills at {yours['prefill_tok_s'] / t['prefill_tok_s']:.2f}x"
        )
    return out


def culprits(profiles: dict) -> list[str]:
    """From the profile of a decode (ms per token inside each function, and the rest): the functions of yours that
    take at least 1.5x the course engine's time and hold at least a tenth of the profiled difference, largest
    first, each with its chapter."""
    yours, course = profiles["yours"], profiles["course"]
    total_yours, total_course = sum(yours.values()), sum(course.values())
    gap = total_yours - total_course
    said = f"profiled: yours {total_yours:.2f} ms per token, the course engine {total_course:.2f} ms"
    lines = []
    for name, more in sorted(((n, ms - course.get(n, 0.0)) for n, ms in yours.items()), key=lambda kv: -kv[1]):
        base = course.get(name, 0.0)
        if name not in SLOT_NAMES and name != "rest":  # the tied head's product: the same code in both engines
            continue
        if gap <= 0 or more < 0.1 * gap or (base > 0 and yours[name] / base < 1.5):
            continue
        times = f", {yours[name] / base:.1f}x" if base > 0 else ""
        share = f"{more:.2f} ms ({more / gap:.0%}) of the difference"
        if name == "rest":
            lines.append(
                f"  the code around the functions (your KVCache, the loop) takes {yours[name]:.2f} ms per token, the "
                f"course engine's {base:.2f} ms{times}: {share}"
            )
        else:
            lines.append(
                f"  your {name} ({CHAPTER_OF.get(name, '?')}) takes {yours[name]:.2f} ms per token, the course "
                f"engine's {base:.2f} ms{times}: {share} (the engine's check on each call of yours included); the "
                f"engine's is llmcourse.engine.parts.{name}"
            )
    if not lines:
        return [f"  no one function of yours holds the difference ({said})"]
    return lines + [f"  ({said})"]


# ------------------------------------------------------------------------------------------------ where it goes

PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")  # the roofline's weight products of the layers
ATTENTION_SLOTS = ("attention", "grouped_attention")


def breakdown(r: dict, name: str = "course") -> dict:
    """Where a decode step of `name`'s engine goes, from this run's profile (ms per token, profiled) beside the
    roofline's time of the same kernels (ms): the layers' weight products (the `linear` part), the tied head's
    product, attention, the other functions (norms, activation, embedding, sampling, head splits) and the code around
    them (the loop, the cache, Python); and the GB/s the weight products read at, against the bandwidth measured.

    -> {"rows": [(what, measured ms, roofline ms or None)], "step_ms", "bandwidth_GBps", "products_share",
        "around_share"}
    """
    prof, roof = r["profile_ms_per_token"][name], r["roofline"]
    kernels = roof["decode_kernels_ms"]
    layers = prof.get("linear", 0.0)
    head = prof.get("head")  # None: an untied head, inside `linear`
    attention = sum(prof.get(n, 0.0) for n in ATTENTION_SLOTS)
    around = prof.get("rest", 0.0)
    others = sum(v for n, v in prof.items() if n not in ("linear", "head", "rest", *ATTENTION_SLOTS))
    if head is None:
        rows = [("weight products (layers and head)", layers, sum(kernels.get(k, 0.0) for k in (*PRODUCTS, "head")))]
    else:
        rows = [
            ("weight products of the layers", layers, sum(kernels.get(k, 0.0) for k in PRODUCTS)),
            ("the head's product (tied)", head, kernels.get("head", 0.0)),
        ]
    rows += [
        ("attention", attention, kernels.get("attention", 0.0)),
        ("norms, activation, other functions", others, kernels.get("elementwise", 0.0)),
        ("the code around them (loop, cache)", around, None),
    ]
    step = sum(ms for _, ms, _ in rows)
    products = layers + (head or 0.0)
    return {
        "rows": rows,
        "step_ms": step,
        "bandwidth_GBps": roof["bandwidth_GBps"],
        "products_share": products / step if step > 0 else 0.0,
        "around_share": around / step if step > 0 else 0.0,
    }


def breakdown_table(r: dict, name: str = "course") -> str:
    """`breakdown` as the chapter prints it: a row per part of the step, and what the figures say."""
    b = breakdown(r, name)
    who = "the course engine" if name == "course" else "your engine"
    lines = [f"one decode step of {who}, profiled (ms per token; the profile's timing adds to every call):",
             f"{'':38s}{'measured':>10s}{'roofline':>10s}{'share':>8s}"]  # fmt: skip
    for what, ms, roof in b["rows"]:
        shown = f"{roof:10.3f}" if roof is not None else f"{'—':>10s}"
        lines.append(f"{what:38s}{ms:10.3f}{shown}{ms / b['step_ms']:8.0%}")
    lines.append(f"{'step':38s}{b['step_ms']:10.3f}{sum(x or 0.0 for _, _, x in b['rows']):10.3f}")
    lines.append("")
    bw = b["bandwidth_GBps"]
    reads = [  # each product row's GB/s: its roofline time is its bytes over the bandwidth (memory-bound at batch 1)
        f"{READS[what]} at {bw * roof / ms:.1f} GB/s ({roof / ms:.0%})" for what, ms, roof in b["rows"][:-3] if ms > 0
    ]
    lines.append(
        f"The weight products take {b['products_share']:.0%} of the step. They read their weights: "
        + ", ".join(reads)
        + f", of the {bw:.1f} GB/s a plain sum read in this run. The code around the functions takes "
        f"{b['around_share']:.0%} of the step."
    )
    return "\n".join(lines)


READS = {
    "weight products of the layers": "the layers'",
    "the head's product (tied)": "the head's",
    "weight products (layers and head)": "the layers' and the head's",
}


CHALLENGE = 0.4  # the open task: your engine's batch-1 decode at 40% of the roofline's tokens per second or more


def challenge(r: dict, target: float = CHALLENGE) -> str:
    """The capstone's open task, reported from this run's table: does your engine decode at `target` of the
    roofline's tok/s or more (the model's dtype unchanged)? Said with the course engine's share on the same run,
    so a machine where even it falls short shows that, rather than a verdict on your code."""
    yours, course = r["fractions"]["yours"]["decode_tok_s"], r["fractions"]["course"]["decode_tok_s"]
    roof = r["roofline"]["decode_tok_s"]
    said = (
        f"the task: decode at {target:.0%} of the roofline's {number(roof)} tok/s or more. Yours: {yours:.0%} "
        f"({number(r['systems']['yours']['decode_tok_s'])} tok/s); the course engine on this run: {course:.0%}."
    )
    if yours_is_course(r):
        return said + " No function of yours is in your engine yet: these are the course engine's figures."
    if yours >= target:
        return said + " Reached."
    if course < target:
        return said + (
            " Not reached, and the course engine does not reach it on this machine either (a busy machine lowers "
            "both; the load average is in the table): compare your share with the course engine's."
        )
    return said + " Not yet: the advice above names the functions of yours that hold the difference."


def main() -> None:  # pragma: no cover  (a run by hand: python -m llmcourse.bench.capstone [MODEL] [--quick])
    model = next((a for a in sys.argv[1:] if not a.startswith("-")), "gpt2-shakespeare")
    results = measure(load_model(model), model=model, quick="--quick" in sys.argv, progress=print)
    print(table(results))
    print("\n".join(advice(results)))


if __name__ == "__main__":
    main()
