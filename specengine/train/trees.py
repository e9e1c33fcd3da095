"""The static draft trees a trained EAGLE-3 head is best verified with (``OUT/trees.json``).

A tree of N drafts keeps more tokens per step than a chain of k, at the price of verifying N
positions per sequence instead of k (cheap where a verify pass is memory-bound: a GPU at small
batch; not on a CPU, where a pass costs about its number of positions). Which tree is best
depends on the head: a sharp head wants a chain, a flat one a bush. After training,
``train-draft`` replays up to ``STAT_SEQS`` of its rollouts through the head's unrolled
maths (teacher forced, as the loss runs) and reads, at every anchor and depth, the head's
rank of the token that must be guessed. A path of ranks ``(r_1 .. r_d)`` is kept by a step
exactly when the token at each depth ``j`` has rank ``r_j``, so its probability is the share
of anchors whose ranks begin with it, and :meth:`DraftTree.best` keeps the most probable
paths:

- ``sampled``: the rollout's own tokens. They were drawn from the policy at the rollouts'
  temperature, and a tree's point-mass children, tried in rank order against the running
  residual, keep the child whose token a draw from the policy gives, so the share is the
  probability a sampled request at that temperature keeps the path (unbiased, correlations
  between depths included);
- ``greedy``: the policy's most likely token at each depth (its recorded distribution's
  argmax over the draft vocabulary), ranked by the head after the rollout's prefix: an
  estimate, since a greedy request's prefix is the argmax one.

Ranks past ``TREE_RANKS`` and tokens outside the draft vocabulary end a path. The file holds
the most probable paths, the trees of ``TREE_SIZES`` drafts per kind and their expected kept
drafts per step; ``SpecEngine.generate(prompts, tree=16)`` verifies them (each request the
tree of its kind; ``drafters/head_trees.py`` reads the file).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specengine.drafters.adapt import BufferedSeq
from specengine.drafters.draft_trainer import DraftTrainer
from specengine.drafters.head_trees import KINDS, TREES_FILE, HeadTrees
from specengine.tree import DraftTree

TREE_SIZES = (4, 8, 16, 32)  # drafts per tree written
TREE_RANKS = 8  # ranks measured per depth
KEEP = 256  # most probable paths written per kind
STAT_SEQS = 128  # rollouts the statistics are measured on (spread over the set)
GROUP_SEQS = 16  # rollouts per unrolled pass


def path_acceptance(trainer: DraftTrainer, params: dict[str, Tensor], source: Any,
                    seqs: list[BufferedSeq], ranks: int = TREE_RANKS
                    ) -> tuple[dict[str, dict[tuple[int, ...], float]], int]:
    """``({"greedy": {path: p}, "sampled": {path: p}}, anchors)``: each path of head ranks
    (depth at most ``trainer.depth``, ranks below ``ranks``) that some anchor of ``seqs`` (of
    ``source``, which must record the policy's distributions) begins with, and the share of
    the anchors that do (module docstring)."""
    depth = trainer.depth
    counts: dict[str, Counter[tuple[int, ...]]] = {k: Counter() for k in KINDS}
    anchors = 0
    with torch.no_grad():
        for i in range(0, len(seqs), GROUP_SEQS):
            group = seqs[i: i + GROUP_SEQS]
            soft = trainer.soft_targets(source, group)
            if soft is None:
                raise ValueError("the rollouts record no distributions of the policy: tree "
                                 "statistics need soft labels (train-draft --soft-labels K)")
            feats, ids, valid, targets = trainer.batch(source, group)
            logits = trainer.math.unroll(params, feats, ids, valid, depth)
            # anchors: from the last prompt row on, with a next token to guess (whether or
            # not the draft vocabulary has it: a token it lacks is a miss)
            t = np.arange(valid.shape[1])
            has = torch.from_numpy(np.stack([(t >= s.num_prompt_tokens - 1) & (t + 1 < len(s.rows))
                                             for s in group])).to(valid.device)  # [B, T]
            anchors += int(has.sum())
            by_kind: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
            for d in range(depth):
                sid, sp = soft[d]  # [B, T, K] draft ids (-1: none), probabilities
                argmax = torch.where(sp.sum(-1) > 0, sid.gather(-1, sp.argmax(-1, keepdim=True))
                                     [..., 0], -1)
                lg = logits[d].float()  # [B, T, Vd]
                for kind, tok in (("sampled", targets[d]), ("greedy", argmax)):
                    ok = tok >= 0  # (-100 / -1: no token there, or none in the draft vocabulary)
                    own = lg.gather(-1, tok.clamp_min(0)[..., None])  # [B, T, 1]
                    rank = (lg > own).sum(-1)  # [B, T]: the head's rank of the token
                    rank = torch.where(ok & (rank < ranks), rank, ranks)  # ranks: path ends
                    by_kind[kind].append(rank[has].cpu().numpy())
            for kind in KINDS:
                for row in np.stack(by_kind[kind], 1).tolist():  # [anchors, depth]
                    for d in range(depth):
                        if row[d] == ranks:
                            break
                        counts[kind][tuple(row[: d + 1])] += 1
    n = max(1, anchors)
    return {k: {p: c / n for p, c in counts[k].items()} for k in KINDS}, anchors


def best_trees(acceptance: dict[str, dict[tuple[int, ...], float]],
               sizes: tuple[int, ...] = TREE_SIZES) -> dict[str, dict[str, list[list[int]]]]:
    """Per kind and size, the paths of :meth:`DraftTree.best` (sizes past the number of
    paths measured are left out)."""
    return {kind: {str(n): [list(p) for p in DraftTree.best(acceptance[kind], n).paths]
                   for n in sizes if n <= len(acceptance[kind])} for kind in KINDS}


def write_trees(trainer: DraftTrainer, params: dict[str, Tensor], source: Any,
                seqs: list[BufferedSeq], out: Path) -> dict[str, Any]:
    """Measure on up to ``STAT_SEQS`` of ``seqs`` (evenly spread) and write ``out/trees.json``
    (also returned)."""
    if not seqs:
        raise ValueError("no rollouts to measure the trees on")
    pick = np.unique(np.linspace(0, len(seqs) - 1, min(STAT_SEQS, len(seqs))).round()
                     .astype(int))
    acceptance, anchors = path_acceptance(trainer, params, source, [seqs[i] for i in pick])
    trees = best_trees(acceptance)
    doc = {"depth": trainer.depth, "ranks": TREE_RANKS, "num_rollouts": len(pick),
           "num_anchors": anchors,
           "expected_accepted_drafts": {
               kind: {n: round(sum(acceptance[kind][tuple(p)] for p in paths), 4)
                      for n, paths in trees[kind].items()} for kind in KINDS},
           "trees": trees,
           # the most probable paths, for a reader's own trees
           "path_acceptance": {kind: {",".join(map(str, p)): round(v, 6) for p, v in sorted(
               acceptance[kind].items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:KEEP]}
               for kind in KINDS}}
    (out / TREES_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def tree_paths(head_dir: str | Path, kind: str, size: int) -> list[tuple[int, ...]]:
    """The ``kind`` ("greedy" or "sampled") tree of ``size`` drafts that ``train-draft`` wrote
    for the head in ``head_dir``."""
    return HeadTrees.load(head_dir).paths(kind, size)
