"""vLLM's server endpoints that RL frameworks call beside ``/v1`` (TRL's ``VLLMClient`` in
server mode, SkyRL, prime-rl, verifiers).

:func:`mount` adds, to an app made by ``build_app``:

- ``GET /get_world_size``: ``{"world_size"}``, the engine's workers (its tensor-parallel
  ranks): a learner's weight group has that many receivers plus itself;
- ``GET /server_info``: ``{"vllm_config": {...}}``, the parts of vLLM's resolved config a
  client reads (the model, its context length, the parallel sizes, and
  ``weight_transfer_config``: None, since vLLM's NCCL weight-transfer handshake is not
  served; TRL then says so instead of hanging in a rendezvous);
- ``POST /reset_prefix_cache``: drops the prefix cache (``{"success": true}``);
- vLLM's weight-transfer endpoints, their bodies as vLLM's: ``/init_weight_transfer_engine``
  (``{"init_info": {master_address, master_port, rank_offset, world_size}}``, plus ours:
  ``backend`` ``"nccl"`` or ``"gloo"``, ``timeout_s``), ``/start_weight_update``,
  ``/update_weights`` (``{"update_info": {names, dtype_names, shapes, packed,
  packed_buffer_size_bytes}}``: the learner broadcasts meanwhile, packed as vLLM packs,
  ``specengine.weights.vllm_receiver``) and ``/finish_weight_update``. The updates between
  start and finish are one update (one version, all or nothing, committed by finish); an
  ``/update_weights`` outside them is one on its own. The group is this engine's
  ``WeightGroup`` (rank 0, the learner, hosts a ``TCPStore``; gloo or NCCL on it), not vLLM's
  ``StatelessProcessGroup`` / PyNccl handshake: a learner makes its side with
  ``specengine.weights.group.WeightGroup(rank=0)``. A new init replaces a group whose learner
  is gone, and is refused at once (409) while it answers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from specengine.sampling import MAX_INT32
from specengine.server.sglang_api import json_response
from specengine.server.sglang_api import parse_body as parse
from specengine.server.sglang_api import read_json_body as read_json
from specengine.server.sglang_schemas import LaxInt
from specengine.weights.group import WeightGroup
from specengine.weights.protocol import MAX_TIMEOUT_S
from specengine.weights.sglang_receiver import announced_sizes, drain_limit
from specengine.weights.vllm_receiver import DEFAULT_PACKED_BUFFER_BYTES, receive

logger = logging.getLogger(__name__)
_BODY = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class InitInfo(BaseModel):
    """vLLM's ``init_info`` (``packed`` and other keys of its engines are ignored: the layout
    is told per update); ``backend`` and ``timeout_s`` are ours."""

    model_config = _BODY

    master_address: str = Field(min_length=1)
    master_port: LaxInt = Field(ge=1, le=65535)
    rank_offset: LaxInt = Field(default=1, ge=1, le=MAX_INT32)
    world_size: LaxInt = Field(ge=2, le=MAX_INT32)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S)


class InitRequest(BaseModel):
    model_config = _BODY

    init_info: InitInfo


class UpdateInfo(BaseModel):
    """vLLM's ``update_info``."""

    model_config = _BODY

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = Field(default=DEFAULT_PACKED_BUFFER_BYTES, ge=1)
    packed_num_buffers: int = Field(default=2, ge=1)


class UpdateRequest(BaseModel):
    model_config = _BODY

    update_info: UpdateInfo


def mount(app: FastAPI) -> None:
    """Add this module's routes to ``app`` (made by ``build_app``; its state is
    ``app.state.server``)."""
    state = app.state.server
    aeng = state.engine

    def world_size() -> int:
        return int(aeng.engine.config.tensor_parallel_size)

    @app.get("/get_world_size")
    async def get_world_size() -> Response:
        return json_response({"world_size": world_size()})

    @app.get("/server_info")
    async def server_info(config_format: str = "json") -> Response:
        cfg = aeng.engine.config
        info: dict[str, Any] = {
            "model_config": {"model": str(cfg.model), "max_model_len": cfg.max_model_len},
            "parallel_config": {"tensor_parallel_size": world_size(),
                                "pipeline_parallel_size": 1, "data_parallel_size": 1},
            "speculative_config": None if cfg.draft is None else {"model": str(cfg.draft)},
            "weight_transfer_config": None,
        }
        return json_response({"vllm_config": info if config_format == "json" else str(info)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await aeng.run_in_engine(lambda e: e.kv_cache.invalidate_prefix_cache())
        return json_response({"success": True})

    # ---- weight transfer -----------------------------------------------------------------
    transfer: dict[str, Any] = {"group": None, "pending": None}
    lock = asyncio.Lock()  # one transfer call at a time

    async def commit(tensors: list[tuple[str, Any]]) -> int:
        def stage() -> Any:
            return aeng.engine.stage_weights(tensors)
        try:
            staged = await asyncio.to_thread(stage)
        except RuntimeError as exc:  # another weight operation holds the lock
            if type(exc) is RuntimeError:
                raise HTTPException(409, str(exc)) from exc
            raise
        try:
            return await aeng.run_in_engine(lambda e: e.commit_staged(staged))
        finally:
            staged.discard()

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        info = parse(InitRequest, await read_json(request)).init_info
        async with lock:
            old: WeightGroup | None = transfer["group"]
            if old is not None:
                gone = await asyncio.to_thread(old.learner_gone)
                if not gone:
                    raise HTTPException(409, "a weight-transfer group exists and its learner "
                                        "still answers")
                logger.warning("weight-transfer group: its learner is gone (%s); replaced",
                               gone)
                old.close()
                transfer["group"], transfer["pending"] = None, None
            device = aeng.engine.device
            transfer["group"] = await asyncio.to_thread(
                WeightGroup, info.master_address, info.master_port, info.rank_offset,
                info.world_size, info.backend, info.timeout_s,
                device if device.type == "cuda" else None)
        return json_response({"success": True})

    @app.post("/start_weight_update")
    async def start_weight_update() -> Response:
        async with lock:
            if transfer["pending"] is not None:
                raise HTTPException(409, "a weight update is already started: "
                                    "/finish_weight_update first")
            transfer["pending"] = {}
        return json_response({"success": True})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        info = parse(UpdateRequest, await read_json(request)).update_info
        async with lock:
            group: WeightGroup | None = transfer["group"]
            if group is None:
                raise HTTPException(409, "no weight-transfer group: "
                                    "/init_weight_transfer_engine first")
            meta, why = announced_sizes(info.names, info.dtype_names, info.shapes,
                                        drain_limit(aeng.engine))
            if why:  # sizes unknown: nothing can be received, the group is out of step
                group.close()
                transfer["group"] = None
                raise ValueError(f"update refused, the group is closed (init a new one): {why}")
            tensors = await asyncio.to_thread(receive, group, meta, info.packed,
                                              info.packed_buffer_size_bytes)
            if transfer["pending"] is not None:
                transfer["pending"].update(tensors)
                return json_response({"success": True, "received": len(tensors)})
            version = await commit(tensors)
        return json_response({"success": True, "weight_version": version})

    @app.post("/finish_weight_update")
    async def finish_weight_update() -> Response:
        async with lock:
            pending = transfer["pending"]
            if pending is None:
                raise HTTPException(409, "no weight update started: /start_weight_update "
                                    "first")
            transfer["pending"] = None
            version = await commit(list(pending.items()))
        return json_response({"success": True, "weight_version": version})


__all__ = ["mount"]
