"""Drafters: EAGLE-3 head, small LM, MTP layers, n-gram, suffix (group-aware), hybrids."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from specengine.core.step_types import DraftProposal
from specengine.drafters.base import Drafter
from specengine.drafters.context import DraftContext

__all__ = ["DraftContext", "Drafter", "DraftProposal", "make_drafter"]


def make_drafter(draft: str | tuple[str, str] | None, ctx: DraftContext) -> Drafter | None:
    """``None`` → no drafter; ``"ngram"`` → n-gram lookup; ``"suffix"`` → the group-aware
    suffix drafter (completions of the same prompt); ``"mtp"`` → the target checkpoint's
    MTP layers; a directory → an EAGLE-3 head (its config has ``draft_vocab_size`` or an Eagle3
    architecture), else a small LM with the target's vocabulary; a pair ``(drafter,
    "suffix")`` → both, each sequence verifying the proposal expected to keep more
    (``hybrid.py``). ``ctx.config.draft_options`` (e.g. ``{"sample": True}``) are passed to
    the drafter's constructor as keywords (in a pair: ``suffix_*`` ones to the suffix
    drafter, the rest to the other)."""
    if draft is None:
        return None
    opts = dict(ctx.config.draft_options)
    if isinstance(draft, (tuple, list)):
        return _make_hybrid(tuple(draft), opts, ctx)
    if draft == "suffix":
        from specengine.drafters.suffix import SuffixDrafter

        suffix = _construct(SuffixDrafter, opts)
        suffix.device = ctx.device  # type: ignore[attr-defined]
        return suffix
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
                         "'suffix', 'mtp', a checkpoint dir or (dir, 'suffix'))")
    if not path.is_dir():
        raise ValueError(f"draft {draft!r} is not a directory (a draft is None, 'ngram', "
                         "'suffix', 'mtp', a checkpoint dir or (dir, 'suffix'))")
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


def _make_hybrid(draft: tuple[object, ...], opts: dict[str, object],
                 ctx: DraftContext) -> Drafter:
    """``(drafter, "suffix")`` (either order): the hybrid of the two."""
    from dataclasses import replace

    from specengine.drafters.hybrid import HybridDrafter
    from specengine.drafters.suffix import SuffixDrafter

    others = [d for d in draft if d != "suffix"]
    if len(draft) != 2 or len(others) != 1 or not isinstance(others[0], (str, Path)):
        raise ValueError(f"a draft pair is (drafter, 'suffix'): one drafter ('ngram', 'mtp' "
                         f"or a checkpoint dir) and 'suffix', got {draft!r}")
    suffix_opts = {k: v for k, v in opts.items() if k.startswith("suffix_")}
    rest = tuple((k, v) for k, v in sorted(opts.items()) if not k.startswith("suffix_"))
    neural = make_drafter(str(others[0]), replace(ctx, config=replace(ctx.config,
                                                                       draft_options=rest)))
    assert neural is not None
    suffix = _construct(SuffixDrafter, suffix_opts)
    suffix.device = ctx.device  # type: ignore[attr-defined]
    return HybridDrafter(neural, suffix)  # type: ignore[arg-type]


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
