"""Held-out acceptance of a trained EAGLE-3 head on the math task, as ``train-draft`` evaluates
it (``offline.evaluate``: k = 1..5, greedy and sampled at T=1, seeded per prompt), on two sets:

- the 16 evaluation problems the SmolLM2 runs report (``math_task.heldout_prompts(16)``), on
  which the training settings were chosen;
- 16 problems never used for any choice (``math_task.heldout_prompts(40, seed=4242)`` minus
  the first set).

Drafts are drawn from the head's distribution for sampled requests (the EAGLE-3 default) or,
with ``--point-mass``, proposed as argmax point masses (``draft_options={"sample": False}``),
so the two can be compared on the same prompts and seeds. Writes the tables to stdout and,
with ``--json``, every figure.

Usage::

    python benchmarks/eval_draft_head.py --head HEAD_DIR [--point-mass] [--threads 2]
    python benchmarks/eval_draft_head.py --model DIR --head DIR --num-prompts 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from specengine import math_task
from specengine.train.data import tokenize_prompts
from specengine.train.offline import TrainDraftConfig, evaluate, format_table

DEFAULT_MODEL = Path.home() / ".cache/specengine/smollm2-135m-instruct"
FRESH_SEED = 4242  # the seed of problems no setting was chosen on


def prompt_sets(num: int, fresh_seed: int = FRESH_SEED) -> dict[str, list[Any]]:
    """The evaluation problems and as many never used before (none shared with the first)."""
    held = math_task.heldout_prompts(num)
    seen = {str(p) for p in held}
    fresh = [p for p in math_task.heldout_prompts(3 * num + 8, seed=fresh_seed)
             if str(p) not in seen][:num]
    if len(fresh) < num:
        raise ValueError(f"only {len(fresh)} new problems for {num} asked")
    return {"evaluation set": held, f"never used (seed {fresh_seed})": fresh}


def run(model: Path, head: Path, point_mass: bool, num: int, max_tokens: int,
        threads: int | None, device: str, fresh_seed: int = FRESH_SEED,
        temperatures: tuple[float, ...] = (0.0, 1.0)) -> dict[str, Any]:
    # (evaluate reads the head from ``out`` and no prompt file: ``prompts`` is a placeholder)
    cfg = TrainDraftConfig(model=model, prompts=head / "config.json", out=head,
                           eval_max_tokens=max_tokens, device=device, num_threads=threads,
                           eval_temperatures=temperatures)
    options = {"sample": False} if point_mass else None
    out = {}
    for name, prompts in prompt_sets(num, fresh_seed).items():
        out[name] = evaluate(cfg, tokenize_prompts(model, prompts), draft_options=options)
        logging.getLogger(__name__).info("%s done", name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint dir")
    ap.add_argument("--head", type=Path, required=True, help="EAGLE-3 head dir")
    ap.add_argument("--point-mass", action="store_true",
                    help="argmax drafts at every temperature (draft_options sample=False)")
    ap.add_argument("--num-prompts", type=int, default=16, help="problems per set")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fresh-seed", type=int, default=FRESH_SEED,
                    help="seed of the second set (another seed: problems never looked at)")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated (0 = greedy)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    res = run(args.model, args.head, args.point_mass, args.num_prompts, args.max_tokens,
              args.threads, args.device, args.fresh_seed,
              tuple(float(t) for t in args.temperatures.split(",")))
    drafts = "argmax point masses" if args.point_mass else "sampled for sampled requests"
    for name, ev in res.items():
        print(f"== {name}; drafts: {drafts}\n{format_table(ev)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"drafts": drafts, "sets": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
