"""The serving benchmark (`python -m llmcourse bench --serving`): its metrics on hand-made timelines, its
workloads, its two runners against `generate` (the same tokens), and the command end to end on the tiny
configuration. No timing is asserted: only that the figures exist, are computed right and are sane."""

import json
import math
import os
import random
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmcourse.bench import serving as sb
from llmcourse.bench.common import CONFIGS
from llmcourse.engine.generate import generate
from llmcourse.engine.model import GPT2

ROOT = Path(__file__).resolve().parent.parent
RATIOS = {
    "continuous_vs_static_throughput",
    "static_vs_continuous_ttft_p50",
    "static_vs_continuous_tpot_p50",
    "prefix_cache_ttft_p50_speedup",
    "prefix_cache_ttft_p99_speedup",
}


@pytest.fixture(scope="module")
def tiny():
    return GPT2(CONFIGS["tiny"]).init_weights(0).eval().requires_grad_(False)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------- metrics


def test_summary_of_a_hand_made_timeline():
    records = [
        sb.Record(arrival=0.0, token_times=[0.5, 0.6, 0.8], tokens=[1, 2, 3]),  # TTFT 0.5, TPOT 0.15
        sb.Record(arrival=1.0, token_times=[1.2, 1.3], tokens=[4, 5]),  # TTFT 0.2, TPOT 0.1
        sb.Record(arrival=1.5, token_times=[2.5], tokens=[6]),  # TTFT 1.0, no TPOT (one token)
    ]
    s = sb.summary(records)
    assert s["requests"] == 3 and s["output_tokens"] == 6
    assert s["wall_s"] == pytest.approx(2.5)  # first arrival to last token
    assert s["tokens_per_s"] == pytest.approx(6 / 2.5)
    assert s["ttft_p50_ms"] == pytest.approx(500)  # of 200, 500, 1000
    assert s["ttft_p99_ms"] == pytest.approx(500 + (1000 - 500) * 0.98)  # rank 0.99 * 2 = 1.98
    assert s["tpot_p50_ms"] == pytest.approx(125)  # of 100, 150
    assert s["tpot_p99_ms"] == pytest.approx(100 + 50 * 0.99)


def test_the_wall_time_starts_at_the_first_arrival_not_at_zero():
    s = sb.summary([sb.Record(2.0, [3.0, 4.0], [1, 2]), sb.Record(2.5, [3.0], [3])])
    assert s["wall_s"] == pytest.approx(2.0) and s["tokens_per_s"] == pytest.approx(1.5)


def test_a_timeline_without_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        sb.summary([sb.Record(0.0, [], [])])
    with pytest.raises(ValueError, match="one time per token"):
        sb.summary([sb.Record(0.0, [1.0], [1, 2])])


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_percentile_is_numpys_linear_one(n):
    values = [random.Random(n).expovariate(1.0) for _ in range(n)]
    for q in (0, 50, 90, 99, 100):
        assert sb.percentile(values, q) == pytest.approx(np.percentile(values, q))


# ---------------------------------------------------------------------------------------------- workloads


def test_mixed_workload_is_seeded_spread_and_fits_the_model():
    w = sb.mixed_workload(200, vocab_size=1000, n_positions=256, rate=5.0, seed=3)
    assert w == sb.mixed_workload(200, vocab_size=1000, n_positions=256, rate=5.0, seed=3)
    assert w != sb.mixed_workload(200, vocab_size=1000, n_positions=256, rate=5.0, seed=4)
    prompts, outputs = [len(p) for p in w.prompts], w.max_new_tokens
    assert all(p + o <= 256 for p, o in zip(prompts, outputs)) and w.longest <= 256
    assert all(0 <= t < 1000 for p in w.prompts for t in p)
    for lengths in (prompts, outputs):  # a long tail: most short, some several times the median
        assert max(lengths) > 2.5 * np.median(lengths) and min(lengths) < np.median(lengths) / 2
    gaps = np.diff(w.arrivals)
    assert w.arrivals[0] == 0.0 and (gaps > 0).all()
    assert 1 / 5.0 * 0.7 < gaps.mean() < 1 / 5.0 * 1.3  # exponential gaps of mean 1 / rate
    assert 0.7 < gaps.std() / gaps.mean() < 1.3  # an exponential's spread equals its mean


def test_shared_prefix_workload_shares_the_system_prompt():
    sizes = sb.sizes_for(256)
    w = sb.shared_prefix_workload(20, vocab_size=1000, n_positions=256, rate=2.0, seed=0, sizes=sizes)
    system = w.prompts[0][: sizes.system_len]
    assert all(p[: sizes.system_len] == system for p in w.prompts)
    assert len({tuple(p[sizes.system_len :]) for p in w.prompts}) == 20  # the user parts differ
    assert all(len(p) + n <= 256 for p, n in zip(w.prompts, w.max_new_tokens))


def test_sizes_fit_every_context():
    for n_positions in (64, 128, 256, 1024):
        for quick in (False, True):
            s = sb.sizes_for(n_positions, quick)
            assert s.prompt_max + s.output_max <= n_positions and s.system_len + s.prefix_output < n_positions
            assert s.requests >= (16 if quick else 64)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_a_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match="arrival rate must be > 0"):
        sb.poisson_arrivals(random.Random(0), 3, rate)


# ---------------------------------------------------------------------------------------------- runners


def small_workload() -> sb.Workload:
    rng = random.Random(1)
    prompts = [[rng.randrange(CONFIGS["tiny"].vocab_size) for _ in range(n)] for n in (5, 17, 3, 30, 9, 12, 40)]
    return sb.Workload(prompts, [6, 1, 11, 4, 9, 2, 7], [0.0, 0.0, 0.001, 0.002, 0.01, 0.02, 0.03])


def check_timeline(records: list, w: sb.Workload) -> None:
    for r, a, n in zip(records, w.arrivals, w.max_new_tokens):
        assert r.arrival == a and len(r.tokens) == len(r.token_times) == n
        assert r.token_times[0] >= a and r.token_times == sorted(r.token_times)


def test_both_systems_give_each_request_its_own_greedy_tokens(tiny):
    """Static batching (padded, run to the batch's longest output) and the engine (a pool smaller than the
    workload, so that requests wait for blocks): the tokens `generate` gives each request alone."""
    w = small_workload()
    alone = [generate(tiny, p, max_new_tokens=n, eos_token_id=None) for p, n in zip(w.prompts, w.max_new_tokens)]
    static = sb.run_static(tiny, w, batch_size=3)
    check_timeline(static, w)
    assert [r.tokens for r in static] == alone
    records, stats = sb.run_engine(tiny, w, block_size=8, num_blocks=10, max_num_seqs=3, max_num_batched_tokens=16)
    check_timeline(records, w)
    assert [r.tokens for r in records] == alone
    assert stats["steps"] >= max(w.max_new_tokens) and stats["computed_tokens"] >= sum(map(len, w.prompts))


def test_a_static_batch_waits_for_its_last_request_and_the_previous_batch(tiny):
    w = sb.Workload([[1, 2], [3], [4, 5, 6]], [2, 2, 2], [0.0, 0.3, 0.05])
    records = sb.run_static(tiny, w, batch_size=2)
    # arrival order: requests 0 and 2 form the first batch, which waits for request 2 (0.05 s)
    assert records[0].token_times[0] >= 0.05 and records[0].token_times == records[2].token_times
    assert records[1].token_times[0] >= 0.3  # the second batch: request 1 alone


def test_the_engine_adds_each_request_when_it_arrives(tiny):
    w = sb.Workload([[1, 2, 3], [4, 5]], [3, 3], [0.0, 0.2])
    records, stats = sb.run_engine(tiny, w, max_num_seqs=4)
    assert records[1].token_times[0] >= 0.2  # not before it arrived, however fast the engine is
    assert [len(r.tokens) for r in records] == [3, 3] and 3 <= stats["steps"] <= 6


def test_bad_batch_size_is_refused(tiny):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        sb.run_static(tiny, small_workload(), batch_size=0)


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_results():
    """The whole benchmark on the tiny configuration, quick sizes (a few seconds)."""
    lines = []
    r = sb.run(["tiny"], device="cpu", quick=True, progress=lines.append)
    r["ratios"] = sb.ratios(r)
    return r, lines


def test_the_benchmark_measures_every_figure(tiny_results):
    r, lines = tiny_results
    assert r["device"] == "cpu" and r["machine"]["cpu"] and set(r["models"]) == {"tiny"}
    m = r["models"]["tiny"]
    sizes = m["sizes"]
    mixed, prefix = m["mixed"], m["prefix"]
    assert mixed["same_tokens"] is True  # greedy: both systems gave every request the same tokens
    assert mixed["static"]["requests"] == mixed["engine"]["requests"] == sizes["requests"]
    assert mixed["static"]["output_tokens"] == mixed["engine"]["output_tokens"]
    # the same memory: the engine's pool holds the KV positions static batching reserves (to one block)
    assert 0 <= mixed["kv_positions"] - mixed["engine_kv_positions"] < sizes["block_size"]
    for v in (mixed["static"], mixed["engine"], prefix["cached"], prefix["uncached"]):
        for key in ("tokens_per_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert isinstance(v[key], float) and math.isfinite(v[key]) and v[key] > 0, (key, v)
        assert v["ttft_p50_ms"] <= v["ttft_p99_ms"] and v["tpot_p50_ms"] <= v["tpot_p99_ms"]
    # prefix caching served system prompt blocks from the cache, and only with caching on (how many depends on
    # how the arrivals fell: requests admitted in the same step cannot share what is not computed yet)
    assert prefix["cached"]["cached_tokens"] % sizes["block_size"] == 0 and prefix["cached"]["cached_tokens"] > 0
    assert prefix["uncached"]["cached_tokens"] == 0
    assert prefix["cached"]["computed_tokens"] < prefix["uncached"]["computed_tokens"]
    assert any("static batching" in line for line in lines) and any("prefix caching off" in line for line in lines)


def test_ratios_table_and_figure(tiny_results, tmp_path):
    r, _ = tiny_results
    q = r["ratios"]["tiny"]
    m = r["models"]["tiny"]
    assert set(q) == RATIOS and all(0 < v < 1e6 for v in q.values())
    assert (
        q["continuous_vs_static_throughput"]
        == m["mixed"]["engine"]["tokens_per_s"] / m["mixed"]["static"]["tokens_per_s"]
    )
    assert (
        q["prefix_cache_ttft_p50_speedup"]
        == m["prefix"]["uncached"]["ttft_p50_ms"] / m["prefix"]["cached"]["ttft_p50_ms"]
    )
    text = sb.table(r)
    assert f"continuous / static throughput {q['continuous_vs_static_throughput']:.2f}x" in text
    assert f"prefix caching cuts TTFT p50 {q['prefix_cache_ttft_p50_speedup']:.1f}x" in text
    assert "same tokens as static batching: yes" in text
    width, height = png_size(sb.plot(r, tmp_path))
    assert 600 <= width <= 1600 and 0.3 < height / width < 2


def test_bench_serving_end_to_end_keeps_the_rest_of_bench_json(tiny_results, tmp_path, monkeypatch, capsys):
    """`python -m llmcourse bench --serving tiny`, in this process, on the measurements above (`run` is tested
    there): the flags reach it, the JSON keeps the other sections, the table, the ratios and the figure come."""
    from llmcourse.__main__ import main

    calls = []
    measured = {k: v for k, v in tiny_results[0].items() if k != "ratios"}
    monkeypatch.setattr(sb, "run", lambda *a, **kw: calls.append((a, kw)) or json.loads(json.dumps(measured)))
    (tmp_path / "bench.json").write_text(json.dumps({"decode": {"engine": 1.0}}))
    assert main(["bench", "--serving", "tiny", "--device", "cpu", "--dtype", "float16", "--out", str(tmp_path)]) == 0
    assert calls == [((["tiny"],), {"device": "cpu", "dtype": "float16", "quick": False})]
    out, err = capsys.readouterr()
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["decode"] == {"engine": 1.0}  # the other sections stay
    assert set(r["serving"]["models"]) == {"tiny"} and set(r["serving"]["ratios"]["tiny"]) == RATIOS
    assert re.search(r"continuous / static throughput \d+\.\d\dx", out)
    assert re.search(r"prefix caching cuts TTFT p50 \d+\.\dx", out)
    assert (tmp_path / sb.FIGURE).exists() and str(tmp_path / sb.FIGURE) in out
    assert not err


def test_a_failing_table_or_figure_loses_no_measurement(tiny_results, tmp_path, monkeypatch, capsys):
    measured = {k: v for k, v in tiny_results[0].items() if k != "ratios"}
    monkeypatch.setattr(sb, "run", lambda *a, **kw: json.loads(json.dumps(measured)))
    monkeypatch.setattr(sb, "plot", lambda *a: 1 / 0)
    assert sb.main(["tiny"], tmp_path) == 1
    out, err = capsys.readouterr()
    assert "ZeroDivisionError" in err and "the measurements are in" in err and "continuous / static" in out
    assert json.loads((tmp_path / "bench.json").read_text())["serving"]["models"] == measured["models"]


def test_bench_serving_without_a_value_means_both_models():
    from llmcourse.__main__ import build_parser

    assert build_parser().parse_args(["bench", "--serving"]).serving == list(sb.MODELS)
    assert build_parser().parse_args(["bench", "--serving", "tiny, gpt2"]).serving == ["tiny", "gpt2"]
    assert getattr(build_parser().parse_args(["bench"]), "serving", None) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--serving", ""], "expected comma-separated model names"),
        (["--serving", "tiny,"], "expected comma-separated model names"),
    ],
)
def test_bad_serving_flags_are_one_line_errors(args, message, capsys):
    from llmcourse.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_an_unknown_model_is_a_one_line_error_before_anything_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", "--serving", "tiny,gpt2-shakspeare", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "did you mean 'gpt2-shakespeare'" in done.stderr and "serving, tiny" not in done.stdout
    assert not (tmp_path / "bench.json").exists()


def test_the_benchmarks_page_shows_the_serving_figures():
    """benchmarks.md's serving section shows bench_serving.png and quotes the committed measurements."""
    page = (ROOT / "benchmarks.md").read_text()
    serving = page[page.index("## Serving") :]
    assert f"](images/{sb.FIGURE})" in serving and png_size(ROOT / "images" / sb.FIGURE)[0] >= 600
    r = json.loads((ROOT / "images" / "bench.json").read_text())["serving"]
    assert set(r["models"]) == set(sb.MODELS) and r["ratios"] == sb.ratios(r)
    for name, q in r["ratios"].items():
        assert f"{q['continuous_vs_static_throughput']:.2f}×" in serving, name
        assert f"{q['prefix_cache_ttft_p50_speedup']:.1f}×" in serving, name
    assert "python -m llmcourse bench --serving" in serving


def test_the_thread_counts_the_page_compares_are_what_the_runs_use(tmp_path):
    """benchmarks.md's "Threads" section compares the engine's own choice with a count set in the environment; the
    command it shows for that, as written (on the tiny model), records the count it was given, and the engine's
    choice is what `llmcourse.engine.threads` says."""
    page = (ROOT / "benchmarks.md").read_text()
    section = page[page.index("## Threads") : page.index("## Speculative decoding")]
    command = re.search(r"`(OMP_NUM_THREADS=(\d+) python -m llmcourse bench --serving)`", section)
    assert command, "the Threads section shows the command with a thread count"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    variable, args = command.group(1).split(" ", 1)
    done = subprocess.run(
        [sys.executable, *shlex.split(args)[1:], "tiny", "--out", str(tmp_path)],
        env={**env, variable.split("=")[0]: variable.split("=")[1]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "bench.json").read_text())["serving"]["threads"] == int(command.group(2))
    committed = json.loads((ROOT / "images" / "bench.json").read_text())["serving"]
    assert f"{committed['threads']} thread" in section  # the page says which count its figures used
