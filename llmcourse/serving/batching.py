"""Batching's swappable functions (chapter 07): left padding for a static batch, and the pieces of the
paged, continuously batched `LLMEngine` (block allocator, slot mapping, paged gather, scheduler step).

    >>> input_ids, attention_mask, position_ids = left_pad([[5, 6, 7], [8]])
    >>> input_ids.tolist(), attention_mask.tolist(), position_ids.tolist()
    ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Callable

import torch
from torch import Tensor

from .block_manager import BlockAllocator
from .paged_cache import gather_kv, slot_mapping
from llmcourse.engine import parts
from llmcourse.engine.parts import Slots, guarded, part_failed
from .scheduler import schedule


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts of different lengths as one batch, padded on the left so that every row's last token is
    in the last column (where the next token is read and appended).

    -> input_ids, attention_mask (1 = real token, 0 = padding), position_ids (0, 1, … counting real tokens
    only; 0 on padding), each [B, longest] long.
    """
    longest = max(map(len, prompts))
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, longest - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


@dataclasses.dataclass(frozen=True)
class Batching(Slots):
    """The batching functions the engine calls: `generate`'s static batches use `left_pad`, `LLMEngine`
    the rest. `Batching.with_overrides(gather_kv=my_gather_kv)` swaps some for a learner's, guarded."""

    left_pad: Callable = left_pad
    BlockAllocator: Callable = BlockAllocator
    slot_mapping: Callable = slot_mapping
    gather_kv: Callable = gather_kv
    schedule: Callable = schedule

    @classmethod
    def with_overrides(cls, **overrides: Callable) -> "Batching":
        """The engine's batching functions with some replaced, each guarded."""
        cls.check_overrides(overrides)
        wrap = {"left_pad": guarded_left_pad, "BlockAllocator": guarded_allocator, "schedule": raising_part,
                "slot_mapping": guarded_slot_mapping}
        return cls(**{n: wrap[n](fn) if n in wrap else guarded(n, fn, _expected) for n, fn in overrides.items()})


def _expected(name: str, args: tuple) -> tuple[tuple, torch.dtype]:
    pool, length = args[0], args[2]  # gather_kv
    return (pool.shape[2], length, pool.shape[3]), pool.dtype


def _fail(name: str, fn: Callable, problem: str, cause: Exception = None):
    part_failed(name, fn, problem, "07", cause)


def raising_part(fn: Callable, name: str = "schedule") -> Callable:
    return parts.raising_part(fn, name, "07")


def guarded_left_pad(fn: Callable) -> Callable:
    call = raising_part(fn, "left_pad")

    @functools.wraps(fn)
    def checked(prompts: list[list[int]], *args):
        out = call(prompts, *args)
        shape = (len(prompts), max(map(len, prompts)))
        if not (isinstance(out, tuple) and len(out) == 3 and all(
                isinstance(t, Tensor) and tuple(t.shape) == shape and t.dtype == torch.long for t in out)):
            _fail("left_pad", fn, f"returned {out!r:.200}; expected (input_ids, attention_mask, position_ids), "
                                  f"each a long tensor of shape {shape}")
        return out

    return checked


def guarded_slot_mapping(fn: Callable) -> Callable:
    """A learner's `slot_mapping`: slots [N] long (that they lie inside the pool is checked where it is known)."""
    call = raising_part(fn, "slot_mapping")

    @functools.wraps(fn)
    def checked(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
        out = call(block_table, positions, block_size)
        if not isinstance(out, Tensor) or tuple(out.shape) != tuple(positions.shape) or out.dtype != torch.long:
            got = f"shape {tuple(out.shape)} dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            _fail("slot_mapping", fn, f"returned {got}; expected slots of shape {tuple(positions.shape)}, dtype "
                                      f"torch.long\n  called with: block_table={block_table.tolist()}, "
                                      f"positions={positions.tolist()}, block_size={block_size}")
        return out

    return checked


def guarded_allocator(cls: Callable) -> Callable:
    """A learner's `BlockAllocator` class; its methods' exceptions name the part, `allocate`'s ids are checked."""

    class Guarded:
        def __init__(self, num_blocks: int):
            self.num_blocks = num_blocks
            self.inner = raising_part(cls, "BlockAllocator")(num_blocks)
            self.users = [0] * num_blocks  # what the engine asked for, to catch a block handed out twice

        @property
        def num_free(self) -> int:
            n = raising_part(lambda: self.inner.num_free, "BlockAllocator")()
            if n != self.users.count(0):
                _fail("BlockAllocator", cls, f"num_free is {n!r}, but {self.users.count(0)} blocks are not in use")
            return n

        @property
        def ref_count(self) -> list[int]:
            return self.users

        def allocate(self) -> int:
            block = raising_part(self.inner.allocate, "BlockAllocator")()
            if isinstance(block, bool) or not isinstance(block, numbers.Integral) or not 0 <= block < self.num_blocks:
                _fail("BlockAllocator", cls, f"allocate() returned {block!r}, not a block id in [0, {self.num_blocks})")
            block = int(block)  # any integer type (numpy's too): the block tables hold Python ints
            if self.users[block]:
                _fail("BlockAllocator", cls, f"allocate() returned block {block}, which is in use "
                                             f"({self.users[block]} user(s)): it would be handed out twice")
            self.users[block] = 1
            return block

        def share(self, block: int) -> None:
            raising_part(self.inner.share, "BlockAllocator")(block)
            self.users[block] += 1

        def release(self, block: int) -> None:
            raising_part(self.inner.release, "BlockAllocator")(block)
            self.users[block] -= 1

    return Guarded
