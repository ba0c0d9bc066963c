"""Checks for chapter 06, the KV cache: the preallocated cache, attention of one new token over it,
the prefill + decode loop, the bytes and FLOPs of a decode step, and how many sequences' caches fit.

Each check compares the learner's code with the engine's (`llmcourse.engine.model.KVCache`, a full
recompute of the model for every token, `llmcourse.engine.roofline`'s formulas) on fixed edge cases and
seeded random ones:
batch > 1, float64, float16 and bfloat16, several layers, writes of several positions, keys and values
as the model passes them (views split from the qkv projection: not contiguous), 1024 positions, a
cache rolled back as speculative decoding does, two caches alive at once, a cache whose unused
positions hold stale values. A cache is also checked for *how* it works: its tensors are allocated
once and written in place (their `data_ptr()` never changes, and `update` returns views of them), made on
the device and in the dtype asked for (a cache made on `device="meta"`, which stands for a GPU on any
machine), and the engine's generation then runs it as `my_engine` installs it. The loop must make one
cache for the whole generation, on the model's device and in its dtype, prefill the prompt once and feed
one token per step: n new tokens take exactly n forward passes, the prefill and n - 1 decode steps, and the
model may compute no more positions than that (a loop that feeds its last token back, or also recomputes
the whole sequence, fails). Half-precision attention is checked with scores of about 1e4, exact in its dtype.
The formulas are exact: answers within a relative 1e-9 (float rounding) pass, in any Python number type, and a
wrong one is matched against the common mistakes to name it. Expected answers are computed after the learner's call.

    >>> def decode_step(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2):
    ...     return 2 * n_params * batch, n_params * bytes_per_weight + batch * context * kv_bytes_per_token
    >>> check_decode_step(decode_step)
    ✓ decode_step — 19 cases
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import random
import traceback
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guard
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.generate import generate
from llmcourse.engine.llama import LlamaConfig
from llmcourse.engine.model import GPT2
from llmcourse.engine.model import KVCache as EngineKVCache
from llmcourse.engine.roofline import decode_step as engine_decode_step
from llmcourse.engine.roofline import max_sequences as engine_max_sequences
from llmcourse.engine.roofline import model_decode_step
from llmcourse.engine.slots import PartError, raised
from llmcourse.engine.tokenizer import get_tokenizer

from .attention import large_exact_scores, overflowing
from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, later, one_hint, run_check
from .harness.forbid import Forbidden
from .harness.show import short
from .harness.tensors import in_float64, tensor_judge, tensor_problem

# ----------------------------------------------------------------------------------------------
# Black boxes

ENGINE_CACHE = Forbidden(
    "llmcourse.engine.model.KVCache",
    "The engine's KVCache is what yours is compared with: write your own (torch.zeros and slicing are all it needs).",
)
NO_ATTENTION = [
    Forbidden(
        "torch.nn.functional.scaled_dot_product_attention",
        "F.scaled_dot_product_attention is the black box this exercise opens: scores, softmax, weighted sum.",
    ),
    Forbidden("torch.nn.functional.multi_head_attention_forward", "Write the attention yourself."),
    Forbidden(
        "llmcourse.engine.parts.attention", "The engine's attention is the black box here: write it with @ and softmax."
    ),
    Forbidden(
        "llmcourse.engine.tiled_attention", "The engine's attention is the black box here: write it with @ and softmax."
    ),
]
NO_ENGINE_LOOP = [
    Forbidden(
        "llmcourse.engine.generate",
        "The engine's generation loop is what yours is compared with: write the loop with model(ids, cache=cache).",
    ),
    Forbidden("transformers", "transformers' generate is what yours is compared with: write the loop yourself."),
]


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread: tiny models gain nothing from more, and on a busy machine two threads that
    wait for each other make a 1 ms forward pass take 50 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _desc(t: Tensor) -> str:
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32) -> Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------------
# Exercise 1: KVCache
#
# A case runs the engine's protocol on one or two caches: each step calls update(layer, k, v) for every layer
# with k and v as the model passes them (views of the attention's qkv projection, split into heads: not
# contiguous), then advances cache.length by T; a step may also set cache.length back (speculative decoding
# rolls a cache back past rejected tokens). The check ends with the engine's generation running the learner's
# class exactly as `my_engine` installs it (`guard("KVCache", cls)`, passed to `generate` as `kv_cache`).


@dataclasses.dataclass
class Write:
    """What one `update(layer, k, v)` did."""

    cache: int  # which cache (0; 1 in the case with two caches alive)
    step: int
    layer: int
    start: int  # cache.length when it was called
    T: int
    keys: Any = None  # what it returned (copies)
    values: Any = None
    returned: str = ""  # what it returned, when that is not a tuple of two tensors
    raised: str = ""  # the error it raised, and where
    length_after: int = 0
    views: bool = True  # the returned tensors share the cache's storage
    moved: str = ""  # which cache tensor was replaced by another one, if any


@dataclasses.dataclass
class Trace:
    """Everything a run of one or two caches did, to compare with the engine's run on the same input."""

    problem: str = ""  # what is wrong with a cache as built (attributes, shapes, shared tensors)
    writes: list = dataclasses.field(default_factory=list)
    contents: list = dataclasses.field(default_factory=list)  # the k and v tensors of every layer, every cache
    refused: Optional[str] = None  # the error of a write past max_len (None: not refused)

    def __repr__(self) -> str:
        if self.problem:
            return self.problem
        shapes = ", ".join(
            f"{list(w.keys.shape)}" for w in self.writes if isinstance(w.keys, Tensor) and w.layer == 0 and w.cache == 0
        )
        refused = "; refused a write past max_len" if self.refused else ""
        return f"update returned keys of shape {shapes} (layer 0){refused}"


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: Tensor) -> tuple[int, int]:
    """The memory a tensor's elements occupy: [first byte, last byte + 1)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _structure_problem(cache, config: GPT2Config, batch_size: int, max_len: int, dtype: torch.dtype) -> str:
    """What is wrong with a new cache's attributes, or ''. What `GuardedCache` (the engine's guard) needs, and more."""
    for name in ("k", "v", "length", "max_len", "update"):
        if not hasattr(cache, name):
            return f"the new cache has no attribute `{name}`"
    shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
    for name in ("k", "v"):
        tensors = getattr(cache, name)
        if isinstance(tensors, tuple) and len(tensors) == config.n_layer:
            return (
                f"cache.{name} is a tuple: make it a list of {config.n_layer} tensors (one per layer), "
                f"[torch.zeros(...) for _ in range(n_layer)] — the engine takes a list (beam search replaces it "
                f"with a new list of reordered rows)"
            )
        if not isinstance(tensors, list) or len(tensors) != config.n_layer:
            return (
                f"cache.{name} should be a list of {config.n_layer} tensors (one per layer), got {short(tensors, 80)}"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor) or type(t) is not Tensor:
                return f"cache.{name}[{i}] should be a plain torch.Tensor, got {short(t, 80)}"
            if tuple(t.shape) != shape:
                grow = (
                    " — preallocate all max_len positions once, in __init__ (a cache grown with torch.cat "
                    "copies everything it holds at every step)"
                    if t.dim() == 4 and t.shape[2] != max_len
                    else " — store config.n_kv_head heads of keys and values, not n_head: with grouped-query "
                    "attention (chapter 11) several query heads share one"
                    if t.dim() == 4 and t.shape[1] == config.n_head != config.n_kv_head
                    else ""
                )
                return (
                    f"cache.{name}[{i}] has shape {tuple(t.shape)}, "
                    f"expected [B, n_kv_head, max_len, head_dim] = {shape}{grow}"
                )
            if t.dtype != dtype:
                return f"cache.{name}[{i}] has dtype {t.dtype}, expected {dtype}: use the dtype argument"
            if bool(t.any()):
                return f"cache.{name}[{i}] should start as zeros (torch.zeros)"
    tensors = [*cache.k, *cache.v]
    names = [f"k[{i}]" for i in range(config.n_layer)] + [f"v[{i}]" for i in range(config.n_layer)]
    spans = [_span(t) for t in tensors]
    overlapping = [
        (names[i], names[j])
        for j in range(len(spans))
        for i in range(j)
        if spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]
    ]
    if overlapping:
        first, second = overlapping[0]
        return (
            f"cache.{first} and cache.{second} are the same tensor (or share memory): every layer needs its "
            f"own keys and its own values, or one overwrites the other (a list made with "
            f"[torch.zeros(...)] * n_layer repeats one tensor; make a new one for each)"
        )
    if cache.length != 0:
        return f"a new cache should have length 0 (no positions filled yet), got {short(cache.length, 40)}"
    if cache.max_len != max_len:
        return f"cache.max_len should be {max_len} (the max_len argument), got {short(cache.max_len, 40)}"
    return ""


def _new_caches(cls, specs: list, defaults: bool) -> tuple[list, str]:
    """cls(config, batch_size, max_len, device='cpu', dtype=dtype) for every spec (without device and dtype if
    `defaults`), each checked when made and all of them again after the last one is made. -> (caches, problem)."""
    caches = []
    for i, (config, batch_size, max_len, dtype) in enumerate(specs):
        cache = (
            cls(config, batch_size, max_len)
            if defaults
            else cls(config, batch_size, max_len, device="cpu", dtype=dtype)
        )
        problem = _structure_problem(cache, config, batch_size, max_len, dtype)
        if problem and defaults and "dtype" in problem:
            problem += (
                " — KVCache(config, batch_size, max_len) without dtype makes float32 tensors (dtype=torch.float32)"
            )
        if problem:
            return caches, problem
        caches.append(cache)
    for i, (cache, spec) in enumerate(zip(caches[:-1], specs)):
        problem = _structure_problem(cache, *spec)
        if problem:
            return caches, (
                f"the first cache was right when made, but after a second KVCache was made: {problem}. "
                f"Keep every tensor (and the length) on the instance, self.k = [...] in __init__, not on "
                f"the class: two caches are alive at once (a target and a draft model, two generations)"
            )
    return caches, ""


def _run_caches(cls, specs: list, steps: list, defaults: bool = False) -> Trace:
    """Make the caches (`_new_caches`) and run `steps` on them: (cache, [(k, v) per layer]) calls update(layer, k, v)
    for every layer, then advances cache.length by T, as the model does; (cache, n) sets cache.length = n (a rollback).
    The last step of a case may write past max_len: it must be refused."""
    caches, problem = _new_caches(cls, specs, defaults)
    trace = Trace(problem=problem)
    if problem:
        return trace
    pointers = [[(t.data_ptr(), _storage(t)) for t in [*c.k, *c.v]] for c in caches]
    for step, (which, layers) in enumerate(steps):
        cache, (config, _, max_len, _) = caches[which], specs[which]
        if isinstance(layers, int):
            cache.length = layers
            continue
        start, T = cache.length, layers[0][0].shape[2]
        for layer, (k, v) in enumerate(layers):
            write = Write(which, step, layer, start, T)
            trace.writes.append(write)
            if int(start) + T > max_len:  # the last step of an overflow case: it must be refused
                try:
                    cache.update(layer, k, v)
                except Exception as err:  # noqa: BLE001 - any clear error will do
                    trace.refused = raised(err).removeprefix("raised ")
                return trace
            try:
                out = cache.update(layer, k, v)
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - said with the case and where it went wrong
                frame = traceback.extract_tb(err.__traceback__)[-1]
                write.raised = f"{raised(err)}\n  at line {frame.lineno} in {frame.name}: {frame.line}"
                return trace
            if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
                write.returned = (
                    f"a {type(out).__name__} of {len(out)}" if isinstance(out, (list, tuple)) else short(out, 60)
                )
                if isinstance(out, list) and len(out) == 2 and all(isinstance(t, Tensor) for t in out):
                    write.returned = "a list [keys, values]"
                return trace
            keys, values = out
            write.views = _storage(keys) == _storage(cache.k[layer]) and _storage(values) == _storage(cache.v[layer])
            write.keys, write.values = keys.clone(), values.clone()
            write.length_after = cache.length
            now = [(t.data_ptr(), _storage(t)) for t in [*cache.k, *cache.v]]
            moved = [i for i, (a, b) in enumerate(zip(pointers[which], now)) if a != b]
            if moved:
                i = moved[0]
                write.moved = f"k[{i}]" if i < config.n_layer else f"v[{i - config.n_layer}]"
        cache.length += T
    trace.contents = [t.clone() for c in caches for t in [*c.k, *c.v]]
    return trace


def _device_problem(cls, config, batch_size: int, max_len: int, dtype: torch.dtype) -> str:
    """What is wrong with a cache made on the `meta` device (a device other than the CPU, which every machine has:
    tensors there have a shape, a dtype and a device but no values), and with what one `update` of 2 positions
    returns; '' if nothing. Stands for a model on a GPU: a cache made on the CPU whatever `device` says, or in a
    fixed dtype, fails here on any machine."""
    cache = cls(config, batch_size, max_len, device="meta", dtype=dtype)
    for name in ("k", "v"):
        tensors = getattr(cache, name, None)
        if not isinstance(tensors, list) or not all(isinstance(t, Tensor) for t in tensors):
            return f"cache.{name} should be a list of tensors, got {short(tensors, 80)}"
        for i, t in enumerate(tensors):
            if t.device.type != "meta":
                return f"cache.{name}[{i}] was made on {t.device}, not on the device asked for (meta)"
            if t.dtype != dtype:
                return f"cache.{name}[{i}] has dtype {t.dtype}, expected {dtype}"
    shape = (batch_size, config.n_kv_head, 2, config.head_dim)
    out = cache.update(
        0, torch.zeros(shape, device="meta", dtype=dtype), torch.zeros(shape, device="meta", dtype=dtype)
    )
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)):
        return ""  # the other cases say what update must return
    for what, t in zip(("keys", "values"), out):
        if t.device.type != "meta":
            return f"update returned {what} on {t.device}, not on the cache's device (meta)"
    return ""


DEVICE_HINT = (
    "make every tensor with device=device and dtype=dtype, the arguments: the model passes its own (on a GPU, keys "
    "on cuda cannot be written into a cache on the CPU, and a bfloat16 model's keys into a float32 cache take twice "
    "the memory)"
)


def _judge_cache(case: Case, got: Trace) -> Verdict:
    expected: Trace = case.expected
    if not isinstance(got, Trace):  # cannot happen: the trace is made by the check
        return "the check could not follow your cache", ""
    if got.problem:
        return got.problem, ""
    specs = case.args[1]
    for mine, theirs in zip(got.writes, expected.writes):
        max_len = specs[mine.cache][2]
        which = f"cache #{mine.cache + 1}, " if len(specs) > 1 else ""
        at = f"{which}step {mine.step} (cache.length {mine.start}, T = {mine.T}), update(layer={mine.layer}, k, v)"
        if theirs.keys is None:  # the write past max_len
            if got.refused is None:
                return (
                    f"{at} writes past max_len = {max_len} and was not refused",
                    f"length {mine.start} + T {mine.T} > max_len {max_len}: raise an error (e.g. "
                    "ValueError('cache full: ...')) rather than dropping positions or growing the cache",
                )
            return None
        extra = ""
        if theirs.start + mine.T > 256:
            extra += " — past position 255 here: is the length or an index kept in 8 bits (uint8)?"
        if any(isinstance(s, int) for _, s in case.args[2][: mine.step]):
            extra += (
                " — the cache was rolled back (cache.length set to fewer positions) before this step: write at "
                "cache.length, not after the last position written"
            )
        if mine.raised:
            hint = NOT_CONTIGUOUS if "view size is not compatible" in mine.raised else ""
            return f"{at} {mine.raised}", (hint + extra if hint else extra.removeprefix(" — "))
        if mine.keys is None and not mine.returned:  # the check's own int(length) said it would not fit
            return (
                f"{at}: cache.length is {short(mine.start, 60)}, expected {theirs.start}",
                "cache.length is a Python int, 0 in a new cache; the model adds T after each step" + extra,
            )
        if mine.returned:
            return (
                f"{at} returned {mine.returned}, expected a tuple (keys, values) of two tensors",
                "return self.k[layer][:, :, :end], self.v[layer][:, :, :end] — a tuple, which the model "
                "unpacks and the engine checks",
            )
        if mine.length_after != mine.start:
            return (
                f"{at} changed cache.length from {mine.start} to {short(mine.length_after, 40)}",
                "update must not advance length: every layer writes the same positions [length, length + T), "
                "and the model does cache.length += T after the last layer",
            )
        if mine.moved:
            return (
                f"{at} replaced cache.{mine.moved} by a new tensor (its data_ptr() changed)",
                "write in place into the preallocated tensor, e.g. self.k[layer][:, :, start:end] = k; "
                "never assign a new tensor (torch.cat, clone) to self.k[layer]",
            )
        for what, g, e in (("keys", mine.keys, theirs.keys), ("values", mine.values, theirs.values)):
            if isinstance(g, Tensor) and isinstance(e, Tensor) and g.dim() == 4 and g.shape[2] != e.shape[2]:
                hint = (
                    (
                        f"return only the filled positions, self.{what[0]}[layer][:, :, :length + T]: the other "
                        f"{g.shape[2] - e.shape[2]} positions are zeros the new token would attend to"
                    )
                    if g.shape[2] == max_len
                    else f"return the positions [0, length + T) = [0, {e.shape[2]}): the cached ones and the new ones"
                )
                return f"{at} returned {what} of shape {tuple(g.shape)}, expected {tuple(e.shape)}", hint + extra
            problem = tensor_problem(g, e, atol=0, rtol=0)
            if problem:
                return (
                    f"{at} returned wrong {what}: {problem}",
                    "write k and v at positions [length, length + T) of this layer's tensors, then return positions "
                    "[0, length + T)" + extra,
                )
        if not mine.views:
            return (
                f"{at} returned copies, not views of the cache",
                "return slices such as self.k[layer][:, :, :end] (a view: no copy); .clone() or torch.cat "
                "copies the whole cache at every layer of every step",
            )
    if got.refused is None and expected.refused is not None:
        return "a write past max_len was not refused", "raise an error when length + T > max_len"
    for i, (g, e) in enumerate(zip(got.contents, expected.contents)):
        problem = tensor_problem(g, e, atol=0, rtol=0)
        if problem:
            return (
                f"after all steps, the cache's tensor #{i} holds wrong values: {problem}",
                "write into the cache's own tensors (in place), not into a copy of them",
            )
    return None


def _heads(g: torch.Generator, config: GPT2Config, batch_size: int, T: int, dtype) -> tuple[Tensor, Tensor]:
    """k and v [B, n_kv_head, T, head_dim] as the model passes them: split from one qkv tensor [B, T, C + 2·KV],
    then split into heads (views, not contiguous). GPT-2: n_kv_head = n_head, KV = C."""
    C, H, D = config.n_embd, config.n_kv_head, config.head_dim
    qkv = _randn(g, batch_size, T, C + 2 * H * D, dtype=torch.float64).mul(3).add(1).to(dtype)
    _, k, v = qkv.split([C, H * D, H * D], dim=-1)
    return k.view(batch_size, T, H, D).transpose(1, 2), v.view(batch_size, T, H, D).transpose(1, 2)


def _gqa_config(n_layer: int, n_head: int, n_kv_head: int, head_dim: int) -> LlamaConfig:
    """A Llama-family config (chapter 11) whose n_head query heads share n_kv_head heads of keys and values."""
    n_embd = n_head * head_dim
    return LlamaConfig(
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd, intermediate_size=n_embd, vocab_size=8
    )


def _config_text(c) -> str:
    if isinstance(c, LlamaConfig):
        return f"LlamaConfig(n_layer={c.n_layer}, n_head={c.n_head}, n_kv_head={c.n_kv_head}, n_embd={c.n_embd}, ...)"
    return f"GPT2Config(n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd})"


def _cache_steps(g: torch.Generator, config: GPT2Config, batch_size: int, chunks: list, dtype, which: int = 0) -> list:
    """Steps for one cache: an int T in `chunks` writes T positions; ('to', n) sets cache.length = n."""
    return [
        (which, chunk[1])
        if isinstance(chunk, tuple)
        else (which, [_heads(g, config, batch_size, chunk, dtype) for _ in range(config.n_layer)])
        for chunk in chunks
    ]


NOT_CONTIGUOUS = (
    "k and v are views split from the qkv projection (not contiguous), as the model passes them: "
    ".view() cannot reshape them; write them with a slice, self.k[layer][:, :, start:end] = k (or use "
    ".reshape())"
)
CACHE_ENGINE_RUNS: dict[int, tuple] = {}  # seed -> (model, calls): kept out of the cases' arguments


def _cache_engine_calls(seed: int) -> tuple:
    """A tiny random model, a draft model and the generations the engine makes with a cache: greedy, a left-padded
    batch (attention mask), beam search (reorder), speculative decoding (rollbacks)."""
    if seed not in CACHE_ENGINE_RUNS:
        rng = random.Random(seed)
        model, draft = decisive_model(seed, n_layer=2), decisive_model(seed + 1, n_layer=1)
        prompt = lambda n: [rng.randrange(97) for _ in range(n)]  # noqa: E731
        calls = [
            ("greedy", prompt(20), dict(max_new_tokens=12)),
            ("a left-padded batch", [prompt(7), prompt(2), prompt(12)], dict(max_new_tokens=8)),
            ("beam search (3 beams)", prompt(5), dict(max_new_tokens=6, num_beams=3)),
            (
                "speculative decoding (rolls the cache back)",
                prompt(6),
                dict(max_new_tokens=12, draft=draft, num_draft_tokens=3),
            ),
        ]
        CACHE_ENGINE_RUNS[seed] = (model, calls)
    return CACHE_ENGINE_RUNS[seed]


def _generations(model: GPT2, calls: list, kv_cache) -> Any:
    """Every call's tokens generated with `kv_cache` (generate's `kv_cache=`: the target's and the draft's caches);
    a PartError of the engine's guard as text."""
    try:
        with one_thread():
            return [
                generate(model, prompt, eos_token_id=None, kv_cache=kv_cache, **settings)
                for _, prompt, settings in calls
            ]
    except PartError as err:
        return f"{err}".split("\n  hint:")[0]


def _run_in_engine(cls, seed: int) -> Any:
    """The engine's generations with `cls` installed as `my_engine` installs it: generate(..., kv_cache=guard("KVCache",
    cls))."""
    model, calls = _cache_engine_calls(seed)
    return _generations(model, calls, guard("KVCache", cls))


def _engine_tokens(seed: int) -> list:
    """What the engine's generations give with its own KVCache (computed after the learner's run)."""
    return _generations(*_cache_engine_calls(seed), EngineKVCache)


def check_kv_cache(cls, *, seed: int = 0, n_random: int = 4) -> None:
    """KVCache(config, batch_size, max_len, *, device=None, dtype=torch.float32): per-layer tensors k, v
    [B, n_kv_head, max_len, head_dim] (lists) allocated once; update(layer, k, v) writes in place at
    [length, length + T) and returns the views [0, length + T) as a tuple; the caller advances length (and may set
    it back). And the engine's generation with it (as my_engine installs it) gives the engine's tokens."""
    if not isinstance(cls, type):
        raise CheckFailed(f"✗ KVCache: expected a class, got {short(cls)}")
    g = torch.Generator().manual_seed(seed)
    f32, f64, f16, bf16 = torch.float32, torch.float64, torch.float16, torch.bfloat16

    def case(description, config, batch_size, max_len, chunks, dtype=f32, hint="", defaults=False):
        specs = [(config, batch_size, max_len, dtype)]
        steps = _cache_steps(g, config, batch_size, chunks, dtype)
        return Case(
            description, ("protocol", specs, steps, defaults), later(_run_caches, EngineKVCache, specs, steps), hint
        )

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=8)
    cases = [
        case(
            "one layer, prefill 3 positions",
            GPT2Config(n_layer=1, n_head=2, n_embd=8),
            1,
            5,
            [3],
            hint="update returns the keys and values of positions [0, 3), written at [0, 3)",
        ),
        case(
            "two layers: prefill 3, then one token",
            cfg,
            1,
            6,
            [3, 1],
            hint="both layers write positions [length, length + T); only the model advances length",
        ),
        case("prefill, then 3 decode steps up to max_len", cfg, 1, 6, [3, 1, 1, 1]),
        case(
            "batch of 2, float64",
            GPT2Config(n_layer=3, n_head=3, n_embd=12),
            2,
            7,
            [4, 1, 2],
            f64,
            hint="float64 in, float64 out: make the tensors with the dtype argument",
        ),
        case(
            "float16, as a half-precision model on a GPU",
            cfg,
            2,
            9,
            [5, 1, 1],
            f16,
            hint="make the tensors with the dtype argument",
        ),
        case("bfloat16", GPT2Config(n_layer=1, n_head=4, n_embd=16), 1, 6, [2, 3, 1], bf16),
        case(
            "a Llama-family model with grouped-query attention (chapter 11): 4 query heads share 2 heads of keys "
            "and values",
            _gqa_config(2, 4, 2, 4),
            1,
            6,
            [3, 1, 1],
            hint="store config.n_kv_head heads of keys and values (GPT-2's n_kv_head is its n_head; a model with "
            "grouped-query attention has fewer)",
        ),
        case("a write past max_len", cfg, 1, 4, [3, 2]),
        case(
            "speculative decoding: the cache is rolled back (cache.length set back) and written again",
            cfg,
            1,
            12,
            [4, 1, 3, ("to", 6), 3, ("to", 9), 1],
            hint="after cache.length = n, the next update writes at position n: keep no position counter of your own",
        ),
        case(
            "GPT-2's 1024 positions: a 300-token prompt, then decode steps past position 255",
            GPT2Config(n_layer=1, n_head=2, n_embd=8),
            1,
            1024,
            [300, 1, 1, 200, 1],
        ),
        case(
            "KVCache(config, batch_size, max_len) with device and dtype left out",
            cfg,
            1,
            5,
            [2, 1],
            hint="dtype=torch.float32 and device=None by default",
            defaults=True,
        ),
    ]
    two = [
        (GPT2Config(n_layer=2, n_head=2, n_embd=8), 1, 8, f32),
        (GPT2Config(n_layer=1, n_head=1, n_embd=4), 2, 6, f64),
    ]
    first, second = (
        _cache_steps(g, c, b, chunks, d, i)
        for i, ((c, b, _, d), chunks) in enumerate(zip(two, ([3, 1, 1, 1], [2, 2, 1])))
    )
    interleaved = [first[0], second[0], first[1], second[1], first[2], first[3], second[2]]
    cases.append(
        Case(
            "two caches alive at once (a target and a draft model), written in turn",
            ("protocol", two, interleaved, False),
            later(_run_caches, EngineKVCache, two, interleaved),
            "each cache keeps its own tensors and length",
        )
    )
    rng = random.Random(seed)
    for i in range(n_random):
        n_head, n_layer, head_dim = rng.choice([1, 2, 3, 4]), rng.randint(1, 4), rng.choice([1, 4, 5, 8])
        if i % 3 == 2:  # grouped-query attention: n_kv_head divides n_head; RoPE needs an even head_dim
            n_head = rng.choice([2, 4, 6])
            kv_heads = rng.choice([k for k in (1, 2, 3) if n_head % k == 0])
            config = _gqa_config(n_layer, n_head, kv_heads, rng.choice([2, 4, 8]))
        else:
            config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim)
        chunks = [rng.randint(1, 6)] + [1] * rng.randint(1, 5) + [rng.randint(1, 3)] * rng.randint(0, 1)
        if rng.random() < 0.3:
            chunks[rng.randrange(1, len(chunks))] = ("to", rng.randint(1, chunks[0]))
        max_len = sum(c for c in chunks if isinstance(c, int)) + rng.randint(0, 3)
        dtype = (f32, f64, f16, bf16)[i % 4]
        cases.append(
            case(
                f"random #{i}: {config.n_layer} layers, {n_head} heads ({config.n_kv_head} of keys and values) of "
                f"{config.head_dim}, "
                f"{str(dtype)[6:]}, T = {chunks}",
                config,
                rng.randint(1, 3),
                max_len,
                chunks,
                dtype,
            )
        )
    device_spec = (GPT2Config(n_layer=2, n_head=2, n_embd=8), 2, 6, bf16)
    cases.append(
        Case(
            "a model on another device: KVCache(..., device='meta', dtype=torch.bfloat16) (meta stands for a GPU: "
            "tensors with a device and a dtype, no values)",
            ("device", device_spec),
            "",
            DEVICE_HINT,
        )
    )
    cases.append(
        Case(
            "the engine's generation with your KVCache, as my_engine installs it (guarded): greedy, "
            "a left-padded batch, beam search, speculative decoding",
            ("engine", seed),
            later(_engine_tokens, seed),
        )
    )

    def show(args: tuple) -> str:
        if args[0] == "device":
            config, b, m, d = args[1]
            return (
                f"cache = KVCache({_config_text(config)}, batch_size={b}, max_len={m}, device='meta', dtype={d}); "
                f"cache.update(0, k, v) with k and v [B, n_kv_head, 2, head_dim] on meta"
            )
        if args[0] == "engine":
            calls = _cache_engine_calls(args[1])[1]
            return 'llmcourse.generate(tiny random model, ..., kv_cache=guard("KVCache", KVCache)) for: ' + "; ".join(
                d for d, _, _ in calls
            )
        _, specs, steps, defaults = args
        made = "; ".join(
            f"cache{'' if len(specs) == 1 else i + 1} = KVCache({_config_text(c)}, batch_size={b}, max_len={m}"
            + (")" if defaults else f", dtype={d})")
            for i, (c, b, m, d) in enumerate(specs)
        )
        Ts = [f"length = {s}" if isinstance(s, int) else s[0][0].shape[2] for _, s in steps]
        whose = "" if len(specs) == 1 else f" (caches {[w + 1 for w, _ in steps]})"
        return (
            f"{made}; steps of T = {Ts}{whose}: each calls cache.update(layer, k, v) for every layer, k and v "
            f"[B, n_kv_head, T, head_dim] (views split from the qkv projection, as the model passes them), then "
            f"cache.length += T"
        )

    def judge(case: Case, got: Any) -> Verdict:
        """Says what went wrong where, with the run's input: a trace has no one 'expected' value to show."""
        if case.args[0] == "device":
            if got:
                raise CheckFailed(
                    f"✗ KVCache — {case.description}: {got}\n  input:    {show(case.args)}\n  hint: {case.hint}"
                )
            return None
        if case.args[0] == "engine":
            if got == case.expected:
                return None
            if isinstance(got, str):
                problem = f"in the engine: {got}"
            else:
                i = next((i for i, (a, b) in enumerate(zip(got, case.expected)) if a != b), 0)
                problem = (
                    f"in the engine, {_cache_engine_calls(case.args[1])[1][i][0]} gave other tokens than with "
                    f"the engine's KVCache: expected {short(case.expected[i], 80)}, got {short(got[i], 80)}"
                )
            raise CheckFailed(
                f"✗ KVCache — {case.description}: {problem}\n  input:    {show(case.args)}\n"
                "  hint: your cache passes the cases above but not the engine's use of it: it must keep "
                "the interface exactly (lists k and v, update returning a tuple, length set by the "
                "model)"
            )
        if isinstance(got, Trace) and got.problem:
            raise CheckFailed(f"✗ KVCache — {case.description}: {got.problem}\n  input:    {show(case.args)}")
        verdict = _judge_cache(case, got)
        if verdict:
            problem, hint = verdict
            about_answer = "returned" in problem and "copies" not in problem  # the case's hint is about answers
            chosen = one_hint(hint, case.hint if about_answer else "")
            raise CheckFailed(
                f"✗ KVCache — {case.description}: {problem}\n  input:    {show(case.args)}"
                + (f"\n  hint: {chosen}" if chosen else "")
            )
        return None

    def run(kind, specs, steps=None, defaults=False):  # named for messages: "changed its input `steps`" (k, v)
        if kind == "engine":
            return _run_in_engine(cls, specs)  # specs: the seed
        if kind == "device":
            return _device_problem(cls, *specs)
        return _run_caches(cls, specs, steps, defaults)

    run_check(
        "KVCache",
        run,
        cases,
        judge=judge,
        forbid=[ENGINE_CACHE],
        show_call=show,
        seconds=5,
        total_seconds=30,
        error_hints={
            "view size is not compatible": NOT_CONTIGUOUS,
            "expected to be in the same device": "make every tensor your cache uses on the cache's device, an index "
            "(torch.arange) too: device=k.device",
        },
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: cached_attention


def reference_cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: int) -> Tensor:
    """Attention of q [B, H, 1, D] over the first `length` positions of k_cache, v_cache [B, H, max_len, D]."""
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]  # [B, H, length, D]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, 1, length]
    return torch.softmax(scores, dim=-1) @ v  # [B, H, 1, D]


def _all_positions(q, k_cache, v_cache, length):
    return reference_cached_attention(q, k_cache, v_cache, k_cache.shape[2])


def _one_short(q, k_cache, v_cache, length):
    return reference_cached_attention(q, k_cache, v_cache, length - 1)


def _one_long(q, k_cache, v_cache, length):
    return reference_cached_attention(q, k_cache, v_cache, length + 1)


def _no_scale(q, k_cache, v_cache, length):
    return reference_cached_attention(q * math.sqrt(q.shape[-1]), k_cache, v_cache, length)


def _scale_by_d(q, k_cache, v_cache, length):
    return reference_cached_attention(q / math.sqrt(q.shape[-1]), k_cache, v_cache, length)


def _softmax_over_queries(q, k_cache, v_cache, length):
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def _no_max_shift(q, k_cache, v_cache, length):
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    e = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return e / e.sum(-1, keepdim=True) @ v


CACHED_ATTENTION_MISTAKES = [
    (
        _all_positions,
        "attend to the first `length` positions only: k_cache[:, :, :length]; the positions after them "
        "are not written yet (zeros, or stale values of an earlier sequence)",
    ),
    (
        _one_short,
        "off by one: the new token's own key is already in the cache, at position length - 1, so attend to "
        "positions [0, length) — k_cache[:, :, :length]",
    ),
    (_one_long, "off by one: attend to positions [0, length) — k_cache[:, :, :length], not length + 1"),
    (_no_scale, "divide the scores by √D (D = head_dim = q.shape[-1]) before the softmax"),
    (_scale_by_d, "divide the scores by √D, not by D"),
    (_softmax_over_queries, "take the softmax over the keys (the last dimension, dim=-1)"),
    (
        overflowing(_no_max_shift),
        "exp() of a score overflows float16 above ~11 (float32 above ~88) and inf / inf is nan: subtract each "
        "row's max score before exp() (torch.softmax does)",
    ),
]


def _cached_attention_tolerance(case: Case) -> tuple[float, float]:
    """(atol, rtol): float64 float64-accurate, float32 1e-5; float16 / bfloat16 a few roundings of each step
    (16 eps), the scores of the half-precision cases being exact in their dtype."""
    dtype = case.expected.dtype
    if dtype == torch.float64:
        return 1e-10, 1e-9
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return 16 * eps, 16 * eps
    return 1e-5, 1e-4


def _show_cached_attention(args: tuple) -> str:
    q, k_cache, v_cache, length = args
    return f"cached_attention(q={_desc(q)}, k_cache={_desc(k_cache)}, v_cache={_desc(v_cache)}, length={length})"


def check_cached_attention(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """cached_attention(q, k_cache, v_cache, length): q [B, H, 1, D] attends to positions [0, length)
    -> [B, H, 1, D]."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def case(description, B, H, D, max_len, length, dtype=torch.float32, scale=1.0, stale=True, hint=""):
        q = _randn(g, B, H, 1, D, dtype=dtype) * scale
        k_cache = _randn(g, B, H, max_len, D, dtype=dtype) * scale
        v_cache = _randn(g, B, H, max_len, D, dtype=dtype) * 3 + 5
        if not stale:  # positions not written yet are zeros, as in a new cache
            k_cache[:, :, length:] = 0
            v_cache[:, :, length:] = 0
        expected = in_float64(reference_cached_attention, q, k_cache, v_cache, length)
        return Case(description, (q, k_cache, v_cache, length), expected, hint)

    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were

    def large_case(description, B, H, max_len, length, dtype):
        """Head dim 16, scores q·k / 4 of about ±1e4, exact in `dtype` (`large_exact_scores`)."""
        q, k_cache = large_exact_scores(large, (B, H, 1, 16), (B, H, max_len, 16), dtype)
        v_cache = (torch.randn(B, H, max_len, 16, generator=large, dtype=torch.float64) * 3 + 5).to(dtype)
        expected = in_float64(reference_cached_attention, q, k_cache, v_cache, length)
        hint = "exp() overflows float16 above ~11: subtract each row's max score first (torch.softmax does)"
        return Case(description, (q, k_cache, v_cache, length), expected, hint)

    cases = [
        case(
            "one filled position",
            1,
            1,
            4,
            3,
            1,
            stale=False,
            hint="with one key the softmax weight is 1: the answer is v_cache[:, :, 0:1]",
        ),
        case("a new cache: the positions after length are zeros", 1, 2, 8, 10, 6, stale=False),
        case(
            "stale values after length (an earlier, longer sequence)",
            1,
            2,
            8,
            10,
            6,
            hint="only positions [0, length) belong to this sequence",
        ),
        case("the cache is full (length = max_len)", 2, 3, 4, 5, 5),
        case("batch of 3, float64", 3, 2, 16, 9, 7, f64, hint="float64 in, float64 out"),
        case(
            "large scores (q and k × 30)",
            2,
            2,
            8,
            6,
            4,
            scale=30.0,
            hint="a stable softmax (subtract the max, or torch.softmax) keeps large scores finite",
        ),
        case("head_dim 64, as in GPT-2", 1, 2, 64, 12, 11, f64),
        large_case(
            "float16, scores of about ±1e4 (exact in float16): exp overflows without the max shift",
            2,
            2,
            9,
            7,
            torch.float16,
        ),
        large_case("bfloat16, scores of about ±1e4, the cache full", 1, 3, 6, 6, torch.bfloat16),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        max_len = rng.randint(1, 40)
        dtype = (torch.float32, f64)[i % 2]
        cases.append(
            case(
                f"random #{i}: {str(dtype)[6:]}",
                rng.randint(1, 3),
                rng.randint(1, 4),
                rng.choice([1, 3, 8, 32, 64]),
                max_len,
                rng.randint(1, max_len),
                dtype,
                scale=rng.choice([0.1, 1.0, 5.0]),
                stale=rng.random() < 0.7,
            )
        )
    run_check(
        "cached_attention",
        fn,
        cases,
        judge=tensor_judge(_cached_attention_tolerance, CACHED_ATTENTION_MISTAKES),
        forbid=NO_ATTENTION,
        show_call=_show_cached_attention,
        seconds=5,
        total_seconds=30,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 3: generate_greedy


def decisive_model(
    seed: int,
    *,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 32,
    n_positions: int = 64,
    vocab_size: int = 97,
    dtype: torch.dtype = torch.float32,
) -> GPT2:
    """A tiny random GPT-2 whose greedy continuations vary and whose argmaxes are clear. GPT-2's own
    initialization gives near-uniform logits (near-ties, which rounding may flip between a cached and a
    full pass); a larger embedding alone makes the model repeat its input token; larger attention and
    MLP weights make the next token depend on the whole context."""
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab_size)
    model = GPT2(config).init_weights(seed)
    with torch.no_grad():
        model.wte.weight.mul_(20)
        model.wpe.weight.mul_(50)
        for block in model.h:
            block.attn.c_attn.weight.mul_(25)
            block.attn.c_proj.weight.mul_(150)
            block.mlp.c_fc.weight.mul_(25)
            block.mlp.c_proj.weight.mul_(150)
    return model.to(dtype).eval()


@torch.no_grad()
def smallest_margin(model: GPT2, prompt_ids: list[int], tokens: list[int]) -> float:
    """The smallest gap between the best and the second-best logit over the steps that chose `tokens`."""
    logits = model(torch.tensor([prompt_ids + tokens[:-1]], device=model.device))[0, len(prompt_ids) - 1 :]
    top2 = logits.topk(2, dim=-1).values  # [steps, 2]
    return float((top2[:, 0] - top2[:, 1]).min())


@torch.no_grad()
def full_recompute(model: GPT2, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens with no cache: the whole sequence through the model for every new token."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids], device=model.device), last_only=True)[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def recording_cache(base: type = EngineKVCache) -> type:
    """A subclass of the engine's cache that records every cache made and every write (to see how a loop
    uses it), and refuses a write past max_len with a message that says so."""

    class Recorded(base):
        made: list = []  # every cache made with this class

        def __init__(self, config, batch_size, max_len, **kwargs):
            super().__init__(config, batch_size, max_len, **kwargs)
            self.writes: list[tuple[int, int]] = []  # (length, T) of every layer-0 write
            self.pointers = [t.data_ptr() for t in [*self.k, *self.v]]
            self.args = (batch_size, max_len, kwargs.get("dtype", torch.float32))
            self.device = kwargs.get("device")  # as given: None when left out
            Recorded.made.append(self)

        def update(self, layer, k, v, slot=None):
            if k.dtype != self.args[2]:
                raise ValueError(
                    f"the cache holds {self.args[2]} but the model gives {k.dtype} keys: make the cache "
                    f"with dtype=model.dtype"
                )
            if slot is None and self.length + k.shape[2] > self.max_len:
                raise ValueError(
                    f"the cache is full: {k.shape[2]} more position(s) at length {self.length}, but "
                    f"max_len is {self.max_len}"
                )
            if layer == 0:
                self.writes.append((self.length, k.shape[2]))
            return super().update(layer, k, v, slot)

    Recorded.__name__ = Recorded.__qualname__ = "KVCache"
    Recorded.made = []
    return Recorded


@dataclasses.dataclass
class Run:
    tokens: Any
    caches: list  # the recorded caches made during the call
    positions: int = 0  # how many positions the model computed (batch rows × tokens, over every call)

    def __repr__(self) -> str:
        return short(self.tokens, 200)


def _run_loop(fn: Callable, model: GPT2, prompt_ids: list[int], max_new_tokens: int) -> Run:
    """fn's tokens, the caches it made with a recording cache class, and the positions the model computed (counted
    where every forward pass goes, `model.blocks`: a loop that also recomputes the whole sequence is seen). fn gets
    the case's own list of prompt ids: the check sees whether it changes it."""
    cache_class = recording_cache()
    run = Run(None, cache_class.made)
    blocks = model.blocks

    def counted(x, position_ids, attend):
        run.positions += x.shape[0] * x.shape[1]
        return blocks(x, position_ids, attend)

    model.blocks = counted
    try:
        run.tokens = fn(model, prompt_ids, max_new_tokens, cache_class)
    finally:
        del model.blocks
    return run


def _count(n: int, thing: str) -> str:
    """'1 decode step', '3 decode steps', '2 forward passes'."""
    return f"{n} {thing}" + ("" if n == 1 else "es" if thing.endswith("s") else "s")


def _loop_problem(case: Case, got: Run) -> Verdict:
    (
        model,
        prompt,
        n,
    ) = case.args
    P, expected = len(prompt), case.expected
    tokens = got.tokens
    if isinstance(tokens, Tensor):
        return f"expected a list of {n} ints, got a tensor {list(tokens.shape)}", "return a list: tensor.tolist()"
    if not isinstance(tokens, list) or not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in tokens
    ):
        return (
            f"expected a list of {n} ints (the new token ids), got {short(tokens, 80)}",
            "int(logits.argmax()) is a Python int",
        )
    if len(tokens) != n:
        return (
            f"expected {n} new tokens, got {len(tokens)}",
            "max_new_tokens counts the generated tokens only (not the prompt): the prefill gives the first, "
            "each decode step one more",
        )
    if not got.caches:
        return (
            "the loop made no cache with cache_class",
            "make one cache with cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device, "
            "dtype=model.dtype) and pass it to every model(..., cache=cache) call",
        )
    if len(got.caches) > 1:
        return (
            f"the loop made {len(got.caches)} caches; one is enough",
            "make the cache once, before the loop: a new cache each step forgets every position and makes the "
            "model recompute them",
        )
    cache = got.caches[0]
    if cache.args[2] != model.dtype:
        return (
            f"the cache has dtype {cache.args[2]}, the model {model.dtype}",
            "make the cache with dtype=model.dtype (float64 model, float64 cache)",
        )
    if cache.device is None or torch.device(cache.device) != model.device:
        made = "without a device" if cache.device is None else f"on {cache.device}"
        return (
            f"the cache was made {made}; the model is on {model.device}",
            "make the cache with device=model.device: on a GPU the model's keys are on cuda, and a cache made on "
            "the default device (the CPU) cannot take them",
        )
    if [t.data_ptr() for t in [*cache.k, *cache.v]] != cache.pointers:
        return (
            "the cache's tensors were replaced during the loop",
            "let the model write into the cache; do not assign cache.k or cache.v",
        )
    writes = cache.writes
    wrong = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    steps = ", ".join(f"{T} at position {start}" for start, T in writes[:6]) + (", ..." if len(writes) > 6 else "")
    seen = f"the model was given tokens: {steps}"
    if not writes or writes[0] != (0, P):
        if writes and writes[0] == (0, P - 1):
            return (
                f"the prefill put {P - 1} of the {P} prompt tokens in the cache ({seen})",
                "prefill the whole prompt, model(prompt, cache=cache): the logits of its last position give "
                "the first new token",
            )
        return (
            f"the prefill should put the {P} prompt tokens at positions [0, {P}) in one call ({seen})",
            "call model(torch.tensor([prompt_ids]), cache=cache) once, before the loop",
        )
    later = writes[1:]
    if any(T != 1 for _, T in later):
        return (
            f"each decode step should feed one token ({seen})",
            "after the prefill the cache holds every earlier position: feed only the newest token, "
            "model(torch.tensor([[token]]), cache=cache) — feeding the whole sequence again writes its positions twice",
        )
    if wrong is not None:
        return (
            f"token {wrong} differs from the full recompute's: expected {expected[wrong]}, got {tokens[wrong]}",
            "each step feeds the token just chosen and takes the argmax of the last position's logits",
        )
    if len(later) != n - 1:
        return (
            f"{_count(1 + len(later), 'forward pass')} with the cache (the prefill and "
            f"{_count(len(later), 'decode step')}) for {_count(n, 'new token')}; it takes exactly "
            f"{_count(n, 'forward pass')}, the prefill and "
            f"{_count(n - 1, 'decode step')} ({seen})",
            "the prefill gives the first token and each decode step one more: stop when you have max_new_tokens; "
            "the last token chosen is returned, never fed back",
        )
    if got.positions > P + n - 1:
        return (
            f"the model computed {got.positions} positions for a {P}-token prompt and {_count(n, 'new token')}; a "
            f"cached loop computes {P + n - 1} ({P} in the prefill, then one per decode step)",
            "take every token from the cached calls: running the model on the whole sequence as well (a full "
            "recompute) does all the work the cache is there to save",
        )
    return None


def check_generate_greedy(fn, *, seed: int = 0, n_random: int = 2, bundled: bool = False) -> None:
    """generate_greedy(model, prompt_ids, max_new_tokens, cache_class): the prefill + decode loop; the tokens of a
    full recompute, with one cache, the prompt prefilled once and one token per step."""
    if not callable(fn):
        raise CheckFailed(f"✗ generate_greedy: expected a function, got {short(fn)}")
    with one_thread():
        _check_generate_greedy(fn, seed, n_random, bundled)


def _check_generate_greedy(fn, seed: int, n_random: int, bundled: bool) -> None:
    rng = random.Random(seed)

    def case(description, model, prompt, n, hint=""):
        """A case whose every greedy step is decisive (a logit gap of at least 2e-3, 40× the rounding
        differences of a cached pass); if the given prompt is not, a random one of the same length."""
        for _ in range(50):
            tokens = full_recompute(model, prompt, n)
            if smallest_margin(model, prompt, tokens) >= 2e-3:
                break
            prompt = [rng.randrange(model.config.vocab_size) for _ in prompt]
        return Case(description, (model, prompt, n), later(full_recompute, model, prompt, n), hint)

    tiny = decisive_model(seed)
    V = tiny.config.vocab_size
    cases = [
        case(
            "a one-token prompt, one new token",
            tiny,
            [5],
            1,
            hint="the prefill alone gives the first token: no decode step is needed",
        ),
        case("a one-token prompt, 6 new tokens", tiny, [5], 6),
        case("a 7-token prompt, 10 new tokens", tiny, [rng.randrange(V) for _ in range(7)], 10),
        case(
            "float64, 3 layers of 4 heads",
            decisive_model(seed + 1, n_layer=3, n_head=4, dtype=torch.float64),
            [rng.randrange(V) for _ in range(5)],
            8,
            "make the cache in the model's dtype",
        ),
        case("filling all 64 positions", tiny, [rng.randrange(V) for _ in range(40)], 24),
        case(
            "the same one-token prompt and length on another model (nothing kept from an earlier call)",
            decisive_model(seed + 2, n_layer=1),
            [5],
            6,
        ),
        case(
            "a 270-token prompt (positions past 255) over 300 token ids (ids past 255), 20 new tokens",
            decisive_model(seed + 3, n_layer=1, n_positions=320, vocab_size=300),
            [rng.randrange(300) for _ in range(270)],
            20,
            "the cache holds len(prompt_ids) + max_new_tokens positions",
        ),
        case(
            "a bfloat16 model",
            decisive_model(seed + 4, dtype=torch.bfloat16),
            [random.Random(seed + 4).randrange(V) for _ in range(6)],
            6,
            "make the cache with dtype=model.dtype: a float32 cache cannot take a bfloat16 model's keys",
        ),
    ]
    for i in range(n_random):
        model = decisive_model(seed + 10 + i, n_layer=rng.randint(1, 3), n_head=rng.choice([1, 2, 4]))
        P = rng.randint(1, 30)
        cases.append(
            case(
                f"random #{i}: {model.config.n_layer} layers, a {P}-token prompt",
                model,
                [rng.randrange(V) for _ in range(P)],
                rng.randint(1, 64 - P),
            )
        )
    if bundled:
        cases.append(case("the bundled model, 'ROMEO:'", bundled_model(), get_tokenizer().encode("ROMEO:"), 20))

    def show(args: tuple) -> str:
        model, prompt, n = args
        c = model.config
        what = f"GPT2(n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, {str(model.dtype)[6:]})"
        return f"generate_greedy({what}, prompt_ids={short(prompt, 60)}, max_new_tokens={n}, cache_class=KVCache)"

    run_check(
        "generate_greedy",
        lambda model, prompt_ids, max_new_tokens: _run_loop(fn, model, prompt_ids, max_new_tokens),
        cases,
        judge=_loop_problem,
        forbid=NO_ENGINE_LOOP,
        show_call=show,
        may_modify=["model"],  # the check counts its forward passes (model.blocks, put back after the call)
        seconds=10,
        total_seconds=30,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: decode_step — the bytes and FLOPs of one decode step (the engine's `decode_step`, which chapter
# 06's decode bound runs through `model_decode_step`)

NO_ENGINE_ROOFLINE = [
    Forbidden(
        "llmcourse.engine.roofline.decode_step",
        "llmcourse.engine.roofline.decode_step is the engine's, what yours is compared with: write your own",
    ),
    Forbidden(
        "llmcourse.engine.roofline.max_sequences",
        "llmcourse.engine.roofline.max_sequences is the engine's, what yours is compared with: write your own",
    ),
]
# The formulas are exact: only float rounding separates two correct ways of writing them.
REL_TOL = 1e-9


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0)


def _step_hint(args: tuple, flops: float, nbytes: float) -> str:
    """What mistake gives this (flops, bytes) for decode_step(*args), or ''."""
    n, kv, context, batch, per_weight = args
    weights, cache = n * per_weight, context * kv
    right_flops, right_bytes = 2 * n * batch, weights + batch * cache
    if _close(flops, right_bytes) and _close(nbytes, right_flops) and not _close(flops, nbytes):
        return "return (flops, bytes), in that order"
    if not _close(flops, right_flops):
        for wrong, hint in [
            (n * batch, "a multiply-add is 2 FLOPs: each weight does one multiply and one add per sequence"),
            (2 * n, "every sequence of the batch does the arithmetic: 2 × n_params FLOPs each"),
            (2 * n * batch * per_weight, "FLOPs do not depend on how many bytes a weight takes: 2 per weight"),
            (n, "a multiply-add is 2 FLOPs, and every sequence of the batch does them"),
        ]:
            if _close(flops, wrong):
                return hint
        return "FLOPs: 2 per weight (a multiply and an add) for each sequence of the batch"
    for wrong, hint in [
        (weights, "each sequence also reads its KV cache: context × kv_bytes_per_token bytes"),
        (weights + cache, "every sequence reads its own KV cache: batch × context × kv_bytes_per_token"),
        (batch * (weights + cache), "the weights are read once for the whole batch (the sequences share them)"),
        (batch * weights + cache, "the weights are read once for the whole batch; each sequence reads its cache"),
        (n + batch * cache, "a weight takes bytes_per_weight bytes: n_params × bytes_per_weight"),
        (weights + batch * cache * per_weight, "kv_bytes_per_token is already in bytes"),
        (weights + batch * kv, "each sequence reads the cache of all its context positions: × context"),
        (8 * right_bytes, "bytes, not bits: the sizes are already in bytes"),
        (right_bytes / 8, "bytes, not bits: do not divide by 8"),
        (right_bytes / 1e9, "return bytes (not GB)"),
        (right_bytes / 2**30, "return bytes (not GiB)"),
    ]:
        if _close(nbytes, wrong):
            return hint
    return "bytes: every weight once, plus each sequence's cache of context × kv_bytes_per_token"


def _judge_step(case: Case, got: Any) -> Verdict:
    expected = case.expected
    if isinstance(got, Tensor) or (isinstance(got, (tuple, list)) and any(isinstance(x, Tensor) for x in got)):
        return "expected plain numbers, got a tensor", "use Python numbers (or .item())"
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(_number(x) for x in got):
        return f"expected a pair of numbers (flops, bytes), got {short(got, 80)}", "return flops, nbytes"
    flops, nbytes = (float(x) for x in got)
    if _close(flops, expected[0]) and _close(nbytes, expected[1]):
        return None
    which = "the FLOPs are wrong" if not _close(flops, expected[0]) else "the bytes are wrong"
    return which, (_step_hint(case.args[1:], flops, nbytes) if case.args[0] == "call" else "")


def _run_step(fn: Callable, how: str, *args):
    if how == "call":
        return fn(*args)
    if how == "defaults":  # decode_step(n_params, kv_bytes_per_token, context): batch 1, 2 bytes per weight
        return fn(*args[:3])
    config, context, bytes_per_value, batch = args  # "engine": the engine's GPT-2 step runs yours
    flops, nbytes = model_decode_step(config, context, bytes_per_value, batch, step=guard("decode_step", fn))
    return flops, nbytes


def check_decode_step(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """decode_step(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2) -> (flops, bytes): every
    weight read once for the batch, each sequence's KV cache read for it; 2 FLOPs per weight per sequence. Exact
    up to float rounding (relative 1e-9). Ends with the engine's GPT-2 step (`model_decode_step`, chapter 06's
    decode bound) running the learner's function."""
    if not callable(fn):
        raise CheckFailed(f"✗ decode_step: expected a function, got {short(fn)}")

    def case(description, args, hint="", how="call"):
        full = (*args, 1, 2)[:5] if how == "defaults" else args
        return Case(description, (how, *args), later(engine_decode_step, *full), hint)

    gpt2_kv = 2 * 12 * 12 * 64 * 2  # bytes per position of GPT-2 small's fp16 cache
    llama8_kv, llama70_kv = 2 * 32 * 8 * 128 * 2, 2 * 80 * 8 * 128 * 2
    cases = [
        case("one weight, no cache", (1, 0, 0, 1, 2), "a multiply-add is 2 FLOPs; the weight takes 2 bytes"),
        case("GPT-2 124M, fp16, 1024 cached positions", (124_439_808, gpt2_kv, 1024, 1, 2)),
        case(
            "GPT-2 124M in float32 (4 bytes per weight)",
            (124_439_808, 2 * gpt2_kv, 1024, 1, 4),
            "the weights take bytes_per_weight bytes each",
        ),
        case(
            "Llama-3-8B, 8192 positions, a batch of 32 (the caches outweigh the weights)",
            (8.03e9, llama8_kv, 8192, 32, 2),
            "the weights are read once for the batch, each sequence reads its own cache",
        ),
        case(
            "Llama-3-70B with int4 weights (half a byte), batch 8",
            (70.6e9, llama70_kv, 4096, 8, 0.5),
            "bytes_per_weight may be a fraction",
        ),
        case("a batch of 256, no cache yet", (124_439_808, gpt2_kv, 0, 256, 2)),
        case(
            "decode_step(n_params, kv_bytes_per_token, context): batch 1, fp16", (1_000_000, 4096, 100), how="defaults"
        ),
        case(
            "numpy and float arguments",
            (np.int64(350_000_000), np.float64(98304.0), np.int64(2048), 4, 2.0),
            "any Python number type",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        n = rng.choice([rng.randint(1, 10**6), rng.randint(10**8, 10**11)])
        kv = 2 * rng.randint(1, 96) * rng.choice([1, 2, 8, 16]) * rng.choice([64, 128]) * rng.choice([1, 2])
        args = (n, kv, rng.randint(0, 131072), rng.randint(1, 512), rng.choice([0.5, 1, 2, 4]))
        cases.append(case(f"random #{i}", args))
    cases.append(
        Case(
            "in the engine: GPT-2 124M's step in float32, 8 sequences of 1000 positions (chapter 06's decode bound)",
            ("engine", GPT2Config(), 1000, 4, 8),
            later(model_decode_step, GPT2Config(), 1000, 4, 8),
            "the engine calls decode_step(n_params, kv_bytes_per_token, context, batch, bytes_per_weight) positionally",
        )
    )

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            config, context, per_value, batch = rest
            return (
                f"model_decode_step(GPT2Config(), context={context}, bytes_per_value={per_value}, batch={batch}, "
                f"step=decode_step)  # the engine's GPT-2 step, computed with yours"
            )
        names = ("n_params", "kv_bytes_per_token", "context", "batch", "bytes_per_weight")
        return "decode_step(" + ", ".join(f"{n}={a!r}" for n, a in zip(names, rest)) + ")"

    run_check(
        "decode_step",
        lambda how, *args: _run_step(fn, how, *args),
        cases,
        judge=_judge_step,
        forbid=NO_ENGINE_ROOFLINE,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 5: max_sequences — how many sequences' caches fit next to the weights (the engine's `max_sequences`)


def _fits_hint(args: tuple, got: float) -> str:
    """What mistake gives `got` for max_sequences(*args), or ''."""
    memory, weights, layers, heads, head_dim, context, per_value = (float(a) for a in (*args, 2)[:7])  # default 2
    room, per_sequence = memory - weights, 2 * layers * heads * head_dim * context * per_value
    if room < per_sequence and got < 0:
        return "when the weights leave no room for a whole cache, no sequence fits: return 0, not a negative number"
    if got != math.floor(got):
        return "a sequence's cache fits whole or not at all: round down to a whole number"
    right = max(0, math.floor(room / per_sequence))
    for wrong, hint in [
        (math.ceil(room / per_sequence), "round down: a sequence whose cache does not fit whole does not fit"),
        (round(room / per_sequence), "round down (floor), not to the nearest: a cache fits whole or not at all"),
        (memory // per_sequence, "subtract the weights first: they take weight_bytes of the memory"),
        (room // (per_sequence / 2), "each position stores a key and a value: the factor 2"),
        (room // (per_sequence / layers), "every layer stores its own keys and values: multiply by n_layer"),
        (room // (per_sequence / heads), "every KV head stores its own keys and values: multiply by n_kv_head"),
        (room // (per_sequence / context), "a sequence's cache holds all its context positions: multiply by context"),
        (room // (per_sequence * 8), "bytes, not bits: bytes_per_value is already in bytes"),
        (room // (per_sequence / per_value * 2), "multiply by bytes_per_value (the argument), not by a fixed 2"),
        (room // (per_sequence / per_value), "multiply by bytes_per_value"),
    ]:
        if got == max(0, wrong) and got != right:
            return hint
    return ""


def _judge_fits(case: Case, got: Any) -> Verdict:
    expected = case.expected
    if isinstance(got, Tensor):
        return "expected a Python int, got a tensor", "use Python numbers (or .item())"
    if not _number(got):
        return f"expected a number of sequences (an int), got {short(got, 80)}", ""
    if got == expected:
        return None
    return f"expected {expected} sequences, got {got}", _fits_hint(case.args, float(got))


def check_max_sequences(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2) -> how
    many whole KV caches of `context` positions fit in the memory the weights leave: floor((memory - weights) /
    (2 · n_layer · n_kv_head · head_dim · context · bytes_per_value)), 0 when none fits. An int (or a whole float);
    ends with the engine's own cache for the bundled model's configuration, measured."""
    if not callable(fn):
        raise CheckFailed(f"✗ max_sequences: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, args, later(engine_max_sequences, *args), hint)

    def between(weights, per_sequence, k, fraction):
        """A memory holding the weights and k + fraction caches."""
        return weights + (k + fraction) * per_sequence

    llama8 = 2 * 32 * 8 * 128 * 8192 * 2  # one fp16 cache of Llama-3-8B at 8192 positions
    llama70 = 2 * 80 * 8 * 128 * 8192 * 2
    cases = [
        case("Llama-3-8B (16 GB of fp16 weights) on one 80 GB GPU, 8192 positions", (80e9, 16.06e9, 32, 8, 128, 8192)),
        case("Llama-3-70B on 8 GPUs of 80 GB, 8 KV heads", (640e9, 141.2e9, 80, 8, 128, 8192, 2)),
        case("Llama-3-70B on 8 GPUs of 80 GB if it had 64 KV heads", (640e9, 141.2e9, 80, 64, 128, 8192, 2)),
        case(
            "Llama-3-70B's fp16 weights do not fit in one 80 GB GPU",
            (80e9, 141.2e9, 80, 8, 128, 8192, 2),
            "when the weights alone do not fit, no sequence does: 0",
        ),
        case("the weights fill the memory exactly", (16e9, 16e9, 32, 8, 128, 8192, 2)),
        case(
            "room for 3.9 caches",
            (between(16e9, llama8, 3, 0.9), 16e9, 32, 8, 128, 8192, 2),
            "a cache fits whole or not at all: round down",
        ),
        case("room for exactly 7 caches", (7 * llama8 + 2**34, 2**34, 32, 8, 128, 8192, 2)),
        case(
            "int8 cache (1 byte per value), 4096 positions",
            (between(7e9, llama70 // 4, 12, 0.3), 7e9, 80, 8, 128, 4096, 1),
        ),
        case("a 4-bit cache (half a byte per value)", (24e9, 4.5e9, 32, 8, 128, 32768, 0.5)),
        case("GPT-2 124M in float32 on a 1 GiB budget, 1024 positions", (2**30, 497_759_232, 12, 12, 64, 1024, 4)),
        case("one position per sequence", (1e6, 0, 1, 1, 1, 1, 2), "a key and a value of 2 bytes: 4 bytes"),
        case(
            "max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context): fp16",
            (between(0, 2 * 4 * 2 * 16 * 100 * 2, 9, 0.5), 0, 4, 2, 16, 100),
            "bytes_per_value=2 by default",
        ),
        case(
            "numpy numbers",
            (np.float64(48e9), np.int64(14_000_000_000), np.int64(28), np.int64(4), np.int64(128), np.int64(8192), 2),
            "any Python number type",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        shape = (rng.randint(1, 96), rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([64, 80, 128, 256]))
        context, per_value = rng.randint(1, 131072), rng.choice([0.5, 1, 2, 4])
        per_sequence = 2 * math.prod(shape) * context * per_value
        weights = rng.randint(0, 10**11)
        if rng.random() < 0.15:  # the weights alone overflow the memory
            memory = weights * rng.uniform(0.5, 0.99)
        else:
            memory = between(weights, per_sequence, rng.randint(0, 400), rng.uniform(0.05, 0.95))
        cases.append(case(f"random #{i}", (memory, weights, *shape, context, per_value)))
    # the engine's own cache, measured: the bundled model's configuration, all its positions, float32
    config = GPT2Config(n_layer=6, n_head=6, n_embd=192, n_positions=256)
    cache = EngineKVCache(config, 1, config.n_positions)
    one = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    weights = 4 * sum(p.numel() for p in GPT2(config).parameters())
    cases.append(
        case(
            f"the engine's KVCache for the bundled model (6 layers, 6 heads of 32, 256 positions, float32) holds "
            f"{one:,} bytes: a memory of the weights and 5.5 of them",
            (weights + 5.5 * one, weights, 6, 6, 32, 256, 4),
            "the engine's cache measured: 5 whole caches fit",
        )
    )

    def show(args: tuple) -> str:
        names = ("memory_bytes", "weight_bytes", "n_layer", "n_kv_head", "head_dim", "context", "bytes_per_value")
        return "max_sequences(" + ", ".join(f"{n}={a!r}" for n, a in zip(names, args)) + ")"

    run_check(
        "max_sequences",
        fn,
        cases,
        judge=_judge_fits,
        forbid=NO_ENGINE_ROOFLINE,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )
