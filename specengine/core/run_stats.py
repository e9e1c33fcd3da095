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
from typing import Any

import numpy as np

from specengine.core.model_runner import PrefillCounts
from specengine.core.sequence import Sequence
from specengine.model.expert_load import KINDS, ExpertLoad
from specengine.outputs import EngineStats
from specengine.tree import MAX_TREE_NODES


@dataclass
class StepTimes:
    """Mutable accumulators of one ``generate`` call (turned into frozen EngineStats after).

    Phase times come from ``GraphRunner.clock`` (``core.graphs.StepClock``): on the CPU
    host time (``verify`` runs until the sampled tokens are on the host); on CUDA the device's
    time between events recorded at the phase boundaries, read without a sync of their own.
    A step's ``bookkeeping`` (it ends with the drafter's catch-up pass) is then added at the
    next step's sync, or by :meth:`settle`."""

    draft: float = 0.0
    verify: float = 0.0  # the target pass and rejection sampling (one static pass / graph)
    bookkeeping: float = 0.0
    num_steps: int = 0
    num_seq_steps: int = 0  # (sequence, step) pairs
    num_step_tokens: int = 0  # tokens those steps kept (after stop / max_tokens cuts)
    # [2, P]: drafts proposed / accepted at each draft position (P covers any k or tree depth)
    position_counts: np.ndarray = field(
        default_factory=lambda: np.zeros((2, MAX_TREE_NODES), dtype=np.int64))
    #: (start, end) timing events of the last step's bookkeeping, not read yet (CUDA)
    pending: tuple[Any, Any] | None = None

    def settle(self, wait: bool) -> None:
        """Add the last step's pending bookkeeping time if its end event is done (``wait``:
        wait for it; only outside a step, e.g. once the run ended)."""
        if self.pending is None:
            return
        start, end = self.pending
        if not wait and not end.query():
            return
        if wait:
            end.synchronize()
        self.bookkeeping += start.elapsed_time(end) / 1e3
        self.pending = None

    @property
    def proposed_per_position(self) -> list[int]:
        """Rows that proposed a draft at position j, up to the deepest position proposed."""
        return self.position_counts[0, : self._depth()].tolist()

    @property
    def accepted_per_position(self) -> list[int]:
        """Rows whose draft at position j was accepted."""
        return self.position_counts[1, : self._depth()].tolist()

    def _depth(self) -> int:
        proposed = np.flatnonzero(self.position_counts[0])
        return int(proposed[-1]) + 1 if len(proposed) else 0


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
    #: a MoE target's live expert-load counters (the engine's; reset when this span began),
    #: then at the span's end a device copy of them (the next span resets the live ones)
    expert_load: ExpertLoad | None = None
    expert_counts: Any = None

    def freeze_expert_load(self) -> None:
        """Keep this span's expert counts (a device-side copy: no sync)."""
        if self.expert_load is not None and self.expert_counts is None:
            self.expert_counts = self.expert_load.counts.clone()

    def _expert_fields(self) -> dict[str, int]:
        """``EngineStats``' MoE fields: one host read of the device counters (when stats are
        asked for, never inside a step)."""
        if self.expert_load is None:
            return {}
        counts = (self.expert_counts if self.expert_counts is not None
                  else self.expert_load.counts).tolist()
        out = {}
        for kind, (passes, experts, tokens) in zip(KINDS, counts):
            out[f"moe_{kind}_layer_passes"] = passes
            out[f"moe_{kind}_experts"] = experts
            out[f"moe_{kind}_tokens"] = tokens
        return out

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
            **self._expert_fields(),
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
