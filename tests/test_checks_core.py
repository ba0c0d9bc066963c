"""The machinery every check shares (llmcourse/checks/core.py): each safeguard is tested on its own
here, on made-up exercises, so that a later chapter's check gets it without writing a line."""

import functools
import importlib
import importlib.util
import math
import re
import signal
import sys
import time
from collections import Counter
from math import factorial as factorial_imported_early

import pytest
import torch

from llmcourse.checks.harness import forbid
from llmcourse.checks.harness.core import Case, CheckFailed, call_learner, equal, run_check
from llmcourse.checks.harness.forbid import Forbidden, ForbiddenCall, forbidding
from llmcourse.checks.harness.show import short
from llmcourse.course.limits import TimeUp, time_limit, time_out_message, wall_ceiling

# -- order-aware comparison ---------------------------------------------------------------------


def test_dicts_compare_in_order():
    assert equal({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    assert "different order" in equal({"b": 2, "a": 1}, {"a": 1, "b": 2})
    assert "different order" in equal([{"b": 2, "a": 1}], [{"a": 1, "b": 2}])  # nested too
    assert equal(Counter({"a": 2, "b": 1}), {"a": 2, "b": 1}) is None  # a dict subclass in the same order is fine


def test_types_and_numbers():
    assert "expected a list, got a tuple" in equal((1, 2), [1, 2])
    assert "expected an int, got a bool" in equal(True, 1)
    assert equal(1.0 + 1e-9, 1.0) is None and equal(2, 2.0) is None
    assert equal(float("nan"), float("nan")) is None
    assert "numbers differ" in equal(1.1, 1.0)
    assert equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-8])) is None
    assert "shape" in equal(torch.zeros(2), torch.zeros(3))


def test_run_check_compares_dicts_in_order_by_default():
    def counts(text):
        return dict(sorted(Counter(text).items()))  # right counts, sorted: not the order of first occurrence

    with pytest.raises(CheckFailed, match="different order"):
        run_check("counts", counts, [Case("a word", ("banana",), dict(Counter("banana")))])


# -- bounded messages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        bytes(97),
        b"ab" + bytes(5000) + b"cd",
        "x" * 10**6,
        "".join(map(chr, range(32, 20000))),
        list(range(10**5)),
        [[0] * 1000] * 1000,
        {i: bytes([i % 256]) * 50 for i in range(5000)},
        torch.randn(50257),
        (b"\xff" * 300,),
        {"nested": [{"deep": "y" * 10**4}]},
    ],
)
def test_short_bounds_every_value(value):
    assert len(short(value)) <= 300
    assert len(short(value, 60)) <= 60


def test_short_shows_runs_as_repetitions():
    assert short(bytes(97)) == "b'\\x00' * 97"
    assert short("ab" + "\n" * 40 + "c") == "'ab' + '\\n' * 40 + 'c'"
    assert short([1, 2] + [0] * 50) == "[1, 2, *[0] * 50]"


def test_short_survives_a_broken_repr():
    class Broken:
        def __repr__(self):
            raise ValueError("no")

    assert short(Broken()) == "<Broken object>"


# -- messages, not tracebacks, in Jupyter -------------------------------------------------------


def test_check_failed_renders_as_its_message():
    err = CheckFailed("✗ f — a case: wrong\n  input:    f(1)\n  hint: do it right")
    assert err._render_traceback_() == ["✗ f — a case: wrong", "  input:    f(1)", "  hint: do it right"]


def test_a_failing_check_cell_shows_the_message_in_a_kernel():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from llmcourse.checks import check_merge\n"
            "def merge(ids, pair, new_id):\n"
            "    return list(ids)\n"
            "check_merge(merge)"
        )
    ]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    (error,) = [out for out in nb.cells[0].outputs if out["output_type"] == "error"]
    assert error["ename"] == "CheckFailed" and "nothing was merged" in error["evalue"]  # what nbgrader records
    shown = "\n".join(error["traceback"])
    assert shown.startswith("✗ merge — exactly the pair: nothing was merged")
    assert "core.py" not in shown and "Traceback" not in shown and "File " not in shown


# -- inputs must not change ---------------------------------------------------------------------


def test_a_changed_list_dict_or_tensor_is_reported():
    def appends(ids):
        ids.append(0)
        return ids

    def adds_a_key(table):
        table["new"] = 1
        return len(table)

    def reorders(table):
        table["a"] = table.pop("a")  # same items, another order
        return len(table)

    def scales(x):
        x *= 2
        return float(x.sum())

    def deep(rows):
        rows[0].append(9)
        return 0

    for fn, args, message in [
        (
            appends,
            ([1, 2],),
            r"changed its input `ids`[\s\S]*before the call: \[1, 2\][\s\S]*after the call:  \[1, 2, 0\]",
        ),
        (adds_a_key, ({"a": 1, "b": 2},), r"changed its input `table`[\s\S]*dict\(d\)"),
        (reorders, ({"a": 1, "b": 2},), r"changed its input `table`"),
        (scales, (torch.ones(3),), r"changed its input `x`[\s\S]*in-place operation"),
        (deep, ([[1], [2]],), r"changed its input `rows`"),
    ]:
        with pytest.raises(CheckFailed, match=message):
            run_check(fn.__name__, fn, [Case("a case", args, None)], judge=lambda case, got: None)


def test_may_modify_allows_it_by_name_or_position():
    def sorts(ids, key):
        ids.sort()
        return ids

    cases = lambda: [Case("a case", ([3, 1, 2], None), [1, 2, 3])]  # noqa: E731
    run_check("sorts", sorts, cases(), may_modify=["ids"])
    run_check("sorts", sorts, cases(), may_modify=[0])
    run_check("sorts", sorts, cases(), may_modify=True)
    with pytest.raises(CheckFailed, match="changed its input `ids`"):
        run_check("sorts", sorts, cases())


def test_unchanged_inputs_pass_also_with_nan_and_shared_arguments(capsys):
    shared = {i: bytes([i]) for i in range(256)}
    cases = [Case(f"#{i}", (torch.tensor([math.nan, 1.0]), shared, i), i) for i in range(5)]
    run_check("reads", lambda x, table, i: i, cases)
    assert capsys.readouterr().out == "✓ reads — 5 cases\n"


# -- black boxes, however they are reached ------------------------------------------------------


def black_box(x):
    return x + 1


@functools.lru_cache(maxsize=None)
def cached_black_box(x):
    return x * 2


class BlackBoxClass:
    def run(self, x):
        return x - 1


BLACK_BOX_ALIAS = black_box


def test_a_python_function_is_caught_through_any_alias():
    rule = [Forbidden(f"{__name__}.black_box", "Write it yourself.")]
    for fn in (lambda x: black_box(x), lambda x: BLACK_BOX_ALIAS(x), black_box):
        with pytest.raises(CheckFailed, match=rf"called {__name__}\.black_box, the black box[\s\S]*Write it yourself"):
            run_check("f", fn, [Case("a case", (1,), 2)], forbid=rule)


def test_a_cached_function_is_caught_even_when_its_answer_is_cached():
    cached_black_box(1)  # cached before the check
    with pytest.raises(CheckFailed, match="called .*cached_black_box"):
        run_check(
            "f",
            lambda x: cached_black_box(x),
            [Case("a case", (1,), 2)],
            forbid=[Forbidden(f"{__name__}.cached_black_box")],
        )


def test_a_class_is_caught_in_subclasses_too():
    class Mine(BlackBoxClass):
        pass

    with pytest.raises(CheckFailed, match=r"BlackBoxClass\.run \(that is .*BlackBoxClass\)"):
        run_check(
            "f", lambda x: Mine().run(x), [Case("a case", (1,), 0)], forbid=[Forbidden(f"{__name__}.BlackBoxClass")]
        )


def test_a_c_function_is_caught_through_an_alias_imported_before():
    with pytest.raises(CheckFailed, match=r"called math\.factorial"):
        run_check(
            "f",
            lambda n: factorial_imported_early(n),
            [Case("a case", (5,), 120)],
            forbid=[Forbidden("math.factorial", "Multiply yourself.")],
        )


def test_a_c_method_is_caught():
    with pytest.raises(CheckFailed, match=r"called str\.upper"):
        run_check("f", lambda s: s.upper(), [Case("a case", ("a",), "A")], forbid=[Forbidden("str.upper")])


def test_a_package_is_caught_even_if_imported_during_the_call(tmp_path, monkeypatch):
    package = tmp_path / "made_up_black_box"
    package.mkdir()
    slow = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 30:\n    pass\n"
    (package / "__init__.py").write_text(slow + "def solve(x):\n    return x\n")  # slow on first use
    (package / "part.py").write_text("def solve(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def uses_it(x):
        from made_up_black_box.part import solve

        return solve(x)

    start = time.process_time()
    with pytest.raises(CheckFailed, match=r"your function imported made_up_black_box, the black box"):
        run_check("f", uses_it, [Case("a case", (1,), 1)], forbid=[Forbidden("made_up_black_box")], seconds=5)
    assert time.process_time() - start < 1  # refused before it loads: not "did not finish within 5 CPU-s"
    assert "made_up_black_box" not in sys.modules and importlib.util.find_spec("made_up_black_box") is not None
    assert sys.meta_path[0] is not forbid._IMPORTS  # the import watch ends with the call


def test_a_forbidden_c_extension_is_refused_when_imported():
    """An extension module has no Python frame to see: it is refused by the import watch, before it loads."""

    def extension(name):
        spec = importlib.util.find_spec(name)
        return name not in sys.modules and spec is not None and str(spec.origin).endswith(".so")

    name = next(filter(extension, ["xxlimited", "termios", "resource", "_curses"]), None)
    if name is None:
        pytest.skip("no C extension module left to import")

    def uses_it(x):
        return importlib.import_module(name) and x

    with pytest.raises(CheckFailed, match=rf"your function imported {name}, the black box"):
        run_check("f", uses_it, [Case("a case", (1,), 1)], forbid=[Forbidden(name)])
    assert name not in sys.modules


def test_torchscript_and_imports_are_refused_only_for_forbidden_names():
    """A learner's own TorchScript function and an import of an allowed module pass; a probe of a forbidden module
    (importlib.util.find_spec, as libraries check what is installed) is answered; both watches end with the call."""
    own = torch.jit.script(lambda_free_double)

    def fn(x):
        import quopri  # noqa: F401  (allowed, perhaps imported here for the first time)

        assert importlib.util.find_spec("colorsys") is not None  # forbidden, not imported: only probed
        return own(x)

    calls = {kind: kind.__call__ for kind in forbid._SCRIPT_TYPES}
    imported = "colorsys" in sys.modules
    run_check(
        "double",
        fn,
        [Case("a case", (torch.ones(2),), torch.full((2,), 2.0))],
        forbid=[Forbidden("colorsys"), Forbidden(f"{__name__}.black_box")],
    )
    assert all(kind.__call__ is call for kind, call in calls.items()) and forbid._IMPORTS not in sys.meta_path
    assert ("colorsys" in sys.modules) == imported


def lambda_free_double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_torch_functions_are_caught_by_name_on_every_route():
    from torch import sort as sort_imported_early

    routes = [
        lambda x: sort_imported_early(x),
        lambda x: x.sort(),
        lambda x: torch.sort(x),
        lambda x: torch.ops.aten.sort(x),
        lambda x: torch.ops.aten.sort.default(x),
        lambda x: torch.Tensor.sort(x),
        lambda x: torch._C._VariableFunctions.sort(x),
    ]
    for route in routes:
        with pytest.raises(CheckFailed, match=r"called torch\.(ops\.aten\.|Tensor\.)?sort\b"):
            run_check(
                "f",
                route,
                [Case("a case", (torch.tensor([2.0, 1.0]),), None)],
                forbid=[Forbidden("torch.sort")],
                judge=lambda case, got: None,
            )
    run_check(
        "f",
        lambda x: torch.argsort(x),
        [Case("a case", (torch.tensor([2.0, 1.0]),), None)],
        forbid=[Forbidden("torch.sort")],
        judge=lambda case, got: None,
    )  # another name: allowed


def test_a_caught_refusal_still_fails_the_check():
    def hides_it(x):
        try:
            return black_box(x)
        except Exception:
            return x + 1

    with pytest.raises(CheckFailed, match="called .*black_box"):
        run_check("f", hides_it, [Case("a case", (1,), 2)], forbid=[Forbidden(f"{__name__}.black_box")])


def test_the_watch_ends_with_the_call():
    with pytest.raises(CheckFailed):
        run_check("f", black_box, [Case("a case", (1,), 2)], forbid=[Forbidden(f"{__name__}.black_box")])
    assert sys.getprofile() is None
    assert black_box(1) == 2 and cached_black_box(3) == 6
    with forbidding([Forbidden(f"{__name__}.black_box")]):
        with pytest.raises(ForbiddenCall):
            black_box(1)
    assert black_box(1) == 2


# -- time: nestable limits that learner code cannot swallow -------------------------------------


def spin():
    while True:
        pass


def test_an_exception_handler_does_not_swallow_the_time_out():
    def swallows(x):
        while True:
            try:
                spin()
            except Exception:  # everything an Exception can be: the time-out is not one
                pass

    start = time.process_time()
    with pytest.raises(CheckFailed, match="did not finish within its 0.3 CPU-s"):
        run_check("f", swallows, [Case("a case", (1,), 1)], seconds=0.3)
    assert time.process_time() - start < 1


def test_a_bare_except_only_delays_the_time_out():
    def catches_everything(x):
        for _ in range(5):
            try:
                spin()
            except:  # noqa: E722  (catches the time-out, but it comes back 50 ms later)
                pass
        return x  # returns after its time was up: still a time-out

    with pytest.raises(CheckFailed, match="did not finish within its 0.3 CPU-s"):
        run_check("f", catches_everything, [Case("a case", (1,), 1)], seconds=0.3)


def burn(cpu_seconds: float) -> None:
    """Compute (not wait) for this much CPU time."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def test_time_limits_nest():
    start = time.process_time()
    with pytest.raises(TimeoutError, match="after 1 CPU-s"):
        with time_limit(1.0):
            for _ in range(20):  # each inner limit ends in time; the outer one still counts
                with time_limit(0.5):
                    burn(0.1)
    assert 0.9 < time.process_time() - start < 1.5


def test_an_outer_limit_passes_through_an_inner_one():
    with pytest.raises(TimeoutError, match="after 0.3 CPU-s"):
        with time_limit(0.3):
            with pytest.raises(TimeUp):  # inside, it is the outer limit's TimeUp: the inner block lets it pass
                with time_limit(5):
                    spin()
            raise AssertionError("not reached")  # pragma: no cover


def test_a_learner_call_inside_an_outer_limit_leaves_it_running():
    """progress() runs a check cell under one limit; each learner call under its own: both hold."""
    with pytest.raises(TimeoutError):
        with time_limit(0.5):
            for i in range(100):
                call_learner("f", lambda: burn(0.05), (), seconds=10)


def test_a_limit_counts_cpu_time_not_the_wall():
    """Waiting (the stand-in for a share of a busy core) uses no CPU time: a 0.3 CPU-s limit lets 1 s of
    sleeping through, and stops 0.3 CPU-s of computing."""
    with time_limit(0.3) as limit:
        time.sleep(1.0)
    assert not limit.expired and limit.wall_used >= 1.0 and limit.cpu_used < 0.3
    with pytest.raises(TimeoutError, match="after 0.3 CPU-s"):
        with time_limit(0.3) as limit:
            spin()
    assert 0.3 <= limit.cpu_used < 0.6 and not limit.by_wall


def test_a_wait_is_stopped_by_the_wall_ceiling_with_a_message_that_says_it_waits():
    assert wall_ceiling(10) == 50  # the default: far above 10 CPU-s of work with two processes per core
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="after 0.5 s on the wall"):
        with time_limit(10, wall=0.5) as limit:
            time.sleep(3600)
    assert time.monotonic() - start < 1.5 and limit.by_wall
    message = time_out_message("f(1)", limit)
    assert "did not finish within 0.5 s on the wall" in message and "waits rather than computes" in message
    assert "time.sleep" in message


def test_a_limit_scaled_to_the_reference_says_both_in_its_message():
    def reference(x):
        burn(0.05)
        return x

    with pytest.raises(CheckFailed) as caught:
        call_learner("f", lambda x: spin(), (1,), seconds=0.2, reference=reference)
    message = str(caught.value)
    found = re.search(r"within its ([\d.]+) CPU-s: it was stopped after using ([\d.]+) CPU-s, where the engine's "
                      r"reference used ([\d.]+) CPU-s on the same input \(the limit here is the larger of 0.2 CPU-s "
                      r"and 20× the engine's\)", message)  # fmt: skip
    assert found, message
    limit, used, engine = map(float, found.groups())
    assert 0.05 <= engine < 0.2 and limit == pytest.approx(20 * engine, rel=0.02) and used >= 0.99 * limit  # 3 digits
    call_learner("f", lambda x: burn(0.3) or x, (1,), seconds=0.2, reference=reference)  # 0.3 < 20 × 0.05: passes


def test_time_limit_leaves_no_timer_behind():
    previous = signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGPROF)
    with time_limit(5):
        pass
    with pytest.raises(TimeoutError):
        with time_limit(0.1):
            spin()
    assert (signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGPROF)) == previous
    assert signal.getitimer(signal.ITIMER_REAL) == signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


def test_a_check_has_a_total_budget():
    def slow(x):
        burn(0.1)
        return x

    with pytest.raises(CheckFailed, match=r"stopped after 0.5 CPU-s in total, with \d of 20 cases done[\s\S]*too slow"):
        run_check("f", slow, [Case(f"#{i}", (i,), i) for i in range(20)], total_seconds=0.5)


# -- crashes ------------------------------------------------------------------------------------


class PanicException(BaseException):
    """Like pyo3's: Rust panics in tiktoken are not Exceptions."""


def test_errors_that_are_not_exceptions_become_messages():
    def panics(x):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    def exits(x):
        sys.exit(1)

    with pytest.raises(
        CheckFailed, match=r"raised PanicException: called `Result::unwrap\(\)`[\s\S]*line \d+ in panics"
    ):
        run_check("f", panics, [Case("a case", (1,), 1)])
    with pytest.raises(CheckFailed, match=r"called exit\(\)"):
        run_check("f", exits, [Case("a case", (1,), 1)])


def test_a_result_that_cannot_be_compared_becomes_a_message():
    class Weird:
        def __eq__(self, other):
            raise RuntimeError("cannot compare")

        __hash__ = None

    with pytest.raises(CheckFailed, match=r"your answer could not be compared[\s\S]*RuntimeError: cannot compare"):
        run_check("f", lambda x: Weird(), [Case("a case", (1,), 1)], compare=lambda got, expected: got == expected)


def test_keyboard_interrupt_stops_the_check():
    def interrupted(x):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_check("f", interrupted, [Case("a case", (1,), 1)])


def test_the_learner_error_points_at_the_learner_line():
    def fails(ids):
        total = 0
        for i in ids:
            total += {}[i]  # KeyError here
        return total

    with pytest.raises(CheckFailed, match=r"raised KeyError: 1\n  at line \d+ in fails: total \+= \{\}\[i\]"):
        run_check("f", fails, [Case("a case", ([1],), 0)])


# -- hints --------------------------------------------------------------------------------------


def test_one_hint_per_message_the_diagnosis_before_the_cases_own():
    def judge(case, got):
        if got == case.expected:
            return None
        return ("wrong", "the judge's diagnosis") if got == 0 else ("wrong", "")

    cases = [Case("a case", (1,), 1, hint="the case's own hint")]
    with pytest.raises(CheckFailed) as caught:
        run_check("f", lambda x: 0, cases, judge=judge)
    assert str(caught.value).count("hint:") == 1 and str(caught.value).endswith("hint: the judge's diagnosis")
    with pytest.raises(CheckFailed) as caught:
        run_check("f", lambda x: 2, cases, judge=judge)  # nothing diagnosed: the case's hint
    assert str(caught.value).count("hint:") == 1 and str(caught.value).endswith("hint: the case's own hint")


def test_the_time_out_hint_is_the_checks_own():
    with pytest.raises(CheckFailed, match=r"hint: is the loop over the tokens\?") as caught:
        run_check(
            "f", lambda x: spin(), [Case("a case", (1,), 1)], seconds=0.2, timeout_hint="is the loop over the tokens?"
        )
    assert "merge" not in str(caught.value)


# -- issue 22: the safeguards every check gets from the shared machinery -------------------------

import fractions  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402

import numpy  # noqa: E402

from llmcourse.checks import later  # noqa: E402
from llmcourse.checks.harness import isolate  # noqa: E402
from llmcourse.checks.harness.randomness import generator_contract  # noqa: E402
from llmcourse.course import limits  # noqa: E402

SOFTMAX_RULES = [Forbidden("torch.softmax", "Write it yourself.")]


def _isolated_check(fn, cases, **kwargs):
    """A check made as chapters make theirs: run_check inside a function that runs in a child process."""
    return isolate.isolated(lambda: run_check("f", fn, cases, **kwargs))()


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(isolate, "GRACE", 0.5)  # the child is forked after this: it has it too


@pytest.mark.skipif(not isolate.usable(), reason="needs fork (Linux)")
@pytest.mark.parametrize("hang", ["one C call", "catches the time-out"])
def test_a_hang_the_in_process_limit_cannot_stop_is_ended_and_the_caller_survives(hang, short_grace):
    def in_c(x):
        return sum(range(10**13))  # one C call: no Python instruction for the time-out to interrupt

    def catches(x):
        while True:
            try:
                while True:
                    pass
            except BaseException:  # also the time-out, every time it comes back
                continue

    before = os.times()
    with pytest.raises(CheckFailed, match=r"did not finish within its 1 CPU-s[\s\S]*the check ended it"):
        _isolated_check(in_c if hang == "one C call" else catches, [Case("a case", (1,), 1)], seconds=1)
    after = os.times()  # the ended child's CPU time, now counted in its parent's children_* (it was waited for)
    child_cpu = after.children_user + after.children_system - before.children_user - before.children_system
    assert 1.0 < child_cpu < 1.0 + 0.5 + 1.0  # its limit, the grace, and the parent's polling and slack
    assert sys.getprofile() is None and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    _isolated_check(lambda x: x, [Case("a case", (1,), 1)])  # the caller goes on as before


@pytest.mark.skipif(not isolate.usable(), reason="needs fork (Linux)")
def test_a_hang_under_any_limit_of_the_check_is_ended_not_only_a_learner_call(short_grace):
    """A check that runs learner code under a `time_limit` of its own (as generating with the learner's sampler in
    the engine does) is watched as a call is: the child reports every limit it enters."""

    def check():
        with time_limit(1):
            sum(range(10**13))  # one C call

    before = os.times()
    with pytest.raises(CheckFailed, match=r"✗ the check did not finish within its 1 CPU-s[\s\S]*the check ended it"):
        isolate.isolated(check)()
    after = os.times()
    assert 1.0 < after.children_user + after.children_system - before.children_user - before.children_system < 2.5


@pytest.mark.skipif(not isolate.usable(), reason="needs fork (Linux)")
def test_a_long_sleep_in_a_child_is_stopped_by_the_wall_ceiling(monkeypatch):
    monkeypatch.setattr(limits, "wall_ceiling", lambda cpu: 1.0)  # forked after this: the child has it too
    start = time.monotonic()
    with pytest.raises(
        CheckFailed, match=r"(did not finish within|stopped after) 1 s on the wall[\s\S]*waits rather than computes"
    ):
        _isolated_check(lambda x: time.sleep(3600), [Case("a case", (1,), 1)], seconds=10)
    assert time.monotonic() - start < 30  # 1 s, however busy the machine (the wall is what this limit counts)


@pytest.mark.skipif(not isolate.usable(), reason="needs fork (Linux)")
def test_a_check_in_a_child_prints_here_and_a_crash_is_a_clear_failure(capsys):
    _isolated_check(lambda x: x, [Case("a case", (1,), 1)])
    assert capsys.readouterr().out == "✓ f — 1 case\n"
    with pytest.raises(CheckFailed, match=r"ended unexpectedly \(exit status 3\) while running f\(1\)"):
        _isolated_check(lambda x: os._exit(3), [Case("a case", (1,), 1)])


@pytest.mark.skipif(not isolate.usable(), reason="needs fork (Linux)")
def test_the_child_uses_torch_safely_after_the_parent_used_its_threads():
    a = torch.randn(512, 512)
    a @ a  # the parent's OpenMP threads have run
    _isolated_check(
        lambda x: (x @ x).sum(),
        [Case("a matmul", (a,), later(lambda: (a @ a).sum()))],
        compare=lambda got, expected: None if torch.allclose(got, expected, rtol=1e-4) else "differ",
    )


def _softmax_routes():
    scripted = torch.jit.script(torch.nn.functional.softmax)  # compiled before the check: runs in C++

    return {
        "_op": lambda x: torch.ops.aten._softmax.default._op(x, -1, False),
        "_safe_softmax": lambda x: torch.ops.aten._safe_softmax(x, -1),
        "_masked_softmax": lambda x: torch._masked_softmax(x, torch.zeros_like(x, dtype=torch.bool)),
        "log_softmax": lambda x: torch.ops.aten._log_softmax(x, -1, False).exp(),
        "cross_entropy": lambda x: torch.stack(
            [
                (-torch.nn.functional.cross_entropy(x[None], torch.tensor([i]), reduction="none")).exp()[0]
                for i in range(x.shape[-1])
            ]
        ),
        "sdpa as softmax": lambda x: torch.nn.functional.scaled_dot_product_attention(
            torch.zeros(1, 1, x.shape[-1]),
            torch.zeros(1, x.shape[-1], 1),
            torch.eye(x.shape[-1])[None],
            attn_mask=x[None, None],
        ).flatten(),
        "jit.script": lambda x: scripted(x, -1),
    }


@pytest.mark.parametrize("route", list(_softmax_routes()))
def test_a_black_box_is_caught_by_what_it_computes_however_it_is_reached(route):
    fn = _softmax_routes()[route]
    x = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(CheckFailed, match=r"your function called torch\.(ops\.aten\.)?\w+ \(that is torch\.softmax\)"):
        run_check("softmax", fn, [Case("a case", (x,), torch.softmax(x, -1))], forbid=SOFTMAX_RULES)


@pytest.mark.parametrize(
    "target, route",
    [
        ("torch.nn.functional.gelu", lambda x: torch._C._nn.gelu_(x.clone(), approximate="tanh")),
        ("torch.nn.functional.layer_norm", lambda x: torch.group_norm(x[:, None], 1)[:, 0]),
        ("torch.nn.functional.layer_norm", lambda x: torch.rms_norm(x - x.mean(-1, keepdim=True), (x.shape[-1],))),
        ("torch.nn.functional.embedding", lambda x: torch.nn.functional.embedding_bag(torch.tensor([[0]]), x)),
    ],
)
def test_private_kernels_of_the_same_job_are_caught(target, route):
    x = torch.randn(2, 4)
    with pytest.raises(CheckFailed, match="your function called torch"):
        run_check("f", route, [Case("a case", (x,), None)], forbid=[Forbidden(target)], judge=lambda case, got: None)


def test_an_allowed_function_of_another_name_stays_allowed():
    x = torch.tensor([3.0, 1.0, 2.0])
    run_check(
        "f", lambda x: x.exp() / x.exp().sum(), [Case("a case", (x,), torch.softmax(x, -1))], forbid=SOFTMAX_RULES
    )  # exp, sum, div: the exercise's own ingredients


@pytest.mark.parametrize("peek", ["sys._getframe", "inspect.stack", "gc.get_objects", "setprofile", "pop mode"])
def test_introspection_and_switching_the_watch_off_are_refused(peek):
    def fn(x):
        if peek == "sys._getframe":
            return sys._getframe(3).f_locals["case"].expected
        if peek == "inspect.stack":
            return inspect.stack()[3].frame.f_locals["case"].expected
        if peek == "gc.get_objects":
            return next(o.expected for o in gc.get_objects() if isinstance(o, Case))
        if peek == "setprofile":
            sys.setprofile(None)
            return torch.softmax(x, -1)
        torch.utils._python_dispatch._pop_mode()
        return x.exp() / x.exp().sum()

    x = torch.tensor([1.0, 2.0])
    with pytest.raises(CheckFailed, match="reads the frames or objects of the check|switched off the check's watch"):
        run_check("softmax", fn, [Case("a case", (x,), torch.softmax(x, -1))], forbid=SOFTMAX_RULES)


def test_an_expected_answer_computed_later_is_out_of_reach_of_the_frames():
    def walks_the_frames(x):
        try:
            raise ValueError
        except ValueError as err:
            frame = err.__traceback__.tb_frame  # an attribute, not a call: no watch sees it
        while frame is not None:
            for value in frame.f_locals.values():
                if isinstance(value, Case):
                    return value.expected
            frame = frame.f_back
        return None

    x = torch.tensor([1.0, 2.0])
    with pytest.raises(CheckFailed, match=r"expected a torch.Tensor of shape \(2,\), got later\(softmax"):
        run_check("softmax", walks_the_frames, [Case("a case", (x,), later(torch.softmax, x, -1))])


def test_the_checks_own_functions_are_refused():
    from llmcourse.checks import embeddings

    ids = torch.tensor([[1, 2]])
    wte, wpe = torch.randn(5, 3), torch.randn(4, 3)
    with pytest.raises(CheckFailed, match="llmcourse.checks.embeddings.reference_embed, one of the check's own"):
        run_check(
            "embed",
            lambda *a: embeddings.reference_embed(*a),
            [Case("a case", (wte, wpe, ids), None)],
            judge=lambda case, got: None,
        )


def test_answers_are_plain_tensors_and_any_python_number():
    class AlwaysEqual(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.tensor(True)

    liar = torch.zeros(2).as_subclass(AlwaysEqual)
    assert "plain torch.Tensor, got a AlwaysEqual" in equal(liar, torch.ones(2))
    from llmcourse.checks.harness.tensors import tensor_problem

    assert "plain torch.Tensor" in tensor_problem(liar, torch.ones(2))
    assert equal(numpy.int64(3), 3) is None and equal(fractions.Fraction(1, 3), 1 / 3) is None
    assert equal(numpy.float32(0.5), 0.5) is None and equal(numpy.bool_(True), True) is None
    assert equal([numpy.int64(1), (2, fractions.Fraction(1, 2))], [1, (2, 0.5)]) is None
    assert "expected a Python int, got a Tensor (use .item())" in equal(torch.tensor(1), 1)


def test_messages_show_the_digits_that_differ_where_an_input_changed_and_the_device():
    assert "expected 0.1153642, got 0.1153641" in equal(0.1153641, 0.1153642, rel_tol=1e-9, abs_tol=0)
    from llmcourse.checks.harness.tensors import tensor_problem

    problem = tensor_problem(torch.tensor([0.115366]), torch.tensor([0.115364]), atol=1e-7, rtol=0)
    assert "expected 0.115364, got 0.115366" in problem and "close, but the check asks for" in problem
    assert tensor_problem(torch.zeros(2, device="meta"), torch.zeros(2)) == "expected a tensor on cpu, got one on meta"

    def writes(cache):
        cache[1, 2] = 7.0
        return cache

    with pytest.raises(CheckFailed, match=r"first at k_cache\[1, 2\]: 0\.0 before the call, 7\.0 after it"):
        run_check(
            "f",
            lambda k_cache: writes(k_cache),
            [Case("a case", (torch.zeros(3, 4),), None)],
            judge=lambda case, got: None,
        )
    assert short(torch.nn.Linear(3, 2)) == "<Linear: 8 parameters (float32)>"


def _draws(sampler):
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    return lambda g: call_learner("sample", sampler, (probs, g)).tolist()


def _multinomial(probs, generator=None):
    return torch.multinomial(probs, 8, replacement=True, generator=generator)


def _inverse_cdf(probs, generator=None):  # another way to draw: uniforms through the cumulative sum
    u = torch.rand(probs.shape[0], 8, generator=generator, dtype=probs.dtype)
    return torch.searchsorted(probs.cumsum(-1), u).clamp(max=probs.shape[-1] - 1)


def _ignores_generator(probs, generator=None):
    return torch.multinomial(probs, 8, replacement=True)


def _copies_state(probs, generator=None):
    own = torch.Generator().set_state(generator.get_state()) if generator is not None else None
    return torch.multinomial(probs, 8, replacement=True, generator=own)


def _reseeds_global(probs, generator=None):
    torch.manual_seed(0)
    return torch.multinomial(probs, 8, replacement=True, generator=generator)


def _fresh_when_none(probs, generator=None):
    return torch.multinomial(probs, 8, replacement=True, generator=generator or torch.Generator())


@pytest.mark.parametrize("sampler", [_multinomial, _inverse_cdf])
def test_the_randomness_contract_accepts_samplers_that_keep_it(sampler):
    generator_contract("sample", _draws(sampler))


@pytest.mark.parametrize(
    "sampler, message",
    [
        (_ignores_generator, "used or changed torch's global generator"),
        (_copies_state, "the generator's state did not change"),
        (_reseeds_global, "used or changed torch's global generator"),
        (_fresh_when_none, "calls with generator=None gave the same result"),
    ],
)
def test_the_randomness_contract_rejects_what_breaks_it(sampler, message):
    state = torch.random.get_rng_state()
    with pytest.raises(CheckFailed, match=message):
        generator_contract("sample", _draws(sampler))
    assert torch.equal(torch.random.get_rng_state(), state)  # the contract's own draws leave it as it was


def test_every_forbidden_name_of_the_package_resolves():
    """A rule naming an llmcourse function that does not exist (a module moved, a typo) would forbid nothing: the
    checks' rules all compile, and such a rule is refused."""
    import importlib
    import pkgutil

    from llmcourse import checks
    from llmcourse.checks.harness import forbid

    rules = []
    for info in pkgutil.iter_modules(checks.__path__):
        module = importlib.import_module(f"llmcourse.checks.{info.name}")
        for value in vars(module).values():
            values = value if isinstance(value, (list, tuple)) else [value]
            rules += [v for v in values if isinstance(v, Forbidden) and v.target.startswith("llmcourse.")]
    assert len(rules) > 20
    forbid._compile(rules)  # raises on a name that resolves to nothing
    with pytest.raises(ValueError, match=r"Forbidden\('llmcourse.parts.softmax'\) names nothing in llmcourse"):
        forbid._compile([Forbidden("llmcourse.parts.softmax", "moved")])


# -- issue 41: messages that show where expected and got differ, at the smallest failing case ------

from llmcourse.checks.harness import shrink as shrinking  # noqa: E402
from llmcourse.checks.harness.show import previews  # noqa: E402
from llmcourse.checks.harness.tensors import tensor_judge  # noqa: E402

CLOSE = tensor_judge({torch.float32: (1e-6, 1e-5), torch.float64: (1e-12, 1e-12)})


def _lines(message, *labels):
    return [next(line for line in message.splitlines() if line.startswith(f"  {label}:")) for label in labels]


def test_the_previews_show_where_expected_and_got_differ_aligned():
    x = torch.arange(48.0).view(4, 12)
    wrong = x.clone()
    wrong[3, 8] = -7.5  # flat index 44: past the first 40 values

    with pytest.raises(CheckFailed) as caught:
        run_check("f", lambda x: wrong, [Case("a case", (x,), x.clone())], judge=CLOSE)
    expected, got = _lines(str(caught.value), "expected", "got")
    assert "values[36:48]=" in expected and "values[36:48]=" in got
    assert "44" in expected and "-7.5" in got and "-7.5" not in expected
    assert expected.index("  44,") == got.index("-7.5,") and len(expected) == len(got)  # aligned, column by column


@pytest.mark.parametrize(
    "expected, got, shown",
    [
        (list(range(100)), [*range(70), -1, *range(71, 100)], "[67:79]="),
        ("a" * 50 + "b" + "a" * 50, "a" * 101, "[47:83]="),
        (b"\x00" * 80 + b"\x01" * 20, b"\x00" * 100, "[64:100]="),
        ((torch.zeros(3), torch.arange(30)), (torch.zeros(3), torch.arange(30).flip(0)), "item 1: tensor"),
    ],
    ids=["list", "str", "bytes", "tuple of tensors"],
)
def test_previews_of_sequences_of_one_length_show_the_first_difference(expected, got, shown):
    want, have = previews(expected, got)
    assert shown in want and shown in have and want != have
    assert len(want) <= 300 and len(have) <= 300


def test_previews_leave_small_or_unlike_answers_as_short_shows_them():
    assert previews([1, 2], [1, 3]) == (short([1, 2]), short([1, 3]))
    assert previews(torch.zeros(40), torch.zeros(41)) == (short(torch.zeros(40)), short(torch.zeros(41)))
    assert previews(torch.zeros(40), torch.zeros(40)) == (short(torch.zeros(40)), short(torch.zeros(40)))
    assert previews(torch.arange(40), "not a tensor")[1] == short("not a tensor")


def _softmax_wrong_at_5(x):  # a planted bug: wrong only at index 5 of the last dimension
    y = torch.softmax(x, -1)
    return y + (torch.arange(x.shape[-1]) == 5) * 0.5


def _softmax_wrong_at_the_max(x):  # a planted bug: wrong only at each row's largest value
    y = torch.softmax(x, -1)
    return torch.where(x == x.amax(-1, keepdim=True), 1.01 * y, y)


def _random_case(shape, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return Case(f"random {list(shape)}", (x,), later(torch.softmax, x, -1))


@pytest.mark.parametrize(
    "bug, smallest", [(_softmax_wrong_at_5, (1, 1, 6)), (_softmax_wrong_at_the_max, (1, 1, 1))], ids=["index 5", "max"]
)
def test_a_failing_random_case_is_shown_at_its_smallest(bug, smallest):
    with pytest.raises(CheckFailed) as caught:
        run_check("softmax", bug, [_random_case((4, 7, 61))], judge=CLOSE)
    message = str(caught.value)
    assert message.startswith("✗ softmax — random [4, 7, 61] (shrunk from x [4, 7, 61]): the values differ")
    (call,) = _lines(message, "input")
    assert f"shape={smallest}" in call


def test_arguments_of_tied_sizes_shrink_together():
    def attend(q, k):  # a planted bug: the scores of the third key are doubled
        scores = q @ k.transpose(-1, -2)
        return scores * torch.where(torch.arange(k.shape[-2]) == 2, 2.0, 1.0)

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 9, 16, generator=g), torch.randn(3, 11, 16, generator=g)
    case = Case("random q [3, 9, 16], k [3, 11, 16]", (q, k), later(lambda q, k: q @ k.transpose(-1, -2), q, k))
    with pytest.raises(CheckFailed) as caught:
        run_check("scores", attend, [case], judge=CLOSE)
    (call,) = _lines(str(caught.value), "input")
    assert "shape=(1, 1, 1)" in call and "shape=(1, 3, 1)" in call  # batch and features shrunk in both at once
    assert "(shrunk from q [3, 9, 16], k [3, 11, 16])" in str(caught.value)


def test_shrinking_keeps_the_same_failure_and_leaves_other_arguments_alone():
    def top(x, k, mode):  # wrong (k + 1 values) only where k > 2: smaller ks pass, so they stay out of the message
        return x.topk(k + (k > 2), -1).values.sum(-1) if mode == "sum" else None

    x = torch.arange(40.0).view(2, 20)
    case = Case("k = 7", (x, 7, "sum"), later(lambda x, k, mode: x.topk(k, -1).values.sum(-1), x, 7, "sum"))
    with pytest.raises(CheckFailed) as caught:
        run_check("top", top, [case], judge=CLOSE)
    (call,) = _lines(str(caught.value), "input")
    assert call.endswith(", 3, 'sum')") and "shape=(1, 4)" in call


def test_shrinking_is_bounded_quiet_and_can_be_switched_off(capsys):
    def slow_and_wrong(x):  # wrong at the case's size only: no try is smaller, each takes 0.2 CPU-s
        print("debugging", x.shape)  # shown once, for the case itself: not for each try
        start = time.process_time()
        while time.process_time() - start < 0.2:
            pass
        return torch.softmax(x, -1) + (x.shape == (64, 64))

    start = time.process_time()
    with pytest.raises(CheckFailed, match=r"random \[64, 64\]( \(x simplified\))?: the values differ"):
        run_check("softmax", slow_and_wrong, [_random_case((64, 64))], judge=CLOSE, total_seconds=20)
    assert shrinking.SECONDS <= time.process_time() - start < shrinking.SECONDS + 1.0
    assert capsys.readouterr().out.count("debugging") == 1
    with pytest.raises(CheckFailed) as caught:
        run_check("softmax", _softmax_wrong_at_5, [_random_case((4, 61))], judge=CLOSE, shrink=False)
    assert "shrunk" not in str(caught.value) and "shape=(4, 61)" in str(caught.value)
    x = torch.randn(4, 61)  # a fixed expected answer: nothing to recompute, nothing shrunk
    with pytest.raises(CheckFailed) as caught:
        run_check("softmax", _softmax_wrong_at_5, [Case("fixed", (x,), torch.softmax(x, -1))], judge=CLOSE)
    assert "shrunk" not in str(caught.value)


def test_a_case_whose_reference_holds_more_than_its_arguments_is_not_shrunk():
    x = torch.randn(4, 61)
    derived = Case("derived", (x,), later(lambda x, wide: torch.softmax(wide, -1).float(), x, x.double()))
    drawn = Case("drawn", (x,), later(lambda x, g: torch.softmax(x, -1), x, torch.Generator().manual_seed(0)))
    for case in (derived, drawn):  # a shrunk x would meet the unshrunk x.double(), a generator every try advances
        with pytest.raises(CheckFailed) as caught:
            run_check("softmax", _softmax_wrong_at_5, [case], judge=CLOSE)
        assert "shrunk" not in str(caught.value) and "shape=(4, 61)" in str(caught.value)


def test_a_shrunk_tensor_keeps_its_layout_and_the_case_its_own():
    base = torch.randn(6, 8)
    view = base.t()  # not contiguous
    before = view.clone()
    seen = []

    def records(x):
        seen.append(x.is_contiguous())
        x.mul_(0)  # changes its input: every try fails on that, and the case's own tensor stays as it was
        return x

    with pytest.raises(CheckFailed, match="changed its input"):
        run_check("f", records, [Case("a view", (view,), later(lambda x: x.clone(), view))], judge=CLOSE)
    assert seen == [False] and torch.equal(view, before * 0)  # the first call changed it; no try was made
    narrowed = shrinking._narrow(view, 1, 0, 3)
    assert not narrowed.is_contiguous() and narrowed.stride() == view.stride()
    assert narrowed.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()


def _top_k_exactly_k(logits, k):  # drops the tokens tied with the k-th
    idx = torch.topk(logits, min(k, logits.shape[-1])).indices
    return torch.full_like(logits, -math.inf).scatter(-1, idx, logits.gather(-1, idx))


def _top_k_one_more(logits, k):
    kth = torch.topk(logits, min(k + 1, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def _repeat_kv_tiled(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)


def _rms_norm_without_the_cast(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize(
    "check, mistake, named",
    [
        ("sampling.check_top_k", _top_k_exactly_k, "tied with the k-th"),
        ("sampling.check_top_k", _top_k_one_more, "off by one"),
        ("modern.check_repeat_kv", _repeat_kv_tiled, "tiled"),
        ("modern.check_rms_norm", _rms_norm_without_the_cast, "float32"),
    ],
    ids=["top_k ties", "top_k k + 1", "repeat_kv tiled", "rms_norm without the cast"],
)
def test_the_chapters_messages_carry_one_hint_the_diagnosis(check, mistake, named):
    """A case with a hint of its own and a judge that names the mistake used to print both (they said the same)."""
    module, name = check.split(".")
    check = getattr(importlib.import_module(f"llmcourse.checks.{module}"), name)
    with pytest.raises(CheckFailed) as caught:
        check(mistake)
    hints = [line for line in str(caught.value).splitlines() if line.lstrip().startswith("hint:")]
    assert len(hints) == 1 and named in hints[0]
