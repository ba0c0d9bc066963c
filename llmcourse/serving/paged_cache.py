"""A paged KV cache: keys and values of all requests in one pool of fixed-size blocks.

A request's block table lists its blocks in order: position p lives in block `table[p // block_size]`
at offset `p % block_size` (its slot in the pool is `table[p // block_size] * block_size + p % block_size`).
Nothing is reserved for tokens not generated yet, and requests of any length share the pool without
padding. `forward` runs one step of the engine over a flat batch: chunks of several requests side by
side, each attending to its own keys through its table. The decode tokens attend with `paged_attention`'s
contract: `paged_attention` walks the block table one column of blocks at a time (each `k_pool[table[:, j]]`
a copy of one block per sequence, never a whole context; a GPU kernel such as vLLM's reads the blocks through
the table inside itself, with no copy); a long context is split into partitions of `partition_size`
positions, attended to side by side and combined with `merge_attention` (vLLM's PagedAttention V2, the
split-K of FlashDecoding). The engine's own, `paged_attention_fused`, the default on every device, copies
each partition's blocks into one tile for torch's fused kernel instead: eager PyTorch cannot read blocks in
place, and small operations per block cost more than that copy. On a CPU that kernel returns the
log-sum-exp; elsewhere a second pass computes it (chapter 07 says what each costs). Compiled decode steps
(`decode_forward`, which `decode_graphs` captures per batch-size bucket) attend with FlexAttention instead
(`paged_attention_flex`): its kernel reads each block through the table where it lies, no copy, no partitions.

    >>> pool = torch.arange(3 * 2 * 1 * 1.0).view(3, 2, 1, 1)   # 3 blocks of 2 positions, 1 head, dim 1
    >>> gather_kv(pool, torch.tensor([2, 0]), 3).flatten().tolist()   # positions 0-1 in block 2, 2 in block 0
    [4.0, 5.0, 0.0]
    >>> out, lse = paged_attention(torch.ones(1, 1, 1), pool, pool, torch.tensor([[2, 0]]), torch.tensor([3]))
    >>> round(out.item(), 4), round(lse.item(), 4)   # softmax of the scores 4, 5, 0 over the values 4, 5, 0
    (4.7079, 5.3182)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from llmcourse.engine import cpu_kernels
from llmcourse.engine.tiled_attention import merge_attention

FLEX_QUERY_BLOCK = 128  # FlexAttention's query block: a decode row's one query fits in it


def slot_mapping(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Where positions [N] of a request live in the pool, as slots block * block_size + offset. -> [N] long."""
    return block_table[positions // block_size] * block_size + positions % block_size


def gather_kv(pool: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first `length` positions of a request, copied out of the pool through its block table (what the prefill
    chunks attend to).

    pool [num_blocks, block_size, n_head, head_dim], block_table [n] long -> [n_head, length, head_dim].
    (Tables [G, n] of G requests give [G, n_head, length, head_dim] in one read.)
    """
    blocks = pool.index_select(0, block_table.flatten())  # [G * n, block_size, H, D]: one copy per block
    positions = blocks.view(*block_table.shape[:-1], -1, *pool.shape[2:])  # [..., n * block_size, H, D]
    return positions[..., :length, :, :].transpose(-3, -2)  # [..., H, length, D]


def paged_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """One query per sequence attending to its first `lengths` positions, read block by block through its table.

    q [G, H, D] (G sequences), k_pool and v_pool [num_blocks, block_size, H, D], block_table [G, n] long (row g:
    sequence g's blocks in order; entries past its length are never read), lengths [G] long, 1 … n * block_size
    -> (out [G, H, D], lse [G, H]): softmax(q·k / √D) v over those positions, and each row's log-sum-exp of the
    scaled scores. The online softmax of chapter 03 walks the table one column of blocks at a time (block j of
    every sequence at once), keeping a running max `m`, sum `l` and accumulator `acc`: no tensor holds more than
    one block of a sequence's keys or values. Grouped-query attention: pools of H_kv heads (H a multiple of H_kv),
    query head h reading KV head h // (H / H_kv), each block read once for the query heads it serves.
    """
    G, H, D = q.shape
    block_size, H_kv = k_pool.shape[1], k_pool.shape[2]
    n_rep = H // H_kv
    m = torch.full((G, 1, H), -math.inf, dtype=q.dtype, device=q.device)  # running max of the scores
    l = torch.zeros(G, 1, H, dtype=q.dtype, device=q.device)  # running sum of exp(s - m)
    acc = torch.zeros(G, H, D, dtype=q.dtype, device=q.device)  # running sum of exp(s - m) v
    q = q.view(G, 1, H_kv, n_rep, D) / math.sqrt(D)  # [G, 1, H_kv, n_rep, D]: the queries of each KV head
    offsets = torch.arange(block_size, device=q.device)
    for j in range(-(-int(lengths.max()) // block_size)):
        k = k_pool[block_table[:, j]]  # [G, block_size, H_kv, D]: block j of every sequence
        v = v_pool[block_table[:, j]]
        s = (k[:, :, :, None] * q).sum(dim=-1).view(G, block_size, H)  # [G, block_size, H]
        unused = j * block_size + offsets >= lengths[:, None]  # [G, block_size]: past the sequence's length
        s = s.masked_fill(unused[..., None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=1, keepdim=True))  # finite: every sequence has a key in block 0
        rescale = torch.exp(m - m_new)  # [G, 1, H]
        p = torch.exp(s - m_new).view(G, block_size, H_kv, n_rep, 1)  # [G, block_size, H_kv, n_rep, 1]
        l = l * rescale + p.sum(dim=1).view(G, 1, H)
        acc = acc * rescale.transpose(1, 2) + (p * v[:, :, :, None]).sum(dim=1).view(G, H, D)  # [G, H, D]
        m = m_new
    return acc / l.transpose(1, 2), (m + torch.log(l))[:, 0]


def paged_attention_fused(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """`paged_attention` as the engine runs it: each row's blocks (one partition of a sequence, at most
    `partition_size` positions) are read into one tile, and torch's fused attention kernel attends to it. Eager
    PyTorch cannot read blocks where they lie without a copy, and a dozen small operations per block cost more
    than one copy of a partition; a GPU kernel (vLLM's) reads them in place. On a CPU the kernel returns the
    log-sum-exp too; elsewhere it is computed from the scores beside torch's public kernel, which gives the
    output exactly as `generate`'s decode does. Grouped-query attention (pools of H_kv heads): each KV head's
    n_rep = H / H_kv query heads are its rows, q viewed [G, H_kv, n_rep, D], so every block is read once."""
    G, H, D = q.shape
    block_size, H_kv = k_pool.shape[1], k_pool.shape[2]
    longest = int(lengths.max())
    n = -(-longest // block_size)  # block columns read
    blocks = block_table[:, :n].flatten()  # [G * n]
    k = k_pool.index_select(0, blocks).view(G, n * block_size, H_kv, D)[:, :longest].transpose(1, 2)  # [G, H_kv, L, D]
    v = v_pool.index_select(0, blocks).view(G, n * block_size, H_kv, D)[:, :longest].transpose(1, 2)
    rows = q.view(G, H_kv, H // H_kv, D)  # [G, H_kv, n_rep, D]: query head h is row h % n_rep of KV head h // n_rep
    bias = None  # every row as long as the longest: no mask, the kernel's call as in generate's decode
    if int(lengths.min()) < longest:
        unused = torch.arange(longest, device=q.device) >= lengths[:, None]  # [G, L]
        bias = q.new_zeros(G, 1, 1, longest).masked_fill_(unused[:, None, None], -math.inf)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, k, v, attn_mask=bias)
        return out.reshape(G, H, D), lse.reshape(G, H).to(q.dtype)  # [G, H, D], [G, H]
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=bias)  # [G, H_kv, n_rep, D]
    scores = (rows @ k.transpose(-2, -1)).float() / math.sqrt(D)  # [G, H_kv, n_rep, L]
    if bias is not None:
        scores = scores + bias
    return out.reshape(G, H, D), torch.logsumexp(scores, dim=-1).reshape(G, H).to(q.dtype)


def flex_mask(block_table: Tensor, lengths: Tensor, block_size: int, num_blocks: int) -> BlockMask:
    """FlexAttention's block mask for one query per sequence over the whole pool: row g reads only the blocks of
    its table (the kernel skips every other block of the pool), all of a full block, and of its last block the
    positions before its length. The pool is the key sequence, slot = block * block_size + offset.

    block_table [G, W] long (entries past a row's length are never read), lengths [G] long -> a BlockMask of G
    rows, 1 query, num_blocks * block_size keys. The mask function says what the blocks' list says (FlexAttention
    requires it: its unfused route evaluates it everywhere), through `logical` [G, num_blocks + 1]: where each
    physical block sits in row g's table, -1 where it does not (column num_blocks takes the unused entries).
    """
    G, W = block_table.shape
    used = (lengths + block_size - 1) // block_size  # [G] blocks in each table
    j = torch.arange(W, device=block_table.device)  # [W]
    listed = torch.where(j < used[:, None], block_table, num_blocks)  # [G, W]: unused entries to the spare column
    logical = torch.full((G, num_blocks + 1), -1, dtype=torch.long, device=block_table.device)
    logical.scatter_(1, listed, j.expand(G, W))  # [G, num_blocks + 1]

    def mask_mod(b, h, q_idx, kv_idx):
        position = logical[b, kv_idx // block_size] * block_size + kv_idx % block_size
        return (logical[b, kv_idx // block_size] >= 0) & (position < lengths[b])

    full = used - 1  # [G]: every block but the last is full
    last = block_table.gather(1, full[:, None])  # [G, 1]: the last block, read through the mask function
    padded = F.pad(block_table, (0, num_blocks - W)) if W < num_blocks else block_table[:, :num_blocks]
    return BlockMask.from_kv_blocks(
        torch.ones(G, 1, 1, dtype=torch.int32, device=block_table.device),
        F.pad(last, (0, num_blocks - 1)).int()[:, None, None],  # [G, 1, 1, num_blocks]
        full.int()[:, None, None],
        padded.int()[:, None, None],
        BLOCK_SIZE=(FLEX_QUERY_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * block_size),
    )


def paged_attention_flex(q: Tensor, k_pool: Tensor, v_pool: Tensor, mask: BlockMask) -> Tensor:
    """One query per sequence attending to its blocks where they lie in the pool, q [G, H, D] -> out [G, H, D]:
    FlexAttention with `flex_mask`'s block mask, compiled into one kernel that reads each listed block through the
    table and no other (no gather, no second pass). Grouped-query attention: H query heads over the pool's H_kv.
    Uncompiled (torch.compile absent), it materializes the scores against the whole pool: tests only."""
    G, H, D = q.shape
    num_blocks, block_size, H_kv = k_pool.shape[:3]
    keys = k_pool.view(1, num_blocks * block_size, H_kv, D).transpose(1, 2)  # [1, H_kv, slots, D], no copy
    values = v_pool.view(1, num_blocks * block_size, H_kv, D).transpose(1, 2)
    keys, values = keys.expand(G, -1, -1, -1), values.expand(G, -1, -1, -1)  # a view per row, no copy
    out = flex_attention(q[:, :, None], keys, values, block_mask=mask, enable_gqa=H != H_kv)  # [G, H, 1, D]
    return out[:, :, 0]


class Partitions(NamedTuple):
    """The decode rows of a step cut into partitions of `partition_blocks` blocks, partition-major: rows 0 … G-1
    are partition 0 of each sequence, then partition 1 of the sequences that reach it, and so on. The same for
    every layer, so made once per step."""

    sequence: Tensor  # [U] long: which sequence each row belongs to
    block_table: Tensor  # [U, partition_blocks] long
    lengths: Tensor  # [U] long: positions of the row's partition, 1 … partition_blocks * block_size
    merges: list[tuple[int, int, Optional[Tensor]]]  # per later partition: its rows a:b, and its sequences (None: all)


def partitions(block_table: Tensor, lengths: Tensor, partition_blocks: int, block_size: int) -> Partitions:
    """block_table [G, n], lengths [G] -> the rows of the partitions of G sequences (see `Partitions`)."""
    G, n = block_table.shape
    if n <= partition_blocks:  # one partition: the rows are the sequences
        return Partitions(torch.arange(G, device=block_table.device), block_table, lengths, [])
    span = partition_blocks * block_size  # positions per partition
    sequence, tables, part_lengths, merges, rows = [], [], [], [], 0
    for p in range(-(-n // partition_blocks)):
        reach = (lengths > p * span).nonzero()[:, 0]  # [g]: the sequences with keys in partition p
        table = block_table[reach, p * partition_blocks : (p + 1) * partition_blocks]
        sequence.append(reach)
        tables.append(F.pad(table, (0, partition_blocks - table.shape[1])))  # padded with block 0, never read
        part_lengths.append((lengths[reach] - p * span).clamp(max=span))
        if p > 0:
            merges.append((rows, rows + len(reach), None if len(reach) == G else reach))
        rows += len(reach)
    return Partitions(torch.cat(sequence), torch.cat(tables), torch.cat(part_lengths), merges)


def paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    parts: Partitions,
    attend: Callable = paged_attention_fused,
    merge: Callable = merge_attention,
) -> Tensor:
    """Attention of one query per sequence, q [G, H, D], over its partitions -> out [G, H, D]: every partition of
    every sequence is one row of a single `attend` call (they run side by side, as vLLM's PagedAttention V2 runs
    them in parallel), and each sequence's partitions are combined by `merge`, left to right."""
    G = q.shape[0]
    rows_q = q if len(parts.sequence) == G else q.index_select(0, parts.sequence)  # [U, H, D]
    out, lse = attend(rows_q, k_pool, v_pool, parts.block_table, parts.lengths)  # [U, H, D], [U, H]
    merged, merged_lse = out[:G], lse[:G]
    for a, b, reach in parts.merges:
        if reach is None:
            merged, merged_lse = merge(merged, merged_lse, out[a:b], lse[a:b])
        else:
            o, s = merge(merged[reach], merged_lse[reach], out[a:b], lse[a:b])
            merged, merged_lse = merged.index_put((reach,), o), merged_lse.index_put((reach,), s)
    return merged


class PagedKVCache:
    """One pool per layer for keys and one for values, [num_blocks, block_size, n_kv_head, head_dim] each."""

    def __init__(self, config, num_blocks: int, block_size: int, *, device=None, dtype=torch.float32):
        shape = (num_blocks, block_size, config.n_kv_head, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.block_size = block_size
        if self.k[0].is_cuda:
            for t in self.k + self.v:  # fixed addresses: a CUDA graph of a decode step writes into them in place
                torch._dynamo.mark_static_address(t)


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
    attend: Callable = paged_attention_fused,
    merge: Callable = merge_attention,
    partition_size: int = 256,
) -> Tensor:
    """Run the chunks of several requests as one batch of N tokens; each chunk's keys and values go into the
    pool, and each chunk attends to all of its request's positions so far. -> logits [len(logits_of), vocab_size]
    of the last token of the chunks `logits_of` (default: all; the engine asks only for those that end a
    request's known tokens, not for prefill chunks whose next token is already known).

    The linear layers see all N tokens at once (one matrix product per layer: what batching buys). The
    single-token (decode) chunks attend all at once with `attend` (`paged_attention`'s contract), reading the
    pool through their block tables, their contexts cut into partitions of `partition_size` positions (rounded
    down to whole blocks) combined by `merge`; each prefill chunk attends with the model's attention to its
    keys, gathered from the pool. Grouped-query attention: the engine's kernels take the H query heads of each
    sequence over pools of H_kv heads and read each KV head's blocks once for its n_rep query heads; a learner's
    `attend` (chapter 07's contract, as many KV heads as query heads) gets G · n_rep rows of H_kv heads instead.
    """
    device, bs = model.device, cache.block_size
    lengths = [len(c.tokens) for c in chunks]
    input_ids = torch.tensor([t for c in chunks for t in c.tokens], device=device)[None]  # [1, N]
    positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)]).to(device)  # [N]
    tables = [torch.tensor(c.block_table, device=device) for c in chunks]
    starts = offsets(lengths)
    slots = torch.cat([slot_mapping(t, positions[o : o + n], bs) for t, o, n in zip(tables, starts, lengths)])
    ends = [c.start + n for c, n in zip(chunks, lengths)]  # keys each chunk attends to
    decodes = [j for j, n in enumerate(lengths) if n == 1]
    prefills = [j for j, n in enumerate(lengths) if n > 1]
    H, H_kv, D = model.config.n_head, model.config.n_kv_head, model.config.head_dim
    n_rep = H // H_kv  # grouped-query attention: query heads per KV head
    # The engine's kernels read each KV head once for its n_rep query heads. A learner's paged_attention (chapter
    # 07's contract: as many KV heads as query heads) sees each group of n_rep query heads as a sequence of its own.
    grouped = n_rep == 1 or attend in (paged_attention, paged_attention_fused)
    if decodes:
        decode_rows = torch.tensor([starts[j] for j in decodes], device=device)  # [G]
        width = max(len(chunks[j].block_table) for j in decodes)
        decode_tables = torch.tensor(
            [chunks[j].block_table + [0] * (width - len(chunks[j].block_table)) for j in decodes], device=device
        )  # [G, width], padded with block 0 (never read: past each request's length)
        decode_lengths = torch.tensor([ends[j] for j in decodes], device=device)  # [G]
        if not grouped:  # a learner's kernel: G * n_rep rows, each reading the KV heads (n_rep reads of each)
            decode_tables, decode_lengths = (
                decode_tables.repeat_interleave(n_rep, 0),
                decode_lengths.repeat_interleave(n_rep),
            )
        parts = partitions(decode_tables, decode_lengths, max(1, partition_size // bs), bs)

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [1, H, N, D], k and v [1, H_kv, N, D]
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        k_pool.view(-1, H_kv, D)[slots] = k[0].transpose(0, 1)  # [N, H_kv, D] into their slots
        v_pool.view(-1, H_kv, D)[slots] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        if decodes:
            G = len(decodes)
            q_rows = q[0, :, decode_rows].transpose(0, 1)  # [G, H, D]; head h reads KV head h // n_rep
            if grouped:
                out[0, :, decode_rows] = paged_decode(q_rows, k_pool, v_pool, parts, attend, merge).transpose(0, 1)
            else:
                q_rows = q_rows.reshape(G, H_kv, n_rep, D).transpose(1, 2).reshape(G * n_rep, H_kv, D)
                read = paged_decode(q_rows, k_pool, v_pool, parts, attend, merge)  # [G * n_rep, H_kv, D]
                out[0, :, decode_rows] = read.view(G, n_rep, H_kv, D).transpose(1, 2).reshape(G, H, D).transpose(0, 1)
        for j in prefills:
            o, n = starts[j], lengths[j]
            keys, values = (
                gather_kv(k_pool, tables[j], ends[j]),
                gather_kv(v_pool, tables[j], ends[j]),
            )  # [H_kv, end, D]
            out[:, :, o : o + n] = model.attention(q[:, :, o : o + n], keys[None], values[None], None)
        return out

    with cpu_kernels.computing():
        x = model.blocks(model.embed(input_ids, positions[None]), positions[None], attention)  # [1, N, C]
        logits_of = range(len(chunks)) if logits_of is None else logits_of
        last = torch.tensor([starts[j] + lengths[j] - 1 for j in logits_of], dtype=torch.long, device=device)
        return model.head(x[0, last])  # [len(logits_of), V]


def offsets(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def decode_forward(
    model,
    cache: PagedKVCache,
    input_ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    block_table: Tensor,
    lengths: Tensor,
) -> Tensor:
    """One decode step of G requests in fixed shapes, what `DecodeGraphs` captures: input_ids, positions, slots
    (where each token's keys and values go) and lengths (positions each attends to, its own included) [G] long,
    block_table [G, W] long -> logits [G, vocab_size]. Shapes depend on G and W only, never on the contexts'
    lengths: the attention reads the pool through `flex_mask`, built here from the tables as tensors."""
    num_blocks, block_size = cache.k[0].shape[:2]
    H_kv, D = model.config.n_kv_head, model.config.head_dim
    mask = flex_mask(block_table, lengths, block_size, num_blocks)  # the same for every layer

    def attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [G, H, 1, D], k and v [G, H_kv, 1, D]
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        k_pool.view(-1, H_kv, D)[slots] = k[:, :, 0]  # [G, H_kv, D] into their slots
        v_pool.view(-1, H_kv, D)[slots] = v[:, :, 0]
        return paged_attention_flex(q[:, :, 0], k_pool, v_pool, mask)[:, :, None]  # [G, H, 1, D]

    x = model.blocks(model.embed(input_ids[:, None], positions[:, None]), positions[:, None], attention)  # [G, 1, C]
    return model.head(x[:, 0])  # [G, V]
