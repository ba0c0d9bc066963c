"""The OpenAI API's requests and responses, as plain dicts: what `/v1/completions` and `/v1/chat/completions`
accept (every field checked, with an OpenAI-shaped error naming it), and the JSON they answer with.

A request becomes a `Job`: the prompt's token ids, `LLMEngine`'s settings and what the response must show.

    >>> job = completion_job({"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0}, tokenizer=None,
    ...                      n_positions=64)
    >>> job.prompt, job.settings["max_new_tokens"], job.settings["temperature"]
    ([1, 2, 3], 5, 0)
    >>> completion_job({"prompt": [1], "n": 2, "logit_bias": {"13": -100}}, tokenizer=None, n_positions=64).n
    2
    >>> completion_job({"prompt": [1], "logit_bias": {"x": 1}}, tokenizer=None, n_positions=64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmcourse.serving.openai_api.APIError: logit_bias maps token ids, written as strings ("50256"), to ...
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
import secrets
import time
from typing import NamedTuple, Optional

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256  # a chat reply's default length, at most the room left in the context
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_N = 128  # choices per request (n), as OpenAI allows (the engine may allow fewer: `LLMEngine.max_choices`)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
INT64 = 2**63  # a seed is a 64-bit signed integer (vLLM's bound too)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# a message's `name`: a word, maybe several (OpenAI allows [A-Za-z0-9_-]{1,64}; a play has LADY CAPULET). No newline,
# colon or bracket: in a template that writes the speaker as text (llama-shakespeare's "NAME:\n") it cannot end a turn.
NAME = re.compile(r"\w[\w .'-]{0,63}")

NUMBER, INTEGER, BOOLEAN, STRING, OBJECT = "a number", "an integer", "true or false", "a string", "an object"
# The fields both routes take, with the JSON type each must have (null is always allowed: the default).
COMMON = {
    "model": STRING,
    "max_tokens": INTEGER,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "n": INTEGER,
    "stream": BOOLEAN,
    "stream_options": OBJECT,
    "stop": "a string or a list of strings",
    "stop_token_ids": "a list of token ids",
    "seed": INTEGER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "logit_bias": OBJECT,
    "user": STRING,
    # the engine's own settings (as vLLM takes them: extra fields of the body)
    "top_k": INTEGER,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "ignore_eos": BOOLEAN,
    # structured output: OpenAI's response_format, and vLLM's extra fields
    "response_format": OBJECT,
    "guided_regex": STRING,
    "guided_choice": "a list of strings",
    "guided_json": "a JSON schema (an object, or its text)",
    "structured_outputs": OBJECT,
}
COMPLETION = {
    **COMMON,
    "prompt": "a string or a list of token ids",
    "logprobs": INTEGER,
    "echo": BOOLEAN,
    "best_of": INTEGER,
    "suffix": STRING,
}
CHAT = {
    **COMMON,
    "messages": "a list of messages",
    "max_completion_tokens": INTEGER,
    "logprobs": BOOLEAN,
    "top_logprobs": INTEGER,
}
SHOWN = reprlib.Repr()  # a value in an error message: short, however long or deep
SHOWN.maxstring, SHOWN.maxother, SHOWN.maxlist, SHOWN.maxdict, SHOWN.maxlevel = 80, 80, 6, 4, 3


def shown(value) -> str:
    """A value as an error message quotes it: short, however long or deep the value is."""
    return SHOWN.repr(value)


CHECKS = {
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    INTEGER: lambda v: isinstance(v, int) and not isinstance(v, bool),
    BOOLEAN: lambda v: isinstance(v, bool),
    STRING: lambda v: isinstance(v, str),
    OBJECT: lambda v: isinstance(v, dict),
}


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """A checked request: prompt token ids, `LLMEngine` settings, and how to answer."""

    prompt: list[int]
    settings: dict
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # alternatives per token to show (None: no logprobs)
    chat: bool = False
    n: int = 1  # choices: the engine's `new_choices`
    constraint: Optional[dict] = None  # structured output: `compile_constraint`'s keywords, and the field that asked


def checked_fields(body, fields: dict) -> dict:
    """The body's fields, each of the right JSON type; unknown fields refused (a typo must not pass silently)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items():
        if name not in fields:
            raise APIError(f"unknown field {shown(name)}; this route takes {', '.join(sorted(fields))}", name[:100])
        kind = fields[name]
        if value is not None and kind in CHECKS and not CHECKS[kind](value):
            raise APIError(f"{name} must be {kind}, got {shown(value)}", name)
    return {k: v for k, v in body.items() if v is not None}


def sampling_settings(fields: dict, n_positions: int, prompt_len: int, default_max_tokens: int) -> dict:
    """`LLMEngine.add_request`'s settings from the fields common to both routes; what the engine does not do is
    refused here with the field's name (the engine checks the values it takes: the penalties' range, logit_bias'
    biases and size, token ids against the vocabulary)."""
    if not 1 <= fields.get("n", 1) <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N} (the number of choices), got {fields['n']}", "n")
    if "seed" in fields and not -INT64 <= fields["seed"] < INT64:
        raise APIError(f"seed must be a 64-bit integer, in [-2**63, 2**63), got {shown(fields['seed'])}", "seed")
    if not 0 <= fields.get("temperature", 1.0) <= 2:
        raise APIError(f"temperature must be between 0 and 2, got {shown(fields['temperature'])}", "temperature")
    stop = fields.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in stop):
        raise APIError(
            f"stop must be a string or a list of at most {MAX_STOP} non-empty strings, got {shown(stop)}", "stop"
        )
    room = n_positions - prompt_len
    if room < 1:
        raise APIError(
            f"the prompt takes {prompt_len} tokens, but the model's context is {n_positions} tokens: shorten it",
            "messages" if default_max_tokens == CHAT_MAX_TOKENS else "prompt",
        )
    max_tokens = fields.get("max_tokens", min(default_max_tokens, room))
    if max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise APIError(
            f"the model's context is {n_positions} tokens: the prompt's {prompt_len} plus max_tokens="
            f"{max_tokens} do not fit; ask for at most {room}",
            "max_tokens",
        )
    options = fields.get("stream_options", {})
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise APIError('stream_options must be {"include_usage": true or false}', "stream_options")
    if options and not fields.get("stream", False):
        raise APIError("stream_options is only allowed with stream: true", "stream_options")
    settings = {
        "max_new_tokens": max_tokens,
        "temperature": fields.get("temperature", 1.0),
        "top_p": fields.get("top_p", 1.0),
        "seed": fields.get("seed", secrets.randbits(62)),  # no seed: a fresh draw, as OpenAI's API does
        "stop": tuple(stop),
    }
    engine_fields = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    settings.update({k: fields[k] for k in engine_fields if k in fields})
    if "logit_bias" in fields:
        settings["logit_bias"] = logit_bias(fields["logit_bias"])
    if "stop_token_ids" in fields:
        settings["stop_token_ids"] = stop_token_ids(fields["stop_token_ids"])
    if fields.get("ignore_eos", False):
        settings["eos_token_id"] = None
    return settings


def constraint_fields(fields: dict) -> Optional[dict]:
    """Structured output asked for by `response_format` (OpenAI: {"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}), vLLM's `guided_regex`, `guided_choice`,
    `guided_json`, or `structured_outputs` ({"regex" | "choice" | "json": ...}): `compile_constraint`'s keywords
    with "field" (which field asked), or None. At most one of them."""
    asked = [name for name in ("response_format", "guided_regex", "guided_choice", "guided_json", "structured_outputs")
             if name in fields]  # fmt: skip
    if len(asked) > 1:
        raise APIError(f"give one of {' and '.join(asked)}, not both: each sets the output's structure", asked[1])
    if not asked:
        return None
    name, value = asked[0], fields[asked[0]]
    if name == "response_format":
        kind = value.get("type")
        if kind == "text" and set(value) == {"type"}:
            return None
        if kind == "json_object" and set(value) == {"type"}:
            return {"json_object": True, "field": name}
        if kind == "json_schema" and set(value) == {"type", "json_schema"} and isinstance(value["json_schema"], dict):
            spec = value["json_schema"]
            unknown = set(spec) - {"name", "schema", "strict", "description"}
            if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(
                    'response_format.json_schema must be {"name": "...", "schema": {...}, "strict": true or false}'
                    + (f"; unknown field {shown(sorted(unknown)[0])}" if unknown else ""),
                    "response_format",
                )
            return {"json_schema": spec.get("schema", {}), "field": name}
        raise APIError(
            'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {shown(value)}',
            "response_format",
        )
    if name == "structured_outputs":
        keys = {"regex": "regex", "choice": "choice", "json": "json_schema"}
        if len(value) != 1 or next(iter(value)) not in keys:
            raise APIError('structured_outputs must be {"regex": ...}, {"choice": [...]} or {"json": {...}}', name)
        key = next(iter(value))
        name, value = {"regex": "guided_regex", "choice": "guided_choice", "json": "guided_json"}[key], value[key]
        if key == "regex" and not isinstance(value, str):
            raise APIError(f"structured_outputs.regex must be a string, got {shown(value)}", "structured_outputs")
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(f"{name} must be a non-empty list of non-empty strings, got {shown(value)}", name)
        return {"choice": value, "field": name}
    if name == "guided_json":
        if not isinstance(value, (dict, str)):
            raise APIError(f"{name} must be a JSON schema (an object, or its text), got {shown(value)}", name)
        return {"json_schema": value, "field": name}
    return {"regex": value, "field": name}


def logit_bias(bias: dict) -> dict:
    """OpenAI's logit_bias, {"token id": bias}, as the engine takes it: {token id: bias} (the engine checks the
    biases, at most 300 entries, and the ids against the vocabulary)."""
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise APIError(
                f'logit_bias maps token ids, written as strings ("50256"), to biases in [-100, 100]; got the key '
                f"{shown(key)}",
                "logit_bias",
            )
        out[int(key)] = value
    return out


def stop_token_ids(ids) -> tuple[int, ...]:
    """vLLM's stop_token_ids: a list of token ids (the engine checks them against the vocabulary)."""
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)
    ):
        raise APIError(
            f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got {shown(ids)}",
            "stop_token_ids",
        )
    return tuple(ids)


def completion_job(body, tokenizer, n_positions: int) -> Job:
    """A `/v1/completions` request: `prompt` is a text, token ids, or a list holding one of them."""
    fields = checked_fields(body, COMPLETION)
    for name, allowed in (("echo", False), ("best_of", 1), ("suffix", None)):
        if name in fields and fields[name] != allowed:
            raise APIError(f"{name} is not supported", name)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = encode_prompt(tokenizer, prompt, n_positions)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise APIError(
            "prompt must be a string or a non-empty list of token ids (one prompt per request: send a batch "
            "as several requests)",
            "prompt",
        )
    logprobs = fields.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise APIError(f"logprobs must be between 0 and 5, got {logprobs}", "logprobs")
    settings = sampling_settings(fields, n_positions, len(ids), COMPLETION_MAX_TOKENS)
    options = fields.get("stream_options", {})
    return Job(ids, settings, fields.get("stream", False), options.get("include_usage", False), logprobs,
               n=fields.get("n", 1), constraint=constraint_fields(fields))  # fmt: skip


def chat_job(body, tokenizer, n_positions: int) -> Job:
    """A `/v1/chat/completions` request: the messages rendered by the model's chat template."""
    fields = checked_fields(body, CHAT)
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(
            "this model has no chat template (tokenizer_config.json's chat_template), so it cannot chat: "
            "use /v1/completions, or serve a chat model",
            "messages",
        )
    messages = chat_messages(fields.get("messages"))
    if "max_completion_tokens" in fields:  # OpenAI's newer name for max_tokens
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    ids = encode_messages(tokenizer, messages, n_positions)
    logprobs = None
    if fields.get("logprobs", False):
        logprobs = fields.get("top_logprobs", 0)
        if not 0 <= logprobs <= 20:
            raise APIError(f"top_logprobs must be between 0 and 20, got {logprobs}", "top_logprobs")
    elif "top_logprobs" in fields:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    settings = sampling_settings(fields, n_positions, len(ids), CHAT_MAX_TOKENS)
    options = fields.get("stream_options", {})
    return Job(ids, settings, fields.get("stream", False), options.get("include_usage", False), logprobs, chat=True,
               n=fields.get("n", 1), constraint=constraint_fields(fields))  # fmt: skip


def chat_messages(messages) -> list[dict]:
    """The conversation as the chat template takes it: role and text content (OpenAI's text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {role, content} messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise APIError(f"{where} must be {{role, content}} (and an optional name)", where)
        if m.get("role") not in ROLES:
            raise APIError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {shown(m.get('role'))}", f"{where}.role"
            )
        content = m.get("content")
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str) for p in content
        ):
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise APIError(
                f'{where}.content must be a string (or a list of {{"type": "text", "text": "..."}} parts)',
                f"{where}.content",
            )
        message = {"role": ROLES[m["role"]], "content": content}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str) or not NAME.fullmatch(name) or name != name.strip():
                raise APIError(
                    f"{where}.name must be a name of letters, digits, spaces, _ . ' or - (at most 64, no newline or "
                    f"colon), got {shown(name)}",
                    f"{where}.name",
                )
            message["name"] = name
        out.append(message)
    return out


def too_long(count: int, n_positions: int, param: str, at_least: bool = False) -> APIError:
    """The prompt does not fit the context (sampling_settings' message)."""
    return APIError(
        f"the prompt takes {'at least ' if at_least else ''}{count} tokens, but the model's context is "
        f"{n_positions} tokens: shorten it",
        param,
    )


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> Optional[int]:
    """The most UTF-8 bytes one token stands for (None: unknown): a text of B bytes has at least B / that many
    tokens, so a text far too long for the context is refused without tokenizing it."""
    try:
        if hasattr(tokenizer, "token_byte_values"):  # tiktoken
            specials = [t.encode() for t in tokenizer.special_tokens_set]
            return max(map(len, [*tokenizer.token_byte_values(), *specials]))
        if hasattr(tokenizer, "token_bytes") and hasattr(tokenizer, "n_vocab"):  # HFTokenizer
            return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab))
    except Exception:  # a learner's tokenizer (serve --parts) may not have what this needs: no bound then
        pass
    return None


def surely_too_long(tokenizer, texts: list[str], n_positions: int, param: str) -> None:
    """Refuse texts whose bytes alone prove that they do not fit: a 1 MB prompt for a context of 256 tokens
    is answered at once instead of tokenized for a second."""
    try:
        longest = longest_token(tokenizer)
    except TypeError:  # a tokenizer that cannot be hashed (cached)
        return
    size = sum(len(t.encode("utf-8", "replace")) for t in texts)
    if longest and size > n_positions * longest:
        raise too_long(size // longest, n_positions, param, at_least=True)


def encode_prompt(tokenizer, text: str, n_positions: int, add_special_tokens: bool = True) -> list[int]:
    """A completion prompt's ids (special tokens written in it are special: the client writes the whole prompt).
    add_special_tokens: those a tokenizer.json's post-processor adds (Llama 3's BOS; GPT-2's tokenizer adds none)."""
    surely_too_long(tokenizer, [text], n_positions, "prompt")
    try:
        if hasattr(tokenizer, "plain_tokenizer"):  # HFTokenizer: no list of ids for a prompt that cannot fit
            return tokenizer.encode(
                text, allowed_special="all", add_special_tokens=add_special_tokens, max_tokens=n_positions
            )
        return tokenizer.encode(text, allowed_special="all")
    except ValueError as err:  # TooManyTokens
        raise too_long(getattr(err, "count", 0), n_positions, "prompt") from None


def encode_messages(tokenizer, messages: list[dict], n_positions: int, add_generation_prompt: bool = True) -> list[int]:
    """The conversation's ids through the model's chat template; the messages' text never becomes a special
    token (`HFTokenizer.encode_chat_plain`). Unlike transformers' apply_chat_template, which parses a typed
    `<|eot_id|>` as the real one, on purpose."""
    surely_too_long(tokenizer, [v for m in messages for v in m.values()], n_positions, "messages")
    try:
        if hasattr(tokenizer, "encode_chat_plain"):
            return tokenizer.encode_chat_plain(messages, add_generation_prompt, max_tokens=n_positions)
        return tokenizer.encode_chat(messages, add_generation_prompt)
    except ValueError as err:  # ChatTemplateError: the template refused the conversation; TooManyTokens
        if hasattr(err, "count"):
            raise too_long(err.count, n_positions, "messages") from None
        raise APIError(str(err), "messages") from None


def engine_error(err: ValueError) -> APIError:
    """A setting the engine refused (`SamplingParams`' message), named by its OpenAI field."""
    message = str(err).replace("max_new_tokens", "max_tokens")
    field = "prompt" if message.startswith("the prompt") else message.split()[0] if message.split() else None
    return APIError(message, field if field in COMMON or field == "prompt" else None)


# -- responses -------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def token_bytes(tokenizer, token: int) -> list[int]:
    """The bytes of one token (tiktoken's GPT-2 and `HFTokenizer` both know them), as OpenAI lists them."""
    if hasattr(tokenizer, "decode_single_token_bytes"):
        return list(tokenizer.decode_single_token_bytes(token))
    return list(tokenizer.token_bytes(token))


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def entry(token: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": token_bytes(tokenizer, token)}

    return {
        "content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
            for t, lp in zip(tokens, logprobs)
        ]
    }


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list, offset: int) -> dict:
    """The completions route's `logprobs`: parallel lists of tokens, their logprobs, the top alternatives as
    {text: logprob}, and each token's character offset in the text (from `offset`)."""
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(tokenizer, i): v for i, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def envelope(rid: str, kind: str, model: str, **fields) -> dict:
    """What every response and streamed chunk carries: its id, its object type, when, which model."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, **fields}


class Choice(NamedTuple):
    """One choice of a whole response: its text, why it ended, its logprobs (None: not asked)."""

    text: str
    finish: str
    logprobs: Optional[dict]


def completion_response(rid: str, model: str, choices: list[Choice], use: dict) -> dict:
    """A completion's response: one entry per choice (n), in order, each with its index."""
    entries = [
        {"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish} for i, c in enumerate(choices)
    ]
    return envelope(rid, "text_completion", model, choices=entries, usage=use)


def chat_response(rid: str, model: str, choices: list[Choice], use: dict) -> dict:
    """A chat completion's response: one message per choice (n), in order, each with its index."""
    entries = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": c.logprobs,
            "finish_reason": c.finish,
        }
        for i, c in enumerate(choices)
    ]
    return envelope(rid, "chat.completion", model, choices=entries, usage=use)


def chunk(
    job: Job, rid: str, model: str, text: Optional[str], logprobs=None, finish=None, first=False, index: int = 0
) -> dict:
    """One server-sent event of a stream: a piece of choice `index`'s text (None: its closing chunk), or its opening
    role chunk. With n > 1 the choices' chunks interleave as their tokens come; `index` tells them apart."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return envelope(rid, chunk_kind(job), model, choices=[choice])


def usage_chunk(job: Job, rid: str, model: str, use: dict) -> dict:
    return envelope(rid, chunk_kind(job), model, choices=[], usage=use)


def chunk_kind(job: Job) -> str:
    return "chat.completion.chunk" if job.chat else "text_completion"
