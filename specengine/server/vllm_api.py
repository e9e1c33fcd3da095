"""vLLM's server endpoints that RL frameworks call beside ``/v1`` (TRL's ``VLLMClient`` in
server mode, SkyRL, prime-rl, verifiers).

:func:`mount` adds, to an app made by ``build_app``:

- ``GET /get_world_size``: ``{"world_size"}``, the engine's workers (its tensor-parallel
  ranks): a learner's weight group has that many receivers plus itself;
- ``GET /server_info``: ``{"vllm_config": {...}}``, the parts of vLLM's resolved config a
  client reads (the model, its context length, the parallel sizes, and
  ``weight_transfer_config``: None, since vLLM's NCCL weight-transfer handshake is not
  served; TRL then says so instead of hanging in a rendezvous);
- ``POST /reset_prefix_cache``: drops the prefix cache (``{"success": true}``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from specengine.server.sglang_api import json_response


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


__all__ = ["mount"]
