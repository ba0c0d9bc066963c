"""Constraints on what a request generates, compiled for a tokenizer, and the guide that follows one request.

`compile_constraint(tokenizer, regex=..., choice=[...], json_schema=..., json_object=True)` -> a `Constraint`: the
pattern's byte automaton (`regex.compile_regex`) and its token index over the tokenizer's vocabulary
(`index.TokenIndex`), cached per (tokenizer, constraint). Each request follows it with a `Guide`: the automaton's
state after the tokens generated so far; before each step `mask_rows_` sets the logits of the tokens it does not
allow to -inf (the sampler then draws from the rest, renormalized), after it `advance(token)` moves on.

End of text: the model's EOS ids end a request only where the text so far is complete (an accepting state), and a
request whose text is complete with nothing allowed after it ends without one. A token that is an EOS id but also
text (llama-shakespeare's EOS is the token "\\n\\n") is text where the constraint allows that text and the state is
not accepting; in an accepting state it ends the request.

    >>> from llmcourse.engine.tokenizer import get_tokenizer
    >>> tok = get_tokenizer()
    >>> guide = Guide(compile_constraint(tok, choice=["yes", "no"]), eos_ids=[50256])
    >>> guide.advance(tok.encode("yes")[0]); guide.complete, guide.ended
    (True, False)
    >>> guide.advance(50256); guide.ended      # EOS in an accepting state ends it
    True
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .index import TokenIndex, Vocabulary, vocabulary_of
from .regex import compile_regex, escape
from .structuring import LazyIndex, Structuring, allowed_dict, mask_logits, structuring_of

CACHE_BYTES = 1 << 30  # compiled constraints kept while their indexes hold less (a 7-property schema's: 130 MB)


class ConstraintError(ValueError):
    """A constraint that cannot be used: several given, none, or one outside what the engine compiles."""


class Constraint:
    """A compiled constraint: `pattern` (its regex), `index` (its token index), `kind` and `spec` as given, and the
    `structuring` functions it is followed with (the engine's own: the whole index built at once by the C kernel;
    a learner's: each state indexed by their `token_index` when a request first reaches it)."""

    def __init__(self, pattern: str, vocab: Vocabulary, kind: str, spec: Any, structuring: Optional[Structuring]):
        self.pattern, self.kind, self.spec = pattern, kind, spec
        self.structuring = structuring_of(structuring)
        self.dfa = compile_regex(pattern)
        if self.structuring.indexes_by_kernel:
            self.index = TokenIndex(self.dfa, vocab)
        else:
            self.index = LazyIndex(self.dfa, vocab, self.structuring)
        self._masks: dict[tuple, Tensor] = {}
        self._lock = threading.RLock()

    def mask(self, state: int, eos_ids: tuple[int, ...], vocab_size: int, device) -> Tensor:
        """[vocab_size] bool: the tokens allowed in `state`, the EOS ids too where the text is complete."""
        key = (state, eos_ids, vocab_size, str(device))
        with self._lock:
            if key not in self._masks:
                allowed = torch.zeros(vocab_size, dtype=torch.bool)
                allowed[torch.from_numpy(self.index.tokens[state])] = True
                if self.index.accepting[state]:
                    allowed[list(eos_ids)] = True
                self._masks[key] = allowed.to(device)
            return self._masks[key]

    def fill(self, state: int, eos_ids: tuple[int, ...], vocab_size: int, device) -> tuple[bool, Tensor]:
        """How `mask_rows_` masks a row in `state`: (True, the allowed ids) where they are fewer than half the
        vocabulary (the row is rebuilt from them), else (False, the disallowed ids, set to -inf): either way the
        work is the smaller set's (in a JSON string a few hundred tokens are refused, between values all but a
        few)."""
        key = ("fill", state, eos_ids, vocab_size, str(device))
        with self._lock:
            if key not in self._masks:
                allowed = self.mask(state, eos_ids, vocab_size, "cpu")
                keep = int(allowed.sum()) <= vocab_size // 2
                ids = torch.nonzero(allowed if keep else ~allowed).flatten()
                self._masks[key] = (keep, ids.to(device))
            return self._masks[key]

    def __repr__(self) -> str:
        return f"Constraint({self.kind}: {self.dfa.num_states} states)"


class Guide:
    """One request's walk through a constraint: its `state`, how many tokens it took (`length`, an ending EOS
    included), whether its text is `complete` (accepting) and whether it has `ended` (`ended_by_eos`: an EOS id in
    an accepting state; or complete with nothing allowed after and no EOS id to end with)."""

    def __init__(self, constraint: Constraint, eos_ids: Sequence[int] = ()):
        self.constraint, self.eos_ids = constraint, tuple(int(i) for i in eos_ids)
        self.state, self.length, self.ended, self.ended_by_eos = 0, 0, False, False

    @property
    def complete(self) -> bool:
        return bool(self.constraint.index.accepting[self.state])

    def allowed(self, vocab_size: int, device) -> Tensor:
        """[vocab_size] bool: the tokens that may come next (all of them once it has ended: nothing is read)."""
        if self.ended:
            return everything(vocab_size, device)
        return self.constraint.mask(self.state, self.eos_ids, vocab_size, device)

    def allowed_along(self, tokens: Sequence[int], rows: int, first: int, vocab_size: int, device) -> Tensor:
        """[rows, vocab_size] bool: row i the tokens allowed after `tokens[:first + i]` taken from here, without
        taking them (speculative decoding checks proposals this way). Rows past a token not allowed, or past the
        end, allow everything: nothing after a rejected proposal is read."""
        walker = Guide(self.constraint, self.eos_ids)
        walker.state, walker.ended = self.state, self.ended
        out, broken = [], False
        for j in range(first + rows):
            if j >= first:
                every = torch.ones(vocab_size, dtype=torch.bool, device=device)
                out.append(every if broken else walker.allowed(vocab_size, device))
            if j < len(tokens) and not broken and not walker.ended:
                try:
                    walker.advance(tokens[j])
                except ValueError:
                    broken = True
        return torch.stack(out)

    def advance(self, token: int) -> None:
        """Take `token`; raises ValueError for a token the constraint does not allow here."""
        if self.ended:
            return
        index = self.constraint.index
        if self.complete and token in self.eos_ids:
            self.length += 1
            self.ended = self.ended_by_eos = True
            return
        state = index.next_state(self.state, token)
        if state < 0:
            raise ValueError(f"token {token} is not allowed in state {self.state} of {self.constraint!r}")
        self.state, self.length = state, self.length + 1
        if self.complete and len(index.tokens[state]) == 0 and not self.eos_ids:
            self.ended = True  # complete, nothing may follow, and no EOS to end it with


_vocabularies: "OrderedDict[int, tuple[object, Vocabulary]]" = OrderedDict()
_constraints: "OrderedDict[tuple, Constraint]" = OrderedDict()
_cache_lock = threading.Lock()


def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer's `Vocabulary`, made once per tokenizer object."""
    with _cache_lock:
        if id(tokenizer) not in _vocabularies:  # the entry keeps the tokenizer alive: its id stays its own
            _vocabularies[id(tokenizer)] = (tokenizer, vocabulary_of(tokenizer))
            while len(_vocabularies) > 4:
                _vocabularies.popitem(last=False)
        return _vocabularies[id(tokenizer)][1]


def constraint_pattern(
    regex: Optional[str] = None,
    choice: Optional[Sequence[str]] = None,
    json_schema: Any = None,
    json_object: bool = False,
    structuring: Optional[Structuring] = None,
) -> tuple[str, str, Any]:
    """(kind, regex, spec) of the one constraint given (a JSON schema compiled by `structuring`'s schema_regex)."""
    given = [
        name
        for name, value in (
            ("regex", regex),
            ("choice", choice),
            ("json_schema", json_schema),
            ("json_object", json_object),
        )
        if value not in (None, False)
    ]
    if len(given) != 1:
        raise ConstraintError(
            f"give one constraint of regex, choice, json_schema and json_object, got {given or 'none'}"
        )
    if regex is not None:
        if not isinstance(regex, str):
            raise ConstraintError(f"regex must be a string, got {type(regex).__name__}")
        return "regex", regex, regex
    if choice is not None:
        if isinstance(choice, str) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise ConstraintError("choice must be a non-empty list of non-empty strings")
        return "choice", "(?:" + "|".join(escape(c) for c in choice) + ")", list(choice)
    if json_schema is not None:
        spec = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        return "json_schema", structuring_of(structuring).schema_regex(spec), spec
    return "json_object", Structuring().schema_regex({"type": "object"}), True


def compile_constraint(tokenizer, *, structuring: Optional[Structuring] = None, **constraint) -> Constraint:
    """A `Constraint` for this tokenizer: exactly one of regex=, choice=, json_schema= (a dict or its JSON text) or
    json_object=True; `structuring`: the functions it is compiled and followed with (the engine's own by default;
    chapter 13's). Compiled once per (tokenizer, constraint, structuring); a constraint the engine cannot compile
    raises ValueError naming why (RegexError, SchemaError and ConstraintError are ValueErrors)."""
    structuring = structuring_of(structuring)
    kind, pattern, spec = constraint_pattern(**constraint, structuring=structuring)
    vocab = vocabulary(tokenizer)
    key = (id(tokenizer), pattern, structuring)  # (a Structuring is equal to one holding the same functions)
    with _cache_lock:
        if key in _constraints:
            _constraints.move_to_end(key)
            return _constraints[key]
    compiled = Constraint(pattern, vocab, kind, spec, structuring)
    with _cache_lock:
        _constraints[key] = compiled
        while len(_constraints) > 1 and sum(c.index.nbytes for c in _constraints.values()) > CACHE_BYTES:
            _constraints.popitem(last=False)  # the least recently used
    return compiled


@functools.lru_cache(maxsize=8)
def everything(vocab_size: int, device) -> Tensor:
    """[vocab_size] bool, all True: the mask of a guide that has ended (made once)."""
    return torch.ones(vocab_size, dtype=torch.bool, device=device)


def mask_rows_(logits: Tensor, guides: Sequence[Optional[Guide]]) -> Tensor:
    """Set, in place, the logits [B, V] of the tokens each row's guide does not allow to -inf (rows without a guide,
    or whose guide has ended, as they are): what the sampler then sees. Rows in the same state of the same
    constraint are masked together, by one indexing. -> logits."""
    V, device = logits.shape[-1], logits.device
    groups: dict[tuple, tuple[Guide, list[int]]] = {}
    for i, guide in enumerate(guides):
        if guide is not None and not guide.ended:
            groups.setdefault((id(guide.constraint), guide.state, guide.eos_ids), (guide, []))[1].append(i)
    for guide, rows in groups.values():
        constraint = guide.constraint
        if constraint.structuring.mask_logits is not mask_logits:  # a learner's: the group's rows through it
            at = torch.tensor(rows, device=device)
            allowed = allowed_dict(constraint.index, guide.state)
            logits[at] = constraint.structuring.mask_logits(logits[at], allowed, guide.complete, guide.eos_ids)
            continue
        keep, ids = constraint.fill(guide.state, guide.eos_ids, V, device)
        every_row = len(rows) == len(logits)
        at = slice(None) if every_row else torch.tensor(rows, device=device)[:, None]  # [rows, 1]
        if keep:  # a few allowed: the rows rebuilt from them
            kept = logits[at, ids]  # [rows, allowed]
            logits[slice(None) if every_row else at[:, 0]] = float("-inf")
            logits[at, ids] = kept
        else:  # a few refused
            logits[at, ids] = float("-inf")
    return logits
