"""The swappable functions of the paged, continuously batched `LLMEngine` (chapter 07): block allocator,
slot mapping, paged gather, scheduler step, and chapter 03's merge of partial attentions.

    >>> Batching().replace(gather_kv=gather_kv).overridden()
    []
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from llmcourse.engine.slots import Slots
from llmcourse.engine.tiled_attention import merge_attention

from .block_manager import BlockAllocator
from .paged_cache import gather_kv, slot_mapping
from .scheduler import schedule


@dataclasses.dataclass(frozen=True)
class Batching(Slots):
    """The functions `LLMEngine` calls (chapter 07): `LLMEngine(model, batching=Batching().replace(gather_kv=...))`
    swaps some. (Chapter 07's `left_pad` is generation's: `generate(..., left_pad=...)`.)"""

    BlockAllocator: Callable = BlockAllocator
    slot_mapping: Callable = slot_mapping
    gather_kv: Callable = gather_kv
    merge_attention: Callable = merge_attention  # chapter 03's: combines the partitions of a long context
    schedule: Callable = schedule
