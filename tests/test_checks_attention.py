"""Chapter 03's checks: references pass, stubs and plausible mistakes fail with a message that names the
mistake, other correct ways of writing each exercise pass, black boxes are refused however reached,
and bugs that show only for batch > 1, for a padding mask or for float64 are caught."""

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa_imported_early

import llmcourse.engine.parts
from llmcourse.checks import CheckFailed
from llmcourse.checks.attention import (
    check_attention,
    check_causal_mask,
    check_merge_attention,
    check_merge_heads,
    check_self_attention,
    check_softmax,
    check_split_heads,
    check_tiled_attention,
    large_exact_scores,
    reference_self_attention,
)
from llmcourse.engine import tiled_attention as engine_tiled_module
from llmcourse.engine.parts import softmax as engine_softmax_imported_early

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "solutions" / "03_attention" / "03_attention.ipynb"


# -- references, written as a learner would ------------------------------------------------------


def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def causal_mask(n_query, n_key):
    return torch.arange(n_key)[None, :] <= torch.arange(n_key - n_query, n_key)[:, None]


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores) @ v


def split_heads(x, n_head):
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x):
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def self_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    return merge_heads(attention(q, k, v, causal_mask(T, T))) @ c_proj_weight + c_proj_bias


def tiled_attention(q, k, v, block_size=64, causal=True, *, rescale=True, with_max=True, offset=True, shift=True):
    """Query blocks outside, key blocks inside (FlashAttention-2's order); the keywords make the known mistakes."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for q0 in range(0, Tq, block_size):
        qb = q[:, :, q0 : q0 + block_size]
        query_pos = (Tk - Tq if offset else 0) + q0 + torch.arange(qb.shape[-2])
        m = torch.full((*qb.shape[:-1], 1), -math.inf if shift else 0.0, dtype=q.dtype)
        l = torch.zeros(*qb.shape[:-1], 1, dtype=q.dtype)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype)
        for k0 in range(0, Tk, block_size):
            s = qb @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) / math.sqrt(q.shape[-1])
            if causal:
                s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > query_pos[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True)) if shift else m
            scale = torch.exp(m - m_new).nan_to_num(0.0) if rescale else torch.ones_like(m)
            p = torch.exp(s - m_new).nan_to_num(0.0, posinf=math.inf)  # 0 for a block entirely in a row's future
            l, acc, m = l * scale + p.sum(-1, keepdim=True), acc * scale + p @ v[:, :, k0 : k0 + block_size], m_new
        outs.append(acc / l)
        lses.append(((m if with_max else 0) + torch.log(l)).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def merge_attention(out1, lse1, out2, lse2):
    """The weights exp(lse_i - lse) from the larger lse; a part without keys (lse -inf) weighs nothing."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(m.isinf(), torch.zeros_like(m), m)  # both -inf: any finite shift
    e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    lse = m + torch.log(e1 + e2)
    w1, w2 = (e1 / (e1 + e2)).unsqueeze(-1), (e2 / (e1 + e2)).unsqueeze(-1)
    out = torch.where(w1 > 0, w1 * out1, 0.0) + torch.where(w2 > 0, w2 * out2, 0.0)
    return out, lse


REFERENCES = [
    (check_softmax, softmax),
    (check_causal_mask, causal_mask),
    (check_attention, attention),
    (check_split_heads, split_heads),
    (check_merge_heads, merge_heads),
    (check_self_attention, self_attention),
    (check_tiled_attention, tiled_attention),
    (check_merge_attention, merge_attention),
]
IDS = [check.__name__ for check, _ in REFERENCES]


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, capsys):
    check(reference)
    check(reference, seed=7, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_tiled_reference_passes_the_long_case(capsys):
    check_tiled_attention(tiled_attention, n_random=0, long=True)
    assert "✓ tiled_attention" in capsys.readouterr().out


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_stub_is_not_written_yet(check, reference):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


# -- plausible mistakes, each rejected with a message that names it -------------------------------


def softmax_without_max_shift(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


def softmax_minus_mean(x, dim=-1):
    e = torch.exp(x - x.mean(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def softmax_minus_min(x, dim=-1):
    e = torch.exp(x - x.amin(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def softmax_global_max(x, dim=-1):
    e = torch.exp(x - x.max())
    return e / e.sum(dim, keepdim=True)


def softmax_last_dim_only(x, dim=-1):
    return softmax(x, -1)


def softmax_in_float32(x, dim=-1):
    return softmax(x.float(), dim).to(x.dtype)


def softmax_without_keepdim(x, dim=-1):
    e = torch.exp(x - x.amax(dim).unsqueeze(-1))  # right only when dim is the last one
    return e / e.sum(dim).unsqueeze(-1)


def causal_mask_strict(n_query, n_key):
    return torch.arange(n_key)[None, :] < torch.arange(n_key - n_query, n_key)[:, None]


def causal_mask_upper(n_query, n_key):
    return torch.arange(n_key)[None, :] >= torch.arange(n_key - n_query, n_key)[:, None]


def causal_mask_float(n_query, n_key):
    return causal_mask(n_query, n_key).float()


def causal_mask_without_offset(n_query, n_key):
    return torch.ones(n_query, n_key, dtype=torch.bool).tril()


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def attention_scaled_by_d(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.shape[-1]
    return softmax(scores if mask is None else scores.masked_fill(~mask, -math.inf)) @ v


def attention_unscaled(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    return softmax(scores if mask is None else scores.masked_fill(~mask, -math.inf)) @ v


def attention_mask_inverted(q, k, v, mask=None):
    scores = _scores(q, k)
    return softmax(scores if mask is None else scores.masked_fill(mask, -math.inf)) @ v


def attention_mask_after_softmax(q, k, v, mask=None):
    probs = softmax(_scores(q, k))
    return (probs if mask is None else probs * mask) @ v


def attention_mask_with_zero(q, k, v, mask=None):
    scores = _scores(q, k)
    return softmax(scores if mask is None else scores.masked_fill(~mask, 0.0)) @ v


def attention_causal_by_default(q, k, v, mask=None):
    return attention(q, k, v, causal_mask(q.shape[-2], k.shape[-2]) if mask is None else mask)


def attention_first_batch_mask(q, k, v, mask=None):
    """Wrong only for a per-batch (padding) mask with batch > 1."""
    return attention(q, k, v, mask[:1] if mask is not None and mask.dim() == 4 else mask)


def attention_in_float32(q, k, v, mask=None):
    return attention(q.float(), k.float(), v.float(), mask)


def attention_float32_inside(q, k, v, mask=None):
    """Wrong only for float64: right dtype, float32 accuracy."""
    return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)


def attention_square_only(q, k, v, mask=None):
    """Assumes Tq == Tk and builds its own mask from T."""
    T = q.shape[-2]
    return attention(q, k[..., -T:, :], v[..., -T:, :], None if mask is None else mask[..., -T:])


def split_heads_without_transpose(x, n_head):
    B, T, C = x.shape
    return x.view(B, n_head, T, C // n_head)


def split_heads_interleaved(x, n_head):
    B, T, C = x.shape
    return x.view(B, T, C // n_head, n_head).permute(0, 3, 1, 2)


def split_heads_mixing_batches(x, n_head):
    """Wrong only for batch > 1: reshapes B·T rows into heads across batch items."""
    B, T, C = x.shape
    return x.reshape(B * T, n_head, C // n_head).transpose(0, 1).reshape(B, n_head, T, C // n_head)


def merge_heads_without_transpose(x):
    B, H, T, D = x.shape
    return x.reshape(B, T, H * D)


def merge_heads_interleaved(x):
    B, H, T, D = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, T, H * D)


def merge_heads_mixing_batches(x):
    """Wrong only for batch > 1."""
    B, H, T, D = x.shape
    return x.transpose(0, 2).reshape(T, B, H * D).transpose(0, 1)


def self_attention_kqv(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    k, q, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    return merge_heads(attention(q, k, v, causal_mask(T, T))) @ c_proj_weight + c_proj_bias


def self_attention_not_causal(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    C = x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    return merge_heads(attention(q, k, v)) @ c_proj_weight + c_proj_bias


def self_attention_without_c_proj(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    return merge_heads(attention(q, k, v, causal_mask(T, T)))


def self_attention_heads_first(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T = x.shape[1]
    q, k, v = split_heads(x @ c_attn_weight + c_attn_bias, n_head).chunk(3, dim=-1)
    return merge_heads(attention(q, k, v, causal_mask(T, T))) @ c_proj_weight + c_proj_bias


def tiled_without_rescale(q, k, v, block_size=64, causal=True):
    return tiled_attention(q, k, v, block_size, causal, rescale=False)


def tiled_lse_without_max(q, k, v, block_size=64, causal=True):
    return tiled_attention(q, k, v, block_size, causal, with_max=False)


def tiled_without_offset(q, k, v, block_size=64, causal=True):
    return tiled_attention(q, k, v, block_size, causal, offset=False)


def tiled_dropping_the_last_block(q, k, v, block_size=64, causal=True):
    """Off by one in the last block: only whole blocks are visited."""
    full = (k.shape[-2] // block_size) * block_size or block_size
    return (
        tiled_attention(q, k[..., :full, :], v[..., :full, :], block_size, causal, offset=False)
        if k.shape[-2] == q.shape[-2]
        else tiled_attention(q, k, v, block_size, causal)
    )


def tiled_lse_unscaled(q, k, v, block_size=64, causal=True):
    out, _ = tiled_attention(q, k, v, block_size, causal)
    _, lse = tiled_attention(q * math.sqrt(q.shape[-1]), k, v, block_size, causal)
    return out, lse


def tiled_returning_out_only(q, k, v, block_size=64, causal=True):
    return tiled_attention(q, k, v, block_size, causal)[0]


def tiled_without_running_max(q, k, v, block_size=64, causal=True):
    """exp of the raw scores: finite while they stay below ~88 (float32), nan in float16 past ~11."""
    return tiled_attention(q, k, v, block_size, causal, shift=False)


def tiled_log_space_in_half_precision(q, k, v, block_size=64, causal=True):
    """The log-space running sum kept in float16 / bfloat16: an lse near 1e4 rounds to a multiple of 8 (64)."""
    return tiled_with_a_list_of_blocks(q, k, v, block_size, causal, state_dtype=q.dtype)


def tiled_all_queries_per_key_block(q, k, v, block_size=64, causal=True):
    """One loop over key blocks, every query at once: all the queries' running state rewritten per key block."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    query_pos = Tk - Tq + torch.arange(Tq)
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    l = torch.zeros(*q.shape[:-1], 1, dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for k0 in range(0, Tk, block_size):
        s = q @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > query_pos[:, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        scale = torch.exp(m - m_new).nan_to_num(0.0)
        p = torch.exp(s - m_new).nan_to_num(0.0)
        l, acc, m = l * scale + p.sum(-1, keepdim=True), acc * scale + p @ v[:, :, k0 : k0 + block_size], m_new
    return acc / l, (m + torch.log(l)).squeeze(-1)


def tiled_key_blocks_outside(q, k, v, block_size=64, causal=True):
    """FlashAttention-1's order: key blocks outside, query blocks (of half a block) inside, running state per row."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    rows = max(1, block_size // 2)
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)  # [B, H, Tq, 1]
    l = torch.zeros(*q.shape[:-1], 1, dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # [B, H, Tq, Dv]
    for k0 in range(0, Tk, block_size):
        k_blk, v_blk = k[:, :, k0 : k0 + block_size], v[:, :, k0 : k0 + block_size]
        for q0 in range(0, Tq, rows):
            r = slice(q0, q0 + rows)
            s = q[:, :, r] @ k_blk.mT / math.sqrt(q.shape[-1])  # [B, H, rows, Bk]
            if causal:
                query_pos = Tk - Tq + q0 + torch.arange(s.shape[-2])
                s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > query_pos[:, None], -math.inf)
            m_new = torch.maximum(m[:, :, r], s.amax(-1, keepdim=True))
            safe = torch.where(m_new.isinf(), 0.0, m_new)
            scale, p = torch.exp(m[:, :, r] - safe), torch.exp(s - safe)
            l[:, :, r] = l[:, :, r] * scale + p.sum(-1, keepdim=True)
            acc[:, :, r] = acc[:, :, r] * scale + p @ v_blk
            m[:, :, r] = m_new
    return acc / l, (m + torch.log(l)).squeeze(-1)


def tiled_scaling_q_in_place(q, k, v, block_size=64, causal=True):
    q *= q.shape[-1] ** -0.5  # the caller's q
    return tiled_attention(q * q.shape[-1] ** 0.5, k, v, block_size, causal)


def attention_scaling_q_in_place(q, k, v, mask=None):
    q /= math.sqrt(q.shape[-1])  # the caller's q
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores) @ v


def merge_weighting_in_place(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp().unsqueeze(-1), (lse2 - lse).exp().unsqueeze(-1)
    out1 *= w1  # the caller's out1 and out2
    out2 *= w2
    return torch.where(w1 > 0, out1, 0.0) + torch.where(w2 > 0, out2, 0.0), lse


def self_attention_without_max_shift(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    """exp of the raw scores: right for the bundled layer and random ones, nan where scores reach 1e4."""
    T, C = x.shape[1], x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    e = torch.exp(_scores(q, k).masked_fill(~causal_mask(T, T), -math.inf))
    return merge_heads(e / e.sum(-1, keepdim=True) @ v) @ c_proj_weight + c_proj_bias


# -- mistakes of the kinds issue 22 found: the engine's sizes, dtypes, views, keywords, lifetimes --------


def softmax_axis_keyword(x, axis=-1):  # the engine calls softmax(scores, dim=-1)
    return softmax(x, axis)


def softmax_float32_for_half(x, dim=-1):  # float16 / bfloat16 come back float32
    return softmax(x if x.dtype == torch.float64 else x.float(), dim)


def softmax_flat_rows(x, dim=-1):  # .view on a transposed (non-contiguous) input
    y = x.movedim(dim, -1)
    rows = y.view(-1, y.shape[-1])
    return softmax(rows, -1).view(y.shape).movedim(-1, dim)


_MASK_256 = torch.ones(256, 256, dtype=torch.bool).tril()


def causal_mask_fixed_buffer(n_query, n_key):  # GPT-2's old `bias` buffer, 256 wide
    return _MASK_256[n_key - n_query : n_key, :n_key]


def causal_mask_uint8_positions(n_query, n_key):
    return torch.arange(n_key).to(torch.uint8)[None, :] <= torch.arange(n_key - n_query, n_key).to(torch.uint8)[:, None]


_CAUSAL_BY_KEYS = {}


def causal_mask_cached_by_n_key(n_query, n_key):
    if n_key not in _CAUSAL_BY_KEYS:
        _CAUSAL_BY_KEYS[n_key] = causal_mask(n_query, n_key)
    return _CAUSAL_BY_KEYS[n_key]


def attention_flat_view(q, k, v, mask=None):  # .view on the engine's transposed q, k
    B, H, Tq, D = q.shape
    qf, kf = q.view(B * H, Tq, D), k.view(B * H, -1, D)
    scores = (qf @ kf.transpose(1, 2)).view(B, H, Tq, -1) / math.sqrt(D)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores) @ v


def attention_float32_for_half(q, k, v, mask=None):
    return (
        attention(q.float(), k.float(), v.float(), mask)
        if q.dtype in (torch.float16, torch.bfloat16)
        else attention(q, k, v, mask)
    )


def attention_wrong_in_the_engine(q, k, v, mask=None):  # right on every case; ignores a [B, 1, Tq, Tk] mask of 6 heads
    return attention(q, k, v, None if (mask is not None and mask.dim() == 4 and q.shape[1] == 6) else mask)


_SPLIT_BUFFER = {}


def split_heads_reused_buffer(x, n_head):  # one output buffer per shape, reused: q, k and v end up the same
    B, T, C = x.shape
    key = (B, n_head, T, C // n_head, x.dtype)
    out = _SPLIT_BUFFER.setdefault(key, torch.empty(key[:4], dtype=x.dtype))
    return out.copy_(x.reshape(B, T, n_head, C // n_head).transpose(1, 2))


def split_heads_flat_view(x, n_head):  # .view(-1) on the engine's slice of qkv
    B, T, C = x.shape
    return x.view(-1).view(B, T, n_head, C // n_head).transpose(1, 2)


def split_heads_float32(x, n_head):
    return split_heads(x if x.dtype == torch.float64 else x.float(), n_head)


def merge_heads_view_after_transpose(x):
    B, H, T, D = x.shape
    return x.transpose(1, 2).view(B, T, H * D)


def merge_heads_float32(x):
    return merge_heads(x if x.dtype == torch.float64 else x.float())


def merge_heads_flat_input(x):  # assumes x is contiguous: .view on the transposed input
    B, H, T, D = x.shape
    return x.view(B * H, T, D).view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)


def tiled_without_tiling(q, k, v, block_size=64, causal=True):  # the whole score matrix, own softmax and lse
    scores = _scores(q, k)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    m = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - m)
    return (e / e.sum(-1, keepdim=True)) @ v, (m + e.sum(-1, keepdim=True).log()).squeeze(-1)


def tiled_query_blocks_only(q, k, v, block_size=64, causal=True):  # blocks of queries, each against all keys
    outs, lses = [], []
    for q0 in range(0, q.shape[-2], block_size):
        Tq, Tk = q.shape[-2], k.shape[-2]
        o, l = tiled_without_tiling(q[:, :, q0 : q0 + block_size], k, v, block_size, False)
        if causal:
            qb = q[:, :, q0 : q0 + block_size]
            scores = _scores(qb, k).masked_fill(
                torch.arange(Tk) > (Tk - Tq + q0 + torch.arange(qb.shape[-2]))[:, None], -math.inf
            )
            m = scores.amax(-1, keepdim=True)
            e = torch.exp(scores - m)
            o, l = (e / e.sum(-1, keepdim=True)) @ v, (m + e.sum(-1, keepdim=True).log()).squeeze(-1)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def tiled_ignores_block_size(q, k, v, block_size=64, causal=True):
    return tiled_attention(q, k, v, 128, causal)


def tiled_all_blocks_at_once(q, k, v, block_size=64, causal=True):  # every [block, block] tile in one tensor
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tq % block_size or Tk % block_size:
        return tiled_attention(q, k, v, block_size, causal)
    qb = q.unflatten(-2, (Tq // block_size, block_size))  # [B, H, nq, Bq, D]
    kb = k.unflatten(-2, (Tk // block_size, block_size))  # [B, H, nk, Bk, D]
    tiles = torch.einsum("bhiqd,bhjkd->bhijqk", qb, kb)  # [B, H, nq, nk, Bq, Bk]: the whole table, tiled
    scores = tiles.permute(0, 1, 2, 4, 3, 5).reshape(*q.shape[:2], Tq, Tk) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_mask(Tq, Tk), -math.inf)
    m = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - m)
    return (e / e.sum(-1, keepdim=True)) @ v, (m + e.sum(-1, keepdim=True).log()).squeeze(-1)


def tiled_flat_view(q, k, v, block_size=64, causal=True):
    B, H, Tk, D = k.shape
    k = k.view(B * H, Tk, D).view(B, H, Tk, D)
    return tiled_attention(q, k, v, block_size, causal)


def merge_without_max_shift(out1, lse1, out2, lse2):
    total = lse1.exp() + lse2.exp()
    w1, w2 = (lse1.exp() / total).unsqueeze(-1), (lse2.exp() / total).unsqueeze(-1)
    return w1 * out1 + w2 * out2, torch.log(total)


def merge_lse_max(out1, lse1, out2, lse2):
    return merge_attention(out1, lse1, out2, lse2)[0], torch.maximum(lse1, lse2)


def merge_lse_sum(out1, lse1, out2, lse2):
    return merge_attention(out1, lse1, out2, lse2)[0], lse1 + lse2


def merge_half_and_half(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, merge_attention(out1, lse1, out2, lse2)[1]


def merge_not_normalised(out1, lse1, out2, lse2):
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp().unsqueeze(-1), (lse2 - m).exp().unsqueeze(-1)
    return w1 * out1 + w2 * out2, merge_attention(out1, lse1, out2, lse2)[1]


def merge_weights_swapped(out1, lse1, out2, lse2):
    out, lse = merge_attention(out2, lse1, out1, lse2)
    return out, lse


def merge_nan_of_an_empty_part(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return (lse1 - lse).exp().unsqueeze(-1) * out1 + (lse2 - lse).exp().unsqueeze(-1) * out2, lse


def merge_in_float32(out1, lse1, out2, lse2):
    out, lse = merge_attention(out1.float(), lse1.float(), out2.float(), lse2.float())
    return out.to(out1.dtype), lse.to(lse1.dtype)


def self_attention_flat_view(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):  # .view on x
    B, T, C = x.shape
    qkv = (x.view(B * T, C) @ c_attn_weight + c_attn_bias).view(B, T, 3 * C)
    q, k, v = (split_heads(t, n_head) for t in qkv.split(C, dim=-1))
    return merge_heads(attention(q, k, v, causal_mask(T, T))) @ c_proj_weight + c_proj_bias


def self_attention_float32_for_half(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    if x.dtype in (torch.float16, torch.bfloat16):
        x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias = (
            t.float() for t in (x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias)
        )
    return self_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head)


def self_attention_fixed_mask_buffer(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    return merge_heads(attention(q, k, v, _MASK_256[:T, :T])) @ c_proj_weight + c_proj_bias


def self_attention_one_head(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):  # ignores n_head
    return self_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, 1)


def self_attention_without_c_attn_bias(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    return self_attention(x, c_attn_weight, torch.zeros_like(c_attn_bias), c_proj_weight, c_proj_bias, n_head)


def self_attention_scaled_by_width(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    q, k, v = (split_heads(t, n_head) for t in (x @ c_attn_weight + c_attn_bias).split(C, dim=-1))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(C)).masked_fill(~causal_mask(T, T), -math.inf)
    return merge_heads(softmax(scores) @ v) @ c_proj_weight + c_proj_bias


MISTAKES = [
    (check_softmax, softmax_axis_keyword, r"softmax in the engine[\s\S]*unexpected keyword argument 'dim'"),
    (
        check_softmax,
        softmax_float32_for_half,
        r"float16 in, float16 out[\s\S]*expected dtype torch.float16, got torch.float32",
    ),
    (check_softmax, softmax_flat_rows, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (check_causal_mask, causal_mask_fixed_buffer, r"300 tokens[\s\S]*expected shape \(300, 300\), got \(256, 256\)"),
    (check_causal_mask, causal_mask_uint8_positions, r"positions go past 255"),
    (check_causal_mask, causal_mask_cached_by_n_key, r"the same n_key as a case before[\s\S]*nothing may be kept"),
    (check_attention, attention_flat_view, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (check_attention, attention_float32_for_half, r"float16 in, float16 out[\s\S]*expected dtype torch.float16"),
    (check_attention, attention_wrong_in_the_engine, r"attention in the engine[\s\S]*the logits differ"),
    (check_split_heads, split_heads_reused_buffer, r"split_heads in the engine[\s\S]*not a buffer reused"),
    (check_split_heads, split_heads_flat_view, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (check_split_heads, split_heads_float32, r"float16[\s\S]*expected dtype torch.float16, got torch.float32"),
    (check_merge_heads, merge_heads_view_after_transpose, r"raised RuntimeError[\s\S]*use \.reshape\(B, T, H \* D\)"),
    (check_merge_heads, merge_heads_float32, r"expected dtype torch.float16, got torch.float32"),
    (
        check_merge_heads,
        merge_heads_flat_input,
        r"merge_heads\(x=<float64 \[2, 3, 3, 4\]>\) raised RuntimeError: view size",
    ),
    (
        check_tiled_attention,
        tiled_without_tiling,
        r"tiling: [\s\S]*\[(1, )?2, 256, 384\], the whole \[Tq, Tk\] score table",
    ),
    (
        check_tiled_attention,
        tiled_query_blocks_only,
        r"tiling: [\s\S]*shape \[(1, )?2, 32, 384\][\s\S]*nor one block of queries against all the keys",
    ),
    (
        check_tiled_attention,
        tiled_ignores_block_size,
        r"tiling: [\s\S]*block_size=32: your function made a tensor of shape \[(1, )?2, (256|128), 128\], a piece "
        r"of the score table more than 32 wide in two dimensions",
    ),
    (check_tiled_attention, tiled_all_blocks_at_once, r"tiling: [\s\S]*(score table|\(196,608 numbers\))"),
    (check_tiled_attention, tiled_flat_view, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (check_softmax, softmax_without_max_shift, r"got nan or inf[\s\S]*overflows to inf[\s\S]*subtract each row's max"),
    (check_softmax, softmax_minus_mean, r"got nan or inf[\s\S]*subtract the max, not the mean"),
    (check_softmax, softmax_minus_min, r"got nan or inf[\s\S]*subtract the max, not the min"),
    (check_softmax, softmax_global_max, r"rows far apart[\s\S]*not (the max )?of the whole tensor"),
    (check_softmax, softmax_last_dim_only, r"dim=0[\s\S]*normalise along `dim`"),
    (check_softmax, softmax_in_float32, r"float64[\s\S]*float32 accuracy"),
    (check_softmax, softmax_without_keepdim, r"dim=0[\s\S]*(normalise along `dim`|keepdim)"),
    (check_causal_mask, causal_mask_strict, r"one position sees itself[\s\S]*off by one"),
    (check_causal_mask, causal_mask_upper, r"upper triangle"),
    (check_causal_mask, causal_mask_float, r"expected dtype torch.bool, got torch.float32[\s\S]*bool tensor"),
    (check_causal_mask, causal_mask_without_offset, r"decode[\s\S]*the queries are the LAST n_query positions"),
    (check_attention, attention_scaled_by_d, r"1/√d[\s\S]*not 1/d"),
    (check_attention, attention_unscaled, r"divide the scores by √d"),
    (check_attention, attention_mask_inverted, r"the mask is inverted"),
    (check_attention, attention_mask_after_softmax, r"apply the mask before the softmax"),
    (check_attention, attention_mask_with_zero, r"not 0: exp\(0\) = 1"),
    (check_attention, attention_causal_by_default, r"mask=None means no mask"),
    (check_attention, attention_first_batch_mask, r"batch of 3[\s\S]*use the whole mask"),
    (check_attention, attention_in_float32, r"expected dtype torch.float64, got torch.float32"),
    (check_attention, attention_float32_inside, r"float64[\s\S]*float32 accuracy"),
    (check_attention, attention_square_only, r"Tq and Tk differ"),
    (check_split_heads, split_heads_without_transpose, r"view\(B, n_head, T, D\) mixes positions"),
    (check_split_heads, split_heads_interleaved, r"consecutive"),
    (check_split_heads, split_heads_mixing_batches, r"batch 2[\s\S]*keep the batch dimension apart"),
    (check_merge_heads, merge_heads_without_transpose, r"transpose back first"),
    (check_merge_heads, merge_heads_interleaved, r"consecutive"),
    (check_merge_heads, merge_heads_mixing_batches, r"batch 2[\s\S]*keep the batch dimension first"),
    (check_self_attention, self_attention_kqv, r"\[q \| k \| v\][\s\S]*in that order"),
    (check_self_attention, self_attention_not_causal, r"GPT-2's attention is causal"),
    (check_self_attention, self_attention_without_c_proj, r"output projection"),
    (check_self_attention, self_attention_heads_first, r"split qkv into q, k, v[\s\S]*first"),
    (check_tiled_attention, tiled_without_rescale, r"out: [\s\S]*multiply both the running sum l and the accumulator"),
    (check_tiled_attention, tiled_lse_without_max, r"lse: [\s\S]*add the running max m back"),
    (check_tiled_attention, tiled_without_offset, r"out: [\s\S]*the queries are the LAST Tq positions"),
    (
        check_tiled_attention,
        tiled_dropping_the_last_block,
        r"does not divide T[\s\S]*out: [\s\S]*the last block is shorter",
    ),
    (check_tiled_attention, tiled_lse_unscaled, r"lse: [\s\S]*SCALED scores"),
    (check_tiled_attention, tiled_returning_out_only, r"expected a tuple \(out, lse\), got Tensor"),
    (
        check_tiled_attention,
        tiled_key_blocks_outside,
        r"loop order: [\s\S]*queries 0–15 with keys 32–63 after it had moved on to queries 16–31[\s\S]*"
        r"FlashAttention-1's order[\s\S]*got: +queries 0–15 with keys 0–31, then queries 16–31",
    ),
    (
        check_tiled_attention,
        tiled_all_queries_per_key_block,
        r"loop order: [\s\S]*256 queries at once \(rows 0–255\) with keys 0–31[\s\S]*FlashAttention-1's order",
    ),
    (check_tiled_attention, tiled_without_running_max, r"got nan or inf[\s\S]*keep the running max m"),
    (
        check_tiled_attention,
        tiled_log_space_in_half_precision,
        r"float16, scores of about ±1e4[\s\S]*running log-sum-exp near 1e4 is rounded",
    ),
    (check_tiled_attention, tiled_scaling_q_in_place, r"changed its input `q`[\s\S]*in-place operation"),
    (check_attention, attention_scaling_q_in_place, r"changed its input `q`[\s\S]*in-place operation"),
    (check_merge_attention, merge_weighting_in_place, r"changed its input `out1`"),
    (
        check_self_attention,
        self_attention_without_max_shift,
        r"float16, scores of about ±1e4[\s\S]*got nan or inf[\s\S]*subtract each row's max",
    ),
    (check_merge_attention, merge_without_max_shift, r"lse1 - lse2 = 200[\s\S]*out: [\s\S]*exp\(lse\) overflows"),
    (check_merge_attention, merge_lse_max, r"lse: [\s\S]*not just the max"),
    (check_merge_attention, merge_lse_sum, r"lse: [\s\S]*PRODUCT of the two sums"),
    (check_merge_attention, merge_half_and_half, r"out: [\s\S]*averaging the two outputs 50/50"),
    (check_merge_attention, merge_not_normalised, r"out: [\s\S]*normalise: the weights"),
    (check_merge_attention, merge_weights_swapped, r"out: [\s\S]*the weights are swapped"),
    (check_merge_attention, merge_nan_of_an_empty_part, r"no keys[\s\S]*out: [\s\S]*0 × nan is nan"),
    (check_merge_attention, merge_in_float32, r"float64[\s\S]*float32 accuracy"),
    (check_self_attention, self_attention_flat_view, r"raised RuntimeError[\s\S]*x is a non-contiguous view here"),
    (
        check_self_attention,
        self_attention_float32_for_half,
        r"float16 in, float16 out[\s\S]*expected dtype torch.float16, got torch.float32",
    ),
    (check_self_attention, self_attention_fixed_mask_buffer, r"raised RuntimeError[\s\S]*nothing of a fixed size"),
    (check_self_attention, self_attention_one_head, r"use the n_head you are given"),
    (check_self_attention, self_attention_without_c_attn_bias, r"add the bias of the fused projection"),
    (check_self_attention, self_attention_scaled_by_width, r"not by 1/√C"),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[w.__name__ for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed, match=message) as caught:
        check(wrong)
    text = str(caught.value)
    if "raised" not in text and "changed its input" not in text:  # a wrong answer shows input, expected and got
        assert "input:" in text and "expected:" in text and "got:" in text


def test_every_exercise_has_three_mistakes():
    counts = {check.__name__: 0 for check, _ in REFERENCES}
    for check, _, _ in MISTAKES:
        counts[check.__name__] += 1
    assert min(counts.values()) >= 3, counts


# -- correct, but written differently -----------------------------------------------------------


def softmax_with_division_by_max_exp(x, dim=-1):
    shifted = x - torch.max(x, dim=dim, keepdim=True).values
    e = shifted.exp()
    return e / torch.sum(e, dim=dim, keepdim=True)


def softmax_moving_dim_last(x, dim=-1):
    y = x.movedim(dim, -1)
    e = torch.exp(y - y.max(-1, keepdim=True).values)
    return (e / e.sum(-1, keepdim=True)).movedim(-1, dim)


def causal_mask_with_tril(n_query, n_key):
    return torch.ones(n_key, n_key, dtype=torch.bool).tril()[n_key - n_query :]


def causal_mask_with_triu(n_query, n_key):
    return ~torch.ones(n_query, n_key, dtype=torch.bool).triu(n_key - n_query + 1)


def attention_with_einsum_and_where(q, k, v, mask=None):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(-1e30, dtype=scores.dtype))  # very negative, not -inf
    return torch.einsum("bhqk,bhkd->bhqd", softmax(scores, dim=-1), v)


def attention_scaling_q_first(q, k, v, mask=None):
    scores = (q / math.sqrt(q.shape[-1])) @ k.mT
    if mask is not None:
        scores = scores + torch.zeros_like(scores).masked_fill(~mask, -math.inf)
    return softmax(scores, -1) @ v


def split_heads_with_unflatten(x, n_head):
    return x.unflatten(-1, (n_head, -1)).permute(0, 2, 1, 3)


def split_heads_by_slicing(x, n_head):
    D = x.shape[-1] // n_head
    return torch.stack([x[..., h * D : (h + 1) * D] for h in range(n_head)], dim=1)


def merge_heads_with_cat(x):
    return torch.cat(x.unbind(1), dim=-1)


def merge_heads_contiguous_view(x):
    B, H, T, D = x.shape
    return x.permute(0, 2, 1, 3).contiguous().view(B, T, H * D)


def self_attention_with_chunk_and_addmm(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    B, T, C = x.shape
    qkv = torch.addmm(c_attn_bias, x.reshape(B * T, C), c_attn_weight).view(B, T, 3 * C)
    q, k, v = (split_heads_with_unflatten(t, n_head) for t in qkv.chunk(3, dim=-1))
    out = merge_heads_with_cat(attention_with_einsum_and_where(q, k, v, causal_mask_with_tril(T, T)))
    return torch.addmm(c_proj_bias, out.reshape(B * T, C), c_proj_weight).view(B, T, C)


def tiled_with_query_blocks(q, k, v, block_size=64, causal=True):
    """The notebook's shape: query blocks outside, key blocks inside, stopping at the diagonal, each block's rows
    written once into preallocated out and lse."""
    Tq, Tk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype)
    for q0 in range(0, Tq, block_size):
        rows = q[:, :, q0 : q0 + block_size]
        where = Tk - Tq + q0 + torch.arange(rows.shape[-2])
        m = torch.full((*rows.shape[:-1], 1), -math.inf, dtype=q.dtype)
        l = torch.zeros(*rows.shape[:-1], 1, dtype=q.dtype)
        acc = torch.zeros(*rows.shape[:-1], v.shape[-1], dtype=q.dtype)
        for k0 in range(0, int(where[-1]) + 1 if causal else Tk, block_size):
            s = rows @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) / math.sqrt(D)
            if causal:
                s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > where[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            scale, p = torch.exp(m - m_new), torch.exp(s - m_new)
            l, acc, m = l * scale + p.sum(dim=-1, keepdim=True), acc * scale + p @ v[:, :, k0 : k0 + block_size], m_new
        out[:, :, q0 : q0 + block_size] = acc / l
        lse[:, :, q0 : q0 + block_size] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def tiled_with_a_list_of_blocks(q, k, v, block_size=64, causal=True, *, state_dtype=None):
    """Keeps a log-space running sum instead of m and l: each query block's lse directly, its out rescaled as it
    goes; the blocks' results in lists, concatenated at the end. The running state in float32 for float16 and
    bfloat16 inputs (as FlashAttention's kernels keep it), unless `state_dtype` says otherwise."""
    Tq, Tk, q_dtype = q.shape[-2], k.shape[-2], q.dtype
    dtype = state_dtype or (torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    outs, lses = [], []
    for q0 in range(0, Tq, block_size):
        qb = q[:, :, q0 : q0 + block_size]
        query_pos = Tk - Tq + q0 + torch.arange(qb.shape[-2])
        lse = torch.full(qb.shape[:-1], -math.inf, dtype=dtype)
        out = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=dtype)
        for k0 in range(0, Tk, block_size):
            s = qb @ k[:, :, k0 : k0 + block_size].mT / math.sqrt(q.shape[-1])
            if causal:
                s = s.masked_fill(k0 + torch.arange(s.shape[-1]) > query_pos[:, None], -math.inf)
            m = s.amax(-1)
            m_safe = torch.where(m.isinf(), torch.zeros_like(m), m)
            block_lse = m_safe + torch.log(torch.exp(s - m_safe[..., None]).sum(-1))
            new_lse = torch.logaddexp(lse, block_lse)
            out = (
                out * torch.exp(lse - new_lse)[..., None].nan_to_num(0.0)
                + torch.exp(s - new_lse[..., None]) @ v[:, :, k0 : k0 + block_size]
            )
            lse = new_lse
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2).to(q_dtype), torch.cat(lses, dim=-1).to(q_dtype)


def tiled_while_loops_half_query_blocks(q, k, v, block_size=64, causal=True):
    """FlashAttention-2's order with while loops: query blocks of half the block size (q scaled first), key blocks
    of block_size stopping at the last one a block can see, each block's rows written once into preallocated
    tensors."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    rows = max(1, block_size // 2)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype)
    q0 = 0
    while q0 < Tq:
        qb = q[:, :, q0 : q0 + rows] * q.shape[-1] ** -0.5
        query_pos = Tk - Tq + q0 + torch.arange(qb.shape[-2])
        end = int(query_pos[-1]) + 1 if causal else Tk
        m = torch.full((*qb.shape[:-1], 1), -math.inf, dtype=q.dtype)
        l = torch.zeros(*qb.shape[:-1], 1, dtype=q.dtype)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype)
        k0 = 0
        while k0 < end:
            s = torch.einsum("bhqd,bhkd->bhqk", qb, k[:, :, k0 : min(k0 + block_size, end)])
            if causal:
                s = torch.where(k0 + torch.arange(s.shape[-1]) <= query_pos[:, None], s, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            r, p = torch.exp(m - m_new), torch.exp(s - m_new)
            l, acc, m = l * r + p.sum(-1, keepdim=True), acc * r + p @ v[:, :, k0 : min(k0 + block_size, end)], m_new
            k0 += block_size
        out[:, :, q0 : q0 + rows] = acc / l
        lse[:, :, q0 : q0 + rows] = (m + torch.log(l)).squeeze(-1)
        q0 += rows
    return out, lse


# other numerics: numpy, float64 accumulation, a log-sum-exp form, torch.where, einsum, reshape/permute, an online
# softmax over key blocks in another order


def _np(t):
    return t.detach().double().numpy()


def _back(a, like):
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)


def softmax_numpy(x, dim=-1):
    a = _np(x)
    e = np.exp(a - a.max(axis=dim, keepdims=True))
    return _back(e / e.sum(axis=dim, keepdims=True), x)


def softmax_float64_accumulation(x, dim=-1):
    return softmax(x.double(), dim).to(x.dtype)


def softmax_log_sum_exp(x, dim=-1):
    m = x.amax(dim, keepdim=True)
    return torch.exp(x - m - torch.log(torch.exp(x - m).sum(dim, keepdim=True)))


def causal_mask_numpy(n_query, n_key):
    return torch.from_numpy(np.tri(n_query, n_key, n_key - n_query, dtype=bool))


def causal_mask_where_int32(n_query, n_key):
    keys = torch.arange(n_key, dtype=torch.int32)
    queries = torch.arange(n_query, dtype=torch.int32) + (n_key - n_query)
    return torch.where(keys[None, :] > queries[:, None], False, True)


def attention_numpy(q, k, v, mask=None):
    s = np.einsum("...qd,...kd->...qk", _np(q), _np(k)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask.numpy(), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return _back((e / e.sum(-1, keepdims=True)) @ _np(v), q)


def attention_float64_accumulation(q, k, v, mask=None):
    return attention(q.double(), k.double(), v.double(), mask).to(q.dtype)


def attention_online_over_key_blocks(q, k, v, mask=None):
    """An online softmax over blocks of 5 keys, the last block first."""
    Tk = k.shape[-2]
    m = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    l = torch.zeros(*q.shape[:-1], 1, dtype=q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for k0 in reversed(range(0, Tk, 5)):
        s = q @ k[..., k0 : k0 + 5, :].mT / math.sqrt(q.shape[-1])
        if mask is not None:
            s = torch.where(mask[..., k0 : k0 + 5], s, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(m_new.isinf(), 0.0, m_new)
        r, p = torch.exp(m - safe), torch.exp(s - safe)
        l, acc, m = l * r + p.sum(-1, keepdim=True), acc * r + p @ v[..., k0 : k0 + 5, :], m_new
    return acc / l


def split_heads_numpy(x, n_head):
    B, T, C = x.shape
    return _back(_np(x).reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3), x)


def split_heads_reshape_permute(x, n_head):
    B, T, C = x.shape
    return x.reshape(B, T, n_head, -1).permute(0, 2, 1, 3)


def split_heads_einsum(x, n_head):
    return torch.einsum("bthd->bhtd", x.unflatten(-1, (n_head, -1)))


def merge_heads_numpy(x):
    B, H, T, D = x.shape
    return _back(_np(x).transpose(0, 2, 1, 3).reshape(B, T, H * D), x)


def merge_heads_permute_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)


def merge_heads_einsum(x):
    return torch.einsum("bhtd->bthd", x).reshape(x.shape[0], x.shape[2], -1)


def self_attention_numpy(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    B, T, C = x.shape
    D = C // n_head
    qkv = _np(x) @ _np(c_attn_weight) + _np(c_attn_bias)
    q, k, v = (a.reshape(B, T, n_head, D).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
    s = np.where(np.tri(T, T, dtype=bool), q @ k.transpose(0, 1, 3, 2) / math.sqrt(D), -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    out = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return _back(out @ _np(c_proj_weight) + _np(c_proj_bias), x)


def self_attention_float64_accumulation(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    wide = (t.double() for t in (x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias))
    return self_attention(*wide, n_head).to(x.dtype)


def self_attention_float32_for_half_rounded_back(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    if x.dtype == torch.float64:
        return self_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head)
    wide = (t.float() for t in (x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias))
    return self_attention(*wide, n_head).to(x.dtype)


def self_attention_einsum_where(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    B, T, C = x.shape
    qkv = torch.einsum("btc,cd->btd", x, c_attn_weight) + c_attn_bias
    q, k, v = (t.reshape(B, T, n_head, -1).permute(0, 2, 1, 3) for t in qkv.tensor_split(3, dim=-1))
    out = attention_online_over_key_blocks(q, k, v, causal_mask_where_int32(T, T))
    return torch.einsum("btc,cd->btd", out.permute(0, 2, 1, 3).reshape(B, T, C), c_proj_weight) + c_proj_bias


def tiled_reversed_blocks(q, k, v, block_size=64, causal=True):
    """Query blocks from the last to the first and, inside, key blocks from the last to the first; torch.where for
    the mask, the max kept finite."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype)
    for q0 in reversed(range(0, Tq, block_size)):
        qb = q[:, :, q0 : q0 + block_size]
        query_pos = Tk - Tq + q0 + torch.arange(qb.shape[-2])
        m = torch.full((*qb.shape[:-1], 1), -math.inf, dtype=q.dtype)
        l = torch.zeros(*qb.shape[:-1], 1, dtype=q.dtype)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype)
        for k0 in reversed(range(0, Tk, block_size)):
            s = torch.einsum("bhqd,bhkd->bhqk", qb, k[:, :, k0 : k0 + block_size]) / math.sqrt(q.shape[-1])
            if causal:
                s = torch.where(k0 + torch.arange(s.shape[-1]) <= query_pos[:, None], s, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(m_new.isinf(), 0.0, m_new)
            r, p = torch.exp(m - safe), torch.exp(s - safe)
            l, acc, m = l * r + p.sum(-1, keepdim=True), acc * r + p @ v[:, :, k0 : k0 + block_size], m_new
        out[:, :, q0 : q0 + block_size] = acc / l
        lse[:, :, q0 : q0 + block_size] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def merge_by_sigmoid(out1, lse1, out2, lse2):
    """Part 1's share of the mass is sigmoid(lse1 - lse2); the lse by logaddexp."""
    diff = lse1 - lse2
    w1 = torch.sigmoid(torch.where(diff.isnan(), torch.zeros_like(diff), diff)).unsqueeze(-1)  # both -inf: any
    out = torch.where(w1 > 0, w1 * out1, 0.0) + torch.where(w1 < 1, (1 - w1) * out2, 0.0)
    return out, torch.logaddexp(lse1, lse2)


def merge_by_stacked_logsumexp(out1, lse1, out2, lse2):
    """Both parts stacked on a new last dimension: torch.logsumexp and a softmax-like weight over it."""
    lses = torch.stack([lse1, lse2], dim=-1)  # [..., Tq, 2]
    lse = torch.logsumexp(lses, dim=-1)  # [..., Tq]
    w = torch.exp(lses - lse.unsqueeze(-1)).nan_to_num(0.0)  # [..., Tq, 2]
    outs = torch.stack([out1, out2], dim=-2).nan_to_num(0.0)  # [..., Tq, 2, Dv]
    return (w.unsqueeze(-2) @ outs).squeeze(-2), lse


def merge_numpy(out1, lse1, out2, lse2):
    o1, l1, o2, l2 = (t.detach().double().numpy() for t in (out1, lse1, out2, lse2))
    lse = np.logaddexp(l1, l2)
    with np.errstate(invalid="ignore"):
        w1, w2 = np.exp(l1 - lse)[..., None], np.exp(l2 - lse)[..., None]
        out = np.where(w1 > 0, w1 * np.nan_to_num(o1), 0.0) + np.where(w2 > 0, w2 * np.nan_to_num(o2), 0.0)
    return torch.from_numpy(out).to(out1.dtype), torch.from_numpy(lse).to(lse1.dtype)


def tiled_float64_accumulators(q, k, v, block_size=64, causal=True):
    out, lse = tiled_attention(q.double(), k.double(), v.double(), block_size, causal)
    return out.to(q.dtype), lse.to(q.dtype)


def tiled_numpy(q, k, v, block_size=64, causal=True):
    Q, K, V = _np(q), _np(k), _np(v)
    Tq, Tk = Q.shape[-2], K.shape[-2]
    out, lse = np.empty((*Q.shape[:-1], V.shape[-1])), np.empty(Q.shape[:-1])
    for q0 in range(0, Tq, block_size):
        Qb = Q[:, :, q0 : q0 + block_size]
        query_pos = Tk - Tq + q0 + np.arange(Qb.shape[-2])
        m = np.full((*Qb.shape[:-1], 1), -np.inf)
        l = np.zeros((*Qb.shape[:-1], 1))
        acc = np.zeros((*Qb.shape[:-1], V.shape[-1]))
        for k0 in range(0, Tk, block_size):
            s = Qb @ np.swapaxes(K[:, :, k0 : k0 + block_size], -1, -2) / math.sqrt(Q.shape[-1])
            if causal:
                s = np.where(k0 + np.arange(s.shape[-1]) <= query_pos[:, None], s, -np.inf)
            m_new = np.maximum(m, s.max(-1, keepdims=True))
            safe = np.where(np.isinf(m_new), 0.0, m_new)
            r, p = np.exp(m - safe), np.exp(s - safe)
            l, acc, m = l * r + p.sum(-1, keepdims=True), acc * r + p @ V[:, :, k0 : k0 + block_size], m_new
        out[:, :, q0 : q0 + block_size], lse[:, :, q0 : q0 + block_size] = acc / l, (m + np.log(l))[..., 0]
    return _back(out, q), _back(lse, q)


ALTERNATIVES = [
    (check_softmax, softmax_with_division_by_max_exp),
    (check_softmax, softmax_moving_dim_last),
    (check_causal_mask, causal_mask_with_tril),
    (check_causal_mask, causal_mask_with_triu),
    (check_attention, attention_with_einsum_and_where),
    (check_attention, attention_scaling_q_first),
    (check_split_heads, split_heads_with_unflatten),
    (check_split_heads, split_heads_by_slicing),
    (check_merge_heads, merge_heads_with_cat),
    (check_merge_heads, merge_heads_contiguous_view),
    (check_self_attention, self_attention_with_chunk_and_addmm),
    (check_tiled_attention, tiled_with_query_blocks),
    (check_tiled_attention, tiled_with_a_list_of_blocks),
    (check_softmax, softmax_numpy),
    (check_softmax, softmax_float64_accumulation),
    (check_softmax, softmax_log_sum_exp),
    (check_causal_mask, causal_mask_numpy),
    (check_causal_mask, causal_mask_where_int32),
    (check_attention, attention_numpy),
    (check_attention, attention_float64_accumulation),
    (check_attention, attention_online_over_key_blocks),
    (check_split_heads, split_heads_numpy),
    (check_split_heads, split_heads_reshape_permute),
    (check_split_heads, split_heads_einsum),
    (check_merge_heads, merge_heads_numpy),
    (check_merge_heads, merge_heads_permute_flatten),
    (check_merge_heads, merge_heads_einsum),
    (check_self_attention, self_attention_numpy),
    (check_self_attention, self_attention_float64_accumulation),
    (check_self_attention, self_attention_float32_for_half_rounded_back),
    (check_self_attention, self_attention_einsum_where),
    (check_tiled_attention, tiled_reversed_blocks),
    (check_tiled_attention, tiled_float64_accumulators),
    (check_tiled_attention, tiled_numpy),
    (check_tiled_attention, tiled_while_loops_half_query_blocks),
    (check_merge_attention, merge_by_sigmoid),
    (check_merge_attention, merge_by_stacked_logsumexp),
    (check_merge_attention, merge_numpy),
]


def test_every_exercise_has_two_correct_alternatives():
    counts = {check.__name__: 0 for check, _ in REFERENCES}
    for check, _ in ALTERNATIVES:
        counts[check.__name__] += 1
    assert min(counts.values()) >= 2, counts


@pytest.mark.parametrize("check, alternative", ALTERNATIVES, ids=[a.__name__ for _, a in ALTERNATIVES])
def test_correct_alternative_passes(check, alternative, capsys):
    check(alternative)
    check(alternative, seed=11, n_random=30)
    assert capsys.readouterr().out.count("✓") == 2


# -- black boxes, however they are reached ---------------------------------------------------------


def softmax_torch(x, dim=-1):
    return torch.softmax(x, dim)


def softmax_functional(x, dim=-1):
    return F.softmax(x, dim=dim)


def softmax_method(x, dim=-1):
    return x.softmax(dim)


def softmax_special(x, dim=-1):
    return torch.special.softmax(x, dim)


def softmax_module(x, dim=-1):
    return torch.nn.Softmax(dim=dim)(x)


def softmax_from_log_softmax(x, dim=-1):
    return torch.log_softmax(x, dim).exp()


def softmax_from_logsumexp(x, dim=-1):
    return torch.exp(x - torch.logsumexp(x, dim, keepdim=True))


def softmax_engine(x, dim=-1):
    return engine_softmax_imported_early(x, dim)


def softmax_aten(x, dim=-1):
    return torch.ops.aten._softmax(x, dim, False)


def causal_mask_engine(n_query, n_key):
    return llmcourse.engine.parts.causal_mask(n_query, n_key)


def attention_sdpa(q, k, v, mask=None):
    return sdpa_imported_early(q, k, v, attn_mask=mask)


def attention_engine(q, k, v, mask=None):
    return llmcourse.engine.parts.attention(q, k, v, mask)


def attention_with_torch_softmax(q, k, v, mask=None):
    scores = _scores(q, k)
    return torch.softmax(scores if mask is None else scores.masked_fill(~mask, -math.inf), -1) @ v


def split_heads_engine(x, n_head):
    return llmcourse.engine.parts.split_heads(x, n_head)


def merge_heads_engine(x):
    return llmcourse.engine.parts.merge_heads(x)


def self_attention_engine_parts(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    T, C = x.shape[1], x.shape[2]
    qkv = llmcourse.engine.parts.linear(x, c_attn_weight, c_attn_bias)
    q, k, v = (split_heads(t, n_head) for t in qkv.split(C, dim=-1))
    return merge_heads(attention(q, k, v, causal_mask(T, T))) @ c_proj_weight + c_proj_bias


def self_attention_multihead_module(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, n_head):
    B, T, C = x.shape
    mha = torch.nn.MultiheadAttention(C, n_head, batch_first=True, dtype=x.dtype)
    return mha(x, x, x, need_weights=False)[0]


def tiled_engine(q, k, v, block_size=64, causal=True):
    return engine_tiled_module.tiled_attention(q, k, v, block_size, causal)


def merge_engine(out1, lse1, out2, lse2):
    return engine_tiled_module.merge_attention(out1, lse1, out2, lse2)


def merge_by_tiled_attention(out1, lse1, out2, lse2):  # attention over two "keys" whose scores are the lses
    k = torch.stack([lse1, lse2], -1).unsqueeze(-1) * 1.0  # [..., Tq, 2, 1]
    v = torch.stack([out1, out2], -2)  # [..., Tq, 2, Dv]
    q = torch.ones(*k.shape[:-2], 1, 1, dtype=k.dtype)
    out, lse = engine_tiled_module.tiled_attention(
        q.flatten(0, -3)[None], k.flatten(0, -3)[None], v.flatten(0, -3)[None], causal=False
    )
    return out.reshape(out1.shape), lse.reshape(lse1.shape)


def tiled_with_torch_softmax_and_logsumexp(q, k, v, block_size=64, causal=True):
    scores = _scores(q, k)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


BLACK_BOXES = [
    (check_softmax, softmax_torch, r"called torch.softmax"),
    (check_softmax, softmax_functional, r"called torch.Tensor.softmax|called torch.nn.functional.softmax"),
    (check_softmax, softmax_method, r"called torch.Tensor.softmax"),
    (check_softmax, softmax_special, r"called torch.special_softmax"),
    (check_softmax, softmax_module, r"softmax"),
    (check_softmax, softmax_from_log_softmax, r"log_softmax"),
    (check_softmax, softmax_from_logsumexp, r"called torch.logsumexp"),
    (check_softmax, softmax_engine, r"llmcourse.engine.parts.softmax|torch.softmax"),
    (check_softmax, softmax_aten, r"_softmax"),
    (check_causal_mask, causal_mask_engine, r"llmcourse.engine.parts.causal_mask"),
    (check_attention, attention_sdpa, r"scaled_dot_product_attention"),
    (check_attention, attention_engine, r"llmcourse.engine.parts.attention|scaled_dot_product_attention"),
    (check_attention, attention_with_torch_softmax, r"called torch.softmax[\s\S]*Use your own softmax"),
    (check_split_heads, split_heads_engine, r"llmcourse.engine.parts.split_heads"),
    (check_merge_heads, merge_heads_engine, r"llmcourse.engine.parts.merge_heads"),
    (check_self_attention, self_attention_engine_parts, r"llmcourse.engine.parts"),
    (
        check_self_attention,
        self_attention_multihead_module,
        r"MultiheadAttention|multi_head_attention_forward|scaled_dot_product_attention",
    ),
    (check_tiled_attention, tiled_engine, r"llmcourse.engine.tiled_attention"),
    (check_tiled_attention, tiled_with_torch_softmax_and_logsumexp, r"called torch.softmax"),
    (check_merge_attention, merge_engine, r"called llmcourse.engine.tiled_attention.merge_attention"),
    (check_merge_attention, merge_by_tiled_attention, r"llmcourse.engine.tiled_attention.tiled_attention"),
]


@pytest.mark.parametrize("check, wrong, message", BLACK_BOXES, ids=[w.__name__ for _, w, _ in BLACK_BOXES])
def test_black_box_is_rejected_however_it_is_reached(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


def test_the_engine_still_works_after_a_check_that_forbids_it():
    with pytest.raises(CheckFailed):
        check_attention(attention_engine)
    q = torch.randn(1, 1, 3, 4)
    assert llmcourse.engine.parts.attention(q, q, q).shape == (1, 1, 3, 4)


# -- broken functions: errors, hangs, wrong shapes and types -------------------------------------


def attention_that_raises(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    return scores @ v.transpose(-2, -1)  # a transpose too many


def attention_wrong_shape(q, k, v, mask=None):
    return softmax(_scores(q, k))  # the weights, not the output


def attention_returning_numpy(q, k, v, mask=None):
    return attention(q, k, v, mask).numpy()


def softmax_that_changes_its_input(x, dim=-1):
    x -= x.amax(dim, keepdim=True)
    e = x.exp()
    return e / e.sum(dim, keepdim=True)


def softmax_that_hangs(x, dim=-1):
    while True:
        pass


def test_an_error_names_the_line_and_the_call():
    with pytest.raises(
        CheckFailed, match=r"attention\(q=<float32 \[1, 1, 1, 2\]>[\s\S]*raised RuntimeError[\s\S]*at line"
    ):
        check_attention(attention_that_raises)


def test_a_wrong_shape_is_named():
    with pytest.raises(CheckFailed, match=r"expected shape \(1, 1, 1, 1\), got \(1, 1, 1, 2\)"):
        check_attention(attention_wrong_shape)


def test_a_wrong_type_is_named():
    with pytest.raises(CheckFailed, match=r"expected a torch.Tensor of shape"):
        check_attention(attention_returning_numpy)


def test_changing_the_input_is_rejected():
    with pytest.raises(CheckFailed, match=r"changed its input `x`"):
        check_softmax(softmax_that_changes_its_input)


def test_endless_loop_is_stopped(monkeypatch):
    import llmcourse.checks.attention as checks

    real = checks.run_check
    monkeypatch.setattr(checks, "run_check", lambda *a, **kw: real(*a, **{**kw, "seconds": 0.5}))
    with pytest.raises(CheckFailed, match=r"did not finish within its 0.5 CPU-s"):
        check_softmax(softmax_that_hangs)


# -- float16 and bfloat16 with scores of about 1e4 -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_exact_scores_are_exact_and_overflow_an_unshifted_softmax(dtype):
    """The half-precision cases' scores q·k / √16 of about ±1e4 are exact in their dtype, however the product is
    taken; an exp() without the max shift overflows (or underflows to 0 / 0) on every row, and a shifted softmax
    in the dtype is within a few eps of the float64 reference the checks expect."""
    q, k = large_exact_scores(torch.Generator().manual_seed(0), (2, 3, 4, 16), (2, 3, 9, 16), dtype)
    exact = q.double() @ k.double().mT / 4
    assert (exact.abs() > 9000).all() and (exact.abs() < 10000).all()
    for scores in (q @ k.mT / 4, (q / 4) @ k.mT, q @ k.mT * 0.25, torch.einsum("bhqd,bhkd->bhqk", q, k) / 4):
        assert torch.equal(scores.double(), exact)
    assert softmax_without_max_shift(q @ k.mT / 4).isnan().all()
    v = torch.randn(2, 3, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = (torch.softmax(exact, -1) @ v.double()).to(dtype)
    eps = torch.finfo(dtype).eps
    assert ((attention(q, k, v).double() - expected.double()).abs() <= 2 * eps * (1 + expected.double().abs())).all()


# -- the references against independent implementations -----------------------------------------


def test_reference_self_attention_equals_transformers_gpt2_attention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = transformers.GPT2Config(n_embd=24, n_head=4, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = GPT2Attention(config, layer_idx=0).eval().double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        x = torch.randn(3, 9, 24, generator=g, dtype=torch.float64)
        causal = torch.zeros(9, 9, dtype=torch.float64).masked_fill(~causal_mask(9, 9), -math.inf)
        theirs = hf(x, attention_mask=causal[None, None])[0]  # transformers' model builds this additive mask
    weights = (hf.c_attn.weight, hf.c_attn.bias, hf.c_proj.weight, hf.c_proj.bias)
    assert torch.allclose(reference_self_attention(x, *weights, 4), theirs, atol=1e-12)
    assert torch.allclose(self_attention(x, *weights, 4), theirs, atol=1e-12)


def test_reference_self_attention_is_the_engines_layer():
    from llmcourse import load_model

    model = load_model("gpt2-shakespeare", device="cpu")
    block, cfg = model.h[2], model.config
    x = torch.randn(2, 11, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        qkv = model.parts.linear(x, block.attn.c_attn.weight, block.attn.c_attn.bias)
        q, k, v = (model.parts.split_heads(t, cfg.n_head) for t in qkv.split(cfg.n_embd, dim=-1))
        engine = model.parts.linear(
            model.parts.merge_heads(model.parts.attention(q, k, v)), block.attn.c_proj.weight, block.attn.c_proj.bias
        )
        ours = reference_self_attention(
            x,
            block.attn.c_attn.weight,
            block.attn.c_attn.bias,
            block.attn.c_proj.weight,
            block.attn.c_proj.bias,
            cfg.n_head,
        )
    assert (ours - engine).abs().max() < 1e-5


def test_learner_parts_run_the_model_like_the_engine():
    from llmcourse import Parts, load_model
    from llmcourse.course.guards import guarded

    model = load_model("gpt2-shakespeare", device="cpu")
    ids = torch.tensor([[464, 1110, 286, 262, 3329, 11, 290]])
    with torch.no_grad():
        engine = model(ids)
        model.parts = guarded(
            Parts, softmax=softmax, attention=attention, split_heads=split_heads, merge_heads=merge_heads
        )
        mine = model(ids)
    assert (mine - engine).abs().max() < 1e-4
