"""Chapter 01's checks: the engine's reference passes, stubs and plausible mistakes fail with a
message that says what is wrong, other correct ways of writing each exercise pass, black boxes and
endless loops are stopped."""

import codecs
import sys
from codecs import getincrementaldecoder as incremental_decoder_imported_early
from collections import Counter, defaultdict
from encodings.utf_8 import IncrementalDecoder as Utf8IncrementalDecoder

import pytest
import regex

import llmcourse.engine.tokenizer
from llmcourse import get_tokenizer
from llmcourse.checks import (
    CheckFailed,
    check_bpe_encode_chunk,
    check_bytes_to_unicode,
    check_decode,
    check_encode,
    check_get_pair_counts,
    check_merge,
    check_stream_decoder,
    check_train_bpe,
)
from llmcourse.course import bpe
from llmcourse.course.bpe import merge as engine_merge_imported_early
from llmcourse.engine.bpe_training import BPETokenizer
from llmcourse.engine.bpe_training import train_bpe as fast_trainer
from llmcourse.engine.tokenizer import EOT, EOT_ID, GPT2_SPLIT_PATTERN, StreamDecoder, bytes_to_unicode
from llmcourse.engine.tokenizer import bytes_to_unicode as engine_table_imported_early

tokenizers = pytest.importorskip("tokenizers")  # Hugging Face's (a dependency of transformers): a black box too


# -- the chapter's solutions, as a learner writes them (a copy of the engine's own source is its black box) -----


def get_pair_counts(ids):
    counts = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text, num_merges):
    ids, merges = list(text.encode("utf-8")), {}
    for new_id in range(256, 256 + num_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = max(counts, key=counts.get)
        ids, merges[pair] = merge(ids, pair, new_id), new_id
    return merges


def printable_bytes_first():
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def bpe_encode_chunk(chunk, ranks):
    parts = [bytes([b]) for b in chunk]
    while len(parts) > 1:
        joined = [left + right for left, right in zip(parts, parts[1:])]
        best = min(range(len(joined)), key=lambda i: ranks.get(joined[i], float("inf")))
        if joined[best] not in ranks:
            break
        parts[best : best + 2] = [joined[best]]
    return [ranks[part] for part in parts]


def encode(text, ranks):
    ids = []
    for n, piece in enumerate(text.split(EOT)):
        if n > 0:
            ids.append(EOT_ID)
        for chunk in regex.findall(GPT2_SPLIT_PATTERN, piece):
            ids.extend(bpe_encode_chunk(chunk.encode("utf-8"), ranks))
    return ids


def decode(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


class ManualStreamDecoder:
    """A correct stream decoder written the way the chapter asks (no incremental decoder)."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.buffer = b""

    def push(self, token_id):
        self.buffer += self.vocab[token_id]
        cut = len(self.buffer)
        for back in range(1, min(4, len(self.buffer)) + 1):
            byte = self.buffer[-back]
            if byte >> 6 != 0b10:  # the last character starts here
                need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
                if need > back:
                    cut = len(self.buffer) - back
                break
        text, self.buffer = self.buffer[:cut].decode("utf-8", errors="replace"), self.buffer[cut:]
        return text

    def flush(self):
        text, self.buffer = self.buffer.decode("utf-8", errors="replace"), b""
        return text


REFERENCES = [
    (check_get_pair_counts, get_pair_counts),
    (check_merge, merge),
    (check_train_bpe, train_bpe),
    (check_bytes_to_unicode, printable_bytes_first),
    (check_bpe_encode_chunk, bpe_encode_chunk),
    (check_encode, encode),
    (check_decode, decode),
    (check_stream_decoder, ManualStreamDecoder),
]
IDS = [check.__name__ for check, _ in REFERENCES]


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, capsys):
    check(reference)
    check(reference, seed=7, n_random=60)
    assert capsys.readouterr().out.count("✓") == 2


def stub(*args):
    raise NotImplementedError()


class StubStreamDecoder:
    def __init__(self, vocab):
        raise NotImplementedError()


@pytest.mark.parametrize("check, reference", REFERENCES, ids=IDS)
def test_stub_is_not_written_yet(check, reference):
    fn = StubStreamDecoder if check is check_stream_decoder else stub
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(fn)


# -- plausible mistakes, each rejected with a message that names it -------------------------------


def pair_counts_missing_last(ids):
    counts = {}
    for i in range(len(ids) - 2):  # off by one
        counts[ids[i], ids[i + 1]] = counts.get((ids[i], ids[i + 1]), 0) + 1
    return counts


def pair_counts_without_overlaps(ids):
    counts, i = {}, 0
    while i < len(ids) - 1:
        pair = (ids[i], ids[i + 1])
        counts[pair] = counts.get(pair, 0) + 1
        i += 2 if ids[i] == ids[i + 1] else 1  # skips the overlapping copy, as merge does
    return counts


def pair_counts_sorted(ids):
    return dict(sorted(Counter(zip(ids, ids[1:])).items()))


def merge_overlapping(ids, pair, new_id):
    out = []
    for i in range(len(ids)):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)  # even when ids[i] was already used by the previous merge
        elif i == 0 or (ids[i - 1], ids[i]) != pair:
            out.append(ids[i])
    return out


def merge_as_tuple(ids, pair, new_id):
    return tuple(merge_with_flag(ids, pair, new_id))


def merge_right_to_left(ids, pair, new_id):
    return merge_with_flag(ids[::-1], pair[::-1], new_id)[::-1]


def train_ties_by_smallest_pair(text, num_merges):
    ids, merges = list(text.encode()), {}
    for new_id in range(256, 256 + num_merges):
        counts = bpe.get_pair_counts(ids)
        if not counts:
            break
        pair = max(sorted(counts), key=counts.get)  # ties go to the smallest pair, not the first one
        ids, merges[pair] = bpe.merge(ids, pair, new_id), new_id
    return merges


def _train_with_tie_rule(text, num_merges, choose):
    """train_bpe with `choose(counts)` picking the pair to merge."""
    ids, merges = list(text.encode()), {}
    for new_id in range(256, 256 + num_merges):
        counts = bpe.get_pair_counts(ids)
        if not counts:
            break
        pair = choose(counts, bpe.build_vocab(merges))
        ids, merges[pair] = bpe.merge(ids, pair, new_id), new_id
    return merges


def train_ties_by_greatest_bytes(text, num_merges):  # Stanford CS336's rule
    return _train_with_tie_rule(
        text, num_merges, lambda counts, vocab: max(counts, key=lambda p: (counts[p], vocab[p[0]], vocab[p[1]]))
    )


def train_ties_by_greatest_pair(text, num_merges):
    return _train_with_tie_rule(text, num_merges, lambda counts, vocab: max(counts, key=lambda p: (counts[p], p)))


def train_ties_by_last_seen(text, num_merges):
    def choose(counts, vocab):
        best, pair = 0, None
        for candidate, count in counts.items():
            if count >= best:  # >= keeps the last of equal counts
                best, pair = count, candidate
        return pair

    return _train_with_tie_rule(text, num_merges, choose)


def train_stops_at_count_one(text, num_merges):
    ids, merges = list(text.encode()), {}
    for new_id in range(256, 256 + num_merges):
        counts = bpe.get_pair_counts(ids)
        if not counts or max(counts.values()) < 2:
            break
        pair = max(counts, key=counts.get)
        ids, merges[pair] = bpe.merge(ids, pair, new_id), new_id
    return merges


def train_without_applying_merges(text, num_merges):
    ids, merges = list(text.encode()), {}
    counts = bpe.get_pair_counts(ids)  # counted once, never recounted
    for new_id, pair in zip(range(256, 256 + num_merges), sorted(counts, key=counts.get, reverse=True)):
        merges[pair] = new_id
    return merges


def chunk_first_pair_in_ranks(chunk, ranks):
    parts = [bytes([b]) for b in chunk]
    merged = True
    while merged:
        merged = False
        for i in range(len(parts) - 1):
            if parts[i] + parts[i + 1] in ranks:  # the first pair found, not the lowest rank
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
                merged = True
                break
    return [ranks[p] for p in parts]


def chunk_returns_parts(chunk, ranks):
    token = {rank: part for part, rank in ranks.items()}
    return [token[i] for i in chunk_merging_every_occurrence(chunk, ranks)]


def encode_without_presplit(text, ranks):
    ids = []
    for i, piece in enumerate(text.split(EOT)):
        ids += [EOT_ID] * (i > 0) + bpe.bpe_encode_chunk(piece.encode(), ranks)
    return ids


def encode_forgetting_special(text, ranks):
    return [i for chunk in regex.findall(GPT2_SPLIT_PATTERN, text) for i in bpe.bpe_encode_chunk(chunk.encode(), ranks)]


def encode_with_re(text, ranks):
    import re

    return [i for chunk in re.findall(GPT2_SPLIT_PATTERN, text) for i in bpe.bpe_encode_chunk(chunk.encode(), ranks)]


def decode_token_by_token(ids, vocab):
    return "".join(vocab[i].decode("utf-8", errors="replace") for i in ids)


def decode_strict(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("utf-8")


def decode_to_bytes(ids, vocab):
    return b"".join(vocab[i] for i in ids)


class TokenByTokenStreamDecoder(ManualStreamDecoder):
    def push(self, token_id):
        return self.vocab[token_id].decode("utf-8", errors="replace")  # emits half characters


class SilentStreamDecoder(ManualStreamDecoder):
    def push(self, token_id):
        self.buffer += self.vocab[token_id]
        return ""  # correct in the end, but streams nothing


class StreamDecoderReturningBytes(ManualStreamDecoder):
    def push(self, token_id):
        return super().push(token_id).encode()


def bytes_to_unicode_in_byte_order():
    table, n = {}, 0
    for b in range(256):  # right characters, but the keys in byte order
        printable = 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
        table[b] = chr(b) if printable else chr(256 + n)
        n += not printable
    return table


def bytes_to_unicode_offset_by_256():
    return {b: chr(b) if chr(b).isprintable() and b != 32 and b < 127 else chr(256 + b) for b in range(256)}


MISTAKES = [
    (check_get_pair_counts, pair_counts_missing_last, r"the pair \(\d+, \d+\) \(count \d\) is missing|one step early"),
    (check_get_pair_counts, pair_counts_without_overlaps, r"should have count 2, got 1[\s\S]*overlapping"),
    (check_get_pair_counts, pair_counts_sorted, r"different order[\s\S]*first occur"),
    (check_merge, merge_overlapping, r"overlapping pairs \[1, 1, 1\][\s\S]*got:      \[9, 9\][\s\S]*without overlaps"),
    (check_merge, merge_as_tuple, r"expected a list, got a tuple"),
    (check_merge, merge_right_to_left, r"right length, wrong ids[\s\S]*left to right"),
    (check_train_bpe, train_ties_by_smallest_pair, r"a tie: 2 pairs occur 2 times, and you took the smallest pair"),
    (check_train_bpe, train_ties_by_greatest_bytes, r"a tie: 3 pairs occur 1 time, [\s\S]*bytes \(CS336's rule\)"),
    (
        check_train_bpe,
        train_ties_by_greatest_pair,
        r"a tie: \d+ pairs occur \d+ times?, and you took the greatest pair",
    ),
    (check_train_bpe, train_ties_by_last_seen, r"a tie: \d+ pairs[\s\S]*or the last of them to occur \(a loop with >="),
    (check_train_bpe, train_stops_at_count_one, r"even a pair that occurs only once"),
    (
        check_train_bpe,
        train_without_applying_merges,
        r"none of your merges uses a merged id[\s\S]*count the pairs again",
    ),
    (check_bpe_encode_chunk, chunk_first_pair_in_ranks, r"expected the parts[\s\S]*lowest rank"),
    (check_bpe_encode_chunk, chunk_returns_parts, r"item 0 should be an int[\s\S]*not the parts"),
    (check_encode, encode_without_presplit, r"a blank line[\s\S]*without the regex pre-split[\s\S]*GPT2_SPLIT_PATTERN"),
    (check_encode, encode_forgetting_special, r"<\|endoftext\|> should become the single id 50256"),
    (check_encode, encode_with_re, r"bad escape[\s\S]*use the `regex` module"),
    (check_decode, decode_token_by_token, r"split across tokens"),
    (check_decode, decode_strict, r"raised UnicodeDecodeError[\s\S]*errors='replace'"),
    (check_decode, decode_to_bytes, r"expected a str, got a bytes"),
    (check_stream_decoder, TokenByTokenStreamDecoder, r"'🦙'[\s\S]*emitted half a character"),
    (check_stream_decoder, SilentStreamDecoder, r"held back text that was already complete"),
    (check_stream_decoder, StreamDecoderReturningBytes, r"push\(\d+\) returned a bytes"),
    (
        check_bytes_to_unicode,
        bytes_to_unicode_in_byte_order,
        r"order of the table[\s\S]*entry #0 is byte 0, expected byte 33",
    ),
    (
        check_bytes_to_unicode,
        bytes_to_unicode_offset_by_256,
        r"byte 127[\s\S]*expected: 'ġ'[\s\S]*chr\(256\), chr\(257\)",
    ),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[w.__name__ for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed, match=message) as caught:
        check(wrong)
    text = str(caught.value)
    if "raised" not in text:  # a wrong answer (not an error) shows input, expected and got
        assert "input:" in text and "expected:" in text and "got:" in text


# -- correct, but written differently -----------------------------------------------------------


def pair_counts_with_counter(ids):
    return Counter(zip(ids, ids[1:]))


def train_with_a_strict_loop(text, num_merges):
    def first_of_the_most_frequent(counts, vocab):
        best, pair = 0, None
        for candidate, count in counts.items():
            if count > best:  # > keeps the first of equal counts
                best, pair = count, candidate
        return pair

    return _train_with_tie_rule(text, num_merges, first_of_the_most_frequent)


def merge_with_flag(ids, pair, new_id):
    out, skip = [], False
    for i, current in enumerate(ids):
        if skip:
            skip = False
        elif tuple(ids[i : i + 2]) == pair:
            out.append(new_id)
            skip = True
        else:
            out.append(current)
    return out


def train_with_most_common(text, num_merges):
    ids, merges = list(text.encode("utf-8")), {}
    for new_id in range(256, 256 + num_merges):
        counts = Counter(zip(ids, ids[1:]))
        if not counts:
            break
        ((pair, _),) = counts.most_common(1)  # equal counts come out in order of first occurrence
        ids, merges[pair] = merge_with_flag(ids, pair, new_id), new_id
    return merges


def chunk_merging_every_occurrence(chunk, ranks):
    """minbpe's way: find the lowest-ranked pair, merge all its occurrences at once."""
    parts = [bytes([b]) for b in chunk]
    while len(parts) > 1:
        pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p[0] + p[1], float("inf")))
        if pair[0] + pair[1] not in ranks:
            break
        out, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                out.append(parts[i] + parts[i + 1])
                i += 2
            else:
                out.append(parts[i])
                i += 1
        parts = out
    return [ranks[p] for p in parts]


def encode_with_regex_split(text, ranks):
    ids = []
    for piece in regex.split(f"({regex.escape(EOT)})", text):
        if piece == EOT:
            ids.append(EOT_ID)
        else:
            for chunk in regex.finditer(GPT2_SPLIT_PATTERN, piece):
                ids.extend(chunk_merging_every_occurrence(chunk.group().encode(), ranks))
    return ids


def decode_with_bytearray(ids, vocab):
    data = bytearray()
    for i in ids:
        data.extend(vocab[i])
    return bytes(data).decode("utf-8", "replace")


def gpt2_original_bytes_to_unicode():
    """As in OpenAI's encoder.py."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(n) for n in cs]))


def pair_counts_with_defaultdict(ids):
    counts = defaultdict(int)
    for i in range(len(ids) - 1):
        counts[ids[i], ids[i + 1]] += 1
    return counts


def merge_with_slices(ids, pair, new_id):
    out, rest = [], list(ids)
    while rest:
        if len(rest) > 1 and rest[0] == pair[0] and rest[1] == pair[1]:
            out.append(new_id)
            rest = rest[2:]
        else:
            out.append(rest[0])
            rest = rest[1:]
    return out


class TryDecodeStreamDecoder:
    """Holds back only bytes that could still become a valid character (Python's own notion): asks
    bytes.decode where the unfinished character starts."""

    def __init__(self, vocab):
        self.vocab, self.pending = vocab, b""

    def push(self, token_id):
        self.pending += self.vocab[token_id]
        keep = 0
        for size in (3, 2, 1):
            tail = self.pending[-size:]
            if len(self.pending) >= size:
                try:
                    tail.decode("utf-8")
                except UnicodeDecodeError as err:
                    if err.start == 0 and err.reason == "unexpected end of data":
                        keep = size
                        break
        cut = len(self.pending) - keep
        text, self.pending = self.pending[:cut].decode("utf-8", "replace"), self.pending[cut:]
        return text

    def flush(self):
        text, self.pending = self.pending.decode("utf-8", "replace"), b""
        return text


ALTERNATIVES = [
    (check_get_pair_counts, pair_counts_with_defaultdict),
    (check_merge, merge_with_slices),
    (check_stream_decoder, TryDecodeStreamDecoder),
    (check_get_pair_counts, pair_counts_with_counter),
    (check_merge, merge_with_flag),
    (check_train_bpe, train_with_most_common),
    (check_train_bpe, train_with_a_strict_loop),
    (check_bytes_to_unicode, gpt2_original_bytes_to_unicode),
    (check_bpe_encode_chunk, chunk_merging_every_occurrence),
    (check_encode, encode_with_regex_split),
    (check_decode, decode_with_bytearray),
]


@pytest.mark.parametrize("check, alternative", ALTERNATIVES, ids=[a.__name__ for _, a in ALTERNATIVES])
def test_correct_alternative_passes(check, alternative):
    check(alternative)
    check(alternative, seed=3, n_random=150)


# -- order that the exercise fixes ---------------------------------------------------------------


def train_sorted_by_pair(text, num_merges):
    return dict(sorted(train_with_most_common(text, num_merges).items()))  # the right merges, sorted: wrong order


def train_sorted_by_new_id_descending(text, num_merges):
    return dict(sorted(train_with_most_common(text, num_merges).items(), key=lambda item: -item[1]))


def pair_counts_most_common_first(ids):
    return dict(Counter(zip(ids, ids[1:])).most_common())


# -- right on small ids only: wide random inputs tell them apart ---------------------------------


def merge_by_text(ids, pair, new_id):  # "1, 2" is also found inside "11, 2"
    text = str(ids).replace(f"{pair[0]}, {pair[1]}", str(new_id))
    return [int(x) for x in text.strip("[]").split(",") if x.strip()]


def pair_counts_by_text(ids):  # counts "1 2" inside "11 2" as well
    text = " " + " ".join(map(str, ids)) + " "
    counts = {}
    for a, b in zip(ids, ids[1:]):
        counts[(a, b)] = text.count(f"{a} {b} ") if a != b else counts.get((a, b), 0) + 1
    return counts


def train_on_characters(text, num_merges):
    ids, merges = [ord(c) for c in text], {}  # characters, not UTF-8 bytes
    for new_id in range(256, 256 + num_merges):
        counts = Counter(zip(ids, ids[1:]))
        if not counts:
            break
        ((pair, _),) = counts.most_common(1)
        ids, merges[pair] = merge_with_flag(ids, pair, new_id), new_id
    return merges


def decode_latin1(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("latin-1")


def decode_ignoring_errors(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="ignore")


def encode_with_w(text, ranks):  # \w and \d instead of \p{L} and \p{N}: right on ASCII words
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"""
    ids = []
    for n, piece in enumerate(text.split(EOT)):
        ids += [EOT_ID] * (n > 0)
        for chunk in regex.findall(pattern, piece):
            ids += chunk_merging_every_occurrence(chunk.encode(), ranks)
    return ids


# -- streaming: what each push returns, invalid bytes included ------------------------------------


class StreamDecoderStuckAfterInvalidByte(ManualStreamDecoder):
    """Right on valid UTF-8; after a byte that is never valid it returns '' until flush()."""

    def push(self, token_id):
        before = self.buffer
        text = super().push(token_id)
        if "\ufffd" in text:  # an invalid byte: wait, flush() will replace it
            self.buffer = before + self.vocab[token_id]
            return ""
        return text


class StreamDecoderDroppingInvalidBytes(ManualStreamDecoder):
    def push(self, token_id):
        return super().push(token_id).replace("\ufffd", "")


class StreamDecoderReplacingTooEarly(ManualStreamDecoder):
    """Emits '\ufffd' for an unfinished character at every push instead of waiting."""

    def push(self, token_id):
        self.buffer += self.vocab[token_id]
        valid = self.buffer.decode("utf-8", errors="ignore").encode("utf-8")
        if self.buffer.startswith(valid) and len(self.buffer) - len(valid) < 4 and valid:
            text, self.buffer = valid.decode(), self.buffer[len(valid) :]
            return text
        text, self.buffer = self.buffer.decode("utf-8", errors="replace"), b""
        return text


# -- changes its input ----------------------------------------------------------------------------


def merge_in_place(ids, pair, new_id):
    i = 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            ids[i : i + 2] = [new_id]  # the caller's list
        i += 1
    return ids


def pair_counts_consuming_ids(ids):
    counts = {}
    while len(ids) > 1:
        left = ids.pop(0)
        counts[left, ids[0]] = counts.get((left, ids[0]), 0) + 1
    return counts


def encode_adding_the_special_token_to_ranks(text, ranks):
    ranks[EOT.encode()] = EOT_ID  # so that bpe_encode_chunk "knows" it: but ranks is the caller's
    return encode_with_regex_split(text, ranks)


class StreamDecoderHidingTheSpecialToken(ManualStreamDecoder):
    def __init__(self, vocab):
        vocab[EOT_ID] = b""  # "don't print <|endoftext|>": but vocab is the caller's
        super().__init__(vocab)


NEAR_MISSES = [
    (check_train_bpe, train_sorted_by_pair, r"the right merges, but in a different order[\s\S]*don't sort"),
    (check_train_bpe, train_sorted_by_new_id_descending, r"different order"),
    (check_get_pair_counts, pair_counts_most_common_first, r"different order"),
    (check_merge, merge_by_text, r"ids whose digits run together[\s\S]*compare ids, not their text"),
    (
        check_get_pair_counts,
        pair_counts_by_text,
        r"ids whose digits run together: the pair \(1, 2\) should have count 1, got 2[\s\S]*not pieces of their text",
    ),
    (check_train_bpe, train_on_characters, r"non-ASCII[\s\S]*hint: train on the UTF-8 bytes"),
    (check_decode, decode_latin1, r"Latin-1[\s\S]*hint: [\s\S]*\.decode\('utf-8', errors='replace'\)"),
    (check_decode, decode_ignoring_errors, r"were dropped[\s\S]*errors='ignore' drops it"),
    (check_encode, encode_with_w, r"beyond ASCII[\s\S]*\\p\{L\}"),
    (
        check_stream_decoder,
        StreamDecoderStuckAfterInvalidByte,
        r"after d\.push\(\d+\) \(its bytes b'\\xff'\)[\s\S]*must not hold the stream up",
    ),
    (check_stream_decoder, StreamDecoderDroppingInvalidBytes, r"text so far should be"),
    (check_stream_decoder, StreamDecoderReplacingTooEarly, r"emitted half a character"),
    (check_merge, merge_in_place, r"changed its input `ids`[\s\S]*before the call: \[[\s\S]*build a new list"),
    (check_get_pair_counts, pair_counts_consuming_ids, r"changed its input `ids`"),
    (check_encode, encode_adding_the_special_token_to_ranks, r"changed its input `ranks`[\s\S]*copy it first"),
    (check_stream_decoder, StreamDecoderHidingTheSpecialToken, r"changed its input `vocab`"),
]


@pytest.mark.parametrize("check, wrong, message", NEAR_MISSES, ids=[w.__name__ for _, w, _ in NEAR_MISSES])
def test_near_miss_is_rejected(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


FIVE_PAIR_TIE = "xyxaxy xaaby xaab y"  # a fixed case of check_train_bpe


@pytest.mark.parametrize(
    "wrong, rule",
    [
        (train_ties_by_smallest_pair, "the smallest pair of ids or the lexicographically smallest pair of bytes."),
        (train_ties_by_greatest_pair, "the greatest pair of ids."),
        (train_ties_by_greatest_bytes, "the lexicographically greatest pair of bytes (CS336's rule)."),
        (train_ties_by_last_seen, "the last of them to occur (a loop with >= keeps the last of equal counts)."),
    ],
)
def test_each_tie_rule_is_named_alone_where_five_pairs_tie(wrong, rule):
    def right_but_there(text, num_merges):
        return (wrong if text == FIVE_PAIR_TIE else train_with_a_strict_loop)(text, num_merges)

    with pytest.raises(CheckFailed, match=r"a tie among five pairs") as caught:
        check_train_bpe(right_but_there)
    assert f"a tie: 5 pairs occur 2 times, and you took {rule}" in str(caught.value)


def test_only_the_decode_hints_are_shown_for_decode():
    with pytest.raises(CheckFailed) as caught:
        check_decode(decode_latin1)
    assert "encode each chunk" not in str(caught.value)


def test_the_case_hint_and_the_diagnosis_are_both_shown():
    with pytest.raises(CheckFailed) as caught:
        check_train_bpe(train_on_characters)
    hints = [line for line in str(caught.value).splitlines() if line.strip().startswith("hint:")]
    assert len(hints) >= 1 and any("UTF-8 bytes" in h for h in hints)


def test_a_stream_is_shown_as_the_calls_it_makes():
    with pytest.raises(CheckFailed, match=r"input:    d = StreamDecoder\(vocab\); d\.push\(\d+\); .*d\.flush\(\)"):
        check_stream_decoder(TokenByTokenStreamDecoder)


def test_long_values_are_shortened_in_messages():
    def zeros(ids, vocab):
        return "\x00" * 5000

    with pytest.raises(CheckFailed) as caught:
        check_decode(zeros)
    text = str(caught.value)
    assert "'\\x00' * 5000" in text and len(text) < 1500


# -- black boxes, however they are reached ------------------------------------------------------

TOKENIZER = get_tokenizer()


class IncrementalStreamDecoder:
    def __init__(self, vocab):
        self.vocab = vocab
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        return self.utf8.decode(self.vocab[token_id])

    def flush(self):
        return self.utf8.decode(b"", final=True)


class AliasedIncrementalStreamDecoder(IncrementalStreamDecoder):
    def __init__(self, vocab):
        self.vocab = vocab
        self.utf8 = incremental_decoder_imported_early("utf-8")(errors="replace")


class LookupStreamDecoder(IncrementalStreamDecoder):
    def __init__(self, vocab):
        self.vocab = vocab
        self.utf8 = codecs.lookup("utf-8").incrementaldecoder(errors="replace")


class EncodingsStreamDecoder(IncrementalStreamDecoder):
    def __init__(self, vocab):
        self.vocab = vocab
        self.utf8 = Utf8IncrementalDecoder(errors="replace")


class RawCodecStreamDecoder(ManualStreamDecoder):
    def push(self, token_id):
        self.buffer += self.vocab[token_id]
        text, used = codecs.utf_8_decode(self.buffer, "replace", False)  # the incremental decoder's core
        self.buffer = self.buffer[used:]
        return text


class EngineStreamDecoder:
    """The engine's own StreamDecoder behind the exercise's interface."""

    def __init__(self, vocab):
        self.inner = StreamDecoder(type("Vocab", (), {"decode_single_token_bytes": lambda _, i: vocab[i]})())

    def push(self, token_id):
        return self.inner.push(token_id)

    def flush(self):
        return self.inner.flush()


class SubclassedEngineStreamDecoder(llmcourse.engine.tokenizer.StreamDecoder):
    """The engine's decoder under another name."""

    def __init__(self, vocab):
        super().__init__(type("Vocab", (), {"decode_single_token_bytes": lambda _, i: vocab[i]})())


def tokenizers_byte_level():
    from tokenizers.pre_tokenizers import ByteLevel  # imported before the check (at the top of this file)

    return ByteLevel


class DecodeStreamDecoder:
    """Hugging Face's streaming decoder (imported before the check, as a notebook would)."""

    def __init__(self, vocab):
        from tokenizers.decoders import DecodeStream  # imported before the check (at the top of this file)

        self.stream = DecodeStream(skip_special_tokens=False)

    def push(self, token_id):
        return self.stream.step(None, token_id) or ""

    def flush(self):
        return ""


def encode_with_the_engines_bpe_tokenizer(text, ranks):
    merges = {}  # GPT-2's ranks as merges: every token of 2+ bytes joins its two parts of lower rank
    token_of = {rank: token for token, rank in ranks.items()}
    for rank in sorted(token_of):
        token = token_of[rank]
        if len(token) > 1:
            for cut in range(1, len(token)):
                if token[:cut] in ranks and token[cut:] in ranks:
                    merges[ranks[token[:cut]], ranks[token[cut:]]] = rank
                    break
    return BPETokenizer(merges, GPT2_SPLIT_PATTERN).encode(text)


BLACK_BOXES = [
    (
        check_encode,
        lambda text, ranks: TOKENIZER.encode(text, allowed_special="all"),
        r"called tiktoken\.core\.Encoding\.encode \(part of tiktoken\)",
    ),
    (check_encode, lambda text, ranks: TOKENIZER._core_bpe.encode(text, {EOT}), r"called CoreBPE\.encode"),
    (
        check_encode,
        lambda text, ranks: sys.modules["tiktoken.core"].Encoding.encode(TOKENIZER, text, allowed_special="all"),
        r"called tiktoken\.core\.Encoding\.encode",
    ),
    (check_decode, lambda ids, vocab: TOKENIZER.decode(ids), r"called tiktoken\.core\.Encoding\.decode\b"),
    (
        check_decode,
        lambda ids, vocab: TOKENIZER.decode_bytes(ids).decode("utf-8", "replace"),
        r"called tiktoken\.core\.Encoding\.decode_bytes",
    ),
    (check_merge, lambda ids, pair, new_id: bpe.merge(ids, pair, new_id), r"called llmcourse\.course\.bpe\.merge"),
    (
        check_merge,
        lambda ids, pair, new_id: engine_merge_imported_early(ids, pair, new_id),
        r"called llmcourse\.course\.bpe\.merge",
    ),
    (check_train_bpe, lambda text, n: bpe.train_bpe(text, n), r"called llmcourse\.course\.bpe\.train_bpe"),
    (check_train_bpe, lambda text, n: fast_trainer(text, n), r"called llmcourse\.engine\.bpe_training\.train_bpe"),
    (check_encode, encode_with_the_engines_bpe_tokenizer, r"called llmcourse\.engine\.bpe_training\.BPETokenizer"),
    (
        check_bytes_to_unicode,
        lambda: dict(engine_table_imported_early()),
        r"called llmcourse\.engine\.tokenizer\.bytes_to_unicode",
    ),
    (
        check_bpe_encode_chunk,
        lambda chunk, ranks: bpe.encode(chunk.decode("utf-8", "replace")),
        r"called llmcourse\.course\.bpe\.encode",
    ),
    (
        check_bytes_to_unicode,
        lambda: dict(zip(range(256), tokenizers_byte_level().alphabet())),
        r"called ByteLevel\.alphabet \(part of tokenizers\)",
    ),
    (check_stream_decoder, DecodeStreamDecoder, r"called DecodeStream\.step \(part of tokenizers\)"),
    (check_stream_decoder, IncrementalStreamDecoder, r"called codecs\.getincrementaldecoder"),
    (check_stream_decoder, AliasedIncrementalStreamDecoder, r"called codecs\.getincrementaldecoder"),
    (check_stream_decoder, LookupStreamDecoder, r"called codecs\.BufferedIncrementalDecoder"),
    (check_stream_decoder, EncodingsStreamDecoder, r"called codecs\.BufferedIncrementalDecoder"),
    (check_stream_decoder, RawCodecStreamDecoder, r"called codecs\.utf_8_decode"),
    (check_stream_decoder, EngineStreamDecoder, r"called llmcourse\.engine\.tokenizer\.StreamDecoder"),
    (
        check_stream_decoder,
        SubclassedEngineStreamDecoder,
        r"called llmcourse\.engine\.tokenizer\.StreamDecoder\.__init__",
    ),
]


@pytest.mark.parametrize(
    "check, wrong, message", BLACK_BOXES, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(BLACK_BOXES)]
)
def test_black_box_is_rejected_however_it_is_reached(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


def test_the_engine_still_works_after_a_check_that_forbids_it():
    with pytest.raises(CheckFailed):
        check_bytes_to_unicode(lambda: dict(engine_table_imported_early()))
    assert sys.getprofile() is None
    assert bytes_to_unicode()[32] == "Ġ" and bpe.merge([1, 2], (1, 2), 9) == [9]
    assert TOKENIZER.encode("Hello world") == [15496, 995]


def test_streamed_pieces_match_the_engine_on_a_mixed_sentence():
    """The manual decoder emits exactly what the engine's incremental decoder emits, push by push."""
    ids = TOKENIZER.encode("I ❤ 🦙 and 中文 — naïve")
    engine, manual = StreamDecoder(TOKENIZER), ManualStreamDecoder(bpe.gpt2_vocab())
    assert [engine.push(i) for i in ids] == [manual.push(i) for i in ids]
    assert engine.flush() == manual.flush() == ""


# -- endless loops and crashes ------------------------------------------------------------------


def merge_forgets_to_advance(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        elif i == len(ids) - 1:
            out.append(ids[i])
            i += 1
        # forgot: else append ids[i] and move on
    return out


def merge_swallowing_errors(ids, pair, new_id):
    try:
        return merge_forgets_to_advance(ids, pair, new_id)
    except Exception:  # the learner's safety net: it must not catch the time-out
        return list(ids)


@pytest.fixture
def short_time_outs(monkeypatch):
    import llmcourse.checks.tokenization as tokenization

    real = tokenization.run_check
    monkeypatch.setattr(tokenization, "run_check", lambda *a, **kw: real(*a, **{**kw, "seconds": 0.5}))


@pytest.mark.parametrize("wrong", [merge_forgets_to_advance, merge_swallowing_errors])
def test_endless_loop_is_stopped(wrong, short_time_outs):
    with pytest.raises(CheckFailed, match=r"did not finish within its 0.5 CPU-s[\s\S]*does i move on"):
        check_merge(wrong)


class PanicException(BaseException):
    """Like pyo3's (tiktoken's Rust panics): not an Exception."""


def encode_that_panics(text, ranks):
    raise PanicException("called `Option::unwrap()` on a `None` value")


def decode_that_exits(ids, vocab):
    sys.exit("bye")


def test_errors_that_are_not_exceptions_are_reported():
    with pytest.raises(CheckFailed, match=r"raised PanicException: called `Option::unwrap\(\)`[\s\S]*at line"):
        check_encode(encode_that_panics)
    with pytest.raises(CheckFailed, match=r"called exit\(\)"):
        check_decode(decode_that_exits)


def test_not_callable_is_rejected():
    with pytest.raises(CheckFailed, match="expected a function"):
        check_decode("decode")
    with pytest.raises(CheckFailed, match="expected a class"):
        check_stream_decoder(None)


# -- the engine's reference against tiktoken (what makes it a reference) ------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello world",
        "   spaces   ",
        "I'm sure they'll",
        "1234567 2024",
        "naïve café — 中文 🦙👨‍👩‍👧‍👦",
        "the end<|endoftext|>new",
        "<|endoftext|",
        "def f(x):\n\treturn x  # ok\n\n",
        "a" * 500,
    ],
)
def test_reference_encode_equals_tiktoken(text):
    tokenizer = get_tokenizer()
    assert bpe.encode(text) == tokenizer.encode(text, allowed_special="all")
    assert bpe.encode(text, allowed_special=()) == tokenizer.encode_ordinary(text)
    assert bpe.decode(bpe.encode(text)) == text


def test_reference_encode_is_fast_on_a_few_kilobytes():
    import time

    text = bpe.CORPUS_FILE.read_text(encoding="utf-8")
    bpe.encode("warm up")
    start = time.process_time()  # CPU time: the same on a busy machine
    ids = bpe.encode(text)
    assert time.process_time() - start < 1.0
    assert ids == get_tokenizer().encode(text)


def test_a_table_that_breaks_when_read_is_reported():
    class Table(dict):
        def __getitem__(self, key):
            raise RuntimeError("lazy table failed")

    with pytest.raises(CheckFailed, match=r"your answer could not be compared[\s\S]*lazy table failed"):
        check_bytes_to_unicode(lambda: Table({b: chr(b) for b in range(256)}))
