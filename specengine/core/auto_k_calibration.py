"""The start-up calibration sweep of ``k="auto"`` (``core.auto_k``): a few decode steps at
each (batch size, k) of a small grid, on synthetic requests, timed by the engine's own
``StepTimes``, to fit the step cost model before the first auto step.

It runs once per engine, when a ``k="auto"`` request arrives and the engine is idle (a busy
engine defers it: auto requests run at k = 0 until then). The requests are greedy, ignore EOS,
use fixed seeds (the engine's seed stream is not touched) and are aborted after their steps;
``engine.stats`` afterwards is what it was before. Acceptance of these random prompts says
nothing about real ones: only their times are used. The first decode step of each (batch, k)
is not timed (it may compile kernels or capture a graph). The grid is run
``calibration_passes`` times, each in a shuffled order, so a burst of another job's work on a
shared machine lands on a few points of one pass, which the median fit then outvotes.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from specengine.core.auto_k import AutoK, snapshot, step_counts
from specengine.core.cost_model import StepMeasure
from specengine.sampling import SamplingParams

if TYPE_CHECKING:
    from specengine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 16


def calibrate(auto: AutoK, core: EngineCore, vocab_size: int, k_max: int) -> int:
    """Run the sweep on the idle ``core`` and fit ``auto``'s cost model; returns the number of
    timed steps. Batch sizes are capped by ``max_batch_size`` and the KV cache."""
    if core.has_unfinished():
        raise RuntimeError("the k='auto' calibration needs an idle engine")
    cfg = auto.config
    ks = sorted({k for k in cfg.calibration_ks if k <= k_max} | {0, k_max})
    if core.drafter is None or len(ks) < 2:
        return 0
    steps = cfg.calibration_steps + 1
    max_tokens = steps * (k_max + 1) + k_max + 2  # no draft cut during the timed steps
    prompt_len = min(PROMPT_TOKENS, core.config.max_model_len - max_tokens - k_max - 2)
    if prompt_len < 1:
        logger.warning("max_model_len %d is too short for the k='auto' calibration",
                       core.config.max_model_len)
        return 0
    per_seq = prompt_len + max_tokens + k_max + 1
    kv_seqs = core.kv_cache.num_blocks // -(-per_seq // core.kv_cache.block_size)
    batches = sorted({min(b, core.config.max_batch_size, kv_seqs)
                      for b in cfg.calibration_batches} - {0})
    if len(batches) < 2:
        batches = sorted({1, max(batches + [1])})
    rng = random.Random(0)
    eos = set(core.eos_token_ids)
    tokens = [t for t in range(vocab_size) if t not in eos] or list(range(vocab_size))
    saved = core.last_run  # the sweep's busy span must not replace the user's stats
    t0 = time.perf_counter()
    samples: list[StepMeasure] = []
    grid = [(b, k) for k in ks for b in batches]
    for _ in range(cfg.calibration_passes):
        rng.shuffle(grid)
        for b, k in grid:
            samples += _sweep_point(core, b, k, steps, max_tokens,
                                    [[rng.choice(tokens) for _ in range(prompt_len)]
                                     for _ in range(b)])
    core.last_run = saved
    auto.costs.calibrate(samples)
    logger.info("k='auto' calibration: %d steps at batches %s x k %s in %.2f s", len(samples),
                batches, ks, time.perf_counter() - t0)
    return len(samples)


def _sweep_point(core: EngineCore, batch: int, k: int, steps: int, max_tokens: int,
                 prompts: list[list[int]]) -> list[StepMeasure]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    ids = [core.add(tuple(p), params, k, None, request_id=f"auto-k-calibration-{i}")
           for i, p in enumerate(prompts)]
    out: list[StepMeasure] = []
    try:
        timed = -1  # the first decode step is not timed
        while timed < steps - 1 and core.has_unfinished():
            times = core.stats.times
            before, n = snapshot(times), times.num_steps
            core.step()
            if core.stats.times is not times or times.num_steps == n:
                continue  # a prefill step (the first one starts a new busy span)
            timed += 1
            if timed == 0:
                continue
            proposed, _ = step_counts(before, times)
            width = sum(1 for x in proposed if x > 0)
            out.append(StepMeasure(batch, width, k > 0, times.draft - before.draft,
                                   times.verify + times.bookkeeping - before.verify))
    finally:
        for i in ids:
            if i in core.requests:
                core.abort(i)
    return out


__all__ = ["calibrate"]
