"""Which sequences run in the next step, and KV-block admission.

Prefill has priority (new requests start as soon as blocks allow); otherwise every running
sequence takes a decode / verify step. Blocks are allocated lazily, a step at a time; when they
run out the most recently admitted sequence is preempted: its blocks are freed and it waits to
be prefilled again over all its tokens (recompute). Sampling is keyed by (seed, position), so a
preempted sequence keeps its tokens and continues from the same random streams.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specengine.kv_cache import KVCache
from specengine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[Sequence, ...]
    is_prefill: bool


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_batch_size: int, max_num_batched_tokens: int,
                 on_preempt: Callable[[Sequence], None] | None = None) -> None:
        """``on_preempt(seq)`` runs after a sequence lost its blocks (the drafter drops its
        per-sequence state there)."""
        self.kv_cache = kv_cache
        self.on_preempt = on_preempt
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: Callable[[Sequence], int]) -> ScheduledBatch:
        """The next batch. ``lookahead(seq)`` is how many draft tokens the seq's next verify
        step feeds after its newest token (0 for plain decoding)."""
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_batch_size:
            seq = self.waiting[0]
            if batch and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.kv_cache.can_ensure(seq, len(seq)):
                break
            self.kv_cache.ensure(seq, len(seq))
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            batch.append(seq)
            num_tokens += len(seq)
        if batch:
            self.running.extend(batch)
            return ScheduledBatch(tuple(batch), is_prefill=True)

        scheduled: list[Sequence] = []
        block_size = self.kv_cache.block_size
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below while making room for an earlier sequence
            need = len(seq) + lookahead(seq)  # context (len-1) + the newest token + drafts
            if need <= len(seq.block_table) * block_size:  # the common case: room already
                scheduled.append(seq)
                continue
            while not self.kv_cache.can_ensure(seq, need):
                victim = self._last_running(exclude=(seq, *scheduled))
                self._preempt(victim if victim is not None else seq)
                if victim is None:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.kv_cache.ensure(seq, need)
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("scheduler: no sequence can run (KV cache too small for one)")
        return ScheduledBatch(tuple(scheduled), is_prefill=False)

    def finish(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every request and free its blocks (after an error mid-generate)."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.kv_cache.free(seq)
            seq.status = SeqStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        return seqs

    def _last_running(self, exclude: tuple[Sequence, ...]) -> Sequence | None:
        for seq in reversed(self.running):
            if all(seq is not e for e in exclude) and seq.status is SeqStatus.RUNNING:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.kv_cache.free(seq)
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)
