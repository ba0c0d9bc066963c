"""The four steps of structured output as replaceable functions (chapter 13's exercises), in the `Structuring` table.

A constraint is a regex (a JSON schema is compiled to one first: `schema_regex`), and its regex a byte automaton:
`transitions[s][b]` is the state after byte b from state s, -1 where no match can follow. Then, per state:

- `walk_token(transitions, state, token)`: the state after all of a token's bytes, -1 if one of them has no move;
- `token_index(transitions, state, vocab, walk_token)`: {token id: the state it leads to} for every token of the
  vocabulary ({id: bytes}, text tokens only) allowed in `state`;
- `mask_logits(logits, allowed, accepting, eos_ids)`: the logits with every token that may not come next at -inf
  (the EOS ids only where the text so far is complete).

These are written for reading. Where a table holds the engine's own `walk_token` and `token_index`, a constraint
builds its whole index at once with the C kernel (`index.TokenIndex`); with a learner's, it calls them for each state
a request reaches, when it reaches it (`LazyIndex`). The engine's own `mask_logits` is `constraint.mask_rows_`'s
grouped indexing.

    >>> dfa = compile_regex("(?:yes|no)")
    >>> transitions = dfa.next.tolist()
    >>> walk_token(transitions, 0, b"ye"), walk_token(transitions, 0, b"yo")   # states numbered as met from 0
    (4, -1)
    >>> token_index(transitions, 0, {7: b"y", 8: b"yes", 9: b"maybe"}), bool(dfa.accepting[3])
    ({7: 2, 8: 3}, True)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from ..slots import Slots
from .index import Vocabulary
from .json_schema import schema_regex
from .regex import ByteDFA, compile_regex


def walk_token(transitions: list, state: int, token: bytes) -> int:
    """The state after walking `token`'s bytes from `state`, or -1 as soon as a byte has no move (-1 in the table:
    there is no state -1 to walk on from).

    >>> t = [[1 if b == ord("a") else -1 for b in range(256)]] * 2    # "a+": state 1 after any a
    >>> walk_token(t, 0, b"aa"), walk_token(t, 0, b"ab"), walk_token(t, 1, b"")
    (1, -1, 1)
    """
    for byte in token:
        state = transitions[state][byte]
        if state < 0:
            return -1
    return state


def token_index(transitions: list, state: int, vocab: dict, walk_token: Callable = walk_token) -> dict:
    """{token id: the state its bytes lead to} for every token of `vocab` ({id: bytes}) that `state` allows: all of
    its bytes walk without leaving the automaton. Ids in `vocab`'s order."""
    index = {}
    for token, piece in vocab.items():
        target = walk_token(transitions, state, piece)
        if target >= 0:
            index[token] = target
    return index


def mask_logits(logits: Tensor, allowed: dict, accepting: bool, eos_ids: tuple) -> Tensor:
    """logits [..., V] (rows in one state) with every token that may not come next at -inf: the tokens `allowed`
    (the state's index: {token id: next state}) keep their logits, and so do the EOS ids where the text so far is
    complete (`accepting`). A new tensor, logits' dtype.

    >>> mask_logits(torch.zeros(4), {1: 0}, True, (3,))
    tensor([-inf, 0., -inf, 0.])
    """
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # [V]
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits.masked_fill(~keep, float("-inf"))


@dataclasses.dataclass(frozen=True)
class Structuring(Slots):
    """The functions a constraint is compiled and followed with (chapter 13): `compile_constraint(...,
    structuring=)` takes it."""

    walk_token: Callable = walk_token
    token_index: Callable = token_index
    mask_logits: Callable = mask_logits
    schema_regex: Callable = schema_regex

    @property
    def indexes_by_kernel(self) -> bool:
        """Whether the whole index is built at once by the engine's kernel (the engine's walk and index)."""
        return self.walk_token is walk_token and self.token_index is token_index


class LazyIndex:
    """A `TokenIndex` whose states are indexed by a `Structuring`'s `token_index` (a learner's), each when first
    asked for: `tokens[s]`, `targets[s]` (ascending ids, int32), `accepting[s]`, `next_state`, `allowed(s)`."""

    def __init__(self, dfa: ByteDFA, vocab: Vocabulary, structuring: Structuring):
        self.accepting = dfa.accepting
        self.structuring = structuring
        self.transitions = dfa.next.tolist()  # [S][256]: the table a learner's functions index
        self.vocab = dict(zip(vocab.ids, vocab.pieces))
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.dicts: dict[int, dict] = {}
        self.tokens, self.targets = _Rows(self, 0), _Rows(self, 1)

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        if state not in self.rows:
            index = self.allowed(state)
            ids = np.array(sorted(index), dtype=np.int32)
            self.rows[state] = ids, np.array([index[int(i)] for i in ids], dtype=np.int32)
        return self.rows[state]

    def allowed(self, state: int) -> dict:
        """{token id: next state} as the table's `token_index` gives it (computed once per state)."""
        if state not in self.dicts:
            s = self.structuring
            self.dicts[state] = dict(s.token_index(self.transitions, state, self.vocab, s.walk_token))
        return self.dicts[state]

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes + s.nbytes for t, s in self.rows.values())

    def next_state(self, state: int, token: int) -> int:
        tokens, targets = self.row(state)
        at = int(np.searchsorted(tokens, token))
        return int(targets[at]) if at < len(tokens) and tokens[at] == token else -1


@dataclasses.dataclass
class _Rows:
    """`LazyIndex.tokens` / `.targets`: `rows[s]` indexes state s when first read."""

    index: LazyIndex
    which: int

    def __getitem__(self, state: int) -> np.ndarray:
        return self.index.row(int(state))[self.which]

    def __len__(self) -> int:
        return self.index.num_states


def allowed_dict(index, state: int) -> dict:
    """A state's index as `mask_logits` takes it, {token id: next state}, from either kind of index."""
    if isinstance(index, LazyIndex):
        return index.allowed(state)
    return dict(zip(index.tokens[state].tolist(), index.targets[state].tolist()))


def structuring_of(structuring: Optional[Structuring]) -> Structuring:
    if structuring is None:
        return Structuring()
    if not isinstance(structuring, Structuring):
        raise TypeError(f"structuring must be a Structuring table, got {type(structuring).__name__}")
    return structuring


__all__ = ["Structuring", "walk_token", "token_index", "mask_logits", "schema_regex", "compile_regex"]
