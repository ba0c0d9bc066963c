"""Position information for a transformer: the sinusoidal encoding and rotary embeddings (RoPE).

GPT-2 needs neither: it *learns* a table of position embeddings (`wpe`, one row per position) and
adds a row to each token's embedding. These are the two other ways chapter 02 teaches, written as
the references its checks compare learners against:

- `sinusoidal_positions`: the fixed encoding of *Attention Is All You Need* (Vaswani et al., 2017),
  added to the token embeddings like GPT-2's learned table; sin and cos interleaved, as in the paper.
- `rope`: rotary position embeddings (Su et al., RoFormer), in the *half-split* layout that
  Llama, Qwen and Mistral checkpoints on Hugging Face use: dimension i is paired with i + D/2 (not
  with its neighbour). It rotates the queries and keys of every attention layer, after their
  projections and before q·k, so that q·k depends only on the distance between the two positions.

    >>> sinusoidal_positions(2, 4)
    tensor([[0.0000, 1.0000, 0.0000, 1.0000],
            [0.8415, 0.5403, 0.0100, 0.9999]])
    >>> rope(torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[1]]))  # D = 2: one pair, turned by 1 radian
    tensor([[[[0.5403, 0.8415]]]])
"""

from __future__ import annotations

import torch
from torch import Tensor


def sinusoidal_positions(n_positions: int, dim: int, base: float = 10000.0) -> Tensor:
    """The sinusoidal encoding: float32 [n_positions, dim], row p for position p.

    PE[p, 2i] = sin(p / base^(2i/dim)) and PE[p, 2i+1] = cos(p / base^(2i/dim)): pair i turns at
    angular speed base^(-2i/dim), from 1 radian per position (i = 0) down to about 1/base.

        >>> sinusoidal_positions(3, 2)[:, 0]   # dim 2: sin(p), p = 0, 1, 2
        tensor([0.0000, 0.8415, 0.9093])
    """
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]  # [P, 1]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [ceil(dim/2)]
    angle = position * inv_freq  # [P, ceil(dim/2)]
    pe = torch.empty(n_positions, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : dim // 2])  # an odd dim ends with a sine
    return pe.float()


def rope_inv_freq(head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float64, device=None) -> Tensor:
    """The angular speed of each of the D/2 rotated pairs: base^(-2i/D), i = 0 .. D/2 - 1. [D/2]"""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim))


def rope_cos_sin(
    position_ids: Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of every position's angles, each [B, T, D], the D/2 angles written twice (half-split).

    The angles are computed in float64 whatever `dtype` is: position × speed reaches thousands of
    radians, where float32 is off by about 1e-4 (see the chapter).
    """
    speed = rope_inv_freq(head_dim, base, device=position_ids.device)  # on the GPU too, where the positions are
    angle = position_ids[..., None].double() * speed  # [B, T, D/2]
    angle = torch.cat([angle, angle], dim=-1)  # [B, T, D]: pair i is (i, i + D/2)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1], with x1, x2 the two halves of the last dim: each pair turned by 90°."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x: Tensor, position_ids: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding, half-split layout: x [B, H, T, D] (D even), position_ids [B, T] -> [B, H, T, D].

    Pair (x[..., i], x[..., i + D/2]) of the token at position p is rotated by the angle
    p · base^(-2i/D). Rows of a batch may have different positions (left padding, decoding at an
    offset). The result has x's dtype.

        >>> x = torch.tensor([[[[1.0, 1.0, 0.0, 0.0]]]])  # [1, 1, 1, 4]: pairs (x0, x2) = (x1, x3) = (1, 0)
        >>> rope(x, torch.tensor([[2]]), base=1.0)       # base 1: both pairs turned by 2 radians
        tensor([[[[-0.4161, -0.4161,  0.9093,  0.9093]]]])
    """
    cos, sin = rope_cos_sin(position_ids, x.shape[-1], base, x.dtype)  # [B, T, D]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]: the same rotation for every head
    return x * cos + rotate_half(x) * sin
