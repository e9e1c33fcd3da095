"""The GPU check's logic on CPU, with real inputs: sub-step outputs (real pytest runs, the
benchmarks' own JSON from their CPU smoke runs) parsed into rows, the PASS/FAIL decisions
against the targets, failing and hanging sub-steps, the RESULTS.md section, and the exit code
without CUDA. The GPU figures themselves need a GPU."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check as gc  # noqa: E402
import gpu_check_rows as gr  # noqa: E402

_EDITS = itertools.count()
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side of the check")


def _run(tmp: Path, name: str, argv: list[str], timeout: float = 300) -> gr.StepRun:
    return gc.run_step(gc.Step(name, argv, int(timeout), gr.parse_pytest), tmp, timeout, 0)


def _rewrite(run: gr.StepRun, name: str, edit) -> gr.StepRun:
    """The same run with its JSON edited (to place a real output either side of a target)."""
    path = run.out_dir / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data)
    new_dir = run.out_dir.parent / f"{run.out_dir.name}_edited_{next(_EDITS)}"
    new_dir.mkdir()
    (new_dir / f"{name}.json").write_text(json.dumps(data))
    return gr.StepRun(run.name, run.returncode, run.timed_out, run.output, new_dir)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict[str, gr.StepRun]:
    """Real CPU runs of the sub-steps whose JSON the check parses (tiny shapes)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    py = sys.executable
    return {
        "rejection": _run(tmp, "rejection", [py, str(BENCH / "bench_rejection_sampling.py"),
                                             "--smoke", "--out", "{out}"]),
        "attention": _run(tmp, "attention", [py, str(BENCH / "bench_attention.py"), "--smoke",
                                             "--modes", "decode", "chain", "--baselines",
                                             "sdpa", "--out", "{out}"]),
        "host": _run(tmp, "host", [py, str(BENCH / "bench_host_overhead.py"), "--batches", "1",
                                   "--ks", "0", "3", "--drafts", "chain", "--backends", "torch",
                                   "--steps", "2", "--warmup-steps", "1", "--out", "{out}"]),
        "peers": _run(tmp, "peers", [py, str(BENCH / "peers_flashinfer.py"), "--out", "{out}"]),
        "parity": _run(tmp, "parity", [py, str(BENCH / "gpu_parity.py"), "hf", "--out",
                                       "{out}"]),
    }


def test_pytest_summary_rows(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_a.py").write_text("def test_ok():\n    assert True\n\n"
                                     "def test_bad():\n    assert 1 == 2\n")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    row, = gr.parse_pytest(_run(tmp_path, "mixed", argv))
    assert (row.verdict, row.figure) == ("FAIL", "1 passed, 1 failed, 0 skipped")
    row, = gr.parse_pytest(_run(tmp_path, "ok", argv + ["-k", "ok"]))
    assert (row.verdict, row.figure) == ("PASS", "1 passed, 0 failed, 0 skipped")


def test_gpu_tests_skipped_on_cpu_are_a_fail(tmp_path):
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
            str(ROOT / "tests" / "test_compact_kv.py")]
    row, = gr.parse_pytest(_run(tmp_path, "gpu", argv))
    assert row.verdict == "FAIL"
    assert row.figure.startswith("0 passed, 0 failed,") and not row.figure.endswith(" 0 skipped")


def test_failing_and_hanging_steps_give_fail_rows(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('boom: no device'); sys.exit(3)"]
    row, = gr.failure_rows(_run(tmp_path, "crash", crash), "crash")
    assert (row.result, row.figure, row.verdict) == ("exit 3", "boom: no device", "FAIL")
    hang = [sys.executable, "-c", "import threading; print('waiting', flush=True); "
                                  "threading.Event().wait()"]
    run = _run(tmp_path, "hang", hang, timeout=3)
    assert run.timed_out
    row, = gr.parse_pytest(run)
    assert row.verdict == "FAIL" and row.result.startswith("timed out")
    not_run = gc.run_step(gc.Step("late", crash, 60, gr.parse_pytest), tmp_path, 5.0)
    assert not_run.returncode is None
    assert gr.failure_rows(not_run, "late")[0].verdict == "SKIP"


def test_rejection_bandwidth_target(smoke):
    run = smoke["rejection"]
    assert run.returncode == 0, run.output
    rows = gr.parse_rejection(run, vocab=1000)
    assert [r.verdict for r in rows] == ["INFO"]  # no peak known on CPU: no bandwidth verdict
    gbps = json.loads((run.out_dir / "rejection_sampling.json").read_text())["rows"][0]["gbps"]
    for frac, verdict in ((0.81, "PASS"), (0.79, "FAIL")):
        edited = _rewrite(run, "rejection_sampling",
                          lambda d, f=frac: d.update(peak_gbps=gbps / f))
        row = gr.parse_rejection(edited, vocab=1000)[0]
        assert row.verdict == verdict and row.target == ">= 80% of HBM peak"
    assert gr.parse_rejection(run)[0].verdict == "INFO"  # no V=151936 row in a smoke run


def test_attention_targets(smoke):
    run = smoke["attention"]
    assert run.returncode == 0, run.output

    def verify_ratio(ratio: float):
        def edit(d):
            dec = {(r["batch"], r["context"]): r["triton_ms"] for r in d["rows"]
                   if r["mode"] == "decode"}
            for r in d["rows"]:
                if r["mode"] == "chain":
                    r["triton_ms"] = dec[(r["batch"], r["context"])] * ratio
        return edit

    for ratio, verdict in ((1.09, "PASS"), (1.11, "FAIL")):
        rows = gr.parse_attention(_rewrite(run, "attention", verify_ratio(ratio)),
                                  min_context=0, verify_len=3)
        row = next(r for r in rows if r.check == "3-token verify / decode")
        assert row.verdict == verdict
    gbps = min(r["gbps"] for r in json.loads((run.out_dir / "attention.json").read_text())
               ["rows"] if r["mode"] == "decode")
    for frac, verdict in ((0.86, "PASS"), (0.84, "FAIL")):
        edited = _rewrite(run, "attention", lambda d, f=frac: d.update(peak_gbps=gbps / f))
        row = gr.parse_attention(edited, min_context=0)[0]
        assert row.check == "attention decode, ctx >= 0" and row.verdict == verdict
    assert any(r.check == "attention vs sdpa" and r.verdict == "INFO"
               for r in gr.parse_attention(run))


def test_host_rows_follow_the_json(smoke):
    run = smoke["host"]
    assert run.returncode == 0, run.output
    data = json.loads((run.out_dir / "host_overhead.json").read_text())
    rows = gr.parse_host(run)
    assert len(rows) == len(data["rows"]) >= 2  # k=0 and k=3 (per graph setting, if any)
    for row, r in zip(rows, data["rows"]):
        assert row.verdict == ("PASS" if r["host_us"] <= 300 + 2 * r["batch"] else "FAIL")
        assert f"k={r['k']}" in row.check and row.target == f"<= {300 + 2 * r['batch']} us"
    launches = gr.parse_launches(run)
    assert len(launches) == len({r["graphs"] for r in data["rows"]})  # no replays on CPU
    for row in launches:
        sel = [r for r in data["rows"] if row.check.endswith(f"(graphs={r['graphs']})")]
        worst = max(r["launches_per_layer"] for r in sel)
        assert row.verdict == ("PASS" if worst <= 12 else "FAIL") and row.result == f"{worst:.1f}"


def test_peers_skip_and_parity_without_cuda(smoke):
    row, = gr.parse_peers(smoke["peers"])
    assert row.verdict == "SKIP" and "no CUDA" in row.figure
    row, = gr.parse_parity(smoke["parity"], "hf", "bf16 parity with HF", "-")
    assert (row.verdict, row.result) == ("FAIL", "exit 2")


def test_results_section_appends_and_keeps_the_file(tmp_path):
    path = tmp_path / "RESULTS.md"
    before = (BENCH / "RESULTS.md").read_text()
    path.write_text(before)
    rows = [gr.Row("pytest -m gpu", "12 passed", "12 passed, 0 failed, 0 skipped", "all pass",
                   "PASS"), gr.Row("a | b", "x", "y", "z", "FAIL")]
    meta = dict(date="2026-11-23 12:00 UTC", device="NVIDIA H100 80GB HBM3", torch="2.11",
                triton="3.6.0", commit="abc1234", command="python benchmarks/gpu_check.py",
                seconds="512")
    gc.append_results(path, gc.results_section(rows, meta))
    gc.append_results(path, gc.results_section(rows[:1], meta))
    text = path.read_text()
    assert text.startswith(before)
    added = text[len(before):]
    assert added.count("## GPU check (`gpu_check.py`), 2026-11-23 12:00 UTC") == 2
    assert "NVIDIA H100 80GB HBM3, torch 2.11, triton 3.6.0, commit abc1234" in added
    assert "\n    python benchmarks/gpu_check.py\n" in added
    assert "| a / b | x | y | z | FAIL |" in added  # a pipe cannot break the table
    assert "1 PASS, 1 FAIL, 0 SKIP, 0 INFO" in added


def test_exit_code_without_cuda():
    script = str(BENCH / "gpu_check.py")
    help_ = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "pytest" in help_.stdout
    run = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert run.returncode == 2 and "no CUDA device" in run.stderr


def test_hf_parity_check_itself_on_cpu():
    """The parity check's scoring (teacher-forced HF logprobs of the engine's own tokens) on
    the CPU in float32, where engine and transformers must agree to rounding."""
    import gpu_parity

    result = gpu_parity.check_hf(device="cpu", dtype="float32")
    assert result["passed"] is True
    for d in result["details"].values():
        assert d["confident_positions"] >= 32 and d["agreeing"] == d["confident_positions"]
        assert d["logprob_err_engine"] < 1e-4 and d["logprob_err_hf_bf16"] == 0.0


def test_graphs_check_itself_on_cpu():
    """graphs-on = graphs-off on the CPU, where ``cuda_graphs=True`` is the same static padded
    path without capture: the check's cases all run and compare equal."""
    import inspect

    import gpu_parity

    from specengine import SpecEngine

    result = gpu_parity.check_graphs(device="cpu", batches=(3,), max_tokens=12)
    if "cuda_graphs" not in inspect.signature(SpecEngine.__init__).parameters:
        assert result["passed"] is None
        return
    assert result["mismatches"] == [] and len(result["cases"]) == 6
    assert result["passed"] is True and result["max_logprob_diff"] <= 1e-3
