"""Static draft trees: paths of child ranks → node order, parents, depths and attention mask.

A tree is given as the list of its paths from the root, each a tuple of ranks: ``(0,)`` is the
draft's most likely first token, ``(1,)`` its second, ``(0, 0)`` the most likely token after
``(0,)``. Node 0 is the root (the sequence's newest token); the paths become nodes 1..N-1 in
breadth-first order, siblings by rank, so parents always precede children.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_TREE_NODES = 64


class DraftTree:
    """Node order, ``parents[N]`` (-1 for the root), ``depths[N]``, ``ranks[N]`` and the
    ancestor mask (node i attends to node j ⇔ j is i or an ancestor of i)."""

    def __init__(self, paths: Sequence[Sequence[int]]) -> None:
        norm = [tuple(int(r) for r in p) for p in paths]
        if not norm:
            raise ValueError("a draft tree needs at least one path")
        if len(set(norm)) != len(norm):
            raise ValueError("draft tree: duplicate paths")
        if len(norm) + 1 > MAX_TREE_NODES:  # + the root
            raise ValueError(f"draft tree: at most {MAX_TREE_NODES} nodes (root included), "
                             f"got {len(norm) + 1}")
        known = set(norm)
        for p in norm:
            if not p or any(r < 0 for r in p):
                raise ValueError(f"draft tree: path {p} must be a non-empty tuple of ranks >= 0")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(
                    f"draft tree is not prefix-closed: {p} is given but its parent {p[:-1]} is not"
                )
        ordered = sorted(norm, key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(ordered)}
        self.paths: tuple[tuple[int, ...], ...] = tuple(ordered)
        self.num_nodes = len(ordered) + 1
        self.parents = np.array([-1] + [index.get(p[:-1], 0) for p in ordered], dtype=np.int32)
        self.depths = np.array([0] + [len(p) for p in ordered], dtype=np.int32)
        self.ranks = np.array([0] + [p[-1] for p in ordered], dtype=np.int32)
        self.max_depth = int(self.depths.max())
        self.max_rank = int(self.ranks.max())
        dense = np.eye(self.num_nodes, dtype=bool)
        for i in range(1, self.num_nodes):
            dense[i] |= dense[self.parents[i]]
        self.dense_mask = torch.from_numpy(dense)
        from specengine.kernels.reference import pack_tree_mask

        self.packed_mask = pack_tree_mask(self.dense_mask)  # [N, num_words] int32
        # Host copies for the decode step (nothing there converts a tensor): the whole mask,
        # and per level-by-level drafting pass the mask of nodes 1 .. n-1 for each n that a
        # pass feeds (every node down to depth d).
        self.packed_mask_host: np.ndarray = self.packed_mask.numpy().copy()
        self.prefix_masks_host: dict[int, np.ndarray] = {
            n: pack_tree_mask(self.dense_mask[1:n, 1:n]).numpy().copy()
            for n in {int((self.depths <= d).sum()) for d in range(1, self.max_depth + 1)}
        }

    def __repr__(self) -> str:
        return f"DraftTree({list(self.paths)})"

    @classmethod
    def chain(cls, k: int) -> DraftTree:
        return cls([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def best(cls, path_probs: Mapping[tuple[int, ...], float], num_drafts: int) -> DraftTree:
        """The static tree of ``num_drafts`` nodes with the most expected accepted drafts per
        step, given ``path_probs[path]``: the probability that a step keeps every node of
        ``path`` (a tuple of child ranks; every given path's parent given too; paths not
        given are never picked).

        A step keeps every node whose path was all kept, so its expected number of kept
        drafts is ``sum_node path_probs[node]``. A path is kept only if its parent is, so a
        child's probability never exceeds its parent's (checked), and the ``num_drafts``
        most probable paths (parents first on ties) are prefix-closed: no tree of that size
        has a larger sum (Medusa's and Sequoia's static trees; ``train/trees.py`` measures
        the probabilities)."""
        probs = {tuple(int(r) for r in p): float(v) for p, v in path_probs.items()}
        if not 1 <= num_drafts < MAX_TREE_NODES:
            raise ValueError(f"num_drafts must be in [1, {MAX_TREE_NODES - 1}], got {num_drafts}")
        for path, v in probs.items():
            if not path or any(r < 0 for r in path):
                raise ValueError(f"path {path} must be a non-empty tuple of ranks >= 0")
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"path {path}: probability {v} is not in [0, 1]")
            if len(path) > 1 and path[:-1] not in probs:
                raise ValueError(f"path {path} is given but its parent {path[:-1]} is not")
            if len(path) > 1 and v > probs[path[:-1]]:
                raise ValueError(f"path {path} is more probable ({v}) than its parent "
                                 f"{path[:-1]} ({probs[path[:-1]]}): a path is only kept "
                                 "when its parent is")
        if len(probs) < num_drafts:
            raise ValueError(f"{num_drafts} drafts asked, but only {len(probs)} paths given")
        ordered = sorted(probs, key=lambda p: (-probs[p], len(p), p))
        return cls(ordered[:num_drafts])


@dataclass(frozen=True)
class TreeChoice:
    """One static tree for greedy requests and one for sampled ones: a head's best trees of
    one size (``drafters.head_trees``), which differ because a greedy step must guess the
    policy's argmax and a sampled one its draw. Each request verifies the tree of its kind
    (:meth:`for_request`), at that tree's depth."""

    greedy: DraftTree
    sampled: DraftTree
    num_drafts: int  # drafts per tree (nodes less the root), the size that picked them

    def __post_init__(self) -> None:
        for kind in ("greedy", "sampled"):
            tree = getattr(self, kind)
            if not isinstance(tree, DraftTree):
                raise ValueError(f"TreeChoice.{kind} must be a DraftTree, got "
                                 f"{type(tree).__name__}")
            if tree.num_nodes - 1 != self.num_drafts:
                raise ValueError(f"TreeChoice.{kind} has {tree.num_nodes - 1} drafts, not "
                                 f"num_drafts={self.num_drafts}")

    def for_request(self, greedy: bool) -> DraftTree:
        return self.greedy if greedy else self.sampled

    @property
    def max_depth(self) -> int:
        return max(self.greedy.max_depth, self.sampled.max_depth)

    @property
    def num_nodes(self) -> int:
        return max(self.greedy.num_nodes, self.sampled.num_nodes)

    def __repr__(self) -> str:
        return f"TreeChoice(num_drafts={self.num_drafts}, greedy={self.greedy}, " \
               f"sampled={self.sampled})"


#: What a ``tree=`` argument may be: a tree's paths, a :class:`DraftTree`, a
#: :class:`TreeChoice`, an int (the draft's own trees of that many drafts, ``HEAD_DIR/
#: trees.json``), or None (a chain of k drafts).
TreeArg = Sequence[Sequence[int]] | DraftTree | TreeChoice | int | None
