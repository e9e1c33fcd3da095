"""Issue 29: scheduler admission and preemption at their edges (``specengine.core.scheduler``).

Who is preempted (the latest admitted), where it goes (the front of the queue), who hears of
it (``on_preempt``, the drafter's hook), a prompt longer than the token budget admitted alone,
the decode room capped by the context, an abort that leaves no pending plan, and a group
sample with generated tokens prefilled on its own (only a fresh sample borrows its sibling's
prompt). Real KV caches on the C++ allocator and a real arena; block size 4.
``mutation/mutate.py --area sched`` shows each test fails on the change it targets.
"""

from __future__ import annotations

import torch

from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import SeqGroup
from specengine.core.scheduler import Scheduler
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence
from specengine.sampling import SamplingParams


def make(num_blocks: int, *, batch: int = 4, budget: int = 64, lookahead: int = 0,
         max_model_len: int = 1000, preempted: list | None = None) -> Scheduler:
    kv = KVCache(num_blocks, 4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                 device="cpu")
    return Scheduler(kv, max_batch_size=batch, max_num_batched_tokens=budget,
                     on_preempt=preempted.append if preempted is not None else None,
                     arena=SeqArena(batch, max_model_len), lookahead_of=lambda s: lookahead)


def seq_of(i: int, n: int) -> Sequence:
    return Sequence(i, [1] * n, SamplingParams(max_tokens=100), seed=i, eos_token_ids=())


def test_preemption_takes_the_latest_admitted_and_requeues_it_first() -> None:
    preempted: list[Sequence] = []
    sched = make(2, lookahead=1, preempted=preempted)
    a, b, c = seq_of(0, 4), seq_of(1, 4), seq_of(2, 4)
    for s in (a, b, c):
        sched.add(s)
    assert sched.schedule(lambda s: 1).seqs == (a, b)  # c waits: no block left
    batch = sched.schedule(lambda s: 1)  # 4 + 1 tokens each: a takes b's block
    assert batch.seqs == (a,) and not batch.is_prefill and a.num_blocks == 2
    assert b.status is SeqStatus.WAITING and not b.block_table
    assert list(sched.waiting) == [b, c]  # b resumes before anything queued after it
    assert preempted == [b] and sched.num_preemptions == 1


def test_a_prompt_longer_than_the_token_budget_runs_alone() -> None:
    sched = make(8, budget=8)
    long, short = seq_of(0, 12), seq_of(1, 2)
    sched.add(long)
    sched.add(short)
    assert sched.schedule(lambda s: 0).seqs == (long,)
    assert sched.schedule(lambda s: 0).seqs == (short,)


def test_decode_room_is_capped_by_the_context() -> None:
    """At 6 of max_model_len 8 tokens a lookahead of 5 needs 2 more slots, not 5: ``a`` keeps
    its 2 blocks, and ``b``, which cannot grow, gives way (its block is freed)."""
    sched = make(3, lookahead=5, max_model_len=8)
    a, b = seq_of(0, 6), seq_of(1, 2)
    sched.add(a)
    sched.add(b)
    assert sched.schedule(lambda s: 5).seqs == (a, b)
    batch = sched.schedule(lambda s: 5)
    assert batch.seqs == (a,) and b.status is SeqStatus.WAITING
    assert a.num_blocks == 2 and sched.kv_cache.num_free_blocks == 1


def test_abort_all_leaves_no_pending_plan() -> None:
    sched = make(8)
    seqs = [seq_of(i, 5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule(lambda s: 0)  # admitted: their prefill plans are pending
    assert len(sched.kv_cache.pending) == 3
    assert sched.abort_all() == seqs
    assert sched.kv_cache.pending == {} and sched.kv_cache.num_free_blocks == 8


def test_a_group_sample_with_tokens_is_prefilled_on_its_own() -> None:
    """Only a fresh sample borrows its sibling's prompt pass; one that already generated
    (preempted and requeued) has more tokens than that pass computes."""
    sched = make(8)
    group = SeqGroup(7, 2)
    fresh = Sequence(0, list(range(8)), SamplingParams(), seed=0, eos_token_ids=())
    resumed = Sequence(1, list(range(8)), SamplingParams(), seed=1, eos_token_ids=())
    resumed.append([3, 4, 5], [0.0, 0.0, 0.0], max_model_len=1000)
    sched.add(fresh, group)
    sched.add(resumed, group)
    assert sched.schedule(lambda s: 0).seqs == (fresh, resumed)
    plan = sched.kv_cache.pending[resumed.seq_id]
    assert plan.leader is None and plan.num_computed == 11
    assert not set(fresh.block_table) & set(resumed.block_table)
    assert resumed.num_blocks == 3
