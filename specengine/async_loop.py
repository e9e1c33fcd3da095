"""The engine thread behind ``AsyncSpecEngine`` (``specengine.async_engine``).

``EngineLoop`` owns the wrapped ``SpecEngine`` and is the only thread that touches it. Callers
hand it commands (add, cancel, abort, call) through a deque guarded by a condition variable;
the thread drains them between steps, runs ``step()`` while requests are unfinished and blocks
on the condition when idle. A step's outputs go back to their callers' loops with one
``loop.call_soon_threadsafe`` per loop per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from specengine.engine import SpecEngine
from specengine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The async engine was closed (or its thread died) before the request finished."""


class EngineOverloadedError(RuntimeError):
    """``max_waiting`` requests are already unfinished: the new one was not added."""


@dataclass(eq=False)
class Channel:
    """Where one request's outputs go: its caller's loop and queue (identity matters: a
    request id may be reused once its previous request is done)."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)


class EngineLoop:
    """The command queue, the unfinished requests' channels and the thread that steps the
    engine. ``register`` / ``send`` / ``call`` / ``request_close`` are safe from any thread."""

    def __init__(self, engine: SpecEngine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: deque[tuple[str, Any]] = deque()
        self._live: dict[str, Channel] = {}  # unfinished requests (queued or in the engine)
        self._closed = False
        self._ids = itertools.count()
        self._num_threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name="specengine-async", daemon=True)
        self.thread.start()

    @property
    def num_unfinished(self) -> int:
        """Registered requests not yet finished, aborted or failed."""
        with self._cond:
            return len(self._live)

    def request_close(self) -> None:
        """Ask the thread to shut down (it aborts what is unfinished, then exits)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def register(self, request_id: str | None, loop: asyncio.AbstractEventLoop) -> Channel:
        """Reserve ``request_id`` (default: a fresh one) and a channel on ``loop``; raises when
        closed, at ``max_waiting``, or for an id in use. Nothing is queued here."""
        with self._cond:
            if self._closed:
                raise EngineClosedError("the async engine is closed")
            if len(self._live) >= self.max_waiting:
                raise EngineOverloadedError(
                    f"{len(self._live)} requests are unfinished (max_waiting="
                    f"{self.max_waiting}): retry when some have finished")
            if request_id is None:
                request_id = f"async-{next(self._ids)}"
                while request_id in self._live:
                    request_id = f"async-{next(self._ids)}"
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
            elif request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                                 "request")
            ch = self._live[request_id] = Channel(request_id, loop)
            return ch

    def register_group(self, request_id: str | None, n: int, loop: asyncio.AbstractEventLoop
                       ) -> list[Channel]:
        """Reserve the ids of the ``n`` samples of one group (``f"{request_id}-{i}"``, the
        names ``SpecEngine.add_request`` gives them; default: a fresh ``request_id``) and
        one channel per sample, all on one queue. Each sample is a sequence: the group takes
        ``n`` of the ``max_waiting`` slots. Nothing is queued here."""
        with self._cond:
            if self._closed:
                raise EngineClosedError("the async engine is closed")
            if n > self.max_waiting:  # no retry would ever fit it
                raise ValueError(f"n={n} samples exceed max_waiting={self.max_waiting} "
                                 "(the unfinished sequences this engine holds)")
            if len(self._live) + n > self.max_waiting:
                raise EngineOverloadedError(
                    f"{len(self._live)} requests are unfinished and a group of n={n} would "
                    f"pass max_waiting={self.max_waiting}: retry when some have finished")
            if request_id is None:
                while True:
                    request_id = f"async-{next(self._ids)}"
                    if not any(f"{request_id}-{i}" in self._live for i in range(n)):
                        break
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
            ids = [f"{request_id}-{i}" for i in range(n)]
            used = [rid for rid in ids if rid in self._live]
            if used:
                raise ValueError(f"request ids {used[:3]} of the {n} samples of {request_id!r} "
                                 "are already used by unfinished requests")
            queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
            chs = [Channel(rid, loop, queue) for rid in ids]
            for ch in chs:
                self._live[ch.request_id] = ch
            return chs

    def release(self, ch: Channel) -> None:
        """Forget ``ch`` before it was sent to the engine (its prompt was refused by the
        caller's own checks), so its id and ``max_waiting`` slot are free at once."""
        with self._cond:
            if self._live.get(ch.request_id) is ch:
                del self._live[ch.request_id]

    def send(self, kind: str, payload: object) -> None:
        """Queue ``add`` (channels, request id, prompt, params, k, tree, k_max: one channel,
        or a group's from :meth:`register_group`) or ``cancel`` (channel)."""
        with self._cond:
            self._commands.append((kind, payload))
            self._cond.notify()

    def call(self, kind: str, payload: object) -> cf.Future[Any]:
        """Queue ``abort`` (of a request id) or ``call`` (of ``fn(engine)``); the future gets
        the result or error."""
        fut: cf.Future[Any] = cf.Future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the async engine is closed")
            self._commands.append((kind, (payload, fut)))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        # OpenMP keeps its thread count per OS thread: use the one the engine chose.
        torch.set_num_threads(self._num_threads)
        try:
            while self._serve_once():
                pass
        except BaseException as exc:  # the thread dies: nobody may wait forever
            logger.exception("specengine async engine thread died")
            with self._cond:
                self._closed = True
            self._shut_down(EngineClosedError(f"the engine thread died: {exc!r}"))
            raise

    def _serve_once(self) -> bool:
        """Run queued commands, then one step if there is work. False once closed."""
        eng = self.engine
        with self._cond:
            while not self._commands and not self._closed and not eng.has_unfinished():
                self._cond.wait()
            commands, self._commands = self._commands, deque()
            closed = self._closed
        for kind, payload in commands:
            self._command(kind, payload, closed)
        if closed:
            self._shut_down(EngineClosedError("the async engine was closed"))
            return False
        if not eng.has_unfinished():
            return True
        try:
            outs = eng.step()
        except Exception as exc:  # an engine-wide fault: the engine aborted every request
            # (one request's failure arrives as its own output, finish_reason "error")
            logger.error("engine step failed engine-wide; failing %d requests: %r",
                         len(self._live), exc)
            with self._cond:
                failed, self._live = list(self._live.values()), {}
            self._deliver([(ch, exc) for ch in failed])
            return True
        self._deliver_outputs(outs)
        return True

    def _command(self, kind: str, payload: Any, closed: bool) -> None:
        eng = self.engine
        if kind == "add":
            chs, request_id, prompt, params, k, tree, k_max = payload
            with self._cond:
                current = [ch for ch in chs if self._live.get(ch.request_id) is ch]
                if len(current) < len(chs):  # cancelled, or failed by a step error, before
                    for ch in current:       # it was added: the whole group goes
                        del self._live[ch.request_id]
                    return
            try:
                if closed:
                    raise EngineClosedError("the async engine was closed")
                eng.add_request(prompt, params, k=k, tree=tree, request_id=request_id,
                                k_max=k_max)
            except Exception as exc:  # bad input: this caller only (a group: one queue)
                with self._cond:
                    for ch in chs:
                        del self._live[ch.request_id]
                self._deliver([(chs[0], exc)])
        elif kind == "cancel":
            ch = payload
            with self._cond:
                current = self._live.get(ch.request_id) is ch
            if current:
                with contextlib.suppress(ValueError):  # its add failed or was never made
                    eng.abort(ch.request_id)
                with self._cond:
                    del self._live[ch.request_id]
        else:
            arg, fut = payload
            if not fut.set_running_or_notify_cancel():
                return
            try:
                if closed:
                    raise EngineClosedError("the async engine was closed")
                fut.set_result(self._abort(arg) if kind == "abort" else arg(eng))
            except BaseException as exc:
                fut.set_exception(exc)

    def _abort(self, request_id: str) -> RequestOutput:
        with self._cond:
            ch = self._live.get(request_id) if isinstance(request_id, str) else None
        if ch is None:
            raise ValueError(f"request {request_id!r} is not an unfinished request of this "
                             "async engine")
        out = self.engine.abort(request_id)
        self._deliver_outputs([out])
        return out

    def _deliver_outputs(self, outs: list[RequestOutput]) -> None:
        items: list[tuple[Channel, RequestOutput | BaseException]] = []
        with self._cond:
            for out in outs:
                ch = self._live.get(out.request_id)
                if ch is None:  # pragma: no cover - every engine request has a channel
                    logger.warning("output for unknown request %r dropped", out.request_id)
                    continue
                if out.finished:
                    del self._live[out.request_id]
                items.append((ch, out))
        self._deliver(items)

    def _deliver(self, items: list[tuple[Channel, RequestOutput | BaseException]]) -> None:
        """Hand items to their callers' loops, one ``call_soon_threadsafe`` per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Channel, object]]] = {}
        for ch, item in items:
            by_loop.setdefault(ch.loop, []).append((ch, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody listens any more
                for ch, item in batch:
                    if isinstance(item, RequestOutput) and not item.finished:
                        self.send("cancel", ch)

    def _shut_down(self, error: EngineClosedError) -> None:
        """Abort every unfinished request (KV freed) and fail its caller and pending calls."""
        with self._cond:
            live, self._live = list(self._live.values()), {}
            pending, self._commands = list(self._commands), deque()
        for ch in live:
            with contextlib.suppress(ValueError):  # not added yet
                self.engine.abort(ch.request_id)
        for _, payload in pending:
            if isinstance(payload, tuple) and isinstance(payload[-1], cf.Future):
                if payload[-1].set_running_or_notify_cancel():
                    payload[-1].set_exception(EngineClosedError(str(error)))
        self._deliver([(ch, EngineClosedError(str(error))) for ch in live])



def _put_all(batch: list[tuple[Channel, object]]) -> None:
    for ch, item in batch:
        ch.queue.put_nowait(item)  # type: ignore[arg-type]


__all__ = ["EngineClosedError", "EngineLoop", "EngineOverloadedError"]
