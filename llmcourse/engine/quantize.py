"""Weight quantization: GPT-2's weights in 8 or 4 bits, and the linear layers that use them.

Decoding one token reads every weight once, so a step's time is bounded by bytes of weights over
memory bandwidth: fewer bytes per weight, faster decode, and a smaller model in memory.

- **int8**: each output row of a weight matrix [C_out, C_in] gets one scale, max|row| / 127, and its
  values become round(w / scale), integers in [-127, 127] (`quantize_int8`).
- **int4**: each group of 32 consecutive inputs of a row gets its own scale, by llama.cpp's Q4_0 rule: the
  value of largest magnitude m maps to -8, so scale = m / -8 and the values are round(w / scale)
  clamped to [-8, 7]; two 4-bit values share a byte, the first in the low nibble (`quantize_int4`,
  `pack_int4`). The scales are stored in float16: 4.5 bits per weight. (The byte layout is the course's
  own: ggml's Q4_0 stores q + 8, pairs element j with j + 16, and keeps each scale inside an 18-byte block.)

Every linear layer of the blocks, and the token table (which is also the tied output head; a row
per token, so the head's output rows are the table's rows), are quantized; the layer norms, biases
and position table stay in the model's float dtype (0.1 % of the weights).

How a quantized layer multiplies on a CPU: the input rows are quantized to int8 too (absmax per row,
as CTranslate2 does), the products of integers are summed exactly in integers and then scaled (`int8_linear`,
the integer route); for a few rows (decoding) by the C kernels of `cpu_kernels` (int4: llama.cpp's Q4_0 dot
product), for many (prefill) by `torch._int_mm` (int8) or a float matmul on the dequantized weights (int4).
Exact integer sums make a row's result independent of the other rows of a batch (int8 at any size, int4 up to 16
rows), and the int8 routes give `int8_linear`'s numbers bit for bit. On a GPU the weights are converted to the
float dtype inside the matmul (weight-only, as gpt-fast does), which torch.compile fuses into one kernel.

Per-token activation scales are where outlier channels hurt (a few input channels 10-100x the rest set every
token's scale): `quantize_model(..., calibration=ids)` first smooths the blocks' layers as SmoothQuant does
(`smooth_scales`, `activation_absmax`), dividing each input channel by a factor and multiplying the weight's
column by it.

    >>> w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
    >>> q, scale = quantize_int8(w)
    >>> q
    tensor([[  64, -127,   32],
            [   0,    0,    0]], dtype=torch.int8)
    >>> dequantize_int8(q, scale)
    tensor([[ 0.5039, -1.0000,  0.2520],
            [ 0.0000,  0.0000,  0.0000]])
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .llama import Linear
from .model import Affine
from .slots import Slots

FORMATS = ("int8", "int4")
GROUP_SIZE = 32  # int4: inputs per scale
BYTES_PER_WEIGHT = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5 + 2 / GROUP_SIZE}


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Absmax per row: w [N, K] float -> (q [N, K] int8 in [-127, 127], scale [N] float32), w ≈ q * scale[:, None].
    An all-zero row gets scale 0 and q 0."""
    w = w.float()
    scale = w.abs().amax(dim=-1) / 127  # [N]
    q = torch.round(w / torch.where(scale == 0, 1.0, scale)[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q [N, K] int8, scale [N] -> w [N, K] float32."""
    return q.float() * scale.float()[:, None]


def pack_int4(q: Tensor) -> Tensor:
    """Two 4-bit values per byte: q [..., K] int8 in [-8, 7], K even -> [..., K // 2] uint8; value 2i in the
    low nibble of byte i, value 2i + 1 in the high nibble (two's complement: -1 is 0b1111)."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of values in the last dimension, got {q.shape[-1]}")
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)  # [..., K]
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of `pack_int4`: [..., K // 2] uint8 -> [..., K] int8 in [-8, 7]."""
    low, high = packed & 0xF, packed >> 4
    values = torch.stack([low, high], dim=-1).flatten(-2).to(torch.int8)  # [..., K], 0..15
    return values - 16 * (values >= 8).to(torch.int8)  # nibbles 8..15 are -8..-1


def quantize_int4(w: Tensor, group_size: int = GROUP_SIZE, *, pack: Callable = pack_int4) -> tuple[Tensor, Tensor]:
    """Groups of `group_size` along each row (Q4_0): w [N, K] -> (packed [N, K // 2] uint8,
    scales [N, K // group_size] float16).
    In each group the value of largest magnitude m becomes -8: scale = m / -8, q = clamp(round(w / scale), -8, 7)."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"quantize_int4 needs rows whose length ({K}) is a multiple of the group size ({group_size})")
    groups = w.float().view(N, K // group_size, group_size)
    extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))  # [N, G, 1], signed
    scales = (extreme / -8).half()  # rounded to what is stored, then used to quantize
    s = scales.float()
    q = torch.round(groups / torch.where(s == 0, 1.0, s)).clamp(-8, 7).to(torch.int8)
    return pack(q.view(N, K)), scales.view(N, -1)


def dequantize_int4(packed: Tensor, scales: Tensor, *, unpack: Callable = unpack_int4) -> Tensor:
    """packed [N, K // 2] uint8, scales [N, G] -> w [N, K] float32 (group size K // G)."""
    q = unpack(packed).float()  # [N, K]
    N, K = q.shape
    return (q.view(N, scales.shape[1], -1) * scales.float()[..., None]).view(N, K)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The integer route: y ≈ x @ (q * scale[:, None]).T + bias, x [..., K], q [N, K] int8, scale [N] -> [..., N] in
    x's dtype. Each row of x (a token) is quantized to int8 with its own absmax scale s_x (`quantize_int8`), the
    int8 x int8 products are summed exactly in int32, and each sum is scaled once by s_x · scale:
    y[m, n] = float(Σ_k xq[m, k] q[n, k]) · (s_x[m] · scale[n]) + bias[n]. Exact sums and a scale per row make a
    row's result independent of the other rows of the batch."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    xq, xs = quantize_int8(rows)  # [M, K] int8, [M] float32
    sums = xq.to(torch.int32) @ q.to(torch.int32).T  # [M, N], exact: |sum| <= 127 * 127 * K
    y = sums.float() * (xs[:, None] * scale.float())  # [M, N] float32
    y = y.to(x.dtype).view(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias


def weight_memory(n_params: float, fmt: str) -> float:
    """Bytes taken by `n_params` weights in `fmt` ('float32', 'float16', 'bfloat16', 'int8' or 'int4' in groups
    of 32 with a float16 scale each): 7e9 weights in int4 are 7e9 * (0.5 + 2 / 32) bytes ≈ 3.9 GB."""
    if fmt not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(BYTES_PER_WEIGHT)}")
    return n_params * BYTES_PER_WEIGHT[fmt]


def smooth_scales(act_absmax: Tensor, weight: Tensor, alpha: float = 0.5) -> Tensor:
    """SmoothQuant's factors (Xiao et al. 2023), one per input channel: act_absmax [K] (max |x_j| seen over some
    tokens), weight [N, K] (rows are outputs) -> s [K] float32, s_j = act_absmax_j^alpha / max_n |w_nj|^(1 - alpha).
    Dividing x's channel j by s_j and multiplying W's column j by it leaves x @ W.T as it was, and moves an outlier
    channel's range from the activations into the weights. A channel with a zero maximum gets s_j = 1.

        >>> smooth_scales(torch.tensor([100.0, 1.0, 0.0]), torch.tensor([[1.0, 4.0, 2.0]]))
        tensor([10.0000,  0.5000,  1.0000])
    """
    a = act_absmax.float()  # [K]
    w = weight.float().abs().amax(dim=0)  # [K]: the largest weight each input channel meets
    s = a.pow(alpha) / w.pow(1 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


# -- fast routes: the same products as the reference, computed with fewer bytes read ---------------


INT8_MM_ON_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")
TINYGEMM_TILES = 8  # int4 on CUDA: torch's tinygemm layout, K in tiles of 8 * 16 inputs (gpt-fast's choice)
KERNEL_ROWS = 16  # up to this many rows (decode, batches) the C kernels; more (prefill): library routes


def int8_linear_fast(x: Tensor, q: Tensor, scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """`int8_linear` on CPU: input rows quantized per row (absmax) too, int8 x int8 -> exact int32 sums, times both
    scales: up to KERNEL_ROWS rows with `cpu_kernels.int8_linear`, more with torch._int_mm (oneDNN); the sums are
    exact integers either way, so both give the same numbers. On CUDA: the weight converted inside the matmul."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.is_cuda:
        if x.dtype in (torch.bfloat16, torch.float16) and INT8_MM_ON_CUDA:  # int8 weights read once, in the kernel
            y = torch._weight_int8pack_mm(rows, q, scale.to(x.dtype)).view(*x.shape[:-1], q.shape[0])
        else:  # converted inside the matmul: torch.compile fuses the conversion into the product's kernel
            y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    if use_kernel(rows, q, scale, bias) and rows.shape[1] % 32 == 0:
        return cpu_kernels.int8_linear(rows.contiguous(), q, scale, bias).view(*x.shape[:-1], q.shape[0])
    xq, xs = quantize_int8(rows)
    y = cpu_kernels.in_column_chunks(
        lambda c: torch._int_mm(xq, q[c].T).float() * (xs[:, None] * scale[c].float()), q.shape[0]
    )  # [M, N]
    y = y.to(x.dtype).view(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias


def use_kernel(rows: Tensor, weight: Tensor, scales: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether rows [M, K] on the CPU go through the C kernels: few rows, float32 (int8: float32 scales), weights
    stored row by row, not while torch.compile traces, and the kernels built."""
    float32 = rows.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32 and bias.is_contiguous())
    return (
        rows.shape[0] <= KERNEL_ROWS
        and float32
        and (weight.dtype == torch.uint8 or scales.dtype == torch.float32)
        and weight.is_contiguous()
        and scales.is_contiguous()
        and not torch.compiler.is_compiling()
        and cpu_kernels.library() is not None
    )


def int4_linear_fast(x: Tensor, packed: Tensor, scales: Tensor, bias: Optional[Tensor]) -> Tensor:
    """y = x @ dequantize_int4(packed, scales).T + bias, x [..., K] -> [..., N]. On CPU the input rows are
    quantized to int8 as for int8 layers, and up to KERNEL_ROWS rows go through `cpu_kernels.int4_linear`
    (the packed bytes are read once; exact integer sums per group). On CUDA: dequantize, then multiply."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.is_cuda:
        y = F.linear(rows, dequantize_int4(packed, scales).to(x.dtype))
    elif use_kernel(rows, packed, scales, bias):
        return cpu_kernels.int4_linear(rows.contiguous(), packed, scales, bias).view(*x.shape[:-1], packed.shape[0])
    else:  # the kernel's numbers up to the order of the sums: same quantized inputs, same products
        rows = dequantize_int8(*quantize_int8(rows))
        if (
            not torch.compiler.is_compiling()
            and packed.is_contiguous()
            and scales.is_contiguous()
            and cpu_kernels.library() is not None
        ):
            rows, weight = cpu_kernels.in_group_order(rows), cpu_kernels.int4_dequantized(packed, scales)
            y = cpu_kernels.in_column_chunks(lambda c: F.linear(rows, weight[c]), packed.shape[0])
        else:
            y = F.linear(rows, dequantize_int4(packed, scales))
        y = y.to(x.dtype)
    y = y.view(*x.shape[:-1], packed.shape[0])
    return y if bias is None else y + bias


def tinygemm_layout(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Int4 weights in the layout of torch's tinygemm kernel (`torch._weight_int4pack_mm` on CUDA, bfloat16):
    packed [N, K/2] (the course's: value 2i in the low nibble, signed) -> (bytes [N, K/2] uint8 with value 2i in
    the high nibble, as unsigned q + 8; to be given to `torch._convert_weight_to_int4pack`, scales_and_zeros
    [K/32, N, 2] bfloat16). tinygemm computes w = (u - 8) * scale + zero: the course's q * scale with zero 0.

        >>> b, sz = tinygemm_layout(pack_int4(torch.tensor([[-8, 7]], dtype=torch.int8)), torch.ones(1, 1).half())
        >>> b.tolist(), sz.shape
        ([[15]], torch.Size([1, 1, 2]))
    """
    u = (unpack_int4(packed).to(torch.int32) + 8).to(torch.uint8)  # [N, K] in 0 … 15
    high_first = (u[:, ::2] << 4) | u[:, 1::2]  # [N, K/2]
    scale = scales.to(torch.bfloat16).T  # [K/32, N]
    return high_first.contiguous(), torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()


def tinygemm_fits(layer: "QuantizedAffine") -> bool:
    """Whether an int4 layer on CUDA can use tinygemm: N a multiple of 8, K of TINYGEMM_TILES * 16."""
    n_out, n_in = layer.qweight.shape[0], layer.qweight.shape[1] * 2
    return layer.format == "int4" and layer.qweight.is_cuda and n_out % 8 == 0 and n_in % (TINYGEMM_TILES * 16) == 0


# -- the modules a quantized model is made of ---------------------------------------------------------


class QuantizedAffine(nn.Module):
    """A linear layer with quantized weights (it replaces GPT-2's `model.Affine` or the Llama family's
    `llama.Linear`). Rows are outputs, as in `nn.Linear`: int8 `qweight` [C_out, C_in] with `scales` [C_out];
    int4 `qweight` [C_out, C_in // 2] (two per byte) with `scales` [C_out, C_in // 32] float16. `bias` [C_out]
    keeps the float dtype.
    It computes with `quantization`'s functions (the engine's own unless `quantize_model` was given others).
    `smooth` [C_in] (None unless `quantize_model` was given a calibration): SmoothQuant's factors, the input divided
    by them before the quantized product (the weight's columns were multiplied by them before quantizing)."""

    def __init__(self, n_in: int, n_out: int, fmt: str, quantization: Optional["Quantization"] = None):
        super().__init__()
        self.format = check_format(fmt)
        self.quantization = quantization or Quantization()
        int8 = fmt == "int8"
        self.register_buffer(
            "qweight", torch.zeros(n_out, n_in if int8 else n_in // 2, dtype=torch.int8 if int8 else torch.uint8)
        )
        self.register_buffer(
            "scales", torch.zeros(n_out) if int8 else torch.zeros(n_out, n_in // GROUP_SIZE, dtype=torch.float16)
        )
        self.register_buffer("bias", torch.zeros(n_out))
        self.register_buffer("smooth", None)
        self.tinygemm = self.tinygemm_scales = None  # int4 on CUDA: the weights in tinygemm's layout (`prepare`)

    def forward(self, x: Tensor, linear: Optional[Callable] = None) -> Tensor:
        """x [..., C_in] -> [..., C_out]. (`linear`, the float layers' part, is not what a quantized layer runs.)"""
        if self.smooth is not None:
            x = x / self.smooth  # [..., C_in]: outlier channels brought down to the others' range
        return self.product(x, self.bias)

    def product(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """x [..., C_in] times the weights (+ bias) -> [..., C_out]: tinygemm for bfloat16 on CUDA where the layer
        holds its layout (and the engine's own int4 functions), else `quantization.linear`."""
        if (
            self.tinygemm is not None
            and x.dtype == torch.bfloat16
            and self.quantization.dequantize_int4 is dequantize_int4
        ):
            y = torch._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.tinygemm, GROUP_SIZE, self.tinygemm_scales)
            y = y.view(*x.shape[:-1], -1)  # [..., C_out]: the packed weights read once, in the kernel
            return y if bias is None else y + bias
        return self.quantization.linear(x, self, bias)

    def prepare(self) -> None:
        """On CUDA, int4 layers that fit also hold their weights in tinygemm's layout (`tinygemm_layout`; bfloat16
        models use it), which `torch._convert_weight_to_int4pack` tiles for the tensor cores. Called when the
        weights are set or moved."""
        self.tinygemm = self.tinygemm_scales = None
        if tinygemm_fits(self):
            high_first, self.tinygemm_scales = tinygemm_layout(self.qweight, self.scales)
            self.tinygemm = torch._convert_weight_to_int4pack(high_first, TINYGEMM_TILES)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` converts the float buffers, but int4 scales stay float16 (the format's)."""
        super()._apply(fn, recurse)
        if self.format == "int4" and self.scales.dtype != torch.float16:
            self.scales = self.scales.half()
        self.prepare()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.prepare()


class QuantizedTable(QuantizedAffine):
    """The token table [vocab_size, C] quantized by rows (a row per token), which is also the tied head."""

    def __init__(self, n: int, dim: int, fmt: str, quantization: Optional["Quantization"] = None):
        super().__init__(dim, n, fmt, quantization)
        del self.bias

    def forward(self, ids: Tensor, embedding: Optional[Callable] = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """Token embeddings: ids [B, T] -> [B, T, C] in `dtype`."""
        return self.quantization.rows(self, ids, dtype)

    def logits(self, x: Tensor) -> Tensor:
        """The tied head: x [..., C] -> [..., vocab_size]."""
        return self.product(x, None)


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"quantize={fmt!r} is not a format; use 'int8' or 'int4' (or None for the float weights)")
    return fmt


@dataclasses.dataclass(frozen=True)
class Quantization(Slots):
    """The functions a quantized model is built and run with (chapter 09): `quantize_model(model, fmt,
    quantization)` builds the layers with them, and each quantized layer keeps them for its forward pass.
    The engine's own `int8_linear` takes a faster route to the same numbers (`int8_linear_fast`); `smooth_scales`
    runs only when `quantize_model` is given a calibration."""

    quantize_int8: Callable = quantize_int8
    dequantize_int8: Callable = dequantize_int8
    pack_int4: Callable = pack_int4
    unpack_int4: Callable = unpack_int4
    quantize_int4: Callable = quantize_int4
    dequantize_int4: Callable = dequantize_int4
    int8_linear: Callable = int8_linear
    smooth_scales: Callable = smooth_scales

    def linear(self, x: Tensor, layer: QuantizedAffine, bias: Optional[Tensor] = None) -> Tensor:
        """x [..., C_in] through a quantized layer -> [..., C_out]."""
        if layer.format == "int8":
            fn = int8_linear_fast if self.int8_linear is int8_linear else self.int8_linear
            return fn(x, layer.qweight, layer.scales, bias)
        if self.dequantize_int4 is dequantize_int4:
            return int4_linear_fast(x, layer.qweight, layer.scales, bias)
        return F.linear(x, self.dequantize_int4(layer.qweight, layer.scales).to(x.dtype), bias)

    def rows(self, table: QuantizedTable, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Token embeddings from a quantized table: ids [B, T] -> [B, T, C]."""
        q, s = table.qweight[ids.flatten()], table.scales[ids.flatten()]
        w = self.dequantize_int8(q, s) if table.format == "int8" else self.dequantize_int4(q, s)
        return w.to(dtype).view(*ids.shape, -1)

    def quantize(self, weight: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
        """(qweight, scales) of a float weight [N, K] (rows are outputs)."""
        return self.quantize_int8(weight) if fmt == "int8" else self.quantize_int4(weight)


def quantize_model(
    model, fmt: str, quantization: Optional[Quantization] = None, *, calibration=None, alpha: float = 0.5
):
    """Replace `model`'s linear layers and token table by quantized ones made and run with `quantization`'s
    functions (the engine's own by default), in place; returns the model.

    With `calibration` (token ids, [T] or [B, T]), the blocks' linear layers are smoothed first (SmoothQuant): one
    forward pass over those tokens records each layer's largest input per channel, `quantization.smooth_scales(
    that [C_in], the weight [C_out, C_in], alpha)` gives a factor per input channel, the weight's columns are
    multiplied by it before quantizing and the layer divides its input by it (`QuantizedAffine.smooth`).

        >>> from llmcourse.engine.model import GPT2, GPT2Config
        >>> config = GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=100)
        >>> model = quantize_model(GPT2(config).init_weights(), "int4")
        >>> c_fc = model.h[0].mlp.c_fc
        >>> c_fc.qweight.shape, c_fc.scales.shape   # [C_out, C_in / 2], [C_out, C_in / 32]
        (torch.Size([256, 32]), torch.Size([256, 2]))
    """
    check_format(fmt)
    current = quantized_format(model)
    if current == fmt:
        return model
    if current:
        raise ValueError(
            f"this model is already quantized to {current}; load the float checkpoint to quantize it again"
        )
    qz = quantization or Quantization()
    absmax = activation_absmax(model, calibration) if calibration is not None else {}
    with torch.no_grad():
        for parent, name, old in affine_layers(model):
            weight = out_in(old)  # [C_out, C_in]
            layer = QuantizedAffine(weight.shape[1], weight.shape[0], fmt, qz)
            if old in absmax:
                layer.smooth = qz.smooth_scales(absmax[old], weight, alpha).to(model.dtype)  # [C_in]
                weight = (weight.float() * layer.smooth.float()).to(weight.dtype)  # W' = W diag(s)
            setattr(parent, name, filled(layer, *qz.quantize(weight, fmt), old.bias, model.dtype))
        table = QuantizedTable(model.config.vocab_size, model.config.n_embd, fmt, qz)
        weight = getattr(model, model.token_table).weight  # [vocab_size, C]
        setattr(model, model.token_table, filled(table, *qz.quantize(weight, fmt), None, model.dtype))
    return model


def activation_absmax(model, ids) -> dict:
    """One forward pass of the float `model` over token ids ([T] or [B, T]) -> {layer: the largest |input| of each
    of its input channels, [C_in] float32} for every linear layer of the blocks."""
    absmax: dict = {}

    def record(layer, args):
        seen = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(dim=0)  # [C_in]
        absmax[layer] = torch.maximum(absmax[layer], seen) if layer in absmax else seen

    hooks = [layer.register_forward_pre_hook(record) for _, _, layer in affine_layers(model)]
    try:
        with torch.inference_mode():
            ids = torch.as_tensor(ids, device=model.device)
            model(ids if ids.dim() == 2 else ids[None])
    finally:
        for hook in hooks:
            hook.remove()
    return absmax


def quantized_format(model) -> Optional[str]:
    """'int8' or 'int4' for a model whose weights `quantize_model` (or loading a quantized folder) quantized,
    else None."""
    table = getattr(model, model.token_table)
    return table.format if isinstance(table, QuantizedTable) else None


def affine_layers(model):
    """(parent module, attribute name, layer) of every float linear layer: the blocks' (and an untied head)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, (Affine, Linear))
    ]


def out_in(layer) -> Tensor:
    """A float linear layer's weight as [C_out, C_in] (GPT-2 stores [C_in, C_out], the Llama family nn.Linear's)."""
    return layer.weight.T if isinstance(layer, Affine) else layer.weight


def filled(module: QuantizedAffine, qweight: Tensor, scales: Tensor, bias: Optional[Tensor], dtype: torch.dtype):
    """`module` holding these values on their device; int8 scales and the bias in `dtype`, int4 scales in float16."""
    module.qweight = qweight.to(module.qweight.dtype).contiguous()  # rows in memory order: what the kernels read
    module.scales = scales.to(torch.float16 if module.format == "int4" else dtype).contiguous()
    if bias is not None:
        module.bias = bias.detach().to(dtype).clone()
    elif "bias" in module._buffers:  # a layer without one adds zeros, on the weights' device (the table has none)
        module.bias = torch.zeros(module.qweight.shape[0], dtype=dtype, device=module.qweight.device)
    module.prepare()
    return module


def empty_quantized(model, fmt: str, smoothed: bool = False):
    """`model` with quantized modules of the right shapes and zero values, ready for `load_state_dict`; `smoothed`:
    the blocks' layers hold SmoothQuant's factors too (`smooth`)."""
    for parent, name, old in affine_layers(model):
        n_out, n_in = out_in(old).shape
        layer = QuantizedAffine(n_in, n_out, fmt)
        if smoothed:
            layer.smooth = torch.ones(n_in)  # [C_in]
        setattr(parent, name, layer)
    setattr(model, model.token_table, QuantizedTable(model.config.vocab_size, model.config.n_embd, fmt))
    return model


def resident_bytes(model) -> int:
    """Bytes of every weight tensor the model holds (parameters and buffers, each counted once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


CONFIG_KEY = "quantization_config"


def saved_format(config_file: Path) -> Optional[str]:
    """The format a checkpoint folder's config.json says its weights are quantized to, or None."""
    try:
        entry = json.loads(Path(config_file).read_text()).get(CONFIG_KEY)
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    return entry.get("format") if isinstance(entry, dict) else repr(entry)  # not a dict: refused by the caller


def config_entry(fmt: str) -> dict:
    """What config.json says about a quantized checkpoint: its format, for `load_model` (transformers knows no
    'llmcourse' quant_method; it loads such a folder only with warnings and freshly initialized layers)."""
    return {"quant_method": "llmcourse", "format": fmt, "group_size": GROUP_SIZE if fmt == "int4" else None}
