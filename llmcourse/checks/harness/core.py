"""The machinery every exercise check shares.

A check runs the learner's function on cases (fixed edge cases plus seeded random ones) and
compares each result with the engine's answer. It stops at the first wrong case with a message a
learner can act on — which input, what was expected, what came back, a hint — and on success
prints one line. Learner code may raise, loop forever, return the wrong type, change its input or
call the black box the exercise replaces: each of these becomes a `CheckFailed` with a clear
message, never a crash or a hang.

    >>> def double(x): return 2 * x
    >>> run_check("double", double, [Case("small", (3,), 6)])
    ✓ double — 1 case

What every check gets from `run_check` / `call_learner`, so that a new check only writes its cases
and, if it wants a specific diagnosis, a judge:

- **Answers** are compared by `equal` unless the check gives its own `compare` or `judge`: types
  first, floats with a tolerance, and dicts *in order* (two dicts with the same items in another
  order are not equal here, unlike `==`).
- **Inputs** are snapshotted before each call and compared after it: a function that changes an
  argument fails ("must not change its input"), unless the check allows it with `may_modify`.
- **Black boxes** (`Forbidden`) are caught however they are reached — by name, through an alias
  imported earlier (`from torch import topk`), a subclass, a library's internals: Python functions
  by their code object, C functions by identity or by the class of their `self`, whole packages by
  module name, torch functions by name on every route (torch.X, Tensor.X, torch.ops.aten.X), all
  seen by one profile function (`sys.setprofile`) while the learner's function runs: about 1.1x
  the time on typical exercise code, up to 2x on code made of tiny calls; also a forbidden module
  imported during the call (refused before it loads), a function compiled by TorchScript, and a
  copy of a forbidden function's source. See `NOT_ENFORCEABLE` for what no in-process watch can catch.
- **Time**: each call has a limit (`seconds`), and the whole check a budget (`total_seconds`), both in
  CPU time, so that a verdict does not depend on how busy the machine is; a call's limit may also be scaled
  to the CPU time the engine's own function uses on the same input (`reference`), and a wall-clock
  ceiling far above stops code that waits instead (`limits.wall_ceiling`). The time-out is a
  `BaseException` that `except Exception:` does not catch and that comes back every 50 ms until the
  call returns; limits nest (an inner limit never switches an outer one off).
  What that cannot stop (a loop inside one C call, code that catches the time-out for ever) is ended
  from outside: every exported check runs in a child process (`isolate`).
- **Answers out of reach**: a case's expected answer may be `later(reference, *args)`, computed only
  after the learner's function returned; frame and heap introspection and the checks' own functions
  are refused. Tensors must be plain `torch.Tensor`s, numbers any Python number type.
- **Crashes**: anything the learner's code raises — `SystemExit`, a Rust `PanicException`, an error
  while comparing a strange result — becomes a `CheckFailed`; only `KeyboardInterrupt` (the user
  pressing stop) passes through.
- **Messages** are bounded (`short`) and, in Jupyter, shown without a traceback
  (`CheckFailed._render_traceback_`); they show expected and got around where they differ (`previews`),
  one hint (the judge's diagnosis, else the case's own), and a wrong random case at the smallest
  version of it that still fails (`shrink`).

Each of these lives in a module of its own: `show` (bounded text), `limits` (time limits), `isolate`
(the child process), `forbid` (black boxes), `inputs` (unchanged arguments), `failed` (`CheckFailed`),
`randomness` (the contract of a function that draws random numbers), `shrink` (smaller failing cases).
"""

from __future__ import annotations

import cmath
import dataclasses
import functools
import math
import numbers
import os
import sysconfig
import traceback
from collections.abc import Sized
from typing import Any, Callable, Collection, Iterable, Optional, Sequence, Union

import torch

from llmcourse.course.failed import CheckFailed
from llmcourse.course.limits import SCALE, TimeUp, cpu_seconds, time_limit, time_out_message

from . import isolate
from . import shrink as shrinking
from .forbid import Forbidden, forbidding
from .inputs import _Inputs, change_verdict
from .show import distinct, previews, short
from .tensors import plain_tensor_problem


@dataclasses.dataclass
class Case:
    """One input of a check: `fn(*args)` must give `expected` (as judged by the check's compare).

    `expected` may be `later(reference, *args)`: it is then computed only after the learner's function
    has returned, so that no frame the learner's code can reach holds the answer.
    """

    description: str
    args: tuple
    expected: Any
    hint: str = ""


class Later:
    """An expected answer computed after the learner's call (see `later`)."""

    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"later({getattr(self.fn, '__name__', 'reference')}, ...)"


def later(fn: Callable, *args: Any, **kwargs: Any) -> Later:
    """`fn(*args, **kwargs)`, computed when a check needs it: after the learner's function returned.

    >>> run_check("double", lambda x: 2 * x, [Case("small", (3,), later(lambda x: x + x, 3))])
    ✓ double — 1 case
    """
    return Later(fn, args, kwargs)


def resolved(case: Case) -> Case:
    """The case with its expected answer computed, if it was `later`."""
    if isinstance(case.expected, Later):
        with torch.no_grad():
            return dataclasses.replace(case, expected=case.expected())
    return case


# ----------------------------------------------------------------------------------------------
# Calling the learner's function


def _default_show(name: str) -> Callable[[tuple], str]:
    return lambda args: f"{name}({', '.join(short(a, 120) for a in args)})"


_LIBRARY_DIRS = tuple(
    {
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        *(
            p
            for p in (
                sysconfig.get_paths().get("stdlib"),
                sysconfig.get_paths().get("purelib"),
                sysconfig.get_paths().get("platlib"),
            )
            if p
        ),
    }
)


def _where(err: BaseException) -> str:
    """'at line N in fn: code' for the deepest frame of the learner's own code (else the deepest)."""
    frames = traceback.extract_tb(err.__traceback__)[1:]  # the first is call_learner's
    if not frames:
        return ""
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS) and "<frozen" not in f.filename]
    frame = (own or frames)[-1]
    text = (
        f"\n  at line {frame.lineno} in {frame.name}: {frame.line}"
        if frame.line
        else f"\n  at line {frame.lineno} in {frame.name}"
    )
    if own and frame is not frames[-1]:
        text += f" (inside {frames[-1].name})"
    return text


def call_learner(
    name: str,
    fn: Callable,
    args: tuple,
    *,
    forbid: Sequence[Forbidden] = (),
    seconds: float = 10.0,
    may_modify: Union[bool, Collection[Union[int, str]]] = False,
    timeout_hint: str = "",
    show: Optional[Callable[[tuple], str]] = None,
    inputs: Optional[_Inputs] = None,
    reference: Optional[Callable] = None,
):
    """fn(*args), turning a raise, a hang, a forbidden call or a changed input into a CheckFailed that says so.

    `show(args)` writes the call for messages (default `name(arg, ...)`); `inputs` lets run_check
    snapshot a shared argument once for all cases. The call may use `seconds` of CPU time, or, given the
    engine's `reference` function, `SCALE` times the CPU time `reference(*args)` uses just before (its answer
    is dropped), if that is more: on a loaded machine both take longer on the wall, not in CPU time.
    """
    __tracebackhide__ = True
    call = (show or _default_show(name))(args)
    inputs = inputs or _Inputs(fn, may_modify)
    inputs.remember(args)
    measured = None
    if reference is not None:
        start = cpu_seconds()
        reference(*args)
        measured = (getattr(reference, "__name__", name), cpu_seconds() - start)
    limit = time_limit(max(seconds, SCALE * measured[1]) if measured else seconds)
    watch = forbidding(forbid)
    isolate.call_started(call)
    try:
        with limit:
            with watch:
                result = fn(*args)
    except TimeUp:
        raise  # an enclosing limit's time is up (the check's total budget): it reports that
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # also SystemExit and errors not derived from Exception (a Rust panic)
        if limit.expired:
            raise CheckFailed(
                time_out_message(call, limit, hint=timeout_hint, floor=seconds, reference=measured)
            ) from None
        if watch.violation:
            raise CheckFailed(f"✗ {call}\n  {watch.violation}") from None
        if isinstance(err, NotImplementedError):
            raise CheckFailed(
                f"✗ {name} is not written yet: replace `raise NotImplementedError` with your code"
            ) from None
        if isinstance(err, SystemExit):
            raise CheckFailed(f"✗ {call} called exit() (SystemExit {err.code!r}): return a value instead") from None
        try:
            message = str(err)
        except BaseException:  # an exception whose str() fails
            message = "(its message cannot be shown)"
        message = short(message, 300) if len(message) > 300 else message
        said = f": {message}" if message.strip() else ""
        raise CheckFailed(f"✗ {call} raised {type(err).__name__}{said}{_where(err)}") from None
    finally:
        isolate.call_ended()
    if watch.violation:
        raise CheckFailed(f"✗ {call}\n  {watch.violation}")
    changed = inputs.changed(args)
    if changed:
        index, before = changed
        problem, hint = change_verdict(inputs.name(index), before, args[index])
        raise CheckFailed(f"✗ {call} {problem}\n  hint: {hint}")
    return result


# ----------------------------------------------------------------------------------------------
# Comparing answers


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def equal(got: Any, expected: Any, *, rel_tol: float = 1e-5, abs_tol: float = 1e-6) -> Optional[str]:
    """None when equal; otherwise why not. Types first; floats with a tolerance; dicts in order.

    Any Python number type is a number (numpy.int64 is an int, fractions.Fraction a float); a tensor
    must be a plain torch.Tensor, and containers their exact type (a subclass could answer "equal"
    to anything).

        >>> equal({"a": 1, "b": 2}, {"b": 2, "a": 1})
        "the same entries in a different order: expected the keys ['b', 'a'], got ['a', 'b']"
    """
    if type(got).__name__ in ("bool_", "bool") and type(got).__module__ == "numpy":
        got = bool(got)
    if isinstance(expected, bool) or isinstance(got, bool):
        if type(got) is not type(expected):
            return f"expected {_a(type(expected).__name__)}, got {_a(type(got).__name__)}"
        return None if got is expected else "the values differ"
    if isinstance(expected, numbers.Number) and not isinstance(expected, torch.Tensor):
        kind = numbers.Real if isinstance(expected, numbers.Real) else numbers.Number
        if isinstance(expected, numbers.Integral) and not isinstance(got, numbers.Real):
            kind = numbers.Integral
        if not isinstance(got, kind) or isinstance(got, (torch.Tensor, bool)):
            want = {numbers.Integral: "Python int", numbers.Real: "Python number"}.get(kind, "number")
            extra = " (use .item())" if isinstance(got, torch.Tensor) else ""
            return f"expected {_a(want)}, got {_a(type(got).__name__)}{extra}"
        if isinstance(expected, numbers.Integral) and isinstance(got, numbers.Integral):
            return (
                None if int(got) == int(expected) else f"the numbers differ: expected {int(expected)}, got {int(got)}"
            )
        got, expected = (
            complex(got) if kind is numbers.Number else float(got),
            complex(expected) if kind is numbers.Number else float(expected),
        )
        if kind is numbers.Number:
            return None if cmath.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol) else "the numbers differ"
        if math.isnan(expected) and math.isnan(got):
            return None
        if math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol):
            return None
        want, have = distinct(expected, got)
        return f"the numbers differ: expected {want}, got {have}"
    if isinstance(expected, torch.Tensor):
        problem = plain_tensor_problem(got, expected)
        if problem:
            return problem
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        got = got.detach().as_subclass(torch.Tensor)
        if expected.is_floating_point():
            close = torch.isclose(got, expected, rtol=rel_tol, atol=abs_tol, equal_nan=True).all()
        else:
            close = torch.equal(got, expected)
        return None if bool(close) else "the values differ"
    # a subclass of the expected container is read through the base type's own methods (its overrides could
    # answer anything): a Counter is a dict, a namedtuple a tuple
    base = next((t for t in (dict, list, tuple, str, bytes) if isinstance(expected, t)), None)
    if base is not None and isinstance(got, base) and type(got) is not base:
        got = (
            dict(dict.items(got))
            if base is dict
            else base(base.__iter__(got))
            if base in (list, tuple)
            else base.__str__(got)
            if base is str
            else bytes(memoryview(got))
        )
    if type(got) is not type(expected) and base is not None:
        return f"expected {_a(type(expected).__name__)}, got {_a(type(got).__name__)}"
    if isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            return f"expected {len(expected)} items, got {len(got)}"
        for i, (a, b) in enumerate(zip(got, expected)):
            problem = equal(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
            if problem:
                return f"item {i}: {problem}"
        return None
    if isinstance(expected, dict):
        missing = [k for k in expected if k not in got]
        if missing:
            return f"the key {short(missing[0], 60)} is missing"
        extra = [k for k in got if k not in expected]
        if extra:
            return f"unexpected key {short(extra[0], 60)}"
        for key, value in expected.items():
            problem = equal(got[key], value, rel_tol=rel_tol, abs_tol=abs_tol)
            if problem:
                return f"at key {short(key, 60)}: {problem}"
        if list(got) != list(expected):
            return (
                f"the same entries in a different order: expected the keys {short(list(expected), 120)}, "
                f"got {short(list(got), 120)}"
            )
        return None
    return None if got == expected else "the values differ"


Verdict = Optional[tuple[str, str]]  # None if right, else (what is wrong, a hint; "" = none beyond the case's)


def also_reference(
    judge: Callable[[Case, Any], Verdict],
    reference: Callable[[Case], Optional[tuple[str, torch.Tensor]]],
    accuracy: Callable[[tuple], tuple[Any, torch.Tensor]],
    *,
    slack: float = 1.0,
    hint: str = "",
) -> Callable[[Case, Any], Verdict]:
    """`judge`, then an independent implementation (transformers', say) held to the same contract: `reference(case)`
    gives (its name, its answer), or None where it has nothing to say; `accuracy(case.args)` gives the tolerance
    tensor (its second item) the learner's answer is judged with, times `slack`."""

    def both(case: Case, got: Any) -> Verdict:
        verdict = judge(case, got)
        if verdict is not None:
            return verdict
        theirs = reference(case)
        if theirs is None:
            return None
        name, expected = theirs
        allowed = slack * accuracy(case.args)[1]
        error = (got.double() - expected.double()).abs()
        if bool((error <= allowed).all()):
            return None
        return (
            f"compared with {name}: differs by up to {error.max().item():.3g} (allowed {allowed.max().item():.3g})",
            hint,
        )

    return both


def one_hint(*hints: str) -> str:
    """The one hint a message shows: the first given that is not empty. Give them from the most specific (what the
    judge diagnosed in this answer) to the most general (the case's own); two hints would mostly say one thing twice.

    >>> one_hint("", "off by one: keep k tokens, not k + 1", "keep the k highest")
    'off by one: keep k tokens, not k + 1'
    """
    return next((hint for hint in hints if hint), "")


def failure(
    name: str, description: str, problem: str, call: str, expected: Any, got: Any, hint: Union[str, Sequence[str]]
) -> CheckFailed:
    """The message every check gives for a wrong answer. `hint`: one, or several from the most specific to the most
    general, of which the first not empty is shown (`one_hint`). Expected and got are shown around where they
    differ (`previews`)."""
    hint = one_hint(hint) if isinstance(hint, str) else one_hint(*hint)
    want, have = previews(expected, got)
    return CheckFailed(
        f"✗ {name} — {description}: {problem}\n"
        f"  input:    {call}\n"
        f"  expected: {want}\n"
        f"  got:      {have}" + (f"\n  hint: {hint}" if hint else "")
    )


def run_check(
    name: str,
    fn: Callable,
    cases: Iterable[Case],
    *,
    compare: Callable[[Any, Any], Optional[str]] = equal,
    judge: Optional[Callable[[Case, Any], Verdict]] = None,
    forbid: Sequence[Forbidden] = (),
    error_hints: Optional[dict[str, str]] = None,
    seconds: float = 10.0,
    total_seconds: float = 60.0,
    may_modify: Union[bool, Collection[Union[int, str]]] = False,
    timeout_hint: str = "",
    show_call: Optional[Callable[[tuple], str]] = None,
    success: Optional[str] = None,
    reference: Optional[Callable] = None,
    shrink: bool = True,
) -> None:
    """Run every case; raise CheckFailed at the first wrong one; print '✓ name — N cases'.

    Answers are judged by `compare(got, expected)` -> None or what is wrong, or, when the verdict
    needs the input too, by `judge(case, got)` -> Verdict; a wrong answer's message shows the judge's
    hint, or if it has none the case's own. A case whose expected answer is `later(reference, *args)` and
    whose answer is wrong in its values (right type and shape) is shown at the smallest version of it
    found that still fails the same way (`shrink`; `shrink=False` where the arguments cannot be cut
    meaningfully). `error_hints` adds a hint when the learner's function raises an
    error whose message contains one of its keys. Each call may use `seconds` of CPU time (or, given the
    engine's `reference` function, `SCALE` times what it uses on the same input, if more: see `call_learner`),
    the whole check `total_seconds`. No argument may change unless `may_modify` is True or names it (by position or
    parameter name). `timeout_hint` says what to look for when a call does not finish; `show_call`
    writes a call for messages (default `name(arg, ...)`); `success` replaces the line printed at
    the end. A judge may also raise CheckFailed itself, with a message of its own.
    """
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"✗ {name}: expected a function, got {short(fn)}")
    if judge is None:
        judge = lambda case, got: (problem, "") if (problem := compare(got, case.expected)) else None  # noqa: E731
    show = show_call or _default_show(name)
    inputs = _Inputs(fn, may_modify)
    total = len(cases) if isinstance(cases, Sized) else None
    count = 0
    budget = time_limit(total_seconds)

    def learner(args: tuple, inputs: _Inputs = inputs) -> Any:
        return call_learner(
            name,
            fn,
            args,
            forbid=forbid,
            seconds=seconds,
            timeout_hint=timeout_hint,
            show=show,
            inputs=inputs,
            reference=reference,
        )

    try:
        with budget:
            for case in cases:
                try:
                    got = learner(case.args)
                except CheckFailed as err:
                    hint = next((h for key, h in (error_hints or {}).items() if key in str(err)), "")
                    if hint and "\n  hint: " not in str(err):
                        raise CheckFailed(f"{err}\n  hint: {hint}") from None
                    raise
                pending, case = case, resolved(case)
                try:
                    verdict = judge(case, got)
                except (TimeUp, KeyboardInterrupt, CheckFailed):
                    raise
                except BaseException as err:
                    raise CheckFailed(
                        f"✗ {name} — {case.description}: your answer could not be compared with the "
                        f"expected one ({type(err).__name__}: {str(err)[:200]}): return the type the "
                        f"exercise asks for\n"
                        f"  input:    {show(case.args)}\n"
                        f"  expected: {short(case.expected)}\n"
                        f"  got:      {short(got)}"
                    ) from None
                if verdict:
                    description = case.description
                    if shrink and isinstance(pending.expected, Later) and shrinking.worth_it(got, case.expected):
                        smaller = _shrunk(
                            pending,
                            verdict,
                            judge,
                            lambda args: learner(args, _Inputs(fn, may_modify)),  # fresh snapshots: ids are reused
                            inputs.name,
                            shrinking.allowed(budget.cpu_left()),
                        )
                        if smaller is not None:
                            case, got, verdict, description = smaller
                    problem, hint = verdict
                    raise failure(name, description, problem, show(case.args), case.expected, got, [hint, case.hint])
                count += 1
    except TimeoutError:
        if not budget.expired:
            raise
        of = f" of {total}" if total is not None else ""
        hint = f"\n  hint: {timeout_hint}" if timeout_hint else ""
        if budget.by_wall:
            raise CheckFailed(
                f"✗ {name}: the check stopped after {budget.wall:g} s on the wall, with {count}{of} cases done (each "
                f"was right), having used only {budget.cpu_used:.2g} CPU-s: your function waits rather than computes."
                "\n  hint: look for a time.sleep, input(), a lock or a queue"
            ) from None
        raise CheckFailed(
            f"✗ {name}: the check stopped after {total_seconds:g} CPU-s in total, with {count}{of} cases "
            f"done (each was right): your function is too slow.{hint}"
        ) from None
    print(success or f"✓ {name} — {count} case{'s' if count != 1 else ''}")


def _shared_arguments(args: tuple, theirs: tuple) -> list[tuple[int, int]]:
    """(i, j) where `args[i] is theirs[j]`, for the one shift j - i that pairs the most: the case's arguments and
    its reference's, which may add some before or after (`later(in_float64, softmax, x, dim)` for `(x, dim)`,
    `later(softmax, x, -1)` for `(x,)`, `later(engine_f, *args)` for `("call", *args)`).

    >>> x = [1.0]
    >>> _shared_arguments(("call", x, 3), (x, 3)), _shared_arguments((x,), (max, x, -1))
    ([(1, 0), (2, 1)], [(0, 1)])
    """
    best: list[tuple[int, int]] = []
    for shift in range(-len(args) + 1, len(theirs)):
        pairs = [
            (i, i + shift) for i in range(len(args)) if 0 <= i + shift < len(theirs) and args[i] is theirs[i + shift]
        ]
        if len(pairs) > len(best):
            best = pairs
    return best


def _shrunk(
    case: Case,
    verdict: tuple[str, str],
    judge: Callable[[Case, Any], Verdict],
    learner: Callable[[tuple], Any],
    names: Callable[[int], str],
    seconds: float,
) -> Optional[tuple[Case, Any, tuple[str, str], str]]:
    """(the case, the learner's answer, the verdict, the description) at the smallest version found of `case` (its
    expected answer `later(reference, ...)`) on which the learner's answer is still wrong as `verdict` says (see
    `shrink`), or None if none is smaller. `learner(args)` calls the learner's function as the case did; a try on
    which anything raises (the learner's function, the reference, the judge) is simply not smaller."""
    reference: Later = case.expected
    pairs = _shared_arguments(case.args, reference.args)
    if not shrinking.safe(case.args, reference.args, reference.kwargs, pairs):
        return None

    def attempt(args: tuple) -> Optional[tuple]:
        theirs = list(reference.args)
        for i, j in pairs:
            theirs[j] = args[i]
        smaller = dataclasses.replace(case, args=args, expected=Later(reference.fn, tuple(theirs), reference.kwargs))
        try:
            got = learner(args)
            smaller = resolved(smaller)
            outcome = judge(smaller, got)
        except Exception:  # CheckFailed too; a time-out (TimeUp) is not an Exception: it ends the shrinking
            return None
        return (smaller, got, outcome) if outcome else None

    found = shrinking.shrink(case.args, [i for i, _ in pairs], attempt, verdict, seconds=seconds)
    if found is None:
        return None
    changes = shrinking.summary(case.args, names, found.case.args)
    return found.case, found.got, found.verdict, f"{case.description} ({changes})"


def unwritten_helper(fn: Callable) -> Callable:
    """fn, where a NotImplementedError raised by a function it calls (a stub of another exercise) says which
    one, rather than that fn itself is not written yet."""

    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except NotImplementedError as err:
            frames = traceback.extract_tb(err.__traceback__)  # this wrapper, fn, then whatever fn called
            if len(frames) > 2 and frames[1].name != frames[-1].name:
                problem = RuntimeError(
                    f"it calls {frames[-1].name}, which is not written yet: write that exercise "
                    "first (its check must pass)"
                )
                raise problem.with_traceback(err.__traceback__) from None  # points at the learner's lines
            raise

    return call
