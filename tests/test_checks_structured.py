"""Chapter 13's checks: the references pass (visible and hidden parts), stubs fail, plausible mistakes fail with a
message that names them, other correct ways of writing each exercise pass, the engine's own functions are refused,
a learner's part that breaks the engine's contract is stopped by its guard, and the learner's four functions make
valid JSON in the engine."""

import json
import re

import jsonschema
import pytest
import torch
from outlines_core.json_schema import build_regex_from_schema as outlines_regex  # loaded before a check runs

from llmcourse.checks import CheckFailed
from llmcourse.checks.structured import (
    PERSON,
    check_mask_logits,
    check_schema_regex,
    check_token_index,
    check_walk_token,
)
from llmcourse.course.guards import guarded
from llmcourse.engine.generate import generate
from llmcourse.engine.slots import PartError
from llmcourse.engine.structured.constraint import compile_constraint
from llmcourse.engine.structured.structuring import Structuring
from llmcourse.engine.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# -- references, written as a learner would ----------------------------------------------------------------------


def walk_token(transitions, state, token):
    for byte in token:
        state = transitions[state][byte]
        if state == -1:
            return -1
    return state


def token_index(transitions, state, vocab, walk_token):
    index = {}
    for token, piece in vocab.items():
        target = walk_token(transitions, state, piece)
        if target != -1:
            index[token] = target
    return index


def mask_logits(logits, allowed, accepting, eos_ids):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits.masked_fill(~keep, float("-inf"))


CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
SCALARS = {
    "string": f'"{CHAR}*"',
    "integer": r"-?(?:0|[1-9][0-9]*)",
    "number": r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?",
    "boolean": "(?:true|false)",
    "null": "null",
}


def schema_regex(schema, scalars=SCALARS, sep=",", colon=":", char=CHAR, quote=True, escape=re.escape, empty=True):
    """The reference, with knobs that make the mistakes below (one changed at a time)."""
    again = lambda s: schema_regex(s, scalars, sep, colon, char, quote, escape, empty)  # noqa: E731
    if "enum" in schema:
        return "(?:" + "|".join(escape(json.dumps(v) if quote else str(v)) for v in schema["enum"]) + ")"
    kind = schema["type"]
    if kind == "string" and "maxLength" in schema:
        return f'"{char}{{0,{schema["maxLength"]}}}"'
    if kind == "array":
        item = again(schema["items"])
        items = f"{item}(?:{sep}{item})*"
        return rf"\[(?:{items})?\]" if empty else rf"\[{items}\]"
    if kind == "object":
        props = [re.escape(json.dumps(n)) + colon + again(s) for n, s in schema["properties"].items()]
        return r"\{" + sep.join(props) + r"\}"
    return scalars[kind]


REFERENCES = [
    (check_walk_token, walk_token),
    (check_token_index, token_index),
    (check_mask_logits, mask_logits),
    (check_schema_regex, schema_regex),
]


@pytest.mark.parametrize("check, reference", REFERENCES, ids=lambda x: getattr(x, "__name__", "")[:20])
@pytest.mark.parametrize("hidden", [False, True], ids=["visible", "hidden"])
def test_reference_passes_visible_and_hidden(check, reference, hidden, capsys):
    check(reference, **(dict(seed=101, n_random=12) if hidden else {}))
    assert capsys.readouterr().out.startswith("✓ ")


def stub(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("check", [c for c, _ in REFERENCES], ids=lambda c: c.__name__)
def test_stub_is_not_written_yet(check):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


def test_the_checks_docstring_example_runs():
    import doctest

    import llmcourse.checks.structured as module

    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# -- the engine's own functions are black boxes ------------------------------------------------------------------


def engine_walk(transitions, state, token):
    from llmcourse.engine.structured.structuring import walk_token as engines

    return engines(transitions, state, token)


def engine_index(transitions, state, vocab, walk_token):
    from llmcourse.engine.structured.structuring import token_index as engines

    return engines(transitions, state, vocab, walk_token)


def engine_mask(logits, allowed, accepting, eos_ids):
    from llmcourse.engine.structured.structuring import mask_logits as engines

    return engines(logits, allowed, accepting, eos_ids)


def engine_schema(schema):
    from llmcourse.engine.structured.json_schema import schema_regex as engines

    return engines(schema)


def outlines_schema(schema):  # (outlines-core is loaded already: see the top of this module)
    return outlines_regex(json.dumps(schema))


def dfa_index(transitions, state, vocab, walk_token):  # the engine's automaton class, walked
    import numpy as np

    from llmcourse.engine.structured.regex import ByteDFA

    dfa = ByteDFA(np.array(transitions), np.zeros(len(transitions), dtype=bool))
    return {t: s for t, p in vocab.items() if (s := dfa.walk(p, state)) >= 0}


@pytest.mark.parametrize(
    "check, fn",
    [
        (check_walk_token, engine_walk),
        (check_token_index, engine_index),
        (check_token_index, dfa_index),
        (check_mask_logits, engine_mask),
        (check_schema_regex, engine_schema),
        (check_schema_regex, outlines_schema),
    ],
    ids=["walk", "index", "index-dfa", "mask", "schema", "schema-outlines"],
)
def test_the_engines_own_and_libraries_are_refused(check, fn):
    with pytest.raises(CheckFailed, match="black box|write your own|structured-output library"):
        check(fn)


# -- plausible mistakes, each named ------------------------------------------------------------------------------


def walk_wraps(transitions, state, token):
    for byte in token:
        state = transitions[state][byte]
    return state


def walk_from_start(transitions, state, token):
    return walk_token(transitions, 0, token)


def walk_first_byte(transitions, state, token):
    return transitions[state][token[0]] if token else state


def walk_chars(transitions, state, token):
    for ch in token.decode("utf-8", errors="replace"):
        if ord(ch) > 255:
            return -1
        state = transitions[state][ord(ch)]
        if state == -1:
            return -1
    return state


def walk_skips_last(transitions, state, token):
    for byte in token[:-1]:
        state = transitions[state][byte]
        if state == -1:
            return -1
    return state


def walk_empty_dead(transitions, state, token):
    if not token:
        return -1
    return walk_token(transitions, state, token)


def walk_none(transitions, state, token):
    out = walk_token(transitions, state, token)
    return None if out == -1 else out


def index_wraps(transitions, state, vocab, walk_token):
    return {t: s for t, p in vocab.items() if (s := walk_wraps(transitions, state, p)) != -1}


def index_first_byte(transitions, state, vocab, walk_token):
    return {t: transitions[state][p[0]] for t, p in vocab.items() if transitions[state][p[0]] != -1}


def index_truthy(transitions, state, vocab, walk_token):
    index = {}
    for token, piece in vocab.items():
        target = walk_token(transitions, state, piece)
        if target:
            index[token] = target
    return index


def index_from_start(transitions, state, vocab, walk_token):
    return token_index(transitions, 0, vocab, walk_token)


def index_positions(transitions, state, vocab, walk_token):
    return {i: s for i, p in enumerate(vocab.values()) if (s := walk_token(transitions, state, p)) != -1}


def index_chars(transitions, state, vocab, walk_token):
    return {t: s for t, p in vocab.items() if (s := walk_chars(transitions, state, p)) != -1}


def index_one_per_state(transitions, state, vocab, walk_token):
    by_target = {}
    for t, p in vocab.items():
        s = walk_token(transitions, state, p)
        if s != -1 and s not in by_target:
            by_target[s] = t
    return {t: s for s, t in by_target.items()}


def mask_eos_always(logits, allowed, accepting, eos_ids):
    return mask_logits(logits, {**allowed, **dict.fromkeys(eos_ids, 0)}, accepting, eos_ids)


def mask_eos_never(logits, allowed, accepting, eos_ids):
    out = mask_logits(logits, allowed, False, eos_ids)
    out[..., list(eos_ids)] = float("-inf")
    return out


def mask_eos_text_dropped(logits, allowed, accepting, eos_ids):
    out = mask_logits(logits, allowed, accepting, eos_ids)
    if not accepting:
        out[..., list(eos_ids)] = float("-inf")
    return out


def mask_zero(logits, allowed, accepting, eos_ids):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits * keep


def mask_finite(logits, allowed, accepting, eos_ids):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits.masked_fill(~keep, -1e9)


def mask_inverted(logits, allowed, accepting, eos_ids):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits.masked_fill(keep, float("-inf"))


def mask_float32(logits, allowed, accepting, eos_ids):
    out = torch.full(logits.shape, float("-inf"))
    ids = list(allowed) + (list(eos_ids) if accepting else [])
    out[..., ids] = logits[..., ids].float()
    return out


def mask_in_place(logits, allowed, accepting, eos_ids):
    masked = mask_logits(logits, allowed, accepting, eos_ids)
    logits.copy_(masked)
    return logits


def mask_one_row(logits, allowed, accepting, eos_ids):  # indexes the first dim: right for [V] only
    out = torch.full_like(logits, float("-inf"))
    ids = list(allowed) + (list(eos_ids) if accepting else [])
    out[ids] = logits[ids]
    return out


def string_unescaped(schema):
    return schema_regex(schema, scalars={**SCALARS, "string": '"[^"]*"'}, char='[^"]')


def integer_leading_zeros(schema):
    return schema_regex(schema, scalars={**SCALARS, "integer": "-?[0-9]+"})


def number_without_exponent(schema):
    return schema_regex(schema, scalars={**SCALARS, "number": r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?"})


def enum_unquoted(schema):
    return schema_regex(schema, quote=False)


def enum_unescaped(schema):
    return schema_regex(schema, escape=lambda text: text)


def boolean_ungrouped(schema):
    return schema_regex(schema, scalars={**SCALARS, "boolean": "true|false"})


def array_never_empty(schema):
    return schema_regex(schema, empty=False)


def max_length_ignored(schema):
    return schema_regex({k: v for k, v in schema.items() if k != "maxLength"})


def trailing_comma(schema):
    if schema.get("type") == "object":
        props = [re.escape(json.dumps(n)) + ":" + trailing_comma(s) + ",?" for n, s in schema["properties"].items()]
        return r"\{" + ",".join(props) + r"\}"
    if schema.get("type") == "array":
        item = trailing_comma(schema["items"])
        return rf"\[(?:{item}(?:,{item})*,?)?\]"
    return schema_regex(schema)


MISTAKES = [
    (check_walk_token, walk_wraps, r"transitions\[-1\] is Python's last row"),
    (check_walk_token, walk_from_start, "walk from the state you are given"),
    (check_walk_token, walk_first_byte, "not only its first"),
    (check_walk_token, walk_chars, "not its characters"),
    (check_walk_token, walk_skips_last, "the last one too"),
    (check_walk_token, walk_empty_dead, "an empty token walks nowhere"),
    (check_walk_token, walk_none, "not None"),
    (check_token_index, index_wraps, r"transitions\[-1\] is Python's last row"),
    (check_token_index, index_first_byte, "walk all of each token's bytes"),
    (check_token_index, index_truthy, "not its truth"),
    (check_token_index, index_from_start, "from the state you are given"),
    (check_token_index, index_positions, "vocab's keys"),
    (check_token_index, index_chars, "not the characters"),
    (check_token_index, index_one_per_state, "also when another one leads to the same state"),
    (check_mask_logits, mask_eos_always, "EOS only where the text so far is complete"),
    (check_mask_logits, mask_eos_never, "allow the EOS ids where the text so far is complete"),
    (check_mask_logits, mask_eos_text_dropped, "also text the constraint allows"),
    (check_mask_logits, mask_zero, "not 0"),
    (check_mask_logits, mask_finite, "not a large negative number"),
    (check_mask_logits, mask_inverted, "not the other way round"),
    (check_mask_logits, mask_float32, "in their own dtype"),
    (check_mask_logits, mask_in_place, "must not change"),
    (check_mask_logits, mask_one_row, r"index the last dim"),
    (check_schema_regex, string_unescaped, "may hold escapes"),
    (check_schema_regex, integer_leading_zeros, "leading zero"),
    (check_schema_regex, number_without_exponent, "may have an exponent"),
    (check_schema_regex, enum_unquoted, r"enum's values are JSON"),
    (check_schema_regex, enum_unescaped, r"escape the values in the regex: a \. in a value"),
    (check_schema_regex, boolean_ungrouped, r"needs a group, \(\?:a\|b\)"),
    (check_schema_regex, array_never_empty, "an array may be empty"),
    (check_schema_regex, max_length_ignored, "maxLength counts characters"),
    (check_schema_regex, trailing_comma, "no comma after the last"),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[w.__name__ for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed) as err:
        check(wrong)
    assert re.search(message, str(err.value)), str(err.value)
    assert "input:" in str(err.value) or "✗" in str(err.value)


def test_every_exercise_has_at_least_five_named_mistakes():
    counts = {}
    for check, _, _ in MISTAKES:
        counts[check.__name__] = counts.get(check.__name__, 0) + 1
    assert len(counts) == 4 and min(counts.values()) >= 5, counts


# -- correct but different ---------------------------------------------------------------------------------------


def walk_while(transitions, state, token):
    i = 0
    while i < len(token) and state != -1:
        state = transitions[state][token[i]]
        i += 1
    return state


def walk_recursive(transitions, state, token):
    if state < 0 or not token:
        return state
    return walk_recursive(transitions, transitions[state][token[0]], token[1:])


def walk_numpy(transitions, state, token):
    import numpy as np

    for byte in token:
        state = np.int64(transitions[state][byte])  # a numpy integer
        if state < 0:
            break
    return state


def index_inline_sorted(transitions, state, vocab, walk_token):
    out = {}
    for token in sorted(vocab):
        s = state
        for byte in vocab[token]:
            s = transitions[s][byte]
            if s < 0:
                break
        if s >= 0:
            out[token] = s
    return out


def index_by_prefix(transitions, state, vocab, walk_token):  # shared prefixes walked once (a trie in a dict)
    reached = {b"": state}
    out = {}
    for token, piece in sorted(vocab.items(), key=lambda kv: kv[1]):
        for n in range(1, len(piece) + 1):
            if piece[:n] not in reached:
                before = reached[piece[: n - 1]]
                reached[piece[:n]] = -1 if before < 0 else transitions[before][piece[n - 1]]
        if reached[piece] >= 0:
            out[token] = reached[piece]
    return out


def mask_where(logits, allowed, accepting, eos_ids):
    ids = list(allowed) + (list(eos_ids) if accepting else [])
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[ids] = True
    return torch.where(keep, logits, torch.full_like(logits, float("-inf")))


def mask_additive(logits, allowed, accepting, eos_ids):
    bias = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype)
    bias[list(allowed)] = 0
    if accepting:
        bias[list(eos_ids)] = 0
    return logits + bias


def mask_clone(logits, allowed, accepting, eos_ids):
    out = logits.clone()
    for t in range(logits.shape[-1]):
        if t not in allowed and not (accepting and t in eos_ids):
            out[..., t] = float("-inf")
    return out


def schema_spaced(schema):  # JSON's own whitespace allowed between tokens
    return schema_regex(schema, sep=r"[ \t\n\r]*,[ \t\n\r]*", colon=r"[ \t\n\r]*:[ \t\n\r]*")


def schema_digits_class(schema):
    return schema_regex(
        schema,
        scalars={
            **SCALARS,
            "integer": r"(-?(0|[1-9]\d*))",
            "number": r"(-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?)",
            "boolean": "(true|false)",
        },
    )


CORRECT = [
    (check_walk_token, walk_while),
    (check_walk_token, walk_recursive),
    (check_walk_token, walk_numpy),
    (check_token_index, index_inline_sorted),
    (check_token_index, index_by_prefix),
    (check_mask_logits, mask_where),
    (check_mask_logits, mask_additive),
    (check_mask_logits, mask_clone),
    (check_schema_regex, schema_spaced),
    (check_schema_regex, schema_digits_class),
]


@pytest.mark.parametrize("check, fn", CORRECT, ids=[f.__name__ for _, f in CORRECT])
def test_correct_but_different_passes(check, fn, capsys):
    check(fn)
    assert capsys.readouterr().out.startswith("✓ ")


# -- in the engine -----------------------------------------------------------------------------------------------


def test_the_learners_four_functions_make_valid_json_in_the_engine_with_the_engines_tokens():
    from llmcourse.checks.harness.bundled import bundled_model

    tok = get_tokenizer()
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string", "maxLength": 8}}}
    mine = guarded(
        Structuring, walk_token=walk_token, token_index=token_index, mask_logits=mask_logits, schema_regex=schema_regex
    )
    prompt = tok.encode("ROMEO:")
    outs = []
    for structuring in (mine, Structuring()):
        constraint = compile_constraint(tok, json_schema=schema, structuring=structuring)
        with torch.no_grad():
            outs.append(generate(bundled_model(), prompt, max_new_tokens=60, constraint=constraint, eos_token_id=50256))
    mine_ids, engine_ids = outs
    text = tok.decode(mine_ids[: mine_ids.index(50256)])
    jsonschema.validate(json.loads(text), schema)
    # the learner's regex has no spaces, the engine's allows one: the texts differ, both valid JSON
    engine_text = tok.decode(engine_ids[: engine_ids.index(50256)])
    jsonschema.validate(json.loads(engine_text), schema)


def test_guards_name_a_part_that_breaks_its_contract():
    tok = get_tokenizer()
    lazy = guarded(Structuring, walk_token=lambda t, s, b: "zero")
    with pytest.raises(PartError, match=r"part 'walk_token'.*expected a state of the automaton"):
        compile_constraint(tok, regex="(?:ab|cd)", structuring=lazy).index.tokens[0]
    bad_index = guarded(Structuring, token_index=lambda t, s, v, w: [1, 2])
    with pytest.raises(PartError, match=r"part 'token_index'.*expected a dict"):
        compile_constraint(tok, regex="(?:ab|cd)", structuring=bad_index).index.tokens[0]
    bad_regex = guarded(Structuring, schema_regex=lambda schema: "(unclosed")
    with pytest.raises(PartError, match=r"part 'schema_regex'.*cannot compile"):
        compile_constraint(tok, json_schema={"type": "integer"}, structuring=bad_regex)
    bad_mask = guarded(Structuring, mask_logits=lambda logits, allowed, accepting, eos: logits * 0)
    with pytest.raises(PartError, match=r"part 'mask_logits'.*-inf elsewhere"):
        bad_mask.mask_logits(torch.zeros(1, 5), {1: 0}, False, (4,))
