"""``benchmarks/bench_real_model.py`` in its dry configuration on the CPU: the bundled pair
(its EAGLE-3 head and the n-gram drafter), batches 1 and 2, 4 tokens; every row written as
measured, with the fields the GPU run reports; the budget stops rows; bad options name the
flag. (The real model's GPU figures: benchmarks/RESULTS.md.)"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_real_model as brm  # noqa: E402

from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Q:472*6="}\n\n{"prompt": "Q:385+472="}\n')
    return path


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_dry_run_writes_every_row(tmp_path: Path, prompt_file: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert brm.main(["--model", DEFAULT_TARGET, "--draft", DEFAULT_DRAFT, "--drafters", "ngram",
                     "--prompts", str(prompt_file), "--batch", "1,2", "--k", "0,3,auto",
                     "--max-tokens", "4", "--temperature", "0", "--device", "cpu",
                     "--out", str(out)]) == 0
    rows = read_rows(out)
    assert [(r["drafter"], r["batch"], r["k"]) for r in rows] == [
        ("none", 1, 0), ("none", 2, 0),
        ("eagle3", 1, 3), ("eagle3", 1, "auto"), ("eagle3", 2, 3), ("eagle3", 2, "auto"),
        ("ngram", 1, 3), ("ngram", 1, "auto"), ("ngram", 2, 3), ("ngram", 2, "auto")]
    for r in rows:
        assert r["device"] == "cpu" and r["tokens"] == 4 * r["batch"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["graphs_captured"] == 0 and r["cuda_graphs"] is False  # CPU: no capture
        if r["k"] == 0:
            assert r["mean_accepted_length"] == 1.0 and r["acceptance_per_position"] == []
        else:
            base = next(b for b in rows if b["k"] == 0 and b["batch"] == r["batch"])
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        if r["k"] == "auto":
            assert sum(r["auto_k_steps"]) == r["steps"] > 0
        else:
            assert r["auto_k_steps"] is None
    head = [r for r in rows if r["drafter"] == "eagle3" and r["k"] == 3]
    assert all(r["mean_accepted_length"] > 1.5 and r["acceptance_per_position"][0] > 0
               for r in head)  # the bundled head's drafts are accepted
    table = (out / "table.md").read_text()
    assert table.count("\n| ") == len(rows) and table in capsys.readouterr().out


def test_budget_stops_starting_rows(tmp_path: Path, prompt_file: Path) -> None:
    out = tmp_path / "out"
    brm.main(["--model", DEFAULT_TARGET, "--prompts", str(prompt_file), "--batch", "1,2",
              "--k", "0", "--max-tokens", "2", "--device", "cpu", "--budget-s", "0",
              "--out", str(out)])
    assert read_rows(out) == []
    assert "2 rows not run: --budget-s 0.0 reached" in (out / "table.md").read_text()


def test_the_heads_own_trees_are_rows_of_their_own(tmp_path: Path, prompt_file: Path) -> None:
    """``--trees N``: the head's tree of N drafts from its ``trees.json`` (the greedy one at
    temperature 0, the sampled one else), verified at its depth, one row per batch after
    the head's k rows; sizes the file lacks, or no head, are refused naming the flag."""
    import shutil

    head = tmp_path / "head"
    shutil.copytree(DEFAULT_DRAFT, head)
    trees = {"greedy": {"4": [[0], [1], [0, 0], [0, 0, 0]]},
             "sampled": {"4": [[0], [1], [2], [3]]}}
    (head / "trees.json").write_text(json.dumps({"trees": trees}))
    out = tmp_path / "out"
    argv = ["--model", DEFAULT_TARGET, "--draft", str(head), "--prompts", str(prompt_file),
            "--batch", "1,2", "--k", "0,3", "--trees", "4", "--max-tokens", "8",
            "--temperature", "0", "--device", "cpu", "--out", str(out)]
    assert brm.parse_args(argv).tree_paths == {"tree4": [(0,), (1,), (0, 0), (0, 0, 0)]}
    assert brm.parse_args(argv[:-6] + ["--temperature", "1", "--device", "cpu", "--out",
                                       str(out)]).tree_paths == {"tree4": [(0,), (1,), (2,), (3,)]}
    assert brm.main(argv) == 0
    rows = read_rows(out)
    assert [(r["drafter"], r["batch"], r["k"]) for r in rows] == [
        ("none", 1, 0), ("none", 2, 0), ("eagle3", 1, 3), ("eagle3", 1, "tree4"),
        ("eagle3", 2, 3), ("eagle3", 2, "tree4")]
    for r in rows[2:]:
        assert r["mean_accepted_length"] > 1.5 and len(r["acceptance_per_position"]) == 3
        assert r["tokens"] == 8 * r["batch"] and r["speedup"] > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--k", "0", "--trees", "4"], "--trees: the trees are a head's own, give --draft"),
    (["--k", "0", "--trees", "4", "--draft", DEFAULT_DRAFT], "trees.json: no such file"),
    (["--k", "0,3"], "k > 0 needs --draft HEAD_DIR or --drafters"),
    (["--drafters", "mtp"], "--drafters mtp: only ngram and suffix"),
    (["--k", "0,17"], "--k 17: must be in [0, 16]"),
    (["--batch", "0"], "every batch must be >= 1"),
])
def test_bad_options_name_the_flag(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        brm.parse_args(["--model", DEFAULT_TARGET, *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_chat_prompts_need_a_chat_template(tmp_path: Path) -> None:
    from specengine.tokenizer import load_tokenizer

    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "Q:1+1="}]}\n')
    tok = dataclasses.replace(load_tokenizer(DEFAULT_TARGET), chat_template=None)
    with pytest.raises(SystemExit, match="need a checkpoint with a chat template"):
        brm.load_prompts(chats, tok)
    text = tmp_path / "p.txt"
    text.write_text("Q:1+1=\n\nQ:2*3=\n")
    assert brm.read_prompts(text, tok) == ["Q:1+1=", "Q:2*3="]
    assert brm.load_prompts(text, tok) == [tok.encode("Q:1+1="), tok.encode("Q:2*3=")]
    with pytest.raises(SystemExit, match="give --prompts FILE.txt"):
        brm.load_prompts(None, tok)


@pytest.mark.real_model
def test_dry_run_on_the_real_model(tmp_path: Path) -> None:
    from specengine.assets.smollm2 import built_checkpoint

    ckpt = built_checkpoint()
    if ckpt is None:
        pytest.skip("the SmolLM2-135M-Instruct checkpoint is not built: specengine "
                    "build-model smollm2")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "Name a color."}]}\n')
    out = tmp_path / "out"
    # No --model: the built checkpoint is found (and checked) by the builder.
    brm.main(["--prompts", str(chats), "--drafters", "ngram", "--batch", "1", "--k", "0,2",
              "--max-tokens", "4", "--device", "cpu", "--out", str(out)])
    rows = read_rows(out)
    assert [(r["drafter"], r["k"]) for r in rows] == [("none", 0), ("ngram", 2)]
    assert all(1 <= r["tokens"] <= 4 for r in rows)  # sampled: may end before 4 tokens
    assert rows[0]["model"] == str(ckpt)
