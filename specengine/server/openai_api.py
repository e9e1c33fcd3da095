"""OpenAI-compatible endpoints of the rollout server (docs/design.md "Server"), the dialect
agent loops and multi-turn RL frameworks speak to vLLM and SGLang.

- ``GET /v1/models``: the one served model (its checkpoint directory's name; a request may
  also name it by the ``--model`` path, or leave ``model`` out).
- ``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either.
- ``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat template
  (``specengine.chat_template``, as transformers' ``apply_chat_template(...,
  add_generation_prompt=True)``) and tokenized without added special tokens, in the async
  engine's text pool.

``n > 1`` is one GRPO group per prompt (``SamplingParams(n=...)``: the prompt prefilled once,
its KV shared; sample i's seed derived from ``seed``); choice ``p * n + i`` is sample i of
prompt p. ``stream: true`` answers server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a choice's text arrives as it is decoded, and its logprobs (the engine
reports them with the finished output) in its last chunk. ``stream_options.include_usage``
adds a last chunk with the usage.

vLLM's RL extensions: ``return_token_ids`` (completions: ``prompt_token_ids`` and
``token_ids`` per choice, in a stream the prompt's in a choice's first chunk; chat: the
prompt's at the top level), ``return_tokens_as_token_ids`` (logprob tokens as
``"token_id:<id>"``), ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``min_tokens``, ``min_p``; ``stop`` strings (a streamed text
holds back a possible stop string's start, so it is always a prefix of the final, cut text;
``stop_reason`` is the matched string); top-N logprobs (completions ``logprobs`` = N: per token
``{text: logprob}``; chat ``top_logprobs`` = N: ``[{token, logprob, bytes}]``), the raw
distribution's ``GenerationOutput.top_logprobs``.
Each logprob is exactly ``GenerationOutput.logprobs``' value (the policy's processed
distribution). This engine's extras: ``k`` (an int or ``"auto"``, with ``k_max``; default the
server's ``--k``), ``max_policy_lag``; every choice answers ``weight_version``,
``num_steps``, ``num_draft_tokens``, ``num_accepted_tokens``, and with
``return_token_ids`` ``token_weight_versions``. Finish reasons are the engine's (``stop``,
``length``, ``abort``, ``policy_lag``).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (``code``:
the HTTP status, as vLLM), on every ``/v1/`` path (:class:`OpenAIErrorShape` reshapes the
server's other errors there too: auth, body size, unknown route); a body that does not fit
the schema is a 400 there, as OpenAI's and vLLM's. Validation is the engine's (the same
words as ``/generate``); a refused request changes nothing (a request with several prompts
is added whole or not at all: the admitted ones are aborted). Unknown fields are ignored,
as vLLM does (``openai_schemas``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from specengine.chat_template import ChatTemplateError
from specengine.core.requests import prompt_ids
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.server.errors import REFUSALS, describe_validation, status_for
from specengine.server.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from specengine.server.streams import EventStream, unless_disconnected
from specengine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from specengine.server.app import ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "/v1/"


# ---- errors ------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answer on a ``/v1/`` route; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> Response:
    return _json(error_body(status, message, param), status)


def _json(obj: object, status: int = 200) -> Response:
    # Python's encoder: a (rare) -inf logprob is written as -Infinity rather than failing.
    return Response(json.dumps(obj), status_code=status, media_type="application/json")


def _param_of(message: str, fields: Iterable[str]) -> str | None:
    """The field an engine message is about (it starts with the field's name)."""
    head = re.split(r"[ \[=(]", message, maxsplit=1)[0]
    return head if head in fields else None


def _loc_param(loc: Iterable[object]) -> str | None:
    """A schema error's field path (``messages.0.role``), without pydantic's union-member
    tags (``int``, ``literal['auto']``, ``list[int]``) that follow it."""
    parts: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and not part.isidentifier():
            break
        if isinstance(part, str) and part in ("str", "int", "float", "bool", "list", "dict"):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def refusal(exc: Exception, body: OpenAIRequest, default: str | None) -> OpenAIError:
    """The engine's refusal of a request (its own words) as an OpenAI error."""
    message = str(exc)
    return OpenAIError(status_for(exc), message,
                       _param_of(message, type(body).model_fields) or default)


def default_param(body: OpenAIRequest) -> str:
    """The field a refused prompt is in."""
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


class OpenAIErrorShape:
    """ASGI middleware: on ``/v1/`` paths, an error answer of the server's own shape
    (``{"error": "message"}``: auth, body size, unknown route, overload) becomes OpenAI's
    shape, and a 422 a 400 (OpenAI's status for a body that does not fit). Other paths and
    answers below 400 pass untouched (a stream is never held)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the (small) body is complete
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = _reshape(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", ())
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping)


def _reshape(status: int, body: bytes) -> tuple[int, bytes]:
    try:
        obj = json.loads(body)
    except ValueError:
        return status, body
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        status = 400 if status == 422 else status
        return status, json.dumps(error_body(status, obj["error"])).encode()
    return status, body


# ---- streams ------------------------------------------------------------------------------
def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class IncrementalText:
    """A choice's text as its tokens arrive, decoded without re-decoding the whole output
    each step: the text of a window that starts a few tokens back (so a token whose text
    depends on its left neighbour, or a multi-byte character split over tokens, decodes
    right) minus the window's earlier text. A window ending in U+FFFD (an incomplete UTF-8
    sequence) is held back until the next tokens complete it. With stop strings the last
    ``hold`` characters (the longest stop string's length - 1, vLLM's rule) are held back too:
    they may begin a stop string that the final text is cut before, and what was handed out
    must stay a prefix of the final text."""

    def __init__(self, tokenizer: TextTokenizer | None, skip_special_tokens: bool,
                 hold: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.hold = hold
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.decoded = ""  # the text decoded so far
        self.text = ""  # what was handed out (``decoded`` less the held-back tail)

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.decoded += now[len(before):]
        end = len(self.decoded) - self.hold
        if end <= len(self.text):
            return ""
        delta = self.decoded[len(self.text):end]
        self.text += delta
        return delta

    def finish(self, full: str) -> str:
        """The rest of the final text ``full`` (what was handed out is its prefix)."""
        if not full.startswith(self.text):  # pragma: no cover - a decoder we do not model
            logger.warning("streamed text is not a prefix of the final text; the last chunk "
                           "carries only what follows the common prefix")
            common = 0
            while common < min(len(full), len(self.text)) and full[common] == self.text[common]:
                common += 1
            self.text = self.text[:common]
        delta = full[len(self.text):]
        self.text = self.decoded = full
        return delta


# ---- the requests of one call ----------------------------------------------------------------
@dataclass
class Job:
    """One API call: its prompts, each a group of ``params.n`` samples, and ``k``. Prompt p
    runs as engine request ``f"{id}-{p}"`` (its samples ``f"{id}-{p}-{i}"`` when n > 1)."""

    id: str
    prompts: list[list[int]]
    params: SamplingParams
    k: int | str
    k_max: int
    tree: int | None = None  # the draft's own tree of that many drafts (serve --tree)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params.n

    def request_id(self, p: int) -> str:
        return f"{self.id}-{p}"

    def sample_ids(self, p: int) -> list[str]:
        rid = self.request_id(p)
        return [rid] if self.n == 1 else [f"{rid}-{i}" for i in range(self.n)]

    def all_ids(self) -> list[str]:
        return [rid for p in range(len(self.prompts)) for rid in self.sample_ids(p)]

    def choice_index(self, p: int, request_id: str) -> int:
        return p * self.n + (0 if self.n == 1 else int(request_id.rsplit("-", 1)[1]))


async def _numbered(p: int, stream: AsyncIterator[RequestOutput]
                   ) -> AsyncIterator[RequestOutput]:
    """``stream``, whose refusal names its prompt ``p`` of the call: the engine saw one
    request and calls its prompt "prompt 0"."""
    try:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                yield out
    except ValueError as exc:
        message = str(exc)
        if p and message.startswith("prompt 0 "):
            raise ValueError(f"prompt {p} {message.removeprefix('prompt 0 ')}") from None
        if p and "of prompt 0 " in message:
            raise ValueError(message.replace("of prompt 0 ", f"of prompt {p} ", 1)) from None
        raise


async def _all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first error with the other works cancelled (their requests
    aborted): a call is served whole or refused whole."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the endpoints ----------------------------------------------------------------------------
class OpenAIServer:
    """The endpoints' shared state and work, over the app's :class:`ServerState`."""

    def __init__(self, state: ServerState, served_model_name: str | None = None) -> None:
        self.state = state
        self.engine = state.engine
        model = str(state.engine.engine.config.model)
        self.model_path = model
        self.model_name = served_model_name or Path(model).name or model
        self.tokenizer: TextTokenizer | None = state.engine.engine.tokenizer
        self._token_text: dict[int, str] = {}  # id -> its text (bounded by the vocabulary)

    # -- admission ---------------------------------------------------------------------------
    def check(self, body: OpenAIRequest) -> SamplingParams:
        """The checks every call gets before any work: the server is open, the model is
        this one, every field asks for something this engine does; the sampling params."""
        if self.state.draining:
            raise OpenAIError(503, "the server is shutting down: no new requests")
        if body.model is not None and body.model not in (self.model_name, self.model_path):
            raise OpenAIError(404, f"the model {body.model!r} does not exist: this server "
                                   f"serves {self.model_name!r}", "model")
        refused = body.unsupported()
        if refused is not None:
            raise OpenAIError(400, refused[1], refused[0])
        try:
            return body.to_params()
        except ValueError as exc:
            raise refusal(exc, body, None) from None

    def job(self, kind: str, prompts: list[list[int]], params: SamplingParams,
            body: OpenAIRequest) -> Job:
        k, k_max, tree = self.state.draft_args(body.k, body.k_max)
        return Job(f"{kind}-{uuid.uuid4().hex}", prompts, params, k, k_max, tree)

    async def tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Text prompts' token ids (in the text pool); id prompts as they are."""
        tok = self.tokenizer
        out = []
        for p, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt = await self.engine.run_in_text_pool(
                    lambda text=prompt, p=p: prompt_ids(text, p, tok))
            out.append(prompt)
        return out

    async def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "the checkpoint has no tokenizer.json: chat needs one "
                                   "(use /v1/completions with token ids)", "messages")
        template = tok.chat_template
        if template is None:
            raise OpenAIError(400, "the checkpoint has no chat template (tokenizer_config."
                                   "json 'chat_template'): use /v1/completions", "messages")
        if not body.messages:
            raise OpenAIError(400, "messages is empty", "messages")
        try:
            messages = [m.template_dict(i) for i, m in enumerate(body.messages)]
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        # As vLLM: the request's chat_template_kwargs are laid over the named fields (a client
        # may set add_generation_prompt there); "messages" is the conversation itself.
        extra = body.chat_template_kwargs or {}
        if "messages" in extra:
            raise OpenAIError(400, "chat_template_kwargs cannot set 'messages' (the "
                                   "conversation is the request's messages)",
                              "chat_template_kwargs")
        kwargs = dict(add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                      documents=body.documents)
        kwargs.update(extra)

        def render() -> list[int]:
            text = template.render(messages, **kwargs)
            return tok.encode(text, what="the rendered messages", add_special_tokens=False)

        try:
            return await self.engine.run_in_text_pool(render)
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        except ImportError as exc:
            raise OpenAIError(501, f"chat templates need jinja2 on the server (pip install "
                                   f"'specengine[server]'): {exc}") from None

    # -- running ---------------------------------------------------------------------------
    def _streams(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        return [_numbered(p, self.engine.generate_stream(
                    prompt, job.params, k=job.k, tree=job.tree, k_max=job.k_max,
                    request_id=job.request_id(p)))
                for p, prompt in enumerate(job.prompts)]

    async def run(self, job: Job, body: OpenAIRequest, request: Request
                  ) -> list[GenerationOutput] | None:
        """Every choice's output in choice order, or None when the client left (its
        requests aborted)."""
        async def group(p: int, stream: AsyncIterator[RequestOutput]) -> list[GenerationOutput]:
            outs: dict[str, GenerationOutput] = {}
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for out in stream:
                    if out.output is not None:
                        outs[out.request_id] = out.output
            return [outs[rid] for rid in job.sample_ids(p)]

        ids = job.all_ids()
        self.state.live.update(ids)
        try:
            done, groups = await unless_disconnected(
                _all_or_none([group(p, s) for p, s in enumerate(self._streams(job))]), request)
        except REFUSALS as exc:
            raise refusal(exc, body, default_param(body)) from None
        finally:
            for rid in ids:
                self.state.live.discard(rid)
        if not done:
            self.state.metrics.disconnects.inc()
            return None
        outs = [o for g in groups for o in g]  # type: ignore[union-attr]
        for out in outs:
            self.state.metrics.observe_finished(out)
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:  # it alone failed inside a step; the others went on
            raise OpenAIError(500, f"a sample of request {job.id!r} failed in the engine "
                                   f"after {len(failed.token_ids)} tokens: {failed.error}")
        return outs

    # -- answers -------------------------------------------------------------------------------
    def token_texts(self, ids: Iterable[int], as_ids: bool) -> list[str]:
        """Each token's own text (special tokens spelled out), or ``"token_id:<id>"``."""
        ids = list(ids)
        if as_ids or self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        cache = self._token_text
        missing = sorted({t for t in ids if t not in cache})
        if missing:
            texts = self.tokenizer.tokenizer.decode_batch([[t] for t in missing],
                                                         skip_special_tokens=False)
            cache.update(zip(missing, texts))
        return [cache[t] for t in ids]

    def final_text(self, out: GenerationOutput, body: OpenAIRequest) -> str:
        if self.tokenizer is None:
            return ""
        # a stop string cut the engine's text (the ids end with the token that completed it)
        cut = isinstance(out.stop_reason, str)
        if (body.skip_special_tokens or cut) and out.text is not None:
            return out.text
        return self.tokenizer.tokenizer.decode(list(out.token_ids),
                                               skip_special_tokens=body.skip_special_tokens)

    def completion_logprobs(self, out: GenerationOutput, body: OpenAIRequest
                            ) -> dict[str, Any]:
        tokens = self.token_texts(out.token_ids, body.return_tokens_as_token_ids)
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        if out.top_logprobs:
            # OpenAI's legacy shape: per token {text: logprob} of the N most likely and the
            # emitted token (as vLLM: the emitted one is kept even when it is not in the top N)
            top = [dict(zip(self.token_texts(alt, body.return_tokens_as_token_ids),
                            alt.values())) for alt in out.top_logprobs]
        else:  # logprobs=0: as vLLM, one entry per token, the emitted one
            top = [{t: lp} for t, lp in zip(tokens, out.logprobs)]
        return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": top,
                "text_offset": offsets}

    def chat_logprobs(self, out: GenerationOutput, body: OpenAIRequest) -> dict[str, Any]:
        tokens = self.token_texts(out.token_ids, body.return_tokens_as_token_ids)
        n = body.top_n() or 0
        tops: list[list[dict[str, Any]]] = [[] for _ in tokens]
        for j, alt in enumerate(out.top_logprobs):
            # chat's shape: the N most likely only, most likely first (as OpenAI and vLLM)
            best = sorted(alt.items(), key=lambda kv: -kv[1])[:n]
            texts = self.token_texts([t for t, _ in best], body.return_tokens_as_token_ids)
            tops[j] = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                       for t, (_, lp) in zip(texts, best)]
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": top}
                            for t, lp, top in zip(tokens, out.logprobs, tops)],
                "refusal": None}

    @staticmethod
    def extras(out: GenerationOutput, body: OpenAIRequest, job: Job) -> dict[str, Any]:
        """This engine's per-choice fields (and vLLM's ``stop_reason``: the stop string or
        stop token id that ended it, None for EOS or a length finish)."""
        extra: dict[str, Any] = {
            "stop_reason": out.stop_reason, "weight_version": out.weight_version,
            "num_steps": out.num_steps, "num_draft_tokens": out.num_draft_tokens,
            "num_accepted_tokens": out.num_accepted_tokens}
        if body.return_token_ids:
            extra["token_weight_versions"] = list(out.token_weight_versions)
        return extra

    def usage(self, job: Job, outs: Iterable[GenerationOutput]) -> dict[str, Any]:
        outs = list(outs)
        prompt = sum(len(p) for p in job.prompts)  # each prompt once, whatever n
        completion = sum(len(o.token_ids) for o in outs)
        # vLLM's prompt_tokens_details.cached_tokens: prefix-cache hits, each prompt once
        # (a group's first sample made the prefill; its siblings borrow it)
        cached = sum(o.num_cached_tokens for o in outs if o.sample_index == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion_answer(self, job: Job, body: CompletionRequest,
                          outs: list[GenerationOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            choice: dict[str, Any] = {
                "index": index, "text": self.final_text(out, body),
                "logprobs": (self.completion_logprobs(out, body)
                             if body.logprobs is not None else None),
                "finish_reason": out.finish_reason}
            if body.return_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(out.token_ids)
            choice.update(self.extras(out, body, job))
            choices.append(choice)
        return {"id": job.id, "object": "text_completion", "created": job.created,
                "model": self.model_name, "choices": choices, "usage": self.usage(job, outs),
                "system_fingerprint": None}

    def chat_answer(self, job: Job, body: ChatCompletionRequest,
                    outs: list[GenerationOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": self.final_text(out, body),
                            "refusal": None, "tool_calls": []},
                "logprobs": self.chat_logprobs(out, body) if body.logprobs else None,
                "finish_reason": out.finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choice.update(self.extras(out, body, job))
            choices.append(choice)
        answer: dict[str, Any] = {
            "id": job.id, "object": "chat.completion", "created": job.created,
            "model": self.model_name, "choices": choices, "usage": self.usage(job, outs),
            "system_fingerprint": None}
        if body.return_token_ids:
            answer["prompt_token_ids"] = list(job.prompts[0])
        return answer

    # -- streaming -----------------------------------------------------------------------------
    async def stream(self, job: Job, body: CompletionRequest | ChatCompletionRequest,
                     request: Request) -> Response:
        """Start the job's requests, wait until every prompt is admitted (bad input is an
        error answer, before any byte of the stream), then stream its chunks."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue())
        loop = asyncio.get_running_loop()
        admitted = [loop.create_future() for _ in job.prompts]

        async def pump(p: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    async for out in stream:
                        if not admitted[p].done():
                            admitted[p].set_result(None)
                        queue.put_nowait((p, out))
                queue.put_nowait((p, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if admitted[p].done():
                    queue.put_nowait((p, exc))
                else:
                    admitted[p].set_exception(exc)

        ids = job.all_ids()
        self.state.live.update(ids)
        pumps = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(self._streams(job))]

        async def stop() -> None:
            # The synchronous part first: in a response whose client left, anyio cancels
            # every await of this scope, the one below included. A cancelled pump closes
            # its stream, which cancels its samples on the engine thread.
            for t in pumps:
                t.cancel()
            for f in admitted:
                if f.done() and not f.cancelled():
                    f.exception()  # retrieved: no "never retrieved" warning
            for rid in ids:
                self.state.live.discard(rid)
            await asyncio.gather(*pumps, return_exceptions=True)

        async def all_admitted() -> None:
            # a task, not gather's future: a cancelled gather ends with a CancelledError
            # *exception* (not cancelled), so a client gone before admission raised it out of
            # the handler instead of getting the 499 below
            await asyncio.gather(*admitted)

        try:
            done, _ = await unless_disconnected(all_admitted(), request)
        except REFUSALS as exc:
            await stop()
            raise refusal(exc, body, default_param(body)) from None
        except BaseException:
            await stop()
            raise
        if not done:
            await stop()
            self.state.metrics.disconnects.inc()
            return Response(status_code=499)  # client closed the request; unread
        chunks = _Chunks(self, job, body)
        return EventStream(self._events(job, chunks, queue, stop),
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(self, job: Job, chunks: _Chunks,
                      queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]],
                      stop: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        remaining, finished = len(job.prompts), 0
        try:
            while remaining:
                p, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                out = item.output
                if out is not None:
                    finished += 1
                    self.state.metrics.observe_finished(out)
                    if out.finish_reason == "error":  # it alone failed in the engine
                        raise OpenAIError(500, f"a sample of request {job.id!r} failed in "
                                               f"the engine after {len(out.token_ids)} "
                                               f"tokens: {out.error}")
                chunk = chunks.of(p, item)
                if chunk is not None:
                    yield _event(chunk)
            if chunks.body.include_usage():
                yield _event(chunks.usage_chunk())
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            if finished < len(job.prompts) * job.n:
                self.state.metrics.disconnects.inc()
            raise
        except Exception as exc:  # the 200 header is out: the error is the last event
            status, message = ((exc.status, exc.message) if isinstance(exc, OpenAIError)
                               else (status_for(exc), str(exc)))
            self.state.metrics.observe_error(status)
            if status == 500 and not isinstance(exc, OpenAIError):
                logger.error("stream of %r failed", job.id, exc_info=exc)
            yield _event(error_body(status, message))
            yield b"data: [DONE]\n\n"
        finally:
            await stop()


class _Chunks:
    """The chunks of one streamed call: each engine step's output of a sample becomes a
    chunk of its choice (text decoded so far; token ids with ``return_token_ids``); a
    choice's last chunk has its finish reason, the rest of its text, its logprobs and the
    engine's extras."""

    def __init__(self, server: OpenAIServer, job: Job, body: OpenAIRequest) -> None:
        self.server, self.job, self.body = server, job, body
        self.chat = isinstance(body, ChatCompletionRequest)
        self.texts: dict[int, IncrementalText] = {}
        self.outs: dict[int, GenerationOutput] = {}
        self.started_prompt = False  # chat: the prompt's ids go in the stream's first chunk

    def _frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "id": self.job.id, "object": "chat.completion.chunk" if self.chat
            else "text_completion", "created": self.job.created,
            "model": self.server.model_name, "choices": choices}
        if self.chat and self.body.return_token_ids and not self.started_prompt:
            frame["prompt_token_ids"] = list(self.job.prompts[0])
        self.started_prompt = True
        return frame

    def of(self, p: int, out: RequestOutput) -> dict[str, Any] | None:
        index = self.job.choice_index(p, out.request_id)
        first = index not in self.texts
        if first or out.restarted:  # a restart voids what came before (policy_lag_action)
            stops = self.job.params.stop
            self.texts[index] = IncrementalText(
                self.server.tokenizer, self.body.skip_special_tokens,
                max(map(len, stops)) - 1 if stops else 0)
        text = self.texts[index]
        final = out.output
        if final is None:
            delta = text.push(out.new_token_ids)
        else:  # the final text (cut at a stop string) completes what was handed out
            self.outs[index] = final
            text.ids.extend(out.new_token_ids)
            delta = text.finish(self.server.final_text(final, self.body))
        if not (delta or first or final is not None or out.restarted
                or (self.body.return_token_ids and out.new_token_ids)):
            return None
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": delta} if first
                               else {"content": delta} if delta else {})
        else:
            choice["text"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = None if final is None else final.finish_reason
        if out.restarted:
            choice["restarted"] = True
        if self.body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
            if first and not self.chat:
                choice["prompt_token_ids"] = list(self.job.prompts[p])
        if final is not None:
            if self.chat and self.body.logprobs:  # type: ignore[union-attr]
                choice["logprobs"] = self.server.chat_logprobs(final, self.body)
            elif not self.chat and self.body.logprobs is not None:  # type: ignore[union-attr]
                choice["logprobs"] = self.server.completion_logprobs(final, self.body)
            choice.update(self.server.extras(final, self.body, self.job))
        return self._frame([choice])

    def usage_chunk(self) -> dict[str, Any]:
        frame = self._frame([])
        frame["usage"] = self.server.usage(self.job, self.outs.values())
        return frame


def register_openai_api(app: FastAPI, state: ServerState,
                        served_model_name: str | None = None) -> OpenAIServer:
    """Mount the ``/v1/`` endpoints on ``app`` (made by ``build_app``, whose ``state`` they
    share) and their error shape. ``served_model_name``: the model's name in ``/v1/models``
    (default: the checkpoint directory's name)."""
    server = OpenAIServer(state, served_model_name)
    if server.tokenizer is not None and server.tokenizer.chat_template is not None:
        try:
            import jinja2  # noqa: F401
        except ImportError:
            logger.warning("the checkpoint has a chat template but jinja2 is not installed: "
                           "/v1/chat/completions will answer 501 (pip install jinja2)")
    app.add_middleware(OpenAIErrorShape)  # outermost: auth and body-size errors too
    plain_invalid = app.exception_handlers.get(RequestValidationError)

    async def invalid(request: Request, exc: Exception) -> Response:
        if not request.url.path.startswith(PREFIX) or not isinstance(
                exc, RequestValidationError):
            assert plain_invalid is not None
            return await plain_invalid(request, exc)
        _, message = describe_validation(exc)
        errors = exc.errors()
        state.metrics.observe_error(400)
        return error_response(400, message, _loc_param(errors[0].get("loc", ()))
                              if errors else None)

    async def refused(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        state.metrics.observe_error(exc.status)
        return error_response(exc.status, exc.message, exc.param)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(OpenAIError, refused)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "specengine", "root": server.model_path, "parent": None,
            "max_model_len": server.engine.engine.config.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = server.check(body)
        try:
            prompts = await server.tokenize(body.prompts())
        except REFUSALS as exc:
            raise refusal(exc, body, "prompt") from None
        job = server.job("cmpl", prompts, params, body)
        if body.stream:
            return await server.stream(job, body, request)
        outs = await server.run(job, body, request)
        if outs is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return _json(server.completion_answer(job, body, outs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        params = server.check(body)
        try:
            prompt = await server.render_chat(body)
        except REFUSALS as exc:
            raise refusal(exc, body, "messages") from None
        job = server.job("chatcmpl", [prompt], params, body)
        if body.stream:
            return await server.stream(job, body, request)
        outs = await server.run(job, body, request)
        if outs is None:
            return Response(status_code=499)
        return _json(server.chat_answer(job, body, outs))

    return server


__all__ = ["OpenAIError", "OpenAIErrorShape", "OpenAIServer", "error_body",
           "register_openai_api"]
