"""Acceptance of the EAGLE-3 head as a GRPO policy drifts, frozen vs adapted online, on the
same policy at every step (issue 14 item 3).

``examples/rl_loop.py --adapt-draft-every N`` shows the automatic mode inside the real
two-process loop, but two runs of it drift apart (drafts change which random draws a
sampled rollout makes, so the runs train on different rollouts). Here one process runs the
GRPO loop of ``examples/grpo.py`` (a transformers learner, the bundled task and reward) and
copies the learner's weights after every step into two engines (``load_weights``, in process):
one with the bundled head frozen, one adapting it (``draft_options`` ``adapt_every`` = the
step's rollouts, so it adapts once per step on the rollouts it just made). Both roll out the
same prompts with the same seeds; the frozen engine's rollouts train the policy. Acceptance
per draft is each engine's ``num_accepted_tokens / num_draft_tokens`` of the step.

Usage::

    python benchmarks/bench_adapt_drift.py [--steps 20] [--lr 1e-3] [--adapt-lr 1e-3]
        [--spoil-sigma 0.7] [--oracle]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from benchlib import DEFAULT_OUT, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def acceptance(engine) -> float:
    st = engine.stats
    return st.num_accepted_tokens / max(st.num_draft_tokens, 1)


def run(args: argparse.Namespace) -> list[dict]:
    from grpo import grpo_step
    from transformers import AutoModelForCausalLM

    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import decode, encode, reward, training_problems
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    torch.manual_seed(args.seed)
    learner = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).train()
    params = list(learner.parameters())
    opt = torch.optim.Adam([{"params": [p for p in params if p.dim() > 1]},
                            {"params": [p for p in params if p.dim() == 1],
                             "lr": args.gain_lr}], lr=args.lr)
    n = args.prompts * args.group_size
    common = dict(device="cpu", dtype="float32", seed=args.seed, max_model_len=128)
    frozen = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **common)
    adaptive = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **common, draft_options={
        "adapt_every": n, "adapt_steps": args.adapt_steps, "adapt_lr": args.adapt_lr,
        "adapt_buffer_tokens": 4 * n * (args.max_tokens + 16),
        "adapt_batch_tokens": args.adapt_batch_tokens})
    if args.spoil_sigma > 0:  # a weaker head for both (bench_adapt.py's noise)
        from bench_adapt import spoilt_tensors

        weak = spoilt_tensors(frozen, "noise", args.spoil_sigma, args.seed)
        frozen.load_weights(weak, which="draft")
        adaptive.load_weights(weak, which="draft")
    # The policy drafting for itself (greedy, k=3): each draft is the policy's own argmax,
    # so its acceptance is the ceiling of any greedy drafter on these rollouts.
    oracle = SpecEngine(DEFAULT_TARGET, DEFAULT_TARGET, **common) if args.oracle else None
    problems, rng = training_problems(), random.Random(args.seed)
    rows = []
    for step in range(args.steps):
        group = [p for p in (next(problems)[0] for _ in range(args.prompts))
                 for _ in range(args.group_size)]
        ids = [encode(p) for p in group]
        sampling = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                   seed=rng.getrandbits(62)) for _ in group]
        outs = frozen.generate(ids, k=3, sampling=sampling)
        acc_frozen = acceptance(frozen)
        t0 = time.perf_counter()
        adaptive.generate(ids, k=3, sampling=sampling)  # adapts at the end of the step
        acc_adapted, adapt_gen_s = acceptance(adaptive), time.perf_counter() - t0
        acc_oracle = None
        if oracle is not None:
            oracle.generate(ids, k=3, sampling=sampling)
            acc_oracle = acceptance(oracle)
        rewards = [reward(p, decode(o.token_ids)) for p, o in zip(group, outs)]
        grpo_step(learner, opt, ids, [list(o.token_ids) for o in outs],
                  [list(o.logprobs) for o in outs], rewards, temperature=args.temperature,
                  group_size=args.group_size, clip_eps=0.2)
        weights = {name: p.detach().clone() for name, p in learner.named_parameters()}
        for engine in (frozen, adaptive, oracle):
            if engine is not None:
                engine.load_weights(weights)
        if oracle is not None:  # its drafter is a second copy of the policy
            oracle.load_weights(weights, which="draft")
        rows.append(dict(step=step, reward=sum(rewards) / n, frozen=acc_frozen,
                         adapted=acc_adapted, oracle=acc_oracle, adapt_gen_s=adapt_gen_s))
        print(f"step {step:2d} | reward {rows[-1]['reward']:.3f} | acceptance frozen "
              f"{acc_frozen:.3f} adapted {acc_adapted:.3f}"
              + (f" policy-as-drafter {acc_oracle:.3f}" if oracle is not None else "")
              + f" | adaptive generate + adapt {adapt_gen_s:.1f} s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="policy matrices (rl_loop: 1e-4)")
    ap.add_argument("--gain-lr", type=float, default=2e-2)
    ap.add_argument("--adapt-steps", type=int, default=8)
    ap.add_argument("--adapt-lr", type=float, default=1e-3)
    ap.add_argument("--adapt-batch-tokens", type=int, default=2048)
    ap.add_argument("--spoil-sigma", type=float, default=0.0,
                    help="start both engines from the bundled head with this much noise")
    ap.add_argument("--oracle", action="store_true",
                    help="also roll out with the policy as its own greedy drafter (ceiling)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = run(args)
    k = max(1, len(rows) // 4)
    for name in ("frozen", "adapted"):
        print(f"{name}: acceptance first {k} steps {sum(r[name] for r in rows[:k]) / k:.3f}, "
              f"last {k} {sum(r[name] for r in rows[-k:]) / k:.3f}")
    write_json({"args": vars(args) | {"out": str(args.out)}, "steps": rows}, args.out,
               "bench_adapt_drift")


if __name__ == "__main__":
    main()
