"""Scheduler and KV admission: requests wait or are preempted when blocks run out, and the
output is the same as with a cache large enough for everything."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from arena_reference import pack

from specengine import SamplingParams, SpecEngine
from specengine.core.kv_cache import KVCache
from specengine.core.scheduler import Scheduler
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def ragged_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def big(tiny_checkpoint: Path) -> SpecEngine:
    return SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", dtype="float32",
                      max_model_len=128, max_batch_size=16, kv_cache_tokens=4096)


@pytest.mark.parametrize("k", [0, 3])
def test_small_cache_waits_and_preempts_with_identical_output(tiny_checkpoint: Path,
                                                              big: SpecEngine, k: int) -> None:
    prompts = ragged_prompts(12)
    expected = big.generate(prompts, k=k, sampling=GREEDY)
    # 10 blocks of 16: room for about three sequences at a time, so most wait and the
    # growing ones preempt each other.
    small = SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", dtype="float32",
                       max_model_len=128, max_batch_size=16, kv_cache_tokens=160)
    got = small.generate(prompts, k=k, sampling=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert small.scheduler.num_preemptions > 0
    assert small.kv_cache.num_free_blocks == small.kv_cache.num_blocks
    small.kv_cache.invalidate_prefix_cache()  # cached prompt blocks hold a reference each
    assert (small.kv_cache.allocator.ref_counts() == 0).all()


def test_ragged_finish_with_stop_tokens_and_max_tokens(big: SpecEngine) -> None:
    prompts = ragged_prompts(8, seed=1)
    free = big.generate(prompts, sampling=SamplingParams(temperature=0.0, max_tokens=30))
    params = []
    for i, out in enumerate(free):
        if i % 2:  # stop at the 6th generated token (its first occurrence)
            stop = out.token_ids[5]
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,)))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=3 + i))
    for k in (0, 2, 5):
        got = big.generate(prompts, k=k, sampling=params)
        for i, (g, f) in enumerate(zip(got, free)):
            if i % 2:
                cut = f.token_ids.index(f.token_ids[5]) + 1
                assert g.finish_reason == "stop"
            else:
                cut = 3 + i
                assert g.finish_reason == "length"
            assert g.token_ids == f.token_ids[:cut]
            assert g.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-5)
        assert big.kv_cache.num_free_blocks == big.kv_cache.num_blocks


def test_max_model_len_cuts_generation(big: SpecEngine) -> None:
    prompt = ragged_prompts(1, seed=3)[0][:20]
    for k in (0, 4):
        out = big.generate([prompt], k=k, sampling=SamplingParams(temperature=0.0,
                                                                  max_tokens=1000))[0]
        assert len(prompt) + len(out.token_ids) == big.config.max_model_len
        assert out.finish_reason == "length"


@pytest.mark.parametrize("in_arena", [False, True], ids=["lists", "arena"])
def test_scheduler_invariants_under_random_load(in_arena: bool) -> None:
    """A model of the engine loop: no batch exceeds its limits, every scheduled sequence owns
    exactly the blocks it needs, and everything is freed at the end. With an arena (the
    engine's case) running tables live in it and a decode step grows every short one at once
    (``KVCache.ensure_slots``), or falls back to preempting when the blocks do not cover
    them all."""
    rng = random.Random(0)
    kv = KVCache(num_blocks=12, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8,
                 dtype=__import__("torch").float32, device="cpu")
    lookahead = 3
    arena = SeqArena(5, 10_000) if in_arena else None
    sched = Scheduler(kv, max_batch_size=5, max_num_batched_tokens=64, arena=arena,
                      lookahead_of=lambda s: lookahead)
    seqs = []
    for i in range(40):
        params = SamplingParams(max_tokens=rng.randrange(1, 60))
        seq = Sequence(i, [1] * rng.randrange(1, 50), params, seed=i, eos_token_ids=())
        seqs.append(seq)
        sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 10_000
        batch = sched.schedule(lambda s: lookahead)
        assert 0 < len(batch.seqs) <= 5
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + kv.num_free_blocks == kv.num_blocks, "a block leaked"
        for seq in batch.seqs:
            assert seq.status is SeqStatus.RUNNING
            need = len(seq) if batch.is_prefill else len(seq) + lookahead
            assert len(seq.block_table) == kv.blocks_for(need)
        if batch.is_prefill:
            assert len(batch.seqs) == 1 or sum(len(s) for s in batch.seqs) <= 64
        for seq in batch.seqs:  # emit 1 .. lookahead+1 tokens
            n = 1 if batch.is_prefill else rng.randrange(1, lookahead + 2)
            if arena is None:
                seq.append([7] * n, [0.0] * n, max_model_len=10_000)
            else:
                assert seq.block_table == arena.blocks_of(seq.slot)
                none = np.zeros(1, dtype=np.int64)
                _, ended = arena.append_packed(
                    pack(np.full((1, n), 7), np.zeros((1, n)), np.array([n - 1])), 1,
                    np.array([seq.slot]), none, none, np.zeros((2, 0), np.int64), 0)
                if ended:
                    seq.finish("length")
            seq.num_cached_tokens = len(seq) - 1
            if seq.status is SeqStatus.FINISHED:
                sched.finish(seq)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(s.num_generated == s.params.max_tokens for s in seqs)
    assert sched.num_preemptions > 0
