"""One `LLMEngine`, many connections: an asyncio task drives `step()` and hands each request's tokens to its
consumer as they come (vLLM's AsyncLLM, in a page).

The step runs in a worker thread, so that the event loop stays free to accept connections, stream text and
notice disconnects while the model computes. Everything else that touches the engine (adding a request,
aborting one, handing out tokens) runs on the loop between steps, so the engine is never used by two threads
at once.

    >>> async with AsyncEngine(LLMEngine(model)) as engine:                     # doctest: +SKIP
    ...     stream = engine.submit(engine.engine.new_request(ids, max_new_tokens=20))
    ...     async for out in stream:
    ...         print(out.token, out.finished)
    ...     streams = engine.submit_all(engine.engine.new_choices(ids, 4, temperature=0.8))  # n = 4 choices
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, NamedTuple, Optional

from .llm_engine import LLMEngine, TokenLogprobs
from .scheduler import Request

STOP_WAIT = 10  # seconds `stop` waits for the running step before cancelling it


class Busy(RuntimeError):
    """The server holds as many requests as it takes (`max_pending`): try again shortly."""


class Output(NamedTuple):
    """One new token of a request: the token, whether the request ended with it, its log-probabilities (if asked),
    and when the engine gave it (time.monotonic(), read once per step: the server's latency metrics)."""

    token: int
    finished: bool
    logprobs: Optional[TokenLogprobs]
    time: float = 0.0


class Stream:
    """A submitted request's outputs, as an async iterator; `abort()` ends it and frees its blocks. `submitted`:
    when it was submitted (time.monotonic()); `counted`: the server's `RequestMetrics` for it, if it counts."""

    def __init__(self, engine: "AsyncEngine", request: Request, after: Optional[Request] = None):
        self.engine, self.request = engine, request
        self.after = after  # the first choice of the same prompt (`LLMEngine.add`), or None
        self.submitted = time.monotonic()
        self.counted = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> AsyncIterator[Output]:
        return self.outputs()

    async def outputs(self) -> AsyncIterator[Output]:
        while not self.done:
            item = await self.queue.get()
            if isinstance(item, BaseException):  # the step failed, or the engine stopped
                self.done = True
                raise item
            self.done = item.finished
            yield item

    def abort(self) -> None:
        """The consumer went away: end the request at the next step boundary (at once if it waits)."""
        if not self.done:
            self.done = True
            self.engine.aborted.append(self)
            self.engine.wake.set()


class AsyncEngine:
    """Runs `engine` (an `LLMEngine`) for many asyncio consumers. max_pending: requests held at once (waiting or
    running); `submit` raises `Busy` beyond that, so that a flood is refused rather than queued without end."""

    def __init__(self, engine: LLMEngine, max_pending: int = 256):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an integer >= 1, got {max_pending!r}")
        self.engine, self.max_pending = engine, max_pending
        self.incoming: list[Stream] = []  # submitted, not yet added to the engine
        self.aborted: list[Stream] = []
        self.streams: dict[int, Stream] = {}  # by request id: in the engine
        self.wake = asyncio.Event()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmcourse-step")
        self.task: Optional[asyncio.Task] = None
        self.stopping = False

    @property
    def num_pending(self) -> int:
        return len(self.incoming) + len(self.streams)

    def submit(self, request: Request) -> Stream:
        """Queue a request made by `LLMEngine.new_request`; it joins the batch at the next step."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[Stream]:
        """Queue the choices of one prompt made by `LLMEngine.new_choices` (all or none: each counts towards
        `max_pending`); the first joins the batch at the next step, the others share its prompt's blocks."""
        if self.stopping or (self.task is not None and self.task.done()):  # done: the loop itself failed
            raise Busy("the server is shutting down")
        if self.num_pending + len(requests) > self.max_pending:
            raise Busy(f"the server holds {self.num_pending} requests, its limit (max_pending={self.max_pending})")
        streams = [Stream(self, r, after=requests[0] if i else None) for i, r in enumerate(requests)]
        self.incoming += streams
        self.wake.set()
        return streams

    async def __aenter__(self) -> "AsyncEngine":
        self.task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def stop(self, wait: float = STOP_WAIT) -> None:
        """End what is in flight (each consumer gets `Busy`) and stop the loop: at the next step boundary (the
        step running finishes and its tokens are delivered), or after `wait` seconds by cancelling."""
        self.stopping = True
        if self.task is not None and not self.task.done():
            self.wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self.task), wait)
            except asyncio.TimeoutError:
                self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        for stream in self.incoming + list(self.streams.values()):
            self.engine.release(stream.request.id)
            stream.queue.put_nowait(Busy("the server shut down before this request finished"))
        self.incoming, self.streams = [], {}
        self.worker.shutdown(wait=True)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            self.apply_changes()
            if not self.engine.has_unfinished():
                self.wake.clear()
                if not self.stopping:
                    await self.wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self.worker, self.engine.step)
            except Exception as err:  # a learner's part failed, say: fail what runs, keep serving
                self.fail_all(err)
                continue
            self.deliver(outputs)

    def apply_changes(self) -> None:
        """Between steps: add the new requests, take out the aborted ones (their blocks freed at once)."""
        for stream in self.aborted:
            if stream in self.incoming:
                self.incoming.remove(stream)
            elif self.streams.pop(stream.request.id, None) is not None:
                self.engine.release(stream.request.id)
        self.aborted = []
        for stream in self.incoming:
            self.streams[self.engine.add(stream.request, after=stream.after)] = stream
        self.incoming = []

    def deliver(self, outputs: list[tuple[int, int, bool]]) -> None:
        now = time.monotonic()  # the step's tokens' time (the one clock read the metrics need)
        for rid, token, finished in outputs:
            stream = self.streams.get(rid)
            if stream is None:
                continue
            request = stream.request
            logprobs = request.logprobs[-1] if request.num_logprobs is not None else None
            stream.queue.put_nowait(Output(token, finished, logprobs, now))
            if finished:
                del self.streams[rid]
                self.engine.release(rid)

    def fail_all(self, err: Exception) -> None:
        for rid, stream in list(self.streams.items()):
            self.engine.release(rid)
            stream.queue.put_nowait(err)
        self.streams = {}
