"""A correct solution passes its checks on a busy machine: the checks limit the CPU time a learner's function
uses, not the time on the wall (llmcourse/course/limits.py).

In the default run, the solutions of chapters 03, 07 and 12 run their checks, visible and hidden parts, as a
student's submission runs them, pinned to one core with a process beside them that computes for ever: they get
at most half a core (on a shared JupyterHub node they got about that), and the suite's other worker keeps the
other core busy. Each check must pass (chapter 12's modes on 2 hidden prompts of 8 tokens). Chapter 12's engine is
made of the solutions' own functions; which of a learner's functions the capstone uses is decided by their chapter's
checks (`your_pieces`), chapter 07's among them, which is the check that once showed a red ✗ on the book's chapter
12 page when built on a busy machine. A learner's endless loop is stopped by its CPU limit on that core.

Marked `under_load` and left out of the default run (about 6 minutes): the sweep over every chapter, each chapter's
checks (chapter 12's whole, with `your_pieces`) idle and then with every core busy (one process more than there are
cores), printing their CPU and wall time, and a `time.sleep(3600)` stopped by the wall ceiling on those cores:
`pytest -m under_load -n 0 -s tests/test_under_load.py`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmcourse.checks import Case, capstone, run_check
from llmcourse.checks.harness import isolate
from llmcourse.course.failed import CheckFailed
from llmcourse.course.learner import CHAPTER_OF, ENGINE_SLOTS, Pieces, pieces_of, your_pieces
from llmcourse.course.limits import wall_ceiling
from tests.notebook_checks import notebook_cells

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())


@contextlib.contextmanager
def busy_cores(n: int = (os.cpu_count() or 1) + 1, *, pinned: bool = False):
    """`n` processes that compute for ever, at the same priority as the checks, until the block ends; `pinned`: this
    process (and the checks' children it forks) and the `n` share one core."""
    allowed = os.sched_getaffinity(0)
    core = {min(allowed)}
    if pinned:
        os.sched_setaffinity(0, core)
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin, preexec_fn=(lambda: os.sched_setaffinity(0, core)) if pinned else None)
                for _ in range(n)]  # fmt: skip
    try:
        time.sleep(0.2)  # they are running
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, allowed)


@contextlib.contextmanager
def in_folder(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def checks_of(chapter: str, solutions: Path) -> list[str]:
    """The chapter's check cells run on its solutions, in order, as a kernel started in its folder runs them:
    each cell's printed output. Chapter 12's `pieces` are `your_pieces` of the solution chapters beside it."""
    setup, exercises, checks = notebook_cells(solutions / chapter / f"{chapter}.ipynb")
    namespace: dict = {"__name__": "__main__"}
    outputs = []
    with in_folder(solutions / chapter):
        for source in setup + exercises:
            exec(compile(source, f"<{chapter}>", "exec"), namespace)
        if chapter == "12_capstone":
            namespace["pieces"] = solution_pieces(solutions)
        for source in checks:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(source, f"<{chapter} check>", "exec"), namespace)
            outputs.append(printed.getvalue())
    return outputs


def solution_pieces(solutions: Path) -> Pieces:
    """The engine with every slot filled by the solutions' own functions (their setup and exercise cells run, not
    their checks: `your_pieces` would run those, which the sweep does)."""
    functions: dict = {}
    for chapter in sorted({CHAPTER_OF[slot] for slot in ENGINE_SLOTS if slot in CHAPTER_OF}):
        setup, exercises, _ = notebook_cells(solutions / chapter / f"{chapter}.ipynb")
        namespace: dict = {"__name__": "__main__"}
        with in_folder(solutions / chapter), contextlib.redirect_stdout(io.StringIO()):
            for source in setup + exercises:
                exec(compile(source, f"<{chapter}>", "exec"), namespace)
        functions |= {slot: namespace[slot] for slot in ENGINE_SLOTS if CHAPTER_OF.get(slot) == chapter}
    return pieces_of(functions, notify=lambda line: None)


@pytest.fixture(scope="module")
def solutions(tmp_path_factory) -> Path:
    """A copy of solutions/: `your_pieces` reads chapter notebooks from a folder, and nothing here may write
    into the repository."""
    copy = tmp_path_factory.mktemp("load") / "solutions"
    shutil.copytree(ROOT / "solutions", copy)
    return copy


def timed(chapter: str, solutions: Path) -> tuple[list[str], float, float]:
    """The chapter's check outputs, and the CPU time (this process and the checks' children) and wall time."""
    before, start = os.times(), time.monotonic()
    outputs = checks_of(chapter, solutions)
    after = os.times()
    cpu = sum(after[:4]) - sum(before[:4])
    return outputs, cpu, time.monotonic() - start


def assert_all_pass(chapter: str, outputs: list[str]) -> None:
    for output in outputs:
        assert "✗" not in output and "✓" in output, f"{chapter}: {output}"


@pytest.mark.parametrize("chapter", ["03_attention", "07_batching", "12_capstone"])
def test_the_solutions_pass_their_checks_on_a_busy_core(chapter, solutions, monkeypatch, request):
    if chapter == "12_capstone":  # each mode on 2 hidden prompts of 8 tokens, as tests/test_checks_capstone.py runs
        monkeypatch.setattr(capstone, "NEW_TOKENS", 8)  # them: the same limits and verdicts in a third of the time
        monkeypatch.setattr(capstone, "PROMPTS", 2)  # (the marked sweep runs the whole check)
        capstone.hidden_prompts.cache_clear()
        request.addfinalizer(capstone.hidden_prompts.cache_clear)  # before monkeypatch restores the sizes
    with busy_cores(1, pinned=True):
        outputs, cpu, wall = timed(chapter, solutions)
    assert_all_pass(chapter, outputs)
    print(f"{chapter}: {len(outputs)} check cells passed under load, {cpu:.1f} CPU-s, {wall:.1f} s on the wall")


@pytest.mark.under_load
def test_every_chapter_passes_its_checks_idle_and_with_every_core_busy(solutions, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "solution_pieces", lambda folder: your_pieces(folder, notify=print))
    rows = []
    for chapter in CHAPTERS:
        idle, cpu_idle, wall_idle = timed(chapter, solutions)
        assert_all_pass(chapter, idle)
        with busy_cores():
            loaded, cpu_loaded, wall_loaded = timed(chapter, solutions)
        assert_all_pass(chapter, loaded)
        rows.append((chapter, cpu_idle, wall_idle, cpu_loaded, wall_loaded))
    print("\n| chapter | idle: CPU-s | idle: wall s | loaded: CPU-s | loaded: wall s |\n|---|---|---|---|---|")
    for chapter, *figures in rows:
        print(f"| {chapter} | " + " | ".join(f"{x:.1f}" for x in figures) + " |")


def endless(x):
    while True:
        pass


def isolated_check(fn):
    """A check as every exported one runs: in a child process, with a limit of 0.5 CPU-s per call."""
    return isolate.isolated(lambda: run_check("f", fn, [Case("a case", (1,), 1)], seconds=0.5))()


def test_an_endless_loop_is_stopped_by_its_cpu_limit_on_a_busy_core():
    """Under the same load, a learner's endless loop is stopped when it has used its CPU time (at half a core, twice
    that on the wall), and the caller goes on."""
    with busy_cores(1, pinned=True):
        before = os.times()
        with pytest.raises(CheckFailed, match=r"did not finish within its 0.5 CPU-s: it was stopped after using 0.5"):
            isolated_check(endless)
        after = os.times()  # the child's CPU time, counted in children_* once it was waited for
        assert 0.5 <= after.children_user + after.children_system - before.children_user - before.children_system < 1.5
        isolated_check(lambda x: x)


@pytest.mark.under_load
def test_a_long_sleep_is_stopped_by_the_wall_ceiling_on_busy_cores():
    """`time.sleep(3600)` uses no CPU time: the wall ceiling (`wall_ceiling`: 21.5 s for a limit of 0.5 CPU-s) stops
    it, with every core busy, and says that it waits. (In the default run: tests/test_checks_core.py, with a 1 s
    ceiling.)"""
    with busy_cores():
        start = time.monotonic()
        with pytest.raises(CheckFailed, match=r"did not finish within 21.5 s on the wall[\s\S]*waits rather than"):
            isolated_check(lambda x: time.sleep(3600))
        assert wall_ceiling(0.5) == 21.5 and 21.5 <= time.monotonic() - start < 21.5 + 3 + 5
