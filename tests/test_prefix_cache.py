"""Prefix caching and shared prompt blocks (docs/design.md §17).

The randomized test drives the real scheduler and KV cache (no model: a prefill is simulated
by ``KVCache.finish_prefill``, a decode step appends a token) through 10^4 events: groups and
lone requests with prompts drawn from a few shared prefixes, decode steps that grow tables and
preempt, finishes, aborts, explicit preemptions and weight updates. After every event each
block's reference count must be the number of tables holding it plus one if the prefix cache
names it; double frees raise in the allocator. The engine tests check that reuse is exact and
that a weight update leaves nothing to hit.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from specengine import SamplingParams, SpecEngine
from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import SeqGroup, block_hashes
from specengine.core.scheduler import Scheduler
from specengine.core.sequence import SeqStatus, Sequence

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_block_hashes_chain_on_the_whole_prefix() -> None:
    a = list(range(48))
    b = [99] + a[1:]
    ha, hb = block_hashes(a, BS, 3), block_hashes(b, BS, 3)
    assert ha == block_hashes(list(a), BS, 3) and len(set(ha)) == 3
    assert all(x != y for x, y in zip(ha, hb))  # block 0 differs: every later name differs
    assert block_hashes(a + [1, 2], BS, 3) == ha  # a partial tail names nothing


# ---- randomized: shared blocks never leak, never double-free ----------------------------------
def check_refs(cache: KVCache, seqs: list[Sequence]) -> None:
    expected = Counter(b for s in seqs for b in s.block_table)
    for b in cache.prefix.hash_of:
        expected[b] += 1
    refs = cache.allocator.ref_counts()
    assert refs.tolist() == [expected.get(b, 0) for b in range(cache.num_blocks)]
    evictable = set(cache.prefix.evictable)
    assert evictable == {b for b in cache.prefix.hash_of if refs[b] == 1}
    assert cache.num_free_blocks == cache.allocator.num_free + len(evictable)


def test_random_events_with_shared_blocks_leak_nothing() -> None:
    rng = random.Random(0)
    cache = KVCache(24, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)
    sched = Scheduler(cache, max_batch_size=12, max_num_batched_tokens=400)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(8, 70))] for _ in range(4)]
    live: list[Sequence] = []  # added, not finished
    next_id, hits, borrows, preempted = 0, 0, 0, 0
    for _ in range(10_000):
        ev = rng.random()
        if ev < 0.12 and len(live) < 30:  # a request, maybe a group
            prompt = rng.choice(stems)[: rng.randrange(1, 71)] or [1]
            prompt = prompt + [rng.randrange(100) for _ in range(rng.randrange(0, 3))]
            n = rng.choice([1, 1, 2, 4])
            group = SeqGroup(next_id, n) if n > 1 else None
            for _ in range(n):
                seq = Sequence(next_id, prompt, SamplingParams(max_tokens=120), 0, ())
                next_id += 1
                sched.add(seq, group)
                live.append(seq)
        elif ev < 0.70 and sched.has_unfinished():  # one engine step
            batch = sched.schedule(lambda s: rng.randrange(0, 3))
            if batch.is_prefill:
                plans = [cache.pending[s.seq_id] for s in batch.seqs]
                hits += sum(p.leader is None and p.num_cached > 0 for p in plans)
                borrows += sum(p.leader is not None for p in plans)
                cache.finish_prefill(batch.seqs)
            for seq in batch.seqs:
                seq.append([rng.randrange(100)], [0.0], 10_000)
                if seq.status is SeqStatus.FINISHED or rng.random() < 0.01:
                    sched.finish(seq)
                    live.remove(seq)
                else:
                    seq.num_cached_tokens = len(seq) - 1
        elif ev < 0.80 and live:  # abort
            seq = rng.choice(live)
            if seq.status is SeqStatus.RUNNING:
                sched.finish(seq)
            else:
                sched.waiting.remove(seq)
                cache.free(seq)
            live.remove(seq)
        elif ev < 0.84 and sched.running:  # preempt (e.g. kv_on_update="recompute")
            sched.preempt(rng.choice(sched.running))
            preempted += 1
        elif ev < 0.93:  # a weight update
            cache.invalidate_prefix_cache()
        check_refs(cache, [s for s in live if s.status is SeqStatus.RUNNING])
        for s in live:
            if s.status is SeqStatus.WAITING:
                assert not s.block_table
    assert hits > 50 and borrows > 50 and preempted > 50 and sched.num_preemptions > preempted
    for seq in list(sched.running):
        sched.finish(seq)
    cache.invalidate_prefix_cache()
    assert (cache.allocator.ref_counts() == 0).all()
    assert cache.allocator.num_free == cache.num_blocks


def test_lru_evicts_least_recently_released_tails_first() -> None:
    cache = KVCache(6, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)
    seqs = []
    for i, n in enumerate((33, 33)):  # 2 full blocks + a partial each
        seq = Sequence(i, [i] * n, SamplingParams(), 0, ())
        cache.admit(cache.plan(seq))
        cache.finish_prefill([seq])
        seqs.append(seq)
    a, b = seqs
    a_blocks, b_blocks = a.block_table[:2], b.block_table[:2]
    cache.free(a)
    cache.free(b)
    assert list(cache.prefix.evictable) == a_blocks[::-1] + b_blocks[::-1]
    big = Sequence(2, [7] * 40, SamplingParams(), 0, ())  # 3 blocks: 2 free + 1 evicted
    cache.admit(cache.plan(big))
    assert a_blocks[1] in big.block_table and a_blocks[0] in cache.prefix.evictable
    plan = cache.plan(Sequence(3, [1] * 33, SamplingParams(), 0, ()))  # b is still cached
    assert plan.shared == b_blocks and plan.num_cached == 32


# ---- engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> tuple[SpecEngine, SpecEngine]:
    kw = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048)
    return (SpecEngine(tiny_checkpoint, **kw),
            SpecEngine(tiny_checkpoint, enable_prefix_caching=False, **kw))


def test_second_call_reuses_full_blocks_with_the_same_output(engines) -> None:
    on, off = engines
    prompts = [list(range(1, 41)), list(range(1, 33)) + [90, 91, 92], list(range(50, 82))]
    first = on.generate(prompts, sampling=GREEDY)
    assert on.stats.num_cached_prompt_tokens == 0
    again = on.generate(prompts, sampling=GREEDY)
    # 40 tokens: 2 of 2 full blocks; 35: 2 of 2; 32: only 1 (the last token is recomputed)
    assert on.stats.num_cached_prompt_tokens == 32 + 32 + 16
    assert on.stats.num_prompt_tokens == 40 + 35 + 32 and on.stats.num_shared_blocks == 5
    plain = off.generate(prompts, sampling=GREEDY)
    assert off.stats.num_cached_prompt_tokens == 0
    for x, y, z in zip(first, again, plain):
        assert x.token_ids == y.token_ids == z.token_ids
        np.testing.assert_allclose(y.logprobs, z.logprobs, atol=1e-5)


def test_weight_update_clears_the_cache(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from checkpoints import make_hf_model, save_checkpoint

    new = save_checkpoint(make_hf_model("qwen3", seed=5), tmp_path / "new")
    kw = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048)
    eng = SpecEngine(tiny_checkpoint, **kw)
    prompt = list(range(3, 60))
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True, n=2)
    eng.generate([prompt], sampling=sampled)
    assert len(eng.kv_cache.prefix) == 3 + 2  # the prompt's 3 blocks, each sample's 4th
    eng.load_weights(new)
    assert len(eng.kv_cache.prefix) == 0
    got = eng.generate([prompt], sampling=sampled)
    assert eng.stats.num_cached_prompt_tokens == 57  # the sibling's borrow only: no cache hit
    want = SpecEngine(new, **kw).generate([prompt], sampling=sampled)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


# ---- issue 29: a hole in the cached prefix, and weight updates racing a prefill ---------------
def prefilled(cache: KVCache, seqs: list[Sequence]) -> None:
    """Plan and admit ``seqs`` in one batch (so none hits another's blocks), then prefill."""
    for plan in [cache.plan(s) for s in seqs]:
        cache.admit(plan)
    cache.finish_prefill(seqs)


def test_match_stops_at_the_first_evicted_block() -> None:
    """Two requests share a 2-block prefix in one batch: the short one names blocks 0 and 1,
    the long one only its block 2 (0 and 1 were named first). Once the short one's block 1 is
    evicted, a third request with the long prompt may reuse block 0 alone: the long one's
    block 2 holds KV of position 32.., not 16.., and must not stand in for block 1."""
    cache = KVCache(16, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)
    stem = list(range(1, 33))
    short = Sequence(0, stem + [7], SamplingParams(), 0, ())
    long = Sequence(1, stem + list(range(40, 57)), SamplingParams(), 0, ())  # 3 full blocks
    prefilled(cache, [short, long])
    hashes = block_hashes(long.token_ids, BS, 3)
    short_blocks = short.block_table[:2]
    assert [cache.prefix.block_of[h] for h in hashes] == short_blocks + long.block_table[2:3]
    cache.free(short)  # its blocks 1, 0 become evictable, in that order
    assert cache.prefix.evict(1) == 1 and hashes[1] not in cache.prefix.block_of
    plan = cache.plan(Sequence(2, list(long.token_ids), SamplingParams(), 0, ()))
    assert plan.shared == short_blocks[:1] and plan.num_cached == BS
    # Every reused block is named by the hash of its own position.
    assert [cache.prefix.hash_of[b] for b in plan.shared] == hashes[: len(plan.shared)]


def test_prefill_planned_before_a_weight_update_registers_nothing() -> None:
    """A prefill planned under the old weights (epoch 0) finishes after the update: its blocks
    hold old-weight KV, so no name may be given to them; a plan after the update registers."""
    cache = KVCache(16, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)
    prompt = list(range(1, 41))  # 2 full blocks
    old = Sequence(0, prompt, SamplingParams(), 0, ())
    cache.admit(cache.plan(old))
    cache.invalidate_prefix_cache()  # the update lands between plan and finish
    cache.finish_prefill([old])
    assert len(cache.prefix) == 0
    assert cache.plan(Sequence(1, prompt, SamplingParams(), 0, ())).shared == []
    check_refs(cache, [old])
    new = Sequence(2, prompt, SamplingParams(), 0, ())
    prefilled(cache, [new])
    assert len(cache.prefix) == 2
    assert cache.plan(Sequence(3, prompt, SamplingParams(), 0, ())).shared == new.block_table[:2]


def test_invalidation_forgets_names_and_gives_back_unheld_blocks() -> None:
    """After a weight update nothing hits, blocks only the cache held are free again and
    blocks a running sequence holds stay its own (one reference, no name)."""
    cache = KVCache(16, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)
    done = Sequence(0, list(range(1, 41)), SamplingParams(), 0, ())
    running = Sequence(1, list(range(50, 90)), SamplingParams(), 0, ())
    prefilled(cache, [done, running])
    cache.free(done)
    assert len(cache.prefix) == 4 and len(cache.prefix.evictable) == 2
    epoch = cache.prefix.epoch
    cache.invalidate_prefix_cache()
    assert cache.prefix.epoch == epoch + 1
    assert len(cache.prefix) == 0 and not cache.prefix.evictable and not cache.prefix.hash_of
    for seq in (done, running):
        assert cache.plan(Sequence(9, list(seq.token_ids), SamplingParams(), 0, ())).shared == []
    check_refs(cache, [running])  # the running table: one reference each, nothing named
    assert cache.allocator.num_free == cache.num_blocks - len(running.block_table)
    cache.free(running)
    assert cache.allocator.num_free == cache.num_blocks and len(cache.prefix.evictable) == 0
