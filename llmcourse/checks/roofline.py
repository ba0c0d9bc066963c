"""Checks for chapter 10, the roofline: a card's two roofs, the bytes of a stored matrix, the FLOPs and bytes of a
forward step, its least time and bound, the batch at which decode turns compute-bound, and MBU / MFU.

Each check compares the learner's function with the engine's (`llmcourse.engine.roofline`) on fixed cases and
seeded random ones drawn from the whole input space: GPT-2 124M, the bundled model's configuration, Llama-2-7B
(every head its own keys and values), Llama-3-8B and 70B (grouped-query attention, SwiGLU, an untied head), tiny
shapes; a batch of 1 and of hundreds; one new token (decode) and many (prefill); no context and long ones; every
weight format (float32, float16, bfloat16, int8, int4) and cache dtype; numpy arguments; and calls exactly as the
engine makes them (positional, defaults left out). The formulas are exact: answers within a relative 1e-9 (float
rounding) pass, in any Python number type (datasheet figures within 1 %: datasheets round), and a wrong one is
matched against the common mistakes to name it. Each check ends in the engine: `predict` (or the engine's quantized
layers, or its critical batch) running the learner's function through its guard. Expected answers are computed
after the learner's call.

    >>> def utilization(flops, nbytes, seconds, peak_flops, bandwidth):
    ...     return nbytes / seconds / bandwidth, flops / seconds / peak_flops
    >>> check_utilization(utilization)
    ✓ utilization — 20 cases
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import numbers
import random
from fractions import Fraction
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guard
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.quantize import QuantizedAffine, quantize_model
from llmcourse.engine.roofline import (
    FLOAT_BYTES,
    GPUS,
    SHAPES,
    Machine,
    ModelShape,
    Prediction,
    Roofline,
    _matrices,
    predict,
)
from llmcourse.engine.roofline import critical_batch as engine_critical_batch
from llmcourse.engine.roofline import gpu_roof as engine_gpu_roof
from llmcourse.engine.roofline import matrix_bytes as engine_matrix_bytes
from llmcourse.engine.roofline import roofline_time as engine_roofline_time
from llmcourse.engine.roofline import step_cost as engine_step_cost
from llmcourse.engine.roofline import utilization as engine_utilization

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, later, run_check
from .harness.forbid import Forbidden
from .harness.show import short

# ----------------------------------------------------------------------------------------------
# Shared: black boxes, numbers, the cases' shapes and machines

_ENGINES = ("gpu_roof", "matrix_bytes", "step_cost", "roofline_time", "critical_batch", "utilization")
NO_ENGINE_ROOFLINE = [
    *(
        Forbidden(
            f"llmcourse.engine.roofline.{name}",
            f"llmcourse.engine.roofline.{name} is the engine's, what yours is compared with: write your own",
        )
        for name in _ENGINES
    ),
    Forbidden(
        "llmcourse.engine.roofline.predict",
        "llmcourse.engine.roofline.predict runs the engine's formulas, what yours are compared with: write your own",
    ),
    Forbidden(
        "llmcourse.engine.roofline._matrices",
        "llmcourse.engine.roofline._matrices lists the engine's matrices: list a layer's matrices yourself",
    ),
]
# `predict` runs the engine's step_cost, roofline_time and utilization (and they _matrices and matrix_bytes): in
# the engine, only the learner's own function and the ones predict does not call stay forbidden.
_PREDICT_RUNS = {"predict", "_matrices", "matrix_bytes", "step_cost", "roofline_time", "utilization"}


def _in_engine_forbid(name: str) -> list[Forbidden]:
    return [f for f in NO_ENGINE_ROOFLINE if f.target.rsplit(".", 1)[1] not in _PREDICT_RUNS - {name}]


# The formulas are exact: only float rounding separates two correct ways of writing them.
REL_TOL = 1e-9
HINT_TOL = 1e-6  # a wrong answer this close to a known mistake is that mistake

BUNDLED_CONFIG = GPT2Config(n_layer=6, n_head=6, n_embd=192, n_positions=256)
BUNDLED = ModelShape.of(BUNDLED_CONFIG)
TINY = ModelShape(1, 4, 1, 1, 4, 16, 10)
TINY_GQA = ModelShape(2, 64, 4, 2, 16, 128, 100, "swiglu", tied=False)
CARDS = ("H100 SXM", "A100 80GB SXM", "RTX 4090")
H100 = (989e12, 3.35e12)  # the roofs the cases use, so that no case depends on the engine's table but gpu_roof's
A100 = (312e12, 2.039e12)
RTX4090 = (165.2e12, 1.008e12)
M3_MAX = (14.2e12, 400e9)  # a made-up peak beside Apple's published bandwidth: a low ridge


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _close(a: float, b: float, rel: float = REL_TOL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0) or (a == b)


def _has_tensor(got: Any) -> bool:
    return isinstance(got, Tensor) or (isinstance(got, (tuple, list)) and any(isinstance(x, Tensor) for x in got))


_TENSOR = ("expected plain numbers, got a tensor", "use Python numbers (or .item()): these are formulas, not tensors")


def _first(mistakes: list[tuple[float, str]], got: float, rel: float = HINT_TOL) -> str:
    """The hint of the first mistake whose value `got` is, or ''."""
    return next((hint for wrong, hint in mistakes if _close(got, wrong, rel)), "")


def _shape_text(shape: ModelShape) -> str:
    name = next((n for n, s in SHAPES.items() if s == shape), None)
    if name:
        return f'SHAPES["{name}"]'
    if shape == BUNDLED:
        return "ModelShape.of(GPT2Config(n_layer=6, n_head=6, n_embd=192))"
    return repr(shape)


def _call_text(name: str, names: tuple, args: tuple) -> str:
    text = (_shape_text(a) if isinstance(a, ModelShape) else repr(a) for a in args)
    return f"{name}(" + ", ".join(f"{n}={a}" for n, a in zip(names, text)) + ")"


def _run_both(
    name: str, runner: Callable, cases: list, engine_cases: Callable[[], list], in_engine: bool = True, **settings
) -> None:
    """The cases under every black box, then the engine's (made only now: some take a while to build) under those
    the engine does not run itself (all of them unless `in_engine`), with one line for both."""
    with contextlib.redirect_stdout(io.StringIO()):
        run_check(name, runner, cases, forbid=NO_ENGINE_ROOFLINE, **settings)
    more = engine_cases()
    forbid = _in_engine_forbid(name) if in_engine else NO_ENGINE_ROOFLINE
    run_check(name, runner, more, forbid=forbid, success=f"✓ {name} — {len(cases) + len(more)} cases", **settings)


def _predicted_with(name: str, fn: Callable, shape: ModelShape, machine: tuple, keywords: dict) -> Prediction:
    """The engine's `predict` with the learner's function in slot `name`, called as the engine calls it (positionally,
    through its guard)."""
    return predict(shape, machine, **keywords, table=Roofline().replace(**{name: guard(name, fn)}))


def _engine_verdict(got: Any, expected: Prediction, part: Verdict) -> Verdict:
    """The verdict on the engine's Prediction made with the learner's function: `part`, the slot's own verdict on
    its piece of the prediction, said as the engine's; else whatever else differs from the engine's own."""
    if part:
        return f"in the engine's prediction, {part[0]}", part[1]
    problem = _judge_prediction(got, expected)
    return (problem, "") if problem else None


def _judge_prediction(got: Any, expected: Prediction, rel: float = REL_TOL) -> Optional[str]:
    """What differs between the engine's Prediction with the learner's function in it and the engine's own."""
    if not isinstance(got, Prediction):
        return f"expected the engine's Prediction, got {short(got, 80)}"
    if got.roof.bound != expected.roof.bound:
        return f"the engine finds the step {got.roof.bound}-bound, expected {expected.roof.bound}-bound"
    for field in ("tokens_per_s", "seconds", "mbu", "mfu"):
        a, b = getattr(got, field), getattr(expected, field)
        if (a is None) != (b is None) or (b is not None and not _close(a, b, rel)):
            return f"the engine's prediction differs: {field} {a!r}, expected {b!r}"
    for a, b, field in [
        *zip(got.cost, expected.cost, got.cost._fields),
        *zip(got.roof, expected.roof, got.roof._fields),
    ]:
        if (a != b) if isinstance(b, str) else not _close(a, b, rel):
            return f"the engine's prediction differs: {field} {a!r}, expected {b!r}"
    return None


# ----------------------------------------------------------------------------------------------
# Exercise 1: gpu_roof — a card's dense 16-bit peak FLOP/s and memory bandwidth, from its datasheet

ROOF_TOL = 0.01  # datasheets round: 2.04 vs 2.039 TB/s, 165 vs 165.2 TFLOP/s, 1.01 vs 1.008 TB/s
# the figures datasheets print beside the one asked for: the FP32 (CUDA cores) and TF32 tensor figures, dense
OTHER_FIGURES = {
    "H100 SXM": (67e12, 494.5e12),
    "A100 80GB SXM": (19.5e12, 156e12),
    "RTX 4090": (82.6e12, 82.6e12),
}
# The datasheet table the chapter's setup imports, `GPUS`, holds the three cards' figures and more cards: a table read
# is no call, so the black-box watch cannot see it. Reading it is made to fail instead. During each call of the
# learner's gpu_roof every entry of GPUS holds a decoy (its peak × 1.37, its bandwidth × 0.61): a gpu_roof that reads
# the table then answers with the decoy, and is told so; and the cards GPUS holds beyond the chapter's three (the H200,
# Apple's chips) must raise like any card the exercise does not ask for, which also catches a copy of the table made
# before the call. The expected answers are computed after the call, from the table as it is.
DECOY = (1.37, 0.61)
TABLE_ONLY_CARDS = tuple(card for card in GPUS if card not in CARDS)
UNKNOWN_CARDS = ("H100 PCIe", "", "A100 40GB PCIe", "RTX 3090", "TPU v5e", *TABLE_ONLY_CARDS)


def _decoy(machine: Machine) -> Machine:
    peak = None if machine.peak_flops is None else machine.peak_flops * DECOY[0]
    return machine._replace(peak_flops=peak, bandwidth=machine.bandwidth * DECOY[1])


@contextlib.contextmanager
def decoy_datasheets():
    """GPUS with every entry a decoy while the block runs (the same dict: a name bound to it sees them too)."""
    saved = dict(GPUS)
    GPUS.update({card: _decoy(machine) for card, machine in saved.items()})
    try:
        yield
    finally:
        GPUS.update(saved)


def _is_roof(got: Any, machine: Machine) -> bool:
    """Whether `got` is the pair (peak, bandwidth) of `machine`, within ROOF_TOL (None where its peak is None)."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return False
    return all(
        (b is None and a is None) or (b is not None and _number(a) and _close(float(a), b, ROOF_TOL))
        for a, b in zip(got, (machine.peak_flops, machine.bandwidth))
    )


def _table_hint(card: str, got: Any) -> str:
    """The hint for an answer that came from llmcourse's GPUS table (read during the call, or copied before), or ''."""
    if card not in GPUS:
        return ""
    if _is_roof(got, _decoy(GPUS[card])):
        return (
            "your gpu_roof reads llmcourse's GPUS table: during the call the check put other numbers in it, and "
            "yours came back — write the datasheet's figures in a table of your own (the chapter's table above)"
        )
    if card not in CARDS and _is_roof(got, GPUS[card]):
        return (
            f"those are the {card}'s figures in llmcourse's GPUS table: your table is (a copy of) the engine's; "
            "the exercise's holds the chapter's three cards, written from their datasheets, and another card raises"
        )
    return ""


def _roof_hint(card: str, flops: float, bandwidth: float) -> str:
    """What mistake gives this (peak, bandwidth) for gpu_roof(card), or ''."""
    peak, bw = engine_gpu_roof(card)
    if _close(flops, bw, ROOF_TOL) and _close(bandwidth, peak, ROOF_TOL):
        return "return (peak FLOP/s, bandwidth in bytes/s), in that order"
    if not _close(flops, peak, ROOF_TOL):
        fp32, tf32 = OTHER_FIGURES[card]
        twice = (
            "1979 TFLOP/s is the H100's BF16 figure with 2:4 sparsity, and its dense FP8 figure"
            if card == "H100 SXM"
            else "that is twice the dense 16-bit figure: the datasheet's figure with 2:4 structured sparsity (or "
            "an 8-bit / 16-bit-accumulate one)"
        )
        return (
            _first(
                [
                    (
                        2 * peak,
                        f"{twice}: dense matrix products in 16 bits never reach it — use the dense BF16/FP16 figure",
                    ),
                    (peak / 1e12, "FLOP/s, not TFLOP/s: multiply the datasheet's TFLOP/s by 10^12"),
                    (peak / 1e9, "FLOP/s, not GFLOP/s: multiply by 10^9"),
                    (
                        fp32,
                        "that is the FP32 figure (CUDA cores): the roof of a 16-bit model is the BF16/FP16 tensor one",
                    ),
                    (tf32, "that is the TF32 tensor figure: the roof of a 16-bit model is the BF16/FP16 tensor one"),
                    (peak * 2**40 / 1e12, "a TFLOP/s is 10^12 FLOP/s, not 2^40"),
                ],
                flops,
                ROOF_TOL,
            )
            or "the dense BF16/FP16 tensor-core figure of the card's datasheet, in FLOP/s"
        )
    return (
        _first(
            [
                (bw / 1e12, "bytes/s, not TB/s: multiply the datasheet's TB/s by 10^12"),
                (bw / 1e9, "bytes/s, not GB/s: multiply the datasheet's GB/s by 10^9"),
                (bw * 2**40 / 1e12, "a TB is 10^12 bytes (not 2^40, a TiB): bandwidths are in decimal units"),
                (bw * 2**30 / 1e9, "a GB is 10^9 bytes (not 2^30, a GiB): bandwidths are in decimal units"),
                (8 * bw, "bytes/s, not bits/s"),
            ],
            bandwidth,
            ROOF_TOL,
        )
        or "the memory bandwidth of the card's datasheet, in bytes/s"
    )


def _judge_roof(case: Case, got: Any) -> Verdict:
    how, card = case.args
    if how == "unknown":
        if isinstance(got, str) and got in ("ValueError raised", "KeyError raised"):
            return None
        if isinstance(got, str) and got.endswith(" raised"):
            return f"it {got}", "raise ValueError (or KeyError) for a card that is not in your table"
        return (
            f"an unknown card must raise an error, not return {short(got, 80)}",
            _table_hint(card, got)
            or "raise ValueError (or KeyError) for a card your table does not hold: numbers for the wrong card are "
            "worse than none",
        )
    if how == "engine":
        problem = _judge_prediction(got, case.expected, ROOF_TOL)
        return (problem, "the engine calls gpu_roof(card) with the card's name alone") if problem else None
    if _has_tensor(got):
        return _TENSOR
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(_number(x) for x in got):
        return f"expected a pair of numbers (peak FLOP/s, bandwidth), got {short(got, 80)}", "return peak, bandwidth"
    flops, bandwidth = (float(x) for x in got)
    peak, bw = case.expected
    if _close(flops, peak, ROOF_TOL) and _close(bandwidth, bw, ROOF_TOL):
        return None
    read = _table_hint(card, got)
    if read:
        return "these are the numbers the check put in llmcourse's GPUS table during the call", read
    which = "the peak FLOP/s is wrong" if not _close(flops, peak, ROOF_TOL) else "the bandwidth is wrong"
    return which, _roof_hint(card, flops, bandwidth)


def _run_roof(fn: Callable, how: str, card: str):
    if how == "unknown":
        try:
            with decoy_datasheets():
                return fn(card)
        except NotImplementedError:
            raise
        except Exception as err:  # which error is judged (a forbidden call is reported by the watch all the same)
            return f"{type(err).__name__} raised"
    if how == "engine":  # the chapter's table: Llama-3-8B on the card, decode at batch 1 and a prefill
        with decoy_datasheets():
            machine = guard("gpu_roof", fn)(card)
        return predict(SHAPES["Llama-3-8B"], machine, new_tokens=1 if card == "H100 SXM" else 2048)
    with decoy_datasheets():
        return fn(card)


def check_gpu_roof(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """gpu_roof(card) -> (dense 16-bit peak FLOP/s, memory bandwidth in bytes/s) of "H100 SXM", "A100 80GB SXM" and
    "RTX 4090", from their datasheets, within 1 % (datasheets round); a card it does not know raises ValueError (or
    KeyError), also the cards llmcourse's GPUS table holds beyond these three. The table itself holds decoys while
    the learner's function runs (see DECOY): its figures are to be written, not read. Ends with the engine's
    prediction for Llama-3-8B on the cards it returns."""
    if not callable(fn):
        raise CheckFailed(f"✗ gpu_roof: expected a function, got {short(fn)}")

    def case(how, card, description, hint=""):
        expected = "ValueError or KeyError raised" if how == "unknown" else later(engine_gpu_roof, card)
        return Case(description, (how, card), expected, hint)

    cases = [
        case("call", "H100 SXM", "the H100 SXM", "989 TFLOP/s dense BF16, 3.35 TB/s of HBM3"),
        case("call", "A100 80GB SXM", "the A100 80GB SXM"),
        case("call", "RTX 4090", "the RTX 4090", "the Ada whitepaper: FP16 tensor with FP32 accumulate, GDDR6X"),
        case("unknown", "H100 PCIe", "a card not in the table (the PCIe H100 has other clocks and memory)"),
        case("unknown", "", "an empty name"),
        case("unknown", "H200 SXM", "the H200 SXM: not one of the exercise's three cards (llmcourse's GPUS has it)"),
        case("unknown", "Apple M3 Max", "Apple's M3 Max: not one of the exercise's cards (no FLOP/s published)"),
    ]
    rng = random.Random(seed)
    for i in range(n_random):  # repeated calls in any order: a table, not state
        if rng.random() < 0.2:
            cases.append(case("unknown", rng.choice(UNKNOWN_CARDS), f"random #{i}: an unknown card"))
        else:
            cases.append(case("call", rng.choice(CARDS), f"random #{i}"))

    def engine_case(card):
        new_tokens = 1 if card == "H100 SXM" else 2048
        what = "a decode step at batch 1" if new_tokens == 1 else "a prefill of 2048 tokens"
        return Case(
            f"in the engine: Llama-3-8B's {what} on the {card}, predicted from your roofs",
            ("engine", card),
            later(lambda: predict(SHAPES["Llama-3-8B"], engine_gpu_roof(card), new_tokens=new_tokens)),
        )

    def show(args: tuple) -> str:
        how, card = args
        if how == "engine":
            new_tokens = 1 if card == "H100 SXM" else 2048
            return f'predict(SHAPES["Llama-3-8B"], gpu_roof({card!r}), new_tokens={new_tokens})'
        return f"gpu_roof({card!r})"

    _run_both(
        "gpu_roof",
        lambda how, card: _run_roof(fn, how, card),
        cases,
        lambda: [engine_case(card) for card in CARDS],
        judge=_judge_roof,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: matrix_bytes — the bytes of a weight matrix as the engine stores it, scales included


def _bytes_mistakes(rows: float, cols: float, fmt: str, dtype: str) -> list[tuple[float, str]]:
    """(what a mistake gives, its hint) for matrix_bytes(rows, cols, fmt, dtype); the same entries for any shape."""
    n, size = rows * cols, FLOAT_BYTES[dtype]
    if fmt in FLOAT_BYTES:
        each = FLOAT_BYTES[fmt]
        return [
            (n * size, "the weights are stored in `fmt`; `dtype` only sets the type of int8's scales"),
            (n * 2, "float32 takes 4 bytes per weight"),
            (n * 4, "float16 and bfloat16 take 2 bytes per weight"),
            (n, f"{fmt} takes {each} bytes per weight"),
            (8 * n * each, "bytes, not bits"),
            (n * each + rows * size, f"only int8 and int4 have scales: {fmt} is stored as it is"),
        ]
    if fmt == "int8":
        return [
            (n, "int8 also stores a scale per row (output), in the model's dtype: + rows × bytes of dtype"),
            (n + cols * size, "one scale per row (output), not per column: + rows × bytes of dtype"),
            (n + rows, "the int8 scales are in the model's `dtype` (float32: 4 bytes, float16/bfloat16: 2)"),
            (
                n + rows * (6 - size),
                "the int8 scales are in the model's `dtype` (float32: 4 bytes, float16/bfloat16: 2)",
            ),
            (n + rows * cols / 32 * size, "int8 has one scale per row; a scale per group of 32 inputs is int4's"),
            (8 * (n + rows * size), "bytes, not bits: an int8 weight is one byte"),
            (n / 2 + rows * size, "an int8 weight is one byte (int4's are half a byte)"),
        ]
    groups = rows * cols / 32
    return [
        (n / 2, "int4 also stores a float16 scale per group of 32 inputs of each row: + rows × cols/32 × 2 bytes"),
        (
            groups * 2,
            "the weights count for nothing: 4 bits is half a byte, and 4 // 8 (or int(0.5)) truncates it to 0 — keep "
            "the half (rows × cols / 2), or count bits and divide the total by 8",
        ),
        (n * 4 + groups * 2, "int4 is 4 bits, half a byte per weight, not 4 bytes"),
        (n * 4, "int4 is 4 bits, half a byte per weight (not 4 bytes), plus a float16 scale per group of 32"),
        (n + groups * 2, "int4 is half a byte per weight: two weights per byte"),
        (n / 2 + groups * 4, "int4's scales are float16 (2 bytes), whatever the model's dtype"),
        (n / 2 + groups * size, "int4's scales are float16 (2 bytes), whatever the model's dtype"),
        (n / 2 + rows * 2, "int4 has a scale per group of 32 inputs of a row, not one per row"),
        (n / 2 + rows * size, "int4 has a scale per group of 32 inputs of a row, not one per row"),
        *(
            (n / 2 + rows * cols / g * 2, "a group is 32 inputs (GROUP_SIZE): rows × cols/32 scales")
            for g in (16, 64, 128)
        ),
        (4 * n + 32 * groups * 2, "bytes, not bits: a weight is half a byte, a scale 2 bytes"),
        (8 * (n / 2 + groups * 2), "bytes, not bits"),
    ]


def _judge_bytes(case: Case, got: Any) -> Verdict:
    expected = case.expected
    if isinstance(got, Tensor):
        return "expected a number of bytes (an int), got a tensor", "use Python numbers (or .item())"
    if not _number(got):
        return f"expected a number of bytes (an int), got {short(got, 80)}", "return rows * cols * ... : a number"
    if _close(float(got), float(expected)):
        if got != int(got):
            return f"expected a whole number of bytes, got {got!r}", "a matrix takes a whole number of bytes"
        return None
    how, *args = case.args
    if how == "engine":
        fmt, dtype, layers = args
        per_layer = [_bytes_mistakes(r, c, fmt, dtype) for r, c in layers]
        mistakes = [(sum(value for value, _ in same), same[0][1]) for same in zip(*per_layer)]
        hint = _first(mistakes, float(got))
        return f"your matrix_bytes over the engine's layers sums to {got!r} bytes, they hold {expected}", hint
    rows, cols, fmt, dtype = (*args, "float32")[:4]
    return f"expected {expected} bytes, got {got!r}", _first(_bytes_mistakes(rows, cols, fmt, dtype), float(got))


def _quantized_layers(fmt: str, dtype: torch.dtype) -> tuple[list[tuple[int, int]], Callable[[], int]]:
    """The bundled model quantized by the engine to `fmt`, its float parts in `dtype`: each quantized
    layer's (rows, cols), and a function that measures what they hold (qweight and scales, in bytes)."""
    model = quantize_model(copy.deepcopy(bundled_model()).to(dtype), fmt)
    layers = [m for m in model.modules() if isinstance(m, QuantizedAffine)]  # the blocks' and the token table
    shapes = [(m.scales.shape[0], m.qweight.shape[1] * (2 if fmt == "int4" else 1)) for m in layers]

    def stored() -> int:
        return sum(t.numel() * t.element_size() for m in layers for t in (m.qweight, m.scales))

    return shapes, stored


def _run_bytes(fn: Callable, how: str, *args):
    if how == "call":
        return fn(*args)
    if how == "defaults":  # matrix_bytes(rows, cols, fmt): the scales of int8 in float32
        return fn(*args[:3])
    fmt, dtype, layers = args  # "engine": every quantized layer of the bundled model
    return sum(fn(rows, cols, fmt, dtype) for rows, cols in layers)


def check_matrix_bytes(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """matrix_bytes(rows, cols, fmt, dtype="float32") -> the bytes of a weight matrix [rows, cols] (outputs, inputs)
    as the engine stores it: float32 4 bytes a weight, float16 / bfloat16 2; int8 1 plus a scale per row in `dtype`;
    int4 half a byte plus a float16 scale per group of 32 inputs of a row. Exact (relative 1e-9); ends with the sum
    over the engine's quantized layers of the bundled model (float16 in int8, float32 in int4), compared with what
    they hold."""
    if not callable(fn):
        raise CheckFailed(f"✗ matrix_bytes: expected a function, got {short(fn)}")

    def case(description, args, hint="", how="call"):
        full = (*args, "float32")[:4]
        return Case(description, (how, *args), later(engine_matrix_bytes, *full), hint)

    cases = [
        case("GPT-2's c_fc [3072, 768] in float32", (3072, 768, "float32", "float32")),
        case("the same in float16", (3072, 768, "float16", "float16"), "2 bytes a weight"),
        case("in bfloat16, the model in float32", (3072, 768, "bfloat16", "float32"), "2 bytes a weight"),
        case("int8, the model in float32", (768, 3072, "int8", "float32"), "a float32 scale per row (output)"),
        case("int8, the model in float16", (768, 3072, "int8", "float16"), "the scales are in the model's dtype"),
        case("int8, the model in bfloat16, 4 rows", (4, 4096, "int8", "bfloat16")),
        case("int4, the model in float32", (768, 3072, "int4", "float32"), "int4 scales are float16, 1 per 32 inputs"),
        case("int4, the model in float16", (576, 192, "int4", "float16")),
        case("one group of 32: the smallest int4 row", (1, 32, "int4", "float32")),
        case("one weight in float32", (1, 1, "float32", "float32")),
        case("Llama-3-8B's MLP up [14336, 4096] in int8 (bfloat16)", (14336, 4096, "int8", "bfloat16")),
        case("Llama-3-70B's head [128256, 8192] in int4", (128256, 8192, "int4", "bfloat16")),
        case("matrix_bytes(rows, cols, 'int8'): the scales in float32", (1000, 64, "int8"), how="defaults"),
        case("matrix_bytes(rows, cols, 'float16')", (50257, 768, "float16"), how="defaults"),
        case("numpy sizes", (np.int64(4096), np.int64(11008), "int4", "float16"), "any Python number type"),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        fmt = rng.choice(["float32", "float16", "bfloat16", "int8", "int4"])
        rows = rng.choice([rng.randint(1, 64), rng.randint(64, 200_000)])
        cols = 32 * rng.randint(1, 1024) if fmt == "int4" or rng.random() < 0.5 else rng.randint(1, 30_000)
        cases.append(case(f"random #{i}: {fmt}", (rows, cols, fmt, rng.choice(list(FLOAT_BYTES)))))

    def engine_cases():
        made = []
        for fmt, dtype in [("int8", torch.float16), ("int4", torch.float32)]:  # int8's scales in the dtype
            layers, stored = _quantized_layers(fmt, dtype)
            name = str(dtype).removeprefix("torch.")
            made.append(
                Case(
                    f"in the engine: the bundled model in {name}, quantized to {fmt} by quantize_model: its "
                    f"{len(layers)} quantized layers (the token table and each block's four)",
                    ("engine", fmt, name, layers),
                    later(stored),
                    "the engine stores qweight and scales: your formula must give their bytes",
                )
            )
        return made

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            fmt, dtype, layers = rest
            return (
                f"sum(matrix_bytes(rows, cols, {fmt!r}, {dtype!r}) for rows, cols in {short(layers, 80)})  # compared "
                f"with the qweight and scales of quantize_model(the bundled model.to({dtype}), {fmt!r})"
            )
        return _call_text("matrix_bytes", ("rows", "cols", "fmt", "dtype"), rest)

    _run_both(
        "matrix_bytes",
        lambda how, *args: _run_bytes(fn, how, *args),
        cases,
        engine_cases,
        in_engine=False,
        judge=_judge_bytes,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 3: step_cost — FLOPs, weight, KV-cache and activation bytes of one forward step

COMPONENTS = ("the FLOPs", "the weight bytes", "the KV-cache bytes", "the activation bytes")
GQA = "k and v have n_kv_head × head_dim outputs, not n_head × head_dim (grouped-query attention shares them)"
SWIGLU = 'a "swiglu" MLP has three matrices (gate and up [d_ff, n_embd], down [n_embd, d_ff]), a "gelu" MLP two'
HEAD = "the output head is a matrix too: [vocab_size, n_embd], multiplied by every row"
ROWS = "every new position of every sequence (batch × new_tokens rows) goes through every matrix"


def _layer_matrices(shape: ModelShape, gqa: bool = True, mlp3: bool = True, head: bool = True) -> list:
    """The matrices of `_matrices`, or what a mistake makes of them."""
    C, H, D, F = shape.n_embd, shape.n_head, shape.head_dim, shape.d_ff
    kv = shape.n_kv_head if gqa else H
    mlp = [(F, C), (F, C), (C, F)] if shape.mlp == "swiglu" and mlp3 else [(F, C), (C, F)]
    layer = [(H * D, C), (kv * D, C), (kv * D, C), (C, H * D), *mlp]
    return layer * shape.n_layer + ([(shape.vocab_size, C)] if head else [])


def _cost_mistakes(shape: ModelShape, B, T, context, weights, dtype) -> list[list[tuple[float, str]]]:
    """For each component of step_cost(shape, B, T, context, weights, dtype): (what a mistake gives, its hint)."""
    B, T, context = int(B), int(T), int(context)
    L, H, Hkv, D, V, C = shape.n_layer, shape.n_head, shape.n_kv_head, shape.head_dim, shape.vocab_size, shape.n_embd
    rows, size = B * T, FLOAT_BYTES[dtype]
    right = _layer_matrices(shape)
    wrong = [(_layer_matrices(shape, gqa=False), GQA), (_layer_matrices(shape, mlp3=False), SWIGLU)]
    wrong.append((_layer_matrices(shape, head=False), HEAD))
    attended = T * context + T * (T + 1) // 2
    attn = 4 * L * H * D * B * attended

    def product(mats):
        return 2 * rows * sum(r * c for r, c in mats)

    flops = [
        (
            product(right) / 2 + attn / 2,
            "a multiply-add is 2 FLOPs: 2 per weight per row, 4 per head dimension "
            "per (query, attended position) pair in attention",
        ),
        (product(right) / 2 + attn, "a multiply-add is 2 FLOPs: 2 per weight for each row"),
        (
            product(right),
            "attention's FLOPs too: 4 per head dimension for each (query, attended position) pair — "
            "2 for the score q·k, 2 for the weighted sum of v",
        ),
        (
            product(right) + 4 * L * H * D * B * T * (context + T),
            "attention is causal: new position i (from 0) "
            "attends to context + i + 1 positions, T·context + T(T+1)/2 pairs per sequence, not T·(context + T)",
        ),
        (
            product(right) + 4 * L * H * D * B * T * context,
            "each new position also attends to itself and the new "
            "positions before it: T·context + T(T+1)/2 pairs per sequence",
        ),
        (
            product(right) + 4 * L * Hkv * D * B * attended,
            "every query head computes its own scores and sum: n_head, even when the KV heads are shared",
        ),
        (
            product(right) + attn / 2,
            "attention: 2 FLOPs per head dimension for the score q·k and 2 for the "
            "weighted sum of v — 4 per (query, attended position) pair",
        ),
        *((product(mats) + attn, hint) for mats, hint in wrong),
        (product(right) / T + attn, ROWS),
        (product(right) / B + attn, ROWS),
    ]

    def stored(mats, fmt):
        return sum(engine_matrix_bytes(r, c, fmt, dtype) for r, c in mats)

    weight = stored(right, weights)
    shared = "the weights are read once per step, shared by all its rows: not × batch (or × rows)"
    weight_bytes = [
        (B * weight, shared),
        (rows * weight, shared),
        *((stored(mats, weights), hint) for mats, hint in wrong),
        (
            weight + V * C * FLOAT_BYTES.get(weights, 1),
            "a step reads the token table only at its rows' ids: count the output head once",
        ),
        (
            stored(right, dtype),
            f"the weights are stored in `weights` ({weights!r}): matrix_bytes(rows, cols, "
            "weights, dtype); `dtype` is the cache's and the activations'",
        ),
        (
            sum(r * c for r, c in right) * {"int8": 1, "int4": 0.5}.get(weights, 0),
            "int8 and int4 weights carry their scales: matrix_bytes(rows, cols, weights, dtype) counts them",
        ),
        (8 * weight, "bytes, not bits"),
        (weight / 1e9, "return bytes (not GB)"),
        (weight / 2**30, "return bytes (not GiB)"),
    ]
    per_position = 2 * L * Hkv * D * size
    cache = B * (context + 2 * T) * per_position
    kv = [
        (
            0,
            "the KV cache: attention reads each sequence's cached keys and values and the new positions', and the "
            "step writes the new ones: context + 2 × new_tokens positions per sequence",
        ),
        (
            B * context * per_position,
            "attention also reads the new positions' keys and values, and the step writes "
            "them: context + 2 × new_tokens positions per sequence",
        ),
        (
            B * (context + T) * per_position,
            "the step reads context + new_tokens positions and also writes the "
            "new_tokens new ones: context + 2 × new_tokens positions per sequence",
        ),
        (cache * H / Hkv, "the cache holds n_kv_head heads per layer, not n_head (grouped-query attention)"),
        (cache / 2, "a key and a value per position, layer and KV head"),
        (cache / B, "every sequence reads and writes its own cache: × batch"),
        (cache / L, "every layer has its own cache: × n_layer"),
        (
            cache / size * FLOAT_BYTES.get(weights, {"int8": 1, "int4": 0.5}.get(weights, 0)),
            "the cache is in `dtype`, not in the weights' format",
        ),
        (8 * cache, "bytes, not bits"),
        (cache / 1e9, "return bytes (not GB)"),
    ]
    attention_io = 2 * L * H * D

    def moved(mats, per_row=None):
        return size * rows * (sum(r + c for r, c in mats) + attention_io) if per_row is None else per_row

    act = moved(right)
    activations = [
        (0, "the activations: every matrix product reads its input rows and writes its output rows (in `dtype`)"),
        (
            act / size * FLOAT_BYTES.get(weights, {"int8": 1, "int4": 0.5}.get(weights, 0)),
            "the activations are in `dtype`, whatever the weights' format",
        ),
        (
            act - size * rows * attention_io,
            "attention also reads its queries and writes its output: 2 × n_head × head_dim values per row and layer",
        ),
        (
            size * rows * (sum(c for _, c in right) + attention_io / 2),
            "every matrix product reads its input rows "
            "(cols values each) and writes its output rows (rows values each)",
        ),
        (
            size * rows * (sum(r for r, _ in right) + attention_io / 2),
            "every matrix product reads its input rows "
            "(cols values each) and writes its output rows (rows values each)",
        ),
        (
            size * rows * sum(c for _, c in right),
            "every matrix product reads its input rows and writes its output rows",
        ),
        (act / T, ROWS),
        (act / B, ROWS),
        *((moved(mats), hint) for mats, hint in wrong),
        (8 * act, "bytes, not bits"),
        (act / 1e9, "return bytes (not GB)"),
    ]
    return [flops, weight_bytes, kv, activations]


def _cost_verdict(args: tuple, got: Any, expected) -> Verdict:
    """The first wrong component of a step_cost answer, and the mistake that gives it."""
    if _has_tensor(got):
        return _TENSOR
    if not isinstance(got, (tuple, list)) or len(got) != 4 or not all(_number(x) for x in got):
        return (
            f"expected four numbers (flops, weight bytes, KV-cache bytes, activation bytes), got {short(got, 80)}",
            "return flops, weight_bytes, kv_cache_bytes, activation_bytes (a tuple or StepCost)",
        )
    values = [float(x) for x in got]
    for i, (value, right) in enumerate(zip(values, expected)):
        if not _close(value, right):
            mistakes = _cost_mistakes(*args)
            return f"{COMPONENTS[i]} are wrong", _first(mistakes[i], value)
    return None


def _judge_cost(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        part = None
        if isinstance(got, Prediction):
            full = (shape, keywords["batch"], keywords["new_tokens"], keywords["context"])
            part = _cost_verdict((*full, keywords["weights"], keywords["dtype"]), got.cost, case.expected.cost)
        return _engine_verdict(got, case.expected, part)
    full = (*args, "float16", "float16")[:6]
    return _cost_verdict(full, got, case.expected)


def _run_cost(fn: Callable, how: str, *args):
    if how == "engine":
        return _predicted_with("step_cost", fn, *args)
    return fn(*args)


def _random_shape(rng: random.Random) -> ModelShape:
    """A decoder of any kind whose matrices all have whole int4 groups (inputs in multiples of 32)."""
    n_kv_head = rng.choice([1, 2, 4])
    n_head = n_kv_head * rng.choice([1, 1, 2, 4])
    swiglu = rng.random() < 0.5
    return ModelShape(
        rng.randint(1, 8),
        32 * rng.randint(1, 24),
        n_head,
        n_kv_head,
        rng.choice([32, 64, 128]),
        32 * rng.randint(1, 64),
        rng.randint(2, 70_000),
        "swiglu" if swiglu else "gelu",
        tied=not swiglu and rng.random() < 0.7,
    )


def check_step_cost(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """step_cost(shape, batch, new_tokens, context, weights="float16", dtype="float16") -> (flops, weight bytes,
    KV-cache bytes, activation bytes) of one forward step: 2 FLOPs per weight per row plus attention's 4 per head
    dimension per causal (query, attended position) pair; every matrix once (`matrix_bytes`); each sequence's
    cache read (context + new_tokens positions) and written (new_tokens); each matrix product's input and output
    rows, and attention's queries and output. Exact (relative 1e-9); ends with the engine's `predict` running it."""
    if not callable(fn):
        raise CheckFailed(f"✗ step_cost: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_step_cost, *args), hint)

    gpt2, l7, l8, l70 = (SHAPES[n] for n in ("GPT-2 124M", "Llama-2-7B", "Llama-3-8B", "Llama-3-70B"))
    cases = [
        case("one layer of width 4, one token, nothing cached", (TINY, 1, 1, 0, "float32", "float32")),
        case("GPT-2 124M, a decode step at 1024 cached positions", (gpt2, 1, 1, 1024, "float16", "float16")),
        case(
            "GPT-2 124M, a prefill of 512 tokens (causal: position i attends to i + 1)",
            (gpt2, 1, 512, 0, "float16", "float16"),
            "T(T+1)/2 (query, position) pairs",
        ),
        case(
            "the bundled model's configuration in float32, 8 sequences, 2 new tokens after 100",
            (BUNDLED, 8, 2, 100, "float32", "float32"),
        ),
        case("Llama-2-7B (a KV head per query head), batch 16, 4096 cached", (l7, 16, 1, 4096, "bfloat16", "bfloat16")),
        case(
            "Llama-3-8B (8 KV heads for 32 query heads, SwiGLU, untied head), decode at 8192",
            (l8, 1, 1, 8192, "float16", "float16"),
            "grouped-query attention: k, v and the cache have n_kv_head heads",
        ),
        case("Llama-3-8B in int8 (float16 scales), batch 64", (l8, 64, 1, 2048, "int8", "float16")),
        case("Llama-3-70B in int4, batch 256, 32768 cached", (l70, 256, 1, 32768, "int4", "bfloat16")),
        case(
            "Llama-3-70B, a prefill of 2048 after 1000 cached, int8 in float32", (l70, 2, 2048, 1000, "int8", "float32")
        ),
        case("a tiny GQA SwiGLU decoder in int4, the cache in float32", (TINY_GQA, 3, 5, 7, "int4", "float32")),
        case("GPT-2 124M, float32 weights, a float16 cache", (gpt2, 4, 1, 300, "float32", "float16")),
        case(
            "step_cost(shape, batch, new_tokens, context): float16 weights and cache",
            (l8, 2, 3, 50),
            'weights="float16", dtype="float16" by default',
        ),
        case("numpy sizes", (gpt2, np.int64(8), np.int64(16), np.int64(128), "bfloat16", "float32")),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        shape = rng.choice([*SHAPES.values(), BUNDLED, _random_shape(rng), _random_shape(rng)])
        batch = rng.choice([1, rng.randint(1, 512)])
        new_tokens = rng.choice([1, 1, rng.randint(1, 4096)])
        context = rng.choice([0, rng.randint(1, 131072)])
        weights, dtype = rng.choice(["float32", "float16", "bfloat16", "int8", "int4"]), rng.choice(list(FLOAT_BYTES))
        cases.append(case(f"random #{i}", (shape, batch, new_tokens, context, weights, dtype)))

    def engine_case(description, shape, machine, **keywords):
        keywords = {"batch": 1, "new_tokens": 1, "context": 0, "weights": "float16", "dtype": "float16", **keywords}
        keywords["measured_seconds"] = 0.01
        return Case(
            f"in the engine: {description}",
            ("engine", shape, machine, keywords),
            later(predict, shape, machine, **keywords),
            "predict calls step_cost(shape, batch, new_tokens, context, weights, dtype) positionally",
        )

    engine_cases = [
        engine_case("Llama-3-8B decoding 32 sequences of 8192 positions on an H100", l8, H100, batch=32, context=8192),
        engine_case("Llama-3-70B in int4, a prefill of 4096 on an A100", l70, A100, new_tokens=4096, weights="int4"),
        engine_case(
            "the bundled model in float32 on an RTX 4090", BUNDLED, RTX4090, weights="float32", dtype="float32"
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            shape, machine, keywords = rest
            settings = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
            return f"predict({_shape_text(shape)}, {machine}, {settings}, table=Roofline().replace(step_cost=yours))"
        return _call_text("step_cost", ("shape", "batch", "new_tokens", "context", "weights", "dtype"), rest)

    _run_both(
        "step_cost",
        lambda how, *args: _run_cost(fn, how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_cost,
        show_call=show,
        seconds=2,
        total_seconds=20,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: roofline_time — a step's least time, its bound, its intensity and the machine's ridge


def _time_verdict(args: tuple, got: Any, expected) -> Verdict:
    flops, nbytes, peak, bandwidth = (float(a) for a in args)
    if _has_tensor(got):
        return _TENSOR
    shaped = isinstance(got, (tuple, list)) and len(got) == 4
    if not shaped or not all(_number(got[i]) for i in (0, 2, 3)) or not isinstance(got[1], str):
        return (
            f'expected (seconds, "memory" or "compute", intensity, ridge), got {short(got, 100)}',
            "return seconds, bound, intensity, ridge (a tuple or RooflineTime)",
        )
    seconds, bound, intensity, ridge = float(got[0]), got[1], float(got[2]), float(got[3])
    memory, compute = nbytes / bandwidth, flops / peak
    if not _close(seconds, expected.seconds):
        return f"the seconds are wrong: expected {expected.seconds!r}, got {seconds!r}", _first(
            [
                (
                    memory + compute,
                    "the least time is the larger of the two times, not their sum: the memory and "
                    "the arithmetic units work at once",
                ),
                (
                    min(memory, compute),
                    "the least time is the larger (max) of bytes ÷ bandwidth and FLOPs ÷ peak: "
                    "the slower of the two sets it",
                ),
                (flops / bandwidth, "FLOPs go with the peak FLOP/s, bytes with the bandwidth"),
                (nbytes / peak, "FLOPs go with the peak FLOP/s, bytes with the bandwidth"),
                (max(flops / bandwidth, nbytes / peak), "FLOPs go with the peak FLOP/s, bytes with the bandwidth"),
            ],
            seconds,
        )
    if bound not in ("memory", "compute"):
        return f'the bound must be "memory" or "compute", got {bound!r}', 'exactly the word "memory" or "compute"'
    if bound != expected.bound:
        if memory == compute:
            return f"the two times are equal, expected {expected.bound!r}, got {bound!r}", (
                'when bytes ÷ bandwidth equals FLOPs ÷ peak, say "memory" (the engine\'s convention: compute-bound '
                "means the FLOPs take strictly longer)"
            )
        return f"the bound is wrong: expected {expected.bound!r}, got {bound!r}", (
            'the bound names the limit that sets the time: "memory" when bytes ÷ bandwidth is the larger, '
            '"compute" when FLOPs ÷ peak is'
        )
    if not _close(intensity, expected.intensity):
        return f"the intensity is wrong: expected {expected.intensity!r}, got {intensity!r}", _first(
            [
                (nbytes / flops if flops else math.inf, "the arithmetic intensity is FLOPs per byte: flops / nbytes"),
                (peak / bandwidth, "the intensity is the step's own (flops / nbytes); the ridge is the machine's"),
            ],
            intensity,
        )
    if not _close(ridge, expected.ridge):
        return f"the ridge is wrong: expected {expected.ridge!r}, got {ridge!r}", _first(
            [
                (bandwidth / peak, "the ridge point is FLOPs per byte too: peak_flops / bandwidth"),
                (flops / nbytes, "the ridge is the machine's (peak_flops / bandwidth); the intensity the step's"),
            ],
            ridge,
        )
    return None


def _judge_time(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        part, cost = None, case.expected.cost
        if isinstance(got, Prediction):
            part = _time_verdict((cost.flops, cost.bytes, *machine), got.roof, case.expected.roof)
        return _engine_verdict(got, case.expected, part)
    return _time_verdict(args, got, case.expected)


def _run_time(fn: Callable, how: str, *args):
    if how == "engine":
        return _predicted_with("roofline_time", fn, *args)
    return fn(*args)


def _tie(flops: float, nbytes: float, peak: float, bandwidth: float) -> bool:
    return math.isclose(flops / peak, nbytes / bandwidth, rel_tol=1e-6)


def check_roofline_time(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """roofline_time(flops, nbytes, peak_flops, bandwidth) -> (seconds, bound, intensity, ridge): the larger of bytes
    ÷ bandwidth and FLOPs ÷ peak, "memory" or "compute" for the one that sets it ("memory" when they are equal),
    FLOPs per byte of the step, and peak ÷ bandwidth. Exact (relative 1e-9); ends with the engine's `predict`."""
    if not callable(fn):
        raise CheckFailed(f"✗ roofline_time: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_roofline_time, *args), hint)

    decode = engine_step_cost(SHAPES["Llama-3-8B"], 1, 1, 8192)
    prefill = engine_step_cost(SHAPES["Llama-3-8B"], 1, 4096, 0)
    cases = [
        case("a memory-bound step", (2e9, 2e9, 1e12, 1e11), "bytes ÷ bandwidth is the larger: 0.02 s"),
        case("a compute-bound step", (8e12, 1e9, 1e12, 1e11), "FLOPs ÷ peak is the larger: 8 s"),
        case("Llama-3-8B decoding one token at 8192 positions on an H100", (decode.flops, decode.bytes, *H100)),
        case("Llama-3-8B's prefill of 4096 tokens on an H100", (prefill.flops, prefill.bytes, *H100)),
        case(
            "the two times exactly equal",
            (1024.0, 512.0, 2048.0, 1024.0),
            'a tie is "memory": compute-bound means the FLOPs take strictly longer',
        ),
        case("a tie at datasheet scale", (989e12 * 3, 3.35e12 * 3, 989e12, 3.35e12), 'a tie is "memory"'),
        case(
            "Fractions, the intensity exactly the ridge point (2 FLOPs per byte)",
            (Fraction(1, 3), Fraction(1, 6), Fraction(2, 3), Fraction(1, 3)),
            'any Python number type; a tie is "memory"',
        ),
        case("no FLOPs at all (a copy)", (0, 1e6, *A100)),
        case("integers", (10**15, 10**12, 312 * 10**12, 2039 * 10**9), "any Python number type"),
        case("numpy numbers", (np.float64(3.3e14), np.int64(8 * 10**9), np.float64(165.2e12), np.float64(1.008e12))),
    ]
    rng = random.Random(seed)
    fixed = len(cases)
    while len(cases) < fixed + n_random:
        flops, nbytes = 10 ** rng.uniform(3, 16), 10 ** rng.uniform(3, 12)
        peak, bandwidth = rng.choice(
            [H100, A100, RTX4090, M3_MAX, (10 ** rng.uniform(9, 16), 10 ** rng.uniform(8, 13))]
        )
        if not _tie(flops, nbytes, peak, bandwidth):
            cases.append(case(f"random #{len(cases) - fixed}", (flops, nbytes, peak, bandwidth)))

    def engine_case(description, shape, machine, **keywords):
        return Case(
            f"in the engine: {description}",
            ("engine", shape, machine, keywords),
            later(predict, shape, machine, **keywords),
            "predict calls roofline_time(flops, nbytes, peak_flops, bandwidth) positionally",
        )

    engine_cases = [
        engine_case("Llama-3-8B decoding at batch 1 on an H100 (memory-bound)", SHAPES["Llama-3-8B"], H100),
        engine_case(
            "Llama-3-70B in int8, a prefill of 2048 on an A100 (compute-bound)",
            SHAPES["Llama-3-70B"],
            A100,
            new_tokens=2048,
            weights="int8",
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            shape, machine, keywords = rest
            settings = "".join(f", {k}={v!r}" for k, v in keywords.items())
            return f"predict({_shape_text(shape)}, {machine}{settings}, table=Roofline().replace(roofline_time=yours))"
        return _call_text("roofline_time", ("flops", "nbytes", "peak_flops", "bandwidth"), rest)

    _run_both(
        "roofline_time",
        lambda how, *args: _run_time(fn, how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_time,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 5: critical_batch — the smallest batch at which a decode step is compute-bound


def _margin(shape, context, weights, dtype, peak, bandwidth, batch) -> float:
    """How far a decode step of `batch` sequences is from the ridge: relative difference of its two times."""
    cost = engine_step_cost(shape, batch, 1, context, weights, dtype)
    compute, memory = cost.flops / peak, cost.bytes / bandwidth
    return abs(compute - memory) / max(compute, memory)


def _clear_of_ties(args: tuple) -> bool:
    """No batch that decides the answer sits within a relative 1e-6 of the ridge (float rounding could go either
    way there, and a closed form and a search would then both be right)."""
    shape, context, weights, dtype, peak, bandwidth, max_batch = args
    answer = engine_critical_batch(*args)
    batches = [max_batch] if answer is None else [answer, answer - 1] if answer > 1 else [answer]
    return all(_margin(shape, context, weights, dtype, peak, bandwidth, b) > 1e-6 for b in batches if b >= 1)


def on_the_ridge(shape: ModelShape, batch: int, scale: int = 2**10) -> tuple[float, float]:
    """A machine (peak FLOP/s, bandwidth) on which a float32 decode step of `batch` sequences, nothing cached, sits
    exactly on the ridge: its two times are equal in floats too (`batch` a power of 2: every quotient is exact)."""
    cost = engine_step_cost(shape, batch, 1, 0, "float32", "float32")
    return float(cost.flops * scale), float(cost.bytes * scale)


def _batch_hint(args: tuple, got: Any, expected: Optional[int]) -> str:
    shape, context, weights, dtype, peak, bandwidth, max_batch = args
    ridge = peak / bandwidth
    if expected is not None and got == expected - 1:
        cost = engine_step_cost(shape, got, 1, context, weights, dtype)
        if cost.flops / peak == cost.bytes / bandwidth:
            return (
                f'at batch {got} the two times are exactly equal: memory-bound by the chapter\'s rule ("memory" on '
                f"a tie, as roofline_time says), so the answer is the next batch — from a balance point x that is a "
                "whole number, math.floor(x) + 1, not math.ceil(x)"
            )
    if expected is None:
        if got == max_batch:
            return "when no batch up to max_batch is compute-bound, return None (not max_batch)"
        if got > max_batch:
            return "no batch above max_batch: return None when none up to it is compute-bound"
        return (
            "each sequence adds its own KV cache and activations to the bytes: at long contexts the intensity "
            "levels off below the ridge, and no batch is compute-bound — return None"
        )
    one = engine_step_cost(shape, 1, 1, context, weights, dtype)
    matrix_flops = 2 * sum(r * c for r, c in _matrices(shape))
    ridge_hint = (
        "that is the ridge point (FLOPs per byte of the machine), not a batch size; it is also about where the "
        "weights alone would balance the FLOPs, but each sequence adds its own KV cache and activations to the "
        "bytes: find the smallest batch whose decode step (step_cost) is compute-bound"
    )
    weights_hint = (
        "each sequence adds its own KV cache and activations to the bytes, not only FLOPs: use step_cost's bytes "
        "at each batch, not the weights' alone"
    )
    return _first(
        [
            (math.floor(ridge), ridge_hint),
            (math.ceil(ridge), ridge_hint),
            (expected - 1, "that batch is the last memory-bound one: return the smallest batch that is compute-bound"),
            (math.floor(ridge * one.weights / one.flops) + 1, weights_hint),
            (math.ceil(ridge * one.weights / one.flops), weights_hint),
            (math.floor(ridge * one.weights / matrix_flops) + 1, weights_hint),
        ],
        float(got),
        0,
    )


def _judge_batch(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    full = (*args, 1 << 20)[:7]
    expected = case.expected
    if isinstance(got, Tensor):
        return "expected a Python int or None, got a tensor", "use Python numbers (or .item())"
    if got is None:
        if expected is None:
            return None
        return f"a batch of {expected} is compute-bound, got None", (
            "return None only when no batch up to max_batch is compute-bound"
        )
    if not _number(got):
        return f"expected a batch size (an int) or None, got {short(got, 80)}", ""
    if not isinstance(got, numbers.Integral):
        return f"expected an int, got {type(got).__name__} {got!r}", (
            "a batch size is a whole number: return an int (math.ceil / math.floor / int give one)"
        )
    if expected is not None and got == expected:
        return None
    if expected is None:
        return f"no batch up to max_batch={full[6]} is compute-bound (expected None), got {got}", _batch_hint(
            full, got, expected
        )
    return f"expected a batch of {expected}, got {got}", _batch_hint(full, got, expected)


def _run_batch(fn: Callable, how: str, *args):
    if how == "engine":  # as the chapter's figures call it, through its guard
        return guard("critical_batch", fn)(*args)
    if how == "defaults":
        return fn(*args[:6])
    return fn(*args)


def check_critical_batch(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """critical_batch(shape, context, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20) -> the smallest batch
    at which a decode step (one new token per sequence, `context` cached) is compute-bound by step_cost and
    roofline_time, or None if none up to max_batch is. An int; one case sits exactly on a tie (exact in floats too:
    `on_the_ridge`), where the step is memory-bound; no other case sits near one. Ends with Llama-3-70B on an H100
    through the guard the engine's figures use."""
    if not callable(fn):
        raise CheckFailed(f"✗ critical_batch: expected a function, got {short(fn)}")

    def case(description, args, hint="", how="call"):
        full = (*args, 1 << 20)[:7]
        return Case(description, (how, *args), later(engine_critical_batch, *full), hint)

    l8, l70 = SHAPES["Llama-3-8B"], SHAPES["Llama-3-70B"]
    cases = [
        case("Llama-3-8B on an H100, nothing cached", (l8, 0, "float16", "float16", *H100, 1 << 20)),
        case(
            "Llama-3-8B on an H100 at 8192 positions: the caches grow the bytes with the batch",
            (l8, 8192, "float16", "float16", *H100, 1 << 20),
            "each sequence reads its own cache: the intensity levels off below the ridge",
        ),
        case(
            "GPT-2 124M in float32 on an A100, 1024 cached", (SHAPES["GPT-2 124M"], 1024, "float32", "float32", *A100)
        ),
        case(
            "Llama-2-7B (MHA) on an RTX 4090, 128 cached", (SHAPES["Llama-2-7B"], 128, "float16", "float16", *RTX4090)
        ),
        case("Llama-3-70B in int4 on an H100, 512 cached", (l70, 512, "int4", "bfloat16", *H100, 1 << 20)),
        case("Llama-3-70B in int8 on an A100, 2048 cached", (l70, 2048, "int8", "float16", *A100, 1 << 20)),
        case("the bundled model in float32, a low ridge", (BUNDLED, 64, "float32", "float32", *M3_MAX, 1 << 20)),
        case("a tiny model with a low ridge", (TINY, 0, "float32", "float32", 2e9, 1e9, 1 << 20)),
        case(
            "max_batch below the answer",
            (l8, 0, "float16", "float16", *H100, 100),
            "no batch up to max_batch is compute-bound: None",
        ),
        case(
            "max_batch just below the answer",
            (l8, 0, "float16", "float16", *H100, engine_critical_batch(l8, 0, "float16", "float16", *H100) - 1),
            "no batch up to max_batch is compute-bound: None",
        ),
        case(
            "max_batch exactly the answer",
            (l8, 0, "float16", "float16", *H100, engine_critical_batch(l8, 0, "float16", "float16", *H100)),
        ),
        case(
            "critical_batch(shape, context, weights, dtype, peak_flops, bandwidth): max_batch 1 << 20",
            (l70, 4096, "float16", "float16", *H100),
            how="defaults",
        ),
        case(
            "numpy numbers",
            (l8, np.int64(256), "int8", "float16", np.float64(312e12), np.float64(2.039e12), np.int64(4096)),
        ),
        case(
            "a machine on whose ridge batch 64 sits exactly (the bundled model in float32, nothing cached): "
            "memory-bound there, so 65",
            (BUNDLED, 0, "float32", "float32", *on_the_ridge(BUNDLED, 64)),
            'a tie is "memory": the smallest compute-bound batch is the one after the balance point',
        ),
    ]
    fixed = len(cases)
    rng = random.Random(seed)
    shapes = [*SHAPES.values(), BUNDLED]
    while len(cases) < fixed + n_random:
        shape = rng.choice(shapes)
        context = rng.choice([0, rng.randint(1, 512), rng.randint(512, 65536)])
        weights = rng.choice(["float32", "float16", "bfloat16", "int8", "int4"])
        machine = rng.choice([H100, A100, RTX4090, M3_MAX])
        max_batch = rng.choice([1 << 20, 1 << 20, rng.randint(1, 4096)])
        args = (shape, context, weights, rng.choice(list(FLOAT_BYTES)), *machine, max_batch)
        if _clear_of_ties(args):
            cases.append(case(f"random #{len(cases) - fixed}", args))
    engine = (l70, 1024, "float16", "float16", *H100)
    cases.append(
        Case(
            "in the engine: Llama-3-70B decoding on an H100 at 1024 positions (the guard the chapter's figures use)",
            ("engine", *engine),
            later(engine_critical_batch, *engine),
            "the engine calls critical_batch(shape, context, weights, dtype, peak_flops, bandwidth) positionally",
        )
    )

    def show(args: tuple) -> str:
        how, *rest = args
        names = ("shape", "context", "weights", "dtype", "peak_flops", "bandwidth", "max_batch")
        return _call_text("critical_batch", names, rest)

    run_check(
        "critical_batch",
        lambda how, *args: _run_batch(fn, how, *args),
        cases,
        judge=_judge_batch,
        forbid=NO_ENGINE_ROOFLINE,
        show_call=show,
        seconds=2,
        total_seconds=20,
        timeout_hint=(
            "a batch-by-batch search up to max_batch (2^20) takes too long: FLOPs and bytes both grow linearly "
            "with the batch, so halve the interval (binary search) or solve for the batch"
        ),
    )


# ----------------------------------------------------------------------------------------------
# Exercise 6: utilization — MBU and MFU of a step from its measured time


def _use_verdict(args: tuple, got: Any, expected) -> Verdict:
    flops, nbytes, seconds, peak, bandwidth = (float(a) for a in args)
    if _has_tensor(got):
        return _TENSOR
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(_number(x) for x in got):
        return f"expected a pair of numbers (mbu, mfu), got {short(got, 80)}", "return mbu, mfu"
    mbu, mfu = (float(x) for x in got)
    right_mbu, right_mfu = expected
    if _close(mbu, right_mbu) and _close(mfu, right_mfu):
        return None
    if _close(mbu, right_mfu) and _close(mfu, right_mbu):
        return "the two are swapped", "return (mbu, mfu): memory bandwidth utilization first"
    bytes_wrong = not _close(mbu, right_mbu)
    which, value, right = ("the MBU is wrong", mbu, right_mbu) if bytes_wrong else ("the MFU is wrong", mfu, right_mfu)
    own, crossed = (nbytes, flops) if bytes_wrong else (flops, nbytes)
    roof, other = (bandwidth, peak) if bytes_wrong else (peak, bandwidth)
    return which, _first(
        [
            (100 * right, "a fraction (0.42), not a percentage (42)"),
            (own * seconds / roof, "per second: divide by the measured seconds"),
            (seconds * roof / own if own else math.inf, "achieved ÷ peak: (amount / seconds) / roof, not its inverse"),
            (own / seconds / other, "bytes go with the bandwidth (MBU), FLOPs with the peak FLOP/s (MFU)"),
            (crossed / seconds / roof, "MBU is the bytes' rate, MFU the FLOPs' rate"),
        ],
        value,
    )


def _judge_use(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        part, cost = None, case.expected.cost
        if isinstance(got, Prediction) and got.mbu is not None:
            part = _use_verdict(
                (cost.flops, cost.bytes, keywords["measured_seconds"], *machine),
                (got.mbu, got.mfu),
                (case.expected.mbu, case.expected.mfu),
            )
        return _engine_verdict(got, case.expected, part)
    return _use_verdict(args, got, case.expected)


def _run_use(fn: Callable, how: str, *args):
    if how == "engine":
        return _predicted_with("utilization", fn, *args)
    return fn(*args)


def check_utilization(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """utilization(flops, nbytes, seconds, peak_flops, bandwidth) -> (mbu, mfu): the bytes moved per second as a
    fraction of the bandwidth, the FLOPs per second as a fraction of the peak. Exact (relative 1e-9); ends with the
    engine's `predict` given a measured time."""
    if not callable(fn):
        raise CheckFailed(f"✗ utilization: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_utilization, *args), hint)

    decode = engine_step_cost(SHAPES["Llama-2-7B"], 1, 1, 0, "bfloat16", "bfloat16")
    cases = [
        case("half the bandwidth, a fifth of the peak", (2e9, 1e9, 0.01, 1e12, 2e11)),
        case(
            "gpt-fast's Llama-2-7B in bfloat16 on an A100: 13.5 GB at ~105 tokens/s",
            (decode.flops, decode.bytes, 1 / 105, *A100),
            "MBU is about 0.69",
        ),
        case("a prefill near the peak", (1.5e16, 2e10, 20.0, *H100)),
        case("one second", (1e12, 1e12, 1, 1e12, 1e12)),
        case("nothing computed", (0, 4e9, 0.002, *RTX4090)),
        case("integers", (10**15, 10**12, 2, 312 * 10**12, 2039 * 10**9), "any Python number type"),
        case("numpy numbers", (np.float64(3e14), np.int64(8 * 10**9), np.float64(0.004), np.float64(989e12), 3.35e12)),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        machine = rng.choice([H100, A100, RTX4090, M3_MAX])
        cases.append(
            case(
                f"random #{i}", (10 ** rng.uniform(6, 17), 10 ** rng.uniform(4, 12), 10 ** rng.uniform(-6, 2), *machine)
            )
        )

    def engine_case(description, shape, machine, **keywords):
        return Case(
            f"in the engine: {description}",
            ("engine", shape, machine, keywords),
            later(predict, shape, machine, **keywords),
            "predict calls utilization(flops, nbytes, seconds, peak_flops, bandwidth) positionally",
        )

    engine_cases = [
        engine_case(
            "Llama-3-8B decoding, measured 7 ms on an H100", SHAPES["Llama-3-8B"], H100, measured_seconds=0.007
        ),
        engine_case(
            "GPT-2 124M, a prefill of 1024 measured at 0.5 s on an M3 Max",
            SHAPES["GPT-2 124M"],
            M3_MAX,
            new_tokens=1024,
            measured_seconds=0.5,
        ),
        engine_case(
            "Llama-3-70B in int4 at batch 64, 4096 cached, 40 ms on an H100",
            SHAPES["Llama-3-70B"],
            H100,
            batch=64,
            context=4096,
            weights="int4",
            measured_seconds=0.04,
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            shape, machine, keywords = rest
            settings = "".join(f", {k}={v!r}" for k, v in keywords.items())
            return f"predict({_shape_text(shape)}, {machine}{settings}, table=Roofline().replace(utilization=yours))"
        return _call_text("utilization", ("flops", "nbytes", "seconds", "peak_flops", "bandwidth"), rest)

    _run_both(
        "utilization",
        lambda how, *args: _run_use(fn, how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_use,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )
