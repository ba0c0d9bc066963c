"""The machinery every check shares (llmcourse/checks/core.py): each safeguard is tested on its own
here, on made-up exercises, so that a later chapter's check gets it without writing a line."""

import functools
import math
import signal
import sys
import time
from collections import Counter
from math import factorial as factorial_imported_early

import pytest
import torch

from llmcourse.checks.core import Case, CheckFailed, call_learner, equal, run_check
from llmcourse.checks.forbid import Forbidden, ForbiddenCall, forbidding
from llmcourse.checks.limits import TimeUp, time_limit
from llmcourse.checks.show import short

# -- order-aware comparison ---------------------------------------------------------------------


def test_dicts_compare_in_order():
    assert equal({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    assert "different order" in equal({"b": 2, "a": 1}, {"a": 1, "b": 2})
    assert "different order" in equal([{"b": 2, "a": 1}], [{"a": 1, "b": 2}])  # nested too
    assert equal(Counter({"a": 2, "b": 1}), {"a": 2, "b": 1}) is None  # a dict subclass in the same order is fine


def test_types_and_numbers():
    assert "expected a list, got a tuple" in equal((1, 2), [1, 2])
    assert "expected a int, got a bool" in equal(True, 1)
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


@pytest.mark.parametrize("value", [
    bytes(97), b"ab" + bytes(5000) + b"cd", "x" * 10**6, "".join(map(chr, range(32, 20000))), list(range(10**5)),
    [[0] * 1000] * 1000, {i: bytes([i % 256]) * 50 for i in range(5000)}, torch.randn(50257), (b"\xff" * 300,),
    {"nested": [{"deep": "y" * 10**4}]},
])
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
    nb.cells = [nbformat.v4.new_code_cell(
        "from llmcourse.checks import check_merge\n"
        "def merge(ids, pair, new_id):\n"
        "    return list(ids)\n"
        "check_merge(merge)")]
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
        (appends, ([1, 2],), r"changed its input `ids`[\s\S]*before the call: \[1, 2\][\s\S]*after the call:  \[1, 2, 0\]"),
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
        run_check("f", lambda x: cached_black_box(x), [Case("a case", (1,), 2)],
                  forbid=[Forbidden(f"{__name__}.cached_black_box")])


def test_a_class_is_caught_in_subclasses_too():
    class Mine(BlackBoxClass):
        pass

    with pytest.raises(CheckFailed, match=r"BlackBoxClass\.run \(that is .*BlackBoxClass\)"):
        run_check("f", lambda x: Mine().run(x), [Case("a case", (1,), 0)],
                  forbid=[Forbidden(f"{__name__}.BlackBoxClass")])


def test_a_c_function_is_caught_through_an_alias_imported_before():
    with pytest.raises(CheckFailed, match=r"called math\.factorial"):
        run_check("f", lambda n: factorial_imported_early(n), [Case("a case", (5,), 120)],
                  forbid=[Forbidden("math.factorial", "Multiply yourself.")])


def test_a_c_method_is_caught():
    with pytest.raises(CheckFailed, match=r"called str\.upper"):
        run_check("f", lambda s: s.upper(), [Case("a case", ("a",), "A")], forbid=[Forbidden("str.upper")])


def test_a_package_is_caught_even_if_imported_during_the_call(tmp_path, monkeypatch):
    package = tmp_path / "made_up_black_box"
    package.mkdir()
    (package / "__init__.py").write_text("def solve(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def uses_it(x):
        import made_up_black_box

        return made_up_black_box.solve(x)

    with pytest.raises(CheckFailed, match=r"called made_up_black_box\.<module> \(part of made_up_black_box\)"):
        run_check("f", uses_it, [Case("a case", (1,), 1)], forbid=[Forbidden("made_up_black_box")])
    monkeypatch.delitem(sys.modules, "made_up_black_box", raising=False)


def test_torch_functions_are_caught_by_name_on_every_route():
    from torch import sort as sort_imported_early

    routes = [lambda x: sort_imported_early(x), lambda x: x.sort(), lambda x: torch.sort(x),
              lambda x: torch.ops.aten.sort(x), lambda x: torch.ops.aten.sort.default(x),
              lambda x: torch.Tensor.sort(x), lambda x: torch._C._VariableFunctions.sort(x)]
    for route in routes:
        with pytest.raises(CheckFailed, match=r"called torch\.(ops\.aten\.|Tensor\.)?sort\b"):
            run_check("f", route, [Case("a case", (torch.tensor([2.0, 1.0]),), None)],
                      forbid=[Forbidden("torch.sort")], judge=lambda case, got: None)
    run_check("f", lambda x: torch.argsort(x), [Case("a case", (torch.tensor([2.0, 1.0]),), None)],
              forbid=[Forbidden("torch.sort")], judge=lambda case, got: None)  # another name: allowed


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

    start = time.monotonic()
    with pytest.raises(CheckFailed, match="did not finish within 0.3 s"):
        run_check("f", swallows, [Case("a case", (1,), 1)], seconds=0.3)
    assert time.monotonic() - start < 2


def test_a_bare_except_only_delays_the_time_out():
    def catches_everything(x):
        for _ in range(5):
            try:
                spin()
            except:  # noqa: E722  (catches the time-out, but it comes back 50 ms later)
                pass
        return x  # returns after its time was up: still a time-out

    with pytest.raises(CheckFailed, match="did not finish within 0.3 s"):
        run_check("f", catches_everything, [Case("a case", (1,), 1)], seconds=0.3)


def test_time_limits_nest():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="after 1 s"):
        with time_limit(1.0):
            for _ in range(20):  # each inner limit ends in time; the outer one still counts
                with time_limit(0.5):
                    time.sleep(0.1)
    assert 0.9 < time.monotonic() - start < 2


def test_an_outer_limit_passes_through_an_inner_one():
    with pytest.raises(TimeoutError, match="after 0.3 s"):
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
                call_learner("f", lambda: time.sleep(0.05), (), seconds=10)


def test_time_limit_leaves_no_timer_behind():
    previous = signal.getsignal(signal.SIGALRM)
    with time_limit(5):
        pass
    with pytest.raises(TimeoutError):
        with time_limit(0.1):
            spin()
    assert signal.getsignal(signal.SIGALRM) is previous
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_check_has_a_total_budget():
    def slow(x):
        time.sleep(0.1)
        return x

    with pytest.raises(CheckFailed, match=r"stopped after 0.5 s in total, with \d of 20 cases done[\s\S]*too slow"):
        run_check("f", slow, [Case(f"#{i}", (i,), i) for i in range(20)], total_seconds=0.5)


# -- crashes ------------------------------------------------------------------------------------


class PanicException(BaseException):
    """Like pyo3's: Rust panics in tiktoken are not Exceptions."""


def test_errors_that_are_not_exceptions_become_messages():
    def panics(x):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    def exits(x):
        sys.exit(1)

    with pytest.raises(CheckFailed, match=r"raised PanicException: called `Result::unwrap\(\)`[\s\S]*line \d+ in panics"):
        run_check("f", panics, [Case("a case", (1,), 1)])
    with pytest.raises(CheckFailed, match=r"called exit\(\)"):
        run_check("f", exits, [Case("a case", (1,), 1)])


def test_a_result_that_cannot_be_compared_becomes_a_message():
    class Weird:
        def __eq__(self, other):
            raise RuntimeError("cannot compare")

        __hash__ = None

    with pytest.raises(CheckFailed, match=r"could not compare your answer[\s\S]*RuntimeError: cannot compare"):
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


def test_the_case_hint_and_the_judge_hint_are_both_shown():
    def judge(case, got):
        return ("wrong", "the judge's diagnosis") if got != case.expected else None

    with pytest.raises(CheckFailed) as caught:
        run_check("f", lambda x: 0, [Case("a case", (1,), 1, hint="the case's own hint")], judge=judge)
    text = str(caught.value)
    assert "hint: the case's own hint\n  hint: the judge's diagnosis" in text


def test_the_time_out_hint_is_the_checks_own():
    with pytest.raises(CheckFailed, match=r"hint: is the loop over the tokens\?") as caught:
        run_check("f", lambda x: spin(), [Case("a case", (1,), 1)], seconds=0.2,
                  timeout_hint="is the loop over the tokens?")
    assert "merge" not in str(caught.value)
