"""``benchmarks/eval_draft_head.py --tree``: static draft trees evaluated as the chains are, on
the bundled pair (whose head accepts most drafts, so a walk that rejected them would show).
A tree that is a chain gives the chain's figures exactly, greedy and at T=1 (the same drafts,
argmaxes greedy and drawn from the head's distribution at T=1, judged with the same random
numbers; the budget leaves room for every answer's end,
so no chain is cut short by ``max_tokens``, which a tree's rows are not); every greedy tree
reproduces k=0; bad ``--tree`` specs are refused with what is wrong; ``--best-trees`` takes
the head's own trees (``trees.json``) per temperature."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

from specengine import arith_task
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.train.offline import TrainDraftConfig, evaluate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import eval_draft_head as edh  # noqa: E402

CHAIN = [(0,), (0, 0), (0, 0, 0)]
WIDE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]


def test_a_chain_shaped_tree_gives_the_chains_figures() -> None:
    cfg = TrainDraftConfig(model=Path(DEFAULT_TARGET), prompts=Path(DEFAULT_DRAFT) / "config.json",
                           out=Path(DEFAULT_DRAFT), eval_max_tokens=64, device="cpu",
                           num_threads=1, eval_temperatures=(0.0, 1.0))
    prompts = [arith_task.encode(p) for p in arith_task.heldout_prompts(4)]
    chains = evaluate(cfg, prompts)["by_temperature"]  # the head's defaults: sampled drafts
    trees = edh.evaluate_trees(cfg, prompts, [CHAIN, WIDE])
    assert set(trees) == {"0", "1"}
    for temp, rows in trees.items():
        chain, wide = rows
        assert chain["paths"] == [list(p) for p in CHAIN] and chain["k"] == wide["k"] == 3
        want = chains[temp]["3"]
        assert chain["mean_accepted_length"] == pytest.approx(want["mean_accepted_length"])
        assert chain["acceptance_per_position"] == pytest.approx(
            want["acceptance_per_position"])
        assert chain["generated_tokens"] == want["generated_tokens"]
        assert chain["mean_accepted_length"] > 2.0, "the bundled head accepts most drafts"
        assert wide["mean_accepted_length"] > 2.0
        assert len(wide["acceptance_per_position"]) == 3
    for row in trees["0"]:
        assert row["identical_to_k0"] == len(prompts)
    assert "identical_to_k0" not in trees["1"][0]
    table = edh.format_trees(trees)
    assert "| tree of 5, depth 3 | 0 |" in table and "| tree of 3, depth 3 | 1 |" in table


@pytest.mark.parametrize(("spec", "says"), [
    ("[[0], [1]", "is not JSON"),
    ('{"0": 1}', "expected a list of paths"),
    ("[[0], [0.5]]", "expected a list of paths"),
    ("[[0], [1, 0, 0]]", "not prefix-closed"),
    ("[]", "at least one path"),
])
def test_bad_tree_specs_are_refused_with_the_reason(spec: str, says: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        edh.parse_tree(spec)
    with pytest.raises(SystemExit) as e:
        edh.main(["--head", str(DEFAULT_DRAFT), "--tree", spec])
    assert e.value.code == 2
    assert says in capsys.readouterr().err
    assert edh.parse_tree("[[0], [1], [0, 0]]") == [(0,), (1,), (0, 0)]


def test_best_trees_are_the_heads_own_per_temperature(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """``--best-trees N``: the greedy tree of ``trees.json`` for greedy requests, the sampled
    one for sampled requests; sizes the file lacks are refused before anything runs."""
    head = tmp_path / "head"
    shutil.copytree(DEFAULT_DRAFT, head)
    (head / "trees.json").write_text(json.dumps({"trees": {
        "greedy": {"4": [list(p) for p in CHAIN] + [[1]]}, "sampled": {"4": WIDE[:4]}}}))
    cfg = TrainDraftConfig(model=Path(DEFAULT_TARGET), prompts=head / "config.json", out=head,
                           eval_max_tokens=16, device="cpu", num_threads=1,
                           eval_temperatures=(0.0, 1.0))
    prompts = [arith_task.encode(p) for p in arith_task.heldout_prompts(2)]
    got = edh.evaluate_trees(cfg, prompts, [CHAIN], (4,))
    assert [r["paths"] for r in got["0"]] == [[list(p) for p in CHAIN],  # (breadth first)
                                              [[0], [1], [0, 0], [0, 0, 0]]]
    assert [r["paths"] for r in got["1"]] == [[list(p) for p in CHAIN],
                                              [list(p) for p in WIDE[:4]]]
    assert [r["best"] for r in got["0"] + got["1"]] == [None, "greedy", None, "sampled"]
    assert got["0"][1]["identical_to_k0"] == 2
    assert "| the head's best tree of 4, depth 3 | 0 |" in edh.format_trees(got)
    for sizes, says in (("4,5", "no greedy tree of 5 drafts"), ("x", "invalid literal")):
        with pytest.raises(SystemExit) as e:
            edh.main(["--model", str(DEFAULT_TARGET), "--head", str(head), "--best-trees",
                      sizes])
        assert e.value.code == 2 and says in capsys.readouterr().err
