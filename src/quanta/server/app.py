"""The Starlette application: routes, the API key, CORS, request counting, and errors as OpenAI error objects.

Public without a key: ``/health`` and the chat page (``/`` and ``/static``); every other route needs
``Authorization: Bearer <key>`` when the server has one. Any failure becomes ``{"error": {...}}`` with its
status (a bug: a 500 whose body says so, its traceback only in the server's log).
"""

from __future__ import annotations

import hmac
import sys
import traceback
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quanta.server.completions import chat_completions, completions, read_json
from quanta.errors import QuantaError
from quanta.server.errors import APIError, internal
from quanta.server.protocol import DetokenizeBody, TokenizeBody, check_token_ids, parse_body
from quanta.server.state import ServerState

STATIC = Path(__file__).parent / "static"
PUBLIC = ("/health", "/static/")
COUNTED = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/metrics")


def build_app(state: ServerState) -> Starlette:
    """The server's ASGI app over ``state`` (whose model may still be loading)."""
    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [Middleware(CountRequests, metrics=state.metrics)]
    if state.config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type"]))
    if state.config.api_key:
        middleware.append(Middleware(RequireKey, key=state.config.api_key))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.quanta = state
    return app


# ---- routes ----------------------------------------------------------------------------------------------------
async def chat_page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


async def health(request: Request) -> Response:
    request.app.state.quanta.ready()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    m = request.app.state.quanta.metrics
    return Response(m.exposition(), media_type=m.content_type)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.quanta
    model = state.ready()
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "quanta",
         "max_model_len": model.n_ctx}]})


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.quanta
    model = state.ready()
    body = parse_body(TokenizeBody, await read_json(request, state.config.max_body_bytes))
    tok = model.tokenizer
    try:
        ids = await run_in_threadpool(tok.encode, body.content, body.add_special, True)
    except QuantaError as e:
        raise APIError(400, f"the content cannot be tokenized: {e}", param="content") from None
    if not body.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": i, "piece": _piece(tok.token_to_piece(i))} for i in ids]})


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not valid UTF-8 on their own (as llama.cpp's server)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.quanta
    model = state.ready()
    body = parse_body(DetokenizeBody, await read_json(request, state.config.max_body_bytes))
    ids = check_token_ids(body.tokens, model.tokenizer.vocab_size, "tokens")
    return JSONResponse({"content": model.tokenizer.decode(ids)})


# ---- errors ----------------------------------------------------------------------------------------------------
async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"Unknown request URL: {request.method} {request.url.path}", "unknown_url"
    elif exc.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response()


async def server_error(request: Request, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)
    return internal().response()


# ---- middleware ------------------------------------------------------------------------------------------------
class RequireKey:
    """401 with OpenAI's invalid_api_key error unless the request carries the server's key (Bearer)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _public(scope["path"]) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.")
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def _public(path: str) -> bool:
    return path == "/" or path.startswith(PUBLIC)


class CountRequests:
    """Counts answered requests by route and status (``quanta_requests_total``)."""

    def __init__(self, app: ASGIApp, metrics: Any):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in COUNTED else "other"
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
