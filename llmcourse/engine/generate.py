"""Text generation: prefill the prompt into the KV cache, then decode one token at a time.

Three entry points share one loop:

- `generate(model, prompt_ids, ...)` -> new token ids (one prompt, or a batch of prompts of
  different lengths, left-padded so that each row gets exactly the tokens it gets alone);
- `stream(model, tokenizer, prompt, ...)` -> an iterator of text pieces as they are decoded;
- `generate_text(model, tokenizer, prompt, ...)` -> the continuation as one string.

Decoding settings: a `SamplingParams` (`llmcourse.engine.sampling`: `max_new_tokens`, `temperature` (0 = greedy,
the default), `top_k`, `top_p`, `min_p`, `repetition_penalty` (same meaning and order as transformers),
`presence_penalty`, `frequency_penalty` and `logit_bias` (OpenAI's, in vLLM's order), `stop_token_ids`,
`num_beams` and `length_penalty` (beam search, greedy only), `eos_token_id` (stops a row; None never
stops), `seed` (sampling is reproducible: the same seed gives the same text), `stop` (strings that end
the text of `stream` and `generate_text`, not included)), or its fields as keywords. A `generator`
replaces the seed's. `draft` (a model with the target's vocabulary, a bundled name such as
'gpt2-shakespeare-draft', or 'prompt-lookup') turns on speculative decoding with `num_draft_tokens`
proposals per round (or "auto": chosen from the acceptance rate as it goes): the same tokens as without it
when greedy, the same distribution when sampling (see `llmcourse.engine.speculative`); pass
`stats=SpeculationStats()` to see how many proposals were accepted.
`constraint` (a compiled `structured.Constraint`, or one per row) masks each step's disallowed tokens so that the
text matches a regex, a choice or a JSON schema (`llmcourse.engine.structured`).
`compile=True` runs each decode step as one torch.compile'd graph of fixed shapes, replayed as a
CUDA graph on a GPU (the first call compiles, which takes a while). The environment variable
`LLMCOURSE_COMPILE_BACKEND=eager` traces the same graph without generating code (seconds instead of a
minute: the test suite runs all but its inductor tests that way).

The functions generation calls, each the engine's own unless given: `sampler` (a `Sampler`: the logits
processors, `greedy`, `sample`), `kv_cache` (the KV cache class; a compiled step always uses the engine's
`KVCache`, which writes at a slot tensor), `left_pad` (a static batch's padding) and `speculation` (a
`Speculation`: speculative decoding's rule, verify step, prompt lookup and round).

`model` is a model (`load_model(...)`: GPT-2 or the Llama family), or an engine such as the one
`llmcourse.course.learner.my_engine()` returns: its model runs, with its `functions`.

    >>> ids = generate(model, tok.encode("ROMEO:"), max_new_tokens=20)            # doctest: +SKIP
    >>> for piece in stream(model, tok, "ROMEO:", temperature=0.8, seed=1): ...   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from . import padding, threads
from .decoder import Decoder
from .sampling import ENGINE_SAMPLER, Sampler, SamplingParams, eos_ids
from .speculative import Speculation, SpeculationStats, check_speculation, resolve_draft, speculative_steps
from .structured.constraint import Constraint, Guide, mask_rows_
from .tokenizer import EOT_ID, stream_decoder

NUM_DRAFT_TOKENS = 4  # prompt lookup is fastest here at k = 3-8; the bundled draft model at k = 1 (benchmarks page)
PromptIds = Union[Sequence[int], Sequence[Sequence[int]]]


def as_model(model) -> tuple[Decoder, dict]:
    """(the model generation runs, the functions it runs with): `model` itself and none of its own, or, for an
    engine such as `my_engine()`'s (an object with `.model` and `.functions`, a dict of the drivers' keywords:
    `sampler`, `kv_cache`, `left_pad`, `speculation`, `batching`), its model and its functions.

    Anything else is refused saying what to pass, rather than failing later on a missing attribute.
    """
    if isinstance(model, Decoder):
        return model, {}
    inner = getattr(model, "model", None)
    if isinstance(inner, Decoder):
        return inner, dict(getattr(model, "functions", {}))
    if hasattr(model, "config") and hasattr(model, "new_cache"):  # a model look-alike (duck typing is fine)
        return model, {}
    raise TypeError(
        f"expected a model (llmcourse.load_model(...)) or my_engine()'s engine, got {type(model).__name__}; "
        "e.g. generate_text(llmcourse.load_model(), tokenizer, 'ROMEO:') or my_engine().generate_text('ROMEO:')"
    )


def functions_of(engines: dict, **given) -> dict:
    """The functions a driver runs with, by keyword: each one `given` (not None), else the engine's (`as_model`)."""
    return {name: engines.get(name) if fn is None else fn for name, fn in given.items()}


def generate(
    model: Decoder,
    prompt_ids: PromptIds,
    params: Optional[SamplingParams] = None,
    *,
    generator: Optional[torch.Generator] = None,
    compile: bool = False,
    draft=None,
    num_draft_tokens: Union[int, str] = NUM_DRAFT_TOKENS,
    stats: Optional[SpeculationStats] = None,
    sampler: Optional[Sampler] = None,
    kv_cache: Optional[Callable] = None,
    left_pad: Optional[Callable] = None,
    speculation: Optional[Speculation] = None,
    constraint=None,
    **settings,
) -> Union[list[int], list[list[int]]]:
    """New token ids for one prompt (a list of ids) or for each prompt of a batch (a list of lists).

    The settings: a `SamplingParams`, or its fields as keywords (over it, if both). A row ends with
    `eos_token_id` (included) or after `max_new_tokens` tokens. `sampler`, `kv_cache` (a class),
    `left_pad` and `speculation` replace the engine's own functions there (see the module's docstring).
    `constraint`: a compiled `structured.Constraint` (`compile_constraint(tokenizer, regex=...)`) that every row
    follows, or a list of one per row (None: free); a constrained row ends where its constraint says (see
    `structured.constraint`), its EOS included.

        >>> generate(model, [15496, 995], max_new_tokens=3)   # doctest: +SKIP
        [13, 314, 1101]
    """
    model, engines = as_model(model)
    fns = functions_of(engines, sampler=sampler, kv_cache=kv_cache, left_pad=left_pad, speculation=speculation)
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    single = len(prompt_ids) == 0 or isinstance(prompt_ids[0], int)
    batch = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    params = SamplingParams.of(params, **settings).for_model(model)
    if params.stop:
        raise ValueError("stop strings end a text: use stream or generate_text (generate returns token ids)")
    check_request(model, batch, params.max_new_tokens, params.eos_token_id)
    check_compile(params, compile)
    guides = new_guides(constraint, len(batch), params, compile)
    if draft is not None:
        draft = checked_draft(model, draft, batch, num_draft_tokens, params, compile)
        generator = generator or new_generator(model, params.seed)
        out = [
            list(
                speculative_steps(
                    model,
                    draft,
                    p,
                    params,
                    num_draft_tokens=num_draft_tokens,
                    generator=generator,
                    stats=stats,
                    speculation=fns.get("speculation"),
                    sampler=fns.get("sampler"),
                    kv_cache=fns.get("kv_cache"),
                    guide=guides[i] if guides else None,
                )
            )
            for i, p in enumerate(batch)
        ]
    elif params.num_beams > 1:
        out = [
            beam_search(
                model,
                p,
                num_beams=params.num_beams,
                max_new_tokens=params.max_new_tokens,
                length_penalty=params.length_penalty,
                eos_token_id=params.eos_token_id,
                repetition_penalty=params.repetition_penalty,
                sampler=fns.get("sampler"),
                kv_cache=fns.get("kv_cache"),
            )
            for p in batch
        ]
    else:
        eos_token_id = params.eos_token_id
        steps = decode_steps(
            model,
            batch,
            params,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos_token_id,
            generator=generator or new_generator(model, params.seed),
            compile=compile,
            sampler=fns.get("sampler"),
            kv_cache=fns.get("kv_cache"),
            left_pad=fns.get("left_pad"),
            guides=guides,
        )
        rows = torch.stack(list(steps), dim=1).tolist()  # one copy to the host, after the last step
        out = [
            row[: guides[i].length] if guides and guides[i] else until_eos(row, eos_token_id)
            for i, row in enumerate(rows)
        ]
    return out[0] if single else out


def new_guides(constraint, rows: int, params: SamplingParams, compile: bool = False) -> Optional[list]:
    """A `Guide` per row for `constraint` (one for all rows, or a list of one per row, None for a free row), or
    None when no row is constrained."""
    if constraint is None:
        return None
    constraints = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * rows
    if len(constraints) != rows:
        raise ValueError(f"constraint: give one, or a list of one per prompt ({rows}), got {len(constraints)}")
    if any(c is not None and not isinstance(c, Constraint) for c in constraints):
        raise ValueError("constraint must be compiled: llmcourse.engine.structured.compile_constraint(tokenizer, ...)")
    if params.num_beams > 1 or compile:
        raise ValueError("a constraint applies to greedy decoding and sampling without compile=True and beam search")
    return [Guide(c, eos_ids(params.eos_token_id)) if c is not None else None for c in constraints]


def stream(
    model: Decoder,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    params: Optional[SamplingParams] = None,
    *,
    generator: Optional[torch.Generator] = None,
    compile: bool = False,
    draft=None,
    num_draft_tokens: Union[int, str] = NUM_DRAFT_TOKENS,
    stats: Optional[SpeculationStats] = None,
    sampler: Optional[Sampler] = None,
    kv_cache: Optional[Callable] = None,
    left_pad: Optional[Callable] = None,
    speculation: Optional[Speculation] = None,
    constraint=None,
    **settings,
) -> Iterator[str]:
    """Yield the continuation of `prompt` (a text, or its token ids: e.g. a chat template's, BOS included) as text
    pieces, as soon as they are complete characters.

    Takes `generate`'s settings and functions. Stops at `eos_token_id` (not shown), `max_new_tokens`, or the
    first of the `stop` strings (the text before it is the last thing yielded). Beam search yields its best
    sequence at the end.
    """
    model, engines = as_model(model)
    fns = functions_of(engines, sampler=sampler, kv_cache=kv_cache, left_pad=left_pad, speculation=speculation)
    ids = tokenizer.encode(prompt, allowed_special="all") if isinstance(prompt, str) else list(prompt)
    params = SamplingParams.of(params, **settings).for_model(model)
    check_request(model, [ids], params.max_new_tokens, params.eos_token_id)
    check_compile(params, compile)
    guides = new_guides(constraint, 1, params, compile)
    if draft is not None:
        draft = checked_draft(model, draft, [ids], num_draft_tokens, params, compile)
        tokens = speculative_steps(
            model,
            draft,
            ids,
            params,
            num_draft_tokens=num_draft_tokens,
            generator=generator or new_generator(model, params.seed),
            stats=stats,
            speculation=fns.get("speculation"),
            sampler=fns.get("sampler"),
            kv_cache=fns.get("kv_cache"),
            guide=guides[0] if guides else None,
        )
    elif params.num_beams > 1:
        tokens = iter(generate(model, ids, dataclasses.replace(params, stop=()), **fns))
    else:
        steps = decode_steps(
            model,
            [ids],
            params,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=params.eos_token_id,
            generator=generator or new_generator(model, params.seed),
            compile=compile,
            sampler=fns.get("sampler"),
            kv_cache=fns.get("kv_cache"),
            left_pad=fns.get("left_pad"),
            guides=guides,
        )
        tokens = (int(t) for t in steps)
    if guides:  # the guide says where the text ends (an EOS id may be text there), and what ends it is not text
        tokens = guided_text(tokens, guides[0])
        return stop_at(decoded(tokens, tokenizer, None), params.stop)
    # Checked above and returned (not yielded from here) so that bad input raises at the call.
    return stop_at(decoded(tokens, tokenizer, params.eos_token_id), params.stop)


def guided_text(tokens: Iterator[int], guide) -> Iterator[int]:
    """The tokens of a constrained stream that are text: up to where its guide ended, not the EOS that ended it."""
    for i, token in enumerate(tokens):
        if i >= guide.length or (guide.ended_by_eos and i == guide.length - 1):
            return
        yield token
        if guide.ended and i == guide.length - 1:
            return


def generate_text(
    model: Decoder, tokenizer, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None, **settings
) -> str:
    """The continuation of `prompt` as one string; takes the same settings and functions as `stream`."""
    return "".join(stream(model, tokenizer, prompt, params, **settings))


def until_eos(tokens: list[int], eos_token_id) -> list[int]:
    """`tokens` up to and including the first EOS id (`eos_token_id`: an id, a tuple of them, or None)."""
    stops = eos_ids(eos_token_id)
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stops), tokens)


def decoded(tokens: Iterator[int], tokenizer, eos_token_id) -> Iterator[str]:
    """Text pieces for a stream of token ids, ending at EOS; never splits a UTF-8 character.
    A tokenizer may bring its own streaming decoder (`tokenizer.stream_decoder()`)."""
    decoder = stream_decoder(tokenizer)
    stops = eos_ids(eos_token_id)
    for token in tokens:
        if token in stops:
            break
        if piece := decoder.push(token):
            yield piece
    if rest := decoder.flush():
        yield rest


class StopStrings:
    """Text pieces in, the text before the first stop string out; what may begin a stop string is held back until
    the next pieces tell (a stop string can span tokens).

        >>> stops = StopStrings(["\\n\\n"])
        >>> stops.push("To be"), stops.push(", or\\n"), stops.push("\\nnot"), stops.stopped
        ('To be', ', or', '', True)
    """

    def __init__(self, stop: Sequence[str]):
        self.stop, self.pending, self.stopped = tuple(stop), "", False

    def push(self, piece: str) -> str:
        """Add a piece; return the text now known to come before any stop string (possibly '')."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self.pending[: min(hits)]
        keep = max((n for s in self.stop for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        ready, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return ready

    def flush(self) -> str:
        """End of text: what was held back (no stop string came)."""
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest


def stop_at(pieces: Iterator[str], stop: Sequence[str]) -> Iterator[str]:
    """Pass text pieces through until a stop string appears; hold back what may begin one."""
    stops = StopStrings(stop)
    for piece in pieces:
        if ready := stops.push(piece):
            yield ready
        if stops.stopped:
            return
    if rest := stops.flush():
        yield rest


def new_generator(model: Decoder, seed: int) -> torch.Generator:
    return torch.Generator(device=model.device).manual_seed(seed)


def check_request(model: Decoder, batch: list[list[int]], max_new_tokens: int, eos_token_id) -> None:
    """Refuse prompts and lengths this model cannot run, saying what is allowed (the settings themselves are
    `SamplingParams`' to check)."""
    cfg = model.config
    if not batch:
        raise ValueError("no prompts given: pass a list of token ids, or a list of such lists")
    if any(not 0 <= t < cfg.vocab_size for t in eos_ids(eos_token_id)):
        raise ValueError(f"eos_token_id must be a token id in [0, {cfg.vocab_size}) or None, got {eos_token_id!r}")
    for i, ids in enumerate(batch):
        which = f"prompt {i}" if len(batch) > 1 else "the prompt"
        if not ids:
            bos = getattr(cfg, "bos_token_id", None)
            start = (
                f"[{EOT_ID}], the <|endoftext|> token GPT-2 saw between documents" if bos is None else f"[{bos}], BOS"
            )
            raise ValueError(f"{which} is empty: give at least one token (to start from nothing, use {start})")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{which} holds {bad[0]!r}, not a token id in [0, {cfg.vocab_size})")
        if len(ids) + max_new_tokens > cfg.n_positions:
            room = cfg.n_positions - len(ids)
            fix = f"lower max_new_tokens to at most {room}" if room >= 1 else "shorten the prompt"
            raise ValueError(
                f"{which} has {len(ids)} token(s) and max_new_tokens is {max_new_tokens}: "
                f"{len(ids) + max_new_tokens} positions, but the model has only n_positions={cfg.n_positions}; {fix}"
            )


def check_compile(params: SamplingParams, compile: bool) -> None:
    if params.num_beams > 1 and compile:
        raise ValueError(
            "compile=True applies to greedy decoding and sampling; beam search runs uncompiled, "
            "so use num_beams=1 or compile=False"
        )


def checked_draft(
    model: Decoder,
    draft,
    batch: list[list[int]],
    num_draft_tokens: Union[int, str],
    params: SamplingParams,
    compile: bool,
):
    """`draft` resolved (a model, or 'prompt-lookup'), refused where speculative decoding does not apply."""
    if params.num_beams > 1:
        raise ValueError(
            "speculative decoding (draft=...) samples or decodes greedily; it does not combine with "
            "beam search: use num_beams=1"
        )
    if compile:
        raise ValueError(
            "compile=True applies to plain decoding; speculative decoding (draft=...) runs uncompiled, "
            "so leave out compile=True or the draft"
        )
    draft = resolve_draft(model, draft)
    check_speculation(model, draft, batch, num_draft_tokens, params.max_new_tokens)
    return draft


CACHE_LENGTH_STEP = 64

# A GPU runs ahead of Python; asking it whether every row has finished makes Python wait for it,
# so the decode loop asks only every this many steps (finished rows just repeat EOS meanwhile).
EOS_CHECK_EVERY = {"cpu": 1, "cuda": 8}


@torch.inference_mode()
def decode_steps(
    model: Decoder,
    batch: list[list[int]],
    settings: SamplingParams,
    *,
    max_new_tokens: int,
    eos_token_id,
    generator: Optional[torch.Generator],
    compile: bool = False,
    sampler: Optional[Sampler] = None,
    kv_cache: Optional[Callable] = None,
    left_pad: Optional[Callable] = None,
    guides: Optional[list] = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row [B], step by step (finished rows repeat `eos_token_id`), choosing
    with `sampler`, caching in a `kv_cache` (each the engine's own by default), padding with `left_pad`.
    `guides` (a `structured.Guide` or None per row): each step the row's disallowed tokens are masked before the
    sampler, and the guide decides where the row ends (each step then reads the tokens back: one sync per step).

    Prompts of different lengths are left-padded; the attention mask hides the padding and the
    position ids count only real tokens, so a row computes what it would alone. The tokens stay
    on the model's device: nothing in the loop waits for the GPU except the occasional EOS check.
    """
    threads.choose()
    device, B = model.device, len(batch)
    longest = max(map(len, batch))
    total = longest + max_new_tokens
    if compile:  # a compiled step is specialized to the cache's length: round it up to reuse one more often
        total = min(-(-total // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP, model.config.n_positions)
    sampler = sampler or ENGINE_SAMPLER
    input_ids, prompt_mask, positions = (left_pad or padding.left_pad)(batch)  # [B, longest] each
    mask = torch.cat([prompt_mask, torch.ones(B, total - longest, dtype=torch.long)], dim=1)  # generated: real
    input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
    padded = any(len(ids) < longest for ids in batch)

    seen = None
    if settings.repetition_penalty != 1.0:
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, input_ids, mask[:, :longest].bool())  # only real tokens count, not padding
    counts = None  # [B, V]: how often each row generated each token (presence and frequency penalties)
    if settings.counts_generated:
        counts = torch.zeros(B, model.config.vocab_size, device=device)
        ones = torch.ones(B, 1, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(eos_ids(eos_token_id), dtype=torch.long, device=device)  # [n_eos]
    check_every = EOS_CHECK_EVERY.get(device.type, 8)
    free = None  # [B] bool: the rows no guide ends, which EOS ends (None: every row has a guide)
    if guides and any(g is None for g in guides):
        free = torch.tensor([g is None for g in guides], device=device)

    cache = model.new_cache(B, total, cache_class=None if compile else kv_cache)  # a compiled step: the engine's
    logits = model(
        input_ids,
        position_ids=positions,
        attention_mask=mask[:, :longest] if padded else None,
        cache=cache,
        last_only=True,
    )[:, -1]  # [B, V]
    next_pos = positions[:, -1:] + 1  # [B, 1]
    slot = torch.tensor([longest], device=device)  # the cache position the next token goes to
    compiled_step = compiled_decode_step(model) if compile else None
    for step in range(max_new_tokens):
        if guides:
            logits = mask_rows_(logits, guides)  # [B, V]: each row's disallowed tokens at -inf
        token = sampler.next_token(logits, settings, seen, generator, counts)  # [B]
        if len(stops):
            token = torch.where(finished, stops[0], token)  # a finished row repeats its first EOS id
        if guides:  # a guided row ends where its guide ends (an EOS id may be text there)
            for guide, t in zip(guides, token.tolist()):
                if guide is not None:
                    guide.advance(t)
            ended = [g is not None and g.ended for g in guides]
            if any(ended):
                finished |= torch.tensor(ended, device=device)
            if free is not None:
                finished |= free & torch.isin(token, stops)
        elif len(stops):
            finished |= torch.isin(token, stops)
        yield token
        if step == max_new_tokens - 1:
            return
        if (len(stops) or guides) and step % check_every == check_every - 1 and bool(finished.all()):
            return
        if seen is not None:
            seen.scatter_(1, token[:, None], True)  # an indexed "= True" copies the scalar to the GPU: a sync
        if counts is not None:
            counts.scatter_add_(1, token[:, None], ones)
        if compiled_step is not None:  # static shapes: the whole mask, the slot as a tensor; torch's threads
            with threads.torch_computes():
                logits = compiled_step(model, token[:, None], next_pos, mask, cache, slot)
            slot += 1
            cache.length += 1
        else:
            logits = decode_step(
                model, token[:, None], next_pos, mask[:, : cache.length + 1] if padded else None, cache
            )
        next_pos = next_pos + 1


def decode_step(
    model: Decoder,
    token: Tensor,
    position_ids: Tensor,
    attention_mask: Optional[Tensor],
    cache,
    slot: Optional[Tensor] = None,
) -> Tensor:
    """Logits [B, V] after one more token per row, token [B, 1]; see `Decoder.forward` for `slot`."""
    return model(token, position_ids=position_ids, attention_mask=attention_mask, cache=cache, slot=slot)[:, -1]


class CompileError(RuntimeError):
    """torch.compile failed on this machine (e.g. no C++ compiler for the CPU backend)."""


_compiled: dict[str, Callable] = {}
_frozen: dict[int, tuple] = {}  # id(model) -> the weights the CPU graphs were frozen with
RECOMPILE_LIMIT = 32  # graphs per compiled step (shapes: batch sizes, cache lengths); torch's default is 8


def compile_step(fn: Callable, device: torch.device, *, freeze: bool = False) -> Callable:
    """`fn` compiled for fixed shapes (torch recompiles it by itself for new shapes, up to RECOMPILE_LIMIT), on
    CUDA also replayed as a CUDA graph: one launch per call instead of hundreds, over inputs copied into the
    graph's own buffers. `freeze` (CPU): the weights are frozen into the graph, which lets inductor prepack them.
    The backend is inductor unless LLMCOURSE_COMPILE_BACKEND says otherwise (`eager`: dynamo traces the same graph
    and runs it without generating code, as the test suite does). A failure to compile raises `CompileError`."""
    backend = os.environ.get("LLMCOURSE_COMPILE_BACKEND", "inductor")
    mode = None if backend != "inductor" else "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(fn, backend=backend, mode=mode, fullgraph=True, dynamic=False)

    def step(*args) -> Tensor:
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                if device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs may now be overwritten
                    return compiled(*args)
                with torch._inductor.config.patch(freezing=freeze):  # read when compiling, at a shape's first call
                    return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CompileError(
                f"torch.compile could not compile the decode step ({reason}); run without compile=True (--compile)"
            ) from err

    return step


def compiled_decode_step(model: Decoder):
    """`decode_step` compiled (`compile_step`), once per device type; on the CPU with the weights frozen into
    the graph, which makes batched steps faster (batch 1 is already memory-bound)."""
    device = model.device
    if device.type not in _compiled:
        _compiled[device.type] = compile_step(decode_step, device, freeze=device.type == "cpu")
    if device.type == "cpu":
        # Frozen weights are copies: if this model's weights changed since (loaded, trained, moved),
        # its graphs are stale, and torch does not notice. Start over. (Tensors created under
        # inference_mode keep no version count; only their replacement is seen.)
        weights = tuple((t.data_ptr(), None if t.is_inference() else t._version) for t in model.parameters())
        if _frozen.setdefault(id(model), weights) != weights:
            torch._dynamo.reset()
            _frozen.clear()
            _frozen[id(model)] = weights
    return _compiled[device.type]


@torch.inference_mode()
def beam_search(
    model: Decoder,
    prompt: list[int],
    *,
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    eos_token_id=EOT_ID,
    repetition_penalty: float = 1.0,
    sampler: Optional[Sampler] = None,
    kv_cache: Optional[Callable] = None,
) -> list[int]:
    """The highest-scoring continuation found by beam search, as transformers computes it.

    Each step extends every live beam by every token and keeps the 2·num_beams best candidates by
    summed log-probability. Candidates ending in EOS (or at max_new_tokens) among the top num_beams
    become finished hypotheses, scored sum_logprob / new_tokens ** length_penalty; the others, best
    first, become the next live beams. Search stops when num_beams hypotheses are finished and the
    best live beam, scored at its current length, cannot beat the worst of them.
    """
    threads.choose()
    device, V, K = model.device, model.config.vocab_size, num_beams
    settings, sampler = SamplingParams(repetition_penalty=repetition_penalty), sampler or ENGINE_SAMPLER
    prompt_t = torch.tensor([prompt], device=device)
    cache = model.new_cache(1, len(prompt) + max_new_tokens, cache_class=kv_cache)
    logits = model(prompt_t, cache=cache, last_only=True)[:, -1].expand(K, V)  # [K, V]
    cache.reorder(torch.zeros(K, dtype=torch.long, device=device))
    beams = [[] for _ in range(K)]  # tokens generated by each live beam
    scores = torch.full((K,), -1e9, device=device)
    scores[0] = 0.0  # all beams start equal: expand the first only, or they would pick the same tokens
    finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first, at most K

    for step in range(max_new_tokens):
        seen = None
        if repetition_penalty != 1.0:
            seen = torch.zeros(K, V, dtype=torch.bool, device=device)
            seen[:, prompt_t[0]] = True
            for row, tokens in enumerate(beams):
                seen[row, tokens] = True
        log_probs = sampler.process(torch.log_softmax(logits.float(), dim=-1), settings, seen)  # [K, V]
        total = (log_probs + scores[:, None]).view(-1)  # [K * V]
        top_scores, top_index = torch.topk(total, 2 * K)
        new_len, last_step = step + 1, step == max_new_tokens - 1
        live = []  # (score, parent beam, token)
        for rank, (s, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            parent, token = divmod(index, V)
            if token in eos_ids(eos_token_id) or last_step:
                if rank < K:
                    done_score = float(top_scores[rank] / new_len**length_penalty)
                    finished.append((done_score, beams[parent] + [token]))
            elif len(live) < K:
                live.append((s, parent, token))
        finished = sorted(finished, key=lambda f: -f[0])[:K]
        if last_step or not live:
            break
        best_possible = live[0][0] / new_len**length_penalty
        if len(finished) == K and best_possible <= finished[-1][0]:
            break
        parents = torch.tensor([p for _, p, _ in live], device=device)
        cache.reorder(parents)
        beams = [beams[p] + [t] for _, p, t in live]
        scores = torch.tensor([s for s, _, _ in live], device=device)
        tokens = torch.tensor([[t] for _, _, t in live], device=device)
        logits = model(tokens, cache=cache)[:, -1]
    return finished[0][1]
