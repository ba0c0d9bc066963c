"""LLMEngine's decode steps as graphs of fixed shapes: on a GPU, one CUDA graph per batch-size bucket.

A decode step of a small model on a GPU is a few hundred kernel launches, each microseconds of Python and driver
work for microseconds of GPU work: the GPU waits on Python. A CUDA graph records the launches once and replays
them in one call. It replays fixed shapes and addresses, so the step must not depend on the requests' lengths:
`paged_cache.decode_forward` takes every request's block table padded to one width and attends with FlexAttention
over the whole pool (the kernel reads only the blocks each table lists; nothing is gathered). The batch is
padded up to the next bucket (1, 2, 4, 8, 16, ...; nano-vllm does the same), so a handful of graphs serve every
batch size; padding rows decode token 0 into a spare block that no request owns, and their logits are dropped.

Steps that prefill a chunk run uncompiled (`paged_cache.forward`): their shapes change with every prompt.

    >>> engine = LLMEngine(model.to("cuda"), compile=True)   # a bucket is captured at its first step  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmcourse.engine.generate import compile_step

from . import paged_cache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is made for, up to `max_num_seqs`.

    >>> bucket_sizes(24)
    [1, 2, 4, 8, 16, 24]
    """
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Runs decode-only steps of `cache`'s requests through `decode_forward` compiled (`compile_step`: on CUDA a
    CUDA graph per bucket). The pool's last block is the padding rows' spare: the engine makes the pool one
    block larger than its block manager knows. `width`: blocks per table (a request's longest)."""

    def __init__(self, model, cache: paged_cache.PagedKVCache, max_num_seqs: int, width: int):
        self.model, self.cache, self.width = model, cache, width
        self.spare = cache.k[0].shape[0] - 1  # the block padding rows write to
        self.buckets = bucket_sizes(max_num_seqs)
        self.step = compile_step(paged_cache.decode_forward, model.device)
        self.sizes_run: set[int] = set()  # buckets run so far (each compiled, or captured, at its first step)

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least n rows."""
        return next(b for b in self.buckets if b >= n)

    def run(self, chunks: list[paged_cache.Chunk]) -> Tensor:
        """Logits [len(chunks), vocab_size] of single-token chunks (each request's next position)."""
        G, bs = len(chunks), self.cache.block_size
        B = self.bucket(G)
        spare = [self.spare] * self.width
        rows = [
            (c.tokens[0], c.start, c.block_table[c.start // bs] * bs + c.start % bs, c.start + 1) for c in chunks
        ] + [(0, 0, self.spare * bs, 1)] * (B - G)  # (token, position, slot, length); padding reads its own slot
        ids, positions, slots, lengths = torch.tensor(rows, device=self.model.device).unbind(1)  # [B] each
        tables = torch.tensor(
            [(c.block_table + spare)[: self.width] for c in chunks] + [spare] * (B - G), device=self.model.device
        )  # [B, width]
        self.sizes_run.add(B)
        logits = self.step(self.model, self.cache, ids, positions, slots, tables, lengths)  # [B, V]
        return logits[:G].clone() if logits.is_cuda else logits[:G]  # a CUDA graph's output is its own buffer
