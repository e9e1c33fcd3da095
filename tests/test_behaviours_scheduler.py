"""Scheduler behaviours at their edges (``specengine.core.scheduler``), in-process: the real
``KVCache`` and ``SeqArena``, no model (a prefill is ``KVCache.finish_prefill``).

- the token budget of a prefill batch is exact (a batch of exactly ``max_num_batched_tokens``
  computed tokens is taken whole), and a group's fresh samples borrow the first sample's
  prompt pass, computing nothing (so the whole group fits the budget of one prompt);
- a decode step grows each sequence for its own lookahead; an arena without a lookahead
  function records none;
- when not even one sequence can run, the step says so;
- preemptions are counted; aborted sequences are finished and hold nothing.
"""

from __future__ import annotations

import re

import pytest
import torch

from specengine import SamplingParams
from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import SeqGroup
from specengine.core.scheduler import Scheduler
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence

BS = 16
NO_ROOM = "scheduler: no sequence can run (KV cache too small for one)"


def kv(num_blocks: int) -> KVCache:
    return KVCache(num_blocks, BS, 1, 1, 2, torch.float32, "cpu")


def seq(i: int, n: int, token: int = 1) -> Sequence:
    return Sequence(i, [token] * n, SamplingParams(max_tokens=500), seed=i, eos_token_ids=())


def scheduler(num_blocks: int, budget: int = 1000, batch: int = 8, arena: bool = True,
              lookahead_of=lambda s: 0) -> Scheduler:
    return Scheduler(kv(num_blocks), max_batch_size=batch, max_num_batched_tokens=budget,
                     arena=SeqArena(batch, 1000) if arena else None, lookahead_of=lookahead_of)


def test_arena_must_hold_a_whole_batch() -> None:
    with pytest.raises(ValueError, match="^the arena holds 3 sequences, fewer than "
                                         "max_batch_size 4$"):
        Scheduler(kv(4), max_batch_size=4, max_num_batched_tokens=64, arena=SeqArena(3, 100))


@pytest.mark.parametrize("budget,admitted", [(20, 2), (19, 1)])
def test_prefill_batch_fills_the_token_budget_exactly(budget: int, admitted: int) -> None:
    sched = scheduler(8, budget=budget)
    seqs = [seq(0, 10), seq(1, 10)]
    for s in seqs:
        sched.add(s)
    assert sched.schedule(lambda s: 0).seqs == tuple(seqs[:admitted])


def test_group_samples_borrow_the_first_samples_prompt_pass() -> None:
    """Three fresh samples of a 20-token prompt (a full block and a partial one) under a
    budget of 20 tokens: one computes the prompt, the others borrow it (its full block shared,
    its partial block copied) and all three are admitted in one batch; another group's sample
    in the same batch has its own leader."""
    sched = scheduler(16, budget=40)
    group, other = SeqGroup(100, 3), SeqGroup(101, 2)
    samples = [seq(i, 20) for i in range(3)]
    for s in samples:
        sched.add(s, group)
    lone = [seq(3, 20, token=7), seq(4, 20, token=7)]
    for s in lone:
        sched.add(s, other)
    batch = sched.schedule(lambda s: 0)
    assert batch.is_prefill and batch.seqs == (*samples, *lone)
    plans = [sched.kv_cache.pending[s.seq_id] for s in (*samples, *lone)]
    first, lead = samples[0], lone[0]
    assert plans[0].leader is None and plans[0].num_computed == 20
    for s, plan in zip(samples[1:], plans[1:3]):
        assert plan.leader is first and plan.num_computed == 0
        assert s.block_table[0] == first.block_table[0]  # the full block, shared
        assert plan.copy_src == first.block_table[1]  # the partial one, copied
    assert plans[3].leader is None and plans[4].leader is lead


def test_unsampled_groups_do_not_borrow() -> None:
    """A sequence queued without a group computes its own prompt, even beside an identical
    one."""
    sched = scheduler(16, budget=40)
    a, b = seq(0, 20), seq(1, 20)
    sched.add(a)
    sched.add(b)
    sched.schedule(lambda s: 0)
    assert all(sched.kv_cache.pending[s.seq_id].leader is None for s in (a, b))
    assert a.block_table[0] != b.block_table[0]


@pytest.mark.parametrize("arena", [False, True], ids=["lists", "arena"])
def test_decode_grows_each_sequence_for_its_own_lookahead(arena: bool) -> None:
    look = {0: 0, 1: 20}
    sched = scheduler(16, arena=arena, lookahead_of=lambda s: look[s.seq_id])
    a, b = seq(0, 16), seq(1, 16)
    sched.add(a)
    sched.add(b)
    sched.schedule(lambda s: look[s.seq_id])
    batch = sched.schedule(lambda s: look[s.seq_id])
    assert not batch.is_prefill and batch.seqs == (a, b)
    assert [len(a.block_table), len(b.block_table)] == [1, 3]  # 16 and 16 + 20 tokens


def test_an_arena_without_a_lookahead_function_records_none() -> None:
    sched = Scheduler(kv(8), max_batch_size=2, max_num_batched_tokens=64,
                      arena=SeqArena(2, 1000))
    a = seq(0, 16)
    sched.add(a)
    sched.schedule(lambda s: 0)
    assert sched.arena.lookahead[a.slot] == 0
    sched.schedule(lambda s: 0)
    assert len(a.block_table) == 1  # 16 tokens, no draft slot: one block


@pytest.mark.parametrize("arena", [False, True], ids=["lists", "arena"])
def test_a_step_no_sequence_fits_in_says_so(arena: bool) -> None:
    """One sequence whose next step needs 3 blocks of a 2-block cache: it preempts itself,
    and the step has nothing to run."""
    sched = scheduler(2, arena=arena, lookahead_of=lambda s: 20)
    a = seq(0, 16)
    sched.add(a)
    sched.schedule(lambda s: 20)
    with pytest.raises(RuntimeError, match="^" + re.escape(NO_ROOM) + "$"):
        sched.schedule(lambda s: 20)
    assert a.status is SeqStatus.WAITING and not a.block_table


def test_every_preemption_is_counted() -> None:
    sched = scheduler(8)
    seqs = [seq(i, 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule(lambda s: 0)
    sched.preempt(seqs[2])
    sched.preempt(seqs[1])
    assert sched.num_preemptions == 2
    assert list(sched.waiting) == [seqs[1], seqs[2]]


def test_aborted_sequences_are_finished_and_hold_nothing() -> None:
    sched = scheduler(8, batch=2)
    seqs = [seq(i, 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule(lambda s: 0)  # two run, one waits
    assert sorted(s.seq_id for s in sched.abort_all()) == [0, 1, 2]
    assert all(s.status is SeqStatus.FINISHED and not s.block_table for s in seqs)
    assert not sched.has_unfinished()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


# ---- running chosen sequences apart (core.isolation's retries) ---------------------------------
@pytest.mark.parametrize("budget,admitted", [(20, 2), (19, 1), (29, 2)])
def test_admit_only_fills_the_token_budget_exactly(budget: int, admitted: int) -> None:
    """Three 10-token sequences retried apart: as many as the budget holds in one prefill."""
    sched = scheduler(8, budget=budget)
    seqs = [seq(i, 10) for i in range(3)]
    batch = sched.admit_only(seqs)
    assert batch.is_prefill and batch.seqs == tuple(seqs[:admitted])
    assert sched.running == seqs[:admitted]
    assert all(s.status is SeqStatus.WAITING for s in seqs[admitted:])


def test_admit_only_preempts_for_each_slot_it_fills() -> None:
    """Batch limit 2, one sequence running: retrying two sequences preempts it for the
    second one's slot (never more than the limit running)."""
    sched = scheduler(8, batch=2, arena=False)
    old = seq(9, 10)
    sched.add(old)
    sched.schedule(lambda s: 0)
    pair = [seq(0, 10), seq(1, 10)]
    assert sched.admit_only(pair).seqs == tuple(pair)
    assert sched.running == pair and list(sched.waiting) == [old]
    assert old.status is SeqStatus.WAITING and sched.num_preemptions == 1


def test_admit_only_stops_at_the_first_that_cannot_fit_beside_the_batch() -> None:
    """A 2-block cache: the first retried sequence takes a block, the second needs two and
    nothing running can make room: the batch is the first alone, the second waits."""
    sched = scheduler(2)
    small, large = seq(0, 10), seq(1, 30)
    batch = sched.admit_only([small, large])
    assert batch.seqs == (small,) and sched.running == [small]
    assert large.status is SeqStatus.WAITING and not large.block_table


def test_admit_only_refuses_one_that_cannot_fit_alone() -> None:
    sched = scheduler(2)
    with pytest.raises(RuntimeError, match=r"^scheduler: seq 5 cannot run even alone \(KV "
                                           r"cache too small for it\)$"):
        sched.admit_only([seq(5, 40)])


def test_admit_only_lets_fresh_group_samples_borrow() -> None:
    sched = scheduler(16, budget=20)
    group = SeqGroup(200, 2)
    a, b = seq(0, 20), seq(1, 20)
    sched.add(a, group)
    sched.add(b, group)
    sched.waiting.clear()  # taken out of the queue, as a retry takes its suspects
    assert sched.admit_only([a, b]).seqs == (a, b)
    assert sched.kv_cache.pending[b.seq_id].leader is a


def test_decode_only_grows_each_for_its_own_lookahead_preempting_the_latest_other() -> None:
    """A 4-block cache, three running sequences of a block each: a verify step of the first
    alone with 20 draft slots needs 2 more blocks: the latest admitted other is preempted
    for the one not free."""
    look = {0: 20, 1: 0, 2: 0}
    sched = scheduler(4, arena=False)
    seqs = [seq(i, 16) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule(lambda s: 0)
    batch = sched.decode_only((seqs[0],), lambda s: look[s.seq_id])
    assert not batch.is_prefill and batch.seqs == (seqs[0],)
    assert len(seqs[0].block_table) == 3
    assert seqs[2].status is SeqStatus.WAITING and seqs[1].status is SeqStatus.RUNNING
