"""SGLang's native API on the rollout server, and GRPO groups (``n`` > 1) over HTTP.

:func:`mount` adds, to an app made by ``build_app``:

- ``POST /generate`` in two dialects, told apart by the body's fields: a body with ``text``
  or ``input_ids`` is SGLang's (``sampling_params`` with ``max_new_tokens``,
  ``return_logprob``, ``rid``, one prompt or a batch) and is answered in SGLang's shape
  (``text``, ``output_ids``, ``meta_info`` with ``id``, ``finish_reason`` as
  ``{"type": "stop" | "length" | "abort", ...}``, ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` as ``[logprob, token_id, null]``, ``weight_version``; a list for
  a batch or ``n`` > 1, prompt-major); any other body is ours (``prompt`` /
  ``prompt_token_ids``), answered as before. ``sampling_params.n`` > 1 runs the n samples as
  one group that shares the prompt's prefill (``AsyncSpecEngine.generate_stream`` with n > 1), in
  both dialects: ours then answers ``{"request_id", "outputs": [...]}`` (sample i's id is
  ``f"{request_id}-{i}"``) and streams every sample's step events.
- SGLang's weight endpoints: ``/init_weights_update_group``, ``/update_weights_from_distributed``
  (a body with ``names``; ours otherwise), ``/destroy_weights_update_group``,
  ``/update_weights_from_disk`` (``abort_all_requests`` honoured: the requests in flight end
  first, with finish reason ``abort``); and ``/flush_cache``, ``/abort_request``,
  ``/get_model_info``, ``/health_generate``.
- ``/pause_generation`` (SGLang's ``abort`` mode: the requests in flight end with finish
  reason ``abort`` and their tokens so far, and new ``/generate`` requests wait) and
  ``/continue_generation`` (the waiting ones start). An asynchronous trainer (AReaL) pauses,
  updates and continues, and resubmits each aborted request's prompt plus its tokens so far:
  no token is lost, and every token it got before the pause is of the old weights.

Weight operations wait in a worker thread (rendezvous, transfer, reading a checkpoint:
``specengine.weights.sglang_receiver``) while the engine keeps stepping, and commit between
two steps; they answer SGLang's ``{"success", "message"}`` (errors also carry ``"error"``, as
every error of this server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

from specengine.engine import SpecEngine
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.server.errors import describe_validation, status_for
from specengine.server.openai_api import IncrementalText
from specengine.server.schemas import GenerateRequest, UpdateWeightsFromDistributedRequest
from specengine.server.sglang_schemas import (
    UNION_TAGS,
    AbortRequestSGLang,
    ContinueGenerationRequest,
    GroupNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    SGLangGenerateRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedSGLang,
    sglang_generate_body,
)
from specengine.server.streams import EventStream, unless_disconnected
from specengine.weights.sglang_receiver import NamedGroup, stage_broadcast_update
from specengine.weights.staged import StagedUpdate, staged

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
#: how long a weight operation waits for another one to finish before it is refused (a
#: learner that broadcasts must not hang behind a checkpoint load)
LOCK_WAIT_S = 600.0
#: how long /pause_generation retries the abort of a request its handler has not yet handed
#: to the engine (it is there within a step or a tokenization)
PAUSE_ABORT_WAIT_S = 5.0


@dataclasses.dataclass
class Job:
    """One prompt of a generate call: its request id (a group's base id when ``params.n`` >
    1), prompt, params, k, k_max and tree (the draft's own tree of that many drafts)."""

    rid: str
    prompt: list[int] | str
    params: SamplingParams
    k: int | str
    k_max: int
    tree: int | None = None

    @property
    def sample_ids(self) -> list[str]:
        n = self.params.n
        return [self.rid] if n == 1 else [f"{self.rid}-{i}" for i in range(n)]


def _stream(state: Any, job: Job) -> AsyncIterator[RequestOutput]:
    # n > 1: one group sharing the prompt's prefill (sample i is f"{rid}-{i}")
    return state.engine.generate_stream(job.prompt, job.params, k=job.k, tree=job.tree,
                                        request_id=job.rid, k_max=job.k_max)


def _claim(state: Any, jobs: list[Job]) -> None:
    """Mark the jobs' request ids in flight (``/abort``, shutdown); refuse ids in use."""
    ids = [rid for job in jobs for rid in job.sample_ids]
    used = [rid for rid in ids if rid in state.live]
    seen: set[str] = set()
    for rid in ids:  # also the call's own: a group's "g-1" and a prompt whose id is "g-1"
        if rid in seen:
            used.append(rid)
        seen.add(rid)
    if used:
        raise ValueError(f"request id {used[0]!r} is already used by an unfinished request")
    for rid in ids:
        state.live.add(rid)


def _release(state: Any, jobs: list[Job]) -> None:
    for job in jobs:
        for rid in job.sample_ids:
            state.live.discard(rid)


async def _merged(state: Any, jobs: list[Job]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(job index, output)`` of every job's steps as they come; the first error of any job
    is raised (the others are then aborted). Closing it early aborts what is unfinished."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def run(i: int, job: Job) -> None:
        try:
            async with contextlib.aclosing(_stream(state, job)) as stream:  # type: ignore
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except ValueError as exc:  # the engine's refusal of this prompt: say which one
            queue.put_nowait((i, ValueError(f"batch item {i}: {exc}") if len(jobs) > 1
                              else exc))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(run(i, job)) for i, job in enumerate(jobs)]
    left = len(tasks)
    try:
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # a closed stream aborts its request(s)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(state: Any, jobs: list[Job]) -> list[list[GenerationOutput]]:
    """Every job's final outputs, by sample index."""
    finals: list[dict[int, GenerationOutput]] = [{} for _ in jobs]
    async with contextlib.aclosing(_merged(state, jobs)) as merged:  # type: ignore
        async for i, out in merged:
            if out.output is not None:
                state.metrics.observe_finished(out.output)
                finals[i][out.output.sample_index] = out.output
    return [[f[s] for s in sorted(f)] for f in finals]


def json_response(obj: object, status_code: int = 200) -> Response:
    # Python's encoder, as the app's: a (rare) -inf logprob is written as -Infinity.
    return Response(json.dumps(obj), status_code=status_code, media_type="application/json")


def output_dict(request_id: str, out: GenerationOutput) -> dict[str, Any]:
    return {"request_id": request_id, **dataclasses.asdict(out)}


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _failed(outs: list[GenerationOutput]) -> GenerationOutput | None:
    return next((o for o in outs if o.finish_reason == "error"), None)


# ---- SGLang's answer shape ----------------------------------------------------------------
def finish_reason(out: GenerationOutput) -> dict[str, Any]:
    """SGLang's ``finish_reason``: ``stop`` (``matched``: the stop string, else the EOS or
    stop token id), ``length`` (``max_new_tokens`` or the context), ``abort`` (aborted; a
    policy-lag stop too)."""
    if out.finish_reason == "stop":
        if isinstance(out.stop_reason, str):
            return {"type": "stop", "matched": out.stop_reason}
        return {"type": "stop", "matched": out.token_ids[-1] if out.token_ids else None}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == "policy_lag":
        return {"type": "abort", "message": "the request's policy lag exceeded its bound"}
    return {"type": "abort", "message": out.error or "aborted"}


def meta_info(rid: str, prompt_len: int | None, ids: list[int], logprobs: list[float] | None,
              out: GenerationOutput | None, version: int, top_n: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": None if out is None else finish_reason(out),
        "prompt_tokens": prompt_len, "completion_tokens": len(ids), "weight_version": version}
    if out is not None:  # SGLang's count of prompt tokens served from the prefix cache
        meta["cached_tokens"] = out.num_cached_tokens
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
    if logprobs is not None and out is not None and top_n:
        # SGLang's shape: per position the N most likely, most likely first, each
        # [logprob, token id, null] (the emitted token only when it is among them)
        meta["output_top_logprobs"] = [
            [[lp, t, None] for t, lp in sorted(alt.items(), key=lambda kv: -kv[1])[:top_n]]
            for alt in out.top_logprobs]
    if out is not None:  # ours: per-token versions and speculation counters
        meta["token_weight_versions"] = list(out.token_weight_versions)
        meta["num_draft_tokens"] = out.num_draft_tokens
        meta["num_accepted_tokens"] = out.num_accepted_tokens
    return meta


def sglang_result(rid: str, out: GenerationOutput, return_logprob: bool, top_n: int = 0,
                  text: str | None = None) -> dict[str, Any]:
    """``top_n``: the request's ``top_logprobs_num`` (``SamplingParams.logprobs``);
    ``text``: in place of ``out.text`` (decoded with the special tokens)."""
    ids = list(out.token_ids)
    return {"text": out.text if text is None else text, "output_ids": ids,
            "meta_info": meta_info(rid, len(out.prompt_token_ids), ids,
                                   list(out.logprobs) if return_logprob else None, out,
                                   out.weight_version, top_n)}


# ---- body parsing -------------------------------------------------------------------------
async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():  # as FastAPI reads it: no body (a 422 "must be a JSON object")
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"malformed JSON body: {e}") from None


def _parse(model: type[M], body: Any, status: int = 400) -> M:
    """``body`` as ``model``; 400 (SGLang's status) naming the fields, or with ``status``
    422 through the app's validation handler (our bodies keep their answers)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [dict(err, loc=tuple(p for p in err["loc"] if p not in UNION_TAGS))
                  for err in e.errors()]
        exc = RequestValidationError(errors)
        if status == 422:
            raise exc from None
        raise HTTPException(400, describe_validation(exc)[1]) from None


def _is_sglang_generate(body: Any) -> bool:
    """SGLang's body names its prompt ``text`` or ``input_ids``; ours ``prompt`` or
    ``prompt_token_ids``."""
    return isinstance(body, dict) and ("text" in body or "input_ids" in body)


def _native_endpoint(app: FastAPI, path: str) -> Callable[..., Awaitable[Response]]:
    """Take the app's ``POST path`` route out (this module's dispatcher replaces it) and
    return its endpoint."""
    for i, route in enumerate(app.router.routes):
        if isinstance(route, APIRoute) and route.path == path and "POST" in route.methods:
            del app.router.routes[i]
            return route.endpoint
    raise RuntimeError(f"mount needs the app's POST {path} route (build_app makes it)")


def _success(message: str, **extra: object) -> Response:
    return json_response({"success": True, "message": message, **extra})


#: the JSON bodies of the routes that read theirs themselves, for the OpenAPI schema
_BODIES: dict[str, Any] = {
    "/generate": GenerateRequest | SGLangGenerateRequest,
    "/update_weights_from_distributed": (UpdateWeightsFromDistributedRequest
                                         | UpdateWeightsFromDistributedSGLang),
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/destroy_weights_update_group": GroupNameRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/abort_request": AbortRequestSGLang,
    "/pause_generation": PauseGenerationRequest,
    "/continue_generation": ContinueGenerationRequest,
}


def _document_bodies(app: FastAPI) -> None:
    """Put the bodies of this module's routes (each parsed by its handler, to tell the
    dialects apart) into the app's OpenAPI schema, as FastAPI does for a declared body."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, body in _BODIES.items():
            js = TypeAdapter(body).json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": js}}}
        return schema
    app.openapi = openapi  # type: ignore[method-assign]


def mount(app: FastAPI) -> None:
    """Add this module's routes to ``app`` (made by ``build_app``; its state is
    ``app.state.server``)."""
    state = app.state.server  # build_app's ServerState
    aeng = state.engine
    native_generate = _native_endpoint(app, "/generate")
    native_update = _native_endpoint(app, "/update_weights_from_distributed")
    groups: dict[str, NamedGroup] = {}
    app.state.sglang_groups = groups
    # set while generation runs; cleared by /pause_generation (new requests wait on it)
    resumed = asyncio.Event()
    resumed.set()
    app.state.sglang_resumed = resumed
    _document_bodies(app)

    async def on_engine(fn: Callable[[SpecEngine], T]) -> T:
        return await aeng.run_in_engine(fn)

    async def weight_op(what: str, make: Callable[[], StagedUpdate]) -> Any:
        """``make()`` (a stage, taking the engine's weight lock) in a worker thread, waiting
        up to LOCK_WAIT_S for another weight operation to end; its commit on the engine
        thread between two steps. Shielded: a caller that goes away cannot strand the lock."""
        def stage_waiting() -> StagedUpdate:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    return make()
                except RuntimeError as e:  # only the lock's refusal is a plain RuntimeError
                    if type(e) is not RuntimeError or "in progress" not in str(e) or \
                            time.monotonic() > deadline:
                        raise
                time.sleep(0.02)

        async def run() -> Any:
            try:
                update = await asyncio.to_thread(stage_waiting)
            except RuntimeError as exc:
                if type(exc) is RuntimeError:
                    raise HTTPException(409, str(exc)) from exc
                raise
            try:
                return await on_engine(update.commit)
            finally:
                update.discard()  # a no-op once committed
        logger.debug("weight operation %s off the step loop", what)
        return await asyncio.shield(asyncio.ensure_future(run()))

    def ours(what: str, stage: Callable[[], tuple[Callable[[SpecEngine], Any],
                                                  Callable[[], None] | None]]
             ) -> Awaitable[Any]:
        return weight_op(what, lambda: staged(aeng.engine, what, stage))

    # ---- generate --------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await _json_body(request)
        if _is_sglang_generate(body):
            return await sglang_generate(_parse(SGLangGenerateRequest,
                                                sglang_generate_body(dict(body))), request)
        native = _parse(GenerateRequest, body, status=422)
        n = native.sampling_params.n if native.sampling_params else None
        if not await unpaused(request):
            return Response(status_code=499)
        if n is None or n == 1:
            return await native_generate(native, request)
        return await native_group(native, request)

    def check_open() -> None:
        if state.draining:
            raise HTTPException(503, "the server is shutting down: no new requests")

    async def unpaused(request: Request) -> bool:
        """Wait while generation is paused; False if the client left meanwhile."""
        if resumed.is_set():
            return True
        state.metrics.paused_waiting.inc()
        try:
            done, _ = await unless_disconnected(resumed.wait(), request)
        finally:
            state.metrics.paused_waiting.dec()
        if not done:
            state.metrics.disconnects.inc()
        return done

    async def native_group(body: GenerateRequest, request: Request) -> Response:
        check_open()
        params = body.sampling_params.to_params()  # type: ignore[union-attr]
        job = Job(body.request_id or f"http-{uuid.uuid4().hex}", body.prompt_value(), params,
                  *state.draft_args(body.k, body.k_max))
        if not body.stream:
            outs = await run_jobs([job], request)
            if isinstance(outs, Response):
                return outs
            return json_response({"request_id": job.rid, "outputs": [
                output_dict(rid, o) for rid, o in zip(job.sample_ids, outs[0])]})

        def native_event(_: int, out: RequestOutput) -> dict[str, Any]:
            return {"request_id": out.request_id, "new_token_ids": list(out.new_token_ids),
                    "finished": out.finished, "restarted": out.restarted,
                    "output": None if out.output is None else dataclasses.asdict(out.output)}
        return await stream_jobs([job], request, native_event)

    async def run_jobs(jobs: list[Job], request: Request
                       ) -> list[list[GenerationOutput]] | Response:
        _claim(state, jobs)
        try:
            done, outs = await unless_disconnected(_collect(state, jobs), request)
        finally:
            _release(state, jobs)
        if not done or outs is None:
            state.metrics.disconnects.inc()
            return Response(status_code=499)  # the client closed the request; unread
        bad = _failed([o for group in outs for o in group])
        if bad is not None:
            state.metrics.observe_error(500)
            return json_response({"error": f"a request failed in the engine after "
                                           f"{len(bad.token_ids)} tokens: {bad.error}"}, 500)
        return outs

    async def stream_jobs(jobs: list[Job], request: Request,
                          event: Callable[[int, RequestOutput], dict[str, Any] | Awaitable[
                              dict[str, Any]]]) -> Response:
        """SSE of every job's steps (``event(job index, output)``), then ``[DONE]``. Bad
        input fails before the 200 (the first step of any job is awaited first)."""
        _claim(state, jobs)
        merged = _merged(state, jobs)
        try:
            done, first = await unless_disconnected(anext(merged), request)
        except BaseException:
            await merged.aclose()
            _release(state, jobs)
            raise
        if not done or first is None:
            await merged.aclose()
            _release(state, jobs)
            state.metrics.disconnects.inc()
            return Response(status_code=499)

        async def events() -> AsyncIterator[bytes]:
            item: tuple[int, RequestOutput] | None = first
            try:
                async with contextlib.aclosing(merged):  # type: ignore[type-var]
                    while item is not None:
                        i, out = item
                        if out.output is not None:
                            state.metrics.observe_finished(out.output)
                            if out.output.finish_reason == "error":
                                state.metrics.observe_error(500)
                                yield _event({"error": f"request {out.request_id!r} failed in "
                                              f"the engine: {out.output.error}",
                                              "status_code": 500})
                                return
                        obj = event(i, out)
                        yield _event(await obj if asyncio.iscoroutine(obj) else obj)
                        item = await anext(merged, None)
                yield b"data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                state.metrics.disconnects.inc()
                raise
            except Exception as exc:  # the 200 is out: the error is the last event
                status = status_for(exc)
                state.metrics.observe_error(status)
                yield _event({"error": str(exc), "status_code": status})
            finally:
                _release(state, jobs)
        return EventStream(events(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    async def sglang_generate(body: SGLangGenerateRequest, request: Request) -> Response:
        check_open()
        per = body.per_prompt()
        skips = body.skip_special_tokens()
        if not await unpaused(request):
            return Response(status_code=499)
        check_open()
        draft = state.draft_args(body.k, body.k_max)
        jobs = [Job(rid or f"sgl-{uuid.uuid4().hex}", prompt, params, *draft)
                for prompt, (params, _, rid) in zip(body.prompts(), per)]
        logprob = [lp for _, lp, _ in per]
        listed = body.is_batch or any(j.params.n > 1 for j in jobs)
        if not body.stream:
            outs = await run_jobs(jobs, request)
            if isinstance(outs, Response):
                return outs
            results = [sglang_result(rid, o, logprob[i], job.params.logprobs or 0,
                                     final_text(o, job.params, skips[i]))
                       for i, job in enumerate(jobs) for rid, o in zip(job.sample_ids, outs[i])]
            return json_response(results if listed else results[0])
        # Streamed as SGLang does by default: every chunk carries the text and ids so far.
        # The text is the OpenAI stream's (IncrementalText): it holds back a possible stop
        # string's start (and a cut UTF-8 character), so every chunk's text is a prefix of
        # the next one's and of the final, cut text, which the last chunk carries whole.
        offsets = [0]
        for job in jobs[:-1]:
            offsets.append(offsets[-1] + job.params.n)
        ids_so_far: dict[str, list[int]] = {}
        texts: dict[str, IncrementalText] = {}
        tok = aeng.engine.tokenizer

        def sglang_event(i: int, out: RequestOutput) -> dict[str, Any]:
            ids = ids_so_far.setdefault(out.request_id, [])
            if out.restarted or out.request_id not in texts:
                ids.clear()  # a restart (a policy-lag reset) voids what came before
                stops = jobs[i].params.stop
                texts[out.request_id] = IncrementalText(
                    tok, skips[i], max(map(len, stops)) - 1 if stops else 0)
            ids.extend(out.new_token_ids)
            final = out.output
            if final is not None:
                chunk = sglang_result(out.request_id, final, logprob[i],
                                      jobs[i].params.logprobs or 0,
                                      final_text(final, jobs[i].params, skips[i]))
            else:
                texts[out.request_id].push(out.new_token_ids)
                text = None if tok is None else texts[out.request_id].text
                prompt = jobs[i].prompt  # a text's length is known once it finished
                chunk = {"text": text, "output_ids": list(ids),
                         "meta_info": meta_info(out.request_id, len(prompt) if isinstance(
                             prompt, list) else None, ids, None, None,
                             aeng.engine.weight_version)}
            if listed:
                sample = 0 if jobs[i].params.n == 1 else int(out.request_id.rsplit("-", 1)[1])
                chunk["index"] = offsets[i] + sample
            return chunk
        return await stream_jobs(jobs, request, sglang_event)

    def final_text(out: GenerationOutput, params: SamplingParams, skip: bool) -> str | None:
        """The text with the special tokens (``skip_special_tokens`` false), cut where the
        engine's was (before a matched stop string, or after it with ``no_stop_trim``); None
        keeps the engine's text."""
        tok = aeng.engine.tokenizer
        if skip or tok is None or out.text is None:
            return None
        full = tok.tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
        if isinstance(out.stop_reason, str):
            # The match is the one the last token completed: an earlier occurrence (before
            # min_tokens, when stop strings are not looked for) is not where the engine cut.
            before = len(tok.tokenizer.decode(list(out.token_ids[:-1]),
                                              skip_special_tokens=False))
            at = full.find(out.stop_reason, max(0, before - len(out.stop_reason) + 1))
            if at >= 0:
                keep = len(out.stop_reason) if params.include_stop_str_in_output else 0
                full = full[:at + keep]
        return full

    # ---- pause / continue --------------------------------------------------------------
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        raw = await _json_body(request)
        _parse(PauseGenerationRequest, {} if raw is None else raw)
        resumed.clear()  # first: a request arriving from now on waits
        aborted = await abort_in_flight()
        return _success(f"generation paused; {aborted} requests in flight aborted",
                        num_aborted=aborted)

    async def abort_in_flight() -> int:
        """Abort every request in flight, also one whose handler has not handed it to the
        engine yet (its abort is retried until it is there, or it left), for up to
        PAUSE_ABORT_WAIT_S. Returns how many were aborted."""
        aborted: set[str] = set()
        deadline = time.monotonic() + PAUSE_ABORT_WAIT_S
        while True:
            pending = [rid for rid in state.live if rid not in aborted]
            for rid in pending:
                with contextlib.suppress(ValueError):  # not in the engine yet, or finished
                    await aeng.abort(rid)
                    aborted.add(rid)
            if not [rid for rid in state.live if rid not in aborted] or \
                    time.monotonic() > deadline:
                return len(aborted)
            await asyncio.sleep(0.005)

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        raw = await _json_body(request)
        _parse(ContinueGenerationRequest, {} if raw is None else raw)
        resumed.set()
        return _success("generation continues")

    async def abort_all_first(body: Any) -> None:
        """SGLang's ``abort_all_requests``: end the requests in flight (finish reason
        ``abort``) before the update."""
        if body.abort_all_requests:
            n = await abort_in_flight()
            logger.info("aborted %d requests before a weight update", n)

    # ---- weights ---------------------------------------------------------------------
    def refused(exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else status_for(exc)
        message = exc.detail if isinstance(exc, HTTPException) else str(exc)
        state.metrics.observe_error(status)
        if status == 500:
            logger.error("weight operation failed", exc_info=exc)
        return json_response({"success": False, "message": message, "error": message}, status)

    def drop_group(name: str, group: NamedGroup) -> None:
        if groups.get(name) is group:
            del groups[name]
        group.close()

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        body = _parse(InitWeightsUpdateGroupRequest, await _json_body(request))
        old = groups.get(body.group_name)
        if old is not None:
            # A restarted trainer inits the same name again: the old group is replaced if
            # its learner is gone, else the join is refused now (never a rendezvous hang).
            gone = await asyncio.to_thread(old.learner_gone)
            if not gone:
                raise HTTPException(409, f"weight-update group {body.group_name!r} exists and "
                                    "its learner still answers: destroy it first "
                                    "(/destroy_weights_update_group)")
            logger.warning("weight-update group %r: its learner is gone (%s); replaced",
                           body.group_name, gone)
            try:
                await ours("destroy_weights_update_group", lambda: (
                    lambda _: drop_group(body.group_name, old), None))
            except Exception as exc:  # noqa: BLE001 - answered in SGLang's shape
                return refused(exc)

        def stage() -> tuple[Callable[[SpecEngine], None], Callable[[], None]]:
            if body.group_name in groups:
                raise ValueError(f"weight-update group {body.group_name!r} exists")
            group = NamedGroup(body.master_address, body.master_port, body.rank_offset,
                               body.world_size, body.group_name, body.backend, body.timeout_s,
                               aeng.engine.device)

            def attach(_: SpecEngine) -> None:
                groups[group.name] = group
            return attach, group.close
        try:
            await ours("init_weights_update_group", stage)
        except Exception as exc:  # noqa: BLE001 - answered in SGLang's shape
            return refused(exc)
        return _success(f"joined weight-update group {body.group_name!r} as rank "
                        f"{body.rank_offset} of {body.world_size}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        raw = await _json_body(request)
        if not (isinstance(raw, dict) and "names" in raw):
            return await native_update(_parse(UpdateWeightsFromDistributedRequest, raw, 422))
        body = _parse(UpdateWeightsFromDistributedSGLang, raw)
        try:
            version = body.version()
            await abort_all_first(body)
            group = groups.get(body.group_name)
            if group is None:
                raise ValueError(f"no weight-update group {body.group_name!r}: "
                                 "/init_weights_update_group first")

            def stage() -> tuple[Callable[[SpecEngine], int], None]:
                return stage_broadcast_update(aeng.engine, group, body.names, body.dtypes,
                                              body.shapes, version), None
            new = await ours("update_weights_from_distributed", stage)
        except Exception as exc:  # noqa: BLE001 - answered in SGLang's shape
            return refused(exc)
        return _success(f"updated {len(body.names)} tensors to weight version {new}",
                        weight_version=new)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = _parse(GroupNameRequest, await _json_body(request))

        def stage() -> tuple[Callable[[SpecEngine], None], None]:
            group = groups.get(body.group_name)
            if group is None:
                raise ValueError(f"no weight-update group {body.group_name!r}")

            def drop(_: SpecEngine) -> None:
                groups.pop(body.group_name, None)
                group.close()
            return drop, None
        try:
            await ours("destroy_weights_update_group", stage)
        except Exception as exc:  # noqa: BLE001
            return refused(exc)
        return _success(f"left weight-update group {body.group_name!r}")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = _parse(UpdateWeightsFromDiskRequest, await _json_body(request))
        try:
            version = body.version()
            await abort_all_first(body)
            new = await weight_op("update_weights_from_disk", lambda: aeng.engine.stage_weights(
                body.model_path, version=version))
        except Exception as exc:  # noqa: BLE001
            return refused(exc)
        if body.keep_pause:
            resumed.clear()
        return _success(f"loaded {body.model_path}: weight version {new}",
                        num_paused_requests=0, weight_version=new)

    # ---- the rest ----------------------------------------------------------------------
    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache() -> Response:
        await on_engine(lambda e: e.kv_cache.invalidate_prefix_cache())
        return _success("prefix cache flushed")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = _parse(AbortRequestSGLang, await _json_body(request))
        if body.abort_all:
            targets = set(state.live)
        else:
            targets = {r for r in state.live
                       if r == body.rid or r.rsplit("-", 1)[0] == body.rid}
        aborted = []
        for rid in sorted(targets):
            with contextlib.suppress(ValueError):  # finished meanwhile
                await aeng.abort(rid)
                aborted.append(rid)
        return _success(f"aborted {len(aborted)} requests", aborted=aborted)

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        eng = aeng.engine
        return json_response({
            "model_path": eng.config.model, "tokenizer_path": eng.config.model,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": eng.weight_version,
            "draft_model_path": None if eng.config.draft is None else str(eng.config.draft),
            "max_model_len": eng.config.max_model_len})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.draining or not aeng.thread.is_alive():
            raise HTTPException(503, "the server is shutting down or its engine stopped")
        try:
            out = await aeng.generate([0], SamplingParams(temperature=0.0, max_tokens=1),
                                      k=0, request_id=f"health-{uuid.uuid4().hex}")
        except Exception as exc:  # noqa: BLE001 - unhealthy, whatever it is
            raise HTTPException(503, f"generating one token failed: {exc}") from exc
        return json_response({"status": "ok", "weight_version": out.weight_version})


#: the body readers, for the other native dialects' routes (``vllm_api``)
read_json_body = _json_body
parse_body = _parse

__all__ = ["finish_reason", "mount", "parse_body", "read_json_body", "sglang_result"]
