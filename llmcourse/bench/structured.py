"""The structured output benchmark (`python -m llmcourse bench --structured`): what a constraint costs.

- **per-step overhead**: decode steps of both bundled models at batch 1 and 16, free and constrained (every row its
  own guide, inside a JSON string that never closes: the state most of a JSON answer's tokens are spent in, and
  both runs take the same number of steps), interleaved repeats, medians: the constrained step's extra time
  (stacking each row's cached mask, the masked fill, reading the tokens back and walking the guides) as a share of
  the free step (goal: under 10 %);
- **index build**: compiling a realistic schema (`SCHEMA`: seven properties, nested object, array, enum, bounded
  strings) over GPT-2's vocabulary from nothing (regex, automaton, token index; the vocabulary's bytes made once
  per tokenizer, timed apart), beside outlines-core's index of the same schema (its own regex of it), when it is
  installed.

    >>> overhead(0.0110, 0.0100)
    0.1
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Optional

from llmcourse.engine.generate import decode_steps, new_guides
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model, resolve_device
from llmcourse.engine.quantize import resident_bytes
from llmcourse.engine.sampling import SamplingParams
from llmcourse.engine.structured.constraint import Constraint, compile_constraint
from llmcourse.engine.structured.index import vocabulary_of
from llmcourse.engine.structured.json_schema import schema_regex
from llmcourse.engine.structured.regex import compile_regex

from .common import ENGINE, ROOF, STYLE, TRANSFORMERS, describe_machine, machine, measure_and_save, save, sync

FIGURE = "bench_structured.png"
MODELS = ("gpt2-shakespeare", "llama-shakespeare")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"enum": ["king", "queen", "knave", "fool", "nurse"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 4},
        "home": {"type": "object", "properties": {"city": {"type": "string"}, "house": {"type": "string"}},
                 "required": ["city"]},
        "loyal": {"type": "boolean"},
        "wealth": {"type": "number"},
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}  # fmt: skip
# The timed constraint: an object's string that never closes: every row decodes every step, constrained all the way.
TIMED = r'\{"text": "(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*'


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 16)
    steps: int = 64
    repeats: int = 3


def overhead(constrained: float, free: float) -> float:
    """The constrained step's extra time as a share of the free step's."""
    return round(constrained / free - 1, 6)


def step_seconds(model, prompts: list[list[int]], steps: int, constraint=None) -> float:
    """Seconds per decode step after the prefill (greedy, no EOS), constrained or not."""
    params = SamplingParams(max_new_tokens=steps + 1, eos_token_id=None)
    guides = new_guides(constraint, len(prompts), params)
    loop = decode_steps(model, prompts, params, max_new_tokens=steps + 1, eos_token_id=None, generator=None,
                        guides=guides)  # fmt: skip
    next(loop)  # the prefill and the first token
    sync(model.device)
    start = time.perf_counter()
    count = sum(1 for _ in loop)
    sync(model.device)
    assert count == steps, f"{count} steps instead of {steps}: a row ended early"
    return (time.perf_counter() - start) / steps


def run(device: str = "auto", sizes: Sizes = Sizes()) -> dict:
    dev = resolve_device(device)
    rows, weights = [], 0
    for name in MODELS:
        model, tok = load_model(name, device=dev), load_tokenizer(name)
        weights = max(weights, resident_bytes(model))
        constraint = compile_constraint(tok, regex=TIMED)
        prompt = tok.encode("ROMEO:")
        for batch in sizes.batches:
            prompts = [prompt] * batch
            step_seconds(model, prompts, 4, constraint)  # warm: the masks of the states it meets, cached
            free, constrained = [], []
            for _ in range(sizes.repeats):  # interleaved: drifts of the machine fall on both
                free.append(step_seconds(model, prompts, sizes.steps))
                constrained.append(step_seconds(model, prompts, sizes.steps, constraint))
            f, c = statistics.median(free), statistics.median(constrained)
            rows.append(dict(model=name, batch=batch, free_ms=f * 1e3, constrained_ms=c * 1e3, overhead=overhead(c, f)))
    return dict(
        machine=machine(dev, weights), steps=sizes.steps, repeats=sizes.repeats, overhead=rows, build=build_times()
    )


def build_times() -> dict:
    """Seconds to compile SCHEMA over GPT-2's vocabulary: the engine (fresh: no cached automaton or index), and
    outlines-core (None when it is not installed)."""
    tok = load_tokenizer("gpt2-shakespeare")
    started = time.perf_counter()
    vocab = vocabulary_of(tok)
    vocab_s = time.perf_counter() - started
    compile_regex.cache_clear()
    started = time.perf_counter()
    compiled = Constraint(schema_regex(SCHEMA), vocab, "json_schema", SCHEMA, None)
    ours = time.perf_counter() - started
    result = dict(vocabulary_s=vocab_s, engine_s=ours, states=compiled.dfa.num_states, outlines_core_s=None)
    try:
        from outlines_core import Index, Vocabulary  # the peer: optional, measured where it is installed
        from outlines_core.json_schema import build_regex_from_schema  # (the same)
    except ImportError:
        return result
    by_bytes: dict[bytes, list[int]] = {}
    for piece, i in zip(vocab.pieces, vocab.ids):
        by_bytes.setdefault(piece, []).append(i)
    started = time.perf_counter()
    Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(max(vocab.ids) + 1, by_bytes))
    result["outlines_core_s"] = time.perf_counter() - started
    return result


def table(r: dict) -> str:
    lines = [
        f"structured output: {describe_machine(r['machine'])}; {r['steps']} decode steps, median of {r['repeats']}",
        f"{'model':<20}{'batch':>6}{'free ms':>10}{'constrained ms':>16}{'overhead':>10}",
    ]
    for row in r["overhead"]:
        lines.append(f"{row['model']:<20}{row['batch']:>6}{row['free_ms']:>10.2f}{row['constrained_ms']:>16.2f}"
                     f"{row['overhead']:>10.1%}")  # fmt: skip
    b = r["build"]
    theirs = "not installed"
    if b["outlines_core_s"] is not None:
        theirs = f"{b['outlines_core_s']:.2f} s (the engine takes {b['engine_s'] / b['outlines_core_s']:.2f}x its time)"
    lines.append(f"index build, a 7-property schema over GPT-2's vocabulary ({b['states']} states):")
    lines.append(f"  engine {b['engine_s']:.2f} s (+ {b['vocabulary_s']:.2f} s for the vocabulary's bytes, once per "
                 f"tokenizer); outlines-core {theirs}")  # fmt: skip
    return "\n".join(lines)


def plot(r: dict, out: Path) -> Path:
    """Decode step time, free and constrained, per model and batch."""
    import matplotlib  # heavy and optional: only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above

    rows = r["overhead"]
    labels = [f"{row['model'].split('-')[0]}\nbatch {row['batch']}" for row in rows]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(5.6, 4.2))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [row["free_ms"] for row in rows], 0.4, color=ENGINE, label="free")
        ax.bar([i + 0.2 for i in x], [row["constrained_ms"] for row in rows], 0.4, color=TRANSFORMERS,
               label="constrained")  # fmt: skip
        for i, row in zip(x, rows):
            ax.annotate(f"{row['overhead']:+.0%}", (i + 0.2, row["constrained_ms"]), ha="center", va="bottom",
                        fontsize=12, color=ROOF)  # fmt: skip
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("ms per decode step")
        ax.legend(loc="upper right")
        ax.set_title("What a constraint costs a step")
        return save(fig, out / FIGURE)


def main(out: Path, *, device: str = "auto", repeats: int = 3, sizes: Optional[Sizes] = None) -> int:
    """`bench --structured`: measure, then write the "structured" section of out/bench.json, print the table and
    draw the figure."""
    sizes = sizes or Sizes(repeats=repeats)

    def report(results: dict) -> Path:
        print(table(results))
        return plot(results, out)

    return measure_and_save(out, "structured", lambda: run(device=device, sizes=sizes), report)
