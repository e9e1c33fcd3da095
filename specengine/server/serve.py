"""Running the rollout server (``specengine serve``): uvicorn over ``build_app``, with a clean
shutdown.

On SIGTERM or SIGINT the server stops accepting connections and refuses new requests (503);
requests in flight get ``shutdown_timeout_s`` to finish, then are aborted (each still gets
its answer: the partial output with ``finish_reason="abort"``, or a stream's last event and
``[DONE]``); then the engine is closed (its thread joined, every KV block freed) and
:func:`serve` returns, so the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from specengine.async_engine import AsyncSpecEngine
from specengine.core.auto_k import DEFAULT_K_MAX
from specengine.server import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT
from specengine.server.app import ServerState, build_app
from specengine.server.limits import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)


class RolloutServer(uvicorn.Server):
    """``uvicorn.Server`` with the shutdown above. ``ready`` is set once it listens (then
    :attr:`port` is the bound port, also when asked for port 0); ``should_exit = True`` from
    any thread stops it like a signal does."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float = 10.0) -> None:
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ready = threading.Event()

    @property
    def state(self) -> ServerState:
        app = self.config.app
        if not isinstance(app, FastAPI):
            raise TypeError("RolloutServer serves an app made by build_app")
        return app.state.server

    @property
    def port(self) -> int:
        return int(self.servers[0].sockets[0].getsockname()[1])

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()

    async def shutdown(self, sockets: Any = None) -> None:
        state = self.state
        state.draining = True
        aborter = asyncio.ensure_future(self._abort_after(state, self.shutdown_timeout_s))
        try:
            await super().shutdown(sockets)  # closes the listener, waits for the connections
        finally:
            aborter.cancel()

    @staticmethod
    async def _abort_after(state: ServerState, delay_s: float) -> None:
        if state.live:
            logger.info("shutting down: %d requests in flight get %.3g s to finish",
                        len(state.live), delay_s)
        await asyncio.sleep(delay_s)
        n = await state.abort_all()
        if n:
            logger.info("shutting down: aborted %d requests still in flight", n)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured signal once serving ended, so SIGTERM would still
        # kill the process (status -15) after the clean shutdown: handle it, exit normally.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(engine: AsyncSpecEngine, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                api_key: str | None = None, default_k: int | str = 0,
                default_k_max: int = DEFAULT_K_MAX, default_tree: int | None = None,
                shutdown_timeout_s: float = 10.0,
                log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                served_model_name: str | None = None) -> RolloutServer:
    """A :class:`RolloutServer` for ``engine`` (not started: ``await server.serve()``, or
    ``server.run()`` in a thread). ``api_key`` None reads ``$SPECENGINE_API_KEY``;
    ``default_k`` / ``default_k_max`` / ``default_tree`` / ``max_body_bytes`` /
    ``served_model_name``: ``build_app``'s."""
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if not shutdown_timeout_s >= 0:
        raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s!r}")
    if api_key is None and not _is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach it can "
                       "generate and replace the weights (set --api-key)", host)
    app = build_app(engine, api_key=api_key, default_k=default_k, default_k_max=default_k_max,
                    default_tree=default_tree, max_body_bytes=max_body_bytes,
                    served_model_name=served_model_name)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            access_log=False)
    return RolloutServer(config, shutdown_timeout_s=shutdown_timeout_s)


def serve(engine: AsyncSpecEngine, **options: Any) -> None:
    """Serve ``engine`` until SIGTERM / SIGINT (options: :func:`make_server`), then close it."""
    server = make_server(engine, **options)
    asyncio.run(_serve_then_close(server, engine))


def serve_main(args: Any) -> int:
    """``specengine serve`` with parsed ``args`` (``specengine.cli``); returns the exit
    status once the server has shut down."""
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from specengine.engine import SpecEngine

    logging.getLogger("specengine").setLevel(args.log_level.upper())
    model, draft = args.model, args.draft
    if model is None:  # the bundled pair, as `specengine generate`
        model = Path(DEFAULT_TARGET)
        if draft is None and (Path(DEFAULT_DRAFT) / "config.json").is_file():
            draft = str(DEFAULT_DRAFT)
    if not model.is_dir():
        raise ValueError(f"--model {model}: no such directory")
    drafts = args.k_max > 0 if args.k == "auto" else args.k > 0
    if drafts and draft is None:
        raise ValueError(f"--k {args.k} needs a drafter: give --draft (or --k 0)")
    engine = SpecEngine(model, draft=draft, device=None if args.device == "auto" else args.device,
                        dtype=args.dtype, kernel_backend=args.kernel_backend, seed=args.seed,
                        max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
                        num_threads=args.threads, kv_on_update=args.kv_on_update,
                        max_policy_lag=args.max_policy_lag,
                        policy_lag_action=args.policy_lag_action)
    aeng = AsyncSpecEngine(engine, max_waiting=args.max_waiting)
    try:
        server = make_server(aeng, host=args.host, port=args.port, api_key=args.api_key,
                             default_k=args.k, default_k_max=args.k_max,
                             default_tree=args.tree, shutdown_timeout_s=args.shutdown_timeout,
                             log_level=args.log_level,
                             max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                             served_model_name=args.served_model_name)
    except BaseException:
        asyncio.run(aeng.close())
        raise
    asyncio.run(_serve_then_close(server, aeng))
    return 0


async def _serve_then_close(server: RolloutServer, engine: AsyncSpecEngine) -> None:
    try:
        await server.serve()
    finally:
        await engine.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["API_KEY_ENV", "RolloutServer", "make_server", "serve", "serve_main"]
