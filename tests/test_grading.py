"""nbgrader's whole round trip in a scratch course: release, submit, autograde, feedback, export."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_course import ROOT, solved_copy

HALF = "01_tokenization"


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--log-level=ERROR"], cwd=course,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def graded_course(tmp_path_factory):
    course = tmp_path_factory.mktemp("class")
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(ROOT / "solutions", course / "solutions")
    submissions = {
        ("solver", "00_pipeline"): lambda d: solved_copy("00_pipeline", d),
        ("idle", "00_pipeline"): lambda d: solved_copy("00_pipeline", d, solve=0),
        ("solver", HALF): lambda d: solved_copy(HALF, d),
        ("halfway", HALF): lambda d: solved_copy(HALF, d, solve=len(exercises(HALF)) // 2),
    }
    for student in sorted({s for s, _ in submissions}):
        nbgrader(course, "db", "student", "add", student)
    for name in sorted({n for _, n in submissions}):
        nbgrader(course, "generate_assignment", name, "--force")
    for (student, name), make in submissions.items():
        make(course / "submitted" / student)
    for name in sorted({n for _, n in submissions}):
        nbgrader(course, "autograde", name)
        nbgrader(course, "generate_feedback", name)
    nbgrader(course, "export")
    with open(course / "grades.csv") as f:
        grades = {(row["student_id"], row["assignment"]): row for row in csv.DictReader(f)}
    return course, grades


def exercises(name):
    cells = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())["cells"]
    return [c for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]


def max_points(name):
    return sum(c["metadata"]["nbgrader"]["points"] for c in exercises(name))


def test_solutions_get_full_points(graded_course):
    _, grades = graded_course
    for name in ["00_pipeline", HALF]:
        row = grades[("solver", name)]
        assert float(row["score"]) == float(row["max_score"]) == max_points(name)


def test_untouched_release_gets_zero(graded_course):
    _, grades = graded_course
    assert float(grades[("idle", "00_pipeline")]["score"]) == 0


def test_half_done_gets_partial_points(graded_course):
    _, grades = graded_course
    score = float(grades[("halfway", HALF)]["score"])
    assert 0 < score < max_points(HALF)


def test_feedback_shows_results_but_no_hidden_tests(graded_course):
    course, _ = graded_course
    for student, name in [("solver", "00_pipeline"), ("halfway", HALF)]:
        html = (course / "feedback" / student / name / f"{name}.html").read_text()
        assert "HIDDEN TESTS" not in html and "seed=2026" not in html
        assert "Score" in html or "score" in html
    failing = (course / "feedback" / "halfway" / HALF / f"{HALF}.html").read_text()
    assert "not written yet" in failing  # the learner sees why a check failed
