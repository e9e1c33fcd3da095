"""The GPU check's pure logic: sub-step outputs → table rows with PASS/FAIL against targets.

Every parser takes a finished :class:`StepRun` (exit code, output tail, the folder its JSON
went to) and returns :class:`Row` s. A sub-step that failed before writing its JSON gives one
FAIL row carrying the exit code or timeout and the last line of its output. Verdicts: PASS /
FAIL against a target; SKIP when the check could not apply (no FlashInfer, no graph keyword, an
optional package missing: :data:`OPTIONAL_PACKAGES`); INFO for figures without a target
(baselines, peers).
"""

from __future__ import annotations

import json
import re
import statistics
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from host_overhead_report import host_target_us

# Packages a lent GPU machine may lack (unless carried in as wheels): a check or test that
# cannot run without one is a SKIP with that reason, never a FAIL.
OPTIONAL_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "ray", "transformers", "scipy",
                     "flashinfer", "matplotlib", "schemathesis", "pytest")
_NO_MODULE = re.compile(r"No module named '([A-Za-z0-9_.]+)'")


def missing_optional(text: str) -> str | None:
    """The optional package whose absence ``text`` (an error or a skip reason) reports."""
    for name in _NO_MODULE.findall(text):
        top = name.partition(".")[0]
        if top in OPTIONAL_PACKAGES:
            return top
    return None


@dataclass(frozen=True)
class StepRun:
    name: str
    returncode: int | None  # None: not run (out of time budget)
    timed_out: bool
    output: str  # tail of stdout + stderr
    out_dir: Path
    seconds: float = 0.0


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    figure: str
    target: str
    verdict: str  # PASS, FAIL, SKIP, INFO


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:120]


def failure_rows(run: StepRun, check: str) -> list[Row]:
    """One row saying why the sub-step produced nothing to read."""
    if run.returncode is None:
        return [Row(check, "not run", "-", "-", "SKIP")]
    why = f"timed out after {run.seconds:.0f} s" if run.timed_out else f"exit {run.returncode}"
    return [Row(check, why, _last_line(run.output) or "-", "runs", "FAIL")]


def _load(run: StepRun, name: str) -> dict | None:
    path = run.out_dir / f"{name}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
_SUMMARY_SKIP = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.*)$")
_SUMMARY_FAIL = re.compile(r"^(FAILED|ERROR) (\S+?)(?:::\S*)? - (.*)$")


def _module_of(dotted: str) -> str:
    """``tests.test_server.TestX`` (a JUnit class name) -> ``tests/test_server.py``. The
    module is the last ``test_*`` part: the folders before it depend on where pytest put its
    rootdir (a temporary folder may itself be named ``test_...``), so only a ``tests`` parent
    is kept."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].startswith("test_"):
            module = parts[i] + ".py"
            return f"tests/{module}" if i > 0 and parts[i - 1] == "tests" else module
    return dotted


def missing_package_outcomes(run: StepRun) -> list[tuple[str, str, str]]:
    """``(module, package, outcome)`` of each test or module that was skipped, failed or
    errored only because an optional package is missing: from the run's JUnit XML
    (``junit.xml`` in its folder) when it wrote one, else from pytest's short summary."""
    out = []
    junit = run.out_dir / "junit.xml"
    if junit.is_file():
        try:
            cases = list(ET.parse(junit).getroot().iter("testcase"))
        except ET.ParseError:
            cases = []
        for case in cases:
            for child in case:
                if child.tag not in ("skipped", "failure", "error"):
                    continue
                pkg = missing_optional(f"{child.get('message', '')}\n{child.text or ''}")
                if pkg:
                    # A module skipped at collection has no class name, only its own name.
                    module = _module_of(case.get("classname") or case.get("name", "?"))
                    outcome = {"skipped": "skipped", "failure": "failed"}.get(child.tag, "error")
                    out.append((module, pkg, outcome))
                break
        return out
    for line in run.output.splitlines():
        if m := _SUMMARY_SKIP.match(line.strip()):
            if pkg := missing_optional(m.group(3)):
                out += [(m.group(2), pkg, "skipped")] * int(m.group(1))
        elif (m := _SUMMARY_FAIL.match(line.strip())) and (pkg := missing_optional(m.group(3))):
            out.append((m.group(2), pkg, "failed" if m.group(1) == "FAILED" else "error"))
    return out


def parse_pytest(run: StepRun, label: str = "pytest -m gpu") -> list[Row]:
    """``pytest -m gpu``: every selected test must pass; a skip means the GPU was not used.
    Tests and modules skipped (or failing to import) for a missing optional package are not
    counted there: they get a SKIP row each, with the package."""
    summary = [ln for ln in run.output.splitlines() if re.search(r"\d+ (passed|failed|error|"
                                                                 r"skipped|deselected)", ln)]
    if run.returncode is None or (not summary and run.returncode != 0):
        return failure_rows(run, label)
    counts: dict[str, int] = {}
    for n, what in _PYTEST_COUNT.findall(summary[-1] if summary else ""):
        counts["error" if what.startswith("error") else what] = int(n)
    missing = missing_package_outcomes(run)
    by_outcome = Counter(outcome for _, _, outcome in missing)
    passed = counts.get("passed", 0)
    failed = max(0, counts.get("failed", 0) + counts.get("error", 0) - by_outcome["failed"]
                 - by_outcome["error"])
    skipped = max(0, counts.get("skipped", 0) - by_outcome["skipped"])
    ok = passed > 0 and failed == 0 and skipped == 0 and not run.timed_out
    fig = f"{passed} passed, {failed} failed, {skipped} skipped"
    if missing:
        fig += f" (+{len(missing)} for missing packages)"
    rows = [Row(label, "timed out" if run.timed_out else fig.split(",")[0], fig,
                "all pass, none skipped", "PASS" if ok else "FAIL")]
    for (module, pkg), n in sorted(Counter((m, p) for m, p, _ in missing).items()):
        rows.append(Row(f"tests in {module}", f"{n} skipped" if n > 1 else "skipped",
                        f"{pkg} not installed", "-", "SKIP"))
    return rows


def parse_parity(run: StepRun, check: str, label: str, target: str) -> list[Row]:
    """``gpu_parity.py hf|graphs``: its own pass/fail (None = skipped)."""
    data = _load(run, f"gpu_parity_{check}")
    if data is None:
        return failure_rows(run, label)
    passed = data.get("passed")
    verdict = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
    result = {"PASS": "equal", "FAIL": "differs", "SKIP": "skipped"}[verdict]
    return [Row(label, result, str(data.get("figure", "-")), target, verdict)]


def parse_attention(run: StepRun, min_context: int = 4096, verify_len: int = 4) -> list[Row]:
    """``bench_attention.py``: decode bandwidth at context >= ``min_context``, a
    ``verify_len``-token chain verify over a decode at the same batch and context."""
    data = _load(run, "attention")
    if data is None:
        return failure_rows(run, "attention")
    rows = [r for r in data["rows"] if r.get("triton_ms")]
    peak = data.get("peak_gbps")
    out = []
    dec = [r for r in rows if r["mode"] == "decode" and r["context"] >= min_context
           and r.get("gbps")]
    if dec and peak:
        worst = min(dec, key=lambda r: r["gbps"])
        frac = worst["gbps"] / peak
        out.append(Row(f"attention decode, ctx >= {min_context}", f"{frac:.0%} of peak (worst)",
                       f"{worst['gbps']:.0f} GB/s at B={worst['batch']} ctx={worst['context']}",
                       ">= 85% of HBM peak", "PASS" if frac >= 0.85 else "FAIL"))
    decode = {(r["batch"], r["context"]): r["triton_ms"] for r in rows if r["mode"] == "decode"}
    ratios = [(r["triton_ms"] / decode[(r["batch"], r["context"])], r) for r in rows
              if r["mode"] == "chain" and r["q_len"] == verify_len
              and (r["batch"], r["context"]) in decode]
    if ratios:
        worst_ratio, r = max(ratios, key=lambda x: x[0])
        out.append(Row(f"{verify_len}-token verify / decode", f"{worst_ratio:.2f}x (worst)",
                       f"B={r['batch']} ctx={r['context']}", "<= 1.1x",
                       "PASS" if worst_ratio <= 1.1 else "FAIL"))
    for base in ("sdpa", "flex"):
        sp = [r[f"{base}_ms"] / r["triton_ms"] for r in rows if r.get(f"{base}_ms")]
        if sp:
            out.append(Row(f"attention vs {base}", f"{statistics.median(sp):.2f}x faster (median)",
                           f"{min(sp):.2f}x .. {max(sp):.2f}x over {len(sp)} configs",
                           "baseline", "INFO"))
    return out or failure_rows(run, "attention")


def parse_rejection(run: StepRun, vocab: int = 151936) -> list[Row]:
    """``bench_rejection_sampling.py``: bandwidth at ``vocab`` and the largest batch."""
    data = _load(run, "rejection_sampling")
    if data is None:
        return failure_rows(run, "rejection sampling")
    rows = [r for r in data["rows"] if r["vocab"] == vocab and r.get("gbps")]
    peak = data.get("peak_gbps")
    out = []
    if rows and peak:
        big = max(r["batch"] for r in rows)
        sel = [r for r in rows if r["batch"] == big and r["top_p"] == 1.0]
        worst = min(sel or rows, key=lambda r: r["gbps"])
        frac = worst["gbps"] / peak
        out.append(Row(f"rejection sampling, V={vocab}", f"{frac:.0%} of peak (worst)",
                       f"{worst['gbps']:.0f} GB/s at B={worst['batch']} k={worst['k']}",
                       ">= 80% of HBM peak", "PASS" if frac >= 0.8 else "FAIL"))
    # top-p's cost: the same shape with top_p < 1 over top_p = 1 (the threshold search's passes)
    plain = {(r["batch"], r["k"], r["draft_probs"]): r["ms"] for r in rows if r["top_p"] == 1.0}
    cost = [(r["ms"] / plain[key], r) for r in rows if r["top_p"] < 1.0
            and plain.get(key := (r["batch"], r["k"], r["draft_probs"]))]
    if cost:
        ratio, r = max(cost, key=lambda c: c[0])
        cut = f", cut alone {r['cut_ms']:.3f} ms" if "cut_ms" in r else ""
        out.append(Row(f"top_p={r['top_p']} cost, V={vocab}", f"{ratio:.2f}x top_p=1 (worst)",
                       f"{r['ms']:.3f} ms at B={r['batch']} k={r['k']}{cut}", "report",
                       "INFO"))
    sp = [r["torch_ms"] / r["ms"] for r in data["rows"] if r.get("ms")]
    if sp:
        out.append(Row("sampling vs torch", f"{statistics.median(sp):.1f}x faster (median)",
                       f"{min(sp):.1f}x .. {max(sp):.1f}x", "baseline", "INFO"))
    return out or failure_rows(run, "rejection sampling")


def parse_kv_cache(run: StepRun) -> list[Row]:
    """``bench_kv_cache.py``: time over the HBM floor of the kernels at the largest batch."""
    data = _load(run, "kv_cache")
    if data is None:
        return failure_rows(run, "kv cache")
    out = []
    for op in ("reshape_and_cache", "compact_kv"):
        sel = [r for r in data["rows"] if r["op"] == op and r["impl"] == "kernel"
               and r.get("ratio")]
        if sel:
            big = max(r["batch"] for r in sel)
            worst = max((r for r in sel if r["batch"] == big), key=lambda r: r["ratio"])
            out.append(Row(op, f"{worst['ratio']:.1f}x the floor", f"{worst['time_us']:.1f} us "
                           f"at B={big}", "report (floor = bytes / peak)", "INFO"))
    return out or failure_rows(run, "kv cache")


def parse_host(run: StepRun, label: str = "host") -> list[Row]:
    """``bench_host_overhead.py``: host time per step vs 300 us + 2 us/seq; launches."""
    data = _load(run, "host_overhead")
    if data is None:
        return failure_rows(run, f"{label} overhead")
    out = []
    for r in data["rows"]:
        name = (f"{label} B={r['batch']} k={r['k']} {r['draft']} "
                f"graphs={'-' if r['graphs'] is None else 'on' if r['graphs'] else 'off'}")
        if r.get("host_us") is None:
            out.append(Row(name, "error", str(r.get("error", "-"))[:80], "runs", "FAIL"))
            continue
        target = host_target_us(r["batch"])
        ok = r["host_us"] <= target
        launches = (f"{r['launches']:.0f} launches" + (
            f" ({r['launches_per_layer']:.1f}/layer)" if r.get("launches_per_layer") else "")
            + f", {r.get('graph_replays', 0):.0f} replays, {r.get('syncs', 0):.0f} syncs")
        out.append(Row(name, f"host {r['host_us']:.0f} us", launches,
                       f"<= {target:.0f} us", "PASS" if ok else "FAIL"))
    return out or failure_rows(run, f"{label} overhead")


def parse_launches(run: StepRun) -> list[Row]:
    """Launch targets from the host-overhead JSON: eager <= 12 per layer; graphed = replays."""
    data = _load(run, "host_overhead")
    if data is None:
        return []
    out = []
    for graphs in (False, True, None):
        sel = [r for r in data["rows"] if r.get("graphs") == graphs and "launches" in r]
        if graphs and any(r.get("graph_replays") for r in sel):
            extra = max(r["launches"] - r.get("copies", 0) for r in sel)
            out.append(Row("graphed step launches", f"{extra:.0f} kernels outside graphs",
                           f"max over {len(sel)} configs", "launches = graph replays",
                           "PASS" if extra == 0 else "FAIL"))
        elif sel and any(r.get("launches_per_layer") for r in sel):
            worst = max(r["launches_per_layer"] or 0 for r in sel)
            out.append(Row(f"eager launches per layer (graphs={graphs})", f"{worst:.1f}",
                           f"max over {len(sel)} configs", "<= 12",
                           "PASS" if worst <= 12 else "FAIL"))
    return out


def parse_step_cost(run: StepRun) -> list[Row]:
    """``bench_generate.py --mode step-cost``: verify(k) / decode at 8B shapes."""
    path = run.out_dir / "generate.json"
    if not path.is_file():
        return failure_rows(run, "8B step cost")
    rows = json.loads(path.read_text())["rows"]
    return [Row(f"8B verify k={r['k']} B={r['batch']} ctx={r['context']}",
                f"{r['cost_vs_decode']:.2f}x decode", f"{r['verify_s'] * 1e3:.2f} ms",
                "report", "INFO") for r in rows if r["k"] > 0 and r.get("cost_vs_decode")]


def parse_head_steps(run: StepRun) -> list[Row]:
    """8B target + EAGLE-3 head through the whole step (host-overhead JSON, dummy weights):
    step wall time at k=3 over k=0, per batch and graph setting."""
    data = _load(run, "host_overhead")
    if data is None:
        return failure_rows(run, "8B + EAGLE-3 step")
    by = {(r["batch"], r["graphs"], r["k"]): r for r in data["rows"] if r.get("wall_us")}
    out = []
    for (batch, graphs, k), r in sorted(by.items(), key=lambda kv: str(kv[0])):
        base = by.get((batch, graphs, 0))
        if k == 0 or base is None:
            continue
        out.append(Row(f"8B+EAGLE-3 step k={k} B={batch} graphs={graphs}",
                       f"{r['wall_us'] / base['wall_us']:.2f}x the k=0 step",
                       f"{r['wall_us'] / 1e3:.2f} ms vs {base['wall_us'] / 1e3:.2f} ms",
                       "report", "INFO"))
    return out or failure_rows(run, "8B + EAGLE-3 step")


def parse_peers(run: StepRun) -> list[Row]:
    """``peers_flashinfer.py``: our time / FlashInfer's per row (SKIP without FlashInfer)."""
    data = _load(run, "peers_flashinfer")
    if data is None:
        return failure_rows(run, "FlashInfer peers")
    if data.get("skipped"):
        return [Row("FlashInfer peers", "skipped", data["skipped"][:80], "-", "SKIP")]
    out = []
    for r in data["rows"]:
        name = f"vs FlashInfer: {r['check']} B={r['batch']}"
        if "error" in r:
            out.append(Row(name, "error", r["error"][:80], "ours / theirs", "INFO"))
            continue
        out.append(Row(name, f"{r['ours_ms'] / r['theirs_ms']:.2f}x their time",
                       f"{r['ours_ms']:.4f} vs {r['theirs_ms']:.4f} ms", "ours / theirs",
                       "INFO"))
    return out


def parse_hf_peer(run: StepRun) -> list[Row]:
    """``bench_generate.py --peer-only``: each configuration's tokens/s over transformers'
    batched ``generate`` (reported), and its greedy outputs against transformers' (identical
    token ids, else FAIL with the first difference)."""
    data = _load(run, "generate")
    if data is None:
        return failure_rows(run, "vs transformers generate")
    out = []
    for r in data["rows"]:
        if r.get("mode") != "peer-hf":
            continue
        step = f", {r['tokens_per_step']:.2f} tok/step" if r.get("tokens_per_step") else ""
        out.append(Row(f"vs transformers: {r['config']} B={r['batch']}",
                       f"{r['vs_transformers']:.2f}x transformers",
                       f"{r['tokens_per_s']:.0f} tok/s{step}; {r['outputs']}"[:120],
                       "greedy ids identical", "PASS" if r["identical"] else "FAIL"))
    return out or failure_rows(run, "vs transformers generate")


def parse_moe(run: StepRun) -> list[Row]:
    """``bench_moe.py``: the fused MoE kernel against the per-expert PyTorch loop (PASS when
    faster at every size), its time over the HBM floor at 1-token decode, and the experts a
    pass touches (a verify of k+1 tokens per sequence reads more expert weights)."""
    data = _load(run, "moe")
    if data is None:
        return failure_rows(run, "fused MoE")
    rows = data["rows"]
    out = []
    by = {(r["model"], r["tokens"], r["impl"]): r for r in rows}
    pairs = [(by[(m, t, "loop")]["time_us"] / r["time_us"], m, t) for (m, t, impl), r in
             by.items() if impl == "fused" and (m, t, "loop") in by]
    if pairs:
        worst, m, t = min(pairs)
        out.append(Row("fused MoE vs per-expert loop", f"{worst:.2f}x faster (worst)",
                       f"{m} T={t}; median {statistics.median(p[0] for p in pairs):.2f}x",
                       ">= 1x at every size", "PASS" if worst >= 1.0 else "FAIL"))
        for r in rows:
            if r["impl"] == "fused" and r["tokens"] == 1 and r.get("ratio"):
                out.append(Row(f"fused MoE decode {r['model']}", f"{r['ratio']:.1f}x the floor",
                               f"{r['time_us']:.1f} us, {r['distinct_experts']} experts",
                               "report (floor = touched experts' bytes / peak)", "INFO"))
    else:
        out.append(Row("fused MoE vs per-expert loop", "not timed", "needs CUDA", "-", "SKIP"))
    for model in sorted({r["model"] for r in rows}):
        touched = {r["tokens"]: r["distinct_experts"] for r in rows if r["model"] == model}
        out.append(Row(f"MoE experts touched {model}", " / ".join(
            f"T={t}: {n}" for t, n in sorted(touched.items())), "random routing",
            "report", "INFO"))
    return out


def _log_text(run: StepRun) -> str:
    """The step's whole log (the output tail may have lost its first lines)."""
    log = run.out_dir / "log.txt"
    return log.read_text(errors="replace") if log.is_file() else run.output


def parse_exit(run: StepRun, label: str, target: str = "runs") -> list[Row]:
    """A step judged by its exit code alone; its last output line is the figure."""
    if run.returncode == 0 and not run.timed_out:
        return [Row(label, "ok", _last_line(run.output) or "-", target, "PASS")]
    return failure_rows(run, label)


_OPTIONAL_LINE = re.compile(r"^optional: (\S+) absent: (.*)$")
_MISSING_LINE = re.compile(r"^missing: (\S+)")


def parse_install(run: StepRun) -> list[Row]:
    """``scripts/install_offline.sh``: installed or not (naming the missing requirements),
    plus a SKIP row per absent optional package saying what its absence skips."""
    text = _log_text(run)
    lines = [ln.strip() for ln in text.splitlines()]
    missing = [m.group(1) for ln in lines if (m := _MISSING_LINE.match(ln))]
    if missing and run.returncode not in (0, None):
        rows = [Row("offline install", "missing requirements", ", ".join(missing)[:120],
                    "all present", "FAIL")]
    else:
        rows = parse_exit(run, "offline install", "builds, installs, imports")
    for ln in lines:
        if m := _OPTIONAL_LINE.match(ln):
            rows.append(Row(f"optional {m.group(1)}", "absent", m.group(2)[:120], "-", "SKIP"))
    return rows


def parse_compile(run: StepRun) -> list[Row]:
    """``scripts/compile_kernels.py``: per target, every kernel variant compiles without
    spilling registers (its JSON: rows and errors)."""
    data = _load(run, "compile_table")
    if data is None:
        return failure_rows(run, "Triton compile")
    out = []
    for target in sorted({r["target"] for r in data["rows"]}):
        sel = [r for r in data["rows"] if r["target"] == target]
        bad = [r for r in sel if "error" in r or r.get("spill_stores") or r.get("spill_loads")]
        regs = max((r.get("registers", 0) for r in sel), default=0)
        out.append(Row(f"Triton compile {target}", f"{len(sel) - len(bad)}/{len(sel)} clean",
                       f"max {regs} registers, {len(bad)} failing or spilling",
                       "all compile, no spills", "FAIL" if bad else "PASS"))
    if data.get("errors") and not any(r.verdict == "FAIL" for r in out):
        out.append(Row("Triton compile", "errors", str(data["errors"][0])[:120],
                       "all compile, no spills", "FAIL"))
    return out or failure_rows(run, "Triton compile")
