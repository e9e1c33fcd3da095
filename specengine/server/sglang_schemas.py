"""Request bodies of the SGLang-compatible endpoints (``specengine.server.sglang_api``).

Strict as ``specengine.server.schemas`` (unknown fields and wrong types are named), but a bad
SGLang body is a 400, as SGLang answers it. SGLang's defaults apply where its body leaves a
field out (``max_new_tokens`` 128). ``stop`` (a str or a list), ``min_p`` and
``min_new_tokens`` (as ``min_tokens``) pass through to ``SamplingParams``, and so do the
penalties, whose ``ValueError`` (not implemented: any value but the off one) is a 400 naming
them; ``no_stop_trim`` is ``include_stop_str_in_output``; ``top_logprobs_num`` with
``return_logprob`` is ``SamplingParams.logprobs``.

Every other field of SGLang's ``GenerateReqInput`` and ``SamplingParams`` (``image_data``,
``lora_path``, ``skip_special_tokens``, ``regex``, ...) is known here
(:data:`GENERATE_FIELDS`, :data:`SAMPLING_FIELDS`): left at its default (or null, which SGLang
reads as the default) it is accepted silently, and so is any value of a field that changes
nothing this engine returns (``log_metrics``, ``stream_interval``, ...); any other value is a
400 naming the field, as on ``/v1``. ``skip_special_tokens`` is honoured (the text). The
weight bodies' integers take numeric strings too (``"master_port": "29631"``), as SGLang's
FastAPI models do.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

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


class _Default:
    """A field whose default (or null) is the only value this engine can honour."""

    def __init__(self, *offs: object) -> None:
        self.offs = offs

    def allows(self, value: object) -> bool:
        if value is None or any(value == off and type(value) is type(off)
                                for off in self.offs):
            return True
        # a batch gives one per prompt: each must be off
        return isinstance(value, (list, dict)) and all(
            self.allows(v) for v in (value.values() if isinstance(value, dict) else value))


class _Any(_Default):
    """A field whose every value is accepted: it changes nothing this engine returns."""

    def allows(self, value: object) -> bool:
        return True


ANY = _Any()
_OFF = _Default()  # null, [], {} only

#: SGLang's ``GenerateReqInput`` fields that this server does not model, with what it accepts
#: (its default / null; ``ANY``: metrics, logging, tracing and routing hints of one engine)
GENERATE_FIELDS: dict[str, _Default] = {
    "session_id": ANY, "input_embeds": _OFF, "image_data": _OFF, "video_data": _OFF,
    "audio_data": _OFF, "mm_hashes": _OFF, "use_audio_in_video": _Default(False),
    "token_ids_logprob": _OFF, "return_text_in_logprobs": _Default(False),
    "log_metrics": ANY, "return_hidden_states": _Default(False),
    "return_routed_experts": _Default(False), "routed_experts_start_len": _Default(0),
    "return_indexer_topk": _Default(False), "modalities": _OFF, "session_params": _OFF,
    "lora_path": _OFF, "lora_id": _OFF, "custom_logit_processor": _OFF,
    "positional_embed_overrides": _OFF, "bootstrap_host": _OFF, "bootstrap_port": _OFF,
    "bootstrap_room": _OFF, "bootstrap_pair_key": _OFF, "decode_tp_size": _OFF,
    "routed_dp_rank": _OFF, "data_parallel_rank": _OFF, "disagg_prefill_dp_rank": _OFF,
    "routing_key": ANY, "conversation_id": ANY, "http_worker_ipc": _OFF,
    "background": _Default(False), "require_reasoning": _Default(False), "priority": _OFF,
    "extra_key": _OFF, "no_logs": ANY, "custom_labels": ANY, "return_bytes": _Default(False),
    "return_entropy": _Default(False), "return_prompt_token_ids": _Default(False),
    "external_trace_header": ANY, "received_time": ANY, "need_wait_for_mm_inputs": _OFF,
    "num_items_assigned": _OFF, "mm_data_mooncake": _OFF, "encoder_urls": _OFF,
    "max_dynamic_patch": _OFF, "min_dynamic_patch": _OFF, "image_max_dynamic_patch": _OFF,
    "video_max_dynamic_patch": _OFF, "images_config": _OFF,
    "multi_item_delimiter_indices": _OFF,
}
#: SGLang's ``SamplingParams`` fields that ``SGLangSamplingParams`` does not model
SAMPLING_FIELDS: dict[str, _Default] = {
    "stop_regex": _OFF, "json_schema": _OFF, "regex": _OFF, "ebnf": _OFF,
    "structural_tag": _OFF, "spaces_between_special_tokens": _Default(True),
    "custom_params": _OFF, "stream_interval": ANY, "logit_bias": _OFF,
}


def known_but_unsupported(body: dict[str, Any], fields: dict[str, _Default], where: str = ""
                          ) -> dict[str, Any]:
    """``body`` less the fields of ``fields`` (accepted at their default, or any value for
    ``ANY``); ``ValueError`` naming the first one that asks for something this engine cannot
    do."""
    rest = {}
    for name, value in body.items():
        rule = fields.get(name)
        if rule is None:
            rest[name] = value
        elif not rule.allows(value):
            raise ValueError(f"{where}{name} is not supported by this engine (got "
                             f"{_short(value)}); leave it out or null")
    return rest


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _lax_int(value: object) -> object:
    """A numeric string as its int (SGLang's FastAPI models coerce them); anything else as
    given, for the strict check."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return value


#: an int that may come as a numeric string
LaxInt = Annotated[int, BeforeValidator(_lax_int)]


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
    skip_special_tokens: bool | None = None  # the text (honoured by sglang_api)

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
            elif name == "skip_special_tokens":
                continue  # the text's decoding, not sampling (sglang_api)
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

    def skip_special_tokens(self) -> list[bool]:
        """Each prompt's ``sampling_params.skip_special_tokens`` (SGLang's default true)."""
        return [sp is None or sp.skip_special_tokens is not False
                for sp in self._each(self.sampling_params)]

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


#: SGLang's default group name, where a body leaves it out
DEFAULT_GROUP_NAME = "weight_update_group"


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's ``POST /init_weights_update_group``; ``timeout_s`` is ours (the rendezvous'
    and every later broadcast's limit). ``pp_rank`` (AReaL's, with pipeline parallelism):
    this engine is one stage, 0."""

    model_config = _STRICT

    master_address: str = Field(min_length=1)
    master_port: LaxInt = Field(ge=1, le=65535)
    rank_offset: LaxInt = Field(ge=1, le=MAX_INT32)
    world_size: LaxInt = Field(ge=2, le=MAX_INT32)
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1, max_length=256)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S)
    pp_rank: LaxInt | None = Field(default=None, ge=0, le=0)
    rid: str | None = None  # SGLang's BaseReq fields, unused
    http_worker_ipc: str | None = None


def _version(value: int | str | None) -> int | None:
    """SGLang's ``weight_version`` (a string there): ours is an int, so digits only."""
    if value is None or isinstance(value, int):
        return value
    if not value.isdigit() or int(value) > MAX_INT64:
        raise ValueError(f"weight_version must be an int (or a string of digits) here, got "
                         f"{value!r}")
    return int(value)


class _WeightUpdateFields(BaseModel):
    """What SGLang's weight updates share. ``abort_all_requests``: the requests in flight end
    first, with finish reason ``abort`` (their tokens so far returned), as SGLang's.
    ``flush_cache`` is accepted either way: every update invalidates the prefix cache (its KV
    is of the old weights). ``torch_empty_cache`` changes nothing on this engine."""

    model_config = _STRICT

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    torch_empty_cache: bool = False
    rid: str | None = None
    http_worker_ipc: str | None = None

    def version(self) -> int | None:
        return _version(self.weight_version)


class UpdateWeightsFromDistributedSGLang(_WeightUpdateFields):
    """SGLang's ``POST /update_weights_from_distributed``: then the learner broadcasts each
    named tensor from rank 0 of the group, in order. ``load_format`` null only (one tensor
    per broadcast); ``disable_draft_model`` either way (a policy update never changes the
    draft here)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1)
    load_format: None = None
    disable_draft_model: bool | None = None


class UpdateWeightsFromDiskRequest(_WeightUpdateFields):
    """SGLang's ``POST /update_weights_from_disk``: a safetensors checkpoint dir on the
    server's machine (all of the model's tensors or some), all or nothing. ``keep_pause``:
    generation stays paused after it (as after ``/pause_generation``). ``is_async`` false and
    ``manifest`` null only; ``recapture_cuda_graph`` and ``token_step`` change nothing."""

    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None
    is_async: Literal[False] = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: LaxInt = 0
    manifest: None = None


class GroupNameRequest(BaseModel):
    """``POST /destroy_weights_update_group``."""

    model_config = _STRICT

    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1)
    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseGenerationRequest(BaseModel):
    """SGLang's ``POST /pause_generation``. ``abort`` (SGLang's default) only: the requests
    in flight end with finish reason ``abort`` (their tokens so far returned) and new ones
    wait for ``/continue_generation``. ``retract`` and ``in_place`` keep requests in the
    engine, halted: this engine's step loop does not halt (weight updates land between two
    steps while it runs, each token stamped with its version), so they are refused by
    name."""

    model_config = _STRICT

    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: str | None = None
    http_worker_ipc: str | None = None

    @model_validator(mode="after")
    def _check(self) -> PauseGenerationRequest:
        if self.mode != "abort":
            raise ValueError(f"mode {self.mode!r} is not supported by this engine: only "
                             "'abort' (requests in flight end with finish reason abort; new "
                             "ones wait for /continue_generation)")
        return self


class ContinueGenerationRequest(BaseModel):
    """SGLang's ``POST /continue_generation`` (``torch_empty_cache`` changes nothing here)."""

    model_config = _STRICT

    torch_empty_cache: bool = True
    rid: str | None = None
    http_worker_ipc: str | None = None


class AbortRequestSGLang(BaseModel):
    """SGLang's ``POST /abort_request``: ``rid`` (a request, or every sample of an n > 1
    request) or ``abort_all``."""

    model_config = _STRICT

    rid: str = ""
    abort_all: bool = False


def sglang_generate_body(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``/generate`` body less the fields this server does not model (each accepted
    at its default, refused by name otherwise: ``ValueError``) and less the nulls SGLang
    reads as defaults; the rest is parsed strictly (a typo is an unknown field)."""
    body = known_but_unsupported(body, GENERATE_FIELDS)
    for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "rid", "stream"):
        if name in body and body[name] is None:
            del body[name]
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        body["sampling_params"] = known_but_unsupported(sp, SAMPLING_FIELDS,
                                                        "sampling_params.")
    elif isinstance(sp, list):
        body["sampling_params"] = [
            known_but_unsupported(one, SAMPLING_FIELDS, f"sampling_params[{i}].")
            if isinstance(one, dict) else one for i, one in enumerate(sp)]
    return body


__all__ = ["GENERATE_FIELDS", "SAMPLING_FIELDS", "AbortRequestSGLang",
           "ContinueGenerationRequest", "GroupNameRequest", "InitWeightsUpdateGroupRequest",
           "PauseGenerationRequest", "SGLangGenerateRequest", "SGLangSamplingParams",
           "UpdateWeightsFromDiskRequest", "UpdateWeightsFromDistributedSGLang",
           "sglang_generate_body"]
