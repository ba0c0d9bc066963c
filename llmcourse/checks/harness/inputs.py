"""Arguments must not change: snapshots taken before a call, compared after it, and the message."""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable, Collection, Optional, Union

import torch

from .show import short

_ATOMS = (str, bytes, int, float, complex, bool, type(None), range)


def _snapshot(value: Any) -> Any:
    """A deep copy to compare with after the call; _UNKNOWN if the value cannot be copied."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Generator):
        return _UNKNOWN  # drawing from it is what it is for: the randomness contract checks its use
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
        return (
            isinstance(value, dict)
            and list(value) == list(snap)
            and all(_unchanged(value[k], v) for k, v in snap.items())
        )
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
            self.names = [
                p.name
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
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
        return (
            "an in-place operation (x -= m, x /= s, x.sub_(m), x[i] = v, x.sort_()) changes the caller's "
            "tensor: write x = x - m, or work on x.clone()"
        )
    if isinstance(value, dict):
        return "don't add, remove or change its entries (d[k] = v, d.pop(k), del d[k]): copy it first, dict(d)"
    if isinstance(value, list):
        return (
            "don't change it in place (ids[i] = ..., ids.pop(i), del ids[i], ids[i:j] = ..., ids.sort()): "
            "build a new list (out = []), or work on a copy, list(ids)"
        )
    return "work on a copy (copy.deepcopy) or build a new value"


_MISSING = object()


def _describe_change(name: str, before: Any, after: Any) -> str:
    """Two lines: what the argument was and what it became (for a dict, the first entry that changed)."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key, value in before.items():
            if key not in after:
                return (
                    f"  before the call: {name}[{short(key, 60)}] was {short(value, 80)}\n  after the call:  it is gone"
                )
            if not _unchanged(after[key], _snapshot(value)):
                return (
                    f"  before the call: {name}[{short(key, 60)}] was {short(value, 80)}\n"
                    f"  after the call:  {name}[{short(key, 60)}] is {short(after[key], 80)}"
                )
        added = next((key for key in after if key not in before), _MISSING)
        if added is not _MISSING:
            return (
                f"  before the call: {name} had no key {short(added, 60)}\n"
                f"  after the call:  {name}[{short(added, 60)}] is {short(after[added], 80)}"
            )
        return (
            f"  before the call: the keys in the order {short(list(before), 120)}\n"
            f"  after the call:  the keys in the order {short(list(after), 120)}"
        )
    if (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.shape == after.shape
        and before.dtype == after.dtype
    ):
        now = after.detach()
        differs = now != before
        if before.is_floating_point() or before.is_complex():
            differs &= ~(now.isnan() & before.isnan())
        if bool(differs.any()):
            index = tuple(int(i) for i in torch.nonzero(differs)[0])
            where = "[" + ", ".join(map(str, index)) + "]"
            return (
                f"  it changed at {int(differs.sum())} of {differs.numel()} positions, first at {name}{where}: "
                f"{short(before[index].item(), 40)} before the call, {short(now[index].item(), 40)} after it"
            )
    if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
        return (
            f"  before the call: shape {tuple(before.shape)}, {before.dtype}\n"
            f"  after the call:  shape {tuple(after.shape)}, {after.dtype}"
        )
    return f"  before the call: {short(before)}\n  after the call:  {short(after)}"


def watched(fn: Callable, args: tuple, may_modify: tuple = ()) -> _Inputs:
    """Snapshots of `args` before fn(*args), for a call the check makes outside `call_learner` (its draws in a
    loop, the engine's calls): `changed_input` then says whether the call changed one."""
    inputs = _Inputs(fn, may_modify)
    inputs.remember(args)
    return inputs


def named_like(run: Callable, fn: Callable, leading: tuple = ("kind",)) -> Callable:
    """`run`, a check's runner called as run(*leading, *fn's arguments), given the signature that says so: a
    changed input is then named as the learner named it (p, draft_token), not "argument #2"."""
    try:
        params = list(inspect.signature(fn).parameters.values())
        run.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in leading]
            + [p.replace(kind=inspect.Parameter.POSITIONAL_ONLY, default=inspect.Parameter.empty) for p in params]
        )
    except (TypeError, ValueError):  # a builtin, or *args: the harness numbers the arguments
        pass
    return run


def changed_input(inputs: _Inputs, args: tuple) -> Optional[tuple[str, str]]:
    """None when the call left its arguments as `watched` saw them; else what changed and the hint."""
    changed = inputs.changed(args)
    if not changed:
        return None
    index, before = changed
    return change_verdict(inputs.name(index), before, args[index])


def change_verdict(name: str, before: Any, after: Any) -> tuple[str, str]:
    """What a call changed in its argument `name`, and the hint."""
    return (
        f"changed its input `{name}`: your function must not change its arguments (the caller still needs them)\n"
        f"{_describe_change(name, before, after)}",
        _modify_hint(after),
    )
