"""The tokenizers of Llama-family model folders (`tokenizer.json`) and their chat templates.

A model folder that transformers' `save_pretrained` wrote holds its tokenizer as `tokenizer.json` (the
`tokenizers` library's format: normalizer, pre-tokenizer, BPE vocabulary and merges, added tokens,
post-processor, decoder), its special tokens and chat template in `tokenizer_config.json` (or
`special_tokens_map.json`, `chat_template.jinja`), and the ids that end a reply in `generation_config.json`.
`HFTokenizer` reads them all and behaves as transformers' tokenizer does, with the interface the engine
uses for GPT-2's tiktoken `Encoding` (`encode(text, allowed_special="all")`, `decode(ids)`,
`stream_decoder()`):

    >>> tok = load_tokenizer("path/to/Llama-3.2-1B-Instruct")                 # doctest: +SKIP
    >>> tok.encode("Hi")                                # Llama 3 adds <|begin_of_text|>   # doctest: +SKIP
    [128000, 13347]
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])          # doctest: +SKIP
    '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: ...'
    >>> tok.eos_token_ids                               # <|end_of_text|>, <|eom_id|>, <|eot_id|>   # doctest: +SKIP
    (128001, 128008, 128009)

A chat template is a Jinja program; it is rendered here exactly as transformers renders it (a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII characters, the special tokens as variables).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence, Union

from .loading import resolve_source
from .tokenizer import TokenizerFileError, bytes_to_unicode, get_tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")
TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template here rather than in the config
FILES = (TOKENIZER_FILE, *CONFIG_FILES[:3], TEMPLATE_FILE)  # what a model's tokenizer needs from its folder
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # a byte-level vocabulary's characters -> their bytes
Message = dict  # {"role": "system" | "user" | "assistant" | ..., "content": str}


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or the template refused the conversation."""


class TooManyTokens(ValueError):
    """A text of more tokens than `max_tokens` allowed (`count`: how many it has, or at least)."""

    def __init__(self, count: int, max_tokens: int):
        super().__init__(f"the text is {count} tokens, over the limit of {max_tokens}")
        self.count, self.max_tokens = count, max_tokens


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its model folder's special tokens, chat template and EOS ids.

    `encode` adds the special tokens transformers' `encode` adds by default: those of tokenizer.json's
    post-processor (Llama 3: `<|begin_of_text|>`; Llama 2: `<s>`; Qwen: none; transformers 5 ignores the
    config's add_bos_token when there is a tokenizer.json, and so do we). `encode_chat` adds none: the
    chat template writes its own BOS.

        >>> tok = HFTokenizer.from_folder("path/to/Qwen2.5-0.5B-Instruct")       # doctest: +SKIP
        >>> tok.decode(tok.encode("Hello, 世界"))                                 # doctest: +SKIP
        'Hello, 世界'
    """

    def __init__(self, tokenizer, config: Optional[dict] = None, eos_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.config = dict(config or {})
        self.special_tokens = {name: token for name in NAMED_TOKENS if (token := token_text(self.config.get(name)))}
        self.chat_template = chat_template_of(self.config.get("chat_template"))
        eos = [i for i in eos_token_ids if i is not None]
        if self.eos_token_id is not None and self.eos_token_id not in eos:
            eos.append(self.eos_token_id)
        self.eos_token_ids = tuple(eos)

    @classmethod
    def from_folder(cls, folder: Union[str, Path]) -> "HFTokenizer":
        """The tokenizer of a model folder: `tokenizer.json` and the configuration files beside it."""
        from tokenizers import Tokenizer  # only tokenizer.json models need the library (GPT-2 runs on tiktoken)

        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # missing, truncated, not JSON, an unknown component ...
            raise TokenizerFileError(
                f"cannot read the tokenizer file {path} ({type(err).__name__}: {str(err)[:200]}); copy the model's "
                f"{TOKENIZER_FILE} there again (it is the file transformers' save_pretrained writes)"
            ) from None
        tok_config, special_map, generation, model = (read_json(folder / name) for name in CONFIG_FILES)
        config = {**{k: v for k, v in special_map.items() if k in NAMED_TOKENS}, **tok_config}
        if (folder / TEMPLATE_FILE).is_file():
            config["chat_template"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
        eos = generation.get("eos_token_id", model.get("eos_token_id"))
        return cls(tokenizer, config, eos_token_ids=[eos] if isinstance(eos, int) else eos or [])

    # -- special tokens ------------------------------------------------------------------------------------

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.token_id(self.eos_token)

    @property
    def n_vocab(self) -> int:
        """Token ids are in [0, n_vocab) (added tokens included), as for tiktoken's Encoding."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids --------------------------------------------------------------------------------------

    def encode(
        self, text: str, allowed_special="all", add_special_tokens: bool = True, max_tokens: Optional[int] = None
    ) -> list[int]:
        """Token ids of `text`, as transformers' `tokenizer.encode(text)` gives them (its BOS included).

        Special tokens written in the text (`<|eot_id|>`) become their ids with `allowed_special="all"`;
        with `allowed_special=()` they are encoded as ordinary text. max_tokens: a text of more tokens raises
        `TooManyTokens` before its ids become Python ints.

        A server tokenizes in worker threads, so the event loop must get the GIL while a long text is encoded:
        `encode_batch_fast` releases it for the whole work and makes no offsets (`encode` would hold it for
        20-100 ms freeing a 1 MB text's 300,000 token strings and offsets), and a list of 300,000 ids is never
        made for a text that cannot fit (another 10-90 ms)."""
        if allowed_special not in ("all", (), set(), frozenset(), None):
            raise ValueError(f"allowed_special must be 'all' or empty, got {allowed_special!r}")
        tokenizer = self.tokenizer if allowed_special == "all" else self.plain_tokenizer
        encoding = tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding), max_tokens)
        return encoding.ids

    @functools.cached_property
    def plain_tokenizer(self):
        """A copy of the tokenizer that encodes special tokens' text as ordinary text (a copy rather than a
        switch on the one tokenizer: two threads may encode at once)."""
        from tokenizers import Tokenizer  # as in load: only tokenizer.json models need the library

        plain = Tokenizer.from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The special tokens' texts (`<|eot_id|>`, ...), longest first."""
        added = self.tokenizer.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens shown, as transformers' `tokenizer.decode(ids)`."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character).

        >>> tok.token_bytes(tok.encode("🦙", add_special_tokens=False)[0])   # Llama 3   # doctest: +SKIP
        b'\\xf0\\x9f'
        """
        piece = self.tokenizer.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (0 ... {self.n_vocab - 1})")
        if type(self.tokenizer.decoder).__name__ == "ByteLevel" and all(c in BYTE_OF for c in piece):
            return bytes(BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte-fallback token
            return bytes([int(piece[3:5], 16)])
        return self.decode([token_id]).encode("utf-8")

    def stream_decoder(self) -> "HFStreamDecoder":
        return HFStreamDecoder(self)

    # -- chat ----------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> Union[str, list[int]]:
        """The conversation as the model saw conversations in training: its chat template rendered as
        transformers' `apply_chat_template` renders it (`kwargs` become template variables, e.g.
        `date_string` or `tools`). With `add_generation_prompt` it ends where the assistant's reply begins.

            >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # Qwen2.5   # doctest: +SKIP
            '<|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>...'
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json, no "
                f"{TEMPLATE_FILE}): use a chat (instruct) model's folder, or add its template to tokenizer_config.json"
            )
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers does
        template = compile_template(self.chat_template)
        try:
            text = template.render(
                messages=messages,
                tools=kwargs.pop("tools", None),
                documents=kwargs.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except ChatTemplateError:
            raise
        except Exception as err:  # the template's own raise_exception, or a jinja2 error
            raise ChatTemplateError(f"the chat template refused the conversation: {err}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered conversation, as `apply_chat_template(tokenize=True)` gives them:
        the template's text encoded without adding special tokens (its own BOS is the only one)."""
        return self.apply_chat_template(messages, add_generation_prompt, tokenize=True, **kwargs)

    def encode_chat_plain(
        self, messages: list[Message], add_generation_prompt: bool = True, max_tokens: Optional[int] = None, **kwargs
    ) -> list[int]:
        """`encode_chat`, except that the messages' own text (content, name) never becomes a special token: a
        `<|eot_id|>` typed in a message is encoded as the text it is, so that it cannot end a turn or open one.
        Only the template's own special tokens are special. (transformers' `apply_chat_template` renders the
        text and then parses every special token in it, the user's too: this deliberately differs.)

        The special tokens' texts in the messages are swapped for private-use characters no message holds, the
        template rendered, and the text split at those characters: the template's pieces are encoded with special
        tokens, the user's special-token texts without. max_tokens: as `encode`'s."""
        texts = [v for m in messages for v in m.values() if isinstance(v, str)]
        found = [t for t in self.special_texts if any(t in x for x in texts)]
        if not found:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        used, code, stand_in = set("".join(texts)), 0xF0000, {}
        for token in found:
            while chr(code) in used:
                code += 1
            stand_in[token] = chr(code)
            code += 1
        typed = re.compile("|".join(map(re.escape, found)))  # longest first
        safe = [{k: typed.sub(lambda m: stand_in[m.group()], v) if isinstance(v, str) else v for k, v in m.items()}
                for m in messages]  # fmt: skip
        text = self.apply_chat_template(safe, add_generation_prompt, **kwargs)
        token_of = {c: t for t, c in stand_in.items()}
        ids: list[int] = []
        for piece in re.split(f"([{''.join(token_of)}])", text):
            if piece in token_of:
                ids += self.encode(token_of[piece], allowed_special=(), add_special_tokens=False)
            elif piece:
                left = None if max_tokens is None else max(0, max_tokens - len(ids))
                try:
                    ids += self.encode(piece, add_special_tokens=False, max_tokens=left)
                except TooManyTokens as err:
                    raise TooManyTokens(len(ids) + err.count, max_tokens) from None
            if max_tokens is not None and len(ids) > max_tokens:
                raise TooManyTokens(len(ids), max_tokens)
        return ids

    def __repr__(self) -> str:
        return f"HFTokenizer(n_vocab={self.n_vocab}, bos={self.bos_token!r}, eos_token_ids={self.eos_token_ids})"


class HFStreamDecoder:
    """Text of a token stream as it grows, never half a character: what `push` and `flush` return, joined,
    is `decode` of all the ids.

    It decodes a short window of recent ids twice, without and with the new ones, and returns the text the
    new ids added, unless that ends in '\\ufffd' (an unfinished UTF-8 character: a byte-level token, or a
    byte-fallback token such as `<0xE2>`). Decoding a window rather than one token keeps what a decoder does
    between tokens (Llama 2's `▁` becomes a space except at the start of the text).

        >>> dec = tok.stream_decoder()                                              # doctest: +SKIP
        >>> "".join(dec.push(i) for i in tok.encode("I ❤ 🦙")) + dec.flush()        # doctest: +SKIP
        '<|begin_of_text|>I ❤ 🦙'
    """

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:] (ids[start:shown] are already returned)
        self.shown = 0

    def new_text(self) -> str:
        window = self.ids[self.start :]
        before = self.tokenizer.decode(window[: self.shown - self.start])
        return self.tokenizer.decode(window)[len(before) :]

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly '')."""
        self.ids.append(int(token_id))
        text = self.new_text()
        if not text or text.endswith("\ufffd"):
            return ""
        self.start, self.shown = self.shown, len(self.ids)
        return text

    def flush(self) -> str:
        """End of stream: what is left (unfinished bytes become '\\ufffd', as in `decode`)."""
        text = self.new_text()
        self.start = self.shown = len(self.ids)
        return text


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
    """A chat template compiled in the environment transformers renders templates in
    (transformers.utils.chat_template_utils: `_compile_jinja_template`)."""
    # jinja2: only chat templates need it (transformers' own dependency for them)
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals |= {"raise_exception": raise_exception, "strftime_now": strftime_now}
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {err} (line {err.lineno})") from None


def chat_template_of(value) -> Optional[str]:
    """The template text: a string, or the 'default' of a list of named templates (some configs have several)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value or None


def token_text(value) -> Optional[str]:
    """A special token as configs write it: a string, or {"content": ..., ...} (an AddedToken), or null."""
    return value.get("content") if isinstance(value, dict) else value


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise TokenizerFileError(
            f"{path} is not valid JSON ({err}); copy the model's {path.name} there again"
        ) from None


def load_tokenizer(source: Union[str, Path, None] = None):
    """The tokenizer of a model source (what `load_model` takes): its folder's `tokenizer.json` as an
    `HFTokenizer`, or, for a GPT-2 model without one (the bundled gpt2-shakespeare), GPT-2's tiktoken tokenizer.

        >>> load_tokenizer("gpt2-shakespeare").encode("ROMEO:")
        [33676, 4720, 25]
    """
    folder = Path(resolve_source("gpt2-shakespeare" if source is None else source))
    if (folder / TOKENIZER_FILE).exists():
        return HFTokenizer.from_folder(folder)
    model_type = read_json(folder / "config.json").get("model_type", "gpt2")
    if model_type != "gpt2":
        raise TokenizerFileError(
            f"{folder} has no {TOKENIZER_FILE}: a {model_type} model needs its own tokenizer; copy the model's "
            f"{TOKENIZER_FILE} (and tokenizer_config.json) into the folder"
        )
    return get_tokenizer()
