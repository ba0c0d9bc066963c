"""A solution notebook's setup, exercise and check cells, read without a kernel."""

import json
from pathlib import Path


def notebook_cells(path):
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    setup, solutions, checks = [], [], []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        meta = cell.get("metadata", {})
        grading = meta.get("nbgrader", {})
        source = "".join(cell["source"])
        if "setup" in meta.get("tags", []):
            setup.append(source)
        elif grading.get("solution") and not grading.get("grade"):
            solutions.append(source.replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", ""))
        elif grading.get("grade") and "check_" in source:
            checks.append(source.replace("### BEGIN HIDDEN TESTS", "").replace("### END HIDDEN TESTS", ""))
    return setup, solutions, checks
