"""A paged KV cache: keys and values of all requests in one pool of fixed-size blocks.

A request's block table lists its blocks in order: position p lives in block `table[p // block_size]`
at offset `p % block_size`. Nothing is reserved for tokens not generated yet, and requests of any
length share the pool without padding. `forward` runs one step of the engine over a flat batch:
chunks of several requests side by side, each attending to its own keys through its table.

    >>> pool = torch.arange(3 * 2 * 1 * 1.0).view(3, 2, 1, 1)   # 3 blocks of 2 positions, 1 head, dim 1
    >>> gather_kv(pool, torch.tensor([2, 0]), 3).flatten().tolist()   # positions 0-1 in block 2, 2 in block 0
    [4.0, 5.0, 0.0]
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from llmcourse.engine.config import GPT2Config
from llmcourse.engine.slots import PartError


def slot_mapping(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Where positions [N] of a request live in the pool, as slots block * block_size + offset. -> [N] long."""
    return block_table[positions // block_size] * block_size + positions % block_size


def gather_kv(pool: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first `length` positions of a request, read through its block table.

    pool [num_blocks, block_size, n_head, head_dim], block_table [n] long -> [n_head, length, head_dim].
    (Tables [G, n] of G requests give [G, n_head, length, head_dim] in one read.)
    """
    blocks = pool.index_select(0, block_table.flatten())  # [G * n, block_size, H, D]: one copy per block
    positions = blocks.view(*block_table.shape[:-1], -1, *pool.shape[2:])  # [..., n * block_size, H, D]
    return positions[..., :length, :, :].transpose(-3, -2)  # [..., H, length, D]


class PagedKVCache:
    """One pool per layer for keys and one for values, [num_blocks, block_size, n_head, head_dim] each."""

    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int, *, device=None, dtype=torch.float32):
        shape = (num_blocks, block_size, config.n_head, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.block_size = block_size


class Chunk(NamedTuple):
    """`tokens` of one request, at positions start … start + len(tokens) - 1, with its block table."""

    tokens: list[int]
    start: int
    block_table: list[int]


@torch.inference_mode()
def forward(
    model,
    cache: PagedKVCache,
    chunks: list[Chunk],
    logits_of: Optional[list[int]] = None,
    *,
    gather: Callable = gather_kv,
    slots_of: Callable = slot_mapping,
) -> Tensor:
    """Run the chunks of several requests as one batch of N tokens; each chunk's keys and values go into the
    pool, and each chunk attends to all of its request's positions so far. -> logits [len(logits_of), vocab_size]
    of the last token of the chunks `logits_of` (default: all; the engine asks only for those that end a
    request's known tokens, not for prefill chunks whose next token is already known).

    The linear layers see all N tokens at once (one matrix product per layer: what batching buys); the
    attention runs per prefill chunk, and for all single-token (decode) chunks at once, padded and masked.
    """
    device, bs = model.device, cache.block_size
    lengths = [len(c.tokens) for c in chunks]
    input_ids = torch.tensor([t for c in chunks for t in c.tokens], device=device)[None]  # [1, N]
    positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)]).to(device)  # [N]
    tables = [torch.tensor(c.block_table, device=device) for c in chunks]
    slots = torch.cat([slots_of(t, positions[o : o + n], bs) for t, o, n in zip(tables, offsets(lengths), lengths)])
    if slots_of is not slot_mapping:
        check_slots(slots, chunks, cache)
    ends = [c.start + n for c, n in zip(chunks, lengths)]  # keys each chunk attends to
    decodes = [j for j, n in enumerate(lengths) if n == 1]
    prefills = [j for j, n in enumerate(lengths) if n > 1]
    starts = offsets(lengths)
    H, D = model.config.n_head, model.config.head_dim

    if len(decodes) > 1:  # one attention call for all of them: keys padded to the longest, masked
        longest = max(ends[j] for j in decodes)
        key_mask = (
            torch.arange(longest, device=device) < torch.tensor([ends[j] for j in decodes], device=device)[:, None]
        )
        key_mask = key_mask[:, None, None, :]  # [G, 1, 1, longest]
        decode_rows = torch.tensor([starts[j] for j in decodes], device=device)
        width = max(len(chunks[j].block_table) for j in decodes)
        decode_tables = torch.tensor(
            [chunks[j].block_table + [0] * (width - len(chunks[j].block_table)) for j in decodes], device=device
        )  # [G, width], padded with block 0

    if gather is not gather_kv:
        gather = checked_gather(gather)

    def padded(pool: Tensor) -> Tensor:  # [G, H, longest, D]; past each request's end: masked, never read
        if gather is gather_kv:  # the engine's reads all the tables at once (a learner's is checked, per request)
            return gather_kv(pool, decode_tables, longest)
        return torch.stack([F.pad(gather(pool, tables[j], ends[j]), (0, 0, 0, longest - ends[j])) for j in decodes])

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [1, H, N, D] each
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        k_pool.view(-1, H, D)[slots] = k[0].transpose(0, 1)  # [N, H, D] into their slots
        v_pool.view(-1, H, D)[slots] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        attention = model.parts.attention
        if len(decodes) > 1:
            q_rows = q[0, :, decode_rows].transpose(0, 1)[:, :, None]  # [G, H, 1, D]
            out[0, :, decode_rows] = attention(q_rows, padded(k_pool), padded(v_pool), key_mask)[:, :, 0].transpose(
                0, 1
            )
        for j in prefills if len(decodes) > 1 else range(len(chunks)):
            o, n = starts[j], lengths[j]
            keys, values = gather(k_pool, tables[j], ends[j]), gather(v_pool, tables[j], ends[j])  # [H, end, D]
            out[:, :, o : o + n] = attention(q[:, :, o : o + n], keys[None], values[None], None)
        return out

    x = model.blocks(model.embed(input_ids, positions[None]), attend)  # [1, N, C]
    logits_of = range(len(chunks)) if logits_of is None else logits_of
    last = torch.tensor([starts[j] + lengths[j] - 1 for j in logits_of], dtype=torch.long, device=device)
    return model.head(x[0, last])  # [len(logits_of), V]


def checked_gather(gather: Callable) -> Callable:
    """A learner's gather, compared with the engine's at every call: wrong keys would silently change the text."""

    def call(pool: Tensor, block_table: Tensor, length: int) -> Tensor:
        out = gather(pool, block_table, length)
        want = torch.cat([pool[b] for b in block_table.tolist()])[:length].transpose(0, 1)  # [H, length, D]
        if not torch.equal(out, want):
            raise PartError(
                f"part 'gather_kv' read positions 0..{length - 1} through block table "
                f"{block_table.tolist()} wrongly: they differ from the pool's blocks in that order\n"
                "  hint: run the check for 'gather_kv' in chapter 07 to debug it"
            )
        return out

    return call


def check_slots(slots: Tensor, chunks: list[Chunk], cache: PagedKVCache) -> None:
    """A learner's slot mapping must put each position in its own block of the table, or keys land elsewhere."""
    bs, at = cache.block_size, 0
    for c in chunks:
        got = slots[at : at + len(c.tokens)].tolist()
        want = [c.block_table[p // bs] * bs + p % bs for p in range(c.start, c.start + len(c.tokens))]
        if got != want:
            raise PartError(
                f"part 'slot_mapping' put positions {c.start}..{c.start + len(c.tokens) - 1} of a request "
                f"with block table {c.block_table} (block_size {bs}) at slots {got}, expected {want}\n"
                "  hint: run the check for 'slot_mapping' in chapter 07 to debug it"
            )
        at += len(c.tokens)


def offsets(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out
