"""The token index: for every state of a byte automaton, which tokens of a vocabulary may come next, and where each
one leads (Willard & Louf 2023's index, what Outlines, vLLM and SGLang mask logits with).

A token is allowed in state s when walking all of its bytes from s never leaves the automaton; its next state is
where the walk ends. All tokens are walked at once with numpy: the vocabulary's bytes as one matrix [V, longest]
(tokens sorted longest first, so the tokens still walking at depth d are the first ones), a chunk of states
against every token, one gather per byte position.

    >>> from llmcourse.engine.structured.regex import compile_regex
    >>> vocab = Vocabulary([b"1", b"2", b"12", b"a", b"."], [0, 1, 2, 3, 4])
    >>> index = TokenIndex(compile_regex(r"[0-9]+\\.?"), vocab)
    >>> index.tokens[0].tolist(), index.targets[0].tolist()   # from the start: digits only
    ([0, 1, 2], [1, 1, 1])
    >>> sorted(index.tokens[1].tolist())   # after a digit: digits or the dot
    [0, 1, 2, 4]
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .regex import ByteDFA

STATES_AT_ONCE = 64  # states walked together: [64, V] int32 is 13 MB for GPT-2's vocabulary


@dataclasses.dataclass
class Vocabulary:
    """The text tokens of a tokenizer: their bytes, and their ids (special tokens are not text: they are left out)."""

    pieces: list[bytes]
    ids: list[int]

    def __post_init__(self):
        order = sorted(range(len(self.pieces)), key=lambda i: -len(self.pieces[i]))  # longest first
        longest = len(self.pieces[order[0]]) if order else 0
        self.matrix = np.zeros((len(order), longest), dtype=np.uint8)  # [V, longest]
        for row, i in enumerate(order):
            self.matrix[row, : len(self.pieces[i])] = np.frombuffer(self.pieces[i], dtype=np.uint8)
        lengths = np.array([len(self.pieces[i]) for i in order], dtype=np.int64)
        self.walking = [int((lengths > d).sum()) for d in range(longest)]  # tokens still walking at each depth
        self.sorted_ids = np.array([self.ids[i] for i in order], dtype=np.int64)  # [V]


def vocabulary_of(tokenizer) -> Vocabulary:
    """A tokenizer's text tokens: tiktoken's Encoding (GPT-2) or the engine's HFTokenizer (the Llama family)."""
    pieces, ids = [], []
    if hasattr(tokenizer, "decode_single_token_bytes"):  # tiktoken
        special = set(tokenizer.special_tokens_set)
        for i in range(tokenizer.n_vocab):
            try:
                piece = tokenizer.decode_single_token_bytes(i)
            except KeyError:
                continue
            if piece and piece.decode("utf-8", "replace") not in special:
                pieces.append(piece)
                ids.append(i)
        return Vocabulary(pieces, ids)
    special = {i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}
    for i in range(tokenizer.n_vocab):
        if i not in special:
            piece = tokenizer.token_bytes(i)
            if piece:
                pieces.append(piece)
                ids.append(i)
    return Vocabulary(pieces, ids)


class TokenIndex:
    """`tokens[s]`: the ids of the tokens allowed in state s, ascending; `targets[s]`: the state each leads to
    (aligned); `accepting[s]`: whether the text so far is complete."""

    def __init__(self, dfa: ByteDFA, vocab: Vocabulary):
        S = dfa.num_states
        dead = S
        step = np.full((S + 1, 256), dead, dtype=np.int32)  # [S + 1, 256]: the dead state's row loops on itself
        step[:S] = np.where(dfa.next >= 0, dfa.next, dead)
        self.accepting = dfa.accepting
        self.tokens: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        for first in range(0, S, STATES_AT_ONCE):
            states = np.arange(first, min(S, first + STATES_AT_ONCE), dtype=np.int32)
            at = np.repeat(states[:, None], len(vocab.sorted_ids), axis=1)  # [c, V]: each token's walk from each state
            for depth, n in enumerate(vocab.walking):
                at[:, :n] = step[at[:, :n], vocab.matrix[:n, depth]]
            for row in at:
                alive = row != dead
                ids, targets = vocab.sorted_ids[alive], row[alive]
                order = np.argsort(ids)  # by token id: a token is then found by bisection
                self.tokens.append(ids[order])
                self.targets.append(targets[order])

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def next_state(self, state: int, token: int) -> int:
        """Where `token` leads from `state`, -1 if it is not allowed there."""
        tokens = self.tokens[state]
        at = int(np.searchsorted(tokens, token))
        return int(self.targets[state][at]) if at < len(tokens) and tokens[at] == token else -1

    def reachable(self, start: int = 0) -> Sequence[int]:
        """The states whole tokens can reach from `start`, in the order a breadth-first walk meets them."""
        seen, order = {start}, [start]
        for s in order:
            for t in np.unique(self.targets[s]).tolist():
                if t not in seen:
                    seen.add(t)
                    order.append(t)
        return order
