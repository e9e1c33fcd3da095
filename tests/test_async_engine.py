"""``AsyncSpecEngine``: concurrent asyncio callers get exactly ``SpecEngine.generate``'s outputs;
back-pressure, cancellation, bad input, step errors and close leave the engine usable and leak
no KV blocks (docs/design.md §3). Real event loops (``asyncio.run``) and a real engine thread."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

import pytest
from readme_blocks import run_readme_blocks

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.async_engine import EngineClosedError, EngineOverloadedError
from specengine.outputs import GenerationOutput, RequestOutput


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      max_batch_size=64, kv_cache_tokens=16 * 1024)


def mixed_params(n: int, base: int = 0) -> list[SamplingParams]:
    """Greedy and seeded sampling, 8..16 tokens."""
    return [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=8 + i % 9,
                           seed=1000 + base + i) for i in range(n)]


def long_params(n: int) -> list[SamplingParams]:
    """Requests that run for many steps (no early stop)."""
    return [SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True) for _ in range(n)]


def assert_same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def assert_idle_and_free(engine: SpecEngine) -> None:
    """Call only once the engine thread has stopped, or from ``run_in_engine``."""
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.drafter.kv_cache.num_free_blocks == engine.drafter.kv_cache.num_blocks


async def settle(aeng: AsyncSpecEngine) -> None:
    """Commands run in order: this runs after every abort queued so far."""
    await aeng.run_in_engine(assert_idle_and_free)
    assert aeng.num_unfinished == 0


async def stream_all(aeng: AsyncSpecEngine, prompt: str, params: SamplingParams, k: int,
                     first: asyncio.Event | None = None) -> tuple[list[int], RequestOutput]:
    """Every step's new tokens and the final output; ``first`` is set at the first item."""
    tokens: list[int] = []
    async with aclosing(aeng.generate_stream(prompt, params, k=k)) as stream:
        async for out in stream:
            tokens.extend(out.new_token_ids)
            if first is not None:
                first.set()
            last = out
    return tokens, last


def test_200_concurrent_requests_equal_generate(engine: SpecEngine) -> None:
    prompts = heldout_prompts(200, seed=3)
    params = mixed_params(200)
    expected = engine.generate(prompts, k=3, sampling=params)

    async def main() -> list[GenerationOutput]:
        async with AsyncSpecEngine(engine) as aeng:
            outs = await asyncio.gather(*(aeng.generate(p, sp, k=3)
                                          for p, sp in zip(prompts, params)))
            await settle(aeng)
        assert not aeng.thread.is_alive()
        return outs

    got = asyncio.run(main())
    for out, want in zip(got, expected):
        assert_same(out, want)
    assert any(p.temperature > 0 for p in params) and any(p.temperature == 0 for p in params)
    assert sum(o.num_draft_tokens for o in got) > 0


def test_requests_added_while_others_run_equal_generate(engine: SpecEngine) -> None:
    prompts = heldout_prompts(24, seed=5)
    params = mixed_params(24, base=50)
    expected = engine.generate(prompts, k=3, sampling=params)

    async def main() -> list[tuple[list[int], RequestOutput]]:
        async with AsyncSpecEngine(engine) as aeng:
            first = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream_all(aeng, p, sp, 3, ev))
                     for p, sp, ev in zip(prompts[:8], params[:8], first)]
            for wave in (1, 2):  # the earlier requests are mid-generation when these join
                await asyncio.gather(*(ev.wait() for ev in first[:8 * wave]))
                assert aeng.num_unfinished > 0
                tasks += [asyncio.create_task(stream_all(aeng, p, sp, 3, ev))
                          for p, sp, ev in zip(prompts[8 * wave:8 * wave + 8],
                                               params[8 * wave:8 * wave + 8],
                                               first[8 * wave:8 * wave + 8])]
            results = await asyncio.gather(*tasks)
            await settle(aeng)
        return results

    for (tokens, last), want in zip(asyncio.run(main()), expected):
        assert last.finished and last.output is not None
        assert_same(last.output, want)
        assert tuple(tokens) == last.output.token_ids  # the stream adds up to the output


def test_cancelled_callers_free_their_kv_blocks(engine: SpecEngine) -> None:
    prompts = heldout_prompts(12, seed=7)
    keep = mixed_params(6)
    expected = engine.generate(prompts[:6], k=3, sampling=keep)

    async def main() -> list[tuple[list[int], RequestOutput]]:
        async with AsyncSpecEngine(engine) as aeng:
            kept = [asyncio.create_task(stream_all(aeng, p, sp, 3))
                    for p, sp in zip(prompts[:6], keep)]
            first = [asyncio.Event() for _ in range(3)]
            doomed = [asyncio.create_task(stream_all(aeng, p, sp, 3, ev))
                      for p, sp, ev in zip(prompts[6:9], long_params(3), first)]
            doomed += [asyncio.create_task(aeng.generate(p, sp, k=3))
                       for p, sp in zip(prompts[9:11], long_params(2))]
            await asyncio.gather(*(ev.wait() for ev in first))  # mid-generation
            for task in doomed:
                task.cancel()
            # A stream its consumer leaves early (closed, not cancelled) aborts too.
            async with aclosing(aeng.generate_stream(prompts[11], long_params(1)[0], k=3)) as s:
                async for out in s:
                    assert not out.finished
                    break
            results = await asyncio.gather(*kept)
            await asyncio.gather(*doomed, return_exceptions=True)
            assert all(task.cancelled() for task in doomed)
            # 200-token requests would still run had they not been aborted.
            await settle(aeng)
            # The engine goes on serving.
            again = await aeng.generate(prompts[0], keep[0], k=3)
            assert_same(again, expected[0])
        return results

    for (tokens, last), want in zip(asyncio.run(main()), expected):
        assert_same(last.output, want)  # type: ignore[arg-type]
        assert tuple(tokens) == want.token_ids


def test_back_pressure_refuses_the_excess_request(engine: SpecEngine) -> None:
    prompts = heldout_prompts(4, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = engine.generate(prompts, k=3, sampling=params)

    async def main() -> None:
        async with AsyncSpecEngine(engine, max_waiting=3) as aeng:
            streams = [aeng.generate_stream(p, params, k=3) for p in prompts[:3]]
            firsts = [await s.__anext__() for s in streams]  # all three are unfinished
            assert not any(f.finished for f in firsts)
            with pytest.raises(EngineOverloadedError, match="max_waiting=3"):
                await aeng.generate(prompts[3], params, k=3)
            assert aeng.num_unfinished == 3
            assert await aeng.run_in_engine(lambda e: e.core.num_unfinished) == 3  # none added
            for stream, first, want in zip(streams, firsts, expected):
                tokens = list(first.new_token_ids)
                async with aclosing(stream):
                    async for out in stream:
                        tokens.extend(out.new_token_ids)
                assert out.output is not None and tuple(tokens) == want.token_ids
            assert_same(await aeng.generate(prompts[3], params, k=3), expected[3])  # room again
            await settle(aeng)

    asyncio.run(main())


def test_bad_request_raises_in_its_caller_only(engine: SpecEngine) -> None:
    prompts = heldout_prompts(4, seed=11)
    params = mixed_params(4)
    expected = engine.generate(prompts, k=3, sampling=params)
    vocab = engine.model_config.vocab_size

    async def main() -> None:
        async with AsyncSpecEngine(engine) as aeng:
            good = [aeng.generate(p, sp, k=3, request_id=f"g{i}")
                    for i, (p, sp) in enumerate(zip(prompts, params))]
            bad = [aeng.generate([1, 2, vocab], params[0], k=3),  # token id outside the vocab
                   aeng.generate(prompts[0], params[0], k=99),
                   aeng.generate(prompts[0], {"temperature": 0.0}),  # type: ignore[arg-type]
                   aeng.generate(prompts[0], params[0], request_id="g1")]  # in use
            outs = await asyncio.gather(*good[:2], *bad, *good[2:], return_exceptions=True)
            for out, want in zip(outs[:2] + outs[-2:], expected):
                assert isinstance(out, GenerationOutput)
                assert_same(out, want)
            errors = outs[2:-2]
            assert all(isinstance(e, ValueError) for e in errors), errors
            assert "vocab" in str(errors[0]) and "k" in str(errors[1])
            assert "already used" in str(errors[3])
            await settle(aeng)
            assert aeng.thread.is_alive()

    asyncio.run(main())


def test_step_error_reaches_every_caller_and_engine_recovers(engine: SpecEngine) -> None:
    """A fault of every verify step is the engine's (core.isolation gives up after a few
    sequences fail alone): every caller gets it, and the engine serves on once mended. A
    one-off fault is absorbed: the step is undone and retried, and every caller gets its
    normal output."""
    prompts = heldout_prompts(3, seed=13)
    params = long_params(3)
    expected = engine.generate(prompts[:1], k=3, sampling=mixed_params(1))
    clean = engine.generate(prompts, k=3, sampling=params)

    def break_decode_steps(e: SpecEngine, once: bool) -> None:
        def boom(*args: object) -> None:
            if once:
                del e.core.decode_step  # the class's method is back
            raise RuntimeError("injected step failure")

        e.core.decode_step = boom  # type: ignore[method-assign]

    def mend(e: SpecEngine) -> None:
        del e.core.decode_step

    async def main() -> None:
        async with AsyncSpecEngine(engine) as aeng:
            for once in (False, True):
                first = [asyncio.Event() for _ in prompts]
                tasks = [asyncio.create_task(stream_all(aeng, p, sp, 3, ev))
                         for p, sp, ev in zip(prompts, params, first)]
                await asyncio.gather(*(ev.wait() for ev in first))
                await aeng.run_in_engine(lambda e, once=once: break_decode_steps(e, once))
                outs = await asyncio.gather(*tasks, return_exceptions=True)
                if once:
                    for (tokens, last), want in zip(outs, clean):  # type: ignore[misc]
                        assert_same(last.output, want)
                        assert tokens == list(want.token_ids)
                else:
                    assert all(isinstance(o, RuntimeError) and "injected" in str(o)
                               for o in outs), outs
                    await aeng.run_in_engine(mend)
                await settle(aeng)  # the engine aborted them all / they finished
                assert_same(await aeng.generate(prompts[0], mixed_params(1)[0], k=3),
                            expected[0])

    asyncio.run(main())


def test_abort_and_run_in_engine(engine: SpecEngine) -> None:
    prompt = heldout_prompts(1, seed=15)[0]

    async def main() -> None:
        async with AsyncSpecEngine(engine) as aeng:
            assert await aeng.run_in_engine(lambda e: threading.current_thread()) is aeng.thread
            stream = aeng.generate_stream(prompt, long_params(1)[0], k=3, request_id="x")
            first = await stream.__anext__()
            with pytest.raises(ValueError, match="must increase"):  # the engine's own refusal
                await aeng.run_in_engine(lambda e: e.load_weights({}, version=0))
            final = await aeng.abort("x")
            assert final.finished and final.output.finish_reason == "abort"  # type: ignore[union-attr]
            tokens = list(first.new_token_ids)
            async with aclosing(stream):
                async for out in stream:
                    tokens.extend(out.new_token_ids)
            assert out.output == final.output and tuple(tokens) == final.output.token_ids
            with pytest.raises(ValueError, match="not an unfinished request"):
                await aeng.abort("x")
            await settle(aeng)

    asyncio.run(main())


def test_close_fails_pending_callers_and_stops_the_thread(engine: SpecEngine) -> None:
    prompts = heldout_prompts(4, seed=17)

    async def main() -> AsyncSpecEngine:
        aeng = AsyncSpecEngine(engine)
        first = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(stream_all(aeng, p, sp, 3, ev))
                 for p, sp, ev in zip(prompts, long_params(4), first)]
        await asyncio.gather(*(ev.wait() for ev in first))
        late = asyncio.create_task(aeng.generate(prompts[0], long_params(1)[0]))
        # Registered before close or refused by it: closed either way.
        await aeng.close()
        outs = await asyncio.gather(*tasks, late, return_exceptions=True)
        assert all(isinstance(o, EngineClosedError) for o in outs), outs
        with pytest.raises(EngineClosedError):
            await aeng.generate(prompts[0])
        with pytest.raises(EngineClosedError):
            await aeng.run_in_engine(lambda e: None)
        await aeng.close()  # idempotent
        return aeng

    aeng = asyncio.run(main())
    assert not aeng.thread.is_alive()
    assert_idle_and_free(engine)  # the thread is gone: the engine is ours again


def test_bad_construction(engine: SpecEngine) -> None:
    with pytest.raises(ValueError, match="engine must be a SpecEngine"):
        AsyncSpecEngine(object())  # type: ignore[arg-type]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_waiting must be an int >= 1"):
            AsyncSpecEngine(engine, max_waiting=bad)  # type: ignore[arg-type]
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished requests"):
        AsyncSpecEngine(engine)
    engine.abort(rid)


def test_readme_async_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's async block, after its first Usage block (which makes ``engine``)."""
    ns = run_readme_blocks("## Usage\n", "### Async API")
    for got, want in zip(ns["async_outs"], ns["outs"]):  # type: ignore[call-overload]
        assert_same(got, want)
    assert "True" in capsys.readouterr().out  # the stream's last item is finished
    assert_idle_and_free(ns["engine"])  # type: ignore[arg-type]
