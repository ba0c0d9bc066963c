"""`short`: a readable repr of bounded length, for the messages of checks; `previews`: an expected and a got
answer side by side, both showing the positions where they differ."""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, defaultdict
from typing import Any, Optional, Sequence, Union

import torch

_DICT_REPRS = (dict.__repr__, Counter.__repr__, defaultdict.__repr__, OrderedDict.__repr__)
_RUN = 6  # this many equal items in a row or more are shown as a repetition
WINDOW = 12  # values (items, 3x as many characters) shown around where an expected and a got answer differ


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


def distinct(expected: float, got: float) -> tuple[str, str]:
    """The two numbers written with as many significant digits as it takes to see that they differ.

    >>> distinct(0.1153641, 0.1153643)
    ('0.1153641', '0.1153643')
    """
    for digits in range(6, 18):
        a, b = f"{expected:.{digits}g}", f"{got:.{digits}g}"
        if a != b:
            return a, b
    return repr(expected), repr(got)


def previews(expected: Any, got: Any, limit: int = 300) -> tuple[str, str]:
    """`short(expected)` and `short(got)`; but where both are tensors of one shape, or lists, tuples, strings or
    bytes of one length, that differ somewhere `short` would hide, both show the same positions around where they
    differ, aligned: for tensors, the first position of the largest difference (the one the message names), else
    the first that differs.

        >>> expected, got = list(range(100)), list(range(100))
        >>> got[60] = -1
        >>> for line in previews(expected, got): print(line)
        list of 100 items, [57:69]=[57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68]
        list of 100 items, [57:69]=[57, 58, 59, -1, 61, 62, 63, 64, 65, 66, 67, 68]
    """
    try:
        shown = _windows(expected, got, limit)
    except Exception:  # a learner's object that cannot be compared or shown: the usual previews
        shown = None
    if shown is None:
        return short(expected, limit), short(got, limit)
    return tuple(text if len(text) <= limit else text[: max(limit - 4, 1)] + " ..." for text in shown)


def _windows(expected: Any, got: Any, budget: int) -> Optional[tuple[str, str]]:
    """The two previews windowed on where they differ, or None where `short` shows enough (or they are alike)."""
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return _tensor_windows(expected, got, budget)
    if type(expected) is not type(got) or not isinstance(expected, (str, bytes, list, tuple)):
        return None
    if len(expected) != len(got):
        return None
    if isinstance(expected, (str, bytes)):
        at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if at is None or len(expected) <= 3 * WINDOW:
            return None
        start, end = _span(at, len(expected), 3 * WINDOW)
        kind = "characters" if isinstance(expected, str) else "bytes"
        head = f"{type(expected).__name__} of {len(expected)} {kind}, [{start}:{end}]="
        return head + repr(expected[start:end]), head + repr(got[start:end])
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if not _alike(a, b)), None)
    if at is None:
        return None
    head = f"{type(expected).__name__} of {len(expected)} items"
    inner = _windows(expected[at], got[at], budget - len(head) - 20)
    if inner is not None:  # the first differing item is itself long: window into it
        return f"{head}, item {at}: {inner[0]}", f"{head}, item {at}: {inner[1]}"
    if len(expected) <= WINDOW:
        return None
    start, end = _span(at, len(expected), WINDOW)
    each = max(budget // WINDOW - 2, 8)
    want, have = _aligned([short(v, each) for v in expected[start:end]], [short(v, each) for v in got[start:end]])
    return f"{head}, [{start}:{end}]={want}", f"{head}, [{start}:{end}]={have}"


def _alike(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and bool(a == b)


def _tensor_windows(expected: torch.Tensor, got: torch.Tensor, budget: int) -> Optional[tuple[str, str]]:
    """Both tensors' values at the same flat positions, around the first largest difference (floats) or the first
    difference (integers, bools); None for small tensors (`short` shows them whole) or tensors that cannot be
    compared value by value."""
    if expected.shape != got.shape or expected.numel() <= WINDOW or expected.device != got.device:
        return None
    if expected.device.type == "meta" or expected.is_complex() or got.is_complex():
        return None
    want, have = expected.detach().flatten(), got.detach().flatten()
    if want.is_floating_point() or have.is_floating_point():
        want64, have64 = want.double(), have.double()
        same = (want64 == have64) | (want64.isnan() & have64.isnan())
        difference = (have64 - want64).abs().nan_to_num(nan=math.inf).masked_fill(same, 0.0)
        if not bool(difference.any()):
            return None
        at = int(difference.argmax())  # the first of the largest: where the message says they differ most
    else:
        differs = want != have
        if not bool(differs.any()):
            return None
        at = int(differs.nonzero()[0])
    start, end = _span(at, want.numel(), WINDOW)

    def values(t: torch.Tensor) -> list[str]:
        items = t[start:end].tolist()
        return [repr(_Float(v)) if isinstance(v, float) else repr(v) for v in items]

    shown = _aligned(values(want), values(have))
    return tuple(
        f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, values[{start}:{end}]={text})"
        for t, text in zip((expected, got), shown)
    )


def _span(at: int, n: int, width: int) -> tuple[int, int]:
    """[start, end) of `width` positions out of n that shows position `at` with a few before it."""
    start = max(0, min(at - 3, n - width))
    return start, min(n, start + width)


def _aligned(left: list[str], right: list[str]) -> tuple[str, str]:
    """'[a, b]' and '[c, d]' with each pair of items padded to one width, so that the two lines align."""
    widths = [max(len(a), len(b)) for a, b in zip(left, right)]
    return tuple("[" + ", ".join(v.rjust(w) for v, w in zip(side, widths)) + "]" for side in (left, right))


def _module(value: torch.nn.Module) -> str:
    """An nn.Module in one line: its class, size and a few settings (its repr is pages long)."""
    params = sum(p.numel() for p in value.parameters())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in value.parameters()})
    config = getattr(value, "config", None)
    settings = ""
    if config is not None:
        known = [
            (k, getattr(config, k))
            for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "layer_norm_epsilon")
            if hasattr(config, k)
        ]
        settings = ", " + ", ".join(f"{k}={v}" for k, v in known) if known else ""
    return f"<{type(value).__name__}: {params:,} parameters ({', '.join(dtypes) or 'none'}){settings}>"


def _short(value: Any, budget: int) -> str:
    if isinstance(value, torch.nn.Module):
        return _module(value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device=meta (no values))"
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
