"""`python -m llmcourse bench --structured`: what a constraint costs a decode step, and the index build beside
outlines-core's, run end to end as documented (one repeat)."""

from __future__ import annotations

import json
import subprocess
import sys

from llmcourse.bench import structured


def test_the_documented_command_measures_every_row(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", "--structured", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = json.loads((tmp_path / "bench.json").read_text())["structured"]
    rows = r["overhead"]
    assert [(row["model"], row["batch"]) for row in rows] == [(m, b) for m in structured.MODELS for b in (1, 16)]
    for row in rows:
        assert row["free_ms"] > 0 and row["constrained_ms"] > 0
        assert row["overhead"] == structured.overhead(row["constrained_ms"], row["free_ms"])
    build = r["build"]
    assert build["states"] > 1000 and build["engine_s"] > 0 and build["outlines_core_s"] > 0
    assert "outlines-core" in done.stdout and "overhead" in done.stdout
    assert (tmp_path / structured.FIGURE).stat().st_size > 10_000


def test_the_benchmarks_page_shows_the_committed_measurements():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    page = (root / "benchmarks.md").read_text()
    section = page[page.index("## Structured output") : page.index("## On a GPU")]
    assert f"](images/{structured.FIGURE})" in section and (root / "images" / structured.FIGURE).exists()
    r = json.loads((root / "images" / "bench.json").read_text())["structured"]
    for row in r["overhead"]:
        line = f"| {row['model']} | {row['batch']} | {row['free_ms']:.2f} ms | {row['constrained_ms']:.2f} ms |"
        assert line + f" {row['overhead']:+.1%} |" in section, line
        assert row["overhead"] < 0.10  # the goal
    build = r["build"]
    assert f"{build['engine_s']:.2f} s" in section and f"{build['outlines_core_s']:.2f} s" in section
    assert f"{build['states']:,}" in section and f"{build['engine_s'] / build['outlines_core_s']:.2f}×" in section
