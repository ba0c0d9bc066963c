"""Sphinx extension for the llmcourse book (loaded by _config.yml: sphinx.local_extensions).

- The chapter pages are the instructor notebooks (nbgrader *source*). Before a page is parsed and
  executed, its nbgrader markers go: hidden tests (``### BEGIN HIDDEN TESTS`` … ``### END HIDDEN
  TESTS``) are removed with what they print, and the ``BEGIN SOLUTION`` / ``END SOLUTION`` marker
  lines are dropped while the solution itself stays on the page (behind its toggle).
- The page's "download source" button hands out the exercise notebook (``chapters/NN/NN.ipynb``),
  never the instructor notebook, and so do its launch buttons (Binder, Colab, JupyterHub: their URLs name
  ``chapters/NN/NN.ipynb`` in the repository that _config.yml's ``repository: url`` names).
- A page whose cell outputs show a failure (a ✗, "does not pass", a traceback) stops the build with that
  line: the book never publishes the course's own solution failing its check.
- Stream outputs are merged as Jupyter shows them: myst-nb's ``coalesce_streams`` strips each piece
  and ends it with a newline, which turns a token-by-token stream into one token per line.
- The build offers what a reader needs to work offline: ``downloads/llmcourse-chapters.zip`` (the
  exercise notebooks) and the ``llmcourse`` wheel (the engine, its checks, the bundled models).
- Interactive figures (``llmcourse.course.figures.show``) are Plotly figures: pages that hold one load the
  plotly.js that ships in the plotly package, copied into the build, so they work offline.
- Static files from ``_ext/static/`` (not the book's ``_static/``, whose every .js jupyter-book loads on
  every page): ``llmcourse.css`` (wide tables show that they scroll on narrow screens) and MathJax 3.2.2
  (``mathjax/``: ``es5/tex-chtml-full.js`` and its CHTML fonts from the npm package, Apache-2.0), which
  ``mathjax_path`` in _config.yml points to, so that maths renders without a network.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

from llmcourse.course.refresh import FAILURE_MARKS, merge_streams

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
STATIC = Path(__file__).resolve().parent / "static"
DOWNLOADS = "downloads"  # folder of the HTML output that holds the reader's downloads
CHAPTERS_ZIP = "llmcourse-chapters.zip"
PLOTLY_JS = "plotly.min.js"

_HIDDEN = re.compile(r"^[^\n]*BEGIN HIDDEN TESTS[^\n]*\n.*?^[^\n]*END HIDDEN TESTS[^\n]*(\n|$)", re.M | re.S)
_SOLUTION_MARKER = re.compile(r"^[^\n]*(BEGIN|END) SOLUTION[^\n]*(\n|$)", re.M)


def strip_grading_markers(source: str) -> str:
    """A cell's source as the book shows it: no hidden tests, no solution markers."""
    if "BEGIN HIDDEN TESTS" in source and not _HIDDEN.search(source):
        raise ValueError("a cell has 'BEGIN HIDDEN TESTS' without a matching 'END HIDDEN TESTS'")
    source = _HIDDEN.sub("", source)
    source = _SOLUTION_MARKER.sub("", source)
    return source.rstrip("\n")


def book_notebook(text: str) -> str:
    """The notebook JSON ``text`` with every cell's grading markers removed."""
    nb = json.loads(text)
    for cell in nb.get("cells", []):
        source = cell.get("source", "")
        joined = "".join(source) if isinstance(source, list) else source
        if "HIDDEN TESTS" in joined or "SOLUTION" in joined:
            cell["source"] = strip_grading_markers(joined)
    return json.dumps(nb, ensure_ascii=False, indent=1)


def _on_source_read(app: Sphinx, docname: str, source: list) -> None:
    if str(app.env.doc2path(docname)).endswith(".ipynb"):
        try:
            source[0] = book_notebook(source[0])
        except ValueError as error:
            logger.warning(f"{docname}: {error}", location=docname)


def coalesce_streams(outputs):
    """Merge consecutive stream outputs of the same name by plain concatenation, as Jupyter shows
    them (a token-by-token ``print(piece, end="", flush=True)`` reads as one text), then apply
    backspaces and carriage returns like myst-nb does."""
    merged = [output.copy() if output["output_type"] == "stream" else output for output in merge_streams(outputs)]
    for output in merged:
        if output["output_type"] == "stream":
            text = output["text"]
            while True:
                shorter = re.sub(r"[^\n]\x08", "", text)
                if shorter == text:
                    break
                text = shorter
            output["text"] = re.sub(r".*\r(?=[^\n])", "", text)
    return merged


def _patch_myst_nb() -> None:
    from myst_nb.core import render

    if not hasattr(render, "coalesce_streams"):
        raise ExtensionError(
            "llmcourse_book: myst_nb.core.render.coalesce_streams is gone; "
            "check how this myst-nb version merges stream outputs"
        )
    render.coalesce_streams = coalesce_streams


def release_notebook(docname: str) -> Path | None:
    """``chapters/NN/NN.ipynb`` for the page ``solutions/NN/NN``, else None."""
    parts = docname.split("/")
    if len(parts) == 3 and parts[0] == "solutions":
        return ROOT / "chapters" / parts[1] / (parts[2] + ".ipynb")
    return None


def build_chapters_zip(dest: Path) -> Path:
    """The exercise notebooks, as ``chapters/NN_topic/NN_topic.ipynb`` in a zip."""
    path = dest / CHAPTERS_ZIP
    notebooks = sorted((ROOT / "chapters").glob("*/*.ipynb"))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for notebook in notebooks:
            if ".ipynb_checkpoints" not in notebook.parts:
                zf.write(notebook, notebook.relative_to(ROOT).as_posix())
    return path


def build_wheel(dest: Path) -> Path:
    """The llmcourse wheel (package, data files and bundled models), built offline from a clean copy
    of the package so that the work tree gets no build/ or egg-info."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ["pyproject.toml", "README.md"]:
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(
            ROOT / "llmcourse",
            src / "llmcourse",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints"),
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                str(src),
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--quiet",
                "--wheel-dir",
                str(Path(tmp) / "wheels"),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ExtensionError(f"llmcourse_book: building the llmcourse wheel failed:\n{done.stdout}\n{done.stderr}")
        (wheel,) = (Path(tmp) / "wheels").glob("llmcourse-*.whl")
        for old in dest.glob("llmcourse-*.whl"):
            old.unlink()
        return Path(shutil.copy2(wheel, dest / wheel.name))


def _on_build_finished(app: Sphinx, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    # The download button of a chapter page gives the exercise notebook, not the instructor's.
    for docname in sorted(app.env.found_docs):
        if not str(app.env.doc2path(docname)).endswith(".ipynb"):
            continue
        served = outdir / "_sources" / (docname + ".ipynb")
        release = release_notebook(docname)
        if release is None or not release.is_file():
            logger.warning(
                f"{docname}: no exercise notebook to offer for download (expected {release}); "
                "run `python -m llmcourse release`",
                location=docname,
            )
            served.unlink(missing_ok=True)
        elif served.exists():
            shutil.copyfile(release, served)
    shutil.copyfile(plotly_js(), outdir / "_static" / PLOTLY_JS)
    # What a reader downloads to do the exercises offline.
    dest = outdir / DOWNLOADS
    dest.mkdir(exist_ok=True)
    build_chapters_zip(dest)
    build_wheel(dest)


def plotly_js() -> Path:
    """plotly.js as bundled in the installed plotly package (the version its Python side writes for)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / PLOTLY_JS


def _on_html_page_context(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if "Plotly.newPlot" in context.get("body", ""):
        app.add_js_file(PLOTLY_JS)  # this page only: Sphinx resets the list after each page


def exercise_launch_url(url: str, docname: str) -> str:
    """A launch button's URL for the page ``solutions/NN/NN``, opening ``chapters/NN/NN.ipynb`` instead.

    sphinx-book-theme puts the page's path in the repository, ``solutions/NN/NN.ipynb``, into each launch URL
    (Binder's ``urlpath=lab/tree/<path>``, Colab's ``…/blob/<branch>/<path>``, JupyterHub's nbgitpuller
    ``urlpath=lab/tree/<repo>/<path>``); it is replaced by the exercise notebook's path."""
    release = release_notebook(docname)
    if release is None:
        return url
    source = f"{docname}.ipynb"
    if url.count(source) != 1:
        raise ValueError(f"a launch URL without the page's notebook {source!r} once: {url}")
    return url.replace(source, release.relative_to(ROOT).as_posix())


def _on_launch_buttons(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Launch buttons (Binder, Colab, JupyterHub: _config.yml's launch_buttons) open the exercise notebook, not
    the instructor's; a page with no exercise notebook gets none (the build warns about it)."""
    buttons = context.get("header_buttons") or []
    for group in [b for b in buttons if b.get("label") == "launch-buttons"]:
        release = release_notebook(pagename)
        if release is None or not release.is_file():
            buttons.remove(group)
            continue
        try:
            for button in group.get("buttons", []):
                if "url" in button:
                    button["url"] = exercise_launch_url(button["url"], pagename)
        except ValueError as error:  # the theme builds its URLs differently now: no button rather than a wrong one
            logger.warning(f"{pagename}: launch buttons left out: {error}", location=pagename)
            buttons.remove(group)


def shown_failure(doctree) -> str | None:
    """The first line of a cell's output on a page that shows a failure (a ✗, "does not pass", a traceback), or
    None."""
    for node in doctree.findall(nodes.Element):
        if "cell_output" in node.get("classes", []):
            for line in node.astext().splitlines():
                if any(mark in line for mark in FAILURE_MARKS):
                    return line.strip()[:300]
    return None


def _on_doctree_read(app: Sphinx, doctree) -> None:
    failure = shown_failure(doctree)
    if failure is not None:
        raise ExtensionError(
            f"{app.env.docname}: a cell's output shows a failure, and a chapter page never publishes one:\n"
            f"  {failure}\n  fix the solution (or its check); a busy machine is no reason: the checks limit CPU time"
        )


def _on_config_inited(app: Sphinx, config) -> None:
    config.html_static_path = [*config.html_static_path, str(STATIC)]


def setup(app: Sphinx) -> dict:
    _patch_myst_nb()
    app.connect("config-inited", _on_config_inited)
    app.connect("source-read", _on_source_read)
    app.connect("doctree-read", _on_doctree_read)
    app.connect("html-page-context", _on_html_page_context)
    app.connect("html-page-context", _on_launch_buttons, priority=600)  # after sphinx-book-theme's (501) made them
    app.connect("build-finished", _on_build_finished)
    app.add_css_file("llmcourse.css")
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
