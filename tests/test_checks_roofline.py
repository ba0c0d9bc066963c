"""Chapter 10's checks: the references pass, stubs and plausible mistakes fail with a message that names the
mistake, other correct ways of writing each exercise pass, and the engine's own functions are refused."""

import math
import re
from collections import namedtuple
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from llmcourse.checks import CheckFailed
from llmcourse.checks.roofline import (
    check_critical_batch,
    check_gpu_roof,
    check_matrix_bytes,
    check_roofline_time,
    check_step_cost,
    check_utilization,
)

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/10_roofline/10_roofline.ipynb"

# -- references, written as a learner would ---------------------------------------------------------

CARDS = {"H100 SXM": (989e12, 3.35e12), "A100 80GB SXM": (312e12, 2.039e12), "RTX 4090": (165.2e12, 1.008e12)}
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def gpu_roof(card):
    if card not in CARDS:
        raise ValueError(f"unknown card {card!r}")
    return CARDS[card]


def matrix_bytes(rows, cols, fmt, dtype="float32"):
    if fmt in BYTES:
        return rows * cols * BYTES[fmt]
    if fmt == "int8":
        return rows * cols + rows * BYTES[dtype]
    if fmt == "int4":
        return rows * cols // 2 + rows * (cols // 32) * 2
    raise ValueError(fmt)


def matrices(shape, gqa=True, mlp3=True, head=True):
    C, H, D, F = shape.n_embd, shape.n_head, shape.head_dim, shape.d_ff
    kv = shape.n_kv_head if gqa else H
    mlp = [(F, C), (F, C), (C, F)] if shape.mlp == "swiglu" and mlp3 else [(F, C), (C, F)]
    return [(H * D, C), (kv * D, C), (kv * D, C), (C, H * D), *mlp] * shape.n_layer + (
        [(shape.vocab_size, C)] if head else []
    )


def step_cost(shape, batch, new_tokens, context, weights="float16", dtype="float16"):
    B, T = batch, new_tokens
    L, H, D = shape.n_layer, shape.n_head, shape.head_dim
    mats, size = matrices(shape), BYTES[dtype]
    flops = 2 * B * T * sum(r * c for r, c in mats) + 4 * L * H * D * B * (T * context + T * (T + 1) // 2)
    weight_bytes = sum(matrix_bytes(r, c, weights, dtype) for r, c in mats)
    kv = B * (context + 2 * T) * 2 * L * shape.n_kv_head * D * size
    activations = size * B * T * (sum(r + c for r, c in mats) + 2 * L * H * D)
    return flops, weight_bytes, kv, activations


def roofline_time(flops, nbytes, peak_flops, bandwidth):
    memory, compute = nbytes / bandwidth, flops / peak_flops
    return max(memory, compute), "compute" if compute > memory else "memory", flops / nbytes, peak_flops / bandwidth


def critical_batch(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    def compute_bound(b):
        flops, *nbytes = step_cost(shape, b, 1, context, weights, dtype)
        return roofline_time(flops, sum(nbytes), peak_flops, bandwidth)[1] == "compute"

    if not compute_bound(max_batch):
        return None
    low, high = 0, max_batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def utilization(flops, nbytes, seconds, peak_flops, bandwidth):
    return nbytes / seconds / bandwidth, flops / seconds / peak_flops


def stub(*args, **kwargs):
    raise NotImplementedError()


CHECKS = {
    "gpu_roof": (check_gpu_roof, gpu_roof),
    "matrix_bytes": (check_matrix_bytes, matrix_bytes),
    "step_cost": (check_step_cost, step_cost),
    "roofline_time": (check_roofline_time, roofline_time),
    "critical_batch": (check_critical_batch, critical_batch),
    "utilization": (check_utilization, utilization),
}


def fails(check, fn, pattern, **kwargs):
    with pytest.raises(CheckFailed) as err:
        check(fn, **kwargs)
    assert re.search(pattern, str(err.value), re.S), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("check, fn", CHECKS.values(), ids=CHECKS)
def test_reference_passes(check, fn, capsys):
    check(fn)
    check(fn, seed=101, n_random=40)
    out = capsys.readouterr().out
    assert out.count(f"✓ {fn.__name__} — ") == 2, out


@pytest.mark.parametrize("check", [c for c, _ in CHECKS.values()], ids=CHECKS)
def test_stub_is_not_written_yet(check):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


@pytest.mark.parametrize("name", CHECKS)
def test_the_engines_own_is_refused(name):
    import llmcourse.engine.roofline as engine

    check, _ = CHECKS[name]
    own = getattr(engine, name)
    fails(check, lambda *args: own(*args), r"write your own")


# -- gpu_roof -------------------------------------------------------------------------------------------


def _roof(table, unknown=None):
    def gpu_roof(card):
        if card in table:
            return table[card]
        if unknown is not None:
            return unknown(card)
        raise KeyError(card)

    return gpu_roof


def _with(**changes):
    return {**CARDS, **{card.replace("_", " "): value for card, value in changes.items()}}


def _index_error(card):
    raise IndexError(card)


ROOF_MISTAKES = {
    "sparse": (_roof(_with(**{"H100_SXM": (1979e12, 3.35e12)})), r"2:4 sparsity, and its dense FP8"),
    "sparse_a100": (_roof({**CARDS, "A100 80GB SXM": (624e12, 2.039e12)}), r"2:4 structured sparsity"),
    "tflops": (_roof(_with(**{"H100_SXM": (989, 3.35e12)})), r"FLOP/s, not TFLOP/s"),
    "tbps": (_roof(_with(**{"H100_SXM": (989e12, 3.35)})), r"bytes/s, not TB/s"),
    "gbps": (_roof(_with(**{"H100_SXM": (989e12, 3350)})), r"bytes/s, not GB/s"),
    "tib": (_roof(_with(**{"H100_SXM": (989e12, 3.35 * 2**40)})), r"a TB is 10\^12 bytes"),
    "fp32": (_roof(_with(**{"H100_SXM": (67e12, 3.35e12)})), r"the FP32 figure"),
    "fp32_4090": (_roof({**CARDS, "RTX 4090": (82.6e12, 1.008e12)}), r"the FP32 figure"),
    "swapped": (_roof({card: roof[::-1] for card, roof in CARDS.items()}), r"in that order"),
    "unknown_returns": (_roof(CARDS, unknown=lambda card: (989e12, 3.35e12)), r"must raise an error, not return"),
    "unknown_index_error": (_roof(CARDS, unknown=_index_error), r"IndexError raised.*raise ValueError"),
}


@pytest.mark.parametrize("fn, pattern", ROOF_MISTAKES.values(), ids=ROOF_MISTAKES)
def test_gpu_roof_mistakes_are_named(fn, pattern):
    fails(check_gpu_roof, fn, pattern)


def test_gpu_roof_message_shows_input_expected_got():
    message = fails(check_gpu_roof, ROOF_MISTAKES["tbps"][0], "")
    assert "input:    gpu_roof('H100 SXM')" in message, message
    assert "expected: (989000000000000.0, 3350000000000.0)" in message, message
    assert "got:      (989000000000000.0, 3.35)" in message, message


def test_gpu_roof_alternatives_pass(capsys):
    rounded = {"H100 SXM": (989e12, 3.35e12), "A100 80GB SXM": (312e12, 2.04e12), "RTX 4090": (165e12, 1.01e12)}

    def by_datasheet_units(card):  # TFLOP/s and TB/s multiplied out, as numpy numbers in a list
        tflops, tbps = rounded[card]
        return [np.float64(tflops), np.float64(tbps)]

    def by_branches(card):
        if card == "H100 SXM":
            return 989 * 10**12, 3350 * 10**9
        elif card == "A100 80GB SXM":
            return 312 * 10**12, 2039 * 10**9
        elif card == "RTX 4090":
            return 165_200_000_000_000, 1_008_000_000_000
        raise ValueError("unknown card")

    check_gpu_roof(_roof(rounded))
    check_gpu_roof(by_datasheet_units, seed=101, n_random=40)
    check_gpu_roof(by_branches)
    assert capsys.readouterr().out.count("✓") == 3


# -- matrix_bytes -----------------------------------------------------------------------------------------


def _bytes(int8=None, int4=None, floats=None):
    """matrix_bytes with one format's formula replaced: f(rows, cols, dtype bytes)."""

    def matrix_bytes_(rows, cols, fmt, dtype="float32"):
        size = BYTES[dtype]
        if fmt == "int8" and int8:
            return int8(rows, cols, size)
        if fmt == "int4" and int4:
            return int4(rows, cols, size)
        if fmt in BYTES and floats:
            return floats(rows, cols, BYTES[fmt])
        return matrix_bytes(rows, cols, fmt, dtype)

    return matrix_bytes_


BYTES_MISTAKES = {
    "int4_no_scales": (_bytes(int4=lambda r, c, s: r * c // 2), r"int4 also stores a float16 scale per group of 32"),
    "int4_four_bytes": (_bytes(int4=lambda r, c, s: r * c * 4 + r * c // 32 * 2), r"half a byte per weight, not 4"),
    "int4_bits_as_bytes": (_bytes(int4=lambda r, c, s: r * c * 4), r"int4 is 4 bits, half a byte"),
    "int4_scale_float32": (_bytes(int4=lambda r, c, s: r * c // 2 + r * c // 32 * 4), r"int4's scales are float16"),
    "int4_group_64": (_bytes(int4=lambda r, c, s: r * c // 2 + r * c // 64 * 2), r"a group is 32 inputs"),
    "int8_no_scale": (_bytes(int8=lambda r, c, s: r * c), r"int8 also stores a scale per row"),
    "int8_scale_per_column": (_bytes(int8=lambda r, c, s: r * c + c * s), r"one scale per row \(output\), not per col"),
    "int8_scale_always_float32": (_bytes(int8=lambda r, c, s: r * c + r * 4), r"the int8 scales are in the model's"),
    "float_bits": (_bytes(floats=lambda r, c, b: 8 * r * c * b), r"bytes, not bits"),
    "float16_as_four": (_bytes(floats=lambda r, c, b: r * c * 4), r"float16 and bfloat16 take 2 bytes"),
    "all_bits": (lambda *args: 8 * matrix_bytes(*args), r"bytes, not bits"),
}


@pytest.mark.parametrize("fn, pattern", BYTES_MISTAKES.values(), ids=BYTES_MISTAKES)
def test_matrix_bytes_mistakes_are_named(fn, pattern):
    fails(check_matrix_bytes, fn, pattern)


def test_matrix_bytes_message_shows_input_expected_got():
    message = fails(check_matrix_bytes, BYTES_MISTAKES["int8_no_scale"][0], "")
    # the first failing case, int8 [768, 3072] in float32, shown as it is or shrunk to a smaller matrix
    shown = re.search(r"input:    matrix_bytes\(rows=(\d+), cols=(\d+), fmt='int8', dtype='float32'\)", message)
    assert shown, message
    rows, cols = int(shown[1]), int(shown[2])
    assert rows <= 768 and cols <= 3072, message
    assert f"expected: {rows * cols + 4 * rows}" in message and f"got:      {rows * cols}" in message, message


def test_matrix_bytes_is_compared_with_the_engines_quantized_layers():
    """Only the last cases sum over the engine's quantized layers: a formula wrong only at their shapes fails there."""

    def wrong_at_the_token_table(rows, cols, fmt, dtype="float32"):
        return matrix_bytes(rows, cols, fmt, dtype) + (rows == 50257 and cols == 192)

    fails(
        check_matrix_bytes,
        wrong_at_the_token_table,
        r"in the engine: the bundled model in float16, quantized to int8.*qweight",
    )


def test_matrix_bytes_alternatives_pass(capsys):
    def in_bits(rows, cols, fmt, dtype="float32"):  # bits per weight, scales' bits, then bytes: whole floats
        bits = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}[fmt]
        scales = rows * {"float32": 32, "float16": 16, "bfloat16": 16}[dtype] if fmt == "int8" else 0
        if fmt == "int4":
            scales = rows * (cols / 32) * 16
        return (np.float64(rows) * cols * bits + scales) / 8

    def by_cases(rows, cols, fmt, dtype="float32"):
        match fmt:
            case "int4":
                return int(rows * cols * 0.5 + rows * cols / 32 * 2)
            case "int8":
                return rows * cols + rows * (4 if dtype == "float32" else 2)
            case "float32":
                return 4 * rows * cols
        return 2 * rows * cols

    check_matrix_bytes(in_bits)
    check_matrix_bytes(by_cases, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- step_cost --------------------------------------------------------------------------------------------


def _cost(
    madd=2,
    attention="causal",
    gqa=True,
    mlp3=True,
    head=True,
    weights_gqa=True,
    weights_per_batch=False,
    cache="full",
    cache_gqa=True,
    activations="dtype",
    weight_bytes_scale=1,
):
    """step_cost with one mistake."""

    def step_cost_(shape, batch, new_tokens, context, weights="float16", dtype="float16"):
        B, T, L, H, D = batch, new_tokens, shape.n_layer, shape.n_head, shape.head_dim
        mats = matrices(shape, gqa, mlp3, head)
        size = BYTES[dtype]
        pairs = {"causal": T * context + T * (T + 1) // 2, "full": T * (context + T), "none": 0}[attention]
        flops = madd * B * T * sum(r * c for r, c in mats) + 2 * madd * L * H * D * B * pairs
        stored = matrices(shape, gqa and weights_gqa, mlp3, head)
        weight_bytes = sum(matrix_bytes(r, c, weights, dtype) for r, c in stored) * weight_bytes_scale
        weight_bytes *= B if weights_per_batch else 1
        positions = {"full": context + 2 * T, "no_writes": context + T, "context": context, "none": 0}[cache]
        kv_heads = shape.n_kv_head if cache_gqa else H
        kv = B * positions * 2 * L * kv_heads * D * size
        per_value = {"dtype": size, "weights": {**BYTES, "int8": 1, "int4": 0.5}[weights], "none": 0}[activations]
        act = per_value * B * T * (sum(r + c for r, c in mats) + 2 * L * H * D)
        return flops, weight_bytes, kv, act

    return step_cost_


COST_MISTAKES = {
    "no_kv_cache": (_cost(cache="none"), r"the KV-cache bytes are wrong.*the KV cache: attention reads"),
    "multiply_add_one_flop": (_cost(madd=1), r"the FLOPs are wrong.*a multiply-add is 2 FLOPs"),
    "weights_per_sequence": (_cost(weights_per_batch=True), r"weight bytes are wrong.*read once per step"),
    "gqa_ignored": (_cost(gqa=False), r"the FLOPs are wrong.*n_kv_head × head_dim outputs"),
    "gqa_ignored_in_weights": (_cost(weights_gqa=False), r"weight bytes are wrong.*grouped-query attention"),
    "gqa_ignored_in_cache": (_cost(cache_gqa=False), r"KV-cache bytes are wrong.*n_kv_head heads per layer"),
    "swiglu_two_matrices": (_cost(mlp3=False), r"the FLOPs are wrong.*\"swiglu\" MLP has three matrices"),
    "head_forgotten": (_cost(head=False), r"the FLOPs are wrong.*the output head is a matrix too"),
    "attention_not_causal": (_cost(attention="full"), r"attention is causal"),
    "attention_forgotten": (_cost(attention="none"), r"attention's FLOPs too"),
    "kv_writes_forgotten": (_cost(cache="no_writes"), r"also writes the new_tokens new ones"),
    "kv_reads_context_only": (_cost(cache="context"), r"context \+ 2 × new_tokens positions per sequence"),
    "activations_forgotten": (_cost(activations="none"), r"activation bytes are wrong.*every matrix product reads"),
    "activations_in_weight_format": (_cost(activations="weights"), r"activations are in `dtype`"),
    "weights_in_bits": (_cost(weight_bytes_scale=8), r"weight bytes are wrong.*bytes, not bits"),
    "weights_in_gb": (_cost(weight_bytes_scale=1e-9), r"return bytes \(not GB\)"),
}


@pytest.mark.parametrize("fn, pattern", COST_MISTAKES.values(), ids=COST_MISTAKES)
def test_step_cost_mistakes_are_named(fn, pattern):
    fails(check_step_cost, fn, pattern)


def test_step_cost_message_shows_input_expected_got():
    message = fails(check_step_cost, COST_MISTAKES["no_kv_cache"][0], "")
    assert "input:    step_cost(shape=ModelShape(n_layer=1, n_embd=4" in message, message
    assert "expected: StepCost(flops=480, weights=928, kv_cache=64, activations=376)" in message, message
    assert "got:      (480, 928, 0, 376)" in message, message


def test_step_cost_runs_in_the_engines_predict():
    """A step_cost that is right when called with keywords but not as predict calls it fails in the engine."""

    def positional_mixup(shape, batch, new_tokens, context, *rest, weights="float16", dtype="float16"):
        return step_cost(shape, batch, new_tokens, context, *(rest or (weights, dtype))[::-1])

    fails(check_step_cost, positional_mixup, r"")


def test_step_cost_alternatives_pass(capsys):
    Cost = namedtuple("Cost", "flops weights kv_cache activations")

    def by_layer_loop(shape, batch, new_tokens, context, weights="float16", dtype="float16"):
        C, H, Hkv, D, F = shape.n_embd, shape.n_head, shape.n_kv_head, shape.head_dim, shape.d_ff
        rows, size = np.int64(batch) * new_tokens, BYTES[dtype]
        flops = weight_bytes = kv = act = 0
        for _ in range(shape.n_layer):
            layer = [(H * D, C), (Hkv * D, C), (Hkv * D, C), (C, H * D), (F, C), (C, F)]
            if shape.mlp == "swiglu":
                layer.append((F, C))
            for r, c in layer:
                flops += 2 * rows * r * c
                weight_bytes += matrix_bytes(r, c, weights, dtype)
                act += size * rows * (r + c)
            for i in range(new_tokens):  # position i attends to context + i + 1 positions
                flops += 4 * H * D * batch * (context + i + 1)
            act += size * rows * 2 * H * D
            kv += batch * (context + 2 * new_tokens) * 2 * Hkv * D * size
        V = shape.vocab_size
        flops, weight_bytes, act = flops + 2 * rows * V * C, weight_bytes + matrix_bytes(V, C, weights, dtype), act
        act += size * rows * (V + C)
        return Cost(float(flops), float(weight_bytes), float(kv), float(act))

    def closed_form(shape, batch, new_tokens, context, weights="float16", dtype="float16"):
        B, T = batch, new_tokens
        size = BYTES[dtype]
        mats = matrices(shape)
        params = sum(r * c for r, c in mats)
        pairs = Fraction(T * (2 * context + T + 1), 2)
        flops = 2 * params * B * T + 4 * shape.n_layer * shape.n_head * shape.head_dim * B * pairs
        kv = 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * size * B * (context + 2 * T)
        act = B * T * size * (sum(r + c for r, c in mats) + 2 * shape.n_layer * shape.n_head * shape.head_dim)
        return [flops, sum(matrix_bytes(r, c, weights, dtype) for r, c in mats), kv, act]

    check_step_cost(by_layer_loop)
    check_step_cost(closed_form, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- roofline_time ----------------------------------------------------------------------------------------


def _time(seconds=max, bound=None, intensity=None, ridge=None):
    def roofline_time_(flops, nbytes, peak_flops, bandwidth):
        memory, compute = nbytes / bandwidth, flops / peak_flops
        which = (bound or (lambda m, c: "compute" if c > m else "memory"))(memory, compute)
        return (
            seconds(memory, compute),
            which,
            (intensity or (lambda f, b: f / b))(flops, nbytes),
            (ridge or (lambda p, w: p / w))(peak_flops, bandwidth),
        )

    return roofline_time_


TIME_MISTAKES = {
    "sum": (_time(seconds=lambda m, c: m + c), r"the larger of the two times, not their sum"),
    "min": (_time(seconds=min), r"the larger \(max\) of bytes ÷ bandwidth"),
    "bound_inverted": (_time(bound=lambda m, c: "memory" if c > m else "compute"), r"the bound names the limit"),
    "tie_is_compute": (_time(bound=lambda m, c: "compute" if c >= m else "memory"), r"two times are equal.*memory"),
    "intensity_inverted": (_time(intensity=lambda f, b: b / f if f else math.inf), r"FLOPs per byte: flops / nbytes"),
    "ridge_inverted": (_time(ridge=lambda p, w: w / p), r"peak_flops / bandwidth"),
    "bound_capitalised": (_time(bound=lambda m, c: "Compute" if c > m else "Memory"), r'"memory" or "compute"'),
}


@pytest.mark.parametrize("fn, pattern", TIME_MISTAKES.values(), ids=TIME_MISTAKES)
def test_roofline_time_mistakes_are_named(fn, pattern):
    fails(check_roofline_time, fn, pattern)


def test_roofline_time_message_shows_input_expected_got():
    message = fails(check_roofline_time, TIME_MISTAKES["sum"][0], "")
    assert "input:    roofline_time(flops=2000000000.0, nbytes=2000000000.0, peak_flops=1000000000000.0" in message
    assert "expected: RooflineTime(seconds=0.02, bound='memory', intensity=1.0, ridge=10.0)" in message, message
    assert "got:      (0.022, 'memory', 1.0, 10.0)" in message, message


def test_roofline_time_alternatives_pass(capsys):
    Roof = namedtuple("Roof", "seconds bound intensity ridge")

    def branches(flops, nbytes, peak_flops, bandwidth):
        t_compute = np.float64(flops) / peak_flops
        t_memory = np.float64(nbytes) / bandwidth
        if t_compute > t_memory:
            return Roof(t_compute, "compute", flops / np.float64(nbytes), np.float64(peak_flops) / bandwidth)
        return Roof(t_memory, "memory", flops / np.float64(nbytes), np.float64(peak_flops) / bandwidth)

    def by_intensity(flops, nbytes, peak_flops, bandwidth):  # below the ridge, memory-bound
        intensity, ridge = flops / nbytes, peak_flops / bandwidth
        bound = "compute" if flops / peak_flops > nbytes / bandwidth else "memory"
        return [max(flops / peak_flops, nbytes / bandwidth), bound, intensity, ridge]

    check_roofline_time(branches)
    check_roofline_time(by_intensity, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- critical_batch ---------------------------------------------------------------------------------------


def weights_only(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    flops, weight_bytes, _, _ = step_cost(shape, 1, 1, context, weights, dtype)
    batch = math.floor(peak_flops / bandwidth * weight_bytes / flops) + 1
    return batch if batch <= max_batch else None


def last_memory_bound(*args):
    found = critical_batch(*args)
    return None if found is None else found - 1


def ridge_itself(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    return math.ceil(peak_flops / bandwidth)


def as_float(*args):
    found = critical_batch(*args)
    return None if found is None else float(found)


def _none_as(value):
    def critical_batch_(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
        found = critical_batch(shape, context, weights, dtype, peak_flops, bandwidth, max_batch)
        return (max_batch if value == "max_batch" else value) if found is None else found

    return critical_batch_


def max_batch_ignored(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    return critical_batch(shape, context, weights, dtype, peak_flops, bandwidth, 1 << 20)


def linear_search(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    for batch in range(1, max_batch + 1):
        flops, *nbytes = step_cost(shape, batch, 1, context, weights, dtype)
        if roofline_time(flops, sum(nbytes), peak_flops, bandwidth)[1] == "compute":
            return batch
    return None


BATCH_MISTAKES = {
    "weights_only": (weights_only, r"adds its own KV cache and activations to the bytes"),
    "off_by_one": (last_memory_bound, r"the last memory-bound one"),
    "the_ridge": (ridge_itself, r"that is the ridge point \(FLOPs per byte of the machine\), not a batch size"),
    "a_float": (as_float, r"a batch size is a whole number: return an int"),
    "max_batch_for_none": (_none_as("max_batch"), r"return None \(not max_batch\)"),
    "zero_for_none": (_none_as(0), r"levels off below the ridge.*return None"),
    "max_batch_ignored": (max_batch_ignored, r"max_batch below the answer.*no batch above max_batch"),
    "linear_search": (linear_search, r"did not finish within its 2 CPU-s.*binary search"),
}


@pytest.mark.parametrize("fn, pattern", BATCH_MISTAKES.values(), ids=BATCH_MISTAKES)
def test_critical_batch_mistakes_are_named(fn, pattern):
    fails(check_critical_batch, fn, pattern)


def test_critical_batch_message_shows_input_expected_got():
    message = fails(check_critical_batch, BATCH_MISTAKES["off_by_one"][0], "")
    assert "input:    critical_batch(shape=SHAPES[\"Llama-3-8B\"], context=0, weights='float16'" in message, message
    assert "expected: 337" in message and "got:      336" in message, message


def test_critical_batch_alternatives_pass(capsys):
    def closed_form_verified(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
        """Both FLOPs and bytes are linear in the batch: solve, then step to the first compute-bound batch."""

        def compute_bound(b):
            flops, *nbytes = step_cost(shape, b, 1, context, weights, dtype)
            return flops / peak_flops > sum(nbytes) / bandwidth

        ridge = peak_flops / bandwidth
        flops, weight_bytes, kv, act = step_cost(shape, 1, 1, context, weights, dtype)
        gain = flops - ridge * (kv + act)  # what each sequence adds to FLOPs beyond what its bytes cost
        if gain <= 0:
            return None
        batch = max(1, math.floor(ridge * weight_bytes / gain))
        while batch > 1 and compute_bound(batch - 1):
            batch -= 1
        while not compute_bound(batch):
            batch += 1
        return np.int64(batch) if batch <= max_batch else None

    check_critical_batch(closed_form_verified)
    check_critical_batch(closed_form_verified, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- utilization ------------------------------------------------------------------------------------------


USE_MISTAKES = {
    "swapped": (lambda f, b, s, p, w: (f / s / p, b / s / w), r"return \(mbu, mfu\)"),
    "percent": (lambda f, b, s, p, w: (100 * b / s / w, 100 * f / s / p), r"a fraction \(0.42\), not a percentage"),
    "seconds_inverted": (lambda f, b, s, p, w: (b * s / w, f * s / p), r"divide by the measured seconds"),
    "wrong_roof": (lambda f, b, s, p, w: (b / s / p, f / s / w), r"bytes go with the bandwidth"),
    "inverse": (lambda f, b, s, p, w: (s * w / b, s * p / f if f else 0.0), r"not its inverse"),
}


@pytest.mark.parametrize("fn, pattern", USE_MISTAKES.values(), ids=USE_MISTAKES)
def test_utilization_mistakes_are_named(fn, pattern):
    fails(check_utilization, fn, pattern)


def test_utilization_message_shows_input_expected_got():
    message = fails(check_utilization, USE_MISTAKES["percent"][0], "")
    assert "input:    utilization(flops=2000000000.0, nbytes=1000000000.0, seconds=0.01" in message, message
    assert "expected: (0.5, 0.2)" in message and "got:      (50.0, 20.0)" in message, message


def test_utilization_alternatives_pass(capsys):
    def achieved_rates(flops, nbytes, seconds, peak_flops, bandwidth):
        achieved_bandwidth, achieved_flops = np.float64(nbytes) / seconds, np.float64(flops) / seconds
        return [achieved_bandwidth / bandwidth, achieved_flops / peak_flops]

    def against_the_least_times(flops, nbytes, seconds, peak_flops, bandwidth):
        return Fraction(nbytes) / Fraction(bandwidth) / Fraction(seconds), Fraction(flops) / peak_flops / seconds

    check_utilization(achieved_rates)
    check_utilization(against_the_least_times, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- issue 41: the datasheet table read instead of written, exact ties on the ridge, a half byte truncated ---------

from llmcourse.engine.roofline import GPUS  # noqa: E402 (what the chapter's setup imports)

GPUS_COPIED = {card: (machine.peak_flops, machine.bandwidth) for card, machine in GPUS.items()}


def roof_from_the_table(card):
    """The engine's datasheet table, read."""
    return GPUS[card].peak_flops, GPUS[card].bandwidth


def roof_from_the_table_for_three(card):
    """The engine's table, read only for the exercise's three cards: the others raise as asked."""
    if card not in CARDS:
        raise ValueError(f"unknown card {card!r}")
    return tuple(GPUS[card][:2])


def roof_from_a_copy(card):
    """A copy of the engine's table made before the check: the right numbers, and numbers for cards that must raise."""
    return GPUS_COPIED[card]


def bytes_in_whole_bytes_per_weight(rows, cols, fmt, dtype="float32"):
    """Bytes per weight as whole numbers: int4's 4 bits // 8 is 0."""
    bits = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}[fmt]
    scales = rows * BYTES[dtype] if fmt == "int8" else rows * (cols // 32) * 2 if fmt == "int4" else 0
    return rows * cols * (bits // 8) + scales


def critical_batch_ceil(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """The balance point of the linear FLOPs and bytes, rounded up: on a tie that batch is still memory-bound."""
    flops, *one = step_cost(shape, 1, 1, context, weights, dtype)
    flops2, *two = step_cost(shape, 2, 1, context, weights, dtype)
    per_flops, per_bytes = flops2 - flops, sum(two) - sum(one)
    fixed = sum(one) - per_bytes
    gain = per_flops * bandwidth / peak_flops - per_bytes
    if gain <= 0:
        return None
    batch = max(1, math.ceil(fixed / gain))
    return batch if batch <= max_batch else None


ISSUE41_MISTAKES = {
    "gpus_read": (
        check_gpu_roof,
        roof_from_the_table,
        r"the H100 SXM: these are the numbers the check put in llmcourse's GPUS table.*"
        r"your gpu_roof reads llmcourse's GPUS table",
    ),
    "gpus_read_for_three": (check_gpu_roof, roof_from_the_table_for_three, r"your gpu_roof reads llmcourse's GPUS"),
    "gpus_copied": (
        check_gpu_roof,
        roof_from_a_copy,
        r"the H200 SXM.*must raise an error, not return \(989.*those are the H200 SXM's figures in llmcourse's GPUS",
    ),
    "half_byte_truncated": (
        check_matrix_bytes,
        bytes_in_whole_bytes_per_weight,
        r"int4.*4 bits is half a byte, and 4 // 8 \(or int\(0\.5\)\) truncates it to 0",
    ),
    "ceil_on_the_ridge": (
        check_critical_batch,
        critical_batch_ceil,
        r"batch 64 sits exactly.*expected a batch of 65, got 64.*at batch 64 the two times are exactly equal.*"
        r"math\.floor\(x\) \+ 1, not math\.ceil\(x\)",
    ),
}


@pytest.mark.parametrize("check, fn, pattern", ISSUE41_MISTAKES.values(), ids=ISSUE41_MISTAKES)
def test_issue41_kinds_are_rejected_and_named(check, fn, pattern):
    fails(check, fn, pattern)


def test_gpus_is_the_engines_again_after_the_check():
    before = dict(GPUS)
    with pytest.raises(CheckFailed):
        check_gpu_roof(roof_from_the_table)
    check_gpu_roof(gpu_roof)
    assert GPUS == before


def roofline_time_by_intensity(flops, nbytes, peak_flops, bandwidth):
    """Correct, written differently: the bound from the intensity against the ridge (equal: memory)."""
    intensity, ridge = flops / nbytes, peak_flops / bandwidth
    return max(nbytes / bandwidth, flops / peak_flops), "compute" if intensity > ridge else "memory", intensity, ridge


def roofline_time_cross_multiplied(flops, nbytes, peak_flops, bandwidth):
    """Correct, written differently: the times compared without dividing."""
    bound = "compute" if flops * bandwidth > nbytes * peak_flops else "memory"
    return max(nbytes / bandwidth, flops / peak_flops), bound, flops / nbytes, peak_flops / bandwidth


def critical_batch_floor_plus_one(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """Correct, written differently: the first batch past the balance point, checked with step_cost and
    roofline_time (float rounding can put the balance point an ulp off)."""

    def compute_bound(b):
        flops, *nbytes = step_cost(shape, b, 1, context, weights, dtype)
        return roofline_time(flops, sum(nbytes), peak_flops, bandwidth)[1] == "compute"

    flops, *one = step_cost(shape, 1, 1, context, weights, dtype)
    flops2, *two = step_cost(shape, 2, 1, context, weights, dtype)
    gain = (flops2 - flops) * bandwidth / peak_flops - (sum(two) - sum(one))
    if gain <= 0:
        return None
    batch = max(1, math.floor((2 * sum(one) - sum(two)) / gain) + 1)
    while batch > 1 and compute_bound(batch - 1):
        batch -= 1
    while batch <= max_batch and not compute_bound(batch):
        batch += 1
    return batch if batch <= max_batch else None


def gpu_roof_own_table_key_error(card):
    """Correct, written differently: the datasheet's units multiplied out; an unknown card's KeyError."""
    return {"H100 SXM": (989 * 1e12, 3.35 * 1e12), "A100 80GB SXM": (312e12, 2039e9), "RTX 4090": (165.2e12, 1008e9)}[
        card
    ]


ISSUE41_ALTERNATIVES = {
    "by_intensity": (check_roofline_time, roofline_time_by_intensity),
    "cross_multiplied": (check_roofline_time, roofline_time_cross_multiplied),
    "floor_plus_one": (check_critical_batch, critical_batch_floor_plus_one),
    "own_table": (check_gpu_roof, gpu_roof_own_table_key_error),
}


@pytest.mark.parametrize("check, fn", ISSUE41_ALTERNATIVES.values(), ids=ISSUE41_ALTERNATIVES)
def test_issue41_alternatives_pass(check, fn, capsys):
    check(fn)
    check(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


def test_the_ridge_case_is_a_tie_in_floats():
    from llmcourse.checks.roofline import BUNDLED, on_the_ridge
    from llmcourse.engine.roofline import critical_batch as engine_critical_batch
    from llmcourse.engine.roofline import step_cost as engine_step_cost

    peak, bandwidth = on_the_ridge(BUNDLED, 64)
    cost = engine_step_cost(BUNDLED, 64, 1, 0, "float32", "float32")
    assert cost.flops / peak == cost.bytes / bandwidth and cost.flops / cost.bytes == peak / bandwidth
    assert engine_critical_batch(BUNDLED, 0, "float32", "float32", peak, bandwidth) == 65
