"""The swappable functions of the paged, continuously batched `LLMEngine` (chapter 07): block allocator,
prefix-cache block hash, paged attention, scheduler step, and chapter 03's merge of partial attentions.

    >>> Batching().replace(paged_attention=paged_attention_fused).overridden()
    []
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from llmcourse.engine.slots import Slots
from llmcourse.engine.tiled_attention import merge_attention

from .block_manager import BlockAllocator, block_hashes
from .paged_cache import paged_attention_fused
from .scheduler import schedule


@dataclasses.dataclass(frozen=True)
class Batching(Slots):
    """The functions `LLMEngine` calls (chapter 07):
    `LLMEngine(model, batching=Batching().replace(paged_attention=...))` swaps some.
    (Chapter 07's `left_pad` is generation's: `generate(..., left_pad=...)`.)"""

    BlockAllocator: Callable = BlockAllocator
    block_hashes: Callable = block_hashes
    paged_attention: Callable = paged_attention_fused  # paged_attention's contract, fused per partition
    merge_attention: Callable = merge_attention  # chapter 03's: combines the partitions of a long context
    schedule: Callable = schedule
