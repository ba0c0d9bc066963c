"""A solution notebook's exercises against its own checks, visible and hidden parts, without a kernel."""

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


def run_notebook_checks(path, capsys):
    setup, solutions, checks = notebook_cells(path)
    namespace = {"__name__": "__learner__"}
    for source in [*setup, *solutions]:
        exec(compile(source, str(path), "exec"), namespace)
    capsys.readouterr()
    for source in checks:
        exec(compile(source, f"{path}:check", "exec"), namespace)
    return capsys.readouterr().out
