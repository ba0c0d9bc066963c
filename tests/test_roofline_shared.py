"""One definition of each idea of the roofline: the engine's `predict` (and through it `step_kernels`, `gemm_cost`,
`attention_cost`, `step_time`, `utilization`) is what `python -m llmcourse bench` (its MBU, MFU and roofline rows),
`bench --quantize` and the capstone's measurement (chapter 12) predict with; chapter 06's notebook bounds its step
with the engine's `roofline_time` and `model_decode_step`.

Two kinds of proof: the benchmarks' figures equal `predict`'s for the same machine figures; and a `predict` whose
table is replaced (a slower `step_time`, another `utilization`) changes every one of their figures as it changes
its own, so none of them computes a figure of its own beside it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from llmcourse import GPT2, GPT2Config
from llmcourse.bench import capstone, quantize, speed
from llmcourse.bench.common import bound_of
from llmcourse.engine import roofline
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.roofline import SHAPES, ModelShape, Roofline, StepTime, predict

ROOT = Path(__file__).resolve().parent.parent
MACHINE = (188e9, 20.5e9)  # a CPU's matmul FLOP/s and bandwidth (images/bench.json's machine)
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256)


def slower(kernels, peak_flops, bandwidth) -> StepTime:
    """The engine's step_time, every kernel three times as slow."""
    t = roofline.step_time(kernels, peak_flops, bandwidth)
    return StepTime(3 * t.seconds, [k._replace(seconds=3 * k.seconds) for k in t.kernels])


def halved(flops, nbytes, seconds, peak_flops, bandwidth):
    """The engine's utilization, halved."""
    mbu, mfu = roofline.utilization(flops, nbytes, seconds, peak_flops, bandwidth)
    return mbu / 2, mfu / 2


OTHER = Roofline().replace(step_time=slower, utilization=halved)


@pytest.fixture
def other_table(monkeypatch):
    """`llmcourse.engine.roofline.predict` running `OTHER` (a learner's table, say), counting its calls."""
    calls = []

    def predict_with_other(*args, **kwargs):
        calls.append(kwargs)
        return predict(*args, **{**kwargs, "table": OTHER})

    monkeypatch.setattr(roofline, "predict", predict_with_other)
    return calls


def test_predicts_defaults_are_the_modules_functions():
    """`predict` without a table runs `Roofline()`, whose slots are the module's own functions (the ones chapter 10's
    checks compare a learner's with), and `step_kernels` defaults to the module's gemm_cost and attention_cost."""
    assert inspect.signature(predict).parameters["table"].default == Roofline()
    for name in Roofline.slot_names():
        assert getattr(Roofline(), name) is getattr(roofline, name), name
    defaults = inspect.signature(roofline.step_kernels).parameters
    assert defaults["gemm_cost"].default is roofline.gemm_cost
    assert defaults["attention_cost"].default is roofline.attention_cost


# ------------------------------------------------------------------------------------------ bench (speed)


def results(config: GPT2Config, dtype: str = "float32") -> dict:
    """What `speed.run` stores about the model, and hand-made measurements."""
    return {
        "shape": dataclasses.asdict(ModelShape.of(config)),
        "dtype": dtype,
        "decode": {"engine": 40.0, "transformers": 30.0},
        "roofline": {"context": 192},
        "prefill": {128: {"engine": 900.0}, 512: {"engine": 800.0}},
        "batching": {1: {"context": 176, "engine": 35.0}, 16: {"context": 176, "engine": 300.0}},
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_speed_benchs_utilization_is_predicts(dtype):
    r, (peak, bandwidth) = results(GPT2Config(), dtype), MACHINE
    u = speed.utilizations(r, peak, bandwidth)
    shape = ModelShape.of(GPT2Config())

    def p(seconds, **settings):
        return predict(shape, MACHINE, **settings, weights=dtype, dtype=dtype, last_only=True, measured_seconds=seconds)

    for name, speed_ in r["decode"].items():
        expected = p(1 / speed_, context=192)
        assert u["decode"][name] == {"MBU": expected.mbu, "MFU": expected.mfu}
    for n, row in r["prefill"].items():
        assert u["prefill"][n]["engine"] == {"MFU": p(n / row["engine"], new_tokens=n).mfu}
    for b, row in r["batching"].items():
        expected = p(b / row["engine"], batch=b, context=176)
        assert u["batching"][b]["engine"] == {"MBU": expected.mbu, "MFU": expected.mfu}
    step = speed.predict_step(r, MACHINE, batch=16, context=176)
    assert step == predict(shape, MACHINE, batch=16, context=176, weights=dtype, dtype=dtype, last_only=True)


def test_the_speed_benchs_utilization_follows_predicts_table(other_table):
    r = results(GPT2Config())
    u = speed.utilizations(r, *MACHINE)
    shape = ModelShape.of(GPT2Config())
    mine = predict(shape, MACHINE, context=192, weights="float32", dtype="float32", measured_seconds=1 / 40)
    assert u["decode"]["engine"] == {"MBU": mine.mbu / 2, "MFU": mine.mfu / 2}
    assert len(other_table) == 2 + 2 + 2  # every decode, prefill and batch row


def test_the_speed_benchs_roofline_rows_are_predicts(other_table):
    """`python -m llmcourse bench` itself (the tiny model, no compile, no transformers): its roofline bound, each
    batch's, the prefill FLOPs and every MBU and MFU come from predict, here running `OTHER`."""
    r = speed.run(
        model_name="tiny",
        device="cpu",
        prompt_len=8,
        new_tokens=4,
        prefill_lens=(8,),
        contexts=(8,),
        batch_sizes=(1, 2),
        repeats=1,
        with_transformers=False,
        compile=False,
        progress=lambda line: None,
    )
    machine = (r["utilization"]["measured"]["peak_GFLOPs"] * 1e9, r["utilization"]["measured"]["bandwidth_GBps"] * 1e9)
    shape = ModelShape.of(TINY)
    engines = predict(shape, machine, context=8 + 2, weights="float32", dtype="float32")
    rf = r["roofline"]
    assert rf["bound_tokens_per_s"] == pytest.approx(engines.tokens_per_s / 3, rel=1e-12)
    assert rf["decode_step_MB"] * 1e6 == pytest.approx(engines.bytes, rel=1e-12)
    assert rf["decode_step_GFLOP"] * 1e9 == pytest.approx(engines.flops, rel=1e-12)
    assert rf["bound_is"] == bound_of(engines) and rf["compute_bound"] == engines.compute_bound()
    steps = max(8, 4 // 4)
    for b, row in r["batching"].items():
        p = predict(shape, machine, batch=b, context=8 + 3 * steps // 2, weights="float32", dtype="float32")
        assert row["bound_tokens_per_s"] == pytest.approx(p.tokens_per_s / 3, rel=1e-12)
        assert row["step_MB"] * 1e6 == pytest.approx(p.bytes, rel=1e-12)
    prefill = predict(shape, machine, new_tokens=8, weights="float32", dtype="float32", last_only=True)
    assert r["prefill_GFLOP"][8] * 1e9 == pytest.approx(prefill.flops, rel=1e-12)
    decode = r["utilization"]["measured"]["decode"]["engine"]
    p = predict(
        shape, machine, context=10, weights="float32", dtype="float32", measured_seconds=1 / r["decode"]["engine"]
    )
    assert decode == {"MBU": pytest.approx(p.mbu / 2, rel=1e-12), "MFU": pytest.approx(p.mfu / 2, rel=1e-12)}


# -------------------------------------------------------------------------------------------- bench --quantize


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 16])
def test_the_quantize_benchs_bound_is_predicts(fmt, batch):
    """The row's weights in its format (scales included), float32 activations and cache; integer products at no
    FLOP/s limit."""
    got = quantize.decode_bound(GPT2Config(), 192, fmt, batch, MACHINE)
    peak = MACHINE[0] if fmt == "float32" else float("inf")
    expected = predict(
        ModelShape.of(GPT2Config()), (peak, MACHINE[1]), batch=batch, context=192, weights=fmt, dtype="float32"
    )
    assert got == expected  # decode: the head on the last position (last_only) is the head on every row


def test_the_quantize_benchs_bound_follows_predicts_table(other_table):
    mine = predict(
        ModelShape.of(GPT2Config()), (float("inf"), MACHINE[1]), context=192, weights="int8", dtype="float32"
    )
    assert quantize.decode_bound(GPT2Config(), 192, "int8", 1, MACHINE).tokens_per_s == pytest.approx(
        mine.tokens_per_s / 3, rel=1e-12
    )
    assert other_table == [dict(batch=1, context=192, weights="int8", dtype="float32", last_only=True)]


# ------------------------------------------------------------------------------------------------- capstone


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_capstones_predicted_rows_are_predicts(family):
    """Prefill (the head on the last position: `last_only`), decode, the server's first token and step, all from
    predict on the model's shape and dtype."""
    if family == "gpt2":
        model = GPT2(TINY)
    else:
        model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=500))
    shape, name = ModelShape.of(model.config), "float32"
    got = capstone.roofline(model, MACHINE, prefill=128, prompt=16, n=64, m=32)

    def p(new_tokens, context):
        return predict(shape, MACHINE, new_tokens=new_tokens, context=context, weights=name, dtype=name, last_only=True)

    assert got["prefill_tok_s"] == p(128, 0).tokens_per_s and got["prefill_bound"] == bound_of(p(128, 0))
    assert got["decode_tok_s"] == p(1, 16 + 32).tokens_per_s and got["decode_bound"] == bound_of(p(1, 48))
    assert got["ttft_ms"] == 1e3 * p(16, 0).seconds and got["itl_ms"] == 1e3 * p(1, 16 + 16).seconds


def test_the_capstones_rows_follow_predicts_table(other_table):
    got = capstone.roofline(GPT2(TINY), MACHINE, prefill=128, prompt=16, n=64, m=32)
    mine = predict(ModelShape.of(TINY), MACHINE, new_tokens=128, weights="float32", dtype="float32", last_only=True)
    assert got["prefill_tok_s"] == pytest.approx(mine.tokens_per_s / 3, rel=1e-12)
    assert len(other_table) == 4 and all(call["last_only"] for call in other_table)


def test_no_benchmark_counts_a_step_itself():
    """The benchmarks' sources name no formula of their own: no roofline_time, step_kernels, gemm_cost or
    utilization of their own, and none of the engine's called directly (they reach them through predict)."""
    for module in (speed, quantize, capstone):
        tree = ast.parse(inspect.getsource(module))
        called = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
        }
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        formulas = {"roofline_time", "step_time", "step_kernels", "gemm_cost", "attention_cost", "utilization"}
        formulas |= {"model_decode_step", "decode_step", "matrix_bytes"}
        assert not (called | defined) & formulas, (module.__name__, (called | defined) & formulas)
        assert "predict" in called, module.__name__


# ----------------------------------------------------------------------------------------- chapter 06's bound


def test_chapter_06_bounds_its_step_with_the_engines_roofline_time():
    """The notebook's `bound_ms` runs the learner's decode_step through the engine's GPT-2 count
    (`model_decode_step`) and takes the larger time with `roofline_time`: no max of its own."""
    notebook = json.loads((ROOT / "solutions" / "06_kv_cache" / "06_kv_cache.ipynb").read_text())
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code" and "def bound_ms(" in "".join(c["source"])]
    assert len(cells) == 1
    tree = ast.parse("".join(cells[0]["source"]))
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    assert {"model_decode_step", "roofline_time"} <= imported
    bound_ms = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "bound_ms")
    calls = {n.func.id: n for n in ast.walk(bound_ms) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"model_decode_step", "roofline_time"} <= set(calls) and "max" not in calls
    step = {k.arg: k.value for k in calls["model_decode_step"].keywords}
    assert isinstance(step.get("step"), ast.Name) and step["step"].id == "decode_step"  # the learner's


def test_chapter_06s_bound_is_the_one_it_computed_before():
    """`model_decode_step` with the learner's decode_step reads what bound_ms counted by hand (all the weights but
    the position table, the float32 cache), plus the one position row a step reads and attention's arithmetic:
    on a memory-bound CPU the printed MB and ms do not move."""
    bandwidth, peak = 12.6e9, 60e9
    for model in (GPT2(GPT2Config(n_layer=6, n_head=6, n_embd=384, vocab_size=50257)), GPT2(GPT2Config())):
        c, context = model.config, 128
        n_params = sum(p.numel() for p in model.parameters()) - c.n_positions * c.n_embd
        flops, nbytes = roofline.decode_step(n_params, 2 * c.n_layer * c.n_embd * 4, context, 1, 4)
        by_hand = max(nbytes / bandwidth, flops / peak)
        engine_flops, engine_bytes = roofline.model_decode_step(c, context, 4, 1, step=roofline.decode_step)
        assert engine_bytes - nbytes == 4 * c.n_embd and engine_flops - flops == 2 * 2 * c.n_layer * c.n_embd * context
        bound = roofline.roofline_time(engine_flops, engine_bytes, peak, bandwidth)
        assert bound.bound == "memory" and f"{bound.seconds * 1e3:7.1f}" == f"{by_hand * 1e3:7.1f}"
        assert f"{engine_bytes / 1e6:6.0f}" == f"{nbytes / 1e6:6.0f}"


def test_the_shapes_the_benchmarks_predict_for_are_the_published_ones():
    assert ModelShape.of(GPT2Config()) == SHAPES["GPT-2 124M"]
