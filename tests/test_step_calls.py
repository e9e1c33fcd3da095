"""No Python loop over sequences in a decode step (issue 11): the Python function calls a
steady step makes (scheduling, staging, drafting, verify, postprocessing; the engine's own and
torch's Python alike) are the same at batch 4 and batch 16, for EAGLE-3 chains and trees and
the small-LM drafter (the bundled target drafting for itself), so nothing in the step visits
sequences one by one. (The streaming ``step()`` API does build one output per
request that advanced, as vLLM's does; ``generate`` runs steps that report only finished ones.)
"""

from __future__ import annotations

import gc
import sys
from collections import Counter

import pytest

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET


def step_calls(draft: str, batch: int, tree: list | None, steps: int = 4) -> list[Counter]:
    """Python calls, by (file, function), of each of ``steps`` steady decode steps."""
    engine = SpecEngine(DEFAULT_TARGET, draft=draft, cuda_graphs=True,
                        graph_buckets=(4, 16), max_batch_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(batch):  # prompts of different lengths: rows grow blocks at different steps
        engine.add_request([5 + i % 7, 6, 7, 8 + i % 5, 9][: 3 + i % 3] * (1 + i % 2), params,
                           k=3, tree=tree)
    for _ in range(3):  # the prefill, then a capture of each static pass
        engine.core.step(report_unfinished=False)
    counts = []
    for _ in range(steps):
        calls: Counter = Counter()

        def profile(frame, event, arg, calls=calls):  # type: ignore[no-untyped-def]
            if event == "call":
                calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

        # The cyclic collector runs finalisers of whatever earlier tests in this worker left
        # behind (event loops, temporary files) at an arbitrary allocation: collect first and
        # keep it off while profiling, so only the step's own calls are counted.
        gc.collect()
        gc.disable()
        sys.setprofile(profile)
        try:
            finished = engine.core.step(report_unfinished=False)
        finally:
            sys.setprofile(None)
            gc.enable()
        assert not finished  # steady: nobody ended
        counts.append(calls)
    static = {"draft-tree"} if tree else {"draft"} if draft == DEFAULT_DRAFT else {"lm-draft"}
    assert static <= set(engine.graphs.num_runs)  # the drafter's static pass ran
    return counts


@pytest.mark.parametrize("draft,tree", [
    (DEFAULT_DRAFT, None),
    (DEFAULT_DRAFT, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
    (str(DEFAULT_TARGET), None),  # a small LM
], ids=["eagle3-chain", "eagle3-tree", "small-lm-chain"])
def test_step_calls_do_not_grow_with_the_batch(draft: str, tree: list | None) -> None:
    small, large = step_calls(draft, 4, tree), step_calls(draft, 16, tree)
    for a, b in zip(small, large):
        grew = {k: (a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]}
        assert not grew, f"calls that depend on the batch size: {grew}"
    drafter = [name for (path, name) in small[0] if "/drafters/" in path]
    assert "propose" in drafter or "propose_tree" in drafter  # the profiler saw the drafter
