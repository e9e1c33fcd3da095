"""Request bodies of the rollout server (``specengine.server.app``).

Every model forbids unknown fields and is strict about types (``true`` is not an int, ``"3"``
is not a number), so a typo or a wrong type is a 422 naming the field instead of a silently
ignored option. Range checks stay with the engine (``SamplingParams.__post_init__``,
``validate_requests``): its ``ValueError`` message becomes the 400's error, so the HTTP and
Python APIs refuse the same inputs with the same words.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specengine.sampling import SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True)
MAX_REQUEST_ID_CHARS = 256
# Fields where an explicit null is a value (no seed; the engine's lag), not "the default".
_NONE_MEANS_SOMETHING = ("seed", "max_policy_lag")


class SamplingParamsBody(BaseModel):
    """``SamplingParams``' fields; the ones left out take ``SamplingParams``' defaults."""

    model_config = _STRICT

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    max_policy_lag: int | None = None
    n: int | None = None  # only 1: /generate answers one completion (send n requests)

    def to_params(self) -> SamplingParams:
        """The engine's ``SamplingParams`` (raises its ``ValueError`` on a bad value)."""
        given = {name: value for name, value in self.model_dump(exclude_unset=True).items()
                 if value is not None or name in _NONE_MEANS_SOMETHING}
        if "stop_token_ids" in given:
            given["stop_token_ids"] = tuple(given["stop_token_ids"])
        return SamplingParams(**given)


class GenerateRequest(BaseModel):
    """``POST /generate``: exactly one of ``prompt_token_ids`` and ``prompt`` (text, with a
    tokenizer); ``k`` (an int, or ``"auto"``: each step's k from the cost model, up to 8)
    defaults to the server's ``--k``."""

    model_config = _STRICT

    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling_params: SamplingParamsBody | None = None
    k: int | Literal["auto"] | None = None
    stream: bool = False
    request_id: str | None = Field(default=None, min_length=1,
                                   max_length=MAX_REQUEST_ID_CHARS)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_token_ids (a list of token ids) and "
                             "prompt (text)")
        return self

    def prompt_value(self) -> list[int] | str:
        return self.prompt_token_ids if self.prompt_token_ids is not None else self.prompt


class AbortRequest(BaseModel):
    """``POST /abort``."""

    model_config = _STRICT

    request_id: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)


class LoadWeightsRequest(BaseModel):
    """``POST /load_weights``: a safetensors checkpoint directory on the server's machine
    (``SpecEngine.load_weights``; a subset of the parameters is fine)."""

    model_config = _STRICT

    path: str = Field(min_length=1)
    which: Literal["policy", "draft"] = "policy"
    version: int | None = None


class InitWeightUpdateGroupRequest(BaseModel):
    """``POST /init_weight_update_group`` (``SpecEngine.init_weight_update_group``)."""

    model_config = _STRICT

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank: int
    world_size: int
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=120.0, gt=0)


class UpdateWeightsFromDistributedRequest(BaseModel):
    """``POST /update_weights_from_distributed``
    (``SpecEngine.update_weights_from_distributed``)."""

    model_config = _STRICT

    which: Literal["policy", "draft"] = "policy"
    src_rank: int = 0
    staging: Literal["auto", "device", "host", "none"] = "auto"


__all__ = ["AbortRequest", "GenerateRequest", "InitWeightUpdateGroupRequest",
           "LoadWeightsRequest", "SamplingParamsBody", "UpdateWeightsFromDistributedRequest"]
