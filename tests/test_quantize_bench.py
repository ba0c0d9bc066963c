"""The quantization benchmark (`python -m llmcourse bench --quantize`): its byte counts and ratios on hand-made
numbers, the run on the tiny configuration with and without CTranslate2, the table, the figure and the command end
to end. No timing is asserted: only that the figures exist, are computed right and are sane."""

import json
import math
import os
import re
import struct
import sys
from pathlib import Path

import pytest
import torch

from llmcourse.bench import quantize as qb
from llmcourse.engine import threads
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.model import GPT2
from llmcourse.engine.quantize import BYTES_PER_WEIGHT, quantize_model

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ROWS = ["engine float32", "engine int8", "engine int4", "transformers float32"]


def peer_rows(r) -> list[str]:
    """The peers' rows of a run: each format at each of its thread counts (CTranslate2, then llama.cpp)."""
    return [
        qb.peer_name(peer, fmt, n)
        for peer, key, formats in (
            ("ctranslate2", "ctranslate2", qb.CT2_TYPES),
            ("llama.cpp", "llama_cpp", ("float32", "int8")),
        )
        if key in r
        for fmt in formats
        for n in r[key]["thread_counts"]
    ]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_rows_bound_reads_the_weights_the_engine_stores_in_its_format(fmt):
    """`decode_bound` (the engine's predict, weights in `fmt`): what a step reads beyond the float32 step's is what
    the engine's quantized model stores (each quantized matrix's weights and scales, the tied table once) beyond
    its float32 matrices; the rest (activations, the float32 KV cache) is the same."""
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=500, n_positions=256)
    base = GPT2(cfg).init_weights(0)
    matrices = [
        m.weight for block in base.h for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
    ] + [base.wte.weight]
    stored = [
        t
        for m in quantize_model(GPT2(cfg).init_weights(0), fmt).modules()
        if hasattr(m, "qweight")
        for t in (m.qweight, m.scales)
    ]
    machine = (100e9, 20e9)
    float32, quantized = (qb.decode_bound(cfg, 40, f, 3, machine) for f in ("float32", fmt))
    assert quantized.bytes - float32.bytes == sum(t.nbytes for t in stored) - sum(t.nbytes for t in matrices)
    assert quantized.flops == float32.flops


def test_integer_rows_are_bounded_by_bandwidth_alone_and_batches_share_the_weights():
    cfg, machine = GPT2Config(), (188e9, 20.5e9)
    for fmt in ("int8", "int4"):
        p = qb.decode_bound(cfg, 192, fmt, 64, machine)
        assert p.compute_bound() == [] and p.seconds == pytest.approx(p.bytes / machine[1], rel=1e-12)
    # float32 at a large batch: its products compute-bound at the measured matmul rate
    assert qb.decode_bound(cfg, 192, "float32", 64, machine).compute_bound() == [
        "q",
        "k",
        "v",
        "o",
        "up",
        "down",
        "head",
    ]
    # fewer bytes per weight, a higher bound; a batch reads the weights once and a cache per row
    bounds = [qb.decode_bound(cfg, 192, fmt, 1, machine).tokens_per_s for fmt in qb.ENGINE_FORMATS]
    assert bounds == sorted(bounds) and bounds[-1] > 5 * bounds[0]
    one, sixteen = (qb.decode_bound(cfg, 192, "int4", b, machine).bytes for b in (1, 16))
    weights = qb.decode_bound(cfg, 192, "int4", 0, machine).bytes
    assert sixteen - weights == 16 * (one - weights) and one - weights > 4 * 2 * 12 * 192 * 768  # the cache and more
    assert BYTES_PER_WEIGHT["int4"] == 0.5625  # the table's column: half a byte and a float16 scale per 32


def test_first_divergence():
    assert qb.first_divergence([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert qb.first_divergence([9], [1]) == 0
    assert qb.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert qb.first_divergence([1, 2], [1, 2, 3]) == 2


def rows(**speeds) -> dict:
    """Hand-made rows: name -> (batch 1 tok/s, batch 16 tok/s or None); "*" after a peer's name: its default."""
    out = {}
    for name, (one, many) in speeds.items():
        name = name.replace("_", " ").replace("q8 0", "q8_0")  # keyword names have no spaces
        out[name.rstrip("*")] = {"batch_1": {"tokens_per_s": one}, "default": name.endswith("*")}
        if many is not None:
            out[name.rstrip("*")]["batch_16"] = {"tokens_per_s": many}
    return out


def test_ratios_set_the_engine_against_each_peer_at_its_default_and_at_its_best():
    got = qb.ratios(
        rows(
            engine_float32=(30.0, 150.0),
            engine_int8=(40.0, 200.0),
            engine_int4=(56.0, 240.0),
            transformers_float32=(24.0, 90.0),
            **{
                "ctranslate2_float32,_1_thread": (25.0, 160.0),
                "ctranslate2_float32,_2_threads*": (20.0, 100.0),
                "ctranslate2_int8,_1_thread": (32.0, 100.0),
                "ctranslate2_int8,_2_threads*": (50.0, 400.0),
                "llama.cpp_f32,_1_thread*": (20.0, None),
                "llama.cpp_f32,_2_threads": (40.0, None),
                "llama.cpp_q8_0,_1_thread*": (80.0, None),
                "llama.cpp_q8_0,_2_threads": (60.0, None),
            },
        ),
        batch=16,
    )
    want = {
        "engine float32 / ctranslate2 float32 at its default, batch 1": (30 / 20, "ctranslate2 float32, 2 threads"),
        "engine float32 / ctranslate2 float32 at its best, batch 1": (30 / 25, "ctranslate2 float32, 1 thread"),
        "engine float32 / llama.cpp f32 at its default, batch 1": (30 / 20, "llama.cpp f32, 1 thread"),
        "engine float32 / llama.cpp f32 at its best, batch 1": (30 / 40, "llama.cpp f32, 2 threads"),
        "engine int8 / ctranslate2 int8 at its default, batch 1": (40 / 50, "ctranslate2 int8, 2 threads"),
        "engine int8 / ctranslate2 int8 at its best, batch 1": (40 / 50, "ctranslate2 int8, 2 threads"),
        "engine int8 / llama.cpp q8_0 at its default, batch 1": (40 / 80, "llama.cpp q8_0, 1 thread"),
        "engine int8 / llama.cpp q8_0 at its best, batch 1": (40 / 80, "llama.cpp q8_0, 1 thread"),
        "engine int4 / engine int8, batch 1": (56 / 40, None),
        # batch 16: llama.cpp decodes one sequence at a time, and the best thread count may differ from batch 1's
        "engine float32 / ctranslate2 float32 at its default, batch 16": (150 / 100, "ctranslate2 float32, 2 threads"),
        "engine float32 / ctranslate2 float32 at its best, batch 16": (150 / 160, "ctranslate2 float32, 1 thread"),
        "engine int8 / ctranslate2 int8 at its default, batch 16": (200 / 400, "ctranslate2 int8, 2 threads"),
        "engine int8 / ctranslate2 int8 at its best, batch 16": (200 / 400, "ctranslate2 int8, 2 threads"),
        "engine int4 / engine int8, batch 16": (240 / 200, None),
    }
    assert list(got) == list(want)
    for name, (ratio, against) in want.items():
        target = 1.3 if "int4" in name else 1.0
        assert got[name]["ratio"] == pytest.approx(ratio) and got[name]["target"] == target, name
        assert got[name]["met"] == (ratio >= target) and got[name].get("against") == against, name


def test_ratios_without_peers_keep_the_engines_own():
    got = qb.ratios(rows(engine_float32=(30.0, 150.0), engine_int8=(40.0, 200.0), engine_int4=(20.0, 300.0)), batch=16)
    assert {k: v["ratio"] for k, v in got.items()} == {
        "engine int4 / engine int8, batch 1": 0.5,
        "engine int4 / engine int8, batch 16": 1.5,
    }


# ---------------------------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def quick():
    """The whole benchmark on the tiny configuration (a few seconds)."""
    before, engine_count = torch.get_num_threads(), threads.count()
    lines = []
    r = qb.run(device="cpu", sizes=qb.QUICK, progress=lines.append)
    assert torch.get_num_threads() == before  # restored
    assert r["threads"] == engine_count  # the engine's count, for every engine
    return r, lines


def test_the_benchmark_measures_every_row(quick):
    r, lines = quick
    pytest.importorskip("ctranslate2")
    assert list(r["rows"]) == ENGINE_ROWS + peer_rows(r)
    assert r["ctranslate2"]["version"] and "int8" in r["ctranslate2"]["compute_types"]
    assert r["ctranslate2"]["default_threads"] == min(4, os.cpu_count())
    assert r["ctranslate2"]["thread_counts"] == qb.peer_thread_counts(r["threads"], min(4, os.cpu_count()))
    assert r["model"] == "tiny" and r["machine"]["cpu"]
    b = qb.QUICK.batch
    for name, v in r["rows"].items():
        assert v["bytes_per_weight"] == BYTES_PER_WEIGHT[v["format"]]
        for key, n in (("batch_1", qb.QUICK.new_tokens), (f"batch_{b}", qb.QUICK.batch_new_tokens)):
            if key not in v:
                assert v["engine"] == "llama.cpp" and key != "batch_1"  # one sequence at a time
                continue
            row = v[key]
            for figure in ("tokens_per_s", "decode_tokens_per_s", "bound_tokens_per_s", "fraction", "step_MB"):
                assert isinstance(row[figure], float) and math.isfinite(row[figure]) and row[figure] > 0, (name, key)
            assert row["fraction"] == pytest.approx(row["decode_tokens_per_s"] / row["bound_tokens_per_s"])
            assert 0 <= row["agreement"] <= n and row["agreement_of"] == n
        assert v.get(f"batch_{b}", {}).get("tokens_per_s") == v.get(f"batch_{b}", {}).get("decode_tokens_per_s")
    # the same float32 weights: the engine agrees with itself and with transformers on every token
    for name in ("engine float32", "transformers float32"):
        assert r["rows"][name]["batch_1"]["agreement"] == qb.QUICK.new_tokens
        assert r["rows"][name][f"batch_{b}"]["agreement"] == qb.QUICK.batch_new_tokens
    # fewer bytes per weight, a higher roofline
    bounds = [r["rows"][f"engine {fmt}"]["batch_1"]["bound_tokens_per_s"] for fmt in ("float32", "int8", "int4")]
    assert bounds == sorted(bounds)
    ct2_int8 = qb.peer_name("ctranslate2", "int8", 1)
    assert r["rows"][ct2_int8]["batch_1"]["step_MB"] == r["rows"]["engine int8"]["batch_1"]["step_MB"]
    assert r["resident_MB"]["int4"] < r["resident_MB"]["int8"] < r["resident_MB"]["float32"]
    peers = 1 + ("llama_cpp" in r)  # at batch 1; CTranslate2 alone at the larger batch
    assert len(r["ratios"]) == (2 * 2 * peers + 1) + (2 * 2 + 1) and all(v["ratio"] > 0 for v in r["ratios"].values())
    assert set(r["attention_ms"]) == {1, b} and all(v["ms"] > 0 and v["GBps"] > 0 for v in r["attention_ms"].values())
    assert set(r["linear_ms"]) == {"float32", "int8", "int4"}
    assert all(
        set(v) == {1, b} and all(t["blocks_ms"] > 0 and t["head_ms"] > 0 for t in v.values())
        for v in r["linear_ms"].values()
    )
    assert any("batch 1" in line for line in lines) and qb.CT2_NOT_INSTALLED not in lines
    json.dumps(r)  # all of it goes into bench.json


def test_without_ctranslate2_or_llama_cpp_their_rows_are_skipped_with_one_line(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert qb.llama_cpp.modules() is None
    assert qb.ctranslate2_module() is None
    assert "OMP_WAIT_POLICY" not in os.environ  # set for CTranslate2's runtime to read when it loads, then removed
    lines = []
    sizes = qb.Sizes(model="tiny", prompt_len=8, new_tokens=4, batch=2, batch_new_tokens=3, repeats=1, layer_repeats=1)
    r = qb.run(device="cpu", sizes=sizes, progress=lines.append)
    assert list(r["rows"]) == ENGINE_ROWS and "ctranslate2" not in r
    assert r["ctranslate2_skipped"] == qb.CT2_NOT_INSTALLED and lines.count(qb.CT2_NOT_INSTALLED) == 1
    assert r["llama_cpp_skipped"] == qb.llama_cpp.NOT_INSTALLED and lines.count(qb.llama_cpp.NOT_INSTALLED) == 1
    assert list(r["ratios"]) == ["engine int4 / engine int8, batch 1", "engine int4 / engine int8, batch 2"]
    text = qb.table(r).replace(qb.CT2_NOT_INSTALLED, "").replace(qb.llama_cpp.NOT_INSTALLED, "")
    assert "ctranslate2" not in text and "llama.cpp" not in text and "CTranslate2 is not installed" in qb.table(r)


def test_table_and_figure(quick, tmp_path):
    r, _ = quick
    text = qb.table(r)
    assert text.splitlines()[1].startswith("machine: ")
    for name, v in r["rows"].items():
        assert re.search(
            rf"^ +{re.escape(name)}( \(default\))? +[\d.]+ +{v['batch_1']['tokens_per_s']:.1f} ", text, re.M
        )
    for name, v in r["ratios"].items():
        if "against" in v:  # the peer's row, its thread count in the name
            name = name.replace(", batch", f" ({v['against'].split(', ')[-1]}), batch")
        assert f"{name:<72} {v['ratio']:5.2f}x (≥ {v['target']:g}: {'met' if v['met'] else 'MISSED'})" in text
    assert text.count("blocks") == 2 * len(r["linear_ms"])
    for fmt, by_rows in r["linear_ms"].items():  # each format's decode step, taken apart
        step = 1e3 / r["rows"][f"engine {fmt}"]["batch_1"]["decode_tokens_per_s"]
        head = f"    {fmt:<8}batch 1: {step:5.1f} = {by_rows[1]['blocks_ms']:.1f} + {by_rows[1]['head_ms']:.1f} + "
        assert head in text, head
    width, height = png_size(qb.plot(r, tmp_path))
    assert 600 <= width <= 1200 and 1 < height / width < 2.5  # two panels, stacked for a phone
    back = json.loads(json.dumps(r))  # keys become strings: the table reads them back alike
    assert qb.table(back) == text


# ---------------------------------------------------------------------------------------------- the command


def test_bench_quantize_end_to_end_keeps_the_rest_of_bench_json(quick, tmp_path, monkeypatch, capsys):
    """`python -m llmcourse bench --quantize`, in this process, on the measurements above: the flags reach it, the
    JSON keeps the other sections, the table and the figure come."""
    from llmcourse.__main__ import main

    calls = []
    measured = json.loads(json.dumps(quick[0]))
    monkeypatch.setattr(qb, "run", lambda **kw: calls.append(kw) or measured)
    (tmp_path / "bench.json").write_text(json.dumps({"decode": {"engine": 1.0}}))
    args = ["bench", "--quantize", "--model", "tiny", "--device", "cpu", "--repeats", "5", "--out", str(tmp_path)]
    assert main(args) == 0
    assert calls == [{"device": "cpu", "sizes": qb.Sizes(model="tiny", repeats=5)}]
    out, err = capsys.readouterr()
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["decode"] == {"engine": 1.0} and r["quantize"] == measured  # the other sections stay
    assert "engine int4 / engine int8, batch 1" in out and str(tmp_path / qb.FIGURE) in out
    assert (tmp_path / qb.FIGURE).exists() and not err


def test_a_failing_figure_loses_no_measurement(quick, tmp_path, monkeypatch, capsys):
    measured = json.loads(json.dumps(quick[0]))
    monkeypatch.setattr(qb, "run", lambda **kw: measured)
    monkeypatch.setattr(qb, "plot", lambda *a: 1 / 0)
    assert qb.main(tmp_path) == 1
    out, err = capsys.readouterr()
    assert "ZeroDivisionError" in err and "the measurements are in" in err and "ratios (target)" in out
    assert json.loads((tmp_path / "bench.json").read_text())["quantize"] == measured


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", "gpt2-shakespeare"],
            "bench --quantize runs a configuration with random weights (gpt2, tiny), not 'gpt2-shakespeare'",
        ),
        (
            ["--dtype", "bfloat16"],
            "bench --quantize runs float32 activations (as CTranslate2's int8 does on a CPU); "
            "--dtype bfloat16 is not supported",
        ),
    ],
)
def test_a_bad_option_is_one_line(args, message, tmp_path, capsys):
    from llmcourse.__main__ import main

    assert main(["bench", "--quantize", *args, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"python -m llmcourse bench: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_the_quantize_flag(capsys):
    from llmcourse.__main__ import build_parser, main

    assert build_parser().parse_args(["bench", "--quantize"]).quantize is True
    assert build_parser().parse_args(["bench"]).quantize is False
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--quantize", "--speculative"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "not allowed with argument" in err, err


def test_the_benchmarks_page_shows_the_quantization_figures():
    """benchmarks.md's quantization section shows bench_quantize.png and quotes the committed measurements."""
    page = (ROOT / "benchmarks.md").read_text()
    section = page[page.index("## Quantization") :]
    assert f"](images/{qb.FIGURE})" in section and png_size(ROOT / "images" / qb.FIGURE)[0] >= 600
    r = json.loads((ROOT / "images" / "bench.json").read_text())["quantize"]
    assert "python -m llmcourse bench --quantize" in section
    assert set(r["rows"]) == set(ENGINE_ROWS + peer_rows(r)) and r["model"] == "gpt2" and "llama_cpp" in r
    for name in r["rows"]:
        assert f"{r['rows'][name]['batch_1']['tokens_per_s']:.1f}" in section, name
    for name, v in r["ratios"].items():
        assert f"{v['ratio']:.2f}×" in section, name


def test_the_threads_under_load_table(monkeypatch, capsys):
    """`python -m llmcourse.bench.under_load`: each way runs in a process of its own (here: hand-made speeds in
    place of the processes), medians, and the two targets per configuration; a child measures one call."""
    from llmcourse.bench import under_load

    speeds = {"default": [40.0, 44.0, 42.0], "1 thread": [30.0, 31.0, 29.0], "default, busy": [20.0, 26.0, 27.0]}
    calls = []

    def one_run(way, args, fmt, batch):
        calls.append((way, fmt, batch))
        return speeds[way][sum(1 for c in calls if c == (way, fmt, batch)) - 1]

    monkeypatch.setattr(under_load, "one_run", one_run)
    assert under_load.main(["--model", "tiny", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 3 * 2 * 3 and calls[:3] == [
        ("default", "float32", 1),
        ("1 thread", "float32", 1),
        ("default, busy", "float32", 1),
    ]
    assert "| float32, 1 | 42.0 (40.0, 44.0, 42.0) | 30.0 (30.0, 31.0, 29.0) | 26.0 (20.0, 26.0, 27.0) |" in out
    assert "0.62 (≥ 0.6: met) | 0.87 (≥ 0.9: MISSED) |" in out
    assert under_load.child("tiny", "int8", 2, 8, 3) > 0
