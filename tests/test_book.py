"""The Jupyter Book builds with zero warnings, and its chapter pages hold what a reader needs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    done = subprocess.run([str(jb), "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"book build failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "WARNING:" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-4000:]  # -W makes them errors too
    return out / "_build" / "html"


def page(book, rel):
    return (book / rel).read_text(encoding="utf-8")


def text(html):
    """What a reader reads: the page without its tags."""
    return re.sub(r"<[^>]+>", "", html)


def test_landing_and_instructor_pages(book):
    landing = text(page(book, "intro.html"))
    assert "What you will build" in landing and "How grading works" in landing
    instructor = text(page(book, "instructor.html"))
    for command in ["nbgrader autograde", "nbgrader generate_feedback", "nbgrader export", "python -m llmcourse release"]:
        assert command in instructor


@pytest.mark.parametrize("name", ["00_pipeline", "01_tokenization"])
def test_chapter_pages_are_executed_with_solutions_behind_toggles(book, name):
    html = page(book, f"solutions/{name}/{name}.html")
    assert "output traceback" not in html and "output error" not in html  # no cell failed
    assert "✓ " in html  # the checks ran and passed
    assert "tag_hide-input" in html  # solution code sits behind a toggle
    assert re.search(r'<img[^>]+src="[^"]+\.png"', html), "no figure on the page"
    link = re.search(rf'href="([^"]*_downloads/[^"]*{name}\.ipynb)"', html)
    assert link, "no link to the exercise notebook"
    target = (book / f"solutions/{name}" / link.group(1)).resolve()
    student = target.read_bytes()
    assert b"raise NotImplementedError()" in student and b"BEGIN SOLUTION" not in student  # the exercise version


def test_benchmarks_page_shows_the_figure(book):
    html = page(book, "benchmarks.html")
    assert "python -m llmcourse bench" in text(html) and "roofline" in text(html)
    assert re.search(r'<img[^>]+src="[^"]*bench\.png"', html)
