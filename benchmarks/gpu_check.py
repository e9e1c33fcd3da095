"""Validates a lent GPU phase by phase, each phase one command under 9 minutes; run it first.

A lent machine gives each command at most 10 minutes, returns only what the command wrote under
its ``$OUT`` folder, and has no network. So the check is split into phases (``--only``), each
a few sub-steps run as subprocesses with their own timeouts, which add up to at most
:data:`PHASE_LIMIT_S` per phase (a failure, hang or crash of one does not stop the rest):

- ``build``: ``scripts/install_offline.sh`` (checks the requirements, builds ``specengine._C``
  with its CUDA kernels, installs without network, lists absent optional packages), then
  ``specengine.native.check_native`` on the device;
- ``compile``: ``scripts/compile_kernels.py`` with the installed Triton: every kernel variant
  compiles for sm_90a / sm_100a without spills;
- ``tests``: ``pytest -m gpu`` (every GPU-marked test must pass; modules and tests skipped for
  a missing optional package are SKIP rows of their own, not part of that verdict);
- ``parity``: bf16 parity with Hugging Face, and graphs-on = graphs-off tokens
  (``gpu_parity.py``; the HF half needs transformers);
- ``micro``: the kernel microbenchmarks at 8B shapes (``bench_attention.py``,
  ``bench_rejection_sampling.py``, ``bench_kv_cache.py``);
- ``e2e``: the host overhead of a decode step (bundled pair), the 8B step cost with dummy
  weights (``bench_generate.py --mode step-cost``) and whole 8B steps with an EAGLE-3-shaped
  head (``bench_host_overhead.py --model llama-8b``);
- ``peers``: FlashInfer side by side (``peers_flashinfer.py``; needs FlashInfer), and
  transformers' batched ``generate`` next to specengine k=0 / n-gram k=3 / EAGLE-3 k=3 on the
  bundled pair (``bench_generate.py --peer-only``; needs transformers), greedy outputs equal.

Every row (check, result, figure, target, PASS/FAIL/SKIP/INFO) is written to ``--out`` the
moment it is known: ``rows.jsonl`` and ``table.md``, flushed per row, and each sub-step's log
streams into ``--out/STEP/log.txt`` while it runs, so a command stopped at its limit still
returns what it measured. A step whose optional package is missing is a SKIP row with the
reason, never a FAIL. At the end the table is printed, written to ``--out/results_section.md``
and appended to ``benchmarks/RESULTS.md`` (``--no-append`` to skip). Without CUDA it exits
with code 2; exit code 1 if any FAIL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gpu_check_rows as gr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
PY = sys.executable
PHASE_LIMIT_S = 540  # 9 minutes: a phase ends inside a 10-minute command with time to spare

VISIT = """\
A 45-minute visit (no network; each command ends under 9 minutes; $OUT is the folder whose
files come back, so every row is there even if a command is stopped). In this order, the
build first; if time runs short, stop after any command: what ran is already in $OUT.

  SPECENGINE_CUDA_ARCHS=90a python benchmarks/gpu_check.py --only build --out "$OUT"
  python benchmarks/gpu_check.py --only tests --out "$OUT"
  python benchmarks/gpu_check.py --only parity --out "$OUT"
  python benchmarks/gpu_check.py --only micro --out "$OUT"
  python benchmarks/gpu_check.py --only e2e --out "$OUT"
  python benchmarks/gpu_check.py --only compile --out "$OUT"
  python benchmarks/gpu_check.py --only peers --out "$OUT"   # FlashInfer rows need it carried in

(SPECENGINE_CUDA_ARCHS=90a: H100/H200 only, a faster build; leave it out to build for B200
too.) Then copy each command's $OUT/results_section.md into benchmarks/RESULTS.md: the
machine's own RESULTS.md does not come back."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # "{out}" is replaced by the step's output folder
    timeout_s: int
    parse: Callable[[gr.StepRun], list[gr.Row]]
    label: str = ""  # the check's name in a SKIP row (default: the step's name)
    needs: tuple[str, ...] = ()  # optional packages: one missing makes the step a SKIP row
    # A step dying on ModuleNotFoundError for an optional package is a SKIP, not a FAIL
    # (pytest instead reports such modules itself, beside its own result).
    skip_on_missing: bool = True


def _bench(script: str, *args: str) -> list[str]:
    return [PY, str(HERE / script), *args, "--out", "{out}"]


def _host_rows(run: gr.StepRun) -> list[gr.Row]:
    return gr.parse_host(run) + gr.parse_launches(run)


def pytest_step(paths: Sequence[str] = ("tests",), timeout_s: int = 480,
                marker: str | None = "gpu") -> Step:
    """``pytest -m MARKER`` on ``paths``: one process (no xdist: a lent machine may lack it,
    and the GPU tests share one device), each test's line in the log as it finishes,
    collection errors not stopping the other modules, JUnit XML for the skip reasons."""
    select = ["-m", marker] if marker else []
    return Step("pytest", [PY, "-m", "pytest", *select, "-v", "-ra", "-o", "addopts=",
                           "-p", "no:cacheprovider", "--continue-on-collection-errors",
                           "--junitxml={out}/junit.xml", *paths],
                timeout_s, gr.parse_pytest, "pytest -m gpu", ("pytest",), skip_on_missing=False)


# The build phase's last word: _C imports, has its CUDA kernels, and they run on this device.
NATIVE_CHECK = """\
import torch
import specengine._C as C
import specengine.kernels
from specengine.native import check_native
check_native("cuda")
print(f"built for {','.join(C.cuda_archs)}, runs on {torch.cuda.get_device_name()}")
"""

PHASES: dict[str, list[Step]] = {
    "build": [
        Step("install", ["env", f"PYTHON={PY}", "bash",
                         str(ROOT / "scripts" / "install_offline.sh")],
             420, gr.parse_install, "offline install"),
        Step("native", [PY, "-c", NATIVE_CHECK], 60,
             lambda r: gr.parse_exit(r, "_C CUDA kernels", "present, built for this GPU")),
    ],
    "compile": [
        Step("kernels", [PY, str(ROOT / "scripts" / "compile_kernels.py"), "--jobs",
                         str(os.cpu_count() or 1), "--json", "{out}/compile_table.json"],
             500, gr.parse_compile, "Triton compile"),
    ],
    "tests": [pytest_step()],
    "parity": [
        Step("parity_hf", _bench("gpu_parity.py", "hf"), 240,
             lambda r: gr.parse_parity(r, "hf", "bf16 parity with HF", "argmax equal, "
                                       "logprobs within 2x HF bf16"),
             "bf16 parity with HF", ("transformers",)),
        Step("graphs", _bench("gpu_parity.py", "graphs"), 240,
             lambda r: gr.parse_parity(r, "graphs", "graphs on = off", "tokens identical"),
             "graphs on = off"),
    ],
    "micro": [
        Step("attention", _bench("bench_attention.py", "--batches", "1", "32", "128",
                                 "--contexts", "4096", "16384", "--chain-lens", "4",
                                 "--tree-sizes", "16", "--baselines", "sdpa", "--iters", "20",
                                 "--warmup", "3"), 180, gr.parse_attention, "attention"),
        Step("rejection", _bench("bench_rejection_sampling.py", "--batches", "1", "64", "256",
                                 "--ks", "3", "--vocabs", "151936", "--iters", "10"),
             150, gr.parse_rejection, "rejection sampling"),
        Step("kv_cache", _bench("bench_kv_cache.py", "--batches", "1", "64", "256",
                                "--new-tokens", "4", "--accepted", "3", "--iters", "50",
                                "--warmup", "5"), 120, gr.parse_kv_cache, "kv cache"),
        Step("moe", _bench("bench_moe.py", "--tokens", "1", "4", "16", "64", "256", "--iters",
                           "20"), 90, gr.parse_moe, "fused MoE"),
    ],
    "e2e": [
        Step("host", _bench("bench_host_overhead.py", "--steps", "10"), 150, _host_rows,
             "host overhead"),
        Step("step_cost", [PY, str(HERE / "bench_generate.py"), "--mode", "step-cost",
                           "--batches", "1", "8", "64", "--contexts", "2048", "--ks", "0", "3",
                           "--out", "{out}/generate.json"], 150, gr.parse_step_cost,
             "8B step cost"),
        Step("head_steps", _bench("bench_host_overhead.py", "--model", "llama-8b", "--batches",
                                  "1", "8", "64", "--drafts", "chain", "--steps", "6",
                                  "--warmup-steps", "2", "--prompt-len", "512", "--max-new",
                                  "64"), 210, gr.parse_head_steps, "8B + EAGLE-3 step"),
    ],
    "peers": [Step("flashinfer", _bench("peers_flashinfer.py"), 300, gr.parse_peers,
                   "FlashInfer peers", ("flashinfer",)),
              Step("hf_generate", [PY, str(HERE / "bench_generate.py"), "--peer-only",
                                   "--peer-batch", "16", "--peer-rounds", "5", "--max-tokens",
                                   "64", "--out", "{out}/generate.json"], 200,
                   gr.parse_hf_peer, "vs transformers generate", ("transformers",))],
}
STEPS = [step for steps in PHASES.values() for step in steps]


def select_steps(only: Sequence[str] | None, skip: Sequence[str] = ()) -> list[Step]:
    """The steps named by ``only`` (phases or single steps; all when None) less ``skip``."""
    phase_of = {s.name: phase for phase, steps in PHASES.items() for s in steps}
    for name in [*(only or ()), *skip]:
        if name not in PHASES and name not in phase_of:
            raise ValueError(f"unknown phase or step {name!r}: phases {', '.join(PHASES)}; "
                             f"steps {', '.join(phase_of)}")
    return [s for s in STEPS
            if (not only or s.name in only or phase_of[s.name] in only)
            and s.name not in skip and phase_of[s.name] not in skip]


def have(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported
        return False


def run_step(step: Step, out_root: Path, timeout_s: float, min_s: float = 10) -> gr.StepRun:
    """Runs ``step`` in a subprocess (its own process group, killed on timeout); not at all
    when less than ``min_s`` seconds (or its own timeout, if shorter) are left. Its output goes
    straight to ``out_root/NAME/log.txt`` as it is printed (unbuffered Python), not at the end."""
    out = out_root / step.name
    out.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{out}", str(out)) for a in step.argv]
    if timeout_s < min(min_s, step.timeout_s):
        return gr.StepRun(step.name, None, False, "out of time budget", out)
    t0 = time.perf_counter()
    log = out / "log.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    text = log.read_text(errors="replace")
    return gr.StepRun(step.name, rc, timed_out, text[-4000:], out, time.perf_counter() - t0)


def step_rows(step: Step, out_root: Path, timeout_s: float) -> tuple[gr.StepRun | None,
                                                                     list[gr.Row]]:
    """Runs ``step`` and parses it: a SKIP row with the reason, and no run, when one of its
    optional packages is missing; a SKIP row when it died importing one."""
    label = step.label or step.name
    absent = [m for m in step.needs if not have(m)]
    if absent:
        return None, [gr.Row(label, "skipped", f"{', '.join(absent)} not installed", "-",
                             "SKIP")]
    run = run_step(step, out_root, timeout_s)
    died_on = gr._last_line(run.output)
    if (step.skip_on_missing and run.returncode not in (0, None) and not run.timed_out
            and died_on.startswith("ModuleNotFoundError")
            and (pkg := gr.missing_optional(died_on))):
        return run, [gr.Row(label, "skipped", f"{pkg} not installed", "-", "SKIP")]
    return run, step.parse(run)


class RowSink:
    """``rows.jsonl`` and ``table.md`` in ``out``, each row appended, flushed and synced the
    moment it is known: a command stopped at its limit still leaves every finished row."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.table = out / "rows.jsonl", out / "table.md"
        if not self.table.exists():
            self._append(self.table, format_table([]) + "\n")

    @staticmethod
    def _append(path: Path, text: str) -> None:
        with path.open("a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def write(self, row: gr.Row) -> None:
        self._append(self.jsonl, json.dumps(asdict(row)) + "\n")
        self._append(self.table, _table_line(row) + "\n")


def run_steps(steps: Sequence[Step], out: Path, budget_s: float) -> list[gr.Row]:
    """Runs ``steps`` in order within ``budget_s`` seconds (a step the budget cannot fit is a
    'not run' SKIP), each row written to ``out`` (:class:`RowSink`) and printed as it comes."""
    sink = RowSink(out)
    start = time.perf_counter()
    rows: list[gr.Row] = []
    for step in steps:
        left = budget_s - (time.perf_counter() - start)
        print(f"[{step.name}] running, at most {min(step.timeout_s, left):.0f} s, log "
              f"{out / step.name / 'log.txt'}", flush=True)
        run, new = step_rows(step, out, min(step.timeout_s, left))
        for row in new:
            sink.write(row)
            print("  " + _table_line(row), flush=True)
        rows += new
        if run is not None:
            print(f"[{step.name}] {run.seconds:.0f} s, exit {run.returncode}", flush=True)
    return rows


def _table_line(r: gr.Row) -> str:
    cells = (c.replace("|", "/") for c in (r.check, r.result, r.figure, r.target, r.verdict))
    return "| " + " | ".join(cells) + " |"


def format_table(rows: list[gr.Row]) -> str:
    """Markdown table of the rows (printed and appended to RESULTS.md)."""
    lines = ["| check | result | figure | target | verdict |", "|---|---|---|---|---|"]
    return "\n".join(lines + [_table_line(r) for r in rows])


def results_section(rows: list[gr.Row], meta: dict[str, str]) -> str:
    """The RESULTS.md section of one GPU check (same layout as the file's other sections)."""
    counts = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "FAIL", "SKIP", "INFO")}
    return (f"\n## GPU check (`gpu_check.py`), {meta['date']}\n\n"
            f"**Run.** {meta['date']}, {meta['device']}, torch {meta['torch']}, "
            f"triton {meta['triton']}, commit {meta['commit']}, {meta['seconds']} s in all:\n\n"
            f"    {meta['command']}\n\n"
            f"**Result.** {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, "
            f"{counts['INFO']} INFO (figures without a target).\n\n{format_table(rows)}\n")


def append_results(path: Path, section: str) -> None:
    """Appends ``section`` to ``path``, leaving what is there untouched."""
    text = path.read_text() if path.exists() else "# Measured results\n"
    sep = "" if text.endswith("\n") else "\n"
    path.write_text(text + sep + section)


def _meta(command: str, seconds: float) -> dict[str, str]:
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "none"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton_v,
                commit=commit, command=command, seconds=f"{seconds:.0f}")


def main(argv: list[str] | None = None) -> int:
    phases = ", ".join(f"{name} ({', '.join(s.name for s in steps)})"
                       for name, steps in PHASES.items())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"phases (steps): {phases}\n\n{VISIT}")
    p.add_argument("--budget-s", type=float, default=580, help="total wall-clock budget")
    p.add_argument("--only", nargs="+", default=None, metavar="PHASE|STEP",
                   help="run only these phases or steps")
    p.add_argument("--skip", nargs="+", default=[], metavar="PHASE|STEP",
                   help="phases or steps to leave out")
    p.add_argument("--out", type=Path, default=HERE / "out" / "gpu_check",
                   help="rows (rows.jsonl, table.md), logs and JSON of every step; on a lent "
                        "machine: \"$OUT\"")
    p.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args(argv)
    try:
        steps = select_steps(args.only, args.skip)
    except ValueError as e:
        p.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible: nothing to check (run it on a lent GPU)",
              file=sys.stderr)
        return 2
    command = "python benchmarks/gpu_check.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta.json").write_text(json.dumps(_meta(command, 0), indent=1))
    rows = run_steps(steps, args.out, args.budget_s)
    meta = _meta(command, time.perf_counter() - start)
    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}")
    print(format_table(rows))
    section = results_section(rows, meta)
    (args.out / "results_section.md").write_text(section)
    if not args.no_append:
        append_results(RESULTS, section)
        print(f"appended to {RESULTS} (and written to {args.out / 'results_section.md'})")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
