"""The OpenAI-compatible layer (``specengine.server.openai_api``) in-process, on the bundled
pair: the app is called as an ASGI application from the test (no socket, no server thread), and
the answer-building functions directly, so every answer field, error shape and stream rule is
pinned where the code that writes it runs:

- errors: OpenAI's ``{"error": {message, type, param, code}}`` with the type of the status,
  the field a message is about (an engine message's first word, a schema error's path), the
  server's own ``{"error": str}`` answers reshaped on ``/v1/`` paths only (422 -> 400);
- a call's requests (``Job``): ids ``{id}-{p}`` / ``{id}-{p}-{i}``, choice ``p * n + i``; a
  refusal from prompt p's stream names prompt p; a call is served whole or refused whole;
- admission checks (draining, model name, unsupported fields, the engine's refusal) and the
  request's ``k`` / ``k_max``, chat rendering and its refusals;
- answers: texts (special tokens, a stop string's cut), logprob shapes of both endpoints,
  usage (each prompt once), this engine's extras; streams: chunk shapes, the prompt's ids in
  the first chunk, usage last, a client that leaves before admission gets nothing (499).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from server_helpers import assert_idle_and_free, bundled_engine, in_engine  # noqa: E402

from specengine import AsyncSpecEngine, SamplingParams  # noqa: E402
from specengine.async_loop import EngineOverloadedError  # noqa: E402
from specengine.outputs import GenerationOutput, RequestOutput  # noqa: E402
from specengine.server import openai_api as oa  # noqa: E402
from specengine.server.app import build_app  # noqa: E402
from specengine.server.openai_schemas import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
)

MODEL = "arith-target"
PROMPT = "Q:1+2="
PROMPT_IDS = [17, 16, 3, 12, 4, 14]  # PROMPT in the bundled vocabulary
EOS = 1
MAX_WAITING = 16  # the engine's bound on unfinished requests


# ---- an in-process ASGI client ------------------------------------------------------------
async def _call(app: Any, method: str, path: str, body: object = None, *,
                leave: bool = False, gone_at: bytes | None = None, nth: int = 1,
                on_first_piece: Callable[[], Awaitable[None]] | None = None
                ) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request to ``app``: status, headers and the whole body. ``leave``: the client
    disconnects as soon as its body is sent; ``gone_at``: the connection is lost when the
    ``nth`` piece of the answer holding these bytes is sent (the send fails, as a server's
    does); ``on_first_piece``: awaited when the answer's first piece is sent."""
    data = b"" if body is None else (body if isinstance(body, bytes) else
                                     json.dumps(body).encode())
    gone = asyncio.Event()
    if leave:
        gone.set()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    seen = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal seen
        if gone_at is not None and gone_at in message.get("body", b""):
            seen += 1
            if seen == nth:
                raise OSError("the client's connection was reset")
        if on_first_piece is not None and message.get("body") and not any(
                m.get("body") for m in messages):
            await on_first_piece()
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5),
             "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())]}
    try:
        try:
            await app(scope, receive, send)
        except Exception as exc:  # the lost connection, as the server sees it
            assert gone_at is not None, exc
        # whatever the answer, a stream's pumps (one task per prompt) have ended with it
        left = [t for t in asyncio.all_tasks() if "pump" in t.get_coro().__qualname__]
        assert not left, left
    finally:
        gone.set()
    starts = [m for m in messages if m["type"] == "http.response.start"]
    if not starts:
        return 0, {}, b""
    (start,) = starts
    names = [k for k, _ in start.get("headers", ())]
    assert len(names) == len(set(names)), names  # each header once
    raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], dict(start.get("headers", ())), raw


def call(app: Any, method: str, path: str, body: object = None,
         **kw: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    return asyncio.run(_call(app, method, path, body, **kw))


def post(app: Any, path: str, body: object) -> tuple[int, Any]:
    status, _, raw = call(app, "POST", path, body)
    return status, json.loads(raw)


def events(app: Any, path: str, body: dict[str, Any]) -> list[Any]:
    status, headers, raw = call(app, "POST", path, {**body, "stream": True})
    assert status == 200, raw
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    eng = AsyncSpecEngine(bundled_engine(), max_waiting=MAX_WAITING)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def app(aeng: AsyncSpecEngine) -> Any:
    """A fresh app over the shared engine (building one is cheap: the engine is not)."""
    return build_app(aeng, default_k=0)


@pytest.fixture
def server(app: Any) -> oa.OpenAIServer:
    return oa.OpenAIServer(app.state.server)


def errors_counted(app: Any, status: int) -> float:
    value = app.state.server.metrics.registry.get_sample_value(
        "specengine_http_errors_total", {"status_code": str(status)})
    return value or 0.0


def reference(aeng: AsyncSpecEngine, prompt: list[int], params: SamplingParams
              ) -> list[GenerationOutput]:
    return in_engine(aeng, lambda e: e.generate([prompt], k=0, sampling=params))


def output(token_ids: tuple[int, ...], **kw: Any) -> GenerationOutput:
    """A finished output over PROMPT_IDS (the fields the answers read)."""
    base: dict[str, Any] = dict(
        prompt_token_ids=tuple(PROMPT_IDS), token_ids=token_ids,
        logprobs=tuple(-0.5 - i for i in range(len(token_ids))), finish_reason="length",
        num_steps=len(token_ids), num_draft_tokens=5, num_accepted_tokens=3)
    base.update(kw)
    return GenerationOutput(**base)


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("status,kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "invalid_request_error"), (499, "invalid_request_error"), (500, "server_error"),
    (501, "server_error"), (503, "server_error")])
def test_error_type_follows_the_status(status: int, kind: str) -> None:
    assert oa.error_type(status) == kind
    assert oa.error_body(status, "why", "n") == {
        "error": {"message": "why", "type": kind, "param": "n", "code": status}}


def test_error_response_is_openai_json_with_its_status() -> None:
    resp = oa.error_response(404, "no such model", "model")
    assert resp.status_code == 404 and resp.media_type == "application/json"
    assert json.loads(resp.body) == {"error": {
        "message": "no such model", "type": "not_found_error", "param": "model", "code": 404}}
    assert json.loads(oa.error_response(400, "bad").body)["error"]["param"] is None
    assert oa.error_body(400, "bad")["error"]["param"] is None
    ok = oa._json({"lp": float("-inf")})
    assert ok.status_code == 200 and ok.media_type == "application/json"
    assert ok.body == b'{"lp": -Infinity}'  # a -inf logprob is written, not refused


@pytest.mark.parametrize("message,param", [
    ("max_tokens must be an int >= 1, got 0", "max_tokens"),
    ("stop[0] is empty", "stop"),
    ("n=0 is not allowed", "n"),
    ("temperature(-1.0) is negative", "temperature"),
    ("top_p", "top_p"),
    ("prompt 1 has 300 tokens", "prompt"),
    ("the prompt is too long", None),
    ("maximum tokens exceeded", None),
])
def test_an_engine_message_names_the_field_it_starts_with(message: str, param: str | None
                                                          ) -> None:
    fields = CompletionRequest.model_fields
    assert oa._param_of(message, fields) == param
    body = CompletionRequest(prompt="x")
    err = oa.refusal(ValueError(message), body, "prompt-default")
    assert (err.status, err.message, str(err)) == (400, message, message)
    assert err.param == (param or "prompt-default")


def test_a_refusal_takes_the_engines_status_and_default_field() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1+1="}])
    err = oa.refusal(EngineOverloadedError("64 requests are unfinished"), body,
                     oa.default_param(body))
    assert (err.status, err.param) == (503, "messages")
    assert oa.default_param(body) == "messages"
    assert oa.default_param(CompletionRequest(prompt="x")) == "prompt"
    assert oa.refusal(RuntimeError("boom"), body, None).status == 500


@pytest.mark.parametrize("loc,param", [
    (("body", "messages", 0, "role"), "messages.0.role"),
    (("body", "k", "literal['auto']"), "k"),
    (("body", "prompt", "list[int]", 2), "prompt"),
    (("body", "temperature", "float"), "temperature"),
    (("body", "seed", "int"), "seed"),
    (("body", "model", "str"), "model"),
    (("body", "ignore_eos", "bool"), "ignore_eos"),
    (("body", "stop", "list", 0), "stop"),
    (("body", "logit_bias", "dict"), "logit_bias"),
    (("body", "stream_options", "include_usage"), "stream_options.include_usage"),
    (("body",), None),
    ((), None),
])
def test_a_schema_errors_field_is_its_path_without_union_tags(loc: tuple, param: str | None
                                                              ) -> None:
    assert oa._loc_param(loc) == param


def test_server_errors_are_reshaped_on_v1_only() -> None:
    status, body = oa._reshape(422, b'{"error": "n: bad"}')
    assert status == 400 and json.loads(body) == oa.error_body(400, "n: bad")
    status, body = oa._reshape(401, b'{"error": "no key"}')
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    for raw in (b"not json", b'{"error": {"message": "x"}}', b'["error"]'):
        assert oa._reshape(409, raw) == (409, raw)


def test_unknown_v1_route_and_bad_body_have_openai_shape(app: Any) -> None:
    status, headers, raw = call(app, "GET", "/v1/nothing-here")
    assert status == 404 and int(headers[b"content-length"]) == len(raw)
    assert json.loads(raw) == oa.error_body(404, "no such endpoint")
    # other paths keep the server's own shape
    status, _, raw = call(app, "GET", "/nothing-here")
    assert status == 404 and json.loads(raw) == {"error": "no such endpoint"}
    before = errors_counted(app, 400)
    status, answer = post(app, "/v1/completions", {"prompt": "Q:1=", "temperature": "hot"})
    assert status == 400 and answer["error"]["param"] == "temperature"
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == 400
    assert "temperature" in answer["error"]["message"]
    assert errors_counted(app, 400) == before + 1
    status, answer = post(app, "/v1/chat/completions", {"messages": [{"role": "robot"}]})
    assert status == 400 and answer["error"]["param"] == "messages.0.role"
    # outside /v1/ a schema error keeps its 422 and the server's shape
    status, answer = post(app, "/generate", {"prompt": 5})
    assert status == 422 and isinstance(answer["error"], str)
    status, _, raw = call(app, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("malformed JSON")


def test_refused_calls_answer_openai_errors_and_count_them(app: Any) -> None:
    before = errors_counted(app, 404)
    status, answer = post(app, "/v1/completions", {"model": "gpt-9", "prompt": PROMPT})
    assert status == 404 and answer == oa.error_body(
        404, "the model 'gpt-9' does not exist: this server serves 'arith-target'", "model")
    assert errors_counted(app, 404) == before + 1
    status, answer = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    status, answer = post(app, "/v1/completions", {"prompt": ["Q:1=", "Q:é"]})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert answer["error"]["message"].startswith("prompt 1 has a character outside")
    status, answer = post(app, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "be brief"}]})
    assert status == 400 and answer["error"]["param"] == "messages"
    assert "got role system" in answer["error"]["message"]
    # a prompt too long for the context: the engine's refusal, for the prompt's field
    status, answer = post(app, "/v1/completions", {"prompt": PROMPT_IDS * 50})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    status, answer = post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "1" * 300}]})
    assert status == 400 and answer["error"]["param"] == "messages", answer
    in_engine(app.state.server.engine, assert_idle_and_free)


# ---- a call's requests -------------------------------------------------------------------------
def test_a_jobs_request_ids_and_choice_indexes() -> None:
    group = oa.Job("cmpl-x", [[1, 2], [3]], SamplingParams(n=3), 0, 8)
    assert group.n == 3 and group.request_id(1) == "cmpl-x-1"
    assert group.sample_ids(1) == ["cmpl-x-1-0", "cmpl-x-1-1", "cmpl-x-1-2"]
    assert group.all_ids() == ["cmpl-x-0-0", "cmpl-x-0-1", "cmpl-x-0-2",
                               "cmpl-x-1-0", "cmpl-x-1-1", "cmpl-x-1-2"]
    assert [group.choice_index(p, f"cmpl-x-{p}-{i}") for p in (0, 1) for i in (0, 1, 2)] == [
        0, 1, 2, 3, 4, 5]
    single = oa.Job("c-y", [[1], [2], [3]], SamplingParams(), 0, 8)
    assert single.sample_ids(2) == ["c-y-2"] and single.all_ids() == ["c-y-0", "c-y-1", "c-y-2"]
    assert [single.choice_index(p, f"c-y-{p}") for p in range(3)] == [0, 1, 2]
    assert isinstance(single.created, int) and abs(single.created - time.time()) < 3600


async def _refusing(message: str, first: object = None) -> AsyncIterator[object]:
    if first is not None:
        yield first
    raise ValueError(message)


@pytest.mark.parametrize("p,message,want", [
    (0, "prompt 0 has 300 tokens", "prompt 0 has 300 tokens"),
    (2, "prompt 0 has 300 tokens", "prompt 2 has 300 tokens"),
    (3, "token 7 of prompt 0 is out of the vocabulary (of prompt 0 too)",
     "token 7 of prompt 3 is out of the vocabulary (of prompt 0 too)"),
    (1, "max_tokens must be >= 1", "max_tokens must be >= 1"),
])
def test_a_refusal_from_prompt_p_names_prompt_p(p: int, message: str, want: str) -> None:
    async def run() -> list[object]:
        got = []
        with pytest.raises(ValueError) as e:
            async for out in oa._numbered(p, _refusing(message, first="out")):
                got.append(out)
        assert str(e.value) == want
        return got

    assert asyncio.run(run()) == ["out"]


def test_a_numbered_stream_closes_its_source_when_left() -> None:
    closed = []

    async def source() -> AsyncIterator[int]:
        try:
            for i in range(10):
                yield i
        finally:
            closed.append(True)

    async def run() -> int:
        it = oa._numbered(1, source())
        first = await anext(it)
        await it.aclose()
        return first

    assert asyncio.run(run()) == 0 and closed == [True]


def test_a_call_is_served_whole_or_refused_whole() -> None:
    """Every result in order; or the first error, raised once the other works have ended
    (cancelled)."""

    async def ok(v: int) -> int:
        return v

    async def run() -> None:
        assert await oa._all_or_none([ok(1), ok(2), ok(3)]) == [1, 2, 3]
        cancelled = []

        async def waits() -> int:
            try:
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return 0  # pragma: no cover

        async def bad() -> int:
            raise ValueError("prompt 1 is bad")

        with pytest.raises(ValueError, match="prompt 1 is bad"):
            await oa._all_or_none([waits(), bad()])
        assert cancelled == [True]  # already, when the error arrives

    asyncio.run(run())


def test_the_first_error_of_a_call_is_the_one_raised() -> None:
    """Prompt 1 fails first, then prompt 0 (before the call's error is handled): the call's
    error is prompt 1's."""

    async def run() -> None:
        first_failed = asyncio.Event()

        async def later() -> int:
            await first_failed.wait()
            raise ValueError("prompt 0 is bad")

        async def first() -> int:
            first_failed.set()
            raise ValueError("prompt 1 is bad")

        with pytest.raises(ValueError, match="prompt 1 is bad"):
            await oa._all_or_none([later(), first()])

    asyncio.run(run())


@pytest.mark.parametrize("p", [0, 1])
def test_a_refusal_naming_no_prompt_passes_as_raised(p: int) -> None:
    class Refused(ValueError):
        pass

    refused = Refused("max_tokens must be >= 1")

    async def source() -> AsyncIterator[int]:
        raise refused
        yield 0  # pragma: no cover

    async def run() -> None:
        with pytest.raises(Refused) as e:
            async for _ in oa._numbered(p, source()):
                pass  # pragma: no cover
        assert e.value is refused

    asyncio.run(run())


# ---- admission -----------------------------------------------------------------------------
def test_the_server_names_its_model_by_the_checkpoint(aeng: AsyncSpecEngine, app: Any) -> None:
    srv = oa.OpenAIServer(app.state.server)
    path = str(aeng.engine.config.model)
    assert srv.model_name == MODEL and srv.model_path == path
    assert srv.tokenizer is aeng.engine.tokenizer
    assert oa.OpenAIServer(app.state.server, "policy-v2").model_name == "policy-v2"
    status, _, raw = call(app, "GET", "/v1/models")
    (model,) = json.loads(raw)["data"]
    assert status == 200 and json.loads(raw)["object"] == "list"
    assert {k: v for k, v in model.items() if k != "created"} == {
        "id": MODEL, "object": "model", "owned_by": "specengine", "root": path,
        "parent": None, "max_model_len": 256}
    assert abs(model["created"] - time.time()) < 3600
    named = build_app(aeng, served_model_name="policy-v2")
    assert json.loads(call(named, "GET", "/v1/models")[2])["data"][0]["id"] == "policy-v2"


def test_admission_checks(server: oa.OpenAIServer) -> None:
    body = CompletionRequest(prompt="x", model=MODEL, max_tokens=5, temperature=0.5)
    assert server.check(body) == body.to_params()
    assert server.check(CompletionRequest(prompt="x", model=server.model_path)).max_tokens == 16
    assert server.check(CompletionRequest(prompt="x")) == CompletionRequest(
        prompt="x").to_params()
    with pytest.raises(oa.OpenAIError) as e:
        server.check(CompletionRequest(prompt="x", model="other"))
    assert (e.value.status, e.value.param) == (404, "model")
    with pytest.raises(oa.OpenAIError) as e:
        server.check(CompletionRequest(prompt="x", presence_penalty=0.5))
    assert (e.value.status, e.value.param) == (400, "presence_penalty")
    assert e.value.message == CompletionRequest(
        prompt="x", presence_penalty=0.5).unsupported()[1]
    with pytest.raises(oa.OpenAIError) as e:
        server.check(CompletionRequest(prompt="x", top_p=1.5))
    assert (e.value.status, e.value.param) == (400, "top_p") and "top_p" in e.value.message
    server.state.draining = True
    try:
        with pytest.raises(oa.OpenAIError) as e:
            server.check(CompletionRequest(prompt="x"))
        assert (e.value.status, e.value.param) == (503, None)
        assert e.value.message == "the server is shutting down: no new requests"
    finally:
        server.state.draining = False


def test_a_jobs_k_is_the_requests_or_the_servers(server: oa.OpenAIServer) -> None:
    params = SamplingParams()
    server.state.default_k, server.state.default_k_max = 2, 5
    job = server.job("chatcmpl", [[1]], params, CompletionRequest(prompt="x"))
    assert (job.k, job.k_max, job.params, job.prompts) == (2, 5, params, [[1]])
    assert job.id.startswith("chatcmpl-") and len(job.id) == len("chatcmpl-") + 32
    int(job.id.removeprefix("chatcmpl-"), 16)
    job = server.job("cmpl", [[1]], params, CompletionRequest(prompt="x", k=3, k_max=4))
    assert (job.k, job.k_max) == (3, 4)
    assert server.job("cmpl", [[1]], params, CompletionRequest(prompt="x")).id != job.id


def test_prompts_are_tokenized_and_id_prompts_kept(server: oa.OpenAIServer) -> None:
    got = asyncio.run(server.tokenize([PROMPT, [5, 6], "Q:2="]))
    assert got == [PROMPT_IDS, [5, 6], [17, 16, 4, 14]]
    with pytest.raises(ValueError, match="^prompt 2 has a character outside"):
        asyncio.run(server.tokenize([PROMPT, [5], "Q:x"]))


def test_chat_renders_the_template_without_special_tokens(server: oa.OpenAIServer) -> None:
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "A:3"},
        {"role": "user", "content": [{"type": "text", "text": "2+"},
                                     {"type": "text", "text": "2="}]}])
    # the bundled template: "Q:" + user, assistant + eos (no newline parts here: "\n" is
    # not in the vocabulary, so the two parts are refused below)
    with pytest.raises(ValueError, match="^the rendered messages has a character outside.*"
                                         "'\\\\n' at position 18"):
        asyncio.run(server.render_chat(body))
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "A:3"},
        {"role": "user", "content": "2="}])
    tok = server.tokenizer
    want = tok.tokenizer.encode("Q:1+2=A:3<eos>Q:2=", add_special_tokens=False).ids
    assert asyncio.run(server.render_chat(body)) == want == (
        PROMPT_IDS + [18, 16, 5, EOS, 17, 16, 4, 14])


@pytest.mark.parametrize("messages,message", [
    ([], "messages is empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]: only text parts ({'type': 'text', 'text': ...}) are supported, "
     "got type 'image_url'"),
    ([{"role": "tool", "content": "4"}],
     "the chat template refused the messages: the arithmetic model takes user and assistant "
     "messages only, got role tool"),
])
def test_chat_refusals_are_400s_on_messages(server: oa.OpenAIServer, messages: list,
                                            message: str) -> None:
    with pytest.raises(oa.OpenAIError) as e:
        asyncio.run(server.render_chat(ChatCompletionRequest(messages=messages)))
    assert (e.value.status, e.value.param) == (400, "messages")
    assert e.value.message == message


def test_chat_needs_a_tokenizer_and_a_template(server: oa.OpenAIServer) -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1="}])
    tok = server.tokenizer
    try:
        server.tokenizer = type(tok)(tok.tokenizer)  # the same vocabulary, no template
        with pytest.raises(oa.OpenAIError) as e:
            asyncio.run(server.render_chat(body))
        assert (e.value.status, e.value.param) == (400, "messages")
        assert e.value.message == ("the checkpoint has no chat template (tokenizer_config."
                                   "json 'chat_template'): use /v1/completions")
        server.tokenizer = None
        with pytest.raises(oa.OpenAIError) as e:
            asyncio.run(server.render_chat(body))
        assert (e.value.status, e.value.param) == (400, "messages")
        assert e.value.message == ("the checkpoint has no tokenizer.json: chat needs one "
                                   "(use /v1/completions with token ids)")
    finally:
        server.tokenizer = tok


# ---- answers -----------------------------------------------------------------------------------
def test_token_texts_spell_special_tokens_or_ids(server: oa.OpenAIServer) -> None:
    assert server.token_texts([17, 16, EOS, 0, 17], False) == ["Q", ":", "<eos>", "<pad>", "Q"]
    assert server.token_texts((5, EOS), True) == ["token_id:5", "token_id:1"]
    server.tokenizer = None
    assert server.token_texts(iter([4]), False) == ["token_id:4"]


def test_final_text_skips_special_tokens_unless_asked(server: oa.OpenAIServer) -> None:
    out = output((4, 12, 4, EOS), text="2+2", finish_reason="stop")
    plain = CompletionRequest(prompt="x")
    assert server.final_text(out, plain) == "2+2"
    assert server.final_text(out, CompletionRequest(prompt="x", skip_special_tokens=False)) == (
        "2+2<eos>")
    # a stop string cut the text: the cut text, even with special tokens asked for
    cut = output((4, 12, 4, 14), text="2", finish_reason="stop", stop_reason="+2")
    assert server.final_text(cut, CompletionRequest(prompt="x", skip_special_tokens=False)) == "2"
    # no text from the engine: decoded here
    assert server.final_text(output((4, 12, EOS)), plain) == "2+"
    server.tokenizer = None
    assert server.final_text(out, plain) == ""


def test_completion_logprobs_shape(server: oa.OpenAIServer) -> None:
    out = output((4, 12, EOS), logprobs=(-0.25, -0.5, -1.0))
    body = CompletionRequest(prompt="x", logprobs=0)
    assert server.completion_logprobs(out, body) == {
        "tokens": ["2", "+", "<eos>"], "token_logprobs": [-0.25, -0.5, -1.0],
        "top_logprobs": [{"2": -0.25}, {"+": -0.5}, {"<eos>": -1.0}],
        "text_offset": [0, 1, 2]}
    top = output((4, 12), logprobs=(-0.25, -3.0),
                 top_logprobs=({4: -0.2, 5: -2.0}, {13: -0.1, 12: -2.9, 2: -4.0}))
    got = server.completion_logprobs(top, CompletionRequest(
        prompt="x", logprobs=2, return_tokens_as_token_ids=True))
    assert got == {"tokens": ["token_id:4", "token_id:12"], "token_logprobs": [-0.25, -3.0],
                   "top_logprobs": [{"token_id:4": -0.2, "token_id:5": -2.0},
                                    {"token_id:13": -0.1, "token_id:12": -2.9,
                                     "token_id:2": -4.0}],
                   "text_offset": [0, 10]}
    # text offsets: where each token's text starts in the joined text
    long = output((17, EOS, 4))
    assert server.completion_logprobs(long, body)["text_offset"] == [0, 1, 6]


def test_chat_logprobs_shape(server: oa.OpenAIServer) -> None:
    out = output((4, 12), logprobs=(-0.25, -3.0),
                 top_logprobs=({5: -2.0, 4: -0.2}, {12: -2.9, 2: -4.0, 13: -0.1}))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1"}], logprobs=True,
                                 top_logprobs=2)
    assert server.chat_logprobs(out, body) == {"content": [
        {"token": "2", "logprob": -0.25, "bytes": [50], "top_logprobs": [
            {"token": "2", "logprob": -0.2, "bytes": [50]},
            {"token": "3", "logprob": -2.0, "bytes": [51]}]},
        {"token": "+", "logprob": -3.0, "bytes": [43], "top_logprobs": [
            {"token": "*", "logprob": -0.1, "bytes": [42]},
            {"token": "+", "logprob": -2.9, "bytes": [43]}]}], "refusal": None}
    as_ids = ChatCompletionRequest(messages=[{"role": "user", "content": "1"}],
                                   logprobs=True, top_logprobs=1,
                                   return_tokens_as_token_ids=True)
    got = server.chat_logprobs(out, as_ids)["content"]
    assert [c["token"] for c in got] == ["token_id:4", "token_id:12"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in got] == [
        ["token_id:4"], ["token_id:13"]]
    assert got[0]["bytes"] == list(b"token_id:4")
    # logprobs without top_logprobs: no alternatives
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "1"}], logprobs=True)
    assert [c["top_logprobs"] for c in server.chat_logprobs(out, plain)["content"]] == [[], []]


def test_usage_counts_each_prompt_once(server: oa.OpenAIServer) -> None:
    job = oa.Job("cmpl-u", [[1, 2, 3], [4, 5]], SamplingParams(n=2), 0, 8)
    outs = [output((4,), sample_index=0, num_cached_tokens=4),
            output((4, 5), sample_index=1, num_cached_tokens=6),
            output((4, 5, 6), sample_index=0, num_cached_tokens=2),
            output((), sample_index=1, num_cached_tokens=6)]
    assert server.usage(job, iter(outs)) == {
        "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 6}}


def test_extras_are_the_engines_per_choice_fields() -> None:
    out = output((4, 12), finish_reason="stop", stop_reason=12, weight_version=3,
                 token_weight_versions=(2, 3))
    job = oa.Job("j", [[1]], SamplingParams(), 0, 8)
    want = {"stop_reason": 12, "weight_version": 3, "num_steps": 2, "num_draft_tokens": 5,
            "num_accepted_tokens": 3}
    assert oa.OpenAIServer.extras(out, CompletionRequest(prompt="x"), job) == want
    assert oa.OpenAIServer.extras(out, CompletionRequest(prompt="x", return_token_ids=True),
                                  job) == {**want, "token_weight_versions": [2, 3]}


def test_completion_answer_shape(server: oa.OpenAIServer) -> None:
    job = oa.Job("cmpl-a", [PROMPT_IDS], SamplingParams(n=2), 0, 8)
    outs = [output((4, EOS), text="2", finish_reason="stop"),
            output((5, 12), text="3+", sample_index=1)]
    body = CompletionRequest(prompt="x", return_token_ids=True)
    answer = server.completion_answer(job, body, outs)
    assert {k: v for k, v in answer.items() if k != "choices"} == {
        "id": "cmpl-a", "object": "text_completion", "created": job.created, "model": MODEL,
        "usage": server.usage(job, outs), "system_fingerprint": None}
    extras = [oa.OpenAIServer.extras(o, body, job) for o in outs]
    assert answer["choices"] == [
        {"index": 0, "text": "2", "logprobs": None, "finish_reason": "stop",
         "prompt_token_ids": PROMPT_IDS, "token_ids": [4, EOS], **extras[0]},
        {"index": 1, "text": "3+", "logprobs": None, "finish_reason": "length",
         "prompt_token_ids": PROMPT_IDS, "token_ids": [5, 12], **extras[1]}]
    with_lp = server.completion_answer(job, CompletionRequest(prompt="x", logprobs=0), outs)
    assert with_lp["choices"][1]["logprobs"] == server.completion_logprobs(
        outs[1], CompletionRequest(prompt="x", logprobs=0))
    assert "token_ids" not in with_lp["choices"][0]
    assert "prompt_token_ids" not in with_lp["choices"][0]


def test_chat_answer_shape(server: oa.OpenAIServer) -> None:
    job = oa.Job("chatcmpl-a", [PROMPT_IDS], SamplingParams(), 0, 8)
    outs = [output((4, EOS), text="2", finish_reason="stop")]
    msgs = [{"role": "user", "content": "1"}]
    body = ChatCompletionRequest(messages=msgs, return_token_ids=True, logprobs=True)
    answer = server.chat_answer(job, body, outs)
    assert answer == {
        "id": "chatcmpl-a", "object": "chat.completion", "created": job.created,
        "model": MODEL, "usage": server.usage(job, outs), "system_fingerprint": None,
        "prompt_token_ids": PROMPT_IDS,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "2",
                                             "refusal": None, "tool_calls": []},
                     "logprobs": server.chat_logprobs(outs[0], body), "finish_reason": "stop",
                     "token_ids": [4, EOS], **oa.OpenAIServer.extras(outs[0], body, job)}]}
    plain = server.chat_answer(job, ChatCompletionRequest(messages=msgs), outs)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None
    assert "token_weight_versions" not in plain["choices"][0]


# ---- whole calls -------------------------------------------------------------------------------
def test_completion_call_equals_generate(aeng: AsyncSpecEngine, app: Any) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=4, ignore_eos=True)
    status, answer = post(app, "/v1/completions", {
        "model": MODEL, "prompt": [PROMPT, PROMPT_IDS[:4]], "max_tokens": 6, "n": 2,
        "seed": 4, "ignore_eos": True, "temperature": 1.0, "return_token_ids": True})
    assert status == 200, answer
    want = reference(aeng, PROMPT_IDS, params) + reference(aeng, PROMPT_IDS[:4], params)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in answer["choices"]] == [list(o.token_ids) for o in want]
    assert [c["prompt_token_ids"] for c in answer["choices"]] == [PROMPT_IDS] * 2 + [
        PROMPT_IDS[:4]] * 2
    assert answer["usage"]["prompt_tokens"] == 10
    assert answer["usage"]["completion_tokens"] == 24
    assert answer["id"].startswith("cmpl-") and answer["model"] == MODEL
    finished = app.state.server.metrics.registry.get_sample_value(
        "specengine_requests_total", {"finish_reason": "length"})
    assert finished == 4  # every sample observed once
    assert not app.state.server.live


def test_chat_call_answers_the_rendered_prompt(aeng: AsyncSpecEngine, app: Any) -> None:
    status, answer = post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 8, "temperature": 0,
        "return_token_ids": True})
    assert status == 200, answer
    want = reference(aeng, PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert answer["prompt_token_ids"] == PROMPT_IDS and answer["object"] == "chat.completion"
    assert answer["choices"][0]["token_ids"] == list(want.token_ids)
    assert answer["choices"][0]["message"]["content"] == aeng.engine.tokenizer.decode(
        want.token_ids)
    assert answer["id"].startswith("chatcmpl-")


def test_a_client_that_leaves_gets_nothing_and_its_requests_end(aeng: AsyncSpecEngine,
                                                                 app: Any) -> None:
    metrics = app.state.server.metrics.registry
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 2}
    for path, extra in (("/v1/completions", {}), ("/v1/completions", {"stream": True}),
                        ("/v1/chat/completions", {})):
        if path.endswith("chat/completions"):
            body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 200,
                    "ignore_eos": True}
        before = metrics.get_sample_value("specengine_client_disconnects_total") or 0
        status, _, raw = call(app, "POST", path, {**body, **extra}, leave=True)
        assert (status, raw) == (499, b""), path
        assert metrics.get_sample_value("specengine_client_disconnects_total") == before + 1
        assert not app.state.server.live
    for _ in range(10_000):  # each call waits for the engine thread's next gap
        if not in_engine(aeng, lambda e: e.has_unfinished()):
            break
    in_engine(aeng, assert_idle_and_free)


# ---- streams -----------------------------------------------------------------------------------
def test_completion_stream_chunks(aeng: AsyncSpecEngine, app: Any) -> None:
    body = {"model": MODEL, "prompt": [PROMPT, PROMPT_IDS[:4]], "max_tokens": 5, "n": 2,
            "seed": 4, "ignore_eos": True, "temperature": 1.0, "return_token_ids": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    chunks = events(app, "/v1/completions", body)
    _, whole = post(app, "/v1/completions", {**body, "stream_options": None})
    *parts, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert app.state.server.metrics.registry.get_sample_value(
        "specengine_requests_total", {"finish_reason": "length"}) == 8  # stream + whole
    assert usage["object"] == "text_completion" and usage["model"] == MODEL
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["created"] == chunks[0]["created"] for c in chunks)
    by: dict[int, list[dict[str, Any]]] = {}
    for chunk in parts:
        assert chunk["object"] == "text_completion" and "prompt_token_ids" not in chunk
        (c,) = chunk["choices"]
        by.setdefault(c["index"], []).append(c)
    assert sorted(by) == [0, 1, 2, 3]
    for index, mine in by.items():
        want = whole["choices"][index]
        assert mine[0]["prompt_token_ids"] == want["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert "".join(c["text"] for c in mine) == want["text"]
        assert sum((c["token_ids"] for c in mine), []) == want["token_ids"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert [c["logprobs"] for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["logprobs"] == want["logprobs"]
        extras = {k: want[k] for k in ("stop_reason", "weight_version", "num_steps",
                                       "num_draft_tokens", "num_accepted_tokens",
                                       "token_weight_versions")}
        assert {k: mine[-1][k] for k in extras} == extras
        assert all("weight_version" not in c and "restarted" not in c for c in mine[:-1])
    assert not app.state.server.live


def test_chat_stream_chunks(app: Any) -> None:
    body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 6,
            "temperature": 0, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}
    chunks = events(app, "/v1/chat/completions", body)
    _, whole = post(app, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == PROMPT_IDS
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("role" not in c["delta"] for c in choices[1:])
    assert all("prompt_token_ids" not in c for c in choices)
    assert "".join(c["delta"].get("content", "") for c in choices) == (
        whole["choices"][0]["message"]["content"])
    assert sum((c["token_ids"] for c in choices), []) == whole["choices"][0]["token_ids"]
    assert choices[-1]["logprobs"] == whole["choices"][0]["logprobs"]
    assert [c["logprobs"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    # without token ids or usage: the stream has no usage chunk, chunks no ids
    plain = events(app, "/v1/chat/completions", {**body, "return_token_ids": False,
                                                  "logprobs": False, "top_logprobs": None})
    assert all(c["choices"] and "token_ids" not in c["choices"][0] for c in plain)
    assert "prompt_token_ids" not in plain[0]
    assert all(c["choices"][0]["logprobs"] is None for c in plain)


def test_a_stream_refused_at_admission_is_an_error_answer(app: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT_IDS * 50, "stream": True}),
                       ("/v1/chat/completions", {
                           "messages": [{"role": "user", "content": "1" * 300}],
                           "stream": True})):
        status, answer = post(app, path, body)
        assert status == 400 and answer["error"]["param"] == (
            "prompt" if "chat" not in path else "messages"), answer
    assert not app.state.server.live


def test_chunks_of_one_choice(server: oa.OpenAIServer) -> None:
    """Each engine step's output of a sample becomes a chunk: nothing to say (no text, no
    ids, not first or last) is no chunk; a restart starts the text over."""
    job = oa.Job("cmpl-s", [PROMPT_IDS], SamplingParams(n=2), 0, 8)
    body = CompletionRequest(prompt="x")
    chunks = oa._Chunks(server, job, body)
    first = chunks.of(0, RequestOutput("cmpl-s-0-1", (4,), False))
    assert first == {"id": "cmpl-s", "object": "text_completion", "created": job.created,
                     "model": MODEL, "choices": [{"index": 1, "text": "2", "logprobs": None,
                                                  "finish_reason": None}]}
    # a step that added no token: nothing to send
    assert chunks.of(0, RequestOutput("cmpl-s-0-1", (), False)) is None
    assert chunks.of(0, RequestOutput("cmpl-s-0-1", (12,), False))["choices"][0]["text"] == "+"
    restarted = chunks.of(0, RequestOutput("cmpl-s-0-1", (5,), False, restarted=True))
    assert restarted["choices"][0] == {"index": 1, "text": "3", "logprobs": None,
                                       "finish_reason": None, "restarted": True}
    final1 = output((5, 12, EOS), text="3+", finish_reason="stop", sample_index=1)
    last = chunks.of(0, RequestOutput("cmpl-s-0-1", (12, EOS), True, final1))
    assert last["choices"][0] == {"index": 1, "text": "+", "logprobs": None,
                                  "finish_reason": "stop",
                                  **oa.OpenAIServer.extras(final1, body, job)}
    # a last output whose text adds nothing still makes the choice's last chunk
    assert chunks.of(0, RequestOutput("cmpl-s-0-0", (4,), False))["choices"][0]["text"] == "2"
    final0 = output((4, EOS), text="2", finish_reason="stop")
    last = chunks.of(0, RequestOutput("cmpl-s-0-0", (EOS,), True, final0))
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] == "stop"
    usage = chunks.usage_chunk()
    assert usage["choices"] == [] and usage["usage"] == server.usage(job, [final1, final0])


def test_chat_chunks_with_ids(server: oa.OpenAIServer) -> None:
    job = oa.Job("chatcmpl-s", [PROMPT_IDS], SamplingParams(), 0, 8)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1"}],
                                 return_token_ids=True)
    chunks = oa._Chunks(server, job, body)
    first = chunks.of(0, RequestOutput("chatcmpl-s-0", (), False))
    assert first["prompt_token_ids"] == PROMPT_IDS and first["object"] == (
        "chat.completion.chunk")
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None, "token_ids": []}]
    # an id whose text is held back (a special token, skipped) still makes a chunk: its id
    second = chunks.of(0, RequestOutput("chatcmpl-s-0", (0,), False))
    assert "prompt_token_ids" not in second
    assert second["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": None, "token_ids": [0]}]
    third = chunks.of(0, RequestOutput("chatcmpl-s-0", (4,), False))
    assert third["choices"][0]["delta"] == {"content": "2"}


def test_stream_text_holds_back_a_possible_stop_string(server: oa.OpenAIServer) -> None:
    job = oa.Job("cmpl-h", [PROMPT_IDS], SamplingParams(stop=("+", "=2;")), 0, 8)
    chunks = oa._Chunks(server, job, CompletionRequest(prompt="x"))
    texts = []
    for t in (4, 12, 4, 14):  # "2+2=": the last 2 characters may start "=2;"
        got = chunks.of(0, RequestOutput("cmpl-h-0", (t,), False))
        texts.append(None if got is None else got["choices"][0]["text"])
    assert texts == ["", None, "2", "+"]  # a first chunk always; the text 2 characters behind


def test_incremental_text_without_a_tokenizer_gives_no_text() -> None:
    inc = oa.IncrementalText(None, True, hold=0)
    assert inc.push([4, 12]) == "" and inc.ids == [4, 12] and inc.text == ""
    assert inc.finish("2+") == "2+" and inc.text == inc.decoded == "2+"


def test_incremental_text_holds_the_tail_and_finishes(server: oa.OpenAIServer) -> None:
    tok = server.tokenizer
    inc = oa.IncrementalText(tok, skip_special_tokens=True, hold=2)
    assert (inc.skip, inc.hold, inc.prefix_offset, inc.read_offset) == (True, 2, 0, 0)
    deltas = [inc.push([t]) for t in (4, 12, 4, 14, 4)]  # "2+2=2"
    assert deltas == ["", "", "2", "+", "2"] and inc.text == "2+2" and inc.decoded == "2+2=2"
    assert inc.push([EOS]) == ""  # a skipped special token adds no text
    assert inc.finish("2+2=2") == "=2" and inc.text == inc.decoded == "2+2=2"
    shown = oa.IncrementalText(tok, skip_special_tokens=False)
    assert [shown.push([t]) for t in (4, EOS)] == ["2", "<eos>"]


def test_a_final_text_that_departs_from_the_streamed_one_gives_its_rest(
        server: oa.OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    inc = oa.IncrementalText(server.tokenizer, skip_special_tokens=True)
    assert "".join(inc.push([t]) for t in (4, 12, 4)) == "2+2"
    with caplog.at_level(logging.WARNING, logger=oa.__name__):
        assert inc.finish("2*35") == "*35"
    assert inc.text == inc.decoded == "2*35"
    assert caplog.messages == ["streamed text is not a prefix of the final text; the last "
                               "chunk carries only what follows the common prefix"]
    inc = oa.IncrementalText(server.tokenizer, skip_special_tokens=True)
    inc.push([4, 12])
    assert inc.finish("") == "" and inc.text == ""
    inc = oa.IncrementalText(server.tokenizer, skip_special_tokens=True)
    inc.push([4, 12])
    assert inc.finish("3") == "3" and inc.text == "3"  # nothing in common
    inc = oa.IncrementalText(server.tokenizer, skip_special_tokens=True)
    inc.push([4, 12, 4])
    assert inc.finish("2+35") == "35" and inc.text == "2+35"  # "2+" in common


# ---- a checkpoint without a tokenizer; a server without jinja2 --------------------------------
@pytest.fixture(scope="module")
def ids_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The bundled target without its tokenizer files: token ids in, token ids out."""
    import shutil

    from specengine.assets import DEFAULT_TARGET

    path = tmp_path_factory.mktemp("ids-only") / "arith-ids"
    path.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{DEFAULT_TARGET}/{name}", path / name)
    return path


def small_engine(path: Any) -> AsyncSpecEngine:
    from specengine import SpecEngine

    return AsyncSpecEngine(SpecEngine(path, device="cpu", kernel_backend="torch",
                                      kv_cache_tokens=2048))


@pytest.fixture(scope="module")
def ids_only(ids_path: Any) -> Iterator[AsyncSpecEngine]:
    eng = small_engine(ids_path)
    assert eng.engine.tokenizer is None
    yield eng
    asyncio.run(eng.close())


def test_a_checkpoint_without_tokenizer_answers_token_ids(ids_only: AsyncSpecEngine) -> None:
    app = build_app(ids_only)
    status, answer = post(app, "/v1/completions", {
        "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "logprobs": 0,
        "return_token_ids": True})
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chunks = events(app, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 4,
                                             "temperature": 0, "return_token_ids": True})
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    status, answer = post(app, "/v1/completions", {"prompt": ["Q:1="]})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert answer["error"]["message"] == ("prompt 0 is a string but the checkpoint has no "
                                          "tokenizer.json: pass token ids")
    status, answer = post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "1="}]})
    assert status == 400 and answer["error"]["param"] == "messages"
    assert answer["error"]["message"].startswith("the checkpoint has no tokenizer.json")


def test_without_jinja2_the_server_warns_that_chat_will_fail(
        aeng: AsyncSpecEngine, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "jinja2", None)  # "import jinja2" raises ImportError
    with caplog.at_level(logging.WARNING, logger=oa.__name__):
        app = build_app(aeng)
    assert caplog.messages == [
        "the checkpoint has a chat template but jinja2 is not installed: "
        "/v1/chat/completions will answer 501 (pip install jinja2)"]
    status, answer = post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "1="}]})
    assert status == 501 and answer["error"]["type"] == "server_error", answer
    assert answer["error"]["message"].startswith(
        "chat templates need jinja2 on the server (pip install 'specengine[server]'): ")
    assert answer["error"]["param"] is None


# ---- refusals and failures after the call was accepted ----------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_groups_past_the_engines_bound_are_a_503_for_the_prompt(aeng: AsyncSpecEngine,
                                                                 app: Any, stream: bool) -> None:
    """Two groups of 9 where 16 fit: the second is refused, and the call with it (the first
    group's samples aborted)."""
    n = MAX_WAITING // 2 + 1
    status, answer = post(app, "/v1/completions", {
        "prompt": [PROMPT_IDS, PROMPT_IDS[:3]], "n": n, "stream": stream, "max_tokens": 100,
        "ignore_eos": True})
    assert status == 503 and answer["error"]["param"] == "prompt", answer
    assert answer["error"]["type"] == "server_error" and f"n={n}" in answer["error"]["message"]
    assert errors_counted(app, 503) == 1 and not app.state.server.live
    for _ in range(10_000):  # each call waits for the engine thread's next gap
        if not in_engine(aeng, lambda e: e.has_unfinished()):
            break
    in_engine(aeng, assert_idle_and_free)


def _fail_prefill_of(aeng: AsyncSpecEngine, token: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's prefill raises for a batch holding a prompt with ``token``: that request
    alone fails (``finish_reason="error"``), the others go on."""
    runner = aeng.engine.runner
    real = runner.prefill

    def prefill(seqs: Any, *args: Any, **kw: Any) -> Any:
        if any(token in s.token_slice(0, s.num_prompt_tokens) for s in seqs):
            raise RuntimeError("Boom: the device refused")
        return real(seqs, *args, **kw)

    monkeypatch.setattr(runner, "prefill", prefill)


def test_a_sample_failing_in_the_engine_is_a_500_naming_it(
        aeng: AsyncSpecEngine, app: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _fail_prefill_of(aeng, 19, monkeypatch)  # "P": in no other test's prompt
    bad = PROMPT_IDS + [19]
    status, answer = post(app, "/v1/completions", {"prompt": [PROMPT_IDS, bad],
                                                   "max_tokens": 3})
    assert status == 500 and answer["error"]["type"] == "server_error", answer
    message = answer["error"]["message"]
    assert message.startswith("a sample of request 'cmpl-") and (
        "' failed in the engine after 0 tokens: " in message and "Boom" in message)
    with caplog.at_level(logging.ERROR, logger=oa.__name__):
        chunks = events(app, "/v1/completions", {"prompt": [PROMPT_IDS, bad], "max_tokens": 3})
    # the engine's own words, logged there: nothing to log here
    assert not [r for r in caplog.records if r.name == oa.__name__]
    error = chunks[-1]
    assert error["error"]["code"] == 500 and error["error"]["type"] == "server_error"
    assert error["error"]["message"].startswith("a sample of request 'cmpl-")
    assert "' failed in the engine after 0 tokens: " in error["error"]["message"]
    assert errors_counted(app, 500) == 2
    failed = app.state.server.metrics.registry.get_sample_value(
        "specengine_requests_total", {"finish_reason": "error"})
    assert failed == 2  # each failed sample observed once
    assert not app.state.server.live
    in_engine(aeng, assert_idle_and_free)


def test_an_engine_fault_mid_stream_ends_it_with_an_error_event(
        aeng: AsyncSpecEngine, app: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """After the first tokens were streamed, a step that fails for the whole engine: the
    stream's last event is the error (a 500 with the engine's words, logged), then [DONE]."""
    graphs = aeng.engine.graphs

    def run(shape: object) -> object:
        raise RuntimeError("Boom: the device is lost")

    monkeypatch.setattr(graphs, "run", run)
    # the first sequence failing alone is taken for the engine's fault (the step raises)
    monkeypatch.setattr("specengine.core.isolation.ENGINE_WIDE_AFTER", 1)
    with caplog.at_level(logging.ERROR, logger=oa.__name__):
        chunks = events(app, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 8,
                                                 "n": 2, "return_token_ids": True})
    assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [[4], [4]]  # prefill's
    assert chunks[-1] == oa.error_body(500, "Boom: the device is lost")
    logged = [r for r in caplog.records if r.name == oa.__name__]
    assert [r.getMessage() for r in logged] == [
        f"stream of {chunks[0]['id']!r} failed"]
    assert logged[0].exc_info is not None and "device is lost" in str(logged[0].exc_info[1])
    assert errors_counted(app, 500) == 1
    monkeypatch.undo()
    in_engine(aeng, assert_idle_and_free)


@pytest.mark.parametrize("n,at,nth,counted", [
    (1, b'"token_ids": [4]', 1, 1),  # the first chunk: the sample runs on
    (1, b'"finish_reason": "length"', 1, 0),  # its last chunk: it had finished
    (2, b'"finish_reason": "length"', 1, 1),  # the first sample's last chunk: one runs on
    (2, b'"finish_reason": "length"', 2, 0),  # the second's: both had finished
])
def test_a_client_gone_mid_stream_is_counted_when_samples_were_left(
        aeng: AsyncSpecEngine, app: Any, n: int, at: bytes, nth: int, counted: int) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "n": n, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "temperature": 0}
    status, _, raw = call(app, "POST", "/v1/completions", body, gone_at=at, nth=nth)
    assert status == 200 and raw.count(at) == nth - 1
    disconnects = app.state.server.metrics.registry.get_sample_value(
        "specengine_client_disconnects_total")
    assert disconnects == counted and not app.state.server.live
    for _ in range(10_000):  # each call waits for the engine thread's next gap
        if not in_engine(aeng, lambda e: e.has_unfinished()):
            break
    in_engine(aeng, assert_idle_and_free)


# a template that shows what it was given: the generation prompt, tools, documents, extra
# variables (chat_template_kwargs), in characters of the bundled vocabulary
SHOWING = ("{% for m in messages %}Q:{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}A:{% endif %}{% if tools %}{{ tools | length }}"
           "{% endif %}{% if documents %}P{{ documents | length }}{% endif %}{{ extra }}")


@pytest.mark.parametrize("fields,text", [
    ({}, "Q:1+1=A:"),
    ({"add_generation_prompt": False}, "Q:1+1="),
    ({"tools": [{"type": "function"}] * 2, "documents": [{"text": "x"}] * 3,
      "chat_template_kwargs": {"extra": "=9"}}, "Q:1+1=A:2P3=9"),
    # as vLLM, chat_template_kwargs are laid over the named fields (it was a TypeError: 500)
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "Q:1+1="),
    ({"add_generation_prompt": False, "chat_template_kwargs": {"add_generation_prompt": True,
                                                               "documents": [{}]}},
     "Q:1+1=A:P1"),
])
def test_chat_passes_its_fields_to_the_template_and_adds_no_special_tokens(
        server: oa.OpenAIServer, fields: dict[str, Any], text: str) -> None:
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from specengine.chat_template import ChatTemplate

    tok = server.tokenizer
    # the same vocabulary with a post-processor that adds EOS first (as a BOS-adding one does):
    # the rendered text must not get it (the template writes its own special tokens)
    bos = Tokenizer.from_str(tok.tokenizer.to_str())
    bos.post_processor = TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", EOS)])
    server.tokenizer = type(tok)(bos, chat_template=ChatTemplate(SHOWING))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1+1="}], **fields)
    assert asyncio.run(server.render_chat(body)) == tok.tokenizer.encode(text).ids
    assert bos.encode(text).ids[0] == EOS


def test_chat_template_kwargs_cannot_replace_the_conversation(server: oa.OpenAIServer) -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "1+1="}],
                                 chat_template_kwargs={"messages": []})
    with pytest.raises(oa.OpenAIError, match="cannot set 'messages'") as err:
        asyncio.run(server.render_chat(body))
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"


def test_an_engine_closing_mid_stream_ends_it_with_a_503_event(
        ids_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    eng = small_engine(ids_path)
    app = build_app(eng)
    body = {"prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.ERROR, logger=oa.__name__):
        status, _, raw = call(app, "POST", "/v1/completions", body, on_first_piece=eng.close)
    blocks = raw.decode().split("\n\n")
    assert status == 200 and blocks[-2:] == ["data: [DONE]", ""]
    assert json.loads(blocks[-3].removeprefix("data: ")) == oa.error_body(
        503, "the async engine was closed")
    assert errors_counted(app, 503) == 1 and not app.state.server.live
    assert not [r for r in caplog.records if r.name == oa.__name__]  # a 503: not logged


def test_an_engine_refusal_of_prompt_p_names_prompt_p(app: Any) -> None:
    status, answer = post(app, "/v1/completions", {"prompt": [PROMPT_IDS, PROMPT_IDS * 50]})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert answer["error"]["message"].startswith("prompt 1 has 300 tokens")
    assert not app.state.server.live


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_requests_k_and_k_max_reach_the_engine(app: Any, stream: bool) -> None:
    def run(**kw: Any) -> dict[str, Any]:
        body = {"prompt": PROMPT_IDS, "max_tokens": 24, "temperature": 0, **kw}
        if not stream:
            return post(app, "/v1/completions", body)[1]["choices"][0]
        return events(app, "/v1/completions", body)[-1]["choices"][0]

    plain = run()
    assert plain["num_draft_tokens"] == 0  # the server's default k: 0
    drafted = run(k=3)
    assert drafted["num_draft_tokens"] > 0 and drafted["finish_reason"] == plain[
        "finish_reason"]
    # "auto" drafts at most k_max a step: none with k_max 0
    assert run(k="auto", k_max=0)["num_draft_tokens"] == 0
    one = run(k="auto", k_max=1)
    assert 0 < one["num_draft_tokens"] <= one["num_steps"]


def test_streamed_text_keeps_a_words_space_after_a_token_without_text() -> None:
    """SentencePiece-style words ("\u2581b" is " b" inside a text, "b" at its start): a skipped
    special token between two words must not make the next word lose its space."""
    from test_behaviours_text import metaspace_tokenizer

    tok = metaspace_tokenizer()
    ids = [0, 4, 1, 4, 4, 2, 1]
    inc = oa.IncrementalText(tok, skip_special_tokens=True)
    assert "".join(inc.push([t]) for t in ids) == tok.decode(ids) == "a bc b"


def _answering(*messages: dict[str, Any]) -> Any:
    """An ASGI app that sends these messages (an answer as any inner app may send it)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        for m in messages:
            await send(m)

    return app


@pytest.mark.parametrize("path,reshaped", [("/v1/models", True), ("/v2/models", False)])
@pytest.mark.parametrize("sent", [400, 422])
def test_error_shape_reshapes_v1_errors_sent_in_pieces(path: str, reshaped: bool,
                                                       sent: int) -> None:
    """A 400 or 422 of the server's shape whose body comes in pieces (one without a body
    key), its start without headers or with its own: on /v1/ one OpenAI answer (a 422 as
    OpenAI's 400), its other headers kept and its length recomputed; elsewhere every message
    as sent."""
    pieces = ({"type": "http.response.body", "body": b'{"error": ', "more_body": True},
              {"type": "http.response.body", "more_body": True},
              {"type": "http.response.body", "body": b'"bad n"}'})
    for start in ({"type": "http.response.start", "status": sent},
                  {"type": "http.response.start", "status": sent,
                   "headers": [(b"x-request", b"7"), (b"content-length", b"18")]}):
        inner = _answering(start, *pieces)
        status, headers, raw = call(oa.OpenAIErrorShape(inner), "GET", path)
        assert status == (400 if reshaped else sent)
        if not reshaped:
            assert raw == b'{"error": "bad n"}' and headers == dict(start.get("headers", ()))
            continue
        assert json.loads(raw) == oa.error_body(400, "bad n")
        assert headers == {**dict(start.get("headers", ())),
                           b"content-length": str(len(raw)).encode()}


def test_error_shape_passes_answers_below_400() -> None:
    ok = ({"type": "http.response.start", "status": 200, "headers": []},
          {"type": "http.response.body", "body": b'{"error": "not one"}'})
    status, _, raw = call(oa.OpenAIErrorShape(_answering(*ok)), "GET", "/v1/x")
    assert (status, raw) == (200, b'{"error": "not one"}')
