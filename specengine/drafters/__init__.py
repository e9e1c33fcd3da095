"""Drafters: EAGLE-3 head, small LM, MTP layers, n-gram."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from specengine.drafters.base import Drafter, DraftProposal
from specengine.drafters.context import DraftContext

__all__ = ["DraftContext", "Drafter", "DraftProposal", "make_drafter"]


def make_drafter(draft: str | None, ctx: DraftContext) -> Drafter | None:
    """``None`` → no drafter; ``"ngram"`` → n-gram lookup; ``"mtp"`` → the target checkpoint's
    MTP layers; a directory → an EAGLE-3 head (its config has ``draft_vocab_size`` or an Eagle3
    architecture), else a small LM with the target's vocabulary. ``ctx.config.draft_options``
    (e.g. ``{"sample": True}``) are passed to the drafter's constructor as keywords."""
    if draft is None:
        return None
    opts = dict(ctx.config.draft_options)
    if draft == "ngram":
        from specengine.drafters.ngram import NgramDrafter

        ngram = _construct(NgramDrafter, opts)
        ngram.device = ctx.device  # type: ignore[attr-defined]
        return ngram
    if draft == "mtp":
        from specengine.drafters.mtp import MTPDrafter

        return _construct(MTPDrafter, opts, ctx)
    path = Path(draft)
    if not path.exists():
        raise ValueError(f"draft {draft!r}: no such directory (a draft is None, 'ngram', "
                         "'mtp' or a checkpoint dir)")
    if not path.is_dir():
        raise ValueError(f"draft {draft!r} is not a directory (a draft is None, 'ngram', "
                         "'mtp' or a checkpoint dir)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"draft dir {draft} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    if "draft_vocab_size" in cfg or any("eagle" in a.lower() for a in archs):
        from specengine.drafters.eagle3 import Eagle3Drafter

        return _construct(Eagle3Drafter, opts, path, ctx)
    from specengine.drafters.draft_model import DraftModelDrafter

    return _construct(DraftModelDrafter, opts, path, ctx)


def _construct(cls: type[Drafter], opts: dict[str, object], *args: object) -> Drafter:
    """``cls(*args, **opts)``, refusing options the drafter does not take with a clear error
    (instead of a ``TypeError`` from inside the constructor)."""
    params = inspect.signature(cls.__init__).parameters
    known = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY or
             (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ValueError(f"draft_options {unknown} are not options of the {cls.__name__} "
                         f"drafter (it takes: {known or 'none'})")
    return cls(*args, **opts)
