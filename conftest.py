"""nbval on the notebooks: solutions/ must run with their checked outputs unchanged; in chapters/
(the student release) every graded check, and every cell tagged `needs-exercise`, must fail on the
stubs (strict xfail: a check that passes on a stub is a broken check)."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "chapters" not in item.path.parts:
            continue
        graded = cell.get("metadata", {}).get("nbgrader", {}).get("grade", False)
        if graded or "needs-exercise" in cell.get("metadata", {}).get("tags", []):
            item.add_marker(pytest.mark.xfail(strict=True, reason="must fail until the learner writes the exercise"))
