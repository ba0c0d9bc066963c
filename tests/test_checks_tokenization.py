"""Chapter 01's checks: the engine's reference passes, stubs and plausible mistakes fail with a
message that says what is wrong, other correct ways of writing each exercise pass, black boxes and
endless loops are stopped."""

import codecs
from collections import Counter

import pytest
import regex

from llmcourse import bpe, get_tokenizer
from llmcourse.checks import (CheckFailed, check_bpe_encode_chunk, check_bytes_to_unicode, check_decode,
                              check_encode, check_get_pair_counts, check_merge, check_stream_decoder,
                              check_train_bpe)
from llmcourse.tokenizer import EOT, EOT_ID, GPT2_SPLIT_PATTERN, StreamDecoder, bytes_to_unicode

# Captured here: each check forbids calling the engine's function for its own exercise by name.
ENGINE_ENCODE, ENGINE_MERGE, ENGINE_CHUNK = bpe.encode, bpe.merge, bpe.bpe_encode_chunk


def engine_encode(text, ranks):
    return ENGINE_ENCODE(text, ranks=ranks)


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
    (check_get_pair_counts, bpe.get_pair_counts),
    (check_merge, bpe.merge),
    (check_train_bpe, bpe.train_bpe),
    (check_bytes_to_unicode, bytes_to_unicode),
    (check_bpe_encode_chunk, bpe.bpe_encode_chunk),
    (check_encode, engine_encode),
    (check_decode, bpe.decode),
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
    return tuple(ENGINE_MERGE(ids, pair, new_id))


def merge_right_to_left(ids, pair, new_id):
    return ENGINE_MERGE(ids[::-1], pair[::-1], new_id)[::-1]


def train_ties_by_smallest_pair(text, num_merges):
    ids, merges = list(text.encode()), {}
    for new_id in range(256, 256 + num_merges):
        counts = bpe.get_pair_counts(ids)
        if not counts:
            break
        pair = max(sorted(counts), key=counts.get)  # ties go to the smallest pair, not the first one
        ids, merges[pair] = bpe.merge(ids, pair, new_id), new_id
    return merges


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
    return [token[i] for i in ENGINE_CHUNK(chunk, ranks)]


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
    (check_train_bpe, train_ties_by_smallest_pair, r"a tie: both pairs occur \d+ times"),
    (check_train_bpe, train_stops_at_count_one, r"even a pair that occurs only once"),
    (check_train_bpe, train_without_applying_merges, r"none of your merges uses a merged id[\s\S]*count the pairs again"),
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
    (check_bytes_to_unicode, bytes_to_unicode_in_byte_order, r"order of the table[\s\S]*entry #0 is byte 0, expected byte 33"),
    (check_bytes_to_unicode, bytes_to_unicode_offset_by_256, r"byte 127[\s\S]*expected: 'ġ'[\s\S]*chr\(256\), chr\(257\)"),
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
        (pair, _), = counts.most_common(1)  # equal counts come out in order of first occurrence
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


ALTERNATIVES = [
    (check_get_pair_counts, pair_counts_with_counter),
    (check_merge, merge_with_flag),
    (check_train_bpe, train_with_most_common),
    (check_bytes_to_unicode, gpt2_original_bytes_to_unicode),
    (check_bpe_encode_chunk, chunk_merging_every_occurrence),
    (check_encode, encode_with_regex_split),
    (check_decode, decode_with_bytearray),
]


@pytest.mark.parametrize("check, alternative", ALTERNATIVES, ids=[a.__name__ for _, a in ALTERNATIVES])
def test_correct_alternative_passes(check, alternative):
    check(alternative)
    check(alternative, seed=3, n_random=150)


# -- black boxes and endless loops --------------------------------------------------------------


def test_calling_tiktoken_is_rejected_by_name():
    tokenizer = get_tokenizer()
    with pytest.raises(CheckFailed, match=r"called tiktoken\.Encoding\.encode\b"):
        check_encode(lambda text, ranks: tokenizer.encode(text, allowed_special="all"))
    with pytest.raises(CheckFailed, match=r"called tiktoken\.Encoding\.decode\b"):
        check_decode(lambda ids, vocab: tokenizer.decode(ids))


def test_calling_the_engine_is_rejected_by_name():
    with pytest.raises(CheckFailed, match=r"called llmcourse\.bpe\.merge"):
        check_merge(lambda ids, pair, new_id: bpe.merge(ids, pair, new_id))


class IncrementalStreamDecoder:
    def __init__(self, vocab):
        self.vocab = vocab
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        return self.utf8.decode(self.vocab[token_id])

    def flush(self):
        return self.utf8.decode(b"", final=True)


class EngineStreamDecoder:
    """The engine's own StreamDecoder behind the exercise's interface: it uses the forbidden decoder."""

    def __init__(self, vocab):
        self.inner = StreamDecoder(type("Vocab", (), {"decode_single_token_bytes": lambda _, i: vocab[i]})())

    def push(self, token_id):
        return self.inner.push(token_id)

    def flush(self):
        return self.inner.flush()


@pytest.mark.parametrize("decoder", [IncrementalStreamDecoder, EngineStreamDecoder])
def test_incremental_decoder_is_rejected_by_name(decoder):
    with pytest.raises(CheckFailed, match=r"called codecs\.getincrementaldecoder"):
        check_stream_decoder(decoder)


def test_streamed_pieces_match_the_engine_on_a_mixed_sentence():
    """The manual decoder emits exactly what the engine's incremental decoder emits, push by push."""
    tokenizer = get_tokenizer()
    ids = tokenizer.encode("I ❤ 🦙 and 中文 — naïve")
    engine, manual = StreamDecoder(tokenizer), ManualStreamDecoder(bpe.gpt2_vocab())
    assert [engine.push(i) for i in ids] == [manual.push(i) for i in ids]
    assert engine.flush() == manual.flush() == ""


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


def test_endless_loop_is_stopped():
    with pytest.raises(CheckFailed, match=r"did not finish within 10 s"):
        check_merge(merge_forgets_to_advance)


def test_not_callable_is_rejected():
    with pytest.raises(CheckFailed, match="expected a function"):
        check_decode("decode")
    with pytest.raises(CheckFailed, match="expected a class"):
        check_stream_decoder(None)


# -- the engine's reference against tiktoken (what makes it a reference) ------------------------


@pytest.mark.parametrize("text", [
    "", "Hello world", "   spaces   ", "I'm sure they'll", "1234567 2024", "naïve café — 中文 🦙👨‍👩‍👧‍👦",
    "the end<|endoftext|>new", "<|endoftext|", "def f(x):\n\treturn x  # ok\n\n", "a" * 500,
])
def test_reference_encode_equals_tiktoken(text):
    tokenizer = get_tokenizer()
    assert bpe.encode(text) == tokenizer.encode(text, allowed_special="all")
    assert bpe.encode(text, allowed_special=()) == tokenizer.encode_ordinary(text)
    assert bpe.decode(bpe.encode(text)) == text


def test_reference_encode_is_fast_on_a_few_kilobytes():
    import time

    text = bpe.CORPUS_FILE.read_text(encoding="utf-8")
    bpe.encode("warm up")
    start = time.perf_counter()
    ids = bpe.encode(text)
    assert time.perf_counter() - start < 1.0
    assert ids == get_tokenizer().encode(text)
