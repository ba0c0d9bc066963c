"""The engine's tiled attention (online softmax) against torch's fused attention and torch.logsumexp, its merge of
partial attentions, and the arithmetic of the IO argument."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmcourse.engine.parts import causal_mask
from llmcourse.engine.tiled_attention import attention_io_bytes, merge_attention, tiled_attention

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
    """torch's fused attention and logsumexp, computed in float64 (a GPU's float32 kernels accumulate in their own
    order: against each other two float32 results differ by twice what each differs from the exact answer)."""
    q, k, v = q.double(), k.double(), v.double()
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
    assert (out.double() - ref_out).abs().max() < tol
    assert (lse.double() - ref_lse).abs().max() < tol * 10


def test_the_running_max_changes_in_every_block():
    """Scores that grow along the keys: without the rescaling the answer would be far off."""
    q = torch.ones(1, 1, 4, 4)
    k = torch.arange(12.0).repeat_interleave(4).reshape(1, 1, 12, 4)
    v = torch.randn(1, 1, 12, 3, generator=torch.Generator().manual_seed(0))
    out, lse = tiled_attention(q, k, v, block_size=3, causal=False)
    ref_out, ref_lse = expected(q, k, v, causal=False)
    assert torch.allclose(out.double(), ref_out, atol=1e-6) and torch.allclose(lse.double(), ref_lse, atol=1e-5)


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
    assert torch.allclose(combined.double(), expected(q, k, v, causal=False)[0], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_merging_partitions_gives_attention_over_all_keys(dtype):
    """Partitions of 4, 4 and 3 keys merged left to right, as a split-K decode step merges them."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 3, 11, 16, generator=g, dtype=torch.float64).unbind(0)
    pieces = [tiled_attention(q, k[..., s : s + 4, :], v[..., s : s + 4, :], causal=False) for s in (0, 4, 8)]
    out, lse = (t.to(dtype) for t in pieces[0])
    for piece in pieces[1:]:
        out, lse = merge_attention(out, lse, *(t.to(dtype) for t in piece))
    whole, whole_lse = expected(q, k, v, causal=False)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 16 * torch.finfo(dtype).eps)
    assert out.dtype == lse.dtype == dtype
    assert torch.allclose(out.double(), whole, atol=tol, rtol=tol)
    assert torch.allclose(lse.double(), whole_lse, atol=tol, rtol=tol)


def test_merge_is_stable_and_ignores_a_part_without_keys():
    out1, out2 = torch.randn(2, 3, 4).unbind(0)  # [Tq=3, Dv=4] each
    far = merge_attention(out1, torch.full((3,), 1000.0), out2, torch.full((3,), 800.0))  # exp(1000) overflows
    assert torch.allclose(far[0], out1) and torch.allclose(far[1], torch.full((3,), 1000.0))
    lse1, no_keys = torch.tensor([0.5, 2.0, -3.0]), torch.full((3,), -math.inf)
    empty = merge_attention(out1, lse1, torch.full((3, 4), math.nan), no_keys)  # attention over no keys: 0 / 0
    assert torch.equal(empty[0], out1) and torch.equal(empty[1], lse1)
    both = merge_attention(out1, no_keys, out2, no_keys)
    assert both[0].isfinite().all() and (both[1] == -math.inf).all()


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
