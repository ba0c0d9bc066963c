"""nbgrader for the course: the release command and four preprocessors that `nbgrader_config.py` names.

`release` is `python -m llmcourse release`: it regenerates `chapters/` from `solutions/` with
`nbgrader generate_assignment` and records each chapter's notebook in the gradebook
(`gradebook.db`), which `nbgrader autograde` needs to find and grade the submissions. First it writes
each chapter's install cell from `_config.yml`'s repository (`llmcourse.course.publish`).

`OverwriteCells` (autograde) is nbgrader's, without its false alarm for hidden tests: the released
check cell lacks the hidden tests, so its checksum never matches the one the gradebook stored for the
source cell, and nbgrader warned "Attribute 'checksum' … has changed!" for every check cell of every
student (jupyter/nbgrader#1961) before putting the hidden tests back. A check cell that differs
from the source in any other way still gets the warning.

`ClearHiddenTests` (feedback) is nbgrader's, with `display_data_priority` configurable: nbconvert's
HTML exporter configures that option for every preprocessor, and nbgrader's base class declares it
without `config=True`, hence "Config option display_data_priority not recognized by
ClearHiddenTests" (nbgrader's own `GetGrades` does the same re-declaration).

`RunAllGoesOn` (release): each check cell tagged `raises-exception`, so that Run All in JupyterLab goes on past
an unfinished exercise's check.

`ShortTracebacks` (feedback): a failed check's traceback would print the check cell's source around
the failing line — hidden tests included — so each error output is cut down to its last line,
`CheckFailed: <the check's message>`, which is what a learner needs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nbconvert.preprocessors import Preprocessor
from nbformat import NotebookNode
from nbgrader import preprocessors as nbgrader_preprocessors
from nbgrader import utils
from nbgrader.api import MissingEntry
from traitlets import List

from .publish import install_requirement, repository, set_install_cells


def chapters(course: Path) -> list[str]:
    """The chapters in `solutions/`: one folder per chapter, holding `<name>/<name>.ipynb`."""
    folder = course / "solutions"
    return sorted(p.name for p in folder.iterdir() if (p / f"{p.name}.ipynb").is_file()) if folder.is_dir() else []


def release(course: Path = Path("."), err=sys.stderr, names: list[str] | None = None) -> int:
    """`nbgrader generate_assignment` for every chapter (or those in `names`), recorded in the gradebook.

    Each chapter's notebook is regenerated on its own (`--notebook`): nbgrader then neither deletes
    the whole `chapters/<name>/` first nor refuses a chapter that already has submissions. If nbgrader
    fails anyway, the previous release notebook is put back.
    """
    if not (course / "nbgrader_config.py").is_file():
        print(
            "python -m llmcourse release: error: no nbgrader_config.py here; run it in the course folder "
            "(the repository root)",
            file=err,
        )
        return 2
    known = chapters(course)
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        print(
            f"python -m llmcourse release: error: no chapter {', '.join(unknown)} in solutions/ "
            f"(the chapters: {', '.join(known)})",
            file=err,
        )
        return 2
    if (course / "_config.yml").is_file():  # the book's repository: each chapter's first cell installs from it
        try:
            for name in set_install_cells(course, names or known):
                print(f"solutions/{name}: install cell set to {install_requirement(*repository(course))!r}")
        except ValueError as error:
            print(f"python -m llmcourse release: error: {error}", file=err)
            return 2
    for name in names or known:
        target = course / "chapters" / name / f"{name}.ipynb"
        previous = target.read_bytes() if target.is_file() else None
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "nbgrader",
                "generate_assignment",
                name,
                f"--notebook={name}",
                "--force",
                "--log-level=ERROR",
            ],
            cwd=course,
        )
        if done.returncode:
            if previous is not None and not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(previous)
            print(
                f"python -m llmcourse release: error: nbgrader could not release {name} (see above); "
                f"chapters/{name} is as it was",
                file=err,
            )
            return done.returncode
        print(f"released chapters/{name}")
    return 0


class OverwriteCells(nbgrader_preprocessors.OverwriteCells):
    """nbgrader's OverwriteCells, quiet about a check cell whose only change is its removed hidden tests."""

    def preprocess_cell(self, cell, resources, cell_index):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is not None and utils.is_locked(cell):
            try:
                source = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id)
            except MissingEntry:
                pass  # nbgrader reports it
            else:
                released = NotebookNode(cell_type=source.cell_type, source=source.source, metadata={})
                ClearHiddenTests(parent=self)._remove_hidden_test_region(released)
                if cell.source == released.source:
                    cell.source = source.source  # what nbgrader would put back, minus the warning
        return super().preprocess_cell(cell, resources, cell_index)


class ClearHiddenTests(nbgrader_preprocessors.ClearHiddenTests):
    """nbgrader's ClearHiddenTests, accepting the display_data_priority that nbconvert's exporters set."""

    display_data_priority = List(nbgrader_preprocessors.ClearHiddenTests.display_data_priority.default_value).tag(
        config=True
    )


class RunAllGoesOn(Preprocessor):
    """(generate_assignment) Every check cell of the release tagged `raises-exception`: in JupyterLab, Run All
    then goes on past a check that fails (an exercise not written yet), and the demonstrations after it still run —
    they say themselves what they are missing. The solution notebooks are never tagged: there a failing check must
    stop the run (`refresh`, the book and the tests refuse any failure)."""

    enabled = True

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and utils.is_grade(cell) and not utils.is_solution(cell):
            tags = cell.metadata.setdefault("tags", [])
            if RAISES not in tags:
                tags.append(RAISES)
        return cell, resources


RAISES = "raises-exception"  # JupyterLab's tag: an error in this cell does not stop Run All


class ShortTracebacks(Preprocessor):
    enabled = True  # nbconvert skips preprocessors that are not enabled

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code":
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return cell, resources
