"""The roofline: what bounds a forward step of a decoder, on any machine, from two numbers of that machine.

A step reads bytes (every weight once, the sequences' KV caches, the activations between the matrix products) and
does FLOPs (a multiply-add, 2 FLOPs, per weight per row, plus attention's). Its time is at least the larger of
bytes ÷ memory bandwidth and FLOPs ÷ peak FLOP/s: the roofline of Williams, Waterman & Patterson (2009),
*Roofline: An Insightful Visual Performance Model for Multicore Architectures*. Their ratio, FLOPs per byte, is the
step's arithmetic intensity; the machine's peak ÷ bandwidth, its ridge point. Decode at small batches sits far
below the ridge: memory-bound.

Chapter 06's learners write `decode_step` and `max_sequences` (weights and caches only, for one decode step);
chapter 10's the general count (`step_cost` with `matrix_bytes`), `roofline_time`, `critical_batch`,
`utilization` and `gpu_roof`, the datasheet figures of the cards in `GPUS`. `Roofline` holds them all; `predict`
runs a table of them, and `python -m llmcourse bench` reports the engine's speed against them (MBU and MFU beside
tokens/s). No generation runs them.

    >>> cost = step_cost(SHAPES["Llama-3-8B"], batch=1, new_tokens=1, context=8192)   # fp16 weights and cache
    >>> roofline_time(cost.flops, cost.bytes, *gpu_roof("H100 SXM")).bound       # one token, 8192 positions cached
    'memory'
    >>> round(predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM")).tokens_per_s)  # batch 1: the weights' read time
    223
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

from .config import GPT2Config
from .quantize import GROUP_SIZE
from .slots import Slots

# bytes of one value in each float dtype; the weight formats add int8 and int4 (`matrix_bytes`)
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WEIGHT_FORMATS = (*FLOAT_BYTES, "int8", "int4")


# ------------------------------------------------------------------------------------------- chapter 06


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


def max_sequences(memory_bytes, weight_bytes, n_layer, n_kv_head, head_dim, context, bytes_per_value=2) -> int:
    """How many sequences of `context` positions have room for their KV caches in `memory_bytes` next to the
    weights (0 when the weights alone do not fit): a key and a value per layer, KV head and position each.

    >>> max_sequences(80e9, 16e9, n_layer=32, n_kv_head=8, head_dim=128, context=8192)   # Llama-3-8B, one H100
    59
    """
    per_sequence = 2 * n_layer * n_kv_head * head_dim * context * bytes_per_value
    return max(0, int((memory_bytes - weight_bytes) // per_sequence))


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


# ------------------------------------------------------------------------------------------- chapter 10


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that set what a decoder's step costs: layers, width, attention heads (query and key/value: fewer
    KV heads is grouped-query attention), head size, the MLP's hidden width and kind ("gelu": up and down, as
    GPT-2; "swiglu": gate, up and down, as Llama), the vocabulary, and whether the output head is the token table.

    >>> ModelShape.of(GPT2Config()).n_kv_head, SHAPES["Llama-3-8B"].n_kv_head
    (12, 8)
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab_size: int
    mlp: str = "gelu"
    tied: bool = True

    @classmethod
    def of(cls, config) -> "ModelShape":
        """The shape of a model's configuration: a `GPT2Config` or a `llama.LlamaConfig`."""
        if hasattr(config, "intermediate_size"):  # the Llama family
            return cls(
                config.n_layer,
                config.n_embd,
                config.n_head,
                config.n_kv_head,
                config.head_dim,
                config.intermediate_size,
                config.vocab_size,
                "swiglu",
                config.tie_word_embeddings,
            )
        return cls(
            config.n_layer,
            config.n_embd,
            config.n_head,
            config.n_head,
            config.head_dim,
            4 * config.n_embd,
            config.vocab_size,
        )

    def multiply_adds(self) -> int:
        """Multiply-adds per token of the matrix products (each matrix once; attention's own left out)."""
        return sum(rows * cols for rows, cols in _matrices(self))

    def resident_params(self) -> int:
        """Weights held in memory: the matrices, plus the token table when the head is not it (biases and norms,
        under 0.1 %, left out)."""
        return self.multiply_adds() + (0 if self.tied else self.vocab_size * self.n_embd)


def _matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, cols) = (outputs, inputs) of every matrix a step multiplies by: each layer's q, k, v, o and MLP, then
    the output head."""
    C, H, Hkv, D, F = shape.n_embd, shape.n_head, shape.n_kv_head, shape.head_dim, shape.d_ff
    mlp = [(F, C), (F, C), (C, F)] if shape.mlp == "swiglu" else [(F, C), (C, F)]
    layer = [(H * D, C), (Hkv * D, C), (Hkv * D, C), (C, H * D), *mlp]
    return layer * shape.n_layer + [(shape.vocab_size, C)]


# Published shapes (each model's config.json on the Hugging Face Hub).
SHAPES = {
    "GPT-2 124M": ModelShape(12, 768, 12, 12, 64, 3072, 50257),
    "Llama-2-7B": ModelShape(32, 4096, 32, 32, 128, 11008, 32000, "swiglu", tied=False),
    "Llama-3-8B": ModelShape(32, 4096, 32, 8, 128, 14336, 128256, "swiglu", tied=False),
    "Llama-3-70B": ModelShape(80, 8192, 64, 8, 128, 28672, 128256, "swiglu", tied=False),
    "Llama-3.2-1B": ModelShape(16, 2048, 32, 8, 64, 8192, 128256, "swiglu"),
}


class Machine(NamedTuple):
    """A processor's two roofs (dense 16-bit tensor FLOP/s, memory bytes/s), its memory, and where they are from.
    `sparse_flops`: the figure a datasheet also prints, with 2:4 structured sparsity (twice the dense one), which
    dense matrix products never reach. Apple publishes no matrix FLOP/s: `peak_flops` None."""

    peak_flops: Optional[float]
    bandwidth: float
    memory: float
    sparse_flops: Optional[float]
    source: str


GPUS = {
    "H100 SXM": Machine(989e12, 3.35e12, 80e9, 1979e12, "NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core)"),
    "A100 80GB SXM": Machine(
        312e12, 2.039e12, 80e9, 624e12, "NVIDIA A100 Tensor Core GPU datasheet (BF16 Tensor Core)"
    ),
    "RTX 4090": Machine(
        165.2e12,
        1.008e12,
        24e9,
        330.4e12,
        "NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090: FP16 Tensor, FP32 accumulate)",
    ),
    "Apple M3 Max": Machine(None, 400e9, 128e9, None, "Apple, MacBook Pro tech specs (M3 Max, 40-core GPU)"),
    "Apple M4 Pro": Machine(None, 273e9, 64e9, None, "Apple, Mac mini tech specs (M4 Pro)"),
    "H200 SXM": Machine(989e12, 4.8e12, 141e9, 1979e12, "NVIDIA H200 Tensor Core GPU datasheet (BF16 Tensor Core)"),
}


def gpu_roof(card: str) -> tuple[Optional[float], float]:
    """(dense 16-bit peak FLOP/s, memory bandwidth in bytes/s) of a card of `GPUS`, from its datasheet.

    >>> gpu_roof("A100 80GB SXM")
    (312000000000000.0, 2039000000000.0)
    """
    if card not in GPUS:
        raise ValueError(f"unknown card {card!r}; the cards are: {', '.join(GPUS)}")
    return GPUS[card].peak_flops, GPUS[card].bandwidth


def card_of(device_name: str) -> Optional[str]:
    """The card of `GPUS` that a CUDA device is (its name as torch reports it), or None.

    >>> card_of("NVIDIA H100 80GB HBM3"), card_of("NVIDIA H100 PCIe"), card_of("NVIDIA A100-SXM4-80GB")
    ('H100 SXM', None, 'A100 80GB SXM')
    """
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:  # other memory and clocks than the SXM cards
        return None
    for card, marks in [
        ("H100 SXM", ("H100",)),
        ("H200 SXM", ("H200",)),
        ("A100 80GB SXM", ("A100", "80GB")),
        ("RTX 4090", ("4090",)),
    ]:
        if all(m in name for m in marks):
            return card
    return None


def matrix_bytes(rows: int, cols: int, fmt: str, dtype: str = "float32") -> int:
    """Bytes of a weight matrix [rows, cols] (outputs, inputs) stored in `fmt`, scales included, as the engine
    stores it: float32/float16/bfloat16 as they are; int8 one byte per weight plus a scale per row in the model's
    float `dtype`; int4 half a byte per weight plus a float16 scale per group of 32 inputs of a row.

    >>> matrix_bytes(768, 3072, "float16"), matrix_bytes(768, 3072, "int8"), matrix_bytes(768, 3072, "int4")
    (4718592, 2362368, 1327104)
    """
    if fmt in FLOAT_BYTES:
        return rows * cols * FLOAT_BYTES[fmt]
    if fmt == "int8":
        return rows * cols + rows * FLOAT_BYTES[dtype]
    if fmt == "int4":
        if cols % GROUP_SIZE:
            raise ValueError(f"int4 needs rows whose length ({cols}) is a multiple of {GROUP_SIZE}")
        return rows * cols // 2 + rows * (cols // GROUP_SIZE) * 2
    raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")


class StepCost(NamedTuple):
    """What one forward step costs: FLOPs, and the bytes it moves to and from memory, by kind."""

    flops: float
    weights: float
    kv_cache: float
    activations: float

    @property
    def bytes(self) -> float:
        return self.weights + self.kv_cache + self.activations


def step_cost(
    shape: ModelShape, batch: int, new_tokens: int, context: int, weights: str = "float16", dtype: str = "float16"
) -> StepCost:
    """FLOPs and bytes of one forward step: `batch` sequences each run `new_tokens` new positions (1: a decode step;
    the prompt: a prefill) after `context` positions already in their caches. Weights in format `weights`; the
    activations and the KV cache in `dtype`. Elementwise work (norms, GELU, softmax, additions) is left out.

    - FLOPs: 2 per weight of every matrix for each of the batch × new_tokens rows; attention 4 per head dimension
      for each (query, attended position) pair — scores and weighted sum — where new position i (from 0) of a
      sequence attends to context + i + 1 positions (causal).
    - weights: every matrix once (the rows share each read): `matrix_bytes`.
    - KV cache: per sequence, the context + new_tokens positions read by attention and the new_tokens positions
      written, each a key and a value per layer and KV head.
    - activations: every matrix product reads its input rows and writes its output rows; attention reads its
      queries and writes its output.

    >>> step_cost(ModelShape(1, 4, 1, 1, 4, 16, 10), batch=1, new_tokens=1, context=0)
    StepCost(flops=480, weights=464, kv_cache=32, activations=188)
    """
    B, T = batch, new_tokens
    rows, H, D, L = B * T, shape.n_head, shape.head_dim, shape.n_layer
    value = FLOAT_BYTES[dtype]  # activations and the cache are both in the model's dtype
    matrices = _matrices(shape)
    attended = T * context + T * (T + 1) // 2  # per sequence: sum over new positions of what each attends to
    flops = 2 * rows * sum(r * c for r, c in matrices) + 4 * L * H * D * B * attended
    weight_bytes = sum(matrix_bytes(r, c, weights, dtype) for r, c in matrices)
    kv_per_position = 2 * L * shape.n_kv_head * D * value
    kv_bytes = B * (context + 2 * T) * kv_per_position
    activation_bytes = value * rows * (sum(r + c for r, c in matrices) + L * 2 * H * D)
    return StepCost(flops, weight_bytes, kv_bytes, activation_bytes)


class RooflineTime(NamedTuple):
    """Where a step sits on a machine's roofline: its least time, the limit that sets it, its FLOPs per byte and
    the machine's."""

    seconds: float
    bound: str  # "memory" or "compute"
    intensity: float  # FLOPs per byte of the step
    ridge: float  # FLOPs per byte where the machine's two limits meet: peak_flops / bandwidth


def roofline_time(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> RooflineTime:
    """The least time of a step of `flops` FLOPs and `nbytes` bytes: the larger of bytes ÷ bandwidth and FLOPs ÷
    peak ("memory" when they are equal), with the step's arithmetic intensity and the machine's ridge point.

    >>> roofline_time(2e9, 2e9, peak_flops=1e12, bandwidth=1e11)
    RooflineTime(seconds=0.02, bound='memory', intensity=1.0, ridge=10.0)
    """
    memory, compute = nbytes / bandwidth, flops / peak_flops
    intensity = flops / nbytes if nbytes else math.inf
    seconds, bound = (compute, "compute") if compute > memory else (memory, "memory")
    return RooflineTime(seconds, bound, intensity, peak_flops / bandwidth)


def critical_batch(
    shape: ModelShape,
    context: int,
    weights: str,
    dtype: str,
    peak_flops: float,
    bandwidth: float,
    max_batch: int = 1 << 20,
) -> Optional[int]:
    """The smallest batch at which a decode step (one new token per sequence, `context` positions cached) is
    compute-bound by `step_cost` and `roofline_time`, or None if no batch up to `max_batch` is: each sequence adds
    its own cache and activations to the bytes, so at long contexts the intensity levels off below the ridge.

    >>> critical_batch(SHAPES["Llama-3-8B"], 0, "float16", "float16", 989e12, 3.35e12)    # no cache yet
    337
    >>> critical_batch(SHAPES["Llama-3-8B"], 8192, "float16", "float16", 989e12, 3.35e12) is None
    True
    """

    def compute_bound(batch: int) -> bool:
        cost = step_cost(shape, batch, 1, context, weights, dtype)
        return roofline_time(cost.flops, cost.bytes, peak_flops, bandwidth).bound == "compute"

    if not compute_bound(max_batch):  # FLOPs and bytes both grow linearly with the batch: the test is monotone
        return None
    low, high = 0, max_batch  # compute_bound(high), and not compute_bound(low) (batch 0 reads the weights for nothing)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high


def utilization(
    flops: float, nbytes: float, seconds: float, peak_flops: float, bandwidth: float
) -> tuple[float, float]:
    """(MBU, MFU) of a step measured to take `seconds`: the bytes it moved per second as a fraction of the memory
    bandwidth, and its FLOPs per second as a fraction of the peak.

    >>> utilization(flops=2e9, nbytes=1e9, seconds=0.01, peak_flops=1e12, bandwidth=2e11)
    (0.5, 0.2)
    """
    return nbytes / seconds / bandwidth, flops / seconds / peak_flops


@dataclasses.dataclass(frozen=True)
class Roofline(Slots):
    """The roofline's formulas: chapter 06's decode step and sequences that fit, chapter 10's general count.
    `model_decode_step` and the benchmarks take a `decode_step`; `predict` runs the rest."""

    decode_step: Callable = decode_step
    max_sequences: Callable = max_sequences
    gpu_roof: Callable = gpu_roof
    matrix_bytes: Callable = matrix_bytes
    step_cost: Callable = step_cost
    roofline_time: Callable = roofline_time
    critical_batch: Callable = critical_batch
    utilization: Callable = utilization


class Prediction(NamedTuple):
    """What the roofline predicts for a step: tokens per second (the new positions of every sequence), the step's
    least time and cost, where it sits (`RooflineTime`), and — given a measured time — MBU and MFU."""

    tokens_per_s: float
    seconds: float
    cost: StepCost
    roof: RooflineTime
    mbu: Optional[float] = None
    mfu: Optional[float] = None


def predict(
    shape: ModelShape,
    machine: tuple[float, float],
    *,
    batch: int = 1,
    new_tokens: int = 1,
    context: int = 0,
    weights: str = "float16",
    dtype: str = "float16",
    measured_seconds: Optional[float] = None,
    table: Roofline = Roofline(),
) -> Prediction:
    """The roofline's prediction for a step on a machine (peak FLOP/s, bandwidth), by the functions of `table` (a
    learner's, in chapter 10): a decode step by default, a prefill with `new_tokens` = the prompt's length.

    >>> p = predict(SHAPES["GPT-2 124M"], (989e12, 3.35e12), context=1024, measured_seconds=1e-3)
    >>> round(p.tokens_per_s), p.roof.bound, round(p.mbu, 2)
    (11740, 'memory', 0.09)
    """
    cost = table.step_cost(shape, batch, new_tokens, context, weights, dtype)
    roof = table.roofline_time(cost.flops, cost.bytes, *machine)
    mbu = mfu = None
    if measured_seconds is not None:
        mbu, mfu = table.utilization(cost.flops, cost.bytes, measured_seconds, *machine)
    return Prediction(batch * new_tokens / roof.seconds, roof.seconds, cost, roof, mbu, mfu)
