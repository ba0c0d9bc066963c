"""Publishing the book (instructor.md, "Publish the book"): the GitHub Actions workflow builds it as the docs
say and deploys the folder the build writes; _config.yml's repository URL is the one setting, and every
chapter's first code cell installs llmcourse from exactly that repository where it is missing (and does
nothing where it is installed). Cheap: no build, no network; tests/test_book.py checks the built pages'
launch buttons."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from llmcourse.course.publish import (
    INSTALL_CELL_ID,
    install_requirement,
    install_source,
    repository,
    set_install_cell,
    set_install_cells,
)

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
GUIDE = (ROOT / "instructor.md").read_text(encoding="utf-8")
BUILD = "jupyter-book build . -W -n --keep-going"
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())
NOTEBOOKS = [ROOT / folder / name / f"{name}.ipynb" for folder in ["solutions", "chapters"] for name in CHAPTERS]


def section(title):
    return GUIDE.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def workflow():
    found = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    found["on"] = found.pop(True, found.get("on"))  # YAML 1.1 reads the key `on` as true
    return found


def steps(flow):
    return [step for job in flow["jobs"].values() for step in job.get("steps", [])]


def test_the_workflow_builds_the_book_as_the_docs_say_and_deploys_what_it_writes():
    flow = workflow()
    assert flow["on"]["push"]["branches"] == ["main"] and "workflow_dispatch" in flow["on"]
    assert flow["permissions"]["pages"] == "write" and flow["permissions"]["id-token"] == "write"
    runs = [step["run"] for step in steps(flow) if "run" in step]
    builds = [line.strip() for run in runs for line in run.splitlines() if line.strip().startswith("jupyter-book")]
    assert builds == [BUILD]
    publish = section("Publish the book")
    assert BUILD in publish and "ghp-import -n -p -f _build/html" in publish
    # the command tests/test_book.py builds the book with (a copy of the course holding the course run's outputs):
    # the same flags
    assert re.search(r'"build", str\(source\), "--path-output", str\(out\), "-W", "-n", "--keep-going"', _book_test())
    install = "\n".join(runs[: next(i for i, run in enumerate(runs) if BUILD in run)])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    torch = re.search(r"^pip install (torch==\S+ --index-url https://download.pytorch.org/whl/cpu)", readme, re.M)
    assert torch and f"pip install {torch.group(1)}" in install  # the CPU-only torch, as README says, first
    assert install.index("download.pytorch.org") < install.index("pip install -r requirements.txt")
    uses = {step["uses"].split("@")[0]: step for step in steps(flow) if "uses" in step}
    assert uses["actions/upload-pages-artifact"]["with"]["path"] == "_build/html"  # where `build .` writes
    assert "actions/deploy-pages" in uses
    jobs = flow["jobs"]
    (deploy,) = [job for job in jobs.values() if any("deploy-pages" in s.get("uses", "") for s in job["steps"])]
    (build_job,) = [name for name, job in jobs.items() if job is not deploy]
    assert deploy["needs"] == build_job and deploy["environment"]["name"] == "github-pages"


def _book_test():
    return " ".join((ROOT / "tests" / "test_book.py").read_text(encoding="utf-8").split())


def test_the_docs_name_the_one_setting_and_the_launch_buttons():
    publish = section("Publish the book")
    url, branch = repository(ROOT)
    assert f"url: {url}" in publish and "Settings → Pages" in publish and "GitHub Actions" in publish
    assert "python -m llmcourse release" in publish and "chapters/NN_topic/NN_topic.ipynb" in publish
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    buttons = config["launch_buttons"]
    assert buttons["binderhub_url"] == "https://mybinder.org"
    assert buttons["colab_url"] == "https://colab.research.google.com"
    assert buttons["notebook_interface"] == "jupyterlab"
    assert config["repository"]["path_to_book"] == "" and branch == "main"
    assert "Binder" in (ROOT / "intro.md").read_text(encoding="utf-8")


def code_cells(path):
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parts[-3]}/{p.stem}")
def test_every_chapter_starts_by_installing_llmcourse_from_the_configured_repository(path):
    first = code_cells(path)[0]
    assert first["id"] == INSTALL_CELL_ID, f"{path.name}: the first code cell is {first['id']!r}"
    assert "".join(first["source"]) == install_source(*repository(ROOT)), (
        f"{path.relative_to(ROOT)} installs from another repository than _config.yml's: "
        "run `python -m llmcourse release` and commit"
    )
    assert first["outputs"] == []  # it prints nothing where llmcourse is installed
    assert "setup" not in first["metadata"].get("tags", [])  # progress and my_engine() do not run it


def run_install_cell(found, monkeypatch):
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found if name == "llmcourse" else None)
    monkeypatch.setattr(subprocess, "check_call", lambda command: calls.append(command))
    monkeypatch.setattr(sys, "path", list(sys.path))  # addsitedir appends to it
    exec(install_source("https://github.com/someone/course", "spring"), {})
    return calls


def test_the_install_cell_does_nothing_where_llmcourse_is_installed(monkeypatch):
    assert run_install_cell(SimpleNamespace(name="llmcourse"), monkeypatch) == []


def test_the_install_cell_installs_the_course_from_the_repository_where_it_is_missing(monkeypatch):
    calls = run_install_cell(None, monkeypatch)
    requirement = "llmcourse[course] @ git+https://github.com/someone/course@spring"
    assert requirement == install_requirement("https://github.com/someone/course", "spring")
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", requirement]]


def test_changing_the_repository_rewrites_only_the_install_cells(tmp_path):
    """What `python -m llmcourse release` does first: the cell's source changes, nothing else; again, nothing."""
    name = CHAPTERS[0]
    (tmp_path / "solutions" / name).mkdir(parents=True)
    committed = ROOT / "solutions" / name / f"{name}.ipynb"
    copy = shutil.copy(committed, tmp_path / "solutions" / name)
    config = (ROOT / "_config.yml").read_text(encoding="utf-8")
    url, _ = repository(ROOT)
    (tmp_path / "_config.yml").write_text(config.replace(url, "https://github.com/someone/course"), encoding="utf-8")
    assert set_install_cells(tmp_path, [name]) == [name]
    assert set_install_cells(tmp_path, [name]) == []
    before, after = code_cells(committed), code_cells(Path(copy))
    assert "git+https://github.com/someone/course@main" in "".join(after[0]["source"])
    after[0]["source"] = before[0]["source"]
    assert after == before


def test_adding_the_install_cell_keeps_the_stored_outputs_as_refresh_writes_them(tmp_path):
    """A notebook without the cell gets it first, numbered as a fresh run would number it: the committed
    notebooks are exactly that, so neither they nor their stored outputs need running again."""
    name = CHAPTERS[0]
    committed = ROOT / "solutions" / name / f"{name}.ipynb"
    nb = json.loads(committed.read_text(encoding="utf-8"))
    nb["cells"] = [c for c in nb["cells"] if c.get("id") != INSTALL_CELL_ID]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["execution_count"] -= 1
            for output in cell["outputs"]:
                if output.get("execution_count") is not None:
                    output["execution_count"] -= 1
    without = tmp_path / f"{name}.ipynb"
    without.write_text(json.dumps(nb, ensure_ascii=False, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert set_install_cell(without, *repository(ROOT))
    assert without.read_bytes() == committed.read_bytes()


def book_extension():
    spec = importlib.util.spec_from_file_location("llmcourse_book", ROOT / "_ext" / "llmcourse_book.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_urls(pagename, hub):
    """The launch buttons of page `pagename` as sphinx-book-theme makes them from _config.yml (with a JupyterHub
    at `hub`), after the book's extension rewrote them: {button text: url}."""
    from sphinx_book_theme.header_buttons.launch import add_launch_buttons

    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    url, branch = repository(ROOT)
    org, repo = url.removeprefix("https://github.com/").split("/")
    app = SimpleNamespace(
        env=SimpleNamespace(doc2path=lambda name: ROOT / f"{name}.ipynb", metadata={pagename: {"kernelspec": {}}}),
        config={
            "html_theme_options": {
                "launch_buttons": {**config["launch_buttons"], "jupyterhub_url": hub},
                "repository_url": url,
                "repository_branch": branch,
                "path_to_docs": config["repository"]["path_to_book"],
            }
        },
    )
    context = {
        "pagename": pagename,
        "sourcename": f"{pagename}.ipynb",
        "header_buttons": [],
        "github_url": "https://github.com",
        "github_user": org,
        "github_repo": repo,
    }
    add_launch_buttons(app, pagename, "page.html", context, None)
    assert context["header_buttons"], "the theme made no launch buttons"
    book_extension()._on_launch_buttons(app, pagename, "page.html", context, None)
    return {b["text"]: b["url"] for group in context["header_buttons"] for b in group["buttons"]}


@pytest.mark.parametrize("name", CHAPTERS)
def test_launch_buttons_open_the_exercise_notebook(name):
    url, branch = repository(ROOT)
    org, repo = url.removeprefix("https://github.com/").split("/")
    exercise = f"chapters/{name}/{name}.ipynb"
    urls = launch_urls(f"solutions/{name}/{name}", hub="https://hub.example.edu")
    assert urls == {
        "Binder": f"https://mybinder.org/v2/gh/{org}/{repo}/{branch}?urlpath=lab/tree/{exercise}",
        "Colab": f"https://colab.research.google.com/github/{org}/{repo}/blob/{branch}/{exercise}",
        "JupyterHub": (
            f"https://hub.example.edu/hub/user-redirect/git-pull?repo=https%3A//github.com/{org}/{repo}"
            f"&urlpath=lab/tree/{repo}/{exercise}&branch={branch}"
        ),
    }
    assert (ROOT / exercise).is_file()


def test_binder_builds_the_cpu_torch_the_course_pins_and_the_notebooks_extras():
    """A launch button's Binder reads binder/ (not requirements.txt): the pinned torch's CPU build, the package with
    its `course` extra, a Python the package supports."""
    pinned = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    lines = [ln for ln in (ROOT / "binder" / "requirements.txt").read_text().splitlines() if not ln.startswith("#")]
    assert lines == [
        "--extra-index-url https://download.pytorch.org/whl/cpu",
        f"torch=={pinned}+cpu",
        "-e .[course]",
    ]
    floor = re.search(r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == f"python-{floor}"


def test_every_torch_install_the_docs_give_pins_the_required_torch():
    """The landing page told readers `pip install torch --index-url …/cpu` (whatever torch is newest) while README
    pinned it: every torch install in the book's pages, README and the instructor guide pins requirements.txt's."""
    pinned = re.search(r"^(torch==\S+)", (ROOT / "requirements.txt").read_text(encoding="utf-8"), re.M).group(1)
    pages = [ROOT / "README.md", ROOT / "intro.md", ROOT / "instructor.md", *ROOT.glob("*.md")]
    installs = [
        (page.name, line.strip())
        for page in dict.fromkeys(pages)
        for line in page.read_text(encoding="utf-8").splitlines()
        if re.search(r"pip install\b[^#]*\btorch\b(?!-)", line)
    ]
    assert len(installs) >= 2, installs  # README's and the landing page's
    for page, line in installs:
        assert f" {pinned} " in f" {line} ", f"{page}: {line!r} does not pin {pinned}"
