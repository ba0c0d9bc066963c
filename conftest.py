"""nbval on the notebooks: solutions/ must run with their checked outputs unchanged; in chapters/
(the student release) every graded check, and every cell tagged `needs-exercise`, must fail on the
stubs (strict xfail: a check that passes on a stub is a broken check). A notebook in chapters/ that holds a
learner's work is not the release: its cells are skipped, saying so (tests/release.py)."""

import os

# The suite runs on pytest-xdist workers (pyproject.toml): each gets its share of the cores, and so do
# the kernels and commands it starts (OMP_NUM_THREADS is inherited), or torch's threads, which spin
# while they wait, fight over the same cores. Set before torch is imported.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

# Measurement cells of the notebooks (timings, bandwidth) measure less under test: `llmcourse.course.limits.quick`.
# The kernels nbval starts, and the commands the tests run, inherit it; the published book is built without it.
os.environ.setdefault("LLMCOURSE_QUICK", "1")

import pytest  # noqa: E402


def _start_kernel_with_retries():
    """nbval's kernels start on ports jupyter_client picks before the kernel binds them: a kernel started at the
    same moment by the other worker or by nbgrader can take one first, and the new kernel dies before it replies
    (seen once in CI: "Kernel died before replying to kernel_info"). Such a start is retried on fresh ports."""
    try:
        import nbval.kernel
    except ImportError:  # a machine that runs only some test files (a GPU's), without nbval
        return
    start = nbval.kernel.start_new_kernel

    def start_new_kernel(*args, **kwargs):
        for attempt in range(3):
            try:
                return start(*args, **kwargs)
            except RuntimeError as err:
                if "died" not in str(err) or attempt == 2:
                    raise

    nbval.kernel.start_new_kernel = start_new_kernel


_start_kernel_with_retries()


def pytest_collection_modifyitems(config, items):
    from tests.release import learner_work

    edited = {}
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "chapters" not in item.path.parts:
            continue
        if item.path not in edited:
            edited[item.path] = learner_work(item.path)
        if edited[item.path]:
            item.add_marker(pytest.mark.skip(reason=edited[item.path]))
            continue
        graded = cell.get("metadata", {}).get("nbgrader", {}).get("grade", False)
        if graded or "needs-exercise" in cell.get("metadata", {}).get("tags", []):
            item.add_marker(pytest.mark.xfail(strict=True, reason="must fail until the learner writes the exercise"))
