"""No Python loop over sequences in a decode step (issue 11): the Python function calls a
steady step makes (scheduling, staging, drafting, verify, postprocessing; the engine's own and
torch's Python alike) are the same at batch 4 and batch 16, for chains and trees, so nothing in
the step visits sequences one by one. (The streaming ``step()`` API does build one output per
request that advanced, as vLLM's does; ``generate`` runs steps that report only finished ones.)
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET


def step_calls(batch: int, tree: list | None, steps: int = 4) -> list[Counter]:
    """Python calls, by (file, function), of each of ``steps`` steady decode steps."""
    engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, cuda_graphs=True,
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

        sys.setprofile(profile)
        try:
            finished = engine.core.step(report_unfinished=False)
        finally:
            sys.setprofile(None)
        assert not finished  # steady: nobody ended
        counts.append(calls)
    return counts


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]],
                         ids=["chain", "tree"])
def test_step_calls_do_not_grow_with_the_batch(tree: list | None) -> None:
    small, large = step_calls(4, tree), step_calls(16, tree)
    for a, b in zip(small, large):
        grew = {k: (a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]}
        assert not grew, f"calls that depend on the batch size: {grew}"
    assert sum(small[0].values()) > 100  # the profiler saw the step
