"""Byte-level BPE in plain Python: train merges on a text, and encode/decode exactly like GPT-2.

The engine tokenizes with tiktoken (fast, written in Rust). This module is the same algorithm
written out, small enough to read in one sitting, and it is the reference chapter 01's exercises are
checked against.

Training (as in minbpe) starts from the UTF-8 bytes of a text, ids 0..255, and again and again
replaces the most frequent adjacent pair of ids by a new id, 256, 257, ...:

    >>> merges = train_bpe("aaabdaaabac", 3)
    >>> merges
    {(97, 97): 256, (256, 97): 257, (257, 98): 258}
    >>> build_vocab(merges)[258]
    b'aaab'

Recounting every pair after each merge is simple and slow (O(text) per merge);
`llmcourse.engine.bpe_training.train_bpe` gives exactly these merges with incremental pair counts, fast
enough to train the bundled llama-shakespeare's 4,096-token vocabulary in seconds.

Encoding (as in GPT-2 and tiktoken) uses *ranks*, token bytes -> id, where a lower rank means the
token was merged earlier in training. Text is first cut into word-like chunks, then each chunk's
bytes are merged lowest rank first:

    >>> encode("Hello world")
    [15496, 995]
    >>> decode([15496, 995])
    'Hello world'
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import regex

from llmcourse.engine.tokenizer import EOT, EOT_ID, GPT2_SPLIT_PATTERN, load_mergeable_ranks, vocab_files

CORPUS_FILE = Path(__file__).parents[1] / "data" / "bpe_corpus.txt"  # Antony's speech (Julius Caesar III.2)
SPECIAL_TOKENS = {EOT: EOT_ID}  # GPT-2 has one special token; it is never produced by merges
GPT2_SPLIT = regex.compile(GPT2_SPLIT_PATTERN)  # \p{L} (any letter) needs `regex`; `re` lacks it


# ----------------------------------------------------------------------------------------------
# Training


def get_pair_counts(ids: list[int]) -> dict[tuple[int, int], int]:
    """How often each adjacent pair occurs, overlapping pairs included, in order of first occurrence.

    >>> get_pair_counts([1, 1, 1, 2])
    {(1, 1): 2, (1, 2): 1}
    """
    counts: dict[tuple[int, int], int] = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace each occurrence of `pair` by `new_id`, left to right, without overlaps.

    >>> merge([1, 1, 1], (1, 1), 9)   # the second (1, 1) overlaps the first: it is not merged
    [9, 1]
    >>> merge([5, 1, 2, 1, 2], (1, 2), 9)
    [5, 9, 9]
    """
    out = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2  # both ids are used up
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text: str, num_merges: int) -> dict[tuple[int, int], int]:
    """Learn up to `num_merges` merges from the UTF-8 bytes of `text`: {(left id, right id): new id}.

    Each step merges the most frequent adjacent pair into the next id (256, 257, ...). Ties go to
    the pair that occurs first in the current sequence: that is what `max` returns when the counts
    are in order of first occurrence. A pair is merged even if it occurs only once; training stops
    early only when no pair is left (the whole text has become one token).

        >>> train_bpe("abcabd", 10)   # (97, 98) occurs twice; after it, every pair occurs once
        {(97, 98): 256, (256, 99): 257, (257, 256): 258, (258, 100): 259}
    """
    ids = list(text.encode("utf-8"))  # [n_bytes], each 0..255
    merges: dict[tuple[int, int], int] = {}
    for new_id in range(256, 256 + num_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = max(counts, key=counts.get)  # first of the most frequent, in order of occurrence
        ids = merge(ids, pair, new_id)
        merges[pair] = new_id
    return merges


def build_vocab(merges: dict[tuple[int, int], int]) -> dict[int, bytes]:
    """Token id -> its bytes: the 256 single bytes, then each merge's two parts joined.

    >>> build_vocab({(104, 105): 256, (256, 33): 257})[257]
    b'hi!'
    """
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in sorted(merges.items(), key=lambda item: item[1]):
        vocab[new_id] = vocab[left] + vocab[right]
    return vocab


# ----------------------------------------------------------------------------------------------
# GPT-2's encoder and decoder


@functools.lru_cache(maxsize=1)
def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's 50,256 mergeable tokens, bytes -> rank (= token id), from the official files.

    Shared and cached: copy it before changing it.

        >>> gpt2_ranks()[b" the"]
        262
    """
    files = vocab_files()
    return load_mergeable_ranks(files["vocab.bpe"], files["encoder.json"])


@functools.lru_cache(maxsize=1)
def gpt2_vocab() -> dict[int, bytes]:
    """GPT-2's 50,257 tokens, id -> bytes, `<|endoftext|>` (50256) included. Shared: do not modify.

    >>> gpt2_vocab()[50256]
    b'<|endoftext|>'
    """
    vocab = {rank: token for token, rank in gpt2_ranks().items()}
    vocab.update({i: special.encode("utf-8") for special, i in SPECIAL_TOKENS.items()})
    return vocab


def bpe_encode_chunk(chunk: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Split one chunk into tokens: start from single bytes and keep merging, lowest rank first.

    At each step, of all adjacent parts whose concatenation is a token in `ranks`, join the pair
    with the lowest rank (the leftmost one if a rank occurs twice); stop when no adjacent pair
    forms a token. Every single byte must be in `ranks`. Returns the ranks of the final parts.

        >>> ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"abc": 257}
        >>> bpe_encode_chunk(b"abcab", ranks)
        [257, 256]
    """
    parts = [bytes([b]) for b in chunk]  # [n], each one byte long
    while len(parts) > 1:
        joined = [left + right for left, right in zip(parts, parts[1:])]  # [n - 1] candidate tokens
        best = min(range(len(joined)), key=lambda i: ranks.get(joined[i], float("inf")))  # first minimum
        if joined[best] not in ranks:
            break  # no adjacent pair forms a token: done
        parts[best : best + 2] = [joined[best]]
    return [ranks[part] for part in parts]


def encode(text: str, allowed_special=(EOT,), *, ranks: dict[bytes, int] | None = None) -> list[int]:
    """GPT-2's token ids for `text` (equal to tiktoken's with `allowed_special` the same).

    1. Special tokens in `allowed_special` become their own id (`<|endoftext|>` -> 50256); any other
       occurrence of them is encoded as ordinary text.
    2. The rest is cut into chunks with GPT-2's regex (words with their leading space, numbers,
       punctuation runs, whitespace), so that no token ever spans two words.
    3. Each chunk's UTF-8 bytes go through `bpe_encode_chunk` with GPT-2's ranks (or `ranks`).

        >>> encode("Hi<|endoftext|>")
        [17250, 50256]
        >>> encode("Hi<|endoftext|>", allowed_special=())
        [17250, 27, 91, 437, 1659, 5239, 91, 29]
    """
    ranks = gpt2_ranks() if ranks is None else ranks
    unknown = set(allowed_special) - set(SPECIAL_TOKENS)
    if unknown:
        raise ValueError(f"unknown special tokens {sorted(unknown)}; GPT-2 has only {list(SPECIAL_TOKENS)}")
    if allowed_special:
        pieces = re.split("(" + "|".join(re.escape(s) for s in allowed_special) + ")", text)  # specials kept
    else:
        pieces = [text]
    ids = []
    chunk_ids: dict[str, list[int]] = {}  # text repeats its words: encode each distinct chunk once
    for piece in pieces:
        if piece in allowed_special:
            ids.append(SPECIAL_TOKENS[piece])
            continue
        for chunk in GPT2_SPLIT.findall(piece):
            if chunk not in chunk_ids:
                chunk_ids[chunk] = bpe_encode_chunk(chunk.encode("utf-8"), ranks)
            ids.extend(chunk_ids[chunk])
    return ids


def decode(ids: list[int], vocab: dict[int, bytes] | None = None) -> str:
    """Text of token ids: join their bytes, then decode UTF-8 once (bad bytes become '\\ufffd').

    Decoding all the bytes together matters: one character can be split across tokens.

        >>> decode([8582, 99, 247])   # 🦙 is three tokens; none of them is a character alone
        '🦙'
        >>> decode([8582])
        '\\ufffd'
    """
    vocab = gpt2_vocab() if vocab is None else vocab
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
