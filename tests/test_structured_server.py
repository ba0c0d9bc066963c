"""Structured output through the server (OpenAI's `response_format`, vLLM's `guided_*` and `structured_outputs`) with
the official `openai` client, and through `generate --json-schema / --regex / --choice`. Every JSON answer is
validated with `jsonschema` and equals the engine run alone with the same constraint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from llmcourse import load_model
from llmcourse.engine.generate import generate_text
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.structured.constraint import compile_constraint
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread", "server_log")
MODEL = "llama-shakespeare"
ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "llmcourse" / "data" / "person.schema.json"


class Character(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=16)
    age: int
    mood: Literal["merry", "sad"]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    with ServerThread(build_app(LLMEngine(model, tokenizer=tokenizer, max_num_seqs=8), tokenizer, MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), model, tokenizer


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def test_the_clients_parse_helper_gets_a_valid_pydantic_object(served):
    client, model, tok = served
    for seed in range(3):
        reply = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Who art thou?"}],
            response_format=Character,
            max_tokens=100,
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Character)
        schema = Character.model_json_schema()
        alone = generate_text(model, tok, chat_ids(tok, "Who art thou?"), max_new_tokens=100, temperature=1.0,
                              seed=seed, constraint=compile_constraint(tok, json_schema=schema))  # fmt: skip
        assert choice.message.content == alone


def test_json_object_streams_json_and_json_schema_validates(served):
    client, _, _ = served
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Speak!"}],
        response_format={"type": "json_object"},
        stream=True,
        max_tokens=200,
        seed=4,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason == "stop" and len(chunks) > 3  # streamed piece by piece
    assert isinstance(json.loads("".join(c.delta.content or "" for c in chunks)), dict)
    schema = json.loads(SCHEMA_FILE.read_text())
    reply = client.completions.create(
        model=MODEL,
        prompt="ROMEO:",
        max_tokens=150,
        seed=5,
        n=3,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)


def test_vllms_guided_fields_and_structured_outputs(served):
    client, model, tok = served
    reply = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=10, extra_body={"guided_choice": ["aye", "nay"]}
    )
    assert reply.choices[0].text in ("aye", "nay") and reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, temperature=0.9, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}})  # fmt: skip
    alone = generate_text(model, tok, tok.encode("ROMEO:"), max_new_tokens=20, temperature=0.9, seed=2,
                          constraint=compile_constraint(tok, regex="[0-9]{3}-[a-z]{2,4}"))  # fmt: skip
    assert reply.choices[0].text == alone and len(alone) >= 6
    reply = client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=3, extra_body={"guided_regex": "[a-z]{30}"}
    )
    assert reply.choices[0].finish_reason == "length"  # 3 tokens cannot finish it: never reported as complete


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "date"}},
                }
            },
            "response_format",
            "the keyword 'format' is not supported",
        ),  # fmt: skip
        ({"response_format": {"type": "xml"}}, "response_format", 'must be {"type": "text"}'),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "is not supported"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one of guided_regex and guided_choice"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs", '{"regex": ...}'),
        ({"guided_regex": "[ab]*a[ab]{14}"}, "guided_regex", "more than 10,000"),
    ],
)
def test_a_structure_the_server_cannot_follow_is_a_400_naming_it(served, extra, param, words):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2).choices  # and the server goes on


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmcourse", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_generate_on_the_command_line_follows_the_structure():
    done = run_generate("ROMEO:", "--json-schema", str(SCHEMA_FILE), "--seed", "1")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), json.loads(SCHEMA_FILE.read_text()))
    done = run_generate("Is it love?", "--choice", "yes", "no", "--model", MODEL)
    assert done.returncode == 0 and done.stdout.strip() in ("yes", "no"), done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--regex", "a(?=b)"], "--regex: the group '(?=' at 1 is not supported"),
        (["--json-schema", "missing.json"], "--json-schema: cannot read missing.json"),
        (["--regex", "a", "--choice", "b"], "not allowed with argument"),
    ],
)
def test_generate_says_what_is_wrong_with_the_structure(args, message):
    done = run_generate("ROMEO:", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
