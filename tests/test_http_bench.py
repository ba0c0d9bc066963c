"""The HTTP benchmark (`python -m llmcourse bench --http`): its metrics on hand-made timelines, its clients, and the
benchmark end to end on quick sizes against the real server in a subprocess (the same greedy text over HTTP as
in-process, every token counted). No timing is asserted: only that the figures exist, are computed right and are
sane."""

import asyncio
import json
import math
import re
import struct
import sys
from pathlib import Path

import pytest

from llmcourse.bench import http as hb

ROOT = Path(__file__).resolve().parent.parent
LEVELS = [1, 3]  # 3 clients for 8 requests: the last client sends fewer
METRICS = ("tokens_per_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------- metrics


def test_summary_of_a_hand_made_timeline():
    runs = [
        [hb.Stream(0.0, [0.5, 0.6, 0.8], 3), hb.Stream(0.2, [0.4, 0.7], 2)],  # TTFT 0.5, 0.2; gaps .1 .2 .3
        [hb.Stream(5.0, [6.0, 6.5], 3)],  # its own run (1 s of wall time); a chunk that carried 2 tokens
    ]
    s = hb.summary(runs)
    assert s["runs"] == 2 and s["requests"] == 3 and s["output_tokens"] == 8 and s["chunks"] == 7
    assert s["wall_s"] == pytest.approx(0.8 + 1.5)  # each run from its first request sent to its last token
    assert s["tokens_per_s"] == pytest.approx(8 / 2.3)
    assert s["ttft_p50_ms"] == pytest.approx(500)  # of 200, 500, 1000
    assert s["ttft_p99_ms"] == pytest.approx(500 + 500 * 0.98)
    assert s["itl_p50_ms"] == pytest.approx(250)  # of 100, 200, 300, 500: pooled over the requests
    assert s["itl_p99_ms"] == pytest.approx(300 + 200 * 0.97)


def test_a_timeline_without_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        hb.summary([[hb.Stream(0.0, [], 0)]])
    with pytest.raises(ValueError, match="every run needs a request"):
        hb.summary([[]])


def test_prompts_are_seeded_random_token_ids():
    p = hb.prompts(5, 7, 100, seed=3)
    assert p == hb.prompts(5, 7, 100, seed=3) != hb.prompts(5, 7, 100, seed=4)
    assert len(p) == 5 and all(len(x) == 7 and all(0 <= t < 100 for t in x) for x in p)


@pytest.mark.parametrize("concurrency", [1, 3, 8, 20])
def test_drive_keeps_each_client_busy_back_to_back(concurrency):
    """`concurrency` clients at once (never more), every item once, results in the items' order."""
    running, most, started = 0, 0, []

    async def one(item):
        nonlocal running, most
        running += 1
        most = max(most, running)
        started.append(item)
        await asyncio.sleep(0.001 * (item % 3))
        running -= 1
        return hb.Stream(float(item), [float(item)], 1)

    results = asyncio.run(hb.drive(list(range(10)), concurrency, one))
    assert [r.sent for r in results] == list(range(10)) and sorted(started) == list(range(10))
    assert most == min(concurrency, 10)


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def results():
    """The whole benchmark on the bundled model, quick sizes: the server started, warmed, 2 levels, stopped."""
    lines = []
    r = hb.run(hb.MODEL, LEVELS, device="cpu", sizes=hb.QUICK, progress=lines.append)
    r["ratios"] = hb.ratios(r)
    return r, lines


def test_both_systems_serve_every_token_and_the_same_text(results):
    r, lines = results
    s = hb.QUICK
    assert r["model"] == hb.MODEL and r["device"] == "cpu" and r["machine"]["cpu"]
    assert r["engine"]["max_num_seqs"] == 32  # the server's default
    assert [level["concurrency"] for level in r["levels"]] == LEVELS
    for level in r["levels"]:
        for system in ("http", "inprocess"):
            v = level[system]
            assert v["requests"] == s.requests * s.repeats, system
            assert v["output_tokens"] == s.requests * s.repeats * s.max_tokens, system  # ignore_eos: all of them
            assert v["chunks"] <= v["output_tokens"], system
            for key in METRICS:
                assert isinstance(v[key], float) and math.isfinite(v[key]) and v[key] > 0, (system, key, v)
            assert v["ttft_p50_ms"] <= v["ttft_p99_ms"] and v["itl_p50_ms"] <= v["itl_p99_ms"]
        assert level["inprocess"]["chunks"] == level["inprocess"]["output_tokens"]  # in-process: one per token
        h, i = level["http"], level["inprocess"]
        if sys.platform == "linux":  # CPU time: the server's from /proc, the clients' and in-process this process's
            assert h["server_cpu_s"] > 0 and h["client_cpu_s"] > 0 and i["cpu_s"] > 0
            assert h["cpu_s"] == h["server_cpu_s"] + h["client_cpu_s"]
        # greedy: the text each HTTP client got is the in-process tokens decoded, for every request
        assert level["same_text"] == s.requests * s.repeats
    assert any("starting the server" in line for line in lines)


def test_ratios_table_and_figure(results, tmp_path):
    r, _ = results
    for q, level in zip(r["ratios"], r["levels"]):
        assert q["concurrency"] == level["concurrency"]
        assert q["tokens_per_s"] == level["http"]["tokens_per_s"] / level["inprocess"]["tokens_per_s"]
        assert q["ttft_p50_ms"] == level["http"]["ttft_p50_ms"] / level["inprocess"]["ttft_p50_ms"]
        assert all(0 < v < 1e6 for v in q.values() if v is not None)
        if sys.platform == "linux":
            assert q["cpu_per_token"] > 0
    text = hb.table(r)
    first = r["ratios"][0]
    assert re.search(rf"^ +1  HTTP +{r['levels'][0]['http']['tokens_per_s']:.0f} ", text, re.M), text
    assert f"HTTP / in     {first['tokens_per_s']:.2f}x" in text
    total = hb.QUICK.requests * hb.QUICK.repeats * len(LEVELS)
    assert f"the same text as in-process for {total} of {total} requests" in text
    width, height = png_size(hb.plot(r, tmp_path))
    assert 600 <= width <= 1600 and 0.3 < height / width < 2


def test_bench_http_end_to_end_keeps_the_rest_of_bench_json(results, tmp_path, monkeypatch, capsys):
    """`python -m llmcourse bench --http`, in this process, on the measurements above (`run` is tested there): the
    flags reach it, the JSON keeps the other sections, the table and the figure come."""
    from llmcourse.__main__ import main

    calls = []
    measured = {k: v for k, v in results[0].items() if k != "ratios"}
    monkeypatch.setattr(hb, "run", lambda *a, **kw: calls.append((a, kw)) or json.loads(json.dumps(measured)))
    (tmp_path / "bench.json").write_text(json.dumps({"decode": {"engine": 1.0}}))
    assert main(["bench", "--http", "--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--http", "gpt2-shakespeare", "--out", str(tmp_path)]) == 0
    assert [(a, kw["device"], kw["dtype"]) for a, kw in calls] == [
        ((hb.MODEL, hb.CONCURRENCY), "cpu", "bfloat16"),
        (("gpt2-shakespeare", hb.CONCURRENCY), "auto", "float32"),
    ]
    out, err = capsys.readouterr()
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["decode"] == {"engine": 1.0}  # the other sections stay
    assert r["http"]["levels"] == measured["levels"] and r["http"]["ratios"] == results[0]["ratios"]
    assert "HTTP / in" in out and (tmp_path / hb.FIGURE).exists() and str(tmp_path / hb.FIGURE) in out
    assert not err


def test_a_failing_table_or_figure_loses_no_measurement(results, tmp_path, monkeypatch, capsys):
    measured = {k: v for k, v in results[0].items() if k != "ratios"}
    monkeypatch.setattr(hb, "run", lambda *a, **kw: json.loads(json.dumps(measured)))
    monkeypatch.setattr(hb, "plot", lambda *a: 1 / 0)
    assert hb.main(tmp_path) == 1
    out, err = capsys.readouterr()
    assert "ZeroDivisionError" in err and "the measurements are in" in err and "HTTP / in" in out
    assert json.loads((tmp_path / "bench.json").read_text())["http"]["levels"] == measured["levels"]


def test_http_is_one_of_the_benchmarks_bench_runs_instead():
    from llmcourse.__main__ import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "--http"]).http == hb.MODEL
    assert parse(["bench", "--http", "gpt2-shakespeare"]).http == "gpt2-shakespeare"
    assert getattr(parse(["bench"]), "http", None) is None
    with pytest.raises(SystemExit):
        parse(["bench", "--http", "--serving"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"concurrency": []}, "concurrency levels must be integers >= 1"),
        ({"concurrency": [4, 0]}, "concurrency levels must be integers >= 1"),
        ({"sizes": hb.Sizes(requests=0)}, "every size must be >= 1"),
        ({"sizes": hb.Sizes(prompt_tokens=200, max_tokens=100)}, "do not fit in llama-shakespeare's 256 positions"),
        ({"model": "llama-shakspeare"}, "did you mean 'llama-shakespeare'"),
    ],
)
def test_bad_settings_are_refused_before_the_server_starts(kwargs, message, tmp_path, capsys):
    lines = []
    with pytest.raises(ValueError, match=message):
        hb.run(device="cpu", progress=lines.append, **kwargs)
    assert not lines  # nothing started
    assert hb.main(tmp_path, device="cpu", **kwargs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.split("'")[0] in err and not (tmp_path / "bench.json").exists()


def test_a_server_that_fails_to_start_says_why():
    with pytest.raises(RuntimeError, match=r"the server exited \(\d+\) before answering:\n(.|\n)*no-such-model"):
        with hb.Server("no-such-model", "cpu", "float32"):
            pass


def test_the_benchmarks_page_shows_the_http_figures():
    """benchmarks.md's HTTP section shows bench_http.png and quotes the committed measurements."""
    page = (ROOT / "benchmarks.md").read_text()
    section = page[page.index("## Over HTTP") : page.index("## On a GPU")]
    assert f"](images/{hb.FIGURE})" in section and png_size(ROOT / "images" / hb.FIGURE)[0] >= 600
    assert "python -m llmcourse bench --http" in section
    r = json.loads((ROOT / "images" / "bench.json").read_text())["http"]
    assert r["ratios"] == hb.ratios(r) and hb.table(r)
    for level, q in zip(r["levels"], r["ratios"]):
        h, i = level["http"]["tokens_per_s"], level["inprocess"]["tokens_per_s"]
        row = f"| {level['concurrency']} | {h:,.0f} / {i:,.0f} |"
        assert row in section and f"**{q['tokens_per_s']:.2f}×**" in section, row
    m = r["machine"]
    assert f"{m['cores']} cores of an {m['cpu']}" in section and f"{m['llc_MB']:.0f} MB L3" in section
    assert f"load average {m['load_average']:.1f}" in section
