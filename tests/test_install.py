"""Every chapter runs from the wheel's install as the book's landing page gives it:
`pip install "llmcourse-<version>-py3-none-any.whl[course]"` (issue 22: chapter 04 imported transformers, which the
`course` extra did not bring). Cheap: the notebooks' imports are parsed, not run."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted(p for p in (ROOT / "solutions").glob("*/*.ipynb") if p.parent.name == p.stem)


def imported_modules(path: Path) -> dict[str, str]:
    """Top-level modules a notebook imports (absolute imports, anywhere in its code cells) -> a cell id."""
    found: dict[str, str] = {}
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        for node in ast.walk(ast.parse(code)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                found.setdefault(name.split(".")[0], cell.get("id", "?"))
    return found


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies plus its `course` extra (read from the source, not the installed metadata,
    which an editable install does not refresh)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["course"]]


@cache
def modules_of_installed() -> dict[str, set[str]]:
    """distribution (canonical name) -> the top-level modules it installs."""
    by_dist: dict[str, set[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(canonical(dist), set()).add(module)
    return by_dist


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions pip installs for `requirements` (their dependencies too, without their extras), as
    this environment resolved them."""
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        name = canonical(todo.pop().name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req)
    return seen


def test_the_course_extra_holds_what_chapter_04_imports():
    names = {canonical(r.name) for r in declared_requirements()}
    assert {"transformers", "jupyterlab", "ipywidgets", "matplotlib", "plotly"} <= names, names


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_import_comes_with_the_wheel_and_its_course_extra(path):
    """Each module a chapter imports is the standard library, llmcourse, or installed by the wheel's
    dependencies + the `course` extra (directly or as one of theirs)."""
    provided = {"llmcourse"} | set(sys.stdlib_module_names)
    by_dist = modules_of_installed()
    for dist in installed_closure(declared_requirements()):
        provided |= by_dist.get(dist, set())
    missing = {module: cell for module, cell in imported_modules(path).items() if module not in provided}
    assert missing == {}, (
        f"{path.stem} imports {sorted(missing)} (cells {sorted(missing.values())}), which "
        f'`pip install "llmcourse-...whl[course]"` does not install: add its distribution to '
        "the `course` extra in pyproject.toml"
    )


def test_the_check_sees_a_missing_module(tmp_path):
    """The test above would have caught chapter 04: without transformers in the extra, it is missing."""
    requirements = [r for r in declared_requirements() if canonical(r.name) != "transformers"]
    provided = set().union(*(modules_of_installed().get(d, set()) for d in installed_closure(requirements)))
    chapter_04 = next(p for p in SOLUTIONS if p.stem.startswith("04_"))
    assert "transformers" in imported_modules(chapter_04)
    assert "transformers" not in provided
