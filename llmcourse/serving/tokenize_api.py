"""vLLM's `POST /tokenize` and `POST /detokenize`: the requests checked (every field, an OpenAI-shaped 400 naming
the one that is wrong) and the answers shaped as vLLM shapes them.

`/tokenize` gives the ids the generation routes would give the same input: a `prompt` as `/v1/completions`
encodes it (special tokens written in it are special), `messages` as `/v1/chat/completions` renders them (through
`encode_messages`: a special token typed in a message stays plain text).

    >>> from llmcourse import get_tokenizer
    >>> gpt2_tokenizer = get_tokenizer()
    >>> tokenize({"prompt": "ROMEO:", "return_token_strs": True}, gpt2_tokenizer, n_positions=256)
    {'count': 3, 'max_model_len': 256, 'tokens': [33676, 4720, 25], 'token_strs': ['ROM', 'EO', ':']}
    >>> detokenize({"tokens": [33676, 4720, 25]}, gpt2_tokenizer, n_positions=256, vocab_size=50257)
    {'prompt': 'ROMEO:'}
"""

from __future__ import annotations

import functools

from llmcourse.engine.tokenizer import bytes_to_unicode

from .openai_api import (
    BOOLEAN,
    STRING,
    APIError,
    chat_messages,
    checked_fields,
    encode_messages,
    encode_prompt,
    shown,
    too_long,
)

PROMPT = {"model": STRING, "prompt": STRING, "add_special_tokens": BOOLEAN, "return_token_strs": BOOLEAN}
CHAT = {
    "model": STRING,
    "messages": "a list of messages",
    "add_generation_prompt": BOOLEAN,
    "add_special_tokens": BOOLEAN,
    "return_token_strs": BOOLEAN,
}
DETOKENIZE = {"model": STRING, "tokens": "a list of token ids"}
BYTE_CHARS = bytes_to_unicode()  # a byte-level BPE's vocabulary writes byte b as BYTE_CHARS[b] ('Ġ' for a space)


def tokenize(body, tokenizer, n_positions: int) -> dict:
    """A `/tokenize` request -> {count, max_model_len, tokens, token_strs}. `prompt` (add_special_tokens: true by
    default, as vLLM) or `messages` (add_generation_prompt: true, add_special_tokens: false by default); a text
    longer than the model's context is refused, as vLLM refuses it."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if "prompt" in body and "messages" in body:
        raise APIError("give prompt (a text) or messages (a conversation), not both", "messages")
    if "messages" in body:
        fields = checked_fields(body, CHAT)
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError("this model has no chat template, so it cannot render messages: send a prompt", "messages")
        messages = chat_messages(fields.get("messages"))
        ids = encode_messages(tokenizer, messages, n_positions, fields.get("add_generation_prompt", True))
        if fields.get("add_special_tokens", False):
            before, after = special_ends(tokenizer)
            ids = before + ids + after
    else:
        fields = checked_fields(body, PROMPT)
        if "prompt" not in fields:
            raise APIError("give prompt (a text) or messages (a list of {role, content})", "prompt")
        ids = encode_prompt(tokenizer, fields["prompt"], n_positions, fields.get("add_special_tokens", True))
    if len(ids) > n_positions:  # (tiktoken encodes a text whatever its length; special tokens may add some)
        raise too_long(len(ids), n_positions, "messages" if "messages" in fields else "prompt")
    strings = token_strings(tokenizer, ids) if fields.get("return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": n_positions, "tokens": ids, "token_strs": strings}


def detokenize(body, tokenizer, n_positions: int, vocab_size: int) -> dict:
    """A `/detokenize` request -> {prompt}: the text of `tokens`, special tokens written out (as vLLM decodes)."""
    fields = checked_fields(body, DETOKENIZE)
    ids = fields.get("tokens")
    if not isinstance(ids, list):
        raise APIError(f"tokens must be a list of token ids, got {shown(ids)}", "tokens")
    if len(ids) > n_positions:
        raise APIError(f"tokens holds {len(ids)} ids; the model's context, the most there can be, is {n_positions}",
                       "tokens")  # fmt: skip
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise APIError(
                f"tokens[{i}] is {shown(t)}, not a token id of this model's vocabulary (0 ... {vocab_size - 1})",
                f"tokens[{i}]",
            )
    return {"prompt": tokenizer.decode(ids)}


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token as its vocabulary writes it (transformers' convert_ids_to_tokens, as vLLM returns them): GPT-2's
    byte-level pieces ('ĠRomeo'), a tokenizer.json's own ('▁Romeo' for SentencePiece-style ones)."""
    if hasattr(tokenizer, "plain_tokenizer"):  # HFTokenizer
        return [tokenizer.tokenizer.id_to_token(t) for t in ids]
    if hasattr(tokenizer, "decode_single_token_bytes"):  # tiktoken: its bytes, written as GPT-2's vocab.json does
        return ["".join(BYTE_CHARS[b] for b in tokenizer.decode_single_token_bytes(t)) for t in ids]
    return [tokenizer.decode([t]) for t in ids]  # a learner's tokenizer (serve --parts): the text of each


@functools.lru_cache(maxsize=8)
def special_ends(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds before and after a text with add_special_tokens (its post-processor: Llama 3's
    [<|begin_of_text|>] before, nothing after; GPT-2: none)."""
    if not hasattr(tokenizer, "plain_tokenizer"):  # tiktoken and a learner's: they add none
        return [], []
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    start = next(i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare)
    return full[:start], full[start + len(bare) :]
