"""One command that validates a lent GPU (about 10 minutes on one H100); run it first.

Sub-steps, each a subprocess with its own timeout inside an overall budget (one failure, hang
or crash does not stop the rest; a step the budget cannot fit is reported as not run: run it
afterwards with ``--only NAME``, e.g. under a 10-minute command limit):

1. ``pytest -m gpu`` (every GPU-marked test must pass);
2. bf16 parity with Hugging Face, and graphs-on = graphs-off tokens (``gpu_parity.py``);
3. the host overhead of a decode step, bundled pair (``bench_host_overhead.py``);
4. the kernel microbenchmarks at 8B shapes (``bench_attention.py``, ``bench_rejection_sampling.py``,
   ``bench_kv_cache.py``);
5. the 8B step cost with dummy weights: target verify k=3 vs decode (``bench_generate.py
   --mode step-cost``) and whole steps with an EAGLE-3-shaped head (``bench_host_overhead.py
   --model llama-8b``), batch 1 / 8 / 64;
6. FlashInfer side by side (``peers_flashinfer.py``; skipped without FlashInfer).

It prints one table (check, result, figure, target, PASS/FAIL/SKIP/INFO) and appends it with
the date, device, torch / triton versions, commit and command to ``benchmarks/RESULTS.md``
(``--no-append`` to skip). Logs and JSON of every sub-step: ``--out`` (default
``benchmarks/out/gpu_check``). Without CUDA it exits with code 2. Exit code 1 if any FAIL.

Usage::

    python benchmarks/gpu_check.py [--budget-s 580] [--only pytest host ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_check_rows as gr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
PY = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # "{out}" is replaced by the step's output folder
    timeout_s: int
    parse: Callable[[gr.StepRun], list[gr.Row]]


def _bench(script: str, *args: str) -> list[str]:
    return [PY, str(HERE / script), *args, "--out", "{out}"]


def _host_rows(run: gr.StepRun) -> list[gr.Row]:
    return gr.parse_host(run) + gr.parse_launches(run)


STEPS = [
    Step("pytest", [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
         150, gr.parse_pytest),
    Step("parity_hf", _bench("gpu_parity.py", "hf"), 90,
         lambda r: gr.parse_parity(r, "hf", "bf16 parity with HF", "argmax equal, logprobs "
                                   "within 2x HF bf16")),
    Step("graphs", _bench("gpu_parity.py", "graphs"), 120,
         lambda r: gr.parse_parity(r, "graphs", "graphs on = off", "tokens identical")),
    Step("host", _bench("bench_host_overhead.py", "--steps", "10"), 120, _host_rows),
    Step("attention", _bench("bench_attention.py", "--batches", "1", "32", "128", "--contexts",
                             "4096", "16384", "--chain-lens", "4", "--tree-sizes", "16",
                             "--baselines", "sdpa", "--iters", "20", "--warmup", "3"),
         90, gr.parse_attention),
    Step("rejection", _bench("bench_rejection_sampling.py", "--batches", "1", "64", "256",
                             "--ks", "3", "--vocabs", "151936", "--iters", "10"),
         60, gr.parse_rejection),
    Step("kv_cache", _bench("bench_kv_cache.py", "--batches", "1", "64", "256", "--new-tokens",
                            "4", "--accepted", "3", "--iters", "50", "--warmup", "5"),
         45, gr.parse_kv_cache),
    Step("step_cost", [PY, str(HERE / "bench_generate.py"), "--mode", "step-cost",
                       "--batches", "1", "8", "64", "--contexts", "2048", "--ks", "0", "3",
                       "--out", "{out}/generate.json"], 90, gr.parse_step_cost),
    Step("head_steps", _bench("bench_host_overhead.py", "--model", "llama-8b", "--batches", "1",
                              "8", "64", "--drafts", "chain", "--steps", "6",
                              "--warmup-steps", "2", "--prompt-len", "512", "--max-new", "64"),
         120, gr.parse_head_steps),
    Step("peers", _bench("peers_flashinfer.py"), 90, gr.parse_peers),
]


def run_step(step: Step, out_root: Path, timeout_s: float, min_s: float = 10) -> gr.StepRun:
    """Runs ``step`` in a subprocess (its own process group, killed on timeout); not at all
    when less than ``min_s`` seconds are left."""
    out = out_root / step.name
    out.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{out}", str(out)) for a in step.argv]
    if timeout_s < min_s:
        return gr.StepRun(step.name, None, False, "out of time budget", out)
    t0 = time.perf_counter()
    log = out / "log.txt"
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    text = log.read_text(errors="replace")
    return gr.StepRun(step.name, rc, timed_out, text[-4000:], out, time.perf_counter() - t0)


def format_table(rows: list[gr.Row]) -> str:
    """Markdown table of the rows (printed and appended to RESULTS.md)."""
    lines = ["| check | result | figure | target | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        cells = (c.replace("|", "/") for c in (r.check, r.result, r.figure, r.target, r.verdict))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="steps: " + ", ".join(s.name for s in STEPS))
    p.add_argument("--budget-s", type=float, default=580, help="total wall-clock budget")
    p.add_argument("--only", nargs="+", default=None, help="run only these steps")
    p.add_argument("--skip", nargs="+", default=[], help="steps to leave out")
    p.add_argument("--out", type=Path, default=HERE / "out" / "gpu_check")
    p.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible: nothing to check (run it on a lent GPU)",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows: list[gr.Row] = []
    for step in STEPS:
        if (args.only and step.name not in args.only) or step.name in args.skip:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        run = run_step(step, args.out, min(step.timeout_s, left))
        new = step.parse(run)
        rows += new
        print(f"[{step.name}] {run.seconds:.0f} s, exit {run.returncode}: "
              + "; ".join(f"{r.verdict} {r.check}" for r in new), flush=True)
    command = "python benchmarks/gpu_check.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    meta = _meta(command, time.perf_counter() - start)
    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}")
    print(format_table(rows))
    if not args.no_append:
        append_results(RESULTS, results_section(rows, meta))
        print(f"appended to {RESULTS}")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
