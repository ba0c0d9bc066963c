"""From next-token logits to a token: logits processors and the choice of the next token.

The processors run in this order (`Sampler.process`): `logit_bias`, the repetition penalty, the frequency and
presence penalties (vLLM's order for these: the ones that can change a greedy choice, see `Sampler.process`), then
temperature, top-k, top-p and min-p (transformers' semantics and order). Each takes logits [B, V] and returns logits
[B, V] with removed tokens set to -inf, so several compose.

    >>> logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    >>> top_k(logits, 2)
    tensor([[2., 1., -inf, -inf]])
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .slots import Slots

MODEL_EOS = "model"  # eos_token_id's default: the model's own end-of-text id(s), `SamplingParams.for_model`
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range, and vLLM's)
MAX_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 300  # entries of logit_bias


def eos_ids(eos_token_id) -> tuple[int, ...]:
    """The ids generation stops at: an id, a tuple of them, or None (never).

    >>> eos_ids(None), eos_ids(50256), eos_ids((128001, 128009))
    ((), (50256,), (128001, 128009))
    """
    if eos_token_id is None:
        return ()
    return tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Every setting of one generation, validated here and only here (vLLM calls it the same).
    `generate`, `stream`, `generate_text` and `LLMEngine.add_request` take it, or its fields as keywords.

    temperature=0 means greedy (argmax); top_k=0, top_p=1, min_p=0, repetition_penalty=1, presence_penalty=0,
    frequency_penalty=0 and an empty logit_bias switch those processors off. presence_penalty and frequency_penalty
    (in [-2, 2]) are OpenAI's: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty, count[t]
    being how often t was *generated* so far (the prompt does not count, as in vLLM). logit_bias maps token ids to
    a number in [-100, 100] added to their logits (a dict, kept as sorted (id, bias) pairs; at most 300).
    A row ends with `eos_token_id` (an id, a list of ids, None: never, or 'model', the default: the model's own,
    see `for_model`), with any of `stop_token_ids` (vLLM's name: more ids that end it as EOS does) or after
    `max_new_tokens`; `stop` strings end a text (`stream`, `generate_text`, `LLMEngine`). `num_beams` > 1 is beam
    search (greedy, without the presence and frequency penalties or logit_bias).

        >>> SamplingParams(temperature=0.8, top_p=0.95).greedy
        False
        >>> SamplingParams.of(None, top_k=-1)
        Traceback (most recent call last):
        ...
        ValueError: top_k must be an integer >= 0 (0 = off), got -1
        >>> SamplingParams(logit_bias={50256: -100, 13: 2.5}).logit_bias
        ((13, 2.5), (50256, -100))
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 64
    num_beams: int = 1
    length_penalty: float = 1.0
    eos_token_id: Union[int, tuple[int, ...], None, str] = MODEL_EOS
    seed: int = 0
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, by id; a dict is accepted
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not _real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a number > 0 (1 = off, > 1 discourages repeats), "
                f"got {self.repetition_penalty!r}"
            )
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _integer(self.num_beams) or self.num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1 (1 = no beam search), got {self.num_beams!r}")
        if not _real(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.num_beams > 1 and not self.greedy:
            raise ValueError("beam search is deterministic: with num_beams > 1 use temperature=0")
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)):
            object.__setattr__(self, "eos_token_id", eos := tuple(eos))
        if eos != MODEL_EOS and any(not _integer(t) or t < 0 for t in eos_ids(eos)):
            raise ValueError(
                f"eos_token_id must be a token id, a list of them, None (never stop) or 'model' (the model's own), "
                f"got {self.eos_token_id!r}"
            )
        if not _integer(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [-2, 2] (0 = off, > 0 discourages repeats), got {value!r}"
                )
        object.__setattr__(self, "logit_bias", checked_logit_bias(self.logit_bias))
        ids = self.stop_token_ids
        if (
            isinstance(ids, (str, bytes))
            or not isinstance(ids, (list, tuple))
            or any(not _integer(t) or t < 0 for t in ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.num_beams > 1 and (self.presence_penalty or self.frequency_penalty or self.logit_bias):
            raise ValueError(
                "beam search takes no presence_penalty, frequency_penalty or logit_bias: use num_beams=1 "
                "(or repetition_penalty, which beam search applies)"
            )

    @classmethod
    def of(
        cls, params: Optional["SamplingParams"] = None, *, allowed: Optional[Sequence[str]] = None, **settings
    ) -> "SamplingParams":
        """`params` (default: every default) with `settings` over it, refusing names that are not settings
        (or not among `allowed`, where a driver takes only some)."""
        names = [f.name for f in dataclasses.fields(cls)] if allowed is None else list(allowed)
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(names)}")
        return dataclasses.replace(params, **settings) if params is not None else cls(**settings)

    def for_model(self, model) -> "SamplingParams":
        """These settings as `model` runs them: eos_token_id='model' replaced by the model's own end-of-text ids
        (GPT-2's <|endoftext|>; several for Llama 3, from its config), `stop_token_ids` added to the EOS ids (every
        driver then stops at them as at EOS, and the server shows neither in the text, as vLLM's detokenizer leaves
        the token that stopped a request out of it: `update` in vllm/v1/engine/detokenizer.py, unless
        include_stop_str_in_output), and the token ids of `stop_token_ids` and `logit_bias` checked against the
        vocabulary."""
        vocab = model.config.vocab_size
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} holds {bad[0]}, not a token id of this model: ids are in [0, {vocab})")
        eos = self.eos_token_id
        if eos == MODEL_EOS:
            ids = tuple(model.config.eos_token_ids)
            eos = None if not ids else ids[0] if len(ids) == 1 else ids
        if self.stop_token_ids:
            ids = tuple(dict.fromkeys(eos_ids(eos) + self.stop_token_ids))  # EOS first, no id twice
            eos = ids[0] if len(ids) == 1 else ids
        if eos == self.eos_token_id:
            return self
        return dataclasses.replace(self, eos_token_id=eos, stop_token_ids=())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processors(self) -> tuple:
        """The settings that change the logits (rows with equal ones are processed alike)."""
        return (
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
            self.logit_bias,
        )

    @property
    def counts_generated(self) -> bool:
        """Whether the processors need each row's counts of generated tokens (presence or frequency penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty)


def checked_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict or from such pairs; a ValueError names what is wrong.

    >>> checked_logit_bias({7: 1.5, 3: -100})
    ((3, -100), (7, 1.5))
    """
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    shape = "a dict {token id: bias}, each bias a number in [-100, 100]"
    if not isinstance(pairs, (list, tuple)) or any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in pairs):
        raise ValueError(f"logit_bias must be {shape}, got {bias!r}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token, value in pairs:
        if not _integer(token) or token < 0:
            raise ValueError(f"logit_bias must be {shape}: {token!r} is not a token id")
        if not _real(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(f"logit_bias must be {shape}: token {token} has {value!r}")
    twice = [t for t, n in collections.Counter(t for t, _ in pairs).items() if n > 1]
    if twice:
        raise ValueError(f"logit_bias gives token id {twice[0]} twice")
    return tuple(sorted((int(t), v) for t, v in pairs))


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens already in the text less likely: positive logits / penalty, negative * penalty.

    logits [B, V]; seen [B, V] bool, True for every token id present in that row's text so far.
    """
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def add_logit_bias(logits: Tensor, bias: Sequence[tuple[int, float]]) -> Tensor:
    """OpenAI's logit_bias: add each (token id, bias) pair's bias to that token's logit, in every row.

    logits [B, V] -> [B, V]; -100 all but bans a token, 100 all but forces it.

        >>> add_logit_bias(torch.tensor([[1.0, 2.0, 3.0]]), [(0, 5.0), (2, -100.0)])
        tensor([[  6.,   2., -97.]])
    """
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(1, ids, values.expand(len(logits), -1))


def presence_frequency_penalty(logits: Tensor, counts: Tensor, frequency: float, presence: float) -> Tensor:
    """OpenAI's penalties (as vLLM applies them): logit[t] -= count[t] * frequency + (count[t] > 0) * presence.

    logits [B, V]; counts [B, V]: how many times each token was generated in that row so far (not the prompt's).

        >>> presence_frequency_penalty(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[0, 1, 3]]), 0.5, 0.25)
        tensor([[ 1.0000,  0.2500, -0.7500]])
    """
    return logits - counts * frequency - (counts > 0) * presence


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device=None) -> Tensor:
    """counts [len(rows), vocab_size]: how many times each token id appears in each row (float32).

    >>> token_counts([[2, 2, 0], []], 3)
    tensor([[1., 0., 2.],
            [0., 0., 0.]])
    """
    counts = torch.zeros(len(rows), vocab_size, device=device)
    for i, row in enumerate(rows):
        if row:
            counts[i] = torch.bincount(torch.tensor(row, device=device), minlength=vocab_size)
    return counts


def temperature(logits: Tensor, t: float) -> Tensor:
    """Divide by t: t < 1 sharpens the distribution, t > 1 flattens it."""
    return logits / t


def top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k highest logits (and any tied with the k-th), set the rest to -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to more than p.

    Works from the least likely token upwards: a token is removed while the cumulative
    probability up to and including it stays <= 1 - p. The most likely token always stays.
    """
    sorted_logits, order = torch.sort(logits, descending=False)  # [B, V], ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p(logits: Tensor, p: float) -> Tensor:
    """Keep tokens whose probability is at least p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return logits.masked_fill(remove, float("-inf"))


def greedy(logits: Tensor) -> Tensor:
    """The most likely token of each row (the lowest id among ties). logits [B, V] -> ids [B]."""
    return logits.argmax(dim=-1)


def sample(logits: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """Draw one token per row from softmax(logits) (-inf = never). logits [B, V] -> ids [B].

    >>> sample(torch.tensor([[0.0, float("-inf")]]), torch.Generator().manual_seed(0))
    tensor([0])
    """
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class Sampler(Slots):
    """The functions that turn logits into the next token: the processors, `greedy` and `sample`.

    `Sampler()` holds the engine's own; `Sampler().replace(top_k=my_top_k)` swaps some. Generation,
    `LLMEngine` and speculative decoding take one as `sampler=`.

        >>> Sampler().next_token(torch.tensor([[1.0, 3.0, 2.0]]), SamplingParams())
        tensor([1])
    """

    repetition_penalty: Callable = repetition_penalty
    temperature: Callable = temperature
    top_k: Callable = top_k
    top_p: Callable = top_p
    min_p: Callable = min_p
    greedy: Callable = greedy
    sample: Callable = sample

    def process(
        self, logits: Tensor, settings: SamplingParams, seen: Optional[Tensor] = None, counts: Optional[Tensor] = None
    ) -> Tensor:
        """Apply the enabled processors. logits [B, V] -> [B, V]; seen [B, V] bool: the tokens in each row's text
        (prompt and generated: the repetition penalty's); counts [B, V]: how often each token was generated in each
        row (the presence and frequency penalties'; `token_counts`).

        The order is vLLM's (its V1 `Sampler`, vllm/v1/sample/sampler.py: logit processors such as logit_bias,
        then the penalties as `apply_penalties` in vllm/model_executor/layers/utils.py runs them, then temperature):
        1. `add_logit_bias`, 2. the repetition penalty (the swappable slot), 3. `presence_frequency_penalty`;
        these change a greedy choice too, so greedy decoding stops after them (the others never change the argmax).
        Then transformers' order for the rest: 4. temperature, 5. top-k, 6. top-p, 7. min-p (vLLM runs min-p before
        top-k and top-p). Steps 1 and 3 are the engine's own code, not slots of the table.
        """
        if settings.logit_bias:
            logits = add_logit_bias(logits, settings.logit_bias)
        if settings.repetition_penalty != 1.0 and seen is not None:
            logits = self.repetition_penalty(logits, seen, settings.repetition_penalty)
        if settings.counts_generated and counts is not None:
            logits = presence_frequency_penalty(logits, counts, settings.frequency_penalty, settings.presence_penalty)
        if settings.greedy:
            return logits
        if settings.temperature != 1.0:
            logits = self.temperature(logits, settings.temperature)
        if settings.top_k:
            logits = self.top_k(logits, settings.top_k)
        if settings.top_p < 1.0:
            logits = self.top_p(logits, settings.top_p)
        if settings.min_p:
            logits = self.min_p(logits, settings.min_p)
        return logits

    def next_token(
        self,
        logits: Tensor,
        settings: SamplingParams,
        seen: Optional[Tensor] = None,
        generator: Optional[torch.Generator] = None,
        counts: Optional[Tensor] = None,
    ) -> Tensor:
        """Choose one token per row. logits [B, V] -> token ids [B] (seen, counts: see `process`)."""
        scores = self.process(logits.float(), settings, seen, counts)
        return self.greedy(scores) if settings.greedy else self.sample(scores, generator)


PROCESSORS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")  # in the order they run

ENGINE_SAMPLER = Sampler()


def process_logits(
    logits: Tensor, settings: SamplingParams, seen: Optional[Tensor] = None, counts: Optional[Tensor] = None
) -> Tensor:
    """The engine's processors in their order; see `Sampler.process`."""
    return ENGINE_SAMPLER.process(logits, settings, seen, counts)


def next_token(
    logits: Tensor,
    settings: SamplingParams,
    seen: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    counts: Optional[Tensor] = None,
) -> Tensor:
    """The engine's choice of one token per row; see `Sampler.next_token`. logits [B, V] -> ids [B]."""
    return ENGINE_SAMPLER.next_token(logits, settings, seen, generator, counts)


def top_k_next_tokens(logits: Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely next tokens as (token id, probability), most likely first.

    Probabilities are the softmax over all of `logits` [V]; equal probabilities list the smaller
    token id first.

        >>> [(token, round(p, 3)) for token, p in top_k_next_tokens(torch.tensor([0.0, 2.0, 1.0, 2.0]), 2)]
        [(1, 0.399), (3, 0.399)]
    """
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    return [(int(i), float(p)) for i, p in zip(order[:k], sorted_probs[:k])]
