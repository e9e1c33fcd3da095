"""Weight updates while requests run (docs/design.md §4): what an update applied between two
steps does to the unfinished requests.

Weights change only between steps (the step API's caller, or ``AsyncSpecEngine``'s engine
thread through ``run_in_engine``), so all tokens of one step come from one version, which the
core stamps on them (``GenerationOutput.token_weight_versions``). After a policy update:

- ``kv_on_update="keep"`` (the default, as in PipelineRL): running sequences keep the KV
  computed under the old weights. Nothing is recomputed; the tokens after the update come
  from the new weights attending to the old weights' KV of the prefix, and the per-token
  versions tell the learner exactly which token came from which weights.
- ``"recompute"``: every running sequence is preempted through the scheduler's own path
  (KV blocks and drafter state freed, back to the front of the waiting queue with all its
  tokens), so its next step re-prefills prompt + generated tokens under the new weights:
  every later token is what a fresh engine with the new weights generates from that prefix.

A draft-only update needs neither: a stale or rebuilt draft changes acceptance, never the
output distribution (rejection sampling keeps the policy's). With ``max_policy_lag=N``, after
any update a request whose oldest output token is more than N versions behind the engine
finishes at once (``finish_reason="policy_lag"``, reported by the next step).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specengine.sequence import SeqStatus

if TYPE_CHECKING:
    from specengine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


def after_update(core: EngineCore, which: str, version: int) -> None:
    """Apply the engine's in-flight policy once an update of ``which`` committed ``version``."""
    if not core.has_unfinished():
        return
    if which == "policy" and core.config.kv_on_update == "recompute":
        recompute_running(core)
    if core.config.max_policy_lag is not None:
        finish_lagging(core, version, core.config.max_policy_lag)


def recompute_running(core: EngineCore) -> int:
    """Preempt every running sequence (the scheduler's own preemption: blocks freed, drafter
    state released, waiting with all its tokens) so its next step re-prefills it. Walking the
    running list backwards keeps the sequences' order at the front of the waiting queue.
    Returns how many were preempted."""
    scheduler = core.scheduler
    running = [s for s in reversed(scheduler.running) if s.status is SeqStatus.RUNNING]
    for seq in running:
        scheduler._preempt(seq)
    if running:
        logger.info("weight update: %d running sequences will be re-prefilled", len(running))
    return len(running)


def finish_lagging(core: EngineCore, version: int, max_lag: int) -> list[str]:
    """End every unfinished request whose oldest output token is more than ``max_lag``
    versions behind ``version``; returns their ids."""
    lagging = [rid for rid, req in core._requests.items()
               if req.seq.status is not SeqStatus.FINISHED and req.seq.token_weight_versions
               and version - req.seq.token_weight_versions[0] > max_lag]
    for rid in lagging:
        core.finish_between_steps(rid, "policy_lag")
    if lagging:
        logger.info("weight update v%d: %d requests exceed max_policy_lag=%d", version,
                    len(lagging), max_lag)
    return lagging


__all__ = ["after_update", "finish_lagging", "recompute_running"]
