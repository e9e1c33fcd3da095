"""Checks shared by the draft-training tests (EAGLE-3 and MTP heads)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from specengine import SamplingParams, SpecEngine
from specengine.drafters.feature_drafter import FeatureState


def greedy_acceptance(model: Path | str, draft: str, prompts: Sequence[list[int]],
                      sampling: SamplingParams) -> tuple[float, list, list]:
    """Greedy k=3 of ``model`` with ``draft``: accepted / drafted, the k=3 and k=0 outputs."""
    engine = SpecEngine(model, draft=draft, device="cpu", max_model_len=128,
                        kv_cache_tokens=4096)
    base = engine.generate(prompts, k=0, sampling=sampling)
    outs = engine.generate(prompts, k=3, sampling=sampling)
    st = engine.stats
    return st.num_accepted_tokens / st.num_draft_tokens, outs, base


def assert_unroll_is_paged_drafting(d, seq, unrolled: list, logits: Callable) -> None:
    """Depth-d logits of anchors i (the prompt's last, and 4 before the end) from the loss's
    unrolled maths equal the drafter ``d``'s own paged passes: entries 0..i from the target's
    features, then d chain entries from its outputs; ``logits`` maps ``g`` to its logits."""
    ad = d.adapter
    tok = ad.buffer.tokens[seq.rows]
    for i in (seq.num_prompt_tokens - 1, len(seq.rows) - 4):
        st = FeatureState()
        d.kv_cache.ensure(st, i + 3)
        g = d._forward([st], [0], tok[: i + 1], ad.buffer.feats[seq.rows[: i + 1]],
                       [np.arange(i + 1)])[i:]
        for depth in range(3):
            if depth:
                g = d._forward([st], [i + depth], tok[i + depth: i + depth + 1], g,
                               [np.array([i + depth])])
            torch.testing.assert_close(unrolled[depth][0, i], logits(g)[0],
                                       atol=1e-4, rtol=1e-4)
        d.kv_cache.free(st)
