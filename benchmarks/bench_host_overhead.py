"""Host overhead of one decode step: the engine's own host time, launches and syncs per step.

For every configuration (kernel backend × CUDA graphs × batch × k × chain/tree) it runs
``generate`` twice on the same prompts (greedy, EOS ignored) and times each engine step
(``EngineCore.step``) that runs a decode / verify step: scheduling (KV growth), staging,
drafting and verify glue, postprocessing and outputs, as the issue counts host time (steps
that run a prefill are not counted):

* pass 1 (timing): cheap wrappers only (blocking syncs, compute regions, Triton / ``_C``
  launches, graph replays; ``step_profiler.py``). On CUDA the host time of a step is its wall
  time minus the time blocked in the device→host syncs it makes (the GPU works
  asynchronously; ``torch.cuda.synchronize`` after the step, CUDA events for the device span).
  On CPU the device work runs inline, so the host time is the step's time minus the time
  inside compute regions: module calls (target, drafter head or LM), the rejection sampler,
  Triton and ``_C`` kernels. Both are taken as this thread's CPU time (``time.thread_time``;
  run with ``OMP_NUM_THREADS=1`` so the ops run on it), so time slices lost to other jobs on a
  shared machine are not counted; the wall-clock version is reported as ``host_wall_us``.
  Tensor ops the engine issues outside modules count as host time (on a GPU each is a launch
  the host pays for).
* pass 2 (counting, same prompts, same steps): a dispatch mode counts every aten operator
  that would launch a kernel, plus Triton and ``_C`` kernel calls, per step and per target
  decoder layer. Its own cost makes this pass slow, so it gives counts, never times.

Launches = aten kernels + host↔device copies + Triton launches + ``_C`` kernels, issued by
the host outside CUDA-graph replays. Targets (issue 11), printed with PASS/MISS:
host ≤ 300 µs + 2 µs × batch per step (stretch 100 µs + 0.5 µs × batch); eager launches per
target decoder layer ≤ 12; with graphs, launches per step = graph replays (no eager kernels).

On CPU the Triton backend runs under the interpreter (slow: it is limited to
``--triton-max-batch`` and ``--triton-steps``); its launch counts are the GPU code path's. The
torch backend's host time is the CPU default's. Both are reported, with the backend named.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_host_overhead.py            # bundled pair
    python benchmarks/bench_host_overhead.py --model dummy --layers 8 --hidden 512
    python benchmarks/bench_host_overhead.py --model llama-8b --batches 1 8 64   # GPU
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not any(a in ("-h", "--help") for a in sys.argv):
    try:
        import torch as _t

        if not _t.cuda.is_available():  # must precede any kernel definition
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        pass

import benchlib  # noqa: E402
import torch  # noqa: E402
from host_models import build_engine, graphs_supported, prompts_for  # noqa: E402
from host_overhead_report import plot, print_table, verdicts  # noqa: E402
from step_profiler import StepProfiler  # noqa: E402

TREE = [(0,), (1,), (0, 0), (0, 0, 0)]
PHASES = ("draft", "verify", "bookkeeping")  # StepTimes fields (verify includes sampling)


class _Done(Exception):
    """Raised from the wrapped step once enough steps were measured (ends ``generate``)."""


def engine_commit() -> str:
    """Short hash of the checkout ``specengine`` is imported from, ``+dirty`` when its
    ``specengine/`` or ``kernels/`` differ from it; ``?`` outside a git checkout."""
    import specengine

    root = Path(specengine.__file__).resolve().parent.parent

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], capture_output=True, text=True, cwd=root)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "?"
    return head + ("+dirty" if git("status", "--porcelain", "--", "specengine", "kernels")
                   else "")


def run_pass(engine, prompts: list, k: int, tree, steps: int, counting: bool) -> list[dict]:
    """``steps`` decode steps of one ``generate``; per step: wall, batch and the counts."""
    from specengine import SamplingParams

    cuda = engine.device.type == "cuda"
    # The timing pass wraps only what its host time needs: compute regions, and on CUDA the
    # syncs (their blocked time is taken out); syncs are counted by the counting pass.
    prof = StepProfiler(dispatch=counting, regions=not counting, syncs=counting or cuda)
    records: list[dict] = []
    core = engine.core
    orig_step, orig_decode = core.step, core.decode_step
    layers = engine.model.model.layers
    seen: dict = {}  # what the decode step of the current engine step saw

    def decode(seqs, k_, tree_, times, *rest):  # kept minimal: it runs inside the timing
        seen["batch"], seen["times"] = len(seqs), times
        orig_decode(seqs, k_, tree_, times, *rest)

    def step(*args, **kwargs):
        if len(records) >= steps:
            core.abort_all()  # frees every request: the next pass starts clean
            raise _Done
        seen.clear()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        prof.reset()
        prof.layers.launches = prof.layers.calls = 0
        before = getattr(core.stats, "times", None)  # the run's StepTimes (phases so far)
        phases0 = {p: getattr(before, p, 0.0) for p in PHASES}
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig_step(*args, **kwargs)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        c = prof.reset()
        if "batch" not in seen:  # a prefill step
            return out
        times = seen["times"]
        if times is not before:  # the step began a new run: its phases start at zero
            phases0 = dict.fromkeys(PHASES, 0.0)
        phases = {p: getattr(times, p, 0.0) - phases0[p] for p in PHASES}
        rec = dict(phases=phases, batch=seen["batch"], wall_s=wall, cpu_s=cpu,
                   counts=c, layer_calls=prof.layers.calls,
                   layer_launches=prof.layers.launches)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            rec["device_s"] = start.elapsed_time(end) / 1e3
        records.append(rec)
        return out

    max_new = max(1, engine.config.max_model_len - max(len(p) for p in prompts) - 8)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    core.decode_step, core.step = decode, step
    try:
        with prof:
            if counting:
                prof.layers.attach(layers)
            engine.generate(prompts, k=k, sampling=params, tree=tree)
    except _Done:
        pass
    finally:
        del core.decode_step, core.step  # back to the class's methods
    return records


def measure(engine, args: argparse.Namespace, batch: int, k: int, kind: str,
            steps: int) -> dict:
    tree = TREE if kind == "tree" else None
    prompts = prompts_for(engine, args, batch)
    total = steps + args.warmup_steps
    timed = run_pass(engine, prompts, k, tree, total, counting=False)[args.warmup_steps:]
    counted = run_pass(engine, prompts, k, tree, total, counting=True)[args.warmup_steps:]
    n = min(len(timed), len(counted))
    if n == 0:
        return dict(error="no decode step ran")
    cuda = engine.device.type == "cuda"
    host, host_wall = [], []
    for a in timed[:n]:
        c = a["counts"]
        host_wall.append(a["wall_s"] - (c.sync_s if cuda else c.compute_s))
        # CPU: this thread's CPU time outside compute regions, so time slices lost to other
        # jobs on a shared machine do not count as host work (OMP_NUM_THREADS=1: the ops run
        # on this thread too).
        host.append(host_wall[-1] if cuda else a["cpu_s"] - c.compute_cpu_s)
    med = statistics.median
    cs = [b["counts"] for b in counted[:n]]
    calls = sum(b["layer_calls"] for b in counted[:n])
    row = dict(
        steps=n, batch_seen=min(a["batch"] for a in timed[:n]),
        host_us=med(host) * 1e6, host_wall_us=med(host_wall) * 1e6,
        wall_us=med(a["wall_s"] for a in timed[:n]) * 1e6,
        compute_us=med(a["counts"].compute_s for a in timed[:n]) * 1e6,
        counted_wall_us=med(b["wall_s"] for b in counted[:n]) * 1e6,
        device_us=med(a["device_s"] for a in timed[:n]) * 1e6 if cuda else None,
        launches=med(c.launches for c in cs), aten_kernels=med(c.aten_kernels for c in cs),
        copies=med(c.copies for c in cs), triton=med(c.triton for c in cs),
        c_kernels=med(c.c_kernels for c in cs),
        graph_replays=med(a["counts"].graph_replays for a in timed[:n]),
        syncs=med(b["counts"].syncs for b in counted[:n]),
        launches_per_layer=(sum(b["layer_launches"] for b in counted[:n]) / calls
                            if calls else None),
        top_ops=sorted(cs[-1].ops.items(), key=lambda kv: -kv[1])[:12],
        # the engine's own wall time per phase of the step (StepTimes), compute included
        phases_us={p: med(a["phases"][p] for a in timed[:n]) * 1e6 for p in PHASES},
        sync_sites=sorted(counted[n - 1]["counts"].sync_sites.items(), key=lambda kv: -kv[1]),
    )
    return row


def bench(args: argparse.Namespace) -> list[dict]:
    from tqdm import tqdm

    graph_modes: list[bool | None] = [None]
    if graphs_supported():
        graph_modes = [g == "on" for g in args.graphs]
    root = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    rows = []
    for backend in args.backends:
        for graphs in graph_modes:
            engine = build_engine(args, backend, graphs, root)
            interp = engine.device.type == "cpu" and backend != "torch"
            grid = [(b, k, kind) for b in args.batches for k in args.ks
                    for kind in (args.drafts if k > 0 else ["chain"])
                    if not (interp and b > args.triton_max_batch)]
            for batch, k, kind in tqdm(grid, desc=f"{backend} graphs={graphs}"):
                steps = args.triton_steps if interp else args.steps
                row = dict(backend=backend, graphs=graphs, batch=batch, k=k, draft=kind,
                           device=str(engine.device))
                try:
                    row.update(measure(engine, args, batch, k, kind, steps))
                except Exception as e:  # noqa: BLE001 - one failing config is reported
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                row.update({f"{t}_verdict": v for t, v in verdicts(row).items()})
                rows.append(row)
            del engine  # an 8B engine must be gone before the next one loads
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled",
                   help="bundled (arith pair), dummy (--layers/--hidden) or llama-8b/qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=192, help="dummy models: room for steps")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    p.add_argument("--drafts", nargs="+", choices=["chain", "tree"], default=["chain", "tree"])
    p.add_argument("--backends", nargs="+", default=None,
                   help="kernel backends (default: triton on CUDA; torch and triton on CPU)")
    p.add_argument("--graphs", nargs="+", choices=["off", "on"], default=["off", "on"],
                   help="CUDA graphs settings (used once the engine takes cuda_graphs=)")
    p.add_argument("--steps", type=int, default=20, help="measured decode steps per config")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--triton-max-batch", type=int, default=16,
                   help="CPU: largest batch run through the (slow) Triton interpreter")
    p.add_argument("--triton-steps", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch intra-op threads (1: the ops run on the timed thread)")
    p.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT)
    p.add_argument("--commit", default=None,
                   help="engine commit to record (default: from the checkout of specengine)")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if args.backends is None:
        args.backends = ["triton"] if cuda else ["torch", "triton"]
    if not cuda:
        torch.set_num_threads(args.threads)
    if args.model not in ("bundled", "dummy"):
        from bench_generate import SHAPES

        if args.model not in SHAPES:
            p.error(f"--model must be bundled, dummy or one of {sorted(SHAPES)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rows = bench(args)
    print(f"device: {benchlib.device_name()}  model: {args.model}  "
          f"threads: {torch.get_num_threads()}")
    print_table(rows)
    commit = args.commit or engine_commit()
    import specengine

    result = dict(started=started, device=benchlib.device_name(), commit=commit,
                  engine_path=str(Path(specengine.__file__).parent),
                  torch=torch.__version__, command=" ".join(sys.argv),
                  graphs_keyword=graphs_supported(), threads=torch.get_num_threads(),
                  model=args.model, rows=rows)
    benchlib.write_json(result, args.out, "host_overhead")
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
