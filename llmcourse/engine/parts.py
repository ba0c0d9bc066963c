"""The named parts GPT-2's forward pass is built from, and the slots learners plug into.

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

from .slots import Slots


def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """Row lookup: weight [N, C], ids [B, T] (long) -> [B, T, C]. Used for tokens and positions."""
    return F.embedding(ids, weight)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Normalize the last dim to mean 0, variance 1, then scale and shift. x [..., C] -> [..., C]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x @ weight + bias with GPT-2's weight layout [C_in, C_out]. x [..., C_in] -> [..., C_out]."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])


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
    if mask is None:
        if q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.shape[-2] == 1:
            return F.scaled_dot_product_attention(q, k, v)
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


@dataclasses.dataclass(frozen=True)
class Parts(Slots):
    """The functions the model's forward pass calls; see each function's docstring. The fused `attention`
    computes its own softmax: `attention_with_softmax` is the written-out one, for a replaced `softmax`."""

    embedding: Callable = embedding
    layer_norm: Callable = layer_norm
    linear: Callable = linear
    gelu: Callable = gelu
    softmax: Callable = softmax
    attention: Callable = attention
    split_heads: Callable = split_heads
    merge_heads: Callable = merge_heads
