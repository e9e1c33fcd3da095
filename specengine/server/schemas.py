"""Request bodies of the rollout server (``specengine.server.app``).

Every model forbids unknown fields and is strict about types (``true`` is not an int, ``"3"``
and ``1e30`` are not ints), so a typo or a wrong type is a 422 naming the field instead of a
silently ignored option. Range checks of generation stay with the engine
(``SamplingParams.__post_init__``, ``resolve_k``, ``validate_requests``): its ``ValueError``
message becomes the 400's error, so the HTTP and Python APIs refuse the same inputs with the
same words. The weight endpoints' numbers are bounded here (422), before they reach the
engine thread: a port, ranks and a world size that ``torch.distributed`` holds (int32), a
version that the int64 weight stamps hold, and a finite timeout of at most a day
(``datetime.timedelta`` overflows on huge ones).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specengine.sampling import MAX_INT32, MAX_INT64, SamplingParams
from specengine.weights.protocol import MAX_TIMEOUT_S

# allow_inf_nan=False: NaN / Infinity (which Python's json reads) are no numbers anywhere.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
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
    n: int | None = None  # > 1: one group sharing its prefill (server.sglang_api)
    stop: str | list[str] | None = None  # stop strings (a str is one)
    include_stop_str_in_output: bool | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    logprobs: int | None = None  # top-N alternatives per token (GenerationOutput.top_logprobs)
    # Not implemented: any value but the default is refused (400 naming the field).
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def to_params(self) -> SamplingParams:
        """The engine's ``SamplingParams`` (raises its ``ValueError`` on a bad value)."""
        given = {name: value for name, value in self.model_dump(exclude_unset=True).items()
                 if value is not None or name in _NONE_MEANS_SOMETHING}
        if "stop_token_ids" in given:
            given["stop_token_ids"] = tuple(given["stop_token_ids"])
        if isinstance(given.get("stop"), list):
            given["stop"] = tuple(given["stop"])
        return SamplingParams(**given)


class GenerateRequest(BaseModel):
    """``POST /generate``: exactly one of ``prompt_token_ids``, ``prompt`` (text, with a
    tokenizer) and ``messages`` (chat messages, rendered with the checkpoint's chat template
    as ``SpecEngine.generate`` renders them); ``k`` (an int, or ``"auto"``: each step's k
    from the cost model, up to ``k_max``) and ``k_max`` default to the server's ``--k`` and
    ``--k-max``."""

    model_config = _STRICT

    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    sampling_params: SamplingParamsBody | None = None
    k: int | Literal["auto"] | None = None
    k_max: int | None = None  # with k "auto": its largest k (default: the server's --k-max)
    stream: bool = False
    request_id: str | None = Field(default=None, min_length=1,
                                   max_length=MAX_REQUEST_ID_CHARS)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt_token_ids, self.prompt, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt_token_ids (a list of token ids), "
                             "prompt (text) and messages (chat messages)")
        return self

    def prompt_value(self) -> list[int] | str | list[dict[str, Any]]:
        if self.messages is not None:
            return self.messages
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
    # >= 0: the engine says why 0 is refused (versions must increase)
    version: int | None = Field(default=None, ge=0, le=MAX_INT64)
    check_finite: bool = True  # refuse NaN / Inf weights (WeightSyncError, 400)


class InitWeightUpdateGroupRequest(BaseModel):
    """``POST /init_weight_update_group`` (``SpecEngine.init_weight_update_group``)."""

    model_config = _STRICT

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    # Only int32 bounds here: the engine's own checks (rank 0 is the sender, rank <
    # world_size, world_size >= 2) answer with their clearer words.
    rank: int = Field(ge=0, le=MAX_INT32)
    world_size: int = Field(ge=1, le=MAX_INT32)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S)


class UpdateWeightsFromDistributedRequest(BaseModel):
    """``POST /update_weights_from_distributed``
    (``SpecEngine.update_weights_from_distributed``)."""

    model_config = _STRICT

    which: Literal["policy", "draft"] = "policy"
    src_rank: int = Field(default=0, ge=0, le=MAX_INT32)
    staging: Literal["auto", "device", "host", "none"] = "auto"
    check_finite: bool = True  # refuse NaN / Inf weights (WeightSyncError, 400)


__all__ = ["AbortRequest", "GenerateRequest", "InitWeightUpdateGroupRequest",
           "LoadWeightsRequest", "SamplingParamsBody", "UpdateWeightsFromDistributedRequest"]
