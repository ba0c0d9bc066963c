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
  the time on typical exercise code, up to 2x on code made of tiny calls. See `NOT_ENFORCEABLE`
  for what no in-process watch can catch.
- **Time**: each call has a limit (`seconds`), and the whole check a budget (`total_seconds`).
  The time-out is a `BaseException` that `except Exception:` does not catch and that comes back
  every 50 ms until the call returns; limits nest (an inner limit never switches an outer one off).
- **Crashes**: anything the learner's code raises — `SystemExit`, a Rust `PanicException`, an error
  while comparing a strange result — becomes a `CheckFailed`; only `KeyboardInterrupt` (the user
  pressing stop) passes through.
- **Messages** are bounded (`short`) and, in Jupyter, shown without a traceback
  (`CheckFailed._render_traceback_`).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
import types
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sized
from typing import Any, Callable, Collection, Iterable, Optional, Sequence, Union

import torch

NOT_ENFORCEABLE = [
    "answers computed before the check runs and reused inside the function (a table built in another "
    "cell, a precomputed result, data such as `ranks` or `vocab`)",
    "work done in another thread or process (threading, multiprocessing, concurrent.futures, subprocess)",
    "C code reached from C without passing through Python (the internals of an allowed C function; "
    "ctypes / cffi)",
    "a cached result of another library's function (functools.lru_cache / cache) that was computed "
    "before the check: the cache answers without running code the check can see",
    "a copy of a black box's source code pasted or exec'd as the learner's own",
    "anything not on the exercise's list (other libraries' sorting or selection, e.g. numpy.argpartition, "
    "heapq.nlargest, sorted)",
]


class CheckFailed(AssertionError):
    """A learner's function gave a wrong answer (the message says which and why).

    In Jupyter the message is shown instead of a traceback: the frames would be the check's own
    code, not the learner's. nbgrader's feedback still gets the exception's name and value.
    """

    def _render_traceback_(self) -> list[str]:
        return str(self).splitlines() or [type(self).__name__]


class ForbiddenCall(RuntimeError):
    """The learner's function called the black box its exercise replaces."""


class TimeUp(BaseException):
    """A `time_limit`'s time is up (raised inside its block; the block's end turns it into TimeoutError).

    Not an `Exception`, so that a learner's `try: ... except Exception:` around an endless loop does
    not swallow it.
    """

    def __init__(self, limit: "time_limit"):
        super().__init__(f"still running after {limit.seconds:g} s")
        self.limit = limit


@dataclasses.dataclass
class Case:
    """One input of a check: `fn(*args)` must give `expected` (as judged by the check's compare)."""

    description: str
    args: tuple
    expected: Any
    hint: str = ""


@dataclasses.dataclass(frozen=True)
class Forbidden:
    """A black box the learner's function may not call, however it reaches it; `instead` says what to do.

    `target` is
    - a function or method: 'llmcourse.bpe.merge', 'codecs.getincrementaldecoder', 'torch.topk'
      (a torch function forbids every torch function of that name: torch.topk, Tensor.topk,
      torch.ops.aten.topk, ...);
    - a class: 'llmcourse.tokenizer.StreamDecoder', 'tiktoken._tiktoken.CoreBPE' (constructing it or
      calling any of its methods, in subclasses too);
    - a module or package: 'tiktoken', 'transformers' (any function defined in it, even if it is
      imported only during the call).
    """

    target: str
    instead: str = ""


# ----------------------------------------------------------------------------------------------
# Short, bounded text for messages

_DICT_REPRS = (dict.__repr__, Counter.__repr__, defaultdict.__repr__, OrderedDict.__repr__)
_RUN = 6  # this many equal items in a row or more are shown as a repetition


def short(value: Any, limit: int = 300) -> str:
    """A readable repr of at most `limit` characters, for messages.

    Long strings, bytes and lists keep their start and end; runs of one character or item are
    written as a repetition; tensors show shape, dtype and their first values.

        >>> short(b"ab" + bytes(97))
        "b'ab' + b'\\\\x00' * 97"
        >>> short(list(range(1000)), 60)
        '[0, 1, 2, 3, ... (+992 more) ..., 996, 997, 998, 999]'
    """
    try:
        text = _short(value, max(limit, 20))
    except Exception:  # a learner's object whose repr fails
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: max(limit - 4, 1)] + " ..."


def _short(value: Any, budget: int) -> str:
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        n = flat.numel()
        shown = flat[: min(n, 64)].tolist()
        if value.is_floating_point():
            shown = [_Float(v) for v in shown]
        values = _short_items(shown, budget // 2, "[", "]", total=n) if value.dim() else repr(value.item())
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, values={values})"
    if isinstance(value, (str, bytes, bytearray)):
        return _short_text(bytes(value) if isinstance(value, bytearray) else value, budget)
    if type(value) in (list, tuple):
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        if isinstance(value, tuple) and len(value) == 1:
            return f"({_short(value[0], budget - 3)},)"
        return _short_items(value, budget, open_, close)
    if type(value) in (set, frozenset):
        return _short_items(list(value), budget, "{", "}") if value else repr(value)
    if isinstance(value, dict) and type(value).__repr__ in _DICT_REPRS:  # not a dict with a repr of its own
        return _short_dict(value, budget)
    text = repr(value)
    return text if len(text) <= budget else text[: budget - 4] + " ..."


class _Float(float):
    def __repr__(self) -> str:
        return f"{float(self):.6g}"


def _short_text(value: Union[str, bytes], budget: int) -> str:
    if len(value) > 20_000:  # only the ends can be shown: don't look at the middle
        keep = max((budget - 30) // 2, 8)
        head, tail = value[: 2 * keep], value[-2 * keep :]
        hidden = len(value) - len(head) - len(tail)
        return _fit([_runs_text(head)], [_runs_text(tail)], hidden, budget, " + ", "", "")
    text = _runs_text(value)
    if len(text) <= budget:
        return text
    keep = max((budget - 30) // 2, 8)
    hidden = len(value) - 2 * keep
    return _fit([_runs_text(value[:keep])], [_runs_text(value[-keep:])], hidden, budget, " + ", "", "")


def _runs_text(value: Union[str, bytes]) -> str:
    """repr(value), with runs of one character written as 'x' * n."""
    runs = []  # (piece, count)
    i = 0
    while i < len(value):
        j = i
        while j < len(value) and value[j] == value[i]:
            j += 1
        if j - i >= _RUN:
            runs.append((value[i : i + 1], j - i))
        elif runs and runs[-1][1] == 1:
            runs[-1] = (runs[-1][0] + value[i:j], 1)
        else:
            runs.append((value[i:j], 1))
        i = j
    pieces = [repr(piece) if count == 1 else f"{piece!r} * {count}" for piece, count in runs]
    return " + ".join(pieces) if pieces else repr(value)


def _item_parts(items: Sequence, each: int) -> list[str]:
    groups: list[list] = []  # [item, count]
    for item in items:
        try:
            same = bool(groups) and type(groups[-1][0]) is type(item) and bool(groups[-1][0] == item)
        except Exception:
            same = False
        if same:
            groups[-1][1] += 1
        else:
            groups.append([item, 1])
    parts = []
    for item, count in groups:
        text = _short(item, each)
        parts.extend([f"*[{text}] * {count}"] if count >= _RUN else [text] * count)
    return parts


def _fit(head: list[str], tail: list[str], hidden: int, budget: int, sep: str, open_: str, close: str) -> str:
    """open_ + as many of head's first and tail's last parts as fit + '... (+n more) ...' + close."""
    if not hidden and len(open_ + sep.join(head + tail) + close) <= budget:
        return open_ + sep.join(head + tail) + close
    shown_head, shown_tail, used = [], [], len(open_) + len(close) + 24
    parts = len(head) + len(tail)
    for k in range(parts):  # alternate from both ends while they fit
        take_head = (k % 2 == 0 and len(shown_head) < len(head)) or len(shown_tail) >= len(tail)
        part = head[len(shown_head)] if take_head else tail[len(tail) - 1 - len(shown_tail)]
        if used + len(part) + len(sep) > budget and (shown_head or shown_tail):
            break
        (shown_head if take_head else shown_tail).append(part)
        used += len(part) + len(sep)
    more = hidden + parts - len(shown_head) - len(shown_tail)
    middle = [f"... (+{more} more) ..."] if more else []
    return open_ + sep.join([*shown_head, *middle, *reversed(shown_tail)]) + close


def _short_items(items: Sequence, budget: int, open_: str, close: str, total: Optional[int] = None) -> str:
    total = len(items) if total is None else total
    each = max(budget // max(min(len(items), 10), 1) - 2, 24)
    if len(items) > 200:  # only the ends can be shown: don't look at the middle
        head, tail = _item_parts(items[:100], each), _item_parts(items[-100:], each)
        return _fit(head, tail, total - 200, budget, ", ", open_, close)
    parts = _item_parts(items, each)
    if total > len(items):
        return _fit(parts, [], total - len(items), budget, ", ", open_, close)
    return _fit(parts, [], 0, budget, ", ", open_, close)


def _short_dict(value: dict, budget: int) -> str:
    parts, used = [], 2
    for k, (key, item) in enumerate(value.items()):
        part = f"{_short(key, 40)}: {_short(item, 60)}"
        if used + len(part) + 2 > budget - 20 and k < len(value) - 1:
            parts.append(f"... (+{len(value) - k} more)")
            break
        parts.append(part)
        used += len(part) + 2
    inner = "{" + ", ".join(parts) + "}"
    return inner if type(value) is dict else f"{type(value).__name__}({inner})"


# ----------------------------------------------------------------------------------------------
# Time limits: nestable, hard to swallow

REPEAT = 0.05  # once a limit is up, the time-out is raised again this often until the block ends
_limits: list["time_limit"] = []  # the active limits, outermost first
_saved: dict = {}  # the SIGALRM handler and interval timer found when the outermost limit started
_critical = 0  # > 0 while this module restores state: a due time-out waits for the next tick
_NAG_AFTER = 5.0  # seconds past the limit before telling the learner that their code ignores it


def _timers_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _arm(now: float) -> None:
    earliest = min(limit.deadline for limit in _limits)
    signal.setitimer(signal.ITIMER_REAL, max(earliest - now, 1e-4), REPEAT)


def _on_alarm(signum, frame) -> None:
    if _critical or not _limits:
        return
    now = time.monotonic()
    due = [limit for limit in _limits if limit.deadline <= now]
    if not due:
        _arm(now)
        return
    for limit in due:
        limit.expired = True
    if frame is not None and frame.f_code in _DEFER:
        return  # this module is restoring state: the repeating timer comes back in REPEAT seconds
    first = due[0]
    if not first.nagged and now - first.deadline > _NAG_AFTER:
        first.nagged = True
        print(f"\nYour code has been stopped {int(now - first.deadline)} s ago (a time limit of {first.seconds:g} s) "
              "and keeps running: it catches the time-out (a bare `except:` or `except BaseException:`). "
              "Catch `Exception` instead; to get out now, interrupt or restart the kernel.", file=sys.stderr)
    raise TimeUp(first)


class time_limit:
    """`with time_limit(seconds):` raises TimeoutError if the block runs longer than `seconds`.

    Inside the block the time-out is a `TimeUp` (a BaseException), raised again every 50 ms until
    the block ends, so that learner code catching exceptions cannot keep it running; when the block
    ends after its time is up — even if the code swallowed the time-out and returned — the `with`
    raises TimeoutError. Limits nest: the inner one never extends or switches off the outer one,
    and a `TimeUp` of an outer limit passes through inner blocks untouched. Main thread on Unix
    only (elsewhere there is no limit).

        >>> with time_limit(1):
        ...     sum(range(10))
        45
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self.nagged = False
        self.active = False
        self.deadline = math.inf

    def __enter__(self) -> "time_limit":
        if not _timers_usable() or not (self.seconds > 0 and math.isfinite(self.seconds)):
            return self
        global _critical
        _critical += 1
        try:
            now = time.monotonic()
            self.deadline = now + self.seconds
            if not _limits:
                handler = signal.signal(signal.SIGALRM, _on_alarm)
                delay, interval = signal.setitimer(signal.ITIMER_REAL, 0)
                _saved.update(handler=handler, until=now + delay if delay else None, interval=interval)
            _limits.append(self)
            self.active = True
            _arm(now)
        finally:
            _critical -= 1
        return self

    def __exit__(self, kind, err, tb) -> bool:
        global _critical
        _critical += 1
        try:
            if self.active:
                self.active = False
                _limits.remove(self)
                now = time.monotonic()
                if _limits:
                    _arm(now)
                else:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, _saved.get("handler") or signal.SIG_DFL)
                    if _saved.get("until") is not None:  # someone else's timer was running: give it back
                        signal.setitimer(signal.ITIMER_REAL, max(_saved["until"] - now, 1e-3), _saved["interval"])
        finally:
            _critical -= 1
        if isinstance(err, TimeUp) and err.limit is not self:
            return False  # an outer limit's time is up: it handles that
        if isinstance(err, (KeyboardInterrupt, CheckFailed)):
            return False
        if self.expired:
            raise TimeoutError(f"still running after {self.seconds:g} s") from None
        return False


# ----------------------------------------------------------------------------------------------
# Forbidden black boxes


@dataclasses.dataclass
class _Rules:
    """Forbidden targets compiled into what the watch compares, fast."""

    codes: dict = dataclasses.field(default_factory=dict)  # id(code object) -> rule
    builtins: dict = dataclasses.field(default_factory=dict)  # id(C function) -> rule
    classes: dict = dataclasses.field(default_factory=dict)  # class -> rule (C methods on its instances)
    methods: dict = dataclasses.field(default_factory=dict)  # C method name -> [(class, rule)]
    modules: dict = dataclasses.field(default_factory=dict)  # module prefix -> rule
    torch_names: dict = dataclasses.field(default_factory=dict)  # torch function name -> rule
    caches: list = dataclasses.field(default_factory=list)  # lru_cache wrappers to clear at the start
    keep: list = dataclasses.field(default_factory=list)  # keeps the objects whose ids are used alive


def _resolve(target: str) -> tuple[Any, str]:
    """'torch.Tensor.topk' -> (torch.Tensor, 'topk'); the object that owns the attribute."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    if hasattr(builtins, parts[0]):  # 'str.upper', 'bytes.decode'
        owner = getattr(builtins, parts[0])
        for name in parts[1:-1]:
            owner = getattr(owner, name)
        return (owner, parts[-1]) if len(parts) > 1 else (builtins, parts[0])
    raise ValueError(f"cannot resolve {target!r}")


def _is_module(target: str) -> bool:
    if target in sys.modules:
        return isinstance(sys.modules[target], types.ModuleType)
    try:
        return importlib.util.find_spec(target) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _add_function(rules: _Rules, fn: Any, rule: Forbidden) -> None:
    seen = 0
    while fn is not None and seen < 10:
        seen += 1
        if isinstance(fn, functools._lru_cache_wrapper):
            rules.caches.append(fn)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, property):
            for part in (fn.fget, fn.fset, fn.fdel):
                _add_function(rules, part, rule)
            return
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            rules.codes[id(code)] = rule
            rules.keep.append(code)
        elif isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            rules.builtins[id(fn)] = rule
            rules.keep.append(fn)
        elif isinstance(fn, (types.MethodDescriptorType, types.ClassMethodDescriptorType)):
            rules.methods.setdefault(fn.__name__, []).append((fn.__objclass__, rule))
        fn = getattr(fn, "__wrapped__", None)


def _add_class(rules: _Rules, cls: type, rule: Forbidden) -> None:
    rules.classes[cls] = rule
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins" and klass is not cls:
            continue
        for value in vars(klass).values():
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                _add_function(rules, value, rule)


def _compile(forbid: Sequence[Forbidden]) -> _Rules:
    rules = _Rules()
    for rule in forbid:
        target = rule.target
        if target.startswith("torch.") and not _is_module(target):
            rules.torch_names[target.rsplit(".", 1)[1]] = rule  # every route: torch.X, Tensor.X, torch.ops.aten.X
            continue
        if _is_module(target):
            rules.modules[target] = rule
            for name, module in list(sys.modules.items()):
                if module is None or not (name == target or name.startswith(target + ".")):
                    continue
                native = str(getattr(module, "__file__", "") or "").endswith((".so", ".pyd"))
                for value in list(vars(module).values()):
                    home = getattr(value, "__module__", None)
                    # defined in the package, or (an extension module's classes may say 'builtins') by this
                    # extension module itself -- not a type a Python module imported (types.ModuleType, ...)
                    ours = (home or "").startswith(target + ".") or home == target or \
                        (native and home in ("builtins", None) and getattr(builtins, getattr(value, "__name__", ""),
                                                                          None) is not value
                         and not any(value is v for v in vars(types).values()))
                    if not ours:
                        continue
                    if isinstance(value, type):
                        # its instances' C methods, and its static C functions (tiktoken's CoreBPE, the
                        # Rust classes of `tokenizers`, which may not say where they live)
                        rules.classes[value] = rule
                        for member in list(vars(value).values()):
                            if isinstance(member, staticmethod) and isinstance(member.__func__, types.BuiltinFunctionType):
                                rules.builtins[id(member.__func__)] = rule
                                rules.keep.append(member.__func__)
                    elif isinstance(value, types.BuiltinFunctionType):
                        rules.builtins[id(value)] = rule
                        rules.keep.append(value)
            continue
        try:
            owner, name = _resolve(target)
            obj = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
        except (ValueError, AttributeError, ImportError):
            continue  # not installed: nothing to call
        if isinstance(obj, type):
            _add_class(rules, obj, rule)
        else:
            _add_function(rules, obj, rule)
            if isinstance(owner, type) and not isinstance(obj, (staticmethod, classmethod)):
                _add_function(rules, getattr(owner, name), rule)
    return rules


_compiled: dict[tuple, tuple[int, _Rules]] = {}  # rules -> (len(sys.modules) then, compiled)


def _rules_for(forbid: Sequence[Forbidden]) -> _Rules:
    key, modules = tuple(forbid), len(sys.modules)  # a newly imported package brings new classes to look at
    cached = _compiled.get(key)
    if cached is None or cached[0] != modules:
        cached = _compiled[key] = (modules, _compile(forbid))
    return cached[1]


def _message(rule: Forbidden, reached: str) -> str:
    via = "" if reached == rule.target else f" ({'part of ' if _is_module(rule.target) else 'that is '}{rule.target})"
    return (f"your function called {reached}{via}, the black box this exercise asks you to write yourself. "
            f"{rule.instead}").rstrip()


_MISSING = object()


def _torch_op_calls() -> set[int]:
    """Ids of the code objects that run `torch.ops.aten.X(...)` and `torch.ops.aten.X.default(...)`."""
    ids = set()
    for cls in (torch._ops.OpOverload, torch._ops.OpOverloadPacket):
        code = getattr(getattr(cls, "__call__", None), "__code__", None)
        if code is not None:
            ids.add(id(code))
    return ids


_OP_CALLS = _torch_op_calls()


class forbidding:
    """`with forbidding(rules):` — calls to the forbidden black boxes raise ForbiddenCall.

    A profile function (`sys.setprofile`) sees every Python frame that starts and every C function
    called from Python, so it catches a black box however the learner reached it. Whatever the
    learner does with the error, `violation` keeps the first one's message, so a check fails even
    when the learner's code caught it. If another profiler is running (e.g. `%prun`), it is left
    alone and nothing is watched.
    """

    def __init__(self, forbid: Sequence[Forbidden]):
        rules = _rules_for(forbid) if forbid else _Rules()
        self.rules = rules
        self.codes, self.builtins = rules.codes, rules.builtins
        self.names = {**{name: None for name in rules.methods}, **{name: None for name in rules.torch_names}}
        self.by_module = bool(rules.modules)
        self.module_rules: dict = {}  # module name -> rule or None, filled as modules are seen
        self.type_rules: dict = {}  # class -> rule or None, filled as classes are seen
        self.violation: Optional[str] = None
        self.profiling = False

    def refuse(self, rule: Forbidden, reached: str):
        message = _message(rule, reached)
        if self.violation is None:
            self.violation = message
        raise ForbiddenCall(message)

    def _module_rule(self, module: Optional[str]) -> Optional[Forbidden]:
        rule = self.module_rules.get(module, _MISSING)
        if rule is _MISSING:
            rule = None
            if module:
                for prefix, candidate in self.rules.modules.items():
                    if module == prefix or module.startswith(prefix + "."):
                        rule = candidate
                        break
            self.module_rules[module] = rule
        return rule

    def _type_rule(self, cls: type) -> Optional[Forbidden]:
        rule = self.type_rules.get(cls, _MISSING)
        if rule is _MISSING:
            classes = self.rules.classes
            rule = next((classes[k] for k in getattr(cls, "__mro__", (cls,)) if k in classes), None)
            self.type_rules[cls] = rule
        return rule

    def _named(self, arg: Any, name: str, owner: Any) -> Optional[tuple[Forbidden, str]]:
        """A C function or method whose name is forbidden: torch's X (torch.X, Tensor.X), or a C method."""
        rules = self.rules
        for cls, rule in rules.methods.get(name, ()):
            if isinstance(owner, cls):
                return rule, f"{type(owner).__name__}.{name}"
        rule = rules.torch_names.get(name)
        if rule is not None:
            if isinstance(owner, torch.Tensor):
                return rule, f"torch.Tensor.{name}"
            module = getattr(arg, "__module__", None) or ""
            objclass = getattr(arg, "__objclass__", None)
            if module.startswith("torch") or (isinstance(owner, type) and owner.__module__.startswith("torch")) or \
                    (objclass is not None and objclass.__module__.startswith("torch")):
                return rule, f"torch.{name}"
        return None

    def _profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            key = id(code)
            rule = self.codes.get(key)
            if rule is not None:
                self.refuse(rule, f"{frame.f_globals.get('__name__') or '?'}.{code.co_qualname}")
            if key in _OP_CALLS and self.rules.torch_names:  # torch.ops.aten.X(...)
                op = str(frame.f_locals.get("self", ""))  # 'aten.topk' or 'aten.topk.default'
                parts = op.split(".")
                if len(parts) > 1 and parts[1] in self.rules.torch_names:
                    self.refuse(self.rules.torch_names[parts[1]], f"torch.ops.{parts[0]}.{parts[1]}")
            if self.by_module:
                module = frame.f_globals.get("__name__")
                rule = self._module_rule(module)
                if rule is not None:
                    self.refuse(rule, f"{module}.{code.co_qualname}")
        elif event == "c_call":
            rule = self.builtins.get(id(arg))
            if rule is not None:
                self.refuse(rule, _c_name(arg))
            owner = getattr(arg, "__self__", None)
            name = getattr(arg, "__name__", None)
            if name in self.names:
                found = self._named(arg, name, owner)
                if found is not None:
                    self.refuse(*found)
            if self.rules.classes and owner is not None:
                rule = self._type_rule(owner if isinstance(owner, type) else type(owner))
                if rule is not None:
                    self.refuse(rule, _c_name(arg))
            if self.by_module:
                rule = self._module_rule(getattr(arg, "__module__", None))
                if rule is not None:
                    self.refuse(rule, _c_name(arg))

    def __enter__(self) -> "forbidding":
        rules = self.rules
        for cache in rules.caches:
            cache.cache_clear()  # a cached answer would come back without running code the watch sees
        if rules.codes or rules.builtins or rules.classes or rules.methods or rules.modules or rules.torch_names:
            if sys.getprofile() is None:  # another profiler (e.g. %prun) is running: leave it alone
                sys.setprofile(self._profile)
                self.profiling = True
        return self

    def __exit__(self, kind, err, tb) -> bool:
        global _critical
        _critical += 1
        try:
            if self.profiling:
                sys.setprofile(None)
                self.profiling = False
        finally:
            _critical -= 1
        return False


def _c_name(arg: Any) -> str:
    owner = getattr(arg, "__self__", None)
    if isinstance(owner, types.ModuleType):
        where = owner.__name__.lstrip("_")  # _codecs.utf_8_decode is codecs.utf_8_decode
    elif isinstance(owner, type):
        where = owner.__name__
    elif owner is not None:
        where = type(owner).__name__
    else:
        qualname = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")
        return f"{getattr(arg, '__module__', None)}.{qualname}" if getattr(arg, "__module__", None) else qualname
    return f"{where}.{getattr(arg, '__name__', '?')}"


# Code that restores state: a time-out that falls due while it runs waits for the next tick.
_DEFER = {f.__code__ for f in (time_limit.__enter__, time_limit.__exit__, forbidding.__enter__, forbidding.__exit__,
                               _arm, _on_alarm)}


# ----------------------------------------------------------------------------------------------
# Inputs must not change


_ATOMS = (str, bytes, int, float, complex, bool, type(None), range)


def _snapshot(value: Any) -> Any:
    """A deep copy to compare with after the call; _UNKNOWN if the value cannot be copied."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        if all(isinstance(v, _ATOMS) for v in value.values()):
            return _Flat(list(value.items()))
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return list(value) if all(isinstance(v, _ATOMS) for v in value) else [_snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return set(value)
    if isinstance(value, bytearray):
        return bytes(value)
    try:
        return copy.deepcopy(value)
    except Exception:
        return _UNKNOWN


class _Flat:
    """A dict whose values are all immutable, as its list of items (compared at C speed)."""

    def __init__(self, items: list):
        self.items = items


_UNKNOWN = object()


def _unchanged(value: Any, snap: Any) -> bool:
    if snap is _UNKNOWN:
        return True
    if isinstance(snap, _Flat):
        return isinstance(value, dict) and len(value) == len(snap.items) and list(value.items()) == snap.items
    if isinstance(snap, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != snap.shape or value.dtype != snap.dtype:
            return False
        if torch.equal(value.detach(), snap):
            return True
        same = value.detach() == snap
        if value.is_floating_point() or value.is_complex():
            same |= value.detach().isnan() & snap.isnan()
        return bool(same.all())
    if isinstance(snap, dict):
        return (isinstance(value, dict) and list(value) == list(snap)
                and all(_unchanged(value[k], v) for k, v in snap.items()))
    if isinstance(snap, list) and isinstance(value, list):
        return len(value) == len(snap) and all(a is b or _unchanged(a, b) for a, b in zip(value, snap))
    if isinstance(snap, tuple):
        return isinstance(value, tuple) and len(value) == len(snap) and all(map(_unchanged, value, snap))
    if isinstance(snap, float) and isinstance(value, float) and math.isnan(snap):
        return math.isnan(value)
    if isinstance(value, bytearray):
        return bytes(value) == snap
    try:
        return bool(value == snap)
    except Exception:
        return True  # cannot tell


class _Inputs:
    """Snapshots of a check's arguments (each distinct object once), compared after every call."""

    def __init__(self, fn: Callable, may_modify: Union[bool, Collection[Union[int, str]]] = False):
        self.may_modify = may_modify
        try:
            self.names = [p.name for p in inspect.signature(fn).parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self.names = []
        self.snapshots: dict[int, tuple[Any, Any]] = {}

    def name(self, index: int) -> str:
        return self.names[index] if index < len(self.names) else f"argument #{index + 1}"

    def watched(self, index: int) -> bool:
        if self.may_modify is True:
            return False
        return not (self.may_modify and (index in self.may_modify or self.name(index) in self.may_modify))

    def remember(self, args: tuple) -> None:
        for index, value in enumerate(args):
            if self.watched(index) and not isinstance(value, _ATOMS) and id(value) not in self.snapshots:
                self.snapshots[id(value)] = (value, _snapshot(value))

    def changed(self, args: tuple) -> Optional[tuple[int, Any]]:
        """(index, value before) of the first argument the call changed, or None."""
        for index, value in enumerate(args):
            if id(value) in self.snapshots and self.watched(index):
                before = self.snapshots[id(value)][1]
                if not _unchanged(value, before):
                    return index, (dict(before.items) if isinstance(before, _Flat) else before)
        return None


def _modify_hint(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return ("an in-place operation (x -= m, x /= s, x.sub_(m), x[i] = v, x.sort_()) changes the caller's "
                "tensor: write x = x - m, or work on x.clone()")
    if isinstance(value, dict):
        return "don't add, remove or change its entries (d[k] = v, d.pop(k), del d[k]): copy it first, dict(d)"
    if isinstance(value, list):
        return ("don't change it in place (ids[i] = ..., ids.pop(i), del ids[i], ids[i:j] = ..., ids.sort()): "
                "build a new list (out = []), or work on a copy, list(ids)")
    return "work on a copy (copy.deepcopy) or build a new value"


# ----------------------------------------------------------------------------------------------
# Calling the learner's function


def _default_show(name: str) -> Callable[[tuple], str]:
    return lambda args: f"{name}({', '.join(short(a, 120) for a in args)})"


_LIBRARY_DIRS = tuple({os.path.dirname(os.path.dirname(__file__)), *(
    p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"),
                sysconfig.get_paths().get("platlib")) if p)})


def _where(err: BaseException) -> str:
    """'at line N in fn: code' for the deepest frame of the learner's own code (else the deepest)."""
    frames = traceback.extract_tb(err.__traceback__)[1:]  # the first is call_learner's
    if not frames:
        return ""
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS) and "<frozen" not in f.filename]
    frame = (own or frames)[-1]
    text = f"\n  at line {frame.lineno} in {frame.name}: {frame.line}" if frame.line else \
        f"\n  at line {frame.lineno} in {frame.name}"
    if own and frame is not frames[-1]:
        text += f" (inside {frames[-1].name})"
    return text


def call_learner(name: str, fn: Callable, args: tuple, *, forbid: Sequence[Forbidden] = (), seconds: float = 10.0,
                 may_modify: Union[bool, Collection[Union[int, str]]] = False, timeout_hint: str = "",
                 show: Optional[Callable[[tuple], str]] = None, inputs: Optional[_Inputs] = None):
    """fn(*args), turning a raise, a hang, a forbidden call or a changed input into a CheckFailed that says so.

    `show(args)` writes the call for messages (default `name(arg, ...)`); `inputs` lets run_check
    snapshot a shared argument once for all cases.
    """
    __tracebackhide__ = True
    call = (show or _default_show(name))(args)
    inputs = inputs or _Inputs(fn, may_modify)
    inputs.remember(args)
    limit = time_limit(seconds)
    watch = forbidding(forbid)
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
            hint = timeout_hint or "look for a loop that never ends (a condition that never changes, an index " \
                                   "that never moves on)"
            raise CheckFailed(f"✗ {call} did not finish within {seconds:g} s.\n  hint: {hint}") from None
        if watch.violation:
            raise CheckFailed(f"✗ {call}\n  {watch.violation}") from None
        if isinstance(err, NotImplementedError):
            raise CheckFailed(f"✗ {name} is not written yet: replace `raise NotImplementedError` with your code") from None
        if isinstance(err, SystemExit):
            raise CheckFailed(f"✗ {call} called exit() (SystemExit {err.code!r}): return a value instead") from None
        try:
            message = str(err)
        except BaseException:  # an exception whose str() fails
            message = "(its message cannot be shown)"
        message = short(message, 300) if len(message) > 300 else message
        raise CheckFailed(f"✗ {call} raised {type(err).__name__}: {message}{_where(err)}") from None
    if watch.violation:
        raise CheckFailed(f"✗ {call}\n  {watch.violation}")
    changed = inputs.changed(args)
    if changed:
        index, before = changed
        value = args[index]
        name = inputs.name(index)
        raise CheckFailed(f"✗ {call} changed its input `{name}`: your function must not change "
                          f"its arguments (the caller still needs them).\n"
                          f"{_describe_change(name, before, value)}\n"
                          f"  hint: {_modify_hint(value)}")
    return result


def _describe_change(name: str, before: Any, after: Any) -> str:
    """Two lines: what the argument was and what it became (for a dict, the first entry that changed)."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key, value in before.items():
            if key not in after:
                return f"  before the call: {name}[{short(key, 60)}] was {short(value, 80)}\n  after the call:  it is gone"
            if not _unchanged(after[key], _snapshot(value)):
                return (f"  before the call: {name}[{short(key, 60)}] was {short(value, 80)}\n"
                        f"  after the call:  {name}[{short(key, 60)}] is {short(after[key], 80)}")
        added = next((key for key in after if key not in before), _MISSING)
        if added is not _MISSING:
            return (f"  before the call: {name} had no key {short(added, 60)}\n"
                    f"  after the call:  {name}[{short(added, 60)}] is {short(after[added], 80)}")
        return (f"  before the call: the keys in the order {short(list(before), 120)}\n"
                f"  after the call:  the keys in the order {short(list(after), 120)}")
    return f"  before the call: {short(before)}\n  after the call:  {short(after)}"


# ----------------------------------------------------------------------------------------------
# Comparing answers


def equal(got: Any, expected: Any, *, rel_tol: float = 1e-5, abs_tol: float = 1e-6) -> Optional[str]:
    """None when equal; otherwise why not. Types first; floats with a tolerance; dicts in order.

        >>> equal({"a": 1, "b": 2}, {"b": 2, "a": 1})
        "the same entries in a different order: expected the keys ['b', 'a'], got ['a', 'b']"
    """
    if isinstance(expected, bool) or isinstance(got, bool):
        if type(got) is not type(expected):
            return f"expected a {type(expected).__name__}, got a {type(got).__name__}"
    numbers = (int, float)
    if type(got) is not type(expected) and not (isinstance(got, numbers) and isinstance(expected, numbers)) \
            and not isinstance(got, type(expected)):
        return f"expected a {type(expected).__name__}, got a {type(got).__name__}"
    if isinstance(expected, float) or isinstance(got, float):
        if math.isnan(expected) and math.isnan(got):
            return None
        return None if math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol) else "the numbers differ"
    if isinstance(expected, torch.Tensor):
        if got.shape != expected.shape:
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if expected.is_floating_point():
            close = torch.isclose(got, expected, rtol=rel_tol, atol=abs_tol, equal_nan=True).all()
        else:
            close = torch.equal(got, expected)
        return None if bool(close) else "the values differ"
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
            return (f"the same entries in a different order: expected the keys {short(list(expected), 120)}, "
                    f"got {short(list(got), 120)}")
        return None
    return None if got == expected else "the values differ"


Verdict = Optional[tuple[str, str]]  # None if right, else (what is wrong, a hint; "" = none beyond the case's)


def _hints(*hints: str) -> list[str]:
    """The hints to show, in order, without repeats (one that another contains, or that says the same
    thing before its first colon, gives way to the longer one)."""
    def same(a: str, b: str) -> bool:
        head_a, head_b = a.split(":")[0].strip().lower(), b.split(":")[0].strip().lower()
        return a in b or b in a or (head_a == head_b and len(head_a) > 10 and ":" in a and ":" in b)

    out: list[str] = []
    for hint in hints:
        if not hint:
            continue
        twin = next((i for i, other in enumerate(out) if same(hint, other)), None)
        if twin is None:
            out.append(hint)
        elif len(hint) > len(out[twin]):
            out[twin] = hint
    return out


def failure(name: str, description: str, problem: str, call: str, expected: Any, got: Any,
            hint: Union[str, Sequence[str]]) -> CheckFailed:
    """The message every check gives for a wrong answer (each hint on its own line)."""
    hints = _hints(hint) if isinstance(hint, str) else _hints(*hint)
    lines = "".join(f"\n  hint: {h}" for h in hints)
    return CheckFailed(f"✗ {name} — {description}: {problem}\n"
                       f"  input:    {call}\n"
                       f"  expected: {short(expected)}\n"
                       f"  got:      {short(got)}{lines}")


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
) -> None:
    """Run every case; raise CheckFailed at the first wrong one; print '✓ name — N cases'.

    Answers are judged by `compare(got, expected)` -> None or what is wrong, or, when the verdict
    needs the input too, by `judge(case, got)` -> Verdict; a wrong answer's message shows the
    case's own hint and the judge's. `error_hints` adds a hint when the learner's function raises an
    error whose message contains one of its keys. Each call may take `seconds`, the whole check
    `total_seconds`. No argument may change unless `may_modify` is True or names it (by position or
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
    try:
        with budget:
            for case in cases:
                try:
                    got = call_learner(name, fn, case.args, forbid=forbid, seconds=seconds, timeout_hint=timeout_hint,
                                       show=show, inputs=inputs)
                except CheckFailed as err:
                    hint = next((h for key, h in (error_hints or {}).items() if key in str(err)), "")
                    if hint and hint not in str(err):
                        raise CheckFailed(f"{err}\n  hint: {hint}") from None
                    raise
                try:
                    verdict = judge(case, got)
                except (TimeUp, KeyboardInterrupt, CheckFailed):
                    raise
                except BaseException as err:
                    raise CheckFailed(f"✗ {name} — {case.description}: the check could not compare your answer "
                                      f"with the expected one ({type(err).__name__}: {str(err)[:200]})\n"
                                      f"  input:    {show(case.args)}\n"
                                      f"  expected: {short(case.expected)}\n"
                                      f"  got:      {short(got)}") from None
                if verdict:
                    problem, hint = verdict
                    raise failure(name, case.description, problem, show(case.args), case.expected, got,
                                  [case.hint, hint])
                count += 1
    except TimeoutError:
        if not budget.expired:
            raise
        of = f" of {total}" if total is not None else ""
        hint = f"\n  hint: {timeout_hint}" if timeout_hint else ""
        raise CheckFailed(f"✗ {name}: the check stopped after {total_seconds:g} s in total, with {count}{of} cases "
                          f"done (each was right): your function is too slow.{hint}") from None
    print(success or f"✓ {name} — {count} case{'s' if count != 1 else ''}")

