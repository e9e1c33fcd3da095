"""What a decode step costs per phase at each fixed k, against ``k="auto"``'s fitted model
(issue 34 item 5b, docs/design.md §15).

Per fixed k (and the catch-up step ``SYNC``: no drafts, the drafter observes), rollouts of
``--prompts`` held-out prompts × ``--samples`` samples with ``ignore_eos`` (every row runs
``--max-tokens``), and the engine's own step clock (``engine.stats``: the engine thread's
CPU time off CUDA, device time on CUDA): draft and verify + bookkeeping milliseconds per step,
sequences per step. Then ``--auto-calls`` ``k="auto"`` calls (without ``ignore_eos``, as a
rollout's batch shrinks) and what the cost model fitted: its coefficients, its median error
and its step times at the full batch next to the measured ones.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_step_phases.py     # the bundled pair, CPU
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from tqdm import tqdm

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

SYNC = "SYNC"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--ks", default="0,SYNC,1,2,3,4,6")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the last is reported")
    ap.add_argument("--auto-calls", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    prompts = [encode(p) for p in heldout_prompts(args.prompts)]
    eng = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device=args.device, dtype="float32")
    ks = [k if k == SYNC else int(k) for k in args.ks.split(",")]
    rows: dict[str, dict[str, float]] = {}
    for r in tqdm(range(args.rounds), desc="rounds"):
        for k in ks:
            eng.drafter.catch_up_at_k0 = k == SYNC
            sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                n=args.samples, seed=100 * r + 7, ignore_eos=True)
            eng.generate(prompts, k=0 if k == SYNC else k, sampling=sp)
            st = eng.stats
            rows[str(k)] = {
                "draft_ms": st.time_draft_s / st.num_steps * 1e3,
                "verify_bookkeeping_ms": (st.time_verify_s + st.time_bookkeeping_s)
                / st.num_steps * 1e3,
                "seqs_per_step": st.num_seq_steps / st.num_steps,
                "tokens_per_seq_step": st.num_step_tokens / st.num_seq_steps}
    eng.drafter.catch_up_at_k0 = False
    print("k     draft ms  verify+bk ms  seqs/step  tokens/seq-step")
    for k, row in rows.items():
        print(f"{k:5} {row['draft_ms']:9.2f} {row['verify_bookkeeping_ms']:13.2f} "
              f"{row['seqs_per_step']:10.1f} {row['tokens_per_seq_step']:16.2f}")
    auto_steps = []
    for r in range(args.auto_calls):
        sp = SamplingParams(temperature=args.temperature, max_tokens=2 * args.max_tokens,
                            n=args.samples, seed=1000 + r)
        eng.generate(prompts, k="auto", sampling=sp)
        auto_steps.append(list(eng.stats.auto_k_steps))
    costs = eng.core.auto_k.costs
    batch = args.prompts * args.samples
    fitted = None
    if costs.cost is not None:
        fitted = costs.cost.step_times(batch, 8, sync=True) * 1e3
        print(f"k='auto' steps per k by call: {auto_steps}")
        print(f"fit: median error {costs.error:.3f}, batch / catch-up terms {costs.terms}")
        print("  draft ms  ", np.round(np.array(costs.cost.draft) * 1e3, 4).tolist())
        print("  verify ms ", np.round(np.array(costs.cost.verify) * 1e3, 4).tolist())
        print(f"  step ms at batch {batch}, k = 0..8: {np.round(fitted, 2).tolist()}")
    eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phases": rows, "auto_steps": auto_steps,
                       "fit_error": costs.error, "fitted_step_ms": None if fitted is None
                       else fitted.tolist()}, f, indent=2)


if __name__ == "__main__":
    main()
