"""One run of the whole course, from which the slow proofs of the suite are all read: each notebook executes once.

In a scratch course, `python -m llmcourse release` releases every chapter; ada hands in every solution and bob
every release notebook untouched; one `nbgrader autograde` grades both (hidden tests included), then
`generate_feedback` and `export`, as instructor.md says; `python -m llmcourse progress` reads ada's notebooks
meanwhile. What the suite proves from it:

- ada's autograded notebooks *are* the solution notebooks run top to bottom on the current code (same cells, no
  error, every check passed): tests/test_notebooks.py compares their cells tagged `nbval-check-output` with the
  outputs `solutions/` stores, and tests/test_book.py builds the book from them (the published build executes the
  notebooks itself: `execute_notebooks: force`);
- bob's are the release run on its stubs: every check fails at its first call, every `needs-exercise` demo fails,
  every other cell runs (tests/test_notebooks.py);
- the round trip itself: ada gets every point, bob none, no feedback shows a hidden test (tests/test_grading.py).

The session fixture `course_run` (tests/conftest.py) makes it once per test process; the root conftest.py keeps
every test module that uses it on one pytest-xdist worker (`COURSE_RUN_MODULES`), started first.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.parent.name for p in (ROOT / "solutions").glob("*/*.ipynb") if p.parent.name == p.stem)
CHECKED = "nbval-check-output"  # the tag of a cell whose stored outputs a fresh run must reproduce
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@dataclasses.dataclass
class CourseRun:
    course: Path  # solutions/, chapters/ (as released), submitted/, autograded/, feedback/, grades.csv
    progress: str  # what `python -m llmcourse progress submitted/ada` printed

    def autograded(self, student: str, name: str) -> dict:
        return json.loads((self.course / "autograded" / student / name / f"{name}.ipynb").read_text(encoding="utf-8"))

    def feedback(self, student: str, name: str) -> str:
        return (self.course / "feedback" / student / name / f"{name}.html").read_text(encoding="utf-8")


def run_course(course: Path) -> CourseRun:
    from .test_course import solved_copy

    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(ROOT / "solutions", course / "solutions")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's tools

    def run(*args):
        done = subprocess.run(
            [sys.executable, *args], cwd=course, env=env, capture_output=True, text=True, timeout=1800
        )
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    run("-m", "llmcourse", "release")
    for name in CHAPTERS:
        solved_copy(name, course / "submitted" / "ada")
        shutil.copytree(course / "chapters" / name, course / "submitted" / "bob" / name)
    # progress reads ada's notebooks while nbgrader grades them (it writes only to autograded/): the two share the
    # cores with the other test worker rather than wait for each other
    progress = subprocess.Popen(
        [sys.executable, "-m", "llmcourse", "progress", "submitted/ada"],
        cwd=course,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # One nbgrader process for every chapter and student ("*" is a chapter pattern nbgrader accepts).
        run("-m", "nbgrader", "autograde", "*", "--log-level=ERROR")
        run("-m", "nbgrader", "generate_feedback", "*", "--log-level=ERROR")
        run("-m", "nbgrader", "export", "--log-level=ERROR")
        out, err = progress.communicate(timeout=1800)
    finally:
        progress.kill()
    assert progress.returncode == 0, f"progress failed:\n{out[-3000:]}\n{err[-3000:]}"
    return CourseRun(course, out)


# ----------------------------------------------------------------------------------------------
# Reading executed notebooks


def joined(text) -> str:
    """A notebook's text field as one string (nbformat stores it as a string or a list of lines)."""
    return "".join(text) if isinstance(text, list) else text


def source(cell) -> str:
    return joined(cell["source"])


def code_cells(nb) -> list:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def without_solution_markers(text: str) -> str:
    """A cell's code as the learner's copy has it (solved_copy drops the `### BEGIN/END SOLUTION` lines)."""
    return "".join(
        ln for ln in text.splitlines(keepends=True) if "### BEGIN SOLUTION" not in ln and "### END SOLUTION" not in ln
    )


def errors_in(cell, nb) -> list[dict]:
    """The error outputs a cell produced: its own, and those inside the widgets it displayed (an
    `ipywidgets.interactive` shows its function's exception in its Output widget, which nbclient stores in the
    notebook's widget state)."""
    found = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    todo = [
        o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
        for o in cell.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    seen = set()
    while todo:
        model = todo.pop()
        if model in seen or model not in state:
            continue
        seen.add(model)
        found += [o for o in state[model]["state"].get("outputs", []) if o.get("output_type") == "error"]
        todo += re.findall(r"IPY_MODEL_(\w+)", json.dumps(state[model]["state"]))
    return found


def printed(cell) -> str:
    return "".join(joined(o.get("text", "")) for o in cell.get("outputs", []) if o["output_type"] == "stream")


# ----------------------------------------------------------------------------------------------
# Checked outputs: nbval's comparison (`--nbval-lax`), which this suite used before it ran each notebook once


SKIPPED = {  # what nbval does not compare: run-to-run metadata, random widget ids, pixels
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
}
BACKSPACE = re.compile("[^\n]\x08")  # a character and the backspace that erases it
CARRIAGE_RETURN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)


def sanitizers() -> list[tuple[re.Pattern, str]]:
    """tests/nbval_sanitize.cfg: memory addresses and timings, written as nbval reads them."""
    text = (ROOT / "tests" / "nbval_sanitize.cfg").read_text(encoding="utf-8")
    pairs = re.findall(r"^regex: (.*)\nreplace: (.*)$", text, re.M)
    return [(re.compile(regex), replace) for regex, replace in pairs]


def comparable(outputs: list) -> dict[str, list]:
    """Each output field (a stream by its name, a display's data by its MIME type) -> its values in order,
    sanitized; every stream of one name joined into one, with backspaces and carriage returns applied."""
    streams: dict[str, str] = {}
    fields: dict[str, list] = {}
    for output in outputs:
        if output["output_type"] == "stream":
            streams[output["name"]] = streams.get(output["name"], "") + joined(output["text"])
            continue
        for key, value in output.items():
            if key in SKIPPED:
                continue
            items = value.items() if key == "data" else [(key, value)]
            for field, v in items:
                if field not in SKIPPED:
                    fields.setdefault(field, []).append(v)
    for name, text in streams.items():
        old = None
        while old != text:
            old, text = text, BACKSPACE.sub("", text)
        fields.setdefault(name, []).append(CARRIAGE_RETURN.sub("", text))
    patterns = sanitizers()

    def clean(v):
        v = joined(v)
        if isinstance(v, str):
            for regex, replace in patterns:
                v = regex.sub(replace, v)
        return v

    return {field: [clean(v) for v in values] for field, values in fields.items()}


def output_difference(stored: list, fresh: list) -> str | None:
    """None when a fresh run's outputs equal the stored ones as nbval compares them; else what differs."""
    want, got = comparable(stored), comparable(fresh)
    if set(want) != set(got):
        return f"output fields differ: stored {sorted(want)}, fresh run {sorted(got)}"
    for field in want:
        if want[field] != got[field]:
            return f"{field} differs:\n--- stored\n{want[field]}\n+++ fresh run\n{got[field]}"
    return None


# ----------------------------------------------------------------------------------------------
# The book's pages from ada's run


HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def check_calls(text: str) -> list[str]:
    """The check functions a check cell's code calls, one name per top-level `check_...(...)` statement."""
    body = ast.parse(textwrap.dedent(text)).body
    return [
        ast.unparse(s.value.func)
        for s in body
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and "check" in ast.unparse(s.value.func)
    ]


def visible_outputs(cell_source: str, outputs: list) -> list:
    """What a check cell prints when only its visible part runs (the book strips the hidden tests before it runs a
    page), from a run of the whole cell. The hidden part holds only calls of the check function the visible part
    calls, and every call of it prints the same number of `✓` lines (one per part it checks): the visible part's
    lines are the first share."""
    before, rest = cell_source.split(HIDDEN_BEGIN, 1)
    hidden, after = rest.split(HIDDEN_END, 1)
    visible, secret = check_calls(before + after), check_calls(hidden)
    assert len(ast.parse(textwrap.dedent(hidden)).body) == len(secret) and set(secret) <= set(visible), (
        f"a hidden part that is not calls of the visible part's check: the book cannot tell what it printed\n{hidden}"
    )
    assert all(o["output_type"] == "stream" and o["name"] == "stdout" for o in outputs), outputs
    lines = printed({"outputs": outputs}).splitlines(keepends=True)
    ticks = [i for i, line in enumerate(lines) if line.startswith("✓")]
    per_call, left = divmod(len(ticks), len(visible) + len(secret))
    assert per_call and not left, f"{len(visible) + len(secret)} check calls and {len(ticks)} ✓ lines:\n{lines}"
    return [{"output_type": "stream", "name": "stdout", "text": "".join(lines[: ticks[len(visible) * per_call]])}]


def with_outputs_of(stored: dict, ran: dict) -> dict:
    """The solution notebook `stored` holding the outputs of its run `ran` (ada's autograded copy), as a book build
    that executes it would: a check cell shows what its visible part printed."""
    nb = copy.deepcopy(stored)
    by_id = {c["id"]: c for c in code_cells(ran)}
    for cell in code_cells(nb):
        got = by_id[cell["id"]]
        text = source(cell)
        cell["outputs"] = visible_outputs(text, got["outputs"]) if HIDDEN_BEGIN in text else got["outputs"]
        cell["execution_count"] = got["execution_count"]
    if "widgets" in ran.get("metadata", {}):
        nb["metadata"]["widgets"] = ran["metadata"]["widgets"]
    return nb
