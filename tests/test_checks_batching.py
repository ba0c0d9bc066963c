"""Chapter 07's checks: the references pass, stubs and plausible mistakes fail with a message that says what
is wrong, other correct ways of writing each exercise pass, the engine's own functions are refused; and the
check-side machinery (the mistake variants of the policy, the workloads) does what the checks rely on."""

import functools
import hashlib
import math
import random
import re
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest
import torch

import llmcourse.checks.batching as batching_checks
from llmcourse.checks import CheckFailed
from llmcourse.checks.batching import (
    alone,
    check_block_allocator,
    check_block_hashes,
    check_left_pad,
    check_paged_attention,
    check_schedule,
    decisive_model,
    policy,
    run_engine,
    schedule_scenario,
    workload,
)
from llmcourse.course.guards import guard, guarded
from llmcourse.engine.padding import left_pad as engine_left_pad
from llmcourse.serving.batching import Batching
from llmcourse.serving.block_manager import BlockAllocator as EngineAllocator
from llmcourse.serving.block_manager import block_hashes as engine_block_hashes
from llmcourse.serving.block_manager import blocks_for
from llmcourse.serving.paged_cache import gather_kv as engine_gather_kv
from llmcourse.serving.paged_cache import paged_attention as engine_paged_attention
from llmcourse.serving.paged_cache import paged_attention_fused
from llmcourse.serving.scheduler import schedule as engine_schedule

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/07_batching/07_batching.ipynb"


# -- references, written as a learner would ---------------------------------------------------------


def left_pad(prompts, pad_id=0):
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids)
        attention_mask[row, longest - len(ids) :] = 1
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


class BlockAllocator:
    def __init__(self, num_blocks):
        self.free = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self):
        return len(self.free)

    def allocate(self):
        if not self.free:
            raise MemoryError("no free block")
        block = self.free.popleft()
        self.ref_count[block] = 1
        return block

    def share(self, block):
        if self.ref_count[block] == 0:
            self.free.remove(block)
        self.ref_count[block] += 1

    def release(self, block):
        if self.ref_count[block] == 0:
            raise ValueError(f"block {block} is not in use")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)


def block_hashes(token_ids, block_size):
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[start : start + block_size]))))
    return hashes


def paged_attention(q, k_pool, v_pool, block_table, lengths):
    G, H, D = q.shape
    bs = k_pool.shape[1]
    m = torch.full((G, H, 1), -math.inf, dtype=q.dtype)
    l = torch.zeros(G, H, 1, dtype=q.dtype)
    acc = torch.zeros(G, H, D, dtype=q.dtype)
    for j in range(-(-int(lengths.max()) // bs)):
        k, v = k_pool[block_table[:, j]], v_pool[block_table[:, j]]  # [G, bs, H, D]: block j of each sequence
        s = torch.einsum("ghd,gthd->ght", q, k) / math.sqrt(D)
        s = s.masked_fill((j * bs + torch.arange(bs) >= lengths[:, None])[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        l = l * torch.exp(m - m_new) + p.sum(-1, keepdim=True)
        acc = acc * torch.exp(m - m_new) + torch.einsum("ght,gthd->ghd", p, v)
        m = m_new
    return acc / l, (m + torch.log(l))[..., 0]


def schedule(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
    budget, free, chunks, preempted = max_num_batched_tokens, num_free_blocks, {}, []
    queue, i = list(running), 0
    while i < len(queue) and budget > 0:
        seq = queue[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free and queue[-1] is not seq:
            victim = queue.pop()
            preempted.append(victim.id)
            free += victim.num_unshared_blocks
        if need > free:
            preempted.append(queue.pop().id)
            break
        chunks[seq.id] = n
        free, budget, i = free - need, budget - n, i + 1
    if preempted:
        return chunks, preempted
    for seq in waiting:
        if len(chunks) >= max_num_seqs or budget == 0:
            break
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        if need > free:
            break
        chunks[seq.id] = n
        free, budget = free - need, budget - n
    return chunks, preempted


REFERENCES = [
    (check_left_pad, left_pad, dict(n_random=40, n_models=3)),
    (check_block_allocator, BlockAllocator, dict(n_random=40, n_workloads=3)),
    (check_block_hashes, block_hashes, dict(n_random=40, n_workloads=3)),
    (check_paged_attention, paged_attention, dict(n_random=40, n_workloads=3)),
    (check_schedule, schedule, dict(n_random=400, n_workloads=3)),
]
IDS = [check.__name__ for check, _, _ in REFERENCES]


@pytest.mark.parametrize("check, reference, hidden", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, hidden, capsys):
    check(reference)
    check(reference, seed=101, **hidden)
    assert capsys.readouterr().out.count("✓") == 2


class StubAllocator:
    def __init__(self, num_blocks):
        raise NotImplementedError()


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "check, fn",
    [
        (check_left_pad, stub),
        (check_block_allocator, StubAllocator),
        (check_block_hashes, stub),
        (check_paged_attention, stub),
        (check_schedule, stub),
    ],
    ids=IDS,
)
def test_stub_is_not_written_yet(check, fn):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(fn)


def fails(check, fn, pattern, **kwargs):
    with pytest.raises(CheckFailed) as err:
        check(fn, **kwargs)
    assert re.search(pattern, str(err.value), re.S), str(err.value)
    assert "Traceback" not in str(err.value)
    return str(err.value)


# -- left_pad ---------------------------------------------------------------------------------------


def pad_positions_count_padding(prompts, pad_id=0):
    """The classic GPT-2 bug: positions 0 … T-1 in every row."""
    ids, mask, _ = left_pad(prompts, pad_id)
    return ids, mask, torch.arange(ids.shape[1]).expand_as(ids).clone()


def pad_right(prompts, pad_id=0):
    longest = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def pad_mask_inverted(prompts, pad_id=0):
    ids, mask, pos = left_pad(prompts, pad_id)
    return ids, 1 - mask, pos


def pad_with_eos_no_mask(prompts, pad_id=0):
    """Pads with <|endoftext|> and lets everything attend everywhere."""
    ids, mask, pos = left_pad(prompts, 50256)
    return ids, torch.ones_like(mask), pos


def pad_mask_all_ones(prompts, pad_id=0):
    ids, mask, pos = left_pad(prompts, pad_id)
    return ids, torch.ones_like(mask), pos


def pad_negative_positions(prompts, pad_id=0):
    ids, mask, _ = left_pad(prompts, pad_id)
    return ids, mask, mask.cumsum(-1) - 1


def pad_float_mask(prompts, pad_id=0):
    ids, mask, pos = left_pad(prompts, pad_id)
    return ids, mask.float(), pos


def pad_lists(prompts, pad_id=0):
    return tuple(t.tolist() for t in left_pad(prompts, pad_id))


def pad_engine(prompts, pad_id=0):
    return engine_left_pad(prompts, pad_id)


def pad_sorts_prompts(prompts, pad_id=0):
    prompts.sort(key=len)
    return left_pad(prompts, pad_id)


def pad_default_eos(prompts, pad_id=50256):
    """A wrong default: the engine calls left_pad(prompts)."""
    return left_pad(prompts, pad_id)


def pad_no_default(prompts, pad_id):
    return left_pad(prompts, pad_id)


def pad_mask_from_ids(prompts, pad_id=0):
    ids, _, _ = left_pad(prompts, pad_id)
    mask = (ids != pad_id).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def pad_positions_uint8(prompts, pad_id=0):
    ids, mask, _ = left_pad(prompts, pad_id)
    return ids, mask, (mask.to(torch.uint8).cumsum(-1, dtype=torch.uint8).long() - 1).clamp(min=0)


def pad_remembers_first_pad(prompts, pad_id=0, _seen={}):
    """Keeps the pad id of the first call with these prompts: pad_id is not part of the key."""
    key = tuple(map(tuple, prompts))
    _seen.setdefault(key, pad_id)
    return left_pad(prompts, _seen[key])


class AlwaysEqual(torch.Tensor):
    """A tensor that says it equals anything."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.equal:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def pad_always_equal(prompts, pad_id=0):
    shape = (len(prompts), max(map(len, prompts)))
    return tuple(torch.zeros(shape, dtype=torch.long).as_subclass(AlwaysEqual) for _ in range(3))


def pad_in_place(prompts, pad_id=0):
    """Pads the caller's lists themselves, then makes the tensors from them."""
    longest = max(map(len, prompts))
    lengths = [len(p) for p in prompts]
    for p in prompts:
        p[:0] = [pad_id] * (longest - len(p))
    mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths])
    return torch.tensor(prompts), mask, (mask.cumsum(-1) - 1).clamp(min=0)


LEFT_PAD_MISTAKES = [
    (pad_always_equal, r"input_ids: expected a plain torch\.Tensor, got a AlwaysEqual"),
    (pad_default_eos, r"without pad_id, the padding holds \[50256\]: the default pad_id must be 0"),
    (
        pad_no_default,
        r"missing 1 required positional argument.*hint: the engine calls left_pad\(prompts\) without "
        r"pad_id",
    ),
    (pad_mask_from_ids, r"the attention mask is 0 on real tokens equal to pad_id = \d+.*not from input_ids != pad_id"),
    (pad_positions_uint8, r"right below 255 and wrong from there on.*int64"),
    (pad_remembers_first_pad, r"the same prompts, pad_id = 13.*: the padding holds \[50256\], expected pad_id = \d+"),
    (pad_positions_count_padding, r"position ids count the padding.*classic GPT-2 pad-position bug.*count real tokens"),
    (pad_right, r"padded on the right.*pad on the LEFT"),
    (pad_mask_inverted, r"attention mask is inverted"),
    (pad_with_eos_no_mask, r"the padding holds \[50256\], expected pad_id = 0"),
    (pad_mask_all_ones, r"attention mask is 1 on the padding too.*0 on padding"),
    (pad_negative_positions, r"position ids on the padding are \[-1\], outside \[0, n_positions\).*clamp"),
    (pad_float_mask, r"attention_mask has dtype torch\.float32, expected torch\.int64"),
    (pad_lists, r"input_ids should be a tensor"),
    (pad_engine, r"llmcourse\.engine\.padding\.left_pad.*write your own"),
    (pad_sorts_prompts, r"changed its input"),
    (pad_in_place, r"changed its input `prompts`.*build a new list"),
]


@pytest.mark.parametrize("fn, pattern", LEFT_PAD_MISTAKES, ids=[f.__name__ for f, _ in LEFT_PAD_MISTAKES])
def test_left_pad_mistakes_are_named(fn, pattern):
    fails(check_left_pad, fn, pattern)


def left_pad_by_rows(prompts, pad_id=0):
    """Correct, written differently: rows built as lists, padding positions = the row's padding length (in range)."""
    longest = max(map(len, prompts))
    rows = [
        (
            [pad_id] * (longest - len(p)) + list(p),
            [0] * (longest - len(p)) + [1] * len(p),
            [longest - len(p)] * (longest - len(p)) + list(range(len(p))),
        )
        for p in prompts
    ]
    return tuple(torch.tensor([r[i] for r in rows]) for i in range(3))


def left_pad_numpy(prompts, pad_id=0):
    """Correct, written differently: numpy arrays (int64 on every platform), positions by np.maximum of a cumsum."""
    lengths = np.array([len(p) for p in prompts])
    longest = int(lengths.max())
    ids = np.full((len(prompts), longest), pad_id, dtype=np.int64)
    columns = np.arange(longest)[None, :]
    mask = (columns >= longest - lengths[:, None]).astype(np.int64)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p) :] = p
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(np.maximum(mask.cumsum(-1) - 1, 0))


@pytest.mark.parametrize("fn", [left_pad_by_rows, left_pad_numpy])
def test_left_pad_alternative_passes(fn, capsys):
    check_left_pad(fn)
    check_left_pad(fn, seed=101, n_random=40, n_models=3)
    assert capsys.readouterr().out.count("✓") == 2


def test_left_pad_pad_position_bug_changes_the_tokens_of_the_batch():
    """The bug also shows in the engine: the generate case alone (no padding cases before it) catches it."""
    model, prompts = decisive_model(0), [[5, 6, 7, 8, 9], [10], [11, 12, 13]]
    before = [engine_left_pad(prompts)]
    from llmcourse import generate

    batched = generate(
        model, prompts, max_new_tokens=8, eos_token_id=None, left_pad=guard("left_pad", pad_positions_count_padding)
    )
    assert batched[0] == generate(model, prompts[0], max_new_tokens=8, eos_token_id=None)
    assert batched[1:] != [generate(model, p, max_new_tokens=8, eos_token_id=None) for p in prompts[1:]]
    assert before[0][0].tolist() == [[5, 6, 7, 8, 9], [0, 0, 0, 0, 10], [0, 0, 11, 12, 13]]


def test_left_pad_that_raises_or_hangs_gets_a_clear_message(monkeypatch):
    def raises(prompts, pad_id=0):
        longest = max(map(len, prompts))
        return torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts[1:]]) if prompts[1:] else prompts[1]

    def hangs(prompts, pad_id=0):
        while True:
            pass

    fails(check_left_pad, raises, r"raised IndexError: list index out of range\n  at line \d+ in raises")
    quick = functools.partial(batching_checks.run_check, seconds=0.5)
    monkeypatch.setattr(batching_checks, "run_check", lambda *a, **k: quick(*a, **{**k, "seconds": 0.5}))
    fails(check_left_pad, hangs, r"did not finish within its 0\.5 CPU-s")


# -- BlockAllocator ---------------------------------------------------------------------------------


class LifoAllocator(BlockAllocator):
    def allocate(self):
        if not self.free:
            raise MemoryError("none")
        block = self.free.pop()
        self.ref_count[block] = 1
        return block


class ReleaseIgnoresUsers(BlockAllocator):
    def release(self, block):
        if self.ref_count[block] == 0:
            raise ValueError("unused")
        self.ref_count[block] = 0
        self.free.append(block)


class ShareKeepsFreeBlock(BlockAllocator):
    def share(self, block):
        self.ref_count[block] += 1


class SilentDoubleRelease(BlockAllocator):
    def release(self, block):
        if self.ref_count[block] == 0:
            return
        super().release(block)


class ReleaseToFront(BlockAllocator):
    def release(self, block):
        if self.ref_count[block] == 0:
            raise ValueError("unused")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.appendleft(block)


class NoMemoryError(BlockAllocator):
    def allocate(self):
        block = self.free.popleft()  # IndexError on an empty deque
        self.ref_count[block] = 1
        return block


class SetFreeList(BlockAllocator):
    """A set as free list: allocate takes the smallest id, not the least recently freed one."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free = set(range(num_blocks))

    def allocate(self):
        if not self.free:
            raise MemoryError("none")
        block = min(self.free)
        self.free.remove(block)
        self.ref_count[block] = 1
        return block

    def release(self, block):
        if self.ref_count[block] == 0:
            raise ValueError("unused")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.add(block)


class EngineSubclass(EngineAllocator):
    pass


class Uint8CountAllocator(BlockAllocator):
    """Counts users in a uint8 array: the 256th user wraps the count to 0."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.ref_count = np.zeros(num_blocks, dtype=np.uint8)

    def allocate(self):
        return int(super().allocate())


class Uint8IdAllocator(BlockAllocator):
    """Block ids in uint8: past 255 they wrap."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free = deque(np.arange(num_blocks).astype(np.uint8).tolist())


class ClassStateAllocator(BlockAllocator):
    """Keeps its free list and counts on the class: a second allocator replaces the first one's."""

    def __init__(self, num_blocks):
        ClassStateAllocator.free = deque(range(num_blocks))
        ClassStateAllocator.ref_count = [0] * num_blocks


class NumpyIdAllocator(BlockAllocator):
    """Correct, written differently: hands out numpy integers (the engine takes any integer type)."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free = deque(np.arange(num_blocks))


ALLOCATOR_MISTAKES = [
    (Uint8CountAllocator, r"256th user: is the count kept in 8 bits"),
    (Uint8IdAllocator, r"a new BlockAllocator\(300\).*block ids go past 255"),
    (ClassStateAllocator, r"two allocators alive at once.*allocator a, BlockAllocator\(5\).*not on the class"),
    (LifoAllocator, r"last in, first out"),
    (ReleaseIgnoresUsers, r"had 2 users: release takes one away"),
    (ShareKeepsFreeBlock, r"share must take it off the free list"),
    (SilentDoubleRelease, r"expected ValueError, your allocator returned.*raise ValueError"),
    (ReleaseToFront, r"goes to the BACK of the free list"),
    (NoMemoryError, r"expected MemoryError, your allocator raised IndexError"),
    (SetFreeList, r"release\(0\).*allocate\(\) returned 0, expected 1|expected free = \[2, 3, 0\]"),
    (EngineSubclass, r"llmcourse\.serving\.block_manager\.BlockAllocator.*write your own"),
]


@pytest.mark.parametrize("cls, pattern", ALLOCATOR_MISTAKES, ids=[c.__name__ for c, _ in ALLOCATOR_MISTAKES])
def test_block_allocator_mistakes_are_named(cls, pattern):
    fails(check_block_allocator, cls, pattern)


class ListAllocator:
    """Correct, written differently: a list as the free list, counts kept in a list filled by comprehension."""

    def __init__(self, num_blocks):
        self.free = [b for b in range(num_blocks)]
        self.ref_count = [0 for _ in range(num_blocks)]

    num_free = property(lambda self: len(self.free))

    def allocate(self):
        try:
            block = self.free.pop(0)
        except IndexError:
            raise MemoryError("the pool is full") from None
        self.ref_count[block] += 1
        return block

    def share(self, block):
        if block in self.free:
            self.free.remove(block)
        self.ref_count[block] += 1

    def release(self, block):
        if not self.ref_count[block]:
            raise ValueError("double release")
        self.ref_count[block] -= 1
        if not self.ref_count[block]:
            self.free += [block]


class NumpyCountAllocator:
    """Correct, written differently: counts in a numpy int64 array, the free list an OrderedDict (O(1) removal)."""

    def __init__(self, num_blocks):
        self.ref_count = np.zeros(num_blocks, dtype=np.int64)
        self._free = OrderedDict.fromkeys(range(num_blocks))

    @property
    def free(self):
        return list(self._free)

    @property
    def num_free(self):
        return np.int64(len(self._free))

    def allocate(self):
        if not self._free:
            raise MemoryError("all blocks are in use")
        block, _ = self._free.popitem(last=False)
        self.ref_count[block] = 1
        return block

    def share(self, block):
        self._free.pop(block, None)
        self.ref_count[block] += 1

    def release(self, block):
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} has no user")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._free[block] = None


@pytest.mark.parametrize("cls", [ListAllocator, NumpyCountAllocator, NumpyIdAllocator])
def test_block_allocator_alternative_passes(cls, capsys):
    check_block_allocator(cls)
    check_block_allocator(cls, seed=101, n_random=40, n_workloads=3)
    assert capsys.readouterr().out.count("✓") == 2


def test_block_allocator_that_raises_gets_a_clear_message():
    class Raising(BlockAllocator):
        def share(self, block):
            raise KeyError(block)

    fails(check_block_allocator, Raising, r"your allocator raised KeyError")
    fails(check_block_allocator, int, r"expected a class|no attribute|free = None")


# -- block_hashes -----------------------------------------------------------------------------------


def hashes_not_chained(token_ids, block_size):
    return [hash(tuple(token_ids[s : s + block_size])) for s in range(0, len(token_ids) - block_size + 1, block_size)]


def hashes_of_partial_blocks(token_ids, block_size):
    hashes = []
    for s in range(0, len(token_ids), block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[s : s + block_size]))))
    return hashes


def hashes_last_token(token_ids, block_size):
    hashes = []
    for s in range(block_size - 1, len(token_ids), block_size):
        hashes.append(hash((hashes[-1] if hashes else None, token_ids[s])))
    return hashes


def hashes_of_sums(token_ids, block_size):
    hashes = []
    for s in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash((hashes[-1] if hashes else None, sum(token_ids[s : s + block_size]))))
    return hashes


def hashes_salted(token_ids, block_size):
    return [hash((h, len(token_ids))) for h in block_hashes(token_ids, block_size)]


def hashes_small(token_ids, block_size):
    return [h % 1000 for h in block_hashes(token_ids, block_size)]


def hashes_as_text(token_ids, block_size):
    return [hex(h) for h in block_hashes(token_ids, block_size)]


def hashes_engine(token_ids, block_size):
    return engine_block_hashes(token_ids, block_size)


def hashes_consuming_tokens(token_ids, block_size):
    """Takes the blocks off the front of the caller's list."""
    hashes = []
    while len(token_ids) >= block_size:
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[:block_size]))))
        del token_ids[:block_size]
    return hashes


def hashes_missing_a_last_full_block(token_ids, block_size):
    """Off by one where the tokens end exactly at a block boundary: the last full block gets no hash."""
    hashes = []
    for s in range(0, len(token_ids) - block_size, block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[s : s + block_size]))))
    return hashes


HASH_MISTAKES = [
    (hashes_not_chained, r"not chained: block \d+ holds .* after different earlier blocks"),
    (hashes_of_partial_blocks, r"a partial last block gets no hash"),
    (hashes_last_token, r"hash every token of the block, not only its last one"),
    (hashes_of_sums, r"the order of the tokens counts"),
    (hashes_salted, r"same tokens after the same prefix in a and b, but got hashes"),
    # Python 3.11's hash(None) (the first block's "previous hash") differs from process to process, so which case
    # first meets a collision of h % 1000 does too: a pair of blocks that got the same hash, or the many-block case.
    (hashes_small, r"some collide|got the same hash"),
    (hashes_as_text, r"expected integers, got '-?0x"),
    (hashes_engine, r"llmcourse\.serving\.block_manager\.block_hashes"),
    (hashes_consuming_tokens, r"changed its input `token_ids`"),
    (hashes_missing_a_last_full_block, r"4 tokens, block_size 4: expected 1 hashes \(one per full block\), got 0"),
]


@pytest.mark.parametrize("fn, pattern", HASH_MISTAKES, ids=[f.__name__ for f, _ in HASH_MISTAKES])
def test_block_hashes_mistakes_are_named(fn, pattern):
    fails(check_block_hashes, fn, pattern)


def hashes_of_whole_prefixes(token_ids, block_size):
    """Correct, written differently: each block keyed by all the tokens up to its end (chained by content)."""
    return [hash(tuple(token_ids[:end])) for end in range(block_size, len(token_ids) + 1, block_size)]


def hashes_sha256(token_ids, block_size):
    """Correct, written differently: sha256 over the previous digest and the block's bytes, as numpy ints."""
    digest, out = b"", []
    for s in range(0, len(token_ids) // block_size * block_size, block_size):
        block = np.array(token_ids[s : s + block_size], dtype=np.int64).tobytes()
        digest = hashlib.sha256(digest + block).digest()
        out.append(np.int64(int.from_bytes(digest[:8], "little", signed=True)))
    return out


def hashes_popping_a_copy(token_ids, block_size):
    """Correct, written differently: takes the blocks off the front of its own copy of the list."""
    rest, hashes = list(token_ids), []
    while len(rest) >= block_size:
        block, rest = rest[:block_size], rest[block_size:]
        hashes.append(hash((hashes[-1] if hashes else None, tuple(block))))
    return hashes


@pytest.mark.parametrize("fn", [hashes_of_whole_prefixes, hashes_sha256, hashes_popping_a_copy])
def test_block_hashes_alternative_passes(fn, capsys):
    check_block_hashes(fn)
    check_block_hashes(fn, seed=101, n_random=40, n_workloads=3)
    assert capsys.readouterr().out.count("✓") == 2


# -- paged_attention --------------------------------------------------------------------------------


def paged_steps(
    q, k_pool, v_pool, block_table, lengths, *, rescale=True, mask=True, through_table=True, scale=None, shift=True
):
    """The reference's loop with one switch per plausible mistake."""
    G, H, D = q.shape
    bs = k_pool.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    m = torch.full((G, H, 1), -math.inf if shift else 0.0, dtype=q.dtype)
    l = torch.zeros(G, H, 1, dtype=q.dtype)
    acc = torch.zeros(G, H, D, dtype=q.dtype)
    columns = -(-int(lengths.max()) // bs) if mask else block_table.shape[1]
    for j in range(columns):
        blocks = block_table[:, j] if through_table else torch.full((G,), j)
        k, v = k_pool[blocks], v_pool[blocks]  # [G, bs, H, D]
        s = torch.einsum("ghd,gthd->ght", q, k) * scale
        if mask:
            s = s.masked_fill((j * bs + torch.arange(bs) >= lengths[:, None])[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True)) if shift else m
        r = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new)
        l = l * r + p.sum(-1, keepdim=True)
        acc = acc * r + torch.einsum("ght,gthd->ghd", p, v)
        m = m_new
    return acc / l, (m + torch.log(l))[..., 0]


def paged_no_rescale(*args):
    return paged_steps(*args, rescale=False)


def paged_no_mask(*args):
    return paged_steps(*args, mask=False)


def paged_block_index(*args):
    return paged_steps(*args, through_table=False)


def paged_scale_d(q, *args):
    return paged_steps(q, *args, scale=1 / q.shape[-1])


def paged_without_running_max(*args):
    """exp of the raw scores, summed block by block: right while they stay below ~88 (float32), nan in float16 past
    ~11."""
    return paged_steps(*args, shift=False)


def paged_scaling_q_in_place(q, k_pool, v_pool, block_table, lengths):
    q *= q.shape[-1] ** -0.5  # the caller's q
    return paged_steps(q, k_pool, v_pool, block_table, lengths, scale=1.0)


def paged_lse_without_max(*args):
    out, lse = paged_attention(*args)
    return out, torch.log(torch.exp(lse - lse.amax()))  # forgot to add the max back


def paged_gathers_everything(q, k_pool, v_pool, block_table, lengths):
    """Right answer, but copies each sequence's keys and values out first: what paged attention avoids."""
    bs, D = k_pool.shape[1], q.shape[-1]
    outs, lses = [], []
    for g, n in enumerate(lengths.tolist()):
        blocks = block_table[g, : -(-n // bs)]
        k, v = k_pool[blocks].flatten(0, 1)[:n], v_pool[blocks].flatten(0, 1)[:n]  # [n, H, D]: a copy
        s = torch.einsum("hd,nhd->hn", q[g], k) / math.sqrt(D)
        top = s.amax(-1, keepdim=True)
        w = torch.exp(s - top)
        outs.append(torch.einsum("hn,nhd->hd", w, v) / w.sum(-1, keepdim=True))
        lses.append((top + w.sum(-1, keepdim=True).log())[:, 0])
    return torch.stack(outs), torch.stack(lses)


def paged_float32(*args):
    out, lse = paged_attention(*args)
    return out.float(), lse.float()


def paged_softmax(q, k_pool, v_pool, block_table, lengths):
    G, H, D = q.shape
    bs = k_pool.shape[1]
    n = block_table.shape[1]
    k, v = k_pool[block_table].flatten(1, 2), v_pool[block_table].flatten(1, 2)  # [G, n * bs, H, D]
    s = torch.einsum("ghd,gthd->ght", q, k) / math.sqrt(D)
    s = s.masked_fill((torch.arange(n * bs) >= lengths[:, None])[:, None, :], -math.inf)
    return torch.einsum("ght,gthd->ghd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def paged_out_only(*args):
    return paged_attention(*args)[0]


def paged_engine(*args):
    return engine_paged_attention(*args)


PAGED_MISTAKES = [
    (paged_no_rescale, r"rescale what was summed so far"),
    (paged_no_mask, r"mask the slots past each sequence's length"),
    (paged_block_index, r"read block j of sequence g where its table says|out of bounds"),
    (paged_scale_d, r"scale the scores by 1/√D \(D = head_dim\), not 1/D"),
    (paged_lse_without_max, r"lse: .*the max m added back"),
    (paged_gathers_everything, r"reading in place: .* made a tensor of shape \[\d+, \d+, 2, 16\]"),
    (paged_float32, r"dtype torch\.float64"),
    (paged_softmax, r"torch\.softmax|torch\.logsumexp"),
    (paged_out_only, r"expected a tuple \(out, lse\), got Tensor"),
    (paged_engine, r"llmcourse\.serving\.paged_cache"),
    (
        paged_without_running_max,
        r"float16, scores of about ±1e4 .*out: got nan or inf.*keep the running max m and take exp\(s - m_new\)",
    ),
    (paged_scaling_q_in_place, r"changed its input `q`.*in-place operation"),
]


@pytest.mark.parametrize("fn, pattern", PAGED_MISTAKES, ids=[f.__name__ for f, _ in PAGED_MISTAKES])
def test_paged_attention_mistakes_are_named(fn, pattern):
    fails(check_paged_attention, fn, pattern)


def paged_per_sequence(q, k_pool, v_pool, block_table, lengths):
    """Correct, written differently: one sequence at a time, all its scores first, then one softmax over them
    (vLLM V1's kernel's order), each block read as a view of the pool."""
    bs, D = k_pool.shape[1], q.shape[-1]
    outs, lses = [], []
    for g in range(q.shape[0]):
        n = int(lengths[g])
        blocks = block_table[g, : -(-n // bs)].tolist()
        s = torch.cat([torch.einsum("hd,thd->ht", q[g], k_pool[b]) for b in blocks], dim=1)[:, :n] / math.sqrt(D)
        top = s.amax(dim=1, keepdim=True)
        w = torch.exp(s - top)  # [H, n]
        out = sum(
            torch.einsum("ht,thd->hd", w[:, i * bs : (i + 1) * bs], v_pool[b][: n - i * bs])
            for i, b in enumerate(blocks)
        )
        outs.append(out / w.sum(dim=1, keepdim=True))
        lses.append(top[:, 0] + torch.log(w.sum(dim=1)))
    return torch.stack(outs), torch.stack(lses)


def paged_two_blocks_at_a_time(q, k_pool, v_pool, block_table, lengths):
    """Correct, written differently: reads two block columns per step, the max taken over both."""
    G, H, D = q.shape
    bs = k_pool.shape[1]
    m = torch.full((G, H), -math.inf, dtype=q.dtype)
    l, acc = torch.zeros(G, H, dtype=q.dtype), torch.zeros(G, H, D, dtype=q.dtype)
    for j in range(0, -(-int(lengths.max()) // bs), 2):
        cols = block_table[:, j : j + 2]  # [G, 1 or 2]
        k = k_pool[cols].flatten(1, 2)  # [G, 2 * bs, H, D]
        v = v_pool[cols].flatten(1, 2)
        s = (k * q[:, None]).sum(-1).transpose(1, 2) / math.sqrt(D)  # [G, H, 2 * bs]
        s = s.masked_fill((j * bs + torch.arange(k.shape[1]) >= lengths[:, None])[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        l = l * torch.exp(m - m_new) + p.sum(-1)
        acc = acc * torch.exp(m - m_new)[..., None] + torch.einsum("ght,gthd->ghd", p, v)
        m = m_new
    return acc / l[..., None], m + torch.log(l)


def paged_float32_state_for_half(q, k_pool, v_pool, block_table, lengths):
    """Correct, written differently: the running m, l and acc in float32 for float16 and bfloat16 inputs, as
    FlashAttention's kernels keep them; rounded to the input's dtype at the end."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    wide = [t.float() if half else t for t in (q, k_pool, v_pool)]
    out, lse = paged_attention(*wide, block_table, lengths)
    return out.to(q.dtype), lse.to(q.dtype)


@pytest.mark.parametrize("fn", [paged_per_sequence, paged_two_blocks_at_a_time, paged_float32_state_for_half])
def test_paged_attention_alternative_passes(fn, capsys):
    check_paged_attention(fn)
    check_paged_attention(fn, seed=101, n_random=40, n_workloads=3)
    assert capsys.readouterr().out.count("✓") == 2


def test_paged_attention_agrees_with_attention_over_the_gathered_keys():
    """Independent of the check's reference: the engine's paged_attention and its fused form give torch's
    attention over each sequence's gathered keys, and the log-sum-exp of its scores."""
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(2, 9, 4, 2, 8, generator=g, dtype=torch.float64)
    table, lengths = torch.tensor([[5, 2, 7], [0, 8, 8]]), torch.tensor([11, 3])
    q = torch.randn(2, 2, 8, generator=g, dtype=torch.float64)
    for route in (engine_paged_attention, paged_attention_fused):
        out, lse = route(q, k_pool, v_pool, table, lengths)
        for row, n in enumerate(lengths.tolist()):
            keys = engine_gather_kv(k_pool, table[row], n)  # [H, n, D]
            values = engine_gather_kv(v_pool, table[row], n)
            want = torch.nn.functional.scaled_dot_product_attention(q[row, :, None], keys, values)[:, 0]
            assert torch.allclose(out[row], want, atol=1e-12)
            scores = (keys @ q[row, :, :, None])[..., 0] / math.sqrt(8)
            assert torch.allclose(lse[row], torch.logsumexp(scores, -1), atol=1e-12)


# -- schedule ---------------------------------------------------------------------------------------


def learner_policy(
    running,
    waiting,
    num_free_blocks,
    *,
    block_size,
    max_num_seqs,
    max_num_batched_tokens,
    victim="newest",
    admit_after_preempt=False,
    skip_unfit=False,
    chunk_waiting=True,
    cached_prefix=True,
    frees_shared=False,
    floor_plus_one=False,
    strict_fit=False,
    past_the_budget=False,
):
    """The check's `policy` (the engine's, or one of the mistakes its flags name), as a learner would write it: the
    check refuses a learner's call to its own functions. (`past_the_budget`: waiting requests admitted while
    budget >= 0, one of 0 tokens after the budget is used up exactly.)"""
    budget, free, chunks, preempted = max_num_batched_tokens, num_free_blocks, {}, []
    queue, i = list(running), 0

    def need_of(seq, n):
        tokens = (seq.num_computed if cached_prefix else 0) + n
        blocks = tokens // block_size + 1 if floor_plus_one else blocks_for(tokens, block_size)
        return blocks - seq.num_blocks + (1 if strict_fit else 0)

    while i < len(queue) and budget > 0:
        seq = queue[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = need_of(seq, n)
        while need > free and len(queue) > i + 1:
            victim_seq = queue.pop() if victim == "newest" else queue.pop(i + 1)
            preempted.append(victim_seq.id)
            free += victim_seq.num_blocks if frees_shared else victim_seq.num_unshared_blocks
        if need > free:
            preempted.append(queue.pop(i).id)
            break
        chunks[seq.id] = n
        free, budget, i = free - need, budget - n, i + 1
    if preempted and not admit_after_preempt:
        return chunks, preempted
    for seq in waiting:
        if len(chunks) >= max_num_seqs or budget < (0 if past_the_budget else 1):
            break
        n = seq.num_tokens - seq.num_computed
        if chunk_waiting:
            n = min(n, budget)
        elif n > budget:
            break
        need = need_of(seq, n)
        if need > free:
            if skip_unfit:
                continue
            break
        chunks[seq.id] = n
        free, budget = free - need, budget - n
    return chunks, preempted


def variant(**flags):
    def fn(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
        return learner_policy(
            running,
            waiting,
            num_free_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            **flags,
        )

    fn.__name__ = "_".join(f"{k}={v}" for k, v in flags.items())
    return fn


def schedule_mutates(running, waiting, num_free_blocks, **limits):
    chunks, preempted = schedule(running, waiting, num_free_blocks, **limits)
    for rid in preempted:
        running[:] = [s for s in running if s.id != rid]
    return chunks, preempted


def schedule_list(running, waiting, num_free_blocks, **limits):
    return list(schedule(running, waiting, num_free_blocks, **limits))


def schedule_waiting_first(running, waiting, num_free_blocks, **limits):
    chunks, preempted = schedule(running, waiting, num_free_blocks, **limits)
    waiting_ids = {s.id for s in waiting}
    return {
        **{k: v for k, v in chunks.items() if k in waiting_ids},
        **{k: v for k, v in chunks.items() if k not in waiting_ids},
    }, preempted


def schedule_engine(running, waiting, num_free_blocks, **limits):
    return engine_schedule(running, waiting, num_free_blocks, **limits)


KEPT = {}


def schedule_remembers_queues(running, waiting, num_free_blocks, **limits):
    """Keeps its answers by the queues alone: the free blocks and limits are not part of the key."""
    key = (tuple(running), tuple(waiting))
    if key not in KEPT:
        KEPT[key] = schedule(running, waiting, num_free_blocks, **limits)
    return KEPT[key]


def schedule_masked_round_up(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
    """Rounds up to whole blocks with a bit mask: right for powers of two only."""
    from llmcourse.serving import block_manager

    real = block_manager.blocks_for
    try:
        globals()["blocks_for"] = lambda n, bs: ((n + bs - 1) & ~(bs - 1)) // bs
        return schedule(
            running,
            waiting,
            num_free_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    finally:
        globals()["blocks_for"] = real


def schedule_id_table(running, waiting, num_free_blocks, **limits):
    """Marks scheduled requests in a table of 256 entries: request ids past 255 do not fit."""
    scheduled = [False] * 256
    chunks, preempted = schedule(running, waiting, num_free_blocks, **limits)
    for rid in chunks:
        scheduled[rid] = True
    return chunks, preempted


def schedule_numpy_counts(running, waiting, num_free_blocks, **limits):
    """Correct, written differently: token counts as numpy integers (the engine takes any integer type)."""
    chunks, preempted = schedule(running, waiting, num_free_blocks, **limits)
    return {rid: np.int64(n) for rid, n in chunks.items()}, preempted


SCHEDULE_MISTAKES = [
    (variant(victim="oldest"), r"preempt the NEWEST running request"),
    (variant(admit_after_preempt=True), r"in a step that preempts, admit no waiting request"),
    (variant(skip_unfit=True), r"first come, first served"),
    (variant(chunk_waiting=False), r"chunked prefill"),
    (variant(frees_shared=True), r"gives back only the blocks nobody else holds"),
    (variant(cached_prefix=False), r"num_computed counts the tokens already in its blocks"),
    (schedule_mutates, r"changed its input `running`"),
    (schedule_list, r"expected a tuple \(chunks, preempted\)"),
    (schedule_waiting_first, r"another order.*running requests first"),
    (schedule_engine, r"llmcourse\.serving\.scheduler\.schedule"),
    (schedule_remembers_queues, r"the same queues, one more free block: scheduled"),
    (schedule_masked_round_up, r"block_size 3 \(not a power of two\).*ceil\(n / 3\)"),
    (schedule_id_table, r"IndexError: list assignment index out of range"),
    (variant(floor_plus_one=True), r"t // block_size \+ 1 is one block too many when t fills its blocks exactly"),
    (variant(strict_fit=True), r"needs no more blocks than are free \(need <= free\)"),
    (variant(past_the_budget=True), r"scheduled \{\d+: \d+, \d+: 0\}.*admit no request with 0 tokens"),
]


@pytest.mark.parametrize("fn, pattern", SCHEDULE_MISTAKES, ids=[f.__name__ for f, _ in SCHEDULE_MISTAKES])
def test_schedule_mistakes_are_named(fn, pattern):
    KEPT.clear()
    fails(check_schedule, fn, pattern)


def schedule_two_phase(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
    """Correct, written differently: the victims are counted from the end with an index, no list popped."""
    budget, free, chunks, preempted = max_num_batched_tokens, num_free_blocks, {}, []
    end = len(running)  # running[:end] are not preempted
    for i, seq in enumerate(running):
        if i >= end or budget <= 0:
            break
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = -(-(seq.num_computed + n) // block_size) - seq.num_blocks
        while need > free and end - 1 > i:
            end -= 1
            preempted.append(running[end].id)
            free += running[end].num_unshared_blocks
        if need > free:
            preempted.append(seq.id)
            return chunks, preempted
        chunks[seq.id] = n
        free -= need
        budget -= n
    if preempted:
        return chunks, preempted
    for seq in waiting:
        n = min(seq.num_tokens - seq.num_computed, budget)
        if len(chunks) >= max_num_seqs or n == 0:
            break
        need = -(-(seq.num_computed + n) // block_size) - seq.num_blocks
        if need > free:
            break
        chunks[seq.id] = n
        free -= need
        budget -= n
    return chunks, preempted


def schedule_by_ceil(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens):
    """Correct, written differently: math.ceil for the blocks, a deque of running requests popped from the right,
    numpy for the arithmetic (converted back to Python ints)."""
    budget, free = np.int64(max_num_batched_tokens), np.int64(num_free_blocks)
    chunks, preempted, queue = {}, [], deque(running)
    served = []
    while queue and budget > 0:
        seq = queue.popleft()
        n = min(np.int64(seq.num_tokens - seq.num_computed), budget)
        need = math.ceil((seq.num_computed + n) / block_size) - seq.num_blocks
        while need > free and queue:
            victim = queue.pop()
            preempted.append(victim.id)
            free += victim.num_unshared_blocks
        if need > free:
            preempted.append(seq.id)
            break
        chunks[seq.id] = int(n)
        free, budget = free - need, budget - n
        served.append(seq)
    if preempted:
        return chunks, preempted
    for seq in waiting:
        if len(chunks) >= max_num_seqs or budget == 0:
            break
        n = min(np.int64(seq.num_tokens - seq.num_computed), budget)
        need = math.ceil((seq.num_computed + n) / block_size) - seq.num_blocks
        if need > free:
            break
        chunks[seq.id] = int(n)
        free, budget = free - need, budget - n
    return chunks, preempted


@pytest.mark.parametrize("fn", [schedule_two_phase, schedule_by_ceil, schedule_numpy_counts])
def test_schedule_alternative_passes(fn, capsys):
    check_schedule(fn)
    check_schedule(fn, seed=101, n_random=400, n_workloads=3)
    assert capsys.readouterr().out.count("✓") == 2


def test_policy_without_flags_is_the_engine_policy_and_each_mistake_differs_somewhere():
    rng = random.Random(5)
    scenarios = [schedule_scenario(rng) for _ in range(3000)]

    def decisions(fn, s):
        running, waiting, free, bs, seqs, budget = s
        return fn(running, waiting, free, block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget)

    for s in scenarios:
        assert decisions(variant(), s) == decisions(engine_schedule, s)
    for flags in [{}, *(flags for flags, _ in batching_checks.SCHEDULE_MISTAKES)]:  # the check's policy: the same
        check_side = functools.partial(policy, **flags)
        assert all(decisions(check_side, s) == decisions(variant(**flags), s) for s in scenarios[:300]), flags
    for fn, _ in SCHEDULE_MISTAKES[:6]:
        assert sum(decisions(fn, s) != decisions(engine_schedule, s) for s in scenarios[:600]) >= 5, fn.__name__


# -- the engine runs the checks use ---------------------------------------------------------------


def test_check_workloads_preempt_share_prefixes_and_chunk_prompts():
    for seed in (0, 101, 102, 103):
        work, model = workload(seed), decisive_model(seed)
        tokens, stats = run_engine(model, work, Batching())
        assert tokens == alone(model, work)
        assert stats["preemptions"] > 0 and stats["cached_tokens"] > 0, stats
        assert max(map(len, work.prompts)) > work.engine["max_num_batched_tokens"]
    assert not hasattr(model, "batching") and model.parts.overridden() == []  # nothing left installed on the model


def test_check_workloads_end_requests_at_eos_id_0():
    """The engine cases' workloads: every request stops at EOS id 0, several end early (blocks given back mid-run),
    and relabelling the token as 0 changes nothing else."""
    for seed in (0, 101, 102, 103):
        model = decisive_model(seed)
        plain = workload(seed)
        before = alone(model, plain)
        work = batching_checks.ending_at_token_0(model, plain)
        tokens, _ = run_engine(model, work, Batching())
        assert tokens == alone(model, work)
        assert all(s["eos_token_id"] == 0 for s in work.settings)
        ended = [i for i, row in enumerate(tokens) if row[-1] == 0 and len(row) < work.settings[i]["max_new_tokens"]]
        assert len(ended) >= 2, (seed, tokens)
        generated = [t for row in before for t in row[:-1]]
        swap = {0: max(set(generated), key=generated.count)}
        swap[swap[0]] = 0
        for i, row in enumerate(before):
            if "temperature" not in work.settings[i]:  # greedy: the same tokens, relabelled, up to the first 0
                relabelled = [swap.get(t, t) for t in row]
                assert tokens[i] == relabelled[: relabelled.index(0) + 1 if 0 in relabelled else None], (seed, i)


def test_engine_with_a_wrong_part_differs_from_alone():
    """What the engine cases are there for: a wrong paged attention or schedule gives other tokens, or a clear
    error."""
    work, model = workload(0), decisive_model(0)
    expected = alone(model, work)
    for wrong in (Batching(paged_attention=paged_no_mask), Batching(paged_attention=paged_block_index)):
        try:
            got, _ = run_engine(model, work, wrong)
        except RuntimeError:
            got = None
        assert got != expected
    with pytest.raises(Exception, match="schedule|blocks"):
        run_engine(model, work, guarded(Batching, schedule=variant(cached_prefix=False)))


def test_left_pad_gives_transformers_each_prompt_alone_and_the_bug_does_not(small_pair):
    """Independent of the engine: transformers' GPT-2 on a batch padded by the reference left_pad (its mask and
    position ids) gives each row the last-position logits of its prompt alone; with positions 0 … T-1 it does not."""
    _, hf = small_pair
    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]]
    alone_logits = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    for pad, exact in [(left_pad, True), (pad_positions_count_padding, False)]:
        ids, mask, positions = pad(prompts)
        with torch.no_grad():
            batch = hf(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        close = [torch.allclose(batch[r], alone_logits[r], atol=1e-4) for r in range(len(prompts))]
        assert close == ([True] * 3 if exact else [True, False, False]), (pad.__name__, close)
