"""An OpenAI-compatible HTTP server over `LLMEngine` (`python -m llmcourse serve`), and the chat page at `/`.

What happens when you press Enter in a chat window, from the server's side: the page POSTs the conversation
to `/v1/chat/completions`; the server renders it with the model's chat template, queues the token ids in
the one `LLMEngine` that every connection shares (`AsyncEngine` steps it, so requests join the running
batch), and streams each piece of text back as a server-sent event (`data: {...}\\n\\n`) the moment it is
a whole character and cannot be the start of a stop string; `data: [DONE]` ends the stream. A client that
goes away aborts its request, and its KV blocks return to the pool at once.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not), `GET /v1/models` (and
`/v1/models/NAME`), `GET /health`, `GET /` (the chat page) and `GET /favicon.ico` (its icon). Errors are OpenAI's:
`{"error": {"message", "type", "param", "code"}}`.

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
import threading
import time
from importlib import resources
from typing import AsyncIterator, Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from llmcourse.engine.generate import StopStrings
from llmcourse.engine.sampling import eos_ids
from llmcourse.engine.tokenizer import stream_decoder

from . import openai_api as api
from .async_engine import AsyncEngine, Busy, Stream
from .llm_engine import LLMEngine

MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413) before it is read
SHUTDOWN_GRACE = 5  # seconds that requests in flight get to finish after SIGINT/SIGTERM; then they are cancelled
RETRY_AFTER = "1"  # seconds, for a client told the server is full (429)


def build_app(
    engine: LLMEngine, tokenizer, model_name: str, *, api_key: Optional[str] = None, max_pending: int = 256
) -> Starlette:
    """The ASGI app serving `engine`'s model as `model_name`. api_key: required as `Authorization: Bearer KEY` on
    the /v1 routes (None: open). max_pending: requests held at once before new ones get 429."""
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
    ]
    handlers = {api.APIError: error_response, HTTPException: http_error, Exception: internal_error}
    return Starlette(routes=routes, lifespan=server.lifespan, exception_handlers=handlers)


class Server:
    """The routes' state: the model's name and tokenizer, and the `AsyncEngine` (made when the app starts)."""

    def __init__(self, engine: LLMEngine, tokenizer, name: str, api_key: Optional[str], max_pending: int):
        self.engine, self.tokenizer, self.name, self.api_key = engine, tokenizer, name, api_key
        self.max_pending = max_pending
        self.n_positions = engine.model.config.n_positions
        self.runner: Optional[AsyncEngine] = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        async with AsyncEngine(self.engine, self.max_pending) as runner:
            self.runner = runner
            yield

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
        body = await read_json(request)
        if isinstance(body, dict):
            self.check_model(body.get("model"))
        job = make_job(body, self.tokenizer, self.n_positions)
        try:
            engine_request = self.engine.new_request(job.prompt, logprobs=job.logprobs, **job.settings)
        except ValueError as err:
            raise api.engine_error(err) from None
        try:
            stream = self.runner.submit(engine_request)
        except Busy as err:
            status = 503 if self.runner.stopping else 429
            raise api.APIError(f"{err}; retry shortly", status=status, kind="server_busy") from None
        rid = api.new_id("chatcmpl" if job.chat else "cmpl")
        if job.stream:
            return EventStream(self.events(job, stream, rid), on_close=stream.abort)
        answer = asyncio.ensure_future(self.answer(job, stream, rid))
        try:
            if not await finished_before_disconnect(answer, request.receive):
                stream.abort()  # the client went away: free its blocks now
                return Response(status_code=499)
        except Busy as err:  # the server stopped before the answer was complete
            raise api.APIError(str(err), status=503, kind="server_busy") from None
        return JSONResponse(answer.result())

    async def answer(self, job: api.Job, stream: Stream, rid: str) -> dict:
        """The whole completion, as one response."""
        text, tokens, logprobs, finish = "", [], [], None
        async for piece, new_tokens, new_logprobs, finish in self.pieces(stream):
            text, tokens, logprobs = text + piece, tokens + new_tokens, logprobs + new_logprobs
        use = api.usage(len(job.prompt), len(stream.request.generated))
        lp = self.logprobs(job, tokens, logprobs, 0)
        respond = api.chat_response if job.chat else api.completion_response
        return respond(rid, self.name, text, finish, lp, use)

    async def events(self, job: api.Job, stream: Stream, rid: str) -> AsyncIterator[str]:
        """The server-sent events of a streamed completion: the role (chat), a chunk per piece of text, the
        finish reason, the usage (when asked), [DONE]. A failure mid-way is sent as an error event."""
        try:
            if job.chat:
                yield sse(api.chunk(job, rid, self.name, None, first=True))
            offset = 0
            async for piece, tokens, logprobs, finish in self.pieces(stream):
                lp = self.logprobs(job, tokens, logprobs, offset)
                if piece:
                    yield sse(api.chunk(job, rid, self.name, piece, lp))
                    offset += len(piece)
                if finish:
                    yield sse(api.chunk(job, rid, self.name, None, None if piece else lp, finish=finish))
            if job.include_usage:
                use = api.usage(len(job.prompt), len(stream.request.generated))
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
        async for out in stream:
            piece = ""
            if out.token not in eos:
                tokens.append(out.token)
                logprobs += [out.logprobs] if out.logprobs is not None else []
                piece = stops.push(decoder.push(out.token))
            finish = None
            if out.finished:
                piece += stops.push(decoder.flush()) + stops.flush()
                finish = "stop" if out.token in eos or stops.stopped else "length"
            if piece or finish:
                yield piece, tokens, logprobs, finish
                tokens, logprobs = [], []

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


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


async def read_json(request: Request):
    """The body as JSON, refused when over MAX_BODY bytes (413) or not JSON (400)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY:
        raise api.APIError(f"the request body is {length} bytes; the limit is {MAX_BODY}", status=413)
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise api.APIError(f"the request body is over the limit of {MAX_BODY} bytes", status=413)
    try:
        return json.loads(body)
    except ValueError as err:
        raise api.APIError(f"the request body is not valid JSON ({err})") from None


async def error_response(request: Request, err: api.APIError) -> Response:
    headers = {"retry-after": RETRY_AFTER} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def http_error(request: Request, err: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}: the routes are /v1/completions, /v1/chat/completions, "
               "/v1/models, /health and / (the chat page)", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(err.status_code, err.detail)  # fmt: skip
    return JSONResponse(api.APIError(message, status=err.status_code).body(), status_code=err.status_code)


async def internal_error(request: Request, err: Exception) -> Response:
    body = {"error": {"message": f"internal error: {type(err).__name__}: {err}", "type": "server_error",
                      "param": None, "code": None}}  # fmt: skip
    return JSONResponse(body, status_code=500)


class StopOnSignal(uvicorn.Server):
    """uvicorn's server, except that a graceful stop is the whole answer to SIGINT/SIGTERM: the process then
    exits normally (status 0) instead of raising the signal again once the server is down."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(app: Starlette, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run `app` until SIGINT/SIGTERM; requests in flight get SHUTDOWN_GRACE seconds to finish, then are cancelled."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE)
    StopOnSignal(config).run()


class ServerThread:
    """`app` served by uvicorn in a background thread (tests, benchmarks, notebooks); `url` once started.

    >>> with ServerThread(app) as server:                                           # doctest: +SKIP
    ...     httpx.get(server.url + "/health").json()["status"]
    'ok'
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
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
