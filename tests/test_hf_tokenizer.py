"""HFTokenizer against transformers, on tokenizer folders built here in the real formats (nothing downloaded).

Three tokenizers, each trained in a fraction of a second on Shakespeare with the `tokenizers` library and
written out as the published models' files are:

- Llama 3 / 3.1: byte-level BPE with Llama 3's split pattern, 256-style special tokens (<|begin_of_text|>,
  <|eot_id|>, <|start_header_id|> ...), a post-processor that adds <|begin_of_text|>, several EOS ids;
- Qwen2.5: byte-level BPE with NFC and Qwen's split pattern, ChatML tokens, no BOS;
- Llama 2: SentencePiece-style BPE (`▁` metaspace, <0xNN> byte fallback), add_bos_token in the config.

The chat templates are the published ones (Llama 3, Llama 3.1, Qwen2.5, Llama 2), typed in.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from llmcourse.engine.hf_tokenizer import ChatTemplateError, HFTokenizer, load_tokenizer
from llmcourse.engine.tokenizer import TokenizerFileError

CORPUS = (Path(__file__).resolve().parents[1] / "llmcourse" / "data" / "shakespeare_val.txt").read_text()[:60_000]

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = QWEN_PATTERN.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)  # Llama 3 groups up to three digits
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]
QWEN_NOT_SPECIAL = ["<tool_call>", "</tool_call>"]  # added tokens that Qwen2.5 marks "special": false

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# meta-llama/Llama-3.1-8B-Instruct
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

# Qwen/Qwen2.5-7B-Instruct
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# meta-llama/Llama-2-7b-chat-hf
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

TEXTS = [
    "Hello world",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "  leading spaces, trailing spaces  ",
    "I ❤ 🦙 — naïve café, 世界, Ελληνικά, ｆｕｌｌ ｗｉｄｔｈ",
    "tabs\tand\r\nnewlines\n\n\nand 1234567 digits",
    "e\u0301 (a combining accent: NFC makes it é for Qwen)",
    "special tokens in text: <|eot_id|> <|im_end|> <|begin_of_text|><s></s>",
    "",
    " ",
    "🦙🦙🦙",
]

CHATS = [
    [{"role": "user", "content": "What light through yonder window breaks?"}],
    [
        {"role": "system", "content": "You speak as Juliet."},
        {"role": "user", "content": "  Wherefore art thou?  "},
    ],
    [
        {"role": "system", "content": "Be brief. 🦙"},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Good morrow, 世界."},
        {"role": "user", "content": "And again: <|eot_id|> <|im_end|>"},
    ],
]


def train_bpe(pre_tokenizer, vocab_size=600, **trainer):
    """A BPE model's vocabulary and merges, trained on CORPUS with this pre-tokenizer."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS.splitlines(), trainers.BpeTrainer(vocab_size=vocab_size, **trainer))
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], model["merges"]


def write_folder(folder: Path, tok, config: dict, generation: dict | None = None) -> Path:
    """A model folder's tokenizer files: tokenizer.json, tokenizer_config.json (with added_tokens_decoder, as
    save_pretrained writes it), generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = json.loads(tok.to_str())["added_tokens"]
    decoder = {str(t.pop("id")): t for t in added}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder, **config}, indent=2))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def byte_level_tokenizer(pattern: str, special: list[str], not_special=(), nfc=False, bos=None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    vocab, merges = train_bpe(pre, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab, [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in merges]))
    tok.normalizer = normalizers.NFC() if nfc else None
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in not_special])
    byte_level = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    if bos is None:
        tok.post_processor = byte_level
    else:  # Llama 3: ByteLevel then TemplateProcessing adding <|begin_of_text|>
        bos_id = tok.token_to_id(bos)
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def sentencepiece_tokenizer():
    """Llama 2's layout: <unk>, <s>, </s>, then the 256 byte tokens <0x00>...<0xFF>, then the pieces (▁ = space)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    vocab, merges = train_bpe(metaspace, vocab_size=500, limit_alphabet=60)  # few characters: byte fallback in use
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [p for p in sorted(vocab, key=vocab.get) if p not in pieces]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in merges]
    tok = Tokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    llama3 = byte_level_tokenizer(LLAMA3_PATTERN, LLAMA3_SPECIAL, bos="<|begin_of_text|>")
    ids = {t: llama3.token_to_id(t) for t in LLAMA3_SPECIAL}
    llama3_config = dict(
        bos_token="<|begin_of_text|>",
        clean_up_tokenization_spaces=True,
        eos_token="<|eot_id|>",
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=131072,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    llama3_eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    qwen = byte_level_tokenizer(QWEN_PATTERN, QWEN_SPECIAL, not_special=QWEN_NOT_SPECIAL, nfc=True)
    qwen_ids = {t: qwen.token_to_id(t) for t in QWEN_SPECIAL}
    qwen_config = dict(
        add_bos_token=False,
        add_prefix_space=False,
        additional_special_tokens=QWEN_SPECIAL[1:],
        bos_token=None,
        chat_template=QWEN25_TEMPLATE,
        clean_up_tokenization_spaces=False,
        eos_token="<|im_end|>",
        errors="replace",
        model_max_length=131072,
        pad_token="<|endoftext|>",
        split_special_tokens=False,
        tokenizer_class="Qwen2Tokenizer",
        unk_token=None,
    )
    added = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    llama2_config = dict(
        add_bos_token=True,
        add_eos_token=False,
        bos_token={"content": "<s>", **added},
        chat_template=LLAMA2_TEMPLATE,
        clean_up_tokenization_spaces=False,
        eos_token={"content": "</s>", **added},
        legacy=False,
        model_max_length=1000000000000000019884624838656,
        pad_token=None,
        sp_model_kwargs={},
        tokenizer_class="LlamaTokenizer",
        unk_token={"content": "<unk>", **added},
    )
    return {
        "llama3": write_folder(
            root / "llama3",
            llama3,
            {**llama3_config, "chat_template": LLAMA3_TEMPLATE},
            {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]},
        ),
        "llama31": write_folder(
            root / "llama31",
            llama3,
            {**llama3_config, "chat_template": LLAMA31_TEMPLATE},
            {"bos_token_id": ids["<|begin_of_text|>"], "do_sample": True, "eos_token_id": llama3_eos},
        ),
        "qwen25": write_folder(
            root / "qwen25",
            qwen,
            qwen_config,
            {"eos_token_id": [qwen_ids["<|im_end|>"], qwen_ids["<|endoftext|>"]], "pad_token_id": 0},
        ),
        "llama2": write_folder(
            root / "llama2", sentencepiece_tokenizer(), llama2_config, {"bos_token_id": 1, "eos_token_id": 2}
        ),
    }


@pytest.fixture(scope="module")
def pairs(folders) -> dict[str, tuple[HFTokenizer, object]]:
    """Each folder's (our tokenizer, transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: (HFTokenizer.from_folder(f), AutoTokenizer.from_pretrained(f)) for name, f in folders.items()}


NAMES = ["llama3", "llama31", "qwen25", "llama2"]


@pytest.mark.parametrize("name", NAMES)
def test_encode_and_decode_equal_transformers(pairs, name):
    ours, theirs = pairs[name]
    for text in TEXTS + CORPUS[:3000].split("\n\n"):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), (name, text)
        assert ids == theirs(text)["input_ids"], (name, text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids), (name, text)


def test_bos_as_transformers_adds_it(pairs):
    """Llama 3 adds <|begin_of_text|> (its post-processor), Llama 2 adds <s> (add_bos_token), Qwen adds none."""
    assert pairs["llama3"][0].encode("Hi")[0] == pairs["llama3"][0].bos_token_id
    assert pairs["llama2"][0].encode("Hi")[0] == 1
    assert pairs["qwen25"][0].bos_token is None and len(pairs["qwen25"][0].encode("a")) == 1


def test_special_tokens_in_text(pairs):
    """With allowed_special="all" (the engine's call) a special token written in the text is one id; with
    none allowed it is plain text, as transformers' split_special_tokens=True encodes it."""
    tok, theirs = pairs["llama3"]
    eot = tok.tokenizer.token_to_id("<|eot_id|>")
    assert tok.encode("a<|eot_id|>b", allowed_special="all").count(eot) == 1
    plain = tok.encode("a<|eot_id|>b", allowed_special=())
    assert eot not in plain and tok.decode(plain) == "<|begin_of_text|>a<|eot_id|>b"
    assert plain == theirs("a<|eot_id|>b", split_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_streaming_decode_is_the_whole_decode(pairs, name):
    """Token by token, the pieces join to `decode` of all ids and no piece holds half a character (byte-level
    tokens and <0xNN> byte-fallback tokens of emoji and CJK included)."""
    tok = pairs[name][0]
    for text in TEXTS + ["🦙" * 5 + " a" + "世界" * 3, CORPUS[:500]]:
        ids = tok.encode(text)
        dec = tok.stream_decoder()
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == tok.decode(ids), (name, text)
        assert not any("\ufffd" in p for p in pieces), (name, text, pieces)


def test_byte_fallback_tokens_are_used_and_held_back(pairs):
    tok = pairs["llama2"][0]
    ids = tok.encode("🦙")
    assert [tok.tokenizer.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids[-4:]] == ["", "", "", "🦙"]
    dec = tok.stream_decoder()
    assert dec.push(ids[-4]) == "" and dec.flush() == "\ufffd" == tok.decode(ids[-4:-3])  # a cut-off character


def test_streaming_keeps_llama2_spaces(pairs):
    """`▁` is a space between words but not at the start of the text (the Strip decoder)."""
    tok = pairs["llama2"][0]
    ids = tok.encode("To be, or not to be", add_special_tokens=False)
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "To be, or not to be"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(pairs, name, add_generation_prompt):
    ours, theirs = pairs[name]
    for chat in CHATS:
        if name == "llama2" and chat[-1]["role"] == "assistant":
            continue
        text = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        expected = theirs.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert text == expected, (name, chat)
        ids = ours.encode_chat(chat, add_generation_prompt=add_generation_prompt)
        encoded = theirs.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, return_dict=True)
        assert ids == encoded["input_ids"], (name, chat)
        assert ours.apply_chat_template(chat, add_generation_prompt, tokenize=True) == ids


def test_chat_ids_have_one_bos(pairs):
    tok = pairs["llama31"][0]
    ids = tok.encode_chat(CHATS[0])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_variables_tools_and_exceptions(pairs):
    """Keyword arguments are template variables (Llama 3.1's date_string, tools rendered by tojson with indent),
    and a template's raise_exception is an error naming what the template said."""
    ours, theirs = pairs["llama31"]
    tool = {"type": "function", "function": {"name": "weather", "description": "Wetter in München", "parameters": {}}}
    for kwargs in [dict(date_string="1 Jan 2025"), dict(tools=[tool]), dict(tools=[tool], tools_in_user_message=False)]:
        expected = theirs.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(CHATS[1], **kwargs) == expected
    assert "München" in ours.apply_chat_template(CHATS[1], tools=[tool])  # tojson keeps non-ASCII characters
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        pairs["llama2"][0].apply_chat_template([{"role": "assistant", "content": "Hi"}])
    qwen, qwen_theirs = pairs["qwen25"]
    expected = qwen_theirs.apply_chat_template(CHATS[0], tools=[tool], add_generation_prompt=True, tokenize=False)
    assert qwen.apply_chat_template(CHATS[0], tools=[tool]) == expected


def test_eos_ids_from_generation_config(pairs, folders):
    llama31 = pairs["llama31"][0]
    names = [llama31.tokenizer.id_to_token(i) for i in llama31.eos_token_ids]
    assert names == ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    llama3 = pairs["llama3"][0]  # generation_config lists two; the tokenizer's eos (<|eot_id|>) is one of them
    assert [llama3.tokenizer.id_to_token(i) for i in llama3.eos_token_ids] == ["<|end_of_text|>", "<|eot_id|>"]
    qwen = pairs["qwen25"][0]
    assert [qwen.tokenizer.id_to_token(i) for i in qwen.eos_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    assert pairs["llama2"][0].eos_token_ids == (2,)


def test_a_folder_without_generation_config_ends_at_the_tokenizers_eos(folders, tmp_path):
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        (tmp_path / name).write_bytes((folders["qwen25"] / name).read_bytes())
    tok = HFTokenizer.from_folder(tmp_path)
    assert tok.eos_token_ids == (tok.tokenizer.token_to_id("<|im_end|>"),)


def test_missing_or_corrupt_files_are_named(folders, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerFileError, match="tokenizer.json.*copy the model's tokenizer.json"):
        HFTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((folders["llama3"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json is not valid JSON"):
        HFTokenizer.from_folder(tmp_path)


def test_no_chat_template_is_a_clear_error(folders, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folders["llama3"] / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HFTokenizer.from_folder(tmp_path).apply_chat_template(CHATS[0])


def test_load_tokenizer_picks_the_folders_tokenizer(folders, tmp_path):
    """A model folder with tokenizer.json gets it; a GPT-2 folder without one gets GPT-2's; a Llama folder
    without one is an error naming the file."""
    from llmcourse import get_tokenizer

    assert load_tokenizer("gpt2-shakespeare") is get_tokenizer()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(TokenizerFileError, match="has no tokenizer.json: a llama model needs its own tokenizer"):
        load_tokenizer(model)
    for f in folders["llama31"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    tok = load_tokenizer(model)
    assert isinstance(tok, HFTokenizer) and len(tok.eos_token_ids) == 3
