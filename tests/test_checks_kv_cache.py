"""Chapter 06's checks: the reference passes, stubs and plausible mistakes fail with a message that says
what is wrong, other correct ways of writing each exercise pass, black boxes are refused; and the
check-side references agree with torch's fused attention and with the engine's generation."""

import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import llmcourse
from llmcourse.checks import CheckFailed
from llmcourse.checks.kv_cache import (
    check_cached_attention,
    check_decode_step,
    check_generate_greedy,
    check_kv_cache,
    check_max_sequences,
    decisive_model,
    full_recompute,
    one_thread,
    recording_cache,
    reference_cached_attention,
    smallest_margin,
)
from llmcourse.engine.model import KVCache as EngineKVCache
from llmcourse.engine.parts import attention

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/06_kv_cache/06_kv_cache.ipynb"


# -- references, written as a learner would ---------------------------------------------------------


class KVCache:
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0
        self.max_len = max_len

    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache is full: {end} > {self.max_len}")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def cached_attention(q, k_cache, v_cache, length):
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


@torch.no_grad()
def generate_greedy(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device, dtype=model.dtype)
    logits = model(torch.tensor([prompt_ids]), cache=cache)[0, -1]
    tokens = [int(logits.argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1].argmax()))
    return tokens


def decode_step(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2):
    return 2 * n_params * batch, n_params * bytes_per_weight + batch * context * kv_bytes_per_token


def max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2):
    per_sequence = 2 * n_layer * n_kv_head * head_dim * context * bytes_per_value
    return max(0, math.floor((memory_bytes - weight_bytes) / per_sequence))


REFERENCES = [
    (check_kv_cache, KVCache, dict(n_random=12)),
    (check_cached_attention, cached_attention, dict(n_random=40)),
    (check_generate_greedy, generate_greedy, dict(n_random=4, bundled=True)),
    (check_decode_step, decode_step, dict(n_random=40)),
    (check_max_sequences, max_sequences, dict(n_random=40)),
]
IDS = [check.__name__ for check, _, _ in REFERENCES]


@pytest.mark.parametrize("check, reference, hidden", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, hidden, capsys):
    check(reference)
    check(reference, seed=101, **hidden)
    assert capsys.readouterr().out.count("✓") == 2


class StubCache:
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        raise NotImplementedError()

    def update(self, layer, k, v):
        raise NotImplementedError()


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "check, fn",
    [
        (check_kv_cache, StubCache),
        (check_cached_attention, stub),
        (check_generate_greedy, stub),
        (check_decode_step, stub),
        (check_max_sequences, stub),
    ],
    ids=IDS,
)
def test_stub_is_not_written_yet(check, fn):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(fn)


def fails(check, fn, pattern, **kwargs):
    with pytest.raises(CheckFailed) as err:
        check(fn, **kwargs)
    assert re.search(pattern, str(err.value), re.S), str(err.value)
    return str(err.value)


# -- KVCache: mistakes ------------------------------------------------------------------------------


class CatCache(KVCache):
    """Grows with torch.cat: nothing preallocated."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.n_head, 0, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length, self.max_len = 0, max_len

    def update(self, layer, k, v):
        self.k[layer] = torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


class CatIntoPreallocated(KVCache):
    """Preallocated, but each update builds a new tensor and assigns it."""

    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError("full")
        rest = self.k[layer][:, :, end:]
        self.k[layer] = torch.cat([self.k[layer][:, :, : self.length], k, rest], dim=2)
        self.v[layer] = torch.cat([self.v[layer][:, :, : self.length], v, self.v[layer][:, :, end:]], dim=2)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class AdvancingCache(KVCache):
    def update(self, layer, k, v):
        keys, values = super().update(layer, k, v)
        self.length += k.shape[2]  # the second layer then writes after the first one's positions
        return keys, values


class WholeBufferCache(KVCache):
    def update(self, layer, k, v):
        super().update(layer, k, v)
        return self.k[layer], self.v[layer]  # attends to max_len - length zeros


class OneLayerTensorCache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        self.k = [torch.zeros_like(self.k[0])] * config.n_layer  # one tensor, n_layer times
        self.v = [torch.zeros_like(self.v[0])] * config.n_layer


class SharedKVCache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        self.v = self.k


class CopyingCache(KVCache):
    def update(self, layer, k, v):
        keys, values = super().update(layer, k, v)
        return keys.clone(), values.clone()


class SilentlyFullCache(KVCache):
    def update(self, layer, k, v):
        room = self.max_len - self.length
        k, v = k[:, :, :room], v[:, :, :room]  # drops what does not fit
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Float32Cache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device)  # ignores dtype


class NoBatchCache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, 1, max_len, device=device, dtype=dtype)


class OffByOneCache(KVCache):
    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, : end - 1], self.v[layer][:, :, : end - 1]


class EngineSubclass(EngineKVCache):
    def update(self, layer, k, v):
        return super().update(layer, k, v)


class TupleLayersCache(KVCache):
    """Layers in tuples: the engine's guard (and beam search) needs lists."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        self.k, self.v = tuple(self.k), tuple(self.v)


class ListReturnCache(KVCache):
    def update(self, layer, k, v):
        return list(super().update(layer, k, v))


class FlatViewCache(KVCache):
    """Writes through .view(): fine on contiguous k and v, not on the model's (split from qkv)."""

    def update(self, layer, k, v):
        B, H, T, D = k.shape
        end = self.length + T
        if end > self.max_len:
            raise ValueError("full")
        self.k[layer][:, :, self.length : end] = k.view(B, H, T * D).view(B, H, T, D)
        self.v[layer][:, :, self.length : end] = v.view(B, H, T * D).view(B, H, T, D)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class ClassAttributeCache(KVCache):
    """Keeps its tensors on the class: a second cache replaces the first one's."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        ClassAttributeCache.k, ClassAttributeCache.v = self.k, self.v
        del self.k, self.v


class OwnCounterCache(KVCache):
    """Counts its own positions instead of reading cache.length: a rollback is ignored."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        self.written, self.n_layer = 0, config.n_layer

    def update(self, layer, k, v):
        start, end = self.written, self.written + k.shape[2]
        if end > self.max_len:
            raise ValueError("full")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        if layer == self.n_layer - 1:
            self.written = end
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Uint8LengthCache(KVCache):
    """The length in a uint8 tensor: wraps past position 255."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        self.length = torch.tensor(0, dtype=torch.uint8)


class QueryHeadsCache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):  # n_head, not n_kv_head
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)
        shape = (batch_size, config.n_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]


class CpuCache(KVCache):
    """Made on the default device (the CPU) whatever device the model passes."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device=None, dtype=dtype)


class CpuIndexCache(KVCache):
    """Writes with index_copy_ through an index made on the CPU: a cache on a GPU refuses it."""

    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError("full")
        where = torch.arange(self.length, end)
        self.k[layer].index_copy_(2, where, k)
        self.v[layer].index_copy_(2, where, v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class HalfByDefaultCache(KVCache):
    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float16):  # a wrong default
        super().__init__(config, batch_size, max_len, device=device, dtype=dtype)


KV_CACHE_MISTAKES = [
    (CatCache, r"has shape \(1, 1?2?, 0, 4\).*preallocate all max_len positions"),
    (CatIntoPreallocated, r"replaced cache\.k\[0\] by a new tensor.*write in place"),
    (AdvancingCache, r"changed cache\.length from 0 to 3.*must not advance length"),
    (WholeBufferCache, r"returned keys of shape \(1, 2, 5, 4\), expected \(1, 2, 3, 4\).*return only the filled"),
    (OneLayerTensorCache, r"cache\.k\[0\] and cache\.k\[1\] are the same tensor"),
    (SharedKVCache, r"cache\.k\[0\] and cache\.v\[0\] are the same tensor"),
    (CopyingCache, r"returned copies, not views"),
    (SilentlyFullCache, r"writes past max_len = 4 and was not refused.*raise an error"),
    (Float32Cache, r"has dtype torch\.float32, expected torch\.float64"),
    (NoBatchCache, r"has shape \(1, 3, 7, 4\), expected .* \(2, 3, 7, 4\)"),
    (OffByOneCache, r"returned keys of shape \(1, 2, 2, 4\), expected \(1, 2, 3, 4\)"),
    (EngineSubclass, r"llmcourse\.engine\.model\.KVCache.*write your own"),
    (TupleLayersCache, r"cache\.k is a tuple: make it a list"),
    (ListReturnCache, r"returned a list \[keys, values\], expected a tuple"),
    (FlatViewCache, r"view size is not compatible.*hint: k and v are views split from the qkv projection"),
    (ClassAttributeCache, r"after a second KVCache was made.*not on the class"),
    (OwnCounterCache, r"rolled back.*write at cache\.length"),
    (Uint8LengthCache, r"past position 255.*uint8"),
    (HalfByDefaultCache, r"without dtype makes float32 tensors"),
    (QueryHeadsCache, r"grouped-query attention.*has shape \(1, 4, 6, 4\).*store config\.n_kv_head heads"),
    (CpuCache, r"device='meta'.*cache\.k\[0\] was made on cpu, not on the device asked for \(meta\).*device=device"),
    (CpuIndexCache, r"device='meta'.*raised RuntimeError: index_copy.*same device.*an index \(torch\.arange\) too"),
]


@pytest.mark.parametrize("cls, pattern", KV_CACHE_MISTAKES, ids=[c.__name__ for c, _ in KV_CACHE_MISTAKES])
def test_kv_cache_mistakes_are_named(cls, pattern):
    fails(check_kv_cache, cls, pattern)


class OneBlockCache:
    """Correct, written differently: one tensor for everything, k and v views of it; index_copy_; max_len a property."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        self.kv = torch.zeros(
            config.n_layer, 2, batch_size, config.n_kv_head, max_len, config.head_dim, device=device, dtype=dtype
        )
        self.k = [self.kv[i, 0] for i in range(config.n_layer)]
        self.v = [self.kv[i, 1] for i in range(config.n_layer)]
        self.length = 0

    @property
    def max_len(self):
        return self.kv.shape[4]

    def update(self, layer, k, v):
        T = k.shape[2]
        if self.length + T > self.max_len:
            raise IndexError("no room left in the cache")
        where = torch.arange(self.length, self.length + T, device=k.device)
        self.k[layer].index_copy_(2, where, k)
        self.v[layer].index_copy_(2, where, v)
        return self.k[layer].narrow(2, 0, self.length + T), self.v[layer].narrow(2, 0, self.length + T)


class KeysValues(NamedTuple):
    keys: torch.Tensor
    values: torch.Tensor


class PositionMajorCache:
    """Correct, written differently: storage [B, max_len, H, D] (position-major, as a paged pool), k and v its
    transposed views; the length a numpy integer; update returns a NamedTuple."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        shape = (batch_size, max_len, config.n_kv_head, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype).transpose(1, 2) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype).transpose(1, 2) for _ in range(config.n_layer)]
        self.length, self.max_len = np.int64(0), max_len

    def update(self, layer, k, v):
        start, end = int(self.length), int(self.length) + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"{end} positions do not fit in {self.max_len}")
        self.k[layer][:, :, start:end].copy_(k)
        self.v[layer][:, :, start:end].copy_(v)
        return KeysValues(self.k[layer][:, :, :end], self.v[layer][:, :, :end])


class MovedToDeviceCache(KVCache):
    """Correct, written differently: made in the default dtype on the CPU, then moved with .to(device, dtype)."""

    def __init__(self, config, batch_size, max_len, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape).to(device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape).to(device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length, self.max_len = 0, max_len


@pytest.mark.parametrize("cls", [OneBlockCache, PositionMajorCache, MovedToDeviceCache])
def test_kv_cache_alternative_passes(cls, capsys):
    check_kv_cache(cls)
    check_kv_cache(cls, seed=101, n_random=12)
    assert capsys.readouterr().out.count("✓") == 2


def test_kv_cache_that_raises_or_hangs_gets_a_clear_message():
    class Raising(KVCache):
        def update(self, layer, k, v):
            return self.k[layer][:, :, self.length + k.shape[2]] + k  # an index, not a slice

    fails(check_kv_cache, Raising, r"raised RuntimeError.*at line \d+ in update")

    class Hanging(KVCache):
        def update(self, layer, k, v):
            while True:
                pass

    fails(check_kv_cache, Hanging, r"did not finish within its \d+ CPU-s")
    fails(check_kv_cache, lambda *a: None, r"expected a class")


# -- cached_attention: mistakes ---------------------------------------------------------------------


def attention_all_positions(q, k_cache, v_cache, length):
    return torch.softmax(q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v_cache


def attention_one_short(q, k_cache, v_cache, length):
    return cached_attention(q, k_cache, v_cache, length - 1)


def attention_no_scale(q, k_cache, v_cache, length):
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def attention_unstable(q, k_cache, v_cache, length):
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    e = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))  # overflows for large scores
    return e / e.sum(-1, keepdim=True) @ v


def attention_zeroing_stale_positions(q, k_cache, v_cache, length):
    k_cache[:, :, length:] = 0  # the caller's cache
    v_cache[:, :, length:] = 0
    return cached_attention(q, k_cache, v_cache, length)


def attention_in_float32(q, k_cache, v_cache, length):
    return cached_attention(q.float(), k_cache.float(), v_cache.float(), length).to(q.dtype)


def attention_first_row(q, k_cache, v_cache, length):
    k, v = k_cache[0, :, :length], v_cache[0, :, :length]  # batch row 0 for everyone
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_fused(q, k_cache, v_cache, length):
    return F.scaled_dot_product_attention(q, k_cache[:, :, :length], v_cache[:, :, :length])


def attention_engine(q, k_cache, v_cache, length):
    return attention(q, k_cache[:, :, :length], v_cache[:, :, :length])


CACHED_ATTENTION_MISTAKES = [
    (attention_all_positions, r"attend to the first `length` positions only"),
    (attention_one_short, r"off by one: the new token's own key is already in the cache"),
    (attention_no_scale, r"divide the scores by √D"),
    (attention_unstable, r"got nan or inf.*subtract each row's max score"),
    (attention_zeroing_stale_positions, r"changed its input `k_cache`.*in-place operation"),
    (attention_in_float32, r"float32 accuracy"),
    (attention_first_row, r"the cache is full.*the values differ"),
    (attention_fused, r"scaled_dot_product_attention is the black box"),
    (attention_engine, r"engine's attention is the black box"),
]


@pytest.mark.parametrize(
    "fn, pattern", CACHED_ATTENTION_MISTAKES, ids=[f.__name__ for f, _ in CACHED_ATTENTION_MISTAKES]
)
def test_cached_attention_mistakes_are_named(fn, pattern):
    fails(check_cached_attention, fn, pattern)


def cached_attention_einsum(q, k_cache, v_cache, length):
    k, v = k_cache.narrow(2, 0, length), v_cache.narrow(2, 0, length)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdim=True), v)


def cached_attention_float32_for_half(q, k_cache, v_cache, length):
    """Correct, written differently: half-precision inputs computed in float32 and rounded back."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    wide = [t.float() if half else t for t in (q, k_cache, v_cache)]
    return cached_attention(*wide, length).to(q.dtype)


@pytest.mark.parametrize("fn", [cached_attention_einsum, cached_attention_float32_for_half])
def test_cached_attention_alternative_passes(fn, capsys):
    check_cached_attention(fn)
    check_cached_attention(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_reference_cached_attention_is_the_last_row_of_fused_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1:]
    cache = torch.randn(2, 2, 3, 20, 16, generator=g, dtype=torch.float64)
    cache[0, :, :, :9], cache[1, :, :, :9] = k, v
    assert torch.allclose(reference_cached_attention(q[:, :, -1:], cache[0], cache[1], 9), fused, atol=1e-12)


# -- generate_greedy: mistakes ----------------------------------------------------------------------


def new_cache(model, cache_class, size):
    return cache_class(model.config, 1, size, device=model.device, dtype=model.dtype)


@torch.no_grad()
def loop_forgets_last_prompt_token(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = new_cache(model, cache_class, len(prompt_ids) + max_new_tokens)
    logits = model(torch.tensor([prompt_ids[:-1]]), cache=cache)[0, -1] if len(prompt_ids) > 1 else None
    token = prompt_ids[-1] if logits is None else int(logits.argmax())
    tokens = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([[token]]), cache=cache)[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
    return tokens


@torch.no_grad()
def loop_refeeds_everything(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = new_cache(model, cache_class, 4 * (len(prompt_ids) + max_new_tokens) ** 2)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids]), cache=cache)[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@torch.no_grad()
def loop_new_cache_each_step(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        cache = new_cache(model, cache_class, len(ids))
        ids.append(int(model(torch.tensor([ids]), cache=cache)[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@torch.no_grad()
def loop_one_token_too_many(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = new_cache(model, cache_class, len(prompt_ids) + max_new_tokens + 1)
    logits = model(torch.tensor([prompt_ids]), cache=cache)[0, -1]
    tokens = [int(logits.argmax())]
    for _ in range(max_new_tokens):
        tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1].argmax()))
    return tokens


@torch.no_grad()
def loop_without_cache(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    return full_recompute(model, prompt_ids, max_new_tokens)


@torch.no_grad()
def loop_float32_cache(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device)  # default dtype
    logits = model(torch.tensor([prompt_ids]), cache=cache)[0, -1]
    tokens = [int(logits.argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1].argmax()))
    return tokens


@torch.no_grad()
def loop_feeds_the_prompt_token(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    cache = new_cache(model, cache_class, len(prompt_ids) + max_new_tokens)
    logits = model(torch.tensor([prompt_ids]), cache=cache)[0, -1]
    tokens = [int(logits.argmax())]
    while len(tokens) < max_new_tokens:
        logits = model(torch.tensor([[prompt_ids[-1]]]), cache=cache)[0, -1]  # not the token just chosen
        tokens.append(int(logits.argmax()))
    return tokens


def loop_returns_tensor(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    return torch.tensor(generate_greedy(model, prompt_ids, max_new_tokens, cache_class))


def loop_engine(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    return llmcourse.generate(model, prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=None)


@torch.no_grad()
def loop_checks_with_full_recompute(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """A cached loop that takes each token from a full recompute of the whole sequence."""
    cache = new_cache(model, cache_class, len(prompt_ids) + max_new_tokens)
    model(torch.tensor([prompt_ids]), cache=cache)
    ids = list(prompt_ids)
    ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    while len(ids) < len(prompt_ids) + max_new_tokens:
        model(torch.tensor([ids[-1:]]), cache=cache)
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids) :]


REMEMBERED = {}


def loop_remembers_answers(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Keeps its answers by (prompt, length): the model is not part of the key."""
    key = (tuple(prompt_ids), max_new_tokens)
    if key not in REMEMBERED:
        REMEMBERED[key] = generate_greedy(model, prompt_ids, max_new_tokens, cache_class)
    return REMEMBERED[key]


@torch.no_grad()
def loop_cache_of_256(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """A cache of a fixed 256 positions."""
    cache = new_cache(model, cache_class, 256)
    tokens = [int(model(torch.tensor([prompt_ids]), cache=cache)[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(model(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1].argmax()))
    return tokens


@torch.no_grad()
def loop_feeds_last_token_back(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Feeds every token it chooses back, the last one too: one forward pass too many (its logits unused)."""
    cache = new_cache(model, cache_class, len(prompt_ids) + max_new_tokens)
    logits = model(torch.tensor([prompt_ids]), cache=cache)[0, -1]
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens


@torch.no_grad()
def loop_cache_without_device(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Right on a CPU; on a GPU the cache (on the default device) could not take the model's keys."""
    cache = cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, dtype=model.dtype)
    return generate_greedy(model, prompt_ids, max_new_tokens, lambda *args, **kwargs: cache)


@torch.no_grad()
def loop_appends_to_prompt_ids(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Grows the caller's list of prompt ids as it generates."""
    ids = prompt_ids
    cache = new_cache(model, cache_class, len(ids) + max_new_tokens)
    logits = model(torch.tensor([ids]), cache=cache)[0, -1]
    start = len(ids)
    while True:
        ids.append(int(logits.argmax()))
        if len(ids) - start == max_new_tokens:
            return ids[start:]
        logits = model(torch.tensor([ids[-1:]]), cache=cache)[0, -1]


LOOP_MISTAKES = [
    (
        loop_feeds_last_token_back,
        r"a one-token prompt, one new token.*2 forward passes with the cache \(the prefill and 1 decode step\) "
        r"for 1 new token; it takes exactly 1 forward pass, the prefill and 0 decode steps.*never fed back",
    ),
    (loop_cache_without_device, r"the cache was made without a device; the model is on cpu.*device=model\.device"),
    (loop_appends_to_prompt_ids, r"changed its input `prompt_ids`.*build a new list"),
    (
        loop_checks_with_full_recompute,
        r"a one-token prompt, one new token: the model computed 2 positions for a 1-token prompt and 1 new token; "
        r"a cached loop computes 1.*full recompute",
    ),
    (loop_remembers_answers, r"nothing kept from an earlier call.*made no cache"),
    (loop_cache_of_256, r"cache is full.*max_len is 256"),
    (loop_forgets_last_prompt_token, r"the prefill put \d+ of the \d+ prompt tokens in the cache"),
    (loop_refeeds_everything, r"each decode step should feed one token.*writes its positions twice"),
    (loop_new_cache_each_step, r"the loop made \d+ caches; one is enough"),
    (loop_one_token_too_many, r"expected 1 new tokens, got 2.*max_new_tokens counts the generated tokens"),
    (loop_without_cache, r"made no cache with cache_class"),
    (loop_float32_cache, r"make the cache with dtype=model\.dtype"),
    (loop_feeds_the_prompt_token, r"token \d differs from the full recompute's.*feeds the token just chosen"),
    (loop_returns_tensor, r"got a tensor.*tolist"),
    (loop_engine, r"engine's generation loop is what yours is compared with"),
]


@pytest.mark.parametrize("fn, pattern", LOOP_MISTAKES, ids=[f.__name__ for f, _ in LOOP_MISTAKES])
def test_generate_greedy_mistakes_are_named(fn, pattern):
    REMEMBERED.clear()
    fails(check_generate_greedy, fn, pattern)


@torch.inference_mode()
def generate_greedy_feeds_last_token(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Correct, written differently: each pass's argmax is the next one's input (n passes for n tokens), last_only
    logits."""
    cache = cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device, dtype=model.dtype)
    ids = torch.tensor([prompt_ids])
    tokens = []
    for _ in range(max_new_tokens):
        ids = model(ids, cache=cache, last_only=True).argmax(-1)  # [1, 1]
        tokens.append(ids.item())
    return tokens


@torch.no_grad()
def generate_greedy_numpy(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Correct, written differently: float64 logits argmaxed by numpy (numpy.int64 tokens), ids grown in a tensor."""
    cache = cache_class(model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device, dtype=model.dtype)
    feed, tokens = torch.as_tensor(np.array([prompt_ids])), []
    for _ in range(max_new_tokens):
        logits = model.forward(feed, cache=cache)[0, -1].double().numpy()
        tokens.append(np.argmax(logits))
        feed = torch.tensor([[int(tokens[-1])]])
        if len(tokens) == max_new_tokens:
            break
    return tokens


@torch.no_grad()
def generate_greedy_device_of_the_ids(model, prompt_ids, max_new_tokens, cache_class=KVCache):
    """Correct, written differently: the ids made on the model's device first, the cache on theirs; a for loop
    that stops before feeding the last token."""
    ids = torch.tensor([prompt_ids], device=model.device)
    cache = cache_class(model.config, 1, ids.shape[1] + max_new_tokens, device=ids.device, dtype=model.dtype)
    logits, tokens = model(ids, cache=cache), []
    for step in range(max_new_tokens):
        tokens.append(logits[0, -1].argmax().item())
        if step < max_new_tokens - 1:
            logits = model(torch.tensor([[tokens[-1]]], device=ids.device), cache=cache)
    return tokens


@pytest.mark.parametrize(
    "fn", [generate_greedy_feeds_last_token, generate_greedy_numpy, generate_greedy_device_of_the_ids]
)
def test_generate_greedy_alternative_passes(fn, capsys):
    check_generate_greedy(fn)
    check_generate_greedy(fn, seed=101, n_random=4)
    assert capsys.readouterr().out.count("✓") == 2


def test_check_models_continue_in_varied_and_decisive_ways():
    """Tokens that vary (a model that repeats its input would let a loop that feeds the wrong token pass), and
    a clear best token at most steps (the check keeps only prompts where every step's gap is >= 2e-3)."""
    with one_thread():
        decisive = 0
        for seed in range(8):
            model = decisive_model(seed, n_layer=1 + seed % 3)
            prompt = [(7 * seed + 13 * i) % 97 for i in range(1 + seed * 3)]
            tokens = full_recompute(model, prompt, 30)
            assert len(set(tokens)) >= 5, tokens
            decisive += smallest_margin(model, prompt, tokens) >= 2e-3
            assert tokens == llmcourse.generate(model, prompt, max_new_tokens=30, eos_token_id=None)
        assert decisive >= 4


def test_full_recompute_equals_the_engine_and_the_cache_records_its_use():
    with one_thread():
        model = decisive_model(5, n_layer=3)
        prompt = [3, 1, 4, 1, 5]
        assert full_recompute(model, prompt, 12) == llmcourse.generate(
            model, prompt, max_new_tokens=12, eos_token_id=None
        )
        cache_class = recording_cache()
        generate_greedy(model, prompt, 4, cache_class)
        assert len(cache_class.made) == 1 and cache_class.made[0].writes == [(0, 5), (5, 1), (6, 1), (7, 1)]


# -- decode_step: mistakes --------------------------------------------------------------------------


def _step(flops, nbytes):
    """A decode_step made of two formulas of (n, kv, context, batch, per_weight)."""

    def decode_step(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2):
        args = (n_params, kv_bytes_per_token, context, batch, bytes_per_weight)
        return flops(*args), nbytes(*args)

    return decode_step


def RIGHT_FLOPS(n, kv, t, b, w):
    return 2 * n * b


def RIGHT_BYTES(n, kv, t, b, w):
    return n * w + b * t * kv


STEP_MISTAKES = {
    "no_kv_cache": (_step(RIGHT_FLOPS, lambda n, kv, t, b, w: n * w), r"each sequence also reads its KV cache"),
    "multiply_add_is_1_flop": (_step(lambda n, kv, t, b, w: n * b, RIGHT_BYTES), r"a multiply-add is 2 FLOPs"),
    "kv_cache_once": (
        _step(RIGHT_FLOPS, lambda n, kv, t, b, w: n * w + t * kv),
        r"every sequence reads its own KV cache",
    ),
    "weights_per_sequence": (
        _step(RIGHT_FLOPS, lambda n, kv, t, b, w: b * (n * w + t * kv)),
        r"the weights are read once for the whole batch",
    ),
    "flops_without_batch": (_step(lambda n, kv, t, b, w: 2 * n, RIGHT_BYTES), r"every sequence of the batch does"),
    "bits": (_step(RIGHT_FLOPS, lambda n, kv, t, b, w: 8 * (n * w + b * t * kv)), r"bytes, not bits"),
    "gib": (_step(RIGHT_FLOPS, lambda n, kv, t, b, w: (n * w + b * t * kv) / 2**30), r"return bytes \(not GiB\)"),
    "weights_as_one_byte": (_step(RIGHT_FLOPS, lambda n, kv, t, b, w: n + b * t * kv), r"n_params × bytes_per_weight"),
    "swapped": (_step(RIGHT_BYTES, RIGHT_FLOPS), r"return \(flops, bytes\), in that order"),
    "kv_times_bytes_per_weight": (
        _step(RIGHT_FLOPS, lambda n, kv, t, b, w: n * w + b * t * kv * w),
        r"kv_bytes_per_token is already in bytes",
    ),
}


@pytest.mark.parametrize("fn, pattern", STEP_MISTAKES.values(), ids=STEP_MISTAKES)
def test_decode_step_mistakes_are_named(fn, pattern):
    fails(check_decode_step, fn, pattern)


def test_decode_step_messages_show_input_expected_got():
    message = fails(check_decode_step, STEP_MISTAKES["no_kv_cache"][0], "")
    assert re.search(r"input:    decode_step\(n_params=\d+, kv_bytes_per_token=\d+, context=\d+", message), message
    shown = re.search(r"expected: \((\d+), (\d+)\)\n  got:      \((\d+), (\d+)\)", message)  # at its smallest
    assert shown and shown[1] == shown[3] and shown[2] != shown[4], message  # the FLOPs right, the bytes not


def test_decode_step_alternatives_pass(capsys):
    def as_list_of_numpy(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2):
        weights = np.float64(n_params) * bytes_per_weight
        caches = sum(context * kv_bytes_per_token for _ in range(batch))
        return [np.float64(2.0) * n_params * batch, weights + caches]

    def fractions(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2):
        from fractions import Fraction  # a learner's exact arithmetic

        per_sequence = Fraction(context) * Fraction(kv_bytes_per_token)
        return Fraction(n_params) * 2 * batch, Fraction(n_params) * Fraction(bytes_per_weight) + batch * per_sequence

    check_decode_step(as_list_of_numpy)
    check_decode_step(fractions, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_decode_step_refuses_the_engines_own():
    from llmcourse.engine.roofline import decode_step as engines

    fails(check_decode_step, lambda *args: engines(*args), r"write your own")


def test_decode_step_runs_in_the_engines_gpt2_step():
    """The last case is the benchmarks' `model_decode_step` calling the learner's function (through its guard):
    a function wrong only for the weights the engine passes (GPT-2 small without its position table) fails there."""
    engines_weights = 124_439_808 - 1024 * 768

    def wrong_in_the_engine(*args):
        return (1.0, 1.0) if args[0] == engines_weights else decode_step(*args)

    fails(check_decode_step, wrong_in_the_engine, r"in the engine: GPT-2 124M's step.*step=decode_step")


# -- max_sequences: mistakes -------------------------------------------------------------------------


def _fits(count):
    """A max_sequences made of a formula of (room, per_sequence, memory, L, H, D, T, bytes)."""

    def max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2):
        per = 2 * n_layer * n_kv_head * head_dim * context * bytes_per_value
        room = memory_bytes - weight_bytes
        return count(room, per, memory_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value)

    return max_sequences


FITS_MISTAKES = {
    "weights_not_subtracted": (_fits(lambda r, p, m, *_: int(m // p)), r"subtract the weights"),
    "k_only": (_fits(lambda r, p, *_: max(0, int(r // (p / 2)))), r"a key and a value: the factor 2"),
    "rounded_up": (_fits(lambda r, p, *_: max(0, math.ceil(r / p))), r"round down"),
    "rounded_to_nearest": (_fits(lambda r, p, *_: max(0, round(r / p))), r"round down"),
    "not_rounded": (_fits(lambda r, p, *_: max(0.0, r / p)), r"fits whole or not at all: round down"),
    "no_layers": (_fits(lambda r, p, m, L, *_: max(0, int(r // (p / L)))), r"multiply by n_layer"),
    "negative": (_fits(lambda r, p, *_: math.floor(r / p)), r"return 0, not a negative number"),
    "bits": (_fits(lambda r, p, *_: max(0, int(r // (8 * p)))), r"bytes, not bits"),
    "fixed_fp16": (_fits(lambda r, p, m, L, H, D, T, bpv: max(0, int(r // (p / bpv * 2)))), r"not by a fixed 2"),
}


@pytest.mark.parametrize("fn, pattern", FITS_MISTAKES.values(), ids=FITS_MISTAKES)
def test_max_sequences_mistakes_are_named(fn, pattern):
    fails(check_max_sequences, fn, pattern)


def test_max_sequences_alternatives_pass(capsys):
    def by_loop(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2):
        per_token = 2 * n_layer * n_kv_head * head_dim * bytes_per_value
        free = memory_bytes - weight_bytes
        return int(free // (per_token * context)) if free > 0 else 0

    def whole_float(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2):
        per = np.float64(2.0) * n_layer * n_kv_head * head_dim * context * bytes_per_value
        return max(np.float64(0.0), np.floor((memory_bytes - weight_bytes) / per))

    check_max_sequences(by_loop)
    check_max_sequences(whole_float, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_max_sequences_refuses_the_engines_own():
    from llmcourse.engine.roofline import max_sequences as engines

    fails(check_max_sequences, lambda *args: engines(*args), r"write your own")


def test_max_sequences_matches_the_engine_cache():
    config = llmcourse.GPT2Config(n_layer=3, n_head=4, n_embd=32)
    cache = EngineKVCache(config, 1, 10, dtype=torch.float16)
    size = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert max_sequences(1000 + 7 * size + size - 1, 1000, 3, 4, 8, 10) == 7


def test_the_engines_gpt2_step_runs_the_decode_step_it_is_given():
    from llmcourse.engine.roofline import model_decode_step

    config = llmcourse.GPT2Config()
    calls = []

    def recording(*args):
        calls.append(args)
        return decode_step(*args)

    assert model_decode_step(config, 100, 4, 3, step=recording) == model_decode_step(config, 100, 4, 3)
    n, kv, context, batch, per_weight = calls[0]
    assert (kv, context, batch, per_weight) == (2 * 12 * 768 * 4, 100, 3, 4)
    assert n == 124_439_808 - 1024 * 768  # all of GPT-2 small but its position table, of which a step reads a row


# -- the references against transformers --------------------------------------------------------------


def test_full_recompute_and_the_cache_agree_with_transformers():
    """transformers' greedy generate (with its own KV cache) gives the full recompute's tokens on the bundled
    model, and its cached keys and values after the prompt are the engine cache's."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from llmcourse.engine.loading import MODELS_DIR

    hf_logging.set_verbosity_error()
    folder = MODELS_DIR / "gpt2-shakespeare"
    with one_thread(), torch.no_grad():
        hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
        model = llmcourse.load_model("gpt2-shakespeare", device="cpu")
        prompt = llmcourse.get_tokenizer().encode("ROMEO:\nWhat light")
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False, pad_token_id=0)
        assert out[0, len(prompt) :].tolist() == full_recompute(model, prompt, 15)
        past = hf(torch.tensor([prompt]), use_cache=True).past_key_values
        cache = model.new_cache(1, len(prompt))
        model(torch.tensor([prompt]), cache=cache)
        for layer in range(model.config.n_layer):
            k, v = past[layer][:2] if isinstance(past, tuple) else (past.layers[layer].keys, past.layers[layer].values)
            assert torch.allclose(cache.k[layer], k, atol=1e-5) and torch.allclose(cache.v[layer], v, atol=1e-5)
