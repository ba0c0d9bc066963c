"""The Jupyter Book builds with zero warnings, and its pages hold what a reader needs: no grading
internals, the exercise notebooks and the llmcourse wheel to download, maths that renders without a
network, a menu that opens on a phone, streamed text that reads as text.

The book is built once per session from the course run's notebooks (tests/course_run.py), without executing them
again. The checks of what a browser shows run headless
Chromium on the built files, offline, and are skipped where no Chromium is installed."""

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from .course_run import source

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


IGNORED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "_build",
    "__pycache__",
    ".pytest_cache",
    ".ipynb_checkpoints",
    "submitted",
    "autograded",
    "feedback",
    "gradebook.db",
    "grades.csv",
)


@pytest.fixture(scope="session")
def book(tmp_path_factory, course_run):
    """The book, built with instructor.md's command and flags, from a copy of the course whose chapter pages hold the
    outputs of the course run (ada's notebooks: the solutions run on the current code, tests/course_run.py), so
    that no notebook is executed twice; the copy's _config.yml says `execute_notebooks: off` for that (the
    published build executes every page itself)."""
    from .course_run import with_outputs_of

    source = tmp_path_factory.mktemp("book_source") / "course"
    shutil.copytree(ROOT, source, ignore=IGNORED)
    config = (source / "_config.yml").read_text(encoding="utf-8")
    assert "  execute_notebooks: force" in config
    (source / "_config.yml").write_text(config.replace("  execute_notebooks: force", "  execute_notebooks: 'off'"))
    for name in CHAPTERS:
        stored = notebook(ROOT / "solutions" / name / f"{name}.ipynb")
        page_ = with_outputs_of(stored, course_run.autograded("ada", name))
        (source / "solutions" / name / f"{name}.ipynb").write_text(json.dumps(page_, indent=1), encoding="utf-8")
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    done = subprocess.run(
        [str(jb), "build", str(source), "--path-output", str(out), "-W", "-n", "--keep-going"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, f"book build failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    log = done.stdout + done.stderr
    sphinx_warnings = [line for line in log.splitlines() if "WARNING:" in line]  # not the kernel's "WARNING |"
    assert not sphinx_warnings, "\n".join(sphinx_warnings)  # -W makes them errors too
    assert "Executing" not in log, "the test build executed a notebook again"
    return out / "_build" / "html"


def page(book, rel):
    return (book / rel).read_text(encoding="utf-8")


def text(markup):
    """What a reader reads: the page without its tags, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def notebook(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------
# What the pages say


def test_landing_and_instructor_pages(book):
    landing = text(page(book, "intro.html"))
    assert "What you will build" in landing and "How grading works" in landing
    assert "coming next" not in landing.lower() and "to come" not in landing.lower()  # every chapter is there
    assert "<this repository>" not in landing
    assert "Python 3.11 or newer" in landing and "3.10" not in landing  # numpy 2.4 and transformers 5 need 3.11
    instructor = text(page(book, "instructor.html"))
    for command in [
        "nbgrader autograde",
        "nbgrader generate_feedback",
        "nbgrader export",
        "python -m llmcourse release",
    ]:
        assert command in instructor


def test_python_floor_is_stated_as_packaged():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"] == ">=3.11"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "Python 3.11" in readme and "3.10" not in readme
    assert "download.pytorch.org/whl/cpu" in readme  # how to get the CPU-only torch


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_pages_are_executed_with_solutions_behind_toggles(book, name):
    html_ = page(book, f"solutions/{name}/{name}.html")
    assert not re.search(r'class="[^"]*\boutput (traceback|error)\b', html_)  # no cell failed (not prose)
    assert "✓ " in html_  # the checks ran and passed
    assert "tag_hide-input" in html_  # solution code sits behind a toggle
    assert re.search(r'<img[^>]+src="[^"]+\.png"|class="plotly-graph-div"', html_), "no figure on the page"
    link = re.search(rf'href="([^"]*_downloads/[^"]*{name}\.ipynb)"', html_)
    assert link, "no link to the exercise notebook"
    target = (book / f"solutions/{name}" / link.group(1)).resolve()
    student = target.read_bytes()
    assert b"BEGIN SOLUTION" not in student and b"HIDDEN TESTS" not in student  # the exercise version
    if any(c.get("metadata", {}).get("nbgrader", {}).get("solution") for c in notebook(target)["cells"]):
        assert b"raise NotImplementedError()" in student  # (chapter 12 has no exercise of its own)


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_pages_show_no_grading_internals(book, name):
    html_ = page(book, f"solutions/{name}/{name}.html")
    for marker in ["BEGIN HIDDEN", "END HIDDEN", "HIDDEN TESTS", "BEGIN SOLUTION", "END SOLUTION"]:
        assert marker not in html_, f"{marker!r} on the page"
    shown = text(html_)
    nb = notebook(ROOT / "solutions" / name / f"{name}.ipynb")
    hidden = visible = solutions = 0
    for cell in nb["cells"]:
        grading = cell.get("metadata", {}).get("nbgrader", {})
        src = source(cell)
        if cell["cell_type"] != "code":
            continue
        if "BEGIN HIDDEN TESTS" in src:
            before, rest = src.split("### BEGIN HIDDEN TESTS", 1)
            secret, after = rest.split("### END HIDDEN TESTS", 1)
            for line in secret.strip().splitlines():
                if line.strip():
                    assert line.strip() not in shown, f"hidden test on the page: {line.strip()!r}"
                    hidden += 1
            for line in (before + after).strip().splitlines():
                assert line.strip() in shown, f"visible check missing from the page: {line.strip()!r}"
                visible += 1
        if grading.get("solution") and "BEGIN SOLUTION" in src:
            body = src.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
            for line in body.strip().splitlines():
                assert line.strip() in shown, f"solution code missing from the page: {line.strip()!r}"
            solutions += 1
    exercises = [c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    assert solutions == len(exercises), "an exercise without its solution in the source notebook"
    if hidden:
        assert visible


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_pages_show_what_the_visible_checks_print_and_not_the_hidden(book, course_run, name):
    """The page of a check cell shows the ✓ lines of its visible part, never a line that only the hidden part
    printed (the book strips the hidden tests before it runs a page; here its outputs come from ada's run, where
    they ran)."""
    from .course_run import HIDDEN_BEGIN, code_cells, printed, visible_outputs

    shown = text(page(book, f"solutions/{name}/{name}.html"))
    for cell in code_cells(course_run.autograded("ada", name)):
        if HIDDEN_BEGIN not in source(cell):
            continue
        visible = printed({"outputs": visible_outputs(source(cell), cell["outputs"])})
        for line in visible.splitlines():
            assert line.strip() in shown, f"{cell['id']}: the visible check's {line!r} is not on the page"
        for line in printed(cell)[len(visible) :].splitlines():
            if line.strip() and line not in visible.splitlines():
                assert line.strip() not in shown, f"{cell['id']}: the hidden check's {line!r} is on the page"


def book_extension():
    sys.path.insert(0, str(ROOT / "_ext"))
    try:
        import llmcourse_book
    finally:
        sys.path.pop(0)
    return llmcourse_book


@pytest.mark.parametrize(
    "printed",
    [
        "✗ capstone llm_engine — 07_batching (paged_attention): does not pass its check",
        "ZeroDivisionError   Traceback (most recent call last)",
    ],
)
def test_a_page_whose_output_shows_a_failure_stops_the_build_with_it(printed):
    """As myst-nb renders a cell: its outputs in a container of class cell_output (the real pages have them: the
    next test). The extension's doctree-read handler raises, naming the page and the line."""
    from docutils import nodes
    from sphinx.errors import ExtensionError

    ext = book_extension()
    doctree = nodes.document(None, None)
    output = nodes.container(classes=["cell_output", "docutils"])
    output += nodes.literal_block("", "✓ softmax — 12 cases\n" + printed)
    doctree += output
    app = type("App", (), {"env": type("Env", (), {"docname": "solutions/12_capstone/12_capstone"})()})()
    with pytest.raises(
        ExtensionError, match=r"12_capstone: a cell's output shows a failure[\s\S]*" + re.escape(printed)
    ):
        ext._on_doctree_read(app, doctree)
    doctree.remove(output)
    ext._on_doctree_read(app, doctree)  # nothing failing: the page is published


@pytest.mark.parametrize("name", ["03_attention", "12_capstone"])
def test_check_lines_sit_in_cell_outputs_where_the_extension_looks(book, name):
    html_ = page(book, f"solutions/{name}/{name}.html")
    after = html_.split('class="cell_output')[1:]  # what follows the start of each cell_output container
    assert after and any("✓" in text(chunk.split("</pre>", 1)[0]) for chunk in after), "no ✓ in a cell_output"


@pytest.mark.parametrize("name", CHAPTERS)
def test_download_button_gives_the_exercise_notebook(book, name):
    html_ = page(book, f"solutions/{name}/{name}.html")
    link = re.search(r'href="([^"]*_sources/[^"]*\.ipynb)"[^>]*\n?[^>]*btn-download-source-button', html_)
    assert link, "no download-source button"
    served = (book / f"solutions/{name}" / link.group(1)).resolve()
    assert served.read_bytes() == (ROOT / "chapters" / name / f"{name}.ipynb").read_bytes()
    for leaked in [b"BEGIN SOLUTION", b"HIDDEN TESTS", b"### END SOLUTION"]:
        assert leaked not in served.read_bytes()


def test_stream_output_reads_as_text(book):
    """Chapter 00 streams ~60 tokens with print(piece, end="", flush=True): one block of a few lines
    on the page, not one token per line."""
    html_ = page(book, "solutions/00_pipeline/00_pipeline.html")
    cells = html_.split('<div class="cell ')
    streamed = [c for c in cells if "llmcourse.stream(" in text(c) and 'class="output stream' in c]
    assert len(streamed) == 1, "no streamed cell with an output on the page"
    out = streamed[0].split('class="output stream', 1)[1]
    shown = text(re.search(r"<pre>(.*?)</pre>", out, re.S).group(1)).strip("\n")
    lines = shown.splitlines()
    assert 2 <= len(lines) <= 20, f"{len(lines)} lines: {shown[:300]!r}"
    assert max(len(line.split()) for line in lines) >= 4, shown


def test_benchmarks_page_shows_the_figures(book):
    html_ = page(book, "benchmarks.html")
    assert "python -m llmcourse bench" in text(html_) and "roofline" in text(html_)
    shown = set(re.findall(r'<img[^>]+src="[^"]*(bench_\w+)\.png"', html_))
    assert shown >= {"bench_decode", "bench_prefill", "bench_kv_cache", "bench_batching"}, shown


# ----------------------------------------------------------------------------------------------
# Launch buttons (Binder, Colab, JupyterHub): the exercise notebook in the configured repository


def launch_buttons(html_):
    """{button text: url} of the page's launch buttons (the theme's links that say "Launch on …")."""
    found = re.findall(r'<a href="([^"]+)" target="_blank"[^>]*?title="Launch on ([^"]+)"', html_, re.S)
    return {name: html.unescape(url) for url, name in found}


def configured_launchers():
    import yaml  # comes with jupyter-book

    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    buttons, repo = config["launch_buttons"], config["repository"]
    names = {"binderhub_url": "Binder", "colab_url": "Colab", "jupyterhub_url": "JupyterHub"}
    return {names[key]: buttons[key].rstrip("/") for key in names if buttons.get(key)}, repo["url"], repo["branch"]


@pytest.mark.parametrize("name", CHAPTERS)
def test_launch_buttons_open_the_exercise_notebook(book, name):
    launchers, url, branch = configured_launchers()
    assert {"Binder", "Colab"} <= set(launchers)
    org, repo = url.removeprefix("https://github.com/").split("/")
    exercise = f"chapters/{name}/{name}.ipynb"
    html_ = page(book, f"solutions/{name}/{name}.html")
    assert 'find_spec("llmcourse")' not in text(html_)  # the install cell is for kernels, not for the page
    buttons = launch_buttons(html_)
    assert set(buttons) == set(launchers), buttons
    for where, target in buttons.items():
        assert target.startswith(launchers[where] + "/"), (where, target)
        assert "solutions/" not in target and target.count(exercise) == 1, (where, target)
    assert buttons["Binder"] == f"{launchers['Binder']}/v2/gh/{org}/{repo}/{branch}?urlpath=lab/tree/{exercise}"
    assert buttons["Colab"] == f"{launchers['Colab']}/github/{org}/{repo}/blob/{branch}/{exercise}"
    if "JupyterHub" in buttons:
        assert f"repo=https://github.com/{org}/{repo}" in buttons["JupyterHub"].replace("%3A", ":")
        assert f"urlpath=lab/tree/{repo}/{exercise}" in buttons["JupyterHub"]
    assert (ROOT / exercise).is_file()


def test_other_pages_have_no_launch_buttons(book):
    for rel in ["intro.html", "benchmarks.html", "instructor.html"]:
        assert launch_buttons(page(book, rel)) == {}, rel


# ----------------------------------------------------------------------------------------------
# What a reader downloads to work offline


def landing_links(book):
    hrefs = re.findall(r'href="([^"]+)"', page(book, "intro.html"))
    return {Path(h).name: (book / h) for h in hrefs if h.startswith("downloads/")}


def test_landing_page_offers_chapters_zip_and_wheel(book):
    links = landing_links(book)
    assert "llmcourse-chapters.zip" in links, links
    wheels = [name for name in links if name.endswith(".whl")]
    assert len(wheels) == 1, links
    for target in links.values():
        assert target.is_file(), f"the landing page links to {target}, which the build lacks"
    built = sorted(p.name for p in (book / "downloads").glob("*.whl"))
    assert built == wheels  # the wheel the page names is the one this version builds
    shown = text(page(book, "intro.html"))
    assert f'pip install "{wheels[0]}[course]"' in shown and "jupyter lab chapters/" in shown


def test_chapters_zip_holds_every_exercise_notebook(book):
    with zipfile.ZipFile(book / "downloads" / "llmcourse-chapters.zip") as zf:
        names = set(zf.namelist())
        expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "chapters").glob("*/*.ipynb")}
        assert expected and names == expected
        for name in expected:
            assert zf.read(name) == (ROOT / name).read_bytes()


def test_wheel_holds_the_models_and_runs_alone(book, tmp_path):
    (wheel,) = (book / "downloads").glob("llmcourse-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for model in (ROOT / "llmcourse" / "models").iterdir():
            for f in ["config.json", "model.safetensors"]:
                assert f"llmcourse/models/{model.name}/{f}" in names
                assert zf.read(f"llmcourse/models/{model.name}/{f}") == (model / f).read_bytes()
        for data in (ROOT / "llmcourse" / "data").iterdir():
            assert f"llmcourse/data/{data.name}" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(meta).decode()
        zf.extractall(tmp_path / "site")
    assert "Requires-Python: >=3.11" in metadata
    assert "Provides-Extra: course" in metadata
    for need in [
        "jupyterlab",
        "ipywidgets",
        "matplotlib",
        "plotly",
        "transformers",
    ]:  # what the chapter notebooks import besides llmcourse
        assert re.search(rf"Requires-Dist: {need}\b.*extra == \"course\"", metadata), need
    # The installed wheel alone (not this checkout) loads the bundled model and the tokenizer offline.
    probe = (
        "import llmcourse, pathlib, sys; "
        "assert pathlib.Path(llmcourse.__file__).is_relative_to(sys.argv[1]), llmcourse.__file__; "
        "tok = llmcourse.get_tokenizer(); m = llmcourse.load_model('gpt2-shakespeare', device='cpu'); "
        "print(llmcourse.generate_text(m, tok, 'ROMEO:', max_new_tokens=5))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "site")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


# ----------------------------------------------------------------------------------------------
# What a browser shows (headless Chromium, offline)

CHROMIUM = next((shutil.which(n) for n in ["chromium", "chromium-browser", "google-chrome"] if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed")


SMALLEST_WINDOW = 500  # headless Chromium lays pages out at least this wide, whatever --window-size says


def browse(book, rel, *, width=1400, probe=None):
    """The DOM of page ``rel`` after its scripts ran, in headless Chromium with no network. ``probe``:
    JavaScript run 1 s after load, whose JSON-able result (or what the promise it returns resolves to)
    comes back (from a copy of the page that carries the probe, removed afterwards). A phone's width
    (below 500 px) needs a probe: the page is then shown in a frame that wide, as a phone would."""
    target = book / rel
    made = []
    if probe is not None:
        script = (
            "<script>window.addEventListener('load', () => setTimeout(async () => {"
            "let r; try { r = await (async () => { %s })(); } catch (e) { r = {error: String(e)}; }"
            "const top = window.top.document, p = top.createElement('pre'); p.id = 'llmcourse-probe';"
            "p.textContent = JSON.stringify(r); top.body.appendChild(p);"
            "}, 1000));</script></body>" % probe
        )
        target = target.with_name(f"_probe_{target.name}")
        target.write_text(page(book, rel).replace("</body>", script, 1), encoding="utf-8")
        made.append(target)
    if width < SMALLEST_WINDOW:
        assert probe is not None, "a phone-width page can only be probed"
        frame = target.with_name(f"_phone_{target.name}")
        frame.write_text(
            f'<html><body style="margin:0"><iframe src="{target.name}" '
            f'style="width:{width}px;height:900px;border:0"></iframe></body></html>',
            encoding="utf-8",
        )
        made.append(frame)
        target = frame
    try:
        with tempfile.TemporaryDirectory() as profile:
            done = subprocess.run(
                [
                    CHROMIUM,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    "--host-resolver-rules=MAP * ~NOTFOUND",  # offline
                    "--allow-file-access-from-files",  # the probe in a phone-width frame writes to the page around it
                    f"--window-size={max(width, SMALLEST_WINDOW)},900",
                    "--virtual-time-budget=8000",
                    "--dump-dom",
                    target.as_uri(),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        for path in made:
            path.unlink()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    if probe is None:
        return dom
    found = re.search(r'<pre id="llmcourse-probe">(.*?)</pre>', dom, re.S)
    assert found, "the probe did not run"
    return json.loads(html.unescape(found.group(1)))


INTERACTIVE = [name for name in CHAPTERS if name >= "02"]  # from chapter 02 on, every chapter has some

PLOTLY_PROBE = """
    const figures = [...document.querySelectorAll('.plotly-graph-div')];
    const found = [];
    for (const gd of figures) {
        const svg = () => [...gd.querySelectorAll('.main-svg')].map(s => s.innerHTML).join('');
        const controls = [...(gd.layout.updatemenus || []).flatMap(m => m.buttons || []),
                          ...(gd.layout.sliders || []).flatMap(s => s.steps || [])];
        const box = gd.getBoundingClientRect(), title = gd.querySelector('.gtitle');
        const t = title ? title.getBoundingClientRect() : null;
        const r = {id: gd.id, drawn: svg().length > 0, traces: gd.data.length, controls: controls.length,
                   width: box.width, page: document.documentElement.clientWidth, window: window.innerWidth,
                   title: t === null || (t.top >= box.top - 1 && t.left >= box.left - 1 && t.right <= box.right + 1)};
        if (controls.length > 1) {  // what a click on the last menu entry or slider step runs, in the page
            const before = svg();
            const steps = (gd.layout.sliders || []).flatMap(s => s.steps || []);
            let pick = controls[controls.length - 1];
            if (steps.length > 1 && gd.layout.sliders[0].active === steps.length - 1) {
                pick = steps[0];  // a replay opens at its last step: go to the first
            }
            // Plotly.animate (a replay's slider) redraws at once, but its promise may not settle in a headless
            // browser: wait for it or 1 s
            const ran = Plotly[pick.method](gd, ...pick.args);
            await Promise.race([ran, new Promise(done => setTimeout(done, 1000))]);
            await new Promise(done => setTimeout(done, 300));
            r.changed = svg() !== before;
        }
        found.push(r);
    }
    const d = document.documentElement;
    return {plotly: typeof Plotly, figures: found, scroll: d.scrollWidth, client: d.clientWidth};
"""


@needs_chromium
@pytest.mark.parametrize("width", [1400, 400])
@pytest.mark.parametrize("name", INTERACTIVE)
def test_interactive_figures_work_offline_without_a_kernel(book, name, width):
    """The chapter's Plotly figures draw from the bundled plotly.js with no network, fit the page, and
    their menus and sliders change what is drawn (client-side: a static page has no kernel). Their titles are
    not clipped, and the page is no wider than the window: what is wider scrolls inside its own box."""
    found = browse(book, f"solutions/{name}/{name}.html", width=width, probe=PLOTLY_PROBE)
    assert found.get("plotly") == "object", found
    assert found["scroll"] <= found["client"] + 1, f"the page is {found['scroll']} px wide at {width} px"
    figures = found["figures"]
    assert figures, "no interactive figure on the page"
    for figure in figures:
        assert figure["window"] == width, figure
        assert figure["drawn"] and figure["traces"] > 0, figure
        assert figure["width"] <= figure["page"], figure
        assert figure["title"], f"the title of {figure['id']} is clipped at {width} px"
        if figure["controls"] > 1:
            assert figure["changed"], figure
    assert any(figure["controls"] > 1 for figure in figures), "no figure has a menu or a slider"


WIDTH_PROBE = """
    const d = document.documentElement, limit = d.clientWidth + 1;
    const wide = [...document.querySelectorAll('body *')]
        .filter(e => e.getBoundingClientRect().right > limit && getComputedStyle(e).position !== 'fixed')
        .filter(e => { for (let a = e.parentElement; a; a = a.parentElement) {  // not inside a box that scrolls
            if (getComputedStyle(a).overflowX !== 'visible') return false; } return true; })
        .filter(e => ![...e.children].some(c => c.getBoundingClientRect().right > limit))  // the innermost
        .slice(0, 3).map(e => `${e.tagName.toLowerCase()}.${e.className}: ${e.textContent.slice(0, 60)}`);
    return {scroll: d.scrollWidth, client: d.clientWidth, wide: wide};
"""
OTHER_PAGES = ["intro.html", "benchmarks.html", "instructor.html"] + [
    f"solutions/{name}/{name}.html" for name in CHAPTERS if name not in INTERACTIVE
]


@needs_chromium
@pytest.mark.parametrize("rel", OTHER_PAGES)
def test_no_page_is_wider_than_a_phone(book, rel):
    """At 400 px no page scrolls sideways (chapter 11's `model.layers.N.self_attn.rotary_emb.inv_freq` once made it
    429 px wide): what is wider (a table, a code block) scrolls inside its own box. The chapters with figures are
    held to it by test_interactive_figures_work_offline_without_a_kernel; these are the others."""
    found = browse(book, rel, width=400, probe=WIDTH_PROBE)
    assert found["scroll"] <= found["client"] + 1, f"{rel} is {found['scroll']} px wide at 400 px: {found['wide']}"


def test_pages_load_plotly_only_where_needed(book):
    for name in CHAPTERS:
        scripts = re.findall(r'<script[^>]+src="([^"]*plotly[^"]*)"', page(book, f"solutions/{name}/{name}.html"))
        assert len(scripts) == (1 if name in INTERACTIVE else 0), (name, scripts)
    assert not re.search(r'<script[^>]+src="[^"]*plotly', page(book, "intro.html"))
    assert (book / "_static" / "plotly.min.js").stat().st_size > 1_000_000


def test_maths_uses_the_bundled_mathjax(book):
    html_ = page(book, "solutions/00_pipeline/00_pipeline.html")
    assert "cdn.jsdelivr" not in html_ and "mathjax@" not in html_
    scripts = re.findall(r'<script[^>]+src="([^"]*mathjax[^"]*)"', html_, re.I)
    assert len(scripts) == 1, scripts  # loaded once, from the build
    local = (book / "solutions/00_pipeline" / scripts[0].split("?")[0]).resolve()
    assert local.is_file() and local.is_relative_to(book.resolve())
    assert (local.parent / "output/chtml/fonts/woff-v2/MathJax_Main-Regular.woff").is_file()
    assert not re.search(r"<script[^>]+mathjax", page(book, "instructor.html"), re.I)  # no maths there, no MathJax


@needs_chromium
def test_maths_renders_offline(book):
    dom = browse(book, "solutions/00_pipeline/00_pipeline.html")
    assert dom.count("<mjx-container") >= 3
    assert r"\(" not in text(dom) and r"\sum" not in text(dom)


@needs_chromium
def test_menu_opens_on_a_phone(book):
    """At 400 px the ☰ button opens the chapter list (pydata-sphinx-theme needs navbar_persistent: [])."""
    found = browse(
        book,
        "intro.html",
        width=400,
        probe="""
        const buttons = [...document.querySelectorAll('button.primary-toggle')]
            .filter(b => b.offsetParent !== null && b.getBoundingClientRect().width > 0);
        if (!buttons.length) return {visible: 0};
        buttons[0].click();
        const dialog = document.querySelector('#pst-primary-sidebar-modal');
        const links = dialog ? [...dialog.querySelectorAll('a')].map(a => a.textContent.trim()) : [];
        return {visible: buttons.length, open: !!(dialog && dialog.open), links: links};
    """,
    )
    assert found.get("visible"), found
    assert found["open"], found
    assert any("The pipeline" in link for link in found["links"]), found


@needs_chromium
def test_wide_tables_show_that_they_scroll_on_a_phone(book):
    found = browse(
        book,
        "benchmarks.html",
        width=400,
        probe="""
        return [...document.querySelectorAll('.pst-scrollable-table-container')].map(c => {
            const s = getComputedStyle(c);
            return {overflows: c.scrollWidth > c.clientWidth + 1, overflowX: s.overflowX,
                    background: s.backgroundImage};
        });
    """,
    )
    wide = [t for t in found if t["overflows"]]
    assert wide, f"no table overflows at 400 px: {found}"
    for table in wide:
        assert table["overflowX"] in ("auto", "scroll")
        assert table["background"].count("radial-gradient") == 2, table  # the scroll shadows


def test_no_show_code_toggle_is_empty():
    """A cell whose code is behind a "show" toggle keeps what it shows: a toggle over a cell whose output is removed
    too (a live widget's, which the static page cannot run) stands alone on the page, a toggle with nothing made by
    it. Such a cell is removed from the page whole (`remove-cell`); its replay figure follows it."""
    both = [
        (name, cell.get("id"))
        for name in CHAPTERS
        for cell in notebook(ROOT / "solutions" / name / f"{name}.ipynb")["cells"]
        if {"hide-input", "remove-output"} <= set(cell.get("metadata", {}).get("tags", []))
    ]
    assert not both, f"cells with a show-code toggle and no output on the page: {both}"
