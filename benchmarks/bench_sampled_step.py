"""What sampling costs a step: a sampled (T = 1, no top-k / top-p) step against a greedy one.

Issue 34 item 5: on the CPU a sampled step must cost at most 1.3x a greedy one at batch 32
(the real model's 49k vocabulary). Each configuration (k, temperature) runs the same batch of
prompts through the step API; every decode / verify step after the prefill is timed alone,
in wall seconds and in the process's CPU seconds (on a shared machine the CPU time is the
cost: wall time also counts the other processes' turns). Configurations are interleaved
round by round and the medians over all timed steps are reported, with the load.

    OMP_NUM_THREADS=1 python benchmarks/bench_sampled_step.py \\
        --model ~/.cache/specengine/smollm2-135m-instruct --draft HEAD_DIR --batch 32 \\
        --ks 0 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

from tqdm import tqdm


def run_steps(engine, prompts: list[str], k: int, temperature: float, tokens: int,
              seed: int) -> tuple[list[float], list[float]]:
    """(wall s, CPU s) of each step after the first (the prefill) of one batch."""
    from specengine import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True,
                            seed=seed)
    for p in prompts:
        engine.add_request(p, params, k=k)
    engine.step()  # prefill
    wall, cpu = [], []
    while engine.has_unfinished():
        w0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return wall[:-1] or wall, cpu[:-1] or cpu  # the last step may hold fewer rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/specengine/smollm2-135m-instruct"))
    ap.add_argument("--draft", default="ngram", help="drafter for k > 0: an EAGLE-3 head "
                    "proposes k drafts every step, so every step verifies k + 1 tokens per "
                    "row (n-grams propose only on a match)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--tokens", type=int, default=8, help="max tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from specengine import SpecEngine

    engine = SpecEngine(args.model, draft=args.draft, device=args.device,
                        max_batch_size=args.batch, enable_prefix_caching=False)
    prompts = [f"Question {i}: what is {i} plus {2 * i + 3}? Explain." for i in range(args.batch)]
    configs = [(k, t) for k in args.ks for t in (0.0, 1.0)]
    run_steps(engine, prompts, 0, 1.0, 2, 0)  # warm-up
    times: dict[tuple[int, float], tuple[list[float], list[float]]] = {
        c: ([], []) for c in configs}
    load = []
    for r in tqdm(range(args.rounds), desc="rounds"):
        for k, t in configs:
            wall, cpu = run_steps(engine, prompts, k, t, args.tokens, seed=r)
            times[(k, t)][0].extend(wall)
            times[(k, t)][1].extend(cpu)
        load.append(os.getloadavg()[0])
    rows = []
    for k in args.ks:
        g_wall, g_cpu = (statistics.median(x) for x in times[(k, 0.0)])
        s_wall, s_cpu = (statistics.median(x) for x in times[(k, 1.0)])
        rows.append(dict(k=k, batch=args.batch, greedy_wall_s=g_wall, sampled_wall_s=s_wall,
                         greedy_cpu_s=g_cpu, sampled_cpu_s=s_cpu, ratio_cpu=s_cpu / g_cpu,
                         ratio_wall=s_wall / g_wall, steps=len(times[(k, 1.0)][1])))
    result = dict(model=str(args.model), device=args.device, load=load, rows=rows,
                  omp_threads=os.environ.get("OMP_NUM_THREADS"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampled_step.json").write_text(json.dumps(result, indent=1))
    print(f"batch {args.batch}, load {min(load):.1f}-{max(load):.1f}, medians per step")
    print("| k | greedy CPU s | T=1 CPU s | ratio (CPU) | greedy wall s | T=1 wall s | "
          "ratio (wall) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['greedy_cpu_s']:.3f} | {r['sampled_cpu_s']:.3f} | "
              f"{r['ratio_cpu']:.2f} | {r['greedy_wall_s']:.3f} | {r['sampled_wall_s']:.3f} | "
              f"{r['ratio_wall']:.2f} |")


if __name__ == "__main__":
    main()
