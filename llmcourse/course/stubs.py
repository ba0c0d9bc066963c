"""One line, not a traceback, when a notebook cell calls an exercise that is still a stub.

A demo cell after an exercise calls the learner's function; while it is the release's stub (`raise
NotImplementedError()`), IPython would show 20 lines of traceback ending in that stub. `install()` (done by
`import llmcourse` inside IPython) makes IPython show instead:

    NotImplementedError: `embedding` is not written yet: write it in its exercise cell above first (its check
    must pass), then run this cell again

(one line on the screen)

only for a bare `NotImplementedError` raised by a function defined in the notebook itself; every other error keeps
IPython's own traceback. The cell still fails (nbgrader and `progress` see an error as before).
"""

from __future__ import annotations

import dis
import inspect
import sys
from typing import Optional

_INSTALLED = "_llmcourse_stub_handler"


def unwritten(value: BaseException, tb, user_ns: dict) -> Optional[str]:
    """The name of the notebook's function whose stub raised `value`, or None if it is not such a stub."""
    if type(value) is not NotImplementedError or value.args:
        return None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_globals is not user_ns:
        return None
    code = tb.tb_frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return None if name == "<module>" else name


def message(name: str) -> str:
    return (
        f"NotImplementedError: `{name}` is not written yet: write it in its exercise cell above first (its check "
        "must pass), then run this cell again"
    )


def is_stub(fn) -> bool:
    """Whether `fn` is still the release's stub: its body only raises a bare NotImplementedError (comments aside).

    >>> def f(x):
    ...     # YOUR CODE HERE
    ...     raise NotImplementedError()
    >>> is_stub(f), is_stub(len), is_stub(lambda x: x)
    (True, False, False)
    >>> import functools   # a decorated stub (torch.no_grad() wraps chapter 06's generate_greedy): what it wraps
    >>> is_stub(functools.wraps(f)(lambda *args: f(*args)))
    True
    """
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return False
    ops = {i.opname for i in dis.get_instructions(code)} - {"RESUME", "NOP", "PUSH_NULL", "PRECALL", "CACHE"}
    return code.co_names == ("NotImplementedError",) and ops <= {"LOAD_GLOBAL", "CALL", "RAISE_VARARGS"}


class NotWritten(NotImplementedError):
    """Raised by `written` for an exercise still a stub: IPython shows its one line, as for a stub's own error."""

    def __init__(self, name: str):
        super().__init__(message(name).removeprefix("NotImplementedError: "))
        self.name = name

    def _render_traceback_(self) -> list[str]:
        return [message(self.name)]


def written(*functions) -> None:
    """Raise `NotWritten` naming the first of `functions` still a stub. A figure drawn from a demo's results calls it
    first: on the release, Run All then says which exercise to write there too, not a KeyError over results the
    failed demo never made."""
    for fn in functions:
        if is_stub(fn):
            raise NotWritten(getattr(fn, "__name__", repr(fn)))


def install(shell=None) -> bool:
    """Show a stub's NotImplementedError as one line in this IPython shell (the running one by default)."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, _INSTALLED, False):
        return False

    def handler(self, etype, value, tb, tb_offset=None):
        name = value.name if isinstance(value, NotWritten) else unwritten(value, tb, self.user_ns)
        if name is None:
            stb = self.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        else:
            stb = [message(name)]
        self._showtraceback(etype, value, stb)  # ipykernel sends it as the cell's error output
        return stb

    shell.set_custom_exc((NotImplementedError,), handler)
    setattr(shell, _INSTALLED, True)
    return True
