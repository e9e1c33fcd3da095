"""Request bodies of the OpenAI-compatible endpoints (``specengine.server.openai_api``).

As vLLM's (and OpenAI's own API), a field these models do not know is ignored (logged once
per name) rather than refused, so a client built for another server keeps working; the
known fields are strictly typed (``"3"`` is not an int; NaN / Infinity are no numbers).
A field this engine knows but cannot honour is refused with a 400 naming it when it asks
for something (:meth:`OpenAIRequest.unsupported`): a penalty, ``logit_bias``, ``echo``...
(left at its "off" value it is accepted). ``stop`` strings, ``min_p``, ``min_tokens``, vLLM's
``include_stop_str_in_output`` and top-N logprobs (completions ``logprobs`` = N, chat
``top_logprobs`` = N) pass through to ``SamplingParams``.

The sampling fields become a ``SamplingParams`` (:meth:`OpenAIRequest.to_params`), whose
``__post_init__`` range-checks them: its ``ValueError`` is the 400's message, so the HTTP
and Python APIs refuse the same values with the same words.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from specengine.sampling import MAX_INT32, MAX_TOP_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

# extra="allow": unknown fields are kept aside (model_extra) and ignored, as vLLM does.
_OPENAI = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
#: OpenAI's default max_tokens of a completion (chat completions default to "until the
#: context is full", as vLLM: SamplingParams stops at max_model_len)
DEFAULT_COMPLETION_TOKENS = 16
_warned_fields: set[str] = set()


class StreamOptions(BaseModel):
    model_config = _OPENAI

    include_usage: bool | None = False


class OpenAIRequest(BaseModel):
    """Fields both endpoints take: OpenAI's, vLLM's extensions (``top_k``, ``ignore_eos``,
    ``stop_token_ids``, ``return_token_ids``, ``return_tokens_as_token_ids``,
    ``skip_special_tokens``) and this engine's (``k``, ``k_max``, ``max_policy_lag``)."""

    model_config = _OPENAI

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    max_policy_lag: int | None = None
    k: int | Literal["auto"] | None = None
    k_max: int | None = None
    include_stop_str_in_output: bool = False
    min_p: float | None = None
    min_tokens: int | None = None
    # Known, refused when they ask for something (see unsupported()).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None

    #: (field, value that means "off"): any other value is refused with a 400
    OFF_VALUES: ClassVar[tuple[tuple[str, object], ...]] = (
        ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
        ("prompt_logprobs", None),
        ("truncate_prompt_tokens", None))

    @model_validator(mode="after")
    def _note_unknown(self) -> OpenAIRequest:
        new = sorted(set(self.model_extra or ()) - _warned_fields)
        if new:
            _warned_fields.update(new)
            logger.warning("ignoring request fields this server does not know (as vLLM "
                           "does; logged once per name): %s", ", ".join(new))
        return self

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, why)`` of the first field that asks for what this engine cannot do."""
        for name, off in self.OFF_VALUES:
            value = getattr(self, name)
            if value is not None and value != off:
                return name, (f"{name}={value!r} is not supported by this server (leave it "
                              f"out or set it to {off!r})")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", ("response_format other than {'type': 'text'} "
                                       "(structured output) is not supported by this server")
        return None

    def max_new_tokens(self) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    def to_params(self) -> SamplingParams:
        """The engine's ``SamplingParams`` (raises its ``ValueError`` on a bad value)."""
        given: dict[str, Any] = {
            "max_tokens": self.max_new_tokens(), "ignore_eos": self.ignore_eos,
            "seed": self.seed, "max_policy_lag": self.max_policy_lag,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "n": 1 if self.n is None else self.n,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "min_tokens": 0 if self.min_tokens is None else self.min_tokens,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "logprobs": self.top_n()}
        return SamplingParams(**given)

    def top_n(self) -> int | None:
        """How many alternatives per token the answer shows (``SamplingParams.logprobs``)."""
        return None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one
    completion group per prompt, texts and id lists may mix; choice ``p * n + i`` is sample
    i of prompt p)."""

    prompt: str | list[int] | list[str | list[int]]
    logprobs: int | None = None  # 0: each sampled token's logprob; > 0: top-N too
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo=true (the prompt in the completion) is not supported"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", ("best_of other than n is not supported (vLLM's V1 engine "
                               "dropped it too); sample n and rank them yourself")
        return super().unsupported()

    def top_n(self) -> int | None:
        # logprobs=0: each sampled token's logprob only (no alternatives asked for)
        return self.logprobs if self.logprobs else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids. Raises ``ValueError`` for an empty list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is an empty list: give text, token ids, or a list of "
                             "either")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    """One message; its other fields (``tool_calls``, ``tool_call_id``,
    ``reasoning_content``, ...) go to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the template sees it: a list of text parts joined with newlines
        into one string (as vLLM's "string" content format). Raises ``ValueError`` for a
        part that is not text."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{index}].content[{j}]: only text parts "
                                     f"({{'type': 'text', 'text': ...}}) are supported, got "
                                     f"type {part.get('type')!r}")
                texts.append(part["text"])
            content = "\n".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content,
                "name": self.name}


class ChatCompletionRequest(OpenAIRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat
    template (``add_generation_prompt``, ``chat_template_kwargs``, ``tools`` and
    ``documents`` passed to it, as transformers' ``apply_chat_template``; as vLLM,
    ``chat_template_kwargs`` override the named fields)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", (f"top_logprobs={self.top_logprobs} needs logprobs=true "
                                    "(as OpenAI and vLLM)")
        if self.continue_final_message:
            return "continue_final_message", "continue_final_message is not supported"
        if self.chat_template is not None:
            return "chat_template", ("a chat template in the request is not accepted: the "
                                     "checkpoint's own is used")
        if self.tool_choice not in (None, "none"):
            return "tool_choice", ("tool calls are not parsed by this server: tools are "
                                   "rendered into the prompt and the model's text comes back "
                                   "as content (tool_choice 'none')")
        return super().unsupported()

    def top_n(self) -> int | None:
        if not (self.logprobs and self.top_logprobs):
            return None
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs!r}")
        return self.top_logprobs

    def max_new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        # no limit given: until a stop token or max_model_len (as vLLM and OpenAI)
        return MAX_INT32 if self.max_tokens is None else self.max_tokens


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "OpenAIRequest",
           "StreamOptions"]
