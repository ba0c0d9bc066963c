"""Every notebook, run once (the course run of tests/course_run.py): the solutions run top to bottom on the current
code with their checked outputs unchanged; the release runs on its stubs, every check failing at its first call;
the committed release is what nbgrader generates.

This is what nbval did, with `--nbval-lax` (cells tagged `nbval-check-output` compared, sanitized as
tests/nbval_sanitize.cfg says) and a strict xfail on every graded and `needs-exercise` cell of chapters/; the runs
are now nbgrader's, which grades the same executions.
"""

import json
import re

import nbformat
import pytest

from llmcourse.course.refresh import failures

from .course_run import (
    CHAPTERS,
    CHECKED,
    ROOT,
    check_calls,
    code_cells,
    comparable,
    errors_in,
    output_difference,
    printed,
    source,
    without_solution_markers,
)
from .release import learner_work


def solution(name):
    return json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text(encoding="utf-8"))


def graded(cell):
    return cell["metadata"].get("nbgrader", {}).get("grade", False)


@pytest.mark.parametrize("name", CHAPTERS)
def test_the_solution_runs_top_to_bottom_with_its_checked_outputs(course_run, name):
    """ada's autograded notebook is the solution notebook (cell for cell, hidden tests included) run on the current
    code: no cell fails, every check call of a cell prints as many ✓ lines as the others (hidden ones included),
    and each cell tagged `nbval-check-output` prints what the solution stores."""
    stored, ran = solution(name), course_run.autograded("ada", name)
    assert [c["id"] for c in code_cells(ran)] == [c["id"] for c in code_cells(stored)]
    shown = failures(ran)  # a ✗, "does not pass" or a traceback anywhere, also in a cell that did not raise
    assert not shown, f"{name}: the solution's run shows a failure:\n" + "\n".join(shown)
    checked = 0
    for want, got in zip(code_cells(stored), code_cells(ran)):
        where = f"{name}, cell {want['id']}:\n{source(want)[:400]}"
        assert without_solution_markers(source(got)) == without_solution_markers(source(want)), where
        errors = errors_in(got, ran)
        assert not errors, f"{where}\nfailed: {errors[0]['ename']}: {errors[0]['evalue']}"
        if graded(want):
            ticks = sum(line.startswith("✓") for line in printed(got).splitlines())
            calls = len(check_calls(without_solution_markers(source(want))))
            assert ticks and ticks % calls == 0, f"{where}\n{calls} checks printed {ticks} ✓ lines:\n{printed(got)}"
        if CHECKED in want["metadata"].get("tags", []) and want.get("execution_count") is not None:
            difference = output_difference(want["outputs"], got["outputs"])
            assert difference is None, (
                f"{where}\nprints something else than the solution stores (refresh it with "
                f"`python -m llmcourse.course.refresh solutions/{name}/{name}.ipynb` if the change is meant):\n"
                f"{difference}"
            )
            checked += 1
    assert checked or name == "12_capstone", "no cell's output is checked"


def test_the_checked_outputs_are_many():
    tagged = sum(CHECKED in c["metadata"].get("tags", []) for name in CHAPTERS for c in code_cells(solution(name)))
    assert tagged >= 90, tagged  # 99 when the suite stopped using nbval


@pytest.mark.parametrize("name", CHAPTERS)
def test_the_release_runs_and_every_check_fails_on_its_stub(course_run, name):
    """bob's autograded notebook is the release run on its stubs: a check cell fails at its first check (it printed
    no ✓: its visible part failed before the hidden one ran), a `needs-exercise` demo fails, every other cell
    runs."""
    ran = course_run.autograded("bob", name)
    for cell in code_cells(ran):
        where = f"{name}, cell {cell['id']}:\n{source(cell)[:400]}"
        errors = errors_in(cell, ran)
        if graded(cell):
            assert errors, f"{where}\npasses on the stubs"
            assert "✓" not in printed(cell), f"{where}\na check passed on the stubs:\n{printed(cell)[-1000:]}"
        elif "needs-exercise" in cell["metadata"].get("tags", []):
            assert errors, f"{where}\nruns on the stubs: it is not a demo that needs an exercise (remove the tag)"
        else:
            assert not errors, f"{where}\nfails on the stubs: {errors[0]['ename']}: {errors[0]['evalue']}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
EMPTY_MESSAGE = re.compile(r"\b\w*(Error|Exception|Warning): *$", re.MULTILINE)  # "raised NotImplementedError: "


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_notice_ends_in_an_empty_message(course_run, name):
    """What a learner reads, on the stubs (bob) and on the solution (ada) — printed notices, check messages and
    errors — never names an exception and then says nothing: a stub's bare NotImplementedError is told as "not
    written yet", an exception without a message as its name alone."""
    for student in ("bob", "ada"):
        ran = course_run.autograded(student, name)
        for cell in code_cells(ran):
            shown = "\n".join(line for e in errors_in(cell, ran) for line in e.get("traceback", []))  # as shown
            said = printed(cell) + "\n" + ANSI.sub("", shown)
            empty = [line for line in said.splitlines() if EMPTY_MESSAGE.search(line)]
            assert not empty, f"{name} ({student}), cell {cell['id']}:\n{source(cell)[:300]}\nsays: {empty[0]!r}"


@pytest.mark.parametrize("name", CHAPTERS)
def test_on_the_stubs_every_failing_demo_names_the_exercise_to_write(course_run, name):
    """Run All on the release: a demo or figure that needs an exercise says which one is not written yet (the stub's
    one line, or the engine's notice for a part), never a KeyError or NameError over results that an earlier demo,
    stopped by the same stub, never made (chapter 11's GQA figure and chapter 09's SmoothQuant figures did)."""
    ran = course_run.autograded("bob", name)
    for cell in code_cells(ran):
        if graded(cell):
            continue
        for error in errors_in(cell, ran):
            shown = ANSI.sub("", "\n".join(error.get("traceback", [])))
            where = f"{name}, cell {cell['id']}:\n{source(cell)[:300]}"
            assert "is not written yet" in shown, f"{where}\nshows: {shown[-600:]}"


@pytest.mark.parametrize("name", CHAPTERS)
def test_release_is_in_sync_with_nbgrader(course_run, name):
    edited = learner_work(ROOT / "chapters" / name / f"{name}.ipynb")
    if edited:  # a learner working in this checkout: their copy is not the release, and releasing would erase it
        pytest.skip(edited)
    committed = (ROOT / "chapters" / name / f"{name}.ipynb").read_bytes()
    regenerated = (course_run.course / "chapters" / name / f"{name}.ipynb").read_bytes()
    assert committed == regenerated, f"chapters/{name} is stale: run `python -m llmcourse release` and commit"


def test_a_stale_stored_output_is_caught(course_run):
    """A solution whose checked cell stores what the code no longer prints fails the comparison, naming what
    differs; the sanitized parts (memory addresses, timings) do not count."""
    stored = nbformat.reads(json.dumps(solution("00_pipeline")), as_version=4)
    ran = course_run.autograded("ada", "00_pipeline")
    cell = next(c for c in code_cells(stored) if CHECKED in c.metadata.get("tags", []) and c.outputs)
    fresh = next(c for c in code_cells(ran) if c["id"] == cell.id)["outputs"]
    assert output_difference(cell.outputs, fresh) is None
    assert "characters ->" in comparable(fresh)["stdout"][0]  # compared as printed (sanitizing spares it)
    text = next(o for o in cell.outputs if o.output_type == "stream")
    text.text = text.text.replace(text.text.strip()[:5], "stale", 1)
    difference = output_difference(cell.outputs, fresh)
    assert difference and difference.startswith("stdout differs") and "stale" in difference

    edited = [{"output_type": "stream", "name": "stdout", "text": "at 0x7f3a2b1c9d40 in 12.5 ms\n"}]
    again = [{"output_type": "stream", "name": "stdout", "text": "at 0x55d0c0ffee00 in 3.25 ms\n"}]
    assert output_difference(edited, again) is None
    assert output_difference(edited, again + [{"output_type": "stream", "name": "stderr", "text": "!"}])
    split = [{"output_type": "stream", "name": "stdout", "text": t} for t in ["at 0x7f3a2b1c9d40", " in 1.0 ms\n"]]
    assert output_difference(edited, split) is None  # a stream's pieces count as one text, as Jupyter shows them


def test_a_stub_in_the_engine_is_told_as_not_written_yet():
    """The notice chapter 11's demo printed on the stubs ("raised NotImplementedError: " and nothing after it)."""
    from llmcourse.course.guards import guarded_loader, guarded_qk_norm
    from llmcourse.engine.slots import PartError

    def load_llama_checkpoint(folder):
        raise NotImplementedError()

    def qk_norm(q, k, q_weight, k_weight, eps):
        raise ValueError()

    with pytest.raises(PartError) as stub:
        guarded_loader(load_llama_checkpoint)("folder")
    assert ".load_llama_checkpoint) is not written yet (it raises NotImplementedError)\n" in str(stub.value)
    with pytest.raises(PartError) as bare:
        guarded_qk_norm(qk_norm)(None, None, None, None, 1e-6)
    assert ".qk_norm) raised ValueError\n" in str(bare.value)
    for message in (str(stub.value), str(bare.value)):
        assert not EMPTY_MESSAGE.search(message), message


# Chapter defects seen on the stubs (tests/test_chapter_defects.py's story), read from bob's run


def test_chapter_05_side_by_side_on_the_stubs_names_the_exercise_to_write_not_a_name_error(course_run):
    """The release run on its stubs (bob's run): the side-by-side demo's one line names `stream_text` (the first
    exercise it calls), its table's cell runs, and no cell raises a NameError."""
    from llmcourse.course.stubs import message

    nb = nbformat.reads(json.dumps(course_run.autograded("bob", "05_sampling")), as_version=4)
    errors = {c.id: o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"}
    named = {i: f"{e.ename}: {e.evalue}" for i, e in errors.items() if e.ename == "NameError"}
    assert not named, named
    demo = errors["side-by-side"]
    assert demo.ename == "NotImplementedError" and demo.traceback == [message("stream_text")], demo
    assert "side-by-side-table" not in errors  # the helper's definition runs on the stubs too


def test_chapter_01_on_the_stubs_every_demo_names_the_exercise_to_write_not_a_name_error(course_run):
    """The whole release run on its stubs (bob's run), as Run All does (it goes on past the failing checks): every
    error is a check's failure or the one line that names an exercise above the cell, never a NameError (or any
    other raw traceback) from a result an earlier demo never made."""
    from llmcourse.course.stubs import message

    nb = nbformat.reads(json.dumps(course_run.autograded("bob", "01_tokenization")), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    defined = {  # each exercise's function or class -> the index of its cell
        name: n
        for n, c in enumerate(code)
        if c.metadata.get("nbgrader", {}).get("solution")
        for name in re.findall(r"^(?:def|class) (\w+)", c.source, re.M)
    }
    named, raw = {}, {}
    for n, c in enumerate(code):
        for e in (o for o in c.outputs if o.output_type == "error"):
            grading = c.metadata.get("nbgrader", {})
            if grading.get("grade") and not grading.get("solution"):
                assert e.ename == "CheckFailed", (c.id, e.ename, e.evalue)  # a check cell's own failure
                continue
            line = re.fullmatch(r"NotImplementedError: `([\w.]+)` is not written yet: .*", "".join(e.traceback))
            name = line and line.group(1)
            if not (name and e.traceback == [message(name)] and defined.get(name.split(".")[0], n) < n):
                raw[c.id] = f"{e.ename}: {e.evalue}"
            else:
                named[c.id] = name
    assert not raw, raw
    # the three that raised a NameError before, now each naming the first exercise it needs
    assert named["merge-demo"] == "get_pair_counts", named
    assert named["compression"] == "train_bpe", named
    assert "compression-plot" not in named  # the plot's helper is a definition: it runs on the stubs too
    # every demo after the first exercise that calls one says which (none passes on a stub)
    demos = [c.id for c in code if "needs-exercise" in c.metadata.get("tags", [])]
    assert set(named) == set(demos), (sorted(named), sorted(demos))
