"""Refresh the stored outputs of solution notebooks, so that an unchanged notebook gives no diff.

    python -m llmcourse.course.refresh                                        # every notebook in solutions/
    python -m llmcourse.course.refresh solutions/00_pipeline/00_pipeline.ipynb

Runs each notebook top to bottom in a fresh kernel started in the notebook's folder, then stores
its outputs in one canonical form:

- the pieces a cell printed one after another (a streamed text, a `print(..., flush=True)` loop)
  are stored as one output per stream, not one per flush;
- no execution timings or per-run metadata are recorded;
- a cell tagged `machine-dependent` (timings and other measurements that differ from run to run)
  keeps the outputs stored before, as long as its source is the one that made them (the cell's
  metadata `outputs_of` holds a hash of that source). The book executes every page when it is
  built, so readers still see figures from the build;
- a live ipywidgets tool is stored without its output and its widget state (new model ids every
  run, and nothing to show without a kernel): the learner's kernel draws it when the cell runs;
- outputs that show a failure (a ✗, "does not pass", a traceback: `failures`) are not stored at all: the
  command says where and exits with status 1.

The test suite compares the cells tagged `nbval-check-output` of a fresh run with these stored outputs, as
nbval does (tests/test_notebooks.py).

    >>> merge_streams([{"output_type": "stream", "name": "stdout", "text": "a"},
    ...                {"output_type": "stream", "name": "stdout", "text": "b\\n"}])
    [{'output_type': 'stream', 'name': 'stdout', 'text': 'ab\\n'}]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

MACHINE_DEPENDENT = "machine-dependent"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def merge_streams(outputs: list) -> list:
    """Consecutive outputs of the same stream (stdout or stderr) joined into one, as Jupyter shows
    them; the outputs given are not changed. (The book's extension merges the same way.)"""
    merged: list = []
    for output in outputs or []:
        previous = merged[-1] if merged else None
        if (
            output["output_type"] == "stream"
            and previous is not None
            and previous["output_type"] == "stream"
            and previous["name"] == output["name"]
        ):
            merged[-1] = previous.copy()
            merged[-1]["text"] = "".join(previous["text"]) + "".join(output["text"])
        else:
            merged.append(output)
    return merged


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


FAILURE_MARKS = ("✗", "does not pass", "Traceback (most recent call last)")


def failures(nb) -> list[str]:
    """Where a notebook's outputs show a failure, one line each: an error output, or a text that holds a ✗, "does
    not pass" or a traceback. A solution's outputs never do: `refresh` refuses to store them, the book's extension
    to publish them, and the tests to accept them.

        >>> failures({"cells": [{"cell_type": "code", "source": "check_softmax(softmax)", "outputs": [
        ...     {"output_type": "stream", "name": "stdout", "text": "✗ softmax([1.0]) raised ValueError"}]}]})
        ["cell 1 (check_softmax(softmax)): '✗ softmax([1.0]) raised ValueError'"]
    """
    found = []
    for number, cell in enumerate(nb["cells"], 1):
        source = "".join(cell.get("source", ""))
        where = f"cell {number} ({source.strip().splitlines()[0][:60] if source.strip() else 'empty'})"
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                found.append(f"{where}: raised {output.get('ename')}: {str(output.get('evalue'))[:200]}")
                continue
            texts = [output.get("text", "")] + [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
            for text in ("".join(t) if isinstance(t, list) else str(t) for t in texts):
                line = next((line for line in text.splitlines() if any(m in line for m in FAILURE_MARKS)), None)
                if line is not None:
                    found.append(f"{where}: {line.strip()[:200]!r}")
                    break
    return found


class StoredFailure(Exception):
    """A solution notebook's fresh outputs show a failure (`failures`): they are not stored."""


def canonical(nb, stored) -> None:
    """Put the freshly executed `nb` into its stored form; `stored` is the notebook as it was."""
    before = {cell.get("id"): cell for cell in stored.cells}
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        cell.outputs = [o for o in merge_streams(cell.outputs) if WIDGET_VIEW not in o.get("data", {})]
        if MACHINE_DEPENDENT not in cell.metadata.get("tags", []):
            cell.metadata.pop("outputs_of", None)
            continue
        old = before.get(cell.get("id"))
        if old is not None and old.get("outputs") and old.metadata.get("outputs_of") == source_hash(cell.source):
            cell.outputs = old.outputs
        cell.metadata["outputs_of"] = source_hash(cell.source)


def refresh(path: Path, timeout: int = 600) -> bool:
    """Execute the notebook at `path` and store its canonical outputs; True if the file changed."""
    # an instructor's tools (requirements.txt), not dependencies of the package
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stored = nbformat.reads(text, as_version=4)
    nb = nbformat.reads(text, as_version=4)
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    ).execute()
    canonical(nb, stored)
    problems = failures(nb)
    if problems:
        raise StoredFailure(
            f"{path}: not stored: its outputs show a failure, and a solution's never may:\n"
            + "".join(f"  {p}\n" for p in problems)
            + "  fix the solution (or its check), then refresh again"
        )
    new = nbformat.writes(nb) + "\n"
    path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmcourse.course.refresh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "notebooks",
        nargs="*",
        metavar="NOTEBOOK",
        help="solution notebooks to refresh (default: every solutions/NN_topic/NN_topic.ipynb)",
    )
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.notebooks] or sorted(
        p for p in Path("solutions").glob("*/*.ipynb") if p.parent.name == p.stem
    )
    if not paths:
        print(
            "no notebooks to refresh: run this in the course folder (where solutions/ is) or name them", file=sys.stderr
        )
        return 2
    for path in paths:
        if not path.is_file():
            print(f"no notebook {path}", file=sys.stderr)
            return 2
        try:
            changed = refresh(path)
        except StoredFailure as err:
            print(err, file=sys.stderr)
            return 1
        print(f"{path}: {'outputs changed' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
