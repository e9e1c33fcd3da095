"""The GPU check's logic on CPU, with real inputs: sub-step outputs (real pytest runs, the
benchmarks' own JSON from their CPU smoke runs) parsed into rows, the PASS/FAIL decisions
against the targets, failing and hanging sub-steps, the RESULTS.md section, and the exit code
without CUDA; and what a short visit needs: every phase bounded under 9 minutes, rows in
``--out`` the moment they are known (a command stopped at its limit keeps them), and missing
optional packages as SKIP rows, never FAIL (hidden here by ``test_optional_deps``'s finder).
The GPU figures themselves need a GPU."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_optional_deps import fake_build_tools, hiding_env

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
    # the row the verdict judges: the worst of the largest batch at top_p = 1 (rows[0] is
    # another row when the smoke run has several and the host's timings vary)
    rows = [r for r in json.loads((run.out_dir / "rejection_sampling.json").read_text())["rows"]
            if r["vocab"] == 1000 and r.get("gbps")]
    big = max(r["batch"] for r in rows)
    gbps = min(r["gbps"] for r in rows if r["batch"] == big and r["top_p"] == 1.0)
    for frac, verdict in ((0.81, "PASS"), (0.79, "FAIL")):
        edited = _rewrite(run, "rejection_sampling",
                          lambda d, f=frac: d.update(peak_gbps=gbps / f))
        row = gr.parse_rejection(edited, vocab=1000)[0]
        assert row.verdict == verdict and row.target == ">= 80% of HBM peak"
    assert gr.parse_rejection(run)[0].verdict == "INFO"  # no V=151936 row in a smoke run


def test_rejection_top_p_cost_row(tmp_path):
    """top_p < 1 rows are reported against the same shape at top_p = 1 (the worst ratio)."""
    def row(bsz: int, top_p: float, ms: float) -> dict:
        return dict(batch=bsz, k=3, vocab=151936, top_p=top_p, draft_probs=False, ms=ms,
                    torch_ms=1.0, cut_ms=ms / 2, bytes=1, gbps=1.0)

    out = tmp_path / "out"
    out.mkdir()
    rows = [row(1, 1.0, 0.2), row(1, 0.9, 0.6), row(64, 1.0, 0.3), row(64, 0.9, 0.45)]
    (out / "rejection_sampling.json").write_text(json.dumps(dict(peak_gbps=None, rows=rows)))
    got = gr.parse_rejection(gr.StepRun("rejection", 0, False, "", out))
    cost = [r for r in got if r.check.startswith("top_p=0.9 cost")]
    assert len(cost) == 1 and cost[0].result == "3.00x top_p=1 (worst)", got
    assert cost[0].figure == "0.600 ms at B=1 k=3, cut alone 0.300 ms"


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
    # The visit's command sequence, every phase once, the build first, rows under $OUT.
    commands = [ln.split() for ln in help_.stdout.splitlines() if "gpu_check.py --only" in ln]
    phases = [c[c.index("--only") + 1] for c in commands]
    assert phases[0] == "build" and sorted(phases) == sorted(gc.PHASES)
    assert all(c[c.index("--out") + 1] == '"$OUT"' for c in commands)
    run = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert run.returncode == 2 and "no CUDA device" in run.stderr


def test_hf_parity_check_itself_on_cpu():
    """The parity check's scoring (teacher-forced HF logprobs of the engine's own tokens) on
    the CPU in float32, where engine and transformers must agree to rounding."""
    pytest.importorskip("transformers")
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


PHASES = {"build", "compile", "tests", "parity", "micro", "e2e", "peers"}


def test_every_phase_ends_under_nine_minutes():
    """A lent machine's command limit is 10 minutes: each phase's step timeouts add up to at
    most 540 s, so one ``--only PHASE`` command always ends (and writes its rows) in time."""
    assert set(gc.PHASES) == PHASES and gc.PHASE_LIMIT_S == 540
    for phase, steps in gc.PHASES.items():
        assert steps and sum(s.timeout_s for s in steps) <= 540, phase
    names = [s.name for s in gc.STEPS]
    assert len(names) == len(set(names)) and set(names).isdisjoint(PHASES)
    assert gc.select_steps(["micro"]) == gc.PHASES["micro"]
    assert gc.select_steps(["tests", "attention"]) == gc.PHASES["tests"] + gc.PHASES["micro"][:1]
    assert gc.select_steps(None, ["build", "peers", "kv_cache"]) == [
        s for s in gc.STEPS
        if s.name not in ("install", "native", "flashinfer", "hf_generate", "kv_cache")]
    with pytest.raises(ValueError, match="unknown phase or step 'gpu'"):
        gc.select_steps(["gpu"])


def _driver(out: Path, steps: str) -> str:
    """Python source running ``steps`` (an expression over gc, gr, py) through the check's
    own loop into ``out``, as ``gpu_check.py --only ...`` does."""
    return (f"import sys\nsys.path.insert(0, {str(BENCH)!r})\n"
            "import gpu_check as gc, gpu_check_rows as gr\npy = sys.executable\n"
            f"gc.run_steps({steps}, gc.Path({str(out)!r}), 300)\n")


def _rows(out: Path) -> list[gr.Row]:
    return [gr.Row(**json.loads(ln)) for ln in (out / "rows.jsonl").read_text().splitlines()]


def test_rows_reach_out_before_the_command_is_stopped(tmp_path):
    """The command is killed while its second step runs: the first step's row is already in
    rows.jsonl and table.md, and the second step's output already in its log."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    out = tmp_path / "out"
    second = f"print('beta started'); open({str(gate)!r}).read()"
    steps = ("[gc.Step('first', [py, '-c', 'print(\"alpha measured\")'], 60, "
             "lambda r: gr.parse_exit(r, 'first')), "
             f"gc.Step('second', [py, '-c', {second!r}], 120, "
             "lambda r: gr.parse_exit(r, 'second'))]")
    # Without PYTHONUNBUFFERED of its own, so the check must make the steps' output unbuffered.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    driver = subprocess.Popen([sys.executable, "-c", _driver(out, steps)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, start_new_session=True)
    opened: list = []
    # Opening the gate for writing returns once the second step opens it to read, that is,
    # after its (unflushed) print: no sleep, no polling.
    opener = threading.Thread(target=lambda: opened.append(gate.open("w")), daemon=True)
    opener.start()
    opener.join(120)
    try:
        assert opened, "the second step never started"
        assert driver.poll() is None
        assert "beta started" in (out / "second" / "log.txt").read_text()
        os.killpg(driver.pid, signal.SIGKILL)  # the command stopped at its limit
        driver.wait()
    finally:
        if not opened:  # unblock the opener so the thread ends
            os.close(os.open(gate, os.O_RDONLY | os.O_NONBLOCK))
            opener.join(10)
        for f in opened:
            f.close()  # the orphaned second step reads EOF and exits
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    rows = _rows(out)
    assert rows == [gr.Row("first", "ok", "alpha measured", "runs", "PASS")]
    assert (out / "table.md").read_text().splitlines() == [
        "| check | result | figure | target | verdict |", "|---|---|---|---|---|",
        "| first | ok | alpha measured | runs | PASS |"]


def test_a_step_killed_by_its_timeout_keeps_the_rows_before_it(tmp_path):
    out = tmp_path / "out"
    py = sys.executable
    steps = [gc.Step("before", [py, "-c", "print('measured 1.5 ms')"], 30,
                     lambda r: gr.parse_exit(r, "before")),
             gc.Step("hangs", [py, "-c", "print('started'); import threading; "
                                         "threading.Event().wait()"], 3,
                     lambda r: gr.parse_exit(r, "hangs"))]
    rows = gc.run_steps(steps, out, 300)
    assert _rows(out) == rows
    assert rows[0] == gr.Row("before", "ok", "measured 1.5 ms", "runs", "PASS")
    assert rows[1].verdict == "FAIL" and rows[1].result.startswith("timed out after")
    assert rows[1].figure == "started"  # its log, written while it ran


def test_missing_optional_packages_are_skip_rows_never_fail(tmp_path):
    """On a machine without transformers, FastAPI and FlashInfer: the parity step needing
    transformers and the peers step are SKIP rows naming the package, a step dying on an
    optional import is a SKIP, one dying on any other import a FAIL; the tests phase's
    pytest row is the GPU tests' own result, and a module skipped for FastAPI a SKIP row."""
    out = tmp_path / "out"
    tests = [str(ROOT / "tests" / "test_server.py"), str(ROOT / "tests" / "test_compact_kv.py")]
    steps = ("[gc.PHASES['parity'][0], gc.PHASES['peers'][0], "
             "gc.Step('optional_import', [py, '-c', 'import fastapi'], 60, "
             "lambda r: gr.parse_exit(r, 'optional import')), "
             "gc.Step('other_import', [py, '-c', 'import no_such_module_here'], 60, "
             "lambda r: gr.parse_exit(r, 'other import')), "
             f"gc.pytest_step({tests!r})]")
    env = hiding_env(tmp_path, ("transformers", "fastapi", "flashinfer"))
    run = subprocess.run([sys.executable, "-c", _driver(out, steps)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r.check: r for r in _rows(out)}
    assert rows["bf16 parity with HF"] == gr.Row("bf16 parity with HF", "skipped",
                                                 "transformers not installed", "-", "SKIP")
    assert not (out / "parity_hf").exists()  # never started
    assert rows["FlashInfer peers"].verdict == "SKIP"
    assert "flashinfer not installed" in rows["FlashInfer peers"].figure
    assert rows["optional_import"].verdict == "SKIP"
    assert rows["optional_import"].figure == "fastapi not installed"
    assert rows["other import"].verdict == "FAIL"
    # The GPU tests, skipped on this CPU machine, still make the pytest row a FAIL...
    gpu = rows["pytest -m gpu"]
    assert gpu.verdict == "FAIL" and gpu.figure.startswith("0 passed, 0 failed, ")
    assert gpu.figure.endswith(" skipped (+1 for missing packages)")
    assert not gpu.figure.startswith("0 passed, 0 failed, 0 skipped")
    # ... while the module skipped for FastAPI is a SKIP row with the reason.
    assert rows["tests in tests/test_server.py"] == gr.Row(
        "tests in tests/test_server.py", "skipped", "fastapi not installed", "-", "SKIP")
    assert not [r for r in rows.values() if r.verdict == "FAIL" and "not installed" in r.figure]


def test_pytest_modules_failing_on_a_missing_package_are_skip_rows(tmp_path):
    """A test module importing an optional package without importorskip: the run goes on
    past its collection error, which is a SKIP row, not a failure of the other tests."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_needs_ray.py").write_text("import ray\n\n\ndef test_x():\n    pass\n")
    (tests / "test_fine.py").write_text("def test_ok():\n    pass\n")
    out = tmp_path / "out"
    steps = f"[gc.pytest_step([{str(tests)!r}], marker=None)]"
    run = subprocess.run([sys.executable, "-c", _driver(out, steps)], cwd=ROOT,
                         env=hiding_env(tmp_path, ("ray",)), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERROR" in (out / "pytest" / "log.txt").read_text()  # a real collection error
    assert _rows(out) == [
        gr.Row("pytest -m gpu", "1 passed", "1 passed, 0 failed, 0 skipped (+1 for missing "
               "packages)", "all pass, none skipped", "PASS"),
        gr.Row("tests in test_needs_ray.py", "skipped", "ray not installed", "-", "SKIP")]


def test_install_rows(tmp_path):
    """The build phase's install step read from the real script's ``--check`` output: the
    missing requirement named in a FAIL row, each absent optional package a SKIP row."""
    pkgs, bin_ = fake_build_tools(tmp_path)
    env = hiding_env(tmp_path, ("safetensors", "fastapi"), pkgs)
    env.update(SPECENGINE_NO_CUDA="1", PATH=f"{bin_}{os.pathsep}{env['PATH']}")
    script = str(ROOT / "scripts" / "install_offline.sh")
    code = (f"import sys\nsys.path.insert(0, {str(BENCH)!r})\nimport gpu_check as gc\n"
            f"gc.run_step(gc.Step('install', ['bash', {script!r}, '--check'], 120, None), "
            f"gc.Path({str(tmp_path / 'out')!r}), 120)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    out_dir = tmp_path / "out" / "install"
    log = (out_dir / "log.txt").read_text()
    rows = gr.parse_install(gr.StepRun("install", 1, False, log[-200:], out_dir))
    assert rows[0] == gr.Row("offline install", "missing requirements", "safetensors",
                             "all present", "FAIL")
    skips = {r.check: r for r in rows[1:]}
    assert all(r.verdict == "SKIP" and r.result == "absent" for r in skips.values())
    assert "optional fastapi" in skips and "optional transformers" not in skips
    assert skips["optional fastapi"].figure.startswith("skips `specengine serve`")
    ok = gr.parse_install(gr.StepRun("install", 0, False, "install_offline: OK", out_dir))
    assert ok[0].verdict == "PASS" and ok[1:] == rows[1:]


def test_compile_rows(tmp_path):
    """``compile_kernels.py``'s JSON (its own layout): a spill or an error fails the target."""
    def run_with(rows, errors=()):
        d = tmp_path / f"c{next(_EDITS)}"
        d.mkdir()
        (d / "compile_table.json").write_text(json.dumps({"rows": rows, "errors": list(errors)}))
        return gr.StepRun("compile", 1 if errors else 0, False, "", d)

    clean = {"kernel": "k", "config": "c", "registers": 96, "stack_bytes": 0, "spill_stores": 0,
             "spill_loads": 0}
    rows = gr.parse_compile(run_with([dict(clean, target="sm_90a"),
                                      dict(clean, target="sm_100a", registers=128)]))
    assert [(r.check, r.verdict, r.figure) for r in rows] == [
        ("Triton compile sm_100a", "PASS", "max 128 registers, 0 failing or spilling"),
        ("Triton compile sm_90a", "PASS", "max 96 registers, 0 failing or spilling")]
    rows = gr.parse_compile(run_with([dict(clean, target="sm_90a", spill_stores=8)],
                                     ["k [c] on sm_90a spills 8 B stores / 0 B loads"]))
    assert [(r.result, r.verdict) for r in rows] == [("0/1 clean", "FAIL")]
    rows = gr.parse_compile(run_with([dict(clean, target="sm_90a")], ["k: no configuration"]))
    assert [r.verdict for r in rows] == ["PASS", "FAIL"]
    assert gr.parse_compile(gr.StepRun("compile", 1, False, "boom", tmp_path))[0].verdict == \
        "FAIL"


def test_module_names_from_junit_class_names():
    """The module of a JUnit class name is its last ``test_*`` part, whatever folders (some
    named ``test_...`` themselves) pytest's rootdir put before it."""
    assert gr._module_of("tests.test_server.TestX") == "tests/test_server.py"
    assert gr._module_of("test_server") == "test_server.py"
    assert gr._module_of("pytest-of-root.pytest-79.popen-gw0.test_fails_on0.t.test_needs_ray"
                         ) == "test_needs_ray.py"
    assert gr._module_of("conftest") == "conftest"
