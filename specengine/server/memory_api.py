"""Sleep and wake over HTTP (issue 36; ``SpecEngine.sleep`` / ``wake_up``,
``specengine.core.sleep``), in vLLM's and SGLang's shapes:

- vLLM: ``POST /sleep?level=1|2``, ``POST /wake_up`` (``?tags=weights&tags=kv_cache``, default
  both), ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.
- SGLang: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` with an
  optional JSON body ``{"tags": ["weights", "kv_cache"] | null}``; release is level 2 (SGLang
  keeps no copy of the weights: a weight update refills them).

Each runs on the engine thread between two steps. Answers ``{"success": true, ...}``
(``released_bytes`` for a release); a refusal (requests in flight, a weight operation in
progress, a part already asleep) is a 409 naming why, a bad level or tag a 400. While the
engine sleeps, a generate request is a 503 saying so, and a weight update that needs the
weights is refused the same way.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from specengine.engine import SpecEngine

__all__ = ["MemoryOccupationRequest", "register_memory_api"]

TagsQuery = Annotated[list[str] | None, Query()]  # ?tags=weights&tags=kv_cache


class MemoryOccupationRequest(BaseModel):
    """SGLang's body of ``/release_memory_occupation`` and ``/resume_memory_occupation``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tags: list[str] | None = None


def _json(obj: object) -> Response:
    return Response(json.dumps(obj), media_type="application/json")


async def _tags_body(request: Request) -> list[str] | None:
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return MemoryOccupationRequest.model_validate_json(raw).tags
    except ValidationError as exc:
        raise HTTPException(422, f"body: {exc.errors()[0].get('msg')}") from None


def register_memory_api(app: FastAPI, state: Any) -> None:
    """Add the sleep / wake routes to ``app`` (``state``: the server's ``ServerState``)."""
    aeng = state.engine

    async def on_engine(fn: Any) -> Any:
        try:
            return await aeng.run_in_engine(fn)
        except NotImplementedError as exc:
            raise HTTPException(501, str(exc)) from exc
        except RuntimeError as exc:  # busy, in flight, already asleep: the engine's state
            raise HTTPException(409, str(exc)) from exc

    async def sleep(level: int, tags: list[str] | None) -> dict[str, Any]:
        def run(e: SpecEngine) -> int:
            return e.sleep(level, tags)
        return {"success": True, "released_bytes": await on_engine(run)}

    async def wake(tags: list[str] | None) -> dict[str, Any]:
        def run(e: SpecEngine) -> None:
            e.wake_up(tags)
        await on_engine(run)
        return {"success": True}

    @app.post("/sleep", include_in_schema=False)
    async def sleep_route(level: int = 1, tags: TagsQuery = None) -> Response:
        return _json(await sleep(level, tags))

    @app.post("/wake_up", include_in_schema=False)
    async def wake_up_route(tags: TagsQuery = None) -> Response:
        return _json(await wake(tags))

    @app.get("/is_sleeping", include_in_schema=False)
    async def is_sleeping() -> Response:
        return _json({"is_sleeping": aeng.engine.is_sleeping})

    @app.post("/release_memory_occupation", include_in_schema=False)
    async def release(request: Request) -> Response:
        out = await sleep(2, await _tags_body(request))
        return _json({**out, "message": "memory released (weights dropped: a weight update "
                                        "refills them after resume)"})

    @app.post("/resume_memory_occupation", include_in_schema=False)
    async def resume(request: Request) -> Response:
        return _json({**await wake(await _tags_body(request)), "message": "memory resumed"})
