"""An OpenAI-compatible HTTP server over `LLMEngine` (`python -m llmcourse serve`), and the chat page at `/`.

What happens when you press Enter in a chat window, from the server's side: the page POSTs the conversation
to `/v1/chat/completions`; the server renders it with the model's chat template, queues the token ids in
the one `LLMEngine` that every connection shares (`AsyncEngine` steps it, so requests join the running
batch), and streams each piece of text back as a server-sent event (`data: {...}\\n\\n`) the moment it is
a whole character and cannot be the start of a stop string; `data: [DONE]` ends the stream. A client that
goes away aborts its request, and its KV blocks return to the pool at once.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not), `GET /v1/models` (and
`/v1/models/NAME`), vLLM's `POST /tokenize` and `POST /detokenize` (`tokenize_api`), `GET /metrics` (Prometheus:
`metrics`), `GET /health`, `GET /` (the chat page) and `GET /favicon.ico` (its icon). Errors are OpenAI's:
`{"error": {"message", "type", "param", "code"}}`.

A client is not trusted: a body must be JSON sent as such (415 otherwise), UTF-8 and Unicode text (400 naming
the problem), and a page of another site gets 403 unless its origin is allowed (`untrusted`); a request must
arrive within a deadline, and on SIGTERM each request in flight is answered (`uvicorn_server`); parsing and
tokenizing run in worker threads, so that the event loop always answers; a message's text never becomes a
special token of the chat template (`HFTokenizer.encode_chat_plain`). An unexpected
exception is a generic 500 and a line in the log, never its text in a response.

    >>> app = build_app(LLMEngine(model), tokenizer, "llama-shakespeare")         # doctest: +SKIP
    >>> with ServerThread(app) as server:                                          # doctest: +SKIP
    ...     client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ...     client.chat.completions.create(model="llama-shakespeare", messages=[{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import AsyncIterator, Callable, Iterable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from llmcourse.engine.generate import StopStrings
from llmcourse.engine.sampling import eos_ids
from llmcourse.engine.structured.constraint import Constraint, compile_constraint
from llmcourse.engine.structured.structuring import Structuring
from llmcourse.engine.tokenizer import stream_decoder

from . import openai_api as api
from . import tokenize_api
from .async_engine import AsyncEngine, Busy, Stream
from .llm_engine import LLMEngine
from .metrics import MEDIA_TYPE, Metrics
from .untrusted import Guard, check_origins, parse_json, read_body
from .uvicorn_server import ServerThread, serve  # noqa: F401 - the server's entry points, as `serve` and tests use them

RETRY_AFTER = "1"  # seconds, for a client told the server is full (429)
logger = logging.getLogger("llmcourse.server")


def build_app(
    engine: LLMEngine,
    tokenizer,
    model_name: str,
    *,
    api_key: Optional[str] = None,
    max_pending: int = 256,
    allowed_origins: Iterable[str] = (),
    structuring: Optional[Structuring] = None,
) -> Starlette:
    """The ASGI app serving `engine`'s model as `model_name`. api_key: required as `Authorization: Bearer KEY` on
    the /v1 routes, /tokenize, /detokenize and /metrics (None: open). max_pending: requests held at once before
    new ones get 429. allowed_origins: the web origins (`https://example.org`, or `*`) whose pages may call the
    server from a browser; any other cross-origin request gets 403 (the chat page is same-origin). structuring: the
    functions a request's constraint is compiled and followed with (`serve --parts`: chapter 13's)."""
    if engine.tokenizer is None:  # stop strings are matched in the text
        engine.tokenizer = tokenizer
    server = Server(engine, tokenizer, model_name, api_key, max_pending, structuring)
    routes = [
        Route("/", server.chat_page),
        Route("/favicon.ico", server.favicon),
        Route("/health", server.health),
        Route("/v1/models", server.models),
        Route("/v1/models/{model:path}", server.model),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/metrics", server.metrics_page),
    ]
    handlers = {api.APIError: error_response, HTTPException: http_error}
    guard = Middleware(Guard, allowed_origins=check_origins(allowed_origins))
    app = Starlette(routes=routes, lifespan=server.lifespan, exception_handlers=handlers, middleware=[guard])
    app.state.server = server  # for the shutdown (LLMServer) and tests
    return app


class Server:
    """The routes' state: the model's name and tokenizer, the `AsyncEngine` (made when the app starts) and the
    metrics."""

    def __init__(self, engine: LLMEngine, tokenizer, name: str, api_key: Optional[str], max_pending: int,
                 structuring: Optional[Structuring] = None):  # fmt: skip
        self.engine, self.tokenizer, self.name, self.api_key = engine, tokenizer, name, api_key
        self.structuring = structuring
        self.max_pending = max_pending
        self.n_positions = engine.model.config.n_positions
        self.vocab_size = getattr(tokenizer, "n_vocab", None) or engine.model.config.vocab_size
        self.runner: Optional[AsyncEngine] = None
        self.metrics = Metrics(name, engine, pending=lambda: len(self.runner.incoming) if self.runner else 0)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        # a request's CPU work (JSON checks, chat template, tokenizer) runs here, off the event loop
        self.cpu: Optional[ThreadPoolExecutor] = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        # one thread: a tokenizer (a learner's, under `serve --parts`) need not be safe to run in two at once
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmcourse-prepare")
        try:
            async with AsyncEngine(self.engine, self.max_pending) as runner:
                self.runner = runner
                yield
        finally:
            self.cpu.shutdown(wait=False, cancel_futures=True)

    # -- plain routes --------------------------------------------------------------------------------------

    async def chat_page(self, request: Request) -> Response:
        page = resources.files("llmcourse.serving").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    async def favicon(self, request: Request) -> Response:  # the browser asks for it with any page: not a 404
        icon = resources.files("llmcourse.serving").joinpath("static/favicon.svg").read_bytes()
        return Response(icon, media_type="image/svg+xml", headers={"cache-control": "max-age=86400"})

    async def health(self, request: Request) -> Response:
        scheduler = self.engine.scheduler
        return JSONResponse(
            {
                "status": "ok",
                "model": self.name,
                "running": len(scheduler.running),
                "waiting": len(scheduler.waiting),
                "free_blocks": self.engine.blocks.num_free,
                "num_blocks": self.engine.blocks.num_blocks,
            }
        )

    def card(self) -> dict:
        return {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "llmcourse",
            "max_model_len": self.n_positions,
            "chat": getattr(self.tokenizer, "chat_template", None) is not None,
        }

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self.card())

    async def metrics_page(self, request: Request) -> Response:
        self.authorize(request)
        return Response(self.metrics.exposition(), media_type=MEDIA_TYPE)

    async def tokenize(self, request: Request) -> Response:
        return await self.tokens_route(
            request, lambda body: tokenize_api.tokenize(body, self.tokenizer, self.n_positions)
        )

    async def detokenize(self, request: Request) -> Response:
        return await self.tokens_route(
            request, lambda body: tokenize_api.detokenize(body, self.tokenizer, self.n_positions, self.vocab_size)
        )

    async def tokens_route(self, request: Request, answer: Callable[[object], dict]) -> Response:
        """/tokenize and /detokenize: checked and answered in the worker thread, as a generation request is
        prepared (a long text's tokens take a while)."""
        self.authorize(request)
        raw = await read_body(request)

        def prepare() -> dict:
            body = parse_json(raw)
            if isinstance(body, dict):
                self.check_model(body.get("model"))
            return answer(body)

        return JSONResponse(await asyncio.get_running_loop().run_in_executor(self.cpu, prepare))

    def check_model(self, name) -> None:
        if name not in (None, self.name):
            raise api.APIError(
                f"the model {name!r} does not exist: this server serves {self.name!r} (GET /v1/models)",
                "model",
                status=404,
                code="model_not_found",
            )

    # -- generation ----------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, api.completion_job)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, api.chat_job)

    async def generate(self, request: Request, make_job: Callable) -> Response:
        self.authorize(request)
        raw = await read_body(request)

        def prepare() -> tuple[api.Job, Optional[Constraint]]:  # in a worker thread: a 1 MB prompt's tokens take a
            body = parse_json(raw)  # second or more, a new schema's token index about one
            if isinstance(body, dict):
                self.check_model(body.get("model"))
            job = make_job(body, self.tokenizer, self.n_positions)
            if job.constraint is None:
                return job, None
            spec = dict(job.constraint)
            field = spec.pop("field")
            try:
                return job, compile_constraint(self.tokenizer, **spec, structuring=self.structuring)
            except ValueError as err:  # a schema outside the subset names its keyword; a regex, its feature
                raise api.APIError(f"{field}: {err}", field) from None

        job, constraint = await asyncio.get_running_loop().run_in_executor(self.cpu, prepare)
        try:  # n choices: n requests, choice i seeded seed + i (`LLMEngine.new_choices`)
            engine_requests = self.engine.new_choices(
                job.prompt, job.n, logprobs=job.logprobs, constraint=constraint, **job.settings
            )
        except ValueError as err:
            raise api.engine_error(err) from None
        try:
            streams = self.runner.submit_all(engine_requests)
        except Busy as err:
            status = 503 if self.runner.stopping else 429
            raise api.APIError(f"{err}; retry shortly", status=status, kind="server_busy") from None
        for stream in streams:  # each choice counts as a request in the metrics, as vLLM's n child requests do
            stream.counted = self.metrics.request(stream.submitted, len(job.prompt))

        def abort() -> None:  # the client went away: free the blocks of every choice now
            for stream in streams:
                stream.abort()
                stream.counted.finish("abort")  # (nothing if it finished)

        rid = api.new_id("chatcmpl" if job.chat else "cmpl")
        if job.stream:
            return EventStream(self.events(job, streams, rid), on_close=abort)
        answer = asyncio.ensure_future(self.answer(job, streams, rid))
        try:
            if await finished_before_disconnect(answer, request.receive):
                return JSONResponse(answer.result())
            return Response(status_code=499)  # the client went away
        except Busy as err:  # the server stopped before the answer was complete
            raise api.APIError(str(err), status=503, kind="server_busy") from None
        finally:
            abort()  # what still runs (the client went away, a choice failed) ends now; finished streams are done

    async def answer(self, job: api.Job, streams: list[Stream], rid: str) -> dict:
        """The whole completion, as one response: every choice, in order; the usage counts the prompt once and
        every choice's tokens."""

        async def whole(stream: Stream) -> api.Choice:
            text, tokens, logprobs, finish = "", [], [], None
            async for piece, new_tokens, new_logprobs, finish in self.pieces(stream):
                text, tokens, logprobs = text + piece, tokens + new_tokens, logprobs + new_logprobs
            return api.Choice(text, finish, self.logprobs(job, tokens, logprobs, 0))

        choices = await asyncio.gather(*(whole(stream) for stream in streams))
        use = api.usage(len(job.prompt), sum(len(stream.request.generated) for stream in streams))
        respond = api.chat_response if job.chat else api.completion_response
        return respond(rid, self.name, choices, use)

    async def events(self, job: api.Job, streams: list[Stream], rid: str) -> AsyncIterator[str]:
        """The server-sent events of a streamed completion: the role (chat), a chunk per piece of text, the
        finish reason, the usage (when asked), [DONE]. With n > 1 each choice has its role chunk, then the
        choices' chunks interleave as their tokens come, each with its choice's `index`. A failure mid-way is sent
        as an error event."""
        try:
            if job.chat:
                for i in range(len(streams)):
                    yield sse(api.chunk(job, rid, self.name, None, first=True, index=i))
            offsets = [0] * len(streams)
            async for i, (piece, tokens, logprobs, finish) in merged([self.pieces(s) for s in streams]):
                lp = self.logprobs(job, tokens, logprobs, offsets[i])
                if piece:
                    yield sse(api.chunk(job, rid, self.name, piece, lp, index=i))
                    offsets[i] += len(piece)
                if finish:
                    yield sse(api.chunk(job, rid, self.name, None, None if piece else lp, finish=finish, index=i))
            if job.include_usage:
                use = api.usage(len(job.prompt), sum(len(stream.request.generated) for stream in streams))
                yield sse(api.usage_chunk(job, rid, self.name, use))
        except Exception as err:  # the engine stopped, or a step failed: say so in the stream
            yield sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    async def pieces(self, stream: Stream) -> AsyncIterator[tuple[str, list[int], list, Optional[str]]]:
        """The request's text as it grows: (new text, the tokens that made it, their logprobs, finish reason or
        None). Whole characters only; EOS not shown; the text ends before a stop string; what may begin a stop
        string waits for the next tokens."""
        request = stream.request
        decoder, stops, eos = stream_decoder(self.tokenizer), StopStrings(request.stop), eos_ids(request.eos_token_id)
        tokens, logprobs = [], []
        counted = stream.counted
        try:
            guide = request.guide  # structured output: it says what ends the text (an EOS id may be text there)
            async for out in stream:
                counted.token(out.time)
                piece = ""
                ending_eos = out.token in eos if guide is None else out.finished and guide.ended_by_eos
                if not ending_eos:
                    tokens.append(out.token)
                    logprobs += [out.logprobs] if out.logprobs is not None else []
                    piece = stops.push(decoder.push(out.token))
                finish = None
                if out.finished:
                    piece += stops.push(decoder.flush()) + stops.flush()
                    ended = out.token in eos if guide is None else guide.ended  # else: max_tokens came first
                    finish = "stop" if ended or stops.stopped else "length"
                    counted.finish(finish)
                if piece or finish:
                    yield piece, tokens, logprobs, finish
                    tokens, logprobs = [], []
        except Exception as err:  # the step failed (a learner's part), or the server stopped (Busy); a client
            counted.finish("abort" if isinstance(err, Busy) else "error")  # that went away: generate's abort()
            raise

    def logprobs(self, job: api.Job, tokens: list[int], logprobs: list, offset: int) -> Optional[dict]:
        if job.logprobs is None:
            return None
        if job.chat:
            return api.chat_logprobs(self.tokenizer, tokens, logprobs)
        return api.completion_logprobs(self.tokenizer, tokens, logprobs, offset)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):  # in constant time: no key guessing by timing
            raise api.APIError(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the server's --api-key",
                status=401,
                kind="authentication_error",
                code="invalid_api_key",
            )


class EventStream(Response):
    """A `text/event-stream` response that stops as soon as the client disconnects (and then calls
    `on_close`, which aborts the request), whether a token is on its way or the request still waits."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        self.status_code, self.background = 200, None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})  # no body: no content-length
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def produce():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await finished_before_disconnect(asyncio.ensure_future(produce()), receive)
        except OSError:  # the connection broke while sending
            pass
        finally:
            self.on_close()


async def finished_before_disconnect(task: asyncio.Future, receive) -> bool:
    """Wait for `task` or the client's disconnect, whichever comes first (the task is cancelled then)."""

    async def disconnected():
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # raise what it raised
    return True


async def merged(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index of the iterator, item) for the items of several async iterators, as each comes (the choices of one
    request, n > 1). The first exception any of them raises is raised here; closing this closes them all.

        >>> async def count(n):
        ...     for i in range(n):
        ...         yield i
        >>> async def collect():
        ...     return sorted([pair async for pair in merged([count(2), count(1)])])
        >>> asyncio.run(collect())
        [(0, 0), (0, 1), (1, 0)]
    """
    if len(iterators) == 1:  # one choice: no task, no queue
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def drain(i: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((i, item))
            await queue.put((i, end))
        except Exception as err:
            await queue.put((i, err))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


async def error_response(request: Request, err: api.APIError) -> Response:
    headers = {"retry-after": RETRY_AFTER} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def http_error(request: Request, err: HTTPException) -> Response:
    messages = {404: f"no route {request.url.path}: the routes are /v1/completions, /v1/chat/completions, "
               "/v1/models, /tokenize, /detokenize, /metrics, /health and / (the chat page)",
               405: f"{request.method} is not allowed on {request.url.path}"}  # fmt: skip
    message = messages.get(err.status_code, err.detail)
    return JSONResponse(api.APIError(message, status=err.status_code).body(), status_code=err.status_code)
