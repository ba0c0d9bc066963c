"""The token index: for every state of a byte automaton, which tokens of a vocabulary may come next, and where each
one leads (Willard & Louf 2023's index, what Outlines, vLLM and SGLang mask logits with).

A token is allowed in state s when walking all of its bytes from s never leaves the automaton; its next state is
where the walk ends. Two routes give the same index:

- the C kernel `token_walk` (`engine/kernels/token_index.c`, built with the CPU kernels), one state at a time on
  every thread: it walks the vocabulary's trie, its tokens' prefixes in depth-first order (`Vocabulary.trie`), so
  that tokens sharing a prefix walk it once and a prefix the automaton refuses skips all the tokens that begin with
  it (GPT-2's 50,256 text tokens have 320,814 bytes but 98,023 distinct prefixes);
- numpy where the kernels are not built: all tokens at once, the vocabulary's bytes as one matrix [V, longest]
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
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .. import cpu_kernels, threads
from .regex import ByteDFA

STATES_AT_ONCE = 64  # numpy: states walked together, [64, V] int32 is 13 MB for GPT-2's vocabulary
MAX_TRIE_DEPTH = 256  # the C kernel's longest token, in bytes


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
        self.sorted_ids = np.array([self.ids[i] for i in order], dtype=np.int32)  # [V]

    @functools.cached_property
    def trie(self) -> dict:
        """The tokens' prefixes in depth-first order (sorted bytes: a prefix before its extensions): per node its
        last `byte`, its `depth`, `skip` (the node after its subtree), and the tokens ending there, `ids[first[n] :
        first[n + 1]]` (several ids may share bytes)."""
        prefixes = sorted({piece[:d] for piece in self.pieces for d in range(1, len(piece) + 1)})
        node = {p: n for n, p in enumerate(prefixes)}
        ending: list[list[int]] = [[] for _ in prefixes]
        for piece, i in zip(self.pieces, self.ids):
            ending[node[piece]].append(i)
        skip, open_nodes = np.zeros(len(prefixes), dtype=np.int32), []
        for n, p in enumerate(prefixes):  # a node's subtree ends where a node no deeper than it begins
            while open_nodes and len(prefixes[open_nodes[-1]]) >= len(p):
                skip[open_nodes.pop()] = n
            open_nodes.append(n)
        skip[open_nodes] = len(prefixes)
        return dict(
            byte=np.array([p[-1] for p in prefixes], dtype=np.uint8),
            depth=np.array([len(p) for p in prefixes], dtype=np.int32),
            skip=skip,
            first=np.cumsum([0] + [len(e) for e in ending]).astype(np.int32),
            ids=np.array([i for e in ending for i in e], dtype=np.int32),
        )


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
        self.accepting = dfa.accepting
        self.tokens: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        lib = cpu_kernels.library()
        if lib is not None and len(vocab.walking) <= MAX_TRIE_DEPTH:
            self.walk_trie(lib, dfa, vocab)
        else:
            self.walk_matrix(dfa, vocab)

    def walk_trie(self, lib, dfa: ByteDFA, vocab: Vocabulary) -> None:
        """The C kernel, states shared out among the engine's threads (each call releases the GIL)."""
        trie, table = vocab.trie, np.ascontiguousarray(dfa.next, dtype=np.int32)
        args = [a.ctypes.data for a in (trie["byte"], trie["depth"], trie["skip"], trie["first"], trie["ids"])]
        nodes, most = len(trie["byte"]), len(trie["ids"])

        def walk(state: int) -> tuple[np.ndarray, np.ndarray]:
            ids, targets = np.empty(most, dtype=np.int32), np.empty(most, dtype=np.int32)
            n = lib.token_walk(table.ctypes.data, state, *args, nodes, ids.ctypes.data, targets.ctypes.data)
            order = np.argsort(ids[:n])  # by token id: a token is then found by bisection
            return ids[:n][order], targets[:n][order]  # (new arrays: the buffers are reused for the next state)

        with ThreadPoolExecutor(max(1, threads.engine_threads())) as pool:
            for ids, targets in pool.map(walk, range(dfa.num_states)):
                self.tokens.append(ids)
                self.targets.append(targets)

    def walk_matrix(self, dfa: ByteDFA, vocab: Vocabulary) -> None:
        """numpy: a chunk of states against every token at once, one gather per byte position."""
        S = dfa.num_states
        dead = S
        step = np.full((S + 1, 256), dead, dtype=np.int32)  # [S + 1, 256]: the dead state's row loops on itself
        step[:S] = np.where(dfa.next >= 0, dfa.next, dead)
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

    @property
    def nbytes(self) -> int:
        """Bytes the index holds: 8 per allowed (state, token), its id and where it leads (int32 each)."""
        return sum(t.nbytes + s.nbytes for t, s in zip(self.tokens, self.targets))

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
