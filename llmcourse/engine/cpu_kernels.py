"""The C kernels of the CPU's decoding routes, compiled on first use: float32 products for a few rows
(`kernels/float_linear.c`), a decode step's attention (`kernels/decode_attention.c`) and the quantized products
(`kernels/quantized_linear.c`).

Why C for float32: a decode step multiplies one row per sequence by every weight, so it runs at the speed the
weights stream in from memory. On an AMD EPYC (Zen 4, one thread) torch.addmm read GPT-2's weights at 17-19 GB/s
where a plain read runs at 25-31 GB/s, and for 4-16 rows at 5-8 GB/s; the kernel reads each weight once, in memory
order, for all the rows (`linear`: 19-25 GB/s for one row, 1.3-2x torch's speed for 4-16; benchmarks.md). It also
sums every output in the same order whatever the number of rows, so a sequence decoded in a batch gets the numbers
it gets decoded alone. Attention: at batch 16 a decode step reads more cached keys and values than weights, which
torch's fused kernel read at 9 GB/s (`decode_attention`: 15-17).

Threads: every kernel cuts its work into chunks of about 16 KB of weights (or a few heads' cache) that the threads of
`kernels/pool.c` take, the caller too, each from its own stretch of memory first; no thread waits for a helper the
system has parked (`computing`, `threads`). On two threads the float32 product read GPT-2's weights at 37-42 GB/s
where one read 20 and a plain read on both cores runs at 43-45 (benchmarks.md, "Threads").

Why C for the quantized routes: on an x86 CPU with AVX2 (no AVX-512), every PyTorch route to multiply by 4-bit
weights was measured slower than float32 for decoding GPT-2 124M (`_weight_int4pack_mm_for_cpu` 5-10x,
`_dyn_quant_matmul_4bit` 10x, dequantize-then-matmul 8x, torch.compile's generated loops 1.5-5x; see benchmarks.md),
so 4 bits would have saved memory but not time. The int4 kernel reads the packed bytes once and multiplies them by
the activations quantized to int8, summing each group of 32 exactly in integers (llama.cpp's Q4_0 dot product). The
int8 kernel is the matrix-vector case of `torch._int_mm` (same exact integer sums, so the same results), which reads
the weights at memory speed where `torch._int_mm` does not for one row.

The shared library is built with the system C compiler (`cc`, or $CC) into ~/.cache/llmcourse (or
$XDG_CACHE_HOME/llmcourse) the first time a model runs on the CPU, about two seconds, once per machine. Without a
compiler, or on a CPU without AVX2, `library()` is None and every layer takes torch's route (with one warning
saying why).

    >>> x = torch.tensor([[0.5, -1.0] * 16])
    >>> xq, xs = quantize_rows(x) if library() else (None, None)   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import math
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import threads

SOURCES = [
    Path(__file__).parent / "kernels" / name
    for name in ("float_linear.c", "decode_attention.c", "quantized_linear.c", "pool.c", "token_index.c")
]
HEADERS = [SOURCES[0].parent / name for name in ("simd.h", "pool.h")]
FLOAT_ROWS = 32  # up to this many rows `linear` takes the C kernel; from about 32 rows on torch's GEMM is as fast
# -ffp-contract=off: `a * b + c` in C rounds as written, as torch rounds it (GCC would otherwise fuse it into one FMA)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]


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
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    path = cache_dir() / f"kernels-{hashlib.sha256(source + ' '.join(FLAGS).encode()).hexdigest()[:16]}.so"
    try:
        if not path.exists():
            compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
            if compiler is None:
                raise OSError("no C compiler (cc or gcc) on PATH")
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then moved: safe for parallel runs
                built = Path(tmp) / path.name
                subprocess.run(
                    [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True, capture_output=True, text=True
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
            f"float32 and quantized layers take slower routes on the CPU: the kernels of "
            f"{' and '.join(p.name for p in SOURCES)} could not be built ({detail}); install a C compiler "
            "(e.g. apt-get install gcc) to make them fast",
            stacklevel=3,
        )
        return None
    pointer = ctypes.c_void_p
    lib.quantize_rows.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, pointer, pointer]
    lib.int8_linear.argtypes = lib.int4_linear.argtypes = [pointer] * 5 + [ctypes.c_int] * 4
    lib.int4_dequantize.argtypes = [pointer] * 3 + [ctypes.c_int] * 3
    float_args = [pointer, ctypes.c_ssize_t, pointer, ctypes.c_ssize_t, pointer, pointer] + [ctypes.c_int] * 4
    lib.float_linear.argtypes = float_args
    lib.attention_scores.argtypes = [pointer, *[ctypes.c_ssize_t] * 2, pointer, *[ctypes.c_ssize_t] * 3, pointer]
    lib.attention_scores.argtypes += [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.attention_values.argtypes = [pointer, pointer, *[ctypes.c_ssize_t] * 3, pointer] + [ctypes.c_int] * 6
    lib.pool_hold_helpers.argtypes = [ctypes.c_int]
    lib.token_walk.argtypes = [pointer, ctypes.c_int] + [pointer] * 5 + [ctypes.c_int, pointer, pointer]
    return lib


_kernel_threads: Optional[int] = None  # while `computing` runs: the engine's count


@contextlib.contextmanager
def computing():
    """One forward pass: the engine's threads (`threads.count()`) split its products (the C kernels' pool for a
    decode step's few rows, `in_column_chunks` for a prefill's many), and torch's own operations run on one
    thread meanwhile (`threads`: why).

        >>> with computing():
        ...     torch.get_num_threads()
        1
    """
    global _kernel_threads
    # a pass inside a pass (a draft model's, say): the outer one decided; torch.compile: the kernels are not called
    if _kernel_threads is not None or torch.compiler.is_compiling():
        yield
        return
    before = torch.get_num_threads()
    _kernel_threads = threads.count()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _kernel_threads = None
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def kernel_threads() -> int:
    """The threads the engine splits a product between: `threads.count()` while `computing`, else torch's."""
    return _kernel_threads or torch.get_num_threads()


_helpers: list[threading.Thread] = []
_handed_out: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()


def _helper() -> None:
    while True:
        _handed_out.get()()


def in_column_chunks(product: Callable[[slice], Tensor], N: int) -> Tensor:
    """torch.cat([product(columns) ...], dim=-1) over slices of range(N): a product of many rows (a prefill's) cut
    by its output columns, each chunk computed by torch on one thread, the chunks taken by whichever of the
    engine's threads (`kernel_threads`) is free, the caller too (Python threads: torch releases the GIL while it
    multiplies). Each output column is computed as in the whole product, so the result is the same.

        >>> w = torch.randn(8, 300)
        >>> torch.equal(in_column_chunks(lambda c: w[:, c] * 2, 300), w * 2)
        True
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:  # what watches sees torch's ops
        return product(slice(0, N))
    threads = kernel_threads()
    width = max(64, math.ceil(N / (4 * threads) / 64) * 64)  # about 4 chunks a thread, whole 64s of columns
    pieces = [slice(n0, min(n0 + width, N)) for n0 in range(0, N, width)]
    if threads == 1 or len(pieces) == 1:
        return product(slice(0, N))
    results: list = [None] * len(pieces)
    handed, finished = itertools.count(), threading.Condition()
    done = [0]

    grad = torch.is_grad_enabled()  # the caller's (a thread's own setting)

    def take() -> None:  # chunks until none is left; a helper that comes late finds none
        mine = 0
        while (i := next(handed)) < len(pieces):
            try:
                with torch.set_grad_enabled(grad):
                    results[i] = product(pieces[i])
            except BaseException as err:  # raised again by the caller
                results[i] = err
            mine += 1
        if mine:
            with finished:
                done[0] += mine
                finished.notify()

    while len(_helpers) < threads - 1:
        _helpers.append(threading.Thread(target=_helper, daemon=True, name="llmcourse-product"))
        _helpers[-1].start()
    for _ in range(threads - 1):
        _handed_out.put(take)
    take()
    with finished:
        finished.wait_for(lambda: done[0] == len(pieces))
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return torch.cat(results, dim=-1)


def plain_cpu_floats(*tensors: Optional[Tensor]) -> bool:
    """Whether the C kernels may take these tensors: float32 on the CPU (None: absent), no gradient wanted, and
    nothing watching torch's operations (torch.compile tracing, or a dispatch mode such as FlopCounterMode: they see
    torch's operations only), and the kernels built."""
    present = [t for t in tensors if t is not None]
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in present)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in present))
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and library() is not None
    )


def linear(rows: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """rows [M, K] @ weight [K, N] + bias [N] -> [M, N]: `torch.addmm`'s product, by the C kernel where it applies
    (at most FLOAT_ROWS rows, `plain_cpu_floats`, and weight the transpose of an [N, K] matrix, as the engine
    stores every layer: `nn.Linear`'s layout; K a multiple of 8), else by torch.

        >>> linear(torch.ones(1, 8), torch.eye(8)[:3].T, torch.tensor([1.0, 2.0, 3.0]))
        tensor([[2., 3., 4.]])
    """
    (M, K), N = rows.shape, weight.shape[1]
    if not (
        weight.shape[0] == K  # else torch says what does not match (the C kernel would read past the memory)
        and (bias is None or tuple(bias.shape) == (N,))
        and weight.stride(0) == 1
        and K % 8 == 0
        and 0 < M <= FLOAT_ROWS
        and rows.stride(1) == 1
        and (bias is None or bias.is_contiguous())
        and plain_cpu_floats(rows, weight, bias)
    ):
        if M > FLOAT_ROWS and weight.stride(0) == 1 and plain_cpu_floats(rows, weight, bias):
            return many_rows(rows, weight, bias)
        return torch.mm(rows, weight) if bias is None else torch.addmm(bias, rows, weight)
    y = torch.empty(M, N)
    library().float_linear(
        rows.data_ptr(),
        rows.stride(0),
        weight.data_ptr(),
        weight.stride(1),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        M,
        N,
        K,
        kernel_threads(),
    )
    return y


def many_rows(rows: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """A prefill's product, rows [M, K] @ weight [K, N] + bias: torch's, in chunks of output columns on the engine's
    threads (`in_column_chunks`; weight stored [N, K], so each chunk reads one stretch of it)."""
    if bias is None:
        return in_column_chunks(lambda c: torch.mm(rows, weight[:, c]), weight.shape[1])
    return in_column_chunks(lambda c: torch.addmm(bias[c], rows, weight[:, c]), weight.shape[1])


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
    packed = 2 if weight.dtype == torch.uint8 else 1  # int4: two weights a byte
    if weight.shape[1] * packed != K or scales.shape[0] != N or (bias is not None and tuple(bias.shape) != (N,)):
        raise ValueError(  # the C kernel would read past the tensors' memory
            f"rows {tuple(rows.shape)} do not fit the weight {tuple(weight.shape)} {weight.dtype} with scales "
            f"{tuple(scales.shape)} and bias {None if bias is None else tuple(bias.shape)}: the weight's rows are the "
            "outputs, its columns the inputs"
        )
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
        kernel_threads(),
    )
    return y


def int4_dequantized(packed: Tensor, scales: Tensor) -> Tensor:
    """The int4 weights as float32 [N, K], each group of 32 in the kernel's order (even positions, then odd)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    out = torch.empty(N, K)
    library().int4_dequantize(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), N, K, kernel_threads())
    return out


def in_group_order(rows: Tensor) -> Tensor:
    """rows [M, K] -> [M, K] with each group of 32 reordered as its even then its odd positions."""
    M, K = rows.shape
    return rows.view(M, K // 32, 16, 2).transpose(-1, -2).reshape(M, K)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Scaled dot-product attention of one query per sequence: q [B, H, 1, D], k and v [B, H_kv, T, D] (H a multiple
    of H_kv: grouped-query attention reads kv head h // (H / H_kv)), `mask` bool broadcastable to [B, H, 1, T] (True:
    attend) or None -> [B, H, 1, D]. The C kernel reads the keys, then the values, front to back (float32 on the
    CPU, D a multiple of 8); torch's softmax in between. Elsewhere torch's fused kernel.

        >>> k = torch.zeros(1, 1, 3, 8); v = torch.arange(3.0).view(1, 1, 3, 1).expand(1, 1, 3, 8)
        >>> decode_attention(torch.ones(1, 1, 1, 8), k, v)[0, 0, 0, :2]   # equal scores: the mean of the values
        tensor([1., 1.])
    """
    (B, H, Tq, D), (H_kv, T) = q.shape, k.shape[1:3]
    if k.shape[:-1] != v.shape[:-1]:  # torch's CPU kernel does not check this one
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} differ in batch, heads or positions")
    if not (
        Tq == 1
        and k.shape == v.shape  # else torch says what does not match (the C kernel would read past the memory)
        and k.shape[0] == B
        and k.shape[-1] == D
        and H % H_kv == 0
        and D % 8 == 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and (mask is None or mask.dtype == torch.bool)
        and plain_cpu_floats(q, k, v)
    ):
        if Tq != 1 or H == H_kv:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        n_rep = H // H_kv  # grouped: KV head g's n_rep queries as rows of its own, k and v not copied
        rows = None if mask is None else mask.expand(B, H, 1, T).reshape(B, H_kv, n_rep, T)
        return F.scaled_dot_product_attention(q.reshape(B, H_kv, n_rep, D), k, v, attn_mask=rows).reshape(B, H, 1, D)
    lib, threads = library(), kernel_threads()
    scores = torch.empty(B, H, T)
    q = q * D**-0.5  # scaled before the products, as torch's fused kernel does: prefill and decode round alike
    lib.attention_scores(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        scores.data_ptr(), B, H, H_kv, T, D, 1.0, threads,
    )  # fmt: skip
    if mask is not None:
        scores = scores.masked_fill(~mask.expand(B, H, 1, T)[:, :, 0], float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [B, H, T]
    out = torch.empty(B, H, 1, D)
    lib.attention_values(
        p.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), out.data_ptr(), B, H, H_kv, T, D, threads
    )
    return out
