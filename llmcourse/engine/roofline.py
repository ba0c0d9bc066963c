"""What bounds a decode step, and how many sequences a memory holds: the arithmetic of chapter 06.

A decode step of `batch` sequences reads every weight once (the sequences share them) plus each sequence's
KV cache, and does one multiply-add — 2 FLOPs — per weight per sequence. Its time is at least the larger of
bytes ÷ memory bandwidth and FLOPs ÷ peak FLOP/s (the roofline of Williams, Waterman & Patterson (2009),
*Roofline: An Insightful Visual Performance Model for Multicore Architectures*). At small batches the
bytes win by far: decode is memory-bound. The benchmarks (`python -m llmcourse bench`) set the engine's
measured speed against `decode_bound`; chapter 10 (the roofline) generalises these.

`Roofline` holds the two functions a learner writes in chapter 06 (`decode_step`, `max_sequences`); no
generation runs them.

    >>> flops, nbytes = decode_step(n_params=8e9, kv_bytes_per_token=131072, context=8192, batch=32)
    >>> decode_bound(flops, nbytes, peak_flops=989e12, bandwidth=3.35e12)      # Llama-3-8B on an H100 SXM
    (0.0150..., 'memory')
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .config import GPT2Config
from .slots import Slots


def decode_step(n_params, kv_bytes_per_token, context, batch=1, bytes_per_weight=2) -> tuple[float, float]:
    """(FLOPs, bytes read) of one decode step of `batch` sequences, each attending to `context` cached positions.

    Every weight is read once for the whole batch; each sequence reads its own KV cache; each weight does
    one multiply-add (2 FLOPs) for each sequence.

    >>> decode_step(n_params=124e6, kv_bytes_per_token=36864, context=1024)     # GPT-2 small, fp16
    (248000000.0, 285748736.0)
    """
    flops = 2 * n_params * batch
    nbytes = n_params * bytes_per_weight + batch * context * kv_bytes_per_token
    return flops, nbytes


def decode_bound(flops, nbytes, peak_flops, bandwidth) -> tuple[float, str]:
    """(the least seconds a step can take, "memory" or "compute": which limit sets it).

    >>> decode_bound(flops=2e9, nbytes=2e9, peak_flops=1e12, bandwidth=1e11)
    (0.02, 'memory')
    """
    memory, compute = nbytes / bandwidth, flops / peak_flops
    return (memory, "memory") if memory >= compute else (compute, "compute")


def max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2) -> int:
    """How many sequences of `context` positions have room for their KV caches in `memory_bytes` next to the
    weights (0 when the weights alone do not fit): a key and a value per layer, KV head and position each.

    >>> max_sequences(80e9, 16e9, n_layer=32, n_kv_head=8, head_dim=128, context=8192)   # Llama-3-8B, one H100
    59
    """
    per_sequence = 2 * n_layer * n_kv_head * head_dim * context * bytes_per_value
    return max(0, int((memory_bytes - weight_bytes) // per_sequence))


@dataclasses.dataclass(frozen=True)
class Roofline(Slots):
    """Chapter 06's formulas: the cost of a decode step and the sequences that fit. `model_decode_step` and the
    benchmarks take a `decode_step`."""

    decode_step: Callable = decode_step
    max_sequences: Callable = max_sequences


def model_decode_step(
    config: GPT2Config, context: int, bytes_per_value: float = 4, batch: int = 1, step: Callable = decode_step
) -> tuple[float, float]:
    """(FLOPs, bytes read) of one decode step of a GPT-2 model: `step` (`decode_step`) over the weights a step
    reads (the blocks, the final layer norm and the tied token table, read whole for the logits; of the
    position table only each row's own row) and the cache, plus what `decode_step` leaves out: attention's
    scores and weighted sum (2 FLOPs per cached value) and each row's position row.

    >>> model_decode_step(GPT2Config(n_layer=1, n_head=1, n_embd=4, vocab_size=10), context=2)
    (616, 1248)
    """
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    weights = L * (12 * C * C + 13 * C) + 2 * C + V * C  # c_attn, c_proj, c_fc, c_proj + biases + 2 norms; ln_f; head
    kv_values = 2 * L * C  # a key and a value per layer, for every head, per position
    flops, nbytes = step(weights, kv_values * bytes_per_value, context, batch, bytes_per_value)
    return flops + batch * 2 * kv_values * context, nbytes + batch * C * bytes_per_value


def ridge_point(peak_flops, bandwidth) -> float:
    """FLOPs per byte a kernel must do for the arithmetic, not the memory, to limit it.

    >>> round(ridge_point(989e12, 3.35e12))            # an H100 SXM, dense bf16
    295
    """
    return peak_flops / bandwidth
