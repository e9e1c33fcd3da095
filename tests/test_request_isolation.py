"""One bad request never hurts another (issue 22, docs/design.md §1, ``core.isolation``).

A real lower-level function of the step (the model runner's prefill, the static-path verify
pass, the EAGLE-3 drafter's propose) is wrapped to raise whenever its batch holds the culprit:
a request whose prompt carries ``SENTINEL``, a token no other prompt holds. The culprit alone
finishes with ``finish_reason="error"`` and the message; every other request's output equals
a clean run without it (greedy and seeded sampling, token for token), drafts are still
accepted, no KV block is left held, and the engine serves new requests. A wrapper that raises
for every batch (an engine-wide fault) still aborts everything and raises.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from server_helpers import post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.client import ServerError
from specengine.core.isolation import ENGINE_WIDE_AFTER
from specengine.core.kv_cache import KVCache
from specengine.core.scheduler import Scheduler
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence
from specengine.outputs import GenerationOutput

SENTINEL = 18  # in no arith prompt (vocab 20): the culprit's prompt starts with it
MESSAGE = "row data the kernel cannot take"
PROMPTS = [encode(p) for p in heldout_prompts(9, seed=3)]
INNOCENT = PROMPTS[:6]
CULPRITS = [[SENTINEL, *p] for p in PROMPTS[6:]]


class Boom(RuntimeError):
    pass


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=8 + 3 * (i % 3)) for i in range(n)]


def mixed(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling (randomness keyed by (seed, position))."""
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=8 + 3 * (i % 3),
                           seed=500 + i) for i in range(n)]


def make_engine(static: bool = False, **kw: int) -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", cuda_graphs=static,
                      graph_buckets=(1, 2, 4, 8), max_batch_size=16, **kw)


@functools.cache
def clean(k: int, static: bool, sampled: bool) -> tuple[GenerationOutput, ...]:
    """The innocent prompts, then the culprits' prompts, on an engine without failures."""
    params = mixed(6) if sampled else greedy(6)
    outs = make_engine(static).generate(INNOCENT, k=k, sampling=params)
    culprits = make_engine(static).generate(CULPRITS, k=k, sampling=greedy(len(CULPRITS)))
    return (*outs, *culprits)


def has_culprit(seqs: object) -> bool:
    return any(SENTINEL in s.token_slice(0, s.num_prompt_tokens)
               for s in seqs)  # type: ignore[attr-defined]


def install(engine: SpecEngine, stage: str, monkeypatch: pytest.MonkeyPatch,
            fails: Callable[[object], bool] = has_culprit) -> None:
    """Make ``stage`` raise ``Boom`` whenever ``fails(its sequences)``."""
    if stage == "prefill":
        real_prefill = engine.runner.prefill

        def prefill(seqs: tuple[Sequence, ...], *args: object, **kw: object) -> object:
            if fails(seqs):
                raise Boom(MESSAGE)
            return real_prefill(seqs, *args, **kw)

        monkeypatch.setattr(engine.runner, "prefill", prefill)
    elif stage == "verify":  # after drafting: the verify pass of the static buffers
        real_run = engine.graphs.run

        def run(shape: object) -> object:
            if fails(engine.graphs.verifier.state.seqs):
                raise Boom(MESSAGE)
            return real_run(shape)

        monkeypatch.setattr(engine.graphs, "run", run)
    else:
        assert stage == "propose"
        real_propose = engine.drafter.propose

        def propose(seqs: tuple[Sequence, ...], *args: object, **kw: object) -> object:
            if fails(seqs):
                raise Boom(MESSAGE)
            return real_propose(seqs, *args, **kw)

        monkeypatch.setattr(engine.drafter, "propose", propose)


def assert_free(engine: SpecEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.drafter.kv_cache.num_free_blocks == engine.drafter.kv_cache.num_blocks


def assert_same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


CASES = [(stage, k, static) for stage in ("prefill", "verify") for k in (0, 3)
         for static in (False, True)] + [("propose", 3, False), ("propose", 3, True)]


@pytest.mark.parametrize("stage,k,static", CASES,
                         ids=[f"{s}-k{k}-{'static' if g else 'eager'}" for s, k, g in CASES])
def test_the_culprit_alone_fails(stage: str, k: int, static: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    want = clean(k, static, True)  # greedy and seeded sampling: both keyed by position
    engine = make_engine(static)
    install(engine, stage, monkeypatch)
    params = mixed(6)
    batch = [*INNOCENT[:3], CULPRITS[0], *INNOCENT[3:]]
    outs = engine.generate(batch, k=k, sampling=[*params[:3], greedy(1)[0], *params[3:]])
    bad = outs.pop(3)
    assert bad.finish_reason == "error" and MESSAGE in bad.error and "Boom" in bad.error
    # what it made before it failed is its clean output's start (nothing after the failure)
    assert bad.token_ids == want[6].token_ids[: len(bad.token_ids)]
    if stage == "prefill":
        assert bad.token_ids == ()
    for got, ref in zip(outs, want[:6]):
        assert_same(got, ref)
    if k:  # the others still draft and accept after the retries
        assert all(o.num_accepted_tokens > 0 for o in outs)
        assert engine.stats.num_accepted_tokens > 0
    assert_free(engine)
    # The engine goes on: a new batch (the culprit again among them) is served the same way.
    again = engine.generate([INNOCENT[0], CULPRITS[0]], k=k, sampling=[params[0], greedy(1)[0]])
    assert_same(again[0], want[0])
    assert again[1].finish_reason == "error"
    assert_free(engine)


def test_a_failed_step_appends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """k=0 and k=3 requests step as two groups; the k=0 group (first) appends and finishes
    (a stop token) before the k=3 group's verify pass fails on the culprit. Undone, the k=0
    request is recomputed and stops at the same token, its failed step not counted."""
    want = clean(0, False, False)
    stop = want[0].token_ids[1]
    assert stop not in want[0].token_ids[:1]
    stops = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop,))
    engine = make_engine()
    install(engine, "verify", monkeypatch)
    a = engine.add_request(INNOCENT[0], stops, k=0)
    b = engine.add_request(INNOCENT[1], greedy(2)[1], k=3)
    c = engine.add_request(CULPRITS[0], greedy(1)[0], k=3)
    first = {o.request_id: o for o in engine.step()}  # the prefill: one token each
    assert not any(o.finished for o in first.values())
    ended = {o.request_id: o.output for o in engine.step()}  # the failing verify step
    assert ended[a] is not None and ended[a].token_ids == want[0].token_ids[:2]
    assert ended[a].finish_reason == "stop"
    assert ended[a].num_steps == 2  # its first prefill and its retry's, not the failed step
    assert ended[c] is not None and ended[c].finish_reason == "error"
    assert ended[b] is None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out.output
    assert_same(ended[b], want[1])
    assert_free(engine)


def test_step_api_reports_and_culprits_arriving_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Culprits join a running batch one at a time (their prefill fails, alone each); more
    than ENGINE_WIDE_AFTER of them, as the others' verify steps go through in between, are
    still one request's fault each. Every request's streamed tokens add up to its output."""
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = make_engine().generate(INNOCENT, k=3, sampling=long)
    engine = make_engine()
    install(engine, "prefill", monkeypatch)
    ids = [engine.add_request(p, long, k=3) for p in INNOCENT]
    culprits = CULPRITS * 2
    assert len(culprits) > ENGINE_WIDE_AFTER
    streamed: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    steps = 0
    while engine.has_unfinished():
        if steps % 2 and culprits:  # one joins at every other step: verify steps between
            engine.add_request(culprits.pop(), greedy(1)[0], k=3)
        steps += 1
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out.output
    assert not culprits
    errors = [o for o in done.values() if o.finish_reason == "error"]
    assert len(errors) == 2 * len(CULPRITS) and all(MESSAGE in o.error for o in errors)
    for rid, ref in zip(ids, want):
        assert_same(done[rid], ref)
    assert all(tuple(streamed[r]) == o.token_ids for r, o in done.items())
    assert_free(engine)


@pytest.mark.parametrize("stage,order", [("verify", "side-by-side"),
                                         ("prefill", "interleaved")])
def test_several_culprits_in_one_batch(stage: str, order: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad requests side by side, or more than ENGINE_WIDE_AFTER of them between good ones
    retried apart (each good one going through in between), are each one request's fault,
    not an engine-wide one."""
    want = clean(3, False, False)
    engine = make_engine()
    install(engine, stage, monkeypatch)
    if order == "side-by-side":
        batch, bad = [CULPRITS[0], CULPRITS[1], *INNOCENT], [0, 1]
    else:
        culprits = CULPRITS + [[SENTINEL, *INNOCENT[5]]]
        assert len(culprits) > ENGINE_WIDE_AFTER
        batch = [p for pair in zip(culprits, INNOCENT) for p in pair] + INNOCENT[4:]
        bad = [0, 2, 4, 6]
    params = iter(greedy(6))
    outs = engine.generate(batch, k=3, sampling=[greedy(1)[0] if i in bad else next(params)
                                                 for i in range(len(batch))])
    assert all(outs[i].finish_reason == "error" for i in bad)
    for got, ref in zip([o for i, o in enumerate(outs) if i not in bad], want[:6]):
        assert_same(got, ref)
    assert_free(engine)


@pytest.mark.parametrize("stage", ["prefill", "verify"])
def test_an_engine_wide_fault_aborts_all_and_raises(stage: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    install(engine, stage, monkeypatch, fails=lambda seqs: True)
    with pytest.raises(Boom, match=MESSAGE):
        engine.generate(INNOCENT, k=3, sampling=greedy(6))
    assert_free(engine)
    monkeypatch.undo()  # the device "recovers": the engine serves again
    assert_same(engine.generate(INNOCENT[:1], k=3, sampling=greedy(1))[0],
                clean(3, False, False)[0])


def test_error_is_set_exactly_with_finish_reason_error() -> None:
    base = dict(prompt_token_ids=(1,), token_ids=(2,), logprobs=(-0.5,), num_steps=1,
                num_draft_tokens=0, num_accepted_tokens=0)
    assert GenerationOutput(**base, finish_reason="error", error="Boom: x").error == "Boom: x"
    with pytest.raises(ValueError, match="exactly when finish_reason is 'error'"):
        GenerationOutput(**base, finish_reason="error")
    with pytest.raises(ValueError, match="exactly when finish_reason is 'error'"):
        GenerationOutput(**base, finish_reason="length", error="Boom: x")
    with pytest.raises(ValueError, match="non-empty str"):
        GenerationOutput(**base, finish_reason="error", error="")


def test_server_answers_the_culprit_alone_with_its_error(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Live server: the culprit's call gets a 500 with the message (non-stream; the stream's
    last event is the error), six concurrent others get 200 with the clean outputs."""
    want = clean(3, False, False)
    engine = make_engine()
    install(engine, "verify", monkeypatch)
    aeng = AsyncSpecEngine(engine)
    try:
        with running_server(aeng, default_k=3) as (server, client):
            def call(i: int) -> tuple[int, dict]:
                prompt = CULPRITS[0] if i == 6 else INNOCENT[i]
                sp = greedy(6)[i] if i < 6 else greedy(1)[0]
                return post_json(server.port, "/generate", {
                    "prompt_token_ids": prompt, "request_id": f"r{i}",
                    "sampling_params": {"temperature": 0.0, "max_tokens": sp.max_tokens}})

            with ThreadPoolExecutor(7) as pool:
                answers = list(pool.map(call, range(7)))
            status, body = answers.pop()
            assert status == 500 and MESSAGE in body["error"] and "'r6'" in body["error"]
            for (status, body), ref in zip(answers, want[:6]):
                assert status == 200, body
                assert tuple(body["token_ids"]) == ref.token_ids
                assert body["finish_reason"] == ref.finish_reason and body["error"] is None
            with pytest.raises(ServerError, match=MESSAGE) as err:
                list(client.generate_stream(CULPRITS[1], {"temperature": 0.0,
                                                          "max_tokens": 8}))
            assert err.value.status == 500
            assert client.generate(INNOCENT[0], greedy(1)[0]).token_ids == want[0].token_ids
            assert aeng.num_unfinished == 0
    finally:
        asyncio.run(aeng.close())
    assert_free(engine)


def test_tight_kv_and_token_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries in a small KV cache (a retry preempts running sequences for its blocks) and
    under a small ``max_num_batched_tokens`` (a retried set is prefilled in several batches):
    still the clean outputs."""
    kw = dict(kv_cache_tokens=160, max_num_batched_tokens=24)
    want = make_engine(**kw).generate(INNOCENT, k=3, sampling=greedy(6))
    engine = make_engine(**kw)
    install(engine, "verify", monkeypatch)
    outs = engine.generate([*INNOCENT[:3], CULPRITS[0], *INNOCENT[3:]], k=3,
                           sampling=[*greedy(6)[:3], greedy(1)[0], *greedy(6)[3:]])
    assert outs.pop(3).finish_reason == "error"
    for got, ref in zip(outs, want):
        assert_same(got, ref)
    assert engine.scheduler.num_preemptions > 0
    assert_free(engine)


def tiny_scheduler(num_blocks: int, budget: int = 64, batch: int = 4) -> Scheduler:
    kv = KVCache(num_blocks=num_blocks, block_size=4, num_layers=1, num_kv_heads=1,
                 head_dim=8, dtype=torch.float32, device="cpu")
    return Scheduler(kv, max_batch_size=batch, max_num_batched_tokens=budget,
                     arena=SeqArena(batch, 1000), lookahead_of=lambda s: 0)


def seq_of(i: int, n: int) -> Sequence:
    return Sequence(i, [1] * n, SamplingParams(max_tokens=8), seed=i, eos_token_ids=())


def test_admit_only_budget_room_and_refusal() -> None:
    sched = tiny_scheduler(num_blocks=6, budget=10)
    running = [seq_of(i, 3) for i in range(3)]  # a block each
    for s in running:
        sched.add(s)
    assert sched.schedule(lambda s: 0).seqs == tuple(running)
    held = [seq_of(10, 6), seq_of(11, 6)]  # two blocks each, 12 tokens > the budget of 10
    first = sched.admit_only(held)
    assert first.is_prefill and first.seqs == (held[0],)  # the budget cuts the batch
    assert [s.status for s in held] == [SeqStatus.RUNNING, SeqStatus.WAITING]
    second = sched.admit_only(held[1:])  # 1 block free: the latest admitted makes room
    assert second.seqs == (held[1],)
    assert held[0].status is SeqStatus.WAITING and list(sched.waiting) == [held[0]]
    assert sched.running == [*running, held[1]]
    # a queued one (preempted by a retry) runs from here and leaves the queue: never twice
    assert sched.admit_only([held[0]]).seqs == (held[0],)
    assert list(sched.waiting) == [held[1]] and sched.running == [*running, held[0]]
    # the batch limit (4) is full: one more preempts the latest admitted for its slot
    assert sched.admit_only([seq_of(12, 1)]).seqs[0].seq_id == 12
    assert held[0].status is SeqStatus.WAITING and len(sched.running) == 4
    too_long = seq_of(13, 30)  # 8 blocks: more than the cache holds
    with pytest.raises(RuntimeError, match="cannot run even alone"):
        sched.admit_only([too_long])
    assert too_long.status is SeqStatus.WAITING and not too_long.block_table


def test_decode_only_runs_just_the_running_ones() -> None:
    sched = tiny_scheduler(num_blocks=8)
    seqs = [seq_of(i, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule(lambda s: 0)
    sched.evict(seqs[1])
    assert seqs[1].status is SeqStatus.WAITING and seqs[1] not in sched.waiting
    batch = sched.decode_only(tuple(seqs), lambda s: 2)  # 4 + 2 tokens: a second block
    assert not batch.is_prefill and batch.seqs == (seqs[0], seqs[2])
    assert [s.num_blocks for s in batch.seqs] == [2, 2]
