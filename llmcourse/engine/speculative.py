"""Speculative decoding: a cheap draft proposes k tokens, the target checks them all in one forward pass.

Decode is memory-bound: each step reads every weight of the target for one token. A round here
reads them once for up to k + 1 tokens:

1. the draft proposes k tokens (a small model with its own KV cache, or prompt lookup: the tokens
   that followed the last few tokens where they appeared earlier in the text);
2. the target runs once over the last token and the k proposals: its next-token distribution p at
   each of the k + 1 positions;
3. `verify` keeps proposals while the acceptance rule says so, then picks one more token (the
   correction at the first rejection, or a bonus token when all k are kept), so a round yields
   1 to k + 1 tokens;
4. both KV caches are rolled back past the first rejected proposal (`cache.length = ...`).

The acceptance rule (`accept_token`): a proposal x drawn from the draft's distribution q is kept
with probability min(1, p(x) / q(x)); otherwise the token is drawn from the residual
max(0, p − q), normalised. The result is distributed exactly as p, whatever q is, so speculative
sampling samples from the target. p and q are the *processed* distributions (repetition penalty,
temperature, top-k, top-p, min-p). Greedy decoding is the special case where p and q are one-hot
on their argmax: a proposal is kept iff it is the target's argmax, which makes the output plain
greedy decoding's, token for token.

    >>> p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    >>> accept_token(p, q, 2)   # p(2) = 0: rejected, drawn from max(0, p - q) = [0.5, 0, 0] normalised
    (False, 0)
    >>> round(expected_speedup(alpha=0.6, k=4, c=0.1), 2)
    1.65
    >>> best_k(alpha=0.6, c=0.1, max_k=8)   # the k with the largest expected speed-up
    3

`num_draft_tokens="auto"` picks k as it goes (`speculative_steps`): it proposes AUTO_FIRST_K tokens per
round at first; every AUTO_ROUNDS rounds it estimates α from the proposals judged so far and takes
k = best_k(α, c, AUTO_MAX_K), with c from the two models' sizes (`draft_cost`), not from timing: sampled
tokens depend on k (a round draws as many random numbers as it proposes), so a k chosen from timings
would make a seeded run unrepeatable, while α and the sizes make the same k on every run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .decoder import Decoder
from .loading import load_model
from .roofline import ModelShape
from .sampling import Sampler, SamplingParams, eos_ids, token_counts
from .slots import Slots

PROMPT_LOOKUP = "prompt-lookup"
AUTO = "auto"  # num_draft_tokens="auto": k chosen by best_k from the measured acceptance rate
AUTO_FIRST_K = 4  # proposals per round before the first estimate of α
AUTO_ROUNDS = 3  # rounds between two choices of k
AUTO_MAX_K = 8  # the most proposals per round "auto" chooses


def accept_token(
    p: Tensor, q: Tensor, draft_token: int, generator: Optional[torch.Generator] = None
) -> tuple[bool, int]:
    """The acceptance rule at one position: p, q [V] the target's and the draft's probabilities,
    `draft_token` drawn from q. -> (True, draft_token) with probability min(1, p/q), else (False, a token
    drawn from max(0, p - q) normalised)."""
    u = torch.rand((), generator=generator, device=p.device)
    if u * q[draft_token] < p[draft_token]:  # u < p/q without dividing: q(x) > 0 for a token drawn from q
        return True, draft_token
    residual = (p - q).clamp(min=0)  # [V]
    if residual.sum() <= 0:  # p == q up to rounding: a rejection is then (nearly) impossible; p is the answer
        residual = p
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def verify(
    p: Tensor,
    q: Tensor,
    draft_tokens: list[int],
    generator: Optional[torch.Generator] = None,
    *,
    accept_token: Callable = accept_token,
) -> tuple[int, int]:
    """Check k proposals: p [k+1, V] the target's probabilities after each prefix, q [k, V] the draft's,
    `draft_tokens` the k proposals. -> (how many are accepted, the token that comes after them): the
    residual's token at the first rejection, or a bonus token drawn from p[k] when all k are kept.

        >>> one_hot = lambda ids: F.one_hot(torch.tensor(ids), 4).float()
        >>> verify(one_hot([1, 2, 3]), one_hot([1, 0]), [1, 0])   # greedy: kept while equal to the argmax
        (1, 2)
    """
    for i, token in enumerate(draft_tokens):
        accepted, token = accept_token(p[i], q[i], token, generator)
        if not accepted:
            return i, token
    return len(draft_tokens), int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))


VERIFY = verify  # the engine's own


def prompt_lookup_draft(tokens: list[int], num_draft_tokens: int, max_ngram: int = 3) -> list[int]:
    """Propose the tokens that followed the latest earlier occurrence of the text's last n tokens
    (n = max_ngram, then shorter down to 1), at most `num_draft_tokens`; [] if the tail never occurred.

        >>> prompt_lookup_draft([1, 2, 3, 4, 9, 2, 3], num_draft_tokens=2)   # "2 3" occurred before, then "4 9"
        [4, 9]
    """
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; it ends before the tail itself
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_draft_tokens]
    return []


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens a round yields on average when each proposal is accepted with probability alpha:
    1 + alpha + ... + alpha^k."""
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Speed-up over plain decoding: tokens per round over the round's cost in target forwards,
    (1 − α^(k+1)) / ((1 − α)(k·c + 1)), c = the draft's cost per token / the target's."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1)


def best_k(alpha: float, c: float, max_k: int) -> int:
    """The k in 1..max_k with the largest `expected_speedup(alpha, k, c)`, the smallest such k on a tie. At
    α = 0 that is k = 1 (each proposal only costs); whether to speculate at all is the caller's choice.

        >>> best_k(0.9, 0.02, 8), best_k(0.57, 0.26, 8), best_k(0.0, 0.1, 8), best_k(1.0, 1.0, 8)
        (8, 2, 1, 1)
    """
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, c))  # max keeps the first best


def draft_cost(target, draft) -> float:
    """c for `best_k`: the multiply-adds per token of the draft's matrix products over the target's (for GPT-2
    12·n_layer·n_embd² + vocab·n_embd: the blocks, the output head; `roofline.ModelShape` counts any family's).
    A decode step at small batch reads each weight once and multiplies it once (chapter 06), so this is the ratio
    of the step times whether the step is memory-bound or compute-bound, up to fixed overheads; 0 for prompt
    lookup.

        >>> from llmcourse.engine.model import GPT2, GPT2Config
        >>> round(draft_cost(GPT2(GPT2Config(6, 6, 192)), GPT2(GPT2Config(2, 2, 64))), 3)
        0.269
    """
    if draft == PROMPT_LOOKUP:
        return 0.0

    def per_token(cfg) -> int:
        return ModelShape.of(cfg).multiply_adds()

    return per_token(draft.config) / per_token(target.config)


@torch.inference_mode()
def speculative_round(target, draft, target_cache, draft_cache, tokens: list[int], num_draft_tokens: int) -> list[int]:
    """One greedy draft-verify round. `tokens` is the text so far (prompt and generated); `target_cache`
    holds all of it but the last token, `draft_cache` a prefix of it. The draft proposes
    `num_draft_tokens` tokens, the target scores them in one forward pass, both caches are rolled back to
    the tokens kept. -> the new tokens: the accepted proposals and the target's next token."""
    return draft_verify(
        target, DraftModel(draft, draft_cache), target_cache, tokens, num_draft_tokens, Distributions(SamplingParams())
    )[0]


@dataclasses.dataclass
class Round:
    """What one round did: the draft's proposals, how many the target accepted, the token it added."""

    drafted: list[int]
    accepted: int
    token: int


@dataclasses.dataclass
class Choice:
    """A choice of k by num_draft_tokens="auto": after `round` rounds of a prompt, from the estimated α and c."""

    round: int
    alpha: float
    c: float
    k: int


@dataclasses.dataclass
class SpeculationStats:
    """Filled in by `generate(..., draft=..., stats=SpeculationStats())`: every round, and the time.

    >>> stats = SpeculationStats(rounds=[Round([5, 6], 1, 7), Round([8, 9], 2, 3)], new_tokens=5)
    >>> stats.acceptance_rate, stats.tokens_per_forward
    (0.75, 2.5)
    """

    rounds: list[Round] = dataclasses.field(default_factory=list)
    new_tokens: int = 0  # tokens returned (the last round may be cut by EOS or max_new_tokens)
    seconds: float = 0.0
    choices: list[Choice] = dataclasses.field(default_factory=list)  # num_draft_tokens="auto": each choice of k

    @property
    def drafted(self) -> int:
        return sum(len(r.drafted) for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals / proposals."""
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per forward pass of the target (plain decoding: 1)."""
        return self.new_tokens / max(len(self.rounds), 1)

    def acceptance_by_position(self) -> list[float]:
        """For i = 1, 2, ...: of the rounds that proposed an i-th token, the fraction that accepted it."""
        longest = max((len(r.drafted) for r in self.rounds), default=0)
        return [
            sum(r.accepted >= i for r in self.rounds) / max(sum(len(r.drafted) >= i for r in self.rounds), 1)
            for i in range(1, longest + 1)
        ]

    def summary(self) -> str:
        chosen = ""
        if self.choices:
            last = self.choices[-1]
            chosen = f"; num_draft_tokens='auto' chose k = {last.k} (α = {last.alpha:.2f}, c = {last.c:.2f})"
        return (
            f"speculative decoding: {self.new_tokens} tokens in {len(self.rounds)} target forward passes "
            f"({self.tokens_per_forward:.2f} per pass), {self.accepted} of {self.drafted} proposals accepted "
            f"({self.acceptance_rate:.0%}), {self.seconds:.2f} s{chosen}"
        )


class Distributions:
    """The processed next-token distributions generation samples from, [n, V] for logits [n, V]: the
    sampler's processors (the engine's own by default), then softmax, or one-hot on the argmax when greedy."""

    def __init__(
        self, settings: SamplingParams, seen: Optional[Tensor] = None, sampler: Optional[Sampler] = None, guide=None
    ):
        self.settings, self.sampler = settings, sampler or Sampler()
        self.seen = seen  # [V] bool, the tokens of the text so far (repetition penalty), or None
        self.generated: list[int] = []  # the tokens generated so far (presence and frequency penalties)
        self.guide = guide  # a structured.Guide: its disallowed tokens are masked before the processors, or None

    def __call__(self, logits: Tensor, new_tokens: list[int], first: int = 0) -> Tensor:
        """logits [n, V], row i after the text and new_tokens[:first + i]."""
        scores = self.scores(logits, new_tokens, first)
        if self.settings.greedy:
            return F.one_hot(self.sampler.greedy(scores), logits.shape[-1]).float()
        return torch.softmax(scores, dim=-1)

    def scores(self, logits: Tensor, new_tokens: list[int], first: int = 0) -> Tensor:
        """The processed logits [n, V] (see `__call__`)."""
        seen = None
        if self.seen is not None:
            seen = self.seen.expand(len(logits), -1).clone()  # [n, V]
            for i, token in enumerate(new_tokens):
                seen[max(i + 1 - first, 0) :, token] = True
        counts = None
        if self.settings.counts_generated:  # [n, V], row i counting new_tokens[:first + i] too
            counts = token_counts([self.generated], logits.shape[-1], logits.device).expand(len(logits), -1).clone()
            for i, token in enumerate(new_tokens):
                counts[max(i + 1 - first, 0) :, token] += 1
        if self.guide is not None:  # row i: the tokens the constraint allows after new_tokens[:first + i]
            allowed = self.guide.allowed_along(new_tokens, len(logits), first, logits.shape[-1], logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        return self.sampler.process(logits.float(), self.settings, seen, counts)

    def pick(self, probs: Tensor, generator: Optional[torch.Generator]) -> int:
        """A token drawn from probs [V] (the argmax of a one-hot)."""
        return int(probs.argmax()) if self.settings.greedy else int(torch.multinomial(probs, 1, generator=generator))

    def add(self, tokens: list[int]) -> None:
        if self.seen is not None:
            self.seen[tokens] = True
        self.generated += tokens


class DraftModel:
    """Proposals from a smaller model with its own KV cache (which holds a prefix of the text)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def propose(
        self, tokens: list[int], k: int, dist: Distributions, generator, need_q: bool = True
    ) -> tuple[list[int], Optional[Tensor]]:
        """k tokens drawn one by one from the draft's processed distribution q; -> (tokens, q [k, V], or None
        when not `need_q`: greedy proposals are argmaxes, and the engine's greedy verify compares ids)."""
        device = self.model.device
        ids = torch.tensor([tokens[self.cache.length :]], device=device)  # [1, n >= 1]: not cached yet
        drafted, probs = [], []
        for _ in range(k):
            logits = self.model(ids, cache=self.cache, last_only=True)[0]  # [1, V]
            if need_q:
                probs.append(dist(logits, drafted, first=len(drafted))[0])  # [V]
                drafted.append(dist.pick(probs[-1], generator))
            else:
                drafted.append(int(dist.sampler.greedy(dist.scores(logits, drafted, first=len(drafted)))[0]))
            ids = torch.tensor([[drafted[-1]]], device=device)
        # The last proposal is not fed: the next round feeds it if it is kept.
        if not need_q:
            return drafted, None
        return drafted, torch.stack(probs) if probs else torch.empty(0, self.model.config.vocab_size, device=device)

    def rollback(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)


class PromptLookup:
    """Proposals copied from the text itself (`prompt_lookup_draft`): q is one-hot on each proposal."""

    def __init__(self, lookup: Callable = prompt_lookup_draft, vocab_size: int = 0, device=None):
        self.lookup, self.vocab_size, self.device = lookup, vocab_size, device

    def propose(
        self, tokens: list[int], k: int, dist: Distributions, generator, need_q: bool = True
    ) -> tuple[list[int], Optional[Tensor]]:
        drafted = list(self.lookup(tokens, k)) if k else []
        if not need_q:
            return drafted, None
        return drafted, F.one_hot(torch.tensor(drafted, dtype=torch.long, device=self.device), self.vocab_size).float()

    def rollback(self, length: int) -> None:
        pass


@torch.inference_mode()
def draft_verify(
    target,
    proposer,
    target_cache,
    tokens: list[int],
    k: int,
    dist: Distributions,
    generator: Optional[torch.Generator] = None,
    verify: Callable = verify,
) -> tuple[list[int], list[int]]:
    """One round for any proposer and settings; -> (new tokens, the proposals). See the module's docstring."""
    compare_ids = dist.settings.greedy and verify is VERIFY  # what `verify` does with one-hot p and q, without draws
    drafted, q = proposer.propose(tokens, k, dist, generator, need_q=not compare_ids)  # q [k, V]
    fed = torch.tensor([[tokens[-1], *drafted]], device=target.device)  # [1, k+1]
    logits = target(fed, cache=target_cache)[0]  # [k+1, V]
    if compare_ids:
        best = dist.sampler.greedy(dist.scores(logits, drafted)).tolist()  # [k+1]
        accepted = next((i for i, (x, y) in enumerate(zip(drafted, best)) if x != y), len(drafted))
        token = best[accepted]
    else:
        accepted, token = verify(dist(logits, drafted), q, drafted, generator)  # p [k+1, V]
    target_cache.length = len(tokens) + accepted  # keeps the text, the accepted proposals; `token` is fed next
    proposer.rollback(len(tokens) + accepted)
    return drafted[:accepted] + [token], drafted


@dataclasses.dataclass(frozen=True)
class Speculation(Slots):
    """The functions speculative decoding calls (chapter 08): `generate(..., draft=..., speculation=...)` takes
    them (`Speculation().replace(verify=my_verify)` swaps some). A replaced
    `speculative_round` is greedy: it runs for greedy decoding with a draft model (without repetition
    penalty); sampling and prompt lookup run the engine's round with the learner's `verify` and `accept_token`.
    `best_k` chooses k when num_draft_tokens="auto"."""

    accept_token: Callable = accept_token
    verify: Callable = verify
    prompt_lookup_draft: Callable = prompt_lookup_draft
    best_k: Callable = best_k
    speculative_round: Callable = speculative_round


def resolve_draft(target, draft) -> Union[str, object]:
    """`draft` as a model on the target's device and dtype (or the string 'prompt-lookup'), checked to
    share the target's vocabulary."""
    if isinstance(draft, str) and draft == PROMPT_LOOKUP:
        return draft
    if isinstance(draft, str) or hasattr(draft, "__fspath__"):
        try:
            draft = load_model(draft, device=target.device).to(target.dtype)  # load_model stops at float32
        except (ValueError, OSError) as err:
            raise ValueError(f"the draft model {str(draft)!r} could not be loaded: {err}") from err
    if not isinstance(draft, Decoder):
        raise ValueError(
            f"draft must be a model (llmcourse.load_model(...)), a model name or folder that load_model takes, or "
            f"'{PROMPT_LOOKUP}', got {type(draft).__name__}"
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.config.vocab_size} tokens but the target's has "
            f"{target.config.vocab_size}: speculative decoding needs a draft with the target's tokenizer "
            f"(e.g. gpt2-shakespeare-draft for gpt2-shakespeare, or draft='{PROMPT_LOOKUP}')"
        )
    if draft.device != target.device:
        raise ValueError(
            f"the draft model is on {draft.device} but the target is on {target.device}: "
            f"move it with draft.to({str(target.device)!r})"
        )
    return draft


def check_speculation(target, draft, batch: list[list[int]], num_draft_tokens, max_new_tokens: int) -> None:
    """Refuse a `num_draft_tokens` or prompt lengths that speculative decoding cannot run."""
    if num_draft_tokens != AUTO and (
        isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens <= 64
    ):
        raise ValueError(
            f"num_draft_tokens must be an integer in [1, 64] (tokens the draft proposes per round) or '{AUTO}' "
            f"(chosen as it goes, from the acceptance rate), got {num_draft_tokens!r}"
        )
    if draft == PROMPT_LOOKUP:
        return
    longest = max(map(len, batch)) + max_new_tokens
    if longest > draft.config.n_positions:
        raise ValueError(
            f"the draft model has only n_positions={draft.config.n_positions}, but the longest prompt plus "
            f"max_new_tokens is {longest} positions: lower max_new_tokens or use a draft with more positions"
        )


@torch.inference_mode()
def speculative_steps(
    target,
    draft,
    prompt: list[int],
    settings: SamplingParams,
    *,
    num_draft_tokens: Union[int, str],
    generator: Optional[torch.Generator],
    stats: Optional[SpeculationStats] = None,
    speculation: Optional["Speculation"] = None,
    sampler: Optional[Sampler] = None,
    kv_cache: Optional[Callable] = None,
    guide=None,
) -> Iterator[int]:
    """The new tokens of one prompt, round by round (`draft`: a model from `resolve_draft`, or 'prompt-lookup'),
    with `speculation`'s functions, `sampler`'s processors and caches (target's and draft's) of class `kv_cache`
    (each the engine's own by default). Ends after `settings.eos_token_id` (included) or `settings.max_new_tokens`,
    exactly where plain decoding ends. `num_draft_tokens="auto"`: k chosen by `speculation.best_k` (the module's
    docstring); greedy output is plain greedy decoding's whatever k is. `guide` (a `structured.Guide`): proposals
    and the target's distributions masked by its constraint, which also says where the text ends."""
    stats = stats if stats is not None else SpeculationStats()
    started = time.perf_counter() - stats.seconds  # a batch's prompts add up
    spec, device = speculation or Speculation(), target.device
    max_new_tokens, stops = settings.max_new_tokens, eos_ids(settings.eos_token_id)
    tokens = list(prompt)
    target_cache = target.new_cache(1, len(prompt) + max_new_tokens, cache_class=kv_cache)
    if len(prompt) > 1:  # the caches hold everything but the last token, which each round feeds
        target(torch.tensor([prompt[:-1]], device=device), cache=target_cache, last_only=True)
    seen = None
    if settings.repetition_penalty != 1.0:
        seen = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=device)
        seen[prompt] = True
    dist = Distributions(settings, seen, sampler, guide)
    if draft == PROMPT_LOOKUP:
        proposer = PromptLookup(spec.prompt_lookup_draft, target.config.vocab_size, device)
    else:
        proposer = DraftModel(draft, draft.new_cache(1, len(prompt) + max_new_tokens, cache_class=kv_cache))
    # The engine's own greedy round is `draft_verify` itself (which also reports the proposals).
    learners_round = (
        "speculative_round" in spec.overridden()
        and isinstance(proposer, DraftModel)
        and settings.greedy
        and seen is None
        and not settings.counts_generated
        and not settings.logit_bias
        and guide is None
    )

    auto = num_draft_tokens == AUTO
    proposing = AUTO_FIRST_K if auto else num_draft_tokens
    c = draft_cost(target, draft) if auto else 0.0
    judged = kept = rounds = 0  # "auto": proposals the target judged (kept, or the first rejected one of a round)

    made = 0
    while made < max_new_tokens:
        k = min(proposing, max_new_tokens - made - 1)  # a round yields up to k + 1: never more than asked
        if learners_round:
            new = spec.speculative_round(target, draft, target_cache, proposer.cache, tokens, k)
            drafted = [None] * k  # a learner's round proposes k; which ones is its own business
        else:
            new, drafted = draft_verify(target, proposer, target_cache, tokens, k, dist, generator, spec.verify)
        stats.rounds.append(Round(drafted, len(new) - 1, new[-1]))
        if auto:  # α estimated as kept / judged: proposals after a round's first rejection are never judged
            rejected = len(new) - 1 < len(drafted)
            rounds, kept, judged = rounds + 1, kept + len(new) - 1, judged + len(new) - 1 + rejected
            if rounds % AUTO_ROUNDS == 0 and judged:
                proposing = int(spec.best_k(kept / judged, c, AUTO_MAX_K))
                stats.choices.append(Choice(rounds, kept / judged, c, proposing))
        dist.add(new)
        tokens += new
        for token in new[: max_new_tokens - made]:
            made += 1
            stats.new_tokens += 1
            stats.seconds = time.perf_counter() - started
            if guide is not None:
                guide.advance(token)
            yield token
            if guide.ended if guide is not None else token in stops:
                return
