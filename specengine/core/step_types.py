"""The data a decode step passes between the engine core and its drafter (docs/design.md §2,
§7): what a drafter proposes (:class:`DraftProposal`, over its own :class:`DraftVocab`), and
what it reads back after a target pass (:class:`ForwardOutput` of a ragged pass,
:class:`VerifyOutput` of a static verify pass of a :class:`VerifyShape`). Data only: the core
and the drafters both import it, and it imports neither."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.core.sampler import SamplerOutput


@dataclass(frozen=True)
class DraftVocab:
    """A drafter's own (reduced) vocabulary, e.g. an EAGLE-3 head's 32k of a 152k target's:
    column ``d`` of its distributions is target token ``to_target[d]``; target token ``t`` is
    column ``to_draft[t]``, or -1 where the drafter has no id for it (draft probability 0).
    The tensors are the drafter's own buffers, rewritten in place by a weight update (a
    captured pass keeps reading them)."""

    to_target: Tensor  # [Vd] int64
    to_draft: Tensor  # [V] int32

    def __post_init__(self) -> None:
        if self.to_target.dim() != 1 or self.to_draft.dim() != 1 or \
                self.to_target.dtype != torch.int64 or self.to_draft.dtype != torch.int32:
            raise ValueError("DraftVocab needs to_target [Vd] int64 and to_draft [V] int32")

    @property
    def size(self) -> int:
        return self.to_target.shape[0]


@dataclass(frozen=True)
class DraftProposal:
    """Drafts for one step. Chains: ``token_ids[b, :num_draft_tokens[b]]`` are sequence b's
    drafts. Trees: ``token_ids[b, i-1]`` is the token of tree node i (every node filled)."""

    token_ids: Tensor  # [B, N-1] int64, on the engine's device
    num_draft_tokens: np.ndarray  # [B] int: host data (the step plans with it, no sync)
    # [B, N-1, V] float32 draft distributions ([B, N-1, Vd] over the drafter's ``draft_vocab``
    # when it has one), or None for point masses
    probs: Tensor | None
    # Every row drafted exactly what ``propose`` asked (the step then skips comparing counts)
    as_asked: bool = False
    # The drafts were written straight into the verify pass's draft buffer (a static draft
    # pass): the step loads nothing
    in_place: bool = False


@dataclass(frozen=True)
class ForwardOutput:
    """A ragged pass. ``qo_indptr[b]`` is the row of sequence b's first fed token (for a
    group sample that borrowed a sibling's prefill: the sibling's); ``fed_rows[b]`` are its
    rows relative to that, one per fed position (the prefill's ``accepted_rows``)."""

    hidden: Tensor  # [T, H] final-norm hidden states of every fed token
    aux_hidden: list[Tensor]  # inputs of the requested layers, each [T, H]
    qo_indptr: list[int]  # token range of each sequence in the ragged batch
    fed_rows: list[list[int]] | None = None


@dataclass(frozen=True)
class VerifyShape:
    """What a verify pass's buffers and graph depend on."""

    num_rows: int  # padded batch (a bucket) or the exact batch
    num_tokens: int  # N fed per row
    tree: DraftTree | None
    has_probs: bool  # sampled drafts carry their distributions
    masks_stops: bool = False  # some row is under its min_tokens (``mask_stop_ids``)
    top_logprobs: bool = False  # some row asks for top-N logprobs (``top_logprobs``)

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.num_tokens < 1:
            raise ValueError(f"VerifyShape needs rows and tokens >= 1, got {self}")
        if self.tree is not None and self.tree.num_nodes != self.num_tokens:
            raise ValueError(f"a tree of {self.tree.num_nodes} nodes feeds {self.tree.num_nodes}"
                             f" tokens, not {self.num_tokens}")

    @functools.cached_property
    def key(self) -> tuple[int, int, tuple | None, bool]:
        """What a pass of this shape is keyed by (graphs, constants); made once per object."""
        return (self.num_rows, self.num_tokens,
                None if self.tree is None else self.tree.paths, self.has_probs,
                self.masks_stops, self.top_logprobs)

    @functools.cached_property
    def graph_keys(self) -> dict[str, tuple]:
        """``run_graph`` keys of the passes of this shape: verify, and the drafter catch-up
        that reads its outputs."""
        return {kind: (kind, *self.key) for kind in ("verify", "observe")}


@dataclass(frozen=True)
class VerifyOutput:
    packed: Tensor  # [rows, 3N + 1] float64: see SamplerOutput.pack
    hidden: Tensor  # [rows * N, H] final-norm hidden of every fed token
    aux_hidden: list[Tensor]  # [rows * N, H] each: the drafter's target features
    sampled: SamplerOutput  # the same results on the device (a static drafter reads them)
    #: [rows, N, 2 * TOP + 1] float64 with ``shape.top_logprobs`` (see ``top_logprobs``)
    top: Tensor | None = None


def forward_output(out: VerifyOutput, num_rows: int, num_tokens: int) -> ForwardOutput:
    """What a drafter's ``observe`` reads: row ``b``'s fed tokens are ``b*N .. b*N + N-1``."""
    return ForwardOutput(out.hidden, out.aux_hidden,
                         list(range(0, (num_rows + 1) * num_tokens, num_tokens)))


__all__ = ["DraftProposal", "DraftVocab", "ForwardOutput", "VerifyOutput", "VerifyShape",
           "forward_output"]
