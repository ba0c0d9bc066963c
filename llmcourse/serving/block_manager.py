"""The paged KV cache's bookkeeping: which fixed-size blocks of the pool each request holds.

`BlockAllocator` hands out block ids from a free list and counts the users of each block.
`BlockManager` keeps each request's block table on top of it and, with prefix caching, remembers
full blocks by a hash of their tokens and of everything before them, so that a request starting
with the same tokens (a shared system prompt) reuses those blocks instead of recomputing them.

    >>> blocks = BlockAllocator(4)
    >>> blocks.allocate(), blocks.allocate(), blocks.num_free
    (0, 1, 2)
    >>> blocks.share(0); blocks.release(0); blocks.release(0); list(blocks.free)
    [2, 3, 0]
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from llmcourse.engine.slots import PartError


class BlockAllocator:
    """Block ids 0 … num_blocks-1: a free list (least recently freed first) and a count of users per block.

    `allocate` takes the block at the front of the free list; `share` adds a user to a block (one found
    by prefix caching, taken off the free list if nobody used it); `release` removes one, and a block
    whose last user leaves goes to the back of the free list, where it is reused last, so that its
    cached keys and values survive as long as possible.
    """

    def __init__(self, num_blocks: int):
        self.free = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise MemoryError("no free block left: free some, or make the pool bigger")
        block = self.free.popleft()
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.free.remove(block)
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        if self.ref_count[block] == 0:
            raise ValueError(f"block {block} is not in use: it cannot be released")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The prefix-cache key of each full block of `token_ids` (a partial last block has none): block i's hash
    is computed from block i-1's hash and its own tokens, so it stands for the whole prefix up to the block's
    end, and equal hashes mean the same tokens at the same positions after the same prefix (hence the same keys
    and values). As in nano-vllm (with xxhash) and vLLM (with sha256 or Python's hash).

        >>> a, b = block_hashes([1, 2, 3, 4, 5], 2), block_hashes([9, 2, 3, 4], 2)
        >>> len(a), a[1] == b[1]   # block [3, 4] after [1, 2] is not block [3, 4] after [9, 2]
        (2, False)
    """
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[start : start + block_size]))))
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Block tables of requests over one pool, with prefix caching.

    A full block is known by its chained hash (`hash_blocks`, by default `block_hashes`: from the hash of the
    block before it and its tokens): equal hashes mean the same tokens at the same positions after the same
    prefix, hence the same keys and values. `allocator_class` builds the free list (a learner's `BlockAllocator`
    may be swapped in, and a learner's `block_hashes`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        allocator_class: Callable[[int], BlockAllocator] = BlockAllocator,
        hash_blocks: Callable[[list[int], int], list[int]] = block_hashes,
    ):
        self.hash_blocks = hash_blocks
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.allocator = allocator_class(num_blocks)
        self.cached: dict[int, int] = {}  # hash of a full block's tokens and prefix -> block id
        self.block_key: list[Optional[tuple[int, tuple[int, ...]]]] = [None] * num_blocks  # block -> (hash, tokens)
        self.cache_hits = 0  # prompt tokens whose keys and values came from the prefix cache

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def prefix_hashes(self, request, num_blocks: int) -> list[int]:
        """The chained hashes of the request's first `num_blocks` full blocks (kept on the request: its tokens
        only grow)."""
        if len(request.block_hashes) < num_blocks:
            full = request.tokens[: num_blocks * self.block_size]
            hashes = list(self.hash_blocks(full, self.block_size))
            if hashes[: len(request.block_hashes)] != request.block_hashes:  # a learner's, not content-determined
                raise PartError(
                    f"part 'block_hashes' gave the first {len(request.block_hashes)} blocks of a request other "
                    "hashes once its tokens grew: a block's hash must depend only on its tokens and those "
                    "before it\n  hint: run the check for 'block_hashes' in chapter 07 to debug it"
                )
            request.block_hashes = hashes
        return request.block_hashes[:num_blocks]

    def cached_prefix(self, request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens, leaving at least the last token
        to compute (its logits are needed)."""
        if not self.prefix_caching:
            return []
        bs, tokens, found = self.block_size, request.tokens, []
        for i, h in enumerate(self.prefix_hashes(request, (len(tokens) - 1) // bs)):
            block = self.cached.get(h)
            if block is None or self.block_key[block] != (h, tuple(tokens[i * bs : (i + 1) * bs])):
                break
            found.append(block)
        return found

    def in_use(self, blocks: list[int]) -> int:
        """How many of `blocks` other requests hold (shared at no cost; the others come off the free list)."""
        return sum(self.allocator.ref_count[b] > 0 for b in blocks)

    def attach_cached_prefix(self, request) -> None:
        """Start a request without blocks on its cached prefix: share those blocks, skip their tokens."""
        for block in self.cached_prefix(request):
            self.allocator.share(block)
            request.block_table.append(block)
        request.num_computed = len(request.block_table) * self.block_size
        self.cache_hits += request.num_computed

    def grow(self, request, num_tokens: int) -> None:
        """Give `request` enough blocks for its first `num_tokens` positions."""
        while len(request.block_table) < blocks_for(num_tokens, self.block_size):
            block = self.allocator.allocate()
            if self.block_key[block] is not None:  # evict what this block cached
                h = self.block_key[block][0]
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.block_key[block] = None
            request.block_table.append(block)

    def remember_full_blocks(self, request) -> None:
        """Make the request's full, computed blocks findable by later requests with the same prefix."""
        if not self.prefix_caching:
            return
        bs, tokens = self.block_size, request.tokens
        full = request.num_computed // bs
        for i, h in enumerate(self.prefix_hashes(request, full)):
            block = request.block_table[i]
            if self.block_key[block] is None and h not in self.cached:
                self.cached[h] = block
                self.block_key[block] = (h, tuple(tokens[i * bs : (i + 1) * bs]))

    def free(self, request) -> None:
        """Release a request's blocks, the last first, so that a prefix's first blocks are evicted last."""
        for block in reversed(request.block_table):
            self.allocator.release(block)
        request.block_table = []
