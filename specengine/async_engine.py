"""``AsyncSpecEngine``: the step API served to asyncio callers (docs/design.md §3).

One background thread (``specengine.async_loop.EngineLoop``) owns the wrapped
:class:`~specengine.engine.SpecEngine` and is the only thread that touches it; callers on any
event loop hand it commands and get each step's outputs back through a per-request
``asyncio.Queue``.

Back-pressure: at most ``max_waiting`` requests may be unfinished (queued or running); one more
raises :class:`EngineOverloadedError` at once and adds nothing. A caller that is cancelled, or
that closes its stream early, aborts its request on the engine thread (KV blocks freed at
once). A request's own bad input raises ``ValueError`` in its caller only; an error inside
``step()`` (the engine then aborts every request) is raised in every caller whose request was
unfinished, and the engine goes on serving new requests.

Text work stays off the step loop: a text prompt is tokenized (after the checks that need no
engine state: a text or id list too long for ``max_model_len`` is refused by its length) in
a small thread pool of the async engine, and the engine thread gets token ids; the final
output's ``text`` is decoded in that pool too (the wrapped engine's ``core.detokenize`` is off
while it is wrapped). A huge prompt therefore neither stalls the other requests' steps nor
holds the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from specengine.async_loop import EngineClosedError, EngineLoop, EngineOverloadedError
from specengine.core.auto_k import DEFAULT_K_MAX
from specengine.core.requests import is_chat, prompt_ids
from specengine.engine import SpecEngine
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.tree import TreeArg

T = TypeVar("T")

# Threads that tokenize prompts and decode outputs: few, so that many huge prompts at once hold
# at most this many tokenizations' memory (each bounded by TextTokenizer's length check).
TEXT_WORKERS = 2


class AsyncSpecEngine:
    """asyncio front end of a :class:`SpecEngine`, whose step loop runs in a background thread.

    ``await generate(prompt, params)`` returns the request's :class:`GenerationOutput`;
    ``async for out in generate_stream(...)`` yields its :class:`RequestOutput` per step (the
    last has ``finished=True`` and ``output``). Outputs equal ``SpecEngine.generate``'s for the
    same prompt, params (seed) and k. Use ``contextlib.aclosing`` around a stream that may be
    left early, so the request is aborted at once rather than when the generator is collected.
    Close with ``await close()`` or ``async with``; the engine must not be used directly
    meanwhile (use :meth:`run_in_engine`).
    """

    def __init__(self, engine: SpecEngine, *, max_waiting: int = 4096) -> None:
        if not isinstance(engine, SpecEngine):
            raise ValueError(f"engine must be a SpecEngine, got {type(engine).__name__}")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1, got {max_waiting!r}")
        if engine.has_unfinished():
            raise ValueError("the engine has unfinished requests: finish or abort them first")
        self.engine = engine
        self.max_waiting = max_waiting
        self._text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="specengine-text")
        engine.core.detokenize = False  # outputs are decoded in _text_pool (close() restores)
        self._loop = EngineLoop(engine, max_waiting)

    @classmethod
    def from_pretrained(cls, model: str | Path, draft: str | Path | None = None, *,
                        max_waiting: int = 4096, **engine_kwargs: Any) -> AsyncSpecEngine:
        """Build a ``SpecEngine(model, draft, **engine_kwargs)`` and wrap it."""
        return cls(SpecEngine(model, draft, **engine_kwargs), max_waiting=max_waiting)

    @property
    def thread(self) -> threading.Thread:
        """The engine thread (alive until :meth:`close`)."""
        return self._loop.thread

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished (what ``max_waiting`` bounds)."""
        return self._loop.num_unfinished

    # ---- callers (event loop side) -----------------------------------------------------------
    async def generate(self, prompt: list[int] | str, params: SamplingParams | None = None, *,
                       k: int | str | None = None, tree: TreeArg = None,
                       request_id: str | None = None, k_max: int = DEFAULT_K_MAX
                       ) -> GenerationOutput:
        """Run one request to the end and return its output (arguments as
        ``SpecEngine.add_request``; one sample: a group's outputs come from
        :meth:`generate_stream`). Cancelling the caller aborts the request."""
        if isinstance(params, SamplingParams) and params.n > 1:
            raise ValueError(f"generate returns one output; got n={params.n}: iterate "
                             "generate_stream for the samples of a group")
        stream = self.generate_stream(prompt, params, k=k, tree=tree, request_id=request_id,
                                      k_max=k_max)
        async with contextlib.aclosing(stream):
            async for out in stream:
                if out.output is not None:
                    return out.output
        raise AssertionError("a stream ends with a finished output")  # pragma: no cover

    async def generate_stream(self, prompt: list[int] | str, params: SamplingParams | None = None,
                              *, k: int | str | None = None,
                              tree: TreeArg = None,
                              request_id: str | None = None, k_max: int = DEFAULT_K_MAX
                              ) -> AsyncIterator[RequestOutput]:
        """Yield the request's :class:`RequestOutput` of each step it advanced in; the last one
        is finished and carries the :class:`GenerationOutput`. Leaving early (``aclose``,
        cancellation) aborts the request. Raises ``EngineOverloadedError`` when ``max_waiting``
        requests are unfinished, ``EngineClosedError`` after :meth:`close`, ``ValueError`` for
        bad input (also a ``request_id`` still in use). ``k_max``: the largest k of a
        ``k="auto"`` request (``SpecEngine.add_request``).

        ``params.n > 1``: one GRPO group, added as ``SpecEngine.add_request`` adds it (the
        prompt prefilled once, its KV shared by the samples); the stream yields every
        sample's outputs as they come (``request_id`` ``f"{request_id}-{i}"`` for sample i;
        with no ``request_id``, a fresh one stands for it) and ends when all n finished."""
        n = params.n if isinstance(params, SamplingParams) else 1
        loop = asyncio.get_running_loop()
        if n > 1:
            chs = self._loop.register_group(request_id, n, loop)
            request_id = chs[0].request_id.rsplit("-", 1)[0]  # the group's (maybe fresh) id
        else:
            chs = [self._loop.register(request_id, loop)]
            request_id = chs[0].request_id
        queue = chs[0].queue  # a group's channels share it
        done = False
        try:
            try:
                if isinstance(prompt, str) or is_chat(prompt):  # never on the engine thread
                    prompt = await loop.run_in_executor(self._text_pool, self._admit, prompt)
                else:
                    prompt = self._admit(prompt)
            except ValueError:  # refused before the engine saw it: its slots are free at once
                done = True
                for ch in chs:
                    self._loop.release(ch)
                raise
            self._loop.send("add", (chs, request_id, prompt, params, k, tree, k_max))
            num_finished = 0
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                num_finished += item.finished
                done = num_finished == n
                if item.output is not None:
                    item = await self._with_text(item)
                yield item
                if done:
                    return
        finally:
            if not done:  # cancelled or closed early: free its KV blocks now
                for ch in chs:  # (a finished sample's cancel is a no-op)
                    self._loop.send("cancel", ch)

    def _admit(self, prompt: object) -> object:
        """The checks of ``prompt`` that need no engine state, and a text's token ids (run in
        the text pool); the engine checks the rest when it adds the request. A prompt that
        cannot fit in ``max_model_len`` is refused by its length before any per-token work.
        The message is ``requests.validate_requests``' (single requests are prompt 0)."""
        max_model_len = self.engine.config.max_model_len
        if isinstance(prompt, str) or is_chat(prompt):
            prompt = prompt_ids(prompt, 0, self.engine.tokenizer)
        if isinstance(prompt, (list, tuple)) and len(prompt) >= max_model_len:
            raise ValueError(f"prompt 0 has {len(prompt)} tokens; max_model_len is "
                             f"{max_model_len}, which leaves no room to generate")
        return prompt

    async def _with_text(self, out: RequestOutput) -> RequestOutput:
        """``out`` with its final output's ``text`` decoded in the text pool (the engine
        thread leaves it None while wrapped here)."""
        tok = self.engine.tokenizer
        final = out.output
        if tok is None or final is None or final.text is not None:
            return out
        try:
            text = await asyncio.get_running_loop().run_in_executor(
                self._text_pool, tok.decode, final.token_ids)
        except RuntimeError:  # closed meanwhile (the pool takes no work): decode right here
            text = tok.decode(final.token_ids)
        return dataclasses.replace(out, output=dataclasses.replace(final, text=text))

    async def run_in_text_pool(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the text pool, where prompts are tokenized: text work (tokenizing,
        rendering a chat template) off the event loop and off the engine thread, at most
        ``TEXT_WORKERS`` at once. Raises ``EngineClosedError`` after :meth:`close`."""
        try:
            fut = self._text_pool.submit(fn)
        except RuntimeError as exc:  # the pool takes no work once closed
            raise EngineClosedError("the async engine is closed") from exc
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> RequestOutput:
        """Abort an unfinished request (its KV blocks are freed at once); its caller gets the
        final output (``finish_reason="abort"``), which is also returned here. An id that is
        not unfinished here raises ``ValueError``."""
        return await self._with_text(
            await asyncio.wrap_future(self._loop.call("abort", request_id)))

    async def run_in_engine(self, fn: Callable[[SpecEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or
        raise its error), e.g. ``await aeng.run_in_engine(lambda e: e.load_weights(sd))``."""
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        return await asyncio.wrap_future(self._loop.call("call", fn))

    async def close(self) -> None:
        """Stop the engine thread: unfinished requests are aborted (KV freed) and their callers
        get ``EngineClosedError``; later calls raise it too. Idempotent."""
        self._loop.request_close()
        await asyncio.get_running_loop().run_in_executor(None, self._loop.thread.join)
        self._text_pool.shutdown(wait=False)  # a queued prompt still ends (closed error)
        self.engine.core.detokenize = True  # the engine's own callers get text again

    async def __aenter__(self) -> AsyncSpecEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncSpecEngine", "EngineClosedError", "EngineOverloadedError"]
