"""Held-out acceptance of a trained EAGLE-3 head on the math task, as ``train-draft`` evaluates
it (``offline.evaluate``: k = 1..5, greedy and sampled at T=1, seeded per prompt), on two sets:

- the 16 evaluation problems the SmolLM2 runs report (``math_task.heldout_prompts(16)``), on
  which the training settings were chosen;
- 16 problems never used for any choice (``math_task.heldout_prompts(40, seed=4242)`` minus
  the first set).

Drafts are drawn from the head's distribution for sampled requests (the EAGLE-3 default) or,
with ``--point-mass``, proposed as argmax point masses (``draft_options={"sample": False}``),
so the two can be compared on the same prompts and seeds. ``--tree PATHS`` (JSON, repeatable:
``[[0],[1],[0,0]]``, see ``specengine.tree``) adds static draft trees on the same prompts and
seeds, their depth as k: a tree's children are the head's top-ranked tokens, point masses at
every temperature, so each step verifies ``len(PATHS)`` drafts per sequence against a chain's
k. ``--best-trees 8,16`` evaluates the trees of those sizes that ``train-draft`` wrote next to
the head (``trees.json``; ``head_trees.py`` writes one for an older head): the greedy tree
for greedy requests, the sampled one for sampled requests. Writes the tables to stdout and,
with ``--json``, every figure.

Usage::

    python benchmarks/eval_draft_head.py --head HEAD_DIR [--point-mass] [--threads 2]
    python benchmarks/eval_draft_head.py --head HEAD_DIR --tree '[[0],[1],[0,0],[0,0,0]]'
    python benchmarks/eval_draft_head.py --head HEAD_DIR --best-trees 8,16,32
    python benchmarks/eval_draft_head.py --model DIR --head DIR --num-prompts 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from specengine import math_task
from specengine.train.data import tokenize_prompts
from specengine.train.offline import (
    TrainDraftConfig,
    eval_row,
    eval_sampling,
    evaluate,
    format_table,
)
from specengine.train.trees import tree_paths
from specengine.tree import DraftTree

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


def parse_tree(spec: str) -> list[tuple[int, ...]]:
    """``--tree``'s JSON list of paths, checked as :class:`DraftTree` checks a tree."""
    try:
        paths = json.loads(spec)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--tree {spec!r} is not JSON: {e}") from None
    if not isinstance(paths, list) or not all(
            isinstance(p, list) and all(type(r) is int for r in p) for p in paths):
        raise argparse.ArgumentTypeError(
            f"--tree {spec!r}: expected a list of paths, each a list of ranks, "
            "e.g. [[0],[1],[0,0]]")
    try:
        DraftTree(paths)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--tree {spec!r}: {e}") from None
    return [tuple(p) for p in paths]


def evaluate_trees(cfg: TrainDraftConfig, prompts: list[list[int]],
                   trees: list[list[tuple[int, ...]]] | None = None,
                   best_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    """Per temperature of ``cfg``, a list with each tree's held-out figures as ``evaluate``
    gives a chain's (same engine settings and per-prompt seeds; the tree's depth as k), plus
    the wall seconds of its ``generate``: the ``trees`` given, then the head's own best
    trees of ``best_sizes`` drafts for that temperature (``trees.json``)."""
    from specengine.engine import SpecEngine

    engine = SpecEngine(cfg.model, draft=str(cfg.out), device=cfg.device, dtype=cfg.dtype,
                        seed=cfg.seed, num_threads=cfg.num_threads,
                        max_batch_size=max(1, len(prompts)))
    given = list(trees or [])
    by_temp: dict[str, Any] = {}
    try:
        for temp in cfg.eval_temperatures:
            params = eval_sampling(cfg, float(temp), len(prompts),
                                   cfg.eval_max_tokens or cfg.max_tokens)
            base = engine.generate(prompts, k=0, sampling=params) if temp == 0 else None
            kind = "greedy" if temp == 0 else "sampled"
            rows = []
            for i, paths in enumerate(given + [tree_paths(cfg.out, kind, n) for n in best_sizes]):
                depth = max(len(p) for p in paths)
                start = time.perf_counter()
                row = eval_row(engine, prompts, params, base, k=depth, tree=paths)
                rows.append({"paths": [list(p) for p in paths], "k": depth,
                             "best": kind if i >= len(given) else None, **row,
                             "seconds": time.perf_counter() - start})
            by_temp[f"{float(temp):g}"] = rows
    finally:
        engine.close()
    return by_temp


def format_trees(by_temp: dict[str, Any]) -> str:
    lines = ["| drafts | T | mean accepted length | acceptance per depth | identical to k=0 "
             "| s |", "|---|---|---|---|---|---|"]
    for temp, rows in by_temp.items():
        for r in rows:
            name = f"tree of {len(r['paths'])}, depth {r['k']}"
            if r.get("best"):
                name = f"the head's best {name}"
            pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            same = r.get("identical_to_k0", "-")
            lines.append(f"| {name} | {temp} | {r['mean_accepted_length']:.2f} | {pos} | "
                         f"{same} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def run(model: Path, head: Path, point_mass: bool, num: int, max_tokens: int,
        threads: int | None, device: str, fresh_seed: int = FRESH_SEED,
        temperatures: tuple[float, ...] = (0.0, 1.0),
        trees: list[list[tuple[int, ...]]] | None = None,
        best_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    # (evaluate reads the head from ``out`` and no prompt file: ``prompts`` is a placeholder)
    cfg = TrainDraftConfig(model=model, prompts=head / "config.json", out=head,
                           eval_max_tokens=max_tokens, device=device, num_threads=threads,
                           eval_temperatures=temperatures)
    options = {"sample": False} if point_mass else None
    out = {}
    for name, prompts in prompt_sets(num, fresh_seed).items():
        ids = tokenize_prompts(model, prompts)
        out[name] = evaluate(cfg, ids, draft_options=options)
        if trees or best_sizes:
            out[name]["trees"] = evaluate_trees(cfg, ids, trees, best_sizes)
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
    ap.add_argument("--tree", type=parse_tree, action="append", default=None,
                    help="a static draft tree's paths as JSON (repeatable), e.g. "
                         "'[[0],[1],[0,0],[0,0,0]]': evaluated after the chains")
    ap.add_argument("--best-trees", default="",
                    help="comma-separated sizes of the head's own trees (its trees.json) to "
                         "evaluate after the chains, e.g. 8,16")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(int(n) for n in args.best_trees.split(",") if n.strip())
        for n in sizes:
            for kind in ("greedy", "sampled"):
                tree_paths(args.head, kind, n)
    except ValueError as e:
        ap.error(f"--best-trees {args.best_trees!r}: {e}")
    res = run(args.model, args.head, args.point_mass, args.num_prompts, args.max_tokens,
              args.threads, args.device, args.fresh_seed,
              tuple(float(t) for t in args.temperatures.split(",")), args.tree, sizes)
    drafts = "argmax point masses" if args.point_mass else "sampled for sampled requests"
    for name, ev in res.items():
        print(f"== {name}; drafts: {drafts}\n{format_table(ev)}")
        if "trees" in ev:
            print(f"== {name}; static trees (point-mass children)\n{format_trees(ev['trees'])}")
    if args.json is not None:
        args.json.write_text(json.dumps({"drafts": drafts, "sets": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
