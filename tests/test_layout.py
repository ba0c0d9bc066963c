"""The package's layout holds: sub-packages by concern, imports pointing only down, no import cycle, imports
inside functions only for heavy optional dependencies (each saying why), and the linter clean.

Read from the source (as text, like a reader would), so a violation names the file and line.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmcourse"

# Each sub-package may import only from those on a lower level (the CLI and the package's __init__ sit on top).
LEVELS = {"engine": 0, "serving": 1, "training": 1, "course": 2, "checks": 3, "bench": 3}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported llmcourse module, line, inside a function) for each import of the package in `path`."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text())
    in_function = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            targets = [n for n in names if MODULES.get(n)] or [target]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "llmcourse" or t.startswith("llmcourse."):
                found.append((t, node.lineno, id(node) in in_function))
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def owner(module: str) -> str:
    """The sub-package a module belongs to ('' for the package's own top-level files)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LEVELS) else ""


def graph() -> dict[str, set[str]]:
    edges = {}
    for name, path in MODULES.items():
        edges[name] = {t if t in MODULES else t.rsplit(".", 1)[0] for t, _, _ in imports(path)} - {name}
    return edges


def test_every_module_lives_in_a_sub_package():
    loose = sorted(
        n for n in MODULES if n.count(".") == 1 and n.split(".")[1] not in LEVELS and n not in ("llmcourse.__main__",)
    )
    assert loose == [], f"modules outside engine/, serving/, course/, checks/, bench/, training/: {loose}"


def test_imports_point_down_never_up():
    """The engine imports nothing from serving, the benchmarks, the course or the checks; and so on up."""
    wrong = []
    for name, path in MODULES.items():
        mine = owner(name)
        if mine not in LEVELS:
            continue  # llmcourse/__init__.py and __main__.py sit on top
        for target, line, _ in imports(path):
            theirs = owner(target)
            if theirs == "" and target != "llmcourse":
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (the package's top level)")
            elif theirs in LEVELS and theirs != mine and LEVELS[theirs] >= LEVELS[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycle():
    edges, state, stack, cycles = graph(), {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def said_why(lines: list[str], i: int) -> bool:
    """Whether import line `i` (0-based) or its block of consecutive imports carries a comment, or the line above
    the block is one."""
    while True:
        if "#" in lines[i]:
            return True
        above = lines[i - 1].strip()
        if above.startswith("#"):
            return True
        if not above.startswith(("import ", "from ")):
            return False
        i -= 1


def test_imports_inside_functions_only_for_heavy_optional_dependencies():
    """An import inside a function says why, on its line or above its block of imports: a heavy optional
    dependency, or a tool that is not the package's dependency. (The package's own modules imported there to
    dodge a cycle have no such reason: there is no cycle left to dodge.)"""
    wrong = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                if not said_why(lines, node.lineno - 1):
                    wrong.append(f"{where} (no comment saying why it is imported here)")
    assert wrong == [], "\n".join(wrong)


def test_the_engine_runs_without_the_rest():
    """Importing the engine's modules loads none of serving, bench, course, checks or training (the package's
    __init__ aside, which a fresh interpreter runs first: it is imported, then the engine is checked alone)."""
    code = (
        "import sys, llmcourse.engine.generate, llmcourse.engine.loading, llmcourse.engine.quantize; "
        "print(sorted(m for m in sys.modules if m.startswith('llmcourse.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "llmcourse.engine.generate" in out
    for path in (PACKAGE / "engine").glob("*.py"):
        for target, line, _ in imports(path):
            assert owner(target) in ("engine", ""), f"{path.name}:{line} imports {target}"


RUFF = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")


@pytest.mark.skipif(not Path(RUFF).exists(), reason="ruff is not installed (requirements.txt installs it)")
def test_the_linter_and_formatter_are_clean():
    """pyproject.toml's [tool.ruff]: line length, unused imports, import order, and the formatter's style."""
    lint = subprocess.run([str(RUFF), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([str(RUFF), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert fmt.returncode == 0, "run `ruff format .`:\n" + fmt.stdout + fmt.stderr
