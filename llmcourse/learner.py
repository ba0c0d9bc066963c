"""A learner's own functions, read from their chapter notebooks: progress, and parts for the engine.

Each chapter notebook (`chapters/NN_topic/NN_topic.ipynb`) has a setup cell (tag `setup`), exercise
cells (nbgrader solution cells) and check cells (nbgrader graded cells, with points). Running just the
setup and exercise cells gives the learner's functions without re-running the chapter's demos; running
each check cell after them says which exercises pass.

    >>> learner_functions("chapters")      # doctest: +SKIP
    {'top_k_next_tokens': <function top_k_next_tokens ...>, ...}
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import warnings
from pathlib import Path
from typing import Callable, Optional

from . import bpe
from .checks.core import CheckFailed, time_limit
from .parts import Parts
from .tokenizer import StreamDecoder, get_tokenizer

STUB = "raise NotImplementedError"


@dataclasses.dataclass
class Exercise:
    grade_id: str
    source: str  # the exercise cell: the learner's code
    check: str  # the check cell's code
    points: float


@dataclasses.dataclass
class Chapter:
    name: str
    path: Path
    setup: list[str]
    exercises: list[Exercise]


def read_chapter(path: Path) -> Chapter:
    """The setup cells, and each exercise cell paired with the check cell that follows it."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    setup, exercises, pending = [], [], None
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        meta = cell.get("metadata", {})
        grading = meta.get("nbgrader", {})
        if "setup" in meta.get("tags", []):
            setup.append(source)
        elif grading.get("solution") and not grading.get("grade"):
            pending = (grading["grade_id"], source)
        elif grading.get("grade") and pending is not None:
            exercises.append(Exercise(pending[0], pending[1], source, float(grading.get("points", 0))))
            pending = None
    return Chapter(Path(path).stem, Path(path), setup, exercises)


def find_chapters(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder {folder}: run this where your chapters/ folder is, or pass its path")
    return sorted(p for p in folder.glob("*/*.ipynb") if p.parent.name == p.stem)


def run_cells(chapter: Chapter, namespace: dict, seconds: float = 60.0) -> Optional[str]:
    """Run setup and exercise cells quietly; None if fine, else what went wrong."""
    for source in [*chapter.setup, *(e.source for e in chapter.exercises)]:
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), time_limit(seconds):
                warnings.simplefilter("ignore")
                exec(compile(source, str(chapter.path), "exec"), namespace)
        except Exception as err:
            first = source.strip().splitlines()[0] if source.strip() else ""
            return f"the cell starting {first!r} raised {type(err).__name__}: {err}"
    return None


@dataclasses.dataclass
class Result:
    chapter: str
    grade_id: str
    status: str  # "not started", "failing" or "passing"
    reason: str
    points: float
    max_points: float


def grade_chapter(path: Path) -> list[Result]:
    """Run one chapter's checks (their visible part) on the learner's functions."""
    chapter = read_chapter(path)
    namespace: dict = {"__name__": "__learner__"}
    broken = run_cells(chapter, namespace)
    results = []
    for ex in chapter.exercises:
        status, reason, points = "passing", "", ex.points
        if STUB in ex.source:
            status, reason, points = "not started", "", 0.0
        elif broken:
            status, reason, points = "failing", broken, 0.0
        else:
            try:
                with contextlib.redirect_stdout(io.StringIO()), time_limit(120):
                    exec(compile(ex.check, f"{chapter.name}:{ex.grade_id}_check", "exec"), dict(namespace))
            except CheckFailed as err:
                status, reason, points = "failing", str(err), 0.0
            except Exception as err:
                status, reason, points = "failing", f"{type(err).__name__}: {err}", 0.0
        results.append(Result(chapter.name, ex.grade_id, status, reason.strip().splitlines()[0] if reason else "",
                              points, ex.points))
    return results


def progress_report(folder: Path) -> str:
    """The learner's dashboard: per chapter and exercise, status and points."""
    lines, total, total_max = [], 0.0, 0.0
    for path in find_chapters(folder):
        results = grade_chapter(path)
        got, most = sum(r.points for r in results), sum(r.max_points for r in results)
        total, total_max = total + got, total_max + most
        lines.append(f"{path.stem}: {got:g}/{most:g} points")
        for r in results:
            status = r.status + (f": {r.reason}" if r.reason else "")
            mark = {"passing": "✓", "failing": "✗"}.get(r.status, "·")
            score = f"{r.points:g}/{r.max_points:g}"
            lines.append(f"  {mark} {r.grade_id:<22} {score:>5}  {status[:100]}")
    if not lines:
        return f"no chapter notebooks (NN_topic/NN_topic.ipynb) in {folder}"
    lines.append(f"total: {total:g}/{total_max:g} points")
    return "\n".join(lines)


def learner_functions(folder: Path = Path("chapters"), *, notify: Callable[[str], None] = print) -> dict[str, Callable]:
    """Every function the learner has written in their chapter notebooks, by name.

    Exercises still holding the stub are left out (the engine keeps its own), with a notice.
    """
    functions: dict[str, Callable] = {}
    for path in find_chapters(folder):
        chapter = read_chapter(path)
        for ex in chapter.exercises:
            if STUB in ex.source:
                notify(f"{chapter.name}: '{ex.grade_id}' is not written yet; the engine uses its own")
        chapter.exercises = [ex for ex in chapter.exercises if STUB not in ex.source]
        namespace: dict = {"__name__": "__learner__"}
        broken = run_cells(chapter, namespace)
        if broken:
            notify(f"{chapter.name}: skipped, {broken}")
            continue
        for ex in chapter.exercises:
            for name in defined_names(ex.source):
                functions[name] = namespace[name]
    return functions


def defined_names(source: str) -> list[str]:
    """Names of the functions and classes a cell defines at top level."""
    tree = ast.parse(source)
    return [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]


def learner_parts(folder: Path = Path("chapters"), *, notify: Callable[[str], None] = print) -> Parts:
    """The engine's parts with every part the learner has written swapped in (see `llmcourse.Parts`).

        >>> model = load_model(parts=learner_parts())     # doctest: +SKIP
    """
    slots = {f.name for f in dataclasses.fields(Parts)}
    mine = {name: fn for name, fn in learner_functions(folder, notify=notify).items() if name in slots}
    notify(f"using your parts: {', '.join(sorted(mine)) or 'none yet'}")
    return Parts.with_overrides(**mine)


class LearnerTokenizer:
    """GPT-2's tokenizer made of the learner's chapter 01 functions — `encode(text, ranks)`,
    `decode(ids, vocab)`, `StreamDecoder(vocab)` — and the engine's where one is not written yet.
    It has what `generate_text` and `stream` use: `encode`, `decode`, `decode_single_token_bytes`,
    `stream_decoder`."""

    def __init__(self, functions: dict[str, Callable]):
        self.engine = get_tokenizer()
        self.ranks, self.vocab = bpe.gpt2_ranks(), bpe.gpt2_vocab()
        self.mine = {name: functions[name] for name in ("encode", "decode", "StreamDecoder") if name in functions}

    def encode(self, text: str, allowed_special="all") -> list[int]:
        if "encode" in self.mine:
            return self.mine["encode"](text, self.ranks)
        return self.engine.encode(text, allowed_special=allowed_special)

    def decode(self, ids: list[int]) -> str:
        return self.mine["decode"](ids, self.vocab) if "decode" in self.mine else self.engine.decode(ids)

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self.vocab[token]

    def stream_decoder(self):
        return self.mine["StreamDecoder"](self.vocab) if "StreamDecoder" in self.mine else StreamDecoder(self.engine)


def learner_tokenizer(folder: Path = Path("chapters"), *, notify: Callable[[str], None] = print) -> LearnerTokenizer:
    """A tokenizer using the learner's chapter 01 functions, for `generate_text` / `stream`.

        >>> llmcourse.generate_text(load_model(), learner_tokenizer(), "ROMEO:")    # doctest: +SKIP
    """
    tokenizer = LearnerTokenizer(learner_functions(folder, notify=notify))
    notify(f"tokenizer: yours for {', '.join(sorted(tokenizer.mine)) or 'nothing yet'}, the engine's for the rest")
    return tokenizer
