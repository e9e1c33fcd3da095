"""Which sequences run in the next step, and KV-block admission.

Prefill has priority (new requests start as soon as blocks allow); otherwise every running
sequence takes a decode / verify step. Blocks are allocated lazily, a step at a time; when they
run out the most recently admitted sequence is preempted: its blocks are freed and it waits to
be prefilled again over all its tokens (recompute). Sampling is keyed by (seed, position), so a
preempted sequence keeps its tokens and continues from the same random streams.

With a :class:`~specengine.core.seq_arena.SeqArena`, a sequence is attached to a slot when it
is admitted and detached when it is preempted or finishes, and the decode path is vectorised:
the room every running sequence needs (its length plus its lookahead, capped by the context)
is compared with its blocks in one numpy expression, and only the sequences that need a new
block are visited. When nothing changed, the same ``ScheduledBatch`` object comes back, so the
step's later stages can tell by identity that the batch is unchanged.

Admission reuses KV (docs/design.md §17): a fresh sample of a GRPO group (``SeqGroup``) whose
sibling was admitted earlier in the same prefill batch borrows that sibling's prompt pass
(shared full blocks, a copy of the partial last block, the same last-token logits); any other
sequence reuses the longest cached prefix of its tokens (``KVCache.plan``). Only the tokens a
prefill computes count against ``max_num_batched_tokens``.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specengine.core.kv_cache import KVCache, PrefillPlan
from specengine.core.prefix_cache import SeqGroup
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[Sequence, ...]
    is_prefill: bool


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_batch_size: int, max_num_batched_tokens: int,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 arena: SeqArena | None = None,
                 lookahead_of: Callable[[Sequence], int] | None = None) -> None:
        """``on_preempt(seq)`` runs after a sequence lost its blocks (the drafter drops its
        per-sequence state there). With ``arena`` (capacity >= ``max_batch_size``), running
        sequences live in its slots and ``lookahead_of(seq)`` (draft tokens a verify step
        feeds after the newest token, uncapped) is recorded at admission."""
        if arena is not None and arena.capacity < max_batch_size:
            raise ValueError(f"the arena holds {arena.capacity} sequences, fewer than "
                             f"max_batch_size {max_batch_size}")
        self.kv_cache = kv_cache
        self.on_preempt = on_preempt
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.arena = arena
        self.lookahead_of = lookahead_of
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._decode: ScheduledBatch | None = None  # the last decode batch, while unchanged
        self._slots: np.ndarray | None = None  # slots of ``running``, in order
        # Group of each sample (weak: a finished sequence leaves with its last holder; a
        # restarted one keeps its group, being reset in place).
        self.group_of: weakref.WeakKeyDictionary[Sequence, SeqGroup] = (
            weakref.WeakKeyDictionary())

    def add(self, seq: Sequence, group: SeqGroup | None = None) -> None:
        """Queue ``seq``; ``group``: the GRPO group it is a sample of."""
        if group is not None:
            self.group_of[seq] = group
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: Callable[[Sequence], int]) -> ScheduledBatch:
        """The next batch. ``lookahead(seq)`` is how many draft tokens the seq's next verify
        step feeds after its newest token (0 for plain decoding), capped by the context (the
        arena path computes the same from ``lookahead_of`` and the arena's lengths)."""
        batch: list[Sequence] = []
        num_tokens = 0
        leaders: dict[int, Sequence] = {}  # group id -> its sample computing the prompt
        while self.waiting and len(self.running) + len(batch) < self.max_batch_size:
            seq = self.waiting[0]
            plan = self._plan(seq, leaders)
            if batch and num_tokens + plan.num_computed > self.max_num_batched_tokens:
                break
            if not self.kv_cache.can_admit(plan):
                break
            self.kv_cache.admit(plan)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self._admit(seq)
            batch.append(seq)
            num_tokens += plan.num_computed
        if batch:
            self.running.extend(batch)
            self._changed()
            return ScheduledBatch(tuple(batch), is_prefill=True)
        if self.arena is not None:
            return self._schedule_decode()

        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below while making room for an earlier sequence
            if self._make_room(seq, len(seq) + lookahead(seq), scheduled):
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("scheduler: no sequence can run (KV cache too small for one)")
        return ScheduledBatch(tuple(scheduled), is_prefill=False)

    def _plan(self, seq: Sequence, leaders: dict[int, Sequence]) -> PrefillPlan:
        """Borrow a fresh sibling's prompt pass in this batch, else reuse cached blocks."""
        group = self.group_of.get(seq)
        fresh = len(seq) == seq.num_prompt_tokens
        if group is None or not fresh:
            return self.kv_cache.plan(seq)
        leader = leaders.get(group.group_id)
        if leader is not None:
            return self.kv_cache.plan_borrow(seq, leader)
        leaders[group.group_id] = seq
        return self.kv_cache.plan(seq)

    def _schedule_decode(self) -> ScheduledBatch:
        """Every running sequence, visiting only those that need a new block."""
        arena = self.arena
        assert arena is not None
        if self._slots is None:
            self._slots = np.fromiter((s.slot for s in self.running), np.int64,
                                      len(self.running))
        slots = self._slots
        # The steady case: every table grown in one C++ pass, no sequence visited.
        if self.kv_cache.ensure_running(arena, slots):
            if self._decode is None:
                self._decode = ScheduledBatch(
                    tuple(s for s in self.running if s.status is SeqStatus.RUNNING), False)
            return self._decode
        # Blocks ran out: grow sequence by sequence, preempting the latest admitted.
        lens = arena.lens[slots]
        # context (len - 1) + the newest token + drafts, the drafts capped by the context
        need = lens + np.minimum(arena.lookahead[slots], arena.max_model_len - lens)
        short = np.flatnonzero(need > arena.num_blocks[slots] * self.kv_cache.block_size)
        running = list(self.running)
        short_set = set(short.tolist())
        scheduled: list[Sequence] = []
        for i, seq in enumerate(running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while making room for an earlier sequence
            if i not in short_set or self._make_room(seq, int(need[i]), scheduled):
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("scheduler: no sequence can run (KV cache too small for one)")
        self._decode = ScheduledBatch(tuple(scheduled), is_prefill=False)
        return self._decode

    def _make_room(self, seq: Sequence, need: int, scheduled: list[Sequence]) -> bool:
        """Blocks for ``need`` tokens of ``seq``, preempting the latest admitted others (or
        ``seq`` itself) when they run out. True if ``seq`` still runs."""
        if need > seq.num_blocks * self.kv_cache.block_size:
            if not self._grow(seq, need, scheduled):
                return False
        return True

    def _grow(self, seq: Sequence, need: int, scheduled: list[Sequence]) -> bool:
        while not self.kv_cache.can_ensure(seq, need):
            victim = self._last_running(exclude=(seq, *scheduled))
            self.preempt(victim if victim is not None else seq)
            if victim is None:
                return False
        self.kv_cache.ensure(seq, need)
        return True

    def finish(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._changed()
        seq.detach()

    def abort_all(self) -> list[Sequence]:
        """Drop every request and free its blocks (after an error mid-generate)."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.kv_cache.free(seq)
            seq.detach()
            seq.status = SeqStatus.FINISHED
        self.kv_cache.pending.clear()
        self.running.clear()
        self.waiting.clear()
        self._changed()
        return seqs

    def _admit(self, seq: Sequence) -> None:
        if self.arena is None:
            return
        slot = seq.attach(self.arena)
        self.arena.lookahead[slot] = self.lookahead_of(seq) if self.lookahead_of else 0

    def _changed(self) -> None:
        self._decode, self._slots = None, None

    def _last_running(self, exclude: tuple[Sequence, ...]) -> Sequence | None:
        for seq in reversed(self.running):
            if all(seq is not e for e in exclude) and seq.status is SeqStatus.RUNNING:
                return seq
        return None

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.evict(seq)
        self.waiting.appendleft(seq)

    # ---- running chosen sequences apart (core.isolation) --------------------------------------
    def evict(self, seq: Sequence) -> None:
        """Take ``seq`` out as a preemption does (blocks freed, slot given back, the drafter's
        state dropped through ``on_preempt``; its tokens are kept) but queue it nowhere: the
        caller runs it again with :meth:`admit_only`."""
        self.kv_cache.free(seq)
        seq.detach()
        seq.status = SeqStatus.WAITING
        if seq in self.running:
            self.running.remove(seq)
        self._changed()
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def admit_only(self, seqs: list[Sequence]) -> ScheduledBatch:
        """A prefill batch of the first of ``seqs`` (waiting: evicted, or queued, then taken
        out of the queue) that fit ``max_num_batched_tokens`` (at least one), admitted ahead
        of the waiting queue. The
        latest admitted running sequences are preempted while blocks or slots are short;
        raises when the first cannot fit even then (validation rules that out)."""
        batch: list[Sequence] = []
        num_tokens = 0
        leaders: dict[int, Sequence] = {}
        for seq in seqs:
            plan = self._plan(seq, leaders)
            if batch and num_tokens + plan.num_computed > self.max_num_batched_tokens:
                break
            while (not self.kv_cache.can_admit(plan)
                   or len(self.running) + len(batch) >= self.max_batch_size):
                victim = self._last_running(exclude=())
                if victim is None:
                    break
                self.preempt(victim)
            else:
                if seq in self.waiting:  # preempted by an earlier retry: run it here, once
                    self.waiting.remove(seq)
                self.kv_cache.admit(plan)
                seq.status = SeqStatus.RUNNING
                self._admit(seq)
                batch.append(seq)
                num_tokens += plan.num_computed
                continue
            if not batch:
                raise RuntimeError(f"scheduler: seq {seq.seq_id} cannot run even alone (KV "
                                   "cache too small for it)")
            break
        self.running.extend(batch)
        self._changed()
        return ScheduledBatch(tuple(batch), is_prefill=True)

    def decode_only(self, seqs: tuple[Sequence, ...], lookahead: Callable[[Sequence], int]
                    ) -> ScheduledBatch:
        """A verify step of just the running ones of ``seqs``, their tables grown (preempting
        the latest admitted others, or one of ``seqs``, while blocks are short)."""
        scheduled: list[Sequence] = []
        for seq in seqs:
            if seq.status is SeqStatus.RUNNING and self._make_room(
                    seq, len(seq) + lookahead(seq), scheduled):
                scheduled.append(seq)
        return ScheduledBatch(tuple(scheduled), is_prefill=False)
