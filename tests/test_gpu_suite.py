"""`python -m llmcourse bench --gpu-suite`: the prepared GPU check's logic, on a tiny model on the CPU (its figures
mean nothing here; on a lent GPU the same code measures the 8B- and 1B-shaped models)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmcourse.bench import gpu_suite

COMMAND = "python -m llmcourse bench --gpu-suite --tiny --device cpu"  # README.md shows it


def test_the_documented_tiny_check_runs_every_section(tmp_path):
    done = subprocess.run(
        [sys.executable, *COMMAND.split()[1:], "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "bench.json").read_text())["gpu_suite"]
    sections = r["sections"]
    assert list(sections) == ["decode", "tests", "batches", "engine", "paged attention", "capstone"]
    assert all("rows" in s for s in sections.values()), sections
    tests = sections["tests"]["rows"][0]
    assert tests["returncode"] == 0 and "skipped" in tests["summary"]  # the CUDA tests, skipped on a CPU
    decode = sections["decode"]["rows"]
    assert [row["format"] for row in decode] == ["float32", "int8", "int4"]
    bandwidth = r["machine"]["bandwidth_GB_s"] * 1e9
    for row in decode:
        assert row["tokens_per_s"] > 0
        assert row["MBU"] == pytest.approx(row["GB_per_step"] * 1e9 * row["tokens_per_s"] / bandwidth)
    assert decode[1]["GB_per_step"] < decode[0]["GB_per_step"] / 2  # int8 reads a quarter of float32's weights
    assert [row["batch"] for row in sections["batches"]["rows"]] == list(gpu_suite.SMALL.batches)
    eager, graphs = sections["engine"]["rows"]
    assert graphs["same_tokens"] is True and graphs["buckets"] == [gpu_suite.SMALL.requests]
    paged = sections["paged attention"]["rows"]
    assert len(paged) == 4 and all(row["max_error"] < 1e-4 for row in paged)
    assert "decode tok/s" in sections["capstone"]["rows"][0]["table"]
    page = (tmp_path / "gpu_suite.md").read_text()
    assert "| model | format | batch | tokens_per_s | GB_per_step | MBU | seconds |" in page
    assert "**paged attention**" in page and "FlexAttention over the pool" in page


def test_sections_that_would_start_late_are_listed_not_run():
    r = gpu_suite.run("cpu", tiny=True, budget=0)
    assert all("skipped" in s and "not started" in s["skipped"] for s in r["sections"].values())
    assert "not run: not started" in gpu_suite.markdown(r)


def test_a_failing_section_is_reported_and_the_rest_still_run(monkeypatch, tmp_path):
    for name in ("tests_section", "decode_section", "batch_section", "engine_section", "capstone_section"):
        monkeypatch.setattr(gpu_suite, name, lambda *a, **k: [dict(ok=1)])
    monkeypatch.setattr(gpu_suite, "paged_section", lambda *a, **k: 1 / 0)
    assert gpu_suite.main(tmp_path, device="cpu", tiny=True) == 1
    r = json.loads((tmp_path / "bench.json").read_text())["gpu_suite"]["sections"]
    assert r["paged attention"] == {"error": "ZeroDivisionError: division by zero"}
    assert r["capstone"]["rows"] == [dict(ok=1)]
    assert "failed: ZeroDivisionError" in (tmp_path / "gpu_suite.md").read_text()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpu-suite", "--device", "cpu"], "the GPU check needs a CUDA device; --tiny runs its logic"),
        (["--tiny"], "--tiny goes with --gpu-suite"),
    ],
)
def test_the_check_says_what_it_needs(flags, message, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", *flags, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
