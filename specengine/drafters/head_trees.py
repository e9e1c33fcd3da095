"""The static draft trees a trained EAGLE-3 head ships with: ``HEAD_DIR/trees.json``.

``train-draft`` measures, after training, which trees of 4 to 32 drafts keep the most tokens
per step with this head (``train/trees.py`` writes the file) and keeps two kinds: ``greedy``
trees guess the policy's argmax, ``sampled`` ones its draw. A head's trees are what
``SpecEngine.generate(prompts, tree=16)`` and ``specengine serve --tree 16`` verify (SGLang's
``--speculative-num-draft-tokens``): each request the tree of its kind, at that tree's depth.

The file is read and checked whole when the engine loads the head: a malformed file is an
error then, naming the file and what is wrong, never later inside a step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specengine.tree import DraftTree, TreeChoice

TREES_FILE = "trees.json"
KINDS = ("greedy", "sampled")


@dataclass(frozen=True)
class HeadTrees:
    """A head's trees by kind and number of drafts (``trees.json``'s ``"trees"``)."""

    path: Path  # the file they were read from (for messages)
    trees: Mapping[str, Mapping[int, DraftTree]]  # kind -> drafts -> tree

    def __post_init__(self) -> None:
        if set(self.trees) != set(KINDS):
            raise ValueError(f"{self.path}: 'trees' must have the kinds {list(KINDS)}, got "
                             f"{sorted(self.trees)}")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The numbers of drafts with a tree of both kinds."""
        return tuple(sorted(set(self.trees["greedy"]) & set(self.trees["sampled"])))

    def choice(self, num_drafts: object) -> TreeChoice:
        """The greedy and the sampled tree of ``num_drafts`` drafts."""
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
            raise ValueError(f"tree: an int number of drafts picks one of the draft's own "
                             f"trees, got {num_drafts!r}")
        if num_drafts not in self.sizes:
            raise ValueError(f"tree={num_drafts}: {self.path} has trees of "
                             f"{list(self.sizes)} drafts")
        return TreeChoice(self.trees["greedy"][num_drafts], self.trees["sampled"][num_drafts],
                          num_drafts)

    def paths(self, kind: str, num_drafts: int) -> list[tuple[int, ...]]:
        """The ``kind`` ("greedy" or "sampled") tree of ``num_drafts`` drafts, as paths."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        tree = self.trees[kind].get(num_drafts)
        if tree is None:
            raise ValueError(f"{self.path}: no {kind} tree of {num_drafts} drafts; it has "
                             f"{sorted(self.trees[kind])}")
        return list(tree.paths)

    @classmethod
    def load(cls, head_dir: str | Path) -> HeadTrees:
        """Read ``head_dir/trees.json``; ``ValueError`` naming the file when it is missing or
        malformed (a tree that is not prefix-closed, a size that is not its number of
        drafts...)."""
        path = Path(head_dir) / TREES_FILE
        if not path.is_file():
            raise ValueError(f"{path}: no such file (train-draft writes it next to the head "
                             "it trains)")
        try:
            doc: Any = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not readable JSON: {e}") from None
        raw = doc.get("trees") if isinstance(doc, dict) else None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: no 'trees' object (kind -> drafts -> paths)")
        trees: dict[str, dict[int, DraftTree]] = {}
        for kind, by_size in raw.items():
            if kind not in KINDS or not isinstance(by_size, dict):
                raise ValueError(f"{path}: 'trees' holds kinds {list(KINDS)}, each an object "
                                 f"of drafts -> paths; got {kind!r}")
            trees[kind] = {}
            for size, paths in by_size.items():
                where = f"{path}: the {kind} tree of {size!r} drafts"
                if not (isinstance(size, str) and size.isdigit()):
                    raise ValueError(f"{where}: the key must be its number of drafts")
                if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
                    raise ValueError(f"{where}: must be a list of paths (lists of ranks)")
                try:
                    tree = DraftTree(paths)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{where}: {e}") from None
                if tree.num_nodes - 1 != int(size):
                    raise ValueError(f"{where} has {tree.num_nodes - 1} paths")
                trees[kind][int(size)] = tree
        return cls(path, trees)


def load_head_trees(draft: object) -> HeadTrees | None:
    """The trees of the engine's ``draft`` when it is a head directory with ``trees.json``
    (a file there is read and checked now); None otherwise (no trees to pick from)."""
    if not isinstance(draft, (str, Path)) or not (Path(draft) / TREES_FILE).is_file():
        return None
    return HeadTrees.load(draft)
