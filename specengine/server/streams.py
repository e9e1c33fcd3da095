"""What every HTTP dialect's streamed and awaited answers share (``server.app``,
``server.openai_api``, ``server.sglang_api``): a streamed response that closes its event
generator however it ends, and awaiting work only while its client is still there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class EventStream(StreamingResponse):
    """Closes its event generator however the response ends (a client that went away
    cancels the send, possibly while the generator waits at a ``yield``), so its requests are
    aborted now rather than when the generator is collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], request: Request) -> tuple[bool, T | None]:
    """``(True, await work)``, or ``(False, None)`` with ``work`` cancelled (its requests
    aborted) when the client disconnects first: nobody would read the answer."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return (False, None) if task.cancelled() else (True, task.result())


__all__ = ["EventStream", "disconnected", "unless_disconnected"]
