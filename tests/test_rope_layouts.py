"""RoPE's two layouts: RoFormer's (Su et al.), which Stanford CS336's assignment 1 uses, turns neighbouring
dimensions (2i, 2i + 1) together; Llama checkpoints and transformers turn i with i + D/2 (the engine's `rope`,
chapter 02). Pair i turns at the same speed theta^(-2i/D) in both, so they differ by a permutation of the q/k
features: perm = [0, 2, 4, ..., 1, 3, 5, ...] (the even dimensions, then the odd ones) sends RoFormer's pair i to
(i, i + D/2). Weights or code from one convention run in the other with their q and k rows (the output features of
q_proj and k_proj, per head) permuted; q·k, all attention reads, is unchanged.

The engine's `rope` passes CS336's own RoPE test once permuted: `tests/test_model.py::test_rope` of
github.com/stanford-cs336/assignment1-basics (commit 25a8a49f6460c83a30416d42348f2ef11d1dd185), its input made as
its conftest makes it (`torch.manual_seed(4); torch.randn(4, 12, 64)`, d_k 64, theta 10000, positions 0-11) and its
expected output the snapshot `tests/_snapshots/test_rope.npz`, copied here as `tests/data/cs336/test_rope.npz` under
CS336's MIT license (`tests/data/cs336/LICENSE`), with CS336's tolerance (atol 1e-6, rtol 1e-4; measured: 5.4e-7).
Unpermuted it is off by 5.4. The interleaved rotation written here from RoFormer's formula meets the same snapshot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmcourse.engine.parts import rope

SNAPSHOT = Path(__file__).parent / "data" / "cs336" / "test_rope.npz"


def half_split_order(d: int) -> torch.Tensor:
    """perm: x[..., perm] puts RoFormer's pair (2i, 2i + 1) at the engine's (i, i + D/2)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoFormer's layout, as CS336 specifies it: x [..., T, D], positions [..., T]; pair (x_2i, x_2i+1) of the token at
    position p turned by p · theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions[..., None].double() * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [..., T, D/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def cs336_case() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    generator = torch.Generator().manual_seed(4)  # torch.manual_seed(4); torch.randn(...), as CS336's conftest
    x = torch.randn(4, 12, 64, generator=generator)
    return x, torch.arange(12), np.load(SNAPSHOT)["array"]


def test_the_engines_rope_passes_cs336s_rope_test_once_permuted():
    x, positions, expected = cs336_case()
    perm = half_split_order(64)
    ours = rope(x[:, None, :, perm], positions.expand(4, 12))[:, 0]  # [B, 1 head, T, D], then back to [B, T, D]
    got = ours[..., torch.argsort(perm)]
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6, rtol=1e-4)  # CS336's test_rope tolerance
    unpermuted = rope(x[:, None], positions.expand(4, 12))[:, 0]
    assert np.abs(unpermuted.numpy() - expected).max() > 1  # the layouts really differ
    np.testing.assert_allclose(interleaved_rope(x, positions).numpy(), expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("d, theta", [(8, 10000.0), (64, 500000.0), (128, 1e6)])
def test_the_layouts_differ_by_the_permutation_and_q_dot_k_is_unchanged(d, theta):
    g = torch.Generator().manual_seed(d)
    x, positions = torch.randn(2, 3, 5, d, generator=g), torch.randint(0, 4000, (2, 5), generator=g)
    perm = half_split_order(d)
    ours = rope(x[..., perm], positions, theta)  # [B, H, T, D]
    theirs = interleaved_rope(x, positions[:, None], theta)
    torch.testing.assert_close(ours, theirs[..., perm], atol=2e-6, rtol=1e-5)
    # q_proj and k_proj rows of an interleaved checkpoint, permuted per head: the same scores with the engine's rope
    h, k = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    wq, wk = torch.randn(d, 16, generator=g), torch.randn(d, 16, generator=g)
    q_i, k_i = (interleaved_rope((t @ w.T)[:, None], positions[:, None], theta) for t, w in ((h, wq), (k, wk)))
    q_h, k_h = (rope((t @ w[perm].T)[:, None], positions, theta) for t, w in ((h, wq), (k, wk)))
    torch.testing.assert_close(q_h @ k_h.transpose(-2, -1), q_i @ k_i.transpose(-2, -1), atol=1e-3, rtol=1e-4)
