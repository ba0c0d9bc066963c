"""Chapter 02's checks: the references pass, stubs and plausible mistakes fail with a message that
says what is wrong, other correct ways of writing each exercise pass, black boxes and endless loops
are stopped, and the notebook's own solutions pass every check."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import embedding as embedding_imported_early

import llmcourse.engine.parts
from llmcourse.checks import CheckFailed
from llmcourse.checks.embeddings import check_embed, check_embedding, check_rope, check_sinusoidal_positions
from llmcourse.course.limits import work_seconds
from llmcourse.engine import positions

NOTEBOOK = Path(__file__).parents[1] / "solutions/02_embeddings/02_embeddings.ipynb"


# -- correct answers, as a learner would write them (not the engine's functions: those are black boxes)


def embedding(weight, ids):
    return weight[ids]


def embed(wte, wpe, input_ids, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return embedding(wte, input_ids) + embedding(wpe, position_ids)


def sinusoidal_positions(n_positions, dim, base=10000.0):
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    angle = position / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pe = torch.zeros(n_positions, dim, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = angle.sin(), angle.cos()
    return pe.float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x, position_ids, base=10000.0):
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position_ids[..., None].double() * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    return x * angle.cos().to(x.dtype) + rotate_half(x) * angle.sin().to(x.dtype)


REFERENCES = [
    (check_embedding, embedding),
    (check_embed, embed),
    (check_sinusoidal_positions, sinusoidal_positions),
    (check_rope, rope),
]
IDS = [check.__name__ for check, _ in REFERENCES]


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, capsys):
    check(reference)
    check(reference, seed=7, n_random=60)
    assert capsys.readouterr().out.count("✓") == 2


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_visible_checks_are_fast(check, reference, capsys):
    start = work_seconds()  # CPU time, the check's child process included: the same on a busy machine
    check(reference)
    assert work_seconds() - start < 3


def stub(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("check", [c for c, _ in REFERENCES], ids=IDS)
def test_stub_is_not_written_yet(check):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


# -- plausible mistakes, each rejected with a message that names it -------------------------------


def embedding_flat(weight, ids):
    return weight[ids.flatten()]


def embedding_from_one(weight, ids):
    return weight[ids - 1]


def embedding_first_row_only(weight, ids):  # right for a batch of one
    return (
        torch.stack([weight[i] for i in ids[0].tolist()])[None].expand(*ids.shape, -1)
        if ids.dim() == 2
        else weight[ids]
    )


def embedding_float32(weight, ids):  # right unless the table is float64
    return weight.float()[ids]


def embedding_columns(weight, ids):
    return weight.T[:, ids]


def embed_ignores_position_ids(wte, wpe, input_ids, position_ids=None):
    return wte[input_ids] + wpe[torch.arange(input_ids.shape[1])]


def embed_positions_from_one(wte, wpe, input_ids, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(1, input_ids.shape[1] + 1).expand_as(input_ids)
    return wte[input_ids] + wpe[position_ids]


def embed_concatenates(wte, wpe, input_ids, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return torch.cat([wte[input_ids], wpe[position_ids]], dim=-1)


def embed_row_zero_positions(wte, wpe, input_ids, position_ids=None):  # right unless rows differ
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1])[None]
    return wte[input_ids] + wpe[position_ids[0]]


def sinusoidal_half_split(n_positions, dim, base=10000.0):
    angle = torch.arange(n_positions)[:, None] / base ** (torch.arange(0, dim, 2) / dim)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


def sinusoidal_exponent_i(n_positions, dim, base=10000.0):
    angle = torch.arange(n_positions)[:, None] / base ** (torch.arange(dim // 2) / dim)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)


def sinusoidal_swapped(n_positions, dim, base=10000.0):
    angle = torch.arange(n_positions)[:, None] / base ** (torch.arange(0, dim, 2) / dim)
    return torch.stack([angle.cos(), angle.sin()], dim=-1).flatten(1)


def sinusoidal_float64(n_positions, dim, base=10000.0):
    return sinusoidal_positions(n_positions, dim, base).double()


def sinusoidal_ignores_base(n_positions, dim, base=10000.0):
    return sinusoidal_positions(n_positions, dim)


def rope_interleaved(x, position_ids, base=10000.0):  # GPT-J / RoFormer layout
    d = x.shape[-1]
    angle = position_ids[..., None].double() / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().to(x.dtype)[:, None], angle.sin().to(x.dtype)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rope_wrong_sign(x, position_ids, base=10000.0):
    d = x.shape[-1]
    angle = position_ids[..., None].double() / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * angle.cos().to(x.dtype) + torch.cat([x2, -x1], dim=-1) * angle.sin().to(x.dtype)


def rope_exponent_i(x, position_ids, base=10000.0):
    d = x.shape[-1]
    angle = position_ids[..., None].double() / base ** (torch.arange(d // 2, dtype=torch.float64) / d)
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    return x * angle.cos().to(x.dtype) + rotate_half(x) * angle.sin().to(x.dtype)


def rope_ignores_position_ids(x, position_ids, base=10000.0):
    T = x.shape[-2]
    return rope(x, torch.arange(T).expand(x.shape[0], T), base)


def rope_float32_angles(x, position_ids, base=10000.0):  # right for float32 input; loses float64 precision
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2) / d)  # float32
    angle = position_ids[..., None].float() * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    return x * angle.cos() + rotate_half(x) * angle.sin()  # float32 cos·float64 x promotes to float64


def rope_returns_float32(x, position_ids, base=10000.0):
    return rope(x.float(), position_ids, base)


def rope_ignores_base(x, position_ids, base=10000.0):
    return rope(x, position_ids)


def rope_first_row_positions(x, position_ids, base=10000.0):  # right unless rows differ
    return rope(x, position_ids[:1].expand_as(position_ids), base)


# -- mistakes of the kinds issue 22 found: the engine's sizes, dtypes, views, defaults, repeated calls --


def embedding_flat_view(weight, ids):  # .view on the engine's expanded position ids
    return weight[ids.view(-1)].view(*ids.shape, weight.shape[-1])


def embedding_float32_unless_float64(weight, ids):  # float16 / bfloat16 tables come back float32
    return weight[ids] if weight.dtype == torch.float64 else weight.float()[ids]


def embedding_int16_ids(weight, ids):  # ids past 32767 wrap around (to negative rows)
    return weight[ids.to(torch.int16).long()]


_EMBEDDING_CACHE = {}


def embedding_cached_by_ids(weight, ids):  # a cache keyed on part of the arguments
    key = (tuple(ids.shape), tuple(ids.flatten().tolist()))
    if key not in _EMBEDDING_CACHE:
        _EMBEDDING_CACHE[key] = weight[ids]
    return _EMBEDDING_CACHE[key]


def embedding_wrong_in_the_engine(weight, ids):  # right on every case; wrong for the bundled model's positions
    return weight[ids] * (0.5 if weight.shape == (256, 192) else 1.0)


def embed_without_default(wte, wpe, input_ids, position_ids):  # the engine calls embed(wte, wpe, input_ids)
    return embed(wte, wpe, input_ids, position_ids)


def embed_eos_as_padding(wte, wpe, input_ids, position_ids=None):
    if position_ids is None:  # counts only tokens that are not <|endoftext|>, as if it were padding
        position_ids = ((input_ids != 50256).long().cumsum(-1) - 1).clamp(min=0)
    return wte[input_ids] + wpe[position_ids]


def embed_uint8_positions(wte, wpe, input_ids, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], dtype=torch.uint8).long().expand_as(input_ids)
    return wte[input_ids] + wpe[position_ids]


def embed_float32_sum(wte, wpe, input_ids, position_ids=None):  # right for float32 and float64 only
    out = torch.zeros(
        *input_ids.shape, wte.shape[1], dtype=torch.float64 if wte.dtype == torch.float64 else torch.float32
    )
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return out + wte[input_ids] + wpe[position_ids]


def embed_flat_view(wte, wpe, input_ids, position_ids=None):
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T).repeat(B, 1)
    return wte[input_ids.view(-1)].view(B, T, -1) + wpe[position_ids.view(-1)].view(B, T, -1)


_SINUSOIDAL_CACHE = {}


def sinusoidal_cached_by_shape(n_positions, dim, base=10000.0):  # keyed on (n, dim), ignoring base
    if (n_positions, dim) not in _SINUSOIDAL_CACHE:
        _SINUSOIDAL_CACHE[(n_positions, dim)] = sinusoidal_positions(n_positions, dim, base)
    return _SINUSOIDAL_CACHE[(n_positions, dim)].clone()


def sinusoidal_uint8_positions(n_positions, dim, base=10000.0):
    position = torch.arange(n_positions).to(torch.uint8).double()[:, None]
    angle = position / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).float()


def sinusoidal_fixed_table(n_positions, dim, base=10000.0):  # a table of 2048 rows, sliced
    return sinusoidal_positions(2048, dim, base)[:n_positions]


def rope_flat_rows(x, position_ids, base=10000.0):  # .view on split_heads' non-contiguous q / k
    B, H, T, D = x.shape
    rows = x.view(-1, D)
    return rope(rows.view(B, H, T, D), position_ids, base)


def rope_float32_for_half(x, position_ids, base=10000.0):  # float32 cos and sin promote float16 x to float32
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position_ids[..., None].double() * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x * angle.cos().to(dtype) + rotate_half(x) * angle.sin().to(dtype)


_ROPE_CACHE = {}


def rope_cached_by_shape(x, position_ids, base=10000.0):  # cos / sin kept by (T, D): positions ignored after
    key = (x.shape[-2], x.shape[-1], base, x.dtype, tuple(position_ids.shape))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = position_ids.clone()
    return rope(x, _ROPE_CACHE[key], base)


def rope_uint8_positions(x, position_ids, base=10000.0):
    return rope(x, position_ids.to(torch.uint8).long(), base)


_ROPE_TABLES = {}


def rope_table_by_head_dim(x, position_ids, base=10000.0):  # transformers-like cos/sin table, keyed on D only
    d = x.shape[-1]
    if d not in _ROPE_TABLES:
        inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.arange(200000, dtype=torch.float64)[:, None] * inv_freq
        _ROPE_TABLES[d] = torch.cat([angle, angle], dim=-1)
    angle = _ROPE_TABLES[d][position_ids][:, None]
    return x * angle.cos().to(x.dtype) + rotate_half(x) * angle.sin().to(x.dtype)


def rope_angles_in_half(x, position_ids, base=10000.0):  # right for float32 and float64 x
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=x.dtype) / d)  # float16 / bfloat16 for a half x
    angle = position_ids[..., None].to(x.dtype) * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]
    return x * angle.cos() + rotate_half(x) * angle.sin()


MISTAKES = [
    (check_embedding, embedding_flat_view, r"raised RuntimeError[\s\S]*non-contiguous view[\s\S]*use \.reshape\(\)"),
    (
        check_embedding,
        embedding_float32_unless_float64,
        r"float16 weights[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*no \.float\(\)",
    ),
    (check_embedding, embedding_int16_ids, r"GPT-2's vocabulary[\s\S]*int16 holds ids only up to 32767"),
    (check_embedding, embedding_cached_by_ids, r"another table of the same shape[\s\S]*nothing may be kept"),
    (
        check_embedding,
        embedding_wrong_in_the_engine,
        r"embedding in the engine — the bundled GPT-2[\s\S]*the logits differ[\s\S]*1e-3 of the largest logit",
    ),
    (check_embed, embed_without_default, r"missing 1 required positional argument[\s\S]*position_ids=None\)"),
    (check_embed, embed_eos_as_padding, r"<\|endoftext\|> \(50256\) inside the text[\s\S]*a real token, not padding"),
    (check_embed, embed_uint8_positions, r"300 tokens[\s\S]*positions go past 255"),
    (check_embed, embed_float32_sum, r"float16 tables[\s\S]*expected dtype torch.float16, got torch.float32"),
    (check_embed, embed_flat_view, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (
        check_sinusoidal_positions,
        sinusoidal_cached_by_shape,
        r"base 100 \(a table kept[\s\S]*a table cached by \(n_positions, dim\) alone",
    ),
    (check_sinusoidal_positions, sinusoidal_uint8_positions, r"positions go past 255"),
    (
        check_sinusoidal_positions,
        sinusoidal_fixed_table,
        r"4096 positions[\s\S]*expected shape \(4096, 64\), got \(2048, 64\)[\s\S]*no table of a fixed size",
    ),
    (check_rope, rope_flat_rows, r"raised RuntimeError[\s\S]*non-contiguous view"),
    (check_rope, rope_float32_for_half, r"float16 stays float16[\s\S]*expected dtype torch.float16, got torch.float32"),
    (check_rope, rope_cached_by_shape, r"\[5, 6, 7\][\s\S]*use position_ids"),
    (check_rope, rope_uint8_positions, r"positions go past 255"),
    (check_rope, rope_table_by_head_dim, r"the base is an argument"),
    (check_rope, rope_angles_in_half, r"float16 stays float16[\s\S]*the angles were computed in x's dtype"),
    (check_embedding, embedding_flat, r"expected shape \(1, 3, 3\), got \(3, 3\)[\s\S]*keep the shape of ids"),
    (check_embedding, embedding_from_one, r"the values differ[\s\S]*ids count from 0"),
    (check_embedding, embedding_first_row_only, r"a batch of two rows[\s\S]*not ids\[0\] for all"),
    (check_embedding, embedding_float32, r"float64 weights[\s\S]*expected dtype torch.float64, got torch.float32"),
    (check_embedding, embedding_columns, r"raised IndexError|expected shape"),
    (check_embed, embed_ignores_position_ids, r"left padding[\s\S]*use position_ids when they are given"),
    (check_embed, embed_positions_from_one, r"a small example[\s\S]*positions count from 0"),
    (check_embed, embed_concatenates, r"expected shape \(1, 3, 4\), got \(1, 3, 8\)[\s\S]*do not concatenate"),
    (check_embed, embed_row_zero_positions, r"left padding[\s\S]*use position_ids\[b\] for row b"),
    (check_sinusoidal_positions, sinusoidal_half_split, r"4 positions, dim 4[\s\S]*interleave them as in the paper"),
    (check_sinusoidal_positions, sinusoidal_exponent_i, r"4 positions, dim 4[\s\S]*the exponent is 2i/dim"),
    (check_sinusoidal_positions, sinusoidal_swapped, r"one position[\s\S]*sin goes in the even columns"),
    (check_sinusoidal_positions, sinusoidal_float64, r"expected dtype torch.float32, got torch.float64"),
    (check_sinusoidal_positions, sinusoidal_ignores_base, r"base 100[\s\S]*use the base you are given"),
    (check_rope, rope_interleaved, r"a small example, D = 8[\s\S]*half-split layout[\s\S]*GPT-J"),
    (check_rope, rope_wrong_sign, r"D = 2[\s\S]*the minus goes on the second half"),
    (check_rope, rope_exponent_i, r"a small example, D = 8[\s\S]*base\^\(-2i/D\)"),
    (check_rope, rope_ignores_position_ids, r"left padding[\s\S]*use position_ids"),
    (check_rope, rope_float32_angles, r"float64 stays float64[\s\S]*compute the angles[\s\S]*in float64"),
    (check_rope, rope_returns_float32, r"expected dtype torch.float64, got torch.float32"),
    (check_rope, rope_ignores_base, r"base 500000[\s\S]*the base is an argument"),
    (check_rope, rope_first_row_positions, r"left padding[\s\S]*row b uses position_ids\[b\]"),
    (check_rope, lambda x, position_ids, base=10000.0: x.clone(), r"D = 2[\s\S]*rotate x: out = x·cos"),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[getattr(w, "__name__", "?") for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


def test_a_float32_only_mistake_passes_every_float32_case(capsys):
    """rope_float32_angles is what transformers does for float32: only float64 cases may reject it."""
    with pytest.raises(CheckFailed, match="float64"):
        check_rope(rope_float32_angles)
    x = torch.randn(2, 3, 4, 64)
    pos = torch.tensor([[0, 1, 2, 3], [2000, 2001, 2002, 2003]])
    assert (rope_float32_angles(x, pos) - positions.rope(x, pos)).abs().max() < 1e-3


# -- correct answers written differently ------------------------------------------------------------


def embedding_one_hot(weight, ids):
    return F.one_hot(ids, weight.shape[0]).to(weight.dtype) @ weight


def embedding_index_select(weight, ids):
    return torch.index_select(weight, 0, ids.reshape(-1)).reshape(*ids.shape, weight.shape[1])


def embed_broadcast(wte, wpe, input_ids, position_ids=None):
    positions_ = wpe[: input_ids.shape[1]][None] if position_ids is None else wpe[position_ids]
    return wte[input_ids] + positions_


def embedding_gather(weight, ids):
    flat = ids.reshape(-1, 1).expand(-1, weight.shape[1])
    return torch.gather(weight, 0, flat).reshape(*ids.shape, weight.shape[1])


def embed_numpy_positions_float64_sum(wte, wpe, input_ids, position_ids=None):
    """Positions from numpy (int64), the sum in float64, rounded once to the tables' dtype."""
    import numpy as np

    if position_ids is None:
        position_ids = torch.from_numpy(np.broadcast_to(np.arange(input_ids.shape[1]), tuple(input_ids.shape)).copy())
    return (wte[input_ids].double() + wpe[position_ids].double()).to(wte.dtype)


def sinusoidal_numpy(n_positions, dim, base=10000.0):
    import numpy as np

    angle = np.arange(n_positions)[:, None] / np.power(base, np.arange(0, dim, 2) / dim)
    pe = np.empty((n_positions, dim))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    return torch.from_numpy(pe.astype(np.float32))


@__import__("functools").lru_cache(maxsize=16)
def _sinusoidal_table(n_positions, dim, base):
    return sinusoidal_positions(n_positions, dim, base)


def sinusoidal_cached_by_every_argument(n_positions, dim, base=10000.0):
    return _sinusoidal_table(n_positions, dim, base).clone()


def rope_numpy(x, position_ids, base=10000.0):
    import numpy as np

    d = x.shape[-1]
    angle = position_ids.numpy()[..., None] * np.power(float(base), -np.arange(0, d, 2) / d)  # [B, T, D/2]
    angle = np.concatenate([angle, angle], axis=-1)[:, None]
    xs = x.double().numpy()
    rotated = np.concatenate([-xs[..., d // 2 :], xs[..., : d // 2]], axis=-1)
    return torch.from_numpy(xs * np.cos(angle) + rotated * np.sin(angle)).to(x.dtype)


def sinusoidal_float32_loop(n_positions, dim, base=10000.0):
    """Written from the paper in float32, column by column."""
    pe = torch.zeros(n_positions, dim)
    p = torch.arange(n_positions, dtype=torch.float32)
    for i in range(dim // 2):
        w = 1.0 / base ** (2 * i / dim)
        pe[:, 2 * i] = torch.sin(p * w)
        pe[:, 2 * i + 1] = torch.cos(p * w)
    return pe


def sinusoidal_exp_log(n_positions, dim, base=10000.0):
    """The annotated transformer's form: exp(-2i·ln(base)/dim)."""
    div = torch.exp(torch.arange(0, dim, 2).float() * (-torch.log(torch.tensor(base)) / dim))
    angle = torch.arange(n_positions).float()[:, None] * div
    return torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(n_positions, dim)


def rope_complex(x, position_ids, base=10000.0):
    """Meta's complex-number form, on the half-split pairs (x[i], x[i + D/2])."""
    d = x.shape[-1]
    real = torch.float64
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=real) / d)
    angle = position_ids[..., None].to(real) * inv_freq  # [B, T, D/2]
    turn = torch.polar(torch.ones_like(angle), angle)[:, None]  # [B, 1, T, D/2]
    x1, x2 = x.to(real).chunk(2, dim=-1)
    z = torch.complex(x1, x2) * turn
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def rope_hf_style_in_x_dtype(x, position_ids, base=10000.0):
    """As transformers writes it, with the angles in x's dtype (float32 for float32: allowed), and in float32
    for float16 / bfloat16 (as transformers does), cos and sin then cast to x's dtype."""
    d = x.shape[-1]
    angle_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=angle_dtype) / d)
    freqs = position_ids[..., None].to(angle_dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    return x * cos + rotate_half(x) * sin


def rope_matrix(x, position_ids, base=10000.0):
    """An explicit D×D rotation matrix per position."""
    B, H, T, D = x.shape
    half = D // 2
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = position_ids[..., None].double() * inv_freq  # [B, T, D/2]
    R = torch.zeros(B, T, D, D, dtype=torch.float64)
    i = torch.arange(half)
    R[..., i, i] = angle.cos()
    R[..., i + half, i + half] = angle.cos()
    R[..., i, i + half] = -angle.sin()
    R[..., i + half, i] = angle.sin()
    return torch.einsum("btij,bhtj->bhti", R, x.double()).to(x.dtype)


ALTERNATIVES = [
    (check_embedding, embedding_one_hot),
    (check_embedding, embedding_index_select),
    (check_embed, embed_broadcast),
    (check_embedding, embedding_gather),
    (check_embed, embed_numpy_positions_float64_sum),
    (check_sinusoidal_positions, sinusoidal_numpy),
    (check_sinusoidal_positions, sinusoidal_cached_by_every_argument),
    (check_rope, rope_numpy),
    (check_sinusoidal_positions, sinusoidal_float32_loop),
    (check_sinusoidal_positions, sinusoidal_exp_log),
    (check_rope, rope_complex),
    (check_rope, rope_hf_style_in_x_dtype),
    (check_rope, rope_matrix),
]


@pytest.mark.parametrize("check, alternative", ALTERNATIVES, ids=[a.__name__ for _, a in ALTERNATIVES])
def test_correct_alternative_passes(check, alternative, capsys):
    check(alternative)
    check(alternative, seed=101, n_random=30)
    assert capsys.readouterr().out.count("✓") == 2


# -- black boxes, however reached ------------------------------------------------------------------


class LookupModule(torch.nn.Embedding):
    pass


def embedding_through_module(weight, ids):
    table = LookupModule(*weight.shape)
    table.weight.data = weight
    return table(ids).detach()


BLACK_BOXES = [
    (check_embedding, lambda weight, ids: F.embedding(ids, weight), r"called torch\.(nn\.functional\.)?embedding"),
    (
        check_embedding,
        lambda weight, ids: embedding_imported_early(ids, weight),
        r"called torch\.(nn\.functional\.)?embedding",
    ),
    (check_embedding, lambda weight, ids: torch.embedding(weight, ids), r"called torch\.embedding"),
    (check_embedding, lambda weight, ids: torch.ops.aten.embedding(weight, ids), r"called .*embedding"),
    (check_embedding, embedding_through_module, r"called torch\.(nn\.(modules\.sparse\.)?Embedding|embedding)"),
    (
        check_embedding,
        lambda weight, ids: llmcourse.engine.parts.embedding(weight, ids),
        r"called llmcourse\.engine\.parts\.embedding",
    ),
    (
        check_embed,
        lambda wte, wpe, ids, pos=None: F.embedding(ids, wte) + wpe[: ids.shape[1]],
        r"called torch\.(nn\.functional\.)?embedding",
    ),
    (
        check_sinusoidal_positions,
        lambda n, dim, base=10000.0: positions.sinusoidal_positions(n, dim, base),
        r"called llmcourse\.engine\.positions\.sinusoidal_positions",
    ),
    (
        check_rope,
        lambda x, pos, base=10000.0: positions.rope(x, pos, base),
        r"called llmcourse\.engine\.positions\.rope",
    ),
    (check_rope, lambda x, pos, base=10000.0: x * 0 + positions.rotate_half(x), r"called llmcourse\.engine\.positions"),
    (
        check_rope,
        lambda x, pos, base=10000.0: sys.modules["transformers.models.llama.modeling_llama"].apply_rotary_pos_emb(
            x, x, *positions.rope_cos_sin(pos, x.shape[-1], base, x.dtype)
        )[0],
        r"called (transformers|llmcourse\.engine\.positions)",
    ),
]


@pytest.mark.parametrize(
    "check, wrong, message", BLACK_BOXES, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(BLACK_BOXES)]
)
def test_black_box_is_rejected_however_it_is_reached(check, wrong, message):
    pytest.importorskip("transformers.models.llama.modeling_llama")
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


def test_the_engine_still_works_after_a_check_that_forbids_it():
    with pytest.raises(CheckFailed):
        check_embedding(lambda weight, ids: F.embedding(ids, weight))
    assert sys.getprofile() is None
    assert torch.equal(
        llmcourse.engine.parts.embedding(torch.eye(3), torch.tensor([[2]])), torch.tensor([[[0.0, 0, 1]]])
    )


# -- crashes, hangs, wrong types ------------------------------------------------------------------


def test_a_function_that_raises_is_reported_with_its_line():
    def rope_bad_shapes(x, position_ids, base=10000.0):
        angle = position_ids * base  # [B, T]: misses the D/2 axis
        return x * angle.cos()

    with pytest.raises(CheckFailed, match=r"rope\(.*\) raised RuntimeError[\s\S]*at line"):
        check_rope(rope_bad_shapes)


def test_a_wrong_type_is_reported():
    with pytest.raises(CheckFailed, match=r"expected a torch\.Tensor of shape \(1, 3, 3\), got \["):
        check_embedding(lambda weight, ids: weight[ids].tolist())


def test_an_endless_loop_is_stopped(monkeypatch):
    import llmcourse.checks.embeddings as module

    real = module.run_check
    monkeypatch.setattr(module, "run_check", lambda *a, **kw: real(*a, **{**kw, "seconds": 0.5}))

    def embedding_forever(weight, ids):
        while True:
            pass

    with pytest.raises(CheckFailed, match=r"did not finish within its 0.5 CPU-s[\s\S]*weight\[ids\]"):
        check_embedding(embedding_forever)


def test_changing_the_input_is_reported():
    def rope_in_place(x, position_ids, base=10000.0):
        out = rope(x, position_ids, base)
        x.mul_(0)
        return out

    with pytest.raises(CheckFailed, match=r"changed its input `x`"):
        check_rope(rope_in_place)
