"""llama-shakespeare's own vocabulary and chat template: a conversation is a scene.

The vocabulary is byte-level BPE trained on the training plays by `llmcourse.engine.bpe_training.train_bpe`
(the course's algorithm, with incremental counts), on chunks cut by GPT-2's pattern plus one rule: a blank
line ("\\n\\n") is a chunk, hence a token, of its own. In the corpus a blank line ends every speech, so the model
learns that token as the end of a turn. `<|endoftext|>` (the corpus's document separator) is the last id.

The chat template writes each message as a speech: the user speaks as ROMEO, the model answers as JULIET (a
message's `name`, or the template variables `user_name` / `assistant_name`, choose other characters), a system
message is a stage direction in brackets. The generation prompt ends at the answering character's `NAME:` line,
and the reply ends at the blank-line token, which generation_config.json lists as an EOS id beside
`<|endoftext|>`:

    <|endoftext|>ROMEO:
    What light through yonder window breaks?

    JULIET:
    ⟨the model's speech⟩⏎⏎        <- "\\n\\n": an EOS id, the speech is over
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcourse.engine.bpe_training import SPLIT_PATTERN, BPETokenizer, train_bpe
from llmcourse.engine.tokenizer import EOT

BLANK_LINE = "\n\n"
USER_NAME, ASSISTANT_NAME = "ROMEO", "JULIET"

# A speech ends at a blank line, so no message may hold one: the template writes a message's lines without the
# blank ones (any run of newlines becomes one), a name on one line, and leaves out a speech with no text (its
# speaker's name would stand right before a blank line), so that nothing a message says can end its speech and
# open another (a "\n\n\nJULIET:" in a user's message would forge the model's turn).
CHAT_TEMPLATE = (
    "{%- macro lines(text) -%}"
    "{%- for line in (text | trim).split('\n') if line | trim -%}"
    "{{- '\n' if not loop.first -}}{{- line -}}"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[' + lines(message['content']) + ']\n\n' -}}"
    "{%- else -%}"
    "{%- set text = lines(message['content']) -%}"
    "{%- if text -%}"
    "{%- if message['name'] is defined -%}{%- set speaker = message['name'].split() | join(' ') -%}"
    "{%- elif message['role'] == 'user' -%}{%- set speaker = user_name | default('" + USER_NAME + "') -%}"
    "{%- else -%}{%- set speaker = assistant_name | default('" + ASSISTANT_NAME + "') -%}"
    "{%- endif -%}"
    "{{- speaker | upper + ':\n' + text + '\n\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- assistant_name | default('" + ASSISTANT_NAME + "') | upper + ':\n' -}}"
    "{%- endif -%}"
)


def train_tokenizer(text: str, vocab_size: int) -> BPETokenizer:
    """A byte-level BPE tokenizer of `vocab_size` ids trained on `text`: 256 bytes, vocab_size - 257 merges,
    then `<|endoftext|>`.

        >>> tok = train_tokenizer("ROMEO:\\nHello.\\n\\nJULIET:\\nHello.\\n", 270)
        >>> tok.n_vocab, tok.encode("<|endoftext|>")
        (270, [269])
    """
    merges = train_bpe(text, vocab_size - 257, SPLIT_PATTERN)
    tokenizer = BPETokenizer(merges, SPLIT_PATTERN, {EOT: 256 + len(merges)})
    if tokenizer.n_vocab != vocab_size:
        raise ValueError(f"the text gives only {len(merges)} merges; train on more text or ask for fewer ids")
    return tokenizer


def eos_token_ids(tokenizer: BPETokenizer) -> list[int]:
    """The ids that end a reply: `<|endoftext|>` and the blank line (a speech's end)."""
    blank = tokenizer.encode(BLANK_LINE)
    if len(blank) != 1:
        raise ValueError("the blank line is not one token in this vocabulary: train the tokenizer on more text")
    return [tokenizer.special_tokens[EOT], blank[0]]


def save_tokenizer(tokenizer: BPETokenizer, folder: Path, n_positions: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (special tokens, the chat template) and generation_config.json
    (the EOS ids) as transformers' `save_pretrained` would."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(folder / "tokenizer.json")
    eot = tokenizer.special_tokens[EOT]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "model_max_length": n_positions,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(eot): {
                "content": EOT,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(folder / "tokenizer_config.json", config)
    generation = {"bos_token_id": eot, "eos_token_id": eos_token_ids(tokenizer), "pad_token_id": eot}
    write_json(folder / "generation_config.json", generation)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
