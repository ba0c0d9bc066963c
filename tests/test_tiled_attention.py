"""The engine's tiled attention (online softmax) against torch's fused attention and torch.logsumexp,
and the arithmetic of the IO argument."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmcourse.engine.parts import causal_mask
from llmcourse.engine.tiled_attention import attention_io_bytes, tiled_attention

from .conftest import DEVICES

SHAPES = [  # B, H, Tq, Tk, D, Dv, block_size, causal
    (1, 1, 1, 1, 4, 4, 64, True),
    (2, 3, 16, 16, 8, 8, 4, True),
    (1, 2, 13, 13, 8, 8, 5, True),  # the block size does not divide T
    (2, 2, 7, 13, 16, 16, 4, True),  # queries at the end of the keys
    (1, 1, 1, 11, 8, 8, 3, True),  # decode
    (2, 2, 10, 10, 8, 5, 3, False),  # values of another width, no mask
    (1, 2, 6, 9, 8, 8, 2, False),
    (1, 1, 9, 9, 4, 4, 1, True),
    (1, 2, 300, 300, 64, 64, 64, True),
]


def expected(q, k, v, causal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    if causal:
        scores = scores.masked_fill(~mask, -math.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_equals_fused_attention_and_logsumexp(shape, dtype, device):
    B, H, Tq, Tk, D, Dv, block, causal = shape
    g = torch.Generator().manual_seed(Tq * 31 + Tk)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=dtype) * 3 for T in (Tq, Tk))
    v = torch.randn(B, H, Tk, Dv, generator=g, dtype=dtype)
    q, k, v = q.to(device), k.to(device), v.to(device)
    out, lse = tiled_attention(q, k, v, block_size=block, causal=causal)
    ref_out, ref_lse = expected(q, k, v, causal)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert out.dtype == lse.dtype == dtype and out.device == q.device
    assert out.shape == (B, H, Tq, Dv) and lse.shape == (B, H, Tq)
    assert (out - ref_out).abs().max() < tol
    assert (lse - ref_lse).abs().max() < tol * 10


def test_the_running_max_changes_in_every_block():
    """Scores that grow along the keys: without the rescaling the answer would be far off."""
    q = torch.ones(1, 1, 4, 4)
    k = torch.arange(12.0).repeat_interleave(4).reshape(1, 1, 12, 4)
    v = torch.randn(1, 1, 12, 3, generator=torch.Generator().manual_seed(0))
    out, lse = tiled_attention(q, k, v, block_size=3, causal=False)
    ref_out, ref_lse = expected(q, k, v, causal=False)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_extreme_scores_stay_finite():
    q = torch.full((1, 1, 5, 8), 40.0)
    k = torch.linspace(-40, 40, 5 * 8).reshape(1, 1, 5, 8)
    out, lse = tiled_attention(q, k, torch.randn(1, 1, 5, 8), block_size=2)
    assert out.isfinite().all() and lse.isfinite().all()


def test_pieces_combine_through_the_lse():
    """What the lse is for: attention over two halves of the keys, combined, is attention over all."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    out_a, lse_a = tiled_attention(q, k[:, :, :5], v[:, :, :5], block_size=4, causal=False)
    out_b, lse_b = tiled_attention(q, k[:, :, 5:], v[:, :, 5:], block_size=4, causal=False)
    lse = torch.logaddexp(lse_a, lse_b)
    combined = out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]
    assert torch.allclose(combined, expected(q, k, v, causal=False)[0], atol=1e-6)


def test_io_bytes_follow_the_stated_assumptions():
    gpt2 = attention_io_bytes(1024, n_layer=12, n_head=12, head_dim=64)
    assert gpt2["scores"] == 12 * 12 * 4 * 1024 * 1024 * 2 == 1_207_959_552
    assert gpt2["qkv_out"] == 12 * 12 * 4 * 1024 * 64 * 2
    assert gpt2["lse"] == 12 * 12 * 1024 * 4
    assert gpt2["kv_rereads"] == 12 * 12 * 7 * 2 * 1024 * 64 * 2  # 8 blocks of 128 queries: 7 more reads
    big = attention_io_bytes(8192, n_layer=32, n_head=32, head_dim=128)
    assert big["scores"] == 549_755_813_888 and big["scores"] == 64 * attention_io_bytes(1024, 32, 32, 128)["scores"]
    assert attention_io_bytes(100, 1, 1, 8, block_rows=128)["kv_rereads"] == 0
    assert attention_io_bytes(64, 2, 3, 8, batch_size=5)["scores"] == 5 * attention_io_bytes(64, 2, 3, 8)["scores"]
