"""llmcourse.engine.positions against independent references: transformers' Llama rotary embedding and
`apply_rotary_pos_emb`, the formula of *Attention Is All You Need* written out entry by entry, and
the property RoPE exists for (q·k depends only on the distance between the positions)."""

import math

import pytest
import torch

from llmcourse.engine.positions import rope, rope_cos_sin, rotate_half, sinusoidal_positions

from .conftest import DEVICES

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402


def hf_rope(x, position_ids, base):
    """transformers' RoPE for Llama: LlamaRotaryEmbedding (cos, sin) + apply_rotary_pos_emb."""
    head_dim = x.shape[-1]
    config = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    cos, sin = llama.LlamaRotaryEmbedding(config)(x, position_ids)  # [B, T, D] each, computed in float32
    q, k = llama.apply_rotary_pos_emb(x, x.flip(-2), cos, sin)
    return q, k


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6])
def test_rope_equals_transformers_llama(head_dim, base):
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(2, 3, 5, head_dim, generator=g)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]])  # row 1: left padding
    q, k = hf_rope(x, position_ids, base)
    assert (rope(x, position_ids, base) - q).abs().max() < 1e-5
    assert (rope(x.flip(-2), position_ids, base) - k).abs().max() < 1e-5


@pytest.mark.parametrize("start", [1000, 4000])
def test_rope_equals_transformers_when_decoding_far_along(start):
    """At large positions transformers' float32 angles differ from ours (float64) by ~position × 6e-8."""
    x = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([[start], [start // 3]])
    q, _ = hf_rope(x, position_ids, 10000.0)
    assert (rope(x, position_ids) - q).abs().max() < 1e-6 * start * float(x.abs().max())


def test_rope_in_float64_equals_apply_rotary_pos_emb_with_float64_angles():
    """apply_rotary_pos_emb is dtype-agnostic: given float64 cos/sin it is the float64 reference."""
    x = torch.randn(2, 2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    position_ids = torch.tensor([[0, 1, 2], [99998, 99999, 100000]])
    cos, sin = rope_cos_sin(position_ids, 16, 10000.0, torch.float64)
    q, _ = llama.apply_rotary_pos_emb(x, x, cos, sin)
    out = rope(x, position_ids)
    assert out.dtype == torch.float64
    assert (out - q).abs().max() < 1e-12
    # transformers' own cos/sin are float32 angles: at position 100000 they are visibly off
    hf_cos, _ = llama.LlamaRotaryEmbedding(LlamaConfig(hidden_size=16, num_attention_heads=1, head_dim=16))(
        x, position_ids
    )
    assert (hf_cos - cos).abs().max() > 1e-4


def test_rotate_half_is_transformers():
    x = torch.randn(3, 8)
    assert torch.equal(rotate_half(x), llama.rotate_half(x))


def test_rope_is_a_rotation_of_each_half_split_pair():
    x = torch.randn(1, 1, 1, 6, dtype=torch.float64)
    p, base, d = 7, 10000.0, 6
    out = rope(x, torch.tensor([[p]]), base)
    for i in range(d // 2):
        angle = p * base ** (-2 * i / d)
        a, b = x[0, 0, 0, i], x[0, 0, 0, i + d // 2]
        assert math.isclose(out[0, 0, 0, i], a * math.cos(angle) - b * math.sin(angle), abs_tol=1e-12)
        assert math.isclose(out[0, 0, 0, i + d // 2], a * math.sin(angle) + b * math.cos(angle), abs_tol=1e-12)
    assert torch.allclose(out.norm(), x.norm())  # a rotation keeps lengths


def test_rope_scores_depend_only_on_the_distance():
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64),
    )

    def score(m, n):
        return float((rope(q, torch.tensor([[m]])) * rope(k, torch.tensor([[n]]))).sum())

    assert math.isclose(score(5, 2), score(103, 100), abs_tol=1e-10)
    assert math.isclose(score(5, 2), score(3003, 3000), abs_tol=1e-10)
    assert not math.isclose(score(5, 2), score(6, 2), abs_tol=1e-3)


@pytest.mark.parametrize(
    "n_positions, dim, base", [(1, 2, 10000.0), (50, 16, 10000.0), (300, 64, 100.0), (7, 5, 10000.0)]
)
def test_sinusoidal_positions_is_the_papers_formula(n_positions, dim, base):
    pe = sinusoidal_positions(n_positions, dim, base)
    assert pe.dtype == torch.float32 and pe.shape == (n_positions, dim)
    for p in range(0, n_positions, max(1, n_positions // 7)):
        for j in range(dim):
            i = j // 2
            angle = p / base ** (2 * i / dim)
            want = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert math.isclose(pe[p, j], want, abs_tol=1e-6)


def test_sinusoidal_positions_row_zero_and_the_first_pair():
    pe = sinusoidal_positions(100, 8)
    assert torch.equal(pe[0], torch.tensor([0.0, 1.0] * 4))
    assert torch.allclose(pe[:, 0], torch.sin(torch.arange(100.0)), atol=1e-6)  # pair 0 turns 1 radian a position


@pytest.mark.parametrize("device", DEVICES)
def test_rope_runs_where_its_input_is(device):
    """A learner's rope slot may be the engine's own function: on a GPU its angles are computed there too."""
    g = torch.Generator().manual_seed(0)
    x, position_ids = torch.randn(2, 3, 5, 8, generator=g), torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    on_device = rope(x.to(device), position_ids.to(device), 500.0)
    assert on_device.device.type == device
    torch.testing.assert_close(on_device.cpu(), rope(x, position_ids, 500.0), rtol=1e-6, atol=1e-6)
