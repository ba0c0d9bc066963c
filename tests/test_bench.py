"""`python -m llmcourse bench`: every documented command and option, run end to end as a user types
it, on the tiny configuration (no timing assertions: only that the figures exist and are sane)."""

import dataclasses
import json
import math
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from llmcourse.bench import common
from llmcourse.bench import speed as bench
from llmcourse.bench.common import bound_of
from llmcourse.bench.speed import FIGURES
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.loading import resolve_device
from llmcourse.engine.roofline import SHAPES, ModelShape, gpu_roof, predict

ROOT = Path(__file__).resolve().parent.parent
# Appended to every command: small enough that a run takes seconds (a compiled run, about a minute).
TINY = [
    "--model",
    "tiny",
    "--prompt-len",
    "16",
    "--new-tokens",
    "8",
    "--prefill-lens",
    "16,32",
    "--contexts",
    "16,32",
    "--batch-sizes",
    "1,2",
    "--repeats",
    "1",
]
# Every command line the end-to-end tests below run (before TINY and --out); `bench --help` must list
# no option that none of them uses.
OPTIONS_RUN = ["--no-compile --no-transformers --device cpu --dtype float16"]
# Compiling takes 10-20 s per batch size: a compiled run measures batch 1 only (the same loop as batch 2).
COMPILED_BATCHES = ["--batch-sizes", "1"]


def documented_commands() -> list[str]:
    """The `python -m llmcourse bench ...` commands that benchmarks.md and README.md show: the lines
    of their bash blocks, and inline code, without the comments."""
    commands = []
    for page in ("benchmarks.md", "README.md"):
        text = (ROOT / page).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            commands += [
                line.split("#")[0].strip()
                for line in block.splitlines()
                if line.strip().startswith("python -m llmcourse bench")
            ]
        commands += re.findall(r"`(python -m llmcourse bench[^`]*)`", text)
    return sorted(set(commands))


def run_bench(command: str, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    args = shlex.split(command)
    assert args[:4] == ["python", "-m", "llmcourse", "bench"], command
    more = [] if "--no-compile" in args else COMPILED_BATCHES
    done = subprocess.run(
        [sys.executable, *args[1:], *TINY, *more, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done, json.loads((out / "bench.json").read_text())


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def check_run(
    done: subprocess.CompletedProcess, r: dict, out: Path, *, compiled: bool, transformers: bool, dtype: str = "float32"
) -> None:
    """The JSON, the table and the figures are all there, with sane numbers."""
    assert r["device"] == "cpu" or r["device"].startswith("cuda")
    assert r["dtype"] == dtype and r["model"] == "tiny" and r["config"]["n_layer"] == 2
    # the machine the figures depend on, in the JSON and in the table's header
    m = r["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] >= 1 and 0 < m["weights_MB"] < 100
    if Path("/sys/devices/system/cpu/cpu0/cache").is_dir() and r["device"] == "cpu":
        assert m["llc_MB"] > 0 and m["llc_level"] >= 2 and m["weights_fit_in_llc"] in (True, False)
    header = done.stdout.splitlines()[1]
    assert header.startswith("machine: ") and m["cpu"] in header and "weights" in header
    # the decode rows asked for, and only those
    expected = {"engine"} | ({"engine_compiled"} if compiled else set()) | ({"transformers"} if transformers else set())
    assert set(r["decode"]) == expected
    assert bool(re.search(r"^ +with torch.compile", done.stdout, re.M)) == compiled
    assert ("transformers" in done.stdout) == transformers
    batches = {"1"} if compiled else {"1", "2"}
    assert set(r["prefill"]) == {"16", "32"} and set(r["kv_cache"]) == {"16", "32"} and set(r["batching"]) == batches
    names = ["engine", "engine_compiled"][: 1 + compiled]
    speeds = [
        *r["decode"].values(),
        *(v for p in r["prefill"].values() for v in p.values()),
        r["roofline"]["bound_tokens_per_s"],
        *(v[k] for v in r["batching"].values() for k in ["bound_tokens_per_s", *names]),
    ]
    assert all(isinstance(x, float) and math.isfinite(x) and 0 < x < 1e7 for x in speeds), speeds
    others = [
        r["roofline"]["bandwidth_GBps"],
        r["roofline"]["matmul_GFLOPs"],
        r["roofline"]["decode_step_MB"],
        *(r["roofline"][f"{n}_fraction"] for n in names),
        *(v[k] for v in r["kv_cache"].values() for k in ("cached_ms", "recompute_ms", "speedup")),
    ]
    assert all(isinstance(x, float) and math.isfinite(x) and 0 < x < 1e6 for x in others), others
    if not compiled:  # the bound of a batch counts the weights once and each row's cache and arithmetic
        one, two = r["batching"]["1"], r["batching"]["2"]
        assert two["bound_tokens_per_s"] > one["bound_tokens_per_s"] or two["bound_is"] == "compute"
    check_utilization(r, r["utilization"]["measured"])
    assert re.search(r"^ +decode, batch 1, engine +\d[\d.]*% +\d[\d.]*%$", done.stdout, re.M), done.stdout
    assert "MBU" in done.stdout and "MFU" in done.stdout
    ratios = {"decode_roofline_fraction", "kv_cache_speedup_16", "kv_cache_speedup_32"}
    ratios |= {"decode_compiled_roofline_fraction"} if compiled else {"batch_2_vs_batch_1"}
    ratios |= (
        {"decode_vs_transformers", "prefill_16_vs_transformers", "prefill_32_vs_transformers"}
        if transformers
        else set()
    )
    ratios |= {"decode_compiled_vs_transformers"} if compiled and transformers else set()
    assert set(r["ratios"]) == ratios and all(0 < v < 1e7 for v in r["ratios"].values())
    if r["device"] == "cpu":
        assert "CUDA rows" in done.stdout and "skipped" in done.stdout and r["cuda_skipped"]
    assert "decode, batch 1" in done.stdout and "roofline" in done.stdout and "error" not in done.stderr.lower()
    # one figure per measurement, each big enough to be read at 400 px wide
    for name in FIGURES.values():
        width, height = png_size(out / name)
        assert 600 <= width <= 1200 and 0.5 < height / width < 1, (name, width, height)
        assert str(out / name) in done.stdout
    assert not (out / "bench.png").exists()


def check_utilization(r: dict, u: dict) -> None:
    """MBU and MFU of every decode and prefill row are its bytes and FLOPs over the time a step took, over the
    bandwidth and peak they are of (`u`): recomputed here from the stored figures, to float rounding; the stored
    bytes, FLOPs and bounds are the engine's `predict` for the model's shape in the run's dtype."""
    bandwidth, peak = u["bandwidth_GBps"] * 1e9, u["peak_GFLOPs"] * 1e9
    if u is r["utilization"]["measured"]:
        assert (u["bandwidth_GBps"], u["peak_GFLOPs"]) == (
            r["roofline"]["bandwidth_GBps"],
            r["roofline"]["matmul_GFLOPs"],
        )
    rf = r["roofline"]
    shape, dtype = ModelShape.of(GPT2Config(**r["config"])), r["dtype"]
    machine = (rf["matmul_GFLOPs"] * 1e9, rf["bandwidth_GBps"] * 1e9)
    # TINY's decode: a 16-token prompt and 8 new tokens, the step in the middle (24 - 4 = 20 cached)
    step = predict(shape, machine, context=16 + 8 // 2, weights=dtype, dtype=dtype)
    assert (rf["decode_step_MB"] * 1e6, rf["decode_step_GFLOP"] * 1e9) == pytest.approx((step.bytes, step.flops))
    assert rf["bound_tokens_per_s"] == pytest.approx(step.tokens_per_s, rel=1e-12)
    assert rf["bound_is"] == bound_of(step) and rf["compute_bound"] == step.compute_bound()
    assert set(u["decode"]) == set(r["decode"])
    for name, speed in r["decode"].items():  # batch 1: a step per token
        seconds = 1 / speed
        assert u["decode"][name]["MBU"] == pytest.approx(rf["decode_step_MB"] * 1e6 / seconds / bandwidth, rel=1e-12)
        assert u["decode"][name]["MFU"] == pytest.approx(rf["decode_step_GFLOP"] * 1e9 / seconds / peak, rel=1e-12)
        # memory-bound at batch 1: MBU is the fraction of the roofline
        if rf["bound_is"] == "memory" and name != "transformers":
            assert u["decode"][name]["MBU"] == pytest.approx(rf[f"{name}_fraction"], rel=1e-9)
    assert set(u["prefill"]) == set(r["prefill"])
    for n, row in r["prefill"].items():  # the head on the last position, as the engine and transformers run it
        flops = predict(shape, machine, new_tokens=int(n), weights=dtype, dtype=dtype, last_only=True).flops
        assert r["prefill_GFLOP"][n] * 1e9 == pytest.approx(flops, rel=1e-12)
        for name, speed in row.items():
            assert set(u["prefill"][n][name]) == {"MFU"}
            assert u["prefill"][n][name]["MFU"] == pytest.approx(flops / (int(n) / speed) / peak, rel=1e-12)
    assert set(u["batching"]) == set(r["batching"])
    for b, row in r["batching"].items():
        # TINY's decode steps: a 16-token prompt, then 8 and 16 steps (the middle of the second half, 28 cached)
        p = predict(shape, machine, batch=int(b), context=16 + 3 * 8 // 2, weights=dtype, dtype=dtype)
        assert (row["step_MB"] * 1e6, row["step_GFLOP"] * 1e9) == pytest.approx((p.bytes, p.flops), rel=1e-12)
        assert row["bound_tokens_per_s"] == pytest.approx(p.tokens_per_s, rel=1e-12) and row["context"] == 28
        for name, figures in u["batching"][b].items():
            seconds = int(b) / row[name]  # a step makes a token for each of the b rows
            assert figures["MBU"] == pytest.approx(row["step_MB"] * 1e6 / seconds / bandwidth, rel=1e-12)
            assert figures["MFU"] == pytest.approx(row["step_GFLOP"] * 1e9 / seconds / peak, rel=1e-12)
            assert 0 < figures["MBU"] < 100 and 0 < figures["MFU"] < 100


def test_utilization_against_a_datasheet():
    """On a card of `GPUS`, `bench` also reports MBU and MFU against its datasheet: the same formula, other
    roofs (no GPU needed to check the arithmetic and the table). GPT-2 124M in float16, as `bench --device cuda
    --dtype float16` measures it; rows keyed by strings, as read back from bench.json."""
    r = {
        "shape": dataclasses.asdict(SHAPES["GPT-2 124M"]),
        "dtype": "float16",
        "decode": {"engine": 2000.0, "transformers": 1000.0},
        "roofline": {"context": 192, "bound_is": "memory"},
        "prefill": {"128": {"engine": 50_000.0}},
        "batching": {"1": {"engine": 1800.0, "context": 176}},
    }
    peak, bandwidth = gpu_roof("H100 SXM")
    u = {"card": "H100 SXM", "peak_GFLOPs": peak / 1e9, "bandwidth_GBps": bandwidth / 1e9}
    u.update(bench.utilizations(r, peak, bandwidth))
    step = predict(SHAPES["GPT-2 124M"], (peak, bandwidth), context=192)  # float16 weights and activations
    assert 250e6 < step.bytes < 260e6 and 0.24e9 < step.flops < 0.26e9
    assert u["decode"]["engine"]["MBU"] == pytest.approx(2000 * step.bytes / 3.35e12, rel=1e-12)  # 15 %
    prefill = predict(SHAPES["GPT-2 124M"], (peak, bandwidth), new_tokens=128, last_only=True)
    assert u["prefill"][128]["engine"]["MFU"] == pytest.approx(prefill.flops * 50_000 / 128 / 989e12, rel=1e-12)
    measured = {"peak_GFLOPs": 400e3, "bandwidth_GBps": 2500.0, **bench.utilizations(r, 400e12, 2500e9)}
    lines = "\n".join(bench.utilization_table({"measured": measured, "datasheet": u}))
    assert "of H100 SXM (datasheet): 3350 GB/s, 989 TFLOP/s" in lines
    shown = [measured["decode"]["engine"]["MBU"], measured["decode"]["engine"]["MFU"]]
    shown += [u["decode"]["engine"]["MBU"], u["decode"]["engine"]["MFU"]]
    assert [bench.percent(x) for x in shown] == ["20%", "0.13%", "15%", "0.051%"]
    assert re.search(r"decode, batch 1, engine +20% +0\.13% +15% +0\.051%$", lines, re.M), lines


def test_the_documentation_shows_the_commands_tested_here():
    assert documented_commands() == [
        "python -m llmcourse bench",
        "python -m llmcourse bench --gpu-suite",
        "python -m llmcourse bench --gpu-suite --tiny --device cpu",
        "python -m llmcourse bench --http",
        "python -m llmcourse bench --no-compile",
        "python -m llmcourse bench --quantize",
        "python -m llmcourse bench --serving",
        "python -m llmcourse bench --speculative",
        "python -m llmcourse bench --structured",
    ]


# `bench --serving`, `bench --speculative`, `bench --quantize` and `bench --http` run end to end in
# tests/test_serving_bench.py, tests/test_speculative_bench.py, tests/test_quantize_bench.py and
# tests/test_http_bench.py; `bench --gpu-suite` in tests/test_gpu_suite.py, `bench --structured` in
# tests/test_structured_bench.py
@pytest.mark.parametrize(
    "command",
    [
        c
        for c in documented_commands()
        if not c.endswith(("--serving", "--speculative", "--quantize", "--http", "--structured"))
        and "--gpu-suite" not in c
    ],
)
def test_documented_bench_command_runs_end_to_end(command, tmp_path):
    """Each command the pages show, exactly as written (plus the tiny sizes); the compiled one takes 30-60 s."""
    done, r = run_bench(command, tmp_path)
    check_run(done, r, tmp_path, compiled="--no-compile" not in command, transformers=True)


@pytest.mark.parametrize("options", OPTIONS_RUN)
def test_bench_options_run_end_to_end(options, tmp_path):
    out = tmp_path / "a" / "new folder"  # --out creates it
    done, r = run_bench(f"python -m llmcourse bench {options}", out)
    dtype = re.search(r"--dtype (\w+)", options).group(1)
    check_run(done, r, out, compiled=False, transformers="--no-transformers" not in options, dtype=dtype)
    assert r["device"] == "cpu"


def test_every_bench_option_is_run_by_a_test():
    help_text = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", help_text)) - {"--help"}
    assert {"--no-compile", "--no-transformers", "--out", "--device", "--dtype"} <= options
    run = " ".join(documented_commands() + OPTIONS_RUN + TINY + COMPILED_BATCHES + ["--out"])
    assert not {o for o in options if o not in run.split()}, "an option of `bench --help` that no test runs"


def report(tmp_path, monkeypatch, results: dict, **failing) -> tuple[int, Path]:
    """`bench.main` on canned measurements, with some of its reporting steps made to fail."""
    import argparse

    from llmcourse.__main__ import build_parser

    monkeypatch.undo()  # the failures of an earlier call
    measured = {k: v for k, v in results.items() if k != "ratios"}  # what `run` returns
    monkeypatch.setattr(bench, "run", lambda **kw: json.loads(json.dumps(measured)))
    for name in failing:
        monkeypatch.setattr(bench, name, lambda *a, **kw: 1 / 0)
    args = build_parser().parse_args(["bench", "--out", str(tmp_path)])
    assert isinstance(args, argparse.Namespace)
    return bench.main(args), tmp_path / "bench.json"


def test_a_failing_table_or_figure_loses_no_measurement(tmp_path, monkeypatch, capsys):
    results = json.loads((ROOT / "images" / "bench.json").read_text())
    status, path = report(tmp_path, monkeypatch, results, plot=True)
    out, err = capsys.readouterr()
    assert status == 1 and "ZeroDivisionError" in err and f"the measurements are in {path}" in err
    assert "decode, batch 1" in out  # the table was printed before the figures failed
    assert json.loads(path.read_text())["decode"] == results["decode"]
    status, path = report(tmp_path, monkeypatch, results, table=True, ratios=True)
    out, err = capsys.readouterr()
    assert status == 1 and err.count("could not produce") == 2
    assert json.loads(path.read_text())["decode"] == results["decode"]
    assert all((tmp_path / name).exists() for name in FIGURES.values())  # the figures still came


@pytest.mark.parametrize("drop", ["engine_compiled", "transformers", "both"])
def test_table_and_figures_without_compiled_or_transformers_rows(drop, tmp_path):
    """The --no-compile crash: the figures read a compiled row that was never measured."""
    r = json.loads((ROOT / "images" / "bench.json").read_text())
    if "engine_compiled" not in r["decode"]:  # measured with --no-compile: make up compiled rows
        r["decode"]["engine_compiled"] = 1.1 * r["decode"]["engine"]
        r["roofline"]["engine_compiled_fraction"] = 1.1 * r["roofline"]["engine_fraction"]
        for v in r["batching"].values():
            v["engine_compiled"], v["engine_compiled_fraction"] = 1.5 * v["engine"], 1.5 * v["engine_fraction"]
    assert "transformers" in r["decode"]
    for name in ["engine_compiled", "transformers"] if drop == "both" else [drop]:
        r["decode"].pop(name, None)
        r["roofline"].pop(f"{name}_fraction", None)
        for section in ("prefill", "batching"):
            for v in r[section].values():
                v.pop(name, None)
                v.pop(f"{name}_fraction", None)
    r.pop("ratios")
    r["ratios"] = bench.ratios(r)
    assert ("compiled" in bench.table(r)) == (drop == "transformers")
    assert [p.name for p in bench.plot(r, tmp_path)] == list(FIGURES.values())


def test_the_benchmarks_page_shows_the_figures_bench_writes():
    """benchmarks.md shows every figure of images/bench.json, which is what `bench` writes today."""
    page = (ROOT / "benchmarks.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\(images/([^)]+)\)", page)
    # `--serving`, `--speculative`, `--quantize`, `--http`, `--structured`
    assert shown == [
        *FIGURES.values(),
        "bench_serving.png",
        "bench_speculative.png",
        "bench_quantize.png",
        "bench_http.png",
        "bench_structured.png",
    ]
    r = json.loads((ROOT / "images" / "bench.json").read_text())
    for name in shown:
        assert png_size(ROOT / "images" / name)[0] >= 600
    # the committed measurements have today's schema: the table and the figures read them
    assert bench.table(r) and set(r["ratios"]) == set(bench.ratios(r))
    # the page names the machine they come from
    m = r["machine"]
    assert f"{m['llc_MB']:.0f} MB" in page and f"{m['cores']} " in page


def test_the_last_level_cache_is_found():
    if not Path("/sys/devices/system/cpu/cpu0/cache").is_dir():
        pytest.skip("no sysfs cache information here")
    level, size = common.last_level_cache()
    assert level >= 2 and 2**20 <= size <= 2**34
    m = common.machine(resolve_device("cpu"), 500 * 10**6)
    assert m["llc_MB"] == size / 2**20 and m["weights_fit_in_llc"] == (size >= 500 * 10**6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_matmul_throughput_is_measured_quickly_in_every_dtype(dtype):
    """float16 products on a CPU without float16 arithmetic are slow: a 2048-wide one takes minutes."""
    import time

    import torch

    start = time.perf_counter()
    assert common.measure_matmul(torch.device("cpu"), getattr(torch, dtype), repeats=1) > 0
    assert time.perf_counter() - start < 20


def test_a_gpt2_small_decode_step_in_the_bench():
    """The bench's step of GPT-2 124M in float32 (`predict_step`): its 123.5M matrix weights read once per step
    (the tied head once; biases, norms and the position table left out), each row's KV cache beside them, and the
    rows' activations; a batch shares the weights."""
    r = {"shape": dataclasses.asdict(ModelShape.of(GPT2Config())), "dtype": "float32"}
    machine = (188e9, 20.5e9)
    empty = bench.predict_step(r, machine, context=0)
    assert 4 * 123_532_032 < empty.bytes < 4 * 123_532_032 * 1.005
    assert empty.flops == pytest.approx(2 * 123_532_032, rel=0.01)  # a multiply-add per weight
    cached = bench.predict_step(r, machine, context=1000)
    cache = 4 * 2 * 12 * 1000 * 768  # K and V, 12 layers, 1000 positions
    assert cached.bytes - empty.bytes == cache
    sixteen = bench.predict_step(r, machine, batch=16, context=1000)
    weights = bench.predict_step(r, machine, batch=0, context=1000).bytes  # no rows: the weights alone
    assert sixteen.bytes - weights == 16 * (cached.bytes - weights)  # the weights once, a cache per row
    assert sixteen.flops == pytest.approx(16 * cached.flops, rel=1e-12)


def test_bound_of_names_the_limit_of_a_step_judged_kernel_by_kernel():
    """memory at batch 1; mixed when the weight products turn compute-bound and attention (each row reading its own
    cache) does not; compute when every kernel that does arithmetic is (the elementwise ones, no FLOPs counted,
    always wait on memory)."""
    shape = SHAPES["GPT-2 124M"]
    assert bound_of(predict(shape, (188e9, 20.5e9), context=192)) == "memory"
    mixed = predict(shape, (188e9, 20.5e9), batch=256, context=192)
    assert bound_of(mixed) == "mixed" and mixed.compute_bound() == ["q", "k", "v", "o", "up", "down", "head"]
    assert bench.bound_text({"bound_is": "mixed", "compute_bound": mixed.compute_bound()}) == (
        "mixed: q, k, v, o, up, down, head compute-bound"
    )
    prefill = predict(shape, (188e9, 1e15), new_tokens=1024)  # all but the elementwise kernels compute-bound
    assert bound_of(prefill) == "compute" and "elementwise" not in prefill.compute_bound()


def test_bad_bench_option_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", "--batch-sizes", "1,x"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "comma-separated integers" in out.stderr
