"""Refreshing a solution notebook's stored outputs is deterministic: no diff when nothing changed."""

import shutil
from pathlib import Path

import nbformat
import pytest

from llmcourse.course.refresh import MACHINE_DEPENDENT, canonical, failures, main, merge_streams

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted(p for p in (ROOT / "solutions").glob("*/*.ipynb") if p.parent.name == p.stem)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_stored_outputs_are_in_canonical_form(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert "execution" not in cell.metadata, f"{cell.id}: timing metadata stored"
        assert merge_streams([dict(o) for o in cell.outputs]) == [dict(o) for o in cell.outputs], (
            f"{cell.id}: a stream split over several outputs (refresh with python -m llmcourse.course.refresh)"
        )


def test_refreshing_an_unchanged_notebook_changes_nothing(tmp_path):
    chapter = ROOT / "solutions" / "00_pipeline"
    copy = tmp_path / "00_pipeline"
    shutil.copytree(chapter, copy)
    notebook = copy / "00_pipeline.ipynb"
    assert main([str(notebook)]) == 0
    assert notebook.read_text(encoding="utf-8") == (chapter / "00_pipeline.ipynb").read_text(encoding="utf-8")


def test_machine_dependent_cells_keep_their_outputs_until_their_source_changes():
    stored = nbformat.v4.new_notebook()
    stored.cells = [
        nbformat.v4.new_code_cell("print(time.time())", id="timing"),
        nbformat.v4.new_code_cell("print(1)", id="plain"),
    ]
    stored.cells[0].metadata["tags"] = [MACHINE_DEPENDENT]
    for cell in stored.cells:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="old\n")]
    fresh = nbformat.reads(nbformat.writes(stored), as_version=4)
    for cell in fresh.cells:
        cell.outputs = [
            nbformat.v4.new_output("stream", name="stdout", text="new"),
            nbformat.v4.new_output("stream", name="stdout", text="\n"),
        ]
    canonical(fresh, stored)  # the stored outputs were made by an unknown source: the new ones are kept
    assert [o["text"] for o in fresh.cells[0].outputs] == ["new\n"]
    assert [o["text"] for o in fresh.cells[1].outputs] == ["new\n"]

    stored = nbformat.reads(nbformat.writes(fresh), as_version=4)
    stored.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="old\n")]
    canonical(fresh, stored)  # same source as the one that made the stored outputs: they stay
    assert [o["text"] for o in fresh.cells[0].outputs] == ["old\n"]

    fresh.cells[0].source = "print(time.perf_counter())"
    fresh.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="new\n")]
    canonical(fresh, stored)
    assert [o["text"] for o in fresh.cells[0].outputs] == ["new\n"]


def test_refresh_without_notebooks_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 2
    assert "solutions/" in capsys.readouterr().err


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_stored_solution_output_shows_a_failure(path):
    assert failures(nbformat.read(path, as_version=4)) == []


@pytest.mark.parametrize(
    "code, shown",
    [
        ("print('✗ softmax([1.0]) did not finish within its 5 CPU-s')", "✗ softmax"),
        ("print('capstone llm_engine: 07_batching (paged_attention) does not pass its check')", "does not pass"),
        ("import traceback\ntry:\n    1/0\nexcept Exception:\n    traceback.print_exc()", "Traceback"),
    ],
)
def test_refresh_refuses_to_store_a_failing_output(tmp_path, capsys, code, shown):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", id="fine"), nbformat.v4.new_code_cell(code, id="failing")]
    path = tmp_path / "01_topic.ipynb"
    nbformat.write(nb, path)
    before = path.read_text(encoding="utf-8")
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "not stored: its outputs show a failure" in err and "cell 2 (" in err and shown in err
    assert path.read_text(encoding="utf-8") == before  # nothing written
