"""A learner's own functions, read from their chapter notebooks: progress, and their own engine.

Both read the *saved* notebooks (`chapters/NN_topic/NN_topic.ipynb`; save in JupyterLab first) and
run, in notebook order and without the chapter's demos:

- the setup cells (tag `setup`),
- the exercise cells (nbgrader solution cells),
- every other code cell that only defines things: each top-level statement an `import`, a `def`, a
  `class`, an assignment or a docstring (also inside `if` / `try`), so that a helper the learner
  wrote in a cell of its own is there, as it is in the notebook. Cells tagged `needs-exercise`
  (demos of an exercise's answer) are not run.

Then each exercise's check cell runs (its visible part). A cell that fails (a syntax error, an
exception) fails only the exercises whose code or check uses what it defines. A function is used in
the engine only if its exercise's check passes; otherwise the engine's own runs in its slot, with
one notice saying why.

    >>> engine = my_engine("chapters")                     # doctest: +SKIP
    >>> print(engine.generate_text("ROMEO:", max_new_tokens=40))         # doctest: +SKIP

    $ python -m llmcourse progress                        # which exercises pass
    $ python -m llmcourse generate --parts chapters/ "ROMEO:"
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import linecache
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional, Union

from . import bpe
from .checks import core
from .checks.core import CheckFailed, time_limit
from .parts import Parts
from .tokenizer import StreamDecoder, get_tokenizer

STUB = "raise NotImplementedError"
PART_SLOTS = tuple(f.name for f in dataclasses.fields(Parts))
TOKENIZER_SLOTS = ("encode", "decode", "StreamDecoder")
ENGINE_SLOTS = PART_SLOTS + TOKENIZER_SLOTS  # the functions the engine can take from a learner
SKIPPED_TAGS = {"needs-exercise"}  # demos of an exercise's answer: never run by progress or the engine

CELL_SECONDS = 60.0  # each setup, exercise or helper cell
CHECK_SECONDS = 120.0  # each check cell
CHAPTER_SECONDS = 600.0  # everything in one chapter

# Never caught from learner code: the user pressing stop, and an outer time limit's time-out.
PASS_THROUGH = (KeyboardInterrupt,) + ((core.TimeUp,) if isinstance(getattr(core, "TimeUp", None), type) else ())

Notify = Callable[[str], None]
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
    source: str  # the exercise cell: the learner's code
    check: str  # the check cell's code
    points: float
    cell: Optional[Cell] = None
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
    """The cells progress runs, and each exercise cell paired with the check cell that follows it."""
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
            if pending is not None:
                check = new_cell("check", source, f"{pending.label} check")
                exercises.append(Exercise(pending.label, pending.source, source, float(grading.get("points", 0)),
                                          pending, check))
            pending = None
        elif not tags & SKIPPED_TAGS and only_defines(source):
            runs.append(new_cell("helper", source, f"cell {number}"))
    return Chapter(path.stem, path, setup, exercises, runs)


def new_cell(kind: str, source: str, label: str) -> Cell:
    defines, uses = names_of(source)
    return Cell(kind, source, label, defines, uses)


DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
               ast.AnnAssign, ast.Pass)


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
            raise FileNotFoundError(f"{target} is not a notebook (.ipynb): pass your chapters/ folder, "
                                    "a chapter's folder or a chapter's notebook")
        return [target]
    own = target / f"{target.name}.ipynb"
    if own.is_file():
        return [own]
    found = sorted(p for p in target.glob("*/*.ipynb") if p.parent.name == p.stem)
    if not found:
        raise FileNotFoundError(f"no chapter notebooks in {target}: expected NN_topic/NN_topic.ipynb inside it; "
                                "pass your chapters/ folder, a chapter's folder or a chapter's notebook")
    return found


def default_folder() -> Path:
    """Where the learner's chapters are, seen from here: ./chapters, or the folder above when this is
    a chapter's folder (a notebook's kernel starts there), else here."""
    here = Path.cwd()
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
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
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
    try:
        with quietly(), time_limit(seconds):
            exec(compile_cell(source, filename), namespace)
    except PASS_THROUGH:
        raise
    except TimeoutError:
        return f"was still running after {seconds:g} s (a loop that never ends?)"
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


@dataclasses.dataclass
class ChapterRun:
    """One chapter's cells run once; each exercise's check runs (once) when asked for."""

    chapter: Chapter
    namespace: dict
    errors: dict[int, str]  # id(cell) -> what went wrong running it
    deadline: float
    seconds: float  # the chapter's limit
    check_seconds: float
    results: dict[str, Result] = dataclasses.field(default_factory=dict)
    grading: set[str] = dataclasses.field(default_factory=set)  # being graded now (exercises may use each other)

    def result(self, ex: Exercise) -> Optional[Result]:
        if ex.grade_id not in self.results:
            if ex.grade_id in self.grading:
                return None
            self.grading.add(ex.grade_id)
            with running():
                self.results[ex.grade_id] = self._grade(ex)
            self.grading.discard(ex.grade_id)
        return self.results[ex.grade_id]

    def _grade(self, ex: Exercise) -> Result:
        name = self.chapter.name
        if untouched(ex.source):
            return Result(name, ex.grade_id, "not started", "", 0.0, ex.points)
        problem = self.errors.get(id(ex.cell))
        if problem is not None and not problem.startswith("was not run"):
            message = f"your cell {problem}"
            return Result(name, ex.grade_id, "failing", message.splitlines()[0], 0.0, ex.points, message)
        if problem is None and self.remaining() > 0:
            filename = cell_filename(self.chapter.path, ex.check_cell.label)
            problem = run_code(ex.check, filename, dict(self.namespace), min(self.check_seconds, self.remaining()))
            if problem is None:
                return Result(name, ex.grade_id, "passing", "", ex.points, ex.points)
        if self.remaining() <= 0:
            message = (f"not checked: this chapter's cells and checks ran longer than the {self.seconds:g} s allowed "
                       "in all (a slow or endless loop in an earlier exercise?)")
            return Result(name, ex.grade_id, "failing", message, 0.0, ex.points, message)
        if problem.startswith(PHRASES):
            problem = f"the check {problem}"
        message = self.blame(ex, problem)
        return Result(name, ex.grade_id, "failing", message.splitlines()[0], 0.0, ex.points, message)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def dependencies(self, ex: Exercise) -> list[Cell]:
        """The other cells whose definitions `ex` or its check use, directly or through other definitions."""
        cells = self.chapter.cells
        wanted, found = set(ex.cell.uses | ex.check_cell.uses), {id(ex.cell)}
        while True:
            new = [c for c in cells if id(c) not in found and c.defines & wanted]
            if not new:
                return [c for c in cells if id(c) in found and c is not ex.cell]
            for c in new:
                found.add(id(c))
                wanted |= c.uses

    def blame(self, ex: Exercise, problem: str) -> str:
        """The check's message, or, when what the exercise uses is broken or not written, that."""
        exercises = {id(e.cell): e for e in self.chapter.exercises}
        failing = []
        for cell in self.dependencies(ex):
            needed = ", ".join(sorted(cell.defines & (ex.cell.uses | ex.check_cell.uses))) or ", ".join(sorted(cell.defines))
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


def run_chapter(path: PathLike, *, cell_seconds: float = CELL_SECONDS, check_seconds: float = CHECK_SECONDS,
                chapter_seconds: float = CHAPTER_SECONDS) -> ChapterRun:
    """Run a chapter's setup, exercise and helper cells in order (each failure kept to its cell)."""
    chapter = read_chapter(path)
    deadline = time.monotonic() + chapter_seconds
    namespace: dict = {"__name__": "__learner__"}
    errors: dict[int, str] = {}
    with running():
        for cell in chapter.cells:
            filename = cell_filename(chapter.path, cell.label)
            problem = run_code(cell.source, filename, namespace, min(cell_seconds, deadline - time.monotonic()))
            if problem is not None:
                errors[id(cell)] = problem
    return ChapterRun(chapter, namespace, errors, deadline, chapter_seconds, check_seconds)


_running = [0]  # chapters being run now: a cell they run may not run the chapters again


@contextlib.contextmanager
def running():
    _running[0] += 1
    try:
        yield
    finally:
        _running[0] -= 1


def refuse_to_recurse() -> None:
    if _running[0]:
        raise RuntimeError("my_engine() and progress run your notebooks' cells; a cell they run cannot call them "
                           "again (put the call in a cell that also prints or plots something)")


def grade_chapter(path: PathLike, **limits) -> list[Result]:
    """Run one chapter's checks (their visible part) on the learner's functions."""
    refuse_to_recurse()
    run = run_chapter(path, **limits)
    return [run.result(ex) for ex in run.chapter.exercises]


HEADER = "Reading the saved notebooks: save yours in JupyterLab first (Ctrl+S / Cmd+S)."


def progress_lines(target: PathLike, *, verbose: bool = False) -> Iterator[str]:
    """The learner's dashboard, line by line as each chapter is checked: status and points."""
    paths = find_chapters(target)
    yield HEADER
    total, total_max = 0.0, 0.0
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


# ----------------------------------------------------------------------------------------------
# The learner's functions in the engine


def learner_functions(folder: Optional[PathLike] = None, *, slots: Optional[tuple[str, ...]] = None,
                      notify: Notify = print) -> dict[str, Callable]:
    """The functions (and classes) of every exercise whose check passes, by name.

    `slots`: only exercises defining one of these names are checked, and each of those that cannot
    be used gets one notice saying why (the engine keeps its own there). None: every exercise,
    quietly.
    """
    refuse_to_recurse()
    functions: dict[str, Callable] = {}
    for path in find_chapters(default_folder() if folder is None else folder):
        chapter = read_chapter(path)
        wanted = [ex for ex in chapter.exercises if slots is None or set(ex.functions) & set(slots)]
        if not wanted:
            continue
        run = run_chapter(path)
        for ex in wanted:
            names = [n for n in ex.functions if slots is None or n in slots]
            result = run.result(ex)
            if result.status == "passing":
                functions.update({n: run.namespace[n] for n in ex.functions if n in run.namespace})
            elif slots is not None:
                why = "is not written yet" if result.status == "not started" else f"does not pass its check ({result.reason})"
                theirs = ", ".join(f"the engine's {n}" for n in names)
                notify(f"{chapter.name}: {ex.grade_id} {why}; {theirs} runs instead")
    return functions


def learner_parts(folder: Optional[PathLike] = None, *, notify: Notify = print) -> Parts:
    """The engine's parts with every part the learner has written (and whose check passes) swapped in.

        >>> model = load_model(parts=learner_parts("chapters"))     # doctest: +SKIP
    """
    mine = learner_functions(folder, slots=PART_SLOTS, notify=notify)
    notify(f"parts: yours for {', '.join(sorted(mine)) or 'none yet'}; the engine's for the rest")
    return Parts.with_overrides(**mine)


class LearnerTokenizer:
    """GPT-2's tokenizer made of the learner's chapter 01 functions — `encode(text, ranks)`,
    `decode(ids, vocab)`, `StreamDecoder(vocab)` — and the engine's where one is not used. It has what
    `generate_text` and `stream` use: `encode`, `decode`, `decode_single_token_bytes`, `stream_decoder`.

    Should a learner's function raise or return something unusable, the engine's takes over from then
    on, with one notice saying where it failed."""

    def __init__(self, functions: dict[str, Callable], *, notify: Notify = print):
        self.engine = get_tokenizer()
        self.ranks, self.vocab = bpe.gpt2_ranks(), bpe.gpt2_vocab()
        self.mine = {name: functions[name] for name in TOKENIZER_SLOTS if name in functions}
        self.notify = notify

    def give_up(self, name: str, problem: str) -> None:
        if self.mine.pop(name, None) is not None:
            self.notify(f"your {name} {problem}; the engine's {name} runs from now on")

    def attempt(self, name: str, fn: Callable, valid: Callable[[object], bool], *args):
        """fn(*args) (the learner's `name`), or None after giving `name` up if it fails."""
        try:
            with quietly():
                out = fn(*args)
        except PASS_THROUGH:
            raise
        except BaseException as err:
            self.give_up(name, f"raised {describe_error(err)}")
            return None
        if not valid(out):
            self.give_up(name, f"returned {type(out).__name__} {str(out)[:60]!r}, which the engine cannot use")
            return None
        return out

    def encode(self, text: str, allowed_special="all") -> list[int]:
        if "encode" in self.mine:
            ids = self.attempt("encode", self.mine["encode"], lambda out: isinstance(out, list) and all(
                type(i) is int and i in self.vocab for i in out), text, self.ranks)
            if ids is not None:
                return ids
        return self.engine.encode(text, allowed_special=allowed_special)

    def decode(self, ids: list[int]) -> str:
        if "decode" in self.mine:
            text = self.attempt("decode", self.mine["decode"], lambda out: isinstance(out, str), list(ids), self.vocab)
            if text is not None:
                return text
        return self.engine.decode(ids)

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self.vocab[token]

    def stream_decoder(self):
        return GuardedStreamDecoder(self)


class GuardedStreamDecoder:
    """The learner's StreamDecoder; if it fails mid-stream, the engine's carries on where it left off."""

    def __init__(self, tokenizer: LearnerTokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.mine = self.engine = None
        if "StreamDecoder" in tokenizer.mine:
            self.mine = tokenizer.attempt("StreamDecoder", tokenizer.mine["StreamDecoder"], lambda out: True,
                                          tokenizer.vocab)
        if self.mine is None:
            self.engine = StreamDecoder(tokenizer.engine)

    def _mine(self, method: str, *args) -> Optional[str]:
        """The learner's decoder's answer; None once the engine's has taken over (caught up)."""
        if self.mine is None:
            return None
        piece = self.tokenizer.attempt("StreamDecoder", getattr(self.mine, method, None),
                                       lambda out: isinstance(out, str), *args)
        if piece is None:
            self.mine, self.engine = None, StreamDecoder(self.tokenizer.engine)
            text = "".join(self.engine.push(i) for i in self.ids)
            return text[len(self.shown):] if text.startswith(self.shown) else ""
        return piece

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._mine("push", token_id) if self.mine is not None else self.engine.push(token_id)
        self.shown += piece
        return piece

    def flush(self) -> str:
        if self.mine is not None:
            piece = self._mine("flush")
            if self.mine is not None:
                return piece
            return piece + self.engine.flush()
        return self.engine.flush()


def learner_tokenizer(folder: Optional[PathLike] = None, *, notify: Notify = print) -> LearnerTokenizer:
    """A tokenizer using the learner's chapter 01 functions, for `generate_text` / `stream`.

        >>> llmcourse.generate_text(load_model(), learner_tokenizer("chapters"), "ROMEO:")    # doctest: +SKIP
    """
    tokenizer = LearnerTokenizer(learner_functions(folder, slots=TOKENIZER_SLOTS, notify=notify), notify=notify)
    notify(f"tokenizer: yours for {', '.join(sorted(tokenizer.mine)) or 'nothing yet'}; the engine's for the rest")
    return tokenizer


def your_parts_and_tokenizer(folder: Optional[PathLike] = None, *,
                             notify: Notify = print) -> tuple[Parts, LearnerTokenizer]:
    """What `my_engine` (and `generate --parts`) runs: your parts and tokenizer, with one notice for each
    exercise with a slot that is not used, and one line saying what is yours."""
    functions = learner_functions(folder, slots=ENGINE_SLOTS, notify=notify)
    parts = Parts.with_overrides(**{n: f for n, f in functions.items() if n in PART_SLOTS})
    tokenizer = LearnerTokenizer(functions, notify=notify)
    yours = sorted(n for n in functions if n in PART_SLOTS) + sorted(tokenizer.mine)
    notify(f"your engine: yours: {', '.join(yours) or 'nothing yet'}; the engine's own for the rest")
    return parts, tokenizer


class Engine(NamedTuple):
    """Your engine: `model` (an `llmcourse.GPT2` with your parts) and `tokenizer` (yours, see
    `LearnerTokenizer`); `model, tokenizer = my_engine()` unpacks it."""

    model: "object"
    tokenizer: LearnerTokenizer

    def generate_text(self, prompt: str, **settings) -> str:
        """`llmcourse.generate_text` with this engine: the continuation of `prompt` as one string."""
        from .generate import generate_text

        return generate_text(self.model, self.tokenizer, prompt, **settings)

    def stream(self, prompt: str, **settings) -> Iterator[str]:
        """`llmcourse.stream` with this engine: the continuation of `prompt`, piece by piece."""
        from .generate import stream

        return stream(self.model, self.tokenizer, prompt, **settings)


def my_engine(folder: Optional[PathLike] = None, *, model="gpt2-shakespeare", device="auto", dtype=None,
              notify: Notify = print) -> Engine:
    """The engine with your functions in it: every exercise with a slot in the engine (the parts of
    `llmcourse.Parts`, and chapter 01's encode, decode and StreamDecoder) whose check passes. The
    engine's own runs wherever yours is not written yet or does not pass its check (one notice each).

    `folder`: your chapters (default: ./chapters, or the folder above when run from a chapter's
    notebook). `model`: what `llmcourse.load_model` takes (a bundled name, a folder, a Hub name), or
    a model already loaded.

        >>> engine = my_engine()                                            # doctest: +SKIP
        >>> print(engine.generate_text("ROMEO:", temperature=0.8))          # doctest: +SKIP
        >>> model, tokenizer = engine                                       # doctest: +SKIP
    """
    from .loading import load_model
    from .model import GPT2

    parts, tokenizer = your_parts_and_tokenizer(folder, notify=notify)
    if isinstance(model, GPT2):
        model.parts = parts
    else:
        model = load_model(model, device=device, dtype=dtype, parts=parts)
    return Engine(model, tokenizer)
