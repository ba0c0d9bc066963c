"""The fast train_bpe gives chapter 01's merges, and its tokenizer encodes as the `tokenizers` library does.

Measured on this 2-core machine (shared with other work): 300 merges on the first 20,000 characters of the
training plays take 2.2 s with the reference (`llmcourse.course.bpe.train_bpe`) and 0.13 s here; all 3,839
merges of llama-shakespeare's vocabulary, on the whole 4.7 MB of training text cut into chunks, 3.9 s (the
reference, recounting the whole text per merge, would take hours). On the uncut byte stream, 1,000 merges
on the first 1 MB take 6.7 s.
"""

import random

import pytest
import regex

from llmcourse.course import bpe as reference
from llmcourse.engine.bpe_training import SPLIT_PATTERN, BPETokenizer, distinct_chunks, train_bpe
from llmcourse.engine.tokenizer import EOT, GPT2_SPLIT_PATTERN
from llmcourse.training.shakespeare import VALIDATION_FILE

ALPHABETS = ["ab", "abc", "aab ", "ab \n", " abcdé🦙\n", "xyz.,!? \n\n"]


def random_texts(seed: int, n: int, max_len: int = 300):
    rng = random.Random(seed)
    for _ in range(n):
        alphabet = rng.choice(ALPHABETS)
        yield "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len))), rng.randint(1, 80)


def reference_on_chunks(text: str, num_merges: int, pattern: str) -> dict:
    """The reference algorithm on regex chunks (minbpe's RegexTokenizer.train): pairs counted over all chunks
    in order of first occurrence, no pair across two chunks."""
    chunks = [list(chunk.encode("utf-8")) for chunk in regex.findall(pattern, text)]
    merges = {}
    for new_id in range(256, 256 + num_merges):
        counts = {}
        for ids in chunks:
            for pair in zip(ids, ids[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        pair = max(counts, key=counts.get)
        chunks = [reference.merge(ids, pair, new_id) for ids in chunks]
        merges[pair] = new_id
    return merges


@pytest.fixture(scope="module")
def excerpt():
    return VALIDATION_FILE.read_text(encoding="utf-8")[:6000]


def test_same_merges_as_the_reference_in_the_same_order():
    for text, n in random_texts(0, 300):
        assert list(train_bpe(text, n).items()) == list(reference.train_bpe(text, n).items()), (text, n)


def test_same_merges_on_unicode_and_on_shakespeare(excerpt):
    assert train_bpe("aaabdaaabac", 3) == reference.train_bpe("aaabdaaabac", 3)
    for text in ["🦙🦙 naïve café 世界世界 " * 5, "aaaaaaaaaaaaaaaaa", "abababababab", "", "x", excerpt]:
        n = 200 if text is excerpt else 40
        assert list(train_bpe(text, n).items()) == list(reference.train_bpe(text, n).items())


def test_training_stops_when_no_pair_is_left():
    assert train_bpe("abc", 10) == reference.train_bpe("abc", 10) == {(97, 98): 256, (256, 99): 257}


@pytest.mark.parametrize("pattern", [GPT2_SPLIT_PATTERN, SPLIT_PATTERN])
def test_same_merges_as_the_reference_on_chunks(pattern, excerpt):
    for text, n in random_texts(1, 150):
        assert list(train_bpe(text, n, pattern).items()) == list(reference_on_chunks(text, n, pattern).items())
    assert train_bpe(excerpt, 150, pattern) == reference_on_chunks(excerpt, 150, pattern)


def test_distinct_chunks_keep_the_order_of_first_occurrence():
    assert distinct_chunks("to be or not to be", SPLIT_PATTERN) == (
        [b"to", b" be", b" or", b" not", b" to"],
        [1, 2, 1, 1, 1],
    )


def test_a_blank_line_is_a_chunk_of_its_own():
    assert regex.findall(SPLIT_PATTERN, "Adieu.\n\nROMEO:\n") == ["Adieu", ".", "\n\n", "ROMEO", ":", "\n"]
    assert regex.findall(GPT2_SPLIT_PATTERN, "Adieu.\n\nROMEO:\n") == ["Adieu", ".", "\n", "\n", "ROMEO", ":", "\n"]


@pytest.fixture(scope="module")
def shakespeare_tokenizer(excerpt):
    merges = train_bpe(excerpt, 400, SPLIT_PATTERN)
    return BPETokenizer(merges, SPLIT_PATTERN, {EOT: 256 + len(merges)})


def test_tokenizer_json_encodes_like_our_tokenizer(shakespeare_tokenizer, tmp_path):
    from tokenizers import Tokenizer

    shakespeare_tokenizer.save(tmp_path / "tokenizer.json")
    library = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = [
        VALIDATION_FILE.read_text(encoding="utf-8")[:50_000],
        "ROMEO:\nBut soft!<|endoftext|>JULIET:\n\n\nAy me.  \t\n",
        "🦙 naïve 世界 'tis 12345 don't\r\n",
        *(text for text, _ in random_texts(2, 50)),
    ]
    for text in texts:
        ids = shakespeare_tokenizer.encode(text)
        assert library.encode(text).ids == ids
        assert shakespeare_tokenizer.decode(ids) == library.decode(ids, skip_special_tokens=False) == text
    eot = shakespeare_tokenizer.special_tokens[EOT]
    assert shakespeare_tokenizer.encode(EOT) == [eot]
    as_text = shakespeare_tokenizer.encode(EOT, allowed_special=())
    assert eot not in as_text and as_text == shakespeare_tokenizer.encode_ordinary(EOT)


def test_tokenizer_refuses_merges_that_spell_one_token_twice():
    with pytest.raises(ValueError, match="same bytes"):
        BPETokenizer({(97, 98): 256, (256, 99): 257, (98, 99): 258, (97, 258): 259})


def test_from_file_reads_back_what_save_wrote(shakespeare_tokenizer, tmp_path):
    shakespeare_tokenizer.save(tmp_path / "tokenizer.json")
    again = BPETokenizer.from_file(tmp_path / "tokenizer.json")
    assert list(again.merges.items()) == list(shakespeare_tokenizer.merges.items())
    assert again.special_tokens == shakespeare_tokenizer.special_tokens and again.split_pattern == SPLIT_PATTERN
