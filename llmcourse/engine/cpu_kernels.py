"""The C kernels of the quantized CPU routes (`kernels/quantized_linear.c`), compiled on first use.

Why C: on an x86 CPU with AVX2 (no AVX-512), every PyTorch route to multiply by 4-bit weights was measured
slower than float32 for decoding GPT-2 124M (`_weight_int4pack_mm_for_cpu` 5-10x, `_dyn_quant_matmul_4bit`
10x, dequantize-then-matmul 8x, torch.compile's generated loops 1.5-5x; see benchmarks.md), so 4 bits
would have saved memory but not time. The int4 kernel reads the packed bytes once and multiplies them by the
activations quantized to int8, summing each group of 32 exactly in integers (llama.cpp's Q4_0 dot product).
The int8 kernel is the matrix-vector case of `torch._int_mm` (same exact integer sums, so the same results),
which reads the weights at memory speed where `torch._int_mm` does not for one row.

The shared library is built with the system C compiler (`cc`, or $CC) into ~/.cache/llmcourse (or
$XDG_CACHE_HOME/llmcourse) the first time an int4 model runs on the CPU, about a second. Without a
compiler, or on a CPU without AVX2, `library()` is None and int4 layers take the slower route (with one
warning saying why).

    >>> x = torch.tensor([[0.5, -1.0] * 16])
    >>> xq, xs = quantize_rows(x) if library() else (None, None)   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

SOURCE = Path(__file__).parent / "kernels" / "quantized_linear.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcourse"


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (with a warning saying why) where they cannot be built or run."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return None  # the dequantize-then-multiply route serves other CPUs; nothing to warn about
    source = SOURCE.read_bytes()
    path = cache_dir() / f"quantized_linear-{hashlib.sha256(source + ' '.join(FLAGS).encode()).hexdigest()[:16]}.so"
    try:
        if not path.exists():
            compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
            if compiler is None:
                raise OSError("no C compiler (cc or gcc) on PATH")
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then moved: safe for parallel runs
                built = Path(tmp) / path.name
                subprocess.run(
                    [compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True, text=True
                )
                os.replace(built, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = (
            err.stderr.strip().splitlines()[-1]
            if isinstance(err, subprocess.CalledProcessError) and err.stderr
            else err
        )
        warnings.warn(
            f"quantized layers take slower routes (int4: dequantizing its weights): the CPU kernels of {SOURCE.name} "
            f"could not be built ({detail}); install a C compiler (e.g. apt-get install gcc) to make them fast",
            stacklevel=3,
        )
        return None
    pointer = ctypes.c_void_p
    lib.quantize_rows.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, pointer, pointer]
    lib.int8_linear.argtypes = lib.int4_linear.argtypes = [pointer] * 5 + [ctypes.c_int] * 4
    lib.int4_dequantize.argtypes = [pointer] * 3 + [ctypes.c_int] * 3
    return lib


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [M, K] float32 contiguous -> (xq [M, K] int8, xs [M] float32): what
    `llmcourse.engine.quantize.quantize_int8(rows)` gives."""
    M, K = rows.shape
    xq, xs = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
    library().quantize_rows(rows.data_ptr(), M, K, xq.data_ptr(), xs.data_ptr(), None)
    return xq, xs


def int4_linear(rows: Tensor, packed: Tensor, scales: Tensor, bias: Optional[Tensor]) -> Tensor:
    """rows [M, K] float32 contiguous, packed [N, K // 2] uint8, scales [N, K // 32] float16, bias [N] float32 or
    None -> [M, N] float32."""
    return _linear(library().int4_linear, rows, packed, scales, bias)


def int8_linear(rows: Tensor, q: Tensor, scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """rows [M, K] float32 contiguous (K a multiple of 32), q [N, K] int8, scale [N] float32, bias [N] float32 or
    None -> [M, N] float32."""
    return _linear(library().int8_linear, rows, q, scale, bias)


def _linear(kernel, rows: Tensor, weight: Tensor, scales: Tensor, bias: Optional[Tensor]) -> Tensor:
    (M, K), N = rows.shape, weight.shape[0]
    y = torch.empty(M, N)
    kernel(
        rows.data_ptr(),
        weight.data_ptr(),
        scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        M,
        N,
        K,
        torch.get_num_threads(),
    )
    return y


def int4_dequantized(packed: Tensor, scales: Tensor) -> Tensor:
    """The int4 weights as float32 [N, K], each group of 32 in the kernel's order (even positions, then odd)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    out = torch.empty(N, K)
    library().int4_dequantize(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), N, K, torch.get_num_threads())
    return out


def in_group_order(rows: Tensor) -> Tensor:
    """rows [M, K] -> [M, K] with each group of 32 reordered as its even then its odd positions."""
    M, K = rows.shape
    return rows.view(M, K // 32, 16, 2).transpose(-1, -2).reshape(M, K)
