"""Write ``trees.json`` (``specengine/train/trees.py``) for an EAGLE-3 head that ``train-draft``
made before it wrote one, from a saved set of the policy's rollouts with their recorded
distributions (``ab_draft_head.py rollouts``' file, or ``train-draft``'s
``checkpoints/data.safetensors``). The set should be the head's training rollouts, not the
prompts it is evaluated on.

Usage::

    python benchmarks/head_trees.py --model MODEL_DIR --head HEAD_DIR --data SET.safetensors
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specengine.drafters.draft_trainer import DraftTrainer
from specengine.train.head_init import read_head
from specengine.train.offline import GeneratedSet, read_embedding
from specengine.train.trees import write_trees


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="target checkpoint dir")
    ap.add_argument("--head", type=Path, required=True, help="EAGLE-3 head dir (written to)")
    ap.add_argument("--data", type=Path, required=True, help="saved rollouts (.safetensors)")
    ap.add_argument("--depth", type=int, default=3, help="tree depth measured")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    embed = read_embedding(args.model)
    _, head = read_head(args.head, embed, torch.device("cpu"))
    data = GeneratedSet.load(args.data)
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=args.depth)
    doc = write_trees(trainer, {n: p.detach() for n, p in head.named_parameters()}, data,
                      data.seqs, args.head)
    print(json.dumps({k: doc[k] for k in ("num_rollouts", "num_anchors",
                                          "expected_accepted_drafts")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
