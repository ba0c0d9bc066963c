"""uvicorn as this server runs it: a deadline for a request to arrive, and a shutdown that answers every request.

`H11WithDeadline`: a request's headers and body must arrive within `--receive-timeout` seconds (uvicorn's keep-alive
timer restarts with every byte, so a client sending a byte a second would hold a connection for ever). `LLMServer`:
on SIGINT/SIGTERM, requests in flight get `--shutdown-grace` seconds, then each stream gets an error event and
`data: [DONE]` and each plain request a JSON 503. `serve` runs an app until a signal; `ServerThread` runs one in a
background thread (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Optional

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import openai_api as api

SHUTDOWN_GRACE = 5  # seconds requests in flight get to finish after SIGINT/SIGTERM; then they end (503, error event)
RECEIVE_TIMEOUT = 20  # seconds in which a request's headers and body must arrive (else 408, the connection closes)
KEEP_ALIVE = 5  # seconds an idle connection stays open between requests (uvicorn's default)
logger = logging.getLogger("llmcourse.server")


class LLMServer(uvicorn.Server):
    """uvicorn's server with the shutdown a client can understand.

    On SIGINT/SIGTERM it stops accepting connections and closes the idle ones; requests in flight get `grace`
    seconds to finish; then the engine stops, and what is left ends in words: each stream gets an error event and
    `data: [DONE]`, each plain request a JSON 503, before its connection closes (nothing is cancelled mid-write).
    The process then exits normally (status 0) instead of raising the signal again."""

    def __init__(self, config: uvicorn.Config, grace: float = SHUTDOWN_GRACE):
        super().__init__(config)
        self.grace = grace

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its response
        state = getattr(self.config.app, "state", None)
        runner = getattr(getattr(state, "server", None), "runner", None)
        if runner is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.grace
            while runner.num_pending and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.02)
            await runner.stop()  # what is left gets its error (503 / error event) now
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(), timeout=self.config.timeout_graceful_shutdown)
        except asyncio.TimeoutError:  # a client that does not read its answer, say
            logger.warning(
                "%d connection(s) did not finish within the shutdown's time: closed", len(self.server_state.tasks)
            )
            for task in self.server_state.tasks:
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()


class H11WithDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for receiving a request: its headers and whole body must arrive
    within `config.receive_timeout` seconds of the connection's opening or of the previous response (else 408 and
    the connection closes). uvicorn's own keep-alive timer restarts with every byte, so a client sending one byte a
    second (slowloris) would hold a connection for ever; ASGI middleware cannot help, it runs only once the headers
    are in."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.receipt: Optional[asyncio.TimerHandle] = None
        self.arm()

    def arm(self) -> None:
        if self.receipt is None:
            self.receipt = self.loop.call_later(getattr(self.config, "receive_timeout", RECEIVE_TIMEOUT), self.too_slow)

    def disarm(self) -> None:
        if self.receipt is not None:
            self.receipt.cancel()
            self.receipt = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete:
            self.disarm()  # the request is in: the deadline is over

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (a pipelined request waiting in the buffer starts here)
        if not self.transport.is_closing() and (self.cycle.response_complete or self.cycle.more_body):
            self.arm()  # the next request's deadline (an idle connection closes at the keep-alive timeout first)

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def too_slow(self) -> None:
        self.receipt = None
        if self.transport.is_closing():
            return
        between = self.cycle is None or self.cycle.response_complete
        if not (between and not self.conn.trailing_data[0] and self.conn.their_state is h11.IDLE):  # bytes came
            timeout = getattr(self.config, "receive_timeout", RECEIVE_TIMEOUT)
            client = "%s:%s" % tuple(self.client[:2]) if self.client else "a client"
            logger.info("%s did not send its request within %s s: 408, connection closed", client, timeout)
            if between or not self.cycle.response_started:
                error = api.APIError(
                    f"the request did not arrive within {timeout} s (headers and body): send it whole, faster",
                    status=408,
                    code="request_timeout",
                )
                body = json.dumps(error.body()).encode()
                head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
                self.transport.write(head.encode() + body)
        self.transport.close()


def server_config(
    app, host: str, port: int, keep_alive: float, receive_timeout: float, graceful: float
) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        log_config=None,  # uvicorn's lines go to the "uvicorn" loggers, as configured by `serve` (or a test)
        http=H11WithDeadline,
        timeout_keep_alive=keep_alive,
        timeout_graceful_shutdown=graceful,
    )
    config.receive_timeout = receive_timeout
    return config


def serve(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    keep_alive: float = KEEP_ALIVE,
    receive_timeout: float = RECEIVE_TIMEOUT,
    shutdown_grace: float = SHUTDOWN_GRACE,
) -> None:
    """Run `app` until SIGINT/SIGTERM (`LLMServer`: requests in flight get `shutdown_grace` seconds to finish).
    keep_alive: seconds an idle connection stays open; receive_timeout: seconds a request may take to arrive."""
    handler = logging.StreamHandler()  # uvicorn's warnings and the server's own lines (info: a client went away)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    for name, level in (("uvicorn", logging.WARNING), ("llmcourse.server", logging.INFO)):
        logging.getLogger(name).handlers = [handler]
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).propagate = False
    config = server_config(app, host, port, keep_alive, receive_timeout, graceful=5)
    LLMServer(config, grace=shutdown_grace).run()


class ServerThread:
    """`app` served by uvicorn in a background thread (tests, benchmarks, notebooks); `url` once started.

    >>> with ServerThread(app) as server:                                           # doctest: +SKIP
    ...     httpx.get(server.url + "/health").json()["status"]
    'ok'
    """

    def __init__(
        self,
        app: Starlette,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keep_alive: float = KEEP_ALIVE,
        receive_timeout: float = RECEIVE_TIMEOUT,
        shutdown_grace: float = 1,
    ):
        config = server_config(app, host, port, keep_alive, receive_timeout, graceful=1)
        self.server = LLMServer(config, grace=shutdown_grace)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="llmcourse-server")
        self.url = ""

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (is the port taken?)")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
