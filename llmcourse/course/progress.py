"""A learner's progress: their saved chapter notebooks read, their cells run and their checks graded.

It reads the *saved* notebooks (`chapters/NN_topic/NN_topic.ipynb`; save in JupyterLab first) and
runs, in notebook order and without the chapter's demos:

- the setup cells (tag `setup`),
- the exercise cells (nbgrader solution cells),
- every other code cell that only defines things: each top-level statement an `import`, a `def`, a
  `class`, an assignment or a docstring (also inside `if` / `try`), so that a helper the learner
  wrote in a cell of its own is there, as it is in the notebook. Cells tagged `needs-exercise`
  (demos of an exercise's answer) are not run.

Then each exercise's check cell runs (its visible part). A cell that fails (a syntax error, an
exception) fails only the exercises whose code or check uses what it defines.
`llmcourse.course.learner` runs the chapters the same way to put the learner's functions in the engine.

    >>> print(progress_report("chapters"))                 # doctest: +SKIP

    $ python -m llmcourse progress                        # which exercises pass
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import linecache
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Optional, Union

from .failed import CheckFailed
from .limits import TimeUp, time_limit, wall_ceiling, work_seconds

STUB = "raise NotImplementedError"
SKIPPED_TAGS = {"needs-exercise"}  # demos of an exercise's answer: never run by progress or the engine

CELL_SECONDS = 60.0  # CPU-s: each setup, exercise or helper cell
CHECK_SECONDS = 120.0  # each check cell
CHAPTER_SECONDS = 600.0  # everything in one chapter

# Never caught from learner code: the user pressing stop, and an outer time limit's time-out.
PASS_THROUGH = (KeyboardInterrupt, TimeUp)

PathLike = Union[str, Path]


# ----------------------------------------------------------------------------------------------
# Reading a notebook


@dataclasses.dataclass
class Cell:
    kind: str  # "setup", "exercise", "helper" (only defines things) or "check"
    source: str
    label: str  # how messages name it: 'setup', the exercise's grade_id, 'encode check', 'cell 12'
    defines: set[str]
    uses: set[str]


@dataclasses.dataclass
class Exercise:
    grade_id: str
    source: str  # the exercise cell: the learner's code ('' for a check of the whole course's work: chapter 12's)
    check: str  # the check cell's code
    points: float
    cell: Optional[Cell] = None  # None: a check with no exercise cell of its own
    check_cell: Optional[Cell] = None

    @property
    def functions(self) -> list[str]:
        return defined_names(self.source)


@dataclasses.dataclass
class Chapter:
    name: str
    path: Path
    setup: list[str]
    exercises: list[Exercise]
    cells: list[Cell] = dataclasses.field(default_factory=list)  # what runs, in notebook order


def read_chapter(path: PathLike) -> Chapter:
    """The cells progress runs, and each exercise cell paired with the check cell that follows it (a check cell with
    no exercise cell before it, as chapter 12's checks of your whole engine, is an exercise of its own)."""
    path = Path(path)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    setup, exercises, runs, pending = [], [], [], None
    number = 0
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        number += 1
        source = "".join(cell["source"])
        meta = cell.get("metadata", {})
        grading = meta.get("nbgrader", {})
        tags = set(meta.get("tags", []))
        if "setup" in tags:
            setup.append(source)
            runs.append(new_cell("setup", source, "setup"))
        elif grading.get("solution") and not grading.get("grade"):
            pending = new_cell("exercise", source, grading.get("grade_id") or f"cell {number}")
            runs.append(pending)
        elif grading.get("grade") and not grading.get("solution"):
            points = float(grading.get("points", 0))
            if pending is not None:
                check = new_cell("check", source, f"{pending.label} check")
                exercises.append(Exercise(pending.label, pending.source, source, points, pending, check))
            else:
                label = grading.get("grade_id") or f"cell {number}"
                exercises.append(Exercise(label, "", source, points, None, new_cell("check", source, label)))
            pending = None
        elif not tags & SKIPPED_TAGS and only_defines(source):
            runs.append(new_cell("helper", source, f"cell {number}"))
    return Chapter(path.stem, path, setup, exercises, runs)


def new_cell(kind: str, source: str, label: str) -> Cell:
    defines, uses = names_of(source)
    return Cell(kind, source, label, defines, uses)


DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
    ast.Pass,
)


def only_defines(source: str) -> bool:
    """Whether every top-level statement of a cell defines something (see the module's docstring)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    return bool(body) and all(_defines(node) for node in body)


def _defines(node: ast.stmt) -> bool:
    if isinstance(node, DEFINITIONS):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, ast.If):
        return all(_defines(n) for n in node.body + node.orelse)
    if isinstance(node, ast.Try):
        blocks = node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        return all(_defines(n) for n in blocks)
    return False


def names_of(source: str) -> tuple[set[str], set[str]]:
    """(names a cell defines at top level, names it reads anywhere)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a guess, so that a broken cell is still blamed for what it should define
        found = re.findall(r"^(?:async\s+def|def|class)\s+(\w+)", source, re.MULTILINE)
        return set(found), set()
    defines: set[str] = set()

    def top(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defines.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defines.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
                targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
                targets += [i.optional_vars for i in getattr(node, "items", []) if i.optional_vars]
                for target in targets:
                    if target is not None:
                        defines.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If):
                top(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                top(node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body])

    top(tree.body)
    uses = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return defines, uses


def defined_names(source: str) -> list[str]:
    """Names of the functions and classes a cell defines at top level."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return sorted(names_of(source)[0])
    return [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def untouched(source: str) -> bool:
    """Whether an exercise cell still holds only its stub: every function body is `raise NotImplementedError`."""
    if STUB not in source:
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def stub(fn) -> bool:
        docstring = fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        body = fn.body[1:] if docstring else fn.body
        return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])

    return all(stub(fn) for fn in functions)


# ----------------------------------------------------------------------------------------------
# Finding the notebooks


def find_chapters(target: PathLike) -> list[Path]:
    """The chapter notebooks `target` names: a folder of chapters (NN_topic/NN_topic.ipynb inside it),
    one chapter's folder, or a notebook."""
    target = Path(target)
    if not target.exists():
        raise FileNotFoundError(f"no folder {target}: run this where your chapters/ folder is, or pass its path")
    if target.is_file():
        if target.suffix != ".ipynb":
            raise FileNotFoundError(
                f"{target} is not a notebook (.ipynb): pass your chapters/ folder, "
                "a chapter's folder or a chapter's notebook"
            )
        return [target]
    own = target / f"{target.name}.ipynb"
    if own.is_file():
        return [own]
    found = sorted(p for p in target.glob("*/*.ipynb") if p.parent.name == p.stem)
    if not found:
        raise FileNotFoundError(
            f"no chapter notebooks in {target}: expected NN_topic/NN_topic.ipynb inside it; "
            "pass your chapters/ folder, a chapter's folder or a chapter's notebook"
        )
    return found


def default_folder() -> Path:
    """Where the learner's chapters are, seen from here: ./chapters, or the folder above when this is
    a chapter's folder (a notebook's kernel starts there), else here. Under `nbgrader autograde`, which runs a
    student's notebook in autograded/STUDENT/CHAPTER/, the student's other chapters are those collected in
    submitted/STUDENT/ (autograded/ holds only the chapters graded so far)."""
    here = Path.cwd()
    if here.parent.parent.name == "autograded" and (here / f"{here.name}.ipynb").is_file():
        submitted = here.parents[2] / "submitted" / here.parent.name
        if submitted.is_dir():
            return submitted
    if (here / "chapters").is_dir():
        return Path("chapters")
    if (here / f"{here.name}.ipynb").is_file():
        return here.parent
    return here


# ----------------------------------------------------------------------------------------------
# Running a chapter


def cell_filename(path: Path, label: str) -> str:
    """What tracebacks call a cell: '<chapters/01_tokenization: encode>'."""
    folder = f"{path.parent.parent.name}/{path.parent.name}" if path.parent.parent.name else path.parent.name
    return f"<{folder}: {label}>"


_CELL_FILES: set[str] = set()


def compile_cell(source: str, filename: str):
    """Compile a cell under its own name and register its lines, so tracebacks quote the right line."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    _CELL_FILES.add(filename)
    return compile(source, filename, "exec")


def describe_error(err: BaseException) -> str:
    """'ValueError: bad (01_tokenization: encode, line 3: `x = int(s)`)': the error, and where in the
    learner's cells it happened."""
    text = f"{type(err).__name__}: {err}".rstrip(": ")
    if isinstance(err, SyntaxError) and err.filename in _CELL_FILES:
        line = (err.text or "").strip()
        return f"{type(err).__name__}: {err.msg} ({err.filename[1:-1]}, line {err.lineno}: `{line}`)"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename in _CELL_FILES]
    if frames:
        frame = frames[-1]
        text += f" ({frame.filename[1:-1]}, line {frame.lineno}: `{(frame.line or '').strip()}`)"
    return text


@contextlib.contextmanager
def quietly():
    """No prints, no warnings, no waiting for input while learner code runs."""
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        stdin, sys.stdin = sys.stdin, io.StringIO()
        try:
            yield
        finally:
            sys.stdin = stdin


def run_code(source: str, filename: str, namespace: dict, seconds: float) -> Optional[str]:
    """Run a cell's code; None if fine, else what went wrong: a check's own message (CheckFailed), or
    a phrase to follow the cell's name ('raised ValueError: ... (line)', 'was still running after 60 s')."""
    if seconds <= 0:
        return "was not run: the chapter's time ran out"
    limit = time_limit(seconds)
    try:
        with quietly(), limit:
            exec(compile_cell(source, filename), namespace)
    except PASS_THROUGH:
        raise
    except TimeoutError:
        return f"was still running after {limit.describe()} (a loop that never ends?)"
    except CheckFailed as err:
        return str(err).strip() or "✗ the check failed"
    except BaseException as err:  # also SystemExit and errors not derived from Exception (e.g. a Rust panic)
        return f"raised {describe_error(err)}"
    return None


PHRASES = ("raised ", "was still running ", "was not run")


@dataclasses.dataclass
class Result:
    chapter: str
    grade_id: str
    status: str  # "not started", "failing" or "passing"
    reason: str  # the first line of why it fails (the check's message, or a cell's error)
    points: float
    max_points: float
    message: str = ""  # the check's whole message


class Budget:
    """A chapter's time: `seconds` of CPU time, its own and its checks' (`work_seconds`), and a wall-clock ceiling
    far above (`wall_ceiling`) for cells that wait rather than compute."""

    def __init__(self, seconds: float):
        self.seconds, self.wall = seconds, wall_ceiling(seconds)
        self.cpu_end, self.wall_end = work_seconds() + seconds, time.monotonic() + self.wall

    def remaining(self) -> float:
        """CPU-seconds left, 0 or less once either limit is reached."""
        return self.cpu_end - work_seconds() if time.monotonic() < self.wall_end else 0.0

    def describe(self) -> str:
        return f"{self.wall:g} s on the wall" if time.monotonic() >= self.wall_end else f"{self.seconds:g} CPU-s"


@dataclasses.dataclass
class ChapterRun:
    """One chapter's cells run once; each exercise's check runs (once) when asked for."""

    chapter: Chapter
    namespace: dict
    errors: dict[int, str]  # id(cell) -> what went wrong running it
    deadline: "Budget"
    seconds: float  # the chapter's limit
    check_seconds: float
    results: dict[str, Result] = dataclasses.field(default_factory=dict)
    grading: set[str] = dataclasses.field(default_factory=set)  # being graded now (exercises may use each other)
    others_started: bool = True  # whether an exercise of the other chapters is written (chapter 12's checks grade them)

    def result(self, ex: Exercise) -> Optional[Result]:
        if ex.grade_id not in self.results:
            if ex.grade_id in self.grading:
                return None
            self.grading.add(ex.grade_id)
            with running(self.chapter.path):
                self.results[ex.grade_id] = self._grade(ex)
            self.grading.discard(ex.grade_id)
        return self.results[ex.grade_id]

    def _grade(self, ex: Exercise) -> Result:
        name = self.chapter.name
        if untouched(ex.source) if ex.cell is not None else not self.others_started:
            return Result(name, ex.grade_id, "not started", "", 0.0, ex.points)
        problem = self.errors.get(id(ex.cell)) if ex.cell is not None else None
        if problem is not None and not problem.startswith("was not run"):
            message = f"your cell {problem}"
            return Result(name, ex.grade_id, "failing", headline(message), 0.0, ex.points, message)
        if problem is None and self.remaining() > 0:
            filename = cell_filename(self.chapter.path, ex.check_cell.label)
            problem = run_code(ex.check, filename, dict(self.namespace), min(self.check_seconds, self.remaining()))
            if problem is None:
                return Result(name, ex.grade_id, "passing", "", ex.points, ex.points)
        if self.remaining() <= 0:
            message = (
                f"not checked: this chapter's cells and checks used more than the {self.deadline.describe()} "
                "allowed in all (a slow or endless loop in an earlier exercise?)"
            )
            return Result(name, ex.grade_id, "failing", message, 0.0, ex.points, message)
        if problem.startswith(PHRASES):
            problem = f"the check {problem}"
        message = self.blame(ex, problem)
        return Result(name, ex.grade_id, "failing", headline(message), 0.0, ex.points, message)

    def remaining(self) -> float:
        return self.deadline.remaining()

    def dependencies(self, ex: Exercise) -> list[Cell]:
        """The other cells whose definitions `ex` or its check use, directly or through other definitions."""
        cells = self.chapter.cells
        own = ex.cell.uses if ex.cell is not None else set()
        wanted, found = set(own | ex.check_cell.uses), {id(ex.cell)}
        while True:
            new = [c for c in cells if id(c) not in found and c.defines & wanted]
            if not new:
                return [c for c in cells if id(c) in found and c is not ex.cell]
            for c in new:
                found.add(id(c))
                wanted |= c.uses

    def blame(self, ex: Exercise, problem: str) -> str:
        """The check's message, or, when what the exercise uses is broken or not written, that."""
        exercises = {id(e.cell): e for e in self.chapter.exercises if e.cell is not None}
        uses = (ex.cell.uses if ex.cell is not None else set()) | ex.check_cell.uses
        failing = []
        for cell in self.dependencies(ex):
            needed = ", ".join(sorted(cell.defines & uses)) or ", ".join(sorted(cell.defines))
            if id(cell) in self.errors:
                return f"it needs {needed} from the cell '{cell.label}', which {self.errors[id(cell)]}"
            other = exercises.get(id(cell))
            if other is not None and untouched(other.source):
                return f"it uses {needed}, which is not written yet: write the exercise '{other.grade_id}' first"
            if other is not None and getattr(self.result(other), "status", "") == "failing":
                failing.append(other.grade_id)
        if failing:
            first, rest = problem.split("\n", 1) if "\n" in problem else (problem, "")
            note = f" (it uses {', '.join(failing)}, which fail{'s' if len(failing) == 1 else ''} its own check)"
            return first + note + ("\n" + rest if rest else "")
        return problem


def others_started(path: Path) -> bool:
    """Whether the learner has written any exercise of the chapters that a check of the whole course's work in the
    chapter `path` reads (chapter 12's: the other chapters of the folder its kernel finds, `default_folder`). `path`
    is taken from here (not from inside `running`, where a relative path would point elsewhere)."""
    own = Path(path).resolve()
    with running(own):
        try:
            others = [p for p in find_chapters(default_folder()) if p.resolve() != own]
        except FileNotFoundError:  # no chapters there at all
            return False
    return any(ex.cell is not None and not untouched(ex.source) for p in others for ex in read_chapter(p).exercises)


def headline(message: str) -> str:
    """A failing check's one-line reason: its message's first line. A first line that introduces the lines below it
    (it ends with ':', as the capstone's list of functions still the engine's own) says where they are instead."""
    first = message.splitlines()[0]
    if first.endswith(":") and "\n" in message:
        return f"{first[:-1]} (--verbose shows which)"
    return first


def run_chapter(
    path: PathLike,
    *,
    cell_seconds: float = CELL_SECONDS,
    check_seconds: float = CHECK_SECONDS,
    chapter_seconds: float = CHAPTER_SECONDS,
) -> ChapterRun:
    """Run a chapter's setup, exercise and helper cells in order (each failure kept to its cell), in the chapter's
    folder as its kernel would. Inside `reusing_runs()`, a chapter already run (and not saved since) is not run
    again."""
    key = (Path(path).resolve(), os.stat(path).st_mtime_ns, cell_seconds, check_seconds, chapter_seconds)
    if _reused is not None and key in _reused:
        return _reused[key]
    chapter = read_chapter(path)
    started = not any(ex.cell is None for ex in chapter.exercises) or others_started(chapter.path)
    deadline = Budget(chapter_seconds)
    namespace: dict = {"__name__": "__learner__"}
    errors: dict[int, str] = {}
    with running(chapter.path):
        for cell in chapter.cells:
            filename = cell_filename(chapter.path, cell.label)
            problem = run_code(cell.source, filename, namespace, min(cell_seconds, deadline.remaining()))
            if problem is not None:
                errors[id(cell)] = problem
    run = ChapterRun(chapter, namespace, errors, deadline, chapter_seconds, check_seconds, others_started=started)
    if _reused is not None:
        _reused[key] = run
    return run


_running: list[Path] = []  # the chapters being run now, innermost last: a cell they run may not run them again
_reused: Optional[dict] = None  # (path, mtime, limits) -> ChapterRun, inside reusing_runs()


@contextlib.contextmanager
def running(path: Path):
    """Run code of the chapter `path`, in its folder (where a notebook's kernel starts)."""
    here = os.getcwd()
    _running.append(Path(path).resolve())
    os.chdir(Path(path).resolve().parent)
    try:
        yield
    finally:
        os.chdir(here)
        _running.pop()


@contextlib.contextmanager
def reusing_runs():
    """Within this block each chapter runs once: `progress` grades chapters 01-11, then chapter 12 reads the same
    notebooks for your engine."""
    global _reused
    outer = _reused
    _reused = {} if outer is None else outer
    try:
        yield
    finally:
        _reused = outer


def refuse_to_recurse(paths: list[Path]) -> None:
    """A cell of a chapter being run may read other chapters (chapter 12 reads 01-11), not its own again."""
    again = [p for p in paths if Path(p).resolve() in _running]
    if again:
        raise RuntimeError(
            f"my_engine() and progress run your notebooks' cells; a cell they run cannot run {again[0].stem} "
            "again (put the call in a cell that also prints or plots something)"
        )


def grade_chapter(path: PathLike, **limits) -> list[Result]:
    """Run one chapter's checks (their visible part) on the learner's functions."""
    refuse_to_recurse([Path(path)])
    run = run_chapter(path, **limits)
    return [run.result(ex) for ex in run.chapter.exercises]


HEADER = "Reading the saved notebooks: save yours in JupyterLab first (Ctrl+S / Cmd+S)."


def progress_lines(target: PathLike, *, verbose: bool = False) -> Iterator[str]:
    """The learner's dashboard, line by line as each chapter is checked: status and points."""
    paths = find_chapters(target)
    yield HEADER
    total, total_max = 0.0, 0.0
    with reusing_runs():  # chapter 12 reads the chapters graded before it
        for path in paths:
            results = grade_chapter(path)
            got, most = sum(r.points for r in results), sum(r.max_points for r in results)
            total, total_max = total + got, total_max + most
            yield f"{path.stem}: {got:g}/{most:g} points"
            for r in results:
                status = r.status + (f": {r.reason}" if r.reason else "")
                mark = {"passing": "✓", "failing": "✗"}.get(r.status, "·")
                score = f"{r.points:g}/{r.max_points:g}"
                yield f"  {mark} {r.grade_id:<22} {score:>5}  {status}"
                if verbose and r.message.count("\n"):
                    for line in r.message.splitlines()[1:]:
                        yield f"{'':34}{line}"
    yield f"total: {total:g}/{total_max:g} points"


def progress_report(target: PathLike, *, verbose: bool = False) -> str:
    return "\n".join(progress_lines(target, verbose=verbose))
