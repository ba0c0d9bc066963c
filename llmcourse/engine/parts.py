"""The named parts the models' forward passes are built from (GPT-2's and the Llama family's), and the slots
learners plug into.

Each part is a plain function on tensors. `Parts()` holds the engine's own, and `model.parts` the ones
the model's forward pass calls; `Parts().replace(gelu=my_gelu)` swaps one for a function with the same
signature (`llmcourse.course.guards.guarded(Parts, ...)` does so with each one guarded).

    >>> x = torch.tensor([[-1.0, 0.0, 2.0]])
    >>> Parts().gelu(x)
    tensor([[-0.1588,  0.0000,  1.9546]])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels, positions
from .checkpoints import load_llama_checkpoint
from .slots import Slots


def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """Row lookup: weight [N, C], ids [B, T] (long) -> [B, T, C]. Used for tokens and positions."""
    return F.embedding(ids, weight)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Normalize the last dim to mean 0, variance 1, then scale and shift. x [..., C] -> [..., C]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x @ weight + bias with GPT-2's weight layout [C_in, C_out]. x [..., C_in] -> [..., C_out].
    (A few float32 rows on the CPU, a decode step's, go through the engine's C kernel: `cpu_kernels.linear`.)"""
    return cpu_kernels.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[-1])


def gelu(x: Tensor) -> Tensor:
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    return F.gelu(x, approximate="tanh")


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along `dim`, computed stably."""
    return torch.softmax(x, dim=dim)


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """[B, T, C] -> [B, n_head, T, C // n_head]."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, n_head, T, head_dim] -> [B, T, n_head * head_dim]."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def causal_mask(n_query: int, n_key: int, device=None) -> Tensor:
    """Bool [n_query, n_key], True where query i may see key j: queries are the last n_query keys."""
    query_pos = torch.arange(n_key - n_query, n_key, device=device)
    return torch.arange(n_key, device=device)[None, :] <= query_pos[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Scaled dot-product attention with torch's fused kernel.

    q [B, H, Tq, D], k and v [B, H, Tk, D] -> [B, H, Tq, D]. `mask` is bool, broadcastable to
    [B, H, Tq, Tk], True where attending is allowed; None means causal, with the queries being the
    last Tq positions of the Tk keys (prefill: Tq == Tk; decode: Tq == 1).
    """
    if q.shape[-2] == 1 and q.shape[-2] != k.shape[-2]:  # a decode step: the engine's kernel where it applies
        return cpu_kernels.decode_attention(q, k, v, mask)
    if mask is None:
        if q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_with_softmax(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, softmax: Callable = softmax
) -> Tensor:
    """The same attention written out, so that a plugged-in `softmax` part is the one used."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, Tq, Tk]
    if mask is None:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ v


def attention_causal_by_default(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, attention: Callable
) -> Tensor:
    """A plugged-in `attention` reads mask=None as "attend everywhere", like torch's; the model's None
    means causal, so the model's call is given the causal mask explicitly."""
    if mask is None:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    return attention(q, k, v, mask)


# -- the Llama family's parts (chapter 11) ------------------------------------------------------------


def rope(x: Tensor, position_ids: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding, half-split layout (chapter 02): x [B, H, T, D], position_ids [B, T] -> same.
    Positions may be floats (chapter 11 passes angles as the positions of 2-dimensional pairs: see `Llama.rotation`)."""
    return positions.rope(x, position_ids, base)


def rope_frequencies(head_dim: int, rope_theta: float, rope_scaling: Optional[dict]) -> Tensor:
    """Each rotated pair's angular speed as a checkpoint ships it: float64 [head_dim / 2], pair i (dims i and
    i + D/2) turning by position × speed[i] radians.

    Unscaled (`rope_scaling` None or {"rope_type": "default"}): 1 / rope_theta ** (2i / head_dim), chapter 02's.
    "linear" (Position Interpolation, Chen et al. 2023): every speed divided by "factor". "llama3" (Llama 3.1 / 3.2):
    with wavelength 2π / speed and the original context L = "original_max_position_embeddings", pairs slower than
    L / "low_freq_factor" are divided by "factor", pairs faster than L / "high_freq_factor" are kept, and those in
    between blended, smooth = (L / wavelength - low) / (high - low): (1 - smooth) · speed / factor + smooth · speed.
    Equal to transformers' `ROPE_INIT_FUNCTIONS` (which compute in float32).

        >>> rope_frequencies(4, 100.0, None)                                  # 100^0, 100^-1/2
        tensor([1.0000, 0.1000], dtype=torch.float64)
        >>> rope_frequencies(4, 100.0, {"rope_type": "linear", "factor": 4.0})
        tensor([0.2500, 0.0250], dtype=torch.float64)
    """
    inv_freq = positions.rope_inv_freq(head_dim, rope_theta)  # [D/2] float64
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low) / (high - low)  # 0 at the slow edge, 1 at the fast edge
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        slow, fast = wavelen > old_context / low, wavelen < old_context / high
        return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))
    if kind != "default":
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not one of default, linear, llama3")
    return inv_freq


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm: x / √(mean(x²) + eps) over the last dim, then times `weight`. x [..., C] -> [..., C].

    No mean subtracted and no bias (what LayerNorm has in addition). Computed in float32, cast back to x's dtype,
    then scaled, as transformers' LlamaRMSNorm does.

        >>> rms_norm(torch.tensor([[3.0, -4.0]]), torch.ones(2), 0.0)   # rms of (3, -4) is √12.5
        tensor([[ 0.8485, -1.1314]])
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The gated activation of Llama's MLP: silu(gate) · up, with silu(g) = g · sigmoid(g). [..., F] each -> [..., F].

    >>> swiglu(torch.tensor([0.0, 1.0]), torch.tensor([5.0, 2.0]))
    tensor([0.0000, 1.4621])
    """
    return F.silu(gate) * up


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Grouped-query attention's sharing by copying: each of the H_kv key (or value) heads repeated for its n_rep
    query heads. x [B, H_kv, T, D] -> [B, H_kv · n_rep, T, D], query head h reading KV head h // n_rep. Not a slot:
    the engine attends with `grouped_attention`, which reads each KV head once; this is the reference it equals
    (`attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)`) and chapter 11's warm-up.

        >>> repeat_kv(torch.tensor([1.0, 2.0]).view(1, 2, 1, 1), 2).flatten()
        tensor([1., 1., 2., 2.])
    """
    if n_rep == 1:
        return x
    B, H_kv, T, D = x.shape
    return x[:, :, None].expand(B, H_kv, n_rep, T, D).reshape(B, H_kv * n_rep, T, D)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], attention: Callable) -> Tensor:
    """Grouped-query attention that reads each KV head once: q [B, H, T, D], k and v [B, H_kv, Tk, D] (H a multiple
    of H_kv) -> [B, H, T, D], query head h attending with KV head h // n_rep, n_rep = H // H_kv.

    The n_rep query heads that share a KV head become rows of one MHA-shaped attention: q viewed as
    [B, H_kv, n_rep · T, D] (row r · T + t: the group's r-th head at position t), so `attention(q, k, v, mask)`
    (chapter 03's slot, q and k with the same head count) runs once on the unrepeated k and v, and nothing copies
    them (`repeat_kv` would: n_rep copies of every KV head). The mask is tiled per group here: `mask` None
    (causal, the T queries being the last T of the Tk positions) becomes `causal_mask(T, Tk)` repeated n_rep times
    along the rows, [n_rep · T, Tk] (`attention`'s own None would take the n_rep · T rows for the last positions);
    a bool mask broadcastable to [B, H, T, Tk] (True: attend) is expanded to that and viewed [B, H_kv, n_rep · T, Tk].
    n_rep == 1 is `attention(q, k, v, mask)` as it is. With the engine's own `attention`, kernels that read KV head
    h // n_rep themselves: a decode step (T == 1) the C kernel `cpu_kernels.decode_attention`, and on a CPU torch's
    flash kernel with `enable_gqa` (causal prefill then skips the blocks above the diagonal, as the tiled mask cannot).

        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g), torch.ones(1, 2, 3, 8)
        >>> grouped_attention(q, k, v, None, attention).shape
        torch.Size([1, 4, 3, 8])
        >>> torch.allclose(grouped_attention(q, k, v, None, attention), attention(q, repeat_kv(k, 2), repeat_kv(v, 2)))
        True
    """
    B, H, T, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    n_rep = H // H_kv
    if n_rep == 1:
        return attention(q, k, v, mask)
    if attention is Parts.attention:  # the engine's own: kernels that read KV head h // n_rep themselves
        if T == 1:
            return cpu_kernels.decode_attention(q, k, v, mask)
        if q.device.type == "cpu":  # torch's CPU flash kernel groups the heads (enable_gqa) and skips masked blocks
            if mask is None and T == Tk:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            mask = causal_mask(T, Tk, q.device) if mask is None else mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    rows = q.reshape(B, H_kv, n_rep * T, D)  # the query heads of KV head g are rows of its own attention
    if mask is None:
        mask = causal_mask(T, Tk, q.device).repeat(n_rep, 1)  # [n_rep * T, Tk]: each head's causal rows, stacked
    else:
        mask = mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep * T, Tk)  # (a bool copy where a view cannot do)
    out = attention(rows, k, v, mask)  # [B, H_kv, n_rep * T, Dv]
    return out.reshape(B, H, T, out.shape[-1])


def qk_norm(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Qwen3's QK-norm: RMSNorm of every head's query and key vector over head_dim, before RoPE, so that q·k
    cannot grow without bound. q [B, H, T, D], k [B, H_kv, T, D], weights [D] -> (q, k), same shapes."""
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def llama_block(x: Tensor, layer, config, rope: Callable, attend: Callable, parts: "Parts") -> Tensor:
    """One Llama decoder layer, pre-norm with residuals: x [B, T, C] -> [B, T, C].

    `layer` holds the weights (transformers' names: `input_layernorm`, `self_attn.q_proj` ..., `mlp.gate_proj` ...);
    each projection is called as `layer.self_attn.q_proj(h, parts.linear)`. `rope(t)` rotates queries or keys
    [B, heads, T, D] for this forward's positions; `attend(q, k, v)` stores k and v in the cache and attends (each
    of its H_kv heads read once for its n_rep query heads: `grouped_attention`) -> [B, H, T, D]. Every other
    function comes from `parts`.
    """
    p, attn, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(attn.q_proj(h, p.linear), config.n_head)  # [B, H, T, D]
    k = p.split_heads(attn.k_proj(h, p.linear), config.n_kv_head)  # [B, H_kv, T, D]
    v = p.split_heads(attn.v_proj(h, p.linear), config.n_kv_head)  # [B, H_kv, T, D]
    if config.qk_norm:
        q, k = p.qk_norm(q, k, attn.q_norm.weight, attn.k_norm.weight, eps)
    x = x + attn.o_proj(p.merge_heads(attend(rope(q), rope(k), v)), p.linear)
    h = p.rms_norm(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    return x + mlp.down_proj(p.swiglu(mlp.gate_proj(h, p.linear), mlp.up_proj(h, p.linear)), p.linear)


@dataclasses.dataclass(frozen=True)
class Parts(Slots):
    """The functions the models' forward passes call (GPT-2's, then the Llama family's); see each function's
    docstring. The fused `attention` computes its own softmax: `attention_with_softmax` is the written-out one,
    for a replaced `softmax`. `load_llama_checkpoint` is the Llama family's loader (`checkpoints`), which
    `load_model` runs."""

    embedding: Callable = embedding
    layer_norm: Callable = layer_norm
    linear: Callable = linear
    gelu: Callable = gelu
    softmax: Callable = softmax
    attention: Callable = attention
    split_heads: Callable = split_heads
    merge_heads: Callable = merge_heads
    rope: Callable = rope
    rope_frequencies: Callable = rope_frequencies
    rms_norm: Callable = rms_norm
    swiglu: Callable = swiglu
    grouped_attention: Callable = grouped_attention
    qk_norm: Callable = qk_norm
    llama_block: Callable = llama_block
    load_llama_checkpoint: Callable = load_llama_checkpoint
