"""Grouped-query attention that reads each KV head once (issue 43): `grouped_attention` equals attention on repeated
keys and values, and the engine's Llama prefill and decode (`generate`) and LLMEngine's paged decode never copy a KV
head for its n_rep query heads.

The copies are counted by a TorchDispatchMode that sees every aten operator (`CopyWatch`): the keys and values the
model attends to (and LLMEngine's pools) are marked, views of them stay marked, and an operator that copies marked
data (clone, reshape, index_select, repeat ...) is a duplicate when its output holds some of it more than once: more
elements than the distinct ones its input refers to (an `expand`ed view), or an index naming a row twice. The C decode
kernel (`cpu_kernels.decode_attention`, which reads KV head h // n_rep by address) is switched off under a dispatch
mode, so decode steps take torch's grouped path. `generate` runs under torch.inference_mode, where a composite
operator (scaled_dot_product_attention) is seen whole; the same prefill and decode outside it (torch.no_grad) show
what runs inside: the CPU flash kernel given the H_kv heads (torch's math backend, forced, repeats them for
enable_gqa, and the watch sees it). Each watch is proven to see the old way: `repeat_kv` put back into the model, and
LLMEngine given a kernel of chapter 07's contract (as many KV heads as query heads), which reads each sequence's
blocks once per query head group.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from llmcourse import generate
from llmcourse.checks.harness.forbid import DispatchWatch
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.parts import (
    Parts,
    attention,
    attention_causal_by_default,
    attention_with_softmax,
    grouped_attention,
    repeat_kv,
)
from llmcourse.serving.batching import Batching
from llmcourse.serving.llm_engine import LLMEngine
from llmcourse.serving.paged_cache import paged_attention, paged_attention_fused

COPIES = {"clone", "contiguous", "reshape", "_unsafe_view", "index_select", "index", "gather", "repeat"}
COPIES |= {"repeat_interleave", "expand_copy", "_to_copy", "to", "flatten", "tile", "take", "narrow_copy"}


def distinct(t: torch.Tensor) -> int:
    """The elements of its storage that `t` refers to (an expanded axis, stride 0, refers to one)."""
    return max(1, int(torch.Size(n for n, s in zip(t.shape, t.stride()) if s != 0).numel()))


class CopyWatch(DispatchWatch):
    """Marks key and value tensors (`mark`), follows their views and copies, and records every copy that holds some
    of their elements more than once (`duplicates`: operator, output shape, times), and every operator that read
    them (`reads`)."""

    def __init__(self):
        super().__init__()
        self.kv = WeakIdKeyDictionary()
        self.duplicates: list[tuple[str, tuple, float]] = []
        self.reads: set[str] = set()

    def mark(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.kv[t] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        marked = [a for a in inputs if a in self.kv]
        if not marked:
            return out
        name = func.overloadpacket.__name__
        self.reads.add(name)
        storages = {a.untyped_storage().data_ptr() for a in marked}
        for o in (o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)):
            if o.untyped_storage().data_ptr() in storages:  # a view: still the keys or values themselves
                self.kv[o] = True
            elif name in COPIES:
                source = marked[0]
                times = o.numel() / distinct(source)
                if name in ("index_select", "index"):  # rows picked by an index: a row named twice is read twice
                    index = args[2] if name == "index_select" else next(i for i in args[1] if i is not None)
                    times = index.numel() / max(1, index.unique().numel())
                if times > 1:
                    self.duplicates.append((name, tuple(o.shape), times))
                self.kv[o] = True
        return out


def tiny_gqa(seed: int = 0, **config) -> Llama:
    """n_head 8 over 2 KV heads: n_rep 4."""
    settings = dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=64, intermediate_size=48, vocab_size=61, head_dim=16)
    model = Llama(LlamaConfig(**{**settings, **config})).init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():  # unit-scale weights: tokens that depend on the prompt
            if p.dim() == 2:
                p.mul_(50 / p.shape[1] ** 0.5)
    return model.requires_grad_(False)


def repeating(q, k, v, mask, attention):
    """The old way: every KV head copied for its n_rep query heads."""
    n_rep = q.shape[1] // k.shape[1]
    return attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)


def watched(model: Llama, run) -> tuple[CopyWatch, object]:
    """`run()` under a CopyWatch, with the keys and values each of the model's attentions reads marked."""
    watch, own = CopyWatch(), model.attention

    def marking(q, k, v, mask):
        watch.mark(k, v)
        return own(q, k, v, mask)

    model.attention = marking
    try:
        with watch:
            return watch, run()
    finally:
        del model.attention


def watched_generate(model: Llama, prompts: list[list[int]]) -> tuple[CopyWatch, list]:
    """`generate` (a prefill, then decode steps; under torch.inference_mode, where the watch sees torch's composite
    operators such as scaled_dot_product_attention whole)."""
    return watched(model, lambda: generate(model, prompts, max_new_tokens=4, eos_token_id=None))


def watched_forward(model: Llama, prompts: list[list[int]]) -> tuple[CopyWatch, list]:
    """A padded prefill of `prompts` and three decode steps through the KV cache, outside inference mode: the watch
    sees inside torch's attention (the kernel it picks, or the reference path's own copies)."""
    ids = torch.tensor([[0] * (len(prompts[1]) - len(prompts[0])) + prompts[0], prompts[1]])  # left-padded
    mask = torch.ones(2, ids.shape[1] + 3, dtype=torch.long)
    mask[0, : len(prompts[1]) - len(prompts[0])] = 0

    def run():
        cache, logits = model.new_cache(2, ids.shape[1] + 3), []
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask[:, : ids.shape[1]], cache=cache)[:, -1])
            for step in range(3):
                nxt = logits[-1].argmax(-1, keepdim=True)
                logits.append(model(nxt, attention_mask=mask[:, : ids.shape[1] + step + 1], cache=cache)[:, -1])
        return torch.stack(logits, 1)

    return watched(model, run)


def watched_llm_engine(model: Llama, prompts: list[list[int]], **batching) -> tuple[CopyWatch, list]:
    """LLMEngine on `prompts` (of one length, no shared prefix: every decode step reads the same number of blocks
    of each sequence, so no table is padded) with its pools marked."""
    engine = LLMEngine(model, block_size=4, num_blocks=32, max_num_seqs=4, batching=Batching().replace(**batching))
    watch = CopyWatch()
    watch.mark(*engine.cache.k, *engine.cache.v)
    with watch:
        tokens = engine.generate(prompts, max_new_tokens=6, eos_token_id=None)
    return watch, tokens


PROMPTS = [[5, 17, 3, 60, 2, 9, 33, 1, 4], [41, 8, 8, 12, 50, 1, 0, 44, 23]]


@pytest.mark.parametrize("how", ["generate", "forward"])
def test_llama_prefill_and_decode_read_each_kv_head_once(how):
    model = tiny_gqa()
    run, prompts = (watched_generate, PROMPTS) if how == "generate" else (watched_forward, [PROMPTS[0][:5], PROMPTS[1]])
    watch, out = run(model, prompts)
    kernel = "scaled_dot_product_attention" if how == "generate" else "_scaled_dot_product_flash_attention_for_cpu"
    assert kernel in watch.reads  # the watch sees the attention read the cache
    assert watch.duplicates == []
    if how == "forward":  # torch's reference kernel repeats the KV heads itself (enable_gqa): seen inside attention
        with sdpa_kernel(SDPBackend.MATH):
            assert run(model, prompts)[0].duplicates
    model.parts = Parts().replace(grouped_attention=repeating)
    old, old_out = run(model, prompts)
    if how == "generate":
        assert old_out == out
    else:
        torch.testing.assert_close(old_out, out, atol=1e-5, rtol=1e-5)
    assert old.duplicates and {times for _, _, times in old.duplicates} == {4.0}  # n_rep copies, seen
    assert {torch.Size(shape[1:-2]).numel() for _, shape, _ in old.duplicates} == {8}  # [B, H, Tk, D]: H heads


def test_llm_engines_paged_decode_reads_each_kv_head_once():
    model = tiny_gqa(1)
    watch, tokens = watched_llm_engine(model, PROMPTS)
    assert "index_select" in watch.reads and watch.duplicates == []
    assert tokens == generate(model, PROMPTS, max_new_tokens=6, eos_token_id=None)
    contract_07 = functools.partial(paged_attention_fused)  # not the engine's own: G * n_rep rows of H_kv heads
    old, old_tokens = watched_llm_engine(model, PROMPTS, paged_attention=contract_07)
    assert old_tokens == tokens
    assert old.duplicates and {name for name, _, _ in old.duplicates} == {"index_select"}
    assert {times for _, _, times in old.duplicates} == {4.0}


# -- grouped_attention == attention(q, repeat_kv(k), repeat_kv(v), mask) ----------------------------------------


def plain_attention(q, k, v, mask=None):
    """Chapter 03's attention as a learner writes it, mask None meaning the queries are the last Tq positions."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is None:
        Tq, Tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    return torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype) @ v


ATTENTIONS = {
    "engine": attention,
    "written out": functools.partial(attention_with_softmax, softmax=torch.softmax),
    "a learner's": plain_attention,
    "a learner's, None made causal": functools.partial(attention_causal_by_default, attention=plain_attention),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T, Tk", [(1, 9), (5, 5), (3, 11)], ids=["decode", "prefill", "chunk"])
@pytest.mark.parametrize("mask", [None, "padding", "per head"])
@pytest.mark.parametrize("n_rep", [1, 4])
@pytest.mark.parametrize("which", list(ATTENTIONS))
def test_grouped_attention_equals_attention_on_repeated_kv(dtype, T, Tk, mask, n_rep, which):
    g = torch.Generator().manual_seed(T * 100 + Tk + n_rep)
    B, H_kv, D = 2, 2, 16
    H = H_kv * n_rep
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k, v = torch.randn(2, B, H_kv, Tk, D, generator=g).to(dtype)
    if mask is not None:
        mask = torch.rand(B, 1 if mask == "padding" else H, T, Tk, generator=g) > 0.4
        mask[..., torch.arange(T), Tk - T + torch.arange(T)] = True  # each query sees itself: no empty row
    attend = ATTENTIONS[which]
    got = grouped_attention(q, k, v, mask, attend)
    expected = attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)
    assert got.shape == (B, H, T, D) and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


def test_grouped_attention_passes_the_tiled_causal_mask_and_the_unrepeated_kv():
    seen = {}

    def recording(q, k, v, mask=None):
        seen.update(q=q.shape, k=k.shape, mask=mask)
        return plain_attention(q, k, v, mask)

    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    grouped_attention(q, k, v, None, recording)
    assert seen["q"] == (1, 2, 6, 8) and seen["k"] == (1, 2, 3, 8)  # [B, H_kv, n_rep * T, D]; k as it is
    causal = torch.tensor([[True, True, False], [True, True, True]])  # 2 queries, the last 2 of 3 positions
    assert torch.equal(seen["mask"], causal.repeat(3, 1))


@pytest.mark.parametrize("lengths", [[7, 7], [3, 9, 5]])
def test_paged_attention_reads_gqa_pools(lengths):
    """The engine's paged kernels take pools of H_kv heads under H query heads: as repeated pools would give."""
    g = torch.Generator().manual_seed(len(lengths))
    G, H, H_kv, D, bs = len(lengths), 8, 2, 16, 4
    k_pool, v_pool = torch.randn(2, 12, bs, H_kv, D, generator=g)
    table = torch.randperm(12, generator=g)[: G * 3].view(G, 3)
    q, lengths = torch.randn(G, H, D, generator=g), torch.tensor(lengths)
    repeated = [pool.repeat_interleave(H // H_kv, dim=2) for pool in (k_pool, v_pool)]
    out, lse = paged_attention(q.double(), *(p.double() for p in repeated), table, lengths)
    for attend in (paged_attention, paged_attention_fused):
        got, got_lse = attend(q, k_pool, v_pool, table, lengths)
        torch.testing.assert_close(got, out.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_lse, lse.float(), atol=1e-5, rtol=1e-5)
