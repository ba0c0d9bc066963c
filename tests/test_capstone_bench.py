"""Chapter 12's measurement (`llmcourse.bench.capstone`): your engine beside the course engine and transformers, with
the roofline's prediction beside each figure, in quick mode.

An engine made of the engine's own functions (standing for a learner who wrote them all) gives the course engine's
tokens and transformers' too; every figure is finite and positive; the fractions are the figures shown over the
roofline's; the table has every row and column; an engine with a deliberately slow softmax is measured slower, and
the advice says by how much and names softmax's chapter, from the profile.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from llmcourse.bench import capstone
from llmcourse.checks.kv_cache import one_thread
from llmcourse.course import bpe
from llmcourse.course.learner import pieces_of
from llmcourse.engine.decoder import KVCache
from llmcourse.engine.loading import load_model
from llmcourse.engine.padding import left_pad
from llmcourse.engine.parts import Parts, softmax
from llmcourse.engine.roofline import ModelShape, predict
from llmcourse.engine.sampling import Sampler

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "gpt2-shakespeare"


def quiet(line):
    pass


def engine_of(**instead):
    """An engine whose forward pass, sampler, cache and tokenizer are all "yours": the engine's own functions."""
    fns = {f.name: f.default for t in (Parts, Sampler) for f in dataclasses.fields(t)}
    fns |= dict(KVCache=KVCache, left_pad=left_pad, decode=bpe.decode)
    fns["encode"] = lambda text, ranks: bpe.encode(text, ranks=ranks)
    fns = {name: fn for name, fn in (fns | instead).items() if fn is not None}  # None: that slot stays the engine's
    pieces = pieces_of(fns, notify=quiet)
    return pieces.install(load_model(MODEL, parts=pieces.parts))


@pytest.fixture(scope="module")
def results():
    with one_thread():  # a module's fixture runs before the tests' one_thread
        yield capstone.measure(engine_of(), model=MODEL, quick=True)


def slow_softmax(x, dim=-1):
    time.sleep(0.002)
    return softmax(x, dim)


@pytest.fixture(scope="module")
def slow():
    with one_thread():
        # your softmax without your attention: the engine's written-out attention runs it, each layer, each step
        engine = engine_of(softmax=slow_softmax, attention=None)
        yield capstone.measure(engine, model=MODEL, quick=True, with_transformers=False)


def test_your_engine_course_engine_and_transformers_give_the_same_tokens(results):
    s = results["systems"]
    assert len(s["yours"]["tokens"]) == capstone.QUICK.new_tokens
    assert s["yours"]["tokens"] == s["course"]["tokens"] == s["transformers"]["tokens"]
    assert results["same_tokens"] == {"yours": True, "course": True, "transformers": True}
    assert s["yours"]["server_text"] == s["course"]["server_text"] != ""


def test_every_figure_is_finite_and_positive_and_transformers_has_no_server(results):
    for name in ("yours", "course"):
        for row in capstone.ROWS:
            value = results["systems"][name][row]
            assert math.isfinite(value) and value > 0, (name, row, value)
    t = results["systems"]["transformers"]
    assert t["ttft_ms"] is None and t["itl_ms"] is None
    assert all(math.isfinite(t[row]) and t[row] > 0 for row in ("prefill_tok_s", "decode_tok_s", "memory_MB"))
    roof = results["roofline"]
    assert all(math.isfinite(roof[row]) and roof[row] > 0 for row in capstone.ROWS)
    # the same weights: the same bytes held, within the buffers each keeps
    weights = [results["systems"][n]["weights_MB"] for n in capstone.SYSTEMS]
    assert max(weights) / min(weights) < 1.05 and abs(weights[0] / roof["weights_MB"] - 1) < 0.05


def test_the_fractions_are_the_figures_over_the_roofline(results):
    roof, f = results["roofline"], results["fractions"]
    for name, s in results["systems"].items():
        for row in ("prefill_tok_s", "decode_tok_s", "memory_MB"):
            assert f[name][row] == pytest.approx(s[row] / roof[row])
        for row in ("ttft_ms", "itl_ms"):
            if s[row] is None:
                assert row not in f[name]
            else:
                assert f[name][row] == pytest.approx(roof[row] / s[row])
    # the decode step of a 49 MB model on any machine: memory-bound
    assert roof["decode_bound"] == "memory"


def test_the_roofline_is_the_engines_predict_on_this_runs_machine(results):
    """Every predicted time is `predict` for the model's shape in its dtype, on the bandwidth and FLOP/s this run
    measured: the prefill (the head on the last position), the decode step in the middle of the decode, the server's
    first token and its step in the middle of its tokens."""
    roof, sz = results["roofline"], results["sizes"]
    config = load_model(MODEL).config
    machine = (roof["peak_GFLOPs"] * 1e9, roof["bandwidth_GBps"] * 1e9)
    prompt, dtype = results["prompt_tokens"], results["dtype"]

    def p(new_tokens, context):
        shape = ModelShape.of(config)
        return predict(
            shape, machine, new_tokens=new_tokens, context=context, weights=dtype, dtype=dtype, last_only=True
        )

    assert roof["prefill_tok_s"] == pytest.approx(p(results["prefill_tokens"], 0).tokens_per_s, rel=1e-12)
    assert roof["decode_tok_s"] == pytest.approx(p(1, prompt + sz["new_tokens"] // 2).tokens_per_s, rel=1e-12)
    assert roof["ttft_ms"] == pytest.approx(1e3 * p(prompt, 0).seconds, rel=1e-12)
    assert roof["itl_ms"] == pytest.approx(1e3 * p(1, prompt + sz["server_tokens"] // 2).seconds, rel=1e-12)


def test_the_table_has_every_row_and_column(results):
    text = capstone.table(results)
    header = next(line for line in text.splitlines() if "course engine" in line)
    assert all(h in header for h in ("yours", "course engine", "transformers", "roofline"))
    for label in capstone.LABELS.values():
        row = next(line for line in text.splitlines() if line.startswith(label))
        assert row.count("(") >= 3 or label.startswith(("TTFT", "ITL")) and "—" in row
    r = results["systems"]["yours"]
    shown = f"{capstone.number(r['decode_tok_s'])} ({capstone.percent(results['fractions']['yours']['decode_tok_s'])})"
    assert shown in text
    assert "same greedy tokens as the course engine: yours yes, transformers yes" in text


def test_a_slow_softmax_is_measured_slower_and_named_by_its_chapter(slow):
    yours, course = slow["systems"]["yours"], slow["systems"]["course"]
    ratio = course["decode_tok_s"] / yours["decode_tok_s"]
    assert ratio > 1.5  # 6 layers x 2 ms of sleep per token
    lines = capstone.advice(slow)
    assert lines[0].startswith(f"decode: yours {capstone.number(yours['decode_tok_s'])} tok/s")
    assert f"{ratio:.1f}x slower" in lines[0]
    assert lines[1].startswith("  your softmax (03_attention) takes")
    assert slow["profile_ms_per_token"]["yours"]["softmax"] > 6 * 2  # measured: the sleeps
    assert "transformers: skipped" in capstone.table(slow)


def test_the_figure_draws_each_speed_beside_its_roofline(results, slow):
    fig = capstone.figure(results)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [list(b.x) for b in bars] == [["yours", "course engine", "transformers"]] * 2 + [
        ["yours", "course engine"]
    ] * 2
    for bar, (row, _) in zip(bars, capstone.PANELS):
        assert (
            list(bar.y)
            == [results["systems"][n][row] for n in capstone.SYSTEMS if n in results["systems"]][: len(bar.y)]
        )
    roofs = [shape.y0 for shape in fig.layout.shapes]
    assert roofs == [results["roofline"][row] for row, _ in capstone.PANELS]
    assert [list(b.x) for b in capstone.figure(slow).data][:2] == [["yours", "course engine"]] * 2  # no transformers


def test_the_breakdown_splits_the_profiled_step_beside_the_roofline_of_the_same_kernels(results):
    """Chapter 12's "where the step's time goes": its rows add up to the profile (every profiled ms in one row, the
    tied head's product timed on its own), and its roofline column is `predict`'s time of the same kernels."""
    prof = results["profile_ms_per_token"]["course"]
    assert prof["head"] > 0  # GPT-2's head is tied: the token table's logits, timed by the profile
    b = capstone.breakdown(results)
    rows = {what: (ms, roof) for what, ms, roof in b["rows"]}
    assert sum(ms for ms, _ in rows.values()) == pytest.approx(sum(prof.values()), rel=1e-12)
    assert rows["the head's product (tied)"][0] == prof["head"]
    assert rows["the code around them (loop, cache)"] == (prof["rest"], None)
    kernels = results["roofline"]["decode_kernels_ms"]
    assert rows["the head's product (tied)"][1] == kernels["head"]
    assert rows["weight products of the layers"][1] == pytest.approx(sum(kernels[k] for k in "qkvo") + kernels["up"]
                                                                     + kernels["down"])  # fmt: skip
    roof = results["roofline"]
    step = predict(
        ModelShape.of(load_model(MODEL).config),
        (roof["peak_GFLOPs"] * 1e9, roof["bandwidth_GBps"] * 1e9),
        new_tokens=1,
        context=results["prompt_tokens"] + results["sizes"]["new_tokens"] // 2,
        weights="float32",
        dtype="float32",
        last_only=True,
    )
    assert sum(kernels.values()) == pytest.approx(1e3 * step.seconds, rel=1e-12)
    text = capstone.breakdown_table(results)
    share = (prof["linear"] + prof["head"]) / sum(prof.values())
    assert f"The weight products take {share:.0%} of the step" in text
    head_rate = roof["bandwidth_GBps"] * kernels["head"] / prof["head"]
    assert f"the head's at {head_rate:.1f} GB/s" in text


def test_the_profile_leaves_the_head_as_it_was(results):
    model = load_model(MODEL)
    capstone.profile(capstone.System("course", model, model), [1, 2, 3], 2)
    assert "logits" not in vars(model.wte)  # the timing wrapper over the method is gone


def challenge_run(yours: float, course: float, functions=("softmax",)) -> dict:
    return {
        "fractions": {"yours": {"decode_tok_s": yours}, "course": {"decode_tok_s": course}},
        "roofline": {"decode_tok_s": 500.0},
        "systems": {"yours": {"decode_tok_s": 500.0 * yours}},
        "yours_functions": list(functions),
    }


def test_the_open_task_is_reported_against_the_course_engines_share_on_the_same_run():
    assert capstone.challenge(challenge_run(0.55, 0.5)).endswith(" Reached.")
    assert "Yours: 55% (275 tok/s); the course engine on this run: 50%" in capstone.challenge(challenge_run(0.55, 0.5))
    assert "the advice above names" in capstone.challenge(challenge_run(0.3, 0.52))
    assert "does not reach it on this machine either" in capstone.challenge(challenge_run(0.3, 0.35))
    assert "No function of yours" in capstone.challenge(challenge_run(0.5, 0.5, functions=()))
    assert capstone.challenge(challenge_run(0.4, 0.6)).endswith(" Reached.")  # the target itself counts
