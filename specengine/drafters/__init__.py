"""Drafters: EAGLE-3 head, small LM, MTP layers, n-gram."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from specengine.drafters.base import Drafter, DraftProposal

if TYPE_CHECKING:
    from specengine.engine import SpecEngine

__all__ = ["Drafter", "DraftProposal", "make_drafter"]


def make_drafter(draft: str | None, engine: SpecEngine) -> Drafter | None:
    """``None`` → no drafter; ``"ngram"`` → n-gram lookup; ``"mtp"`` → the target checkpoint's
    MTP layers; a directory → an EAGLE-3 head (its config has ``draft_vocab_size`` or an Eagle3
    architecture), else a small LM with the target's vocabulary. ``engine.config.draft_options``
    (e.g. ``{"sample": True}``) are passed to the drafter's constructor as keywords."""
    if draft is None:
        return None
    opts = dict(getattr(engine.config, "draft_options", None) or ())
    if draft == "ngram":
        from specengine.drafters.ngram import NgramDrafter

        return NgramDrafter(**opts)
    if draft == "mtp":
        from specengine.drafters.mtp import MTPDrafter

        return MTPDrafter(engine, **opts)
    path = Path(draft)
    if not path.is_dir():
        raise ValueError(f"unknown drafter {draft!r}: expected None, 'ngram', 'mtp' or a "
                         "checkpoint dir")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"draft dir {draft} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    if "draft_vocab_size" in cfg or any("eagle" in a.lower() for a in archs):
        from specengine.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(path, engine, **opts)
    from specengine.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(path, engine, **opts)
