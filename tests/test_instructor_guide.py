"""The instructor guide, run as written.

Every ```bash block of instructor.md runs, in order and with its own text, in a scratch copy of the
course: release, then — with two students' notebooks collected into submitted/ — autograde,
feedback and export. One student hands in the full solution, the other solved the first half of the
exercises. Only the commands in NOT_RUN_HERE are left out, and only the placeholder the guide
documents (NN_topic, "the chapter you edited") is filled in.
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .release import released as release_of
from .test_course import ROOT, solved_copy

GUIDE = ROOT / "instructor.md"
NOT_RUN_HERE = {
    "pip install -r requirements.txt": "installs the packages; the tests run in the installed environment",
    # "Publish the book": tests/test_publish.py checks these commands against the workflow and what they write
    "python -m llmcourse release": "every chapter: the guide's first block releases one, as written",
    "jupyter-book build . -W -n --keep-going": "builds the book: tests/test_book.py builds it with these flags",
    "ghp-import -n -p -f _build/html": "pushes to GitHub",
}
PLACEHOLDERS = ["NN_topic"]  # instructor.md: "NN_topic is the chapter you edited"


def exercises(name):
    """The chapter's graded check cells, in order."""
    cells = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())["cells"]
    return [c for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]


def points(name, first=None):
    return sum(c["metadata"]["nbgrader"]["points"] for c in exercises(name)[:first])


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def runnable(block: str, chapter: str) -> str:
    lines = []
    for line in block.splitlines():
        command = line.split("#")[0].strip()
        lines.append(f": not run here: {command}" if command in NOT_RUN_HERE else line)
    script = "\n".join(lines)
    for placeholder in PLACEHOLDERS:
        script = script.replace(placeholder, chapter)
    return script


GUIDE_TEXT = GUIDE.read_text()
CHAPTER = re.search(r"^nbgrader autograde (\S+)", GUIDE_TEXT, re.M).group(1)
HALF = len(exercises(CHAPTER)) // 2
STUDENTS = {  # what each student hands in: the release with this many exercises solved
    "ada": len(exercises(CHAPTER)),
    "grace": HALF,
}


@pytest.fixture(scope="module")
def guide_course(tmp_path_factory):
    course = tmp_path_factory.mktemp("guide")
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(ROOT / "solutions" / CHAPTER, course / "solutions" / CHAPTER)
    shutil.copytree(release_of(CHAPTER), course / "chapters" / CHAPTER)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's tools
    ran = []
    for block in bash_blocks(GUIDE_TEXT):
        if "nbgrader autograde" in block:  # the students' notebooks are collected before grading
            for student, solved in STUDENTS.items():
                solved_copy(CHAPTER, course / "submitted" / student, solve=solved)
        script = runnable(block, CHAPTER)
        start = time.perf_counter()
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=course,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        ran.append(
            SimpleNamespace(script=script, output=done.stdout + done.stderr, seconds=time.perf_counter() - start)
        )
        assert done.returncode == 0, f"instructor.md's commands failed:\n{script}\n{done.stdout}\n{done.stderr}"
    print("\n".join(f"{r.seconds:6.1f} s  {r.script.splitlines()[0]} …" for r in ran))  # pytest -s shows them
    with open(course / "grades.csv") as f:
        grades = {row["student_id"]: row for row in csv.DictReader(f) if row["assignment"] == CHAPTER}
    released = (course / "chapters" / CHAPTER / f"{CHAPTER}.ipynb").read_bytes()
    return SimpleNamespace(course=course, grades=grades, ran=ran, env=env, released=released)


def test_the_guide_names_its_example_and_leaves_out_only_pip():
    blocks = bash_blocks(GUIDE_TEXT)
    assert any("python -m llmcourse release" in b for b in blocks)
    grading = next(b for b in blocks if "nbgrader autograde" in b)
    for command in ["generate_feedback", "export"]:
        assert f"nbgrader {command}" in grading
    assert set(re.findall(r"nbgrader db student add (\S+)", grading)) == set(STUDENTS)
    commands = "\n".join(line.split("#")[0] for b in blocks for line in b.splitlines())
    assert not re.search(r"<\w+>", commands), "a placeholder in a command cannot run as written"
    assert not re.search(r"^\s*cd ", commands, re.M), "the course directory is the repository root"
    skipped = [line for b in blocks for line in runnable(b, CHAPTER).splitlines() if line.startswith(": not run")]
    assert len(skipped) == len(NOT_RUN_HERE)


def test_full_solution_gets_all_points(guide_course):
    row = guide_course.grades["ada"]
    assert float(row["score"]) == float(row["max_score"]) == points(CHAPTER)
    assert (row["first_name"], row["last_name"]) == ("Ada", "Lovelace")


def test_half_done_gets_the_points_of_the_exercises_solved(guide_course):
    row = guide_course.grades["grace"]
    assert 0 < float(row["score"]) == points(CHAPTER, first=HALF) < points(CHAPTER)


def test_feedback_shows_results_but_no_hidden_tests(guide_course):
    for student in STUDENTS:
        html = (guide_course.course / "feedback" / student / CHAPTER / f"{CHAPTER}.html").read_text()
        assert "HIDDEN TESTS" not in html and "seed=2026" not in html
        assert "Score" in html or "score" in html
    failing = (guide_course.course / "feedback" / "grace" / CHAPTER / f"{CHAPTER}.html").read_text()
    assert "not written yet" in failing  # the learner sees why a check failed


def test_grading_prints_no_warnings(guide_course):
    """Only the kernel's own TCP notice, which instructor.md explains, may appear."""
    tolerated = ["[IPKernelApp] WARNING | Kernel is running over TCP without encryption"]
    output = "\n".join(r.output for r in guide_course.ran)
    assert "checksum" not in output and "not recognized" not in output and "SAWarning" not in output
    noisy = [
        line
        for line in output.splitlines()
        if re.search(r"warn|error", line, re.I) and not any(line.startswith(t) for t in tolerated)
    ]
    assert noisy == []


def test_release_again_after_submissions(guide_course, capsys):
    """The instructor fixes a typo and releases again: the gradebook keeps the chapter's notebook."""
    from nbgrader.api import Gradebook

    from llmcourse.course.grading import release

    assert release(guide_course.course) == 0, capsys.readouterr()
    assert (guide_course.course / "chapters" / CHAPTER / f"{CHAPTER}.ipynb").read_bytes() == guide_course.released
    with Gradebook(f"sqlite:///{guide_course.course / 'gradebook.db'}") as gb:
        assert [nb.name for nb in gb.find_assignment(CHAPTER).notebooks] == [CHAPTER]
        assert gb.find_submission(CHAPTER, "ada").score == points(CHAPTER)
