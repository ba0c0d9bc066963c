"""Chapter 12's dashboard: watch your engine generate, step by step.

One generation, seen three ways, all made of the same events:

- `events(engine, prompt, ...)` yields what happens as it happens: `Started`, `Tokenized`, `Prefill`, a `Step`
  for every new token (with a draft, a `DraftRound` before the tokens of each speculative round) and `Finished`;
- `trace(engine, prompt, ...)` collects them into a `Trace`;
- `replay(trace)` draws a trace as a Plotly figure with a slider over its steps (the book's static page: no kernel);
- `dashboard(engine)` is the live view in JupyterLab: type a prompt, press Enter, and watch each step arrive.

How it is measured, from outside the engine. Generation runs through the engine's own drivers (`decode_steps`,
or `speculative_steps` with a draft, called as `stream` calls them) with the engine's functions, so the tokens
are exactly `generate`'s for the same settings, and the learner's code is what runs. A forward hook on the model
times every forward pass and keeps the logits it returns, by position (a speculative round that is rolled back
recomputes the same positions: the latest logits win). A step's time is the wall-clock time the driver took to
hand out its token (its forward pass and the choice of the token); the first forward pass, over the prompt, is
the prefill's and is counted there, not in the first step. With a draft, a round's time falls on the first
token of the round: the others came with it.

    >>> t = trace(my_engine(), "ROMEO:", max_new_tokens=8)          # doctest: +SKIP
    >>> [(s.label, round(s.prob, 2), s.kv_positions) for s in t.steps][:2]   # doctest: +SKIP
    [('\\n', 0.93, 3), ('I', 0.21, 4)]
    >>> show(replay(t), "capstone-replay")                           # doctest: +SKIP
    >>> dashboard(my_engine())                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import time
from typing import Iterator, Optional, Union

import ipywidgets as widgets
import numpy as np
import torch
from torch import nn

from llmcourse.engine.generate import (
    NUM_DRAFT_TOKENS,
    as_model,
    check_request,
    checked_draft,
    decode_steps,
    functions_of,
    new_generator,
)
from llmcourse.engine.sampling import SamplingParams, eos_ids
from llmcourse.engine.speculative import PROMPT_LOOKUP, SpeculationStats, speculative_steps
from llmcourse.engine.tokenizer import stream_decoder

from .figures import round_significant
from .progress import describe_error

FUNCTION_KEYWORDS = ("sampler", "kv_cache", "left_pad", "speculation")  # what `generate` takes besides settings
DIGITS = 3  # significant digits of the numbers a replay stores: plenty for a bar or a hover label

# ----------------------------------------------------------------------------------------------
# Events


@dataclasses.dataclass
class Started:
    """Generation begins: the prompt, the model's family, the settings, and the KV cache's room."""

    prompt: str
    model: str
    settings: dict
    kv_capacity: int  # positions the cache is allocated for: the prompt's and max_new_tokens
    kv_bytes_per_position: int  # 2 (K and V) · n_layer · n_kv_head · head_dim · bytes per element


@dataclasses.dataclass
class Tokenized:
    """The prompt's token ids, each token's own text (its bytes as UTF-8, '\\ufffd' where a token holds part of
    a character), and the milliseconds the tokenizer's `encode` took."""

    ids: list[int]
    pieces: list[str]
    ms: float


@dataclasses.dataclass
class Prefill:
    """The forward pass over the prompt that fills the KV cache: positions it ran over, and its time. With a
    draft, the prompt's last token is left for the first round (0 positions when the prompt is one token)."""

    positions: int
    ms: float


@dataclasses.dataclass
class Step:
    """One new token. `prob` and `top` (the `top` likeliest tokens, as (id, text, probability)) are the model's
    softmax over its logits at the position before the token: the raw distribution, before temperature, top-k,
    top-p or a repetition penalty change it. `kv_positions`: positions the KV cache holds when the token is handed
    out, `kv_bytes` their size. `kind`: 'decode' (plain decoding), 'proposal' (a draft's proposal the target kept)
    or 'target' (the token a speculative round's target added: a correction, or a bonus when all were kept)."""

    index: int
    token: int
    label: str  # the token's own text
    text: str  # what the stream decoder gave on this token: '' mid-character and for EOS
    prob: float
    top: list[tuple[int, str, float]]
    ms: float
    kv_positions: int
    kv_bytes: int
    kind: str = "decode"
    round: Optional[int] = None  # the speculative round it came from


@dataclasses.dataclass
class DraftRound:
    """One speculative round: the draft's proposals (None where a learner's own round does not say which), how
    many the target kept, the token it added, the round's time and the draft's share of it."""

    index: int
    drafted: list[Optional[int]]
    labels: list[str]
    accepted: int
    token: int
    label: str
    ms: float
    draft_ms: float  # the draft model's forward passes (0 for prompt lookup)


@dataclasses.dataclass
class Finished:
    """The end: the continuation as `generate_text` gives it, why it stopped, and the time from tokenization on."""

    text: str
    new_tokens: int
    stopped: str  # 'eos' or 'max_new_tokens'
    ms: float


Event = Union[Started, Tokenized, Prefill, Step, DraftRound, Finished]


@dataclasses.dataclass
class Trace:
    """Every event of one generation (`trace` makes one; `add` builds one as events arrive).

    >>> t = Trace(Started("Hi", "GPT2", {}, kv_capacity=4, kv_bytes_per_position=8))
    >>> t.add(Step(0, 11, "!", "!", 0.5, [(11, "!", 0.5)], 1.0, kv_positions=2, kv_bytes=16))
    >>> t.tokens, t.text
    ([11], '!')
    """

    started: Started
    tokenized: Optional[Tokenized] = None
    prefill: Optional[Prefill] = None
    steps: list[Step] = dataclasses.field(default_factory=list)
    rounds: list[DraftRound] = dataclasses.field(default_factory=list)
    finished: Optional[Finished] = None

    def add(self, event: Event) -> None:
        if isinstance(event, Step):
            self.steps.append(event)
        elif isinstance(event, DraftRound):
            self.rounds.append(event)
        else:
            name = {Tokenized: "tokenized", Prefill: "prefill", Finished: "finished", Started: "started"}
            setattr(self, name[type(event)], event)

    @property
    def tokens(self) -> list[int]:
        """The new token ids: `generate`'s for the same settings."""
        return [s.token for s in self.steps]

    @property
    def text(self) -> str:
        """The continuation (so far, until `Finished`)."""
        return self.finished.text if self.finished else "".join(s.text for s in self.steps)


# ----------------------------------------------------------------------------------------------
# Instrumenting generation from outside: forward hooks


@dataclasses.dataclass
class Call:
    start: int  # the cache position of the call's first token
    positions: int  # tokens fed
    ms: float


class Recorder:
    """Forward hooks on a model, recording only while `armed`: each forward pass's time and start position, the
    last cache it was given, and (with `keep_logits`) the logits of row 0 by the position they were computed at."""

    def __init__(self, model: Optional[nn.Module], keep_logits: bool = True):
        self.model, self.keep_logits, self.on = model, keep_logits, False
        self.calls: list[Call] = []
        self.rows: dict[int, torch.Tensor] = {}  # position -> logits [V] after the token there
        self.cache, self.handles = None, []
        self.sync = model is not None and next(model.parameters()).is_cuda

    def __enter__(self) -> "Recorder":
        if self.model is not None:
            self.handles = [
                self.model.register_forward_pre_hook(self.before, with_kwargs=True),
                self.model.register_forward_hook(self.after, with_kwargs=True),
            ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    @contextlib.contextmanager
    def armed(self):
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def now(self) -> float:
        if self.sync:  # a GPU runs ahead of Python: wait for it, or the time is only the launches'
            torch.cuda.synchronize()
        return time.perf_counter()

    def before(self, module, args, kwargs) -> None:
        if self.on:
            self.cache = kwargs.get("cache")
            self.start = self.cache.length if self.cache is not None else 0
            self.began = self.now()

    def after(self, module, args, kwargs, output) -> None:
        if not self.on:
            return
        ms = (self.now() - self.began) * 1000
        fed = (args[0] if args else kwargs["input_ids"]).shape[1]
        self.calls.append(Call(self.start, fed, ms))
        if self.keep_logits:
            out = output[0]  # [T_out, V], T_out = fed, or 1 with last_only: the last positions
            first = self.start + fed - out.shape[0]
            for j in range(out.shape[0]):
                self.rows[first + j] = out[j]

    def ms_since(self, n_calls: int) -> float:
        return sum(c.ms for c in self.calls[n_calls:])


def unpack(engine) -> tuple[nn.Module, object, dict]:
    """(model, tokenizer, the functions generation runs with) of an `Engine` or a (model, tokenizer) pair."""
    if hasattr(engine, "model") and hasattr(engine, "tokenizer"):
        tokenizer = engine.tokenizer
        model, functions = as_model(engine)
    else:
        try:
            model, tokenizer = engine
        except (TypeError, ValueError):
            raise TypeError(
                f"expected an engine (my_engine()) or a (model, tokenizer) pair, got {type(engine).__name__}"
            ) from None
        model, functions = as_model(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the dashboard times a torch model's forward passes; got {type(model).__name__}")
    return model, tokenizer, functions


def token_label(tokenizer, token: int) -> str:
    """One token's own text: its bytes as UTF-8 ('\\ufffd' for part of a character), else `decode([token])`."""
    for method in ("decode_single_token_bytes", "token_bytes"):
        if hasattr(tokenizer, method):
            return getattr(tokenizer, method)(token).decode("utf-8", errors="replace")
    return tokenizer.decode([token])


def kv_bytes_per_position(model) -> int:
    """2 (keys and values) · n_layer · n_kv_head · head_dim · bytes per element (GPT-2's config derives n_kv_head
    = n_head and head_dim = n_embd / n_head)."""
    cfg = model.config
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * element


def events(
    engine,
    prompt: str,
    *,
    max_new_tokens: int = 24,
    temperature: float = 0.0,
    seed: int = 0,
    draft=None,
    top: int = 5,
    num_draft_tokens: Union[int, str] = NUM_DRAFT_TOKENS,
    **settings,
) -> Iterator[Event]:
    """Generate from `prompt` with `engine` (`my_engine()`'s, or a (model, tokenizer) pair), yielding each event
    as it happens: `Started`, `Tokenized`, `Prefill`, then per new token a `Step` (with a `draft` — a model,
    a bundled name, or 'prompt-lookup' — a `DraftRound` before each round's tokens), and `Finished`.

    `settings`: the rest of `generate`'s (top_k, top_p, repetition_penalty, eos_token_id, ...) and its functions
    (sampler, kv_cache, left_pad, speculation: the engine's by default). The tokens are `generate`'s for the same
    settings. The model is hooked only while the generator runs a step, so running it between events is fine.

        >>> for event in events(my_engine(), "ROMEO:", max_new_tokens=4): print(type(event).__name__)  # doctest: +SKIP
    """
    model, tokenizer, engines = unpack(engine)
    fns = functions_of(engines, **{name: settings.pop(name, None) for name in FUNCTION_KEYWORDS})
    params = SamplingParams.of(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **settings)
    params = params.for_model(model)
    if params.num_beams > 1 or params.stop:
        raise ValueError("the dashboard follows greedy decoding and sampling token by token: no num_beams, no stop")
    begun = time.perf_counter()
    ids = tokenizer.encode(prompt, allowed_special="all") if isinstance(prompt, str) else list(prompt)
    tokenize_ms = (time.perf_counter() - begun) * 1000
    check_request(model, [ids], params.max_new_tokens, params.eos_token_id)
    if draft is not None:
        draft = checked_draft(model, draft, [ids], num_draft_tokens, params, compile=False)
    per_position = kv_bytes_per_position(model)
    shown = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "seed": params.seed}
    shown["draft"] = None if draft is None else draft if draft == PROMPT_LOOKUP else type(draft).__name__
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    yield Started(text, type(model).__name__, shown, len(ids) + params.max_new_tokens, per_position)
    yield Tokenized(ids, [token_label(tokenizer, t) for t in ids], tokenize_ms)

    generator = new_generator(model, params.seed)  # as `generate` makes it
    stats = SpeculationStats()
    if draft is None:
        tokens = decode_steps(
            model,
            [ids],
            params,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=params.eos_token_id,
            generator=generator,
            sampler=fns.get("sampler"),
            kv_cache=fns.get("kv_cache"),
            left_pad=fns.get("left_pad"),
        )
    else:
        tokens = speculative_steps(
            model,
            draft,
            ids,
            params,
            num_draft_tokens=num_draft_tokens,
            generator=generator,
            stats=stats,
            speculation=fns.get("speculation"),
            sampler=fns.get("sampler"),
            kv_cache=fns.get("kv_cache"),
        )
    has_prefill = draft is None or len(ids) > 1  # speculative decoding prefills all but the last token
    decoder, stops, pieces, stopped = stream_decoder(tokenizer), eos_ids(params.eos_token_id), [], "max_new_tokens"
    drafter = draft if isinstance(draft, nn.Module) else None
    with Recorder(model) as target, Recorder(drafter, keep_logits=False) as drafts, contextlib.closing(tokens):
        rounds_seen = in_round = 0
        for index in range(params.max_new_tokens):
            draft_calls = len(drafts.calls)
            began = time.perf_counter()
            with target.armed(), drafts.armed():
                token = next(tokens, None)
                token = None if token is None else int(token)  # on a GPU, int() waits for the step
            ms = (time.perf_counter() - began) * 1000
            if token is None:
                break
            if index == 0:
                prefill_ms = target.calls[0].ms if has_prefill else 0.0
                yield Prefill(target.calls[0].positions if has_prefill else 0, prefill_ms)
                ms -= prefill_ms
            kind, round_index = "decode", None
            if draft is not None:
                if len(stats.rounds) > rounds_seen:  # this step ran a round: its tokens follow
                    done = stats.rounds[rounds_seen]
                    labels = ["?" if t is None else token_label(tokenizer, t) for t in done.drafted]
                    yield DraftRound(
                        rounds_seen,
                        list(done.drafted),
                        labels,
                        done.accepted,
                        done.token,
                        token_label(tokenizer, done.token),
                        ms,
                        drafts.ms_since(draft_calls),
                    )
                    rounds_seen, in_round = rounds_seen + 1, 0
                round_index = rounds_seen - 1
                kind = "proposal" if in_round < stats.rounds[round_index].accepted else "target"
                in_round += 1
            with torch.inference_mode():
                prob, alternatives = distribution(target.rows, len(ids) + index - 1, token, top, tokenizer)
            for position in [p for p in target.rows if p < len(ids) + index]:  # used: the text before is fixed
                del target.rows[position]
            piece = "" if token in stops else decoder.push(token)
            pieces.append(piece)
            held = getattr(target.cache, "length", 0)
            yield Step(
                index,
                token,
                token_label(tokenizer, token),
                piece,
                prob,
                alternatives,
                ms,
                held,
                held * per_position,
                kind,
                round_index,
            )
            if token in stops:
                stopped = "eos"
                break
    rest = decoder.flush()
    if pieces and rest:
        pieces[-1] += rest
    total = (time.perf_counter() - begun) * 1000
    yield Finished("".join(pieces), len(pieces), stopped, total)


def distribution(rows: dict, position: int, token: int, top: int, tokenizer) -> tuple[float, list]:
    """(the token's probability, the `top` likeliest (id, text, probability)) from the logits at `position`
    (the one before the token); (nan, []) if no forward pass computed them there."""
    if position not in rows:
        return float("nan"), []
    probs = torch.softmax(rows[position].float(), dim=-1)  # [V]
    best = torch.topk(probs, min(top, probs.shape[-1]))
    alternatives = [
        (int(t), token_label(tokenizer, int(t)), float(p)) for p, t in zip(best.values.tolist(), best.indices)
    ]
    return float(probs[token]), alternatives


def trace(engine, prompt: str, **settings) -> Trace:
    """Every event of generating from `prompt` with `engine`, collected (`settings`: those of `events`).

    Probabilities are the model's softmax over its logits at each position (before any sampling setting).

        >>> t = trace((load_model(), get_tokenizer()), "ROMEO:", max_new_tokens=8)    # doctest: +SKIP
        >>> t.tokens == generate(load_model(), t.tokenized.ids, max_new_tokens=8)     # doctest: +SKIP
        True
    """
    stream_of = events(engine, prompt, **settings)
    out = Trace(next(stream_of))
    for event in stream_of:
        out.add(event)
    return out


# ----------------------------------------------------------------------------------------------
# How tokens and steps look (shared by the replay and the dashboard)

COLORS = {
    "prompt": "#616161",
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "proposal": "#2ca02c",
    "target": "#9467bd",
    "round": "#9467bd",
    "rejected": "#d62728",
}
BAR_NAMES = {
    "prefill": "prefill",
    "decode": "decode step",
    "round": "speculative round",
    "proposal": "kept proposal (came with its round)",
    "target": "came with its round",
}
TOKEN_BACKGROUNDS = ("#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d7f2f7")


def shown(text: str) -> str:
    """A token's text made visible: a newline as ↵, a tab as →, nothing as ∅."""
    return text.replace("\n", "↵").replace("\t", "→") or "∅"


def kilobytes(n: float) -> str:
    return f"{n / 1024:.1f} KB" if n < 1024**2 else f"{n / 1024**2:.2f} MB"


def round_round(values) -> list:
    """Floats rounded to `DIGITS` significant digits (a replay's numbers)."""
    return [float(v) for v in round_significant(np.asarray(values, dtype=np.float64), DIGITS)]


def round_of(t: Trace, step: Step) -> Optional[DraftRound]:
    return t.rounds[step.round] if step.round is not None and step.round < len(t.rounds) else None


def bar_kinds(t: Trace) -> list[str]:
    """What each step's time was spent on: 'decode' (a decode step), 'round' (the step that ran a speculative
    round: its first token), or the kind of a token that came with its round, at no cost of its own."""
    kinds, previous = [], None
    for s in t.steps:
        kinds.append("decode" if s.round is None else "round" if s.round != previous else s.kind)
        previous = s.round
    return kinds


def round_sizes(t: Trace) -> dict[int, int]:
    """Tokens each round gave (the last one may be cut by EOS), by round."""
    sizes: dict[int, int] = {}
    for s in t.steps:
        if s.round is not None:
            sizes[s.round] = sizes.get(s.round, 0) + 1
    return sizes


# ----------------------------------------------------------------------------------------------
# The replay: a Plotly figure with a slider over the steps

WRAP = 36  # characters per line of text: 12-pixel monospace fits a 400-pixel phone


def wrapped(items: list[tuple[str, str]], width: int = WRAP) -> tuple[str, int]:
    """(Plotly's HTML-like text for (piece, colour) items, wrapped at `width` characters and after newlines, each
    run of one colour one span; the number of lines)."""
    lines, column, runs = 1, 0, []  # runs: [colour, text]
    for piece, color in items:
        visible = html.escape(piece.replace("\n", "↵"), quote=False).replace(" ", "\u00a0")
        if column and column + len(piece) > width:
            runs.append([None, "<br>"])
            lines, column = lines + 1, 0
        if runs and runs[-1][0] == color:
            runs[-1][1] += visible
        else:
            runs.append([color, visible])
        column += len(piece)
        if piece.endswith("\n"):
            runs.append([None, "<br>"])
            lines, column = lines + 1, 0
    text = "".join(s if c is None else f"<span style='color:{c}'>{s}</span>" for c, s in runs)
    return text, lines


def text_items(t: Trace, upto: int) -> list[tuple[str, str]]:
    """(piece, colour) for the prompt's tokens and the new tokens up to step `upto` (the last one bold)."""
    items = [(piece, COLORS["prompt"]) for piece in (t.tokenized.pieces if t.tokenized else [])]
    for step in t.steps[: upto + 1]:
        items.append((step.label, COLORS[step.kind]))
    return items


def replay(t: Trace, *, width: int = WRAP):
    """The static page's replay of a trace: a Plotly figure with a slider (and a play button) over its steps; at
    each step the text so far (prompt grey, new tokens coloured by where they came from), the chosen token's
    probability among the likeliest alternatives, the KV cache filling, and a bar per step of its time (the prefill
    orange; with a draft, each round's bar purple, marked +n for the n tokens it gave, the tokens that came with
    it costing none; kept proposals green in the text). Numbers are rounded to 3 significant digits: 24 steps
    make about 50 KB. It opens at the last step.

        >>> show(replay(trace(my_engine(), "ROMEO:")), "capstone-replay")   # doctest: +SKIP
    """
    import plotly.graph_objects as go  # the course extra, as in figures.py: imported when a figure is made
    from plotly.subplots import make_subplots  # the same extra

    if not t.steps:
        raise ValueError("this trace has no steps to replay (max_new_tokens=0, or generation stopped at once)")
    steps, n, top = t.steps, len(t.steps), max((len(s.top) for s in t.steps), default=1) or 1
    lines = wrapped(text_items(t, n - 1), width)[1] + (1 if t.rounds else 0)
    heights = [26 + 17 * lines, 26 * (top + 1), 40, 170]  # pixels of each row
    height = sum(heights) + 120 + 160  # the titles, the slider and the buttons
    fig = make_subplots(
        rows=4,
        cols=1,
        row_heights=[h / sum(heights) for h in heights],
        vertical_spacing=0.09,
        subplot_titles=[
            "Text: <span style='color:#616161'>prompt</span> and new tokens",
            "The model's probabilities for the token chosen",
            "KV cache",
            time_title(t),
        ],
    )
    # 1: the text so far, as one text point at the top left
    fig.add_scatter(x=[0], y=[1], mode="text", textposition="bottom right", hoverinfo="skip", row=1, col=1)
    fig.update_xaxes(range=[0, 1], visible=False, fixedrange=True, row=1, col=1)
    fig.update_yaxes(range=[0, 1], visible=False, fixedrange=True, row=1, col=1)
    fig.data[0].textfont = dict(family="monospace", size=12)
    # 2: alternatives as bars (rank on y, the likeliest on top), their labels drawn over the bars' start
    fig.add_bar(orientation="h", marker_color="#c6dbef", hoverinfo="text", row=2, col=1)
    fig.add_scatter(mode="text", textposition="middle right", hoverinfo="skip", row=2, col=1)
    fig.update_xaxes(range=[0, 1], tickformat=".0%", fixedrange=True, row=2, col=1)
    fig.update_yaxes(range=[0.4, top + 1.6], visible=False, fixedrange=True, row=2, col=1)
    fig.data[2].textfont = dict(family="monospace", size=12)
    # 3: the cache: its room in grey, what it holds in colour
    room = t.started.kv_capacity
    per = t.started.kv_bytes_per_position
    fig.add_bar(
        x=[room],
        y=[0],
        orientation="h",
        marker_color="#eeeeee",
        hovertext=[f"allocated: {room} positions, {kilobytes(room * per)}"],
        hoverinfo="text",
        row=3,
        col=1,
    )
    fig.add_bar(
        orientation="h",
        y=[0],
        marker_color=COLORS["decode"],
        hoverinfo="text",
        textposition="inside",
        insidetextanchor="end",
        textfont=dict(size=11, color="white"),
        constraintext="none",
        row=3,
        col=1,
    )
    fig.update_xaxes(range=[0, room], title_text="positions", title_standoff=2, fixedrange=True, row=3, col=1)
    fig.update_yaxes(visible=False, fixedrange=True, row=3, col=1)
    # 4: a bar per step of its time, the prefill first; future steps faint
    prefill_ms = t.prefill.ms if t.prefill else 0.0
    times = round_round([prefill_ms] + [s.ms for s in steps])
    kinds, sizes = bar_kinds(t), round_sizes(t)
    colors = [COLORS["prefill"]] + [COLORS[k] for k in kinds]
    hovers = [f"prefill: {t.prefill.positions if t.prefill else 0} positions in {times[0]:.3g} ms"]
    for s, k, ms in zip(steps, kinds, times[1:]):
        hovers.append(
            f"step {s.index}: {html.escape(repr(s.label))}, {ms:.3g} ms ({BAR_NAMES[k]})<br>{step_note(t, s)}"
        )
    marks = [""] + [f"+{sizes[s.round]}" if k == "round" and sizes[s.round] > 1 else "" for s, k in zip(steps, kinds)]
    fig.add_bar(
        x=list(range(-1, n)),
        y=times,
        marker=dict(color=colors, opacity=[1.0] + [0.15] * n),
        text=marks,  # a round that gave several tokens says how many
        textposition="outside",
        textfont_size=9,
        cliponaxis=False,
        hovertext=hovers,
        hoverinfo="text",
        row=4,
        col=1,
    )
    fig.update_xaxes(
        tickvals=[-1] + list(range(0, n, max(1, n // 8))),
        ticktext=["P"] + [str(i) for i in range(0, n, max(1, n // 8))],
        title_text="step (P: prefill)",
        title_standoff=2,
        fixedrange=True,
        row=4,
        col=1,
    )
    fig.update_yaxes(title_text="ms", range=[0, max(times) * 1.1 or 1], fixedrange=True, row=4, col=1)

    frames = [go.Frame(name=str(i), data=frame_data(t, i, width, top), traces=[0, 1, 2, 4, 5]) for i in range(n)]
    fig.frames = frames
    for index, value in zip((0, 1, 2, 4, 5), frames[-1].data):  # shown before the slider moves: the last step
        fig.data[index].update(value.to_plotly_json())
    play = dict(frame=dict(duration=350, redraw=True), transition=dict(duration=0), fromcurrent=True, mode="immediate")
    still = dict(frame=dict(duration=0, redraw=True), transition=dict(duration=0), mode="immediate")
    fig.update_layout(
        height=height,
        showlegend=False,
        barmode="overlay",  # the KV cache's fill over its allocated room
        margin=dict(l=40, r=15, t=40, b=70),
        hoverlabel=dict(font_family="monospace"),
        sliders=[
            dict(
                active=n - 1,
                currentvalue=dict(prefix="step ", font_size=13),
                pad=dict(t=40, b=0),
                len=1.0,
                x=0,
                font_size=10,
                steps=[dict(label=str(i), method="animate", args=[[str(i)], still]) for i in range(n)],
            )
        ],
        updatemenus=[
            dict(
                type="buttons",
                direction="left",
                x=0,
                xanchor="left",
                y=0,
                yanchor="top",
                pad=dict(t=125),
                showactive=False,
                buttons=[
                    dict(label="▶ play", method="animate", args=[None, {**play, "fromcurrent": False}]),
                    dict(label="❚❚ pause", method="animate", args=[[None], still]),
                ],
            )
        ],
    )
    for annotation in fig.layout.annotations:  # the subplot titles: left-aligned, readable at 500 pixels
        annotation.update(x=0, xanchor="left", font_size=13)
    return fig


def time_title(t: Trace) -> str:
    """The time chart's title, naming its colours (a legend would crowd a phone's screen)."""
    kinds = ["prefill"] + sorted(set(bar_kinds(t)) & {"decode", "round"}, key=list(COLORS).index)
    legend = " · ".join(f"<span style='color:{COLORS[k]}'>{BAR_NAMES[k]}</span>" for k in kinds)
    return f"Time per step: {legend}" + (" (+n tokens)" if t.rounds else "")


def step_note(t: Trace, s: Step) -> str:
    """What a step's hover says besides its time: the probability, and its round."""
    note = f"p = {s.prob:.3g}, KV cache {s.kv_positions} positions"
    r = round_of(t, s)
    if r is not None:
        proposed = " ".join(html.escape(repr(x)) for x in r.labels) or "nothing"
        note += f"<br>round {r.index}: proposed {proposed}, kept {r.accepted}"
    return note


def frame_data(t: Trace, i: int, width: int, top: int) -> list[dict]:
    """What changes at step i: the text, the alternatives (bars and labels), the cache's fill, the time bars'
    opacity."""
    s = t.steps[i]
    text, _ = wrapped(text_items(t, i), width)
    r = round_of(t, s)
    if r is not None:  # the round this step's token came from, under the text
        kept = "".join(html.escape(shown(x)) for x in r.labels[: r.accepted])
        lost = "".join(html.escape(shown(x)) for x in r.labels[r.accepted :])
        text += (
            f"<br><span style='color:#616161'>round {r.index}: </span><span style='color:{COLORS['proposal']}'>"
            f"{kept}</span><s style='color:{COLORS['rejected']}'>{lost}</s>"
            f"<span style='color:{COLORS['target']}'> +{html.escape(shown(r.label))}</span>"
        )
    shown_top = list(s.top)
    if s.token not in [a[0] for a in shown_top]:  # sampled outside the top: shown below them
        shown_top.append((s.token, s.label, s.prob))
    probs = round_round([p for _, _, p in shown_top])
    ranks = [top + 1 - j for j in range(len(shown_top))]
    marks = ["▶" if tok == s.token else "\u00a0" for tok, _, _ in shown_top]  # the chosen one
    labels = [f"{m} {html.escape(repr(label))} {p:.3g}" for m, (_, label, _), p in zip(marks, shown_top, probs)]
    bar_colors = [COLORS[s.kind] if tok == s.token else "#c6dbef" for tok, _, _ in shown_top]
    kv_hover = f"{s.kv_positions} of {t.started.kv_capacity} positions: {kilobytes(s.kv_bytes)}"
    return [
        dict(type="scatter", text=[text]),
        dict(type="bar", x=probs, y=ranks, marker=dict(color=bar_colors), hovertext=labels),
        dict(type="scatter", x=[0.01] * len(ranks), y=ranks, text=labels),
        dict(type="bar", x=[s.kv_positions], hovertext=[kv_hover], text=[f"{s.kv_positions}: {kilobytes(s.kv_bytes)}"]),
        dict(type="bar", marker=dict(opacity=[1] + [1 if j <= i else 0.15 for j in range(len(t.steps))])),
    ]


# ----------------------------------------------------------------------------------------------
# The live dashboard (ipywidgets)


def span(text: str, color: str, *, title: str = "", background: str = "", strike: bool = False, bold=False) -> str:
    style = f"color:{color};" + (f"background:{background};" if background else "")
    style += "display:inline-block;border-radius:3px;padding:0 1px;margin:1px;white-space:pre;"  # wraps between
    inner = html.escape(shown(text))
    inner = f"<s>{inner}</s>" if strike else inner
    inner = f"<b>{inner}</b>" if bold else inner
    return f"<span style='{style}' title='{html.escape(title)}'>{inner}</span>"


def tokens_html(t: Trace) -> str:
    """The prompt's tokens as coloured spans (hover: the id), and the tokenizer's time."""
    if t.tokenized is None:
        return ""
    spans = "".join(
        span(piece, "#222", background=TOKEN_BACKGROUNDS[j % len(TOKEN_BACKGROUNDS)], title=f"token id {tok}")
        for j, (tok, piece) in enumerate(zip(t.tokenized.ids, t.tokenized.pieces))
    )
    n = len(t.tokenized.ids)
    return f"<b>Tokenization</b>: {n} token{'s' * (n != 1)} in {t.tokenized.ms:.2f} ms<div>{spans}</div>"


def text_html(t: Trace) -> str:
    """The text so far: the prompt grey, each new token coloured by where it came from (hover: its step)."""
    pieces = [span(piece, COLORS["prompt"]) for piece in (t.tokenized.pieces if t.tokenized else [])]
    for s in t.steps:
        note = f"step {s.index}: p = {s.prob:.3f}, {s.ms:.2f} ms"
        pieces.append(span(s.label, COLORS[s.kind], title=note, bold=s is t.steps[-1]))
        if s.label.endswith("\n"):  # the text's own line breaks, as well as the ↵ that shows them
            pieces.append("<br>")
    return f"<div style='line-height:1.6;font-family:monospace'>{''.join(pieces)}</div>"


def times_html(t: Trace) -> str:
    """A bar per step of its time (the prefill first), scaled to the longest; hover: the step."""
    if t.prefill is None:
        return ""
    bars = [(t.prefill.ms, COLORS["prefill"], f"prefill: {t.prefill.positions} positions, {t.prefill.ms:.2f} ms")]
    bars += [
        (s.ms, COLORS[k], f"step {s.index} {s.label!r}: {s.ms:.2f} ms ({BAR_NAMES[k]})")
        for s, k in zip(t.steps, bar_kinds(t))
    ]
    longest = max(ms for ms, _, _ in bars) or 1.0
    divs = "".join(
        f"<div title='{html.escape(title)}' style='width:7px;margin-right:1px;background:{color};"
        f"height:{max(2, round(56 * ms / longest))}px'></div>"
        for ms, color, title in bars
    )
    decode = [s.ms for s in t.steps]
    mean = f", {sum(decode) / len(decode):.2f} ms per step on average" if decode else ""
    head = f"<b>Time</b>: prefill {t.prefill.ms:.2f} ms over {t.prefill.positions} positions{mean}"
    return f"{head}<div style='display:flex;align-items:flex-end;height:60px;overflow-x:auto'>{divs}</div>"


def kv_html(t: Trace) -> str:
    """The KV cache's fill bar: positions held of those allocated, and their bytes."""
    if not t.steps:
        return ""
    s, room = t.steps[-1], t.started.kv_capacity
    pct = 100 * s.kv_positions / max(room, 1)
    return (
        f"<b>KV cache</b>: {s.kv_positions} of {room} positions, {kilobytes(s.kv_bytes)} of "
        f"{kilobytes(room * t.started.kv_bytes_per_position)}"
        f"<div style='border:1px solid #999;height:14px;max-width:600px'>"
        f"<div style='width:{pct:.1f}%;height:100%;background:{COLORS['decode']}'></div></div>"
    )


def probs_html(t: Trace) -> str:
    """The latest token's probability among the likeliest alternatives, as bars."""
    if not t.steps:
        return ""
    s = t.steps[-1]
    rows = list(s.top) + ([] if s.token in [a[0] for a in s.top] else [(s.token, s.label, s.prob)])
    out = [f"<b>Step {s.index}</b>: {html.escape(repr(s.label))} with p = {s.prob:.3f} (the model's softmax)"]
    for tok, label, p in rows:
        chosen = tok == s.token
        color = COLORS[s.kind] if chosen else "#9ecae1"
        out.append(
            f"<div style='display:flex;align-items:center;font-family:monospace;{'font-weight:bold;' * chosen}'>"
            f"<span style='width:9em;white-space:pre;overflow:hidden'>{html.escape(repr(label))}</span>"
            f"<span style='display:inline-block;height:10px;width:{max(1, round(200 * p))}px;background:{color}'>"
            f"</span>&nbsp;{p:.3f}</div>"
        )
    return "".join(out)


def rounds_html(t: Trace) -> str:
    """Each speculative round: kept proposals green, the rejected one (and those after it) red and struck
    through, then the token the target added."""
    if not t.rounds:
        return ""
    lines, last = [], ROUNDS_SHOWN
    if len(t.rounds) > last:
        lines.append(f"<div>… {len(t.rounds) - last} earlier rounds</div>")
    for r in t.rounds[-last:]:
        kept = "".join(span(x, COLORS["proposal"], title="kept") for x in r.labels[: r.accepted])
        lost = "".join(span(x, COLORS["rejected"], strike=True, title="rejected") for x in r.labels[r.accepted :])
        added = span(r.label, COLORS["target"], title="the target's token", bold=True)
        lines.append(f"<div>round {r.index} ({r.ms:.2f} ms): {kept}{lost} + {added}</div>")
    accepted, drafted = sum(r.accepted for r in t.rounds), sum(len(r.drafted) for r in t.rounds)
    return f"<b>Drafts</b>: {accepted} of {drafted} proposals kept" + "".join(lines)


ROUNDS_SHOWN = 12  # the dashboard lists the latest rounds only
# Each setting's label as wide as its text: ipywidgets gives every label the same fixed width (80 px in JupyterLab),
# which cuts "temperature" to "temperat…"; the widths of the settings leave room for the label and the control.
LABEL_STYLE = {"description_width": "initial"}


class Dashboard(widgets.VBox):
    """The live dashboard (`dashboard()` makes one): a prompt box, settings, and outputs filled as events arrive.
    `run(prompt)` generates; `trace` is the last run's; `status` shows an error from the learner's code."""

    def __init__(self, engine, *, prompt: str = "ROMEO:", max_new_tokens: int = 24):
        self.engine, self.trace = engine, None
        room = unpack(engine)[0].config.n_positions
        self.prompt = widgets.Text(
            value=prompt,
            continuous_update=False,  # only Enter (or leaving the box) sends the value: one run per prompt
            placeholder="a prompt, then Enter",
            layout=widgets.Layout(width="100%"),
        )
        self.max_new_tokens = widgets.BoundedIntText(
            value=max_new_tokens,
            min=1,
            max=room,
            description="new tokens",
            style=LABEL_STYLE,
            layout=widgets.Layout(width="180px"),
        )
        self.temperature = widgets.FloatSlider(
            value=0.0,
            min=0.0,
            max=2.0,
            step=0.05,
            description="temperature",
            style=LABEL_STYLE,
            layout=widgets.Layout(width="300px"),
        )
        self.draft = widgets.Dropdown(
            options=[("none", None), ("prompt lookup", PROMPT_LOOKUP)],
            description="draft",
            style=LABEL_STYLE,
            layout=widgets.Layout(width="200px"),
        )
        self.button = widgets.Button(description="Generate", button_style="primary")
        self.status, self.tokens, self.text = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.probs, self.kv, self.times, self.rounds = widgets.HTML(), widgets.HTML(), widgets.HTML(), widgets.HTML()
        settings = widgets.HBox(
            [self.max_new_tokens, self.temperature, self.draft, self.button],
            layout=widgets.Layout(flex_flow="row wrap"),
        )
        outputs = [self.status, self.tokens, self.text, self.probs, self.kv, self.times, self.rounds]
        super().__init__([self.prompt, settings, *outputs], layout=widgets.Layout(max_width="1100px"))
        self.prompt.observe(lambda change: self.run(change["new"]), names="value")
        self.button.on_click(lambda _: self.run(self.prompt.value))

    def run(self, prompt: Optional[str] = None) -> Optional[Trace]:
        """Generate from `prompt` (the box's by default), updating the outputs at every event. An error (the
        learner's code raising, a prompt too long) is shown in `status`; the outputs so far stay."""
        prompt = self.prompt.value if prompt is None else prompt
        for out in (self.status, self.tokens, self.text, self.probs, self.kv, self.times, self.rounds):
            out.value = ""
        self.status.value = "<i>generating…</i>"
        self.trace = None
        try:
            stream_of = events(
                self.engine,
                prompt,
                max_new_tokens=self.max_new_tokens.value,
                temperature=self.temperature.value,
                draft=self.draft.value,
            )
            for event in stream_of:
                self.show(event)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # the learner's code (or a bad prompt): say what, keep the widget alive
            self.status.value = (
                f"<div style='color:{COLORS['rejected']};white-space:pre-wrap'><b>Generation stopped</b>: "
                f"{html.escape(describe_error(err))}</div>"
            )
        return self.trace

    def show(self, event: Event) -> None:
        """Add one event to the trace and redraw the outputs it changes."""
        if isinstance(event, Started):
            self.trace = Trace(event)
            return
        self.trace.add(event)
        t = self.trace
        if isinstance(event, Tokenized):
            self.tokens.value, self.text.value = tokens_html(t), text_html(t)
        elif isinstance(event, Prefill):
            self.times.value = times_html(t)
        elif isinstance(event, DraftRound):
            self.rounds.value = rounds_html(t)
        elif isinstance(event, Step):
            self.text.value, self.probs.value = text_html(t), probs_html(t)
            self.kv.value, self.times.value = kv_html(t), times_html(t)
        elif isinstance(event, Finished):
            self.status.value = (
                f"{event.new_tokens} new tokens in {event.ms:.1f} ms (stopped at {event.stopped.replace('_', ' ')})"
            )


def dashboard(engine, *, prompt: str = "ROMEO:", max_new_tokens: int = 24) -> Dashboard:
    """A live dashboard on `engine` (`my_engine()`'s, or a (model, tokenizer) pair): type a prompt and press Enter
    (or Generate); the tokenization, each step's time, the KV cache's fill, the latest token's probability and
    its alternatives, and the drafts kept (green) and rejected (red) appear as generation runs. It runs once
    with `prompt` when made.

        >>> dashboard(my_engine())      # doctest: +SKIP
    """
    board = Dashboard(engine, prompt=prompt, max_new_tokens=max_new_tokens)
    board.run(prompt)
    return board
