"""Chapter 12's dashboard: its traces follow the engine's own generation exactly, its probabilities are the
model's, its replay figure is one frame per step and small, and the live widget fills in and survives errors."""

from __future__ import annotations

import html
import json

import pytest
import torch

import llmcourse
from llmcourse.course import dashboard as dash
from llmcourse.course.figures import bundle
from llmcourse.course.guards import guarded
from llmcourse.course.learner import Engine
from llmcourse.engine.generate import generate
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def gpt2():
    return llmcourse.load_model("gpt2-shakespeare", device="cpu"), llmcourse.get_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return llmcourse.load_model("llama-shakespeare", device="cpu"), load_tokenizer("llama-shakespeare")


@pytest.fixture(scope="module")
def greedy_trace(gpt2):
    return dash.trace(gpt2, PROMPT, max_new_tokens=24)


def model_probs(model, ids: list[int]) -> torch.Tensor:
    """The model's softmax at every position of `ids`, run on the whole sequence at once: [T, V]."""
    with torch.inference_mode():
        return torch.softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def test_greedy_tokens_probabilities_and_cache_follow_the_model(gpt2, greedy_trace):
    model, tokenizer = gpt2
    t = greedy_trace
    prompt = tokenizer.encode(PROMPT)
    assert t.tokenized.ids == prompt and "".join(t.tokenized.pieces) == PROMPT
    assert t.tokens == generate(model, prompt, max_new_tokens=24)
    assert t.prefill.positions == len(prompt) and t.prefill.ms > 0
    probs = model_probs(model, prompt + t.tokens)  # [T, V]
    per_position = 2 * model.config.n_layer * model.config.n_head * (model.config.n_embd // model.config.n_head) * 4
    for s in t.steps:
        row = probs[len(prompt) + s.index - 1]  # the position before the token
        assert s.prob == pytest.approx(float(row[s.token]), abs=1e-4)
        best = torch.topk(row, 5)
        assert [a[0] for a in s.top] == best.indices.tolist()
        assert [a[2] for a in s.top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert s.top[0][0] == s.token  # greedy: the chosen token is the likeliest
        assert s.kv_positions == len(prompt) + s.index  # grows by one per token added
        assert s.kv_bytes == s.kv_positions * per_position
        assert s.kind == "decode" and s.ms >= 0
    assert t.text == tokenizer.decode(t.tokens) and t.finished.new_tokens == 24


def test_llama_and_seeded_sampling_give_generates_tokens(gpt2, llama):
    model, tokenizer = llama
    t = dash.trace(llama, PROMPT, max_new_tokens=12)
    assert t.tokens == generate(model, tokenizer.encode(PROMPT), max_new_tokens=12)
    cfg = model.config
    assert t.started.kv_bytes_per_position == 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4
    settings = dict(max_new_tokens=16, temperature=0.9, seed=3, top_k=50)
    t = dash.trace(gpt2, PROMPT, **settings)
    assert t.tokens == generate(gpt2[0], gpt2[1].encode(PROMPT), **settings)
    probs = model_probs(gpt2[0], t.tokenized.ids + t.tokens)
    for s in t.steps:  # the model's softmax, before temperature and top-k
        assert s.prob == pytest.approx(float(probs[len(t.tokenized.ids) + s.index - 1, s.token]), abs=1e-4)


def test_prompt_lookup_records_rounds_that_add_up(gpt2):
    model, tokenizer = gpt2
    prompt = tokenizer.encode(PROMPT)
    t = dash.trace(gpt2, PROMPT, max_new_tokens=32, draft="prompt-lookup")
    assert t.tokens == generate(model, prompt, max_new_tokens=32, draft="prompt-lookup")
    assert t.tokens == generate(model, prompt, max_new_tokens=32)  # greedy: speculation changes no token
    assert t.rounds and sum(r.accepted for r in t.rounds) > 0
    assert sum(r.accepted + 1 for r in t.rounds) == len(t.tokens)  # kept proposals + the target's tokens
    assert [s.round for s in t.steps] == [r.index for r in t.rounds for _ in range(r.accepted + 1)]
    for r in t.rounds:
        mine = [s for s in t.steps if s.round == r.index]
        assert [s.kind for s in mine] == ["proposal"] * r.accepted + ["target"]
        assert mine[-1].token == r.token and [s.token for s in mine[:-1]] == r.drafted[: r.accepted]
    probs = model_probs(model, prompt + t.tokens)
    for s in t.steps:  # from the verify passes' logits, rolled-back rounds overwritten
        assert s.prob == pytest.approx(float(probs[len(prompt) + s.index - 1, s.token]), abs=1e-4)
    held = [len(prompt) - 1] + [next(s.kv_positions for s in t.steps if s.round == r.index) for r in t.rounds]
    assert [b - a for a, b in zip(held, held[1:])] == [r.accepted + 1 for r in t.rounds]  # grows by what it adds
    assert t.prefill.positions == len(prompt) - 1  # the last prompt token is the first round's


def test_events_arrive_in_order(gpt2):
    kinds = [type(e).__name__ for e in dash.events(gpt2, PROMPT, max_new_tokens=3)]
    assert kinds == ["Started", "Tokenized", "Prefill", "Step", "Step", "Step", "Finished"]


def test_replay_has_a_frame_per_step_and_stays_small(greedy_trace):
    fig = dash.replay(greedy_trace)
    assert len(fig.frames) == len(greedy_trace.steps) == 24
    assert len(fig.layout.sliders[0].steps) == 24
    page = bundle(fig, "capstone-replay")
    size = len(json.dumps(page["application/vnd.plotly.v1+json"]))
    assert size < 150_000, size
    assert len(page["text/html"]) < 150_000


def test_dashboard_fills_in_on_enter(gpt2):
    board = dash.dashboard(gpt2, prompt=PROMPT, max_new_tokens=6)
    assert board.trace is not None and len(board.trace.steps) == 6
    board.prompt.value = "JULIET:"  # what pressing Enter in the box does
    expected = dash.trace(gpt2, "JULIET:", max_new_tokens=6)
    assert board.trace.tokens == expected.tokens
    for s in expected.steps:
        assert html.escape(dash.shown(s.label)) in board.text.value
    for piece in expected.tokenized.pieces:
        assert html.escape(dash.shown(piece)) in board.tokens.value
    assert "KV cache" in board.kv.value and "Step 5" in board.probs.value and "prefill" in board.times.value
    assert "6 new tokens" in board.status.value
    board.draft.value = "prompt-lookup"
    board.button.click()
    assert board.trace.tokens == expected.tokens and "proposals kept" in board.rounds.value


def test_an_error_in_the_learners_code_is_shown_not_raised(gpt2):
    def greedy(logits):
        raise ZeroDivisionError("my greedy divides by zero")

    engine = Engine(gpt2[0], gpt2[1], {"sampler": guarded(Sampler, greedy=greedy)})
    board = dash.dashboard(engine, max_new_tokens=4)
    assert "Generation stopped" in board.status.value and "divides by zero" in board.status.value
    assert "Traceback" not in board.status.value
    board.prompt.value = ""  # an empty prompt: the engine's own refusal, shown the same way
    assert "empty" in board.status.value


def labelled(widget):
    """The widgets under `widget` that show a description label beside their control (a Button's is its text)."""
    style = getattr(widget, "style", None)
    own = [widget] if getattr(widget, "description", "") and hasattr(style, "description_width") else []
    return own + [w for child in getattr(widget, "children", ()) for w in labelled(child)]


def test_every_setting_shows_its_whole_label(gpt2):
    """Each setting's label is as wide as its text ('initial'; the fixed default cut "temperature" to "temperat…"),
    and its widget leaves room for the control beside it: 8 px a character of the label, more than JupyterLab's
    13 px interface font takes, and at least 90 px for the control."""
    import ipywidgets as widgets

    settings = labelled(dash.Dashboard(gpt2))
    assert sorted(w.description for w in settings) == ["draft", "new tokens", "temperature"]
    for widget in settings:
        assert widget.style.description_width == "initial", widget.description
    for widget in settings:
        assert int(widget.layout.width.removesuffix("px")) - 8 * len(widget.description) >= 90, widget.description
    assert widgets.FloatSlider(description="temperature").style.description_width == ""  # the default's fixed width
