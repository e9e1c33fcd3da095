"""Batch sampling parameters → the fused rejection sampler (reference or Triton kernel).

Plain decoding (k = 0) goes through the same sampler with zero drafts: one code path, so the
k = 0 baseline and speculative steps sample with the same rules and the same random streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specengine.sequence import Sequence


@dataclass(frozen=True)
class SamplerOutput:
    output_ids: Tensor  # [B, N] int64, -1 padded
    num_accepted: Tensor  # [B] int32 accepted drafts (emitted = num_accepted + 1)
    logprobs: Tensor  # [B, N] float32
    row_ids: Tensor  # [B, N] int32: logits row (tree node) each emitted token was judged at


class Sampler:
    def __init__(self, kernel_backend: str, device: torch.device) -> None:
        self.kernel_backend = kernel_backend
        self.device = device

    def __call__(
        self,
        seqs: tuple[Sequence, ...],
        target_logits: Tensor,  # [B, N, V] float32
        draft_token_ids: Tensor,  # [B, N-1] int64
        num_draft_tokens: Tensor,  # [B] int32
        draft_probs: Tensor | None,  # [B, N-1, V] or None (point-mass drafts)
        tree_parents: Tensor | None,  # [N] int32 or None (chains)
    ) -> SamplerOutput:
        dev = self.device
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32,
                                   device=dev)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.int32, device=dev)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=dev)
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        # Random numbers are keyed by (seed, position of the first token this step emits), so
        # a request's draws never depend on its batch, on preemption or on earlier steps.
        offsets = torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=dev)
        if self.kernel_backend == "torch":
            from specengine.kernels.reference import rejection_sample
        else:
            from specengine.kernels.rejection_sampling import rejection_sample
        out = rejection_sample(target_logits, draft_token_ids, num_draft_tokens, draft_probs,
                               temperature, top_k, top_p, seeds, offsets, tree_parents)
        return SamplerOutput(*out)
