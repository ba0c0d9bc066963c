"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Every request has `num_tokens` (prompt plus the tokens generated so far) and `num_computed` (those
whose keys and values are in the cache). A step computes the next `num_tokens - num_computed`
tokens of some requests, or a chunk of them: a decoding request needs one, a new one its prompt.
`schedule` is the policy, a pure function of what the scheduler sees (`SeqView`s and the number of
free blocks); `Scheduler` keeps the queues and applies its decisions through the `BlockManager`.

    >>> running = [SeqView(id=0, num_tokens=9, num_computed=8, num_blocks=1, num_unshared_blocks=1)]  # decoding
    >>> waiting = [SeqView(id=1, num_tokens=40, num_computed=0, num_blocks=0, num_unshared_blocks=0)]  # new
    >>> schedule(running, waiting, num_free_blocks=2, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    ({0: 1, 1: 31}, [])
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import deque
from typing import Callable, NamedTuple, Optional

import torch

from llmcourse.engine.sampling import SamplingParams
from llmcourse.engine.slots import PartError

from .block_manager import BlockManager, blocks_for


class SeqView(NamedTuple):
    """What the scheduling policy sees of a request.

    `num_blocks` is the length of its block table, `num_unshared_blocks` how many of those no other
    request holds: what preempting it gives back (a block shared with a prefix-caching neighbour stays).
    For a waiting request, `num_computed` and `num_blocks` count its cached prefix: the tokens it can
    skip, and the blocks of that prefix that other requests hold (shared at no cost; a cached block
    nobody holds comes off the free list like a new one); it has no unshared blocks.
    """

    id: int
    num_tokens: int  # prompt + generated so far
    num_computed: int  # tokens whose keys and values are already in the cache
    num_blocks: int  # blocks in its table
    num_unshared_blocks: int  # blocks that only it holds


def schedule(
    running: list[SeqView],
    waiting: list[SeqView],
    num_free_blocks: int,
    *,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[dict[int, int], list[int]]:
    """One scheduler step -> ({request id: tokens to compute this step}, [ids preempted, newest first]).

    1. Running requests, oldest first, each get min(tokens left to compute, token budget left); a request
       that needs more blocks than are free preempts the newest running request (its unshared blocks
       come free; it will be recomputed later) until they fit, or preempts itself if it is the newest.
    2. If nothing was preempted, waiting requests join in arrival order while there are fewer than
       `max_num_seqs`, budget is left and their blocks fit; the first that does not fit stops the
       admissions (first come, first served).
    """
    budget, free = max_num_batched_tokens, num_free_blocks
    chunks: dict[int, int] = {}
    preempted: list[int] = []
    queue = list(running)
    i = 0
    while i < len(queue) and budget > 0:
        seq = queue[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free and queue[-1] is not seq:
            victim = queue.pop()
            preempted.append(victim.id)
            free += victim.num_unshared_blocks
        if need > free:  # the newest itself: it waits for the others to finish
            preempted.append(queue.pop().id)
            break
        chunks[seq.id] = n
        free -= need
        budget -= n
        i += 1
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
        free -= need
        budget -= n
    return chunks, preempted


@dataclasses.dataclass(eq=False)
class Request:
    """One request: its tokens, its place in the paged cache, and how it decodes."""

    id: int
    prompt: list[int]
    settings: SamplingParams
    max_new_tokens: int
    eos_token_id: Optional[int]
    stop: tuple[str, ...] = ()
    generator: Optional[torch.Generator] = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    num_computed: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of its full blocks, for prefix caching
    finished: bool = False
    num_logprobs: Optional[int] = None  # record log-probabilities with this many alternatives (None: not at all)
    logprobs: list = dataclasses.field(default_factory=list)  # one `TokenLogprobs` per generated token
    guide: Optional[object] = None  # a `structured.Guide`: the constraint it follows (None: free)

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class Scheduler:
    """The waiting and running queues; each step asks `policy` (`schedule` or a learner's) what to run."""

    def __init__(
        self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int, policy: Callable = schedule
    ):
        self.blocks, self.policy = blocks, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.num_preempted = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def running_view(self, request: Request) -> SeqView:
        unshared = sum(self.blocks.allocator.ref_count[b] == 1 for b in request.block_table)
        return SeqView(request.id, len(request.tokens), request.num_computed, len(request.block_table), unshared)

    def waiting_view(self, request: Request) -> SeqView:
        prefix = self.blocks.cached_prefix(request)
        return SeqView(
            request.id, len(request.tokens), len(prefix) * self.blocks.block_size, self.blocks.in_use(prefix), 0
        )

    def next_step(self) -> list[tuple[Request, int]]:
        """The requests to run in this step, each with its number of tokens; blocks are allocated for them."""
        by_id = {r.id: r for r in self.running + list(self.waiting)}
        views = [self.running_view(r) for r in self.running], [self.waiting_view(r) for r in self.waiting]
        chunks, preempted = self.policy(
            *views,
            self.blocks.num_free,
            block_size=self.blocks.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        check_decisions(chunks, preempted, *views)
        for rid in preempted:  # newest first: the oldest ends up at the front of the queue
            request = by_id[rid]
            self.running.remove(request)
            self.blocks.free(request)
            request.num_computed = 0
            self.waiting.appendleft(request)
            self.num_preempted += 1
        batch = []
        for rid, n in chunks.items():
            request = by_id[rid]
            if request in self.waiting:
                self.blocks.attach_cached_prefix(request)
                n = min(n, len(request.tokens) - request.num_computed)
                if (
                    blocks_for(request.num_computed + n, self.blocks.block_size) - len(request.block_table)
                    > self.blocks.num_free
                ):  # part of its cached prefix was evicted by a request before it
                    self.blocks.free(request)
                    request.num_computed = 0
                    continue
                self.waiting.remove(request)
                self.running.append(request)
            self.blocks.grow(request, request.num_computed + n)
            batch.append((request, n))
        return batch

    def finish(self, request: Request) -> None:
        request.finished = True
        self.running.remove(request)
        self.blocks.free(request)

    def abort(self, request: Request) -> None:
        """Take a request out wherever it is, its blocks freed."""
        request.finished = True
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.blocks.free(request)


def check_decisions(chunks, preempted, running: list[SeqView], waiting: list[SeqView]) -> None:
    """Refuse decisions the engine cannot carry out (a learner's policy), naming what is wrong."""

    def fail(problem: str):
        raise PartError(
            f"part 'schedule' {problem}\n  running: {running}\n  waiting: {waiting}\n"
            "  hint: run the check for 'schedule' in chapter 07 to debug it"
        )

    if not (isinstance(chunks, dict) and isinstance(preempted, list)):
        fail(
            f"returned {type(chunks).__name__}, {type(preempted).__name__}; expected a dict "
            "{request id: tokens to compute} and a list of preempted ids"
        )
    views = {s.id: s for s in running + waiting}
    running_ids = {s.id for s in running}
    for rid in preempted:
        if rid not in running_ids:
            fail(f"preempted request {rid!r}, which is not running")
    for rid, n in chunks.items():
        if rid not in views or rid in preempted:
            fail(f"scheduled request {rid!r}, which is not " + ("running" if rid in preempted else "known"))
        left = views[rid].num_tokens - views[rid].num_computed
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= left:
            fail(f"gave request {rid} {n!r} tokens; it has {left} to compute (give 1 to {left})")
        chunks[rid] = int(n)  # any integer type (numpy's too)
    if not chunks and not preempted and (running or waiting):
        fail("scheduled nothing and preempted nothing while requests wait: the engine would never finish")
