"""Tables of replaceable functions, and the error a replaced function raises when it breaks its contract.

Each driver of the engine calls its functions through a table: the forward pass through `Parts`,
token choice through `Sampler`, speculative decoding through `Speculation`, quantization through
`Quantization`, `LLMEngine` through `Batching`. A table is a frozen dataclass whose defaults are the
engine's own functions; `table.replace(name=fn)` is a copy with some swapped.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Ops(Slots):
    ...     double: Callable = lambda x: 2 * x
    >>> Ops().replace(double=lambda x: x + x).double(4), Ops().overridden()
    (8, [])
"""

from __future__ import annotations

import dataclasses
from typing import Callable


def raised(err: BaseException, limit: int = 300) -> str:
    """What a replaced function did, for a `PartError`'s message: 'raised ValueError: bad', 'raised KeyError', and
    for a bare `NotImplementedError` (an exercise still its stub) that it is not written yet; a message past `limit`
    characters is cut there.

        >>> raised(ValueError("bad")), raised(KeyError())
        ('raised ValueError: bad', 'raised KeyError')
        >>> raised(NotImplementedError())
        'is not written yet (it raises NotImplementedError)'
    """
    if type(err) is NotImplementedError and not err.args:
        return "is not written yet (it raises NotImplementedError)"
    try:
        text = str(err)
    except Exception:  # an exception whose str() fails
        text = "(its message cannot be shown)"
    text = text if len(text) <= limit else text[:limit] + "…"
    return f"raised {type(err).__name__}: {text}" if text.strip() else f"raised {type(err).__name__}"


class PartError(RuntimeError):
    """A replaced function raised, or returned something the engine cannot use.

    Its message says everything (which function, its input, what was wrong, a hint), so IPython shows just the
    message (`_render_traceback_`), not the engine's frames between the learner's cell and the function.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"PartError: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class Slots:
    """Swappable functions: the fields of a frozen dataclass whose defaults are the engine's own."""

    @classmethod
    def slot_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_functions(cls, functions: dict) -> None:
        """Refuse names that are not slots and values that are not functions (or classes)."""
        names = cls.slot_names()
        for name, fn in functions.items():
            if name not in names:
                raise ValueError(f"unknown part {name!r}; the parts are: {', '.join(sorted(names))}")
            if not callable(fn):
                raise ValueError(f"part {name!r} must be a function, got {type(fn).__name__}")

    def replace(self, **functions: Callable):
        """A copy of this table with some functions swapped (names and values checked)."""
        self.check_functions(functions)
        return dataclasses.replace(self, **functions)

    def overridden(self) -> list[str]:
        """Names of the slots that do not hold the engine's own function."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not f.default]
