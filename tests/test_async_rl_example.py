"""examples/async_rl.py: the synchronous and the asynchronous GRPO loop for two steps each, in
one process (AsyncSpecEngine's engine thread, the learner in an executor thread, weights through
the colocated transport while the next batch generates)."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def async_rl() -> Iterator[ModuleType]:
    # The example imports its siblings (grpo, rl_config, rl_loop) by name.
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        yield importlib.import_module("async_rl")


def test_two_steps_of_both_loops(async_rl: ModuleType, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert async_rl.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    run = json.loads(out.read_text())
    loops = run["loops"]
    assert set(loops) == {"sync", "async"} and run["kv_on_update"] == "recompute"
    for mode, loop in loops.items():
        steps = loop["steps"]
        assert [s["step"] for s in steps] == [0, 1]
        assert loop["exposed_gen_s"] == pytest.approx(sum(s["wait_s"] for s in steps))
        assert math.isfinite(loop["exposed_gen_s"]) and loop["exposed_gen_s"] > 0
        assert f"{mode:5s}: exposed generation" in printed
        for s in steps:
            assert 0.0 <= s["reward"] <= 1.0 and math.isfinite(s["loss"])
            assert s["num_tokens"] > 0
            # Lag at most one version, never ahead of the learner.
            assert s["learner_version"] == s["step"]
            assert s["learner_version"] - 1 <= s["min_version"] <= s["max_version"]
            assert s["max_version"] <= s["learner_version"]
            # recompute: every token of the learner's version is exactly its policy's
            assert s["max_logprob_diff"] <= 1e-4
    sync, asyn = loops["sync"]["steps"], loops["async"]["steps"]
    assert all(s["min_version"] == s["max_version"] == s["step"] for s in sync)
    assert all(s["frac_current"] == 1.0 for s in sync)
    # Step 0: the same prompts, seeds and weights in both loops, so the same batch.
    assert (asyn[0]["reward"], asyn[0]["num_tokens"]) == (sync[0]["reward"], sync[0]["num_tokens"])
    assert asyn[0]["min_version"] == asyn[0]["max_version"] == 0
    # Async: batch 1 was submitted before training on batch 0, so the learner waited for
    # only part of its generation.
    assert asyn[1]["wait_s"] <= asyn[1]["gen_s"]


def test_unknown_mode_is_refused(async_rl: ModuleType) -> None:
    cfg = async_rl.LoopConfig(steps=1)
    with pytest.raises(ValueError, match="mode must be one of"):
        asyncio.run(async_rl.run_loop(cfg, "lockstep"))
