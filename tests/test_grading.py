"""The course's nbgrader pieces (llmcourse.course.grading) one by one.

The whole round trip — release, autograde, feedback, export, as instructor.md says — is
tests/test_instructor_guide.py for one chapter; the whole course is graded end to end here too (the course run of
tests/course_run.py), for a student who solved everything and one who handed in the untouched release.
"""

import csv
import html
import io
import json
import logging
import shutil
from types import SimpleNamespace

from nbformat import NotebookNode

from llmcourse.course.grading import ClearHiddenTests, OverwriteCells, ShortTracebacks, release

from .release import released as release_of
from .test_course import ROOT

SOURCE = "check(f)\n### BEGIN HIDDEN TESTS\ncheck(f, seed=2026)\n### END HIDDEN TESTS"
RELEASED = "check(f)"


def check_cell(source):
    return NotebookNode(
        cell_type="code",
        source=source,
        outputs=[],
        execution_count=None,
        metadata=NotebookNode(
            nbgrader=NotebookNode(grade=True, solution=False, locked=True, points=1, grade_id="f_check")
        ),
    )


class Gradebook:
    """The two look-ups OverwriteCells makes, answered from the source cell above."""

    def __init__(self):
        self.source = check_cell(SOURCE)
        from nbgrader.utils import compute_checksum

        self.checksum = compute_checksum(self.source)

    def find_source_cell(self, grade_id, notebook, assignment):
        return SimpleNamespace(name=grade_id, source=SOURCE, cell_type="code", locked=True, checksum=self.checksum)

    def find_graded_cell(self, grade_id, notebook, assignment):
        return SimpleNamespace(max_score=1)


def overwrite(source, caplog):
    pp = OverwriteCells()
    pp.gradebook, pp.notebook_id, pp.assignment_id = Gradebook(), "nb", "ch"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cell, _ = pp.preprocess_cell(check_cell(source), {}, 0)
    return cell, [r.getMessage() for r in caplog.records]


def test_autograde_puts_hidden_tests_back_without_a_false_alarm(caplog):
    cell, warnings = overwrite(RELEASED, caplog)
    assert cell.source == SOURCE and warnings == []


def test_autograde_still_reports_an_edited_check_cell(caplog):
    cell, warnings = overwrite("pass  # the learner emptied the check", caplog)
    assert cell.source == SOURCE
    assert any("Attribute 'checksum' for cell f_check has changed" in w for w in warnings)


def test_clear_hidden_tests_accepts_the_exporters_display_priority(caplog):
    from traitlets.config import Config

    with caplog.at_level(logging.WARNING):
        pp = ClearHiddenTests(config=Config({"NbConvertBase": {"display_data_priority": ["text/html"]}}))
    assert pp.display_data_priority == ["text/html"]
    assert not [r for r in caplog.records if "not recognized" in r.getMessage()]
    cell, _ = pp.preprocess_cell(check_cell(SOURCE), {}, 0)
    assert cell.source == RELEASED


def test_feedback_tracebacks_are_cut_to_the_checks_message():
    cell = check_cell(SOURCE)
    cell.outputs = [
        NotebookNode(
            output_type="error",
            ename="CheckFailed",
            evalue="f(2) should be 4, got 5",
            traceback=["----", "check(f, seed=2026)  # a hidden line", "CheckFailed: ..."],
        )
    ]
    cell, _ = ShortTracebacks().preprocess_cell(cell, {}, 0)
    assert cell.outputs[0]["traceback"] == ["CheckFailed: f(2) should be 4, got 5"]


def test_release_outside_a_course_is_one_clear_error(tmp_path):
    err = io.StringIO()
    assert release(tmp_path, err=err) == 2 and "no nbgrader_config.py here" in err.getvalue()


def test_a_failed_release_leaves_the_chapter_as_it_was(tmp_path):
    """nbgrader deletes the release before it fails (here: prose marked `solution` but not `grade`)."""
    name = "00_pipeline"
    shutil.copy(ROOT / "nbgrader_config.py", tmp_path)
    shutil.copytree(release_of(name), tmp_path / "chapters" / name)
    source = tmp_path / "solutions" / name / f"{name}.ipynb"
    source.parent.mkdir(parents=True)
    nb = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())
    prose = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    prose["metadata"]["nbgrader"] = {
        "solution": True,
        "grade": False,
        "locked": False,
        "grade_id": "prose",
        "schema_version": 3,
        "task": False,
    }
    source.write_text(json.dumps(nb))
    err = io.StringIO()
    assert release(tmp_path, err=err) != 0
    assert f"chapters/{name} is as it was" in err.getvalue()
    released = tmp_path / "chapters" / name / f"{name}.ipynb"
    assert released.read_bytes() == (release_of(name) / f"{name}.ipynb").read_bytes()


def test_release_of_named_chapters_leaves_the_others_alone(tmp_path):
    shutil.copy(ROOT / "nbgrader_config.py", tmp_path)
    for name in ["00_pipeline", "01_tokenization"]:
        shutil.copytree(ROOT / "solutions" / name, tmp_path / "solutions" / name)
    err = io.StringIO()
    assert release(tmp_path, err=err, names=["00_pipeline"]) == 0, err.getvalue()
    released = tmp_path / "chapters" / "00_pipeline" / "00_pipeline.ipynb"
    assert released.read_bytes() == (release_of("00_pipeline") / "00_pipeline.ipynb").read_bytes()
    assert not (tmp_path / "chapters" / "01_tokenization").exists()
    assert release(tmp_path, err=err, names=["01_tokenisation"]) == 2
    assert "no chapter 01_tokenisation in solutions/ (the chapters: 00_pipeline, 01_tokenization)" in err.getvalue()


CHAPTERS = sorted(p.parent.name for p in (ROOT / "solutions").glob("*/*.ipynb") if p.parent.name == p.stem)


def hidden_lines(name):
    """The lines of the chapter's hidden tests, as the source notebook holds them."""
    cells = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())["cells"]
    found = []
    for cell in cells:
        text = "".join(cell["source"])
        if "### BEGIN HIDDEN TESTS" in text:
            found += text.split("### BEGIN HIDDEN TESTS")[1].split("### END HIDDEN TESTS")[0].strip().splitlines()
    return [line.strip() for line in found if line.strip()]


def test_the_whole_course_round_trips_through_nbgrader(course_run):
    """Every chapter released; ada hands in every solution, bob every notebook untouched; autograde (hidden tests
    included), feedback and export as instructor.md says (tests/course_run.py). ada gets every point of every
    chapter (chapter 12 finds her other chapters in submitted/ada/), bob none; no feedback shows a hidden test;
    grades.csv has every chapter; `python -m llmcourse progress` on ada's notebooks shows the whole course, every
    point."""
    from .test_instructor_guide import points

    with open(course_run.course / "grades.csv") as f:
        scores = {(row["assignment"], row["student_id"]): float(row["score"]) for row in csv.DictReader(f)}
    assert scores == {(name, "ada"): points(name) for name in CHAPTERS} | {(name, "bob"): 0.0 for name in CHAPTERS}
    for name in CHAPTERS:
        hidden = hidden_lines(name)
        assert hidden, f"{name} has no hidden tests"
        for student in ("ada", "bob"):
            page = html.unescape(course_run.feedback(student, name))
            shown = [line for line in hidden if line in page]
            assert not shown and "BEGIN HIDDEN TESTS" not in page, f"{student}'s {name} feedback shows {shown}"

    report = course_run.progress.splitlines()
    total = sum(points(name) for name in CHAPTERS)
    assert [line for line in report if not line.startswith(" ")][1:] == [
        *(f"{name}: {points(name):g}/{points(name):g} points" for name in CHAPTERS),
        f"total: {total:g}/{total:g} points",
    ], "\n".join(report)
