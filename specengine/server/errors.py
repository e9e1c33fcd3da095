"""Error responses and bearer-token auth of the rollout server.

Every error is JSON ``{"error": "what and why"}`` with a 4xx status for the client's mistakes
(400: malformed JSON or a value the engine refuses, with the engine's own message; 401: no
or a wrong bearer token; 404: unknown route or request id; 409: the engine is not in a state
for the call; 422: the body does not fit the schema) and a 5xx for the server's (503: the
engine is overloaded, closed or shutting down; 500: a bug, logged with its traceback). No
error escapes a handler into uvicorn, and none ends the engine thread.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specengine.async_loop import EngineClosedError, EngineOverloadedError
from specengine.core.kv_cache import KVCacheFullError
from specengine.core.sleep import EngineAsleepError
from specengine.weights.protocol import WeightSyncError

logger = logging.getLogger(__name__)


def error_response(status_code: int, message: str, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status_code, headers=headers)


REFUSALS = (ValueError, KVCacheFullError, WeightSyncError, EngineOverloadedError,
            EngineClosedError, EngineAsleepError)


def status_for(exc: BaseException) -> int:
    """The HTTP status of an error raised by the engine for one request."""
    if isinstance(exc, (EngineOverloadedError, EngineClosedError, EngineAsleepError)):
        return 503
    if isinstance(exc, (ValueError, KVCacheFullError, WeightSyncError)):
        return 400  # the request's own input (the engine checked it and changed nothing)
    return 500


def describe_validation(exc: RequestValidationError) -> tuple[int, str]:
    """Status and one-line message for a body that is not JSON (400) or does not fit the
    schema (422): every error as ``where: what``."""
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return 400, f"malformed JSON body: {ctx.get('error', err.get('msg'))}"
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        elif not loc and err.get("type") in ("missing", "model_attributes_type",
                                             "model_type", "dict_type"):
            parts.append("the body must be a JSON object")
        elif err.get("type") == "missing":
            parts.append(f"{loc}: required field missing")
        else:
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            got = json.dumps(err.get("input"), default=repr)[:80]
            parts.append(f"{loc + ': ' if loc else ''}{msg} (got {got})")
    return 422, "; ".join(parts) or "invalid request body"


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Turn every exception into a JSON error response; ``on_error(status)`` counts them.
    Also reads every body as JSON whatever its Content-Type (:class:`JSONBodies`): FastAPI
    would otherwise hand a JSON body sent without ``application/json`` to the schema as
    bytes, whose error ("the body must be a JSON object") would be false."""
    app.add_middleware(JSONBodies)

    def respond(status: int, message: str, headers: dict[str, str] | None = None
                ) -> JSONResponse:
        on_error(status)
        return error_response(status, message, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(*describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = "no such endpoint"
        return respond(exc.status_code, detail, getattr(exc, "headers", None))

    async def _refused(_: Request, exc: Exception) -> JSONResponse:
        return respond(status_for(exc), str(exc))

    # Registered per class: these go through Starlette's ExceptionMiddleware and end there;
    # only the catch-all 500 passes ServerErrorMiddleware, which also logs it.
    for cls in REFUSALS:
        app.add_exception_handler(cls, _refused)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return respond(500, f"internal error: {type(exc).__name__}: {exc}")


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/")
                                            and media.endswith(b"+json"))


class JSONBodies:
    """ASGI middleware: an HTTP request whose Content-Type is missing or not JSON (``curl
    -d`` sends ``application/x-www-form-urlencoded``) is passed on as ``application/json``.
    Every endpoint takes a JSON body, so its body is parsed as one: JSON is served, and
    anything else is the usual "malformed JSON body" 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [(n, v) for n, v in scope.get("headers", ()) if n != b"content-type"]
            given = [v for n, v in scope.get("headers", ()) if n == b"content-type"]
            if len(given) != 1 or not _is_json(given[0]):
                scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


class BearerAuth:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <api_key>`` (the
    scheme name in any case, as HTTP's are case-insensitive; the token compared in constant
    time); otherwise 401 before the body is read or routed."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: Callable[[int], None]) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = api_key.encode()
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.strip().partition(b" ")
        bearer = scheme.lower() == b"bearer"
        # RFC 9110: one or more spaces after the scheme; compared even when the scheme is
        # wrong, so the time taken says nothing about the token.
        if hmac.compare_digest(token.lstrip(b" "), self._expected) and bearer:
            await self.app(scope, receive, send)
            return
        self._on_error(401)
        why = ("missing Authorization header" if not given else
               "wrong bearer token" if bearer else "not a Bearer scheme")
        response = error_response(
            401, f"unauthorized: {why}; send 'Authorization: Bearer <api key>'",
            headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


__all__ = ["BearerAuth", "JSONBodies", "describe_validation", "error_response",
           "install_error_handlers", "status_for"]
