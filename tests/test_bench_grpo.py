"""benchmarks/bench_grpo.py on the bundled pair at a tiny size: every configuration runs its
steps, the engine's logprobs equal the learner's before each update, the weights are pushed
every step, drafting configurations draft, and the table / JSONL / plots are written; bad
configuration names are refused."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_grpo")
    finally:
        sys.path.remove(str(BENCH))


def test_config_names(bench) -> None:
    p = bench.parse_config
    assert p("k0") == bench.RunSpec("k0", None, 0)
    assert p("auto") == bench.RunSpec("auto", "eagle3", "auto")
    assert p("suffix-k3") == bench.RunSpec("suffix-k3", "suffix", 3)
    assert p("eagle3-k3-adapt") == bench.RunSpec("eagle3-k3-adapt", "eagle3", 3, True)
    assert p("hybrid-auto").k == "auto"
    assert p("eagle3-tree16") == bench.RunSpec("eagle3-tree16", "eagle3", 0, tree=16)
    for bad in ("k3", "eagle3-3", "foo-k3", "suffix-k3-adapt", "eagle3-k0", "suffix-tree16",
                "eagle3-tree0", "hybrid-tree4"):
        with pytest.raises(ValueError):
            p(bad)


def test_tiny_run_on_the_bundled_pair(bench, tmp_path: Path) -> None:
    out = tmp_path / "grpo"
    assert bench.main(["--task", "arith", "--steps", "2", "--prompts", "2", "--group", "2",
                       "--max-tokens", "12", "--configs", "k0,eagle3-k3,auto",
                       "--out", str(out)]) == 0
    recs = [json.loads(line) for line in (out / "grpo_steps.jsonl").read_text().splitlines()]
    assert [(r["config"], r["step"]) for r in recs] == [
        (c, s) for c in ("k0", "eagle3-k3", "auto") for s in (0, 1)]
    for r in recs:
        assert r["logprob_gap_max"] <= 1e-4  # the engine samples the learner's policy
        assert r["version"] == r["step"] + 1  # pushed after every step
        assert r["tokens"] > 0 and r["rollout_s"] > 0
        assert all(a is None or 0 <= a <= 1 for a in r["acceptance_per_position"])
    k0 = [r for r in recs if r["config"] == "k0"]
    assert all(r["tokens_per_step"] == 1 and not r["proposed_per_position"] for r in k0)
    eagle = [r for r in recs if r["config"] == "eagle3-k3"]
    assert all(len(r["proposed_per_position"]) == 3 and r["tokens_per_step"] > 1
               for r in eagle)  # the bundled head is good: drafts are proposed and kept
    assert sum(sum(r["auto_k_steps"]) for r in recs if r["config"] == "auto") > 0
    summary = json.loads((out / "grpo_summary.json").read_text())
    assert [r["config"] for r in summary["rows"]] == ["k0", "eagle3-k3", "auto"]
    assert summary["rows"][0]["vs_k0"] == summary["rows"][0]["vs_k0_cpu"] == 1
    assert "| eagle3-k3 |" in (out / "grpo_table.md").read_text()
    (out / "grpo_table.md").unlink()  # --summarize-only writes it again from the JSONL
    assert bench.main(["--task", "arith", "--configs", "k0,eagle3-k3,auto", "--out", str(out),
                       "--summarize-only"]) == 0
    assert "| auto |" in (out / "grpo_table.md").read_text()


def test_the_heads_own_trees_as_a_configuration(bench, tmp_path: Path) -> None:
    """``eagle3-treeN``: each rollout verifies the head's sampled tree of N drafts (depth 3
    here), its row labelled ``treeN``."""
    import shutil

    from specengine.assets import DEFAULT_DRAFT

    head = tmp_path / "head"
    shutil.copytree(DEFAULT_DRAFT, head)
    tree = [[0], [0, 0], [0, 0, 0], [1]]
    (head / "trees.json").write_text(json.dumps({"trees": {"greedy": {"4": tree},
                                                           "sampled": {"4": tree}}}))
    out = tmp_path / "grpo"
    assert bench.main(["--task", "arith", "--steps", "1", "--prompts", "2", "--group", "2",
                       "--max-tokens", "12", "--configs", "eagle3-tree4", "--draft", str(head),
                       "--no-learner", "--out", str(out)]) == 0
    (rec,) = [json.loads(line) for line in (out / "grpo_steps.jsonl").read_text().splitlines()]
    # drafts at depths 1-3 though the configuration gives k=0: the tree's, verified at its depth
    assert len(rec["proposed_per_position"]) == 3 and rec["tokens_per_step"] > 1
    row = json.loads((out / "grpo_summary.json").read_text())["rows"][0]
    assert row["k"] == "tree4"


def test_interleaved_rollouts_without_a_learner(bench, tmp_path: Path) -> None:
    """``--interleave --no-learner``: every configuration's engine at once, one step of each
    in turn on the same prompts and seeds; no learner, so no update, push or gap."""
    out = tmp_path / "grpo"
    assert bench.main(["--task", "arith", "--steps", "2", "--prompts", "2", "--group", "2",
                       "--max-tokens", "12", "--configs", "k0,eagle3-k3", "--interleave",
                       "--no-learner", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in (out / "grpo_steps.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["config"]) for r in recs) == [
        (s, c) for s in (0, 1) for c in ("eagle3-k3", "k0")]
    assert [r["step"] for r in recs] == [0, 0, 1, 1]  # step by step, not run by run
    for r in recs:
        assert r["version"] is None and r["logprob_gap_max"] is None and r["loss"] is None
    assert all(r["tokens_per_step"] > 1 for r in recs if r["config"] == "eagle3-k3")
    rows = json.loads((out / "grpo_summary.json").read_text())["rows"]
    assert all(r["logprob_gap_max"] is None and r["cpu_ms_per_token"] > 0 for r in rows)
