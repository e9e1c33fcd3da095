"""Counters of one busy span of the engine (docs/design.md §3 ``engine.stats``).

A span starts at the first ``step`` after the engine was idle and ends when no request is
left; ``generate`` needs an idle engine and runs until its requests finish, so its span is
exactly the call. Step counts and times cover every step of the span; token counts cover the
requests that finished (or were aborted) in it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from specengine.model_runner import PrefillCounts
from specengine.outputs import EngineStats
from specengine.sequence import Sequence
from specengine.speculate import StepTimes


@dataclass
class RunStats:
    """Mutable accumulator; :meth:`snapshot` gives the frozen :class:`EngineStats`."""

    times: StepTimes = field(default_factory=StepTimes)
    start: float = field(default_factory=time.perf_counter)
    end: float = 0.0
    prefill_s: float = 0.0
    num_forwards: int = 0  # prefill and verify passes
    num_generated: int = 0
    num_draft: int = 0
    num_accepted: int = 0
    auto_k_steps: list[int] = field(default_factory=list)  # steps of auto groups, by k
    num_prompt_tokens: int = 0  # prefills: tokens held, reused, blocks shared (§17)
    num_cached_prompt_tokens: int = 0
    num_shared_blocks: int = 0

    def add_prefill(self, counts: PrefillCounts) -> None:
        """Count one prefill pass (``ModelRunner.last_prefill``)."""
        self.num_prompt_tokens += counts.num_prompt_tokens
        self.num_cached_prompt_tokens += counts.num_cached_prompt_tokens
        self.num_shared_blocks += counts.num_shared_blocks

    def count_auto_k(self, k: int) -> None:
        """A step of a ``k="auto"`` group ran with ``k`` drafts."""
        if k >= len(self.auto_k_steps):
            self.auto_k_steps.extend([0] * (k + 1 - len(self.auto_k_steps)))
        self.auto_k_steps[k] += 1

    def add_finished(self, seq: Sequence) -> None:
        """Count a request that left the engine (finished or aborted)."""
        self.num_generated += seq.num_generated
        self.num_draft += seq.num_draft_tokens
        self.num_accepted += seq.num_accepted_tokens

    def snapshot(self) -> EngineStats:
        t = self.times
        # The last step's bookkeeping events (CUDA): read once done; waited for only after
        # the span ended (no step is running then).
        t.settle(wait=self.end > 0)
        return EngineStats(
            num_steps=t.num_steps,
            num_seq_steps=t.num_seq_steps,
            num_step_tokens=t.num_step_tokens,
            num_generated_tokens=self.num_generated,
            num_draft_tokens=self.num_draft,
            num_accepted_tokens=self.num_accepted,
            accepted_per_position=tuple(t.accepted_per_position),
            proposed_per_position=tuple(t.proposed_per_position),
            num_target_forwards=self.num_forwards,
            time_draft_s=t.draft, time_verify_s=t.verify,
            time_bookkeeping_s=t.bookkeeping, time_prefill_s=self.prefill_s,
            wall_time_s=max(0.0, (self.end or time.perf_counter()) - self.start),
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_shared_blocks=self.num_shared_blocks,
            auto_k_steps=tuple(self.auto_k_steps),
        )




def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """One ``EngineStats`` for several runs (``generate`` calls, pool workers): counters and
    times summed, per-position lists summed position by position."""
    first = stats[0]
    if len(stats) == 1:
        return first
    merged = {}
    for f in dataclasses.fields(first):
        vals = [getattr(s, f.name) for s in stats]
        if isinstance(vals[0], tuple):
            width = max(len(v) for v in vals)
            merged[f.name] = tuple(sum(v[i] for v in vals if i < len(v)) for i in range(width))
        else:
            merged[f.name] = sum(vals)
    return type(first)(**merged)


__all__ = ["RunStats", "merge_stats"]
