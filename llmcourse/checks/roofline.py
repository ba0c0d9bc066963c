"""Checks for chapter 10, the roofline kernel by kernel: a card's two roofs, the bytes of a stored matrix, the FLOPs
and bytes of one weight product and of attention, one kernel's least time and bound, a step's time as the sum of
its kernels', the batch at which the weight products turn compute-bound, and MBU / MFU.

Each check compares the learner's function with the engine's (`llmcourse.engine.roofline`) on fixed cases and
seeded random ones drawn from the whole input space: GPT-2 124M, the bundled model's configuration, Llama-2-7B
(every head its own keys and values), Llama-3-8B and 70B (grouped-query attention, SwiGLU, an untied head),
multi-query and tiny shapes; one row and a million; one new token (decode) and many (prefill); no context and long
ones; every weight format (float32, float16, bfloat16, int8, int4) and dtype; numpy arguments; and calls exactly as
the engine makes them (positional, defaults left out). The formulas are exact: answers within a relative 1e-9
(float rounding) pass, in any Python number type (datasheet figures within 1 %: datasheets round), and a wrong one
is matched against the common mistakes to name it. Each check ends in the engine: `predict` (or the engine's
quantized layers, or its critical batch) running the learner's function through its guard. Expected answers are
computed after the learner's call.

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
    Kernel,
    Machine,
    ModelShape,
    Prediction,
    Roofline,
    StepTime,
    _layer_matrices,
    _matrices,
    predict,
    step_kernels,
)
from llmcourse.engine.roofline import attention_cost as engine_attention_cost
from llmcourse.engine.roofline import critical_batch as engine_critical_batch
from llmcourse.engine.roofline import gemm_cost as engine_gemm_cost
from llmcourse.engine.roofline import gpu_roof as engine_gpu_roof
from llmcourse.engine.roofline import matrix_bytes as engine_matrix_bytes
from llmcourse.engine.roofline import roofline_time as engine_roofline_time
from llmcourse.engine.roofline import step_time as engine_step_time
from llmcourse.engine.roofline import utilization as engine_utilization

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, later, run_check
from .harness.forbid import Forbidden
from .harness.inputs import named_like
from .harness.show import short

# ----------------------------------------------------------------------------------------------
# Shared: black boxes, numbers, the cases' shapes and machines

_ENGINES = (
    "gpu_roof",
    "matrix_bytes",
    "gemm_cost",
    "attention_cost",
    "roofline_time",
    "step_time",
    "critical_batch",
    "utilization",
)
# The chapter gives `matrices` / `layer_matrices` and a `step_kernels` made of the learner's functions (not graded):
# the engine's `_matrices`, `_layer_matrices` and `step_kernels` (which runs its gemm_cost, forbidden) stay open.
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
]
# `predict` runs the engine's gemm_cost (and it matrix_bytes), attention_cost, step_time (and it roofline_time) and
# utilization: in the engine, only the learner's own function and the ones predict does not call stay forbidden.
_PREDICT_RUNS = {"predict", "matrix_bytes", "gemm_cost", "attention_cost", "step_time", "roofline_time", "utilization"}


def _in_engine_forbid(name: str) -> list[Forbidden]:
    return [f for f in NO_ENGINE_ROOFLINE if f.target.rsplit(".", 1)[1] not in _PREDICT_RUNS - {name}]


# The formulas are exact: only float rounding separates two correct ways of writing them.
REL_TOL = 1e-9
HINT_TOL = 1e-6  # a wrong answer this close to a known mistake is that mistake

BUNDLED_CONFIG = GPT2Config(n_layer=6, n_head=6, n_embd=192, n_positions=256)
BUNDLED = ModelShape.of(BUNDLED_CONFIG)
TINY = ModelShape(1, 4, 1, 1, 4, 16, 10)
TINY_GQA = ModelShape(2, 64, 4, 2, 16, 128, 100, "swiglu", tied=False)
MQA = ModelShape(4, 256, 8, 1, 32, 1024, 1000)  # multi-query attention: one KV head for all eight query heads
SMALL_VOCAB = ModelShape(2, 256, 4, 2, 64, 1024, 64)  # its output head [64, 256] is its thinnest matrix
CARDS = ("H100 SXM", "A100 80GB SXM", "RTX 4090")
H100 = (989e12, 3.35e12)  # the roofs the cases use, so that no case depends on the engine's table but gpu_roof's
A100 = (312e12, 2.039e12)
RTX4090 = (165.2e12, 1.008e12)
M3_MAX = (14.2e12, 400e9)  # a made-up peak beside Apple's published bandwidth: a low ridge
FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
VALUE_BYTES = {**FLOAT_BYTES, "int8": 1, "int4": 0.5}  # a weight's bytes in each format, scales left out


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


def _predict_text(shape: ModelShape, machine: tuple, keywords: dict, slot: str) -> str:
    settings = "".join(f", {k}={v!r}" for k, v in keywords.items())
    return f"predict({_shape_text(shape)}, {machine}{settings}, table=Roofline().replace({slot}=yours))"


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


def _engine_case(slot: str, description: str, shape: ModelShape, machine: tuple, call: str, **keywords) -> Case:
    """A case that runs the engine's `predict` with the learner's function in `slot`: expected, the engine's own."""
    keywords = {"batch": 1, "new_tokens": 1, "context": 0, "weights": "float16", "dtype": "float16", **keywords}
    return Case(
        f"in the engine: {description}",
        ("engine", shape, machine, keywords),
        later(predict, shape, machine, **keywords),
        f"predict calls {call} positionally",
    )


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
    names = [k.name for k in expected.kernels]
    if [getattr(k, "name", None) for k in got.kernels] != names or len(got.times) != len(names):
        return f"the engine's prediction has other kernels: {short(got.kernels, 120)}, expected the kernels {names}"
    for k, e in zip(got.kernels, expected.kernels):
        for field in ("flops", "bytes"):
            if not _close(getattr(k, field), getattr(e, field), rel):
                a, b = getattr(k, field), getattr(e, field)
                return f"the engine's kernel {e.name!r} differs: {field} {a!r}, expected {b!r}"
    for name, t, e in zip(names, got.times, expected.times):
        if t.bound != e.bound:
            return f"the engine finds kernel {name!r} {t.bound}-bound, expected {e.bound}-bound"
        for field in ("seconds", "intensity", "ridge"):
            if not _close(getattr(t, field), getattr(e, field), rel):
                return (
                    f"the engine's time of kernel {name!r} differs: {field} {getattr(t, field)!r}, "
                    f"expected {getattr(e, field)!r}"
                )
    for field in ("tokens_per_s", "seconds", "mbu", "mfu"):
        a, b = getattr(got, field), getattr(expected, field)
        if (a is None) != (b is None) or (b is not None and not _close(a, b, rel)):
            return f"the engine's prediction differs: {field} {a!r}, expected {b!r}"
    return None


def _step_totals(shape: ModelShape, batch: int, new_tokens: int, context: int, weights: str, dtype: str) -> tuple:
    """(FLOPs, bytes) of a whole step by the engine's kernels."""
    kernels = step_kernels(shape, batch, new_tokens, context, weights, dtype)
    return sum(k.flops for k in kernels), sum(k.bytes for k in kernels)


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
# Exercise 3: gemm_cost — the FLOPs and bytes of one weight product

PAIR = ("flops", "bytes")
ONCE = (
    "the matrix is read once for all the rows: they share the read (that is what batching buys) — "
    "matrix_bytes(outputs, inputs, weights, dtype), not × rows"
)
ACTIVATIONS = (
    "the activations move too: the product reads its input rows (rows × inputs values) and writes its output rows "
    "(rows × outputs values), each value in `dtype`"
)
SWAPPED = (
    "a weight matrix is [outputs, inputs]: matrix_bytes(outputs, inputs, weights, dtype) — int8 has a scale per "
    "output row, int4 a scale per 32 inputs of each row, so the order matters"
)


def _gemm_mistakes(rows, outputs, inputs, weights, dtype) -> tuple[list, list]:
    """(what a mistake gives, its hint) for the FLOPs and for the bytes of gemm_cost(rows, outputs, inputs, ...)."""
    R, o, i = int(rows), int(outputs), int(inputs)
    size, n = FLOAT_BYTES[dtype], o * i
    matrix = engine_matrix_bytes(o, i, weights, dtype)
    moved = R * (i + o) * size
    flops = [
        (R * n, "a multiply-add is 2 FLOPs: 2 × rows × outputs × inputs"),
        (2 * n, "every row is multiplied by the whole matrix: 2 × rows × outputs × inputs"),
        (4 * R * n, "a multiply-add is 2 FLOPs (not 4): 2 × rows × outputs × inputs"),
    ]
    swapped = []
    if weights == "int8":
        swapped = [n + i * size]
    elif weights == "int4":
        swapped = [n / 2 + i * (o // 32) * 2, n / 2 + i * o / 32 * 2]
    nbytes = [
        (matrix, ACTIVATIONS),
        (matrix + R * i * size, ACTIVATIONS),
        (matrix + R * o * size, ACTIVATIONS),
        (R * matrix + moved, ONCE),
        (R * matrix, ONCE),
        (
            matrix + R * (i + o) * VALUE_BYTES[weights],
            f"the activations are in `dtype` ({dtype}: {size} bytes a value), whatever the weights' format",
        ),
        *(
            (matrix + R * (i + o) * each, f"the activations are in `dtype` ({dtype}: {size} bytes a value)")
            for each in (4, 2)
            if each != size
        ),
        *((wrong + moved, SWAPPED) for wrong in swapped),
        (
            engine_matrix_bytes(o, i, dtype, dtype) + moved,
            f"the matrix is stored in `weights` ({weights!r}): matrix_bytes(outputs, inputs, weights, dtype); `dtype` "
            "is the activations'",
        ),
        (8 * (matrix + moved), "bytes, not bits"),
        (matrix + 8 * moved, "bytes, not bits"),
    ]
    if weights == "int8":
        nbytes.append(
            (
                engine_matrix_bytes(o, i, weights) + moved,
                "pass `dtype` on: matrix_bytes(outputs, inputs, weights, dtype) — int8's scales are in the model's "
                "dtype (its default, float32, is not this model's)",
            )
        )
    nbytes += [
        (wrong + moved, f"the matrix's bytes are wrong: {hint}")
        for wrong, hint in _bytes_mistakes(o, i, weights, dtype)
    ]
    return flops, nbytes


def _pair_verdict(got: Any, expected, name: str, mistakes: Callable[[], tuple[list, list]], show_intensity=False):
    """The verdict on a (flops, bytes) answer: its kind, then each number, with the mistake that gives it."""
    if _has_tensor(got):
        return _TENSOR
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(_number(x) for x in got):
        return (
            f"expected two numbers (flops, bytes), got {short(got, 80)}",
            f"return flops, nbytes (a tuple, or the engine's Cost): {name} counts both",
        )
    values = [float(x) for x in got]
    for index, (value, right) in enumerate(zip(values, expected)):
        if not _close(value, float(right)):
            wrong = [(v, hint) for v, hint in mistakes()[index] if not _close(v, float(right), HINT_TOL)]  # not right
            problem = f"the {PAIR[index]} are wrong: expected {right!r}, got {got[index]!r}"
            if show_intensity and index == 1 and value > 0:
                problem += (
                    f" (its intensity: {float(expected[0]) / float(right):.4g} FLOPs per byte expected, yours "
                    f"{float(expected[0]) / value:.4g})"
                )
            return problem, _first(wrong, value)
    return None


def _product_part(got: Prediction, expected: Prediction, keywords: dict, shape: ModelShape) -> Verdict:
    """The verdict on the first weight product of the engine's prediction that differs, as gemm_cost's."""
    rows = keywords["batch"] * keywords["new_tokens"]
    products = {name: (shape.n_layer, o, i) for name, (o, i) in _layer_matrices(shape).items()}
    head_rows = keywords["batch"] if keywords.get("last_only") else rows
    products["head"] = (1, shape.vocab_size, shape.n_embd)
    for k, e in zip(got.kernels, expected.kernels):
        if e.name not in products or (_close(k.flops, e.flops) and _close(k.bytes, e.bytes)):
            continue
        layers, o, i = products[e.name]
        r = head_rows if e.name == "head" else rows
        args = (r, o, i, keywords["weights"], keywords["dtype"])

        def scaled(args=args, layers=layers):
            return tuple([(layers * value, hint) for value, hint in part] for part in _gemm_mistakes(*args))

        verdict = _pair_verdict((k.flops, k.bytes), (e.flops, e.bytes), "gemm_cost", scaled)
        if verdict:
            times = f"{layers} layers × " if layers > 1 else ""
            call = _call_text("gemm_cost", ("rows", "outputs", "inputs", "weights", "dtype"), args)
            return f"kernel {e.name!r} ({times}{call}): {verdict[0]}", verdict[1]
    return None


def _judge_gemm(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        part = _product_part(got, case.expected, keywords, shape) if isinstance(got, Prediction) else None
        return _engine_verdict(got, case.expected, part)
    full = (*args, "float16", "float16")[:5]
    return _pair_verdict(got, case.expected, "gemm_cost", lambda: _gemm_mistakes(*full))


def _run_predict(fn: Callable, slot: str, how: str, *args):
    if how == "engine":
        return _predicted_with(slot, fn, *args)
    return fn(*args)


def check_gemm_cost(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """gemm_cost(rows, outputs, inputs, weights="float16", dtype="float16") -> (flops, bytes) of one weight product:
    `rows` activation rows times a matrix [outputs, inputs] stored in format `weights`. 2 FLOPs (a multiply-add) per
    weight per row; the matrix's bytes once (`matrix_bytes(outputs, inputs, weights, dtype)`, whatever the rows), plus
    the rows read (inputs values each) and written (outputs values each) in `dtype`. Exact (relative 1e-9), in any
    Python number type; ends with the engine's `predict` running it for every weight product of a step."""
    if not callable(fn):
        raise CheckFailed(f"✗ gemm_cost: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        full = (*args, "float16", "float16")[:5]
        return Case(description, ("call", *args), later(engine_gemm_cost, *full), hint)

    cases = [
        case(
            "one row through Llama-3-8B's q [4096, 4096] in bfloat16",
            (1, 4096, 4096, "bfloat16", "bfloat16"),
            "one row: the matrix's 32 MiB for 33.6 MFLOP",
        ),
        case(
            "8 rows through Llama-3-8B's k [1024, 4096] in int8 (float16 scales): a thin matrix",
            (8, 1024, 4096, "int8", "float16"),
            "int8: a byte a weight and a scale per output row",
        ),
        case("64 rows, float16", (64, 4096, 4096, "float16", "float16"), "the rows share the matrix's read"),
        case(
            "4096 rows through Llama-3-8B's down [4096, 14336] in int4, activations in bfloat16",
            (4096, 4096, 14336, "int4", "bfloat16"),
        ),
        case(
            "a million rows through a [1024, 8192] matrix in float16",
            (1 << 20, 1024, 8192, "float16", "float16"),
            "at many rows the activations outweigh the matrix",
        ),
        case(
            "one row through Llama-3-8B's head [128256, 4096] in float32: a wide matrix",
            (1, 128256, 4096, "float32", "float32"),
        ),
        case("float16 weights, float32 activations", (16, 3072, 768, "float16", "float32"), "activations in `dtype`"),
        case("int8 weights, float32 activations and scales", (3, 768, 2304, "int8", "float32")),
        case(
            "int4, 100 outputs (not a multiple of 32): one row of scales per output",
            (5, 100, 4096, "int4", "float16"),
            "int4's scales: one per group of 32 inputs of each of the outputs",
        ),
        case("a single output", (7, 1, 64, "int4", "float32")),
        case("the smallest int4 matrix, one row", (1, 1, 32, "int4", "bfloat16")),
        case("gemm_cost(rows, outputs, inputs): float16 weights and activations", (12, 2048, 512)),
        case("gemm_cost(rows, outputs, inputs, 'int8'): activations and scales in float16", (12, 2048, 512, "int8")),
        case("numpy sizes", (np.int64(256), np.int64(14336), np.int64(4096), "bfloat16", "bfloat16")),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        weights, dtype = rng.choice(FORMATS), rng.choice(list(FLOAT_BYTES))
        rows = rng.choice([1, rng.randint(1, 64), rng.randint(64, 1 << 20)])
        outputs = rng.choice([rng.randint(1, 256), rng.randint(256, 200_000)])
        inputs = 32 * rng.randint(1, 1024) if weights == "int4" or rng.random() < 0.5 else rng.randint(1, 30_000)
        cases.append(case(f"random #{i}: {weights}", (rows, outputs, inputs, weights, dtype)))

    l8, l70 = SHAPES["Llama-3-8B"], SHAPES["Llama-3-70B"]
    call = "gemm_cost(rows, outputs, inputs, weights, dtype)"
    engine_cases = [
        _engine_case(
            "gemm_cost",
            "Llama-3-8B in int8 decoding 64 sequences at 1024 cached, on an H100",
            l8,
            H100,
            call,
            batch=64,
            context=1024,
            weights="int8",
            dtype="bfloat16",
        ),
        _engine_case(
            "gemm_cost",
            "Llama-3-70B in int4, a prefill of 2048 that computes the last position's logits only, on an A100",
            l70,
            A100,
            call,
            new_tokens=2048,
            weights="int4",
            last_only=True,
        ),
        _engine_case(
            "gemm_cost",
            "the bundled model in float32, 8 sequences of 4 new tokens, on an RTX 4090",
            BUNDLED,
            RTX4090,
            call,
            batch=8,
            new_tokens=4,
            context=100,
            weights="float32",
            dtype="float32",
            measured_seconds=0.002,
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            return _predict_text(*rest, "gemm_cost")
        return _call_text("gemm_cost", ("rows", "outputs", "inputs", "weights", "dtype"), rest)

    _run_both(
        "gemm_cost",
        lambda how, *args: _run_predict(fn, "gemm_cost", how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_gemm,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: attention_cost — the FLOPs and bytes of attention in all the layers of a step

CAUSAL = (
    "attention is causal: new position i (from 0) attends to context + i + 1 positions, T·context + T(T+1)/2 "
    "(query, position) pairs per sequence and query head, not T·(context + T)"
)
ITSELF = (
    "new position i (from 0) attends to context + i + 1 positions: the cached ones, the new ones before it and "
    "itself — T·context + T(T+1)/2 pairs per sequence and query head"
)
FOUR = (
    "4 FLOPs per head dimension for each (query, attended position) pair: the score q·k and the sum p·v, a "
    "multiply-add (2 FLOPs) each"
)
QUERY_HEADS = "every query head computes its own scores and sum: n_head heads, even when KV heads are shared"
REPEAT_KV = (
    "grouped-query attention reads each KV head's keys and values once for its n_head / n_kv_head query heads "
    "(as chapter 11's grouped_attention does, without repeat_kv's copies): 2 × n_kv_head × head_dim values per "
    "position and layer"
)
WRITES = (
    "a step reads the cached positions and its new ones, and writes the new positions' keys and values into the "
    "cache: context + 2 × new_tokens positions per sequence"
)
QUERIES = (
    "attention also reads its queries and writes its output: 2 × n_head × head_dim values per new position, "
    "layer and sequence"
)
QUERIES_OR_WRITES = (
    "besides the cache's reads a step writes the new positions' keys and values (context + 2 × new_tokens positions "
    "per sequence in all), reads its queries and writes its output (2 × n_head × head_dim values per new position "
    "and layer): count both"
)
REREAD = (
    "the new positions run together: the step reads each sequence's cache once (context + new_tokens positions), "
    "not once per new position"
)
LAYERS = "every layer has its own attention and its own cache: × n_layer"
SEQUENCES = "every sequence attends to its own positions and reads its own cache: × batch"


def _attention_mistakes(shape: ModelShape, batch, new_tokens, context, dtype) -> tuple[list, list]:
    """(what a mistake gives, its hint) for the FLOPs and for the bytes of attention_cost(shape, ...)."""
    B, T, ctx = int(batch), int(new_tokens), int(context)
    L, H, Hkv, D, size = shape.n_layer, shape.n_head, shape.n_kv_head, shape.head_dim, FLOAT_BYTES[dtype]
    pairs = T * ctx + T * (T + 1) // 2
    flops = 4 * L * H * D * B * pairs
    per_pair = 4 * L * H * D * B
    flops_mistakes = [
        (flops / 2, FOUR),
        (2 * flops, FOUR),
        (per_pair * (T * ctx + T * (T - 1) // 2), ITSELF),
        (per_pair * T * (ctx + T), CAUSAL),
        (per_pair * T * ctx, ITSELF),
        (4 * L * Hkv * D * B * pairs, QUERY_HEADS),
        (flops / L, LAYERS),
        (flops / B, SEQUENCES),
        (0, "attention's FLOPs: 4 per head dimension for each (query, attended position) pair of each query head"),
    ]
    kv = 2 * L * Hkv * D * B  # values per cached position, over the layers and sequences
    queries = 2 * L * H * D * B * T
    right = kv * (ctx + 2 * T) + queries

    def values(n):
        return n * size

    # every head its own keys and values, one new position: the new keys and values written weigh what the queries
    # and the output do, and leaving out either gives the same bytes
    either = QUERIES_OR_WRITES if kv * T == queries else None
    bytes_mistakes = [
        (values(2 * L * H * D * B * (ctx + T) + kv * T + queries), REPEAT_KV),
        (values(2 * L * H * D * B * (ctx + 2 * T) + queries), REPEAT_KV),
        (values(kv * (ctx + T) + queries), either or WRITES),
        (values(kv * ctx + queries), WRITES),
        (values(kv * (ctx + 2 * T)), either or QUERIES),
        (values(kv * (ctx + 2 * T) + queries / 2), QUERIES),
        (values(kv * (ctx + 2 * T) * T + queries), REREAD),
        (values(kv * (pairs + T) + queries), REREAD),
        (values(kv * (ctx + T) * T + kv * T + queries), REREAD),
        (values(right) / L, LAYERS),
        (values(right) / B, SEQUENCES),
        (values(kv * (ctx + 2 * T) / 2 + queries), "a key and a value per position, KV head and layer"),
        *(
            (each * right, f"the cache, the queries and the output are in `dtype` ({dtype}: {size} bytes a value)")
            for each in (4, 2, 1)
            if each != size
        ),
        (8 * values(right), "bytes, not bits"),
    ]
    return flops_mistakes, bytes_mistakes


def _attention_part(got: Prediction, expected: Prediction, keywords: dict, shape: ModelShape) -> Verdict:
    """The verdict on the engine's attention kernel, as attention_cost's."""
    names = [k.name for k in expected.kernels]
    if "attention" not in names or [getattr(k, "name", None) for k in got.kernels] != names:
        return None
    index = names.index("attention")
    args = (shape, keywords["batch"], keywords["new_tokens"], keywords["context"], keywords["dtype"])
    k, e = got.kernels[index], expected.kernels[index]
    verdict = _pair_verdict(
        (k.flops, k.bytes), (e.flops, e.bytes), "attention_cost", lambda: _attention_mistakes(*args), True
    )
    if verdict:
        call = _call_text("attention_cost", ("shape", "batch", "new_tokens", "context", "dtype"), args)
        return f"kernel 'attention' ({call}): {verdict[0]}", verdict[1]
    return None


def _judge_attention(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        part = _attention_part(got, case.expected, keywords, shape) if isinstance(got, Prediction) else None
        return _engine_verdict(got, case.expected, part)
    full = (*args, "float16")[:5]
    return _pair_verdict(got, case.expected, "attention_cost", lambda: _attention_mistakes(*full), True)


def check_attention_cost(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """attention_cost(shape, batch, new_tokens, context, dtype="float16") -> (flops, bytes) of attention in all the
    layers of a step: `batch` sequences, each `new_tokens` new positions after `context` cached ones. FLOPs: 4 per
    head dimension per (query, attended position) pair of each query head, new position i attending to context + i
    + 1 positions (causal). Bytes, in `dtype`: each sequence's keys and values of context + new_tokens positions read
    once per KV head (grouped-query attention shares them), its new positions' written, its queries read and its
    output written. Exact (relative 1e-9); ends with the engine's `predict` running it."""
    if not callable(fn):
        raise CheckFailed(f"✗ attention_cost: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        full = (*args, "float16")[:5]
        return Case(description, ("call", *args), later(engine_attention_cost, *full), hint)

    gpt2, l8, l70 = SHAPES["GPT-2 124M"], SHAPES["Llama-3-8B"], SHAPES["Llama-3-70B"]
    cases = [
        case(
            "Llama-3-8B (8 KV heads for 32 query heads), a decode step at 1023 cached, bfloat16",
            (l8, 1, 1, 1023, "bfloat16"),
            "grouped-query attention: 4 query heads share each KV head's read — intensity about 4 FLOPs per byte",
        ),
        case("one layer of width 4, one new position, nothing cached", (TINY, 1, 1, 0, "float32")),
        case("GPT-2 124M, a decode step at 1024 cached positions", (gpt2, 1, 1, 1024, "float16")),
        case(
            "GPT-2 124M, a prefill of 512 positions, nothing cached",
            (gpt2, 1, 512, 0, "float16"),
            "causal: new position i attends to i + 1 positions",
        ),
        case(
            "Llama-3-8B decoding 32 sequences at 8192 cached",
            (l8, 32, 1, 8192, "bfloat16"),
            "each sequence reads its own cache: the intensity does not grow with the batch",
        ),
        case(
            "multi-query attention (1 KV head for 8 query heads): 3 sequences, 16 new after 100 cached",
            (MQA, 3, 16, 100, "float16"),
        ),
        case("Llama-3-70B, 2 sequences, a prefill of 2048 after 1000 cached, float32", (l70, 2, 2048, 1000, "float32")),
        case("a tiny GQA SwiGLU decoder, 4 sequences, 5 new after 7 cached", (TINY_GQA, 4, 5, 7, "bfloat16")),
        case("Llama-3.2-1B, one new position, nothing cached", (SHAPES["Llama-3.2-1B"], 1, 1, 0, "bfloat16")),
        case("attention_cost(shape, batch, new_tokens, context): float16", (l8, 2, 3, 50), 'dtype="float16"'),
        case("numpy sizes", (gpt2, np.int64(8), np.int64(16), np.int64(128), "float32")),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        shape = rng.choice([*SHAPES.values(), BUNDLED, MQA, _random_shape(rng), _random_shape(rng)])
        batch = rng.choice([1, rng.randint(1, 512)])
        new_tokens = rng.choice([1, 1, rng.randint(1, 4096)])
        context = rng.choice([0, rng.randint(1, 131072)])
        cases.append(case(f"random #{i}", (shape, batch, new_tokens, context, rng.choice(list(FLOAT_BYTES)))))

    call = "attention_cost(shape, batch, new_tokens, context, dtype)"
    engine_cases = [
        _engine_case(
            "attention_cost",
            "Llama-3-8B decoding 32 sequences at 8192 cached, on an H100",
            l8,
            H100,
            call,
            batch=32,
            context=8192,
            weights="bfloat16",
            dtype="bfloat16",
        ),
        _engine_case(
            "attention_cost",
            "Llama-3.2-1B, a prefill of 2048 after 1000 cached, on an A100",
            SHAPES["Llama-3.2-1B"],
            A100,
            call,
            new_tokens=2048,
            context=1000,
        ),
        _engine_case(
            "attention_cost",
            "GPT-2 124M in float32, 4 sequences of 4 new tokens after 100, on an RTX 4090",
            gpt2,
            RTX4090,
            call,
            batch=4,
            new_tokens=4,
            context=100,
            weights="float32",
            dtype="float32",
            measured_seconds=0.003,
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            return _predict_text(*rest, "attention_cost")
        return _call_text("attention_cost", ("shape", "batch", "new_tokens", "context", "dtype"), rest)

    _run_both(
        "attention_cost",
        lambda how, *args: _run_predict(fn, "attention_cost", how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_attention,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 5: roofline_time — a kernel's least time, its bound, its intensity and the machine's ridge


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
                (peak / bandwidth, "the intensity is the kernel's own (flops / nbytes); the ridge is the machine's"),
            ],
            intensity,
        )
    if not _close(ridge, expected.ridge):
        return f"the ridge is wrong: expected {expected.ridge!r}, got {ridge!r}", _first(
            [
                (bandwidth / peak, "the ridge point is FLOPs per byte too: peak_flops / bandwidth"),
                (flops / nbytes, "the ridge is the machine's (peak_flops / bandwidth); the intensity the kernel's"),
            ],
            ridge,
        )
    return None


def _kernel_times_part(got: Prediction, expected: Prediction, machine: tuple) -> Verdict:
    """The verdict on the first kernel of the engine's prediction whose time differs, as roofline_time's."""
    for k, t, e in zip(expected.kernels, got.times, expected.times):
        verdict = _time_verdict((k.flops, k.bytes, *machine), t, e)
        if verdict:
            call = _call_text(
                "roofline_time", ("flops", "nbytes", "peak_flops", "bandwidth"), (k.flops, k.bytes, *machine)
            )
            return f"kernel {k.name!r} ({call}): {verdict[0]}", verdict[1]
    return None


def _judge_time(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        same = isinstance(got, Prediction) and len(got.times) == len(case.expected.times)
        part = _kernel_times_part(got, case.expected, machine) if same else None
        return _engine_verdict(got, case.expected, part)
    return _time_verdict(args, got, case.expected)


def step_time_with(roofline_time: Callable) -> Callable:
    """The engine's `step_time` with another `roofline_time` for its kernels (the chapter's step_time calls the
    learner's): each kernel's time, in their order, and their sum."""

    def step_time(kernels: list, peak_flops: float, bandwidth: float) -> StepTime:
        times = [roofline_time(k[1], k[2], peak_flops, bandwidth) for k in kernels]
        return StepTime(sum(t.seconds for t in times), times)

    return step_time


def _run_time(fn: Callable, how: str, *args):
    if how == "engine":  # predict's step_time judges every kernel with the learner's roofline_time
        shape, machine, keywords = args
        table = Roofline().replace(step_time=step_time_with(guard("roofline_time", fn)))
        return predict(shape, machine, **keywords, table=table)
    return fn(*args)


def _tie(flops: float, nbytes: float, peak: float, bandwidth: float) -> bool:
    return math.isclose(flops / peak, nbytes / bandwidth, rel_tol=1e-6)


def check_roofline_time(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """roofline_time(flops, nbytes, peak_flops, bandwidth) -> (seconds, bound, intensity, ridge): the larger of bytes
    ÷ bandwidth and FLOPs ÷ peak, "memory" or "compute" for the one that sets it ("memory" when they are equal),
    FLOPs per byte of the kernel, and peak ÷ bandwidth. Exact (relative 1e-9); ends with the engine's `predict`, its
    step_time judging every kernel with it."""
    if not callable(fn):
        raise CheckFailed(f"✗ roofline_time: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_roofline_time, *args), hint)

    decode = engine_attention_cost(SHAPES["Llama-3-8B"], 1, 1, 8192, "bfloat16")
    prefill = engine_gemm_cost(4096, 14336, 4096, "bfloat16", "bfloat16")
    cases = [
        case("a memory-bound kernel", (2e9, 2e9, 1e12, 1e11), "bytes ÷ bandwidth is the larger: 0.02 s"),
        case("a compute-bound kernel", (8e12, 1e9, 1e12, 1e11), "FLOPs ÷ peak is the larger: 8 s"),
        case("Llama-3-8B's attention decoding one token at 8192 positions on an H100", (*decode, *H100)),
        case("Llama-3-8B's MLP up in a prefill of 4096 tokens on an H100", (*prefill, *H100)),
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

    call = "roofline_time(flops, nbytes, peak_flops, bandwidth) for each kernel"
    engine_cases = [
        _engine_case(
            "roofline_time",
            "Llama-3-8B decoding at batch 1 on an H100 (every kernel memory-bound)",
            SHAPES["Llama-3-8B"],
            H100,
            call,
        ),
        _engine_case(
            "roofline_time",
            "Llama-3-8B decoding 1024 sequences at 1024 cached on an H100 (the products compute-bound, attention not)",
            SHAPES["Llama-3-8B"],
            H100,
            call,
            batch=1024,
            context=1024,
            weights="bfloat16",
            dtype="bfloat16",
        ),
        _engine_case(
            "roofline_time",
            "Llama-3-70B in int8, a prefill of 2048 on an A100",
            SHAPES["Llama-3-70B"],
            A100,
            call,
            new_tokens=2048,
            weights="int8",
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            shape, machine, keywords = rest
            settings = "".join(f", {k}={v!r}" for k, v in keywords.items())
            return (
                f"predict({_shape_text(shape)}, {machine}{settings}, table=Roofline().replace(step_time=the engine's "
                "step_time calling your roofline_time))"
            )
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
# Exercise 6: step_time — a step's least time, the sum of its kernels' on their own rooflines

ONE_POINT = (
    "judge each kernel on its own roofline and add their times: one roofline point for the whole step (its summed "
    "FLOPs against its summed bytes) lets a compute-bound kernel's FLOPs hide behind the other kernels' bytes, as if "
    "they ran at once"
)
SUMMED_ROOFS = (
    "a kernel's time is the larger of its two times (its bytes and its FLOPs overlap), and the step's the sum of its "
    "kernels': not Σ bytes ÷ bandwidth + Σ FLOPs ÷ peak"
)
LARGEST = "the kernels run one after another: the step's time is the sum of theirs, not the largest"
STEP_BOUND = (
    "each kernel has its own bound, from its own FLOPs and bytes (roofline_time of the kernel): not the bound of "
    "the whole step's sums"
)
STEP_INTENSITY = "each kernel has its own intensity, its FLOPs ÷ its bytes: not the whole step's"
ORDER = (
    "one time per kernel, in the order of the kernels given (the caller pairs them by position): don't sort or "
    "reorder them"
)
KERNEL_FIELDS = (
    "a kernel is (name, flops, bytes) — a Kernel, or a plain tuple: its FLOPs are k[1], its bytes k[2] "
    "(or unpack name, flops, nbytes = k)"
)
STEP_ERRORS = {
    "'str' and": KERNEL_FIELDS,
    "and 'str'": KERNEL_FIELDS,
    "not str": KERNEL_FIELDS,
    "too many values to unpack": KERNEL_FIELDS,
    "object has no attribute 'flops'": KERNEL_FIELDS,
    "object has no attribute 'bytes'": KERNEL_FIELDS,
    "object has no attribute 'nbytes'": KERNEL_FIELDS,
}


def _step_mistakes(kernels, peak: float, bandwidth: float) -> list[tuple[float, str]]:
    """(what a mistake gives, its hint) for the seconds of step_time(kernels, peak, bandwidth)."""
    flops, nbytes = [float(k[1]) for k in kernels], [float(k[2]) for k in kernels]
    memory, compute = [b / float(bandwidth) for b in nbytes], [f / float(peak) for f in flops]
    step_memory, step_compute = sum(nbytes) / float(bandwidth), sum(flops) / float(peak)
    return [
        (max(step_memory, step_compute), ONE_POINT),
        (step_memory + step_compute, SUMMED_ROOFS),
        (max(map(max, memory, compute), default=0.0), LARGEST),
        (sum(map(min, memory, compute)), "a kernel's time is the larger of bytes ÷ bandwidth and FLOPs ÷ peak"),
        (sum(memory) + sum(compute), "a kernel's time is the larger of its two times, not their sum"),
        (step_memory, "the compute-bound kernels take FLOPs ÷ peak: each kernel's time is the larger of its two"),
    ]


def _time_shaped(t: Any) -> bool:
    return (
        isinstance(t, (tuple, list)) and len(t) == 4 and isinstance(t[1], str) and all(_number(t[i]) for i in (0, 2, 3))
    )


def _permuted(times: list, expected: list) -> bool:
    """Whether `times` are the expected ones in another order."""
    left = list(range(len(expected)))
    for t in times:
        match = next(
            (
                j
                for j in left
                if t[1] == expected[j].bound and all(_close(float(t[n]), expected[j][n]) for n in (0, 2, 3))
            ),
            None,
        )
        if match is None:
            return False
        left.remove(match)
    return True


def _step_verdict(args: tuple, got: Any, expected: StepTime) -> Verdict:
    kernels, peak, bandwidth = args
    if _has_tensor(got) or (isinstance(got, (tuple, list)) and len(got) == 2 and _has_tensor(got[1])):
        return _TENSOR
    shaped = isinstance(got, (tuple, list)) and len(got) == 2 and _number(got[0]) and isinstance(got[1], (tuple, list))
    if not shaped:
        return (
            f"expected (seconds, [one (seconds, bound, intensity, ridge) per kernel]), got {short(got, 100)}",
            "return the step's seconds and the list of each kernel's roofline_time (a tuple, or the engine's StepTime)",
        )
    seconds, times = float(got[0]), list(got[1])
    if not _close(seconds, expected.seconds):
        return (
            f"the step's seconds are wrong: expected {expected.seconds!r}, got {got[0]!r}",
            _first(_step_mistakes(kernels, peak, bandwidth), seconds),
        )
    if len(times) != len(expected.kernels):
        return f"expected one time per kernel ({len(expected.kernels)}), got {len(times)}", ORDER
    for i, t in enumerate(times):
        if not _time_shaped(t):
            return (
                f'kernel {i}: expected (seconds, "memory" or "compute", intensity, ridge), got {short(t, 100)}',
                "each kernel's time is what roofline_time returns for it",
            )
    right = [
        all(_close(float(t[n]), e[n]) for n in (0, 2, 3)) and t[1] == e.bound for t, e in zip(times, expected.kernels)
    ]
    if not all(right) and _permuted(times, expected.kernels):
        return "the kernels' times are the right ones in another order", ORDER
    flops, nbytes = sum(float(k[1]) for k in kernels), sum(float(k[2]) for k in kernels)
    step_bound = "compute" if flops / peak > nbytes / bandwidth else "memory"
    step_intensity = flops / nbytes if nbytes else math.inf
    for i, (t, e, k) in enumerate(zip(times, expected.kernels, kernels)):
        verdict = _time_verdict((k[1], k[2], peak, bandwidth), t, e)
        if verdict:
            problem, hint = verdict
            tie = float(k[1]) / peak == float(k[2]) / bandwidth  # roofline_time's own hint says "memory" on a tie
            if t[1] != e.bound and not tie and all(x[1] == step_bound for x in times):
                hint = STEP_BOUND
            if not _close(float(t[2]), e.intensity) and all(_close(float(x[2]), step_intensity) for x in times):
                hint = STEP_INTENSITY
            return f"kernel {i} ({k[0]!r}): {problem}", hint
    return None


def _judge_step(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    if how == "engine":
        shape, machine, keywords = args
        expected = case.expected
        part = None
        if isinstance(got, Prediction):
            part = _step_verdict(
                (expected.kernels, *machine), (got.seconds, got.times), StepTime(expected.seconds, expected.times)
            )
        return _engine_verdict(got, expected, part)
    return _step_verdict(args, got, case.expected)


def _random_kernels(rng: random.Random) -> tuple[list, float, float]:
    """Kernels and a machine: a step of a random model, or made-up kernels; no kernel near its ridge."""
    machine = rng.choice([H100, A100, RTX4090, M3_MAX])
    if rng.random() < 0.5:
        shape = rng.choice([*SHAPES.values(), BUNDLED, MQA, _random_shape(rng)])
        batch = rng.choice([1, rng.randint(1, 2048)])
        new_tokens = rng.choice([1, 1, rng.randint(1, 4096)])
        context = rng.choice([0, rng.randint(1, 65536)])
        weights, dtype = rng.choice(FORMATS), rng.choice(list(FLOAT_BYTES))
        kernels = step_kernels(shape, batch, new_tokens, context, weights, dtype)
    else:
        names = ("q", "k", "v", "o", "up", "down", "attention", "elementwise", "head", "gate")
        kernels = [
            Kernel(rng.choice(names), 10 ** rng.uniform(3, 16) if rng.random() < 0.9 else 0.0, 10 ** rng.uniform(3, 12))
            for _ in range(rng.randint(1, 12))
        ]
    if any(_tie(k.flops, k.bytes, *machine) for k in kernels):
        return _random_kernels(rng)
    return kernels, *machine


def check_step_time(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """step_time(kernels, peak_flops, bandwidth) -> (seconds, [per-kernel (seconds, bound, intensity, ridge)]): each
    kernel (name, flops, bytes) — a `Kernel` or a plain tuple — judged on its own roofline (roofline_time), in the
    order given, and the step's least time the sum of theirs (they run one after another). The answer may be a
    tuple, a list or the engine's `StepTime`, each kernel's time a tuple, a list or a `RooflineTime`. The kernels
    must not change. Exact (relative 1e-9); ends with the engine's `predict` running it."""
    if not callable(fn):
        raise CheckFailed(f"✗ step_time: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_step_time, *args), hint)

    l8, l70 = SHAPES["Llama-3-8B"], SHAPES["Llama-3-70B"]
    cases = [
        case(
            "a compute-bound product beside memory-bound cache reads",
            ([Kernel("big product", 2e10, 1e9), Kernel("cache reads", 1e9, 1e9)], 1e12, 1e11),
            "0.02 s of arithmetic, then 0.01 s of reads: 0.03 s (one point, 21 GFLOP for 2 GB, would say 0.021 s)",
        ),
        case(
            "Llama-3-8B decoding 1024 sequences at 1024 cached, in bfloat16, on an H100: the products compute-bound, "
            "attention memory-bound",
            (step_kernels(l8, 1024, 1, 1024, "bfloat16", "bfloat16"), *H100),
        ),
        case(
            "Llama-3-8B decoding one sequence at 8192 cached on an H100: every kernel memory-bound",
            (step_kernels(l8, 1, 1, 8192), *H100),
        ),
        case(
            "plain (name, flops, bytes) tuples",
            ([("q", 3e12, 2e9), ("attention", 4e9, 1e9), ("norms", 0.0, 5e8)], *A100),
            "a kernel is (name, flops, bytes): k[1] and k[2]",
        ),
        case(
            "one kernel exactly on the ridge (its two times equal), one above it",
            ([Kernel("on the ridge", 1024.0, 512.0), Kernel("above it", 4096.0, 512.0)], 2048.0, 1024.0),
            'a tie is "memory", as roofline_time says',
        ),
        case("a single kernel", ([Kernel("head", 1e12, 1e9)], *RTX4090)),
        case(
            "Llama-3-70B in int4, a prefill of 2048, on an A100",
            (step_kernels(l70, 1, 2048, 0, "int4", "bfloat16"), *A100),
        ),
        case(
            "a tuple of kernels, numpy numbers",
            (
                (
                    Kernel("up", np.float64(5e13), np.int64(3 * 10**9)),
                    Kernel("attention", np.float64(2e9), np.int64(10**9)),
                ),
                np.float64(989e12),
                np.float64(3.35e12),
            ),
        ),
        case("integers", ([Kernel("a", 10**15, 10**12), Kernel("b", 10**9, 10**10)], 312 * 10**12, 2039 * 10**9)),
        case(
            "Fractions",
            (
                [Kernel("x", Fraction(1, 3), Fraction(1, 6)), Kernel("y", Fraction(5), Fraction(1, 2))],
                Fraction(2, 3),
                1,
            ),
            "any Python number type",
        ),
    ]
    rng = random.Random(seed)
    for i in range(n_random):
        cases.append(case(f"random #{i}", _random_kernels(rng)))

    call = "step_time(kernels, peak_flops, bandwidth)"
    engine_cases = [
        _engine_case(
            "step_time",
            "Llama-3-8B decoding 1024 sequences at 1024 cached on an H100",
            l8,
            H100,
            call,
            batch=1024,
            context=1024,
            weights="bfloat16",
            dtype="bfloat16",
        ),
        _engine_case(
            "step_time",
            "Llama-3-70B in int4, a prefill of 2048 that computes the last position's logits only, on an A100",
            l70,
            A100,
            call,
            new_tokens=2048,
            weights="int4",
            last_only=True,
        ),
        _engine_case(
            "step_time",
            "GPT-2 124M in float32 decoding 64 sequences at 512 cached, measured 50 ms",
            SHAPES["GPT-2 124M"],
            M3_MAX,
            call,
            batch=64,
            context=512,
            weights="float32",
            dtype="float32",
            measured_seconds=0.05,
        ),
    ]

    def show(args: tuple) -> str:
        how, *rest = args
        if how == "engine":
            return _predict_text(*rest, "step_time")
        return _call_text("step_time", ("kernels", "peak_flops", "bandwidth"), rest)

    _run_both(
        "step_time",
        named_like(lambda how, *args: _run_predict(fn, "step_time", how, *args), fn, leading=("how",)),
        cases,
        lambda: engine_cases,
        judge=_judge_step,
        show_call=show,
        error_hints=STEP_ERRORS,
        seconds=2,
        total_seconds=10,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 7: critical_batch — the smallest batch at which every weight product of a decode step is compute-bound

SUMMED = (
    "judge each weight product on its own roofline: summed into one point, the wide matrices' high intensity hides "
    "the thin ones (grouped-query attention's k and v), which stay memory-bound longest — the answer is the batch "
    "at which the last of them turns"
)
WHOLE_STEP = (
    "attention and the elementwise kernels are no weight products: their intensity does not grow with the batch. "
    "Judge each weight product (gemm_cost at `batch` rows) on its own roofline"
)
FIRST_TO_TURN = (
    "that batch turns the first product compute-bound; every product must be: the largest of the products' batches"
)
HEAD_TOO = "the output head [vocab_size, n_embd] is a weight product too: here it is the thinnest, the last to turn"
EVERY_MATRIX = "every weight product must be compute-bound, not only q: k and v, o, the MLP's and the head too"
WEIGHTS_ONLY = (
    "each sequence's activation rows add bytes too (inputs read, outputs written, in dtype): use gemm_cost's bytes, "
    "not the weights' alone (with them alone, every float product would turn just past the ridge point × bytes per "
    "weight ÷ 2)"
)
RIDGE = (
    "that is the ridge point (FLOPs per byte of the machine), not a batch size: find the smallest batch at which "
    "every weight product's gemm_cost is compute-bound by roofline_time"
)
LAST_MEMORY = "that batch is the last memory-bound one: return the smallest batch that is compute-bound"
NEVER = (
    "some weight product stays memory-bound at every batch up to max_batch (its intensity levels off at "
    "2·outputs·inputs / ((outputs + inputs) × bytes per value), below this ridge): return None"
)


def _smallest_batch(compute_bound: Callable[[int], bool], max_batch: int) -> Optional[int]:
    """The smallest batch from 1 to max_batch at which `compute_bound` (monotone) holds, or None."""
    if max_batch < 1 or not compute_bound(max_batch):
        return None
    low, high = 0, max_batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def _product_batches(args: tuple, weights_only: bool = False) -> dict[tuple[int, int], Optional[int]]:
    """{(outputs, inputs): the smallest batch at which that product is compute-bound, or None} for every matrix."""
    shape, weights, dtype, peak, bandwidth, max_batch = args

    def bound(o, i):
        def compute(batch):
            if weights_only:
                return 2 * batch * o * i / peak > engine_matrix_bytes(o, i, weights, dtype) / bandwidth
            cost = engine_gemm_cost(batch, o, i, weights, dtype)
            return cost.flops / peak > cost.bytes / bandwidth

        return compute

    return {m: _smallest_batch(bound(*m), max_batch) for m in set(_matrices(shape))}


def _last(batches) -> Optional[int]:
    values = list(batches)
    return None if any(b is None for b in values) else max(values, default=1)


def _batch_mistakes(args: tuple) -> list[tuple[Optional[float], str]]:
    """(what a mistake gives, its hint) for critical_batch(*args); None values never match."""
    shape, weights, dtype, peak, bandwidth, max_batch = args
    mats = _matrices(shape)
    each = _product_batches(args)
    layer = set(_layer_matrices(shape).values())

    def summed(batch):
        costs = [engine_gemm_cost(batch, o, i, weights, dtype) for o, i in mats]
        return sum(c.flops for c in costs) / peak > sum(c.bytes for c in costs) / bandwidth

    def whole(elementwise: bool):
        def bound(batch):
            kernels = step_kernels(shape, batch, 1, 0, weights, dtype)
            kept = [k for k in kernels if elementwise or k.name != "elementwise"]
            return sum(k.flops for k in kept) / peak > sum(k.bytes for k in kept) / bandwidth

        return bound

    ridge = peak / bandwidth
    found = [b for b in each.values() if b is not None]
    q = (shape.n_head * shape.head_dim, shape.n_embd)
    return [
        (_smallest_batch(summed, max_batch), SUMMED),
        (_smallest_batch(whole(True), max_batch), WHOLE_STEP),
        (_smallest_batch(whole(False), max_batch), WHOLE_STEP),
        (min(found) if found else None, FIRST_TO_TURN),
        (_last(b for m, b in each.items() if m in layer), HEAD_TOO),
        (each[q], EVERY_MATRIX),
        (_last(_product_batches(args, weights_only=True).values()), WEIGHTS_ONLY),
        (math.floor(ridge * VALUE_BYTES[weights] / 2) + 1, WEIGHTS_ONLY),
        (math.floor(ridge), RIDGE),
        (math.ceil(ridge), RIDGE),
    ]


def _on_a_tie(args: tuple, batch: int) -> bool:
    """Whether some weight product's two times are exactly equal at `batch`."""
    shape, weights, dtype, peak, bandwidth, _ = args
    for o, i in set(_matrices(shape)):
        cost = engine_gemm_cost(batch, o, i, weights, dtype)
        if cost.flops / peak == cost.bytes / bandwidth:
            return True
    return False


def _batch_hint(args: tuple, got: Any, expected: Optional[int]) -> str:
    max_batch = args[5]
    if expected is None:
        if got == max_batch:
            return "when no batch up to max_batch is compute-bound, return None (not max_batch)"
        if got > max_batch:
            return "no batch above max_batch: return None when none up to it is compute-bound"
        return _first([(v, h) for v, h in _batch_mistakes(args) if v is not None], float(got), 0) or NEVER
    if got == expected - 1 and got >= 1 and _on_a_tie(args, got):
        return (
            f"at batch {got} a product's two times are exactly equal: memory-bound by the chapter's rule (\"memory\" "
            "on a tie, as roofline_time says), so the answer is the next batch — from a balance point x that is a "
            "whole number, math.floor(x) + 1, not math.ceil(x)"
        )
    mistakes = [(v, h) for v, h in _batch_mistakes(args) if v is not None and v != expected]
    return _first([*mistakes, (expected - 1, LAST_MEMORY)], float(got), 0)


def _judge_batch(case: Case, got: Any) -> Verdict:
    how, *args = case.args
    full = (*args, 1 << 20)[:6]
    expected = case.expected
    if isinstance(got, Tensor):
        return "expected a Python int or None, got a tensor", "use Python numbers (or .item())"
    if got is None:
        if expected is None:
            return None
        return f"a batch of {expected} is compute-bound, got None", (
            "return None only when some weight product is memory-bound at every batch up to max_batch (attention is "
            "no weight product: its intensity does not grow with the batch, leave it out)"
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
        return f"no batch up to max_batch={full[5]} is compute-bound (expected None), got {got}", _batch_hint(
            full, got, expected
        )
    return f"expected a batch of {expected}, got {got}", _batch_hint(full, got, expected)


def _run_batch(fn: Callable, how: str, *args):
    if how == "engine":  # as the chapter's figures call it, through its guard
        return guard("critical_batch", fn)(*args)
    return fn(*args)


def _margin(args: tuple, batch: int) -> float:
    """How far the weight product closest to its ridge at `batch` is from it: the relative difference of its times."""
    shape, weights, dtype, peak, bandwidth, _ = args
    margins = []
    for o, i in set(_matrices(shape)):
        cost = engine_gemm_cost(batch, o, i, weights, dtype)
        compute, memory = cost.flops / peak, cost.bytes / bandwidth
        margins.append(abs(compute - memory) / max(compute, memory))
    return min(margins)


def _clear_of_ties(args: tuple) -> bool:
    """No batch that decides the answer sits within a relative 1e-6 of some product's ridge (float rounding could go
    either way there, and a closed form and a search would then both be right)."""
    answer = engine_critical_batch(*args)
    batches = [args[5]] if answer is None else [answer, answer - 1] if answer > 1 else [answer]
    return all(_margin(args, b) > 1e-6 for b in batches if b >= 1)


def on_the_ridge(shape: ModelShape, batch: int, scale: int = 2**10) -> tuple[float, float]:
    """A machine (peak FLOP/s, bandwidth) on whose ridge the thinnest weight product of `shape` in float32 sits
    exactly at `batch` rows: its two times are equal in floats too (every quotient exact: a power-of-2 scale). In
    float32 the thinnest product (the largest 1/outputs + 1/inputs) has the lowest intensity at every batch, so the
    critical batch is `batch` + 1."""
    o, i = max(set(_matrices(shape)), key=lambda m: Fraction(1, m[0]) + Fraction(1, m[1]))
    cost = engine_gemm_cost(batch, o, i, "float32", "float32")
    return float(cost.flops * scale), float(cost.bytes * scale)


def check_critical_batch(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """critical_batch(shape, weights, dtype, peak_flops, bandwidth, max_batch=1 << 20) -> the smallest batch at which
    every weight product of a decode step (each layer's matrices and the output head, `batch` rows each: gemm_cost)
    is compute-bound by roofline_time, or None if some product is memory-bound at every batch up to max_batch. An
    int; one case sits exactly on a tie (exact in floats too: `on_the_ridge`), where the product is memory-bound; no
    other case sits near one. Ends with Llama-3-70B on an H100 through the guard the engine's figures use."""
    if not callable(fn):
        raise CheckFailed(f"✗ critical_batch: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        full = (*args, 1 << 20)[:6]
        return Case(description, ("call", *args), later(engine_critical_batch, *full), hint)

    l8, l70 = SHAPES["Llama-3-8B"], SHAPES["Llama-3-70B"]
    l8_answer = engine_critical_batch(l8, "bfloat16", "bfloat16", *H100)
    cases = [
        case(
            "Llama-3-8B in bfloat16 on an H100",
            (l8, "bfloat16", "bfloat16", *H100, 1 << 20),
            "k and v (grouped-query attention's thin matrices) turn last",
        ),
        case(
            "GPT-2 124M in float32 on an H100: no batch",
            (SHAPES["GPT-2 124M"], "float32", "float32", *H100, 1 << 20),
            "a [768, 768] product in float32 levels off at 192 FLOPs per byte, below the H100's ridge (295)",
        ),
        case("Llama-2-7B (MHA) on an RTX 4090", (SHAPES["Llama-2-7B"], "float16", "float16", *RTX4090, 1 << 20)),
        case("Llama-3-70B in int4 on an H100", (l70, "int4", "bfloat16", *H100, 1 << 20)),
        case("Llama-3-70B in int8 on an A100", (l70, "int8", "float16", *A100, 1 << 20)),
        case(
            "a model whose output head [64, 256] is its thinnest product, on a low ridge",
            (SMALL_VOCAB, "float16", "float16", *M3_MAX, 1 << 20),
            "the head is a weight product too",
        ),
        case("the bundled model in float32, a low ridge", (BUNDLED, "float32", "float32", *M3_MAX, 1 << 20)),
        case("a tiny model with a low ridge", (TINY, "float32", "float32", 2e9, 1e9, 1 << 20)),
        case(
            "max_batch below the answer",
            (l8, "bfloat16", "bfloat16", *H100, 100),
            "no batch up to max_batch is compute-bound: None",
        ),
        case(
            "max_batch just below the answer",
            (l8, "bfloat16", "bfloat16", *H100, l8_answer - 1),
            "no batch up to max_batch is compute-bound: None",
        ),
        case("max_batch exactly the answer", (l8, "bfloat16", "bfloat16", *H100, l8_answer)),
        case(
            "critical_batch(shape, weights, dtype, peak_flops, bandwidth): max_batch 1 << 20",
            (l70, "float16", "float16", *H100),
        ),
        case(
            "numpy numbers",
            (SHAPES["Llama-3.2-1B"], "int8", "float16", np.float64(312e12), np.float64(2.039e12), np.int64(4096)),
        ),
        case(
            "a machine on whose ridge the bundled model's thinnest product in float32 sits exactly at batch 64: "
            "memory-bound there, so 65",
            (BUNDLED, "float32", "float32", *on_the_ridge(BUNDLED, 64)),
            'a tie is "memory": the smallest compute-bound batch is the one after the balance point',
        ),
    ]
    fixed = len(cases)
    rng = random.Random(seed)
    while len(cases) < fixed + n_random:
        shape = rng.choice([*SHAPES.values(), BUNDLED, SMALL_VOCAB, MQA, _random_shape(rng)])
        machine = rng.choice([H100, A100, RTX4090, M3_MAX])
        max_batch = rng.choice([1 << 20, 1 << 20, rng.randint(1, 4096)])
        args = (shape, rng.choice(FORMATS), rng.choice(list(FLOAT_BYTES)), *machine, max_batch)
        if _clear_of_ties(args):
            cases.append(case(f"random #{len(cases) - fixed}", args))
    engine = (l70, "bfloat16", "bfloat16", *H100)
    cases.append(
        Case(
            "in the engine: Llama-3-70B on an H100 (the guard the chapter's figures use)",
            ("engine", *engine),
            later(engine_critical_batch, *engine),
            "the engine calls critical_batch(shape, weights, dtype, peak_flops, bandwidth) positionally",
        )
    )

    def show(args: tuple) -> str:
        how, *rest = args
        names = ("shape", "weights", "dtype", "peak_flops", "bandwidth", "max_batch")
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
            "a batch-by-batch search up to max_batch (2^20) takes too long: a product's FLOPs and bytes both grow "
            "linearly with the batch, so halve the interval (binary search) or solve for the batch"
        ),
    )


# ----------------------------------------------------------------------------------------------
# Exercise 8: utilization — MBU and MFU of a step from its measured time


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
        part, expected = None, case.expected
        if isinstance(got, Prediction) and got.mbu is not None:
            part = _use_verdict(
                (expected.flops, expected.bytes, keywords["measured_seconds"], *machine),
                (got.mbu, got.mfu),
                (case.expected.mbu, case.expected.mfu),
            )
        return _engine_verdict(got, case.expected, part)
    return _use_verdict(args, got, case.expected)


def check_utilization(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """utilization(flops, nbytes, seconds, peak_flops, bandwidth) -> (mbu, mfu): the bytes moved per second as a
    fraction of the bandwidth, the FLOPs per second as a fraction of the peak. Exact (relative 1e-9); ends with the
    engine's `predict` given a measured time."""
    if not callable(fn):
        raise CheckFailed(f"✗ utilization: expected a function, got {short(fn)}")

    def case(description, args, hint=""):
        return Case(description, ("call", *args), later(engine_utilization, *args), hint)

    decode = _step_totals(SHAPES["Llama-2-7B"], 1, 1, 0, "bfloat16", "bfloat16")
    cases = [
        case("half the bandwidth, a fifth of the peak", (2e9, 1e9, 0.01, 1e12, 2e11)),
        case(
            "gpt-fast's Llama-2-7B in bfloat16 on an A100: 13.5 GB at ~105 tokens/s",
            (*decode, 1 / 105, *A100),
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
        call = "utilization(flops, nbytes, seconds, peak_flops, bandwidth)"
        return _engine_case("utilization", description, shape, machine, call, **keywords)

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
            return _predict_text(*rest, "utilization")
        return _call_text("utilization", ("flops", "nbytes", "seconds", "peak_flops", "bandwidth"), rest)

    _run_both(
        "utilization",
        lambda how, *args: _run_predict(fn, "utilization", how, *args),
        cases,
        lambda: engine_cases,
        judge=_judge_use,
        show_call=show,
        seconds=2,
        total_seconds=10,
    )
