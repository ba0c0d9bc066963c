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
the problem), and a page of another site gets 403 unless its origin is allowed (`Guard`); a request must arrive
within a deadline (`H11WithDeadline`); parsing and tokenizing run in worker threads, so that the event loop
always answers; a message's text never becomes a special token of the chat template
(`HFTokenizer.encode_chat_plain`); on SIGTERM each request in flight is answered (`LLMServer`). An unexpected
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
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import AsyncIterator, Callable, Iterable, Optional
from urllib.parse import urlsplit

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmcourse.engine.generate import StopStrings
from llmcourse.engine.sampling import eos_ids
from llmcourse.engine.tokenizer import stream_decoder

from . import openai_api as api
from . import tokenize_api
from .async_engine import AsyncEngine, Busy, Stream
from .llm_engine import LLMEngine
from .metrics import MEDIA_TYPE, Metrics

MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413) before it is read
MAX_DEPTH = 32  # levels of JSON nesting a body may have (a request needs 4)
SHUTDOWN_GRACE = 5  # seconds requests in flight get to finish after SIGINT/SIGTERM; then they end (503, error event)
RECEIVE_TIMEOUT = 20  # seconds in which a request's headers and body must arrive (else 408, the connection closes)
KEEP_ALIVE = 5  # seconds an idle connection stays open between requests (uvicorn's default)
RETRY_AFTER = "1"  # seconds, for a client told the server is full (429)
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: what a JSON "\\ud800" decodes to, not Unicode text
logger = logging.getLogger("llmcourse.server")


def build_app(
    engine: LLMEngine,
    tokenizer,
    model_name: str,
    *,
    api_key: Optional[str] = None,
    max_pending: int = 256,
    allowed_origins: Iterable[str] = (),
) -> Starlette:
    """The ASGI app serving `engine`'s model as `model_name`. api_key: required as `Authorization: Bearer KEY` on
    the /v1 routes, /tokenize, /detokenize and /metrics (None: open). max_pending: requests held at once before
    new ones get 429. allowed_origins: the web origins (`https://example.org`, or `*`) whose pages may call the
    server from a browser; any other cross-origin request gets 403 (the chat page is same-origin)."""
    if engine.tokenizer is None:  # stop strings are matched in the text
        engine.tokenizer = tokenizer
    server = Server(engine, tokenizer, model_name, api_key, max_pending)
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

    def __init__(self, engine: LLMEngine, tokenizer, name: str, api_key: Optional[str], max_pending: int):
        self.engine, self.tokenizer, self.name, self.api_key = engine, tokenizer, name, api_key
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

        def prepare() -> api.Job:  # in a worker thread: a 1 MB prompt's tokens take a second or more
            body = parse_json(raw)
            if isinstance(body, dict):
                self.check_model(body.get("model"))
            return make_job(body, self.tokenizer, self.n_positions)

        job = await asyncio.get_running_loop().run_in_executor(self.cpu, prepare)
        try:  # n choices: n requests, choice i seeded seed + i (`LLMEngine.new_choices`)
            engine_requests = self.engine.new_choices(job.prompt, job.n, logprobs=job.logprobs, **job.settings)
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
            async for out in stream:
                counted.token(out.time)
                piece = ""
                if out.token not in eos:
                    tokens.append(out.token)
                    logprobs += [out.logprobs] if out.logprobs is not None else []
                    piece = stops.push(decoder.push(out.token))
                finish = None
                if out.finished:
                    piece += stops.push(decoder.flush()) + stops.flush()
                    finish = "stop" if out.token in eos or stops.stopped else "length"
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


async def read_body(request: Request) -> bytes:
    """The body's bytes, refused when it is not sent as JSON (415) or over MAX_BODY bytes (413)."""
    check_content_type(request.headers.get("content-type"))
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY:
        raise api.APIError(f"the request body is {length} bytes; the limit is {MAX_BODY}", status=413)
    parts, size = [], 0
    async for part in request.stream():
        parts.append(part)
        size += len(part)
        if size > MAX_BODY:
            raise api.APIError(f"the request body is over the limit of {MAX_BODY} bytes", status=413)
    return b"".join(parts)


def check_content_type(value: Optional[str]) -> None:
    """JSON bodies only: `Content-Type: application/json` (a charset, if given, utf-8). Anything else gets 415, so
    that a web page cannot send the server a "simple" cross-origin request (a form or text/plain POST, which
    browsers send without asking the server first)."""
    media, _, params = (value or "").partition(";")
    pairs = (p.partition("=")[::2] for p in params.split(";") if "=" in p)
    charset = {k.strip().lower(): v.strip().strip('"').lower() for k, v in pairs}.get("charset", "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = f"Content-Type {value!r}" if value else "no Content-Type"
        raise api.APIError(
            f"the request body must be JSON sent with 'Content-Type: application/json' (UTF-8); got {shown}",
            status=415,
            code="unsupported_media_type",
        )


def parse_json(body: bytes):
    """The body as JSON: UTF-8, at most MAX_DEPTH levels deep, every string and field name Unicode text (no lone
    surrogates, which no tokenizer takes and no response can show); else 400 saying which."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise api.APIError(f"the request body is not UTF-8 (byte {err.start} is not): send JSON in UTF-8") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise api.APIError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:
        raise api.APIError(f"the request body is not valid JSON ({err})") from None
    check_text(value)
    return value


def check_text(value) -> None:
    """Refuse JSON nested over MAX_DEPTH levels, or holding a lone surrogate in a string or a field name
    (iteratively: a deep body must not exhaust the stack here)."""
    todo = [(value, "the body", 1)]
    while todo:
        item, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise api.APIError(f"the request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            if SURROGATE.search(item):
                raise api.APIError(
                    f"{where} holds a lone surrogate (a \\ud800-\\udfff escape that is not half of a pair): strings "
                    "must be Unicode text",
                    None if where == "the body" else where,
                )
        elif isinstance(item, dict):
            for key, v in item.items():
                if SURROGATE.search(key):
                    raise api.APIError(
                        f"a field name in {where} holds a lone surrogate: field names must be Unicode text"
                    )
                todo.append((v, key if where == "the body" else f"{where}.{key}", depth + 1))
        elif isinstance(item, list):
            todo.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))


async def error_response(request: Request, err: api.APIError) -> Response:
    headers = {"retry-after": RETRY_AFTER} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def http_error(request: Request, err: HTTPException) -> Response:
    messages = {404: f"no route {request.url.path}: the routes are /v1/completions, /v1/chat/completions, "
               "/v1/models, /tokenize, /detokenize, /metrics, /health and / (the chat page)",
               405: f"{request.method} is not allowed on {request.url.path}"}  # fmt: skip
    message = messages.get(err.status_code, err.detail)
    return JSONResponse(api.APIError(message, status=err.status_code).body(), status_code=err.status_code)


INTERNAL_ERROR = {"error": {"message": "internal server error (the server's log says more)", "type": "server_error",
                             "param": None, "code": None}}  # fmt: skip


def check_origins(origins: Iterable[str]) -> frozenset:
    """--allowed-origins' values, each `*` or an origin as browsers send it (`scheme://host[:port]`, no path)."""
    out = set()
    for origin in origins:
        origin = origin.strip().rstrip("/")
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme in ("http", "https") and parts.netloc and not parts.path
                                  and not parts.query and not parts.fragment):  # fmt: skip
            raise ValueError(f"an allowed origin is * or scheme://host[:port] (https://example.org), got {origin!r}")
        out.add(origin.lower())
    return frozenset(out)


class Guard:
    """The app's outer layer (pure ASGI): the cross-origin policy, and what no route should let out.

    CORS: a request whose `Origin` is another site's gets 403 unless that origin is allowed (`--allowed-origins`);
    an allowed one gets `Access-Control-Allow-Origin` and its preflight (OPTIONS) is answered. Same-origin
    requests (the chat page) and clients that send no Origin (curl, the openai client) pass.
    A client that disconnected while its request was read is one info line; any other exception a generic 500
    (its text only in the log, never in the body)."""

    ALLOW_HEADERS = "authorization, content-type"

    def __init__(self, app, allowed_origins: frozenset = frozenset()):
        self.app, self.allowed = app, allowed_origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin, extra = headers.get("origin"), []
        if origin is not None and urlsplit(origin).netloc.lower() != headers.get("host", "").lower():
            if "*" not in self.allowed and origin.lower().rstrip("/") not in self.allowed:
                error = api.APIError(
                    f"cross-origin requests from {origin} are not allowed: start the server with --allowed-origins "
                    f"{origin} to let that site's pages call it",
                    status=403,
                    kind="permission_error",
                    code="origin_not_allowed",
                )
                return await JSONResponse(error.body(), status_code=403)(scope, receive, send)
            extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                preflight = {"access-control-allow-methods": "GET, POST", "access-control-max-age": "600",
                             "access-control-allow-headers": self.ALLOW_HEADERS}  # fmt: skip
                response = Response(status_code=204, headers=preflight)
                response.raw_headers += extra
                return await response(scope, receive, send)
        started = False

        async def send_with_cors(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_cors)
        except ClientDisconnect:
            client = scope.get("client") or ("?", 0)
            logger.info("%s:%s went away while sending its request to %s", *client[:2], scope["path"])
        except Exception as err:
            logger.error(
                "internal error on %s %s: %s", scope["method"], scope["path"], type(err).__name__, exc_info=err
            )
            if not started:
                await JSONResponse(INTERNAL_ERROR, status_code=500)(scope, receive, send)


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
