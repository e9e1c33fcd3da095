"""Expert-load counters of a MoE model (docs/design.md §3 ``engine.stats``, §21).

A MoE layer's pass reads the weights of the distinct experts its tokens route to: one token
reads ``top_k`` of them, a verify pass of ``k + 1`` tokens per sequence more (under uniform
routing ``E·(1 − (1 − top_k/E)^n)``, ``core.cost_model.expected_distinct_experts``). These
counters measure it: per pass kind (prefill, 1-token decode, verify) and summed over the MoE
layers, the layer passes, the distinct experts each touched and the real tokens each saw.

Counting adds no host sync to a step: it is a few device ops on the routing (the top-k of the
router logits the fused MoE routes by), accumulated into one static device tensor, so a
captured decode or verify graph counts on every replay; the host reads it once, when stats are
asked for. Padded rows of a static pass (``slot_mapping < 0``: inactive, no KV write) do not
count.
"""

from __future__ import annotations

import torch
from torch import Tensor

PREFILL, DECODE, VERIFY = 0, 1, 2
KINDS = ("prefill", "decode", "verify")
#: columns of ``ExpertLoad.counts``
LAYER_PASSES, EXPERTS, TOKENS = 0, 1, 2


class ExpertLoad:
    """``counts [3 kinds, 3]`` (int64, on the model's device): per kind the MoE layer passes,
    the distinct experts they touched (summed) and the real tokens they routed (summed).

    The model's forward sets :attr:`rows` (the pass's ``slot_mapping``) and :attr:`kind` (from
    :attr:`prefill`, set by the engine around its prompt pass, else from the pass's query
    length: 1 → decode, more → verify; a captured graph keeps the kind of its shape)."""

    def __init__(self, device: torch.device | str) -> None:
        self.counts = torch.zeros(len(KINDS), 3, dtype=torch.int64, device=device)
        self.prefill = False
        self.kind = DECODE
        self.rows: Tensor | None = None

    def begin_pass(self, slot_mapping: Tensor, max_q_len: int) -> None:
        self.rows = slot_mapping
        self.kind = PREFILL if self.prefill else (DECODE if max_q_len <= 1 else VERIFY)

    def count(self, router_logits: Tensor, top_k: int) -> None:
        """Count one MoE layer's pass from its router logits ``[T, E]`` (the top-k of the
        logits is the top-k of their softmax: the experts the fused MoE runs)."""
        num_tokens, num_experts = router_logits.shape
        ids = router_logits.topk(top_k, dim=-1).indices  # [T, k]
        hit = torch.zeros(num_tokens, num_experts, dtype=torch.int64,
                          device=router_logits.device)
        hit.scatter_(1, ids, 1)
        row = self.counts[self.kind]
        if self.rows is not None and self.rows.shape[0] == num_tokens:
            real = (self.rows >= 0).to(torch.int64)
            hit *= real[:, None]
            row[TOKENS] += real.sum()
        else:  # a python scalar: no host-to-device copy (a copy would sync, and not capture)
            row[TOKENS] += num_tokens
        row[LAYER_PASSES] += 1
        row[EXPERTS] += (hit.amax(dim=0) > 0).sum()

    def reset(self) -> None:
        self.counts.zero_()


def enable_expert_load(model: torch.nn.Module, device: torch.device | str
                       ) -> ExpertLoad | None:
    """An :class:`ExpertLoad` attached to every MoE block of ``model`` and to the model (its
    ``expert_load``), or None for a model without MoE layers."""
    from specengine.model.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    load = ExpertLoad(device)
    for block in blocks:
        block.expert_load = load
    model.expert_load = load
    return load


__all__ = ["DECODE", "KINDS", "PREFILL", "VERIFY", "ExpertLoad", "enable_expert_load"]
