"""What the server takes from a client it does not trust, and how it refuses the rest.

A body must be JSON sent as such (`check_content_type`: 415 otherwise, so that another site's page cannot send a
"simple" cross-origin request without asking first), at most MAX_BODY bytes (`read_body`: 413), UTF-8 text nested at
most MAX_DEPTH levels with no lone surrogate in a string or a field name (`parse_json`: 400 naming what is wrong).
`Guard`, the app's outer layer, answers cross-origin requests by `--allowed-origins` (403 otherwise), turns a client
that went away mid-body into one info line, and any unexpected exception into a generic 500 (its text only in the
log).

    >>> parse_json(b'{"prompt": "hi"}')
    {'prompt': 'hi'}
    >>> parse_json(b'{"prompt": "\\ud800"}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmcourse.serving.openai_api.APIError: prompt holds a lone surrogate (...): strings must be Unicode text
"""

from __future__ import annotations

import json
import logging
import re
from typing import Iterable, Optional
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from . import openai_api as api

MAX_BODY = 1 << 20  # bytes: a request body larger than this is refused (413) before it is read
MAX_DEPTH = 32  # levels of JSON nesting a body may have (a request needs 4)
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: what a JSON "\\ud800" decodes to, not Unicode text
logger = logging.getLogger("llmcourse.server")


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
