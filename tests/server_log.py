"""The server tests' log check: what the server logs while a test runs is collected, and the test fails if it holds
a traceback or an error (uvicorn's "Exception in ASGI application", a CancelledError at shutdown ...), unless the
test says it provokes one (`server_log.expect_errors()`). A test module uses it with
`pytestmark = pytest.mark.usefixtures("server_log")` (the fixture is in conftest.py)."""

from __future__ import annotations

import logging

NAMES = ("uvicorn", "llmcourse")  # the loggers of the HTTP stack and of the server (llmcourse.server)


class ServerLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.errors_expected = False
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(NAMES):
            self.records.append(record)

    def expect_errors(self) -> None:
        self.errors_expected = True

    def lines(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]

    def bad(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


def collect_server_log():
    handler, root, server = ServerLog(), logging.getLogger(), logging.getLogger("llmcourse.server")
    level = server.level
    root.addHandler(handler)
    server.setLevel(logging.INFO)  # its info lines too (a client that went away)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        server.setLevel(level)
    if not handler.errors_expected:
        assert not handler.bad(), "the server logged a traceback or an error:\n" + "\n\n".join(handler.bad())
