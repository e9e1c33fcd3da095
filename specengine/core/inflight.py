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
output distribution (rejection sampling keeps the policy's).

Policy lag: after any update, a request whose oldest output token is more than N versions
behind the engine (N = its ``SamplingParams.max_policy_lag``, else the engine's
``max_policy_lag``) is, by the engine's ``policy_lag_action``:

- ``"finish"``: ended at once (``finish_reason="policy_lag"``, reported by the next step);
- ``"restart"``: its tokens, KV blocks and drafter state are dropped and it waits at the
  front of the queue to start again from its prompt, same request id and seed (the same
  random streams: its new completion is what a fresh engine with the new weights makes for
  that prompt and seed). Its next output has ``restarted=True``: the tokens reported for it
  before are void, and the ``new_token_ids`` from that output on make up its final
  ``token_ids``, all of the new version or later.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specengine.core.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from specengine.core.engine_core import EngineCore, RequestState

logger = logging.getLogger(__name__)


def after_update(core: EngineCore, which: str, version: int) -> None:
    """Apply the engine's in-flight policy once an update of ``which`` committed ``version``."""
    core.kv_cache.invalidate_prefix_cache()  # no later prefill may reuse older weights' KV
    if core.drafter is not None:  # nor the drafter's own cached KV (drafters.draft_prefix)
        core.drafter.clear_prefix_cache()
    if not core.has_unfinished():
        return
    if which == "policy" and core.config.kv_on_update == "recompute":
        recompute_running(core)
    lagging = lagging_requests(core, version)
    if not lagging:
        return
    if core.config.policy_lag_action == "restart":
        restart_requests(core, lagging)
    else:
        for rid in lagging:
            core.finish_between_steps(rid, "policy_lag")
    logger.info("weight update v%d: %d requests exceed their max_policy_lag (%s)", version,
                len(lagging), core.config.policy_lag_action)


def recompute_running(core: EngineCore) -> int:
    """Preempt every running sequence (the scheduler's own preemption: blocks freed, drafter
    state released, waiting with all its tokens) so its next step re-prefills it. Walking the
    running list backwards keeps the sequences' order at the front of the waiting queue.
    Returns how many were preempted."""
    scheduler = core.scheduler
    running = [s for s in reversed(scheduler.running) if s.status is SeqStatus.RUNNING]
    for seq in running:
        scheduler.preempt(seq)
    if running:
        logger.info("weight update: %d running sequences will be re-prefilled", len(running))
    return len(running)


def max_lag_of(core: EngineCore, req: RequestState) -> int | None:
    """The request's own ``max_policy_lag``, else the engine's (None: no limit)."""
    own = req.seq.params.max_policy_lag
    return own if own is not None else core.config.max_policy_lag


def lagging_requests(core: EngineCore, version: int) -> list[str]:
    """Ids of the unfinished requests whose oldest output token is more than their
    ``max_policy_lag`` versions behind ``version``, in the order they were added."""
    lagging = []
    for rid, req in core.requests.items():
        versions = req.seq.token_weight_versions
        if req.seq.status is SeqStatus.FINISHED or not versions:
            continue
        limit = max_lag_of(core, req)
        if limit is not None and version - versions[0] > limit:
            lagging.append(rid)
    return lagging


def restart_requests(core: EngineCore, request_ids: list[str]) -> None:
    """Start each request again from its prompt (see the module docstring). The KV blocks
    and drafter state are freed at once; the requests go to the front of the waiting queue
    in the given order (they are the oldest work in the engine)."""
    reqs = [core.requests[rid] for rid in request_ids]
    for req in reqs:
        core.release(req.seq)  # frees blocks and drafter state, leaves running / waiting
        reset_sequence(req.seq, core.eos_token_ids)
        req.num_reported = 0
        req.restarted = True
    for req in reversed(reqs):
        core.scheduler.waiting.appendleft(req.seq)


def reset_sequence(seq: Sequence, eos_token_ids: tuple[int, ...]) -> None:
    """Put ``seq`` back in the state it was added in: the prompt, no tokens, blocks, counters
    or versions, waiting. Done in place (the same object, ``seq_id`` and seed), so every
    holder of the sequence (the persistent batch rows, the request table) stays valid; the
    state is rebuilt by ``Sequence.__init__`` itself so no field can be forgotten."""
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    fresh = Sequence(seq.seq_id, prompt, seq.params, seq.seed, eos_token_ids)
    if seq.stop_strings is not None:
        fresh.stop_strings = seq.stop_strings.fresh()
    vars(seq).clear()
    vars(seq).update(vars(fresh))


__all__ = ["after_update", "lagging_requests", "recompute_running",
           "reset_sequence", "restart_requests"]
