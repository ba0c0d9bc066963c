"""Fast byte-level BPE training with the same merges as the course's reference, and a tokenizer built on them.

Chapter 01's `llmcourse.course.bpe.train_bpe` recounts every adjacent pair of the whole text after each
merge: O(text length) per merge, minutes for a few thousand merges on Shakespeare. `train_bpe` here gives
exactly the same merges (ties included) by counting the pairs once and then updating only the counts around
each merged occurrence: the text is a linked list of tokens, each pair remembers where it occurs, and a heap
holds the pairs by (count, first occurrence).

    >>> train_bpe("aaabdaaabac", 3)                       # the reference's doctest, same answer
    {(97, 97): 256, (256, 97): 257, (257, 98): 258}

With `split_pattern` the text is first cut into chunks (as minbpe's RegexTokenizer and GPT-2 do) and no merge
crosses a chunk; each distinct chunk is stored once with its number of occurrences. The tokenizer that uses
such merges, `BPETokenizer`, cuts text with the same pattern and merges each chunk lowest rank first; it is
exported as a `tokenizer.json` that the `tokenizers` library (and transformers) encode identically with.

    >>> tok = BPETokenizer(train_bpe("to be or not to be", 4, SPLIT_PATTERN), SPLIT_PATTERN)
    >>> tok.encode("to be")
    [256, 258]
    >>> tok.decode([256, 258])
    'to be'

The ties: the reference picks, among the most frequent pairs, the one that occurs first in the current
sequence (`max` over counts in order of first occurrence). A token keeps the byte offset where it starts, so
"first occurrence" is the smallest start offset among the pair's occurrences; with chunks, the distinct
chunks are laid out in order of their first occurrence in the text, which keeps that order.
"""

from __future__ import annotations

import functools
import heapq
import json
from pathlib import Path
from typing import Optional

import regex

from .tokenizer import GPT2_SPLIT_PATTERN, bytes_to_unicode

# GPT-2's pattern, with a blank line ("\n\n") always a chunk of its own, so that it becomes one token: the end of a
# speech in the Shakespeare corpus, which the chat template uses as the end of a reply.
SPLIT_PATTERN = GPT2_SPLIT_PATTERN.replace(r"|\s+(?!\S)", r"|\n\n|\s+(?!\S)")

Pair = tuple[int, int]

# How many distinct chunks a `BPETokenizer` remembers the ids of (the least recently used forgotten first). Text
# repeats its common chunks (" the", " and", "\n\n"), so a few thousand cover nearly every one a text has; without a
# bound, a long-lived tokenizer (a server's, one encoding a large corpus) would keep every chunk it ever saw, numbers
# and names included, and its memory would grow with all the text it encoded. Each entry is a chunk and its ids: at
# most a few hundred bytes, a few MB for all of them.
CHUNK_CACHE_SIZE = 10_000


def distinct_chunks(text: str, split_pattern: Optional[str]) -> tuple[list[bytes], list[int]]:
    """The distinct chunks of `text` in order of first occurrence (UTF-8 bytes) and how often each occurs.

    >>> distinct_chunks("ab ab c", r" ?\\w+")
    ([b'ab', b' ab', b' c'], [1, 1, 1])
    >>> distinct_chunks("aaa", None)
    ([b'aaa'], [1])
    """
    if split_pattern is None:
        return ([text.encode("utf-8")] if text else []), ([1] if text else [])
    counts: dict[str, int] = {}
    for chunk in regex.findall(split_pattern, text):
        counts[chunk] = counts.get(chunk, 0) + 1  # dicts keep the order of first insertion
    return [chunk.encode("utf-8") for chunk in counts], list(counts.values())


class PairCounts:
    """The token sequence of all chunks as a linked list, each adjacent pair's total count and positions.

    Position i is the byte offset (in the distinct chunks laid end to end) where a token starts; `tok[i]` is -1
    once the token starting there has been merged into its left neighbour. `nxt`/`prv` link the live tokens of
    a chunk (-1 at its ends); `weight[i]` is how often i's chunk occurs in the text.
    """

    def __init__(self, chunks: list[bytes], weights: list[int]):
        self.tok: list[int] = []
        self.nxt: list[int] = []
        self.prv: list[int] = []
        self.weight: list[int] = []
        for chunk, w in zip(chunks, weights):
            start = len(self.tok)
            n = len(chunk)
            self.tok.extend(chunk)
            self.nxt.extend(range(start + 1, start + n))
            self.nxt.append(-1)
            self.prv.append(-1)
            self.prv.extend(range(start, start + n - 1))
            self.weight.extend([w] * n)
        self.count: dict[Pair, int] = {}
        self.where: dict[Pair, set[int]] = {}  # pair -> positions of its left token
        self.first: dict[Pair, int] = {}  # a lower bound of min(where[pair]), exact when pushed fresh
        tok, nxt, weight = self.tok, self.nxt, self.weight
        for i, j in enumerate(nxt):
            if j != -1:
                pair = (tok[i], tok[j])
                if pair in self.count:
                    self.count[pair] += weight[i]
                    self.where[pair].add(i)
                else:
                    self.count[pair], self.where[pair], self.first[pair] = weight[i], {i}, i
        self.heap = [(-c, self.first[p], p) for p, c in self.count.items()]
        heapq.heapify(self.heap)
        self.changed: set[Pair] = set()

    def add(self, pair: Pair, i: int) -> None:
        if pair in self.where:
            self.where[pair].add(i)
            self.count[pair] += self.weight[i]
            self.first[pair] = min(self.first[pair], i)
        else:
            self.where[pair], self.count[pair], self.first[pair] = {i}, self.weight[i], i
        self.changed.add(pair)

    def remove(self, pair: Pair, i: int) -> None:
        self.where[pair].discard(i)
        self.count[pair] -= self.weight[i]
        self.changed.add(pair)

    def best(self) -> Optional[Pair]:
        """The most frequent pair, the one occurring first among equals; None when no pair is left.

        Heap entries are (-count, a lower bound of the first position, pair); an entry whose count is no longer
        the pair's is stale. An entry is the answer once its position is exact: every other entry's key is at
        most that pair's true key, and no two pairs share a first position."""
        while self.heap:
            neg, first, pair = self.heap[0]
            if self.count.get(pair, 0) != -neg or neg == 0:
                heapq.heappop(self.heap)
                continue
            exact = min(self.where[pair])
            if exact == first:
                return pair
            self.first[pair] = exact
            heapq.heapreplace(self.heap, (neg, exact, pair))
        return None

    def merge(self, pair: Pair, new_id: int) -> None:
        """Replace every occurrence of `pair`, left to right without overlaps, by `new_id`, updating the counts
        of the pairs around each occurrence."""
        a, b = pair
        tok, nxt, prv = self.tok, self.nxt, self.prv
        for i in sorted(self.where[pair]):
            j = nxt[i]
            if tok[i] != a or j == -1 or tok[j] != b:
                continue  # i was used up by the previous occurrence (a == b, as in "aaa")
            p, n = prv[i], nxt[j]
            if p != -1:
                self.remove((tok[p], a), p)
            if n != -1:
                self.remove((b, tok[n]), j)
            self.count[pair] -= self.weight[i]
            tok[i], tok[j] = new_id, -1
            nxt[i] = n
            if n != -1:
                prv[n] = i
            if p != -1:
                self.add((tok[p], new_id), p)
            if n != -1:
                self.add((new_id, tok[n]), i)
        del self.where[pair], self.count[pair], self.first[pair]
        self.changed.discard(pair)
        for changed in self.changed:
            if self.count[changed] > 0:
                heapq.heappush(self.heap, (-self.count[changed], self.first[changed], changed))
            else:
                del self.where[changed], self.count[changed], self.first[changed]
        self.changed.clear()


def train_bpe(text: str, num_merges: int, split_pattern: Optional[str] = None) -> dict[Pair, int]:
    """Up to `num_merges` merges learned from the UTF-8 bytes of `text`: {(left id, right id): new id}.

    Without `split_pattern`, the merges of `llmcourse.course.bpe.train_bpe(text, num_merges)` (the reference,
    which this one is tested against); with it, the merges of the same algorithm run on the chunks the pattern
    cuts (pairs counted over all chunks, ties to the pair occurring first in the text, as minbpe's
    RegexTokenizer trains). Stops early when no pair is left.

        >>> train_bpe("abcabd", 10)
        {(97, 98): 256, (256, 99): 257, (257, 256): 258, (258, 100): 259}
    """
    state = PairCounts(*distinct_chunks(text, split_pattern))
    merges: dict[Pair, int] = {}
    for new_id in range(256, 256 + num_merges):
        pair = state.best()
        if pair is None:
            break
        state.merge(pair, new_id)
        merges[pair] = new_id
    return merges


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer of a set of merges, and its tokenizer.json


class BPETokenizer:
    """Byte-level BPE with `merges` ({pair: id}, ids 256, 257, ... in training order): text is cut with
    `split_pattern`, each chunk's bytes are merged lowest id first (the leftmost occurrence first), as
    minbpe's RegexTokenizer and the `tokenizers` library's BPE encode. `special_tokens` ({text: id}) are
    matched in the text first, the longest first where one starts with another, and never merged with their
    neighbours. The ids of the `CHUNK_CACHE_SIZE` chunks used most recently are remembered.

        >>> tok = BPETokenizer({(104, 105): 256}, special_tokens={"<|endoftext|>": 257})
        >>> tok.encode("hi<|endoftext|>hi")
        [256, 257, 256]
    """

    def __init__(
        self,
        merges: dict[Pair, int],
        split_pattern: str = SPLIT_PATTERN,
        special_tokens: Optional[dict[str, int]] = None,
    ):
        self.merges = dict(merges)
        self.split_pattern = split_pattern
        self.split = regex.compile(split_pattern)
        self.special_tokens = dict(special_tokens or {})
        self.vocab = {i: bytes([i]) for i in range(256)}
        for (left, right), new_id in sorted(self.merges.items(), key=lambda item: item[1]):
            self.vocab[new_id] = self.vocab[left] + self.vocab[right]
        seen: dict[bytes, int] = {}
        for i, token in self.vocab.items():
            if token in seen:
                raise ValueError(
                    f"merges give ids {seen[token]} and {i} the same bytes {token!r}; a tokenizer.json cannot hold "
                    "both (train on other text or with another number of merges)"
                )
            seen[token] = i
        self.vocab.update({i: s.encode("utf-8") for s, i in self.special_tokens.items()})
        # longest first: the regex takes the first alternative that matches, so "<|endoftext|>" listed before
        # "<|endoftext|><|endoftext|>" would cut the longer one in two
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self.special_split = (
            regex.compile("(" + "|".join(regex.escape(s) for s in longest_first) + ")") if longest_first else None
        )
        self.chunk_ids = functools.lru_cache(maxsize=CHUNK_CACHE_SIZE)(self._chunk_ids)

    @classmethod
    def from_file(cls, path: Path) -> "BPETokenizer":
        """The tokenizer a `save` wrote: merges, pattern and special tokens read back from tokenizer.json."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        vocab = data["model"]["vocab"]
        merges = {}
        for left, right in (m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]):
            merges[(vocab[left], vocab[right])] = vocab[left + right]
        specials = {t["content"]: t["id"] for t in data["added_tokens"]}
        pattern = data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
        tokenizer = cls(merges, pattern, specials)
        if any(bytes(to_byte[c] for c in s) != tokenizer.vocab[i] for s, i in vocab.items() if s not in specials):
            raise ValueError(f"{path}: its vocabulary does not follow from its merges")
        return tokenizer

    @property
    def n_vocab(self) -> int:
        return max(self.vocab) + 1

    def encode_chunk(self, chunk: bytes) -> list[int]:
        """One chunk's ids: its bytes, merged by the pair with the lowest id until no pair is a merge.

        >>> BPETokenizer({(97, 97): 256, (256, 97): 257}).encode_chunk(b"aaaaa")  # (a, a) twice, then (aa, a)
        [256, 257]
        """
        ids = list(chunk)
        while len(ids) > 1:
            pairs = set(zip(ids, ids[1:]))
            pair = min(pairs, key=lambda p: self.merges.get(p, float("inf")))
            if pair not in self.merges:
                break
            new_id, out, i = self.merges[pair], [], 0
            while i < len(ids):  # left to right, without overlaps
                if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens written in it encoded as ordinary text."""
        ids = []
        for chunk in self.split.findall(text):
            ids.extend(self.chunk_ids(chunk))
        return ids

    def _chunk_ids(self, chunk: str) -> tuple[int, ...]:
        """A chunk of text's ids (`chunk_ids` remembers those of the chunks used most recently)."""
        return tuple(self.encode_chunk(chunk.encode("utf-8")))

    def encode(self, text: str, allowed_special="all") -> list[int]:
        """Token ids of `text`; special tokens written in it become their ids (with `allowed_special="all"`, as
        tiktoken's `encode` takes it) or are encoded as ordinary text (`allowed_special=()`)."""
        if self.special_split is None or not allowed_special:
            return self.encode_ordinary(text)
        ids = []
        for piece in self.special_split.split(text):
            ids.extend([self.special_tokens[piece]] if piece in self.special_tokens else self.encode_ordinary(piece))
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.vocab[i] for i in ids)

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (bytes that are not UTF-8 become '\\ufffd')."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        """The `tokenizers` library's tokenizer.json: byte-level BPE, id = byte for the 256 single bytes,
        merges in training order, the pattern as a `Split` pre-tokenizer, special tokens as added tokens."""
        to_char = bytes_to_unicode()

        def spell(token: bytes) -> str:
            return "".join(to_char[b] for b in token)

        ordinary = {spell(self.vocab[i]): i for i in range(256 + len(self.merges))}
        merges = [[spell(self.vocab[a]), spell(self.vocab[b])] for (a, b), _ in sorted(self.merges.items(), key=by_id)]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": i,
                    "content": s,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
                for s, i in sorted(self.special_tokens.items(), key=by_id)
            ],
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": self.split_pattern},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                    byte_level,
                ],
            },
            "post_processor": None,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {**ordinary, **{s: i for s, i in self.special_tokens.items()}},
                "merges": merges,
            },
        }

    def save(self, path: Path) -> None:
        """Write tokenizer.json."""
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def by_id(item):
    return item[1]
