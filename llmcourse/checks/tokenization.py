"""Checks for chapter 01, tokenization: byte-level BPE, from pair counts to GPT-2's encoder.

Each check compares the learner's function with the engine's (`llmcourse.course.bpe`, and
`llmcourse.engine.tokenizer` for `bytes_to_unicode` and `StreamDecoder`) on fixed edge cases and seeded
random inputs. When an answer is wrong, the message also says what was probably done wrong, worked
out from the input and the wrong answer (merged overlapping pairs, broke a tie the other way,
forgot `<|endoftext|>`, skipped the regex pre-split, decoded token by token, emitted half a
character, ...).

    >>> def merge(ids, pair, new_id):
    ...     out, i = [], 0
    ...     while i < len(ids):
    ...         if tuple(ids[i : i + 2]) == pair:
    ...             out.append(new_id)
    ...             i += 2
    ...         else:
    ...             out.append(ids[i])
    ...             i += 1
    ...     return out
    >>> check_merge(merge)
    ✓ merge — 34 cases

The engine's own functions are the black boxes: passing `llmcourse.course.bpe.merge` itself fails.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Optional

from llmcourse.course import bpe
from llmcourse.engine.tokenizer import EOT, EOT_ID, StreamDecoder, bytes_to_unicode

from .harness.core import Case, CheckFailed, Verdict, failure, run_check
from .harness.forbid import Forbidden
from .harness.show import short

NO_TIKTOKEN = [Forbidden("tiktoken", "tiktoken is the black box this chapter opens: use your own functions.")]
NO_ENGINE_TRAINER = [  # the engine's fast trainer gives the same merges, and its BPETokenizer encodes with them
    Forbidden(
        "llmcourse.engine.bpe_training",
        "The engine's BPE trainer and tokenizer are black boxes here: use your own functions.",
    )
]
NO_LIBRARIES = [
    *NO_TIKTOKEN,
    *NO_ENGINE_TRAINER,
    Forbidden("transformers", "Hugging Face's tokenizers are black boxes here: use your own functions."),
    Forbidden("tokenizers", "Hugging Face's tokenizers are black boxes here: use your own functions."),
]


def _engine(*names: str, instead: str) -> list[Forbidden]:
    return [Forbidden(f"llmcourse.course.bpe.{name}", instead) for name in names]


# ----------------------------------------------------------------------------------------------
# Running cases


class _Shown(dict):
    """A big dict argument (GPT-2's ranks or vocab) that prints as a short label in messages."""

    def __init__(self, data: dict, label: str):
        super().__init__(data)
        self.label = label

    def __repr__(self) -> str:
        return self.label


def _gpt2_ranks() -> _Shown:
    return _Shown(bpe.gpt2_ranks(), "ranks")  # a fresh copy per check: a learner may modify it


def _gpt2_vocab() -> _Shown:
    return _Shown(bpe.gpt2_vocab(), "vocab")


@functools.lru_cache(maxsize=None)
def _trained_vocab(text: str, num_merges: int) -> dict[int, bytes]:
    return bpe.build_vocab(bpe.train_bpe(text, num_merges))


def _toy_ranks(text: str, num_merges: int) -> _Shown:
    """Ranks of a small BPE trained on `text`: the 256 bytes, then one token per merge."""
    vocab = _trained_vocab(text, num_merges)
    learned = ", ".join(f"{vocab[i]!r}: {i}" for i in range(256, len(vocab)))
    return _Shown({token: i for i, token in vocab.items()}, f"{{<256 single bytes>, {learned}}}")


def _is_int_list(got: Any) -> Optional[str]:
    """None if `got` is a list of Python ints, else what it is instead."""
    if not isinstance(got, list):
        return f"expected a list, got a {type(got).__name__}"
    for i, item in enumerate(got):
        if not isinstance(item, int) or isinstance(item, bool):
            return f"item {i} should be an int, got {short(item, 60)} ({type(item).__name__})"
    return None


# ----------------------------------------------------------------------------------------------
# Random inputs

# Pieces that exercise every branch of GPT-2's pre-split pattern and of UTF-8: letters and digits
# beyond ASCII (\p{L}, \p{N}), marks and underscores (neither), every kind of whitespace.
TEXT_PIECES = [
    "the",
    " the",
    "The",
    " THE",
    "hello",
    " world",
    "Caesar",
    " ambitious",
    "ing",
    " un",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "’s",
    "''",
    " 2024",
    "1234567",
    "3.14",
    "１２３",
    " Ⅻ",
    "x²",
    "٣٤",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    " \n ",
    "\u3000",
    "\u00a0",
    "\u200b",
    ",",
    ".",
    "!?",
    " —",
    "--",
    "(",
    ")",
    ":",
    " #",
    "_",
    "snake_case",
    "x_1",
    "café",
    " naïve",
    "Straße",
    "e\u0301",
    "ǅ",
    "中文",
    "日本語",
    "🦙",
    "🔥",
    "❤️",
    "👍🏽",
    "é",
    "x",
    "Q",
    " q",
    EOT,
]

# Ids whose decimal digits run together (1, 11, 12, 112, ...): "[11, 2]" contains the text "1, 2".
DIGIT_IDS = [1, 2, 11, 12, 21, 22, 111, 112, 121, 211, 256, 1256, 2561, 50256]


def _random_text(rng: random.Random, max_pieces: int) -> str:
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, max_pieces)))


@functools.lru_cache(maxsize=1)
def _corpus() -> str:
    return bpe.CORPUS_FILE.read_text(encoding="utf-8")


def _corpus_slice(rng: random.Random, max_chars: int) -> str:
    text = _corpus()
    length = rng.randint(1, max_chars)
    start = rng.randrange(len(text) - length)
    return text[start : start + length]


def _random_alphabet(rng: random.Random, kind: int) -> list[int]:
    """A few ids to draw from: small ones (runs and overlaps), ones whose digits run together, large ones."""
    if kind == 0:
        return list(range(rng.choice([2, 3])))
    if kind == 1:
        return rng.sample(DIGIT_IDS, rng.randint(2, 5))
    if kind == 2:
        return rng.sample(range(50257), rng.randint(2, 6))
    return list(range(300))


@functools.lru_cache(maxsize=1)
def _byte_ids() -> tuple[int, ...]:
    """The id of each single-byte token: _byte_ids()[b] is the token for bytes([b])."""
    ranks = bpe.gpt2_ranks()
    return tuple(ranks[bytes([b])] for b in range(256))


# Bytes that are tricky in a stream: continuation bytes, lead bytes of every length (valid and not),
# bytes that are never valid UTF-8, and plain ASCII.
TRICKY_BYTES = [
    0x80,
    0x9F,
    0xA0,
    0xBF,
    0xC0,
    0xC1,
    0xC2,
    0xDF,
    0xE0,
    0xE2,
    0xED,
    0xEF,
    0xF0,
    0xF4,
    0xF5,
    0xF8,
    0xFF,
    0x41,
    0x20,
    0x0A,
]


def _random_stream(rng: random.Random, kind: int) -> list[int]:
    """Token ids: of a text; any ids (they may cut characters anywhere); byte by byte with invalid bytes; a
    text's tokens with invalid bytes put in between."""
    byte_ids = _byte_ids()
    if kind == 0:
        return bpe.encode(_random_text(rng, 10))
    if kind == 1:
        return [rng.randrange(EOT_ID + 1) for _ in range(rng.randint(1, 12))]
    if kind == 2:
        text = _random_text(rng, 4).encode("utf-8")
        pool = [*TRICKY_BYTES, *text]
        return [byte_ids[rng.choice(pool)] for _ in range(rng.randint(1, 14))]
    ids = bpe.encode(_random_text(rng, 8))
    for _ in range(rng.randint(1, 3)):
        ids.insert(rng.randint(0, len(ids)), byte_ids[rng.choice(TRICKY_BYTES[:17])])
    return ids


# ----------------------------------------------------------------------------------------------
# Pair counts and merge


def _judge_pair_counts(case: Case, got: Any) -> Verdict:
    expected = case.expected
    if not isinstance(got, dict):
        return f"expected a dict {{(id, id): count}}, got a {type(got).__name__}", ""
    wrong_key = next((k for k in got if not (isinstance(k, tuple) and len(k) == 2)), None)
    if wrong_key is not None:
        return (
            f"the keys should be tuples (left id, right id), got {short(wrong_key, 60)}",
            "use the pair itself as the key: counts[(ids[i], ids[i + 1])]",
        )
    for pair, count in expected.items():
        if pair not in got:
            return f"the pair {pair} (count {count}) is missing", ""
        if type(got[pair]) is not int:
            return (
                f"the count of {pair} should be an int, got {short(got[pair], 60)} ({type(got[pair]).__name__})",
                "count with whole numbers: counts[pair] = counts.get(pair, 0) + 1",
            )
        if got[pair] != count:
            return f"the pair {pair} should have count {count}, got {got[pair]}", ""
    extra = [pair for pair in got if pair not in expected]
    if extra:
        return (
            f"{short(extra[0], 60)} is not an adjacent pair of the input",
            "count only (ids[i], ids[i + 1]) for i = 0 .. len(ids) - 2, comparing ids, not their text",
        )
    if list(got) != list(expected):
        return (
            "the counts are right but the pairs are in a different order",
            "keep the pairs in the order they first occur (a plain dict or a Counter does, if you do not "
            "sort it): train_bpe breaks ties by that order",
        )
    return None


def check_get_pair_counts(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """get_pair_counts(ids) -> {(left, right): count}, overlapping pairs included, in order of first occurrence."""
    overlap = "count every adjacent pair, overlapping ones too: in [1, 1, 1] the pair (1, 1) starts at 0 and at 1"
    last = "the last pair is (ids[-2], ids[-1]): does your loop stop one step early?"
    fixed = [
        ("an empty list has no pairs", [], ""),
        ("a single id has no pairs", [7], "a list of n ids has n - 1 adjacent pairs"),
        ("two ids, one pair", [1, 2], last),
        ("overlapping pairs [1, 1, 1]", [1, 1, 1], overlap),
        ("a run of one id", [4, 4, 4, 4, 4], overlap),
        ("repeated pairs", [1, 2, 1, 2, 1, 2], ""),
        ("order of first occurrence", [9, 3, 1, 2, 9, 3], "keep the pairs in the order they first occur"),
        ("pairs are ordered: (1, 2) is not (2, 1)", [1, 2, 1], "a pair is (left, right): (1, 2) and (2, 1) differ"),
        ("the bytes of 'hello world'", list("hello world".encode()), last),
        ("ids above 255", [256, 300, 256, 300, 5], ""),
        (
            "ids whose digits run together",
            [11, 2, 1, 21, 1, 2],
            "count pairs of ids, not pieces of their text: 11 followed by 2 is not the pair (1, 2)",
        ),
    ]
    cases = [Case(d, (ids,), bpe.get_pair_counts(ids), h) for d, ids, h in fixed]
    rng = random.Random(seed)
    for i in range(n_random):
        alphabet = _random_alphabet(rng, i % 4)
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        cases.append(Case(f"random ids #{i}", (ids,), bpe.get_pair_counts(ids)))
    run_check(
        "get_pair_counts",
        fn,
        cases,
        judge=_judge_pair_counts,
        forbid=_engine("get_pair_counts", instead="Count the pairs yourself with a dict and a loop."),
        timeout_hint="look for a loop that never ends (a while loop whose index never moves on)",
    )


def _judge_merge(case: Case, got: Any) -> Verdict:
    ids, pair, new_id = case.args
    expected = case.expected
    if not isinstance(got, list):
        return (
            f"expected a list, got a {type(got).__name__}",
            "build a new list and return it (not a tuple or a generator)",
        )
    problem = _is_int_list(got)
    if problem:
        return problem, "the list holds ids: ints, as in the input"
    if got == expected:
        return None
    if got == ids:
        return (
            "nothing was merged",
            "compare each (ids[i], ids[i + 1]) with the pair and append new_id where they match",
        )
    if len(got) < len(expected):
        return (
            f"expected {len(expected)} ids, got {len(got)}: too many merges or ids lost",
            case.hint
            or "merges must not overlap: after merging ids[i] and ids[i + 1], continue at i + 2, so that "
            "[1, 1, 1] becomes [9, 1]; and keep every id that is not merged",
        )
    if len(got) > len(expected):
        return (
            f"expected {len(expected)} ids, got {len(got)}: some occurrences were not merged or ids were repeated",
            case.hint
            or "after a merge skip both ids (i += 2); don't forget a pair at the very end; append each "
            "unmerged id exactly once",
        )
    return (
        "right length, wrong ids",
        case.hint or "scan left to right, without overlaps: [1, 1, 1] with (1, 1) gives [9, 1], not [1, 9] or [9, 9]",
    )


def check_merge(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """merge(ids, pair, new_id) -> new list with each occurrence of pair replaced, left to right, no overlaps."""
    fixed = [
        ("an empty list", [], (1, 2), 9, ""),
        ("a single id", [1], (1, 2), 9, "with one id there is no pair: return [1]"),
        ("exactly the pair", [1, 2], (1, 2), 9, ""),
        (
            "overlapping pairs [1, 1, 1]",
            [1, 1, 1],
            (1, 1),
            9,
            "left to right, without overlaps: after merging positions 0 and 1, continue at 2",
        ),
        ("a run of four", [1, 1, 1, 1], (1, 1), 9, "two non-overlapping pairs: [9, 9]"),
        ("a run of five", [1, 1, 1, 1, 1], (1, 1), 9, ""),
        ("the pair at the end", [3, 4, 1, 2], (1, 2), 9, "does your loop look at the last pair?"),
        ("the pair at the start", [1, 2, 3, 4], (1, 2), 9, ""),
        ("the pair twice in a row", [5, 1, 2, 1, 2], (1, 2), 9, ""),
        ("the pair is absent", [2, 1, 3], (1, 2), 9, "(2, 1) is not (1, 2): return the ids unchanged, as a new list"),
        ("the last id is not merged", [1, 2, 1], (1, 2), 9, "keep the last id when it is not part of a merge"),
        ("ids above 255", [256, 300, 256, 300, 256], (256, 300), 301, ""),
        (
            "ids whose digits run together",
            [11, 2, 1, 21, 12, 1, 2],
            (1, 2),
            9,
            "compare ids, not their text: [11, 2] does not contain the pair (1, 2)",
        ),
        ("large ids", [50256, 198, 50256, 198, 50256], (50256, 198), 50257, ""),
    ]
    cases = [Case(d, (ids, pair, new), bpe.merge(ids, pair, new), h) for d, ids, pair, new, h in fixed]
    rng = random.Random(seed)
    for i in range(n_random):
        alphabet = _random_alphabet(rng, i % 3)
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
        if ids and rng.random() < 0.8:  # mostly a pair that occurs
            at = rng.randrange(max(len(ids) - 1, 1))
            pair = (ids[at], ids[at + 1]) if len(ids) > 1 else (ids[0], rng.choice(alphabet))
        else:
            pair = (rng.choice(alphabet), rng.choice(alphabet))
        new_id = rng.choice([256 + i, 50257 + i, 100_000 + rng.randrange(10**6)])
        cases.append(Case(f"random ids #{i}", (ids, pair, new_id), bpe.merge(ids, pair, new_id)))
    run_check(
        "merge",
        fn,
        cases,
        judge=_judge_merge,
        forbid=_engine("merge", instead="Write the loop yourself."),
        timeout_hint="look for a loop that never ends: does i move on in every branch (i += 2 after a merge, "
        "i += 1 otherwise)?",
    )


# ----------------------------------------------------------------------------------------------
# Training


def _judge_train_bpe(case: Case, got: Any) -> Verdict:
    text, num_merges = case.args
    expected = case.expected
    if not isinstance(got, dict):
        return f"expected a dict {{(left id, right id): new id}}, got a {type(got).__name__}", ""
    for pair, new_id in got.items():
        if (
            not (isinstance(pair, tuple) and len(pair) == 2 and all(type(x) is int for x in pair))
            or type(new_id) is not int
        ):
            return (
                f"each entry should be (left id, right id): new id, all ints; got {short(pair, 40)}: "
                f"{short(new_id, 40)}",
                "merges[pair] = new_id, with pair a tuple of two ids",
            )
    if list(got.items()) == list(expected.items()):
        return None
    if not text.isascii() and list(got.items()) == list(_train_on([ord(c) for c in text], num_merges).items()):
        return (
            "these merges were learned from the characters of the text, not from its UTF-8 bytes",
            "train on the UTF-8 bytes: list(text.encode('utf-8')), not on [ord(c) for c in text]",
        )
    if got == expected:
        return (
            "the right merges, but in a different order",
            "add each merge to the dict as you learn it (merges[pair] = new_id inside the loop) and don't sort "
            "it: the merges are used in this order (build_vocab, encode), earliest first",
        )
    learned = sorted(got.items(), key=lambda item: item[1])
    ids = list(text.encode("utf-8"))
    for step, (pair, new_id) in enumerate(expected.items()):
        if step >= len(learned):
            return (
                f"expected {len(expected)} merges, got {len(got)}",
                "keep merging while any pair is left, even a pair that occurs only once; stop only after "
                "num_merges merges or when the text has become a single token",
            )
        got_pair, got_id = learned[step]
        if got_id != new_id:
            return (
                f"merge #{step} should create id {new_id}, got id {short(got_id, 40)}",
                "new ids are 256, 257, 258, ... in the order of the merges",
            )
        if got_pair != pair:
            counts = bpe.get_pair_counts(ids)
            best = counts[pair]
            problem = f"merge #{step} (new id {new_id}) should join {pair} (count {best}), got {short(got_pair, 60)}"
            recount = (
                "apply each merge to the ids (ids = merge(ids, pair, new_id)) and count the pairs again "
                "before choosing the next one"
            )
            if got_pair not in counts:
                return problem, f"that pair does not occur at this point: {recount}"
            if max(pair) >= 256 and all(max(p) < 256 for p, _ in learned):
                return problem, f"none of your merges uses a merged id (256 or more): {recount}"
            if counts[got_pair] == best:
                return problem, _tie_hint(counts, got_pair, bpe.build_vocab(dict(list(expected.items())[:step])))
            return (
                problem,
                f"{got_pair} occurs {counts[got_pair]} times, {pair} {best} times: pick the most frequent pair",
            )
        ids = bpe.merge(ids, pair, new_id)
    return (
        f"expected {len(expected)} merges, got {len(got)}",
        "stop after num_merges merges, or earlier when no pair is left",
    )


# Other ways to break a tie among equally frequent pairs (`tied`, in order of first occurrence; `as_bytes(pair)`:
# the two tokens' bytes), each with what it is called in a hint
TIE_RULES = [
    (lambda tied, as_bytes: max(tied), "the greatest pair of ids"),
    (lambda tied, as_bytes: max(tied, key=as_bytes), "the lexicographically greatest pair of bytes (CS336's rule)"),
    (lambda tied, as_bytes: min(tied), "the smallest pair of ids"),
    (lambda tied, as_bytes: min(tied, key=as_bytes), "the lexicographically smallest pair of bytes"),
    (lambda tied, as_bytes: tied[-1], "the last of them to occur (a loop with >= keeps the last of equal counts)"),
]


def _tie_hint(counts: dict[tuple[int, int], int], got_pair: tuple[int, int], vocab: dict[int, bytes]) -> str:
    """What a merge that took `got_pair` among equally frequent pairs did instead of the chapter's rule."""
    best = counts[got_pair]
    tied = [pair for pair, count in counts.items() if count == best]

    def as_bytes(pair):
        return vocab[pair[0]], vocab[pair[1]]

    rules = [name for pick, name in TIE_RULES if pick(tied, as_bytes) == got_pair] or ["another of them"]
    took = ", ".join(rules[:-1]) + (" or " if len(rules) > 1 else "") + rules[-1]
    return (
        f"a tie: {len(tied)} pairs occur {best} time{'s' if best > 1 else ''}, and you took {took}. This chapter "
        f"breaks ties by the pair seen first in the current ids, {tied[0]}: max(counts, key=counts.get), with "
        "counts in order of first occurrence"
    )


def _train_on(ids: list[int], num_merges: int) -> dict[tuple[int, int], int]:
    """train_bpe's algorithm on any list of ids (to recognise merges learned from characters)."""
    merges: dict[tuple[int, int], int] = {}
    for new_id in range(256, 256 + num_merges):  # as a learner would, even if a character's code is above 255
        counts = bpe.get_pair_counts(ids)
        if not counts:
            break
        pair = max(counts, key=counts.get)
        ids, merges[pair] = bpe.merge(ids, pair, new_id), new_id
    return merges


def check_train_bpe(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """train_bpe(text, num_merges) -> {(left, right): new id} learned from the UTF-8 bytes of text, in merge order."""
    count_one = "keep merging even when the most frequent pair occurs only once"
    fixed = [
        ("an empty text", "", 5, "no bytes, no pairs, no merges: return {}"),
        ("one byte: no pairs", "a", 3, "stop when no pair is left"),
        ("zero merges", "abab", 0, ""),
        ("the classic example", "aaabdaaabac", 3, ""),
        ("overlapping pairs", "aaaa", 3, "merge without overlaps: 'aaaa' becomes [256, 256], then [257]"),
        ("pairs that occur once", "abcabd", 10, count_one),
        ("more merges than pairs", "abc", 10, "after 'abc' becomes one token there is nothing left to merge: stop"),
        ("a tie between three pairs", "cdab cdab", 2, ""),
        (
            "a tie among five pairs after a merge: the first seen, the smallest, the greatest (by ids, by bytes) "
            "and the last all differ",
            "xyxaxy xaaby xaab y",
            3,
            "",
        ),
        (
            "non-ASCII: é and — are two and three bytes",
            "café — café — cafés",
            6,
            "train on the UTF-8 bytes: list(text.encode('utf-8')), not on the characters",
        ),
        ("words and spaces", "the cat and the hat and the bat", 12, ""),
        (
            "merges learned in an order that is not sorted",
            "zzzz yy zzzz yy xzxz",
            6,
            "keep the merges in the order you learn them",
        ),
    ]
    cases = [Case(d, (text, n), bpe.train_bpe(text, n), h) for d, text, n, h in fixed]
    rng = random.Random(seed)
    for i in range(n_random):
        kind = i % 3
        if kind == 1:
            text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 40)))  # ties and overlaps everywhere
            n = rng.randint(0, 30)
        elif kind == 2:
            text = _random_text(rng, 12)  # multi-byte characters: bytes, not characters
            n = rng.randint(1, 30)
        else:
            text = _corpus_slice(rng, 300)
            n = rng.randint(1, 40)
        cases.append(Case(f"random text #{i}", (text, n), bpe.train_bpe(text, n)))
    run_check(
        "train_bpe",
        fn,
        cases,
        judge=_judge_train_bpe,
        forbid=[*_engine("train_bpe", instead="Build it from your get_pair_counts and merge."), *NO_ENGINE_TRAINER],
        timeout_hint="does every step shrink the ids (ids = merge(ids, pair, new_id))? Stop after num_merges "
        "steps, or when no pair is left",
    )


# ----------------------------------------------------------------------------------------------
# GPT-2's byte <-> character table


def check_bytes_to_unicode(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """bytes_to_unicode() -> {byte: printable character}, GPT-2's table for writing bytes in vocab.bpe.

    Every byte is checked (the `n_random` random ones right after the landmark bytes, for a hint that
    fits), and so is the order of the keys, which gives the single-byte tokens their ids.
    """
    name = "bytes_to_unicode"
    forbid = [
        Forbidden("llmcourse.engine.tokenizer.bytes_to_unicode", "Build the table yourself."),
        Forbidden("llmcourse.engine.tokenizer.load_mergeable_ranks", "Build the table yourself."),
        *NO_LIBRARIES,
    ]
    reference = bytes_to_unicode()
    hints = {
        "printable": "bytes that are printable characters in Latin-1 ('!'..'~', '¡'..'¬', '®'..'ÿ') map to chr(byte)",
        "other": "the other 68 bytes (controls, space, 127..160, 173) map to chr(256), chr(257), ... in byte order",
    }
    rng = random.Random(seed)
    landmarks = [32, 10, 9, 0, 65, 33, 126, 127, 160, 161, 173, 174, 255]  # around the edges of the printable ranges
    order = dict.fromkeys([*landmarks, *rng.sample(range(256), min(n_random, 256)), *range(256)])  # first ones first

    def fail(description, problem, call, expected, got, hint):
        return failure(name, description, problem, call, expected, got, hint)

    def judge(case: Case, table: Any) -> Verdict:  # raises its own messages: each names the entry it looks at
        if not isinstance(table, dict):
            raise fail(
                "the table",
                f"expected a dict {{byte: character}}, got a {type(table).__name__}",
                "bytes_to_unicode()",
                "{33: '!', 34: '\"', ...}",
                table,
                "",
            )
        if set(table) != set(range(256)) or any(type(k) is not int for k in table):
            missing = [b for b in range(256) if b not in table]
            raise fail(
                "the keys",
                f"expected the 256 bytes 0..255 as keys, got {len(table)} keys"
                + (f", missing {missing[:5]}" if missing else ""),
                "set(bytes_to_unicode())",
                "{0, 1, ..., 255}",
                set(table),
                "the keys are ints 0..255, one per byte value",
            )
        for b in order:
            if type(table[b]) is not str or table[b] != reference[b]:
                kind = "other" if reference[b] != chr(b) else "printable"
                raise fail(
                    f"byte {b} ({bytes([b])!r})",
                    "the characters differ",
                    f"bytes_to_unicode()[{b}]",
                    reference[b],
                    table[b],
                    hints[kind],
                )
        if list(table) != list(reference):
            at = next(k for k, (got, want) in enumerate(zip(table, reference)) if got != want)
            raise fail(
                "the order of the table",
                f"right characters, but entry #{at} is byte {list(table)[at]}, expected byte {list(reference)[at]}",
                "list(bytes_to_unicode())",
                list(reference),
                list(table),
                "the order matters: GPT-2 numbers its 256 single-byte tokens in the order of "
                "this table. Insert the printable bytes first (33..126, 161..172, 174..255), then the others "
                "in increasing order",
            )
        return None

    run_check(
        name,
        fn,
        [Case("the table", (), reference)],
        judge=judge,
        forbid=forbid,
        timeout_hint="look for a loop that never ends: 256 bytes need one loop over range(256)",
        success=f"✓ {name} — 256 bytes and their order",
    )


# ----------------------------------------------------------------------------------------------
# Encoding one chunk with ranks


def _judge_encode_chunk(case: Case, got: Any) -> Verdict:
    chunk, ranks = case.args
    problem = _is_int_list(got)
    if problem:
        hint = (
            "return the ranks of the parts (ints), not the parts: [ranks[part] for part in parts]"
            if isinstance(got, list) and got and isinstance(got[0], bytes)
            else ""
        )
        return problem, hint
    if got == case.expected:
        return None
    token = {rank: part for part, rank in ranks.items()}
    unknown = [i for i in got if i not in token]
    if unknown:
        return f"{unknown[0]} is not a rank in `ranks`", "every id you return must be ranks[part] for a part"
    expected_parts = [token[i] for i in case.expected]
    got_parts = [token[i] for i in got]
    problem = f"expected the parts {short(expected_parts, 160)}, got {short(got_parts, 160)}"
    if b"".join(got_parts) != chunk:
        return problem, "the parts must join back to the input bytes: each merge joins two neighbouring parts"
    if any(left + right in ranks for left, right in zip(got_parts, got_parts[1:])):
        return problem, (
            "some adjacent parts still join into a token in `ranks`: keep merging until no "
            "adjacent pair's concatenation is in ranks"
        )
    return problem, case.hint or (
        "at each step merge the adjacent pair whose concatenation has the lowest rank "
        "(not the first pair you find, nor the longest token)"
    )


def check_bpe_encode_chunk(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """bpe_encode_chunk(chunk: bytes, ranks: {bytes: rank}) -> ranks of the parts, merging lowest rank first."""
    gpt2 = _gpt2_ranks()
    toy = _toy_ranks("aaabdaaabac", 3)
    corpus = _corpus()
    shakespeare = _toy_ranks(corpus, 60)
    order = "merge the pair with the lowest rank first, not the first pair that is in ranks"
    fixed = [
        ("an empty chunk", b"", gpt2, "no bytes, no tokens: return []"),
        ("one byte", b"a", gpt2, "a single byte is its own token: [ranks[b'a']]"),
        ("a common word with its space", b" the", gpt2, ""),
        ("a word that is one token", b"Hello", gpt2, ""),
        ("a word of several tokens", b" SolidGoldMagikarp", gpt2, order),
        ("a long word", b" incomprehensibilities", gpt2, order),
        ("a run of one letter", b"aaaaaaaaaaa", gpt2, "identical pairs merge left to right, one at a time"),
        ("digits", b"1234567", gpt2, ""),
        ("the 4 UTF-8 bytes of an emoji", "🦙".encode(), gpt2, "work on bytes: a chunk may split inside a character"),
        ("accented letters", " café".encode(), gpt2, ""),
        ("bytes that are not valid UTF-8", b"\xff\xfe\x80", gpt2, "every single byte is in ranks"),
        ("whitespace", b"\n\n\n", gpt2, ""),
        ("toy ranks: the classic example", b"aaabdaaabac", toy, order),
        ("toy ranks: a run", b"aaaaaaa", toy, order),
        ("toy ranks: nothing to merge", b"bcd", toy, ""),
        ("ranks trained on Antony's speech", b"honourable", shakespeare, order),
    ]
    cases = [Case(d, (chunk, ranks), bpe.bpe_encode_chunk(chunk, ranks), h) for d, chunk, ranks, h in fixed]
    rng = random.Random(seed)
    words = bpe.GPT2_SPLIT.findall(corpus)
    for i in range(n_random):
        kind = i % 5
        if kind == 0:
            chunk, ranks = rng.choice(words).encode(), gpt2
        elif kind == 1:
            chunk, ranks = _random_text(rng, 3).replace(EOT, "").encode(), gpt2
        elif kind == 2:
            chunk, ranks = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))), gpt2
        elif kind == 3:
            chunk, ranks = _corpus_slice(rng, 40).encode(), shakespeare
        else:  # a long chunk: several words run together
            chunk, ranks = "".join(rng.choice(words).strip() for _ in range(rng.randint(2, 5))).encode(), gpt2
        cases.append(Case(f"random chunk #{i}", (chunk, ranks), bpe.bpe_encode_chunk(chunk, ranks)))
    run_check(
        "bpe_encode_chunk",
        fn,
        cases,
        judge=_judge_encode_chunk,
        forbid=[*_engine("bpe_encode_chunk", "encode", instead="Write the merge loop yourself."), *NO_LIBRARIES],
        timeout_hint="look for a loop that never ends: does every step join two parts (the list gets "
        "shorter), and do you stop when no adjacent pair is in ranks?",
    )


# ----------------------------------------------------------------------------------------------
# GPT-2 encode and decode

HARD_TEXTS = [  # (description, text, hint for encode)
    ("an empty text", "", ""),
    ("two words", "Hello world", "each word is encoded separately, with its leading space"),
    ("a leading space", " hello", "the space belongs to the word after it: ' hello' is one chunk"),
    ("capitals", "HELLO Hello hello", ""),
    (
        "runs of spaces",
        "   leading and trailing spaces   ",
        "whitespace: the pattern \\s+(?!\\S) leaves the last space of a run to the next word; use "
        "regex.findall(GPT2_SPLIT_PATTERN, text), exactly",
    ),
    ("tabs and newlines", "tabs\tand\nnew\r\nlines\n\n\n", ""),
    (
        "a blank line between paragraphs",
        "line one\n\nline two",
        "the pattern \\s+(?!\\S) leaves the last whitespace character of a run to the next chunk",
    ),
    (
        "contractions",
        "I'm sure you've seen they'll, she'd, we're, it's, I'M, YOU'VE",
        "GPT-2's pattern splits off 's 't 're 've 'm 'll 'd (lower case only)",
    ),
    ("numbers", "1234567 + 2024 = 1236591; 3.14159, 1,000,000", ""),
    (
        "letters and digits beyond ASCII",
        "x² ١٢٣ Ⅻ ǅungla snake_case e\u0301",
        "GPT-2's pattern uses \\p{L} (any letter) and \\p{N} (any digit), not \\w or [a-zA-Z]: use "
        "regex.findall(GPT2_SPLIT_PATTERN, text), exactly",
    ),
    (
        "accents and dashes",
        "naïve café, Straße, Œuvre — “quoted”",
        "encode each chunk to UTF-8 bytes with chunk.encode('utf-8')",
    ),
    ("Chinese, Japanese, Korean", "中文分词测试，日本語のテキスト、한국어 텍스트", ""),
    ("emoji", "Emoji: 🦙🔥👨‍👩‍👧‍👦 ❤️ 🇫🇷", ""),
    ("code", "def f(x):\n    return x ** 2  # square\n", ""),
    ("the special token alone", EOT, f"split out {EOT} before the regex and give it the single id EOT_ID ({EOT_ID})"),
    ("the special token between documents", f"the end{EOT}new document", f"{EOT} becomes the single id {EOT_ID}"),
    ("two special tokens in a row", EOT + EOT, ""),
    ("almost the special token", "<|endoftext|", "only the exact string <|endoftext|> is special"),
    ("a long run of one letter", "a" * 100, ""),
]


def _without_presplit(text: str, ranks: dict) -> list[int]:
    """What encode gives if the regex pre-split is skipped (for the hint)."""
    ids = []
    for i, piece in enumerate(text.split(EOT)):
        if i:
            ids.append(EOT_ID)
        ids.extend(bpe.bpe_encode_chunk(piece.encode("utf-8"), ranks))
    return ids


def _judge_encode(case: Case, got: Any) -> Verdict:
    text, ranks = case.args
    expected = case.expected
    problem = _is_int_list(got)
    if problem:
        return problem, ""
    if got == expected:
        return None
    vocab = bpe.gpt2_vocab()
    if EOT_ID in expected and EOT_ID not in got:
        return (
            f"{EOT} should become the single id {EOT_ID}",
            f"split the text on {EOT} first (text.split(EOT)), encode the pieces in between, and put EOT_ID "
            "between them; ranks has no entry for it, it is a special token",
        )
    if got == _without_presplit(text, ranks):
        return (
            "these are the tokens of the whole text encoded as one chunk, without the regex pre-split",
            "pre-split first: regex.findall(GPT2_SPLIT_PATTERN, text), then bpe_encode_chunk on each piece's "
            "UTF-8 bytes. GPT-2's merges were learned on pre-split text; the pattern cuts, e.g., '\\n\\n' "
            "before a word into '\\n', '\\n'",
        )
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))

    def show(ids: list[int]) -> str:
        return f"{ids[at]} {vocab[ids[at]]!r}" if at < len(ids) and ids[at] in vocab else "nothing"

    return (
        f"first difference at token #{at}: expected {show(expected)}, got {show(got)}",
        case.hint or "print(regex.findall(GPT2_SPLIT_PATTERN, text)) and check each chunk with bpe_encode_chunk",
    )


def check_encode(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """encode(text, ranks) -> GPT-2's token ids: <|endoftext|> split out, regex pre-split, BPE on bytes."""
    ranks = _gpt2_ranks()
    cases = [Case(d, (text, ranks), bpe.encode(text, ranks=ranks), h) for d, text, h in HARD_TEXTS]
    rng = random.Random(seed)
    for i in range(n_random):
        text = _random_text(rng, 12) if i % 2 else _corpus_slice(rng, 200)
        cases.append(Case(f"random text #{i}", (text, ranks), bpe.encode(text, ranks=ranks)))
    run_check(
        "encode",
        fn,
        cases,
        judge=_judge_encode,
        forbid=[*_engine("encode", instead="Use your bpe_encode_chunk."), *NO_LIBRARIES],
        error_hints={
            "bad escape \\p": "Python's `re` does not know \\p{L}: use the `regex` module (import regex)",
            "KeyError": f"{EOT} is not in ranks: split it out first and give it the id EOT_ID",
        },
        timeout_hint="look for a loop that never ends (in your chunk loop or your bpe_encode_chunk)",
    )


DECODE_HINTS = {  # for decode's cases made from HARD_TEXTS: decode-specific hints
    "accents and dashes": "these characters are two or three UTF-8 bytes: join all the bytes, then decode as UTF-8",
    "Chinese, Japanese, Korean": "each character is three UTF-8 bytes, often split across tokens: join all the bytes "
    "first, then decode once",
    "emoji": "an emoji is four UTF-8 bytes, often split across tokens: join all the bytes first, then decode once",
    "letters and digits beyond ASCII": "join all the bytes first, then decode once as UTF-8",
    "the special token alone": f"vocab[{EOT_ID}] is b'{EOT}': look it up like any other token",
    "the special token between documents": f"vocab[{EOT_ID}] is b'{EOT}': look it up like any other token",
}


def _judge_decode(case: Case, got: Any) -> Verdict:
    ids, vocab = case.args
    expected = case.expected
    if not isinstance(got, str):
        return (
            f"expected a str, got a {type(got).__name__}",
            "join the tokens' bytes, then turn them into text with .decode('utf-8', errors='replace')",
        )
    if got == expected:
        return None
    data = b"".join(vocab[i] for i in ids)
    if got == data.decode("latin-1"):
        return (
            "this is the bytes decoded as Latin-1 (one character per byte)",
            "GPT-2's bytes are UTF-8: decode them with .decode('utf-8', errors='replace')",
        )
    if got == data.decode("utf-8", errors="ignore"):
        return (
            "bytes that are not valid UTF-8 were dropped",
            "errors='replace' turns each invalid sequence into '\\ufffd'; errors='ignore' drops it",
        )
    if got in (data.decode("utf-8", errors="backslashreplace"), data.decode("utf-8", errors="surrogateescape")):
        return "invalid bytes should become '\\ufffd'", "decode with errors='replace'"
    one_by_one = "".join(vocab[i].decode("utf-8", errors="replace") for i in ids)
    if got == one_by_one or ("\ufffd" in got and "\ufffd" not in expected):
        return (
            "broken characters (\ufffd) where the expected text has none",
            "join the bytes of all the tokens first, then decode once: a character can be split across "
            "tokens (🦙 is three tokens, and none of them is valid UTF-8 alone)",
        )
    if EOT in expected and EOT not in got:
        return f"{EOT} is missing", f"vocab[{EOT_ID}] is b'{EOT}': decode it like any other token"
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return (
        f"the texts differ from character #{at} on: expected {short(expected[at : at + 10], 40)}, "
        f"got {short(got[at : at + 10], 40)}",
        case.hint
        or "join the bytes of all the tokens (vocab[i] for each id), then decode once: "
        ".decode('utf-8', errors='replace')",
    )


def check_decode(fn, *, seed: int = 0, n_random: int = 20) -> None:
    """decode(ids, vocab: {id: bytes}) -> text: the tokens' bytes joined, decoded as UTF-8 with errors='replace'."""
    vocab = _gpt2_vocab()
    fixed = [(d, bpe.encode(text), DECODE_HINTS.get(d, "")) for d, text, _ in HARD_TEXTS if text]
    byte_ids = _byte_ids()
    fixed += [
        ("no tokens", [], "no tokens give ''"),
        ("the three tokens of 🦙", [8582, 99, 247], "decode the joined bytes, not each token alone"),
        ("half an emoji", [8582], "bytes that are not a whole character become '\\ufffd': errors='replace'"),
        ("bytes that are never valid UTF-8", [byte_ids[0xFF], 40], "decode with errors='replace'"),
        (
            "Latin-1 is not UTF-8",
            [byte_ids[0xE9], byte_ids[0x41]],
            "the byte 0xE9 alone is not 'é' in UTF-8: it is an unfinished character, '\\ufffd'",
        ),
    ]
    cases = [Case(d, (ids, vocab), bpe.decode(ids, vocab), h) for d, ids, h in fixed]
    rng = random.Random(seed)
    for i in range(n_random):
        ids = _random_stream(rng, i % 4)
        cases.append(Case(f"random ids #{i}", (ids, vocab), bpe.decode(ids, vocab)))
    run_check(
        "decode",
        fn,
        cases,
        judge=_judge_decode,
        forbid=[*_engine("decode", instead="Join the bytes from vocab yourself."), *NO_LIBRARIES],
        error_hints={
            "UnicodeDecodeError": "some byte sequences are not valid UTF-8 (half a character, stray "
            "bytes): decode with errors='replace'"
        },
        timeout_hint="look for a loop that never ends: one pass over the ids is enough",
    )


# ----------------------------------------------------------------------------------------------
# Streaming detokenizer


class _VocabTokenizer:
    """Lets the engine's StreamDecoder (written for a tiktoken.Encoding) read a plain vocab."""

    def __init__(self, vocab: dict[int, bytes]):
        self.vocab = vocab

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id]


def _engine_pieces(ids: list[int], vocab: dict[int, bytes]) -> list[str]:
    decoder = StreamDecoder(_VocabTokenizer(vocab))
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _unfinished(data: bytes) -> set[int]:
    """How many bytes at the end of `data` a stream decoder may hold back: those of an unfinished
    character. Two readings are right: the bytes that could still become a valid character (what
    Python's incremental decoder holds), and a lead byte 0b11xxxxxx followed by fewer continuation
    bytes 0b10xxxxxx than it announces (what a decoder that reads the lead byte holds)."""
    valid = 0
    for t in (3, 2, 1):
        if len(data) >= t:
            try:
                data[-t:].decode("utf-8")
            except UnicodeDecodeError as err:
                if err.start == 0 and err.end == t and err.reason == "unexpected end of data":
                    valid = t
                    break
    announced = 0
    for t in (1, 2, 3):
        if len(data) < t:
            break
        byte = data[-t]
        if byte >> 6 == 0b10:
            continue
        if byte >> 6 == 0b11:
            size = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            announced = t if t < size else 0
        break
    return {valid, announced}


def _judge_stream(case: Case, got: Any) -> Verdict:
    """After each push, the text so far is everything received, decoded with errors='replace', except an
    unfinished character at the end (see `_unfinished`); after flush(), all of it."""
    ids, vocab = case.args
    for k, piece in enumerate(got):
        if not isinstance(piece, str):
            call = f"d.push({ids[k]})" if k < len(ids) else "d.flush()"
            return (
                f"{call} returned a {type(piece).__name__}",
                "return a str every time ('' when nothing is complete yet)",
            )
    received, so_far = b"", ""
    for k, piece in enumerate(got):
        so_far += piece
        if k < len(ids):
            received += vocab[ids[k]]
            allowed = [
                received[: len(received) - t].decode("utf-8", errors="replace") for t in sorted(_unfinished(received))
            ]
            call = f"d.push({ids[k]}) (its bytes {vocab[ids[k]]!r})"
        else:
            allowed = [received.decode("utf-8", errors="replace")]
            call = "d.flush()"
        if so_far in allowed:
            continue
        shown = " or ".join(short(a, 120) for a in dict.fromkeys(allowed))
        problem = f"after {call} the text so far should be {shown}, got {short(so_far, 120)}"
        if k == len(ids):
            return problem, (
                "all the pieces together should equal decoding the whole stream at once, "
                "b''.join(bytes).decode('utf-8', errors='replace'): at flush(), decode what is left "
                "with errors='replace'"
            )
        if len(so_far) > max(len(a) for a in allowed) or any(so_far.startswith(a) for a in allowed):
            return problem, (
                "you emitted half a character: if the bytes end inside a character (a lead byte "
                "0b11xxxxxx whose continuation bytes 0b10xxxxxx have not all arrived), keep those "
                "bytes for the next push"
            )
        if not _is_utf8(received[: len(received) - max(_unfinished(received))]):
            return problem, (
                "bytes that can never be part of a character (here in "
                f"{short(received[-12:], 60)}) must not hold the stream up: emit them as '\\ufffd' at "
                "once, with the text around them; hold back only an unfinished character at the very end"
            )
        return problem, (
            "you held back text that was already complete: emit everything up to the start of "
            "the last, unfinished character"
        )
    return None


def check_stream_decoder(cls, *, seed: int = 0, n_random: int = 20) -> None:
    """StreamDecoder(vocab): push(token_id) -> newly complete text, flush() -> the rest; never half a character."""
    if not callable(cls):
        raise CheckFailed(f"✗ StreamDecoder: expected a class, got {short(cls)}")
    vocab = _gpt2_vocab()

    def stream(ids: list[int], vocab: dict[int, bytes]) -> list[Any]:
        decoder = cls(vocab)
        return [decoder.push(i) for i in ids] + [decoder.flush()]

    def show(args: tuple) -> str:
        ids = args[0]
        pushes = [f"d.push({i})" for i in ids[:24]] + ([f"... ({len(ids) - 24} more d.push)"] if len(ids) > 24 else [])
        return "; ".join(["d = StreamDecoder(vocab)", *pushes, "d.flush()"])

    ranks = bpe.gpt2_ranks()
    byte_ids = _byte_ids()
    texts = [
        ("Hello world", ""),
        ("🦙", "🦙 is three tokens: b'\\xf0\\x9f', b'\\xa6', b'\\x99'"),
        ("I ❤ 🦙", ""),
        ("naïve café", ""),
        ("中文分词", ""),
        ("👨‍👩‍👧‍👦 family", ""),
        ("a\nb  c", ""),
        (EOT + "x", ""),
    ]
    fixed = [(f"push the ids of {text!r}, then flush()", bpe.encode(text), h) for text, h in texts]
    never = "a byte that is never valid UTF-8 becomes '\\ufffd' at once: it must not hold up the text after it"
    fixed += [
        ("no tokens, only flush()", [], "flush() with nothing left returns ''"),
        (
            "the stream ends inside an emoji",
            [40, 8582, 99],
            "at flush(), the unfinished character becomes '\\ufffd' (decode the rest with errors='replace')",
        ),
        ("a byte that is never valid UTF-8", [40, ranks[b"\xff"], 40, 41, 42], never),
        ("a stray continuation byte", [40, ranks[b"\xa6"], 40, 41], never),
        ("a lead byte followed by plain text", [ranks[b"\xe2"], 40, 41], never),
        ("an invalid byte, then a whole emoji", [byte_ids[0xFF], 8582, 99, 247, 40], never),
        ("half an emoji, then plain text", [8582, 40, 41, 42], never),
    ]
    cases = [Case(d, (ids, vocab), _engine_pieces(ids, vocab), h) for d, ids, h in fixed]
    rng = random.Random(seed)
    for i in range(n_random):
        ids = _random_stream(rng, i % 4)
        cases.append(Case(f"random stream #{i}", (ids, vocab), _engine_pieces(ids, vocab)))
    incremental = "Find where the last complete character ends yourself."
    forbid = [
        Forbidden("codecs.getincrementaldecoder", incremental),
        Forbidden("codecs.iterdecode", incremental),
        Forbidden(
            "codecs.BufferedIncrementalDecoder", incremental
        ),  # codecs.lookup(...).incrementaldecoder, io.TextIOWrapper
        Forbidden("codecs.IncrementalDecoder", incremental),
        Forbidden("codecs.StreamReader", incremental),
        Forbidden("codecs.utf_8_decode", "Use bytes.decode on the complete part only."),
        Forbidden("llmcourse.engine.tokenizer.StreamDecoder", "Write your own."),
        *NO_LIBRARIES,
    ]
    run_check(
        "StreamDecoder",
        stream,
        cases,
        judge=_judge_stream,
        forbid=forbid,
        show_call=show,
        timeout_hint="look for a loop that never ends, e.g. one that looks for the start of the last character "
        "but never moves back (at most 3 bytes back)",
    )
