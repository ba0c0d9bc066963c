"""Weight quantization (int8 absmax per row, int4 Q4_0 groups of 32), proven against references that
do not use `llmcourse.engine.quantize`: quantizers written here in numpy (a loop over groups, and a
vectorized one), a float model holding the dequantized weights (the "twin"), and the float model.

- the formats: q, scales and packed bytes equal to the independent quantizers bit for bit; every
  byte packed and unpacked; round trips; error bounds; refusals;
- accuracy on the bundled model (validation loss, greedy agreement with fp32) and the logits'
  error on random 124M weights;
- equivalence wherever the float model goes: generate, sampling, stream, beams, batches, the KV
  cache, `LLMEngine`, speculative decoding, compile=True, float64 / bfloat16 activations, CUDA;
- save and load without re-quantizing, refused checkpoints, the command line, resident memory.

Measured when written (CPU, one thread; the tests that assert them print them, run with -s): validation
loss on the first 2,049 held-out tokens fp32 3.9894, int8 3.9900 (+0.02 %), int4 4.0015 (+0.30 %);
greedy agreement with fp32 over 8 held-out prompts x 32 tokens: int8 25.8 tokens before the first
difference, int4 7.0 (four of those prompts end where fp32's top two logits are 0.04 to 0.11 apart and
int4's logits move by up to 1.9); random 124M weights, 32-token prompt, logits up to 2.8: max error int8
0.099, int4 0.79 (in norm 3.6 % and 27 %; with the exact dequantized weights and float inputs 2.5 % and
27 %: the rest of int8's is its 8-bit inputs). Weights in memory: bundled fp32 49.5 MB, int8 12.8 MB,
int4 7.2 MB; 124M 497.8, 127.7, 73.1 MB; the files are the same sizes.
"""

from __future__ import annotations

import copy
import importlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmcourse import GPT2, GPT2Config, generate, generate_text, get_tokenizer, load_model, save_model, stream
from llmcourse.engine.config import CheckpointError
from llmcourse.engine.loading import MODELS_DIR
from llmcourse.engine.quantize import (
    BYTES_PER_WEIGHT,
    GROUP_SIZE,
    Quantization,
    QuantizedAffine,
    QuantizedTable,
    activation_absmax,
    affine_layers,
    dequantize_int4,
    dequantize_int8,
    int8_linear,
    int8_linear_fast,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_format,
    resident_bytes,
    smooth_scales,
    unpack_int4,
    weight_memory,
)
from llmcourse.engine.speculative import SpeculationStats
from llmcourse.training.shakespeare import validation_loss, validation_tokens

from .conftest import CUDA, lively_model

generation = importlib.import_module("llmcourse.engine.generate")  # the module (the package exports its function)
FORMATS = ["int8", "int4"]
SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=97)
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Independent quantizers, in numpy: float32 arithmetic, as the format prescribes.


def my_int8(w) -> tuple[np.ndarray, np.ndarray]:
    """Absmax per row: (q [N, K] int8, scale [N] float32); a zero row has scale 0 and q 0."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / np.float32(127)
    divisor = np.where(scale == 0, np.float32(1), scale)[:, None]
    return np.clip(np.rint(w / divisor), -127, 127).astype(np.int8), scale.astype(np.float32)


def my_pack(q) -> np.ndarray:
    """Nibbles by arithmetic: byte i = (q[2i] mod 16) + 16 * (q[2i+1] mod 16)."""
    q = np.asarray(q, dtype=np.int64)
    return (q[..., 0::2] % 16 + 16 * (q[..., 1::2] % 16)).astype(np.uint8)


def my_unpack(packed) -> np.ndarray:
    b = np.asarray(packed, dtype=np.int64)
    v = np.stack([b % 16, b // 16], axis=-1).reshape(*b.shape[:-1], -1)
    return np.where(v > 7, v - 16, v).astype(np.int8)


def my_int4_loop(w, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 as llama.cpp's reference writes it: a loop over groups; the first value of largest magnitude
    m gives scale = m / -8 (stored, and used, as float16); q = clamp(round(w / scale), -8, 7)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    q, scales = np.zeros((n, k), np.int8), np.zeros((n, k // group), np.float16)
    for r in range(n):
        for g in range(k // group):
            block = w[r, g * group : (g + 1) * group]
            m = np.float32(0)
            for v in block:
                if abs(v) > abs(m):
                    m = v
            scales[r, g] = np.float16(m / np.float32(-8))
            if scales[r, g] != 0:
                q[r, g * group : (g + 1) * group] = np.clip(np.rint(block / np.float32(scales[r, g])), -8, 7)
    return my_pack(q), scales


def my_int4(w, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The same, vectorized (for whole models): argmax takes the first of equal magnitudes."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)  # [n, G, 1]
    scales = (m / np.float32(-8)).astype(np.float16)
    s = scales.astype(np.float32)
    q = np.where(s == 0, 0, np.clip(np.rint(blocks / np.where(s == 0, 1, s)), -8, 7)).astype(np.int8)
    return my_pack(q.reshape(n, k)), scales[..., 0]


def my_dequantize_int4(packed, scales) -> np.ndarray:
    q = my_unpack(packed).astype(np.float32)
    n, k = q.shape
    g = np.asarray(scales, dtype=np.float32).shape[1]
    return (q.reshape(n, g, -1) * np.asarray(scales, dtype=np.float32)[..., None]).reshape(n, k)


def twin(model: GPT2) -> GPT2:
    """A float GPT2 holding a quantized model's weights, dequantized here (not by `llmcourse.engine.quantize`)."""
    float_model = GPT2(model.config).init_weights().eval()
    state = {k: v for k, v in model.state_dict().items()}

    def weight(prefix):
        q, s = state[f"{prefix}.qweight"].numpy(), state[f"{prefix}.scales"].float().numpy()
        w = q.astype(np.float32) * s[:, None] if quantized_format(model) == "int8" else my_dequantize_int4(q, s)
        return torch.from_numpy(np.ascontiguousarray(w))  # [C_out, C_in]

    with torch.no_grad():
        for name, tensor in float_model.state_dict().items():
            if name == "wte.weight":
                tensor.copy_(weight("wte"))
            elif name.endswith("weight") and any(f".{layer}." in f".{name}" for layer in LINEARS):
                tensor.copy_(weight(name.removesuffix(".weight")).T)  # GPT-2's layout is [C_in, C_out]
            else:
                tensor.copy_(state[name])
    return float_model.requires_grad_(False)


def random_weights(seed: int, n: int, k: int) -> torch.Tensor:
    """Rows of very different ranges: far from 0 and from their mean, tiny, huge, with outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 3, n)[:, None]
    w[0] += 50.0  # all far from 0, one sign
    w[1] = 0.0  # all zero
    w[2, k // 2] = 1e4  # one outlier
    w[3] = -w[3].abs()  # all negative
    w[4, :] = torch.where(torch.arange(k) % 2 == 0, 2.0, -2.0)  # ties between +m and -m
    return w


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------------------------
# The formats, bit for bit.


def test_my_two_int4_quantizers_agree():
    w = random_weights(0, 7, 96).numpy()
    loop, vectorized = my_int4_loop(w), my_int4(w)
    assert np.array_equal(loop[0], vectorized[0]) and np.array_equal(loop[1], vectorized[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 5), (12, 192), (3, 1), (1, 769)])
def test_quantize_int8_equals_an_independent_quantizer(shape, dtype):
    w = random_weights(sum(shape), max(shape[0], 5), shape[1])[: shape[0]].to(dtype)
    q, scale = quantize_int8(w)
    my_q, my_scale = my_int8(w.float().numpy())
    assert q.dtype == torch.int8 and q.shape == shape and scale.dtype == torch.float32 and scale.shape == shape[:1]
    assert np.array_equal(scale.numpy(), my_scale), (scale, my_scale)
    assert np.array_equal(q.numpy(), my_q)
    assert q.abs().max() <= 127
    deq = dequantize_int8(q, scale)
    assert deq.dtype == torch.float32 and torch.equal(deq, q.float() * scale[:, None])
    err = (w.float() - deq).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6) + 1e-30).all(), "|w - dequantized| > scale / 2"


def test_int8_edge_rows():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [-3.0, 1.5, 3.0], [1e-3, 0.0, -2.54e-3]])
    q, scale = quantize_int8(w)
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [-127, 64, 127], [50, 0, -127]]  # 63.5 -> 64 (half to even)
    assert scale[1] == 0 and dequantize_int8(q, scale)[1].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(dequantize_int8(q, scale)[:, 1], torch.tensor([-1.0, 0.0, 3 / 127 * 64, 0.0]))


def test_every_byte_packs_and_unpacks():
    values = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(values, values)  # [256, 2]: (first, second)
    packed = pack_int4(pairs)  # [256, 1]
    assert packed.dtype == torch.uint8 and packed.shape == (256, 1)
    expected = [(int(a) & 0xF) | ((int(b) & 0xF) << 4) for a, b in pairs.tolist()]
    assert packed[:, 0].tolist() == expected
    assert sorted(expected) == list(range(256))  # a bijection
    assert torch.equal(unpack_int4(packed), pairs)
    every_byte = torch.arange(256, dtype=torch.uint8)[:, None]
    assert np.array_equal(unpack_int4(every_byte).numpy(), my_unpack(every_byte.numpy()))
    assert pack_int4(torch.tensor([-1, 0], dtype=torch.int8)).item() == 0x0F  # first value in the low nibble
    assert pack_int4(torch.tensor([0, -1], dtype=torch.int8)).item() == 0xF0
    assert pack_int4(torch.tensor([-8, 7], dtype=torch.int8)).item() == 0x78
    assert pack_int4(torch.tensor([1, 2], dtype=torch.int8)).item() == 0x21


def test_pack_round_trips_with_leading_dimensions():
    q = torch.randint(-8, 8, (2, 3, 10), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (2, 3, 5) and packed.dtype == torch.uint8
    assert np.array_equal(packed.numpy(), my_pack(q.numpy()))
    assert torch.equal(unpack_int4(packed), q) and unpack_int4(packed).dtype == torch.int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("shape", [(7, 32), (5, 96), (12, 192)])
def test_quantize_int4_equals_an_independent_quantizer(shape, dtype):
    w = random_weights(shape[1] + 3, max(shape[0], 5), shape[1])[: shape[0]]
    w = w.clamp(-6e4, 6e4).to(dtype)  # float16's range
    packed, scales = quantize_int4(w)
    my_packed, my_scales = my_int4_loop(w.float().numpy())
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert scales.dtype == torch.float16 and scales.shape == (shape[0], shape[1] // 32)
    assert np.array_equal(scales.numpy(), my_scales)
    assert np.array_equal(packed.numpy(), my_packed)
    deq = dequantize_int4(packed, scales)
    assert deq.dtype == torch.float32 and np.array_equal(deq.numpy(), my_dequantize_int4(my_packed, my_scales))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizing_dequantized_weights_gives_the_same_values(fmt):
    """A round trip: the dequantized weights are exactly representable, so they quantize to themselves."""
    w = random_weights(8, 24, 128)
    quantize, dequantize = (quantize_int8, dequantize_int8) if fmt == "int8" else (quantize_int4, dequantize_int4)
    q, s = quantize(w)
    q2, s2 = quantize(dequantize(q, s))
    assert torch.equal(q2, q) and torch.equal(s2, s)  # int4: -8 * scale / -8 is exact; int8: 127 * s / 127 here


def test_int4_error_is_at_most_half_a_step_except_where_clamped():
    w = random_weights(5, 64, 256)
    packed, scales = quantize_int4(w)
    q = unpack_int4(packed).view(64, 8, 32).float()
    s = scales.float().view(64, 8, 1)
    groups = w.view(64, 8, 32)
    err = (groups - dequantize_int4(packed, scales).view(64, 8, 32)).abs()
    clamped = (groups / s.where(s != 0, 1.0)).round() > 7  # only +8 (the opposite of the largest) is clamped
    assert (q.min(dim=-1).values[s[..., 0] != 0] == -8).all(), "the largest magnitude must map to -8"
    assert (err[~clamped] <= (s.abs() / 2 * (1 + 1e-3)).expand_as(err)[~clamped] + 1e-30).all()
    assert clamped.any() and (err[clamped] <= (s.abs() * (1 + 1e-3)).expand_as(err)[clamped]).all()
    assert (q[clamped] == 7).all()


def test_int4_edge_groups():
    w = torch.zeros(3, 32)
    w[1] = torch.linspace(-1, 1, 32)
    w[2, 0], w[2, 1] = 0.8, -0.8  # a tie: the first wins, its sign decides the scale's
    packed, scales = quantize_int4(w)
    q = unpack_int4(packed)
    assert scales[0].item() == 0 and q[0].abs().sum() == 0  # a zero group: scale 0, q 0
    assert scales[1].item() == pytest.approx(1 / 8, rel=1e-3) and q[1, 0] == -8 and q[1, -1] == 7  # 1 / (1/8) = 8 -> 7
    assert scales[2].item() == pytest.approx(-0.1, rel=1e-3) and q[2, :2].tolist() == [-8, 7]


def test_sizes_that_do_not_fit_are_refused_clearly():
    with pytest.raises(ValueError, match=r"even number of values in the last dimension, got 5"):
        pack_int4(torch.zeros(2, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\(48\) is a multiple of the group size \(32\)"):
        quantize_int4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"unknown format 'int3'; use one of float32, float16, bfloat16, int8, int4"):
        weight_memory(10, "int3")
    with pytest.raises(ValueError, match=r"'int3' is not a format; use 'int8' or 'int4'"):
        load_model("gpt2-shakespeare", quantize="int3")
    with pytest.raises(ValueError, match="already quantized to int8"):
        quantize_model(quantize_model(lively_model(SMALL), "int8"), "int4")


def test_weight_memory_formula():
    assert weight_memory(7e9, "float32") == 28e9 and weight_memory(7e9, "float16") == 14e9
    assert weight_memory(7e9, "bfloat16") == 14e9 and weight_memory(70e9, "int8") == 70e9
    assert weight_memory(7e9, "int4") == pytest.approx(3.9375e9) and BYTES_PER_WEIGHT["int4"] * 8 == 4.5
    assert weight_memory(0, "int4") == 0 and GROUP_SIZE == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_int8_linear_is_the_integer_route(dtype):
    """Each row of x rounded to int8 by its own absmax, the integer products summed exactly (here in int64),
    the sums times both scales; close to the float layer (the activations' rounding: under 1 %)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g) * torch.logspace(-2, 2, 40)[:, None]
    q, scale = quantize_int8(w)
    x = torch.randn(2, 3, 24, generator=g, dtype=torch.float64) * 5 + 3
    bias = torch.randn(40, generator=g)
    xq, xs = quantize_int8(x.to(dtype).reshape(6, 24))
    exact = ((xq.long() @ q.long().T).double() * xs.double()[:, None] * scale.double()).view(2, 3, 40)
    float_layer = x @ (q.double() * scale.double()[:, None]).T
    for b in (bias, None):
        y = int8_linear(x.to(dtype), q, scale, None if b is None else b.to(dtype))
        assert y.dtype == dtype and y.shape == (2, 3, 40)
        extra = 0 if b is None else b.to(dtype).double()
        tol = {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
        assert ((y.double() - exact - extra).abs() / exact.abs().amax()).max() < tol
        assert ((y.double() - extra - float_layer).norm() / float_layer.norm()) < 0.01


def test_the_fast_int8_route_is_the_reference_and_independent_of_the_batch():
    """`int8_linear_fast` (C kernel up to 16 rows, torch._int_mm above) gives the reference's numbers bit for bit;
    exact integer sums make a row's result the same alone or in any batch."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 192, generator=g) * 0.02
    q, scale = quantize_int8(w)
    x = torch.randn(8, 5, 192, generator=g) * torch.logspace(-1, 2, 8)[:, None, None]
    bias = torch.randn(256, generator=g)
    fast, reference = int8_linear_fast(x, q, scale, bias), int8_linear(x, q, scale, bias)
    assert torch.equal(fast, reference)
    for rows in (x[3:4], x[3:4, 2:3], x[[3, 0]]):
        alone = int8_linear_fast(rows, q, scale, bias)
        assert torch.equal(alone[0], fast[3, : alone.shape[1]] if alone.shape[1] == 5 else fast[3, 2:3])
        assert torch.equal(int8_linear(rows, q, scale, bias), alone)


def test_smooth_scales_even_out_a_planted_outlier_channel():
    """SmoothQuant's factors: (x / s) @ (W diag(s)).T = x @ W.T, and with one input channel 80x the others the
    int8 route's output error drops well below plain rounding's; zero channels get 1."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 128, generator=g)
    x[:, 9] *= 80
    w = torch.randn(64, 128, generator=g) * 0.05
    s = smooth_scales(x.abs().amax(dim=0), w)
    assert s.shape == (128,) and s.dtype == torch.float32 and s[9] > 5 * s.median()
    assert torch.allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-3)
    exact = x.double() @ w.double().T

    def error(x, w):
        q, scale = quantize_int8(w)
        return ((int8_linear(x, q, scale, None).double() - exact).norm() / exact.norm()).item()

    plain, smoothed = error(x, w), error(x / s, w * s)
    assert smoothed < plain / 3, (plain, smoothed)
    zero = smooth_scales(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([[1.0, 0.0, 4.0]]), 0.3)
    assert torch.equal(zero[:2], torch.ones(2)) and zero[2] == pytest.approx(4**-0.7)


def test_quantize_model_with_a_calibration_smooths_the_blocks_layers(small):
    """`calibration=` records each layer's input maxima in one forward pass and smooths its weight; without it
    nothing changes (no `smooth`); a smoothed model computes the float model's logits as closely as a plain one."""
    model = small[None]
    assert all(layer.smooth is None for _, _, layer in affine_layers(small["int8"]))
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(8))
    smoothed = quantize_model(copy.deepcopy(model), "int8", calibration=ids)
    layer = smoothed.h[1].mlp.c_fc
    assert layer.smooth.shape == (64,) and smoothed.wte.smooth is None
    absmax = activation_absmax(model, ids)[model.h[1].mlp.c_fc]
    assert torch.equal(layer.smooth, smooth_scales(absmax, model.h[1].mlp.c_fc.weight.T))
    with torch.inference_mode():
        want, plain, got = model(ids), small["int8"](ids), smoothed(ids)
    assert ((got - want).norm() / want.norm()) < 2 * ((plain - want).norm() / want.norm()) + 1e-3
    assert generate(smoothed, [5, 17, 33], max_new_tokens=8, eos_token_id=None) == generate(
        small["int8"], [5, 17, 33], max_new_tokens=8, eos_token_id=None
    )


def test_a_saved_smoothed_model_loads_as_it_was(bundled, tmp_path):
    smoothed = quantize_model(copy.deepcopy(bundled[None]), "int8", calibration=[5, 17, 33, 90])
    save_model(smoothed, tmp_path)
    again = load_model(tmp_path)
    assert torch.equal(again.h[2].mlp.c_proj.smooth, smoothed.h[2].mlp.c_proj.smooth)
    assert generate(again, [5, 17, 33], max_new_tokens=6) == generate(smoothed, [5, 17, 33], max_new_tokens=6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fast_routes_for_any_number_of_rows_and_any_layout(fmt):
    """Decode (1 row), small batches and prefill take different routes on the CPU (C kernels up to some
    rows, library calls above); all must give the reference's product, whatever the strides of the
    stored tensors (`quantize_model` quantizes `weight.T`, a transposed view: bug tests-1)."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(192, 100, generator=g) * 0.05  # GPT-2's layout [C_in, C_out]
    q, s = (quantize_int8 if fmt == "int8" else quantize_int4)(weight.T)  # rows = outputs
    layer = QuantizedAffine(192, 100, fmt)
    w = dequantize_int8(q, s) if fmt == "int8" else dequantize_int4(q, s)
    bias = torch.randn(100, generator=g)
    qz = Quantization()
    for stored in ((q, s), (q.contiguous(), s.contiguous())):
        layer.qweight, layer.scales = stored
        for m in (1, 2, 5, 16, 17, 40):
            x = torch.randn(m, 192, generator=g, dtype=torch.float64) * 3 + 1
            want = x @ w.double().T + bias.double()
            got = qz.linear(x.float(), layer, bias)
            rel = ((got.double() - want).norm() / want.norm()).item()
            assert got.shape == (m, 100) and rel < 0.01, (m, stored[0].stride(), rel)
            alone = qz.linear(x[:1].float(), layer, bias)  # a row's result does not depend on the batch
            if fmt == "int8":  # exact integer sums times the same scales, whichever route
                assert torch.equal(alone[0], got[0]), (m, (alone[0] - got[0]).abs().max())
            else:  # integer sums per group, added in float in an order that may depend on the route
                assert torch.allclose(alone[0], got[0], rtol=1e-5, atol=1e-5), (m, (alone[0] - got[0]).abs().max())


# ---------------------------------------------------------------------------------------------
# The quantized model's tensors.


@pytest.fixture(scope="module")
def bundled():
    """The bundled model, float and quantized."""
    return {fmt: load_model("gpt2-shakespeare", device="cpu", quantize=fmt) for fmt in (None, *FORMATS)}


@pytest.fixture(scope="module")
def small():
    """A small random model with lively continuations (vocab 97) and its quantized copies."""
    model = lively_model(SMALL, seed=1)
    return {None: model, **{fmt: quantize_model(copy.deepcopy(model), fmt) for fmt in FORMATS}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_model_holds_the_independent_quantizers_values(bundled, fmt):
    model, float_model = bundled[fmt], bundled[None]
    mine = my_int8 if fmt == "int8" else my_int4
    for i in (0, 5):
        for name in LINEARS:
            layer, original = model.h[i].get_submodule(name), float_model.h[i].get_submodule(name)
            assert type(layer) is QuantizedAffine and layer.format == fmt
            q, s = mine(original.weight.T.numpy())  # rows are outputs
            assert np.array_equal(layer.qweight.numpy(), q) and np.array_equal(layer.scales.numpy(), s), f"h.{i}.{name}"
            assert torch.equal(layer.bias, original.bias)
    assert type(model.wte) is QuantizedTable and not hasattr(model.wte, "bias")
    rows = slice(1000, 1400)  # a slice of the token table (also the tied head)
    q, s = mine(float_model.wte.weight[rows].numpy())
    assert np.array_equal(model.wte.qweight[rows].numpy(), q) and np.array_equal(model.wte.scales[rows].numpy(), s)
    for name, tensor in float_model.state_dict().items():  # what stays float stays equal
        if "ln_" in name or name == "wpe.weight":
            assert torch.equal(model.state_dict()[name], tensor), name
    expected = {
        "int8": (torch.int8, (576, 192), torch.float32, (576,)),
        "int4": (torch.uint8, (576, 96), torch.float16, (576, 6)),
    }[fmt]
    c_attn = model.h[0].attn.c_attn
    assert (
        c_attn.qweight.dtype,
        tuple(c_attn.qweight.shape),
        c_attn.scales.dtype,
        tuple(c_attn.scales.shape),
    ) == expected
    assert quantize_model(model, fmt) is model  # already in this format: nothing to do


# ---------------------------------------------------------------------------------------------
# Accuracy.

VALIDATION_TOKENS = 2049  # 8 windows of 256 predicted tokens


def test_validation_loss_stays_within_bounds(bundled):
    tokens = validation_tokens()[:VALIDATION_TOKENS]
    loss = {fmt: validation_loss(bundled[fmt], tokens) for fmt in (None, *FORMATS)}
    rel = {fmt: loss[fmt] / loss[None] - 1 for fmt in FORMATS}
    print(
        f"\nvalidation loss on {VALIDATION_TOKENS} tokens: fp32 {loss[None]:.4f}, int8 {loss['int8']:.4f} "
        f"({rel['int8']:+.2%}), int4 {loss['int4']:.4f} ({rel['int4']:+.2%})"
    )
    assert 3.5 < loss[None] < 5.0
    assert abs(rel["int8"]) < 0.005, rel
    assert abs(rel["int4"]) < 0.03, rel
    assert loss["int8"] != loss[None] and loss["int4"] != loss["int8"]  # the quantized weights are used


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    ids = validation_tokens().tolist()
    step = (len(ids) - length) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def test_greedy_continuations_agree_with_fp32(bundled):
    """Tokens until the first difference from fp32's greedy continuation, over 8 held-out prompts
    (one batch of equal lengths, so no padding)."""
    prompts = held_out_prompts(8, 16)
    reference = generate(bundled[None], prompts, max_new_tokens=32, eos_token_id=None)
    agreement = {}
    for fmt in FORMATS:
        out = generate(bundled[fmt], prompts, max_new_tokens=32, eos_token_id=None)
        agreement[fmt] = [first_difference(a, b) for a, b in zip(reference, out)]
    mean = {fmt: sum(v) / len(v) for fmt, v in agreement.items()}
    print(
        f"\ngreedy agreement with fp32 (of 32): int8 {agreement['int8']} mean {mean['int8']:.1f}, "
        f"int4 {agreement['int4']} mean {mean['int4']:.1f}"
    )
    assert mean["int8"] >= 16, agreement
    assert mean["int4"] >= 3, agreement


@pytest.fixture(scope="module")
def gpt2_124m():
    """Random 124M weights (GPT-2's initialization), float and quantized (the copies share nothing)."""
    model = GPT2(GPT2Config()).init_weights(seed=7).eval().requires_grad_(False)
    return {None: model, **{fmt: quantize_model(copy.deepcopy(model), fmt) for fmt in FORMATS}}


def test_logits_error_on_random_124m_weights(gpt2_124m):
    ids = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        logits = {fmt: model(ids) for fmt, model in gpt2_124m.items()}
    scale = logits[None].abs().max().item()
    report = {}
    for fmt in FORMATS:
        diff = logits[fmt] - logits[None]
        report[fmt] = (diff.abs().max().item(), (diff.norm() / logits[None].norm()).item())
    print(
        f"\n124M random weights, 32 tokens, logits up to {scale:.3g}: "
        + ", ".join(f"{fmt} max error {m:.2e}, relative {r:.2%}" for fmt, (m, r) in report.items())
    )
    assert report["int8"][1] < 0.05 and report["int4"][1] < 0.35, report
    assert report["int8"][0] < 0.05 * scale and report["int4"][0] < 0.4 * scale, report
    assert report["int8"][1] < report["int4"][1] / 4  # 8 bits are much closer than 4


# ---------------------------------------------------------------------------------------------
# Memory.


def linear_weights(model) -> int:
    """Weights that are quantized: the blocks' linear layers and the token table."""
    cfg = model.config
    return cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd


@pytest.mark.parametrize("which", ["bundled", "gpt2_124m"])
def test_resident_bytes_follow_the_formula(request, which):
    models = request.getfixturevalue(which)
    fp32 = resident_bytes(models[None])
    n = linear_weights(models[None])
    rest = sum(p.numel() for p in models[None].parameters()) - n  # layer norms, biases, wpe stay float32
    assert fp32 == 4 * (n + rest)
    sizes = {"float32": fp32}
    for fmt in FORMATS:
        sizes[fmt] = resident_bytes(models[fmt])
        expected = weight_memory(n, fmt) + 4 * rest
        assert abs(sizes[fmt] / expected - 1) < 0.03, (fmt, sizes[fmt], expected)
    print(f"\n{which}: weights in memory " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))
    assert sizes["int8"] < fp32 / 3.5 and sizes["int4"] < fp32 / 6


# ---------------------------------------------------------------------------------------------
# Equivalence: everything the float model does, the quantized one does.

PROMPTS = [[5, 17, 33, 2, 90, 61], [8, 8, 1], [40, 11, 25, 3, 3, 70, 12, 9], [64]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_model_computes_what_its_dequantized_twin_computes(small, fmt):
    """The twin: a float model holding the weights dequantized by numpy here. The engine's CPU routes also
    round the inputs of each layer to 8 bits per row (int8 x int8, Q4_0 x Q8 sums): within 1 %."""
    model, float_twin = small[fmt], twin(small[fmt])
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got, want = model(ids), float_twin(ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.01, rel
    # tokens: the same until rounding the inputs flips a close pair of logits (measured: >= 16 of 20)
    greedy = [generate(model, p, max_new_tokens=20, eos_token_id=None) for p in PROMPTS]
    expected = [generate(float_twin, p, max_new_tokens=20, eos_token_id=None) for p in PROMPTS]
    assert min(first_difference(a, b) for a, b in zip(greedy, expected)) >= 10, (greedy, expected)
    beams = generate(model, PROMPTS[0], max_new_tokens=8, num_beams=3, eos_token_id=None)
    assert beams == generate(float_twin, PROMPTS[0], max_new_tokens=8, num_beams=3, eos_token_id=None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_sampling_and_beams_are_repeatable(small, fmt):
    model = small[fmt]
    settings = dict(max_new_tokens=20, temperature=1.0, top_k=20, eos_token_id=None)
    sampled = generate(model, PROMPTS[2], seed=3, **settings)
    assert sampled == generate(model, PROMPTS[2], seed=3, **settings)
    assert sampled != generate(model, PROMPTS[2], seed=4, **settings)
    beams = generate(model, PROMPTS[:2], max_new_tokens=10, num_beams=2, eos_token_id=None)
    assert beams == [generate(model, p, max_new_tokens=10, num_beams=2, eos_token_id=None) for p in PROMPTS[:2]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_batch_gives_each_prompt_its_own_tokens(small, fmt):
    model = small[fmt]
    alone = [generate(model, p, max_new_tokens=16, eos_token_id=None) for p in PROMPTS]
    assert generate(model, PROMPTS, max_new_tokens=16, eos_token_id=None) == alone  # padded batch
    ids = torch.randint(0, 97, (5, 24), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        batch = model(ids)
        rows = torch.cat([model(ids[i : i + 1]) for i in range(5)])
    if fmt == "int8":  # exact integer sums: a row's logits do not depend on the batch
        assert torch.equal(batch, rows), (batch - rows).abs().max()
    else:
        assert torch.allclose(batch, rows, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kv_cache_gives_the_logits_of_a_full_recompute(small, fmt):
    model = small[fmt]
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(2, 30)
        steps = [model(ids[:, :10], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(10, 30)]
    incremental = torch.cat(steps, dim=1)
    assert incremental.shape == full.shape
    # prefill and decode may take different routes (library call, C kernel): the same integer sums, but
    # attention's float differences may flip a rounded input (measured: < 1e-4 of the largest logit)
    assert ((incremental - full).abs().max() / full.abs().max()).item() < 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_llm_engine_gives_the_tokens_of_generate(small, fmt):
    from llmcourse.serving.llm_engine import LLMEngine

    model = small[fmt]
    expected = [generate(model, p, max_new_tokens=12, eos_token_id=None) for p in PROMPTS]
    engine = LLMEngine(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=12)
    assert engine.generate(PROMPTS, arrivals=[0, 0, 2, 5], max_new_tokens=12, eos_token_id=None) == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_speculative_decoding_is_plain_greedy_of_the_quantized_target(bundled, fmt):
    tok = get_tokenizer()
    target = bundled[fmt]
    draft = load_model("gpt2-shakespeare-draft", device="cpu", quantize=fmt)
    assert quantized_format(draft) == fmt
    prompt = tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft, what")
    plain = generate(target, prompt, max_new_tokens=16, eos_token_id=None)
    for settings in (dict(draft=draft, num_draft_tokens=4), dict(draft="prompt-lookup")):
        stats = SpeculationStats()
        assert generate(target, prompt, max_new_tokens=16, eos_token_id=None, stats=stats, **settings) == plain
        assert stats.acceptance_rate > 0, settings  # drafts were proposed and kept


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_is_generate_in_pieces(bundled, fmt):
    tok = get_tokenizer()
    model = bundled[fmt]
    ids = generate(model, tok.encode("JULIET:"), max_new_tokens=24, temperature=0.8, seed=5)
    text = generate_text(model, tok, "JULIET:", max_new_tokens=24, temperature=0.8, seed=5)
    assert text == tok.decode([t for t in ids if t != 50256]) and len(text) > 20
    assert "".join(stream(model, tok, "JULIET:", max_new_tokens=24, temperature=0.8, seed=5)) == text


@pytest.mark.parametrize("fmt", FORMATS)
def test_float64_and_bfloat16_activations(bundled, fmt):
    """float64: the quantized model converted (`.double()`), or the float64 model quantized: the same
    integers; bfloat16: `load_model(dtype=, quantize=)`. The activations take the dtype, the integers stay."""
    tok = get_tokenizer()
    ids = torch.tensor([tok.encode("ROMEO:\nWhat light is this")])
    models = {
        torch.float32: bundled[fmt],
        torch.float64: copy.deepcopy(bundled[fmt]).double(),
        torch.bfloat16: load_model("gpt2-shakespeare", device="cpu", dtype="bfloat16", quantize=fmt),
    }
    quantized64 = quantize_model(copy.deepcopy(bundled[None]).double(), fmt)
    with torch.inference_mode():
        logits = {dtype: model(ids) for dtype, model in models.items()}
        assert torch.equal(quantized64(ids), logits[torch.float64])
    for dtype, model in models.items():
        assert logits[dtype].dtype == dtype and torch.isfinite(logits[dtype]).all()
        assert model.h[3].mlp.c_fc.qweight.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
        assert (
            model.ln_f.weight.dtype == dtype
            and model.wpe.weight.dtype == dtype
            and model.h[3].mlp.c_fc.bias.dtype == dtype
        )
        assert model.h[3].mlp.c_fc.scales.dtype == (dtype if fmt == "int8" else torch.float16)
    assert torch.equal(quantized64.h[3].mlp.c_fc.qweight, bundled[fmt].h[3].mlp.c_fc.qweight)
    assert torch.equal(quantized64.wte.qweight, bundled[fmt].wte.qweight)
    scale = logits[torch.float32].abs().max()
    # float64 activations are rounded to 8 bits per row too: where a value sits on a rounding boundary,
    # float32 and float64 round it differently (measured: int8 0.8 %, int4 0.00002 % of the largest logit)
    assert (logits[torch.float64] - logits[torch.float32]).abs().max() < 0.02 * scale
    # bfloat16: the float weights are rounded to bfloat16 before quantizing (measured: int8 2.4 %, int4 8 %)
    assert (logits[torch.bfloat16].float() - logits[torch.float32]).abs().max() < 0.15 * scale
    prompt = ids[0].tolist()
    assert generate(models[torch.float64], prompt, max_new_tokens=12) == generate(
        bundled[fmt], prompt, max_new_tokens=12
    )
    assert len(generate(models[torch.bfloat16], prompt, max_new_tokens=4, eos_token_id=None)) == 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_static_decode_loop_of_compile_gives_the_same_tokens(small, fmt, monkeypatch):
    """compile=True's loop (static shapes, a slot per step, a mask over the whole cache) run eagerly."""
    monkeypatch.setattr(generation, "compiled_decode_step", lambda model: generation.decode_step)
    model = small[fmt]
    for settings in (dict(), dict(temperature=0.9, top_k=20, seed=4)):
        free = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=None, **settings)
        assert generate(model, PROMPTS, max_new_tokens=12, eos_token_id=None, compile=True, **settings) == free


TINY = GPT2Config(n_layer=1, n_head=1, n_embd=32, n_positions=64, vocab_size=97)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compile_traces_the_quantized_step_in_one_graph(fmt, monkeypatch):
    """compile=True's torch.compile (fullgraph) with dynamo's "eager" backend: the quantized layers trace
    into one graph (no call dynamo cannot trace: bug tests-3). Inductor's code generation is left out: it
    took 20 to 70 s here for one tiny model (measured: its tokens were the eager ones for int8); the CUDA
    test below compiles for real."""
    real_compile = torch.compile
    monkeypatch.setattr(generation, "_compiled", {})  # nothing cached from, or left to, other tests
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, *, fullgraph=False, dynamic=None, **_: real_compile(
            fn, backend="eager", fullgraph=fullgraph, dynamic=dynamic
        ),
    )
    model = quantize_model(lively_model(TINY, seed=2), fmt)
    eager = generate(model, PROMPTS[:2], max_new_tokens=6, eos_token_id=None)
    assert generate(model, PROMPTS[:2], max_new_tokens=6, eos_token_id=None, compile=True) == eager


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_on_cuda_the_model_computes_what_its_twin_computes(small, fmt):
    model, float_twin = copy.deepcopy(small[fmt]).to("cuda"), twin(small[fmt]).to("cuda")
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.inference_mode():
        got, want = model(ids), float_twin(ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert model.h[0].attn.c_attn.qweight.is_cuda and got.is_cuda
    greedy = [generate(model, p, max_new_tokens=16, eos_token_id=None) for p in PROMPTS]
    assert greedy == [generate(float_twin, p, max_new_tokens=16, eos_token_id=None) for p in PROMPTS]
    assert generate(model, PROMPTS, max_new_tokens=16, eos_token_id=None) == greedy
    assert generate(model, PROMPTS[:2], max_new_tokens=8, eos_token_id=None, compile=True) == [
        g[:8] for g in greedy[:2]
    ]


# ---------------------------------------------------------------------------------------------
# Save and load.


@pytest.fixture(scope="module")
def saved(bundled, tmp_path_factory):
    """The bundled model saved in each format."""
    return {fmt: save_model(bundled[fmt], tmp_path_factory.mktemp(fmt)) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_saved_quantized_model_loads_as_it_was(bundled, saved, fmt, monkeypatch):
    config = json.loads((saved[fmt] / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "llmcourse",
        "format": fmt,
        "group_size": 32 if fmt == "int4" else None,
    }

    def refuse(*args, **kwargs):
        raise AssertionError("loading a quantized checkpoint must not quantize again")

    with monkeypatch.context() as patch:  # only while loading: the int8 route quantizes activations
        for name in ("quantize_int8", "quantize_int4", "quantize_model"):
            patch.setattr(f"llmcourse.engine.quantize.{name}", refuse)
        patch.setattr(Quantization, "quantize", refuse)
        loaded = load_model(saved[fmt], device="cpu")
        assert quantized_format(load_model(saved[fmt], device="cpu", quantize=fmt)) == fmt  # the format it holds: fine
    assert quantized_format(loaded) == fmt
    original = bundled[fmt].state_dict()
    assert loaded.state_dict().keys() == original.keys()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    assert loaded.wte.qweight.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    ids = torch.tensor([[464, 2068, 7586, 21831, 18045, 625, 262]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids), bundled[fmt](ids))


def test_quantized_files_and_memory_are_smaller(bundled, saved, tmp_path):
    files = {fmt: (saved[fmt] / "model.safetensors").stat().st_size for fmt in FORMATS}
    files["float32"] = (save_model(bundled[None], tmp_path) / "model.safetensors").stat().st_size
    files["float16 (bundled)"] = (MODELS_DIR / "gpt2-shakespeare" / "model.safetensors").stat().st_size
    print("\nfile sizes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in files.items()))
    assert files["float32"] / files["int8"] > 3.5 and files["float32"] / files["int4"] > 6.0
    assert files["float16 (bundled)"] / files["int4"] > 3.0
    for fmt in (*FORMATS, "float32"):  # a file is its tensors (and a short header)
        assert 0 < files[fmt] - resident_bytes(bundled[None if fmt == "float32" else fmt]) < 0.01 * files[fmt]


def test_a_quantized_folder_is_not_quantized_again(saved):
    with pytest.raises(CheckpointError, match=r"holds int8 weights; quantizing them again to int4"):
        load_model(saved["int8"], quantize="int4")
    with pytest.raises(CheckpointError, match=r"holds int4 weights; quantizing them again to int8"):
        load_model(saved["int4"], quantize="int8")


def corrupt(saved_folder, tmp_path, *, tensors=None, config=None):
    """A copy of a saved folder with some tensors or config.json entries replaced."""
    state = load_file(str(saved_folder / "model.safetensors"))
    state.update(tensors or {})
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((saved_folder / "config.json").read_text())
    cfg.update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_corrupt_quantized_checkpoint_is_refused_naming_the_tensor(saved, bundled, tmp_path):
    key = "transformer.h.2.mlp.c_fc.qweight"
    q = load_file(str(saved["int8"] / "model.safetensors"))[key]
    cases = [
        (
            saved["int8"],
            dict(tensors={key: q[:, :100].contiguous()}),
            r"tensor 'h\.2\.mlp\.c_fc\.qweight' has shape \(768, 100\)",
        ),
        (
            saved["int8"],
            dict(tensors={key: q.float()}),
            r"tensor 'h\.2\.mlp\.c_fc\.qweight' is torch\.float32.*quantization_config",
        ),
        (
            saved["int8"],
            dict(config={"quantization_config": {"quant_method": "llmcourse", "format": "int4", "group_size": 32}}),
            r"tensor 'wte\.qweight' has shape \(50257, 192\).*needs \(50257, 96\)",
        ),
        (
            saved["int4"],
            dict(tensors={"transformer.h.0.attn.c_proj.scales": torch.zeros(192, 5, dtype=torch.float16)}),
            r"tensor 'h\.0\.attn\.c_proj\.scales' has shape \(192, 5\)",
        ),
        (
            MODELS_DIR / "gpt2-shakespeare",
            dict(config={"quantization_config": {"quant_method": "llmcourse", "format": "int8"}}),
            r"missing tensor 'wte\.qweight'",
        ),
    ]
    for i, (folder, change, message) in enumerate(cases):
        path = tmp_path / str(i)
        path.mkdir()
        with pytest.raises(CheckpointError, match=message):
            load_model(corrupt(folder, path, **change))


def test_the_command_line_quantizes_saves_and_generates(tmp_path, capsys):
    from llmcourse.__main__ import main

    def run_here(*args):
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = exit.code
        out = capsys.readouterr()
        return code, out.out, out.err

    folder = tmp_path / "int8"
    code, out, err = run_here("quantize", "int8", "--out", str(folder))
    assert code == 0 and "quantized to int8" in out and f"generate --model {folder}" in out, (out, err)
    greedy = ("generate", "--max-new-tokens", "16", "--temperature", "0")
    code, from_folder, err = run_here(*greedy, "--model", str(folder), "ROMEO:")
    assert code == 0 and len(from_folder) > 20, err
    code, on_load, _ = run_here(*greedy, "--quantize", "int8", "ROMEO:")
    assert code == 0 and on_load == from_folder
    code, fp32, _ = run_here(*greedy, "ROMEO:")
    assert code == 0 and fp32 != ""
    code, out, err = run_here(*greedy, "--quantize", "int3", "ROMEO:")
    assert code == 2 and out == "" and err.count("\n") == 1 and "invalid choice: 'int3'" in err, err
    code, out, err = run_here("quantize", "int3", "--out", str(tmp_path / "x"))
    assert code == 2 and err.count("\n") == 1 and "invalid choice: 'int3'" in err, err
    code, out, err = run_here(*greedy, "--model", str(folder), "--quantize", "int4", "ROMEO:")
    assert code == 1 and out == "" and err.count("\n") == 1 and "holds int8 weights" in err, err
