"""The test suite's setup: threads per worker, the notebooks' quick mode, and one worker for the course run.

The slow proofs (every notebook run, the nbgrader round trip, the book) come from one run of the whole course
(tests/course_run.py), made once by the session fixture `course_run`. Every test module that uses it runs on the
same pytest-xdist worker, and that worker starts with them: the other worker meanwhile runs everything else.
"""

import os

# The suite runs on pytest-xdist workers (pyproject.toml): each gets its share of the cores, and so do
# the kernels and commands it starts (OMP_NUM_THREADS is inherited), or torch's threads, which spin
# while they wait, fight over the same cores. Set before torch is imported.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

# Measurement cells of the notebooks (timings, bandwidth) measure less under test: `llmcourse.course.limits.quick`.
# The kernels nbgrader starts, and the commands the tests run, inherit it; the published book is built without it.
os.environ.setdefault("LLMCOURSE_QUICK", "1")
# torch.compile traces the decode step but generates no code (dynamo's eager backend): seconds instead of a minute
# per compiling test. tests/test_static_decode.py compiles with inductor for real.
os.environ.setdefault("LLMCOURSE_COMPILE_BACKEND", "eager")

import pytest  # noqa: E402

# The test modules that use the `course_run` fixture: one scope for pytest-xdist, scheduled first.
COURSE_RUN_MODULES = ("tests/test_notebooks.py", "tests/test_grading.py", "tests/test_book.py")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    stray = sorted({_module(i.nodeid) for i in items if "course_run" in getattr(i, "fixturenames", ())})
    stray = [m for m in stray if m not in COURSE_RUN_MODULES]
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)} use course_run: add them to COURSE_RUN_MODULES in conftest.py")
    items.sort(key=lambda item: _module(item.nodeid) not in COURSE_RUN_MODULES)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)  # a machine may run some test files without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's `--dist loadfile`, with the course run's modules as one unit, handed out first (the longest
    unit: started last, it would keep one worker busy long after the other has finished)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CourseRunFirst(LoadFileScheduling):
        def _split_scope(self, nodeid):
            module = _module(nodeid)
            return "course run" if module in COURSE_RUN_MODULES else module

    config.option.loadscopereorder = False  # the order of collection, which puts the course run first
    return CourseRunFirst(config, log)
