"""Measurements on this machine for the rollout simulator (``simulate.py``): per-step times of
the engine at known batch size and k (the calibration), and whole rollouts (the validation).

Both drive the engine through its step API (``add_request`` / ``step``), timing every
``step()`` call. A step's batch size is the number of requests it advanced; a step whose
requests all got their first token is a prefill; its draft length is the longest chain a row
proposed (from ``engine.stats.proposed_per_position`` before and after, read outside the
timed call): near ``max_tokens`` the engine cuts drafts, and the eager CPU path drafts and
verifies only as wide as the longest chain. Times are this thread's CPU time
(``time.thread_time``) next to the wall time: with one torch thread every op runs on this
thread, so on an idle machine the two agree, while on a shared one (this project's CPU box)
the wall time also counts other jobs' time slices. The model is fitted on thread time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sim_model import StepSample


@dataclass
class Rollout:
    """One measured rollout (a batch of requests all added at once, run to the end)."""

    k: int
    num_seqs: int
    wall_s: float
    cpu_s: float
    lengths: list[int]  # completion tokens per request
    prompt_lens: list[int]
    accepted_per_position: tuple[int, ...]
    proposed_per_position: tuple[int, ...]
    steps: list[StepSample] = field(default_factory=list)
    #: per request, drafts accepted / proposed at each position (from its steps' new tokens)
    seq_accepted: list[list[int]] = field(default_factory=list)
    seq_proposed: list[list[int]] = field(default_factory=list)


def run_steps(engine, prompts: list, params: list, k: int) -> Rollout:  # engine: SpecEngine
    """Add every request, step to the end, time each step (see the module docstring). Per
    request, a decode step proposed ``min(k, max_tokens - generated - 1)`` drafts and kept
    ``len(new_token_ids) - 1`` of them; a step that ended the request at a stop token says
    nothing about the drafts after it (only its accepted ones are counted)."""
    ids = [engine.add_request(p, sp, k=k) for p, sp in zip(prompts, params)]
    index = {i: n for n, i in enumerate(ids)}
    seq_acc = [[0] * k for _ in ids]
    seq_prop = [[0] * k for _ in ids]
    started: set[str] = set()
    ctx = {i: len(p) for i, p in zip(ids, prompts)}  # token-id prompts
    out = Rollout(k, len(ids), 0.0, 0.0, [], [], (), ())
    done = {}
    proposed = engine.stats.proposed_per_position
    cpu_total = wall_total = 0.0
    while engine.has_unfinished():
        ws, cs = time.perf_counter(), time.thread_time()
        outs = engine.step()
        cpu, wall = time.thread_time() - cs, time.perf_counter() - ws
        cpu_total, wall_total = cpu_total + cpu, wall_total + wall
        if not outs:
            continue
        before, proposed = proposed, engine.stats.proposed_per_position
        width = sum(1 for j, n in enumerate(proposed)
                    if n > (before[j] if j < len(before) else 0))
        prefill = all(o.request_id not in started for o in outs)
        ctx_tokens = sum(ctx[o.request_id] for o in outs)
        finished = sum(o.finished for o in outs)
        out.steps.append(StepSample(len(outs), width, ctx_tokens, cpu, wall, prefill,
                                    finished))
        for o in outs:
            if not prefill:
                n = index[o.request_id]
                gen = ctx[o.request_id] - len(prompts[n])
                drafts = max(0, min(k, params[n].max_tokens - gen - 1))
                kept = len(o.new_token_ids) - 1
                stopped = o.finished and o.output is not None and \
                    o.output.finish_reason == "stop"
                for j in range(kept if stopped else drafts):
                    seq_prop[n][j] += 1
                    seq_acc[n][j] += j < kept
            started.add(o.request_id)
            ctx[o.request_id] += len(o.new_token_ids)
            if o.output is not None:
                done[o.request_id] = o.output
    out.wall_s, out.cpu_s = wall_total, cpu_total  # the steps only (stats reads excluded)
    outputs = [done[i] for i in ids]
    out.lengths = [len(o.token_ids) for o in outputs]
    out.prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    st = engine.stats
    out.seq_accepted, out.seq_proposed = seq_acc, seq_prop
    out.accepted_per_position = tuple(st.accepted_per_position)
    out.proposed_per_position = tuple(st.proposed_per_position)
    return out


def calibrate(engine, prompts: list, params_for, batches: tuple[int, ...],
              ks: tuple[int, ...]) -> list[StepSample]:
    """Steps of every (batch, k) of the sweep: ``batches[i]`` requests of ``prompts`` (cycled)
    with ``params_for(n)`` sampling parameters."""
    samples: list[StepSample] = []
    for k in ks:
        for b in batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            samples += run_steps(engine, batch, params_for(b), k).steps
    return samples
