"""Serving many requests at once: continuous batching over a paged KV cache (the scheduling policy of vLLM's
V1 engine, in nano-vllm's split of modules).

Requests arrive and leave at any step. Each `step` runs one forward pass over the decode token of
every running request plus prefill chunks of waiting ones (up to `max_num_batched_tokens`); keys and
values live in fixed-size blocks of one preallocated pool (`paged_cache`), requests with a common
prefix share its blocks (`block_manager`), and when the pool runs out the newest request is evicted
and recomputed later (`scheduler`). Every request gets exactly the tokens `llmcourse.generate` gives
it alone, with the same settings and seed.

    >>> engine = LLMEngine(model, max_num_seqs=8)                                # doctest: +SKIP
    >>> engine.generate([tok.encode("ROMEO:"), tok.encode("JULIET:")], max_new_tokens=20)   # doctest: +SKIP
    >>> rid = engine.add_request(tok.encode("HAMLET:"), temperature=0.8, seed=3)  # doctest: +SKIP
    >>> while engine.has_unfinished(): engine.step()  # -> [(request id, new token, finished), ...]  # doctest: +SKIP
    >>> engine.abort(rid)   # a client went away: its blocks return to the pool at once     # doctest: +SKIP
    >>> choices = engine.new_choices(tok.encode("ROMEO:"), 4, temperature=0.8, seed=3)  # seeds 3-6  # doctest: +SKIP
    >>> ids = [engine.add(c, after=choices[0] if i else None) for i, c in enumerate(choices)]  # doctest: +SKIP

n choices of one prompt (OpenAI's `n`) are n requests that share the prompt's KV blocks through the prefix cache:
`new_choices` makes them, choice i seeded `seed + i` as vLLM seeds a request's n samples (its V1 engine's
`ParentRequest._get_child_sampling_params`, vllm/v1/engine/parallel_sampling.py: each child a copy of the
parameters with `seed + index`), so choice i equals a request of its own with seed `seed + i`, token for token.
`add(choice, after=first)` holds choices 1 … n-1 until the first has computed its prompt, whose full blocks are
then in the prefix cache: each of the others shares them (a reference more on each block, no copy, no
recomputation) and computes only the prompt's last, partial block itself (at least its last token: its logits are
needed). That block is recomputed, not copied: a block holds whole positions, the partial one gets different
tokens in each choice once they generate, and recomputing at most `block_size` tokens per choice is one small
prefill chunk in a step that decodes anyway; copying would need a copy-on-write block kind the cache has no other
use for, and this keeps every block either full and immutable (shared) or private. `max_choices` bounds n.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from llmcourse.engine import threads
from llmcourse.engine.decoder import Decoder
from llmcourse.engine.generate import as_model, check_request, new_generator, new_guides
from llmcourse.engine.model import GPT2
from llmcourse.engine.roofline import max_sequences
from llmcourse.engine.sampling import Sampler, SamplingParams, eos_ids, token_counts
from llmcourse.engine.slots import PartError
from llmcourse.engine.structured.constraint import mask_rows_
from llmcourse.engine.tokenizer import get_tokenizer

from . import paged_cache
from .batching import Batching
from .block_manager import BlockManager, blocks_for
from .decode_graphs import DecodeGraphs
from .scheduler import Request, Scheduler

# generation's settings without beam search, which the engine does not do
SETTINGS = (
    "max_new_tokens",
    "eos_token_id",
    "seed",
    "stop",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop_token_ids",
)
MAX_NUM_SEQS = 32  # requests running at once, by default (`serve --max-num-seqs` too)
MAX_CHOICES = 128  # choices (OpenAI's n) per prompt at most, as OpenAI allows; also at most max_num_seqs
DEFAULT_CONTEXT = 4096  # the default pool holds one request this long (a 128k-context model would need GBs)


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability and the likeliest tokens' (token id, log-probability), best first."""

    logprob: float
    top: list[tuple[int, float]]


def record_logprobs(requests: list[Request], logits: torch.Tensor, tokens: list[int]) -> None:
    """Append to each request that asked for them (`num_logprobs` not None) its new token's log-probability
    under the model (log-softmax of the raw logits [R, V]) and its `num_logprobs` likeliest tokens'."""
    rows = [i for i, r in enumerate(requests) if r.num_logprobs is not None]
    if not rows:
        return
    logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [len(rows), V]
    k = max(requests[i].num_logprobs for i in rows)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    picked = torch.tensor([tokens[i] for i in rows], device=logp.device)
    chosen = logp.gather(1, picked[:, None])[:, 0].tolist()
    for j, i in enumerate(rows):
        n = requests[i].num_logprobs
        top = list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist()))
        requests[i].logprobs.append(TokenLogprobs(chosen[j], top))


class LLMEngine:
    """Continuous batching over a paged KV cache for `model` (`load_model(...)`: GPT-2 or the Llama family).

    block_size: positions per block. num_blocks: blocks in the pool (None: room for `max_num_seqs`
    requests of 256 tokens, and at least one of the model's longest, up to 4096). kv_cache_memory: bytes for the pool
    instead (as vLLM sizes it from the memory left next to the weights): as many blocks as fit, counted by
    chapter 06's `max_sequences` with a block as a sequence of `block_size` positions. max_num_seqs: requests running at
    once. max_num_batched_tokens: tokens computed per step (decodes plus prefill chunks); a longer
    prompt is prefilled in chunks over several steps. prefix_caching: share the blocks of common
    prefixes. partition_size: positions of context a decode step attends to as one partition (rounded down to
    whole blocks; longer contexts are split and the partitions merged). tokenizer: decodes text for `stop`
    strings (default: GPT-2's, for a GPT-2 model; other models need theirs). sampler, batching: the functions
    that choose tokens (`Sampler`) and run the paged batches (`Batching`), the engine's own by default.
    compile: run the steps that only decode as compiled graphs of fixed shapes, on a GPU one CUDA graph per
    batch-size bucket (`decode_graphs`; each bucket compiles at its first step); the engine's own paged attention
    and batching functions only.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        kv_cache_memory: Optional[int] = None,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int = 512,
        prefix_caching: bool = True,
        partition_size: int = 256,
        tokenizer=None,
        sampler: Optional[Sampler] = None,
        batching: Optional[Batching] = None,
        compile: bool = False,
    ):
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("num_blocks", num_blocks),
            ("kv_cache_memory", kv_cache_memory),
            ("partition_size", partition_size),
        ):
            if not (value is None and name in ("num_blocks", "kv_cache_memory")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        model, engines = as_model(model)  # my_engine()'s engine serves its model, with its functions
        threads.choose()
        cfg = model.config
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_blocks or kv_cache_memory, not both: kv_cache_memory sets num_blocks")
        if kv_cache_memory is not None:  # a block is a "sequence" of block_size positions (chapter 06's count)
            element = torch.empty((), dtype=model.dtype).element_size()
            num_blocks = max_sequences(
                kv_cache_memory, 0, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, block_size, element
            )
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory={kv_cache_memory} bytes hold no block of {block_size} positions (a block's keys "
                    f"and values take {2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * block_size * element} "
                    "bytes); give more memory or a smaller block_size"
                )
        if num_blocks is None:  # room for max_num_seqs requests of 256 positions, or one of the whole context
            num_blocks = max(
                max_num_seqs * blocks_for(min(256, cfg.n_positions), block_size),
                blocks_for(min(DEFAULT_CONTEXT, cfg.n_positions), block_size),
            )
        self.model, self.tokenizer, self.partition_size = model, tokenizer, partition_size
        self.sampler = sampler or engines.get("sampler") or Sampler()
        self.batching = batching or engines.get("batching") or Batching()
        if compile and self.batching.overridden():
            raise ValueError(
                "compile=True runs the engine's own paged attention and batching functions; a learner's "
                f"({', '.join(self.batching.overridden())}) run uncompiled: leave out compile=True"
            )
        spare = 1 if compile else 0  # compiled decode steps pad the batch: its padding rows write to a spare block
        self.cache = paged_cache.PagedKVCache(
            cfg, num_blocks + spare, block_size, device=model.device, dtype=model.dtype
        )
        self.graphs = None
        if compile:
            width = blocks_for(min(cfg.n_positions, num_blocks * block_size), block_size)  # a table's most blocks
            self.graphs = DecodeGraphs(model, self.cache, max_num_seqs, width)
        self.blocks = BlockManager(
            num_blocks,
            block_size,
            prefix_caching=prefix_caching,
            allocator_class=self.batching.BlockAllocator,
            hash_blocks=self.batching.block_hashes,
        )
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=self.batching.schedule,
        )
        self.requests: dict[int, Request] = {}  # by id, until `release`d
        self.held: dict[int, list[Request]] = {}  # first choice's id -> the other choices, until its prompt is in
        self.next_id = 0
        self.num_steps = 0
        self.steps_without_token = 0
        self.last_step: list[tuple[int, int]] = []  # (request id, tokens computed) in the latest step
        self.num_computed_tokens = 0  # prompt and generated tokens run through the model (recomputation included)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: Optional[SamplingParams] = None,
        *,
        logprobs=None,
        constraint=None,
        **settings,
    ) -> int:
        """Queue a request; it joins the next step. -> its id. Takes `generate`'s settings, as a `SamplingParams`
        or keywords (`stop` strings end the request with the token that completes one; no beam search). A request
        that can never run is refused with a ValueError, and the engine goes on with the others.
        logprobs: None, or k >= 0 to record each new token's log-probability and the k likeliest tokens'
        (`Request.logprobs`; of the model's own distribution, before temperature and the other settings).
        constraint: a compiled `structured.Constraint` the request's text follows (`Request.guide` walks it; the
        request ends where it says, `Request.guide.ended`; else at max_new_tokens)."""
        return self.add(self.new_request(prompt_ids, params, logprobs=logprobs, constraint=constraint, **settings))

    def add(self, request: Request, after: Optional[Request] = None) -> int:
        """Queue a request made by `new_request` or `new_choices`. -> its id. after: the first choice of the same
        prompt, already added: with prefix caching this request waits until that one has computed its prompt, then
        shares its full blocks (the module's docstring)."""
        request.id, self.next_id = self.next_id, self.next_id + 1
        self.requests[request.id] = request
        first = after is not None and self.requests.get(after.id) is after and not after.finished
        if first and self.blocks.prefix_caching and self.shared_blocks(request.prompt):
            self.held.setdefault(after.id, []).append(request)
        else:
            self.scheduler.add(request)
        return request.id

    def shared_blocks(self, prompt: Sequence[int]) -> int:
        """How many blocks of a prompt the choices after the first take from the prefix cache: its full blocks but
        the one holding its last token (which each choice computes)."""
        return (len(prompt) - 1) // self.blocks.block_size

    def release_held(self) -> None:
        """Queue the choices held for a first choice that has computed its prompt (or has ended)."""
        for first_id in list(self.held):
            first = self.requests.get(first_id)
            if first is None or first.finished or first.num_computed >= len(first.prompt):
                for request in self.held.pop(first_id):
                    self.scheduler.add(request)

    def max_choices(self, prompt_len: int, max_new_tokens: int) -> int:
        """The most choices of one prompt this engine takes (OpenAI's n): MAX_CHOICES, at most `max_num_seqs` (the
        choices decode in one batch), and as many as fit in the pool at once (the prompt's shared blocks once,
        each choice's own blocks for its last prompt block and its tokens)."""
        bs = self.blocks.block_size
        shared = (prompt_len - 1) // bs if self.blocks.prefix_caching else 0
        own = blocks_for(prompt_len + max_new_tokens, bs) - shared
        return max(1, min(MAX_CHOICES, self.scheduler.max_num_seqs, (self.blocks.num_blocks - shared) // own))

    def new_choices(
        self,
        prompt_ids: Sequence[int],
        n: int,
        params: Optional[SamplingParams] = None,
        *,
        logprobs=None,
        constraint=None,
        **settings,
    ) -> list[Request]:
        """n checked requests for one prompt (OpenAI's n), not queued yet: choice i has seed `seed + i` (vLLM's
        rule), the other settings alike. Add the first, then the others with `after=` the first (`add`). Refuses
        n beyond `max_choices` with a ValueError."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1 (the number of choices), got {n!r}")
        first = self.new_request(prompt_ids, params, logprobs=logprobs, constraint=constraint, **settings)
        most = self.max_choices(len(first.prompt), first.max_new_tokens)
        if n > most:
            raise ValueError(
                f"n must be at most {most} here (got {n}): at most {MAX_CHOICES}, at most max_num_seqs="
                f"{self.scheduler.max_num_seqs} (the choices decode together), and as many as the KV pool holds at "
                f"once ({self.blocks.num_blocks} blocks of {self.blocks.block_size} positions) with this prompt and "
                "max_tokens; ask for fewer choices or fewer tokens"
            )
        seed = first.settings.seed
        return [first] + [
            self.new_request(first.prompt, first.settings, logprobs=logprobs, constraint=constraint, seed=seed + i)
            for i in range(1, n)
        ]

    def new_request(
        self,
        prompt_ids: Sequence[int],
        params: Optional[SamplingParams] = None,
        *,
        logprobs=None,
        constraint=None,
        **settings,
    ) -> Request:
        """A checked request, not queued yet (`add` queues it and gives it its id); takes `add_request`'s
        arguments and raises its ValueErrors, and changes nothing in the engine."""
        settings = SamplingParams.of(params, allowed=SETTINGS, **settings).for_model(self.model)
        if settings.num_beams != 1:
            raise ValueError(f"LLMEngine does not do beam search: num_beams must be 1, got {settings.num_beams}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0 (alternatives per token), got {logprobs!r}")
        max_new_tokens, eos_token_id, stop = settings.max_new_tokens, settings.eos_token_id, settings.stop
        prompt = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        check_request(self.model, [prompt], max_new_tokens, eos_token_id)
        need, bs = blocks_for(len(prompt) + max_new_tokens, self.blocks.block_size), self.blocks.block_size
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"a request of {len(prompt)} prompt tokens and max_new_tokens={max_new_tokens} needs "
                f"{need} blocks of {bs} positions, but the pool has num_blocks={self.blocks.num_blocks}; "
                "lower max_new_tokens or make the pool bigger"
            )
        if stop and self.tokenizer is None:
            if not isinstance(self.model, GPT2):
                raise ValueError("stop strings need the model's tokenizer: LLMEngine(model, tokenizer=...)")
            self.tokenizer = get_tokenizer()
        generator = None if settings.greedy else new_generator(self.model, settings.seed)
        guides = new_guides(constraint, 1, settings)
        return Request(
            -1,
            prompt,
            settings,
            max_new_tokens,
            eos_token_id,
            stop,
            generator,
            num_logprobs=logprobs,
            guide=guides[0] if guides else None,
        )

    def abort(self, request_id: int) -> None:
        """End a request now, wherever it is (waiting, mid-prompt, decoding): its blocks return to the pool at once
        (blocks a finished prefix shares with others stay cached). Ending an unknown or finished request does
        nothing."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        for held in self.held.values():
            if request in held:  # a choice still waiting for its first: it holds no block
                held.remove(request)
                request.finished = True
                return
        self.scheduler.abort(request)

    def release(self, request_id: int) -> Optional[Request]:
        """Forget a request (a server serving for days must not keep every request it served): abort it if it
        runs, and drop it from `requests`. -> the request, or None if unknown."""
        self.abort(request_id)
        return self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or any(self.held.values()))

    @torch.inference_mode()
    def step(self) -> list[tuple[int, int, bool]]:
        """Run one step. -> (request id, new token, finished) for each request that got a token."""
        self.release_held()
        if not self.has_unfinished():
            return []
        try:
            batch = self.scheduler.next_step()
        except MemoryError as err:
            raise PartError(
                f"the scheduler gave out more blocks than were free ({err}); "
                "hint: run the checks for 'schedule' and 'BlockAllocator' in chapter 07"
            ) from err
        if not batch:  # a learner's policy may preempt without running anything
            self.steps_without_token += 1
            self.check_progress()
            return []
        chunks = [
            paged_cache.Chunk(r.tokens[r.num_computed : r.num_computed + n], r.num_computed, r.block_table)
            for r, n in batch
        ]
        rows = [row for row, (r, n) in enumerate(batch) if r.num_computed + n == len(r.tokens)]  # not mid-prompt
        if self.graphs is not None and all(len(c.tokens) == 1 for c in chunks):  # decodes only: fixed shapes
            logits = self.graphs.run(chunks)  # [len(chunks), V]: every row ends its request's known tokens
        else:
            logits = paged_cache.forward(
                self.model,
                self.cache,
                chunks,
                rows,
                attend=self.batching.paged_attention,
                merge=self.batching.merge_attention,
                partition_size=self.partition_size,
            )  # [len(rows), V]
        self.num_steps += 1
        self.last_step = [(r.id, n) for r, n in batch]
        for request, n in batch:
            request.num_computed += n
            self.num_computed_tokens += n
            self.blocks.remember_full_blocks(request)
        self.steps_without_token = 0 if rows else self.steps_without_token + 1
        self.check_progress()
        out = []
        requests = [batch[row][0] for row in rows]
        tokens = self.next_tokens(requests, logits)
        record_logprobs(requests, logits, tokens)
        for request, token in zip(requests, tokens):
            request.tokens.append(token)
            if request.guide is not None:
                request.guide.advance(token)
            done = self.is_done(request, token)
            if done:
                self.scheduler.finish(request)
            out.append((request.id, token, done))
        return out

    def check_progress(self) -> None:
        """Never hang: the oldest request gets a token within as many steps as it has tokens (it runs first, with
        at least one token of budget), so far more steps without any token means a policy that makes no progress."""
        if self.steps_without_token <= 8:  # the usual case, decided without walking the queues
            return
        pending = self.scheduler.running + list(self.scheduler.waiting)
        if self.steps_without_token > 2 * sum(len(r.tokens) for r in pending) + 8:
            raise PartError(
                f"part 'schedule' makes no progress: {self.steps_without_token} steps without a new "
                f"token ({self.scheduler.num_preempted} preemptions so far)\n"
                "  hint: run the check for 'schedule' in chapter 07 to debug it"
            )

    def next_tokens(self, requests: list[Request], logits: torch.Tensor) -> list[int]:
        """The next token of each request, logits [R, V]. Requests with the same greedy settings are decided in
        one call (an argmax per row, as alone); a sampling request draws from its own generator."""
        tokens: dict[int, int] = {}
        groups: dict[object, list[int]] = {}
        guides = [r.guide for r in requests]
        if any(g is not None for g in guides):  # a constrained request's disallowed tokens at -inf
            logprobs = any(r.num_logprobs is not None for r in requests)  # they read the model's own logits after
            logits = mask_rows_(logits.clone() if logprobs else logits, guides)
        for i, r in enumerate(requests):
            groups.setdefault(r.settings.processors if r.settings.greedy else i, []).append(i)
        for rows in groups.values():
            settings, seen, counts = requests[rows[0]].settings, None, None
            if settings.repetition_penalty != 1.0:
                seen = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
                for k, i in enumerate(rows):
                    seen[k, torch.tensor(requests[i].tokens, device=logits.device)] = True
            if settings.counts_generated:  # [len(rows), V]
                counts = token_counts([requests[i].generated for i in rows], logits.shape[-1], logits.device)
            scores = logits if len(rows) == len(requests) else logits[rows]  # [len(rows), V]
            chosen = self.sampler.next_token(scores, settings, seen, requests[rows[0]].generator, counts)
            tokens.update(zip(rows, chosen.tolist()))
        return [tokens[i] for i in range(len(requests))]

    def is_done(self, request: Request, token: int) -> bool:
        ended = request.guide.ended if request.guide is not None else token in eos_ids(request.eos_token_id)
        if ended or len(request.generated) == request.max_new_tokens:
            return True
        if request.stop:
            text = self.tokenizer.decode(request.generated)
            return any(s in text for s in request.stop)
        return False

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        arrivals: Optional[Sequence[int]] = None,
        settings: Optional[Sequence[dict]] = None,
        **common,
    ) -> list[list[int]]:
        """New token ids for each prompt, in the order given. `arrivals[i]`: the step at which prompt i arrives
        (default: all at step 0). `settings[i]`: prompt i's own settings (a dict, over the `common` ones).
        Every request is checked before any runs."""
        n = len(prompts)
        arrivals = [0] * n if arrivals is None else list(arrivals)
        settings = [{}] * n if settings is None else list(settings)
        if len(arrivals) != n or any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in arrivals):
            raise ValueError(f"arrivals must hold one step number >= 0 per prompt ({n}), got {arrivals!r}")
        if len(settings) != n or any(not isinstance(s, dict) for s in settings):
            raise ValueError(f"settings must hold one dict per prompt ({n}), got {settings!r}")
        requests = []
        for i, (p, s) in enumerate(zip(prompts, settings)):
            try:
                requests.append(self.new_request(p, **{**common, **s}))
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        order = sorted(range(n), key=lambda i: arrivals[i])
        step = 0
        while order or self.has_unfinished():
            while order and arrivals[order[0]] <= step:
                self.add(requests[order.pop(0)])
            self.step()
            step += 1
        return [r.generated for r in requests]

    @property
    def stats(self) -> dict:
        """Counters so far: steps, preemptions, prompt tokens served from the prefix cache, tokens computed."""
        return {
            "steps": self.num_steps,
            "preemptions": self.scheduler.num_preempted,
            "cached_tokens": self.blocks.cache_hits,
            "computed_tokens": self.num_computed_tokens,
        }
