"""Checks for chapter 07, batching: left padding, the block allocator of a paged KV cache, the prefix cache's
chained block hashes, paged attention (the online softmax over a sequence's blocks, read in place), and one
scheduler step.

Each check compares the learner's code with the engine's (`llmcourse.engine.padding.left_pad`,
`llmcourse.serving.block_manager.BlockAllocator`, `llmcourse.serving.scheduler.schedule`), with a plain
float64 reference (`paged_attention`), or with the properties the prefix cache relies on (`block_hashes`:
its values are the learner's choice) on fixed edge cases and seeded random ones, and then runs the engine
with the learner's function in its slot on a small random model: a static batch (`llmcourse.generate`
on several prompts) or `LLMEngine` (a workload with chunked prefill, a shared prefix, preemption and decode
contexts split into partitions) must give every request exactly the tokens it gets alone (every request
stops at EOS id 0, and several do end early). The cases reach what the engine meets: `left_pad` called
without its pad id (as the engine calls it), real tokens equal to the pad id, 1024-token prompts; pools of
300 blocks and a block with 300 users, two allocators alive at once; block sizes that are not powers of two
and a server's scale for `schedule`, with requests that fill their blocks, the free blocks or the token budget
exactly; stale keys in unused slots, a non-contiguous query, and float16 and bfloat16 with scores of about 1e4
for `paged_attention`; the same input with one argument changed; Python ints where the engine takes them.
Expected answers are computed after the learner's call.

    >>> def block_hashes(token_ids, block_size):
    ...     hashes = []
    ...     for start in range(0, len(token_ids) - block_size + 1, block_size):
    ...         hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[start : start + block_size]))))
    ...     return hashes
    >>> check_block_hashes(block_hashes)
    ✓ block_hashes — 43 cases
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import numbers
import random
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guard, guarded
from llmcourse.engine.generate import generate
from llmcourse.engine.padding import left_pad as engine_left_pad
from llmcourse.engine.slots import raised
from llmcourse.serving.batching import Batching
from llmcourse.serving.block_manager import BlockAllocator as EngineAllocator
from llmcourse.serving.block_manager import blocks_for
from llmcourse.serving.llm_engine import LLMEngine
from llmcourse.serving.scheduler import SeqView
from llmcourse.serving.scheduler import schedule as engine_schedule

from .attention import large_exact_scores, overflowing
from .harness.core import Case, Verdict, call_learner, later, one_hint, run_check
from .harness.forbid import DispatchWatch, Forbidden
from .harness.show import short
from .harness.tensors import diagnose, plain_tensor_problem, tensor_problem
from .kv_cache import decisive_model, one_thread

GPT2_POSITIONS = 1024

# ----------------------------------------------------------------------------------------------
# Running the engine with a learner's function in a slot


@dataclasses.dataclass
class Workload:
    """Prompts for `LLMEngine` on a tiny model, with what each request gets alone (`expected`)."""

    prompts: list
    settings: list  # one dict per prompt
    arrivals: list
    engine: dict  # LLMEngine's arguments

    def __repr__(self) -> str:
        lengths = [len(p) for p in self.prompts]
        return (
            f"{len(self.prompts)} requests (prompt lengths {lengths}, arriving at steps {self.arrivals}) on "
            f"LLMEngine(tiny random model, {', '.join(f'{k}={v}' for k, v in self.engine.items())})"
        )


def workload(seed: int, n: int = 6) -> Workload:
    """Requests that exercise the whole engine on `decisive_model`: several share an 8-token prefix (two blocks
    of 4: prefix caching), prompts up to 21 tokens (chunked prefill under a budget of 12 tokens), staggered
    arrivals, one sampled request, and a pool of 10 blocks that forces preemption."""
    rng = random.Random(seed)
    prefix = [rng.randrange(97) for _ in range(8)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(97) for _ in range(rng.randint(1, 13))]
        prompts.append(prefix + tail if i % 2 == 0 else tail)
    settings = [{"max_new_tokens": rng.randint(4, 10)} for _ in range(n)]
    settings[1].update(temperature=0.8, seed=seed + 3)
    arrivals = sorted(rng.randint(0, 6) for _ in range(n))
    return Workload(
        prompts,
        settings,
        arrivals,
        dict(block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=12, partition_size=8),
    )


def ending_at_token_0(model, work: Workload) -> Workload:
    """`work` where every request ends at EOS id 0 (token 0: a real id, easy to take for "none"), and some do end
    early, giving their blocks back while the others run: the token the requests generate most often is swapped
    with token 0 in the model (its row of the tied embedding) and in the prompts, which relabels it and changes
    nothing else. The model is changed in place."""
    tokens = [t for row in alone(model, work) for t in row[:-1]]
    t = max(set(tokens), key=tokens.count) if tokens else 0
    if t != 0:
        with torch.no_grad():
            weight = model.wte.weight
            weight[[0, t]] = weight[[t, 0]]
    swap = {0: t, t: 0}
    prompts = [[swap.get(i, i) for i in p] for p in work.prompts]
    return dataclasses.replace(work, prompts=prompts, settings=[{**s, "eos_token_id": 0} for s in work.settings])


def alone(model, work: Workload) -> list[list[int]]:
    """Each request by itself, with `llmcourse.generate`."""
    with one_thread():
        return [generate(model, p, **{"eos_token_id": None, **s}) for p, s in zip(work.prompts, work.settings)]


def run_engine(model, work: Workload, batching: Batching) -> tuple[list[list[int]], dict]:
    """The workload through `LLMEngine(model, ..., batching=batching)`.
    -> the tokens of each request, and the engine's stats."""
    watch = sys.getprofile()
    sys.setprofile(None)  # the engine's own code is not watched (and runs faster): `watched` re-arms it for theirs
    try:
        with one_thread():
            engine = LLMEngine(model, **work.engine, batching=batching)
            tokens = engine.generate(work.prompts, work.arrivals, work.settings, eos_token_id=None)
            return tokens, engine.stats
    finally:
        sys.setprofile(watch)


def watched(fn: Callable) -> Callable:
    """fn, called with the check's watch for black boxes on (run_engine switches it off around the engine)."""
    watch = sys.getprofile()

    @functools.wraps(fn)
    def call(*args, **kwargs):
        outside = sys.getprofile()
        sys.setprofile(watch)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(outside)

    return call


ENGINE_RUNS: dict[int, tuple] = {}  # seed -> (model, workload): kept out of the cases' arguments, which must not change


def _alone_of(seed: int) -> list[list[int]]:
    return alone(*ENGINE_RUNS[seed])


def engine_case(name: str, seed: int) -> Case:
    """A case that runs `workload(seed)` through LLMEngine with the learner's `name`; expected: the tokens alone
    (computed after the learner's run: no answer is kept where their code could read it)."""
    if seed not in ENGINE_RUNS:
        model = decisive_model(seed)
        work = ending_at_token_0(model, workload(seed))
        ENGINE_RUNS[seed] = (model, work)
    return Case(f"LLMEngine with your {name}", ("engine", seed), later(_alone_of, seed))  # computed after the call


def _engine_verdict(name: str, work: Workload, expected: list, got: list) -> Verdict:
    if got == expected:
        return None
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    return (
        f"request {i} (prompt of {len(work.prompts[i])} tokens) got different tokens in LLMEngine than alone: "
        f"expected {short(expected[i], 80)}, got {short(got[i], 80)}",
        f"every request must get exactly its tokens alone; your {name} passes the cases above but not this run "
        "of the engine, whose requests share blocks, are preempted and prefilled in chunks",
    )


# ----------------------------------------------------------------------------------------------
# Exercise 1: left_pad


NO_ENGINE_PAD = Forbidden(
    "llmcourse.engine.padding.left_pad",
    "The engine's left_pad is what yours is compared with: write your own (torch.full, slicing and cumsum).",
)


DEFAULT_PAD_HINT = (
    "the engine calls left_pad(prompts) without pad_id: give it its default, def left_pad(prompts, pad_id=0)"
)


def _pad_verdict(case: Case, got: Any) -> Verdict:
    prompts, pad_id = case.args[1], case.args[2]
    default = pad_id is None  # called as the engine calls it: left_pad(prompts)
    pad_id = 0 if default else pad_id
    exp_ids, exp_mask, exp_pos = case.expected
    shape = tuple(exp_ids.shape)
    names = ("input_ids", "attention_mask", "position_ids")
    if not isinstance(got, tuple) or len(got) != 3:
        return (
            f"expected a tuple (input_ids, attention_mask, position_ids), got {short(got, 80)}",
            "return input_ids, attention_mask, position_ids",
        )
    for name, t in zip(names, got):
        if not isinstance(t, Tensor):
            return f"{name} should be a tensor, got {short(t, 60)}", ""
        problem = plain_tensor_problem(t, exp_ids)
        if problem:
            return f"{name}: {problem}", ""
        if tuple(t.shape) != shape:
            return (
                f"{name} has shape {tuple(t.shape)}, expected [B, longest] = {shape}",
                "one row per prompt, as many columns as the longest prompt has tokens",
            )
        if t.dtype != torch.long:
            return f"{name} has dtype {t.dtype}, expected torch.int64", "make it with dtype=torch.long"
    ids, mask, pos = got
    rows = [(r, len(p)) for r, p in enumerate(prompts)]
    if not torch.equal(ids, exp_ids):
        if any(n < shape[1] and ids[r, :n].tolist() == prompts[r] for r, n in rows):
            return (
                "the prompts are padded on the right",
                "pad on the LEFT: every row's last token must be in the last column, where the model reads the "
                "next token's logits and where the new token is appended",
            )
        real = exp_mask.bool()
        if torch.equal(ids[real], exp_ids[real]):
            found = sorted(set(ids[~real].tolist()))
            if default:
                return (
                    f"called as the engine calls it, left_pad(prompts) without pad_id, the padding holds "
                    f"{short(found, 40)}: the default pad_id must be 0",
                    "def left_pad(prompts, pad_id=0): the engine pads with the default, on models of any "
                    "vocabulary (a model of 97 tokens has no token 50256: its embedding would fail)",
                )
            return (f"the padding holds {short(found, 40)}, expected pad_id = {pad_id}", "fill the padding with pad_id")
        return "input_ids differ", "row r holds prompts[r] in its last len(prompts[r]) columns"
    if not torch.equal(mask, exp_mask):
        if torch.equal(mask, 1 - exp_mask):
            return "the attention mask is inverted", "the mask is 1 on real tokens (attend) and 0 on padding"
        clash = exp_mask.bool() & (exp_ids == pad_id)
        if bool(clash.any()) and torch.equal(mask, (exp_ids != pad_id).long()):
            r, c = (int(i) for i in torch.nonzero(clash)[0])
            return (
                f"the attention mask is 0 on real tokens equal to pad_id = {pad_id} (row {r}, column {c})",
                "a prompt may contain the pad id as a real token: build the mask from each prompt's length "
                "(its last len(prompt) columns), not from input_ids != pad_id",
            )
        if bool((mask == 1).all()):
            return (
                "the attention mask is 1 on the padding too",
                "0 on padding: otherwise the real tokens attend to the pad tokens, and a padded row computes "
                "something else than the prompt alone",
            )
        return "attention_mask differs", "1 on each row's real tokens (its last len(prompt) columns), 0 before"
    real = exp_mask.bool()
    if not torch.equal(pos[real], exp_pos[real]):
        arange = torch.arange(shape[1]).expand(shape)
        if torch.equal(pos[real], arange[real]):
            return (
                "the position ids count the padding: a padded row's first real token is at position "
                f"{int(exp_mask.shape[1] - exp_mask.sum(1).min())}, not 0 — the classic GPT-2 pad-position bug",
                "position ids count real tokens only: 0, 1, 2, … from each row's first real token "
                "(attention_mask.cumsum(-1) - 1); with positions 0 … T-1 for every row, a padded prompt gets "
                "other position embeddings than alone, hence other tokens",
            )
        low = real & (exp_pos < 255)
        if bool((exp_pos[real] >= 255).any()) and torch.equal(pos[low], exp_pos[low]):
            return (
                "the position ids are right below 255 and wrong from there on (do they wrap around in 8 bits?)",
                "keep them in int64 (torch.long) all the way: GPT-2 has 1024 positions",
            )
        return "position ids differ on the real tokens", "0, 1, 2, … from each row's first real token"
    if pos.numel() and not bool(((pos >= 0) & (pos < GPT2_POSITIONS)).all()):
        bad = pos[(pos < 0) | (pos >= GPT2_POSITIONS)]
        return (
            f"position ids on the padding are {short(sorted(set(bad.tolist())), 40)}, outside [0, n_positions)",
            "padding positions are never read, but they index the position embeddings: clamp them, e.g. to 0",
        )
    return None


BATCH_RUNS: dict[int, tuple] = {}


def batch_run(seed: int) -> tuple:
    """(tiny random model, a batch of prompts of lengths 5, 1, 9 and 3)."""
    if seed not in BATCH_RUNS:
        model, rng = decisive_model(seed), random.Random(seed)
        prompts = [[rng.randrange(97) for _ in range(n)] for n in (5, 1, 9, 3)]
        prompts[2][0] = prompts[3][1] = 0  # real tokens equal to the pad id the engine uses
        BATCH_RUNS[seed] = (model, prompts)
    return BATCH_RUNS[seed]


def batch_alone(seed: int) -> list[list[int]]:
    """Each prompt of `batch_run(seed)`'s 8 greedy tokens alone."""
    model, prompts = batch_run(seed)
    with one_thread():
        return [generate(model, p, max_new_tokens=8, eos_token_id=None) for p in prompts]


def check_left_pad(fn, *, seed: int = 0, n_random: int = 6, n_models: int = 1) -> None:
    """left_pad(prompts, pad_id=0) -> input_ids, attention_mask, position_ids, each [B, longest] long: left
    padding, mask 1 on real tokens, position ids counting real tokens; and llmcourse.generate on a batch with
    it gives every prompt its tokens alone."""
    rng = random.Random(seed)

    def case(description, prompts, pad_id=0, hint=""):
        """pad_id None: called as the engine calls it, left_pad(prompts)."""
        expected = later(engine_left_pad, prompts) if pad_id is None else later(engine_left_pad, prompts, pad_id)
        return Case(description, ("pad", prompts, pad_id), expected, hint)

    long_prompts = [[rng.randrange(50257) for _ in range(n)] for n in (300, 1, 1024, 257)]
    cases = [
        case("one prompt: nothing to pad", [[5, 6, 7]]),
        case("two prompts", [[5, 6, 7], [8]]),
        case(
            "as the engine calls it: left_pad(prompts), pad_id left out",
            [[5, 6, 7], [8]],
            None,
            hint="the default pad_id is 0",
        ),
        case("equal lengths: no padding", [[1, 2], [3, 4], [5, 6]]),
        case(
            "pad_id = 50256 (GPT-2's <|endoftext|>)",
            [[11, 12, 13, 14], [15, 16]],
            50256,
            hint="fill the padding with pad_id",
        ),
        case("the same prompts, pad_id = 13", [[11, 12, 13, 14], [15, 16]], 13),
        case("the longest prompt is not the first", [[7], [1, 2, 3, 4, 5], [9, 8]]),
        case("a batch of 5 with large ids", [[50000 + i for i in range(n)] for n in (3, 1, 7, 7, 2)]),
        case(
            "real tokens equal to the pad id (token 0, pad_id left out)",
            [[0, 5, 0], [0], [7, 0, 0, 0, 9]],
            None,
            hint="token 0 is a real token in a prompt: only the columns before a prompt are padding",
        ),
        case("<|endoftext|> inside a prompt, pad_id = 50256", [[50256, 11, 50256], [12]], 50256),
        case(
            "GPT-2's 1024 positions: prompts of 300, 1, 1024 and 257 tokens",
            long_prompts,
            None,
            hint="position ids count up to 1023",
        ),
        case("64 one-token prompts and one of 3", [[i] for i in range(64)] + [[1, 2, 3]], None),
    ]
    for i in range(n_random):
        prompts = [
            [rng.randrange(50257) for _ in range(rng.randint(1, 12 if i % 4 else 300))]
            for _ in range(rng.randint(1, 6))
        ]
        cases.append(case(f"random #{i}", prompts, rng.choice([0, 0, 50256, 13, None])))
    for j in range(n_models):
        cases.append(
            Case(
                "llmcourse.generate on a batch of prompts of different lengths, your left_pad installed",
                ("generate", seed + j),
                later(batch_alone, seed + j),
            )
        )

    def run(kind, prompts, pad_id=None):  # named as the learner's: "changed its input `prompts`"
        if kind == "pad":
            return fn(prompts) if pad_id is None else fn(prompts, pad_id)
        model, prompts = batch_run(prompts)  # "generate": prompts is the seed of the model and its prompts
        with one_thread():
            return generate(model, prompts, max_new_tokens=8, eos_token_id=None, left_pad=guard("left_pad", fn))

    def show(args):
        if args[0] == "pad":
            return f"left_pad({short(args[1], 120)}" + (")" if args[2] is None else f", pad_id={args[2]})")
        return (
            f"llmcourse.generate(tiny random model, {short(batch_run(args[1])[1], 120)}, max_new_tokens=8, "
            'left_pad=guard("left_pad", left_pad))'
        )

    def judge(case, got):
        if case.args[0] == "pad":
            return _pad_verdict(case, got)
        if got == case.expected:
            return None
        i = next((i for i, (a, b) in enumerate(zip(got, case.expected)) if a != b), 0)
        return (
            f"prompt {i} gets other tokens in the batch than alone",
            "each row must compute what its prompt computes alone: the mask hides the padding, the position "
            "ids count real tokens only",
        )

    run_check(
        "left_pad",
        run,
        cases,
        judge=judge,
        forbid=[NO_ENGINE_PAD],
        show_call=show,
        seconds=10,
        total_seconds=40,
        error_hints={"missing 1 required positional argument": DEFAULT_PAD_HINT},
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: BlockAllocator


NO_ENGINE_ALLOCATOR = Forbidden(
    "llmcourse.serving.block_manager.BlockAllocator",
    "The engine's BlockAllocator is what yours is compared with: write your own "
    "(a collections.deque and a list of counts).",
)


@dataclasses.dataclass
class Event:
    """One operation on an allocator and what followed: its result (or error) and the state after it."""

    op: tuple  # ("allocate",), ("share", block), ("release", block)
    result: Any = None
    error: Optional[BaseException] = None
    free: Any = None
    ref_count: Any = None
    num_free: Any = None

    def outcome(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}"
        return f"returned {short(self.result, 20)}" if self.op[0] == "allocate" else "returned"


def _call(op: tuple) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


def _state(allocator) -> tuple:
    free, ref_count = getattr(allocator, "free", None), getattr(allocator, "ref_count", None)
    try:
        free = list(free)
    except TypeError:
        pass
    try:
        ref_count = list(ref_count)
    except TypeError:
        pass
    return free, ref_count, getattr(allocator, "num_free", None)


def run_allocator(cls, num_blocks: int, ops: list) -> list[Event]:
    """cls(num_blocks), then every op; -> the initial state and one Event per op (errors recorded, not raised)."""
    allocator = cls(num_blocks)
    start = Event(("new",))
    start.free, start.ref_count, start.num_free = _state(allocator)
    events = [start]
    for op in ops:
        event = Event(op)
        try:
            event.result = getattr(allocator, op[0])(*op[1:])
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - recorded, compared with the engine's
            event.error = err
        event.free, event.ref_count, event.num_free = _state(allocator)
        events.append(event)
    return events


def run_allocators(cls, sizes: list, ops: list) -> list[list[Event]]:
    """Several allocators alive at once: cls(n) for every n of `sizes` (all made first), then every (which, op);
    -> each allocator's events, as `run_allocator` gives them."""
    allocators = [cls(n) for n in sizes]
    events = []
    for allocator in allocators:
        start = Event(("new",))
        start.free, start.ref_count, start.num_free = _state(allocator)
        events.append([start])
    for which, op in ops:
        event = Event(op)
        try:
            event.result = getattr(allocators[which], op[0])(*op[1:])
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - recorded, compared with the engine's
            event.error = err
        event.free, event.ref_count, event.num_free = _state(allocators[which])
        events[which].append(event)
    return events


def allocator_ops(rng: random.Random, num_blocks: int, n_ops: int) -> list[tuple]:
    """A random sequence of operations, mostly valid, some not (a release of an unused block, an allocate when
    none is free), chosen from the engine's allocator's state as it goes."""
    reference, ops = EngineAllocator(num_blocks), []
    for _ in range(n_ops):
        used = [b for b in range(num_blocks) if reference.ref_count[b] > 0]
        r = rng.random()
        if r < 0.4 or not used:
            op = ("allocate",)
        elif r < 0.7:
            op = ("release", rng.choice(used))
        elif r < 0.82:
            op = ("share", rng.choice(used))
        elif r < 0.92:
            op = ("share", rng.randrange(num_blocks))  # a free one: prefix caching revives it
        else:
            op = ("release", rng.randrange(num_blocks))  # maybe unused: refused
        try:
            getattr(reference, op[0])(*op[1:])
        except (MemoryError, ValueError):
            pass
        ops.append(op)
    return ops


def _allocator_verdict(case: Case, got: list) -> Verdict:
    expected: list[Event] = case.expected
    new_got, new_exp = got[0], expected[0]
    for what, g, e in (
        ("free", new_got.free, new_exp.free),
        ("ref_count", new_got.ref_count, new_exp.ref_count),
        ("num_free", new_got.num_free, new_exp.num_free),
    ):
        if g != e:
            hint = (
                "start with every block free, in order (deque(range(num_blocks))), and ref_count = "
                "[0] * num_blocks; num_free is len(self.free)"
            )
            if case.args[1] > 256:
                hint += " — block ids go past 255 here: are they kept in 8 bits (uint8), or in a fixed-size table?"
            return (f"a new BlockAllocator({case.args[1]}) has {what} = {short(g, 60)}, expected {short(e, 60)}", hint)
    for i, (g, e) in enumerate(zip(got[1:], expected[1:])):
        before = expected[i]
        done = "; ".join(_call(ev.op) for ev in expected[max(1, i - 5) : i + 1])
        at = f"{_call(e.op)} " + (f"after {'…; ' if i > 5 else ''}{done}" if done else "on a new allocator")
        op, block = e.op[0], (e.op[1] if len(e.op) > 1 else None)
        if e.error is not None and not isinstance(g.error, type(e.error)):
            hint = (
                "raise MemoryError when the free list is empty: the engine then preempts a request"
                if op == "allocate"
                else f"block {block} has no user (ref_count 0): releasing it again is a bug in the caller — raise "
                "ValueError, or its id would enter the free list twice and be handed to two requests"
            )
            return f"{at}: expected {type(e.error).__name__}, your allocator {g.outcome()}", hint
        if g.error is not None and e.error is None:
            return f"{at}: your allocator {raised(g.error, 100)}", ""
        if (
            op == "allocate"
            and g.error is None
            and (isinstance(g.result, bool) or not isinstance(g.result, numbers.Integral))
        ):
            return (
                f"{at} returned {short(g.result, 20)} of type {type(g.result).__module__}.{type(g.result).__name__}"
                f", expected an integer block id",
                "return the block's id: an int (numpy's integers do too)",
            )
        if op == "allocate" and g.result != e.result:
            hint = "take the block at the FRONT of the free list (popleft): it was freed longest ago"
            if before.free and g.result == before.free[-1]:
                hint = (
                    "your free list is last in, first out: allocate takes from the front (popleft), release "
                    "appends to the back, so a freed block — whose cached keys may serve a prefix again — is "
                    "reused last"
                )
            return (
                f"{at} returned {short(g.result, 20)}, expected {e.result} (the free list was "
                f"{short(before.free, 60)})",
                hint,
            )
        if (g.free, g.ref_count, g.num_free) != (e.free, e.ref_count, e.num_free):
            hint = ""
            if op == "release" and before.ref_count[block] > 1 and block in (g.free or []):
                hint = (
                    f"block {block} had {before.ref_count[block]} users: release takes one away; only when the "
                    "last one leaves (ref_count 0) does it go back on the free list"
                )
            elif op == "share" and before.ref_count[block] == 0 and isinstance(g.free, list) and block in g.free:
                hint = (
                    f"block {block} was free: share must take it off the free list (self.free.remove), or "
                    "allocate would hand it to another request while this one uses it"
                )
            elif op == "release" and isinstance(g.free, list) and g.free and e.free and g.free[0] == block != e.free[0]:
                hint = "a released block goes to the BACK of the free list (append), to be reused last"
            elif g.ref_count != e.ref_count and op == "share" and before.ref_count[block] == 255:
                hint = (
                    f"block {block}'s 256th user: is the count kept in 8 bits (uint8)? Python ints (a list) "
                    "never overflow"
                )
            elif g.ref_count != e.ref_count:
                hint = "allocate sets the block's count to 1, share adds one, release takes one away"
            elif g.num_free != e.num_free:
                hint = "num_free is the number of blocks on the free list: len(self.free)"
            return (
                f"{at}: then expected free = {short(e.free, 60)}, ref_count = {short(e.ref_count, 60)}, num_free = "
                f"{e.num_free}; got free = {short(g.free, 60)}, ref_count = {short(g.ref_count, 60)}, num_free = "
                f"{short(g.num_free, 20)}",
                hint,
            )
    return None


def check_block_allocator(cls, *, seed: int = 0, n_random: int = 8, n_workloads: int = 1) -> None:
    """BlockAllocator(num_blocks): free (least recently freed first) and ref_count; num_free; allocate() from
    the front; share(block); release(block) to the back at 0 users, ValueError if unused; MemoryError when
    none is free. And LLMEngine with it gives every request its tokens alone."""
    if not isinstance(cls, type):
        raise CheckFailed(f"✗ BlockAllocator: expected a class, got {short(cls)}")
    rng = random.Random(seed)

    def case(description, num_blocks, ops, hint=""):
        return Case(description, ("ops", num_blocks, ops), later(run_allocator, EngineAllocator, num_blocks, ops), hint)

    A, S, R = ("allocate",), (lambda b: ("share", b)), (lambda b: ("release", b))
    cases = [
        case("a new allocator", 4, []),
        case("allocate three blocks", 4, [A, A, A]),
        case("release to the back of the free list", 4, [A, A, R(0), A, A, A]),
        case("the pool runs out", 2, [A, A, A, R(1), A]),
        case("a shared block is freed by its last user only", 3, [A, S(0), R(0), A, R(0), A]),
        case("sharing a free block (a cached prefix) takes it off the free list", 4, [A, A, R(1), S(1), A, A]),
        case("releasing a block nobody uses", 3, [A, R(0), R(0), R(2)]),
    ]
    big = rng.sample(range(300), 40)  # blocks released in a random order, then reused
    cases += [
        case(
            "300 blocks: ids past 255, released in a random order and reused",
            300,
            [A] * 300 + [R(b) for b in big] + [A] * 40 + [A],
        ),
        case(
            "a block with 300 users (a prefix shared by many requests)",
            3,
            [A, A] + [S(1)] * 300 + [R(1)] * 299 + [A, R(1), A],
        ),
        case(
            "share, release and allocate across 70 blocks",
            70,
            [A] * 70 + [S(b) for b in range(0, 70, 3)] + [R(b) for b in range(70)] + [A] * 20,
        ),
    ]
    for i in range(n_random):
        n = rng.randint(1, 12) if i % 2 == 0 else rng.randint(13, 100)
        cases.append(case(f"random #{i}: {n} blocks", n, allocator_ops(rng, n, rng.randint(10, 60 if n < 13 else 200))))
    sizes = [5, 3]
    ops = [
        (0, A),
        (1, A),
        (0, A),
        (1, S(0)),
        (1, A),
        (0, R(0)),
        (1, R(0)),
        (1, R(0)),
        (0, A),
        (1, A),
        (0, S(1)),
        (1, R(1)),
    ]
    cases.append(
        Case(
            "two allocators alive at once (two engines), used in turn",
            ("two", sizes, ops),
            later(
                lambda: [
                    run_allocator(EngineAllocator, n, [op for w, op in ops if w == i]) for i, n in enumerate(sizes)
                ]
            ),
            "each allocator keeps its own free list and counts, on the instance (self.free = ... in "
            "__init__), not on the class",
        )
    )
    for j in range(n_workloads):
        cases.append(engine_case("BlockAllocator", seed + j))

    def run(kind, *args):
        if kind == "ops":
            return run_allocator(cls, *args)
        if kind == "two":
            return run_allocators(cls, *args)
        return run_engine(*ENGINE_RUNS[args[0]][:2], guarded(Batching, BlockAllocator=cls))[0]

    def show(args):
        if args[0] == "ops":
            return (
                f"a = BlockAllocator({args[1]}); "
                + "; ".join(f"a.{_call(op)}" for op in args[2][:12])
                + ("; …" if len(args[2]) > 12 else "")
            )
        if args[0] == "two":
            names = "ab"
            return (
                "; ".join(f"{names[i]} = BlockAllocator({n})" for i, n in enumerate(args[1]))
                + "; "
                + "; ".join(f"{names[w]}.{_call(op)}" for w, op in args[2])
            )
        return repr(ENGINE_RUNS[args[1]][1])

    def judge(case, got):
        if case.args[0] == "engine":
            return _engine_verdict("BlockAllocator", ENGINE_RUNS[case.args[1]][1], case.expected, got)
        if case.args[0] == "two":
            for i, (n, mine, theirs) in enumerate(zip(case.args[1], got, case.expected)):
                ops = [op for w, op in case.args[2] if w == i]
                verdict = _allocator_verdict(Case(case.description, ("ops", n, ops), theirs), mine)
                if verdict:
                    problem, hint = verdict
                    # the case's hint names what two allocators alive at once reveal (state on the class)
                    hints = f"\n  hint: {h}" if (h := one_hint(case.hint, hint)) else ""
                    raise CheckFailed(
                        f"✗ BlockAllocator — {case.description}: allocator {'ab'[i]}, "
                        f"BlockAllocator({n}): {problem}\n  input:    {show(case.args)}{hints}"
                    )
            return None
        verdict = _allocator_verdict(case, got)
        if verdict:  # the problem names the operation, what was expected and what came: no traces to show
            problem, hint = verdict
            hints = f"\n  hint: {h}" if (h := one_hint(hint, case.hint)) else ""
            raise CheckFailed(f"✗ BlockAllocator — {case.description}: {problem}\n  input:    {show(case.args)}{hints}")
        return None

    run_check(
        "BlockAllocator",
        run,
        cases,
        judge=judge,
        forbid=[NO_ENGINE_ALLOCATOR],
        show_call=show,
        seconds=10,
        total_seconds=40,
        success=None,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 3: block_hashes


NO_ENGINE_HASHES = Forbidden(
    "llmcourse.serving.block_manager.block_hashes",
    "The engine's block_hashes is what yours is checked against: write the chain yourself (Python's hash, "
    "hashlib, anything content-determined).",
)

BLOCK_HASH_CONTRACT = (
    "one integer per full block; block i's hash computed from block i-1's hash and block i's tokens, so that "
    "equal hashes mean equal tokens from position 0 to the block's end"
)


def _hash_lists(rng: random.Random, block_size: int, n_blocks: int, vocab: int = 50257) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n_blocks * block_size)]


def _block_of(tokens: list[int], i: int, bs: int) -> list[int]:
    return tokens[i * bs : (i + 1) * bs]


def _hash_problem(got: Any, n: int) -> Optional[str]:
    """What is wrong with `got` as the hashes of n full blocks (None: a list of n integers)."""
    if not isinstance(got, (list, tuple)):
        return f"expected a list of {n} integers, got {short(got, 80)}"
    if len(got) != n:
        return f"expected {n} hashes (one per full block), got {len(got)}: {short(list(got), 80)}"
    bad = next((h for h in got if isinstance(h, bool) or not isinstance(h, numbers.Integral)), None)
    if bad is not None or any(isinstance(h, bool) for h in got):
        return f"expected integers, got {short(bad, 60)} ({type(bad).__name__}) among {short(list(got), 80)}"
    return None


def check_block_hashes(fn, *, seed: int = 0, n_random: int = 6, n_workloads: int = 1) -> None:
    """block_hashes(token_ids, block_size) -> one integer per full block, chained: block i's hash stands for
    tokens 0 … (i+1)·block_size - 1. Checked by what the prefix cache relies on, not by the values: as many
    hashes as full blocks; the same tokens give the same hashes (again, and as the tokens grow); two token lists
    agree on block i's hash exactly when they agree on every token up to its end (a changed earlier block, a
    changed or moved token, changes it); no two of a few thousand different prefixes collide. Then LLMEngine
    with it gives every request its tokens alone and finds the cached prefixes the engine's own finds."""
    rng = random.Random(seed)
    cases = []

    def case(description, kind, spec, hint=""):
        cases.append(Case(description, (kind, spec), None, hint))

    # count: partial blocks get no hash
    for bs, n_tokens in [
        (4, 0),
        (4, 3),
        (4, 4),
        (4, 11),
        (1, 5),
        (16, 40),
        (3, 9),
        (16, 32),
    ]:  # 9, 32: full blocks only
        case(f"{n_tokens} tokens, block_size {bs}", "count", (_hash_lists(rng, 1, n_tokens), bs))
    # equal prefixes: the same call again, and a list that grew
    for bs in (2, 4, 16):
        tokens = _hash_lists(rng, bs, 5)
        case(f"the same 5 blocks of {bs}, twice", "same", (tokens, list(tokens), bs))
        case(f"5 blocks of {bs}, then the same tokens grown by 3 blocks", "same", (tokens, tokens + [1] * 3 * bs, bs))
        case(f"5 blocks of {bs} and the first 2 of them plus a partial one", "same", (tokens, tokens[: 2 * bs + 1], bs))
        case(
            f"5 blocks of {bs} and exactly their first 2 (the list ends at a block boundary)",
            "same",
            (tokens, tokens[: 2 * bs], bs),
        )
    # differences: an earlier block, one token, two tokens swapped, only the last token kept
    for bs in (3, 4, 16):
        a = _hash_lists(rng, bs, 4)
        b = list(a)
        b[0] = (b[0] + 1) % 50257  # block 0 differs: blocks 1-3 have the same tokens after another prefix
        case(f"blocks of {bs}: the same blocks 1-3 after another block 0", "differ", (a, b, bs, 0))
        b = list(a)
        b[2 * bs] += 1  # the first token of block 2
        case(f"blocks of {bs}: one token of block 2 changed", "differ", (a, b, bs, 2))
        b = list(a)
        b[bs], b[bs + 1] = b[bs + 1], b[bs]  # two tokens of block 1 swapped
        if b != a:
            case(f"blocks of {bs}: two tokens of block 1 swapped", "differ", (a, b, bs, 1))
        b = list(a)
        b[bs + bs // 2 - 1 if bs > 1 else bs] += 7  # a token inside block 1, not its last
        case(f"blocks of {bs}: a token in the middle of block 1 changed", "differ", (a, b, bs, 1))
    a = [7] * 8
    case("repeated tokens: block 1 equals block 0, after a different prefix", "differ", (a, [6] + a[1:], 4, 0))
    case("blocks that sum to the same", "differ", ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 6, 5], 2, 2))
    case("token ids 0 and 50256, block_size 1", "differ", ([0, 50256, 0], [50256, 0, 0], 1, 0))
    for i in range(n_random):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        a = _hash_lists(rng, bs, rng.randint(2, 6))
        b = list(a)
        at = rng.randrange(len(a))
        b[at] = (b[at] + rng.randint(1, 9)) % 50257
        case(f"random #{i}: block_size {bs}, token {at} of {len(a)} changed", "differ", (a, b, bs, at // bs))
    case("2000 different prefixes, block_size 2", "distinct", (random.Random(seed + 1).random(), 2))
    for j in range(n_workloads):
        cases.append(engine_case("block_hashes", seed + j))

    def run(kind, token_ids):  # token_ids: the case's lists (a seed for "engine"), watched for changes by run_check
        if kind == "engine":
            tokens, stats = run_engine(*ENGINE_RUNS[token_ids][:2], guarded(Batching, block_hashes=watched(fn)))
            return tokens, stats["cached_tokens"]
        spec = token_ids
        if kind == "count":
            return fn(*spec)
        if kind == "same" or kind == "differ":
            return fn(spec[0], spec[2]), fn(spec[1], spec[2])
        r, bs = random.Random(spec[0]), spec[1]  # distinct: prefixes that share blocks, and fresh ones
        base = _hash_lists(r, bs, 8, vocab=50)
        lists = [base[: r.randrange(8) * bs] + _hash_lists(r, bs, r.randint(1, 4), vocab=50) for _ in range(500)]
        return [h for t in lists for h in fn(t, bs)], lists

    def show(args):
        kind, spec = args[0], args[1]
        if kind == "engine":
            return repr(ENGINE_RUNS[spec][1])
        if kind == "count":
            return f"block_hashes({short(spec[0], 60)}, block_size={spec[1]})"
        if kind == "distinct":
            return f"block_hashes(tokens, block_size={spec[1]}) for 500 token lists (many sharing prefixes)"
        return (
            f"block_hashes(a, {spec[2]}) and block_hashes(b, {spec[2]}) with\n            a = {short(spec[0], 90)}"
            f"\n            b = {short(spec[1], 90)}"
        )

    def judge(case, got):
        kind, spec = case.args
        if kind == "engine":
            work = ENGINE_RUNS[spec][1]
            verdict = _engine_verdict("block_hashes", work, case.expected, got[0])
            if verdict:
                return verdict
            own = run_engine(*ENGINE_RUNS[spec][:2], Batching())[1]["cached_tokens"]
            if got[1] != own:
                return (
                    f"the prefix cache found {got[1]} cached prompt tokens with your block_hashes, {own} with the "
                    "engine's own",
                    "requests that share a prefix must get equal hashes for its full blocks, whatever else they hold",
                )
            return None
        if kind == "count":
            tokens, bs = spec
            n = len(tokens) // bs
            problem = _hash_problem(got, n)
            if problem is None:
                return None
            hint = (
                f"{len(tokens)} tokens in blocks of {bs} make {n} full blocks; a partial last block gets no hash "
                "(it is still being filled, and its keys and values are not complete)"
                if isinstance(got, (list, tuple)) and len(got) == -(-len(tokens) // bs) != n
                else BLOCK_HASH_CONTRACT
            )
            return problem, hint
        if kind == "distinct":
            hashes, lists = got
            problem = _hash_problem(hashes, sum(len(t) // spec[1] for t in lists))
            if problem:
                return problem, BLOCK_HASH_CONTRACT
            prefixes = {tuple(t[: (i + 1) * spec[1]]) for t in lists for i in range(len(t) // spec[1])}
            if len(set(hashes)) != len(prefixes):
                return (
                    f"{len(prefixes)} different prefixes got {len(set(hashes))} different hashes: some collide",
                    "hash the previous hash together with the block's tokens, e.g. hash((previous, tuple(block))) "
                    "or hashlib.sha256: a sum or a small modulus makes different blocks collide",
                )
            return None
        a, b, bs = spec[:3]
        ga, gb = got
        for tokens, hashes in ((a, ga), (b, gb)):
            problem = _hash_problem(hashes, len(tokens) // bs)
            if problem:
                return problem, BLOCK_HASH_CONTRACT
        ga, gb = [int(h) for h in ga], [int(h) for h in gb]
        n = min(len(a), len(b)) // bs
        for i in range(n):
            same_prefix = a[: (i + 1) * bs] == b[: (i + 1) * bs]
            if same_prefix and ga[i] != gb[i]:
                return (
                    f"block {i} has the same tokens after the same prefix in a and b, but got hashes {ga[i]} and "
                    f"{gb[i]}",
                    "a block's hash may depend only on its tokens and those before it: no randomness, no "
                    "length of the whole list, no state kept between calls",
                )
            if not same_prefix and ga[i] == gb[i]:
                if _block_of(a, i, bs) == _block_of(b, i, bs):
                    hint = (
                        f"not chained: block {i} holds {_block_of(a, i, bs)} in both, after different earlier "
                        "blocks, and its keys and values differ (they depend on the whole prefix): compute block "
                        "i's hash from block i-1's hash and block i's tokens"
                    )
                elif sorted(_block_of(a, i, bs)) == sorted(_block_of(b, i, bs)):
                    hint = "the order of the tokens counts: hash the block as a tuple, not a set, a sum or sorted"
                elif _block_of(a, i, bs)[-1:] == _block_of(b, i, bs)[-1:]:
                    hint = "hash every token of the block, not only its last one"
                else:
                    hint = "every token of the block, and every block before it, must change the hash"
                return (
                    f"a and b differ up to the end of block {i} (blocks {_block_of(a, i, bs)} and "
                    f"{_block_of(b, i, bs)}), but block {i} got the same hash, {ga[i]}",
                    hint,
                )
        return None

    run_check(
        "block_hashes",
        run,
        cases,
        judge=judge,
        forbid=[NO_ENGINE_HASHES],
        show_call=show,
        seconds=10,
        total_seconds=40,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: paged_attention


OWN_PAGED = "Write the online softmax over the blocks yourself: scores, running max, sum and accumulator."
NO_ENGINE_PAGED = [
    *[
        Forbidden(target, OWN_PAGED)
        for target in (
            "torch.softmax",
            "torch._softmax",
            "torch.special.special_softmax",
            "torch.log_softmax",
            "torch.logsumexp",
            "torch.nn.functional.scaled_dot_product_attention",
            "torch.nn.functional.multi_head_attention_forward",
            "llmcourse.engine.parts",
            "llmcourse.engine.tiled_attention",
            "llmcourse.serving.paged_cache",
            "transformers",
        )
    ],
]
PAGED_DTYPES = (torch.float32, torch.float64, torch.float16)


def _paged_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol): float64 float64-accurate; float16 a few roundings per block (16 eps); float32 1e-5."""
    if dtype == torch.float64:
        return 1e-10, 1e-10
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return 16 * eps, 16 * eps
    return 1e-5, 1e-4


def paged_reference(q, k_pool, v_pool, block_table, lengths):
    """Each sequence's keys and values gathered position by position, one softmax, in float64: (out, lse)."""
    bs, D = k_pool.shape[1], q.shape[-1]
    outs, lses = [], []
    for g, n in enumerate(lengths.tolist()):
        where = [(int(block_table[g, p // bs]), p % bs) for p in range(n)]
        k = torch.stack([k_pool[b, o] for b, o in where]).double()  # [n, H, D]
        v = torch.stack([v_pool[b, o] for b, o in where]).double()
        s = torch.einsum("hd,nhd->hn", q[g].double(), k) / math.sqrt(D)  # [H, n]
        top = s.amax(-1, keepdim=True)
        w = torch.exp(s - top)
        outs.append(torch.einsum("hn,nhd->hd", w / w.sum(-1, keepdim=True), v))
        lses.append((top + w.sum(-1, keepdim=True).log())[:, 0])
    return torch.stack(outs).to(q.dtype), torch.stack(lses).to(q.dtype)


def _paged_variant(
    q,
    k_pool,
    v_pool,
    block_table,
    lengths,
    *,
    rescale=True,
    mask=True,
    through_table=True,
    scale=None,
    shift=True,
    dtype=torch.float64,
):
    """The online softmax over the block columns in `dtype` (float64: no rounding of its own), with one mistake
    switched on: -> out."""
    G, H, D = q.shape
    bs = k_pool.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    m = torch.full((G, H), -math.inf, dtype=dtype)
    l = torch.zeros(G, H, dtype=dtype)
    acc = torch.zeros(G, H, D, dtype=dtype)
    n_cols = block_table.shape[1] if not mask else -(-int(lengths.max()) // bs)
    for j in range(n_cols):
        blocks = block_table[:, j] if through_table else torch.full((G,), j % k_pool.shape[0])
        k, v = k_pool[blocks].to(dtype), v_pool[blocks].to(dtype)  # [G, bs, H, D]
        s = torch.einsum("ghd,gthd->ght", q.to(dtype), k) * scale
        if mask:
            s = s.masked_fill((j * bs + torch.arange(bs) >= lengths[:, None])[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1)) if shift else torch.zeros_like(m)
        r = torch.exp(m - m_new) if (rescale and shift) else torch.ones_like(m)
        r = torch.nan_to_num(r, nan=0.0)
        p = torch.exp(s - m_new[..., None])
        l = l * r + p.sum(-1)
        acc = acc * r[..., None] + torch.einsum("ght,gthd->ghd", p, v)
        m = m_new
    return (acc / l[..., None]).to(q.dtype)


PAGED_MISTAKES = [
    (
        functools.partial(_paged_variant, rescale=False),
        "when a block raises the running max from m to m_new, rescale what was summed so far: l and acc times "
        "exp(m - m_new), before adding this block's exp(s - m_new)",
    ),
    (
        functools.partial(_paged_variant, mask=False),
        "mask the slots past each sequence's length (scores -inf for positions >= length): the rest of its last "
        "block, and the blocks its table lists past the length, hold stale keys of other requests",
    ),
    (
        functools.partial(_paged_variant, through_table=False),
        "read block j of sequence g where its table says, k_pool[block_table[g, j]], not k_pool[j]: a "
        "sequence's blocks can be anywhere in the pool",
    ),
    (
        lambda q, *args: _paged_variant(q, *args, scale=1 / q.shape[-1]),
        "scale the scores by 1/√D (D = head_dim), not 1/D",
    ),
    (lambda q, *args: _paged_variant(q, *args, scale=1.0), "scale the scores by 1/√D (D = head_dim)"),
    (
        overflowing(lambda q, *args: _paged_variant(q, *args, shift=False, dtype=q.dtype)),
        "keep the running max m and take exp(s - m_new): exp of a raw score overflows float16 above ~11 (float32 "
        "above ~88), and inf / inf is nan",
    ),
]


def _pools(g, num_blocks, bs, H, D, dtype, stale=40.0):
    """Key and value pools of random numbers; `stale`: scale of what sits in every slot (large: a slot read by
    mistake changes the answer a lot)."""
    k = torch.randn(num_blocks, bs, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(num_blocks, bs, H, D, generator=g, dtype=torch.float64) * 3 + 1
    return k.to(dtype), v.to(dtype)


def _desc(t: Tensor) -> str:
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check_paged_attention(fn, *, seed: int = 0, n_random: int = 8, n_workloads: int = 1) -> None:
    """paged_attention(q [G, H, D], k_pool, v_pool [num_blocks, block_size, H, D], block_table [G, n],
    lengths [G]) -> (out [G, H, D], lse [G, H]): each sequence's query attending to its first `length` positions,
    read through its block table; reading the blocks in place (no tensor as large as a sequence's keys); and
    LLMEngine decoding with it (its contexts split into partitions, merged) gives every request its tokens
    alone."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def case(description, q, k_pool, v_pool, table, lengths, hint=""):
        table, lengths = torch.as_tensor(table, dtype=torch.long), torch.as_tensor(lengths, dtype=torch.long)
        args = ("paged", q, k_pool, v_pool, table, lengths)
        return Case(description, args, later(paged_reference, q, k_pool, v_pool, table, lengths), hint)

    def qkv(G, num_blocks, bs, H, D, dtype=torch.float32):
        q = torch.randn(G, H, D, generator=g, dtype=torch.float64).to(dtype)
        return (q, *_pools(g, num_blocks, bs, H, D, dtype))

    # a second block whose keys score far higher than the first's: the running max rises
    q_up, k_up, v_up = qkv(1, 3, 4, 1, 4)
    q_up, k_up = q_up.abs() + 1, k_up.clone()
    k_up[2] = k_up[2].abs() * 4 + 3
    k_up[0] = -k_up[0].abs()
    # a last block whose unused slots hold keys that would win every score
    q_st, k_st, v_st = qkv(2, 4, 4, 2, 8)
    k_st[1, 2:] = q_st[0] * 30
    k_st[3, 1:] = q_st[1] * 30
    engine_q = qkv(8, 12, 4, 2, 16)[0].transpose(0, 1).contiguous().transpose(0, 1)  # [G, H, D] not contiguous
    large = torch.Generator().manual_seed(seed)  # the large-score cases: g's draws stay as they were

    def large_scores(G, num_blocks, bs, H, dtype):
        """q and pools (head dim 16) whose scores q·k / 4 are about ±1e4, exact in `dtype` (`large_exact_scores`)."""
        q, k_pool = large_exact_scores(large, (G, H, 16), (num_blocks, bs, H, 16), dtype)
        return q, k_pool, (torch.randn(num_blocks, bs, H, 16, generator=large, dtype=torch.float64) * 3 + 1).to(dtype)

    cases = [
        case("one sequence, one full block", *qkv(1, 2, 4, 1, 4), [[1]], [4]),
        case("one sequence, its last block partly filled", *qkv(1, 3, 4, 2, 8), [[2, 0]], [6]),
        case(
            "the running max rises in the second block",
            q_up,
            k_up,
            v_up,
            [[0, 2]],
            [8],
            hint="block 2's scores are far above block 0's: the sums over block 0 must be rescaled",
        ),
        case(
            "unused slots past the length hold keys that would win",
            q_st,
            k_st,
            v_st,
            [[0, 1], [2, 3]],
            [6, 5],
            hint="positions 6-7 of sequence 0 and 5-7 of sequence 1 are not theirs (yet): never attend to them",
        ),
        case(
            "three sequences, tables out of order, lengths 1, 5 and 12",
            *qkv(3, 9, 4, 2, 8),
            [[7, 0, 0], [3, 8, 0], [5, 1, 6]],
            [1, 5, 12],
        ),
        case("a block shared by two sequences (prefix caching)", *qkv(2, 5, 4, 2, 4), [[4, 1, 0], [4, 2, 3]], [9, 12]),
        case(
            "table entries past the length point at any block",
            *qkv(2, 6, 2, 1, 4),
            [[5, 5, 5, 5], [3, 0, 0, 0]],
            [8, 1],
        ),
        case("float64", *qkv(2, 6, 4, 3, 8, torch.float64), [[2, 5], [1, 0]], [7, 3], hint="float64 in, float64 out"),
        case("float16", *qkv(2, 6, 4, 2, 8, torch.float16), [[2, 5], [1, 0]], [7, 3], hint="float16 in, float16 out"),
        case("block_size 16, head_dim 64, as in GPT-2", *qkv(2, 8, 16, 2, 64), [[6, 2, 7], [0, 1, 3]], [40, 17]),
        case(
            "float16, scores of about ±1e4 (exact in float16): exp overflows without the running max",
            *large_scores(3, 7, 4, 2, torch.float16),
            [[6, 1, 3], [0, 2, 5], [4, 4, 4]],
            [11, 8, 2],
            hint="the running max keeps every exponent <= 0: exp(s - m_new), and l, acc rescaled by exp(m - m_new)",
        ),
        case("bfloat16, scores of about ±1e4", *large_scores(2, 5, 4, 1, torch.bfloat16), [[3, 0], [1, 4]], [7, 5]),
        case(
            "as the engine calls it: q not contiguous, 8 sequences",
            engine_q,
            *qkv(8, 12, 4, 2, 16)[1:],
            [rng.sample(range(12), 3) for _ in range(8)],
            [rng.randint(1, 12) for _ in range(8)],
        ),
    ]
    for i in range(n_random):
        G, bs = rng.randint(1, 5), rng.choice([1, 2, 3, 4, 8, 16])
        n, num_blocks = rng.randint(1, 6), rng.randint(6, 30)
        H, D = rng.randint(1, 4), rng.choice([1, 4, 8, 32])
        dtype = PAGED_DTYPES[i % 2]
        table = [[rng.randrange(num_blocks) for _ in range(n)] for _ in range(G)]
        lengths = [rng.randint(1, n * bs) for _ in range(G)]
        cases.append(
            case(
                f"random #{i}: {G} sequences, block_size {bs}, lengths {lengths}",
                *qkv(G, num_blocks, bs, H, D, dtype),
                table,
                lengths,
            )
        )
    engine_cases = [engine_case("paged_attention", seed + j) for j in range(n_workloads)]

    def run(kind, q, k_pool=None, v_pool=None, block_table=None, lengths=None):  # the learner's names, for messages
        if kind == "paged":
            return fn(q, k_pool, v_pool, block_table, lengths)
        return run_engine(*ENGINE_RUNS[q][:2], guarded(Batching, paged_attention=watched(fn)))[0]  # q: the seed

    def show(args):
        if args[0] == "paged":
            q, k_pool, _, table, lengths = args[1:]
            return (
                f"paged_attention(q={_desc(q)}, k_pool={_desc(k_pool)}, v_pool=…, block_table={table.tolist()}, "
                f"lengths={lengths.tolist()})"
            )
        return repr(ENGINE_RUNS[args[1]][1])

    def judge(case, got):
        if case.args[0] == "engine":
            return _engine_verdict("paged_attention", ENGINE_RUNS[case.args[1]][1], case.expected, got)
        out, lse = case.expected
        if not (isinstance(got, tuple) and len(got) == 2):
            what = type(got).__name__ + (f" of {len(got)} items" if isinstance(got, (tuple, list)) else "")
            return f"expected a tuple (out, lse), got {what}", "return out, lse: the attention and its log-sum-exp"
        atol, rtol = _paged_tolerance(out.dtype)
        problem = tensor_problem(got[0], out, atol=atol, rtol=rtol)
        if problem:
            return f"out: {problem}", diagnose(got[0], case.args[1:], PAGED_MISTAKES, out, atol=atol, rtol=rtol)
        problem = tensor_problem(got[1], lse, atol=atol, rtol=rtol)
        if problem:
            return f"lse: {problem}", (
                "lse is each row's log-sum-exp of the scaled scores over its positions: m + log(l) at the end "
                "(the max m added back)"
            )
        return None

    settings = dict(judge=judge, show_call=show, seconds=10, error_hints={"out of bounds": PAGED_MISTAKES[2][1]})
    with contextlib.redirect_stdout(io.StringIO()):  # one line at the end, for the three parts
        run_check("paged_attention", run, cases, forbid=NO_ENGINE_PAGED, total_seconds=60, **settings)
    _check_reads_in_place(fn, show)
    # the engine's own prefill runs torch's attention: only the engine's functions stay forbidden in the engine
    total = len(cases) + 1 + len(engine_cases)
    run_check(
        "paged_attention",
        run,
        engine_cases,
        forbid=[f for f in NO_ENGINE_PAGED if f.target.startswith("llmcourse.")],
        total_seconds=60,
        success=f"✓ paged_attention — {total} cases",
        **settings,
    )


def _check_reads_in_place(fn: Callable, show: Callable[[tuple], str]) -> None:
    """Reading in place is the exercise: at a size where a sequence's keys (length × H × D numbers) are 16 blocks,
    no floating-point tensor the function makes may hold more numbers than two blocks of every sequence's keys
    ([G, 2 · block_size, H, D]): not the gathered keys or values of a sequence, nor a copy of the pool. Views of
    the pool take no memory and are not counted; every tensor torch makes during the call is seen (a dispatch
    mode); work in numpy is not."""
    G, bs, H, D, n, num_blocks = 3, 4, 2, 16, 16, 60
    g = torch.Generator().manual_seed(7)
    q = torch.randn(G, H, D, generator=g)
    k_pool, v_pool = _pools(g, num_blocks, bs, H, D, torch.float32)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:n] for _ in range(G)])
    lengths = torch.tensor([n * bs, n * bs - 3, n * bs - bs - 1])
    allowed = G * 2 * bs * H * D
    pools = {k_pool.untyped_storage().data_ptr(), v_pool.untyped_storage().data_ptr()}
    largest: list = [0, None]

    class Sizes(DispatchWatch):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if not (isinstance(t, Tensor) and t.is_floating_point()) or t.untyped_storage().data_ptr() in pools:
                    continue
                held = math.prod(s for s, stride in zip(t.shape, t.stride()) if stride != 0 or s == 1)
                if held > largest[0]:
                    largest[0], largest[1] = held, tuple(t.shape)
            return out

    def sized(kind, q, k_pool, v_pool, block_table, lengths):  # the learner's names, for messages
        with Sizes():
            return fn(q, k_pool, v_pool, block_table, lengths)

    args = ("paged", q, k_pool, v_pool, table, lengths)
    got = call_learner("paged_attention", sized, args, forbid=NO_ENGINE_PAGED, show=show)
    expected = paged_reference(*args[1:])
    atol, rtol = _paged_tolerance(torch.float32)
    if not (isinstance(got, tuple) and len(got) == 2) or tensor_problem(got[0], expected[0], atol=atol, rtol=rtol):
        raise CheckFailed(
            f"✗ paged_attention — {G} sequences of up to {n} blocks: wrong answer\n  input:    {show(args)}\n"
            "  hint: run the cases above again: this one only has more blocks"
        )
    if largest[0] > allowed:
        raise CheckFailed(
            f"✗ paged_attention — reading in place: {G} sequences of {n} blocks of {bs} positions: your function "
            f"made a tensor of shape {list(largest[1])} ({largest[0]:,} numbers); reading the blocks in place never "
            f"holds more than a block or two of each sequence's keys at once\n"
            f"  input:    {show(args)}\n"
            f"  expected: no tensor of more than {allowed:,} numbers ([G, 2·block_size, H, D] = {[G, 2 * bs, H, D]})\n"
            f"  got:      a tensor of shape {list(largest[1])}\n"
            "  hint: walk the block table one column at a time: k_pool[block_table[:, j]] is block j of every "
            "sequence, [G, block_size, H, D]; gathering all of a sequence's keys first is the copy paged "
            "attention avoids"
        )


# ----------------------------------------------------------------------------------------------
# Exercise 5: schedule


NO_ENGINE_SCHEDULE = Forbidden(
    "llmcourse.serving.scheduler.schedule", "The engine's schedule is what yours is compared with: write the two loops."
)


def policy(
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
    """The engine's policy, or one of the mistakes the flags name (for hints): preempting the oldest, admitting
    waiting requests in a step that preempts, skipping a waiting request that does not fit, no chunked prefill
    for waiting requests, a block need that forgets num_computed, blocks counted as t // block_size + 1 (one too
    many when t fills its blocks exactly), a request that needs exactly the free blocks taken as not fitting,
    waiting requests admitted with 0 tokens once the budget is used up exactly."""
    budget, free, chunks, preempted = max_num_batched_tokens, num_free_blocks, {}, []
    queue, i = list(running), 0

    def need_of(seq, n):
        tokens = (seq.num_computed if cached_prefix else 0) + n
        blocks = tokens // block_size + 1 if floor_plus_one else blocks_for(tokens, block_size)
        return blocks - seq.num_blocks + (1 if strict_fit else 0)  # needing one more than free = needing >= free

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


SCHEDULE_MISTAKES = [
    (
        dict(victim="oldest"),
        "preempt the NEWEST running request (the end of `running`): it has done the least "
        "work, and the oldest finish first",
    ),
    (
        dict(admit_after_preempt=True),
        "in a step that preempts, admit no waiting request: the pool is full, and a "
        "new request would only be preempted in turn",
    ),
    (
        dict(skip_unfit=True),
        "first come, first served: the first waiting request that does not fit stops the "
        "admissions; admitting a later, smaller one instead could starve a long prompt forever",
    ),
    (
        dict(chunk_waiting=False),
        "a waiting request gets min(tokens left, budget left) tokens: a long prompt is "
        "prefilled in chunks over several steps (chunked prefill)",
    ),
    (
        dict(frees_shared=True),
        "a preempted request gives back only the blocks nobody else holds, "
        "num_unshared_blocks: the prefix blocks it shares stay in use by the others",
    ),
    (
        dict(cached_prefix=False),
        "a request needs blocks_for(num_computed + n, block_size) - num_blocks more blocks: "
        "num_computed counts the tokens already in its blocks (or in a cached prefix)",
    ),
    (
        dict(floor_plus_one=True),
        "blocks_for(t, block_size) is ceil(t / block_size): t // block_size + 1 is one block too many when t "
        "fills its blocks exactly (8 tokens in blocks of 4 need 2)",
    ),
    (
        dict(past_the_budget=True),
        "stop admitting when the token budget is used up (budget == 0): admit no request with 0 tokens to compute",
    ),
    (
        dict(strict_fit=True),
        "a request fits when it needs no more blocks than are free (need <= free): needing exactly the free "
        "blocks is enough",
    ),
]


def _scheduled(args: tuple, **flags) -> tuple:
    running, waiting, free, bs, seqs, budget = args
    return policy(running, waiting, free, block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget, **flags)


def _schedule_verdict(case: Case, got: Any) -> Verdict:
    expected = case.expected
    if not (isinstance(got, tuple) and len(got) == 2):
        return (
            f"expected a tuple (chunks, preempted), got {short(got, 80)}",
            "return chunks, preempted: a dict {request id: tokens to compute} and a list of ids",
        )
    chunks, preempted = got
    if not isinstance(chunks, dict) or not isinstance(preempted, list):
        return (
            f"expected a dict and a list, got a {type(chunks).__name__} and a {type(preempted).__name__}",
            "return chunks, preempted: a dict {request id: tokens to compute} and a list of ids",
        )
    if got == expected and list(chunks) == list(expected[0]):
        odd = next(
            (
                x
                for x in [*chunks, *chunks.values(), *preempted]
                if isinstance(x, bool) or not isinstance(x, numbers.Integral)
            ),
            None,
        )
        if odd is None:
            return None
        return (
            f"the right decisions, but {short(odd, 20)} is a {type(odd).__module__}.{type(odd).__name__}, not an "
            "integer",
            "ids and token counts are integers (an int, or numpy's): int(n)",
        )
    if preempted != expected[1]:
        problem = f"preempted {preempted}, expected {expected[1]} (newest first)"
    elif chunks == expected[0]:
        problem = (
            f"the right requests and counts in another order: expected the order {list(expected[0])}, got "
            f"{list(chunks)}"
        )
    else:
        problem = f"scheduled {short(chunks, 80)}, expected {short(expected[0], 80)}"
    hint = next((h for flags, h in SCHEDULE_MISTAKES if _scheduled(case.args[1:], **flags) == got != expected), "")
    if not hint and chunks == expected[0]:
        hint = "running requests first, oldest first, then waiting ones in arrival order"
    return problem, hint


def _seq(rng: random.Random, rid: int, block_size: int, running: bool, scale: int = 1) -> SeqView:
    if running:
        computed = rng.randint(1, 40 * scale)
        tokens = computed + (1 if rng.random() < 0.7 else rng.randint(1, 20 * scale))  # decoding, or a prompt in chunks
        blocks = blocks_for(computed, block_size)
        shared = rng.randint(1, blocks) if rng.random() < 0.4 else 0  # a prefix it shares with others
        return SeqView(rid, tokens, computed, blocks, blocks - shared)
    tokens = rng.randint(1, 40 * scale)
    cached = rng.randint(0, (tokens - 1) // block_size) if rng.random() < 0.3 else 0
    return SeqView(rid, tokens, cached * block_size, rng.randint(0, cached), 0)


def schedule_scenario(rng: random.Random) -> tuple:
    """Random queues and limits: (running, waiting, num_free_blocks, block_size, max_num_seqs, budget). One in four
    is at a server's scale (prompts of thousands of tokens, thousands of free blocks, budgets up to 8192, request ids
    up to a million); block sizes are not only powers of two."""
    big = rng.random() < 0.25
    scale = 50 if big else 1
    bs = rng.choice([1, 2, 3, 4, 5, 8, 12, 16])
    n_run, n_wait = rng.randint(0, 6), rng.randint(0 if rng.random() < 0.5 else 1, 5)
    ids = rng.sample(range(10**6) if big else range(100), n_run + n_wait)
    running = [_seq(rng, ids[i], bs, True, scale) for i in range(n_run)]
    waiting = [_seq(rng, ids[n_run + i], bs, False, scale) for i in range(n_wait)]
    free = rng.randint(0, 12 * scale**2 // 10) if big else rng.randint(0, 12)
    budget = rng.choice([256, 512, 2048, 8192]) if big else rng.choice([1, 4, 8, 16, 32, 64])
    return running, waiting, free, bs, rng.randint(1, 256) if big else rng.randint(1, 8), budget


def check_schedule(fn, *, seed: int = 0, n_random: int = 60, n_workloads: int = 1) -> None:
    """schedule(running, waiting, num_free_blocks, *, block_size, max_num_seqs, max_num_batched_tokens) ->
    ({request id: tokens to compute}, [preempted ids, newest first]): the policy of
    llmcourse.serving.scheduler.schedule;
    and LLMEngine with it gives every request its tokens alone."""
    rng = random.Random(seed)

    def R(rid, num_tokens, num_computed, num_blocks, num_unshared_blocks=None):  # running: by default shares nothing
        unshared = num_blocks if num_unshared_blocks is None else num_unshared_blocks
        return SeqView(rid, num_tokens, num_computed, num_blocks, unshared)

    def W(rid, num_tokens, num_computed, num_blocks):  # waiting: holds no block of its own
        return SeqView(rid, num_tokens, num_computed, num_blocks, 0)

    def case(description, running, waiting, free, bs=4, seqs=8, budget=32, hint=""):
        args = (running, waiting, free, bs, seqs, budget)
        return Case(
            description,
            ("step", *args),
            later(
                engine_schedule, running, waiting, free, block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget
            ),
            hint,
        )

    cases = [
        case("nothing to do", [], [], 4),
        case(
            "three requests decoding",
            [R(0, 9, 8, 2), R(1, 5, 4, 1), R(2, 13, 12, 3)],
            [],
            4,
            hint="a decoding request computes 1 token",
        ),
        case(
            "a new prompt joins the decodes",
            [R(0, 9, 8, 2)],
            [W(1, 10, 0, 0)],
            4,
            hint="running first, then the waiting prompt: all 10 of its tokens fit the budget",
        ),
        case(
            "a long prompt, chunked by the token budget",
            [R(0, 9, 8, 2)],
            [W(1, 40, 0, 0)],
            10,
            budget=16,
            hint="1 token for the decode, the 15 left of the budget for the prompt's first chunk",
        ),
        case(
            "a prompt prefilled over several steps continues",
            [R(3, 40, 15, 4)],
            [W(4, 6, 0, 0)],
            10,
            budget=16,
            hint="the running prompt gets min(25 left, 16) tokens: the budget is used up",
        ),
        case(
            "a decode needs a new block but none is free: the newest is preempted",
            [R(0, 9, 8, 2), R(1, 5, 4, 1), R(2, 7, 6, 2)],
            [W(3, 4, 0, 0)],
            0,
            hint="request 0 needs a third block; preempting request 2 (the newest) frees 2",
        ),
        case(
            "the newest itself needs a block: it preempts itself",
            [R(0, 6, 5, 2), R(1, 9, 8, 2)],
            [],
            0,
            hint="request 1 is the newest: nothing newer to evict, so it waits, and nothing is admitted",
        ),
        case(
            "preemptions until enough blocks come free",
            [R(5, 9, 8, 2), R(6, 3, 2, 1), R(7, 2, 1, 1, 0), R(8, 3, 2, 1, 0)],
            [],
            0,
            hint="requests 7 and 8 hold only a block they share: preempting them frees nothing, so request 6 goes too",
        ),
        case(
            "max_num_seqs reached",
            [R(0, 5, 4, 1), R(1, 5, 4, 1)],
            [W(2, 3, 0, 0), W(3, 3, 0, 0)],
            8,
            seqs=3,
            hint="3 requests at most: one waiting request joins",
        ),
        case(
            "the first waiting request does not fit: admissions stop",
            [R(0, 5, 4, 1)],
            [W(1, 30, 0, 0), W(2, 2, 0, 0)],
            3,
            hint="request 1 needs 8 blocks, 3 are free: it waits, and request 2 waits behind it (first come, "
            "first served)",
        ),
        case(
            "a cached prefix held by others needs fewer blocks",
            [R(0, 21, 20, 5)],
            [W(1, 18, 16, 4)],
            1,
            hint="request 1's 16 prompt tokens are cached in 4 blocks that request 0 holds: it computes 2 tokens "
            "and needs blocks_for(16 + 2) - 4 = 1 new block",
        ),
        case(
            "preempting a request that shares its prefix frees only its own blocks",
            [R(0, 30, 20, 5), R(1, 13, 12, 3, 1), R(2, 13, 12, 3, 1)],
            [],
            0,
            budget=8,
            hint="requests 1 and 2 share 2 prefix blocks: preempting request 2 gives back 1 block (its unshared "
            "one), not 3; request 0 needs 2, so request 1 goes too",
        ),
        case(
            "a cached prefix nobody holds costs its blocks",
            [],
            [W(1, 18, 16, 0)],
            4,
            hint="the 4 cached blocks are free ones to take back, plus 1 for the 2 new tokens: 5 > 4 free",
        ),
    ]
    cases += [  # thresholds: a block filled exactly, the free blocks or the budget used exactly
        case(
            "decodes whose tokens fill their last block exactly need no new block",
            [R(0, 8, 7, 2), R(1, 6, 5, 2)],
            [],
            0,
            hint="request 0's 8th token goes in its 2nd block (positions 4-7): blocks_for(8, 4) - 2 = 0 new blocks, "
            "so nobody is preempted",
        ),
        case(
            "a prompt of exactly 2 blocks, and exactly 2 free",
            [],
            [W(1, 8, 0, 0), W(2, 1, 0, 0)],
            2,
            hint="8 tokens in blocks of 4 need blocks_for(8, 4) = 2 blocks, and 2 are free: it is admitted",
        ),
        case(
            "a prompt that needs exactly the free blocks",
            [R(0, 9, 8, 2)],
            [W(1, 7, 0, 0)],
            3,
            hint="the decode takes 1 block (its 9th token), the prompt the 2 left: a request fits when need <= free",
        ),
        case(
            "a prompt that uses the token budget exactly",
            [R(0, 5, 4, 1)],
            [W(1, 15, 0, 0), W(2, 3, 0, 0)],
            8,
            budget=16,
            hint="1 token for the decode, all 15 of the prompt: the budget is then used up and request 2 waits",
        ),
    ]
    queues = ([R(0, 10, 9, 3), R(1, 7, 6, 2), R(2, 4, 3, 1)], [W(3, 6, 0, 0), W(4, 3, 0, 0)])
    cases += [  # the same queues, one argument changed at a time: an answer kept from an earlier call is wrong here
        case("the same queues as the next cases, 2 free blocks", *queues, 2),
        case("the same queues, one more free block", *queues, 3),
        case("the same queues, a budget of 2 tokens", *queues, 3, budget=2),
        case("the same queues, max_num_seqs 4", *queues, 3, seqs=4),
        case(
            "the same queues, block_size 3 (not a power of two)",
            *queues,
            2,
            bs=3,
            hint="blocks_for(n, 3) = ceil(n / 3): request 0 needs a 4th block for its 10th token",
        ),
        case(
            "request ids past 255 and a budget of 8192 tokens (a server's scale)",
            [R(70000, 2049, 2048, 128), R(256, 3001, 3000, 188)],
            [W(1000000, 5000, 0, 0), W(513, 40, 32, 2)],
            600,
            bs=16,
            seqs=256,
            budget=8192,
        ),
    ]
    for i in range(n_random):
        cases.append(case(f"random #{i}", *schedule_scenario(rng)))
    for j in range(n_workloads):
        cases.append(engine_case("schedule", seed + j))

    def run(
        kind,
        running,
        waiting=None,
        num_free_blocks=None,
        block_size=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
    ):  # these names appear in messages ("changed its input `running`")
        if kind == "step":
            return fn(
                running,
                waiting,
                num_free_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        return run_engine(*ENGINE_RUNS[running][:2], guarded(Batching, schedule=watched(fn)))[0]  # running: the seed

    def show(args):
        if args[0] == "step":
            running, waiting, free, bs, seqs, budget = args[1:]
            return (
                f"schedule(running={running}, waiting={waiting}, num_free_blocks={free}, block_size={bs}, "
                f"max_num_seqs={seqs}, max_num_batched_tokens={budget})"
            )
        return repr(ENGINE_RUNS[args[1]][1])

    def judge(case, got):
        if case.args[0] == "engine":
            return _engine_verdict("schedule", ENGINE_RUNS[case.args[1]][1], case.expected, got)
        return _schedule_verdict(case, got)

    run_check(
        "schedule", run, cases, judge=judge, forbid=[NO_ENGINE_SCHEDULE], show_call=show, seconds=10, total_seconds=40
    )
