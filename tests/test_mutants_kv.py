"""Issue 29: the KV cache's block accounting at its edges (``specengine.core.kv_cache``).

What admission may count as free (cached blocks nobody holds, minus the ones the plan itself
reuses), the last prompt token always computed, borrowed blocks referenced without a prefix
cache, a freed sequence's pending plan dropped, and blocks named only after a prefill the
drafter caught up on. ``mutation/mutate.py --area kv`` shows each test fails on the change it
targets. Real caches on the C++ block allocator; block size 4.
"""

from __future__ import annotations

import torch

from specengine.core.kv_cache import KVCache
from specengine.core.sequence import Sequence
from specengine.sampling import SamplingParams


def make_cache(num_blocks: int, prefix: bool = True) -> KVCache:
    return KVCache(num_blocks, 4, num_layers=1, num_kv_heads=1, head_dim=8,
                   dtype=torch.float32, device="cpu", prefix_caching=prefix)


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), seed=seq_id, eos_token_ids=())


def prefilled(cache: KVCache, seq: Sequence) -> Sequence:
    cache.admit(cache.plan(seq))
    cache.finish_prefill([seq])
    return seq


PROMPT = list(range(1, 10))  # 9 tokens: 2 full blocks and one partial


def test_admission_counts_reused_cached_blocks_once() -> None:
    """Two named blocks nobody holds are free for others but not for the plan reusing them."""
    cache = make_cache(4)
    a = prefilled(cache, seq_of(0, PROMPT))
    named = a.block_table[:2]
    cache.free(a)
    assert cache.num_free_blocks == 4  # 2 free + 2 cached nobody holds
    fits = cache.plan(seq_of(1, PROMPT[:8] + [50] * 8))  # 16 tokens: 2 reused + 2 new
    assert fits.shared == named and cache.can_admit(fits)
    too_big = cache.plan(seq_of(2, PROMPT[:8] + [50] * 9))  # 17 tokens: 2 reused + 3 new
    assert too_big.shared == named and not cache.can_admit(too_big)
    cache.admit(fits)
    assert cache.num_free_blocks == 0


def test_plan_leaves_the_last_token_to_compute() -> None:
    """A prompt made only of cached full blocks still computes its last block: its last
    token's logits sample the first new token."""
    cache = make_cache(8)
    a = prefilled(cache, seq_of(0, PROMPT))
    plan = cache.plan(seq_of(1, PROMPT[:8]))
    assert plan.shared == a.block_table[:1] and plan.num_cached == 4
    assert plan.num_computed == 4


def test_borrowed_blocks_are_referenced_without_a_prefix_cache() -> None:
    cache = make_cache(8, prefix=False)
    leader = seq_of(0, PROMPT)
    cache.admit(cache.plan(leader))
    sample = seq_of(1, PROMPT)
    cache.admit(cache.plan_borrow(sample, leader))
    refs = cache.allocator.ref_counts().tolist()
    assert [refs[b] for b in leader.block_table] == [2, 2, 1]
    assert sample.block_table[:2] == leader.block_table[:2]
    cache.free(leader)  # the sample still holds the shared blocks
    assert [cache.allocator.ref_counts().tolist()[b] for b in sample.block_table[:2]] == [1, 1]
    cache.free(sample)
    assert cache.num_free_blocks == 8


def test_free_drops_the_pending_plan() -> None:
    """A sequence freed between admission and its prefill's end (aborted, preempted) leaves
    no plan behind (it would hold the sequence and, later, name blocks it no longer owns)."""
    cache = make_cache(8)
    seq = seq_of(3, PROMPT)
    cache.admit(cache.plan(seq))
    assert 3 in cache.pending
    cache.free(seq)
    assert cache.pending == {}


def test_blocks_are_named_only_after_a_prefill_the_drafter_caught_up_on() -> None:
    cache = make_cache(8)
    cache.follow_drafter(name_next_token=False, names_need_draft=True, draft_hits=None)
    a = seq_of(0, PROMPT)
    cache.admit(cache.plan(a))
    cache.finish_prefill([a], drafted=False)
    assert cache.plan(seq_of(1, PROMPT)).shared == []
    b = seq_of(2, PROMPT)
    cache.admit(cache.plan(b))
    cache.finish_prefill([b], drafted=True)
    assert cache.plan(seq_of(3, PROMPT)).shared == b.block_table[:2]
