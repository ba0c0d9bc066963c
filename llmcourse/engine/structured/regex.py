"""A regular expression compiled to a deterministic automaton over bytes (what constrained decoding walks tokens on).

A tokenizer's tokens are byte strings (GPT-2's and the Llama family's alike), and a token may end in the middle of
a character, so the automaton reads bytes, not characters: a character class becomes the UTF-8 byte sequences of
its characters. `compile_regex(pattern)` parses the pattern, builds Thompson's NFA (one state per position, empty
moves between them), turns it into a DFA by the subset construction (a DFA state is the set of NFA states the
bytes so far can have reached), and minimizes it (Moore's refinement: states no string tells apart are one), with
every state able to reach acceptance ("trimmed": a byte that could never lead to a match has no transition).

The pattern matches the whole text (as `re.fullmatch`). Supported: literal characters, `.` (any character but a
newline), classes `[a-z_]`, `[^"\\]`, escapes `\\d \\w \\s \\D \\W \\S \\n \\t \\r \\f \\v \\xHH \\uHHHH` and escaped
punctuation, groups `( )` and `(?: )`, alternation `|`, quantifiers `* + ? {n} {n,} {n,m}` (a lazy `?` after one
changes nothing here). Refused with a message naming the feature: anchors, lookaround, backreferences, named
groups, and class ranges beyond ASCII.

    >>> dfa = compile_regex(r"(yes|no)!?")
    >>> dfa.matches(b"yes!"), dfa.matches(b"no"), dfa.matches(b"nope")
    (True, True, False)
    >>> dfa.num_states
    6
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import numpy as np

ANY_BYTE = (1 << 256) - 1
MAX_REPEAT = 1000  # {n,m} bounds above this are refused: the automaton grows with them
MAX_NFA_STATES = 200_000  # a pattern whose repetitions nest deeper is refused before it takes the memory
MAX_DFA_STATES = 10_000  # ... and one whose automaton has more states (its index would take gigabytes)


class RegexError(ValueError):
    """A pattern this engine cannot compile; the message names the feature and where it is."""


def byte_set(*ranges: tuple[int, int]) -> int:
    """Bytes lo … hi of each range, as a 256-bit mask (bit b set: byte b belongs).

    >>> bin(byte_set((0x30, 0x31)))
    '0b11000000000000000000000000000000000000000000000000'
    """
    mask = 0
    for lo, hi in ranges:
        mask |= ((1 << (hi - lo + 1)) - 1) << lo
    return mask


# -- the pattern's syntax tree: ("bytes", mask) | ("seq", [nodes]) | ("alt", [nodes]) | ("repeat", node, lo, hi) --

Node = tuple
EMPTY: Node = ("seq", [])
CONTINUATION = byte_set((0x80, 0xBF))
# Every character beyond ASCII as UTF-8 bytes: 2, 3 or 4 bytes, surrogates and overlong forms excluded.
NON_ASCII: Node = (
    "alt",
    [
        ("seq", [("bytes", byte_set((0xC2, 0xDF))), ("bytes", CONTINUATION)]),
        ("seq", [("bytes", byte_set((0xE0, 0xE0))), ("bytes", byte_set((0xA0, 0xBF))), ("bytes", CONTINUATION)]),
        ("seq", [("bytes", byte_set((0xE1, 0xEC), (0xEE, 0xEF))), ("bytes", CONTINUATION), ("bytes", CONTINUATION)]),
        ("seq", [("bytes", byte_set((0xED, 0xED))), ("bytes", byte_set((0x80, 0x9F))), ("bytes", CONTINUATION)]),
        ("seq", [("bytes", byte_set((0xF0, 0xF0))), ("bytes", byte_set((0x90, 0xBF)))] + [("bytes", CONTINUATION)] * 2),
        ("seq", [("bytes", byte_set((0xF1, 0xF3)))] + [("bytes", CONTINUATION)] * 3),
        ("seq", [("bytes", byte_set((0xF4, 0xF4))), ("bytes", byte_set((0x80, 0x8F)))] + [("bytes", CONTINUATION)] * 2),
    ],
)


@dataclasses.dataclass
class CharSet:
    """A set of characters: ASCII ones as a byte mask, and either every non-ASCII character (`all_beyond`) or these."""

    ascii: int = 0
    beyond: frozenset = frozenset()
    all_beyond: bool = False

    def node(self) -> Node:
        options = [("bytes", self.ascii)] if self.ascii else []
        if self.all_beyond:
            options.append(NON_ASCII)
        options += [literal(c) for c in sorted(self.beyond)]
        return options[0] if len(options) == 1 else ("alt", options)

    def negated(self, where: int) -> "CharSet":
        if self.beyond:
            raise RegexError(f"a negated class with characters beyond ASCII (at {where}) is not supported")
        return CharSet(byte_set((0, 127)) & ~self.ascii, frozenset(), not self.all_beyond)


def literal(char: str) -> Node:
    """A character as its UTF-8 bytes in sequence."""
    return ("seq", [("bytes", 1 << b) for b in char.encode()])


ESCAPES = {
    "d": CharSet(byte_set((0x30, 0x39))),
    "w": CharSet(byte_set((0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A), (0x5F, 0x5F))),
    "s": CharSet(byte_set((0x20, 0x20), (0x09, 0x0D))),
}
CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


class Parser:
    """Recursive descent over the pattern: alternation of sequences of repeated atoms."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def parse(self) -> Node:
        node = self.alternation()
        if self.i < len(self.p):
            raise RegexError(f"unbalanced ')' at {self.i} in {self.p!r}")
        return node

    def peek(self) -> Optional[str]:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise RegexError(f"the pattern {self.p!r} ends too early")
        self.i += 1
        return self.p[self.i - 1]

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> Node:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeated(self.atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def repeated(self, node: Node) -> Node:
        while self.peek() in ("*", "+", "?", "{"):
            start, c = self.i, self.take()
            if c == "{":
                close = self.p.find("}", self.i)
                body = self.p[self.i : close] if close > 0 else ""
                lo, _, hi = body.partition(",")
                if not lo.strip().isdigit() or (hi.strip() and not hi.strip().isdigit()):
                    raise RegexError(f"a repetition {{{body}}} at {start} must be {{n}}, {{n,}} or {{n,m}}")
                low, high = int(lo), (int(hi) if hi.strip() else None) if "," in body else int(lo)
                if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
                    raise RegexError(f"the repetition {{{body}}} at {start} is out of range (at most {MAX_REPEAT})")
                self.i = close + 1
            else:
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            node = ("repeat", node, low, high)
        return node

    def atom(self) -> Node:
        start, c = self.i, self.take()
        if c == "(":
            if self.peek() == "?":
                if self.p[self.i : self.i + 2] != "?:":
                    raise RegexError(f"the group '(?{self.p[self.i + 1 : self.i + 2]}' at {start} is not supported")
                self.i += 2
            node = self.alternation()
            if self.peek() != ")":
                raise RegexError(f"the group opened at {start} is not closed")
            self.i += 1
            return node
        if c == "[":
            return self.char_class(start).node()
        if c == ".":
            return CharSet(byte_set((0, 127)) & ~(1 << 10), all_beyond=True).node()
        if c == "\\":
            return self.escape(start).node()
        if c in "^$":
            raise RegexError(f"the anchor {c!r} at {start} is not supported: a constraint matches the whole text")
        if c in "*+?{":
            raise RegexError(f"{c!r} at {start} repeats nothing")
        return literal(c)

    def escape(self, start: int) -> CharSet:
        c = self.take()
        if c.lower() in ESCAPES:
            chars = ESCAPES[c.lower()]
            return chars.negated(start) if c.isupper() else chars
        if c in CONTROL:
            return single(CONTROL[c])
        if c in "xu":
            digits = self.p[self.i : self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise RegexError(f"\\{c} at {start} needs {2 if c == 'x' else 4} hexadecimal digits")
            self.i += len(digits)
            return single(chr(int(digits, 16)))
        if c.isalnum():
            raise RegexError(f"the escape \\{c} at {start} is not supported (backreferences and anchors are not)")
        return single(c)

    def char_class(self, start: int) -> CharSet:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        chars, first = CharSet(), True
        while True:
            if self.peek() is None:
                raise RegexError(f"the class opened at {start} is not closed")
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            c = self.take()
            if c == "\\":
                item = self.escape(self.i - 1)
            else:
                item = single(c)
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                end = self.take()
                end_char = self.escape(self.i - 1) if end == "\\" else single(end)
                lo, hi = only_char(item, start), only_char(end_char, start)
                if ord(hi) > 127:
                    raise RegexError(f"the class range {lo}-{hi} at {start} goes beyond ASCII; list those characters")
                if ord(lo) > ord(hi):
                    raise RegexError(f"the class range {lo}-{hi} at {start} is reversed")
                item = CharSet(byte_set((ord(lo), ord(hi))))
            chars = CharSet(chars.ascii | item.ascii, chars.beyond | item.beyond, chars.all_beyond or item.all_beyond)
        return chars.negated(start) if negate else chars


def single(char: str) -> CharSet:
    return CharSet(1 << ord(char)) if ord(char) < 128 else CharSet(beyond=frozenset([char]))


def only_char(chars: CharSet, where: int) -> str:
    if chars.all_beyond or bin(chars.ascii).count("1") + len(chars.beyond) != 1:
        raise RegexError(f"a class range at {where} must run between two characters")
    return next(iter(chars.beyond)) if chars.beyond else chr(chars.ascii.bit_length() - 1)


# -- Thompson's NFA -----------------------------------------------------------------------------------------------


class NFA:
    """States 0 … n-1; `moves[s]`: (byte mask, next state) pairs; `empty[s]`: states reached without a byte."""

    def __init__(self):
        self.moves: list[list[tuple[int, int]]] = []
        self.empty: list[list[int]] = []

    def state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise RegexError(
                f"the pattern needs more than {MAX_NFA_STATES:,} automaton states: its repetitions multiply "
                "(e.g. a bounded repeat inside another); write it with fewer or smaller bounds"
            )
        self.moves.append([])
        self.empty.append([])
        return len(self.moves) - 1

    def build(self, node: Node, start: int) -> int:
        """Add `node` from state `start`; -> its end state."""
        kind = node[0]
        if kind == "bytes":
            end = self.state()
            self.moves[start].append((node[1], end))
            return end
        if kind == "seq":
            for item in node[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.state()
            for option in node[1]:
                first = self.state()
                self.empty[start].append(first)
                self.empty[self.build(option, first)].append(end)
            return end
        _, inner, low, high = node
        for _ in range(low):
            start = self.build(inner, start)
        if high is None:  # a loop: any number more
            loop = self.state()
            self.empty[start].append(loop)
            self.empty[self.build(inner, loop)].append(loop)
            return loop
        end = self.state()
        self.empty[start].append(end)
        for _ in range(high - low):  # each optional copy may be the last
            start = self.build(inner, start)
            self.empty[start].append(end)
        return end


# -- the DFA -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ByteDFA:
    """A minimal, trimmed DFA over bytes: `next[s, b]` the state after byte b from state s (-1: no match can follow),
    state 0 the start, `accepting[s]` whether the bytes so far match."""

    next: np.ndarray  # [S, 256] int32
    accepting: np.ndarray  # [S] bool
    pattern: str = ""

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, data: bytes, state: int = 0) -> int:
        """The state after `data` from `state` (-1 once no match can follow)."""
        for b in data:
            if state < 0:
                break
            state = int(self.next[state, b])
        return state

    def matches(self, data: bytes) -> bool:
        state = self.walk(data)
        return state >= 0 and bool(self.accepting[state])


def byte_classes(masks: list[int]) -> tuple[np.ndarray, list[int]]:
    """Bytes that every mask treats alike, grouped: -> (class of each byte [256], a representative byte per class)."""
    signature: dict[tuple, int] = {}
    classes = np.zeros(256, dtype=np.int64)
    representatives = []
    for b in range(256):
        key = tuple(m >> b & 1 for m in masks)
        if key not in signature:
            signature[key] = len(representatives)
            representatives.append(b)
        classes[b] = signature[key]
    return classes, representatives


def determinize(nfa: NFA, start: int, end: int) -> tuple[list[list[int]], list[bool], np.ndarray]:
    """Subset construction over byte classes -> (next state per class per DFA state, -1 none; accepting; classes)."""
    masks = sorted({mask for moves in nfa.moves for mask, _ in moves})
    classes, representatives = byte_classes(masks)

    @functools.lru_cache(maxsize=None)
    def closure(s: int) -> frozenset:
        seen, todo = {s}, [s]
        while todo:
            for t in nfa.empty[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    first = closure(start)
    ids, sets, table = {first: 0}, [first], []
    while len(table) < len(sets):
        current = sets[len(table)]
        row = []
        for b in representatives:
            target = frozenset().union(*(closure(t) for s in current for mask, t in nfa.moves[s] if mask >> b & 1))
            if not target:
                row.append(-1)
                continue
            if target not in ids:
                if len(sets) >= MAX_DFA_STATES * 4:  # minimizing rarely divides by more
                    raise RegexError(
                        f"the constraint needs more than {MAX_DFA_STATES:,} automaton states; make it smaller "
                        "(shorter maxLength / maxItems, fewer optional properties, smaller {n,m} bounds)"
                    )
                ids[target] = len(sets)
                sets.append(target)
            row.append(ids[target])
        table.append(row)
    return table, [end in s for s in sets], classes


def minimize(table: list[list[int]], accepting: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Moore's refinement, after dropping the states that cannot reach acceptance; the start stays state 0.
    -> (next state per class [S, C], -1 none; accepting [S])."""
    moves, accept = np.array(table, dtype=np.int64), np.array(accepting, dtype=bool)  # [n, C], [n]
    alive = accept.copy()  # co-reachability: alive once some move leads to an alive state
    while True:
        grown = alive | ((moves >= 0) & alive[np.maximum(moves, 0)]).any(axis=1)
        if (grown == alive).all():
            break
        alive = grown
    if not alive[0]:
        raise RegexError("the pattern matches no text at all")
    moves = np.where((moves >= 0) & alive[np.maximum(moves, 0)], moves, -1)  # a move to a dead state: none
    block = accept.astype(np.int64)  # states no string tells apart share a block: first split by acceptance
    mix = np.random.default_rng(0).integers(1, 2**62, size=moves.shape[1] + 1)  # [C + 1]: rows to one number
    while True:  # a state's signature: its block and the blocks its moves lead to, hashed (64 bits, wrapping)
        signature = np.column_stack([block, np.where(moves >= 0, block[np.maximum(moves, 0)], -1)])  # [n, C + 1]
        signature[~alive] = -1
        _, first, refined = np.unique((signature * mix).sum(axis=1), return_index=True, return_inverse=True)
        if not (signature == signature[first[refined]]).all():  # two signatures hashed alike (about 1e-11): exact
            _, refined = np.unique(signature, axis=0, return_inverse=True)
            refined = refined.reshape(-1)
        if refined.max() == block.max():  # no block split: stable
            break
        block = refined
    order, todo = {}, [0]  # blocks numbered as a breadth-first walk from the start meets them: the start is 0
    member = {}
    for s in todo:
        if block[s] in order:
            continue
        order[block[s]] = len(order)
        member[order[block[s]]] = s
        todo += [int(t) for t in moves[s] if t >= 0 and block[t] not in order]
    renumber = np.full(block.max() + 2, -1)
    for b, i in order.items():
        renumber[b] = i
    rows = moves[[member[i] for i in range(len(order))]]  # [S, C]
    return np.where(rows >= 0, renumber[block[np.maximum(rows, 0)]], -1), accept[[member[i] for i in range(len(order))]]


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str) -> ByteDFA:
    """The minimal trimmed DFA over bytes of `pattern` (cached per pattern). Raises RegexError for what it cannot
    compile, naming the feature."""
    if not isinstance(pattern, str):
        raise RegexError(f"a regex must be a string, got {type(pattern).__name__}")
    nfa = NFA()
    start = nfa.state()
    end = nfa.build(Parser(pattern).parse(), start)
    table, accepting, classes = determinize(nfa, start, end)
    by_class, accepting = minimize(table, accepting)  # [S, classes], [S]
    if len(accepting) > MAX_DFA_STATES:
        raise RegexError(
            f"the constraint needs {len(accepting):,} automaton states, more than {MAX_DFA_STATES:,}; make it smaller "
            "(shorter maxLength / maxItems, fewer optional properties, smaller {n,m} bounds)"
        )
    return ByteDFA(by_class[:, classes].astype(np.int32), accepting, pattern)


def escape(text: Union[str, bytes]) -> str:
    """`text` as a pattern that matches exactly it (every character but letters, digits, space and _ escaped).

    >>> escape("a.b (c)")
    'a\\\\.b \\\\(c\\\\)'
    """
    text = text.decode() if isinstance(text, bytes) else text
    return "".join(c if c.isalnum() or c in " _" or ord(c) > 127 else "\\" + c for c in text)
