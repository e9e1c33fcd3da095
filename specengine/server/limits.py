"""Bounded work before admission: the rollout server's request-body size limit.

Without it a client can make the server buffer, then JSON-parse, a body of any size (a 50 MB
prompt held the whole body, its parse and its tokenization at once). :class:`BodySizeLimit`
answers 413 with a JSON ``{"error": ...}`` for a body over ``max_body_bytes``:

- at once, before reading a byte of it, when ``Content-Length`` says so;
- otherwise (chunked bodies, or a ``Content-Length`` that understates) as soon as the bytes
  received pass the limit, so at most ``max_body_bytes`` plus one chunk is ever held.

The rest of a refused body is read and dropped by the HTTP server (uvicorn discards what
arrives after the response), so the client still gets its 413 on an open connection.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specengine.server.errors import error_response

#: the default limit: a prompt of 32k tokens as JSON ids or text is well under 1 MiB
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def check_max_body_bytes(max_body_bytes: object) -> int:
    """``max_body_bytes`` if it is an int >= 1, else ``ValueError``."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or (
            max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    return max_body_bytes


def too_large(max_body_bytes: int, size: int | None = None) -> str:
    said = f"{size} bytes" if size is not None else f"more than {max_body_bytes} bytes"
    return (f"request body too large: {said}; this server takes at most {max_body_bytes} "
            f"bytes (--max-body-mb)")


class BodySizeLimit:
    """ASGI middleware: 413 for an HTTP request body over ``max_body_bytes`` (see the module
    docstring); ``on_error(413)`` counts each refusal."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_body_bytes = check_max_body_bytes(max_body_bytes)
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            if self._on_error is not None:
                self._on_error(413)
            await error_response(413, too_large(limit, declared))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException passes FastAPI's body reading unchanged (any other
                    # error there becomes a 400) and the app's handler answers it as JSON.
                    raise HTTPException(413, too_large(limit))
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            # The HTTP server already refused a malformed one; be safe regardless.
            return int(value) if value.isdigit() else None
    return None


__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodySizeLimit", "check_max_body_bytes"]
