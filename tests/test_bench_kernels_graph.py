"""``bench_kernels_graph.py --dry`` (the CPU path of the graph-timed kernel sweep, issue 35): a
real run of a few cases of every group under the Triton interpreter, its JSONL rows (rotation
over copies, exact byte counts, floors on the measured bandwidth, targets judged from the
row's own figures and from the row it compares with), the markdown table, the summary of a
stopped run and the time budget. Speed is not checked here (no timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_kernels_graph as bkg  # noqa: E402
import graph_timing as gt  # noqa: E402

# One or two cases of each group; "decode B=1 ctx=40" also picks its forced split counts.
MATCH = ("attention decode B=1 ctx=40,attention decode B=2 ctx=40,tree8 B=2 ctx=40,"
         "top_p=1 bf16 B=1,T=1 forward,rope_kv T=4,reshape_and_cache B=1,compact_kv B=1")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(BENCH / "bench_kernels_graph.py"), "--dry", "--out", str(out),
            *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[dict, dict[str, dict], Path]:
    out = tmp_path_factory.mktemp("sweep")
    proc = _run(out, "--match", MATCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(ln) for ln in (out / "kernels_graph.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "meta"
    rows = {r["case"]: r for r in records[1:]}
    assert all(r["kind"] == "row" for r in rows.values())
    return records[0], rows, out


def test_every_group_runs_with_rotated_copies_and_sane_fields(dry):
    meta, rows, _ = dry
    assert meta["l2_bytes"] == gt.DRY_L2_BYTES and meta["copy_gbps"] > 0
    assert {r["group"] for r in rows.values()} == set(bkg.GROUPS)
    assert set(rows) == {
        "attention decode B=1 ctx=40", "attention decode B=1 ctx=40 splits=1",
        "attention decode B=1 ctx=40 splits=2", "attention decode B=2 ctx=40",
        "attention tree8 B=2 ctx=40", "sampling top_p=1 bf16 B=1",
        "moe qwen3-30b-a3b T=1 forward", "moe qwen3-235b-a22b T=1 forward", "rope_kv T=4",
        "reshape_and_cache B=1 x4", "compact_kv B=1 accepted=3"}
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        # Dry runs rotate two copies (the stand-in L2 is 1 MiB; every case here is smaller).
        assert (r["copies"], r["calls"], r["replays"]) == (2, 2, 2), name
        assert r["graph_us"] > 0 and r["eager_us"] > 0 and r["time_us"] == r["graph_us"]
        assert "dry run" in r["graph_error"]
        assert r["floor_us"] == pytest.approx(r["bytes"] / (meta["copy_gbps"] * 1e3))
        assert r["x_floor"] == pytest.approx(r["time_us"] / r["floor_us"])
        assert r["bw_frac"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e3)
                                             / meta["copy_gbps"])
        assert r["working_set_mb"] == pytest.approx(2 * r["bytes"] / 1e6, abs=0.06)


def test_bytes_are_counted_from_the_shapes(dry):
    _, rows, _ = dry
    f32 = 4
    # decode, dry heads (Hq 4, Hkv 2, D 32), ctx 40 + 1 new token, pages of 16:
    # K and V of 41 tokens, q in and o out, the block table (3 pages), context_lens, indptr.
    want = 2 * 41 * 2 * 32 * f32 + 2 * 4 * 32 * f32 + 3 * 4 + 4 + 2 * 4
    assert rows["attention decode B=1 ctx=40"]["bytes"] == want
    # The split count changes the kernel, not what a perfect kernel must move.
    assert rows["attention decode B=1 ctx=40 splits=2"]["bytes"] == want
    # sampling, B=1, k=3 (4 rows) of V=1000 bf16 logits, 3 int64 drafts, the per-request
    # vectors, and per row the output id (int64), logprob and row id.
    assert rows["sampling top_p=1 bf16 B=1"]["bytes"] == 4 * 1000 * 2 + 3 * 8 + 32 + 4 * 16 + 4
    # rope_kv, T=4 (Hq 4, Hkv 2, D 64): qkv in, cos/sin and the two norm weights, q out,
    # K and V into the cache, the slots.
    assert rows["rope_kv T=4"]["bytes"] == (4 * 8 * 64 + 2 * 4 * 32 + 2 * 64 + 4 * 4 * 64
                                            + 2 * 4 * 2 * 64) * f32 + 4 * 8
    moe = rows["moe qwen3-30b-a3b T=1 forward"]  # dry shape: E 12, top-2, H 64, I 32
    assert moe["distinct_experts"] == 2  # one token, top-2
    assert moe["bytes"] == round(moe["distinct_experts"] * 3 * 64 * 32 * f32
                                 + 2 * 64 * f32 + 12 * f32)


def test_targets_are_judged_from_the_rows(dry):
    _, rows, _ = dry
    dec = rows["attention decode B=1 ctx=40"]
    assert dec["target"] == "<= 8 us"
    assert dec["verdict"] == ("PASS" if dec["time_us"] <= 8 else "MISS")
    tree, ref = rows["attention tree8 B=2 ctx=40"], rows["attention decode B=2 ctx=40"]
    assert "x decode" in tree["target"] and "target" not in ref
    assert tree["verdict"] == ("PASS" if tree["time_us"] <= 1.3 * ref["time_us"] else "MISS")
    for model, mult in (("qwen3-30b-a3b", 2.0), ("qwen3-235b-a22b", 1.5)):
        r = rows[f"moe {model} T=1 forward"]
        assert r["target"].startswith(f"<= {mult:g}x floor")
        assert r["verdict"] == ("PASS" if r["time_us"] <= mult * r["floor_us"] else "MISS")
        # the profile of one call's launches in order (on the CPU: its top-level operators)
        prof = r["kernels_us"]
        assert prof and "error" not in prof and "split_by_call" not in prof
        assert list(prof)[0].startswith("00 ") and sum(prof.values()) > 0
    samp = rows["sampling top_p=1 bf16 B=1"]
    assert samp["verdict"] == ("PASS" if samp["time_us"] <= 15 else "MISS")
    assert "verdict" not in rows["reshape_and_cache B=1 x4"]  # no target there


def test_attention_rows_name_the_launch_they_timed(dry):
    _, rows, _ = dry
    for r in rows.values():
        if r["group"] == "attention":
            assert "launch_error" not in r, r["launch_error"]
            assert r["block_m"] >= 16 and r["block_n"] >= 16 and r["num_stages"] >= 1
    assert rows["attention decode B=1 ctx=40 splits=2"]["splits_used"] == 2
    assert rows["attention decode B=1 ctx=40"]["splits_used"] == 1  # the CPU never splits


def test_table_and_summary(dry):
    _, rows, out = dry
    table = (out / "kernels_graph.md").read_text()
    for name in rows:
        assert f"| {name} " in table
    text = bkg.summary(out / "kernels_graph.jsonl")
    judged = [n for n, r in rows.items() if r.get("verdict")]
    assert judged and all(n in text for n in judged)
    assert "reshape_and_cache" not in text  # only rows with a target


def test_summary_of_a_run_stopped_mid_row(dry, tmp_path):
    _, _, out = dry
    lines = (out / "kernels_graph.jsonl").read_text().splitlines()
    cut = tmp_path / "kernels_graph.jsonl"
    cut.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    text = bkg.summary(cut)
    assert text.startswith("sweep: 2 cases on cpu (dry)")


def test_budget_stops_starting_cases(tmp_path):
    proc = _run(tmp_path, "--only", "kv", "--budget-s", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(ln) for ln in (tmp_path / "kernels_graph.jsonl").read_text()
               .splitlines()]
    assert [r["kind"] for r in records] == ["meta", "skipped"]
    assert records[1]["cases"] == [c.name for c in bkg.all_cases(True, ["kv"])]
    assert "Not run (budget)" in (tmp_path / "kernels_graph.md").read_text()


def test_bad_group_is_refused(tmp_path):
    proc = _run(tmp_path, "--only", "attention,gemm")
    assert proc.returncode == 2 and "--only takes groups" in proc.stderr


def test_num_copies_reach_four_l2_within_the_caps():
    l2 = 60 * 10**6
    assert gt.num_copies(16 * 2**20, 16 * 2**20, l2=l2, max_copies=64,
                         mem_cap_bytes=3 << 30) == 15  # 15 x 16 MiB >= 240 MB
    assert gt.num_copies(300 * 10**6, 300 * 10**6, l2=l2, max_copies=64,
                         mem_cap_bytes=3 << 30) == 1  # one copy is already 4x L2
    assert gt.num_copies(1000, 1000, l2=l2, max_copies=64, mem_cap_bytes=3 << 30) == 64
    assert gt.num_copies(10**6, 1 << 30, l2=l2, max_copies=64, mem_cap_bytes=3 << 30) == 3
    assert gt.num_copies(10**6, 4 << 30, l2=l2, max_copies=64, mem_cap_bytes=3 << 30) == 1
    with pytest.raises(ValueError, match="touch_bytes"):
        gt.num_copies(0, 1, l2=l2, max_copies=4, mem_cap_bytes=1)


def test_a_later_command_skips_what_was_measured_and_compares_with_it(dry, tmp_path):
    """``--skip-from`` (device_kernels.sh RESUME=1): cases measured without error before are
    not run again, and a target row compares with the earlier run's row."""
    meta, rows, out = dry
    earlier = tmp_path / "earlier.jsonl"
    decode = rows["attention decode B=2 ctx=40"]
    failed = dict(rows["compact_kv B=1 accepted=3"], error="boom")  # failed: runs again
    earlier.write_text("\n".join(json.dumps(r) for r in (meta, decode, failed)) + "\n")
    proc = _run(tmp_path / "later", "--match", "B=2 ctx=40,compact_kv B=1",
                "--skip-from", str(earlier))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(ln) for ln in (tmp_path / "later" / "kernels_graph.jsonl")
               .read_text().splitlines()]
    assert records[0]["skipped_measured_before"] == ["attention decode B=2 ctx=40"]
    later = {r["case"]: r for r in records[1:]}
    assert set(later) == {"attention chain3 B=2 ctx=40", "attention tree8 B=2 ctx=40",
                          "compact_kv B=1 accepted=3"}
    tree = later["attention tree8 B=2 ctx=40"]
    assert f"({1.3 * decode['time_us']:.1f} us)" in tree["target"]
    assert tree["verdict"] == ("PASS" if tree["time_us"] <= 1.3 * decode["time_us"] else "MISS")


def test_split_search_cases_run_split_and_in_one_program(tmp_path):
    """The B = 1 top_p = 0.9 comparison cases (issue 35's split search): the cut alone over
    4,097 tokens (3 parts in dry runs, so the split path runs) and in one program per row,
    and the sampler with vocab_parts=1; every row measured, the cut's bytes counted."""
    proc = _run(tmp_path, "--match", "keep_threshold top_p=0.9 bf16,top_p=0.9 bf16 B=1 parts=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, (tmp_path / "kernels_graph.jsonl")
                                      .read_text().splitlines()) if r["kind"] == "row"}
    assert set(rows) == {"keep_threshold top_p=0.9 bf16 rows=4",
                         "keep_threshold top_p=0.9 bf16 rows=4 parts=1",
                         "sampling top_p=0.9 bf16 B=1 parts=1"}
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
    for name in ("keep_threshold top_p=0.9 bf16 rows=4",
                 "keep_threshold top_p=0.9 bf16 rows=4 parts=1"):
        # bf16 logits in, temperature / top_k / top_p in and tau / mass / max out per row
        assert rows[name]["bytes"] == 4 * 4097 * 2 + 4 * 24
