"""Per-row sampling tensors → the fused rejection sampler (reference or Triton kernel).

Plain decoding (k = 0) goes through the same sampler with zero drafts: one code path, so the
k = 0 baseline and speculative steps sample with the same rules and the same random streams.
The four outputs travel to the host as one packed tensor (:func:`pack` / :class:`StepResult`):
the decode step's only device→host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specengine.core.chain_sampler import sampled_chain_sample
from specengine.core.greedy_sampler import greedy_chain_sample
from specengine.core.sequence import Sequence
from specengine.core.transfer import to_device


@dataclass(frozen=True)
class SamplingTensors:
    """Each row's sampling parameters on the device, all ``[B]``."""

    temperature: Tensor  # float32, 0 = greedy
    top_k: Tensor  # int, <= 0 = off
    top_p: Tensor  # float32
    seeds: Tensor  # int64
    # Random numbers are keyed by (seed, position of the first token this step emits), so a
    # request's draws never depend on its batch, on padding, on preemption or on earlier steps.
    offsets: Tensor  # int64
    log_min_p: Tensor | None = None  # float32 log(min_p), -inf = off; None: off for all

    @classmethod
    def from_seqs(cls, seqs: tuple[Sequence, ...], device: torch.device) -> SamplingTensors:
        """Built from the sequences with non-blocking copies (prefill; the decode step reads
        the persistent batch state instead)."""
        p = [s.params for s in seqs]
        return cls(
            temperature=to_device(np.array([x.temperature for x in p], np.float32), device),
            top_k=to_device(np.array([x.top_k for x in p], np.int64), device),
            top_p=to_device(np.array([x.top_p for x in p], np.float32), device),
            seeds=to_device(np.array([s.seed for s in seqs], np.int64), device),
            offsets=to_device(np.array([len(s) for s in seqs], np.int64), device),
            log_min_p=to_device(np.array([np.log(np.float32(x.min_p)) if x.min_p > 0
                                          else -np.inf for x in p], np.float32), device),
        )


@dataclass(frozen=True)
class SamplerOutput:
    output_ids: Tensor  # [B, N] int64, -1 padded
    num_accepted: Tensor  # [B] int32 accepted drafts (emitted = num_accepted + 1)
    logprobs: Tensor  # [B, N] float32
    row_ids: Tensor  # [B, N] int32: logits row (tree node) each emitted token was judged at

    def pack(self) -> Tensor:
        """``[B, 3N + 1]`` float64 (ids and logprobs are exact in float64): one copy."""
        return torch.cat([self.output_ids.double(), self.logprobs.double(),
                          self.row_ids.double(), self.num_accepted.double()[:, None]], dim=1)


@dataclass(frozen=True)
class StepResult:
    """A packed :class:`SamplerOutput` on the host, rows ``0 .. B-1``."""

    output_ids: np.ndarray  # [B, N] int64
    logprobs: np.ndarray  # [B, N] float64
    row_ids: np.ndarray  # [B, N] int64
    num_accepted: np.ndarray  # [B] int64

    @classmethod
    def unpack(cls, host: np.ndarray, num_rows: int) -> StepResult:
        n = (host.shape[1] - 1) // 3
        h = host[:num_rows]
        return cls(h[:, :n].astype(np.int64), h[:, n:2 * n], h[:, 2 * n:3 * n].astype(np.int64),
                   h[:, 3 * n].astype(np.int64))


class Sampler:
    def __init__(self, kernel_backend: str, device: torch.device) -> None:
        self.kernel_backend = kernel_backend
        self.device = device
        #: chains on the CPU take ``greedy_chain_sample`` (all rows greedy) or
        #: ``sampled_chain_sample`` (choices and row subsets read from the rows' values on the
        #: host: off for passes that are captured, ``core.graphs``)
        self.cpu_fast_paths = True

    def __call__(
        self,
        target_logits: Tensor,  # [B, N, V]
        draft_token_ids: Tensor,  # [B, N-1] int64
        num_draft_tokens: Tensor,  # [B] int
        draft_probs: Tensor | None,  # [B, N-1, V] or None (point-mass drafts)
        tree_parents: Tensor | None,  # [N] int32 or None (chains)
        params: SamplingTensors,
        draft_index: Tensor | None = None,  # [V] int32: draft_probs over a draft vocabulary
    ) -> SamplerOutput:
        if (self.cpu_fast_paths and self.kernel_backend == "torch" and tree_parents is None
                and target_logits.device.type == "cpu"):
            # Reading the rows' values is a memory read here, not a device sync (CPU only).
            if not params.temperature.numpy().any():
                # All rows greedy: the same outputs in ~20 whole-batch operators instead of
                # the reference's general race (greedy_sampler's docstring).
                return SamplerOutput(*greedy_chain_sample(target_logits, draft_token_ids,
                                                          num_draft_tokens))
            # Sampled rows: the reference's outputs with one race per row and no sort unless
            # a row filters (top-k / top-p / min-p; chain_sampler's docstring).
            return SamplerOutput(*sampled_chain_sample(
                target_logits, draft_token_ids, num_draft_tokens, draft_probs,
                params.temperature, params.top_k, params.top_p, params.seeds, params.offsets,
                params.log_min_p, draft_index))
        if self.kernel_backend == "torch":
            from specengine.kernels.reference import rejection_sample
        else:
            from specengine.kernels.rejection_sampling import rejection_sample
        out = rejection_sample(target_logits, draft_token_ids, num_draft_tokens, draft_probs,
                               params.temperature, params.top_k, params.top_p, params.seeds,
                               params.offsets, tree_parents, params.log_min_p,
                               draft_index=draft_index)
        return SamplerOutput(*out)
