"""The README's "Scaling out" example runs as written: a 2-worker Ray pool, groups kept whole,
outputs in prompt order and equal to a single engine's greedy outputs."""

from __future__ import annotations

import pytest
from readme_blocks import run_readme_blocks

ray = pytest.importorskip("ray")


def test_scaling_out_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    from specengine import SpecEngine
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    ns = run_readme_blocks("### Scaling out: a rollout pool on Ray")
    outs = ns["outs"]
    prompts = ["Q:472*6="] * 4 + ["Q:385+472="] * 4
    expected = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT).generate(prompts, k=3)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]  # prompt order
    printed = capsys.readouterr().out
    # Each group of four went to one worker (the printed assignment is by prompt index).
    assert "(0, 1, 2, 3)" in printed and "(4, 5, 6, 7)" in printed
