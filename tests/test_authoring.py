"""The authoring rules of instructor.md that a machine can check, on every solution notebook."""

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted(p for p in (ROOT / "solutions").glob("*/*.ipynb") if p.parent.name == p.stem)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_figure_has_alternative_text(path):
    """Feedback HTML and screen readers use the cell's `alt`; without it nbgrader warns on every student."""
    nb = nbformat.read(path, as_version=4)
    missing = [
        cell.id
        for cell in nb.cells
        if cell.cell_type == "code"
        and not cell.metadata.get("alt")
        and any(key.startswith("image/") for out in cell.outputs for key in out.get("data", {}))
    ]
    assert missing == [], f"figure cells without metadata 'alt': {missing}"
