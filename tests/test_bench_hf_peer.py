"""``bench_generate.py --peer hf``'s logic (not its timing): a real run of the interleaved
table against transformers' batched ``generate`` on the bundled pair (tiny settings), its rows
and their ratios, the greedy comparison (identical here, as the engine is lossless), and a
difference in any configuration's outputs reported with where it is: in the row and as a
FAIL row of ``gpu_check.py``'s parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check_rows as gr  # noqa: E402
import hf_peer  # noqa: E402


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory) -> gr.StepRun:
    out = tmp_path_factory.mktemp("hf_peer")
    argv = [sys.executable, str(BENCH / "bench_generate.py"), "--peer-only", "--peer-batch",
            "3", "--peer-rounds", "2", "--max-tokens", "12", "--device", "cpu", "--out",
            str(out / "generate.json")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return gr.StepRun("hf_generate", proc.returncode, False, proc.stdout + proc.stderr, out)


def test_peer_table_rows_and_greedy_identity(peer_run):
    assert peer_run.returncode == 0, peer_run.output
    rows = json.loads((peer_run.out_dir / "generate.json").read_text())["rows"]
    assert [r["config"] for r in rows] == [hf_peer.HF_ROW, *(c[0] for c in hf_peer.CONFIGS)]
    hf = rows[0]
    for r in rows:
        assert r["mode"] == "peer-hf" and r["batch"] == 3 and r["rounds"] == 2
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["median_s"])
        assert r["vs_transformers"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
        # lossless greedy: every configuration returns transformers' token ids
        assert r["identical"] and r["outputs"] == "identical" and r["mismatches"] == []
        assert r["tokens"] == hf["tokens"]
    by = {r["config"]: r for r in rows}
    assert by["specengine k=0"]["tokens_per_step"] == pytest.approx(1.0, abs=0.2)
    assert by["specengine EAGLE-3 k=3"]["tokens_per_step"] > 1.5  # the head is accepted
    checks = gr.parse_hf_peer(peer_run)
    assert [c.verdict for c in checks] == ["PASS"] * 4
    assert all(c.result.endswith("x transformers") for c in checks)


def test_a_different_output_is_reported(peer_run, tmp_path):
    rows = json.loads((peer_run.out_dir / "generate.json").read_text())["rows"]
    rows[3].update(identical=False, outputs="1 of 3 differ (first: prompt 2 at token 5)")
    (tmp_path / "generate.json").write_text(json.dumps(dict(rows=rows)))
    bent = gr.StepRun("hf_generate", 0, False, "", tmp_path)
    verdicts = [(c.check, c.verdict) for c in gr.parse_hf_peer(bent)]
    assert verdicts[3] == ("vs transformers: specengine EAGLE-3 k=3 B=3", "FAIL")
    assert [v for _, v in verdicts[:3]] == ["PASS"] * 3
    assert "prompt 2 at token 5" in gr.parse_hf_peer(bent)[3].figure


def test_compare_finds_each_difference():
    ref = [(5, 6, 7, 1), (8, 9, 1), (4, 4)]
    got = [(5, 6, 7, 1), (8, 3, 1), (4, 4, 4)]  # a changed token; a longer completion
    mism = hf_peer.compare(ref, got)
    assert [(m.prompt, m.position) for m in mism] == [(1, 1), (2, 2)]
    assert hf_peer.describe(mism, 3).startswith("2 of 3 differ (first: prompt 1 at token 1")
    assert hf_peer.compare(ref, ref) == [] and hf_peer.describe([], 3) == "identical"
    assert hf_peer.completion([3, 1, 0, 0], eos_id=1) == (3, 1)
    with pytest.raises(ValueError, match="2 completions to compare with 3"):
        hf_peer.compare(ref, got[:2])
    # peer_rows marks the row whose outputs differ, and only that one
    times = {hf_peer.HF_ROW: [1.0, 2.0, 3.0], "ours": [1.0, 1.0, 1.0]}
    rows = hf_peer.peer_rows(times, {hf_peer.HF_ROW: ref, "ours": got},
                             {hf_peer.HF_ROW: 0, "ours": 4})
    assert [r["identical"] for r in rows] == [True, False]
    assert rows[1]["mismatches"] == [[1, 1], [2, 2]]
    assert rows[1]["vs_transformers"] == pytest.approx((10 / 1.0) / (9 / 2.0))
