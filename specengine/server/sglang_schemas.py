"""Request bodies of the SGLang-compatible endpoints (``specengine.server.sglang_api``).

Strict as ``specengine.server.schemas`` (unknown fields and wrong types are named), but a bad
SGLang body is a 400, as SGLang answers it. SGLang's defaults apply where its body leaves a
field out (``max_new_tokens`` 128). ``stop`` (a str or a list), ``min_p`` and
``min_new_tokens`` (as ``min_tokens``) pass through to ``SamplingParams``, and so do the
penalties, whose ``ValueError`` (not implemented: any value but the off one) is a 400 naming
them; ``no_stop_trim`` is ``include_stop_str_in_output``; ``top_logprobs_num`` with
``return_logprob`` is ``SamplingParams.logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from specengine.sampling import MAX_INT32, MAX_INT64, MAX_TOP_LOGPROBS, SamplingParams
from specengine.server.schemas import MAX_REQUEST_ID_CHARS
from specengine.weights.protocol import MAX_TIMEOUT_S

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
#: SGLang's default ``max_new_tokens``
DEFAULT_MAX_NEW_TOKENS = 128
#: SGLang field -> (SamplingParams field, the value that means "off")
_OPTIONAL_FIELDS = {"stop": ("stop", None), "min_p": ("min_p", 0.0),
                    "min_new_tokens": ("min_tokens", 0),
                    "frequency_penalty": ("frequency_penalty", 0.0),
                    "presence_penalty": ("presence_penalty", 0.0),
                    "repetition_penalty": ("repetition_penalty", 1.0),
                    "no_stop_trim": ("include_stop_str_in_output", False)}


def _one_or_list(one: Any, many: Any, is_many: Any = None) -> Any:
    """A field that is one value or a list of them (one per prompt of a batch), told apart
    before validation, so an error names the field once rather than per union branch. The
    branch tags ``one`` / ``many`` are dropped from error locations (``sglang_api``)."""
    def pick(v: object) -> str:
        if is_many is not None:
            return "many" if is_many(v) else "one"
        return "many" if isinstance(v, list) else "one"
    return Annotated[Annotated[one, Tag("one")] | Annotated[many, Tag("many")],
                     Discriminator(pick)]


#: branch tags of :func:`_one_or_list`, not part of a field's path
UNION_TAGS = ("one", "many")


def _engine_has(name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(SamplingParams)}


class SGLangSamplingParams(BaseModel):
    """SGLang's ``sampling_params``. ``sampling_seed`` (SGLang's name) or ``seed``: one seed
    per request; with ``n`` > 1 sample i draws from a seed derived from it."""

    model_config = _STRICT

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    max_policy_lag: int | None = None  # ours (SpecEngine's per-request policy lag bound)
    stop: str | list[str] | None = None
    min_p: float | None = None
    min_new_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    no_stop_trim: bool | None = None  # SGLang's: the text keeps the matched stop string

    def to_params(self) -> SamplingParams:
        """The engine's ``SamplingParams``; ``ValueError`` (a 400) naming a field the engine
        refuses or does not support yet."""
        given = self.model_dump(exclude_unset=True)
        if given.get("seed") is not None and given.get("sampling_seed") is not None:
            raise ValueError("sampling_params: give one of seed and sampling_seed")
        out: dict[str, object] = {"max_tokens": DEFAULT_MAX_NEW_TOKENS}
        for name, value in given.items():
            if value is None:
                continue
            if name in _OPTIONAL_FIELDS:
                field, off = _OPTIONAL_FIELDS[name]
                if value == off or value == [] or value == "":
                    continue
                if not _engine_has(field):
                    raise ValueError(f"sampling_params.{name} is not supported by this engine "
                                     f"yet (got {value!r}); leave it out")
                out[field] = tuple(value) if isinstance(value, list) else value
            elif name == "max_new_tokens":
                out["max_tokens"] = value
            elif name in ("seed", "sampling_seed"):
                out["seed"] = value
            elif name == "stop_token_ids":
                out[name] = tuple(value)
            else:
                out[name] = value
        return SamplingParams(**out)  # type: ignore[arg-type]


class SGLangGenerateRequest(BaseModel):
    """SGLang's ``POST /generate`` body: exactly one of ``text`` and ``input_ids``, one prompt
    or a batch (a list of strings / of id lists); ``sampling_params``, ``return_logprob`` and
    ``rid`` one for all or one per prompt. ``k`` / ``k_max`` are ours (the server's defaults
    otherwise)."""

    model_config = _STRICT

    text: _one_or_list(str, list[str]) | None = None
    input_ids: _one_or_list(list[int], list[list[int]], lambda v: isinstance(
        v, list) and bool(v) and isinstance(v[0], list)) | None = None
    sampling_params: _one_or_list(SGLangSamplingParams, list[SGLangSamplingParams]
                                  ) | None = None
    return_logprob: _one_or_list(bool, list[bool]) = False
    logprob_start_len: _one_or_list(int, list[int]) = -1  # -1 only: output tokens' logprobs
    top_logprobs_num: _one_or_list(int, list[int]) = 0  # with return_logprob: top-N per token
    stream: bool = False
    rid: _one_or_list(str, list[str]) | None = None
    k: int | Literal["auto"] | None = None
    k_max: int | None = None

    @model_validator(mode="after")
    def _check(self) -> SGLangGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        n = self.batch_size
        if n == 0:
            raise ValueError("the batch is empty")
        for name in ("sampling_params", "return_logprob", "rid", "logprob_start_len",
                     "top_logprobs_num"):
            value = getattr(self, name)
            if isinstance(value, list) and (self.is_batch is False or len(value) != n):
                raise ValueError(f"{name}: a list gives one per prompt of a batch "
                                 f"({n if self.is_batch else 'not a batch'}), got {len(value)}")
        if any(v != -1 for v in self._each(self.logprob_start_len)):
            raise ValueError("logprob_start_len: only -1 (logprobs of the output tokens) is "
                             "supported")
        if any(not 0 <= v <= MAX_TOP_LOGPROBS for v in self._each(self.top_logprobs_num)):
            raise ValueError(f"top_logprobs_num: an int in [0, {MAX_TOP_LOGPROBS}] (top "
                             "alternatives per token)")
        rids = [r for r in self._each(self.rid) if r is not None]
        if any(not r or len(r) > MAX_REQUEST_ID_CHARS for r in rids):
            raise ValueError(f"rid: 1 to {MAX_REQUEST_ID_CHARS} characters")
        if len(set(rids)) != len(rids):
            raise ValueError("rid: the ids of a batch must differ")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore

    def prompts(self) -> list[str | list[int]]:
        value = self.text if self.text is not None else self.input_ids
        return list(value) if self.is_batch else [value]  # type: ignore[list-item]

    def _each(self, value: object) -> list:
        return list(value) if isinstance(value, list) else [value] * self.batch_size

    def per_prompt(self) -> list[tuple[SamplingParams, bool, str | None]]:
        """``(params, return_logprob, rid)`` of each prompt (``ValueError`` for a bad
        sampling field). ``top_logprobs_num`` counts only with ``return_logprob`` (as SGLang):
        it becomes ``SamplingParams.logprobs``."""
        sps = self._each(self.sampling_params)
        out = []
        for i, (sp, lp, rid, top) in enumerate(zip(sps, self._each(self.return_logprob),
                                                    self._each(self.rid),
                                                    self._each(self.top_logprobs_num))):
            try:
                params = (sp or SGLangSamplingParams()).to_params()
                if lp and top:
                    params = dataclasses.replace(params, logprobs=top)
            except ValueError as e:
                where = f"prompt {i}: " if self.is_batch else ""
                raise ValueError(f"{where}{e}") from None
            out.append((params, lp, rid))
        return out


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's ``POST /init_weights_update_group``; ``timeout_s`` is ours (the rendezvous'
    and every later broadcast's limit)."""

    model_config = _STRICT

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_INT32)
    world_size: int = Field(ge=2, le=MAX_INT32)
    group_name: str = Field(min_length=1, max_length=256)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S)


def _version(value: int | str | None) -> int | None:
    """SGLang's ``weight_version`` (a string there): ours is an int, so digits only."""
    if value is None or isinstance(value, int):
        return value
    if not value.isdigit() or int(value) > MAX_INT64:
        raise ValueError(f"weight_version must be an int (or a string of digits) here, got "
                         f"{value!r}")
    return int(value)


class UpdateWeightsFromDistributedSGLang(BaseModel):
    """SGLang's ``POST /update_weights_from_distributed``: then the learner broadcasts each
    named tensor from rank 0 of the group, in order. ``flush_cache`` is accepted either way:
    every update invalidates the prefix cache (its KV is of the old weights)."""

    model_config = _STRICT

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(min_length=1)
    flush_cache: bool = True
    weight_version: int | str | None = None

    def version(self) -> int | None:
        return _version(self.weight_version)


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's ``POST /update_weights_from_disk``: a safetensors checkpoint dir on the
    server's machine (all of the model's tensors or some), all or nothing."""

    model_config = _STRICT

    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: bool = True
    weight_version: int | str | None = None

    def version(self) -> int | None:
        return _version(self.weight_version)


class GroupNameRequest(BaseModel):
    """``POST /destroy_weights_update_group``."""

    model_config = _STRICT

    group_name: str = Field(min_length=1)


class AbortRequestSGLang(BaseModel):
    """SGLang's ``POST /abort_request``: ``rid`` (a request, or every sample of an n > 1
    request) or ``abort_all``."""

    model_config = _STRICT

    rid: str = ""
    abort_all: bool = False


__all__ = ["AbortRequestSGLang", "GroupNameRequest", "InitWeightsUpdateGroupRequest",
           "SGLangGenerateRequest", "SGLangSamplingParams", "UpdateWeightsFromDiskRequest",
           "UpdateWeightsFromDistributedSGLang"]
