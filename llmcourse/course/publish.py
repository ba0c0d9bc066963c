"""Publishing the course: the repository a reader's notebooks come from, and the first cell of every chapter.

`_config.yml`'s `repository: url` (with its `branch`) is the one setting a publisher changes. Jupyter Book's
launch buttons (Binder, Colab, JupyterHub) open the exercise notebooks in that repository, and there a kernel may
start without `llmcourse`: so each chapter's first code cell (id `install-llmcourse`) installs it from the same
repository where it is missing, and does nothing where it is installed (a learner's own machine, nbgrader, the
test suite, the book build). `python -m llmcourse release` writes that cell into every `solutions/` notebook from
`_config.yml` (`set_install_cells`) before nbgrader releases `chapters/`; the test suite checks that every
notebook names exactly the configured repository.
"""

from __future__ import annotations

import json
from pathlib import Path

INSTALL_CELL_ID = "install-llmcourse"
INSTALL_TAGS = ["remove-cell"]  # the book's pages leave it out: they are the executed solutions, not a kernel

INSTALL_TEMPLATE = """\
# Binder, Colab or a JupyterHub may start without the course's package: this cell installs it from the course's
# repository (a few minutes, once). Where llmcourse is installed already, it does nothing.
import importlib.util
import site
import subprocess
import sys

if importlib.util.find_spec("llmcourse") is None:
    requirement = "{requirement}"
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", requirement])
    site.addsitedir(site.getusersitepackages())  # where pip installs when the environment is not writable
    importlib.invalidate_caches()"""


def repository(course: Path = Path(".")) -> tuple[str, str]:
    """(url, branch) of the repository `_config.yml` names (its `repository:` section; branch `main` if unset)."""
    import yaml  # PyYAML comes with jupyter-book, the tool whose _config.yml this reads; not a package dependency

    config = yaml.safe_load((Path(course) / "_config.yml").read_text(encoding="utf-8")) or {}
    section = config.get("repository") or {}
    url = str(section.get("url") or "").strip().rstrip("/")
    if not url.startswith("https://"):
        raise ValueError(f"_config.yml: repository: url must be the repository's https:// address, not {url!r}")
    return url, str(section.get("branch") or "main")


def install_requirement(url: str, branch: str) -> str:
    """What pip installs: the package with its `course` extra, from the repository's branch."""
    return f"llmcourse[course] @ git+{url}@{branch}"


def install_source(url: str, branch: str) -> str:
    """The source of a chapter's first code cell for the repository `url` and its `branch`."""
    return INSTALL_TEMPLATE.format(requirement=install_requirement(url, branch))


def install_cell(nb: dict) -> dict | None:
    """The notebook's install cell (by id), or None."""
    return next((c for c in nb.get("cells", []) if c.get("id") == INSTALL_CELL_ID), None)


def _first_code(nb: dict) -> int:
    return next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")


def set_install_cell(path: Path, url: str, branch: str) -> bool:
    """Make the notebook at `path` start its code with the install cell for `url` and `branch`; True if the file
    changed. A new cell goes before the first code cell, with the execution count a fresh run would give it (the
    counts after it move up by one), so the stored outputs stay as `python -m llmcourse.course.refresh` writes
    them and nothing needs to run again; an existing one gets the source only."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    cell = install_cell(nb)
    source = install_source(url, branch)
    if cell is None:
        first = _first_code(nb)
        ran = nb["cells"][first].get("execution_count") is not None
        if ran:
            for other in nb["cells"]:
                if other["cell_type"] != "code":
                    continue
                if other.get("execution_count") is not None:
                    other["execution_count"] += 1
                for output in other.get("outputs", []):
                    if output.get("execution_count") is not None:
                        output["execution_count"] += 1
        cell = {
            "cell_type": "code",
            "execution_count": 1 if ran else None,
            "id": INSTALL_CELL_ID,
            "metadata": {"tags": list(INSTALL_TAGS)},
            "outputs": [],
            "source": [],
        }
        nb["cells"].insert(first, cell)
    elif _first_code(nb) != nb["cells"].index(cell):
        raise ValueError(f"{path}: the cell {INSTALL_CELL_ID!r} is not the first code cell")
    cell["source"] = source.splitlines(keepends=True)
    new = json.dumps(nb, ensure_ascii=False, indent=1, sort_keys=True) + "\n"
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def set_install_cells(course: Path, names: list[str]) -> list[str]:
    """`set_install_cell` on `solutions/<name>/<name>.ipynb` for each name, with `_config.yml`'s repository;
    the names whose notebook changed."""
    url, branch = repository(course)
    notebooks = {name: Path(course) / "solutions" / name / f"{name}.ipynb" for name in names}
    return [name for name, path in notebooks.items() if set_install_cell(path, url, branch)]
