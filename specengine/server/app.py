"""The rollout server's FastAPI app over an :class:`~specengine.AsyncSpecEngine`
(docs/design.md "Server").

``POST /generate`` runs one request and answers its ``GenerationOutput`` as JSON (plus its
``request_id``), or with ``"stream": true`` server-sent events: one ``data: {json}`` per
engine step (the request's ``RequestOutput``: ``new_token_ids``, ``finished``, ``output``
on the last), then ``data: [DONE]``. A client that disconnects aborts its request (KV blocks
freed at once). ``POST /abort`` ends a request by id. The weight endpoints mirror
``SpecEngine``'s methods and run on the engine thread between two steps
(``run_in_engine``), so an update lands while other requests stream. ``GET /health`` and
``GET /metrics`` (Prometheus text). Errors: ``specengine.server.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response

from specengine.async_engine import AsyncSpecEngine
from specengine.config import MAX_K
from specengine.core.auto_k import DEFAULT_K_MAX, resolve_k
from specengine.engine import SpecEngine
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.server.errors import BearerAuth, install_error_handlers, status_for
from specengine.server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit, check_max_body_bytes
from specengine.server.memory_api import register_memory_api
from specengine.server.metrics import CONTENT_TYPE, ServerMetrics, read_engine
from specengine.server.openai_api import register_openai_api
from specengine.server.schemas import (
    AbortRequest,
    GenerateRequest,
    InitWeightUpdateGroupRequest,
    LoadWeightsRequest,
    UpdateWeightsFromDistributedRequest,
)
from specengine.server.sglang_api import mount as mount_sglang
from specengine.server.streams import EventStream, unless_disconnected
from specengine.server.vllm_api import mount as mount_vllm
from specengine.weights.staged import StagedUpdate

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ServerState:
    """What the endpoints share: the engine, the default k (and k_max of ``"auto"``, or the
    draft's own tree of ``default_tree`` drafts), the metrics, the ids of the requests in
    flight over HTTP, and whether shutdown has begun (new requests refused)."""

    engine: AsyncSpecEngine
    default_k: int | str
    metrics: ServerMetrics
    live: set[str] = field(default_factory=set)
    draining: bool = False
    default_k_max: int = DEFAULT_K_MAX
    default_tree: int | None = None

    def draft_args(self, k: int | str | None, k_max: int | None
                   ) -> tuple[int | str, int, int | None]:
        """``(k, k_max, tree)`` of a request that gave ``k`` / ``k_max`` (None: not given).
        A request that gives no k gets the server's defaults, its tree included; one that
        gives k drafts a chain of k (vLLM's and SGLang's servers fix the draft shape at
        launch; this one lets a request choose its chain)."""
        if k is None:
            return (self.default_k, self.default_k_max if k_max is None else k_max,
                    self.default_tree)
        return k, self.default_k_max if k_max is None else k_max, None

    async def abort_all(self) -> int:
        """Abort every request in flight (each handler then answers its partial output with
        ``finish_reason="abort"``). Returns how many were aborted."""
        n = 0
        for rid in list(self.live):
            with contextlib.suppress(ValueError):  # finished meanwhile
                await self.engine.abort(rid)
                n += 1
        return n


def output_dict(request_id: str, out: GenerationOutput) -> dict[str, Any]:
    return {"request_id": request_id, **dataclasses.asdict(out)}


def failed_message(request_id: str, out: GenerationOutput) -> str:
    """The error answer of a request that finished with ``finish_reason="error"``."""
    return (f"request {request_id!r} failed in the engine after {len(out.token_ids)} tokens: "
            f"{out.error}")


def json_response(obj: object, status_code: int = 200) -> Response:
    # Python's encoder: a (rare) -inf logprob is written as -Infinity rather than failing.
    return Response(json.dumps(obj), status_code=status_code, media_type="application/json")


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _step_dict(out: RequestOutput) -> dict[str, Any]:
    return {"request_id": out.request_id, "new_token_ids": list(out.new_token_ids),
            "finished": out.finished, "restarted": out.restarted,
            "output": None if out.output is None else dataclasses.asdict(out.output)}


async def _final(stream: AsyncIterator[RequestOutput]) -> GenerationOutput:
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:
            if out.output is not None:
                return out.output
    raise AssertionError("a stream ends with a finished output")  # pragma: no cover


async def _events(state: ServerState, rid: str, stream: AsyncIterator[RequestOutput],
                  first: RequestOutput) -> AsyncIterator[bytes]:
    done = False
    try:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            out = first
            while True:
                if out.output is not None:
                    done = True
                    state.metrics.observe_finished(out.output)
                    if out.output.finish_reason == "error":  # it alone failed in the engine
                        state.metrics.observe_error(500)
                        yield _event({"error": failed_message(rid, out.output),
                                      "status_code": 500})
                        return
                yield _event(_step_dict(out))
                if done:
                    break
                out = await anext(stream)
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client went away
        if not done:
            state.metrics.disconnects.inc()
        raise
    except Exception as exc:  # the 200 header is out: the error is the last event
        status = status_for(exc)
        state.metrics.observe_error(status)
        if status == 500:
            logger.error("stream of request %r failed", rid, exc_info=exc)
        yield _event({"error": str(exc), "status_code": status})
    finally:
        state.live.discard(rid)


def build_app(engine: AsyncSpecEngine, *, api_key: str | None = None,
              default_k: int | str = 0, default_k_max: int = DEFAULT_K_MAX,
              default_tree: int | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              served_model_name: str | None = None) -> FastAPI:
    """The server's app over ``engine`` (which it does not close: ``specengine.server.serve``
    does at shutdown). ``api_key``: every endpoint then needs ``Authorization: Bearer
    <api_key>``. ``default_k``: the draft length of requests that give no ``k`` (an int, or
    ``"auto"``: each step's k in 0..``default_k_max``, as a request's ``"k": "auto"``).
    ``default_tree``: those requests verify the draft's own best tree of that many drafts
    instead (``HEAD_DIR/trees.json``; ``SpecEngine.tree_choice``); ``default_k`` must then
    be 0 or the tree's depth.
    ``served_model_name``: the model's name on the OpenAI-compatible routes (default: the
    checkpoint directory's name)."""
    if not isinstance(engine, AsyncSpecEngine):
        raise ValueError(f"engine must be an AsyncSpecEngine, got {type(engine).__name__}")
    try:
        most_k, _ = resolve_k(default_k, default_k_max)
    except ValueError:
        raise ValueError(f"default_k must be an int in [0, {MAX_K}] or \"auto\" and "
                         f"default_k_max an int in [0, {MAX_K}], got {default_k!r} and "
                         f"{default_k_max!r}") from None
    if most_k > 0 and engine.engine.drafter is None:
        raise ValueError(f"default_k={default_k!r} needs a drafter: the engine has none")
    if default_tree is not None:
        if default_k == "auto":
            raise ValueError('default_k="auto" picks a chain length every step; it takes no '
                             "default_tree")
        depth = engine.engine.tree_choice(default_tree).max_depth  # ValueError: no trees
        if default_k not in (0, depth):
            raise ValueError(f"default_k={default_k} disagrees with the depth {depth} of the "
                             f"draft's trees of {default_tree} drafts: give 0 or the depth")
        default_k = 0  # each request verifies its tree at the tree's own depth
    check_max_body_bytes(max_body_bytes)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    state = ServerState(engine, default_k, ServerMetrics(), default_k_max=default_k_max,
                        default_tree=default_tree)
    app = FastAPI(title="specengine rollout server", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    install_error_handlers(app, state.metrics.observe_error)
    # 413 past max_body_bytes while the body arrives (server.limits); auth, added next, is
    # the outer middleware, so an unauthenticated client gets 401 first.
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes,
                       on_error=state.metrics.observe_error)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, on_error=state.metrics.observe_error)

    async def on_engine(fn: Callable[[SpecEngine], T]) -> T:
        """``fn(engine)`` on the engine thread between steps; the engine's own state errors
        (a plain ``RuntimeError``: no weight group yet, one already joined) are 409s."""
        try:
            return await engine.run_in_engine(fn)
        except RuntimeError as exc:
            if type(exc) is RuntimeError:
                raise HTTPException(409, str(exc)) from exc
            raise

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if state.draining:
            raise HTTPException(503, "the server is shutting down: no new requests")
        params = body.sampling_params.to_params() if body.sampling_params else None
        k, k_max, tree = state.draft_args(body.k, body.k_max)
        rid = body.request_id or f"http-{uuid.uuid4().hex}"
        if rid in state.live:
            raise ValueError(f"request_id {rid!r} is already used by an unfinished request")
        stream = engine.generate_stream(body.prompt_value(), params, k=k, tree=tree,
                                        request_id=rid, k_max=k_max)
        state.live.add(rid)
        if not body.stream:
            try:
                done, out = await unless_disconnected(_final(stream), request)
            finally:
                state.live.discard(rid)
            if not done or out is None:
                state.metrics.disconnects.inc()
                return Response(status_code=499)  # client closed the request; unread
            state.metrics.observe_finished(out)
            if out.finish_reason == "error":  # it alone failed inside a step; others went on
                state.metrics.observe_error(500)
                return json_response({"error": failed_message(rid, out)}, status_code=500)
            return json_response(output_dict(rid, out))
        try:  # bad input fails here, before any byte is sent
            done, first = await unless_disconnected(anext(stream), request)
        except BaseException:
            state.live.discard(rid)
            raise
        if not done or first is None:  # the client left while it waited for its first step
            state.live.discard(rid)
            state.metrics.disconnects.inc()
            return Response(status_code=499)
        return EventStream(_events(state, rid, stream, first), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    @app.post("/abort")
    async def abort(body: AbortRequest) -> Response:
        rid = body.request_id
        if rid not in state.live:
            raise HTTPException(404, f"no unfinished request with id {rid!r}")
        try:
            out = await engine.abort(rid)
        except ValueError as exc:  # it finished meanwhile
            raise HTTPException(404, str(exc)) from exc
        assert out.output is not None
        return json_response(output_dict(rid, out.output))

    async def off_loop(what: str, stage: Callable[[SpecEngine], StagedUpdate]) -> Any:
        """A weight operation whose waiting part (``stage``: reading a checkpoint, a
        rendezvous, a transfer) runs in a worker thread while the engine keeps stepping, and
        whose commit runs on the engine thread between two steps. Shielded: a caller that
        goes away cannot strand a staged update (its commit or discard still runs, so the
        weight lock is released)."""
        async def run() -> Any:
            try:
                staged = await asyncio.to_thread(stage, engine.engine)
            except RuntimeError as exc:  # busy, no group, already joined: the engine's state
                if type(exc) is RuntimeError:
                    raise HTTPException(409, str(exc)) from exc
                raise
            try:
                return await on_engine(lambda e: e.commit_staged(staged))
            finally:
                staged.discard()  # a no-op once committed
        logger.debug("weight operation %s off the step loop", what)
        return await asyncio.shield(asyncio.ensure_future(run()))

    @app.post("/load_weights")
    async def load_weights(body: LoadWeightsRequest) -> Response:
        version = await off_loop("load_weights", lambda e: e.stage_weights(
            body.path, which=body.which, version=body.version,
            check_finite=body.check_finite))
        return json_response({"weight_version": version})

    @app.post("/init_weight_update_group")
    async def init_weight_update_group(body: InitWeightUpdateGroupRequest) -> Response:
        await off_loop("init_weight_update_group", lambda e: e.stage_weight_update_group(
            body.master_address, body.master_port, body.rank, body.world_size,
            backend=body.backend, timeout_s=body.timeout_s))
        return json_response({"ok": True})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest
                                              ) -> Response:
        version = await off_loop("update_weights_from_distributed",
                                 lambda e: e.stage_weights_from_distributed(
                                     which=body.which, src_rank=body.src_rank,
                                     staging=body.staging, check_finite=body.check_finite))
        return json_response({"weight_version": version})

    @app.post("/close_weight_update_group")
    async def close_weight_update_group() -> Response:
        await on_engine(lambda e: e.close_weight_update_group())
        return json_response({"ok": True})

    @app.get("/health")
    async def health() -> Response:
        if not engine.thread.is_alive():
            raise HTTPException(503, "the engine thread is not running")
        if state.draining:
            raise HTTPException(503, "the server is shutting down")
        return json_response({"status": "ok", "num_unfinished": engine.num_unfinished,
                              "weight_version": engine.engine.weight_version})

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = await engine.run_in_engine(read_engine)
        return Response(state.metrics.render(snap, engine.num_unfinished),
                        media_type=CONTENT_TYPE)

    # /v1/models, /v1/completions, /v1/chat/completions
    register_openai_api(app, state, served_model_name)
    register_memory_api(app, state)  # /sleep, /wake_up, /is_sleeping, SGLang's release/resume
    # SGLang's native API and n > 1 on /generate (GRPO groups); it takes over /generate and
    # /update_weights_from_distributed, serving our bodies through the routes above.
    mount_sglang(app)
    mount_vllm(app)  # /get_world_size, /server_info, /reset_prefix_cache
    return app


__all__ = ["ServerState", "build_app", "output_dict"]
