"""The roofline: what bounds a forward step of a decoder, kernel by kernel, from two numbers of a machine.

A kernel reads and writes bytes (a weight matrix, the sequences' KV caches, activation rows) and does FLOPs (a
multiply-add, 2 FLOPs, per weight per row; attention's per cached position). Its time is at least the larger of
bytes ÷ memory bandwidth and FLOPs ÷ peak FLOP/s: the roofline of Williams, Waterman & Patterson (2009),
*Roofline: An Insightful Visual Performance Model for Multicore Architectures*. Their ratio, FLOPs per byte, is the
kernel's arithmetic intensity; the machine's peak ÷ bandwidth, its ridge point. The roofline judges one kernel at a
time: a step runs its kernels one after another, so its least time is the sum of theirs (`step_time`). The weight
products' intensity grows with the batch (the rows share each weight read); decode attention's does not (each
sequence reads its own cache), so at large batches the products turn compute-bound while attention stays
memory-bound — one roofline point for the whole step would average the two away.

Chapter 06's learners write `decode_step` and `max_sequences` (weights and caches only, one decode step);
chapter 10's `gpu_roof`, `matrix_bytes`, `gemm_cost`, `attention_cost`, `roofline_time`, `step_time`,
`critical_batch` and `utilization`. `Roofline` holds them all; `predict` runs a table of them, and
`python -m llmcourse bench` and the capstone's benchmark report the engine's speed against it (MBU and MFU beside
tokens/s). No generation runs them.

    >>> p = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), context=8192)     # fp16, one token, batch 1
    >>> p.compute_bound(), round(p.tokens_per_s)          # every kernel waits on memory: the weights' read time
    ([], 208)
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


def _layer_matrices(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """{name: (rows, cols) = (outputs, inputs)} of each matrix a layer multiplies by: q, k, v, o and the MLP's."""
    C, H, Hkv, D, F = shape.n_embd, shape.n_head, shape.n_kv_head, shape.head_dim, shape.d_ff
    mlp = {"gate": (F, C), "up": (F, C), "down": (C, F)} if shape.mlp == "swiglu" else {"up": (F, C), "down": (C, F)}
    return {"q": (H * D, C), "k": (Hkv * D, C), "v": (Hkv * D, C), "o": (C, H * D), **mlp}


def _matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """(outputs, inputs) of every matrix a step multiplies by: each layer's, then the output head."""
    return list(_layer_matrices(shape).values()) * shape.n_layer + [(shape.vocab_size, shape.n_embd)]


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
    dense matrix products never reach. Apple publishes its GPUs' memory bandwidth and its Neural Engine's TOPS,
    but no GPU FLOP/s: `peak_flops` None."""

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


class Cost(NamedTuple):
    """What one kernel costs: its FLOPs and the bytes it moves between memory and the processor."""

    flops: float
    bytes: float


class Kernel(NamedTuple):
    """One kind of kernel of a step, over all the layers it runs in: its name ("q", "k", "v", "o", "gate", "up",
    "down", "attention", "elementwise", "head"), FLOPs and bytes. The layers run one after another, so a kernel's
    time over the layers is the layers' count times one layer's: the roofline can judge the total."""

    name: str
    flops: float
    bytes: float


def gemm_cost(rows: int, outputs: int, inputs: int, weights: str = "float16", dtype: str = "float16") -> Cost:
    """FLOPs and bytes of one weight product: `rows` activation rows [rows, inputs] (in `dtype`) times a matrix
    [outputs, inputs] stored in format `weights`. A multiply-add (2 FLOPs) per weight per row; the matrix is read
    once, whatever the rows (they share the read), its input rows read and its output rows written.

    >>> gemm_cost(1, 4096, 4096, "bfloat16", "bfloat16")      # one row: the matrix's 32 MiB for 33.6 MFLOP
    Cost(flops=33554432, bytes=33570816)
    """
    return Cost(
        2 * rows * outputs * inputs,
        matrix_bytes(outputs, inputs, weights, dtype) + rows * (inputs + outputs) * FLOAT_BYTES[dtype],
    )


def attention_cost(shape: "ModelShape", batch: int, new_tokens: int, context: int, dtype: str = "float16") -> Cost:
    """FLOPs and bytes of attention in all the layers of a step: `batch` sequences each run `new_tokens` new
    positions after `context` cached ones, the cache in `dtype`.

    - FLOPs: 4 per head dimension for each (query, attended position) pair of each query head — 2 for the score
      q·k, 2 for adding p·v — where new position i (from 0) attends to context + i + 1 positions (causal).
    - bytes: each sequence's keys and values of the context + new_tokens positions it attends to, read once per
      KV head (grouped-query attention: the n_head / n_kv_head query heads of a group share the read), and its
      new positions' keys and values written; the queries read and the output written.

    Its intensity, at decode (one new position) over a long context: 4·H·D FLOPs per position for 2·H_kv·D
    values, 2·(H / H_kv) / bytes-per-value FLOPs per byte whatever the batch: about 4 for Llama-3-8B in bf16.

    >>> attention_cost(SHAPES["Llama-3-8B"], batch=1, new_tokens=1, context=1023, dtype="bfloat16")
    Cost(flops=536870912, bytes=134873088)
    """
    L, H, Hkv, D = shape.n_layer, shape.n_head, shape.n_kv_head, shape.head_dim
    value = FLOAT_BYTES[dtype]
    attended = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # per sequence and query head
    flops = 4 * L * H * D * batch * attended
    kv_values = 2 * L * Hkv * D * batch * (context + 2 * new_tokens)  # read what it attends to, write the new
    query_values = 2 * L * H * D * batch * new_tokens  # the queries read, the output written
    return Cost(flops, (kv_values + query_values) * value)


def elementwise_cost(shape: "ModelShape", rows: int, dtype: str = "float16") -> Cost:
    """Bytes of the elementwise kernels of a step's `rows` rows in all layers: each layer's two norms (read and
    write a row each), its two residual additions (read two rows, write one) and the MLP's activation (GELU reads
    and writes a hidden row; SwiGLU reads two, writes one), and the final norm. Their few FLOPs per value are not
    counted (0): these kernels are memory-bound on every machine.

    >>> elementwise_cost(ModelShape(1, 4, 1, 1, 4, 16, 10), rows=1, dtype="float32")   # (4+4+4+4+12+16+16+8) × 4
    Cost(flops=0, bytes=320)
    """
    C, F = shape.n_embd, shape.d_ff
    activation = 3 * F if shape.mlp == "swiglu" else 2 * F
    per_row = shape.n_layer * (2 * 2 * C + 2 * 3 * C + activation) + 2 * C
    return Cost(0, rows * per_row * FLOAT_BYTES[dtype])


def step_kernels(
    shape: "ModelShape",
    batch: int,
    new_tokens: int,
    context: int,
    weights: str = "float16",
    dtype: str = "float16",
    *,
    gemm_cost: Callable = gemm_cost,
    attention_cost: Callable = attention_cost,
) -> list[Kernel]:
    """The kernels of one forward step, each over all the layers: the weight products (q, k, v, o and the MLP's),
    attention, the elementwise kernels and the output head. `batch` sequences each run `new_tokens` new positions
    after `context` cached ones; weights in format `weights`, activations and cache in `dtype`. `gemm_cost` and
    `attention_cost` may be a learner's.

    >>> [k.name for k in step_kernels(SHAPES["Llama-3-8B"], 1, 1, 0)]
    ['q', 'k', 'v', 'o', 'gate', 'up', 'down', 'attention', 'elementwise', 'head']
    """
    rows, L = batch * new_tokens, shape.n_layer
    kernels = []
    for name, (outputs, inputs) in _layer_matrices(shape).items():
        one = gemm_cost(rows, outputs, inputs, weights, dtype)
        kernels.append(Kernel(name, L * one[0], L * one[1]))
    kernels.append(Kernel("attention", *attention_cost(shape, batch, new_tokens, context, dtype)))
    kernels.append(Kernel("elementwise", *elementwise_cost(shape, rows, dtype)))
    kernels.append(Kernel("head", *gemm_cost(rows, shape.vocab_size, shape.n_embd, weights, dtype)))
    return kernels


class RooflineTime(NamedTuple):
    """Where a kernel sits on a machine's roofline: its least time, the limit that sets it, its FLOPs per byte
    and the machine's."""

    seconds: float
    bound: str  # "memory" or "compute"
    intensity: float  # FLOPs per byte of the kernel
    ridge: float  # FLOPs per byte where the machine's two limits meet: peak_flops / bandwidth


def roofline_time(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> RooflineTime:
    """The least time of a kernel of `flops` FLOPs and `nbytes` bytes: the larger of bytes ÷ bandwidth and FLOPs ÷
    peak ("memory" when they are equal), with the kernel's arithmetic intensity and the machine's ridge point.

    >>> roofline_time(2e9, 2e9, peak_flops=1e12, bandwidth=1e11)
    RooflineTime(seconds=0.02, bound='memory', intensity=1.0, ridge=10.0)
    """
    memory, compute = nbytes / bandwidth, flops / peak_flops
    intensity = flops / nbytes if nbytes else math.inf
    seconds, bound = (compute, "compute") if compute > memory else (memory, "memory")
    return RooflineTime(seconds, bound, intensity, peak_flops / bandwidth)


class StepTime(NamedTuple):
    """A step's least time, the sum of its kernels' (they run one after another), and each kernel's
    `RooflineTime`, in the order of the kernels."""

    seconds: float
    kernels: list[RooflineTime]


def step_time(kernels: list, peak_flops: float, bandwidth: float) -> StepTime:
    """The least time of a step made of `kernels` (each with .flops and .bytes, or a (name, flops, bytes)
    tuple): each judged on its own roofline, the step's time the sum of theirs. One roofline point for the whole
    step (its summed FLOPs over its summed bytes) hides a compute-bound kernel behind memory-bound ones.

    >>> t = step_time([Kernel("big product", 2e10, 1e9), Kernel("cache reads", 1e9, 1e9)], 1e12, 1e11)
    >>> round(t.seconds, 6), [k.bound for k in t.kernels]      # one point (21 GFLOP, 2 GB) would say 0.021 s
    (0.03, ['compute', 'memory'])
    """
    times = [roofline_time(k[1], k[2], peak_flops, bandwidth) for k in kernels]
    return StepTime(sum(t.seconds for t in times), times)


def critical_batch(
    shape: "ModelShape",
    weights: str,
    dtype: str,
    peak_flops: float,
    bandwidth: float,
    max_batch: int = 1 << 20,
) -> Optional[int]:
    """The smallest batch at which every weight product of a decode step (one new position per sequence: the
    batch is the product's rows) is compute-bound on `roofline_time`, or None if some product is memory-bound at
    every batch up to `max_batch`. Attention is not a weight product: each sequence reads its own cache, so its
    intensity does not grow with the batch, and the context does not enter.

    A product [outputs, inputs] does 2·B·outputs·inputs FLOPs for its weights' bytes plus B·(inputs + outputs)
    activation values: its intensity rises with B towards 2·outputs·inputs / ((inputs + outputs)·bytes per value),
    lowest for the thinnest matrix — grouped-query attention's k and v.

    >>> critical_batch(SHAPES["Llama-3-8B"], "bfloat16", "bfloat16", 989e12, 3.35e12)
    462
    """

    def compute_bound(batch: int, outputs: int, inputs: int) -> bool:
        cost = gemm_cost(batch, outputs, inputs, weights, dtype)
        return roofline_time(cost.flops, cost.bytes, peak_flops, bandwidth).bound == "compute"

    needed = 1
    for outputs, inputs in set(_matrices(shape)):
        if not compute_bound(max_batch, outputs, inputs):  # intensity rises with the batch: the test is monotone
            return None
        low, high = 0, max_batch  # memory-bound at low (0 rows: the weights read for nothing), compute at high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if compute_bound(middle, outputs, inputs) else (middle, high)
        needed = max(needed, high)
    return needed


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
    """The roofline's formulas: chapter 06's decode step and sequences that fit, chapter 10's per-kernel count.
    `model_decode_step` takes a `decode_step`; `predict` runs the rest."""

    decode_step: Callable = decode_step
    max_sequences: Callable = max_sequences
    gpu_roof: Callable = gpu_roof
    matrix_bytes: Callable = matrix_bytes
    gemm_cost: Callable = gemm_cost
    attention_cost: Callable = attention_cost
    roofline_time: Callable = roofline_time
    step_time: Callable = step_time
    critical_batch: Callable = critical_batch
    utilization: Callable = utilization


class Prediction(NamedTuple):
    """What the roofline predicts for a step: tokens per second (the new positions of every sequence), the step's
    least time (the sum of its kernels'), its kernels and where each sits (`RooflineTime`), and — given a
    measured time — MBU and MFU of the whole step."""

    tokens_per_s: float
    seconds: float
    kernels: list[Kernel]
    times: list[RooflineTime]
    mbu: Optional[float] = None
    mfu: Optional[float] = None

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)

    def time_of(self, *names: str) -> float:
        """Seconds of the kernels named (all the weight products: "q", "k", "v", "o", "gate", "up", "down")."""
        return sum(t.seconds for k, t in zip(self.kernels, self.times) if k.name in names)

    def compute_bound(self) -> list[str]:
        """The names of the kernels arithmetic bounds."""
        return [k.name for k, t in zip(self.kernels, self.times) if t.bound == "compute"]


def predict(
    shape: ModelShape,
    machine: tuple[float, float],
    *,
    batch: int = 1,
    new_tokens: int = 1,
    context: int = 0,
    weights: str = "float16",
    dtype: str = "float16",
    last_only: bool = False,
    measured_seconds: Optional[float] = None,
    table: Roofline = Roofline(),
) -> Prediction:
    """The roofline's prediction for a step on a machine (peak FLOP/s, bandwidth) by the functions of `table` (a
    learner's, in chapter 10): `step_kernels` with its `gemm_cost` and `attention_cost`, then its `step_time` and
    `utilization`. A decode step by default; a prefill with `new_tokens` = the prompt's length, and `last_only`
    when only the last position's logits are computed (the engine's generation: the head multiplies one row per
    sequence).

    >>> p = predict(SHAPES["Llama-3-8B"], (989e12, 3.35e12), batch=1024, context=1024, weights="bfloat16",
    ...             dtype="bfloat16")
    >>> round(p.seconds * 1e3, 1), p.compute_bound()
    (58.5, ['q', 'k', 'v', 'o', 'gate', 'up', 'down', 'head'])
    """
    kernels = step_kernels(
        shape,
        batch,
        new_tokens,
        context,
        weights,
        dtype,
        gemm_cost=table.gemm_cost,
        attention_cost=table.attention_cost,
    )
    if last_only:
        kernels[-1] = Kernel("head", *table.gemm_cost(batch, shape.vocab_size, shape.n_embd, weights, dtype))
    step = table.step_time(kernels, *machine)
    mbu = mfu = None
    if measured_seconds is not None:
        flops, nbytes = sum(k.flops for k in kernels), sum(k.bytes for k in kernels)
        mbu, mfu = table.utilization(flops, nbytes, measured_seconds, *machine)
    return Prediction(batch * new_tokens / step.seconds, step.seconds, kernels, step.kernels, mbu, mfu)
