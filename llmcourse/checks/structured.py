"""Checks for chapter 13, structured output: walking a token's bytes through a constraint's automaton
(`walk_token`), the token index of one state (`token_index`), the masked step (`mask_logits`), and a JSON-schema
subset compiled to a regex (`schema_regex`).

The automata are the engine's (`compile_regex` of a few patterns: digits, words, a JSON string with its escapes,
non-ASCII text, a schema's whole regex), given as the table the exercises index, `transitions[s][b]`. The
vocabularies are GPT-2's tokens: all of them, or slices that keep the awkward ones (tokens that are part of a UTF-8
character, tokens that pass through an accepting state and go on). `mask_logits` is checked on every dtype, on one
row and on several, on non-contiguous logits, with EOS ids that are also text. A learner's `schema_regex` is judged
by what its regex matches, not by its text: the engine compiles it; compact and spaced serializations of valid
instances (random ones, and the corners: empty arrays, escapes, exponents) must match; near misses (a leading zero,
a trailing comma, an unescaped quote, a missing property, a value outside an enum) must not; and strings drawn at
random from its automaton must be JSON that the schema validates (`jsonschema`). Each check ends by running the
learner's function in the engine (`compile_constraint(..., structuring=)`) on the bundled GPT-2: the same tokens as
the engine's own.

    >>> def walk_token(transitions, state, token):
    ...     for b in token:
    ...         state = transitions[state][b]
    ...         if state == -1:
    ...             return -1
    ...     return state
    >>> check_walk_token(walk_token)
    ✓ walk_token — 32 cases
"""

from __future__ import annotations

import json
import numbers
import random
from typing import Any, Callable, Optional

import jsonschema
import numpy as np
import torch
from torch import Tensor

from llmcourse.course.guards import guarded
from llmcourse.engine.generate import generate
from llmcourse.engine.structured.constraint import compile_constraint, vocabulary
from llmcourse.engine.structured.index import vocabulary_of
from llmcourse.engine.structured.json_schema import STRING
from llmcourse.engine.structured.regex import RegexError, compile_regex
from llmcourse.engine.structured.structuring import Structuring
from llmcourse.engine.structured.structuring import walk_token as engine_walk_token
from llmcourse.engine.tokenizer import get_tokenizer

from .harness.bundled import bundled_model
from .harness.core import Case, Verdict, later, run_check
from .harness.forbid import Forbidden
from .harness.show import short

ENGINE_IS_THE_ANSWER = "the engine's structured output, what yours is compared with: write your own"
LIBRARY = "a structured-output library: write your own"
NO_LIBRARIES = [
    Forbidden("outlines_core", f"outlines-core is {LIBRARY}"),
    Forbidden("outlines", f"outlines is {LIBRARY}"),
    # outlines-core's Rust functions say they live in a module 'json_schema' that the package rule cannot recognize
    # once outlines-core is loaded: named one by one
    *[
        Forbidden(f"outlines_core.{name}", f"outlines-core is {LIBRARY}")
        for name in ("json_schema.build_regex_from_schema", "Index", "Guide", "Vocabulary")
    ],
]
NO_ENGINE = [Forbidden("llmcourse.engine.structured", ENGINE_IS_THE_ANSWER, direct=True), *NO_LIBRARIES]
# token_index is given the engine's walk_token to call (the check does not judge a walk twice): the rest is refused
NO_ENGINE_INDEX = [
    Forbidden("llmcourse.engine.structured.structuring.token_index", ENGINE_IS_THE_ANSWER, direct=True),
    Forbidden("llmcourse.engine.structured.structuring.LazyIndex", ENGINE_IS_THE_ANSWER, direct=True),
    *[
        Forbidden(f"llmcourse.engine.structured.{module}", ENGINE_IS_THE_ANSWER, direct=True)
        for module in ("index", "regex", "constraint", "json_schema")
    ],
    *NO_LIBRARIES,
]
EOS = 50256  # GPT-2's <|endoftext|>


# -- the check's own copies of the engine's answers (the learner may not reach the engine's) ---------------------


def _walk(transitions: list, state: int, token: bytes) -> int:
    for byte in token:
        state = transitions[state][byte]
        if state < 0:
            return -1
    return state


def _index(transitions: list, state: int, vocab: dict, walk_token: Callable = _walk) -> dict:
    return {t: s for t, piece in vocab.items() if (s := walk_token(transitions, state, piece)) >= 0}


def _mask(logits: Tensor, allowed: dict, accepting: bool, eos_ids: tuple) -> Tensor:
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting:
        keep[list(eos_ids)] = True
    return logits.masked_fill(~keep, float("-inf"))


# -- automata and vocabularies --------------------------------------------------------------------------------

PATTERNS = {
    "a number": r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?",
    "yes, no or maybe": r"(?:yes|no|maybe)",
    "a JSON string": STRING,
    "non-ASCII words": r"(?:café|naïve|日本)(?: (?:café|naïve|日本))*",
    "a person as JSON": r'\{"name":' + STRING + r',"age":(?:0|[1-9][0-9]*)\}',
    "digit-letter pairs": r"(?:[0-9][a-z])*",  # back to the start (state 0) after each pair
}


class Automaton:
    """A pattern's automaton as the exercises take it: `transitions` [S][256] (a list of lists), `accepting` [S]."""

    def __init__(self, what: str):
        self.what, self.pattern = what, PATTERNS[what]
        dfa = compile_regex(self.pattern)
        self.transitions, self.accepting = dfa.next.tolist(), [bool(a) for a in dfa.accepting]

    def __deepcopy__(self, memo):
        return self

    def reached(self, text: bytes) -> int:
        return _walk(self.transitions, 0, text)


_automata: dict[str, Automaton] = {}


def automaton(what: str) -> Automaton:
    if what not in _automata:
        _automata[what] = Automaton(what)
    return _automata[what]


_vocab: dict[int, bytes] = {}


def gpt2_vocab() -> dict[int, bytes]:
    """GPT-2's 50,256 text tokens, {id: bytes}."""
    if not _vocab:
        v = vocabulary_of(get_tokenizer())
        _vocab.update(zip(v.ids, v.pieces))
    return _vocab


def vocab_slice(seed: int, n: int, keep: tuple[int, ...] = ()) -> dict[int, bytes]:
    """n tokens of GPT-2 drawn at random (the ids in `keep` always), in a shuffled order: {id: bytes}."""
    full = gpt2_vocab()
    rng = random.Random(seed)
    ids = sorted(set(rng.sample(sorted(full), n)) | set(keep))
    rng.shuffle(ids)
    return {i: full[i] for i in ids}


def _show_transitions(transitions: list) -> str:
    return f"<automaton: {len(transitions)} states × 256 bytes>"


# -- walk_token -------------------------------------------------------------------------------------------------


def _walk_wraps(transitions, state, token):  # no early stop: transitions[-1] is the last state's row
    for byte in token:
        state = transitions[state][byte]
    return state


def _walk_from_start(transitions, state, token):
    return _walk(transitions, 0, token)


def _walk_first_byte(transitions, state, token):
    return transitions[state][token[0]] if token else state


def _walk_chars(transitions, state, token):
    for ch in token.decode("utf-8", "replace"):
        state = transitions[state][ord(ch)] if ord(ch) < 256 else -1
        if state < 0:
            return -1
    return state


def _walk_skips_last(transitions, state, token):
    return _walk(transitions, state, token[:-1])


def _walk_empty_dead(transitions, state, token):
    return _walk(transitions, state, token) if token else -1


def _walk_none(transitions, state, token):
    out = _walk(transitions, state, token)
    return None if out < 0 else out


WALK_MISTAKES = [
    (
        _walk_wraps,
        "once a byte has no move, transitions[state][byte] is -1, and transitions[-1] is Python's last row: the walk "
        "goes on from the automaton's last state. Return -1 as soon as a step gives -1",
    ),
    (_walk_from_start, "walk from the state you are given, not from 0: a token continues the text generated so far"),
    (_walk_first_byte, "walk every byte of the token, not only its first: a token is several bytes"),
    (
        _walk_chars,
        "walk the token's bytes (for byte in token), not its characters: the automaton reads UTF-8 bytes, and é is two",
    ),
    (_walk_skips_last, "walk every byte, the last one too"),
    (_walk_empty_dead, "an empty token walks nowhere: it stays in the state it started from"),
    (_walk_none, "return -1 for a token that leaves the automaton, not None: the engine compares states as integers"),
]


def walk_cases(seed: int, n_random: int) -> list[Case]:
    num, words, string = automaton("a number"), automaton("yes, no or maybe"), automaton("a JSON string")
    intl, person = automaton("non-ASCII words"), automaton("a person as JSON")
    cases = []

    def case(description: str, a: Automaton, state: int, token: bytes, hint: str = "") -> None:
        expected = later(_walk, a.transitions, state, token)
        cases.append(Case(f"{a.what}, {description}", (a.transitions, state, token), expected, hint))

    case("one digit from the start", num, 0, b"7")
    case("digits from the start", num, 0, b"2024")
    case("a minus sign then digits", num, 0, b"-12")
    case("a leading zero followed by a digit (no move after 0)", num, 0, b"01")
    case("the first byte has no move", num, 0, b"x1")
    case("the last byte has no move", num, 0, b"12a")
    case("an empty token", num, num.reached(b"12"), b"")
    case("from the middle: a fraction", num, num.reached(b"3"), b".14")
    case("from the middle: a dot after a dot", num, num.reached(b"3.1"), b".")
    case("through an accepting state and on", words, 0, b"maybe")
    case("a prefix of a word", words, 0, b"ma")
    case("past the end of a word", words, 0, b"yes!")
    case("after the end: nothing may follow", words, words.reached(b"no"), b"o")
    case("from the middle of a word", words, words.reached(b"ye"), b"s")
    case("an escaped quote inside a string", string, string.reached(b'"a'), b'\\"')
    case("an escape that JSON has not", string, string.reached(b'"a'), b"\\q")
    case("a control character in a string", string, string.reached(b'"'), b"a\x01")
    case("the closing quote", string, string.reached(b'"abc'), b'"')
    case("a \\u escape in two tokens", string, string.reached(b'"\\u00'), b"e9")
    case("a two-byte character, whole", intl, 0, "café".encode())
    case("half of a two-byte character", intl, intl.reached(b"caf"), "é".encode()[:1])
    case("the other half", intl, intl.reached(b"caf\xc3"), "é".encode()[1:])
    case("a three-byte character", intl, 0, "日本".encode())
    case("a wrong continuation byte", intl, intl.reached(b"caf\xc3"), b"\xaa")
    case("a token across a key", person, person.reached(b'{"na'), b'me":"')
    case("a number ending the object", person, person.reached(b'{"name":"x","age":4'), b"2}")
    pairs = automaton("digit-letter pairs")
    case("back to the start state", pairs, 0, b"1a")
    case("back to the start, then dead", pairs, 0, b"1a!")
    rng = random.Random(seed)
    vocab = gpt2_vocab()
    ids = sorted(vocab)
    for _ in range(n_random):  # a random token of GPT-2's from a random state of a random automaton
        a = automaton(rng.choice(list(PATTERNS)))
        state = rng.randrange(len(a.transitions))
        case(f"random: GPT-2 token from state {state}", a, state, vocab[rng.choice(ids)])
    return cases


def _show_walk(args: tuple) -> str:
    return f"walk_token({_show_transitions(args[0])}, {args[1]}, {args[2]!r})"


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _walk_judge(case: Case, got: Any) -> Verdict:
    mistake = _named(got, case.args, WALK_MISTAKES, case.expected)
    if not _is_int(got):
        return f"returned {type(got).__name__} {short(got, 40)}, expected an integer state", mistake or (
            "return the state reached (an int), or -1"
        )
    if got == case.expected:
        return None
    transitions, state, token = case.args
    trail, s = [state], state
    for b in token:
        s = transitions[s][b]
        trail.append(s)
        if s < 0:
            break
    return f"the walk goes {' → '.join(map(str, trail))} over bytes {list(token)}", mistake


def _named(got: Any, args: tuple, mistakes: list, expected: Any) -> str:
    """The hint of the first mistake whose answer on args is `got` and is not `expected`."""
    for wrong, hint in mistakes:
        try:
            candidate = wrong(*args)
        except Exception:
            continue
        if _same(candidate, got) and not _same(candidate, expected):
            return hint
    return ""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.nan_to_num(), b.nan_to_num())
            and torch.equal(torch.isinf(a), torch.isinf(b))
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def check_walk_token(fn, *, seed: int = 0, n_random: int = 3) -> None:
    """walk_token(transitions, state, token) -> the state after all of token's bytes from state, or -1 as soon as one
    has no move. The last case runs it in the engine, through the engine's token index."""
    cases = walk_cases(seed, n_random) + [engine_case("walk_token", seed)]
    run, judge = with_engine_runs(fn, _walk_judge)
    run_check(
        "walk_token",
        run,
        cases,
        judge=judge,
        forbid=NO_ENGINE,
        show_call=lambda args: args[0].show() if isinstance(args[0], EngineRun) else _show_walk(args),
        seconds=20,
        total_seconds=120,
        shrink=False,
    )


# -- token_index ------------------------------------------------------------------------------------------------


def _index_first_byte(transitions, state, vocab, walk_token):
    return {t: transitions[state][p[0]] for t, p in vocab.items() if transitions[state][p[0]] >= 0}


def _index_final_only(transitions, state, vocab, walk_token):  # the walk wraps past -1; only the end is tested
    return {t: s for t, p in vocab.items() if (s := _walk_wraps(transitions, state, p)) >= 0}


def _index_truthy(transitions, state, vocab, walk_token):  # `if target:` is False for state 0, True for -1
    return {t: s for t, p in vocab.items() if (s := _walk(transitions, state, p))}


def _index_from_start(transitions, state, vocab, walk_token):
    return _index(transitions, 0, vocab)


def _index_positions(transitions, state, vocab, walk_token):  # positions in the vocabulary, not token ids
    return {n: s for n, (t, p) in enumerate(vocab.items()) if (s := _walk(transitions, state, p)) >= 0}


def _index_chars(transitions, state, vocab, walk_token):
    return {t: s for t, p in vocab.items() if (s := _walk_chars(transitions, state, p)) >= 0}


def _index_first_per_target(transitions, state, vocab, walk_token):  # one token per next state
    out: dict = {}
    for t, s in _index(transitions, state, vocab).items():
        if s not in out.values():
            out[t] = s
    return out


INDEX_MISTAKES = [
    (
        _index_final_only,
        "a token whose walk leaves the automaton midway is not allowed, even if a walk that went on from -1 ends in a "
        "state: transitions[-1] is Python's last row. Stop at the first -1 (your walk_token does)",
    ),
    (_index_first_byte, "walk all of each token's bytes: a token is allowed only if every byte has a move"),
    (
        _index_truthy,
        "test the walk's end against -1 (`if target != -1`, or `>= 0`), not its truth: `if target:` drops the tokens "
        "that lead back to state 0 and keeps those that lead to -1",
    ),
    (_index_from_start, "walk each token from the state you are given, not from 0"),
    (_index_positions, "the keys are the vocabulary's token ids (vocab's keys), not positions in it"),
    (_index_chars, "walk each token's bytes, not the characters of its decoded text: é is two bytes"),
    (
        _index_first_per_target,
        "every allowed token is in the index, also when another one leads to the same state: the model chooses "
        "among all of them",
    ),
]


def index_cases(seed: int, n_random: int) -> list[Case]:
    num, words, string = automaton("a number"), automaton("yes, no or maybe"), automaton("a JSON string")
    intl, person = automaton("non-ASCII words"), automaton("a person as JSON")
    full = gpt2_vocab()
    e_first = next(i for i, p in full.items() if p == "é".encode()[:1])  # half of é: a token of its own
    small = vocab_slice(seed, 400, keep=tuple(i for i, p in full.items() if p in (b"7", b"12", b"-", b".", b"0")))
    cases = []

    def case(description: str, a: Automaton, state: int, vocab: dict, hint: str = "") -> None:
        args = (a.transitions, state, vocab, engine_walk_token)
        cases.append(Case(f"{a.what}, {description}", args, later(_index, a.transitions, state, vocab), hint))

    tiny = {3: b"1", 9: b"12", 4: b"1a", 7: b"a", 1: b".", 8: b"1.5", 2: b"-0", 5: b"00"}
    case("8 tokens from the start (ids not in order)", num, 0, tiny)
    case("the same 8 tokens after a digit", num, num.reached(b"1"), tiny)
    case("the same 8 tokens after a leading zero", num, num.reached(b"0"), tiny)
    case("400 GPT-2 tokens from the start", num, 0, small)
    case("400 GPT-2 tokens after '1.'", num, num.reached(b"1."), small)
    case("words: a token through an accepting state", words, 0, {10: b"no", 11: b"nope", 12: b"yes", 13: b"y"})
    case("after the end of a word", words, words.reached(b"yes"), small)
    case("inside a string, 400 tokens", string, string.reached(b'"'), vocab_slice(seed + 1, 400, keep=(e_first,)))
    case("half a character", intl, intl.reached(b"caf"), {e_first: full[e_first], 14: "é".encode(), 15: b"e"})
    pairs = automaton("digit-letter pairs")
    case("tokens back to the start state", pairs, 0, {20: b"1a", 21: b"1", 22: b"a", 23: b"1a2", 24: b"!", 25: b"9z"})
    rng = random.Random(seed)
    for _ in range(n_random):
        a = automaton(rng.choice(list(PATTERNS)))
        state = rng.randrange(len(a.transitions))
        case(f"random: 300 GPT-2 tokens from state {state}", a, state, vocab_slice(rng.randrange(10**6), 300))
    case("every GPT-2 token, from the start of an object", person, 0, full)
    case("every GPT-2 token, inside a string value", person, person.reached(b'{"name":"R'), full)
    return cases


def _show_index(args: tuple) -> str:
    vocab = args[2]
    shown = ", ".join(f"{t}: {p!r}" for t, p in list(vocab.items())[:4])
    more = f", … {len(vocab)} tokens" if len(vocab) > 4 else ""
    return f"token_index({_show_transitions(args[0])}, {args[1]}, {{{shown}{more}}}, walk_token)"


def _index_judge(case: Case, got: Any) -> Verdict:
    expected: dict = case.expected
    mistake = _named(got, case.args, INDEX_MISTAKES, expected)
    if not isinstance(got, dict):
        return f"returned {type(got).__name__}, expected a dict {{token id: next state}}", mistake
    bad = [(k, v) for k, v in got.items() if not (_is_int(k) and _is_int(v))]
    if bad:
        return f"the dict holds {short(bad[0], 60)}: keys and values must be integers (token id, state)", mistake
    got = {int(k): int(v) for k, v in got.items()}
    if got == expected:
        return None
    vocab = case.args[2]
    missing = [t for t in expected if t not in got]
    extra = [t for t in got if t not in expected]
    wrong = [t for t in expected if t in got and got[t] != expected[t]]
    said = []
    if missing:
        said.append(f"{len(missing)} allowed tokens missing, e.g. {missing[0]} {vocab.get(missing[0])!r} → "
                    f"state {expected[missing[0]]}")  # fmt: skip
    if extra:
        said.append(f"{len(extra)} tokens that are not allowed, e.g. {extra[0]} {vocab.get(extra[0])!r}")
    if wrong:
        t = wrong[0]
        said.append(f"{len(wrong)} tokens lead elsewhere, e.g. {t} {vocab.get(t)!r}: state {expected[t]}, "
                    f"not {got[t]}")  # fmt: skip
    return "; ".join(said), mistake


def check_token_index(fn, *, seed: int = 0, n_random: int = 2) -> None:
    """token_index(transitions, state, vocab, walk_token) -> {token id: state it leads to} for every token of vocab
    ({id: bytes}) whose bytes all walk from state. The last case runs it in the engine: the index of every state a
    constrained generation reaches."""
    cases = index_cases(seed, n_random) + [engine_case("token_index", seed)]
    run, judge = with_engine_runs(fn, _index_judge)
    run_check(
        "token_index",
        run,
        cases,
        judge=judge,
        forbid=NO_ENGINE_INDEX,
        show_call=lambda args: args[0].show() if isinstance(args[0], EngineRun) else _show_index(args),
        seconds=20,
        total_seconds=180,
        reference=lambda *args: _index(*args[:3]) if not isinstance(args[0], EngineRun) else None,
        shrink=False,
        timeout_hint="walk each token once, and stop at its first byte without a move",
    )


# -- mask_logits ------------------------------------------------------------------------------------------------


def _mask_eos_always(logits, allowed, accepting, eos_ids):
    return _mask(logits, {**allowed, **dict.fromkeys(eos_ids, 0)}, accepting, eos_ids)


def _mask_eos_never(logits, allowed, accepting, eos_ids):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    keep[list(eos_ids)] = False
    return logits.masked_fill(~keep, float("-inf"))


def _mask_eos_text_dropped(logits, allowed, accepting, eos_ids):  # an EOS id that is text removed when not complete
    out = _mask(logits, allowed, accepting, eos_ids)
    if not accepting:
        out[..., list(eos_ids)] = float("-inf")
    return out


def _mask_zero(logits, allowed, accepting, eos_ids):
    keep = ~torch.isneginf(_mask(logits, allowed, accepting, eos_ids))
    return logits.masked_fill(~keep & ~torch.isneginf(logits), 0.0)


def _mask_finite(logits, allowed, accepting, eos_ids):
    return _mask(logits, allowed, accepting, eos_ids).nan_to_num(neginf=-1e9).to(logits.dtype)


def _mask_inverted(logits, allowed, accepting, eos_ids):
    keep = ~torch.isneginf(_mask(logits, allowed, accepting, eos_ids))
    return logits.masked_fill(keep, float("-inf"))


def _mask_float32(logits, allowed, accepting, eos_ids):
    return _mask(logits.float(), allowed, accepting, eos_ids)


MASK_MISTAKES = [
    (
        _mask_eos_always,
        "EOS only where the text so far is complete (accepting): before that, ending would leave broken JSON",
    ),
    (
        _mask_eos_text_dropped,
        "here an EOS id is also text the constraint allows (llama-shakespeare's EOS is the token '\\n\\n'): keep "
        "every token of `allowed`; the EOS rule only adds the EOS ids where the text is complete",
    ),
    (_mask_eos_never, "allow the EOS ids where the text so far is complete (accepting): that is how an answer ends"),
    (_mask_zero, "set the tokens that may not come next to -inf, not 0: a logit of 0 still has a probability"),
    (
        _mask_finite,
        "use -inf, not a large negative number: divided by a high temperature (or pushed up by top-k's ties), a "
        "finite logit gets a probability again; exp(-inf) is exactly 0",
    ),
    (_mask_inverted, "keep the allowed tokens and mask the others, not the other way round"),
    (_mask_float32, "return logits in their own dtype (torch.full(...) is float32 unless you pass dtype=)"),
]


def mask_cases(seed: int, n_random: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    cases = []

    def case(description: str, logits: Tensor, allowed: dict, accepting: bool, eos: tuple, hint: str = "") -> None:
        args = (logits, allowed, accepting, eos)
        cases.append(Case(description, args, later(_mask, logits, allowed, accepting, eos), hint))

    V = 12
    row = torch.randn(V, generator=g)
    case("one row, 3 allowed, not accepting", row, {2: 5, 7: 1, 3: 0}, False, (11,))
    case("one row, 3 allowed, accepting: EOS too", row, {2: 5, 7: 1, 3: 0}, True, (11,))
    case("accepting, nothing else allowed: only EOS", row, {}, True, (11,))
    case("two EOS ids, accepting", row, {0: 1}, True, (10, 11))
    case("an EOS id that is also text, not accepting", row, {11: 4, 1: 2}, False, (11,))
    case("an EOS id that is also text, accepting", row, {11: 4, 1: 2}, True, (11,))
    case("every token allowed", row, dict.fromkeys(range(V - 1), 0), False, (11,))
    rows = torch.randn(3, V, generator=g)
    case("3 rows in one state", rows, {4: 2, 5: 2}, False, (11,))
    case("3 rows in one state, accepting", rows, {4: 2, 5: 2}, True, (11,))
    case("non-contiguous rows (a transposed tensor)", torch.randn(V, 3, generator=g).t(), {1: 0, 9: 3}, True, (0,))
    case("logits already -inf somewhere", row.masked_fill(row > 0.5, float("-inf")), {2: 5, 3: 1}, True, (11,))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        case(f"{str(dtype)[6:]} logits", torch.randn(2, V, generator=g).to(dtype), {0: 0, 6: 1}, True, (11,))
    big = torch.randn(50257, generator=g) * 3
    case("GPT-2's 50,257 logits, 3 allowed", big, {13: 4, 90: 1, 1003: 2}, False, (EOS,))
    case("GPT-2's 50,257 logits, most allowed", big, dict.fromkeys(range(0, 50000, 2), 7), True, (EOS,))
    rng = random.Random(seed)
    for i in range(n_random):
        B, V = rng.choice([1, 2, 5]), rng.choice([5, 17, 300])
        logits = torch.randn(B, V, generator=g) * 4
        allowed = {t: rng.randrange(9) for t in rng.sample(range(V), rng.randrange(0, V))}
        eos = tuple(rng.sample(range(V), rng.choice([1, 2])))
        case(f"random {i}: {B} × {V} logits, {len(allowed)} allowed", logits, allowed, rng.random() < 0.5, eos)
    return cases


def _show_mask(args: tuple) -> str:
    logits, allowed, accepting, eos = args
    shown = short(dict(list(allowed.items())[:6]), 80) + (f" … {len(allowed)} tokens" if len(allowed) > 6 else "")
    return f"mask_logits({short(logits, 80)}, {shown}, accepting={accepting}, eos_ids={eos})"


def _mask_judge(case: Case, got: Any) -> Verdict:
    expected: Tensor = case.expected
    mistake = _named(got, case.args, MASK_MISTAKES, expected)
    if not isinstance(got, Tensor) or type(got) is not Tensor:
        return f"returned {type(got).__name__}, expected a torch.Tensor", mistake
    if got.shape != expected.shape or got.dtype != expected.dtype:
        shapes = f"shape {tuple(got.shape)} {got.dtype}, expected logits' shape {tuple(expected.shape)}"
        return f"returned {shapes} and dtype {expected.dtype}", mistake or "mask along the last dim, every row alike"
    if _same(got, expected):
        return None
    differ = ~((got == expected) | (torch.isnan(got) & torch.isnan(expected)))
    at = tuple(differ.nonzero()[0].tolist())
    where = f"token {at[-1]}" + (f" of row {at[0]}" if len(at) > 1 else "")
    return f"{where}: expected {expected[at].item()}, got {got[at].item()}", mistake


def check_mask_logits(fn, *, seed: int = 0, n_random: int = 4) -> None:
    """mask_logits(logits [..., V], allowed {token: state}, accepting, eos_ids) -> a new tensor, logits' dtype: the
    allowed tokens' logits as they are, the EOS ids' too where accepting, every other token at -inf. The last case
    runs it in the engine."""
    cases = mask_cases(seed, n_random) + [engine_case("mask_logits", seed)]
    run, judge = with_engine_runs(fn, _mask_judge)
    run_check(
        "mask_logits",
        run,
        cases,
        judge=judge,
        forbid=NO_ENGINE,
        show_call=lambda args: args[0].show() if isinstance(args[0], EngineRun) else _show_mask(args),
        seconds=10,
        total_seconds=120,
        shrink=False,
        error_hints={
            "out of bounds for dimension 0": "logits may be [V] or [rows, V]: index the last dim, logits[..., ids]"
        },  # fmt: skip
    )


# -- schema_regex -----------------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "alive": {"type": "boolean"}},
    "required": ["name", "age", "alive"],
    "additionalProperties": False,
}
PLAY = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "genre": {"enum": ["comedy", "tragedy", "history"]},
        "year": {"type": "number"},
        "cast": {"type": "array", "items": PERSON},
        "sequel": {"type": "null"},
    },
    "required": ["title", "genre", "year", "cast", "sequel"],
    "additionalProperties": False,
}
VISIBLE_SCHEMAS = [
    {"type": "string"},
    {"type": "string", "maxLength": 3},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "a.b", 7, True, None]},
    {"type": "array", "items": {"type": "integer"}},
    PERSON,
    PLAY,
]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema of the exercise's subset: scalars, enums, arrays, objects with all properties required, in order."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["x", "y z", 'q"t', "1+1", 0, -2.5, False, None, "é"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1)}
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "ok", "a b", "kind", "ünï"], rng.randint(1, 3))
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names,
            "additionalProperties": False,
        }
    if kind == "string" and rng.random() < 0.3:
        return {"type": "string", "maxLength": rng.randint(0, 5)}
    return {"type": kind}


STRINGS = ["", "Romeo", 'say "hi"', "back\\slash", "tab\there", "line\nbreak", "café", "日本", "a/b", "\u0001"]
NUMBERS = [0, 7, -3, 2024, 0.5, -0.25, 3.0, 1e20, 1.5e-07, -2e100, 123456789012]


def instances(schema: dict, rng: random.Random, n: int) -> list:
    """Valid instances of schema: the corners first (empty arrays, escapes, exponents), then random ones."""
    out = [_instance(schema, rng, corner=i) for i in range(4)]
    out += [_instance(schema, rng) for _ in range(n)]
    return out


def _instance(schema: dict, rng: random.Random, corner: Optional[int] = None) -> Any:
    if "enum" in schema:
        values = schema["enum"]
        return values[corner % len(values)] if corner is not None else rng.choice(values)
    kind = schema["type"]
    if kind == "string":
        text = STRINGS[corner] if corner is not None else "".join(rng.choice(STRINGS) for _ in range(rng.randint(0, 3)))
        return text[: schema.get("maxLength", len(text))]
    if kind == "integer":
        return [0, -1, 10, 123456789012][corner] if corner is not None else rng.randint(-(10**6), 10**6)
    if kind == "number":
        return [1e20, -0.5, 1.5e-07, 42][corner] if corner is not None else rng.choice(NUMBERS)
    if kind == "boolean":
        return [True, False][corner % 2] if corner is not None else rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        size = [0, 1, 3, 2][corner] if corner is not None else rng.randint(0, 3)
        return [_instance(schema["items"], rng, corner if corner is not None and size == 1 else None)
                for _ in range(size)]  # fmt: skip
    return {name: _instance(sub, rng, corner) for name, sub in schema["properties"].items()}


def serializations(value: Any) -> list[str]:
    """Compact ({"a":1,"b":[2]}) and spaced ({"a": 1, "b": [2]}) JSON of value, with characters past ASCII as they
    are and as \\u escapes (json.dumps' default): a regex must match one of them."""
    return [
        json.dumps(value, separators=separators, ensure_ascii=ascii)
        for ascii in (False, True)
        for separators in ((",", ":"), (", ", ": "))
    ]


# (text replacing a value of this kind, why it is not valid, the hint for a regex that matches it)
NEAR_MISSES = {
    "string": [
        (
            '"a\\"',
            "an escaped quote that leaves the string open",
            "a JSON string's characters are anything but \" and \\ and control characters, or an escape: "
            '(?:[^"\\\\\\x00-\\x1f]|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})',
        ),
        (
            '"tab\there"',
            "a raw control character (a tab) inside a string",
            "control characters (\\x00-\\x1f) may appear in a JSON string only escaped (\\t, \\n, \\u0001)",
        ),
        ('"\\q"', "an escape JSON does not have", "JSON's escapes are \\\" \\\\ \\/ \\b \\f \\n \\r \\t and \\uXXXX"),
        ("Romeo", "a string without quotes", "a string is in double quotes"),
    ],
    "integer": [
        ("01", "a leading zero", "a JSON integer is 0 or starts with 1-9: -?(?:0|[1-9][0-9]*)"),
        ("1.5", "a fraction where an integer goes", "an integer has no fraction"),
        ("+1", "a plus sign", "JSON numbers have no leading +"),
        ('"1"', "an integer in quotes", "an integer is not a string"),
        ("-", "a minus sign alone", "at least one digit after the minus sign"),
    ],
    "number": [
        ("01.5", "a leading zero", "a JSON number's integer part is 0 or starts with 1-9"),
        (".5", "no digit before the point", "a JSON number has digits before its point: 0.5"),
        ("1.", "no digit after the point", "a JSON number's fraction has digits: (?:\\.[0-9]+)?"),
        ("1e", "an exponent without digits", "an exponent has digits: (?:[eE][+-]?[0-9]+)?"),
        ("NaN", "NaN", "JSON has no NaN"),
    ],
    "boolean": [("True", "Python's True", "JSON's booleans are true and false"), ("truefalse", "two booleans", "")],
    "null": [("None", "Python's None", "JSON's null is null")],
    "enum": [],
    "array": [
        ("[,]", "a comma alone", "items separated by commas, none before the first or after the last"),
    ],
    "object": [],
}
MISSED_HINTS = {  # what a valid instance that does not match has, and the hint
    "1e+20": "a JSON number may have an exponent (json.dumps(1e20) is 1e+20): (?:[eE][+-]?[0-9]+)?",
    "1.5e-07": "a JSON number may have an exponent (json.dumps(1.5e-07) is 1.5e-07): (?:[eE][+-]?[0-9]+)?",
    "[]": "an array may be empty: \\[(?:item(?:,item)*)?\\]",
    '\\"': 'a string may hold escapes: \\" and \\\\ and \\n',
}


def _missed_hint(dfa, value: Any, text: str) -> str:
    """Why a regex may miss a valid answer: a known corner, a string it takes without quotes, or an alternation
    that took the text apart (it matches a part of it)."""
    hint = next((h for key, h in MISSED_HINTS.items() if key in text), "")
    if hint:
        return hint
    if isinstance(value, str) and dfa.matches(value.encode()):
        return "an enum's values are JSON: json.dumps(value) writes a string in quotes"
    data = text.encode()
    if any(dfa.matches(data[:n]) or dfa.matches(data[n:]) for n in range(1, len(data))):
        return ("your regex matches a part of this answer alone: an alternation a|b inside a sequence needs a group, "
                "(?:a|b), or it splits the whole regex in two")  # fmt: skip
    return ""


def _near_misses(schema: dict, value: Any) -> list[tuple[str, str, str]]:
    """(text, what is wrong, hint): value's compact JSON with one part broken, for every part of schema."""
    out = []
    compact = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False)  # noqa: E731

    def visit(sub: dict, v: Any, replace: Callable[[str], str]) -> None:
        kind = "enum" if "enum" in sub else sub["type"]
        for text, why, hint in NEAR_MISSES[kind]:
            out.append((replace(text), why, hint))
        if kind == "string" and "maxLength" in sub:
            n = sub["maxLength"]
            out.append((replace(json.dumps("é" * (n + 1), ensure_ascii=False)), f"a string over maxLength {n}",
                        "maxLength counts characters (an escape like \\n is one, é is one): "
                        '"(?:char){0,n}", with char a JSON string character'))  # fmt: skip
        if kind == "enum":
            wrong = next(x for x in ["zzz", 12345, "red ", "a.b".replace(".", "x")] if x not in sub["enum"])
            out.append((replace(compact(wrong)), f"{compact(wrong)}, which is not in the enum",
                        "an enum's values are JSON (json.dumps(value)) and nothing else; escape them in the regex "
                        "(a . in a value matches any character otherwise)"))  # fmt: skip
            for x in sub["enum"]:
                special = [c for c in str(x) if c in ".+*?()[]{}|^$"] if isinstance(x, str) else []
                if special:
                    near = x.replace(special[0], "x")
                    if near not in sub["enum"]:
                        out.append((replace(compact(near)), f"{compact(near)}, which is not in the enum",
                                    f"escape the values in the regex: a {special[0]} in a value is a regex operator "
                                    "otherwise (re.escape)"))  # fmt: skip
            strings = [x for x in sub["enum"] if isinstance(x, str)]
            if strings:
                out.append((replace(strings[0]), "an enum string without its quotes",
                            "an enum's values are JSON: json.dumps(value) writes a string in quotes"))  # fmt: skip
        if kind == "array" and isinstance(v, list):
            item = compact(_instance(sub["items"], random.Random(0), corner=1))
            out.append((replace(f"[{item},]"), "a trailing comma in an array", "no comma after the last item"))
            out.append((replace(f"[{item}"), "an array not closed", ""))
        if kind == "object":
            names = list(sub["properties"])
            full = {n: v[n] for n in names}
            body = compact(full)
            out.append((replace(body[:-1] + ",}"), "a trailing comma in an object", "no comma after the last property"))
            if len(names) > 1:
                out.append((replace(compact({n: full[n] for n in names[:-1]})), f"property {names[-1]!r} missing",
                            "every property of the schema is required in this exercise"))  # fmt: skip
            out.append((replace(compact({**full, "extra": 1})), "a property the schema does not have",
                        "only the schema's properties (additionalProperties is false)"))  # fmt: skip
            out.append((replace(body.replace('"', "", 2)), "a key without quotes", "keys are JSON strings"))
            for n in names:

                def inner(text: str, n=n) -> str:
                    parts = [f"{json.dumps(k, ensure_ascii=False)}:{text if k == n else compact(full[k])}"
                             for k in names]  # fmt: skip
                    return replace("{" + ",".join(parts) + "}")

                visit(sub["properties"][n], full[n], inner)
        if kind == "array" and isinstance(v, list) and v:
            rest = [compact(x) for x in v[1:]]
            visit(sub["items"], v[0], lambda text: replace("[" + ",".join([text] + rest) + "]"))

    visit(schema, value, lambda text: text)
    return out


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; JSON has neither


def _valid(text: bytes, schema: dict) -> Optional[str]:
    """None if text is JSON that schema validates; else why not."""
    try:
        value = json.loads(text.decode("utf-8"), parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as err:
        return f"not JSON ({str(err)[:60]})"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as err:
        return f"JSON the schema does not validate ({err.message[:80]})"
    return None


def random_matches(dfa, rng: random.Random, n: int, longest: int = 120) -> list[bytes]:
    """n strings the automaton matches, drawn by walking it: at each state a byte class (bytes that lead to one
    state) uniformly, then a byte in it; stopping at an accepting state with probability 1/4; past `longest` bytes,
    the shortest way to an accepting state."""
    nxt, accepting = dfa.next, dfa.accepting
    S = len(accepting)
    distance = np.where(accepting, 0, 10**9)  # bytes to the nearest accepting state
    for _ in range(S):
        reach = np.where(nxt >= 0, distance[np.maximum(nxt, 0)], 10**9).min(axis=1) + 1
        new = np.minimum(distance, reach)
        if (new == distance).all():
            break
        distance = new
    out = []
    for _ in range(n):
        s, text = 0, bytearray()
        while True:
            if accepting[s] and (rng.random() < 0.25 or len(text) >= longest):
                break
            row = nxt[s]
            if len(text) >= longest:
                b = int(np.argmin(np.where(row >= 0, distance[np.maximum(row, 0)], 10**9)))
            else:
                targets = sorted({int(t) for t in row if t >= 0})
                if not targets:
                    break
                t = rng.choice(targets)
                b = rng.choice(np.nonzero(row == t)[0].tolist())
            text.append(b)
            s = int(row[b])
        out.append(bytes(text))
    return out


class SchemaCase:
    """A schema with what a regex for it must do: `positives` (valid JSON texts it must match, one of each value's
    two serializations), `near_misses` (texts it must not match)."""

    def __init__(self, schema: dict, seed: int, n: int):
        self.schema = schema
        rng = random.Random(seed)
        self.values = instances(schema, rng, n)
        self.near_misses = [m for v in self.values[:4] for m in _near_misses(schema, v)]
        seen: set = set()
        self.near_misses = [m for m in self.near_misses if not (m[0] in seen or seen.add(m[0]))]
        self.near_misses = [m for m in self.near_misses if _valid(m[0].encode(), schema) is not None]
        self.seed = seed

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "a regex matching exactly the JSON texts this schema validates (compact or spaced)"


def schema_verdict(case: SchemaCase, regex: Any) -> Verdict:
    """What is wrong with `regex` for the case's schema, or None."""
    if not isinstance(regex, str):
        return f"returned {type(regex).__name__} {short(regex, 60)}, expected the regex as a str", ""
    try:
        dfa = compile_regex(regex)
    except RegexError as err:
        return f"the engine cannot compile your regex: {err}", (
            "the engine's regexes have literals, ., [classes], escapes, (groups), (?:groups), |, *, +, ?, {n,m}; "
            "no anchors, lookarounds or backreferences"
        )
    for value in case.values:
        texts = serializations(value)
        if not any(dfa.matches(t.encode()) for t in texts):
            return f"it does not match a valid answer: {short(texts[0], 160)}", _missed_hint(dfa, value, texts[0])
    for text, why, hint in case.near_misses:
        if dfa.matches(text.encode()):
            return f"it matches {short(text, 160)}: {why}", hint
    for text in random_matches(dfa, random.Random(case.seed), 150):
        problem = _valid(text, case.schema)
        if problem:
            hint = ""
            if text[:1] not in b'{["-0123456789tfn' or not text:
                hint = ("it matches text that does not begin like a JSON value: an alternation a|b inside a sequence "
                        "needs a group, (?:a|b), or it splits the whole regex in two")  # fmt: skip
            return f"it matches {short(text.decode('utf-8', 'replace'), 160)!r}, which is {problem}", hint
    return None


def schema_cases(seed: int, n_random: int) -> list[Case]:
    cases = [Case(f"schema {short(s, 70)}", (s,), SchemaCase(s, seed + i, 6)) for i, s in enumerate(VISIBLE_SCHEMAS)]
    rng = random.Random(seed)
    for i in range(n_random):
        s = random_schema(rng)
        cases.append(Case(f"random schema {i}: {short(s, 70)}", (s,), SchemaCase(s, seed + 100 + i, 6)))
    return cases


def _schema_judge(case: Case, got: Any) -> Verdict:
    return schema_verdict(case.expected, got)


def check_schema_regex(fn, *, seed: int = 0, n_random: int = 3) -> None:
    """schema_regex(schema) -> a regex (str, the engine's dialect) whose matches are exactly JSON texts the schema
    validates: every valid answer (compact or spaced) matches, near misses do not, random matches validate. The last
    case compiles a schema with it in the engine and generates."""
    cases = schema_cases(seed, n_random) + [engine_case("schema_regex", seed)]
    run, judge = with_engine_runs(fn, _schema_judge)
    run_check(
        "schema_regex",
        run,
        cases,
        judge=judge,
        forbid=NO_ENGINE + [Forbidden("jsonschema", "jsonschema validates JSON, it does not write regexes")],
        show_call=lambda args: (
            args[0].show() if isinstance(args[0], EngineRun) else f"schema_regex({short(args[0], 120)})"
        ),
        seconds=10,
        total_seconds=120,
        shrink=False,
    )


# -- the engine, with the learner's function in its slot ------------------------------------------------------

ENGINE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "mood": {"enum": ["merry", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


ENGINE_REGEX = r"(?:merry|sad|[0-9]{1,3})"  # a few states: the learner's walk and index run on all GPT-2's tokens


class EngineRun:
    """Greedy generation on the bundled GPT-2 with the learner's function in its `Structuring` slot (guarded, as
    `my_engine` installs it; the engine's own in the others): its tokens, to equal those of the engine's own. The
    walk and the index run on every GPT-2 token in each state reached, so they get a regex of a few states
    (ENGINE_REGEX); the masked step and the schema compiler a schema (ENGINE_SCHEMA)."""

    def __init__(self, slot: str, seed: int):
        self.slot, self.seed = slot, seed
        schema = slot in ("mask_logits", "schema_regex")
        self.constraint = dict(json_schema=ENGINE_SCHEMA) if schema else dict(regex=ENGINE_REGEX)
        self.max_new_tokens = 56 if schema else 8

    def __deepcopy__(self, memo):
        return self

    def show(self) -> str:
        ((kind, spec),) = self.constraint.items()
        return (f"the bundled GPT-2 after 'ROMEO:', {self.max_new_tokens} tokens greedily under the "
                f"{kind.replace('_', ' ')} {short(spec, 90)}, with your {self.slot} in the engine")  # fmt: skip

    def run(self, structuring: Structuring) -> list[int]:
        tok = get_tokenizer()
        constraint = compile_constraint(tok, **self.constraint, structuring=structuring)
        with torch.no_grad():
            return generate(bundled_model(), tok.encode("ROMEO:"), max_new_tokens=self.max_new_tokens,
                            constraint=constraint, eos_token_id=EOS)  # fmt: skip


def _engine_tokens(run: EngineRun) -> list[int]:
    return run.run(Structuring())


def engine_case(slot: str, seed: int) -> Case:
    vocabulary(get_tokenizer())  # made once, now: not while the learner's function is watched
    run = EngineRun(slot, seed)
    return Case(f"in the engine: your {slot}", (run,), later(_engine_tokens, run))


def with_engine_runs(fn: Callable, judge: Callable) -> tuple[Callable, Callable]:
    """(the function a check runs, its judge): an `EngineRun` case installs fn in its slot and generates; the
    others call fn."""

    def run(*args):
        if args and isinstance(args[0], EngineRun):
            return args[0].run(guarded(Structuring, **{args[0].slot: fn}))
        return fn(*args)

    def both(case: Case, got: Any) -> Verdict:
        if isinstance(case.args[0], EngineRun):
            tok = get_tokenizer()
            if case.args[0].slot == "schema_regex":  # your regex may differ from the engine's (its spaces): valid?
                if EOS not in got:
                    return None  # (not finished: the automaton keeps what was written a valid beginning)
                text = tok.decode(got[: got.index(EOS)])
                problem = _valid(text.encode(), ENGINE_SCHEMA)
                return (f"the engine generated {text!r} with your regex, {problem}", "") if problem else None
            if got == case.expected:
                return None
            return (f"the engine generated {tok.decode(got)!r} with your {case.args[0].slot}, "
                    f"{tok.decode(case.expected)!r} with its own", "")  # fmt: skip
        return judge(case, got)

    return run, both


__all__ = ["check_walk_token", "check_token_index", "check_mask_logits", "check_schema_regex"]
