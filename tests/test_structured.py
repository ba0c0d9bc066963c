"""Structured output (`llmcourse.engine.structured`): regexes to byte automata, the token index, JSON schemas, and
constrained generation in `generate`, `LLMEngine` and speculative decoding.

References: Python's `re` for the automata (random strings, and strings drawn from the automaton itself),
outlines-core for the token index (a joint walk from the start: equal allowed sets and consistent transitions),
`jsonschema` for every JSON output, a chi-square test for constrained sampling, and `generate` alone for the engine.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from outlines_core import Index
from outlines_core import Vocabulary as OutlinesVocabulary

from llmcourse import load_model
from llmcourse.engine.generate import generate, generate_text
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.sampling import ENGINE_SAMPLER, SamplingParams
from llmcourse.engine.structured.constraint import Guide, compile_constraint, mask_rows_, vocabulary
from llmcourse.engine.structured.json_schema import SchemaError, schema_regex
from llmcourse.engine.structured.regex import RegexError, compile_regex
from llmcourse.serving.llm_engine import LLMEngine

from .test_speculative import chi_square_p_value

PATTERNS = [
    r"(yes|no)!?",
    r"[0-9]{1,3}(\.[0-9]+)?",
    r"a*b+c?",
    r"(ab|a)*",
    r'"([^"\\]|\\["\\/bfnrt])*"',
    r"[a-c]{2,4}x",
    r"(a|b)*abb",
    r".{0,3}z",
    r"é+|ñ|日本",
    r"\d+\.\d*",
    r"[^a-z]+",
    r"\(\[\{\}\]\)\x41\u00e9",
    r"(?:ab){2}(?:c|d){1,}",
]
ALPHABET = list('abcdxyz!19."\\/()[]{}Aé日本ñ \n')
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "mood": {"enum": ["merry", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "height": {"type": "number"},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def random_match(dfa, rng: random.Random, most: int = 40) -> bytes:
    """Bytes drawn from the automaton: a random walk that stops in an accepting state (every state can reach one)."""
    state, out = 0, bytearray()
    while True:
        if dfa.accepting[state] and (rng.random() < 0.3 or len(out) > most):
            return bytes(out)
        choices = np.nonzero(dfa.next[state] >= 0)[0]
        if len(choices) == 0:
            return bytes(out)
        byte = int(rng.choice(list(choices)))
        out.append(byte)
        state = int(dfa.next[state, byte])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_automaton_matches_what_python_re_matches(pattern):
    dfa, rng = compile_regex(pattern), random.Random(pattern)
    for _ in range(300):  # random texts: mostly not matches
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        assert dfa.matches(text.encode()) == bool(re.fullmatch(pattern, text)), (pattern, text)
    for _ in range(100):  # the automaton's own matches: each one Python's too, and valid UTF-8
        data = random_match(dfa, rng)
        assert re.fullmatch(pattern, data.decode("utf-8")), (pattern, data)


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("^ab", "the anchor '^' at 0"),
        ("a(?=b)", "the group '(?=' at 1"),
        (r"(a)\1", r"the escape \1 at 3"),
        ("[é-ü]", "goes beyond ASCII"),
        ("a{3,1}", "out of range"),
        ("(ab", "not closed"),
        ("*a", "repeats nothing"),
        ("[^é]", "negated class with characters beyond ASCII"),
        ("((a{0,1000}){0,1000}){0,1000}", "more than 200,000 automaton states"),  # a hostile client: no hang,
        ("[ab]*a[ab]{14}", "32,768 automaton states, more than 10,000"),  # no gigabytes of index
    ],
)
def test_what_the_compiler_refuses_it_names(pattern, message):
    with pytest.raises(RegexError, match=re.escape(message)):
        compile_regex(pattern)


# -- the token index against outlines-core ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2-shakespeare", "llama-shakespeare"])
def tokenizer(request):
    return load_tokenizer(request.param)


def outlines_index(tokenizer, pattern: str) -> Index:
    vocab = vocabulary(tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for piece, i in zip(vocab.pieces, vocab.ids):
        by_bytes.setdefault(piece, []).append(i)
    eos = max(vocab.ids) + 1  # a token id that is not text: outlines-core's EOS
    return Index(pattern, OutlinesVocabulary(eos, by_bytes)), eos


# Regexes on which a token never passes through a complete text and goes on (see the divergence test below), and
# two JSON schemas' regexes (a JSON value's only complete state is its end).
ISOMORPHIC = [
    r"(yes|no|maybe)",
    r'"([^"\\]|\\["\\/bfnrt])*"',
    r"[a-z]{3,8}",
    r"\[[0-9]{1,2}(, [0-9]{1,2}){0,3}\]",
    r"(Romeo|Juliet|Nurse): [A-Z][a-z ]{0,20}\.",
    schema_regex({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}),
    schema_regex({"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 3}),
]


@pytest.mark.parametrize("pattern", ISOMORPHIC)
def test_the_token_index_is_isomorphic_to_outlines_cores(tokenizer, pattern):
    """A joint walk from both start states over every allowed token, pair of states by pair of states: the same
    tokens allowed and the same completeness in every pair reached. outlines-core does not minimize its automaton
    (one of the engine's states may pair with several of its equivalent ones), so the walk is a bisimulation, and
    each of its states pairs with exactly one of the engine's: the engine's index is its minimal form (on the plain
    regexes both have as many states, paired one to one; on the schemas' it has 45 and 29 where the engine has 31
    and 26)."""
    ours = compile_constraint(tokenizer, regex=pattern).index
    theirs, eos = outlines_index(tokenizer, pattern)
    transitions = theirs.get_transitions()
    start = (0, theirs.get_initial_state())
    seen, todo, mine_of = {start}, [start], {}
    while todo:
        state, other = todo.pop()
        assert mine_of.setdefault(other, state) == state, f"outlines-core's state {other} is two of the engine's"
        allowed = {t: s for t, s in transitions.get(other, {}).items() if t != eos}
        mine = dict(zip(ours.tokens[state].tolist(), ours.targets[state].tolist()))
        assert set(mine) == set(allowed), f"state {state}: {len(mine)} tokens allowed here, {len(allowed)} there"
        assert bool(ours.accepting[state]) == theirs.is_final_state(other)
        for token, target in mine.items():
            pair = (target, allowed[token])
            if pair not in seen:
                seen.add(pair)
                todo.append(pair)
    assert set(mine_of.values()) == set(ours.reachable())  # every state the engine's tokens reach was compared
    if pattern in ISOMORPHIC[:5]:  # plain regexes: outlines-core's automaton is minimal too, the pairing one to one
        assert len(mine_of) == len(ours.reachable())


def test_where_outlines_core_refuses_a_valid_continuation(tokenizer):
    """The one difference found: outlines-core 0.2 refuses a token whose bytes pass through a complete text and go
    on to an incomplete one ("." after "1" in `[0-9]+(\\.[0-9]+)?`), though "1." continues to "1.5". The engine's
    index follows the language: it allows "." there."""
    pattern = r"[0-9]+(\.[0-9]+)?"
    ours = compile_constraint(tokenizer, regex=pattern).index
    theirs, _ = outlines_index(tokenizer, pattern)
    vocab = vocabulary(tokenizer)
    one, dot = (vocab.ids[vocab.pieces.index(piece)] for piece in (b"1", b"."))
    after_one = ours.next_state(0, one)
    assert ours.next_state(after_one, dot) >= 0 and not ours.accepting[ours.next_state(after_one, dot)]
    assert dot not in theirs.get_transitions()[theirs.get_transitions()[theirs.get_initial_state()][one]]


def test_compiled_constraints_are_cached_per_tokenizer_and_constraint(tokenizer):
    first = compile_constraint(tokenizer, choice=["a", "b"])
    assert compile_constraint(tokenizer, choice=["a", "b"]) is first
    assert compile_constraint(tokenizer, choice=["a", "bb"]) is not first


# -- JSON schemas ------------------------------------------------------------------------------------------------


def test_every_text_the_schema_automaton_accepts_validates():
    dfa, rng = compile_regex(schema_regex(SCHEMA)), random.Random(0)
    for _ in range(200):
        text = random_match(dfa, rng, most=400).decode("utf-8")
        jsonschema.validate(json.loads(text), SCHEMA)
    for bad in ['{"age": 3, "name": "x", "mood": "sad"}', '{"name": "", "age": 3, "mood": "sad"}',
                '{"name": "x", "age": 3}', '{"name": "x", "age": 3.5, "mood": "sad"}',
                '{"name": "x", "age": 3, "mood": "sad", "other": 1}', '{"name": "x", "age": 03, "mood": "sad"}',
                '{"name": "x",  "age": 3, "mood": "sad"}']:  # fmt: skip
        assert not dfa.matches(bad.encode()), bad  # order, lengths, required, types, extra, leading 0, two spaces


DATE = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "string", "pattern": "a+"}, "'pattern'"),
        (DATE, "#/properties/d: the keyword 'format'"),
        ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
        ({"$ref": "#/$defs/Node", "$defs": {"Node": NODE}}, "recursive"),
        ({"type": "object", "additionalProperties": {"type": "string"}}, "'additionalProperties' as a schema"),
        ({"type": "decimal"}, "not a JSON schema type"),
    ],
)
def test_a_schema_outside_the_subset_is_refused_by_keyword(schema, keyword):
    with pytest.raises(SchemaError, match=re.escape(keyword)):
        schema_regex(schema)


def test_refs_anyof_and_type_lists_as_pydantic_writes_them():
    schema = {
        "$defs": {"Pet": {"properties": {"kind": {"const": "cat"}}, "required": ["kind"], "type": "object"}},
        "properties": {"pet": {"$ref": "#/$defs/Pet"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "n": {"type": ["integer", "null"]}},
        "required": ["pet", "note", "n"], "type": "object",
    }  # fmt: skip
    dfa = compile_regex(schema_regex(schema))
    for text in ['{"pet": {"kind": "cat"}, "note": null, "n": 7}', '{"pet":{"kind":"cat"},"note":"hi","n":null}']:
        assert dfa.matches(text.encode()), text
        jsonschema.validate(json.loads(text), schema)
    assert not dfa.matches(b'{"pet": {"kind": "dog"}, "note": null, "n": 7}')


# -- generation -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2-shakespeare", "llama-shakespeare"])
def bundled(request):
    return load_model(request.param), load_tokenizer(request.param)


SCHEMAS = [
    SCHEMA,
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 20}},
     "required": ["answer", "why"]},
]  # fmt: skip


def test_seeded_samples_of_a_batch_validate(bundled):
    """Three schemas side by side in one batch, rows sampled with several seeds: every output is JSON that validates."""
    model, tok = bundled
    constraints = [compile_constraint(tok, json_schema=s) for s in SCHEMAS]
    prompt = tok.encode("ROMEO:")
    for seed in range(3):
        rows = generate(model, [prompt] * 3, constraint=constraints, temperature=1.0, seed=seed, max_new_tokens=120)
        for row, schema in zip(rows, SCHEMAS):
            ended = Guide(compile_constraint(tok, json_schema=schema), model.config.eos_token_ids)
            for t in row:
                ended.advance(t)
            assert ended.ended, f"seed {seed}: {tok.decode(row)!r} did not end within 120 tokens"
            text = tok.decode(row[:-1] if ended.ended_by_eos else row)
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("pattern, keep", [(r"[0-9]", True), (r"[^0-9]*", False)], ids=["few allowed", "few refused"])
def test_constrained_sampling_draws_from_the_renormalized_distribution(pattern, keep):
    """The masked step as decode_steps runs it (`mask_rows_`, then the sampler), both ways a row is masked; the
    draws' frequencies against softmax over the allowed tokens (chi-square, 4,000 draws of one row)."""
    tok = load_tokenizer("llama-shakespeare")
    V = tok.n_vocab
    guide = Guide(compile_constraint(tok, regex=pattern), [V - 1])
    allowed = guide.allowed(V, "cpu")  # [V]
    assert guide.constraint.fill(0, guide.eos_ids, V, "cpu")[0] == keep  # both ways of masking a row
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3
    rows = mask_rows_(logits.expand(4000, -1).clone(), [guide] * 4000)
    draws = ENGINE_SAMPLER.next_token(rows, SamplingParams(temperature=0.7), None, torch.Generator().manual_seed(1))
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")) / 0.7, dim=-1)
    assert chi_square_p_value(draws.tolist(), probs) > 1e-4
    wrong = torch.softmax(logits.masked_fill(~allowed, float("-inf")) / 1.0, dim=-1)  # another temperature
    assert chi_square_p_value(draws.tolist(), wrong) < 1e-6


def test_a_constraint_that_cannot_finish_in_time_is_not_presented_as_complete(bundled):
    model, tok = bundled
    constraint = compile_constraint(tok, regex=r"[a-z]{40}")
    out = generate(model, tok.encode("ROMEO:"), constraint=constraint, max_new_tokens=4)
    guide = Guide(constraint, model.config.eos_token_ids)
    for t in out:
        guide.advance(t)
    assert len(out) == 4 and not guide.complete and not guide.ended
    assert re.fullmatch("[a-z]*", tok.decode(out))  # what there is follows the constraint


def test_an_eos_id_that_is_text_is_text_where_the_constraint_needs_it():
    """llama-shakespeare's EOS ids are <|endoftext|> and the token "\\n\\n": pushed by logit_bias, "\\n\\n" is taken as
    text inside `A\\n\\nB` (not complete there), and ends the text only after B."""
    model, tok = load_model("llama-shakespeare"), load_tokenizer("llama-shakespeare")
    double_newline = 267
    assert tok.token_bytes(double_newline) == b"\n\n" and double_newline in model.config.eos_token_ids
    constraint = compile_constraint(tok, regex=r"A\n\nB")
    out = generate(
        model, tok.encode("ROMEO:"), constraint=constraint, logit_bias={double_newline: 50}, max_new_tokens=8
    )
    assert double_newline in out[:-1] and tok.decode(out[:-1]) == "A\n\nB" and out[-1] in model.config.eos_token_ids
    assert generate_text(model, tok, "ROMEO:", constraint=constraint, logit_bias={double_newline: 50}) == "A\n\nB"


def test_the_engine_and_speculative_decoding_equal_constrained_generate_alone(bundled):
    """LLMEngine with arrivals, a small pool (preemption) and a shared prompt (prefix caching), each request its own
    constraint; speculative decoding (prompt lookup; the draft model for GPT-2) greedy: all equal `generate` alone."""
    model, tok = bundled
    c_json, c_choice = compile_constraint(tok, json_schema=SCHEMAS[2]), compile_constraint(tok, choice=["aye", "nay"])
    c_regex = compile_constraint(tok, regex=r"[A-Z][a-z]{2,12}( [a-z]{1,8}){1,3}\.")
    shared = tok.encode("JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.")
    prompts = [shared + tok.encode(s) for s in ("\nROMEO:", "\nNURSE:", "\nROMEO:", "\nTYBALT:", "\nPARIS:")]
    settings = [dict(constraint=c_json), dict(constraint=c_choice, temperature=0.9, seed=3),
                dict(constraint=c_regex, temperature=1.0, seed=5), dict(), dict(temperature=0.7, seed=9)]  # fmt: skip
    room = -(-(max(map(len, prompts)) + 40) // 8)  # blocks for the longest request: the pool holds about two
    engine = LLMEngine(model, tokenizer=tok, max_num_seqs=3, num_blocks=room + 2, block_size=8)
    got = engine.generate(prompts, arrivals=[0, 0, 2, 3, 3], settings=settings, max_new_tokens=40)
    expected = [generate(model, p, max_new_tokens=40, **s) for p, s in zip(prompts, settings)]
    assert got == expected
    assert engine.stats["preemptions"] > 0 and engine.stats["cached_tokens"] > 0, engine.stats
    drafts = ["prompt-lookup"] + (["gpt2-shakespeare-draft"] if tok.n_vocab == 50257 else [])
    for draft in drafts:
        for c in (c_json, c_regex):
            plain = generate(model, prompts[0], constraint=c, max_new_tokens=40)
            assert (
                generate(model, prompts[0], constraint=c, draft=draft, num_draft_tokens=4, max_new_tokens=40) == plain
            )


def test_rows_without_a_constraint_decode_as_without_one(bundled):
    model, tok = bundled
    prompt = tok.encode("ROMEO:")
    free = generate(model, prompt, max_new_tokens=12, temperature=0.8, seed=2)
    both = generate(model, [prompt, prompt], constraint=[compile_constraint(tok, choice=["x"]), None],
                    max_new_tokens=12, temperature=0.8, seed=2)  # fmt: skip
    assert tok.decode(both[0]).startswith("x") and len(both[0]) <= 2
    assert both[1] == generate(model, [prompt, prompt], max_new_tokens=12, temperature=0.8, seed=2)[1]
    assert free == generate(model, [prompt], max_new_tokens=12, temperature=0.8, seed=2)[0]


def test_a_constraint_needs_compiling_and_one_per_row():
    model, tok = load_model("gpt2-shakespeare"), load_tokenizer("gpt2-shakespeare")
    with pytest.raises(ValueError, match="constraint must be compiled"):
        generate(model, [1, 2], constraint="[0-9]+")
    with pytest.raises(ValueError, match=r"one per prompt \(2\), got 3"):
        generate(model, [[1], [2]], constraint=[None] * 3)
    with pytest.raises(ValueError, match="give one constraint of regex, choice"):
        compile_constraint(tok, regex="a", choice=["b"])
    with pytest.raises(ValueError, match="without compile=True and beam search"):
        generate(model, [1, 2], constraint=compile_constraint(tok, choice=["b"]), num_beams=2)


def test_the_readme_example_runs_as_written(capsys):
    from pathlib import Path

    import llmcourse

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "compile_constraint" in b)
    namespace = {"llmcourse": llmcourse, "tok": llmcourse.get_tokenizer(), "model": llmcourse.load_model()}
    exec(compile(example, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.strip()
    assert json.loads(printed) == {"mood": "sad"} and printed in example  # the comment shows what it prints
