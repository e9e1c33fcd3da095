"""GRPO rollouts with the group-aware suffix drafter (issue 14 item 2): tokens kept per step per
sequence, epoch by epoch, for the n-gram drafter, the suffix drafter, the bundled EAGLE-3 head
and the pair (head, "suffix").

Setting (the issue's): the bundled pair, ``--groups`` held-out prompts of the arithmetic task
× ``--group-size`` samples each (a GRPO group), k = 3, temperature 1, and the same prompts
again for every epoch (``generate`` once per epoch on one engine, so the suffix drafter's
index carries over). "Tokens per step per sequence" is ``engine.stats.num_step_tokens /
num_seq_steps`` (tokens kept over (sequence, step) pairs, prefill excluded); acceptance per
draft position is ``accepted_per_position / proposed_per_position``. Wall times on a shared
CPU are noisy and only for orientation (the speed claim is tokens per step).

Usage::

    python benchmarks/bench_suffix.py [--epochs 3] [--groups 8] [--group-size 8] [--k 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from benchlib import DEFAULT_OUT, write_json

DRAFTS = ("ngram", "suffix", "head", "head+suffix")


def make_engine(draft: str, device: str, options: dict | None = None):  # -> SpecEngine
    from specengine import SpecEngine
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from specengine.drafters.hybrid import HybridDrafter
    from specengine.drafters.suffix import SuffixDrafter

    if draft == "suffix":
        return SpecEngine(DEFAULT_TARGET, draft=draft, device=device, draft_options=options)
    if draft == "ngram":
        return SpecEngine(DEFAULT_TARGET, draft=draft, device=device)
    if draft == "head":
        return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device=device)
    try:  # the engine passes a (dir, "suffix") pair to make_drafter once it takes tuples
        return SpecEngine(DEFAULT_TARGET, draft=(str(DEFAULT_DRAFT), "suffix"), device=device)
    except ValueError:
        engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device=device)
        hybrid = HybridDrafter(engine.drafter, SuffixDrafter())
        engine.drafter = engine.core.drafter = hybrid
        engine.scheduler.on_preempt = hybrid.release
        return engine


#: the batch at which host time per sequence is reported (the engine's max_batch_size)
FULL_BATCH = 256


def time_proposals(drafter: object) -> list[tuple[int, float]]:
    """Wrap ``drafter.propose`` (an instance attribute over the method, nothing else changes)
    to record ``(batch, seconds)`` per call: the drafter's whole host cost of a step, catching
    up the accepted tokens included."""
    calls: list[tuple[int, float]] = []
    inner = drafter.propose  # type: ignore[attr-defined]

    def propose(seqs, num_drafts, tree):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = inner(seqs, num_drafts, tree)
        calls.append((len(seqs), time.perf_counter() - t0))
        return out

    drafter.propose = propose  # type: ignore[attr-defined]
    return calls


def options_arg(text: str) -> dict[str, float]:
    """``a=1,b=0.5`` -> ``{"a": 1, "b": 0.5}`` (ints stay ints)."""
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from specengine import SamplingParams
    from specengine.arith_task import heldout_prompts

    batch = [p for p in heldout_prompts(args.groups) for _ in range(args.group_size)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    rows = []
    for draft in args.drafts:
        engine = make_engine(draft, args.device, args.options)
        calls = time_proposals(engine.drafter)
        for epoch in range(1, args.epochs + 1):
            calls.clear()
            t0 = time.perf_counter()
            outs = engine.generate(batch, k=args.k, sampling=params)
            wall = time.perf_counter() - t0
            st = engine.stats
            rate = [a / p if p else 0.0 for a, p in
                    zip(st.accepted_per_position, st.proposed_per_position)]
            row = dict(draft=draft, epoch=epoch,
                       tokens_per_step=st.num_step_tokens / st.num_seq_steps,
                       accept_per_position=rate,
                       drafts_per_step=(sum(st.proposed_per_position) / st.num_seq_steps),
                       accepted_share=(sum(st.accepted_per_position)
                                       / max(sum(st.proposed_per_position), 1)),
                       num_tokens=sum(len(o.token_ids) for o in outs), wall_s=wall)
            full = [t / n for n, t in calls if n >= FULL_BATCH]
            row["propose_us_per_seq"] = 1e6 * sum(t for _, t in calls) / max(
                sum(n for n, _ in calls), 1)
            row["propose_us_per_seq_full"] = 1e6 * float(np.median(full)) if full else None
            hybrid = engine.drafter
            if hasattr(hybrid, "num_suffix_rows"):
                row["suffix_share"] = hybrid.num_suffix_rows / max(hybrid.num_rows, 1)
                hybrid.num_suffix_rows = hybrid.num_rows = 0
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=DRAFTS)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--options", type=options_arg, default=None,
                    help="draft_options of the suffix drafter, e.g. suffix_min_prob=0.2,"
                         "suffix_spec_factor=1")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = run(args)
    print(f"\n{args.groups} prompts x {args.group_size} samples, k={args.k}, "
          f"temperature {args.temperature}")
    print("| draft | epoch | tokens / step / seq | acceptance per position | drafts / step "
          "| drafts accepted | propose µs / seq (all, batch 256) | suffix rows | wall s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        share = f"{r['suffix_share']:.2f}" if "suffix_share" in r else "-"
        full = r["propose_us_per_seq_full"]
        host = f"{r['propose_us_per_seq']:.2f}, " + (f"{full:.2f}" if full else "-")
        print(f"| {r['draft']} | {r['epoch']} | {r['tokens_per_step']:.2f} | {acc} | "
              f"{r['drafts_per_step']:.2f} | {r['accepted_share']:.2f} | {host} | {share} | "
              f"{r['wall_s']:.2f} |")
    write_json({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, args.out,
               "bench_suffix")


if __name__ == "__main__":
    main()
