"""Chapter 10's checks: the references pass, stubs and plausible mistakes fail with a message that names the
mistake, other correct ways of writing each exercise pass, and the engine's own functions are refused."""

import math
import re
from collections import namedtuple
from fractions import Fraction

import numpy as np
import pytest

from llmcourse.checks import CheckFailed
from llmcourse.checks.roofline import (
    check_attention_cost,
    check_critical_batch,
    check_gemm_cost,
    check_gpu_roof,
    check_matrix_bytes,
    check_roofline_time,
    check_step_time,
    check_utilization,
)
from llmcourse.engine.roofline import Cost, Kernel

# -- references, written as the chapter's solutions are ----------------------------------------------

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


def layer_matrices(shape):
    """{name: (outputs, inputs)} of a layer's matrices (the chapter gives it)."""
    C, H, Hkv, D, F = shape.n_embd, shape.n_head, shape.n_kv_head, shape.head_dim, shape.d_ff
    mlp = {"gate": (F, C), "up": (F, C), "down": (C, F)} if shape.mlp == "swiglu" else {"up": (F, C), "down": (C, F)}
    return {"q": (H * D, C), "k": (Hkv * D, C), "v": (Hkv * D, C), "o": (C, H * D), **mlp}


def matrices(shape):
    """(outputs, inputs) of every matrix of a step: each layer's, then the head (the chapter gives it)."""
    return list(layer_matrices(shape).values()) * shape.n_layer + [(shape.vocab_size, shape.n_embd)]


def gemm_cost(rows, outputs, inputs, weights="float16", dtype="float16"):
    flops = 2 * rows * outputs * inputs
    nbytes = matrix_bytes(outputs, inputs, weights, dtype) + rows * (inputs + outputs) * BYTES[dtype]
    return flops, nbytes


def attention_cost(shape, batch, new_tokens, context, dtype="float16"):
    L, H, Hkv, D = shape.n_layer, shape.n_head, shape.n_kv_head, shape.head_dim
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # position i attends to context + i + 1
    flops = 4 * L * H * D * batch * pairs
    kv = 2 * L * Hkv * D * batch * (context + 2 * new_tokens)  # read context + new_tokens, write new_tokens
    queries = 2 * L * H * D * batch * new_tokens  # the queries read, the output written
    return flops, (kv + queries) * BYTES[dtype]


def roofline_time(flops, nbytes, peak_flops, bandwidth):
    memory, compute = nbytes / bandwidth, flops / peak_flops
    return max(memory, compute), "compute" if compute > memory else "memory", flops / nbytes, peak_flops / bandwidth


def step_time(kernels, peak_flops, bandwidth):
    times = [roofline_time(flops, nbytes, peak_flops, bandwidth) for _, flops, nbytes in kernels]
    return sum(t[0] for t in times), times


def critical_batch(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    def compute_bound(batch, outputs, inputs):
        flops, nbytes = gemm_cost(batch, outputs, inputs, weights, dtype)
        return roofline_time(flops, nbytes, peak_flops, bandwidth)[1] == "compute"

    needed = 1
    for outputs, inputs in set(matrices(shape)):
        if not compute_bound(max_batch, outputs, inputs):  # the intensity rises with the batch
            return None
        low, high = 0, max_batch  # memory-bound at low, compute-bound at high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if compute_bound(middle, outputs, inputs) else (middle, high)
        needed = max(needed, high)
    return needed


def utilization(flops, nbytes, seconds, peak_flops, bandwidth):
    return nbytes / seconds / bandwidth, flops / seconds / peak_flops


def stub(*args, **kwargs):
    raise NotImplementedError()


CHECKS = {
    "gpu_roof": (check_gpu_roof, gpu_roof),
    "matrix_bytes": (check_matrix_bytes, matrix_bytes),
    "gemm_cost": (check_gemm_cost, gemm_cost),
    "attention_cost": (check_attention_cost, attention_cost),
    "roofline_time": (check_roofline_time, roofline_time),
    "step_time": (check_step_time, step_time),
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


# -- gemm_cost --------------------------------------------------------------------------------------------

VALUE = {**BYTES, "int8": 1, "int4": 0.5}


def _gemm(flops=None, nbytes=None):
    """gemm_cost with one mistake: flops(rows, outputs, inputs), nbytes(rows, outputs, inputs, weights, dtype)."""

    def gemm_cost_(rows, outputs, inputs, weights="float16", dtype="float16"):
        right_flops, right_bytes = gemm_cost(rows, outputs, inputs, weights, dtype)
        return (
            flops(rows, outputs, inputs) if flops else right_flops,
            nbytes(rows, outputs, inputs, weights, dtype) if nbytes else right_bytes,
        )

    return gemm_cost_


def _moved(r, o, i, d):
    return r * (i + o) * BYTES[d]


GEMM_MISTAKES = {
    "weights_read_per_row": (
        _gemm(nbytes=lambda r, o, i, w, d: r * matrix_bytes(o, i, w, d) + _moved(r, o, i, d)),
        r"the bytes are wrong.*the matrix is read once for all the rows",
    ),
    "activations_left_out": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w, d)),
        r"the bytes are wrong.*the activations move too",
    ),
    "input_rows_only": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w, d) + r * i * BYTES[d]),
        r"the activations move too: the product reads its input rows .* and writes its output rows",
    ),
    "output_rows_only": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w, d) + r * o * BYTES[d]),
        r"the activations move too",
    ),
    "one_flop_per_multiply_add": (_gemm(flops=lambda r, o, i: r * o * i), r"the flops are wrong.*a multiply-add is 2"),
    "rows_ignored_in_flops": (_gemm(flops=lambda r, o, i: 2 * o * i), r"every row is multiplied by the whole matrix"),
    "activations_in_the_weights_format": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w, d) + r * (i + o) * VALUE[w]),
        r"the activations are in `dtype` \(float16: 2 bytes a value\), whatever the weights' format",
    ),
    "activations_always_4_bytes": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w, d) + r * (i + o) * 4),
        r"the activations are in `dtype` \(bfloat16: 2 bytes a value\)",
    ),
    "outputs_and_inputs_swapped": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(i, o, w, d) + _moved(r, o, i, d)),
        r"8 rows through Llama-3-8B's k .*a weight matrix is \[outputs, inputs\]: matrix_bytes\(outputs, inputs",
    ),
    "matrix_in_the_activations_dtype": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, d, d) + _moved(r, o, i, d)),
        r"the matrix is stored in `weights` \('int8'\)",
    ),
    "dtype_not_passed_on": (
        _gemm(nbytes=lambda r, o, i, w, d: matrix_bytes(o, i, w) + _moved(r, o, i, d)),
        r"pass `dtype` on: matrix_bytes\(outputs, inputs, weights, dtype\)",
    ),
    "bits": (_gemm(nbytes=lambda r, o, i, w, d: 8 * gemm_cost(r, o, i, w, d)[1]), r"bytes, not bits"),
    "one_number": (lambda *args: gemm_cost(*args)[0], r"expected two numbers \(flops, bytes\)"),
}


@pytest.mark.parametrize("fn, pattern", GEMM_MISTAKES.values(), ids=GEMM_MISTAKES)
def test_gemm_cost_mistakes_are_named(fn, pattern):
    fails(check_gemm_cost, fn, pattern)


def test_gemm_cost_swapped_int4_matrix_is_named_too():
    """int4's scales are per 32 inputs of each output row: swapped, a matrix of 100 outputs has other bytes."""

    def int4_only_swapped(rows, outputs, inputs, weights="float16", dtype="float16"):
        if weights != "int4":
            return gemm_cost(rows, outputs, inputs, weights, dtype)
        return 2 * rows * outputs * inputs, matrix_bytes(inputs, outputs, weights, dtype) + _moved(
            rows, outputs, inputs, dtype
        )

    fails(check_gemm_cost, int4_only_swapped, r"int4.*a weight matrix is \[outputs, inputs\]")


def test_gemm_cost_message_shows_input_expected_got():
    message = fails(check_gemm_cost, GEMM_MISTAKES["activations_left_out"][0], "")
    # the first case, one row through [4096, 4096] in bfloat16, shown as it is or shrunk to a smaller matrix
    shown = re.search(
        r"input:    gemm_cost\(rows=(\d+), outputs=(\d+), inputs=(\d+), weights='bfloat16', dtype='bfloat16'\)", message
    )
    assert shown, message
    rows, outputs, inputs = (int(shown[n]) for n in (1, 2, 3))
    assert outputs <= 4096 and inputs <= 4096, message
    flops, nbytes = 2 * rows * outputs * inputs, 2 * outputs * inputs + 2 * rows * (inputs + outputs)
    assert f"expected: Cost(flops={flops}, bytes={nbytes})" in message, message
    assert f"got:      ({flops}, {2 * outputs * inputs})" in message, message


def test_gemm_cost_runs_in_the_engines_predict():
    """A gemm_cost that is right when called with keywords but not as predict calls it fails in the engine."""

    def keywords_only(rows, outputs, inputs, *rest, weights="float16", dtype="float16"):
        return gemm_cost(rows, outputs, inputs, *(rest or (weights, dtype))[::-1])

    fails(check_gemm_cost, keywords_only, r"")

    def wrong_at_the_head_only(rows, outputs, inputs, weights="float16", dtype="float16"):
        flops, nbytes = gemm_cost(rows, outputs, inputs, weights, dtype)
        return flops, nbytes + (outputs == 128256 and rows == 1 and weights == "int4")

    fails(check_gemm_cost, wrong_at_the_head_only, r"in the engine: Llama-3-70B in int4.*kernel 'head'")


def test_gemm_cost_alternatives_pass(capsys):
    def as_cost_of_numpy_numbers(rows, outputs, inputs, weights="float16", dtype="float16"):
        weights_per_byte = {"float32": 0.25, "float16": 0.5, "bfloat16": 0.5, "int8": 1, "int4": 2}[weights]
        scales = {"int8": outputs * BYTES[dtype], "int4": outputs * inputs // 32 * 2}.get(weights, 0)
        stored = np.float64(outputs) * inputs / weights_per_byte + scales
        return Cost(np.int64(2) * rows * outputs * inputs, stored + np.int64(rows) * (inputs + outputs) * BYTES[dtype])

    def in_bits_as_a_list(rows, outputs, inputs, weights="float16", dtype="float16"):
        bits = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}
        activation_bits = rows * (inputs + outputs) * bits[dtype]
        return [
            Fraction(2 * rows * outputs * inputs),
            Fraction(matrix_bytes(outputs, inputs, weights, dtype)) + Fraction(activation_bits, 8),
        ]

    check_gemm_cost(as_cost_of_numpy_numbers)
    check_gemm_cost(in_bits_as_a_list, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- attention_cost ---------------------------------------------------------------------------------------


def _attention(
    per_pair=4,
    pairs="causal",
    flops_heads="query",
    kv_heads="kv",
    positions="full",
    queries=2,
    layers=True,
    reread=False,
    value=None,
):
    """attention_cost with one mistake."""

    def attention_cost_(shape, batch, new_tokens, context, dtype="float16"):
        L = shape.n_layer if layers else 1
        H, D, B, T = shape.n_head, shape.head_dim, batch, new_tokens
        n_pairs = {
            "causal": T * context + T * (T + 1) // 2,
            "full": T * (context + T),
            "self_excluded": T * context + T * (T - 1) // 2,
        }[pairs]
        heads = H if flops_heads == "query" else shape.n_kv_head
        flops = per_pair * L * heads * D * B * n_pairs
        kv_heads_read = shape.n_kv_head if kv_heads == "kv" else H
        kv = 2 * L * kv_heads_read * D * B * {"full": context + 2 * T, "no_writes": context + T}[positions]
        kv *= T if reread else 1
        return flops, (kv + queries * L * H * D * B * T) * (value or BYTES[dtype])

    return attention_cost_


ATTENTION_MISTAKES = {
    "kv_read_per_query_head": (
        _attention(kv_heads="query"),
        r"Llama-3-8B \(8 KV heads.*the bytes are wrong.*intensity.*reads each KV head's keys and values once",
    ),
    "not_causal": (_attention(pairs="full"), r"a prefill of 512.*the flops are wrong.*attention is causal"),
    "scores_only": (_attention(per_pair=2), r"the flops are wrong.*4 FLOPs per head dimension"),
    "eight_flops_per_pair": (_attention(per_pair=8), r"the flops are wrong.*4 FLOPs per head dimension"),
    "query_heads_as_kv_heads_in_flops": (_attention(flops_heads="kv"), r"every query head computes its own"),
    "new_keys_values_not_written": (_attention(positions="no_writes"), r"writes the new positions' keys and values"),
    "queries_and_outputs_left_out": (_attention(queries=0), r"also reads its queries and writes its output"),
    "one_layer": (_attention(layers=False), r"the flops are wrong.*every layer has its own attention"),
    "cache_reread_per_new_position": (
        _attention(reread=True),
        r"a prefill of 512.*the bytes are wrong.*reads each sequence's cache once",
    ),
    "itself_not_attended": (_attention(pairs="self_excluded"), r"attends to context \+ i \+ 1 positions"),
    "always_4_bytes": (_attention(value=4), r"Llama-3-8B.*in `dtype` \(bfloat16: 2 bytes a value\)"),
}


@pytest.mark.parametrize("fn, pattern", ATTENTION_MISTAKES.values(), ids=ATTENTION_MISTAKES)
def test_attention_cost_mistakes_are_named(fn, pattern):
    fails(check_attention_cost, fn, pattern)


def test_attention_cost_message_shows_input_expected_got_and_the_intensity():
    message = fails(check_attention_cost, ATTENTION_MISTAKES["kv_read_per_query_head"][0], "")
    assert (
        "input:    attention_cost(shape=SHAPES[\"Llama-3-8B\"], batch=1, new_tokens=1, context=1023, dtype='bfloat16')"
        in message
    ), message
    assert "expected: Cost(flops=536870912, bytes=134873088)" in message, message
    assert "got:      (536870912, 537919488)" in message, message
    assert "its intensity: 3.981 FLOPs per byte expected, yours 0.9981" in message, message


def test_attention_cost_alternatives_pass(capsys):
    def per_layer_loop(shape, batch, new_tokens, context, dtype="float16"):
        pairs = sum(context + i + 1 for i in range(new_tokens))  # new position i attends to context + i + 1
        flops = nbytes = 0
        for _ in range(shape.n_layer):
            for _ in range(shape.n_head):
                flops += 4 * shape.head_dim * np.int64(batch) * pairs
            for _ in range(shape.n_kv_head):  # a group's query heads share the read
                nbytes += 2 * shape.head_dim * batch * (context + 2 * new_tokens) * BYTES[dtype]
            nbytes += 2 * shape.n_head * shape.head_dim * batch * new_tokens * BYTES[dtype]
        return np.float64(flops), nbytes

    def by_intensity(shape, batch, new_tokens, context, dtype="float16"):
        per_layer_values = (
            batch * shape.head_dim * (2 * shape.n_kv_head * (context + 2 * new_tokens) + 2 * shape.n_head * new_tokens)
        )
        pairs = Fraction(new_tokens * (2 * context + new_tokens + 1), 2)
        return Cost(
            4 * shape.n_layer * shape.n_head * shape.head_dim * batch * pairs,
            shape.n_layer * per_layer_values * BYTES[dtype],
        )

    check_attention_cost(per_layer_loop)
    check_attention_cost(by_intensity, seed=101, n_random=40)
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


# -- step_time --------------------------------------------------------------------------------------------


def _sums(kernels):
    return sum(k[1] for k in kernels), sum(k[2] for k in kernels)


def step_time_one_point(kernels, peak_flops, bandwidth):
    """The whole step as one roofline point: its summed FLOPs and bytes."""
    flops, nbytes = _sums(kernels)
    return roofline_time(flops, nbytes, peak_flops, bandwidth)[0], step_time(kernels, peak_flops, bandwidth)[1]


def step_time_summed_roofs(kernels, peak_flops, bandwidth):
    flops, nbytes = _sums(kernels)
    return nbytes / bandwidth + flops / peak_flops, step_time(kernels, peak_flops, bandwidth)[1]


def step_time_largest(kernels, peak_flops, bandwidth):
    times = step_time(kernels, peak_flops, bandwidth)[1]
    return max(t[0] for t in times), times


def step_time_smaller_of_the_two(kernels, peak_flops, bandwidth):
    times = []
    for _, flops, nbytes in kernels:
        memory, compute = nbytes / bandwidth, flops / peak_flops
        times.append(
            (min(memory, compute), "compute" if compute > memory else "memory", flops / nbytes, peak_flops / bandwidth)
        )
    return sum(t[0] for t in times), times


def step_time_the_steps_bound(kernels, peak_flops, bandwidth):
    """Each kernel's time, but the bound of the whole step's sums for all of them."""
    flops, nbytes = _sums(kernels)
    bound = roofline_time(flops, nbytes, peak_flops, bandwidth)[1]
    seconds, times = step_time(kernels, peak_flops, bandwidth)
    return seconds, [(t[0], bound, t[2], t[3]) for t in times]


def step_time_sorted(kernels, peak_flops, bandwidth):
    seconds, times = step_time(kernels, peak_flops, bandwidth)
    return seconds, sorted(times)


def step_time_sorts_its_input(kernels, peak_flops, bandwidth):
    kernels.sort(key=lambda k: k[2])  # the slowest reads last
    return step_time(kernels, peak_flops, bandwidth)


def step_time_name_as_flops(kernels, peak_flops, bandwidth):
    times = [roofline_time(k[0], k[1], peak_flops, bandwidth) for k in kernels]
    return sum(t[0] for t in times), times


def step_time_by_attributes(kernels, peak_flops, bandwidth):
    """Right for Kernels; plain (name, flops, bytes) tuples have no .flops."""
    times = [roofline_time(k.flops, k.bytes, peak_flops, bandwidth) for k in kernels]
    return sum(t[0] for t in times), times


def step_time_tie_compute(kernels, peak_flops, bandwidth):
    """Its roofline_time says "compute" when the two times are equal."""
    times = []
    for _, flops, nbytes in kernels:
        memory, compute = nbytes / bandwidth, flops / peak_flops
        times.append(
            (max(memory, compute), "compute" if compute >= memory else "memory", flops / nbytes, peak_flops / bandwidth)
        )
    return sum(t[0] for t in times), times


STEP_MISTAKES = {
    "one_roofline_point": (
        step_time_one_point,
        r"a compute-bound product beside memory-bound cache reads: the step's seconds are wrong.*"
        r"one roofline point for the whole step",
    ),
    "bytes_time_plus_flops_time": (step_time_summed_roofs, r"not Σ bytes ÷ bandwidth \+ Σ FLOPs ÷ peak"),
    "largest_kernel": (step_time_largest, r"the step's time is the sum of theirs, not the largest"),
    "smaller_of_the_two": (step_time_smaller_of_the_two, r"a kernel's time is the larger of bytes ÷ bandwidth"),
    "the_steps_bound_for_every_kernel": (step_time_the_steps_bound, r"kernel 1 \('cache reads'\).*its own bound"),
    "kernels_reordered": (step_time_sorted, r"in another order.*in the order of the kernels given"),
    "kernels_mutated": (step_time_sorts_its_input, r"changed its input `kernels`.*build a new list"),
    "name_read_as_flops": (step_time_name_as_flops, r"raised TypeError.*its FLOPs are k\[1\], its bytes k\[2\]"),
    "attributes_of_plain_tuples": (
        step_time_by_attributes,
        r"step_time\(kernels=\[\('q'.*raised AttributeError.*its FLOPs are k\[1\]",
    ),
    "tie_is_compute": (
        step_time_tie_compute,
        r"exactly on the ridge.*kernel 0 \('on the ridge'\): the two times are equal.*"
        r"hint: when bytes ÷ bandwidth equals",
    ),
    "seconds_alone": (lambda *args: step_time(*args)[0], r"expected \(seconds, \[one \(seconds, bound"),
}


@pytest.mark.parametrize("fn, pattern", STEP_MISTAKES.values(), ids=STEP_MISTAKES)
def test_step_time_mistakes_are_named(fn, pattern):
    fails(check_step_time, fn, pattern)


def test_step_time_message_shows_input_expected_got():
    message = fails(check_step_time, STEP_MISTAKES["one_roofline_point"][0], "")
    assert (
        "input:    step_time(kernels=[Kernel(name='big product', flops=20000000000.0, bytes=1000000000.0), "
        "Kernel(name='cache reads', flops=1000000000.0, bytes=1000000000.0)], peak_flops=1000000000000.0, "
        "bandwidth=100000000000.0)" in message
    ), message
    assert "expected: StepTime(seconds=0.03, kernels=[RooflineTime(seconds=0.02, bound='compute'" in message, message
    assert "got:      (0.021, [(0.02, 'compute'" in message, message


def test_step_time_runs_in_the_engines_predict():
    """A step_time right on the check's kernels but not on the engine's (a kernel named "attention" skipped) fails
    in the engine."""

    def skips_attention(kernels, peak_flops, bandwidth):
        seconds, times = step_time(kernels, peak_flops, bandwidth)
        if [k[0] for k in kernels][:3] == ["q", "k", "v"] and len(kernels) == 10:
            return seconds - times[7][0], times
        return seconds, times

    fails(check_step_time, skips_attention, r"Llama-3-8B decoding 1024 sequences.*the step's seconds are wrong")


def test_step_time_alternatives_pass(capsys):
    def with_a_generator(kernels, peak_flops, bandwidth):
        times = list(roofline_time(k[1], k[2], peak_flops, bandwidth) for k in kernels)
        return math.fsum(t[0] for t in times), tuple(times)

    Step = namedtuple("Step", "seconds kernels")

    def numpy_and_lists(kernels, peak_flops, bandwidth):
        each = []
        for name, flops, nbytes in kernels:
            memory, compute = np.float64(nbytes) / bandwidth, np.float64(flops) / peak_flops
            each.append(
                [
                    max(memory, compute),
                    "compute" if compute > memory else "memory",
                    flops / np.float64(nbytes),
                    peak_flops / np.float64(bandwidth),
                ]
            )
        return Step(np.sum([t[0] for t in each]), each)

    check_step_time(with_a_generator)
    check_step_time(numpy_and_lists, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2


# -- critical_batch ---------------------------------------------------------------------------------------


def _first_batch(compute_bound, max_batch):
    if not compute_bound(max_batch):
        return None
    low, high = 0, max_batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def _each_product(shape, weights, dtype, peak_flops, bandwidth, max_batch, mats=None, bytes_of=None):
    """{(outputs, inputs): its critical batch or None} over `mats` (every matrix of the shape)."""

    def product(outputs, inputs):
        def bound(batch):
            flops, nbytes = gemm_cost(batch, outputs, inputs, weights, dtype)
            if bytes_of:
                nbytes = bytes_of(batch, outputs, inputs)
            return roofline_time(flops, nbytes, peak_flops, bandwidth)[1] == "compute"

        return _first_batch(bound, max_batch)

    return {m: product(*m) for m in set(mats if mats is not None else matrices(shape))}


def _the_last(batches):
    values = list(batches.values())
    return None if None in values else max(values)


def step_kernels(shape, batch, new_tokens, context, weights="float16", dtype="float16"):
    """A step's kernels from the learner's functions (as the chapter gives it): the products over the layers,
    attention and the head."""
    rows, L = batch * new_tokens, shape.n_layer
    kernels = [
        Kernel(n, *(L * x for x in gemm_cost(rows, o, i, weights, dtype)))
        for n, (o, i) in layer_matrices(shape).items()
    ]
    kernels.append(Kernel("attention", *attention_cost(shape, batch, new_tokens, context, dtype)))
    kernels.append(Kernel("head", *gemm_cost(rows, shape.vocab_size, shape.n_embd, weights, dtype)))
    return kernels


def critical_batch_summed(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """Every weight product summed into one roofline point."""

    def bound(batch):
        costs = [gemm_cost(batch, o, i, weights, dtype) for o, i in matrices(shape)]
        flops, nbytes = sum(c[0] for c in costs), sum(c[1] for c in costs)
        return roofline_time(flops, nbytes, peak_flops, bandwidth)[1] == "compute"

    return _first_batch(bound, max_batch)


def critical_batch_whole_step(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """The whole decode step (attention at context 0 too) as one point, by step_time's sum... of one roofline."""

    def bound(batch):
        kernels = step_kernels(shape, batch, 1, 0, weights, dtype)
        return (
            roofline_time(sum(k.flops for k in kernels), sum(k.bytes for k in kernels), peak_flops, bandwidth)[1]
            == "compute"
        )

    return _first_batch(bound, max_batch)


def critical_batch_first_to_turn(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    found = [b for b in _each_product(shape, weights, dtype, peak_flops, bandwidth, max_batch).values() if b]
    return min(found) if found else None


def critical_batch_no_head(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    layer = list(layer_matrices(shape).values())
    return _the_last(_each_product(shape, weights, dtype, peak_flops, bandwidth, max_batch, mats=layer))


def critical_batch_q_only(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    q = [layer_matrices(shape)["q"]]
    return _the_last(_each_product(shape, weights, dtype, peak_flops, bandwidth, max_batch, mats=q))


def critical_batch_weights_only(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    def weights_alone(batch, outputs, inputs):
        return matrix_bytes(outputs, inputs, weights, dtype)

    return _the_last(_each_product(shape, weights, dtype, peak_flops, bandwidth, max_batch, bytes_of=weights_alone))


def critical_batch_two_over_bytes(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """2·B FLOPs per weight read against the ridge: 2B / bytes per weight > ridge."""
    per_weight = {**BYTES, "int8": 1, "int4": 0.5}[weights]
    batch = math.floor(peak_flops / bandwidth * per_weight / 2) + 1
    return batch if batch <= max_batch else None


def last_memory_bound(*args):
    found = critical_batch(*args)
    return None if found is None else found - 1


def ridge_itself(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    return math.floor(peak_flops / bandwidth)


def as_float(*args):
    found = critical_batch(*args)
    return None if found is None else float(found)


def _none_as(value):
    def critical_batch_(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
        found = critical_batch(shape, weights, dtype, peak_flops, bandwidth, max_batch)
        return (max_batch if value == "max_batch" else value) if found is None else found

    return critical_batch_


def max_batch_ignored(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    return critical_batch(shape, weights, dtype, peak_flops, bandwidth, 1 << 20)


def critical_batch_ties_compute(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """Compute-bound when the FLOPs take as long as the bytes (>=)."""

    def bound(outputs, inputs):
        def at(batch):
            flops, nbytes = gemm_cost(batch, outputs, inputs, weights, dtype)
            return flops / peak_flops >= nbytes / bandwidth

        return at

    found = [_first_batch(bound(o, i), max_batch) for o, i in set(matrices(shape))]
    return None if None in found else max(found)


def linear_search(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    def compute_bound(batch, outputs, inputs):
        flops, nbytes = gemm_cost(batch, outputs, inputs, weights, dtype)
        return roofline_time(flops, nbytes, peak_flops, bandwidth)[1] == "compute"

    for batch in range(1, max_batch + 1):
        if all(compute_bound(batch, o, i) for o, i in set(matrices(shape))):
            return batch
    return None


BATCH_MISTAKES = {
    "products_summed_into_one_point": (
        critical_batch_summed,
        r"Llama-3-8B.*expected a batch of 462, got 332.*judge each weight product on its own roofline",
    ),
    "whole_step_one_point": (critical_batch_whole_step, r"expected a batch of 462.*no weight products"),
    "first_product_to_turn": (critical_batch_first_to_turn, r"turns the first product compute-bound"),
    "head_left_out": (
        critical_batch_no_head,
        r"output head \[64, 256\].*the output head \[vocab_size, n_embd\] is a weight product too",
    ),
    "q_only": (critical_batch_q_only, r"every weight product must be compute-bound, not only q"),
    "weights_only": (critical_batch_weights_only, r"use gemm_cost's bytes, not the weights' alone"),
    "two_over_bytes_per_weight": (critical_batch_two_over_bytes, r"use gemm_cost's bytes, not the weights' alone"),
    "off_by_one": (last_memory_bound, r"the last memory-bound one"),
    "the_ridge": (ridge_itself, r"that is the ridge point \(FLOPs per byte of the machine\), not a batch size"),
    "a_float": (as_float, r"a batch size is a whole number: return an int"),
    "max_batch_for_none": (_none_as("max_batch"), r"return None \(not max_batch\)"),
    "zero_for_none": (_none_as(0), r"no batch up to max_batch=1048576 is compute-bound.*return None"),
    "max_batch_ignored": (max_batch_ignored, r"max_batch below the answer.*no batch above max_batch"),
    "ties_counted_compute_bound": (
        critical_batch_ties_compute,
        r"exactly at batch 64.*expected a batch of 65, got 64.*at batch 64 a product's two times are exactly equal",
    ),
    "linear_search": (linear_search, r"did not finish within its 2 CPU-s.*binary search"),
}


@pytest.mark.parametrize("fn, pattern", BATCH_MISTAKES.values(), ids=BATCH_MISTAKES)
def test_critical_batch_mistakes_are_named(fn, pattern):
    fails(check_critical_batch, fn, pattern)


def test_critical_batch_message_shows_input_expected_got():
    message = fails(check_critical_batch, BATCH_MISTAKES["off_by_one"][0], "")
    assert "input:    critical_batch(shape=SHAPES[\"Llama-3-8B\"], weights='bfloat16', dtype='bfloat16'" in message, (
        message
    )
    assert "expected: 462" in message and "got:      461" in message, message


def test_critical_batch_alternatives_pass(capsys):
    def closed_form_exact(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
        """A product [o, i] is compute-bound at B when 2·B·o·i / peak > (stored + B·(o + i)·bytes) / bandwidth:
        B·(2·o·i·bandwidth − (o + i)·bytes·peak) > stored·peak, solved in exact fractions."""
        peak, bw = Fraction(peak_flops), Fraction(bandwidth)
        needed = 1
        for o, i in set(matrices(shape)):
            gain = 2 * o * i * bw - (o + i) * BYTES[dtype] * peak
            if gain <= 0:
                return None
            needed = max(needed, math.floor(matrix_bytes(o, i, weights, dtype) * peak / gain) + 1)
        return np.int64(needed) if needed <= max_batch else None

    def from_the_step_kernels(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
        """The weight products of the chapter's step_kernels, each over the layers (the same intensity)."""
        products = [*layer_matrices(shape), "head"]

        def all_compute_bound(batch):
            kernels = step_kernels(shape, batch, 1, 0, weights, dtype)
            return all(
                roofline_time(k.flops, k.bytes, peak_flops, bandwidth)[1] == "compute"
                for k in kernels
                if k.name in products
            )

        return _first_batch(all_compute_bound, max_batch)

    check_critical_batch(closed_form_exact)
    check_critical_batch(closed_form_exact, seed=101, n_random=40)
    check_critical_batch(from_the_step_kernels, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 3


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


def critical_batch_ceil(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """Each product's balance point of its linear FLOPs and bytes, rounded up: on a tie that batch is still
    memory-bound."""
    ridge, needed = peak_flops / bandwidth, 1
    for o, i in set(matrices(shape)):
        flops, nbytes = gemm_cost(1, o, i, weights, dtype)
        per_flops, per_bytes = flops, (o + i) * BYTES[dtype]  # what each row adds
        gain = per_flops / ridge - per_bytes
        if gain <= 0:
            return None
        needed = max(needed, math.ceil(matrix_bytes(o, i, weights, dtype) / gain))
    return needed if needed <= max_batch else None


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
        r"exactly at batch 64.*expected a batch of 65, got 64.*at batch 64 a product's two times are exactly equal.*"
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


def critical_batch_floor_plus_one(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    """Correct, written differently: each product's first batch past its balance point, checked with gemm_cost and
    roofline_time (float rounding can put the balance point an ulp off)."""

    def compute_bound(b, o, i):
        return roofline_time(*gemm_cost(b, o, i, weights, dtype), peak_flops, bandwidth)[1] == "compute"

    needed = 1
    for o, i in set(matrices(shape)):
        one, two = gemm_cost(1, o, i, weights, dtype), gemm_cost(2, o, i, weights, dtype)
        gain = (two[0] - one[0]) * bandwidth / peak_flops - (two[1] - one[1])
        if gain <= 0:
            return None
        batch = max(1, math.floor((2 * one[1] - two[1]) / gain) + 1)
        while batch > 1 and compute_bound(batch - 1, o, i):
            batch -= 1
        while batch <= max_batch and not compute_bound(batch, o, i):
            batch += 1
        needed = max(needed, batch)
    return needed if needed <= max_batch else None


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
    from llmcourse.engine.roofline import gemm_cost as engine_gemm_cost

    peak, bandwidth = on_the_ridge(BUNDLED, 64)
    cost = engine_gemm_cost(64, 192, 192, "float32", "float32")  # the thinnest product: q, k, v and o [192, 192]
    assert cost.flops / peak == cost.bytes / bandwidth and cost.flops / cost.bytes == peak / bandwidth
    assert engine_critical_batch(BUNDLED, "float32", "float32", peak, bandwidth) == 65


# -- issue 42's kinds for the per-kernel checks: inputs mutated, black boxes, thresholds, number types ------------


def step_time_replaces_a_kernel(kernels, peak_flops, bandwidth):
    """Writes each kernel's time over its entry: the caller's kernels are gone."""
    for index, (_, flops, nbytes) in enumerate(kernels):
        kernels[index] = roofline_time(flops, nbytes, peak_flops, bandwidth)
    return sum(t[0] for t in kernels), list(kernels)


def step_time_with_the_engines_roofline_time(kernels, peak_flops, bandwidth):
    from llmcourse.engine.roofline import roofline_time as engines

    times = [engines(k[1], k[2], peak_flops, bandwidth) for k in kernels]
    return sum(t.seconds for t in times), times


def critical_batch_with_the_engines_gemm_cost(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20):
    import llmcourse.engine.roofline as engine

    def compute_bound(batch, outputs, inputs):
        flops, nbytes = engine.gemm_cost(batch, outputs, inputs, weights, dtype)
        return roofline_time(flops, nbytes, peak_flops, bandwidth)[1] == "compute"

    needed = 1
    for o, i in set(matrices(shape)):
        if not compute_bound(max_batch, o, i):
            return None
        needed = max(needed, next(b for b in range(1, max_batch + 1) if compute_bound(b, o, i)))
    return needed


def attention_cost_through_predict(shape, batch, new_tokens, context, dtype="float16"):
    from llmcourse.engine.roofline import predict

    p = predict(shape, (1e12, 1e12), batch=batch, new_tokens=new_tokens, context=context, dtype=dtype)
    return next((k.flops, k.bytes) for k in p.kernels if k.name == "attention")


ISSUE42_MISTAKES = {
    "kernels_replaced_in_place": (check_step_time, step_time_replaces_a_kernel, r"changed its input `kernels`"),
    "engines_roofline_time_inside": (
        check_step_time,
        step_time_with_the_engines_roofline_time,
        r"llmcourse.engine.roofline.roofline_time is the engine's.*write your own",
    ),
    "engines_gemm_cost_inside": (
        check_critical_batch,
        critical_batch_with_the_engines_gemm_cost,
        r"llmcourse.engine.roofline.gemm_cost is the engine's.*write your own",
    ),
    "engines_predict_inside": (
        check_attention_cost,
        attention_cost_through_predict,
        r"llmcourse.engine.roofline.predict runs the engine's formulas",
    ),
    "tie_counted_compute_in_step_time": (
        check_step_time,
        step_time_tie_compute,
        r"kernel 0 \('on the ridge'\): the two times are equal, expected 'memory', got 'compute'",
    ),
    "gemm_cost_as_a_string": (check_gemm_cost, lambda *args: str(gemm_cost(*args)), r"expected two numbers"),
    "critical_batch_as_a_tensor": (
        check_critical_batch,
        lambda *args: __import__("torch").tensor(critical_batch(*args) or 0),
        r"got a tensor",
    ),
}


@pytest.mark.parametrize("check, fn, pattern", ISSUE42_MISTAKES.values(), ids=ISSUE42_MISTAKES)
def test_issue42_kinds_are_rejected_and_named(check, fn, pattern):
    fails(check, fn, pattern)


def gemm_cost_in_fractions(rows, outputs, inputs, weights="float16", dtype="float16"):
    """Any Python number type: Fractions."""
    return Fraction(2 * rows * outputs * inputs), Fraction(gemm_cost(rows, outputs, inputs, weights, dtype)[1])


def attention_cost_in_numpy(shape, batch, new_tokens, context, dtype="float16"):
    """Any Python number type: numpy scalars, in the engine's Cost."""
    flops, nbytes = attention_cost(shape, batch, new_tokens, context, dtype)
    return Cost(np.float64(flops), np.int64(nbytes))


def critical_batch_numpy_int(*args):
    found = critical_batch(*args)
    return None if found is None else np.int64(found)


def step_time_as_a_step_time(kernels, peak_flops, bandwidth):
    """The engine's StepTime and RooflineTime types, filled with the learner's numbers."""
    from llmcourse.engine.roofline import RooflineTime, StepTime

    times = [RooflineTime(*roofline_time(k[1], k[2], peak_flops, bandwidth)) for k in kernels]
    return StepTime(sum(t.seconds for t in times), times)


ISSUE42_ALTERNATIVES = {
    "gemm_fractions": (check_gemm_cost, gemm_cost_in_fractions),
    "attention_numpy": (check_attention_cost, attention_cost_in_numpy),
    "critical_numpy_int": (check_critical_batch, critical_batch_numpy_int),
    "step_time_types": (check_step_time, step_time_as_a_step_time),
}


@pytest.mark.parametrize("check, fn", ISSUE42_ALTERNATIVES.values(), ids=ISSUE42_ALTERNATIVES)
def test_issue42_alternatives_pass(check, fn, capsys):
    check(fn)
    check(fn, seed=101, n_random=40)
    assert capsys.readouterr().out.count("✓") == 2
