"""Chapter 05's checks: the notebook's solutions pass, stubs and plausible mistakes fail with a message
that says what is wrong, other correct ways of writing each exercise pass, the engine's functions and
transformers are refused, and the references the checks use equal transformers' logits processors."""

from pathlib import Path

import pytest
import torch

import llmcourse.engine.sampling as S
from llmcourse import get_tokenizer
from llmcourse.checks import CheckFailed
from llmcourse.checks import sampling as C
from llmcourse.checks.harness.core import resolved
from tests.notebook_checks import notebook_cells

NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions/05_sampling/05_sampling.ipynb"
INF = float("inf")


@pytest.fixture(scope="module")
def nb():
    """The notebook's solutions, defined as a learner's notebook defines them."""
    setup, solutions, _ = notebook_cells(NOTEBOOK)
    namespace = {"__name__": "__learner__"}
    for source in [*setup, *solutions]:
        exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    return namespace


def learner(namespace, source, name):
    """A function written in a learner's notebook (its globals: the notebook's solutions)."""
    scope = dict(namespace)
    exec(compile(source, "<learner's cell>", "exec"), scope)
    return scope[name]


def fails(check, fn, pattern, **kwargs):
    with pytest.raises(CheckFailed, match=pattern):
        check(fn, **kwargs)


def stub(*args, **kwargs):
    raise NotImplementedError()


CHECKS = [
    "temperature",
    "greedy",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "sample",
    "next_token",
    "beam_search",
    "stream_text",
]


@pytest.mark.parametrize("name", CHECKS)
def test_stubs_fail(name):
    fails(getattr(C, f"check_{name}"), stub, "is not written yet")


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "greedy", "sample"])
def test_the_engines_own_functions_are_refused(name):
    fails(getattr(C, f"check_{name}"), getattr(S, name), "black box")


def test_transformers_is_refused():
    from transformers import TopKLogitsWarper

    fails(C.check_top_k, lambda logits, k: TopKLogitsWarper(k)(None, logits.clone()), "black box")


def test_a_next_token_that_uses_the_engines_is_refused():
    fails(
        C.check_next_token,
        lambda logits, settings, seen=None, generator=None: S.next_token(logits, settings, seen, generator),
        "black box",
    )


# ----------------------------------------------------------------------------------------------
# Processors


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("def temperature(logits, t):\n    return logits * t", "do not multiply"),
        ("def temperature(logits, t):\n    return torch.softmax(logits / t, dim=-1)", "not probabilities"),
        ("def temperature(logits, t):\n    logits /= t\n    return logits", "changed its input"),
        ("def temperature(logits, t):\n    return logits.float() / t", "float64 in, float64 out"),
    ],
)
def test_temperature_mistakes(nb, source, pattern):
    fails(C.check_temperature, learner(nb, source, "temperature"), pattern)


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("def greedy(logits):\n    return logits.argmax(dim=0)", "expected shape"),
        ("def greedy(logits):\n    return logits.max(dim=-1).values", "token ids"),
        ("def greedy(logits):\n    return logits.argmax(dim=-1, keepdim=True)", "1-d tensor"),
        (
            "def greedy(logits):\n    V = logits.shape[-1]\n    return V - 1 - logits.flip(-1).argmax(dim=-1)",
            "a tie: the lowest id wins",
        ),
    ],
)
def test_greedy_mistakes(nb, source, pattern):
    fails(C.check_greedy, learner(nb, source, "greedy"), pattern)


TOP_K_STRICT = """
def top_k(logits, k):
    k = min(k, logits.shape[-1])
    index = torch.topk(logits, k).indices
    return torch.full_like(logits, float("-inf")).scatter(-1, index, logits.gather(-1, index))
"""


@pytest.mark.parametrize(
    "source, pattern",
    [
        (TOP_K_STRICT, "ties with the k-th are kept.*\n(.*\n)*.*hint: keep every token tied"),
        (
            "def top_k(logits, k):\n    kth = torch.topk(logits, k).values[:, -1:]\n"
            "    return logits.masked_fill(logits < kth, float('-inf'))",
            "k may be larger than the vocabulary",
        ),
        (
            "def top_k(logits, k):\n    k = min(k, logits.shape[-1])\n    kth = torch.topk(logits, k).values[:, -1:]\n"
            "    return logits.masked_fill(logits < kth, 0.0)",
            "must be -inf",
        ),
        (
            "def top_k(logits, k):\n    kth = torch.sort(logits.flatten(), descending=True).values[min(k, "
            "logits.shape[-1]) - 1]\n"
            "    return logits.masked_fill(logits < kth, float('-inf'))",
            "not of the whole batch",
        ),
        (
            "def top_k(logits, k):\n    k = min(k + 1, logits.shape[-1])\n    kth = torch.topk(logits, "
            "k).values[:, -1:]\n"
            "    return logits.masked_fill(logits < kth, float('-inf'))",
            "expected 2 tokens kept",
        ),
    ],
)
def test_top_k_mistakes(nb, source, pattern):
    fails(C.check_top_k, learner(nb, source, "top_k"), pattern)


TOP_P_DESCENDING = """
def top_p(logits, p):
    probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs          # probability of the more likely tokens
    keep = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before < p)
    return logits.masked_fill(~keep, float("-inf"))
"""
TOP_P_TOO_FEW = """
def top_p(logits, p):
    probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    keep_sorted = probs.cumsum(dim=-1) <= p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
"""
TOP_P_SWAPPED = """
def top_p(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1)
    remove_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) <= p
    remove_sorted[:, -1] = False
    return logits.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), float("-inf"))
"""
TOP_P_LOGITS = """
def top_p(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1)
    remove_sorted = sorted_logits.cumsum(dim=-1) <= 1 - p
    remove_sorted[:, -1] = False
    return logits.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), float("-inf"))
"""
TOP_P_NO_SCATTER = """
def top_p(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1)
    remove_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) <= 1 - p
    remove_sorted[:, -1] = False
    return logits.masked_fill(remove_sorted, float("-inf"))   # forgot to put it back in vocabulary order
"""


def test_top_p_descending_is_accepted(nb):
    C.check_top_p(learner(nb, TOP_P_DESCENDING, "top_p"))
    C.check_top_p(learner(nb, TOP_P_DESCENDING, "top_p"), seed=101, n_random=30)


@pytest.mark.parametrize(
    "source, pattern",
    [
        (TOP_P_TOO_FEW, "one token too few"),
        (TOP_P_SWAPPED, "expected 2 tokens kept: \\[0, 1\\], got 1 kept"),
        (TOP_P_LOGITS, "tokens kept"),
        (TOP_P_NO_SCATTER, "tokens kept"),
    ],
)
def test_top_p_mistakes(nb, source, pattern):
    fails(C.check_top_p, learner(nb, source, "top_p"), pattern)


MIN_P_LOG = """
def min_p(logits, p):
    # probability >= p * max probability  <=>  logit >= max logit + log(p)
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + math.log(p), float("-inf"))
"""


def test_min_p_in_log_space_is_accepted(nb):
    C.check_min_p(learner(nb, MIN_P_LOG, "min_p"))
    C.check_min_p(learner(nb, MIN_P_LOG, "min_p"), seed=101, n_random=30)


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def min_p(logits, p):\n    return logits.masked_fill(torch.softmax(logits, -1) < p, float('-inf'))",
            "LARGEST probability of its row",
        ),
        (
            "def min_p(logits, p):\n    return logits.masked_fill(logits < p * logits.amax(-1, keepdim=True), "
            "float('-inf'))",
            "compare probabilities",
        ),
        (
            "def min_p(logits, p):\n    probs = torch.softmax(logits, -1)\n"
            "    return logits.masked_fill(probs < p * probs.max(), float('-inf'))",
            "each row has its own",
        ),
        (
            "def min_p(logits, p):\n    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)\n"
            "    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float('-inf'))",
            "large logits",
        ),
    ],
)
def test_min_p_mistakes(nb, source, pattern):
    fails(C.check_min_p, learner(nb, source, "min_p"), pattern)


def test_repetition_penalty_with_a_mask_product_is_accepted(nb):
    source = (
        "def repetition_penalty(logits, seen, penalty):\n"
        "    factor = torch.where(logits > 0, torch.full_like(logits, 1 / penalty), torch.full_like(logits, penalty))\n"
        "    return torch.where(seen, logits * factor, logits)"
    )
    C.check_repetition_penalty(learner(nb, source, "repetition_penalty"), seed=101, n_random=30)


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def repetition_penalty(logits, seen, penalty):\n    return torch.where(seen, logits * penalty, logits)",
            "MORE likely",
        ),
        (
            "def repetition_penalty(logits, seen, penalty):\n    return torch.where(seen, logits / penalty, logits)",
            "negative logit is multiplied",
        ),
        (
            "def repetition_penalty(logits, seen, penalty):\n"
            "    return torch.where(~seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)",
            "that ARE in the text",
        ),
        (
            "def repetition_penalty(logits, seen, penalty):\n"
            "    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)\n"
            "    return logits",
            "changed its input",
        ),
    ],
)
def test_repetition_penalty_mistakes(nb, source, pattern):
    fails(C.check_repetition_penalty, learner(nb, source, "repetition_penalty"), pattern)


# ----------------------------------------------------------------------------------------------
# Samplers

SAMPLE_INVERSE_CDF = """
def sample(logits, generator):
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)          # [B, V]
    u = torch.rand(logits.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logits.shape[-1] - 1)
"""
SAMPLE_GUMBEL = """
def sample(logits, generator):
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp(min=1e-300)
    return torch.argmax(logits.double() - torch.log(-torch.log(u)), dim=-1)
"""


@pytest.mark.parametrize("source", [SAMPLE_INVERSE_CDF, SAMPLE_GUMBEL])
def test_other_correct_samplers_are_accepted(nb, source):
    fn = learner(nb, source, "sample")
    C.check_sample(fn)
    C.check_sample(fn, seed=101, n_random=8)


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("def sample(logits, generator):\n    return torch.argmax(logits, dim=-1)", "chi-square"),
        (
            "def sample(logits, generator):\n    probs = logits - logits.amin(-1, keepdim=True)\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "did not|chi-square|raised",
        ),
        (
            "def sample(logits, generator):\n    probs = torch.softmax(logits, dim=-1) ** 2\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "chi-square",
        ),
        (
            "def sample(logits, generator):\n    probs = torch.softmax(logits, dim=0)\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "chi-square",
        ),
        (
            "def sample(logits, generator):\n    return torch.multinomial(torch.softmax(logits, dim=-1), 1, "
            "generator=generator)",
            "squeeze",
        ),
        (
            "def sample(logits, generator):\n    return torch.multinomial(torch.softmax(logits, dim=-1), "
            "1).squeeze(-1)",
            "used or changed torch's global generator",
        ),
        (
            "def sample(logits, generator):\n    g = torch.Generator().manual_seed(0)\n"
            "    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).squeeze(-1)",
            "generator's state did not change",
        ),
        (
            "def sample(logits, generator):\n    probs = torch.softmax(logits.clamp(min=-1e4), dim=-1) + 1e-3\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "probability is 0",
        ),
    ],
)
def test_sample_mistakes(nb, source, pattern):
    fails(C.check_sample, learner(nb, source, "sample"), pattern)


NEXT_TOKEN = """
def next_token(logits, settings, seen=None, generator=None):
    steps = [("repetition_penalty", lambda x: repetition_penalty(x, seen, settings.repetition_penalty)
              if seen is not None and settings.repetition_penalty != 1 else x),
             ("temperature", lambda x: temperature(x, settings.temperature) if settings.temperature else x),
             ("top_k", lambda x: top_k(x, settings.top_k) if settings.top_k else x),
             ("top_p", lambda x: top_p(x, settings.top_p) if settings.top_p < 1 else x),
             ("min_p", lambda x: min_p(x, settings.min_p) if settings.min_p else x)]
    order = ORDER
    for name in order:
        logits = dict(steps)[name](logits)
    if settings.temperature == 0:
        return GREEDY
    return sample(logits, generator)
"""
RIGHT = '["repetition_penalty", "temperature", "top_k", "top_p", "min_p"]'


def next_token_variant(nb, order=RIGHT, greedy="greedy(logits)"):
    return learner(nb, NEXT_TOKEN.replace("ORDER", order).replace("GREEDY", greedy), "next_token")


def test_next_token_written_differently_is_accepted(nb):
    C.check_next_token(next_token_variant(nb), seed=101, n_random=8)


@pytest.mark.parametrize(
    "order, greedy, pattern",
    [
        (
            '["repetition_penalty", "top_p", "temperature", "top_k", "min_p"]',
            "greedy(logits)",
            "temperature 0.5 before top-p",
        ),
        (
            '["repetition_penalty", "min_p", "temperature", "top_k", "top_p"]',
            "greedy(logits)",
            "temperature 2 before min-p",
        ),
        ('["repetition_penalty", "temperature", "top_p", "top_k", "min_p"]', "greedy(logits)", "top-k 3 before top-p"),
        (
            '["repetition_penalty", "temperature", "top_k", "min_p", "top_p"]',
            "greedy(logits)",
            "top-p 0.8 before min-p",
        ),
        (
            '["temperature", "top_k", "repetition_penalty", "top_p", "min_p"]',
            "greedy(logits)",
            "repetition penalty before",
        ),
    ],
)
def test_next_token_order_mistakes(nb, order, greedy, pattern):
    fails(C.check_next_token, next_token_variant(nb, order, greedy), pattern)


@pytest.mark.parametrize(
    "source, pattern",
    [
        # the repetition penalty forgotten when greedy
        (
            "def next_token(logits, settings, seen=None, generator=None):\n"
            "    if settings.temperature == 0:\n        return greedy(logits)\n"
            "    return sample(temperature(logits, settings.temperature), generator)",
            "repetition penalty first",
        ),
        # sampling from logits, not their softmax
        (
            "def next_token(logits, settings, seen=None, generator=None):\n"
            "    if seen is not None and settings.repetition_penalty != 1:\n"
            "        logits = repetition_penalty(logits, seen, settings.repetition_penalty)\n"
            "    if settings.temperature == 0:\n        return greedy(logits)\n"
            "    x = temperature(logits, settings.temperature)\n"
            "    if settings.top_p < 1:\n        x = top_p(x, settings.top_p)\n"
            "    probs = (x - x.amax(-1, keepdim=True)).clamp(min=-30) + 30\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "chi-square|probability is 0|top-k 1",
        ),
        # divides by zero at temperature 0
        (
            "def next_token(logits, settings, seen=None, generator=None):\n"
            "    return sample(temperature(logits, settings.temperature), generator)",
            "expected|raised",
        ),
    ],
)
def test_next_token_mistakes(nb, source, pattern):
    fails(C.check_next_token, learner(nb, source, "next_token"), pattern)


def test_next_token_that_calls_an_unwritten_exercise_says_which(nb):
    fn = next_token_variant(dict(nb, sample=stub))
    fails(C.check_next_token, fn, "it calls stub, which is not written yet")


def test_a_sampler_that_hangs_is_stopped(nb):
    fails(
        C.check_sample,
        learner(nb, "def sample(logits, generator):\n    while True:\n        pass", "sample"),
        "did not finish",
    )


# ----------------------------------------------------------------------------------------------
# Beam search

BEAM = """
def beam_search(model, prompt_ids, num_beams, max_new_tokens, length_penalty=1.0, eos_token_id=None):
    beams = [list(prompt_ids)] * num_beams
    scores = torch.full((num_beams,), FIRST)
    scores[0] = 0.0
    finished = []
    for step in range(max_new_tokens):
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor(beams))[:, -1].float(), dim=-1)
        V = log_probs.shape[-1]
        top, index = torch.topk((scores[:, None] + log_probs).flatten(), 2 * num_beams)
        n, last = step + 1, step == max_new_tokens - 1
        live = []
        for rank, (score, i) in enumerate(zip(top.tolist(), index.tolist())):
            beam, token = divmod(i, V)
            if token == eos_token_id or last:
                if rank < RANK:
                    finished.append((FINAL, beams[beam] + [token]))
            elif len(live) < num_beams:
                live.append((score, beams[beam] + [token]))
        finished = sorted(finished, key=lambda f: -f[0])[:num_beams]
        if last or not live or STOP:
            break
        if len(finished) == num_beams and live[0][0] / n**length_penalty <= finished[-1][0]:
            break
        beams = [tokens for _, tokens in live]
        scores = torch.tensor([score for score, _ in live])
    return finished[0][1][len(prompt_ids):]
"""
BEAM_RIGHT = dict(FIRST='float("-inf")', RANK="num_beams", FINAL="score / n**length_penalty", STOP="False")


def variant(nb, name, template, right, **changes):
    """The learner function `name` written from `template`, its placeholders filled by `right`
    except where `changes` fill them with a mistake."""
    for key, value in {**right, **changes}.items():
        template = template.replace(key, value)
    return learner(nb, template, name)


def beam_variant(nb, **changes):
    return variant(nb, "beam_search", BEAM, BEAM_RIGHT, **changes)


def test_beam_search_written_differently_is_accepted(nb):
    C.check_beam_search(beam_variant(nb), seed=101, n_random=6)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(FINAL="score"), "length_penalty"),
        (dict(FIRST="0.0"), "expand only the first"),
        (dict(STOP="bool(finished)"), "keep searching until num_beams beams are finished"),
        (dict(FINAL="score / (n + len(prompt_ids))**length_penalty"), "length_penalty"),
    ],
)
def test_beam_search_mistakes(nb, changes, pattern):
    fails(C.check_beam_search, beam_variant(nb, **changes), pattern)


def test_beam_search_that_returns_a_tensor_is_told(nb):
    fn = learner(
        nb,
        "def beam_search(model, prompt_ids, num_beams, max_new_tokens, length_penalty=1.0, "
        "eos_token_id=None):\n    return torch.tensor(BEAM(model, prompt_ids, num_beams, max_new_tokens, "
        "length_penalty, eos_token_id))",
        "beam_search",
    )
    fn.__globals__["BEAM"] = nb["beam_search"]
    fails(C.check_beam_search, fn, "a list of token ids")


# ----------------------------------------------------------------------------------------------
# The generation loop

STREAM = """
def stream_text(model, tokenizer, prompt, settings, max_new_tokens, eos_token_id=EOT_ID, stop=(), seed=0):
    ids = tokenizer.encode(prompt, allowed_special="all")
    generator = torch.Generator().manual_seed(seed)
    seen = torch.zeros(1, model.config.vocab_size, dtype=torch.bool)
    seen[0, ids] = True
    decoder = StreamDecoder(tokenizer)
    text, shown = "", 0
    for _ in range(STEPS):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[:, -1]
        token = int(next_token(logits, settings, seen, generator))
        EOS_EARLY
        ids.append(token)
        seen[0, token] = True
        piece = PUSH
        text += piece
        EOS_LATE
        cut = min([i for i in (FIND) if i >= 0], default=-1)
        if cut >= 0:
            yield text[shown:cut]
            return
        safe = len(text) - max([n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
        if safe > shown:
            yield text[shown:safe]
            shown = safe
    text += decoder.flush()
    cut = min([i for i in (text.find(s) for s in stop) if i >= 0], default=len(text))
    if cut > shown:
        yield text[shown:cut]
"""
STREAM_RIGHT = dict(
    STEPS="max_new_tokens",
    EOS_EARLY="if token == eos_token_id:\n            break",
    EOS_LATE="",
    PUSH="decoder.push(token)",
    FIND="text.find(s) for s in stop",
)


def stream_variant(nb, **changes):
    return variant(nb, "stream_text", STREAM, STREAM_RIGHT, **changes)


def test_stream_text_written_differently_is_accepted(nb):
    C.check_stream_text(stream_variant(nb), seed=101, n_random=2)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(EOS_EARLY="", EOS_LATE="if token == eos_token_id:\n            break"), "EOS ends the text"),
        (dict(STEPS="max_new_tokens - 1"), "max_new_tokens = 3"),
        (dict(STEPS="max_new_tokens + 1"), "max_new_tokens = 3"),
        (dict(PUSH="tokenizer.decode([token])"), "unfinished UTF-8 character"),
        (dict(FIND="(text.find(s) if s in piece else -1) for s in stop"), "a stop string spread over two tokens"),
    ],
)
def test_stream_text_mistakes(nb, changes, pattern):
    fails(C.check_stream_text, stream_variant(nb, **changes), pattern)


def test_stream_text_that_does_not_stream_is_told(nb):
    fn = learner(nb, "def stream_text(*args, **kwargs):\n    yield ''.join(STREAM(*args, **kwargs))", "stream_text")
    fn.__globals__["STREAM"] = nb["stream_text"]
    fails(C.check_stream_text, fn, "came in one piece")


# ----------------------------------------------------------------------------------------------
# The checks' references against transformers, on the checks' own random cases (ties included)


def captured_cases(check, monkeypatch):
    seen = []

    def capture(name, fn, cases, **kwargs):
        seen.extend(map(resolved, cases))  # expected answers given as later(...) computed now

    monkeypatch.setenv("LLMCOURSE_CHECKS_IN_PROCESS", "1")  # the cases are made where they can be captured
    monkeypatch.setattr(C, "run_check", capture)
    monkeypatch.setattr(C, "in_engine", lambda *args, **kwargs: None)
    check(lambda *a: None, seed=101, n_random=30)
    return seen


@pytest.mark.parametrize(
    "name, warper", [("top_k", "TopKLogitsWarper"), ("top_p", "TopPLogitsWarper"), ("min_p", "MinPLogitsWarper")]
)
def test_expected_answers_equal_transformers(monkeypatch, name, warper):
    import transformers

    cases = captured_cases(getattr(C, f"check_{name}"), monkeypatch)
    assert len(cases) >= 30
    ties = 0
    for case in cases:
        logits, value = case.args
        theirs = getattr(transformers, warper)(value)(None, logits.clone())
        assert torch.equal(case.expected > -INF, theirs > -INF), case.description
        assert torch.equal(case.expected[case.expected > -INF], logits[case.expected > -INF])
        ties += any(len(set(row.tolist())) < len(row) for row in logits)
    assert ties >= 10  # the cases have ties


def test_repetition_penalty_expected_answers_equal_transformers(monkeypatch):
    from transformers import RepetitionPenaltyLogitsProcessor

    for case in captured_cases(C.check_repetition_penalty, monkeypatch):
        logits, seen, penalty = case.args
        for row in range(logits.shape[0]):
            ids = torch.nonzero(seen[row]).flatten()[None]
            if ids.numel() == 0:
                continue
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())
            assert torch.equal(theirs[0], case.expected[row]), case.description


def test_the_frequency_test_catches_a_small_bias_and_passes_the_truth():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    g = torch.Generator().manual_seed(0)
    right = torch.multinomial(probs.expand(3000, 3), 1, generator=g).squeeze(-1)
    assert C.frequency_problem(right, probs) is None
    biased = torch.multinomial(torch.tensor([[0.57, 0.27, 0.16]]).expand(3000, 3), 1, generator=g).squeeze(-1)
    assert "chi-square" in C.frequency_problem(biased, probs)


def test_scripted_model_steers_the_engine_and_the_loop_alike():
    tok = get_tokenizer()
    script = tok.encode(" to be or not")
    model = C.ScriptedModel(2, script)
    ids = torch.tensor([[1, 2]])
    for token in script:
        nxt = int(model(ids)[:, -1].argmax())
        assert nxt == token
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)


# ----------------------------------------------------------------------------------------------
# Issue 22's kinds of hole: dtypes and layouts, one row, extreme parameters, calls that differ in one
# argument, randomness as a contract, statistical power, defaults, streaming, the part to blame


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def temperature(logits, t):\n    x = logits if logits.dtype == torch.float64 else logits.float()\n    "
            "return x / t",
            "expected dtype torch.float16",
        ),
        ("def temperature(logits, t):\n    return logits / max(t, 0.3)", "t = 0.05"),
        (
            "def temperature(logits, t):\n    if t not in CACHE:\n        CACHE[t] = logits / t\n    return CACHE[t]",
            "one call must not remember another|values differ|expected shape",
        ),
    ],
)
def test_temperature_kinds_of_mistake(nb, source, pattern):
    fails(C.check_temperature, learner(dict(nb, CACHE={}), source, "temperature"), pattern)


@pytest.mark.parametrize(
    "source",
    [
        "def temperature(logits, t):\n    return logits * (1.0 / t)",
        "def temperature(logits, t):\n    return (logits.double() / t).to(logits.dtype)",
        "import numpy as np\ndef temperature(logits, t):\n    return logits / np.float64(t)",
    ],
)
def test_temperature_other_numerics_are_accepted(nb, source):
    C.check_temperature(learner(nb, source, "temperature"))


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("def greedy(logits):\n    return logits.argmax(dim=-1).int()", "token ids are torch.long"),
        (
            "def greedy(logits):\n    flat = logits.view(-1)\n    return flat.view(-1, "
            "logits.shape[-1]).argmax(dim=-1)",
            "not be contiguous",
        ),
        (
            "def greedy(logits):\n    return logits.argmax() if logits.shape[0] == 1 else logits.argmax(dim=-1)",
            "even when B = 1",
        ),
    ],
)
def test_greedy_kinds_of_mistake(nb, source, pattern):
    fails(C.check_greedy, learner(nb, source, "greedy"), pattern)


@pytest.mark.parametrize(
    "source",
    [
        "def greedy(logits):\n    return logits.max(dim=-1).indices",
        "import numpy as np\ndef greedy(logits):\n    return torch.from_numpy(np.argmax(logits.double().numpy(), "
        "axis=-1))",
    ],
)
def test_greedy_other_ways_are_accepted(nb, source):
    C.check_greedy(learner(nb, source, "greedy"))


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def top_k(logits, k):\n    k = min(k, logits.shape[-1])\n    x = logits.float()\n"
            "    return x.masked_fill(x < torch.topk(x, k).values[:, -1:], float('-inf'))",
            "expected dtype torch.float16",
        ),
        (
            "def top_k(logits, k):\n    V = logits.shape[-1]\n    x = logits.view(-1).view(-1, V)\n"
            "    return x.masked_fill(x < torch.topk(x, min(k, V)).values[:, -1:], float('-inf'))",
            "not be contiguous",
        ),
        (
            "def top_k(logits, k):\n    key = logits.data_ptr()\n    if key not in CACHE:\n"
            "        CACHE[key] = torch.topk(logits, min(k, logits.shape[-1])).values[:, -1:]\n"
            "    return logits.masked_fill(logits < CACHE[key], float('-inf'))",
            "tokens kept",
        ),
    ],
)
def test_top_k_kinds_of_mistake(nb, source, pattern):
    fails(C.check_top_k, learner(dict(nb, CACHE={}), source, "top_k"), pattern)


@pytest.mark.parametrize(
    "source",
    [
        "def top_k(logits, k):\n    k = min(k, logits.shape[-1])\n"
        "    kth = torch.sort(logits.double(), dim=-1, descending=True).values[:, k - 1 : k].to(logits.dtype)\n"
        "    return torch.where(logits >= kth, logits, torch.full_like(logits, float('-inf')))",
        "import numpy as np\ndef top_k(logits, k):\n    k = min(k, logits.shape[-1])\n"
        "    kth = np.sort(logits.double().numpy(), axis=-1)[:, -k][:, None]\n"
        "    return logits.masked_fill(torch.from_numpy(logits.double().numpy() < kth), float('-inf'))",
    ],
)
def test_top_k_other_ways_are_accepted(nb, source):
    C.check_top_k(learner(nb, source, "top_k"))


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            TOP_P_DESCENDING.replace("return logits.masked_fill", "return logits.float().masked_fill"),
            "expected dtype torch.float(16|64), got torch.float32",
        ),
        (
            TOP_P_DESCENDING.replace(
                "torch.sort(torch.softmax(logits, dim=-1)",
                "torch.sort(torch.softmax(logits.view(-1).view(logits.shape), dim=-1)",
            ),
            "not be contiguous",
        ),
        (
            TOP_P_DESCENDING.replace(
                "    before = probs",
                "    if logits.data_ptr() in CACHE:\n        return CACHE[logits.data_ptr()]\n    before = probs",
            ).replace(
                '    return logits.masked_fill(~keep, float("-inf"))',
                '    CACHE[logits.data_ptr()] = logits.masked_fill(~keep, float("-inf"))\n    return '
                "CACHE[logits.data_ptr()]",
            ),
            "one call must not remember another",
        ),
    ],
)
def test_top_p_kinds_of_mistake(nb, source, pattern):
    fails(C.check_top_p, learner(dict(nb, CACHE={}), source, "top_p"), pattern)


def test_top_p_in_float64_is_accepted(nb):
    source = TOP_P_DESCENDING.replace("torch.softmax(logits, dim=-1)", "torch.softmax(logits.double(), dim=-1)")
    C.check_top_p(learner(nb, source, "top_p"), seed=101, n_random=30)


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def min_p(logits, p):\n    probs = torch.softmax(logits, -1)\n"
            "    return logits.masked_fill(probs <= p * probs.amax(-1, keepdim=True), float('-inf'))",
            "p = 1 keeps only the most likely token[\\s\\S]*not <=",
        ),
        (
            "def min_p(logits, p):\n    probs = torch.softmax(logits.float(), -1)\n"
            "    return logits.float().masked_fill(probs < p * probs.amax(-1, keepdim=True), float('-inf'))",
            "expected dtype torch.float16",
        ),
        (
            "def min_p(logits, p):\n    probs = torch.softmax(logits.view(-1).view(logits.shape), -1)\n"
            "    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float('-inf'))",
            "not be contiguous",
        ),
    ],
)
def test_min_p_kinds_of_mistake(nb, source, pattern):
    fails(C.check_min_p, learner(nb, source, "min_p"), pattern)


def test_min_p_in_float64_is_accepted(nb):
    source = (
        "def min_p(logits, p):\n    probs = torch.softmax(logits.double(), -1)\n"
        "    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float('-inf'))"
    )
    C.check_min_p(learner(nb, source, "min_p"))


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def repetition_penalty(logits, seen, penalty):\n    x = logits.float()\n"
            "    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)",
            "expected dtype torch.float16",
        ),
        (
            "def repetition_penalty(logits, seen, penalty):\n    x = logits.view(-1)\n    s = seen.view(-1)\n"
            "    return torch.where(s, torch.where(x > 0, x / penalty, x * penalty), x).view(logits.shape)",
            "not be contiguous",
        ),
        (
            "def repetition_penalty(logits, seen, penalty):\n    seen = seen.any(0, keepdim=True)\n"
            "    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)",
            "row|values differ",
        ),
    ],
)
def test_repetition_penalty_kinds_of_mistake(nb, source, pattern):
    fails(C.check_repetition_penalty, learner(nb, source, "repetition_penalty"), pattern)


def test_repetition_penalty_in_float64_is_accepted(nb):
    source = (
        "def repetition_penalty(logits, seen, penalty):\n    x = logits.double()\n"
        "    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x).to(logits.dtype)"
    )
    C.check_repetition_penalty(learner(nb, source, "repetition_penalty"))


@pytest.mark.parametrize(
    "source, pattern",
    [
        # 0-d for one row
        (
            "def sample(logits, generator):\n"
            "    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze()",
            "a tensor \\[1\\]",
        ),
        # greedy below 50 rows
        (
            "def sample(logits, generator):\n    if logits.shape[0] < 50:\n        return logits.argmax(-1)\n"
            "    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)",
            "calls with one row|successive calls|drew nothing",
        ),
        # drops every probability below 1e-4
        (
            "def sample(logits, generator):\n    probs = torch.softmax(logits, dim=-1)\n"
            "    probs = probs.masked_fill(probs < 1e-4, 0)\n"
            "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)",
            "probability below 0.0001",
        ),
        # one uniform for all rows (inverse CDF)
        (
            "def sample(logits, generator):\n    cdf = torch.softmax(logits.double(), -1).cumsum(-1)\n"
            "    u = torch.rand(1, 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]\n"
            "    return torch.searchsorted(cdf, u.expand(cdf.shape[0], 1)).squeeze(-1).clamp(max=logits.shape[-1] - 1)",
            "not independent|chi-square",
        ),
        # ignores the generator when it is given
        (
            "def sample(logits, generator):\n    return torch.multinomial(torch.softmax(logits, dim=-1), "
            "1).squeeze(-1)",
            "global generator",
        ),
        # a fresh generator when given none
        (
            "def sample(logits, generator):\n    generator = generator or torch.Generator().manual_seed(0)\n"
            "    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)",
            "generator=None gave the same result",
        ),
    ],
)
def test_sample_kinds_of_mistake(nb, source, pattern):
    fails(C.check_sample, learner(nb, source, "sample"), pattern)


def test_sample_hint_about_minus_inf_only_when_one_was_drawn(nb):
    with pytest.raises(CheckFailed) as err:
        C.check_sample(learner(nb, "def sample(logits, generator):\n    return torch.argmax(logits, dim=-1)", "sample"))
    assert "exp(-inf)" not in str(err.value)
    source = (
        "def sample(logits, generator):\n    probs = torch.softmax(logits.clamp(min=-1e4), dim=-1) + 1e-3\n"
        "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)"
    )
    fails(C.check_sample, learner(nb, source, "sample"), "exp\\(-inf\\)")


def test_the_tail_test_sees_a_cut_at_1e_4_on_gpt2s_logits():
    one, _ = C.real_logits(0)
    probs = torch.softmax(one.double(), -1)
    assert float(probs[probs < 1e-4].sum()) > 0.09
    g = torch.Generator().manual_seed(1)
    right = torch.multinomial(probs.expand(300, -1).float(), 1, generator=g).squeeze(-1)
    assert C.frequency_problem(right, probs) is None
    cut = probs.masked_fill(probs < 1e-4, 0)
    wrong = torch.multinomial(cut.expand(300, -1).float(), 1, generator=g).squeeze(-1)
    assert "below 0.0001" in C.frequency_problem(wrong, probs)


@pytest.mark.parametrize(
    "source, pattern",
    [
        # top_k = 1 treated as 'off'
        (
            NEXT_TOKEN.replace("if settings.top_k else x", "if settings.top_k > 1 else x")
            .replace("ORDER", RIGHT)
            .replace("GREEDY", "greedy(logits)"),
            "top-k 1",
        ),
        # repetition penalty applied with seen=None
        (
            "def next_token(logits, settings, seen=None, generator=None):\n"
            "    if settings.repetition_penalty != 1.0:\n"
            "        logits = repetition_penalty(logits, seen, settings.repetition_penalty)\n"
            "    if settings.temperature == 0:\n        return greedy(logits)\n"
            "    return sample(temperature(logits, settings.temperature), generator)",
            "seen=None",
        ),
        # its own generator when given none
        (
            NEXT_TOKEN.replace(
                "return sample(logits, generator)",
                "return sample(logits, generator or torch.Generator().manual_seed(0))",
            )
            .replace("ORDER", RIGHT)
            .replace("GREEDY", "greedy(logits)"),
            "generator=None gave the same result",
        ),
    ],
)
def test_next_token_kinds_of_mistake(nb, source, pattern):
    fails(C.check_next_token, learner(nb, source, "next_token"), pattern)


def test_next_token_names_the_part_that_broke(nb):
    broken_top_p = "def top_p(logits, p):\n    return torch.full_like(logits, float('-inf'))"
    namespace = dict(nb)
    exec(compile(broken_top_p, "<learner's cell>", "exec"), namespace)
    fn = learner(
        namespace,
        "def next_token(logits, settings, seen=None, generator=None):\n"
        + "\n".join(NEXT_TOKEN.replace("ORDER", RIGHT).replace("GREEDY", "greedy(logits)").split("\n")[2:]),
        "next_token",
    )
    with pytest.raises(CheckFailed) as err:
        C.check_next_token(fn)
    assert "your top_p removed every token" in str(err.value) and "check_top_p" in str(err.value)
    assert "in sample" not in str(err.value)


def test_next_token_written_with_numpy_draws_is_accepted(nb):
    source = (
        "import numpy as np\n"
        "def next_token(logits, settings, seen=None, generator=None):\n"
        "    if seen is not None and settings.repetition_penalty != 1.0:\n"
        "        logits = repetition_penalty(logits, seen, settings.repetition_penalty)\n"
        "    if settings.temperature == 0:\n        return greedy(logits)\n"
        "    x = temperature(logits, settings.temperature)\n"
        "    if settings.top_k:\n        x = top_k(x, settings.top_k)\n"
        "    if settings.top_p < 1:\n        x = top_p(x, settings.top_p)\n"
        "    if settings.min_p:\n        x = min_p(x, settings.min_p)\n"
        "    cdf = torch.softmax(x.double(), -1).cumsum(-1)\n"
        "    u = torch.rand(x.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]\n"
        "    return torch.from_numpy(np.minimum((cdf.numpy() < u.numpy()).sum(-1), x.shape[-1] - 1))"
    )
    C.check_next_token(learner(nb, source, "next_token"))


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(EOS_EARLY="if eos_token_id and token == eos_token_id:\n            break"), "EOS id 0"),
        (
            dict(EOS_EARLY="if token == eos_token_id:\n            break\n        eos_token_id = eos_token_id or None"),
            "EOS id 0",
        ),
        (dict(FIND="(text.find(s) for s in stop) if False else (-1 for s in stop)"), "stop string"),
    ],
)
def test_stream_text_kinds_of_mistake(nb, changes, pattern):
    fails(C.check_stream_text, stream_variant(nb, **changes), pattern)


def test_stream_text_with_a_wrong_default_is_told(nb):
    source = STREAM.replace("eos_token_id=EOT_ID", "eos_token_id=None")
    for key, value in STREAM_RIGHT.items():
        source = source.replace(key, value)
    fails(C.check_stream_text, learner(nb, source, "stream_text"), "without eos_token_id, stop and seed")


def test_stream_text_without_flush_is_told_to_flush(nb):
    source = STREAM
    for key, value in STREAM_RIGHT.items():
        source = source.replace(key, value)
    source = source.replace("text += decoder.flush()", "pass")
    with pytest.raises(CheckFailed) as err:
        C.check_stream_text(learner(nb, source, "stream_text"))
    assert "flush" in str(err.value) and "Generator" not in str(err.value)


def test_stream_text_that_yields_only_at_the_end_is_told(nb):
    fn = learner(
        nb,
        "def stream_text(*args, **kwargs):\n    pieces = list(STREAM(*args, **kwargs))\n    yield from pieces",
        "stream_text",
    )
    fn.__globals__["STREAM"] = nb["stream_text"]
    fails(C.check_stream_text, fn, "before computing the next token|came in one piece")


def test_stream_text_with_a_prompt_encoded_without_special_tokens_is_told(nb):
    source = STREAM
    for key, value in STREAM_RIGHT.items():
        source = source.replace(key, value)
    source = source.replace(
        'tokenizer.encode(prompt, allowed_special="all")', "tokenizer.encode(prompt, disallowed_special=())"
    )
    fails(C.check_stream_text, learner(nb, source, "stream_text"), "endoftext")


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            BEAM.replace("if token == eos_token_id or last", "if (eos_token_id and token == eos_token_id) or last"),
            "EOS id 0",
        ),
    ],
)
def test_beam_search_kinds_of_mistake(nb, source, pattern):
    for key, value in BEAM_RIGHT.items():
        source = source.replace(key, value)
    fails(C.check_beam_search, learner(nb, source, "beam_search"), pattern)


# ----------------------------------------------------------------------------------------------
# Issue 41's kinds of hole: exactly on a threshold, float16 with large scores, inputs changed in place,
# settings that look greedy, beam search's stopping rules, streaming's bookkeeping

TOP_P_TUTORIAL = """
def top_p(logits, p):   # the tutorials' rule: remove a token once the mass before it exceeds p
    probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs
    keep = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before <= p)
    return logits.masked_fill(~keep, float("-inf"))
"""
TOP_P_STRICT = """
def top_p(logits, p):   # the chapter's rule with < where it says <=
    sorted_logits, order = torch.sort(logits, dim=-1)
    remove_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) < 1 - p
    remove_sorted[:, -1] = False
    return logits.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), float("-inf"))
"""
TOP_P_SHIFTED = """
def top_p(logits, p):   # transformers' old rule: remove where the cumulative passes p, shifted right by one
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    remove = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) COMPARE p
    remove[:, 1:] = remove[:, :-1].clone()
    remove[:, 0] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
"""


def test_the_threshold_cases_are_exact_in_float64_and_float32():
    probs = [0.5, 0.25, 0.125, 0.03125, 0.03125, 0.03125, 0.03125]
    logits = C._exact_logits(probs)
    for x in (logits, logits.float()):  # computed in their own dtype
        assert torch.softmax(x, -1).double().tolist()[0] == probs
    for p in (0.75, 0.5):  # float32 logits computed in float64 (by the check's reference) keep the same tokens
        assert torch.equal(S.top_p(logits.float(), p) > -INF, S.top_p(logits.float().double(), p) > -INF)


@pytest.mark.parametrize(
    "source", [TOP_P_TUTORIAL, TOP_P_STRICT, TOP_P_SHIFTED.replace("COMPARE", ">")], ids=["tutorial", "<", "shifted"]
)
def test_top_p_one_token_too_many_exactly_on_the_threshold_is_told(nb, source):
    fails(
        C.check_top_p,
        learner(nb, source, "top_p"),
        r"\.5 \+ \.25 is exactly p and is kept alone: row 0: expected 2 tokens kept: \[0, 1\], got 3"
        r"[\s\S]*hint: one token too many exactly on the boundary",
    )


def test_top_p_shifted_with_reaches_is_accepted(nb):
    C.check_top_p(learner(nb, TOP_P_SHIFTED.replace("COMPARE", ">="), "top_p"), seed=101, n_random=30)


MIN_P_AT_MOST = """
def min_p(logits, p):   # <= where the rule says <, the most likely token kept apart
    probs = torch.softmax(logits, -1)
    top = probs.amax(-1, keepdim=True)
    return logits.masked_fill((probs <= p * top) & (probs < top), float("-inf"))
"""


def test_min_p_that_removes_a_probability_exactly_on_the_bar_is_told(nb):
    fails(
        C.check_min_p,
        learner(nb, MIN_P_AT_MOST, "min_p"),
        r"a probability of exactly 0\.25 × \.5 = 0\.125 is kept: row 0: expected 3 tokens kept[\s\S]*not <=",
    )


def test_min_p_as_a_ratio_is_accepted(nb):
    source = (
        "def min_p(logits, p):\n    probs = torch.softmax(logits, -1)\n"
        "    return logits.masked_fill(probs / probs.amax(-1, keepdim=True) < p, float('-inf'))"
    )
    C.check_min_p(learner(nb, source, "min_p"), seed=101, n_random=30)


@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "def top_k(logits, k):\n    rows = []\n    for row in logits:\n"
            "        values = torch.unique(row, sorted=True).flip(0)   # distinct values, highest first\n"
            "        rows.append(row.masked_fill(row < values[min(k, len(values)) - 1], float('-inf')))\n"
            "    return torch.stack(rows)",
            r"the two highest tie, k = 2[\s\S]*not the k-th distinct value",
        ),
        (
            "def top_k(logits, k):\n    kth = torch.topk(logits, min(k, logits.shape[-1])).values[:, -1:]\n"
            "    return logits.masked_fill(logits <= kth, float('-inf'))",
            r"hint: the k-th highest logit itself stays: remove only the logits < the k-th \(not <=\)",
        ),
        (
            "def top_k(logits, k):\n    kth = torch.topk(logits, min(k, logits.shape[-1])).values[:, -1:]\n"
            "    logits[logits < kth] = float('-inf')\n    return logits",
            r"changed its input `logits`[\s\S]*in-place operation",
        ),
    ],
    ids=["distinct values", "<=", "in place"],
)
def test_top_k_ties_and_boundary_mistakes(nb, source, pattern):
    fails(C.check_top_k, learner(nb, source, "top_k"), pattern)


# a softmax that subtracts the max only where float32 would overflow: right in float32, inf / inf in float16
GUARDS_FLOAT32_ONLY = """
def softmax(x):
    if bool((x.abs().amax(-1) > 80).any()):
        x = x - x.amax(-1, keepdim=True)
    e = x.exp()
    return e / e.sum(-1, keepdim=True)
"""


@pytest.mark.parametrize(
    "name, body",
    [
        (
            "top_p",
            "def top_p(logits, p):\n    sorted_logits, order = torch.sort(logits, dim=-1)\n"
            "    remove_sorted = softmax(sorted_logits).cumsum(dim=-1) <= 1 - p\n    remove_sorted[:, -1] = False\n"
            "    return logits.masked_fill(torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted), "
            "float('-inf'))",
        ),
        (
            "min_p",
            "def min_p(logits, p):\n    probs = softmax(logits)\n"
            "    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), float('-inf'))",
        ),
        (
            "sample",
            "def sample(logits, generator):\n"
            "    return torch.multinomial(softmax(logits), 1, generator=generator).squeeze(-1)",
        ),
    ],
)
def test_a_softmax_that_overflows_in_float16_is_told(nb, name, body):
    fn = learner(nb, GUARDS_FLOAT32_ONLY + body, name)
    fails(getattr(C, f"check_{name}"), fn, r"float16[\s\S]*subtract each row's max")


NEXT_TOKEN_SHORTCUT = """
def next_token(logits, settings, seen=None, generator=None):
    if seen is not None and settings.repetition_penalty != 1.0:
        logits = repetition_penalty(logits, seen, settings.repetition_penalty)
    if SHORTCUT:
        return greedy(logits)
    logits = temperature(logits, settings.temperature)
    if settings.top_k:
        logits = top_k(logits, settings.top_k)
    if settings.top_p < 1.0:
        logits = top_p(logits, settings.top_p)
    if settings.min_p:
        logits = min_p(logits, settings.min_p)
    return sample(logits, generator)
"""


@pytest.mark.parametrize(
    "shortcut, pattern",
    [
        ("settings.temperature == 0 or settings.top_k == 1", r"top-k 1 with two tokens tied[\s\S]*not greedy|ties"),
        ("settings.temperature < 0.01", r"temperature 0\.001, logits 0\.001 apart[\s\S]*only temperature 0 is greedy"),
    ],
    ids=["top-k 1 is greedy", "a small temperature is greedy"],
)
def test_next_token_that_takes_a_shortcut_to_greedy_is_told(nb, shortcut, pattern):
    fails(C.check_next_token, learner(nb, NEXT_TOKEN_SHORTCUT.replace("SHORTCUT", shortcut), "next_token"), pattern)


def test_next_token_that_is_greedy_at_top_k_1_before_the_penalty_is_told(nb):
    source = NEXT_TOKEN_SHORTCUT.replace(
        "    if seen is not None",
        "    if settings.top_k == 1:\n        return greedy(logits)\n    if seen is not None",
        1,
    )
    fails(
        C.check_next_token,
        learner(nb, source.replace("SHORTCUT", "settings.temperature == 0"), "next_token"),
        r"top-k 1 after the repetition penalty[\s\S]*top_k=1 is not greedy decoding",
    )


def test_next_token_that_divides_its_input_in_place_is_told(nb):
    source = NEXT_TOKEN_SHORTCUT.replace("SHORTCUT", "settings.temperature == 0").replace(
        "logits = temperature(logits, settings.temperature)", "logits /= settings.temperature"
    )
    fails(C.check_next_token, learner(nb, source, "next_token"), r"changed its input `logits`")


def test_a_sampler_that_changes_its_one_row_input_is_told(nb):
    source = (
        "def sample(logits, generator):\n    if logits.shape[0] == 1:\n"
        "        logits -= logits.amax(-1, keepdim=True)\n"
        "    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)"
    )
    fails(C.check_sample, learner(nb, source, "sample"), r"changed its input `logits`")


def beam_right():
    source = BEAM
    for key, value in BEAM_RIGHT.items():
        source = source.replace(key, value)
    return source


@pytest.mark.parametrize(
    "old, new, pattern",
    [
        ("2 * num_beams)", "num_beams)", r"found only by keeping 2·num_beams[\s\S]*hint: take the 2·num_beams best"),
        (
            "if token == eos_token_id or last:",
            "if (token == eos_token_id and rank == 0) or last:",
            r"\[EOS\] is finished, never extended[\s\S]*hint: a candidate that ends with EOS is finished at any rank",
        ),
        (
            "if rank < num_beams:",
            "if rank < 2 * num_beams:",
            r"ranked 3rd, below num_beams: it does not finish[\s\S]*hint: only candidates ranked among the first",
        ),
        (
            "if token == eos_token_id or last:",
            "if token == eos_token_id:",
            r"reaching max_new_tokens finishes \[A, X\][\s\S]*hint: at the last step \(max_new_tokens\) every",
        ),
        (
            "live[0][0] / n**length_penalty <= finished[-1][0]",
            "live[0][0] <= finished[-1][0]",
            r"scored at its length \(-0\.76\) can still beat[\s\S]*hint: in the stopping test, score the best live",
        ),
        (
            "if len(finished) == num_beams and live[0][0]",
            "if False and live[0][0]",
            r"1 beam, length_penalty 2: EOS \.6 first[\s\S]*hint: stop once num_beams hypotheses are finished",
        ),
        ("or False:", "or bool(finished):", r"hint: do not stop when the first hypothesis is finished"),
    ],
    ids=[
        "num_beams candidates",
        "EOS only at rank 0",
        "EOS at any of 2k ranks",
        "length does not finish",
        "stopping test unnormalized",
        "never stops early",
        "stops at the first EOS",
    ],
)
def test_beam_search_stopping_rule_mistakes_are_named(nb, old, new, pattern):
    source = beam_right()
    assert old in source
    source = source.replace(old, new).replace(
        "return finished[0][1][len(prompt_ids):]", "return (finished or live)[0][1][len(prompt_ids):]"
    )
    fails(C.check_beam_search, learner(nb, source, "beam_search"), pattern)


def test_beam_search_with_a_sort_instead_of_topk_is_accepted(nb):
    source = beam_right().replace(
        "top, index = torch.topk((scores[:, None] + log_probs).flatten(), 2 * num_beams)",
        "top, index = torch.sort((scores[:, None] + log_probs).flatten(), descending=True)\n"
        "        top, index = top[: 2 * num_beams], index[: 2 * num_beams]",
    )
    assert "torch.sort" in source
    C.check_beam_search(learner(nb, source, "beam_search"), seed=101, n_random=6)


def test_one_beam_as_greedy_decoding_that_extends_the_prompt_is_told(nb):
    source = beam_right().replace(
        "    beams = [list(prompt_ids)] * num_beams",
        "    if num_beams == 1:   # greedy decoding\n        ids = prompt_ids\n"
        "        for _ in range(max_new_tokens):\n"
        "            with torch.no_grad():\n"
        "                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))\n"
        "            if ids[-1] == eos_token_id:\n                break\n"
        "        return ids[len(ids) - max_new_tokens:]\n"
        "    beams = [list(prompt_ids)] * num_beams",
    )
    fails(C.check_beam_search, learner(nb, source, "beam_search"), r"changed its input `prompt_ids`")


def test_the_checks_beam_search_by_the_chapters_rules_is_the_engines(monkeypatch):
    cases = captured_cases(C.check_beam_search, monkeypatch)
    trees = [case for case in cases if isinstance(case.args[0], C.TreeModel)]
    assert len(trees) == 6 and len(cases) >= 15
    for case in cases:
        assert C.beam_search_by(C.BeamRules(), *case.args) == case.expected, case.description
    # each scripted case separates its mistake from the chapter's rules
    designed = [[7], [2, 7], [1, 4], [1, 4], [7], [1, 4, 7]]
    assert [case.expected for case in trees] == designed


def stream_right():
    source = STREAM
    for key, value in STREAM_RIGHT.items():
        source = source.replace(key, value)
    return source


@pytest.mark.parametrize(
    "old, new, pattern",
    [
        ("        seen[0, token] = True\n", "", r"repetition penalty 1\.5[\s\S]*hint: add each new token to seen"),
        ("    seen[0, ids] = True\n", "", r"repetition penalty 1\.5[\s\S]*hint: seen starts with the prompt's tokens"),
        (
            "next_token(logits, settings, seen, generator)",
            "next_token(logits, settings, seen, torch.Generator().manual_seed(seed))",
            r"a draw from one generator[\s\S]*hint: make the generator once, before the loop",
        ),
        ("manual_seed(seed)", "manual_seed(0)", r"seed 5: [\s\S]*hint: seed the generator with the seed given"),
        (
            "next_token(logits, settings, seen, generator)",
            "next_token(logits, SamplingParams(), seen, generator)",
            r"repetition penalty 1\.5[\s\S]*hint: pass the settings given to your next_token",
        ),
        (
            "    generator = torch.Generator().manual_seed(seed)\n",
            "    torch.manual_seed(seed)\n    generator = None\n",
            r"the text is right, but torch's global generator changed",
        ),
    ],
    ids=[
        "seen without new tokens",
        "seen without the prompt",
        "a generator each step",
        "seed ignored",
        "settings ignored",
        "the global generator",
    ],
)
def test_stream_text_bookkeeping_mistakes_are_named(nb, old, new, pattern):
    source = stream_right()
    assert old in source
    fails(C.check_stream_text, learner(nb, source.replace(old, new), "stream_text"), pattern)


def test_stream_text_that_returns_a_list_is_told(nb):
    fn = learner(nb, "def stream_text(*args, **kwargs):\n    return list(STREAM(*args, **kwargs))", "stream_text")
    fn.__globals__["STREAM"] = nb["stream_text"]
    fails(C.check_stream_text, fn, r"returned a list: it must be a generator function[\s\S]*hint: write `yield piece`")


STREAM_REDECODED = """
def stream_text(model, tokenizer, prompt, settings, max_new_tokens, eos_token_id=EOT_ID, stop=(), seed=0):
    ids = tokenizer.encode(prompt, allowed_special="all")
    generator = torch.Generator().manual_seed(seed)
    seen = torch.zeros(1, model.config.vocab_size, dtype=torch.bool)
    seen[0, ids] = True
    new, shown = [], 0
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[:, -1]
        token = int(next_token(logits, settings, seen, generator))
        if token == eos_token_id:
            break
        ids.append(token)
        new.append(token)
        seen[0, token] = True
        text = tokenizer.decode(new)          # all the new text, decoded again at every step
        ready = len(HELD)
        cut = min([i for i in (text.find(s) for s in stop) if i >= 0], default=-1)
        if cut >= 0:
            if cut > shown:
                yield text[shown:cut]
            return
        ready -= max([n for s in stop for n in range(1, len(s)) if text[:ready].endswith(s[:n])], default=0)
        if ready > shown:
            yield text[shown:ready]
            shown = ready
    text = tokenizer.decode(new)
    cut = min([i for i in (text.find(s) for s in stop) if i >= 0], default=len(text))
    if cut > shown:
        yield text[shown:cut]
"""


def test_stream_text_that_decodes_again_each_step_is_accepted_if_it_holds_back_a_partial_character(nb):
    held_back = STREAM_REDECODED.replace("HELD", 'text.rstrip("\\ufffd")')  # an unfinished character waits
    C.check_stream_text(learner(nb, held_back, "stream_text"), seed=101, n_random=2)
    fails(
        C.check_stream_text,
        learner(nb, STREAM_REDECODED.replace("HELD", "text"), "stream_text"),
        r"an emoji split over several tokens[\s\S]*unfinished UTF-8 character",
    )


def test_stream_tokens_is_the_engines_loop():
    from llmcourse.engine.generate import generate

    model, tok = C.tiny_model(3, vocab_size=1000), get_tokenizer()
    prompt = tok.encode("The")
    for settings in (
        S.SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3),
        S.SamplingParams(repetition_penalty=1.5),
    ):
        theirs = generate(model, prompt, settings, max_new_tokens=12, eos_token_id=None, seed=7)
        assert C.stream_tokens(model, prompt, settings, 12, 7) == theirs


@pytest.mark.parametrize("seed", [0, 101])
def test_the_sampled_stream_case_tells_the_generator_mistakes_apart(seed):
    tok = get_tokenizer()
    yes, no = tok.encode(" yes") + tok.encode(" no")
    model = C.ScriptedModel(4, [{yes: 30.0, no: 30.0}] * 8)
    settings = S.SamplingParams(temperature=1.0, top_k=2)
    right = C.stream_tokens(model, [0, 1, 2, 3], settings, 8, seed + 5)
    assert {yes, no} <= set(right)
    assert right != C.stream_tokens(model, [0, 1, 2, 3], settings, 8, seed + 5, one_generator=False)
    assert right != C.stream_tokens(model, [0, 1, 2, 3], settings, 8, 0)
