"""Chapter 12's checks: your whole engine, assembled from your chapter notebooks, against the reference in every
mode it runs in.

Each mode runs both bundled models — gpt2-shakespeare (chapter 04's family) and llama-shakespeare (chapter 11's) —
on prompts you never see (slices of held-out Shakespeare, chosen where the reference's greedy choice is clear: the
best token leads the second by at least `MARGIN` in the logits at every step, so that a correct engine that rounds
differently still picks the same tokens), with your functions and with the engine's own, and compares every token:

- `single`: one prompt at a time (for GPT-2 also your tokenizer: the prompt's ids and the streamed text);
- `batched`: all prompts in one batch, left-padded to the longest;
- `llm_engine`: `LLMEngine` with arrivals over time, a pool so small that requests are preempted, and decode
  attention split into partitions;
- `speculative`: GPT-2 with its draft model, and prompt lookup on both models;
- `int8`, `int4`: the models quantized with your functions;
- `sampled`: seeded sampling (temperature, top-k, top-p): the same seed gives the same tokens.

A mode counts only when every function it runs is yours: while one of them is still the engine's own (not written
yet, or not passing its chapter's check), the mode's check fails and names the chapter to finish. When your tokens
differ, the check names the first token that differs and the function(s) that cause it: it reruns the mode with the
engine's own functions and just one of yours at a time.

    >>> pieces = your_pieces("chapters")                                            # doctest: +SKIP
    >>> check_mode("batched", pieces)                                               # doctest: +SKIP
    ✓ capstone batched — 2 models × 3 prompts, 96 new tokens each equal to the reference's
"""

from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path
from typing import Callable, Optional

import torch

from llmcourse.course.failed import CheckFailed
from llmcourse.course.learner import (
    BATCHING_SLOTS,
    CHAPTER_OF,
    TOKENIZER_SLOTS,
    Pieces,
    pieces_of,
    slots_used,
)
from llmcourse.course.limits import SCALE, cpu_seconds, time_limit, time_out_message
from llmcourse.engine.generate import generate, stream
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model
from llmcourse.engine.quantize import Quantization, dequantize_int4, quantize_model
from llmcourse.engine.slots import PartError
from llmcourse.serving.block_manager import blocks_for
from llmcourse.serving.llm_engine import LLMEngine

from .harness.show import short

GPT2, LLAMA, DRAFT = "gpt2-shakespeare", "llama-shakespeare", "gpt2-shakespeare-draft"
MARGIN = 1e-3  # the reference's best token leads the second by this much (logits) at every step of a chosen prompt
NEW_TOKENS = 16
PROMPTS = 3
SECONDS = 120  # CPU-s for one run of a mode with your functions (or SCALE × the engine's, if more): far more than
# a working engine needs (seconds), so that an endless loop in one of your functions ends the check, not the kernel
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Run:
    """One model's part of a mode: which model, how its tokens are made, and what settings `slots_used` sees."""

    model: str
    tokens: Callable  # (target, prompts, side) -> list of new-token lists
    settings: dict = dataclasses.field(default_factory=dict)
    quantize: Optional[str] = None
    extra: tuple[str, ...] = ()  # slots this run uses besides generation's
    without: tuple[str, ...] = ()  # generation's slots this run does not use


def greedy_alone(target, prompts, side):
    return [generate(target, p, max_new_tokens=NEW_TOKENS, eos_token_id=None) for p in prompts]


def greedy_batched(target, prompts, side):
    return generate(target, prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None)


def engine_with_preemption(target, prompts, side):
    """Arrivals over 4 steps, 3 requests at once in a pool of blocks of 4 positions one block bigger than the longest
    request needs (so that requests are preempted and recomputed), prompts prefilled in chunks of up to 12 tokens,
    decode attention in partitions of 8 positions (merged)."""
    pool = max(blocks_for(len(p) + NEW_TOKENS, 4) for p in prompts) + 1
    engine = LLMEngine(
        target, block_size=4, num_blocks=pool, max_num_seqs=3, max_num_batched_tokens=12, partition_size=8
    )
    out = engine.generate(prompts, arrivals=[0, 1, 4][: len(prompts)], max_new_tokens=NEW_TOKENS, eos_token_id=None)
    side["preemptions"] = engine.stats["preemptions"]
    return out


def with_draft(target, prompts, side):
    return [
        generate(target, p, max_new_tokens=NEW_TOKENS, eos_token_id=None, draft=side["draft"], num_draft_tokens=4)
        for p in prompts
    ]


def prompt_lookup(target, prompts, side):
    return [generate(target, p, max_new_tokens=NEW_TOKENS, eos_token_id=None, draft="prompt-lookup") for p in prompts]


def sampled(target, prompts, side):
    return [
        generate(target, p, max_new_tokens=NEW_TOKENS, eos_token_id=None, seed=100 + i, **SAMPLING)
        for i, p in enumerate(prompts)
    ]


def tokenizer_and_text(target, prompts, side):
    """GPT-2 alone, from text: the prompt encoded by the side's tokenizer, the new tokens, and the streamed text."""
    tok = side["tokenizer"]
    out = []
    for text in side["texts"]:
        ids = tok.encode(text)
        tokens = generate(target, ids, max_new_tokens=NEW_TOKENS, eos_token_id=None)
        shown = "".join(stream(target, tok, ids, max_new_tokens=NEW_TOKENS, eos_token_id=None))
        out.append((ids, tokens, shown))
    return out


NOT_GENERATION = ("KVCache", "left_pad")  # LLMEngine keeps keys and values in its pool, batches without padding
MODES = {
    "single": (Run(GPT2, tokenizer_and_text, extra=TOKENIZER_SLOTS), Run(LLAMA, greedy_alone)),
    "batched": (Run(GPT2, greedy_batched), Run(LLAMA, greedy_batched)),
    "llm_engine": tuple(
        Run(m, engine_with_preemption, extra=BATCHING_SLOTS[1:], without=NOT_GENERATION) for m in (GPT2, LLAMA)
    ),
    "speculative": (
        Run(GPT2, with_draft, {"draft": DRAFT}),
        Run(GPT2, prompt_lookup, {"draft": "prompt-lookup"}),
        Run(LLAMA, prompt_lookup, {"draft": "prompt-lookup"}),
    ),
    "int8": (Run(GPT2, greedy_batched, quantize="int8"), Run(LLAMA, greedy_batched, quantize="int8")),
    "int4": (Run(GPT2, greedy_batched, quantize="int4"), Run(LLAMA, greedy_batched, quantize="int4")),
    "sampled": (Run(GPT2, sampled, SAMPLING), Run(LLAMA, sampled, SAMPLING)),
}


def mode_slots(mode: str) -> set[str]:
    """Every slot the mode runs, over all its models."""
    used: set[str] = set()
    for run in MODES[mode]:
        model_type = "gpt2" if run.model.startswith("gpt2") else "llama"
        slots = slots_used({**run.settings, "quantize": run.quantize}, model_type) | set(run.extra)
        used |= slots - set(run.without) - (set(TOKENIZER_SLOTS) - set(run.extra))
    return used - {"smooth_scales"}


# -- the hidden prompts ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def held_out_text() -> str:
    return (Path(__file__).resolve().parents[1] / "data" / "shakespeare_val.txt").read_text(encoding="utf-8")


# The engine's own int4 route quantizes the activations too (Q4_0 x Q8_0, as llama.cpp): another number than
# chapter 09's dequantize-then-multiply. The reference takes the learner's route with the engine's functions.
LEARNERS_ROUTE = Quantization(dequantize_int4=lambda packed, scales: dequantize_int4(packed, scales))


@functools.lru_cache(maxsize=None)
def reference_model(name: str, quantize: Optional[str] = None):
    model = load_model(name, device="cpu")
    return model if quantize is None else quantize_model(model, quantize, LEARNERS_ROUTE)


def clear_lead(model, ids: list[int]) -> bool:
    """Whether the greedy continuation of `ids` has a best token at least MARGIN ahead of the second at every step."""
    tokens = generate(model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + tokens[:-1]]))[0, len(ids) - 1 :].float()  # [NEW_TOKENS, V]
    top2 = logits.topk(2, dim=-1).values
    return bool((top2[:, 0] - top2[:, 1] >= MARGIN).all())


@functools.lru_cache(maxsize=None)
def hidden_prompts(
    model_name: str, quantize: Optional[str] = None, seed: int = 0
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """PROMPTS (text, ids) from the held-out plays, each starting at a line, 8-24 tokens, with a clear greedy lead
    in the reference (quantized as asked); another `seed`, other prompts."""
    rng = random.Random(f"capstone {model_name} {seed}")
    text, tok = held_out_text(), load_tokenizer(model_name)
    model = reference_model(model_name, quantize)
    chosen: list[tuple[str, tuple[int, ...]]] = []
    starts = [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2].isalpha()]
    for _ in range(200):
        start = rng.choice(starts)
        ids = tok.encode(text[start : start + 200])[: rng.randint(8, 24)]
        piece = tok.decode(ids)
        if "\ufffd" in piece:
            continue
        ids = tok.encode(piece)  # what encoding the text gives (its BOS included for the Llama tokenizer)
        if clear_lead(model, ids):
            chosen.append((piece, tuple(ids)))
        if len(chosen) == PROMPTS:
            return tuple(chosen)
    raise RuntimeError(f"only {len(chosen)} prompts with a clear lead for {model_name}")  # not for these models


# -- running a mode ------------------------------------------------------------------------------------------------


def run_side(run: Run, pieces: Optional[Pieces], seed: int = 0) -> list:
    """The run's tokens on the prompts of `seed`, with the engine's own functions (pieces None) or with `pieces`."""
    chosen = hidden_prompts(run.model, run.quantize, seed)
    prompts, side = [list(ids) for _, ids in chosen], {"texts": [text for text, _ in chosen]}
    if pieces is None:
        target = reference_model(run.model, run.quantize)
        side["tokenizer"], side["draft"] = load_tokenizer(run.model), reference_model(DRAFT)
    else:
        model = load_model(run.model, device="cpu", parts=pieces.parts)  # your loader for the Llama family
        target = pieces.install(model, run.quantize)  # quantized with your functions
        side["tokenizer"] = pieces.tokenizer if run.model.startswith("gpt2") else load_tokenizer(run.model)
        draft = load_model(DRAFT, device="cpu")
        draft.parts = pieces.parts
        side["draft"] = draft
    out = run.tokens(target, prompts, side)
    if run.tokens is engine_with_preemption and pieces is None:
        assert side["preemptions"] > 0, "the reference run has no preemption: make the pool smaller"
    return out


def first_difference(expected: list, got: list) -> Optional[tuple[int, str]]:
    """(prompt index, what differs) for the first prompt whose result differs, or None."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if e == g:
            continue
        if isinstance(e, tuple):  # single GPT-2: (prompt ids, new tokens, text)
            if e[0] != g[0]:
                return i, f"your encode gives the prompt's ids {short(g[0], 120)}, the reference {short(e[0], 120)}"
            if e[1] != g[1]:
                return i, tokens_differ(e[1], g[1])
            return i, f"the same tokens, but the streamed text differs: expected {e[2]!r}, got {g[2]!r}"
        return i, tokens_differ(e, g)
    return None if len(expected) == len(got) else (len(got), f"{len(got)} results for {len(expected)} prompts")


def tokens_differ(expected: list[int], got: list[int]) -> str:
    if not isinstance(got, list) or len(got) != len(expected):
        return f"expected {len(expected)} new tokens, got {short(got, 120)}"
    at = next(k for k, (a, b) in enumerate(zip(expected, got)) if a != b)
    return f"new token {at} differs: expected {expected[at]}, got {got[at]} (the {at} before it are the same)"


def check_mode(mode: str, pieces: Pieces, *, seed: int = 0) -> None:
    """Check your engine (`pieces`: `your_pieces(folder)`) in one mode on the prompts of `seed` (the graded run uses
    prompts you do not see); print one line, or raise CheckFailed."""
    __tracebackhide__ = True
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; the modes are {', '.join(MODES)}")
    name = f"capstone {mode}"
    uses = mode_slots(mode)
    engines = [s for s in sorted(uses) if s not in pieces.mine]
    if engines:
        raise CheckFailed(
            f"✗ {name} — this mode runs functions that are still the engine's own:\n" + still_to_do(engines, pieces)
        )
    for run in MODES[mode]:
        start = cpu_seconds()
        expected = run_side(run, None, seed)
        engine = cpu_seconds() - start
        limit = time_limit(max(SECONDS, SCALE * engine))
        try:
            with limit:
                got = run_side(run, pieces, seed)
        except PartError as err:
            raise CheckFailed(f"✗ {name} — {describe(run)}: your engine stopped: {err}") from None
        except TimeoutError:
            if not limit.expired:
                raise
            what = f"{name} — {describe(run)}: your engine"
            raise CheckFailed(time_out_message(what, limit, floor=SECONDS, reference=("engine", engine))) from None
        diff = first_difference(expected, got)
        if diff is not None:
            prompt, what = diff
            text = hidden_prompts(run.model, run.quantize, seed)[prompt][0]
            raise CheckFailed(
                f"✗ {name} — {describe(run)}, prompt {prompt} of seed {seed} ({short(text, 60)}): {what}\n"
                + blame(run, pieces, uses, expected, seed)
            )
    if set(TOKENIZER_SLOTS) & uses and set(TOKENIZER_SLOTS) - set(pieces.tokenizer.mine):
        gone = sorted(set(TOKENIZER_SLOTS) - set(pieces.tokenizer.mine))
        raise CheckFailed(f"✗ {name} — your {', '.join(gone)} failed during the run, and the engine's took over")
    runs = MODES[mode]
    print(f"✓ {name} — {len(runs)} runs ({', '.join(describe(r) for r in runs)}), {PROMPTS} prompts each "
          f"(seed {seed}): every token equal to the reference's")  # fmt: skip


def describe(run: Run) -> str:
    how = {
        greedy_alone: "alone",
        greedy_batched: "batched",
        engine_with_preemption: "LLMEngine",
        sampled: "sampled",
        with_draft: "with its draft model",
        prompt_lookup: "prompt lookup",
        tokenizer_and_text: "from text",
    }
    return f"{run.model}{' ' + run.quantize if run.quantize else ''} {how.get(run.tokens, '')}".strip()


def still_to_do(slots: list[str], pieces: Pieces) -> str:
    """Chapter by chapter, which of `slots` are not yours and why; then which chapters to finish."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for slot in slots:
        chapter, _, why = pieces.origins.get(slot, (CHAPTER_OF.get(slot, "?"), slot, None))
        why = why or "not found (is the chapter's notebook in your chapters folder, saved?)"
        grouped.setdefault((chapter, why.removeprefix("is ")), []).append(slot)
    lines = [f"  {chapter} ({', '.join(names)}): {why}" for (chapter, why), names in sorted(grouped.items())]
    chapters = sorted({chapter for chapter, _ in grouped})
    return (
        "\n".join(lines) + f"\n  hint: finish {', '.join(chapters)} (python -m llmcourse progress shows what is left)"
    )


def blame(run: Run, pieces: Pieces, uses: set[str], expected: list, seed: int) -> str:
    """Which of your functions makes the difference: the mode rerun with the engine's own and one of yours."""
    culprits = []
    for slot in sorted(uses & set(pieces.mine)):
        alone = pieces_of({slot: pieces.mine[slot]}, notify=lambda line: None)
        try:
            differs = first_difference(expected, run_side(run, alone, seed)) is not None
        except PartError:
            differs = True
        if differs:
            culprits.append(slot)
    if not culprits:
        return ("  each of your functions alone gives the reference's tokens: the difference comes from two or more "
                "of them together\n  hint: rerun the chapter checks (python -m llmcourse progress)")  # fmt: skip
    where = ", ".join(f"{s} ({CHAPTER_OF.get(s, '?')})" for s in culprits)
    return (f"  the difference comes from your {where}: the engine with only that function of yours gives it too\n"
            f"  hint: rerun the checks of {', '.join(sorted({CHAPTER_OF.get(s, '?') for s in culprits}))}; a check "
            "passes within a tolerance, and this mode needs the same tokens on new inputs")  # fmt: skip
