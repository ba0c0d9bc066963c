"""Tiled attention with an online softmax (the FlashAttention forward), and the memory traffic it saves.

Plain attention builds the whole score matrix S = QKᵀ/√D [Tq, Tk], its softmax P, then P V. The
tiled version walks over blocks of keys and values and keeps, per query row, only a running
maximum `m`, a running denominator `l` and an accumulator `acc` of the weighted values. When a new
block raises the maximum, the old `l` and `acc` are rescaled by exp(m_old - m_new), so at the end
acc / l is exactly softmax(S) V, and m + log(l) is the row's log-sum-exp — what a backward pass
(or a split over several devices) needs. On a GPU each block lives in on-chip memory and S is never
written to main memory; here, in PyTorch, the loop shows the arithmetic.

    >>> q, k, v = torch.randn(3, 1, 2, 10, 8).unbind(0)
    >>> out, lse = tiled_attention(q, k, v, block_size=4)
    >>> out.shape, lse.shape
    (torch.Size([1, 2, 10, 8]), torch.Size([1, 2, 10]))
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, block_size: int = 64, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Attention over blocks of `block_size` queries and keys: (out [B, H, Tq, Dv], lse [B, H, Tq]).

    q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv]. With `causal`, the queries are the last Tq of
    the Tk positions (query i sits at position Tk - Tq + i and sees keys 0 .. Tk - Tq + i).
    lse is the log-sum-exp of each row of the scaled (and masked) scores.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[-2]
    scale = 1.0 / math.sqrt(D)
    offset = Tk - Tq  # position of query 0 among the keys
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)  # [B, H, Tq, Dv]
    lse = torch.empty(B, H, Tq, dtype=q.dtype, device=q.device)
    for q0 in range(0, Tq, block_size):
        q_blk = q[:, :, q0 : q0 + block_size]  # [B, H, Bq, D]
        rows = q_blk.shape[-2]
        m = torch.full((B, H, rows, 1), -math.inf, dtype=q.dtype, device=q.device)  # running max
        l = torch.zeros(B, H, rows, 1, dtype=q.dtype, device=q.device)  # running sum of exp(s - m)
        acc = torch.zeros(B, H, rows, v.shape[-1], dtype=q.dtype, device=q.device)  # running sum of exp(s - m) v
        last_key = offset + q0 + rows if causal else Tk  # keys at or after this are masked for every row
        for k0 in range(0, last_key, block_size):
            s = q_blk @ k[:, :, k0 : k0 + block_size].transpose(-2, -1) * scale  # [B, H, Bq, Bk]
            if causal:
                query_pos = offset + q0 + torch.arange(rows, device=q.device)
                key_pos = k0 + torch.arange(s.shape[-1], device=q.device)
                s = s.masked_fill(key_pos[None, :] > query_pos[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # finite: every row sees key 0
            rescale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
            p = torch.exp(s - m_new)  # [B, H, Bq, Bk]
            l = l * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + p @ v[:, :, k0 : k0 + block_size]
            m = m_new
        out[:, :, q0 : q0 + rows] = acc / l
        lse[:, :, q0 : q0 + rows] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def merge_attention(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two attentions of the same queries over disjoint sets of keys into the attention over both.

    out1, out2 [..., Tq, Dv] and lse1, lse2 [..., Tq] (each row's log-sum-exp of its scaled scores) ->
    (out [..., Tq, Dv], lse [..., Tq]). Each part's weights sum to 1 over its own keys; over both, part i
    holds exp(lse_i) / (exp(lse1) + exp(lse2)) of the mass. Computed from the larger lse, so nothing
    overflows; a part that saw no keys (lse = -inf) contributes nothing. The split-K decode of long
    contexts and attention over cached keys plus new keys both end with this merge.

    >>> q, k, v = torch.randn(3, 1, 1, 6, 4).unbind(0)
    >>> whole, _ = tiled_attention(q, k, v, block_size=6, causal=False)
    >>> a, b = (tiled_attention(q, k[..., s, :], v[..., s, :], causal=False) for s in (slice(0, 2), slice(2, 6)))
    >>> torch.allclose(merge_attention(*a, *b)[0], whole, atol=1e-6)
    True
    """
    lse = torch.logaddexp(lse1, lse2)  # [..., Tq]
    lse_safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)  # no keys at all: weights 0
    w1 = torch.exp(lse1 - lse_safe).unsqueeze(-1)  # [..., Tq, 1]
    w2 = torch.exp(lse2 - lse_safe).unsqueeze(-1)
    part1 = torch.where(w1 > 0, w1 * out1, 0.0)  # an empty part's out may be nan (0/0): it weighs nothing
    part2 = torch.where(w2 > 0, w2 * out2, 0.0)
    return part1 + part2, lse


def attention_io_bytes(
    seq_len: int,
    n_layer: int,
    n_head: int,
    head_dim: int,
    *,
    batch_size: int = 1,
    bytes_per_value: int = 2,
    block_rows: int = 128,
) -> dict[str, int]:
    """Bytes of main-memory traffic of attention in one forward pass over `seq_len` tokens, all layers.

    - scores: what a plain implementation moves for its score matrices, 4·T² values per head and
      layer: QKᵀ writes S, the softmax reads S and writes P (scale and mask fused into it), P V reads P.
    - qkv_out: q, k, v read once and out written once (4·T·D values), which every version moves.
    - lse: the tiled version's extra output, one float32 per query row.
    - kv_rereads: the tiled version reads k and v once per block of `block_rows` queries, so
      ceil(T / block_rows) - 1 more times than once (counted as main-memory traffic: an upper bound, Dao et al.
      2022's Θ(T²d²/M) with block_rows = M/d).

    The tiled version moves qkv_out + lse + kv_rereads and no scores at all.

        >>> attention_io_bytes(1024, 12, 12, 64)["scores"]  # GPT-2 124M, 1024 tokens, fp16
        1207959552
    """
    T, heads = seq_len, batch_size * n_layer * n_head
    return {
        "scores": heads * 4 * T * T * bytes_per_value,
        "qkv_out": heads * 4 * T * head_dim * bytes_per_value,
        "lse": heads * T * 4,
        "kv_rereads": heads * (math.ceil(T / block_rows) - 1) * 2 * T * head_dim * bytes_per_value,
    }
